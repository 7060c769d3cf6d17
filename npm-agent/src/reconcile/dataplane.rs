//! The dataplane as the sync loop drives it: the [`Dataplane`] trait plus
//! what only some dataplanes can tell (deny events, the state adopted from
//! a previous agent), and the boxed form `--dataplane` opens.

use npm_common::DenyEvent;
use npm_dataplane::ebpf::{Fitted, MapFill};
use npm_dataplane::{AdoptedEndpoint, Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::adopt::AdoptedNumbers;
use npm_policy::compiled::{Compiled, CompiledDiff};

/// A dataplane as the agent drives it: the [`Dataplane`] trait plus the
/// optional deny-event source (the eBPF ring buffer).
pub trait AgentDataplane: Dataplane + Send {
    /// Drain the deny events the datapath reported since the last call.
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        Vec::new()
    }
    /// The (pod identities, endpoints) the dataplane found programmed when
    /// it was opened (state a previous agent left: pinned maps), if it can
    /// tell. A restarted agent's first sync is guarded against them, as if
    /// it had programmed them itself (see the [`reconcile`](crate::reconcile) module doc).
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        None
    }
    /// The endpoint records the dataplane found programmed when it was
    /// opened (a previous agent's). A restarted agent gives a pod the id of
    /// the record on its interface when the addresses match too, and
    /// numbers every other endpoint above all adopted ids (see the module
    /// doc).
    fn adopted_endpoints(&self) -> Vec<AdoptedEndpoint> {
        Vec::new()
    }
    /// The tiered endpoint directions (per endpoint, each direction and
    /// ClusterNetworkPolicy tier with entries: `guard::tiered_directions`)
    /// the dataplane found programmed when it was opened (a previous
    /// agent's), if it can tell. A restarted agent's first sync is guarded
    /// against them, so a first list without the CNPs does not remove
    /// every adopted Deny unheld.
    fn adopted_tier_directions(&self) -> Option<usize> {
        None
    }
    /// The pod identity, CIDR identity and rule numbers the dataplane found
    /// programmed when it was opened (a previous agent's). A restarted
    /// agent keeps each number's meaning: an identity stays with exactly
    /// the addresses that carried it, a CIDR identity with its prefix, and
    /// every other number is handed out above all adopted ones
    /// (`npm_policy::adopt`).
    fn adopted_numbers(&self) -> AdoptedNumbers {
        AdoptedNumbers::default()
    }
    /// The kernel maps' fill against their capacity, where the dataplane
    /// has kernel maps (eBPF); empty otherwise.
    fn map_fill(&self) -> Vec<MapFill> {
        Vec::new()
    }
    /// Deny events the datapath could not queue because the ring buffer was
    /// full (eBPF), if the dataplane can tell.
    fn events_lost(&self) -> Option<u64> {
        None
    }
    /// Whether the datapath runs without its precomputed layers because the
    /// kernel's verifier refused the full programs (eBPF), if it can tell.
    fn reduced_datapath(&self) -> Option<bool> {
        None
    }
    /// The attach mode the datapath's programs run in (eBPF: `tcx` or
    /// `tc`, what `--attach auto` chose), if the dataplane has one.
    fn attach_mode(&self) -> Option<&'static str> {
        None
    }
    /// Degraded mode: `None` when `target` fits the dataplane's maps (when
    /// `diff`, the change from `programmed`, is given, a cheap bound on it
    /// may decide), else the largest fail-closed part of `target` that
    /// fits, with the maps it did not fit (eBPF:
    /// `npm_dataplane::ebpf::EbpfDataplane::fit`). Dataplanes without size
    /// limits always fit.
    fn fit(
        &self,
        _programmed: Option<&Compiled>,
        _diff: Option<&CompiledDiff>,
        _target: &Compiled,
    ) -> Result<Option<Fitted>, DataplaneError> {
        Ok(None)
    }
}

impl Dataplane for Box<dyn AgentDataplane> {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        (**self).sync_full(compiled, interfaces)
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        (**self).apply(diff, next, interfaces)
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        (**self).counters()
    }
    fn set_established_enforce(&mut self, endpoints: std::collections::BTreeSet<u32>) {
        (**self).set_established_enforce(endpoints)
    }
}

impl AgentDataplane for Box<dyn AgentDataplane> {
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        (**self).poll_deny_events()
    }
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        (**self).adopted_counts()
    }
    fn adopted_endpoints(&self) -> Vec<AdoptedEndpoint> {
        (**self).adopted_endpoints()
    }
    fn adopted_tier_directions(&self) -> Option<usize> {
        (**self).adopted_tier_directions()
    }
    fn adopted_numbers(&self) -> AdoptedNumbers {
        (**self).adopted_numbers()
    }
    fn map_fill(&self) -> Vec<MapFill> {
        (**self).map_fill()
    }
    fn events_lost(&self) -> Option<u64> {
        (**self).events_lost()
    }
    fn reduced_datapath(&self) -> Option<bool> {
        (**self).reduced_datapath()
    }
    fn attach_mode(&self) -> Option<&'static str> {
        (**self).attach_mode()
    }
    fn fit(
        &self,
        programmed: Option<&Compiled>,
        diff: Option<&CompiledDiff>,
        target: &Compiled,
    ) -> Result<Option<Fitted>, DataplaneError> {
        (**self).fit(programmed, diff, target)
    }
}
