//! The agent's calls into the compiler (`npm-policy`): API objects ->
//! [`Snapshot`], [`Snapshot`] -> [`Compiled`], and the [`Incremental`]
//! compiler that the sync loop keeps between syncs.
//!
//! Objects are converted one by one so that a pod or namespace the converter
//! rejects (a malformed IP, say) is logged and skipped instead of stopping
//! enforcement of everything else; invalid policies are kept by the
//! converter in `Snapshot::invalid_policies` (ClusterNetworkPolicies in
//! `Snapshot::invalid_cluster_policies`, see [`cluster`]). Nodes are
//! converted by `npm_policy::convert::node_from_api` (a Node with an
//! address that does not parse is logged and left out: its addresses are
//! world, as before Nodes were watched).
//!
//! [`Incremental`] stays level-triggered: each update compares the complete
//! state it is given with the complete state of the previous update (object
//! by object, by pointer, resourceVersion and uid) and feeds only the
//! objects that were added, changed or removed to a long-lived
//! [`npm_policy::incremental::Compiler`]. Event order never matters: two
//! complete states are diffed, whatever happened between them.
//!
//! - [`cluster`]: ClusterNetworkPolicies into the snapshot (decoded and
//!   converted one by one; an undecodable one keeps its last decoded
//!   version, and is reported);
//! - [`objects`]: the ordered walk that diffs two complete states;
//! - [`overlay`]: this node's CNI facts on the converted pods (and which
//!   pods a change of the facts touches);
//! - [`incremental`]: the [`Incremental`] compile state itself.

pub mod cluster;
pub mod incremental;
pub mod objects;
pub mod overlay;

pub use incremental::Incremental;

use npm_policy::compiled::{CompileOptions, Compiled};
use npm_policy::convert::{namespace_from_api, node_from_api};
use npm_policy::model::Snapshot;

use crate::cni::NodeFacts;
use crate::k8s::CompleteState;
pub use cluster::LastValid;
use cluster::Unparsed;
use overlay::Stripped;

/// Build the snapshot of a complete state with this node's CNI `facts`
/// overlaid on its pods. Objects that cannot be converted are logged
/// (naming the object and the field) and left out.
/// ClusterNetworkPolicies start from their `last` valid versions.
pub fn snapshot(state: &CompleteState, facts: &NodeFacts, last: &LastValid) -> Snapshot {
    snapshot_with_overlay(state, facts, last).0
}

/// [`snapshot`], the pods the overlay took addresses from and the
/// ClusterNetworkPolicies that could not be decoded.
fn snapshot_with_overlay(state: &CompleteState, facts: &NodeFacts, last: &LastValid) -> (Snapshot, Stripped, Unparsed) {
    let mut s = Snapshot::default();
    let mut stripped = Stripped::default();
    let mut unparsed = Unparsed::new();
    for ns in &state.namespaces {
        match namespace_from_api(ns) {
            Ok(n) => s.upsert_namespace(n),
            Err(e) => tracing::error!(error = %e, "namespace skipped"),
        }
    }
    // The pods come in key order: collected at once, the map is built
    // with full nodes (inserted one by one in order, each node would keep
    // about half of its room empty: about 170 bytes per pod).
    let mut pods = Vec::with_capacity(state.pods.len());
    for p in &state.pods {
        match overlay::convert_pod(p, facts) {
            Ok((p, ips)) => {
                if !ips.is_empty() {
                    stripped.set(&(p.namespace.clone(), p.name.clone()), ips);
                }
                pods.push(((p.namespace.clone(), p.name.clone()), p));
            }
            Err(e) => tracing::error!(error = %e, "pod skipped"),
        }
    }
    s.pods = pods.into_iter().collect();
    for np in &state.policies {
        // Invalid policies are recorded in `s.invalid_policies`; the sync
        // loop logs and counts them.
        let _ = s.upsert_policy(np);
    }
    for cnp in &state.cluster_policies {
        cluster::upsert(&mut s, &mut unparsed, cnp, last);
    }
    for n in &state.nodes {
        match node_from_api(n) {
            Ok(n) => s.upsert_node(n),
            Err(e) => tracing::error!(error = %e, "node skipped"),
        }
    }
    (s, stripped, unparsed)
}

/// Compile a snapshot, reusing the previous compile's ids.
pub fn compile(snapshot: &Snapshot, opts: &CompileOptions, prev: Option<&Compiled>) -> Compiled {
    npm_policy::compile(snapshot, opts, prev)
}

/// How many objects an [`Incremental::update`] fed to the compiler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Namespaces added, changed or removed.
    pub namespaces: usize,
    /// Pods added, changed or removed.
    pub pods: usize,
    /// NetworkPolicies added, changed or removed.
    pub policies: usize,
    /// ClusterNetworkPolicies added, changed or removed.
    pub cluster_policies: usize,
    /// Nodes added, changed or removed.
    pub nodes: usize,
}

impl Changes {
    /// Total number of objects fed to the compiler.
    pub fn total(&self) -> usize {
        self.namespaces + self.pods + self.policies + self.cluster_policies + self.nodes
    }
}

/// A difference between the incremental compile and a full compile of the
/// same snapshot (found by [`Incremental::cross_check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Number of map changes between the two.
    pub changes: usize,
}

#[cfg(test)]
pub(crate) mod tests;
