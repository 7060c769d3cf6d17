//! The direct read: a fresh, complete, paginated LIST of the three
//! resources straight from the API server (not the cache), which the
//! mass-deletion guard needs to confirm a large removal.

use std::sync::Arc;

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::{Api, Client};

use super::cache::{CompleteState, Watched};
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
