//! Step 9 on the LPM trie `NPM_POLICY`: one fully specified key per
//! lookup, the trie finds the allow of its longest matching prefix.

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, LpmTrie},
};
use npm_common::{sizes, PolicyValue, POLICY_KEY_LEN, POLICY_PREFIX_FULL};

use core::mem::size_of;

use crate::mem::wr32;

/// `NPM_POLICY`: the allows of every subject (`PolicyKey` -> `PolicyValue`;
/// a subject is the pod identity of the local endpoints it governs).
#[map]
static NPM_POLICY: LpmTrie<[u8; POLICY_KEY_LEN], PolicyValue> = LpmTrie::with_max_entries(sizes::POLICY, 0);
// The scratch key `lpm` is written as four words and read as a
// `NPM_POLICY` key (`npm_common::PolicyKey`).
const _: () = assert!(size_of::<Key<[u8; POLICY_KEY_LEN]>>() == 16);

/// [`policy_rule`]'s answer when no entry matches (no rule has this id).
pub(crate) const NO_RULE: u32 = u32::MAX;

/// Looks up the fully specified policy key (see `PolicyKey`): subject,
/// direction, identity, protocol and port in network order, prefix 96.
/// Returns the rule id of the matching allow, or [`NO_RULE`].
#[inline(always)]
pub(crate) fn policy_rule(lpm: *mut u8, subject: u32, dir: u8, identity: u32, protocol: u8, port: u16) -> u32 {
    // SAFETY: lpm is 20 bytes; the key is 16 (`bpf_lpm_trie_key` + 12).
    unsafe {
        write_full_key(lpm, subject, dir, identity, protocol, port);
        match NPM_POLICY.get(&*(lpm as *const Key<[u8; POLICY_KEY_LEN]>)) {
            Some(v) => v.rule,
            None => NO_RULE,
        }
    }
}

/// Writes the fully specified `PolicyKey` layout (prefix 96; `owner`,
/// direction byte `dir`, identity, protocol and port in network order) as
/// four 32-bit words at `lpm`: the key of `NPM_POLICY` (`owner` the
/// subject) and, with the tier in `dir`, of `NPM_TIERS` (`owner` the
/// subject too).
///
/// # Safety
/// `lpm` is 16 writable, 4-aligned bytes.
#[inline(always)]
pub(crate) unsafe fn write_full_key(lpm: *mut u8, owner: u32, dir: u8, identity: u32, protocol: u8, port: u16) {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        let i = identity;
        wr32(lpm, POLICY_PREFIX_FULL);
        wr32(lpm.add(4), owner.to_be());
        wr32(
            lpm.add(8),
            dir as u32 | ((i >> 24) & 0xff) << 8 | ((i >> 16) & 0xff) << 16 | ((i >> 8) & 0xff) << 24,
        );
        wr32(
            lpm.add(12),
            (i & 0xff) | (protocol as u32) << 8 | ((port >> 8) as u32) << 16 | ((port & 0xff) as u32) << 24,
        );
    }
}
