//! The input side of `npmctl preview`: the agent's flow records (JSON
//! lines of `npm-agent observe`, `kubectl npm observe -o json`, or the
//! agent's flow log itself) read into distinct flows for
//! [`npm_policy::analysis::preview`]. The analyses themselves
//! ([`npm_policy::analysis`]) are pure functions of the model.
//!
//! Each record is one end of one connection: `direction` says whether the
//! record's `pod` is the source (egress) or the destination (ingress), and
//! `peer` is the other end (a pod by name, or the host, a node, the world:
//! an address). Both ends of a connection between two pods give the same
//! flow. Source ports are ignored. Empty lines and `{"lost":N}` lines are
//! skipped (the losses are counted); any other line that is not a record
//! is an error naming its line.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use npm_policy::analysis::preview::{FlowEnd, RecordedFlow};

/// Distinct flows with their record count and recorded verdict (`Some`:
/// every record of it said `allow` (true) or `deny` (false); `None`: mixed
/// or `would-deny`).
pub type Flows = BTreeMap<RecordedFlow, (usize, Option<bool>)>;

/// What [`parse_flow_records`] read.
#[derive(Clone, Debug, Default)]
pub struct FlowRecords {
    /// The distinct flows.
    pub flows: Flows,
    /// Records the stream reported lost (`{"lost":N}`).
    pub lost: u64,
    /// Records with `"verdict":"allow"`.
    pub allowed: usize,
}

/// Removes the object `spec` names from `snapshot` (`preview --delete`):
/// `networkpolicy/NAMESPACE/NAME` or `clusternetworkpolicy/NAME` (`np/`,
/// `cnp/` for short). An object that is not there is an error: a typo
/// never previews as "nothing changes".
pub fn delete_object(snapshot: &mut npm_policy::model::Snapshot, spec: &str) -> Result<(), String> {
    let parts: Vec<&str> = spec.split('/').collect();
    match parts.as_slice() {
        [kind, ns, name] if matches!(kind.to_ascii_lowercase().as_str(), "networkpolicy" | "np") => {
            let key = (ns.to_string(), name.to_string());
            if snapshot.policies.remove(&key).is_none() {
                return Err(format!("--delete {spec}: no networkpolicy {ns}/{name} in the state"));
            }
            snapshot
                .invalid_policies
                .retain(|p| p.namespace != *ns || p.name != *name);
            Ok(())
        }
        [kind, name] if matches!(kind.to_ascii_lowercase().as_str(), "clusternetworkpolicy" | "cnp") => snapshot
            .remove_cluster_policy(name)
            .map(|_| ())
            .ok_or_else(|| format!("--delete {spec}: no clusternetworkpolicy {name} in the state")),
        _ => Err(format!(
            "--delete {spec:?}: want networkpolicy/NAMESPACE/NAME or clusternetworkpolicy/NAME"
        )),
    }
}

/// A protocol name (`TCP`, `ICMP`, ...) or number of a record.
fn protocol(s: &str) -> Option<u8> {
    match s {
        "TCP" => Some(npm_common::proto::TCP),
        "UDP" => Some(npm_common::proto::UDP),
        "SCTP" => Some(npm_common::proto::SCTP),
        "ICMP" => Some(npm_common::proto::ICMP),
        "ICMPv6" => Some(npm_common::proto::ICMPV6),
        n => n.parse().ok(),
    }
}

fn socket(v: &serde_json::Value, key: &str) -> Result<SocketAddr, String> {
    let s = v
        .get(key)
        .and_then(|x| x.as_str())
        .ok_or_else(|| format!("no {key:?}"))?;
    s.parse().map_err(|_| format!("{key} {s:?}: want ADDRESS:PORT"))
}

fn pod_end(v: Option<&serde_json::Value>, ip: IpAddr) -> FlowEnd {
    let field = |k: &str| v.and_then(|p| p.get(k)).and_then(|x| x.as_str()).map(String::from);
    match (field("namespace"), field("name")) {
        (Some(namespace), Some(name)) if v.and_then(|p| p.get("kind")).is_none_or(|k| k == "pod") => {
            FlowEnd::Pod { namespace, name, ip }
        }
        _ => FlowEnd::Address { ip },
    }
}

/// One record's flow and verdict.
fn record(v: &serde_json::Value) -> Result<(RecordedFlow, Option<bool>), String> {
    let src = socket(v, "src")?;
    let dst = socket(v, "dst")?;
    let proto = v.get("protocol").and_then(|x| x.as_str()).ok_or("no \"protocol\"")?;
    let protocol = protocol(proto).ok_or_else(|| format!("protocol {proto:?}"))?;
    let (pod_ip, peer_ip) = match v.get("direction").and_then(|x| x.as_str()) {
        Some("egress") => (src.ip(), dst.ip()),
        Some("ingress") => (dst.ip(), src.ip()),
        other => return Err(format!("direction {other:?}: want ingress or egress")),
    };
    let me = pod_end(v.get("pod").filter(|p| !p.is_null()), pod_ip);
    let peer = pod_end(v.get("peer"), peer_ip);
    let (src_end, dst_end) = if v.get("direction").and_then(|x| x.as_str()) == Some("egress") {
        (me, peer)
    } else {
        (peer, me)
    };
    let verdict = match v.get("verdict").and_then(|x| x.as_str()) {
        Some("allow") => Some(true),
        Some("deny") => Some(false),
        _ => None,
    };
    Ok((
        RecordedFlow {
            src: src_end,
            dst: dst_end,
            protocol,
            dst_port: dst.port(),
        },
        verdict,
    ))
}

/// Reads flow records, one JSON object a line.
pub fn parse_flow_records(text: &str) -> Result<FlowRecords, String> {
    let mut out = FlowRecords::default();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(line).map_err(|e| format!("line {}: not a JSON record: {e}", n + 1))?;
        if let Some(l) = v.get("lost").and_then(|l| l.as_u64()) {
            out.lost += l;
            continue;
        }
        let (flow, verdict) = record(&v).map_err(|e| format!("line {}: {e}", n + 1))?;
        if verdict == Some(true) {
            out.allowed += 1;
        }
        let e = out.flows.entry(flow).or_insert((0, verdict));
        e.0 += 1;
        if e.1 != verdict {
            e.1 = None;
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_ends_of_one_connection_are_one_flow() {
        let text = r#"{"verdict":"allow","reason":"policy","direction":"egress","pod":{"namespace":"y","name":"b"},"peer":{"kind":"pod","namespace":"x","name":"a"},"peer_ip":"198.18.1.1","policies":[],"protocol":"TCP","src":"198.18.2.2:40000","dst":"198.18.1.1:80","endpoint":5,"ifindex":9}

{"lost":3}
{"verdict":"allow","reason":"policy","direction":"ingress","pod":{"namespace":"x","name":"a"},"peer":{"kind":"pod","namespace":"y","name":"b"},"peer_ip":"198.18.2.2","policies":[],"protocol":"TCP","src":"198.18.2.2:40001","dst":"198.18.1.1:80","endpoint":2,"ifindex":4,"node":"n1"}
{"verdict":"deny","reason":"policy-denied","direction":"egress","pod":{"namespace":"y","name":"b"},"peer":{"kind":"world","cidr":null},"peer_ip":"8.8.8.8","policies":["y/p"],"protocol":"UDP","src":"198.18.2.2:5000","dst":"8.8.8.8:53","endpoint":5,"ifindex":9}
"#;
        let r = parse_flow_records(text).unwrap();
        assert_eq!(r.lost, 3);
        assert_eq!(r.allowed, 2);
        let flows: Vec<(String, String, u8, u16, usize, Option<bool>)> = r
            .flows
            .iter()
            .map(|(f, (n, v))| (f.src.label(), f.dst.label(), f.protocol, f.dst_port, *n, *v))
            .collect();
        assert_eq!(
            flows,
            vec![
                ("y/b".into(), "x/a".into(), 6, 80, 2, Some(true)),
                ("y/b".into(), "8.8.8.8".into(), 17, 53, 1, Some(false)),
            ]
        );
    }

    #[test]
    fn delete_names_an_object_that_is_there() {
        let mut s = crate::sim::load_snapshot(&[(
            "t".into(),
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: p, namespace: x}\nspec: {podSelector: {}}\n"
                .into(),
        )])
        .unwrap();
        assert!(delete_object(&mut s, "networkpolicy/x/q")
            .unwrap_err()
            .contains("no networkpolicy x/q"));
        assert!(delete_object(&mut s, "pod/x/a")
            .unwrap_err()
            .contains("want networkpolicy"));
        assert!(delete_object(&mut s, "cnp/none").is_err());
        delete_object(&mut s, "np/x/p").unwrap();
        assert!(s.policies.is_empty());
    }

    #[test]
    fn a_line_that_is_not_a_record_is_an_error_naming_it() {
        let e = parse_flow_records("\nnot json\n").unwrap_err();
        assert!(e.starts_with("line 2:"), "{e}");
        let e = parse_flow_records(r#"{"direction":"up","src":"1.1.1.1:1","dst":"2.2.2.2:2","protocol":"TCP"}"#)
            .unwrap_err();
        assert!(e.contains("direction"), "{e}");
    }
}
