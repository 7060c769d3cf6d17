//! `NPM_TIER_FRONT`, the tier front: a hash table of
//! [`tier_front_word`]s in 4-word buckets, written through a shared mapping
//! of the array and probed by the datapath with inlined array reads
//! instead of an `NPM_TIERS` LPM walk.
//!
//! A word is one (endpoint, direction, tier, peer identity, port class)
//! key's tag together with its value (action and rank): the port class is
//! any protocol, any port of a protocol, one port, or an aligned block of
//! 64 ports (an entry's range is expanded into exact ports at its edges and
//! blocks inside). Because the tag and the value are one word, each change
//! (a new key, a new value for a key, a removal) is one aligned 64-bit
//! store: a packet sees a slot before or after it, never a key with
//! another key's value. A key lives only in its own bucket
//! ([`tier_front_slot`]); when the four slots there are taken it is not
//! stored, and its endpoint's direction and tier keep using `NPM_TIERS`.
//! The datapath trusts the front for an endpoint direction and tier only
//! while the endpoint record carries `EP_ADMIN_FRONT_<dir>` /
//! `EP_BASELINE_FRONT_<dir>`, which the writer sets when every word of
//! those entries is here with its current value. `NPM_TIERS` always holds
//! every entry. Writes follow `NPM_TIERS`: words after the LPM keys,
//! removals before them.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd};
use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{Array, IterableMap, MapData};
use npm_common::{
    maps, policy_front_proto, sizes, tier_front_key, tier_front_key_of, tier_front_pc_any_port, tier_front_pc_block,
    tier_front_pc_exact, tier_front_slot, tier_front_word, EP_ADMIN_FRONT_INGRESS, EP_BASELINE_FRONT_INGRESS,
    TIER_FRONT_BLOCK_BITS, TIER_FRONT_MAX_ENDPOINT, TIER_FRONT_MAX_IDENTITY, TIER_FRONT_PC_ANY_PROTO,
};
use npm_policy::compiled::{Compiled, Tier, TierEntry, TierValue};

use super::errors::EbpfError;
use super::shared_words::SharedWords;
use super::translate;

/// Words per bucket.
const WAYS: usize = 4;

/// Most words one tier entry may take (its range's edge ports and 64-port
/// blocks); an entry needing more keeps its endpoint's direction and tier
/// on `NPM_TIERS`.
pub const TIER_FRONT_MAX_WORDS: usize = 256;

/// The `NPM_TIER_FRONT` words of a tier entry with its value, as (key,
/// word) pairs: one "any protocol" word for an entry without protocol, one
/// "any port" word for a whole protocol, else one word per port at the
/// edges of the range and one per aligned 64-port block inside it. `None`
/// when the entry does not fit the front: an endpoint id or peer identity
/// beyond the key's fields, a rank beyond the word's, a protocol other
/// than TCP, UDP and SCTP, an empty range, or more than
/// [`TIER_FRONT_MAX_WORDS`] words.
pub fn tier_front_words(entry: &TierEntry, value: &TierValue) -> Option<Vec<(u64, u64)>> {
    let ep = entry.endpoint;
    if ep == 0 || ep >= TIER_FRONT_MAX_ENDPOINT || entry.peer >= TIER_FRONT_MAX_IDENTITY {
        return None;
    }
    let flags = translate::tier_value(value).flags;
    let (dir, tier, peer) = (entry.direction.as_u8(), translate::tier_bit(entry.tier), entry.peer);
    let key = |pc| tier_front_key(ep, dir, tier, peer, pc);
    let mut pcs = Vec::new();
    match entry.protocol {
        None => pcs.push(TIER_FRONT_PC_ANY_PROTO),
        Some(protocol) => {
            let code = policy_front_proto(protocol.number());
            let (lo, hi) = entry.ports;
            if code == 0 || lo > hi {
                return None;
            }
            if (lo, hi) == (0, u16::MAX) {
                pcs.push(tier_front_pc_any_port(code));
            } else {
                let block = 1u32 << TIER_FRONT_BLOCK_BITS;
                let mut p = u32::from(lo);
                let end = u32::from(hi);
                while p <= end {
                    if p % block == 0 && p + block - 1 <= end {
                        pcs.push(tier_front_pc_block(code, p as u16));
                        p += block;
                    } else {
                        pcs.push(tier_front_pc_exact(code, p as u16));
                        p += 1;
                    }
                    if pcs.len() > TIER_FRONT_MAX_WORDS {
                        return None;
                    }
                }
            }
        }
    }
    pcs.into_iter()
        .map(|pc| {
            let k = key(pc);
            tier_front_word(k, flags).map(|w| (k, w))
        })
        .collect()
}

/// The endpoint flag telling that a tier of a direction is complete in the
/// front.
pub(crate) fn front_flag(entry: &TierEntry) -> u32 {
    let f = match entry.tier {
        Tier::Admin => EP_ADMIN_FRONT_INGRESS,
        Tier::Baseline => EP_BASELINE_FRONT_INGRESS,
    };
    f << entry.direction.as_u8()
}

/// The mapped `NPM_TIER_FRONT` array and where each stored key is.
pub(crate) struct TierFront {
    slots: SharedWords,
    /// Stored key -> (slot index, word) (the loader is the only writer).
    placed: HashMap<u64, (usize, u64)>,
    /// Keeps the map (and its fd) alive as long as the mapping.
    _map: Array<MapData, [u64; 4]>,
}

impl TierFront {
    /// Maps the array (created with `BPF_F_MMAPABLE` by the object) and
    /// learns the words already there (adopted pins): each word's key is
    /// recovered from its bucket and tag.
    pub(crate) fn new(map: Array<MapData, [u64; 4]>) -> Result<Self, EbpfError> {
        let fd = map.map().fd().as_fd().as_raw_fd();
        let slots = SharedWords::map(fd, sizes::TIER_FRONT_BUCKETS as usize * WAYS, maps::TIER_FRONT)?;
        let mut placed = HashMap::new();
        for (i, s) in slots.words().iter().enumerate() {
            let w = s.load(Ordering::Acquire);
            if w == 0 {
                continue;
            }
            let key = tier_front_key_of((i / WAYS) as u32, w);
            match placed.entry(key) {
                // Not a word this loader would have stored: a key is in one
                // slot only (the datapath reads the first).
                std::collections::hash_map::Entry::Occupied(_) => s.store(0, Ordering::Release),
                std::collections::hash_map::Entry::Vacant(v) => {
                    v.insert((i, w));
                }
            }
        }
        Ok(TierFront {
            slots,
            placed,
            _map: map,
        })
    }

    fn slots(&self) -> &[AtomicU64] {
        self.slots.words()
    }

    /// Stores `word` for `key`: over the key's slot when it is stored (one
    /// store replaces the value), else in a free slot of its bucket.
    /// Returns false when the bucket is full: the key is not in the front.
    pub(crate) fn upsert(&mut self, key: u64, word: u64) -> bool {
        if let Some((i, w)) = self.placed.get_mut(&key) {
            if *w != word {
                self.slots.words()[*i].store(word, Ordering::Release);
                *w = word;
            }
            return true;
        }
        let base = tier_front_slot(key).0 as usize * WAYS;
        for i in base..base + WAYS {
            let slot = &self.slots()[i];
            if slot.load(Ordering::Acquire) == 0 {
                slot.store(word, Ordering::Release);
                self.placed.insert(key, (i, word));
                return true;
            }
        }
        false
    }

    /// Removes the word of `key`.
    pub(crate) fn remove(&mut self, key: u64) {
        if let Some((i, _)) = self.placed.remove(&key) {
            self.slots()[i].store(0, Ordering::Release);
        }
    }

    /// Whether the front holds exactly `word` for `key`.
    pub(crate) fn holds(&self, key: u64, word: u64) -> bool {
        self.placed.get(&key).is_some_and(|(_, w)| *w == word)
    }

    /// Removes every key not in `want`. Returns how many were removed.
    pub(crate) fn sweep(&mut self, want: &BTreeMap<u64, u64>) -> usize {
        let stale: Vec<u64> = self.placed.keys().filter(|k| !want.contains_key(k)).copied().collect();
        for k in &stale {
            self.remove(*k);
        }
        stale.len()
    }

    /// Words stored.
    pub(crate) fn len(&self) -> usize {
        self.placed.len()
    }

    /// The front flags of every endpoint that has tier entries (endpoint id
    /// -> `EP_ADMIN_FRONT_*` / `EP_BASELINE_FRONT_*`): set for a direction
    /// and tier when every entry of it fits the front and its words are
    /// stored with the entry's current value.
    pub(crate) fn flags(&self, next: &Compiled) -> BTreeMap<u32, u32> {
        // (endpoint -> flags that some entry rules out, flags seen).
        let mut seen: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        for (e, v) in &next.tiers {
            let f = front_flag(e);
            let s = seen.entry(e.endpoint).or_default();
            s.1 |= f;
            if s.0 & f != 0 {
                continue;
            }
            let held = tier_front_words(e, v).is_some_and(|w| w.iter().all(|(k, w)| self.holds(*k, *w)));
            if !held {
                s.0 |= f;
            }
        }
        seen.into_iter().map(|(id, (out, all))| (id, all & !out)).collect()
    }
}

/// Every front (key, word) of `compiled`'s tier entries that fit (a full
/// sync's "mark" set).
pub(crate) fn want_words(compiled: &Compiled) -> BTreeMap<u64, u64> {
    compiled
        .tiers
        .iter()
        .filter_map(|(e, v)| tier_front_words(e, v))
        .flatten()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::{tier_flags, tier_front_hit, TIER_ACCEPT};
    use npm_policy::compiled::{Direction, TierAction};
    use npm_policy::model::Protocol;

    fn entry(protocol: Option<Protocol>, lo: u16, hi: u16) -> TierEntry {
        TierEntry {
            endpoint: 7,
            direction: Direction::Egress,
            tier: Tier::Admin,
            peer: 300,
            protocol,
            ports: (lo, hi),
        }
    }
    const V: TierValue = TierValue {
        action: TierAction::Accept,
        rank: 9,
        rule: 4,
    };

    #[test]
    fn words_of_each_entry_form() {
        assert_eq!(tier_front_words(&entry(None, 0, 0), &V).unwrap().len(), 1);
        assert_eq!(
            tier_front_words(&entry(Some(Protocol::Tcp), 0, u16::MAX), &V)
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            tier_front_words(&entry(Some(Protocol::Tcp), 80, 80), &V).unwrap().len(),
            1
        );
        // 0..=1023: 16 blocks; 60..=200: 4 edge ports, 2 blocks, 9 ports.
        assert_eq!(
            tier_front_words(&entry(Some(Protocol::Udp), 0, 1023), &V)
                .unwrap()
                .len(),
            16
        );
        assert_eq!(
            tier_front_words(&entry(Some(Protocol::Udp), 60, 200), &V)
                .unwrap()
                .len(),
            4 + 2 + 9
        );
        let (k, w) = tier_front_words(&entry(Some(Protocol::Sctp), 443, 443), &V).unwrap()[0];
        assert_eq!(tier_front_hit(w, tier_front_slot(k).1), tier_flags(TIER_ACCEPT, 9));
        // Too many words, an empty range, ids and ranks beyond the fields.
        assert_eq!(tier_front_words(&entry(Some(Protocol::Tcp), 1, 65534), &V), None);
        assert_eq!(tier_front_words(&entry(Some(Protocol::Tcp), 5, 4), &V), None);
        let big_ep = TierEntry {
            endpoint: TIER_FRONT_MAX_ENDPOINT,
            ..entry(None, 0, 0)
        };
        assert_eq!(tier_front_words(&big_ep, &V), None);
        let big_rank = TierValue {
            rank: npm_common::TIER_FRONT_MAX_RANK,
            ..V
        };
        assert_eq!(tier_front_words(&entry(None, 0, 0), &big_rank), None);
    }
}
