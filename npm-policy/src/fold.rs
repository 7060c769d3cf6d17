//! The ahead-of-time fold of one endpoint direction's decision.
//!
//! The datapath decides a new connection from the endpoint's flags, the
//! peer's two identities (step 8: its pod or node identity and its CIDR
//! identity, a *peer class*), the protocol and the destination port
//! ([`crate::lookup`], steps 1 to 6: Host, Admin tier, NetworkPolicy,
//! Baseline tier, allow). For one endpoint, direction and peer class that
//! is a function of (protocol, port) alone, and a piecewise constant one:
//! the entries that can match (the tier and policy entries of the class's
//! three identities) change only at their ranges' ends. [`fold`] computes
//! that function as a few runs of ports per protocol, each with the
//! decision [`crate::lookup::lookup`] takes there, so that one lookup of
//! (class, protocol, port) can stand for the Admin tier, NetworkPolicy and
//! the Baseline tier together. (The tier compiler's
//! [`crate::tiers::compile::fold`] is one step earlier: it folds one tier's
//! ordered rules per peer identity into entries; this folds those entries,
//! NetworkPolicy's and the precedence between them for the three
//! identities of a class into one decision.)
//!
//! Used by `npmctl ports`, measured by `bench_tiers`, and stored by the
//! eBPF loader as `NPM_FOLD`, the one precomputed form of the datapath's
//! decision (`npm-dataplane/src/ebpf/fold.rs`).
//!
//! Pure: no I/O. The differential test (`tests/differential.rs`) checks
//! every folded decision against [`crate::lookup::lookup`], which it checks
//! against the reference evaluator.

use std::collections::BTreeSet;

use npm_common::{Reason, IDENTITY_ANY, IDENTITY_WORLD};

use crate::compiled::{Compiled, Direction, PolicyEntry, Tier, TierEntry};
use crate::lookup::{decide, LookupResult};
use crate::model::Protocol;

/// A peer class: the two identities that step 8 gives a peer address.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerClass {
    /// Pod identity, node identity, `IDENTITY_HOST`, or `IDENTITY_WORLD`
    /// for an address the ipcache does not hold.
    pub identity: u32,
    /// Identity of the longest ipBlock prefix holding the address
    /// (`IDENTITY_ANY`: none).
    pub cidr_identity: u32,
}

/// Every peer class an address can resolve to under `compiled`: each
/// ipcache entry's, and `IDENTITY_WORLD` with each CIDR identity and with
/// none (an address the ipcache does not hold).
pub fn peer_classes(compiled: &Compiled) -> BTreeSet<PeerClass> {
    let mut classes: BTreeSet<PeerClass> = compiled
        .ipcache
        .values()
        .map(|e| PeerClass {
            identity: e.identity,
            cidr_identity: e.cidr_identity,
        })
        .collect();
    classes.extend(
        compiled
            .cidrs
            .values()
            .copied()
            .chain([IDENTITY_ANY])
            .map(|cidr_identity| PeerClass {
                identity: IDENTITY_WORLD,
                cidr_identity,
            }),
    );
    classes
}

/// One folded decision: what [`crate::lookup::lookup`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Decision {
    /// Why (the datapath's reason).
    pub reason: Reason,
    /// The deciding rule (see [`LookupResult::rule`]).
    pub rule: Option<u32>,
}

impl Decision {
    /// The packet passes.
    pub fn allowed(&self) -> bool {
        !self.reason.is_deny()
    }
}

impl From<LookupResult> for Decision {
    fn from(r: LookupResult) -> Self {
        Decision {
            reason: r.reason,
            rule: r.rule,
        }
    }
}

/// Destination ports `lo..=hi` of one protocol, decided alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PortRun {
    /// First port.
    pub lo: u16,
    /// Last port.
    pub hi: u16,
    /// The decision for every port of the run.
    pub decision: Decision,
}

/// The protocols with ports, in [`Folded::ported`]'s order.
pub const PORTED: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

/// One endpoint direction's decisions for one peer class ([`fold`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Folded {
    /// Every protocol other than TCP, UDP and SCTP (only entries of every
    /// protocol match them, and the datapath gives them port 0).
    pub other: Decision,
    /// Per protocol of [`PORTED`]: runs covering 0..=65535 in order, two
    /// neighbours never decided alike.
    pub ported: [Vec<PortRun>; 3],
}

impl Folded {
    /// The decision for `protocol` (an IP protocol number) and destination
    /// `port`: the run holding it.
    pub fn decide(&self, protocol: u8, port: u16) -> Decision {
        let Some(i) = PORTED.iter().position(|p| p.number() == protocol) else {
            return self.other;
        };
        let runs = &self.ported[i];
        // The last run starting at or below `port` (runs start at 0).
        let at = runs.partition_point(|r| r.lo <= port) - 1;
        runs[at].decision
    }

    /// Runs in all (at least one per protocol of [`PORTED`]).
    pub fn runs(&self) -> usize {
        self.ported.iter().map(Vec::len).sum()
    }

    /// Words of an encoding with `NPM_FOLD`'s port classes: one word
    /// for every protocol ([`Folded::other`]), per protocol one any-port
    /// word for its widest run's decision unless that is `other`'s, and
    /// the other runs' ports as aligned 64-port blocks inside a run and
    /// exact ports at its ends. What a loader storing the fold would
    /// write.
    pub fn front_words(&self) -> usize {
        let mut words = 1;
        for runs in &self.ported {
            let widest = runs
                .iter()
                .max_by_key(|r| u32::from(r.hi) - u32::from(r.lo))
                .expect("runs cover every port");
            if widest.decision != self.other {
                words += 1;
            }
            for r in runs.iter().filter(|r| r.decision != widest.decision) {
                words += run_words(r.lo, r.hi);
            }
        }
        words
    }
}

/// Exact and aligned 64-port block words covering `lo..=hi`.
fn run_words(lo: u16, hi: u16) -> usize {
    let (lo, hi) = (u32::from(lo), u32::from(hi) + 1);
    let first_block = lo.div_ceil(64) * 64;
    let end_block = hi / 64 * 64;
    if first_block >= end_block {
        return (hi - lo) as usize;
    }
    ((first_block - lo) + (end_block - first_block) / 64 + (hi - end_block)) as usize
}

/// The decisions of local endpoint `endpoint` in `direction` for peers of
/// `class`, per protocol and port: equal to [`crate::lookup::lookup`] for
/// every address of that class. `None` when `endpoint` is not compiled.
pub fn fold(compiled: &Compiled, endpoint: u32, direction: Direction, class: PeerClass) -> Option<Folded> {
    let ep = compiled.endpoints.get(&endpoint)?;
    let start = LookupResult {
        allowed: true,
        reason: Reason::NoEndpoint,
        rule: None,
        admin: None,
        baseline: None,
        peer_identity: class.identity,
        cidr_identity: class.cidr_identity,
    };
    let at = |protocol: u8, port: u16| Decision::from(decide(compiled, ep, direction, start, protocol, port));
    let ids = [class.identity, class.cidr_identity, IDENTITY_ANY];
    let ported = PORTED.map(|p| {
        let mut runs: Vec<PortRun> = Vec::new();
        for (lo, hi) in segments(&bounds(compiled, ep.identity, direction, ids, p)) {
            let decision = at(p.number(), lo);
            match runs.last_mut() {
                Some(last) if last.decision == decision => last.hi = hi,
                _ => runs.push(PortRun { lo, hi, decision }),
            }
        }
        runs
    });
    Some(Folded {
        other: at(1, 0),
        ported,
    })
}

/// Where the entries of protocol `protocol` that subject `subject` has in
/// `direction` for the identities `ids` (policy entries and both tiers'
/// entries) start and end: each range's first port and the port after its
/// last, with 0. Between two neighbours the same entries match every port.
fn bounds(compiled: &Compiled, subject: u32, direction: Direction, ids: [u32; 3], protocol: Protocol) -> BTreeSet<u32> {
    let mut at = BTreeSet::from([0u32]);
    let mut add = |ports: (u16, u16)| {
        at.insert(u32::from(ports.0));
        at.insert(u32::from(ports.1) + 1);
    };
    for peer in ids {
        let lo = PolicyEntry {
            subject,
            direction,
            peer,
            protocol: Some(protocol),
            ports: (0, 0),
        };
        let hi = PolicyEntry {
            ports: (u16::MAX, u16::MAX),
            ..lo
        };
        compiled.policy.range(lo..=hi).for_each(|(e, _)| add(e.ports));
        for tier in [Tier::Admin, Tier::Baseline] {
            let lo = TierEntry {
                subject,
                direction,
                tier,
                peer,
                protocol: Some(protocol),
                ports: (0, 0),
            };
            let hi = TierEntry {
                ports: (u16::MAX, u16::MAX),
                ..lo
            };
            compiled.tiers.range(lo..=hi).for_each(|(e, _)| add(e.ports));
        }
    }
    at
}

/// The port ranges between neighbouring `bounds` (which hold 0), up to
/// 65535.
fn segments(bounds: &BTreeSet<u32>) -> Vec<(u16, u16)> {
    let starts: Vec<u32> = bounds.iter().copied().filter(|b| *b <= 0xffff).collect();
    starts
        .iter()
        .enumerate()
        .map(|(i, lo)| {
            let end = starts.get(i + 1).copied().unwrap_or(0x1_0000);
            (*lo as u16, (end - 1) as u16)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_split_at_every_bound() {
        let b = BTreeSet::from([0, 80, 81, 1000, 0x1_0000]);
        assert_eq!(segments(&b), vec![(0, 79), (80, 80), (81, 999), (1000, 65535)]);
        assert_eq!(segments(&BTreeSet::from([0])), vec![(0, 65535)]);
    }

    #[test]
    fn run_words_use_blocks_inside_a_run() {
        assert_eq!(run_words(80, 80), 1);
        assert_eq!(run_words(0, 63), 1);
        assert_eq!(run_words(1, 64), 63 + 1);
        assert_eq!(run_words(0, 65535), 1024);
        assert_eq!(run_words(60, 130), 4 + 1 + 3);
    }
}
