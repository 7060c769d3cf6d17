//! `NPM_TIERS`: the LPM trie of the ClusterNetworkPolicy tier entries,
//! keyed by [`npm_common::tier_key`] (the `NPM_POLICY` key layout with the
//! tier in the direction byte; see [`translate::tier_keys`]) -> the action,
//! rank and rule id of the entry ([`translate::tier_value`]). Written in
//! the order of the policy entries: upserts before the endpoints whose
//! tier flags point at them, removals after. Its front `NPM_TIER_FRONT`
//! ([`TierFront`]) is written with it: words after the LPM keys, removals
//! before them.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::MapData;
use aya::Ebpf;
use npm_common::{maps, PolicyKey, TierValue as KernelTierValue, POLICY_KEY_LEN};
use npm_policy::compiled::{Compiled, TierEntry, TierValue};

use super::errors::{map_err, removed, EbpfError};
use super::loader::take_map;
use super::tier_front::{tier_front_words, TierFront};
use super::translate;

/// `NPM_TIERS` and its front, written together.
pub(crate) struct TierTable {
    lpm: LpmTrie<MapData, [u8; POLICY_KEY_LEN], KernelTierValue>,
    front: TierFront,
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
            front: TierFront::new(take_map(bpf, maps::TIER_FRONT)?)?,
        })
    }

    /// Writes the keys of `entry` with its value, then its front words (a
    /// word whose bucket is full is left out: the endpoint's direction and
    /// tier then stay on the LPM).
    pub(crate) fn upsert(&mut self, entry: &TierEntry, value: &TierValue) -> Result<(), EbpfError> {
        let v = translate::tier_value(value);
        for k in translate::tier_keys(entry)? {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), v, 0)
                .map_err(map_err(maps::TIERS, format!("insert {entry:?}")))?;
        }
        for (k, w) in tier_front_words(entry, value).unwrap_or_default() {
            self.front.upsert(k, w);
        }
        Ok(())
    }

    /// Removes the keys of `entry` that no entry of `next` still produces
    /// (an entry of the same group may hold the same aligned block): its
    /// front words first, then its LPM keys.
    pub(crate) fn remove(&mut self, entry: &TierEntry, next: &Compiled) -> Result<(), EbpfError> {
        let mut still: BTreeSet<PolicyKey> = BTreeSet::new();
        let mut still_words: BTreeSet<u64> = BTreeSet::new();
        for (other, v) in group(next, entry) {
            still.extend(translate::tier_keys(other)?);
            still_words.extend(
                tier_front_words(other, v)
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(k, _)| k),
            );
        }
        // Every key the entry may have stored (whatever its value was).
        let any = TierValue {
            action: npm_policy::compiled::TierAction::Pass,
            rank: 0,
            rule: 0,
        };
        for (k, _) in tier_front_words(entry, &any).unwrap_or_default() {
            if !still_words.contains(&k) {
                self.front.remove(k);
            }
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

    /// After the removals of a batch: drops the front words an upserted
    /// entry left when its new value no longer fits the front (its
    /// endpoint's flag was cleared by then), and stores the words of
    /// upserted entries that found their bucket full before the removals.
    /// Returns whether a word was newly stored (the endpoints' front flags
    /// may then be set).
    pub(crate) fn refront<'a>(&mut self, upserts: impl IntoIterator<Item = (&'a TierEntry, &'a TierValue)>) -> bool {
        let mut placed = false;
        for (entry, value) in upserts {
            match tier_front_words(entry, value) {
                Some(words) => {
                    for (k, w) in words {
                        if !self.front.holds(k, w) {
                            placed |= self.front.upsert(k, w);
                        }
                    }
                }
                None => {
                    let any = TierValue { rank: 0, ..*value };
                    for (k, _) in tier_front_words(entry, &any).unwrap_or_default() {
                        self.front.remove(k);
                    }
                }
            }
        }
        placed
    }

    /// Stores the front words of `want` (key -> word, after their LPM
    /// keys).
    pub(crate) fn insert_words(&mut self, want: &BTreeMap<u64, u64>) {
        for (k, w) in want {
            self.front.upsert(*k, *w);
        }
    }

    /// Removes the front words whose key is not in `want`.
    pub(crate) fn sweep_words(&mut self, want: &BTreeMap<u64, u64>) {
        self.front.sweep(want);
    }

    /// The `EP_ADMIN_FRONT_*` / `EP_BASELINE_FRONT_*` flags of the
    /// endpoints of `next` that have tier entries.
    pub(crate) fn front_flags(&self, next: &Compiled) -> BTreeMap<u32, u32> {
        self.front.flags(next)
    }

    /// Words in the front.
    pub(crate) fn front_len(&self) -> usize {
        self.front.len()
    }

    /// Removes every key not in `want`.
    pub(crate) fn sweep_keys(&mut self, want: &BTreeMap<PolicyKey, KernelTierValue>) -> Result<(), EbpfError> {
        let stale: Vec<Key<[u8; POLICY_KEY_LEN]>> = self
            .lpm
            .keys()
            .filter_map(Result::ok)
            .filter(|k| {
                !want.contains_key(&PolicyKey {
                    prefix_len: k.prefix_len(),
                    data: k.data(),
                })
            })
            .collect();
        for k in stale {
            removed(self.lpm.remove(&k), maps::TIERS, "stale tier key")?;
        }
        Ok(())
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
