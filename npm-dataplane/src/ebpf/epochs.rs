//! `NPM_EP_EPOCH`: each local endpoint's decision epoch (connection
//! semantics). Under `enforce` the writer moves the epoch of
//! every `enforce` endpoint whose decisions the batch may have changed,
//! once the batch is written ([`decisions_touched`]); the datapath then
//! decides each of that endpoint's tracked flows again on its next packet
//! (`npm-ebpf/src/conntrack.rs`), once. An endpoint that enters `enforce`
//! (an annotation or flag change, nothing else) has its epoch moved by the
//! next batch, even an empty one ([`Epochs::newly_enforced`]): its flows,
//! kept until then, are judged by the policy in force. Under `keep` no epoch moves, and
//! the tracked path is as before: one inlined array read per packet.

use std::collections::BTreeSet;

use aya::maps::{Array, MapData};
use aya::Ebpf;
use npm_common::{ep_epoch_slot, maps};
use npm_policy::compiled::{Compiled, CompiledDiff};

use super::errors::{map_err, EbpfError};
use super::loader::take_map;

/// The pinned `NPM_EP_EPOCH` array and the endpoints whose established
/// connections follow policy changes.
pub(crate) struct Epochs {
    map: Array<MapData, u32>,
    /// Endpoint ids under `enforce` ([`crate::Dataplane::set_established_enforce`]).
    pub(crate) enforce: BTreeSet<u32>,
    /// The `enforce` set of the last batch that moved the epochs: an
    /// endpoint of `enforce` not in it entered `enforce` since.
    judged: BTreeSet<u32>,
}

impl Epochs {
    /// Takes `NPM_EP_EPOCH` out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(Epochs {
            map: take_map(bpf, maps::EP_EPOCH)?,
            enforce: BTreeSet::new(),
            judged: BTreeSet::new(),
        })
    }

    /// Sets the `enforce` set; an endpoint that leaves it is no longer
    /// judged (its flows are kept from then on: coming back, it is judged
    /// again).
    pub(crate) fn set_enforce(&mut self, endpoints: BTreeSet<u32>) {
        self.judged.retain(|id| endpoints.contains(id));
        self.enforce = endpoints;
    }

    /// The endpoints that entered `enforce` since the last batch that
    /// moved the epochs ([`Epochs::judged_all`]): their tracked flows were
    /// kept so far, so the next batch has them decided again, whatever it
    /// changes.
    pub(crate) fn newly_enforced(&self) -> BTreeSet<u32> {
        self.enforce.difference(&self.judged).copied().collect()
    }

    /// Records that a batch moved the epochs of every endpoint that
    /// needed it under the current `enforce` set.
    pub(crate) fn judged_all(&mut self) {
        self.judged = self.enforce.clone();
    }

    /// Moves the epoch of the endpoints on `ifindexes` (each slot once).
    /// Returns how many slots moved.
    pub(crate) fn advance(&mut self, ifindexes: impl IntoIterator<Item = u32>) -> Result<usize, EbpfError> {
        let slots: BTreeSet<u32> = ifindexes.into_iter().map(ep_epoch_slot).collect();
        for &slot in &slots {
            let cur = self
                .map
                .get(&slot, 0)
                .map_err(map_err(maps::EP_EPOCH, format!("read slot {slot}")))?;
            self.map
                .set(slot, cur.wrapping_add(1), 0)
                .map_err(map_err(maps::EP_EPOCH, format!("write slot {slot}")))?;
        }
        Ok(slots.len())
    }

    /// The epoch of the endpoint on `ifindex` (tests, `inspect`).
    pub(crate) fn get(&self, ifindex: u32) -> Result<u32, EbpfError> {
        let slot = ep_epoch_slot(ifindex);
        self.map
            .get(&slot, 0)
            .map_err(map_err(maps::EP_EPOCH, format!("read slot {slot}")))
    }
}

/// The endpoints of `next` in `enforce` whose decisions `diff` may have
/// changed: a policy or tier entry of their subject, their own record
/// (isolation, subject, tier or report flags), or, for an endpoint that
/// is isolated or tiered in some direction, any ipcache or CIDR change (a
/// peer's identity decides; an endpoint neither isolated nor tiered allows
/// every peer). Conservative: an endpoint listed whose decisions did not
/// change only has its flows decided again once, to the same verdict.
pub(crate) fn decisions_touched(diff: &CompiledDiff, next: &Compiled, enforce: &BTreeSet<u32>) -> BTreeSet<u32> {
    if enforce.is_empty() || diff.is_empty() {
        return BTreeSet::new();
    }
    let peers_moved = !diff.ipcache.is_empty() || !diff.cidrs.is_empty();
    let subjects: BTreeSet<u32> = diff
        .policy
        .upsert
        .iter()
        .map(|(e, _)| e.subject)
        .chain(diff.policy.remove.iter().map(|e| e.subject))
        .chain(diff.tiers.upsert.iter().map(|(e, _)| e.subject))
        .chain(diff.tiers.remove.iter().map(|e| e.subject))
        .collect();
    let records: BTreeSet<u32> = diff.endpoints.upsert.iter().map(|(id, _)| *id).collect();
    next.endpoints
        .iter()
        .filter(|(id, _)| enforce.contains(id))
        .filter(|(id, ep)| {
            let t = &ep.tiers;
            let decides = ep.isolated_ingress
                || ep.isolated_egress
                || t.admin_ingress
                || t.admin_egress
                || t.baseline_ingress
                || t.baseline_egress;
            subjects.contains(&ep.identity) || records.contains(id) || (peers_moved && decides)
        })
        .map(|(id, _)| *id)
        .collect()
}
