//! The kube-rs watchers (`kube::runtime::watcher`, paginated with
//! `page_size`, with its default backoff) of the five resources, each
//! feeding the [`Cache`]. A failed watch is counted and logged; the last
//! complete list stays in force. The ClusterNetworkPolicy watcher also
//! applies [`ClusterPolicyMode`] to a failed list (a `404` in `auto` is a
//! complete empty list, a `403` a readiness problem; see
//! [`cluster_policy`](super::cluster_policy)).

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::cache::{Cache, Watched};
use super::cluster_policy::{
    classify_list_error, ClusterNetworkPolicy, ClusterPolicyMode, ListFailure, CHECK_CLUSTER_POLICIES,
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

/// Run the ClusterNetworkPolicy watcher forever, feeding `cache`: as
/// [`watch`], and a failed list is classified by `mode` (a `404` in `auto`
/// makes the list complete and empty; a `403`, or a `404` in `on`, is
/// reported as the readiness check [`CHECK_CLUSTER_POLICIES`] until a list
/// completes).
pub async fn watch_cluster_policies(
    api: Api<ClusterNetworkPolicy>,
    page_size: u32,
    mode: ClusterPolicyMode,
    cache: Arc<Cache>,
    metrics: Metrics,
    health: Arc<Health>,
) {
    let config = watcher::Config::default().page_size(page_size);
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    let mut not_served = false;
    // The check is reported from its first failure on (as every problem
    // check), then cleared by a list that completes or finds them not served.
    let mut reported = false;
    let clear = |health: &Health, reported: &mut bool| {
        if std::mem::take(reported) {
            health.set_problem(CHECK_CLUSTER_POLICIES, None);
        }
    };
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                if matches!(event, kube::runtime::watcher::Event::InitDone) {
                    if not_served {
                        tracing::info!("ClusterNetworkPolicies are served now; watching them");
                    }
                    not_served = false;
                    clear(&health, &mut reported);
                }
                cache.handle(event);
            }
            Err(watcher::Error::InitialListFailed(e)) => match classify_list_error(mode, &e) {
                ListFailure::NotServed => {
                    clear(&health, &mut reported);
                    if cache.mark_cluster_policies_absent() {
                        tracing::warn!(
                            "the API server no longer serves ClusterNetworkPolicies (404): their list is now empty;                              the removal of the ones enforced goes through the mass-removal guard"
                        );
                    } else if !not_served {
                        tracing::info!(
                            "the API server does not serve ClusterNetworkPolicies (404, CRD not installed): none                              enforced; looking again with the watcher's backoff (at most 30 s)"
                        );
                    }
                    not_served = true;
                }
                ListFailure::Forbidden(problem) | ListFailure::Other(Some(problem)) => {
                    metrics.error("watch");
                    tracing::warn!(%problem, "listing ClusterNetworkPolicies failed; the last complete list stays in force");
                    health.set_problem(CHECK_CLUSTER_POLICIES, Some(problem));
                    reported = true;
                }
                ListFailure::Other(None) => {
                    metrics.error("watch");
                    tracing::warn!(error = %e, "listing ClusterNetworkPolicies failed; the last complete list stays in force");
                }
            },
            Err(e) => {
                metrics.error("watch");
                tracing::warn!(resource = ClusterNetworkPolicy::NAME, error = %e, "watch failed; the last complete list stays in force");
            }
        }
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
            Api::all(client.clone()),
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
