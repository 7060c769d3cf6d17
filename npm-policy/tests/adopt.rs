//! Table tests of `npm_policy::adopt`: which adopted numbers a restarted
//! agent keeps (an identity only for exactly the addresses that carried
//! it, a CIDR identity by prefix) and that every new number is above every
//! adopted one, through the real `compile()`.

use std::collections::BTreeMap;
use std::net::IpAddr;

use npm_policy::adopt::{addresses_by_identity, seed, AdoptedNumbers};
use npm_policy::compiled::Compiled;
use npm_policy::model::Snapshot;
use npm_testkit::policy::{app_snapshot, opts};

/// Pods of namespace `x` on node `other`: (name, address, app label).
fn snapshot(pods: &[(&str, &str, &str)]) -> Snapshot {
    app_snapshot("x", "other", pods)
}

/// The identity of address `ip` in `c`.
fn id_of(c: &Compiled, ip: &str) -> u32 {
    c.ipcache[&ip.parse::<IpAddr>().unwrap()].identity
}

/// Compiles `s` the way a restarted agent does against `adopted`.
fn restarted(s: &Snapshot, adopted: &AdoptedNumbers) -> Compiled {
    let fresh = npm_policy::compile(s, &opts(), None);
    npm_policy::compile(s, &opts(), Some(&seed(&fresh, adopted)))
}

fn adopted_from(c: &Compiled) -> AdoptedNumbers {
    AdoptedNumbers {
        identities: addresses_by_identity(c),
        cidrs: c.cidrs.clone(),
        max_rule: c.ids.rules.keys().next_back().copied().unwrap_or(0),
        max_subject: c.policy.keys().map(|e| e.subject).max().unwrap_or(0),
    }
}

/// A subject whose policy keys a previous agent left (pod identity 900,
/// no address of it left in the ipcache) is never handed to an identity
/// key: every new pod identity is numbered above it.
#[test]
fn new_identities_are_numbered_above_an_adopted_subject() {
    let s = snapshot(&[("a", "10.0.0.1", "a"), ("b", "10.0.0.2", "b")]);
    let adopted = AdoptedNumbers {
        max_subject: 900,
        ..AdoptedNumbers::default()
    };
    let c = restarted(&s, &adopted);
    for ip in ["10.0.0.1", "10.0.0.2"] {
        assert!(
            id_of(&c, ip) > 900,
            "{ip} got {} (not above the adopted subject)",
            id_of(&c, ip)
        );
    }
    assert!(c.ids.next_identity > 900);
}

#[test]
fn unchanged_state_keeps_every_number() {
    // The previous agent saw z first: its numbering follows history.
    let s1 = snapshot(&[("z", "10.0.0.9", "zed")]);
    let c1 = npm_policy::compile(&s1, &opts(), None);
    let s = snapshot(&[("a", "10.0.0.1", "a"), ("z", "10.0.0.9", "zed"), ("b", "10.0.0.2", "a")]);
    let old = npm_policy::compile(&s, &opts(), Some(&c1));
    assert!(id_of(&old, "10.0.0.9") < id_of(&old, "10.0.0.1"), "history order");
    let fresh = npm_policy::compile(&s, &opts(), None);
    assert_ne!(fresh.ipcache, old.ipcache, "a fresh numbering would change meanings");
    let new = restarted(&s, &adopted_from(&old));
    assert_eq!(new.ipcache, old.ipcache);
    assert_eq!(new.ids.identities, old.ids.identities);
}

#[test]
fn an_identity_is_kept_only_for_exactly_its_addresses() {
    let s = snapshot(&[
        ("a", "10.0.0.1", "a"),
        ("b", "10.0.0.2", "b"),
        ("c1", "10.0.0.3", "c"),
        ("c2", "10.0.0.4", "c"),
        ("d", "10.0.0.5", "d"),
    ]);
    let old = npm_policy::compile(&s, &opts(), None);
    let adopted = adopted_from(&old);
    let max = adopted.max_identity().unwrap();
    // While the agent was down: a relabelled (same address: kept), b
    // deleted and its address reused by a new pod with a's old labels, c2
    // deleted (c's address set shrank), d's address moved to e (other
    // labels, another name), f new.
    let s2 = snapshot(&[
        ("a", "10.0.0.1", "a2"),
        ("b2", "10.0.0.2", "a"),
        ("c1", "10.0.0.3", "c"),
        ("e", "10.0.0.5", "e"),
        ("f", "10.0.0.6", "d"),
    ]);
    let new = restarted(&s2, &adopted);
    let old_id: BTreeMap<&str, u32> = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.5"]
        .into_iter()
        .map(|ip| (ip, id_of(&old, ip)))
        .collect();
    // Same address set: the number keeps its meaning (these addresses).
    assert_eq!(id_of(&new, "10.0.0.1"), old_id["10.0.0.1"]);
    assert_eq!(id_of(&new, "10.0.0.2"), old_id["10.0.0.2"]);
    assert_eq!(id_of(&new, "10.0.0.5"), old_id["10.0.0.5"]);
    // c's set shrank: a new number, above every adopted one.
    assert!(id_of(&new, "10.0.0.3") > max);
    assert!(id_of(&new, "10.0.0.6") > max);
    // The map-level invariant: every number of the new state that existed
    // in the old one stands for exactly the same addresses.
    let new_sets = addresses_by_identity(&new);
    for (id, addrs) in &new_sets {
        if let Some(old_addrs) = adopted.identities.get(id) {
            assert_eq!(addrs, old_addrs, "identity {id} changed meaning");
        }
    }
    assert!(new.ids.next_identity > max);
}

#[test]
fn cidr_identities_are_kept_by_prefix_and_new_ones_numbered_above() {
    let mut adopted = AdoptedNumbers::default();
    let base = npm_common::IDENTITY_FIRST_CIDR;
    adopted.cidrs.insert("10.0.0.0/8".parse().unwrap(), base + 7);
    adopted.cidrs.insert("192.168.0.0/16".parse().unwrap(), base + 3);
    adopted.max_rule = 41;
    let mut fresh = Compiled::default();
    fresh.cidrs.insert("10.0.0.0/8".parse().unwrap(), base);
    fresh.cidrs.insert("172.16.0.0/12".parse().unwrap(), base + 1);
    let s = seed(&fresh, &adopted);
    assert_eq!(
        s.cidrs,
        [("10.0.0.0/8".parse().unwrap(), base + 7)].into_iter().collect(),
        "kept by prefix; prefixes no longer wanted are not carried"
    );
    assert_eq!(s.ids.next_cidr, base + 8, "above every adopted CIDR identity");
    assert_eq!(s.ids.next_rule, 42, "rule ids above every adopted one");
    assert_eq!(s.ids.next_identity, npm_common::IDENTITY_FIRST_POD);
    assert!(s.ids.identities.is_empty());
    assert!(AdoptedNumbers::default().is_empty() && !adopted.is_empty());
}

/// ClusterNetworkPolicy rule ids are numbered above every adopted rule id
/// and `networks` prefixes keep their adopted CIDR identity (the tier
/// entries name them), so a restarted agent never gives an old number a
/// new meaning in the tier map either.
#[test]
fn cluster_policy_rules_and_networks_keep_the_restart_numbering() {
    use npm_policy::compiled::{Direction, Tier, TierAction};
    use npm_policy::model::Selector;
    use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterRule, Subject};
    let mut s = snapshot(&[("a", "10.0.0.1", "a"), ("b", "10.0.0.2", "b")]);
    s.pods.get_mut(&("x".to_string(), "a".to_string())).unwrap().node_name = Some("node".into());
    s.insert_cluster_policy(
        ClusterPolicy {
            name: "deny-ten".into(),
            tier: Tier::Admin,
            priority: 1,
            subject: Subject::Namespaces(Selector::default()),
            ingress: vec![],
            egress: vec![ClusterRule {
                name: None,
                action: TierAction::Deny,
                peers: vec![ClusterPeer::Networks(vec!["10.0.0.0/8".parse().unwrap()])],
                ports: vec![],
            }],
        },
        None,
    );
    let base = npm_common::IDENTITY_FIRST_CIDR;
    let adopted = AdoptedNumbers {
        cidrs: [("10.0.0.0/8".parse().unwrap(), base + 7)].into(),
        max_rule: 41,
        ..AdoptedNumbers::default()
    };
    let new = restarted(&s, &adopted);
    assert_eq!(new.cidrs.get(&"10.0.0.0/8".parse().unwrap()), Some(&(base + 7)));
    assert!(!new.tiers.is_empty());
    for (e, v) in &new.tiers {
        assert_eq!((e.direction, e.peer), (Direction::Egress, base + 7));
        assert!(v.rule >= 42, "rule {} reuses an adopted number", v.rule);
        assert!(new.ids.rules.contains_key(&v.rule));
    }
    // The next restart adopts the tier rule ids as well.
    let again = restarted(&s, &adopted_from(&new));
    assert!(again
        .tiers
        .values()
        .all(|v| v.rule > *new.ids.rules.keys().next_back().unwrap()));
}
