//! One sync attempt ([`Syncer::sync_once`]): take the complete stores,
//! bring the incremental compile up to them, ask the guard, find the
//! endpoints' interfaces, and apply the difference against what is
//! programmed (a full sync the first time and after a failure); the
//! [`Syncer`] keeps what was compiled and programmed last, and reports the
//! snapshot's invalid policies and ClusterNetworkPolicies (log, metrics, a
//! Kubernetes Event per policy resourceVersion: NetworkPolicies are
//! enforced as far as they are understood, ClusterNetworkPolicies fail
//! closed where they are not) and IP conflicts.
//!
//! Degraded mode: before it is written, the target is checked against the
//! dataplane's map sizes ([`AgentDataplane::fit`]); a target that does not
//! fit is replaced by its largest fail-closed part that does (an endpoint
//! direction whose allows do not fit keeps only the allows both programmed
//! and still wanted, or denies; an address that does not fit is left
//! unknown), which is programmed and recorded like any state, so everything
//! else keeps being programmed. The sync reports it
//! ([`SyncOutcome::map_full`]: a log line per map naming its sizes,
//! `npm_map_full{map}`, the `map-capacity` readiness check) and, while
//! degraded, fits every later target from scratch, so the whole state is
//! programmed (and the report cleared) as soon as it fits again.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_dataplane::ebpf::{Fitted, Shortfall};
use npm_dataplane::{AdoptedEndpoint, DataplaneError, Interfaces};
use npm_policy::adopt::AdoptedNumbers;
use npm_policy::compiled::{Compiled, IdTables, MapDiff};
use npm_policy::numbers::NumbersExhausted;

use super::compiler;
use super::config::SyncConfig;
use super::dataplane::AgentDataplane;
use super::guard::{pod_identities, GuardReference};
use super::hold;
use crate::cni::{FactsHandle, NodeFacts};
use crate::dns::handle::Learned;
use crate::dns::NamesHandle;
use crate::k8s::{Cache, CompleteState, WatchError};
use crate::node::Resolve;
use crate::telemetry::events::{cluster_reports_of, reports_of, EventRecorder, MapFullReport};
use crate::telemetry::flowlog::FlowLog;
use crate::telemetry::health::Health;
use crate::telemetry::metrics::Metrics;

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
    /// This node's addresses have never been read: nothing is programmed
    /// (programming no node addresses would make the kubelet's probes
    /// "world" traffic).
    #[error("node addresses unknown: {problem}")]
    NodeAddressesUnknown {
        /// Why they could not be read.
        problem: String,
    },
    /// The compiled state needs a number past its range (see
    /// [`super::numbers`]): nothing is programmed.
    #[error("sync refused, the last good state stays programmed: {source}")]
    NumbersExhausted {
        /// Which range is used up.
        #[source]
        source: NumbersExhausted,
    },
    /// A mass deletion was held and no client is available to confirm it.
    #[error("mass deletion held ({what}): no API client to confirm it with a direct read")]
    NoDirectReader {
        /// What would have been removed.
        what: String,
    },
}

/// Makes `programmed` equal `target` by changing only the entries that
/// differ (a CNP change adds or drops a few rule ids: no copy of every
/// identity and rule per sync).
fn update_ids(programmed: &mut IdTables, target: &IdTables) {
    let IdTables {
        identities,
        node_identities,
        endpoints,
        rules,
        next_endpoint: _,
        next_identity: _,
        next_rule: _,
        next_cidr: _,
        limits,
        exhausted,
        provisional: _,
    } = target;
    debug_assert!(exhausted.is_none(), "a compile past a number range is never programmed");
    MapDiff::between(&programmed.identities, identities).apply_to(&mut programmed.identities);
    MapDiff::between(&programmed.node_identities, node_identities).apply_to(&mut programmed.node_identities);
    MapDiff::between(&programmed.endpoints, endpoints).apply_to(&mut programmed.endpoints);
    MapDiff::between(&programmed.rules, rules).apply_to(&mut programmed.rules);
    programmed.counters_from(target);
    programmed.limits = *limits;
}

/// The dataplane's fit of `target` (see [`AgentDataplane::fit`]); an error
/// computing it is logged and the whole target is written (the write then
/// reports what the kernel says).
fn fit<D: AgentDataplane>(
    dataplane: &D,
    programmed: Option<&Compiled>,
    diff: Option<&npm_policy::compiled::CompiledDiff>,
    target: &Compiled,
) -> Option<Fitted> {
    match dataplane.fit(programmed, diff, target) {
        Ok(f) => f,
        Err(e) => {
            tracing::warn!(error = %e, "checking the compiled state against the map sizes failed; writing it whole");
            None
        }
    }
}

/// Readiness of the agent: the shared [`Health`] state the loop writes
/// (first sync, held removals, apply failures, full maps) and the HTTP
/// server reads.
pub type Readiness = Health;

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
    /// The maps the target did not fit: a reduced, fail-closed state was
    /// programmed instead (degraded mode; empty: the whole state).
    pub map_full: Vec<Shortfall>,
    /// When the next deleting pod's claim expires ([`super::expiry`]): the
    /// loop syncs again then, with or without a change.
    pub next_expiry: Option<Instant>,
}

/// The sync loop's state: what was compiled and programmed last.
pub struct Syncer<D: AgentDataplane> {
    pub(super) cfg: SyncConfig,
    pub(super) cache: Arc<Cache>,
    pub(super) metrics: Metrics,
    pub(super) dataplane: D,
    pub(super) resolver: Box<dyn Resolve>,
    /// This node's CNI facts, shared with the CNI server.
    pub(super) node_facts: FactsHandle,
    /// The version of the facts the current sync compiles.
    pub(super) facts: Arc<NodeFacts>,
    /// The names learned from DNS answers, shared with the capture.
    pub(super) dns_names: NamesHandle,
    /// The version of the learned names the current sync compiles.
    pub(super) names: Arc<Learned>,
    /// The generation of the node addresses compiled in.
    pub(super) node_generation: u64,
    pub(super) client: Option<kube::Client>,
    pub(super) readiness: Arc<Readiness>,
    pub(super) incremental: compiler::Incremental,
    pub(super) last_cross_check: Instant,
    /// The running background cross-check's result.
    pub(super) cross_check: Option<mpsc::Receiver<Option<compiler::Mismatch>>>,
    /// A cross-check found a difference: the next sync rebuilds.
    pub(super) rebuild_pending: bool,
    pub(super) programmed: Option<(Compiled, Interfaces)>,
    pub(super) guard: GuardReference,
    /// Whether the guard was seeded from the adopted state (once).
    pub(super) guard_seeded: bool,
    /// The endpoint records the dataplane adopted (read once).
    pub(super) adopted: Option<Vec<AdoptedEndpoint>>,
    /// The identity, CIDR and rule numbers the dataplane adopted (read once).
    pub(super) adopted_numbers: Option<AdoptedNumbers>,
    pub(super) need_full: bool,
    /// The cache's count of completed lists at the last return of freed
    /// memory ([`super::memory`]).
    pub(super) trimmed_lists: u64,
    /// The id counters of a failed first apply (nothing programmed yet):
    /// the kernel may hold the ids it handed out, so the rebuild starts
    /// above them.
    pub(super) attempted_ids: Option<IdTables>,
    /// No direct read before this (a held sync stays held until then).
    pub(super) next_direct_read_at: Option<Instant>,
    /// The wait after the next direct read that does not confirm a deletion.
    pub(super) direct_read_backoff: Duration,
    pub(super) known_invalid: BTreeSet<(String, String, Vec<String>)>,
    /// The ClusterNetworkPolicies last reported as not fully understood.
    pub(super) known_invalid_cluster: BTreeMap<String, Vec<String>>,
    /// Where the Events on policies that are not fully understood go
    /// (`None`: logs and metrics only).
    pub(super) events: Option<EventRecorder>,
    pub(super) known_conflicts: BTreeSet<(IpAddr, Vec<String>)>,
    pub(super) flowlog: FlowLog,
    /// Audit mode: the audited policies of the state last compiled.
    pub(super) audit: crate::telemetry::audit::Audit,
    /// Connection semantics: `--established` and the namespaces'
    /// `npm.io/established` (`established.rs`).
    pub(super) established: super::established::EstablishedModes,
    /// The maps the last programmed state did not fit (degraded mode).
    pub(super) degraded: Vec<Shortfall>,
    /// Where each successful sync publishes what it programmed (`/explain`).
    pub(super) programmed_view: crate::explain::ProgrammedView,
    /// npm-cni is expected to be chained: a local endpoint that appears with
    /// no CNI ADD is suspect (its pod started unenforced).
    pub(super) expect_cni_adds: bool,
    /// The pods (uids) of the local endpoints that had an interface, or
    /// were there at the first sync (`None` before it): see
    /// `report_endpoints_without_add`.
    pub(super) local_endpoints: Option<std::collections::HashSet<String>>,
    /// Where the local pods' `npm.io/PolicyEnforced` reasons go after each
    /// sync attempt (`None`: not written; see [`super::enforced`]).
    pub(super) pod_conditions: Option<crate::k8s::pod_conditions::PodConditions>,
    /// nftables: the bridged endpoints' br_netfilter check (stats tick).
    pub(super) bridge_nf: Option<crate::node::bridge_nf::BridgeNfCheck>,
    /// When each deleting pod of another node was first seen (its claim
    /// on its address expires after its grace period).
    pub(super) deletion_clock: super::expiry::DeletionClock,
}

impl<D: AgentDataplane> Syncer<D> {
    /// The health state, shared with the HTTP server.
    pub fn readiness(&self) -> Arc<Readiness> {
        self.readiness.clone()
    }

    /// What was programmed last (the compiled state and the interfaces).
    pub fn programmed(&self) -> Option<&(Compiled, Interfaces)> {
        self.programmed.as_ref()
    }

    /// Copy what is programmed for `/explain`, which waits for it (see
    /// [`crate::explain::ProgrammedView`]); refused while a failed sync left
    /// the compiled state unlike what is programmed.
    pub(super) fn publish_programmed(&self) {
        let view = &self.programmed_view;
        match &self.programmed {
            Some((prog, _)) if view.is_settled() => {
                if view.is_stale() {
                    view.publish(prog, self.incremental.snapshot(), &self.cfg.compile);
                }
            }
            _ => view.refuse(),
        }
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
                tracing::error!(policy = %format!("{ns}/{name}"), error = %e, "invalid NetworkPolicy: enforced without the parts that cannot be understood; it keeps isolating the pods it selects");
            }
        }
        self.metrics.invalid_policies.set(invalid.len() as f64);
        self.known_invalid = invalid;
        let invalid_cluster = self.incremental.invalid_cluster_policies();
        for (name, errors) in &invalid_cluster {
            if self.known_invalid_cluster.get(name) == Some(errors) {
                continue;
            }
            self.metrics.policy_errors.increment(errors.len().max(1) as u64);
            for e in errors {
                tracing::error!(cluster_network_policy = %name, error = %e, "invalid ClusterNetworkPolicy: enforced failing closed where it is not understood");
            }
        }
        self.metrics.invalid_cluster_policies.set(invalid_cluster.len() as f64);
        if invalid_cluster != self.known_invalid_cluster {
            self.readiness.set_problem(
                crate::telemetry::health::CHECK_CLUSTER_POLICY_SUBJECTS,
                never_valid_subjects(&invalid_cluster),
            );
        }
        self.known_invalid_cluster = invalid_cluster;
        for (ip, pods) in conflicts.difference(&self.known_conflicts) {
            self.metrics.ip_conflicts.increment(1);
            tracing::warn!(%ip, pods = ?pods, "IP claimed by more than one live pod; the compiler gives it to one owner");
        }
        self.known_conflicts = conflicts;
    }

    /// Report the maps the programmed state did not fit (`map_full`; empty:
    /// the whole state is programmed): an error line per map when its
    /// report changes, an info line when the last one clears, and
    /// `npm_map_full{map}`, and a Kubernetes Event on the Node when a map
    /// enters degraded mode. The readiness check is set by the loop.
    fn report_map_full(
        metrics: &Metrics,
        events: Option<&EventRecorder>,
        degraded: &mut Vec<Shortfall>,
        map_full: &[Shortfall],
    ) {
        for s in map_full {
            if let Some(events) = events.filter(|_| !degraded.iter().any(|d| d.map == s.map)) {
                events.map_full(MapFullReport {
                    map: s.map.to_string(),
                    detail: s.to_string(),
                });
            }
            if !degraded.iter().any(|d| d == s) {
                tracing::error!(
                    map = s.map,
                    needed = s.needed,
                    capacity = s.capacity,
                    programmed = s.programmed,
                    degraded = s.degraded,
                    unit = s.unit,
                    "kernel map full: programming a reduced, fail-closed state (endpoints keep their last good allows or deny; addresses that do not fit stay unknown); raise the map size (chart value mapSizes) or reduce the policy"
                );
            }
            metrics.map_full(s.map, true);
        }
        for d in degraded.iter() {
            if !map_full.iter().any(|s| s.map == d.map) {
                tracing::info!(map = d.map, "the compiled state fits the map again; programmed whole");
                metrics.map_full(d.map, false);
            }
        }
        *degraded = map_full.to_vec();
    }

    /// Bring the incremental compiler up to `state` (a full rebuild when
    /// `rebuild`, keeping the ids of what is programmed) and report the
    /// snapshot's invalid policies and IP conflicts.
    pub(super) fn compile_state(&mut self, state: &CompleteState, rebuild: bool) {
        if rebuild {
            // The ids of what is programmed are kept (a pod that is still
            // there keeps its endpoint id, and so its conntrack entries).
            let floor;
            let prev = match &self.programmed {
                Some((c, _)) => c,
                None => {
                    floor = super::numbers::unprogrammed_floor(self.attempted_ids.as_ref(), &self.cfg);
                    &floor
                }
            };
            // ClusterNetworkPolicies whose subject is not understood keep
            // their last valid versions across the rebuild.
            let last_valid = self.incremental.last_valid();
            self.incremental =
                compiler::Incremental::new_keeping(state, &self.facts, &self.cfg.compile, Some(prev), last_valid);
            // Until something is programmed (the first sync, its retries,
            // its direct read), every rebuild starts from the adopted ids.
            if self.programmed.is_none() {
                self.seed_endpoint_ids(state);
            }
            self.rebuild_pending = false;
        } else {
            let changes = self.incremental.update(state, &self.facts);
            tracing::trace!(?changes, "incremental compile");
        }
        self.incremental.set_domain_names(&self.names.names);
        let patterns = crate::dns::handle::patterns_of(self.incremental.snapshot());
        let some = !patterns.is_empty();
        if self.dns_names.learning() {
            // Each learned answer counts against its pod's namespace.
            let node = &self.cfg.compile.node_name;
            let map = crate::dns::handle::pod_namespaces_of(self.incremental.snapshot(), node);
            self.dns_names.set_pod_namespaces(map);
        }
        if self.dns_names.set_patterns(patterns) && some && !self.dns_names.learning() {
            tracing::warn!(
                "ClusterNetworkPolicy domainNames peers match nothing: this agent learns no DNS answers \
                 (start it with --dns-server, the cluster DNS Service's addresses)"
            );
        }
        let invalid: BTreeSet<_> = self
            .incremental
            .snapshot()
            .invalid_policies
            .iter()
            .map(|p| (p.namespace.clone(), p.name.clone(), p.errors.clone()))
            .collect();
        if let Some(events) = &self.events {
            let mut reports = reports_of(&self.incremental.snapshot().invalid_policies, &state.policies);
            let cluster: Vec<(String, Vec<String>)> = self.incremental.invalid_cluster_policies().into_iter().collect();
            reports.extend(cluster_reports_of(&cluster, &self.incremental.state().cluster_policies));
            events.report(reports);
        }
        let conflicts = self.incremental.conflicts();
        self.report_snapshot(invalid, conflicts);
        // Audit mode: the audited policies of the state just compiled.
        self.audit.refresh(&state.policies);
    }

    /// Take this node's current addresses into the compile options (a
    /// change rebuilds the compiled state, keeping its ids) and report
    /// whether they are readable (readiness check `node-addresses`). The
    /// last good set stays in force while they are not; before any good
    /// set, nothing is programmed.
    fn update_node_addresses(&mut self) -> Result<(), SyncError> {
        let Some(source) = &self.cfg.node_addresses else {
            return Ok(());
        };
        let state = source.state();
        self.readiness.set_problem("node-addresses", source.readiness_problem());
        let Some(addresses) = state.addresses else {
            return Err(SyncError::NodeAddressesUnknown {
                problem: state.problem.unwrap_or_else(|| "not read yet".into()),
            });
        };
        if state.generation != self.node_generation {
            if self.node_generation != 0 {
                tracing::info!(node_ips = ?addresses, "node addresses changed; recompiling");
            }
            self.node_generation = state.generation;
            self.cfg.compile.node_ips = addresses.to_vec();
            self.rebuild_pending = true;
        }
        Ok(())
    }

    /// Refuses the compiled state when a number it needs is past its range
    /// (see [`super::numbers`]); the next sync rebuilds from what is
    /// programmed.
    fn check_numbers(&mut self) -> Result<(), SyncError> {
        let r = super::numbers::check(self.incremental.compiled(), &self.readiness, &self.metrics);
        if r.is_err() {
            self.rebuild_pending = true;
        }
        r
    }

    /// One sync attempt: snapshot, compile, guard, apply.
    pub async fn sync_once(&mut self) -> Result<SyncOutcome, SyncError> {
        self.update_node_addresses()?;
        let mut outcome = SyncOutcome::default();
        let t0 = Instant::now();
        let Some(mut state) = self.cache.complete() else {
            outcome.not_listed = true;
            return Ok(outcome);
        };
        // Deleting pods of other nodes past their grace period claim no
        // address (a stage of the complete state, before anything compiles
        // it; a held sync's old objects are added after it).
        let expiry = self
            .deletion_clock
            .apply(&state.pods, &self.cfg.compile.node_name, Instant::now());
        state.pods = expiry.pods;
        outcome.next_expiry = expiry.next;
        self.metrics.deleting_claims_expired.set(expiry.expired as f64);
        // The CNI facts are part of the state this sync compiles.
        self.facts = self.node_facts.current();
        // So are the names learned from DNS answers.
        self.names = self.dns_names.current();
        let started = Instant::now();
        let t_state = started.duration_since(t0);
        self.poll_cross_check();
        let rebuild = self.need_full || self.programmed.is_none() || self.rebuild_pending;
        // The objects last programmed (what a held removal keeps).
        let last = self.programmed.is_some().then(|| self.incremental.state());
        // Until this sync succeeds, the compiled state may not be what is
        // programmed (`/explain` is told so).
        self.programmed_view.syncing();
        self.compile_state(&state, rebuild);
        self.check_numbers()?;
        let t_compile = started.elapsed();
        let mut confirmed = false;
        // A held removal: reported once the rest of the sync is programmed.
        let mut held_err = None;
        self.seed_guard();
        if let Some(what) = self.held(Instant::now()) {
            match self.confirm_by_direct_read(what, &mut outcome).await {
                Ok(()) => confirmed = true,
                Err(
                    e @ (SyncError::DirectRead { .. }
                    | SyncError::DirectReadDeferred { .. }
                    | SyncError::NoDirectReader { .. }),
                ) if last.is_some() => {
                    // Hold the removals only: program the current state
                    // plus the old objects it lost (see `hold`), unless
                    // that too would remove too much.
                    let last = last.as_ref().expect("checked");
                    // A rebuild keeping the programmed ids: the held pods
                    // keep their endpoint ids (and tracked flows).
                    let merged = hold::held_state(last, &state);
                    self.compile_state(&merged, true);
                    self.check_numbers()?;
                    if let Some(still) = self.held(Instant::now()) {
                        tracing::warn!(%still, "the held state itself would remove too much; programming nothing");
                        return Err(e);
                    }
                    tracing::warn!(
                        held = hold::held_objects(last, &state),
                        "removals held; programming everything else"
                    );
                    held_err = Some(e);
                }
                Err(e) => return Err(e),
            }
        } else {
            self.start_cross_check(&state);
        }
        let t_guard = started.elapsed();
        // The endpoints whose tier entries changed since the last sync that
        // got here: what is programmed differs from the target only there
        // (a failed write makes the next sync a full one).
        let tier_touched = self.incremental.take_tier_touched();
        let compiled = self.incremental.compiled();
        // CNI-reported veths first: the conflict check then gives an
        // attached veth to its pod, never to a route-resolved endpoint.
        let attached = self.facts.attached_interfaces(compiled);
        let resolved = self.resolver.resolve_attached(compiled, &attached);
        self.metrics
            .interface_conflicts
            .increment(self.resolver.take_new_conflicts());
        outcome.pending_interfaces = resolved.missing.len();
        self.metrics.endpoints_pending.set(resolved.missing.len() as f64);
        if !resolved.missing.is_empty() {
            tracing::debug!(missing = ?resolved.missing, "endpoints without an interface yet; retrying");
        }
        let interfaces = resolved.interfaces;
        if self.expect_cni_adds {
            report_endpoints_without_add(
                compiled,
                &attached,
                &interfaces,
                &mut self.local_endpoints,
                &self.metrics,
            );
        }
        // Endpoints without an interface are left out, and `report_new` is
        // set as `report_new` decides; only then is the compiled state copied.
        let filtered;
        let snapshot = self.incremental.snapshot();
        let target: &Compiled = if compiled.endpoints.keys().all(|id| interfaces.contains_key(id))
            && !super::report_new::report_new_differs(&self.cfg, snapshot, &self.audit, compiled)
        {
            compiled
        } else {
            let mut t = compiled.clone();
            t.endpoints.retain(|id, _| interfaces.contains_key(id));
            super::report_new::apply_report_new(&self.cfg, snapshot, &self.audit, &mut t);
            filtered = t;
            &filtered
        };
        let t_target = started.elapsed();
        let mut t_diff = t_target;

        // Connection semantics: which endpoints' established connections
        // the change about to be programmed may cut.
        let enforce = self.established.enforce_set(&state.namespaces, target);
        // An endpoint that entered `enforce` (an annotation switched, alone)
        // has its tracked connections judged now: the dataplane is called
        // even when nothing else changed.
        let entered_enforce = self.established.entered_enforce(&enforce);
        self.dataplane.set_established_enforce(enforce.clone());
        let degraded = !self.degraded.is_empty();
        let mut map_full = Vec::new();
        match &mut self.programmed {
            Some((prog, prog_ifaces)) if !self.need_full => {
                let mut diff = prog.diff_with_tiers_of(target, tier_touched.as_ref());
                // Degraded mode: what fits (every target from scratch while
                // degraded, so that the whole state comes back).
                let fitted = fit(&self.dataplane, Some(&*prog), (!degraded).then_some(&diff), target);
                let fitted_compiled;
                let target: &Compiled = match fitted {
                    Some(f) => {
                        map_full = f.shortfalls;
                        fitted_compiled = f.compiled;
                        diff = prog.diff(&fitted_compiled);
                        &fitted_compiled
                    }
                    None => target,
                };
                t_diff = started.elapsed();
                if !diff.is_empty() || *prog_ifaces != interfaces || entered_enforce {
                    outcome.changes = diff.len();
                    if let Err(source) = self.dataplane.apply(&diff, target, &interfaces) {
                        self.need_full = true;
                        // The kernel may already hold ids handed out by the
                        // target: they must never be handed out again.
                        prog.ids.raise_to(&target.ids);
                        self.metrics.error("dataplane");
                        return Err(SyncError::Dataplane { op: "apply", source });
                    }
                    outcome.applied = true;
                    // What is programmed now: the same diff, applied in place.
                    diff.ipcache.apply_to(&mut prog.ipcache);
                    diff.cidrs.apply_to(&mut prog.cidrs);
                    diff.endpoints.apply_to(&mut prog.endpoints);
                    diff.policy.apply_to_policy(&mut prog.policy);
                    diff.tiers.apply_to(&mut prog.tiers);
                    *prog_ifaces = interfaces;
                }
                update_ids(&mut prog.ids, &target.ids);
                debug_assert!(prog.ids == target.ids);
            }
            _ => {
                let last = self.programmed.as_ref().map(|p| &p.0);
                let fitted = fit(&self.dataplane, last, None, target);
                let fitted_compiled;
                let target: &Compiled = match fitted {
                    Some(f) => {
                        map_full = f.shortfalls;
                        fitted_compiled = f.compiled;
                        &fitted_compiled
                    }
                    None => target,
                };
                if let Err(source) = self.dataplane.sync_full(target, &interfaces) {
                    self.need_full = true;
                    // The kernel may already hold ids handed out by the
                    // target: they must never be handed out again.
                    match &mut self.programmed {
                        Some((prog, _)) => prog.ids.raise_to(&target.ids),
                        None => match &mut self.attempted_ids {
                            Some(ids) => ids.raise_to(&target.ids),
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
                outcome.changes = target.ipcache.len()
                    + target.cidrs.len()
                    + target.endpoints.len()
                    + target.policy.len()
                    + target.tiers.len();
                self.programmed = Some((target.clone(), interfaces));
                self.attempted_ids = None;
            }
        }
        Self::report_map_full(&self.metrics, self.events.as_ref(), &mut self.degraded, &map_full);
        outcome.map_full = map_full;
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
        self.established.programmed(enforce);
        for (map, n) in [
            ("ipcache", target.ipcache.len()),
            ("cidrs", target.cidrs.len()),
            ("endpoints", target.endpoints.len()),
            ("policy", target.policy.len()),
            ("tiers", target.tiers.len()),
        ] {
            self.metrics.compiled_entries(map, n);
        }
        let (ids, eps) = (pod_identities(target).count(), target.endpoints.len());
        let now = Instant::now();
        if confirmed {
            self.guard.reset(now, ids, eps);
        } else {
            self.guard.observe(now, ids, eps);
        }
        self.guard.observe_enforcement(now, self.incremental.snapshot(), target);
        let cnps = self.incremental.cluster_policy_names().map(String::from).collect();
        self.guard.observe_tiers(now, cnps, target);
        let nodes = self.incremental.node_names().map(String::from).collect();
        self.guard.observe_nodes(now, nodes, target);
        self.metrics.sync_duration.record(started.elapsed().as_secs_f64());
        if outcome.applied {
            self.metrics.syncs.increment(1);
        }
        if self.readiness.first_sync_applied() {
            tracing::info!("first full sync applied; ready");
        }
        if let Some((prog, interfaces)) = &self.programmed {
            // What CNI requests wait for: this sync's facts, programmed.
            self.node_facts.publish(self.facts.programmed(prog, interfaces));
            // What held DNS responses wait for.
            self.dns_names.publish_programmed(self.names.version);
        }
        // `/explain` copies this state when it asks (`publish_programmed`).
        self.programmed_view.synced();
        // A list completed since the last sync: the relist's buffer and
        // the state it replaced are freed now; give their pages back.
        if super::memory::after_new_lists(&mut self.trimmed_lists, self.cache.lists_completed()) {
            super::memory::release_free();
        }
        match held_err {
            Some(e) => Err(e),
            None => Ok(outcome),
        }
    }
}

/// Logs and counts each local endpoint of `compiled` that gets an interface
/// (`interfaces`) for the first time with no CNI ADD fact (`attached`), for
/// a node where npm-cni is expected to be chained: its pod started without
/// npm-cni holding it until enforced (npm-cni un-chained by the primary
/// CNI, or a runtime that skipped it). `known` (updated) holds the pods of
/// the endpoints that had an interface, or were there at the first sync
/// (pods older than npm, or than the agent's facts, are not suspect), while
/// they stay endpoints: an endpoint whose interface is briefly not found is
/// not counted again.
fn report_endpoints_without_add(
    compiled: &Compiled,
    attached: &Interfaces,
    interfaces: &Interfaces,
    known: &mut Option<std::collections::HashSet<String>>,
    metrics: &Metrics,
) {
    let Some(seen) = known.as_ref() else {
        *known = Some(compiled.endpoints.values().map(|ep| ep.pod.uid.clone()).collect());
        return;
    };
    let mut next = std::collections::HashSet::with_capacity(compiled.endpoints.len());
    for (id, ep) in &compiled.endpoints {
        let was_seen = seen.contains(&ep.pod.uid);
        if !interfaces.contains_key(id) && !was_seen {
            continue;
        }
        if !was_seen && !attached.contains_key(id) {
            tracing::warn!(
                pod = %format!("{}/{}", ep.pod.namespace, ep.pod.name),
                uid = %ep.pod.uid,
                "a local endpoint appeared with no CNI ADD: its pod started before npm enforced its \
                 policies (npm-cni not chained?)"
            );
            metrics.cni_endpoints_without_add.increment(1);
        }
        next.insert(ep.pod.uid.clone());
    }
    *known = Some(next);
}

/// The readiness problem of the ClusterNetworkPolicies of `invalid` (name,
/// errors) that never had a subject this agent understands: each selects
/// no pod (`ClusterConsequence::SelectsNothing`); `None` when there are
/// none. A policy whose last valid subject stays enforced is not one.
fn never_valid_subjects(invalid: &BTreeMap<String, Vec<String>>) -> Option<String> {
    let nothing = npm_policy::tiers::validate::ClusterConsequence::SelectsNothing.to_string();
    let names: Vec<&str> = invalid
        .iter()
        .filter(|(_, errors)| errors.iter().any(|e| e.contains(&nothing)))
        .map(|(name, _)| name.as_str())
        .collect();
    (!names.is_empty()).then(|| {
        format!(
            "ClusterNetworkPolicy {} never had a subject this agent understands: it selects no pod \
             (its Denies are enforced nowhere; fix its subject)",
            names.join(", ")
        )
    })
}
