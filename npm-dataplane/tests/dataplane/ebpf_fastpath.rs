//! The datapath's fast paths, through `BPF_PROG_TEST_RUN` on the real
//! program: the endpoint slot array and its overflow hash for large
//! ifindexes, the per-CPU flow cache in front of the IPv4 conntrack map, and
//! TCP SYNs that are always decided by policy. Needs root.
//!
//! The flow cache is per CPU, so the flow-cache tests pin their thread to
//! one CPU: every test run of a test then uses the same cache.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::ebpf_common::*;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use npm_common::{maps, CtKey4, CtValue, Reason, CT_CLOSING};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Egress as EG, Direction::Ingress as IN};
use npm_policy::model::Protocol::Tcp;

const POD_B: u32 = 300;

/// Endpoint 1 (10.0.0.1, isolated both ways) admitting POD_B (10.0.0.2) on
/// TCP 80.
fn compiled() -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.2", POD_B, 0);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    c
}

/// Pins the calling thread to its current CPU (test runs execute on the
/// caller's CPU, and the flow cache is per CPU).
fn pin_to_one_cpu() {
    // SAFETY: plain libc calls on a zeroed cpu_set_t we own.
    unsafe {
        let cpu = libc::sched_getcpu();
        assert!(cpu >= 0, "sched_getcpu failed");
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu as usize, &mut set);
        assert_eq!(
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set),
            0,
            "sched_setaffinity: {}",
            std::io::Error::last_os_error()
        );
    }
}

/// Deletes every `NPM_CT4` entry through the pinned map, as an LRU eviction
/// would, behind the loader's back.
fn drop_ipv4_conntrack(pin_dir: &Path) {
    let data = MapData::from_pin(pin_dir.join(maps::CT4)).expect("open pinned NPM_CT4");
    let mut ct: BpfHashMap<MapData, CtKey4, CtValue> =
        BpfHashMap::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_CT4");
    let keys: Vec<CtKey4> = ct.keys().map(|k| k.expect("key")).collect();
    assert!(!keys.is_empty(), "no conntrack entry to drop");
    for k in keys {
        ct.remove(&k).expect("remove conntrack entry");
    }
}

struct Fixture {
    dp: EbpfDataplane,
    ep: Dummy,
    pins: PinDir,
}

fn fixture(tag: &str) -> Fixture {
    fixture_with(tag, BenchSwitches::default())
}

fn fixture_with(tag: &str, switches: BenchSwitches) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let ep = Dummy::new(&format!("{tag}a"));
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    dp.sync_full(&compiled(), &ifaces(&[(1, ep.ifindex)])).unwrap();
    Fixture { dp, ep, pins }
}

fn run(f: &Fixture, dir: npm_policy::compiled::Direction, pkt: &[u8]) -> (i32, Option<Reason>) {
    f.dp.test_run(dir, f.ep.ifindex, pkt).unwrap()
}

/// SYN in, SYN-ACK out, ACK in: the connection is established and, after
/// the ACK's conntrack hit, in this CPU's flow cache. Returns the ACK and
/// when the cache slot was filled.
fn establish(f: &Fixture, sport: u16) -> (Vec<u8>, Instant) {
    let syn = v4("10.0.0.2", "10.0.0.1", L4::Tcp(sport, 80, 0x02));
    assert_eq!(run(f, IN, &syn), (VERDICT_ALLOW, Some(Reason::Policy)));
    let synack = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, sport, 0x12));
    assert_eq!(run(f, EG, &synack), (VERDICT_ALLOW, Some(Reason::Tracked)));
    let ack = v4("10.0.0.2", "10.0.0.1", L4::Tcp(sport, 80, 0x10));
    assert_eq!(run(f, IN, &ack), (VERDICT_ALLOW, Some(Reason::Tracked)));
    (ack, Instant::now())
}

/// Removes the TCP 80 rule, so only conntrack (or the cache) admits the
/// connection's packets.
fn remove_rule(f: &mut Fixture) {
    let c0 = compiled();
    let mut c1 = c0.clone();
    c1.policy.clear();
    f.dp.apply(&c0.diff(&c1), &c1, &ifaces(&[(1, f.ep.ifindex)])).unwrap();
}

#[test]
fn flow_cache_vouches_for_a_lost_entry_at_most_its_ttl() {
    pin_to_one_cpu();
    let mut f = fixture("fc");
    let (ack, filled) = establish(&f, 41001);
    remove_rule(&mut f);
    // The established flow keeps flowing (policy changes do not cut it).
    assert_eq!(run(&f, IN, &ack), (VERDICT_ALLOW, Some(Reason::Tracked)));
    // The conntrack entry disappears (as by LRU eviction).
    drop_ipv4_conntrack(&f.pins.path);
    let first = run(&f, IN, &ack);
    if filled.elapsed() < Duration::from_millis(200) {
        // Only the flow cache can still know the flow.
        assert_eq!(first, (VERDICT_ALLOW, Some(Reason::Tracked)), "flow cache hit expected");
    }
    // Past the 250 ms TTL the packet takes the conntrack path: no entry, no
    // rule, dropped.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(run(&f, IN, &ack), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    assert_eq!(f.dp.ct_len(), 0);
}

#[test]
fn fin_and_rst_leave_the_flow_cache() {
    pin_to_one_cpu();
    let mut f = fixture("ff");
    let (_, _) = establish(&f, 41002);
    remove_rule(&mut f);
    // A FIN is decided by conntrack (it marks the entry closing) and empties
    // the flow's cache slot.
    let fin = v4("10.0.0.2", "10.0.0.1", L4::Tcp(41002, 80, 0x11));
    assert_eq!(run(&f, IN, &fin), (VERDICT_ALLOW, Some(Reason::Tracked)));
    let ct = f.dp.ct_entries();
    assert_eq!(ct.len(), 1);
    assert_ne!(ct[0].1.flags & CT_CLOSING, 0);
    // Without the conntrack entry the next ACK is no longer admitted: the
    // cache slot is gone with the FIN (no 250 ms grace).
    drop_ipv4_conntrack(&f.pins.path);
    let ack = v4("10.0.0.2", "10.0.0.1", L4::Tcp(41002, 80, 0x10));
    assert_eq!(run(&f, IN, &ack), (VERDICT_DROP, Some(Reason::PolicyDenied)));

    // Same with a RST on another connection.
    let mut f = fixture("fr");
    let (_, _) = establish(&f, 41003);
    remove_rule(&mut f);
    let rst = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 41003, 0x04));
    assert_eq!(run(&f, EG, &rst), (VERDICT_ALLOW, Some(Reason::Tracked)));
    drop_ipv4_conntrack(&f.pins.path);
    let ack = v4("10.0.0.2", "10.0.0.1", L4::Tcp(41003, 80, 0x10));
    assert_eq!(run(&f, IN, &ack), (VERDICT_DROP, Some(Reason::PolicyDenied)));
}

#[test]
fn flows_that_saw_no_reply_are_not_cached() {
    pin_to_one_cpu();
    let mut f = fixture("fn");
    // UDP from the peer, never answered: tracked, but not established.
    let mut c = compiled();
    allow(
        &mut c,
        1,
        IN,
        POD_B,
        Some(npm_policy::model::Protocol::Udp),
        (53, 53),
        2,
    );
    f.dp.apply(&compiled().diff(&c), &c, &ifaces(&[(1, f.ep.ifindex)]))
        .unwrap();
    let q = v4("10.0.0.2", "10.0.0.1", L4::Udp(41004, 53));
    assert_eq!(run(&f, IN, &q), (VERDICT_ALLOW, Some(Reason::Policy)));
    assert_eq!(run(&f, IN, &q), (VERDICT_ALLOW, Some(Reason::Tracked)));
    let mut c2 = c.clone();
    c2.policy.clear();
    f.dp.apply(&c.diff(&c2), &c2, &ifaces(&[(1, f.ep.ifindex)])).unwrap();
    drop_ipv4_conntrack(&f.pins.path);
    // No reply was seen, so no cache slot vouches for it.
    assert_eq!(run(&f, IN, &q), (VERDICT_DROP, Some(Reason::PolicyDenied)));
}

#[test]
fn a_syn_is_decided_by_policy_not_by_an_old_entry() {
    let mut f = fixture("fs");
    let (ack, _) = establish(&f, 41005);
    remove_rule(&mut f);
    // The connection itself keeps flowing...
    assert_eq!(run(&f, IN, &ack), (VERDICT_ALLOW, Some(Reason::Tracked)));
    // ...but a SYN of the same 5-tuple opens a new one, which policy denies.
    let syn = v4("10.0.0.2", "10.0.0.1", L4::Tcp(41005, 80, 0x02));
    assert_eq!(run(&f, IN, &syn), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    assert_eq!(run(&f, IN, &ack), (VERDICT_ALLOW, Some(Reason::Tracked)));
}

/// A veth pair whose host side gets the given ifindex.
struct IndexedVeth {
    name: String,
}

impl IndexedVeth {
    fn new(tag: &str, index: u32) -> IndexedVeth {
        let name = format!("npt{}{}", std::process::id(), tag);
        sh_quiet(&["ip", "link", "del", &name]);
        sh(&[
            "ip",
            "link",
            "add",
            "name",
            &name,
            "index",
            &index.to_string(),
            "type",
            "veth",
            "peer",
            "name",
            &format!("{name}x"),
        ]);
        IndexedVeth { name }
    }
}

impl Drop for IndexedVeth {
    fn drop(&mut self) {
        sh_quiet(&["ip", "link", "del", &self.name]);
    }
}

#[test]
fn endpoints_beyond_the_slot_array_use_the_overflow_map() {
    sweep_leftovers();
    let pins = PinDir::new("ov");
    // An ifindex past NPM_EP_SLOTS, unique per test process.
    let big = npm_common::sizes::ENDPOINT_SLOTS + 1000 + std::process::id() % 100_000;
    let _veth = IndexedVeth::new("ovb", big);
    assert_eq!(ifindex_of(&format!("npt{}ovb", std::process::id())), big);
    let small = Dummy::new("ovs");
    assert!(small.ifindex < npm_common::sizes::ENDPOINT_SLOTS);
    let mut dp = pins.open();
    let mut c = compiled();
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.9"), None, true, false));
    allow(&mut c, 2, IN, POD_B, Some(Tcp), (8080, 8080), 3);
    let ifs = ifaces(&[(1, small.ifindex), (2, big)]);
    dp.sync_full(&c, &ifs).unwrap();

    // Both endpoints enforce their own policy.
    let to_b = |port| v4("10.0.0.2", "10.0.0.9", L4::Tcp(42000 + port, port, 0x02));
    let to_a = |port| v4("10.0.0.2", "10.0.0.1", L4::Tcp(42000 + port, port, 0x02));
    assert_eq!(
        dp.test_run(IN, big, &to_b(8080)).unwrap(),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    assert_eq!(
        dp.test_run(IN, big, &to_b(80)).unwrap(),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(
        dp.test_run(IN, small.ifindex, &to_a(80)).unwrap(),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    // Source validation uses the overflow record's address too.
    let spoofed = v4("10.0.0.1", "10.0.0.2", L4::Tcp(1, 2, 0x02));
    assert_eq!(
        dp.test_run(EG, big, &spoofed).unwrap(),
        (VERDICT_DROP, Some(Reason::Spoofed))
    );

    // The dumps (loaded and read-only from the pins) list both.
    for dump in [
        dp.dump().unwrap(),
        npm_dataplane::ebpf::dump_pinned(&pins.path).unwrap(),
    ] {
        let got: Vec<(u32, u32)> = dump.endpoints.iter().map(|e| (e.ifindex, e.id)).collect();
        assert_eq!(got, vec![(small.ifindex, 1), (big, 2)]);
    }

    // Removing each endpoint clears its record: the interface is no
    // endpoint any more (the program stays only where it is attached).
    let mut c2 = c.clone();
    c2.endpoints.clear();
    dp.apply(&c.diff(&c2), &c2, &ifs).unwrap();
    assert!(dp.dump().unwrap().endpoints.is_empty());
    assert_eq!(
        dp.test_run(IN, big, &to_b(80)).unwrap(),
        (VERDICT_ALLOW, Some(Reason::NoEndpoint))
    );
    assert_eq!(
        dp.test_run(IN, small.ifindex, &to_a(81)).unwrap(),
        (VERDICT_ALLOW, Some(Reason::NoEndpoint))
    );
}

#[test]
fn decisions_follow_every_loader_write_at_once() {
    pin_to_one_cpu();
    let mut f = fixture("dw");
    let ifs = ifaces(&[(1, f.ep.ifindex)]);
    let syn = |sport, port| v4("10.0.0.2", "10.0.0.1", L4::Tcp(sport, port, 0x02));
    let c0 = compiled();
    // Allowed, then the rule goes: the very next SYN of the pair is denied.
    assert_eq!(run(&f, IN, &syn(44001, 80)), (VERDICT_ALLOW, Some(Reason::Policy)));
    assert_eq!(run(&f, IN, &syn(44002, 80)), (VERDICT_ALLOW, Some(Reason::Policy)));
    let mut c1 = c0.clone();
    c1.policy.clear();
    f.dp.apply(&c0.diff(&c1), &c1, &ifs).unwrap();
    assert_eq!(run(&f, IN, &syn(44003, 80)), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    // Denied (and cached), then a rule admits it: allowed at once.
    assert_eq!(run(&f, IN, &syn(44004, 81)), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    let mut c2 = c1.clone();
    allow(&mut c2, 1, IN, POD_B, Some(Tcp), (81, 81), 2);
    f.dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap();
    assert_eq!(run(&f, IN, &syn(44005, 81)), (VERDICT_ALLOW, Some(Reason::Policy)));
    // The peer's identity changes (ipcache write only): the decision follows.
    let mut c3 = c2.clone();
    ip(&mut c3, "10.0.0.2", POD_B + 1, 0);
    f.dp.apply(&c2.diff(&c3), &c3, &ifs).unwrap();
    assert_eq!(run(&f, IN, &syn(44006, 81)), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    // The endpoint stops being isolated (endpoint write only): allowed.
    let mut c4 = c3.clone();
    c4.endpoints.get_mut(&1).unwrap().isolated_ingress = false;
    f.dp.apply(&c3.diff(&c4), &c4, &ifs).unwrap();
    assert_eq!(run(&f, IN, &syn(44007, 81)), (VERDICT_ALLOW, Some(Reason::NotIsolated)));
}

#[test]
fn deny_events_are_budgeted_per_cpu_and_tick_while_every_drop_is_counted() {
    let mut f = fixture("eb");
    let _ = f.dp.poll_deny_events();
    let before = f.dp.counters().unwrap();
    let denied = v4("10.0.0.2", "10.0.0.1", L4::Tcp(45001, 81, 0x02));
    const N: u32 = 20_000;
    let t = Instant::now();
    f.dp.bench_run(npm_dataplane::ebpf::PROG_INGRESS, f.ep.ifindex, &denied, N)
        .unwrap();
    let elapsed_ms = t.elapsed().as_millis() as usize;
    let events = f.dp.poll_deny_events();
    // 32 events per CPU and tick; a tick is at least 1 ms (HZ <= 1000), and
    // the run may have moved between the 2 CPUs.
    let bound = 2 * 32 * (elapsed_ms + 2);
    assert!(!events.is_empty(), "some deny events must be sent");
    assert!(
        events.len() <= bound && events.len() < N as usize,
        "{} events for {N} drops in {elapsed_ms} ms (bound {bound})",
        events.len()
    );
    assert!(events
        .iter()
        .all(|e| e.reason == Reason::PolicyDenied as u8 && e.dport == 81));
    let after = f.dp.counters().unwrap();
    let denied = |c: &npm_dataplane::Counters| c.packets(npm_common::DIR_INGRESS, Reason::PolicyDenied);
    let drops = denied(&after) - denied(&before);
    assert_eq!(drops, N as u64, "every dropped packet is counted");
}

/// The `NPM_IPCACHE4` word the loader should write for `addr`.
fn word(addr: &str, identity: u32, cidr_identity: u32) -> u64 {
    let a: std::net::Ipv4Addr = addr.parse().unwrap();
    npm_common::ipcache4_word(
        u32::from_le_bytes(a.octets()),
        npm_common::IpInfo {
            identity,
            cidr_identity,
        },
    )
    .expect("fits a word")
}

/// An address in 10.128.0.0/9 whose `NPM_IPCACHE4` slot is `addr`'s.
fn colliding_with(addr: &str) -> String {
    let a: std::net::Ipv4Addr = addr.parse().unwrap();
    let slot = npm_common::ipcache4_slot(u32::from_le_bytes(a.octets()));
    (0..1u32 << 23)
        .map(|i| std::net::Ipv4Addr::new(10, 128 + (i >> 16) as u8, (i >> 8) as u8, i as u8))
        .find(|c| npm_common::ipcache4_slot(u32::from_le_bytes(c.octets())) == slot)
        .expect("a colliding address in a /9")
        .to_string()
}

#[test]
fn ipcache4_front_follows_every_write_and_collisions_use_the_hash() {
    let mut f = fixture("i4");
    let ifs = ifaces(&[(1, f.ep.ifindex)]);
    let b: std::net::IpAddr = "10.0.0.2".parse().unwrap();
    let syn_from = |src: &str, sport| v4(src, "10.0.0.1", L4::Tcp(sport, 80, 0x02));
    // Written with the hash entry.
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(word("10.0.0.2", POD_B, 0)));
    assert_eq!(f.dp.ipcache4_occupied(), 2);

    // An address sharing the slot stays in the hash only, and is decided
    // by its own identity; the slot keeps its holder.
    let x = colliding_with("10.0.0.2");
    let c0 = compiled();
    let mut c1 = c0.clone();
    ip(&mut c1, &x, POD_B + 1, 0);
    f.dp.apply(&c0.diff(&c1), &c1, &ifs).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(word("10.0.0.2", POD_B, 0)));
    assert_eq!(
        run(&f, IN, &syn_from(&x, 46001)),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(
        run(&f, IN, &syn_from("10.0.0.2", 46002)),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );

    // An identity change rewrites the slot.
    let mut c2 = c1.clone();
    ip(&mut c2, "10.0.0.2", POD_B + 1, 0);
    f.dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(word("10.0.0.2", POD_B + 1, 0)));
    assert_eq!(
        run(&f, IN, &syn_from("10.0.0.2", 46003)),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );

    // An entry that does not fit a word (a CIDR identity past the first
    // 255) empties the slot it held; the hash decides.
    let mut c3 = c2.clone();
    ip(&mut c3, "10.0.0.2", POD_B, npm_common::IDENTITY_FIRST_CIDR + 300);
    f.dp.apply(&c2.diff(&c3), &c3, &ifs).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(0));
    assert_eq!(
        run(&f, IN, &syn_from("10.0.0.2", 46004)),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );

    // Removing the holder empties the slot; the colliding address is still
    // decided right (by the hash), and a full sync gives it the free slot.
    let mut c4 = c3.clone();
    ip(&mut c4, "10.0.0.2", POD_B, 0);
    f.dp.apply(&c3.diff(&c4), &c4, &ifs).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(word("10.0.0.2", POD_B, 0)));
    let mut c5 = c4.clone();
    c5.ipcache.remove(&b);
    f.dp.apply(&c4.diff(&c5), &c5, &ifs).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(0));
    assert_eq!(
        run(&f, IN, &syn_from(&x, 46005)),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    f.dp.sync_full(&c5, &ifs).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(word(&x, POD_B + 1, 0)));
    assert_eq!(
        run(&f, IN, &syn_from(&x, 46006)),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
}

#[test]
fn the_datapath_reads_the_ipcache4_slot_first() {
    let mut f = fixture("i5");
    let b: std::net::IpAddr = "10.0.0.2".parse().unwrap();
    let a: std::net::Ipv4Addr = "10.0.0.2".parse().unwrap();
    let slot = npm_common::ipcache4_slot(u32::from_le_bytes(a.octets()));
    // Behind the loader's back, the slot says the peer has another identity
    // (the hash still says POD_B): the slot decides.
    let data = MapData::from_pin(f.pins.path.join(maps::IPCACHE4)).expect("open pinned NPM_IPCACHE4");
    let mut arr: aya::maps::Array<MapData, u64> =
        aya::maps::Array::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_IPCACHE4");
    arr.set(slot, word("10.0.0.2", POD_B + 7, 0), 0).unwrap();
    let syn = v4("10.0.0.2", "10.0.0.1", L4::Tcp(47001, 80, 0x02));
    assert_eq!(run(&f, IN, &syn), (VERDICT_DROP, Some(Reason::PolicyDenied)));
    // A full sync puts back the entry the hash holds.
    f.dp.sync_full(&compiled(), &ifaces(&[(1, f.ep.ifindex)])).unwrap();
    assert_eq!(f.dp.ipcache4_slot_word(b), Some(word("10.0.0.2", POD_B, 0)));
    assert_eq!(run(&f, IN, &syn), (VERDICT_ALLOW, Some(Reason::Policy)));
}

#[test]
fn an_interface_that_changes_endpoint_carries_only_the_new_endpoints_policy() {
    let mut f = fixture("ow");
    // Endpoint 1 (10.0.0.1) admits POD_B on TCP 80. Then the interface
    // belongs to endpoint 5 (10.0.0.5), which admits POD_B on TCP 81 only.
    let c0 = compiled();
    let mut c1 = Compiled::default();
    c1.endpoints
        .insert(5, endpoint("y", 260, Some("10.0.0.5"), None, true, true));
    ip(&mut c1, "10.0.0.5", 260, 0);
    ip(&mut c1, "10.0.0.2", POD_B, 0);
    allow(&mut c1, 5, IN, POD_B, Some(Tcp), (81, 81), 9);
    let ifs_y = ifaces(&[(5, f.ep.ifindex)]);
    assert_eq!(
        run(&f, IN, &v4("10.0.0.2", "10.0.0.1", L4::Tcp(48001, 80, 0x02))),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    f.dp.apply(&c0.diff(&c1), &c1, &ifs_y).unwrap();
    let dump = f.dp.dump().unwrap();
    let eps: Vec<(u32, u32)> = dump.endpoints.iter().map(|e| (e.ifindex, e.id)).collect();
    assert_eq!(eps, vec![(f.ep.ifindex, 5)]);
    assert_eq!(
        run(&f, IN, &v4("10.0.0.2", "10.0.0.5", L4::Tcp(48002, 80, 0x02))),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(
        run(&f, IN, &v4("10.0.0.2", "10.0.0.5", L4::Tcp(48003, 81, 0x02))),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    // The old address is no longer this endpoint's: spoofed.
    assert_eq!(
        run(&f, EG, &v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 48001, 0x12))),
        (VERDICT_DROP, Some(Reason::Spoofed))
    );
}
