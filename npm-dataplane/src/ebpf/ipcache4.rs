//! `NPM_IPCACHE4`, the direct-mapped IPv4 front of the ipcache, written
//! through a shared mapping of the array.
//!
//! Slot [`ipcache4_slot`]`(a)` holds the [`ipcache4_word`] of address `a`,
//! or of another address with the same slot, or 0. The datapath reads a
//! slot with one 64-bit load and uses it only when the word's address is
//! the packet's; otherwise it looks the address up in `NPM_IPCACHE`, which
//! always holds every address. So the invariant kept here is: a slot that
//! holds address `a` holds `a`'s current entry. Each change is one aligned
//! 64-bit store (atomic on every architecture the datapath runs on), so a
//! packet sees a slot before or after a change, never half of it:
//!
//! - writing `a`: the hash entry first (by the caller), then the slot if it
//!   is empty or already holds `a`; if `a`'s entry does not fit a word, a
//!   slot holding `a` is emptied;
//! - removing `a`: the slot first, if it holds `a`, then (by the caller)
//!   the hash entry.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{Array, IterableMap, MapData};
use npm_common::{ipcache4_slot, ipcache4_word, maps, sizes, IpInfo};
use npm_policy::compiled::IpEntry;

use super::errors::EbpfError;
use super::shared_words::SharedWords;
use super::translate;

/// The mapped `NPM_IPCACHE4` array.
pub(crate) struct Ipcache4 {
    slots: SharedWords,
    /// Keeps the map (and its fd) alive as long as the mapping.
    _map: Array<MapData, u64>,
}

/// An IPv4 address as the datapath reads it (see `npm_common::ipcache4_slot`).
fn word_addr(addr: IpAddr) -> Option<u32> {
    match addr {
        IpAddr::V4(a) => Some(u32::from_le_bytes(a.octets())),
        IpAddr::V6(a) => a.to_ipv4_mapped().map(|a| u32::from_le_bytes(a.octets())),
    }
}

impl Ipcache4 {
    /// Maps the array (created with `BPF_F_MMAPABLE` by the object).
    pub(crate) fn new(map: Array<MapData, u64>) -> Result<Self, EbpfError> {
        let fd = map.map().fd().as_fd().as_raw_fd();
        let slots = SharedWords::map(fd, sizes::IPCACHE4_SLOTS as usize, maps::IPCACHE4)?;
        Ok(Ipcache4 { slots, _map: map })
    }

    fn slots(&self) -> &[AtomicU64] {
        self.slots.words()
    }

    fn slot_of(&self, a: u32) -> &AtomicU64 {
        &self.slots()[ipcache4_slot(a) as usize]
    }

    /// After `addr`'s hash entry was written with `info`.
    pub(crate) fn upsert(&self, addr: IpAddr, info: IpInfo) {
        let Some(a) = word_addr(addr) else {
            return;
        };
        let slot = self.slot_of(a);
        let cur = slot.load(Ordering::Acquire);
        let holds = cur != 0 && cur as u32 == a;
        match ipcache4_word(a, info) {
            Some(w) if cur == 0 || holds => slot.store(w, Ordering::Release),
            Some(_) => {}
            None if holds => slot.store(0, Ordering::Release),
            None => {}
        }
    }

    /// Before `addr`'s hash entry is removed.
    pub(crate) fn remove(&self, addr: IpAddr) {
        let Some(a) = word_addr(addr) else {
            return;
        };
        let slot = self.slot_of(a);
        let cur = slot.load(Ordering::Acquire);
        if cur != 0 && cur as u32 == a {
            slot.store(0, Ordering::Release);
        }
    }

    /// Empties every slot whose word is not the wanted entry of its address
    /// (addresses gone, or changed in a map written without this
    /// loader: adopted pins). Returns how many were emptied.
    pub(crate) fn sweep(&self, want: &BTreeMap<IpAddr, IpEntry>) -> usize {
        let wanted: BTreeMap<u32, u64> = want
            .iter()
            .filter_map(|(addr, e)| {
                let a = word_addr(*addr)?;
                Some((a, ipcache4_word(a, translate::ip_info(e))?))
            })
            .collect();
        let mut emptied = 0;
        for slot in self.slots() {
            let cur = slot.load(Ordering::Acquire);
            if cur != 0 && wanted.get(&(cur as u32)) != Some(&cur) {
                slot.store(0, Ordering::Release);
                emptied += 1;
            }
        }
        emptied
    }

    /// Slots in use.
    pub(crate) fn occupied(&self) -> usize {
        self.slots().iter().filter(|s| s.load(Ordering::Relaxed) != 0).count()
    }

    /// The word in the slot of `addr`, whichever address it holds.
    pub(crate) fn slot_word(&self, addr: IpAddr) -> Option<u64> {
        word_addr(addr).map(|a| self.slot_of(a).load(Ordering::Acquire))
    }
}
