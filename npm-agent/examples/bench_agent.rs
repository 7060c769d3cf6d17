//! Agent benchmark: the in-process test API server with 10,000 pods and
//! 1,000 policies, the real watchers, compiler and sync loop, and an
//! in-memory dataplane that timestamps what it is given.
//!
//! Measures the time from agent start to the first full enforcement (the
//! first `sync_full`), then p50/p99 latency from an API write (pod or policy
//! create) to the dataplane update, at 100 changes/s, and the agent's RSS
//! growth (the API server runs in the same process; its memory is measured
//! before the agent starts and subtracted). Ends with one JSON line.
//!
//! `cargo run --release -p npm-agent --example bench_agent [-- PODS POLICIES SECONDS]`

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodIP, PodSpec, PodStatus};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ObjectMeta, PostParams};
use npm_agent::agent::{self, AgentConfig};
use npm_agent::endpoints::{Resolve, Resolved};
use npm_agent::metrics::Metrics;
use npm_agent::sync::{AgentDataplane, SyncConfig};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff, RuleRef};
use npm_testapi::{Options, TestApiServer};

#[derive(Default)]
struct Probe {
    first_full: Option<Instant>,
    pending_ips: HashMap<IpAddr, Instant>,
    pending_policies: HashMap<String, Instant>,
    latencies_ms: Vec<f64>,
}

#[derive(Clone, Default)]
struct TimingDataplane(Arc<Mutex<Probe>>);

impl TimingDataplane {
    fn observe(&self, next: &Compiled, upserted_ips: &[IpAddr]) {
        let now = Instant::now();
        let mut p = self.0.lock().unwrap();
        for ip in upserted_ips {
            if let Some(t) = p.pending_ips.remove(ip) {
                p.latencies_ms.push((now - t).as_secs_f64() * 1e3);
            }
        }
        if !p.pending_policies.is_empty() {
            let names: BTreeSet<&str> = next
                .ids
                .rules
                .values()
                .filter_map(|r| match r {
                    RuleRef::Policy { name, .. } => Some(name.as_str()),
                    RuleRef::HostEgress => None,
                })
                .collect();
            let done: Vec<String> = p
                .pending_policies
                .keys()
                .filter(|n| names.contains(n.as_str()))
                .cloned()
                .collect();
            for n in done {
                let t = p.pending_policies.remove(&n).unwrap();
                p.latencies_ms.push((now - t).as_secs_f64() * 1e3);
            }
        }
    }
}

impl Dataplane for TimingDataplane {
    fn sync_full(&mut self, compiled: &Compiled, _: &Interfaces) -> Result<(), DataplaneError> {
        self.0.lock().unwrap().first_full.get_or_insert_with(Instant::now);
        let ips: Vec<IpAddr> = compiled.ipcache.keys().copied().collect();
        self.observe(compiled, &ips);
        Ok(())
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, _: &Interfaces) -> Result<(), DataplaneError> {
        let ips: Vec<IpAddr> = diff.ipcache.upsert.iter().map(|(k, _)| *k).collect();
        self.observe(next, &ips);
        Ok(())
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
}

impl AgentDataplane for TimingDataplane {}

struct AllFound;

impl Resolve for AllFound {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        Resolved {
            interfaces: compiled.endpoints.keys().map(|&id| (id, 10_000 + id)).collect(),
            missing: Vec::new(),
        }
    }
}

fn rss_mb() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

fn pod(ns: &str, i: usize, ip: &str, local: bool) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(format!("p{i}")),
            namespace: Some(ns.into()),
            labels: Some([("app".to_string(), format!("g{}", i % 100))].into()),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(if local { "node-a" } else { "node-b" }.into()),
            containers: vec![Container {
                name: "c".into(),
                image: Some("agnhost".into()),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: Some(ip.into()),
            pod_ips: Some(vec![PodIP { ip: ip.into() }]),
            ..Default::default()
        }),
    }
}

fn policy(ns: &str, name: &str, i: usize) -> NetworkPolicy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": format!("g{}", i % 100)}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": format!("g{}", (i + 1) % 100)}}}],
                              "ports": [{"port": 1000 + (i % 100) as i32}]}]}
    }))
    .unwrap()
}

/// A policy selecting this node's pods (`app=g0` in `bench0`) with a port
/// of its own, so that it produces allow entries of its own.
fn churn_policy(name: &str, c: usize) -> NetworkPolicy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "bench0"},
        "spec": {"podSelector": {"matchLabels": {"app": "g0"}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": format!("g{}", (c * 10) % 100)}}}],
                              "ports": [{"port": 2000 + c as i32}]}]}
    }))
    .unwrap()
}

fn ip_of(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let pods = args.first().copied().unwrap_or(10_000);
    let policies = args.get(1).copied().unwrap_or(1_000);
    let seconds = args.get(2).copied().unwrap_or(10);
    let namespaces = 10;

    let srv = TestApiServer::start(Options::default()).await?;
    let mut config = kube::Config::new(srv.url().parse()?);
    config.default_retry = false;
    let client = kube::Client::try_from(config)?;
    let ns_api: Api<Namespace> = Api::all(client.clone());
    for n in 0..namespaces {
        let ns: Namespace = serde_json::from_value(serde_json::json!({"metadata": {"name": format!("bench{n}")}}))?;
        ns_api.create(&PostParams::default(), &ns).await?;
    }
    let t = Instant::now();
    futures::stream::iter(0..pods)
        .map(|i| {
            let ns = format!("bench{}", i % namespaces);
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            let p = pod(&ns, i, &ip_of(i), i % 100 == 0);
            async move { api.create(&PostParams::default(), &p).await.map(|_| ()) }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    futures::stream::iter(0..policies)
        .map(|i| {
            let ns = format!("bench{}", i % namespaces);
            let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), &ns);
            let np = policy(&ns, &format!("np{i}"), i);
            async move { api.create(&PostParams::default(), &np).await.map(|_| ()) }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    eprintln!(
        "populated {pods} pods and {policies} policies in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    let rss_before = rss_mb();
    let dp = TimingDataplane::default();
    let cfg = AgentConfig {
        sync: SyncConfig {
            compile: CompileOptions {
                node_name: "node-a".into(),
                node_ips: Vec::new(),
                allow_host_egress: false,
            },
            ..SyncConfig::default()
        },
        page_size: 500,
        metrics_addr: None,
    };
    let started = Instant::now();
    let running = agent::start(cfg, client.clone(), dp.clone(), Box::new(AllFound), Metrics::new()?).await?;
    let first = loop {
        if let Some(t) = dp.0.lock().unwrap().first_full {
            break t;
        }
        anyhow::ensure!(
            started.elapsed() < Duration::from_secs(600),
            "no first enforcement after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let first_enforcement_s = (first - started).as_secs_f64();
    eprintln!("first full enforcement after {first_enforcement_s:.2}s");

    // 100 changes per second: alternately a new pod and a new policy.
    let changes = seconds * 100;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), "bench0");
    let np_api: Api<NetworkPolicy> = Api::namespaced(client.clone(), "bench0");
    for c in 0..changes {
        tick.tick().await;
        let i = pods + c;
        if c % 2 == 0 {
            let ip = ip_of(i);
            let p = pod("bench0", i, &ip, false);
            dp.0.lock().unwrap().pending_ips.insert(ip.parse()?, Instant::now());
            pod_api.create(&PostParams::default(), &p).await?;
        } else {
            let name = format!("churn{c}");
            let np = churn_policy(&name, c);
            dp.0.lock().unwrap().pending_policies.insert(name, Instant::now());
            np_api.create(&PostParams::default(), &np).await?;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let done = {
            let p = dp.0.lock().unwrap();
            p.pending_ips.is_empty() && p.pending_policies.is_empty()
        };
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss = rss_mb() - rss_before;
    let (mut lat, missing) = {
        let p = dp.0.lock().unwrap();
        (p.latencies_ms.clone(), p.pending_ips.len() + p.pending_policies.len())
    };
    anyhow::ensure!(missing == 0, "{missing} changes never reached the dataplane");
    lat.sort_by(|a, b| a.total_cmp(b));
    running.abort();
    println!(
        "{}",
        serde_json::json!({
            "bench": "agent", "pods": pods, "policies": policies,
            "first_enforcement_s": (first_enforcement_s * 1000.0).round() / 1000.0,
            "p50_ms": (percentile(&lat, 0.5) * 10.0).round() / 10.0,
            "p99_ms": (percentile(&lat, 0.99) * 10.0).round() / 10.0,
            "rss_mb": rss.round(),
        })
    );
    Ok(())
}
