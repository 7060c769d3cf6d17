//! Per-rule and per-endpoint counters of the eBPF datapath:
//! real TCP connections and UDP flows across a veth into a pod netns. The
//! packet that a policy decision allows (the first of each new connection,
//! decided by a lookup) moves its rule's slot of
//! `NPM_RULE_COUNT` by exactly the packets and bytes it moves the `policy`
//! reason counter; the other rule's slot does not move; tracked packets
//! move neither; packets NetworkPolicy denies move the endpoint's slot of
//! `NPM_EP_DENIES` like the `policy-denied` reason counter. Both the IPv4
//! fast path and the general path. Needs root.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::Duration;

use crate::ebpf_common::*;
use npm_common::{endpoint_deny_slot, rule_slot, Reason, DIR_INGRESS, RULE_SLOTS};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane};
use npm_dataplane::{Counters, Dataplane, KernelCount};
use npm_policy::model::Protocol::{Tcp, Udp};

const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 8081;
/// Not allowed (and nothing listens): denied by NetworkPolicy.
const DENIED_PORT: u16 = 8089;

/// (packets, bytes) of the counter with key `key` in `list`.
fn of(list: &[KernelCount], key: u32) -> (u64, u64) {
    list.iter()
        .filter(|c| c.key == key)
        .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes))
}

fn reason(c: &Counters, r: Reason) -> (u64, u64) {
    c.by_reason.get(&(DIR_INGRESS, r as u8)).copied().unwrap_or_default()
}

fn minus(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 - b.0, a.1 - b.1)
}

/// A TCP connection to the pod with `lines` lines echoed (tracked packets).
fn connection(net: &PodNet, lines: usize) {
    let s = TcpStream::connect_timeout(&SocketAddr::from((net.pod_ip, TCP_PORT)), Duration::from_secs(3))
        .expect("connect to the pod");
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut r = BufReader::new(s.try_clone().unwrap());
    let mut w = s;
    for i in 0..lines {
        let line = format!("line {i}\n");
        w.write_all(line.as_bytes()).unwrap();
        let mut got = String::new();
        r.read_line(&mut got).unwrap();
        assert_eq!(got, line);
    }
}

fn run(tag: &str, general: bool) {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let mut net = PodNet::new(tag);
    net.start_servers(TCP_PORT, &[UDP_PORT]);
    net.wait_ready(TCP_PORT, UDP_PORT);
    let switches = BenchSwitches {
        no_fast_v4: general,
        no_flow_cache: general,
        ..BenchSwitches::default()
    };
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    // Rule 0: TCP 8080; rule 8193: UDP 8081 (ids as a long-lived agent
    // hands out: slot 1).
    let mut c = pod_policy(&net, &[(Tcp, TCP_PORT)]);
    allow(
        &mut c,
        1,
        npm_policy::compiled::Direction::Ingress,
        300,
        Some(Udp),
        (UDP_PORT, UDP_PORT),
        RULE_SLOTS + 1,
    );
    let (tcp_slot, udp_slot) = (rule_slot(0), rule_slot(RULE_SLOTS + 1));
    assert_ne!(tcp_slot, udp_slot);
    dp.sync_full(&c, &ifaces(&[(1, net.ifindex)])).unwrap();
    // Let packets of the readiness probes still in flight settle.
    std::thread::sleep(Duration::from_millis(200));

    // Three new connections (same peer, same port, each decided anew)
    // with tracked traffic.
    let before = dp.counters().unwrap();
    for _ in 0..3 {
        connection(&net, 4);
    }
    let after = dp.counters().unwrap();
    let policy = minus(reason(&after, Reason::Policy), reason(&before, Reason::Policy));
    assert_eq!(policy.0, 3, "three SYNs decided by policy");
    let tcp_rule = minus(of(&after.rules.allowed, tcp_slot), of(&before.rules.allowed, tcp_slot));
    assert_eq!(
        tcp_rule, policy,
        "the TCP rule counts exactly the policy-decided packets"
    );
    assert!(
        reason(&after, Reason::Tracked).0 - reason(&before, Reason::Tracked).0 >= 3 * 4,
        "tracked packets passed"
    );
    assert_eq!(
        of(&after.rules.allowed, udp_slot),
        of(&before.rules.allowed, udp_slot),
        "the UDP rule did not move"
    );
    assert_eq!(after.rules.rule_modulus, Some(RULE_SLOTS));

    // Two new UDP flows: the UDP rule moves by two packets.
    for _ in 0..2 {
        net.udp_exchange(UDP_PORT, Duration::from_secs(3))
            .expect("udp exchange");
    }
    let after2 = dp.counters().unwrap();
    let policy = minus(reason(&after2, Reason::Policy), reason(&after, Reason::Policy));
    assert_eq!(policy.0, 2);
    assert_eq!(
        minus(of(&after2.rules.allowed, udp_slot), of(&after.rules.allowed, udp_slot)),
        policy
    );
    assert_eq!(of(&after2.rules.allowed, tcp_slot), of(&after.rules.allowed, tcp_slot));

    // Five datagrams to a port no rule allows: the endpoint's deny slot
    // moves like the policy-denied reason.
    let u = UdpSocket::bind((net.peer_ip, 0)).unwrap();
    for _ in 0..5 {
        u.send_to(b"denied", (net.pod_ip, DENIED_PORT)).unwrap();
    }
    std::thread::sleep(Duration::from_millis(100));
    let after3 = dp.counters().unwrap();
    let denied = minus(
        reason(&after3, Reason::PolicyDenied),
        reason(&after2, Reason::PolicyDenied),
    );
    assert_eq!(denied.0, 5);
    let slot = endpoint_deny_slot(1, DIR_INGRESS) >> 1;
    let ingress = |l: &[KernelCount]| {
        l.iter()
            .filter(|c| c.key == slot && c.direction == DIR_INGRESS)
            .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes))
    };
    assert_eq!(
        minus(ingress(&after3.rules.denied), ingress(&after2.rules.denied)),
        denied
    );
    assert_eq!(
        minus(of(&after3.rules.allowed, udp_slot), of(&after2.rules.allowed, udp_slot)),
        (0, 0)
    );
}

#[test]
fn rule_and_endpoint_counters_fast_path() {
    run("rk", false);
}

#[test]
fn rule_and_endpoint_counters_general_path() {
    run("rkg", true);
}
