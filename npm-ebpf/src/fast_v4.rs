//! The IPv4 fast path: the common IPv4 TCP/UDP packet decided with its
//! fields in registers; anything else goes to [`crate::classify::classify`].

use aya_ebpf::programs::TcContext;
use npm_common::{proto, sizes, Reason, DIR_EGRESS, DIR_INGRESS, EP_HAS_V4, EP_REPORT_NEW, FIRST_DENY_REASON};

use crate::conntrack::{
    ct4_key, ct_continue, ct_create, ct_original, ct_redecided, store_ct4, CtPacket, CT_CUT_HIT, CT_FAILED, CT_REFUSED,
    CT_STALE, CT_TRACKED, CT_WRITTEN, NPM_CT4,
};
use crate::endpoint::{endpoint_epoch, endpoint_slot};
use crate::flow_cache::{flow_cache_hit, flow_slot, FlowSlot, NPM_BENCH_NO_FLOW_CACHE, NPM_FLOWCACHE};
use crate::mem::{rd32, wr32, V4_MAPPED_WORD};
use crate::parse::{Pkt, ETH_HLEN, TCP_ACK, TCP_FIN, TCP_RST, TCP_SYN};
use crate::policy::{policy_step, Peer};
use crate::scratch::{coarse_now, Scratch};
use crate::service::{defer, deferred_v4};
use crate::verdict::{report_new, Seen};

/// Test and benchmark switch: when 1, every packet takes the general path
/// ([`classify`](crate::classify::classify)), never [`fast_v4`]; the packet tables run both ways.
#[no_mangle]
static NPM_BENCH_NO_FAST_V4: u8 = 0;

/// [`fast_v4`]'s answer for a packet it leaves to [`classify`](crate::classify::classify).
pub(crate) const TAKE_GENERAL: u8 = 0xfe;

/// The IPv4 fast path: the same steps as [`classify`](crate::classify::classify) for the common packet
/// (Ethernet, IPv4 without options or fragmentation, TCP or UDP, the
/// first 54 bytes linear, an endpoint in `NPM_EP_SLOTS`, a valid source on
/// egress, no TCP FIN or RST), with the packet's fields in registers
/// rather than in scratch memory: an established flow costs the parse, the
/// endpoint slot and the flow-cache slot. Returns the reason, or
/// [`TAKE_GENERAL`] (having changed nothing) for any other packet.
/// `s.pkt` is filled only for a denied packet (its deny event) and for the
/// allow event of a new connection of an `EP_REPORT_NEW` endpoint.
///
/// `ebpf_packets.rs` runs its tables with this path switched off too
/// (`NPM_BENCH_NO_FAST_V4`): both paths give every row the same verdict.
#[inline(always)]
pub(crate) fn fast_v4(ctx: &TcContext, dir: u8, ifindex: u32, s: &mut Scratch, seen: &mut Seen) -> u8 {
    // SAFETY: reading a read-only global.
    if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FAST_V4) } != 0 {
        return TAKE_GENERAL;
    }
    let data = ctx.data();
    if data + 54 > ctx.data_end() || ifindex >= sizes::ENDPOINT_SLOTS {
        return TAKE_GENERAL;
    }
    let pk = data as *const u8;
    // SAFETY: 54 bytes are in bounds (checked just above); unaligned 32-bit
    // packet reads as in `parse_fast`.
    // Whole 32-bit words of the headers, read little-endian (the byte at
    // the lowest offset is the lowest byte of the word).
    let (saddr, daddr, pr, sport, dport, tcp_flags) = unsafe {
        // Bytes 12..15: ethertype 0x0800, version 4 with a 20-byte header.
        if rd32(pk.add(12)) & 0x00ff_ffff != 0x0045_0008 {
            return TAKE_GENERAL;
        }
        let w16 = rd32(pk.add(16));
        let tot = (((w16 & 0xff) << 8) | ((w16 >> 8) & 0xff)) as usize;
        // Bytes 20..23: no fragment (MF clear, offset 0), then the protocol.
        let w20 = rd32(pk.add(20));
        // A datagram shorter than 40 bytes may end inside its L4 header:
        // the general path checks it.
        if w20 & 0xff3f != 0 || tot < 40 || (ctx.len() as usize) < ETH_HLEN + tot {
            return TAKE_GENERAL;
        }
        let pr = (w20 >> 24) as u8;
        let mut fl = 0u8;
        if pr == proto::TCP {
            // Bytes 44..47: the data offset at 46, the flags at 47.
            let w44 = rd32(pk.add(44));
            fl = (w44 >> 24) as u8;
            if (w44 >> 20) & 0xf < 5 || fl & (TCP_FIN | TCP_RST) != 0 {
                return TAKE_GENERAL;
            }
        } else if pr != proto::UDP {
            return TAKE_GENERAL;
        }
        // Bytes 34..37: the ports, each big-endian.
        let w34 = rd32(pk.add(34));
        (
            rd32(pk.add(26)),
            rd32(pk.add(30)),
            pr,
            (((w34 & 0xff) << 8) | ((w34 >> 8) & 0xff)) as u16,
            (((w34 >> 16) & 0xff) << 8 | (w34 >> 24)) as u16,
            fl,
        )
    };
    let ep = match endpoint_slot(ifindex) {
        Some(ep) => ep,
        None => return TAKE_GENERAL,
    };
    if dir == DIR_EGRESS {
        let a = ep.ipv4.as_ptr();
        // SAFETY: 16-byte, 4-aligned map field.
        let own = ep.flags & EP_HAS_V4 != 0
            && unsafe {
                (rd32(a) | rd32(a.add(4)) | (rd32(a.add(8)) ^ V4_MAPPED_WORD) | (rd32(a.add(12)) ^ saddr)) == 0
            };
        if !own {
            return TAKE_GENERAL;
        }
    }
    seen.ep_id = ep.id;
    // The endpoint's decision epoch, read before any policy lookup.
    let epoch = endpoint_epoch(ifindex);
    // 6. conntrack, with the `NPM_CT4` key in registers.
    let now = coarse_now(&mut s.clk);
    seen.now = now;
    let (src_is_lo, key) = ct4_key(ep.id, pr, saddr, daddr, sport, dport);
    let ct = CtPacket {
        pr,
        tcp_flags,
        src_is_lo,
        now,
    };
    let opening = pr == proto::TCP && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    // A tracked flow decided under an older epoch: decided again below.
    let mut stale = core::ptr::null_mut();
    if !opening {
        let mut slot: *mut FlowSlot = core::ptr::null_mut();
        // SAFETY: reading a read-only global.
        if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FLOW_CACHE) } == 0 {
            if let Some(sl) = NPM_FLOWCACHE.get_ptr_mut(flow_slot(&key)) {
                // SAFETY: this CPU's slot.
                if unsafe { flow_cache_hit(sl, &key, now, epoch) } {
                    return Reason::Tracked as u8;
                }
                slot = sl;
            }
        }
        store_ct4(&mut s.ct4, &key);
        if let Some(v) = NPM_CT4.get_ptr_mut(&s.ct4) {
            match ct_continue(v, ct, slot, &key, s.pad == crate::DRY_RUN_IIF, epoch) {
                CT_TRACKED => return Reason::Tracked as u8,
                CT_STALE => stale = v,
                CT_CUT_HIT => {
                    // The deny event reads the packet from scratch.
                    let h = Hdr4::new(saddr, daddr, pr, tcp_flags, sport, dport);
                    fill_pkt_v4(&mut s.pkt, h);
                    return Reason::CutFlow as u8;
                }
                _ => {}
            }
        }
    }
    // The decision's direction and port: this packet's, or the original
    // packet's of a stale flow.
    let (ddir, dport_d) = if stale.is_null() {
        // A new flow to a Service: egress is decided after the DNAT
        // (counted here as `Reason::Deferred`).
        if dir == DIR_EGRESS && deferred_v4(ep.flags, ifindex, pr, daddr, dport) {
            store_ct4(&mut s.ct4, &key);
            let r = defer(ctx, s, ifindex, true, ct);
            if r >= FIRST_DENY_REASON {
                // The pending entry was not written: the deny event reads
                // the packet from scratch.
                fill_pkt_v4(&mut s.pkt, Hdr4::new(saddr, daddr, pr, tcp_flags, sport, dport));
            }
            return r;
        }
        (dir, dport)
    } else {
        ct_original(stale, src_is_lo, sport, dport)
    };
    // Steps 7 to 9 with the peer in a register.
    let lpm = s.lpm.as_mut_ptr() as *mut u8;
    let peer = Peer {
        // SAFETY: lpm is 20 bytes.
        at: unsafe { lpm.add(4) },
        lazy_v4: true,
        v4addr: if dir == DIR_INGRESS { saddr } else { daddr },
    };
    let reason = policy_step(lpm, ep, ddir, pr, dport_d, peer);
    // What an event reads from scratch (written only when one is sent).
    let h = Hdr4::new(saddr, daddr, pr, tcp_flags, sport, dport);
    if !stale.is_null() {
        let r = ct_redecided(s, stale, reason, epoch);
        if r >= FIRST_DENY_REASON {
            // The cut's event: the direction that now denies.
            fill_pkt_v4(&mut s.pkt, h);
            seen.dir = ddir;
        }
        return r;
    }
    if reason >= FIRST_DENY_REASON {
        // The deny event reads the packet from scratch.
        fill_pkt_v4(&mut s.pkt, h);
        return reason;
    }
    store_ct4(&mut s.ct4, &key);
    // The allow event of a new connection (only for a flagged endpoint:
    // an unflagged one pays the flag test), read from scratch.
    match ct_create(s, true, ct, dir, reason, 0, epoch, ifindex) {
        // The endpoint holds its share of the conntrack: its new flow is
        // dropped (the deny event reads the packet from scratch).
        CT_REFUSED => {
            fill_pkt_v4(&mut s.pkt, h);
            return Reason::ConntrackQuota as u8;
        }
        // The kernel did not write the entry: dropped (its replies would
        // be decided as new flows), the sender retries.
        CT_FAILED => {
            fill_pkt_v4(&mut s.pkt, h);
            return Reason::ConntrackFailed as u8;
        }
        CT_WRITTEN if ep.flags & EP_REPORT_NEW != 0 => {
            fill_pkt_v4(&mut s.pkt, h);
            report_new(s, dir, ifindex, ep.id, reason, now);
        }
        _ => {}
    }
    reason
}

/// The fields [`fast_v4`] reads of an IPv4 packet: the addresses (as
/// loaded, network order in a little-endian word), the protocol, the TCP
/// flags and the ports.
#[derive(Clone, Copy)]
struct Hdr4 {
    saddr: u32,
    daddr: u32,
    pr: u8,
    tcp_flags: u8,
    sport: u16,
    dport: u16,
}

impl Hdr4 {
    #[inline(always)]
    const fn new(saddr: u32, daddr: u32, pr: u8, tcp_flags: u8, sport: u16, dport: u16) -> Hdr4 {
        Hdr4 {
            saddr,
            daddr,
            pr,
            tcp_flags,
            sport,
            dport,
        }
    }
}

/// Fills the parsed packet of an IPv4 packet [`fast_v4`] decided (for its
/// deny event).
#[inline(always)]
fn fill_pkt_v4(p: &mut Pkt, h: Hdr4) {
    // SAFETY: 4-aligned fields of the repr(C) Pkt (words 32..52 are the
    // family, protocol, flags, fragment id and ports).
    unsafe {
        let p = p as *mut Pkt as *mut u8;
        wr32(p, 0);
        wr32(p.add(4), 0);
        wr32(p.add(8), V4_MAPPED_WORD);
        wr32(p.add(12), h.saddr);
        wr32(p.add(16), 0);
        wr32(p.add(20), 0);
        wr32(p.add(24), V4_MAPPED_WORD);
        wr32(p.add(28), h.daddr);
        wr32(p.add(32), 4 | (h.pr as u32) << 8 | (h.tcp_flags as u32) << 16);
        wr32(p.add(36), 0);
        wr32(p.add(40), 0);
        wr32(p.add(44), h.sport as u32 | (h.dport as u32) << 16);
        wr32(p.add(48), h.sport as u32 | (h.dport as u32) << 16);
    }
}
