//! The conformance runner: loads case files, runs them on the simulator or
//! on the netns cluster enforced by the real agent, prints each case's
//! result and a final `N passed, M failed` line.
//!
//! Live mode: the test API server runs in-process; the cluster (upstream
//! model x,y,z / a,b,c) is built once and published to it; the agent binary
//! is started with `NODE_NAME`, a generated kubeconfig and a unique pin dir.
//! Each case starts from the pristine model: the runner keeps an
//! `npm_sim::cases::Model` in step with the live cluster, and before a
//! case brings the live objects back to `Model::upstream()` (policies
//! deleted, labels restored, extra pods and namespaces deleted, missing ones
//! recreated at their pristine addresses).
//!
//! Multi-node live mode (`--nodes N`, `--cni ptp|bridge`, `--kube-proxy`,
//! [`Options::multi_node`]): N node netns on a routed fabric
//! ([`crate::nodes`]), one agent per node inside the node's netns and
//! mount namespace, pods on the node owning their namespace's subnet
//! (hand-made veths or the CNI chain of [`crate::cni`]), Node objects, and
//! with a kube-proxy the per-pod Services `s-<ns>-<pod>`
//! (`--destination service` probes their ClusterIPs).

//!
//! Layout: `cases` loads the case files; `live` is the [`LiveRunner`]
//! (its agent process, the model-to-cluster step and the probing with the
//! matrix comparison); this module has the options, the engines and the
//! reporting of a run.

mod cases;
mod live;

use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use npm_sim::cases::{self as case_format, Case};

use crate::api::ApiError;
use crate::cluster::ClusterError;

pub use cases::{case_files, load_cases, parse_text, remap_cidr_placeholders_v6, v6_prefix_for_v4, LoadedCase};
pub use live::{preload_ip, preload_pod, preload_policy, LiveRunner, Preload, WiredTimes, PRELOAD_NAMESPACES};

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
        source: case_format::CaseError,
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
    /// The options do not fit together.
    #[error("options: {0}")]
    Options(String),
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

    /// Parses a real agent's dataplane (`ebpf` or `nftables`) for the
    /// program `prog`; otherwise the message it exits with.
    pub fn parse_live(prog: &str, s: &str) -> Result<Engine, String> {
        match Engine::parse(s) {
            Some(e @ (Engine::Ebpf | Engine::Nftables)) => Ok(e),
            _ => Err(format!("{prog}: --dataplane must be ebpf or nftables, not {s:?}")),
        }
    }
}

/// How pods are wired (`--cni`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CniMode {
    /// Hand-made veths with /32 routes (today's default).
    Veth,
    /// The reference `ptp` plugin, host-local IPAM, then npm-cni.
    Ptp,
    /// The reference `bridge` plugin, host-local IPAM, then npm-cni.
    Bridge,
}

impl CniMode {
    /// Parses `veth`, `ptp` or `bridge`.
    pub fn parse(s: &str) -> Option<CniMode> {
        match s {
            "veth" => Some(CniMode::Veth),
            "ptp" => Some(CniMode::Ptp),
            "bridge" => Some(CniMode::Bridge),
            _ => None,
        }
    }
}

/// The kube-proxy emulation programmed on each node (`--kube-proxy`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KubeProxyMode {
    /// No kube-proxy (today's default).
    None,
    /// kube-proxy's iptables mode.
    Iptables,
    /// kube-proxy's nftables mode.
    Nftables,
}

impl KubeProxyMode {
    /// Parses `none`, `iptables` or `nftables`.
    pub fn parse(s: &str) -> Option<KubeProxyMode> {
        match s {
            "none" => Some(KubeProxyMode::None),
            "iptables" => Some(KubeProxyMode::Iptables),
            "nftables" => Some(KubeProxyMode::Nftables),
            _ => None,
        }
    }
}

/// What a probe connects to (`--destination`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Destination {
    /// The destination pod's address.
    Pod,
    /// The ClusterIP of the pod's Service `s-<ns>-<pod>`.
    Service,
}

impl Destination {
    /// Parses `pod` or `service`.
    pub fn parse(s: &str) -> Option<Destination> {
        match s {
            "pod" => Some(Destination::Pod),
            "service" => Some(Destination::Service),
            _ => None,
        }
    }
}

/// The fabric between nodes (`--fabric`): routed, or VXLAN with pod MTU 1450.
pub use crate::nodes::Fabric as FabricMode;

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
    /// Extra environment variables of the agents (the chaos soak's fault
    /// injection: `NPM_TEST_SKIP_DELETE`).
    pub agent_env: Vec<(String, String)>,
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
    /// come up), and of the kube-proxies' first sync (at least 20 s).
    pub startup_deadline: Duration,
    /// Nodes (1: the root netns is the only node, as before).
    pub nodes: usize,
    /// How pods are wired.
    pub cni: CniMode,
    /// The npm-cni binary (CNI wiring).
    pub npm_cni_bin: PathBuf,
    /// The kube-proxy emulation.
    pub kube_proxy: KubeProxyMode,
    /// What probes connect to.
    pub destination: Destination,
    /// The fabric between nodes.
    pub fabric: FabricMode,
    /// Objects written into the API server before the agents start (the
    /// enforcement bench's 100,000 pods; multi-node runs only).
    pub preload: Preload,
    /// Node agents' restarts across a map-layout change (multi-node runs):
    /// the first agents pin under `<pin dir>/v<LAYOUT_VERSION + 1>`, a
    /// restarted one under `<pin dir>/v<LAYOUT_VERSION>`, which finds the
    /// other layout beside it (copies its conntrack, adopts its endpoint
    /// numbers and retires it after its first full sync, as after an
    /// upgrade or a rollback; the other layout's records are this
    /// layout's, as from a rollback).
    pub pin_layout_change: bool,
}

impl Options {
    /// Whether the cluster is built of node netns ([`crate::nodes`]) rather
    /// than the single root-netns node: more than one node, CNI wiring or
    /// a kube-proxy.
    pub fn multi_node(&self) -> bool {
        self.nodes > 1 || self.cni != CniMode::Veth || self.kube_proxy != KubeProxyMode::None
    }
}

impl Default for Options {
    fn default() -> Self {
        Options {
            engine: Engine::Simulate,
            cases: vec![],
            filter: None,
            agent_bin: PathBuf::from("target/debug/npm-agent"),
            agent_args: vec![],
            agent_env: vec![],
            ipv6: false,
            probe_timeout: Duration::from_secs(1),
            deadline: Duration::from_secs(10),
            threads: 32,
            settle: Duration::from_millis(500),
            startup_deadline: Duration::from_secs(30),
            nodes: 1,
            cni: CniMode::Veth,
            npm_cni_bin: PathBuf::from("target/debug/npm-cni"),
            kube_proxy: KubeProxyMode::None,
            destination: Destination::Pod,
            fabric: FabricMode::Routed,
            preload: Preload::default(),
            pin_layout_change: false,
        }
    }
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
        let r = case_format::run_case_simulated(&lc.case);
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
    let workdir = runner.workdir().to_path_buf();
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
    fn engine_names() {
        assert_eq!(Engine::parse("simulate"), Some(Engine::Simulate));
        assert_eq!(Engine::parse("ebpf"), Some(Engine::Ebpf));
        assert_eq!(Engine::parse("nftables"), Some(Engine::Nftables));
        assert_eq!(Engine::parse("iptables"), None);
    }
}
