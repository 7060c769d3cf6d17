//! `NPM_POLICY_FRONT`, the policy front: a hash table of
//! [`policy_front_word`]s in 4-word buckets, written through a shared
//! mapping of the array and probed by the datapath with inlined array
//! reads instead of an LPM walk; and beside it `NPM_POLICY_FRONT_RULES`,
//! the rule id of each slot's word ([`policy_front_rule`], 0 unknown),
//! which the datapath reads from the slot that matched to count the
//! allowing rule without an `NPM_POLICY` lookup.
//!
//! A word is an allow of one (subject, direction, peer identity, protocol,
//! port), or of any port of a protocol, or of any protocol; the subject is
//! the pod identity of the endpoints it governs. It is stored
//! only in its own bucket ([`policy_front_bucket`]); when the four slots
//! there are taken the word is not stored, and its subject's direction
//! keeps using `NPM_POLICY`. The datapath trusts the front for an endpoint
//! direction only while the endpoint record carries `EP_FRONT_<dir>`,
//! which the loader sets when every word of that direction's entries of
//! the endpoint's subject is here. `NPM_POLICY` always holds every entry.
//!
//! Each change is one aligned 64-bit (word) or 32-bit (rule) store, so a
//! packet sees a slot before or after it, never half of it. The order of
//! writes keeps the front a subset of what `NPM_POLICY` allows at every
//! moment: a word is stored after its entry's LPM keys and removed before
//! them. Verdicts come only from the words; the rules only say which rule
//! to count. A slot's rule is stored before its word and cleared after
//! the word is removed (so a slot reused by another word never shows the
//! new word with the old rule, and the datapath, which reads the word again
//! after the rule, counts a torn read as unknown). A word that two entries
//! produce carries the rule of one of them: the last written, and after
//! one of them is removed, the other's ([`PolicyFront::insert`] again).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use aya::maps::{Array, IterableMap, MapData};
use npm_common::{front_shift, maps, policy_front_bucket, policy_front_rule, POLICY_FRONT_RULE_UNKNOWN};

use super::errors::EbpfError;
use super::loader::check_front_buckets;
use super::shared_words::{SharedWords, SharedWords32};

/// Words per bucket.
const WAYS: usize = 4;

/// The mapped `NPM_POLICY_FRONT` and `NPM_POLICY_FRONT_RULES` arrays and
/// where each stored word is.
pub(crate) struct PolicyFront {
    slots: SharedWords,
    rules: SharedWords32,
    /// Stored word -> slot index (the loader is the only writer).
    placed: HashMap<u64, usize>,
    /// The [`front_shift`] of the front's buckets as loaded (the program's
    /// `NPM_POLICY_FRONT_SHIFT`).
    shift: u32,
    /// Keep the maps (and their fds) alive as long as the mappings.
    _map: Array<MapData, [u64; 4]>,
    _rules_map: Array<MapData, [u32; 4]>,
}

impl PolicyFront {
    /// Maps both arrays (created with `BPF_F_MMAPABLE` by the object) and
    /// learns the words already there (adopted pins). An adopted word
    /// keeps its adopted rule (a rules map created beside older pins
    /// starts unknown, 0) until the next write of it; the rule of a slot
    /// without a word is cleared. The buckets are the map's as loaded (the
    /// loader gave the program the same number, and the rules array the
    /// same size).
    pub(crate) fn new(map: Array<MapData, [u64; 4]>, rules_map: Array<MapData, [u32; 4]>) -> Result<Self, EbpfError> {
        let (slots, buckets) = SharedWords::map_array(map.map(), WAYS, maps::POLICY_FRONT)?;
        let (rules, rule_buckets) = SharedWords32::map_array(rules_map.map(), WAYS, maps::POLICY_FRONT_RULES)?;
        check_front_buckets(maps::POLICY_FRONT, buckets)?;
        if rule_buckets != buckets {
            return Err(EbpfError::FrontSize {
                map: maps::POLICY_FRONT_RULES,
                buckets: rule_buckets,
                min: buckets,
                max: buckets,
            });
        }
        let shift = front_shift(buckets);
        let mut placed = HashMap::new();
        for (i, (s, r)) in slots.words().iter().zip(rules.words()).enumerate() {
            let w = s.load(Ordering::Acquire);
            if w != 0 && !placed.contains_key(&w) && policy_front_bucket(w, shift) as usize == i / WAYS {
                placed.insert(w, i);
                continue;
            }
            if w != 0 {
                // Not a word this loader would have stored there: drop it.
                s.store(0, Ordering::Release);
            }
            if r.load(Ordering::Acquire) != POLICY_FRONT_RULE_UNKNOWN {
                r.store(POLICY_FRONT_RULE_UNKNOWN, Ordering::Release);
            }
        }
        Ok(PolicyFront {
            slots,
            rules,
            placed,
            shift,
            _map: map,
            _rules_map: rules_map,
        })
    }

    fn slots(&self) -> &[AtomicU64] {
        self.slots.words()
    }

    fn rules(&self) -> &[AtomicU32] {
        self.rules.words()
    }

    /// Stores `word` allowed by rule `rule` (after its entry's LPM keys
    /// were written): the rule first, then the word. A word already stored
    /// gets `rule` in place (the datapath counts the old or the new one).
    /// Returns false when its bucket is full: the word is not in the front.
    pub(crate) fn insert(&mut self, word: u64, rule: u32) -> bool {
        let code = policy_front_rule(rule);
        if let Some(&i) = self.placed.get(&word) {
            let r = &self.rules()[i];
            if r.load(Ordering::Acquire) != code {
                r.store(code, Ordering::Release);
            }
            return true;
        }
        let base = policy_front_bucket(word, self.shift) as usize * WAYS;
        for i in base..base + WAYS {
            let slot = &self.slots()[i];
            if slot.load(Ordering::Acquire) == 0 {
                self.rules()[i].store(code, Ordering::Release);
                slot.store(word, Ordering::Release);
                self.placed.insert(word, i);
                return true;
            }
        }
        false
    }

    /// Removes `word` (before its entry's LPM keys are removed), then
    /// clears its slot's rule.
    pub(crate) fn remove(&mut self, word: u64) {
        if let Some(i) = self.placed.remove(&word) {
            self.slots()[i].store(0, Ordering::Release);
            self.rules()[i].store(POLICY_FRONT_RULE_UNKNOWN, Ordering::Release);
        }
    }

    /// Whether the front holds `word`.
    pub(crate) fn contains(&self, word: u64) -> bool {
        self.placed.contains_key(&word)
    }

    /// Removes every word not in `want` (word -> rule). Returns how many
    /// were removed.
    pub(crate) fn sweep(&mut self, want: &BTreeMap<u64, u32>) -> usize {
        let stale: Vec<u64> = self.placed.keys().filter(|w| !want.contains_key(w)).copied().collect();
        for w in &stale {
            self.remove(*w);
        }
        stale.len()
    }

    /// Words stored.
    pub(crate) fn len(&self) -> usize {
        self.placed.len()
    }
}
