//! The peer's identities of step 8: the IPv4 front `NPM_IPCACHE4` (one
//! inlined array read of a whole word), the exact-address hash
//! `NPM_IPCACHE`, and the CIDR trie `NPM_CIDRS` for unknown addresses.

use aya_ebpf::{
    macros::map,
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie},
};
use core::mem::size_of;
use npm_common::{ipcache4_slot, ipcache4_unpack, sizes, IpInfo, IpKey, IDENTITY_ANY, IDENTITY_WORLD};

use super::{Peer, BPF_F_MMAPABLE};
use crate::mem::{copy16, is_v4_mapped, rd32, wr32, V4_MAPPED_WORD};

/// `NPM_IPCACHE`: exact address -> identities; holds every known address.
#[map]
static NPM_IPCACHE: HashMap<IpKey, IpInfo> = HashMap::with_max_entries(sizes::IPCACHE, 0);
/// `NPM_IPCACHE4`: the direct-mapped IPv4 front of `NPM_IPCACHE`, one
/// `npm_common::ipcache4_word` a slot (`BPF_F_MMAPABLE`: user space maps
/// the array and stores whole words).
#[map]
static NPM_IPCACHE4: Array<u64> = Array::with_max_entries(sizes::IPCACHE4_SLOTS, BPF_F_MMAPABLE);
/// `NPM_CIDRS`: ipBlock prefix -> CIDR identity.
#[map]
static NPM_CIDRS: LpmTrie<[u8; 16], u32> = LpmTrie::with_max_entries(sizes::CIDRS, 0);
// The scratch key `lpm` (20 bytes) is read as a `NPM_CIDRS` key: the prefix
// length, then the address at 4.
const _: () = assert!(size_of::<Key<[u8; 16]>>() == 20);

/// Step 8's lookups: the peer's pod identity and CIDR identity, from its
/// `NPM_IPCACHE4` word, else its `NPM_IPCACHE` entry, else `IDENTITY_WORLD`
/// and the identity of its longest `NPM_CIDRS` prefix. `lpm` is the 20-byte
/// scratch key (a lazy IPv4 peer is written there when a lookup needs it).
#[inline(always)]
pub(crate) fn peer_identities(lpm: *mut u8, peer: Peer) -> (u32, u32) {
    let Peer {
        at: peer,
        lazy_v4,
        v4addr,
    } = peer;
    let (v4, addr) = if lazy_v4 {
        (true, v4addr)
    } else {
        // SAFETY: 16-byte, 4-aligned address (not read when lazy).
        unsafe { (is_v4_mapped(peer), rd32(peer.add(12))) }
    };
    // The IPv4 front first: one inlined array read of a whole word.
    let slot_word = if v4 {
        match NPM_IPCACHE4.get(ipcache4_slot(addr)) {
            Some(w) => {
                // SAFETY: an 8-aligned array value, stored whole by user space.
                let w = unsafe { core::ptr::read_volatile(w) };
                if w as u32 == addr && w >> 32 != 0 {
                    w
                } else {
                    0
                }
            }
            None => 0,
        }
    } else {
        0
    };
    if slot_word == 0 && lazy_v4 {
        // SAFETY: lpm is 20 bytes; the mapped address goes to 4..20.
        unsafe {
            let d = lpm.add(4);
            wr32(d, 0);
            wr32(d.add(4), 0);
            wr32(d.add(8), V4_MAPPED_WORD);
            wr32(d.add(12), v4addr);
        }
    }
    let info = if slot_word != 0 {
        None
    } else {
        // SAFETY: IpKey is repr(C) around exactly 16 address bytes.
        unsafe { NPM_IPCACHE.get(&*(peer as *const IpKey)) }
    };
    let (identity, cidr_identity) = match info {
        _ if slot_word != 0 => {
            let (_, i) = ipcache4_unpack(slot_word);
            (i.identity, i.cidr_identity)
        }
        Some(i) => (i.identity, i.cidr_identity),
        None => {
            // SAFETY: lpm is 20 bytes: prefix length and 16 bytes (when
            // lazy, `peer` is already those 16 bytes).
            let cidr = unsafe {
                wr32(lpm, 128);
                if !lazy_v4 {
                    copy16(lpm.add(4), peer);
                }
                NPM_CIDRS.get(&*(lpm as *const Key<[u8; 16]>)).copied()
            };
            (IDENTITY_WORLD, cidr.unwrap_or(IDENTITY_ANY))
        }
    };
    (identity, cidr_identity)
}
