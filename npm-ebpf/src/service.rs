//! Services: `NPM_SERVICES` (the ClusterIP and NodePort keys kube-proxy
//! may DNAT), the deferral of an egress-isolated endpoint's decision past
//! the DNAT ([`defer`], the mark of `npm_common::service`), and the
//! deferred decision itself ([`deferred_egress`]), taken by `to_pod` of a
//! local backend, by `node_exit` for a backend beyond the node, and by
//! `host_in` ([`deferred_egress_l3`]) for a backend on the node's own host
//! network.
//!
//! The deferral runs only for a packet that steps 1 to 6 left to policy
//! (no established flow) from an endpoint whose egress is isolated or has a
//! ClusterNetworkPolicy tier (`EP_ADMIN_EGRESS`, `EP_BASELINE_EGRESS`: the
//! tiers decide against the backend too), to a port-carrying protocol: one extra hash lookup for such a packet, none
//! for any other.

use aya_ebpf::{macros::map, maps::HashMap, programs::TcContext};
use npm_common::{
    defer_mark, proto, sizes, EndpointInfo, Reason, ServiceValue, CT_PENDING, DIR_EGRESS, EP_ISOLATED_EGRESS,
    EP_TIERS_INGRESS,
};

use crate::conntrack::{ct_create, CtPacket};
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
/// `ifindex`: sets the deferral mark and writes the pending conntrack
/// entry of the pre-NAT tuple (the key in `s.ct4` when `v4`, else `s.ct`,
/// filled by the caller) so that the un-NATted replies pass the
/// endpoint's `to_pod`. Returns the allow reason of `from_pod`,
/// `Reason::Deferred`: the packet passes undecided, counted apart from the
/// policy decisions (the entry records the same reason).
#[inline(always)]
pub(crate) fn defer(ctx: &TcContext, s: &mut Scratch, ifindex: u32, v4: bool, pkt: CtPacket) -> u8 {
    // SAFETY: the context pointer is valid for the program's lifetime.
    let mark = unsafe { (*ctx.skb.skb).mark };
    ctx.set_mark(defer_mark(mark, ifindex));
    // Epoch 0: a pending entry is never decided again (its tuple is the
    // pre-DNAT one).
    // Refused at the endpoint's conntrack quota: no pending entry, so the
    // flow's replies are decided by policy (dropped at an isolated
    // endpoint), never let in untracked.
    ct_create(s, v4, pkt, DIR_EGRESS, Reason::Deferred as u8, CT_PENDING, 0, ifindex);
    Reason::Deferred as u8
}

/// The deferred egress decision of the endpoint on `src_ifindex` for the
/// Ethernet frame in `ctx`, after the DNAT: steps 7 to 9 of the endpoint's
/// egress against the packet's destination (the backend) and port. A
/// source endpoint gone since the deferral denies (fail closed); a
/// non-first fragment is left to the destination's fragment records (its
/// first fragment was decided here). Fills `s.pkt` for the deny event.
#[inline(always)]
pub(crate) fn deferred_egress(ctx: &TcContext, s: &mut Scratch, src_ifindex: u32, seen: &mut Seen) -> u8 {
    let ep = match endpoint_slot(src_ifindex) {
        Some(ep) => ep,
        None => return Reason::PolicyDenied as u8,
    };
    seen.ep_id = ep.id;
    clear_fields(&mut s.pkt);
    if parse(ctx, s).is_err() {
        return Reason::Malformed as u8;
    }
    deferred_policy(s, ep)
}

/// [`deferred_egress`] of a packet that starts at its IP header: the one
/// `host_in` sees at the node's `INPUT` hook, delivered to the node's own
/// host network (a backend there crosses no tc egress hook), and the one
/// `node_exit_l3` sees on a device without an Ethernet header (IPIP,
/// WireGuard, GRE, TUN: the inner packet, before the encapsulation).
#[inline(always)]
pub(crate) fn deferred_egress_l3(ctx: &impl Skb, s: &mut Scratch, src_ifindex: u32, seen: &mut Seen) -> u8 {
    let ep = match endpoint_slot(src_ifindex) {
        Some(ep) => ep,
        None => return Reason::PolicyDenied as u8,
    };
    seen.ep_id = ep.id;
    clear_fields(&mut s.pkt);
    if parse_at::<0>(ctx, s).is_err() {
        return Reason::Malformed as u8;
    }
    deferred_policy(s, ep)
}

/// Steps 7 to 9 of endpoint `ep`'s egress for the parsed `s.pkt` (the
/// common tail of the deferred decisions).
#[inline(always)]
fn deferred_policy(s: &mut Scratch, ep: &EndpointInfo) -> u8 {
    let p = &s.pkt;
    if p.frag == FRAG_LATER {
        return Reason::Policy as u8;
    }
    // Only TCP, UDP and SCTP flows are deferred: a marked packet of any
    // other protocol is an encapsulation's outer header (IPIP, GRE, ...,
    // whose device had no decision point) and never decided on it.
    if !has_ports(p.proto) {
        return Reason::PolicyDenied as u8;
    }
    let port = p.dport;
    let peer = Peer {
        at: p.dst.as_ptr(),
        lazy_v4: false,
        v4addr: 0,
    };
    policy_step(s.lpm.as_mut_ptr() as *mut u8, ep, DIR_EGRESS, p.proto, port, peer)
}
