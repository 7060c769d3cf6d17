//! `NPM_TIERS`: the LPM trie of the ClusterNetworkPolicy tier entries,
//! keyed by [`npm_common::tier_key`] (the `NPM_POLICY` key layout with the
//! tier in the direction byte; see [`translate::tier_keys`]) -> the action,
//! rank and rule id of the entry ([`translate::tier_value`]). Written in
//! the order of the policy entries: upserts before the endpoints whose
//! tier flags point at them, removals after. Its front `NPM_TIER_FRONT`
//! ([`TierFront`]) is written with it: words after the LPM keys, removals
//! before them.
//!
//! The front's words carry front ranks ([`FrontRanks`]), given when the
//! endpoints' front flags are computed ([`TierTable::front_flags`], which
//! the writer calls after the upserts and before it writes the
//! endpoints): the upserted entries' new ranks are placed in the gaps of
//! their group's numbering, all at once, and their words stored. A group
//! whose gap is too small (or whose words were adopted from pins) is
//! renumbered in three steps, so no packet is ever decided by a mix of two
//! numberings: `front_flags` reports it off (the writer clears the flag in
//! the endpoint record: the tier is decided on `NPM_TIERS`), the next
//! [`TierTable::refront`] or [`TierTable::insert_words`] (after the
//! records are written) rewrites its words, and the writer's next
//! `front_flags` sets the flag again.
//!
//! A group's flag depends only on its own entries, words and numbering, so
//! an apply computes only the groups its diff touches
//! ([`TierTable::begin_apply`]) and those waiting for a renumbering; a full
//! sync or a failed batch computes every group. Debug builds check the
//! result against a pass over every entry.

use std::collections::{BTreeMap, BTreeSet};

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::MapData;
use aya::Ebpf;
use npm_common::{
    maps, tier_front_word, PolicyKey, TierValue as KernelTierValue, POLICY_KEY_LEN, TIER_ACTION_MASK, TIER_RANK_SHIFT,
};
use npm_policy::compiled::{Compiled, Direction, MapDiff, Tier, TierEntry, TierValue};

use super::errors::{map_err, removed, EbpfError};
use super::loader::take_map;
use super::tier_front::ranks::{self, FrontRanks, Group, Numbering};
use super::tier_front::{entry_group, front_flag, tier_front_keys, TierFront};
use super::translate;

/// `NPM_TIERS` and its front, written together.
pub(crate) struct TierTable {
    lpm: LpmTrie<MapData, [u8; POLICY_KEY_LEN], KernelTierValue>,
    front: TierFront,
    ranks: FrontRanks,
    /// Entries upserted whose words wait for [`TierTable::front_flags`]
    /// (their new ranks are placed together).
    queued: Vec<TierEntry>,
    /// Renumberings of pending groups computed by the last `front_flags`
    /// (group -> numbering, words), stored by the next `refront` or
    /// `insert_words`, after the endpoints were written with the group's
    /// front flag cleared.
    ready: BTreeMap<Group, (Numbering, Vec<(u64, u64)>)>,
    /// Each group's ranks in the last `front_flags`'s target (the groups
    /// it computed; `true`: every group of the target): the numbers of
    /// other ranks are dropped by the next `refront` or `insert_words`,
    /// once the batch's removals are done (with `true`, other groups too).
    prune: Option<(BTreeMap<Group, BTreeSet<u32>>, bool)>,
    /// Every group is computed by the next `front_flags` (set by a full
    /// sync and a failed batch).
    full: bool,
    /// The groups the current batch touches ([`TierTable::begin_apply`]).
    touched: BTreeSet<Triple>,
    /// Groups waiting for a renumbering when `front_flags` last ran: it
    /// computes them again.
    waiting: BTreeSet<Triple>,
    /// The front flags `front_flags` last gave each endpoint (none: 0).
    flags: BTreeMap<u32, u32>,
}

/// A (subject, direction, tier) of the tier entries (one front group).
type Triple = (u32, Direction, Tier);

/// The group of `entry`.
fn triple(entry: &TierEntry) -> Triple {
    (entry.subject, entry.direction, entry.tier)
}

/// The lowest [`TierEntry`] of a group (the entries of a group are
/// contiguous: subject, direction and tier lead their order).
fn first_of((subject, direction, tier): Triple) -> TierEntry {
    TierEntry {
        subject,
        direction,
        tier,
        peer: 0,
        protocol: None,
        ports: (0, 0),
    }
}

/// The entries of `compiled` in group `t`.
fn entries_of(compiled: &Compiled, t: Triple) -> impl Iterator<Item = (&TierEntry, &TierValue)> {
    compiled
        .tiers
        .range(first_of(t)..)
        .take_while(move |(e, _)| triple(e) == t)
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

/// The front flags (action and front rank) of a compiler `flags` word in a
/// numbering.
fn front_flags_of(ranks: &FrontRanks, group: Group, flags: u32) -> Option<u32> {
    let n = ranks.number(group, flags >> TIER_RANK_SHIFT)?;
    Some(flags & TIER_ACTION_MASK | n << TIER_RANK_SHIFT)
}

impl TierTable {
    /// Takes the map out of the loaded object. Groups with adopted words
    /// (numbered by an earlier loader) wait for a renumbering.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let front = TierFront::new(take_map(bpf, maps::TIER_FRONT)?, take_map(bpf, maps::TIER_SUMMARY)?)?;
        let mut ranks = FrontRanks::default();
        for k in front.keys() {
            ranks.set_pending(ranks::group_of_key(k));
        }
        Ok(TierTable {
            lpm: take_map(bpf, maps::TIERS)?,
            front,
            ranks,
            queued: Vec::new(),
            ready: BTreeMap::new(),
            prune: None,
            full: true,
            touched: BTreeSet::new(),
            waiting: BTreeSet::new(),
            flags: BTreeMap::new(),
        })
    }

    /// The front words of `entry` with `value`, numbered; `None` when the
    /// entry does not fit the front or its rank has no front rank (yet).
    fn words(&self, entry: &TierEntry, value: &TierValue) -> Option<Vec<(u64, u64)>> {
        let group = entry_group(entry)?;
        let flags = front_flags_of(&self.ranks, group, translate::tier_value(value).flags)?;
        tier_front_keys(entry)?
            .into_iter()
            .map(|k| tier_front_word(k, flags).map(|w| (k, w)))
            .collect()
    }

    /// Writes the keys of `entry` with its value; its front words follow in
    /// [`TierTable::front_flags`] (a word whose bucket is full is left
    /// out: the endpoint's direction and tier then stay on the LPM).
    pub(crate) fn upsert(&mut self, entry: &TierEntry, value: &TierValue) -> Result<(), EbpfError> {
        // A new batch: what an aborted one computed is stale.
        self.ready.clear();
        self.prune = None;
        let v = translate::tier_value(value);
        for k in translate::tier_keys(entry)? {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), v, 0)
                .map_err(map_err(maps::TIERS, format!("insert {entry:?}")))?;
        }
        self.queued.push(*entry);
        Ok(())
    }

    /// Removes the keys of `entry` that no entry of `next` still produces
    /// (an entry of the same group may hold the same aligned block): its
    /// front words first, then its LPM keys.
    pub(crate) fn remove(&mut self, entry: &TierEntry, next: &Compiled) -> Result<(), EbpfError> {
        let mut still: BTreeSet<PolicyKey> = BTreeSet::new();
        let mut still_words: BTreeSet<u64> = BTreeSet::new();
        for (other, _) in group(next, entry) {
            still.extend(translate::tier_keys(other)?);
            still_words.extend(tier_front_keys(other).unwrap_or_default());
        }
        for k in tier_front_keys(entry).unwrap_or_default() {
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

    /// Writes every key of `want` (a full sync's first tier write: what an
    /// aborted batch computed is dropped).
    pub(crate) fn insert_keys(&mut self, want: &BTreeMap<PolicyKey, KernelTierValue>) -> Result<(), EbpfError> {
        self.ready.clear();
        self.prune = None;
        self.queued.clear();
        self.full = true;
        for (k, v) in want {
            self.lpm
                .insert(&Key::new(k.prefix_len, k.data), *v, 0)
                .map_err(map_err(maps::TIERS, format!("insert {k:?}")))?;
        }
        Ok(())
    }

    /// The renumberings and prunings the last `front_flags` prepared, now
    /// that the endpoints were written with the renumbered groups' front
    /// flags cleared and the batch's removals are done. Returns whether a
    /// group was renumbered (its flag may be set again).
    fn finish_batch(&mut self) -> bool {
        let ready = std::mem::take(&mut self.ready);
        let renumbered = !ready.is_empty();
        for (group, (numbering, words)) in ready {
            tracing::debug!(group, ranks = numbering.len(), "tier front: group renumbered");
            self.ranks.renumbered(group, numbering);
            for (k, w) in words {
                self.front.upsert(k, w);
            }
        }
        if let Some((plan, every)) = self.prune.take() {
            for (group, ranks) in &plan {
                self.ranks.prune(*group, ranks);
            }
            if every {
                self.ranks.retain(&plan.keys().copied().collect());
            }
        }
        renumbered
    }

    /// After the removals of a batch: stores the renumbered groups' words,
    /// drops the front words an upserted entry left when its new value no
    /// longer fits the front (its endpoint's flag was cleared by then), and
    /// stores the words of upserted entries that found their bucket full
    /// before the removals. Returns whether a word was newly stored (the
    /// endpoints' front flags may then be set).
    pub(crate) fn refront<'a>(&mut self, upserts: impl IntoIterator<Item = (&'a TierEntry, &'a TierValue)>) -> bool {
        let mut placed = self.finish_batch();
        for (entry, value) in upserts {
            match self.words(entry, value) {
                Some(words) => {
                    for (k, w) in words {
                        if !self.front.holds(k, w) {
                            placed |= self.front.upsert(k, w);
                        }
                    }
                }
                None => {
                    for k in tier_front_keys(entry).unwrap_or_default() {
                        self.front.remove(k);
                    }
                }
            }
        }
        placed
    }

    /// Stores the front words of `want` (key -> `NPM_TIERS` flags, after
    /// their LPM keys), giving their ranks front ranks in their groups'
    /// gaps; a group without room waits for a renumbering (see the module
    /// doc). The second call of a full sync (after the endpoints were
    /// written) first stores the renumbered groups.
    pub(crate) fn insert_words(&mut self, want: &BTreeMap<u64, u64>) {
        self.finish_batch();
        let mut by_group: BTreeMap<Group, BTreeSet<u32>> = BTreeMap::new();
        for (k, f) in want {
            by_group
                .entry(ranks::group_of_key(*k))
                .or_default()
                .insert((*f as u32) >> TIER_RANK_SHIFT);
        }
        for (group, ranks) in &by_group {
            self.ranks.place(*group, ranks);
        }
        for (k, f) in want {
            let Some(flags) = front_flags_of(&self.ranks, ranks::group_of_key(*k), *f as u32) else {
                continue;
            };
            if let Some(w) = tier_front_word(*k, flags) {
                self.front.upsert(*k, w);
            }
        }
    }

    /// Removes the front words whose key is not in `want`.
    pub(crate) fn sweep_words(&mut self, want: &BTreeMap<u64, u64>) {
        self.front.sweep(want);
    }

    /// Records the (endpoint, direction, tier) groups an apply's tier
    /// changes touch: with [`TierTable::front_flags`]'s cache, only those
    /// (and the groups waiting for a renumbering) are computed again.
    /// Called before the batch's first write.
    pub(crate) fn begin_apply(&mut self, diff: &MapDiff<TierEntry, TierValue>) {
        let entries = diff.upsert.iter().map(|(e, _)| e).chain(&diff.remove);
        self.touched.extend(entries.map(triple));
    }

    /// Ends a batch (an apply or a full sync): the touched groups were
    /// computed; after a failed batch every group is computed again.
    pub(crate) fn end_batch(&mut self, ok: bool) {
        self.touched.clear();
        self.full = !ok;
        if !ok {
            self.flags.clear();
            self.waiting.clear();
        }
    }

    /// The `EP_ADMIN_FRONT_*` / `EP_BASELINE_FRONT_*` flags of the
    /// endpoints of `next` that have tier entries: set for a direction and
    /// tier when every entry of it fits the front and its words are stored
    /// with the entry's current value and front rank. First stores the
    /// words of the entries upserted since the last call (their new ranks
    /// placed in their groups' gaps), and prepares the renumbering of the
    /// groups that wait for one (reported off here; stored by the next
    /// `refront` / `insert_words`).
    ///
    /// A group's flag depends only on its own entries, words and
    /// numbering, so outside a full sync only the groups the batch touched
    /// ([`TierTable::begin_apply`], the upserted entries) and those waiting
    /// for a renumbering are computed; the others keep their flags from
    /// the last call.
    pub(crate) fn front_flags(&mut self, next: &Compiled) -> BTreeMap<u32, u32> {
        let full = self.full;
        let groups: BTreeSet<Triple> = if full {
            self.flags.clear();
            self.waiting.clear();
            next.tiers.keys().map(triple).collect()
        } else {
            let mut g = std::mem::take(&mut self.waiting);
            g.extend(self.touched.iter().copied());
            g.extend(self.queued.iter().map(triple));
            g
        };
        // Each group's ranks in the target.
        let mut group_ranks: BTreeMap<Group, BTreeSet<u32>> = BTreeMap::new();
        for t in &groups {
            let Some(g) = entry_group(&first_of(*t)) else {
                continue;
            };
            let ranks = group_ranks.entry(g).or_default();
            ranks.extend(entries_of(next, *t).map(|(_, v)| v.rank));
        }
        // The upserted entries' new ranks, placed once per group, then
        // their words.
        let queued = std::mem::take(&mut self.queued);
        let mut placed: BTreeMap<Group, bool> = BTreeMap::new();
        for entry in queued {
            let (Some(value), Some(g)) = (next.tiers.get(&entry), entry_group(&entry)) else {
                continue;
            };
            let ok = *placed.entry(g).or_insert_with(|| match group_ranks.get(&g) {
                Some(r) => self.ranks.place(g, r),
                None => false,
            });
            if !ok {
                continue;
            }
            for (k, w) in self.words(&entry, value).unwrap_or_default() {
                self.front.upsert(k, w);
            }
        }
        // The renumberings of waiting groups, from the target state.
        self.ready.clear();
        for t in &groups {
            let Some(g) = entry_group(&first_of(*t)) else {
                continue;
            };
            if !self.ranks.pending(g) {
                continue;
            }
            let Some(n) = group_ranks.get(&g).filter(|r| !r.is_empty()).and_then(ranks::fresh) else {
                continue;
            };
            let mut words = Vec::new();
            for (e, v) in entries_of(next, *t) {
                let flags = translate::tier_value(v).flags;
                let front = flags & TIER_ACTION_MASK | n[&v.rank] << TIER_RANK_SHIFT;
                words.extend(
                    tier_front_keys(e)
                        .unwrap_or_default()
                        .into_iter()
                        .filter_map(|k| tier_front_word(k, front).map(|w| (k, w))),
                );
            }
            self.ready.insert(g, (n, words));
        }
        self.prune = Some((group_ranks, full));
        // The flags of the groups computed here; a group still waiting
        // for a renumbering is computed again by the next call.
        for t in &groups {
            let (endpoint, direction, tier) = *t;
            let bit = front_flag(&first_of(*t));
            let mut any = false;
            let mut held = true;
            for (e, v) in entries_of(next, *t) {
                any = true;
                held = self
                    .words(e, v)
                    .is_some_and(|w| w.iter().all(|(k, w)| self.front.holds(*k, *w)));
                if !held {
                    break;
                }
            }
            let f = self.flags.entry(endpoint).or_default();
            *f = if any && held { *f | bit } else { *f & !bit };
            if *f == 0 {
                self.flags.remove(&endpoint);
            }
            if entry_group(&first_of(*t)).is_some_and(|g| self.ranks.pending(g)) {
                self.waiting.insert((endpoint, direction, tier));
            }
        }
        #[cfg(debug_assertions)]
        {
            let scratch = self.flags_from_scratch(next);
            debug_assert_eq!(
                self.flags, scratch,
                "tier front flags computed for the touched groups only differ from a pass over every entry"
            );
        }
        self.flags.clone()
    }

    /// [`TierTable::front_flags`]'s result from a pass over every entry of
    /// `next` (what the cached flags must equal; checked in debug builds).
    #[cfg(debug_assertions)]
    fn flags_from_scratch(&self, next: &Compiled) -> BTreeMap<u32, u32> {
        // (subject -> flags that some entry rules out, flags seen).
        let mut seen: BTreeMap<u32, (u32, u32)> = BTreeMap::new();
        for (e, v) in &next.tiers {
            let f = front_flag(e);
            let s = seen.entry(e.subject).or_default();
            s.1 |= f;
            if s.0 & f != 0 {
                continue;
            }
            let held = self
                .words(e, v)
                .is_some_and(|w| w.iter().all(|(k, w)| self.front.holds(*k, *w)));
            if !held {
                s.0 |= f;
            }
        }
        seen.into_iter()
            .map(|(id, (out, all))| (id, all & !out))
            .filter(|(_, f)| *f != 0)
            .collect()
    }

    /// Words in the front.
    pub(crate) fn front_len(&self) -> usize {
        self.front.len()
    }

    /// Slots of the class filter in use.
    pub(crate) fn filter_len(&self) -> usize {
        self.front.filter_len()
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
