//! The policy maps: `NPM_POLICY`, the LPM trie of allow entries keyed by
//! [`PolicyKey`] (subject, direction, peer identity, protocol, port block;
//! see [`translate::policy_keys`]; the subject is the pod identity of the
//! endpoints the entry governs) -> rule id.
//!
//! The subjects' policy flags (`EP_NO_*_PEER_*`, written
//! into every endpoint record of the subject) are kept between applies and
//! recounted for the entry groups a diff touches (`policy_flags.rs`).

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::MapData;
use aya::Ebpf;
use npm_common::{maps, PolicyKey, PolicyValue, POLICY_KEY_LEN};
use npm_policy::compiled::{Compiled, MapDiff, PolicyEntry};

use super::errors::{map_err, removed, EbpfError};
use super::loader::take_map;
use super::policy_flags::PolicyFlags;
use super::translate;

/// `NPM_POLICY` and its subjects' flags.
pub(crate) struct PolicyTable {
    lpm: LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue>,
    /// The subjects' policy flags, kept between applies.
    flags: PolicyFlags,
}

impl PolicyTable {
    /// Takes the map out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(PolicyTable {
            lpm: take_map(bpf, maps::POLICY)?,
            flags: PolicyFlags::default(),
        })
    }

    /// Writes `entry` with rule id `rule`: its LPM keys.
    pub(crate) fn upsert(&mut self, entry: &PolicyEntry, rule: u32) -> Result<(), EbpfError> {
        let value = translate::policy_value(rule);
        for k in translate::policy_keys(entry)? {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), value, 0)
                .map_err(map_err(maps::POLICY, format!("insert {entry:?}")))?;
        }
        Ok(())
    }

    /// Removes the keys of `entry` that no entry of `next` still produces
    /// (two entries of one peer and protocol may share an aligned block).
    pub(crate) fn remove(&mut self, entry: &PolicyEntry, next: &Compiled) -> Result<(), EbpfError> {
        let lo = PolicyEntry {
            ports: (0, 0),
            ..*entry
        };
        let hi = PolicyEntry {
            ports: (u16::MAX, u16::MAX),
            ..*entry
        };
        let mut still: BTreeSet<PolicyKey> = BTreeSet::new();
        for (other, _) in next.policy.range(lo..=hi) {
            if other.ports.0 <= other.ports.1 || other.protocol.is_none() {
                still.extend(translate::policy_keys(other)?);
            }
        }
        for k in translate::policy_keys(entry)? {
            if !still.contains(&k) {
                removed(
                    self.lpm.remove(&Key::new(k.prefix_len, k.data)),
                    maps::POLICY,
                    format!("{entry:?}"),
                )?;
            }
        }
        Ok(())
    }

    /// Writes the LPM keys of `want` (key -> rule id).
    pub(crate) fn insert_keys(&mut self, want: &BTreeMap<PolicyKey, u32>) -> Result<(), EbpfError> {
        for (k, rule) in want {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), translate::policy_value(*rule), 0)
                .map_err(map_err(maps::POLICY, format!("insert {k:?}")))?;
        }
        Ok(())
    }

    /// Removes every LPM key not in `want`.
    pub(crate) fn sweep_keys(&mut self, want: &BTreeMap<PolicyKey, u32>) -> Result<(), EbpfError> {
        sweep_lpm(&mut self.lpm, want, maps::POLICY, "stale policy key")
    }

    /// Records the entry groups an apply's policy changes touch: outside
    /// a full sync only those are counted again by
    /// [`PolicyTable::subject_flags`]. Called before the batch's first
    /// write.
    pub(crate) fn begin_apply(&mut self, diff: &MapDiff<PolicyEntry, u32>) {
        self.flags.begin_apply(diff);
    }

    /// A full sync starts: every subject is counted again.
    pub(crate) fn begin_sync(&mut self) {
        self.flags.begin_sync();
    }

    /// Ends a batch (an apply or a full sync); after a failed one every
    /// subject is counted again.
    pub(crate) fn end_batch(&mut self, ok: bool) {
        self.flags.end_batch(ok);
    }

    /// The policy flags of every subject of `next` that has policy entries
    /// (subject -> flags, for each endpoint of that subject; see
    /// `policy_flags.rs`): a subject missing has no entry, its endpoints'
    /// flags are [`translate::EP_NO_PEER_ALL`]. Called after the batch's
    /// upserts.
    pub(crate) fn subject_flags(&mut self, next: &Compiled) -> &BTreeMap<u32, u32> {
        self.flags.compute(next)
    }

    /// The LPM trie, for reads.
    pub(crate) fn lpm(&self) -> &LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue> {
        &self.lpm
    }
}

/// Removes every key of `lpm` (the policy-key LPM trie `map`: `NPM_POLICY`
/// or `NPM_TIERS`) that is not in `want`; `what` names a key in an error.
pub(crate) fn sweep_lpm<V: aya::Pod, W>(
    lpm: &mut LpmTrie<MapData, [u8; POLICY_KEY_LEN], V>,
    want: &BTreeMap<PolicyKey, W>,
    map: &'static str,
    what: &'static str,
) -> Result<(), EbpfError> {
    let stale: Vec<Key<[u8; POLICY_KEY_LEN]>> = lpm
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
        removed(lpm.remove(&k), map, what)?;
    }
    Ok(())
}
