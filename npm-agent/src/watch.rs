//! Watching the API server: pods (all namespaces), namespaces and
//! NetworkPolicies, each into a [`ListStore`] that only trusts complete lists.
//!
//! Incident 2 (a paginated LIST hit `410 Gone` mid-list and a controller
//! trusted the partial list and deleted live resources) shapes this module:
//!
//! - the objects of a (re)list (`Init`, `InitApply`...) are buffered aside;
//!   the store's complete state is replaced only on `InitDone`. A relist that
//!   fails mid-way (the watcher restarts with a new `Init`) throws its buffer
//!   away and the last complete state stays in force;
//! - nothing is reported as changed for `InitApply`: the sync loop is only
//!   woken by `InitDone`, `Apply` and `Delete`;
//! - [`Cache::complete`] returns nothing until all three resources have
//!   completed a full list, so the agent programs and deletes nothing before.
//!
//! kube's reflector store is not used on purpose: we need the "keep the last
//! complete state during a relist" behaviour and per-resource list tracking
//! in one place. The watcher itself is kube-rs' (`kube::runtime::watcher`,
//! paginated with `page_size`, with its default backoff).

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource, ResourceExt};
use serde::de::DeserializeOwned;
use tokio::sync::Notify;

use crate::metrics::{Metrics, PodOperation};

/// Errors of the direct (uncached) reads.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// A direct LIST failed.
    #[error("direct list of {resource} failed: {source}")]
    DirectList {
        /// Resource being listed.
        resource: &'static str,
        /// The client error.
        #[source]
        source: kube::Error,
    },
}

/// `namespace/name` of an object (`name` for cluster-scoped ones).
pub type ObjKey = (String, String);

/// The objects of one resource kind, trusting only complete lists.
#[derive(Debug)]
pub struct ListStore<K> {
    complete: Option<BTreeMap<ObjKey, Arc<K>>>,
    pending: Option<BTreeMap<ObjKey, Arc<K>>>,
    lists_completed: u64,
}

impl<K> Default for ListStore<K> {
    fn default() -> Self {
        ListStore {
            complete: None,
            pending: None,
            lists_completed: 0,
        }
    }
}

/// What a watch event did to a store (the sync loop is woken for `Changed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreUpdate {
    /// Nothing visible changed (a buffered InitApply, or Init).
    Buffered,
    /// The complete state changed.
    Changed,
}

impl<K: Resource + Clone> ListStore<K> {
    /// Whether a full list has completed at least once.
    pub fn is_listed(&self) -> bool {
        self.complete.is_some()
    }

    /// Whether a relist is in progress (its objects are not trusted yet).
    pub fn is_relisting(&self) -> bool {
        self.pending.is_some()
    }

    /// Number of full lists completed.
    pub fn lists_completed(&self) -> u64 {
        self.lists_completed
    }

    /// The last complete state, `None` before the first full list.
    pub fn complete(&self) -> Option<&BTreeMap<ObjKey, Arc<K>>> {
        self.complete.as_ref()
    }

    /// Apply one watcher event. `on_change(old, new)` is called for every
    /// object change of the complete state (with both `None`-able sides).
    pub fn handle(&mut self, event: Event<K>, mut on_change: impl FnMut(Option<&K>, Option<&K>)) -> StoreUpdate {
        match event {
            Event::Init => {
                self.pending = Some(BTreeMap::new());
                StoreUpdate::Buffered
            }
            Event::InitApply(obj) => {
                let obj = strip(obj);
                self.pending
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key_of(&obj), Arc::new(obj));
                StoreUpdate::Buffered
            }
            Event::InitDone => {
                let new = self.pending.take().unwrap_or_default();
                let old = self.complete.take().unwrap_or_default();
                for (k, o) in &old {
                    match new.get(k) {
                        None => on_change(Some(o), None),
                        Some(n)
                            if !Arc::ptr_eq(o, n) && resource_version(o.as_ref()) != resource_version(n.as_ref()) =>
                        {
                            on_change(Some(o), Some(n))
                        }
                        Some(_) => {}
                    }
                }
                for (k, n) in &new {
                    if !old.contains_key(k) {
                        on_change(None, Some(n));
                    }
                }
                self.complete = Some(new);
                self.lists_completed += 1;
                StoreUpdate::Changed
            }
            Event::Apply(obj) => {
                let obj = Arc::new(strip(obj));
                let Some(complete) = self.complete.as_mut() else {
                    // Cannot happen with kube's watcher (Apply only follows
                    // InitDone); if it did, a partial state is not trusted.
                    self.pending
                        .get_or_insert_with(BTreeMap::new)
                        .insert(key_of(obj.as_ref()), obj);
                    return StoreUpdate::Buffered;
                };
                let old = complete.insert(key_of(obj.as_ref()), obj.clone());
                on_change(old.as_deref(), Some(&obj));
                StoreUpdate::Changed
            }
            Event::Delete(obj) => {
                let Some(complete) = self.complete.as_mut() else {
                    if let Some(p) = self.pending.as_mut() {
                        p.remove(&key_of(&obj));
                    }
                    return StoreUpdate::Buffered;
                };
                let old = complete.remove(&key_of(&obj));
                on_change(old.as_deref().or(Some(&obj)), None);
                StoreUpdate::Changed
            }
        }
    }
}

fn resource_version<K: Resource>(o: &K) -> Option<&String> {
    o.meta().resource_version.as_ref()
}

/// `(namespace, name)` of an object; cluster-scoped objects have an empty namespace.
pub fn key_of<K: Resource>(o: &K) -> ObjKey {
    (
        o.meta().namespace.clone().unwrap_or_default(),
        o.meta().name.clone().unwrap_or_default(),
    )
}

/// Drop the fields the agent never reads (managedFields, annotations) so the
/// cache of a large cluster stays small.
pub fn strip<K: Resource>(mut o: K) -> K {
    let m = o.meta_mut();
    m.managed_fields = None;
    m.annotations = None;
    o
}

/// The three resources the agent watches.
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

/// A consistent copy of the three complete stores.
#[derive(Clone, Debug, Default)]
pub struct CompleteState {
    /// Namespaces.
    pub namespaces: Vec<Arc<Namespace>>,
    /// Pods.
    pub pods: Vec<Arc<Pod>>,
    /// NetworkPolicies.
    pub policies: Vec<Arc<NetworkPolicy>>,
}

/// The agent's view of the cluster, shared by the watchers and the sync loop.
pub struct Cache {
    /// Pods of every namespace.
    pub pods: Mutex<ListStore<Pod>>,
    /// Namespaces.
    pub namespaces: Mutex<ListStore<Namespace>>,
    /// NetworkPolicies.
    pub policies: Mutex<ListStore<NetworkPolicy>>,
    /// Woken on every change of a complete state.
    pub changed: Notify,
    /// When the oldest change not yet programmed was received.
    pub first_unprogrammed: Mutex<Option<Instant>>,
    metrics: Metrics,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding a store lock leaves consistent data (every
    // mutation is a single insert/remove/swap); keep going.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Cache {
    /// An empty cache.
    pub fn new(metrics: Metrics) -> Arc<Cache> {
        Arc::new(Cache {
            pods: Mutex::default(),
            namespaces: Mutex::default(),
            policies: Mutex::default(),
            changed: Notify::new(),
            first_unprogrammed: Mutex::new(None),
            metrics,
        })
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

    /// Whether pods, namespaces and policies have each completed a full list.
    pub fn all_listed(&self) -> bool {
        lock(&self.pods).is_listed() && lock(&self.namespaces).is_listed() && lock(&self.policies).is_listed()
    }

    /// The complete state of all three resources, `None` until all three
    /// have completed a full list.
    pub fn complete(&self) -> Option<CompleteState> {
        let pods = lock(&self.pods);
        let namespaces = lock(&self.namespaces);
        let policies = lock(&self.policies);
        Some(CompleteState {
            pods: pods.complete()?.values().cloned().collect(),
            namespaces: namespaces.complete()?.values().cloned().collect(),
            policies: policies.complete()?.values().cloned().collect(),
        })
    }
}

/// Run the watcher of one resource kind forever, feeding `cache`.
pub async fn watch<K: Watched>(api: Api<K>, page_size: u32, cache: Arc<Cache>, metrics: Metrics) {
    let config = watcher::Config::default().page_size(page_size);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                cache.handle(event);
            }
            Err(e) => {
                metrics.error("watch");
                tracing::warn!(resource = K::NAME, error = %e, "watch failed; the last complete list stays in force");
            }
        }
    }
}

/// Spawn the three watchers on the current tokio runtime.
pub fn spawn_watchers(
    client: Client,
    page_size: u32,
    cache: &Arc<Cache>,
    metrics: &Metrics,
) -> Vec<tokio::task::JoinHandle<()>> {
    vec![
        tokio::spawn(watch(
            Api::<Pod>::all(client.clone()),
            page_size,
            cache.clone(),
            metrics.clone(),
        )),
        tokio::spawn(watch(
            Api::<Namespace>::all(client.clone()),
            page_size,
            cache.clone(),
            metrics.clone(),
        )),
        tokio::spawn(watch(
            Api::<NetworkPolicy>::all(client),
            page_size,
            cache.clone(),
            metrics.clone(),
        )),
    ]
}

async fn direct_list<K: Watched>(api: Api<K>, page_size: u32) -> Result<Vec<Arc<K>>, WatchError> {
    let mut out = Vec::new();
    let mut lp = kube::api::ListParams::default().limit(page_size);
    loop {
        let list = api.list(&lp).await.map_err(|source| WatchError::DirectList {
            resource: K::NAME,
            source,
        })?;
        out.extend(list.items.into_iter().map(|o| Arc::new(strip(o))));
        match list.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => return Ok(out),
        }
    }
}

/// A fresh, complete read of all three resources straight from the API
/// server (not the cache): the confirmation the mass-deletion guard needs.
/// A list that fails mid-way (e.g. `410` on a continue token) is an error,
/// never a partial result.
pub async fn direct_read(client: &Client, page_size: u32) -> Result<CompleteState, WatchError> {
    Ok(CompleteState {
        namespaces: direct_list(Api::<Namespace>::all(client.clone()), page_size).await?,
        pods: direct_list(Api::<Pod>::all(client.clone()), page_size).await?,
        policies: direct_list(Api::<NetworkPolicy>::all(client.clone()), page_size).await?,
    })
}

impl<K: Resource> ListStore<K> {
    /// Name of the objects of the complete state (for tests and logs).
    pub fn names(&self) -> Vec<String>
    where
        K: ResourceExt,
    {
        self.complete
            .as_ref()
            .map(|c| c.values().map(|o| o.name_any()).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::PodStatus;
    use kube::api::ObjectMeta;

    fn pod(name: &str, rv: &str, ip: Option<&str>) -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some("ns".into()),
                resource_version: Some(rv.into()),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                ..Default::default()
            },
            status: Some(PodStatus {
                pod_ip: ip.map(String::from),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn relist_keeps_last_complete_state_until_init_done() {
        let metrics = Metrics::new().unwrap();
        let cache = Cache::new(metrics.clone());
        cache.handle::<Pod>(Event::Init);
        cache.handle(Event::InitApply(pod("a", "1", Some("10.0.0.1"))));
        assert!(
            cache.pods.lock().unwrap().complete().is_none(),
            "a partial first list is not trusted"
        );
        cache.handle::<Pod>(Event::InitDone);
        cache.handle(Event::InitApply(pod("x", "1", None)));
        assert_eq!(cache.pods.lock().unwrap().names(), vec!["a"]);
        // Relist interrupted (410): a new Init throws the partial buffer away.
        cache.handle::<Pod>(Event::Init);
        cache.handle(Event::InitApply(pod("b", "2", Some("10.0.0.2"))));
        assert_eq!(
            cache.pods.lock().unwrap().names(),
            vec!["a"],
            "last complete state stays"
        );
        assert!(cache.complete().is_none(), "namespaces and policies not listed yet");
        cache.handle::<Pod>(Event::Init);
        cache.handle(Event::InitApply(pod("a", "1", Some("10.0.0.1"))));
        cache.handle(Event::InitApply(pod("b", "2", Some("10.0.0.2"))));
        cache.handle::<Pod>(Event::InitDone);
        assert_eq!(cache.pods.lock().unwrap().names(), vec!["a", "b"]);
        let stored = cache.pods.lock().unwrap().complete().unwrap()[&("ns".into(), "a".into())].clone();
        assert!(stored.metadata.annotations.is_none(), "annotations stripped");
        cache.handle(Event::Apply(pod("b", "3", None)));
        cache.handle(Event::Delete(pod("a", "4", None)));
        cache.handle::<Namespace>(Event::Init);
        cache.handle::<Namespace>(Event::InitDone);
        cache.handle::<NetworkPolicy>(Event::Init);
        cache.handle::<NetworkPolicy>(Event::InitDone);
        let state = cache.complete().expect("all listed");
        assert_eq!(state.pods.len(), 1);
        let text = metrics.render();
        let get = |op: &str| {
            crate::metrics::sample(&text, &format!("npm_controller_pod_event_total{{operation=\"{op}\"}}")).unwrap()
        };
        assert_eq!(get("create"), 2.0, "a (first list) and b (relist)");
        assert_eq!(get("update-with-empty-ip"), 1.0);
        assert_eq!(get("delete"), 1.0);
    }
}
