//! Compile benchmark: 10,000 pods in 500 namespaces, 1,000 policies, a node
//! with 100 local endpoints. Measures a full compile, a single-pod label
//! update and a single-policy update (both recompiled with `prev`), and
//! peak RSS. Run: `cargo run --release -p npm-policy --example bench_compile`
//! (with `NPM_BENCH_ANY_PEER_NAMED=1`, the egress policies also hold a rule
//! with a named port and an empty `to`).

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use npm_policy::compiled::CompileOptions;
use npm_policy::incremental::Compiler;
use npm_policy::model::*;

const PODS: usize = 10_000;
const NAMESPACES: usize = 500;
const POLICIES: usize = 1_000;
const NODES: usize = 100;

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
        let ns = format!("ns-{}", i % NAMESPACES);
        let j = i / NAMESPACES;
        let pod = Pod {
            uid: format!("uid-{i}"),
            namespace: ns.clone(),
            name: format!("pod-{j}"),
            labels: l(&[
                ("app", format!("app{}", j % 5)),
                ("pod-template-hash", format!("h{}", j % 7)),
                ("tier", if j.is_multiple_of(2) { "front" } else { "back" }.into()),
            ]),
            ips: vec![IpAddr::V4(Ipv4Addr::new(
                10,
                (i / 65536) as u8 + 1,
                (i / 256 % 256) as u8,
                (i % 256) as u8,
            ))],
            node_name: Some(format!("node-{}", i % NODES)),
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
    for p in 0..POLICIES {
        let n = p % NAMESPACES;
        let ns = format!("ns-{n}");
        let k = p / NAMESPACES;
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

fn ms(d: std::time::Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn main() {
    let s = snapshot();
    let opts = CompileOptions {
        node_name: "node-0".into(),
        node_ips: vec!["192.168.0.10".parse().unwrap()],
        allow_host_egress: false,
    };

    let t = Instant::now();
    let full = npm_policy::compile(&s, &opts, None);
    let full_ms = ms(t.elapsed());
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
    println!("Compiler::new: {:.1} ms", ms(t.elapsed()));

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
        .find(|p| p.node_name.as_deref() == Some("node-7"))
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

    // One policy's port changes.
    let pk = compiler
        .snapshot()
        .policies
        .iter()
        .find(|(_, p)| {
            p.ingress.first().is_some_and(|r| {
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

    // One namespace's labels change.
    let mut ns = compiler.snapshot().namespaces["ns-0"].clone();
    ns.labels.insert("team".into(), "t7".into());
    let t = Instant::now();
    compiler.upsert_namespace(ns);
    println!("namespace update (20 pods): {:.3} ms", ms(t.elapsed()));

    let rss = peak_rss_mb();
    println!("peak RSS: {rss} MB");
    println!(
        "{{\"bench\":\"compile\",{}\"pods\":{PODS},\"policies\":{POLICIES},\"full_compile_ms\":{:.1},\"pod_update_ms\":{:.2},\"policy_update_ms\":{:.2},\"peak_rss_mb\":{rss}}}",
        if any_peer_named() {
            "\"variant\":\"any_peer_named\","
        } else {
            ""
        },
        full_ms,
        pod_ms,
        policy_ms
    );
}
