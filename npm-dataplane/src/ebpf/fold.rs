//! `NPM_FOLD`, the folded decisions: per (subject, direction, peer class,
//! port class) the decision of the Admin tier, NetworkPolicy and the
//! Baseline tier together (`npm_policy::fold`), for the directions of
//! subjects with tier entries, so that the datapath decides a new
//! connection there with one probe instead of the tiers' and
//! NetworkPolicy's lookups (see `npm_common::fold_key` for the layout).
//!
//! Every map the datapath falls back on keeps every entry: a class without
//! entries here (new, or it did not fit) is decided as before. What keeps
//! the entries right:
//! - A class's entries are stored most specific first and its any-port and
//!   any-protocol entries last, and removed in the reverse order: a packet
//!   finds either the class's decision for its port or none.
//! - The datapath trusts a subject's direction only while its endpoint
//!   records carry `EP_FOLD_<dir>` ([`FoldTable::flags`]). A batch that
//!   changes what decides that direction (its policy or tier entries, its
//!   endpoints' isolation or tier flags: [`FoldTable::begin_apply`]) first
//!   drops the flag, which the writer's endpoint pass clears in the
//!   records; [`FoldTable::finish`], after every other map of the batch is
//!   written, replaces the direction's entries and raises the flag again.
//! - Classes come and go with the ipcache and the CIDR prefixes while the
//!   flag stays: a new class's entries are added (no address has the class
//!   before its ipcache entry is written, and none decides before they are
//!   all there), a gone class's entries are removed once no address
//!   resolves to it.
//! - What the map holds at open (adopted pins), after a failed batch, and
//!   at a full sync is not trusted: the flags drop for every subject, and
//!   once the records are written without them the map is cleared and
//!   folded anew.
//!
//! A direction is folded whole or not at all: flagged, every class that
//! fits a key has its entries, so a packet never probes in vain before
//! the lookups. The map's size is fixed
//! ([`npm_common::sizes::FOLD_BUCKETS`]); a direction that would fill it
//! beyond three quarters (as estimated from its first classes, or found
//! while storing), or meets a full bucket, is not folded (its packets take
//! the lookups) until its decisions change or a full sync.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;

use aya::maps::{Array, IterableMap, MapData};
use aya::Ebpf;
use npm_common::{
    cidr_code, fold_bucket, fold_key, fold_pc_any_port, fold_pc_block, fold_pc_exact, fold_value, maps, rule_slot,
    sizes, Reason, EP_FOLD_INGRESS, FOLD_BLOCK_BITS, FOLD_BUCKET_WORDS, FOLD_MAX_IDENTITY, FOLD_MAX_SUBJECT,
    FOLD_PC_ANY_PROTO, FOLD_SHIFT, FOLD_WAYS, RULE_SLOT_UNKNOWN,
};
use npm_policy::compiled::{Compiled, CompiledDiff, Direction, Tier};
use npm_policy::fold::{fold, peer_classes, Decision, Folded, PeerClass};

use super::errors::EbpfError;
use super::loader::take_map;
use super::shared_words::SharedWords;

/// Classes folded before a direction's size is estimated from them.
const ESTIMATE_AFTER: usize = 32;

/// Most entries one class may take; a class needing more is not folded.
pub const FOLD_MAX_CLASS_ENTRIES: usize = 1024;

/// The port classes covering ports `lo..=hi` of protocol `code` (1..=3):
/// each aligned 64-port block inside the range, and the ports at its edges
/// one by one, in port order. `None` when they are more than `max`.
fn range_classes(code: u64, lo: u16, hi: u16, max: usize) -> Option<Vec<u64>> {
    let block = 1u32 << FOLD_BLOCK_BITS;
    let (mut p, end) = (u32::from(lo), u32::from(hi));
    let mut pcs = Vec::new();
    while p <= end {
        if p % block == 0 && p + block - 1 <= end {
            pcs.push(fold_pc_block(code, p as u16));
            p += block;
        } else {
            pcs.push(fold_pc_exact(code, p as u16));
            p += 1;
        }
        if pcs.len() > max {
            return None;
        }
    }
    Some(pcs)
}

/// A (subject, direction) of the folded decisions.
type Sd = (u32, Direction);

/// The `EP_FOLD_<dir>` flag of `dir`.
fn flag(dir: Direction) -> u32 {
    EP_FOLD_INGRESS << dir.as_u8()
}

/// `NPM_FOLD` through a shared mapping, and what this loader stored there.
pub(crate) struct FoldTable {
    words: SharedWords,
    _map: Array<MapData, [u64; FOLD_BUCKET_WORDS]>,
    /// Entries the map has room for.
    capacity: usize,
    /// Entries in use.
    used: usize,
    /// Per folded (subject, direction), per class, the entry indexes
    /// (bucket * 4 + way) its entries hold, in the order they were stored.
    stored: HashMap<Sd, HashMap<PeerClass, Vec<usize>>>,
    /// The classes the stored entries were folded for.
    classes: BTreeSet<PeerClass>,
    /// Subject -> the `EP_FOLD_*` flags of its folded directions whose
    /// entries are current.
    current: BTreeMap<u32, u32>,
    /// Directions of the current batch whose entries are replaced by
    /// [`FoldTable::finish`].
    dirty: BTreeSet<Sd>,
    /// The map holds entries this loader does not know: cleared by the
    /// next [`FoldTable::finish`].
    unknown: bool,
    /// Directions that could not be folded whole (not tried again until
    /// they are dirty or a full sync).
    failed: BTreeSet<Sd>,
}

impl FoldTable {
    /// Maps `NPM_FOLD`. Its entries (adopted pins) are not trusted: the
    /// first [`FoldTable::finish`] clears them.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let map: Array<MapData, [u64; FOLD_BUCKET_WORDS]> = take_map(bpf, maps::FOLD)?;
        let (words, buckets) = SharedWords::map_array(map.map(), FOLD_BUCKET_WORDS, maps::FOLD)?;
        if buckets != sizes::FOLD_BUCKETS {
            return Err(EbpfError::PinnedFrontSize {
                map: maps::FOLD,
                buckets,
                path: maps::FOLD.into(),
            });
        }
        Ok(FoldTable {
            words,
            _map: map,
            capacity: buckets as usize * FOLD_WAYS,
            used: 0,
            stored: HashMap::new(),
            classes: BTreeSet::new(),
            current: BTreeMap::new(),
            dirty: BTreeSet::new(),
            unknown: true,
            failed: BTreeSet::new(),
        })
    }

    /// The `EP_FOLD_*` flags of subject `subject`'s endpoint records.
    pub(crate) fn flags(&self, subject: u32) -> u32 {
        self.current.get(&subject).copied().unwrap_or(0)
    }

    /// Entries stored.
    pub(crate) fn len(&self) -> usize {
        self.used
    }

    /// Before a batch applying `diff` (towards `next`) writes anything:
    /// the directions whose decisions it may change lose their flag (the
    /// writer's endpoint pass clears it in the records).
    pub(crate) fn begin_apply(&mut self, diff: &CompiledDiff, next: &Compiled) {
        let mut dirty: BTreeSet<Sd> = BTreeSet::new();
        dirty.extend(diff.policy.upsert.iter().map(|(e, _)| (e.subject, e.direction)));
        dirty.extend(diff.policy.remove.iter().map(|e| (e.subject, e.direction)));
        dirty.extend(diff.tiers.upsert.iter().map(|(e, _)| (e.subject, e.direction)));
        dirty.extend(diff.tiers.remove.iter().map(|e| (e.subject, e.direction)));
        for (_, ep) in &diff.endpoints.upsert {
            dirty.insert((ep.identity, Direction::Ingress));
            dirty.insert((ep.identity, Direction::Egress));
        }
        // A direction that stops being folded is unflagged before its
        // entries go.
        let foldable = foldable(next);
        dirty.extend(self.stored.keys().filter(|sd| !foldable.contains_key(sd)).copied());
        for (subject, dir) in &dirty {
            if let Some(f) = self.current.get_mut(subject) {
                *f &= !flag(*dir);
            }
        }
        self.current.retain(|_, f| *f != 0);
        self.dirty.extend(dirty);
    }

    /// Before a full sync writes anything: no direction is trusted until
    /// it is folded anew.
    pub(crate) fn begin_sync(&mut self) {
        self.poison();
    }

    /// After a failed batch: nothing stored is trusted any more.
    pub(crate) fn poison(&mut self) {
        self.current.clear();
        self.unknown = true;
    }

    /// After every other map of a batch is written (and the endpoint
    /// records carry the flags [`FoldTable::begin_apply`] left): folds
    /// `next` into the entries (the dirty directions anew, the other
    /// folded ones for the classes that appeared, removing the classes
    /// that went) and flags every folded direction. Returns whether the
    /// flags changed (the endpoint records must be written again).
    pub(crate) fn finish(&mut self, next: &Compiled) -> bool {
        if self.unknown {
            for w in self.words.words() {
                w.store(0, Ordering::Release);
            }
            self.stored.clear();
            self.classes.clear();
            self.used = 0;
            self.failed.clear();
            self.unknown = false;
        }
        let foldable = foldable(next);
        let now: BTreeSet<PeerClass> = peer_classes(next).into_iter().filter(|c| fits(*c)).collect();
        // Directions no longer folded, and the dirty ones: every entry goes.
        let gone: Vec<Sd> = self
            .stored
            .keys()
            .filter(|sd| !foldable.contains_key(sd) || self.dirty.contains(sd))
            .copied()
            .collect();
        for sd in gone {
            self.drop_direction(sd);
        }
        // Classes no address resolves to any more.
        let went: Vec<PeerClass> = self.classes.difference(&now).copied().collect();
        for sd in self.stored.keys().copied().collect::<Vec<_>>() {
            for class in &went {
                if let Some(slots) = self.stored.get_mut(&sd).and_then(|m| m.remove(class)) {
                    self.clear(&slots);
                }
            }
        }
        // A direction is folded whole or not at all: flagged, every class
        // that fits a key has its entries (a packet then never probes in
        // vain before the lookups); one that cannot be (the map three
        // quarters full, a full bucket) has none, keeps its lookups and is
        // tried again when its decisions change or at a full sync.
        let budget = self.capacity * 3 / 4;
        let added: Vec<PeerClass> = now.difference(&self.classes).copied().collect();
        let all: Vec<PeerClass> = now.iter().copied().collect();
        self.failed
            .retain(|sd| foldable.contains_key(sd) && !self.dirty.contains(sd));
        let mut current = BTreeMap::new();
        for (&sd, &endpoint) in &foldable {
            if self.failed.contains(&sd) {
                continue;
            }
            let known = self.stored.contains_key(&sd);
            let todo = if known { &added } else { &all };
            let mut whole = true;
            // What the first classes take predicts what all of them will:
            // a direction that would not fit is given up early.
            let (start, mut taken) = (self.used, 0usize);
            for (done, class) in todo.iter().enumerate() {
                if done == ESTIMATE_AFTER && start + taken / done * todo.len() > budget {
                    whole = false;
                    break;
                }
                let slots = match fold(next, endpoint, sd.1, *class).and_then(|f| entries(sd.0, sd.1, *class, &f)) {
                    // A class needing more entries than one may have: its
                    // packets take the lookups.
                    None => continue,
                    Some(e) if self.used + e.len() <= budget => {
                        taken += e.len();
                        self.store(&e)
                    }
                    Some(_) => None,
                };
                match slots {
                    Some(slots) => {
                        self.stored.entry(sd).or_default().insert(*class, slots);
                    }
                    None => {
                        whole = false;
                        break;
                    }
                }
            }
            if whole {
                self.stored.entry(sd).or_default();
                *current.entry(sd.0).or_insert(0) |= flag(sd.1);
            } else {
                self.failed.insert(sd);
                self.drop_direction(sd);
            }
        }
        self.classes = now;
        self.dirty.clear();
        let changed = current != self.current;
        self.current = current;
        changed
    }

    /// Stores `entries` in order, each in a free way of its bucket; when
    /// one finds its bucket full, the stored ones are removed again and
    /// `None` returned.
    fn store(&mut self, entries: &[(u64, u64, u32)]) -> Option<Vec<usize>> {
        let words = self.words.words();
        let mut slots = Vec::with_capacity(entries.len());
        for &(key, value, bucket) in entries {
            let base = bucket as usize * FOLD_WAYS;
            let Some(i) = free_way(words, base, value) else {
                clear_entries(words, &slots);
                return None;
            };
            // The value before its key: a reader that sees the key sees
            // its value on x86; on arm64 it may see the slot's previous
            // value, which the datapath rejects ([`free_way`]).
            words[i * 2 + 1].store(value, Ordering::Release);
            words[i * 2].store(key, Ordering::Release);
            slots.push(i);
        }
        self.used += slots.len();
        Some(slots)
    }

    /// Removes every entry of direction `sd` and forgets it.
    fn drop_direction(&mut self, sd: Sd) {
        if let Some(classes) = self.stored.remove(&sd) {
            for slots in classes.into_values() {
                self.clear(&slots);
            }
        }
    }

    /// Removes the entries at `slots` ([`clear_entries`]).
    fn clear(&mut self, slots: &[usize]) {
        clear_entries(self.words.words(), slots);
        self.used -= slots.len();
    }
}

/// Removes the entries at `slots` of `words`, the last stored first: the
/// key only, the value word stays (what [`free_way`] reads of the slot's
/// previous occupant).
fn clear_entries(words: &[std::sync::atomic::AtomicU64], slots: &[usize]) {
    for &i in slots.iter().rev() {
        words[i * 2].store(0, Ordering::Release);
    }
}

/// The entry index of a free way (key word 0) of the bucket whose first
/// entry is `base` for an entry of value word `value`, `None` when all
/// four are taken. A datapath that reads the new key may read the slot's
/// previous value with it (arm64 may perform the value's load first); it
/// takes the pair only when the value carries the key's check (bits
/// 32..64, `npm_common::fold_check`). A free way whose remaining value
/// word has another check (or is this very value) is therefore preferred:
/// a stale read of it is rejected (or harmless). Another way is taken only
/// when none is: its previous value then has this check, which happens
/// when it held the same key (a direction folded anew: its endpoints'
/// records do not carry its flag meanwhile) or a key of this bucket and
/// CIDR code whose 23-bit tag collides.
fn free_way(words: &[std::sync::atomic::AtomicU64], base: usize, value: u64) -> Option<usize> {
    let free = |i: &usize| words[i * 2].load(Ordering::Acquire) == 0;
    let safe = |i: &usize| {
        let old = words[i * 2 + 1].load(Ordering::Relaxed);
        old >> 32 != value >> 32 || old == value
    };
    let ways = base..base + FOLD_WAYS;
    ways.clone().filter(free).find(safe).or_else(|| ways.clone().find(free))
}

/// Whether entries of `class` fit a key and a value.
fn fits(class: PeerClass) -> bool {
    class.identity < FOLD_MAX_IDENTITY && cidr_code(class.cidr_identity).is_some()
}

/// The folded (subject, direction)s of `compiled`, each with one of its
/// endpoints: the directions with tier entries of subjects that fit a key
/// and whose endpoints agree on their isolation and tier flags (what the
/// fold reads of an endpoint).
fn foldable(compiled: &Compiled) -> BTreeMap<Sd, u32> {
    let mut by_subject: BTreeMap<u32, (u32, bool)> = BTreeMap::new();
    for (id, ep) in &compiled.endpoints {
        let e = by_subject.entry(ep.identity).or_insert((*id, true));
        let rep = &compiled.endpoints[&e.0];
        if (rep.isolated_ingress, rep.isolated_egress, rep.tiers) != (ep.isolated_ingress, ep.isolated_egress, ep.tiers)
        {
            e.1 = false;
        }
    }
    let mut out = BTreeMap::new();
    for (subject, (id, uniform)) in by_subject {
        if !uniform || subject == 0 || subject >= FOLD_MAX_SUBJECT {
            continue;
        }
        let ep = &compiled.endpoints[&id];
        for dir in [Direction::Ingress, Direction::Egress] {
            if ep.tiers.has(Tier::Admin, dir) || ep.tiers.has(Tier::Baseline, dir) {
                out.insert((subject, dir), id);
            }
        }
    }
    out
}

/// The decision word the datapath's policy step returns for `d`: the
/// reason, and for `Reason::Policy` the allowing rule's slot above.
fn decision_word(d: Decision) -> u32 {
    let r = d.reason as u32;
    if d.reason == Reason::Policy {
        r | d.rule.map_or(RULE_SLOT_UNKNOWN, rule_slot) << 8
    } else {
        r
    }
}

/// The entries of class `class` of (subject, direction) folded as `f`,
/// as (key, value, bucket) in storing order: per protocol with ports the
/// ports whose decision is not that of the protocol's widest run (exact
/// ports, and aligned 64-port blocks inside a run), then per protocol the
/// any-port entry with the widest run's decision, then the any-protocol
/// entry with [`Folded::other`]. `None` when a field does not fit or the
/// class needs more than [`FOLD_MAX_CLASS_ENTRIES`].
pub fn entries(subject: u32, dir: Direction, class: PeerClass, f: &Folded) -> Option<Vec<(u64, u64, u32)>> {
    let code = cidr_code(class.cidr_identity)?;
    let d = dir.as_u8();
    let entry = |pc: u64, decision: Decision| -> Option<(u64, u64, u32)> {
        let key = fold_key(subject, d, class.identity, pc)?;
        Some((
            key,
            fold_value(key, code, decision_word(decision)),
            fold_bucket(key, code, FOLD_SHIFT),
        ))
    };
    let mut out = Vec::new();
    let mut any_port = Vec::new();
    for (i, runs) in f.ported.iter().enumerate() {
        let proto = i as u64 + 1;
        let widest = runs.iter().max_by_key(|r| u32::from(r.hi) - u32::from(r.lo))?.decision;
        for r in runs.iter().filter(|r| r.decision != widest) {
            for pc in range_classes(proto, r.lo, r.hi, FOLD_MAX_CLASS_ENTRIES - out.len())? {
                out.push(entry(pc, r.decision)?);
            }
        }
        any_port.push(entry(fold_pc_any_port(proto), widest)?);
    }
    out.extend(any_port);
    out.push(entry(FOLD_PC_ANY_PROTO, f.other)?);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn a_free_way_whose_stale_value_the_datapath_would_take_is_avoided() {
        let code = 2;
        let key = fold_key(300, 0, 5000, fold_pc_exact(1, 443)).unwrap();
        let value = fold_value(key, code, Reason::AdminDeny as u32);
        // Bucket 1 (entries 4..8): way 0 taken, way 1 free with the same
        // key's older decision left in it, way 2 free with another check.
        let words: Vec<AtomicU64> = (0..2 * FOLD_BUCKET_WORDS).map(|_| AtomicU64::new(0)).collect();
        let w = |e: usize, k: u64, v: u64| {
            words[e * 2].store(k, Ordering::Relaxed);
            words[e * 2 + 1].store(v, Ordering::Relaxed);
        };
        let older = fold_value(key, code, Reason::AdminAccept as u32);
        w(4, key ^ 1, 5);
        w(5, 0, older);
        w(6, 0, fold_value(key, code + 1, Reason::AdminAccept as u32));
        w(7, 9, 9);
        assert_eq!(free_way(&words, 4, value), Some(6));
        // The very value left in a way is as good.
        w(5, 0, value);
        assert_eq!(free_way(&words, 4, value), Some(5));
        // Only a way whose stale value has this check: taken all the same.
        w(5, 0, older);
        w(6, 8, 8);
        assert_eq!(free_way(&words, 4, value), Some(5));
        w(5, 7, 7);
        assert_eq!(free_way(&words, 4, value), None);
    }
}
