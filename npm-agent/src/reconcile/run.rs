//! The loop around [`Syncer::sync_once`]: wait for a change, coalesce
//! changes for the debounce, sync, retry failures with exponential backoff,
//! and poll the dataplane's counters and deny events on the stats tick.
//!
//! The loop reports to the shared [`Health`](crate::telemetry::Health): a
//! pass of the loop (a sync, a stats tick, or the heartbeat tick every
//! [`HEARTBEAT`] when idle) is progress for the `/healthz` watchdog, and
//! each sync's outcome feeds the readiness checks (a held removal, an
//! apply that failed and whether a map is full, a sync that went through,
//! a reduced state programmed because the compiled state does not fit a
//! map: degraded mode, until a later sync's target fits).
//!
//! The agent runs the loop on a dedicated OS thread with a runtime of its
//! own ([`Syncer::spawn_thread`], issue 12 §5): a long compile or a burst of
//! map syscalls blocks that thread only, never the runtime of the watchers,
//! the CNI server and the health endpoints. The dirty signal (a
//! `tokio::sync::Notify` of the cache) and the node-address watch cross
//! runtimes; the direct reads use the agent's client, whose connection
//! tasks stay on the agent's runtime.

use std::time::{Duration, Instant};

use tokio::sync::oneshot;

use super::dataplane::AgentDataplane;
use super::syncer::{SyncError, Syncer};
use crate::node::NodeAddresses;

/// Longest time between two passes of an idle loop (the `/healthz`
/// watchdog's progress; well below its 60 s limit).
pub const HEARTBEAT: Duration = Duration::from_secs(5);

/// How long to wait before a sync: `debounce` after the oldest change not
/// yet programmed (`first`), or a whole `debounce` without one. A debounce
/// too large to add to an instant waits the whole debounce (never panics).
pub(super) fn debounce_wait(first: Option<Instant>, debounce: Duration, now: Instant) -> Duration {
    match first.and_then(|t| t.checked_add(debounce)) {
        Some(until) => until.saturating_duration_since(now),
        None => debounce,
    }
}

/// The instant `after` from now (far in the future when that overflows).
fn retry_instant(after: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(86400 * 365))
}

/// Resolves when this node's addresses (or their readability) changed;
/// never without a watcher.
async fn node_addresses_changed(addresses: Option<&mut NodeAddresses>) {
    if let Some(a) = addresses {
        if a.changed().await {
            return;
        }
    }
    std::future::pending().await
}

impl<D: AgentDataplane> Syncer<D> {
    /// Read the dataplane's counters and deny events into metrics and logs.
    pub fn poll_stats(&mut self) {
        match self.dataplane.counters() {
            Ok(c) => {
                self.metrics.dataplane_counters(&c);
                let programmed = self.programmed.as_ref().map(|p| &p.0);
                self.metrics.rules.fold(&c.rules, programmed);
            }
            Err(e) => {
                self.metrics.error("counters");
                tracing::warn!(error = %e, "reading dataplane counters failed");
            }
        }
        self.metrics.map_fill(&self.dataplane.map_fill());
        if let (Some(check), Some((prog, interfaces))) = (&mut self.bridge_nf, &self.programmed) {
            check.report(prog, interfaces, &self.readiness, &self.metrics);
        }
        if let Some(lost) = self.dataplane.events_lost() {
            self.metrics.ringbuf_events_lost(lost);
        }
        // Deny events and the allow events of `report_new` endpoints; an
        // allow event is not a deny.
        let events = self.dataplane.poll_deny_events();
        let denies = events.iter().filter(|e| !e.is_allow()).count();
        self.metrics.deny_events.increment(denies as u64);
        let programmed = self.programmed.as_ref().map(|p| &p.0);
        // Connection semantics `enforce`: each cut connection, by the
        // namespace of the pod whose direction denied it.
        for e in events
            .iter()
            .filter(|e| e.reason == npm_common::Reason::ConnectionCut as u8)
        {
            let ns = programmed
                .and_then(|p| p.endpoints.get(&e.endpoint))
                .map_or("_unknown", |ep| ep.pod.namespace.as_str());
            let dir = if e.direction == npm_common::DIR_EGRESS {
                "egress"
            } else {
                "ingress"
            };
            self.metrics.connection_cut(ns, dir);
        }
        let names = crate::telemetry::flowlog::Names::new(programmed, self.incremental.snapshot());
        let suppressed = self.flowlog.log_all(&events, &names, Instant::now());
        // Audit mode: the allow events the audited policies would deny.
        let snapshot = self.incremental.snapshot();
        let would_deny = self
            .audit
            .would_deny(&events, &names, programmed, snapshot, &self.cfg.compile, &self.metrics);
        self.audit.log(&would_deny, &mut self.flowlog, Instant::now());
        self.metrics.deny_events_suppressed.increment(suppressed);
    }

    /// Run forever: wait for changes, debounce, sync, retry with backoff.
    pub async fn run(mut self) {
        let min_backoff = Duration::from_millis(100);
        let mut backoff = min_backoff;
        // When to sync again without a change (a retry); kept across loop
        // passes so that the stats tick does not postpone it.
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut stats = tokio::time::interval(self.cfg.stats_interval.max(Duration::from_millis(1)));
        stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut heartbeat = tokio::time::interval(HEARTBEAT);
        heartbeat.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cache = self.cache.clone();
        let health = self.readiness.clone();
        let mut node_addresses = self.cfg.node_addresses.clone();
        let view = self.programmed_view.clone();
        loop {
            health.loop_progress();
            let far = tokio::time::Instant::now() + Duration::from_secs(3600);
            let sleep = tokio::time::sleep_until(retry_at.unwrap_or(far));
            tokio::select! {
                _ = cache.changed.notified() => {}
                _ = sleep, if retry_at.is_some() => {}
                _ = stats.tick() => { self.poll_stats(); continue; }
                _ = heartbeat.tick() => continue,
                // `/explain` waits for a copy of what is programmed.
                _ = view.wanted() => { self.publish_programmed(); continue; }
                _ = node_addresses_changed(node_addresses.as_mut()) => {}
            }
            // Coalesce changes for `debounce` after the oldest one not yet
            // programmed (already waited for when it came during a sync).
            let wait = debounce_wait(cache.first_unprogrammed(), self.cfg.debounce, Instant::now());
            tokio::time::sleep(wait).await;
            let since = cache.take_first_unprogrammed();
            let result = self.sync_once().await;
            // The local pods' npm.io/PolicyEnforced conditions.
            self.publish_pod_conditions(&result);
            // A held DNS response waits for a sync: only while they succeed.
            self.dns_names.sync_result(matches!(&result, Ok(o) if !o.not_listed));
            match &result {
                Ok(o) if !o.not_listed => {
                    health.sync_succeeded();
                    // Degraded mode: a reduced state was programmed.
                    let reason = (!o.map_full.is_empty()).then(|| {
                        o.map_full
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ")
                    });
                    health.maps_degraded(reason);
                }
                Ok(_) => {}
                Err(SyncError::Dataplane { source, .. }) => health.apply_failed(source),
                Err(
                    SyncError::DirectRead { what, .. }
                    | SyncError::DirectReadDeferred { what, .. }
                    | SyncError::NoDirectReader { what },
                ) => health.removal_held(what),
                // Reported as the `node-addresses` and `number-space`
                // readiness checks.
                Err(SyncError::NodeAddressesUnknown { .. } | SyncError::NumbersExhausted { .. }) => {}
            }
            match result {
                Ok(o) => {
                    backoff = min_backoff;
                    if o.applied {
                        if let Some(t) = since {
                            self.metrics.programming_latency.record(t.elapsed().as_secs_f64());
                        }
                        tracing::debug!(changes = o.changes, full = o.full, "programmed");
                    }
                    // Degraded mode needs no retry: the fit is of the whole
                    // target; the next change is fitted from scratch.
                    retry_at = (o.pending_interfaces > 0).then(|| retry_instant(Duration::from_secs(1)));
                    // A deleting pod's claim expires: sync then.
                    if let Some(at) = o.next_expiry {
                        let at = tokio::time::Instant::from_std(at);
                        retry_at = Some(retry_at.map_or(at, |r| r.min(at)));
                    }
                }
                Err(e) => {
                    let wait = match &e {
                        SyncError::DirectReadDeferred { retry_in, .. } => backoff.max(*retry_in),
                        _ => backoff,
                    };
                    tracing::error!(error = %e, retry_in = ?wait, "sync failed; will retry");
                    if let Some(t) = since {
                        cache
                            .first_unprogrammed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(t);
                    }
                    retry_at = Some(retry_instant(wait));
                    backoff = (backoff * 2).min(self.cfg.max_backoff);
                }
            }
        }
    }
}

/// The sync loop running on its own OS thread ([`Syncer::spawn_thread`]).
/// Dropping it stops the loop at its next wait (a sync under way finishes
/// first) and joins the thread, so the dataplane is closed when the drop
/// returns.
#[derive(Debug)]
pub struct SyncThread {
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl SyncThread {
    /// Whether the thread has ended (normally never while it is not
    /// dropped: a panic of the loop ends it).
    pub fn is_finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }
}

impl Drop for SyncThread {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            if t.join().is_err() {
                tracing::error!("the sync thread panicked");
            }
        }
    }
}

impl<D: AgentDataplane + 'static> Syncer<D> {
    /// Runs [`Syncer::run`] on a new OS thread (`npm-sync`) with a
    /// current-thread runtime of its own, until the returned
    /// [`SyncThread`] is dropped. Errors: the thread or its runtime could
    /// not be created.
    pub fn spawn_thread(self) -> std::io::Result<SyncThread> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new().name("npm-sync".into()).spawn(move || {
            rt.block_on(async move {
                tokio::select! {
                    _ = self.run() => {}
                    // The sender is dropped (or sends): stop.
                    _ = stopped => {}
                }
            });
        })?;
        Ok(SyncThread {
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}
