//! Step 2's maps: the local endpoints by host-side ifindex, `NPM_EP_SLOTS`
//! (an array, inlined by the verifier) for the usual small ifindex and the
//! hash `NPM_ENDPOINTS` beyond it.

use aya_ebpf::{
    macros::map,
    maps::{Array, HashMap},
};
use npm_common::{sizes, EndpointInfo, EP_PRESENT};

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
