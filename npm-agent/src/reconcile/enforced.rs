//! Where the pod condition `npm.io/PolicyEnforced` is decided:
//! after each sync attempt, the reason of every local pod of the state last
//! compiled ([`decide`]), handed to the writer
//! (`crate::k8s::pod_conditions`), which turns reasons into conditions and
//! writes only their transitions.
//!
//! The local pods are the compiled state's endpoints (pods of this node
//! with an address, not host-network). A pod is [`Reason::Enforced`] only
//! when the last sync went through whole (no error, no held removal, no
//! reduced state) and its endpoint is in what that sync programmed, with
//! its interface: `sync_full`/`apply` returned, so its endpoint record and
//! its subject's entries are in the kernel maps (eBPF) or the loaded table
//! (nftables). Otherwise, in this order:
//! - the sync failed or could not run ([`Reason::AgentNotSynced`]) or is
//!   held ([`Reason::RemovalHeld`]): every local pod, as what is programmed
//!   is not known to be the compiled state (a held sync keeps objects the
//!   cluster may have removed, peers and policies alike);
//! - its endpoint has no interface yet ([`Reason::NoInterface`]);
//! - a map is full ([`Reason::MapFull`]): every local pod, as an address
//!   left unknown changes the verdicts of every pod that names it;
//! - a NetworkPolicy or ClusterNetworkPolicy selecting it is not fully
//!   understood ([`Reason::PolicyInvalid`]).
//!
//! What this covers is this node: the remote peers' addresses reaching the
//! other nodes' kernels is their agents' figure.

use npm_policy::compiled::Compiled;
use npm_policy::model::{Pod, Snapshot};
use npm_policy::tiers::evaluate::selects;

use super::dataplane::AgentDataplane;
use super::syncer::{SyncError, SyncOutcome, Syncer};
use crate::k8s::pod_conditions::{Desired, PodState, Reason};

/// Whether a policy of `snapshot` that is not fully understood selects
/// `pod`.
fn selected_by_invalid(snapshot: &Snapshot, pod: &Pod) -> bool {
    snapshot.invalid_policies.iter().any(|i| {
        snapshot
            .policies
            .get(&(i.namespace.clone(), i.name.clone()))
            .is_some_and(|p| npm_policy::compile::policy_selects(p, pod))
    }) || snapshot.invalid_cluster_policies.iter().any(|i| {
        snapshot
            .cluster_policies
            .get(&i.name)
            .is_some_and(|cp| selects(snapshot, cp, pod))
    })
}

/// The reason of every local pod of `compiled` (the state last compiled,
/// whose snapshot is `snapshot`) after a sync attempt with `result`, where
/// `programmed` is what is programmed now (see the module doc).
pub fn decide(
    compiled: &Compiled,
    snapshot: &Snapshot,
    programmed: Option<&(Compiled, npm_dataplane::Interfaces)>,
    result: &Result<SyncOutcome, SyncError>,
) -> Desired {
    let all = match result {
        Ok(o) if o.not_listed => Some(Reason::AgentNotSynced),
        Ok(_) => None,
        Err(SyncError::DirectRead { .. } | SyncError::DirectReadDeferred { .. } | SyncError::NoDirectReader { .. }) => {
            Some(Reason::RemovalHeld)
        }
        Err(
            SyncError::Dataplane { .. } | SyncError::NodeAddressesUnknown { .. } | SyncError::NumbersExhausted { .. },
        ) => Some(Reason::AgentNotSynced),
    };
    let map_full = matches!(result, Ok(o) if !o.map_full.is_empty());
    let mut desired = Desired::new();
    for (id, ep) in &compiled.endpoints {
        let in_kernel = programmed.is_some_and(|(prog, interfaces)| {
            interfaces.contains_key(id) && prog.endpoints.get(id).is_some_and(|p| p.pod.uid == ep.pod.uid)
        });
        let reason = if let Some(r) = all {
            r
        } else if !in_kernel {
            Reason::NoInterface
        } else if map_full {
            Reason::MapFull
        } else if snapshot
            .pods
            .get(&(ep.pod.namespace.clone(), ep.pod.name.clone()))
            .is_some_and(|p| selected_by_invalid(snapshot, p))
        {
            Reason::PolicyInvalid
        } else {
            Reason::Enforced
        };
        desired.insert(
            ep.pod.uid.clone(),
            PodState {
                namespace: ep.pod.namespace.clone(),
                name: ep.pod.name.clone(),
                reason,
            },
        );
    }
    desired
}

impl<D: AgentDataplane> Syncer<D> {
    /// Hand the writer the local pods' reasons after a sync attempt with
    /// `result` (nothing without a writer).
    pub(super) fn publish_pod_conditions(&self, result: &Result<SyncOutcome, SyncError>) {
        let Some(writer) = &self.pod_conditions else { return };
        writer.publish(decide(
            self.incremental.compiled(),
            self.incremental.snapshot(),
            self.programmed.as_ref(),
            result,
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_dataplane::ebpf::Shortfall;

    use crate::reconcile::tests::two_endpoints as compiled;

    fn reasons(d: &Desired) -> Vec<(&str, Reason)> {
        d.iter().map(|(u, s)| (u.as_str(), s.reason)).collect()
    }

    #[test]
    fn enforced_only_when_programmed_with_an_interface_and_the_sync_whole() {
        let c = compiled();
        let snap = Snapshot::default();
        let mut prog = c.clone();
        prog.endpoints.remove(&2);
        let programmed = (prog, [(1, 10)].into_iter().collect());
        let ok = Ok(SyncOutcome::default());
        let d = decide(&c, &snap, Some(&programmed), &ok);
        assert_eq!(reasons(&d), [("u1", Reason::Enforced), ("u2", Reason::NoInterface)]);
        let d = decide(&c, &snap, None, &ok);
        assert_eq!(reasons(&d), [("u1", Reason::NoInterface), ("u2", Reason::NoInterface)]);
        let full = Ok(SyncOutcome {
            map_full: vec![Shortfall {
                map: "NPM_POLICY",
                needed: 2,
                capacity: 1,
                programmed: 1,
                degraded: 1,
                unit: "subject directions",
            }],
            ..SyncOutcome::default()
        });
        let d = decide(&c, &snap, Some(&programmed), &full);
        assert_eq!(reasons(&d), [("u1", Reason::MapFull), ("u2", Reason::NoInterface)]);
        let held = Err(SyncError::NoDirectReader { what: "x".into() });
        let d = decide(&c, &snap, Some(&programmed), &held);
        assert_eq!(reasons(&d), [("u1", Reason::RemovalHeld), ("u2", Reason::RemovalHeld)]);
        let failed = Err(SyncError::NodeAddressesUnknown { problem: "x".into() });
        let d = decide(&c, &snap, Some(&programmed), &failed);
        assert_eq!(
            reasons(&d),
            [("u1", Reason::AgentNotSynced), ("u2", Reason::AgentNotSynced)]
        );
    }
}
