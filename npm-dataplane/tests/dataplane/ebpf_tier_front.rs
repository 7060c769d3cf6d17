//! The tier front (`NPM_TIER_FRONT`), through `BPF_PROG_TEST_RUN` on the
//! real programs: it decides exactly as the `NPM_TIERS` LPM does (every
//! entry form: exact ports, a range of edge ports and 64-port blocks, any
//! port, any protocol, CIDR and any peers, ranks across identities), the
//! datapath really reads it for a tier complete there (the LPM emptied
//! behind the loader's back changes nothing), a value change is one store
//! and follows diffs, a tier that does not fit (a long range, a full
//! bucket) stays on the LPM and correct, and the compiler's real ranks
//! (`priority << 20 | …`) are renumbered onto the front and decide in
//! their order through priority changes and renumberings. The class filter
//! `NPM_TIER_SUMMARY` holds exactly the bits the front's words need, the
//! datapath reads it, and trusts it only on endpoints flagged
//! `EP_TIER_SUMMARY`. Needs root.

use crate::ebpf_common::tier_in as tier;
use crate::ebpf_common::*;
use aya::maps::{Array, Map, MapData};
use npm_common::{
    maps, tier_front_is_summary, tier_front_key, tier_front_key_of, tier_front_pc_exact, tier_front_pc_of,
    tier_front_shared_summary_key, tier_front_slot, tier_front_summary_key, tier_summary_bits, tier_summary_slot,
    EndpointInfo, Reason, DIR_INGRESS, EP_ADMIN_FRONT_INGRESS, EP_BASELINE_FRONT_INGRESS, EP_TIER_SUMMARY,
    IDENTITY_ANY, TIER_ADMIN, TIER_FRONT_MAX_RANK,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN, Tier, TierAction::*, TierEntry};
use npm_policy::model::Protocol::{Tcp, Udp};

const POD_B: u32 = TIER_POD_B;
const POD_C: u32 = TIER_POD_C;

/// [`tier_fixture`] with endpoint 1 isolated both ways.
fn base() -> Compiled {
    let mut c = tier_fixture(true);
    // Endpoint 1's NetworkPolicy allows POD_B on TCP 80.
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    c
}

/// Every entry form in both tiers of both endpoints; endpoint 2's Baseline
/// tier also has a 20,000-port range, which keeps that tier on the LPM.
fn compiled() -> Compiled {
    let mut c = base();
    for ep in [1, 2] {
        tier_entry_forms(&mut c, ep);
        tier(&mut c, ep, Tier::Admin, IDENTITY_ANY, Some(Tcp), (0, 59), Accept, 11);
        tier(&mut c, ep, Tier::Baseline, IDENTITY_ANY, None, (0, 0), Accept, 8);
    }
    tier(&mut c, 2, Tier::Baseline, POD_B, Some(Tcp), (20_000, 40_000), Deny, 6);
    c
}

/// One probe of [`TierFront::grid`].
type Probe = TierProbe;

/// The tier front tests' dataplane.
type Fixture = TierDp;

/// A dataplane on `c` with `switches`, never reading the folded decisions
/// (`NPM_FOLD`, which would decide these tiers before the tier front:
/// `ebpf_fold.rs` tests it).
fn fixture(tag: &str, c: &Compiled, switches: BenchSwitches) -> Fixture {
    let switches = BenchSwitches {
        no_fold: true,
        ..switches
    };
    sweep_leftovers();
    TierDp::new(tag, c, switches)
}

/// The probes: every source, both endpoints, TCP and UDP ports at and
/// around every edge of the entries.
const PORTS: [u16; 16] = [
    0, 53, 59, 60, 63, 64, 127, 128, 200, 201, 443, 8000, 8100, 9000, 20_000, 40_001,
];

/// The tier front tests' probes of a [`TierDp`].
trait TierFront {
    /// A new flow from `src`'s port 40000 to endpoint `ep`'s `port`.
    fn run(&self, ep: u32, src: &str, udp: bool, port: u16) -> (i32, Option<Reason>);
    /// [`TierFront::run`] from source port `sport` (a new flow, not one
    /// tracked by an earlier probe).
    fn run_from(&self, ep: u32, src: &str, sport: u16, udp: bool, port: u16) -> (i32, Option<Reason>);
    /// Every probe's (verdict, reason): POD_B and POD_C, [`PORTS`].
    fn grid(&mut self, sport: u16) -> Vec<Probe>;
}

impl TierFront for TierDp {
    fn run(&self, ep: u32, src: &str, udp: bool, port: u16) -> (i32, Option<Reason>) {
        self.probe(ep, src, 40000, udp, port)
    }

    fn run_from(&self, ep: u32, src: &str, sport: u16, udp: bool, port: u16) -> (i32, Option<Reason>) {
        self.probe(ep, src, sport, udp, port)
    }

    fn grid(&mut self, sport: u16) -> Vec<Probe> {
        self.probe_grid(&["10.0.0.2", "10.0.0.3"], &PORTS, sport)
    }
}

/// The non-zero words of the pinned `NPM_TIER_FRONT`, the summary words
/// apart: (entry words, summary words). Checks that the summaries are
/// exactly one per (endpoint, direction, tier, identity) with entry words
/// and one shared per (endpoint, direction, identity).
fn kernel_words(pin_dir: &std::path::Path) -> (usize, usize) {
    let data = MapData::from_pin(pin_dir.join(maps::TIER_FRONT)).expect("open pinned NPM_TIER_FRONT");
    let front: Array<MapData, [u64; 4]> =
        Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIER_FRONT");
    let (mut words, mut summaries) = (std::collections::BTreeSet::new(), std::collections::BTreeSet::new());
    for (bucket, b) in front.iter().enumerate() {
        for w in b.expect("bucket").into_iter().filter(|w| *w != 0) {
            let key = tier_front_key_of(bucket as u32, w, npm_common::TIER_FRONT_SHIFT);
            if tier_front_is_summary(tier_front_pc_of(key)) {
                summaries.insert(key);
            } else {
                words.insert(key);
            }
        }
    }
    let identities: std::collections::BTreeSet<u64> = words
        .iter()
        .flat_map(|k| [tier_front_summary_key(*k), tier_front_shared_summary_key(*k)])
        .collect();
    assert_eq!(
        identities, summaries,
        "one per-tier and one shared summary word per identity with words"
    );
    // The class filter: each slot is exactly the OR of the bits of the
    // words whose (endpoint, direction, identity) lands there.
    let mut want = std::collections::BTreeMap::<u32, u64>::new();
    for k in &words {
        *want
            .entry(tier_summary_slot(
                tier_front_shared_summary_key(*k),
                npm_common::TIER_FRONT_SHIFT,
            ))
            .or_default() |= tier_summary_bits(*k);
    }
    let have: std::collections::BTreeMap<u32, u64> = kernel_filter(pin_dir)
        .into_iter()
        .enumerate()
        .filter(|(_, w)| *w != 0)
        .map(|(i, w)| (i as u32, w))
        .collect();
    assert_eq!(
        have, want,
        "the class filter names exactly the words' classes and ports"
    );
    (words.len(), summaries.len())
}

/// Every slot of the pinned class filter `NPM_TIER_SUMMARY`.
fn kernel_filter(pin_dir: &std::path::Path) -> Vec<u64> {
    let data = MapData::from_pin(pin_dir.join(maps::TIER_SUMMARY)).expect("open pinned NPM_TIER_SUMMARY");
    let filter: Array<MapData, u64> =
        Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIER_SUMMARY");
    filter.iter().map(|w| w.expect("slot")).collect()
}

/// Zeroes every slot of the pinned class filter, behind the loader's back.
fn clear_kernel_filter(pin_dir: &std::path::Path) {
    let data = MapData::from_pin(pin_dir.join(maps::TIER_SUMMARY)).expect("open pinned NPM_TIER_SUMMARY");
    let mut filter: Array<MapData, u64> =
        Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIER_SUMMARY");
    let set: Vec<u32> = (0..filter.len()).filter(|i| filter.get(i, 0).unwrap() != 0).collect();
    assert!(!set.is_empty());
    for i in set {
        filter.set(i, 0, 0).unwrap();
    }
}

/// Clears `flag` in the pinned endpoint record of `ifindex`, behind the
/// loader's back.
fn clear_endpoint_flag(pin_dir: &std::path::Path, ifindex: u32, flag: u32) {
    let data = MapData::from_pin(pin_dir.join(maps::EP_SLOTS)).expect("open pinned NPM_EP_SLOTS");
    let mut slots: Array<MapData, EndpointInfo> =
        Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_EP_SLOTS");
    let mut info = slots.get(&ifindex, 0).unwrap();
    assert_ne!(info.flags & flag, 0);
    info.flags &= !flag;
    slots.set(ifindex, info, 0).unwrap();
}

/// Empties the pinned `NPM_TIERS`, behind the loader's back.
fn drop_kernel_tiers(pin_dir: &std::path::Path) {
    use aya::maps::lpm_trie::{Key, LpmTrie};
    let data = MapData::from_pin(pin_dir.join(maps::TIERS)).expect("open pinned NPM_TIERS");
    let mut trie: LpmTrie<MapData, [u8; 12], npm_common::TierValue> =
        LpmTrie::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIERS");
    let keys: Vec<Key<[u8; 12]>> = trie.keys().map(|k| k.unwrap()).collect();
    for k in keys {
        trie.remove(&k).unwrap();
    }
}

#[test]
fn the_tier_front_decides_as_the_lpm_does() {
    let c = compiled();
    let mut front = fixture("tfa", &c, BenchSwitches::default());
    let mut lpm = fixture(
        "tfl",
        &c,
        BenchSwitches {
            no_tier_front: true,
            ..BenchSwitches::default()
        },
    );
    // Which tiers the front holds: all but endpoint 2's Baseline.
    assert_ne!(front.flags(1) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_ne!(front.flags(1) & EP_BASELINE_FRONT_INGRESS, 0);
    assert_ne!(front.flags(2) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_eq!(front.flags(2) & EP_BASELINE_FRONT_INGRESS, 0);
    // 60..=200: 4 + 9 edge ports and 2 blocks; 0..=59: 59 + 1 ... counted
    // by the writer, checked against the kernel.
    let words = front.dp.tier_front_len();
    assert!(words > 0);
    // The summary words (one per identity with words) come on top.
    assert_eq!(kernel_words(&front.pins.path).0, words);
    // The fill: one tier (endpoint 2's Baseline ingress) decided on the
    // LPM behind the tier front, every policy direction on its front; the
    // filter's slots in use are the kernel's non-zero ones.
    let fill = front.dp.map_fill();
    let of = |map: &str| fill.iter().find(|m| m.map == map).unwrap().clone();
    assert_eq!(of(maps::TIER_FRONT).fallbacks, Some(1));
    assert_eq!(of(maps::POLICY_FRONT).fallbacks, Some(0));
    assert_eq!(of(maps::TIERS).fallbacks, None);
    let filter = of(maps::TIER_SUMMARY);
    assert_eq!(
        filter.entries,
        kernel_filter(&front.pins.path).iter().filter(|w| **w != 0).count() as u64
    );
    assert_eq!(filter.capacity, 4 * npm_common::sizes::TIER_FRONT_BUCKETS as u64);
    let (g_front, g_lpm) = (front.grid(40000), lpm.grid(40000));
    assert_eq!(g_front, g_lpm);
    // The grid is not trivial: spot checks of each form.
    let at = |ep, src, udp, port| {
        g_front
            .iter()
            .find(|g| (g.0, g.1, g.2, g.3) == (ep, src, udp, port))
            .unwrap()
            .4
    };
    let deny = (VERDICT_DROP, Some(Reason::AdminDeny));
    let accept = (VERDICT_ALLOW, Some(Reason::AdminAccept));
    assert_eq!(at(1, "10.0.0.2", false, 60), deny);
    // Port 64 (a block): the CIDR identity's Accept (rank 3) beats the pod
    // identity's Deny (rank 5).
    assert_eq!(at(1, "10.0.0.2", false, 64), accept);
    assert_eq!(at(1, "10.0.0.2", false, 128), deny);
    assert_eq!(
        at(1, "10.0.0.2", false, 201),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(at(1, "10.0.0.2", false, 443), accept);
    assert_eq!(at(1, "10.0.0.2", true, 53), deny);
    assert_eq!(at(1, "10.0.0.2", false, 9000), deny);
    // POD_C's pass (rank 9) beats any peer's Accept (rank 11): the NP decides.
    assert_eq!(at(1, "10.0.0.3", false, 53), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    // POD_C's Admin pass, then the Baseline of endpoint 2.
    assert_eq!(
        at(2, "10.0.0.3", false, 8000),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );
    assert_eq!(
        at(2, "10.0.0.3", true, 8000),
        (VERDICT_ALLOW, Some(Reason::BaselineAccept))
    );
    assert_eq!(
        at(2, "10.0.0.2", false, 20_000),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );

    // The datapath reads the front: with NPM_TIERS emptied behind the
    // loader's back, the tiers in the front decide as before; endpoint 2's
    // Baseline (on the LPM) no longer decides.
    drop_kernel_tiers(&front.pins.path);
    let g = front.grid(41000);
    let mut changed = 0;
    for (row, want) in g.iter().zip(&g_lpm) {
        if row.0 == 2 && matches!(want.4 .1, Some(Reason::BaselineDeny | Reason::BaselineAccept)) {
            assert_eq!(row.4, (VERDICT_ALLOW, Some(Reason::NotIsolated)), "{row:?}");
            changed += 1;
        } else {
            assert_eq!(row, want);
        }
    }
    assert!(changed > 0);
}

#[test]
fn the_datapath_reads_the_class_filter_on_flagged_endpoints_only() {
    let c = compiled();
    let mut f = fixture("tfc", &c, BenchSwitches::default());
    let before = f.grid(40000);
    assert_ne!(f.flags(1) & EP_TIER_SUMMARY, 0);
    assert_ne!(f.flags(2) & EP_TIER_SUMMARY, 0);
    let at = |g: &[Probe], ep, src, udp, port| {
        g.iter()
            .find(|p| (p.0, p.1, p.2, p.3) == (ep, src, udp, port))
            .unwrap()
            .4
    };
    assert_eq!(
        at(&before, 1, "10.0.0.2", false, 60),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
    // An empty filter names no class: the tiers on the front find no
    // word (a test of the datapath, not a state the loader leaves).
    clear_kernel_filter(&f.pins.path);
    let blind = f.grid(41000);
    assert_eq!(
        at(&blind, 1, "10.0.0.2", false, 60),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(
        at(&blind, 1, "10.0.0.2", false, 443),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_ne!(blind, before);
    // Without EP_TIER_SUMMARY (as a loader that does not keep the filter
    // writes its records) the same tiers are decided on NPM_TIERS, as
    // before, whatever the filter holds.
    clear_endpoint_flag(&f.pins.path, f.a.ifindex, EP_TIER_SUMMARY);
    clear_endpoint_flag(&f.pins.path, f.b.ifindex, EP_TIER_SUMMARY);
    let lpm = f.grid(42000);
    assert_eq!(lpm, before);
    // A restarted loader rebuilds the filter from the adopted words before
    // its first sync, which flags the endpoints again.
    let Fixture { dp, a, b, pins } = f;
    drop(dp);
    let no_fold = BenchSwitches {
        no_fold: true,
        ..BenchSwitches::default()
    };
    let mut dp = EbpfDataplane::open_with(pins.options(), no_fold).unwrap();
    kernel_words(&pins.path);
    dp.sync_full(&c, &ifaces(&[(1, a.ifindex), (2, b.ifindex)])).unwrap();
    let mut f = Fixture { dp, a, b, pins };
    kernel_words(&f.pins.path);
    assert_ne!(f.flags(1) & EP_TIER_SUMMARY, 0);
    assert_eq!(f.grid(43000), before);
}

#[test]
fn a_value_change_follows_diffs_and_what_does_not_fit_stays_on_the_lpm() {
    let c = compiled();
    let mut f = fixture("tfd", &c, BenchSwitches::default());
    let words = f.dp.tier_front_len();
    // Deny 60..=200 of POD_B becomes an Accept: the same keys, new values.
    let mut next = c.clone();
    for ep in [1, 2] {
        tier(&mut next, ep, Tier::Admin, POD_B, Some(Tcp), (60, 200), Accept, 5);
    }
    f.dp.apply(&c.diff(&next), &next, &f.ifs()).unwrap();
    assert_eq!(f.dp.tier_front_len(), words);
    assert_eq!(kernel_words(&f.pins.path).0, words);
    assert_eq!(f.grid(40000), {
        let mut l = fixture(
            "tfe",
            &next,
            BenchSwitches {
                no_tier_front: true,
                ..BenchSwitches::default()
            },
        );
        l.grid(40000)
    });
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41000, false, 60),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );
    // A compiler rank beyond the word's 14 bits is renumbered: endpoint
    // 1's Admin tier stays on the front and decides by it.
    let mut big = next.clone();
    tier(
        &mut big,
        1,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (443, 443),
        Deny,
        TIER_FRONT_MAX_RANK + 5,
    );
    f.dp.apply(&next.diff(&big), &big, &f.ifs()).unwrap();
    assert_ne!(f.flags(1) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_eq!(f.dp.tier_front_len(), words);
    f.dp.bump_generation().unwrap();
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41001, false, 443),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
    // A range too long for the front: endpoint 1's Admin tier leaves the
    // front (the words of the range it replaces go: 60..=200 had 15) and
    // still decides, on the LPM.
    let mut long = big.clone();
    long.tiers.remove(&TierEntry {
        subject: big.endpoints[&1].identity,
        direction: IN,
        tier: Tier::Admin,
        peer: POD_B,
        protocol: Some(Tcp),
        ports: (60, 200),
    });
    tier(&mut long, 1, Tier::Admin, POD_B, Some(Tcp), (1000, 30_000), Deny, 5);
    f.dp.apply(&big.diff(&long), &long, &f.ifs()).unwrap();
    assert_eq!(f.flags(1) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_ne!(f.flags(2) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_eq!(f.dp.tier_front_len(), words - 15);
    f.dp.bump_generation().unwrap();
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41002, false, 1000),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41002, false, 443),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41002, false, 60),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(
        f.run_from(2, "10.0.0.2", 41002, false, 443),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );
    let big = long;
    // Removing every tier entry empties the front.
    let none = base();
    f.dp.apply(&big.diff(&none), &none, &f.ifs()).unwrap();
    assert_eq!(f.dp.tier_front_len(), 0);
    assert_eq!(kernel_words(&f.pins.path), (0, 0));
    f.dp.bump_generation().unwrap();
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41003, false, 60),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
}

#[test]
fn a_full_bucket_keeps_the_tier_on_the_lpm_until_it_frees() {
    // Endpoint 2's Admin tier: one Deny of POD_B TCP 80, whose bucket is
    // filled behind the loader's back before the entry is written.
    let c = base();
    let mut f = fixture("tfb", &c, BenchSwitches::default());
    let key = tier_front_key(
        c.endpoints[&2].identity,
        DIR_INGRESS,
        TIER_ADMIN,
        POD_B,
        tier_front_pc_exact(1, 80),
    );
    let (bucket, tag) = tier_front_slot(key, npm_common::TIER_FRONT_SHIFT);
    let data = MapData::from_pin(f.pins.path.join(maps::TIER_FRONT)).unwrap();
    let mut front: Array<MapData, [u64; 4]> = Array::try_from(Map::from_map_data(data).unwrap()).unwrap();
    // Four other keys (other tags), action accept.
    let junk = [1u64, 2, 3, 4].map(|i| (tag ^ i) | 1 << 48);
    front.set(bucket, junk, 0).unwrap();
    let mut next = c.clone();
    tier(&mut next, 2, Tier::Admin, POD_B, Some(Tcp), (80, 80), Deny, 0);
    f.dp.apply(&c.diff(&next), &next, &f.ifs()).unwrap();
    assert_eq!(f.flags(2) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_eq!(f.run(2, "10.0.0.2", false, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    // The bucket frees; a full sync places the word and the tier moves to
    // the front.
    front.set(bucket, [0; 4], 0).unwrap();
    f.dp.sync_full(&next, &f.ifs()).unwrap();
    assert_ne!(f.flags(2) & EP_ADMIN_FRONT_INGRESS, 0);
    // The word and its identity's summary words (per-tier and shared).
    assert_eq!(kernel_words(&f.pins.path), (1, 2));
    f.dp.bump_generation().unwrap();
    assert_eq!(f.run(2, "10.0.0.2", false, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(
        f.run_from(2, "10.0.0.2", 41001, false, 81),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
}

/// The compiler's rank of rule `index` of the CNP at `position` (by name)
/// among those of priority `priority` (`npm_policy::tiers::compile`).
fn compiler_rank(priority: u32, position: u32, index: u32) -> u32 {
    priority << 20 | position << 5 | index
}

/// Admin CNPs A (priority `a`: deny POD_B TCP 80), B (`b`: accept every
/// peer TCP 80..=81) and C (`c`: pass POD_C, deny every peer TCP 8080),
/// and a Baseline (priority 20: accept POD_B TCP 443; 500: deny all), on
/// both endpoints, with the compiler's ranks.
fn prioritised(a: u32, b: u32, c: u32) -> Compiled {
    let mut x = base();
    for ep in [1, 2] {
        tier(
            &mut x,
            ep,
            Tier::Admin,
            POD_B,
            Some(Tcp),
            (80, 80),
            Deny,
            compiler_rank(a, 0, 0),
        );
        let accept = compiler_rank(b, 0, 0);
        tier(
            &mut x,
            ep,
            Tier::Admin,
            IDENTITY_ANY,
            Some(Tcp),
            (80, 81),
            Accept,
            accept,
        );
        tier(
            &mut x,
            ep,
            Tier::Admin,
            POD_C,
            None,
            (0, 0),
            Pass,
            compiler_rank(c, 0, 0),
        );
        let deny = compiler_rank(c, 0, 1);
        tier(
            &mut x,
            ep,
            Tier::Admin,
            IDENTITY_ANY,
            Some(Tcp),
            (8080, 8080),
            Deny,
            deny,
        );
        let accept = compiler_rank(20, 0, 0);
        tier(&mut x, ep, Tier::Baseline, POD_B, Some(Tcp), (443, 443), Accept, accept);
        let deny = compiler_rank(500, 0, 0);
        tier(&mut x, ep, Tier::Baseline, IDENTITY_ANY, None, (0, 0), Deny, deny);
    }
    x
}

impl Fixture {
    /// Both tiers of both endpoints are decided on the front, and the
    /// pinned front holds exactly the writer's words.
    fn all_on_front(&self, what: &str) {
        for ep in [1, 2] {
            let f = self.flags(ep);
            assert_ne!(
                f & EP_ADMIN_FRONT_INGRESS,
                0,
                "{what}: endpoint {ep} Admin on the front"
            );
            assert_ne!(
                f & EP_BASELINE_FRONT_INGRESS,
                0,
                "{what}: endpoint {ep} Baseline on the front"
            );
        }
        let words = self.dp.tier_front_len();
        assert!(words > 0, "{what}");
        assert_eq!(kernel_words(&self.pins.path).0, words, "{what}");
    }

    /// New flows from POD_B and POD_C to both endpoints, TCP and UDP, on
    /// the ports of [`prioritised`].
    fn probes(&mut self, sport: u16) -> Vec<Probe> {
        self.dp.bump_generation().unwrap();
        let mut out = Vec::new();
        for ep in [1, 2] {
            for src in ["10.0.0.2", "10.0.0.3"] {
                for udp in [false, true] {
                    for port in [53, 80, 81, 82, 443, 1000, 1050, 8080] {
                        out.push((ep, src, udp, port, self.run_from(ep, src, sport, udp, port)));
                    }
                }
            }
        }
        out
    }
}

#[test]
fn real_priorities_are_decided_on_the_front_in_their_order() {
    const ADMIN_DENY: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::AdminDeny));
    const ADMIN_ACCEPT: (i32, Option<Reason>) = (VERDICT_ALLOW, Some(Reason::AdminAccept));
    const NP_DENIED: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::PolicyDenied));
    // Priorities 10, 20, 500: ranks of 2^23 and more. `l` decides on
    // NPM_TIERS only and follows the same diffs.
    let c = prioritised(10, 20, 500);
    let mut f = fixture("tfp", &c, BenchSwitches::default());
    let no_front = BenchSwitches {
        no_tier_front: true,
        ..BenchSwitches::default()
    };
    let mut l = fixture("tfq", &c, no_front);
    let step = |f: &mut Fixture, l: &mut Fixture, c: &Compiled, n: &Compiled| {
        f.dp.apply(&c.diff(n), n, &f.ifs()).unwrap();
        l.dp.apply(&c.diff(n), n, &l.ifs()).unwrap();
    };
    f.all_on_front("priorities 10, 20, 500");
    assert_eq!(f.probes(40000), l.probes(40000));
    assert_eq!(f.run_from(1, "10.0.0.2", 40100, false, 80), ADMIN_DENY, "A before B");
    assert_eq!(
        f.run_from(1, "10.0.0.3", 40100, false, 80),
        ADMIN_ACCEPT,
        "B before C's pass"
    );
    assert_eq!(
        f.run_from(1, "10.0.0.3", 40100, false, 8080),
        NP_DENIED,
        "C's pass first"
    );
    assert_eq!(f.run_from(1, "10.0.0.2", 40100, false, 8080), ADMIN_DENY);
    assert_eq!(
        f.run_from(2, "10.0.0.2", 40100, false, 443),
        (VERDICT_ALLOW, Some(Reason::BaselineAccept))
    );
    assert_eq!(
        f.run_from(2, "10.0.0.3", 40100, false, 443),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );

    // A's priority 10 -> 30: A and B swap.
    let next = prioritised(30, 20, 500);
    step(&mut f, &mut l, &c, &next);
    f.all_on_front("A after B");
    assert_eq!(f.probes(41000), l.probes(41000));
    assert_eq!(f.run_from(1, "10.0.0.2", 41100, false, 80), ADMIN_ACCEPT, "B before A");
    // C's priority 500 -> 5: C moves in front of both.
    let c = next;
    let next = prioritised(30, 20, 5);
    step(&mut f, &mut l, &c, &next);
    f.all_on_front("C first");
    assert_eq!(f.probes(42000), l.probes(42000));
    assert_eq!(
        f.run_from(1, "10.0.0.3", 42100, false, 80),
        NP_DENIED,
        "C's pass before B"
    );
    assert_eq!(f.run_from(1, "10.0.0.2", 42100, false, 80), ADMIN_ACCEPT);

    // An accept of every peer's UDP 1000..=1100 at priority 25, then CNPs
    // inserted one by one between B (20) and it, each after the last:
    // priority 20, positions 1, 2, ... by name, each denying POD_B UDP
    // 1000 + i. The gap between B's and the accept's front ranks runs out
    // (after about 10) and the group is renumbered; every step decides in
    // the compiler's order.
    let mut c = next;
    let mut n = c.clone();
    for ep in [1, 2] {
        let accept = compiler_rank(25, 0, 0);
        tier(
            &mut n,
            ep,
            Tier::Admin,
            IDENTITY_ANY,
            Some(Udp),
            (1000, 1100),
            Accept,
            accept,
        );
    }
    step(&mut f, &mut l, &c, &n);
    c = n;
    for i in 1..=14u16 {
        let mut n = c.clone();
        for ep in [1, 2] {
            let port = 1000 + i;
            let rank = compiler_rank(20, u32::from(i), 0);
            tier(&mut n, ep, Tier::Admin, POD_B, Some(Udp), (port, port), Deny, rank);
        }
        step(&mut f, &mut l, &c, &n);
        c = n;
        f.all_on_front(&format!("{i} CNPs inserted"));
        f.dp.bump_generation().unwrap();
        for ep in [1, 2] {
            for j in [1, i] {
                let got = f.run_from(ep, "10.0.0.2", 43000 + i, true, 1000 + j);
                assert_eq!(got, ADMIN_DENY, "{i} inserted: POD_B UDP {}", 1000 + j);
            }
            let got = f.run_from(ep, "10.0.0.2", 43000 + i, true, 1050);
            assert_eq!(got, ADMIN_ACCEPT, "{i} inserted: POD_B UDP 1050");
            let got = f.run_from(ep, "10.0.0.2", 43000 + i, false, 80);
            assert_eq!(got, ADMIN_ACCEPT, "{i} inserted: B before A");
        }
    }
    assert_eq!(f.probes(44000), l.probes(44000));
    // The front decides: with NPM_TIERS emptied behind the loader's back,
    // every verdict stays.
    let before = f.probes(45000);
    drop_kernel_tiers(&f.pins.path);
    assert_eq!(f.probes(46000), before);
}
