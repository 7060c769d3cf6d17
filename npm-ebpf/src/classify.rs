//! The general path: steps 1 to 9 for every packet [`crate::fast_v4::fast_v4`]
//! leaves (IPv6, fragments, options, SCTP, ICMP, non-linear headers, ...).

use aya_ebpf::programs::TcContext;
use npm_common::{
    proto, sizes, CtValue, Reason, DIR_EGRESS, DIR_INGRESS, EP_HAS_V4, EP_HAS_V6, EP_REPORT_NEW, FIRST_DENY_REASON,
};

use crate::conntrack::{
    ct4_words, ct_continue, ct_create, ct_original, ct_redecided, fill_ct_key, fill_ct_key4, CtPacket, CT_CUT_HIT,
    CT_FAILED, CT_REFUSED, CT_STALE, CT_TRACKED, CT_WRITTEN, NPM_CT, NPM_CT4,
};
use crate::endpoint::{endpoint_epoch, endpoint_slot, NPM_ENDPOINTS};
use crate::flow_cache::{
    flow_cache_forget, flow_cache_hit, flow_slot, FlowSlot, NPM_BENCH_NO_FLOW_CACHE, NPM_FLOWCACHE,
};
use crate::fragments::{later_fragment, record_first_fragment};
use crate::icmp_error::{is_icmp_error, related, REL_CUT, REL_PASS, REL_STALE};
use crate::mem::{eq16, is_v4_mapped, rd32, wr32};
use crate::parse::{
    be16, is_icmpv6_control, load, parse, ETH_HLEN, ETH_P_IP, ETH_P_IPV6, FRAG_LATER, FRAG_NONE, TCP_ACK, TCP_FIN,
    TCP_RST, TCP_SYN,
};
use crate::policy::{policy_step, Peer};
use crate::scratch::{coarse_now, Scratch};
use crate::service::{defer, deferred};
use crate::verdict::{report_new, Seen};

/// Steps 1 to 9 of the precedence; returns the reason (a `Reason` number).
#[inline(always)]
pub(crate) fn classify(ctx: &TcContext, dir: u8, ifindex: u32, s: &mut Scratch, seen: &mut Seen) -> u8 {
    // 1. non-IP. A frame too short for an Ethernet header, or a VLAN tag that
    // could hide an IP packet, is malformed rather than non-IP.
    let data = ctx.data();
    let eth_proto = if data + ETH_HLEN <= ctx.data_end() {
        let pk = data as *const u8;
        // SAFETY: bounds checked against data_end just above.
        unsafe { be16(*pk.add(12), *pk.add(13)) }
    } else {
        match load::<2>(ctx, 12, &mut s.hdr) {
            Ok(()) => be16(s.hdr[0], s.hdr[1]),
            Err(()) => 0,
        }
    };
    let known = eth_proto == ETH_P_IP || eth_proto == ETH_P_IPV6;
    let vlan = eth_proto == 0x8100 || eth_proto == 0x88a8;
    if eth_proto != 0 && !known && !vlan {
        return Reason::NonIp as u8;
    }
    // 2. endpoint: an inlined array lookup for the usual small ifindex.
    let ep = if ifindex < sizes::ENDPOINT_SLOTS {
        match endpoint_slot(ifindex) {
            Some(ep) => ep,
            None => return Reason::NoEndpoint as u8,
        }
    } else {
        // SAFETY: the value is only read.
        match unsafe { NPM_ENDPOINTS.get(&ifindex) } {
            Some(ep) => ep,
            None => return Reason::NoEndpoint as u8,
        }
    };
    seen.ep_id = ep.id;
    // The endpoint's decision epoch, read before any policy lookup.
    let epoch = endpoint_epoch(ifindex);
    // 3. headers.
    if !known || parse(ctx, s).is_err() {
        return Reason::Malformed as u8;
    }
    let p = &s.pkt;
    let src = p.src.as_ptr();
    let dst = p.dst.as_ptr();
    // 4. ICMPv6 control (both directions), then source validation.
    if p.family == 6 && p.proto == proto::ICMPV6 && p.frag != FRAG_LATER && is_icmpv6_control(p.icmp_type) {
        return Reason::Icmpv6Control as u8;
    }
    if dir == DIR_EGRESS {
        // SAFETY: 16-byte, 4-aligned fields of scratch and map memory.
        let ok = unsafe {
            if p.family == 4 {
                ep.flags & EP_HAS_V4 != 0 && eq16(src, ep.ipv4.as_ptr())
            } else {
                ep.flags & EP_HAS_V6 != 0 && eq16(src, ep.ipv6.as_ptr())
            }
        };
        if !ok {
            return Reason::Spoofed as u8;
        }
    }
    // 5. non-first fragments.
    if p.frag == FRAG_LATER {
        return later_fragment(s, ep.id, dir);
    }
    // 6. conntrack: an ICMP error of a tracked flow passes as that flow
    // does (dropped when the flow was cut; decided again below, as the
    // flow's own next packet would be, when the flow was decided under an
    // older epoch); otherwise the error itself is looked up (and decided)
    // as any packet.
    let now = coarse_now(&mut s.clk);
    seen.now = now;
    // A tracked flow decided under an older epoch: decided again below.
    let mut stale: *mut CtValue = core::ptr::null_mut();
    let mut quoted_lo = false;
    if is_icmp_error(p) {
        let (rel, v, lo) = related(ctx, s, ep.id, now, epoch);
        if rel == REL_PASS {
            return Reason::Related as u8;
        }
        if rel == REL_CUT {
            return Reason::CutFlow as u8;
        }
        if rel == REL_STALE {
            stale = v;
            quoted_lo = lo;
        }
    }
    // The ICMP error of a stale flow: the flow it quotes is decided again.
    let error_of_stale = !stale.is_null();
    let p = &s.pkt;
    // Flows whose two addresses are IPv4-mapped live in NPM_CT4 (20-byte
    // key), all others in NPM_CT (44 bytes).
    // SAFETY: 16-byte, 4-aligned scratch fields.
    let v4 = p.family == 4 || unsafe { is_v4_mapped(src) && is_v4_mapped(dst) };
    // A packet the flow cache may decide: an IPv4 flow, no fragment (a
    // first fragment must be recorded), no TCP FIN or RST (they change the
    // conntrack entry's state, and clear the flow's slot).
    let closing = p.proto == proto::TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0;
    // SAFETY: reading a read-only global.
    let use_cache = v4 && p.frag == FRAG_NONE && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FLOW_CACHE) } == 0;
    let mut slot: *mut FlowSlot = core::ptr::null_mut();
    // A TCP SYN without ACK opens a new connection: policy decides it, never
    // an older entry of the same 5-tuple, so no lookup (an allowed SYN then
    // writes a fresh entry over any old one).
    let opening = p.proto == proto::TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let (src_is_lo, hit) = if error_of_stale {
        (quoted_lo, None)
    } else if opening {
        let lo = if v4 {
            fill_ct_key4(&mut s.ct4, ep.id, p)
        } else {
            fill_ct_key(&mut s.ct, ep.id, p)
        };
        (lo, None)
    } else if v4 {
        let lo = fill_ct_key4(&mut s.ct4, ep.id, p);
        if use_cache {
            let k = ct4_words(&s.ct4);
            if let Some(sl) = NPM_FLOWCACHE.get_ptr_mut(flow_slot(k)) {
                // SAFETY: this CPU's slot; 4-aligned words.
                unsafe {
                    if closing {
                        flow_cache_forget(sl, k);
                    } else if flow_cache_hit(sl, k, now, epoch) {
                        return Reason::Tracked as u8;
                    } else {
                        slot = sl;
                    }
                }
            }
        }
        (lo, NPM_CT4.get_ptr_mut(&s.ct4))
    } else {
        let lo = fill_ct_key(&mut s.ct, ep.id, p);
        (lo, NPM_CT.get_ptr_mut(&s.ct))
    };
    if let Some(v) = hit {
        let pkt = CtPacket {
            pr: p.proto,
            tcp_flags: p.tcp_flags,
            src_is_lo,
            now,
        };
        match ct_continue(v, pkt, slot, ct4_words(&s.ct4), s.pad == crate::DRY_RUN_IIF, epoch) {
            CT_TRACKED => {
                let r = Reason::Tracked as u8;
                record_first_fragment(s, ep.id, dir, r);
                return r;
            }
            CT_STALE => stale = v,
            CT_CUT_HIT => return Reason::CutFlow as u8,
            _ => {}
        }
    }
    // What is decided: this packet, or the flow an ICMP error of a stale
    // flow quotes (its peer: the quoted destination at ingress, where the
    // error comes to the pod, the quoted source at egress).
    let q = &s.quoted;
    let (peer, pr, sport, dport) = if error_of_stale {
        let at = if dir == DIR_INGRESS {
            q.dst.as_ptr()
        } else {
            q.src.as_ptr()
        };
        (at, q.proto, q.ct_sport, q.ct_dport)
    } else {
        (if dir == DIR_INGRESS { src } else { dst }, p.proto, p.sport, p.dport)
    };
    let ported = matches!(pr, proto::TCP | proto::UDP | proto::SCTP);
    let port = if ported { dport } else { 0 };
    let peer = Peer {
        at: peer,
        lazy_v4: false,
        v4addr: 0,
    };
    // The decision's direction and port: this packet's, or the original
    // packet's of a stale flow.
    let (ddir, dport_d) = if stale.is_null() {
        // A new flow to a Service: egress is decided after the DNAT
        // (counted here as `Reason::Deferred`).
        if dir == DIR_EGRESS && deferred(ep.flags, ifindex, p.proto, dst, port) {
            let pkt = CtPacket {
                pr: p.proto,
                tcp_flags: p.tcp_flags,
                src_is_lo,
                now,
            };
            let r = defer(ctx, s, ifindex, v4, pkt);
            record_first_fragment(s, ep.id, dir, r);
            return r;
        }
        (dir, port)
    } else {
        let (odir, oport) = ct_original(stale, src_is_lo, sport, dport);
        (odir, if ported { oport } else { 0 })
    };
    let reason = policy_step(s.lpm.as_mut_ptr() as *mut u8, ep, ddir, pr, dport_d, peer);
    if !stale.is_null() {
        let r = ct_redecided(s, stale, reason, epoch);
        if r >= FIRST_DENY_REASON {
            // The cut's event: the direction that now denies, and the
            // connection (the quoted header) rather than its ICMP error.
            seen.dir = ddir;
            if error_of_stale {
                // SAFETY: two 4-aligned 52-byte `Pkt`s of the scratch.
                unsafe {
                    let d = core::ptr::addr_of_mut!(s.pkt) as *mut u8;
                    let q = core::ptr::addr_of!(s.quoted) as *const u8;
                    let mut i = 0;
                    while i < core::mem::size_of::<crate::parse::Pkt>() {
                        wr32(d.add(i), rd32(q.add(i)));
                        i += 4;
                    }
                }
            }
        } else if error_of_stale {
            // The flow goes on: its error passes as related.
            return Reason::Related as u8;
        } else {
            record_first_fragment(s, ep.id, dir, r);
        }
        return r;
    }
    if reason >= FIRST_DENY_REASON {
        return reason;
    }
    // Allowed by steps 7-9: track the connection.
    let (pr, tcp_flags) = (s.pkt.proto, s.pkt.tcp_flags);
    let pkt = CtPacket {
        pr,
        tcp_flags,
        src_is_lo,
        now,
    };
    // The allow event of a new connection (only for a flagged endpoint:
    // an unflagged one pays the flag test).
    let reason = match ct_create(s, v4, pkt, dir, reason, 0, epoch, ifindex) {
        // The endpoint holds its share of the conntrack: its new flow is
        // dropped.
        CT_REFUSED => Reason::ConntrackQuota as u8,
        // The kernel did not write the entry: dropped (its replies would
        // be decided as new flows), the sender retries.
        CT_FAILED => Reason::ConntrackFailed as u8,
        CT_WRITTEN if ep.flags & EP_REPORT_NEW != 0 => {
            report_new(s, dir, ifindex, ep.id, reason, now);
            reason
        }
        _ => reason,
    };
    record_first_fragment(s, ep.id, dir, reason);
    reason
}
