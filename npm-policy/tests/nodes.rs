//! Other nodes, table by
//! table: Node conversion, node identities in the ipcache (shared by equal
//! labels, this node's addresses host, a pod address wins), NetworkPolicy
//! selecting node addresses by ipBlock only, the ClusterNetworkPolicy
//! `nodes` peer (other nodes and this node), stable and adopted numbers,
//! and the log name of a node identity. Verdicts are checked with the
//! datapath lookup on the full and incremental compiles and with the
//! reference evaluator.

use std::net::IpAddr;

use k8s_openapi::api::core::v1 as corev1;
use npm_common::{Reason, IDENTITY_HOST};
use npm_policy::compiled::{CompileOptions, Compiled, Direction, Tier, TierAction};
use npm_policy::convert::{load_yaml, node_from_api, ConvertError};
use npm_policy::evaluate::evaluate_direction;
use npm_policy::incremental::Compiler;
use npm_policy::lookup::lookup;
use npm_policy::model::*;
use npm_policy::render::identity_name;
use npm_policy::tiers::validate::convert_cluster_policy_value;
use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterRule, Subject};

const NODE_IP: &str = "192.168.0.10";
const POD: &str = "10.1.0.1";

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec![NODE_IP.parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn labels(pairs: &[(&str, &str)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
}

fn sel(pairs: &[(&str, &str)]) -> Selector {
    Selector {
        match_labels: labels(pairs),
        match_expressions: vec![],
    }
}

fn node(name: &str, zone: &str, addrs: &[&str]) -> Node {
    Node {
        name: name.into(),
        labels: labels(&[("zone", zone)]),
        addresses: addrs.iter().map(|a| ip(a)).collect(),
    }
}

/// One local pod x/a (POD) and nodes: this one (zone z1, its Node object
/// lists an address that is not in `node_ips`), w1 and w2 (zone z1), w3
/// (zone z2, listing the pod's address too).
fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    s.upsert_namespace(Namespace {
        name: "x".into(),
        labels: labels(&[("kubernetes.io/metadata.name", "x")]),
    });
    s.upsert_pod(Pod {
        uid: "uid-a".into(),
        namespace: "x".into(),
        name: "a".into(),
        labels: labels(&[("app", "a")]).into(),
        ips: vec![ip(POD)],
        node_name: Some("node".into()),
        phase: PodPhase::Running,
        deleting: false,
        host_network: false,
        ports: vec![],
        created: 0,
    });
    for n in [
        node("node", "z1", &[NODE_IP, "192.168.0.99"]),
        node("w1", "z1", &["192.168.0.11", "fd00::11"]),
        node("w2", "z1", &["192.168.0.12"]),
        node("w3", "z2", &["192.168.0.13", POD]),
    ] {
        s.upsert_node(n);
    }
    s
}

fn incremental(s: &Snapshot) -> Compiler {
    let mut base = s.clone();
    base.nodes.clear();
    base.policies.clear();
    base.cluster_policies.clear();
    let mut c = Compiler::new(base, opts(), None);
    for n in s.nodes.values() {
        c.upsert_node(n.clone());
    }
    for p in s.policies.values() {
        c.upsert_policy(p.clone());
    }
    for p in s.cluster_policies.values() {
        c.upsert_cluster_policy(p.clone());
    }
    c
}

/// Checks x/a with each peer on both compiles and the evaluator.
fn check(s: &Snapshot, cases: &[(Direction, &str, bool, Reason)]) {
    let full = npm_policy::compile(s, &opts(), None);
    let inc = incremental(s);
    let pod = &s.pods[&("x".to_string(), "a".to_string())];
    for (name, c) in [("full", &full), ("incremental", inc.compiled())] {
        let ep = *c.endpoints.keys().next().unwrap();
        for (dir, peer, allowed, reason) in cases {
            let got = lookup(c, ep, *dir, ip(peer), 6, 80);
            let want = evaluate_direction(s, &opts(), pod, *dir, ip(peer), 6, 80);
            let what = format!("{name}: {dir:?} peer {peer}");
            assert_eq!(
                (got.allowed, got.reason),
                (*allowed, *reason),
                "{what}: {got:?}\n{}",
                c.render_table()
            );
            assert_eq!(want.allowed, *allowed, "{what}: evaluator {want}");
        }
    }
}

#[test]
fn node_from_api_takes_internal_and_external_addresses() {
    let n: corev1::Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "w1", "labels": {"zone": "z1"}},
        "status": {"addresses": [
            {"type": "Hostname", "address": "w1"},
            {"type": "InternalIP", "address": "10.99.0.2"},
            {"type": "ExternalIP", "address": "203.0.113.7"},
            {"type": "InternalIP", "address": "fd00::2"},
            {"type": "InternalIP", "address": "10.99.0.2"},
            {"type": "InternalDNS", "address": "w1.cluster.local"},
            {"type": "ExternalIP", "address": "::ffff:198.51.100.1"}
        ]}
    }))
    .unwrap();
    let got = node_from_api(&n).unwrap();
    assert_eq!(got.name, "w1");
    assert_eq!(got.labels, labels(&[("zone", "z1")]));
    assert_eq!(
        got.addresses,
        vec![ip("10.99.0.2"), ip("203.0.113.7"), ip("fd00::2"), ip("198.51.100.1")]
    );
    // No status: no addresses.
    let bare: corev1::Node = serde_json::from_value(serde_json::json!({"metadata": {"name": "w2"}})).unwrap();
    assert!(node_from_api(&bare).unwrap().addresses.is_empty());
    // A bad address is an error naming it; no name is an error.
    let bad: corev1::Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "w3"},
        "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.300"}]}
    }))
    .unwrap();
    match node_from_api(&bad) {
        Err(e @ ConvertError::BadNodeIp { .. }) => {
            assert!(e.to_string().contains("status.addresses[0].address"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    let unnamed: corev1::Node = serde_json::from_value(serde_json::json!({"metadata": {}})).unwrap();
    assert!(matches!(
        node_from_api(&unnamed),
        Err(ConvertError::MissingName { kind: "Node" })
    ));
    // The YAML loader reads Nodes and NodeLists.
    let objs = load_yaml(
        "apiVersion: v1\nkind: Node\nmetadata: {name: w1}\n---\napiVersion: v1\nkind: NodeList\nitems:\n- {apiVersion: v1, kind: Node, metadata: {name: w2}}\n",
    )
    .unwrap();
    assert_eq!(objs.nodes.len(), 2);
}

#[test]
fn other_nodes_have_node_identities_and_this_node_is_host() {
    let s = snapshot();
    let c = npm_policy::compile(&s, &opts(), None);
    let id = |a: &str| c.ipcache.get(&ip(a)).map(|e| e.identity);
    // w1 and w2 share the zone=z1 identity (both addresses of w1), w3 has
    // its own; all in the pod identity space, none a pod identity.
    let z1 = id("192.168.0.11").unwrap();
    assert_eq!(id("fd00::11"), Some(z1));
    assert_eq!(id("192.168.0.12"), Some(z1));
    let z2 = id("192.168.0.13").unwrap();
    assert_ne!(z1, z2);
    for n in [z1, z2] {
        assert!((npm_common::IDENTITY_FIRST_POD..npm_common::IDENTITY_FIRST_CIDR).contains(&n));
        assert!(!c.ids.identities.contains_key(&n));
    }
    assert_eq!(
        c.ids.node_identities[&z1].nodes,
        vec!["w1".to_string(), "w2".to_string()]
    );
    assert_eq!(c.ids.node_identities[&z2].labels, labels(&[("zone", "z2")]));
    // This node: node_ips are host; its Node object's other address is not
    // a node address (netlink's node_ips are this node's truth).
    assert_eq!(id(NODE_IP), Some(IDENTITY_HOST));
    assert_eq!(id("192.168.0.99"), None);
    // The pod wins over w3 listing its address.
    let pod_id = c.endpoints.values().next().unwrap().identity;
    assert_eq!(id(POD), Some(pod_id));
    // Names for logs.
    assert_eq!(identity_name(&c, z1), "node/w1+1");
    assert_eq!(identity_name(&c, z2), "node/w3");
    assert_eq!(identity_name(&c, IDENTITY_HOST), "host");
    // The incremental compiler gets the same tables.
    assert_eq!(incremental(&s).compiled().ipcache, c.ipcache);
}

#[test]
fn networkpolicy_selects_node_addresses_by_ipblock_only() {
    let mut s = snapshot();
    // Egress isolation with a namespaceSelector {} (every pod) and an
    // ipBlock holding w2 only.
    s.policies.insert(
        ("x".into(), "np".into()),
        Policy {
            namespace: "x".into(),
            name: "np".into(),
            pod_selector: Selector::default(),
            ingress_isolation: true,
            egress_isolation: true,
            ingress: vec![Rule {
                ports: vec![],
                peers: vec![Peer::Namespaces(Selector::default())],
            }],
            egress: vec![Rule {
                ports: vec![],
                peers: vec![
                    Peer::Namespaces(Selector::default()),
                    Peer::IpBlock(IpBlock {
                        cidr: "192.168.0.12/32".parse().unwrap(),
                        except: vec![],
                    }),
                ],
            }],
        },
    );
    use Direction::{Egress as EG, Ingress as IN};
    check(
        &s,
        &[
            (EG, "192.168.0.12", true, Reason::Policy),
            (EG, "192.168.0.11", false, Reason::PolicyDenied),
            (EG, "192.168.0.13", false, Reason::PolicyDenied),
            (IN, "192.168.0.11", false, Reason::PolicyDenied),
            // This node: ingress always, egress by policy.
            (IN, NODE_IP, true, Reason::Host),
            (EG, NODE_IP, false, Reason::PolicyDenied),
        ],
    );
}

fn deny_to(peers: Vec<ClusterPeer>) -> ClusterPolicy {
    ClusterPolicy {
        name: "deny-nodes".into(),
        tier: Tier::Admin,
        priority: 10,
        subject: Subject::Namespaces(Selector::default()),
        ingress: vec![],
        egress: vec![ClusterRule {
            name: None,
            action: TierAction::Deny,
            peers,
            ports: vec![],
        }],
    }
}

#[test]
fn cnp_nodes_peer_matches_other_nodes_and_this_node_by_labels() {
    use Direction::Egress as EG;
    // zone=z1: w1, w2 and this node (host), not w3, not the pod, not world.
    let mut s = snapshot();
    s.insert_cluster_policy(deny_to(vec![ClusterPeer::Nodes(sel(&[("zone", "z1")]))]), None);
    check(
        &s,
        &[
            (EG, "192.168.0.11", false, Reason::AdminDeny),
            (EG, "fd00::11", false, Reason::AdminDeny),
            (EG, "192.168.0.12", false, Reason::AdminDeny),
            (EG, NODE_IP, false, Reason::AdminDeny),
            (EG, "192.168.0.13", true, Reason::NotIsolated),
            (EG, POD, true, Reason::NotIsolated),
            (EG, "192.168.0.99", true, Reason::NotIsolated),
            (EG, "8.8.8.8", true, Reason::NotIsolated),
        ],
    );
    // An empty selector: every node, this one too.
    let mut s = snapshot();
    s.insert_cluster_policy(deny_to(vec![ClusterPeer::Nodes(Selector::default())]), None);
    check(
        &s,
        &[
            (EG, "192.168.0.13", false, Reason::AdminDeny),
            (EG, NODE_IP, false, Reason::AdminDeny),
            (EG, POD, true, Reason::NotIsolated),
        ],
    );
    // zone=z2: w3 only; this node is not z2.
    let mut s = snapshot();
    s.insert_cluster_policy(deny_to(vec![ClusterPeer::Nodes(sel(&[("zone", "z2")]))]), None);
    check(
        &s,
        &[
            (EG, "192.168.0.13", false, Reason::AdminDeny),
            (EG, NODE_IP, true, Reason::NotIsolated),
            (EG, "192.168.0.11", true, Reason::NotIsolated),
        ],
    );
}

#[test]
fn cnp_nodes_and_domain_names_peers_are_converted() {
    let cnp = |peer: serde_json::Value, action: &str| {
        serde_json::json!({
            "apiVersion": "policy.networking.k8s.io/v1alpha2",
            "kind": "ClusterNetworkPolicy",
            "metadata": {"name": "p"},
            "spec": {"tier": "Admin", "priority": 1, "subject": {"namespaces": {}},
                     "egress": [{"action": action, "to": [peer]}]}
        })
    };
    let c = convert_cluster_policy_value(&cnp(
        serde_json::json!({"nodes": {"matchLabels": {"zone": "z1"}}}),
        "Deny",
    ))
    .unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    assert_eq!(
        c.policy.egress[0].peers,
        vec![ClusterPeer::Nodes(sel(&[("zone", "z1")]))]
    );
    // A bad nodes selector fails closed like any bad selector.
    let bad = convert_cluster_policy_value(&cnp(
        serde_json::json!({"nodes": {"matchExpressions": [{"key": "zone", "operator": "In", "values": []}]}}),
        "Accept",
    ))
    .unwrap();
    assert!(!bad.problems.is_empty());
    assert!(
        bad.policy.egress[0].peers.is_empty(),
        "Accept with a bad peer matches nothing"
    );
    // domainNames in a Deny rule (the API allows it in Accept rules only):
    // reported, Deny of every peer.
    let d = convert_cluster_policy_value(&cnp(serde_json::json!({"domainNames": ["example.com"]}), "Deny")).unwrap();
    assert!(
        d.problems.iter().any(|p| p.field.ends_with("domainNames")),
        "{:?}",
        d.problems
    );
    assert_eq!(d.policy.egress[0].peers, vec![ClusterPeer::All]);
    // In an Accept rule: converted, lowercased, without the trailing dot.
    let a = convert_cluster_policy_value(&cnp(
        serde_json::json!({"domainNames": ["Example.COM.", "*.cdn.example.com"]}),
        "Accept",
    ))
    .unwrap();
    assert!(a.problems.is_empty(), "{:?}", a.problems);
    let names: Vec<String> = match &a.policy.egress[0].peers[..] {
        [ClusterPeer::DomainNames(n)] => n.iter().map(ToString::to_string).collect(),
        other => panic!("{other:?}"),
    };
    assert_eq!(names, ["example.com", "*.cdn.example.com"]);
}

/// Node identities: kept by label set across recompiles and address
/// changes, a new one for a new label set; the incremental compiler
/// follows add, label change, address change and delete; a restarted
/// agent adopts them by their addresses.
#[test]
fn node_identities_are_stable_and_adopted() {
    let s = snapshot();
    let mut inc = Compiler::new(s.clone(), opts(), None);
    let first = inc.compiled().clone();
    let z1 = first.ipcache[&ip("192.168.0.11")].identity;
    // Address change: w1 moves to .21; same identity, old address gone.
    inc.upsert_node(node("w1", "z1", &["192.168.0.21"]));
    let c = inc.compiled();
    assert_eq!(c.ipcache[&ip("192.168.0.21")].identity, z1);
    assert!(!c.ipcache.contains_key(&ip("192.168.0.11")));
    assert!(!c.ipcache.contains_key(&ip("fd00::11")));
    // Label change: w2 to zone z3 gets a new identity, z1 stays for w1.
    inc.upsert_node(node("w2", "z3", &["192.168.0.12"]));
    let c = inc.compiled().clone();
    let z3 = c.ipcache[&ip("192.168.0.12")].identity;
    assert!(z3 != z1 && z3 >= first.ids.next_identity, "a new number: {z3}");
    assert_eq!(c.ids.node_identities[&z1].nodes, vec!["w1".to_string()]);
    // Delete: w3's address goes; the pod keeps its own.
    inc.remove_node("w3");
    let c = inc.compiled().clone();
    assert!(!c.ipcache.contains_key(&ip("192.168.0.13")));
    assert!(c
        .ids
        .node_identities
        .values()
        .all(|n| n.labels != labels(&[("zone", "z2")])));
    // The pod leaves: its address goes back to a node listing it.
    inc.upsert_node(node("w3", "z2", &[POD]));
    inc.remove_pod("x", "a");
    let z2 = inc.compiled().ipcache[&ip(POD)].identity;
    assert_eq!(inc.compiled().ids.node_identities[&z2].nodes, vec!["w3".to_string()]);
    // The full compile agrees, with the same numbers from the previous compile.
    let full = npm_policy::compile(inc.snapshot(), &opts(), Some(inc.compiled()));
    assert_eq!(full.ipcache, inc.compiled().ipcache);
    assert_eq!(full.ids.node_identities, inc.compiled().ids.node_identities);
    // Restart: a fresh compile numbers from scratch; the seed adopts the
    // identities whose addresses are exactly those of the old kernel state.
    let old: &Compiled = inc.compiled();
    let adopted = npm_policy::adopt::AdoptedNumbers {
        identities: npm_policy::adopt::addresses_by_identity(old),
        cidrs: old.cidrs.clone(),
        max_rule: 0,
        max_subject: 0,
    };
    let fresh = npm_policy::compile(inc.snapshot(), &opts(), None);
    let seeded = npm_policy::adopt::seed(&fresh, &adopted);
    let restarted = npm_policy::compile(inc.snapshot(), &opts(), Some(&seeded));
    assert_eq!(restarted.ipcache, old.ipcache);
    assert_eq!(restarted.ids.node_identities, old.ids.node_identities);
}
