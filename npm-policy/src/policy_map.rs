//! [`PolicyMap`]: the allow entries of a compile ([`crate::compiled::Compiled::policy`]),
//! held as one small ordered map per (subject, direction).
//!
//! A policy change rewrites the entries of a few (subject, direction)
//! groups; with one map per group the incremental compiler rebuilds a
//! group in one linear pass ([`PolicyMap::set_group`]) instead of
//! inserting and removing entries one by one in a map of every entry of
//! the node (a million at 100,000 pods). Iteration order is that of one
//! `BTreeMap<PolicyEntry, u32>`: subject, direction, peer, protocol, ports.

use std::collections::btree_map;
use std::collections::BTreeMap;
use std::fmt;
use std::ops::{Bound, RangeInclusive};

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::compiled::{Direction, PolicyEntry};

/// (subject, direction): the key of one group of entries.
pub type PolicyGroup = (u32, Direction);

/// Allow entries -> rule id, grouped by (subject, direction). Groups are
/// never kept empty.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct PolicyMap {
    groups: BTreeMap<PolicyGroup, BTreeMap<PolicyEntry, u32>>,
}

/// The group of an entry.
fn group_of(e: &PolicyEntry) -> PolicyGroup {
    (e.subject, e.direction)
}

/// The entries of `subject` in `dir` towards `peer` (in entry order:
/// from its first possible entry up to the first of `peer + 1`).
pub fn peer_range(subject: u32, direction: Direction, peer: u32) -> (Bound<PolicyEntry>, Bound<PolicyEntry>) {
    let first = |peer: u32| PolicyEntry {
        subject,
        direction,
        peer,
        protocol: None,
        ports: (0, 0),
    };
    (
        Bound::Included(first(peer)),
        match peer.checked_add(1) {
            Some(next) => Bound::Excluded(first(next)),
            None => Bound::Unbounded,
        },
    )
}

/// Iterator over the entries of a [`PolicyMap`], in entry order.
pub type Iter<'a> = std::iter::Flatten<btree_map::Values<'a, PolicyGroup, BTreeMap<PolicyEntry, u32>>>;

impl PolicyMap {
    /// An empty map.
    pub fn new() -> PolicyMap {
        PolicyMap::default()
    }

    /// Number of entries (one pass over the groups, not the entries).
    pub fn len(&self) -> usize {
        self.groups.values().map(BTreeMap::len).sum()
    }

    /// No entry.
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The rule id of entry `e`.
    pub fn get(&self, e: &PolicyEntry) -> Option<&u32> {
        self.groups.get(&group_of(e))?.get(e)
    }

    /// Whether `e` is an entry.
    pub fn contains_key(&self, e: &PolicyEntry) -> bool {
        self.get(e).is_some()
    }

    /// Sets the rule id of `e`; returns the previous one.
    pub fn insert(&mut self, e: PolicyEntry, rule: u32) -> Option<u32> {
        self.groups.entry(group_of(&e)).or_default().insert(e, rule)
    }

    /// Adds `e` with `rule`, or keeps the lower rule id when it is there
    /// (how the compiler merges the entries of several rules).
    pub fn insert_min(&mut self, e: PolicyEntry, rule: u32) {
        let slot = self.groups.entry(group_of(&e)).or_default().entry(e).or_insert(rule);
        *slot = (*slot).min(rule);
    }

    /// Removes `e`; returns its rule id.
    pub fn remove(&mut self, e: &PolicyEntry) -> Option<u32> {
        let g = group_of(e);
        let map = self.groups.get_mut(&g)?;
        let old = map.remove(e);
        if map.is_empty() {
            self.groups.remove(&g);
        }
        old
    }

    /// Every entry, in entry order.
    pub fn iter(&self) -> Iter<'_> {
        self.groups.values().flatten()
    }

    /// Every entry key, in order.
    pub fn keys(&self) -> impl Iterator<Item = &PolicyEntry> + '_ {
        self.iter().map(|(e, _)| e)
    }

    /// Every rule id, in entry order.
    pub fn values(&self) -> impl Iterator<Item = &u32> + '_ {
        self.iter().map(|(_, r)| r)
    }

    /// The entries from `range.start()` to `range.end()` inclusive, in
    /// order (one group's map when both ends are in one group, as for the
    /// entries of one peer).
    pub fn range(&self, range: RangeInclusive<PolicyEntry>) -> impl Iterator<Item = (&PolicyEntry, &u32)> + '_ {
        let (lo, hi) = range.into_inner();
        let groups = if lo <= hi {
            Some(self.groups.range(group_of(&lo)..=group_of(&hi)))
        } else {
            None
        };
        groups
            .into_iter()
            .flatten()
            .flat_map(move |(_, map)| map.range(lo..=hi))
    }

    /// The entries of group (`subject`, `dir`).
    pub fn group(&self, subject: u32, dir: Direction) -> Option<&BTreeMap<PolicyEntry, u32>> {
        self.groups.get(&(subject, dir))
    }

    /// The groups, in order.
    pub fn groups(&self) -> impl Iterator<Item = (&PolicyGroup, &BTreeMap<PolicyEntry, u32>)> + '_ {
        self.groups.iter()
    }

    /// Takes the entries of group (`subject`, `dir`) out of the map.
    pub fn take_group(&mut self, subject: u32, dir: Direction) -> BTreeMap<PolicyEntry, u32> {
        self.groups.remove(&(subject, dir)).unwrap_or_default()
    }

    /// Makes `entries` the entries of group (`subject`, `dir`), replacing
    /// what it had. Every entry must be of that group.
    pub fn set_group(&mut self, subject: u32, dir: Direction, entries: BTreeMap<PolicyEntry, u32>) {
        debug_assert!(
            entries.keys().all(|e| group_of(e) == (subject, dir)),
            "an entry of another group"
        );
        if entries.is_empty() {
            self.groups.remove(&(subject, dir));
        } else {
            self.groups.insert((subject, dir), entries);
        }
    }

    /// Removes every entry of `subject`.
    pub fn remove_subject(&mut self, subject: u32) {
        for dir in [Direction::Ingress, Direction::Egress] {
            self.groups.remove(&(subject, dir));
        }
    }

    /// Removes the entries of `subject` in `dir` towards `peer`.
    pub fn remove_peer(&mut self, subject: u32, dir: Direction, peer: u32) {
        let Some(map) = self.groups.get_mut(&(subject, dir)) else {
            return;
        };
        let gone: Vec<PolicyEntry> = map.range(peer_range(subject, dir, peer)).map(|(e, _)| *e).collect();
        for e in gone {
            map.remove(&e);
        }
        if map.is_empty() {
            self.groups.remove(&(subject, dir));
        }
    }

    /// Keeps the entries for which `keep` is true.
    pub fn retain(&mut self, mut keep: impl FnMut(&PolicyEntry, &mut u32) -> bool) {
        self.groups.retain(|_, map| {
            map.retain(&mut keep);
            !map.is_empty()
        });
    }

    /// Removes every entry.
    pub fn clear(&mut self) {
        self.groups.clear();
    }
}

impl<'a> IntoIterator for &'a PolicyMap {
    type Item = (&'a PolicyEntry, &'a u32);
    type IntoIter = Iter<'a>;
    fn into_iter(self) -> Iter<'a> {
        self.iter()
    }
}

impl Extend<(PolicyEntry, u32)> for PolicyMap {
    /// Inserts each entry (a later one replaces an earlier one).
    fn extend<T: IntoIterator<Item = (PolicyEntry, u32)>>(&mut self, iter: T) {
        for (e, r) in iter {
            self.insert(e, r);
        }
    }
}

impl FromIterator<(PolicyEntry, u32)> for PolicyMap {
    /// Groups the entries (one pass when they come in order, as from a
    /// `BTreeMap`).
    fn from_iter<T: IntoIterator<Item = (PolicyEntry, u32)>>(iter: T) -> PolicyMap {
        let mut map = PolicyMap::new();
        let mut run: Vec<(PolicyEntry, u32)> = Vec::new();
        let flush = |map: &mut PolicyMap, run: &mut Vec<(PolicyEntry, u32)>| {
            let Some((first, _)) = run.first() else { return };
            let g = group_of(first);
            let entries: BTreeMap<PolicyEntry, u32> = std::mem::take(run).into_iter().collect();
            match map.groups.get_mut(&g) {
                Some(old) => old.extend(entries),
                None => {
                    map.groups.insert(g, entries);
                }
            }
        };
        for (e, r) in iter {
            if run.first().is_some_and(|(f, _)| group_of(f) != group_of(&e)) {
                flush(&mut map, &mut run);
            }
            run.push((e, r));
        }
        flush(&mut map, &mut run);
        map
    }
}

impl From<BTreeMap<PolicyEntry, u32>> for PolicyMap {
    fn from(entries: BTreeMap<PolicyEntry, u32>) -> PolicyMap {
        entries.into_iter().collect()
    }
}

impl fmt::Debug for PolicyMap {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

impl Serialize for PolicyMap {
    /// As one map of entries (the form of a `BTreeMap<PolicyEntry, u32>`).
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_map(self.iter())
    }
}

impl<'de> Deserialize<'de> for PolicyMap {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<PolicyMap, D::Error> {
        Ok(BTreeMap::<PolicyEntry, u32>::deserialize(d)?.into())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Protocol;

    fn e(subject: u32, direction: Direction, peer: u32, port: u16) -> PolicyEntry {
        PolicyEntry {
            subject,
            direction,
            peer,
            protocol: Some(Protocol::Tcp),
            ports: (port, port),
        }
    }

    #[test]
    fn iterates_in_the_order_of_one_ordered_map() {
        let entries = [
            e(2, Direction::Egress, 1, 80),
            e(1, Direction::Ingress, 9, 80),
            e(1, Direction::Egress, 3, 443),
            e(1, Direction::Ingress, 9, 22),
            e(2, Direction::Ingress, 5, 53),
        ];
        let mut map = PolicyMap::new();
        let mut reference = BTreeMap::new();
        for (i, x) in entries.iter().enumerate() {
            map.insert(*x, i as u32);
            reference.insert(*x, i as u32);
        }
        assert!(map.iter().eq(reference.iter()));
        assert_eq!(map.len(), 5);
        let collected: PolicyMap = reference.clone().into();
        assert_eq!(collected, map);
        let lo = e(1, Direction::Ingress, 9, 0);
        let hi = e(1, Direction::Ingress, 9, u16::MAX);
        assert!(map.range(lo..=hi).eq(reference.range(lo..=hi)));
        let lo = e(1, Direction::Egress, 0, 0);
        let hi = e(2, Direction::Ingress, u32::MAX, u16::MAX);
        assert!(map.range(lo..=hi).eq(reference.range(lo..=hi)));
    }

    #[test]
    fn empty_groups_do_not_stay() {
        let mut map = PolicyMap::new();
        map.insert(e(1, Direction::Ingress, 9, 80), 1);
        map.insert(e(1, Direction::Egress, 9, 80), 1);
        map.insert_min(e(1, Direction::Egress, 9, 80), 3);
        assert_eq!(map.get(&e(1, Direction::Egress, 9, 80)), Some(&1));
        map.remove(&e(1, Direction::Ingress, 9, 80));
        map.remove_peer(1, Direction::Egress, 9);
        assert!(map.is_empty());
        assert_eq!(map, PolicyMap::new());
        map.insert(e(1, Direction::Ingress, 9, 80), 1);
        map.retain(|_, _| false);
        assert!(map.is_empty() && map.groups().next().is_none());
    }
}
