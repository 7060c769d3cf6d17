//! The one owner of the numbers the compiler hands out: endpoint ids, pod
//! (and node) identities, CIDR identities and rule ids. Every new number
//! comes from [`IdTables::next`] (checked) or, inside a compile that must
//! go on, [`IdTables::next_or_provisional`]; every floor (the previous
//! compile's counters, the numbers adopted from a previous agent's kernel
//! state, the counters of a failed apply) is raised with
//! [`IdTables::raise_floor`] / [`IdTables::raise_to`].
//!
//! The rules:
//! - counters only grow, so a number is never handed to something else
//!   while the agent runs (a new owner never carries an old owner's kernel
//!   entries or tracked flows);
//! - each kind has a range ([`NumberLimits`]); pod and node identities must
//!   stay below `IDENTITY_FIRST_CIDR`, where CIDR identities start;
//! - a number past its range is never programmed: [`IdTables::next`] fails,
//!   and a compile that needed one carries the error
//!   ([`IdTables::exhausted`]); its numbers past the range are provisional
//!   (counted down from `u32::MAX`, distinct from every other number of
//!   any kind, so the compile stays consistent), and the agent refuses to
//!   program such a compile (the last good state stays).
//!
//! Numbers of label sets no longer used are not recycled: a number may
//! still be referenced by a conntrack entry or a policy key of the kernel
//! after the compile stopped using it.

use npm_common::{IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use serde::{Deserialize, Serialize};

use crate::compiled::IdTables;

/// The kinds of numbers a compile hands out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NumberKind {
    /// Endpoint ids (one per local pod uid).
    Endpoint,
    /// Pod and node identities (one per identity key or node label set).
    Identity,
    /// Rule ids (one per rule).
    Rule,
    /// CIDR identities (one per ipBlock prefix).
    Cidr,
}

impl NumberKind {
    /// Every kind.
    pub const ALL: [NumberKind; 4] = [
        NumberKind::Endpoint,
        NumberKind::Identity,
        NumberKind::Rule,
        NumberKind::Cidr,
    ];

    /// The first number of the kind.
    pub const fn first(self) -> u32 {
        match self {
            NumberKind::Endpoint | NumberKind::Rule => 1,
            NumberKind::Identity => IDENTITY_FIRST_POD,
            NumberKind::Cidr => IDENTITY_FIRST_CIDR,
        }
    }

    /// A short name (logs, metrics).
    pub const fn name(self) -> &'static str {
        match self {
            NumberKind::Endpoint => "endpoint",
            NumberKind::Identity => "identity",
            NumberKind::Rule => "rule",
            NumberKind::Cidr => "cidr",
        }
    }
}

impl std::fmt::Display for NumberKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The end (exclusive) of each kind's range; the first number of each kind
/// is [`NumberKind::first`]. The default is the datapath's: pod and node
/// identities below `IDENTITY_FIRST_CIDR`, the others up to `u32::MAX`.
/// Smaller ends serve tests (reaching a bound in a few allocations).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumberLimits {
    /// End of the endpoint ids.
    pub endpoint_end: u32,
    /// End of the pod and node identities (at most `IDENTITY_FIRST_CIDR`).
    pub identity_end: u32,
    /// End of the rule ids.
    pub rule_end: u32,
    /// End of the CIDR identities.
    pub cidr_end: u32,
}

impl Default for NumberLimits {
    fn default() -> Self {
        NumberLimits {
            endpoint_end: u32::MAX,
            identity_end: IDENTITY_FIRST_CIDR,
            rule_end: u32::MAX,
            cidr_end: u32::MAX,
        }
    }
}

impl NumberLimits {
    /// Whether these are the datapath's limits (not serialized then).
    pub fn is_default(&self) -> bool {
        *self == NumberLimits::default()
    }

    /// The end (exclusive) of `kind`'s range; an identity end above
    /// `IDENTITY_FIRST_CIDR` is `IDENTITY_FIRST_CIDR` (pod identities never
    /// reach the CIDR identities).
    pub fn end(&self, kind: NumberKind) -> u32 {
        match kind {
            NumberKind::Endpoint => self.endpoint_end,
            NumberKind::Identity => self.identity_end.min(IDENTITY_FIRST_CIDR),
            NumberKind::Rule => self.rule_end,
            NumberKind::Cidr => self.cidr_end,
        }
    }
}

/// A kind's numbers are used up: nothing new of that kind can be numbered
/// until the agent restarts with fewer label sets, prefixes or rules.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
#[error("{kind} numbers exhausted: every number below {end} has been handed out (numbers are never reused while the agent runs)")]
pub struct NumbersExhausted {
    /// The kind whose range is used up.
    pub kind: NumberKind,
    /// The end (exclusive) of its range.
    pub end: u32,
}

impl IdTables {
    /// The next number `kind` would hand out.
    pub fn counter(&self, kind: NumberKind) -> u32 {
        match kind {
            NumberKind::Endpoint => self.next_endpoint,
            NumberKind::Identity => self.next_identity,
            NumberKind::Rule => self.next_rule,
            NumberKind::Cidr => self.next_cidr,
        }
    }

    fn counter_mut(&mut self, kind: NumberKind) -> &mut u32 {
        match kind {
            NumberKind::Endpoint => &mut self.next_endpoint,
            NumberKind::Identity => &mut self.next_identity,
            NumberKind::Rule => &mut self.next_rule,
            NumberKind::Cidr => &mut self.next_cidr,
        }
    }

    /// Hands out the next number of `kind`, or fails (handing out nothing)
    /// when it would be at or past the end of the kind's range.
    pub fn next(&mut self, kind: NumberKind) -> Result<u32, NumbersExhausted> {
        self.raise_floor(kind, kind.first());
        let end = self.limits.end(kind);
        let n = self.counter(kind);
        if n >= end {
            return Err(NumbersExhausted { kind, end });
        }
        *self.counter_mut(kind) = n + 1;
        Ok(n)
    }

    /// [`IdTables::next`] for a compile that must go on: when the range is
    /// used up, the error is recorded in [`IdTables::exhausted`] (the
    /// compile must not be programmed) and a provisional number is handed
    /// out, counted down from `u32::MAX` (distinct from every other number
    /// of the compile, so it stays consistent; it never reaches the
    /// kernel).
    pub fn next_or_provisional(&mut self, kind: NumberKind) -> u32 {
        match self.next(kind) {
            Ok(n) => n,
            Err(e) => {
                self.exhausted.get_or_insert(e);
                let n = u32::MAX - self.provisional;
                self.provisional = self.provisional.saturating_add(1);
                n
            }
        }
    }

    /// Raises `kind`'s counter to at least `floor` (a number at or above
    /// it is handed out next; nothing below it ever again).
    pub fn raise_floor(&mut self, kind: NumberKind, floor: u32) {
        let c = self.counter_mut(kind);
        *c = (*c).max(floor);
    }

    /// Raises every counter to at least `other`'s (e.g. the counters of a
    /// failed attempt, whose numbers the kernel may hold), keeping
    /// `other`'s provisional numbers and exhaustion too.
    pub fn raise_to(&mut self, other: &IdTables) {
        for kind in NumberKind::ALL {
            self.raise_floor(kind, other.counter(kind));
        }
        self.provisional = self.provisional.max(other.provisional);
        if let Some(e) = &other.exhausted {
            self.exhausted.get_or_insert_with(|| e.clone());
        }
    }

    /// Sets every counter to `other`'s (what is programmed becoming the
    /// target: counters only grow, so this never lowers one).
    pub fn counters_from(&mut self, other: &IdTables) {
        for kind in NumberKind::ALL {
            *self.counter_mut(kind) = other.counter(kind);
        }
    }

    /// Tables with `self`'s counters (each at least its kind's first
    /// number), limits, provisional count and exhaustion, and nothing
    /// numbered: the floor of a compile that keeps no number but must
    /// reuse none.
    pub fn floors(&self) -> IdTables {
        let mut t = IdTables {
            limits: self.limits,
            ..IdTables::default()
        };
        t.raise_to(self);
        for kind in NumberKind::ALL {
            t.raise_floor(kind, kind.first());
        }
        t
    }

    /// Whether a number of this compile is past its range (set by
    /// [`IdTables::next_or_provisional`]): such a compile is never
    /// programmed.
    pub fn exhausted(&self) -> Option<&NumbersExhausted> {
        self.exhausted.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small(identity_end: u32) -> IdTables {
        IdTables {
            limits: NumberLimits {
                identity_end,
                ..NumberLimits::default()
            },
            ..IdTables::default()
        }
    }

    #[test]
    fn next_starts_at_each_kinds_first_number() {
        let mut t = IdTables::default();
        assert_eq!(t.next(NumberKind::Endpoint), Ok(1));
        assert_eq!(t.next(NumberKind::Rule), Ok(1));
        assert_eq!(t.next(NumberKind::Identity), Ok(IDENTITY_FIRST_POD));
        assert_eq!(t.next(NumberKind::Cidr), Ok(IDENTITY_FIRST_CIDR));
        assert_eq!(t.next(NumberKind::Identity), Ok(IDENTITY_FIRST_POD + 1));
    }

    #[test]
    fn next_fails_closed_at_the_end_of_the_range_and_hands_out_nothing() {
        let mut t = small(IDENTITY_FIRST_POD + 2);
        assert_eq!(t.next(NumberKind::Identity), Ok(IDENTITY_FIRST_POD));
        assert_eq!(t.next(NumberKind::Identity), Ok(IDENTITY_FIRST_POD + 1));
        let e = NumbersExhausted {
            kind: NumberKind::Identity,
            end: IDENTITY_FIRST_POD + 2,
        };
        assert_eq!(t.next(NumberKind::Identity), Err(e.clone()));
        assert_eq!(t.next(NumberKind::Identity), Err(e));
        assert_eq!(t.counter(NumberKind::Identity), IDENTITY_FIRST_POD + 2);
        // Other kinds are not affected.
        assert_eq!(t.next(NumberKind::Cidr), Ok(IDENTITY_FIRST_CIDR));
        assert!(t.exhausted().is_none(), "a checked next records nothing");
    }

    #[test]
    fn pod_identities_never_reach_the_cidr_identities() {
        let mut t = small(u32::MAX);
        t.raise_floor(NumberKind::Identity, IDENTITY_FIRST_CIDR - 1);
        assert_eq!(t.next(NumberKind::Identity), Ok(IDENTITY_FIRST_CIDR - 1));
        assert_eq!(
            t.next(NumberKind::Identity),
            Err(NumbersExhausted {
                kind: NumberKind::Identity,
                end: IDENTITY_FIRST_CIDR
            })
        );
        // The default limits too.
        let mut d = IdTables::default();
        d.raise_floor(NumberKind::Identity, IDENTITY_FIRST_CIDR);
        assert!(d.next(NumberKind::Identity).is_err());
    }

    #[test]
    fn provisional_numbers_are_distinct_and_mark_the_tables() {
        let mut t = small(IDENTITY_FIRST_POD + 1);
        assert_eq!(t.next_or_provisional(NumberKind::Identity), IDENTITY_FIRST_POD);
        assert!(t.exhausted().is_none());
        let a = t.next_or_provisional(NumberKind::Identity);
        let b = t.next_or_provisional(NumberKind::Identity);
        assert_ne!(a, b);
        assert!(a > IDENTITY_FIRST_POD && b > IDENTITY_FIRST_POD, "past the range");
        assert_eq!(t.exhausted().map(|e| e.kind), Some(NumberKind::Identity));
    }

    #[test]
    fn floors_only_raise() {
        let mut t = IdTables::default();
        t.raise_floor(NumberKind::Rule, 42);
        t.raise_floor(NumberKind::Rule, 7);
        assert_eq!(t.next(NumberKind::Rule), Ok(42));
        let mut other = IdTables::default();
        other.raise_floor(NumberKind::Endpoint, 9);
        other.raise_floor(NumberKind::Rule, 3);
        t.raise_to(&other);
        assert_eq!(t.counter(NumberKind::Endpoint), 9);
        assert_eq!(t.counter(NumberKind::Rule), 43);
        let f = t.floors();
        assert_eq!(f.counter(NumberKind::Rule), 43);
        assert!(f.endpoints.is_empty() && f.rules.is_empty());
    }
}
