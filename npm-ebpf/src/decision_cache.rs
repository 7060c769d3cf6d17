//! The per-CPU decision cache of steps 8 and 9 (`NPM_DECISIONS`, not
//! pinned) and the policy generation `NPM_GENERATION` that tags its slots.

use aya_ebpf::{
    macros::map,
    maps::{Array, PerCpuArray},
};
use core::mem::{offset_of, size_of};

use crate::mem::{rd32, wr32, wr64};

/// The per-CPU decision cache of steps 8 and 9 (the tiers and
/// NetworkPolicy alike: every outcome of `evaluate_policy`, from `Host` to
/// `BaselineDeny`): a direct-mapped table of
/// (endpoint id, direction, protocol, port, peer address) -> reason, each
/// slot tagged with the `NPM_GENERATION` it was decided under. The loader
/// bumps the generation after every batch of writes to the maps a decision
/// reads (endpoints, ipcache, CIDRs, policy, tiers), so a slot only answers while
/// the maps are as when it was decided: exact at batch boundaries (during a
/// batch it answers with the state before the batch). The generation is a
/// plain load, ordered before the map reads on x86; see ARCHITECTURE.md for
/// weakly ordered CPUs. The key is the endpoint id, whose record names
/// the subject the NetworkPolicy lookups use: a relabelled pod (its record
/// now naming another subject) and a change of a subject's entries are
/// both writes of a batch, so neither outlives the batch in a slot. Not
/// pinned.
#[map]
pub(crate) static NPM_DECISIONS: PerCpuArray<DecisionSlot> = PerCpuArray::with_max_entries(DECISION_SLOTS, 0);

/// Slots of [`NPM_DECISIONS`] per CPU (a power of two).
const DECISION_SLOTS: u32 = 4096;

/// One [`NPM_DECISIONS`] slot.
#[repr(C)]
pub(crate) struct DecisionSlot {
    key: [u32; 6],
    reason: u32,
    pad: u32,
    /// `NPM_GENERATION` at the decision; 0 never matches (no loader write yet).
    generation: u64,
}
// [`decision_cache_put`] writes the slot as words.
const _: () = assert!(size_of::<DecisionSlot>() == 40);
const _: () = assert!(offset_of!(DecisionSlot, key) == 0);
const _: () = assert!(offset_of!(DecisionSlot, reason) == 24);
const _: () = assert!(offset_of!(DecisionSlot, generation) == 32);

/// The policy generation (one `u64`), bumped by the loader after every map
/// write; see [`NPM_DECISIONS`].
#[map]
pub(crate) static NPM_GENERATION: Array<u64> = Array::with_max_entries(1, 0);

/// Benchmark-only switch: when 1, the decision cache is not used, so
/// policy-decided packets measure the ipcache and policy lookups.
#[no_mangle]
pub(crate) static NPM_BENCH_NO_DECISION_CACHE: u8 = 0;

/// The decision-cache key: endpoint, direction|protocol|port, peer
/// address (4 words).
///
/// # Safety
/// `peer` is a 16-byte, 4-aligned address.
#[inline(always)]
pub(crate) unsafe fn decision_key(ep: u32, dir: u8, pr: u8, port: u16, peer: *const u8) -> [u32; 6] {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        [
            ep,
            dir as u32 | (pr as u32) << 8 | (port as u32) << 16,
            rd32(peer),
            rd32(peer.add(4)),
            rd32(peer.add(8)),
            rd32(peer.add(12)),
        ]
    }
}

/// The decision-cache slot of a key.
#[inline(always)]
pub(crate) fn decision_slot(w: &[u32; 6]) -> u32 {
    let a = (w[5] ^ w[1].rotate_left(16)).wrapping_mul(0x9e37_79b1);
    let b = (w[0] ^ w[2] ^ w[3] ^ w[4]).wrapping_mul(0x85eb_ca77);
    ((a ^ b) >> 16) & (DECISION_SLOTS - 1)
}

/// [`decision_cache_get`]'s miss (no reason is 0xff).
pub(crate) const NO_DECISION: u32 = 0xff;

/// The cached decision word for `key` (the reason in bits 0..8, the rule
/// slot of a `Policy` allow above) if the slot holds it under
/// `generation`, else [`NO_DECISION`].
///
/// # Safety
/// `slot` points to this CPU's `NPM_DECISIONS` slot.
#[inline(always)]
pub(crate) unsafe fn decision_cache_get(slot: *const DecisionSlot, w: &[u32; 6], generation: u64) -> u32 {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        let sl = &*slot;
        let diff = (sl.key[0] ^ w[0])
            | (sl.key[1] ^ w[1])
            | (sl.key[2] ^ w[2])
            | (sl.key[3] ^ w[3])
            | (sl.key[4] ^ w[4])
            | (sl.key[5] ^ w[5]);
        if diff == 0 && sl.generation == generation {
            sl.reason
        } else {
            NO_DECISION
        }
    }
}

/// Stores a decision word (see [`decision_cache_get`]) made under `generation`.
///
/// # Safety
/// `slot` points to this CPU's `NPM_DECISIONS` slot.
#[inline(always)]
pub(crate) unsafe fn decision_cache_put(slot: *mut DecisionSlot, w: &[u32; 6], generation: u64, word: u32) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        let d = slot as *mut u8;
        if crate::flow_cache::store_key(d, w) {
            wr32(d.add(24), word);
            wr64(d.add(32), generation);
        }
    }
}
