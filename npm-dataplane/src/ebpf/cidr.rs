//! `NPM_CIDRS`: the LPM trie of CIDR prefixes -> CIDR identity, keyed by
//! [`translate::cidr_key`] (IPv4-mapped, an IPv4 prefix `n` stored as
//! `96 + n`); the datapath looks a peer up here when the ipcache has no
//! CIDR identity for it.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::MapData;
use aya::Ebpf;
use ipnet::IpNet;
use npm_common::maps;

use super::errors::{map_err, removed, EbpfError};
use super::loader::take_map;
use super::translate;

/// The opened `NPM_CIDRS`.
pub(crate) struct CidrTable {
    trie: LpmTrie<MapData, [u8; 16], u32>,
}

impl CidrTable {
    /// Takes the map out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(CidrTable {
            trie: take_map(bpf, maps::CIDRS)?,
        })
    }

    /// Writes the identity of `net`.
    pub(crate) fn upsert(&mut self, net: &IpNet, identity: u32) -> Result<(), EbpfError> {
        let (len, addr) = translate::cidr_key(net);
        self.trie
            .insert(&Key::new(len, addr), identity, 0)
            .map_err(map_err(maps::CIDRS, format!("insert {net}")))
    }

    /// Removes the prefixes of `gone` whose key no prefix of `next` still
    /// has.
    pub(crate) fn remove(&mut self, gone: &[IpNet], next: &BTreeMap<IpNet, u32>) -> Result<(), EbpfError> {
        if gone.is_empty() {
            return Ok(());
        }
        let still: BTreeSet<(u32, [u8; 16])> = next.keys().map(translate::cidr_key).collect();
        for net in gone {
            let k = translate::cidr_key(net);
            if !still.contains(&k) {
                removed(self.trie.remove(&Key::new(k.0, k.1)), maps::CIDRS, net)?;
            }
        }
        Ok(())
    }

    /// Removes every prefix not in `want`.
    pub(crate) fn sweep(&mut self, want: &BTreeMap<IpNet, u32>) -> Result<(), EbpfError> {
        let want: BTreeSet<(u32, [u8; 16])> = want.keys().map(translate::cidr_key).collect();
        let stale: Vec<Key<[u8; 16]>> = self
            .trie
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !want.contains(&(k.prefix_len(), k.data())))
            .collect();
        for k in stale {
            removed(self.trie.remove(&k), maps::CIDRS, "stale prefix")?;
        }
        Ok(())
    }

    /// The trie, for reads.
    pub(crate) fn trie(&self) -> &LpmTrie<MapData, [u8; 16], u32> {
        &self.trie
    }
}
