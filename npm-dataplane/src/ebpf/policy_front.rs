//! `NPM_POLICY_FRONT`, the policy front: a hash table of
//! [`policy_front_word`]s in 4-word buckets, written through a shared
//! mapping of the array and probed by the datapath with inlined array
//! reads instead of an LPM walk.
//!
//! A word is an allow of one (endpoint, direction, peer identity, protocol,
//! port), or of any port of a protocol, or of any protocol. It is stored
//! only in its own bucket ([`policy_front_bucket`]); when the four slots
//! there are taken the word is not stored, and its endpoint's direction
//! keeps using `NPM_POLICY`. The datapath trusts the front for an endpoint
//! direction only while the endpoint record carries `EP_FRONT_<dir>`,
//! which the loader sets when every word of that direction's entries is
//! here. `NPM_POLICY` always holds every entry.
//!
//! Each change is one aligned 64-bit store, so a packet sees a slot before
//! or after it, never half of it. The order of writes keeps the front a
//! subset of what `NPM_POLICY` allows at every moment: a word is stored
//! after its entry's LPM keys and removed before them.

use std::collections::{BTreeSet, HashMap};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{Array, IterableMap, MapData};
use npm_common::{maps, policy_front_bucket, sizes};

use super::errors::EbpfError;
use super::shared_words::SharedWords;

/// Words per bucket.
const WAYS: usize = 4;

/// The mapped `NPM_POLICY_FRONT` array and where each stored word is.
pub(crate) struct PolicyFront {
    slots: SharedWords,
    /// Stored word -> slot index (the loader is the only writer).
    placed: HashMap<u64, usize>,
    /// Keeps the map (and its fd) alive as long as the mapping.
    _map: Array<MapData, [u64; 4]>,
}

impl PolicyFront {
    /// Maps the array (created with `BPF_F_MMAPABLE` by the object) and
    /// learns the words already there (adopted pins).
    pub(crate) fn new(map: Array<MapData, [u64; 4]>) -> Result<Self, EbpfError> {
        let fd = map.map().fd().as_fd().as_raw_fd();
        let slots = SharedWords::map(fd, sizes::POLICY_FRONT_BUCKETS as usize * WAYS, maps::POLICY_FRONT)?;
        let mut placed = HashMap::new();
        for (i, s) in slots.words().iter().enumerate() {
            let w = s.load(Ordering::Acquire);
            if w == 0 {
                continue;
            }
            if placed.contains_key(&w) || policy_front_bucket(w) as usize != i / WAYS {
                // Not a word this loader would have stored there: drop it.
                s.store(0, Ordering::Release);
            } else {
                placed.insert(w, i);
            }
        }
        Ok(PolicyFront {
            slots,
            placed,
            _map: map,
        })
    }

    fn slots(&self) -> &[AtomicU64] {
        self.slots.words()
    }

    /// Stores `word` (after its entry's LPM keys were written). Returns
    /// false when its bucket is full: the word is not in the front.
    pub(crate) fn insert(&mut self, word: u64) -> bool {
        if self.placed.contains_key(&word) {
            return true;
        }
        let base = policy_front_bucket(word) as usize * WAYS;
        for i in base..base + WAYS {
            let slot = &self.slots()[i];
            if slot.load(Ordering::Acquire) == 0 {
                slot.store(word, Ordering::Release);
                self.placed.insert(word, i);
                return true;
            }
        }
        false
    }

    /// Removes `word` (before its entry's LPM keys are removed).
    pub(crate) fn remove(&mut self, word: u64) {
        if let Some(i) = self.placed.remove(&word) {
            self.slots()[i].store(0, Ordering::Release);
        }
    }

    /// Whether the front holds `word`.
    pub(crate) fn contains(&self, word: u64) -> bool {
        self.placed.contains_key(&word)
    }

    /// Removes every word not in `want`. Returns how many were removed.
    pub(crate) fn sweep(&mut self, want: &BTreeSet<u64>) -> usize {
        let stale: Vec<u64> = self.placed.keys().filter(|w| !want.contains(w)).copied().collect();
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
