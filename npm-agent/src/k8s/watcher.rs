//! The kube-rs watchers (`kube::runtime::watcher`, paginated with
//! `page_size`, with its default backoff) of the five resources, each
//! feeding the [`Cache`]. A failed watch is counted and logged; the last
//! complete list stays in force. The ClusterNetworkPolicy watcher also
//! reads the version discovery says is served, and decides a `404` on its
//! list or watch with discovery and [`ClusterPolicyMode`] (another version:
//! switch without a gap; confirmed absent in `auto`: a complete empty list;
//! else "unknown": the last list stays, not ready), a `403` being a
//! readiness problem (see [`cluster_policy`](super::cluster_policy)).

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::cache::{Cache, Watched};
use super::cluster_policy::{
    after_not_found, classify_list_error, discover, ClusterNetworkPolicy, ClusterNetworkPolicyV1beta1,
    ClusterPolicyMode, ListFailure, NotFound, CHECK_CLUSTER_POLICIES, VERSIONS,
};
use super::pods::Pod;
use crate::telemetry::health::Health;
use crate::telemetry::metrics::Metrics;

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

/// The pause before the ClusterNetworkPolicy watch starts over with a list
/// after its watch (not its list) answered `404` or `403`.
const RELIST_PAUSE: std::time::Duration = std::time::Duration::from_secs(1);

/// What the ClusterNetworkPolicy watcher carries from one version's watch
/// to the next.
#[derive(Default)]
struct CnpWatch {
    /// The last list found them confirmed absent (for the logs).
    not_served: bool,
    /// The readiness check is reported failing (cleared by a list that
    /// completes or finds them confirmed absent).
    reported: bool,
}

/// Everything a ClusterNetworkPolicy watch reports to.
struct CnpSinks<'a> {
    client: &'a Client,
    mode: ClusterPolicyMode,
    cache: &'a Cache,
    metrics: &'a Metrics,
    health: &'a Health,
}

impl CnpWatch {
    fn clear(&mut self, health: &Health) {
        if std::mem::take(&mut self.reported) {
            health.set_problem(CHECK_CLUSTER_POLICIES, None);
        }
    }

    fn report(&mut self, sinks: &CnpSinks<'_>, kind: &'static str, problem: String) {
        sinks.metrics.error(kind);
        tracing::warn!(%problem, "ClusterNetworkPolicies: the last complete list stays in force");
        sinks.health.set_problem(CHECK_CLUSTER_POLICIES, Some(problem));
        self.reported = true;
    }

    /// A failed list (or watch start) at `version`: a `404` decided by
    /// discovery ([`after_not_found`]), a `403` reported. `Some(version)`
    /// when discovery says another version is served (read that one).
    async fn failed(&mut self, e: &kube::Error, version: &'static str, sinks: &CnpSinks<'_>) -> Option<&'static str> {
        match classify_list_error(e) {
            ListFailure::NotFound => match after_not_found(sinks.mode, version, discover(sinks.client).await) {
                NotFound::Switch(next) => {
                    tracing::warn!(
                        from = version,
                        to = next,
                        "ClusterNetworkPolicies are no longer served at {version} (404) but are at {next}: reading \
                         {next}; the last list stays enforced until its list completes"
                    );
                    return Some(next);
                }
                NotFound::Absent(why) => {
                    self.clear(sinks.health);
                    if sinks.cache.mark_cluster_policies_absent() {
                        tracing::warn!(
                            %why,
                            "ClusterNetworkPolicies are confirmed no longer served (404, and discovery): their list \
                             is now empty; the removal of the ones enforced goes through the mass-removal guard"
                        );
                    } else if !self.not_served {
                        tracing::info!(
                            %why,
                            "the API server does not serve ClusterNetworkPolicies (404, CRD not installed): none \
                             enforced; looking again with the watcher's backoff (at most 30 s)"
                        );
                    }
                    self.not_served = true;
                }
                NotFound::Unknown(problem) => self.report(sinks, "cluster-policies-unknown", problem),
            },
            ListFailure::Forbidden(problem) => self.report(sinks, "watch", problem),
            ListFailure::Other => {
                sinks.metrics.error("watch");
                tracing::warn!(error = %e, "listing ClusterNetworkPolicies failed; the last complete list stays in force");
            }
        }
        None
    }

    /// Watch ClusterNetworkPolicies at `version` (`api`, its objects made
    /// [`ClusterNetworkPolicy`] by `into`) until a `404` and discovery name
    /// another version: that version.
    async fn watch_version<V>(
        &mut self,
        api: Api<V>,
        version: &'static str,
        page_size: u32,
        sinks: &CnpSinks<'_>,
        into: fn(V) -> ClusterNetworkPolicy,
    ) -> &'static str
    where
        V: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + 'static,
    {
        let config = watcher::Config::default().page_size(page_size);
        let mut stream = watcher::watcher(api, config).default_backoff().boxed();
        while let Some(item) = stream.next().await {
            match item {
                Ok(event) => {
                    if matches!(event, watcher::Event::InitDone) {
                        if std::mem::take(&mut self.not_served) {
                            tracing::info!(version, "ClusterNetworkPolicies are served now; watching them");
                        }
                        self.clear(sinks.health);
                    }
                    sinks.cache.handle(map_event(event, into));
                }
                Err(watcher::Error::InitialListFailed(e)) => {
                    if let Some(next) = self.failed(&e, version, sinks).await {
                        return next;
                    }
                }
                Err(watcher::Error::WatchStartFailed(e)) => {
                    let relist = matches!(
                        classify_list_error(&e),
                        ListFailure::NotFound | ListFailure::Forbidden(_)
                    );
                    if let Some(next) = self.failed(&e, version, sinks).await {
                        return next;
                    }
                    if relist {
                        // The watcher would resume the watch from its last
                        // version and never list again: a server that serves
                        // them again would then never clear the check (no
                        // list completes), and objects written while they
                        // were not served would be missed. Start over with a
                        // list, after a pause.
                        tokio::time::sleep(RELIST_PAUSE).await;
                        return version;
                    }
                }
                Err(e) => {
                    sinks.metrics.error("watch");
                    tracing::warn!(resource = ClusterNetworkPolicy::NAME, error = %e, "watch failed; the last complete list stays in force");
                }
            }
        }
        version
    }
}

/// A watcher event of `V` as one of [`ClusterNetworkPolicy`].
fn map_event<V>(event: watcher::Event<V>, into: fn(V) -> ClusterNetworkPolicy) -> watcher::Event<ClusterNetworkPolicy> {
    use watcher::Event;
    match event {
        Event::Init => Event::Init,
        Event::InitApply(o) => Event::InitApply(into(o)),
        Event::InitDone => Event::InitDone,
        Event::Apply(o) => Event::Apply(into(o)),
        Event::Delete(o) => Event::Delete(into(o)),
    }
}

/// Run the ClusterNetworkPolicy watcher forever, feeding `cache`: as
/// [`watch`], at the version discovery says is served (`v1alpha2` first,
/// [`VERSIONS`]); a `404` on the list or watch is decided by discovery
/// ([`after_not_found`]: switch version, confirmed absent, or unknown), a
/// `403` is reported as the readiness check [`CHECK_CLUSTER_POLICIES`]
/// until a list completes.
pub async fn watch_cluster_policies(
    client: Client,
    page_size: u32,
    mode: ClusterPolicyMode,
    cache: Arc<Cache>,
    metrics: Metrics,
    health: Arc<Health>,
) {
    let sinks = CnpSinks {
        client: &client,
        mode,
        cache: &cache,
        metrics: &metrics,
        health: &health,
    };
    let mut state = CnpWatch::default();
    let mut version = VERSIONS[0];
    loop {
        version = if version == VERSIONS[1] {
            let api = Api::<ClusterNetworkPolicyV1beta1>::all(client.clone());
            state.watch_version(api, version, page_size, &sinks, |o| o.0).await
        } else {
            let api = Api::<ClusterNetworkPolicy>::all(client.clone());
            state.watch_version(api, version, page_size, &sinks, |o| o).await
        };
    }
}

/// Spawn the watchers on the current tokio runtime: pods, namespaces,
/// NetworkPolicies, Nodes when the cache watches them
/// ([`Cache::watches_nodes`]) and, unless the cache's [`ClusterPolicyMode`]
/// is `off` (then their list is complete and empty from the start),
/// ClusterNetworkPolicies.
pub fn spawn_watchers(
    client: Client,
    page_size: u32,
    cache: &Arc<Cache>,
    metrics: &Metrics,
    health: &Arc<Health>,
) -> Vec<tokio::task::JoinHandle<()>> {
    let mut tasks = Vec::new();
    let cluster_policies = cache.cluster_policy_mode();
    if cluster_policies == ClusterPolicyMode::Off {
        tracing::info!("ClusterNetworkPolicies are not watched (--cluster-network-policies=off)");
    } else {
        tasks.push(tokio::spawn(watch_cluster_policies(
            client.clone(),
            page_size,
            cluster_policies,
            cache.clone(),
            metrics.clone(),
            health.clone(),
        )));
    }
    if cache.watches_nodes() {
        tasks.push(tokio::spawn(watch(
            Api::<Node>::all(client.clone()),
            page_size,
            cache.clone(),
            metrics.clone(),
        )));
    }
    tasks.extend([
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
    ]);
    tasks
}
