//! The policy flags of each subject, kept between applies
//! ([`PolicyFlags`]) and written into the record of every endpoint of
//! that subject (its pod identity, `EndpointInfo::subject`):
//! `EP_NO_<class>_PEER_<dir>` when no entry of the subject's direction has
//! a peer of that class (any, CIDR, pod identity), so the datapath skips
//! that lookup; `EP_FRONT_<dir>` when the policy front holds every word of
//! the direction's entries, so the datapath trusts a front miss;
//! `EP_FRONT_EXACT_<dir>` when none of them is a wildcard.
//!
//! The flags are derived from counts per (subject, direction, peer,
//! protocol) group of entries: how many entries, how many the front does
//! not hold, how many are wildcards. A group's counts depend only on its
//! own entries and on the front's words of that group (a word names its
//! subject, direction, peer and protocol, and is stored only in a free
//! slot, never in place of another word), so an apply recounts only the
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

use npm_common::{
    ep_no_peer_flag, EP_FRONT_EXACT_INGRESS, EP_FRONT_INGRESS, EP_NO_ANY_PEER_INGRESS, EP_NO_CIDR_PEER_INGRESS,
    EP_NO_POD_PEER_INGRESS,
};
use npm_policy::compiled::{Compiled, Direction, MapDiff, PolicyEntry};
use npm_policy::model::Protocol;

use super::{translate, FRONT_ALL};

/// (subject, direction, peer, protocol): the entries whose front words
/// only they produce.
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
    /// Entries whose words the front does not all hold.
    not_held: u32,
    /// Wildcard entries ([`translate::is_wildcard`]).
    wildcards: u32,
}

impl Counts {
    fn is_empty(&self) -> bool {
        self.by_class == [0; 3]
    }

    fn add(&mut self, o: &Counts) {
        for (a, b) in self.by_class.iter_mut().zip(o.by_class) {
            *a += b;
        }
        self.not_held += o.not_held;
        self.wildcards += o.wildcards;
    }

    fn sub(&mut self, o: &Counts) {
        for (a, b) in self.by_class.iter_mut().zip(o.by_class) {
            *a -= b;
        }
        self.not_held -= o.not_held;
        self.wildcards -= o.wildcards;
    }

    /// Counts entry `e`, `held` telling whether the front holds its words.
    fn count(&mut self, e: &PolicyEntry, held: bool) {
        self.by_class[class_of(e.peer)] += 1;
        self.not_held += u32::from(!held);
        self.wildcards += u32::from(translate::is_wildcard(e));
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
    let mut flags = translate::EP_NO_PEER_ALL | FRONT_ALL;
    for (side, dir) in [(ingress, Direction::Ingress), (egress, Direction::Egress)] {
        let Some(c) = side else { continue };
        let shift = dir.as_u8();
        for (n, f) in c.by_class.iter().zip(CLASS_FLAGS) {
            if *n > 0 {
                flags &= !(f << shift);
            }
        }
        if c.not_held > 0 {
            flags &= !(EP_FRONT_INGRESS << shift);
        }
        if c.wildcards > 0 {
            flags &= !(EP_FRONT_EXACT_INGRESS << shift);
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
    /// missing has none: [`translate::EP_NO_PEER_ALL`] | [`FRONT_ALL`]),
    /// `held` telling
    /// whether the front holds every word of an entry. Counts the touched
    /// groups again, or everything (see the module doc); called after the
    /// batch's upserts.
    pub(crate) fn compute(&mut self, next: &Compiled, held: impl Fn(&PolicyEntry) -> bool) -> &BTreeMap<u32, u32> {
        if std::mem::take(&mut self.all) {
            self.touched.clear();
            self.groups.clear();
            self.sides.clear();
            for e in next.policy.keys() {
                self.groups.entry(group(e)).or_default().count(e, held(e));
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
                    now.count(e, held(e));
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
            from_scratch(next, &held),
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
fn from_scratch(next: &Compiled, held: &impl Fn(&PolicyEntry) -> bool) -> BTreeMap<u32, u32> {
    let mut sides: BTreeMap<(u32, Direction), Counts> = BTreeMap::new();
    for e in next.policy.keys() {
        sides.entry((e.subject, e.direction)).or_default().count(e, held(e));
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

    /// A sequence of applies (with a front that holds only TCP words) keeps
    /// the flags a full count gives, entry by entry.
    #[test]
    fn touched_groups_keep_the_flags_of_a_full_count() {
        use Direction::{Egress, Ingress};
        let tcp = Some(Protocol::Tcp);
        let held = |e: &PolicyEntry| e.protocol == Some(Protocol::Tcp);
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
        flags.compute(&before, held);
        for step in steps {
            let next = compiled(&step);
            let diff = before.diff(&next);
            flags.begin_apply(&diff.policy);
            let got = flags.compute(&next, held).clone();
            flags.end_batch(true);
            let mut full = PolicyFlags::default();
            assert_eq!(got, *full.compute(&next, held), "after {step:?}");
            before = next;
        }
        assert!(flags.groups.is_empty() && flags.sides.is_empty() && flags.flags.is_empty());
    }

    /// The flags of one subject: a pod peer over TCP port 80 held by the
    /// front, a CIDR peer of every UDP port not held.
    #[test]
    fn flags_name_the_classes_present_and_what_the_front_holds() {
        use Direction::{Egress, Ingress};
        let next = compiled(&[
            entry(7, Ingress, 300, Some(Protocol::Tcp), (80, 80)),
            entry(7, Egress, IDENTITY_FIRST_CIDR, Some(Protocol::Udp), (0, u16::MAX)),
        ]);
        let mut flags = PolicyFlags::default();
        let f = flags.compute(&next, |e| e.protocol == Some(Protocol::Tcp))[&7];
        let eg = Direction::Egress.as_u8();
        assert_eq!(f & EP_NO_POD_PEER_INGRESS, 0);
        assert_ne!(f & EP_NO_CIDR_PEER_INGRESS, 0);
        assert_ne!(f & EP_NO_ANY_PEER_INGRESS, 0);
        assert_eq!(f & (EP_NO_CIDR_PEER_INGRESS << eg), 0);
        assert_ne!(f & (EP_NO_POD_PEER_INGRESS << eg), 0);
        assert_ne!(f & EP_FRONT_INGRESS, 0);
        assert_ne!(f & EP_FRONT_EXACT_INGRESS, 0);
        assert_eq!(f & (EP_FRONT_INGRESS << eg), 0);
        assert_eq!(f & (EP_FRONT_EXACT_INGRESS << eg), 0);
    }

    /// Flags are per subject: the two subjects below differ, and a subject
    /// too large for a front word never gets `EP_FRONT_*` for a direction
    /// with entries, whatever the front holds (it has no words: it keeps
    /// the LPM), while one just below the limit does.
    #[test]
    fn a_subject_beyond_the_front_word_keeps_the_lpm() {
        use npm_common::POLICY_FRONT_MAX_SUBJECT;
        let tcp = Some(Protocol::Tcp);
        let small = POLICY_FRONT_MAX_SUBJECT - 1;
        let big = POLICY_FRONT_MAX_SUBJECT;
        let next = compiled(&[
            entry(small, Direction::Ingress, 300, tcp, (80, 80)),
            entry(big, Direction::Ingress, 300, tcp, (80, 80)),
        ]);
        // A front that holds every word there is (the writer's test, with
        // every store succeeding).
        let held = |e: &PolicyEntry| translate::front_word_iter(e).is_some();
        let mut flags = PolicyFlags::default();
        let f = flags.compute(&next, held).clone();
        assert_eq!(f.len(), 2);
        assert_ne!(f[&small] & EP_FRONT_INGRESS, 0);
        assert_eq!(f[&big] & EP_FRONT_INGRESS, 0);
        // Both still skip what their entries rule out.
        for s in [small, big] {
            assert_eq!(f[&s] & EP_NO_POD_PEER_INGRESS, 0);
            assert_ne!(f[&s] & EP_NO_ANY_PEER_INGRESS, 0);
        }
    }
}
