//! The agent's health as `/readyz` and `/healthz` tell it: one small shared
//! state ([`Health`]) that the sync loop writes and the HTTP server reads.
//!
//! `/readyz` is a list of named checks, printed one line per check by
//! `/readyz?verbose` as the kube-apiserver does (`[+]name ok`,
//! `[-]name failed: reason`). The agent is ready when every check passes:
//!
//! | check | fails while | written by |
//! |---|---|---|
//! | `lists` | the pod, namespace, NetworkPolicy or ClusterNetworkPolicy list has not completed (the server reads the cache) | - |
//! | `first-sync` | no full sync has been applied yet | [`Health::first_sync_applied`] |
//! | `held-removal` | a mass removal has been held (waiting for a confirming direct read) longer than [`HealthConfig::max_held_removal`] | [`Health::removal_held`], cleared by [`Health::sync_succeeded`] |
//! | `apply-failures` | the last [`HealthConfig::max_apply_failures`] (or more) applies failed in a row | [`Health::apply_failed`], cleared by [`Health::sync_succeeded`] |
//! | `map-capacity` | the last apply failed because a kernel map is full ([`npm_dataplane::DataplaneError::is_map_full`]), or the last sync programmed a reduced state because the compiled state does not fit a map (degraded mode; the reason names the map and its sizes) | [`Health::apply_failed`], [`Health::maps_degraded`] |
//! | `cluster-network-policies` | the ClusterNetworkPolicy list fails for a reason that is not "not served" in `auto` (RBAC `403`; a `404` with `--cluster-network-policies=on`) | the CNP watcher (`k8s::watcher`), through [`Health::set_problem`] |
//! | `cni-chained` | with `--cni-conf-dir`: the conflist the runtime uses lacks npm-cni's entry (or there is no usable one), the entry was just put back (until the next check confirms it), or the primary CNI removed it 3 times in 5 minutes | `cni::chain`, through [`Health::set_problem`] |
//! | `bridge-netfilter` | nftables dataplane: a local endpoint is a bridge port and the bridge-nf-call sysctl of its family is 0 or absent (br_netfilter not loaded) | `node::bridge_nf`, through [`Health::set_problem`] |
//! | any other name | a problem another part of the agent reports | [`Health::set_problem`] |
//!
//! **Reporting a problem from elsewhere** (e.g. "node addresses unreadable"):
//! call `health.set_problem("node-addresses", Some(reason))` when it starts
//! and `health.set_problem("node-addresses", None)` when it is over. The
//! check appears in `/readyz?verbose` from its first report on (`[+]... ok`
//! once cleared), makes the agent unready while it holds a reason, and is
//! counted in `npm_readiness_failures{check}`. Names are short kebab-case
//! words, as the built-in checks.
//!
//! `/healthz` has one check, `sync-loop`: it fails when the sync loop has
//! made no progress (a pass of its loop, even an idle one: the loop ticks at
//! least every few seconds) for [`HealthConfig::max_stall`], so the kubelet
//! restarts an agent whose loop is stuck. The [`Watchdog`] that decides it
//! reads an injected [`Clock`], so it is tested without waiting.
//!
//! Metrics (through the registry given with [`Health::with_metrics`]):
//! `npm_ready` (1 when every check but `lists` passes: the first sync implies
//! the lists completed), `npm_held_removals` (1 while a removal is held, 0
//! otherwise), `npm_last_sync_success_timestamp_seconds` (Unix time of the
//! last sync that completed without error) and `npm_readiness_failures{check}`
//! (1 while that check fails).

use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use npm_dataplane::DataplaneError;

use super::metrics::Metrics;

/// Name of the check of the four lists (computed by the HTTP server from
/// the cache).
pub const CHECK_LISTS: &str = "lists";
/// Name of the first-sync check.
pub const CHECK_FIRST_SYNC: &str = "first-sync";
/// Name of the held-removal check.
pub const CHECK_HELD_REMOVAL: &str = "held-removal";
/// Name of the consecutive apply failures check.
pub const CHECK_APPLY_FAILURES: &str = "apply-failures";
/// Name of the full-map check.
pub const CHECK_MAP_CAPACITY: &str = "map-capacity";
/// Name of the liveness check of the sync loop.
pub const CHECK_SYNC_LOOP: &str = "sync-loop";
/// Name of the check that fails while a ClusterNetworkPolicy has never had
/// a subject this agent understands (it selects no pod: an Admin Deny with
/// a typo in its subject is not enforced anywhere).
pub const CHECK_CLUSTER_POLICY_SUBJECTS: &str = "cluster-policy-subjects";

/// A source of the current time (injected so that tests drive the time).
pub trait Clock: Send + Sync + fmt::Debug {
    /// The current instant.
    fn now(&self) -> Instant;
}

/// The monotonic system clock.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Instant {
        Instant::now()
    }
}

/// When the health checks fail (`npm-agent run` flags).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HealthConfig {
    /// A removal held longer than this makes the agent unready
    /// (`--max-held-removal-secs`).
    pub max_held_removal: Duration,
    /// This many applies failing in a row make the agent unready
    /// (`--max-apply-failures`, at least 1).
    pub max_apply_failures: u32,
    /// No progress of the sync loop for this long fails `/healthz`.
    pub max_stall: Duration,
}

/// Default of [`HealthConfig::max_held_removal`], in seconds.
pub const DEFAULT_MAX_HELD_REMOVAL_SECS: u64 = 300;
/// Default of [`HealthConfig::max_apply_failures`].
pub const DEFAULT_MAX_APPLY_FAILURES: u32 = 3;
/// [`HealthConfig::max_stall`]: 60 s without progress fails `/healthz`.
pub const MAX_STALL: Duration = Duration::from_secs(60);

impl Default for HealthConfig {
    fn default() -> Self {
        HealthConfig {
            max_held_removal: Duration::from_secs(DEFAULT_MAX_HELD_REMOVAL_SECS),
            max_apply_failures: DEFAULT_MAX_APPLY_FAILURES,
            max_stall: MAX_STALL,
        }
    }
}

/// One check's result: `failure` is `None` when it passes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Check {
    /// The check's name.
    pub name: String,
    /// Why it fails (`None`: it passes).
    pub failure: Option<String>,
}

impl Check {
    fn new(name: &str, failure: Option<String>) -> Self {
        Check {
            name: name.to_string(),
            failure,
        }
    }

    /// Whether the check passes.
    pub fn ok(&self) -> bool {
        self.failure.is_none()
    }

    /// The kube-apiserver style line: `[+]name ok` or `[-]name failed: reason`.
    pub fn line(&self) -> String {
        match &self.failure {
            None => format!("[+]{} ok", self.name),
            Some(reason) => format!("[-]{} failed: {reason}", self.name),
        }
    }
}

/// Decides whether the sync loop is stuck: [`Watchdog::progress`] at every
/// pass of the loop, [`Watchdog::stalled_for`] by the liveness check.
#[derive(Debug)]
pub struct Watchdog {
    clock: Arc<dyn Clock>,
    max_stall: Duration,
    last: Mutex<Instant>,
}

impl Watchdog {
    /// A watchdog that considers the loop alive from now on.
    pub fn new(clock: Arc<dyn Clock>, max_stall: Duration) -> Self {
        let last = Mutex::new(clock.now());
        Watchdog { clock, max_stall, last }
    }

    /// The loop made progress now.
    pub fn progress(&self) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = self.clock.now();
    }

    /// How long the loop has made no progress, when that is longer than
    /// the allowed stall.
    pub fn stalled_for(&self) -> Option<Duration> {
        let last = *self.last.lock().unwrap_or_else(|p| p.into_inner());
        let idle = self.clock.now().saturating_duration_since(last);
        (idle > self.max_stall).then_some(idle)
    }

    /// The `sync-loop` check.
    pub fn check(&self) -> Check {
        Check::new(
            CHECK_SYNC_LOOP,
            self.stalled_for().map(|idle| {
                format!(
                    "the sync loop made no progress for {}s (limit {}s)",
                    idle.as_secs(),
                    self.max_stall.as_secs()
                )
            }),
        )
    }
}

#[derive(Debug, Default)]
struct State {
    first_sync: bool,
    /// Since when a removal is held, and what it would remove.
    held: Option<(Instant, String)>,
    apply_failures: u32,
    last_apply_error: Option<String>,
    map_full: Option<String>,
    problems: BTreeMap<String, Option<String>>,
}

/// The shared health state (see the module doc): written by the sync loop
/// (and by other parts through [`Health::set_problem`]), read by the HTTP
/// server.
pub struct Health {
    cfg: HealthConfig,
    clock: Arc<dyn Clock>,
    watchdog: Watchdog,
    state: Mutex<State>,
    metrics: Option<Metrics>,
}

impl fmt::Debug for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Health")
            .field("cfg", &self.cfg)
            .field("watchdog", &self.watchdog)
            .field("state", &*self.state())
            .field("metrics", &self.metrics.is_some())
            .finish()
    }
}

impl Default for Health {
    fn default() -> Self {
        Health::new(HealthConfig::default())
    }
}

impl Health {
    /// Health with the settings `cfg`, on the system clock, publishing no
    /// metrics.
    pub fn new(cfg: HealthConfig) -> Self {
        Health::with_clock(cfg, Arc::new(SystemClock))
    }

    /// Health on the clock `clock` (tests).
    pub fn with_clock(cfg: HealthConfig, clock: Arc<dyn Clock>) -> Self {
        Health {
            watchdog: Watchdog::new(clock.clone(), cfg.max_stall),
            cfg,
            clock,
            state: Mutex::new(State::default()),
            metrics: None,
        }
    }

    /// Publish the health metrics (module doc) into `metrics`.
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = Some(metrics);
        self.publish();
        self
    }

    /// The settings.
    pub fn config(&self) -> &HealthConfig {
        &self.cfg
    }

    fn state(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A full sync was applied; `true` the first time (the agent becomes
    /// ready unless another check fails).
    pub fn first_sync_applied(&self) -> bool {
        let first = !std::mem::replace(&mut self.state().first_sync, true);
        self.publish();
        first
    }

    /// Whether the first full sync has been applied.
    pub fn first_sync_done(&self) -> bool {
        self.state().first_sync
    }

    /// A sync completed without error: nothing is held, no apply failed.
    pub fn sync_succeeded(&self) {
        {
            let mut s = self.state();
            s.held = None;
            s.apply_failures = 0;
            s.last_apply_error = None;
            s.map_full = None;
        }
        if let Some(m) = &self.metrics {
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap_or_default();
            m.last_sync_success.set(now.as_secs_f64());
        }
        self.publish();
    }

    /// A sync was held because it would remove `what` (a mass removal
    /// waiting for a confirming direct read); the hold is timed from its
    /// first report.
    pub fn removal_held(&self, what: &str) {
        {
            let now = self.clock.now();
            let mut s = self.state();
            match &mut s.held {
                Some((_, w)) => *w = what.to_string(),
                None => s.held = Some((now, what.to_string())),
            }
        }
        self.publish();
    }

    /// An apply (or full sync) failed with `error`; a failure after a hold
    /// means the hold is over.
    pub fn apply_failed(&self, error: &DataplaneError) {
        {
            let mut s = self.state();
            s.held = None;
            s.apply_failures = s.apply_failures.saturating_add(1);
            s.last_apply_error = Some(error.to_string());
            s.map_full = error.is_map_full().then(|| error.to_string());
        }
        self.publish();
    }

    /// The last sync programmed a reduced, fail-closed state because the
    /// compiled state does not fit a kernel map (`Some(reason)`, naming the
    /// map and its sizes), or the whole state (`None`). Call after
    /// [`Health::sync_succeeded`], which clears it.
    pub fn maps_degraded(&self, reason: Option<String>) {
        self.state().map_full = reason;
        self.publish();
    }

    /// Report (`Some(reason)`) or clear (`None`) the problem `name`: while
    /// it has a reason, the check `name` fails and the agent is not ready.
    pub fn set_problem(&self, name: &str, problem: Option<String>) {
        self.state().problems.insert(name.to_string(), problem);
        self.publish();
    }

    /// The sync loop made progress (called at every pass of the loop).
    pub fn loop_progress(&self) {
        self.watchdog.progress();
        // Time-based checks change without a write: refresh the gauges.
        self.publish();
    }

    /// The watchdog of the sync loop.
    pub fn watchdog(&self) -> &Watchdog {
        &self.watchdog
    }

    /// The readiness checks, in order (without `lists`, which the server
    /// adds from the cache).
    pub fn readiness(&self) -> Vec<Check> {
        let now = self.clock.now();
        let s = self.state();
        let mut checks = vec![Check::new(
            CHECK_FIRST_SYNC,
            (!s.first_sync).then(|| "no full sync applied yet".to_string()),
        )];
        let held = s.held.as_ref().and_then(|(since, what)| {
            let held_for = now.saturating_duration_since(*since);
            (held_for > self.cfg.max_held_removal).then(|| {
                format!(
                    "a removal has been held for {}s (limit {}s): {what}",
                    held_for.as_secs(),
                    self.cfg.max_held_removal.as_secs()
                )
            })
        });
        checks.push(Check::new(CHECK_HELD_REMOVAL, held));
        let failures = (s.apply_failures >= self.cfg.max_apply_failures.max(1)).then(|| {
            format!(
                "{} applies failed in a row (limit {}); last: {}",
                s.apply_failures,
                self.cfg.max_apply_failures,
                s.last_apply_error.as_deref().unwrap_or("unknown")
            )
        });
        checks.push(Check::new(CHECK_APPLY_FAILURES, failures));
        checks.push(Check::new(CHECK_MAP_CAPACITY, s.map_full.clone()));
        for (name, problem) in &s.problems {
            checks.push(Check::new(name, problem.clone()));
        }
        checks
    }

    /// Whether every readiness check passes.
    pub fn is_ready(&self) -> bool {
        self.readiness().iter().all(Check::ok)
    }

    /// The liveness checks (`sync-loop`).
    pub fn liveness(&self) -> Vec<Check> {
        vec![self.watchdog.check()]
    }

    fn publish(&self) {
        let Some(m) = &self.metrics else {
            return;
        };
        let checks = self.readiness();
        m.ready.set(if checks.iter().all(Check::ok) { 1.0 } else { 0.0 });
        m.held_removals.set(if self.state().held.is_some() { 1.0 } else { 0.0 });
        for c in &checks {
            m.readiness_failure(&c.name, !c.ok());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::sample;

    /// A clock the test moves.
    #[derive(Debug)]
    struct ManualClock(Mutex<Instant>);

    impl ManualClock {
        fn advance(&self, d: Duration) {
            *self.0.lock().unwrap() += d;
        }
    }

    impl Clock for ManualClock {
        fn now(&self) -> Instant {
            *self.0.lock().unwrap()
        }
    }

    fn clock() -> Arc<ManualClock> {
        Arc::new(ManualClock(Mutex::new(Instant::now())))
    }

    fn failing(h: &Health) -> Vec<String> {
        h.readiness().into_iter().filter(|c| !c.ok()).map(|c| c.name).collect()
    }

    #[test]
    fn watchdog_fails_after_the_stall_limit_and_recovers_on_progress() {
        let c = clock();
        let w = Watchdog::new(c.clone(), Duration::from_secs(60));
        assert_eq!(w.stalled_for(), None);
        c.advance(Duration::from_secs(59));
        assert_eq!(w.stalled_for(), None, "59 s is within the limit");
        w.progress();
        c.advance(Duration::from_secs(60));
        assert_eq!(w.stalled_for(), None, "60 s since the last progress");
        c.advance(Duration::from_secs(15));
        assert_eq!(w.stalled_for(), Some(Duration::from_secs(75)));
        assert_eq!(
            w.check().line(),
            "[-]sync-loop failed: the sync loop made no progress for 75s (limit 60s)"
        );
        w.progress();
        assert_eq!(w.check().line(), "[+]sync-loop ok");
    }

    #[test]
    fn not_ready_until_the_first_sync_then_ready() {
        let h = Health::with_clock(HealthConfig::default(), clock());
        assert_eq!(failing(&h), ["first-sync"]);
        assert_eq!(
            h.readiness()[0].line(),
            "[-]first-sync failed: no full sync applied yet"
        );
        assert!(h.first_sync_applied());
        assert!(!h.first_sync_applied(), "only the first time");
        assert!(h.is_ready());
        let lines: Vec<String> = h.readiness().iter().map(Check::line).collect();
        assert_eq!(
            lines,
            [
                "[+]first-sync ok",
                "[+]held-removal ok",
                "[+]apply-failures ok",
                "[+]map-capacity ok"
            ]
        );
    }

    #[test]
    fn a_removal_held_longer_than_the_limit_makes_it_unready() {
        let c = clock();
        let cfg = HealthConfig {
            max_held_removal: Duration::from_secs(300),
            ..HealthConfig::default()
        };
        let h = Health::with_clock(cfg, c.clone());
        h.first_sync_applied();
        h.removal_held("3/4 identities and 3/4 endpoints would be removed");
        c.advance(Duration::from_secs(200));
        h.removal_held("3/4 identities and 3/4 endpoints would be removed");
        assert!(h.is_ready(), "held for 200 s: within the limit");
        c.advance(Duration::from_secs(101));
        assert_eq!(failing(&h), ["held-removal"]);
        let line = h.readiness()[1].line();
        assert_eq!(
            line,
            "[-]held-removal failed: a removal has been held for 301s (limit 300s): 3/4 identities and 3/4 endpoints would be removed"
        );
        h.sync_succeeded();
        assert!(h.is_ready(), "a sync went through: nothing held");
    }

    #[test]
    fn consecutive_apply_failures_and_full_maps() {
        let h = Health::with_clock(HealthConfig::default(), clock());
        h.first_sync_applied();
        let err = |detail: &str| DataplaneError::Kernel {
            op: "apply".into(),
            detail: detail.into(),
        };
        h.apply_failed(&err("one"));
        h.apply_failed(&err("two"));
        assert!(h.is_ready(), "2 failures < 3");
        h.apply_failed(&err("three"));
        assert_eq!(failing(&h), ["apply-failures"]);
        assert!(h.readiness()[2]
            .line()
            .ends_with("3 applies failed in a row (limit 3); last: apply: three"));
        h.sync_succeeded();
        assert!(h.is_ready());
        let full = DataplaneError::MapFull {
            map: "NPM_POLICY",
            source: npm_dataplane::ebpf::EbpfError::MapMissing { map: "NPM_POLICY" },
        };
        h.apply_failed(&full);
        assert_eq!(failing(&h), ["map-capacity"], "one failure, but a full map");
        assert!(h.readiness()[3]
            .line()
            .starts_with("[-]map-capacity failed: map NPM_POLICY is full"));
        h.apply_failed(&err("other"));
        assert!(h.is_ready(), "the last error is not a full map, and 2 failures < 3");
    }

    #[test]
    fn problems_reported_by_other_parts_and_metrics() {
        let m = Metrics::new().unwrap();
        let h = Health::with_clock(HealthConfig::default(), clock()).with_metrics(m.clone());
        assert_eq!(sample(&m.render(), "npm_ready"), Some(0.0));
        h.first_sync_applied();
        assert_eq!(sample(&m.render(), "npm_ready"), Some(1.0));
        h.set_problem("node-addresses", Some("netlink: permission denied".into()));
        assert_eq!(failing(&h), ["node-addresses"]);
        assert_eq!(
            h.readiness().last().unwrap().line(),
            "[-]node-addresses failed: netlink: permission denied"
        );
        let text = m.render();
        assert_eq!(sample(&text, "npm_ready"), Some(0.0));
        assert_eq!(
            sample(&text, "npm_readiness_failures{check=\"node-addresses\"}"),
            Some(1.0)
        );
        h.set_problem("node-addresses", None);
        assert!(h.is_ready());
        assert_eq!(h.readiness().last().unwrap().line(), "[+]node-addresses ok");
        h.removal_held("x");
        assert_eq!(sample(&m.render(), "npm_held_removals"), Some(1.0));
        h.sync_succeeded();
        let text = m.render();
        assert_eq!(sample(&text, "npm_held_removals"), Some(0.0));
        assert!(sample(&text, "npm_last_sync_success_timestamp_seconds").unwrap() > 1.7e9);
    }
}
