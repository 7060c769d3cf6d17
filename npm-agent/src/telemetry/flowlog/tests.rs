//! Unit tests of the flow log: the rate limit, and the names of a compiled
//! state (pod, peer pod / host / world CIDR, isolating policies).

use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use npm_policy::compiled::CompileOptions;
use npm_policy::model::{IpBlock, Namespace, Peer as ModelPeer, Pod, Policy, Rule, Selector, Snapshot};

use super::*;

#[test]
fn limits_per_second_window() {
    let mut f = FlowLog::with_writer(3, Box::new(std::io::sink()));
    let t0 = Instant::now();
    let deny = DenyEvent {
        reason: Reason::PolicyDenied as u8,
        ..DenyEvent::default()
    };
    let events = vec![deny; 5];
    let snapshot = Snapshot::default();
    assert_eq!(f.log_all(&events, &Names::new(None, &snapshot), t0), 2);
    assert_eq!(f.admit(t0 + Duration::from_millis(999)), Admit::Suppress);
    // Allow events have a budget of their own.
    assert_eq!(f.admit_verdict(t0 + Duration::from_millis(999), true), Admit::Log);
    assert_eq!(f.admit(t0 + Duration::from_secs(1)), Admit::Log);
}

#[test]
fn allow_events_are_allow_lines_and_reach_the_allow_sinks_all() {
    let sink = Sink::default();
    let mut f = FlowLog::with_writer(1, Box::new(sink.clone()));
    let seen: Arc<Mutex<Vec<(u16, &'static str)>>> = Arc::default();
    let s2 = seen.clone();
    f.on_allow(Box::new(move |e, r| s2.lock().unwrap().push((e.sport, r.verdict))));
    let mut allow = event(7, npm_common::DIR_INGRESS, [10, 0, 0, 1], [10, 0, 0, 2]);
    allow.reason = Reason::Policy as u8;
    let deny = event(7, npm_common::DIR_INGRESS, [10, 0, 0, 1], [10, 0, 0, 2]);
    let mut allow2 = allow;
    allow2.sport = 999;
    let snapshot = Snapshot::default();
    let t0 = Instant::now();
    // One line of each verdict fits the window; the second allow line is
    // suppressed but still reaches the sink.
    assert_eq!(f.log_all(&[allow, deny, allow2], &Names::new(None, &snapshot), t0), 1);
    assert_eq!(*seen.lock().unwrap(), vec![(1234, "allow"), (999, "allow")]);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    let lines: Vec<serde_json::Value> = text.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert_eq!(
        (lines[0]["verdict"].as_str(), lines[0]["reason"].as_str()),
        (Some("allow"), Some("policy"))
    );
    assert_eq!(
        (lines[1]["verdict"].as_str(), lines[1]["reason"].as_str()),
        (Some("deny"), Some("policy-denied"))
    );
    assert!(describe(&allow).starts_with("allow endpoint=7 "));
}

#[test]
fn describes_v4_event() {
    let e = event(7, npm_common::DIR_EGRESS, [10, 0, 0, 1], [10, 0, 0, 2]);
    assert_eq!(
        describe(&e),
        "deny endpoint=7 ifindex=9 dir=egress reason=policy-denied proto=6 10.0.0.1:1234 -> 10.0.0.2:80"
    );
}

fn event(endpoint: u32, direction: u8, src: [u8; 4], dst: [u8; 4]) -> DenyEvent {
    let mut e = DenyEvent {
        endpoint,
        ifindex: 9,
        direction,
        reason: Reason::PolicyDenied as u8,
        protocol: 6,
        family: 4,
        sport: 1234,
        dport: 80,
        ..Default::default()
    };
    e.src = npm_common::IpKey::v4(src).addr;
    e.dst = npm_common::IpKey::v4(dst).addr;
    e
}

/// The kit's pod, created at 0.
fn pod(ns: &str, name: &str, node: &str, ip: &str, app: &str) -> Pod {
    Pod {
        created: 0,
        ..npm_testkit::policy::pod(ns, name, ip, app, node)
    }
}

fn policy(name: &str, app: &str, ingress: bool, egress: bool, rules: Vec<Rule>) -> Policy {
    Policy {
        namespace: "k".into(),
        name: name.into(),
        pod_selector: Selector {
            match_labels: [("app".to_string(), app.to_string())].into(),
            match_expressions: Vec::new(),
        },
        ingress_isolation: ingress,
        egress_isolation: egress,
        ingress: Vec::new(),
        egress: rules,
    }
}

/// Records what the flow log wrote.
#[derive(Clone, Default)]
struct Sink(Arc<Mutex<Vec<u8>>>);

impl Write for Sink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn names_pod_peer_and_isolating_policies() {
    let mut s = Snapshot::default();
    s.namespaces.insert(
        "k".into(),
        Namespace {
            name: "k".into(),
            labels: [("kubernetes.io/metadata.name".to_string(), "k".to_string())].into(),
        },
    );
    for p in [
        pod("k", "a", "node-a", "10.1.1.2", "a"),
        pod("k", "b", "node-a", "10.1.2.2", "b"),
        pod("k", "far", "node-b", "10.9.0.5", "far"),
    ] {
        s.pods.insert((p.namespace.clone(), p.name.clone()), p);
    }
    let to_cidr = Rule {
        ports: Vec::new(),
        peers: vec![ModelPeer::IpBlock(IpBlock {
            cidr: "192.0.2.0/24".parse().unwrap(),
            except: Vec::new(),
        })],
    };
    for pol in [
        policy("deny-b", "b", true, false, Vec::new()),
        policy("b-egress", "b", false, true, vec![to_cidr]),
        policy("deny-a", "a", true, false, Vec::new()),
    ] {
        s.policies.insert((pol.namespace.clone(), pol.name.clone()), pol);
    }
    for (name, ip) in [("node-a", "10.0.0.1"), ("node-b", "10.0.0.2")] {
        s.upsert_node(npm_policy::model::Node {
            name: name.into(),
            labels: [("zone".to_string(), "z1".to_string())].into(),
            addresses: vec![ip.parse().unwrap()],
        });
    }
    let opts = CompileOptions {
        node_name: "node-a".into(),
        node_ips: vec!["10.0.0.1".parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    };
    let compiled = npm_policy::compile(&s, &opts, None);
    let b = *compiled.ids.endpoints.get("uid-b").expect("endpoint of b");
    let names = Names::new(Some(&compiled), &s);

    // Ingress into b from a (another pod of this node).
    let r = names.record(&event(b, npm_common::DIR_INGRESS, [10, 1, 1, 2], [10, 1, 2, 2]));
    assert_eq!(
        r.pod,
        Some(PodName {
            namespace: "k".into(),
            name: "b".into()
        })
    );
    assert_eq!(
        r.peer,
        Peer::Pod {
            namespace: "k".into(),
            name: "a".into()
        }
    );
    assert_eq!(r.policies, vec!["k/deny-b".to_string()]);
    assert_eq!(r.direction, "ingress");
    // Egress from b to a remote pod, to the world inside a policy CIDR,
    // outside every CIDR, and to the node.
    let egress = |dst| names.record(&event(b, npm_common::DIR_EGRESS, [10, 1, 2, 2], dst));
    let r = egress([10, 9, 0, 5]);
    assert_eq!(
        r.peer,
        Peer::Pod {
            namespace: "k".into(),
            name: "far".into()
        }
    );
    assert_eq!(r.policies, vec!["k/b-egress".to_string()]);
    assert_eq!(
        egress([192, 0, 2, 7]).peer,
        Peer::World {
            cidr: Some("192.0.2.0/24".into())
        }
    );
    assert_eq!(egress([198, 51, 100, 1]).peer, Peer::World { cidr: None });
    assert_eq!(egress([10, 0, 0, 1]).peer, Peer::Host);
    // Another node's address: named by its Node.
    let other = egress([10, 0, 0, 2]).peer;
    assert_eq!(other, Peer::Node { name: "node-b".into() });
    assert_eq!(other.to_string(), "node/node-b");
    assert_eq!(
        serde_json::to_value(&other).unwrap(),
        serde_json::json!({"kind": "node", "name": "node-b"})
    );

    // The JSON line.
    let sink = Sink::default();
    let mut log = FlowLog::with_writer(10, Box::new(sink.clone()));
    let ev = event(b, npm_common::DIR_INGRESS, [10, 1, 1, 2], [10, 1, 2, 2]);
    assert_eq!(log.log_all(&[ev], &names, Instant::now()), 0);
    let text = String::from_utf8(sink.0.lock().unwrap().clone()).unwrap();
    let line: serde_json::Value = serde_json::from_str(text.trim_end()).unwrap();
    assert_eq!(line["pod"]["name"], "b", "{text}");
    assert_eq!(
        line["peer"],
        serde_json::json!({"kind": "pod", "namespace": "k", "name": "a"})
    );
    assert_eq!(line["policies"], serde_json::json!(["k/deny-b"]));
    assert_eq!(line["src"], "10.1.1.2:1234");
    assert_eq!(line["peer_ip"], "10.1.1.2".parse::<IpAddr>().unwrap().to_string());
    assert_eq!(line["protocol"], "TCP");
}

/// A deny of the Admin tier names the tier and the CNP rule that the
/// programmed state decides it by; a tier deny the programmed state no
/// longer decides so names the tier only; an NP deny names neither.
#[test]
fn a_tier_deny_names_the_tier_and_the_cluster_policy() {
    let mut s = Snapshot::default();
    for p in [
        pod("k", "a", "node-a", "10.1.1.2", "a"),
        pod("k", "b", "node-a", "10.1.2.2", "b"),
    ] {
        s.pods.insert((p.namespace.clone(), p.name.clone()), p);
    }
    s.namespaces.insert(
        "k".into(),
        Namespace {
            name: "k".into(),
            labels: [("kubernetes.io/metadata.name".to_string(), "k".to_string())].into(),
        },
    );
    let api = npm_policy::tiers::validate::cluster_policy_from_value(&serde_json::json!({
        "metadata": {"name": "no-a-to-b"},
        "spec": {
            "tier": "Admin", "priority": 3,
            "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "b"}}}},
            "ingress": [
                {"action": "Accept", "from": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "x"}}}}]},
                {"action": "Deny", "from": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "a"}}}}]}
            ]
        }
    }))
    .unwrap();
    s.upsert_cluster_policy(&api).unwrap();
    let opts = CompileOptions {
        node_name: "node-a".into(),
        ..CompileOptions::default()
    };
    let compiled = npm_policy::compile(&s, &opts, None);
    let b = *compiled.ids.endpoints.get("uid-b").expect("endpoint of b");
    let names = Names::new(Some(&compiled), &s);
    let mut ev = event(b, npm_common::DIR_INGRESS, [10, 1, 1, 2], [10, 1, 2, 2]);
    ev.reason = Reason::AdminDeny as u8;
    let r = names.record(&ev);
    assert_eq!(r.reason, "admin-deny");
    assert_eq!(r.tier, Some("Admin"));
    assert_eq!(
        r.cluster_policy,
        Some(ClusterRuleName {
            name: "no-a-to-b".into(),
            rule: 1
        })
    );
    let line = serde_json::to_value(&r).unwrap();
    assert_eq!(line["tier"], "Admin");
    assert_eq!(
        line["cluster_policy"],
        serde_json::json!({"name": "no-a-to-b", "rule": 1})
    );
    // A Baseline deny the programmed state does not decide: the tier only.
    ev.reason = Reason::BaselineDeny as u8;
    let r = names.record(&ev);
    assert_eq!((r.tier, r.cluster_policy), (Some("Baseline"), None));
    // A NetworkPolicy deny: neither field in the JSON line.
    ev.reason = Reason::PolicyDenied as u8;
    let line = serde_json::to_value(names.record(&ev)).unwrap();
    assert!(
        line.get("tier").is_none() && line.get("cluster_policy").is_none(),
        "{line}"
    );
}

/// A record's time is the event's monotonic kernel time on the wall
/// clock: an event 5 s old is stamped about 5 s before now, an event
/// without a time is stamped now; the text is RFC 3339 in UTC.
#[test]
fn records_carry_the_events_wall_clock_time() {
    use k8s_openapi::jiff::{SignedDuration, Timestamp};
    let mono = u64::try_from(clock_ns(libc::CLOCK_MONOTONIC)).unwrap();
    let before = Timestamp::now();
    let old: Timestamp = wall_time(mono - 5_000_000_000).parse().unwrap();
    let fresh: Timestamp = wall_time(0).parse().unwrap();
    let after = Timestamp::now();
    let age = before.duration_since(old);
    assert!(
        age >= SignedDuration::from_secs(4) && after.duration_since(old) <= SignedDuration::from_secs(6),
        "{old} vs {before}"
    );
    assert!(fresh >= before && fresh <= after, "{fresh}");
    assert!(wall_time(0).ends_with('Z'), "{}", wall_time(0));
    let e = event(1, npm_common::DIR_INGRESS, [10, 0, 0, 1], [10, 0, 0, 2]);
    let snapshot = Snapshot::default();
    let v = serde_json::to_value(Names::new(None, &snapshot).record(&e)).unwrap();
    assert!(
        v["time"].as_str().is_some_and(|t| t.parse::<Timestamp>().is_ok()),
        "{v}"
    );
}
