//! The tier front's ranks: per (endpoint, direction, tier) an
//! order-preserving map from the compiler's ranks (`priority << 20 | …`,
//! up to 2^30) to the 14-bit ranks a front word holds
//! ([`TIER_FRONT_MAX_RANK`]).
//!
//! The datapath compares front ranks only with front ranks of the same
//! endpoint, direction and tier (a tier is decided on the front or on
//! `NPM_TIERS`, never a mix), so only the order inside such a group
//! matters, and an order-preserving map keeps "lower rank wins" the same
//! as on `NPM_TIERS` for every packet.
//!
//! The map is stable: a compiler rank keeps its front rank for as long as
//! it is in use. New ranks are put in the gaps between their neighbours
//! (a fresh numbering spreads the ranks evenly over the 2^14), so a new or
//! re-prioritised CNP only writes its own words. When a gap is too small
//! the group is renumbered, and only while the datapath does not read the
//! front for it: the group is first marked [`FrontRanks::pending`] (its
//! endpoint's front flag is then written cleared, the tier is decided on
//! `NPM_TIERS`), its words are rewritten, then the flag is set again.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use npm_common::TIER_FRONT_MAX_RANK;

/// An (endpoint, direction, tier) of the front: the top 21 bits of its
/// words' keys ([`group_of_key`]).
pub(crate) type Group = u64;

/// The group of a `tier_front_key` (endpoint, tier and direction bits).
pub(crate) const fn group_of_key(key: u64) -> Group {
    key >> 43
}

/// Compiler rank -> front rank, strictly increasing.
pub(crate) type Numbering = BTreeMap<u32, u32>;

/// The numbering of every group that has words, and the groups waiting for
/// a renumbering.
#[derive(Default)]
pub(crate) struct FrontRanks {
    groups: HashMap<Group, Numbering>,
    /// Groups whose words may not be written until they are renumbered
    /// with the front off (no room in a gap, or words adopted from pins
    /// whose numbering this loader does not know).
    pending: BTreeSet<Group>,
}

impl FrontRanks {
    /// The front rank of compiler rank `rank` in `group`, if it has one
    /// and the group is not pending.
    pub(crate) fn number(&self, group: Group, rank: u32) -> Option<u32> {
        if self.pending.contains(&group) {
            return None;
        }
        self.groups.get(&group)?.get(&rank).copied()
    }

    /// Whether `group` waits for a renumbering.
    pub(crate) fn pending(&self, group: Group) -> bool {
        self.pending.contains(&group)
    }

    /// Marks `group` as waiting for a renumbering.
    pub(crate) fn set_pending(&mut self, group: Group) {
        self.pending.insert(group);
    }

    /// Gives every rank of `ranks` (the group's ranks in the target state)
    /// that has none a front rank in the gap between its numbered
    /// neighbours, keeping every existing number. Returns false (and marks
    /// the group pending) when a gap is too small; a pending group is left
    /// alone (false).
    pub(crate) fn place(&mut self, group: Group, ranks: &BTreeSet<u32>) -> bool {
        if self.pending.contains(&group) {
            return false;
        }
        let numbering = self.groups.entry(group).or_default();
        match placed(numbering, ranks) {
            Some(n) => {
                *numbering = n;
                true
            }
            None => {
                self.pending.insert(group);
                false
            }
        }
    }

    /// Drops the numbers of ranks of `group` no longer in `ranks` (none of
    /// its words carries them any more once the batch's removals are
    /// done), and the group when `ranks` is empty.
    pub(crate) fn prune(&mut self, group: Group, ranks: &BTreeSet<u32>) {
        if ranks.is_empty() {
            self.groups.remove(&group);
            self.pending.remove(&group);
        } else if let Some(n) = self.groups.get_mut(&group) {
            n.retain(|r, _| ranks.contains(r));
        }
    }

    /// Drops every group not in `keep`.
    pub(crate) fn retain(&mut self, keep: &BTreeSet<Group>) {
        self.groups.retain(|g, _| keep.contains(g));
        self.pending.retain(|g| keep.contains(g));
    }

    /// Installs a renumbering of a pending group (its words are then
    /// rewritten by the caller, while the front is off for it).
    pub(crate) fn renumbered(&mut self, group: Group, numbering: Numbering) {
        self.pending.remove(&group);
        self.groups.insert(group, numbering);
    }
}

/// A fresh numbering of `ranks`, spread evenly over the front's ranks;
/// `None` when there are more ranks than front ranks.
pub(crate) fn fresh(ranks: &BTreeSet<u32>) -> Option<Numbering> {
    spread(-1, i64::from(TIER_FRONT_MAX_RANK), ranks.iter().copied())
}

/// `k` ranks spread evenly strictly between front ranks `lo` and `hi`.
fn spread(lo: i64, hi: i64, ranks: impl ExactSizeIterator<Item = u32>) -> Option<Numbering> {
    let k = ranks.len() as i64;
    if hi - lo - 1 < k {
        return None;
    }
    // (j + 1) (hi - lo) / (k + 1) grows by at least 1 per step (hi - lo >
    // k) and stays below hi - lo.
    Some(
        ranks
            .enumerate()
            .map(|(j, r)| (r, (lo + (j as i64 + 1) * (hi - lo) / (k + 1)) as u32))
            .collect(),
    )
}

/// `numbering` extended to every rank of `ranks` (existing numbers kept),
/// or `None` when some run of new ranks does not fit its gap.
fn placed(numbering: &Numbering, ranks: &BTreeSet<u32>) -> Option<Numbering> {
    let mut out = numbering.clone();
    let mut run: Vec<u32> = Vec::new();
    let mut lo: i64 = -1;
    let flush = |out: &mut Numbering, run: &mut Vec<u32>, lo: i64, hi: i64| -> Option<()> {
        if !run.is_empty() {
            out.extend(spread(lo, hi, run.drain(..))?);
        }
        Some(())
    };
    // Walk the union of the old and the wanted ranks in order: a run of
    // new ranks lies between two numbered ones.
    let all: BTreeSet<u32> = numbering.keys().chain(ranks.iter()).copied().collect();
    for r in all {
        match numbering.get(&r) {
            Some(&n) => {
                flush(&mut out, &mut run, lo, i64::from(n))?;
                lo = i64::from(n);
            }
            None => run.push(r),
        }
    }
    flush(&mut out, &mut run, lo, i64::from(TIER_FRONT_MAX_RANK))?;
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(v: &[u32]) -> BTreeSet<u32> {
        v.iter().copied().collect()
    }

    fn increasing(n: &Numbering) -> bool {
        n.values().zip(n.values().skip(1)).all(|(a, b)| a < b) && n.values().all(|v| *v < TIER_FRONT_MAX_RANK)
    }

    #[test]
    fn fresh_numbering_keeps_the_order_and_fits() {
        let ranks = set(&[10 << 20, 20 << 20, 500 << 20 | 3, 1000 << 20 | 31]);
        let n = fresh(&ranks).unwrap();
        assert_eq!(n.keys().copied().collect::<BTreeSet<_>>(), ranks);
        assert!(increasing(&n));
        let full: BTreeSet<u32> = (0..TIER_FRONT_MAX_RANK).map(|r| r << 10).collect();
        assert!(increasing(&fresh(&full).unwrap()));
        let over: BTreeSet<u32> = (0..=TIER_FRONT_MAX_RANK).collect();
        assert!(fresh(&over).is_none());
    }

    #[test]
    fn new_ranks_go_in_the_gaps_and_old_numbers_stay() {
        let mut fr = FrontRanks::default();
        let g = 7;
        assert!(fr.place(g, &set(&[10 << 20, 20 << 20])));
        let a = fr.number(g, 10 << 20).unwrap();
        let b = fr.number(g, 20 << 20).unwrap();
        assert!(a < b);
        // A CNP between the two, one before and one after: old numbers stay.
        assert!(fr.place(
            g,
            &set(&[5 << 20, 10 << 20, 15 << 20, 15 << 20 | 1, 20 << 20, 30 << 20])
        ));
        assert_eq!((fr.number(g, 10 << 20), fr.number(g, 20 << 20)), (Some(a), Some(b)));
        let n = fr.groups[&g].clone();
        assert!(increasing(&n));
        // A priority change: 10 moves behind 20 (a new rank after b).
        fr.prune(g, &set(&[20 << 20, 40 << 20]));
        assert!(fr.place(g, &set(&[20 << 20, 40 << 20])));
        assert!(fr.number(g, 40 << 20).unwrap() > b);
        assert_eq!(fr.number(g, 10 << 20), None);
    }

    #[test]
    fn a_full_gap_makes_the_group_pending_until_renumbered() {
        let mut fr = FrontRanks::default();
        let g = 1;
        let mut numbering = Numbering::new();
        numbering.insert(100, 5);
        numbering.insert(200, 6);
        fr.renumbered(g, numbering);
        assert!(!fr.place(g, &set(&[100, 150, 200])));
        assert!(fr.pending(g));
        assert_eq!(fr.number(g, 100), None);
        // A pending group is not placed again.
        assert!(!fr.place(g, &set(&[100, 200])));
        let n = fresh(&set(&[100, 150, 200])).unwrap();
        fr.renumbered(g, n);
        assert!(!fr.pending(g));
        assert!(fr.number(g, 100) < fr.number(g, 150) && fr.number(g, 150) < fr.number(g, 200));
        // Repeated insertions into one gap end in a renumbering, never in
        // two ranks sharing a number.
        let mut ranks = set(&[0, 1 << 29]);
        let mut fr = FrontRanks::default();
        assert!(fr.place(g, &ranks));
        for i in 1..64u32 {
            ranks.insert(i);
            if !fr.place(g, &ranks) {
                assert!(fr.pending(g));
                fr.renumbered(g, fresh(&ranks).unwrap());
            }
            assert!(increasing(&fr.groups[&g]));
            assert_eq!(fr.groups[&g].len(), ranks.len());
        }
    }
}
