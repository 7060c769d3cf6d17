//! Step 9 on the policy front `NPM_POLICY_FRONT`: a hash table of exact
//! words in 4-word buckets written by user space, probed with inlined array
//! reads for an endpoint direction whose subject's policy is complete there
//! (`EP_FRONT_<dir>`), and the allowing rule of a hit, read from the same
//! slot of `NPM_POLICY_FRONT_RULES` (no `NPM_POLICY` lookup).
//!
//! Verdicts come only from the words. User space stores a slot's rule id
//! before its word and clears it after removing the word, and a hit
//! re-reads its word after reading the rule: a reader that raced with a
//! change of the slot gets [`UNKNOWN_RULE`] (counted at
//! `RULE_SLOT_UNKNOWN`), never another word's rule, and never an allow the
//! words do not give. (The datapath's loads are plain loads: on a weakly
//! ordered CPU a torn read may still count one packet under a neighbouring
//! rule; the verdict stays the words'.)

use aya_ebpf::{macros::map, maps::Array};
use npm_common::{
    policy_front_bucket_unchecked, policy_front_proto, policy_front_word, sizes, EP_FRONT_INGRESS,
    POLICY_FRONT_MAX_IDENTITY, POLICY_FRONT_MAX_SUBJECT, POLICY_FRONT_RULE_UNKNOWN, POLICY_FRONT_SHIFT,
};

use super::lpm::NO_RULE;
use super::BPF_F_MMAPABLE;

/// `NPM_POLICY_FRONT`: buckets of four policy words (see
/// `npm_common::policy_front_word`), written by user space through a
/// shared mapping with single 64-bit stores. Its number of buckets is set
/// at load time (`max_entries`; the default here), and with it
/// [`NPM_POLICY_FRONT_SHIFT`].
#[map]
static NPM_POLICY_FRONT: Array<[u64; 4]> = Array::with_max_entries(sizes::POLICY_FRONT_BUCKETS, BPF_F_MMAPABLE);

/// `NPM_POLICY_FRONT_RULES`: beside each bucket of `NPM_POLICY_FRONT`, the
/// `npm_common::policy_front_rule` of each slot's word (0: unknown),
/// written by user space through a shared mapping with single 32-bit
/// stores.
#[map]
static NPM_POLICY_FRONT_RULES: Array<[u32; 4]> = Array::with_max_entries(sizes::POLICY_FRONT_BUCKETS, BPF_F_MMAPABLE);

/// Load-time constant: the `npm_common::front_shift` of the buckets of
/// `NPM_POLICY_FRONT` as loaded (set by the loader from the size the map
/// is created with, or the size of the pinned map it adopts), so that the
/// datapath hashes a word to the bucket user space stored it in. Read once
/// per lookup ([`front_rule`]); the verifier sees the frozen value.
#[no_mangle]
static NPM_POLICY_FRONT_SHIFT: u32 = POLICY_FRONT_SHIFT;

/// Test and benchmark switch: when 1, step 9 always walks the LPM
/// (`NPM_POLICY`), never the policy front.
#[no_mangle]
static NPM_BENCH_NO_POLICY_FRONT: u8 = 0;

/// [`front_rule`]'s answer for a hit whose rule slot is unknown (not
/// written yet, or changed while it was read): allowed, by a rule it
/// cannot tell.
pub(crate) const UNKNOWN_RULE: u32 = u32::MAX - 1;

/// The rule of slot `i` (0..4) of bucket `bucket`, whose word (at `words`)
/// was `word`: the rule id, or [`UNKNOWN_RULE`] when the slot's rule is
/// unknown or the word changed meanwhile.
#[inline(always)]
fn slot_rule(bucket: u32, i: usize, words: *const u64, word: u64) -> u32 {
    let Some(rules) = NPM_POLICY_FRONT_RULES.get(bucket) else {
        return UNKNOWN_RULE;
    };
    let i = i & 3;
    // SAFETY: slot i < 4 of the bucket's rules and words; volatile: user
    // space stores them concurrently (whole words). The word is read again
    // after its rule: user space writes a rule before its word and clears
    // it after removing the word.
    let (v, still) = unsafe {
        let v = core::ptr::read_volatile(rules.as_ptr().add(i));
        (v, core::ptr::read_volatile(words.add(i)) == word)
    };
    if v == POLICY_FRONT_RULE_UNKNOWN || !still {
        UNKNOWN_RULE
    } else {
        v - 1
    }
}

/// One probe of `NPM_POLICY_FRONT` (one bucket of four words; `shift`:
/// [`NPM_POLICY_FRONT_SHIFT`]): the rule of the slot holding `word` (see
/// [`slot_rule`]), or [`NO_RULE`] when no slot does.
#[inline(always)]
fn front_probe(word: u64, shift: u32) -> u32 {
    // SAFETY: shift is NPM_POLICY_FRONT_SHIFT, below 64: the loader sets it to the
    // front_shift of a front size that check_front_buckets accepted (at
    // least 64 buckets: at most 58).
    let bucket = unsafe { policy_front_bucket_unchecked(word, shift) };
    let Some(b) = NPM_POLICY_FRONT.get(bucket) else {
        return NO_RULE;
    };
    let b = b.as_ptr();
    // SAFETY: four 8-aligned words of the bucket; volatile: user space
    // stores them concurrently (whole words).
    let i = unsafe {
        if core::ptr::read_volatile(b) == word {
            0
        } else if core::ptr::read_volatile(b.add(1)) == word {
            1
        } else if core::ptr::read_volatile(b.add(2)) == word {
            2
        } else if core::ptr::read_volatile(b.add(3)) == word {
            3
        } else {
            return NO_RULE;
        }
    };
    slot_rule(bucket, i, b, word)
}

/// Step 9's lookup of one peer identity in the policy front under
/// `subject` (the endpoint's pod identity), for an endpoint direction whose
/// subject's policy is complete there: the exact port, then
/// (unless `exact_only`) any port of the protocol and any protocol. Returns
/// the allowing rule's id, [`UNKNOWN_RULE`], or [`NO_RULE`] (no allow): the
/// same allow as [`super::lpm::policy_rule`] on the LPM (an LPM entry is an
/// aligned port block, which the front holds port by port).
#[inline(always)]
pub(crate) fn front_rule(subject: u32, dir: u8, identity: u32, protocol: u8, port: u16, exact_only: bool) -> u32 {
    // Out of the word's ranges no front word can be meant (the loader never
    // marks a direction of such a subject, or with such a peer, complete):
    // no allow, rather than a word whose bits spill into other fields.
    // Subject 0 is never used (its any-protocol word for peer ANY would be
    // 0, an empty slot).
    if identity >= POLICY_FRONT_MAX_IDENTITY || subject == 0 || subject >= POLICY_FRONT_MAX_SUBJECT {
        return NO_RULE;
    }
    // SAFETY: reading a read-only global.
    let shift = unsafe { core::ptr::read_volatile(&NPM_POLICY_FRONT_SHIFT) };
    let code = policy_front_proto(protocol);
    if code != 0 {
        let r = front_probe(policy_front_word(subject, dir, identity, code, true, port), shift);
        if r != NO_RULE {
            return r;
        }
    }
    if exact_only {
        return NO_RULE;
    }
    if code != 0 {
        let r = front_probe(policy_front_word(subject, dir, identity, code, false, 0), shift);
        if r != NO_RULE {
            return r;
        }
    }
    front_probe(policy_front_word(subject, dir, identity, 0, false, 0), shift)
}

/// Whether step 9 probes the front for an endpoint (flags `ep_flags`) in
/// direction `dir`: its subject's policy is complete there (`EP_FRONT_<dir>`) and
/// [`NPM_BENCH_NO_POLICY_FRONT`] is not set.
#[inline(always)]
pub(crate) fn front_enabled(ep_flags: u32, dir: u8) -> bool {
    // SAFETY: reading a read-only global.
    ep_flags & (EP_FRONT_INGRESS << dir) != 0 && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_POLICY_FRONT) } == 0
}
