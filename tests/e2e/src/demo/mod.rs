//! The local demo (`cargo xtask demo`, binary `npm-demo`): the in-process
//! test API server, the 3x3 netns cluster of the upstream model and the real
//! agent, started by [`LiveRunner`]. The demo prints the reachability matrix
//! before any policy, applies `01-default-deny-ingress-x.yaml` from the
//! examples directory, prints the matrix after enforcement, then (unless
//! `once`) re-probes every few seconds and prints the matrix whenever it
//! changes, so that `kubectl apply/delete` against the printed kubeconfig
//! shows enforcement change live. SIGINT/SIGTERM tear everything down.
//!
//! Layout: `expect` reads the example policies and computes the
//! expected matrices, `observe` probes the live cluster, `host` checks
//! the host (prerequisites, other clusters, leftovers); this module runs the
//! demo and its watch loop.

mod expect;
mod host;
mod observe;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use npm_policy::model::Protocol;
use npm_sim::cases::Matrix;

use crate::api::ApiError;
use crate::runner::{Engine, LiveRunner, Options, RunnerError};

use expect::all_reachable;
use host::{check_prerequisites, wait_exclusive};
use observe::policy_name;

pub use expect::{expected_matrix, model_pods, parse_protocol, protocol_name, read_policies};
pub use host::{clear_leftovers, other_live_clusters};
pub use observe::{list_policies, observe, observe_until};

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
    /// Nodes (1: the root netns, as before; more: node netns on a fabric,
    /// one agent each; see [`crate::nodes`]).
    pub nodes: usize,
    /// How pods are wired (hand-made veths, or the reference CNI plugins
    /// chained with npm-cni).
    pub cni: crate::runner::CniMode,
    /// The npm-cni binary (CNI wiring).
    pub npm_cni_bin: PathBuf,
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
            nodes: 1,
            cni: crate::runner::CniMode::Veth,
            npm_cni_bin: PathBuf::from("target/debug/npm-cni"),
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
        nodes: opts.nodes,
        cni: opts.cni,
        npm_cni_bin: opts.npm_cni_bin.clone(),
        ..Options::default()
    })?;
    if stop_requested() {
        return Err(DemoError::Interrupted("startup"));
    }
    std::fs::create_dir_all(&opts.state_dir).map_err(|source| DemoError::Io {
        path: opts.state_dir.clone(),
        source,
    })?;
    // The kubeconfig of a user granted `pods/portforward` to the agent
    // pods registered as the chart's: `kubectl npm` works as in a cluster.
    crate::plugin::register(&runner, &kubeconfig).map_err(|message| DemoError::Io {
        path: kubeconfig.clone(),
        source: std::io::Error::other(message),
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
    writeln_flush(
        out,
        &format!(
            "  kubectl --kubeconfig {} npm why y/a x/b --port {}    # kubectl-npm on PATH; also: npm status, npm observe",
            shown(&kubeconfig),
            opts.port
        ),
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

    #[test]
    fn missing_agent_is_a_prerequisite_error() {
        let opts = DemoOptions {
            agent_bin: PathBuf::from("/nonexistent/npm-agent"),
            examples: Path::new(env!("CARGO_MANIFEST_DIR")).join("../../examples"),
            ..DemoOptions::default()
        };
        let mut out = Vec::new();
        let e = run(&opts, &mut out).expect_err("no agent").to_string();
        assert!(e.contains("/nonexistent/npm-agent"), "{e}");
    }
}
