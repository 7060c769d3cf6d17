//! Shared state of a running server: the store behind its lock, request counters
//! ([`Stats`]), open-watch accounting and the signal that drops every watch.

use super::FaultRule;
use crate::store::Store;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// Request counters, as reported by `GET /admin/stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// All API requests (admin requests excluded).
    pub requests: u64,
    /// Requests by verb.
    pub by_verb: BTreeMap<String, u64>,
    /// Write requests (create, update, patch, delete, deletecollection) by
    /// resource: the plural, with `/<subresource>` when there is one
    /// (`pods/status`), namespaced or not.
    pub writes: BTreeMap<String, u64>,
    /// Requests answered with an injected failure.
    pub injected_failures: u64,
    /// Requests delayed by an injected delay.
    pub injected_delays: u64,
    /// Watches currently open.
    pub open_watches: u64,
    /// Watches opened since start.
    pub watches_started: u64,
    /// The store's current resourceVersion.
    pub resource_version: u64,
    /// The store's compaction revision.
    pub compacted_revision: u64,
}

/// Shared state of a running server.
#[derive(Debug)]
pub struct AppState {
    /// The object store.
    pub store: Mutex<Store>,
    /// Pending fault rules.
    pub faults: Mutex<Vec<FaultRule>>,
    /// Request counters (`open_watches` and the store revisions are filled in by [`AppState::stats`]).
    pub(super) counters: Mutex<Stats>,
    /// Watches currently open.
    pub(super) open_watches: AtomicU64,
    /// Bumped to end every open watch.
    pub(super) drop_watches: tokio::sync::watch::Sender<u64>,
    /// Interval of BOOKMARK events for watches that allow them.
    pub bookmark_interval: Duration,
    /// Address the server listens on.
    pub addr: SocketAddr,
    /// Tokens and RBAC objects (what `TokenReview` and `SubjectAccessReview` answer).
    pub auth: Mutex<crate::auth::Auth>,
}

impl AppState {
    /// New state around a store.
    pub fn new(store: Store, bookmark_interval: Duration, addr: SocketAddr) -> Self {
        let (drop_watches, _) = tokio::sync::watch::channel(0);
        Self {
            store: Mutex::new(store),
            faults: Mutex::new(Vec::new()),
            counters: Mutex::new(Stats::default()),
            open_watches: AtomicU64::new(0),
            drop_watches,
            bookmark_interval,
            addr,
            auth: Mutex::new(crate::auth::Auth::default()),
        }
    }

    /// Lock the store (a poisoned lock is recovered: the store has no invariants spanning
    /// a panic point).
    pub fn store(&self) -> MutexGuard<'_, Store> {
        lock(&self.store)
    }

    /// Lock the tokens and RBAC objects.
    pub fn auth(&self) -> MutexGuard<'_, crate::auth::Auth> {
        lock(&self.auth)
    }

    /// Lock the request counters.
    pub(super) fn counters(&self) -> MutexGuard<'_, Stats> {
        lock(&self.counters)
    }

    /// End every open watch stream (clients see the stream close and re-watch).
    pub fn drop_watches(&self) {
        self.drop_watches.send_modify(|g| *g += 1);
    }

    /// Serve ClusterNetworkPolicies at exactly the versions `served` (see
    /// [`Store::set_cnp_served_versions`]) and end every open watch, as a real server's
    /// handler change ends the watches of a version it stops serving (a client's re-watch
    /// or relist at that version then gets 404). Not found without the CRD.
    pub fn set_cnp_served_versions(&self, served: &[&str]) -> Result<(), crate::ApiError> {
        self.store().set_cnp_served_versions(served)?;
        self.drop_watches();
        Ok(())
    }

    /// Current counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.counters().clone();
        s.open_watches = self.open_watches.load(Ordering::SeqCst);
        let st = self.store();
        s.resource_version = st.rev();
        s.compacted_revision = st.compacted();
        s
    }
}

/// Lock a mutex of the state, recovering a poisoned lock (no state spans a panic point).
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
