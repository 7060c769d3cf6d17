//! The level-triggered sync loop.
//!
//! Any change of a complete store marks the state dirty; after a debounce the
//! loop takes the complete stores (never events) and brings a long-lived
//! [`compiler::Incremental`] up to them: the objects added, changed or
//! removed since the previous sync's complete state are converted and
//! compiled, nothing else (a diff of complete states, so event order never
//! matters). The first sync, and the first after a failed apply, rebuild it
//! with a full compile (keeping the previous compile's ids). As a safety net a
//! full compile is compared with the incremental one every
//! `cross_check_interval` (every sync in debug builds); a difference is
//! logged, counted in `npm_incremental_mismatch_total`, and the full compile
//! is trusted. The loop then finds the endpoints'
//! interfaces, diffs against what is programmed and applies the diff through
//! the [`Dataplane`]. The first apply of an agent's life is a
//! [`Dataplane::sync_full`] (mark and sweep against pinned state left by a
//! previous agent, which keeps enforcing until then); so is the first one
//! after a failed apply, whose effect on the kernel is unknown. Dataplane
//! errors are retried with exponential backoff.
//!
//! Mass-deletion guard (incident 2): a resync that would remove more than
//! `mass_delete_threshold` of the programmed pod identities or endpoints is
//! held; the agent reads the three resources directly from the API server
//! (a fresh paginated LIST, not the cache) and programs what that read says.
//! A failed direct read programs nothing and is retried.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_common::{DenyEvent, IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff};
use npm_policy::model::{Pod, PodPhase, Snapshot};

use crate::compiler;
use crate::endpoints::Resolve;
use crate::flowlog::FlowLog;
use crate::metrics::Metrics;
use crate::watch::{direct_read, Cache, CompleteState, WatchError};

/// Errors of one sync attempt.
#[derive(Debug, thiserror::Error)]
pub enum SyncError {
    /// The dataplane refused the change.
    #[error("dataplane {op} failed: {source}")]
    Dataplane {
        /// `sync_full` or `apply`.
        op: &'static str,
        /// The dataplane's error.
        #[source]
        source: DataplaneError,
    },
    /// A mass deletion could not be confirmed because the direct read failed.
    #[error("mass deletion held ({what}): confirming direct read failed: {source}")]
    DirectRead {
        /// What would have been removed.
        what: String,
        /// The read error.
        #[source]
        source: WatchError,
    },
    /// A mass deletion was held and no client is available to confirm it.
    #[error("mass deletion held ({what}): no API client to confirm it with a direct read")]
    NoDirectReader {
        /// What would have been removed.
        what: String,
    },
}

/// A dataplane as the agent drives it: the [`Dataplane`] trait plus the
/// optional deny-event source (the eBPF ring buffer).
pub trait AgentDataplane: Dataplane + Send {
    /// Drain the deny events the datapath reported since the last call.
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        Vec::new()
    }
}

impl Dataplane for Box<dyn AgentDataplane> {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        (**self).sync_full(compiled, interfaces)
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        (**self).apply(diff, next, interfaces)
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        (**self).counters()
    }
}

impl AgentDataplane for Box<dyn AgentDataplane> {
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        (**self).poll_deny_events()
    }
}

/// Default quiet time after a change before syncing, in milliseconds.
pub const DEFAULT_DEBOUNCE_MS: u64 = 20;

/// Settings of the sync loop.
#[derive(Clone, Debug)]
pub struct SyncConfig {
    /// Compile options (node name, node addresses, host egress).
    pub compile: CompileOptions,
    /// Quiet time after a change before syncing.
    pub debounce: Duration,
    /// Share (0..=1) of identities or endpoints whose removal is held for a direct read.
    pub mass_delete_threshold: f64,
    /// Page size of the direct reads.
    pub page_size: u32,
    /// Longest retry backoff.
    pub max_backoff: Duration,
    /// How often dataplane counters and deny events are read.
    pub stats_interval: Duration,
    /// Deny events logged per second at most.
    pub flow_logs_per_sec: u32,
    /// How often the incremental compile is checked against a full compile
    /// (`Duration::ZERO`: every sync; debug builds check every sync).
    pub cross_check_interval: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            compile: CompileOptions::default(),
            debounce: Duration::from_millis(DEFAULT_DEBOUNCE_MS),
            mass_delete_threshold: 0.5,
            page_size: 500,
            max_backoff: Duration::from_secs(30),
            stats_interval: Duration::from_secs(5),
            flow_logs_per_sec: 10,
            cross_check_interval: Duration::from_secs(300),
        }
    }
}

/// Readiness of the agent: all three lists complete and the first sync applied.
#[derive(Debug, Default)]
pub struct Readiness {
    first_sync: AtomicBool,
}

impl Readiness {
    /// Whether the first sync has been applied.
    pub fn first_sync_done(&self) -> bool {
        self.first_sync.load(Ordering::SeqCst)
    }
}

/// What one sync attempt did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SyncOutcome {
    /// Not all resources have completed a full list: nothing was done.
    pub not_listed: bool,
    /// Something was written to the dataplane.
    pub applied: bool,
    /// The write was a `sync_full`.
    pub full: bool,
    /// Number of map changes applied.
    pub changes: usize,
    /// The mass-deletion guard fired (and a direct read was made).
    pub guarded: bool,
    /// Endpoints left out because their interface is not found yet.
    pub pending_interfaces: usize,
}

/// The sync loop's state: what was compiled and programmed last.
pub struct Syncer<D: AgentDataplane> {
    cfg: SyncConfig,
    cache: Arc<Cache>,
    metrics: Metrics,
    dataplane: D,
    resolver: Box<dyn Resolve>,
    client: Option<kube::Client>,
    readiness: Arc<Readiness>,
    last_compiled: Option<Compiled>,
    incremental: Option<compiler::Incremental>,
    last_cross_check: Instant,
    programmed: Option<(Compiled, Interfaces)>,
    need_full: bool,
    known_invalid: BTreeSet<(String, String, Vec<String>)>,
    known_conflicts: BTreeSet<(IpAddr, Vec<String>)>,
    flowlog: FlowLog,
}

fn pod_identities(c: &Compiled) -> BTreeSet<u32> {
    c.ipcache
        .values()
        .map(|e| e.identity)
        .filter(|&i| (IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR).contains(&i))
        .collect()
}

/// Which share of `old`'s pod identities and endpoints `new` no longer has;
/// `Some(description)` when either exceeds `threshold`.
pub fn mass_removal(old: &Compiled, new: &Compiled, threshold: f64) -> Option<String> {
    let share = |old: usize, removed: usize| if old == 0 { 0.0 } else { removed as f64 / old as f64 };
    let (oi, ni) = (pod_identities(old), pod_identities(new));
    let removed_ids = oi.difference(&ni).count();
    let removed_eps = old.endpoints.keys().filter(|k| !new.endpoints.contains_key(k)).count();
    let (si, se) = (share(oi.len(), removed_ids), share(old.endpoints.len(), removed_eps));
    (si > threshold || se > threshold).then(|| {
        format!(
            "{removed_ids}/{} identities and {removed_eps}/{} endpoints would be removed",
            oi.len(),
            old.endpoints.len()
        )
    })
}

/// IP conflicts of a snapshot: addresses claimed by more than one live
/// (not terminal, not hostNetwork) pod, with the claiming pods' `ns/name`.
pub fn ip_conflicts(snapshot: &Snapshot) -> BTreeSet<(IpAddr, Vec<String>)> {
    let mut claims: HashMap<IpAddr, Vec<&Pod>> = HashMap::new();
    for p in snapshot.pods.values() {
        if p.host_network || matches!(p.phase, PodPhase::Succeeded | PodPhase::Failed) {
            continue;
        }
        for ip in &p.ips {
            claims.entry(*ip).or_default().push(p);
        }
    }
    claims
        .into_iter()
        .filter(|(_, pods)| pods.len() > 1)
        .map(|(ip, pods)| {
            let mut pods: Vec<String> = pods.iter().map(|p| format!("{}/{}", p.namespace, p.name)).collect();
            pods.sort();
            (ip, pods)
        })
        .collect()
}

impl<D: AgentDataplane> Syncer<D> {
    /// A sync loop over `dataplane`. `client` is used for the direct reads
    /// of the mass-deletion guard (without one, mass deletions are held).
    pub fn new(
        cfg: SyncConfig,
        cache: Arc<Cache>,
        metrics: Metrics,
        dataplane: D,
        resolver: Box<dyn Resolve>,
        client: Option<kube::Client>,
    ) -> Self {
        let flowlog = FlowLog::new(cfg.flow_logs_per_sec);
        Syncer {
            cfg,
            cache,
            metrics,
            dataplane,
            resolver,
            client,
            readiness: Arc::new(Readiness::default()),
            last_compiled: None,
            incremental: None,
            last_cross_check: Instant::now(),
            programmed: None,
            need_full: true,
            known_invalid: BTreeSet::new(),
            known_conflicts: BTreeSet::new(),
            flowlog,
        }
    }

    /// The readiness flag, shared with the HTTP server.
    pub fn readiness(&self) -> Arc<Readiness> {
        self.readiness.clone()
    }

    /// What was programmed last (the compiled state and the interfaces).
    pub fn programmed(&self) -> Option<&(Compiled, Interfaces)> {
        self.programmed.as_ref()
    }

    /// The dataplane.
    pub fn dataplane(&self) -> &D {
        &self.dataplane
    }

    /// The dataplane, mutably.
    pub fn dataplane_mut(&mut self) -> &mut D {
        &mut self.dataplane
    }

    fn report_snapshot(
        &mut self,
        invalid: BTreeSet<(String, String, Vec<String>)>,
        conflicts: BTreeSet<(IpAddr, Vec<String>)>,
    ) {
        for (ns, name, errors) in invalid.difference(&self.known_invalid) {
            self.metrics.policy_errors.increment(errors.len().max(1) as u64);
            for e in errors {
                tracing::error!(policy = %format!("{ns}/{name}"), error = %e, "invalid NetworkPolicy skipped; the others are enforced");
            }
        }
        self.metrics.invalid_policies.set(invalid.len() as f64);
        self.known_invalid = invalid;
        for (ip, pods) in conflicts.difference(&self.known_conflicts) {
            self.metrics.ip_conflicts.increment(1);
            tracing::warn!(%ip, pods = ?pods, "IP claimed by more than one live pod; the compiler gives it to one owner");
        }
        self.known_conflicts = conflicts;
    }

    /// Bring the incremental compiler up to `state` (a full rebuild when
    /// `rebuild`), cross-check it when due, report the snapshot, and return
    /// the compiled form.
    fn compile_state(&mut self, state: &CompleteState, rebuild: bool) -> Compiled {
        let inc = match self.incremental.as_mut() {
            Some(inc) if !rebuild => {
                let changes = inc.update(state);
                tracing::trace!(?changes, "incremental compile");
                inc
            }
            _ => self.incremental.insert(compiler::Incremental::new(
                state,
                &self.cfg.compile,
                self.last_compiled.as_ref(),
            )),
        };
        let due = cfg!(debug_assertions) || self.last_cross_check.elapsed() >= self.cfg.cross_check_interval;
        if due && !rebuild {
            self.last_cross_check = Instant::now();
            if let Some(m) = inc.cross_check(state) {
                self.metrics.incremental_mismatch.increment(1);
                tracing::error!(
                    changes = m.changes,
                    "incremental compile differs from the full compile; trusting the full compile"
                );
            }
        }
        let snapshot = inc.snapshot();
        let invalid: BTreeSet<_> = snapshot
            .invalid_policies
            .iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p.errors.clone()))
            .collect();
        let conflicts = ip_conflicts(snapshot);
        let compiled = inc.compiled().clone();
        self.report_snapshot(invalid, conflicts);
        compiled
    }

    /// One sync attempt: snapshot, compile, guard, apply.
    pub async fn sync_once(&mut self) -> Result<SyncOutcome, SyncError> {
        let mut outcome = SyncOutcome::default();
        let Some(state) = self.cache.complete() else {
            outcome.not_listed = true;
            return Ok(outcome);
        };
        let started = Instant::now();
        let rebuild = self.need_full || self.programmed.is_none();
        let mut compiled = self.compile_state(&state, rebuild);
        let held = self
            .last_compiled
            .as_ref()
            .and_then(|prev| mass_removal(prev, &compiled, self.cfg.mass_delete_threshold));
        {
            if let Some(what) = held {
                outcome.guarded = true;
                self.metrics.destructive_deferred.increment(1);
                tracing::warn!(%what, "mass deletion held; confirming with a direct read of the API server");
                let Some(client) = self.client.clone() else {
                    return Err(SyncError::NoDirectReader { what });
                };
                let fresh = direct_read(&client, self.cfg.page_size).await.map_err(|source| {
                    self.metrics.error("direct-read");
                    SyncError::DirectRead {
                        what: what.clone(),
                        source,
                    }
                })?;
                // The direct read replaces the cached state as the compiler's
                // base; the next sync diffs the cache against it.
                let confirmed = self.compile_state(&fresh, true);
                let still = self
                    .last_compiled
                    .as_ref()
                    .and_then(|prev| mass_removal(prev, &confirmed, self.cfg.mass_delete_threshold));
                match still {
                    Some(seen) => tracing::warn!(%seen, "direct read confirms the mass deletion; applying"),
                    None => {
                        tracing::warn!("direct read does not confirm the mass deletion; programming the direct read")
                    }
                }
                compiled = confirmed;
            }
        }
        let resolved = self.resolver.resolve(&compiled);
        outcome.pending_interfaces = resolved.missing.len();
        self.metrics.endpoints_pending.set(resolved.missing.len() as f64);
        if !resolved.missing.is_empty() {
            tracing::debug!(missing = ?resolved.missing, "endpoints without an interface yet; retrying");
        }
        let mut target = compiled.clone();
        target.endpoints.retain(|id, _| resolved.interfaces.contains_key(id));
        let interfaces = resolved.interfaces;

        if self.need_full || self.programmed.is_none() {
            self.dataplane
                .sync_full(&target, &interfaces)
                .map_err(|source| self.dp_error("sync_full", source))?;
            outcome.full = true;
            outcome.applied = true;
            outcome.changes = target.ipcache.len() + target.cidrs.len() + target.endpoints.len() + target.policy.len();
        } else if let Some((prog, prog_ifaces)) = &self.programmed {
            let diff = prog.diff(&target);
            if !diff.is_empty() || prog_ifaces != &interfaces {
                outcome.changes = diff.len();
                if let Err(source) = self.dataplane.apply(&diff, &target, &interfaces) {
                    return Err(self.dp_error("apply", source));
                }
                outcome.applied = true;
            }
        }
        self.need_full = false;
        for (map, n) in [
            ("ipcache", target.ipcache.len()),
            ("cidrs", target.cidrs.len()),
            ("endpoints", target.endpoints.len()),
            ("policy", target.policy.len()),
        ] {
            self.metrics.map_entries(map, n);
        }
        self.programmed = Some((target, interfaces));
        self.last_compiled = Some(compiled);
        self.metrics.sync_duration.record(started.elapsed().as_secs_f64());
        if outcome.applied {
            self.metrics.syncs.increment(1);
        }
        if !self.readiness.first_sync.swap(true, Ordering::SeqCst) {
            tracing::info!("first full sync applied; ready");
        }
        self.metrics.ready.set(1.0);
        Ok(outcome)
    }

    fn dp_error(&mut self, op: &'static str, source: DataplaneError) -> SyncError {
        self.need_full = true;
        self.metrics.error("dataplane");
        SyncError::Dataplane { op, source }
    }

    /// Read the dataplane's counters and deny events into metrics and logs.
    pub fn poll_stats(&mut self) {
        match self.dataplane.counters() {
            Ok(c) => self.metrics.dataplane_counters(&c),
            Err(e) => {
                self.metrics.error("counters");
                tracing::warn!(error = %e, "reading dataplane counters failed");
            }
        }
        let events = self.dataplane.poll_deny_events();
        self.metrics.deny_events.increment(events.len() as u64);
        let suppressed = self.flowlog.log_all(&events, Instant::now());
        self.metrics.deny_events_suppressed.increment(suppressed);
    }

    /// Run forever: wait for changes, debounce, sync, retry with backoff.
    pub async fn run(mut self) {
        let min_backoff = Duration::from_millis(100);
        let mut backoff = min_backoff;
        let mut retry_after: Option<Duration> = None;
        let mut stats = tokio::time::interval(self.cfg.stats_interval);
        stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cache = self.cache.clone();
        loop {
            let sleep = tokio::time::sleep(retry_after.unwrap_or(Duration::from_secs(3600)));
            tokio::select! {
                _ = cache.changed.notified() => {}
                _ = sleep, if retry_after.is_some() => {}
                _ = stats.tick() => { self.poll_stats(); continue; }
            }
            tokio::time::sleep(self.cfg.debounce).await;
            let since = cache.take_first_unprogrammed();
            match self.sync_once().await {
                Ok(o) => {
                    backoff = min_backoff;
                    if o.applied {
                        if let Some(t) = since {
                            self.metrics.programming_latency.record(t.elapsed().as_secs_f64());
                        }
                        tracing::debug!(changes = o.changes, full = o.full, "programmed");
                    }
                    retry_after = (o.pending_interfaces > 0).then(|| Duration::from_secs(1));
                }
                Err(e) => {
                    tracing::error!(error = %e, retry_in = ?backoff, "sync failed; will retry");
                    if let Some(t) = since {
                        cache
                            .first_unprogrammed
                            .lock()
                            .unwrap_or_else(|p| p.into_inner())
                            .get_or_insert(t);
                    }
                    retry_after = Some(backoff);
                    backoff = (backoff * 2).min(self.cfg.max_backoff);
                }
            }
        }
    }
}
