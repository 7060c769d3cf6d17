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
    assert_eq!(g.cumulative_removal(&with_identities(0), t0, window, 0.5), None);
    for (s, n) in [(0, 100), (10, 90), (20, 80), (30, 70), (40, 60), (50, 50)] {
        assert_eq!(
            g.cumulative_removal(&with_identities(n), at(s), window, 0.5),
            None,
            "{n}"
        );
        g.observe(at(s), n, 0);
    }
    assert_eq!(g.high_water(at(55), window), (100, 0));
    let what = g.cumulative_removal(&with_identities(40), at(55), window, 0.5);
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
        .cumulative_removal(&with_identities(14), at(2), window, 0.5)
        .is_some());
    // A count stays the reference for a window after it stopped being
    // programmed: the 100 was programmed until 10 s (when 90 replaced
    // it), so it is still the reference at 61 s and forgotten at 71 s,
    // when the highest remaining count is 90 (programmed until 20 s).
    assert_eq!(g.high_water(at(61), window), (100, 0));
    assert_eq!(g.high_water(at(71), window), (90, 0));
    assert!(g
        .cumulative_removal(&with_identities(40), at(71), window, 0.5)
        .is_some());
    assert_eq!(g.high_water(at(200), window), (50, 0), "the newest sample always stays");
    assert_eq!(g.cumulative_removal(&with_identities(40), at(200), window, 0.5), None);
    // A confirmation resets the reference to what was programmed.
    g.observe(at(201), 100, 0);
    g.reset(at(202), 40, 0);
    assert_eq!(g.high_water(at(203), window), (40, 0));
    assert_eq!(g.cumulative_removal(&with_identities(30), at(203), window, 0.5), None);
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
    assert_eq!(g.cumulative_removal(&with_identities(60), at(660), window, 0.5), None);
    g.observe(at(660), 60, 0);
    // 5 s later 35: 65% below the 100 that was programmed until 660 s.
    assert_eq!(g.high_water(at(665), window), (100, 0));
    let what = g.cumulative_removal(&with_identities(35), at(665), window, 0.5);
    assert!(
        what.as_deref()
            .is_some_and(|w| w.contains("65 of up to 100 identities")),
        "{what:?}"
    );
    // The 100 is forgotten a window after it stopped being programmed.
    assert_eq!(g.high_water(at(1261), window), (60, 0));
}
