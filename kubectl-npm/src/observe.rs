//! `kubectl npm observe [--namespace NS | --pod NS/POD] [--verdict V]`: the
//! live flow records of the agents of the nodes that host the selected
//! pods (every agent without a selection), each through its own
//! port-forward, printed as they arrive, each record with its node. The
//! agents filter (npm-agent's `/observe`); the lines are npm-agent's
//! `render_line`, or the records as JSON or YAML with a `node` field.
//! Records carry no timestamp: across nodes the order is the order of
//! arrival (each node's own stream is in order).

use std::collections::BTreeSet;
use std::io::Write;

use npm_agent::explain::observe_client::{follow_on, render_line, ObserveQuery};
use serde_json::Value;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};

use crate::cluster::Cluster;
use crate::error::NpmError;
use crate::forward::{agent_error, with_agent};
use crate::output::Output;

/// Collects the lines one agent's client writes and sends each with its node.
struct Lines {
    node: String,
    buf: Vec<u8>,
    tx: UnboundedSender<(String, String)>,
}

impl Write for Lines {
    fn write(&mut self, data: &[u8]) -> std::io::Result<usize> {
        self.buf.extend_from_slice(data);
        while let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line).trim_end().to_string();
            // The printer is gone (its output closed): stop this stream.
            self.tx
                .send((self.node.clone(), line))
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

/// One printed record: the text line prefixed by its node, or the JSON
/// record with a `node` field (one line; YAML: one document).
fn print_record(node: &str, line: &str, output: Output) -> String {
    let mut v: Value = serde_json::from_str(line).unwrap_or(Value::Null);
    match output {
        Output::Text if v.is_null() => format!("{node:<12} {line}\n"),
        Output::Text => format!("{node:<12} {}\n", render_line(&v)),
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

/// Follows the agents of `q`'s nodes until interrupted, an agent's stream
/// fails (the error names it), or the output is closed.
pub async fn observe(cluster: &Cluster, q: ObserveQuery, output: Output) -> Result<(), NpmError> {
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
    for node in nodes {
        let agent = cluster.agent_of(&agents, &node)?.clone();
        let (cluster, q, tx) = (cluster.clone(), q.clone(), tx.clone());
        streams.spawn(async move {
            let mut lines = Lines {
                node: node.clone(),
                buf: Vec::new(),
                tx,
            };
            with_agent(&cluster, &agent, move |s, label| {
                let mut notes = std::io::stderr();
                follow_on(s, &label, &q, true, &mut lines, &mut notes)
            })
            .await?
            .map_err(|e| agent_error(&agent, e.to_string()))
        });
    }
    drop(tx);
    let mut stdout = std::io::stdout();
    loop {
        tokio::select! {
            Some((node, line)) = rx.recv() => {
                if stdout.write_all(print_record(&node, &line, output).as_bytes()).and_then(|()| stdout.flush()).is_err() {
                    // The reader left (a closed pipe): done.
                    return Ok(());
                }
            }
            Some(done) = streams.join_next() => match done {
                Ok(Ok(())) => return Ok(()),
                Ok(Err(e)) => return Err(e),
                Err(e) => return Err(NpmError::Output(e.to_string())),
            },
            else => return Ok(()),
        }
    }
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
        assert_eq!(rx.try_recv().unwrap(), ("n2".into(), "a".into()));
        assert_eq!(rx.try_recv().unwrap(), ("n2".into(), "bc".into()));
    }
}
