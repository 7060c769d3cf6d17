//! The agent's view of the cluster: the five [`ListStore`]s (pods,
//! namespaces, NetworkPolicies, ClusterNetworkPolicies, Nodes) behind one
//! [`Cache`] (shared by the watchers and the sync loop), the
//! [`CompleteState`] copy a sync works on, and what each watched kind
//! counts in the metrics.

use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::Event;
use kube::Resource;
use serde::de::DeserializeOwned;
use tokio::sync::Notify;

use super::cluster_policy::{ClusterNetworkPolicy, ClusterPolicyMode};
use super::nodes::NODE_PROJECTION;
use super::objects::Objects;
use super::pods::{Pod, POD_PROJECTION};
use super::store::{ListStore, StoreUpdate};
use crate::telemetry::metrics::{Metrics, PodOperation};

/// The five resources the agent watches.
pub trait Watched: Resource<DynamicType = ()> + Clone + DeserializeOwned + Debug + Send + Sync + 'static {
    /// Plural resource name (metrics label, logs).
    const NAME: &'static str;
    /// This kind's store in the cache.
    fn store(cache: &Cache) -> &Mutex<ListStore<Self>>;
    /// Count a change of the complete state (pods count their operations).
    fn count_change(_metrics: &Metrics, _old: Option<&Self>, _new: Option<&Self>) {}
}

impl Watched for Pod {
    const NAME: &'static str = "pods";
    fn store(cache: &Cache) -> &Mutex<ListStore<Self>> {
        &cache.pods
    }
    fn count_change(metrics: &Metrics, old: Option<&Self>, new: Option<&Self>) {
        if let Some(op) = classify_pod_change(old, new) {
            metrics.pod_event(op, 1);
        }
    }
}

impl Watched for Namespace {
    const NAME: &'static str = "namespaces";
    fn store(cache: &Cache) -> &Mutex<ListStore<Self>> {
        &cache.namespaces
    }
}

impl Watched for NetworkPolicy {
    const NAME: &'static str = "networkpolicies";
    fn store(cache: &Cache) -> &Mutex<ListStore<Self>> {
        &cache.policies
    }
}

impl Watched for ClusterNetworkPolicy {
    const NAME: &'static str = super::cluster_policy::PLURAL;
    fn store(cache: &Cache) -> &Mutex<ListStore<Self>> {
        &cache.cluster_policies
    }
}

impl Watched for Node {
    const NAME: &'static str = "nodes";
    fn store(cache: &Cache) -> &Mutex<ListStore<Self>> {
        &cache.nodes
    }
}

fn pod_has_ip(p: &Pod) -> bool {
    p.status.as_ref().is_some_and(|s| {
        s.pod_ip.as_deref().is_some_and(|ip| !ip.is_empty())
            || s.pod_ips
                .as_ref()
                .is_some_and(|ips| ips.iter().any(|i| !i.ip.is_empty()))
    })
}

/// The `npm_controller_pod_event_total` operation of a pod change; `None`
/// when nothing changed.
pub fn classify_pod_change(old: Option<&Pod>, new: Option<&Pod>) -> Option<PodOperation> {
    match (old, new) {
        (None, Some(_)) => Some(PodOperation::Create),
        (Some(_), None) => Some(PodOperation::Delete),
        (Some(o), Some(n)) if pod_has_ip(o) && !pod_has_ip(n) => Some(PodOperation::UpdateWithEmptyIp),
        (Some(_), Some(_)) => Some(PodOperation::Update),
        (None, None) => None,
    }
}

/// A consistent copy of the five complete stores (each a copy of the
/// store's [`Objects`]: O(1), sharing its structure).
#[derive(Clone, Debug, Default)]
pub struct CompleteState {
    /// Namespaces.
    pub namespaces: Objects<Namespace>,
    /// Pods (slim: [`crate::k8s::pods`]).
    pub pods: Objects<Pod>,
    /// NetworkPolicies.
    pub policies: Objects<NetworkPolicy>,
    /// ClusterNetworkPolicies (empty when the API does not serve them and
    /// `--cluster-network-policies` is `auto`, or it is `off`).
    pub cluster_policies: Objects<ClusterNetworkPolicy>,
    /// Nodes, slim (see [`crate::k8s::nodes`]; empty when the cache does
    /// not watch them, [`Cache::watches_nodes`]).
    pub nodes: Objects<Node>,
}

/// The agent's view of the cluster, shared by the watchers and the sync loop.
pub struct Cache {
    /// Pods of every namespace (slim: [`crate::k8s::pods`]).
    pub pods: Mutex<ListStore<Pod>>,
    /// Namespaces.
    pub namespaces: Mutex<ListStore<Namespace>>,
    /// NetworkPolicies.
    pub policies: Mutex<ListStore<NetworkPolicy>>,
    /// ClusterNetworkPolicies.
    pub cluster_policies: Mutex<ListStore<ClusterNetworkPolicy>>,
    /// Nodes (slim: [`crate::k8s::nodes`]).
    pub nodes: Mutex<ListStore<Node>>,
    /// Woken on every change of a complete state.
    pub changed: Notify,
    /// When the oldest change not yet programmed was received.
    pub first_unprogrammed: Mutex<Option<Instant>>,
    metrics: Metrics,
    cluster_policy_mode: ClusterPolicyMode,
    watch_nodes: bool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a store lock leaves consistent data (every
    // mutation is a single insert/remove/swap); keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Cache {
    /// An empty cache of pods, namespaces and NetworkPolicies that does not
    /// watch ClusterNetworkPolicies nor Nodes: their lists are complete and
    /// empty from the start, as with `--cluster-network-policies=off`
    /// ([`Cache::with_cluster_policies`] with [`ClusterPolicyMode::Off`]).
    pub fn new(metrics: Metrics) -> Arc<Cache> {
        Cache::with_cluster_policies(metrics, ClusterPolicyMode::Off)
    }

    /// The agent's cache: as [`Cache::with_cluster_policies`], and Nodes
    /// are watched too (their list is incomplete, so nothing is
    /// programmed, until their watcher completes one; other nodes'
    /// addresses are node identities, not world).
    pub fn watching_nodes(metrics: Metrics, mode: ClusterPolicyMode) -> Arc<Cache> {
        Cache::build(metrics, mode, true)
    }

    /// An empty cache whose ClusterNetworkPolicies follow `mode`: with
    /// `auto` and `on` their list is incomplete (nothing is programmed)
    /// until their watcher completes one (or, with `auto`, finds them not
    /// served); with `off` it is complete and empty from the start. The
    /// watchers ([`crate::k8s::spawn_watchers`]) and the guard's direct
    /// reads follow the mode of the cache. Nodes are not watched (their
    /// list is complete and empty: other nodes' addresses are world; the
    /// agent uses [`Cache::watching_nodes`]).
    pub fn with_cluster_policies(metrics: Metrics, mode: ClusterPolicyMode) -> Arc<Cache> {
        Cache::build(metrics, mode, false)
    }

    fn build(metrics: Metrics, mode: ClusterPolicyMode, watch_nodes: bool) -> Arc<Cache> {
        let mut cluster_policies = ListStore::default();
        if mode == ClusterPolicyMode::Off {
            cluster_policies.handle(Event::Init, |_, _| {});
            cluster_policies.handle(Event::InitDone, |_, _| {});
        }
        let mut nodes = ListStore::projected(NODE_PROJECTION);
        if !watch_nodes {
            nodes.handle(Event::Init, |_, _| {});
            nodes.handle(Event::InitDone, |_, _| {});
        }
        Arc::new(Cache {
            pods: Mutex::new(ListStore::projected(POD_PROJECTION)),
            namespaces: Mutex::default(),
            policies: Mutex::default(),
            cluster_policies: Mutex::new(cluster_policies),
            nodes: Mutex::new(nodes),
            changed: Notify::new(),
            first_unprogrammed: Mutex::new(None),
            metrics,
            cluster_policy_mode: mode,
            watch_nodes,
        })
    }

    /// Whether Nodes are watched (and read by the guard's direct reads).
    pub fn watches_nodes(&self) -> bool {
        self.watch_nodes
    }

    /// Whether (and how) ClusterNetworkPolicies are watched.
    pub fn cluster_policy_mode(&self) -> ClusterPolicyMode {
        self.cluster_policy_mode
    }

    /// The metrics registry the cache counts watch events into.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Feed one watcher event of kind `K`; wakes the sync loop when the
    /// complete state changed.
    pub fn handle<K: Watched>(&self, event: Event<K>) -> StoreUpdate {
        let name = match &event {
            Event::Init => "init",
            Event::InitApply(_) => "init-apply",
            Event::InitDone => "init-done",
            Event::Apply(_) => "apply",
            Event::Delete(_) => "delete",
        };
        self.metrics.watch_event(K::NAME, name);
        if name == "delete" && super::fault_injection::skip_delete(K::NAME) {
            tracing::warn!(
                resource = K::NAME,
                "fault injection ({}): dropping a watch delete",
                super::fault_injection::SKIP_DELETE_ENV
            );
            return StoreUpdate::Unchanged;
        }
        let update = lock(K::store(self)).handle(event, |o, n| K::count_change(&self.metrics, o, n));
        if name == "init-done" {
            tracing::info!(resource = K::NAME, "full list completed");
        }
        if update == StoreUpdate::Changed {
            self.mark_changed();
        }
        update
    }

    /// Wake the sync loop (a change, or a retry it asked for).
    pub fn mark_changed(&self) {
        lock(&self.first_unprogrammed).get_or_insert_with(Instant::now);
        self.changed.notify_one();
    }

    /// When the oldest change not yet programmed was received.
    pub fn first_unprogrammed(&self) -> Option<Instant> {
        *lock(&self.first_unprogrammed)
    }

    /// Take the time of the oldest unprogrammed change.
    pub fn take_first_unprogrammed(&self) -> Option<Instant> {
        lock(&self.first_unprogrammed).take()
    }

    /// Whether pods, namespaces, NetworkPolicies, ClusterNetworkPolicies
    /// and Nodes have each completed a full list.
    pub fn all_listed(&self) -> bool {
        lock(&self.pods).is_listed()
            && lock(&self.namespaces).is_listed()
            && lock(&self.policies).is_listed()
            && lock(&self.cluster_policies).is_listed()
            && lock(&self.nodes).is_listed()
    }

    /// The number of full lists completed by the five stores together
    /// (it grows with each relist).
    pub fn lists_completed(&self) -> u64 {
        lock(&self.pods).lists_completed()
            + lock(&self.namespaces).lists_completed()
            + lock(&self.policies).lists_completed()
            + lock(&self.cluster_policies).lists_completed()
            + lock(&self.nodes).lists_completed()
    }

    /// The complete state of all five resources, `None` until all five
    /// have completed a full list.
    pub fn complete(&self) -> Option<CompleteState> {
        let pods = lock(&self.pods);
        let namespaces = lock(&self.namespaces);
        let policies = lock(&self.policies);
        let cluster_policies = lock(&self.cluster_policies);
        let nodes = lock(&self.nodes);
        Some(CompleteState {
            pods: pods.complete()?.clone(),
            namespaces: namespaces.complete()?.clone(),
            policies: policies.complete()?.clone(),
            cluster_policies: cluster_policies.complete()?.clone(),
            nodes: nodes.complete()?.clone(),
        })
    }

    /// The API server does not serve ClusterNetworkPolicies (a `404` on the
    /// list with `--cluster-network-policies=auto`, or the mode is `off`):
    /// their list counts as complete and empty, exactly as a relist that
    /// found none (a removal of CNPs listed before goes through the sync
    /// loop's mass-removal guard). Does nothing (and wakes nobody) when the
    /// complete list is empty already. Returns whether it changed the
    /// complete state.
    pub fn mark_cluster_policies_absent(&self) -> bool {
        let already_empty = lock(&self.cluster_policies).complete().is_some_and(|c| c.is_empty());
        if already_empty {
            return false;
        }
        self.handle::<ClusterNetworkPolicy>(Event::Init);
        self.handle::<ClusterNetworkPolicy>(Event::InitDone) == StoreUpdate::Changed
    }
}
