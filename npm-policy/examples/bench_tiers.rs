//! ClusterNetworkPolicy compile benchmark: 2,000 pods in 100 namespaces,
//! 100 local endpoints, 1,000 CNPs (half Admin, half Baseline; each selects
//! the pods of 5 namespaces, 3 ingress and 2 egress rules with pod,
//! namespace and CIDR peers, port ranges and overlapping folds). Measures
//! the full compile, the incremental compiler's update for one CNP change,
//! one pod label change and one unrelated pod change (the tier entries are
//! recomputed wholesale on each), the tier entry count, and what the
//! ahead-of-time fold of every endpoint direction and peer class would
//! store (`npm_policy::fold`; one JSON line at the end).
//! Run: `cargo run --release -p npm-policy --example bench_tiers`.

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use npm_policy::compiled::{CompileOptions, Direction, Tier, TierAction};
use npm_policy::incremental::Compiler;
use npm_policy::model::*;
use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};

const PODS: usize = 2_000;
const NAMESPACES: usize = 100;
const CNPS: usize = 1_000;

fn l(pairs: &[(&str, String)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}
fn sel(pairs: &[(&str, String)]) -> Selector {
    Selector {
        match_labels: l(pairs),
        match_expressions: vec![],
    }
}

fn pod(i: usize, app: usize) -> Pod {
    let ns = format!("ns-{}", i % NAMESPACES);
    let j = i / NAMESPACES;
    Pod {
        uid: format!("uid-{i}"),
        namespace: ns,
        name: format!("pod-{j}"),
        labels: l(&[
            ("app", format!("app{}", app % 5)),
            ("tier", if j.is_multiple_of(2) { "front" } else { "back" }.into()),
        ])
        .into(),
        ips: vec![IpAddr::V4(Ipv4Addr::new(
            10,
            (i / 65536) as u8 + 1,
            (i / 256 % 256) as u8,
            (i % 256) as u8,
        ))],
        // Pods 0..100 are on this node (namespaces ns-0..ns-99).
        node_name: Some(format!("node-{}", (i / 100) % 20)),
        phase: PodPhase::Running,
        deleting: false,
        host_network: false,
        ports: vec![ContainerPort {
            name: Some("http".into()),
            port: 8080 + (j % 3) as u16,
            protocol: Protocol::Tcp,
        }],
        created: i as i64,
    }
}

fn cnp(p: usize) -> ClusterPolicy {
    let tcp = |a: u16, b: u16| ClusterPort::Ports {
        protocol: Protocol::Tcp,
        start: a,
        end: b,
    };
    ClusterPolicy {
        name: format!("cnp-{p:04}"),
        tier: if p.is_multiple_of(2) {
            Tier::Admin
        } else {
            Tier::Baseline
        },
        priority: (p % 1000) as u32,
        subject: Subject::Namespaces(sel(&[("team", format!("t{}", p % 20))])),
        ingress: vec![
            ClusterRule {
                name: Some("accept-app".into()),
                action: TierAction::Accept,
                peers: vec![ClusterPeer::Pods {
                    namespaces: sel(&[("team", format!("t{}", (p + 1) % 20))]),
                    pods: sel(&[("app", format!("app{}", p % 5))]),
                }],
                ports: vec![tcp(8080, 8080), ClusterPort::Named("http".into())],
            },
            ClusterRule {
                name: Some("deny-dev".into()),
                action: TierAction::Deny,
                peers: vec![ClusterPeer::Namespaces(sel(&[("env", "dev".into())]))],
                ports: vec![tcp(8000, 8100)],
            },
            ClusterRule {
                name: Some("pass-rest".into()),
                action: TierAction::Pass,
                peers: vec![ClusterPeer::Namespaces(sel(&[("team", format!("t{}", (p + 7) % 20))]))],
                ports: vec![],
            },
        ],
        egress: vec![
            ClusterRule {
                name: Some("deny-range".into()),
                action: TierAction::Deny,
                peers: vec![ClusterPeer::Networks(vec![format!("10.{}.0.0/16", 1 + p % 200)
                    .parse()
                    .unwrap()])],
                ports: vec![tcp(443, 450)],
            },
            ClusterRule {
                name: Some("dns".into()),
                action: TierAction::Accept,
                peers: vec![ClusterPeer::Networks(vec!["0.0.0.0/0".parse().unwrap()])],
                ports: vec![ClusterPort::Ports {
                    protocol: Protocol::Udp,
                    start: 53,
                    end: 53,
                }],
            },
        ],
    }
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    for n in 0..NAMESPACES {
        let name = format!("ns-{n}");
        let labels = l(&[
            ("kubernetes.io/metadata.name", name.clone()),
            ("team", format!("t{}", n % 20)),
            ("env", if n.is_multiple_of(3) { "prod" } else { "dev" }.into()),
        ]);
        s.namespaces.insert(name.clone(), Namespace { name, labels });
    }
    for i in 0..PODS {
        let p = pod(i, i / NAMESPACES);
        s.pods.insert((p.namespace.clone(), p.name.clone()), p);
    }
    for p in 0..CNPS {
        s.insert_cluster_policy(cnp(p), None);
    }
    s
}

fn main() {
    let s = snapshot();
    let opts = CompileOptions {
        node_name: "node-0".into(),
        node_ips: vec!["192.168.0.1".parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    };
    let t = Instant::now();
    let c = npm_policy::compile(&s, &opts, None);
    let full = t.elapsed();
    let presence = c.endpoints.values().filter(|e| !e.tiers.is_empty()).count();
    let per = |d: Direction, t: Tier| c.tiers.keys().filter(|e| e.direction == d && e.tier == t).count();
    println!(
        "{} pods, {} local endpoints ({presence} with tier entries), {} identities, {} CIDR prefixes, {CNPS} CNPs",
        s.pods.len(),
        c.endpoints.len(),
        c.ids.identities.len(),
        c.cidrs.len()
    );
    println!(
        "tier entries: {} (admin ingress {}, admin egress {}, baseline ingress {}, baseline egress {}); policy entries {}",
        c.tiers.len(),
        per(Direction::Ingress, Tier::Admin),
        per(Direction::Egress, Tier::Admin),
        per(Direction::Ingress, Tier::Baseline),
        per(Direction::Egress, Tier::Baseline),
        c.policy.len()
    );
    println!("full compile: {:.1} ms", full.as_secs_f64() * 1e3);
    let t = Instant::now();
    let mut inc = Compiler::new(s.clone(), opts.clone(), Some(&c));
    println!("incremental compiler build: {:.1} ms", t.elapsed().as_secs_f64() * 1e3);
    let time = |what: &str, inc: &mut Compiler, f: &dyn Fn(&mut Compiler, usize)| {
        let mut samples = Vec::new();
        for k in 0..5 {
            let before = inc.compiled().clone();
            let t = Instant::now();
            f(inc, k);
            samples.push(t.elapsed().as_secs_f64() * 1e3);
            let d = before.diff(inc.compiled());
            if k == 0 {
                println!(
                    "  {what}: first diff {} changes ({} tier entries)",
                    d.len(),
                    d.tiers.len()
                );
            }
        }
        samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
        println!("{what}: median {:.1} ms, max {:.1} ms (5 runs)", samples[2], samples[4]);
    };
    time("one CNP changed (priority)", &mut inc, &|inc, k| {
        let mut p = cnp(2 * k);
        p.priority = 1000 - k as u32;
        inc.upsert_cluster_policy(p);
    });
    time("one local pod's labels changed", &mut inc, &|inc, k| {
        inc.upsert_pod(pod(20, 20 + k + 1));
    });
    time("one remote pod's labels changed", &mut inc, &|inc, k| {
        inc.upsert_pod(pod(1_000 + k, 3 + k));
    });
    // The incremental result equals the full compile's tier entries.
    let reference = npm_policy::compile(inc.snapshot(), &opts, Some(inc.compiled()));
    assert_eq!(
        reference.tiers,
        inc.compiled().tiers,
        "incremental tiers differ from the full compile"
    );
    println!("incremental tier entries equal the full compile's");
    fold_size(&c);
}

/// What the ahead-of-time fold ([`npm_policy::fold`]) of this cluster
/// costs: every direction of a local subject that has tier entries or is
/// isolated, for every peer class, folded; the runs and the words an
/// encoding with `NPM_FOLD`'s port classes would store, in all and
/// with the classes of identities a subject's entries do not name sharing
/// one table per CIDR identity (they fold alike). Ends with one JSON line.
fn fold_size(c: &npm_policy::compiled::Compiled) {
    let classes = npm_policy::fold::peer_classes(c);
    let mut fold_time = std::time::Duration::ZERO;
    let (mut tables, mut runs, mut words, mut max_words) = (0usize, 0usize, 0usize, 0usize);
    let (mut compact_tables, mut compact_words) = (0usize, 0usize);
    // Per subject (pod identity): its endpoints share their entries and
    // flags, so one fold serves them all.
    let mut subjects = std::collections::BTreeSet::new();
    for (id, ep) in &c.endpoints {
        if !subjects.insert(ep.identity) {
            continue;
        }
        for dir in [Direction::Ingress, Direction::Egress] {
            let isolated = match dir {
                Direction::Ingress => ep.isolated_ingress,
                Direction::Egress => ep.isolated_egress,
            };
            if !isolated && !ep.tiers.has(Tier::Admin, dir) && !ep.tiers.has(Tier::Baseline, dir) {
                continue;
            }
            // The peer identities the subject's entries name in `dir`: a
            // class of any other identity folds like every other one of
            // its CIDR identity (one shared table per CIDR identity).
            let named: std::collections::BTreeSet<u32> = c
                .policy
                .keys()
                .filter(|e| e.subject == ep.identity && e.direction == dir)
                .map(|e| e.peer)
                .chain(
                    c.tiers
                        .keys()
                        .filter(|e| e.subject == ep.identity && e.direction == dir)
                        .map(|e| e.peer),
                )
                .collect();
            let mut shared = std::collections::BTreeSet::new();
            for class in &classes {
                let t = Instant::now();
                let f = npm_policy::fold::fold(c, *id, dir, *class).expect("a compiled endpoint");
                fold_time += t.elapsed();
                tables += 1;
                runs += f.runs();
                let w = f.front_words();
                words += w;
                max_words = max_words.max(w);
                if named.contains(&class.identity) || shared.insert(class.cidr_identity) {
                    compact_tables += 1;
                    compact_words += w;
                }
            }
        }
    }
    let ms = fold_time.as_secs_f64() * 1e3;
    println!(
        "fold: {} subjects, {} peer classes, {tables} (subject, direction, class) tables, {runs} runs, {words} front words (largest table {max_words}), {ms:.0} ms; with one shared table per CIDR identity for the identities a subject's entries do not name: {compact_tables} tables, {compact_words} words",
        subjects.len(),
        classes.len()
    );
    println!(
        r#"{{"bench":"fold","cnps":{CNPS},"local_endpoints":{},"subjects":{},"peer_classes":{},"tables":{tables},"runs":{runs},"front_words":{words},"max_table_words":{max_words},"compact_tables":{compact_tables},"compact_words":{compact_words},"fold_ms":{ms:.0},"tier_entries":{},"policy_entries":{}}}"#,
        c.endpoints.len(),
        subjects.len(),
        classes.len(),
        c.tiers.len(),
        c.policy.len()
    );
}
