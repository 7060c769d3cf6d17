//! The mass-deletion guard (incident 2): whether a sync would remove too
//! much, in one step ([`mass_removal`], [`enforcement_removal`]) or
//! cumulatively against the highest counts programmed within the window
//! ([`GuardReference`]), and the confirming direct read of a held sync,
//! with its backoff (see the [`reconcile`](crate::reconcile) module doc).
//!
//! What is measured: the pod identities and the endpoints (losing pods
//! deletes their addresses and state), and, because losing policies opens
//! pods as surely as losing pods, the NetworkPolicies of the
//! snapshot and the isolated endpoint directions (an endpoint isolated for
//! ingress and egress counts twice), and, because a lost Deny opens traffic
//! too, the ClusterNetworkPolicies of the state (by name) and the tier
//! entries of the compile (`Compiled::tiers`, by count: a CNP edit that
//! reshapes its entries is no loss), and, because other nodes' addresses
//! are node identities (a lost one becomes world, which a
//! ClusterNetworkPolicy `nodes` peer or an ipBlock decides differently),
//! the Nodes of the state (by name) and the node addresses of the compile
//! (ipcache entries with a node identity). Each is held at the same
//! threshold, with the same window and the same confirming direct read.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use npm_common::{IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Snapshot;

use super::config::{DIRECT_READ_MAX_BACKOFF, DIRECT_READ_MIN_BACKOFF};
use super::dataplane::AgentDataplane;
use super::syncer::{SyncError, SyncOutcome, Syncer};
use crate::k8s::direct_read_for;

/// The pod identities of a compile (its identity table holds exactly the
/// identities of the pods that own an address), in order.
pub(super) fn pod_identities(c: &Compiled) -> impl Iterator<Item = u32> + '_ {
    c.ids
        .identities
        .range(IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR)
        .map(|(id, _)| *id)
}

/// How many of the ordered `old` are not in the ordered `new`.
pub(super) fn missing_from<T: Ord>(old: impl Iterator<Item = T>, new: impl Iterator<Item = T>) -> usize {
    let mut new = new.peekable();
    let mut missing = 0;
    for o in old {
        while new.next_if(|n| *n < o).is_some() {}
        if new.next_if(|n| *n == o).is_none() {
            missing += 1;
        }
    }
    missing
}

/// The isolated endpoint directions of a compile, in order: an endpoint
/// isolated both ways appears twice.
pub(super) fn isolated_directions(c: &Compiled) -> impl Iterator<Item = (u32, Direction)> + '_ {
    c.endpoints.iter().flat_map(|(id, e)| {
        let ingress = e.isolated_ingress.then_some((*id, Direction::Ingress));
        let egress = e.isolated_egress.then_some((*id, Direction::Egress));
        ingress.into_iter().chain(egress)
    })
}

fn share(old: usize, removed: usize) -> f64 {
    if old == 0 {
        0.0
    } else {
        removed as f64 / old as f64
    }
}

/// Which share of `old`'s pod identities and endpoints `new` no longer has;
/// `Some(description)` when either exceeds `threshold`.
pub fn mass_removal(old: &Compiled, new: &Compiled, threshold: f64) -> Option<String> {
    let oi = pod_identities(old).count();
    let removed_ids = missing_from(pod_identities(old), pod_identities(new));
    let removed_eps = missing_from(old.endpoints.keys(), new.endpoints.keys());
    let (si, se) = (share(oi, removed_ids), share(old.endpoints.len(), removed_eps));
    (si > threshold || se > threshold).then(|| {
        format!(
            "{removed_ids}/{oi} identities and {removed_eps}/{} endpoints would be removed",
            old.endpoints.len()
        )
    })
}

/// Which share of the NetworkPolicies last programmed (`programmed`, in
/// order) the snapshot `next` no longer has, and which share of `old`'s
/// isolated endpoint directions `new` no longer has; `Some(description)`
/// when either exceeds `threshold`.
pub fn enforcement_removal(
    programmed: &[(String, String)],
    next: &Snapshot,
    old: &Compiled,
    new: &Compiled,
    threshold: f64,
) -> Option<String> {
    let removed_policies = missing_from(programmed.iter(), next.policies.keys());
    let old_isolated = isolated_directions(old).count();
    let removed_isolated = missing_from(isolated_directions(old), isolated_directions(new));
    let (sp, si) = (
        share(programmed.len(), removed_policies),
        share(old_isolated, removed_isolated),
    );
    (sp > threshold || si > threshold).then(|| {
        format!(
            "{removed_policies}/{} NetworkPolicies and {removed_isolated}/{old_isolated} isolated endpoint \
             directions would be removed",
            programmed.len()
        )
    })
}

/// The named objects whose removal is checked by name: the
/// ClusterNetworkPolicies (with their tier entries) and the Nodes (with
/// their addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Named {
    /// ClusterNetworkPolicies, counted with the tier entries they compile to.
    ClusterPolicies,
    /// Nodes, counted with the node addresses of the compile.
    Nodes,
}

impl Named {
    /// What the names are, what the derived count counts, and that count
    /// in a compile.
    fn what(self, c: &Compiled) -> (&'static str, &'static str, usize) {
        match self {
            Named::ClusterPolicies => ("ClusterNetworkPolicies", "tier entries", c.tiers.len()),
            Named::Nodes => ("Nodes", "node addresses", node_addresses(c)),
        }
    }
}

/// Which share of the `kind` objects last programmed (`programmed`, names
/// in order) the next state (`next`, names in order) no longer has, and by
/// which share their derived count (tier entries, node addresses) of `new`
/// fell below that of `old`; `Some(description)` when either exceeds
/// `threshold`.
pub fn named_removal<'a>(
    kind: Named,
    programmed: &'a [String],
    next: impl Iterator<Item = &'a str>,
    old: &Compiled,
    new: &Compiled,
    threshold: f64,
) -> Option<String> {
    let ((names, counted, old), (_, _, new)) = (kind.what(old), kind.what(new));
    let removed = missing_from(programmed.iter().map(String::as_str), next);
    let removed_count = old.saturating_sub(new);
    let (sn, sc) = (share(programmed.len(), removed), share(old, removed_count));
    (sn > threshold || sc > threshold).then(|| {
        format!(
            "{removed}/{} {names} and {removed_count}/{old} {counted} would be removed",
            programmed.len()
        )
    })
}

/// The tiered endpoint directions of a compile: per endpoint, each
/// (direction, tier) with tier entries for its subject (the endpoint's
/// [`TierPresence`](npm_policy::compiled::TierPresence) flags; what a
/// dataplane can report of a previous agent's state, unlike the entries,
/// whose kernel form is not one per entry).
pub fn tiered_directions(c: &Compiled) -> usize {
    use npm_policy::compiled::Tier;
    c.endpoints
        .values()
        .map(|e| {
            [Tier::Admin, Tier::Baseline]
                .into_iter()
                .flat_map(|t| [(t, Direction::Ingress), (t, Direction::Egress)])
                .filter(|(t, d)| e.tiers.has(*t, *d))
                .count()
        })
        .sum()
}

/// The node addresses of a compile: its ipcache entries whose identity is
/// a node identity.
pub fn node_addresses(c: &Compiled) -> usize {
    c.ipcache
        .values()
        .filter(|e| c.ids.node_identities.contains_key(&e.identity))
        .count()
}

/// The reference of the cumulative mass-deletion check: the highest pod
/// identity, endpoint, NetworkPolicy, isolated endpoint direction,
/// ClusterNetworkPolicy and tier entry counts
/// programmed within a time window since the last confirmation (a
/// sliding-window maximum: each queue holds the samples that can still
/// become the maximum, oldest first), and the NetworkPolicies last
/// programmed (for the one-step check).
#[derive(Debug, Default)]
pub struct GuardReference {
    identities: VecDeque<(Instant, usize)>,
    endpoints: VecDeque<(Instant, usize)>,
    policies: VecDeque<(Instant, usize)>,
    isolated: VecDeque<(Instant, usize)>,
    cluster_policies: VecDeque<(Instant, usize)>,
    tier_entries: VecDeque<(Instant, usize)>,
    tiered: VecDeque<(Instant, usize)>,
    nodes: VecDeque<(Instant, usize)>,
    node_addresses: VecDeque<(Instant, usize)>,
    /// The Nodes (names) last programmed, in order (`None` before the
    /// first sync).
    programmed_nodes: Option<Vec<String>>,
    /// The NetworkPolicies (namespace, name) last programmed, in order
    /// (`None` before the first sync).
    programmed_policies: Option<Vec<(String, String)>>,
    /// The ClusterNetworkPolicies (names) last programmed, in order
    /// (`None` before the first sync).
    programmed_cluster_policies: Option<Vec<String>>,
}

fn push_max(q: &mut VecDeque<(Instant, usize)>, now: Instant, v: usize) {
    while q.back().is_some_and(|(_, b)| *b <= v) {
        q.pop_back();
    }
    q.push_back((now, v));
}

/// The bound of a cumulative check: the instant of the check, the window
/// before it whose high-water counts are the reference, and the share of
/// them that may go.
pub type Bound = (Instant, Duration, f64);

/// One count of a cumulative check: its high-water samples, the count the
/// next state would have, and what it counts (for the message).
struct Count<'a> {
    samples: &'a mut VecDeque<(Instant, usize)>,
    next: usize,
    what: &'static str,
}

impl<'a> Count<'a> {
    fn of(samples: &'a mut VecDeque<(Instant, usize)>, next: usize, what: &'static str) -> Self {
        Count { samples, next, what }
    }
}

/// `Some(description)` when either count is more than `threshold` below
/// its high-water within `window` before `now` (samples older than the
/// window are expired first).
fn cumulative_pair(a: Count<'_>, b: Count<'_>, (now, window, threshold): Bound) -> Option<String> {
    expire(a.samples, now, window);
    expire(b.samples, now, window);
    let ha = a.samples.front().map_or(0, |s| s.1);
    let hb = b.samples.front().map_or(0, |s| s.1);
    let (ra, rb) = (ha.saturating_sub(a.next), hb.saturating_sub(b.next));
    let (wa, wb) = (a.what, b.what);
    (share(ha, ra) > threshold || share(hb, rb) > threshold).then(|| {
        format!(
            "{ra} of up to {ha} {wa} and {rb} of up to {hb} {wb} gone within {window:?} since the last confirmation"
        )
    })
}

fn expire(q: &mut VecDeque<(Instant, usize)>, now: Instant, window: Duration) {
    // The newest sample is what is programmed now: it always stays.
    while q.len() > 1
        && q.front()
            .is_some_and(|(t, _)| now.saturating_duration_since(*t) > window)
    {
        q.pop_front();
    }
}

impl GuardReference {
    /// Record the counts just programmed.
    pub fn observe(&mut self, now: Instant, identities: usize, endpoints: usize) {
        // The newest sample was programmed until now: its time moves up, so
        // a count left unchanged through a quiet period longer than the
        // window is not forgotten the moment a smaller one is recorded.
        for q in [&mut self.identities, &mut self.endpoints] {
            if let Some(b) = q.back_mut() {
                b.0 = b.0.max(now);
            }
        }
        push_max(&mut self.identities, now, identities);
        push_max(&mut self.endpoints, now, endpoints);
    }

    /// Record the NetworkPolicies of the snapshot just programmed and the
    /// isolated endpoint directions of what was programmed (`programmed`).
    pub fn observe_enforcement(&mut self, now: Instant, snapshot: &Snapshot, programmed: &Compiled) {
        for q in [&mut self.policies, &mut self.isolated] {
            if let Some(b) = q.back_mut() {
                b.0 = b.0.max(now);
            }
        }
        push_max(&mut self.policies, now, snapshot.policies.len());
        push_max(&mut self.isolated, now, isolated_directions(programmed).count());
        self.programmed_policies = Some(snapshot.policies.keys().cloned().collect());
    }

    /// Record the ClusterNetworkPolicies (`names`, in order) of the state
    /// just programmed and the tier entries and tiered endpoint directions
    /// ([`tiered_directions`]) of what was programmed.
    pub fn observe_tiers(&mut self, now: Instant, names: Vec<String>, programmed: &Compiled) {
        for q in [&mut self.cluster_policies, &mut self.tier_entries, &mut self.tiered] {
            if let Some(b) = q.back_mut() {
                b.0 = b.0.max(now);
            }
        }
        push_max(&mut self.cluster_policies, now, names.len());
        push_max(&mut self.tier_entries, now, programmed.tiers.len());
        push_max(&mut self.tiered, now, tiered_directions(programmed));
        self.programmed_cluster_policies = Some(names);
    }

    /// Record the Nodes (`names`, in order) of the state just programmed
    /// and the node addresses of what was programmed.
    pub fn observe_nodes(&mut self, now: Instant, names: Vec<String>, programmed: &Compiled) {
        for q in [&mut self.nodes, &mut self.node_addresses] {
            if let Some(b) = q.back_mut() {
                b.0 = b.0.max(now);
            }
        }
        push_max(&mut self.nodes, now, names.len());
        push_max(&mut self.node_addresses, now, node_addresses(programmed));
        self.programmed_nodes = Some(names);
    }

    /// The Nodes last programmed, in order (`None` before the first sync).
    pub fn programmed_nodes(&self) -> Option<&[String]> {
        self.programmed_nodes.as_deref()
    }

    /// `Some(description)` when the next state has more than `threshold`
    /// fewer Nodes (`next_count`), or its compile `compiled` fewer node
    /// addresses, than the high-water counts within `window` before `now`.
    pub fn cumulative_node_removal(
        &mut self,
        next_count: usize,
        compiled: &Compiled,
        (now, window, threshold): Bound,
    ) -> Option<String> {
        let addresses = node_addresses(compiled);
        cumulative_pair(
            Count::of(&mut self.nodes, next_count, "Nodes"),
            Count::of(&mut self.node_addresses, addresses, "node addresses"),
            (now, window, threshold),
        )
    }

    /// The ClusterNetworkPolicies last programmed, in order (`None`
    /// before the first sync).
    pub fn programmed_cluster_policies(&self) -> Option<&[String]> {
        self.programmed_cluster_policies.as_deref()
    }

    /// `Some(description)` when the next state has more than `threshold`
    /// fewer ClusterNetworkPolicies (`next_count`), or its compile
    /// `compiled` fewer tier entries or tiered endpoint directions, than
    /// the high-water counts within `window` before `now`.
    pub fn cumulative_tier_removal(
        &mut self,
        next_count: usize,
        compiled: &Compiled,
        (now, window, threshold): Bound,
    ) -> Option<String> {
        let tiered = tiered_directions(compiled);
        expire(&mut self.tiered, now, window);
        let high = self.tiered.front().map_or(0, |s| s.1);
        let removed = high.saturating_sub(tiered);
        if share(high, removed) > threshold {
            return Some(format!(
                "{removed} of up to {high} tiered endpoint directions gone within {window:?} since the last confirmation"
            ));
        }
        cumulative_pair(
            Count::of(&mut self.cluster_policies, next_count, "ClusterNetworkPolicies"),
            Count::of(&mut self.tier_entries, compiled.tiers.len(), "tier entries"),
            (now, window, threshold),
        )
    }

    /// Record the isolated endpoint directions of the state adopted from a
    /// previous agent (before the first sync; no NetworkPolicy count is
    /// known then).
    pub fn observe_adopted_isolation(&mut self, now: Instant, isolated: usize) {
        push_max(&mut self.isolated, now, isolated);
    }

    /// Record the tiered endpoint directions ([`tiered_directions`]) of the
    /// state adopted from a previous agent (before the first sync; no
    /// ClusterNetworkPolicy name nor tier entry count is known then).
    pub fn observe_adopted_tiers(&mut self, now: Instant, tiered: usize) {
        push_max(&mut self.tiered, now, tiered);
    }

    /// A direct read confirmed the state: the counts just programmed become
    /// the whole reference (the NetworkPolicy, isolation, CNP and tier
    /// counts too: [`GuardReference::observe_enforcement`] and
    /// [`GuardReference::observe_tiers`] record them next).
    pub fn reset(&mut self, now: Instant, identities: usize, endpoints: usize) {
        self.identities.clear();
        self.endpoints.clear();
        self.policies.clear();
        self.isolated.clear();
        self.cluster_policies.clear();
        self.tier_entries.clear();
        self.tiered.clear();
        self.nodes.clear();
        self.node_addresses.clear();
        self.observe(now, identities, endpoints);
    }

    /// The NetworkPolicies last programmed, in order (`None` before the
    /// first sync).
    pub fn programmed_policies(&self) -> Option<&[(String, String)]> {
        self.programmed_policies.as_deref()
    }

    /// `Some(description)` when the snapshot `next` has more than
    /// `threshold` fewer NetworkPolicies, or its compile `compiled` fewer
    /// isolated endpoint directions, than the high-water counts within
    /// `window` before `now`.
    pub fn cumulative_enforcement_removal(
        &mut self,
        next: &Snapshot,
        compiled: &Compiled,
        (now, window, threshold): Bound,
    ) -> Option<String> {
        let isolated = isolated_directions(compiled).count();
        cumulative_pair(
            Count::of(&mut self.policies, next.policies.len(), "NetworkPolicies"),
            Count::of(&mut self.isolated, isolated, "isolated endpoint directions"),
            (now, window, threshold),
        )
    }

    /// The highest (identities, endpoints) counts programmed within
    /// `window` before `now` (since the last reset); `(0, 0)` before the
    /// first sample.
    pub fn high_water(&mut self, now: Instant, window: Duration) -> (usize, usize) {
        expire(&mut self.identities, now, window);
        expire(&mut self.endpoints, now, window);
        (
            self.identities.front().map_or(0, |s| s.1),
            self.endpoints.front().map_or(0, |s| s.1),
        )
    }

    /// `Some(description)` when `next` has more than `threshold` fewer pod
    /// identities or endpoints than the high-water counts.
    pub fn cumulative_removal(&mut self, next: &Compiled, (now, window, threshold): Bound) -> Option<String> {
        let identities = pod_identities(next).count();
        cumulative_pair(
            Count::of(&mut self.identities, identities, "identities"),
            Count::of(&mut self.endpoints, next.endpoints.len(), "endpoints"),
            (now, window, threshold),
        )
    }
}

impl<D: AgentDataplane> Syncer<D> {
    /// Whether `next` would remove too much, in one step or cumulatively
    /// (see the module doc).
    pub(super) fn held(&mut self, now: Instant) -> Option<String> {
        let next = self.incremental.compiled();
        let snapshot = self.incremental.snapshot();
        let (threshold, window) = (self.cfg.mass_delete_threshold, self.cfg.mass_delete_window);
        if let Some((prog, _)) = &self.programmed {
            if let Some(what) = mass_removal(prog, next, threshold) {
                return Some(what);
            }
            if let Some(policies) = self.guard.programmed_policies() {
                if let Some(what) = enforcement_removal(policies, snapshot, prog, next, threshold) {
                    return Some(what);
                }
            }
            if let Some(cnps) = self.guard.programmed_cluster_policies() {
                let names = self.incremental.cluster_policy_names();
                if let Some(what) = named_removal(Named::ClusterPolicies, cnps, names, prog, next, threshold) {
                    return Some(what);
                }
            }
            if let Some(nodes) = self.guard.programmed_nodes() {
                let names = self.incremental.node_names();
                if let Some(what) = named_removal(Named::Nodes, nodes, names, prog, next, threshold) {
                    return Some(what);
                }
            }
        }
        if let Some(what) = self.guard.cumulative_removal(next, (now, window, threshold)) {
            return Some(what);
        }
        if let Some(what) = self
            .guard
            .cumulative_enforcement_removal(snapshot, next, (now, window, threshold))
        {
            return Some(what);
        }
        let cnps = self.incremental.cluster_policy_names().count();
        if let Some(what) = self.guard.cumulative_tier_removal(cnps, next, (now, window, threshold)) {
            return Some(what);
        }
        let nodes = self.incremental.node_names().count();
        self.guard
            .cumulative_node_removal(nodes, next, (now, window, threshold))
    }

    /// A sync is held (it would remove `what`): confirm it with a direct
    /// read of the API server, which replaces the cached state as the
    /// compiler's base, unless the direct reads wait out their backoff.
    pub(super) async fn confirm_by_direct_read(
        &mut self,
        what: String,
        outcome: &mut SyncOutcome,
    ) -> Result<(), SyncError> {
        if let Some(at) = self.next_direct_read_at {
            let now = Instant::now();
            if now < at {
                // Stay held, without another full LIST of the cluster.
                return Err(SyncError::DirectReadDeferred {
                    what,
                    retry_in: at - now,
                });
            }
        }
        outcome.guarded = true;
        self.metrics.destructive_deferred.increment(1);
        tracing::warn!(%what, "mass deletion held; confirming with a direct read of the API server");
        let Some(client) = self.client.clone() else {
            return Err(SyncError::NoDirectReader { what });
        };
        let read = direct_read_for(&self.cache, &client, self.cfg.page_size).await;
        // Until a read confirms a deletion, reads back off.
        self.next_direct_read_at = Instant::now().checked_add(self.direct_read_backoff);
        self.direct_read_backoff = (self.direct_read_backoff * 2).min(DIRECT_READ_MAX_BACKOFF);
        let fresh = read.map_err(|source| {
            self.metrics.error("direct-read");
            SyncError::DirectRead {
                what: what.clone(),
                source,
            }
        })?;
        // The direct read replaces the cached state as the compiler's
        // base; the next sync diffs the cache against it.
        self.compile_state(&fresh, true);
        match self.held(Instant::now()) {
            Some(seen) => {
                tracing::warn!(%seen, "direct read confirms the mass deletion; applying");
                self.next_direct_read_at = None;
                self.direct_read_backoff = DIRECT_READ_MIN_BACKOFF;
            }
            None => {
                tracing::warn!("direct read does not confirm the mass deletion; programming the direct read")
            }
        }
        Ok(())
    }
}
