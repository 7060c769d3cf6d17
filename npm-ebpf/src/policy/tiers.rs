//! Steps 9a and 9c: the ClusterNetworkPolicy Admin and Baseline tiers, on
//! the tier front `NPM_TIER_FRONT` (inlined array reads) for a subject's
//! direction and tier complete there (a subject is the pod identity of
//! local endpoints: the endpoints of one identity share its entries) (`EP_ADMIN_FRONT_<dir>`,
//! `EP_BASELINE_FRONT_<dir>`), else on the LPM trie `NPM_TIERS` (the
//! `NPM_POLICY` key layout with the tier bit in the direction byte). Per
//! tier one most specific entry per peer identity (three identities) and
//! the minimum of their ranks: constant in the number of
//! ClusterNetworkPolicies and rules. On the front, each identity's slot
//! of the class filter `NPM_TIER_SUMMARY` (its port classes in both tiers
//! and a filter of its exact ports: one inlined array read, no tag to
//! compare) is read once per packet for both tiers ([`tier_summaries`]);
//! an identity then costs nothing in a tier where it has no word, else the
//! probes of the classes its slot names, most specific first, up to the
//! first hit.

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, Array, LpmTrie},
};
use npm_common::{
    policy_front_proto, sizes, tier_front_key, tier_front_pc_any_port, tier_front_pc_block, tier_front_pc_exact,
    tier_front_slot_unchecked, tier_summary_port_bit, tier_summary_slot_unchecked, TierValue, EP_ADMIN_FRONT_INGRESS,
    EP_BASELINE_FRONT_INGRESS, EP_TIER_SUMMARY, IDENTITY_ANY, POLICY_KEY_LEN, TIER_ACTION_MASK, TIER_ADMIN,
    TIER_BASELINE, TIER_FRONT_MAX_IDENTITY, TIER_FRONT_MAX_SUBJECT, TIER_FRONT_PC_ANY_PROTO,
    TIER_FRONT_PC_SHARED_SUMMARY, TIER_FRONT_SHARED_ANY_PORT, TIER_FRONT_SHARED_ANY_PROTO, TIER_FRONT_SHARED_BLOCK,
    TIER_FRONT_SHARED_EXACT, TIER_FRONT_SHARED_TIER_MASK, TIER_FRONT_SHARED_TIER_SHIFT, TIER_FRONT_SHIFT,
};

use super::lpm::write_full_key;
use super::BPF_F_MMAPABLE;
use crate::mem::wr32;

/// `NPM_TIERS`: the tier entries of every subject (`tier_key` ->
/// `TierValue`).
#[map]
static NPM_TIERS: LpmTrie<[u8; POLICY_KEY_LEN], TierValue> = LpmTrie::with_max_entries(sizes::TIERS, 0);

/// `NPM_TIER_FRONT`: buckets of four tier words (see
/// `npm_common::tier_front_word`: tag and value in one word), written by
/// user space through a shared mapping with single 64-bit stores. Its
/// number of buckets is set at load time (`max_entries`; the default here),
/// and with it [`NPM_TIER_FRONT_SHIFT`].
#[map]
static NPM_TIER_FRONT: Array<[u64; 4]> = Array::with_max_entries(sizes::TIER_FRONT_BUCKETS, BPF_F_MMAPABLE);

/// `NPM_TIER_SUMMARY`: the tier front's class filter, one word per
/// (subject, direction, peer identity) slot (`npm_common::tier_summary_slot`,
/// direct-mapped, no tags: the OR of the classes of every key landing
/// there), written by user space through a shared mapping with single
/// 64-bit stores. Its number of slots is the front's buckets times 4, set
/// at load time with them.
#[map]
static NPM_TIER_SUMMARY: Array<u64> = Array::with_max_entries(sizes::TIER_SUMMARY_SLOTS, BPF_F_MMAPABLE);

/// Load-time constant: the `npm_common::front_shift` of the buckets of
/// `NPM_TIER_FRONT` as loaded (set by the loader from the size the map is
/// created with, or the size of the pinned map it adopts). Read once per
/// packet, by [`tier_summaries`] (the [`Summaries`] carry it to
/// [`tier_action`]); the verifier sees the frozen value.
#[no_mangle]
static NPM_TIER_FRONT_SHIFT: u32 = TIER_FRONT_SHIFT;

/// [`NPM_TIER_FRONT_SHIFT`].
#[inline(always)]
fn front_shift() -> u32 {
    // SAFETY: reading a read-only global.
    unsafe { core::ptr::read_volatile(&NPM_TIER_FRONT_SHIFT) }
}

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
fn front_get(lpm: *mut u8, key: u64, shift: u32) -> u32 {
    let f = front_probe(key, shift);
    // SAFETY: lpm is the 20-byte, 4-aligned scratch key.
    unsafe {
        wr32(lpm, f);
        core::ptr::read_volatile(lpm as *const u32)
    }
}

/// [`front_get`] without the scratch word: the smallest [`slot_code`] of
/// the bucket's four words, a hit when it is below `0xffff` (a key is in
/// at most one slot, so the smallest is that slot's).
#[inline(always)]
fn front_probe(key: u64, shift: u32) -> u32 {
    // SAFETY: shift is NPM_TIER_FRONT_SHIFT, below 64: the loader sets it to the
    // front_shift of a front size that check_front_buckets accepted (at
    // least 64 buckets: at most 58).
    let (bucket, tag) = unsafe { tier_front_slot_unchecked(key, shift) };
    match NPM_TIER_FRONT.get(bucket) {
        Some(b) => {
            let b = b.as_ptr();
            // SAFETY: four 8-aligned words of the bucket; volatile: user
            // space stores them concurrently (whole words).
            let m = unsafe {
                min64(
                    min64(
                        slot_code(core::ptr::read_volatile(b), tag),
                        slot_code(core::ptr::read_volatile(b.add(1)), tag),
                    ),
                    min64(
                        slot_code(core::ptr::read_volatile(b.add(2)), tag),
                        slot_code(core::ptr::read_volatile(b.add(3)), tag),
                    ),
                )
            };
            if m < 0xffff {
                (m + 1) as u32
            } else {
                u32::MAX
            }
        }
        None => u32::MAX,
    }
}

/// A word's 16-bit value minus one when its tag is `tag` (below `0xffff`:
/// a word's value is never 0, its action is set), else at least `0xffff`:
/// the word XOR the tag, rotated so that the value is the low 16 bits and
/// the tag difference the high 48 (an empty slot, 0, gives `u64::MAX`
/// whatever the tag). The loader stores only words whose action is set
/// (`npm_common::tier_front_word`; adopted words without one are
/// dropped), so this is `npm_common::tier_front_hit` minus one.
#[inline(always)]
fn slot_code(word: u64, tag: u64) -> u64 {
    (word ^ tag).rotate_left(16).wrapping_sub(1)
}

/// The smaller of `a` and `b`.
#[inline(always)]
fn min64(a: u64, b: u64) -> u64 {
    if a < b {
        a
    } else {
        b
    }
}

/// The smaller of `a` and `b` without a branch.
#[inline(always)]
fn min32(a: u32, b: u32) -> u32 {
    let lt = (a as u64).wrapping_sub(b as u64) >> 63;
    b ^ ((a ^ b) & (lt as u32).wrapping_neg())
}

/// The class filter slots (`NPM_TIER_SUMMARY`) of a packet's three peer
/// identities: per identity, the port classes it has words of in both
/// tiers and the filter bits of its exact ports (0: no word, or not
/// read), read once for the Admin and the Baseline tier
/// ([`tier_summaries`]).
#[derive(Clone, Copy)]
pub(crate) struct Summaries {
    pod: u64,
    cidr: u64,
    any: u64,
    /// [`NPM_TIER_FRONT_SHIFT`], read with the summaries (0 when none was
    /// probed: then every mask is 0 and no word is probed either).
    shift: u32,
}

/// The `NPM_TIER_SUMMARY` slot of the shared summary key `key` (a
/// superset of that identity's classes and exact ports; 0: no word): one
/// inlined array read, no tag.
#[inline(always)]
fn summary_get(key: u64, shift: u32) -> u64 {
    // SAFETY: shift is NPM_TIER_FRONT_SHIFT, the front_shift of a tier
    // front the loader accepted (2^16 to 2^24 buckets): 40..=48.
    let slot = unsafe { tier_summary_slot_unchecked(key, shift) };
    match NPM_TIER_SUMMARY.get(slot) {
        // SAFETY: an 8-aligned array value, stored whole by user space.
        Some(w) => unsafe { core::ptr::read_volatile(w) },
        None => 0,
    }
}

/// The [`Summaries`] of the peer `ids` (pod or node identity, CIDR
/// identity) for subject `ep` (the endpoint's flags `ep_flags`) in direction `dir`: three
/// array reads when a tier that will be consulted (the Admin tier when `admin`,
/// the Baseline tier when `baseline`) is on the front, else none. An
/// identity out of the key's range, or a CIDR identity of `IDENTITY_ANY`
/// (the any facet answers for it), gets 0 without a read.
#[inline(always)]
pub(crate) fn tier_summaries(
    ep: u32,
    ep_flags: u32,
    dir: u8,
    ids: (u32, u32),
    admin: bool,
    baseline: bool,
) -> Summaries {
    let mut s = Summaries {
        pod: 0,
        cidr: 0,
        any: 0,
        shift: 0,
    };
    let front = (admin && front_enabled(ep, ep_flags, dir | TIER_ADMIN))
        || (baseline && front_enabled(ep, ep_flags, dir | TIER_BASELINE));
    if !front {
        return s;
    }
    let (identity, cidr_identity) = ids;
    // (Plain calls, not a closure: LLVM compiles a closure into a
    // BPF-to-BPF call.)
    let pc = TIER_FRONT_PC_SHARED_SUMMARY;
    let shift = front_shift();
    s.shift = shift;
    if identity < TIER_FRONT_MAX_IDENTITY {
        s.pod = summary_get(tier_front_key(ep, dir, TIER_ADMIN, identity, pc), shift);
    }
    if cidr_identity != IDENTITY_ANY && cidr_identity < TIER_FRONT_MAX_IDENTITY {
        s.cidr = summary_get(tier_front_key(ep, dir, TIER_ADMIN, cidr_identity, pc), shift);
    }
    s.any = summary_get(tier_front_key(ep, dir, TIER_ADMIN, IDENTITY_ANY, pc), shift);
    s
}

/// One packet's probes of one tier on the tier front: what every peer
/// identity's probes share.
#[derive(Clone, Copy)]
struct FrontProbe {
    /// The 20-byte scratch key (see [`front_get`]).
    lpm: *mut u8,
    /// The subject.
    ep: u32,
    dir: u8,
    /// `TIER_ADMIN` or `TIER_BASELINE`.
    tier: u8,
    /// This tier's classes in a filter slot start here (see
    /// [`tier_classes`]).
    classes_shift: u32,
    /// The packet's `policy_front_proto`.
    code: u64,
    /// The destination port and its exact-port filter bit.
    port: u16,
    port_bit: u64,
    /// [`NPM_TIER_FRONT_SHIFT`].
    shift: u32,
}

impl FrontProbe {
    /// [`tier_hit`] on the tier front for peer `identity` whose filter slot
    /// is `slot`, as 16 bits (action, rank): only the port classes this
    /// tier's bits of the slot name (none: the identity has no word, no
    /// hit; an exact port only when the slot's port filter has the
    /// packet's), the most specific first, the first hit ending the search:
    /// the exact port's word, else its 64-port block's (one protocol's
    /// entries have disjoint ranges: at most one of the two exists), else
    /// the protocol's any-port word, else the any-protocol word: the same
    /// answer as the LPM's longest prefix. `0xffff` for none (a pass of the
    /// last front rank, which never decides).
    #[inline(always)]
    fn hit(self, identity: u32, slot: u64) -> u32 {
        let mask = tier_classes(slot, self.classes_shift);
        if mask == 0 {
            return 0xffff;
        }
        let (code, port) = (self.code, self.port);
        let mut r = u32::MAX;
        if code != 0 {
            if slot & self.port_bit != 0 && mask & (TIER_FRONT_SHARED_EXACT << (code - 1) as u32) != 0 {
                r = self.word(identity, tier_front_pc_exact(code, port));
            }
            if r == u32::MAX && mask & TIER_FRONT_SHARED_BLOCK != 0 {
                r = self.word(identity, tier_front_pc_block(code, port));
            }
            if r == u32::MAX && mask & TIER_FRONT_SHARED_ANY_PORT != 0 {
                r = self.word(identity, tier_front_pc_any_port(code));
            }
        }
        if r == u32::MAX && mask & TIER_FRONT_SHARED_ANY_PROTO != 0 {
            r = self.word(identity, TIER_FRONT_PC_ANY_PROTO);
        }
        r & 0xffff
    }

    /// [`front_get`] of the word of `identity` and port class `pc`. (A
    /// method, not a closure: LLVM compiles a closure into a BPF-to-BPF
    /// call.)
    #[inline(always)]
    fn word(self, identity: u32, pc: u64) -> u32 {
        front_get(
            self.lpm,
            tier_front_key(self.ep, self.dir, self.tier, identity, pc),
            self.shift,
        )
    }
}

/// One tier's classes (bits 0..6 after `shift`: 0 for the Admin tier,
/// `TIER_FRONT_SHARED_TIER_SHIFT` for the Baseline tier) of a filter slot.
#[inline(always)]
fn tier_classes(slot: u64, shift: u32) -> u32 {
    (slot as u32 >> shift) & TIER_FRONT_SHARED_TIER_MASK
}

/// Whether a tier of subject `ep` (its endpoint's flags `ep_flags`) in
/// direction `dir` is complete in the tier front, the loader keeps the
/// class filter for it (`EP_TIER_SUMMARY`), and the front is not switched
/// off.
#[inline(always)]
fn front_enabled(ep: u32, ep_flags: u32, dir_tier: u8) -> bool {
    let flag = if dir_tier & TIER_BASELINE != 0 {
        EP_BASELINE_FRONT_INGRESS
    } else {
        EP_ADMIN_FRONT_INGRESS
    };
    ep != 0
        && ep < TIER_FRONT_MAX_SUBJECT
        && ep_flags & (flag << (dir_tier & 1)) != 0
        && ep_flags & EP_TIER_SUMMARY != 0
        // SAFETY: reading a read-only global.
        && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_TIER_FRONT) } == 0
}

/// The decision of a tier for a packet of an endpoint of subject `ep`
/// (the endpoint's flags `ep_flags`): `dir_tier` is the direction `|` the tier bit (`TIER_ADMIN`
/// or `TIER_BASELINE`), `ids` the peer's (pod or node identity, CIDR
/// identity; `IDENTITY_ANY`: none). Returns the action (`TIER_ACCEPT`,
/// `TIER_DENY`, `TIER_PASS`) of the hit of lowest rank among the lookups of
/// the pod identity, the CIDR identity (skipped when there is none: it
/// could not hit) and `IDENTITY_ANY`. No hit is `TIER_PASS` (the tier does
/// not decide). On the front, `sums` are the identities' filter slots
/// ([`tier_summaries`], read with this tier consulted).
#[inline(always)]
// Eight scalar arguments kept in registers: a struct passed to this
// per-packet step would go through the BPF stack the verifier bounds.
#[allow(clippy::too_many_arguments)]
pub(crate) fn tier_action(
    lpm: *mut u8,
    ep: u32,
    ep_flags: u32,
    dir_tier: u8,
    ids: (u32, u32),
    pr: u8,
    port: u16,
    sums: Summaries,
) -> u32 {
    let (identity, cidr_identity) = ids;
    if front_enabled(ep, ep_flags, dir_tier) {
        let tier = dir_tier & !1;
        // This tier's classes of each identity's filter slot. Out of
        // the key's ranges no word can be meant (the loader never marks a
        // tier complete with such a peer): the slot is 0, no hit,
        // rather than a key whose bits spill into other fields.
        let probe = FrontProbe {
            lpm,
            ep,
            dir: dir_tier & 1,
            tier,
            classes_shift: if tier & TIER_BASELINE != 0 {
                TIER_FRONT_SHARED_TIER_SHIFT
            } else {
                0
            },
            code: policy_front_proto(pr),
            port,
            port_bit: tier_summary_port_bit(port),
            shift: sums.shift,
        };
        let mut best = probe.hit(identity, sums.pod);
        best = min32(best, probe.hit(cidr_identity, sums.cidr));
        best = min32(best, probe.hit(IDENTITY_ANY, sums.any));
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
