//! The folded decisions (`NPM_FOLD`), through `BPF_PROG_TEST_RUN` on the
//! real programs: a dataplane that reads them decides every probe (each
//! source, TCP and UDP, ports at and around every edge) as one that takes
//! the tiers' and NetworkPolicy's lookups; the datapath really reads them
//! (an entry changed behind the loader's back changes that verdict) and
//! falls back to the lookups for a class without entries (all entries
//! removed behind its back: nothing changes); a key read with its slot's
//! previous value (another key's, or a cleared word: what arm64 may read
//! while user space stores the entry) is not taken; the entries and the
//! `EP_FOLD_*` flags follow diffs (a tier rule's action, a NetworkPolicy
//! allow, a new peer pod, the tiers removed) and a restarted loader's full
//! sync. The random rule sets of `ebpf_differential.rs` compare it with
//! the reference lookup too. Needs root.

use crate::ebpf_common::tier_in as tier;
use crate::ebpf_common::*;
use aya::maps::{Array, Map, MapData};
use npm_common::{
    cidr_code, fold_bucket, fold_key, fold_pc_exact, fold_value, maps, Reason, EP_FOLD_EGRESS, EP_FOLD_INGRESS,
    FOLD_BUCKET_WORDS, FOLD_SHIFT, IDENTITY_ANY,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN, IpEntry, Tier, TierAction::*};
use npm_policy::model::Protocol::{Tcp, Udp};

const POD_B: u32 = TIER_POD_B;
const POD_C: u32 = TIER_POD_C;
const BLOCK: u32 = TIER_BLOCK;

/// Both endpoints' tiers with every entry form ([`tier_entry_forms`], an
/// any-peer range and an any-protocol Baseline accept), endpoint 1
/// isolated for ingress by a NetworkPolicy allowing POD_B on TCP 80 (which
/// its Admin deny of 60..=200 overrides) and 8000..=8100.
fn compiled() -> Compiled {
    let mut c = tier_fixture(false);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (8000, 8100), 3);
    for ep in [1, 2] {
        tier_entry_forms(&mut c, ep);
        tier(&mut c, ep, Tier::Admin, IDENTITY_ANY, Some(Tcp), (0, 59), Accept, 11);
        tier(&mut c, ep, Tier::Baseline, IDENTITY_ANY, None, (0, 0), Accept, 8);
    }
    c
}

/// Ports at and around every edge of the entries.
const PORTS: [u16; 17] = [
    0, 53, 59, 60, 63, 64, 80, 127, 128, 200, 201, 443, 8000, 8100, 8101, 9000, 40_001,
];
/// The sources: POD_B (with its CIDR identity), POD_C, an unknown address,
/// and (once added) a new pod.
const SOURCES: [&str; 4] = ["10.0.0.2", "10.0.0.3", "10.0.0.9", "10.0.0.7"];

/// The dataplane that never reads the folded decisions.
fn lookups() -> BenchSwitches {
    BenchSwitches {
        no_fold: true,
        ..BenchSwitches::default()
    }
}

/// The fold's view of a [`TierDp`].
trait Folds {
    /// Every probe of [`SOURCES`] and [`PORTS`] from source port `sport`.
    fn grid(&mut self, sport: u16) -> Vec<TierProbe>;
    /// The `EP_FOLD_*` flags of endpoint `id`'s record.
    fn fold_flags(&self, id: u32) -> u32;
    /// The pinned `NPM_FOLD`.
    fn words(&self) -> Array<MapData, [u64; FOLD_BUCKET_WORDS]>;
    /// The entries in the pinned map (non-zero keys).
    fn kernel_entries(&self) -> usize;
}

impl Folds for TierDp {
    fn grid(&mut self, sport: u16) -> Vec<TierProbe> {
        self.probe_grid(&SOURCES, &PORTS, sport)
    }

    fn fold_flags(&self, id: u32) -> u32 {
        self.flags(id) & (EP_FOLD_INGRESS | EP_FOLD_EGRESS)
    }

    fn words(&self) -> Array<MapData, [u64; FOLD_BUCKET_WORDS]> {
        let data = MapData::from_pin(self.pins.path.join(maps::FOLD)).expect("open pinned NPM_FOLD");
        Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_FOLD")
    }

    fn kernel_entries(&self) -> usize {
        self.words()
            .iter()
            .map(|b| b.expect("bucket").chunks(2).filter(|e| e[0] != 0).count())
            .sum()
    }
}

fn assert_same(got: &[TierProbe], want: &[TierProbe], what: &str) {
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(want) {
        assert_eq!(g, w, "{what}: folded vs lookups");
    }
}

#[test]
fn the_fold_decides_as_the_lookups_and_the_datapath_reads_it() {
    sweep_leftovers();
    let c = compiled();
    let mut fold = TierDp::new("fda", &c, BenchSwitches::default());
    let mut look = TierDp::new("fdb", &c, lookups());
    // Both endpoints' ingress is folded; egress has no tier entry.
    assert_eq!(fold.fold_flags(1), EP_FOLD_INGRESS);
    assert_eq!(fold.fold_flags(2), EP_FOLD_INGRESS);
    assert_eq!(
        look.fold_flags(1),
        EP_FOLD_INGRESS,
        "the flags do not depend on the switch"
    );
    let entries = fold.dp.fold_len();
    assert!(entries > 0);
    assert_eq!(fold.kernel_entries(), entries, "the loader's count is the kernel's");
    let fill = fold.dp.map_fill();
    let of = fill.iter().find(|m| m.map == maps::FOLD).expect("NPM_FOLD's fill");
    assert_eq!((of.entries, of.fallbacks), (entries as u64, Some(0)));
    let want = look.grid(40_000);
    assert_same(&fold.grid(40_000), &want, "synced");
    // Not trivial: every tier reason and both NetworkPolicy reasons occur.
    for r in [
        Reason::AdminAccept,
        Reason::AdminDeny,
        Reason::BaselineAccept,
        Reason::BaselineDeny,
        Reason::Policy,
        Reason::PolicyDenied,
    ] {
        assert!(want.iter().any(|p| p.4 .1 == Some(r)), "{r:?} never decides");
    }

    // The datapath reads the entries: POD_B's TCP 443 accept (an exact
    // port of its class, CIDR identity BLOCK) turned into a deny behind the
    // loader's back is what decides.
    let code = cidr_code(BLOCK).unwrap();
    let key = fold_key(256, 0, POD_B, fold_pc_exact(1, 443)).unwrap();
    let bucket = fold_bucket(key, code, FOLD_SHIFT);
    let mut words = fold.words();
    let mut b = words.get(&bucket, 0).unwrap();
    let way = (0..4)
        .find(|i| b[2 * i] == key && b[2 * i + 1] >> 56 == code)
        .expect("the entry");
    assert_eq!(b[2 * way + 1] as u8, Reason::AdminAccept as u8);
    b[2 * way + 1] = fold_value(key, code, Reason::AdminDeny as u32);
    words.set(bucket, b, 0).unwrap();
    assert_eq!(
        fold.probe(1, "10.0.0.2", 41_000, false, 443),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
    assert_eq!(
        look.probe(1, "10.0.0.2", 41_000, false, 443),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );

    // Without entries, every class falls back to the lookups: the same
    // decisions.
    for i in 0..npm_common::sizes::FOLD_BUCKETS {
        words.set(i, [0u64; FOLD_BUCKET_WORDS], 0).unwrap();
    }
    assert_eq!(fold.kernel_entries(), 0);
    assert_same(&fold.grid(42_000), &want, "no entries");
    // The next full sync folds again.
    let ifs = fold.ifs();
    fold.dp.sync_full(&c, &ifs).unwrap();
    assert_eq!(fold.kernel_entries(), entries);
    assert_eq!(fold.fold_flags(1), EP_FOLD_INGRESS);
    assert_same(&fold.grid(43_000), &want, "synced again");
}

/// The (subject, direction, identity) fields of a key word.
fn key_class(k: u64) -> (u64, u64, u64) {
    (k >> 43 & 0x7_ffff, k >> 42 & 1, k >> 18 & 0xff_ffff)
}

/// Writes `key` with value word `value` into a free way of its bucket of
/// CIDR code `code`, behind the loader's back.
fn write_entry(words: &mut Array<MapData, [u64; FOLD_BUCKET_WORDS]>, key: u64, code: u64, value: u64) {
    let bucket = fold_bucket(key, code, FOLD_SHIFT);
    let mut b = words.get(&bucket, 0).unwrap();
    let way = (0..4).find(|w| b[2 * w] == 0).expect("a free way");
    b[2 * way + 1] = value;
    b[2 * way] = key;
    words.set(bucket, b, 0).unwrap();
}

#[test]
fn a_key_read_with_its_slots_previous_value_is_not_taken() {
    sweep_leftovers();
    let c = compiled();
    let fold = TierDp::new("fdh", &c, BenchSwitches::default());
    let look = TierDp::new("fdi", &c, lookups());
    // Endpoint 1's ingress classes of POD_B (CIDR identity BLOCK) and
    // POD_C (none: code 0) lose their entries behind the loader's back:
    // the lookups decide them, as while a new class is being stored.
    let mut words = fold.words();
    let buckets: Vec<(u32, [u64; FOLD_BUCKET_WORDS])> = words
        .iter()
        .enumerate()
        .map(|(i, b)| (i as u32, b.expect("bucket")))
        .collect();
    let mut removed = 0;
    for (i, mut b) in buckets {
        let mut changed = false;
        for w in 0..4 {
            let (subject, dir, id) = key_class(b[2 * w]);
            if b[2 * w] != 0 && subject == 256 && dir == 0 && (id == u64::from(POD_B) || id == u64::from(POD_C)) {
                b[2 * w] = 0;
                changed = true;
                removed += 1;
            }
        }
        if changed {
            words.set(i, b, 0).unwrap();
        }
    }
    assert!(removed >= 4, "{removed}");
    let want_b = look.probe(1, "10.0.0.2", 41_000, false, 443);
    assert_eq!(want_b, (VERDICT_ALLOW, Some(Reason::AdminAccept)));
    assert_eq!(fold.probe(1, "10.0.0.2", 41_000, false, 443), want_b, "class absent");

    // The first entry of POD_B's class, its exact TCP 443 key, is written
    // in a way whose value word holds the previous occupant's value:
    // another class's entry of the same CIDR code and bucket line, a deny.
    // A datapath that pairs them denies; the key is not taken, so the
    // class is still absent.
    let code = cidr_code(BLOCK).unwrap();
    let key = fold_key(256, 0, POD_B, fold_pc_exact(1, 443)).unwrap();
    let other = fold_key(256, 0, 999, fold_pc_exact(1, 443)).unwrap();
    write_entry(&mut words, key, code, fold_value(other, code, Reason::AdminDeny as u32));
    assert_eq!(
        fold.probe(1, "10.0.0.2", 41_100, false, 443),
        want_b,
        "a key taken with another key's value"
    );
    // POD_C's (code 0) exact TCP 443 key with a cleared value word.
    let key_c = fold_key(256, 0, POD_C, fold_pc_exact(1, 443)).unwrap();
    write_entry(&mut words, key_c, 0, 0);
    let want_c = look.probe(1, "10.0.0.3", 41_200, false, 443);
    assert_eq!(
        fold.probe(1, "10.0.0.3", 41_200, false, 443),
        want_c,
        "a key taken with a cleared value"
    );

    // With its own value the entry decides (the datapath read it).
    let bucket = fold_bucket(key, code, FOLD_SHIFT);
    let mut b = words.get(&bucket, 0).unwrap();
    let way = (0..4).find(|w| b[2 * w] == key).expect("the entry");
    b[2 * way + 1] = fold_value(key, code, Reason::AdminDeny as u32);
    words.set(bucket, b, 0).unwrap();
    assert_eq!(
        fold.probe(1, "10.0.0.2", 41_300, false, 443),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
}

/// Applies `prev` -> `next` to both dataplanes and checks they decide
/// alike; returns the grid.
fn step(
    prev: &mut Compiled,
    name: &str,
    next: Compiled,
    fold: &mut TierDp,
    look: &mut TierDp,
    sport: u16,
) -> Vec<TierProbe> {
    fold.apply(prev, &next);
    look.apply(prev, &next);
    let want = look.grid(sport);
    assert_same(&fold.grid(sport), &want, name);
    *prev = next;
    want
}

#[test]
fn the_fold_follows_diffs_and_a_restarted_loader() {
    sweep_leftovers();
    let c = compiled();
    let mut fold = TierDp::new("fdc", &c, BenchSwitches::default());
    let mut look = TierDp::new("fdd", &c, lookups());
    let mut prev = c.clone();

    // A tier rule's action: POD_B's TCP 443 accept becomes a deny.
    let mut next = prev.clone();
    for ep in [1, 2] {
        tier(&mut next, ep, Tier::Admin, POD_B, Some(Tcp), (443, 443), Deny, 2);
    }
    let g = step(&mut prev, "tier action", next, &mut fold, &mut look, 40_000);
    assert!(g.contains(&(1, "10.0.0.2", false, 443, (VERDICT_DROP, Some(Reason::AdminDeny)))));
    assert_eq!(fold.fold_flags(1), EP_FOLD_INGRESS);

    // A NetworkPolicy allow of endpoint 1 (POD_C passes there).
    let mut next = prev.clone();
    allow(&mut next, 1, IN, POD_C, Some(Udp), (53, 53), 2);
    let g = step(&mut prev, "policy allow", next, &mut fold, &mut look, 40_100);
    assert!(g.contains(&(1, "10.0.0.3", true, 53, (VERDICT_ALLOW, Some(Reason::Policy)))));

    // A new pod (a new class) and a rule naming it.
    let entries = fold.dp.fold_len();
    let mut next = prev.clone();
    next.ipcache.insert(
        "10.0.0.7".parse().unwrap(),
        IpEntry {
            identity: 302,
            cidr_identity: 0,
            owner: 0,
        },
    );
    tier(&mut next, 2, Tier::Admin, 302, Some(Tcp), (8000, 8000), Deny, 6);
    let g = step(&mut prev, "new pod", next, &mut fold, &mut look, 40_200);
    assert!(g.contains(&(2, "10.0.0.7", false, 8000, (VERDICT_DROP, Some(Reason::AdminDeny)))));
    assert!(fold.dp.fold_len() > entries, "the new class is folded");
    assert_eq!(fold.kernel_entries(), fold.dp.fold_len());

    // The pod goes again: its class's entries go with it.
    let mut next = prev.clone();
    next.ipcache.remove(&"10.0.0.7".parse().unwrap());
    step(&mut prev, "pod gone", next, &mut fold, &mut look, 40_300);
    assert_eq!(fold.kernel_entries(), fold.dp.fold_len());

    // A restarted loader: adopts the pins, decides as before until its
    // full sync, which folds anew.
    let ifs = fold.ifs();
    let TierDp { dp, a, b, pins } = fold;
    drop(dp);
    let dp =
        EbpfDataplane::open_with(pins.options(), BenchSwitches::default()).unwrap_or_else(|e| panic!("reopen: {e}"));
    let mut fold = TierDp { dp, a, b, pins };
    let want = look.grid(40_400);
    assert_same(&fold.grid(40_400), &want, "adopted, before the sync");
    fold.dp.sync_full(&prev, &ifs).unwrap();
    assert_same(&fold.grid(40_500), &want, "adopted, after the sync");
    assert_eq!(fold.kernel_entries(), fold.dp.fold_len());
    assert_eq!(fold.fold_flags(2), EP_FOLD_INGRESS);

    // No tier entry left: nothing folded, no flag.
    let mut next = prev.clone();
    next.tiers.clear();
    for ep in next.endpoints.values_mut() {
        ep.tiers = Default::default();
    }
    step(&mut prev, "tiers removed", next, &mut fold, &mut look, 40_600);
    assert_eq!((fold.dp.fold_len(), fold.kernel_entries()), (0, 0));
    assert_eq!((fold.fold_flags(1), fold.fold_flags(2)), (0, 0));
}

#[test]
fn a_direction_that_does_not_fit_keeps_its_lookups() {
    sweep_leftovers();
    // Endpoint 1: 900 exact ports denied to any peer (every class gets an
    // entry per port) and 250 peer pods: more entries than three quarters
    // of the map. Endpoint 2: one rule, folded.
    let mut c = tier_fixture(false);
    for i in 0..900u16 {
        tier(
            &mut c,
            1,
            Tier::Admin,
            IDENTITY_ANY,
            Some(Tcp),
            (1000 + 2 * i, 1000 + 2 * i),
            Deny,
            10 + u32::from(i),
        );
    }
    for i in 0..250u32 {
        c.ipcache.insert(
            format!("10.0.{}.{}", 10 + i / 200, 10 + i % 200).parse().unwrap(),
            IpEntry {
                identity: 400 + i,
                cidr_identity: 0,
                owner: 0,
            },
        );
    }
    tier(&mut c, 2, Tier::Admin, POD_B, Some(Tcp), (80, 80), Deny, 1);
    let mut fold = TierDp::new("fdf", &c, BenchSwitches::default());
    let mut look = TierDp::new("fdg", &c, lookups());
    assert_eq!(fold.fold_flags(1), 0, "too large to fold");
    assert_eq!(fold.fold_flags(2), EP_FOLD_INGRESS);
    let entries = fold.dp.fold_len();
    assert!(entries > 0 && entries < 10_000, "only endpoint 2's entries: {entries}");
    assert_eq!(fold.kernel_entries(), entries);
    // The metric counts the direction left to the lookups.
    let fill = fold.dp.map_fill();
    let of = fill.iter().find(|m| m.map == maps::FOLD).expect("NPM_FOLD's fill");
    assert_eq!(of.fallbacks, Some(1));
    assert_same(&fold.grid(40_000), &look.grid(40_000), "partly folded");
    for port in [1000, 1001, 2798] {
        assert_eq!(
            fold.probe(1, "10.0.10.10", 41_000, false, port),
            look.probe(1, "10.0.10.10", 41_000, false, port)
        );
    }
    assert_eq!(
        fold.probe(1, "10.0.10.10", 41_000, false, 1000),
        (VERDICT_DROP, Some(Reason::AdminDeny))
    );
}
