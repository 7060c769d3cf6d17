//! ClusterNetworkPolicy tiers on the nftables dataplane, with real packets:
//! a "node" namespace forwards between three "pod" namespaces (veth pairs,
//! /32 and /128 addresses, as in `nft_traffic.rs`); compiled forms are built
//! by hand (Admin, NetworkPolicy and Baseline entries) and TCP, UDP and ICMP
//! probes check the order of cnp-design.md: host ingress, Admin (Accept,
//! Deny, Pass), NetworkPolicy when it isolates, else Baseline, else allow.
//! A Deny is a silent drop: the TCP probe times out, it is never refused.
//! Plus the golden of an endpoint with Admin + NetworkPolicy + Baseline
//! (`tests/golden/nft_tiers.nft` and `.list`) and incremental updates
//! through tier changes equal to a fresh load.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Instant;

use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS, IDENTITY_ANY, IDENTITY_HOST};
use npm_dataplane::nft::{render, NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction, Tier, TierAction};
use npm_policy::model::Protocol;

use crate::nft_common::tier_topo::{
    base, count, pod_ip, pod_ip6, Deltas, Topo, A, B, C, C_NET, EP_A, EP_B, ID_A, ID_C, NODE_IP, NS_PREFIX,
};
use crate::nft_common::{
    allow, check_golden, clear_leftovers, endpoint, ip, listing_blocks, normalise_listing, tier, Netns,
};

/// b ingress-isolated, nothing allowed; an Admin Accept of a on TCP 8000
/// decides before NetworkPolicy: a passes, c and a's other port do not.
#[test]
fn admin_accept_overrides_networkpolicy_deny() {
    let topo = Topo::new("acc");
    let mut dp = topo.dataplane("acc");
    let mut c = base();
    c.endpoints.get_mut(&EP_B).unwrap().isolated_ingress = true;
    dp.sync_full(&c, &topo.ifs).unwrap();
    assert_eq!(topo.tcp(A, B, 8000), "timeout", "NetworkPolicy isolates b");
    let mut next = c.clone();
    let (adm, ing) = (Tier::Admin, Direction::Ingress);
    let tcp = Some(Protocol::Tcp);
    tier(
        &mut next,
        EP_B,
        ing,
        adm,
        ID_A,
        tcp,
        (8000, 8000),
        TierAction::Accept,
        0,
    );
    dp.apply(&c.diff(&next), &next, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(topo.tcp(A, B, 8000), "ok", "Admin Accept: a -> b tcp/8000");
    assert_eq!(topo.tcp6(A, B, 8000), "ok", "Admin Accept: a -> b tcp6/8000");
    assert_eq!(topo.tcp(A, B, 8001), "timeout", "not accepted: a -> b tcp/8001");
    assert_eq!(topo.tcp(C, B, 8000), "timeout", "not accepted: c -> b tcp/8000");
    assert_eq!(
        d.of(&dp, DIR_INGRESS, Reason::AdminAccept),
        2,
        "one SYN per accepted connection"
    );
    assert!(d.of(&dp, DIR_INGRESS, Reason::PolicyDenied) >= 2);
    assert_eq!(dp.full_loads(), 1, "the tier change went through an incremental update");
    dp.remove().unwrap();
}

/// b allows everything by NetworkPolicy; an Admin Deny of a (every
/// protocol) drops a's TCP, UDP and ICMP silently (a timeout where the
/// closed port was refused before), c still passes, and the node still
/// reaches b (host ingress comes before every tier).
#[test]
fn admin_deny_overrides_networkpolicy_allow() {
    let topo = Topo::new("deny");
    let mut dp = topo.dataplane("deny");
    let mut c = base();
    c.endpoints.get_mut(&EP_B).unwrap().isolated_ingress = true;
    allow(&mut c, EP_B, Direction::Ingress, IDENTITY_ANY, None, (0, 65535));
    dp.sync_full(&c, &topo.ifs).unwrap();
    assert_eq!(topo.tcp(A, B, 8000), "ok", "NetworkPolicy allows a -> b");
    assert_eq!(
        topo.tcp(A, B, 8009),
        "refused",
        "a closed port is refused (the probe tells)"
    );
    assert!(topo.ping(A, B), "NetworkPolicy allows a's ICMP");
    let mut next = c.clone();
    tier(
        &mut next,
        EP_B,
        Direction::Ingress,
        Tier::Admin,
        ID_A,
        None,
        (0, 65535),
        TierAction::Deny,
        0,
    );
    dp.apply(&c.diff(&next), &next, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(topo.tcp(A, B, 8000), "timeout", "Admin Deny: a -> b tcp/8000");
    assert_eq!(topo.tcp(A, B, 8009), "timeout", "Admin Deny is silent (no RST)");
    assert_eq!(topo.tcp6(A, B, 8000), "timeout", "Admin Deny: a -> b tcp6/8000");
    assert_eq!(topo.udp(A, B), "timeout", "Admin Deny: a -> b udp/9000");
    assert!(!topo.ping(A, B), "Admin Deny without protocols covers ICMP");
    assert_eq!(topo.tcp(C, B, 8000), "ok", "c is not denied");
    assert_eq!(
        topo.probe(None, "tcp", &pod_ip(B), 8000),
        "ok",
        "host ingress before the tiers"
    );
    assert!(d.of(&dp, DIR_INGRESS, Reason::AdminDeny) >= 5);
    assert!(d.of(&dp, DIR_INGRESS, Reason::Host) >= 1);
    assert_eq!(d.of(&dp, DIR_INGRESS, Reason::AdminAccept), 0);
    // Removing the tier restores NetworkPolicy's verdict (incrementally).
    dp.apply(&next.diff(&c), &c, &topo.ifs).unwrap();
    assert_eq!(topo.tcp(A, B, 8000), "ok", "tier removed: a -> b");
    assert_eq!(dp.full_loads(), 1);
    dp.remove().unwrap();
}

/// Admin: rank 0 Pass for a, rank 1 Deny for everybody. a goes on to
/// NetworkPolicy (allowed on TCP 8000 only), c is denied by the Admin
/// tier; an Admin Deny for a in a's own ingress does not stop the
/// replies of a's connections (conntrack).
#[test]
fn admin_pass_goes_on_to_networkpolicy() {
    let topo = Topo::new("pass");
    let mut dp = topo.dataplane("pass");
    let mut c = base();
    c.endpoints.get_mut(&EP_B).unwrap().isolated_ingress = true;
    allow(
        &mut c,
        EP_B,
        Direction::Ingress,
        ID_A,
        Some(Protocol::Tcp),
        (8000, 8000),
    );
    let (adm, ing) = (Tier::Admin, Direction::Ingress);
    tier(&mut c, EP_B, ing, adm, ID_A, None, (0, 65535), TierAction::Pass, 0);
    tier(
        &mut c,
        EP_B,
        ing,
        adm,
        IDENTITY_ANY,
        None,
        (0, 65535),
        TierAction::Deny,
        1,
    );
    tier(
        &mut c,
        EP_A,
        ing,
        adm,
        IDENTITY_ANY,
        None,
        (0, 65535),
        TierAction::Deny,
        0,
    );
    dp.sync_full(&c, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(
        topo.tcp(A, B, 8000),
        "ok",
        "Pass, then NetworkPolicy allows a -> b tcp/8000"
    );
    assert_eq!(
        topo.tcp(A, B, 8001),
        "timeout",
        "Pass, then NetworkPolicy denies tcp/8001"
    );
    assert_eq!(d.of(&dp, DIR_INGRESS, Reason::Policy), 1);
    assert!(d.of(&dp, DIR_INGRESS, Reason::PolicyDenied) >= 1, "the 8001 SYN");
    assert_eq!(
        d.of(&dp, DIR_INGRESS, Reason::AdminDeny),
        0,
        "a is never denied by the Admin tier"
    );
    assert_eq!(topo.tcp(C, B, 8000), "timeout", "c: the rank-1 Admin Deny");
    assert!(d.of(&dp, DIR_INGRESS, Reason::AdminDeny) >= 1);
    assert_eq!(topo.tcp(C, A, 8000), "timeout", "a's ingress denies c");
    dp.remove().unwrap();
}

/// b not NetworkPolicy-isolated: Baseline decides (rank 0 Accept for c on
/// TCP 8000, rank 1 Deny for a on everything); a packet no Baseline rule
/// matches is allowed (not isolated). Egress Baseline too (a -> the CIDR
/// 10.78.0.0/16 on UDP denied).
#[test]
fn baseline_decides_when_not_isolated() {
    let topo = Topo::new("base");
    let mut dp = topo.dataplane("base");
    let mut c = base();
    let (bl, ing) = (Tier::Baseline, Direction::Ingress);
    let tcp = Some(Protocol::Tcp);
    tier(&mut c, EP_B, ing, bl, ID_C, tcp, (8000, 8000), TierAction::Accept, 0);
    tier(&mut c, EP_B, ing, bl, ID_A, None, (0, 65535), TierAction::Deny, 1);
    let udp = Some(Protocol::Udp);
    tier(
        &mut c,
        EP_A,
        Direction::Egress,
        bl,
        C_NET,
        udp,
        (0, 65535),
        TierAction::Deny,
        0,
    );
    dp.sync_full(&c, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(topo.tcp(A, B, 8000), "timeout", "Baseline Deny: a -> b");
    assert_eq!(topo.tcp6(A, B, 8001), "timeout", "Baseline Deny: a -> b tcp6");
    assert_eq!(topo.tcp(C, B, 8000), "ok", "Baseline Accept: c -> b tcp/8000");
    assert_eq!(
        topo.tcp(C, B, 8001),
        "ok",
        "no Baseline rule: c -> b tcp/8001 (not isolated)"
    );
    assert_eq!(
        topo.udp(A, C),
        "timeout",
        "egress Baseline Deny to the CIDR: a -> c udp"
    );
    assert_eq!(topo.tcp(A, C, 8000), "ok", "a -> c tcp: not covered");
    assert!(d.of(&dp, DIR_INGRESS, Reason::BaselineDeny) >= 2);
    assert_eq!(d.of(&dp, DIR_INGRESS, Reason::BaselineAccept), 1);
    assert!(d.of(&dp, DIR_EGRESS, Reason::BaselineDeny) >= 1);
    assert!(d.of(&dp, DIR_INGRESS, Reason::NotIsolated) >= 1);
    dp.remove().unwrap();
}

/// b NetworkPolicy-isolated (a allowed on TCP 8000): the Baseline tier is
/// never consulted: its Deny of a and its Accept of c change nothing.
#[test]
fn baseline_is_ignored_when_networkpolicy_isolates() {
    let topo = Topo::new("iso");
    let mut dp = topo.dataplane("iso");
    let mut c = base();
    c.endpoints.get_mut(&EP_B).unwrap().isolated_ingress = true;
    let tcp = Some(Protocol::Tcp);
    allow(&mut c, EP_B, Direction::Ingress, ID_A, tcp, (8000, 8000));
    let (bl, ing) = (Tier::Baseline, Direction::Ingress);
    tier(&mut c, EP_B, ing, bl, ID_A, None, (0, 65535), TierAction::Deny, 0);
    tier(&mut c, EP_B, ing, bl, ID_C, None, (0, 65535), TierAction::Accept, 1);
    dp.sync_full(&c, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(
        topo.tcp(A, B, 8000),
        "ok",
        "NetworkPolicy allows a, Baseline Deny ignored"
    );
    assert_eq!(
        topo.tcp(C, B, 8000),
        "timeout",
        "NetworkPolicy denies c, Baseline Accept ignored"
    );
    assert_eq!(d.of(&dp, DIR_INGRESS, Reason::BaselineDeny), 0);
    assert_eq!(d.of(&dp, DIR_INGRESS, Reason::BaselineAccept), 0);
    assert_eq!(d.of(&dp, DIR_INGRESS, Reason::Policy), 1);
    dp.remove().unwrap();
}

/// Admin egress: a denied to the CIDR on TCP 8001 (rank 0) and accepted to
/// everybody on TCP (rank 1) while NetworkPolicy isolates a's egress with
/// nothing allowed; then the tier counters survive a full replace and a
/// restarted dataplane.
#[test]
fn admin_egress_and_counters_across_replaces() {
    let topo = Topo::new("egr");
    let mut dp = topo.dataplane("egr");
    let mut c = base();
    c.endpoints.get_mut(&EP_A).unwrap().isolated_egress = true;
    let (adm, eg) = (Tier::Admin, Direction::Egress);
    let tcp = Some(Protocol::Tcp);
    tier(&mut c, EP_A, eg, adm, C_NET, tcp, (8001, 8001), TierAction::Deny, 0);
    tier(
        &mut c,
        EP_A,
        eg,
        adm,
        IDENTITY_ANY,
        tcp,
        (0, 65535),
        TierAction::Accept,
        1,
    );
    dp.sync_full(&c, &topo.ifs).unwrap();
    assert_eq!(
        topo.tcp(A, B, 8000),
        "ok",
        "Admin egress Accept over NetworkPolicy isolation"
    );
    assert_eq!(topo.tcp(A, B, 8001), "timeout", "Admin egress Deny (rank 0) first");
    assert_eq!(topo.udp(A, B), "timeout", "NetworkPolicy egress isolation for UDP");
    let counters = dp.counters().unwrap();
    assert_eq!(count(&counters, DIR_EGRESS, Reason::AdminAccept), 1, "one SYN");
    let denied = count(&counters, DIR_EGRESS, Reason::AdminDeny);
    assert!(denied >= 1, "the 8001 SYN (and its retransmission)");
    // No tiers any more: a full replace keeps the tier counters' totals.
    let plain = base();
    dp.sync_full(&plain, &topo.ifs).unwrap();
    let mut dp2 = topo.dataplane("egr");
    dp2.sync_full(&plain, &topo.ifs).unwrap();
    let kept = dp2.counters().unwrap();
    assert_eq!(count(&kept, DIR_EGRESS, Reason::AdminAccept), 1);
    assert_eq!(count(&kept, DIR_EGRESS, Reason::AdminDeny), denied);
    // Tiers again, incrementally: the counters go on from their totals.
    dp2.apply(&plain.diff(&c), &c, &topo.ifs).unwrap();
    assert_eq!(topo.tcp(A, B, 8001), "timeout");
    assert!(count(&dp2.counters().unwrap(), DIR_EGRESS, Reason::AdminDeny) > denied);
    assert_eq!(dp2.full_loads(), 1);
    dp2.remove().unwrap();
}

/// Endpoint 2 with Admin, NetworkPolicy and Baseline entries of every kind
/// in both directions (IPv4 and IPv6 peers, CIDR, any peer, port ranges,
/// Pass); endpoint 1 without tiers (rendered as without tiers).
fn golden_tiers() -> (Compiled, Interfaces) {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, false, false));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.2"), Some("fd00::2"), true, false));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.2", 257, 0);
    ip(&mut c, "fd00::2", 257, 0);
    ip(&mut c, "10.0.0.3", 258, 0);
    ip(&mut c, "fd00::3", 258, 0);
    ip(&mut c, "192.168.1.10", IDENTITY_HOST, 0);
    c.cidrs.insert("169.254.0.0/16".parse().unwrap(), C_NET);
    let (adm, bl) = (Tier::Admin, Tier::Baseline);
    let (ing, eg) = (Direction::Ingress, Direction::Egress);
    let (tcp, udp) = (Some(Protocol::Tcp), Some(Protocol::Udp));
    allow(&mut c, 2, ing, 256, tcp, (80, 80));
    tier(&mut c, 2, ing, adm, 258, None, (0, 65535), TierAction::Deny, 2);
    tier(&mut c, 2, ing, adm, 256, tcp, (80, 80), TierAction::Pass, 1);
    tier(&mut c, 2, ing, adm, IDENTITY_ANY, udp, (53, 53), TierAction::Accept, 0);
    tier(&mut c, 2, ing, bl, 258, None, (0, 65535), TierAction::Accept, 0);
    tier(&mut c, 2, eg, adm, C_NET, None, (0, 65535), TierAction::Deny, 0);
    tier(&mut c, 2, eg, bl, 258, tcp, (8000, 8999), TierAction::Accept, 0);
    tier(&mut c, 2, eg, bl, IDENTITY_ANY, None, (0, 65535), TierAction::Deny, 1);
    (c, Interfaces::from([(1, 10), (2, 11)]))
}

#[test]
fn golden_admin_networkpolicy_baseline() {
    let (c, ifs) = golden_tiers();
    let script = render(&c, &ifs, &NftOptions::default());
    check_golden("tiers", "nft", &script);
    clear_leftovers(NS_PREFIX);
    let ns = Netns::new(&format!("{NS_PREFIX}{}gold", std::process::id()));
    let table = format!("npm_g{}", std::process::id());
    let mut dp = NftDataplane::new(NftOptions {
        table: table.clone(),
        netns: Some(ns.name.clone()),
    })
    .unwrap();
    dp.sync_full(&c, &ifs).unwrap();
    check_golden("tiers", "list", &normalise_listing(&dp.list_table().unwrap(), &table));
    dp.remove().unwrap();
}

/// Incremental updates through tier additions, re-rankings, action changes
/// and removals list the same objects as a fresh load of each state, and
/// never fall back to a full replace.
#[test]
fn incremental_tier_updates_equal_a_fresh_load() {
    clear_leftovers(NS_PREFIX);
    let ns = Netns::new(&format!("{NS_PREFIX}{}inc", std::process::id()));
    let opts = |table: &str| NftOptions {
        table: table.into(),
        netns: Some(ns.name.clone()),
    };
    let mut inc = NftDataplane::new(opts("npm_tinc")).unwrap();
    let mut fresh = NftDataplane::new(opts("npm_tfresh")).unwrap();
    let (g, ifs) = golden_tiers();
    let mut plain = g.clone();
    plain.tiers.clear();
    for ep in plain.endpoints.values_mut() {
        ep.tiers = Default::default();
    }
    let mut reranked = g.clone();
    for v in reranked.tiers.values_mut() {
        v.rank = 10 - v.rank;
        if v.action == TierAction::Pass {
            v.action = TierAction::Deny;
        }
    }
    let mut only_baseline = g.clone();
    only_baseline.tiers.retain(|e, _| e.tier == Tier::Baseline);
    let mut gone = g.clone();
    gone.endpoints.remove(&2);
    let steps = [
        plain.clone(),
        g.clone(),
        reranked,
        only_baseline,
        g.clone(),
        gone,
        plain,
        g,
    ];
    // The tables differ in when the tier counters appeared, not in what
    // the chains do: start both with the tier counters declared.
    inc.sync_full(&steps[1], &ifs).unwrap();
    inc.sync_full(&steps[0], &ifs).unwrap();
    fresh.sync_full(&steps[1], &ifs).unwrap();
    let started = Instant::now();
    for (i, next) in steps.iter().enumerate().skip(1) {
        inc.apply(&steps[i - 1].diff(next), next, &ifs).unwrap();
        fresh.sync_full(next, &ifs).unwrap();
        let got = listing_blocks(&normalise_listing(&inc.list_table().unwrap(), "npm_tinc"));
        let want = listing_blocks(&normalise_listing(&fresh.list_table().unwrap(), "npm_tfresh"));
        assert_eq!(got, want, "step {i}: incremental table differs from a fresh load");
    }
    eprintln!(
        "{} incremental tier updates in {:?}",
        steps.len() - 1,
        started.elapsed()
    );
    assert_eq!(inc.full_loads(), 2);
    assert_eq!(inc.incremental_updates(), steps.len() as u64 - 1);
    inc.remove().unwrap();
    fresh.remove().unwrap();
}

/// Service traffic: a kube-proxy-style DNAT of 10.96.0.10:80 to b:8000 in
/// the node. a's egress is decided after the DNAT (on b's identity and
/// port 8000; the ClusterIP is in no set), b's ingress in postrouting, and
/// the tiers apply there as to direct traffic.
#[test]
fn tiers_apply_to_service_traffic_after_dnat() {
    const CLUSTER_IP: &str = "10.96.0.10";
    let topo = Topo::new("svc");
    let kp = format!(
        "table ip npmtierkp {{\n chain pre {{\n  type nat hook prerouting priority dstnat; policy accept;\n  \
         ip daddr {CLUSTER_IP} tcp dport 80 dnat to {}:8000\n }}\n}}\n",
        pod_ip(B)
    );
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &topo.node.name, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    nft.stdin.as_mut().unwrap().write_all(kp.as_bytes()).unwrap();
    drop(nft.stdin.take());
    assert!(nft.wait().unwrap().success(), "load the DNAT:\n{kp}");
    let mut dp = topo.dataplane("svc");
    let open = base();
    dp.sync_full(&open, &topo.ifs).unwrap();
    let svc = |from: usize| topo.probe(Some(from), "tcp", CLUSTER_IP, 80);
    assert_eq!(svc(A), "ok", "no policy: a -> service");
    // a's Admin egress Deny of b's identity on TCP 8000 (the backend port).
    let mut egress = open.clone();
    let tcp = Some(Protocol::Tcp);
    let id_b = 257;
    tier(
        &mut egress,
        EP_A,
        Direction::Egress,
        Tier::Admin,
        id_b,
        tcp,
        (8000, 8000),
        TierAction::Deny,
        0,
    );
    dp.apply(&open.diff(&egress), &egress, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(svc(A), "timeout", "Admin egress Deny of the backend, after DNAT");
    assert_eq!(svc(C), "ok", "c -> service");
    assert!(d.of(&dp, DIR_EGRESS, Reason::AdminDeny) >= 1);
    // b's Admin ingress Deny of a: a's connection through the service is
    // dropped at b, c's is not.
    let mut ingress = open.clone();
    tier(
        &mut ingress,
        EP_B,
        Direction::Ingress,
        Tier::Admin,
        ID_A,
        None,
        (0, 65535),
        TierAction::Deny,
        0,
    );
    dp.apply(&egress.diff(&ingress), &ingress, &topo.ifs).unwrap();
    let d = Deltas::start(&dp);
    assert_eq!(svc(A), "timeout", "Admin ingress Deny at the backend");
    assert_eq!(svc(C), "ok", "c -> service");
    assert!(d.of(&dp, DIR_INGRESS, Reason::AdminDeny) >= 1);
    assert_eq!(dp.full_loads(), 1);
    dp.remove().unwrap();
}

/// A ClusterNetworkPolicy rule of the differential test (its rank is its
/// index in its tier and direction).
#[derive(Clone, Copy, Debug)]
struct Rule {
    peer: u32,
    proto: Option<Protocol>,
    ports: (u16, u16),
    action: TierAction,
}

impl Rule {
    fn matches(&self, ids: &[u32; 3], proto: u8, port: u16) -> bool {
        ids.contains(&self.peer)
            && match self.proto {
                None => true,
                Some(p) => p.number() == proto && self.ports.0 <= port && port <= self.ports.1,
            }
    }
}

/// Folds the rules of one (endpoint, direction, tier) into tier entries as
/// the `TierEntry` documentation says the compiler does: per peer identity,
/// the `protocol: None` entry carries the first rule without protocols;
/// the port axis of each protocol is cut at every rule's bounds, and each
/// piece some rule of that protocol covers carries the first rule matching
/// it (that protocol's rules and the rules without protocols).
fn fold(c: &mut Compiled, ep: u32, direction: Direction, tier_: Tier, rules: &[Rule]) {
    let rule_id = |rank: usize| 5000 + 100 * tier_ as u32 + 50 * direction as u32 + rank as u32;
    let peers: std::collections::BTreeSet<u32> = rules.iter().map(|r| r.peer).collect();
    for peer in peers {
        let none = rules.iter().position(|r| r.peer == peer && r.proto.is_none());
        let mut put = |proto, ports, rank: usize| {
            let entry = npm_policy::compiled::TierEntry {
                subject: c.endpoints[&ep].identity,
                direction,
                tier: tier_,
                peer,
                protocol: proto,
                ports,
            };
            let action = rules[rank].action;
            let value = npm_policy::compiled::TierValue {
                action,
                rank: rank as u32,
                rule: rule_id(rank),
            };
            c.tiers.insert(entry, value);
        };
        if let Some(rank) = none {
            put(None, (0, 65535), rank);
        }
        for proto in [Protocol::Tcp, Protocol::Udp] {
            let mine: Vec<usize> = (0..rules.len())
                .filter(|i| rules[*i].peer == peer && rules[*i].proto == Some(proto))
                .collect();
            let mut cuts = std::collections::BTreeSet::from([0u32, 65536]);
            for i in &mine {
                cuts.insert(u32::from(rules[*i].ports.0));
                cuts.insert(u32::from(rules[*i].ports.1) + 1);
            }
            let cuts: Vec<u32> = cuts.into_iter().collect();
            for w in cuts.windows(2) {
                let (lo, hi) = (w[0] as u16, (w[1] - 1) as u16);
                let covering = mine
                    .iter()
                    .copied()
                    .filter(|i| rules[*i].ports.0 <= lo && hi <= rules[*i].ports.1)
                    .min();
                if let Some(first) = covering {
                    put(Some(proto), (lo, hi), none.map_or(first, |n| n.min(first)));
                }
            }
        }
    }
    if !rules.is_empty() {
        c.endpoints.get_mut(&ep).unwrap().tiers.set(tier_, direction);
    }
}

/// Deterministic xorshift; `NPM_TIER_SEED` overrides the seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// Random Admin, NetworkPolicy and Baseline state of pod b (both
/// directions), folded into entries; returns the rules per (direction,
/// tier) for the direct check of the reference lookup.
fn random_state(rng: &mut Rng) -> (Compiled, Vec<(Direction, Tier, Vec<Rule>)>) {
    let mut c = base();
    let peers = [ID_A, ID_C, C_NET, IDENTITY_ANY, IDENTITY_HOST];
    let tcp_ports = [(8000, 8000), (8001, 8001), (8000, 8001), (0, 65535), (7000, 8000)];
    let actions = [TierAction::Accept, TierAction::Deny, TierAction::Pass];
    let mut rules_out = Vec::new();
    let ep = c.endpoints.get_mut(&EP_B).unwrap();
    ep.isolated_ingress = rng.below(2) == 0;
    ep.isolated_egress = rng.below(2) == 0;
    for direction in [Direction::Ingress, Direction::Egress] {
        for _ in 0..rng.below(3) {
            let (proto, ports) = match rng.below(3) {
                0 => (None, (0, 65535)),
                1 => (Some(Protocol::Tcp), rng.pick(&tcp_ports)),
                _ => (Some(Protocol::Udp), (9000, 9000)),
            };
            allow(&mut c, EP_B, direction, rng.pick(&peers), proto, ports);
        }
        for tier_ in [Tier::Admin, Tier::Baseline] {
            let rules: Vec<Rule> = (0..rng.below(5))
                .map(|_| {
                    let (proto, ports) = match rng.below(4) {
                        0 => (None, (0, 65535)),
                        1 | 2 => (Some(Protocol::Tcp), rng.pick(&tcp_ports)),
                        _ => (Some(Protocol::Udp), rng.pick(&[(9000, 9000), (0, 65535)])),
                    };
                    Rule {
                        peer: rng.pick(&peers),
                        proto,
                        ports,
                        action: rng.pick(&actions),
                    }
                })
                .collect();
            fold(&mut c, EP_B, direction, tier_, &rules);
            rules_out.push((direction, tier_, rules));
        }
    }
    (c, rules_out)
}

/// A probe of the differential test: (from, mode, destination, port,
/// b's direction, b's peer address).
type Probe = (Option<usize>, &'static str, String, u16, Direction, String);

/// Random tier states of pod b, applied incrementally, against real
/// probes: every TCP/UDP probe into and out of b passes exactly when the
/// compiler's reference lookup (`npm_policy::lookup::lookup`: most specific
/// entry per identity, lowest rank among identities) allows it; and the
/// reference's tier matches equal the first matching rule by rank, which
/// checks the rank-ordered rendering is the datapath's decision.
#[test]
fn random_tiers_match_the_reference_lookup() {
    let seed = npm_testkit::rng::seed("NPM_TIER_SEED", Some(0x5eed_7135));
    let mut rng = Rng(seed);
    let topo = Topo::new("diff");
    let mut dp = topo.dataplane("diff");
    let started = Instant::now();
    let mut prev: Option<Compiled> = None;
    let mut decided = std::collections::BTreeMap::<Reason, usize>::new();
    const ROUNDS: usize = 12;
    for round in 0..ROUNDS {
        let (c, rules) = random_state(&mut rng);
        match &prev {
            None => dp.sync_full(&c, &topo.ifs).unwrap(),
            Some(p) => dp.apply(&p.diff(&c), &c, &topo.ifs).unwrap(),
        }
        let mut probes: Vec<Probe> = Vec::new();
        for from in [Some(A), Some(C), None] {
            let src = from.map_or(NODE_IP.to_string(), pod_ip);
            for (mode, port) in [("tcp", 8000), ("tcp", 8001), ("udp", 9000)] {
                probes.push((from, mode, pod_ip(B), port, Direction::Ingress, src.clone()));
            }
        }
        probes.push((Some(A), "tcp", pod_ip6(B), 8000, Direction::Ingress, pod_ip6(A)));
        for to in [A, C] {
            for (mode, port) in [("tcp", 8000), ("tcp", 8001), ("udp", 9000)] {
                probes.push((Some(B), mode, pod_ip(to), port, Direction::Egress, pod_ip(to)));
            }
        }
        probes.push((
            Some(B),
            "tcp",
            NODE_IP.to_string(),
            8000,
            Direction::Egress,
            NODE_IP.to_string(),
        ));
        let batch: Vec<_> = probes.iter().map(|p| (p.0, p.1, p.2.clone(), p.3)).collect();
        let got = topo.probe_all(&batch);
        let mut wrong = Vec::new();
        for ((_, mode, dst, port, direction, peer), got) in probes.iter().zip(&got) {
            let proto = if *mode == "tcp" { 6 } else { 17 };
            let peer_ip: std::net::IpAddr = peer.parse().unwrap();
            let res = npm_policy::lookup::lookup(&c, EP_B, *direction, peer_ip, proto, *port);
            *decided.entry(res.reason).or_default() += 1;
            // The reference's tier match is the first rule by rank.
            let ids = [res.peer_identity, res.cidr_identity, IDENTITY_ANY];
            for (d, t, list) in &rules {
                let first = list
                    .iter()
                    .position(|r| r.matches(&ids, proto, *port))
                    .map(|i| i as u32);
                let seen = if *t == Tier::Admin { res.admin } else { res.baseline };
                if d == direction && seen.is_some() {
                    assert_eq!(
                        seen.map(|v| v.rank),
                        first,
                        "round {round}: {t:?} {d:?} {peer} {mode}/{port}"
                    );
                }
            }
            let want = if res.allowed { "ok" } else { "timeout" };
            if got != want {
                wrong.push(format!(
                    "{mode} {peer} <-> {dst}:{port} ({direction:?} of b): got {got}, reference {res:?}"
                ));
            }
        }
        assert!(
            wrong.is_empty(),
            "round {round} (seed {seed}):\n{}\nstate: {c:#?}",
            wrong.join("\n")
        );
        prev = Some(c);
    }
    eprintln!(
        "{ROUNDS} random tier states in {:?}, decided by {decided:?}",
        started.elapsed()
    );
    for r in [
        Reason::AdminAccept,
        Reason::AdminDeny,
        Reason::BaselineAccept,
        Reason::BaselineDeny,
        Reason::Policy,
    ] {
        assert!(
            decided.contains_key(&r),
            "no probe decided by {r:?}: {decided:?} (change the seed)"
        );
    }
    assert_eq!(dp.full_loads(), 1, "every change went through an incremental update");
    dp.remove().unwrap();
}
