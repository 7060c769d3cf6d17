//! Steps 9a to 9d by the folded decisions `NPM_FOLD`: for a subject whose
//! endpoint record has `EP_FOLD_<dir>`, the decision of the Admin tier,
//! NetworkPolicy and the Baseline tier for the peer's class (its pod and
//! CIDR identities), the protocol and the port, computed ahead of time by
//! user space: one probe of one bucket for an exact port (at most four,
//! most specific first), inlined array reads, no LPM walk. A class without
//! entries (not folded: it did not fit, or is new) returns [`NO_FOLD`] and
//! the packet takes the tiers' and NetworkPolicy's lookups on the LPM
//! tries, the truth the fold is computed from.

use aya_ebpf::{macros::map, maps::Array};
use npm_common::{
    cidr_code, fold_check, fold_hash, fold_key_unchecked, fold_pc_any_port, fold_pc_block, fold_pc_exact, proto_code,
    sizes, EP_FOLD_INGRESS, FOLD_BUCKET_WORDS, FOLD_MAX_IDENTITY, FOLD_MAX_SUBJECT, FOLD_PC_ANY_PROTO, FOLD_SHIFT,
};

use super::BPF_F_MMAPABLE;

/// `NPM_FOLD`: buckets of four (key, value) entries (see
/// `npm_common::fold_key`), written by user space through a shared
/// mapping with single 64-bit stores.
#[map]
static NPM_FOLD: Array<[u64; FOLD_BUCKET_WORDS]> = Array::with_max_entries(sizes::FOLD_BUCKETS, BPF_F_MMAPABLE);

/// Test and benchmark switch: when 1, the datapath never reads `NPM_FOLD`.
#[no_mangle]
static NPM_BENCH_NO_FOLD: u8 = 0;

/// [`fold_decision`]'s answer when no entry decides.
pub(crate) const NO_FOLD: u32 = u32::MAX;

/// Whether the datapath reads `NPM_FOLD` for an endpoint (flags
/// `ep_flags`) in direction `dir`: the direction is flagged folded and
/// [`NPM_BENCH_NO_FOLD`] is not set.
#[inline(always)]
pub(crate) fn fold_enabled(ep_flags: u32, dir: u8) -> bool {
    // SAFETY: reading a read-only global.
    ep_flags & (EP_FOLD_INGRESS << dir) != 0 && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FOLD) } == 0
}

/// The decision word (as `super::evaluate_policy` returns it) of the
/// folded entry for a packet of subject `subject` in direction `dir` (a
/// direction [`fold_enabled`] says is folded) whose peer has the
/// identities `ids` (pod or node identity, CIDR identity), protocol `pr`
/// and destination port `port`; [`NO_FOLD`] when the class has no entries.
#[inline(always)]
pub(crate) fn fold_decision(subject: u32, dir: u8, ids: (u32, u32), pr: u8, port: u16) -> u32 {
    let (identity, cidr_identity) = ids;
    if subject == 0 || subject >= FOLD_MAX_SUBJECT || identity >= FOLD_MAX_IDENTITY {
        return NO_FOLD;
    }
    let Some(code) = cidr_code(cidr_identity) else {
        return NO_FOLD;
    };
    let base = fold_key_unchecked(subject, dir, identity, 0);
    let proto = proto_code(pr);
    if proto != 0 {
        let w = probe(base | fold_pc_exact(proto, port), code);
        if w != NO_FOLD {
            return w;
        }
        let w = probe(base | fold_pc_block(proto, port), code);
        if w != NO_FOLD {
            return w;
        }
        let w = probe(base | fold_pc_any_port(proto), code);
        if w != NO_FOLD {
            return w;
        }
    }
    probe(base | FOLD_PC_ANY_PROTO, code)
}

/// The decision word of the entry of `key` and CIDR code `code` in its
/// bucket, [`NO_FOLD`] for none. User space writes a value before its key
/// and clears a key only (the value stays). A slot's value is taken only
/// when it carries the key's check ([`fold_check`]: the CIDR code and a
/// tag of the key), so a key read with its slot's previous value (another
/// key's: arm64 may perform the value's load before the key's, x86 does
/// not) is not taken: the entry counts as not yet written, which a class
/// being stored already is (its wider entries are stored after it). The
/// key is read again after the value (x86's order: a key cleared and
/// rewritten between the two reads is not paired with the value).
#[inline(always)]
fn probe(key: u64, code: u64) -> u32 {
    let hash = fold_hash(key, code);
    let Some(b) = NPM_FOLD.get((hash >> FOLD_SHIFT) as u32) else {
        return NO_FOLD;
    };
    let check = fold_check(hash, code, FOLD_SHIFT);
    let b = b.as_ptr();
    let mut i = 0;
    while i < FOLD_BUCKET_WORDS {
        // SAFETY: words i and i + 1 of the bucket (8-aligned); volatile:
        // user space stores them concurrently (whole words).
        unsafe {
            if core::ptr::read_volatile(b.add(i)) == key {
                let v = core::ptr::read_volatile(b.add(i + 1));
                if v >> 32 == check && core::ptr::read_volatile(b.add(i)) == key {
                    return v as u32;
                }
            }
        }
        i += 2;
    }
    NO_FOLD
}
