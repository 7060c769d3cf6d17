//! The policy front (`NPM_POLICY_FRONT`), through `BPF_PROG_TEST_RUN` on
//! the real program: it decides exactly as the LPM does, the datapath reads
//! it only for endpoint directions whose policy is complete there, and a
//! direction that does not fit (a long port range, a full bucket) stays on
//! the LPM until a full sync can place it. Needs root.

use crate::ebpf_common::*;
use npm_common::{
    policy_front_bucket, policy_front_proto, policy_front_word, Reason, DIR_INGRESS, EP_FRONT_EGRESS,
    EP_FRONT_EXACT_EGRESS, EP_FRONT_EXACT_INGRESS, EP_FRONT_INGRESS, IDENTITY_ANY, IDENTITY_FIRST_CIDR,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Egress as EG, Direction::Ingress as IN};
use npm_policy::model::Protocol::{Sctp, Tcp, Udp};

const POD_B: u32 = 300;
const POD_C: u32 = 301;
const BLOCK: u32 = IDENTITY_FIRST_CIDR + 1;

/// Endpoints 1 (10.0.0.1), 2 (10.0.0.5) and 3 (10.0.0.6), isolated both
/// ways. Endpoint 1's policy fits the front in both directions (exact
/// ports, a 4-port range, any port, any protocol, a CIDR peer, any peer);
/// endpoint 2's ingress has a 1,001-port range, which keeps it on the LPM;
/// endpoint 3's ingress has exact ports only (one probe per identity).
fn compiled() -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, true));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.5"), None, true, true));
    c.endpoints
        .insert(3, endpoint("c", 258, Some("10.0.0.6"), None, true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.5", 257, 0);
    ip(&mut c, "10.0.0.6", 258, 0);
    ip(&mut c, "10.0.0.2", POD_B, 0);
    ip(&mut c, "10.0.0.3", POD_C, 0);
    c.cidrs.insert("192.0.2.0/24".parse().unwrap(), BLOCK);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    allow(&mut c, 1, IN, POD_B, Some(Udp), (5000, 5003), 2);
    allow(&mut c, 1, IN, POD_C, Some(Tcp), (0, u16::MAX), 3);
    allow(&mut c, 1, IN, BLOCK, Some(Sctp), (9000, 9000), 4);
    allow(&mut c, 1, IN, IDENTITY_ANY, Some(Tcp), (443, 443), 5);
    allow(&mut c, 1, EG, POD_B, None, (0, 0), 6);
    allow(&mut c, 1, EG, POD_C, Some(Udp), (53, 53), 7);
    allow(&mut c, 2, IN, POD_B, Some(Tcp), (1000, 2000), 8);
    allow(&mut c, 2, IN, POD_C, Some(Tcp), (22, 22), 9);
    allow(&mut c, 3, IN, POD_B, Some(Tcp), (80, 80), 10);
    allow(&mut c, 3, IN, POD_C, Some(Udp), (5000, 5003), 11);
    allow(&mut c, 3, IN, BLOCK, Some(Tcp), (443, 443), 12);
    c
}

/// Words every test's `compiled()` stores: endpoint 1's 1 + 4 + 1 + 1 + 1
/// ingress and 1 + 1 egress, endpoint 2's TCP 22 (stored, though its
/// direction stays on the LPM), endpoint 3's 1 + 4 + 1.
const WORDS: usize = 17;

struct Fixture {
    dp: EbpfDataplane,
    a: Dummy,
    b: Dummy,
    c: Dummy,
    pins: PinDir,
}

fn fixture(tag: &str, c: &Compiled, switches: BenchSwitches) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let a = Dummy::new(&format!("{tag}a"));
    let b = Dummy::new(&format!("{tag}b"));
    let d = Dummy::new(&format!("{tag}c"));
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    dp.sync_full(c, &ifaces(&[(1, a.ifindex), (2, b.ifindex), (3, d.ifindex)]))
        .unwrap();
    Fixture { dp, a, b, c: d, pins }
}

impl Fixture {
    fn ifs(&self) -> std::collections::BTreeMap<u32, u32> {
        ifaces(&[(1, self.a.ifindex), (2, self.b.ifindex), (3, self.c.ifindex)])
    }

    fn flags(&self, id: u32) -> u32 {
        record_flags(&self.dp, id)
    }
}

/// A new connection (or datagram) from `src` to `dst`; protocol 0 stands
/// for a TCP ACK without a conntrack entry (decided by policy after the
/// conntrack lookup misses).
fn packet(src: &str, dst: &str, proto: u8, sport: u16, dport: u16) -> Vec<u8> {
    match proto {
        0 => v4(src, dst, L4::Tcp(sport, dport, 0x10)),
        6 => v4(src, dst, L4::Tcp(sport, dport, 0x02)),
        17 => v4(src, dst, L4::Udp(sport, dport)),
        132 => v4(src, dst, L4::Sctp(sport, dport)),
        _ => v4(src, dst, L4::Icmp(8, sport)),
    }
}

#[test]
fn the_front_decides_as_the_lpm_does() {
    let c = compiled();
    let front = fixture("fa", &c, BenchSwitches::default());
    let lpm = fixture(
        "fl",
        &c,
        BenchSwitches {
            no_policy_front: true,
            ..BenchSwitches::default()
        },
    );
    // Which directions the front holds.
    let f1 = front.flags(1);
    assert_eq!(
        f1 & (EP_FRONT_INGRESS | EP_FRONT_EGRESS),
        EP_FRONT_INGRESS | EP_FRONT_EGRESS
    );
    assert_eq!(
        f1 & (EP_FRONT_EXACT_INGRESS | EP_FRONT_EXACT_EGRESS),
        0,
        "wildcards both ways"
    );
    let f2 = front.flags(2);
    assert_eq!(f2 & EP_FRONT_INGRESS, 0, "a 1,001-port range stays on the LPM");
    assert_ne!(f2 & EP_FRONT_EGRESS, 0);
    let f3 = front.flags(3);
    assert_eq!(
        f3 & (EP_FRONT_INGRESS | EP_FRONT_EXACT_INGRESS),
        EP_FRONT_INGRESS | EP_FRONT_EXACT_INGRESS
    );
    assert_eq!(front.dp.policy_front_len(), WORDS);
    assert_eq!(kernel_front_words(&front.pins.path), WORDS);

    let peers = ["10.0.0.2", "10.0.0.3", "192.0.2.7", "198.51.100.9"];
    let protos = [6u8, 0, 17, 132, 1];
    let ports = [
        22u16, 80, 81, 443, 999, 1000, 1500, 2000, 2001, 4999, 5000, 5003, 5004, 9000,
    ];
    let mut sport = 20000u16;
    let mut rows = 0;
    let mut allowed = 0;
    for peer in peers {
        for proto in protos {
            for port in ports {
                // (direction, interface on each side, source, destination)
                let cases = [
                    (IN, front.a.ifindex, lpm.a.ifindex, peer, "10.0.0.1"),
                    (EG, front.a.ifindex, lpm.a.ifindex, "10.0.0.1", peer),
                    (IN, front.b.ifindex, lpm.b.ifindex, peer, "10.0.0.5"),
                    (IN, front.c.ifindex, lpm.c.ifindex, peer, "10.0.0.6"),
                ];
                for (dir, fi, li, src, dst) in cases {
                    sport += 1;
                    let pkt = packet(src, dst, proto, sport, port);
                    let got = front.dp.test_run(dir, fi, &pkt).unwrap();
                    let want = lpm.dp.test_run(dir, li, &pkt).unwrap();
                    assert_eq!(
                        got, want,
                        "{dir:?} {src} -> {dst} proto {proto} port {port}: front {got:?}, LPM {want:?}"
                    );
                    rows += 1;
                    allowed += usize::from(got.0 == VERDICT_ALLOW);
                }
            }
        }
    }
    assert_eq!(rows, 4 * 5 * 14 * 4);
    // Spot checks that the table decides both ways.
    let run = |dir, ifindex, pkt: Vec<u8>| front.dp.test_run(dir, ifindex, &pkt).unwrap().0;
    let a = front.a.ifindex;
    assert_eq!(run(IN, a, packet("10.0.0.2", "10.0.0.1", 6, 1, 80)), VERDICT_ALLOW);
    assert_eq!(run(IN, a, packet("10.0.0.2", "10.0.0.1", 6, 1, 81)), VERDICT_DROP);
    assert_eq!(run(IN, a, packet("10.0.0.2", "10.0.0.1", 17, 1, 5003)), VERDICT_ALLOW);
    assert_eq!(run(IN, a, packet("10.0.0.2", "10.0.0.1", 17, 1, 5004)), VERDICT_DROP);
    assert_eq!(run(IN, a, packet("10.0.0.3", "10.0.0.1", 6, 1, 4999)), VERDICT_ALLOW);
    assert_eq!(run(IN, a, packet("10.0.0.3", "10.0.0.1", 17, 1, 4999)), VERDICT_DROP);
    assert_eq!(run(IN, a, packet("192.0.2.7", "10.0.0.1", 132, 1, 9000)), VERDICT_ALLOW);
    assert_eq!(run(IN, a, packet("198.51.100.9", "10.0.0.1", 6, 1, 443)), VERDICT_ALLOW);
    assert_eq!(run(EG, a, packet("10.0.0.1", "10.0.0.2", 1, 1, 0)), VERDICT_ALLOW);
    assert_eq!(run(EG, a, packet("10.0.0.1", "10.0.0.3", 1, 1, 0)), VERDICT_DROP);
    let c3 = front.c.ifindex;
    assert_eq!(run(IN, c3, packet("10.0.0.2", "10.0.0.6", 0, 2, 80)), VERDICT_ALLOW);
    assert_eq!(run(IN, c3, packet("192.0.2.7", "10.0.0.6", 6, 2, 443)), VERDICT_ALLOW);
    assert_eq!(run(IN, c3, packet("10.0.0.2", "10.0.0.6", 17, 2, 80)), VERDICT_DROP);
    assert_eq!(run(IN, c3, packet("10.0.0.3", "10.0.0.6", 1, 2, 0)), VERDICT_DROP);
    assert!(allowed > 40 && allowed < rows - 40, "{allowed} of {rows} allowed");
}

#[test]
fn complete_directions_are_decided_by_the_front() {
    let c = compiled();
    let mut f = fixture("fd", &c, BenchSwitches::default());
    let to_a = |sport, port| packet("10.0.0.2", "10.0.0.1", 6, sport, port);
    let to_b = |sport, port| packet("10.0.0.2", "10.0.0.5", 6, sport, port);
    assert_eq!(f.dp.test_run(IN, f.a.ifindex, &to_a(1, 80)).unwrap().0, VERDICT_ALLOW);
    assert_eq!(f.dp.test_run(IN, f.b.ifindex, &to_b(1, 1500)).unwrap().0, VERDICT_ALLOW);
    // The LPM loses every entry behind the loader's back; with the decision
    // cache emptied, endpoint 1 (complete in the front) is still decided
    // by the front, endpoint 2 (on the LPM) no longer finds its rule.
    drop_policy_entries(&f.pins.path);
    f.dp.bump_generation().unwrap();
    assert_eq!(
        f.dp.test_run(IN, f.a.ifindex, &to_a(2, 80)).unwrap(),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    assert_eq!(
        f.dp.test_run(IN, f.b.ifindex, &to_b(2, 1500)).unwrap(),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );

    // Incremental changes keep the front exact: a new rule is allowed at
    // once, a removed one denied at once (its words left the front).
    let ifs = f.ifs();
    f.dp.sync_full(&c, &ifs).unwrap();
    let mut c1 = c.clone();
    allow(&mut c1, 1, IN, POD_B, Some(Tcp), (8080, 8080), 9);
    c1.policy
        .retain(|e, _| !(e.subject == subject_of(&c, 1) && e.ports == (80, 80)));
    f.dp.apply(&c.diff(&c1), &c1, &ifs).unwrap();
    assert_eq!(f.dp.policy_front_len(), WORDS);
    assert_eq!(kernel_front_words(&f.pins.path), WORDS);
    assert_ne!(f.flags(1) & EP_FRONT_INGRESS, 0);
    assert_eq!(
        f.dp.test_run(IN, f.a.ifindex, &to_a(3, 8080)).unwrap(),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    assert_eq!(
        f.dp.test_run(IN, f.a.ifindex, &to_a(4, 80)).unwrap(),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    // Removing the endpoint's entries removes its words.
    let mut c2 = c1.clone();
    c2.policy.retain(|e, _| e.subject != subject_of(&c, 1));
    f.dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap();
    assert_eq!(f.dp.policy_front_len(), WORDS - 10);
    assert_eq!(kernel_front_words(&f.pins.path), WORDS - 10);
}

/// The subject (pod identity) of endpoint 1 in the full-bucket test.
const A_SUBJECT: u32 = 256;

/// `n` peer identities whose words for (endpoint 1's subject
/// [`A_SUBJECT`], ingress, TCP 80) share one bucket of the front.
fn colliding_identities(n: usize) -> Vec<u32> {
    let word = |id: u32| policy_front_word(A_SUBJECT, DIR_INGRESS, id, policy_front_proto(6), true, 80);
    let mut by_bucket: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
    for id in 1000..2_000_000u32 {
        let v = by_bucket
            .entry(policy_front_bucket(word(id), npm_common::POLICY_FRONT_SHIFT))
            .or_default();
        v.push(id);
        if v.len() == n {
            return v.clone();
        }
    }
    panic!("no {n} identities share a bucket");
}

#[test]
fn a_full_bucket_keeps_the_direction_on_the_lpm_until_a_sync_places_it() {
    let ids = colliding_identities(5);
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", A_SUBJECT, Some("10.0.0.1"), None, true, true));
    c.endpoints
        .insert(2, endpoint("b", 257, Some("10.0.0.5"), None, true, true));
    for (i, id) in ids.iter().enumerate() {
        ip(&mut c, &format!("10.0.1.{}", i + 1), *id, 0);
        allow(&mut c, 1, IN, *id, Some(Tcp), (80, 80), i as u32);
    }
    let mut f = fixture("fb", &c, BenchSwitches::default());
    let from = |i: usize, sport| packet(&format!("10.0.1.{}", i + 1), "10.0.0.1", 6, sport, 80);
    // Four words fit the bucket, the fifth does not: ingress stays on the
    // LPM, which allows all five.
    assert_eq!(f.dp.policy_front_len(), 4);
    assert_eq!(f.flags(1) & EP_FRONT_INGRESS, 0);
    for i in 0..5 {
        assert_eq!(
            f.dp.test_run(IN, f.a.ifindex, &from(i, 1)).unwrap(),
            (VERDICT_ALLOW, Some(Reason::Policy)),
            "peer {i}"
        );
    }
    // One rule goes: the incremental apply removes its word but does not
    // retry the one left out; the next full sync places it, and the
    // direction moves to the front.
    let ifs = f.ifs();
    let mut c1 = c.clone();
    let gone = ids[0];
    c1.policy.retain(|e, _| e.peer != gone);
    f.dp.apply(&c.diff(&c1), &c1, &ifs).unwrap();
    assert_eq!(f.flags(1) & EP_FRONT_INGRESS, 0);
    f.dp.sync_full(&c1, &ifs).unwrap();
    assert_eq!(f.dp.policy_front_len(), 4);
    assert_ne!(f.flags(1) & EP_FRONT_INGRESS, 0);
    assert_ne!(f.flags(1) & EP_FRONT_EXACT_INGRESS, 0);
    assert_eq!(
        f.dp.test_run(IN, f.a.ifindex, &from(0, 2)).unwrap(),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    for i in 1..5 {
        assert_eq!(
            f.dp.test_run(IN, f.a.ifindex, &from(i, 2)).unwrap(),
            (VERDICT_ALLOW, Some(Reason::Policy)),
            "peer {i}"
        );
    }
    // Proof that the front now decides: the LPM loses its entries, the
    // four peers are still allowed.
    drop_policy_entries(&f.pins.path);
    f.dp.bump_generation().unwrap();
    for i in 1..5 {
        assert_eq!(
            f.dp.test_run(IN, f.a.ifindex, &from(i, 3)).unwrap(),
            (VERDICT_ALLOW, Some(Reason::Policy)),
            "peer {i}"
        );
    }
}

#[test]
fn a_restarted_loader_adopts_the_front() {
    let c = compiled();
    let f = fixture("fp", &c, BenchSwitches::default());
    assert_eq!(f.dp.adopted_counts(), (0, 0), "fresh pins");
    let ifs = f.ifs();
    let Fixture { dp, a, b, c: d, pins } = f;
    drop(dp);
    // A new loader on the same pins learns the stored words, and a full
    // sync keeps exactly the wanted ones: endpoint 1's "any protocol"
    // egress word for POD_B goes, its UDP 53 word for POD_C stays (so the
    // direction stays on the front, and the front decides).
    let mut dp = EbpfDataplane::open(pins.options()).unwrap();
    assert_eq!(dp.policy_front_len(), WORDS);
    // What the agent's mass-deletion guard starts from: 5 pod identities
    // (3 endpoints' own, POD_B, POD_C) and 3 endpoints.
    assert_eq!(dp.adopted_counts(), (5, 3));
    let mut c1 = c.clone();
    c1.policy
        .retain(|e, _| !(e.subject == subject_of(&c, 1) && e.direction == EG && e.peer == POD_B));
    dp.sync_full(&c1, &ifs).unwrap();
    assert_eq!(dp.policy_front_len(), WORDS - 1);
    assert_eq!(kernel_front_words(&pins.path), WORDS - 1);
    let flags = dp.dump().unwrap().endpoints.iter().find(|e| e.id == 1).unwrap().flags;
    assert_ne!(flags & EP_FRONT_EGRESS, 0);
    assert_eq!(
        dp.test_run(IN, a.ifindex, &packet("10.0.0.2", "10.0.0.1", 6, 5, 80))
            .unwrap(),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    assert_eq!(
        dp.test_run(EG, a.ifindex, &packet("10.0.0.1", "10.0.0.2", 6, 5, 80))
            .unwrap(),
        (VERDICT_DROP, Some(Reason::PolicyDenied))
    );
    assert_eq!(
        dp.test_run(EG, a.ifindex, &packet("10.0.0.1", "10.0.0.3", 17, 5, 53))
            .unwrap(),
        (VERDICT_ALLOW, Some(Reason::Policy))
    );
    drop((b, d));
}
