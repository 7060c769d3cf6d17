//! Map sizes set at load time and degraded mode, against the kernel (issue
//! 15): maps created with the configured `max_entries`; a pinned map keeps
//! its size across a reopen with another configuration (reported, never
//! recreated); a size out of bounds is refused naming the map; and a
//! compiled state that does not fit a tiny `NPM_POLICY` (64 keys) or
//! `NPM_IPCACHE` (64 addresses) is trimmed by `EbpfDataplane::fit` so that
//! previously programmed endpoints keep their verdicts (probed with
//! `BPF_PROG_TEST_RUN` on real veths), everything else is programmed, the
//! directions whose allows did not fit fail closed, an address that did not
//! fit never keeps another owner's identity, and once the state fits again
//! it converges. Privileged: needs root (bpffs, veths).

use crate::ebpf_common::*;
use aya::maps::MapData;
use npm_common::{maps, sizes, Reason};
use npm_dataplane::ebpf::{EbpfDataplane, EbpfError, MapSizes, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN, Tier, TierAction, TierEntry, TierValue};
use npm_policy::model::Protocol::Tcp;

/// Tiny maps: 64 policy keys, 64 addresses.
fn tiny() -> MapSizes {
    MapSizes {
        policy: 64,
        ipcache: 64,
        ..MapSizes::default()
    }
}

fn open(pins: &PinDir, sizes: MapSizes) -> EbpfDataplane {
    EbpfDataplane::open_sized(pins.options(), sizes).unwrap_or_else(|e| panic!("open: {e}"))
}

/// The kernel's `max_entries` of a pinned map.
fn pinned_max_entries(pins: &PinDir, name: &str) -> u32 {
    let data = MapData::from_pin(pins.path.join(name)).unwrap_or_else(|e| panic!("pin {name}: {e}"));
    data.info().unwrap().max_entries()
}

fn verdict(dp: &EbpfDataplane, ifindex: u32, src: &str, dst: &str, port: u16) -> i32 {
    let syn = v4(src, dst, L4::Tcp(40000, port, 0x02));
    dp.test_run(IN, ifindex, &syn).unwrap().0
}

/// Ingress allows of `ep` from identity `peer` on each of `ports`.
fn allow_ports(c: &mut Compiled, ep: u32, peer: u32, ports: impl IntoIterator<Item = u16>) {
    for p in ports {
        allow(c, ep, IN, peer, Some(Tcp), (p, p), 100 + u32::from(p));
    }
}

/// Endpoints a (1), b (2), c (3), d (4) ingress-isolated; the peer
/// 10.70.1.9 is identity 300.
fn base() -> Compiled {
    let mut c = Compiled::default();
    let eps = [
        (1, "a", "10.70.0.1"),
        (2, "b", "10.70.0.2"),
        (3, "c", "10.70.0.3"),
        (4, "d", "10.70.0.4"),
    ];
    for (id, name, addr) in eps {
        c.endpoints
            .insert(id, endpoint(name, 255 + id, Some(addr), None, true, false));
        ip(&mut c, addr, 255 + id, 0);
    }
    ip(&mut c, "10.70.1.9", 300, 0);
    c
}

#[test]
fn configured_sizes_apply_and_a_pinned_map_keeps_its_size() {
    sweep_leftovers();
    let pins = PinDir::new("h15sz");
    // Out of bounds: refused before anything is loaded, naming the map.
    let bad = MapSizes {
        policy: 10,
        ..MapSizes::default()
    };
    match EbpfDataplane::open_sized(pins.options(), bad) {
        Err(
            e @ EbpfError::MapSize {
                map: maps::POLICY,
                size: 10,
                ..
            },
        ) => {
            assert!(e.to_string().contains("NPM_POLICY"), "{e}")
        }
        other => panic!("expected a size error, got {:?}", other.map(|_| ())),
    }
    assert!(!pins.path.join(maps::POLICY).exists(), "nothing pinned");

    let dp = open(&pins, tiny());
    assert_eq!(pinned_max_entries(&pins, maps::POLICY), 64);
    assert_eq!(pinned_max_entries(&pins, maps::IPCACHE), 64);
    assert_eq!(pinned_max_entries(&pins, maps::CIDRS), sizes::CIDRS);
    assert_eq!(dp.map_sizes().actual, tiny());
    assert!(dp.map_sizes().pending().is_empty());
    drop(dp);

    // Reopened with other sizes: the pinned maps are adopted with theirs.
    let bigger = MapSizes {
        policy: 4096,
        ..MapSizes::default()
    };
    let mut dp = open(&pins, bigger);
    assert_eq!(pinned_max_entries(&pins, maps::POLICY), 64);
    assert_eq!(dp.map_sizes().configured, bigger);
    assert_eq!(dp.map_sizes().actual.policy, 64);
    assert_eq!(
        dp.map_sizes().pending(),
        vec![(maps::POLICY, 64, 4096), (maps::IPCACHE, 64, sizes::IPCACHE)]
    );
    // The capacity reported is the map's own.
    dp.sync_full(&Compiled::default(), &Default::default()).unwrap();
    let fill = dp.map_fill();
    let policy = fill.iter().find(|f| f.map == maps::POLICY).unwrap();
    assert_eq!(policy.capacity, 64);
}

#[test]
fn a_policy_that_does_not_fit_keeps_programmed_verdicts_and_fails_closed() {
    sweep_leftovers();
    let pins = PinDir::new("h15pol");
    let (a, b, c, d) = (
        Dummy::new("h5a"),
        Dummy::new("h5b"),
        Dummy::new("h5c"),
        Dummy::new("h5d"),
    );
    let ifs = ifaces(&[(1, a.ifindex), (2, b.ifindex), (3, c.ifindex), (4, d.ifindex)]);
    let mut dp = open(&pins, tiny());
    let peer = "10.70.1.9";

    // Programmed: a allows 80, b allows 81, c and d nothing yet (isolated).
    let mut s0 = base();
    allow_ports(&mut s0, 1, 300, [80]);
    allow_ports(&mut s0, 2, 300, [81]);
    assert!(dp.fit(None, &s0).unwrap().is_none(), "fits");
    dp.sync_full(&s0, &ifs).unwrap();
    assert_eq!(verdict(&dp, a.ifindex, peer, "10.70.0.1", 80), VERDICT_ALLOW);
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 81), VERDICT_ALLOW);

    // Wanted: b adds 70 ports, c 100, d 1: 173 keys for 64.
    let mut s1 = base();
    allow_ports(&mut s1, 1, 300, [80]);
    allow_ports(&mut s1, 4, 300, [82]);
    allow_ports(&mut s1, 2, 300, std::iter::once(81).chain(1000..1070));
    allow_ports(&mut s1, 3, 300, 2000..2100);
    // A new peer address too: everything but the allows that do not fit
    // is programmed.
    ip(&mut s1, "10.70.1.10", 300, 0);
    // Written whole, the kernel refuses it, naming the map.
    let whole = dp.apply_diff(&s0.diff(&s1), &s1, &ifs).unwrap_err();
    assert_eq!(whole.full_map(), Some(maps::POLICY), "{whole}");
    // (A failed write: the next write is a full sync of the fitted state;
    // the map is full of b's new keys, so the sync removes them first.)
    let fitted = dp.fit(Some(&s0), &s1).unwrap().expect("does not fit");
    let [short] = fitted.shortfalls.as_slice() else {
        panic!("{:?}", fitted.shortfalls)
    };
    assert_eq!((short.map, short.needed, short.capacity), (maps::POLICY, 173, 64));
    // c (100 keys) and b (70) are degraded, d (1 new key) is not.
    assert_eq!((short.degraded, short.programmed), (2, 3));
    assert!(short.to_string().contains("NPM_POLICY"), "{short}");
    let f1 = fitted.compiled;
    dp.sync_full(&f1, &ifs).unwrap();
    // Programmed verdicts unchanged, the rest of the change programmed:
    assert_eq!(verdict(&dp, a.ifindex, peer, "10.70.0.1", 80), VERDICT_ALLOW);
    assert_eq!(verdict(&dp, d.ifindex, peer, "10.70.0.4", 82), VERDICT_ALLOW);
    assert_eq!(verdict(&dp, a.ifindex, "10.70.1.10", "10.70.0.1", 80), VERDICT_ALLOW);
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 81), VERDICT_ALLOW);
    // What did not fit fails closed: b's new port, any port of c (isolated,
    // never "not isolated"), and what nobody allows.
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 1000), VERDICT_DROP);
    assert_eq!(verdict(&dp, c.ifindex, peer, "10.70.0.3", 2000), VERDICT_DROP);
    assert_eq!(verdict(&dp, c.ifindex, peer, "10.70.0.3", 9), VERDICT_DROP);
    assert_eq!(verdict(&dp, a.ifindex, peer, "10.70.0.1", 9), VERDICT_DROP);

    // A policy revoked while degraded is revoked: b drops 81.
    let mut s2 = s1.clone();
    let b_subject = s2.endpoints[&2].identity;
    s2.policy.retain(|e, _| !(e.subject == b_subject && e.ports.0 == 81));
    let f2 = dp.fit(Some(&f1), &s2).unwrap().expect("still too big").compiled;
    dp.apply(&f1.diff(&f2), &f2, &ifs).unwrap();
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 81), VERDICT_DROP);

    // Shrunk to fit (b 30 ports, c 20): the whole state, by an ordinary diff.
    let mut s3 = base();
    allow_ports(&mut s3, 1, 300, [80]);
    allow_ports(&mut s3, 4, 300, [82]);
    allow_ports(&mut s3, 2, 300, 1000..1030);
    allow_ports(&mut s3, 3, 300, 2000..2020);
    ip(&mut s3, "10.70.1.10", 300, 0);
    assert!(dp.fit(Some(&f2), &s3).unwrap().is_none(), "fits again");
    dp.apply(&f2.diff(&s3), &s3, &ifs).unwrap();
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 1000), VERDICT_ALLOW);
    assert_eq!(verdict(&dp, c.ifindex, peer, "10.70.0.3", 2019), VERDICT_ALLOW);
    let (v, reason) = dp
        .test_run(IN, c.ifindex, &v4(peer, "10.70.0.3", L4::Tcp(40001, 2020, 0x02)))
        .unwrap();
    assert_eq!((v, reason), (VERDICT_DROP, Some(Reason::PolicyDenied)));

    // Nearly full (52 keys of 64) and 30 keys replaced: the final state
    // fits but not beside the old one; the removals go first.
    let mut s4 = s3.clone();
    s4.policy.retain(|e, _| e.subject != b_subject);
    allow_ports(&mut s4, 2, 300, 1100..1130);
    assert!(!dp.diff_fits(&s3.diff(&s4)).unwrap());
    assert!(dp.fit(Some(&s3), &s4).unwrap().is_none(), "the final state fits");
    dp.apply(&s3.diff(&s4), &s4, &ifs).unwrap();
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 1100), VERDICT_ALLOW);
    assert_eq!(verdict(&dp, b.ifindex, peer, "10.70.0.2", 1000), VERDICT_DROP);
    assert_eq!(verdict(&dp, d.ifindex, peer, "10.70.0.4", 82), VERDICT_ALLOW);
}

#[test]
fn an_address_that_does_not_fit_never_keeps_another_identity() {
    sweep_leftovers();
    let pins = PinDir::new("h15ip");
    let a = Dummy::new("h5i");
    let ifs = ifaces(&[(1, a.ifindex)]);
    let mut dp = open(&pins, tiny());
    // a allows identity 300 on 80; 10.71.0.0/24 hold 60 addresses of 300.
    let mut s0 = Compiled::default();
    s0.endpoints
        .insert(1, endpoint("a", 256, Some("10.70.0.1"), None, true, false));
    ip(&mut s0, "10.70.0.1", 256, 0);
    for i in 1..=60 {
        ip(&mut s0, &format!("10.71.0.{i}"), 300, 0);
    }
    allow_ports(&mut s0, 1, 300, [80]);
    dp.sync_full(&s0, &ifs).unwrap();
    assert_eq!(verdict(&dp, a.ifindex, "10.71.0.7", "10.70.0.1", 80), VERDICT_ALLOW);

    // 10 new addresses (3 too many), and 10.71.0.7 now belongs to a pod of
    // identity 301, which a does not allow.
    let mut s1 = s0.clone();
    for i in 1..=10 {
        ip(&mut s1, &format!("10.72.0.{i}"), 300, 0);
    }
    ip(&mut s1, "10.71.0.7", 301, 0);
    let fitted = dp.fit(Some(&s0), &s1).unwrap().expect("does not fit");
    let [short] = fitted.shortfalls.as_slice() else {
        panic!("{:?}", fitted.shortfalls)
    };
    assert_eq!(
        (short.map, short.needed, short.capacity, short.degraded),
        (maps::IPCACHE, 71, 64, 7)
    );
    let f1 = fitted.compiled;
    dp.apply(&s0.diff(&f1), &f1, &ifs).unwrap();
    // The new owner's identity, never the old one's.
    assert_eq!(verdict(&dp, a.ifindex, "10.71.0.7", "10.70.0.1", 80), VERDICT_DROP);
    // The new addresses that fit are programmed; those that did not are
    // unknown (outside the cluster: no pod identity, nothing allows them).
    let known: Vec<_> = (1..=10)
        .filter(|i| f1.ipcache.contains_key(&format!("10.72.0.{i}").parse().unwrap()))
        .collect();
    assert_eq!(known.len(), 3, "{known:?}");
    for i in 1..=10 {
        let want = if known.contains(&i) {
            VERDICT_ALLOW
        } else {
            VERDICT_DROP
        };
        assert_eq!(
            verdict(&dp, a.ifindex, &format!("10.72.0.{i}"), "10.70.0.1", 80),
            want,
            "10.72.0.{i}"
        );
    }
    // Ten old addresses go: everything fits again.
    let mut s2 = s1.clone();
    for i in 41..=50 {
        s2.ipcache.remove(&format!("10.71.0.{i}").parse().unwrap());
    }
    assert!(dp.fit(Some(&f1), &s2).unwrap().is_none());
    dp.apply(&f1.diff(&s2), &s2, &ifs).unwrap();
    for i in 1..=10 {
        assert_eq!(
            verdict(&dp, a.ifindex, &format!("10.72.0.{i}"), "10.70.0.1", 80),
            VERDICT_ALLOW
        );
    }
    // With a ClusterNetworkPolicy compiled, the ipcache is never trimmed:
    // an admin Deny of identity 300 would no longer match a left-out
    // address of 300, and the NetworkPolicy allow would then let it in.
    let mut s3 = s2.clone();
    let subject = s3.endpoints[&1].identity;
    s3.tiers.insert(
        TierEntry {
            subject,
            direction: IN,
            tier: Tier::Admin,
            peer: 300,
            protocol: None,
            ports: (0, 65535),
        },
        TierValue {
            action: TierAction::Deny,
            rank: 1,
            rule: 0,
        },
    );
    for i in 11..=30 {
        ip(&mut s3, &format!("10.72.0.{i}"), 300, 0);
    }
    assert!(
        dp.fit(Some(&s2), &s3).unwrap().is_none(),
        "with tiers compiled the ipcache must not be trimmed"
    );
}
