//! The chaos soak (`cargo xtask chaos`, `npm-chaos`): a seeded random
//! schedule of changes and faults on the two-node netns cluster (pods wired
//! by the reference `ptp` plugin chained with npm-cni, one real agent per
//! node, and each node's kube-proxy emulation programming one Service per
//! pod), continuous TCP and UDP probes between pods, to their
//! addresses and through their ClusterIPs, and an oracle that judges every
//! probe against the states the cluster passed through.
//!
//! - [`schedule`]: the seeded steps (pods created, deleted, relabelled;
//!   addresses of deleted pods reused by the CNI chain, on their subnet's
//!   node or moved to the other one;
//!   NetworkPolicies created, updated, deleted, one written invalid;
//!   namespaces relabelled; an agent killed with SIGKILL and started again;
//!   an agent stopped while npm-cni's ADD times out, the address then
//!   given to another pod;
//!   API faults: 410 Gone on a relist, dropped watches, an outage of lists
//!   and watches, 404 on the ClusterNetworkPolicy resource, slow answers).
//! - [`oracle`]: states, legal kept states, violations and liveness
//!   failures (bounds in [`oracle::Bounds`]).
//! - [`monitor`]: the agents' readiness and held removals, settle times.
//!
//! One tick a second: perhaps a step (one in two ticks), the agents
//! polled, then a round of [`PROBES_PER_ROUND`] probes (half of them on
//! pairs whose verdict the latest changes flipped), 500 ms timeout each
//! and one retry of a failed one: at most 16 connection attempts a second,
//! four probe threads (mostly waiting). The run ends with one
//! JSON line (`"bench":"chaos"`).

pub mod monitor;
pub mod oracle;
pub mod schedule;

use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::json;

use crate::probe::{probe_all, Probe, ProbeConfig, Proto};
use crate::runner::{CniMode, Engine, KubeProxyMode, LiveRunner, Options, RunnerError};
use oracle::{Bounds, Oracle, ProbeProto, ProbeRecord, Verdict};
use schedule::{Fault, Step, World};

/// Probes per round (one round a tick).
pub const PROBES_PER_ROUND: usize = 8;
/// Nodes of the soak's cluster.
pub const NODES: u8 = 2;
/// How long (ticks) an API fault counts as a disturbance after it ended:
/// the agents' watchers back off and relist in that time.
const FAULT_TAIL_TICKS: u64 = 10;

/// Errors of the soak.
#[derive(Debug, thiserror::Error)]
pub enum ChaosError {
    /// The cluster, the API or a step failed.
    #[error("{0}")]
    Runner(#[from] RunnerError),
    /// A step of the schedule could not be applied.
    #[error("step {index} ({what}): {message}")]
    Step {
        /// Step number.
        index: usize,
        /// The step.
        what: String,
        /// The error.
        message: String,
    },
}

/// Options of a soak.
#[derive(Clone, Debug)]
pub struct ChaosOptions {
    /// `Engine::Ebpf` or `Engine::Nftables`.
    pub engine: Engine,
    /// Seconds of schedule (the setup comes before).
    pub duration: u64,
    /// The seed.
    pub seed: u64,
    /// The agent binary.
    pub agent_bin: PathBuf,
    /// The npm-cni binary.
    pub npm_cni_bin: PathBuf,
    /// Fault injection: agents drop every NetworkPolicy watch delete
    /// (`NPM_TEST_SKIP_DELETE=networkpolicies`); the oracle must report it.
    pub inject: bool,
    /// The oracle's bounds.
    pub bounds: Bounds,
    /// A `kill -9` of node `.1`'s agent (down 3 s) at tick `.0`, beside
    /// the drawn steps: a short run is sure to restart an agent, across
    /// the map-layout change of a node's first restart.
    pub kill_at: Option<(u64, u8)>,
    /// A [`Step::CniTimeout`] on node `.1` at tick `.0` (at the first freed
    /// address of that node's subnet from then on), beside the drawn steps.
    pub cni_timeout_at: Option<(u64, u8)>,
}

/// The figures of a soak.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Dataplane name.
    pub dataplane: String,
    /// The seed.
    pub seed: u64,
    /// Seconds of schedule.
    pub duration: u64,
    /// Steps applied.
    pub steps: usize,
    /// States (steps that changed what the API server holds, plus the first).
    pub states: usize,
    /// Probes run.
    pub probes: usize,
    /// Probes that connected.
    pub connected: usize,
    /// Probes through a ClusterIP, and how many of them connected.
    pub via_service: (usize, usize),
    /// eBPF: nodes whose agent restarted across the map-layout change, and
    /// how many of them had retired the other layout's pins by the end.
    pub layout_changes: (usize, usize),
    /// Violations.
    pub violations: usize,
    /// Liveness failures.
    pub liveness_failures: usize,
    /// Settle times (s): from a fault's end or an agent's restart to every
    /// agent ready with nothing held.
    pub settle: Vec<f64>,
    /// [`Step::CniTimeout`]s whose ADD failed (npm-cni failed closed); an
    /// ADD that succeeded is counted in `violations`.
    pub cni_timeouts: usize,
    /// The largest agent resident set seen (MB).
    pub agent_rss_max_mb: f64,
    /// The fastest growth of one agent process's resident set, from a
    /// minute after its start over at least a minute more (MB per hour;
    /// `None`: none lived that long).
    pub agent_rss_growth_mb_per_h: Option<f64>,
    /// The fullest kernel map seen (eBPF): name and fill (0..1).
    pub map_fill: Option<(String, f64)>,
    /// The reports of the violations and liveness failures (the first 20).
    pub findings: Vec<String>,
    /// Whether the fault injection was on.
    pub inject: bool,
}

impl Report {
    /// The result line.
    pub fn json_line(&self) -> String {
        json!({
            "bench": "chaos",
            "dataplane": self.dataplane,
            "seed": self.seed,
            "duration_s": self.duration,
            "inject": self.inject,
            "steps": self.steps,
            "states": self.states,
            "probes": self.probes,
            "connected": self.connected,
            "via_cluster_ip": self.via_service.0,
            "via_cluster_ip_connected": self.via_service.1,
            "layout_changes": self.layout_changes.0,
            "layouts_retired": self.layout_changes.1,
            "violations": self.violations,
            "liveness_failures": self.liveness_failures,
            "cni_timeouts": self.cni_timeouts,
            "agent_rss_max_mb": round3(self.agent_rss_max_mb),
            "agent_rss_growth_mb_per_h": self.agent_rss_growth_mb_per_h.map(round3),
            "map_fullest": self.map_fill.as_ref().map(|m| m.0.clone()),
            "map_fill": self.map_fill.as_ref().map(|m| round3(m.1)),
            "settle_events": self.settle.len(),
            "settle_p50_s": round3(monitor::percentile(&self.settle, 50.0)),
            "settle_p99_s": round3(monitor::percentile(&self.settle, 99.0)),
            "probes_per_round": PROBES_PER_ROUND,
            "probes_per_s": round3(self.probes as f64 / self.duration.max(1) as f64),
        })
        .to_string()
    }
}

fn round3(v: f64) -> f64 {
    (v * 1000.0).round() / 1000.0
}

/// A resident set sample: (seconds since the start, KiB).
type RssSample = (f64, u64);

/// Seconds of an agent process's life before its resident set counts for
/// growth (its first sync and caches fill in that time).
const RSS_WARMUP_S: f64 = 60.0;

/// One agent process's resident set as the soak samples it.
#[derive(Clone, Copy, Debug)]
struct AgentRss {
    /// When it was first sampled.
    seen: f64,
    /// The first sample after [`RSS_WARMUP_S`].
    base: Option<RssSample>,
    /// The latest sample.
    last: RssSample,
}

/// npm-cni's `timeoutSeconds` in a [`Step::CniTimeout`].
const CNI_TIMEOUT_SECS: u64 = 2;

/// A pending end of something the schedule started, at a tick (ticks,
/// not seconds, so that a seed replays the same steps however long a tick
/// took).
enum Pending {
    /// Clear the API faults at this tick; the disturbance handle.
    ClearFaults(u64, usize),
    /// End a disturbance at this tick.
    EndDisturbance(u64, usize),
    /// End a fault's disturbance at this tick.
    EndFault(u64, usize),
    /// Start node `k`'s agent again at this tick.
    Respawn(u64, u8),
}

struct Soak {
    runner: LiveRunner,
    oracle: Oracle,
    world: World,
    /// The schedule's generator (steps only).
    rng: StdRng,
    /// The probes' generator (pairs), apart so the steps replay.
    probe_rng: StdRng,
    tick: u64,
    t0: Instant,
    pending: Vec<Pending>,
    /// Open "node-k unsettled" disturbances, by node.
    unsettled: Vec<Option<usize>>,
    /// Times after which the next all-settled poll is a settle time.
    settle_from: Vec<f64>,
    settle: Vec<f64>,
    restarts: u32,
    /// The nodes whose agent was restarted.
    restarted: std::collections::BTreeSet<u8>,
    probes: Vec<ProbeRecord>,
    cfg: ProbeConfig,
    steps: usize,
    /// Drawn steps not applied yet: a pod made by the CNI chain waits
    /// while an API fault runs, an agent is down or not ready (npm-cni's
    /// ADD needs the node's agent to have seen the pod; a kubelet would
    /// retry); no step is drawn meanwhile. A seed replays the same steps
    /// as long as the agents' readiness falls on the same ticks.
    deferred: std::collections::VecDeque<Step>,
    /// [`Step::CniTimeout`]s whose ADD failed, as it must.
    cni_timeouts: usize,
    /// `ChaosOptions::cni_timeout_at`'s step was queued.
    forced_cni_timeout: bool,
    /// Their one-line records.
    cni_log: Vec<String>,
    /// Findings: ADDs that succeeded with the agent stopped.
    cni_fail_open: Vec<String>,
    /// By node: the current agent process's resident set; reset when the
    /// agent restarts.
    rss: Vec<Option<AgentRss>>,
    /// The largest resident set any agent had (KiB).
    rss_max_kib: u64,
    /// The fullest kernel map seen at any poll (eBPF).
    map_fill: Option<(String, f64)>,
}

/// Runs a soak, printing progress and each finding to `out`; returns the
/// figures (the caller prints [`Report::json_line`]).
pub fn run(opts: &ChaosOptions, out: &mut dyn Write) -> Result<Report, ChaosError> {
    let mut agent_env = vec![];
    if opts.inject {
        agent_env.push(("NPM_TEST_SKIP_DELETE".to_string(), "networkpolicies".to_string()));
    }
    let runner = LiveRunner::start(Options {
        engine: opts.engine,
        agent_bin: opts.agent_bin.clone(),
        npm_cni_bin: opts.npm_cni_bin.clone(),
        nodes: NODES as usize,
        cni: CniMode::Ptp,
        // Every model pod gets its own Service, programmed by the
        // kube-proxy emulation of each node in the mode CI's conformance
        // row of the dataplane uses: some probes go to ClusterIPs.
        kube_proxy: if opts.engine == Engine::Nftables {
            KubeProxyMode::Iptables
        } else {
            KubeProxyMode::Nftables
        },
        agent_env,
        // Each node's first restart moves its agent to another map layout.
        pin_layout_change: true,
        startup_deadline: Duration::from_secs(60),
        ..Options::default()
    })?;
    let cfg = ProbeConfig {
        timeout: Duration::from_millis(500),
        threads: 4,
        sctp_log: runner.cluster().sctp_log(),
    };
    let mut oracle = Oracle::new(opts.bounds, npm_sim::cases::Model::options())
        .with_placement(Box::new(|ip| schedule::node_of_address(NODES, ip)));
    let world = World {
        injected: opts.inject,
        ..World::default()
    };
    let snap = schedule::oracle_snapshot(&runner.model().snapshot, &world);
    oracle.push_state(0.0, "start", snap);
    let mut soak = Soak {
        runner,
        oracle,
        world,
        rng: StdRng::seed_from_u64(opts.seed),
        probe_rng: StdRng::seed_from_u64(opts.seed ^ 0x9e37_79b9_7f4a_7c15),
        tick: 0,
        t0: Instant::now(),
        pending: Vec::new(),
        unsettled: vec![None; NODES as usize],
        settle_from: Vec::new(),
        settle: Vec::new(),
        restarts: 0,
        restarted: Default::default(),
        probes: Vec::new(),
        cfg,
        steps: 0,
        deferred: Default::default(),
        cni_timeouts: 0,
        forced_cni_timeout: false,
        cni_log: Vec::new(),
        cni_fail_open: Vec::new(),
        rss: vec![None; NODES as usize],
        rss_max_kib: 0,
        map_fill: None,
    };
    let dataplane = if opts.engine == Engine::Nftables {
        "nftables"
    } else {
        "ebpf"
    };
    let _ = writeln!(
        out,
        "chaos: {dataplane}, seed {}, {} s, {} nodes{}",
        opts.seed,
        opts.duration,
        NODES,
        if opts.inject { ", fault injection on" } else { "" }
    );
    for step in schedule::baseline() {
        soak.step(step, out)?;
    }
    let end = Duration::from_secs(opts.duration);
    while soak.t0.elapsed() < end {
        let tick_start = soak.t0.elapsed();
        soak.run_pending(out)?;
        if opts.inject {
            for step in schedule::injected_step(soak.tick).into_iter().rev() {
                soak.deferred.push_front(step);
            }
        }
        if let Some((tick, node)) = opts.kill_at {
            if tick == soak.tick && !soak.world.agent_down {
                soak.deferred.push_front(Step::KillAgent { node, down_secs: 3 });
            }
        }
        if let Some((tick, node)) = opts.cni_timeout_at {
            if tick <= soak.tick && !soak.forced_cni_timeout && soak.deferred.is_empty() {
                // At a freed address of the node; none free: a pod there is
                // deleted first.
                match schedule::cni_timeout_on(&mut soak.world, node, NODES) {
                    Some(step) => {
                        soak.forced_cni_timeout = true;
                        soak.deferred.push_back(step);
                    }
                    None => soak.deferred.extend(schedule::free_one_on(
                        &soak.runner.model().snapshot,
                        &soak.world,
                        node,
                        NODES,
                    )),
                }
            }
        }
        if soak.deferred.is_empty() && soak.rng.random_bool(0.5) {
            let step = schedule::next_step(&mut soak.rng, &soak.runner.model().snapshot, &mut soak.world, NODES);
            soak.deferred.push_back(step);
        }
        soak.apply_ready_steps(out)?;
        soak.poll_agents();
        soak.probe_round();
        soak.tick += 1;
        if soak.tick.is_multiple_of(60) {
            let _ = writeln!(
                out,
                "chaos: {:.0}s, {} steps, {} probes",
                soak.now(),
                soak.steps,
                soak.probes.len()
            );
        }
        let next = tick_start + Duration::from_secs(1);
        if let Some(wait) = next.checked_sub(soak.t0.elapsed()) {
            std::thread::sleep(wait);
        }
    }
    // Let pending restarts and fault ends happen, then judge.
    while !soak.pending.is_empty() || !soak.deferred.is_empty() {
        soak.tick += 1;
        soak.run_pending(out)?;
        soak.apply_ready_steps(out)?;
        soak.poll_agents();
        std::thread::sleep(Duration::from_millis(1000));
    }
    let mut report = soak.judge(opts, dataplane, out);
    if opts.engine == Engine::Ebpf {
        // A restart near the end: its first full sync retires the other
        // layout's pins; wait for it (bounded).
        let deadline = Instant::now() + Duration::from_secs(60);
        while Instant::now() < deadline
            && soak
                .restarted
                .iter()
                .any(|k| soak.runner.node_pin_dir(*k, false).exists())
        {
            std::thread::sleep(Duration::from_millis(500));
        }
        // A restarted node's agent pins under this layout's directory; the
        // first start's directory goes once its first full sync attached
        // this layout's programs everywhere.
        for k in soak.restarted.iter() {
            let (first, now) = (soak.runner.node_pin_dir(*k, false), soak.runner.node_pin_dir(*k, true));
            report.layout_changes.0 += 1;
            if now.join("links").is_dir() && !first.exists() {
                report.layout_changes.1 += 1;
            } else {
                let _ = writeln!(
                    out,
                    "chaos: node-{k}: the other map layout's pins {} remain beside {}",
                    first.display(),
                    now.display()
                );
            }
        }
    }
    let logs = soak.runner.agent_logs();
    let workdir = soak.runner.workdir().to_path_buf();
    soak.runner.shutdown()?;
    if report.violations == 0 && report.liveness_failures == 0 {
        let _ = std::fs::remove_dir_all(&workdir);
    } else {
        for l in logs {
            let _ = writeln!(out, "agent log: {}", l.display());
        }
    }
    Ok(report)
}

impl Soak {
    fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    fn step_err(&self, what: &str, message: String) -> ChaosError {
        ChaosError::Step {
            index: self.steps,
            what: what.to_string(),
            message,
        }
    }

    /// Records the state the API server holds now.
    /// A JSON merge patch of pod `ns/name`'s status (as a kubelet writes it).
    fn patch_pod_status(&self, pod: &str, status: &serde_json::Value) -> Result<(), String> {
        let (ns, name) = pod.split_once('/').ok_or_else(|| format!("pod {pod:?}: not ns/name"))?;
        let path = format!("{}/status", crate::api::pod_path(ns, name));
        self.runner
            .api()
            .merge_patch(&path, status)
            .map(|_| ())
            .map_err(|e| format!("status of {pod}: {e}"))
    }

    fn push_state(&mut self, what: &str) {
        let model = &self.runner.model().snapshot;
        let snap = schedule::oracle_snapshot(model, &self.world);
        let local_only = schedule::lost_pods(model, &self.world, NODES);
        let t = self.now();
        self.oracle.push_state_with(t, what, snap, local_only);
    }

    fn run_pending(&mut self, out: &mut dyn Write) -> Result<(), ChaosError> {
        let now = self.tick;
        let due: Vec<Pending> = {
            let (due, rest): (Vec<Pending>, Vec<Pending>) =
                std::mem::take(&mut self.pending).into_iter().partition(|p| match p {
                    Pending::ClearFaults(t, _)
                    | Pending::EndDisturbance(t, _)
                    | Pending::EndFault(t, _)
                    | Pending::Respawn(t, _) => *t <= now,
                });
            self.pending = rest;
            due
        };
        for p in due {
            match p {
                Pending::ClearFaults(_, h) => {
                    if let Some(s) = self.runner.api_server() {
                        s.clear_faults();
                    }
                    let t = self.now();
                    self.settle_from.push(t);
                    self.pending.push(Pending::EndFault(self.tick + FAULT_TAIL_TICKS, h));
                }
                Pending::EndDisturbance(_, h) => {
                    self.oracle.end(h, self.now());
                }
                Pending::EndFault(_, h) => {
                    self.oracle.end(h, self.now());
                    self.world.fault_running = self
                        .pending
                        .iter()
                        .any(|p| matches!(p, Pending::EndFault(..) | Pending::ClearFaults(..)));
                }
                Pending::Respawn(_, k) => {
                    self.restarts += 1;
                    self.restarted.insert(k);
                    let n = self.restarts;
                    self.rss[(k - 1) as usize] = None;
                    self.runner
                        .respawn_node_agent(k, n)
                        .map_err(|e| self.step_err("restart agent", e.to_string()))?;
                    let t = self.now();
                    self.settle_from.push(t);
                    self.world.agent_down = false;
                    let _ = writeln!(out, "chaos: {t:.1}s restarted the agent of node-{k}");
                }
            }
        }
        Ok(())
    }

    /// Applies the deferred steps from the front while they may run.
    fn apply_ready_steps(&mut self, out: &mut dyn Write) -> Result<(), ChaosError> {
        while let Some(front) = self.deferred.front() {
            let cni_pod = matches!(
                front,
                Step::Model(npm_sim::cases::Action::CreatePod(_)) | Step::Reuse { .. } | Step::CniTimeout(_)
            );
            if cni_pod && (self.world.fault_running || self.world.agent_down || !self.agents_ready()) {
                return Ok(());
            }
            let step = self.deferred.pop_front().expect("front");
            self.step(step, out)?;
        }
        Ok(())
    }

    /// Whether every agent answers `/readyz` 200.
    fn agents_ready(&self) -> bool {
        (1..=NODES).all(|k| {
            self.runner
                .node_metrics_addr(k)
                .and_then(monitor::poll)
                .is_some_and(|h| h.ready)
        })
    }

    fn step(&mut self, step: Step, out: &mut dyn Write) -> Result<(), ChaosError> {
        let what = step.describe();
        self.steps += 1;
        let t = self.now();
        let _ = writeln!(out, "chaos: {t:.1}s step {}: {what}", self.steps);
        let err = |s: &Self, e: &dyn std::fmt::Display| s.step_err(&what, e.to_string());
        match step {
            Step::Model(action) => {
                let freed = match &action {
                    npm_sim::cases::Action::DeletePod(p) => {
                        schedule::addresses_of(&self.runner.model().snapshot, &p.pod)
                    }
                    _ => None,
                };
                self.runner.apply(&action).map_err(|e| err(self, &e))?;
                if let npm_sim::cases::Action::DeletePod(p) = &action {
                    self.world.lost.remove(&p.pod);
                }
                self.world.freed.extend(freed);
                self.push_state(&what);
            }
            Step::Reuse {
                pod,
                labels,
                v4,
                v6,
                node,
            } => {
                let created = 1_000_000 + self.steps as i64;
                let rp = schedule::ReusePod {
                    labels,
                    v4,
                    v6,
                    node,
                    created,
                };
                self.runner
                    .create_unmodelled_pod_wired(&schedule::reuse_pod(&pod, &rp), v4, v6, Some(node))
                    .map_err(|e| err(self, &e))?;
                self.world.freed.retain(|(_, a, _)| *a != v4);
                self.world.reuse.insert(pod.clone(), rp);
                self.push_state(&what);
            }
            Step::LoseIp(pod) => {
                let status = serde_json::json!({"status": {"podIP": null, "podIPs": []}});
                self.patch_pod_status(&pod, &status).map_err(|e| err(self, &e))?;
                self.world.lost.insert(pod);
                self.push_state(&what);
            }
            Step::RestoreIp(pod) => {
                let (ns, name) = pod.split_once('/').unwrap_or(("", ""));
                let ips: Vec<String> = self
                    .runner
                    .model()
                    .snapshot
                    .pods
                    .get(&(ns.to_string(), name.to_string()))
                    .map(|p| p.ips.iter().map(|ip| ip.to_string()).collect())
                    .unwrap_or_default();
                let status = serde_json::json!({"status": {
                    "podIP": ips.first(),
                    "podIPs": ips.iter().map(|ip| serde_json::json!({"ip": ip})).collect::<Vec<_>>(),
                }});
                self.patch_pod_status(&pod, &status).map_err(|e| err(self, &e))?;
                self.world.lost.remove(&pod);
                self.push_state(&what);
            }
            Step::DeleteReuse(pod) => {
                let (ns, name) = pod.split_once('/').unwrap_or(("", ""));
                self.runner.delete_unmodelled_pod(ns, name).map_err(|e| err(self, &e))?;
                if let Some(p) = self.world.reuse.remove(&pod) {
                    self.world.freed.push((ns.to_string(), p.v4, p.v6));
                }
                self.push_state(&what);
            }
            Step::Invalid(np) => {
                let v = serde_json::to_value(&*np).map_err(|e| err(self, &e))?;
                let server = self.runner.api_server().ok_or_else(|| err(self, &"no API server"))?;
                server.set_validation(false);
                let r = self.runner.api().apply_policy(&v, false);
                server.set_validation(true);
                r.map_err(|e| err(self, &e))?;
                let key = (
                    np.metadata.namespace.clone().unwrap_or_default(),
                    np.metadata.name.clone().unwrap_or_default(),
                );
                self.world.invalid.insert(key, *np);
                self.push_state(&what);
            }
            Step::DeleteInvalid(ns, name) => {
                self.runner
                    .api()
                    .delete(&crate::api::policy_path(&ns, &name))
                    .map_err(|e| err(self, &e))?;
                self.world.invalid.remove(&(ns, name));
                self.push_state(&what);
            }
            Step::KillAgent { node, down_secs } => {
                self.runner.kill_node_agent(node).map_err(|e| err(self, &e))?;
                self.world.agent_down = true;
                self.pending.push(Pending::Respawn(self.tick + down_secs, node));
                // The node's unsettled disturbance (polls) covers the rest.
                let h = self.oracle.begin(&format!("node-{node} agent killed"), t);
                self.pending.push(Pending::EndDisturbance(self.tick + down_secs, h));
            }
            Step::Fault(f) => self.fault(f, &what)?,
            Step::CniTimeout(c) => self.cni_timeout(&what, c)?,
        }
        Ok(())
    }

    fn fault(&mut self, f: Fault, what: &str) -> Result<(), ChaosError> {
        use npm_testapi::FaultRule;
        let server = self
            .runner
            .api_server()
            .ok_or_else(|| self.step_err(what, "no API server".into()))?;
        let t = self.now();
        let h = self.oracle.begin(what, t);
        self.world.fault_running = true;
        match f {
            Fault::GoneMidList => {
                server.compact();
                server.inject(FaultRule::fail(1, 410).path("/api/v1/pods").verb("list"));
                server.drop_watches();
                self.pending.push(Pending::ClearFaults(self.tick + 1, h));
            }
            Fault::DroppedWatches => {
                server.drop_watches();
                self.pending.push(Pending::ClearFaults(self.tick, h));
            }
            Fault::Outage(secs) => {
                server.inject(FaultRule::fail(u32::MAX, 503).verb("list"));
                server.inject(FaultRule::fail(u32::MAX, 503).verb("watch"));
                server.drop_watches();
                self.pending.push(Pending::ClearFaults(self.tick + secs, h));
            }
            Fault::CnpNotFound(secs) => {
                server.inject(FaultRule::fail(u32::MAX, 404).path("/apis/policy.networking.k8s.io"));
                server.drop_watches();
                self.pending.push(Pending::ClearFaults(self.tick + secs, h));
            }
            Fault::Slow => {
                server.inject(FaultRule::delay(20, Duration::from_millis(1500)).verb("list"));
                server.inject(FaultRule::delay(20, Duration::from_millis(1500)).verb("watch"));
                self.pending.push(Pending::ClearFaults(self.tick + 15, h));
            }
        }
        Ok(())
    }

    /// [`Step::CniTimeout`]: the node's agent stopped, the CNI chain's ADD
    /// with a [`CNI_TIMEOUT_SECS`] npm-cni timeout, the agent continued.
    /// An ADD that succeeds is a finding (npm-cni opened a pod its agent
    /// never answered for): counted with the violations.
    fn cni_timeout(&mut self, what: &str, s: schedule::CniTimeoutPod) -> Result<(), ChaosError> {
        let t = self.now();
        let h = self.oracle.begin(&format!("node-{} agent stopped", s.node), t);
        self.runner
            .pause_node_agent(s.node, true)
            .map_err(|e| self.step_err(what, e.to_string()))?;
        self.runner.set_npm_cni_timeout(Some(CNI_TIMEOUT_SECS));
        let rp = schedule::ReusePod {
            labels: s.labels,
            v4: s.v4,
            v6: s.v6,
            node: s.node,
            created: 1_000_000 + self.steps as i64,
        };
        let added =
            self.runner
                .create_unmodelled_pod_wired(&schedule::reuse_pod(&s.pod, &rp), s.v4, s.v6, Some(s.node));
        self.runner.set_npm_cni_timeout(None);
        let resumed = self.runner.pause_node_agent(s.node, false);
        let t = self.now();
        self.settle_from.push(t);
        self.pending.push(Pending::EndDisturbance(self.tick + 3, h));
        resumed.map_err(|e| self.step_err(what, e.to_string()))?;
        let (ns, name) = s.pod.split_once('/').unwrap_or(("", ""));
        match added {
            Err(e) => {
                self.cni_timeouts += 1;
                let first = e.to_string().lines().next().unwrap_or_default().to_string();
                self.cni_log.push(format!("{t:.1}s {}: ADD failed: {first}", s.pod));
            }
            Ok(()) => {
                self.cni_fail_open.push(format!(
                    "chaos: VIOLATION: npm-cni's ADD of {} at {} succeeded while the agent of node-{} was stopped\n",
                    s.pod, s.v4, s.node
                ));
                self.runner
                    .delete_unmodelled_pod(ns, name)
                    .map_err(|e| self.step_err(what, e.to_string()))?;
            }
        }
        // The address's next owner, once the agents are ready again.
        self.deferred.push_front(Step::Reuse {
            pod: format!("{}n", s.pod),
            labels: s.next_labels,
            v4: s.v4,
            v6: s.v6,
            node: s.node,
        });
        Ok(())
    }

    /// Polls every agent; opens or closes its unsettled disturbance, and
    /// records settle times.
    fn poll_agents(&mut self) {
        let mut all = true;
        for k in 1..=NODES {
            let Some(addr) = self.runner.node_metrics_addr(k) else {
                continue;
            };
            let health = monitor::poll(addr);
            let settled = health.as_ref().is_some_and(|h| h.settled());
            let t = self.now();
            if let Some((name, fill)) = health.and_then(|h| h.map_fill) {
                if self.map_fill.as_ref().is_none_or(|m| fill > m.1) {
                    self.map_fill = Some((name, fill));
                }
            }
            if let Some(kib) = self.runner.node_agent_rss_kib(k) {
                self.rss_max_kib = self.rss_max_kib.max(kib);
                let a = self.rss[(k - 1) as usize].get_or_insert(AgentRss {
                    seen: t,
                    base: None,
                    last: (t, kib),
                });
                if a.base.is_none() && t - a.seen >= RSS_WARMUP_S {
                    a.base = Some((t, kib));
                }
                a.last = (t, kib);
            }
            let slot = &mut self.unsettled[(k - 1) as usize];
            match (settled, *slot) {
                (false, None) => *slot = Some(self.oracle.begin(&format!("node-{k} unsettled"), t)),
                (true, Some(h)) => {
                    self.oracle.end(h, t);
                    *slot = None;
                }
                _ => {}
            }
            all &= settled;
        }
        if all && !self.world.agent_down {
            let t = self.now();
            for from in std::mem::take(&mut self.settle_from) {
                self.settle.push(t - from);
            }
        }
    }

    /// The live pods: (`ns/name`, netns, IPv4).
    /// The probed pods: `ns/name`, netns, address, and its Service's
    /// ClusterIP while its address is published (every pod made through
    /// the runner has its own Service).
    fn live_pods(&self) -> Vec<LivePod> {
        let mut v = Vec::new();
        for p in self.runner.cluster().pods() {
            let key = format!("{}/{}", p.namespace, p.name);
            let model = self
                .runner
                .model()
                .snapshot
                .pods
                .contains_key(&(p.namespace.clone(), p.name.clone()));
            if model || self.world.reuse.contains_key(&key) {
                let service = if !self.world.lost.contains(&key) {
                    self.runner.service_ip(&p.namespace, &p.name, false)
                } else {
                    None
                };
                v.push(LivePod {
                    key,
                    netns: p.netns.clone(),
                    ip: IpAddr::V4(p.ipv4),
                    service,
                });
            }
        }
        v
    }

    /// One round: half on pairs the latest states judge differently, half
    /// at random; TCP or UDP, port 80 or 81; one in four through the
    /// destination's ClusterIP when it has one (judged as the flow to the
    /// pod behind it: its Service has that one backend).
    fn probe_round(&mut self) {
        let pods = self.live_pods();
        if pods.len() < 2 {
            return;
        }
        let n_states = self.oracle.states().len();
        let mut chosen: Vec<(usize, usize, ProbeProto, u16, Option<IpAddr>)> = Vec::new();
        let mut tries = 0;
        while chosen.len() < PROBES_PER_ROUND && tries < 200 {
            tries += 1;
            let a = self.probe_rng.random_range(0..pods.len());
            let b = self.probe_rng.random_range(0..pods.len());
            if a == b {
                continue;
            }
            let proto = if self.probe_rng.random_bool(0.5) {
                ProbeProto::Tcp
            } else {
                ProbeProto::Udp
            };
            let port = if self.probe_rng.random_bool(0.75) { 80 } else { 81 };
            let want_flipped = chosen.len() < PROBES_PER_ROUND / 2 && tries < 150;
            if want_flipped && n_states >= 2 {
                let rec = probe_record(0, &pods[a], &pods[b], proto, port);
                let lo = n_states.saturating_sub(4);
                let first = self.oracle.allows(lo, &rec);
                if (lo + 1..n_states).all(|i| self.oracle.allows(i, &rec) == first) {
                    continue;
                }
            }
            let via = if self.probe_rng.random_bool(0.25) {
                pods[b].service
            } else {
                None
            };
            chosen.push((a, b, proto, port, via));
        }
        let probes: Vec<Probe> = chosen
            .iter()
            .map(|&(a, b, proto, port, via)| Probe {
                src_netns: pods[a].netns.clone(),
                dst_pod: pods[b].key.clone(),
                dst: SocketAddr::new(via.unwrap_or(pods[b].ip), port),
                proto: match proto {
                    ProbeProto::Tcp => Proto::Tcp,
                    ProbeProto::Udp => Proto::Udp,
                },
            })
            .collect();
        let start = self.now();
        let mut results = probe_all(&probes, &self.cfg);
        // A failed probe is tried once more (a lost SYN or datagram is not
        // a verdict); its window covers both attempts.
        let failed: Vec<usize> = (0..probes.len()).filter(|&i| !results[i]).collect();
        if !failed.is_empty() {
            let again: Vec<Probe> = failed.iter().map(|&i| probes[i].clone()).collect();
            for (&i, ok) in failed.iter().zip(probe_all(&again, &self.cfg)) {
                results[i] = ok;
            }
        }
        let end = self.now();
        for (&(a, b, proto, port, via), ok) in chosen.iter().zip(results) {
            let id = self.probes.len() as u64 + 1;
            let rec = ProbeRecord {
                start,
                end,
                ok,
                via,
                ..probe_record(id, &pods[a], &pods[b], proto, port)
            };
            self.probes.push(rec);
        }
    }

    fn judge(&self, opts: &ChaosOptions, dataplane: &str, out: &mut dyn Write) -> Report {
        let mut r = Report {
            dataplane: dataplane.to_string(),
            seed: opts.seed,
            duration: opts.duration,
            steps: self.steps,
            states: self.oracle.states().len(),
            probes: self.probes.len(),
            connected: self.probes.iter().filter(|p| p.ok).count(),
            via_service: (
                self.probes.iter().filter(|p| p.via.is_some()).count(),
                self.probes.iter().filter(|p| p.via.is_some() && p.ok).count(),
            ),
            settle: self.settle.clone(),
            inject: opts.inject,
            cni_timeouts: self.cni_timeouts,
            agent_rss_max_mb: self.rss_max_kib as f64 / 1024.0,
            agent_rss_growth_mb_per_h: self
                .rss
                .iter()
                .flatten()
                .filter_map(|a| Some((a.base?, a.last)))
                .filter(|((t0, _), (t1, _))| t1 - t0 >= 60.0)
                .map(|((t0, k0), (t1, k1))| (k1 as f64 - k0 as f64) / 1024.0 / (t1 - t0) * 3600.0)
                .max_by(f64::total_cmp),
            map_fill: self.map_fill.clone(),
            ..Report::default()
        };
        for line in &self.cni_log {
            let _ = writeln!(out, "chaos: npm-cni timeout: {line}");
        }
        for text in &self.cni_fail_open {
            r.violations += 1;
            let _ = out.write_all(text.as_bytes());
            if r.findings.len() < 20 {
                r.findings.push(text.clone());
            }
        }
        let replay = format!(
            "replay: cargo xtask chaos --dataplane {dataplane} --seed {} --duration {}{}",
            opts.seed,
            opts.duration,
            if opts.inject { " --inject" } else { "" }
        );
        for p in &self.probes {
            let (kind, states) = match self.oracle.judge(p) {
                Verdict::Fine => continue,
                Verdict::Violation(s) => {
                    r.violations += 1;
                    ("VIOLATION", s)
                }
                Verdict::LivenessFailure(s) => {
                    r.liveness_failures += 1;
                    ("LIVENESS FAILURE", s)
                }
            };
            let text = format!(
                "chaos: {kind} (seed {}): {}  {replay}\n",
                opts.seed,
                self.oracle.explain(p, &states)
            );
            let _ = out.write_all(text.as_bytes());
            if r.findings.len() < 20 {
                r.findings.push(text);
            }
        }
        r
    }
}

/// A pod probes can reach.
struct LivePod {
    /// `ns/name`.
    key: String,
    /// Its netns.
    netns: String,
    /// Its IPv4 address.
    ip: IpAddr,
    /// Its Service's IPv4 ClusterIP, while its address is published.
    service: Option<IpAddr>,
}

/// The record of probe `id` from pod `src` to `dst` directly, not yet
/// run: no time, not connected.
fn probe_record(id: u64, src: &LivePod, dst: &LivePod, proto: ProbeProto, port: u16) -> ProbeRecord {
    ProbeRecord {
        id,
        src: src.key.clone(),
        dst: dst.key.clone(),
        src_ip: src.ip,
        dst_ip: dst.ip,
        via: None,
        proto,
        port,
        start: 0.0,
        end: 0.0,
        ok: false,
    }
}
