//! The level-triggered sync loop.
//!
//! Any change of a complete store marks the state dirty; changes are
//! coalesced for `debounce` after the oldest change not yet programmed (a
//! change that arrived while a sync was running is not made to wait a full
//! debounce again), then the loop takes the complete stores (never events)
//! and brings a long-lived [`compiler::Incremental`] up to them: the objects
//! added, changed or removed since the previous sync's complete state are
//! converted and compiled, nothing else (a diff of complete states, so event
//! order never matters). The first sync, and the first after a failed apply,
//! rebuild it with a full compile (keeping the previous compile's ids). As a
//! safety net a full compile is compared with the incremental one every
//! `cross_check_interval` (every sync in debug builds), on a thread of its
//! own so that it never delays a sync; a difference is logged, counted in
//! `npm_incremental_mismatch_total`, and the full compile is trusted: the
//! next sync (woken at once) rebuilds the compiler from the complete state.
//! The loop then finds the endpoints' interfaces, diffs the compiled state
//! against what is programmed (a merge walk of the ordered maps) and applies
//! the diff through the [`Dataplane`]; the record of what is programmed is
//! updated with the same diff, not copied. The first apply of an agent's
//! life is a [`Dataplane::sync_full`] (mark and sweep against pinned state
//! left by a previous agent, which keeps enforcing until then); so is the
//! first one after a failed apply, whose effect on the kernel is unknown.
//! Dataplane errors are retried with exponential backoff.
//!
//! Mass-deletion guard (incident 2): a resync is held when it would remove
//! more than `mass_delete_threshold` (default 50%) of the pod identities or
//! of the endpoints, measured two ways:
//! - in one step: the share of the programmed identities (endpoints) that
//!   the new state no longer has;
//! - cumulatively: the share by which the number of identities (endpoints)
//!   fell below its *reference*, the highest number programmed within the
//!   last `mass_delete_window` since the last confirmation. Removals spread
//!   over many syncs, each below the threshold (a cache that shrinks by 10%
//!   per sync), are held once together they cross it.
//!
//! A held resync is confirmed by a direct read: the agent reads the three
//! resources straight from the API server (a fresh paginated LIST, not the
//! cache) and programs what that read says. The reference is reset to what
//! was then programmed: a direct read confirms the state. Otherwise the
//! reference only forgets counts older than the window, so a legitimate
//! scale-down proceeds without a direct read when it is slower than the
//! window, and with one (confirmed) when it is faster. A failed direct read
//! programs nothing and is retried. Direct reads back off: after a read
//! that does not confirm a deletion (or fails), a held sync stays held
//! without reading for `DIRECT_READ_MIN_BACKOFF`, doubling up to
//! `DIRECT_READ_MAX_BACKOFF`; a read that confirms a deletion resets it.
//!
//! A restarted agent has programmed nothing itself, but its dataplane may
//! have adopted a previous agent's state (pinned maps): before its first
//! sync the reference starts from the counts the dataplane reports
//! ([`AgentDataplane::adopted_counts`]), so a first sync that would remove
//! most of what the previous agent enforced is held like any other. Its
//! first compile also keeps the adopted endpoint ids of the pods whose
//! interface still holds their record with the same addresses, and numbers
//! every other endpoint above all adopted ids
//! ([`AgentDataplane::adopted_endpoints`]).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_common::{DenyEvent, IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};
use npm_dataplane::{AdoptedEndpoint, Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff, IdTables};
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
    /// A mass deletion is held and the confirming direct read waits out its
    /// backoff (a direct read is a full LIST of the cluster: they are not
    /// repeated on every change).
    #[error("mass deletion held ({what}): next confirming direct read in {retry_in:?}")]
    DirectReadDeferred {
        /// What would have been removed.
        what: String,
        /// How long until the next direct read may be made.
        retry_in: Duration,
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
    /// The (pod identities, endpoints) the dataplane found programmed when
    /// it was opened (state a previous agent left: pinned maps), if it can
    /// tell. A restarted agent's first sync is guarded against them, as if
    /// it had programmed them itself (see the module doc).
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        None
    }
    /// The endpoint records the dataplane found programmed when it was
    /// opened (a previous agent's). A restarted agent gives a pod the id of
    /// the record on its interface when the addresses match too, and
    /// numbers every other endpoint above all adopted ids (see the module
    /// doc).
    fn adopted_endpoints(&self) -> Vec<AdoptedEndpoint> {
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
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        (**self).adopted_counts()
    }
    fn adopted_endpoints(&self) -> Vec<AdoptedEndpoint> {
        (**self).adopted_endpoints()
    }
}

/// A setting of the sync loop that cannot work.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// The mass-deletion threshold is not a share strictly between 0 and 1.
    #[error("--mass-delete-threshold must be within 0..1 (exclusive), got {value}")]
    MassDeleteThreshold {
        /// The value given.
        value: f64,
    },
    /// The stats interval is zero.
    #[error("stats interval must be positive, got {value:?}")]
    StatsInterval {
        /// The value given.
        value: Duration,
    },
}

/// Shortest time between two direct reads of the mass-deletion guard that
/// did not confirm a deletion (the time doubles after each such read).
pub const DIRECT_READ_MIN_BACKOFF: Duration = Duration::from_secs(1);
/// Longest time between two direct reads of the mass-deletion guard.
pub const DIRECT_READ_MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Default coalescing time of changes before a sync, in milliseconds.
pub const DEFAULT_DEBOUNCE_MS: u64 = 20;

/// Settings of the sync loop.
#[derive(Clone, Debug)]
pub struct SyncConfig {
    /// Compile options (node name, node addresses, host egress).
    pub compile: CompileOptions,
    /// How long changes are coalesced, counted from the oldest change not
    /// yet programmed, before a sync.
    pub debounce: Duration,
    /// Share (0..=1) of pod identities or endpoints whose removal is held
    /// for a direct read: in one sync, or cumulatively against the highest
    /// count programmed within `mass_delete_window` since the last
    /// confirmation (see the module doc).
    pub mass_delete_threshold: f64,
    /// How long a programmed count stays the reference of the cumulative
    /// mass-deletion check, unless a direct read confirms the state earlier
    /// (which resets the reference). Removals slower than this are not held.
    pub mass_delete_window: Duration,
    /// Page size of the direct reads.
    pub page_size: u32,
    /// Longest retry backoff.
    pub max_backoff: Duration,
    /// How often dataplane counters and deny events are read.
    pub stats_interval: Duration,
    /// Deny events logged per second at most.
    pub flow_logs_per_sec: u32,
    /// How often the incremental compile is checked against a full compile,
    /// in the background (`Duration::ZERO`: after every sync, one check at a
    /// time; debug builds check after every sync).
    pub cross_check_interval: Duration,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            compile: CompileOptions::default(),
            debounce: Duration::from_millis(DEFAULT_DEBOUNCE_MS),
            mass_delete_threshold: 0.5,
            mass_delete_window: Duration::from_secs(600),
            page_size: 500,
            max_backoff: Duration::from_secs(30),
            stats_interval: Duration::from_secs(5),
            flow_logs_per_sec: 10,
            cross_check_interval: Duration::from_secs(300),
        }
    }
}

impl SyncConfig {
    /// Check the settings that would make the loop misbehave or panic: the
    /// mass-deletion threshold must be strictly between 0 and 1 (not NaN)
    /// and the stats interval positive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = self.mass_delete_threshold;
        if !(t > 0.0 && t < 1.0) {
            return Err(ConfigError::MassDeleteThreshold { value: t });
        }
        if self.stats_interval.is_zero() {
            return Err(ConfigError::StatsInterval {
                value: self.stats_interval,
            });
        }
        Ok(())
    }
}

/// How long to wait before a sync: `debounce` after the oldest change not
/// yet programmed (`first`), or a whole `debounce` without one. A debounce
/// too large to add to an instant waits the whole debounce (never panics).
fn debounce_wait(first: Option<Instant>, debounce: Duration, now: Instant) -> Duration {
    match first.and_then(|t| t.checked_add(debounce)) {
        Some(until) => until.saturating_duration_since(now),
        None => debounce,
    }
}

/// Raise the never-reuse counters of `programmed` to those of `attempted`
/// (a failed apply may have written ids handed out by `attempted`).
fn raise_counters(programmed: &mut IdTables, attempted: &IdTables) {
    programmed.next_endpoint = programmed.next_endpoint.max(attempted.next_endpoint);
    programmed.next_identity = programmed.next_identity.max(attempted.next_identity);
    programmed.next_rule = programmed.next_rule.max(attempted.next_rule);
    programmed.next_cidr = programmed.next_cidr.max(attempted.next_cidr);
}

/// The instant `after` from now (far in the future when that overflows).
fn retry_instant(after: Duration) -> tokio::time::Instant {
    let now = tokio::time::Instant::now();
    now.checked_add(after)
        .unwrap_or_else(|| now + Duration::from_secs(86400 * 365))
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
    incremental: compiler::Incremental,
    last_cross_check: Instant,
    /// The running background cross-check's result.
    cross_check: Option<mpsc::Receiver<Option<compiler::Mismatch>>>,
    /// A cross-check found a difference: the next sync rebuilds.
    rebuild_pending: bool,
    programmed: Option<(Compiled, Interfaces)>,
    guard: GuardReference,
    /// Whether the guard was seeded from the adopted state (once).
    guard_seeded: bool,
    /// The endpoint records the dataplane adopted (read once).
    adopted: Option<Vec<AdoptedEndpoint>>,
    need_full: bool,
    /// The id counters of a failed first apply (nothing programmed yet):
    /// the kernel may hold the ids it handed out, so the rebuild starts
    /// above them.
    attempted_ids: Option<IdTables>,
    /// No direct read before this (a held sync stays held until then).
    next_direct_read_at: Option<Instant>,
    /// The wait after the next direct read that does not confirm a deletion.
    direct_read_backoff: Duration,
    known_invalid: BTreeSet<(String, String, Vec<String>)>,
    known_conflicts: BTreeSet<(IpAddr, Vec<String>)>,
    flowlog: FlowLog,
}

/// The pod identities of a compile (its identity table holds exactly the
/// identities of the pods that own an address), in order.
fn pod_identities(c: &Compiled) -> impl Iterator<Item = u32> + '_ {
    c.ids
        .identities
        .range(IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR)
        .map(|(id, _)| *id)
}

/// How many of the ordered `old` are not in the ordered `new`.
fn missing_from<T: Ord>(old: impl Iterator<Item = T>, new: impl Iterator<Item = T>) -> usize {
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
            cache,
            metrics,
            dataplane,
            resolver,
            client,
            readiness: Arc::new(Readiness::default()),
            // Replaced by the first sync's rebuild (`programmed` is `None`).
            incremental: compiler::Incremental::new(&CompleteState::default(), &cfg.compile, None),
            last_cross_check: Instant::now(),
            cross_check: None,
            rebuild_pending: false,
            programmed: None,
            guard: GuardReference::default(),
            guard_seeded: false,
            adopted: None,
            need_full: true,
            attempted_ids: None,
            next_direct_read_at: None,
            direct_read_backoff: DIRECT_READ_MIN_BACKOFF,
            known_invalid: BTreeSet::new(),
            known_conflicts: BTreeSet::new(),
            flowlog,
            cfg,
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
    /// `rebuild`, keeping the ids of what is programmed) and report the
    /// snapshot's invalid policies and IP conflicts.
    fn compile_state(&mut self, state: &CompleteState, rebuild: bool) {
        if rebuild {
            // The ids of what is programmed are kept (a pod that is still
            // there keeps its endpoint id, and so its conntrack entries).
            let floor;
            let prev = match (&self.programmed, &self.attempted_ids) {
                (Some((c, _)), _) => Some(c),
                (None, Some(ids)) => {
                    floor = Compiled {
                        ids: IdTables {
                            next_endpoint: ids.next_endpoint,
                            next_identity: ids.next_identity,
                            next_rule: ids.next_rule,
                            next_cidr: ids.next_cidr,
                            ..IdTables::default()
                        },
                        ..Compiled::default()
                    };
                    Some(&floor)
                }
                (None, None) => None,
            };
            self.incremental = compiler::Incremental::new(state, &self.cfg.compile, prev);
            // Until something is programmed (the first sync, its retries,
            // its direct read), every rebuild starts from the adopted ids.
            if self.programmed.is_none() {
                self.seed_endpoint_ids(state);
            }
            self.rebuild_pending = false;
        } else {
            let changes = self.incremental.update(state);
            tracing::trace!(?changes, "incremental compile");
        }
        let invalid: BTreeSet<_> = self
            .incremental
            .snapshot()
            .invalid_policies
            .iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p.errors.clone()))
            .collect();
        let conflicts = self.incremental.conflicts();
        self.report_snapshot(invalid, conflicts);
    }

    /// A compile before anything is programmed, when the dataplane adopted
    /// a previous agent's endpoint records: each pod whose interface holds
    /// a record with the pod's own addresses keeps that record's id (and so
    /// its tracked flows), every other endpoint is numbered above all
    /// adopted ids (and above the ids of a failed attempt), and the compile
    /// is redone with those ids. So no packet of one pod is ever decided
    /// under an id another pod's record had (the kernel keeps the old
    /// records until the first sync rewrites them). Matching relies on each
    /// pod having its own host-side interface (an ifindex is not handed out
    /// again while its interface exists).
    fn seed_endpoint_ids(&mut self, state: &CompleteState) {
        let dataplane = &self.dataplane;
        let adopted = self
            .adopted
            .get_or_insert_with(|| dataplane.adopted_endpoints())
            .clone();
        let Some(max) = adopted.iter().map(|a| a.id).max() else {
            return;
        };
        let by_ifindex: HashMap<u32, &AdoptedEndpoint> = adopted.iter().map(|a| (a.ifindex, a)).collect();
        let compiled = self.incremental.compiled();
        let resolved = self.resolver.resolve(compiled);
        let mut keep: BTreeMap<String, u32> = BTreeMap::new();
        let mut used = BTreeSet::new();
        for (id, ep) in &compiled.endpoints {
            let Some(a) = resolved.interfaces.get(id).and_then(|i| by_ifindex.get(i)) else {
                continue;
            };
            if a.ipv4 == ep.ipv4 && a.ipv6 == ep.ipv6 && used.insert(a.id) {
                keep.insert(ep.pod.uid.clone(), a.id);
            }
        }
        tracing::info!(
            kept = keep.len(),
            adopted = adopted.len(),
            next = max + 1,
            "endpoint ids of the adopted state kept for the pods they still describe"
        );
        // The counters of a failed attempt stay floors (never reused).
        let attempted = self.attempted_ids.clone().unwrap_or_default();
        let floor = Compiled {
            ids: IdTables {
                endpoints: keep,
                next_endpoint: (max + 1).max(attempted.next_endpoint),
                next_identity: attempted.next_identity,
                next_rule: attempted.next_rule,
                next_cidr: attempted.next_cidr,
                ..IdTables::default()
            },
            ..Compiled::default()
        };
        self.incremental = compiler::Incremental::new(state, &self.cfg.compile, Some(&floor));
    }

    /// Collect the result of a finished background cross-check.
    fn poll_cross_check(&mut self) {
        let Some(rx) = &self.cross_check else { return };
        match rx.try_recv() {
            Err(mpsc::TryRecvError::Empty) => return,
            Ok(None) => {}
            Ok(Some(m)) => {
                self.metrics.incremental_mismatch.increment(1);
                tracing::error!(
                    changes = m.changes,
                    "incremental compile differs from the full compile; trusting the full compile (rebuilding)"
                );
                self.rebuild_pending = true;
            }
            Err(mpsc::TryRecvError::Disconnected) => {
                self.metrics.error("cross-check");
                tracing::error!("the background cross-check stopped without a result");
            }
        }
        self.cross_check = None;
    }

    /// Start a background cross-check of the compile of `state` when one
    /// is due and none is running.
    fn start_cross_check(&mut self, state: &CompleteState) {
        let due = cfg!(debug_assertions) || self.last_cross_check.elapsed() >= self.cfg.cross_check_interval;
        if !due || self.cross_check.is_some() {
            return;
        }
        self.last_cross_check = Instant::now();
        let job = self.incremental.cross_check_job(state);
        let cache = self.cache.clone();
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("npm-cross-check".into())
            .spawn(move || {
                let result = job();
                let mismatch = result.is_some();
                let _ = tx.send(result);
                if mismatch {
                    // Wake the sync loop: its next sync rebuilds.
                    cache.mark_changed();
                }
            });
        match spawned {
            Ok(_) => self.cross_check = Some(rx),
            Err(e) => tracing::warn!(error = %e, "could not start the background cross-check"),
        }
    }

    /// Before the first sync of the agent's life: the guard's reference
    /// starts from what the dataplane adopted (a previous agent's pinned
    /// state), so a restarted agent's first sync is held like any other
    /// when it would remove most of it.
    fn seed_guard(&mut self) {
        if self.guard_seeded {
            return;
        }
        self.guard_seeded = true;
        if self.programmed.is_some() {
            return;
        }
        if let Some((identities, endpoints)) = self.dataplane.adopted_counts() {
            if identities + endpoints > 0 {
                tracing::info!(
                    identities,
                    endpoints,
                    "mass-deletion guard: starting from the state adopted from a previous agent"
                );
                self.guard.observe(Instant::now(), identities, endpoints);
            }
        }
    }

    /// Whether `next` would remove too much, in one step or cumulatively
    /// (see the module doc).
    fn held(&mut self, now: Instant) -> Option<String> {
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

    /// One sync attempt: snapshot, compile, guard, apply.
    pub async fn sync_once(&mut self) -> Result<SyncOutcome, SyncError> {
        let mut outcome = SyncOutcome::default();
        let t0 = Instant::now();
        let Some(state) = self.cache.complete() else {
            outcome.not_listed = true;
            return Ok(outcome);
        };
        let started = Instant::now();
        let t_state = started.duration_since(t0);
        self.poll_cross_check();
        let rebuild = self.need_full || self.programmed.is_none() || self.rebuild_pending;
        self.compile_state(&state, rebuild);
        let t_compile = started.elapsed();
        let mut confirmed = false;
        self.seed_guard();
        if let Some(what) = self.held(Instant::now()) {
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
            confirmed = true;
        } else {
            self.start_cross_check(&state);
        }
        let t_guard = started.elapsed();
        let compiled = self.incremental.compiled();
        let resolved = self.resolver.resolve(compiled);
        outcome.pending_interfaces = resolved.missing.len();
        self.metrics.endpoints_pending.set(resolved.missing.len() as f64);
        if !resolved.missing.is_empty() {
            tracing::debug!(missing = ?resolved.missing, "endpoints without an interface yet; retrying");
        }
        let interfaces = resolved.interfaces;
        // Endpoints without an interface are left out; only then is the
        // compiled state copied.
        let filtered;
        let target: &Compiled = if compiled.endpoints.keys().all(|id| interfaces.contains_key(id)) {
            compiled
        } else {
            let mut t = compiled.clone();
            t.endpoints.retain(|id, _| interfaces.contains_key(id));
            filtered = t;
            &filtered
        };
        let t_target = started.elapsed();
        let mut t_diff = t_target;

        match &mut self.programmed {
            Some((prog, prog_ifaces)) if !self.need_full => {
                let diff = prog.diff(target);
                t_diff = started.elapsed();
                if !diff.is_empty() || *prog_ifaces != interfaces {
                    outcome.changes = diff.len();
                    if let Err(source) = self.dataplane.apply(&diff, target, &interfaces) {
                        self.need_full = true;
                        // The kernel may already hold ids handed out by the
                        // target: they must never be handed out again.
                        raise_counters(&mut prog.ids, &target.ids);
                        self.metrics.error("dataplane");
                        return Err(SyncError::Dataplane { op: "apply", source });
                    }
                    outcome.applied = true;
                    // What is programmed now: the same diff, applied in place.
                    diff.ipcache.apply_to(&mut prog.ipcache);
                    diff.cidrs.apply_to(&mut prog.cidrs);
                    diff.endpoints.apply_to(&mut prog.endpoints);
                    diff.policy.apply_to(&mut prog.policy);
                    *prog_ifaces = interfaces;
                }
                if prog.ids != target.ids {
                    prog.ids = target.ids.clone();
                }
            }
            _ => {
                if let Err(source) = self.dataplane.sync_full(target, &interfaces) {
                    self.need_full = true;
                    // The kernel may already hold ids handed out by the
                    // target: they must never be handed out again.
                    match &mut self.programmed {
                        Some((prog, _)) => raise_counters(&mut prog.ids, &target.ids),
                        None => match &mut self.attempted_ids {
                            Some(ids) => raise_counters(ids, &target.ids),
                            None => self.attempted_ids = Some(target.ids.clone()),
                        },
                    }
                    self.metrics.error("dataplane");
                    return Err(SyncError::Dataplane {
                        op: "sync_full",
                        source,
                    });
                }
                outcome.full = true;
                outcome.applied = true;
                outcome.changes =
                    target.ipcache.len() + target.cidrs.len() + target.endpoints.len() + target.policy.len();
                self.programmed = Some((target.clone(), interfaces));
                self.attempted_ids = None;
            }
        }
        let t_apply = started.elapsed();
        tracing::debug!(
            state_ms = t_state.as_secs_f64() * 1e3,
            compile_ms = t_compile.as_secs_f64() * 1e3,
            guard_ms = (t_guard - t_compile).as_secs_f64() * 1e3,
            target_ms = (t_target - t_guard).as_secs_f64() * 1e3,
            diff_ms = (t_diff - t_target).as_secs_f64() * 1e3,
            apply_ms = (t_apply - t_diff).as_secs_f64() * 1e3,
            changes = outcome.changes,
            "sync phases"
        );
        self.need_full = false;
        for (map, n) in [
            ("ipcache", target.ipcache.len()),
            ("cidrs", target.cidrs.len()),
            ("endpoints", target.endpoints.len()),
            ("policy", target.policy.len()),
        ] {
            self.metrics.map_entries(map, n);
        }
        let (ids, eps) = (pod_identities(target).count(), target.endpoints.len());
        let now = Instant::now();
        if confirmed {
            self.guard.reset(now, ids, eps);
        } else {
            self.guard.observe(now, ids, eps);
        }
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
        // When to sync again without a change (a retry); kept across loop
        // passes so that the stats tick does not postpone it.
        let mut retry_at: Option<tokio::time::Instant> = None;
        let mut stats = tokio::time::interval(self.cfg.stats_interval.max(Duration::from_millis(1)));
        stats.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let cache = self.cache.clone();
        loop {
            let far = tokio::time::Instant::now() + Duration::from_secs(3600);
            let sleep = tokio::time::sleep_until(retry_at.unwrap_or(far));
            tokio::select! {
                _ = cache.changed.notified() => {}
                _ = sleep, if retry_at.is_some() => {}
                _ = stats.tick() => { self.poll_stats(); continue; }
            }
            // Coalesce changes for `debounce` after the oldest one not yet
            // programmed (already waited for when it came during a sync).
            let wait = debounce_wait(cache.first_unprogrammed(), self.cfg.debounce, Instant::now());
            tokio::time::sleep(wait).await;
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
                    retry_at = (o.pending_interfaces > 0).then(|| retry_instant(Duration::from_secs(1)));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoints::Resolved;
    use crate::metrics::sample;
    use k8s_openapi::api::core::v1::{Namespace, Pod as ApiPod};
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use kube::api::ObjectMeta;
    use kube::runtime::watcher::Event;
    use npm_policy::compiled::IdentityKey;
    use std::sync::Mutex;

    /// An in-memory dataplane: the "kernel" is a compiled state.
    #[derive(Clone, Default)]
    struct Mem(Arc<Mutex<Compiled>>);

    impl Dataplane for Mem {
        fn sync_full(&mut self, compiled: &Compiled, _: &Interfaces) -> Result<(), DataplaneError> {
            *self.0.lock().unwrap() = compiled.clone();
            Ok(())
        }
        fn apply(&mut self, diff: &CompiledDiff, _: &Compiled, _: &Interfaces) -> Result<(), DataplaneError> {
            let mut k = self.0.lock().unwrap();
            diff.ipcache.apply_to(&mut k.ipcache);
            diff.cidrs.apply_to(&mut k.cidrs);
            diff.endpoints.apply_to(&mut k.endpoints);
            diff.policy.apply_to(&mut k.policy);
            Ok(())
        }
        fn counters(&self) -> Result<Counters, DataplaneError> {
            Ok(Counters::default())
        }
    }

    impl AgentDataplane for Mem {}

    struct AllFound;

    impl Resolve for AllFound {
        fn resolve(&mut self, compiled: &Compiled) -> Resolved {
            Resolved {
                interfaces: compiled.endpoints.keys().map(|&id| (id, 100 + id)).collect(),
                missing: Vec::new(),
            }
        }
    }

    /// The background cross-check catches a change the incremental compile
    /// missed: the mismatch is counted, the sync loop is woken (a change is
    /// marked unprogrammed) and the next sync rebuilds and programs the
    /// full compile's result.
    #[tokio::test]
    async fn background_cross_check_repairs_a_missed_change() {
        let metrics = Metrics::new().unwrap();
        let cache = listed_cache(&metrics, &[("p", "10.2.0.1")]);
        let dp = Mem::default();
        let cfg = SyncConfig {
            compile: CompileOptions {
                node_name: "node-a".into(),
                node_ips: Vec::new(),
                allow_host_egress: false,
            },
            ..SyncConfig::default()
        };
        let mut syncer = Syncer::new(
            cfg,
            cache.clone(),
            metrics.clone(),
            dp.clone(),
            Box::new(AllFound),
            None,
        );
        assert!(syncer.sync_once().await.unwrap().full);
        let (old, new): (IpAddr, IpAddr) = ("10.2.0.1".parse().unwrap(), "10.2.0.9".parse().unwrap());
        assert!(dp.0.lock().unwrap().ipcache.contains_key(&old));

        // The pod moves; the incremental compiler is made to miss it.
        cache.handle(Event::Apply(named_pod("p", "10.2.0.9", 3)));
        let state = cache.complete().unwrap();
        syncer.incremental.pretend_compiled(&state);
        let _ = cache.take_first_unprogrammed();
        let missed = syncer.sync_once().await.unwrap();
        assert!(!missed.applied, "the missed change is not programmed by this sync");
        let mismatches = || sample(&metrics.render(), "npm_incremental_mismatch_total").unwrap_or(0.0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut woken = false;
        while mismatches() < 1.0 || !dp.0.lock().unwrap().ipcache.contains_key(&new) {
            assert!(Instant::now() < deadline, "the cross-check did not repair the state");
            tokio::time::sleep(Duration::from_millis(10)).await;
            // Debug builds start a cross-check after every sync (one at a
            // time); a sync also collects a finished one's result.
            woken |= cache.take_first_unprogrammed().is_some();
            syncer.sync_once().await.unwrap();
        }
        // The checker wakes the loop right after handing over its result.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !woken && Instant::now() < deadline {
            woken = cache.first_unprogrammed().is_some();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(woken, "the mismatch woke the sync loop");
        assert_eq!(mismatches(), 1.0);
        let k = dp.0.lock().unwrap();
        assert!(!k.ipcache.contains_key(&old));
        assert_eq!(
            k.endpoints.values().next().and_then(|e| e.ipv4),
            Some("10.2.0.9".parse().unwrap())
        );
    }

    /// A compile with `ids` pod identities (and no endpoints).
    fn with_identities(ids: usize) -> Compiled {
        let mut c = Compiled::default();
        for i in 0..ids as u32 {
            let key = IdentityKey {
                namespace: "ns".into(),
                namespace_labels: Default::default(),
                pod_labels: [("app".to_string(), format!("a{i}"))].into(),
                named_ports: Vec::new(),
            };
            c.ids.identities.insert(IDENTITY_FIRST_POD + i, key);
        }
        c
    }

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

    /// A dataplane that fails its first `fail_applies` applies and first
    /// `fail_full` full syncs; each failure first writes the target's
    /// endpoints (a failure midway), like a real partial write.
    #[derive(Clone, Default)]
    struct Flaky {
        mem: Mem,
        fail_applies: Arc<std::sync::atomic::AtomicUsize>,
        fail_full: Arc<std::sync::atomic::AtomicUsize>,
    }

    fn take_failure(n: &std::sync::atomic::AtomicUsize) -> bool {
        n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
            .is_ok()
    }

    fn injected() -> DataplaneError {
        DataplaneError::Kernel {
            op: "test".into(),
            detail: "injected failure".into(),
        }
    }

    impl Dataplane for Flaky {
        fn sync_full(&mut self, compiled: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
            if take_failure(&self.fail_full) {
                self.mem.0.lock().unwrap().endpoints = compiled.endpoints.clone();
                return Err(injected());
            }
            self.mem.sync_full(compiled, i)
        }
        fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
            if take_failure(&self.fail_applies) {
                diff.endpoints.apply_to(&mut self.mem.0.lock().unwrap().endpoints);
                return Err(injected());
            }
            self.mem.apply(diff, next, i)
        }
        fn counters(&self) -> Result<Counters, DataplaneError> {
            Ok(Counters::default())
        }
    }

    impl AgentDataplane for Flaky {}

    fn node_a_config() -> SyncConfig {
        SyncConfig {
            compile: CompileOptions {
                node_name: "node-a".into(),
                node_ips: Vec::new(),
                allow_host_egress: false,
            },
            ..SyncConfig::default()
        }
    }

    /// A complete cache with namespace `a` (no policies) and `pods`.
    fn listed_cache(metrics: &Metrics, pods: &[(&str, &str)]) -> Arc<Cache> {
        let cache = Cache::new(metrics.clone());
        cache.handle::<Namespace>(Event::Init);
        cache.handle(Event::InitApply(Namespace {
            metadata: ObjectMeta {
                name: Some("a".into()),
                resource_version: Some("1".into()),
                ..Default::default()
            },
            ..Default::default()
        }));
        cache.handle::<Namespace>(Event::InitDone);
        cache.handle::<NetworkPolicy>(Event::Init);
        cache.handle::<NetworkPolicy>(Event::InitDone);
        cache.handle::<ApiPod>(Event::Init);
        for (i, (name, ip)) in pods.iter().enumerate() {
            cache.handle(Event::InitApply(named_pod(name, ip, 2 + i as u64)));
        }
        cache.handle::<ApiPod>(Event::InitDone);
        cache
    }

    fn named_pod(name: &str, ip: &str, rv: u64) -> ApiPod {
        (*crate::compiler::tests::pod("a", name, rv, ip, name, "node-a")).clone()
    }

    fn endpoint_id(c: &Compiled, name: &str) -> Option<u32> {
        c.ids.endpoints.get(&format!("uid-a-{name}")).copied()
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

    /// B2: an apply that fails midway may leave new endpoint ids in the
    /// kernel; the rebuild after it must not hand them out again.
    #[tokio::test]
    async fn failed_apply_never_reuses_endpoint_ids() {
        let metrics = Metrics::new().unwrap();
        let cache = listed_cache(&metrics, &[("p", "10.2.0.1")]);
        let dp = Flaky::default();
        let mut syncer = Syncer::new(
            node_a_config(),
            cache.clone(),
            metrics,
            dp.clone(),
            Box::new(AllFound),
            None,
        );
        assert!(syncer.sync_once().await.unwrap().full);
        // Pod b comes; its apply fails after writing b's endpoint.
        cache.handle(Event::Apply(named_pod("b", "10.2.0.2", 10)));
        dp.fail_applies.store(1, Ordering::SeqCst);
        assert!(matches!(
            syncer.sync_once().await,
            Err(SyncError::Dataplane { op: "apply", .. })
        ));
        let failed_id = {
            let k = dp.mem.0.lock().unwrap();
            *k.endpoints.keys().max().unwrap()
        };
        // b goes, c comes: c must not get b's id (and its conntrack).
        cache.handle(Event::Delete(named_pod("b", "10.2.0.2", 11)));
        cache.handle(Event::Apply(named_pod("c", "10.2.0.3", 12)));
        assert!(syncer.sync_once().await.unwrap().full);
        let prog = &syncer.programmed().unwrap().0;
        let c = endpoint_id(prog, "c").unwrap();
        assert!(
            c > failed_id,
            "pod c got endpoint id {c}, not above the failed apply's {failed_id}"
        );
        assert!(endpoint_id(prog, "b").is_none());
    }

    /// B2: the same when the very first (full) sync fails: nothing is
    /// programmed yet, but the kernel may hold the attempted ids.
    #[tokio::test]
    async fn failed_first_sync_never_reuses_endpoint_ids() {
        let metrics = Metrics::new().unwrap();
        let cache = listed_cache(&metrics, &[("b", "10.2.0.2")]);
        let dp = Flaky::default();
        dp.fail_full.store(1, Ordering::SeqCst);
        let mut syncer = Syncer::new(
            node_a_config(),
            cache.clone(),
            metrics,
            dp.clone(),
            Box::new(AllFound),
            None,
        );
        assert!(matches!(
            syncer.sync_once().await,
            Err(SyncError::Dataplane { op: "sync_full", .. })
        ));
        let failed_id = *dp.mem.0.lock().unwrap().endpoints.keys().max().unwrap();
        cache.handle(Event::Delete(named_pod("b", "10.2.0.2", 11)));
        cache.handle(Event::Apply(named_pod("c", "10.2.0.3", 12)));
        assert!(syncer.sync_once().await.unwrap().full);
        let c = endpoint_id(&syncer.programmed().unwrap().0, "c").unwrap();
        assert!(
            c > failed_id,
            "pod c got endpoint id {c}, not above the failed sync's {failed_id}"
        );
    }

    /// B3: retries keep firing when the backoff is longer than the stats
    /// interval (the stats tick must not postpone them).
    #[tokio::test]
    async fn retries_fire_although_the_stats_tick_is_shorter() {
        let metrics = Metrics::new().unwrap();
        let cache = listed_cache(&metrics, &[("p", "10.2.0.1")]);
        let dp = Flaky::default();
        // Backoff 100, 200, 400 ms: each longer than the 20 ms stats tick.
        dp.fail_full.store(3, Ordering::SeqCst);
        let cfg = SyncConfig {
            debounce: Duration::from_millis(1),
            stats_interval: Duration::from_millis(20),
            ..node_a_config()
        };
        let syncer = Syncer::new(cfg, cache.clone(), metrics, dp.clone(), Box::new(AllFound), None);
        let readiness = syncer.readiness();
        let task = tokio::spawn(syncer.run());
        let deadline = Instant::now() + Duration::from_secs(10);
        while !readiness.first_sync_done() {
            assert!(
                Instant::now() < deadline,
                "the failed sync was not retried ({} failures left)",
                dp.fail_full.load(Ordering::SeqCst)
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        task.abort();
        assert_eq!(dp.fail_full.load(Ordering::SeqCst), 0);
        assert!(dp
            .mem
            .0
            .lock()
            .unwrap()
            .ipcache
            .contains_key(&"10.2.0.1".parse::<IpAddr>().unwrap()));
    }

    /// N2: settings that cannot work are rejected with the flag named.
    #[test]
    fn config_validation_rejects_bad_settings() {
        assert_eq!(SyncConfig::default().validate(), Ok(()));
        for t in [f64::NAN, 0.0, 1.0, -0.5, 1.5, f64::INFINITY] {
            let cfg = SyncConfig {
                mass_delete_threshold: t,
                ..SyncConfig::default()
            };
            let err = cfg.validate().unwrap_err();
            assert!(matches!(err, ConfigError::MassDeleteThreshold { .. }), "{t}");
            assert!(err.to_string().contains("--mass-delete-threshold"), "{err}");
        }
        let cfg = SyncConfig {
            stats_interval: Duration::ZERO,
            ..SyncConfig::default()
        };
        assert_eq!(
            cfg.validate(),
            Err(ConfigError::StatsInterval { value: Duration::ZERO })
        );
    }

    /// N2: a debounce too large to add to an instant does not panic.
    #[test]
    fn huge_debounce_does_not_overflow() {
        let now = Instant::now();
        assert_eq!(debounce_wait(Some(now), Duration::MAX, now), Duration::MAX);
        assert_eq!(debounce_wait(None, Duration::MAX, now), Duration::MAX);
        let ms = Duration::from_millis(u64::MAX);
        assert_eq!(debounce_wait(Some(now), ms, now), ms);
        let d = Duration::from_millis(20);
        assert_eq!(
            debounce_wait(Some(now), d, now + Duration::from_millis(5)),
            Duration::from_millis(15)
        );
        assert_eq!(
            debounce_wait(Some(now), d, now + Duration::from_secs(1)),
            Duration::ZERO
        );
    }
}
