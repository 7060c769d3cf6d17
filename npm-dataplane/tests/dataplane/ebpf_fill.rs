//! Map fill and lost deny events of the eBPF dataplane, against the
//! kernel: [`EbpfDataplane::map_fill`] reports for each map exactly the
//! entries the pinned map holds (counted here by iterating it), after a
//! full sync and after diffs (policy entries sharing an aligned port block
//! included); conntrack entries created by real test-run packets are
//! counted; and a ring buffer nobody drains makes
//! [`EbpfDataplane::events_lost`] grow, while a drained one does not.
//! Privileged: needs root (bpffs, veths).

use std::time::{Duration, Instant};

use crate::ebpf_common::*;
use aya::maps::lpm_trie::LpmTrie;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use npm_common::{maps, sizes, CtKey4, CtValue, IpInfo, IpKey, PolicyValue, Reason, IDENTITY_FIRST_CIDR};
use npm_dataplane::ebpf::{MapFill, PROG_INGRESS, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Egress as EG, Direction::Ingress as IN};
use npm_policy::model::Protocol::{Tcp, Udp};

fn pinned(pins: &PinDir, name: &str) -> Map {
    let data = MapData::from_pin(pins.path.join(name)).unwrap_or_else(|e| panic!("open pinned {name}: {e}"));
    Map::from_map_data(data).unwrap()
}

/// The entries of a pinned map, counted by iterating its keys.
fn kernel_len(pins: &PinDir, name: &str) -> u64 {
    let map = pinned(pins, name);
    let n = match name {
        maps::IPCACHE => BpfHashMap::<_, IpKey, IpInfo>::try_from(map).unwrap().keys().count(),
        maps::CIDRS => LpmTrie::<_, [u8; 16], u32>::try_from(map).unwrap().keys().count(),
        maps::POLICY => LpmTrie::<_, [u8; npm_common::POLICY_KEY_LEN], PolicyValue>::try_from(map)
            .unwrap()
            .keys()
            .count(),
        maps::CT4 => BpfHashMap::<_, CtKey4, CtValue>::try_from(map).unwrap().keys().count(),
        other => panic!("no kernel count for {other}"),
    };
    n as u64
}

fn fill_of(fill: &[MapFill], map: &str) -> MapFill {
    fill.iter()
        .find(|f| f.map == map)
        .cloned()
        .unwrap_or_else(|| panic!("{map} not reported: {fill:?}"))
}

/// Two endpoints (10.60.0.1, 10.60.0.2), `extra` more addresses, three
/// CIDRs, and policy entries of which two share the aligned block 82-83.
fn compiled(extra: u32) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.60.0.1"), None, true, true));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.60.0.2"), None, true, false));
    ip(&mut c, "10.60.0.1", 256, 0);
    ip(&mut c, "10.60.0.2", 257, 0);
    ip(&mut c, "10.60.1.9", 300, 0);
    for i in 0..extra {
        ip(&mut c, &format!("10.61.{}.{}", i / 250, i % 250 + 1), 300, 0);
    }
    for (n, net) in ["192.168.0.0/16", "192.168.7.0/24", "fd00::/8"].iter().enumerate() {
        c.cidrs.insert(net.parse().unwrap(), IDENTITY_FIRST_CIDR + n as u32);
    }
    allow(&mut c, 1, IN, 300, Some(Tcp), (81, 83), 1);
    allow(&mut c, 1, IN, 300, Some(Tcp), (82, 85), 2);
    allow(&mut c, 1, IN, 300, Some(Tcp), (8080, 8080), 3);
    allow(&mut c, 1, IN, 300, Some(Udp), (53, 53), 4);
    allow(&mut c, 2, IN, 256, None, (0, 65535), 5);
    allow(&mut c, 1, EG, 257, Some(Tcp), (1000, 1999), 6);
    c
}

/// Every writer-counted map equals the kernel's count.
fn assert_counts_match(dp: &npm_dataplane::ebpf::EbpfDataplane, pins: &PinDir, c: &Compiled, what: &str) {
    let fill = dp.map_fill();
    for map in [maps::IPCACHE, maps::CIDRS, maps::POLICY] {
        let f = fill_of(&fill, map);
        assert_eq!(f.entries, kernel_len(pins, map), "{what}: {map}");
    }
    assert_eq!(fill_of(&fill, maps::IPCACHE).entries, c.ipcache.len() as u64, "{what}");
    assert_eq!(fill_of(&fill, maps::CIDRS).entries, c.cidrs.len() as u64, "{what}");
    assert_eq!(
        fill_of(&fill, maps::EP_SLOTS).entries,
        c.endpoints.len() as u64,
        "{what}"
    );
    assert_eq!(fill_of(&fill, maps::ENDPOINTS).entries, 0, "{what}");
}

#[test]
fn map_fill_equals_what_the_kernel_holds() {
    sweep_leftovers();
    let pins = PinDir::new("fill");
    let (a, b) = (Dummy::new("fla"), Dummy::new("flb"));
    let ifs = ifaces(&[(1, a.ifindex), (2, b.ifindex)]);
    let mut dp = pins.open();
    assert!(
        dp.map_fill().iter().all(|f| f.map != maps::POLICY),
        "not known before the first full sync"
    );

    let c1 = compiled(300);
    dp.sync_full(&c1, &ifs).unwrap();
    assert_counts_match(&dp, &pins, &c1, "after the full sync");
    let fill = dp.map_fill();
    let policy = fill_of(&fill, maps::POLICY);
    eprintln!("after the full sync: {fill:?}");
    assert_eq!(policy.capacity, u64::from(sizes::POLICY));
    assert_eq!(fill_of(&fill, maps::IPCACHE).capacity, u64::from(sizes::IPCACHE));
    assert_eq!(fill_of(&fill, maps::IPCACHE).entries, 303);
    assert!(fill_of(&fill, maps::IPCACHE4).entries > 0);

    // Diffs: the entry sharing the 82-83 block goes (its shared key stays),
    // addresses come and go, a CIDR goes.
    let mut c2 = compiled(500);
    c2.policy.retain(|e, _| e.ports != (82, 85));
    c2.cidrs.remove(&"192.168.7.0/24".parse().unwrap());
    for i in 0..100 {
        c2.ipcache.remove(&format!("10.61.0.{}", i + 1).parse().unwrap());
    }
    dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap();
    assert_counts_match(&dp, &pins, &c2, "after removing entries");
    assert!(fill_of(&dp.map_fill(), maps::POLICY).entries < policy.entries);

    let mut c3 = c2.clone();
    allow(&mut c3, 1, IN, 300, Some(Tcp), (82, 85), 2);
    allow(&mut c3, 2, EG, 300, Some(Udp), (5000, 5100), 7);
    dp.apply(&c2.diff(&c3), &c3, &ifs).unwrap();
    assert_counts_match(&dp, &pins, &c3, "after adding entries back");

    // Conntrack: allowed SYNs create entries (counted by iterating, at
    // most every 30 s: ask for a recount).
    assert_eq!(fill_of(&dp.map_fill(), maps::CT4).entries, 0);
    for port in 0..5u16 {
        let syn = v4("10.60.1.9", "10.60.0.1", L4::Tcp(40000 + port, 8080, 0x02));
        assert_eq!(
            dp.test_run(IN, a.ifindex, &syn).unwrap(),
            (VERDICT_ALLOW, Some(Reason::Policy))
        );
    }
    dp.recount_datapath_maps();
    let ct = fill_of(&dp.map_fill(), maps::CT4);
    assert_eq!((ct.entries, ct.capacity), (5, u64::from(sizes::CT)));
    assert_eq!(ct.entries, kernel_len(&pins, maps::CT4));
}

#[test]
fn a_full_ring_buffer_counts_lost_events() {
    sweep_leftovers();
    let pins = PinDir::new("ring");
    let a = Dummy::new("rga");
    let mut dp = pins.open();
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.62.0.1"), None, true, true));
    ip(&mut c, "10.62.0.1", 256, 0);
    ip(&mut c, "10.62.1.9", 300, 0);
    dp.sync_full(&c, &ifaces(&[(1, a.ifindex)])).unwrap();
    let denied = v4("10.62.1.9", "10.62.0.1", L4::Tcp(40000, 8080, 0x02));
    assert_eq!(
        dp.test_run(IN, a.ifindex, &denied).unwrap(),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    // A drained ring loses nothing.
    assert_eq!(dp.poll_deny_events().len(), 1);
    assert_eq!(dp.events_lost().unwrap(), 0);

    // Nobody drains: denied packets until the ring (256 KiB) overflows;
    // the datapath sends at most 32 events per CPU and tick, so this takes
    // a few hundred ticks.
    let start = Instant::now();
    let mut runs = 0u64;
    while dp.events_lost().unwrap() == 0 {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "no event lost after {runs} denied packets"
        );
        dp.bench_run(PROG_INGRESS, a.ifindex, &denied, 100_000).unwrap();
        runs += 100_000;
    }
    let lost = dp.events_lost().unwrap();
    let queued = dp.poll_deny_events().len();
    eprintln!(
        "ring full after {runs} denied packets in {:?}: {queued} events queued, {lost} lost",
        start.elapsed()
    );
    assert!(queued > 1000, "{queued} events in the ring");
    // Drained again: new events fit, the lost count stays (next tick:
    // this CPU's budget of the current one may be spent).
    std::thread::sleep(Duration::from_millis(20));
    dp.test_run(IN, a.ifindex, &denied).unwrap();
    assert_eq!(dp.poll_deny_events().len(), 1);
    assert_eq!(dp.events_lost().unwrap(), lost);
    // The lost slot is no verdict: the reasons' counters are unaffected.
    let counters = dp.counters().unwrap();
    assert!(counters.by_reason.keys().all(|(_, r)| Reason::from_u8(*r).is_some()));
}

#[test]
fn conntrack_fill_at_capacity_and_its_cost() {
    sweep_leftovers();
    let pins = PinDir::new("ctfull");
    let dp = pins.open();
    // Fill NPM_CT4 to its size through the pinned map (as many flows).
    let mut ct4: BpfHashMap<_, CtKey4, CtValue> = BpfHashMap::try_from(pinned(&pins, maps::CT4)).unwrap();
    for i in 0..sizes::CT {
        let key = CtKey4 {
            endpoint: 1 + i / 65_536,
            protocol: 6,
            addr_lo: [10, 64, 0, 1],
            addr_hi: [10, 65, 0, 1],
            port_lo: (i % 65_536) as u16,
            port_hi: 80,
            ..CtKey4::default()
        };
        ct4.insert(key, CtValue::default(), 0).unwrap();
    }
    let start = Instant::now();
    dp.recount_datapath_maps();
    let fill = fill_of(&dp.map_fill(), maps::CT4);
    let took = start.elapsed();
    let in_kernel = kernel_len(&pins, maps::CT4);
    eprintln!(
        "NPM_CT4 with {} entries (capacity {}): counted in {took:?}",
        fill.entries, fill.capacity
    );
    assert_eq!(fill.entries, in_kernel);
    // LRU: inserting the size may evict a few entries early (per-CPU free lists).
    assert!(fill.entries > u64::from(sizes::CT) * 9 / 10, "{fill:?}");
    // Within the interval the count is not taken again.
    let again = Instant::now();
    assert_eq!(fill_of(&dp.map_fill(), maps::CT4), fill);
    assert!(again.elapsed() < took / 4 + Duration::from_millis(5));
}
