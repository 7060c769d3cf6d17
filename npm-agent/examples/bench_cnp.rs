//! ClusterNetworkPolicy agent benchmark: the in-process test API server with
//! the standard-channel CRD, 2,000 pods in 100 namespaces (100 of them on
//! this node, one per namespace), 1,000 CNPs (half Admin, half Baseline;
//! the shape of `npm-policy`'s `bench_tiers`: each selects the pods of 5
//! namespaces with 3 ingress and 2 egress rules, pod, namespace and CIDR
//! peers, port ranges and overlapping folds, with narrower Deny ranges:
//! `bench_tiers`' own ranges need more `NPM_TIERS` keys than its 262,144
//! and the first sync fails "map full"), the real watchers, compiler
//! and sync loop, and the real eBPF dataplane ([`EbpfDataplane`], maps
//! pinned under a bpffs directory of its own, tcx programs on one veth per
//! local pod).
//!
//! Then a stream of CNP changes at a fixed rate, cycling: create a CNP,
//! change the priority of one created earlier, delete one created earlier.
//! The changed CNPs ("churn-N", Admin tier) allow ingress from the pod of
//! the namespace `churn-peers` (which no other CNP selects) on a TCP port of
//! their own, so each has tier entries of its own on the 5 local endpoints
//! of its subject (`team=t0`) whatever the 1,000 others say. Each change is
//! timed from just before its API write to the return of the dataplane
//! call that wrote its `NPM_TIERS` keys (and the folded decisions: the
//! `bpf(2)` updates and the shared-mapping stores done): created: an entry
//! of its rule written; priority changed: each of its entries holds a new
//! rank; deleted: none of its entries is left.
//!
//! At the end the pinned maps are read back through `bpf(2)`: the set of
//! (endpoint, direction, tier, peer, action, rank, rule) in `NPM_TIERS`
//! must equal the last compiled state's. Ends with
//! one JSON line (p50/p99/max per kind and overall, counts).
//!
//! Runs as root. Names carry the process id (veths `ncb<pid>x<n>` /
//! `ncb<pid>y<n>`, pin dir `/sys/fs/bpf/npmcnpbench<pid>`); they are
//! removed at the end (also on panic) and leftovers of crashed runs first.
//!
//! `cargo xtask bench cnp [-- CNPS CHANGES RATE_PER_S]` (defaults 1000 150
//! 10), or `cargo run --release -p npm-agent --example bench_cnp`.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::api::{Api, DeleteParams, PostParams};
use npm_agent::agent::{self, AgentConfig};
use npm_agent::reconcile::{AgentDataplane, SyncConfig};
use npm_agent::telemetry::Metrics;
use npm_common::DenyEvent;
use npm_dataplane::ebpf::{dump_pinned, EbpfDataplane, EbpfOptions, MapSizes};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff, Direction, RuleRef, Tier, TierAction, TierEntry};
use npm_policy::tiers::ClusterNetworkPolicy as ApiCnp;
use npm_testapi::{CnpChannel, Options, TestApiServer};
use serde_json::json;

#[path = "bench_support/mod.rs"]
mod bench_support;

use bench_support::{percentile, setup_kernel, PoolResolver};

const LINK_PREFIX: &str = "ncb";
const PIN_PREFIX: &str = "npmcnpbench";
const PODS: usize = 2_000;
const NAMESPACES: usize = 100;

/// What a pending change waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Create,
    Update,
    Delete,
}

/// One change in flight: its CNP, kind, the priority it writes and when
/// its API write started.
struct Pending {
    name: String,
    kind: Kind,
    priority: u32,
    since: Instant,
}

#[derive(Default)]
struct Probe {
    first_full: Option<Instant>,
    /// Changes waiting for the kernel, in write order.
    pending: Vec<Pending>,
    ms: BTreeMap<&'static str, Vec<f64>>,
    /// The state the last dataplane call programmed (kept by full syncs,
    /// and by every call once `keep_last` is set: a copy of 165k entries
    /// per sync would slow the sync loop it measures).
    last: Option<Compiled>,
    /// Set before the last change is written.
    keep_last: bool,
}

/// Whether namespace `ns` is one the churn CNPs' subject (`team=t0`)
/// selects (see [`namespace`]).
fn churn_subject_namespace(ns: &str) -> bool {
    ns.strip_prefix("ns-")
        .and_then(|n| n.parse::<usize>().ok())
        .is_some_and(|n| n % 20 == 0)
}

impl Probe {
    /// Called right after the dataplane call that programmed `next`
    /// returned.
    fn observe(&mut self, now: Instant, next: &Compiled) {
        if !self.pending.is_empty() {
            // The ranks of each churn CNP's entries now in the kernel: the
            // Admin ingress entries of the subjects (pod identities) of the
            // endpoints it selects.
            let mut ranks: HashMap<&str, Vec<u32>> = HashMap::new();
            let subject: BTreeSet<u32> = next
                .endpoints
                .values()
                .filter(|e| churn_subject_namespace(&e.pod.namespace))
                .map(|e| e.identity)
                .collect();
            let lo = |subject| TierEntry {
                subject,
                direction: Direction::Ingress,
                tier: Tier::Admin,
                peer: 0,
                protocol: None,
                ports: (0, 0),
            };
            let entries = subject.into_iter().flat_map(|id| {
                next.tiers
                    .range(lo(id)..)
                    .take_while(move |(e, _)| {
                        e.subject == id && e.direction == Direction::Ingress && e.tier == Tier::Admin
                    })
                    .map(|(_, v)| v)
            });
            for v in entries {
                if let Some(RuleRef::Cluster { name, .. }) = next.ids.rules.get(&v.rule) {
                    if name.starts_with("churn-") {
                        ranks.entry(name.as_str()).or_default().push(v.rank);
                    }
                }
            }
            // A change overtaken by a later reached change of the same CNP
            // (coalesced into one sync: the kernel never shows its own
            // state) counts as reached with it.
            let mut reached_names: Vec<String> = Vec::new();
            let mut still = Vec::new();
            for p in std::mem::take(&mut self.pending).into_iter().rev() {
                let reached = reached_names.contains(&p.name)
                    || match p.kind {
                        Kind::Create => ranks.contains_key(p.name.as_str()),
                        // The sparse rank carries the priority in bits 20..
                        Kind::Update => ranks
                            .get(p.name.as_str())
                            .is_some_and(|r| r.iter().all(|r| r >> 20 == p.priority)),
                        Kind::Delete => !ranks.contains_key(p.name.as_str()),
                    };
                if reached {
                    let kind = match p.kind {
                        Kind::Create => "create",
                        Kind::Update => "update",
                        Kind::Delete => "delete",
                    };
                    self.ms
                        .entry(kind)
                        .or_default()
                        .push((now - p.since).as_secs_f64() * 1e3);
                    reached_names.push(p.name);
                } else {
                    still.push(p);
                }
            }
            still.reverse();
            self.pending = still;
        }
        if self.keep_last {
            self.last = Some(next.clone());
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
        p.observe(now, compiled);
        p.last = Some(compiled.clone());
        Ok(())
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.apply(diff, next, interfaces)?;
        let now = Instant::now();
        self.probe.lock().unwrap().observe(now, next);
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

fn namespace(n: usize) -> Namespace {
    serde_json::from_value(json!({"metadata": {"name": format!("ns-{n}"), "labels": {
        "team": format!("t{}", n % 20),
        "env": if n.is_multiple_of(3) { "prod" } else { "dev" },
    }}}))
    .expect("namespace JSON")
}

/// Pod `i` of the population: namespace `ns-<i % 100>`; pods 0..100 are
/// on this node.
fn population_pod(i: usize) -> Pod {
    let j = i / NAMESPACES;
    let app = format!("app{}", (i / NAMESPACES) % 5);
    let tier = if j.is_multiple_of(2) { "front" } else { "back" };
    let ip = format!("10.{}.{}.{}", i / 65536 + 1, i / 256 % 256, i % 256);
    let node = if i < NAMESPACES { "node-a" } else { "node-b" };
    let mut pod = npm_testkit::k8s::pod(
        &format!("ns-{}", i % NAMESPACES),
        &format!("pod-{j}"),
        node,
        Some(&ip),
        &[("app", &app), ("tier", tier)],
    );
    // The named port `http` on one of three numbers.
    if let Some(port) = (pod.spec.as_mut())
        .and_then(|s| s.containers.first_mut())
        .and_then(|c| c.ports.as_mut())
        .and_then(|p| p.first_mut())
    {
        port.container_port = 8080 + (j % 3) as i32;
    }
    pod
}

/// CNP `p` of the 1,000 (the `bench_tiers` shape).
fn population_cnp(p: usize) -> serde_json::Value {
    let tcp = |a: u16, b: u16| {
        if a == b {
            json!({"tcp": {"destinationPort": {"number": a}}})
        } else {
            json!({"tcp": {"destinationPort": {"range": {"start": a, "end": b}}}})
        }
    };
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": format!("cnp-{p:04}")},
        "spec": {
            "tier": if p.is_multiple_of(2) { "Admin" } else { "Baseline" },
            "priority": p % 1000,
            "subject": {"namespaces": {"matchLabels": {"team": format!("t{}", p % 20)}}},
            "ingress": [
                {"name": "accept-app", "action": "Accept",
                 "from": [{"pods": {"namespaceSelector": {"matchLabels": {"team": format!("t{}", (p + 1) % 20)}},
                                    "podSelector": {"matchLabels": {"app": format!("app{}", p % 5)}}}}],
                 "protocols": [tcp(8080, 8080), {"destinationNamedPort": "http"}]},
                {"name": "deny-dev", "action": "Deny",
                 "from": [{"namespaces": {"matchLabels": {"env": "dev"}}}],
                 "protocols": [tcp(8000, 8015)]},
                {"name": "pass-rest", "action": "Pass",
                 "from": [{"namespaces": {"matchLabels": {"team": format!("t{}", (p + 7) % 20)}}}]},
            ],
            "egress": [
                {"name": "deny-range", "action": "Deny",
                 "to": [{"networks": [format!("10.{}.0.0/16", 1 + p % 200)]}],
                 "protocols": [tcp(443, 443)]},
                {"name": "dns", "action": "Accept",
                 "to": [{"networks": ["0.0.0.0/0"]}],
                 "protocols": [{"udp": {"destinationPort": {"number": 53}}}]},
            ],
        }
    })
}

/// Churn CNP `k`: Admin, subject `team=t0`, Accept from the `churn-peers`
/// pod on TCP `20000 + k`.
fn churn_cnp(k: usize, priority: usize) -> ApiCnp {
    serde_json::from_value(json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": format!("churn-{k:04}")},
        "spec": {
            "tier": "Admin", "priority": priority,
            "subject": {"namespaces": {"matchLabels": {"team": "t0"}}},
            "ingress": [{"name": "accept-peer", "action": "Accept",
                         "from": [{"namespaces": {"matchLabels": {"kubernetes.io/metadata.name": "churn-peers"}}}],
                         "protocols": [{"tcp": {"destinationPort": {"number": 20000 + k}}}]}],
        }
    }))
    .expect("churn CNP JSON")
}

fn stats(v: &mut [f64]) -> serde_json::Value {
    v.sort_by(|a, b| a.total_cmp(b));
    let r = |x: f64| (x * 10.0).round() / 10.0;
    json!({"n": v.len(), "p50_ms": r(percentile(v, 0.5)), "p99_ms": r(percentile(v, 0.99)),
           "max_ms": r(v.last().copied().unwrap_or(f64::NAN))})
}

/// Checks the pinned `NPM_TIERS` against `last`; returns the tier entries
/// verified.
fn verify_pinned(pin_dir: &std::path::Path, last: &Compiled) -> anyhow::Result<usize> {
    let dump = dump_pinned(pin_dir)?;
    let dir = |d: Direction| match d {
        Direction::Ingress => "ingress",
        Direction::Egress => "egress",
    };
    let tier = |t: Tier| match t {
        Tier::Admin => "admin",
        Tier::Baseline => "baseline",
    };
    let action = |a: TierAction| match a {
        TierAction::Accept => "accept",
        TierAction::Deny => "deny",
        TierAction::Pass => "pass",
    };
    let want: BTreeSet<_> = last
        .tiers
        .iter()
        .map(|(e, v)| {
            (
                e.subject,
                dir(e.direction),
                tier(e.tier),
                e.peer,
                action(v.action),
                v.rank,
                v.rule,
            )
        })
        .collect();
    let have: BTreeSet<_> = dump
        .tiers
        .iter()
        .map(|t| (t.subject, t.direction, t.tier, t.peer, t.action, t.rank, t.rule))
        .collect();
    anyhow::ensure!(
        want == have,
        "pinned NPM_TIERS differs from the compiled state: {} missing, {} extra",
        want.difference(&have).count(),
        have.difference(&want).count()
    );
    Ok(want.len())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let map_sizes = MapSizes::default();
    let args: Vec<usize> = argv.iter().filter_map(|a| a.parse().ok()).collect();
    let cnps = args.first().copied().unwrap_or(1_000);
    let changes = args.get(1).copied().unwrap_or(150);
    let rate = args.get(2).copied().unwrap_or(10).max(1);
    if let Ok(filter) = std::env::var("RUST_LOG") {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .init();
    }

    let srv = TestApiServer::start(Options {
        cnp_crd: Some(CnpChannel::Standard),
        ..Options::default()
    })
    .await?;
    let mut config = kube::Config::new(srv.url().parse()?);
    config.default_retry = false;
    let client = kube::Client::try_from(config)?;
    let ns_api: Api<Namespace> = Api::all(client.clone());
    for n in 0..NAMESPACES {
        ns_api.create(&PostParams::default(), &namespace(n)).await?;
    }
    let peers: Namespace = serde_json::from_value(json!({"metadata": {"name": "churn-peers"}}))?;
    ns_api.create(&PostParams::default(), &peers).await?;
    let t = Instant::now();
    let mut all_pods: Vec<Pod> = (0..PODS).map(population_pod).collect();
    all_pods.push(npm_testkit::k8s::pod(
        "churn-peers",
        "peer",
        "node-b",
        Some("10.200.0.1"),
        &[],
    ));
    futures::stream::iter(all_pods)
        .map(|p| {
            let api: Api<Pod> = Api::namespaced(client.clone(), p.metadata.namespace.as_deref().unwrap_or_default());
            async move { api.create(&PostParams::default(), &p).await.map(|_| ()) }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    let cnp_api: Api<ApiCnp> = Api::all(client.clone());
    futures::stream::iter(0..cnps)
        .map(|p| {
            let api = cnp_api.clone();
            async move {
                let o: ApiCnp = serde_json::from_value(population_cnp(p)).expect("CNP JSON");
                api.create(&PostParams::default(), &o).await.map(|_| ())
            }
        })
        .buffer_unordered(64)
        .collect::<Vec<_>>()
        .await
        .into_iter()
        .collect::<Result<Vec<_>, _>>()?;
    eprintln!(
        "populated {PODS} pods and {cnps} CNPs in {:.1}s",
        t.elapsed().as_secs_f64()
    );

    let (kernel, ifindexes) = setup_kernel(NAMESPACES, LINK_PREFIX, PIN_PREFIX)?;
    let probe: Arc<Mutex<Probe>> = Arc::default();
    let dp = TimedEbpf {
        inner: EbpfDataplane::open_sized(
            EbpfOptions {
                object: None,
                pin_dir: kernel.pin_dir.clone(),
                bench_no_ct_create: false,
                attach: npm_dataplane::ebpf::AttachMode::Tcx,
            },
            map_sizes,
        )?,
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
    let entries = probe.lock().unwrap().last.as_ref().map_or(0, |c| c.tiers.len());
    eprintln!("first full enforcement after {first_enforcement_s:.2}s, {entries} tier entries");

    // The change stream: create churn-k; change the priority of the one
    // created before; delete the one created two steps before.
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate as u64));
    let mut created: Vec<usize> = Vec::new();
    let mut next_k = 0;
    for c in 0..changes {
        tick.tick().await;
        if c + 1 == changes {
            probe.lock().unwrap().keep_last = true;
        }
        let kind = match c % 3 {
            0 => Kind::Create,
            1 if !created.is_empty() => Kind::Update,
            2 if created.len() > 1 => Kind::Delete,
            _ => Kind::Create,
        };
        match kind {
            Kind::Create => {
                let k = next_k;
                next_k += 1;
                let priority = 1 + (k * 7) % 900;
                let o = churn_cnp(k, priority);
                let name = o.metadata.name.clone().unwrap_or_default();
                probe.lock().unwrap().pending.push(Pending {
                    name,
                    kind,
                    priority: priority as u32,
                    since: Instant::now(),
                });
                cnp_api.create(&PostParams::default(), &o).await?;
                created.push(k);
            }
            Kind::Update => {
                let k = *created.last().unwrap_or(&0);
                let priority = 950 + c % 50;
                let mut o = churn_cnp(k, priority);
                let name = o.metadata.name.clone().unwrap_or_default();
                o.metadata.resource_version = cnp_api.get(&name).await?.metadata.resource_version;
                let since = Instant::now();
                probe.lock().unwrap().pending.push(Pending {
                    name: name.clone(),
                    kind,
                    priority: priority as u32,
                    since,
                });
                cnp_api.replace(&name, &PostParams::default(), &o).await?;
            }
            Kind::Delete => {
                let k = created.remove(created.len() - 2);
                let name = format!("churn-{k:04}");
                let since = Instant::now();
                probe.lock().unwrap().pending.push(Pending {
                    name: name.clone(),
                    kind,
                    priority: 0,
                    since,
                });
                cnp_api.delete(&name, &DeleteParams::default()).await?;
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline && !probe.lock().unwrap().pending.is_empty() {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (mut by_kind, missing, last) = {
        let mut p = probe.lock().unwrap();
        let missing: Vec<String> = p.pending.iter().map(|p| format!("{:?} {}", p.kind, p.name)).collect();
        (std::mem::take(&mut p.ms), missing, p.last.clone())
    };
    running.abort();
    anyhow::ensure!(
        missing.is_empty(),
        "{} changes never reached the kernel: {missing:?}",
        missing.len()
    );
    let last = last.ok_or_else(|| anyhow::anyhow!("nothing was programmed"))?;
    // Let the aborted sync loop's last call return before reading back.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let tier_keys = verify_pinned(&kernel.pin_dir, &last)?;
    eprintln!("verified in the pinned maps: {tier_keys} tier entries");
    let mut all: Vec<f64> = by_kind.values().flatten().copied().collect();
    let mut out = json!({
        "bench": "cnp", "dataplane": "ebpf", "pods": PODS, "local_endpoints": NAMESPACES, "cnps": cnps,
        "tier_entries": last.tiers.len(), "changes": changes, "rate_per_s": rate,
        "first_enforcement_s": (first_enforcement_s * 1000.0).round() / 1000.0,
    });
    let overall = stats(&mut all);
    for k in ["p50_ms", "p99_ms", "max_ms"] {
        out[k] = overall[k].clone();
    }
    for (kind, v) in by_kind.iter_mut() {
        out[*kind] = stats(v);
    }
    println!("{out}");
    drop(kernel);
    Ok(())
}
