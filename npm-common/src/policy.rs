//! `NPM_POLICY` (the LPM trie of allows: [`PolicyKey`] -> [`PolicyValue`])
//! and the per-rule counters of the allows it decides.

use core::mem::{offset_of, size_of};

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
/// The slot of an allow whose rule the datapath could not tell (a folded
/// decision whose rule user space could not name, or a `Policy` allow
/// whose rule tag is missing).
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
    use crate::packet::{proto, DIR_EGRESS, DIR_INGRESS};

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
}
