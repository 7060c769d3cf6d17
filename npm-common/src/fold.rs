//! `NPM_FOLD`, the folded decision front: per (subject, direction, peer
//! class, port class) the decision of the Admin tier, NetworkPolicy and the
//! Baseline tier together (steps 9a to 9d), computed ahead of time by user
//! space (`npm_policy::fold`) for subjects with tier entries, so a packet
//! of such a subject is decided by one probe of one bucket instead of the
//! tiers' and NetworkPolicy's lookups.
//!
//! A peer class is the pair step 8 gives the peer: its pod (or node, world,
//! host) identity and its CIDR identity. A bucket holds four entries of
//! two words: the key ([`fold_key`]: subject, direction, identity, port
//! class) and the value ([`fold_value`]: the CIDR identity's code, a tag
//! of the key, and the decision word). Port classes ([`fold_pc_exact`] ...): the datapath probes the exact
//! port, its 64-port block, the protocol's any-port class, then the
//! any-protocol class, and the first entry found decides. User space
//! stores a class's any-port and any-protocol entries after all its exact
//! and block entries and removes them first, so a class is either
//! absent (no entry decides: the datapath takes the tiers' and
//! NetworkPolicy's lookups) or whole.
//!
//! The datapath trusts the entries of a subject's direction only while the
//! endpoint record has [`crate::EP_FOLD_INGRESS`] (or egress): user space
//! clears it before that subject's entries may change and sets it when
//! they are the current decisions.

use crate::packet::IDENTITY_FIRST_CIDR;

/// Subjects below this fit a [`fold_key`] (19 bits).
pub const FOLD_MAX_SUBJECT: u32 = 1 << 19;
/// Peer (pod, node, world, host) identities below this fit a [`fold_key`]
/// (24 bits: every identity below `IDENTITY_FIRST_CIDR`).
pub const FOLD_MAX_IDENTITY: u32 = IDENTITY_FIRST_CIDR;
/// Words of a bucket: four (key, value) entries.
pub const FOLD_BUCKET_WORDS: usize = 8;
/// Entries of a bucket.
pub const FOLD_WAYS: usize = FOLD_BUCKET_WORDS / 2;
/// Set in every key: an all-zero key word is an empty entry.
pub const FOLD_KEY_PRESENT: u64 = 1 << 63;

/// The key word of (subject, direction `dir`, peer `identity`, port class
/// `pc`), or `None` when a field does not fit (`subject` 0 or
/// `>=` [`FOLD_MAX_SUBJECT`], `identity >=` [`FOLD_MAX_IDENTITY`]).
pub const fn fold_key(subject: u32, dir: u8, identity: u32, pc: u64) -> Option<u64> {
    if subject == 0 || subject >= FOLD_MAX_SUBJECT || identity >= FOLD_MAX_IDENTITY {
        return None;
    }
    Some(fold_key_unchecked(subject, dir, identity, pc))
}

/// log2 of the ports of a block class ([`fold_pc_block`]): an aligned
/// block of 64 ports inside one range is one entry.
pub const FOLD_BLOCK_BITS: u32 = 6;
/// First port class of the exact ports.
const PC_EXACT: u64 = 4;
/// First port class of the 64-port blocks.
const PC_BLOCK: u64 = PC_EXACT + 3 * 65_536;
// Every port class fits the 18 bits below the identity.
const _: () = assert!(PC_BLOCK + 3 * (65_536 >> FOLD_BLOCK_BITS) <= 1 << 18);

/// The protocol code of an IP protocol number in a port class: 1 TCP,
/// 2 UDP, 3 SCTP, 0 for any other (only the any-protocol class matches
/// those).
pub const fn proto_code(protocol: u8) -> u64 {
    match protocol {
        crate::proto::TCP => 1,
        crate::proto::UDP => 2,
        crate::proto::SCTP => 3,
        _ => 0,
    }
}

/// Port class of "any protocol".
pub const FOLD_PC_ANY_PROTO: u64 = 0;
/// Port class of "any port of protocol `code`" (`code` 1..=3, see
/// [`proto_code`]).
pub const fn fold_pc_any_port(code: u64) -> u64 {
    code
}
/// Port class of destination port `port` of protocol `code` (1..=3).
pub const fn fold_pc_exact(code: u64, port: u16) -> u64 {
    PC_EXACT + ((code - 1) << 16) + port as u64
}
/// Port class of the aligned 64-port block holding `port` of protocol
/// `code` (1..=3).
pub const fn fold_pc_block(code: u64, port: u16) -> u64 {
    PC_BLOCK + ((code - 1) << (16 - FOLD_BLOCK_BITS)) + (port >> FOLD_BLOCK_BITS) as u64
}

/// [`fold_key`] without the range checks (the datapath checks them once).
#[inline(always)]
pub const fn fold_key_unchecked(subject: u32, dir: u8, identity: u32, pc: u64) -> u64 {
    FOLD_KEY_PRESENT | (subject as u64) << 43 | ((dir & 1) as u64) << 42 | (identity as u64) << 18 | pc
}

/// The value word of the entry of key `key`: its check ([`fold_check`]:
/// the CIDR identity's [`crate::cidr_code`], classes whose CIDR identity
/// has none are not folded, and the key's tag) in bits 32..64 and the
/// decision word in bits 0..32 (the reason in bits 0..8 and, for
/// `Reason::Policy`, the allowing rule's [`crate::rule_slot`] above, as
/// the datapath's policy step returns it).
pub const fn fold_value(key: u64, cidr_code: u64, decision: u32) -> u64 {
    fold_check(fold_hash(key, cidr_code), cidr_code, FOLD_SHIFT) << 32 | decision as u64
}

/// The [`crate::cidr_code`] of a value word.
#[inline(always)]
pub const fn fold_value_cidr(value: u64) -> u64 {
    value >> 56
}

/// Bits of the key tag in a value word (bits 32..56).
pub const FOLD_TAG_BITS: u32 = 24;

/// The multiplicative hash of (key, CIDR code) that both the bucket
/// ([`fold_bucket`]) and the key tag ([`fold_check`]) are taken from.
#[inline(always)]
pub const fn fold_hash(key: u64, cidr_code: u64) -> u64 {
    (key ^ cidr_code.wrapping_mul(0x0100_0000_01b3)).wrapping_mul(0x9e37_79b9_7f4a_7c15)
}

/// What bits 32..64 of the value word of (key, CIDR code) must hold, from
/// their [`fold_hash`] `hash` in a map of `1 << (64 - shift)` buckets:
/// the CIDR code (8 bits) and the key's tag, the [`FOLD_TAG_BITS`] bits of
/// the hash just below the bucket's with the lowest set (a cleared value
/// word, 0, never matches). The datapath takes an entry only when its
/// value carries its key's check: a key read with a value of another key
/// (the slot's previous occupant: arm64 may perform the value's load
/// before the key's, see ARCHITECTURE.md "Shared values without locks on
/// arm64") is not taken unless the two share the bucket, the code and the
/// tag, which user space avoids when the bucket has another free way.
#[inline(always)]
pub const fn fold_check(hash: u64, cidr_code: u64, shift: u32) -> u64 {
    cidr_code << FOLD_TAG_BITS | (hash >> (shift - FOLD_TAG_BITS) & ((1 << FOLD_TAG_BITS) - 1)) | 1
}

/// The bucket of (key, CIDR code) in an `NPM_FOLD` of `1 << (64 - shift)`
/// buckets ([`FOLD_SHIFT`]): the top bits of their [`fold_hash`].
#[inline(always)]
pub const fn fold_bucket(key: u64, cidr_code: u64, shift: u32) -> u32 {
    fold_hash(key, cidr_code).wrapping_shr(shift) as u32
}

/// The right shift of the 64-bit hash that leaves the bucket of
/// `NPM_FOLD`: 64 - log2 of its buckets.
pub const FOLD_SHIFT: u32 = 64 - crate::maps::sizes::FOLD_BUCKETS.trailing_zeros();

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_keep_their_fields_apart() {
        let k = fold_key(FOLD_MAX_SUBJECT - 1, 1, FOLD_MAX_IDENTITY - 1, fold_pc_exact(3, 65535)).unwrap();
        assert_eq!(k >> 43 & (FOLD_MAX_SUBJECT as u64 - 1), FOLD_MAX_SUBJECT as u64 - 1);
        assert_eq!(k >> 42 & 1, 1);
        assert_eq!(k >> 18 & (FOLD_MAX_IDENTITY as u64 - 1), FOLD_MAX_IDENTITY as u64 - 1);
        assert_ne!(k & FOLD_KEY_PRESENT, 0);
        assert_eq!(k >> 62 & 1, 0, "bit 62 stays free");
        assert_eq!(fold_key(0, 0, 5, 0), None);
        assert_eq!(fold_key(FOLD_MAX_SUBJECT, 0, 5, 0), None);
        assert_eq!(fold_key(300, 0, FOLD_MAX_IDENTITY, 0), None);
        assert_ne!(fold_key(300, 0, 5, 0), fold_key(300, 1, 5, 0));
        assert_eq!(crate::cidr_code(0), Some(0));
        assert_eq!(crate::cidr_code(IDENTITY_FIRST_CIDR), Some(1));
        assert_eq!(crate::cidr_code(IDENTITY_FIRST_CIDR + 254), Some(255));
        assert_eq!(crate::cidr_code(IDENTITY_FIRST_CIDR + 255), None);
        assert_eq!(crate::cidr_code(300), None);
        for c in [0, IDENTITY_FIRST_CIDR, IDENTITY_FIRST_CIDR + 254] {
            assert_eq!(crate::cidr_of_code(crate::cidr_code(c).unwrap()), c);
        }
        let v = fold_value(k, 255, 0xdead_beef);
        assert_eq!((fold_value_cidr(v), v as u32), (255, 0xdead_beef));
        assert_eq!(v >> 32, fold_check(fold_hash(k, 255), 255, FOLD_SHIFT));
        assert!(fold_bucket(k, 7, FOLD_SHIFT) < crate::maps::sizes::FOLD_BUCKETS);
        // Port classes never collide.
        assert!(fold_pc_any_port(3) < fold_pc_exact(1, 0));
        assert!(fold_pc_exact(3, u16::MAX) < fold_pc_block(1, 0));
        assert_eq!(fold_pc_block(1, 63), fold_pc_block(1, 0));
        assert_ne!(fold_pc_block(1, 64), fold_pc_block(1, 0));
    }

    /// The datapath's acceptance of a (key, value) pair read from a slot
    /// (`npm-ebpf/src/policy/fold.rs`, `probe`).
    fn taken(key: u64, code: u64, value: u64) -> bool {
        value >> 32 == fold_check(fold_hash(key, code), code, FOLD_SHIFT)
    }

    #[test]
    fn a_key_is_not_paired_with_another_keys_value() {
        // Keys of one bucket and CIDR code (the previous occupants a slot
        // can have for a new key), and the cleared value.
        let code = 3;
        let k = fold_key(300, 0, 5000, fold_pc_exact(1, 443)).unwrap();
        let bucket = fold_bucket(k, code, FOLD_SHIFT);
        assert!(taken(k, code, fold_value(k, code, 7)));
        assert!(!taken(k, code, 0), "a cleared value");
        assert!(!taken(k, code, fold_value(k, 4, 7)), "another CIDR code");
        let mut same_bucket = 0;
        let mut rejected = 0;
        for identity in 256..400_000u32 {
            let other = fold_key(300, 0, identity, fold_pc_exact(1, 443)).unwrap();
            if other == k || fold_bucket(other, code, FOLD_SHIFT) != bucket {
                continue;
            }
            same_bucket += 1;
            if !taken(k, code, fold_value(other, code, 7)) {
                rejected += 1;
            }
        }
        // The code alone (the check before the tag) took them all.
        assert!(same_bucket >= 3, "{same_bucket}");
        assert_eq!(
            rejected, same_bucket,
            "a stale value of another key of the bucket is taken"
        );
        // Cleared, every key's value word is rejected; the tag is never 0.
        for c in [0, 1, 255] {
            assert_ne!(fold_check(0, c, FOLD_SHIFT) & ((1 << FOLD_TAG_BITS) - 1), 0);
        }
    }
}
