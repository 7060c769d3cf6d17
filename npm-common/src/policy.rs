//! `NPM_POLICY` (the LPM trie of allows: [`PolicyKey`] -> [`PolicyValue`])
//! and its front `NPM_POLICY_FRONT` (exact words: [`policy_front_word`] in
//! the buckets of [`policy_front_bucket`]).

use core::mem::{offset_of, size_of};

use crate::maps::sizes;
use crate::packet::{proto, DIR_INGRESS, IDENTITY_ANY, IDENTITY_FIRST_POD};

/// Length of [`PolicyKey::data`] in bytes.
pub const POLICY_KEY_LEN: usize = 12;
/// Prefix length matching subject, direction and peer: any protocol, any port.
pub const POLICY_PREFIX_ANY_PROTO: u32 = 72;
/// Prefix length matching up to the protocol: any port of that protocol.
pub const POLICY_PREFIX_ANY_PORT: u32 = 80;
/// Prefix length of a fully specified key (one port).
pub const POLICY_PREFIX_FULL: u32 = 96;

/// Key of the `NPM_POLICY` LPM trie: `bpf_lpm_trie_key` layout.
///
/// `data` is, in network order: the subject (4 bytes), direction (1),
/// peer identity (4), protocol (1), destination port (2). The subject of an
/// `NPM_POLICY` key is the pod identity of the local endpoints it governs
/// ([`crate::EndpointInfo::subject`]): one set of keys serves every local
/// endpoint of that identity. `NPM_TIERS` uses the same layout, keyed by
/// subject too, with the tier in the direction byte ([`crate::tier_key`],
/// read back with [`PolicyKey::subject`]). A rule without
/// ports is an entry of prefix length [`POLICY_PREFIX_ANY_PROTO`]; a rule
/// with a protocol and no port, [`POLICY_PREFIX_ANY_PORT`]; a port range is
/// split into aligned power-of-two blocks, each an entry of prefix length
/// `80 + (16 - log2(block size))`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    /// Significant bits of `data`.
    pub prefix_len: u32,
    /// See the type's documentation.
    pub data: [u8; POLICY_KEY_LEN],
}
// The datapath writes the key as four 32-bit words: the prefix length, then
// `data` in network order.
const _: () = assert!(size_of::<PolicyKey>() == 16);
const _: () = assert!(offset_of!(PolicyKey, prefix_len) == 0);
const _: () = assert!(offset_of!(PolicyKey, data) == 4);
// `data` bytes: subject 0..4, direction 4, identity 5..9, protocol 9,
// port 10..12 (each big-endian): here the bytes 1 to 12 in order.
const _: () = {
    let k = PolicyKey::new(0x0102_0304, 0x05, 0x0607_0809, 0x0a, 0x0b0c);
    let mut i = 0;
    while i < POLICY_KEY_LEN {
        assert!(k.data[i] == i as u8 + 1);
        i += 1;
    }
};

impl PolicyKey {
    /// The fully specified key the datapath looks up for one packet.
    #[inline(always)]
    pub const fn new(subject: u32, direction: u8, identity: u32, protocol: u8, port: u16) -> Self {
        Self::with_prefix(POLICY_PREFIX_FULL, subject, direction, identity, protocol, port)
    }

    /// A key with an explicit prefix length; bits past the prefix are
    /// zeroed. `subject`: the first word (an `NPM_TIERS` key's endpoint id).
    #[inline(always)]
    pub const fn with_prefix(
        prefix_len: u32,
        subject: u32,
        direction: u8,
        identity: u32,
        protocol: u8,
        port: u16,
    ) -> Self {
        let e = subject.to_be_bytes();
        let i = identity.to_be_bytes();
        let p = port.to_be_bytes();
        let mut data = [
            e[0], e[1], e[2], e[3], direction, i[0], i[1], i[2], i[3], protocol, p[0], p[1],
        ];
        // Zero the bits beyond the prefix so equal rules give equal keys.
        let mut bit = prefix_len as usize;
        while bit < POLICY_KEY_LEN * 8 {
            data[bit / 8] &= !(0x80u8 >> (bit % 8));
            bit += 1;
        }
        PolicyKey { prefix_len, data }
    }

    /// Subject of an `NPM_POLICY` or `NPM_TIERS` key ([`crate::tier_key`]):
    /// the pod identity whose endpoints it governs.
    pub const fn subject(&self) -> u32 {
        u32::from_be_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }
    /// Direction of the key.
    pub const fn direction(&self) -> u8 {
        self.data[4]
    }
    /// Peer identity of the key.
    pub const fn identity(&self) -> u32 {
        u32::from_be_bytes([self.data[5], self.data[6], self.data[7], self.data[8]])
    }
    /// Protocol of the key (meaningless below [`POLICY_PREFIX_ANY_PORT`]).
    pub const fn protocol(&self) -> u8 {
        self.data[9]
    }
    /// First port of the key's range.
    pub const fn port(&self) -> u16 {
        u16::from_be_bytes([self.data[10], self.data[11]])
    }
}

/// Value of a policy entry: which compiled rule produced it (for counters,
/// `inspect` and `explain`). Its presence alone means "allow".
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PolicyValue {
    /// Index of the rule in the compiled rule table.
    pub rule: u32,
    /// Reserved, zero.
    pub flags: u32,
}
const _: () = assert!(size_of::<PolicyValue>() == 8);

/// Subjects (pod identities) below this fit a [`policy_front_word`] (19
/// bits). The entries of a subject at or above it are not put in the
/// front: its endpoints' directions with entries never carry
/// [`crate::EP_FRONT_INGRESS`] / [`crate::EP_FRONT_EGRESS`] and keep the
/// LPM (`NPM_POLICY`), which holds every entry.
pub const POLICY_FRONT_MAX_SUBJECT: u32 = 1 << 19;
/// Peer identities below this fit a [`policy_front_word`] (25 bits: every
/// pod identity and the first 2^24 CIDR identities).
pub const POLICY_FRONT_MAX_IDENTITY: u32 = 1 << 25;

/// The `NPM_POLICY_FRONT` protocol code of an IP protocol number: 1 TCP,
/// 2 UDP, 3 SCTP, 0 for any other (only "any protocol" words match those).
pub const fn policy_front_proto(protocol: u8) -> u64 {
    match protocol {
        proto::TCP => 1,
        proto::UDP => 2,
        proto::SCTP => 3,
        _ => 0,
    }
}

/// One `NPM_POLICY_FRONT` word: an allow of subject `subject` (a pod
/// identity, [`crate::EndpointInfo::subject`]) in direction `dir` for peer
/// `identity` and
/// - `code` 0: any protocol, any port (`exact` false, `port` 0);
/// - `code` 1..=3 ([`policy_front_proto`]) with `exact` false: any port of
///   that protocol (`port` 0);
/// - `code` 1..=3 with `exact` true: that destination port.
///
/// Bits 0..16 the port, 16 exact, 17..19 the protocol code, 19..44 the
/// identity, 44 the direction, 45..64 the subject. Subjects are pod
/// identities (`>=` [`crate::IDENTITY_FIRST_POD`], never 0), so no word is
/// 0 (an empty slot). The caller checks the ranges
/// ([`POLICY_FRONT_MAX_SUBJECT`], [`POLICY_FRONT_MAX_IDENTITY`]).
pub const fn policy_front_word(subject: u32, dir: u8, identity: u32, code: u64, exact: bool, port: u16) -> u64 {
    port as u64
        | (exact as u64) << 16
        | code << 17
        | (identity as u64) << 19
        | ((dir & 1) as u64) << 44
        | (subject as u64) << 45
}
// The datapath reads a bucket as four `u64` words, 0 being an empty slot:
// the smallest word of the first subject (the first pod identity; any
// subject above 0) is not 0.
const _: () = assert!(policy_front_word(IDENTITY_FIRST_POD, DIR_INGRESS, IDENTITY_ANY, 0, false, 0) != 0);

/// The right shift of a front's 64-bit hash that leaves its bucket, for a
/// front of `buckets` buckets (a power of two, at least 2): 64 - log2 of
/// the buckets. The datapath reads it from a load-time constant set from
/// the front's size as loaded (`NPM_POLICY_FRONT_SHIFT`,
/// `NPM_TIER_FRONT_SHIFT`).
pub const fn front_shift(buckets: u32) -> u32 {
    64 - buckets.trailing_zeros()
}

/// The shift of the default policy front ([`sizes::POLICY_FRONT_BUCKETS`]).
pub const POLICY_FRONT_SHIFT: u32 = front_shift(sizes::POLICY_FRONT_BUCKETS);

/// The bucket of a [`policy_front_word`] in an `NPM_POLICY_FRONT` whose
/// [`front_shift`] is `shift`: the top bits of a multiplicative hash of the
/// whole word. A word is only ever stored in its own bucket (4 slots); a
/// word that finds its bucket full is not stored, and its subject's
/// direction keeps the LPM.
#[inline(always)]
pub const fn policy_front_bucket(word: u64, shift: u32) -> u32 {
    (word.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> shift) as u32
}

/// [`policy_front_bucket`] without the masking of the shift (one
/// instruction less per probe in the datapath, where the shift is a
/// load-time constant LLVM cannot see).
///
/// # Safety
///
/// `shift` is below 64 (a [`front_shift`] of at least 2 buckets).
#[inline(always)]
pub const unsafe fn policy_front_bucket_unchecked(word: u64, shift: u32) -> u32 {
    // SAFETY: the caller's.
    unsafe { word.wrapping_mul(0x9e37_79b9_7f4a_7c15).unchecked_shr(shift) as u32 }
}

/// The `NPM_POLICY_FRONT_RULES` value of rule id `rule`: `rule + 1`, so
/// that 0 ([`POLICY_FRONT_RULE_UNKNOWN`], what a new map holds) is no rule
/// id (rule `u32::MAX` wraps to it: counted as unknown).
pub const fn policy_front_rule(rule: u32) -> u32 {
    rule.wrapping_add(1)
}
/// An `NPM_POLICY_FRONT_RULES` slot whose rule is not known (empty, or
/// its word's rule not written yet): the allow counts at
/// [`RULE_SLOT_UNKNOWN`].
pub const POLICY_FRONT_RULE_UNKNOWN: u32 = 0;

// SAFETY: repr(C), only integers, no padding (asserted above), any bit
// pattern is valid.
#[cfg(feature = "user")]
unsafe impl aya::Pod for PolicyValue {}

/// Rule slots of `NPM_RULE_COUNT` (a power of two): the packets and bytes
/// allowed by rule `r` at a policy decision are counted at
/// [`rule_slot`]`(r)`. Rule ids only grow while the rule table lives, so
/// two live rules share a slot only when their ids are this far apart;
/// user space attributes a slot to the one live rule it belongs to.
pub const RULE_SLOTS: u32 = 8192;
/// The slot of an allow whose rule the datapath could not tell (a policy
/// front word whose `NPM_POLICY_FRONT_RULES` slot was unknown or changed
/// while it was read: a race with the loader, or adopted pins before the
/// first full sync).
pub const RULE_SLOT_UNKNOWN: u32 = RULE_SLOTS;
/// Entries of `NPM_RULE_COUNT`: the rule slots and [`RULE_SLOT_UNKNOWN`].
pub const RULE_COUNT_ENTRIES: u32 = RULE_SLOTS + 1;

/// The `NPM_RULE_COUNT` slot of rule id `rule`.
pub const fn rule_slot(rule: u32) -> u32 {
    rule & (RULE_SLOTS - 1)
}

/// Endpoint slots of `NPM_EP_DENIES` (a power of two): the packets a
/// NetworkPolicy denies (`Reason::PolicyDenied`) to endpoint `e` in
/// direction `d` are counted at [`endpoint_deny_slot`]`(e, d)`. Endpoint
/// ids are never reused, so two live endpoints share a slot only when
/// their ids are this far apart.
pub const DENY_ENDPOINT_SLOTS: u32 = 2048;
/// Entries of `NPM_EP_DENIES`: two directions per endpoint slot.
pub const EP_DENY_ENTRIES: u32 = DENY_ENDPOINT_SLOTS * 2;

/// The `NPM_EP_DENIES` slot of endpoint `endpoint` in direction `dir`.
pub const fn endpoint_deny_slot(endpoint: u32, dir: u8) -> u32 {
    (endpoint & (DENY_ENDPOINT_SLOTS - 1)) << 1 | (dir & 1) as u32
}
const _: () = assert!(RULE_SLOTS.is_power_of_two() && DENY_ENDPOINT_SLOTS.is_power_of_two());
const _: () = assert!(endpoint_deny_slot(u32::MAX, 1) < EP_DENY_ENTRIES);

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::packet::DIR_EGRESS;

    #[test]
    fn policy_key_prefix_zeroes_tail() {
        let k = PolicyKey::with_prefix(POLICY_PREFIX_ANY_PROTO, 7, DIR_EGRESS, 300, proto::TCP, 80);
        assert_eq!(k.subject(), 7);
        assert_eq!(k.subject(), 7);
        assert_eq!(k.direction(), DIR_EGRESS);
        assert_eq!(k.identity(), 300);
        assert_eq!(k.protocol(), 0);
        assert_eq!(k.port(), 0);
        let k = PolicyKey::with_prefix(88, 7, DIR_INGRESS, 1, proto::UDP, 0x12ff);
        assert_eq!(k.protocol(), proto::UDP);
        assert_eq!(k.port(), 0x1200);
    }

    #[test]
    fn policy_front_buckets_follow_the_front_size() {
        let words = [
            policy_front_word(1, DIR_INGRESS, IDENTITY_ANY, 0, false, 0),
            policy_front_word(7, DIR_EGRESS, 300, 1, true, 80),
            policy_front_word(
                POLICY_FRONT_MAX_SUBJECT - 1,
                1,
                POLICY_FRONT_MAX_IDENTITY - 1,
                3,
                true,
                65_535,
            ),
        ];
        assert_eq!(POLICY_FRONT_SHIFT, 48);
        for w in words {
            // The default is today's layout: the top 16 bits of the hash.
            let h = w.wrapping_mul(0x9e37_79b9_7f4a_7c15);
            assert_eq!(policy_front_bucket(w, POLICY_FRONT_SHIFT), (h >> 48) as u32);
            let mut buckets = sizes::POLICY_FRONT_MIN_BUCKETS;
            while buckets <= sizes::FRONT_MAX_BUCKETS {
                let shift = front_shift(buckets);
                assert_eq!(1u64 << (64 - shift), u64::from(buckets));
                assert!(policy_front_bucket(w, shift) < buckets);
                assert_eq!(
                    // SAFETY: shift < 64.
                    unsafe { policy_front_bucket_unchecked(w, shift) },
                    policy_front_bucket(w, shift)
                );
                // A front twice as large splits each bucket in two.
                assert_eq!(policy_front_bucket(w, shift - 1) >> 1, policy_front_bucket(w, shift));
                buckets <<= 1;
            }
        }
    }
}
