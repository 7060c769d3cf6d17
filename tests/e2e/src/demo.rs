//! The local demo (`cargo xtask demo`, binary `npm-demo`): the in-process
//! test API server, the 3x3 netns cluster of the upstream model and the real
//! agent, started by [`LiveRunner`]. The demo prints the reachability matrix
//! before any policy, applies `01-default-deny-ingress-x.yaml` from the
//! examples directory, prints the matrix after enforcement, then (unless
//! `once`) re-probes every few seconds and prints the matrix whenever it
//! changes, so that `kubectl apply/delete` against the printed kubeconfig
//! shows enforcement change live. SIGINT/SIGTERM tear everything down.

use std::io::Write;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use npm_policy::cases::{self, Action, Matrix, Model};
use npm_policy::model::Protocol;
use serde::Deserialize;
use serde_json::Value;

use crate::api::ApiError;
use crate::probe::{probe_all, Probe, ProbeConfig, Proto};
use crate::runner::{Engine, LiveRunner, Options, RunnerError};

/// The example the demo applies itself.
pub const FIRST_EXAMPLE: &str = "01-default-deny-ingress-x.yaml";
/// The example the demo suggests applying with kubectl.
pub const SECOND_EXAMPLE: &str = "02-egress-only-dns-and-z.yaml";
/// Prefix of the runner's pin directories under `/sys/fs/bpf`.
pub const PIN_DIR_PREFIX: &str = "npm-conformance-";
/// Prefix of the runner's nftables tables.
pub const NFT_TABLE_PREFIX: &str = "npmconf";
/// Marker line printed before the matrix observed without policies.
pub const BEFORE_MARKER: &str = "=== BEFORE any policy";
/// Marker line printed before the matrix observed after the first example.
pub const AFTER_MARKER: &str = "=== AFTER ";
/// Marker line printed when the watched matrix changed.
pub const CHANGED_MARKER: &str = "=== CHANGED ";

/// Errors of the demo.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The live runner (API server, cluster, agent) failed.
    #[error(transparent)]
    Runner(#[from] RunnerError),
    /// An API request failed.
    #[error("{context}: {source}")]
    Api {
        /// What the demo was doing.
        context: String,
        /// The API error.
        source: ApiError,
    },
    /// A file or directory could not be read or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An example file is not a list of NetworkPolicies.
    #[error("example {path}, document {document}: {message}")]
    Example {
        /// The file.
        path: PathBuf,
        /// The 1-based YAML document index.
        document: usize,
        /// What is wrong.
        message: String,
    },
    /// A prerequisite (agent binary, BPF object, examples) is missing.
    #[error("missing prerequisite: {0}")]
    Prerequisite(String),
    /// SIGINT/SIGTERM arrived before the demo got to its watch loop
    /// (everything was torn down).
    #[error("interrupted during {0}; everything was torn down")]
    Interrupted(&'static str),
    /// A bad option value.
    #[error("option {option}: {message}")]
    Option {
        /// The option.
        option: &'static str,
        /// What is wrong.
        message: String,
    },
}

/// Demo options (the `npm-demo` flags).
#[derive(Clone, Debug)]
pub struct DemoOptions {
    /// The agent binary.
    pub agent_bin: PathBuf,
    /// The examples directory (holds [`FIRST_EXAMPLE`] and [`SECOND_EXAMPLE`]).
    pub examples: PathBuf,
    /// [`Engine::Ebpf`] or [`Engine::Nftables`].
    pub engine: Engine,
    /// Where the kubeconfig is written (`<state_dir>/kubeconfig`).
    pub state_dir: PathBuf,
    /// Probed port.
    pub port: u16,
    /// Probed protocol.
    pub protocol: Protocol,
    /// Pause between two watch rounds.
    pub watch: Duration,
    /// Stop after the AFTER matrix (no watch loop).
    pub once: bool,
    /// How long to wait for the cluster/agent to reach an expected matrix.
    pub deadline: Duration,
    /// How long to wait for other processes' netns clusters to go away
    /// before starting (see [`other_live_clusters`]).
    pub exclusive_wait: Duration,
}

impl Default for DemoOptions {
    fn default() -> Self {
        DemoOptions {
            agent_bin: PathBuf::from("target/debug/npm-agent"),
            examples: PathBuf::from("examples"),
            engine: Engine::Ebpf,
            state_dir: PathBuf::from(".npm-demo"),
            port: 80,
            protocol: Protocol::Tcp,
            watch: Duration::from_secs(5),
            once: false,
            deadline: Duration::from_secs(30),
            exclusive_wait: Duration::from_secs(600),
        }
    }
}

/// What a demo run observed.
#[derive(Clone, Debug)]
pub struct DemoOutcome {
    /// The matrix before any policy.
    pub before: Matrix,
    /// The matrix after [`FIRST_EXAMPLE`].
    pub after: Matrix,
    /// The expected matrix after [`FIRST_EXAMPLE`] (npm-policy's evaluator).
    pub expected_after: Matrix,
}

impl DemoOutcome {
    /// Whether BEFORE is all reachable and AFTER equals the expectation.
    pub fn passed(&self) -> bool {
        let all = all_reachable(&self.before.rows, &self.before.columns);
        all.compare(&self.before).is_empty() && self.expected_after.compare(&self.after).is_empty()
    }
}

static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(_: libc::c_int) {
    STOP.store(true, Ordering::SeqCst);
}

/// Installs SIGINT/SIGTERM handlers that only set a flag (see
/// [`stop_requested`]); the demo then tears everything down and returns.
pub fn install_stop_handler() {
    let handler: extern "C" fn(libc::c_int) = on_stop_signal;
    // SAFETY: the handler only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, handler as libc::sighandler_t);
        libc::signal(libc::SIGTERM, handler as libc::sighandler_t);
    }
}

/// Whether SIGINT/SIGTERM arrived.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::SeqCst)
}

/// The upstream model's pods, `ns/name`, in x,y,z / a,b,c order.
pub fn model_pods() -> Vec<String> {
    cases::default_pods()
}

fn all_reachable(rows: &[String], cols: &[String]) -> Matrix {
    Matrix {
        rows: rows.to_vec(),
        columns: cols.to_vec(),
        cells: vec![vec![true; cols.len()]; rows.len()],
    }
}

/// Reads a multi-document YAML file of NetworkPolicies into JSON objects
/// (empty documents are skipped; any other kind is an error).
pub fn read_policies(path: &Path) -> Result<Vec<Value>, DemoError> {
    let text = std::fs::read_to_string(path).map_err(|source| DemoError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = Vec::new();
    for (i, doc) in serde_yaml::Deserializer::from_str(&text).enumerate() {
        let err = |message: String| DemoError::Example {
            path: path.to_path_buf(),
            document: i + 1,
            message,
        };
        let v = Value::deserialize(doc).map_err(|e| err(e.to_string()))?;
        if v.is_null() {
            continue;
        }
        if v["kind"] != "NetworkPolicy" || v["apiVersion"] != "networking.k8s.io/v1" {
            return Err(err(format!(
                "want apiVersion networking.k8s.io/v1 kind NetworkPolicy, got {} {}",
                v["apiVersion"], v["kind"]
            )));
        }
        if v["metadata"]["name"].as_str().is_none_or(str::is_empty) {
            return Err(err("metadata.name is missing".into()));
        }
        out.push(v);
    }
    if out.is_empty() {
        return Err(DemoError::Example {
            path: path.to_path_buf(),
            document: 0,
            message: "no NetworkPolicy in the file".into(),
        });
    }
    Ok(out)
}

/// The matrix npm-policy's reference evaluator expects for the upstream
/// model with `policies` (JSON NetworkPolicy objects, as the API server
/// holds them) on `port`/`protocol`.
pub fn expected_matrix(policies: &[Value], protocol: Protocol, port: u16) -> Result<Matrix, String> {
    let mut model = Model::upstream();
    for p in policies {
        let mut clean = p.clone();
        if let Some(m) = clean["metadata"].as_object_mut() {
            m.retain(|k, _| matches!(k.as_str(), "name" | "namespace" | "labels"));
        }
        clean.as_object_mut().map(|o| o.remove("status"));
        let name = format!(
            "{}/{}",
            p["metadata"]["namespace"].as_str().unwrap_or("default"),
            p["metadata"]["name"].as_str().unwrap_or("")
        );
        let action: Action = serde_json::from_value(serde_json::json!({ "create_policy": clean }))
            .map_err(|e| format!("policy {name}: {e}"))?;
        model.apply(&action).map_err(|e| format!("policy {name}: {e}"))?;
    }
    let pods = model_pods();
    Ok(model.probe(&pods, &pods, protocol, port).0)
}

/// Probes every ordered pair of the model's pods once (no retries, no
/// expectation); the diagonal is reported reachable.
pub fn observe(runner: &LiveRunner, protocol: Protocol, port: u16) -> Result<Matrix, DemoError> {
    let pods = model_pods();
    let proto = match protocol {
        Protocol::Tcp => Proto::Tcp,
        Protocol::Udp => Proto::Udp,
        Protocol::Sctp => Proto::Sctp,
    };
    let cluster = runner.cluster();
    let mut jobs = Vec::new();
    let mut cells = Vec::new();
    for (ri, r) in pods.iter().enumerate() {
        let (rns, rname) = r.split_once('/').unwrap_or(("", ""));
        let src = cluster
            .pod(rns, rname)
            .ok_or_else(|| RunnerError::Probe(format!("source pod {r} does not exist")))?;
        for (ci, c) in pods.iter().enumerate() {
            if r == c {
                continue;
            }
            let (cns, cname) = c.split_once('/').unwrap_or(("", ""));
            let dst = cluster
                .pod(cns, cname)
                .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} does not exist")))?;
            jobs.push(Probe {
                src_netns: src.netns.clone(),
                dst_pod: dst.key(),
                dst: SocketAddr::new(dst.ip(false), port),
                proto,
            });
            cells.push((ri, ci));
        }
    }
    let cfg = ProbeConfig {
        timeout: Duration::from_secs(1),
        threads: 32,
        sctp_log: cluster.sctp_log(),
    };
    let got = probe_all(&jobs, &cfg);
    let mut m = all_reachable(&pods, &pods);
    for (k, &(ri, ci)) in cells.iter().enumerate() {
        m.cells[ri][ci] = got[k];
    }
    Ok(m)
}

/// Probes until the observed matrix equals `expected` (confirmed by one
/// more round) or `deadline` passes; returns the last observation.
pub fn observe_until(
    runner: &LiveRunner,
    protocol: Protocol,
    port: u16,
    expected: &Matrix,
    deadline: Duration,
) -> Result<Matrix, DemoError> {
    let end = Instant::now() + deadline;
    let mut confirmed = false;
    loop {
        let m = observe(runner, protocol, port)?;
        if expected.compare(&m).is_empty() {
            if confirmed {
                return Ok(m);
            }
            confirmed = true;
        } else {
            confirmed = false;
        }
        if Instant::now() >= end || stop_requested() {
            return Ok(m);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The NetworkPolicies in the API server, sorted by `ns/name`.
pub fn list_policies(runner: &LiveRunner) -> Result<Vec<Value>, DemoError> {
    let list = runner
        .api()
        .get("/apis/networking.k8s.io/v1/networkpolicies")
        .map_err(|source| DemoError::Api {
            context: "listing NetworkPolicies".into(),
            source,
        })?;
    let mut items = list["items"].as_array().cloned().unwrap_or_default();
    items.sort_by_key(policy_name);
    Ok(items)
}

fn policy_name(p: &Value) -> String {
    format!(
        "{}/{}",
        p["metadata"]["namespace"].as_str().unwrap_or(""),
        p["metadata"]["name"].as_str().unwrap_or("")
    )
}

/// Pids of other live processes that own a netns cluster (netns names
/// `npmc<hex pid><letter>-...`). The model's pods have fixed addresses, so
/// two clusters at once steal each other's host routes.
pub fn other_live_clusters() -> Vec<u32> {
    let me = std::process::id();
    let Ok(list) = crate::netns::ip(&["netns", "list"]) else {
        return vec![];
    };
    let mut pids: Vec<u32> = list
        .lines()
        .filter_map(|l| {
            let rest = l.split_whitespace().next()?.strip_prefix(crate::cluster::NAME_PREFIX)?;
            let hex: String = rest.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
            if hex.is_empty() || hex.len() == rest.len() {
                return None;
            }
            u32::from_str_radix(&hex, 16).ok()
        })
        .filter(|&p| p != me && pid_alive(p))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Waits (up to `max`) until no other process runs a netns cluster.
fn wait_exclusive(max: Duration, out: &mut dyn Write) -> Result<(), DemoError> {
    let end = Instant::now() + max;
    let mut said = false;
    loop {
        let others = other_live_clusters();
        if others.is_empty() {
            return Ok(());
        }
        if stop_requested() {
            return Err(DemoError::Interrupted("the wait for other clusters"));
        }
        if Instant::now() >= end {
            return Err(DemoError::Prerequisite(format!(
                "another netns cluster is running (pids {others:?}); its pods use the same addresses"
            )));
        }
        if !said {
            writeln_flush(
                out,
                &format!("npm-demo: waiting for the netns cluster of pids {others:?} to finish (same pod addresses)"),
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes what a crashed earlier demo (or conformance) run left behind:
/// netns and veths of the cluster prefix (done by `Cluster::new`), pin
/// directories `/sys/fs/bpf/npm-conformance-<pid>`, scratch directories
/// `<tmp>/npm-conformance-<pid>` and nftables tables `npmconf<pid>` whose
/// process is gone. Returns what was removed.
pub fn clear_leftovers() -> Vec<String> {
    let mut removed = Vec::new();
    crate::cluster::clear_leftovers();
    for dir in [PathBuf::from("/sys/fs/bpf"), std::env::temp_dir()] {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(pid) = name.strip_prefix(PIN_DIR_PREFIX).and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !pid_alive(pid) && std::fs::remove_dir_all(e.path()).is_ok() {
                removed.push(e.path().display().to_string());
            }
        }
    }
    if let Ok(out) = Command::new("nft")
        .args(["list", "tables"])
        .stderr(Stdio::null())
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "table inet npmconf1234"
            let parts: Vec<&str> = line.split_whitespace().collect();
            if let [_, fam, name] = parts[..] {
                if let Some(pid) = name.strip_prefix(NFT_TABLE_PREFIX).and_then(|p| p.parse::<u32>().ok()) {
                    if !pid_alive(pid)
                        && Command::new("nft")
                            .args(["delete", "table", fam, name])
                            .stderr(Stdio::null())
                            .status()
                            .is_ok_and(|s| s.success())
                    {
                        removed.push(format!("nft table {fam} {name}"));
                    }
                }
            }
        }
    }
    removed
}

/// Removes the demo's kubeconfig (and the state dir when it is then empty)
/// and the runner's scratch directory on drop.
struct FileGuard {
    kubeconfig: PathBuf,
    state_dir: PathBuf,
    workdir: PathBuf,
}

impl Drop for FileGuard {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.kubeconfig);
        let _ = std::fs::remove_dir(&self.state_dir);
        let _ = std::fs::remove_dir_all(&self.workdir);
    }
}

fn now_utc() -> String {
    let s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    format!("{:02}:{:02}:{:02} UTC", (s / 3600) % 24, (s / 60) % 60, s % 60)
}

fn shown(p: &Path) -> String {
    std::env::current_dir()
        .ok()
        .and_then(|cwd| p.strip_prefix(cwd).ok().map(Path::to_path_buf))
        .unwrap_or_else(|| p.to_path_buf())
        .display()
        .to_string()
}

fn check_prerequisites(opts: &DemoOptions) -> Result<(), DemoError> {
    if !opts.agent_bin.is_file() {
        return Err(DemoError::Prerequisite(format!(
            "agent binary {} (build it: cargo build --bin npm-agent)",
            opts.agent_bin.display()
        )));
    }
    if opts.engine == Engine::Ebpf {
        match std::env::var_os("NPM_EBPF_OBJECT") {
            Some(o) if Path::new(&o).is_file() => {}
            Some(o) => {
                return Err(DemoError::Prerequisite(format!(
                    "BPF object {} (NPM_EBPF_OBJECT) does not exist (build it: cargo xtask build-ebpf, or use --dataplane nftables)",
                    Path::new(&o).display()
                )))
            }
            None => {
                return Err(DemoError::Prerequisite(
                    "NPM_EBPF_OBJECT is not set (run through `cargo xtask demo`, or use --dataplane nftables)".into(),
                ))
            }
        }
    }
    if opts.engine == Engine::Simulate {
        return Err(DemoError::Option {
            option: "--dataplane",
            message: "the demo needs a real dataplane: ebpf or nftables".into(),
        });
    }
    for f in [FIRST_EXAMPLE, SECOND_EXAMPLE] {
        if !opts.examples.join(f).is_file() {
            return Err(DemoError::Prerequisite(format!(
                "example {}",
                opts.examples.join(f).display()
            )));
        }
    }
    Ok(())
}

fn writeln_flush(out: &mut dyn Write, text: &str) {
    let _ = writeln!(out, "{text}");
    let _ = out.flush();
}

/// Runs the demo, printing to `out`. Returns what it observed (the watch
/// loop, unless `once`, runs until SIGINT/SIGTERM, see
/// [`install_stop_handler`]). Everything is torn down before it returns,
/// also on error.
pub fn run(opts: &DemoOptions, out: &mut dyn Write) -> Result<DemoOutcome, DemoError> {
    check_prerequisites(opts)?;
    wait_exclusive(opts.exclusive_wait, out)?;
    for r in clear_leftovers() {
        writeln_flush(out, &format!("npm-demo: removed a leftover of an earlier run: {r}"));
    }
    let proto_name = protocol_name(opts.protocol);
    let first = read_policies(&opts.examples.join(FIRST_EXAMPLE))?;
    let expected_after = expected_matrix(&first, opts.protocol, opts.port).map_err(|message| DemoError::Example {
        path: opts.examples.join(FIRST_EXAMPLE),
        document: 0,
        message,
    })?;

    writeln_flush(
        out,
        &format!(
            "npm-demo: starting the test API server, the 3x3 netns cluster and the agent ({})",
            engine_name(opts.engine)
        ),
    );
    let kubeconfig = opts.state_dir.join("kubeconfig");
    // The runner's scratch dir is `<tmp>/npm-conformance-<pid>`; the guard
    // also removes it when the start fails half-way.
    let _files = FileGuard {
        kubeconfig: kubeconfig.clone(),
        state_dir: opts.state_dir.clone(),
        workdir: std::env::temp_dir().join(format!("{PIN_DIR_PREFIX}{}", std::process::id())),
    };
    let mut runner = LiveRunner::start(Options {
        engine: opts.engine,
        agent_bin: opts.agent_bin.clone(),
        deadline: opts.deadline,
        startup_deadline: opts.deadline,
        ..Options::default()
    })?;
    if stop_requested() {
        return Err(DemoError::Interrupted("startup"));
    }
    std::fs::create_dir_all(&opts.state_dir).map_err(|source| DemoError::Io {
        path: opts.state_dir.clone(),
        source,
    })?;
    std::fs::copy(runner.kubeconfig_path(), &kubeconfig).map_err(|source| DemoError::Io {
        path: kubeconfig.clone(),
        source,
    })?;
    let server = std::fs::read_to_string(&kubeconfig)
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.trim().strip_prefix("server:").map(|s| s.trim().to_string()))
        })
        .unwrap_or_else(|| "?".into());
    writeln_flush(out, &format!("npm-demo: API server: {server}"));
    if let Some(m) = runner.metrics_addr() {
        writeln_flush(
            out,
            &format!("npm-demo: agent metrics: http://{m}/metrics (health: http://{m}/readyz)"),
        );
    }
    writeln_flush(out, &format!("npm-demo: pin dir {}", runner.pin_dir().display()));
    writeln_flush(out, &format!("npm-demo: kubeconfig: {}", shown(&kubeconfig)));
    writeln_flush(out, "npm-demo: try, in another terminal:");
    writeln_flush(
        out,
        &format!(
            "  kubectl --kubeconfig {} apply -f {}",
            shown(&kubeconfig),
            shown(&opts.examples.join(SECOND_EXAMPLE))
        ),
    );
    writeln_flush(
        out,
        &format!("  kubectl --kubeconfig {} get networkpolicies -A", shown(&kubeconfig)),
    );
    writeln_flush(out, "");

    let pods = model_pods();
    let before = observe_until(
        &runner,
        opts.protocol,
        opts.port,
        &all_reachable(&pods, &pods),
        opts.deadline,
    )?;
    writeln_flush(
        out,
        &format!(
            "{BEFORE_MARKER} ({proto_name}/{}; rows: from, columns: to; . reachable, X blocked)\n{}",
            opts.port,
            before.render()
        ),
    );

    if stop_requested() {
        return Err(DemoError::Interrupted("the BEFORE probe"));
    }
    writeln_flush(
        out,
        &format!(
            "npm-demo: applying {} through the API server:",
            shown(&opts.examples.join(FIRST_EXAMPLE))
        ),
    );
    for p in &first {
        runner.api().apply_policy(p, true).map_err(|source| DemoError::Api {
            context: format!("applying {}", policy_name(p)),
            source,
        })?;
        writeln_flush(out, &format!("  networkpolicy {} applied", policy_name(p)));
    }
    let after = observe_until(&runner, opts.protocol, opts.port, &expected_after, opts.deadline)?;
    writeln_flush(
        out,
        &format!(
            "{AFTER_MARKER}{FIRST_EXAMPLE} ({proto_name}/{})\n{}",
            opts.port,
            after.render()
        ),
    );
    if stop_requested() {
        return Err(DemoError::Interrupted("the AFTER probe"));
    }
    let outcome = DemoOutcome {
        before,
        after,
        expected_after,
    };
    report_expectation(out, &outcome.expected_after, &outcome.after);
    if let Some(msg) = runner.agent_exited() {
        writeln_flush(out, &format!("npm-demo: the agent is not running: {msg}"));
    }

    if !opts.once {
        watch(&mut runner, opts, outcome.after.clone(), out)?;
    }
    writeln_flush(
        out,
        "npm-demo: tearing down (agent, netns cluster, pins, API server, kubeconfig)",
    );
    runner.shutdown()?;
    drop(_files);
    writeln_flush(out, "npm-demo: done");
    Ok(outcome)
}

/// The name of a protocol as NetworkPolicy spells it.
pub fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    }
}

/// Parses `TCP`, `UDP` or `SCTP` (any case).
pub fn parse_protocol(s: &str) -> Result<Protocol, DemoError> {
    match s.to_ascii_uppercase().as_str() {
        "TCP" => Ok(Protocol::Tcp),
        "UDP" => Ok(Protocol::Udp),
        "SCTP" => Ok(Protocol::Sctp),
        _ => Err(DemoError::Option {
            option: "--protocol",
            message: format!("{s:?}: want TCP, UDP or SCTP"),
        }),
    }
}

fn report_expectation(out: &mut dyn Write, expected: &Matrix, observed: &Matrix) {
    let mism = expected.compare(observed);
    if mism.is_empty() {
        writeln_flush(out, "npm-demo: matches npm-policy's reference evaluator");
    } else {
        let mut s = format!(
            "npm-demo: {} cells differ from npm-policy's reference evaluator, which expects:\n{}",
            mism.len(),
            expected.render()
        );
        for m in &mism {
            s.push_str(&format!("  {m}\n"));
        }
        writeln_flush(out, &s);
    }
}

fn engine_name(e: Engine) -> &'static str {
    match e {
        Engine::Ebpf => "ebpf",
        Engine::Nftables => "nftables",
        Engine::Simulate => "simulate",
    }
}

fn watch(runner: &mut LiveRunner, opts: &DemoOptions, mut last: Matrix, out: &mut dyn Write) -> Result<(), DemoError> {
    writeln_flush(
        out,
        &format!(
            "npm-demo: watching: probing every {}s, printing the matrix when it changes (Ctrl-C to stop)",
            opts.watch.as_secs_f64()
        ),
    );
    let mut last_policies: Vec<String> = list_policies(runner)?.iter().map(policy_name).collect();
    while !stop_requested() {
        let end = Instant::now() + opts.watch;
        while Instant::now() < end && !stop_requested() {
            std::thread::sleep(Duration::from_millis(100));
        }
        if stop_requested() {
            break;
        }
        let others = other_live_clusters();
        if !others.is_empty() {
            writeln_flush(
                out,
                &format!(
                    "[{}] warning: another netns cluster (pids {others:?}) uses the same pod addresses; probes may be wrong",
                    now_utc()
                ),
            );
        }
        let policies = list_policies(runner)?;
        let names: Vec<String> = policies.iter().map(policy_name).collect();
        let mut m = observe(runner, opts.protocol, opts.port)?;
        // A change may be caught half-way through the agent's update:
        // report it once two consecutive rounds agree.
        for _ in 0..5 {
            if m == last || stop_requested() {
                break;
            }
            std::thread::sleep(Duration::from_millis(500));
            let again = observe(runner, opts.protocol, opts.port)?;
            if again == m {
                break;
            }
            m = again;
        }
        if m == last && names == last_policies {
            continue;
        }
        if m == last {
            writeln_flush(
                out,
                &format!(
                    "[{}] policies now: {} (matrix unchanged)",
                    now_utc(),
                    if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    }
                ),
            );
        } else {
            writeln_flush(
                out,
                &format!(
                    "{CHANGED_MARKER}[{}] ({}/{}) policies: {}\n{}",
                    now_utc(),
                    protocol_name(opts.protocol),
                    opts.port,
                    if names.is_empty() {
                        "none".into()
                    } else {
                        names.join(", ")
                    },
                    m.render()
                ),
            );
            match expected_matrix(&policies, opts.protocol, opts.port) {
                Ok(exp) => report_expectation(out, &exp, &m),
                Err(e) => writeln_flush(out, &format!("npm-demo: no reference expectation: {e}")),
            }
        }
        if let Some(msg) = runner.agent_exited() {
            writeln_flush(out, &format!("npm-demo: the agent is not running: {msg}"));
        }
        last = m;
        last_policies = names;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn examples() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples")
    }

    fn tmp_file(name: &str, text: &str) -> PathBuf {
        let p = std::env::temp_dir().join(format!("npm-demo-unit-{}-{name}", std::process::id()));
        std::fs::write(&p, text).expect("write");
        p
    }

    #[test]
    fn example_01_expectation_is_the_documented_one() {
        let pols = read_policies(&examples().join(FIRST_EXAMPLE)).expect("example 01");
        assert_eq!(pols.len(), 2);
        let m = expected_matrix(&pols, Protocol::Tcp, 80).expect("matrix");
        // The diagonal (a pod to itself) is not probed.
        for r in &m.rows {
            for c in m.columns.iter().filter(|c| *c != r) {
                let want = match c.as_str() {
                    "x/b" | "x/c" => false,
                    "x/a" => r.starts_with("y/"),
                    _ => true,
                };
                assert_eq!(m.get(r, c), Some(want), "{r} -> {c}");
            }
        }
        // Port 81 is not opened by allow-y-to-a: all of x is isolated.
        let m81 = expected_matrix(&pols, Protocol::Tcp, 81).expect("matrix");
        assert_eq!(m81.get("y/a", "x/a"), Some(false));
        assert_eq!(m81.get("y/a", "z/a"), Some(true));
    }

    #[test]
    fn example_02_blocks_y_except_to_z() {
        let mut pols = read_policies(&examples().join(FIRST_EXAMPLE)).expect("example 01");
        pols.extend(read_policies(&examples().join(SECOND_EXAMPLE)).expect("example 02"));
        let m = expected_matrix(&pols, Protocol::Tcp, 80).expect("matrix");
        assert_eq!(m.get("y/a", "x/a"), Some(false));
        assert_eq!(m.get("y/a", "y/b"), Some(false));
        assert_eq!(m.get("y/a", "z/c"), Some(true));
        assert_eq!(m.get("z/a", "y/b"), Some(true));
    }

    #[test]
    fn bad_example_files_are_clear_errors() {
        let p = tmp_file("pod.yaml", "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\n");
        let e = read_policies(&p).expect_err("a Pod").to_string();
        assert!(e.contains("document 1") && e.contains("kind NetworkPolicy"), "{e}");
        let p2 = tmp_file("empty.yaml", "# nothing\n");
        let e = read_policies(&p2).expect_err("empty").to_string();
        assert!(e.contains("no NetworkPolicy"), "{e}");
        let p3 = tmp_file(
            "noname.yaml",
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {namespace: x}\nspec: {podSelector: {}}\n---\n",
        );
        let e = read_policies(&p3).expect_err("no name").to_string();
        assert!(e.contains("metadata.name"), "{e}");
        let e = read_policies(Path::new("/nonexistent/npm-demo.yaml"))
            .expect_err("missing")
            .to_string();
        assert!(e.contains("/nonexistent/npm-demo.yaml"), "{e}");
        for f in [p, p2, p3] {
            let _ = std::fs::remove_file(f);
        }
    }

    #[test]
    fn protocol_names() {
        assert_eq!(parse_protocol("tcp").expect("tcp"), Protocol::Tcp);
        assert_eq!(parse_protocol("SCTP").expect("sctp"), Protocol::Sctp);
        assert!(parse_protocol("icmp")
            .expect_err("icmp")
            .to_string()
            .contains("--protocol"));
        assert_eq!(protocol_name(Protocol::Udp), "UDP");
    }

    #[test]
    fn missing_agent_is_a_prerequisite_error() {
        let opts = DemoOptions {
            agent_bin: PathBuf::from("/nonexistent/npm-agent"),
            examples: examples(),
            ..DemoOptions::default()
        };
        let mut out = Vec::new();
        let e = run(&opts, &mut out).expect_err("no agent").to_string();
        assert!(e.contains("/nonexistent/npm-agent"), "{e}");
    }
}
