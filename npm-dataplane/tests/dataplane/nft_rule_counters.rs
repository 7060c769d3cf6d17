//! Per-rule and per-endpoint counters of the nftables dataplane,
//! read back from the kernel: real TCP and UDP probes between pod
//! namespaces through the node's table. Each new connection allowed by a
//! rule moves that rule's counters (the anonymous `counter` of every nft
//! rule commented `rule <id>`, IPv4 and IPv6 summed) by exactly what it
//! moves the `policy` reason counter, the other rule's not; a denied probe
//! moves the isolated endpoint's deny counter like `policy-denied`; a
//! rewritten chain's counters restart at 0 and count on. Needs root.

use npm_common::{Reason, DIR_INGRESS};
use npm_dataplane::{Counters, Dataplane, KernelCount};
use npm_policy::compiled::Direction;
use npm_policy::model::Protocol;

use crate::nft_common::allow;
use crate::nft_common::tier_topo::{base, Topo, A, B, C, EP_B, ID_A};

fn sum(list: &[KernelCount], key: u32) -> (u64, u64) {
    list.iter()
        .filter(|c| c.key == key && c.direction == DIR_INGRESS)
        .fold((0, 0), |(p, b), c| (p + c.packets, b + c.bytes))
}

fn reason(c: &Counters, r: Reason) -> (u64, u64) {
    c.by_reason.get(&(DIR_INGRESS, r as u8)).copied().unwrap_or_default()
}

fn delta(a: (u64, u64), b: (u64, u64)) -> (u64, u64) {
    (a.0 - b.0, a.1 - b.1)
}

#[test]
fn nft_rule_and_endpoint_counters() {
    let topo = Topo::new("rcnt");
    let mut dp = topo.dataplane("rcnt");
    let mut c = base();
    c.endpoints.get_mut(&EP_B).unwrap().isolated_ingress = true;
    // Rule 1: a -> b TCP 8000; rule 2: a -> b UDP 9000.
    allow(
        &mut c,
        EP_B,
        Direction::Ingress,
        ID_A,
        Some(Protocol::Tcp),
        (8000, 8000),
    );
    allow(
        &mut c,
        EP_B,
        Direction::Ingress,
        ID_A,
        Some(Protocol::Udp),
        (9000, 9000),
    );
    let (tcp_rule, udp_rule) = (1, 2);
    assert_eq!(c.policy.values().copied().collect::<Vec<_>>(), [tcp_rule, udp_rule]);
    dp.sync_full(&c, &topo.ifs).unwrap();
    let before = dp.counters().unwrap();
    assert_eq!(before.rules.rule_modulus, None, "nftables keys are rule ids");

    // Three new TCP connections (two IPv4, one IPv6).
    assert_eq!(topo.tcp(A, B, 8000), "ok");
    assert_eq!(topo.tcp(A, B, 8000), "ok");
    assert_eq!(topo.tcp6(A, B, 8000), "ok");
    let after = dp.counters().unwrap();
    let policy = delta(reason(&after, Reason::Policy), reason(&before, Reason::Policy));
    assert_eq!(policy.0, 3, "three SYNs decided by policy");
    assert_eq!(
        delta(
            sum(&after.rules.allowed, tcp_rule),
            sum(&before.rules.allowed, tcp_rule)
        ),
        policy
    );
    assert_eq!(
        sum(&after.rules.allowed, udp_rule),
        sum(&before.rules.allowed, udp_rule)
    );

    // One new UDP flow: rule 2.
    assert_eq!(topo.udp(A, B), "ok");
    let after2 = dp.counters().unwrap();
    let policy = delta(reason(&after2, Reason::Policy), reason(&after, Reason::Policy));
    assert_eq!(policy.0, 1);
    assert_eq!(
        delta(
            sum(&after2.rules.allowed, udp_rule),
            sum(&after.rules.allowed, udp_rule)
        ),
        policy
    );

    // c is denied: b's deny counter moves like policy-denied.
    assert_eq!(topo.tcp(C, B, 8000), "timeout");
    let after3 = dp.counters().unwrap();
    let denied = delta(
        reason(&after3, Reason::PolicyDenied),
        reason(&after2, Reason::PolicyDenied),
    );
    assert!(denied.0 >= 1);
    assert_eq!(
        delta(sum(&after3.rules.denied, EP_B), sum(&after2.rules.denied, EP_B)),
        denied
    );

    // An incremental update that rewrites b's chain restarts its rules'
    // counters at 0 (the agent's fold counts a restart); they count on.
    let mut next = c.clone();
    allow(
        &mut next,
        EP_B,
        Direction::Ingress,
        ID_A,
        Some(Protocol::Tcp),
        (8001, 8001),
    );
    dp.apply(&c.diff(&next), &next, &topo.ifs).unwrap();
    let after4 = dp.counters().unwrap();
    assert!(sum(&after4.rules.allowed, tcp_rule).0 <= sum(&after3.rules.allowed, tcp_rule).0);
    assert_eq!(topo.tcp(A, B, 8000), "ok");
    let after5 = dp.counters().unwrap();
    let policy = delta(reason(&after5, Reason::Policy), reason(&after4, Reason::Policy));
    assert_eq!(policy.0, 1);
    assert_eq!(
        delta(
            sum(&after5.rules.allowed, tcp_rule),
            sum(&after4.rules.allowed, tcp_rule)
        ),
        policy
    );
    dp.remove().unwrap();
}
