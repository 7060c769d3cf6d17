//! Conntrack (`NPM_CT`: [`CtKey`], `NPM_CT4`: [`CtKey4`], both to
//! [`CtValue`]; the `CT_*` flags and timeouts) and the fragment records
//! (`NPM_FRAGS`: [`FragKey`] -> [`FragValue`]).

use core::mem::{align_of, offset_of, size_of};

use crate::ipcache::V4_MAPPED_PREFIX;

/// Conntrack key: one connection as seen by one endpoint, canonical so that
/// both directions of the connection give the same key (the lower
/// (address, port) pair first).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtKey {
    /// Endpoint id that tracks the connection.
    pub endpoint: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Reserved, zero.
    pub pad: [u8; 3],
    /// Lower address of the pair.
    pub addr_lo: [u8; 16],
    /// Higher address of the pair.
    pub addr_hi: [u8; 16],
    /// Port that goes with `addr_lo` (ICMP echo: the echo id).
    pub port_lo: u16,
    /// Port that goes with `addr_hi` (ICMP echo: the echo id).
    pub port_hi: u16,
}
// The datapath writes the key as 32-bit words: endpoint, protocol and pad,
// the addresses, the two ports.
const _: () = assert!(size_of::<CtKey>() == 44);
const _: () = assert!(align_of::<CtKey>() == 4);
const _: () = assert!(offset_of!(CtKey, endpoint) == 0);
const _: () = assert!(offset_of!(CtKey, protocol) == 4);
const _: () = assert!(offset_of!(CtKey, pad) == 5);
const _: () = assert!(offset_of!(CtKey, addr_lo) == 8);
const _: () = assert!(offset_of!(CtKey, addr_hi) == 24);
const _: () = assert!(offset_of!(CtKey, port_lo) == 40);
const _: () = assert!(offset_of!(CtKey, port_hi) == 42);

/// The `NPM_CT4` key: a [`CtKey`] whose two addresses are IPv4-mapped,
/// stored as their last 4 bytes. Same canonical order as [`CtKey`] (for
/// IPv4-mapped addresses, comparing the last 4 bytes is comparing all 16).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtKey4 {
    /// Endpoint id that tracks the connection.
    pub endpoint: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Reserved, zero.
    pub pad: [u8; 3],
    /// Lower IPv4 address of the pair.
    pub addr_lo: [u8; 4],
    /// Higher IPv4 address of the pair.
    pub addr_hi: [u8; 4],
    /// Port that goes with `addr_lo` (ICMP echo: the echo id).
    pub port_lo: u16,
    /// Port that goes with `addr_hi` (ICMP echo: the echo id).
    pub port_hi: u16,
}
// The datapath reads and writes the key as five 4-aligned 32-bit words
// (also the key of its flow cache).
const _: () = assert!(size_of::<CtKey4>() == 20);
const _: () = assert!(align_of::<CtKey4>() == 4);
const _: () = assert!(offset_of!(CtKey4, endpoint) == 0);
const _: () = assert!(offset_of!(CtKey4, protocol) == 4);
const _: () = assert!(offset_of!(CtKey4, pad) == 5);
const _: () = assert!(offset_of!(CtKey4, addr_lo) == 8);
const _: () = assert!(offset_of!(CtKey4, addr_hi) == 12);
const _: () = assert!(offset_of!(CtKey4, port_lo) == 16);
const _: () = assert!(offset_of!(CtKey4, port_hi) == 18);

impl CtKey4 {
    /// The equivalent [`CtKey`] (IPv4-mapped addresses).
    pub fn to_key(&self) -> CtKey {
        let map = |a: [u8; 4]| {
            let mut m = [0u8; 16];
            m[..12].copy_from_slice(&V4_MAPPED_PREFIX);
            m[12..].copy_from_slice(&a);
            m
        };
        CtKey {
            endpoint: self.endpoint,
            protocol: self.protocol,
            pad: self.pad,
            addr_lo: map(self.addr_lo),
            addr_hi: map(self.addr_hi),
            port_lo: self.port_lo,
            port_hi: self.port_hi,
        }
    }
}

impl CtKey {
    /// The `NPM_CT4` form of this key, when both addresses are IPv4-mapped.
    pub fn to_v4(&self) -> Option<CtKey4> {
        let v4 = |a: &[u8; 16]| (a[..12] == V4_MAPPED_PREFIX).then(|| [a[12], a[13], a[14], a[15]]);
        Some(CtKey4 {
            endpoint: self.endpoint,
            protocol: self.protocol,
            pad: self.pad,
            addr_lo: v4(&self.addr_lo)?,
            addr_hi: v4(&self.addr_hi)?,
            port_lo: self.port_lo,
            port_hi: self.port_hi,
        })
    }
}

/// [`CtValue::flags`]: the connection was opened from `addr_lo` to `addr_hi`.
pub const CT_ORIG_LO_TO_HI: u8 = 1 << 0;
/// [`CtValue::flags`]: a TCP FIN or RST was seen: the flow is no longer an
/// established one (the flow cache leaves it to the conntrack lookup). It
/// takes the short [`CT_TIMEOUT_TCP_CLOSING_NS`] once both sides sent a FIN
/// or a RST was seen; a half-closed flow (a FIN from one side only) keeps
/// its timeout (see [`ct_timeout_ns`]).
pub const CT_CLOSING: u8 = 1 << 1;
/// [`CtValue::flags`]: a packet of the reply direction was seen.
pub const CT_SEEN_REPLY: u8 = 1 << 2;
/// [`CtValue::flags`]: the `addr_lo` side of the key sent a TCP FIN.
pub const CT_FIN_LO: u8 = 1 << 3;
/// [`CtValue::flags`]: the `addr_hi` side of the key sent a TCP FIN.
pub const CT_FIN_HI: u8 = 1 << 4;
/// [`CtValue::flags`]: a TCP RST was seen.
pub const CT_RST: u8 = 1 << 5;
/// [`CtValue::flags`]: a *pending* entry: the flow goes to a Service
/// (`NPM_SERVICES`) and its egress decision was deferred past the DNAT
/// (`npm_common::service`). Until a reply is seen ([`CT_SEEN_REPLY`])
/// the entry only lets replies in: a packet of the original direction
/// is deferred again, never `Tracked`; it idles out after
/// [`CT_TIMEOUT_PENDING_NS`]. The first reply confirms it (the backend
/// answered, so the deferred decision allowed the flow).
pub const CT_PENDING: u8 = 1 << 6;
/// [`CtValue::flags`]: the connection was *cut*: decided again after its
/// endpoint's policy changed (connection semantics `enforce`)
/// and denied. Every later packet of its 5-tuple, in either direction, is
/// dropped (`Reason::CutFlow`) until the entry idles out (each dropped
/// packet refreshes it, so a side that keeps trying keeps it cut) or a
/// TCP SYN opens a new connection on the tuple (decided by policy). The
/// entry stays rather than going: without it, the first packet of the
/// other side (whose own policy may allow it) would open the connection
/// again as a new one in its direction, and the cut side's packets would
/// pass as its replies. Added with layout 7 (same rule: a bit no older
/// program sets; an older one reads the entry as tracked, `keep`).
pub const CT_CUT: u8 = 1 << 7;

/// Conntrack value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CtValue {
    /// Monotonic time (ns) of the last packet.
    pub last_seen_ns: u64,
    /// Monotonic time (ns) the entry was created.
    pub created_ns: u64,
    /// Direction (from the endpoint) of the packet that opened the connection.
    pub origin_direction: u8,
    /// `CT_*` flags.
    pub flags: u8,
    /// Verdict reason that opened the connection.
    pub reason: u8,
    /// Reserved, zero.
    pub pad: u8,
    /// The decision epoch of the tracking endpoint (its `NPM_EP_EPOCH`
    /// slot, [`crate::ep_epoch_slot`]) when the connection was last
    /// decided: read before the policy lookup that created the entry (or
    /// decided it again). A tracked packet that finds the endpoint's epoch
    /// moved is decided again once by the current policy (connection
    /// semantics `enforce`): allowed, the entry takes the
    /// current epoch; denied, the packet is dropped
    /// ([`crate::Reason::ConnectionCut`]) and the entry marked [`CT_CUT`]. A pending
    /// Service entry ([`CT_PENDING`]) is never decided again (its tuple is
    /// the pre-DNAT one). The entries a layout-6 program wrote have 0 here
    /// (their reserved bytes), as does every epoch a loader never moved.
    pub epoch: u32,
}
// The datapath writes a new value as two 64-bit and two 32-bit words
// (the second one is the epoch).
const _: () = assert!(size_of::<CtValue>() == 24);
const _: () = assert!(align_of::<CtValue>() == 8);
const _: () = assert!(offset_of!(CtValue, last_seen_ns) == 0);
const _: () = assert!(offset_of!(CtValue, created_ns) == 8);
const _: () = assert!(offset_of!(CtValue, origin_direction) == 16);
const _: () = assert!(offset_of!(CtValue, flags) == 17);
const _: () = assert!(offset_of!(CtValue, reason) == 18);
const _: () = assert!(offset_of!(CtValue, pad) == 19);
const _: () = assert!(offset_of!(CtValue, epoch) == 20);

/// Idle timeout of a TCP connection that has not seen a reply (ns).
pub const CT_TIMEOUT_TCP_SYN_NS: u64 = 60 * 1_000_000_000;
/// Idle timeout of an established TCP connection (ns).
pub const CT_TIMEOUT_TCP_NS: u64 = 6 * 3600 * 1_000_000_000;
/// Idle timeout of a TCP connection after FIN or RST (ns).
pub const CT_TIMEOUT_TCP_CLOSING_NS: u64 = 10 * 1_000_000_000;
/// Idle timeout of a pending entry ([`CT_PENDING`]) without a reply (ns):
/// each deferred packet of the flow writes it afresh.
pub const CT_TIMEOUT_PENDING_NS: u64 = 10 * 1_000_000_000;
/// Idle timeout of UDP, SCTP, ICMP and other flows (ns).
pub const CT_TIMEOUT_OTHER_NS: u64 = 120 * 1_000_000_000;

/// The idle timeout (ns) of a conntrack entry of protocol `protocol` whose
/// [`CtValue::flags`] are `flags`. A TCP flow is closing, with
/// [`CT_TIMEOUT_TCP_CLOSING_NS`], once both sides sent a FIN or a RST was
/// seen (or [`CT_CLOSING`] is set without the side bits, as layouts before
/// the side bits wrote it); a half-closed flow (one side sent a FIN, the
/// other may still send for as long as it likes) keeps the timeout of an
/// established flow ([`CT_TIMEOUT_TCP_NS`]), or of an unanswered one
/// ([`CT_TIMEOUT_TCP_SYN_NS`]) before a reply was seen.
#[inline(always)]
pub const fn ct_timeout_ns(protocol: u8, flags: u8) -> u64 {
    if flags & (CT_PENDING | CT_SEEN_REPLY) == CT_PENDING {
        return CT_TIMEOUT_PENDING_NS;
    }
    if protocol != crate::proto::TCP {
        return CT_TIMEOUT_OTHER_NS;
    }
    let ends = flags & (CT_FIN_LO | CT_FIN_HI | CT_RST);
    let half_closed = ends == CT_FIN_LO || ends == CT_FIN_HI;
    if flags & CT_CLOSING != 0 && !half_closed {
        CT_TIMEOUT_TCP_CLOSING_NS
    } else if flags & CT_SEEN_REPLY == 0 {
        CT_TIMEOUT_TCP_SYN_NS
    } else {
        CT_TIMEOUT_TCP_NS
    }
}

/// The default share of each conntrack map (`NPM_CT`, `NPM_CT4`) one
/// endpoint may hold while that map is under pressure
/// (`--conntrack-quota-share`): an endpoint holding more than
/// `max_entries / share` live entries has its new connections refused
/// (`Reason::ConntrackQuota`) while the map's fill ([`CT_FILL_ENTRIES`])
/// is at or above its pressure threshold ([`CT_FILL_PRESSURE`]), so one
/// pod's flood of flows cannot evict the entries of other pods (the maps
/// are LRU: a full map evicts whoever's least recently used entry). Below
/// the threshold no endpoint is capped. The loader sets the endpoint
/// programs' cap (`NPM_CT_CAP`) from the map size and the configured
/// share; the object's own value (what `node_exit` and `host_in`, loaded
/// beside the pins, keep) is the default map size over this share.
///
/// Why an eighth (32,768 entries of the default 262,144): since the cap
/// applies only above the pressure threshold (at most three quarters of
/// the map), the last quarter, where the LRU starts evicting, is reached
/// only by endpoints within their cap, and with an eighth it takes two of
/// them adding a full share each; with a quarter one endpoint alone could
/// fill it. An endpoint holding more than an eighth is the one refused
/// while the map is under pressure.
pub const CT_QUOTA_SHARE_DEFAULT: u32 = 8;

/// `NPM_CT_FILL` words per conntrack map: [`CT_FILL_ENTRIES`],
/// [`CT_FILL_PRESSURE`], [`CT_FILL_CAP`] and a reserved word; `NPM_CT`'s
/// words come first ([`CT_FILL_CT`]), then `NPM_CT4`'s ([`CT_FILL_CT4`]).
pub const CT_FILL_WORDS: u32 = 4;
/// `NPM_CT_FILL`: the first word of `NPM_CT`'s.
pub const CT_FILL_CT: u32 = 0;
/// `NPM_CT_FILL`: the first word of `NPM_CT4`'s.
pub const CT_FILL_CT4: u32 = CT_FILL_WORDS;
/// `NPM_CT_FILL` word (of a map's words): an approximation from above of
/// the map's entries. The datapath adds one per entry it writes (nothing
/// in BPF sees an LRU eviction, and an insert replacing an entry of the
/// same key counts too), the loader's conntrack worker moves it to the
/// entries its pass left (deleting the idled-out ones), both with atomic
/// adds through a shared mapping. It follows a flood at once, where the
/// worker's passes are seconds apart.
pub const CT_FILL_ENTRIES: u32 = 0;
/// `NPM_CT_FILL` word (of a map's words): the pressure threshold, written
/// by the loader from the map's size (`npm_dataplane`'s
/// `pressure_threshold`): while [`CT_FILL_ENTRIES`] is at or above it
/// the per-endpoint cap applies. 0 (a map no loader configured yet):
/// always under pressure, the cap always applies.
pub const CT_FILL_PRESSURE: u32 = 1;
/// `NPM_CT_FILL` word (of a map's words): the `NPM_CT_CAP` the endpoint
/// programs were loaded with (`u32::MAX`: no quota), written by their
/// loader for the programs loaded beside the pins (`node_exit`,
/// `host_in`), whose loader sets their `NPM_CT_CAP` from it; 0: none
/// written (they keep the object's default). Not read by the datapath.
pub const CT_FILL_CAP: u32 = 2;
/// `NPM_CT_FILL` entries.
pub const CT_FILL_LEN: u32 = 2 * CT_FILL_WORDS;

/// `NPM_CT_QUOTA` words per slot: [`CT_QUOTA_HELD`] and
/// [`CT_QUOTA_REFUSED`].
pub const CT_QUOTA_WORDS: u32 = 2;
/// `NPM_CT_QUOTA` word: an upper bound of the live conntrack entries of
/// the endpoints of the slot (`npm_common::ep_epoch_slot` of the
/// host-side ifindex): the datapath adds one per entry it creates, the
/// loader's conntrack worker takes away what its last pass did not find
/// alive (both with atomic adds, through a shared mapping).
pub const CT_QUOTA_HELD: u32 = 0;
/// `NPM_CT_QUOTA` word: the new connections refused to the slot's
/// endpoints because [`CT_QUOTA_HELD`] reached the cap (a running total).
pub const CT_QUOTA_REFUSED: u32 = 1;

/// Fragment record key: an allowed first fragment, per endpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragKey {
    /// Endpoint id.
    pub endpoint: u32,
    /// IPv4 identification or IPv6 fragment identification.
    pub id: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Direction from the endpoint.
    pub direction: u8,
    /// Reserved, zero.
    pub pad: [u8; 2],
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
}
// The datapath writes the key as 32-bit words.
const _: () = assert!(size_of::<FragKey>() == 44);
const _: () = assert!(align_of::<FragKey>() == 4);
const _: () = assert!(offset_of!(FragKey, endpoint) == 0);
const _: () = assert!(offset_of!(FragKey, id) == 4);
const _: () = assert!(offset_of!(FragKey, protocol) == 8);
const _: () = assert!(offset_of!(FragKey, direction) == 9);
const _: () = assert!(offset_of!(FragKey, pad) == 10);
const _: () = assert!(offset_of!(FragKey, src) == 12);
const _: () = assert!(offset_of!(FragKey, dst) == 28);

/// Fragment record value: the first fragment's ports and verdict reason.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FragValue {
    /// Source port of the first fragment.
    pub sport: u16,
    /// Destination port of the first fragment.
    pub dport: u16,
    /// Reason the first fragment was allowed.
    pub reason: u8,
    /// Reserved, zero.
    pub pad: [u8; 3],
}
// The datapath writes a value as two 32-bit words.
const _: () = assert!(size_of::<FragValue>() == 8);
const _: () = assert!(align_of::<FragValue>() == 2);
const _: () = assert!(offset_of!(FragValue, sport) == 0);
const _: () = assert!(offset_of!(FragValue, dport) == 2);
const _: () = assert!(offset_of!(FragValue, reason) == 4);
const _: () = assert!(offset_of!(FragValue, pad) == 5);

#[cfg(feature = "user")]
mod pod_impls {
    use super::*;
    // SAFETY: repr(C), only integers and byte arrays, no padding (asserted
    // above), any bit pattern is valid.
    unsafe impl aya::Pod for CtKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CtKey4 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for CtValue {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FragKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for FragValue {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::proto;

    #[test]
    fn ct_key4_round_trip() {
        let k4 = CtKey4 {
            endpoint: 9,
            protocol: proto::TCP,
            pad: [0; 3],
            addr_lo: [10, 0, 0, 1],
            addr_hi: [10, 0, 0, 2],
            port_lo: 80,
            port_hi: 40000,
        };
        let k = k4.to_key();
        assert_eq!(k.addr_lo[..12], V4_MAPPED_PREFIX);
        assert_eq!(k.addr_hi[12..], [10, 0, 0, 2]);
        assert_eq!(k.to_v4(), Some(k4));
        let mut v6 = k;
        v6.addr_hi[0] = 0xfd;
        assert_eq!(v6.to_v4(), None);
    }

    #[test]
    fn half_closed_flows_keep_their_timeout() {
        let tcp = proto::TCP;
        let est = CT_SEEN_REPLY;
        assert_eq!(ct_timeout_ns(tcp, est), CT_TIMEOUT_TCP_NS);
        assert_eq!(ct_timeout_ns(tcp, 0), CT_TIMEOUT_TCP_SYN_NS);
        // One FIN: half-closed, still established.
        assert_eq!(ct_timeout_ns(tcp, est | CT_CLOSING | CT_FIN_LO), CT_TIMEOUT_TCP_NS);
        assert_eq!(ct_timeout_ns(tcp, est | CT_CLOSING | CT_FIN_HI), CT_TIMEOUT_TCP_NS);
        // Both FINs, a RST, or the closing flag of an older layout: closing.
        let both = est | CT_CLOSING | CT_FIN_LO | CT_FIN_HI;
        assert_eq!(ct_timeout_ns(tcp, both), CT_TIMEOUT_TCP_CLOSING_NS);
        assert_eq!(
            ct_timeout_ns(tcp, est | CT_CLOSING | CT_FIN_LO | CT_RST),
            CT_TIMEOUT_TCP_CLOSING_NS
        );
        assert_eq!(ct_timeout_ns(tcp, est | CT_CLOSING | CT_RST), CT_TIMEOUT_TCP_CLOSING_NS);
        assert_eq!(ct_timeout_ns(tcp, est | CT_CLOSING), CT_TIMEOUT_TCP_CLOSING_NS);
        assert_eq!(ct_timeout_ns(proto::UDP, both), CT_TIMEOUT_OTHER_NS);
    }

    #[test]
    fn pending_entries_are_short_lived_until_a_reply() {
        assert_eq!(ct_timeout_ns(proto::TCP, CT_PENDING), CT_TIMEOUT_PENDING_NS);
        assert_eq!(
            ct_timeout_ns(proto::UDP, CT_PENDING | CT_ORIG_LO_TO_HI),
            CT_TIMEOUT_PENDING_NS
        );
        assert_eq!(ct_timeout_ns(proto::TCP, CT_PENDING | CT_SEEN_REPLY), CT_TIMEOUT_TCP_NS);
        assert_eq!(
            ct_timeout_ns(proto::UDP, CT_PENDING | CT_SEEN_REPLY),
            CT_TIMEOUT_OTHER_NS
        );
    }
}
