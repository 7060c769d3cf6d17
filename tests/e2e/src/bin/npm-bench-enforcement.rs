//! `npm-bench-enforcement`: enforcement latency as packets see it, and how
//! long npm-cni holds CNI ADD (`npm_e2e::enforcement` says how).
//!
//! ```text
//! npm-bench-enforcement [--dataplane ebpf|nftables] [--pods N] [--policies M]
//!                       [--pairs P] [--interval-ms MS] [--probe-timeout-ms MS]
//!                       [--changes N] [--new-pods N] [--churn-rate N]
//!                       [--agent-bin PATH] [--npm-cni-bin PATH]
//! ```
//! Ends with one JSON line (`"bench":"enforcement"`); exits 1 when a
//! change or a new pod was not observed within the deadline.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use npm_e2e::enforcement::{self, EnforcementOptions};
use npm_e2e::runner::Engine;

/// Enforcement latency seen by probes, and npm-cni's hold of CNI ADD.
#[derive(Debug, Parser)]
#[command(name = "npm-bench-enforcement")]
struct Cli {
    /// ebpf or nftables.
    #[arg(long, default_value = "ebpf")]
    dataplane: String,
    /// Pods preloaded in the API server (remote, as `bench agent`'s).
    #[arg(long, default_value_t = 100_000)]
    pods: usize,
    /// NetworkPolicies preloaded.
    #[arg(long, default_value_t = 10_000)]
    policies: usize,
    /// Probed pairs of the policy changes (1..=36).
    #[arg(long, default_value_t = 8)]
    pairs: usize,
    /// Probe interval of each pair (ms): the resolution.
    #[arg(long, default_value_t = 10)]
    interval_ms: u64,
    /// A connect not completed within this is a deny (ms).
    #[arg(long, default_value_t = 250)]
    probe_timeout_ms: u64,
    /// Policy changes per phase (idle, then under churn).
    #[arg(long, default_value_t = 200)]
    changes: usize,
    /// New pods per phase.
    #[arg(long, default_value_t = 20)]
    new_pods: usize,
    /// API writes a second of the churn phase.
    #[arg(long, default_value_t = 100)]
    churn_rate: u32,
    /// Pause between policy writes (ms).
    #[arg(long, default_value_t = 100)]
    op_gap_ms: u64,
    /// The agent binary.
    #[arg(long, default_value = "target/release/npm-agent")]
    agent_bin: PathBuf,
    /// The npm-cni binary.
    #[arg(long, default_value = "target/release/npm-cni")]
    npm_cni_bin: PathBuf,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(engine) = Engine::parse(&cli.dataplane).filter(|e| *e != Engine::Simulate) else {
        eprintln!(
            "npm-bench-enforcement: --dataplane {:?}: use ebpf or nftables",
            cli.dataplane
        );
        return ExitCode::FAILURE;
    };
    let opts = EnforcementOptions {
        engine,
        agent_bin: cli.agent_bin,
        npm_cni_bin: cli.npm_cni_bin,
        pods: cli.pods,
        policies: cli.policies,
        pairs: cli.pairs,
        interval: Duration::from_millis(cli.interval_ms.max(1)),
        probe_timeout: Duration::from_millis(cli.probe_timeout_ms.max(1)),
        changes: cli.changes,
        new_pods: cli.new_pods,
        churn_rate: cli.churn_rate,
        op_gap: Duration::from_millis(cli.op_gap_ms),
        ..EnforcementOptions::default()
    };
    let mut err = std::io::stderr();
    match enforcement::run(&opts, &mut err) {
        Ok(report) => {
            println!("{}", report.json_line());
            if report.missed() > 0 {
                eprintln!(
                    "npm-bench-enforcement: {} changes or pods not observed within the deadline",
                    report.missed()
                );
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("npm-bench-enforcement: {e}");
            ExitCode::FAILURE
        }
    }
}
