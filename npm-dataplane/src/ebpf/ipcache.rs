//! The ipcache: address ([`IpKey`], IPv4-mapped) -> [`IpInfo`] (identity
//! and CIDR identity) in `NPM_IPCACHE`, which always holds every address,
//! with its direct-mapped IPv4 front `NPM_IPCACHE4` ([`Ipcache4`]). The
//! order of writes between the two is the front's invariant (see
//! `ipcache4.rs`): the hash entry before the slot on a write, the slot
//! before the hash entry on a removal.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use aya::maps::{HashMap as BpfHashMap, MapData};
use aya::Ebpf;
use npm_common::{maps, IpInfo, IpKey};
use npm_policy::compiled::IpEntry;

use super::errors::{map_err, removed, EbpfError};
use super::ipcache4::Ipcache4;
use super::loader::take_map;
use super::translate;

/// `NPM_IPCACHE` and its IPv4 front, written together.
pub(crate) struct IpcacheTable {
    hash: BpfHashMap<MapData, IpKey, IpInfo>,
    v4: Ipcache4,
}

impl IpcacheTable {
    /// Takes both maps out of the loaded object (mapping the front).
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let hash = take_map(bpf, maps::IPCACHE)?;
        let v4 = Ipcache4::new(take_map(bpf, maps::IPCACHE4)?)?;
        Ok(IpcacheTable { hash, v4 })
    }

    /// Writes the entry of `addr`: the hash, then the front.
    pub(crate) fn upsert(&mut self, addr: IpAddr, info: IpInfo) -> Result<(), EbpfError> {
        self.hash
            .insert(translate::ip_key(addr), info, 0)
            .map_err(map_err(maps::IPCACHE, format!("insert {addr}")))?;
        self.v4.upsert(addr, info);
        Ok(())
    }

    /// Removes the entry of `addr`: the front, then the hash.
    pub(crate) fn remove(&mut self, addr: IpAddr) -> Result<(), EbpfError> {
        self.v4.remove(addr);
        removed(self.hash.remove(&translate::ip_key(addr)), maps::IPCACHE, addr)
    }

    /// Empties the front's slots that do not hold their address's entry of
    /// `want` (first in a full sync: the writes then fill free slots).
    pub(crate) fn sweep_front(&self, want: &BTreeMap<IpAddr, IpEntry>) {
        self.v4.sweep(want);
    }

    /// Removes the hash entries of addresses not in `want`.
    pub(crate) fn sweep(&mut self, want: &BTreeMap<IpAddr, IpEntry>) -> Result<(), EbpfError> {
        let want_ips: BTreeSet<IpKey> = want.keys().map(|a| translate::ip_key(*a)).collect();
        let stale: Vec<IpKey> = self
            .hash
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !want_ips.contains(k))
            .collect();
        for k in stale {
            removed(self.hash.remove(&k), maps::IPCACHE, translate::ip_from_key(&k))?;
        }
        Ok(())
    }

    /// `NPM_IPCACHE`, for reads.
    pub(crate) fn hash(&self) -> &BpfHashMap<MapData, IpKey, IpInfo> {
        &self.hash
    }

    /// The front, for reads.
    pub(crate) fn v4(&self) -> &Ipcache4 {
        &self.v4
    }
}

/// The distinct pod identities (`IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR`)
/// of an `NPM_IPCACHE`.
pub(crate) fn pod_identities(hash: &BpfHashMap<MapData, IpKey, IpInfo>) -> Result<usize, EbpfError> {
    let mut identities = BTreeSet::new();
    for e in hash.iter() {
        let (_, info) = e.map_err(|e: aya::maps::MapError| map_err(maps::IPCACHE, "iterate")(e))?;
        if (npm_common::IDENTITY_FIRST_POD..npm_common::IDENTITY_FIRST_CIDR).contains(&info.identity) {
            identities.insert(info.identity);
        }
    }
    Ok(identities.len())
}
