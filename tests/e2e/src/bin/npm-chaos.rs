//! `npm-chaos`: the chaos soak (see `npm_e2e::chaos`) on the two-node
//! netns cluster with the real agents.
//!
//! ```text
//! npm-chaos --dataplane ebpf|nftables [--duration SECS] [--seed N]
//!           [--inject] [--agent-bin PATH] [--npm-cni-bin PATH]
//! ```
//! Prints the schedule as it runs, each violation and liveness failure
//! (seed, probe, legal states, disturbances, the replay command) and, last,
//! one JSON line (`"bench":"chaos"`). Exits non-zero on a violation or a
//! liveness failure (with `--inject`: when there is no violation).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use npm_e2e::chaos::{self, oracle::Bounds, ChaosOptions};
use npm_e2e::runner::Engine;

/// Runs the chaos soak.
#[derive(Debug, Parser)]
#[command(name = "npm-chaos")]
struct Cli {
    /// ebpf or nftables.
    #[arg(long, default_value = "ebpf")]
    dataplane: String,
    /// Seconds of schedule.
    #[arg(long, default_value_t = 120)]
    duration: u64,
    /// The seed (default: drawn from the clock and printed).
    #[arg(long)]
    seed: Option<u64>,
    /// Fault injection: the agents drop every NetworkPolicy watch delete;
    /// the oracle must report violations.
    #[arg(long)]
    inject: bool,
    /// `TICK:NODE`: a `kill -9` of node NODE's agent at second TICK, beside
    /// the drawn steps (its restart changes the node's map layout when it
    /// is the node's first).
    #[arg(long, value_parser = parse_kill_at)]
    kill_at: Option<(u64, u8)>,
    /// `TICK:NODE`: from second TICK, npm-cni's ADD of a pod at a freed
    /// address of node NODE times out with the node's agent stopped, beside
    /// the drawn steps; the address then goes to another pod.
    #[arg(long, value_parser = parse_kill_at)]
    cni_timeout_at: Option<(u64, u8)>,
    /// The agent binary.
    #[arg(long, default_value = "target/debug/npm-agent")]
    agent_bin: PathBuf,
    /// The npm-cni binary.
    #[arg(long, default_value = "target/debug/npm-cni")]
    npm_cni_bin: PathBuf,
}

fn parse_kill_at(s: &str) -> Result<(u64, u8), String> {
    let (t, n) = s.split_once(':').ok_or("expected TICK:NODE")?;
    let t = t.parse().map_err(|e| format!("tick: {e}"))?;
    let n = n.parse().map_err(|e| format!("node: {e}"))?;
    Ok((t, n))
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let engine = match Engine::parse_live("npm-chaos", &cli.dataplane) {
        Ok(e) => e,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let seed = cli.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or(1)
    });
    let opts = ChaosOptions {
        engine,
        duration: cli.duration,
        seed,
        agent_bin: cli.agent_bin,
        npm_cni_bin: cli.npm_cni_bin,
        inject: cli.inject,
        bounds: Bounds::default(),
        kill_at: cli.kill_at,
        cni_timeout_at: cli.cni_timeout_at,
    };
    let mut out = std::io::stdout();
    match chaos::run(&opts, &mut out) {
        Ok(r) => {
            println!("{}", r.json_line());
            let failed = if cli.inject {
                r.violations == 0
            } else {
                r.violations > 0 || r.liveness_failures > 0
            };
            if failed {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
        Err(e) => {
            eprintln!("npm-chaos: {e}");
            ExitCode::FAILURE
        }
    }
}
