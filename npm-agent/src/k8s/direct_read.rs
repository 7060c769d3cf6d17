//! The direct read: a fresh, complete, paginated LIST of the five
//! resources straight from the API server (not the cache), which the
//! mass-deletion guard needs to confirm a large removal. The
//! ClusterNetworkPolicies follow [`ClusterPolicyMode`]: not read with
//! `off`; a `404` is decided by discovery as for the watcher (another
//! version served: read it; confirmed absent with `auto`: an empty list;
//! otherwise the read fails, so a held removal of CNPs stays held), any
//! other failure fails the read. Nodes are read unless the cache they
//! confirm does not watch them ([`direct_read_for`]).

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::{Api, Client};

use super::cache::{Cache, CompleteState, Watched};
use super::cluster_policy::{
    after_not_found, classify_list_error, discover, ClusterNetworkPolicy, ClusterNetworkPolicyV1beta1,
    ClusterPolicyMode, ListFailure, NotFound, PLURAL, VERSIONS,
};
use super::pods::Pod;
use super::store::strip;

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
    /// The ClusterNetworkPolicies answered `404` and discovery did not
    /// confirm them absent (the reason).
    #[error("direct list of ClusterNetworkPolicies: {0}")]
    ClusterPoliciesUnknown(String),
    /// The whole direct read took longer than its bound.
    #[error("direct read did not finish within {0:?}")]
    TimedOut(Duration),
}

/// The bound on one whole direct read (all pages of the four lists).
/// Well below the watchdog's stall limit
/// ([`crate::telemetry::health::MAX_STALL`], 60 s): a read that hangs
/// fails like any other read error (the sync stays held and the reads back
/// off) instead of stalling the loop until `/healthz` fails.
pub const DIRECT_READ_TIMEOUT: Duration = Duration::from_secs(30);

async fn direct_list<K: Watched>(api: Api<K>, page_size: u32) -> Result<Vec<Arc<K>>, WatchError> {
    direct_list_of(api, page_size, K::NAME).await
}

/// All pages of the list of `api` (`resource` names it in errors).
async fn direct_list_of<K>(api: Api<K>, page_size: u32, resource: &'static str) -> Result<Vec<Arc<K>>, WatchError>
where
    K: kube::Resource<DynamicType = ()> + Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut out = Vec::new();
    let mut lp = kube::api::ListParams::default().limit(page_size);
    loop {
        let list = api
            .list(&lp)
            .await
            .map_err(|source| WatchError::DirectList { resource, source })?;
        out.extend(list.items.into_iter().map(|o| Arc::new(strip(o))));
        match list.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(c) => lp = lp.continue_token(&c),
            None => return Ok(out),
        }
    }
}

/// [`direct_read_with`] in the default mode, `auto`.
pub async fn direct_read(client: &Client, page_size: u32) -> Result<CompleteState, WatchError> {
    direct_read_with(client, page_size, ClusterPolicyMode::Auto).await
}

/// The ClusterNetworkPolicies of a direct read under `mode`: at
/// `v1alpha2`, and a `404` is decided by discovery as the watcher decides it
/// ([`after_not_found`]): another version served is read instead, a
/// confirmed absence in `auto` is the empty list, anything else fails the
/// read ([`WatchError::ClusterPoliciesUnknown`]).
async fn direct_cluster_policies(
    client: &Client,
    page_size: u32,
    mode: ClusterPolicyMode,
) -> Result<Vec<Arc<ClusterNetworkPolicy>>, WatchError> {
    if mode == ClusterPolicyMode::Off {
        return Ok(Vec::new());
    }
    let mut version = VERSIONS[0];
    // One switch at most: discovery named the version that 404s next.
    for _ in 0..VERSIONS.len() {
        let read = if version == VERSIONS[1] {
            let api = Api::<ClusterNetworkPolicyV1beta1>::all(client.clone());
            direct_list_of(api, page_size, PLURAL)
                .await
                .map(|l| l.into_iter().map(|o| Arc::new(o.0.clone())).collect())
        } else {
            direct_list(Api::<ClusterNetworkPolicy>::all(client.clone()), page_size).await
        };
        match read {
            Err(WatchError::DirectList { source, .. }) if classify_list_error(&source) == ListFailure::NotFound => {
                match after_not_found(mode, version, discover(client).await) {
                    NotFound::Switch(next) => version = next,
                    NotFound::Absent(_) => return Ok(Vec::new()),
                    NotFound::Unknown(problem) => return Err(WatchError::ClusterPoliciesUnknown(problem)),
                }
            }
            other => return other,
        }
    }
    Err(WatchError::ClusterPoliciesUnknown(format!(
        "every ClusterNetworkPolicy version discovery named answered 404 ({})",
        VERSIONS.join(", ")
    )))
}

/// A fresh, complete read of all four resources straight from the API
/// server (not the cache): the confirmation the mass-deletion guard needs.
/// A list that fails mid-way (e.g. `410` on a continue token) is an error,
/// never a partial result. ClusterNetworkPolicies are read as `mode` says
/// (see the module doc).
/// It is bounded by [`DIRECT_READ_TIMEOUT`].
pub async fn direct_read_with(
    client: &Client,
    page_size: u32,
    mode: ClusterPolicyMode,
) -> Result<CompleteState, WatchError> {
    read_all(client, page_size, mode, true).await
}

/// The direct read that confirms `cache`: ClusterNetworkPolicies in its
/// mode, Nodes only when it watches them (else none, as in the cache).
pub async fn direct_read_for(cache: &Cache, client: &Client, page_size: u32) -> Result<CompleteState, WatchError> {
    read_all(client, page_size, cache.cluster_policy_mode(), cache.watches_nodes()).await
}

async fn read_all(
    client: &Client,
    page_size: u32,
    mode: ClusterPolicyMode,
    nodes: bool,
) -> Result<CompleteState, WatchError> {
    within(DIRECT_READ_TIMEOUT, async {
        Ok(CompleteState {
            namespaces: direct_list(Api::<Namespace>::all(client.clone()), page_size)
                .await?
                .into(),
            pods: direct_list(Api::<Pod>::all(client.clone()), page_size)
                .await?
                .into_iter()
                .map(|p| std::sync::Arc::new(super::pods::slim_pod((*p).clone())))
                .collect(),
            policies: direct_list(Api::<NetworkPolicy>::all(client.clone()), page_size)
                .await?
                .into(),
            cluster_policies: direct_cluster_policies(client, page_size, mode).await?.into(),
            nodes: match nodes {
                true => direct_list(Api::<Node>::all(client.clone()), page_size)
                    .await?
                    .into_iter()
                    .map(|n| std::sync::Arc::new(super::nodes::slim_node((*n).clone())))
                    .collect(),
                false => Default::default(),
            },
        })
    })
    .await
}

/// `read`, or [`WatchError::TimedOut`] when it takes longer than `limit`.
async fn within<T>(limit: Duration, read: impl Future<Output = Result<T, WatchError>>) -> Result<T, WatchError> {
    tokio::time::timeout(limit, read)
        .await
        .unwrap_or(Err(WatchError::TimedOut(limit)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_hanging_read_times_out_as_an_error() {
        let hung = within(
            Duration::from_millis(20),
            std::future::pending::<Result<(), WatchError>>(),
        )
        .await;
        assert!(matches!(hung, Err(WatchError::TimedOut(_))), "{hung:?}");
        assert!(within(Duration::from_secs(5), async { Ok(1) }).await.is_ok());
    }
}
