//! The kube-rs watchers (`kube::runtime::watcher`, paginated with
//! `page_size`, with its default backoff) of the three resources, each
//! feeding the [`Cache`]. A failed watch is counted and logged; the last
//! complete list stays in force.

use std::sync::Arc;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};

use super::cache::{Cache, Watched};
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
