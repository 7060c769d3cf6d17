//! `kubectl npm observe [--namespace NS | --pod NS/POD] [--verdict V]`: the
//! live flow records of the agents of the nodes that host the selected
//! pods (every agent without a selection), each through its own
//! port-forward, each record with its node. The agents filter (npm-agent's
//! `/observe`); the lines are npm-agent's `render_line`, or the records as
//! JSON or YAML with a `node` field.
//!
//! Time order ([`Merge`]): each record carries the agent's `time` (the
//! datapath's timestamp on the node's clock) and each node's stream is in
//! time order, so a record is printed once every other followed node has
//! sent a record at least as late, or has ended, or after the sort window
//! (`--sort-window`, default 1 s) without such a record (an idle node does
//! not hold the others back longer). Records without a time (older agents)
//! are printed as they arrive.
//!
//! A node whose stream fails (the agent gone, restarted, or silent past
//! `--idle-timeout`: the agents send a keepalive every 10 s) is reported
//! on stderr by name and no longer followed; the others continue. The
//! command ends when every stream has ended (an error if one failed), or
//! when its output is closed.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap};
use std::io::Write;
use std::time::{Duration, Instant};

use k8s_openapi::jiff::Timestamp;
use npm_agent::explain::observe_client::{follow_on, render_line, ObserveError, ObserveQuery};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use crate::cluster::Cluster;
use crate::error::NpmError;
use crate::forward::{agent_error, with_agent};
use crate::output::Output;

/// What the streams send the printer, in order per node: records, then
/// the stream's end.
#[derive(Debug, PartialEq, Eq)]
enum Msg {
    /// One record line of a node.
    Line(String, String),
    /// A node's stream ended: `Err` with why.
    End(String, Result<(), String>),
}

/// Collects the lines one agent's client writes and sends each with its node.
struct Lines {
    node: String,
    buf: Vec<u8>,
    tx: UnboundedSender<Msg>,
}

impl Write for Lines {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        while let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line).trim_end().to_string();
            // The printer is gone (its output closed): stop this stream.
            self.tx
                .send(Msg::Line(self.node.clone(), line))
                .map_err(|_| std::io::Error::from(std::io::ErrorKind::BrokenPipe))?;
        }
        Ok(data.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The nodes to follow for `q`: the selected pod's, the nodes of the
/// selected namespace's pods, else `None` (every agent).
async fn nodes(cluster: &Cluster, q: &ObserveQuery) -> Result<Option<BTreeSet<String>>, NpmError> {
    if let Some(pod) = &q.pod {
        let (_, node) = cluster
            .node_of(pod)
            .await?
            .ok_or_else(|| NpmError::Usage(format!("--pod {pod:?}: want NAMESPACE/POD")))?;
        return Ok(Some([node].into()));
    }
    if let Some(ns) = &q.namespace {
        let nodes: BTreeSet<String> = cluster
            .pods(Some(ns), None)
            .await?
            .into_iter()
            .filter_map(|p| p.spec.and_then(|s| s.node_name))
            .collect();
        if nodes.is_empty() {
            return Err(NpmError::Usage(format!(
                "no pod of namespace {ns} runs on a node: no agent has flows of it"
            )));
        }
        return Ok(Some(nodes));
    }
    Ok(None)
}

/// One printed record: the text line prefixed by its node and time, or the JSON
/// record with a `node` field (one line; YAML: one document).
fn print_record(node: &str, line: &str, output: Output) -> String {
    let mut v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
    match output {
        Output::Text if v.is_null() => format!("{node:<12} {line}\n"),
        Output::Text => match v.get("time").and_then(Value::as_str) {
            Some(t) => format!("{node:<12} {t} {}\n", render_line(&v)),
            None => format!("{node:<12} {}\n", render_line(&v)),
        },
        Output::Json | Output::Yaml => {
            if let Some(o) = v.as_object_mut() {
                o.insert("node".into(), Value::String(node.into()));
            } else {
                v = serde_json::json!({"node": node, "line": line});
            }
            if output == Output::Json {
                format!("{v}\n")
            } else {
                format!("---\n{}", serde_yaml::to_string(&v).unwrap_or_default())
            }
        }
    }
}

/// The time of a record line (its `time` field), if it has one.
fn time_of(line: &str) -> Option<Timestamp> {
    serde_json::from_str::<Value>(line)
        .ok()?
        .get("time")?
        .as_str()?
        .parse()
        .ok()
}

/// One buffered record: its time, arrival order, node and line, and when
/// it arrived.
type Held = Reverse<(Timestamp, u64, String, String, Instant)>;

/// The time-order merge of several nodes' streams, each in time order.
/// A buffered record is released when it is the earliest and every other
/// open node's latest record is at least as late (nothing earlier can
/// come from it), or when it has waited `window`.
#[derive(Debug)]
pub struct Merge {
    window: Duration,
    /// The open streams and the time of each one's latest record.
    open: BTreeMap<String, Option<Timestamp>>,
    held: BinaryHeap<Held>,
    seq: u64,
}

impl Merge {
    /// A merge of the streams of `nodes`.
    pub fn new(nodes: impl IntoIterator<Item = String>, window: Duration) -> Self {
        Merge {
            window,
            open: nodes.into_iter().map(|n| (n, None)).collect(),
            held: BinaryHeap::new(),
            seq: 0,
        }
    }

    /// A record `line` of `node` arrived at `now`; returns the records it
    /// releases (a record without a time releases itself at once).
    pub fn push(&mut self, node: &str, line: String, now: Instant) -> Vec<(String, String)> {
        let Some(t) = time_of(&line) else {
            let mut out = self.release(now);
            out.push((node.to_string(), line));
            return out;
        };
        if let Some(latest) = self.open.get_mut(node) {
            *latest = (*latest).max(Some(t));
        }
        self.seq += 1;
        self.held.push(Reverse((t, self.seq, node.to_string(), line, now)));
        self.release(now)
    }

    /// `node`'s stream ended: it holds nothing back any more.
    pub fn close(&mut self, node: &str, now: Instant) -> Vec<(String, String)> {
        self.open.remove(node);
        self.release(now)
    }

    /// The records due at `now`, in time order.
    pub fn release(&mut self, now: Instant) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while let Some(Reverse((t, _, _, _, arrived))) = self.held.peek() {
            let others_later = self.open.values().all(|latest| latest.is_some_and(|l| l >= *t));
            if !others_later && now.duration_since(*arrived) < self.window {
                break;
            }
            let Some(Reverse((_, _, node, line, _))) = self.held.pop() else {
                break;
            };
            out.push((node, line));
        }
        out
    }

    /// Every buffered record, in time order (at the end).
    pub fn drain(&mut self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        while let Some(Reverse((_, _, node, line, _))) = self.held.pop() {
            out.push((node, line));
        }
        out
    }
}

/// The message of a failed stream of `agent`.
fn stream_error(cluster: &Cluster, agent: &crate::cluster::AgentPod, e: ObserveError) -> NpmError {
    match e {
        ObserveError::Silent { .. } => agent_error(
            agent,
            format!(
                "nothing from it for {} s, not even its keepalive (sent every 10 s): hung or unreachable (--idle-timeout); no longer following it",
                cluster.idle_timeout.as_secs_f64()
            ),
        ),
        ObserveError::Io { source, .. } if source.kind() == std::io::ErrorKind::TimedOut => agent_error(
            agent,
            format!("{source}; no longer following it"),
        ),
        other => agent_error(agent, other.to_string()),
    }
}

/// Follows the agents of `q`'s nodes, printing their records in time order
/// ([`Merge`], `window`), until interrupted, every stream has ended, or
/// the output is closed. A failed stream is reported when it fails; the
/// others continue.
pub async fn observe(cluster: &Cluster, q: ObserveQuery, output: Output, window: Duration) -> Result<(), NpmError> {
    let selected = nodes(cluster, &q).await?;
    let agents = cluster.agents().await?;
    let nodes: Vec<String> = match selected {
        Some(n) => n.into_iter().collect(),
        None if agents.is_empty() => {
            return Err(NpmError::NoAgents {
                namespace: cluster.agent_namespace.clone(),
                selector: cluster.agent_selector.clone(),
            })
        }
        None => agents.keys().cloned().collect(),
    };
    let (tx, mut rx) = unbounded_channel();
    let mut streams = tokio::task::JoinSet::new();
    for node in &nodes {
        let agent = cluster.agent_of(&agents, node)?.clone();
        let (cluster, q, tx, node) = (cluster.clone(), q.clone(), tx.clone(), node.clone());
        streams.spawn(async move {
            let lines = Lines {
                node: node.clone(),
                buf: Vec::new(),
                tx: tx.clone(),
            };
            let ended = with_agent(&cluster, &agent, move |s, label| {
                let (mut lines, mut notes) = (lines, std::io::stderr());
                follow_on(s, &label, &q, true, &mut lines, &mut notes)
            })
            .await
            .and_then(|r| r.map_err(|e| stream_error(&cluster, &agent, e)))
            .map_err(|e| e.to_string());
            // After this node's lines: the channel keeps their order.
            let _ = tx.send(Msg::End(node, ended));
        });
    }
    drop(tx);
    let mut merge = Merge::new(nodes.iter().cloned(), window);
    let mut tick = tokio::time::interval((window / 4).clamp(Duration::from_millis(20), Duration::from_millis(250)));
    let (mut open, mut failed) = (nodes.len(), 0);
    let mut stdout = std::io::stdout();
    let mut print = |due: Vec<(String, String)>| {
        let text: String = due.iter().map(|(n, l)| print_record(n, l, output)).collect();
        text.is_empty() || stdout.write_all(text.as_bytes()).and_then(|()| stdout.flush()).is_ok()
    };
    while open > 0 {
        let due = tokio::select! {
            msg = rx.recv() => match msg {
                Some(Msg::Line(node, line)) => merge.push(&node, line, Instant::now()),
                Some(Msg::End(node, ended)) => {
                    open -= 1;
                    if let Err(e) = ended {
                        failed += 1;
                        let rest = match open {
                            0 => String::new(),
                            1 => " (still following 1 other node)".into(),
                            n => format!(" (still following {n} other nodes)"),
                        };
                        eprintln!("error: {e}{rest}");
                    }
                    merge.close(&node, Instant::now())
                }
                None => break,
            },
            _ = tick.tick() => merge.release(Instant::now()),
        };
        if !print(due) {
            // The reader left (a closed pipe): done.
            return Ok(());
        }
    }
    print(merge.drain());
    streams.abort_all();
    if failed > 0 {
        return Err(NpmError::Streams {
            failed,
            streams: nodes.len(),
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_carry_their_node() {
        let line = r#"{"verdict":"deny","direction":"ingress","pod":{"namespace":"y","name":"b"},"peer":{"kind":"world"},"src":"1.1.1.1:1","dst":"10.0.0.2:80","protocol":"TCP","reason":"policy-denied"}"#;
        let text = print_record("n1", line, Output::Text);
        assert!(
            text.starts_with("n1           DENY       ingress y/b <- world"),
            "{text}"
        );
        let json: Value = serde_json::from_str(&print_record("n1", line, Output::Json)).unwrap();
        assert_eq!(
            (json["node"].as_str(), json["verdict"].as_str()),
            (Some("n1"), Some("deny"))
        );
        assert!(print_record("n1", line, Output::Yaml).contains("node: n1"));
        let (tx, mut rx) = unbounded_channel();
        let mut l = Lines {
            node: "n2".into(),
            buf: Vec::new(),
            tx,
        };
        write!(l, "a\nb").unwrap();
        writeln!(l, "c").unwrap();
        assert_eq!(rx.try_recv().unwrap(), Msg::Line("n2".into(), "a".into()));
        assert_eq!(rx.try_recv().unwrap(), Msg::Line("n2".into(), "bc".into()));
    }

    fn rec(t: &str) -> String {
        format!(r#"{{"time":"2026-12-07T15:00:{t}Z","verdict":"deny"}}"#)
    }

    fn seconds(out: &[(String, String)]) -> Vec<(String, String)> {
        out.iter()
            .map(|(n, l)| {
                (
                    n.clone(),
                    time_of(l).map(|t| t.to_string()[17..].to_string()).unwrap_or_default(),
                )
            })
            .collect()
    }

    /// Records are released in time order once the other open nodes have
    /// sent later ones or ended, or after the window; untimed records at
    /// once.
    #[test]
    fn merges_in_time_order() {
        let t0 = Instant::now();
        let mut m = Merge::new(["n1".to_string(), "n2".to_string()], Duration::from_secs(1));
        // n2 first, but later than what n1 will send: held.
        assert!(m.push("n2", rec("02"), t0).is_empty());
        assert!(m.push("n2", rec("04"), t0).is_empty());
        // n1's 01 is earlier than n2's latest: out at once, not n2's 02
        // (n1 could still send 01.5); with n1 at 03, n2's 02 and n1's 03
        // go, not n2's 04.
        let out = m.push("n1", rec("01"), t0);
        assert_eq!(seconds(&out), [("n1".into(), "01Z".into())]);
        let out = m.push("n1", rec("03"), t0);
        assert_eq!(
            seconds(&out),
            [("n2".into(), "02Z".into()), ("n1".into(), "03Z".into())]
        );
        // n1 idle: n2's 04 waits for the window, then goes.
        assert!(m.release(t0 + Duration::from_millis(500)).is_empty());
        assert_eq!(
            seconds(&m.release(t0 + Duration::from_secs(1))),
            [("n2".into(), "04Z".into())]
        );
        // n1 ends: n2 alone holds nothing back.
        assert!(m.push("n2", rec("06"), t0).is_empty());
        assert_eq!(seconds(&m.close("n1", t0)), [("n2".into(), "06Z".into())]);
        // An untimed record (an older agent) is printed as it comes.
        assert_eq!(m.push("n2", "{}".into(), t0), [("n2".to_string(), "{}".to_string())]);
        assert!(m.drain().is_empty());
    }
}
