//! Steps 9a and 9c: the ClusterNetworkPolicy Admin and Baseline tiers on
//! the LPM trie `NPM_TIERS` (the `NPM_POLICY` key layout with the tier bit
//! in the direction byte), keyed by subject (the pod identity of local
//! endpoints: the endpoints of one identity share its entries). Per tier
//! one most specific entry per peer identity (at most three identities)
//! and the minimum of their ranks: constant in the number of
//! ClusterNetworkPolicies and rules. A subject's direction whose decisions
//! are folded (`NPM_FOLD`) comes here only for a peer class the fold does
//! not hold.

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, LpmTrie},
};
use npm_common::{sizes, TierValue, IDENTITY_ANY, POLICY_KEY_LEN, TIER_ACTION_MASK};

use super::lpm::write_full_key;

/// `NPM_TIERS`: the tier entries of every subject (`tier_key` ->
/// `TierValue`).
#[map]
static NPM_TIERS: LpmTrie<[u8; POLICY_KEY_LEN], TierValue> = LpmTrie::with_max_entries(sizes::TIERS, 0);

/// The [`TierValue::flags`] of the most specific `NPM_TIERS` entry for one
/// peer identity, `u32::MAX` (a pass of the last rank) for none.
#[inline(always)]
fn tier_hit(lpm: *mut u8, subject: u32, dir_tier: u8, identity: u32, pr: u8, port: u16) -> u32 {
    // SAFETY: lpm is the 20-byte scratch key; the key is 16 bytes.
    unsafe {
        write_full_key(lpm, subject, dir_tier, identity, pr, port);
        match NPM_TIERS.get(&*(lpm as *const Key<[u8; POLICY_KEY_LEN]>)) {
            Some(v) => v.flags,
            None => u32::MAX,
        }
    }
}

/// The decision of a tier for a packet of an endpoint of subject
/// `subject`: `dir_tier` is the direction `|` the tier bit (`TIER_ADMIN`
/// or `TIER_BASELINE`), `ids` the peer's (pod or node identity, CIDR
/// identity; `IDENTITY_ANY`: none). Returns the action (`TIER_ACCEPT`,
/// `TIER_DENY`, `TIER_PASS`) of the hit of lowest rank among the lookups of
/// the pod identity, the CIDR identity (skipped when there is none: it
/// could not hit) and `IDENTITY_ANY`. No hit is `TIER_PASS` (the tier does
/// not decide).
#[inline(always)]
pub(crate) fn tier_action(lpm: *mut u8, subject: u32, dir_tier: u8, ids: (u32, u32), pr: u8, port: u16) -> u32 {
    let (identity, cidr_identity) = ids;
    let mut best = tier_hit(lpm, subject, dir_tier, identity, pr, port);
    if cidr_identity != IDENTITY_ANY {
        let f = tier_hit(lpm, subject, dir_tier, cidr_identity, pr, port);
        if f < best {
            best = f;
        }
    }
    let f = tier_hit(lpm, subject, dir_tier, IDENTITY_ANY, pr, port);
    if f < best {
        best = f;
    }
    best & TIER_ACTION_MASK
}
