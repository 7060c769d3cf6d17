//! The incremental [`Compiler`] against the reference `compile()`: random
//! snapshots and random changes (pods, labels, namespaces, policies); after
//! each change both give the same tables (compared by meaning, since new
//! ids may be numbered differently), the diff of an unchanged step is
//! empty, and ids of what still exists are stable.

use std::collections::BTreeSet;
use std::net::IpAddr;

use npm_policy::compiled::{CompileOptions, Compiled, Direction, RuleRef, Tier, TierAction};
use npm_policy::incremental::Compiler;
use npm_policy::model::*;
use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> &'a T {
    &v[rng.random_range(0..v.len())]
}

fn labels(rng: &mut StdRng, key: &str, vals: &[&str]) -> Labels {
    let mut l = Labels::new();
    if rng.random_bool(0.7) {
        l.insert(key.to_string(), pick(rng, vals).to_string());
    }
    l
}

fn sel(rng: &mut StdRng, key: &str, vals: &[&str]) -> Selector {
    Selector {
        match_labels: labels(rng, key, vals),
        match_expressions: vec![],
    }
}

/// Container ports: a named port `http` on one of two numbers (sometimes
/// UDP, which a TCP named port must not resolve), or none.
fn ports(rng: &mut StdRng) -> Vec<ContainerPort> {
    if rng.random_bool(0.5) {
        vec![ContainerPort {
            name: Some("http".into()),
            port: *pick(rng, &[80, 8080]),
            protocol: *pick(rng, &[Protocol::Tcp, Protocol::Tcp, Protocol::Tcp, Protocol::Udp]),
        }]
    } else {
        vec![]
    }
}

fn pod(rng: &mut StdRng, i: usize) -> Pod {
    let ns = pick(rng, &["n0", "n1", "n2"]).to_string();
    Pod {
        uid: format!("uid-{i}-{}", rng.random_range(0..1000)),
        namespace: ns,
        name: format!("p{}", rng.random_range(0..8)),
        labels: labels(rng, "app", &["a", "b"]).into(),
        ips: vec![
            format!("10.0.0.{}", rng.random_range(1..10)).parse().unwrap(),
            format!("fd00::{}", rng.random_range(1..4)).parse().unwrap(),
        ][..rng.random_range(0..3)]
            .to_vec(),
        node_name: Some(pick(rng, &["node", "node", "other"]).to_string()),
        phase: *pick(
            rng,
            &[
                PodPhase::Running,
                PodPhase::Running,
                PodPhase::Pending,
                PodPhase::Failed,
            ],
        ),
        deleting: rng.random_bool(0.1),
        host_network: rng.random_bool(0.05),
        ports: ports(rng),
        created: rng.random_range(0..3),
    }
}

fn policy(rng: &mut StdRng) -> Policy {
    let ns = pick(rng, &["n0", "n1", "n2"]).to_string();
    let rule = |rng: &mut StdRng| {
        let peers = (0..rng.random_range(0..3))
            .map(|_| match rng.random_range(0..4) {
                0 => Peer::Pods(sel(rng, "app", &["a", "b"])),
                1 => Peer::Namespaces(sel(rng, "team", &["t1", "t2"])),
                2 => Peer::PodsInNamespaces {
                    namespaces: sel(rng, "team", &["t1", "t2"]),
                    pods: sel(rng, "app", &["a", "b"]),
                },
                _ => Peer::IpBlock(IpBlock {
                    cidr: pick(rng, &["10.0.0.0/29", "10.0.0.0/24", "0.0.0.0/0", "::/0", "fd00::/126"])
                        .parse()
                        .unwrap(),
                    except: vec![],
                }),
            })
            .collect();
        let ports = match rng.random_range(0..3) {
            0 => vec![],
            1 => vec![Port {
                protocol: Protocol::Tcp,
                port: PortSpec::Named("http".into()),
            }],
            _ => vec![Port {
                protocol: Protocol::Tcp,
                port: PortSpec::Range(80, 90),
            }],
        };
        // More rules with a named port and an empty peer list (resolved
        // per destination pod on egress, spec §3, §5).
        let peers = if ports.iter().any(|p| matches!(p.port, PortSpec::Named(_))) && rng.random_bool(0.3) {
            vec![]
        } else {
            peers
        };
        Rule { ports, peers }
    };
    let ni = rng.random_range(0..3);
    let ingress = (0..ni).map(|_| rule(rng)).collect();
    let ne = rng.random_range(0..3);
    let egress = (0..ne).map(|_| rule(rng)).collect();
    Policy {
        namespace: ns,
        name: format!("np{}", rng.random_range(0..4)),
        pod_selector: sel(rng, "app", &["a", "b"]),
        ingress_isolation: rng.random_bool(0.7),
        egress_isolation: rng.random_bool(0.5),
        ingress,
        egress,
    }
}

/// A ClusterNetworkPolicy: subjects and peers by the same labels, CIDR
/// networks overlapping the ipBlocks (new prefixes), named and numbered
/// ports.
fn cluster_policy(rng: &mut StdRng) -> ClusterPolicy {
    let rule = |rng: &mut StdRng, egress: bool| {
        let peers = (0..rng.random_range(1..3))
            .map(|_| match rng.random_range(0..if egress { 5 } else { 3 }) {
                0 => ClusterPeer::Namespaces(sel(rng, "team", &["t1", "t2"])),
                1 => ClusterPeer::Pods {
                    namespaces: sel(rng, "team", &["t1", "t2"]),
                    pods: sel(rng, "app", &["a", "b"]),
                },
                2 => ClusterPeer::All,
                _ => ClusterPeer::Networks(vec![pick(
                    rng,
                    &["10.0.0.0/29", "10.0.0.4/30", "10.0.0.0/16", "fd00::/127"],
                )
                .parse()
                .unwrap()]),
            })
            .collect();
        let ports = match rng.random_range(0..4) {
            0 | 1 => vec![],
            2 => vec![ClusterPort::Named("http".into())],
            _ => vec![ClusterPort::Ports {
                protocol: Protocol::Tcp,
                start: 80,
                end: *pick(rng, &[80, 90]),
            }],
        };
        ClusterRule {
            name: None,
            action: *pick(rng, &[TierAction::Accept, TierAction::Deny, TierAction::Pass]),
            peers,
            ports,
        }
    };
    let ingress = (0..rng.random_range(0..4)).map(|_| rule(rng, false)).collect();
    let egress = (0..rng.random_range(0..4)).map(|_| rule(rng, true)).collect();
    ClusterPolicy {
        name: format!("cnp{}", rng.random_range(0..4)),
        tier: *pick(rng, &[Tier::Admin, Tier::Baseline]),
        priority: *pick(rng, &[1, 1, 7]),
        subject: if rng.random_bool(0.5) {
            Subject::Namespaces(sel(rng, "team", &["t1", "t2"]))
        } else {
            Subject::Pods {
                namespaces: sel(rng, "team", &["t1", "t2"]),
                pods: sel(rng, "app", &["a", "b"]),
            }
        },
        ingress,
        egress,
    }
}

/// `p` with some egress peers of its Accept rules turned into
/// `domainNames` peers, drawn from `rng` (the names' own stream).
fn with_domains(mut p: ClusterPolicy, rng: &mut StdRng) -> ClusterPolicy {
    for r in p.egress.iter_mut().filter(|r| r.action == TierAction::Accept) {
        for peer in &mut r.peers {
            if !matches!(peer, ClusterPeer::All) && rng.random_bool(0.4) {
                let name = *pick(rng, &["a.example.com", "*.example.com", "other.org"]);
                *peer = ClusterPeer::DomainNames(vec![npm_policy::tiers::DomainPattern::parse(name).unwrap()]);
            }
        }
    }
    p
}

/// Learned names for some of `s`'s pod addresses and addresses inside and
/// outside the `networks` of the generated policies, from `rng`.
fn learned(rng: &mut StdRng, s: &Snapshot) -> npm_policy::tiers::LearnedNames {
    let mut addrs: Vec<IpAddr> = s.pods.values().flat_map(|p| p.ips.iter().copied()).collect();
    addrs.extend(["10.0.0.9", "10.1.2.3", "192.0.2.1", "2001:db8::7"].map(|a| a.parse::<IpAddr>().unwrap()));
    let mut out = npm_policy::tiers::LearnedNames::new();
    for name in ["a.example.com", "b.example.com", "other.org"] {
        if rng.random_bool(0.7) {
            let ips = (0..rng.random_range(1..3)).map(|_| *pick(rng, &addrs)).collect();
            out.insert(name.into(), ips);
        }
    }
    out
}

/// `p` with some egress `networks` peers turned into `nodes` peers, drawn
/// from `rng` (the nodes' stream, so the policies' stream stays as it was).
fn with_nodes(mut p: ClusterPolicy, rng: &mut StdRng) -> ClusterPolicy {
    for r in &mut p.egress {
        for peer in &mut r.peers {
            if matches!(peer, ClusterPeer::Networks(_)) && rng.random_bool(0.5) {
                *peer = ClusterPeer::Nodes(sel(rng, "zone", &["z1", "z2"]));
            }
        }
    }
    p
}

/// A Node (`node` is the local one): zone labels, addresses from a pool
/// that collides with pod addresses (10.0.0.3, 10.0.0.5), this node's
/// address (10.0.0.9) and the other nodes' (10.2.0.x, fd00::2).
fn node(rng: &mut StdRng) -> Node {
    let pool = ["10.0.0.9", "10.0.0.3", "10.2.0.1", "10.2.0.2", "fd00::2", "10.0.0.5"];
    let n = rng.random_range(0..4);
    let mut addresses: Vec<std::net::IpAddr> = Vec::new();
    for _ in 0..n {
        let a = pick(rng, &pool).parse().unwrap();
        if !addresses.contains(&a) {
            addresses.push(a);
        }
    }
    Node {
        name: pick(rng, &["node", "w1", "w2", "w3"]).to_string(),
        labels: labels(rng, "zone", &["z1", "z2"]),
        addresses,
    }
}

fn namespace(rng: &mut StdRng, name: &str) -> Namespace {
    let mut l = labels(rng, "team", &["t1", "t2"]);
    l.insert("kubernetes.io/metadata.name".into(), name.into());
    Namespace {
        name: name.into(),
        labels: l,
    }
}

/// The tables by meaning: ids replaced with what they stand for.
fn canonical(c: &Compiled) -> BTreeSet<String> {
    let ident = |id: u32| match c.ids.identities.get(&id) {
        Some(k) => format!("{k:?}"),
        None if c.ids.node_identities.contains_key(&id) => format!("node {:?}", c.ids.node_identities[&id]),
        None => match c.cidrs.iter().find(|(_, v)| **v == id) {
            Some((n, _)) => format!("cidr {n}"),
            None => format!("reserved {id}"),
        },
    };
    let mut out = BTreeSet::new();
    for (ip, e) in &c.ipcache {
        out.insert(format!("ip {ip} {} {}", ident(e.identity), ident(e.cidr_identity)));
    }
    for n in c.cidrs.keys() {
        out.insert(format!("cidr {n}"));
    }
    for n in c.ids.node_identities.values() {
        out.insert(format!("node identity {n:?}"));
    }
    for (id, e) in &c.endpoints {
        out.insert(format!(
            "ep {:?} {} {:?} {:?} {} {} {:?}",
            e.pod,
            ident(e.identity),
            e.ipv4,
            e.ipv6,
            e.isolated_ingress,
            e.isolated_egress,
            e.tiers
        ));
        assert_eq!(c.ids.endpoints.get(&e.pod.uid), Some(id));
    }
    for (e, r) in &c.policy {
        out.insert(format!(
            "entry {} {:?} {} {:?} {:?}",
            ident(e.subject),
            e.direction,
            ident(e.peer),
            e.protocol,
            e.ports
        ));
        assert!(c.ids.rules.contains_key(r), "rule {r} of {e:?} not in the table");
    }
    // Tier entries with their rule by meaning.
    for (e, v) in &c.tiers {
        out.insert(format!(
            "tier {} {:?} {:?} {} {:?} {:?} {:?} rank {} {:?}",
            ident(e.subject),
            e.direction,
            e.tier,
            ident(e.peer),
            e.protocol,
            e.ports,
            v.action,
            v.rank,
            c.ids.rules.get(&v.rule).expect("tier rule in the table")
        ));
    }
    out
}

/// Policy entries of `c` towards a pod identity on a named port's number
/// whose rule is an egress rule of `s` with an empty `to` and named ports
/// only (spec §5: resolved against each destination pod).
fn any_peer_named_entries(c: &Compiled, s: &Snapshot) -> usize {
    c.policy
        .iter()
        .filter(|(e, r)| {
            e.direction == Direction::Egress
                && c.ids.identities.contains_key(&e.peer)
                && match c.ids.rules.get(r) {
                    Some(RuleRef::Policy {
                        namespace,
                        name,
                        direction: Direction::Egress,
                        index,
                    }) => s
                        .policies
                        .get(&(namespace.clone(), name.clone()))
                        .and_then(|p| p.egress.get(*index))
                        .is_some_and(|r| {
                            r.peers.is_empty()
                                && !r.ports.is_empty()
                                && r.ports.iter().all(|p| matches!(p.port, PortSpec::Named(_)))
                        }),
                    _ => false,
                }
        })
        .count()
}

/// The compile options of these tests (this node holds 10.0.0.9).
fn options() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec!["10.0.0.9".parse().unwrap()],
        allow_host_egress: true,
        report_new: false,
    }
}

/// The incremental compiler's tables are the full compile's (`reference`).
fn assert_same(compiler: &Compiled, reference: &Compiled, what: std::fmt::Arguments<'_>) {
    assert_eq!(
        canonical(compiler),
        canonical(reference),
        "{what}\ncompiler:\n{}\nreference:\n{}",
        compiler.render_table(),
        reference.render_table()
    );
}

#[test]
fn compiler_matches_reference() {
    let opts = options();
    let mut changes = 0;
    // Steps whose tables hold entries of an egress rule with an empty `to`
    // and a named port (so the generator covers that case).
    let mut any_peer_named = 0;
    // Steps whose tables hold tier entries.
    let mut tier_steps = 0;
    // Node changes, and steps whose ipcache holds a node identity or whose
    // tier entries name one.
    let (mut node_changes, mut node_ip_steps, mut node_tier_steps) = (0, 0, 0);
    // Learned-name changes, and those that changed tier entries.
    let (mut name_changes, mut name_tier_changes) = (0, 0);
    for seed in 0..300u64 {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut s = Snapshot::default();
        for n in ["n0", "n1", "n2"] {
            s.namespaces.insert(n.into(), namespace(&mut rng, n));
        }
        for i in 0..rng.random_range(2..10) {
            let p = pod(&mut rng, i);
            s.pods.insert((p.namespace.clone(), p.name.clone()), p);
        }
        for _ in 0..rng.random_range(0..4) {
            let p = policy(&mut rng);
            s.policies.insert((p.namespace.clone(), p.name.clone()), p);
        }
        // ClusterNetworkPolicies from their own stream (the rest of the
        // test sees the same random sequence as without them).
        let mut crng = StdRng::seed_from_u64(seed ^ 0xc1_57e5);
        // Nodes (and `nodes` peers) from their own stream too.
        let mut nrng = StdRng::seed_from_u64(seed ^ 0x70de);
        // Learned names (and `domainNames` peers) from their own stream.
        let mut drng = StdRng::seed_from_u64(seed ^ 0xd0_3a17);
        for _ in 0..crng.random_range(1..5) {
            let p = with_domains(with_nodes(cluster_policy(&mut crng), &mut nrng), &mut drng);
            s.insert_cluster_policy(p, None);
        }
        s.domain_names = learned(&mut drng, &s);
        for _ in 0..nrng.random_range(0..4) {
            let n = node(&mut nrng);
            s.nodes.insert(n.name.clone(), n);
        }
        let mut c = Compiler::new(s.clone(), opts.clone(), None);
        assert_eq!(
            canonical(c.compiled()),
            canonical(&npm_policy::compile(&s, &opts, None)),
            "seed {seed} initial"
        );
        for step in 0..15 {
            let before = c.compiled().clone();
            let what = rng.random_range(0..8);
            // A ClusterNetworkPolicy change in a quarter of the steps
            // (its own stream), otherwise the change drawn above.
            let what = match crng.random_range(0..8) {
                0 => 8,
                1 => 9,
                _ => what,
            };
            // A Node change (add, labels, addresses, delete) in a fifth of
            // the steps, before the step's other change, checked alone.
            if nrng.random_range(0..10) < 2 {
                if nrng.random_bool(0.25) {
                    let name = pick(&mut nrng, &["node", "w1", "w2", "w3"]).to_string();
                    s.nodes.remove(&name);
                    c.remove_node(&name);
                } else {
                    let n = node(&mut nrng);
                    s.nodes.insert(n.name.clone(), n.clone());
                    c.upsert_node(n);
                }
                node_changes += 1;
                let reference = npm_policy::compile(&s, &opts, Some(&before));
                assert_same(
                    c.compiled(),
                    &reference,
                    format_args!("seed {seed} step {step} node change"),
                );
            }
            // New learned names in a fifth of the steps, checked alone.
            if drng.random_range(0..10) < 2 {
                let l = learned(&mut drng, &s);
                let tiers_before = c.compiled().tiers.clone();
                s.domain_names = l.clone();
                c.set_domain_names(l);
                name_changes += 1;
                let reference = npm_policy::compile(&s, &opts, Some(&before));
                if reference.tiers != tiers_before {
                    name_tier_changes += 1;
                }
                assert_same(
                    c.compiled(),
                    &reference,
                    format_args!("seed {seed} step {step} learned names change"),
                );
            }
            match what {
                8 => {
                    let p = with_domains(with_nodes(cluster_policy(&mut crng), &mut nrng), &mut drng);
                    s.insert_cluster_policy(p.clone(), None);
                    c.upsert_cluster_policy(p);
                }
                9 => {
                    if let Some(k) = s.cluster_policies.keys().next().cloned() {
                        s.remove_cluster_policy(&k);
                        c.remove_cluster_policy(&k);
                    }
                }
                0 | 1 => {
                    let p = pod(&mut rng, 100 + step);
                    s.pods.insert((p.namespace.clone(), p.name.clone()), p.clone());
                    c.upsert_pod(p);
                }
                2 => {
                    if let Some(k) = s.pods.keys().nth(rng.random_range(0..s.pods.len().max(1))).cloned() {
                        s.pods.remove(&k);
                        c.remove_pod(&k.0, &k.1);
                    }
                }
                3 => {
                    // Label or container port change only.
                    if let Some(k) = s.pods.keys().nth(rng.random_range(0..s.pods.len().max(1))).cloned() {
                        let mut p = s.pods[&k].clone();
                        if rng.random_bool(0.5) {
                            p.labels = labels(&mut rng, "app", &["a", "b"]).into();
                        } else {
                            p.ports = ports(&mut rng);
                        }
                        s.pods.insert(k, p.clone());
                        c.upsert_pod(p);
                    }
                }
                4 => {
                    let n = *pick(&mut rng, &["n0", "n1", "n2"]);
                    if rng.random_bool(0.2) {
                        s.namespaces.remove(n);
                        c.remove_namespace(n);
                    } else {
                        let ns = namespace(&mut rng, n);
                        s.namespaces.insert(n.into(), ns.clone());
                        c.upsert_namespace(ns);
                    }
                }
                5 | 6 => {
                    let p = policy(&mut rng);
                    s.policies.insert((p.namespace.clone(), p.name.clone()), p.clone());
                    c.upsert_policy(p);
                }
                _ => {
                    if let Some(k) = s.policies.keys().next().cloned() {
                        s.policies.remove(&k);
                        c.remove_policy(&k.0, &k.1);
                    }
                }
            }
            changes += 1;
            let reference = npm_policy::compile(&s, &opts, Some(&before));
            if !reference.tiers.is_empty() {
                tier_steps += 1;
            }
            let is_node = |id: &u32| reference.ids.node_identities.contains_key(id);
            if reference.ipcache.values().any(|e| is_node(&e.identity)) {
                node_ip_steps += 1;
            }
            if reference.tiers.keys().any(|e| is_node(&e.peer)) {
                node_tier_steps += 1;
            }
            if any_peer_named_entries(&reference, &s) > 0 {
                any_peer_named += 1;
            }
            assert_same(
                c.compiled(),
                &reference,
                format_args!("seed {seed} step {step} change {what}"),
            );
            // With the compiler's ids, the full compile gives exactly its
            // policy entries and endpoint records: rule ids included (each
            // entry has the smallest id of the rules producing it), which
            // the comparison by meaning above leaves out.
            let same_ids = npm_policy::compile(&s, &opts, Some(c.compiled()));
            assert_eq!(
                c.compiled().policy,
                same_ids.policy,
                "seed {seed} step {step} change {what}: policy entries (with rule ids) differ"
            );
            assert_eq!(
                c.compiled().endpoints,
                same_ids.endpoints,
                "seed {seed} step {step} change {what}: endpoint records differ"
            );
            // Ids of what still exists are stable.
            for (uid, id) in &c.compiled().ids.endpoints {
                if let Some(old) = before.ids.endpoints.get(uid) {
                    assert_eq!(old, id, "seed {seed} step {step}: endpoint id of {uid} changed");
                }
            }
            for (n, id) in &c.compiled().cidrs {
                if let Some(old) = before.cidrs.get(n) {
                    assert_eq!(old, id);
                }
            }
            // A node label set that still exists keeps its identity.
            for (id, n) in &c.compiled().ids.node_identities {
                if let Some((old, _)) = before.ids.node_identities.iter().find(|(_, o)| o.labels == n.labels) {
                    assert_eq!(
                        old, id,
                        "seed {seed} step {step}: node identity of {:?} changed",
                        n.labels
                    );
                }
            }
        }
        assert_eq!(c.snapshot(), &s);
    }
    assert!(changes >= 4000);
    eprintln!(
        "{changes} changes, {tier_steps} with tier entries, {node_changes} node changes, {node_ip_steps} with node \
         addresses, {node_tier_steps} with node tier entries, {name_changes} learned-name changes \
         ({name_tier_changes} changing tier entries)"
    );
    assert!(
        name_tier_changes >= 50,
        "only {name_tier_changes} learned-name changes changed tier entries"
    );
    assert!(node_changes >= 800, "only {node_changes} node changes");
    assert!(node_ip_steps >= 1000, "only {node_ip_steps} steps with node addresses");
    assert!(
        node_tier_steps >= 100,
        "only {node_tier_steps} steps with node tier entries"
    );
    assert!(tier_steps >= 1500, "only {tier_steps} steps with tier entries");
    assert!(
        any_peer_named >= 100,
        "only {any_peer_named} steps with egress named-port entries of an empty `to`"
    );
}

/// Learned names that trade addresses (the set of host prefixes, and so the
/// CIDR identities, stay the same): the tier entries of the CNPs with
/// `domainNames` peers follow the names, as a full compile does.
#[test]
fn learned_names_that_trade_addresses_move_the_tier_entries() {
    let opts = options();
    let mut rng = StdRng::seed_from_u64(7);
    let mut s = Snapshot::default();
    s.namespaces.insert("n0".into(), namespace(&mut rng, "n0"));
    let p = pod(&mut rng, 0);
    s.pods.insert((p.namespace.clone(), p.name.clone()), p);
    let accept_to = |name: &str, priority: u32| ClusterPolicy {
        name: format!("to-{name}"),
        tier: Tier::Admin,
        priority,
        subject: Subject::Namespaces(Selector::default()),
        ingress: vec![],
        egress: vec![ClusterRule {
            name: None,
            action: TierAction::Accept,
            peers: vec![ClusterPeer::DomainNames(vec![npm_policy::tiers::DomainPattern::parse(
                name,
            )
            .unwrap()])],
            ports: vec![],
        }],
    };
    s.insert_cluster_policy(accept_to("a.example.com", 1), None);
    s.insert_cluster_policy(accept_to("b.example.com", 2), None);
    let learned = |a: &str, b: &str| -> npm_policy::tiers::LearnedNames {
        [("a.example.com", a), ("b.example.com", b)]
            .into_iter()
            .map(|(n, ip)| (n.to_string(), [ip.parse::<IpAddr>().unwrap()].into()))
            .collect()
    };
    s.domain_names = learned("192.0.2.1", "192.0.2.2");
    let mut c = Compiler::new(s.clone(), opts.clone(), None);
    let first = c.compiled().clone();
    assert!(!first.tiers.is_empty(), "the names' addresses have tier entries");
    let l = learned("192.0.2.2", "192.0.2.1");
    s.domain_names = l.clone();
    c.set_domain_names(l);
    let reference = npm_policy::compile(&s, &opts, Some(&first));
    assert_eq!(first.cidrs, reference.cidrs, "the same prefixes");
    assert_ne!(first.tiers, reference.tiers, "the entries follow the names");
    assert_eq!(canonical(c.compiled()), canonical(&reference));
    // Forgotten names: no entry left for them.
    s.domain_names.clear();
    c.set_domain_names(Default::default());
    let reference = npm_policy::compile(&s, &opts, Some(&first));
    assert!(reference.tiers.is_empty() && c.compiled().tiers.is_empty());
    assert_eq!(canonical(c.compiled()), canonical(&reference));
}
