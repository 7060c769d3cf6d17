//! The API server side of the agent: watching pods (all namespaces),
//! namespaces, NetworkPolicies, ClusterNetworkPolicies and Nodes, each into
//! a [`ListStore`] that only trusts complete lists, and the direct
//! (uncached) read of all five.
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
//! - [`Cache::complete`] returns nothing until all five resources have
//!   completed a full list, so the agent programs and deletes nothing before.
//!
//! kube's reflector store is not used on purpose: we need the "keep the last
//! complete state during a relist" behaviour and per-resource list tracking
//! in one place. The watcher itself is kube-rs' (`kube::runtime::watcher`,
//! paginated with `page_size`, with its default backoff).
//!
//! - [`objects`]: [`Objects`], the objects of one kind by key as a
//!   persistent map (a copy is a pointer; a diff of two copies visits only
//!   what they do not share);
//! - [`store`]: one kind's [`ListStore`] (complete state, relist buffer);
//! - [`cache`]: the five stores as one [`Cache`] and its [`CompleteState`];
//! - [`cluster_policy`]: the ClusterNetworkPolicy resource type and
//!   [`ClusterPolicyMode`] (what a `404` or `403` on its list means);
//! - [`nodes`]: the slim Node projection (a heartbeat is no change);
//! - [`pods`]: the slim Pod type (only what the compiler reads; a
//!   condition update is no change);
//! - [`watcher`]: the kube-rs watchers feeding the cache;
//! - [`direct_read`](mod@direct_read): a fresh paginated LIST of all five (the
//!   mass-deletion guard's confirmation);
//! - [`fault_injection`]: the test-only switch that drops watch deletes
//!   (proves the chaos oracle can fail);
//! - [`taint`]: removing the `npm.io/agent-not-ready` taint from this
//!   agent's Node after the first full sync.

pub mod cache;
pub mod cluster_policy;
pub mod direct_read;
pub mod fault_injection;
pub mod nodes;
pub mod objects;
pub mod pod_conditions;
pub mod pods;
pub mod store;
pub mod taint;
pub mod watcher;

pub use cache::{classify_pod_change, Cache, CompleteState, Watched};
pub use cluster_policy::{ClusterNetworkPolicy, ClusterPolicyMode};
pub use direct_read::{direct_read, direct_read_for, direct_read_with, WatchError};
pub use objects::Objects;
pub use store::{key_of, strip, ListStore, ObjKey, Projection, StoreUpdate};
pub use watcher::{spawn_watchers, watch, watch_cluster_policies};

#[cfg(test)]
mod tests;
