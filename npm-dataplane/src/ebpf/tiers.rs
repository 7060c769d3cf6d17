//! `NPM_TIERS`: the LPM trie of the ClusterNetworkPolicy tier entries,
//! keyed by [`npm_common::tier_key`] (the `NPM_POLICY` key layout with the
//! tier in the direction byte; see [`translate::tier_keys`]) -> the action,
//! rank and rule id of the entry ([`translate::tier_value`]). Written in
//! the order of the policy entries: upserts before the endpoints whose
//! tier flags point at them, removals after.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::MapData;
use aya::Ebpf;
use npm_common::{maps, PolicyKey, TierValue as KernelTierValue, POLICY_KEY_LEN};
use npm_policy::compiled::{Compiled, TierEntry, TierValue};

use super::errors::{map_err, removed, EbpfError};
use super::loader::take_map;
use super::translate;

/// `NPM_TIERS`.
pub(crate) struct TierTable {
    lpm: LpmTrie<MapData, [u8; POLICY_KEY_LEN], KernelTierValue>,
}

/// The entries of `compiled` that may share LPM keys with `entry`: the same
/// endpoint, direction, tier, peer and protocol (every port range).
fn group<'a>(compiled: &'a Compiled, entry: &TierEntry) -> impl Iterator<Item = (&'a TierEntry, &'a TierValue)> {
    let lo = TierEntry {
        ports: (0, 0),
        ..*entry
    };
    let hi = TierEntry {
        ports: (u16::MAX, u16::MAX),
        ..*entry
    };
    compiled
        .tiers
        .range(lo..=hi)
        .filter(|(e, _)| e.ports.0 <= e.ports.1 || e.protocol.is_none())
}

/// The distinct `NPM_TIERS` keys of the entries of `compiled` in the group
/// of `entry` (for `npm_map_entries`).
pub(crate) fn group_keys(compiled: &Compiled, entry: &TierEntry) -> usize {
    let mut keys: BTreeSet<PolicyKey> = BTreeSet::new();
    for (e, _) in group(compiled, entry) {
        if let Ok(k) = translate::tier_keys(e) {
            keys.extend(k);
        }
    }
    keys.len()
}

impl TierTable {
    /// Takes the map out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(TierTable {
            lpm: take_map(bpf, maps::TIERS)?,
        })
    }

    /// Writes the keys of `entry` with its value.
    pub(crate) fn upsert(&mut self, entry: &TierEntry, value: &TierValue) -> Result<(), EbpfError> {
        let v = translate::tier_value(value);
        for k in translate::tier_keys(entry)? {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), v, 0)
                .map_err(map_err(maps::TIERS, format!("insert {entry:?}")))?;
        }
        Ok(())
    }

    /// Removes the keys of `entry` that no entry of `next` still produces
    /// (an entry of the same group may hold the same aligned block).
    pub(crate) fn remove(&mut self, entry: &TierEntry, next: &Compiled) -> Result<(), EbpfError> {
        let mut still: BTreeSet<PolicyKey> = BTreeSet::new();
        for (other, _) in group(next, entry) {
            still.extend(translate::tier_keys(other)?);
        }
        for k in translate::tier_keys(entry)? {
            if !still.contains(&k) {
                removed(
                    self.lpm.remove(&Key::new(k.prefix_len, k.data)),
                    maps::TIERS,
                    format!("{entry:?}"),
                )?;
            }
        }
        Ok(())
    }

    /// Writes every key of `want`.
    pub(crate) fn insert_keys(&mut self, want: &BTreeMap<PolicyKey, KernelTierValue>) -> Result<(), EbpfError> {
        for (k, v) in want {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), *v, 0)
                .map_err(map_err(maps::TIERS, format!("insert {k:?}")))?;
        }
        Ok(())
    }

    /// Removes every key not in `want`.
    pub(crate) fn sweep_keys(&mut self, want: &BTreeMap<PolicyKey, KernelTierValue>) -> Result<(), EbpfError> {
        super::policy::sweep_lpm(&mut self.lpm, want, maps::TIERS, "stale tier key")
    }

    /// The LPM trie, for reads.
    pub(crate) fn lpm(&self) -> &LpmTrie<MapData, [u8; POLICY_KEY_LEN], KernelTierValue> {
        &self.lpm
    }
}

/// Every `NPM_TIERS` key of `compiled` with its value (a full sync's
/// "mark" set).
pub(crate) fn want_keys(compiled: &Compiled) -> Result<BTreeMap<PolicyKey, KernelTierValue>, EbpfError> {
    let mut want = BTreeMap::new();
    for (entry, value) in &compiled.tiers {
        let v = translate::tier_value(value);
        for k in translate::tier_keys(entry)? {
            want.insert(k, v);
        }
    }
    Ok(want)
}
