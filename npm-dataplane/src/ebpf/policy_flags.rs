//! The policy flags of each subject, kept between applies
//! ([`PolicyFlags`]) and written into the record of every endpoint of
//! that subject (its pod identity, `EndpointInfo::subject`):
//! `EP_NO_<class>_PEER_<dir>` when no entry of the subject's direction has
//! a peer of that class (any, CIDR, pod identity), so the datapath skips
//! that lookup of `NPM_POLICY`.
//!
//! The flags are derived from counts per (subject, direction, peer,
//! protocol) group of entries. A group's counts depend only on its own
//! entries, so an apply recounts only the
//! groups its diff touches and the work is proportional to the change,
//! not to the entries of the subjects it touches. A full sync or a failed
//! batch counts everything again; debug builds check the kept flags
//! against a pass over every entry.
//!
//! The writer looks an endpoint's flags up by its subject when it writes
//! the record, after the batch's upserts, and rewrites every record whose
//! flags differ from those last written: a change of a subject's groups
//! rewrites every endpoint of that subject, an endpoint whose subject
//! changed (a relabelled pod) gets its new subject's flags with its new
//! subject, and the old subject's entries go only with the removals,
//! after the record stopped naming them (invariant 4).

use std::collections::{BTreeMap, BTreeSet};

use npm_common::{ep_no_peer_flag, EP_NO_ANY_PEER_INGRESS, EP_NO_CIDR_PEER_INGRESS, EP_NO_POD_PEER_INGRESS};
use npm_policy::compiled::{Compiled, Direction, MapDiff, PolicyEntry};
use npm_policy::model::Protocol;

use super::translate;

/// (subject, direction, peer, protocol): a group of entries.
type Group = (u32, Direction, u32, Option<Protocol>);

fn group(e: &PolicyEntry) -> Group {
    (e.subject, e.direction, e.peer, e.protocol)
}

/// The entries of `next` in group `g`.
fn entries_of(next: &Compiled, g: Group) -> impl Iterator<Item = &PolicyEntry> {
    let (subject, direction, peer, protocol) = g;
    let lo = PolicyEntry {
        subject,
        direction,
        peer,
        protocol,
        ports: (0, 0),
    };
    let hi = PolicyEntry {
        ports: (u16::MAX, u16::MAX),
        ..lo
    };
    next.policy.range(lo..=hi).map(|(e, _)| e)
}

/// The counts of one group, or of one (subject, direction) side.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Counts {
    /// Entries with an any / a CIDR / a pod identity peer.
    by_class: [u32; 3],
}

impl Counts {
    fn is_empty(&self) -> bool {
        self.by_class == [0; 3]
    }

    fn add(&mut self, o: &Counts) {
        for (a, b) in self.by_class.iter_mut().zip(o.by_class) {
            *a += b;
        }
    }

    fn sub(&mut self, o: &Counts) {
        for (a, b) in self.by_class.iter_mut().zip(o.by_class) {
            *a -= b;
        }
    }

    /// Counts entry `e`.
    fn count(&mut self, e: &PolicyEntry) {
        self.by_class[class_of(e.peer)] += 1;
    }
}

/// The `EP_NO_*_PEER_INGRESS` flags in [`Counts::by_class`] order.
const CLASS_FLAGS: [u32; 3] = [EP_NO_ANY_PEER_INGRESS, EP_NO_CIDR_PEER_INGRESS, EP_NO_POD_PEER_INGRESS];

fn class_of(peer: u32) -> usize {
    let flag = ep_no_peer_flag(peer);
    CLASS_FLAGS.iter().position(|f| *f == flag).unwrap_or(0)
}

/// The flags of a subject whose sides have `ingress` and `egress`.
fn flags_of(ingress: Option<&Counts>, egress: Option<&Counts>) -> u32 {
    let mut flags = translate::EP_NO_PEER_ALL;
    for (side, dir) in [(ingress, Direction::Ingress), (egress, Direction::Egress)] {
        let Some(c) = side else { continue };
        let shift = dir.as_u8();
        for (n, f) in c.by_class.iter().zip(CLASS_FLAGS) {
            if *n > 0 {
                flags &= !(f << shift);
            }
        }
    }
    flags
}

/// Each subject's policy flags and the group counts they come from (see
/// the module doc).
#[derive(Debug)]
pub(crate) struct PolicyFlags {
    groups: BTreeMap<Group, Counts>,
    sides: BTreeMap<(u32, Direction), Counts>,
    /// Subject -> flags, for the subjects with entries.
    flags: BTreeMap<u32, u32>,
    /// Everything is counted again by the next [`PolicyFlags::compute`].
    all: bool,
    /// The groups the current batch touches.
    touched: BTreeSet<Group>,
}

impl Default for PolicyFlags {
    fn default() -> Self {
        PolicyFlags {
            groups: BTreeMap::new(),
            sides: BTreeMap::new(),
            flags: BTreeMap::new(),
            all: true,
            touched: BTreeSet::new(),
        }
    }
}

impl PolicyFlags {
    /// Records the groups an apply's policy changes touch (upserted or
    /// removed entries); called before the batch's first write.
    pub(crate) fn begin_apply(&mut self, diff: &MapDiff<PolicyEntry, u32>) {
        let entries = diff.upsert.iter().map(|(e, _)| e).chain(&diff.remove);
        self.touched.extend(entries.map(group));
    }

    /// A full sync starts: everything is counted again.
    pub(crate) fn begin_sync(&mut self) {
        self.all = true;
    }

    /// Ends a batch; after a failed one everything is counted again.
    pub(crate) fn end_batch(&mut self, ok: bool) {
        self.touched.clear();
        if !ok {
            self.all = true;
        }
    }

    /// The flags of every subject of `next` that has policy entries
    /// (subject -> flags, for every endpoint of that subject; a subject
    /// missing has none: [`translate::EP_NO_PEER_ALL`]). Counts the touched
    /// groups again, or everything (see the module doc); called after the
    /// batch's upserts.
    pub(crate) fn compute(&mut self, next: &Compiled) -> &BTreeMap<u32, u32> {
        if std::mem::take(&mut self.all) {
            self.touched.clear();
            self.groups.clear();
            self.sides.clear();
            for e in next.policy.keys() {
                self.groups.entry(group(e)).or_default().count(e);
            }
            for (g, c) in &self.groups {
                self.sides.entry((g.0, g.1)).or_default().add(c);
            }
            self.flags = self.flags_from_sides(self.sides.keys().map(|(subject, _)| *subject).collect());
        } else {
            let mut subjects = BTreeSet::new();
            for g in std::mem::take(&mut self.touched) {
                let mut now = Counts::default();
                for e in entries_of(next, g) {
                    now.count(e);
                }
                let before = if now.is_empty() {
                    self.groups.remove(&g)
                } else {
                    self.groups.insert(g, now)
                };
                let side = self.sides.entry((g.0, g.1)).or_default();
                if let Some(b) = before {
                    side.sub(&b);
                }
                side.add(&now);
                if side.is_empty() {
                    self.sides.remove(&(g.0, g.1));
                }
                subjects.insert(g.0);
            }
            let changed = self.flags_from_sides(subjects.clone());
            for subject in subjects {
                match changed.get(&subject) {
                    Some(f) => self.flags.insert(subject, *f),
                    None => self.flags.remove(&subject),
                };
            }
        }
        #[cfg(debug_assertions)]
        debug_assert_eq!(
            self.flags,
            from_scratch(next),
            "policy flags kept per touched group differ from a pass over every entry"
        );
        &self.flags
    }

    /// The flags of the subjects `subjects` that have entries, from their
    /// sides.
    fn flags_from_sides(&self, subjects: BTreeSet<u32>) -> BTreeMap<u32, u32> {
        subjects
            .into_iter()
            .filter_map(|s| {
                let ingress = self.sides.get(&(s, Direction::Ingress));
                let egress = self.sides.get(&(s, Direction::Egress));
                (ingress.is_some() || egress.is_some()).then(|| (s, flags_of(ingress, egress)))
            })
            .collect()
    }
}

/// [`PolicyFlags::compute`]'s result from a pass over every entry of
/// `next` (what the kept flags must equal; checked in debug builds).
#[cfg(debug_assertions)]
fn from_scratch(next: &Compiled) -> BTreeMap<u32, u32> {
    let mut sides: BTreeMap<(u32, Direction), Counts> = BTreeMap::new();
    for e in next.policy.keys() {
        sides.entry((e.subject, e.direction)).or_default().count(e);
    }
    let subjects: BTreeSet<u32> = sides.keys().map(|(s, _)| *s).collect();
    subjects
        .into_iter()
        .map(|s| {
            let f = flags_of(sides.get(&(s, Direction::Ingress)), sides.get(&(s, Direction::Egress)));
            (s, f)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::{IDENTITY_ANY, IDENTITY_FIRST_CIDR};

    fn entry(
        subject: u32,
        direction: Direction,
        peer: u32,
        protocol: Option<Protocol>,
        ports: (u16, u16),
    ) -> PolicyEntry {
        PolicyEntry {
            subject,
            direction,
            peer,
            protocol,
            ports,
        }
    }

    fn compiled(entries: &[PolicyEntry]) -> Compiled {
        let mut c = Compiled::default();
        for e in entries {
            c.policy.insert(*e, 1);
        }
        c
    }

    /// A sequence of applies keeps the flags a full count gives, entry by
    /// entry.
    #[test]
    fn touched_groups_keep_the_flags_of_a_full_count() {
        use Direction::{Egress, Ingress};
        let tcp = Some(Protocol::Tcp);
        let pod = 300;
        let cidr = IDENTITY_FIRST_CIDR + 1;
        let steps: Vec<Vec<PolicyEntry>> = vec![
            vec![entry(1, Ingress, pod, tcp, (80, 80))],
            vec![
                entry(1, Ingress, pod, tcp, (80, 80)),
                entry(1, Ingress, pod, tcp, (0, u16::MAX)),
            ],
            vec![
                entry(1, Ingress, pod, tcp, (80, 80)),
                entry(1, Egress, cidr, Some(Protocol::Udp), (53, 53)),
                entry(2, Ingress, IDENTITY_ANY, None, (0, u16::MAX)),
            ],
            vec![entry(2, Ingress, IDENTITY_ANY, None, (0, u16::MAX))],
            vec![],
        ];
        let mut flags = PolicyFlags::default();
        let mut before = Compiled::default();
        flags.compute(&before);
        for step in steps {
            let next = compiled(&step);
            let diff = before.diff(&next);
            flags.begin_apply(&diff.policy);
            let got = flags.compute(&next).clone();
            flags.end_batch(true);
            let mut full = PolicyFlags::default();
            assert_eq!(got, *full.compute(&next), "after {step:?}");
            before = next;
        }
        assert!(flags.groups.is_empty() && flags.sides.is_empty() && flags.flags.is_empty());
    }

    /// The flags of one subject: a pod peer over TCP port 80, a CIDR peer
    /// of every UDP port.
    #[test]
    fn flags_name_the_classes_present() {
        use Direction::{Egress, Ingress};
        let next = compiled(&[
            entry(7, Ingress, 300, Some(Protocol::Tcp), (80, 80)),
            entry(7, Egress, IDENTITY_FIRST_CIDR, Some(Protocol::Udp), (0, u16::MAX)),
        ]);
        let mut flags = PolicyFlags::default();
        let f = flags.compute(&next)[&7];
        let eg = Direction::Egress.as_u8();
        assert_eq!(f & EP_NO_POD_PEER_INGRESS, 0);
        assert_ne!(f & EP_NO_CIDR_PEER_INGRESS, 0);
        assert_ne!(f & EP_NO_ANY_PEER_INGRESS, 0);
        assert_eq!(f & (EP_NO_CIDR_PEER_INGRESS << eg), 0);
        assert_ne!(f & (EP_NO_POD_PEER_INGRESS << eg), 0);
    }
}
