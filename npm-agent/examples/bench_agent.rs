//! Agent benchmark: the in-process test API server with 10,000 pods and
//! 1,000 policies, the real watchers, compiler and sync loop, and the real
//! eBPF dataplane ([`EbpfDataplane`], maps pinned under a bpffs directory of
//! its own) programming this node's endpoints on veth interfaces (one per
//! local pod, tcx programs attached).
//!
//! Measures the time from agent start to the first full enforcement (the
//! first `sync_full` returned: every map written), then p50/p99 latency from
//! an API write (pod or policy create) to the return of the dataplane call
//! that wrote its kernel map entries (the `bpf(BPF_MAP_UPDATE_ELEM)` calls
//! completed), at 100 changes/s, and the agent's RSS growth (the API server
//! runs in the same process; its memory is measured before the agent starts
//! and subtracted). A new pod writes its `NPM_IPCACHE` entry; a new policy
//! writes `NPM_POLICY` entries for each subject (pod identity) of the
//! local endpoints it selects (policy entries are keyed by subject: the 100
//! local pods at 10,000 pods share one identity, so one subject) and their
//! `NPM_ENDPOINTS` records. At the end the pinned maps are read back and
//! every change is checked to be there, keyed by the subjects of the last
//! state written. Ends with one JSON line (`policy_keys`: the `NPM_POLICY`
//! keys pinned at the end).
//!
//! Runs as root (bpffs, tcx, veth links). Names carry the process id
//! (veths `nbd<pid>x<n>` / `nbd<pid>y<n>`, pin dir `/sys/fs/bpf/npmbench<pid>`); they are
//! removed at the end (also on panic) and leftovers of crashed runs first.
//!
//! `cargo run --release -p npm-agent --example bench_agent [-- PODS POLICIES SECONDS]`
//! (`NPM_EBPF_OBJECT` or the workspace build of `cargo xtask build-ebpf`
//! gives the BPF object).

#[path = "bench_support/mod.rs"]
mod bench_support;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Container, Namespace, Pod, PodIP, PodSpec, PodStatus};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ObjectMeta, PostParams};
use npm_agent::agent::{self, AgentConfig};
use npm_agent::reconcile::{AgentDataplane, SyncConfig};
use npm_agent::telemetry::Metrics;
use npm_common::DenyEvent;
use npm_dataplane::ebpf::{dump_pinned, EbpfDataplane, EbpfOptions};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff, PolicyEntry, RuleRef};
use npm_testapi::{FaultRule, Kind, Options, TestApiServer};

use bench_support::{percentile, setup_kernel, PoolResolver};

const LINK_PREFIX: &str = "nbd";
const PIN_PREFIX: &str = "npmbench";

#[derive(Default)]
struct Probe {
    first_full: Option<Instant>,
    pending_ips: HashMap<IpAddr, Instant>,
    pending_policies: HashMap<String, Instant>,
    latencies_ms: Vec<f64>,
    pod_ms: Vec<f64>,
    policy_ms: Vec<f64>,
    /// The subjects (pod identities) of the local endpoints of the last
    /// state written: the keys the policy entries of the churn policies
    /// must have in `NPM_POLICY`.
    local_subjects: BTreeSet<u32>,
}

impl Probe {
    /// Called right after the dataplane call that wrote `ips` and
    /// `entries` returned.
    fn observe<'a>(
        &mut self,
        now: Instant,
        next: &Compiled,
        ips: impl Iterator<Item = &'a IpAddr>,
        entries: impl Iterator<Item = (&'a PolicyEntry, &'a u32)>,
    ) {
        self.local_subjects = next.endpoints.values().map(|e| e.identity).collect();
        for ip in ips {
            if let Some(t) = self.pending_ips.remove(ip) {
                let ms = (now - t).as_secs_f64() * 1e3;
                self.latencies_ms.push(ms);
                self.pod_ms.push(ms);
            }
        }
        if self.pending_policies.is_empty() {
            return;
        }
        for (_, rule) in entries {
            if let Some(RuleRef::Policy { name, .. }) = next.ids.rules.get(rule) {
                if let Some(t) = self.pending_policies.remove(name) {
                    let ms = (now - t).as_secs_f64() * 1e3;
                    self.latencies_ms.push(ms);
                    self.policy_ms.push(ms);
                }
            }
        }
    }
}

/// The real eBPF dataplane, timestamping each change when the call that
/// wrote its map entries has returned.
struct TimedEbpf {
    inner: EbpfDataplane,
    probe: Arc<Mutex<Probe>>,
}

impl Dataplane for TimedEbpf {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.sync_full(compiled, interfaces)?;
        let now = Instant::now();
        let mut p = self.probe.lock().unwrap();
        p.first_full.get_or_insert(now);
        p.observe(now, compiled, compiled.ipcache.keys(), compiled.policy.iter());
        Ok(())
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.apply(diff, next, interfaces)?;
        let now = Instant::now();
        self.probe.lock().unwrap().observe(
            now,
            next,
            diff.ipcache.upsert.iter().map(|(k, _)| k),
            diff.policy.upsert.iter().map(|(e, r)| (e, r)),
        );
        Ok(())
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        self.inner.counters()
    }
}

impl AgentDataplane for TimedEbpf {
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        self.inner.poll_deny_events()
    }
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        Some(self.inner.adopted_counts())
    }
    fn adopted_endpoints(&self) -> Vec<npm_dataplane::AdoptedEndpoint> {
        self.inner.adopted_endpoints().to_vec()
    }
}

/// A `/proc/self/status` field in kB (`VmRSS`, `VmHWM`), as MB.
fn status_mb(field: &str) -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map(|kb| kb / 1024.0)
        .unwrap_or(0.0)
}

/// The process's resident set now.
fn rss_mb() -> f64 {
    status_mb("VmRSS")
}

/// The process's peak resident set since the last [`reset_peak`].
fn peak_mb() -> f64 {
    status_mb("VmHWM")
}

/// Reset the peak resident set (`VmHWM`) to the current one
/// (`/proc/PID/clear_refs`, value 5).
fn reset_peak() -> anyhow::Result<()> {
    std::fs::write("/proc/self/clear_refs", "5")?;
    Ok(())
}

/// The 1-minute load average (the machine's load during the run).
fn load1() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|l| l.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// A sample of the agent's metrics (0 when absent).
fn metric(metrics: &Metrics, series: &str) -> f64 {
    metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series)?.trim().parse().ok())
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let pods = args.first().copied().unwrap_or(10_000);
    let policies = args.get(1).copied().unwrap_or(1_000);
    let seconds = args.get(2).copied().unwrap_or(10);
    let namespaces = 10;
    if let Ok(filter) = std::env::var("RUST_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }

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

    let locals = pods.div_ceil(100);
    let (kernel, ifindexes) = setup_kernel(locals, LINK_PREFIX, PIN_PREFIX)?;
    let probe: Arc<Mutex<Probe>> = Arc::default();
    // The API server's memory (same process) is taken before the agent
    // starts and subtracted; the peak is counted from here.
    reset_peak()?;
    let rss_before = rss_mb();
    let dp = TimedEbpf {
        inner: EbpfDataplane::open(EbpfOptions {
            object: None,
            pin_dir: kernel.pin_dir.clone(),
            bench_no_ct_create: false,
            attach: npm_dataplane::ebpf::AttachMode::Tcx,
        })?,
        probe: probe.clone(),
    };
    let resolver = PoolResolver {
        free: ifindexes,
        assigned: BTreeMap::new(),
    };
    let cfg = AgentConfig {
        sync: SyncConfig {
            compile: CompileOptions {
                node_name: "node-a".into(),
                node_ips: Vec::new(),
                allow_host_egress: false,
                report_new: false,
            },
            ..SyncConfig::default()
        },
        page_size: 500,
        metrics_addr: None,
        debug_addr: None,
        cni: None,
        dns: None,
        pod_conditions: None,
    };
    let started = Instant::now();
    let running = agent::start(cfg, client.clone(), dp, Box::new(resolver), Metrics::new()?).await?;
    let first = loop {
        if let Some(t) = probe.lock().unwrap().first_full {
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
    // The initial list and first full sync (no old state held).
    let first_peak = peak_mb() - rss_before;

    // 100 changes per second: alternately a new pod and a new policy.
    let changes = seconds * 100;
    let mut tick = tokio::time::interval(Duration::from_millis(10));
    let mut churn_ips: Vec<IpAddr> = Vec::new();
    let mut churn_ports: Vec<u16> = Vec::new();
    let pod_api: Api<Pod> = Api::namespaced(client.clone(), "bench0");
    let np_api: Api<NetworkPolicy> = Api::namespaced(client.clone(), "bench0");
    for c in 0..changes {
        tick.tick().await;
        let i = pods + c;
        if c % 2 == 0 {
            let ip = ip_of(i);
            let p = pod("bench0", i, &ip, false);
            churn_ips.push(ip.parse()?);
            probe.lock().unwrap().pending_ips.insert(ip.parse()?, Instant::now());
            pod_api.create(&PostParams::default(), &p).await?;
        } else {
            let name = format!("churn{c}");
            let np = churn_policy(&name, c);
            churn_ports.push(2000 + c as u16);
            probe.lock().unwrap().pending_policies.insert(name, Instant::now());
            np_api.create(&PostParams::default(), &np).await?;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        let done = {
            let p = probe.lock().unwrap();
            p.pending_ips.is_empty() && p.pending_policies.is_empty()
        };
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rss = rss_mb() - rss_before;
    let churn_peak = peak_mb() - rss_before;
    let (mut lat, missing) = {
        let p = probe.lock().unwrap();
        (p.latencies_ms.clone(), p.pending_ips.len() + p.pending_policies.len())
    };
    anyhow::ensure!(missing == 0, "{missing} changes never reached the dataplane");
    lat.sort_by(|a, b| a.total_cmp(b));
    let (mut pod_ms, mut policy_ms) = {
        let p = probe.lock().unwrap();
        (p.pod_ms.clone(), p.policy_ms.clone())
    };
    pod_ms.sort_by(|a, b| a.total_cmp(b));
    policy_ms.sort_by(|a, b| a.total_cmp(b));

    // A forced full relist of every watched kind, the agent holding its last
    // complete state until each list is complete: the watches are closed
    // and their reconnection held back while a new pod is written and the
    // event log compacted past it, so every watch resumes from a compacted
    // revision, gets 410 Gone and lists again. Done when the pods' list
    // completed again and the new pod's address is in the kernel; the peak
    // resident set is counted from a reset at its start.
    let init_done = r#"npm_watch_events_total{resource="pods",event="init-done"}"#;
    let lists_before = metric(&running.metrics, init_done);
    reset_peak()?;
    srv.inject(FaultRule::delay(16, Duration::from_secs(1)).verb("watch"));
    srv.drop_watches();
    tokio::time::sleep(Duration::from_millis(200)).await;
    let marker_ip: IpAddr = ip_of(pods + changes).parse()?;
    let marker = pod("bench0", pods + changes, &marker_ip.to_string(), false);
    probe.lock().unwrap().pending_ips.insert(marker_ip, Instant::now());
    srv.create_object(Kind::Pod, Some("bench0"), serde_json::to_value(&marker)?)?;
    srv.compact();
    let relist_start = Instant::now();
    loop {
        let relisted = metric(&running.metrics, init_done) > lists_before;
        if relisted && !probe.lock().unwrap().pending_ips.contains_key(&marker_ip) {
            break;
        }
        anyhow::ensure!(
            relist_start.elapsed() < Duration::from_secs(600),
            "no relist (pods listed again: {relisted}) or the new pod not programmed after 600 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let relist_s = relist_start.elapsed().as_secs_f64();
    srv.clear_faults();
    // The sync that programmed the new pod returns the freed memory to the
    // kernel after its apply: a second for it to finish.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let relist_peak = peak_mb() - rss_before;
    let after_relist = rss_mb() - rss_before;
    churn_ips.push(marker_ip);
    eprintln!(
        "relist done in {relist_s:.2}s: steady {rss:.0} MB before, {after_relist:.0} MB after, peak {relist_peak:.0} MB"
    );
    running.abort();

    // Read the pinned maps back: every change must be in the kernel.
    let dump = dump_pinned(&kernel.pin_dir)?;
    let ips: std::collections::HashSet<IpAddr> = dump.ipcache.iter().map(|e| e.addr).collect();
    let absent = churn_ips.iter().filter(|ip| !ips.contains(ip)).count();
    anyhow::ensure!(
        absent == 0,
        "{absent} new pods' addresses are not in the pinned ipcache"
    );
    anyhow::ensure!(
        dump.endpoints.len() == locals && dump.endpoints.iter().all(|e| e.attached.len() == 2),
        "{} endpoints programmed ({} expected, all with both hooks attached)",
        dump.endpoints.len(),
        locals
    );
    // The churn policies select every local pod (`app=g0` in `bench0`):
    // each must have its ingress entry, keyed by subject (the local
    // endpoints' pod identity), for every subject of the local endpoints.
    let subjects = probe.lock().unwrap().local_subjects.clone();
    anyhow::ensure!(!subjects.is_empty(), "no local endpoint in the last state written");
    let mut per_port: HashMap<u16, BTreeSet<u32>> = HashMap::new();
    for e in &dump.policy {
        if e.direction == "ingress" && e.protocol == Some(6) && e.ports.0 == e.ports.1 {
            per_port.entry(e.ports.0).or_default().insert(e.subject);
        }
    }
    let short = churn_ports
        .iter()
        .filter(|p| per_port.get(p).is_none_or(|have| !subjects.is_subset(have)))
        .count();
    anyhow::ensure!(
        short == 0,
        "{short} new policies lack pinned policy entries for some of the {} subjects of the {locals} local endpoints",
        subjects.len()
    );
    eprintln!(
        "verified in the pinned maps: {} ipcache, {} endpoints, {} policy keys ({} subjects)",
        dump.ipcache.len(),
        dump.endpoints.len(),
        dump.policy.len(),
        subjects.len()
    );
    println!(
        "{}",
        serde_json::json!({
            "bench": "agent", "pods": pods, "policies": policies,
            "first_enforcement_s": (first_enforcement_s * 1000.0).round() / 1000.0,
            "p50_ms": (percentile(&lat, 0.5) * 10.0).round() / 10.0,
            "p99_ms": (percentile(&lat, 0.99) * 10.0).round() / 10.0,
            "rss_mb": rss.round(),
            // Steady: after the churn; peaks: the first list and sync, the
            // churn, the forced full relist (the old state held).
            "steady_rss_mb": rss.round(),
            "first_peak_mb": first_peak.round(),
            "churn_peak_mb": churn_peak.round(),
            "relist_peak_mb": relist_peak.round(),
            "after_relist_rss_mb": after_relist.round(),
            "relist_s": (relist_s * 100.0).round() / 100.0,
            "kib_per_pod": (rss * 1024.0 / pods as f64 * 100.0).round() / 100.0,
            "peak_kib_per_pod": (first_peak.max(churn_peak).max(relist_peak) * 1024.0 / pods as f64 * 100.0).round() / 100.0,
            "load1": load1(),
            "dataplane": "ebpf", "local_endpoints": locals,
            "policy_keys": dump.policy.len(), "subjects": subjects.len(),
            "pod_p50_ms": (percentile(&pod_ms, 0.5) * 10.0).round() / 10.0,
            "pod_p99_ms": (percentile(&pod_ms, 0.99) * 10.0).round() / 10.0,
            "policy_p50_ms": (percentile(&policy_ms, 0.5) * 10.0).round() / 10.0,
            "policy_p99_ms": (percentile(&policy_ms, 0.99) * 10.0).round() / 10.0,
        })
    );
    drop(kernel);
    Ok(())
}
