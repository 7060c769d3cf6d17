//! `npm-demo`: the local demo (`cargo xtask demo`). Starts the test API
//! server, the 3x3 netns cluster (namespaces x,y,z; pods a,b,c) and the
//! agent; prints the reachability matrix before and after
//! `examples/01-default-deny-ingress-x.yaml`; then re-probes every
//! `--watch-secs` and prints the matrix whenever it changes, until Ctrl-C,
//! which tears everything down.
//!
//! ```text
//! npm-demo --agent-bin PATH --examples DIR [--dataplane ebpf|nftables]
//!          [--state-dir DIR] [--port 80] [--protocol TCP] [--watch-secs 5]
//!          [--once] [--nodes N] [--cni veth|ptp|bridge] [--npm-cni-bin PATH]
//! ```
//! Exit status: 0 when the matrices are as expected (with `--once`) or after
//! Ctrl-C; 1 when the BEFORE/AFTER matrices differ from the expectation
//! (`--once`); 2 on errors; 130 when interrupted before the watch loop.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use npm_e2e::demo::{self, DemoOptions};
use npm_e2e::runner::Engine;

/// The npm local demo: a netns cluster enforced by the real agent.
#[derive(Debug, Parser)]
#[command(name = "npm-demo")]
struct Cli {
    /// The agent binary.
    #[arg(long, default_value = "target/debug/npm-agent")]
    agent_bin: PathBuf,
    /// The examples directory.
    #[arg(long, default_value = "examples")]
    examples: PathBuf,
    /// ebpf or nftables.
    #[arg(long, default_value = "ebpf")]
    dataplane: String,
    /// Where the kubeconfig is written.
    #[arg(long, default_value = ".npm-demo")]
    state_dir: PathBuf,
    /// Probed port.
    #[arg(long, default_value_t = 80)]
    port: u16,
    /// Probed protocol: TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    protocol: String,
    /// Seconds between two watch rounds.
    #[arg(long, default_value_t = 5)]
    watch_secs: u64,
    /// Stop after the AFTER matrix; exit 0 only when BEFORE is all
    /// reachable and AFTER is the expected matrix.
    #[arg(long)]
    once: bool,
    /// Seconds to wait for the cluster/agent to reach an expected matrix.
    #[arg(long, default_value_t = 30)]
    deadline_secs: u64,
    /// Nodes: 1 is the root netns alone; more are node netns on a routed
    /// fabric, each with its own agent.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// How pods are wired: veth, ptp or bridge.
    #[arg(long, default_value = "veth")]
    cni: String,
    /// The npm-cni binary (with --cni ptp|bridge).
    #[arg(long, default_value = "target/debug/npm-cni")]
    npm_cni_bin: PathBuf,
    /// Seconds to wait for another process's netns cluster (same pod
    /// addresses) to finish before starting.
    #[arg(long, default_value_t = 600)]
    wait_secs: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let engine = match Engine::parse_live("npm-demo", &cli.dataplane) {
        Ok(e) => e,
        Err(message) => {
            eprintln!("{message}");
            return ExitCode::from(2);
        }
    };
    let protocol = match demo::parse_protocol(&cli.protocol) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("npm-demo: {e}");
            return ExitCode::from(2);
        }
    };
    let Some(cni) = npm_e2e::runner::CniMode::parse(&cli.cni) else {
        eprintln!("npm-demo: --cni must be veth, ptp or bridge, not {:?}", cli.cni);
        return ExitCode::from(2);
    };
    if !(1..=9).contains(&cli.nodes) {
        eprintln!("npm-demo: --nodes must be between 1 and 9, not {}", cli.nodes);
        return ExitCode::from(2);
    }
    let opts = DemoOptions {
        agent_bin: cli.agent_bin,
        examples: cli.examples,
        engine,
        state_dir: cli.state_dir,
        port: cli.port,
        protocol,
        watch: Duration::from_secs(cli.watch_secs.max(1)),
        once: cli.once,
        deadline: Duration::from_secs(cli.deadline_secs.max(1)),
        exclusive_wait: Duration::from_secs(cli.wait_secs),
        nodes: cli.nodes,
        cni,
        npm_cni_bin: cli.npm_cni_bin,
    };
    demo::install_stop_handler();
    let mut out = std::io::stdout();
    match demo::run(&opts, &mut out) {
        Ok(outcome) if !opts.once || outcome.passed() => ExitCode::SUCCESS,
        Ok(_) => {
            eprintln!("npm-demo: the observed matrices differ from the expected ones (see above)");
            ExitCode::from(1)
        }
        Err(e @ demo::DemoError::Interrupted(_)) => {
            eprintln!("npm-demo: {e}");
            ExitCode::from(130)
        }
        Err(e) => {
            eprintln!("npm-demo: {e}");
            ExitCode::from(2)
        }
    }
}
