//! Services: `NPM_SERVICES` (the ClusterIP and NodePort keys kube-proxy
//! may DNAT), the deferral of an egress-isolated endpoint's decision past
//! the DNAT ([`defer`]: the deferral bit of `npm_common::service` and the
//! flow's source in `NPM_DEFER_SRC`), and the deferred decision itself
//! ([`deferred_egress`]), taken by `to_pod` of a local backend, by
//! `node_exit` for a backend beyond the node, and by `host_in`
//! ([`deferred_egress_l3`]) for a backend on the node's own host network,
//! each under the endpoint that sent the packet ([`deferred_sender`]: the
//! mark carries no endpoint).
//!
//! The deferral runs only for a packet that steps 1 to 6 left to policy
//! (no established flow) from an endpoint whose egress is isolated or has a
//! ClusterNetworkPolicy tier (`EP_ADMIN_EGRESS`, `EP_BASELINE_EGRESS`: the
//! tiers decide against the backend too), to a port-carrying protocol: one extra hash lookup for such a packet, none
//! for any other.

use aya_ebpf::{
    macros::map,
    maps::{HashMap, LruHashMap},
    programs::TcContext,
};
use npm_common::{
    defer_mark, proto, sizes, CtKey, Reason, ServiceValue, CT_PENDING, DIR_EGRESS, EP_ISOLATED_EGRESS, EP_TIERS_INGRESS,
};

use crate::conntrack::{ct4_words, ct_create, CtPacket, CT_FAILED};
use crate::endpoint::endpoint_slot;
use crate::mem::{rd32, V4_MAPPED_WORD};
use crate::parse::{clear_fields, parse, parse_at, Skb, FRAG_LATER};
use crate::policy::{policy_step, Peer};
use crate::scratch::Scratch;
use crate::verdict::Seen;

/// `NPM_SERVICES`: `npm_common::ServiceKey` (as its five words: the
/// address, then the port and the protocol) -> flags.
#[map]
static NPM_SERVICES: HashMap<[u32; 5], ServiceValue> = HashMap::with_max_entries(sizes::SERVICES, 0);

/// `NPM_DEFER_SRC`: `npm_common::DeferSourceKey` (the source address, then
/// the source port and the protocol, as five words) of a deferred flow ->
/// the sender's host-side ifindex.
#[map]
static NPM_DEFER_SRC: LruHashMap<[u32; 5], u32> = LruHashMap::with_max_entries(sizes::DEFER_SOURCES, 0);

/// Whether endpoint `ep_flags`' new flow of protocol `pr` to `dport` at
/// the IPv4 address `daddr` (as loaded) is deferred: an isolated egress (or
/// one with a tier flag), an endpoint in the slot array, and a key of `NPM_SERVICES`.
#[inline(always)]
pub(crate) fn deferred_v4(ep_flags: u32, ifindex: u32, pr: u8, daddr: u32, dport: u16) -> bool {
    if ep_flags & (EP_ISOLATED_EGRESS | EP_TIERS_INGRESS << DIR_EGRESS) == 0
        || ifindex >= sizes::ENDPOINT_SLOTS
        || !has_ports(pr)
    {
        return false;
    }
    let key = [0, 0, V4_MAPPED_WORD, daddr, dport as u32 | (pr as u32) << 16];
    // SAFETY: the value is not read.
    unsafe { NPM_SERVICES.get(&key) }.is_some()
}

/// [`deferred_v4`] for a 16-byte (IPv4-mapped or IPv6) destination at `dst`.
#[inline(always)]
pub(crate) fn deferred(ep_flags: u32, ifindex: u32, pr: u8, dst: *const u8, dport: u16) -> bool {
    if ep_flags & (EP_ISOLATED_EGRESS | EP_TIERS_INGRESS << DIR_EGRESS) == 0
        || ifindex >= sizes::ENDPOINT_SLOTS
        || !has_ports(pr)
    {
        return false;
    }
    // SAFETY: a 16-byte, 4-aligned address.
    let key = unsafe {
        [
            rd32(dst),
            rd32(dst.add(4)),
            rd32(dst.add(8)),
            rd32(dst.add(12)),
            dport as u32 | (pr as u32) << 16,
        ]
    };
    // SAFETY: the value is not read.
    unsafe { NPM_SERVICES.get(&key) }.is_some()
}

/// Whether protocol `pr` has ports (Services only have TCP, UDP, SCTP).
#[inline(always)]
fn has_ports(pr: u8) -> bool {
    pr == proto::TCP || pr == proto::UDP || pr == proto::SCTP
}

/// Defers the egress decision of the packet in `ctx` from the endpoint on
/// `ifindex`: sets the deferral bit of the mark, records the flow's source
/// (address, port, protocol) as the endpoint's in `NPM_DEFER_SRC` and
/// writes the pending conntrack entry of the pre-NAT tuple (the key in
/// `s.ct4` when `v4`, else `s.ct`, filled by the caller) so that the
/// un-NATted replies pass the endpoint's `to_pod`. Returns the allow
/// reason of `from_pod`, `Reason::Deferred`: the packet passes undecided,
/// counted apart from the policy decisions (the entry records the same
/// reason).
#[inline(always)]
pub(crate) fn defer(ctx: &TcContext, s: &mut Scratch, ifindex: u32, v4: bool, pkt: CtPacket) -> u8 {
    // SAFETY: the context pointer is valid for the program's lifetime.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(defer_mark(mark));
    // The source side of the canonical key: `lo` (its port in the low
    // half of the ports word) when the packet's source is the lower pair.
    let pr = (pkt.pr as u32) << 16;
    let key = if v4 {
        let k = ct4_words(&s.ct4);
        let (a, port) = if pkt.src_is_lo {
            (k[2], k[4] & 0xffff)
        } else {
            (k[3], k[4] >> 16)
        };
        [0, 0, V4_MAPPED_WORD, a, port | pr]
    } else {
        // SAFETY: CtKey layout: addr_lo 8, addr_hi 24, the ports word 40.
        unsafe {
            let k = &s.ct as *const CtKey as *const u8;
            let ports = rd32(k.add(40));
            let (a, port) = if pkt.src_is_lo {
                (k.add(8), ports & 0xffff)
            } else {
                (k.add(24), ports >> 16)
            };
            [rd32(a), rd32(a.add(4)), rd32(a.add(8)), rd32(a.add(12)), port | pr]
        }
    };
    // A dry run (`npm-agent explain`) writes no state.
    if s.pad != crate::DRY_RUN_IIF {
        let _ = NPM_DEFER_SRC.insert(&key, &ifindex, 0);
    }
    // Epoch 0: a pending entry is never decided again (its tuple is the
    // pre-DNAT one).
    // Refused at the endpoint's conntrack quota: no pending entry, so the
    // flow's replies are decided by policy (dropped at an isolated
    // endpoint), never let in untracked. An entry the kernel did not
    // write drops the packet, as for any new flow (`ct_create`).
    match ct_create(s, v4, pkt, DIR_EGRESS, Reason::Deferred as u8, CT_PENDING, 0, ifindex) {
        CT_FAILED => Reason::ConntrackFailed as u8,
        _ => Reason::Deferred as u8,
    }
}

/// The sender's host-side ifindex of the deferred packet parsed in `s.pkt`
/// that entered the node on `iif` (its `ingress_ifindex`): `iif` itself
/// when it is an endpoint's (a routed pod's packet, NATted or not; a
/// bridged pod's frame the bridge forwarded), else the endpoint
/// `NPM_DEFER_SRC` holds for the packet's source (a bridged pod's packet
/// the node routed: `iif` is the bridge), else 0 (no endpoint: the
/// caller denies, or `host_in` leaves the packet to another chain). The
/// mark is never read for it: other owners rewrite its bits.
#[inline(always)]
pub(crate) fn deferred_sender(s: &Scratch, iif: u32) -> u32 {
    if endpoint_slot(iif).is_some() {
        return iif;
    }
    let p = &s.pkt;
    let a = p.src.as_ptr();
    // SAFETY: a 16-byte, 4-aligned address.
    let key = unsafe {
        [
            rd32(a),
            rd32(a.add(4)),
            rd32(a.add(8)),
            rd32(a.add(12)),
            p.sport as u32 | (p.proto as u32) << 16,
        ]
    };
    // SAFETY: a u32 value, read once.
    match unsafe { NPM_DEFER_SRC.get(&key) } {
        Some(i) => *i,
        None => 0,
    }
}

/// The deferred egress decision for the Ethernet frame in `ctx`, after
/// the DNAT, of the packet that entered the node on `iif`: its sender
/// ([`deferred_sender`]), then steps 7 to 9 of that endpoint's egress
/// against the packet's destination (the backend) and port. Returns the
/// reason and the sender's ifindex (0 when none was found: denied, fail
/// closed, never decided under another endpoint; 0 too for a packet that
/// does not parse, `Reason::Malformed`); a non-first
/// fragment is left to the destination's fragment records (its first
/// fragment was decided here). Fills `s.pkt` for the deny event.
#[inline(always)]
pub(crate) fn deferred_egress(ctx: &TcContext, s: &mut Scratch, iif: u32, seen: &mut Seen) -> (u8, u32) {
    clear_fields(&mut s.pkt);
    if parse(ctx, s).is_err() {
        return (Reason::Malformed as u8, 0);
    }
    deferred_policy(s, iif, seen)
}

/// [`deferred_egress`] of a packet that starts at its IP header: the one
/// `host_in` sees at the node's `INPUT` hook, delivered to the node's own
/// host network (a backend there crosses no tc egress hook), and the one
/// `node_exit_l3` sees on a device without an Ethernet header (IPIP,
/// WireGuard, GRE, TUN: the inner packet, before the encapsulation).
#[inline(always)]
pub(crate) fn deferred_egress_l3(ctx: &impl Skb, s: &mut Scratch, iif: u32, seen: &mut Seen) -> (u8, u32) {
    clear_fields(&mut s.pkt);
    if parse_at::<0>(ctx, s).is_err() {
        return (Reason::Malformed as u8, 0);
    }
    deferred_policy(s, iif, seen)
}

/// The sender of the parsed `s.pkt` and steps 7 to 9 of its egress (the
/// common tail of the deferred decisions).
#[inline(always)]
fn deferred_policy(s: &mut Scratch, iif: u32, seen: &mut Seen) -> (u8, u32) {
    let src = deferred_sender(s, iif);
    let ep = match endpoint_slot(src) {
        Some(ep) => ep,
        None => return (Reason::PolicyDenied as u8, 0),
    };
    seen.ep_id = ep.id;
    let p = &s.pkt;
    if p.frag == FRAG_LATER {
        return (Reason::Policy as u8, src);
    }
    // Only TCP, UDP and SCTP flows are deferred: a marked packet of any
    // other protocol is an encapsulation's outer header (IPIP, GRE, ...,
    // whose device had no decision point) and never decided on it.
    if !has_ports(p.proto) {
        return (Reason::PolicyDenied as u8, src);
    }
    let port = p.dport;
    let peer = Peer {
        at: p.dst.as_ptr(),
        lazy_v4: false,
        v4addr: 0,
    };
    (
        policy_step(s.lpm.as_mut_ptr() as *mut u8, ep, DIR_EGRESS, p.proto, port, peer),
        src,
    )
}
