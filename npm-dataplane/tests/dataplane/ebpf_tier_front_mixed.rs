//! The tier front against the `NPM_TIERS` LPM on varied rule sets, through
//! `BPF_PROG_TEST_RUN` on the real programs: seeded random sets of tier
//! entries (both tiers, both endpoints, pod, CIDR and any peers, exact
//! ports, ranges over 64-port blocks, any port, any protocol, now and then
//! a range too long for the front that keeps its tier on the LPM) are
//! applied one after the other as diffs to a dataplane reading the front
//! and to one that never does, and every probe (each source, TCP and UDP,
//! ports at and around every edge) must get the same verdict and reason
//! from both. This covers the shared summaries (one word per identity for
//! both tiers, written and shrunk by the diffs) and the first-hit order of
//! the port classes. A third dataplane decides by the folded decisions
//! (`NPM_FOLD`, one probe per packet) and must agree too, through the same
//! diffs. Needs root.

use crate::ebpf_common::*;
use npm_common::{
    Reason, EP_ADMIN_FRONT_INGRESS, EP_BASELINE_FRONT_INGRESS, EP_FOLD_EGRESS, EP_FOLD_INGRESS, IDENTITY_ANY,
};
use npm_dataplane::ebpf::BenchSwitches;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN, Tier, TierAction, TierEntry, TierValue};
use npm_policy::model::Protocol;
use npm_testkit::rng::Xorshift as Rng;

const POD_B: u32 = TIER_POD_B;
const POD_C: u32 = TIER_POD_C;
const BLOCK: u32 = TIER_BLOCK;

/// [`tier_fixture`]: endpoint 1 (isolated for ingress: its NetworkPolicy
/// allows POD_B on TCP 80, so its Baseline tier is never consulted) and
/// endpoint 2 (isolated by none).
fn base() -> Compiled {
    let mut c = tier_fixture(false);
    allow(&mut c, 1, IN, POD_B, Some(Protocol::Tcp), (80, 80), 1);
    c
}

/// Disjoint port ranges an entry of one protocol may take: exact ports, a
/// range with edge ports and two blocks, an aligned block, a range over
/// three blocks with edges.
const RANGES: [(u16, u16); 6] = [
    (53, 53),
    (60, 200),
    (443, 443),
    (1024, 1087),
    (8000, 8100),
    (9000, 9000),
];
/// A range that does not fit the front (more words than an entry may
/// take): its endpoint's tier stays on `NPM_TIERS`.
const LONG: (u16, u16) = (20_000, 40_000);

/// A random set of tier entries over [`base`], with ranks unique per
/// endpoint and tier (as the compiler's are per direction and tier).
fn random_set(rng: &mut Rng) -> Compiled {
    let mut c = base();
    for ep in [1, 2] {
        for tier in [Tier::Admin, Tier::Baseline] {
            // Shuffled ranks 1..=n for this tier.
            let mut ranks: Vec<u32> = (1..=64).collect();
            for i in (1..ranks.len()).rev() {
                ranks.swap(i, rng.below(i as u64 + 1) as usize);
            }
            let mut next_rank = ranks.into_iter();
            let mut any = false;
            for peer in [POD_B, POD_C, BLOCK, IDENTITY_ANY] {
                let mut add = |c: &mut Compiled, protocol, ports, rng: &mut Rng| {
                    let action = match rng.below(3) {
                        0 => TierAction::Accept,
                        1 => TierAction::Deny,
                        _ => TierAction::Pass,
                    };
                    let rank = next_rank.next().expect("enough ranks");
                    let entry = TierEntry {
                        subject: c.endpoints[&ep].identity,
                        direction: IN,
                        tier,
                        peer,
                        protocol,
                        ports,
                    };
                    c.tiers.insert(
                        entry,
                        TierValue {
                            action,
                            rank,
                            rule: 1000 + rank,
                        },
                    );
                };
                if rng.below(4) == 0 {
                    add(&mut c, None, (0, 0), rng);
                    any = true;
                }
                for protocol in [Protocol::Tcp, Protocol::Udp] {
                    match rng.below(4) {
                        0 => {}
                        1 => {
                            add(&mut c, Some(protocol), (0, u16::MAX), rng);
                            any = true;
                        }
                        _ => {
                            for r in RANGES {
                                if rng.below(3) == 0 {
                                    add(&mut c, Some(protocol), r, rng);
                                    any = true;
                                }
                            }
                            if rng.below(12) == 0 {
                                add(&mut c, Some(protocol), LONG, rng);
                                any = true;
                            }
                        }
                    }
                }
            }
            if any {
                c.endpoints.get_mut(&ep).unwrap().tiers.set(tier, IN);
            }
        }
    }
    c
}

/// Ports at and around every edge of [`RANGES`] and [`LONG`].
const PORTS: [u16; 17] = [
    0, 53, 59, 60, 64, 127, 128, 200, 201, 443, 1024, 1087, 8000, 8100, 9000, 20_000, 40_001,
];

/// A [`TierDp`] on [`base`] with `switches`.
fn fixture(tag: &str, switches: BenchSwitches) -> TierDp {
    TierDp::new(tag, &base(), switches)
}

/// The rounds' view of a [`TierDp`].
trait Rounds {
    /// Every probe (POD_B with its CIDR identity, POD_C, an unknown
    /// address; [`PORTS`]) from source port `sport`.
    fn grid(&mut self, sport: u16) -> Vec<TierProbe>;
    /// How many endpoint directions are flagged folded (`EP_FOLD_*`).
    fn folded(&self) -> usize;
    /// How many (endpoint, tier)s are on the front.
    fn on_front(&self) -> usize;
}

impl Rounds for TierDp {
    fn grid(&mut self, sport: u16) -> Vec<TierProbe> {
        self.probe_grid(&["10.0.0.2", "10.0.0.3", "10.0.0.9"], &PORTS, sport)
    }

    fn folded(&self) -> usize {
        let d = self.dp.dump().unwrap();
        d.endpoints
            .iter()
            .map(|e| (e.flags & (EP_FOLD_INGRESS | EP_FOLD_EGRESS)).count_ones() as usize)
            .sum()
    }

    fn on_front(&self) -> usize {
        let d = self.dp.dump().unwrap();
        d.endpoints
            .iter()
            .map(|e| {
                usize::from(e.flags & EP_ADMIN_FRONT_INGRESS != 0)
                    + usize::from(e.flags & EP_BASELINE_FRONT_INGRESS != 0)
            })
            .sum()
    }
}

#[test]
fn the_tier_front_decides_as_the_lpm_does_on_random_rule_sets() {
    sweep_leftovers();
    let mut front = fixture(
        "tfm",
        BenchSwitches {
            no_fold: true,
            ..BenchSwitches::default()
        },
    );
    let mut lpm = fixture(
        "tfn",
        BenchSwitches {
            no_tier_front: true,
            no_fold: true,
            ..BenchSwitches::default()
        },
    );
    // The folded decisions (NPM_FOLD) on the same rule sets.
    let mut folded = fixture("tfo", BenchSwitches::default());
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut prev = base();
    let (mut decided, mut fronted, mut folds, mut want_folds) = (0, 0, 0, 0);
    for round in 0..8u16 {
        let next = random_set(&mut rng);
        front.apply(&prev, &next);
        lpm.apply(&prev, &next);
        folded.apply(&prev, &next);
        fronted += front.on_front();
        folds += folded.folded();
        want_folds += next
            .endpoints
            .values()
            .flat_map(|e| {
                [IN, npm_policy::compiled::Direction::Egress]
                    .into_iter()
                    .filter(|d| e.tiers.has(Tier::Admin, *d) || e.tiers.has(Tier::Baseline, *d))
            })
            .count();
        let sport = 40_000 + round;
        let (g_front, g_lpm, g_fold) = (front.grid(sport), lpm.grid(sport), folded.grid(sport));
        for ((f, l), o) in g_front.iter().zip(&g_lpm).zip(&g_fold) {
            assert_eq!(f, l, "round {round}: front vs LPM");
            assert_eq!(o, l, "round {round}: folded vs LPM");
        }
        decided += g_front
            .iter()
            .filter(|p| {
                matches!(
                    p.4 .1,
                    Some(Reason::AdminAccept | Reason::AdminDeny | Reason::BaselineAccept | Reason::BaselineDeny)
                )
            })
            .count();
        prev = next;
    }
    // Not trivial: the tiers decided many probes, most tiers were read
    // from the front.
    assert!(decided > 200, "tier-decided probes: {decided}");
    assert!(
        fronted > 16,
        "(endpoint, tier)s on the front over the rounds: {fronted}"
    );
    // Every round's tiered directions were folded.
    assert!(
        want_folds > 8,
        "tiered (endpoint, direction)s over the rounds: {want_folds}"
    );
    assert_eq!(folds, want_folds, "folded (endpoint, direction)s over the rounds");
    // Back to no tier entry: the front empties, the packets are decided as
    // without tiers; nothing is folded any more.
    front.apply(&prev, &base());
    assert_eq!(front.dp.tier_front_len(), 0);
    folded.apply(&prev, &base());
    assert_eq!((folded.dp.fold_len(), folded.folded()), (0, 0));
}
