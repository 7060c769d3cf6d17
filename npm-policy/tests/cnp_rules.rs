//! ClusterNetworkPolicy semantics, table by table: every case is checked
//! with BOTH the reference evaluator (`evaluate_direction`, API text) and the
//! datapath lookup on the full compile and on the incremental compiler,
//! which must agree with each other and with the expected verdict, reason
//! and deciding rule.

use std::collections::BTreeMap;
use std::net::IpAddr;

use npm_common::Reason;
use npm_policy::compiled::{CompileOptions, Compiled, Direction, RuleRef, Tier, TierAction};
use npm_policy::evaluate::{evaluate, evaluate_direction, EndReason, Flow};
use npm_policy::incremental::Compiler;
use npm_policy::lookup::lookup;
use npm_policy::model::*;
use npm_policy::tiers::compile::ranked_rules;
use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};

const TCP: u8 = 6;
const UDP: u8 = 17;
const ICMP: u8 = 1;
const NODE_IP: &str = "192.168.0.10";

/// (namespace, name, address); every pod is on this node with the label
/// `pod=<name>` and the named ports http (TCP 80) and dns (UDP 53).
const PODS: &[(&str, &str, &str)] = &[
    ("x", "a", "10.1.0.1"),
    ("x", "b", "10.1.0.2"),
    ("y", "a", "10.1.0.3"),
    ("y", "b", "10.1.0.4"),
];

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec![NODE_IP.parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    }
}

fn sel(pairs: &[(&str, &str)]) -> Selector {
    Selector {
        match_labels: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        match_expressions: vec![],
    }
}

fn ip(name: &str) -> IpAddr {
    match PODS.iter().find(|p| format!("{}/{}", p.0, p.1) == name) {
        Some(p) => p.2.parse().unwrap(),
        None => name.parse().unwrap(),
    }
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    for ns in ["x", "y"] {
        s.upsert_namespace(Namespace {
            name: ns.into(),
            labels: [("ns".to_string(), ns.to_string())].into(),
        });
    }
    for (i, (ns, name, addr)) in PODS.iter().enumerate() {
        s.upsert_pod(Pod {
            uid: format!("uid-{i}"),
            namespace: ns.to_string(),
            name: name.to_string(),
            labels: [("pod".to_string(), name.to_string())].into(),
            ips: vec![addr.parse().unwrap()],
            node_name: Some("node".into()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: false,
            ports: vec![
                ContainerPort {
                    name: Some("http".into()),
                    port: 80,
                    protocol: Protocol::Tcp,
                },
                ContainerPort {
                    name: Some("dns".into()),
                    port: 53,
                    protocol: Protocol::Udp,
                },
            ],
            created: 0,
        });
    }
    s
}

/// The subject x/a.
fn xa() -> Subject {
    Subject::Pods {
        namespaces: sel(&[("ns", "x")]),
        pods: sel(&[("pod", "a")]),
    }
}

fn cnp(name: &str, tier: Tier, priority: u32, ingress: Vec<ClusterRule>, egress: Vec<ClusterRule>) -> ClusterPolicy {
    ClusterPolicy {
        name: name.into(),
        tier,
        priority,
        subject: xa(),
        ingress,
        egress,
    }
}

fn rule(action: TierAction, peers: Vec<ClusterPeer>, ports: Vec<ClusterPort>) -> ClusterRule {
    ClusterRule {
        name: None,
        action,
        peers,
        ports,
    }
}

fn ns(n: &str) -> ClusterPeer {
    ClusterPeer::Namespaces(sel(&[("ns", n)]))
}

fn nets(n: &[&str]) -> ClusterPeer {
    ClusterPeer::Networks(n.iter().map(|c| c.parse().unwrap()).collect())
}

fn tcp(a: u16, b: u16) -> ClusterPort {
    ClusterPort::Ports {
        protocol: Protocol::Tcp,
        start: a,
        end: b,
    }
}

fn np(name: &str, ingress: Option<Vec<Rule>>, egress: Option<Vec<Rule>>) -> Policy {
    Policy {
        namespace: "x".into(),
        name: name.into(),
        pod_selector: sel(&[("pod", "a")]),
        ingress_isolation: ingress.is_some(),
        egress_isolation: egress.is_some(),
        ingress: ingress.unwrap_or_default(),
        egress: egress.unwrap_or_default(),
    }
}

/// What one end expects: allowed, the datapath reason, and for a tier
/// decision the deciding (policy, index).
type Want = (bool, Reason, Option<(&'static str, usize)>);

/// Checks x/a in `dir` with `peer` on both compiles and the evaluator.
fn check(s: &Snapshot, cases: &[(Direction, &str, u8, u16, Want)]) {
    let full = npm_policy::compile(s, &opts(), None);
    let inc = incremental(s);
    let pod = &s.pods[&("x".to_string(), "a".to_string())];
    for (c, compiled) in [("full", &full), ("incremental", inc.compiled())] {
        let ep = *compiled
            .endpoints
            .iter()
            .find(|(_, e)| e.pod.namespace == "x" && e.pod.name == "a")
            .unwrap()
            .0;
        for (dir, peer, proto, port, (allowed, reason, rule)) in cases {
            let what = format!("{c}: x/a {dir:?} peer {peer} proto {proto} port {port}");
            let got = lookup(compiled, ep, *dir, ip(peer), *proto, *port);
            let want = evaluate_direction(s, &opts(), pod, *dir, ip(peer), *proto, *port);
            assert_eq!(
                got.allowed,
                *allowed,
                "{what}: lookup {got:?}\n{}",
                compiled.render_table()
            );
            assert_eq!(want.allowed, *allowed, "{what}: evaluator {want}");
            assert_eq!(
                got.reason,
                *reason,
                "{what}: lookup {got:?}\n{}",
                compiled.render_table()
            );
            let got_rule = got.rule.and_then(|r| compiled.ids.rules.get(&r)).and_then(|r| match r {
                RuleRef::Cluster { name, index, .. } => Some((name.as_str(), *index)),
                _ => None,
            });
            let want_rule = match &want.reason {
                EndReason::Tier(m) => Some((m.policy.as_str(), m.index)),
                _ => None,
            };
            assert_eq!(got_rule, *rule, "{what}: lookup rule");
            assert_eq!(want_rule, *rule, "{what}: evaluator {want}");
        }
    }
}

/// The incremental compiler reaching `s` from the snapshot without CNPs
/// and NetworkPolicies, one change at a time.
fn incremental(s: &Snapshot) -> Compiler {
    let mut base = s.clone();
    base.cluster_policies.clear();
    base.policies.clear();
    let mut c = Compiler::new(base, opts(), None);
    for p in s.policies.values() {
        c.upsert_policy(p.clone());
    }
    for p in s.cluster_policies.values() {
        c.upsert_cluster_policy(p.clone());
    }
    assert_eq!(
        c.compiled().tiers,
        npm_policy::compile(s, &opts(), Some(c.compiled())).tiers
    );
    c
}

fn add(s: &mut Snapshot, p: ClusterPolicy) {
    s.insert_cluster_policy(p, None);
}

const IN: Direction = Direction::Ingress;
const EG: Direction = Direction::Egress;
use TierAction::{Accept, Deny, Pass};

#[test]
fn equal_priorities_are_ordered_by_name_lower_priority_first() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp(
            "b-accept",
            Tier::Admin,
            10,
            vec![rule(Accept, vec![ns("x")], vec![])],
            vec![],
        ),
    );
    add(
        &mut s,
        cnp(
            "a-deny",
            Tier::Admin,
            10,
            vec![rule(Deny, vec![ns("x")], vec![])],
            vec![],
        ),
    );
    check(
        &s,
        &[(IN, "x/b", TCP, 80, (false, Reason::AdminDeny, Some(("a-deny", 0))))],
    );
    // Ranks: a-deny's rule before b-accept's.
    let ranks: Vec<(String, u32)> = ranked_rules(&s, Tier::Admin, IN)
        .iter()
        .map(|r| (r.policy.name.clone(), r.rank))
        .collect();
    assert_eq!(
        ranks,
        vec![
            ("a-deny".to_string(), 10 << 20),
            ("b-accept".to_string(), (10 << 20) | (1 << 5))
        ]
    );
    // Renamed after b-accept: the Accept is first.
    let p = s.remove_cluster_policy("a-deny").unwrap();
    add(
        &mut s,
        ClusterPolicy {
            name: "c-deny".into(),
            ..p
        },
    );
    check(
        &s,
        &[(IN, "x/b", TCP, 80, (true, Reason::AdminAccept, Some(("b-accept", 0))))],
    );
    // A lower priority value wins whatever the name.
    s.cluster_policies.get_mut("c-deny").unwrap().priority = 9;
    check(
        &s,
        &[(IN, "x/b", TCP, 80, (false, Reason::AdminDeny, Some(("c-deny", 0))))],
    );
}

#[test]
fn deny_all_first_shadows_a_later_accept_of_one_port() {
    let mut s = snapshot();
    // Rank 0: Pass from y; rank 1: Deny all from x; rank 2: Accept TCP 80 from x.
    add(
        &mut s,
        cnp(
            "p",
            Tier::Admin,
            1,
            vec![
                rule(Pass, vec![ns("y")], vec![]),
                rule(Deny, vec![ns("x")], vec![]),
                rule(Accept, vec![ns("x")], vec![tcp(80, 80)]),
            ],
            vec![],
        ),
    );
    check(
        &s,
        &[
            (IN, "x/b", TCP, 80, (false, Reason::AdminDeny, Some(("p", 1)))),
            (IN, "x/b", UDP, 53, (false, Reason::AdminDeny, Some(("p", 1)))),
            (IN, "x/b", ICMP, 0, (false, Reason::AdminDeny, Some(("p", 1)))),
            (IN, "y/a", TCP, 80, (true, Reason::NotIsolated, None)),
        ],
    );
    // The folded TCP 80 entry would carry the rank-1 Deny, which the
    // protocol-less entry already says: one entry for x/b's identity.
    let c = npm_policy::compile(&s, &opts(), None);
    let xb = c.ipcache[&ip("x/b")].identity;
    let of_xb: Vec<_> = c.tiers.iter().filter(|(e, _)| e.peer == xb).collect();
    assert_eq!(of_xb.len(), 1, "{}", c.render_table());
    assert_eq!((of_xb[0].0.protocol, of_xb[0].1.action), (None, Deny));
    // The other order: the Accept of TCP 80 first, then Deny all.
    let rules = &mut s.cluster_policies.get_mut("p").unwrap().ingress;
    rules.swap(1, 2);
    check(
        &s,
        &[
            (IN, "x/b", TCP, 80, (true, Reason::AdminAccept, Some(("p", 1)))),
            (IN, "x/b", TCP, 81, (false, Reason::AdminDeny, Some(("p", 2)))),
            (IN, "x/b", UDP, 80, (false, Reason::AdminDeny, Some(("p", 2)))),
            (IN, "x/b", ICMP, 0, (false, Reason::AdminDeny, Some(("p", 2)))),
        ],
    );
}

#[test]
fn overlapping_port_ranges_fold_to_disjoint_entries() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp(
            "ranges",
            Tier::Admin,
            1,
            vec![
                rule(Accept, vec![ns("x")], vec![tcp(100, 200)]),
                rule(Deny, vec![ns("x")], vec![tcp(150, 300), tcp(120, 130)]),
                rule(Pass, vec![ns("x")], vec![tcp(250, 400)]),
                rule(Deny, vec![ns("x")], vec![tcp(390, 500)]),
            ],
            vec![],
        ),
    );
    // NetworkPolicy isolates x/a and allows only TCP 350 from x/b, so a Pass
    // is distinguishable from no match.
    s.policies.insert(
        ("x".into(), "np".into()),
        np(
            "np",
            Some(vec![Rule {
                ports: vec![Port {
                    protocol: Protocol::Tcp,
                    port: PortSpec::Range(350, 350),
                }],
                peers: vec![Peer::Pods(sel(&[("pod", "b")]))],
            }]),
            None,
        ),
    );
    let r = |i| Some(("ranges", i));
    check(
        &s,
        &[
            (IN, "x/b", TCP, 99, (false, Reason::PolicyDenied, None)),
            (IN, "x/b", TCP, 100, (true, Reason::AdminAccept, r(0))),
            (IN, "x/b", TCP, 125, (true, Reason::AdminAccept, r(0))),
            (IN, "x/b", TCP, 200, (true, Reason::AdminAccept, r(0))),
            (IN, "x/b", TCP, 201, (false, Reason::AdminDeny, r(1))),
            (IN, "x/b", TCP, 300, (false, Reason::AdminDeny, r(1))),
            (IN, "x/b", TCP, 301, (false, Reason::PolicyDenied, None)),
            (IN, "x/b", TCP, 350, (true, Reason::Policy, None)),
            (IN, "x/b", TCP, 400, (false, Reason::PolicyDenied, None)),
            (IN, "x/b", TCP, 401, (false, Reason::AdminDeny, r(3))),
            (IN, "x/b", TCP, 500, (false, Reason::AdminDeny, r(3))),
            (IN, "x/b", TCP, 501, (false, Reason::PolicyDenied, None)),
            (IN, "x/b", UDP, 150, (false, Reason::PolicyDenied, None)),
        ],
    );
    // Disjoint per (endpoint, direction, tier, peer, protocol).
    let c = npm_policy::compile(&s, &opts(), None);
    let mut by: BTreeMap<_, Vec<(u16, u16)>> = BTreeMap::new();
    for e in c.tiers.keys() {
        by.entry((e.subject, e.direction, e.tier, e.peer, e.protocol))
            .or_default()
            .push(e.ports);
    }
    for (k, mut v) in by {
        v.sort();
        for w in v.windows(2) {
            assert!(w[0].1 < w[1].0, "{k:?}: {v:?} overlap\n{}", c.render_table());
        }
    }
}

#[test]
fn nested_networks_fold_onto_narrower_cidr_identities() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp(
            "nets",
            Tier::Admin,
            5,
            vec![],
            vec![
                rule(Accept, vec![nets(&["10.1.0.0/30"])], vec![]),
                rule(Deny, vec![nets(&["10.1.0.0/16"])], vec![]),
            ],
        ),
    );
    let r = |i| Some(("nets", i));
    let cases = [
        (EG, "y/a", TCP, 80, (true, Reason::AdminAccept, r(0))), // 10.1.0.3: in the /30
        (EG, "y/b", TCP, 80, (false, Reason::AdminDeny, r(1))),  // 10.1.0.4: the /16 only
        (EG, "10.1.7.7", UDP, 53, (false, Reason::AdminDeny, r(1))),
        (EG, "10.1.0.2", ICMP, 0, (true, Reason::AdminAccept, r(0))),
        (EG, "8.8.8.8", TCP, 80, (true, Reason::NotIsolated, None)),
    ];
    check(&s, &cases);
    let c = npm_policy::compile(&s, &opts(), None);
    assert!(c.cidrs.contains_key(&"10.1.0.0/30".parse().unwrap()));
    assert!(c.cidrs.contains_key(&"10.1.0.0/16".parse().unwrap()));
    // A /32 inserted by a higher-priority policy (the upstream conformance
    // "CIDR peer with a /32 insertion"): the address gets the /32 identity,
    // which both broader rules must also cover.
    add(
        &mut s,
        cnp(
            "deny-one",
            Tier::Admin,
            1,
            vec![],
            vec![rule(Deny, vec![nets(&["10.1.0.3/32"])], vec![tcp(80, 80)])],
        ),
    );
    check(
        &s,
        &[
            (EG, "y/a", TCP, 80, (false, Reason::AdminDeny, Some(("deny-one", 0)))),
            (EG, "y/a", TCP, 81, (true, Reason::AdminAccept, r(0))),
            (EG, "x/b", TCP, 80, (true, Reason::AdminAccept, r(0))),
            (EG, "y/b", TCP, 80, (false, Reason::AdminDeny, r(1))),
        ],
    );
    // A NetworkPolicy ipBlock and a CIDR network share the identity of one
    // prefix.
    s.policies.insert(
        ("x".into(), "np".into()),
        np(
            "np",
            None,
            Some(vec![Rule {
                ports: vec![],
                peers: vec![Peer::IpBlock(IpBlock {
                    cidr: "10.1.0.0/16".parse().unwrap(),
                    except: vec![],
                })],
            }]),
        ),
    );
    let c = npm_policy::compile(&s, &opts(), None);
    assert_eq!(c.cidrs.len(), 3, "{:?}", c.cidrs);
}

#[test]
fn pass_goes_to_networkpolicy_skipping_the_rest_of_the_tier() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp(
            "pass",
            Tier::Admin,
            1,
            vec![
                rule(Pass, vec![ns("x")], vec![]),
                rule(Deny, vec![ClusterPeer::Namespaces(Selector::default())], vec![]),
            ],
            vec![],
        ),
    );
    // A later CNP's Accept is skipped too.
    add(
        &mut s,
        cnp(
            "later",
            Tier::Admin,
            2,
            vec![rule(Accept, vec![ns("x")], vec![])],
            vec![],
        ),
    );
    s.policies.insert(
        ("x".into(), "np".into()),
        np(
            "np",
            Some(vec![Rule {
                ports: vec![Port {
                    protocol: Protocol::Tcp,
                    port: PortSpec::Range(80, 80),
                }],
                peers: vec![Peer::Pods(sel(&[("pod", "b")]))],
            }]),
            None,
        ),
    );
    check(
        &s,
        &[
            (IN, "x/b", TCP, 80, (true, Reason::Policy, None)),
            (IN, "x/b", TCP, 81, (false, Reason::PolicyDenied, None)),
            (IN, "y/a", TCP, 80, (false, Reason::AdminDeny, Some(("pass", 1)))),
        ],
    );
    // The evaluator names the Pass.
    let pod = &s.pods[&("x".to_string(), "a".to_string())];
    let v = evaluate_direction(&s, &opts(), pod, IN, ip("x/b"), TCP, 81);
    assert_eq!(v.tiers.len(), 1);
    assert_eq!((v.tiers[0].policy.as_str(), v.tiers[0].action), ("pass", Pass));
    assert!(v.to_string().contains("Pass by clusternetworkpolicy pass"), "{v}");
}

#[test]
fn baseline_decides_when_no_networkpolicy_isolates() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp(
            "base",
            Tier::Baseline,
            1,
            vec![
                rule(Accept, vec![ns("x")], vec![tcp(80, 80)]),
                rule(Deny, vec![ns("y")], vec![]),
            ],
            vec![rule(Deny, vec![ns("y")], vec![])],
        ),
    );
    // A NetworkPolicy isolating x/a for egress only: ingress still goes to
    // the Baseline tier.
    s.policies
        .insert(("x".into(), "eg".into()), np("eg", None, Some(vec![])));
    check(
        &s,
        &[
            (IN, "y/a", TCP, 80, (false, Reason::BaselineDeny, Some(("base", 1)))),
            (IN, "x/b", TCP, 80, (true, Reason::BaselineAccept, Some(("base", 0)))),
            (IN, "x/b", TCP, 81, (true, Reason::NotIsolated, None)),
            // Egress: the NetworkPolicy isolates and decides; Baseline is
            // never reached.
            (EG, "y/a", TCP, 80, (false, Reason::PolicyDenied, None)),
            (EG, "x/b", TCP, 80, (false, Reason::PolicyDenied, None)),
        ],
    );
    // An ingress NetworkPolicy allowing y overrides the Baseline Deny.
    s.policies.insert(
        ("x".into(), "in".into()),
        np(
            "in",
            Some(vec![Rule {
                ports: vec![],
                peers: vec![Peer::Namespaces(sel(&[("ns", "y")]))],
            }]),
            None,
        ),
    );
    check(
        &s,
        &[
            (IN, "y/a", TCP, 80, (true, Reason::Policy, None)),
            (IN, "x/b", TCP, 80, (false, Reason::PolicyDenied, None)),
        ],
    );
}

#[test]
fn admin_accept_overrides_a_networkpolicy_deny_and_host_comes_first() {
    let mut s = snapshot();
    s.policies
        .insert(("x".into(), "deny-all".into()), np("deny-all", Some(vec![]), None));
    add(
        &mut s,
        cnp(
            "admin",
            Tier::Admin,
            1,
            vec![
                rule(Accept, vec![ns("y")], vec![tcp(80, 80)]),
                // Fail-closed "every peer" Deny: the node is still allowed.
                rule(Deny, vec![ClusterPeer::All], vec![ClusterPort::Named("dns".into())]),
            ],
            vec![],
        ),
    );
    check(
        &s,
        &[
            (IN, "y/a", TCP, 80, (true, Reason::AdminAccept, Some(("admin", 0)))),
            (IN, "y/a", TCP, 81, (false, Reason::PolicyDenied, None)),
            (IN, "y/a", UDP, 53, (false, Reason::AdminDeny, Some(("admin", 1)))),
            (IN, "8.8.8.8", UDP, 53, (false, Reason::AdminDeny, Some(("admin", 1)))),
            (IN, NODE_IP, UDP, 53, (true, Reason::Host, None)),
        ],
    );
}

#[test]
fn egress_accept_does_not_override_ingress_at_the_destination() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp("out", Tier::Admin, 1, vec![], vec![rule(Accept, vec![ns("y")], vec![])]),
    );
    // y/a isolated for ingress with no rule.
    s.policies.insert(
        ("y".into(), "deny".into()),
        Policy {
            namespace: "y".into(),
            ..np("deny", Some(vec![]), None)
        },
    );
    let flow = Flow {
        src: ip("x/a"),
        dst: ip("y/a"),
        protocol: TCP,
        dst_port: 80,
    };
    let v = evaluate(&s, &opts(), &flow);
    assert!(v.egress.allowed && !v.ingress.allowed && !v.allowed, "{v}");
    let c = npm_policy::compile(&s, &opts(), None);
    let ep = |n: &str| {
        *c.endpoints
            .iter()
            .find(|(_, e)| format!("{}/{}", e.pod.namespace, e.pod.name) == n)
            .unwrap()
            .0
    };
    let out = lookup(&c, ep("x/a"), EG, ip("y/a"), TCP, 80);
    let inn = lookup(&c, ep("y/a"), IN, ip("x/a"), TCP, 80);
    assert_eq!((out.allowed, out.reason), (true, Reason::AdminAccept));
    assert_eq!((inn.allowed, inn.reason), (false, Reason::PolicyDenied));
}

#[test]
fn named_ports_resolve_on_the_destination_pod() {
    let mut s = snapshot();
    add(
        &mut s,
        cnp(
            "named",
            Tier::Admin,
            1,
            vec![rule(Deny, vec![ns("x")], vec![ClusterPort::Named("http".into())])],
            vec![
                rule(Accept, vec![ns("y")], vec![ClusterPort::Named("dns".into())]),
                // A named port never matches a networks destination.
                rule(
                    Deny,
                    vec![nets(&["10.1.0.0/24"])],
                    vec![ClusterPort::Named("http".into())],
                ),
                rule(Deny, vec![ClusterPeer::All], vec![]),
            ],
        ),
    );
    let r = |i| Some(("named", i));
    check(
        &s,
        &[
            (IN, "x/b", TCP, 80, (false, Reason::AdminDeny, r(0))),
            (IN, "x/b", UDP, 80, (true, Reason::NotIsolated, None)),
            (IN, "x/b", TCP, 81, (true, Reason::NotIsolated, None)),
            (EG, "y/a", UDP, 53, (true, Reason::AdminAccept, r(0))),
            (EG, "y/a", TCP, 53, (false, Reason::AdminDeny, r(2))),
            (EG, "y/a", TCP, 80, (false, Reason::AdminDeny, r(2))),
            (EG, "x/b", UDP, 53, (false, Reason::AdminDeny, r(2))),
        ],
    );
}

#[test]
fn no_cluster_policy_changes_nothing_and_empty_rules_select_nothing() {
    let s = snapshot();
    let c = npm_policy::compile(&s, &opts(), None);
    assert!(c.tiers.is_empty() && c.endpoints.values().all(|e| e.tiers.is_empty()));
    let mut s2 = s.clone();
    // Selects x/a but its only rule matches nothing (an Accept rule
    // emptied by validation): no entry, no presence flag.
    add(
        &mut s2,
        cnp("empty", Tier::Admin, 1, vec![rule(Accept, vec![], vec![])], vec![]),
    );
    let c2 = npm_policy::compile(&s2, &opts(), None);
    assert!(c2.tiers.is_empty() && c2.endpoints.values().all(|e| e.tiers.is_empty()));
    check(&s2, &[(IN, "x/b", TCP, 80, (true, Reason::NotIsolated, None))]);
    // Presence: set iff entries exist, per tier and direction.
    let mut s3 = s.clone();
    add(
        &mut s3,
        cnp("b", Tier::Baseline, 1, vec![], vec![rule(Deny, vec![ns("y")], vec![])]),
    );
    let c3: Compiled = npm_policy::compile(&s3, &opts(), None);
    let xa = c3
        .endpoints
        .values()
        .find(|e| e.pod.name == "a" && e.pod.namespace == "x")
        .unwrap();
    assert!(xa.tiers.baseline_egress && !xa.tiers.baseline_ingress && !xa.tiers.admin_egress);
    assert!(
        c3.render_table().contains("tiers: baseline-egress"),
        "{}",
        c3.render_table()
    );
    assert!(
        c3.render_table().contains("egress Baseline id:"),
        "{}",
        c3.render_table()
    );
}
