//! `npm-agent explain`: why a flow is allowed or denied on this node, as
//! the agent sees it and as the kernel does.
//!
//! The agent serves `GET /explain?from=…&to=…&port=…&protocol=…` on its
//! metrics listener, read-only ([`handler`]); `npm-agent explain --agent
//! http://HOST:PORT …` asks it ([`client`]). For each direction whose
//! endpoint is local to this node (the sender's egress, the receiver's
//! ingress) the answer gives:
//!
//! - the agent's view: the state the sync loop last programmed
//!   ([`programmed`]: the compiled state exactly as written, with its ids,
//!   and the snapshot it came from, copied by the sync loop when asked;
//!   nothing is compiled per request)
//!   decided by `npm_policy::lookup::lookup`, with the deciding rule by
//!   name (NetworkPolicy `namespace/name` and rule index, or the
//!   ClusterNetworkPolicy's tier, name and rule index, an Admin `Pass`
//!   included) and, when nothing allows it, the policies that isolate the
//!   pod (from the reference evaluator, `npm_policy::evaluate`);
//! - the kernel's verdict: on eBPF the program attached to that hook run
//!   once as a dry run over a crafted packet against the live maps
//!   ([`npm_dataplane::ebpf::explain`]: no conntrack entry, no cache fill,
//!   no counter, no event); on nftables `null` (the ruleset has no test
//!   mode: a packet would have to be sent).
//!
//! A change the sync loop has not programmed yet (the debounce, a held
//! removal, a failed apply) is not in the agent's view: explain says what
//! the agent believes the kernel holds. When the two views disagree the mismatch is printed first and counted
//! (`npm_explain_mismatch_total`). A kernel verdict from a tracked flow
//! (UDP or SCTP packets of an existing connection) is shown but not
//! compared: policy decides new connections only.

pub mod client;
pub mod observe_client;
pub mod programmed;
mod report;

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

pub use programmed::{Programmed, ProgrammedView, ViewError};
pub use report::{explain, DirectionReport, ExplainReport, KernelReport, PolicyRef};

use crate::telemetry::ServerState;

/// Errors of an explain request (each a 4xx or 503 answer).
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// An endpoint argument is neither `NS/POD` nor an address.
    #[error("{arg}: {value:?} is neither NAMESPACE/POD nor an IP address")]
    BadEndpoint {
        /// `from` or `to`.
        arg: &'static str,
        /// The value.
        value: String,
    },
    /// No pod of that name (or it has no address of the family).
    #[error("{arg}: pod {pod} not found or without an address")]
    NoPod {
        /// `from` or `to`.
        arg: &'static str,
        /// `namespace/name`.
        pod: String,
    },
    /// A protocol other than TCP, UDP, SCTP.
    #[error("protocol {0:?}: want TCP, UDP or SCTP")]
    Protocol(String),
    /// Addresses of two families.
    #[error("from {0} and to {1} are of different address families")]
    Family(IpAddr, IpAddr),
    /// The programmed state cannot be read now.
    #[error(transparent)]
    View(#[from] programmed::ViewError),
    /// The agent was started without explain support.
    #[error("explain is not configured in this agent")]
    NotConfigured,
}

/// Which kernel view explain asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KernelView {
    /// The eBPF dataplane pinned under this directory.
    Ebpf {
        /// The pin directory.
        pin_dir: PathBuf,
    },
    /// The nftables dataplane: no kernel verdict (`null`).
    Nftables,
}

/// What explain needs besides the programmed state: this node and the
/// kernel view.
#[derive(Clone, Debug)]
pub struct ExplainConfig {
    /// This node's name.
    pub node_name: String,
    /// The kernel view.
    pub kernel: KernelView,
}

/// The query of `GET /explain`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExplainQuery {
    /// `NAMESPACE/POD` or an address.
    pub from: String,
    /// `NAMESPACE/POD` or an address.
    pub to: String,
    /// Destination port.
    pub port: u16,
    /// `TCP` (default), `UDP` or `SCTP`.
    #[serde(default)]
    pub protocol: Option<String>,
}

impl ExplainQuery {
    /// The request path of this query (`/explain?from=…&to=…&port=…`,
    /// percent-encoded), as [`parse_query`] reads it back.
    pub fn path(&self) -> String {
        let enc = client::encode;
        let mut path = format!(
            "/explain?from={}&to={}&port={}",
            enc(&self.from),
            enc(&self.to),
            self.port
        );
        if let Some(p) = &self.protocol {
            path.push_str(&format!("&protocol={}", enc(p)));
        }
        path
    }
}

/// How long `/explain` waits for the sync loop's copy of what it programmed.
pub const VIEW_WAIT: std::time::Duration = std::time::Duration::from_secs(20);

/// `GET /explain`: the [`ExplainReport`] as JSON; 400 for a bad query,
/// 503 before the first sync, after a failed one, or when the sync loop
/// does not hand over its state within [`VIEW_WAIT`].
pub async fn handler(State(s): State<ServerState>, uri: Uri) -> Response {
    let q = match parse_query(uri.query().unwrap_or("")) {
        Ok(q) => q,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    let Some(cfg) = s.metrics.explain_config() else {
        return (StatusCode::SERVICE_UNAVAILABLE, ExplainError::NotConfigured.to_string()).into_response();
    };
    // At most MAX_EXPLAIN answers at once (each may wait for a copy and
    // runs a dry run on a blocking thread); beyond: 429.
    let Ok(_slot) = s.slots.explain.clone().try_acquire_owned() else {
        return crate::telemetry::server::too_many("explain", crate::telemetry::server::MAX_EXPLAIN);
    };
    // At most the sync under way is waited for.
    let programmed = match s.programmed.current(VIEW_WAIT).await {
        Ok(p) => p,
        Err(e) => return (StatusCode::SERVICE_UNAVAILABLE, ExplainError::View(e).to_string()).into_response(),
    };
    let metrics = s.metrics.clone();
    let job = tokio::task::spawn_blocking(move || {
        let r = explain(&cfg, &programmed, &q)?;
        if r.mismatch.is_some() {
            metrics.explain_mismatch.increment(1);
        }
        Ok::<_, ExplainError>(r)
    });
    match job.await {
        Ok(Ok(r)) => match serde_json::to_string(&r) {
            Ok(body) => ([(header::CONTENT_TYPE, "application/json")], body).into_response(),
            Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("explain: {e}")).into_response(),
        },
        Ok(Err(e @ ExplainError::View(_))) => (StatusCode::SERVICE_UNAVAILABLE, e.to_string()).into_response(),
        Ok(Err(e)) => (StatusCode::BAD_REQUEST, e.to_string()).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("explain failed: {e}")).into_response(),
    }
}

/// Decodes a percent-encoded query component (`+` is a space).
pub(crate) fn decode(s: &str) -> Result<String, String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| format!("bad percent-encoding in {s:?}"))?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            c => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| format!("{s:?} is not UTF-8"))
}

/// The [`ExplainQuery`] of a query string (`from`, `to` and `port`
/// required).
pub fn parse_query(query: &str) -> Result<ExplainQuery, String> {
    let (mut from, mut to, mut port, mut protocol) = (None, None, None, None);
    for kv in query.split('&').filter(|kv| !kv.is_empty()) {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        let v = decode(v)?;
        match k {
            "from" => from = Some(v),
            "to" => to = Some(v),
            "port" => port = Some(v.parse::<u16>().map_err(|_| format!("port {v:?}: want 0 to 65535"))?),
            "protocol" => protocol = Some(v),
            other => return Err(format!("unknown parameter {other:?} (from, to, port, protocol)")),
        }
    }
    Ok(ExplainQuery {
        from: from.ok_or("missing from")?,
        to: to.ok_or("missing to")?,
        port: port.ok_or("missing port")?,
        protocol,
    })
}

/// Shared explain configuration slot (set once by `main`).
pub type ExplainSlot = Arc<std::sync::OnceLock<ExplainConfig>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn queries_parse_or_fail_with_a_reason() {
        let q = parse_query("from=x%2Fa&to=fd00%3A%3A1&port=80&protocol=udp").unwrap();
        assert_eq!((q.from.as_str(), q.to.as_str(), q.port), ("x/a", "fd00::1", 80));
        assert_eq!(q.protocol.as_deref(), Some("udp"));
        assert!(parse_query("from=a&to=b").unwrap_err().contains("port"));
        assert!(parse_query("from=a&to=b&port=70000").unwrap_err().contains("70000"));
        assert!(parse_query("from=a&to=b&port=1&x=1").unwrap_err().contains("unknown"));
        assert!(parse_query("from=%zz&to=b&port=1").unwrap_err().contains("percent"));
        let back = parse_query(q.path().split_once('?').unwrap().1).unwrap();
        assert_eq!(back, q);
    }
}
