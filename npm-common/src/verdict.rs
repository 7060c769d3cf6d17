//! Verdicts: why a packet was allowed or dropped ([`Reason`]), the
//! per-CPU counters (`NPM_COUNTERS`: [`counter_index`] -> [`Counter`], and
//! the lost events at [`EVENTS_LOST_SLOT`]) and the events of the ring
//! buffer `NPM_EVENTS` ([`DenyEvent`]): deny events, and the allow events
//! of new connections of endpoints flagged [`crate::EP_REPORT_NEW`].

use core::mem::{align_of, offset_of, size_of};

/// Why a packet was allowed or dropped.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// Allowed: allowed by a policy entry.
    Policy = 0,
    /// Allowed: the endpoint is not isolated in this direction.
    NotIsolated = 1,
    /// Allowed: part of a tracked connection (established or reply).
    Tracked = 2,
    /// Allowed: ingress from this node.
    Host = 3,
    /// Allowed: not an IP packet.
    NonIp = 4,
    /// Allowed: ICMPv6 neighbour discovery or MLD.
    Icmpv6Control = 5,
    /// Allowed: the interface has no endpoint entry.
    NoEndpoint = 6,
    /// Allowed: an ICMP error whose quoted header belongs to a tracked
    /// connection of the endpoint.
    Related = 7,
    /// Let through undecided by `from_pod`: a new flow of an
    /// egress-isolated endpoint to a Service key, whose egress decision is
    /// deferred to after kube-proxy's DNAT (to `to_pod` of a local backend,
    /// which counts the decision when it denies, or to `node_exit`, which
    /// counts it either way). Not a policy decision: a packet counted here
    /// is not counted as [`Reason::Policy`] by `from_pod`.
    Deferred = 8,
    /// Allowed: an Admin-tier ClusterNetworkPolicy rule with action
    /// `Accept` decided it (final: NetworkPolicy is not consulted).
    AdminAccept = 9,
    /// Allowed: a Baseline-tier ClusterNetworkPolicy rule with action
    /// `Accept` decided it (no Admin rule and no isolating NetworkPolicy did).
    BaselineAccept = 10,
    /// Dropped: no policy entry allows it.
    PolicyDenied = 16,
    /// Dropped: egress with a source that is not the endpoint's address.
    Spoofed = 17,
    /// Dropped: truncated or malformed headers.
    Malformed = 18,
    /// Dropped: non-first fragment without an allowed first fragment.
    Fragment = 19,
    /// Dropped: an Admin-tier ClusterNetworkPolicy rule with action `Deny`
    /// decided it (final).
    AdminDeny = 20,
    /// Dropped: a Baseline-tier ClusterNetworkPolicy rule with action
    /// `Deny` decided it (no Admin rule and no isolating NetworkPolicy did).
    BaselineDeny = 21,
    /// Dropped: a packet of a tracked connection whose endpoint's policy
    /// changed since the connection was decided (connection semantics
    /// `enforce`: the decision epoch moved), decided again by the current
    /// policy and denied: the connection is cut (one such packet per
    /// connection; its conntrack entry is marked `CT_CUT`).
    ConnectionCut = 22,
    /// Dropped: a later packet of a connection cut by
    /// [`Reason::ConnectionCut`], in either direction, until its entry
    /// idles out or a TCP SYN opens a new connection on its 5-tuple.
    CutFlow = 23,
    /// Dropped: the first packet of a new connection of an endpoint that
    /// already holds its share of the conntrack table
    /// (`npm_common::CT_QUOTA`): its flood costs it its own new
    /// connections instead of evicting other endpoints' entries.
    ConntrackQuota = 24,
    /// Dropped: the first packet of a new connection allowed by policy
    /// whose conntrack entry the kernel did not write (the LRU insert
    /// failed: no free node found under churn, or the bucket's lock busy
    /// on this CPU). Passing it would leave a connection nothing tracks:
    /// its replies would be decided as new flows (dropped, and counted as
    /// policy denials, at an isolated endpoint) after the peer did the
    /// work; dropped, the sender retries.
    ConntrackFailed = 25,
}

/// Number of reason slots per direction in `NPM_COUNTERS`.
pub const REASON_SLOTS: u32 = 32;
/// Reasons at or above this value drop the packet.
pub const FIRST_DENY_REASON: u8 = 16;

/// The dry-run signal of `npm-agent explain`: `__sk_buff.ingress_ifindex`
/// (the kernel's `skb->skb_iif`) equal to this value. `BPF_PROG_TEST_RUN`
/// lets the caller set it in `ctx_in`; a real packet never carries it: the
/// kernel sets `skb_iif` only to the ifindex of the device that received
/// the packet (an `int` allocated in `1..=i32::MAX`) or leaves it 0 for a
/// locally generated one, and no BPF program or helper can write it (it
/// is read-only in `__sk_buff`). `mark`, `priority` and `tstamp` can be
/// set by any process or program, and `cb[]` is not zeroed for every
/// packet on the TC path, so none of them could be trusted. The classifier
/// (`npm-ebpf`) tests it; `npm_dataplane::ebpf::explain` sets it.
pub const DRY_RUN_IIF: u32 = u32::MAX;

/// A dry run returns its [`Reason`] in the skb mark (`ctx_out` of
/// `BPF_PROG_TEST_RUN`): this value with the reason in the low byte. A
/// program without dry-run support leaves the mark without it.
pub const DRY_RUN_MARK: u32 = 0x4e50_4d00;

impl Reason {
    /// Every reason, for counters and metrics.
    pub const ALL: [Reason; 21] = [
        Reason::Policy,
        Reason::NotIsolated,
        Reason::Tracked,
        Reason::Host,
        Reason::NonIp,
        Reason::Icmpv6Control,
        Reason::NoEndpoint,
        Reason::Related,
        Reason::Deferred,
        Reason::AdminAccept,
        Reason::BaselineAccept,
        Reason::PolicyDenied,
        Reason::Spoofed,
        Reason::Malformed,
        Reason::Fragment,
        Reason::AdminDeny,
        Reason::BaselineDeny,
        Reason::ConnectionCut,
        Reason::CutFlow,
        Reason::ConntrackQuota,
        Reason::ConntrackFailed,
    ];

    /// True when the reason drops the packet.
    pub const fn is_deny(self) -> bool {
        self as u8 >= FIRST_DENY_REASON
    }

    /// The verdict label of the reason (metrics): `"denied"` for a drop,
    /// `"deferred"` for [`Reason::Deferred`] (passed undecided: its
    /// decision is counted again where it is taken), else `"allowed"`.
    pub const fn verdict(self) -> &'static str {
        if self.is_deny() {
            "denied"
        } else if self as u8 == Reason::Deferred as u8 {
            "deferred"
        } else {
            "allowed"
        }
    }

    /// The reason with this number.
    pub const fn from_u8(v: u8) -> Option<Reason> {
        Some(match v {
            0 => Reason::Policy,
            1 => Reason::NotIsolated,
            2 => Reason::Tracked,
            3 => Reason::Host,
            4 => Reason::NonIp,
            5 => Reason::Icmpv6Control,
            6 => Reason::NoEndpoint,
            7 => Reason::Related,
            8 => Reason::Deferred,
            9 => Reason::AdminAccept,
            10 => Reason::BaselineAccept,
            16 => Reason::PolicyDenied,
            17 => Reason::Spoofed,
            18 => Reason::Malformed,
            19 => Reason::Fragment,
            20 => Reason::AdminDeny,
            21 => Reason::BaselineDeny,
            22 => Reason::ConnectionCut,
            23 => Reason::CutFlow,
            24 => Reason::ConntrackQuota,
            25 => Reason::ConntrackFailed,
            _ => return None,
        })
    }

    /// Stable lower-case name (metrics label, logs).
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Policy => "policy",
            Reason::NotIsolated => "not-isolated",
            Reason::Tracked => "tracked",
            Reason::Host => "host",
            Reason::NonIp => "non-ip",
            Reason::Icmpv6Control => "icmpv6-control",
            Reason::NoEndpoint => "no-endpoint",
            Reason::Related => "related",
            Reason::Deferred => "deferred",
            Reason::PolicyDenied => "policy-denied",
            Reason::Spoofed => "spoofed",
            Reason::Malformed => "malformed",
            Reason::Fragment => "fragment",
            Reason::AdminAccept => "admin-accept",
            Reason::BaselineAccept => "baseline-accept",
            Reason::AdminDeny => "admin-deny",
            Reason::BaselineDeny => "baseline-deny",
            Reason::ConnectionCut => "connection-cut",
            Reason::CutFlow => "cut-flow",
            Reason::ConntrackQuota => "conntrack-quota",
            Reason::ConntrackFailed => "conntrack-failed",
        }
    }
}

/// Index into `NPM_COUNTERS` for a direction and a reason.
#[inline(always)]
pub const fn counter_index(direction: u8, reason: u8) -> u32 {
    (direction as u32) * REASON_SLOTS + (reason as u32 % REASON_SLOTS)
}

/// Number of entries of `NPM_COUNTERS`.
pub const COUNTER_SLOTS: u32 = 2 * REASON_SLOTS;

/// The slot of `NPM_COUNTERS` that counts events (deny or allow) lost because
/// `NPM_EVENTS` was full (its `packets` are the lost events, its `bytes`
/// stay 0): the last slot, whose reason number (31, of the egress half) no
/// [`Reason`] has, so no verdict is ever counted there. The slot existed
/// unused in every layout: older programs leave it 0.
pub const EVENTS_LOST_SLOT: u32 = COUNTER_SLOTS - 1;
const _: () = assert!(Reason::from_u8((EVENTS_LOST_SLOT % REASON_SLOTS) as u8).is_none());
const _: () = assert!(EVENTS_LOST_SLOT < COUNTER_SLOTS);

/// One per-CPU counter slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}
const _: () = assert!(size_of::<Counter>() == 16);
const _: () = assert!(offset_of!(Counter, packets) == 0);
const _: () = assert!(offset_of!(Counter, bytes) == 8);

/// A dropped packet, or the first packet of a new connection allowed for an
/// endpoint flagged [`crate::EP_REPORT_NEW`], sent to user space through
/// `NPM_EVENTS`. The verdict is the reason's: [`DenyEvent::is_allow`]
/// (`reason <` [`FIRST_DENY_REASON`]: `Policy`, `NotIsolated`, `Host`,
/// `AdminAccept`, `BaselineAccept`) for an allow event, else a deny. An
/// allow event is never counted as a drop: the counters count verdicts in
/// the datapath, not events.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DenyEvent {
    /// Monotonic time (ns).
    pub ts_ns: u64,
    /// Endpoint id.
    pub endpoint: u32,
    /// Host-side ifindex.
    pub ifindex: u32,
    /// `DIR_*`.
    pub direction: u8,
    /// [`Reason`] as a number.
    pub reason: u8,
    /// Protocol number.
    pub protocol: u8,
    /// 4 or 6.
    pub family: u8,
    /// Source port (0 when not known).
    pub sport: u16,
    /// Destination port (0 when not known).
    pub dport: u16,
    /// Source address (IPv4-mapped for IPv4).
    pub src: [u8; 16],
    /// Destination address (IPv4-mapped for IPv4).
    pub dst: [u8; 16],
}
impl DenyEvent {
    /// True for an allow event (a new connection allowed), false for a drop.
    pub const fn is_allow(&self) -> bool {
        self.reason < FIRST_DENY_REASON
    }
}

// The datapath writes an event as 64- and 32-bit words: the time, endpoint,
// ifindex, the four bytes direction..family, the two ports, the addresses.
const _: () = assert!(size_of::<DenyEvent>() == 56);
const _: () = assert!(align_of::<DenyEvent>() == 8);
const _: () = assert!(offset_of!(DenyEvent, ts_ns) == 0);
const _: () = assert!(offset_of!(DenyEvent, endpoint) == 8);
const _: () = assert!(offset_of!(DenyEvent, ifindex) == 12);
const _: () = assert!(offset_of!(DenyEvent, direction) == 16);
const _: () = assert!(offset_of!(DenyEvent, reason) == 17);
const _: () = assert!(offset_of!(DenyEvent, protocol) == 18);
const _: () = assert!(offset_of!(DenyEvent, family) == 19);
const _: () = assert!(offset_of!(DenyEvent, sport) == 20);
const _: () = assert!(offset_of!(DenyEvent, dport) == 22);
const _: () = assert!(offset_of!(DenyEvent, src) == 24);
const _: () = assert!(offset_of!(DenyEvent, dst) == 40);

#[cfg(feature = "user")]
mod pod_impls {
    use super::*;
    // SAFETY: repr(C), only integers and byte arrays, no padding (asserted
    // above), any bit pattern is valid.
    unsafe impl aya::Pod for Counter {}
    // SAFETY: as above.
    unsafe impl aya::Pod for DenyEvent {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use crate::DIR_EGRESS;

    #[test]
    fn reasons_round_trip() {
        for r in Reason::ALL {
            assert_eq!(Reason::from_u8(r as u8), Some(r));
            assert!(counter_index(DIR_EGRESS, r as u8) < COUNTER_SLOTS);
        }
        assert!(Reason::Spoofed.is_deny());
        assert!(!Reason::Tracked.is_deny());
        assert!(!Reason::Deferred.is_deny());
        assert_eq!(Reason::Deferred.name(), "deferred");
        assert_eq!(Reason::Deferred.verdict(), "deferred");
        assert_eq!(Reason::Policy.verdict(), "allowed");
        assert_eq!(Reason::PolicyDenied.verdict(), "denied");
        assert_ne!(counter_index(DIR_EGRESS, Reason::Deferred as u8), EVENTS_LOST_SLOT);
        let allow = DenyEvent {
            reason: Reason::Policy as u8,
            ..DenyEvent::default()
        };
        assert!(allow.is_allow());
        let deny = DenyEvent {
            reason: Reason::PolicyDenied as u8,
            ..DenyEvent::default()
        };
        assert!(!deny.is_allow());
    }
}
