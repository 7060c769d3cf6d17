//! The fronts sized at load time (`MapSizes::policy_front`,
//! `MapSizes::tier_front`), through `BPF_PROG_TEST_RUN` on the real
//! programs: a dataplane whose policy front has 2^10 buckets and whose
//! tier front has 2^18 (the defaults are 2^16) creates the maps with those
//! `max_entries` and loads the program with their bucket shifts; it
//! decides every probe as a dataplane that only reads the LPMs, also with
//! `NPM_POLICY` and `NPM_TIERS` emptied behind the loader's back (so the
//! verdicts can only come from the fronts: a program hashing to other
//! buckets than user space finds no word, and denies or passes). Reopened
//! with the default sizes, the pinned fronts are adopted with their own
//! sizes (reported as pending) and the program hashes to those. A pinned
//! rules array of another size than its front is created anew. Sizes that
//! are not a power of two within the bounds are refused. Needs root.

use crate::ebpf_common::tier_in as tier;
use crate::ebpf_common::*;
use aya::maps::MapData;
use npm_common::{
    maps, sizes, Reason, EP_ADMIN_FRONT_INGRESS, EP_BASELINE_FRONT_INGRESS, EP_FRONT_INGRESS, IDENTITY_ANY,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, EbpfError, MapSizes};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN, Tier, TierAction::*};
use npm_policy::model::Protocol::{Tcp, Udp};

const POD_B: u32 = TIER_POD_B;
const POD_C: u32 = TIER_POD_C;
const BLOCK: u32 = TIER_BLOCK;

/// Policy front 2^10 buckets, tier front 2^18.
fn sized() -> MapSizes {
    MapSizes {
        policy_front: 1 << 10,
        tier_front: 1 << 18,
        ..MapSizes::default()
    }
}

/// Endpoint 1 isolated for ingress, its NetworkPolicy allowing POD_B on
/// TCP 80 and 8000..8040, POD_C on any UDP port and the CIDR of 10.0.0.2
/// on TCP 443; both endpoints with entries of every form in both tiers
/// (all fit the fronts).
fn compiled() -> Compiled {
    let mut c = tier_fixture(false);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (8000, 8040), 2);
    allow(&mut c, 1, IN, POD_C, Some(Udp), (0, u16::MAX), 3);
    allow(&mut c, 1, IN, BLOCK, Some(Tcp), (443, 443), 4);
    for ep in [1, 2] {
        tier_entry_forms(&mut c, ep);
        tier(&mut c, ep, Tier::Baseline, IDENTITY_ANY, Some(Udp), (53, 53), Accept, 8);
    }
    c
}

/// Ports at and around the entries' edges.
const PORTS: [u16; 17] = [
    0, 53, 59, 60, 64, 80, 127, 128, 200, 201, 443, 8000, 8040, 8041, 8100, 8101, 9000,
];

/// One probe: (endpoint, source, UDP, port, (verdict, reason)).
type Probe = (u32, &'static str, bool, u16, (i32, Option<Reason>));

struct Fixture {
    dp: EbpfDataplane,
    a: Dummy,
    b: Dummy,
    pins: PinDir,
}

impl Fixture {
    fn new(tag: &str, sizes: MapSizes, switches: BenchSwitches) -> Fixture {
        let pins = PinDir::new(tag);
        let a = Dummy::new(&format!("{tag}a"));
        let b = Dummy::new(&format!("{tag}b"));
        let dp =
            EbpfDataplane::open_with_sized(pins.options(), sizes, switches).unwrap_or_else(|e| panic!("open: {e}"));
        let mut f = Fixture { dp, a, b, pins };
        f.sync();
        f
    }

    fn sync(&mut self) {
        let ifs = ifaces(&[(1, self.a.ifindex), (2, self.b.ifindex)]);
        self.dp.sync_full(&compiled(), &ifs).unwrap();
    }

    /// Every probe's (verdict, reason), each a new flow, nothing cached.
    fn grid(&mut self, sport: u16) -> Vec<Probe> {
        self.dp.bump_generation().unwrap();
        let mut out = Vec::new();
        for (ep, ifindex, dst) in [(1, self.a.ifindex, "10.0.0.1"), (2, self.b.ifindex, "10.0.0.5")] {
            for src in ["10.0.0.2", "10.0.0.3", "10.0.0.9"] {
                for udp in [false, true] {
                    for port in PORTS {
                        let l4 = if udp {
                            L4::Udp(sport, port)
                        } else {
                            L4::Tcp(sport, port, 0x02)
                        };
                        out.push((
                            ep,
                            src,
                            udp,
                            port,
                            self.dp.test_run(IN, ifindex, &v4(src, dst, l4)).unwrap(),
                        ));
                    }
                }
            }
        }
        out
    }

    fn flags(&self, id: u32) -> u32 {
        let d = self.dp.dump().unwrap();
        d.endpoints.iter().find(|e| e.id == id).unwrap().flags
    }

    /// Both endpoints' policy and tiers are on the fronts.
    fn assert_on_fronts(&self) {
        assert_ne!(self.flags(1) & EP_FRONT_INGRESS, 0, "endpoint 1's policy on the front");
        for ep in [1, 2] {
            let f = self.flags(ep);
            assert_ne!(f & EP_ADMIN_FRONT_INGRESS, 0, "endpoint {ep}'s Admin tier on the front");
            assert_ne!(
                f & EP_BASELINE_FRONT_INGRESS,
                0,
                "endpoint {ep}'s Baseline tier on the front"
            );
        }
        assert!(self.dp.policy_front_len() > 40, "{}", self.dp.policy_front_len());
        assert!(self.dp.tier_front_len() > 20, "{}", self.dp.tier_front_len());
    }

    /// Empties `NPM_POLICY` and `NPM_TIERS` behind the loader's back.
    fn drop_lpms(&self) {
        drop_policy_entries(&self.pins.path);
        drop_tier_entries(&self.pins.path);
    }
}

/// Empties the pinned `NPM_TIERS`, behind the loader's back.
fn drop_tier_entries(pin_dir: &std::path::Path) {
    use aya::maps::lpm_trie::{Key, LpmTrie};
    use aya::maps::Map;
    let data = MapData::from_pin(pin_dir.join(maps::TIERS)).expect("open pinned NPM_TIERS");
    let mut trie: LpmTrie<MapData, [u8; npm_common::POLICY_KEY_LEN], npm_common::TierValue> =
        LpmTrie::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIERS");
    let keys: Vec<Key<[u8; npm_common::POLICY_KEY_LEN]>> = trie.keys().map(|k| k.unwrap()).collect();
    assert!(!keys.is_empty(), "no tier entry to drop");
    for k in keys {
        trie.remove(&k).unwrap();
    }
}

/// The kernel's `max_entries` of a pinned map.
fn pinned_max_entries(pins: &PinDir, name: &str) -> u32 {
    let data = MapData::from_pin(pins.path.join(name)).unwrap_or_else(|e| panic!("pin {name}: {e}"));
    data.info().unwrap().max_entries()
}

/// The probes decided by a tier or a NetworkPolicy allow, by reason.
fn decided(grid: &[Probe]) -> usize {
    grid.iter()
        .filter(|p| {
            matches!(
                p.4 .1,
                Some(
                    Reason::Policy
                        | Reason::AdminAccept
                        | Reason::AdminDeny
                        | Reason::BaselineAccept
                        | Reason::BaselineDeny
                )
            )
        })
        .count()
}

#[test]
fn fronts_of_configured_sizes_decide_as_the_lpms() {
    sweep_leftovers();
    let mut lpm = Fixture::new(
        "fzl",
        MapSizes::default(),
        BenchSwitches {
            no_policy_front: true,
            no_tier_front: true,
            no_fold: true,
            ..BenchSwitches::default()
        },
    );
    let want = lpm.grid(41_000);
    assert!(decided(&want) > 60, "not trivial: {}", decided(&want));

    // The fronts decide, not the folded decisions (`ebpf_fold.rs`).
    let no_fold = BenchSwitches {
        no_fold: true,
        ..BenchSwitches::default()
    };
    let mut f = Fixture::new("fzs", sized(), no_fold);
    // The maps have the configured sizes, in the kernel and as reported.
    assert_eq!(pinned_max_entries(&f.pins, maps::POLICY_FRONT), 1 << 10);
    assert_eq!(pinned_max_entries(&f.pins, maps::POLICY_FRONT_RULES), 1 << 10);
    assert_eq!(pinned_max_entries(&f.pins, maps::TIER_FRONT), 1 << 18);
    // The tier front's class filter: one slot per word of the front.
    assert_eq!(pinned_max_entries(&f.pins, maps::TIER_SUMMARY), 4 << 18);
    assert_eq!(f.dp.map_sizes().actual, sized());
    assert!(f.dp.map_sizes().pending().is_empty());
    let fill = f.dp.map_fill();
    let front = fill.iter().find(|m| m.map == maps::POLICY_FRONT).unwrap();
    assert_eq!(front.capacity, 4 << 10, "the policy front's capacity is its words");
    let tier_front = fill.iter().find(|m| m.map == maps::TIER_FRONT).unwrap();
    assert_eq!(tier_front.capacity, 4 << 18, "the tier front's capacity is its words");
    assert_eq!(tier_front.entries, f.dp.tier_front_len() as u64);
    f.assert_on_fronts();
    assert_eq!(f.grid(41_000), want, "fronts (with the LPMs behind them) vs LPMs");
    // Only the fronts: the verdicts can only come from the words, found in
    // the buckets user space stored them in.
    f.drop_lpms();
    assert_eq!(f.grid(41_001), want, "fronts alone vs LPMs");

    // Reopened with the default sizes: the pinned fronts keep theirs, the
    // difference is reported, and the program hashes to the pinned sizes.
    drop(f.dp);
    f.dp = EbpfDataplane::open_sized(f.pins.options(), MapSizes::default()).unwrap_or_else(|e| panic!("reopen: {e}"));
    assert_eq!(f.dp.map_sizes().actual, sized());
    assert_eq!(
        f.dp.map_sizes().pending(),
        vec![
            (maps::POLICY_FRONT, 1 << 10, sizes::POLICY_FRONT_BUCKETS),
            (maps::TIER_FRONT, 1 << 18, sizes::TIER_FRONT_BUCKETS),
        ]
    );
    assert_eq!(pinned_max_entries(&f.pins, maps::TIER_FRONT), 1 << 18);
    f.sync();
    f.assert_on_fronts();
    f.drop_lpms();
    assert_eq!(f.grid(41_002), want, "adopted fronts alone vs LPMs");

    // The policy front unpinned (its rules array left at 2^10): a new
    // front of the configured 2^16 buckets, and a rules array anew of the
    // same size.
    drop(f.dp);
    std::fs::remove_file(f.pins.path.join(maps::POLICY_FRONT)).unwrap();
    f.dp = EbpfDataplane::open_sized(f.pins.options(), MapSizes::default()).unwrap_or_else(|e| panic!("reopen: {e}"));
    assert_eq!(
        pinned_max_entries(&f.pins, maps::POLICY_FRONT),
        sizes::POLICY_FRONT_BUCKETS
    );
    assert_eq!(
        pinned_max_entries(&f.pins, maps::POLICY_FRONT_RULES),
        sizes::POLICY_FRONT_BUCKETS
    );
    assert_eq!(f.dp.map_sizes().actual.policy_front, sizes::POLICY_FRONT_BUCKETS);
    f.sync();
    f.assert_on_fronts();
    f.drop_lpms();
    assert_eq!(f.grid(41_003), want, "new policy front, adopted tier front vs LPMs");

    // The tier front unpinned, its class filter left at 4 x 2^18: a new
    // front of 2^16 buckets would need a filter of 4 x 2^16 slots; the
    // pinned one (which an attached program still reads) is refused, not
    // replaced, and nothing changes.
    drop(f.dp);
    std::fs::remove_file(f.pins.path.join(maps::TIER_FRONT)).unwrap();
    let err = match EbpfDataplane::open_sized(f.pins.options(), MapSizes::default()) {
        Err(e) => e,
        Ok(_) => panic!("opened beside a class filter of another size"),
    };
    match &err {
        EbpfError::PinnedFrontSize { map, buckets, .. } => assert_eq!((*map, *buckets), (maps::TIER_SUMMARY, 4 << 18)),
        other => panic!("expected a pinned size error, got {other}"),
    }
    assert_eq!(pinned_max_entries(&f.pins, maps::TIER_SUMMARY), 4 << 18);
    // Both gone (as after `npm-agent cleanup`): both anew, of the default.
    std::fs::remove_file(f.pins.path.join(maps::TIER_SUMMARY)).unwrap();
    f.dp = EbpfDataplane::open_sized(f.pins.options(), MapSizes::default()).unwrap_or_else(|e| panic!("reopen: {e}"));
    assert_eq!(
        pinned_max_entries(&f.pins, maps::TIER_SUMMARY),
        sizes::TIER_FRONT_BUCKETS * 4
    );
    f.sync();
    f.assert_on_fronts();
    f.drop_lpms();
    assert_eq!(f.grid(41_004), want, "new tier front and filter vs LPMs");
}

#[test]
fn front_sizes_out_of_bounds_are_refused() {
    sweep_leftovers();
    let pins = PinDir::new("fzb");
    for (sizes, map, buckets) in [
        (
            MapSizes {
                policy_front: 1000,
                ..MapSizes::default()
            },
            maps::POLICY_FRONT,
            1000,
        ),
        (
            MapSizes {
                policy_front: 32,
                ..MapSizes::default()
            },
            maps::POLICY_FRONT,
            32,
        ),
        (
            MapSizes {
                tier_front: 1 << 15,
                ..MapSizes::default()
            },
            maps::TIER_FRONT,
            1 << 15,
        ),
        (
            MapSizes {
                tier_front: 1 << 25,
                ..MapSizes::default()
            },
            maps::TIER_FRONT,
            1 << 25,
        ),
    ] {
        let err = match EbpfDataplane::open_sized(pins.options(), sizes) {
            Err(e) => e,
            Ok(_) => panic!("{map} {buckets}: opened"),
        };
        match &err {
            EbpfError::FrontSize { map: m, buckets: b, .. } => assert_eq!((*m, *b), (map, buckets)),
            other => panic!("{map} {buckets}: expected a front size error, got {other}"),
        }
        let text = err.to_string();
        assert!(text.contains(map) && text.contains("power of two"), "{text}");
    }
    assert!(!pins.path.join(maps::POLICY_FRONT).exists(), "nothing pinned");
}
