//! The mass-deletion guard: the one-step share and the cumulative
//! reference with its window.

use std::time::{Duration, Instant};

use npm_common::IDENTITY_FIRST_POD;

use super::with_identities;
use crate::reconcile::guard::{mass_removal, missing_from, GuardReference};

/// Small steps add up against the high-water count; a reset (a
/// confirmation) or the window's end makes the current count the
/// reference.
#[test]
fn cumulative_reference_window_and_reset() {
    let window = Duration::from_secs(60);
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut g = GuardReference::default();
    assert_eq!(g.cumulative_removal(&with_identities(0), (t0, window, 0.5)), None);
    for (s, n) in [(0, 100), (10, 90), (20, 80), (30, 70), (40, 60), (50, 50)] {
        assert_eq!(
            g.cumulative_removal(&with_identities(n), (at(s), window, 0.5)),
            None,
            "{n}"
        );
        g.observe(at(s), n, 0);
    }
    assert_eq!(g.high_water(at(55), window), (100, 0));
    let what = g.cumulative_removal(&with_identities(40), (at(55), window, 0.5));
    assert!(
        what.as_deref()
            .is_some_and(|w| w.contains("60 of up to 100 identities")),
        "{what:?}"
    );
    // Growth raises the reference.
    let mut up = GuardReference::default();
    up.observe(at(0), 10, 4);
    up.observe(at(1), 30, 2);
    assert_eq!(up.high_water(at(2), window), (30, 4));
    assert!(up
        .cumulative_removal(&with_identities(14), (at(2), window, 0.5))
        .is_some());
    // A count stays the reference for a window after it stopped being
    // programmed: the 100 was programmed until 10 s (when 90 replaced
    // it), so it is still the reference at 61 s and forgotten at 71 s,
    // when the highest remaining count is 90 (programmed until 20 s).
    assert_eq!(g.high_water(at(61), window), (100, 0));
    assert_eq!(g.high_water(at(71), window), (90, 0));
    assert!(g
        .cumulative_removal(&with_identities(40), (at(71), window, 0.5))
        .is_some());
    assert_eq!(g.high_water(at(200), window), (50, 0), "the newest sample always stays");
    assert_eq!(g.cumulative_removal(&with_identities(40), (at(200), window, 0.5)), None);
    // A confirmation resets the reference to what was programmed.
    g.observe(at(201), 100, 0);
    g.reset(at(202), 40, 0);
    assert_eq!(g.high_water(at(203), window), (40, 0));
    assert_eq!(g.cumulative_removal(&with_identities(30), (at(203), window, 0.5)), None);
}

/// The one-step check counts the programmed identities and endpoints
/// the next state no longer has.
#[test]
fn one_step_removal_counts_missing_members() {
    assert_eq!(missing_from([1, 2, 3, 5].into_iter(), [2, 4, 5, 6].into_iter()), 2);
    assert_eq!(missing_from([1, 2].into_iter(), std::iter::empty()), 2);
    assert_eq!(missing_from(std::iter::empty::<u32>(), [1].into_iter()), 0);
    let old = with_identities(10);
    let mut new = with_identities(10);
    new.ids.identities.retain(|id, _| *id >= IDENTITY_FIRST_POD + 4);
    assert_eq!(mass_removal(&old, &new, 0.5), None);
    new.ids.identities.retain(|id, _| *id >= IDENTITY_FIRST_POD + 6);
    assert!(mass_removal(&old, &new, 0.5).is_some_and(|w| w.starts_with("6/10 identities")));
}

/// B1: a count left unchanged through a quiet period longer than the
/// window stays the reference until a smaller count replaces it, so a
/// fast drop right after the quiet period is still held.
#[test]
fn high_water_survives_a_quiet_period_longer_than_the_window() {
    let window = Duration::from_secs(600);
    let t0 = Instant::now();
    let at = |s: u64| t0 + Duration::from_secs(s);
    let mut g = GuardReference::default();
    g.observe(at(0), 100, 0);
    // 11 minutes without a sync (a stalled watch), then 60: 40% removed.
    assert_eq!(g.cumulative_removal(&with_identities(60), (at(660), window, 0.5)), None);
    g.observe(at(660), 60, 0);
    // 5 s later 35: 65% below the 100 that was programmed until 660 s.
    assert_eq!(g.high_water(at(665), window), (100, 0));
    let what = g.cumulative_removal(&with_identities(35), (at(665), window, 0.5));
    assert!(
        what.as_deref()
            .is_some_and(|w| w.contains("65 of up to 100 identities")),
        "{what:?}"
    );
    // The 100 is forgotten a window after it stopped being programmed.
    assert_eq!(g.high_water(at(1261), window), (60, 0));
}

/// A compile with `n` tier entries (one subject, distinct peers).
fn with_tier_entries(n: u32) -> npm_policy::compiled::Compiled {
    use npm_policy::compiled::{Compiled, Direction, Tier, TierAction, TierEntry, TierValue};
    let mut c = Compiled::default();
    for i in 0..n {
        c.tiers.insert(
            TierEntry {
                subject: IDENTITY_FIRST_POD,
                direction: Direction::Ingress,
                tier: Tier::Admin,
                peer: IDENTITY_FIRST_POD + i,
                protocol: None,
                ports: (0, u16::MAX),
            },
            TierValue {
                action: TierAction::Deny,
                rank: i,
                rule: i,
            },
        );
    }
    c
}

/// Losing most ClusterNetworkPolicies (by name) or most tier entries (by
/// count: a reshaped CNP is no loss) is a mass removal, in one step and
/// cumulatively.
#[test]
fn losing_most_cluster_policies_or_tier_entries_is_held() {
    use crate::reconcile::guard::{named_removal, Named};
    let names: Vec<String> = (0..4).map(|i| format!("cnp{i}")).collect();
    let (full, few) = (with_tier_entries(10), with_tier_entries(4));
    let all = || names.iter().map(String::as_str);
    assert_eq!(
        named_removal(Named::ClusterPolicies, &names, all(), &full, &full, 0.5),
        None
    );
    assert_eq!(
        named_removal(Named::ClusterPolicies, &names, all().skip(2), &full, &full, 0.5),
        None,
        "2 of 4: not most"
    );
    let what = named_removal(Named::ClusterPolicies, &names, all().skip(3), &full, &full, 0.5);
    assert!(
        what.as_deref()
            .is_some_and(|w| w.starts_with("3/4 ClusterNetworkPolicies")),
        "{what:?}"
    );
    let what = named_removal(Named::ClusterPolicies, &names, all(), &full, &few, 0.5);
    assert!(
        what.as_deref().is_some_and(|w| w.contains("6/10 tier entries")),
        "{what:?}"
    );
    // Same count, other keys (a CNP edited): no loss.
    let mut reshaped = with_tier_entries(10);
    let moved: Vec<_> = reshaped.tiers.iter().map(|(k, v)| (*k, *v)).collect();
    reshaped.tiers.clear();
    for (mut k, v) in moved {
        k.peer += 100;
        reshaped.tiers.insert(k, v);
    }
    assert_eq!(
        named_removal(Named::ClusterPolicies, &names, all(), &full, &reshaped, 0.5),
        None
    );

    // Cumulative: small steps add up against the high-water counts.
    let window = Duration::from_secs(60);
    let t0 = Instant::now();
    let mut g = GuardReference::default();
    g.observe_tiers(t0, names.clone(), &full);
    assert_eq!(g.programmed_cluster_policies(), Some(&names[..]));
    g.observe_tiers(t0 + Duration::from_secs(1), names[..3].to_vec(), &with_tier_entries(7));
    let at = t0 + Duration::from_secs(2);
    assert_eq!(
        g.cumulative_tier_removal(2, &with_tier_entries(7), (at, window, 0.5)),
        None
    );
    let what = g.cumulative_tier_removal(1, &with_tier_entries(7), (at, window, 0.5));
    assert!(
        what.as_deref()
            .is_some_and(|w| w.contains("3 of up to 4 ClusterNetworkPolicies")),
        "{what:?}"
    );
    let what = g.cumulative_tier_removal(4, &with_tier_entries(3), (at, window, 0.5));
    assert!(
        what.as_deref()
            .is_some_and(|w| w.contains("7 of up to 10 tier entries")),
        "{what:?}"
    );
    // A confirmation resets the reference.
    g.reset(at, 0, 0);
    g.observe_tiers(at, vec!["cnp0".into()], &with_tier_entries(3));
    assert_eq!(
        g.cumulative_tier_removal(1, &with_tier_entries(3), (at, window, 0.5)),
        None
    );
}

/// Losing most Nodes, or most node addresses, is held, in one step and
/// cumulatively.
#[test]
fn node_removals_are_held() {
    use crate::reconcile::guard::{named_removal, node_addresses, Named};
    use npm_policy::compiled::{Compiled, IpEntry, NodeIdentity};
    let with_nodes = |n: u8| {
        let mut c = Compiled::default();
        c.ids.node_identities.insert(
            IDENTITY_FIRST_POD,
            NodeIdentity {
                labels: Default::default(),
                nodes: (0..n).map(|i| format!("n{i}")).collect(),
            },
        );
        for i in 0..n {
            c.ipcache.insert(
                format!("10.0.0.{i}").parse().unwrap(),
                IpEntry {
                    identity: IDENTITY_FIRST_POD,
                    cidr_identity: 0,
                    owner: 0,
                },
            );
        }
        c
    };
    let names = |n: u8| (0..n).map(|i| format!("n{i:02}")).collect::<Vec<_>>();
    let (old, new) = (with_nodes(10), with_nodes(4));
    assert_eq!(node_addresses(&old), 10);
    let all = names(10);
    let some = names(4);
    assert!(
        named_removal(Named::Nodes, &all, some.iter().map(String::as_str), &old, &new, 0.5)
            .is_some_and(|w| w.starts_with("6/10 Nodes and 6/10 node addresses"))
    );
    let most = names(6);
    assert_eq!(
        named_removal(
            Named::Nodes,
            &all,
            most.iter().map(String::as_str),
            &old,
            &with_nodes(6),
            0.5
        ),
        None
    );
    // Addresses lost while the Node objects stay are held too.
    assert!(named_removal(Named::Nodes, &all, all.iter().map(String::as_str), &old, &new, 0.5).is_some());
    // Cumulatively: small steps add up against the high-water count.
    let (window, t0) = (Duration::from_secs(60), Instant::now());
    let mut g = GuardReference::default();
    for (s, n) in [(0u64, 10u8), (10, 8), (20, 6)] {
        let at = t0 + Duration::from_secs(s);
        assert_eq!(
            g.cumulative_node_removal(n as usize, &with_nodes(n), (at, window, 0.5)),
            None
        );
        g.observe_nodes(at, names(n), &with_nodes(n));
    }
    assert_eq!(g.programmed_nodes().map(<[String]>::len), Some(6));
    let at = t0 + Duration::from_secs(30);
    assert!(g
        .cumulative_node_removal(4, &with_nodes(4), (at, window, 0.5))
        .is_some_and(|w| w.starts_with("6 of up to 10 Nodes")));
    g.reset(at, 0, 0);
    g.observe_nodes(at, names(4), &with_nodes(4));
    assert_eq!(g.cumulative_node_removal(4, &with_nodes(4), (at, window, 0.5)), None);
}
