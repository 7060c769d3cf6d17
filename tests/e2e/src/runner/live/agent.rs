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
}
