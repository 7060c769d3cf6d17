//! How full the kernel maps are ([`MapFill`]: entries against capacity,
//! per map), for `npm_map_entries{map}` and `npm_map_capacity{map}`.
//!
//! The maps the loader writes are counted from what the writer wrote, never
//! by iterating them (`NPM_POLICY` holds up to 1,048,576 keys): after a
//! successful full sync a map holds exactly the translated compiled state,
//! and after a successful diff exactly the translation of the diff's
//! target, so
//!
//! - `NPM_IPCACHE` holds one entry per compiled address, `NPM_CIDRS` one
//!   per compiled prefix;
//! - `NPM_EP_SLOTS` / `NPM_ENDPOINTS` one per programmed interface (by
//!   whether its ifindex fits the slot array);
//! - `NPM_POLICY` the distinct LPM keys of the compiled entries. Entries
//!   of one (subject, direction, peer, protocol) may share an aligned port
//!   block, so keys are counted per such group ([`Fill::applied`] recounts
//!   only the groups a diff touches);
//! - `NPM_TIERS` likewise, per (endpoint, direction, tier, peer, protocol);
//! - `NPM_IPCACHE4` and `NPM_FOLD` are counted by the loader's own
//!   mappings (user-space memory reads, no syscall).
//!
//! Until the first full sync the counts are not known (adopted pins may
//! hold anything) and those maps are not reported; a failed write leaves
//! the last counts (the next full sync corrects them).
//!
//! The datapath's own maps are counted by iterating their keys, rate
//! limited to once per [`DATAPATH_COUNT_INTERVAL`]: `NPM_CT` and `NPM_CT4`
//! (LRU: never "full", the oldest flow is evicted; one `BPF_MAP_GET_NEXT_KEY`
//! syscall per entry: a full `NPM_CT4`, 262,016 entries, took 0.39 s in a
//! debug build, `tests/ebpf_fill.rs`; both maps full, about 0.8 s every
//! 30 s, under 3% of one core) and `NPM_FRAGS` (at most 8,192).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use npm_common::{maps, sizes, PolicyKey};
use npm_policy::compiled::{Compiled, CompiledDiff, MapDiff, PolicyEntry, TierEntry};

use super::{tiers, translate, EbpfDataplane};

/// The [`MapFill::fallbacks`] of the folded decisions (`NPM_FOLD`): per
/// endpoint record, each direction with tier entries (`EP_ADMIN_<dir>` or
/// `EP_BASELINE_<dir>`) that is not flagged folded (`EP_FOLD_<dir>`).
pub(crate) fn fold_fallbacks(records: impl Iterator<Item = u32>) -> u64 {
    use npm_common::{DIR_EGRESS, DIR_INGRESS, EP_FOLD_INGRESS, EP_TIERS_INGRESS};
    records
        .map(|f| {
            [DIR_INGRESS, DIR_EGRESS]
                .into_iter()
                .filter(|dir| f & (EP_TIERS_INGRESS << dir) != 0 && f & (EP_FOLD_INGRESS << dir) == 0)
                .count() as u64
        })
        .sum()
}

/// How often the datapath's maps (conntrack, fragments) are counted.
pub const DATAPATH_COUNT_INTERVAL: Duration = Duration::from_secs(30);

/// One map's fill.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapFill {
    /// The pinned map name (`NPM_POLICY`...).
    pub map: &'static str,
    /// Entries (slots in use for the direct-mapped arrays, entries for
    /// `NPM_FOLD`).
    pub entries: u64,
    /// The most entries the map can hold.
    pub capacity: u64,
    /// For `NPM_FOLD`, once the first full sync is done: the local
    /// endpoint directions with tier entries that are not folded (too
    /// large for the map) and are decided by the lookups on `NPM_TIERS`
    /// and `NPM_POLICY` (same verdicts, slower). `None` for the other
    /// maps.
    pub fallbacks: Option<u64>,
}

/// (subject, direction, peer, protocol): the entries whose LPM keys may
/// coincide.
type Group = (u32, u8, u32, Option<u8>);

fn group(e: &PolicyEntry) -> Group {
    (e.subject, e.direction.as_u8(), e.peer, e.protocol.map(|p| p as u8))
}

/// (subject, direction, tier, peer, protocol): the tier entries whose LPM
/// keys may coincide.
type TierGroup = (u32, u8, u8, u32, Option<u8>);

fn tier_group(e: &TierEntry) -> TierGroup {
    (
        e.subject,
        e.direction.as_u8(),
        translate::tier_bit(e.tier),
        e.peer,
        e.protocol.map(|p| p as u8),
    )
}

/// The distinct LPM keys of the entries of `next` in the group of `e`.
fn group_keys(next: &Compiled, e: &PolicyEntry) -> usize {
    let lo = PolicyEntry { ports: (0, 0), ..*e };
    let hi = PolicyEntry {
        ports: (u16::MAX, u16::MAX),
        ..*e
    };
    let mut keys: BTreeSet<PolicyKey> = BTreeSet::new();
    for (other, _) in next.policy.range(lo..=hi) {
        if let Ok(k) = translate::policy_keys(other) {
            keys.extend(k);
        }
    }
    keys.len()
}

/// Recounts the key groups (`group_of`) that `diff` touches, each once (a
/// diff may change many entries of one): `keys_of` an entry gives its
/// group's distinct keys in the target; `groups` and `total` follow.
fn recount<E, V, G: Ord>(
    diff: &MapDiff<E, V>,
    group_of: impl Fn(&E) -> G,
    keys_of: impl Fn(&E) -> usize,
    groups: &mut BTreeMap<G, usize>,
    total: &mut usize,
) {
    let entries = diff.upsert.iter().map(|(e, _)| e).chain(&diff.remove);
    let touched: BTreeMap<G, &E> = entries.map(|e| (group_of(e), e)).collect();
    for (g, e) in touched {
        let now = keys_of(e);
        let before = if now == 0 {
            groups.remove(&g)
        } else {
            groups.insert(g, now)
        };
        *total = (*total + now).saturating_sub(before.unwrap_or(0));
    }
}

/// The counts of the maps the writer writes (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct Fill {
    /// Whether a full sync succeeded (the counts are known).
    pub(super) known: bool,
    /// `NPM_IPCACHE` entries.
    pub(super) ipcache: usize,
    cidrs: usize,
    /// Group -> its distinct LPM keys.
    policy_groups: BTreeMap<Group, usize>,
    /// `NPM_POLICY` keys.
    pub(super) policy_keys: usize,
    /// Tier group -> its distinct LPM keys.
    tier_groups: BTreeMap<TierGroup, usize>,
    tier_keys: usize,
    /// The datapath maps' counts and when they were taken.
    datapath: Mutex<Option<(Instant, [usize; 3])>>,
}

impl Fill {
    /// A full sync of `compiled` succeeded (its `NPM_POLICY` keys are
    /// `keys`, its `NPM_TIERS` keys `tier_keys`).
    pub(crate) fn synced(&mut self, compiled: &Compiled, keys: usize, tier_keys: usize) {
        self.known = true;
        self.ipcache = compiled.ipcache.len();
        self.cidrs = compiled.cidrs.len();
        self.policy_groups.clear();
        for e in compiled.policy.keys() {
            if let std::collections::btree_map::Entry::Vacant(v) = self.policy_groups.entry(group(e)) {
                v.insert(group_keys(compiled, e));
            }
        }
        // The writer's own count of the keys it wrote (equal to the sum
        // over the groups).
        self.policy_keys = keys;
        self.tier_groups.clear();
        for e in compiled.tiers.keys() {
            if let std::collections::btree_map::Entry::Vacant(v) = self.tier_groups.entry(tier_group(e)) {
                v.insert(tiers::group_keys(compiled, e));
            }
        }
        self.tier_keys = tier_keys;
    }

    /// `diff` (which took the maps to `next`) was applied.
    pub(crate) fn applied(&mut self, diff: &CompiledDiff, next: &Compiled) {
        if !self.known {
            return;
        }
        self.ipcache = next.ipcache.len();
        self.cidrs = next.cidrs.len();
        recount(
            &diff.policy,
            group,
            |e| group_keys(next, e),
            &mut self.policy_groups,
            &mut self.policy_keys,
        );
        recount(
            &diff.tiers,
            tier_group,
            |e| tiers::group_keys(next, e),
            &mut self.tier_groups,
            &mut self.tier_keys,
        );
    }
}

impl EbpfDataplane {
    /// Every map's fill (see the module doc); the maps the writer counts
    /// only after the first full sync. The capacity is the map's real
    /// `max_entries` (configured, or kept by a pinned map).
    pub fn map_fill(&self) -> Vec<MapFill> {
        let fill = |map, entries: usize, capacity: u32| MapFill {
            map,
            entries: entries as u64,
            capacity: u64::from(capacity),
            fallbacks: None,
        };
        let fold_fallbacks = self
            .fill
            .known
            .then(|| fold_fallbacks(self.written.values().map(|i| i.flags)));
        let actual = &self.sizes.actual;
        let mut out = Vec::new();
        if self.fill.known {
            let ifindexes: BTreeSet<u32> = self.programmed.values().copied().collect();
            let slots = ifindexes.iter().filter(|i| **i < sizes::ENDPOINT_SLOTS).count();
            out.extend([
                fill(maps::EP_SLOTS, slots, sizes::ENDPOINT_SLOTS),
                fill(maps::ENDPOINTS, ifindexes.len() - slots, sizes::ENDPOINTS),
                fill(maps::IPCACHE, self.fill.ipcache, actual.ipcache),
                fill(maps::CIDRS, self.fill.cidrs, actual.cidrs),
                fill(maps::POLICY, self.fill.policy_keys, actual.policy),
                fill(maps::TIERS, self.fill.tier_keys, actual.tiers),
            ]);
        }
        out.push(fill(maps::IPCACHE4, self.ipcache4_occupied(), sizes::IPCACHE4_SLOTS));
        out.push(MapFill {
            fallbacks: fold_fallbacks,
            ..fill(
                maps::FOLD,
                self.fold_len(),
                sizes::FOLD_BUCKETS * npm_common::FOLD_WAYS as u32,
            )
        });
        let [ct, ct4, frags] = self.datapath_counts();
        out.extend([
            fill(maps::CT, ct, actual.conntrack),
            fill(maps::CT4, ct4, actual.conntrack),
            fill(maps::FRAGS, frags, sizes::FRAGS),
        ]);
        out
    }

    /// `NPM_CT`, `NPM_CT4` and `NPM_FRAGS` entries, counted at most once
    /// per [`DATAPATH_COUNT_INTERVAL`].
    fn datapath_counts(&self) -> [usize; 3] {
        let mut last = self.fill.datapath.lock().unwrap_or_else(|p| p.into_inner());
        match *last {
            Some((at, counts)) if at.elapsed() < DATAPATH_COUNT_INTERVAL => counts,
            _ => {
                let (ct, ct4) = self.flows.ct_lens();
                let counts = [ct, ct4, self.flows.frag_len()];
                *last = Some((Instant::now(), counts));
                counts
            }
        }
    }

    /// Forget the datapath maps' last count (the next [`Self::map_fill`]
    /// counts them again).
    pub fn recount_datapath_maps(&self) {
        *self.fill.datapath.lock().unwrap_or_else(|p| p.into_inner()) = None;
    }
}

#[cfg(test)]
mod tests {
    use super::fold_fallbacks;
    use npm_common::{EP_ADMIN_INGRESS, EP_BASELINE_EGRESS, EP_FOLD_EGRESS, EP_FOLD_INGRESS, EP_ISOLATED_INGRESS};

    #[test]
    fn fold_fallbacks_count_tiered_directions_not_folded() {
        assert_eq!(fold_fallbacks([0u32, EP_ISOLATED_INGRESS].into_iter()), 0);
        let f = EP_ADMIN_INGRESS | EP_BASELINE_EGRESS;
        assert_eq!(fold_fallbacks([f].into_iter()), 2);
        assert_eq!(fold_fallbacks([f | EP_FOLD_INGRESS].into_iter()), 1);
        assert_eq!(fold_fallbacks([f | EP_FOLD_INGRESS | EP_FOLD_EGRESS, f].into_iter()), 2);
    }
}
