//! The `npm-agent observe` command: follows an agent's `/observe` stream
//! (plain HTTP on the metrics listener) and prints each flow record, as one
//! human line ([`render_line`]: verdict, direction, pod, peer, the packet,
//! reason and policies) or as the agent's JSON (`--json`), until it is
//! interrupted. The filters are the server's ([`crate::telemetry::observe`]).
//! A stream that ends, a connection refused, or an agent silent for three
//! keepalive periods is an error naming the agent; records the agent
//! dropped because this client fell behind are reported on stderr.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use serde_json::Value;

use super::client::{agent_addr, encode, ClientError};
use crate::telemetry::observe::KEEPALIVE;

/// Errors of the observe client.
#[derive(Debug, thiserror::Error)]
pub enum ObserveError {
    /// The agent URL is not `http://HOST:PORT`.
    #[error("observe: --agent {0:?}: want http://HOST:PORT")]
    Url(String),
    /// The agent could not be reached.
    #[error(
        "observe: cannot connect to the agent at {addr}: {source} (is it running, and is --agent its metrics address?)"
    )]
    Connect {
        /// The agent's address.
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// Sending or reading failed.
    #[error("observe: talking to the agent at {addr}: {source}")]
    Io {
        /// The agent's address.
        addr: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The agent answered with an error (a bad filter, an old agent).
    #[error("observe: the agent at {addr} answered {status}: {body}")]
    Status {
        /// The agent's address.
        addr: String,
        /// The status line.
        status: String,
        /// The body.
        body: String,
    },
    /// The agent ended the stream.
    #[error("observe: the agent at {addr} closed the stream (stopped or restarted)")]
    Closed {
        /// The agent's address.
        addr: String,
    },
    /// Nothing came, not even a keepalive.
    #[error("observe: nothing from the agent at {addr} for {secs} s, not even a keepalive: connection lost")]
    Silent {
        /// The agent's address.
        addr: String,
        /// How long it was silent.
        secs: u64,
    },
}

/// What to follow: the server-side filters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObserveQuery {
    /// Records whose pod or peer pod is in this namespace.
    pub namespace: Option<String>,
    /// Records whose pod or peer pod is `NAMESPACE/POD`.
    pub pod: Option<String>,
    /// `allow`, `deny` or `would-deny`.
    pub verdict: Option<String>,
}

impl ObserveQuery {
    /// The request path with its query.
    pub fn path(&self) -> String {
        let params: Vec<String> = [
            ("namespace", &self.namespace),
            ("pod", &self.pod),
            ("verdict", &self.verdict),
        ]
        .into_iter()
        .filter_map(|(k, v)| v.as_ref().map(|v| format!("{k}={}", encode(v))))
        .collect();
        if params.is_empty() {
            "/observe".into()
        } else {
            format!("/observe?{}", params.join("&"))
        }
    }
}

fn pod_name(v: &Value) -> Option<String> {
    Some(format!(
        "{}/{}",
        v.get("namespace")?.as_str()?,
        v.get("name")?.as_str()?
    ))
}

fn peer_name(v: &Value) -> String {
    let s = |k: &str| v.get(k).and_then(Value::as_str);
    match s("kind") {
        Some("pod") => pod_name(v).unwrap_or_else(|| "pod/?".into()),
        Some("host") => "host".into(),
        Some("node") => format!("node/{}", s("name").unwrap_or("?")),
        Some("world") => match s("cidr") {
            Some(c) => format!("world/{c}"),
            None => "world".into(),
        },
        _ => "?".into(),
    }
}

/// One human line of a flow record: verdict, direction, the pod and its
/// peer (`<-` into the pod, `->` out of it), the packet, the reason, the
/// ClusterNetworkPolicy rule if any, and the policies isolating the pod.
pub fn render_line(v: &Value) -> String {
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or("?");
    let direction = s("direction");
    let pod = v.get("pod").and_then(pod_name).unwrap_or_else(|| "?".into());
    let peer = v.get("peer").map(peer_name).unwrap_or_else(|| "?".into());
    let arrow = if direction == "ingress" { "<-" } else { "->" };
    let mut line = format!(
        "{:<10} {:<7} {pod} {arrow} {peer} ({} -> {} {}) reason={}",
        s("verdict").to_ascii_uppercase(),
        direction,
        s("src"),
        s("dst"),
        s("protocol"),
        s("reason"),
    );
    if let Some(t) = v.get("tier").and_then(Value::as_str) {
        line.push_str(&format!(" tier={t}"));
    }
    if let Some(c) = v.get("cluster_policy") {
        let name = c.get("name").and_then(Value::as_str).unwrap_or("?");
        let rule = c
            .get("rule")
            .and_then(Value::as_u64)
            .map_or("?".into(), |r| r.to_string());
        line.push_str(&format!(" cnp={name}[{rule}]"));
    }
    let policies: Vec<&str> = v
        .get("policies")
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    if !policies.is_empty() {
        line.push_str(&format!(" policies={}", policies.join(",")));
    }
    line
}

/// A response body: raw (close-delimited) or chunked.
pub(crate) enum Body<R> {
    Raw(R),
    Chunked { r: R, left: usize, done: bool },
}

impl<R> Body<R> {
    /// The body read from `r`, chunked or to the end of the connection.
    pub(crate) fn new(r: R, chunked: bool) -> Self {
        if chunked {
            Body::Chunked {
                r,
                left: 0,
                done: false,
            }
        } else {
            Body::Raw(r)
        }
    }
}

/// Reads an answer's status line and headers from `r`: the status line and
/// whether the body is chunked.
pub(crate) fn read_head<R: BufRead>(r: &mut R) -> std::io::Result<(String, bool)> {
    let mut status = String::new();
    r.read_line(&mut status)?;
    let mut chunked = false;
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        let (k, v) = h.split_once(':').unwrap_or((&h, ""));
        if k.trim().eq_ignore_ascii_case("transfer-encoding") && v.to_ascii_lowercase().contains("chunked") {
            chunked = true;
        }
    }
    Ok((status.trim().to_string(), chunked))
}

impl<R: BufRead> Read for Body<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Body::Raw(r) => r.read(buf),
            Body::Chunked { r, left, done } => {
                while *left == 0 {
                    if *done {
                        return Ok(0);
                    }
                    let mut size = String::new();
                    if r.read_line(&mut size)? == 0 {
                        return Ok(0);
                    }
                    let size = size.trim();
                    if size.is_empty() {
                        // The CRLF after a chunk's data.
                        continue;
                    }
                    let hex = size.split(';').next().unwrap_or("");
                    *left = usize::from_str_radix(hex, 16).map_err(|_| {
                        std::io::Error::new(std::io::ErrorKind::InvalidData, format!("bad chunk size {size:?}"))
                    })?;
                    *done = *left == 0;
                }
                let want = buf.len().min(*left);
                let n = r.read(&mut buf[..want])?;
                if n == 0 {
                    return Ok(0);
                }
                *left -= n;
                Ok(n)
            }
        }
    }
}

/// Follows the agent at `agent` (`http://HOST:PORT`): prints each record
/// of `q` to `out` (JSON lines with `json`, else [`render_line`]) and
/// notes (subscribed, records lost) to `notes`. Returns only on an error;
/// `Ok` when `out` is closed (a pipe whose reader left).
pub fn follow(
    agent: &str,
    q: &ObserveQuery,
    json: bool,
    out: &mut dyn Write,
    notes: &mut dyn Write,
) -> Result<(), ObserveError> {
    let addr = agent_addr(agent).map_err(|e| match e {
        ClientError::Url(u) => ObserveError::Url(u),
        other => ObserveError::Url(other.to_string()),
    })?;
    let s = TcpStream::connect(&addr).map_err(|source| ObserveError::Connect {
        addr: addr.clone(),
        source,
    })?;
    // An agent silent for three keepalive periods is lost.
    s.set_read_timeout(Some(KEEPALIVE * 3))
        .map_err(|source| ObserveError::Io {
            addr: addr.clone(),
            source,
        })?;
    follow_on(s, &addr, q, json, out, notes)
}

/// [`follow`] over `stream`, any connection to an agent's debug listener
/// (a TCP connection, or a stream port-forwarded through the API server as
/// `kubectl npm observe` opens it); `addr` names the agent in notes and
/// errors. A read that times out (`WouldBlock`, `TimedOut`: the caller's
/// read timeout) is [`ObserveError::Silent`].
pub fn follow_on<S: Read + Write>(
    mut s: S,
    addr: &str,
    q: &ObserveQuery,
    json: bool,
    out: &mut dyn Write,
    notes: &mut dyn Write,
) -> Result<(), ObserveError> {
    let addr = addr.to_string();
    let io = |source| ObserveError::Io {
        addr: addr.clone(),
        source,
    };
    let silence = KEEPALIVE * 3;
    let path = q.path();
    // `Connection: close`: the stream lasts until the connection ends, and
    // an error answer ends with it.
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: application/x-ndjson\r\nConnection: close\r\n\r\n"
    )
    .and_then(|()| s.flush())
    .map_err(io)?;
    let mut r = BufReader::new(s);
    let (status, chunked) = read_head(&mut r).map_err(io)?;
    let mut lines = BufReader::new(Body::new(r, chunked));
    if status.split_whitespace().nth(1) != Some("200") {
        let mut text = String::new();
        // The error body is short; a read error leaves it empty.
        let _ = lines.take(64 * 1024).read_to_string(&mut text);
        return Err(ObserveError::Status {
            addr,
            status,
            body: text.trim().into(),
        });
    }
    let mut subscribed = false;
    loop {
        let mut line = String::new();
        match lines.read_line(&mut line) {
            Ok(0) => return Err(ObserveError::Closed { addr }),
            Ok(_) => {}
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                return Err(ObserveError::Silent {
                    addr,
                    secs: silence.as_secs(),
                })
            }
            Err(e) => return Err(io(e)),
        }
        if !subscribed {
            subscribed = true;
            let _ = writeln!(notes, "observing flows of the agent at {addr} ({path}); Ctrl-C to stop");
        }
        let line = line.trim_end();
        if line.is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line).unwrap_or(Value::Null);
        if let Some(n) = value.get("lost").and_then(Value::as_u64) {
            let _ = writeln!(
                notes,
                "observe: {n} records lost: this client read too slowly and the agent dropped them for it"
            );
            continue;
        }
        let text = if json || value.is_null() {
            line.to_string()
        } else {
            render_line(&value)
        };
        if let Err(e) = writeln!(out, "{text}").and_then(|()| out.flush()) {
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(io(e));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn lines_paths_and_chunks() {
        let v = json!({
            "verdict": "deny", "reason": "policy-denied", "direction": "ingress",
            "pod": {"namespace": "y", "name": "b"},
            "peer": {"kind": "pod", "namespace": "x", "name": "a"},
            "src": "10.0.0.1:49152", "dst": "10.0.0.2:81", "protocol": "TCP",
            "policies": ["y/allow-xa-80"],
        });
        assert_eq!(
            render_line(&v),
            "DENY       ingress y/b <- x/a (10.0.0.1:49152 -> 10.0.0.2:81 TCP) reason=policy-denied policies=y/allow-xa-80"
        );
        let w = json!({"verdict": "allow", "direction": "egress", "pod": {"namespace": "x", "name": "a"},
            "peer": {"kind": "world", "cidr": "10.0.0.0/8"}, "tier": "Admin",
            "cluster_policy": {"name": "c", "rule": 2}});
        assert!(
            render_line(&w).contains("x/a -> world/10.0.0.0/8"),
            "{}",
            render_line(&w)
        );
        assert!(render_line(&w).ends_with("tier=Admin cnp=c[2]"), "{}", render_line(&w));
        assert_eq!(ObserveQuery::default().path(), "/observe");
        let q = ObserveQuery {
            pod: Some("y/b".into()),
            verdict: Some("deny".into()),
            ..Default::default()
        };
        assert_eq!(q.path(), "/observe?pod=y%2Fb&verdict=deny");
        let raw = b"5\r\nhello\r\n3;x=1\r\n\n{}\r\n0\r\n\r\n";
        let mut body = Body::Chunked {
            r: &raw[..],
            left: 0,
            done: false,
        };
        let mut got = String::new();
        body.read_to_string(&mut got).unwrap();
        assert_eq!(got, "hello\n{}");
        assert!(matches!(
            follow(
                "localhost:1",
                &ObserveQuery::default(),
                true,
                &mut Vec::new(),
                &mut Vec::new()
            ),
            Err(ObserveError::Url(_))
        ));
    }
}
