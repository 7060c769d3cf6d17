//! The live flow stream behind `npm-agent observe` (like `hubble observe`):
//! `GET /observe` on the metrics listener, read-only, answers with every
//! flow-log record the agent writes from then on, one JSON object per line
//! (`application/x-ndjson`), until the client goes away.
//!
//! The source is the flow log itself: the sync loop's [`FlowLog`] writes
//! through [`ObserveHub::tee`], which passes each line on to stdout and
//! publishes it, parsed once, to a `tokio::sync::broadcast` channel of
//! [`CAPACITY`] records. A record the rate limit suppresses
//! (`--flow-logs-per-sec`) is not written, so it is not streamed either.
//! Publishing never blocks and costs nothing without a client (the line is
//! not even parsed). A client that reads more slowly than records come
//! falls behind the channel: the records it missed are dropped for it
//! alone, counted (`npm_observe_lost_total`) and announced in its stream as
//! one `{"lost":N}` line; the agent and the other clients do not wait for
//! it.
//!
//! Server-side filters, as query parameters: `namespace=NS` (the pod or a
//! peer pod is in NS), `pod=NS/POD` (the pod or the peer pod is that pod),
//! `verdict=allow|deny|would-deny` (the record's `verdict`). An empty line
//! is sent on subscribing and every [`KEEPALIVE`] without a record, so a
//! client sees at once that it is subscribed and notices a dead agent (and
//! the agent a dead client).
//!
//! [`FlowLog`]: super::flowlog::FlowLog

use std::io::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::Value;
use tokio::sync::broadcast;

use super::server::ServerState;

/// Records a client may fall behind by before it loses some.
pub const CAPACITY: usize = 4096;

/// The longest time a stream stays silent (an empty line then).
pub const KEEPALIVE: Duration = Duration::from_secs(10);

/// Longest flow-log line the tee buffers (a longer one is not published).
const MAX_LINE: usize = 64 * 1024;

/// The verdicts a filter may ask for.
pub const VERDICTS: [&str; 3] = ["allow", "deny", "would-deny"];

/// One published record: the flow-log line and its parsed JSON.
#[derive(Debug)]
pub struct Observed {
    /// The line as the flow log wrote it (no newline).
    pub line: String,
    /// Its JSON (`Null` if it is not JSON).
    pub value: Value,
}

/// The broadcast channel of flow-log records and its loss count; clones
/// share both. The sync loop publishes ([`ObserveHub::tee`]), `/observe`
/// subscribes.
#[derive(Clone, Debug)]
pub struct ObserveHub {
    tx: broadcast::Sender<Arc<Observed>>,
    lost: Arc<AtomicU64>,
}

impl Default for ObserveHub {
    fn default() -> Self {
        Self::new(CAPACITY)
    }
}

impl ObserveHub {
    /// A hub keeping `capacity` records for slow clients (at least 1).
    pub fn new(capacity: usize) -> Self {
        let (tx, _) = broadcast::channel(capacity.max(1));
        ObserveHub {
            tx,
            lost: Arc::default(),
        }
    }

    /// Publish one flow-log line (without its newline) to every client;
    /// nothing is done without a client. Never blocks.
    pub fn publish_line(&self, line: &str) {
        if self.tx.receiver_count() == 0 || line.is_empty() {
            return;
        }
        let value = serde_json::from_str(line).unwrap_or(Value::Null);
        // An error only means the last client just left.
        let _ = self.tx.send(Arc::new(Observed {
            line: line.to_string(),
            value,
        }));
    }

    /// A new client's receiver: the records published from now on.
    pub fn subscribe(&self) -> broadcast::Receiver<Arc<Observed>> {
        self.tx.subscribe()
    }

    /// Clients subscribed now.
    pub fn clients(&self) -> usize {
        self.tx.receiver_count()
    }

    /// Records dropped for slow clients so far (each client's loss counts).
    pub fn lost(&self) -> u64 {
        self.lost.load(Ordering::Relaxed)
    }

    /// A writer that writes to `inner` and publishes each complete line
    /// written through it (the flow log's writer).
    pub fn tee(&self, inner: Box<dyn Write + Send>) -> Box<dyn Write + Send> {
        Box::new(Tee {
            inner,
            hub: self.clone(),
            partial: Vec::new(),
        })
    }
}

/// See [`ObserveHub::tee`].
struct Tee {
    inner: Box<dyn Write + Send>,
    hub: ObserveHub,
    partial: Vec<u8>,
}

impl Write for Tee {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        let mut rest = &buf[..n];
        while let Some(at) = rest.iter().position(|&b| b == b'\n') {
            if self.partial.len() + at <= MAX_LINE {
                self.partial.extend_from_slice(&rest[..at]);
                self.hub.publish_line(String::from_utf8_lossy(&self.partial).trim_end());
            }
            self.partial.clear();
            rest = &rest[at + 1..];
        }
        if self.partial.len() + rest.len() <= MAX_LINE {
            self.partial.extend_from_slice(rest);
        } else {
            // Too long to publish: dropped up to its newline.
            self.partial.clear();
            self.partial.resize(MAX_LINE + 1, b' ');
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The filters of one `/observe` client.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObserveFilter {
    /// The pod or a peer pod is in this namespace.
    pub namespace: Option<String>,
    /// The pod or the peer pod is this one (`namespace`, `name`).
    pub pod: Option<(String, String)>,
    /// The record's verdict (one of [`VERDICTS`]).
    pub verdict: Option<String>,
}

impl ObserveFilter {
    /// The filter of a query string (`namespace`, `pod`, `verdict`, all
    /// optional); an unknown parameter or value is an error.
    pub fn parse(query: &str) -> Result<Self, String> {
        let mut f = ObserveFilter::default();
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            let v = crate::explain::decode(v)?;
            match k {
                "namespace" if !v.is_empty() => f.namespace = Some(v),
                "pod" => {
                    let (ns, name) = v
                        .split_once('/')
                        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty() && !name.contains('/'))
                        .ok_or_else(|| format!("pod {v:?}: want NAMESPACE/POD"))?;
                    f.pod = Some((ns.into(), name.into()));
                }
                "verdict" if VERDICTS.contains(&v.as_str()) => f.verdict = Some(v),
                "verdict" => return Err(format!("verdict {v:?}: want one of {}", VERDICTS.join(", "))),
                "namespace" => return Err("namespace: empty".into()),
                other => return Err(format!("unknown parameter {other:?} (namespace, pod, verdict)")),
            }
        }
        Ok(f)
    }

    /// Whether the record `v` passes.
    pub fn matches(&self, v: &Value) -> bool {
        fn pod(p: &Value) -> Option<(&str, &str)> {
            Some((p.get("namespace")?.as_str()?, p.get("name")?.as_str()?))
        }
        let me = v.get("pod").and_then(pod);
        let peer = v
            .get("peer")
            .filter(|p| p.get("kind").and_then(Value::as_str) == Some("pod"))
            .and_then(pod);
        let ends = [me, peer];
        if let Some(ns) = &self.namespace {
            if !ends.iter().flatten().any(|(n, _)| n == ns) {
                return false;
            }
        }
        if let Some((ns, name)) = &self.pod {
            if !ends.iter().flatten().any(|(n, p)| n == ns && p == name) {
                return false;
            }
        }
        if let Some(want) = &self.verdict {
            if v.get("verdict").and_then(Value::as_str) != Some(want.as_str()) {
                return false;
            }
        }
        true
    }
}

/// One client's stream: its receiver, filter and keepalive clock.
struct Client {
    rx: broadcast::Receiver<Arc<Observed>>,
    filter: ObserveFilter,
    keepalive: tokio::time::Interval,
    hub: ObserveHub,
    metrics: super::Metrics,
    /// The stream's slot among the open streams (freed with the stream).
    _slot: tokio::sync::OwnedSemaphorePermit,
}

impl Client {
    /// The next chunk of the stream (`None`: the channel closed).
    async fn next(&mut self) -> Option<String> {
        loop {
            tokio::select! {
                r = self.rx.recv() => match r {
                    Ok(rec) => {
                        if self.filter.matches(&rec.value) {
                            self.keepalive.reset();
                            return Some(format!("{}\n", rec.line));
                        }
                    }
                    Err(broadcast::error::RecvError::Lagged(n)) => {
                        self.hub.lost.fetch_add(n, Ordering::Relaxed);
                        self.metrics.observe_lost.increment(n);
                        tracing::debug!(lost = n, "an observe client fell behind");
                        return Some(format!("{{\"lost\":{n}}}\n"));
                    }
                    Err(broadcast::error::RecvError::Closed) => return None,
                },
                _ = self.keepalive.tick() => return Some("\n".into()),
            }
        }
    }
}

/// `GET /observe`: the records from now on as newline-delimited JSON
/// (400 for a bad filter).
pub async fn handler(State(s): State<ServerState>, uri: Uri) -> Response {
    let filter = match ObserveFilter::parse(uri.query().unwrap_or("")) {
        Ok(f) => f,
        Err(e) => return (StatusCode::BAD_REQUEST, format!("observe: {e}\n")).into_response(),
    };
    // At most MAX_OBSERVE streams at once (the slot lives as long as the
    // stream); beyond: 429.
    let Ok(slot) = s.slots.observe.clone().try_acquire_owned() else {
        return super::server::too_many("observe", super::server::MAX_OBSERVE);
    };
    // Subscribed before the answer goes out: a client that has read the
    // headers sees every record published after that.
    let client = Client {
        _slot: slot,
        rx: s.observe.subscribe(),
        filter,
        // The first tick is immediate: the empty line that confirms the
        // subscription.
        keepalive: tokio::time::interval(KEEPALIVE),
        hub: s.observe.clone(),
        metrics: s.metrics.clone(),
    };
    let stream = futures::stream::unfold(client, |mut c| async move {
        let chunk = c.next().await?;
        Some((Ok::<_, std::convert::Infallible>(chunk), c))
    });
    (
        [
            (header::CONTENT_TYPE, "application/x-ndjson"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        Body::from_stream(stream),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn record(verdict: &str, pod: (&str, &str), peer: Value) -> Value {
        json!({"verdict": verdict, "pod": {"namespace": pod.0, "name": pod.1}, "peer": peer})
    }

    #[test]
    fn filters_parse_and_match_either_end() {
        let deny_b_from_a = record(
            "deny",
            ("y", "b"),
            json!({"kind": "pod", "namespace": "x", "name": "a"}),
        );
        let allow_c_world = record("allow", ("z", "c"), json!({"kind": "world", "cidr": null}));
        let f = ObserveFilter::parse("namespace=x").unwrap();
        assert!(f.matches(&deny_b_from_a) && !f.matches(&allow_c_world));
        let f = ObserveFilter::parse("pod=y%2Fb&verdict=deny").unwrap();
        assert!(f.matches(&deny_b_from_a) && !f.matches(&allow_c_world));
        assert!(!ObserveFilter::parse("verdict=allow").unwrap().matches(&deny_b_from_a));
        assert!(ObserveFilter::parse("").unwrap().matches(&Value::Null));
        assert!(!ObserveFilter::parse("namespace=x").unwrap().matches(&Value::Null));
        assert!(ObserveFilter::parse("verdict=maybe")
            .unwrap_err()
            .contains("would-deny"));
        assert!(ObserveFilter::parse("pod=b").unwrap_err().contains("NAMESPACE/POD"));
        assert!(ObserveFilter::parse("node=n1").unwrap_err().contains("unknown"));
        assert!(ObserveFilter::parse("pod=%zz").unwrap_err().contains("percent"));
    }

    #[test]
    fn the_tee_writes_through_and_publishes_whole_lines() {
        let hub = ObserveHub::new(8);
        let mut rx = hub.subscribe();
        let sink = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        struct Shared(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);
        impl Write for Shared {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let mut tee = hub.tee(Box::new(Shared(sink.clone())));
        // Pieces of lines, as `writeln!` writes them.
        tee.write_all(b"{\"verdict\":").unwrap();
        tee.write_all(b"\"deny\"}\n{\"verdict\":\"allow\"}\n{\"part").unwrap();
        assert_eq!(rx.try_recv().unwrap().value, json!({"verdict": "deny"}));
        assert_eq!(rx.try_recv().unwrap().line, "{\"verdict\":\"allow\"}");
        assert!(rx.try_recv().is_err(), "a partial line is not published");
        assert!(sink.lock().unwrap().ends_with(b"{\"part"));
        // A client that falls behind loses the oldest records only.
        for i in 0..20 {
            hub.publish_line(&format!("{{\"n\":{i}}}"));
        }
        assert!(matches!(rx.try_recv(), Err(broadcast::error::TryRecvError::Lagged(12))));
        assert_eq!(rx.try_recv().unwrap().value, json!({"n": 12}));
        drop(rx);
        assert_eq!(hub.clients(), 0);
        hub.publish_line("{}");
    }
}
