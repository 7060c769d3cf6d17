//! The number ranges through the real compilers (`npm_policy::numbers`):
//! pod identities stay below `IDENTITY_FIRST_CIDR` (or a smaller
//! configured end), a compile that needs one more is marked exhausted
//! (never to be programmed) by both the full and the incremental compiler,
//! adopted floors count, and nothing is handed out twice.

use std::collections::BTreeSet;

use npm_common::{IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use npm_policy::adopt::{seed, AdoptedNumbers};
use npm_policy::compiled::{Compiled, IdTables};
use npm_policy::incremental::Compiler;
use npm_policy::model::Snapshot;
use npm_policy::numbers::{NumberKind, NumberLimits, NumbersExhausted};
use npm_testkit::policy::{app_snapshot, opts, pod};

/// Pods of namespace `x` on node `node`: (name, address, app label).
fn snapshot(pods: &[(&str, &str, &str)]) -> Snapshot {
    app_snapshot("x", "node", pods)
}

/// A `prev` with no numbers and room for `n` pod identities.
fn room_for(n: u32) -> Compiled {
    Compiled {
        ids: IdTables {
            limits: NumberLimits {
                identity_end: IDENTITY_FIRST_POD + n,
                ..NumberLimits::default()
            },
            ..IdTables::default()
        },
        ..Compiled::default()
    }
}

fn identity_exhausted(end: u32) -> Option<NumbersExhausted> {
    Some(NumbersExhausted {
        kind: NumberKind::Identity,
        end,
    })
}

#[test]
fn a_full_compile_past_the_identity_range_is_marked_and_its_numbers_stay_distinct() {
    let two = snapshot(&[("a", "10.0.0.1", "a"), ("a2", "10.0.0.2", "a"), ("b", "10.0.0.3", "b")]);
    let first = npm_policy::compile(&two, &opts(), Some(&room_for(2)));
    assert_eq!(first.ids.exhausted(), None);
    assert!(first.ids.identities.keys().all(|id| *id < IDENTITY_FIRST_POD + 2));
    assert_eq!(
        first.ids.limits.identity_end,
        IDENTITY_FIRST_POD + 2,
        "the limits are kept"
    );

    let three = snapshot(&[("a", "10.0.0.1", "a"), ("b", "10.0.0.3", "b"), ("c", "10.0.0.4", "c")]);
    let next = npm_policy::compile(&three, &opts(), Some(&first));
    assert_eq!(
        next.ids.exhausted(),
        identity_exhausted(IDENTITY_FIRST_POD + 2).as_ref()
    );
    // The kept numbers are kept; the new one is provisional, past the end,
    // and no other label set has it.
    let ids: BTreeSet<u32> = next.ipcache.values().map(|e| e.identity).collect();
    assert_eq!(ids.len(), 3);
    let c = next.ipcache[&"10.0.0.4".parse().unwrap()].identity;
    assert!(c >= IDENTITY_FIRST_POD + 2, "{c}");
    // A compile from a marked one stays marked (its provisional numbers
    // are reused).
    let again = npm_policy::compile(&three, &opts(), Some(&next));
    assert!(again.ids.exhausted().is_some());
    // From the last good compile, the same state is refused again: the
    // range stays used up (numbers are not recycled).
    let retry = npm_policy::compile(&three, &opts(), Some(&first));
    assert!(retry.ids.exhausted().is_some());
    // Without the new label set, the compile is good again.
    let back = npm_policy::compile(&two, &opts(), Some(&first));
    assert_eq!(back.ids.exhausted(), None);
}

#[test]
fn the_incremental_compiler_marks_the_same_exhaustion() {
    let two = snapshot(&[("a", "10.0.0.1", "a"), ("b", "10.0.0.3", "b")]);
    let mut inc = Compiler::new(two.clone(), opts(), Some(&room_for(2)));
    assert_eq!(inc.compiled().ids.exhausted(), None);
    inc.upsert_pod(pod("x", "c", "10.0.0.4", "c", "node"));
    assert_eq!(
        inc.compiled().ids.exhausted(),
        identity_exhausted(IDENTITY_FIRST_POD + 2).as_ref()
    );
    let ids: BTreeSet<u32> = inc.compiled().ipcache.values().map(|e| e.identity).collect();
    assert_eq!(ids.len(), 3, "the provisional number is distinct");
    // A new pod of a known label set needs no new number.
    let mut inc = Compiler::new(two, opts(), Some(&room_for(2)));
    inc.upsert_pod(pod("x", "a2", "10.0.0.2", "a", "node"));
    assert_eq!(inc.compiled().ids.exhausted(), None);
}

/// The datapath's bound itself: adopted pod identities just below
/// `IDENTITY_FIRST_CIDR` leave room for one more label set; the next is
/// refused and never numbered as a CIDR identity.
#[test]
fn pod_identities_never_reach_the_cidr_identities_after_an_adoption() {
    let s = snapshot(&[("a", "10.0.0.1", "a")]);
    let fresh = npm_policy::compile(&s, &opts(), None);
    let adopted = AdoptedNumbers {
        identities: [(IDENTITY_FIRST_CIDR - 2, ["10.0.0.1".parse().unwrap()].into())].into(),
        ..AdoptedNumbers::default()
    };
    let floor = seed(&fresh, &adopted);
    assert_eq!(floor.ids.counter(NumberKind::Identity), IDENTITY_FIRST_CIDR - 1);
    let kept = npm_policy::compile(&s, &opts(), Some(&floor));
    assert_eq!(kept.ids.exhausted(), None);
    let one_more = snapshot(&[("a", "10.0.0.1", "a"), ("b", "10.0.0.2", "b")]);
    let c = npm_policy::compile(&one_more, &opts(), Some(&kept));
    assert_eq!(c.ids.exhausted(), None);
    assert_eq!(
        c.ipcache[&"10.0.0.2".parse().unwrap()].identity,
        IDENTITY_FIRST_CIDR - 1
    );
    let two_more = snapshot(&[("a", "10.0.0.1", "a"), ("b", "10.0.0.2", "b"), ("c", "10.0.0.3", "c")]);
    let c = npm_policy::compile(&two_more, &opts(), Some(&c));
    assert_eq!(c.ids.exhausted(), identity_exhausted(IDENTITY_FIRST_CIDR).as_ref());
}
