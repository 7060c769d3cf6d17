//! Steps 9a and 9c: the ClusterNetworkPolicy Admin and Baseline tiers, on
//! the tier front `NPM_TIER_FRONT` (inlined array reads) for an endpoint
//! direction and tier complete there (`EP_ADMIN_FRONT_<dir>`,
//! `EP_BASELINE_FRONT_<dir>`), else on the LPM trie `NPM_TIERS` (the
//! `NPM_POLICY` key layout with the tier bit in the direction byte). Per
//! tier one most specific entry per peer identity (three identities) and
//! the minimum of their ranks: constant in the number of
//! ClusterNetworkPolicies and rules. On the front, an identity costs one
//! probe (its summary word) when it has no word, else the summary and the
//! port classes it names.

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, Array, LpmTrie},
};
use npm_common::{
    policy_front_proto, sizes, tier_front_key, tier_front_pc_any_port, tier_front_pc_block, tier_front_pc_exact,
    tier_front_slot, TierValue, EP_ADMIN_FRONT_INGRESS, EP_BASELINE_FRONT_INGRESS, IDENTITY_ANY, POLICY_KEY_LEN,
    TIER_ACTION_MASK, TIER_BASELINE, TIER_FRONT_MAX_ENDPOINT, TIER_FRONT_MAX_IDENTITY, TIER_FRONT_PC_ANY_PROTO,
    TIER_FRONT_PC_SUMMARY, TIER_FRONT_SUM_ANY_PORT, TIER_FRONT_SUM_ANY_PROTO, TIER_FRONT_SUM_BLOCK,
    TIER_FRONT_SUM_EXACT, TIER_FRONT_TAG_MASK, TIER_RANK_SHIFT,
};

use super::lpm::write_full_key;
use super::BPF_F_MMAPABLE;
use crate::mem::wr32;

/// `NPM_TIERS`: the tier entries of every endpoint (`tier_key` ->
/// `TierValue`).
#[map]
static NPM_TIERS: LpmTrie<[u8; POLICY_KEY_LEN], TierValue> = LpmTrie::with_max_entries(sizes::TIERS, 0);

/// `NPM_TIER_FRONT`: buckets of four tier words (see
/// `npm_common::tier_front_word`: tag and value in one word), written by
/// user space through a shared mapping with single 64-bit stores.
#[map]
static NPM_TIER_FRONT: Array<[u64; 4]> = Array::with_max_entries(sizes::TIER_FRONT_BUCKETS, BPF_F_MMAPABLE);

/// Test and benchmark switch: when 1, the tiers always walk the LPM
/// (`NPM_TIERS`), never the tier front.
#[no_mangle]
static NPM_BENCH_NO_TIER_FRONT: u8 = 0;

/// The [`TierValue::flags`] of the most specific `NPM_TIERS` entry for one
/// peer identity, `u32::MAX` (a pass of the last rank) for none.
#[inline(always)]
fn tier_hit(lpm: *mut u8, ep: u32, dir_tier: u8, identity: u32, pr: u8, port: u16) -> u32 {
    // SAFETY: lpm is the 20-byte scratch key; the key is 16 bytes.
    unsafe {
        write_full_key(lpm, ep, dir_tier, identity, pr, port);
        match NPM_TIERS.get(&*(lpm as *const Key<[u8; POLICY_KEY_LEN]>)) {
            Some(v) => v.flags,
            None => u32::MAX,
        }
    }
}

/// The flags of the word of `key` in `NPM_TIER_FRONT` (one bucket of four
/// words), `u32::MAX` for none. The answer goes through the scratch word
/// `lpm`: the verifier then knows nothing of how it was found, which keeps
/// the number of states it explores (the branches of the probes and
/// minimums) from multiplying.
#[inline(always)]
fn front_get(lpm: *mut u8, key: u64) -> u32 {
    let f = front_probe(key);
    // SAFETY: lpm is the 20-byte, 4-aligned scratch key.
    unsafe {
        wr32(lpm, f);
        core::ptr::read_volatile(lpm as *const u32)
    }
}

/// [`front_get`] without the scratch word.
#[inline(always)]
fn front_probe(key: u64) -> u32 {
    let (bucket, tag) = tier_front_slot(key);
    match NPM_TIER_FRONT.get(bucket) {
        Some(b) => {
            let b = b.as_ptr();
            // SAFETY: four 8-aligned words of the bucket; volatile: user
            // space stores them concurrently (whole words). A key is in at
            // most one slot.
            unsafe {
                slot_hit(core::ptr::read_volatile(b), tag)
                    & slot_hit(core::ptr::read_volatile(b.add(1)), tag)
                    & slot_hit(core::ptr::read_volatile(b.add(2)), tag)
                    & slot_hit(core::ptr::read_volatile(b.add(3)), tag)
            }
        }
        None => u32::MAX,
    }
}

/// 1 when `x` is not 0, else 0, without a branch (BPF has no conditional
/// move or set: a comparison is a jump the verifier explores both ways).
#[inline(always)]
fn nonzero(x: u64) -> u64 {
    (x | x.wrapping_neg()) >> 63
}

/// `npm_common::tier_front_hit` without a branch: the word's 16-bit value
/// when its tag is `tag` and its action is set, else `u32::MAX`.
#[inline(always)]
fn slot_hit(word: u64, tag: u64) -> u32 {
    let value = word >> 48;
    let miss = nonzero((word & TIER_FRONT_TAG_MASK) ^ tag) | (1 - nonzero(value & TIER_ACTION_MASK as u64));
    (value | miss.wrapping_neg()) as u32
}

/// The smaller of `a` and `b` without a branch.
#[inline(always)]
fn min32(a: u32, b: u32) -> u32 {
    let lt = (a as u64).wrapping_sub(b as u64) >> 63;
    b ^ ((a ^ b) & (lt as u32).wrapping_neg())
}

/// [`tier_hit`] on the tier front, as 16 bits (action, rank): first the
/// identity's summary word (`TIER_FRONT_PC_SUMMARY`; none: the identity
/// has no word, no hit), then only the port classes it names: the exact
/// port's word or its 64-port block's (one protocol's entries have
/// disjoint ranges: at most one of the two exists), else the protocol's
/// any-port word, else the any-protocol word: the same answer as the
/// LPM's longest prefix. `0xffff` for none (a pass of the last front rank,
/// which never decides). The specificity is put above the 16 bits and the
/// minimum taken ([`min32`]); a class the summary does not name is a miss
/// without its probe.
#[inline(always)]
fn front_hit(lpm: *mut u8, ep: u32, dir: u8, tier: u8, identity: u32, pr: u8, port: u16) -> u32 {
    let summary = front_get(lpm, tier_front_key(ep, dir, tier, identity, TIER_FRONT_PC_SUMMARY));
    if summary == u32::MAX {
        return 0xffff;
    }
    let mask = summary >> TIER_RANK_SHIFT;
    let code = policy_front_proto(pr);
    let mut exact = u32::MAX;
    let mut any_port = u32::MAX;
    if code != 0 {
        let shift = (code - 1) as u32;
        if mask & (TIER_FRONT_SUM_EXACT << shift) != 0 {
            exact = front_get(
                lpm,
                tier_front_key(ep, dir, tier, identity, tier_front_pc_exact(code, port)),
            );
        }
        if mask & (TIER_FRONT_SUM_BLOCK << shift) != 0 {
            exact &= front_get(
                lpm,
                tier_front_key(ep, dir, tier, identity, tier_front_pc_block(code, port)),
            );
        }
        if mask & (TIER_FRONT_SUM_ANY_PORT << shift) != 0 {
            any_port = front_get(
                lpm,
                tier_front_key(ep, dir, tier, identity, tier_front_pc_any_port(code)),
            );
        }
    }
    let mut any_proto = u32::MAX;
    if mask & TIER_FRONT_SUM_ANY_PROTO != 0 {
        any_proto = front_get(lpm, tier_front_key(ep, dir, tier, identity, TIER_FRONT_PC_ANY_PROTO));
    }
    // A miss is u32::MAX; `|` keeps it so.
    let specific = min32(exact, any_port | 0x1_0000);
    min32(specific, any_proto | 0x2_0000) & 0xffff
}

/// Whether a tier of an endpoint (flags `ep_flags`) in direction `dir` is
/// complete in the tier front and the front is not switched off.
#[inline(always)]
fn front_enabled(ep: u32, ep_flags: u32, dir_tier: u8) -> bool {
    let flag = if dir_tier & TIER_BASELINE != 0 {
        EP_BASELINE_FRONT_INGRESS
    } else {
        EP_ADMIN_FRONT_INGRESS
    };
    ep != 0
        && ep < TIER_FRONT_MAX_ENDPOINT
        && ep_flags & (flag << (dir_tier & 1)) != 0
        // SAFETY: reading a read-only global.
        && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_TIER_FRONT) } == 0
}

/// The decision of a tier for a packet of endpoint `ep` (flags
/// `ep_flags`): `dir_tier` is the direction `|` the tier bit (`TIER_ADMIN`
/// or `TIER_BASELINE`), `ids` the peer's (pod or node identity, CIDR
/// identity; `IDENTITY_ANY`: none). Returns the action (`TIER_ACCEPT`,
/// `TIER_DENY`, `TIER_PASS`) of the hit of lowest rank among the lookups of
/// the pod identity, the CIDR identity (skipped when there is none: it
/// could not hit) and `IDENTITY_ANY`. No hit is `TIER_PASS` (the tier does
/// not decide).
#[inline(always)]
pub(crate) fn tier_action(
    lpm: *mut u8,
    ep: u32,
    ep_flags: u32,
    dir_tier: u8,
    ids: (u32, u32),
    pr: u8,
    port: u16,
) -> u32 {
    let (identity, cidr_identity) = ids;
    if front_enabled(ep, ep_flags, dir_tier) {
        let (dir, tier) = (dir_tier & 1, dir_tier & !1);
        // Out of the key's ranges no word can be meant (the loader never
        // marks a tier complete with such a peer): no hit, rather than a
        // key whose bits spill into other fields. A CIDR identity of ANY
        // probes ANY twice: the same answer.
        let mut best = 0xffff;
        if identity < TIER_FRONT_MAX_IDENTITY {
            best = front_hit(lpm, ep, dir, tier, identity, pr, port);
        }
        if cidr_identity < TIER_FRONT_MAX_IDENTITY {
            best = min32(best, front_hit(lpm, ep, dir, tier, cidr_identity, pr, port));
        }
        best = min32(best, front_hit(lpm, ep, dir, tier, IDENTITY_ANY, pr, port));
        return best & TIER_ACTION_MASK;
    }
    let mut best = tier_hit(lpm, ep, dir_tier, identity, pr, port);
    if cidr_identity != IDENTITY_ANY {
        let f = tier_hit(lpm, ep, dir_tier, cidr_identity, pr, port);
        if f < best {
            best = f;
        }
    }
    let f = tier_hit(lpm, ep, dir_tier, IDENTITY_ANY, pr, port);
    if f < best {
        best = f;
    }
    best & TIER_ACTION_MASK
}
