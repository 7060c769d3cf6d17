//! The per-CPU flow cache in front of `NPM_CT4` (`NPM_FLOWCACHE`, not
//! pinned): established IPv4 flows confirmed by a conntrack hit in the last
//! 250 ms skip the conntrack lookup (see [`flow_cache_hit`] for what that
//! may change).

use aya_ebpf::{macros::map, maps::PerCpuArray};
use core::mem::{offset_of, size_of};

use crate::mem::{wr32, wr64};

/// The per-CPU flow cache in front of `NPM_CT4`: a direct-mapped table of
/// recently confirmed established IPv4 flows, looked up by an inlined array
/// access instead of a hash-map call. Not pinned: a cache, rebuilt from the
/// conntrack map after every load. See [`flow_cache_hit`].
#[map]
pub(crate) static NPM_FLOWCACHE: PerCpuArray<FlowSlot> = PerCpuArray::with_max_entries(FLOW_SLOTS, 0);

/// Slots of [`NPM_FLOWCACHE`] per CPU (a power of two).
const FLOW_SLOTS: u32 = 4096;
/// How long a flow-cache slot vouches for its flow: after this, the next
/// packet of the flow takes the conntrack lookup again (which refreshes the
/// entry's idle timer and checks its timeout) and refills the slot.
const FLOW_TTL_NS: u64 = 250_000_000;

/// One [`NPM_FLOWCACHE`] slot: the `CtKey4` of an established flow (words,
/// see [`crate::conntrack::ct4_key`]), the decision epoch of its entry and
/// when the conntrack lookup last confirmed it.
#[repr(C)]
pub(crate) struct FlowSlot {
    key: [u32; 5],
    /// The endpoint's decision epoch the entry carried at the confirmation.
    epoch: u32,
    /// Coarse clock at the confirmation; 0: empty slot.
    confirmed_ns: u64,
}
// [`flow_cache_fill`] and [`flow_cache_forget`] write the slot as words.
const _: () = assert!(size_of::<FlowSlot>() == 32);
const _: () = assert!(offset_of!(FlowSlot, key) == 0);
const _: () = assert!(offset_of!(FlowSlot, epoch) == 20);
const _: () = assert!(offset_of!(FlowSlot, confirmed_ns) == 24);

/// Benchmark-only switch like [`crate::conntrack::NPM_BENCH_NO_CT_CREATE`]: when 1, the flow
/// cache is neither read nor filled, so tracked packets measure the
/// conntrack lookup.
#[no_mangle]
pub(crate) static NPM_BENCH_NO_FLOW_CACHE: u8 = 0;

/// The flow-cache slot of a `NPM_CT4` key: a multiplicative hash of its
/// words (the key is canonical, so both directions share the slot).
#[inline(always)]
pub(crate) fn flow_slot(w: &[u32; 5]) -> u32 {
    let a = (w[2] ^ w[4].rotate_left(16)).wrapping_mul(0x9e37_79b1);
    let b = (w[3] ^ w[0] ^ (w[1] << 24)).wrapping_mul(0x85eb_ca77);
    ((a ^ b) >> 16) & (FLOW_SLOTS - 1)
}

/// Step 6's fast path: the slot holds exactly this flow's key, was
/// confirmed by a conntrack hit less than [`FLOW_TTL_NS`] ago, under the
/// endpoint's current decision `epoch` (a moved epoch sends the packet to
/// the conntrack lookup, which decides the flow again: no slot vouches for
/// a flow past its endpoint's policy change).
///
/// What the cache may change: a flow whose conntrack entry disappears (LRU
/// eviction, or the loader's purge of a removed endpoint) keeps passing on
/// this CPU until the slot's confirmation is [`FLOW_TTL_NS`] old. Endpoint
/// ids are never reused, so a purged endpoint's slots match no live
/// endpoint. Everything else is as the conntrack entry says: only flows
/// with replies seen and not closing are cached, FIN/RST packets and
/// fragments always take the conntrack path (a FIN or RST also empties the
/// flow's slot), and the conntrack entry is refreshed by the packet that
/// refills the slot.
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
pub(crate) unsafe fn flow_cache_hit(slot: *const FlowSlot, k: &[u32; 5], now: u64, epoch: u32) -> bool {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        let confirmed = (*slot).confirmed_ns;
        flow_slot_holds(slot, k)
            && (*slot).epoch == epoch
            && confirmed != 0
            && now.wrapping_sub(confirmed) < FLOW_TTL_NS
    }
}

/// Whether the slot holds exactly this key.
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
unsafe fn flow_slot_holds(slot: *const FlowSlot, w: &[u32; 5]) -> bool {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        let sl = &*slot;
        ((sl.key[0] ^ w[0]) | (sl.key[1] ^ w[1]) | (sl.key[2] ^ w[2]) | (sl.key[3] ^ w[3]) | (sl.key[4] ^ w[4])) == 0
    }
}

/// Empties the slot if it holds this key (a FIN or RST of the flow: its
/// next packets take the conntrack path, which knows it is closing).
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
pub(crate) unsafe fn flow_cache_forget(slot: *mut FlowSlot, k: &[u32; 5]) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        if flow_slot_holds(slot, k) {
            wr64((slot as *mut u8).add(24), 0);
        }
    }
}

/// Stores an established flow's key in its flow-cache slot, confirmed
/// under `epoch`.
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
pub(crate) unsafe fn flow_cache_fill(slot: *mut FlowSlot, w: &[u32; 5], now: u64, epoch: u32) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        // A dry run (`npm-agent explain`) fills no cache.
        if crate::dry_run() {
            return;
        }
        let d = slot as *mut u8;
        wr32(d, w[0]);
        wr32(d.add(4), w[1]);
        wr32(d.add(8), w[2]);
        wr32(d.add(12), w[3]);
        wr32(d.add(16), w[4]);
        wr32(d.add(20), epoch);
        wr64(d.add(24), now);
    }
}
