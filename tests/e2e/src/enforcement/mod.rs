//! The enforcement bench (`cargo xtask bench enforcement`,
//! `npm-bench-enforcement`): enforcement latency as packets see it.
//!
//! The cluster: one node netns with the real agent, the upstream pods
//! (`x`, `y`, `z` × `a`, `b`, `c`) wired by the reference `ptp` plugin
//! chained with npm-cni, and the API server preloaded before the agent
//! starts with `pods` pods and `policies` NetworkPolicies shaped as
//! `cargo xtask bench agent` shapes them (remote pods, none selecting a
//! probed pod: [`crate::runner::Preload`]).
//!
//! A baseline isolates ingress in `x`, `y` and `z`. Then:
//!
//! - **Policy latency.** `pairs` probed pairs (a source pod, a destination
//!   pod in `x` or `y`, TCP 80), each governed by a policy of its own,
//!   `pair-<i>`, cycled through create (port 80: allowed), update to port
//!   81 (denied), update back to 80 (allowed) and delete (denied): every
//!   write flips its pair's verdict. A sample is the time from the write's
//!   response to the send time of the first probe of the pair that saw
//!   the new verdict (confirmed by the next probe; a probe sent before
//!   the response that already saw it counts as 0). Writes go every
//!   `op_gap`, round robin over the pairs; a pair's next write waits
//!   until its last one was observed (or its deadline passed: a miss).
//! - **Pod latency.** A new pod `x/new-<k>` labelled `role: bench-new`,
//!   made as a kubelet makes it (the Pod object without an IP, CNI ADD
//!   through the chain, then the status write with its IPs). Its policies
//!   admit `y/a` on TCP 80 (and not `z/a`) and let it reach `z/b` on TCP
//!   80 (egress, and `z/b`'s ingress admits it; not `z/c`). Its four pairs
//!   are probed from the moment ADD returned; the sample is from the
//!   status write's response until all four show their verdict (0 when
//!   they did before), and a probe of a denied pair that connects at any
//!   time is counted (`pod_wrong_allows`: npm-cni holds ADD until the pod
//!   is enforced, so none may).
//! - **CNI hold.** How long npm-cni's ADD took, as the runtime waited for
//!   it (its process, start to exit), for each new pod; beside it the
//!   agent's own part (its `npm_cni_add_wait_seconds` over the ADD).
//!
//! Both are taken twice: on the idle node, then while a churn thread
//! writes `churn_rate` changes a second to the API server (alternately a
//! remote pod and a NetworkPolicy in the preloaded namespaces).
//!
//! The probes ([`prober`]): one thread, a non-blocking TCP connect per
//! pair every `interval`, a deny being a connect not completed within
//! `probe_timeout`; the interval bounds the resolution of every figure.
//! Ends with one JSON line (`"bench":"enforcement"`).

pub mod prober;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::api::{policy_path, Api};
use crate::chaos::monitor::percentile;
use crate::cluster::{pod_ipv4, pod_ipv6};
use crate::runner::{preload_pod, preload_policy, CniMode, Engine, LiveRunner, Options, Preload, RunnerError};
use prober::{first_confirmed, Prober, Sample};

/// The probed port (allowed by the pair policies) and the other one.
const PORT: u16 = 80;
const OTHER_PORT: u16 = 81;
/// The label of the bench's new pods.
const NEW_ROLE: &str = "bench-new";
/// The most pairs there are (two destination namespaces × three pods ×
/// two source namespaces × three pods).
pub const MAX_PAIRS: usize = 36;

/// Errors of the bench.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// The cluster, the API or the agent failed.
    #[error("{0}")]
    Runner(#[from] RunnerError),
    /// A step failed.
    #[error("{0}")]
    Step(String),
}

/// Options of a run.
#[derive(Clone, Debug)]
pub struct EnforcementOptions {
    /// `Engine::Ebpf` or `Engine::Nftables`.
    pub engine: Engine,
    /// The agent binary.
    pub agent_bin: PathBuf,
    /// The npm-cni binary.
    pub npm_cni_bin: PathBuf,
    /// Preloaded pods.
    pub pods: usize,
    /// Preloaded NetworkPolicies.
    pub policies: usize,
    /// Probed pairs of the policy changes (1..=[`MAX_PAIRS`]).
    pub pairs: usize,
    /// Probe interval (each pair).
    pub interval: Duration,
    /// A connect not completed within this is a deny.
    pub probe_timeout: Duration,
    /// Policy writes per phase (idle, churn).
    pub changes: usize,
    /// New pods per phase.
    pub new_pods: usize,
    /// Writes a second of the churn phase.
    pub churn_rate: u32,
    /// Pause between policy writes.
    pub op_gap: Duration,
    /// A change not observed within this is a miss.
    pub deadline: Duration,
    /// How long the agent may take to its first ready state.
    pub startup_deadline: Duration,
}

impl Default for EnforcementOptions {
    fn default() -> Self {
        EnforcementOptions {
            engine: Engine::Ebpf,
            agent_bin: PathBuf::from("target/release/npm-agent"),
            npm_cni_bin: PathBuf::from("target/release/npm-cni"),
            pods: 100_000,
            policies: 10_000,
            pairs: 8,
            interval: Duration::from_millis(10),
            probe_timeout: Duration::from_millis(250),
            changes: 200,
            new_pods: 20,
            churn_rate: 100,
            op_gap: Duration::from_millis(100),
            deadline: Duration::from_secs(10),
            startup_deadline: Duration::from_secs(600),
        }
    }
}

/// One policy write and what the probes made of it.
#[derive(Clone, Debug)]
pub struct Change {
    /// Pair index.
    pub pair: usize,
    /// `create`, `update` or `delete`.
    pub kind: &'static str,
    /// The verdict it brings.
    pub want: bool,
    /// Churn phase.
    pub churn: bool,
    /// Write sent.
    pub sent: Instant,
    /// Write answered.
    pub done: Instant,
    /// Latency (ms), `None`: not observed within the deadline.
    pub latency_ms: Option<f64>,
    /// Send time of the probe that observed it.
    pub observed_at: Option<Instant>,
}

/// One new pod.
#[derive(Clone, Debug)]
pub struct NewPod {
    /// Churn phase.
    pub churn: bool,
    /// npm-cni's ADD (ms).
    pub cni_hold_ms: f64,
    /// The whole chain's ADD (ms).
    pub chain_add_ms: f64,
    /// The agent's side of the hold (ms): the growth of its
    /// `npm_cni_add_wait_seconds` sum over the pod's ADD (`None`: not read).
    pub agent_wait_ms: Option<f64>,
    /// Status write to all four verdicts (ms); `None`: not within the
    /// deadline.
    pub latency_ms: Option<f64>,
    /// Probes of its two denied pairs, from the first (sent once ADD
    /// returned) to the last, that connected: what fail-closed pod start
    /// must keep at 0.
    pub wrong_allows: usize,
}

/// The figures of a run.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// Dataplane name.
    pub dataplane: String,
    /// Options (pods, policies, pairs, interval, timeout, churn rate).
    pub pods: usize,
    /// Preloaded policies.
    pub policies: usize,
    /// Probed pairs.
    pub pairs: usize,
    /// Probe interval (ms).
    pub interval_ms: f64,
    /// Probe timeout (ms).
    pub probe_timeout_ms: f64,
    /// The churn's target rate.
    pub churn_rate: u32,
    /// The churn's achieved rate (writes a second).
    pub churn_achieved: f64,
    /// Churn writes that failed.
    pub churn_errors: usize,
    /// The policy changes.
    pub changes: Vec<Change>,
    /// The new pods.
    pub new_pods: Vec<NewPod>,
    /// Probes sent.
    pub probes: usize,
    /// Prober rounds per second achieved.
    pub rounds_per_s: f64,
    /// Probes contradicting the verdict after a change was observed and
    /// before the pair's next change.
    pub flaps: usize,
    /// Seconds from start to the agent ready on the preloaded cluster.
    pub setup_s: f64,
    /// The agent's RSS at the end (MB), if read.
    pub agent_rss_mb: Option<f64>,
}

fn round1(v: f64) -> f64 {
    (v * 10.0).round() / 10.0
}

fn pct(v: &[f64], p: f64) -> Value {
    if v.is_empty() {
        Value::Null
    } else {
        json!(round1(percentile(v, p)))
    }
}

impl Report {
    fn policy_ms(&self, churn: Option<bool>) -> Vec<f64> {
        self.changes
            .iter()
            .filter(|c| churn.is_none_or(|b| c.churn == b))
            .filter_map(|c| c.latency_ms)
            .collect()
    }

    fn pod_ms(&self, churn: Option<bool>) -> Vec<f64> {
        self.new_pods
            .iter()
            .filter(|c| churn.is_none_or(|b| c.churn == b))
            .filter_map(|c| c.latency_ms)
            .collect()
    }

    fn cni_ms(&self, churn: Option<bool>) -> Vec<f64> {
        self.new_pods
            .iter()
            .filter(|c| churn.is_none_or(|b| c.churn == b))
            .map(|c| c.cni_hold_ms)
            .collect()
    }

    /// Changes not observed within the deadline, and new pods not seen
    /// enforced within it.
    pub fn missed(&self) -> usize {
        self.changes.iter().filter(|c| c.latency_ms.is_none()).count()
            + self.new_pods.iter().filter(|p| p.latency_ms.is_none()).count()
    }

    /// The result line (`"bench"` first).
    pub fn json_line(&self) -> String {
        let (pa, pi, pc) = (
            self.policy_ms(None),
            self.policy_ms(Some(false)),
            self.policy_ms(Some(true)),
        );
        let (da, di, dc) = (self.pod_ms(None), self.pod_ms(Some(false)), self.pod_ms(Some(true)));
        let (ca, ci, cc) = (self.cni_ms(None), self.cni_ms(Some(false)), self.cni_ms(Some(true)));
        let kinds = |k: &str| self.changes.iter().filter(|c| c.kind == k).count();
        let aw: Vec<f64> = self.new_pods.iter().filter_map(|p| p.agent_wait_ms).collect();
        let rest = json!({
            "dataplane": self.dataplane,
            "pods": self.pods,
            "policies": self.policies,
            "policy_p50_ms": pct(&pa, 50.0),
            "policy_p90_ms": pct(&pa, 90.0),
            "policy_p99_ms": pct(&pa, 99.0),
            "policy_max_ms": pct(&pa, 100.0),
            "policy_idle_p99_ms": pct(&pi, 99.0),
            "policy_churn_p99_ms": pct(&pc, 99.0),
            "pod_p50_ms": pct(&da, 50.0),
            "pod_p99_ms": pct(&da, 99.0),
            "pod_idle_p99_ms": pct(&di, 99.0),
            "pod_churn_p99_ms": pct(&dc, 99.0),
            "pod_wrong_allows": self.new_pods.iter().map(|p| p.wrong_allows).sum::<usize>(),
            "cni_hold_p50_ms": pct(&ca, 50.0),
            "cni_hold_p99_ms": pct(&ca, 99.0),
            "cni_hold_idle_p50_ms": pct(&ci, 50.0),
            "cni_hold_idle_p99_ms": pct(&ci, 99.0),
            "cni_hold_churn_p50_ms": pct(&cc, 50.0),
            "cni_hold_churn_p99_ms": pct(&cc, 99.0),
            "cni_agent_wait_p50_ms": pct(&aw, 50.0),
            "cni_agent_wait_p99_ms": pct(&aw, 99.0),
            "changes": self.changes.len(),
            "creates": kinds("create"),
            "updates": kinds("update"),
            "deletes": kinds("delete"),
            "new_pods": self.new_pods.len(),
            "missed": self.missed(),
            "flaps": self.flaps,
            "pairs": self.pairs,
            "probe_interval_ms": self.interval_ms,
            "probe_timeout_ms": self.probe_timeout_ms,
            "probes": self.probes,
            "prober_rounds_per_s": round1(self.rounds_per_s),
            "churn_per_s": self.churn_rate,
            "churn_achieved_per_s": round1(self.churn_achieved),
            "churn_errors": self.churn_errors,
            "setup_s": round1(self.setup_s),
            "agent_rss_mb": self.agent_rss_mb.map(|v| v.round()),
        });
        let mut line = String::from(r#"{"bench":"enforcement""#);
        for (k, v) in rest.as_object().into_iter().flatten() {
            line.push_str(&format!(",{}:{v}", Value::String(k.clone())));
        }
        line.push('}');
        line
    }
}

/// A probed pair of the policy phase: source `(ns, pod)`, destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairSpec {
    /// Source namespace.
    pub src_ns: &'static str,
    /// Source pod.
    pub src: &'static str,
    /// Destination namespace (`x` or `y`).
    pub dst_ns: &'static str,
    /// Destination pod.
    pub dst: &'static str,
}

/// The first `n` pairs, spread over the destination pods first.
pub fn pair_specs(n: usize) -> Vec<PairSpec> {
    let pods = ["a", "b", "c"];
    let mut v = Vec::new();
    for src in pods {
        for side in 0..2 {
            for dst in pods {
                for dst_ns in ["x", "y"] {
                    let src_ns = match (dst_ns, side) {
                        ("x", 0) => "y",
                        ("x", _) => "z",
                        (_, 0) => "z",
                        _ => "x",
                    };
                    v.push(PairSpec {
                        src_ns,
                        src,
                        dst_ns,
                        dst,
                    });
                }
            }
        }
    }
    v.truncate(n);
    v
}

/// Pair `i`'s policy admitting its source on `port`.
pub fn pair_policy(i: usize, p: &PairSpec, port: u16) -> Value {
    json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": p.dst_ns, "name": format!("pair-{i}")},
        "spec": {
            "podSelector": {"matchLabels": {"pod": p.dst}},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{"namespaceSelector": {"matchLabels": {"ns": p.src_ns}}, "podSelector": {"matchLabels": {"pod": p.src}}}],
                "ports": [{"protocol": "TCP", "port": port}],
            }],
        },
    })
}

/// The baseline: ingress isolated in x, y, z; the new pods' policies.
pub fn baseline_policies() -> Vec<Value> {
    let mut v = Vec::new();
    for ns in ["x", "y", "z"] {
        v.push(json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"namespace": ns, "name": "bench-deny-ingress"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        }));
    }
    let peer = |ns: &str, sel: Value| json!({"namespaceSelector": {"matchLabels": {"ns": ns}}, "podSelector": {"matchLabels": sel}});
    let port = json!([{"protocol": "TCP", "port": PORT}]);
    v.push(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "x", "name": "bench-new-in"},
        "spec": {"podSelector": {"matchLabels": {"role": NEW_ROLE}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [peer("y", json!({"pod": "a"}))], "ports": port}]},
    }));
    v.push(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "x", "name": "bench-new-out"},
        "spec": {"podSelector": {"matchLabels": {"role": NEW_ROLE}}, "policyTypes": ["Egress"],
                 "egress": [{"to": [peer("z", json!({"pod": "b"}))], "ports": port}]},
    }));
    v.push(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"namespace": "z", "name": "bench-from-new"},
        "spec": {"podSelector": {"matchLabels": {"pod": "b"}}, "policyTypes": ["Ingress"],
                 "ingress": [{"from": [peer("x", json!({"role": NEW_ROLE}))], "ports": port}]},
    }));
    v
}

/// The background writer of the churn phase.
struct Churn {
    stop: Arc<AtomicBool>,
    writes: Arc<AtomicUsize>,
    errors: Arc<AtomicUsize>,
    thread: Option<std::thread::JoinHandle<()>>,
    started: Instant,
}

impl Churn {
    fn start(api: Api, rate: u32, first_pod: usize) -> Churn {
        let stop = Arc::new(AtomicBool::new(false));
        let writes = Arc::new(AtomicUsize::new(0));
        let errors = Arc::new(AtomicUsize::new(0));
        let (s, w, e) = (stop.clone(), writes.clone(), errors.clone());
        let started = Instant::now();
        let thread = std::thread::Builder::new()
            .name("enforcement-churn".into())
            .spawn(move || {
                let gap = Duration::from_secs_f64(1.0 / f64::from(rate.max(1)));
                let mut k = 0usize;
                while !s.load(Ordering::Relaxed) {
                    let due = started + gap * k as u32;
                    if let Some(wait) = due.checked_duration_since(Instant::now()) {
                        std::thread::sleep(wait);
                    }
                    let r = if k.is_multiple_of(2) {
                        let (ns, obj) = preload_pod(first_pod + k / 2);
                        api.create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
                    } else {
                        let (ns, obj) = preload_policy(k / 2, &format!("churn-{k}"));
                        api.create(
                            &format!("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"),
                            &obj,
                        )
                    };
                    match r {
                        Ok(_) => w.fetch_add(1, Ordering::Relaxed),
                        Err(_) => e.fetch_add(1, Ordering::Relaxed),
                    };
                    k += 1;
                }
            })
            .ok();
        Churn {
            stop,
            writes,
            errors,
            thread,
            started,
        }
    }

    /// Stops it: (writes, errors, achieved rate).
    fn stop(mut self) -> (usize, usize, f64) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let w = self.writes.load(Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64().max(1e-3);
        (w, self.errors.load(Ordering::Relaxed), w as f64 / secs)
    }
}

struct Bench<'a> {
    opts: &'a EnforcementOptions,
    runner: LiveRunner,
    prober: Prober,
    specs: Vec<PairSpec>,
    /// Prober ids of the pairs.
    ids: Vec<usize>,
    /// Next stage of each pair's cycle.
    stage: Vec<usize>,
    report: Report,
    new_pod_seq: usize,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// Runs the bench, printing progress to `out`; returns the figures (the
/// caller prints [`Report::json_line`]).
pub fn run(opts: &EnforcementOptions, out: &mut dyn Write) -> Result<Report, BenchError> {
    if opts.pairs == 0 || opts.pairs > MAX_PAIRS {
        return Err(BenchError::Step(format!(
            "--pairs {}: between 1 and {MAX_PAIRS}",
            opts.pairs
        )));
    }
    if opts.engine == Engine::Simulate {
        return Err(BenchError::Step("the bench needs a dataplane: ebpf or nftables".into()));
    }
    let t0 = Instant::now();
    let _ = writeln!(
        out,
        "enforcement: starting one node with {} pods and {} policies preloaded",
        opts.pods, opts.policies
    );
    let runner = LiveRunner::start(Options {
        engine: opts.engine,
        agent_bin: opts.agent_bin.clone(),
        npm_cni_bin: opts.npm_cni_bin.clone(),
        nodes: 1,
        cni: CniMode::Ptp,
        startup_deadline: opts.startup_deadline,
        preload: Preload {
            pods: opts.pods,
            policies: opts.policies,
        },
        ..Options::default()
    })?;
    let setup_s = t0.elapsed().as_secs_f64();
    let _ = writeln!(out, "enforcement: cluster ready after {setup_s:.1} s");
    let prober = Prober::start(opts.interval, opts.probe_timeout)
        .map_err(|e| BenchError::Step(format!("prober thread: {e}")))?;
    let dataplane = if opts.engine == Engine::Nftables {
        "nftables"
    } else {
        "ebpf"
    };
    let mut b = Bench {
        opts,
        runner,
        prober,
        specs: pair_specs(opts.pairs),
        ids: Vec::new(),
        stage: vec![0; opts.pairs],
        report: Report {
            dataplane: dataplane.to_string(),
            pods: opts.pods,
            policies: opts.policies,
            pairs: opts.pairs,
            interval_ms: ms(opts.interval),
            probe_timeout_ms: ms(opts.probe_timeout),
            churn_rate: opts.churn_rate,
            setup_s,
            ..Report::default()
        },
        new_pod_seq: 0,
    };
    let result = b.measure(out);
    b.prober.stop();
    b.report.probes = b.prober.sample_count();
    b.report.agent_rss_mb = b.agent_rss_mb();
    let workdir = b.runner.workdir().to_path_buf();
    let logs = b.runner.agent_logs();
    b.runner.shutdown()?;
    match result {
        Ok(()) if b.report.missed() == 0 => {
            let _ = std::fs::remove_dir_all(&workdir);
        }
        _ => {
            for l in logs {
                let _ = writeln!(out, "agent log: {}", l.display());
            }
        }
    }
    result.map(|()| b.report)
}

impl Bench<'_> {
    fn netns_of(&self, ns: &str, pod: &str) -> Result<String, BenchError> {
        self.runner
            .cluster()
            .pod(ns, pod)
            .map(|p| p.netns.clone())
            .ok_or_else(|| BenchError::Step(format!("no pod {ns}/{pod}")))
    }

    fn addr_of(&self, ns: &str, pod: &str) -> Result<SocketAddr, BenchError> {
        self.runner
            .cluster()
            .pod(ns, pod)
            .map(|p| SocketAddr::new(IpAddr::V4(p.ipv4), PORT))
            .ok_or_else(|| BenchError::Step(format!("no pod {ns}/{pod}")))
    }

    fn step<T, E: std::fmt::Display>(what: &str, r: Result<T, E>) -> Result<T, BenchError> {
        r.map_err(|e| BenchError::Step(format!("{what}: {e}")))
    }

    fn measure(&mut self, out: &mut dyn Write) -> Result<(), BenchError> {
        for p in baseline_policies() {
            Self::step("baseline policy", self.runner.api().apply_policy(&p, false))?;
        }
        for i in 0..self.specs.len() {
            let s = self.specs[i].clone();
            let id = self
                .prober
                .add(&self.netns_of(s.src_ns, s.src)?, self.addr_of(s.dst_ns, s.dst)?);
            self.ids.push(id);
        }
        // The baseline is in force once every pair is denied.
        let from = Instant::now();
        for i in 0..self.ids.len() {
            if self.wait_verdict(self.ids[i], from, false).is_none() {
                return Err(BenchError::Step(format!(
                    "pair {i} ({:?}) not denied by the baseline within {:?}",
                    self.specs[i], self.opts.deadline
                )));
            }
        }
        let _ = writeln!(out, "enforcement: baseline in force; idle phase");
        let rounds0 = (self.prober.rounds(), Instant::now());
        self.policy_phase(false, out)?;
        self.pod_phase(false, out)?;
        let _ = writeln!(out, "enforcement: churn phase ({} writes/s)", self.opts.churn_rate);
        let server = self.runner.api_server().map(|s| s.addr());
        let churn = server.map(|a| Churn::start(Api::new(a), self.opts.churn_rate, self.opts.pods + 1_000_000));
        let r = self.policy_phase(true, out).and_then(|()| self.pod_phase(true, out));
        if let Some(c) = churn {
            let (_, errors, rate) = c.stop();
            self.report.churn_errors = errors;
            self.report.churn_achieved = rate;
        }
        r?;
        let secs = rounds0.1.elapsed().as_secs_f64().max(1e-3);
        self.report.rounds_per_s = (self.prober.rounds() - rounds0.0) as f64 / secs;
        self.report.flaps = self.count_flaps();
        Ok(())
    }

    /// Waits until pair `id` shows `want` (confirmed) in samples sent from
    /// `from`; the observing sample.
    fn wait_verdict(&self, id: usize, from: Instant, want: bool) -> Option<Sample> {
        let end = Instant::now() + self.opts.deadline + self.opts.probe_timeout;
        loop {
            if let Some(s) = first_confirmed(&self.prober.samples_since(id, from), want) {
                return Some(s);
            }
            if Instant::now() >= end {
                return None;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    /// Resolves change `c` (waits for its observation or its deadline).
    fn resolve(&mut self, c: usize) {
        let ch = self.report.changes[c].clone();
        if ch.observed_at.is_some() || ch.latency_ms.is_some() {
            return;
        }
        let id = self.ids[ch.pair];
        let end = ch.done + self.opts.deadline;
        loop {
            if let Some(s) = first_confirmed(&self.prober.samples_since(id, ch.sent), ch.want) {
                let c = &mut self.report.changes[c];
                c.latency_ms = Some(ms(s.sent.saturating_duration_since(ch.done)));
                c.observed_at = Some(s.sent);
                return;
            }
            if Instant::now() >= end + self.opts.probe_timeout {
                return;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    fn policy_phase(&mut self, churn: bool, out: &mut dyn Write) -> Result<(), BenchError> {
        let n = self.specs.len();
        let mut last: Vec<Option<usize>> = vec![None; n];
        for k in 0..self.opts.changes {
            let i = k % n;
            if let Some(c) = last[i] {
                self.resolve(c);
            }
            let stage = self.stage[i] % 4;
            self.stage[i] += 1;
            let spec = self.specs[i].clone();
            let api = self.runner.api();
            let sent = Instant::now();
            let (kind, want, r) = match stage {
                0 => ("create", true, api.apply_policy(&pair_policy(i, &spec, PORT), false)),
                1 => (
                    "update",
                    false,
                    api.apply_policy(&pair_policy(i, &spec, OTHER_PORT), true),
                ),
                2 => ("update", true, api.apply_policy(&pair_policy(i, &spec, PORT), true)),
                _ => (
                    "delete",
                    false,
                    api.delete(&policy_path(spec.dst_ns, &format!("pair-{i}"))),
                ),
            };
            let done = Instant::now();
            Self::step(&format!("{kind} pair-{i}"), r)?;
            self.report.changes.push(Change {
                pair: i,
                kind,
                want,
                churn,
                sent,
                done,
                latency_ms: None,
                observed_at: None,
            });
            last[i] = Some(self.report.changes.len() - 1);
            std::thread::sleep(self.opts.op_gap);
        }
        for c in last.into_iter().flatten() {
            self.resolve(c);
        }
        let phase: Vec<&Change> = self.report.changes.iter().filter(|c| c.churn == churn).collect();
        let lat: Vec<f64> = phase.iter().filter_map(|c| c.latency_ms).collect();
        let _ = writeln!(
            out,
            "enforcement: {} policy changes ({}), {} observed, p50 {:.1} ms, p99 {:.1} ms",
            phase.len(),
            if churn { "churn" } else { "idle" },
            lat.len(),
            percentile(&lat, 50.0),
            percentile(&lat, 99.0)
        );
        Ok(())
    }

    fn pod_phase(&mut self, churn: bool, out: &mut dyn Write) -> Result<(), BenchError> {
        for _ in 0..self.opts.new_pods {
            let k = self.new_pod_seq;
            self.new_pod_seq += 1;
            let name = format!("new-{k}");
            let idx = 100 + (k % 150) as u8;
            let (v4, v6) = (pod_ipv4(1, idx), pod_ipv6(1, idx));
            let labels: BTreeMap<String, String> = [
                ("pod".to_string(), name.clone()),
                ("role".to_string(), NEW_ROLE.to_string()),
            ]
            .into();
            let prober = &self.prober;
            let mut ids: Vec<(usize, bool)> = Vec::new();
            let added = std::cell::Cell::new(None);
            let wait_before = self.agent_cni_wait_s();
            let ya = self.netns_of("y", "a")?;
            let za = self.netns_of("z", "a")?;
            let (zb, zc) = (self.addr_of("z", "b")?, self.addr_of("z", "c")?);
            let times = Self::step(
                &format!("pod x/{name}"),
                self.runner
                    .create_pod_wired_timed("x", &name, &labels, v4, v6, &mut |pod| {
                        let me = SocketAddr::new(IpAddr::V4(pod.ipv4), PORT);
                        ids.push((prober.add(&ya, me), true));
                        ids.push((prober.add(&za, me), false));
                        ids.push((prober.add(&pod.netns, zb), true));
                        ids.push((prober.add(&pod.netns, zc), false));
                        added.set(Some(Instant::now()));
                    }),
            )?;
            let agent_wait_ms = match (wait_before, self.agent_cni_wait_s()) {
                (Some(a), Some(b)) => Some((b - a) * 1e3),
                _ => None,
            };
            let from = added.get().unwrap_or(times.status_sent);
            let mut worst: Option<Instant> = Some(from);
            for &(id, want) in &ids {
                let seen = self.wait_verdict(id, from, want).map(|s| s.sent);
                worst = match (worst, seen) {
                    (Some(a), Some(b)) => Some(a.max(b)),
                    _ => None,
                };
            }
            let mut wrong_allows = 0;
            for &(id, want) in &ids {
                self.prober.remove(id);
                if !want {
                    wrong_allows += self.prober.samples_since(id, from).iter().filter(|s| s.ok).count();
                }
            }
            self.report.new_pods.push(NewPod {
                churn,
                cni_hold_ms: ms(times.npm_cni_add),
                chain_add_ms: ms(times.chain_add),
                agent_wait_ms,
                latency_ms: worst.map(|w| ms(w.saturating_duration_since(times.status_done))),
                wrong_allows,
            });
            Self::step(
                &format!("delete x/{name}"),
                self.runner.delete_unmodelled_pod("x", &name),
            )?;
        }
        let phase: Vec<&NewPod> = self.report.new_pods.iter().filter(|p| p.churn == churn).collect();
        let cni: Vec<f64> = phase.iter().map(|p| p.cni_hold_ms).collect();
        let lat: Vec<f64> = phase.iter().filter_map(|p| p.latency_ms).collect();
        let _ = writeln!(
            out,
            "enforcement: {} new pods ({}), {} enforced, pod p99 {:.1} ms, npm-cni ADD p50 {:.1} ms p99 {:.1} ms",
            phase.len(),
            if churn { "churn" } else { "idle" },
            lat.len(),
            percentile(&lat, 99.0),
            percentile(&cni, 50.0),
            percentile(&cni, 99.0)
        );
        Ok(())
    }

    /// Probes that contradicted an observed change before the pair's next
    /// change was written.
    fn count_flaps(&self) -> usize {
        let mut flaps = 0;
        for (idx, c) in self.report.changes.iter().enumerate() {
            let Some(seen) = c.observed_at else { continue };
            let next = self.report.changes[idx + 1..]
                .iter()
                .find(|d| d.pair == c.pair)
                .map(|d| d.sent);
            flaps += self
                .prober
                .samples_since(self.ids[c.pair], seen)
                .iter()
                .filter(|s| next.is_none_or(|n| s.sent < n) && s.ok != c.want)
                .count();
        }
        flaps
    }

    /// The agent's `npm_cni_add_wait_seconds_sum` (s).
    fn agent_cni_wait_s(&self) -> Option<f64> {
        let addr = self.runner.node_metrics_addr(1)?;
        let (_, body) = Api::new(addr).request_raw("GET", "/metrics", "text/plain", None).ok()?;
        crate::chaos::monitor::metric_value(body.as_str()?, "npm_cni_add_wait_seconds_sum")
    }

    fn agent_rss_mb(&self) -> Option<f64> {
        let node = self.runner.cluster().nodes()?.node(1)?;
        let pid = std::fs::read_to_string(node.dir.join("agent.pid")).ok()?;
        let status = std::fs::read_to_string(format!("/proc/{}/status", pid.trim())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
            .map(|kb| kb / 1024.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pairs_are_distinct_and_cross_namespace() {
        let v = pair_specs(MAX_PAIRS);
        assert_eq!(v.len(), MAX_PAIRS);
        for (i, a) in v.iter().enumerate() {
            assert_ne!(a.src_ns, a.dst_ns);
            assert!(v[i + 1..].iter().all(|b| b != a));
        }
        // The first six reach all six destinations.
        let dsts: std::collections::BTreeSet<_> = v[..6].iter().map(|p| (p.dst_ns, p.dst)).collect();
        assert_eq!(dsts.len(), 6);
    }

    #[test]
    fn the_line_has_every_field_and_bench_first() {
        let r = Report {
            dataplane: "ebpf".into(),
            ..Report::default()
        };
        let line = r.json_line();
        assert!(line.starts_with(r#"{"bench":"enforcement""#));
        let v: Value = serde_json::from_str(&line).unwrap();
        for f in [
            "dataplane",
            "pods",
            "policies",
            "policy_p50_ms",
            "policy_p90_ms",
            "policy_p99_ms",
            "pod_p99_ms",
            "cni_hold_p50_ms",
            "cni_hold_p99_ms",
            "pairs",
            "probe_interval_ms",
        ] {
            assert!(v.get(f).is_some(), "{f} missing in {line}");
        }
    }
}
