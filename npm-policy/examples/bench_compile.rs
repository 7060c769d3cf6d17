//! Compile benchmark: PODS pods in PODS/20 namespaces, POLICIES policies,
//! a node with LOCAL local endpoints (defaults 10,000 / 1,000 / 100).
//! Measures a full compile, a single-pod label update and a single-policy
//! update (incremental, checked against the reference path), peak RSS and
//! the entry counts, and ends with one JSON line holding the scale.
//! Run: `cargo xtask bench compile -- [PODS [POLICIES [LOCAL]]]`, or
//! `cargo run --release -p npm-policy --example bench_compile -- ...`
//! (with `NPM_BENCH_ANY_PEER_NAMED=1`, the egress policies also hold a rule
//! with a named port and an empty `to`).

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use npm_policy::compiled::CompileOptions;
use npm_policy::incremental::Compiler;
use npm_policy::model::*;

/// The scale of a run.
#[derive(Clone, Copy, Debug)]
struct Scale {
    pods: usize,
    namespaces: usize,
    policies: usize,
    /// Nodes: `pods / local`, so node-0 has `local` endpoints.
    nodes: usize,
}

impl Scale {
    /// `[PODS [POLICIES [LOCAL]]]`, defaults 10,000 / 1,000 / 100; one
    /// namespace per 20 pods (500 at 10,000).
    fn from_args() -> Result<Scale, String> {
        let args: Vec<String> = std::env::args().skip(1).collect();
        let arg = |i: usize, default: usize, what: &str| -> Result<usize, String> {
            match args.get(i) {
                None => Ok(default),
                Some(a) => a
                    .parse::<usize>()
                    .ok()
                    .filter(|n| *n > 0)
                    .ok_or_else(|| format!("{what} must be a positive integer, got {a:?}")),
            }
        };
        if args.len() > 3 {
            return Err(format!("usage: bench_compile [PODS [POLICIES [LOCAL]]], got {args:?}"));
        }
        let pods = arg(0, 10_000, "PODS")?;
        let policies = arg(1, 1_000, "POLICIES")?;
        let local = arg(2, 100, "LOCAL")?;
        if pods < 20 || local > pods {
            return Err(format!(
                "need PODS >= 20 and LOCAL <= PODS (got {pods} pods, {local} local)"
            ));
        }
        if pods > 250 * 65_536 {
            return Err(format!(
                "at most {} pods (addresses 10.1.0.0 - 10.250.255.255)",
                250 * 65_536
            ));
        }
        Ok(Scale {
            pods,
            namespaces: pods / 20,
            policies,
            nodes: pods / local,
        })
    }
}

fn l(pairs: &[(&str, String)]) -> Labels {
    pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}
fn sel(pairs: &[(&str, String)]) -> Selector {
    Selector {
        match_labels: l(pairs),
        match_expressions: vec![],
    }
}

/// `NPM_BENCH_ANY_PEER_NAMED=1`: the egress policies also get a rule with
/// a named port and an empty `to`, which expands over every pod identity
/// that resolves the name.
fn any_peer_named() -> bool {
    std::env::var("NPM_BENCH_ANY_PEER_NAMED").is_ok_and(|v| v == "1")
}

fn snapshot(sc: Scale) -> Snapshot {
    let mut s = Snapshot::default();
    for n in 0..sc.namespaces {
        let name = format!("ns-{n}");
        let labels = l(&[
            ("kubernetes.io/metadata.name", name.clone()),
            ("team", format!("t{}", n % 20)),
            ("env", if n.is_multiple_of(3) { "prod" } else { "dev" }.into()),
        ]);
        s.namespaces.insert(name.clone(), Namespace { name, labels });
    }
    for i in 0..sc.pods {
        let ns = format!("ns-{}", i % sc.namespaces);
        let j = i / sc.namespaces;
        let pod = Pod {
            uid: format!("uid-{i}"),
            namespace: ns.clone(),
            name: format!("pod-{j}"),
            labels: l(&[
                ("app", format!("app{}", j % 5)),
                ("pod-template-hash", format!("h{}", j % 7)),
                ("tier", if j.is_multiple_of(2) { "front" } else { "back" }.into()),
            ])
            .into(),
            ips: vec![IpAddr::V4(Ipv4Addr::new(
                10,
                (i / 65536) as u8 + 1,
                (i / 256 % 256) as u8,
                (i % 256) as u8,
            ))],
            node_name: Some(format!("node-{}", i % sc.nodes)),
            phase: PodPhase::Running,
            deleting: false,
            host_network: false,
            ports: vec![
                ContainerPort {
                    name: Some("http".into()),
                    port: 8080 + (j % 3) as u16,
                    protocol: Protocol::Tcp,
                },
                ContainerPort {
                    name: Some("metrics".into()),
                    port: 9090,
                    protocol: Protocol::Tcp,
                },
            ],
            created: i as i64,
        };
        s.pods.insert((ns, pod.name.clone()), pod);
    }
    for p in 0..sc.policies {
        let n = p % sc.namespaces;
        let ns = format!("ns-{n}");
        let k = p / sc.namespaces;
        let app = |x: usize| ("app", format!("app{}", x % 5));
        let port = |a: u16, b: u16| Port {
            protocol: Protocol::Tcp,
            port: PortSpec::Range(a, b),
        };
        let named = |name: &str| Port {
            protocol: Protocol::Tcp,
            port: PortSpec::Named(name.into()),
        };
        let (ingress_isolation, egress_isolation, ingress, egress, pod_selector) = match (p / 7) % 5 {
            0 => (true, false, vec![], vec![], Selector::default()),
            1 => (
                true,
                false,
                vec![Rule {
                    ports: vec![port(8080, 8080)],
                    peers: vec![Peer::Pods(sel(&[app(p + 1)]))],
                }],
                vec![],
                sel(&[app(p)]),
            ),
            2 => (
                true,
                false,
                vec![Rule {
                    ports: vec![port(8000, 8100)],
                    peers: vec![Peer::Namespaces(sel(&[("team", format!("t{}", p % 20))]))],
                }],
                vec![],
                sel(&[app(p + k)]),
            ),
            3 => (
                false,
                true,
                vec![],
                vec![
                    Rule {
                        ports: vec![named("http"), port(443, 443)],
                        peers: vec![Peer::IpBlock(IpBlock {
                            cidr: "10.0.0.0/8".parse().unwrap(),
                            except: vec![
                                format!("10.{}.0.0/16", 1 + p % 200).parse().unwrap(),
                                format!("10.1.{}.0/24", p % 250).parse().unwrap(),
                            ],
                        })],
                    },
                    Rule {
                        ports: vec![Port {
                            protocol: Protocol::Udp,
                            port: PortSpec::Range(53, 53),
                        }],
                        peers: vec![],
                    },
                ]
                .into_iter()
                .chain(any_peer_named().then(|| Rule {
                    ports: vec![named("http")],
                    peers: vec![],
                }))
                .collect(),
                sel(&[("tier", "front".into())]),
            ),
            _ => (
                true,
                true,
                vec![Rule {
                    ports: vec![named("metrics")],
                    peers: vec![Peer::PodsInNamespaces {
                        namespaces: sel(&[("env", "prod".into())]),
                        pods: sel(&[("app", "app0".into())]),
                    }],
                }],
                vec![Rule {
                    ports: vec![named("http")],
                    peers: vec![Peer::Pods(sel(&[app(p + 2)]))],
                }],
                sel(&[app(p + 3)]),
            ),
        };
        let name = format!("np-{k}");
        s.policies.insert(
            (ns.clone(), name.clone()),
            Policy {
                namespace: ns,
                name,
                pod_selector,
                ingress_isolation,
                egress_isolation,
                ingress,
                egress,
            },
        );
    }
    s
}

fn peak_rss_mb() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .unwrap_or(0)
        / 1024
}

/// Updates of each kind measured beyond the first.
const REPEATS: usize = 20;

/// Median and maximum.
fn stats(v: &mut [f64]) -> (f64, f64) {
    v.sort_by(f64::total_cmp);
    (v[v.len() / 2], v[v.len() - 1])
}

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let sc = match Scale::from_args() {
        Ok(sc) => sc,
        Err(e) => {
            eprintln!("bench_compile: {e}");
            std::process::exit(2);
        }
    };
    let local = sc.pods / sc.nodes;
    println!(
        "scale: {} pods, {} namespaces, {} policies, {} nodes (~{local} local endpoints)",
        sc.pods, sc.namespaces, sc.policies, sc.nodes
    );
    let t = Instant::now();
    let s = snapshot(sc);
    println!("snapshot built: {:.1} ms", ms(t.elapsed()));
    let opts = CompileOptions {
        node_name: "node-0".into(),
        node_ips: vec!["192.168.0.10".parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    };

    let t = Instant::now();
    let full = npm_policy::compile(&s, &opts, None);
    let full_ms = ms(t.elapsed());
    let (endpoints, entries) = (full.endpoints.len(), full.policy.len());
    println!(
        "full compile: {full_ms:.1} ms ({} endpoints, {} ipcache, {} cidrs, {} identities, {} policy entries)",
        full.endpoints.len(),
        full.ipcache.len(),
        full.cidrs.len(),
        full.ids.identities.len(),
        full.policy.len()
    );

    // Reference path: compile() again with prev after a pod label change.
    let key = s
        .pods
        .values()
        .find(|p| p.node_name.as_deref() == Some("node-0"))
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .unwrap();
    let reference_diff = {
        let mut s2 = s.clone();
        s2.pods
            .get_mut(&key)
            .unwrap()
            .labels
            .insert("app".into(), "app4".into());
        let t = Instant::now();
        let reference = npm_policy::compile(&s2, &opts, Some(&full));
        println!(
            "compile() with prev after a pod change (reference path): {:.1} ms",
            ms(t.elapsed())
        );
        full.diff(&reference)
    };

    // The incremental compiler.
    let t = Instant::now();
    let mut compiler = Compiler::new(s, opts.clone(), Some(&full));
    drop(full);
    let new_ms = ms(t.elapsed());
    println!("Compiler::new: {new_ms:.1} ms");

    // One local pod's labels change.
    let mut pod = compiler.snapshot().pods[&key].clone();
    pod.labels.insert("app".into(), "app4".into());
    let before = compiler.compiled().clone();
    let t = Instant::now();
    compiler.upsert_pod(pod);
    let pod_ms = ms(t.elapsed());
    let d = before.diff(compiler.compiled());
    assert_eq!(d, reference_diff, "incremental and reference diffs agree");
    println!(
        "pod update: {pod_ms:.3} ms (diff: {} ipcache, {} endpoints, {} policy)",
        d.ipcache.len(),
        d.endpoints.len(),
        d.policy.len()
    );

    // One remote pod's labels change.
    let rkey = compiler
        .snapshot()
        .pods
        .values()
        .find(|p| p.node_name.as_deref().is_some_and(|n| n != "node-0"))
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .unwrap();
    let mut pod = compiler.snapshot().pods[&rkey].clone();
    pod.labels.insert("app".into(), "app1".into());
    let before = compiler.compiled().clone();
    let t = Instant::now();
    compiler.upsert_pod(pod);
    let remote_ms = ms(t.elapsed());
    let d = before.diff(compiler.compiled());
    println!(
        "remote pod update: {remote_ms:.3} ms (diff: {} ipcache, {} policy)",
        d.ipcache.len(),
        d.policy.len()
    );

    // One policy's port changes: one that selects local endpoints.
    let on_node = |p: &Policy| {
        compiler.snapshot().pods.values().any(|pod| {
            pod.node_name.as_deref() == Some("node-0")
                && pod.namespace == p.namespace
                && p.pod_selector.matches(&pod.labels)
        })
    };
    let pk = compiler
        .snapshot()
        .policies
        .iter()
        .find(|(_, p)| {
            on_node(p)
                && p.ingress.first().is_some_and(|r| {
                    matches!(
                        r.ports.first(),
                        Some(Port {
                            port: PortSpec::Range(8080, 8080),
                            ..
                        })
                    )
                })
        })
        .map(|(k, _)| k.clone())
        .unwrap();
    let mut pol = compiler.snapshot().policies[&pk].clone();
    pol.ingress[0].ports[0].port = PortSpec::Range(8081, 8081);
    let before = compiler.compiled().clone();
    let t = Instant::now();
    compiler.upsert_policy(pol);
    let policy_ms = ms(t.elapsed());
    let d = before.diff(compiler.compiled());
    println!(
        "policy update: {policy_ms:.3} ms (diff: {} policy entries)",
        d.policy.len()
    );

    // More of each (the machine is shared: medians and maxima of
    // REPEATS + 1 updates, the first ones above included).
    let mut pod_times = vec![pod_ms];
    let locals: Vec<_> = compiler
        .snapshot()
        .pods
        .values()
        .filter(|p| p.node_name.as_deref() == Some("node-0") && (p.namespace.clone(), p.name.clone()) != key)
        .take(REPEATS)
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .collect();
    for k in &locals {
        let mut pod = compiler.snapshot().pods[k].clone();
        pod.labels.insert("app".into(), "app4".into());
        let t = Instant::now();
        compiler.upsert_pod(pod);
        pod_times.push(ms(t.elapsed()));
    }
    let mut remote_times = vec![remote_ms];
    let remotes: Vec<_> = compiler
        .snapshot()
        .pods
        .values()
        .filter(|p| {
            p.node_name.as_deref().is_some_and(|n| n != "node-0") && (p.namespace.clone(), p.name.clone()) != rkey
        })
        .step_by(97)
        .take(REPEATS)
        .map(|p| (p.namespace.clone(), p.name.clone()))
        .collect();
    for k in &remotes {
        let mut pod = compiler.snapshot().pods[k].clone();
        pod.labels.insert("app".into(), "app1".into());
        let t = Instant::now();
        compiler.upsert_pod(pod);
        remote_times.push(ms(t.elapsed()));
    }
    let mut policy_times = vec![policy_ms];
    let on_node = |p: &Policy| {
        compiler.snapshot().pods.values().any(|pod| {
            pod.node_name.as_deref() == Some("node-0")
                && pod.namespace == p.namespace
                && p.pod_selector.matches(&pod.labels)
        })
    };
    let pols: Vec<Policy> = compiler
        .snapshot()
        .policies
        .values()
        .filter(|p| p.ingress_isolation && !p.ingress.is_empty() && !p.ingress[0].ports.is_empty() && on_node(p))
        .filter(|p| (p.namespace.clone(), p.name.clone()) != pk)
        .take(REPEATS)
        .cloned()
        .collect();
    for mut pol in pols {
        pol.ingress[0].ports[0].port = PortSpec::Range(7000, 7001);
        let t = Instant::now();
        compiler.upsert_policy(pol);
        policy_times.push(ms(t.elapsed()));
    }
    let (pod_med, pod_max) = stats(&mut pod_times);
    let (remote_med, remote_max) = stats(&mut remote_times);
    let (policy_med, policy_max) = stats(&mut policy_times);
    println!(
        "median / max of {} local pod updates: {pod_med:.3} / {pod_max:.3} ms; {} remote: {remote_med:.3} / {remote_max:.3} ms; {} policy updates: {policy_med:.3} / {policy_max:.3} ms",
        pod_times.len(),
        remote_times.len(),
        policy_times.len()
    );

    // One namespace's labels change.
    let mut ns = compiler.snapshot().namespaces["ns-0"].clone();
    ns.labels.insert("team".into(), "t7".into());
    let t = Instant::now();
    compiler.upsert_namespace(ns);
    println!("namespace update (20 pods): {:.3} ms", ms(t.elapsed()));

    let rss = peak_rss_mb();
    println!("peak RSS: {rss} MB");
    println!(
        "{{\"bench\":\"compile\",{}\"pods\":{},\"namespaces\":{},\"policies\":{},\"local_endpoints\":{endpoints},\"policy_entries\":{entries},\"full_compile_ms\":{full_ms:.1},\"compiler_new_ms\":{new_ms:.1},\"pod_update_ms\":{pod_med:.2},\"pod_update_max_ms\":{pod_max:.2},\"remote_pod_update_ms\":{remote_med:.2},\"remote_pod_update_max_ms\":{remote_max:.2},\"policy_update_ms\":{policy_med:.2},\"policy_update_max_ms\":{policy_max:.2},\"peak_rss_mb\":{rss}}}",
        if any_peer_named() {
            "\"variant\":\"any_peer_named\","
        } else {
            ""
        },
        sc.pods,
        sc.namespaces,
        sc.policies,
    );
}
