//! The rule ids beside the policy front (`NPM_POLICY_FRONT_RULES`), through
//! `BPF_PROG_TEST_RUN` on the real program: an allow the front decides is
//! counted in `NPM_RULE_COUNT` under the rule of the very slot that matched
//! (four words of distinct rules in one bucket, so a wrong slot index
//! counts a wrong rule), with `NPM_POLICY` emptied behind the loader's back
//! (so the rule cannot come from an LPM lookup); a rule changed in place, a
//! slot reused by another word, a restarted loader (the rules adopted), and
//! a rules map created beside adopted words (unknown until a full sync,
//! the verdicts unchanged). Needs root.

use crate::ebpf_common::*;
use npm_common::{
    maps, policy_front_bucket, policy_front_proto, policy_front_word, rule_slot, Reason, DIR_INGRESS, EP_FRONT_INGRESS,
    RULE_SLOT_UNKNOWN,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Ingress as IN};
use npm_policy::model::Protocol::Tcp;

const PORT: u16 = 80;

/// The subject (pod identity) of endpoint 1.
const A_SUBJECT: u32 = 256;

/// `n` peer identities whose words for (endpoint 1's subject
/// [`A_SUBJECT`], ingress, TCP 80) share one bucket of the front.
fn colliding_identities(n: usize) -> Vec<u32> {
    let word = |id: u32| policy_front_word(A_SUBJECT, DIR_INGRESS, id, policy_front_proto(6), true, PORT);
    let mut by_bucket: std::collections::HashMap<u32, Vec<u32>> = std::collections::HashMap::new();
    for id in 3000..3_000_000u32 {
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

/// The rule of peer `i` (distinct slots of `NPM_RULE_COUNT`).
fn rule_of(i: usize) -> u32 {
    101 + i as u32
}

/// Endpoint 1 (10.0.0.1), isolated, allowing TCP 80 from the first four of
/// `ids` (at 10.0.3.1 ..), peer `i` by rule [`rule_of`]`(i)`; the fifth
/// peer's address is known, no entry allows it.
fn compiled(ids: &[u32]) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", A_SUBJECT, Some("10.0.0.1"), None, true, true));
    ip(&mut c, "10.0.0.1", A_SUBJECT, 0);
    for (i, id) in ids.iter().enumerate() {
        ip(&mut c, &format!("10.0.3.{}", i + 1), *id, 0);
        if i < 4 {
            allow(&mut c, 1, IN, *id, Some(Tcp), (PORT, PORT), rule_of(i));
        }
    }
    c
}

/// Packets counted at `slot` of `NPM_RULE_COUNT`.
fn counted(dp: &EbpfDataplane, slot: u32) -> u64 {
    dp.counters()
        .unwrap()
        .rules
        .allowed
        .iter()
        .filter(|c| c.key == slot)
        .map(|c| c.packets)
        .sum()
}

/// Sends `n` SYNs from peer `i` to endpoint 1 on `ifindex` (each a policy
/// decision: the decision cache is off) and checks their verdict.
fn syns(dp: &EbpfDataplane, ifindex: u32, i: usize, n: u16, want: (i32, Option<Reason>)) {
    for sport in 0..n {
        let pkt = v4(
            &format!("10.0.3.{}", i + 1),
            "10.0.0.1",
            L4::Tcp(40000 + sport, PORT, 0x02),
        );
        assert_eq!(dp.test_run(IN, ifindex, &pkt).unwrap(), want, "peer {i}");
    }
}

/// Sends `i + 1` SYNs from each peer `i` in `peers` and checks that slot
/// `rules[i]` moved by exactly that many, and `RULE_SLOT_UNKNOWN` not at all.
fn check_counts(dp: &EbpfDataplane, ifindex: u32, peers: &[(usize, u32)]) {
    let allowed = (VERDICT_ALLOW, Some(Reason::Policy));
    let before: Vec<u64> = peers.iter().map(|(_, r)| counted(dp, rule_slot(*r))).collect();
    let unknown = counted(dp, RULE_SLOT_UNKNOWN);
    for (i, _) in peers {
        syns(dp, ifindex, *i, *i as u16 + 1, allowed);
    }
    for ((i, r), b) in peers.iter().zip(before) {
        assert_eq!(
            counted(dp, rule_slot(*r)) - b,
            *i as u64 + 1,
            "peer {i}: its allows counted under its rule {r}"
        );
    }
    assert_eq!(counted(dp, RULE_SLOT_UNKNOWN), unknown, "no allow of unknown rule");
}

fn no_cache() -> BenchSwitches {
    BenchSwitches {
        no_decision_cache: true,
        ..BenchSwitches::default()
    }
}

#[test]
fn front_allows_count_the_rule_of_their_own_slot() {
    sweep_leftovers();
    let ids = colliding_identities(5);
    let c = compiled(&ids);
    let pins = PinDir::new("qr");
    let a = Dummy::new("qra");
    let ifs = ifaces(&[(1, a.ifindex)]);
    let mut dp = EbpfDataplane::open_with(pins.options(), no_cache()).unwrap_or_else(|e| panic!("open: {e}"));
    dp.sync_full(&c, &ifs).unwrap();
    assert_eq!(dp.policy_front_len(), 4, "one bucket, four slots");
    let flags = |dp: &EbpfDataplane| dp.dump().unwrap().endpoints.iter().find(|e| e.id == 1).unwrap().flags;
    assert_ne!(flags(&dp) & EP_FRONT_INGRESS, 0);
    // The LPM loses its entries: the front still decides, and its rules
    // can only come from NPM_POLICY_FRONT_RULES.
    drop_policy_entries(&pins.path);
    dp.bump_generation().unwrap();
    let all: Vec<(usize, u32)> = (0..4).map(|i| (i, rule_of(i))).collect();
    check_counts(&dp, a.ifindex, &all);
    syns(&dp, a.ifindex, 4, 1, (VERDICT_DROP, Some(Reason::PolicyDenied)));

    // Peer 0's entry changes rule: its word stays, its rule is rewritten
    // in place.
    let mut c1 = c.clone();
    allow(&mut c1, 1, IN, ids[0], Some(Tcp), (PORT, PORT), 201);
    dp.apply(&c.diff(&c1), &c1, &ifs).unwrap();
    drop_policy_entries(&pins.path);
    dp.bump_generation().unwrap();
    check_counts(
        &dp,
        a.ifindex,
        &[(0, 201), (1, rule_of(1)), (2, rule_of(2)), (3, rule_of(3))],
    );
    assert_eq!(
        counted(&dp, rule_slot(rule_of(0))),
        1,
        "the old rule of peer 0 kept only its first allow"
    );

    // Peer 1's entry goes, then peer 4 (same bucket) comes with rule 205:
    // its word takes the freed slot, with its own rule.
    let mut c2 = c1.clone();
    c2.policy.retain(|e, _| e.peer != ids[1]);
    dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap();
    let mut c3 = c2.clone();
    allow(&mut c3, 1, IN, ids[4], Some(Tcp), (PORT, PORT), 205);
    dp.apply(&c2.diff(&c3), &c3, &ifs).unwrap();
    assert_eq!(dp.policy_front_len(), 4);
    assert_ne!(flags(&dp) & EP_FRONT_INGRESS, 0);
    drop_policy_entries(&pins.path);
    dp.bump_generation().unwrap();
    syns(&dp, a.ifindex, 1, 1, (VERDICT_DROP, Some(Reason::PolicyDenied)));
    check_counts(&dp, a.ifindex, &[(0, 201), (2, rule_of(2)), (3, rule_of(3)), (4, 205)]);
}

#[test]
fn restarted_loaders_adopt_the_rules_and_a_new_rules_map_counts_unknown_until_a_sync() {
    sweep_leftovers();
    let ids = colliding_identities(5);
    let c = compiled(&ids);
    let pins = PinDir::new("qu");
    let a = Dummy::new("qua");
    let ifs = ifaces(&[(1, a.ifindex)]);
    let open = || EbpfDataplane::open_with(pins.options(), no_cache()).unwrap_or_else(|e| panic!("open: {e}"));
    let mut dp = open();
    dp.sync_full(&c, &ifs).unwrap();
    drop(dp);
    let all: Vec<(usize, u32)> = (0..4).map(|i| (i, rule_of(i))).collect();

    // A restarted loader on the same pins, before any sync: the adopted
    // words keep their adopted rules.
    let mut dp = open();
    assert_eq!(dp.policy_front_len(), 4);
    drop_policy_entries(&pins.path);
    dp.bump_generation().unwrap();
    check_counts(&dp, a.ifindex, &all);
    drop(dp);

    // Pins of a loader from before NPM_POLICY_FRONT_RULES: the map is
    // created beside the adopted words, all unknown. The front decides as
    // before (verdicts come from the words), its allows count as unknown.
    std::fs::remove_file(pins.path.join(maps::POLICY_FRONT_RULES)).unwrap();
    let mut dp = open();
    assert!(pins.path.join(maps::POLICY_FRONT_RULES).exists(), "created and pinned");
    assert_eq!(dp.policy_front_len(), 4);
    dp.bump_generation().unwrap();
    let unknown = counted(&dp, RULE_SLOT_UNKNOWN);
    let before: Vec<u64> = all.iter().map(|(_, r)| counted(&dp, rule_slot(*r))).collect();
    for i in 0..4 {
        syns(&dp, a.ifindex, i, 1, (VERDICT_ALLOW, Some(Reason::Policy)));
    }
    syns(&dp, a.ifindex, 4, 1, (VERDICT_DROP, Some(Reason::PolicyDenied)));
    assert_eq!(counted(&dp, RULE_SLOT_UNKNOWN) - unknown, 4);
    let after: Vec<u64> = all.iter().map(|(_, r)| counted(&dp, rule_slot(*r))).collect();
    assert_eq!(before, after, "no rule counted");
    // The full sync writes every rule.
    dp.sync_full(&c, &ifs).unwrap();
    drop_policy_entries(&pins.path);
    dp.bump_generation().unwrap();
    check_counts(&dp, a.ifindex, &all);
}
