//! The tier front (`NPM_TIER_FRONT`), through `BPF_PROG_TEST_RUN` on the
//! real programs: it decides exactly as the `NPM_TIERS` LPM does (every
//! entry form: exact ports, a range of edge ports and 64-port blocks, any
//! port, any protocol, CIDR and any peers, ranks across identities), the
//! datapath really reads it for a tier complete there (the LPM emptied
//! behind the loader's back changes nothing), a value change is one store
//! and follows diffs, and a tier that does not fit (a long range, a rank
//! beyond the word, a full bucket) stays on the LPM and correct. Needs root.

use crate::ebpf_common::*;
use aya::maps::{Array, Map, MapData};
use npm_common::{
    maps, tier_front_key, tier_front_pc_exact, tier_front_slot, Reason, DIR_INGRESS, EP_ADMIN_FRONT_INGRESS,
    EP_BASELINE_FRONT_INGRESS, IDENTITY_ANY, IDENTITY_FIRST_CIDR, TIER_ADMIN, TIER_FRONT_MAX_RANK,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN, Tier, TierAction, TierAction::*, TierEntry, TierValue};
use npm_policy::model::Protocol::{self, Tcp, Udp};

const POD_B: u32 = 300;
const POD_C: u32 = 301;
const BLOCK: u32 = IDENTITY_FIRST_CIDR + 1;

fn base() -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, true));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.5"), None, false, false));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.5", 257, 0);
    ip(&mut c, "10.0.0.2", POD_B, BLOCK);
    ip(&mut c, "10.0.0.3", POD_C, 0);
    c.cidrs.insert("10.0.0.2/32".parse().unwrap(), BLOCK);
    // Endpoint 1's NetworkPolicy allows POD_B on TCP 80.
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    c
}

#[allow(clippy::too_many_arguments)]
fn tier(
    c: &mut Compiled,
    ep: u32,
    tier: Tier,
    peer: u32,
    protocol: Option<Protocol>,
    ports: (u16, u16),
    action: TierAction,
    rank: u32,
) {
    c.tiers.insert(
        TierEntry {
            endpoint: ep,
            direction: IN,
            tier,
            peer,
            protocol,
            ports,
        },
        TierValue {
            action,
            rank,
            rule: 100 + rank,
        },
    );
    c.endpoints.get_mut(&ep).unwrap().tiers.set(tier, IN);
}

/// Every entry form in both tiers of both endpoints; endpoint 2's Baseline
/// tier also has a 20,000-port range, which keeps that tier on the LPM.
fn compiled() -> Compiled {
    let mut c = base();
    for ep in [1, 2] {
        tier(&mut c, ep, Tier::Admin, POD_B, Some(Tcp), (60, 200), Deny, 5);
        tier(&mut c, ep, Tier::Admin, POD_B, Some(Tcp), (443, 443), Accept, 2);
        tier(&mut c, ep, Tier::Admin, POD_B, Some(Udp), (0, u16::MAX), Deny, 7);
        tier(&mut c, ep, Tier::Admin, BLOCK, Some(Tcp), (64, 127), Accept, 3);
        tier(&mut c, ep, Tier::Admin, POD_C, None, (0, 0), Pass, 9);
        tier(&mut c, ep, Tier::Admin, IDENTITY_ANY, Some(Tcp), (9000, 9000), Deny, 1);
        tier(&mut c, ep, Tier::Admin, IDENTITY_ANY, Some(Tcp), (0, 59), Accept, 11);
        tier(&mut c, ep, Tier::Baseline, POD_C, Some(Tcp), (8000, 8100), Deny, 4);
        tier(&mut c, ep, Tier::Baseline, IDENTITY_ANY, None, (0, 0), Accept, 8);
    }
    tier(&mut c, 2, Tier::Baseline, POD_B, Some(Tcp), (20_000, 40_000), Deny, 6);
    c
}

/// One probe of [`Fixture::grid`]: (endpoint, source, UDP, port, (verdict,
/// reason)).
type Probe = (u32, &'static str, bool, u16, (i32, Option<Reason>));

struct Fixture {
    dp: EbpfDataplane,
    a: Dummy,
    b: Dummy,
    pins: PinDir,
}

fn fixture(tag: &str, c: &Compiled, switches: BenchSwitches) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let a = Dummy::new(&format!("{tag}a"));
    let b = Dummy::new(&format!("{tag}b"));
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    dp.sync_full(c, &ifaces(&[(1, a.ifindex), (2, b.ifindex)])).unwrap();
    Fixture { dp, a, b, pins }
}

/// The probes: every source, both endpoints, TCP and UDP ports at and
/// around every edge of the entries.
const PORTS: [u16; 16] = [
    0, 53, 59, 60, 63, 64, 127, 128, 200, 201, 443, 8000, 8100, 9000, 20_000, 40_001,
];

impl Fixture {
    fn ifs(&self) -> std::collections::BTreeMap<u32, u32> {
        ifaces(&[(1, self.a.ifindex), (2, self.b.ifindex)])
    }

    fn run(&self, ep: u32, src: &str, udp: bool, port: u16) -> (i32, Option<Reason>) {
        self.run_from(ep, src, 40000, udp, port)
    }

    /// [`Fixture::run`] from source port `sport` (a new flow, not one
    /// tracked by an earlier probe).
    fn run_from(&self, ep: u32, src: &str, sport: u16, udp: bool, port: u16) -> (i32, Option<Reason>) {
        let (ifindex, dst) = if ep == 1 {
            (self.a.ifindex, "10.0.0.1")
        } else {
            (self.b.ifindex, "10.0.0.5")
        };
        let l4 = if udp {
            L4::Udp(sport, port)
        } else {
            L4::Tcp(sport, port, 0x02)
        };
        self.dp.test_run(IN, ifindex, &v4(src, dst, l4)).unwrap()
    }

    /// Every probe's (verdict, reason).
    fn grid(&mut self, sport: u16) -> Vec<Probe> {
        // Nothing cached from before.
        self.dp.bump_generation().unwrap();
        let mut out = Vec::new();
        for ep in [1, 2] {
            for src in ["10.0.0.2", "10.0.0.3"] {
                for udp in [false, true] {
                    for port in PORTS {
                        out.push((ep, src, udp, port, self.run_from(ep, src, sport, udp, port)));
                    }
                }
            }
        }
        out
    }

    fn flags(&self, id: u32) -> u32 {
        self.dp
            .dump()
            .unwrap()
            .endpoints
            .iter()
            .find(|e| e.id == id)
            .unwrap()
            .flags
    }
}

/// The non-zero words of the pinned `NPM_TIER_FRONT`.
fn kernel_words(pin_dir: &std::path::Path) -> usize {
    let data = MapData::from_pin(pin_dir.join(maps::TIER_FRONT)).expect("open pinned NPM_TIER_FRONT");
    let front: Array<MapData, [u64; 4]> =
        Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIER_FRONT");
    front
        .iter()
        .map(|b| b.expect("bucket").iter().filter(|w| **w != 0).count())
        .sum()
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
    assert_eq!(kernel_words(&front.pins.path), words);
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
    assert_eq!(kernel_words(&f.pins.path), words);
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
    // A rank beyond the word: endpoint 1's Admin tier leaves the front (its
    // stale words go) and still decides, on the LPM.
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
    assert_eq!(f.flags(1) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_ne!(f.flags(2) & EP_ADMIN_FRONT_INGRESS, 0);
    assert_eq!(f.dp.tier_front_len(), words - 1);
    f.dp.bump_generation().unwrap();
    // Rank 2^14 + 5 loses to the CIDR identity's ... nothing on 443: a deny.
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41001, false, 443),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
    assert_eq!(
        f.run_from(2, "10.0.0.2", 41001, false, 443),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );
    // Removing every tier entry empties the front.
    let none = base();
    f.dp.apply(&big.diff(&none), &none, &f.ifs()).unwrap();
    assert_eq!(f.dp.tier_front_len(), 0);
    assert_eq!(kernel_words(&f.pins.path), 0);
    f.dp.bump_generation().unwrap();
    assert_eq!(
        f.run_from(1, "10.0.0.2", 41002, false, 60),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
}

#[test]
fn a_full_bucket_keeps_the_tier_on_the_lpm_until_it_frees() {
    // Endpoint 2's Admin tier: one Deny of POD_B TCP 80, whose bucket is
    // filled behind the loader's back before the entry is written.
    let c = base();
    let mut f = fixture("tfb", &c, BenchSwitches::default());
    let key = tier_front_key(2, DIR_INGRESS, TIER_ADMIN, POD_B, tier_front_pc_exact(1, 80));
    let (bucket, tag) = tier_front_slot(key);
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
    assert_eq!(kernel_words(&f.pins.path), 1);
    f.dp.bump_generation().unwrap();
    assert_eq!(f.run(2, "10.0.0.2", false, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(
        f.run_from(2, "10.0.0.2", 41001, false, 81),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
}
