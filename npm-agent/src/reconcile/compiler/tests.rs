//! Unit tests of the compiler bridge: incremental updates against full
//! compiles, and the cross-check.

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::ObjectMeta;
use npm_policy::compiled::CompileOptions;

use super::incremental::Incremental;
use super::{compile, snapshot, Changes, LastValid};
use crate::cni::{Attachment, NodeFacts};
use crate::k8s::pods::{Container, Pod, PodSpec, PodStatus};
use crate::k8s::CompleteState;

/// The store key of `ns/name` (`""` for cluster-scoped objects).
fn key(ns: &str, name: &str) -> crate::k8s::ObjKey {
    (ns.to_string(), name.to_string())
}

fn no_facts() -> Arc<NodeFacts> {
    Arc::default()
}

fn meta(ns: Option<&str>, name: &str, rv: u64, labels: &[(&str, &str)]) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.into()),
        namespace: ns.map(String::from),
        uid: Some(format!("uid-{}-{name}", ns.unwrap_or(""))),
        resource_version: Some(rv.to_string()),
        labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
        ..Default::default()
    }
}

fn ns(name: &str, rv: u64, team: &str) -> Arc<Namespace> {
    Arc::new(Namespace {
        metadata: meta(None, name, rv, &[("team", team)]),
        ..Default::default()
    })
}

/// A Running pod `ns/name` with `ip`, label `app`, on `node` (shared by
/// the sync tests).
pub(crate) fn pod(ns: &str, name: &str, rv: u64, ip: &str, app: &str, node: &str) -> Arc<Pod> {
    Arc::new(Pod {
        metadata: meta(Some(ns), name, rv, &[("app", app)]),
        labels: Default::default(),
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "c".into(),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.into()),
            ..Default::default()
        }),
    })
}

fn policy(ns: &str, name: &str, rv: u64, app: &str, from_team: &str) -> Arc<NetworkPolicy> {
    let mut np: NetworkPolicy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"app": app}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": from_team}}}],
                         "ports": [{"protocol": "TCP", "port": 80}]}]
        }
    }))
    .unwrap();
    np.metadata = meta(Some(ns), name, rv, &[]);
    Arc::new(np)
}

type Step = dyn Fn(&mut CompleteState, u64);

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node-a".into(),
        node_ips: Vec::new(),
        allow_host_egress: false,
        report_new: false,
    }
}

/// Every incremental step equals a full compile of the same complete
/// state, and a relist with the same resourceVersions feeds nothing.
#[test]
fn incremental_updates_match_full_compile() {
    let mut state = CompleteState {
        namespaces: vec![ns("a", 1, "x"), ns("b", 2, "y")].into(),
        pods: (0..20)
            .map(|i| {
                let node = if i % 2 == 0 { "node-a" } else { "node-b" };
                pod(
                    if i % 3 == 0 { "a" } else { "b" },
                    &format!("p{i}"),
                    10 + i,
                    &format!("10.1.0.{}", i + 1),
                    if i % 2 == 0 { "web" } else { "db" },
                    node,
                )
            })
            .collect(),
        policies: vec![policy("a", "np1", 100, "web", "y")].into(),
        cluster_policies: Default::default(),
        nodes: Default::default(),
    };
    let mut inc = Incremental::new(&state, &no_facts(), &opts(), None);
    let mut rv = 1000;
    let mut next = || {
        rv += 1;
        rv
    };
    let steps: Vec<Box<Step>> = vec![
        Box::new(|s, rv| {
            s.pods.insert(pod("a", "new", rv, "10.1.1.1", "web", "node-a"));
        }),
        Box::new(|s, rv| {
            s.pods.insert(pod("b", "p1", rv, "10.1.1.2", "web", "node-b"));
        }),
        Box::new(|s, _| {
            s.pods.remove(&key("a", "p0"));
        }),
        Box::new(|s, rv| {
            s.namespaces.insert(ns("b", rv, "x"));
        }),
        Box::new(|s, rv| {
            s.policies.insert(policy("b", "np2", rv, "db", "x"));
        }),
        Box::new(|s, rv| {
            s.policies.insert(policy("a", "np1", rv, "web", "x"));
        }),
        Box::new(|s, _| {
            s.policies.remove(&key("a", "np1"));
        }),
        // An address taken over by another pod (incident 1 shape).
        Box::new(|s, rv| {
            s.pods.insert(pod("b", "thief", rv, "10.1.0.3", "db", "node-a"));
        }),
        Box::new(|s, _| {
            s.namespaces.remove(&key("", "a"));
        }),
    ];
    let mut incremental_steps = 0;
    for (i, step) in steps.iter().enumerate() {
        incremental_steps += usize::from(inc.is_incremental());
        let before = inc.compiled().clone();
        step(&mut state, next());
        // Every third step takes the rebuild path (estimated slower),
        // the others the incremental one: the estimates are set before
        // each step, since the measured ones vary with the machine's load.
        let force_rebuild = i % 3 == 2;
        if force_rebuild {
            inc.per_change = Duration::from_secs(3600);
            inc.rebuild_cost = Duration::ZERO;
        } else {
            inc.per_change = Duration::ZERO;
            inc.rebuild_cost = Duration::from_secs(3600);
        }
        let changes = inc.update(&state, &no_facts());
        assert!(changes.total() >= 1, "step {i}: a change was fed");
        assert_eq!(inc.is_incremental(), !force_rebuild, "step {i}");
        assert_eq!(
            inc.conflicts(),
            npm_policy::ownership::conflicts(
                &snapshot(&state, &NodeFacts::default(), &LastValid::default()),
                &opts().node_ips
            ),
            "step {i}: conflicts kept up to date"
        );
        let reference = compile(
            &snapshot(&state, &NodeFacts::default(), &LastValid::default()),
            &opts(),
            Some(inc.compiled()),
        );
        assert!(
            inc.compiled().diff(&reference).is_empty(),
            "step {i}: incremental == full"
        );
        if [0, 1, 2, 7].contains(&i) {
            assert!(!before.diff(inc.compiled()).is_empty(), "step {i} changed the output");
        }
        assert_eq!(inc.cross_check(&state), None, "step {i}");
    }
    assert!(incremental_steps > 0, "the incremental compiler was used");
    // A relist: new objects with the same versions change nothing.
    let relisted = CompleteState {
        namespaces: state.namespaces.iter().map(|o| Arc::new((**o).clone())).collect(),
        pods: state.pods.iter().map(|o| Arc::new((**o).clone())).collect(),
        policies: state.policies.iter().map(|o| Arc::new((**o).clone())).collect(),
        cluster_policies: Default::default(),
        nodes: Default::default(),
    };
    assert_eq!(inc.update(&relisted, &no_facts()), Changes::default());
}

/// The cross-check catches a change the object diff missed and trusts
/// the full compile.
#[test]
fn cross_check_repairs_a_missed_change() {
    let mut state = CompleteState {
        namespaces: vec![ns("a", 1, "x")].into(),
        pods: vec![pod("a", "p", 2, "10.2.0.1", "web", "node-a")].into(),
        policies: Default::default(),
        cluster_policies: Default::default(),
        nodes: Default::default(),
    };
    let mut inc = Incremental::new(&state, &no_facts(), &opts(), None);
    state.pods.insert(pod("a", "p", 3, "10.2.0.9", "web", "node-a"));
    // Pretend the new version was already compiled: the diff misses it.
    inc.pretend_compiled(&state);
    assert_eq!(inc.update(&state, &no_facts()), Changes::default());
    let old: IpAddr = "10.2.0.1".parse().unwrap();
    let new: IpAddr = "10.2.0.9".parse().unwrap();
    assert!(inc.compiled().ipcache.contains_key(&old));
    let m = inc.cross_check(&state).expect("mismatch found");
    assert!(m.changes >= 2, "{m:?}");
    assert!(inc.compiled().ipcache.contains_key(&new));
    assert!(!inc.compiled().ipcache.contains_key(&old));
    assert_eq!(inc.cross_check(&state), None);
}

/// An attachment of pod `ns/name` (uid as [`pod`] gives it) with `ip`.
fn attachment(ns: &str, name: &str, container: &str, ip: &str) -> Attachment {
    Attachment {
        network: "net".into(),
        container_id: container.into(),
        ifname: "eth0".into(),
        netns: String::new(),
        pod: npm_cni::proto::PodRef {
            namespace: ns.into(),
            name: name.into(),
            uid: format!("uid-{ns}-{name}"),
        },
        host_interface: format!("veth{container}"),
        ifindex: 100,
        ips: vec![ip.parse().unwrap()],
        seq: 0,
    }
}

/// The CNI facts are part of the state: a change of the facts alone
/// re-converts the pods it touches (the attached pod, the stale pod whose
/// claim on its address the overlay removes, and back), and every step
/// equals a full compile of the same state and facts.
#[test]
fn facts_changes_are_compiled_incrementally() {
    let mut new = (*pod("a", "new", 1, "", "web", "node-a")).clone();
    new.status.as_mut().unwrap().pod_ip = None;
    let state = CompleteState {
        namespaces: vec![ns("a", 1, "x")].into(),
        pods: vec![
            Arc::new(new),
            // A stale object of a gone pod with the address IPAM hands out next.
            pod("a", "old", 2, "10.3.0.7", "db", "node-a"),
        ]
        .into(),
        policies: vec![policy("a", "np1", 3, "web", "x")].into(),
        cluster_policies: Default::default(),
        nodes: Default::default(),
    };
    let ip: IpAddr = "10.3.0.7".parse().unwrap();
    let mut facts = NodeFacts::default();
    let mut inc = Incremental::new(&state, &Arc::new(facts.clone()), &opts(), None);
    let owner = |inc: &Incremental| {
        inc.compiled()
            .endpoints
            .values()
            .find(|e| e.ipv4.map(IpAddr::V4) == Some(ip))
            .map(|e| e.pod.name.clone())
    };
    assert_eq!(owner(&inc).as_deref(), Some("old"));
    let steps: [fn(&mut NodeFacts); 3] = [
        |f| {
            f.add(attachment("a", "new", "c1", "10.3.0.7"));
        },
        |f| {
            f.del(&("c1".into(), "eth0".into()), None);
        },
        |f| {
            f.lift_tombstones(|_| true);
        },
    ];
    let expected = [Some("new"), Some("old"), Some("old")];
    for (i, step) in steps.iter().enumerate() {
        step(&mut facts);
        let facts = Arc::new(facts.clone());
        inc.per_change = Duration::ZERO;
        inc.rebuild_cost = Duration::from_secs(3600);
        let changes = inc.update(&state, &facts);
        assert!(i == 2 || changes.pods >= 1, "step {i}: {changes:?}");
        let reference = compile(
            &snapshot(&state, &facts, &LastValid::default()),
            &opts(),
            Some(inc.compiled()),
        );
        assert!(
            inc.compiled().diff(&reference).is_empty(),
            "step {i}: incremental == full"
        );
        assert_eq!(owner(&inc).as_deref(), expected[i], "step {i}");
        assert_eq!(inc.cross_check(&state), None, "step {i}");
    }
    // While tombstoned, "new" has no endpoint even with an address in the API.
    let mut facts = NodeFacts::default();
    facts.add(attachment("a", "new", "c1", "10.3.0.9"));
    facts.del(&("c1".into(), "eth0".into()), None);
    let mut with_ip = (*pod("a", "new", 5, "10.3.0.8", "web", "node-a")).clone();
    with_ip.metadata.uid = Some("uid-a-new".into());
    let tombstoned = CompleteState {
        pods: vec![Arc::new(with_ip)].into(),
        ..state.clone()
    };
    let inc = Incremental::new(&tombstoned, &Arc::new(facts), &opts(), None);
    assert!(inc.compiled().endpoints.values().all(|e| e.pod.name != "new"));
    assert!(!inc.compiled().ipcache.contains_key(&"10.3.0.8".parse().unwrap()));
}

fn cnp(name: &str, rv: u64, spec: serde_json::Value) -> Arc<crate::k8s::ClusterNetworkPolicy> {
    Arc::new(crate::k8s::ClusterNetworkPolicy {
        metadata: meta(None, name, rv, &[]),
        spec,
    })
}

/// An Admin CNP: pods app=`app` deny ingress from namespaces team=`team`.
fn admin_deny(name: &str, rv: u64, action: &str, app: &str, team: &str) -> Arc<crate::k8s::ClusterNetworkPolicy> {
    cnp(
        name,
        rv,
        serde_json::json!({
            "tier": "Admin", "priority": 10,
            "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": app}}}},
            "ingress": [{"action": action, "from": [{"namespaces": {"matchLabels": {"team": team}}}]}]
        }),
    )
}

/// ClusterNetworkPolicies go through the same incremental compile: every
/// step (CNP added, changed, a pod it selects added, an undecodable CNP,
/// removals) equals a full compile, both ways; an undecodable object is
/// reported and enforced by nothing, the others are.
#[test]
fn cluster_policy_steps_match_full_compile() {
    let mut state = CompleteState {
        namespaces: vec![ns("a", 1, "x"), ns("b", 2, "y")].into(),
        pods: vec![
            pod("a", "w", 3, "10.4.0.1", "web", "node-a"),
            pod("b", "d", 4, "10.4.0.2", "db", "node-a"),
        ]
        .into(),
        ..Default::default()
    };
    let mut inc = Incremental::new(&state, &no_facts(), &opts(), None);
    assert!(inc.compiled().tiers.is_empty());
    let steps: Vec<Box<Step>> = vec![
        Box::new(|s, rv| {
            s.cluster_policies.insert(admin_deny("deny-y", rv, "Deny", "web", "y"));
        }),
        Box::new(|s, rv| {
            s.pods.insert(pod("a", "w2", rv, "10.4.0.3", "web", "node-a"));
        }),
        Box::new(|s, rv| {
            s.cluster_policies.insert(admin_deny("deny-y", rv, "Pass", "web", "y"));
        }),
        Box::new(|s, rv| {
            s.cluster_policies.insert(cnp(
                "garbled",
                rv,
                serde_json::json!({"tier": "Admin", "priority": "high"}),
            ));
        }),
        Box::new(|s, _| {
            s.cluster_policies.remove(&key("", "deny-y"));
        }),
        Box::new(|s, _| s.cluster_policies = Default::default()),
    ];
    for (i, step) in steps.iter().enumerate() {
        step(&mut state, 100 + i as u64);
        let force_rebuild = i % 2 == 1;
        (inc.per_change, inc.rebuild_cost) = if force_rebuild {
            (Duration::from_secs(3600), Duration::ZERO)
        } else {
            (Duration::ZERO, Duration::from_secs(3600))
        };
        let changes = inc.update(&state, &no_facts());
        assert!(changes.total() >= 1, "step {i}");
        assert_eq!(inc.is_incremental(), !force_rebuild, "step {i}");
        let reference = compile(
            &snapshot(&state, &NodeFacts::default(), &LastValid::default()),
            &opts(),
            Some(inc.compiled()),
        );
        let diff = inc.compiled().diff(&reference);
        assert!(diff.is_empty(), "step {i}: incremental == full: {diff:?}");
        let tiers = inc.compiled().tiers.len();
        if i <= 2 {
            assert!(tiers > 0, "step {i}: deny-y has tier entries");
        }
        let invalid = inc.invalid_cluster_policies();
        assert_eq!(
            invalid.contains_key("garbled"),
            (3..5).contains(&i),
            "step {i}: {invalid:?}"
        );
        assert_eq!(inc.cluster_policy_names().count(), state.cluster_policies.len());
        assert_eq!(inc.cross_check(&state), None, "step {i}");
    }
    assert!(inc.compiled().tiers.is_empty(), "all CNPs removed");
    assert!(inc.snapshot().cluster_policies.is_empty());
}

/// An update of a ClusterNetworkPolicy that cannot be decoded keeps the
/// last decoded version of the same object enforced (its Denies included)
/// and reports it on the pods it selects, incrementally and in a full
/// compile alike; an undecodable object that never had a decoded version
/// (or a recreated one: another uid) selects no pod and says so, the
/// consequence that fails readiness. Before the fix, the garbled update
/// removed every tier entry of `deny-y`.
#[test]
fn an_undecodable_update_keeps_the_last_decoded_version() {
    let mut state = CompleteState {
        namespaces: vec![ns("a", 1, "x"), ns("b", 2, "y")].into(),
        pods: vec![
            pod("a", "w", 3, "10.4.0.1", "web", "node-a"),
            pod("b", "d", 4, "10.4.0.2", "db", "node-a"),
        ]
        .into(),
        ..Default::default()
    };
    state
        .cluster_policies
        .insert(admin_deny("deny-y", 5, "Deny", "web", "y"));
    let garbled = serde_json::json!({"tier": "Admin", "priority": "high"});
    let nothing = npm_policy::tiers::validate::ClusterConsequence::SelectsNothing.to_string();
    let kept = npm_policy::tiers::validate::ClusterConsequence::KeptLastValid.to_string();
    for force_rebuild in [false, true] {
        let mut state = state.clone();
        let mut inc = Incremental::new(&state, &no_facts(), &opts(), None);
        // The verdicts (entry, action, rank); the rule's number for its
        // counter may be drawn again.
        let verdicts = |inc: &Incremental| -> Vec<_> {
            inc.compiled()
                .tiers
                .iter()
                .map(|(e, v)| (*e, v.action, v.rank))
                .collect()
        };
        let valid_tiers = verdicts(&inc);
        assert!(!valid_tiers.is_empty(), "deny-y has tier entries");
        (inc.per_change, inc.rebuild_cost) = if force_rebuild {
            (Duration::from_secs(3600), Duration::ZERO)
        } else {
            (Duration::ZERO, Duration::from_secs(3600))
        };
        // The same object (uid), updated to a spec that cannot be decoded.
        state.cluster_policies.insert(cnp("deny-y", 6, garbled.clone()));
        inc.update(&state, &no_facts());
        assert_eq!(inc.is_incremental(), !force_rebuild);
        assert_eq!(verdicts(&inc), valid_tiers, "rebuild {force_rebuild}: the Denies stay");
        let invalid = inc.invalid_cluster_policies();
        let errors = invalid.get("deny-y").expect("reported");
        assert!(errors.iter().any(|e| e.contains(&kept)), "{errors:?}");
        assert!(
            inc.snapshot()
                .invalid_cluster_policies
                .iter()
                .any(|p| p.name == "deny-y"),
            "the pods it selects are told (PolicyInvalid)"
        );
        let reference = compile(
            &snapshot(&state, &NodeFacts::default(), &inc.last_valid()),
            &opts(),
            Some(inc.compiled()),
        );
        assert!(inc.compiled().diff(&reference).is_empty(), "incremental == full");
        assert_eq!(inc.cross_check(&state), None);
        // Recreated under the same name (another uid), still undecodable:
        // nothing of the old object is kept.
        let mut recreated = (*cnp("deny-y", 7, garbled.clone())).clone();
        recreated.metadata.uid = Some("uid-deny-y-2".into());
        state.cluster_policies.insert(Arc::new(recreated));
        inc.update(&state, &no_facts());
        assert!(
            inc.compiled().tiers.is_empty(),
            "rebuild {force_rebuild}: a new object keeps nothing"
        );
        let errors = inc.invalid_cluster_policies().remove("deny-y").expect("reported");
        assert!(errors.iter().any(|e| e.contains(&nothing)), "{errors:?}");
    }
}

fn api_node(name: &str, rv: u64, zone: &str, ips: &[&str]) -> Arc<k8s_openapi::api::core::v1::Node> {
    use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeStatus};
    Arc::new(Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            uid: Some(format!("uid-node-{name}")),
            resource_version: Some(rv.to_string()),
            labels: Some([("zone".to_string(), zone.to_string())].into()),
            ..Default::default()
        },
        spec: None,
        status: Some(NodeStatus {
            addresses: Some(
                ips.iter()
                    .map(|ip| NodeAddress {
                        type_: "InternalIP".into(),
                        address: ip.to_string(),
                    })
                    .collect(),
            ),
            ..Default::default()
        }),
    })
}

/// Nodes go through the same incremental compile: every step (a node
/// added, relabelled, readdressed, one with a bad address, a pod taking a
/// node's address and giving it back, removals) equals a full compile,
/// both ways; other nodes' addresses get node identities, this node's
/// Node none.
#[test]
fn node_steps_match_full_compile() {
    let mut state = CompleteState {
        namespaces: vec![ns("a", 1, "x")].into(),
        pods: vec![pod("a", "w", 2, "10.5.0.1", "web", "node-a")].into(),
        nodes: vec![api_node("node-a", 3, "z1", &["10.6.0.1"])].into(),
        ..Default::default()
    };
    let mut inc = Incremental::new(&state, &no_facts(), &opts(), None);
    assert!(
        inc.compiled().ids.node_identities.is_empty(),
        "this node is no node identity"
    );
    let steps: Vec<Box<Step>> = vec![
        Box::new(|s, rv| {
            s.nodes.insert(api_node("node-b", rv, "z1", &["10.6.0.2"]));
        }),
        Box::new(|s, rv| {
            s.nodes.insert(api_node("node-c", rv, "z2", &["10.6.0.3", "fd00::3"]));
        }),
        Box::new(|s, rv| {
            s.nodes.insert(api_node("node-b", rv, "z2", &["10.6.0.2"]));
        }),
        Box::new(|s, rv| {
            s.nodes.insert(api_node("node-c", rv, "z2", &["10.6.0.4"]));
        }),
        Box::new(|s, rv| {
            s.nodes.insert(api_node("node-d", rv, "z3", &["not-an-ip"]));
        }),
        Box::new(|s, rv| {
            s.pods.insert(pod("a", "squat", rv, "10.6.0.2", "web", "node-b"));
        }),
        Box::new(|s, _| {
            s.pods.remove(&key("a", "squat"));
        }),
        Box::new(|s, _| {
            s.nodes.remove(&key("", "node-b"));
        }),
        Box::new(|s, _| {
            s.nodes.remove(&key("", "node-c"));
            s.nodes.remove(&key("", "node-d"));
        }),
    ];
    for (i, step) in steps.iter().enumerate() {
        step(&mut state, 100 + i as u64);
        let force_rebuild = i % 2 == 1;
        (inc.per_change, inc.rebuild_cost) = if force_rebuild {
            (Duration::from_secs(3600), Duration::ZERO)
        } else {
            (Duration::ZERO, Duration::from_secs(3600))
        };
        let changes = inc.update(&state, &no_facts());
        assert!(changes.total() >= 1, "step {i}");
        let reference = compile(
            &snapshot(&state, &NodeFacts::default(), &LastValid::default()),
            &opts(),
            Some(inc.compiled()),
        );
        let diff = inc.compiled().diff(&reference);
        assert!(diff.is_empty(), "step {i}: incremental == full: {diff:?}");
        assert_eq!(inc.node_names().count(), state.nodes.len(), "step {i}");
        assert_eq!(inc.cross_check(&state), None, "step {i}");
        let c = inc.compiled();
        let node_id = |ip: &str| {
            c.ipcache
                .get(&ip.parse::<IpAddr>().unwrap())
                .map(|e| c.ids.node_identities.contains_key(&e.identity))
        };
        match i {
            0 => assert_eq!(node_id("10.6.0.2"), Some(true), "node-b is a node identity"),
            3 => {
                assert_eq!(node_id("10.6.0.4"), Some(true));
                assert_eq!(node_id("10.6.0.3"), None, "an address the node dropped is world");
            }
            5 => assert_eq!(node_id("10.6.0.2"), Some(false), "a pod owning the address wins"),
            6 => assert_eq!(node_id("10.6.0.2"), Some(true), "the node gets it back"),
            8 => assert!(c.ids.node_identities.is_empty() && node_id("10.6.0.4").is_none()),
            _ => {}
        }
    }
    // A relist with the same versions feeds nothing.
    let relisted = CompleteState {
        nodes: state.nodes.iter().map(|o| Arc::new((**o).clone())).collect(),
        ..state.clone()
    };
    assert_eq!(inc.update(&relisted, &no_facts()), Changes::default());
}
