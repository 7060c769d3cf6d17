//! `npm-conformance`: runs the NetworkPolicy conformance catalogue on the
//! simulator or on real network-namespace pods enforced by the real agent.
//!
//! ```text
//! npm-conformance [--dataplane ebpf|nftables|simulate] [--cases PATH]...
//!                 [--filter ID] [--agent-bin PATH] [--ipv6]
//!                 [--nodes N] [--cni veth|ptp|bridge] [--npm-cni-bin PATH]
//!                 [--kube-proxy none|iptables|nftables] [--destination pod|service]
//!                 [--fabric routed|vxlan]
//! ```
//! Without the node flags the cluster is today's: one node (the root
//! netns), hand-made veths, probes to pod addresses.
//! Prints each case's result and, last, exactly `N passed, M failed`; exits
//! non-zero when a case fails.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;
use npm_e2e::runner::{self, CniMode, Destination, Engine, FabricMode, KubeProxyMode, Options};

/// Runs the NetworkPolicy conformance catalogue.
#[derive(Debug, Parser)]
#[command(name = "npm-conformance")]
struct Cli {
    /// ebpf, nftables or simulate.
    #[arg(long, default_value = "ebpf")]
    dataplane: String,
    /// Case files or directories (default: tests/conformance).
    #[arg(long = "cases")]
    cases: Vec<PathBuf>,
    /// Run only the cases whose id contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// The agent binary.
    #[arg(long, default_value = "target/debug/npm-agent")]
    agent_bin: PathBuf,
    /// Extra argument for `npm-agent run` (repeatable).
    #[arg(long = "agent-arg", allow_hyphen_values = true)]
    agent_args: Vec<String>,
    /// Probe the pods' IPv6 addresses.
    #[arg(long)]
    ipv6: bool,
    /// Seconds a probe matrix is retried until it matches; also, at least
    /// 30, the startup waits (the agents' readiness, the first probe, the
    /// test kube-proxies' first sync).
    #[arg(long, default_value_t = 10)]
    deadline_secs: u64,
    /// Milliseconds of one probe attempt.
    #[arg(long, default_value_t = 1000)]
    probe_timeout_ms: u64,
    /// Probe threads.
    #[arg(long, default_value_t = 32)]
    threads: usize,
    /// Milliseconds to wait after a step's actions and before the
    /// confirmation round of a matching matrix.
    #[arg(long, default_value_t = 500)]
    settle_ms: u64,
    /// Nodes: 1 is the root netns alone (as before); more are node netns
    /// on a fabric, each with its own agent.
    #[arg(long, default_value_t = 1)]
    nodes: usize,
    /// How pods are wired: veth (hand-made), ptp or bridge (the reference
    /// CNI plugins chained with npm-cni).
    #[arg(long, default_value = "veth")]
    cni: String,
    /// The npm-cni binary (with --cni ptp|bridge).
    #[arg(long, default_value = "target/debug/npm-cni")]
    npm_cni_bin: PathBuf,
    /// The kube-proxy emulation on each node: none, iptables or nftables.
    #[arg(long, default_value = "none")]
    kube_proxy: String,
    /// What probes connect to: pod (its address) or service (the ClusterIP
    /// of its Service `s-<ns>-<pod>`).
    #[arg(long, default_value = "pod")]
    destination: String,
    /// The fabric between nodes: routed (no overlay) or vxlan (an overlay
    /// with MTU 1450; pods get MTU 1450).
    #[arg(long, default_value = "routed")]
    fabric: String,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(engine) = Engine::parse(&cli.dataplane) else {
        eprintln!(
            "npm-conformance: --dataplane must be ebpf, nftables or simulate, not {:?}",
            cli.dataplane
        );
        return ExitCode::from(2);
    };
    let (Some(cni), Some(kube_proxy), Some(destination)) = (
        CniMode::parse(&cli.cni),
        KubeProxyMode::parse(&cli.kube_proxy),
        Destination::parse(&cli.destination),
    ) else {
        eprintln!(
            "npm-conformance: --cni must be veth|ptp|bridge, --kube-proxy none|iptables|nftables, --destination pod|service (got {:?}, {:?}, {:?})",
            cli.cni, cli.kube_proxy, cli.destination
        );
        return ExitCode::from(2);
    };
    let fabric = match cli.fabric.as_str() {
        "routed" => FabricMode::Routed,
        "vxlan" => FabricMode::Vxlan,
        other => {
            eprintln!("npm-conformance: --fabric must be routed or vxlan, not {other:?}");
            return ExitCode::from(2);
        }
    };
    if !(1..=9).contains(&cli.nodes) {
        eprintln!("npm-conformance: --nodes must be between 1 and 9, not {}", cli.nodes);
        return ExitCode::from(2);
    }
    let cases = if cli.cases.is_empty() {
        vec![PathBuf::from("tests/conformance")]
    } else {
        cli.cases
    };
    let opts = Options {
        engine,
        cases,
        filter: cli.filter,
        agent_bin: cli.agent_bin,
        agent_args: cli.agent_args,
        agent_env: vec![],
        ipv6: cli.ipv6,
        probe_timeout: Duration::from_millis(cli.probe_timeout_ms),
        deadline: Duration::from_secs(cli.deadline_secs),
        threads: cli.threads,
        settle: Duration::from_millis(cli.settle_ms),
        startup_deadline: Duration::from_secs(cli.deadline_secs.max(30)),
        nodes: cli.nodes,
        cni,
        npm_cni_bin: cli.npm_cni_bin,
        kube_proxy,
        destination,
        fabric,
        preload: Default::default(),
        pin_layout_change: false,
    };
    let mut out = std::io::stdout();
    match runner::run(&opts, &mut out) {
        Ok(s) if s.failed() == 0 => ExitCode::SUCCESS,
        Ok(_) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("npm-conformance: {e}");
            println!("0 passed, 1 failed");
            ExitCode::FAILURE
        }
    }
}
