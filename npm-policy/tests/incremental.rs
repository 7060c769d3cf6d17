//! Incremental recompiles give minimal diffs with stable ids; IP ownership.

use npm_common::IDENTITY_HOST;
use npm_policy::compiled::{CompileOptions, Compiled, Direction, IdentityKey};
use npm_policy::lookup::lookup;
use npm_policy::model::*;
use npm_sim::cases::Model;

fn sel(pairs: &[(&str, &str)]) -> Selector {
    Selector {
        match_labels: pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
        match_expressions: vec![],
    }
}

fn opts() -> CompileOptions {
    Model::options()
}

/// x/a accepts TCP 80 from x's pods labelled pod=b.
fn model() -> Model {
    let mut m = Model::upstream();
    m.snapshot.policies.insert(
        ("x".into(), "p".into()),
        Policy {
            namespace: "x".into(),
            name: "p".into(),
            pod_selector: sel(&[("pod", "a")]),
            ingress_isolation: true,
            egress_isolation: false,
            ingress: vec![Rule {
                ports: vec![Port {
                    protocol: Protocol::Tcp,
                    port: PortSpec::Range(80, 80),
                }],
                peers: vec![Peer::Pods(sel(&[("pod", "b")]))],
            }],
            egress: vec![],
        },
    );
    m
}

fn ep(c: &Compiled, pod: &str) -> u32 {
    *c.endpoints
        .iter()
        .find(|(_, e)| format!("{}/{}", e.pod.namespace, e.pod.name) == pod)
        .unwrap()
        .0
}

#[test]
fn recompile_without_change_is_empty_and_ids_stable() {
    let m = model();
    let c1 = npm_policy::compile(&m.snapshot, &opts(), None);
    assert_eq!(c1.endpoints.len(), 9);
    assert_eq!(c1.ipcache.len(), 18);
    assert_eq!(c1.policy.len(), 1);
    let c2 = npm_policy::compile(&m.snapshot, &opts(), Some(&c1));
    assert_eq!(c1, c2);
    assert!(c1.diff(&c2).is_empty());
}

#[test]
fn pod_label_change_touches_only_that_pod() {
    let mut m = model();
    let c1 = npm_policy::compile(&m.snapshot, &opts(), None);
    let xb_id = c1.ipcache[&m.ip("x/b").unwrap()].identity;
    m.snapshot.pods.get_mut(&("x".into(), "c".into())).unwrap().labels = sel(&[("pod", "b")]).match_labels.into();
    let c2 = npm_policy::compile(&m.snapshot, &opts(), Some(&c1));
    let d = c1.diff(&c2);
    // x/c now shares x/b's identity: its 2 addresses and its endpoint
    // change; the policy entry for x/b's identity already allows it.
    assert_eq!((d.ipcache.upsert.len(), d.ipcache.remove.len()), (2, 0), "{d:?}");
    assert_eq!(d.endpoints.upsert.len(), 1);
    assert!(d.policy.is_empty() && d.cidrs.is_empty());
    assert_eq!(d.len(), 3);
    assert_eq!(c2.ipcache[&m.ip("x/c").unwrap()].identity, xb_id);
    assert_eq!(
        c2.ids.identities.len(),
        c1.ids.identities.len() - 1,
        "x/c's old identity is released"
    );
    assert!(lookup(&c2, ep(&c2, "x/a"), Direction::Ingress, m.ip("x/c").unwrap(), 6, 80).allowed);
    // Every other endpoint keeps its id.
    for (id, e) in &c1.endpoints {
        assert_eq!(c2.endpoints[id].pod, e.pod);
    }
}

#[test]
fn namespace_label_change_touches_its_pods() {
    let mut m = model();
    let c1 = npm_policy::compile(&m.snapshot, &opts(), None);
    m.snapshot
        .namespaces
        .get_mut("z")
        .unwrap()
        .labels
        .insert("team".into(), "blue".into());
    let c2 = npm_policy::compile(&m.snapshot, &opts(), Some(&c1));
    let d = c1.diff(&c2);
    assert_eq!(d.ipcache.upsert.len(), 6);
    assert_eq!(d.endpoints.upsert.len(), 3);
    assert_eq!(d.len(), 9);
    // New identities are fresh numbers, never reused ones.
    let old_max = *c1.ids.identities.keys().max().unwrap();
    for (_, e) in &d.ipcache.upsert {
        assert!(e.identity > old_max);
    }
}

#[test]
fn policy_add_and_remove() {
    let mut m = model();
    let c1 = npm_policy::compile(&m.snapshot, &opts(), None);
    let q = Policy {
        namespace: "y".into(),
        name: "q".into(),
        pod_selector: sel(&[("pod", "a")]),
        ingress_isolation: true,
        egress_isolation: false,
        ingress: vec![Rule {
            ports: vec![],
            peers: vec![Peer::IpBlock(IpBlock {
                cidr: "198.18.1.0/24".parse().unwrap(),
                except: vec![],
            })],
        }],
        egress: vec![],
    };
    m.snapshot.policies.insert(("y".into(), "q".into()), q);
    let c2 = npm_policy::compile(&m.snapshot, &opts(), Some(&c1));
    let d = c1.diff(&c2);
    // 1 CIDR, x's three IPv4 addresses get its CIDR identity, y/a becomes
    // isolated, one allow entry.
    assert_eq!(
        (d.cidrs.len(), d.ipcache.len(), d.endpoints.len(), d.policy.len()),
        (1, 3, 1, 1),
        "{d:?}"
    );
    assert!(lookup(&c2, ep(&c2, "y/a"), Direction::Ingress, m.ip("x/b").unwrap(), 6, 1).allowed);
    assert!(!lookup(&c2, ep(&c2, "y/a"), Direction::Ingress, m.ip("z/b").unwrap(), 6, 1).allowed);
    // Rule ids of the untouched policy are stable.
    assert_eq!(
        c1.policy.values().collect::<Vec<_>>(),
        c2.policy
            .iter()
            .filter(|(e, _)| e.subject == c2.endpoints[&ep(&c2, "x/a")].identity)
            .map(|(_, r)| r)
            .collect::<Vec<_>>()
    );
    m.snapshot.policies.remove(&("y".into(), "q".into()));
    let c3 = npm_policy::compile(&m.snapshot, &opts(), Some(&c2));
    let d = c2.diff(&c3);
    assert_eq!(
        (
            d.cidrs.remove.len(),
            d.ipcache.upsert.len(),
            d.endpoints.upsert.len(),
            d.policy.remove.len()
        ),
        (1, 3, 1, 1)
    );
    assert!(c1.diff(&c3).is_empty(), "back to the first state");
    // Port change of the existing policy: one entry out, one in.
    m.snapshot.policies.get_mut(&("x".into(), "p".into())).unwrap().ingress[0].ports[0].port = PortSpec::Range(81, 81);
    let c4 = npm_policy::compile(&m.snapshot, &opts(), Some(&c3));
    let d = c3.diff(&c4);
    assert_eq!((d.policy.upsert.len(), d.policy.remove.len(), d.len()), (1, 1, 2));
}

#[test]
fn ids_never_reused() {
    let mut m = model();
    let c1 = npm_policy::compile(&m.snapshot, &opts(), None);
    let old = c1.ids.endpoints[&m.snapshot.pods[&("y".into(), "c".into())].uid];
    let old_identity = c1.ipcache[&m.ip("y/c").unwrap()].identity;
    m.snapshot.pods.remove(&("y".into(), "c".into()));
    let c2 = npm_policy::compile(&m.snapshot, &opts(), Some(&c1));
    assert_eq!(c1.diff(&c2).len(), 3, "2 addresses and 1 endpoint removed");
    // Same name and labels again, new uid: a new endpoint id; the identity
    // key is back, but after a compile without it the id is new too.
    m.apply(&npm_sim::cases::Action::CreatePod(npm_sim::cases::PodLabels {
        pod: "y/c".into(),
        labels: sel(&[("pod", "c")]).match_labels,
    }))
    .unwrap();
    let c3 = npm_policy::compile(&m.snapshot, &opts(), Some(&c2));
    let new = c3.ids.endpoints[&m.snapshot.pods[&("y".into(), "c".into())].uid];
    assert!(new > old && new >= c1.ids.next_endpoint);
    assert!(c3.ipcache[&m.ip("y/c").unwrap()].identity > old_identity);
}

#[test]
fn cidr_identities_stable() {
    let mut m = model();
    let blk = |c: &str| {
        Peer::IpBlock(IpBlock {
            cidr: c.parse().unwrap(),
            except: vec![],
        })
    };
    m.snapshot.policies.get_mut(&("x".into(), "p".into())).unwrap().ingress[0].peers =
        vec![blk("10.0.0.0/8"), blk("172.16.0.0/12")];
    let c1 = npm_policy::compile(&m.snapshot, &opts(), None);
    m.snapshot.policies.get_mut(&("x".into(), "p".into())).unwrap().ingress[0]
        .peers
        .insert(0, blk("192.168.0.0/16"));
    let c2 = npm_policy::compile(&m.snapshot, &opts(), Some(&c1));
    for (n, id) in &c1.cidrs {
        assert_eq!(c2.cidrs[n], *id, "{n}");
    }
    assert_eq!(c1.diff(&c2).cidrs.len(), 1);
}

fn pod(uid: &str, name: &str, ip: &str, phase: PodPhase, deleting: bool, created: i64) -> Pod {
    Pod {
        uid: uid.into(),
        namespace: "x".into(),
        name: name.into(),
        labels: sel(&[("pod", name)]).match_labels.into(),
        ips: if ip.is_empty() {
            vec![]
        } else {
            vec![ip.parse().unwrap()]
        },
        node_name: Some("npm-node".into()),
        phase,
        deleting,
        host_network: false,
        ports: vec![],
        created,
    }
}

#[test]
fn ip_ownership() {
    // Incident 1: stale pod A (deleting) and live pod B share 10.9.0.1.
    let mut m = Model::upstream();
    let s = &mut m.snapshot;
    s.pods.insert(
        ("x".into(), "stale".into()),
        pod("uid-a", "stale", "10.9.0.1", PodPhase::Running, true, 100),
    );
    s.pods.insert(
        ("x".into(), "live".into()),
        pod("uid-b", "live", "10.9.0.1", PodPhase::Running, false, 50),
    );
    // Older pending object vs newer pending object: newest wins.
    s.pods.insert(
        ("x".into(), "old".into()),
        pod("uid-c", "old", "10.9.0.2", PodPhase::Pending, false, 10),
    );
    s.pods.insert(
        ("x".into(), "new".into()),
        pod("uid-d", "new", "10.9.0.2", PodPhase::Pending, false, 20),
    );
    // Terminal pod with a (reused) address and a Running pod without one.
    s.pods.insert(
        ("x".into(), "done".into()),
        pod("uid-e", "done", "10.9.0.3", PodPhase::Succeeded, false, 30),
    );
    s.pods.insert(
        ("x".into(), "noip".into()),
        pod("uid-f", "noip", "", PodPhase::Running, false, 30),
    );
    // A policy selecting the stale pod: it must never apply to the live one.
    s.policies.insert(
        ("x".into(), "stale-only".into()),
        Policy {
            namespace: "x".into(),
            name: "stale-only".into(),
            pod_selector: sel(&[("pod", "stale")]),
            ingress_isolation: true,
            egress_isolation: true,
            ingress: vec![],
            egress: vec![],
        },
    );
    let o = CompileOptions {
        node_ips: vec!["192.168.0.10".parse().unwrap()],
        ..opts()
    };
    let c = npm_policy::compile(&m.snapshot, &o, None);
    let by_uid = |uid: &str| c.endpoints.values().find(|e| e.pod.uid == uid);
    let live = by_uid("uid-b").expect("live pod is an endpoint");
    assert!(
        !live.isolated_ingress && !live.isolated_egress,
        "live pod must not carry the stale pod's policies"
    );
    assert!(by_uid("uid-a").is_none(), "stale pod loses its address and endpoint");
    assert_eq!(c.ipcache[&"10.9.0.1".parse().unwrap()].identity, live.identity);
    assert!(by_uid("uid-d").is_some() && by_uid("uid-c").is_none());
    assert!(by_uid("uid-e").is_none() && !c.ipcache.contains_key(&"10.9.0.3".parse().unwrap()));
    assert!(by_uid("uid-f").is_none());
    assert!(!c
        .ids
        .identities
        .values()
        .any(|k: &IdentityKey| k.pod_labels.get("pod").map(String::as_str) == Some("noip")));
    assert!(!c.policy.keys().any(|e| Some(e.subject)
        == c.ids
            .endpoints
            .get("uid-a")
            .and_then(|id| c.endpoints.get(id))
            .map(|r| r.identity)));
    assert_eq!(c.ipcache[&"192.168.0.10".parse().unwrap()].identity, IDENTITY_HOST);
    // Tie on state and time: the greater uid wins, deterministically.
    let mut m2 = Model::upstream();
    m2.snapshot.pods.insert(
        ("x".into(), "p1".into()),
        pod("uid-1", "p1", "10.9.0.9", PodPhase::Running, false, 5),
    );
    m2.snapshot.pods.insert(
        ("x".into(), "p2".into()),
        pod("uid-2", "p2", "10.9.0.9", PodPhase::Running, false, 5),
    );
    let c = npm_policy::compile(&m2.snapshot, &opts(), None);
    assert!(c.endpoints.values().any(|e| e.pod.uid == "uid-2") && !c.endpoints.values().any(|e| e.pod.uid == "uid-1"));
}

#[test]
fn compiler_apply_policy_validates_and_fails_closed() {
    let m = model();
    let mut c = npm_policy::incremental::Compiler::new(m.snapshot.clone(), opts(), None);
    assert_eq!(c.compiled().policy.len(), 1);
    let mut np: k8s_openapi::api::networking::v1::NetworkPolicy = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "p", "namespace": "x"},
        "spec": {"podSelector": {"matchLabels": {"pod": "a"}}, "ingress": [{"ports": [{"port": 80, "endPort": 70}]}]}
    }))
    .unwrap();
    let err = c.apply_policy(&np).unwrap_err();
    assert!(
        err.errors[0].starts_with("x/p: spec.ingress[0].ports[0].endPort:"),
        "{:?}",
        err.errors
    );
    assert!(
        err.errors[0].contains("rule spec.ingress[0] dropped"),
        "{:?}",
        err.errors
    );
    // The version with a bad port replaced the valid one: its only rule is
    // dropped, and x/a stays isolated (invalid input fails closed).
    assert!(c.compiled().policy.is_empty());
    let xa = ep(c.compiled(), "x/a");
    assert!(c.compiled().endpoints[&xa].isolated_ingress);
    assert!(!lookup(c.compiled(), xa, Direction::Ingress, m.ip("z/c").unwrap(), 6, 75).allowed);
    assert_eq!(c.snapshot().invalid_policies.len(), 1);
    np.spec.as_mut().unwrap().ingress.as_mut().unwrap()[0]
        .ports
        .as_mut()
        .unwrap()[0]
        .end_port = Some(90);
    c.apply_policy(&np).unwrap();
    assert!(c.snapshot().invalid_policies.is_empty());
    let xa = ep(c.compiled(), "x/a");
    assert!(lookup(c.compiled(), xa, Direction::Ingress, m.ip("z/c").unwrap(), 6, 85).allowed);
    assert!(!lookup(c.compiled(), xa, Direction::Ingress, m.ip("z/c").unwrap(), 6, 91).allowed);
}

#[test]
fn ip_ownership_tie_on_uid_is_the_same_incrementally() {
    // Two objects with the same uid, age and state claim one address: the
    // smaller `namespace/name` owns it (its identity is the address's), in
    // the full compile and in the incremental compiler whatever the order
    // the pods arrive in.
    let m = Model::upstream();
    let ip = "10.9.0.9".parse().unwrap();
    let owner = |c: &Compiled| {
        let id = c.ipcache[&ip].identity;
        c.ids.identities[&id].pod_labels["pod"].clone()
    };
    let mut s = m.snapshot.clone();
    for name in ["p2", "p1"] {
        s.upsert_pod(pod("uid-same", name, "10.9.0.9", PodPhase::Running, false, 5));
    }
    assert_eq!(owner(&npm_policy::compile(&s, &opts(), None)), "p1");
    for order in [["p1", "p2"], ["p2", "p1"]] {
        let mut c = npm_policy::incremental::Compiler::new(m.snapshot.clone(), opts(), None);
        for name in order {
            c.upsert_pod(pod("uid-same", name, "10.9.0.9", PodPhase::Running, false, 5));
        }
        assert_eq!(owner(c.compiled()), "p1", "order {order:?}");
    }
}

#[test]
fn report_new_option_flags_every_endpoint_in_the_full_and_incremental_compile() {
    let m = model();
    let on = CompileOptions {
        report_new: true,
        ..opts()
    };
    let full = npm_policy::compile(&m.snapshot, &on, None);
    assert!(!full.endpoints.is_empty());
    assert!(full.endpoints.values().all(|e| e.report_new));
    let off = npm_policy::compile(&m.snapshot, &opts(), None);
    assert!(off.endpoints.values().all(|e| !e.report_new));
    // The incremental compiler keeps the flag on endpoints it re-emits
    // (a label change) and on new ones (a new local pod).
    let mut inc = npm_policy::incremental::Compiler::new(m.snapshot.clone(), on.clone(), None);
    let mut c = m.snapshot.pods[&("x".to_string(), "c".to_string())].clone();
    c.labels = sel(&[("pod", "b")]).match_labels.into();
    inc.upsert_pod(c.clone());
    let mut d = c;
    d.name = "d".into();
    d.uid = "uid-x-d".into();
    d.ips = vec!["10.0.9.9".parse().unwrap()];
    inc.upsert_pod(d);
    assert!(inc.compiled().endpoints.len() > full.endpoints.len());
    assert!(inc.compiled().endpoints.values().all(|e| e.report_new));
    assert_eq!(
        inc.compiled(),
        &npm_policy::compile(inc.snapshot(), &on, Some(inc.compiled()))
    );
}

/// A changed or removed policy is patched in place (only the entries
/// towards the peers of its old or new version are emitted again, from
/// every rule of the endpoint): after each step the compiler's policy
/// entries and endpoint records are exactly those of a full compile with
/// its ids, rule ids included. The steps cover an entry shared by two
/// policies (it keeps the other's rule), a new identity between two
/// changes with the same peers (the peer set carried over from the old
/// version must not outlive the change), an egress rule with an empty `to`
/// and a named port (every pod identity resolving the name), and removals.
#[test]
fn policy_changes_are_patched_like_a_full_compile() {
    use npm_policy::incremental::Compiler;
    let mut m = model();
    let pk = |n: &str| ("x".to_string(), n.to_string());
    // r: the same peers and port as p, so their entries coincide.
    let mut r = m.snapshot.policies[&pk("p")].clone();
    r.name = "r".into();
    m.snapshot.policies.insert(pk("r"), r.clone());
    let mut c = Compiler::new(m.snapshot.clone(), opts(), None);
    let check = matches_full_compile;
    check(&c, "initial");
    let xa = ep(c.compiled(), "x/a");
    let allows = |c: &Compiler, pod: &str, port: u16| {
        lookup(c.compiled(), xa, Direction::Ingress, m.ip(pod).unwrap(), 6, port).allowed
    };
    // p's port only: r keeps port 80, p gets 81.
    let mut p = c.snapshot().policies[&pk("p")].clone();
    p.ingress[0].ports[0].port = PortSpec::Range(81, 81);
    c.upsert_policy(p.clone());
    check(&c, "p's port");
    assert!(allows(&c, "x/b", 80) && allows(&c, "x/b", 81));
    // A new identity selected by p's and r's peers (pod=b with a named port).
    let mut b2 = pod("uid-b2", "b2", "10.9.0.7", PodPhase::Running, false, 1);
    b2.labels = sel(&[("pod", "b")]).match_labels.into();
    b2.node_name = Some("elsewhere".into());
    b2.ports = vec![ContainerPort {
        name: Some("http".into()),
        port: 8080,
        protocol: Protocol::Tcp,
    }];
    c.upsert_pod(b2);
    check(&c, "new identity");
    // A new policy with the same peers: its set holds the new identity.
    let mut q = p.clone();
    q.name = "q".into();
    q.ingress[0].ports[0].port = PortSpec::Range(90, 90);
    c.upsert_policy(q);
    check(&c, "q added");
    assert!(c
        .compiled()
        .policy
        .keys()
        .any(|e| e.subject == c.compiled().endpoints[&xa].identity
            && e.ports == (90, 90)
            && c.compiled().ids.identities[&e.peer].pod_labels.contains_key("pod")
            && c.compiled().ids.identities[&e.peer].named_ports.len() == 1));
    p.ingress[0].ports[0].port = PortSpec::Range(82, 82);
    c.upsert_policy(p);
    check(&c, "p's port again");
    // r: egress to every pod on its named port `http`, then on UDP (which
    // no pod names).
    r.egress_isolation = true;
    r.egress = vec![Rule {
        ports: vec![Port {
            protocol: Protocol::Tcp,
            port: PortSpec::Named("http".into()),
        }],
        peers: vec![],
    }];
    c.upsert_policy(r.clone());
    check(&c, "r egress named");
    assert!(c
        .compiled()
        .policy
        .keys()
        .any(|e| e.direction == Direction::Egress && e.ports == (8080, 8080)));
    r.egress[0].ports[0].protocol = Protocol::Udp;
    c.upsert_policy(r);
    check(&c, "r egress named UDP");
    c.remove_policy("x", "p");
    check(&c, "p removed");
    assert!(allows(&c, "x/b", 80) && !allows(&c, "x/b", 82));
    c.remove_policy("x", "r");
    check(&c, "r removed");
    c.remove_policy("x", "q");
    check(&c, "q removed");
    assert!(c.compiled().policy.is_empty());
}

/// Policy entries are keyed by subject (the endpoints' pod identity): two
/// local pods of one identity share one set of entries, a relabelled pod
/// moves to its new identity's entries without changing the other's, and
/// a subject's entries go with its last endpoint. The incremental
/// compiler agrees with the full compile at every step, and the verdicts
/// follow the pods' current labels.
#[test]
fn endpoints_of_one_identity_share_their_subjects_entries() {
    let mut m = model();
    // x/c joins x/a's identity: both are selected by `p`.
    m.snapshot.pods.get_mut(&("x".into(), "c".into())).unwrap().labels = sel(&[("pod", "a")]).match_labels.into();
    let mut inc = npm_policy::incremental::Compiler::new(m.snapshot.clone(), opts(), None);
    let c = inc.compiled().clone();
    same_tables(&c, &npm_policy::compile(&m.snapshot, &opts(), Some(&c)));
    let (xa, xc) = (ep(&c, "x/a"), ep(&c, "x/c"));
    let subject = c.endpoints[&xa].identity;
    assert_eq!(c.endpoints[&xc].identity, subject, "x/a and x/c share an identity");
    // One entry (TCP 80 from pod=b), once for both endpoints.
    assert_eq!(c.policy.len(), 1);
    assert!(c.policy.keys().all(|e| e.subject == subject));
    let xb = m.ip("x/b").unwrap();
    for e in [xa, xc] {
        assert!(lookup(&c, e, Direction::Ingress, xb, 6, 80).allowed);
        assert!(!lookup(&c, e, Direction::Ingress, xb, 6, 81).allowed);
    }
    // x/c is relabelled: a new identity, not selected by `p`.
    let c2 = relabel(&mut m, &mut inc, "c", "c2");
    let d = c.diff(&c2);
    assert!(d.policy.is_empty(), "x/a's subject keeps its entries: {:?}", d.policy);
    assert_ne!(c2.endpoints[&xc].identity, subject);
    assert!(!c2.endpoints[&xc].isolated_ingress);
    assert!(
        lookup(&c2, xc, Direction::Ingress, xb, 6, 81).allowed,
        "x/c is not isolated any more"
    );
    assert!(!lookup(&c2, xa, Direction::Ingress, xb, 6, 81).allowed);
    // x/a goes: its subject had no other endpoint, its entries go.
    inc.remove_pod("x", "a");
    m.snapshot.pods.remove(&("x".to_string(), "a".to_string()));
    let c3 = inc.compiled().clone();
    same_tables(&c3, &npm_policy::compile(&m.snapshot, &opts(), Some(&c3)));
    assert!(c3.policy.is_empty(), "{:?}", c3.policy);
}

/// The incremental compiler's state is the full compile's (`what` names
/// the step).
fn matches_full_compile(c: &npm_policy::incremental::Compiler, what: &str) {
    let full = npm_policy::compile(c.snapshot(), &opts(), Some(c.compiled()));
    assert_eq!(c.compiled().policy, full.policy, "{what}: policy entries");
    assert_eq!(c.compiled().endpoints, full.endpoints, "{what}: endpoint records");
    assert!(c.compiled().diff(&full).is_empty(), "{what}: diff");
}

/// Relabels pod `x/name` to `pod=label` in the model and the incremental
/// compiler; returns the compiled form, checked against a full compile.
fn relabel(m: &mut Model, inc: &mut npm_policy::incremental::Compiler, name: &str, label: &str) -> Compiled {
    let key = ("x".to_string(), name.to_string());
    let mut pod = m.snapshot.pods[&key].clone();
    pod.labels = sel(&[("pod", label)]).match_labels.into();
    inc.upsert_pod(pod.clone());
    m.snapshot.pods.insert(key, pod);
    let c = inc.compiled().clone();
    same_tables(&c, &npm_policy::compile(&m.snapshot, &opts(), Some(&c)));
    c
}

/// The tables two compiles program (the rule id table aside: the
/// incremental compiler keeps the ids of a policy's rules while it exists).
fn same_tables(a: &Compiled, b: &Compiled) {
    assert_eq!(a.ipcache, b.ipcache);
    assert_eq!(a.endpoints, b.endpoints);
    assert_eq!(a.policy, b.policy);
    assert_eq!(a.tiers, b.tiers);
}

/// ClusterNetworkPolicy tier entries are keyed by subject too: two local
/// pods of one identity share them (and both get the tier presence), a
/// relabelled pod leaves them, and the Admin Deny decides the verdicts of
/// exactly the pods its subject selects now.
#[test]
fn endpoints_of_one_identity_share_their_subjects_tier_entries() {
    use npm_policy::compiled::{Tier, TierAction};
    use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterRule, Subject};
    let mut m = Model::upstream();
    m.snapshot.pods.get_mut(&("x".into(), "c".into())).unwrap().labels = sel(&[("pod", "a")]).match_labels.into();
    let cnp = ClusterPolicy {
        name: "deny-to-a".into(),
        tier: Tier::Admin,
        priority: 5,
        subject: Subject::Pods {
            namespaces: Selector::default(),
            pods: sel(&[("pod", "a")]),
        },
        ingress: vec![ClusterRule {
            name: None,
            action: TierAction::Deny,
            peers: vec![ClusterPeer::Namespaces(Selector::default())],
            ports: vec![],
        }],
        egress: vec![],
    };
    m.snapshot.insert_cluster_policy(cnp, None);
    let mut inc = npm_policy::incremental::Compiler::new(m.snapshot.clone(), opts(), None);
    let c = inc.compiled().clone();
    same_tables(&c, &npm_policy::compile(&m.snapshot, &opts(), Some(&c)));
    let (xa, xc) = (ep(&c, "x/a"), ep(&c, "x/c"));
    let subject = c.endpoints[&xa].identity;
    assert_eq!(c.endpoints[&xc].identity, subject);
    // Pods labelled pod=a: x/a, x/c, y/a, z/a: three identities (x/a and
    // x/c share one), each with one entry per peer identity.
    let subjects: std::collections::BTreeSet<u32> = c.tiers.keys().map(|e| e.subject).collect();
    assert_eq!(subjects.len(), 3, "{subjects:?}");
    assert!(subjects.contains(&subject));
    let yb = m.ip("y/b").unwrap();
    for e in [xa, xc] {
        assert!(c.endpoints[&e].tiers.admin_ingress);
        assert!(!lookup(&c, e, Direction::Ingress, yb, 6, 80).allowed);
    }
    // x/c is relabelled: it leaves the subject, the Deny no longer applies.
    let c2 = relabel(&mut m, &mut inc, "c", "c2");
    // x/a's subject keeps its entries; it only gains one towards x/c's
    // new identity (a peer of the Deny: every namespace).
    let d = c.diff(&c2);
    let xc_new = c2.endpoints[&xc].identity;
    assert!(d.tiers.remove.iter().all(|e| e.subject != subject), "{:?}", d.tiers);
    assert!(
        d.tiers
            .upsert
            .iter()
            .all(|(e, _)| e.subject != subject || e.peer == xc_new),
        "{:?}",
        d.tiers
    );
    assert!(!c2.endpoints[&xc].tiers.admin_ingress);
    assert!(lookup(&c2, xc, Direction::Ingress, yb, 6, 80).allowed);
    assert!(!lookup(&c2, xa, Direction::Ingress, yb, 6, 80).allowed);
}

/// A policy change towards many peers (more than are patched entry by
/// entry) rebuilds the subject's (subject, direction) group: the entries
/// that other rules give towards the same peers stay, those of the other
/// direction are untouched, and the result is the full compile's at every
/// step, with the verdicts to match.
#[test]
fn a_policy_change_towards_many_peers_is_patched_like_a_full_compile() {
    use npm_policy::incremental::Compiler;
    let mut m = model();
    // 100 remote pods, each of its own identity, all labelled role=peer.
    for i in 0..100u32 {
        let mut p = pod(
            &format!("uid-peer{i}"),
            &format!("peer{i}"),
            &format!("10.9.1.{i}"),
            PodPhase::Running,
            false,
            1,
        );
        p.labels = sel(&[("role", "peer"), ("n", &i.to_string())]).match_labels.into();
        p.node_name = Some("elsewhere".into());
        m.snapshot.pods.insert(("x".into(), p.name.clone()), p);
    }
    let pk = |n: &str| ("x".to_string(), n.to_string());
    let tcp = |a: u16, b: u16| Port {
        protocol: Protocol::Tcp,
        port: PortSpec::Range(a, b),
    };
    // wide: x/a accepts TCP 80 from every role=peer pod, and may send to
    // them on TCP 443.
    let wide = Policy {
        namespace: "x".into(),
        name: "wide".into(),
        pod_selector: sel(&[("pod", "a")]),
        ingress_isolation: true,
        egress_isolation: true,
        ingress: vec![Rule {
            ports: vec![tcp(80, 80)],
            peers: vec![Peer::Pods(sel(&[("role", "peer")]))],
        }],
        egress: vec![Rule {
            ports: vec![tcp(443, 443)],
            peers: vec![Peer::Pods(sel(&[("role", "peer")]))],
        }],
    };
    // narrow: the same port from peer7 only (its entry coincides with one
    // of wide's), and 22 from peer8.
    let narrow = Policy {
        name: "narrow".into(),
        egress_isolation: false,
        ingress: vec![
            Rule {
                ports: vec![tcp(80, 80)],
                peers: vec![Peer::Pods(sel(&[("n", "7")]))],
            },
            Rule {
                ports: vec![tcp(22, 22)],
                peers: vec![Peer::Pods(sel(&[("n", "8")]))],
            },
        ],
        egress: vec![],
        ..wide.clone()
    };
    m.snapshot.policies.insert(pk("wide"), wide.clone());
    m.snapshot.policies.insert(pk("narrow"), narrow);
    let mut c = Compiler::new(m.snapshot.clone(), opts(), None);
    let check = matches_full_compile;
    check(&c, "initial");
    let xa = ep(c.compiled(), "x/a");
    let from = |c: &Compiler, i: u32, port: u16| {
        let ip = format!("10.9.1.{i}").parse().unwrap();
        lookup(c.compiled(), xa, Direction::Ingress, ip, 6, port).allowed
    };
    let to = |c: &Compiler, i: u32, port: u16| {
        let ip = format!("10.9.1.{i}").parse().unwrap();
        lookup(c.compiled(), xa, Direction::Egress, ip, 6, port).allowed
    };
    assert!(from(&c, 3, 80) && from(&c, 7, 80) && from(&c, 8, 22) && to(&c, 3, 443));
    // wide's ingress port moves to 8080: 100 peers' entries are rewritten.
    let mut w = wide.clone();
    w.ingress[0].ports = vec![tcp(8080, 8080)];
    c.upsert_policy(w.clone());
    check(&c, "wide's port");
    assert!(!from(&c, 3, 80) && from(&c, 3, 8080));
    assert!(from(&c, 7, 80), "narrow's entry towards peer7 stays");
    assert!(from(&c, 8, 22) && to(&c, 3, 443), "the other entries stay");
    // wide selects half the peers on ingress.
    w.ingress[0].peers = vec![Peer::Pods(Selector {
        match_labels: [("role".to_string(), "peer".to_string())].into(),
        match_expressions: vec![Requirement {
            key: "n".into(),
            operator: Operator::In,
            values: (0..50).map(|i| i.to_string()).collect(),
        }],
    })];
    c.upsert_policy(w);
    check(&c, "wide's half");
    assert!(from(&c, 3, 8080) && !from(&c, 60, 8080) && from(&c, 7, 80));
    c.remove_policy("x", "wide");
    check(&c, "wide removed");
    assert!(!from(&c, 3, 8080) && from(&c, 7, 80) && from(&c, 8, 22));
    c.remove_policy("x", "narrow");
    check(&c, "narrow removed");
}
