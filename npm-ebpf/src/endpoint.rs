//! Step 2's maps: the local endpoints by host-side ifindex, `NPM_EP_SLOTS`
//! (an array, inlined by the verifier) for the usual small ifindex and the
//! hash `NPM_ENDPOINTS` beyond it; and each endpoint's decision epoch,
//! `NPM_EP_EPOCH` (an array by the same ifindex, modulo its size).

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap},
};
use npm_common::{ep_epoch_slot, sizes, EndpointInfo, EP_PRESENT};

/// `NPM_EP_SLOTS`: ifindex -> endpoint, for an ifindex below
/// `sizes::ENDPOINT_SLOTS` (a slot without `EP_PRESENT` is no endpoint).
#[map]
static NPM_EP_SLOTS: Array<EndpointInfo> = Array::with_max_entries(sizes::ENDPOINT_SLOTS, 0);
/// `NPM_ENDPOINTS`: ifindex -> endpoint, for the larger ifindexes.
#[map]
pub(crate) static NPM_ENDPOINTS: HashMap<u32, EndpointInfo> = HashMap::with_max_entries(sizes::ENDPOINTS, 0);

/// Step 2 for an ifindex below `sizes::ENDPOINT_SLOTS`: the endpoint in its
/// `NPM_EP_SLOTS` slot (an inlined array lookup), if the slot holds one.
#[inline(always)]
pub(crate) fn endpoint_slot(ifindex: u32) -> Option<&'static EndpointInfo> {
    match NPM_EP_SLOTS.get(ifindex) {
        Some(ep) if ep.flags & EP_PRESENT != 0 => Some(ep),
        _ => None,
    }
}

/// `NPM_EP_EPOCH`: ifindex (modulo the size, `npm_common::ep_epoch_slot`)
/// -> the endpoint's decision epoch, which the loader moves after a sync
/// that changed what the endpoint's policy decides (connection semantics
/// `enforce`; see `npm_common::CtValue::epoch`). An inlined array lookup.
#[map]
static NPM_EP_EPOCH: Array<u32> = Array::with_max_entries(sizes::ENDPOINT_SLOTS, 0);

/// The current decision epoch of the endpoint on `ifindex` (0 if never
/// moved). Read before any policy lookup whose decision a conntrack entry
/// records, so an entry never carries an epoch newer than its decision.
#[inline(always)]
pub(crate) fn endpoint_epoch(ifindex: u32) -> u32 {
    match NPM_EP_EPOCH.get(ep_epoch_slot(ifindex)) {
        // SAFETY: a 4-byte array value, read once (a racing write by the
        // loader gives the old or the new epoch, either is consistent).
        Some(e) => unsafe { core::ptr::read_volatile(e) },
        None => 0,
    }
}
