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

/// Subjects (pod identities of local endpoints) below this fit a
/// [`tier_front_key`] (19 bits); a subject at or above it has no front
/// words and its tiers are decided on `NPM_TIERS`.
pub const TIER_FRONT_MAX_SUBJECT: u32 = 1 << 19;
/// Peer identities below this fit a [`tier_front_key`] (25 bits: every pod
/// identity and the first 2^24 CIDR identities).
pub const TIER_FRONT_MAX_IDENTITY: u32 = 1 << 25;
/// Ranks below this fit a [`tier_front_word`] (14 bits). A word holds the
/// loader's front rank, not the compiler's: per endpoint, direction and
/// tier an order-preserving renumbering of the compiler's ranks (the
/// datapath compares a front rank only with front ranks of the same
/// endpoint, direction and tier).
pub const TIER_FRONT_MAX_RANK: u32 = 1 << 14;
/// log2 of the ports of a block word ([`tier_front_pc_block`]): an aligned
/// block of 64 ports inside one entry's range is one word.
pub const TIER_FRONT_BLOCK_BITS: u32 = 6;
/// First port class of the exact-port words.
const PC_EXACT: u64 = 4;
/// First port class of the block words.
const PC_BLOCK: u64 = PC_EXACT + 3 * 65_536;
// Every port class fits 18 bits.
const _: () = assert!(PC_BLOCK + 3 * (65_536 >> TIER_FRONT_BLOCK_BITS) <= 1 << 18);

/// Port class of an "any protocol" entry.
pub const TIER_FRONT_PC_ANY_PROTO: u64 = 0;
/// Port class of "any port of protocol `code`" (`code` 1..=3, see
/// [`crate::policy_front_proto`]).
pub const fn tier_front_pc_any_port(code: u64) -> u64 {
    code
}
/// Port class of destination port `port` of protocol `code` (1..=3).
pub const fn tier_front_pc_exact(code: u64, port: u16) -> u64 {
    PC_EXACT + ((code - 1) << 16) + port as u64
}
/// Port class of the aligned 64-port block holding `port` of protocol
/// `code` (1..=3).
pub const fn tier_front_pc_block(code: u64, port: u16) -> u64 {
    PC_BLOCK + ((code - 1) << (16 - TIER_FRONT_BLOCK_BITS)) + (port >> TIER_FRONT_BLOCK_BITS) as u64
}

/// Port class of an identity's per-tier summary word: the word of
/// (endpoint, direction, tier, identity) whose rank field is a mask of the
/// port classes that identity has words of ([`tier_front_summary_bit`]).
/// A program of the previous format probes it first and only the classes
/// it names (an identity without a summary word has no word at all); the
/// current datapath reads the shared summary
/// ([`TIER_FRONT_PC_SHARED_SUMMARY`]) instead.
/// The loader keeps the mask a superset of the identity's words: a bit is
/// set before the first word of its class is stored and cleared after the
/// last one is removed.
pub const TIER_FRONT_PC_SUMMARY: u64 = PC_BLOCK + 3 * (65_536 >> TIER_FRONT_BLOCK_BITS);
const _: () = assert!(TIER_FRONT_PC_SUMMARY < 1 << 18);
/// Summary class: exact-port words of protocol code 1 (shift left by
/// `code - 1` for the others).
pub const TIER_FRONT_SUM_EXACT: u32 = 1 << 0;
/// Summary class: 64-port block words of protocol code 1 (shift left by
/// `code - 1`).
pub const TIER_FRONT_SUM_BLOCK: u32 = 1 << 3;
/// Summary class: the any-port word of protocol code 1 (shift left by
/// `code - 1`).
pub const TIER_FRONT_SUM_ANY_PORT: u32 = 1 << 6;
/// Summary class: the any-protocol word.
pub const TIER_FRONT_SUM_ANY_PROTO: u32 = 1 << 9;
/// The action bits of a summary word's flags (any non-zero action: a word
/// is never 0).
pub const TIER_FRONT_SUM_ACTION: u32 = TIER_PASS;

/// The summary class bit ([`TIER_FRONT_SUM_EXACT`] ...) of the word of
/// port class `pc` (not itself a summary).
pub const fn tier_front_summary_bit(pc: u64) -> u32 {
    if pc == TIER_FRONT_PC_ANY_PROTO {
        TIER_FRONT_SUM_ANY_PROTO
    } else if pc < PC_EXACT {
        TIER_FRONT_SUM_ANY_PORT << (pc - 1)
    } else if pc < PC_BLOCK {
        TIER_FRONT_SUM_EXACT << ((pc - PC_EXACT) >> 16)
    } else {
        TIER_FRONT_SUM_BLOCK << ((pc - PC_BLOCK) >> (16 - TIER_FRONT_BLOCK_BITS))
    }
}

/// Port class of an identity's shared summary word: the word of
/// (endpoint, direction, identity) (the tier bit of its key is 0) whose
/// rank field names, for both tiers, the port classes that identity has
/// words of ([`tier_front_shared_bit`]): the datapath probes it once for
/// the Admin and the Baseline tier. The per-tier summaries
/// ([`TIER_FRONT_PC_SUMMARY`]) are kept beside it for the programs that
/// read them (an older program stays attached until the new one replaces
/// it); the loader keeps both masks supersets of the identity's words.
pub const TIER_FRONT_PC_SHARED_SUMMARY: u64 = TIER_FRONT_PC_SUMMARY + 1;
const _: () = assert!(TIER_FRONT_PC_SHARED_SUMMARY < 1 << 18);
/// Shared summary class: exact-port words of protocol code 1 (shift left
/// by `code - 1` for the others), in the Admin tier (shift left by
/// [`TIER_FRONT_SHARED_TIER_SHIFT`] for the Baseline tier).
pub const TIER_FRONT_SHARED_EXACT: u32 = 1 << 0;
/// Shared summary class: 64-port block words of any protocol.
pub const TIER_FRONT_SHARED_BLOCK: u32 = 1 << 3;
/// Shared summary class: the any-port word of any protocol.
pub const TIER_FRONT_SHARED_ANY_PORT: u32 = 1 << 4;
/// Shared summary class: the any-protocol word.
pub const TIER_FRONT_SHARED_ANY_PROTO: u32 = 1 << 5;
/// Shift of the Baseline tier's classes in a shared summary.
pub const TIER_FRONT_SHARED_TIER_SHIFT: u32 = 6;
/// The classes of one tier in a shared summary.
pub const TIER_FRONT_SHARED_TIER_MASK: u32 = (1 << TIER_FRONT_SHARED_TIER_SHIFT) - 1;
// Both tiers' classes fit the 14-bit rank field of a word.
const _: () = assert!(TIER_FRONT_SHARED_ANY_PROTO << TIER_FRONT_SHARED_TIER_SHIFT < TIER_FRONT_MAX_RANK);

/// The shared summary class bit of the word of `key` (not itself a
/// summary): its class ([`TIER_FRONT_SHARED_EXACT`] ...) shifted by its
/// tier.
pub const fn tier_front_shared_bit(key: u64) -> u32 {
    let pc = tier_front_pc_of(key);
    let bit = if pc == TIER_FRONT_PC_ANY_PROTO {
        TIER_FRONT_SHARED_ANY_PROTO
    } else if pc < PC_EXACT {
        TIER_FRONT_SHARED_ANY_PORT
    } else if pc < PC_BLOCK {
        TIER_FRONT_SHARED_EXACT << ((pc - PC_EXACT) >> 16)
    } else {
        TIER_FRONT_SHARED_BLOCK
    };
    if key >> 44 & 1 != 0 {
        bit << TIER_FRONT_SHARED_TIER_SHIFT
    } else {
        bit
    }
}

/// The shared summary key of the identity of `key` (same endpoint,
/// direction and identity; tier bit 0; port class
/// [`TIER_FRONT_PC_SHARED_SUMMARY`]).
pub const fn tier_front_shared_summary_key(key: u64) -> u64 {
    (key & !((1 << 18) - 1) & !(1 << 44)) | TIER_FRONT_PC_SHARED_SUMMARY
}

/// Whether port class `pc` is a summary's (per-tier or shared).
pub const fn tier_front_is_summary(pc: u64) -> bool {
    pc == TIER_FRONT_PC_SUMMARY || pc == TIER_FRONT_PC_SHARED_SUMMARY
}

/// The port class of a [`tier_front_key`] (bits 0..18).
pub const fn tier_front_pc_of(key: u64) -> u64 {
    key & ((1 << 18) - 1)
}

/// The summary key of the identity of `key` (same endpoint, direction,
/// tier and identity; port class [`TIER_FRONT_PC_SUMMARY`]).
pub const fn tier_front_summary_key(key: u64) -> u64 {
    (key & !((1 << 18) - 1)) | TIER_FRONT_PC_SUMMARY
}

/// The key of one `NPM_TIER_FRONT` entry (64 bits): port class `pc` (bits
/// 0..18), peer `identity` (18..43), direction (43), tier (44: 1 for
/// [`TIER_BASELINE`]), subject (45..64: the pod identity of the endpoints
/// it governs). The caller checks the ranges ([`TIER_FRONT_MAX_SUBJECT`],
/// [`TIER_FRONT_MAX_IDENTITY`]).
pub const fn tier_front_key(subject: u32, dir: u8, tier: u8, identity: u32, pc: u64) -> u64 {
    pc | (identity as u64) << 18
        | ((dir & 1) as u64) << 43
        | ((tier & TIER_BASELINE != 0) as u64) << 44
        | (subject as u64) << 45
}

/// The odd multiplier of the front's bijective hash.
const FRONT_MUL: u64 = 0x9e37_79b9_7f4a_7c15;
/// Its inverse modulo 2^64 (Newton's iteration).
const FRONT_MUL_INV: u64 = {
    let mut x = FRONT_MUL;
    let mut i = 0;
    while i < 6 {
        x = x.wrapping_mul(2u64.wrapping_sub(FRONT_MUL.wrapping_mul(x)));
        i += 1;
    }
    x
};
const _: () = assert!(FRONT_MUL.wrapping_mul(FRONT_MUL_INV) == 1);
/// Bits of a word's tag (the low bits of the hashed key); the bucket is
/// the top bits (at least the other 16: [`crate::sizes::TIER_FRONT_MIN_BUCKETS`]).
pub const TIER_FRONT_TAG_BITS: u32 = 48;
const TAG_BITS: u32 = TIER_FRONT_TAG_BITS;
/// The tag bits of a word.
pub const TIER_FRONT_TAG_MASK: u64 = (1 << TAG_BITS) - 1;
// The value (action, 14-bit rank) fills the 16 bits above the tag.
const _: () = assert!(TAG_BITS == 48 && TIER_FRONT_MAX_RANK << TIER_RANK_SHIFT == 1 << 16);

/// The [`crate::front_shift`] of the default tier front
/// ([`crate::sizes::TIER_FRONT_BUCKETS`]).
pub const TIER_FRONT_SHIFT: u32 = crate::front_shift(crate::sizes::TIER_FRONT_BUCKETS);

/// (bucket, tag) of a [`tier_front_key`] in an `NPM_TIER_FRONT` whose
/// [`crate::front_shift`] is `shift` (at most 48: at least
/// [`crate::sizes::TIER_FRONT_MIN_BUCKETS`] buckets): the key times an odd
/// constant (a bijection of 64-bit words), whose top `64 - shift` bits are
/// the bucket and low 48 bits the tag. Within one bucket the tag identifies
/// the key, so a word holds its tag and its value together and is
/// published with one store.
#[inline(always)]
pub const fn tier_front_slot(key: u64, shift: u32) -> (u32, u64) {
    let h = key.wrapping_mul(FRONT_MUL);
    ((h >> shift) as u32, h & TIER_FRONT_TAG_MASK)
}

/// [`tier_front_slot`] without the masking of the shift (one instruction
/// less per probe in the datapath, where the shift is a load-time constant
/// LLVM cannot see).
///
/// # Safety
///
/// `shift` is below 64 (a [`crate::front_shift`] of at least 2 buckets).
#[inline(always)]
pub const unsafe fn tier_front_slot_unchecked(key: u64, shift: u32) -> (u32, u64) {
    let h = key.wrapping_mul(FRONT_MUL);
    // SAFETY: the caller's.
    (unsafe { h.unchecked_shr(shift) } as u32, h & TIER_FRONT_TAG_MASK)
}

/// The key of the word `word` found in bucket `bucket` of a front whose
/// shift is `shift` (inverse of [`tier_front_slot`]; the bucket's bits
/// below bit 48 repeat the tag's, for a word in its own bucket).
pub const fn tier_front_key_of(bucket: u32, word: u64, shift: u32) -> u64 {
    (((bucket as u64) << shift) | (word & TIER_FRONT_TAG_MASK)).wrapping_mul(FRONT_MUL_INV)
}

/// The `NPM_TIER_FRONT` word of `key` with the [`TierValue::flags`]
/// `flags`: its tag, then action and rank in bits 48..64. `None` when the
/// rank does not fit ([`TIER_FRONT_MAX_RANK`]) or the action is none. A
/// word is never 0 (the action is not), the empty slot.
pub const fn tier_front_word(key: u64, flags: u32) -> Option<u64> {
    if flags >> TIER_RANK_SHIFT >= TIER_FRONT_MAX_RANK || flags & TIER_ACTION_MASK == 0 {
        return None;
    }
    Some(key.wrapping_mul(FRONT_MUL) & TIER_FRONT_TAG_MASK | (flags as u64) << TAG_BITS)
}

/// The [`TierValue::flags`] of a word whose tag is `tag`, else `u32::MAX`
/// (no entry: a pass of the last rank, as the datapath's misses).
#[inline(always)]
pub const fn tier_front_hit(word: u64, tag: u64) -> u32 {
    if word & TIER_FRONT_TAG_MASK == tag && (word >> TAG_BITS) as u32 & TIER_ACTION_MASK != 0 {
        (word >> TAG_BITS) as u32
    } else {
        u32::MAX
    }
}

/// log2 of the `NPM_TIER_SUMMARY` slots per `NPM_TIER_FRONT` bucket: the
/// summary array has one slot per word the front can hold.
pub const TIER_SUMMARY_SLOTS_PER_BUCKET_LOG: u32 = 2;

/// The `NPM_TIER_SUMMARY` slot of the shared summary key `skey`
/// ([`tier_front_shared_summary_key`]: one (subject, direction, identity))
/// in a summary array beside a tier front whose [`crate::front_shift`] is
/// `shift`: the top bits of the same multiplicative hash as
/// [`tier_front_slot`], two more than the front's bucket. The array is
/// direct-mapped and has no tags: a slot holds the OR of the
/// [`tier_summary_bits`] of every key that lands there, a superset of
/// each one's (bits only ever cost a probe that misses).
#[inline(always)]
pub const fn tier_summary_slot(skey: u64, shift: u32) -> u32 {
    (skey.wrapping_mul(FRONT_MUL) >> (shift - TIER_SUMMARY_SLOTS_PER_BUCKET_LOG)) as u32
}

/// [`tier_summary_slot`] without the checks of the shift (one instruction
/// less in the datapath, where the shift is a load-time constant).
///
/// # Safety
///
/// `shift` is in `TIER_SUMMARY_SLOTS_PER_BUCKET_LOG..64 +
/// TIER_SUMMARY_SLOTS_PER_BUCKET_LOG` (a tier front's [`crate::front_shift`]
/// is 40 to 48).
#[inline(always)]
pub const unsafe fn tier_summary_slot_unchecked(skey: u64, shift: u32) -> u32 {
    // SAFETY: the caller's.
    unsafe {
        skey.wrapping_mul(FRONT_MUL)
            .unchecked_shr(shift.unchecked_sub(TIER_SUMMARY_SLOTS_PER_BUCKET_LOG)) as u32
    }
}

/// Shift of the exact-port filter in an `NPM_TIER_SUMMARY` slot: bits
/// 0..12 are the shared summary classes ([`tier_front_shared_bit`]),
/// bits 32..64 a one-hash Bloom filter of the ports of the exact-port
/// words ([`tier_summary_port_bit`]), whatever their protocol and tier.
pub const TIER_SUMMARY_PORTS_SHIFT: u32 = 32;

/// The exact-port filter bit of destination port `port` in an
/// `NPM_TIER_SUMMARY` slot: the datapath probes an exact-port word only
/// when the slot has both the class and this bit.
#[inline(always)]
pub const fn tier_summary_port_bit(port: u16) -> u64 {
    1u64 << (TIER_SUMMARY_PORTS_SHIFT + ((port as u32).wrapping_mul(0x9e37_79b1) >> 27))
}

/// The `NPM_TIER_SUMMARY` bits the word of tier front key `key` (not a
/// summary) needs in the slot of its shared summary key: its shared class
/// bit and, for an exact-port word, its port's filter bit.
pub const fn tier_summary_bits(key: u64) -> u64 {
    let pc = tier_front_pc_of(key);
    let class = tier_front_shared_bit(key) as u64;
    if pc >= PC_EXACT && pc < PC_BLOCK {
        class | tier_summary_port_bit(((pc - PC_EXACT) & 0xffff) as u16)
    } else {
        class
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

    #[test]
    fn tier_front_words_round_trip() {
        let keys = [
            tier_front_key(1, DIR_INGRESS, TIER_ADMIN, 0, TIER_FRONT_PC_ANY_PROTO),
            tier_front_key(7, 1, TIER_BASELINE, 300, tier_front_pc_exact(1, 80)),
            tier_front_key(7, 1, TIER_ADMIN, 300, tier_front_pc_exact(1, 80)),
            tier_front_key(7, 1, TIER_ADMIN, 300, tier_front_pc_block(3, 65_535)),
            tier_front_key(
                TIER_FRONT_MAX_SUBJECT - 1,
                1,
                TIER_BASELINE,
                TIER_FRONT_MAX_IDENTITY - 1,
                3,
            ),
        ];
        let mut seen = std::collections::BTreeSet::new();
        for k in keys {
            assert!(seen.insert(k), "distinct keys");
            let w = tier_front_word(k, tier_flags(TIER_DENY, 77)).unwrap();
            assert_ne!(w, 0);
            // Every front size from the smallest to the largest: the bucket
            // is in range, the tag the same, and bucket and word give the key.
            let mut buckets = crate::sizes::TIER_FRONT_MIN_BUCKETS;
            while buckets <= crate::sizes::FRONT_MAX_BUCKETS {
                let shift = crate::front_shift(buckets);
                let (bucket, tag) = tier_front_slot(k, shift);
                assert!(bucket < buckets);
                assert_eq!(tag, tier_front_slot(k, TIER_FRONT_SHIFT).1);
                assert_eq!(tier_front_key_of(bucket, w, shift), k);
                // SAFETY: shift < 64.
                assert_eq!(unsafe { tier_front_slot_unchecked(k, shift) }, (bucket, tag));
                assert_eq!(tier_front_hit(w, tag), tier_flags(TIER_DENY, 77));
                assert_eq!(tier_front_hit(w, tag ^ 1), u32::MAX);
                assert_eq!(tier_front_hit(0, tag), u32::MAX);
                buckets <<= 1;
            }
            // The default: the top 16 bits (today's layout, which adopted
            // pins and attached programs of the same layout share).
            assert_eq!(
                tier_front_slot(k, TIER_FRONT_SHIFT).0,
                (k.wrapping_mul(FRONT_MUL) >> 48) as u32
            );
        }
        assert_eq!(
            tier_front_word(keys[0], tier_flags(TIER_ACCEPT, TIER_FRONT_MAX_RANK)),
            None
        );
        assert!(tier_front_word(keys[0], tier_flags(TIER_PASS, TIER_FRONT_MAX_RANK - 1)).is_some());
        // Port classes never collide.
        assert!(tier_front_pc_exact(3, u16::MAX) < tier_front_pc_block(1, 0));
        assert!(tier_front_pc_block(3, u16::MAX) < TIER_FRONT_PC_SUMMARY);
        // Summary bits, one per class and protocol code.
        assert_eq!(
            tier_front_summary_bit(TIER_FRONT_PC_ANY_PROTO),
            TIER_FRONT_SUM_ANY_PROTO
        );
        assert_eq!(
            tier_front_summary_bit(tier_front_pc_any_port(2)),
            TIER_FRONT_SUM_ANY_PORT << 1
        );
        assert_eq!(
            tier_front_summary_bit(tier_front_pc_exact(3, 65_535)),
            TIER_FRONT_SUM_EXACT << 2
        );
        assert_eq!(tier_front_summary_bit(tier_front_pc_exact(1, 0)), TIER_FRONT_SUM_EXACT);
        assert_eq!(
            tier_front_summary_bit(tier_front_pc_block(1, 65_535)),
            TIER_FRONT_SUM_BLOCK
        );
        assert_eq!(
            tier_front_summary_bit(tier_front_pc_block(2, 64)),
            TIER_FRONT_SUM_BLOCK << 1
        );
        let k = tier_front_key(7, 1, TIER_ADMIN, 300, tier_front_pc_exact(1, 80));
        assert_eq!(tier_front_pc_of(k), tier_front_pc_exact(1, 80));
        let sk = tier_front_summary_key(k);
        assert_eq!(sk, tier_front_key(7, 1, TIER_ADMIN, 300, TIER_FRONT_PC_SUMMARY));
        let all = TIER_FRONT_SUM_ANY_PROTO * 2 - 1;
        assert!(tier_front_word(sk, tier_flags(TIER_FRONT_SUM_ACTION, all)).is_some());
        assert!(tier_front_pc_any_port(3) < tier_front_pc_exact(1, 0));
        // The shared summary: one key for both tiers, the Baseline's
        // classes above the Admin's.
        let kb = tier_front_key(7, 1, TIER_BASELINE, 300, tier_front_pc_exact(2, 80));
        assert_eq!(tier_front_shared_summary_key(k), tier_front_shared_summary_key(kb));
        assert_eq!(
            tier_front_shared_summary_key(kb),
            tier_front_key(7, 1, TIER_ADMIN, 300, TIER_FRONT_PC_SHARED_SUMMARY)
        );
        assert_eq!(tier_front_shared_bit(k), TIER_FRONT_SHARED_EXACT);
        assert_eq!(
            tier_front_shared_bit(kb),
            (TIER_FRONT_SHARED_EXACT << 1) << TIER_FRONT_SHARED_TIER_SHIFT
        );
        let kp = tier_front_key(7, 1, TIER_BASELINE, 300, TIER_FRONT_PC_ANY_PROTO);
        assert_eq!(
            tier_front_shared_bit(kp),
            TIER_FRONT_SHARED_ANY_PROTO << TIER_FRONT_SHARED_TIER_SHIFT
        );
        let ka = tier_front_key(7, 1, TIER_ADMIN, 300, tier_front_pc_any_port(3));
        assert_eq!(tier_front_shared_bit(ka), TIER_FRONT_SHARED_ANY_PORT);
        let kk = tier_front_key(7, 1, TIER_ADMIN, 300, tier_front_pc_block(3, 640));
        assert_eq!(tier_front_shared_bit(kk), TIER_FRONT_SHARED_BLOCK);
        assert!(tier_front_is_summary(TIER_FRONT_PC_SHARED_SUMMARY) && tier_front_is_summary(TIER_FRONT_PC_SUMMARY));
        assert!(!tier_front_is_summary(tier_front_pc_block(3, 65_535)));
        let both = (TIER_FRONT_SHARED_ANY_PROTO << TIER_FRONT_SHARED_TIER_SHIFT) * 2 - 1;
        assert!(tier_front_word(
            tier_front_shared_summary_key(k),
            tier_flags(TIER_FRONT_SUM_ACTION, both)
        )
        .is_some());
        // The summary array: a slot in range for every front size, the
        // class bit and, for an exact port, its filter bit.
        let mut buckets = crate::sizes::TIER_FRONT_MIN_BUCKETS;
        while buckets <= crate::sizes::FRONT_MAX_BUCKETS {
            let shift = crate::front_shift(buckets);
            let slot = tier_summary_slot(tier_front_shared_summary_key(k), shift);
            assert!(slot < buckets << TIER_SUMMARY_SLOTS_PER_BUCKET_LOG);
            assert_eq!(
                // SAFETY: shift is in range.
                unsafe { tier_summary_slot_unchecked(tier_front_shared_summary_key(k), shift) },
                slot
            );
            buckets <<= 1;
        }
        assert_eq!(
            tier_summary_bits(k),
            TIER_FRONT_SHARED_EXACT as u64 | tier_summary_port_bit(80)
        );
        assert_eq!(tier_summary_bits(kk), TIER_FRONT_SHARED_BLOCK as u64);
        assert_eq!(
            tier_summary_bits(kp),
            (TIER_FRONT_SHARED_ANY_PROTO << TIER_FRONT_SHARED_TIER_SHIFT) as u64
        );
        let bits: std::collections::BTreeSet<u64> = (0..=u16::MAX).map(tier_summary_port_bit).collect();
        assert_eq!(bits.len(), 32, "the ports spread over the 32 filter bits");
        assert!(bits.iter().all(|b| *b >> TIER_SUMMARY_PORTS_SHIFT != 0));
    }
}
