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
//!
//! A word's rank is not the compiler's (`priority << 20 | …`, up to 2^30)
//! but its loader-given front rank ([`ranks`]: 14 bits, the same order
//! within the endpoint, direction and tier).
//!
//! Each (endpoint, direction, identity) with words also has a shared
//! summary word ([`npm_common::TIER_FRONT_PC_SHARED_SUMMARY`]) naming the
//! port classes it has words of in each tier: the datapath reads the
//! three peer identities' shared summaries once per packet for both tiers
//! and then probes only the named classes. Each (endpoint, direction,
//! tier, identity) with words keeps its per-tier summary
//! ([`npm_common::TIER_FRONT_PC_SUMMARY`]) too, for a program of the same
//! layout that reads those (one still attached while a new agent writes
//! the adopted pins). Every mask is kept a superset of the stored words'
//! classes: a class is added before its first word is stored and dropped
//! after its last word is removed; a word one of whose summaries cannot
//! be stored (bucket full) is not stored either.
//!
//! The current datapath reads neither summary word: it reads the class
//! filter `NPM_TIER_SUMMARY` ([`ClassFilter`]), one `u64` per (endpoint,
//! direction, identity) slot ([`npm_common::tier_summary_slot`]) with no
//! tag, so one inlined array read instead of a probe of four tagged words.
//! Keys that land in one slot share it: the slot is the OR of their
//! classes and exact ports ([`npm_common::tier_summary_bits`]), a superset
//! of each one's, which only ever costs a probe that misses. A bit is set
//! before the first word that needs it is stored and cleared after the last
//! one is removed, as for the summary words; the filter never refuses a
//! word. The datapath trusts the front only on endpoints flagged
//! `EP_TIER_SUMMARY`, which only a loader keeping the filter sets.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};

use aya::maps::{Array, IterableMap, MapData};
use npm_common::{
    front_shift, maps, tier_flags, tier_front_is_summary, tier_front_key, tier_front_key_of, tier_front_pc_any_port,
    tier_front_pc_block, tier_front_pc_exact, tier_front_pc_of, tier_front_shared_bit, tier_front_shared_summary_key,
    tier_front_slot, tier_front_summary_bit, tier_front_summary_key, tier_front_word, tier_summary_bits,
    tier_summary_slot, EP_ADMIN_FRONT_INGRESS, EP_BASELINE_FRONT_INGRESS, TIER_ACTION_MASK, TIER_FRONT_BLOCK_BITS,
    TIER_FRONT_MAX_IDENTITY, TIER_FRONT_MAX_SUBJECT, TIER_FRONT_PC_ANY_PROTO, TIER_FRONT_SUM_ACTION, TIER_RANK_SHIFT,
};
use npm_policy::compiled::{Compiled, Tier, TierEntry, TierValue};

use super::errors::EbpfError;
use super::loader::{check_front_buckets, tier_summary_slots};
use super::shared_words::SharedWords;
use super::translate;

pub(crate) mod ranks;

/// Words per bucket.
const WAYS: usize = 4;

/// Most words one tier entry may take (its range's edge ports and 64-port
/// blocks); an entry needing more keeps its endpoint's direction and tier
/// on `NPM_TIERS`.
pub const TIER_FRONT_MAX_WORDS: usize = 256;

/// The `NPM_TIER_FRONT` words of a tier entry with its value, as (key,
/// word) pairs (`tier_front_keys`, each with `value`'s action and rank;
/// the loader stores the entry's front rank, see `ranks`). `None` when
/// the keys do not fit the front or the rank does not fit a word.
pub fn tier_front_words(entry: &TierEntry, value: &TierValue) -> Option<Vec<(u64, u64)>> {
    let flags = translate::tier_value(value).flags;
    tier_front_keys(entry)?
        .into_iter()
        .map(|k| tier_front_word(k, flags).map(|w| (k, w)))
        .collect()
}

/// The `NPM_TIER_FRONT` keys of a tier entry: one "any protocol" key for
/// an entry without protocol, one "any port" key for a whole protocol,
/// else one key per port at the edges of the range and one per aligned
/// 64-port block inside it. `None` when the entry does not fit the front:
/// a subject (pod identity) or peer identity beyond the key's fields, a protocol
/// other than TCP, UDP and SCTP, an empty range, or more than
/// [`TIER_FRONT_MAX_WORDS`] words.
pub(crate) fn tier_front_keys(entry: &TierEntry) -> Option<Vec<u64>> {
    let ep = entry.subject;
    if ep == 0 || ep >= TIER_FRONT_MAX_SUBJECT || entry.peer >= TIER_FRONT_MAX_IDENTITY {
        return None;
    }
    let (dir, tier, peer) = (entry.direction.as_u8(), translate::tier_bit(entry.tier), entry.peer);
    let key = |pc| tier_front_key(ep, dir, tier, peer, pc);
    let pcs = match translate::front_ports(entry.protocol, entry.ports)? {
        translate::FrontPorts::AnyProtocol => vec![TIER_FRONT_PC_ANY_PROTO],
        translate::FrontPorts::AnyPort(code) => vec![tier_front_pc_any_port(code)],
        translate::FrontPorts::Range(code, lo, hi) => range_classes(code, lo, hi, TIER_FRONT_MAX_WORDS)?,
    };
    Some(pcs.into_iter().map(key).collect())
}

/// The port classes covering ports `lo..=hi` of protocol `code` (1..=3):
/// each aligned 64-port block inside the range, and the ports at its edges
/// one by one, in port order. `None` when they are more than `max`.
pub(crate) fn range_classes(code: u64, lo: u16, hi: u16, max: usize) -> Option<Vec<u64>> {
    let block = 1u32 << TIER_FRONT_BLOCK_BITS;
    let (mut p, end) = (u32::from(lo), u32::from(hi));
    let mut pcs = Vec::new();
    while p <= end {
        if p % block == 0 && p + block - 1 <= end {
            pcs.push(tier_front_pc_block(code, p as u16));
            p += block;
        } else {
            pcs.push(tier_front_pc_exact(code, p as u16));
            p += 1;
        }
        if pcs.len() > max {
            return None;
        }
    }
    Some(pcs)
}

/// The front group (subject, direction, tier) of a tier entry whose
/// subject fits the front's keys.
pub(crate) fn entry_group(entry: &TierEntry) -> Option<ranks::Group> {
    let ep = entry.subject;
    (ep != 0 && ep < TIER_FRONT_MAX_SUBJECT).then(|| {
        ranks::group_of_key(tier_front_key(
            ep,
            entry.direction.as_u8(),
            translate::tier_bit(entry.tier),
            0,
            0,
        ))
    })
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

/// Summary class bits: ten in a per-tier summary
/// ([`tier_front_summary_bit`]: three per protocol code for exact, block
/// and any-port words, one for any protocol), twelve in a shared one
/// ([`tier_front_shared_bit`]: six per tier).
const SUMMARY_BITS: usize = 12;

/// The summaries that name the word of `key`, each with the word's class
/// bit there: its identity's per-tier summary and its shared summary.
fn summaries_of(key: u64) -> [(u64, u32); 2] {
    [
        (
            tier_front_summary_key(key),
            tier_front_summary_bit(tier_front_pc_of(key)),
        ),
        (tier_front_shared_summary_key(key), tier_front_shared_bit(key)),
    ]
}

/// The index of a single summary class bit.
fn bit_index(bit: u32) -> usize {
    bit.trailing_zeros() as usize
}

/// The mapped `NPM_TIER_FRONT` array and where each stored key is.
pub(crate) struct TierFront {
    slots: SharedWords,
    /// Stored key -> (slot index, word) (the loader is the only writer),
    /// the words of tier entries.
    placed: HashMap<u64, (usize, u64)>,
    /// Summary key of an identity -> (slot index, class mask): stored for
    /// every identity that has words in `placed`, its mask a superset of
    /// their classes.
    summaries: HashMap<u64, (usize, u32)>,
    /// Summary key -> words in `placed` per class bit.
    counts: HashMap<u64, [u32; SUMMARY_BITS]>,
    /// The [`front_shift`] of the front's buckets as loaded (the program's
    /// `NPM_TIER_FRONT_SHIFT`).
    shift: u32,
    /// The class filter the datapath reads instead of the summary words.
    filter: ClassFilter,
    /// Keeps the map (and its fd) alive as long as the mapping.
    _map: Array<MapData, [u64; 4]>,
}

/// The mapped class filter `NPM_TIER_SUMMARY` and, per slot, how many
/// stored words need each of its bits (see the module doc).
struct ClassFilter {
    slots: SharedWords,
    /// Slot -> (bit index, words stored in the front that need it), only
    /// bits some word needs (a few per slot).
    counts: HashMap<u32, Vec<(u8, u32)>>,
    /// The tier front's [`front_shift`] (the slot is two bits more).
    shift: u32,
    /// Keeps the map (and its fd) alive as long as the mapping.
    _map: Array<MapData, u64>,
}

/// The set bits' indexes of `bits`.
fn bit_indexes(bits: u64) -> impl Iterator<Item = u8> {
    (0..64u8).filter(move |b| bits >> b & 1 != 0)
}

impl ClassFilter {
    /// Maps the filter beside a tier front of `buckets` buckets; its size
    /// must be the front's (the loader created or kept it so).
    fn new(map: Array<MapData, u64>, buckets: u32) -> Result<Self, EbpfError> {
        let (slots, len) = SharedWords::map_array(map.map(), 1, maps::TIER_SUMMARY)?;
        if Some(len) != tier_summary_slots(buckets) {
            return Err(EbpfError::PinnedFrontSize {
                map: maps::TIER_SUMMARY,
                buckets: len,
                path: maps::TIER_SUMMARY.into(),
            });
        }
        Ok(ClassFilter {
            slots,
            counts: HashMap::new(),
            shift: front_shift(buckets),
            _map: map,
        })
    }

    /// The slot of the word of front key `key`.
    fn slot_of(&self, key: u64) -> u32 {
        tier_summary_slot(tier_front_shared_summary_key(key), self.shift)
    }

    /// The bits the counts of `slot` need.
    fn need(&self, slot: u32) -> u64 {
        self.counts
            .get(&slot)
            .map_or(0, |c| c.iter().fold(0, |m, (b, _)| m | 1 << b))
    }

    /// Counts the word of `key` in its slot; returns the slot and the
    /// word's bits.
    fn count_one(&mut self, key: u64) -> (u32, u64) {
        let slot = self.slot_of(key);
        let bits = tier_summary_bits(key);
        let c = self.counts.entry(slot).or_default();
        for b in bit_indexes(bits) {
            match c.iter_mut().find(|(i, _)| *i == b) {
                Some((_, n)) => *n += 1,
                None => c.push((b, 1)),
            }
        }
        (slot, bits)
    }

    /// Counts the word of `key` and sets its bits in its slot (before the
    /// word is stored).
    fn add(&mut self, key: u64) {
        let (slot, bits) = self.count_one(key);
        let w = &self.slots.words()[slot as usize];
        let have = w.load(Ordering::Acquire);
        if have | bits != have {
            w.store(have | bits, Ordering::Release);
        }
    }

    /// Uncounts the word of `key` (after it was removed) and clears the
    /// bits no stored word needs any more.
    fn sub(&mut self, key: u64) {
        let slot = self.slot_of(key);
        let bits = tier_summary_bits(key);
        if let Some(c) = self.counts.get_mut(&slot) {
            for b in bit_indexes(bits) {
                if let Some(n) = c.iter_mut().find(|(i, _)| *i == b).map(|(_, n)| n) {
                    *n = n.saturating_sub(1);
                }
            }
            c.retain(|(_, n)| *n > 0);
            if c.is_empty() {
                self.counts.remove(&slot);
            }
        }
        self.store(slot);
    }

    /// Makes `slot` hold exactly the bits its counts need.
    fn store(&self, slot: u32) {
        let need = self.need(slot);
        let w = &self.slots.words()[slot as usize];
        if w.load(Ordering::Acquire) != need {
            w.store(need, Ordering::Release);
        }
    }

    /// Counts exactly the words of `keys` (no slot is written).
    fn count(&mut self, keys: impl Iterator<Item = u64>) {
        self.counts.clear();
        for key in keys {
            self.count_one(key);
        }
    }

    /// Makes every slot hold exactly what the counts need (adopted pins:
    /// stale bits of an earlier loader go, missing ones come before any
    /// program that reads them is attached).
    fn store_all(&self) {
        // Slots no word needs are cleared (a look-up only for the set ones),
        // then each needed slot gets exactly its bits (a needed bit is never
        // cleared on the way).
        for (i, w) in self.slots.words().iter().enumerate() {
            if w.load(Ordering::Acquire) != 0 && !self.counts.contains_key(&(i as u32)) {
                w.store(0, Ordering::Release);
            }
        }
        for slot in self.counts.keys() {
            self.store(*slot);
        }
    }
}

impl TierFront {
    /// Maps the array (created with `BPF_F_MMAPABLE` by the object) and
    /// learns the words already there (adopted pins): each word's key is
    /// recovered from its bucket and tag. The summaries are then made to
    /// cover exactly the adopted words' classes (pins of a loader without
    /// summaries get them here, before a program that reads them is
    /// attached); an identity whose summary finds its bucket full loses
    /// its words, so its tier stays on `NPM_TIERS`. The buckets are the
    /// map's as loaded (the loader gave the program the same number).
    pub(crate) fn new(map: Array<MapData, [u64; 4]>, filter: Array<MapData, u64>) -> Result<Self, EbpfError> {
        let (slots, buckets) = SharedWords::map_array(map.map(), WAYS, maps::TIER_FRONT)?;
        check_front_buckets(maps::TIER_FRONT, buckets)?;
        let filter = ClassFilter::new(filter, buckets)?;
        let shift = front_shift(buckets);
        let mut placed = HashMap::new();
        let mut summaries = HashMap::new();
        for (i, s) in slots.words().iter().enumerate() {
            let w = s.load(Ordering::Acquire);
            if w == 0 {
                continue;
            }
            // A word without an action is none this loader stores (the
            // datapath takes every word of a matching tag for a hit).
            if ((w >> 48) as u32) & TIER_ACTION_MASK == 0 {
                s.store(0, Ordering::Release);
                continue;
            }
            let bucket = (i / WAYS) as u32;
            let key = tier_front_key_of(bucket, w, shift);
            // A word out of its bucket (its bucket bits below bit 48
            // disagree with its tag) is none this loader stored.
            if tier_front_slot(key, shift).0 != bucket {
                s.store(0, Ordering::Release);
                continue;
            }
            let fresh = if tier_front_is_summary(tier_front_pc_of(key)) {
                summaries
                    .insert(key, (i, ((w >> 48) as u32) >> TIER_RANK_SHIFT))
                    .is_none()
            } else {
                placed.insert(key, (i, w)).is_none()
            };
            // Not a word this loader would have stored: a key is in one
            // slot only (the datapath reads the first).
            if !fresh {
                s.store(0, Ordering::Release);
            }
        }
        let mut front = TierFront {
            slots,
            placed,
            summaries,
            counts: HashMap::new(),
            shift,
            filter,
            _map: map,
        };
        let keys: Vec<u64> = front.placed.keys().copied().collect();
        for k in &keys {
            for (sk, bit) in summaries_of(*k) {
                front.counts.entry(sk).or_default()[bit_index(bit)] += 1;
            }
        }
        // The filter counts the adopted words first, so that removing one
        // below keeps every bit the others need.
        front.filter.count(keys.iter().copied());
        let mut lost = Vec::new();
        let skeys: BTreeSet<u64> = front.summaries.keys().chain(front.counts.keys()).copied().collect();
        for sk in skeys {
            let need = front.counts.get(&sk).map_or(0, mask_of);
            if !front.store_summary(sk, need) {
                lost.push(sk);
            }
        }
        // The words of an identity whose summary could not be stored go
        // (their other summary shrinks with them).
        for k in keys {
            if summaries_of(k).iter().any(|(sk, _)| lost.contains(sk)) {
                front.remove(k);
            }
        }
        // The counts followed those removals: they are the kept words'.
        front.filter.store_all();
        Ok(front)
    }

    fn slots(&self) -> &[AtomicU64] {
        self.slots.words()
    }

    /// A free slot of the bucket of `key`.
    fn free_slot(&self, key: u64) -> Option<usize> {
        let base = tier_front_slot(key, self.shift).0 as usize * WAYS;
        (base..base + WAYS).find(|i| self.slots()[*i].load(Ordering::Acquire) == 0)
    }

    /// Makes the summary word of `skey` hold `mask` (0: no summary word).
    /// Returns false when a new summary word finds its bucket full.
    fn store_summary(&mut self, skey: u64, mask: u32) -> bool {
        let current = self.summaries.get(&skey).copied();
        if mask == 0 {
            if let Some((i, _)) = current {
                self.slots()[i].store(0, Ordering::Release);
                self.summaries.remove(&skey);
            }
            return true;
        }
        if current.is_some_and(|(_, m)| m == mask) {
            return true;
        }
        let Some(word) = tier_front_word(skey, tier_flags(TIER_FRONT_SUM_ACTION, mask)) else {
            return false;
        };
        let slot = match current {
            Some((i, _)) => i,
            None => match self.free_slot(skey) {
                Some(i) => i,
                None => return false,
            },
        };
        self.slots()[slot].store(word, Ordering::Release);
        self.summaries.insert(skey, (slot, mask));
        true
    }

    /// Stores `word` for `key`: over the key's slot when it is stored (one
    /// store replaces the value), else in a free slot of its bucket, after
    /// its identity's summary has its class. Returns false when a bucket
    /// (the word's or its summary's) is full: the key is not in the front.
    pub(crate) fn upsert(&mut self, key: u64, word: u64) -> bool {
        if let Some((i, w)) = self.placed.get_mut(&key) {
            if *w != word {
                self.slots.words()[*i].store(word, Ordering::Release);
                *w = word;
            }
            return true;
        }
        let Some(slot) = self.free_slot(key) else {
            return false;
        };
        let sums = summaries_of(key);
        // The summaries name the class before the word is there.
        for (n, (skey, bit)) in sums.iter().enumerate() {
            let mask = self.summaries.get(skey).map_or(0, |(_, m)| *m);
            if mask & bit != 0 || self.store_summary(*skey, mask | bit) {
                continue;
            }
            // Undo what the earlier summaries gained for this word.
            for (skey, _) in &sums[..n] {
                let need = self.counts.get(skey).map_or(0, mask_of);
                self.store_summary(*skey, need);
            }
            return false;
        }
        // The filter names the class (and port) before the word is there.
        self.filter.add(key);
        self.slots()[slot].store(word, Ordering::Release);
        self.placed.insert(key, (slot, word));
        for (skey, bit) in sums {
            self.counts.entry(skey).or_default()[bit_index(bit)] += 1;
        }
        true
    }

    /// Removes the word of `key`, then its class from its identity's
    /// summary when it was the class's last word.
    pub(crate) fn remove(&mut self, key: u64) {
        let Some((i, _)) = self.placed.remove(&key) else {
            return;
        };
        self.slots()[i].store(0, Ordering::Release);
        self.filter.sub(key);
        for (skey, bit) in summaries_of(key) {
            let Some(c) = self.counts.get_mut(&skey) else {
                continue;
            };
            let n = &mut c[bit_index(bit)];
            *n = n.saturating_sub(1);
            if *n == 0 {
                let need = mask_of(c);
                if need == 0 {
                    self.counts.remove(&skey);
                }
                // Shrinking (or removing) never needs a free slot.
                self.store_summary(skey, need);
            }
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

    /// Slots of the class filter in use (some word needs a bit there).
    pub(crate) fn filter_len(&self) -> usize {
        self.filter.counts.len()
    }

    /// Words stored.
    pub(crate) fn len(&self) -> usize {
        self.placed.len()
    }

    /// The stored keys (summaries apart).
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.placed.keys().copied()
    }
}

/// The summary mask of per-class word counts.
fn mask_of(counts: &[u32; SUMMARY_BITS]) -> u32 {
    counts
        .iter()
        .enumerate()
        .filter(|(_, n)| **n > 0)
        .fold(0, |m, (i, _)| m | 1 << i)
}

/// Every front key of `compiled`'s tier entries that fit, with the
/// entry's `NPM_TIERS` flags (action and compiler rank, numbered into a
/// front rank when stored): a full sync's "mark" set.
pub(crate) fn want_words(compiled: &Compiled) -> BTreeMap<u64, u64> {
    compiled
        .tiers
        .iter()
        .filter_map(|(e, v)| {
            let flags = u64::from(translate::tier_value(v).flags);
            Some(tier_front_keys(e)?.into_iter().map(move |k| (k, flags)))
        })
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
            subject: 7,
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
        assert_eq!(
            tier_front_hit(w, tier_front_slot(k, npm_common::TIER_FRONT_SHIFT).1),
            tier_flags(TIER_ACCEPT, 9)
        );
        // Too many words, an empty range, ids and ranks beyond the fields.
        assert_eq!(tier_front_words(&entry(Some(Protocol::Tcp), 1, 65534), &V), None);
        assert_eq!(tier_front_words(&entry(Some(Protocol::Tcp), 5, 4), &V), None);
        let big_ep = TierEntry {
            subject: TIER_FRONT_MAX_SUBJECT,
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
