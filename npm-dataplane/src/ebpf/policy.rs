//! The policy maps: `NPM_POLICY`, the LPM trie of allow entries keyed by
//! [`PolicyKey`] (subject, direction, peer identity, protocol, port block;
//! see [`translate::policy_keys`]; the subject is the pod identity of the
//! endpoints the entry governs) -> rule id, which always holds every
//! entry, and its front `NPM_POLICY_FRONT` with the rule ids beside it
//! (`NPM_POLICY_FRONT_RULES`, [`PolicyFront`]). The front is
//! a subset of what the LPM allows at every moment: its words are stored
//! after their entry's LPM keys and removed before them.
//!
//! The subjects' policy flags (`EP_NO_*_PEER_*`, `EP_FRONT_*`, written
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
use super::policy_front::PolicyFront;
use super::translate;

/// `NPM_POLICY` and its front, written together.
pub(crate) struct PolicyTable {
    lpm: LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue>,
    front: PolicyFront,
    /// The subjects' policy flags, kept between applies.
    flags: PolicyFlags,
}

impl PolicyTable {
    /// Takes both maps out of the loaded object (mapping the front).
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let lpm = take_map(bpf, maps::POLICY)?;
        let front = PolicyFront::new(
            take_map(bpf, maps::POLICY_FRONT)?,
            take_map(bpf, maps::POLICY_FRONT_RULES)?,
        )?;
        Ok(PolicyTable {
            lpm,
            front,
            flags: PolicyFlags::default(),
        })
    }

    /// Writes `entry` with rule id `rule`: its LPM keys, then its front
    /// words with `rule` (a word whose bucket is full is simply left out:
    /// the subject's direction then stays on the LPM).
    pub(crate) fn upsert(&mut self, entry: &PolicyEntry, rule: u32) -> Result<(), EbpfError> {
        let value = translate::policy_value(rule);
        for k in translate::policy_keys(entry)? {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), value, 0)
                .map_err(map_err(maps::POLICY, format!("insert {entry:?}")))?;
        }
        for w in translate::front_words(entry).unwrap_or_default() {
            self.front.insert(w, rule);
        }
        Ok(())
    }

    /// Removes the keys of `entry` that no entry of `next` still produces
    /// (two entries of one peer and protocol may share an aligned block):
    /// its front words first, then its LPM keys. A word another entry still
    /// produces stays, with that entry's rule.
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
        let mut still_words: BTreeMap<u64, u32> = BTreeMap::new();
        for (other, rule) in next.policy.range(lo..=hi) {
            if other.ports.0 <= other.ports.1 || other.protocol.is_none() {
                still.extend(translate::policy_keys(other)?);
                for w in translate::front_words(other).unwrap_or_default() {
                    still_words.insert(w, *rule);
                }
            }
        }
        for w in translate::front_words(entry).unwrap_or_default() {
            match still_words.get(&w) {
                Some(rule) if self.front.contains(w) => {
                    self.front.insert(w, *rule);
                }
                Some(_) => {}
                None => self.front.remove(w),
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

    /// Removes the front words not in `want` (word -> rule; first in a
    /// full sync: the front never allows what the LPM does not).
    pub(crate) fn sweep_front(&mut self, want: &BTreeMap<u64, u32>) {
        self.front.sweep(want);
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

    /// Stores the front words of `want` (word -> rule; after their LPM
    /// keys), each with its rule (rewritten in place for a stored word).
    pub(crate) fn insert_words(&mut self, want: &BTreeMap<u64, u32>) {
        for (w, rule) in want {
            self.front.insert(*w, *rule);
        }
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
    /// flags are [`translate::EP_NO_PEER_ALL`] |
    /// [`FRONT_ALL`](super::FRONT_ALL). Called after the batch's upserts.
    pub(crate) fn subject_flags(&mut self, next: &Compiled) -> &BTreeMap<u32, u32> {
        let front = &self.front;
        self.flags.compute(next, |e| {
            translate::front_word_iter(e).is_some_and(|mut w| w.all(|w| front.contains(w)))
        })
    }

    /// Words in the front.
    pub(crate) fn front_len(&self) -> usize {
        self.front.len()
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
