//! NetworkPolicy allows are keyed by subject (the pod identity), not by
//! endpoint: two pods of one identity, each in its own network namespace
//! behind its own veth, are governed by one set of `NPM_POLICY` keys,
//! counted in the kernel; relabelling one pod (a new
//! identity) moves it to the new subject's entries and leaves the other's
//! record and verdicts alone; a change of a subject's entries rewrites
//! every endpoint record of the subject. Real TCP connections and UDP flows
//! from the root netns decide, on the LPM trie (and, for the tiers, on the
//! folded decisions and with the fold switched off). Needs root.

use std::time::Duration;

use crate::ebpf_common::*;
use npm_common::{EP_NO_ANY_PEER_INGRESS, IDENTITY_ANY, POLICY_PREFIX_FULL};
use npm_dataplane::ebpf::{dump_pinned, BenchSwitches, EbpfDataplane, EbpfDump};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction, Tier, TierAction};
use npm_policy::model::Protocol;

/// The subject both pods start with, and its allowed port.
const OLD: u32 = 256;
const OLD_PORT: u16 = 8080;
/// The identity pod b is relabelled to, and its allowed port.
const NEW: u32 = 257;
const NEW_PORT: u16 = 9090;
/// The identity of a third pod without entries (no ipcache entry either).
const LONE: u32 = 400;
/// The identity of the root-netns peers.
const PEER: u32 = 300;
/// The pods' UDP echo port (allowed from any peer for a while).
const UDP_PORT: u16 = 5353;

#[test]
fn endpoints_of_one_identity_share_its_entries_lpm() {
    endpoints_of_one_identity_share_its_entries("sl");
}

/// Pods a (endpoint 1) and b (endpoint 2), both ingress- and
/// egress-isolated, b of identity `b_identity`; each identity that some pod
/// has allows ingress from [`PEER`] on its own port only.
fn state(a: &PodNet, b: &PodNet, b_identity: u32) -> Compiled {
    let mut c = two_pods(a, b, b_identity, true);
    // One entry per subject (keyed through an endpoint of it).
    allow(
        &mut c,
        1,
        Direction::Ingress,
        PEER,
        Some(Protocol::Tcp),
        (OLD_PORT, OLD_PORT),
        1,
    );
    if b_identity != OLD {
        allow(
            &mut c,
            2,
            Direction::Ingress,
            PEER,
            Some(Protocol::Tcp),
            (NEW_PORT, NEW_PORT),
            2,
        );
    }
    c
}

/// Pods a (endpoint 1, identity [`OLD`]) and b (endpoint 2, identity
/// `b_identity`), isolated in both directions or in none, and the root
/// netns peers ([`PEER`]); no entry.
fn two_pods(a: &PodNet, b: &PodNet, b_identity: u32, isolated: bool) -> Compiled {
    let mut c = Compiled::default();
    let (pa, pb) = (a.pod_ip.to_string(), b.pod_ip.to_string());
    c.endpoints
        .insert(1, endpoint("a", OLD, Some(&pa), None, isolated, isolated));
    c.endpoints
        .insert(2, endpoint("b", b_identity, Some(&pb), None, isolated, isolated));
    ip(&mut c, &pa, OLD, 0);
    ip(&mut c, &pb, b_identity, 0);
    ip(&mut c, &a.peer_ip.to_string(), PEER, 0);
    ip(&mut c, &b.peer_ip.to_string(), PEER, 0);
    c
}

/// What [`setup`] creates.
struct Setup {
    pins: PinDir,
    a: PodNet,
    b: PodNet,
    dp: EbpfDataplane,
    ifs: std::collections::BTreeMap<u32, u32>,
}

/// Two pods (endpoints 1 and 2) serving TCP on [`OLD_PORT`] and
/// [`NEW_PORT`] and UDP on [`UDP_PORT`], and a dataplane on fresh pins.
fn setup(tag: &str, switches: BenchSwitches) -> Setup {
    sweep_leftovers();
    let pins = PinDir::new(&format!("subj{tag}"));
    let mut a = PodNet::new(&format!("{tag}a"));
    let mut b = PodNet::new(&format!("{tag}b"));
    for net in [&mut a, &mut b] {
        net.start_servers(OLD_PORT, &[UDP_PORT]);
        net.start_servers(NEW_PORT, &[]);
        net.wait_ready(OLD_PORT, UDP_PORT);
        net.wait_ready(NEW_PORT, UDP_PORT);
    }
    let dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    let ifs = ifaces(&[(1, a.ifindex), (2, b.ifindex)]);
    Setup { pins, a, b, dp, ifs }
}

/// The kernel's `NPM_POLICY` keys as (subject, port), sorted.
fn kernel_keys(d: &EbpfDump) -> Vec<(u32, u16)> {
    let mut keys: Vec<(u32, u16)> = d
        .policy
        .iter()
        .map(|p| {
            assert_eq!(
                (p.prefix_len, p.ports.0, p.ports.1),
                (POLICY_PREFIX_FULL, p.ports.0, p.ports.0)
            );
            (p.subject, p.ports.0)
        })
        .collect();
    keys.sort();
    keys
}

/// The record of endpoint `id` in the dump.
fn record(d: &EbpfDump, id: u32) -> (u32, u32) {
    let e = d
        .endpoints
        .iter()
        .find(|e| e.id == id)
        .unwrap_or_else(|| panic!("no record of endpoint {id}: {d:?}"));
    (e.subject, e.flags)
}

/// Whether a new TCP connection from the root netns to `net`'s port
/// `port` is answered.
fn connects(net: &PodNet, port: u16) -> bool {
    let short = Duration::from_millis(700);
    net.tcp_exchange(port, short).is_ok()
}

/// Whether a new UDP flow from the root netns to `net`'s echo port is
/// answered.
fn echoes(net: &PodNet) -> bool {
    let short = Duration::from_millis(700);
    net.udp_exchange(UDP_PORT, short).is_ok()
}

fn endpoints_of_one_identity_share_its_entries(tag: &str) {
    let switches = BenchSwitches::default();
    let Setup {
        pins,
        a,
        b,
        mut dp,
        ifs,
    } = setup(tag, switches);

    // One identity: one set of keys in the kernel, both records name it.
    let shared = state(&a, &b, OLD);
    dp.sync_full(&shared, &ifs).unwrap();
    // Read through the pins: the kernel's maps, not the loader's counts.
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(kernel_keys(&d), vec![(OLD, OLD_PORT)], "one key for both endpoints");
    let (a_subject, a_flags) = record(&d, 1);
    assert_eq!(a_subject, OLD);
    assert_eq!(record(&d, 2), (OLD, a_flags), "b carries a's subject and flags");
    for net in [&a, &b] {
        assert!(connects(net, OLD_PORT), "{}: the shared rule allows", net.pod_ip);
        assert!(!connects(net, NEW_PORT), "{}: no rule for {NEW_PORT}", net.pod_ip);
        assert!(!echoes(net), "{}: no UDP rule", net.pod_ip);
    }

    // The subject's entries change (a rule from any peer: its
    // EP_NO_ANY_PEER flag goes): every endpoint of it is rewritten, b
    // although the rule was keyed through a.
    assert_ne!(a_flags & EP_NO_ANY_PEER_INGRESS, 0);
    let mut wider = shared.clone();
    let udp = (UDP_PORT, UDP_PORT);
    allow(
        &mut wider,
        1,
        Direction::Ingress,
        IDENTITY_ANY,
        Some(Protocol::Udp),
        udp,
        3,
    );
    dp.apply(&shared.diff(&wider), &wider, &ifs).unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(kernel_keys(&d), vec![(OLD, UDP_PORT), (OLD, OLD_PORT)]);
    let (_, wider_flags) = record(&d, 1);
    assert_eq!(wider_flags & EP_NO_ANY_PEER_INGRESS, 0);
    assert_eq!(
        record(&d, 2),
        (OLD, wider_flags),
        "b rewritten with the subject's flags"
    );
    for net in [&a, &b] {
        assert!(echoes(net), "{}: the subject's new rule allows", net.pod_ip);
    }
    dp.apply(&wider.diff(&shared), &shared, &ifs).unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(kernel_keys(&d), vec![(OLD, OLD_PORT)]);
    assert_eq!((record(&d, 1), record(&d, 2)), ((OLD, a_flags), (OLD, a_flags)));
    for net in [&a, &b] {
        assert!(!echoes(net), "{}: the rule is gone", net.pod_ip);
    }

    // b is relabelled: a new subject with its own rule; a's entries and
    // record stay as they were.
    let relabelled = state(&a, &b, NEW);
    dp.apply(&shared.diff(&relabelled), &relabelled, &ifs).unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(kernel_keys(&d), vec![(OLD, OLD_PORT), (NEW, NEW_PORT)]);
    assert_eq!(record(&d, 1), (OLD, a_flags), "a's record untouched");
    assert_eq!(record(&d, 2).0, NEW, "b's record names its new subject");
    assert!(connects(&a, OLD_PORT), "a keeps its rule");
    assert!(!connects(&a, NEW_PORT), "a does not get b's new rule");
    assert!(connects(&b, NEW_PORT), "b gets its new identity's rule");
    assert!(!connects(&b, OLD_PORT), "b loses its old identity's rule");

    // a goes: its subject's entries go with it; b is unchanged.
    let mut alone = relabelled.clone();
    alone.endpoints.remove(&1);
    alone.policy.retain(|e, _| e.subject != OLD);
    dp.apply(&relabelled.diff(&alone), &alone, &ifaces(&[(2, b.ifindex)]))
        .unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(kernel_keys(&d), vec![(NEW, NEW_PORT)]);
    assert!(connects(&b, NEW_PORT));
    assert!(!connects(&b, OLD_PORT));

    // A restarted loader adopts the highest subject of the policy keys and
    // the endpoint records: here a record's (an endpoint whose identity has
    // no entry yet), above every key's.
    let other = Dummy::new(&format!("{tag}c"));
    let mut third = alone.clone();
    third
        .endpoints
        .insert(3, endpoint("c", LONE, Some("10.9.7.1"), None, true, false));
    let ifs3 = ifaces(&[(2, b.ifindex), (3, other.ifindex)]);
    dp.apply(&alone.diff(&third), &third, &ifs3).unwrap();
    drop(dp);
    let again = EbpfDataplane::open(pins.options()).unwrap_or_else(|e| panic!("reopen: {e}"));
    assert_eq!(again.adopted_numbers().max_subject, LONE);
}

#[test]
fn endpoints_of_one_identity_share_its_tier_entries_fold() {
    endpoints_of_one_identity_share_its_tier_entries(false, "tf");
}

#[test]
fn endpoints_of_one_identity_share_its_tier_entries_lpm() {
    endpoints_of_one_identity_share_its_tier_entries(true, "tl");
}

/// Pods a (endpoint 1, identity [`OLD`]) and b (endpoint 2, identity
/// `b_identity`), not isolated; identity [`OLD`] has an Admin Deny of
/// [`PEER`] on TCP [`OLD_PORT`] (a ClusterNetworkPolicy whose subject
/// selects it), keyed through endpoint 1.
fn tier_state(a: &PodNet, b: &PodNet, b_identity: u32) -> Compiled {
    let mut c = two_pods(a, b, b_identity, false);
    tier_entry(
        &mut c,
        1,
        Direction::Ingress,
        Tier::Admin,
        PEER,
        Some(Protocol::Tcp),
        (OLD_PORT, OLD_PORT),
        TierAction::Deny,
        1,
        41,
    );
    // The presence is the subject's: every endpoint of it has the flag.
    if b_identity == OLD {
        c.endpoints.get_mut(&2).unwrap().tiers = c.endpoints[&1].tiers;
    }
    c
}

/// The kernel's `NPM_TIERS` keys as (subject, port), sorted.
fn kernel_tier_keys(d: &EbpfDump) -> Vec<(u32, u16)> {
    let mut keys: Vec<(u32, u16)> = d.tiers.iter().map(|t| (t.subject, t.ports.0)).collect();
    keys.sort();
    keys
}

fn endpoints_of_one_identity_share_its_tier_entries(lpm: bool, tag: &str) {
    // The folded decisions or, with the fold off, the LPM decides.
    let switches = BenchSwitches {
        no_fold: lpm,
        ..BenchSwitches::default()
    };
    let Setup {
        pins,
        a,
        b,
        mut dp,
        ifs,
    } = setup(tag, switches);

    // One identity: one tier key for both endpoints; the Admin Deny
    // decides for both.
    let shared = tier_state(&a, &b, OLD);
    dp.sync_full(&shared, &ifs).unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(
        kernel_tier_keys(&d),
        vec![(OLD, OLD_PORT)],
        "one tier key for both endpoints"
    );
    let (_, a_flags) = record(&d, 1);
    assert_eq!(record(&d, 2), (OLD, a_flags), "b carries a's subject and flags");
    for net in [&a, &b] {
        assert!(!connects(net, OLD_PORT), "{}: the subject's Admin Deny", net.pod_ip);
        assert!(connects(net, NEW_PORT), "{}: not isolated elsewhere", net.pod_ip);
    }

    // b is relabelled: it leaves the subject (and its Deny); a keeps it.
    let relabelled = tier_state(&a, &b, NEW);
    dp.apply(&shared.diff(&relabelled), &relabelled, &ifs).unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert_eq!(kernel_tier_keys(&d), vec![(OLD, OLD_PORT)]);
    assert_eq!(record(&d, 1), (OLD, a_flags), "a's record untouched");
    assert_eq!(record(&d, 2).0, NEW);
    assert!(!connects(&a, OLD_PORT), "a keeps the Deny");
    assert!(connects(&b, OLD_PORT), "b is no longer denied");

    // a goes: the subject's tier keys go with its last endpoint.
    let mut alone = relabelled.clone();
    alone.endpoints.remove(&1);
    alone.tiers.retain(|e, _| e.subject != OLD);
    dp.apply(&relabelled.diff(&alone), &alone, &ifaces(&[(2, b.ifindex)]))
        .unwrap();
    let d = dump_pinned(&pins.path).unwrap();
    assert!(kernel_tier_keys(&d).is_empty(), "{:?}", d.tiers);
    assert!(connects(&b, OLD_PORT));
}
