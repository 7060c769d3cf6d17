//! The agent process of the live runner: started with the cluster's
//! kubeconfig, its own pin dir, nftables table and metrics address, waited
//! for until ready, stopped (SIGTERM, then SIGKILL) on drop.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use npm_sim::cases;

use super::LiveRunner;
use crate::api::{Api, ApiError};
use crate::runner::{Engine, RunnerError};

/// The agent process; killed (SIGTERM, then SIGKILL) on drop.
#[derive(Debug)]
pub(super) struct Agent {
    bin: PathBuf,
    child: Child,
    log: PathBuf,
    pub(super) metrics: SocketAddr,
    /// `/explain` and `/observe` (loopback of the agent's netns).
    pub(super) debug: SocketAddr,
    /// A node agent's own pin directory (removed after it stopped).
    pub(super) pin_dir: Option<PathBuf>,
}

/// Where and as whom an agent runs.
pub(super) struct AgentSpec<'a> {
    /// `NODE_NAME`.
    pub node_name: &'a str,
    /// The node to run in (`None`: the root netns, as the one-node cluster).
    pub node: Option<&'a crate::nodes::Node>,
    /// Pin directory.
    pub pin_dir: &'a Path,
    /// nftables table.
    pub nft_table: &'a str,
    /// Metrics/health address.
    pub metrics: SocketAddr,
    /// Log file.
    pub log: PathBuf,
}

impl Agent {
    pub(super) fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(st)) => Some(format!(
                "exited with {st}; log {}:\n{}",
                self.log.display(),
                tail(&self.log, 30)
            )),
            _ => None,
        }
    }

    /// SIGKILL, and reaped.
    pub(super) fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGSTOP (`true`) or SIGCONT (`false`): a stopped agent accepts no
    /// request (npm-cni's connections wait in the socket's backlog) and
    /// programs nothing, as an agent starved of CPU or stuck.
    pub(super) fn pause(&mut self, stop: bool) {
        if let Ok(None) = self.child.try_wait() {
            let sig = if stop { libc::SIGSTOP } else { libc::SIGCONT };
            // SAFETY: signalling the child we started, by its pid.
            unsafe { libc::kill(self.child.id() as i32, sig) };
        }
    }

    /// The process's resident set (KiB, `VmRSS`), `None` once it exited.
    pub(super) fn rss_kib(&self) -> Option<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
    }

    pub(super) fn stop(&mut self) {
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

impl LiveRunner {
    pub(super) fn start_agent(&mut self, kubeconfig: &Path) -> Result<(), RunnerError> {
        let metrics_port = free_port();
        let pin_dir = self.pin_dir.clone();
        let nft_table = self.nft_table.clone();
        let agent = self.spawn_agent(
            kubeconfig,
            AgentSpec {
                node_name: cases::MODEL_NODE,
                node: None,
                pin_dir: &pin_dir,
                nft_table: &nft_table,
                metrics: SocketAddr::from(([127, 0, 0, 1], metrics_port)),
                log: self.workdir.join("agent.log"),
            },
        )?;
        let agent = self.wait_ready(agent)?;
        self.agents.push(agent);
        Ok(())
    }

    /// Starts one agent as `spec` says (inside its node when given: the
    /// node's netns and mount namespace).
    pub(super) fn spawn_agent(&self, kubeconfig: &Path, spec: AgentSpec<'_>) -> Result<Agent, RunnerError> {
        let bin = self.opts.agent_bin.clone();
        let log = spec.log.clone();
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
        // The debug listener on the agent's loopback, on a port of its own
        // (one-node agents share the root netns with other tests).
        let debug = SocketAddr::from(([127, 0, 0, 1], free_port()));
        let bin_abs = std::fs::canonicalize(&bin).unwrap_or_else(|_| bin.clone());
        let mut cmd = match spec.node {
            Some(node) => node.command(&bin_abs),
            None => Command::new(&bin),
        };
        cmd.arg("run")
            .env("NODE_NAME", spec.node_name)
            .arg("--kubeconfig")
            .arg(kubeconfig)
            .arg("--dataplane")
            .arg(dp)
            .arg("--pin-dir")
            .arg(spec.pin_dir)
            .arg("--nft-table")
            .arg(spec.nft_table)
            .arg("--metrics-addr")
            .arg(spec.metrics.to_string())
            .arg("--debug-addr")
            .arg(debug.to_string())
            .args(&self.opts.agent_args)
            .envs(self.opts.agent_env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(logf)
            .stderr(logf2);
        let child = cmd.spawn().map_err(|e| RunnerError::Agent {
            bin: bin.clone(),
            message: format!("spawn: {e}"),
        })?;
        if let Some(node) = spec.node {
            let _ = std::fs::write(node.dir.join("agent.pid"), child.id().to_string());
        }
        Ok(Agent {
            bin,
            child,
            log,
            metrics: spec.metrics,
            debug,
            // Removed at shutdown: with layout directories, their parent.
            pin_dir: spec.node.map(|_| {
                let p = spec.pin_dir;
                let root = if self.opts.pin_layout_change {
                    p.parent().unwrap_or(p)
                } else {
                    p
                };
                root.to_path_buf()
            }),
        })
    }

    /// Waits for the agent's /readyz (all lists done, first sync applied);
    /// fails early when the agent exits.
    pub(super) fn wait_ready(&self, mut agent: Agent) -> Result<Agent, RunnerError> {
        let health = Api::new(agent.metrics);
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
        Ok(agent)
    }
}
