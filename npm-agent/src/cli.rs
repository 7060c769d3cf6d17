//! The command line of the `npm-agent` binary (a module of `main.rs`, not
//! of the library): flags, environment variables and defaults of each
//! subcommand, and the agent settings `run`'s flags stand for.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand, ValueEnum};
use npm_agent::agent::AgentConfig;
use npm_agent::dataplanes::{DataplaneKind, DataplaneOptions};
use npm_agent::reconcile::SyncConfig;
use npm_policy::compiled::CompileOptions;

#[derive(Parser)]
#[command(name = "npm-agent", version, about = "npm NetworkPolicy node agent")]
pub struct Cli {
    /// Log level (a tracing filter such as `info` or `npm_agent=debug`).
    #[arg(long, env = "NPM_LOG_LEVEL", default_value = "info", global = true)]
    pub log_level: String,
    /// Log format.
    #[arg(long, env = "NPM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum LogFormat {
    Json,
    Text,
}

#[derive(Subcommand)]
pub enum Command {
    /// Run the agent (the DaemonSet's command).
    Run(RunArgs),
    /// Print what the eBPF dataplane of this node has pinned.
    Inspect(InspectArgs),
    /// Reachability matrix of YAML objects, by the compiler's simulator
    /// (the reference evaluator of npm-policy; no kernel, no API server).
    Simulate(SimulateArgs),
}

#[derive(Parser)]
pub struct RunArgs {
    /// This node's name (pods with this spec.nodeName are local endpoints).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,
    /// Kubeconfig file; without it, in-cluster config (or $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    pub kubeconfig: Option<PathBuf>,
    /// Which dataplane programs the kernel.
    #[arg(long, env = "NPM_DATAPLANE", value_enum, default_value_t = DataplaneKind::Ebpf)]
    pub dataplane: DataplaneKind,
    /// eBPF object (default: the loader's search path).
    #[arg(long, env = "NPM_EBPF_OBJECT")]
    pub bpf_object: Option<PathBuf>,
    /// bpffs pin directory of the eBPF dataplane.
    #[arg(long, env = "NPM_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
    /// nftables table name of the nftables dataplane.
    #[arg(long, env = "NPM_NFT_TABLE", default_value = "npm")]
    pub nft_table: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "NPM_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,
    /// LIST page size.
    #[arg(long, env = "NPM_PAGE_SIZE", default_value_t = 500)]
    pub page_size: u32,
    /// Time (ms) changes are coalesced for, after the oldest change not yet
    /// programmed, before syncing.
    #[arg(long, env = "NPM_DEBOUNCE_MS", default_value_t = npm_agent::reconcile::DEFAULT_DEBOUNCE_MS)]
    pub debounce_ms: u64,
    /// Share of identities or endpoints whose removal is held until a
    /// direct read of the API server confirms it: in one sync, or in total
    /// against the highest count programmed within the window since the
    /// last confirmation.
    #[arg(long, env = "NPM_MASS_DELETE_THRESHOLD", default_value_t = 0.5)]
    pub mass_delete_threshold: f64,
    /// Window (seconds) of the cumulative mass-deletion check: removals
    /// slower than this are not held.
    #[arg(long, env = "NPM_MASS_DELETE_WINDOW_SECS", default_value_t = 600)]
    pub mass_delete_window_secs: u64,
    /// Let egress-isolated pods reach their own node.
    #[arg(long, env = "NPM_ALLOW_HOST_EGRESS")]
    pub allow_host_egress: bool,
    /// Only interfaces matching this glob (e.g. `veth*`) are pod interfaces.
    #[arg(long, env = "NPM_INTERFACE_PATTERN")]
    pub interface_pattern: Option<String>,
    /// Deny flow log lines per second at most.
    #[arg(long, env = "NPM_FLOW_LOGS_PER_SEC", default_value_t = 10)]
    pub flow_logs_per_sec: u32,
}

#[derive(Parser)]
pub struct SimulateArgs {
    /// YAML files of Namespace, Pod and NetworkPolicy objects.
    #[arg(short = 'f', long = "file", required = true)]
    pub files: Vec<PathBuf>,
    /// Destination port.
    #[arg(long, default_value_t = 80)]
    pub port: u16,
    /// TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    pub protocol: String,
}

#[derive(Parser)]
pub struct InspectArgs {
    /// bpffs pin directory of the eBPF dataplane.
    #[arg(long, env = "NPM_PIN_DIR")]
    pub pin_dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    pub json: bool,
}

impl RunArgs {
    /// The dataplane options of the flags.
    pub fn dataplane_options(&self) -> DataplaneOptions {
        DataplaneOptions {
            bpf_object: self.bpf_object.clone(),
            pin_dir: self.pin_dir.clone(),
            nft_table: self.nft_table.clone(),
        }
    }

    /// The agent settings of the flags, with this node's addresses
    /// `node_ips`.
    pub fn agent_config(&self, node_ips: Vec<IpAddr>) -> AgentConfig {
        AgentConfig {
            sync: SyncConfig {
                compile: CompileOptions {
                    node_name: self.node_name.clone(),
                    node_ips,
                    allow_host_egress: self.allow_host_egress,
                },
                debounce: Duration::from_millis(self.debounce_ms),
                mass_delete_threshold: self.mass_delete_threshold,
                mass_delete_window: Duration::from_secs(self.mass_delete_window_secs),
                page_size: self.page_size,
                flow_logs_per_sec: self.flow_logs_per_sec,
                ..SyncConfig::default()
            },
            page_size: self.page_size,
            metrics_addr: Some(self.metrics_addr),
        }
    }
}
