//! The mass-deletion guard (incident 2): whether a sync would remove too
//! much, in one step ([`mass_removal`]) or cumulatively against the
//! highest counts programmed within the window ([`GuardReference`]), and
//! the confirming direct read of a held sync, with its backoff (see the
//! [`reconcile`](crate::reconcile) module doc).

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use npm_common::{IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use npm_policy::compiled::Compiled;

use super::config::{DIRECT_READ_MAX_BACKOFF, DIRECT_READ_MIN_BACKOFF};
use super::dataplane::AgentDataplane;
use super::syncer::{SyncError, SyncOutcome, Syncer};
use crate::k8s::direct_read;

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

/// The reference of the cumulative mass-deletion check: the highest pod
/// identity and endpoint counts programmed within a time window since the
/// last confirmation (a sliding-window maximum: each queue holds the
/// samples that can still become the maximum, oldest first).
#[derive(Debug, Default)]
pub struct GuardReference {
    identities: VecDeque<(Instant, usize)>,
    endpoints: VecDeque<(Instant, usize)>,
}

fn push_max(q: &mut VecDeque<(Instant, usize)>, now: Instant, v: usize) {
    while q.back().is_some_and(|(_, b)| *b <= v) {
        q.pop_back();
    }
    q.push_back((now, v));
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

    /// A direct read confirmed the state: the counts just programmed become
    /// the whole reference.
    pub fn reset(&mut self, now: Instant, identities: usize, endpoints: usize) {
        self.identities.clear();
        self.endpoints.clear();
        self.observe(now, identities, endpoints);
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
    pub fn cumulative_removal(
        &mut self,
        next: &Compiled,
        now: Instant,
        window: Duration,
        threshold: f64,
    ) -> Option<String> {
        let (hi, he) = self.high_water(now, window);
        let (ni, ne) = (pod_identities(next).count(), next.endpoints.len());
        let (ri, re) = (hi.saturating_sub(ni), he.saturating_sub(ne));
        (share(hi, ri) > threshold || share(he, re) > threshold).then(|| {
            format!(
                "{ri} of up to {hi} identities and {re} of up to {he} endpoints gone within {window:?} \
                 since the last confirmation"
            )
        })
    }
}

impl<D: AgentDataplane> Syncer<D> {
    /// Whether `next` would remove too much, in one step or cumulatively
    /// (see the module doc).
    pub(super) fn held(&mut self, now: Instant) -> Option<String> {
        let next = self.incremental.compiled();
        let threshold = self.cfg.mass_delete_threshold;
        if let Some((prog, _)) = &self.programmed {
            if let Some(what) = mass_removal(prog, next, threshold) {
                return Some(what);
            }
        }
        self.guard
            .cumulative_removal(next, now, self.cfg.mass_delete_window, threshold)
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
        let read = direct_read(&client, self.cfg.page_size).await;
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
