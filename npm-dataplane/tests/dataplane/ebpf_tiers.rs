//! The ClusterNetworkPolicy tiers in the datapath (`NPM_TIERS`), through
//! `BPF_PROG_TEST_RUN` on the real programs with a hand-built compiled
//! form: the Admin tier decides before NetworkPolicy (Accept over an NP
//! deny, Deny over an NP allow, Pass leaves it to NP), the Baseline tier
//! only where no NetworkPolicy isolates, the lowest rank across the peer's
//! identities wins, host ingress comes first, and the writer's entries are
//! in the pinned map (full sync and diffs). Needs root.

use crate::ebpf_common::tier_entry as tier;
use crate::ebpf_common::*;
use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{Map, MapData};
use npm_common::{
    maps, Reason, TierValue as KernelTierValue, EP_ADMIN_EGRESS, EP_ADMIN_INGRESS, EP_BASELINE_INGRESS, IDENTITY_ANY,
    IDENTITY_HOST, POLICY_KEY_LEN, TIER_ACCEPT, TIER_DENY,
};
use npm_dataplane::ebpf::{EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction, Direction::Egress as EG, Direction::Ingress as IN, Tier, TierAction};
use npm_policy::model::Protocol::{Tcp, Udp};

const POD_B: u32 = TIER_POD_B;
const POD_C: u32 = TIER_POD_C;
const BLOCK: u32 = TIER_BLOCK;

/// [`tier_fixture`] with endpoint 1 isolated both ways, and the node
/// 10.0.0.9 (IDENTITY_HOST). No tier entry yet.
fn base() -> Compiled {
    let mut c = tier_fixture(true);
    ip(&mut c, "10.0.0.9", IDENTITY_HOST, 0);
    c
}

struct Fixture {
    dp: EbpfDataplane,
    a: Dummy,
    b: Dummy,
    pins: PinDir,
}

fn fixture(tag: &str, c: &Compiled) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let a = Dummy::new(&format!("{tag}a"));
    let b = Dummy::new(&format!("{tag}b"));
    let mut dp = pins.open();
    dp.sync_full(c, &ifaces(&[(1, a.ifindex), (2, b.ifindex)])).unwrap();
    Fixture { dp, a, b, pins }
}

impl Fixture {
    fn ifs(&self) -> std::collections::BTreeMap<u32, u32> {
        ifaces(&[(1, self.a.ifindex), (2, self.b.ifindex)])
    }

    /// A new TCP connection (SYN) from `src` to `dst`:`port` through the
    /// hook of `dir` on `ifindex`; (verdict, reason).
    fn syn(&self, dir: Direction, ifindex: u32, src: &str, dst: &str, sport: u16, port: u16) -> (i32, Option<Reason>) {
        self.dp
            .test_run(dir, ifindex, &v4(src, dst, L4::Tcp(sport, port, 0x02)))
            .unwrap()
    }

    /// Ingress of endpoint 1 from `src`.
    fn to_a(&self, src: &str, sport: u16, port: u16) -> (i32, Option<Reason>) {
        self.syn(IN, self.a.ifindex, src, "10.0.0.1", sport, port)
    }

    /// Ingress of endpoint 2 from `src`.
    fn to_b(&self, src: &str, sport: u16, port: u16) -> (i32, Option<Reason>) {
        self.syn(IN, self.b.ifindex, src, "10.0.0.5", sport, port)
    }

    fn flags(&self, id: u32) -> u32 {
        record_flags(&self.dp, id)
    }

    fn counter(&self, dir: Direction, reason: Reason) -> u64 {
        let c = self.dp.read_counters().unwrap();
        c.packets(dir.as_u8(), reason)
    }
}

/// The pinned `NPM_TIERS` as the kernel holds it: (prefix length, key
/// bytes) -> value.
fn kernel_tiers(pin_dir: &std::path::Path) -> Vec<(u32, [u8; POLICY_KEY_LEN], KernelTierValue)> {
    let data = MapData::from_pin(pin_dir.join(maps::TIERS)).expect("open pinned NPM_TIERS");
    let trie: LpmTrie<MapData, [u8; POLICY_KEY_LEN], KernelTierValue> =
        LpmTrie::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIERS");
    trie.iter()
        .map(|e| {
            let (k, v) = e.expect("entry");
            (k.prefix_len(), k.data(), v)
        })
        .collect()
}

#[test]
fn admin_accept_overrides_a_networkpolicy_deny_and_covers_replies() {
    let mut c = base();
    // NP isolates endpoint 1's ingress and allows only POD_C TCP 22.
    allow(&mut c, 1, IN, POD_C, Some(Tcp), (22, 22), 1);
    tier(
        &mut c,
        1,
        IN,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 80),
        TierAction::Accept,
        0,
        10,
    );
    let f = fixture("ta", &c);
    assert_ne!(f.flags(1) & EP_ADMIN_INGRESS, 0);
    assert_eq!(
        f.to_a("10.0.0.2", 40000, 80),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );
    // Its reply is tracked (the accept created a conntrack entry).
    let reply = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 40000, 0x12));
    assert_eq!(
        f.dp.test_run(EG, f.a.ifindex, &reply).unwrap(),
        (VERDICT_ALLOW, Some(Reason::Tracked))
    );
    // What the Admin rule does not match, NP decides.
    assert_eq!(
        f.to_a("10.0.0.2", 40001, 81),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(f.to_a("10.0.0.3", 40002, 22), (VERDICT_ALLOW, Some(Reason::Policy)));
}

#[test]
fn admin_deny_overrides_a_networkpolicy_allow_silently() {
    let mut c = base();
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    allow(&mut c, 1, IN, POD_C, Some(Tcp), (80, 80), 2);
    tier(&mut c, 1, IN, Tier::Admin, POD_B, None, (0, 0), TierAction::Deny, 0, 10);
    let mut f = fixture("td", &c);
    let _ = f.dp.poll_deny_events();
    let before = f.counter(IN, Reason::AdminDeny);
    assert_eq!(f.to_a("10.0.0.2", 40000, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    // Again: decided anew, same answer.
    assert_eq!(f.to_a("10.0.0.2", 40000, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(f.counter(IN, Reason::AdminDeny), before + 2);
    let events = f.dp.poll_deny_events();
    assert!(
        events
            .iter()
            .any(|e| e.reason == Reason::AdminDeny as u8 && e.endpoint == 1 && e.dport == 80),
        "a deny event with the tier's reason: {events:?}"
    );
    // Another peer is still decided by NP.
    assert_eq!(f.to_a("10.0.0.3", 40000, 80), (VERDICT_ALLOW, Some(Reason::Policy)));
}

#[test]
fn pass_leaves_it_to_networkpolicy_and_baseline_is_not_consulted_when_np_isolates() {
    let mut c = base();
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    tier(&mut c, 1, IN, Tier::Admin, POD_B, None, (0, 0), TierAction::Pass, 0, 10);
    // A lower-ranked Admin Deny of everything: the Pass (rank 0) wins.
    tier(
        &mut c,
        1,
        IN,
        Tier::Admin,
        IDENTITY_ANY,
        None,
        (0, 0),
        TierAction::Deny,
        1,
        11,
    );
    // Baseline would accept everything: never consulted, NP isolates.
    tier(
        &mut c,
        1,
        IN,
        Tier::Baseline,
        IDENTITY_ANY,
        None,
        (0, 0),
        TierAction::Accept,
        0,
        20,
    );
    let f = fixture("tp", &c);
    assert_ne!(f.flags(1) & EP_BASELINE_INGRESS, 0);
    assert_eq!(f.to_a("10.0.0.2", 40000, 80), (VERDICT_ALLOW, Some(Reason::Policy)));
    assert_eq!(
        f.to_a("10.0.0.2", 40001, 81),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    // POD_C matches no Pass: the Admin Deny of any peer.
    assert_eq!(f.to_a("10.0.0.3", 40000, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
}

#[test]
fn baseline_decides_where_no_networkpolicy_isolates() {
    let mut c = base();
    tier(
        &mut c,
        2,
        IN,
        Tier::Baseline,
        POD_C,
        Some(Tcp),
        (80, 80),
        TierAction::Accept,
        0,
        20,
    );
    tier(
        &mut c,
        2,
        IN,
        Tier::Baseline,
        IDENTITY_ANY,
        None,
        (0, 0),
        TierAction::Deny,
        1,
        21,
    );
    tier(
        &mut c,
        2,
        IN,
        Tier::Baseline,
        POD_B,
        Some(Udp),
        (53, 53),
        TierAction::Pass,
        2,
        22,
    );
    let f = fixture("tb", &c);
    let before = f.counter(IN, Reason::BaselineDeny);
    assert_eq!(
        f.to_b("10.0.0.2", 40000, 80),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );
    assert_eq!(f.counter(IN, Reason::BaselineDeny), before + 1);
    assert_eq!(
        f.to_b("10.0.0.3", 40000, 80),
        (VERDICT_ALLOW, Some(Reason::BaselineAccept))
    );
    assert_eq!(
        f.to_b("10.0.0.3", 40000, 81),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );
    // The Pass of rank 2 loses to the Deny of rank 1 (any peer).
    let dns = v4("10.0.0.2", "10.0.0.5", L4::Udp(5353, 53));
    assert_eq!(
        f.dp.test_run(IN, f.b.ifindex, &dns).unwrap(),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );
    // Ingress from the node comes before every tier.
    assert_eq!(f.to_b("10.0.0.9", 40000, 80), (VERDICT_ALLOW, Some(Reason::Host)));
    // Egress has no tier entry: not isolated, no lookup.
    let out = f.syn(EG, f.b.ifindex, "10.0.0.5", "10.0.0.2", 40000, 80);
    assert_eq!(out, (VERDICT_ALLOW, Some(Reason::NotIsolated)));
}

#[test]
fn the_lowest_rank_across_the_peers_identities_decides() {
    let mut c = base();
    allow(&mut c, 1, IN, IDENTITY_ANY, None, (0, 0), 1);
    // 10.0.0.2 carries POD_B and the CIDR identity BLOCK.
    tier(
        &mut c,
        1,
        IN,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 80),
        TierAction::Accept,
        5,
        10,
    );
    tier(&mut c, 1, IN, Tier::Admin, BLOCK, None, (0, 0), TierAction::Deny, 2, 11);
    // Egress: the reverse ranks, and an any-peer entry of middle rank.
    tier(
        &mut c,
        1,
        EG,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 80),
        TierAction::Accept,
        1,
        12,
    );
    tier(&mut c, 1, EG, Tier::Admin, BLOCK, None, (0, 0), TierAction::Deny, 4, 13);
    tier(
        &mut c,
        1,
        EG,
        Tier::Admin,
        IDENTITY_ANY,
        Some(Tcp),
        (0, 1023),
        TierAction::Deny,
        3,
        14,
    );
    allow(&mut c, 1, EG, IDENTITY_ANY, None, (0, 0), 2);
    let mut f = fixture("tr", &c);
    assert_ne!(f.flags(1) & EP_ADMIN_EGRESS, 0);
    assert_eq!(f.to_a("10.0.0.2", 40000, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    // POD_C has no CIDR identity: no entry matches it, NP allows.
    assert_eq!(f.to_a("10.0.0.3", 40000, 80), (VERDICT_ALLOW, Some(Reason::Policy)));
    let out = |f: &Fixture, port| f.syn(EG, f.a.ifindex, "10.0.0.1", "10.0.0.2", 40000, port);
    assert_eq!(out(&f, 80), (VERDICT_ALLOW, Some(Reason::AdminAccept)));
    assert_eq!(out(&f, 81), (VERDICT_DROP, Some(Reason::AdminDeny)));
    // An address nobody knows: identity WORLD, no CIDR identity; only the
    // any-peer entry (ports 0..=1023) can match.
    let world = |port| f.syn(EG, f.a.ifindex, "10.0.0.1", "192.0.2.7", 40000, port);
    assert_eq!(world(443), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(world(8080), (VERDICT_ALLOW, Some(Reason::Policy)));

    // Swap the ingress ranks with a diff: the Accept of POD_B now comes
    // first (nothing decided before the batch outlives it).
    let mut next = c.clone();
    let subject = c.endpoints[&1].identity;
    for (e, v) in next.tiers.iter_mut() {
        if e.subject == subject && e.direction == IN {
            v.rank = if e.peer == POD_B { 2 } else { 5 };
        }
    }
    f.dp.apply(&c.diff(&next), &next, &f.ifs()).unwrap();
    assert_eq!(
        f.to_a("10.0.0.2", 40001, 80),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );
    assert_eq!(f.to_a("10.0.0.2", 40001, 81), (VERDICT_DROP, Some(Reason::AdminDeny)));
}

#[test]
fn tier_entries_are_in_the_pinned_map_and_follow_diffs() {
    let c = base();
    let mut f = fixture("tm", &c);
    assert!(kernel_tiers(&f.pins.path).is_empty());
    assert_eq!(f.flags(2) & (EP_ADMIN_INGRESS | EP_BASELINE_INGRESS), 0);
    assert_eq!(
        f.to_b("10.0.0.2", 40000, 80),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );

    // A diff adds an Admin Deny of TCP 80..=83 from POD_B (one aligned
    // block) and TCP 8080 from any peer.
    let mut next = c.clone();
    tier(
        &mut next,
        2,
        IN,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 83),
        TierAction::Deny,
        0,
        30,
    );
    tier(
        &mut next,
        2,
        IN,
        Tier::Admin,
        IDENTITY_ANY,
        Some(Tcp),
        (8080, 8080),
        TierAction::Deny,
        1,
        31,
    );
    f.dp.apply(&c.diff(&next), &next, &f.ifs()).unwrap();
    let keys = kernel_tiers(&f.pins.path);
    assert_eq!(keys.len(), 2, "{keys:?}");
    let ranks: Vec<(u32, u32, u32)> = keys.iter().map(|(len, _, v)| (*len, v.rule, v.flags)).collect();
    assert!(ranks.contains(&(94, 30, TIER_DENY)), "{ranks:?}");
    assert!(ranks.contains(&(96, 31, TIER_DENY | 1 << 2)), "{ranks:?}");
    assert_ne!(f.flags(2) & EP_ADMIN_INGRESS, 0);
    assert_eq!(f.to_b("10.0.0.2", 40000, 83), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(
        f.to_b("10.0.0.2", 40000, 84),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
    assert_eq!(f.to_b("10.0.0.3", 40000, 8080), (VERDICT_DROP, Some(Reason::AdminDeny)));
    let dump = f.dp.dump().unwrap();
    assert_eq!(dump.tiers.len(), 2);
    assert!(dump
        .tiers
        .iter()
        .any(|t| t.tier == "admin" && t.action == "deny" && t.peer == POD_B && t.ports == (80, 83)));
    let fill = f.dp.map_fill();
    let tiers_fill = fill.iter().find(|m| m.map == maps::TIERS).expect("NPM_TIERS fill");
    assert_eq!(tiers_fill.entries, 2);

    // The range shrinks to 80..=81 and turns into an Accept; the any-peer
    // entry goes: the old key is removed, the flag stays.
    let mut third = c.clone();
    tier(
        &mut third,
        2,
        IN,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 81),
        TierAction::Accept,
        0,
        32,
    );
    f.dp.apply(&next.diff(&third), &third, &f.ifs()).unwrap();
    let keys = kernel_tiers(&f.pins.path);
    assert_eq!(keys.len(), 1, "{keys:?}");
    assert_eq!((keys[0].0, keys[0].2.rule, keys[0].2.flags), (95, 32, TIER_ACCEPT));
    assert_eq!(
        f.to_b("10.0.0.2", 40001, 81),
        (VERDICT_ALLOW, Some(Reason::AdminAccept))
    );
    assert_eq!(
        f.to_b("10.0.0.2", 40001, 83),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
    assert_eq!(
        f.to_b("10.0.0.3", 40001, 8080),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
    assert_eq!(
        f.dp.map_fill().iter().find(|m| m.map == maps::TIERS).unwrap().entries,
        1
    );

    // Every tier entry goes: the flag is cleared, the map is empty.
    f.dp.apply(&third.diff(&c), &c, &f.ifs()).unwrap();
    assert!(kernel_tiers(&f.pins.path).is_empty());
    assert_eq!(f.flags(2) & EP_ADMIN_INGRESS, 0);

    // A full sync writes everything and sweeps a stale key written behind
    // the loader's back.
    f.dp.sync_full(&next, &f.ifs()).unwrap();
    assert_eq!(kernel_tiers(&f.pins.path).len(), 2);
    let stale = npm_common::tier_key(96, 2, npm_common::DIR_INGRESS, npm_common::TIER_ADMIN, POD_C, 6, 9);
    insert_kernel_tier(&f.pins.path, &stale, TIER_DENY);
    assert_eq!(kernel_tiers(&f.pins.path).len(), 3);
    f.dp.sync_full(&c, &f.ifs()).unwrap();
    assert!(kernel_tiers(&f.pins.path).is_empty());
    assert_eq!(
        f.to_b("10.0.0.2", 40002, 80),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
}

/// Writes an `NPM_TIERS` key into the pinned map, behind the loader's back.
fn insert_kernel_tier(pin_dir: &std::path::Path, key: &npm_common::PolicyKey, flags: u32) {
    use aya::maps::lpm_trie::Key;
    let data = MapData::from_pin(pin_dir.join(maps::TIERS)).expect("open pinned NPM_TIERS");
    let mut trie: LpmTrie<MapData, [u8; POLICY_KEY_LEN], KernelTierValue> =
        LpmTrie::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_TIERS");
    trie.insert(
        &Key::new(key.prefix_len, key.data),
        KernelTierValue { rule: 99, flags },
        0,
    )
    .expect("insert");
}

#[test]
fn a_diff_that_moves_a_range_keeps_the_shared_block() {
    // Ports 80..=83 (one block, 80/94) become 80..=84 (80/94 and 84/96):
    // the removal of the old entry must not take the block the new one
    // wrote.
    let mut c = base();
    tier(
        &mut c,
        2,
        IN,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 83),
        TierAction::Deny,
        0,
        40,
    );
    let mut f = fixture("tg", &c);
    let mut next = base();
    tier(
        &mut next,
        2,
        IN,
        Tier::Admin,
        POD_B,
        Some(Tcp),
        (80, 84),
        TierAction::Deny,
        0,
        41,
    );
    let diff = c.diff(&next);
    assert_eq!((diff.tiers.upsert.len(), diff.tiers.remove.len()), (1, 1));
    f.dp.apply(&diff, &next, &f.ifs()).unwrap();
    assert_eq!(kernel_tiers(&f.pins.path).len(), 2);
    assert_eq!(f.to_b("10.0.0.2", 40000, 80), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(f.to_b("10.0.0.2", 40000, 84), (VERDICT_DROP, Some(Reason::AdminDeny)));
    assert_eq!(
        f.to_b("10.0.0.2", 40000, 85),
        (VERDICT_ALLOW, Some(Reason::NotIsolated))
    );
}

#[test]
fn a_restarted_loader_adopts_the_tier_rule_ids() {
    let mut c = base();
    tier(
        &mut c,
        2,
        IN,
        Tier::Baseline,
        POD_B,
        None,
        (0, 0),
        TierAction::Deny,
        0,
        777,
    );
    let f = fixture("tn", &c);
    let again = f.pins.open();
    assert!(again.adopted_numbers().max_rule >= 777);
    assert_eq!(
        f.to_b("10.0.0.2", 40000, 80),
        (VERDICT_DROP, Some(Reason::BaselineDeny))
    );
}

#[test]
fn service_traffic_of_a_tiered_endpoint_is_decided_against_the_backend() {
    use npm_dataplane::ebpf::{ServicePort, ServicesMap};
    // Endpoint 2 is isolated by no NetworkPolicy; its egress has an Admin
    // Deny of endpoint 1's identity (256): a new flow to a ClusterIP is
    // deferred past the DNAT, and the backend's decision is the tier's.
    let mut c = base();
    tier(
        &mut c,
        2,
        EG,
        Tier::Admin,
        256,
        Some(Tcp),
        (8080, 8080),
        TierAction::Deny,
        0,
        50,
    );
    let f = fixture("ts", &c);
    let cip: std::net::Ipv4Addr = "10.96.0.10".parse().unwrap();
    let wanted: std::collections::BTreeMap<ServicePort, u32> = [(
        ServicePort {
            addr: std::net::IpAddr::V4(cip),
            port: 80,
            protocol: 6,
        },
        npm_common::SVC_CLUSTER_IP,
    )]
    .into_iter()
    .collect();
    ServicesMap::open(&f.pins.path).unwrap().sync(&wanted).unwrap();
    let before = f.counter(EG, Reason::Deferred);
    assert_eq!(
        f.syn(EG, f.b.ifindex, "10.0.0.5", "10.96.0.10", 40000, 80).0,
        VERDICT_ALLOW
    );
    assert_eq!(f.counter(EG, Reason::Deferred), before + 1, "deferred past the DNAT");
    // After the DNAT, at the backend's to_pod: the sender's egress tier.
    let mark = npm_common::defer_mark(0);
    let denied = f.counter(EG, Reason::AdminDeny);
    let dnat = v4("10.0.0.5", "10.0.0.1", L4::Tcp(40000, 8080, 0x02));
    assert_eq!(
        f.dp.test_run_marked(IN, f.a.ifindex, &dnat, mark, f.b.ifindex).unwrap(),
        VERDICT_DROP
    );
    assert_eq!(f.counter(EG, Reason::AdminDeny), denied + 1);
    // Another backend port is not denied by the tier: the sender's egress
    // allows it (not isolated), then endpoint 1's ingress (NP-isolated, no
    // allow) decides.
    let other = v4("10.0.0.5", "10.0.0.1", L4::Tcp(40001, 9090, 0x02));
    let pd = f.counter(IN, Reason::PolicyDenied);
    assert_eq!(
        f.dp.test_run_marked(IN, f.a.ifindex, &other, mark, f.b.ifindex)
            .unwrap(),
        VERDICT_DROP
    );
    assert_eq!(f.counter(IN, Reason::PolicyDenied), pd + 1);
}

/// A reopened dataplane (a restarted agent) reads back, per adopted
/// endpoint record, how many (tier, direction) pairs have entries: what the
/// agent seeds its mass-removal guard with, so that a first sync without
/// the ClusterNetworkPolicies cannot remove the adopted Denies unheld.
#[test]
fn a_reopened_dataplane_reports_the_adopted_tier_directions() {
    let mut c = tier_fixture(true);
    tier_entry_forms(&mut c, 1);
    tier(
        &mut c,
        1,
        Direction::Egress,
        Tier::Admin,
        TIER_POD_B,
        Some(Tcp),
        (80, 80),
        TierAction::Deny,
        11,
        111,
    );
    let t = TierDp::new("tad", &c, npm_dataplane::ebpf::BenchSwitches::default());
    let reopened = EbpfDataplane::open(t.pins.options()).expect("reopen");
    let mut got: Vec<(u32, u8)> = reopened
        .adopted_endpoints()
        .iter()
        .map(|e| (e.id, e.tiered_directions))
        .collect();
    got.sort_unstable();
    // Endpoint 1: Admin ingress and egress, Baseline ingress; endpoint 2: none.
    assert_eq!(got, vec![(1, 3), (2, 0)]);
}
