//! Shared helpers of the agent's integration tests: the test API server, a
//! recording in-memory dataplane, a fixed interface resolver, object
//! builders and polling.
#![allow(dead_code)]

pub mod netns;
pub mod process;

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, PostParams};
use npm_agent::agent::{self, AgentConfig, RunningAgent};
/// The agent's slim cached Pod (what `Cache` and `CompleteState` hold).
pub use npm_agent::k8s::pods::Pod as CachedPod;
use npm_agent::k8s::Cache;
use npm_agent::node::{Resolve, Resolved};
use npm_agent::reconcile::{AgentDataplane, SyncConfig, Syncer, SyncerBuilder};
use npm_agent::telemetry::{sample, Metrics};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff, MapDiff, RuleRef};
use npm_testapi::{Options, TestApiServer};
/// The object builders (namespaces, pods) and HTTP helpers of the kit.
pub use npm_testkit::http::{get, get_with, wait_readyz};
pub use npm_testkit::k8s::{namespace, pod};

/// One write to the recording dataplane.
#[derive(Clone, Debug)]
pub struct Call {
    /// A sync_full (else an apply).
    pub full: bool,
    /// ipcache entries removed by this call.
    pub ipcache_removed: usize,
    /// Endpoints removed by this call.
    pub endpoints_removed: usize,
    /// ipcache size after the call.
    pub ipcache_after: usize,
}

/// What the recording dataplane holds.
#[derive(Debug, Default)]
pub struct Recorded {
    /// The "kernel" state.
    pub state: Compiled,
    /// Interfaces of the last write.
    pub interfaces: Interfaces,
    /// Every write.
    pub calls: Vec<Call>,
    /// Fail the next N writes.
    pub fail_next: u32,
    /// Writes whose diff did not take `state` to `next` (must stay empty).
    pub inconsistent: Vec<String>,
}

/// An in-memory dataplane recording what the agent programs. Cloning shares
/// the state, like pinned maps outliving an agent.
#[derive(Clone, Debug, Default)]
pub struct RecordingDataplane(pub Arc<Mutex<Recorded>>);

impl RecordingDataplane {
    /// Lock the record.
    pub fn lock(&self) -> MutexGuard<'_, Recorded> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn apply_map<K: Ord + Clone, V: Clone>(map: &mut BTreeMap<K, V>, d: &MapDiff<K, V>) -> usize {
    for (k, v) in &d.upsert {
        map.insert(k.clone(), v.clone());
    }
    let mut removed = 0;
    for k in &d.remove {
        removed += map.remove(k).is_some() as usize;
    }
    removed
}

impl Dataplane for RecordingDataplane {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        let mut r = self.lock();
        if r.fail_next > 0 {
            r.fail_next -= 1;
            return Err(DataplaneError::Kernel {
                op: "sync_full (recording dataplane)".into(),
                detail: "injected failure".into(),
            });
        }
        let ipcache_removed = r
            .state
            .ipcache
            .keys()
            .filter(|k| !compiled.ipcache.contains_key(k))
            .count();
        let endpoints_removed = r
            .state
            .endpoints
            .keys()
            .filter(|k| !compiled.endpoints.contains_key(k))
            .count();
        r.state = compiled.clone();
        r.interfaces = interfaces.clone();
        r.calls.push(Call {
            full: true,
            ipcache_removed,
            endpoints_removed,
            ipcache_after: compiled.ipcache.len(),
        });
        Ok(())
    }

    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        let mut r = self.lock();
        if r.fail_next > 0 {
            r.fail_next -= 1;
            return Err(DataplaneError::Kernel {
                op: "apply (recording dataplane)".into(),
                detail: "injected failure".into(),
            });
        }
        let ipcache_removed = apply_map(&mut r.state.ipcache, &diff.ipcache);
        apply_map(&mut r.state.cidrs, &diff.cidrs);
        let endpoints_removed = apply_map(&mut r.state.endpoints, &diff.endpoints);
        diff.policy.apply_to_policy(&mut r.state.policy);
        if r.state.ipcache != next.ipcache
            || r.state.endpoints != next.endpoints
            || r.state.policy != next.policy
            || r.state.cidrs != next.cidrs
        {
            r.inconsistent
                .push(format!("diff of {} changes did not reach next", diff.len()));
        }
        r.state.ids = next.ids.clone();
        r.interfaces = interfaces.clone();
        let ipcache_after = r.state.ipcache.len();
        r.calls.push(Call {
            full: false,
            ipcache_removed,
            endpoints_removed,
            ipcache_after,
        });
        Ok(())
    }

    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
}

impl AgentDataplane for RecordingDataplane {
    /// The recorded endpoints on their recorded interfaces (what a previous
    /// agent left, for a syncer that starts on a clone).
    fn adopted_endpoints(&self) -> Vec<npm_dataplane::AdoptedEndpoint> {
        let r = self.lock();
        r.state
            .endpoints
            .iter()
            .filter_map(|(id, ep)| {
                Some(npm_dataplane::AdoptedEndpoint {
                    ifindex: *r.interfaces.get(id)?,
                    id: *id,
                    ipv4: ep.ipv4,
                    ipv6: ep.ipv6,
                    isolated_ingress: ep.isolated_ingress,
                    isolated_egress: ep.isolated_egress,
                    tiered_directions: 0,
                })
            })
            .collect()
    }
    /// Like the nftables dataplane's (its tier chains): the tiered
    /// directions of the recorded endpoints (what a previous agent left,
    /// for a syncer that starts on a clone).
    fn adopted_tier_directions(&self) -> Option<usize> {
        Some(npm_agent::reconcile::guard::tiered_directions(&self.lock().state))
    }
    /// Like the eBPF dataplane's: the distinct pod identities of the
    /// recorded ipcache and the recorded endpoints (what a previous agent
    /// left, for a syncer that starts on a clone).
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        let r = self.lock();
        let identities: BTreeSet<u32> = r
            .state
            .ipcache
            .values()
            .map(|e| e.identity)
            .filter(|i| (npm_common::IDENTITY_FIRST_POD..npm_common::IDENTITY_FIRST_CIDR).contains(i))
            .collect();
        Some((identities.len(), r.state.endpoints.len()))
    }
}

/// Gives every endpoint the ifindex `1000 + id`.
pub struct FixedResolver;

impl Resolve for FixedResolver {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        Resolved {
            interfaces: compiled.endpoints.keys().map(|&id| (id, 1000 + id)).collect(),
            missing: Vec::new(),
        }
    }
}

/// A test API server and a client for it.
pub async fn server(validation: bool) -> (TestApiServer, kube::Client) {
    let srv = TestApiServer::start(Options {
        validation,
        ..Options::default()
    })
    .await
    .expect("start test API server");
    let client = client_for(&srv);
    (srv, client)
}

/// A kube client for the server.
pub fn client_for(srv: &TestApiServer) -> kube::Client {
    let mut config = kube::Config::new(srv.url().parse().expect("server url"));
    // As in the agent's main: no client-side retry of 503s.
    config.default_retry = false;
    kube::Client::try_from(config).expect("kube client")
}

/// Agent settings for tests: node `node-a`, short debounce, no HTTP server.
pub fn agent_config(page_size: u32) -> AgentConfig {
    AgentConfig {
        sync: SyncConfig {
            compile: CompileOptions {
                node_name: "node-a".into(),
                node_ips: Vec::new(),
                allow_host_egress: false,
                report_new: false,
            },
            debounce: Duration::from_millis(50),
            page_size,
            stats_interval: Duration::from_millis(500),
            ..SyncConfig::default()
        },
        page_size,
        metrics_addr: None,
        debug_addr: None,
        cni: None,
        dns: None,
        pod_conditions: None,
    }
}

/// The syncer the tests start from (builder-style: a test changes what it
/// needs and calls `build`): over `dp`, reading `cache`, with the settings
/// of `agent_config(100)`, the fixed resolver and `client` for the direct
/// reads of the mass-deletion guard.
pub fn test_syncer<D: AgentDataplane>(cache: &Arc<Cache>, dp: D, client: &kube::Client) -> SyncerBuilder<D> {
    Syncer::builder(cache.clone(), dp)
        .config(agent_config(100).sync)
        .resolver(Box::new(FixedResolver))
        .client(client.clone())
}

/// Start an agent over `dp` with the fixed resolver.
pub async fn start_agent(cfg: AgentConfig, client: kube::Client, dp: impl AgentDataplane + 'static) -> RunningAgent {
    start_agent_with(cfg, client, dp, Box::new(FixedResolver)).await
}

/// Start an agent over `dp` whose endpoints' interfaces `resolver` finds.
pub async fn start_agent_with(
    cfg: AgentConfig,
    client: kube::Client,
    dp: impl AgentDataplane + 'static,
    resolver: Box<dyn Resolve>,
) -> RunningAgent {
    agent::start(cfg, client, dp, resolver, Metrics::new().expect("metrics"))
        .await
        .expect("start agent")
}

/// A test API server holding namespace `k` and two Running pods of
/// `node-a`: `k/a` (app=a) at `<subnet>.1.2` and `k/b` (app=b) at
/// `<subnet>.2.2` (the kernel tests' two routed pods).
pub async fn two_pod_server(subnet: &str) -> (TestApiServer, kube::Client) {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("k", "a", "node-a", Some(&format!("{subnet}.1.2")), &[("app", "a")]),
            pod("k", "b", "node-a", Some(&format!("{subnet}.2.2")), &[("app", "b")]),
        ],
        2,
    )
    .await;
    (srv, client)
}

/// Policy `k/deny-b`: pods app=b are ingress-isolated.
pub fn deny_b() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "deny-b", "namespace": "k"},
        "spec": {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"]}
    })
}

/// Policy `k/allow-a`: pods app=a may reach pods app=b on port 8080.
pub fn allow_a() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "allow-a", "namespace": "k"},
        "spec": {"podSelector": {"matchLabels": {"app": "b"}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": 8080}]}]}
    })
}

/// Create namespaces.
pub async fn create_namespaces(client: &kube::Client, nss: &[Namespace]) {
    let api: Api<Namespace> = Api::all(client.clone());
    for ns in nss {
        api.create(&PostParams::default(), ns).await.expect("create namespace");
    }
}

/// Create pods, `concurrency` at a time.
pub async fn create_pods(client: &kube::Client, pods: Vec<Pod>, concurrency: usize) {
    futures::stream::iter(pods)
        .map(|p| {
            let api: Api<Pod> = Api::namespaced(client.clone(), p.metadata.namespace.as_deref().unwrap());
            async move {
                api.create(&PostParams::default(), &p)
                    .await
                    .unwrap_or_else(|e| panic!("create pod {:?}: {e}", p.metadata.name))
            }
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<_>>()
        .await;
}

/// Delete pods by (namespace, name), `concurrency` at a time.
pub async fn delete_pods(client: &kube::Client, names: Vec<(String, String)>, concurrency: usize) {
    futures::stream::iter(names)
        .map(|(ns, name)| {
            let api: Api<Pod> = Api::namespaced(client.clone(), &ns);
            async move { api.delete(&name, &DeleteParams::default()).await.expect("delete pod") }
        })
        .buffer_unordered(concurrency)
        .collect::<Vec<_>>()
        .await;
}

/// Create a NetworkPolicy from JSON.
pub async fn create_policy(
    client: &kube::Client,
    ns: &str,
    json: serde_json::Value,
) -> Result<NetworkPolicy, kube::Error> {
    let np: NetworkPolicy = serde_json::from_value(json).expect("policy JSON");
    Api::<NetworkPolicy>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &np)
        .await
}

/// Delete the NetworkPolicy `ns/name`.
pub async fn delete_policy(client: &kube::Client, ns: &str, name: &str) {
    Api::<NetworkPolicy>::namespaced(client.clone(), ns)
        .delete(name, &DeleteParams::default())
        .await
        .expect("delete policy");
}

/// Poll `cond` every 20 ms until it holds or `timeout` passes (then panic with `what`).
pub async fn wait_until(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Poll an async condition.
pub async fn wait_until_async<F: Future<Output = bool>>(what: &str, timeout: Duration, mut cond: impl FnMut() -> F) {
    let start = Instant::now();
    while !cond().await {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A metric sample of an agent (0 when absent).
pub fn metric(agent: &RunningAgent, series: &str) -> f64 {
    sample(&agent.metrics.render(), series).unwrap_or(0.0)
}

/// Names (`ns/name`) of the policies whose rules allow something for the
/// endpoint `endpoint` in the recorded state: the entries of its subject
/// (its pod identity; none when the endpoint is not in the state).
pub fn policies_of_endpoint(state: &Compiled, endpoint: u32) -> BTreeSet<String> {
    let Some(subject) = state.endpoints.get(&endpoint).map(|e| e.identity) else {
        return BTreeSet::new();
    };
    state
        .policy
        .iter()
        .filter(|(k, _)| k.subject == subject)
        .filter_map(|(_, rule)| match state.ids.rules.get(rule) {
            Some(RuleRef::Policy { namespace, name, .. }) => Some(format!("{namespace}/{name}")),
            _ => None,
        })
        .collect()
}

/// The endpoint id holding `ip`, if any.
pub fn endpoint_with_ip(state: &Compiled, ip: &str) -> Option<(u32, String)> {
    let ip: IpAddr = ip.parse().unwrap();
    state.endpoints.iter().find_map(|(&id, e)| {
        (e.ipv4.map(IpAddr::V4) == Some(ip) || e.ipv6.map(IpAddr::V6) == Some(ip))
            .then(|| (id, format!("{}/{}", e.pod.namespace, e.pod.name)))
    })
}

/// Feeds `cache` a complete list of `state`'s namespaces and policies and
/// of the pods `keep` accepts, as the watchers would.
pub fn feed_cache(cache: &Cache, state: &npm_agent::k8s::CompleteState, keep: impl Fn(&CachedPod) -> bool) {
    use kube::runtime::watcher::Event;
    cache.handle::<Namespace>(Event::Init);
    for n in &state.namespaces {
        cache.handle(Event::InitApply((**n).clone()));
    }
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    for p in &state.policies {
        cache.handle(Event::InitApply((**p).clone()));
    }
    cache.handle::<NetworkPolicy>(Event::InitDone);
    cache.handle::<CachedPod>(Event::Init);
    for p in state.pods.iter().filter(|p| keep(p)) {
        cache.handle(Event::InitApply((**p).clone()));
    }
    cache.handle::<CachedPod>(Event::InitDone);
}
