//! Degraded mode: when a compiled state does not fit the maps, the largest
//! part of it that fits and never allows more than the state itself
//! ([`EbpfDataplane::fit`]), and the cheap test that a diff fits
//! ([`EbpfDataplane::diff_fits`]) so that the normal path never pays for it.
//!
//! What is left out, and why it fails closed:
//!
//! - `NPM_POLICY` (allow entries): a subject direction (subject, the pod
//!   identity whose entries govern its local endpoints, and ingress or
//!   egress) whose new allows do not fit keeps only the allows
//!   that are both programmed and still wanted (the last good state minus
//!   what the current policy revoked; deny-all for a direction with no
//!   programmed state, e.g. the first sync after a restart, or a subject
//!   new since the last good state: a relabelled pod whose new identity's
//!   entries were trimmed is denied in that direction, it never keeps its
//!   old identity's allows, which are another subject's). Every endpoint of
//!   a trimmed subject is degraded alike. Its isolation
//!   follows the current policy, so it never becomes "not isolated" for
//!   lack of room, and it never allows what the current policy denies.
//!   The directions that free the most keys go first, so as few subjects
//!   as possible are degraded; every other subject gets its whole policy.
//!   A programmed entry that is still wanted is never removed to make room.
//! - `NPM_IPCACHE` (exact addresses): the addresses that did not fit are
//!   left out, newest first (never this node's addresses, never a local
//!   endpoint's, never one already programmed). An address that is not in
//!   the ipcache is decided as outside the cluster: by its CIDR identity
//!   only, never by another pod's identity (an address whose owner changed
//!   is rewritten in place, which needs no room, and a removed address is
//!   removed). So a NetworkPolicy allow by pod or namespace selector does
//!   not match it; an ipBlock allow covering it does, as it does for any
//!   pod address. Not while ClusterNetworkPolicies are compiled (any tier
//!   entry): a tier Deny or Pass that selects the left-out pod by its
//!   namespace or labels would no longer match it, and a lower-ranked
//!   Accept (or no rule at all) would then allow what the Deny forbids. So
//!   with tiers the ipcache is not trimmed and a state that does not fit it
//!   fails as the maps below do.
//!
//! The other maps (`NPM_CIDRS`, `NPM_TIERS`, the endpoint and Service
//! tables) are not trimmed: leaving out an ipBlock `except` prefix or a
//! ClusterNetworkPolicy Deny would allow more. A state that does not fit
//! them fails as before (the agent keeps the last good state and retries).
//!
//! The agent programs the fitted state as it programs any state (and keeps
//! it as what is programmed), so the next state that fits, after entries
//! are removed or the maps are resized, is applied by the ordinary diff and
//! the report clears.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use npm_common::{maps, PolicyKey, IDENTITY_HOST};
use npm_policy::compiled::{Compiled, CompiledDiff, PolicyEntry, PolicyMap};

use super::errors::EbpfError;
use super::{translate, EbpfDataplane};

/// One map the compiled state did not fit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shortfall {
    /// The map (`NPM_POLICY`, `NPM_IPCACHE`).
    pub map: &'static str,
    /// Entries the whole compiled state needs in it.
    pub needed: u64,
    /// Entries the map holds at most (its real `max_entries`).
    pub capacity: u64,
    /// Entries the fitted state puts in it.
    pub programmed: u64,
    /// How many subject directions (`NPM_POLICY`: a subject is the pod
    /// identity whose entries govern its local endpoints) or addresses
    /// (`NPM_IPCACHE`) were left on a reduced state.
    pub degraded: usize,
    /// What `degraded` counts: `subject directions` or `addresses`.
    pub unit: &'static str,
}

impl std::fmt::Display for Shortfall {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "map {} is full: {} entries needed, {} fit; {} written, {} {} on a reduced state (last good entries still wanted, else denied or unknown)",
            self.map, self.needed, self.capacity, self.programmed, self.degraded, self.unit
        )
    }
}

/// A compiled state trimmed to fit the maps ([`EbpfDataplane::fit`]).
#[derive(Clone, Debug)]
pub struct Fitted {
    /// What to program instead of the whole state.
    pub compiled: Compiled,
    /// The maps it did not fit, and what was left out.
    pub shortfalls: Vec<Shortfall>,
}

/// The most `NPM_POLICY` keys one entry expands to (a port range splits
/// into at most 30 aligned blocks): a bound that needs no translation.
pub(super) const MAX_KEYS_PER_ENTRY: usize = 32;

/// (subject, direction): the unit of `NPM_POLICY` degradation.
type Group = (u32, u8);

/// The distinct LPM keys of `entries` (all of one [`Group`]).
fn distinct_keys<'a>(entries: impl Iterator<Item = &'a PolicyEntry>) -> Result<usize, EbpfError> {
    let mut keys: BTreeSet<PolicyKey> = BTreeSet::new();
    for e in entries {
        keys.extend(translate::policy_keys(e)?);
    }
    Ok(keys.len())
}

impl EbpfDataplane {
    /// Whether `diff`, applied to what the writer last wrote, surely fits
    /// `NPM_POLICY` and `NPM_IPCACHE` even before its removals (its upserts
    /// are written first). A cheap bound (the diff's own entries); `false`
    /// when the maps' contents are not known (before a full sync): the
    /// caller then asks [`Self::fit`].
    pub fn diff_fits(&self, diff: &CompiledDiff) -> Result<bool, EbpfError> {
        if !self.fill.known {
            return Ok(false);
        }
        let actual = &self.sizes.actual;
        if self.fill.ipcache + diff.ipcache.upsert.len() > actual.ipcache as usize {
            return Ok(false);
        }
        if self.fill.policy_keys + diff.policy.upsert.len() * MAX_KEYS_PER_ENTRY <= actual.policy as usize {
            return Ok(true);
        }
        let mut keys = self.fill.policy_keys;
        for (e, _) in &diff.policy.upsert {
            keys += translate::policy_keys(e)?.len();
            if keys > actual.policy as usize {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// `target` itself when it fits `NPM_POLICY` and `NPM_IPCACHE`
    /// (`None`), else the largest part of it that fits and fails closed
    /// (see the module doc), given `programmed`, the state the maps hold
    /// now (`None`: unknown, e.g. before the first full sync).
    pub fn fit(&self, programmed: Option<&Compiled>, target: &Compiled) -> Result<Option<Fitted>, EbpfError> {
        let mut shortfalls = Vec::new();
        let policy = self.fit_policy(programmed, target)?;
        let ipcache = self.fit_ipcache(programmed, target);
        if policy.is_none() && ipcache.is_none() {
            return Ok(None);
        }
        let mut compiled = target.clone();
        if let Some((trimmed, s)) = policy {
            compiled.policy = trimmed;
            shortfalls.push(s);
        }
        if let Some((left_out, s)) = ipcache {
            compiled.ipcache.retain(|a, _| !left_out.contains(a));
            shortfalls.push(s);
        }
        Ok(Some(Fitted { compiled, shortfalls }))
    }

    /// The `NPM_POLICY` part of [`Self::fit`]: the trimmed policy and its
    /// report, or `None` when the target's policy fits.
    fn fit_policy(
        &self,
        programmed: Option<&Compiled>,
        target: &Compiled,
    ) -> Result<Option<(PolicyMap, Shortfall)>, EbpfError> {
        let cap = self.sizes.actual.policy as usize;
        // The target's entries by group (contiguous: entries order by
        // subject, then direction).
        let mut groups: BTreeMap<Group, Vec<&PolicyEntry>> = BTreeMap::new();
        for e in target.policy.keys() {
            groups.entry((e.subject, e.direction.as_u8())).or_default().push(e);
        }
        let mut sizes: BTreeMap<Group, usize> = BTreeMap::new();
        for (g, entries) in &groups {
            sizes.insert(*g, distinct_keys(entries.iter().copied())?);
        }
        let needed: usize = sizes.values().sum();
        if needed <= cap {
            return Ok(None);
        }
        let old = programmed.map(|p| &p.policy);
        let kept = |e: &PolicyEntry| old.is_some_and(|o| o.contains_key(e));
        // Candidates: groups with entries not programmed; trimming keeps
        // the programmed ones. (saving, group, trimmed keys)
        let mut candidates: Vec<(usize, Group, usize)> = Vec::new();
        for (g, entries) in &groups {
            if entries.iter().all(|e| kept(e)) {
                continue;
            }
            let t = distinct_keys(entries.iter().copied().filter(|e| kept(e)))?;
            candidates.push((sizes[g] - t, *g, t));
        }
        candidates.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        let mut total = needed;
        let mut trimmed: BTreeSet<Group> = BTreeSet::new();
        for (saving, g, _) in candidates {
            if total <= cap {
                break;
            }
            total -= saving;
            trimmed.insert(g);
        }
        let policy: PolicyMap = target
            .policy
            .iter()
            .filter(|(e, _)| !trimmed.contains(&(e.subject, e.direction.as_u8())) || kept(e))
            .map(|(e, r)| (*e, *r))
            .collect();
        let shortfall = Shortfall {
            map: maps::POLICY,
            needed: needed as u64,
            capacity: cap as u64,
            programmed: total as u64,
            degraded: trimmed.len(),
            unit: "subject directions",
        };
        Ok(Some((policy, shortfall)))
    }

    /// The `NPM_IPCACHE` part of [`Self::fit`]: the addresses left out and
    /// the report, or `None` when the target's ipcache fits.
    fn fit_ipcache(&self, programmed: Option<&Compiled>, target: &Compiled) -> Option<(BTreeSet<IpAddr>, Shortfall)> {
        let cap = self.sizes.actual.ipcache as usize;
        let needed = target.ipcache.len();
        // Trimming would widen tier verdicts (see the module doc): no fit.
        if needed <= cap || !target.tiers.is_empty() {
            return None;
        }
        let local: BTreeSet<IpAddr> = target
            .endpoints
            .values()
            .flat_map(|ep| [ep.ipv4.map(IpAddr::V4), ep.ipv6.map(IpAddr::V6)])
            .flatten()
            .collect();
        let is_old = |a: &IpAddr| programmed.is_some_and(|p| p.ipcache.contains_key(a));
        let protected = |a: &IpAddr, identity: u32| identity == IDENTITY_HOST || local.contains(a);
        // New remote addresses first, highest first; then (nothing
        // programmed is known) any other remote address.
        let mut order: Vec<&IpAddr> = target
            .ipcache
            .iter()
            .filter(|(a, e)| !protected(a, e.identity) && !is_old(a))
            .map(|(a, _)| a)
            .collect();
        order.reverse();
        let excess = needed - cap;
        let left_out: BTreeSet<IpAddr> = order.into_iter().take(excess).copied().collect();
        let shortfall = Shortfall {
            map: maps::IPCACHE,
            needed: needed as u64,
            capacity: cap as u64,
            programmed: (needed - left_out.len()) as u64,
            degraded: left_out.len(),
            unit: "addresses",
        };
        Some((left_out, shortfall))
    }
}
