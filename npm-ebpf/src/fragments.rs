//! Step 5, fragments (`NPM_FRAGS`).
//!
//! A first fragment (IPv4 MF set and offset 0; IPv6 fragment header with
//! offset 0) carries the L4 header and is evaluated like any packet. If it is
//! allowed, its ports and verdict reason are recorded in `NPM_FRAGS` under
//! (endpoint, direction, fragment id, source, destination, protocol). A
//! non-first fragment carries no L4 header: it is allowed only if that record
//! exists, and then with the reason its first fragment had; without a record
//! it is dropped with reason `Fragment`. Fragments that arrive before their
//! first fragment are therefore dropped (the sender retransmits).

use aya_ebpf::{macros::map, maps::LruHashMap};
use npm_common::{sizes, FragKey, FragValue, Reason};

use crate::mem::{copy16, wr32};
use crate::parse::{Pkt, FRAG_FIRST};
use crate::scratch::Scratch;

/// `NPM_FRAGS`: the allowed first fragments, keyed by `fill_frag_key`.
#[map]
static NPM_FRAGS: LruHashMap<FragKey, FragValue> = LruHashMap::with_max_entries(sizes::FRAGS, 0);

/// FragKey layout: endpoint 0, id 4, protocol and direction 8, src 12, dst 28.
#[inline(always)]
fn fill_frag_key(k: &mut FragKey, ep: u32, dir: u8, p: &Pkt) {
    // SAFETY: offsets of the repr(C) FragKey.
    unsafe {
        let k = k as *mut FragKey as *mut u8;
        wr32(k, ep);
        wr32(k.add(4), p.frag_id);
        wr32(k.add(8), p.frag_proto as u32 | (dir as u32) << 8);
        copy16(k.add(12), p.src.as_ptr());
        copy16(k.add(28), p.dst.as_ptr());
    }
}

#[inline(always)]
pub(crate) fn record_first_fragment(s: &mut Scratch, ep: u32, dir: u8, reason: u8) {
    if s.pkt.frag == FRAG_FIRST {
        fill_frag_key(&mut s.frag, ep, dir, &s.pkt);
        // SAFETY: FragValue layout: sport 0, dport 2, reason 4, pad 5..8.
        unsafe {
            let v = core::ptr::addr_of_mut!(s.fragv) as *mut u8;
            wr32(v, s.pkt.sport as u32 | (s.pkt.dport as u32) << 16);
            wr32(v.add(4), reason as u32);
        }
        let _ = NPM_FRAGS.insert(&s.frag, &s.fragv, 0);
    }
}

/// Step 5 for a non-first fragment: the reason its first fragment was
/// allowed with (its ports go to `s.pkt`), or `Fragment` without a record.
#[inline(always)]
pub(crate) fn later_fragment(s: &mut Scratch, ep: u32, dir: u8) -> u8 {
    fill_frag_key(&mut s.frag, ep, dir, &s.pkt);
    // SAFETY: the value is only read.
    match unsafe { NPM_FRAGS.get(&s.frag) } {
        Some(v) => {
            s.pkt.sport = v.sport;
            s.pkt.dport = v.dport;
            v.reason
        }
        None => Reason::Fragment as u8,
    }
}
