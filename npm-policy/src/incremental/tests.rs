//! The incremental tier entries against the full compile: random sequences
//! of ClusterNetworkPolicy changes (creations, priority-only changes that
//! re-rank equal-priority neighbours, subject changes that move endpoints
//! in and out, tier moves, deletions), pod changes (labels, named ports,
//! moves between nodes, removals) and namespace relabels (peers and
//! subjects by namespace labels), NetworkPolicies and Nodes; after every
//! change the tier entries and every endpoint's tier presence equal
//! exactly those of [`crate::compile()`] keeping the compiler's ids.

use std::collections::BTreeMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::compiled::{CompileOptions, Compiled, Tier, TierAction, TierEntry, TierValue};
use crate::model::{ContainerPort, Namespace, Node, Peer, Pod, PodPhase, Policy, Protocol, Rule, Selector, Snapshot};
use crate::tiers::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};

use super::Compiler;

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> &'a T {
    &v[rng.random_range(0..v.len())]
}

fn sel(rng: &mut StdRng, key: &str, vals: &[&str]) -> Selector {
    let mut s = Selector::default();
    if rng.random_bool(0.8) {
        s.match_labels.insert(key.into(), pick(rng, vals).to_string());
    }
    s
}

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec!["10.0.0.250".parse().unwrap()],
        allow_host_egress: true,
        report_new: false,
    }
}

fn namespace(rng: &mut StdRng, name: &str) -> Namespace {
    let mut labels = BTreeMap::new();
    labels.insert("kubernetes.io/metadata.name".into(), name.to_string());
    if rng.random_bool(0.8) {
        labels.insert("team".into(), pick(rng, &["t1", "t2", "t3"]).to_string());
    }
    Namespace {
        name: name.into(),
        labels: labels.into_iter().collect(),
    }
}

fn pod(rng: &mut StdRng, i: usize) -> Pod {
    let mut labels = BTreeMap::new();
    if rng.random_bool(0.8) {
        labels.insert("app".to_string(), pick(rng, &["a", "b", "c"]).to_string());
    }
    Pod {
        uid: format!("uid-{i}-{}", rng.random_range(0..1000)),
        namespace: pick(rng, &["n0", "n1", "n2", "n3"]).to_string(),
        name: format!("p{}", rng.random_range(0..10)),
        labels: labels.into_iter().collect(),
        ips: vec![format!("10.0.0.{}", rng.random_range(1..40)).parse().unwrap()],
        node_name: Some(pick(rng, &["node", "node", "other"]).to_string()),
        phase: PodPhase::Running,
        deleting: false,
        host_network: false,
        ports: if rng.random_bool(0.5) {
            vec![ContainerPort {
                name: Some("http".into()),
                port: *pick(rng, &[80, 8080]),
                protocol: Protocol::Tcp,
            }]
        } else {
            vec![]
        },
        created: 0,
    }
}

fn subject(rng: &mut StdRng) -> Subject {
    if rng.random_bool(0.5) {
        Subject::Namespaces(sel(rng, "team", &["t1", "t2", "t3"]))
    } else {
        Subject::Pods {
            namespaces: sel(rng, "team", &["t1", "t2", "t3"]),
            pods: sel(rng, "app", &["a", "b", "c"]),
        }
    }
}

fn rule(rng: &mut StdRng, egress: bool) -> ClusterRule {
    let peers = (0..rng.random_range(1..3))
        .map(|_| match rng.random_range(0..if egress { 6 } else { 4 }) {
            0 | 1 => ClusterPeer::Namespaces(sel(rng, "team", &["t1", "t2", "t3"])),
            2 => ClusterPeer::Pods {
                namespaces: sel(rng, "team", &["t1", "t2", "t3"]),
                pods: sel(rng, "app", &["a", "b", "c"]),
            },
            3 => ClusterPeer::All,
            4 => ClusterPeer::Nodes(sel(rng, "zone", &["z1", "z2"])),
            _ => ClusterPeer::Networks(vec![pick(rng, &["10.0.0.0/27", "10.0.0.8/29", "10.1.0.0/16"])
                .parse()
                .unwrap()]),
        })
        .collect();
    let ports = match rng.random_range(0..5) {
        0 | 1 => vec![],
        2 => vec![ClusterPort::Named("http".into())],
        _ => vec![ClusterPort::Ports {
            protocol: Protocol::Tcp,
            start: *pick(rng, &[80, 85]),
            end: *pick(rng, &[90, 100]),
        }],
    };
    ClusterRule {
        name: None,
        action: *pick(rng, &[TierAction::Accept, TierAction::Deny, TierAction::Pass]),
        peers,
        ports,
    }
}

fn cluster_policy(rng: &mut StdRng) -> ClusterPolicy {
    ClusterPolicy {
        name: format!("c{}", rng.random_range(0..8)),
        tier: *pick(rng, &[Tier::Admin, Tier::Admin, Tier::Baseline]),
        // Few priorities: equal-priority neighbours are re-ranked.
        priority: *pick(rng, &[1, 1, 2, 5]),
        subject: subject(rng),
        ingress: (0..rng.random_range(0..4)).map(|_| rule(rng, false)).collect(),
        egress: (0..rng.random_range(0..4)).map(|_| rule(rng, true)).collect(),
    }
}

fn network_policy(rng: &mut StdRng) -> Policy {
    Policy {
        namespace: pick(rng, &["n0", "n1", "n2", "n3"]).to_string(),
        name: format!("np{}", rng.random_range(0..3)),
        pod_selector: sel(rng, "app", &["a", "b", "c"]),
        ingress_isolation: true,
        egress_isolation: rng.random_bool(0.5),
        ingress: vec![Rule {
            ports: vec![],
            peers: if rng.random_bool(0.5) {
                vec![Peer::IpBlock(crate::model::IpBlock {
                    cidr: pick(rng, &["10.0.0.0/28", "10.0.0.16/28"]).parse().unwrap(),
                    except: vec![],
                })]
            } else {
                vec![]
            },
        }],
        egress: vec![],
    }
}

fn node(rng: &mut StdRng) -> Node {
    let mut labels = BTreeMap::new();
    labels.insert("zone".to_string(), pick(rng, &["z1", "z2"]).to_string());
    Node {
        name: pick(rng, &["node", "w1", "w2"]).to_string(),
        labels: labels.into_iter().collect(),
        addresses: vec![format!("10.2.0.{}", rng.random_range(1..4)).parse().unwrap()],
    }
}

/// The incremental tier entries and presence equal the full compile's.
fn check(c: &Compiler, s: &Snapshot, before: &Compiled, what: &str) {
    assert_eq!(c.snapshot(), s, "{what}: snapshots differ");
    let reference = crate::compile(s, &opts(), Some(before));
    let ours = c.compiled();
    // The full compile keeps the ids of `before`, the ids of new rules
    // aside: compare rules by what they stand for.
    let by_meaning = |x: &Compiled| {
        x.tiers
            .iter()
            .map(|(e, v)| (*e, v.action, v.rank, x.ids.rules.get(&v.rule).cloned()))
            .collect::<Vec<_>>()
    };
    assert_eq!(by_meaning(ours), by_meaning(&reference), "{what}: tier entries differ");
    assert!(
        by_meaning(ours).iter().all(|t| t.3.is_some()),
        "{what}: a tier rule id is unknown"
    );
    let presence = |x: &Compiled| x.endpoints.iter().map(|(id, e)| (*id, e.tiers)).collect::<Vec<_>>();
    assert_eq!(presence(ours), presence(&reference), "{what}: tier presence differs");
    assert_eq!(ours.endpoints, reference.endpoints, "{what}: endpoint records differ");
}

#[test]
fn incremental_tiers_match_full_compile() {
    let mut steps = 0;
    let mut with_entries = 0;
    for seed in 0..120u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut s = Snapshot::default();
        for n in ["n0", "n1", "n2", "n3"] {
            s.namespaces.insert(n.into(), namespace(&mut rng, n));
        }
        for i in 0..rng.random_range(4..14) {
            let p = pod(&mut rng, i);
            s.pods.insert((p.namespace.clone(), p.name.clone()), p);
        }
        for _ in 0..rng.random_range(1..6) {
            s.insert_cluster_policy(cluster_policy(&mut rng), None);
        }
        let mut c = Compiler::new(s.clone(), opts(), None);
        check(&c, &s, c.compiled(), &format!("seed {seed} initial"));
        assert_eq!(c.take_tier_touched(), None, "a new compiler touched every endpoint");
        // The compiled form at the last `take_tier_touched` (taken at two
        // steps of three: what it names accumulates in between).
        let mut taken = c.compiled().clone();
        for step in 0..30 {
            let before = c.compiled().clone();
            let what = rng.random_range(0..12);
            match what {
                0 => {
                    let p = cluster_policy(&mut rng);
                    s.insert_cluster_policy(p.clone(), None);
                    c.upsert_cluster_policy(p);
                }
                1 | 2 => {
                    // Only the priority (1) or only the subject (2) of an
                    // existing one.
                    let Some(mut p) = s
                        .cluster_policies
                        .values()
                        .nth(rng.random_range(0..s.cluster_policies.len().max(1)))
                        .cloned()
                    else {
                        continue;
                    };
                    if what == 1 {
                        p.priority = *pick(&mut rng, &[1, 1, 2, 5, 9]);
                    } else {
                        p.subject = subject(&mut rng);
                    }
                    s.insert_cluster_policy(p.clone(), None);
                    c.upsert_cluster_policy(p);
                }
                3 => {
                    let Some(name) = s
                        .cluster_policies
                        .keys()
                        .nth(rng.random_range(0..s.cluster_policies.len().max(1)))
                        .cloned()
                    else {
                        continue;
                    };
                    s.remove_cluster_policy(&name);
                    c.remove_cluster_policy(&name);
                }
                4 | 5 => {
                    let p = pod(&mut rng, 100 + step);
                    s.pods.insert((p.namespace.clone(), p.name.clone()), p.clone());
                    c.upsert_pod(p);
                }
                6 => {
                    // Labels, named ports or node of an existing pod.
                    let Some(k) = s.pods.keys().nth(rng.random_range(0..s.pods.len().max(1))).cloned() else {
                        continue;
                    };
                    let mut p = s.pods[&k].clone();
                    match rng.random_range(0..3) {
                        0 => p.labels = pod(&mut rng, 0).labels,
                        1 => p.ports = pod(&mut rng, 0).ports,
                        _ => p.node_name = Some(pick(&mut rng, &["node", "other"]).to_string()),
                    }
                    s.pods.insert(k, p.clone());
                    c.upsert_pod(p);
                }
                7 => {
                    let Some(k) = s.pods.keys().nth(rng.random_range(0..s.pods.len().max(1))).cloned() else {
                        continue;
                    };
                    s.pods.remove(&k);
                    c.remove_pod(&k.0, &k.1);
                }
                8 | 9 => {
                    let n = *pick(&mut rng, &["n0", "n1", "n2", "n3"]);
                    let ns = namespace(&mut rng, n);
                    s.namespaces.insert(n.into(), ns.clone());
                    c.upsert_namespace(ns);
                }
                10 => {
                    let p = network_policy(&mut rng);
                    s.policies.insert((p.namespace.clone(), p.name.clone()), p.clone());
                    c.upsert_policy(p);
                }
                _ => {
                    let n = node(&mut rng);
                    s.nodes.insert(n.name.clone(), n.clone());
                    c.upsert_node(n);
                }
            }
            steps += 1;
            if !c.compiled().tiers.is_empty() {
                with_entries += 1;
            }
            check(&c, &s, &before, &format!("seed {seed} step {step} change {what}"));
            if !(seed as usize + step).is_multiple_of(3) {
                // The tier entries changed only on the subjects named.
                let touched = c.take_tier_touched().expect("taken before");
                let ours = c.compiled();
                let outside = |m: &BTreeMap<TierEntry, TierValue>| {
                    m.iter()
                        .filter(|(e, _)| !touched.contains(&e.subject))
                        .map(|(e, v)| (*e, *v))
                        .collect::<Vec<_>>()
                };
                assert_eq!(
                    outside(&taken.tiers),
                    outside(&ours.tiers),
                    "seed {seed} step {step} change {what}: tier entries changed outside {touched:?}"
                );
                taken = ours.clone();
            }
        }
    }
    assert!(steps >= 3000, "only {steps} steps");
    assert!(with_entries >= 2000, "only {with_entries} steps with tier entries");
}

/// Equal priorities: a CNP created (or renamed into place) before another
/// of its priority moves that one's ranks; the other's endpoints are
/// recomputed although its subject selects none of the new one's.
#[test]
fn equal_priority_neighbour_is_reranked() {
    let mut s = Snapshot::default();
    for (n, team) in [("n0", "t1"), ("n1", "t2")] {
        let mut labels = crate::model::Labels::new();
        labels.insert("team".into(), team.into());
        s.namespaces.insert(n.into(), Namespace { name: n.into(), labels });
    }
    for (i, ns) in ["n0", "n1"].iter().enumerate() {
        let p = Pod {
            uid: format!("u{i}"),
            namespace: ns.to_string(),
            name: "p".into(),
            labels: Default::default(),
            ips: vec![format!("10.0.0.{}", i + 1).parse().unwrap()],
            node_name: Some("node".into()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: false,
            ports: vec![],
            created: 0,
        };
        s.pods.insert((p.namespace.clone(), p.name.clone()), p);
    }
    let team = |t: &str| {
        let mut sel = Selector::default();
        sel.match_labels.insert("team".into(), t.into());
        sel
    };
    let cnp = |name: &str, t: &str| ClusterPolicy {
        name: name.into(),
        tier: Tier::Admin,
        priority: 3,
        subject: Subject::Namespaces(team(t)),
        ingress: vec![ClusterRule {
            name: None,
            action: TierAction::Deny,
            peers: vec![ClusterPeer::Namespaces(Selector::default())],
            ports: vec![],
        }],
        egress: vec![],
    };
    s.insert_cluster_policy(cnp("b", "t2"), None);
    let mut c = Compiler::new(s.clone(), opts(), None);
    let rank_of_b = |c: &Compiler| c.compiled().tiers.values().map(|v| v.rank).collect::<Vec<_>>();
    let old = rank_of_b(&c);
    let before = c.compiled().clone();
    // "a" sorts before "b" at priority 3 and selects only n0's pod.
    s.insert_cluster_policy(cnp("a", "t1"), None);
    c.upsert_cluster_policy(cnp("a", "t1"));
    check(&c, &s, &before, "a created");
    let b_entries: Vec<u32> = c
        .compiled()
        .tiers
        .iter()
        .filter(|(_, v)| matches!(c.compiled().ids.rules.get(&v.rule), Some(crate::compiled::RuleRef::Cluster { name, .. }) if name == "b"))
        .map(|(_, v)| v.rank)
        .collect();
    assert!(!b_entries.is_empty());
    assert_ne!(b_entries, old, "b's rank moved");
    let before = c.compiled().clone();
    s.remove_cluster_policy("a");
    c.remove_cluster_policy("a");
    check(&c, &s, &before, "a removed");
    assert_eq!(rank_of_b(&c), old);
}

/// One copy of a pod's key is shared by the claims on its address, its
/// address's owner entry and its identity: after a full build, after the
/// pod changes (a new address) and after its namespace is relabelled.
#[test]
fn a_pods_key_is_one_copy_in_the_claims_owners_and_identities() {
    let mut rng = StdRng::seed_from_u64(7);
    let mut s = Snapshot::default();
    s.upsert_namespace(namespace(&mut rng, "n0"));
    let mut pods: Vec<Pod> = (0..3).map(|i| pod(&mut rng, i)).collect();
    for (i, p) in pods.iter_mut().enumerate() {
        p.namespace = "n0".into();
        p.name = format!("p{i}");
        p.ips = vec![format!("10.0.1.{i}").parse().unwrap()];
        s.upsert_pod(p.clone());
    }
    let key = ("n0".to_string(), "p1".to_string());
    let one_copy = |c: &Compiler, what: &str| {
        let copies = c.key_copies(&key);
        assert_eq!(copies.len(), 3, "{what}: claimant, owner, identity: {copies:?}");
        assert!(copies.iter().all(|k| k.shares(copies[0])), "{what}: one copy");
    };
    let mut c = Compiler::new(s, opts(), None);
    one_copy(&c, "full build");
    let mut moved = pods[1].clone();
    moved.ips = vec!["10.0.1.9".parse().unwrap()];
    c.upsert_pod(moved);
    one_copy(&c, "new address");
    let mut relabelled = namespace(&mut rng, "n0");
    relabelled.labels.insert("new".into(), "label".into());
    c.upsert_namespace(relabelled);
    one_copy(&c, "namespace relabelled");
    c.remove_pod("n0", "p1");
    assert!(c.key_copies(&key).is_empty(), "removed: no copy left");
}
