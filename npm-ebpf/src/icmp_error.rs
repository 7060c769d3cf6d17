//! Step 6 for ICMP errors: an ICMP error (IPv4 types 3, 11 and 12, ICMPv6
//! types 1 to 4) quotes the start of the packet it reports on, which
//! travelled the other way. When that quoted header gives the canonical key
//! of a conntrack entry of this endpoint (the key is the same for both
//! directions of a flow, so the quoted tuple needs no reversing) that has
//! not idled out, and the error is addressed to the quoted packet's source
//! (as the kernel's own conntrack requires of a related error), the error
//! passes as that flow does: `Related`. It changes nothing in the entry.
//! This is what makes path-MTU discovery (Fragmentation Needed, Packet Too
//! Big) and traceroute work for isolated pods.
//!
//! Connection semantics `enforce`: the error of a cut flow
//! (`CT_CUT`) is dropped as that flow's packets are (`Reason::CutFlow`,
//! [`REL_CUT`]); the error of a flow decided under an older epoch of its
//! endpoint ([`REL_STALE`]) first has that flow decided again, as the
//! flow's own next packet would (by the caller, `crate::classify`): the
//! error is then dropped as the cut (`Reason::ConnectionCut`) when the
//! current policy denies the flow, and passes as `Related` when it allows
//! it.
//!
//! Anything else (a fragmented error, a quoted header of another family,
//! a quoted IPv4 non-first fragment, fewer than 8 quoted L4 bytes, quoted
//! IPv6 extension headers, no entry) is decided as any other ICMP packet.

use aya_ebpf::programs::TcContext;
use npm_common::{proto, CtValue, CT_CUT, CT_PENDING};

use crate::conntrack::{ct_alive, fill_ct_key, fill_ct_key4, NPM_CT, NPM_CT4};
use crate::mem::{copy16, eq16, is_v4_mapped};
use crate::parse::{be16, is_icmp_echo, load, v4_mapped_addresses, Pkt, FRAG_NONE};
use crate::scratch::Scratch;

/// Length of the ICMP and ICMPv6 header before the quoted packet.
const ICMP_HLEN: usize = 8;

/// Whether the parsed packet is an unfragmented ICMP error: IPv4 ICMP
/// destination unreachable (3), time exceeded (11) or parameter problem
/// (12); ICMPv6 destination unreachable (1), packet too big (2), time
/// exceeded (3) or parameter problem (4).
#[inline(always)]
pub(crate) fn is_icmp_error(p: &Pkt) -> bool {
    if p.frag != FRAG_NONE {
        return false;
    }
    let t = p.icmp_type;
    if p.family == 4 && p.proto == proto::ICMP {
        t == 3 || t == 11 || t == 12
    } else if p.family == 6 && p.proto == proto::ICMPV6 {
        (1..=4).contains(&t)
    } else {
        false
    }
}

/// Parses the header quoted by the ICMP error in `s.pkt` into `s.quoted`:
/// its addresses (IPv4-mapped for IPv4), protocol and conntrack ports (the
/// L4 ports, an echo's identifier, 0 for other protocols), as
/// [`crate::parse::parse`] would have for the quoted packet. Fails when the
/// quoted header is not of the error's family, is an IPv4 non-first
/// fragment, or is cut short of its first 8 L4 bytes.
#[inline(always)]
fn parse_quoted(ctx: &TcContext, s: &mut Scratch) -> Result<(), ()> {
    let off = s.pkt.l4_off as usize + ICMP_HLEN;
    let family = s.pkt.family;
    let h = &mut s.hdr;
    let q = &mut s.quoted;
    let l4off: usize;
    if family == 4 {
        load::<20>(ctx, off, h)?;
        let ihl = ((h[0] & 0x0f) as usize) * 4;
        // A non-first fragment quotes no L4 header.
        if h[0] >> 4 != 4 || ihl < 20 || be16(h[6], h[7]) & 0x1fff != 0 {
            return Err(());
        }
        q.proto = h[9];
        // SAFETY: `h` holds the quoted 20-byte IPv4 header.
        unsafe { v4_mapped_addresses(q, h.as_ptr()) };
        l4off = off + ihl;
    } else {
        load::<40>(ctx, off, h)?;
        if h[0] >> 4 != 6 {
            return Err(());
        }
        q.proto = h[6];
        // SAFETY: 4-aligned 16-byte fields and header offsets 8 and 24.
        unsafe {
            copy16(q.src.as_mut_ptr(), h.as_ptr().add(8));
            copy16(q.dst.as_mut_ptr(), h.as_ptr().add(24));
        }
        l4off = off + 40;
    }
    q.family = family;
    q.ct_sport = 0;
    q.ct_dport = 0;
    let pr = q.proto;
    match pr {
        proto::TCP | proto::UDP | proto::SCTP => {
            load::<8>(ctx, l4off, h)?;
            q.ct_sport = be16(h[0], h[1]);
            q.ct_dport = be16(h[2], h[3]);
        }
        proto::ICMP | proto::ICMPV6 => {
            load::<8>(ctx, l4off, h)?;
            if is_icmp_echo(pr, h[0]) {
                let id = be16(h[4], h[5]);
                q.ct_sport = id;
                q.ct_dport = id;
            }
        }
        _ => {}
    }
    Ok(())
}

/// [`related`]: no live entry of the quoted flow (or the error does not
/// go to the quoted packet's source): the error is decided as any other
/// ICMP packet.
pub(crate) const REL_NONE: u8 = 0;
/// [`related`]: the quoted flow is tracked: the error passes (`Related`).
pub(crate) const REL_PASS: u8 = 1;
/// [`related`]: the quoted flow was cut (`CT_CUT`): the error is dropped
/// (`Reason::CutFlow`).
pub(crate) const REL_CUT: u8 = 2;
/// [`related`]: the quoted flow's entry was decided under an older epoch
/// of the endpoint: the flow is decided again (its entry is returned).
pub(crate) const REL_STALE: u8 = 3;

/// Step 6 for an ICMP error ([`is_icmp_error`]) at endpoint `ep` whose
/// decision epoch is `epoch`: [`REL_NONE`] unless its quoted header
/// belongs to a conntrack entry of `ep` that has not idled out at `now`
/// and the error goes to the quoted packet's source; else how that entry
/// stands: [`REL_CUT`], [`REL_STALE`] (decided under another epoch, as
/// `crate::conntrack::ct_continue` judges it: a pending Service entry
/// never is) or [`REL_PASS`]. Also returns the entry and whether the
/// quoted packet's source is the key's `lo` side. Fills `s.quoted` and one
/// of the conntrack keys (`s.ct4` or `s.ct`), which the caller refills for
/// the error's own lookup. Writes nothing in the entry.
#[inline(always)]
pub(crate) fn related(ctx: &TcContext, s: &mut Scratch, ep: u32, now: u64, epoch: u32) -> (u8, *mut CtValue, bool) {
    let none = (REL_NONE, core::ptr::null_mut(), false);
    if parse_quoted(ctx, s).is_err() {
        return none;
    }
    let q = &s.quoted;
    let (qs, qd) = (q.src.as_ptr(), q.dst.as_ptr());
    // SAFETY: 16-byte, 4-aligned scratch fields.
    let (to_sender, v4) = unsafe {
        (
            eq16(s.pkt.dst.as_ptr(), qs),
            q.family == 4 || (is_v4_mapped(qs) && is_v4_mapped(qd)),
        )
    };
    if !to_sender {
        return none;
    }
    // The same canonical keys as the quoted packet's own lookup.
    let (lo, hit) = if v4 {
        let lo = fill_ct_key4(&mut s.ct4, ep, q);
        (lo, NPM_CT4.get_ptr_mut(&s.ct4))
    } else {
        let lo = fill_ct_key(&mut s.ct, ep, q);
        (lo, NPM_CT.get_ptr_mut(&s.ct))
    };
    let Some(v) = hit else {
        return none;
    };
    // SAFETY: a map value, only read here.
    let e = unsafe { &*v };
    if !ct_alive(e, q.proto, now) {
        return none;
    }
    if e.flags & CT_CUT != 0 {
        return (REL_CUT, v, lo);
    }
    if e.epoch != epoch && e.flags & CT_PENDING == 0 {
        return (REL_STALE, v, lo);
    }
    (REL_PASS, v, lo)
}
