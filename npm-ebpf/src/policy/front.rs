//! Step 9 on the policy front `NPM_POLICY_FRONT`: a hash table of exact
//! words in 4-word buckets written by user space, probed with inlined array
//! reads for an endpoint direction whose policy is complete there
//! (`EP_FRONT_<dir>`).

use aya_ebpf::{macros::map, maps::Array};
use npm_common::{
    policy_front_bucket, policy_front_proto, policy_front_word, sizes, EP_FRONT_INGRESS, POLICY_FRONT_MAX_ENDPOINT,
    POLICY_FRONT_MAX_IDENTITY,
};

use super::BPF_F_MMAPABLE;

/// `NPM_POLICY_FRONT`: buckets of four policy words (see
/// `npm_common::policy_front_word`), written by user space through a
/// shared mapping with single 64-bit stores.
#[map]
static NPM_POLICY_FRONT: Array<[u64; 4]> = Array::with_max_entries(sizes::POLICY_FRONT_BUCKETS, BPF_F_MMAPABLE);

/// Test and benchmark switch: when 1, step 9 always walks the LPM
/// (`NPM_POLICY`), never the policy front.
#[no_mangle]
static NPM_BENCH_NO_POLICY_FRONT: u8 = 0;

/// Whether `NPM_POLICY_FRONT` holds the word (one bucket of four words).
#[inline(always)]
fn front_has(word: u64) -> bool {
    match NPM_POLICY_FRONT.get(policy_front_bucket(word)) {
        Some(b) => {
            let b = b.as_ptr();
            // SAFETY: four 8-aligned words of the bucket; volatile: user
            // space stores them concurrently (whole words).
            unsafe {
                (core::ptr::read_volatile(b) == word)
                    | (core::ptr::read_volatile(b.add(1)) == word)
                    | (core::ptr::read_volatile(b.add(2)) == word)
                    | (core::ptr::read_volatile(b.add(3)) == word)
            }
        }
        None => false,
    }
}

/// Step 9's lookup of one peer identity in the policy front, for an
/// endpoint direction whose policy is complete there: the exact port, then
/// (unless `exact_only`) any port of the protocol and any protocol. The
/// same answer as [`super::lpm::policy_rule`] on the LPM: an LPM entry is an aligned
/// port block, which the front holds port by port.
#[inline(always)]
pub(crate) fn front_allows(ep: u32, dir: u8, identity: u32, protocol: u8, port: u16, exact_only: bool) -> bool {
    // Out of the word's ranges no front word can be meant (the loader never
    // marks such an endpoint, or a direction with such a peer, complete):
    // no allow, rather than a word whose bits spill into other fields.
    // Endpoint 0 is never used (its any-protocol word for peer ANY would be
    // 0, an empty slot).
    if identity >= POLICY_FRONT_MAX_IDENTITY || ep == 0 || ep >= POLICY_FRONT_MAX_ENDPOINT {
        return false;
    }
    let code = policy_front_proto(protocol);
    if code != 0 && front_has(policy_front_word(ep, dir, identity, code, true, port)) {
        return true;
    }
    if exact_only {
        return false;
    }
    (code != 0 && front_has(policy_front_word(ep, dir, identity, code, false, 0)))
        || front_has(policy_front_word(ep, dir, identity, 0, false, 0))
}

/// Whether step 9 probes the front for an endpoint (flags `ep_flags`) in
/// direction `dir`: its policy is complete there (`EP_FRONT_<dir>`) and
/// [`NPM_BENCH_NO_POLICY_FRONT`] is not set.
#[inline(always)]
pub(crate) fn front_enabled(ep_flags: u32, dir: u8) -> bool {
    // SAFETY: reading a read-only global.
    ep_flags & (EP_FRONT_INGRESS << dir) != 0 && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_POLICY_FRONT) } == 0
}
