//! Packet parsing: Ethernet, IPv4 or IPv6 (extension headers, fragment
//! header) and the L4 header into [`Pkt`], by direct packet access when the
//! headers are linear ([`parse_fast`]), else with `bpf_skb_load_bytes`.
//! ICMP and ICMPv6 echo messages carry their identifier as both conntrack
//! ports; [`is_icmpv6_control`] names the neighbour discovery and MLD types
//! of step 4.

use aya_ebpf::{
    helpers::bpf_skb_load_bytes,
    programs::{sk_buff::SkBuff, SkBuffContext, TcContext},
};
use core::ffi::c_void;
use core::mem::{offset_of, size_of};

use npm_common::proto;

use crate::mem::{copy16, rd32, wr32, V4_MAPPED_WORD};
use crate::scratch::Scratch;

/// Length of the Ethernet header.
pub(crate) const ETH_HLEN: usize = 14;
/// Ethertype of IPv4.
pub(crate) const ETH_P_IP: u16 = 0x0800;
/// Ethertype of IPv6.
pub(crate) const ETH_P_IPV6: u16 = 0x86dd;
/// TCP flag FIN.
pub(crate) const TCP_FIN: u8 = 0x01;
/// TCP flag RST.
pub(crate) const TCP_RST: u8 = 0x04;
/// TCP flag SYN.
pub(crate) const TCP_SYN: u8 = 0x02;
/// TCP flag ACK.
pub(crate) const TCP_ACK: u8 = 0x10;
/// Most IPv6 extension headers walked before the packet counts as malformed.
const MAX_EXT_HEADERS: usize = 8;
/// [`Pkt::frag`]: not a fragment.
pub(crate) const FRAG_NONE: u8 = 0;
/// [`Pkt::frag`]: a first fragment (it carries the L4 header).
pub(crate) const FRAG_FIRST: u8 = 1;
/// [`Pkt::frag`]: a non-first fragment (no L4 header).
pub(crate) const FRAG_LATER: u8 = 2;

/// What the parser learned of one packet. Every multi-byte field sits at a
/// 4-byte aligned offset, so the code moves addresses as 32-bit words:
/// byte-wise copies and `memset`/`memcpy` calls (which the BPF backend
/// emits as slow byte loops) are avoided on the hot path.
#[repr(C)]
pub(crate) struct Pkt {
    /// Source address (IPv4-mapped for IPv4); valid once `family != 0`.
    pub(crate) src: [u8; 16],
    /// Destination address.
    pub(crate) dst: [u8; 16],
    /// 4 or 6; 0 until parsed.
    pub(crate) family: u8,
    /// Upper-layer protocol (for a non-first fragment: the fragment's).
    pub(crate) proto: u8,
    /// TCP flags (0 for other protocols).
    pub(crate) tcp_flags: u8,
    /// `FRAG_NONE`, `FRAG_FIRST` or `FRAG_LATER`.
    pub(crate) frag: u8,
    /// Protocol stored in the fragment record (IPv4 protocol, or the next
    /// header of the IPv6 fragment header).
    pub(crate) frag_proto: u8,
    /// ICMP or ICMPv6 type.
    pub(crate) icmp_type: u8,
    /// Offset of the ICMP or ICMPv6 header in the frame (0 for other
    /// protocols): where an ICMP error's quoted header starts, 8 bytes on.
    pub(crate) l4_off: u16,
    /// IPv4 identification or IPv6 fragment identification.
    pub(crate) frag_id: u32,
    /// L4 source port (0 when the protocol has none).
    pub(crate) sport: u16,
    /// L4 destination port (0 when the protocol has none).
    pub(crate) dport: u16,
    /// Conntrack ports (ICMP echo: the echo id on both sides).
    pub(crate) ct_sport: u16,
    /// See `ct_sport`.
    pub(crate) ct_dport: u16,
}
// Code writes `Pkt` as 32-bit words: the addresses, then the words 32..52
// (`fill_pkt_v4` of the IPv4 fast path, [`clear_fields`]).
const _: () = assert!(size_of::<Pkt>() == 52);
const _: () = assert!(offset_of!(Pkt, src) == 0);
const _: () = assert!(offset_of!(Pkt, dst) == 16);
const _: () = assert!(offset_of!(Pkt, family) == 32);
const _: () = assert!(offset_of!(Pkt, proto) == 33);
const _: () = assert!(offset_of!(Pkt, tcp_flags) == 34);
const _: () = assert!(offset_of!(Pkt, frag) == 35);
const _: () = assert!(offset_of!(Pkt, l4_off) == 38);
const _: () = assert!(offset_of!(Pkt, frag_id) == 40);
const _: () = assert!(offset_of!(Pkt, sport) == 44);
const _: () = assert!(offset_of!(Pkt, dport) == 46);
const _: () = assert!(offset_of!(Pkt, ct_sport) == 48);
const _: () = assert!(offset_of!(Pkt, ct_dport) == 50);

/// Zeroes every field of `p` but the addresses (words 32..52), as the
/// general path expects to find them.
#[inline(always)]
pub(crate) fn clear_fields(p: &mut Pkt) {
    // SAFETY: words 32..52 of Pkt (everything but the addresses).
    unsafe {
        let p = p as *mut Pkt as *mut u8;
        wr32(p.add(32), 0);
        wr32(p.add(36), 0);
        wr32(p.add(40), 0);
        wr32(p.add(44), 0);
        wr32(p.add(48), 0);
    }
}

/// The big-endian 16-bit number of two bytes.
#[inline(always)]
pub(crate) fn be16(b0: u8, b1: u8) -> u16 {
    ((b0 as u16) << 8) | b1 as u16
}

/// A program context that holds a socket buffer: `TcContext` (the packet
/// starts at its Ethernet header) and `SkBuffContext` (a socket filter,
/// run by `xt_bpf`: the packet starts at its IP header).
pub(crate) trait Skb {
    /// The socket buffer.
    fn sk_buff(&self) -> &SkBuff;
}

impl Skb for TcContext {
    #[inline(always)]
    fn sk_buff(&self) -> &SkBuff {
        &self.skb
    }
}

impl Skb for SkBuffContext {
    #[inline(always)]
    fn sk_buff(&self) -> &SkBuff {
        &self.skb
    }
}

/// Copies `N` bytes of the packet at `off` into `buf` (works on non-linear
/// skbs too); fails when the packet is shorter.
#[inline(always)]
pub(crate) fn load<const N: usize>(ctx: &impl Skb, off: usize, buf: &mut [u8; 40]) -> Result<(), ()> {
    // SAFETY: buf has room for N <= 40 bytes.
    let r = unsafe {
        bpf_skb_load_bytes(
            ctx.sk_buff().skb as *const c_void,
            off as u32,
            buf.as_mut_ptr() as *mut c_void,
            N as u32,
        )
    };
    if r < 0 {
        Err(())
    } else {
        Ok(())
    }
}

/// Whether an ICMP (protocol `pr` [`proto::ICMP`]) or ICMPv6 message of
/// type `t` is an echo request or reply, whose identifier is both of its
/// conntrack ports.
#[inline(always)]
pub(crate) fn is_icmp_echo(pr: u8, t: u8) -> bool {
    if pr == proto::ICMP {
        t == 8 || t == 0
    } else {
        t == 128 || t == 129
    }
}

/// Whether an ICMPv6 type is neighbour discovery or MLD (step 4 allows
/// them in both directions).
#[inline(always)]
pub(crate) fn is_icmpv6_control(t: u8) -> bool {
    (130..=137).contains(&t) || t == 143
}

/// Fast path of [`parse`]: reads the headers in place (direct packet
/// access) when the frame is IPv4 without options or fragmentation, or IPv6
/// without extension headers, carries TCP, UDP, SCTP or ICMP/ICMPv6, and
/// the first 54 (IPv4) or 74 (IPv6) bytes are in the linear area. Returns
/// false, having changed nothing the slow path relies on, for anything else.
#[inline(always)]
fn parse_fast(ctx: &TcContext, p: &mut Pkt) -> bool {
    let len = ctx.len() as usize;
    let data = ctx.data();
    let end = ctx.data_end();
    if data + 54 > end {
        return false;
    }
    let pk = data as *const u8;
    // SAFETY: every read below is within the bounds checked against
    // data_end (54 bytes, or 74 after the second check). Unaligned 32-bit
    // packet reads are fine: the kernel only enforces packet alignment on
    // architectures without efficient unaligned access.
    unsafe {
        let ethertype = be16(*pk.add(12), *pk.add(13));
        let l4: *const u8;
        let l4_off: u16;
        if ethertype == ETH_P_IP && *pk.add(14) == 0x45 {
            let tot = be16(*pk.add(16), *pk.add(17)) as usize;
            let fo = be16(*pk.add(20), *pk.add(21));
            let pr = *pk.add(23);
            // A datagram shorter than 40 bytes may end inside its L4
            // header: the general path checks it.
            if fo & 0x3fff != 0 || tot < 40 || len < ETH_HLEN + tot {
                return false;
            }
            if !(pr == proto::TCP || pr == proto::UDP || pr == proto::SCTP || pr == proto::ICMP) {
                return false;
            }
            p.family = 4;
            p.proto = pr;
            v4_mapped_addresses(p, pk.add(ETH_HLEN));
            l4_off = (ETH_HLEN + 20) as u16;
            l4 = pk.add(l4_off as usize);
        } else if ethertype == ETH_P_IPV6 {
            if data + 74 > end || *pk.add(14) >> 4 != 6 {
                return false;
            }
            let payload = be16(*pk.add(18), *pk.add(19)) as usize;
            let pr = *pk.add(20);
            if payload < 20 || len < ETH_HLEN + 40 + payload {
                return false;
            }
            if !(pr == proto::TCP || pr == proto::UDP || pr == proto::SCTP || pr == proto::ICMPV6) {
                return false;
            }
            p.family = 6;
            p.proto = pr;
            let sp = p.src.as_mut_ptr();
            let dp = p.dst.as_mut_ptr();
            wr32(sp, rd32(pk.add(22)));
            wr32(sp.add(4), rd32(pk.add(26)));
            wr32(sp.add(8), rd32(pk.add(30)));
            wr32(sp.add(12), rd32(pk.add(34)));
            wr32(dp, rd32(pk.add(38)));
            wr32(dp.add(4), rd32(pk.add(42)));
            wr32(dp.add(8), rd32(pk.add(46)));
            wr32(dp.add(12), rd32(pk.add(50)));
            l4_off = (ETH_HLEN + 40) as u16;
            l4 = pk.add(l4_off as usize);
        } else {
            return false;
        }
        // 20 bytes of L4 header are in bounds on both paths.
        let pr = p.proto;
        if pr == proto::ICMP || pr == proto::ICMPV6 {
            let t = *l4;
            p.icmp_type = t;
            p.l4_off = l4_off;
            if is_icmp_echo(pr, t) {
                let id = be16(*l4.add(4), *l4.add(5));
                p.ct_sport = id;
                p.ct_dport = id;
            }
            return true;
        }
        if pr == proto::TCP {
            if *l4.add(12) >> 4 < 5 {
                // Malformed: let the slow path decide it.
                p.family = 0;
                return false;
            }
            p.tcp_flags = *l4.add(13);
        }
        let sport = be16(*l4, *l4.add(1));
        let dport = be16(*l4.add(2), *l4.add(3));
        p.sport = sport;
        p.dport = dport;
        p.ct_sport = sport;
        p.ct_dport = dport;
    }
    true
}

/// Parses IPv4/IPv6 and the L4 header of the Ethernet frame in `ctx` into
/// `s.pkt`.
#[inline(always)]
pub(crate) fn parse(ctx: &TcContext, s: &mut Scratch) -> Result<(), ()> {
    if parse_fast(ctx, &mut s.pkt) {
        return Ok(());
    }
    parse_at::<ETH_HLEN>(ctx, s)?;
    // The header's version must be the ethertype's (the receiver's stack
    // drops the other, so its "flow" is no flow: malformed, not decided).
    load::<2>(ctx, 12, &mut s.hdr)?;
    let want = if s.pkt.family == 4 { ETH_P_IP } else { ETH_P_IPV6 };
    if be16(s.hdr[0], s.hdr[1]) != want {
        return Err(());
    }
    Ok(())
}

/// [`parse`] of a packet whose IP header starts at byte `L3` (14 behind
/// an Ethernet header, 0 in a socket filter), by `bpf_skb_load_bytes`
/// only (no direct packet access, which socket filters lack).
#[inline(always)]
pub(crate) fn parse_at<const L3: usize>(ctx: &impl Skb, s: &mut Scratch) -> Result<(), ()> {
    let len = ctx.sk_buff().len() as usize;
    let h = &mut s.hdr;
    let p = &mut s.pkt;
    load::<1>(ctx, L3, h)?;
    let version = h[0] >> 4;
    let l4off: usize;
    // The end of the datagram (its length field, not the frame: Ethernet
    // padding is not the packet's): every header must lie before it.
    let end: usize;
    if version == 4 {
        load::<20>(ctx, L3, h)?;
        let ihl = ((h[0] & 0x0f) as usize) * 4;
        let tot = be16(h[2], h[3]) as usize;
        if ihl < 20 || tot < ihl || len < L3 + tot {
            return Err(());
        }
        end = L3 + tot;
        p.family = 4;
        p.proto = h[9];
        p.frag_proto = h[9];
        // SAFETY: `h` holds the 20-byte IPv4 header.
        unsafe { v4_mapped_addresses(p, h.as_ptr()) };
        let fo = be16(h[6], h[7]);
        if fo & 0x1fff != 0 {
            p.frag = FRAG_LATER;
        } else if fo & 0x2000 != 0 {
            p.frag = FRAG_FIRST;
        }
        p.frag_id = be16(h[4], h[5]) as u32;
        l4off = L3 + ihl;
    } else if version == 6 {
        load::<40>(ctx, L3, h)?;
        let payload = be16(h[4], h[5]) as usize;
        if len < L3 + 40 + payload {
            return Err(());
        }
        end = L3 + 40 + payload;
        p.family = 6;
        // SAFETY: 4-aligned 16-byte fields and header offsets 8 and 24.
        unsafe {
            copy16(p.src.as_mut_ptr(), h.as_ptr().add(8));
            copy16(p.dst.as_mut_ptr(), h.as_ptr().add(24));
        }
        let mut nh = h[6];
        let mut off = L3 + 40;
        let mut done = false;
        // One more round than headers allowed: it finds the upper layer.
        for _ in 0..=MAX_EXT_HEADERS {
            match nh {
                0 | 43 | 60 => {
                    load::<2>(ctx, off, h)?;
                    nh = h[0];
                    off += (h[1] as usize + 1) * 8;
                }
                51 => {
                    load::<2>(ctx, off, h)?;
                    nh = h[0];
                    off += (h[1] as usize + 2) * 4;
                }
                44 => {
                    if p.frag != FRAG_NONE {
                        return Err(());
                    }
                    load::<8>(ctx, off, h)?;
                    nh = h[0];
                    let fo = be16(h[2], h[3]);
                    p.frag_proto = h[0];
                    p.frag_id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                    off += 8;
                    if fo >> 3 != 0 {
                        // Later fragment: what follows is not a header.
                        p.frag = FRAG_LATER;
                        done = true;
                        break;
                    } else if fo & 1 != 0 {
                        p.frag = FRAG_FIRST;
                    }
                }
                _ => {
                    done = true;
                    break;
                }
            }
        }
        if !done || off > end {
            return Err(());
        }
        p.proto = nh;
        l4off = off;
    } else {
        return Err(());
    }
    if p.frag == FRAG_LATER {
        return Ok(());
    }
    // The fixed L4 header the decision reads, within the datagram.
    let need = match p.proto {
        proto::TCP => 20,
        proto::SCTP => 12,
        proto::UDP | proto::ICMP | proto::ICMPV6 => 8,
        _ => 0,
    };
    if l4off + need > end {
        return Err(());
    }
    match p.proto {
        proto::TCP => {
            load::<20>(ctx, l4off, h)?;
            if h[12] >> 4 < 5 {
                return Err(());
            }
            p.tcp_flags = h[13];
        }
        proto::UDP => load::<8>(ctx, l4off, h)?,
        proto::SCTP => load::<12>(ctx, l4off, h)?,
        proto::ICMP | proto::ICMPV6 => {
            load::<8>(ctx, l4off, h)?;
            p.icmp_type = h[0];
            p.l4_off = l4off as u16;
            if is_icmp_echo(p.proto, h[0]) {
                let id = be16(h[4], h[5]);
                p.ct_sport = id;
                p.ct_dport = id;
            }
            return Ok(());
        }
        _ => return Ok(()),
    }
    p.sport = be16(h[0], h[1]);
    p.dport = be16(h[2], h[3]);
    p.ct_sport = p.sport;
    p.ct_dport = p.dport;
    Ok(())
}

/// The IPv4 header at `h` (its source at byte 12, destination at 16) as the
/// IPv4-mapped addresses of `p` (one rule for every parsed header: the
/// packet's own and an ICMP error's quoted one).
///
/// # Safety
/// `h` points at least 20 readable, 4-aligned bytes.
#[inline(always)]
pub(crate) unsafe fn v4_mapped_addresses(p: &mut Pkt, h: *const u8) {
    // SAFETY: `Pkt`'s 16-byte fields are 4-aligned; the caller's `h`.
    unsafe {
        let sp = p.src.as_mut_ptr();
        let dp = p.dst.as_mut_ptr();
        wr32(sp, 0);
        wr32(sp.add(4), 0);
        wr32(sp.add(8), V4_MAPPED_WORD);
        wr32(sp.add(12), rd32(h.add(12)));
        wr32(dp, 0);
        wr32(dp.add(4), 0);
        wr32(dp.add(8), V4_MAPPED_WORD);
        wr32(dp.add(12), rd32(h.add(16)));
    }
}
