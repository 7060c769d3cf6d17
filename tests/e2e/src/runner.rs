//! The conformance runner: loads case files, runs them on the simulator or
//! on the netns cluster enforced by the real agent, prints each case's
//! result and a final `N passed, M failed` line.
//!
//! Live mode: the test API server runs in-process; the cluster (upstream
//! model x,y,z / a,b,c) is built once and published to it; the agent binary
//! is started with `NODE_NAME`, a generated kubeconfig and a unique pin dir.
//! Each case starts from the pristine model: the runner keeps an
//! `npm_policy::cases::Model` in step with the live cluster, and before a
//! case brings the live objects back to `Model::upstream()` (policies
//! deleted, labels restored, extra pods and namespaces deleted, missing ones
//! recreated at their pristine addresses).

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use npm_policy::cases::{self, Action, Case, Matrix, Model};
use npm_policy::model::Protocol;
use serde_json::{json, Value};

use crate::api::{namespace_path, pod_object, pod_path, policy_path, Api, ApiError};
use crate::cluster::{Cluster, ClusterError};
use crate::probe::{probe_until, Probe, ProbeConfig, Proto};

/// Errors of the runner.
#[derive(Debug, thiserror::Error)]
pub enum RunnerError {
    /// A case file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A case file could not be parsed.
    #[error("parsing {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// The parse error.
        source: cases::CaseError,
    },
    /// Two cases share an id.
    #[error("duplicate case id {id} (in {first} and {second})")]
    DuplicateId {
        /// The id.
        id: String,
        /// Where it appeared first.
        first: PathBuf,
        /// Where it appeared again.
        second: PathBuf,
    },
    /// The netns cluster failed.
    #[error(transparent)]
    Cluster(#[from] ClusterError),
    /// An API request failed.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// The test API server could not start.
    #[error("starting the test API server: {0}")]
    ApiServer(String),
    /// The agent could not be started or died.
    #[error("agent {bin}: {message}")]
    Agent {
        /// The agent binary.
        bin: PathBuf,
        /// What happened.
        message: String,
    },
    /// An action could not be applied.
    #[error("action {action}: {message}")]
    Action {
        /// The action name.
        action: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A probe is malformed (unknown protocol, bad matrix, unknown pod).
    #[error("probe: {0}")]
    Probe(String),
}

/// Which engine decides reachability.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// npm-policy's simulator (no kernel).
    Simulate,
    /// The real agent with the eBPF dataplane.
    Ebpf,
    /// The real agent with the nftables dataplane.
    Nftables,
}

impl Engine {
    /// Parses `simulate`, `ebpf` or `nftables`.
    pub fn parse(s: &str) -> Option<Engine> {
        match s {
            "simulate" => Some(Engine::Simulate),
            "ebpf" => Some(Engine::Ebpf),
            "nftables" | "nft" => Some(Engine::Nftables),
            _ => None,
        }
    }
}

/// Runner options.
#[derive(Clone, Debug)]
pub struct Options {
    /// The engine.
    pub engine: Engine,
    /// Case files or directories (every `*.yaml` in them).
    pub cases: Vec<PathBuf>,
    /// Run only cases whose id contains this text.
    pub filter: Option<String>,
    /// The agent binary (live modes).
    pub agent_bin: PathBuf,
    /// Extra arguments for `npm-agent run`.
    pub agent_args: Vec<String>,
    /// Probe IPv6 addresses instead of IPv4.
    pub ipv6: bool,
    /// Timeout of one probe attempt.
    pub probe_timeout: Duration,
    /// How long a probe matrix is retried until it matches.
    pub deadline: Duration,
    /// Probe threads.
    pub threads: usize,
    /// Pause after a step's actions before probing, and before the
    /// confirmation round of a matching matrix.
    pub settle: Duration,
    /// Deadline of the very first probe (it also waits for the agent to
    /// come up).
    pub startup_deadline: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            engine: Engine::Simulate,
            cases: vec![],
            filter: None,
            agent_bin: PathBuf::from("target/debug/npm-agent"),
            agent_args: vec![],
            ipv6: false,
            probe_timeout: Duration::from_secs(1),
            deadline: Duration::from_secs(10),
            threads: 32,
            settle: Duration::from_millis(500),
            startup_deadline: Duration::from_secs(30),
        }
    }
}

/// A loaded case and where it came from.
#[derive(Clone, Debug)]
pub struct LoadedCase {
    /// The file.
    pub path: PathBuf,
    /// The case.
    pub case: Case,
}

/// Expands directories to their `*.yaml` files (sorted).
pub fn case_files(paths: &[PathBuf]) -> Result<Vec<PathBuf>, RunnerError> {
    let mut out = Vec::new();
    for p in paths {
        if p.is_dir() {
            let rd = std::fs::read_dir(p).map_err(|source| RunnerError::Read {
                path: p.clone(),
                source,
            })?;
            let mut files: Vec<PathBuf> = rd
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|f| f.is_file() && matches!(f.extension().and_then(|e| e.to_str()), Some("yaml" | "yml")))
                .collect();
            files.sort();
            out.extend(files);
        } else {
            out.push(p.clone());
        }
    }
    Ok(out)
}

/// Parses a case file (`npm_policy::cases::parse_case_file`; placeholders
/// stay in place).
pub fn parse_text(text: &str) -> Result<Vec<Case>, cases::CaseError> {
    cases::parse_case_file(text)
}

/// Loads every case of the given files/directories (placeholders stay in
/// place; they are resolved when an action runs). Ids must be unique.
pub fn load_cases(paths: &[PathBuf]) -> Result<Vec<LoadedCase>, RunnerError> {
    let mut out: Vec<LoadedCase> = Vec::new();
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    for f in case_files(paths)? {
        let text = std::fs::read_to_string(&f).map_err(|source| RunnerError::Read {
            path: f.clone(),
            source,
        })?;
        let parsed = parse_text(&text).map_err(|source| RunnerError::Parse {
            path: f.clone(),
            source,
        })?;
        for case in parsed {
            if let Some(first) = seen.get(&case.id) {
                return Err(RunnerError::DuplicateId {
                    id: case.id.clone(),
                    first: first.clone(),
                    second: f.clone(),
                });
            }
            seen.insert(case.id.clone(), f.clone());
            out.push(LoadedCase { path: f.clone(), case });
        }
    }
    Ok(out)
}

/// The outcome of one case.
#[derive(Clone, Debug)]
pub struct Outcome {
    /// Case id.
    pub id: String,
    /// Passed.
    pub passed: bool,
    /// The printed report (failures: expected and observed tables).
    pub report: String,
    /// Wall time.
    pub elapsed: Duration,
}

/// Totals of a run.
#[derive(Clone, Debug, Default)]
pub struct Summary {
    /// Every case's outcome, in order.
    pub outcomes: Vec<Outcome>,
}

impl Summary {
    /// Passed cases.
    pub fn passed(&self) -> usize {
        self.outcomes.iter().filter(|o| o.passed).count()
    }
    /// Failed cases.
    pub fn failed(&self) -> usize {
        self.outcomes.len() - self.passed()
    }
    /// The final line, exactly `N passed, M failed`.
    pub fn line(&self) -> String {
        format!("{} passed, {} failed", self.passed(), self.failed())
    }
}

fn selected(cases: Vec<LoadedCase>, filter: &Option<String>) -> Vec<LoadedCase> {
    cases
        .into_iter()
        .filter(|c| filter.as_ref().is_none_or(|f| c.case.id.contains(f.as_str())))
        .collect()
}

fn title(c: &Case) -> String {
    c.title.clone().map(|t| format!(" — {t}")).unwrap_or_default()
}

/// Runs the cases through npm-policy's simulator (evaluator and compiled
/// lookup), printing to `out`.
pub fn run_simulated(cases: &[LoadedCase], out: &mut dyn Write) -> Summary {
    let mut s = Summary::default();
    for lc in cases {
        let t0 = Instant::now();
        let r = cases::run_case_simulated(&lc.case);
        let passed = r.passed();
        let report = if passed {
            format!("PASS {}{}\n", lc.case.id, title(&lc.case))
        } else {
            format!("FAIL {}{}\n{}", lc.case.id, title(&lc.case), r.report())
        };
        let _ = out.write_all(report.as_bytes());
        s.outcomes.push(Outcome {
            id: lc.case.id.clone(),
            passed,
            report,
            elapsed: t0.elapsed(),
        });
    }
    s
}

/// Maps an IPv4 prefix length of a placeholder to the IPv6 length that
/// keeps the same containment for the model's addresses (`198.18.n.p` <->
/// `fd00:198:18::n:p`): /0../16 -> x6 (/16 -> /96, /4 -> /24), /24 -> /112,
/// /32 -> /128.
pub fn v6_prefix_for_v4(n: u8) -> u8 {
    match n {
        0..=16 => n * 6,
        17..=24 => 96 + (n - 16) * 2,
        _ => (112 + (n.min(32) - 24) * 2).min(128),
    }
}

/// Rewrites `${CIDR<n>:` placeholders to their IPv6 lengths.
pub fn remap_cidr_placeholders_v6(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("${CIDR") {
        out.push_str(&rest[..i + 6]);
        rest = &rest[i + 6..];
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        match digits.parse::<u8>() {
            Ok(n) if rest[digits.len()..].starts_with(':') => {
                out.push_str(&v6_prefix_for_v4(n).to_string());
                rest = &rest[digits.len()..];
            }
            _ => {}
        }
    }
    out.push_str(rest);
    out
}

fn proto_of(p: Protocol) -> Proto {
    match p {
        Protocol::Tcp => Proto::Tcp,
        Protocol::Udp => Proto::Udp,
        Protocol::Sctp => Proto::Sctp,
    }
}

fn model_pod_ip(model: &Model, pod: &str, v6: bool) -> Option<IpAddr> {
    let (ns, name) = pod.split_once('/')?;
    model
        .snapshot
        .pods
        .get(&(ns.to_string(), name.to_string()))?
        .ips
        .iter()
        .find(|i| i.is_ipv6() == v6)
        .copied()
}

/// The agent process; killed (SIGTERM, then SIGKILL) on drop.
#[derive(Debug)]
struct Agent {
    bin: PathBuf,
    child: Child,
    log: PathBuf,
    metrics: SocketAddr,
}

impl Agent {
    fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(st)) => Some(format!(
                "exited with {st}; log {}:\n{}",
                self.log.display(),
                tail(&self.log, 30)
            )),
            _ => None,
        }
    }

    fn stop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling the child we started, by its pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let end = Instant::now() + Duration::from_secs(5);
            while Instant::now() < end {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let v: Vec<&str> = text.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .unwrap_or(19090)
}

/// The live runner: API server, netns cluster, agent.
pub struct LiveRunner {
    opts: Options,
    // Field order is drop order: the agent stops before the cluster and the
    // API server go away.
    agent: Option<Agent>,
    cluster: Cluster,
    api: Api,
    server: Option<npm_testapi::TestApiServer>,
    model: Model,
    workdir: PathBuf,
    pin_dir: PathBuf,
    nft_table: String,
    first_probe: bool,
}

impl std::fmt::Debug for LiveRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveRunner")
            .field("engine", &self.opts.engine)
            .field("workdir", &self.workdir)
            .finish()
    }
}

fn api_err(e: ApiError) -> RunnerError {
    RunnerError::Api(e)
}

impl LiveRunner {
    /// Starts the API server, builds and publishes the pristine cluster and
    /// starts the agent.
    pub fn start(opts: Options) -> Result<Self, RunnerError> {
        let pid = std::process::id();
        let server = npm_testapi::TestApiServer::start_background(npm_testapi::Options::default())
            .map_err(|e| RunnerError::ApiServer(e.to_string()))?;
        let api = Api::new(server.addr());
        let workdir = std::env::temp_dir().join(format!("npm-conformance-{pid}"));
        std::fs::create_dir_all(&workdir).map_err(|source| RunnerError::Read {
            path: workdir.clone(),
            source,
        })?;
        let kubeconfig = workdir.join("kubeconfig");
        server
            .kubeconfig(&kubeconfig)
            .map_err(|e| RunnerError::ApiServer(e.to_string()))?;
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/npm-conformance-{pid}"));
        let nft_table = format!("npmconf{pid}");
        let mut r = LiveRunner {
            opts,
            agent: None,
            cluster: Cluster::new()?,
            api,
            server: Some(server),
            model: Model::upstream(),
            workdir,
            pin_dir,
            nft_table,
            first_probe: true,
        };
        // Publish and build the pristine model.
        let pristine = Model::upstream();
        for ns in pristine.snapshot.namespaces.values() {
            r.create_namespace_obj(&ns.name, &ns.labels)?;
        }
        for pod in pristine.snapshot.pods.values() {
            r.create_pod_live(&pristine, &pod.namespace, &pod.name)?;
        }
        r.model = pristine;
        r.start_agent(&kubeconfig)?;
        Ok(r)
    }

    fn start_agent(&mut self, kubeconfig: &Path) -> Result<(), RunnerError> {
        let bin = self.opts.agent_bin.clone();
        let log = self.workdir.join("agent.log");
        let logf = std::fs::File::create(&log).map_err(|source| RunnerError::Read {
            path: log.clone(),
            source,
        })?;
        let logf2 = logf.try_clone().map_err(|source| RunnerError::Read {
            path: log.clone(),
            source,
        })?;
        let dp = match self.opts.engine {
            Engine::Nftables => "nftables",
            _ => "ebpf",
        };
        let metrics_port = free_port();
        let mut cmd = Command::new(&bin);
        cmd.arg("run")
            .env("NODE_NAME", cases::MODEL_NODE)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--dataplane")
            .arg(dp)
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            .arg("--nft-table")
            .arg(&self.nft_table)
            .arg("--metrics-addr")
            .arg(format!("127.0.0.1:{metrics_port}"))
            .args(&self.opts.agent_args)
            .stdin(Stdio::null())
            .stdout(logf)
            .stderr(logf2);
        let child = cmd.spawn().map_err(|e| RunnerError::Agent {
            bin: bin.clone(),
            message: format!("spawn: {e}"),
        })?;
        let mut agent = Agent {
            bin,
            child,
            log,
            metrics: SocketAddr::from(([127, 0, 0, 1], metrics_port)),
        };
        // Wait for /readyz (all lists done, first sync applied); fail early
        // when the agent exits.
        let health = Api::new(SocketAddr::from(([127, 0, 0, 1], metrics_port)));
        let end = Instant::now() + self.opts.startup_deadline;
        loop {
            if let Some(msg) = agent.exited() {
                return Err(RunnerError::Agent {
                    bin: agent.bin.clone(),
                    message: msg,
                });
            }
            // `/readyz` answers 200 "ready\n" (text, not JSON): request_raw
            // reports a 2xx answer with a non-JSON body as a "json:"
            // BadResponse; a not-ready agent answers 503 (a Status error).
            match health.request_raw("GET", "/readyz", "text/plain", None) {
                Ok((200, _)) => break,
                Err(ApiError::BadResponse { detail, .. }) if detail.starts_with("json") => break,
                _ => {}
            }
            if Instant::now() >= end {
                eprintln!(
                    "npm-conformance: the agent is not ready after {:?}; running anyway (log {})",
                    self.opts.startup_deadline,
                    agent.log.display()
                );
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.agent = Some(agent);
        Ok(())
    }

    fn create_namespace_obj(&self, ns: &str, labels: &BTreeMap<String, String>) -> Result<(), RunnerError> {
        self.api
            .create(
                "/api/v1/namespaces",
                &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}),
            )
            .map_err(api_err)?;
        Ok(())
    }

    /// Creates the netns of `ns/name` at the address `model` gives it and
    /// publishes the pod.
    fn create_pod_live(&mut self, model: &Model, ns: &str, name: &str) -> Result<(), RunnerError> {
        let key = format!("{ns}/{name}");
        let pod = model
            .snapshot
            .pods
            .get(&(ns.to_string(), name.to_string()))
            .ok_or_else(|| RunnerError::Action {
                action: "create_pod",
                message: format!("pod {key} is not in the model"),
            })?
            .clone();
        let v4 = pod.ips.iter().find_map(|i| match i {
            IpAddr::V4(a) => Some(*a),
            _ => None,
        });
        let v6 = pod.ips.iter().find_map(|i| match i {
            IpAddr::V6(a) => Some(*a),
            _ => None,
        });
        let (v4, v6): (Ipv4Addr, Ipv6Addr) = match (v4, v6) {
            (Some(a), Some(b)) => (a, b),
            _ => {
                return Err(RunnerError::Action {
                    action: "create_pod",
                    message: format!("model pod {key} lacks an IPv4 or IPv6 address"),
                })
            }
        };
        self.cluster.create_pod_at(ns, name, v4, v6)?;
        let obj = pod_object(
            ns,
            name,
            &pod.labels,
            cases::MODEL_NODE,
            &[IpAddr::V4(v4), IpAddr::V6(v6)],
        );
        self.api
            .create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
            .map_err(api_err)?;
        Ok(())
    }

    fn delete_pod_live(&mut self, ns: &str, name: &str) -> Result<(), RunnerError> {
        self.api.delete(&pod_path(ns, name)).map_err(api_err)?;
        if self.cluster.pod(ns, name).is_some() {
            self.cluster.delete_pod(ns, name)?;
        }
        Ok(())
    }

    /// The REST client of the in-process API server.
    pub fn api(&self) -> &Api {
        &self.api
    }

    /// The netns cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The model the live cluster is kept equal to.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The kubeconfig pointing at the in-process API server (the one the
    /// agent uses).
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.workdir.join("kubeconfig")
    }

    /// The runner's scratch directory (kubeconfig, agent log); not removed
    /// by [`LiveRunner::shutdown`].
    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// The agent's bpffs pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// The agent's nftables table name.
    pub fn nft_table(&self) -> &str {
        &self.nft_table
    }

    /// The agent's metrics/health address (`/metrics`, `/readyz`), while it
    /// runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.agent.as_ref().map(|a| a.metrics)
    }

    /// Brings the live cluster back to the pristine model.
    pub fn reset(&mut self) -> Result<(), RunnerError> {
        self.api.delete_all_policies().map_err(api_err)?;
        let pristine = Model::upstream();
        let cur = self.model.clone();
        // Extra namespaces (with their pods).
        for ns in cur.snapshot.namespaces.keys() {
            if !pristine.snapshot.namespaces.contains_key(ns) {
                self.api.delete(&namespace_path(ns)).map_err(api_err)?;
                let pods: Vec<String> = self
                    .cluster
                    .pods()
                    .filter(|p| &p.namespace == ns)
                    .map(|p| p.name.clone())
                    .collect();
                for p in pods {
                    self.cluster.delete_pod(ns, &p)?;
                }
            }
        }
        // Pods that are extra or at another address.
        for (k, pod) in &cur.snapshot.pods {
            if !pristine.snapshot.namespaces.contains_key(&k.0) {
                continue;
            }
            let keep = pristine.snapshot.pods.get(k).is_some_and(|p| p.ips == pod.ips);
            if !keep {
                self.delete_pod_live(&k.0, &k.1)?;
            }
        }
        // Namespaces: missing or with other labels.
        for (name, ns) in &pristine.snapshot.namespaces {
            match cur.snapshot.namespaces.get(name) {
                None => self.create_namespace_obj(name, &ns.labels)?,
                Some(c) if c.labels != ns.labels => self
                    .api
                    .set_labels(&namespace_path(name), &ns.labels)
                    .map_err(api_err)?,
                Some(_) => {}
            }
        }
        // Pods: missing or with other labels.
        for (k, pod) in &pristine.snapshot.pods {
            let live = cur.snapshot.pods.get(k).filter(|p| p.ips == pod.ips);
            let ns_was_deleted = !cur.snapshot.namespaces.contains_key(&k.0);
            match live {
                Some(c) if !ns_was_deleted => {
                    if c.labels != pod.labels {
                        self.api
                            .set_labels(&pod_path(&k.0, &k.1), &pod.labels)
                            .map_err(api_err)?;
                    }
                }
                _ => {
                    if self.cluster.pod(&k.0, &k.1).is_some() {
                        self.cluster.delete_pod(&k.0, &k.1)?;
                    }
                    self.create_pod_live(&pristine, &k.0, &k.1)?;
                }
            }
        }
        self.model = pristine;
        Ok(())
    }

    fn policy_json(&self, action: &'static str, np: &impl serde::Serialize) -> Result<Value, RunnerError> {
        let v = serde_json::to_value(np).map_err(|e| RunnerError::Action {
            action,
            message: format!("serialising the policy: {e}"),
        })?;
        let text = v.to_string();
        if !text.contains("${") {
            return Ok(v);
        }
        let v6 = self.opts.ipv6;
        let text = if v6 { remap_cidr_placeholders_v6(&text) } else { text };
        let model = &self.model;
        let sub = cases::substitute(&text, &|p| model_pod_ip(model, p, v6)).map_err(|e| RunnerError::Action {
            action,
            message: e.to_string(),
        })?;
        serde_json::from_str(&sub).map_err(|e| RunnerError::Action {
            action,
            message: format!("policy after substitution: {e}"),
        })
    }

    /// Applies one action to the live cluster (and to the runner's model).
    pub fn apply(&mut self, action: &Action) -> Result<(), RunnerError> {
        let name = action.name();
        let aerr = |e: cases::CaseError| RunnerError::Action {
            action: name,
            message: e.to_string(),
        };
        match action {
            Action::CreatePolicy(np) | Action::UpdatePolicy(np) => {
                let mut v = self.policy_json(name, np)?;
                if v.get("apiVersion").is_none() {
                    v["apiVersion"] = json!("networking.k8s.io/v1");
                    v["kind"] = json!("NetworkPolicy");
                }
                self.api
                    .apply_policy(&v, matches!(action, Action::UpdatePolicy(_)))
                    .map_err(api_err)?;
                // The model gets the placeholder-resolved policy too (it
                // resolves IPv4 placeholders itself).
                self.model.apply(action).map_err(aerr)?;
            }
            Action::DeletePolicy(o) => {
                self.api.delete(&policy_path(&o.namespace, &o.name)).map_err(api_err)?;
                self.model.apply(action).map_err(aerr)?;
            }
            Action::DeleteAllPolicies(_) => {
                self.api.delete_all_policies().map_err(api_err)?;
                self.model.apply(action).map_err(aerr)?;
            }
            Action::AddNamespaceLabels(a) | Action::SetNamespaceLabels(a) => {
                self.model.apply(action).map_err(aerr)?;
                let labels = self.model.snapshot.namespaces[&a.namespace].labels.clone();
                self.api
                    .set_labels(&namespace_path(&a.namespace), &labels)
                    .map_err(api_err)?;
            }
            Action::AddPodLabels(a) | Action::SetPodLabels(a) => {
                self.model.apply(action).map_err(aerr)?;
                let (ns, p) = a.pod.split_once('/').unwrap_or(("", ""));
                let labels = self.model.snapshot.pods[&(ns.to_string(), p.to_string())]
                    .labels
                    .clone();
                self.api.set_labels(&pod_path(ns, p), &labels).map_err(api_err)?;
            }
            Action::CreatePod(a) => {
                self.model.apply(action).map_err(aerr)?;
                let (ns, p) = a.pod.split_once('/').unwrap_or(("", ""));
                let model = self.model.clone();
                self.create_pod_live(&model, ns, p)?;
            }
            Action::DeletePod(a) => {
                self.model.apply(action).map_err(aerr)?;
                let (ns, p) = a.pod.split_once('/').unwrap_or(("", ""));
                self.delete_pod_live(ns, p)?;
            }
            Action::CreateNamespace(a) => {
                self.model.apply(action).map_err(aerr)?;
                let labels = self.model.snapshot.namespaces[&a.namespace].labels.clone();
                self.create_namespace_obj(&a.namespace, &labels)?;
            }
            Action::DeleteNamespace(a) => {
                self.model.apply(action).map_err(aerr)?;
                self.api.delete(&namespace_path(&a.namespace)).map_err(api_err)?;
                let pods: Vec<String> = self
                    .cluster
                    .pods()
                    .filter(|p| p.namespace == a.namespace)
                    .map(|p| p.name.clone())
                    .collect();
                for p in pods {
                    self.cluster.delete_pod(&a.namespace, &p)?;
                }
            }
        }
        Ok(())
    }

    /// Probes one case probe until it matches or the deadline passes;
    /// returns (expected, observed, rounds).
    pub fn probe(&mut self, probe: &cases::Probe) -> Result<(Matrix, Matrix, usize), RunnerError> {
        let proto = probe.protocol().map_err(|e| RunnerError::Probe(e.to_string()))?;
        let expected = probe.expected().map_err(|e| RunnerError::Probe(e.to_string()))?;
        let mut jobs = Vec::new();
        let mut want = Vec::new();
        let mut cells = Vec::new();
        for (ri, r) in expected.rows.iter().enumerate() {
            let (rns, rname) = r.split_once('/').unwrap_or(("", ""));
            let src = self
                .cluster
                .pod(rns, rname)
                .ok_or_else(|| RunnerError::Probe(format!("source pod {r} does not exist")))?;
            for (ci, c) in expected.columns.iter().enumerate() {
                if r == c {
                    continue;
                }
                let (cns, cname) = c.split_once('/').unwrap_or(("", ""));
                let dst = self
                    .cluster
                    .pod(cns, cname)
                    .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} does not exist")))?;
                jobs.push(Probe {
                    src_netns: src.netns.clone(),
                    dst_pod: dst.key(),
                    dst: SocketAddr::new(dst.ip(self.opts.ipv6), probe.port),
                    proto: proto_of(proto),
                });
                want.push(expected.cells[ri][ci]);
                cells.push((ri, ci));
            }
        }
        let cfg = ProbeConfig {
            timeout: self.opts.probe_timeout,
            threads: self.opts.threads,
            sctp_log: self.cluster.sctp_log(),
        };
        // The very first probe also waits for the agent to come up.
        let deadline = if self.first_probe {
            self.opts.deadline.max(self.opts.startup_deadline)
        } else {
            self.opts.deadline
        };
        self.first_probe = false;
        let (got, rounds) = probe_until(&jobs, &want, &cfg, deadline, self.opts.settle, true);
        let mut observed = expected.clone();
        for (k, &(ri, ci)) in cells.iter().enumerate() {
            observed.cells[ri][ci] = got[k];
        }
        Ok((expected, observed, rounds))
    }

    /// Why the agent is gone, if it exited.
    pub fn agent_exited(&mut self) -> Option<String> {
        self.agent.as_mut().and_then(|a| a.exited())
    }

    /// Runs one case from the pristine model.
    pub fn run_case(&mut self, case: &Case) -> (bool, String) {
        let mut report = String::new();
        let mut ok = true;
        if let Some(msg) = self.agent_exited() {
            return (false, format!("  the agent is not running: {msg}\n"));
        }
        if let Err(e) = self.reset() {
            return (false, format!("  reset to the pristine model: {e}\n"));
        }
        for (si, step) in case.steps.iter().enumerate() {
            for a in &step.actions {
                if let Err(e) = self.apply(a) {
                    return (false, format!("{report}  step {si}: {e}\n"));
                }
            }
            std::thread::sleep(self.opts.settle);
            for (pi, p) in step.probes.iter().enumerate() {
                match self.probe(p) {
                    Ok((expected, observed, _rounds)) => {
                        let mism = expected.compare(&observed);
                        if !mism.is_empty() {
                            ok = false;
                            report.push_str(&format!(
                                "  step {si} probe {pi} ({} {}{}): {} cells differ\n  expected:\n{}  observed:\n{}",
                                p.protocol,
                                p.port,
                                if self.opts.ipv6 { " IPv6" } else { "" },
                                mism.len(),
                                indent(&expected.render()),
                                indent(&observed.render())
                            ));
                            for m in mism.iter().take(20) {
                                report.push_str(&format!("    {m}\n"));
                            }
                        }
                    }
                    Err(e) => return (false, format!("{report}  step {si} probe {pi}: {e}\n")),
                }
            }
        }
        if let Some(agent) = self.agent.as_mut() {
            if let Some(msg) = agent.exited() {
                ok = false;
                report.push_str(&format!("  the agent died: {msg}\n"));
            }
        }
        (ok, report)
    }

    /// Stops the agent, tears the cluster down, stops the API server and
    /// removes the agent's pins and nftables table.
    pub fn shutdown(mut self) -> Result<(), RunnerError> {
        self.shutdown_inner()
    }

    fn shutdown_inner(&mut self) -> Result<(), RunnerError> {
        if let Some(mut a) = self.agent.take() {
            a.stop();
        }
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        for fam in ["inet", "ip", "ip6", "bridge", "netdev"] {
            let _ = Command::new("nft")
                .args(["delete", "table", fam, &self.nft_table])
                .stderr(Stdio::null())
                .status();
        }
        self.server.take();
        Ok(())
    }
}

impl Drop for LiveRunner {
    fn drop(&mut self) {
        let _ = self.shutdown_inner();
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}

static STOP: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// SIGINT/SIGTERM end the run after the current case, so the cluster, the
/// agent and the API server are still torn down.
fn install_stop_handler() {
    let handler: extern "C" fn(libc::c_int) = on_stop_signal;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

/// Runs the cases live (agent + netns cluster), printing to `out`.
pub fn run_live(opts: &Options, cases: &[LoadedCase], out: &mut dyn Write) -> Result<Summary, RunnerError> {
    let mut runner = LiveRunner::start(opts.clone())?;
    let mut s = Summary::default();
    let sctp_note = cases.iter().any(|c| {
        c.case
            .steps
            .iter()
            .any(|st| st.probes.iter().any(|p| p.protocol.eq_ignore_ascii_case("SCTP")))
    });
    if sctp_note {
        let _ = writeln!(out, "note: sctp: decided on crafted packets (SCTP INIT sent with a raw socket, observed in the destination netns)");
    }
    install_stop_handler();
    for lc in cases {
        let t0 = Instant::now();
        if STOP.load(std::sync::atomic::Ordering::Relaxed) {
            let _ = writeln!(out, "interrupted: stopping before {}", lc.case.id);
            break;
        }
        let (passed, details) = runner.run_case(&lc.case);
        let elapsed = t0.elapsed();
        let report = format!(
            "{} {}{} ({:.1}s)\n{}",
            if passed { "PASS" } else { "FAIL" },
            lc.case.id,
            title(&lc.case),
            elapsed.as_secs_f64(),
            details
        );
        let _ = out.write_all(report.as_bytes());
        let _ = out.flush();
        s.outcomes.push(Outcome {
            id: lc.case.id.clone(),
            passed,
            report,
            elapsed,
        });
    }
    let workdir = runner.workdir.clone();
    runner.shutdown()?;
    if s.failed() == 0 {
        let _ = std::fs::remove_dir_all(&workdir);
    } else {
        let _ = writeln!(out, "agent log: {}", workdir.join("agent.log").display());
    }
    Ok(s)
}

/// Loads, filters and runs the cases with the chosen engine; prints the
/// final `N passed, M failed` line.
pub fn run(opts: &Options, out: &mut dyn Write) -> Result<Summary, RunnerError> {
    let cases = selected(load_cases(&opts.cases)?, &opts.filter);
    let summary = match opts.engine {
        Engine::Simulate => run_simulated(&cases, out),
        Engine::Ebpf | Engine::Nftables => run_live(opts, &cases, out)?,
    };
    let _ = writeln!(out, "{}", summary.line());
    Ok(summary)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn v6_prefix_mapping_keeps_containment() {
        assert_eq!(v6_prefix_for_v4(32), 128);
        assert_eq!(v6_prefix_for_v4(24), 112);
        assert_eq!(v6_prefix_for_v4(16), 96);
        assert_eq!(v6_prefix_for_v4(4), 24);
        assert_eq!(v6_prefix_for_v4(0), 0);
        assert_eq!(
            remap_cidr_placeholders_v6("a ${CIDR32:x/a} b ${CIDR4:y/b} ${IP:z/c}"),
            "a ${CIDR128:x/a} b ${CIDR24:y/b} ${IP:z/c}"
        );
    }

    #[test]
    fn engine_names() {
        assert_eq!(Engine::parse("simulate"), Some(Engine::Simulate));
        assert_eq!(Engine::parse("ebpf"), Some(Engine::Ebpf));
        assert_eq!(Engine::parse("nftables"), Some(Engine::Nftables));
        assert_eq!(Engine::parse("iptables"), None);
    }
}
