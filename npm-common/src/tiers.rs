//! `NPM_TIERS`: the ClusterNetworkPolicy tiers, one LPM trie of
//! [`PolicyKey`]s (the `NPM_POLICY` layout, with the tier in the direction
//! byte: [`tier_key`]) -> [`TierValue`] (the action and rank of the first
//! rule of the tier matching that key).
//!
//! A packet's tier decision is, per tier, at most three lookups (the peer's
//! pod or node identity, its CIDR identity, [`crate::IDENTITY_ANY`]) and the
//! hit of the lowest rank ([`TierValue::flags`] compares rank first):
//! constant in the number of ClusterNetworkPolicies and rules.

use core::mem::{offset_of, size_of};

use crate::packet::DIR_EGRESS;
use crate::policy::PolicyKey;

/// Direction-byte bit of an Admin-tier key of `NPM_TIERS`.
pub const TIER_ADMIN: u8 = 2;
/// Direction-byte bit of a Baseline-tier key of `NPM_TIERS`.
pub const TIER_BASELINE: u8 = 4;
// The tier bits leave the direction bit alone.
const _: () = assert!(TIER_ADMIN & DIR_EGRESS == 0 && TIER_BASELINE & DIR_EGRESS == 0);
const _: () = assert!(TIER_ADMIN & TIER_BASELINE == 0);

/// [`TierValue::flags`] action: accept (allow, final).
pub const TIER_ACCEPT: u32 = 1;
/// [`TierValue::flags`] action: deny (drop silently, final).
pub const TIER_DENY: u32 = 2;
/// [`TierValue::flags`] action: pass (skip the rest of the tier).
pub const TIER_PASS: u32 = 3;
/// The action bits of [`TierValue::flags`].
pub const TIER_ACTION_MASK: u32 = 3;
/// Shift of the rank in [`TierValue::flags`].
pub const TIER_RANK_SHIFT: u32 = 2;
/// Ranks are below this (they fit [`TierValue::flags`] above the action).
pub const TIER_MAX_RANK: u32 = 1 << 30;

/// The `NPM_TIERS` key of subject `subject` (the pod identity of the
/// endpoints it governs), direction `dir`, tier
/// `tier` ([`TIER_ADMIN`] or [`TIER_BASELINE`]), peer `identity`,
/// `protocol` and `port`, with `prefix_len` significant bits (the
/// prefixes of `NPM_POLICY`: [`crate::POLICY_PREFIX_ANY_PROTO`] for every
/// protocol, [`crate::POLICY_PREFIX_ANY_PORT`] for every port of a
/// protocol, `80 + bits` for an aligned port block,
/// [`crate::POLICY_PREFIX_FULL`] for the key of one packet).
#[inline(always)]
pub const fn tier_key(
    prefix_len: u32,
    subject: u32,
    dir: u8,
    tier: u8,
    identity: u32,
    protocol: u8,
    port: u16,
) -> PolicyKey {
    PolicyKey::with_prefix(prefix_len, subject, dir | tier, identity, protocol, port)
}

/// Value of an `NPM_TIERS` entry: the first rule of the tier matching the
/// key (the most specific entry of its peer identity), its action and
/// rank.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct TierValue {
    /// Rule id in the compiled rule table (a ClusterNetworkPolicy rule).
    pub rule: u32,
    /// Action ([`TIER_ACCEPT`], [`TIER_DENY`], [`TIER_PASS`]) `|` rank
    /// `<<` [`TIER_RANK_SHIFT`]: comparing two values' flags compares their
    /// ranks (ranks are unique per tier and direction, and one rank is one
    /// rule, so equal ranks have equal actions).
    pub flags: u32,
}
// The datapath reads the value's flags as a 32-bit word at 4.
const _: () = assert!(size_of::<TierValue>() == 8);
const _: () = assert!(offset_of!(TierValue, rule) == 0);
const _: () = assert!(offset_of!(TierValue, flags) == 4);
// The key is the `NPM_POLICY` key (four 32-bit words).
const _: () = assert!(size_of::<PolicyKey>() == 16);
// The tier lands in the direction byte (data[4]).
const _: () = assert!(tier_key(96, 1, DIR_EGRESS, TIER_BASELINE, 0, 0, 0).data[4] == DIR_EGRESS | TIER_BASELINE);

/// The [`TierValue::flags`] of `action` and `rank` (`rank` <
/// [`TIER_MAX_RANK`]; larger ranks are clamped to the last one).
pub const fn tier_flags(action: u32, rank: u32) -> u32 {
    let rank = if rank >= TIER_MAX_RANK { TIER_MAX_RANK - 1 } else { rank };
    (action & TIER_ACTION_MASK) | rank << TIER_RANK_SHIFT
}
const _: () = assert!(tier_flags(TIER_PASS, TIER_MAX_RANK) == u32::MAX);

impl TierValue {
    /// The action bits ([`TIER_ACCEPT`], [`TIER_DENY`], [`TIER_PASS`]).
    pub const fn action(&self) -> u32 {
        self.flags & TIER_ACTION_MASK
    }
    /// The rank.
    pub const fn rank(&self) -> u32 {
        self.flags >> TIER_RANK_SHIFT
    }
}

// SAFETY: repr(C), only integers, no padding (asserted above), any bit
// pattern is valid.
#[cfg(feature = "user")]
unsafe impl aya::Pod for TierValue {}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::{proto, DIR_INGRESS, POLICY_PREFIX_ANY_PORT};

    #[test]
    fn tier_key_and_flags() {
        let k = tier_key(POLICY_PREFIX_ANY_PORT, 7, DIR_INGRESS, TIER_ADMIN, 300, proto::TCP, 80);
        assert_eq!(k.direction(), TIER_ADMIN);
        assert_eq!(k.identity(), 300);
        assert_eq!(k.port(), 0);
        let v = TierValue {
            rule: 3,
            flags: tier_flags(TIER_DENY, 5),
        };
        assert_eq!((v.action(), v.rank()), (TIER_DENY, 5));
        // Lower rank, lower flags, whatever the action.
        assert!(tier_flags(TIER_PASS, 1) < tier_flags(TIER_ACCEPT, 2));
    }
}
