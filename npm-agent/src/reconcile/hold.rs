//! What a held sync programs: the mass-deletion guard holds
//! the *removals*, not the sync. While a removal is held (its direct read
//! waits out its backoff, failed, or no client can make one), the state
//! programmed is the complete current state plus the objects of the state
//! last programmed that it no longer has ([`held_state`]): additions and
//! label changes are programmed at once, and the held old objects stay.
//! The held pods are marked as terminating, so the one ownership rule
//! (`npm_policy::ownership`: a live pod beats a terminating one) moves an
//! address that a new live pod claims to that pod at once: incident 1
//! cannot come back through a held sync. A held pod whose address nobody
//! else claims keeps it, its identity and its endpoint.

use std::sync::Arc;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::Resource;

use crate::k8s::{CompleteState, Objects};

/// The objects of `last` whose (namespace, name) `next` does not have.
fn missing<K: Resource>(last: &Objects<K>, next: &Objects<K>) -> Vec<Arc<K>> {
    last.entries()
        .filter(|(k, _)| !next.contains_key(k))
        .map(|(_, o)| o.clone())
        .collect()
}

/// `next` plus the namespaces, pods, NetworkPolicies,
/// ClusterNetworkPolicies and Nodes of `last` (the
/// state last programmed) that `next` no longer has; each held pod carries
/// a deletion timestamp (keeping one it had), so that any live pod of
/// `next` claiming its address owns it.
pub fn held_state(last: &CompleteState, next: &CompleteState) -> CompleteState {
    let mut out = next.clone();
    out.namespaces.extend(missing(&last.namespaces, &next.namespaces));
    out.policies.extend(missing(&last.policies, &next.policies));
    out.cluster_policies
        .extend(missing(&last.cluster_policies, &next.cluster_policies));
    out.nodes.extend(missing(&last.nodes, &next.nodes));
    let now = Time(k8s_openapi::jiff::Timestamp::now());
    for p in missing(&last.pods, &next.pods) {
        if p.metadata.deletion_timestamp.is_some() {
            out.pods.insert(p);
            continue;
        }
        let mut held = (*p).clone();
        held.metadata.deletion_timestamp = Some(now.clone());
        out.pods.insert(Arc::new(held));
    }
    out
}

/// How many objects `held_state(last, next)` holds beyond `next`.
pub fn held_objects(last: &CompleteState, next: &CompleteState) -> usize {
    missing(&last.namespaces, &next.namespaces).len()
        + missing(&last.policies, &next.policies).len()
        + missing(&last.cluster_policies, &next.cluster_policies).len()
        + missing(&last.pods, &next.pods).len()
        + missing(&last.nodes, &next.nodes).len()
}
