//! `npm-agent`: the node agent binary. Only wiring lives here; see the
//! library modules for the logic.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use npm_agent::agent::{self, AgentConfig};
use npm_agent::dataplanes::{self, DataplaneKind, DataplaneOptions};
use npm_agent::endpoints::{InterfacePattern, InterfaceResolver};
use npm_agent::metrics::Metrics;
use npm_agent::sync::SyncConfig;
use npm_policy::compiled::CompileOptions;
use tokio::signal::unix::{signal, SignalKind};

#[derive(Parser)]
#[command(name = "npm-agent", version, about = "npm NetworkPolicy node agent")]
struct Cli {
    /// Log level (a tracing filter such as `info` or `npm_agent=debug`).
    #[arg(long, env = "NPM_LOG_LEVEL", default_value = "info", global = true)]
    log_level: String,
    /// Log format.
    #[arg(long, env = "NPM_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text, global = true)]
    log_format: LogFormat,
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Json,
    Text,
}

#[derive(Subcommand)]
enum Command {
    /// Run the agent (the DaemonSet's command).
    Run(RunArgs),
    /// Print what the eBPF dataplane of this node has pinned.
    Inspect(InspectArgs),
    /// Reachability matrix of YAML objects, by the compiler's simulator
    /// (the reference evaluator of npm-policy; no kernel, no API server).
    Simulate(SimulateArgs),
}

#[derive(Parser)]
struct RunArgs {
    /// This node's name (pods with this spec.nodeName are local endpoints).
    #[arg(long, env = "NODE_NAME")]
    node_name: String,
    /// Kubeconfig file; without it, in-cluster config (or $KUBECONFIG).
    #[arg(long, env = "KUBECONFIG")]
    kubeconfig: Option<PathBuf>,
    /// Which dataplane programs the kernel.
    #[arg(long, env = "NPM_DATAPLANE", value_enum, default_value_t = DataplaneKind::Ebpf)]
    dataplane: DataplaneKind,
    /// eBPF object (default: the loader's search path).
    #[arg(long, env = "NPM_EBPF_OBJECT")]
    bpf_object: Option<PathBuf>,
    /// bpffs pin directory of the eBPF dataplane.
    #[arg(long, env = "NPM_PIN_DIR")]
    pin_dir: Option<PathBuf>,
    /// nftables table name of the nftables dataplane.
    #[arg(long, env = "NPM_NFT_TABLE", default_value = "npm")]
    nft_table: String,
    /// Address of /metrics, /healthz and /readyz.
    #[arg(long, env = "NPM_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    metrics_addr: SocketAddr,
    /// LIST page size.
    #[arg(long, env = "NPM_PAGE_SIZE", default_value_t = 500)]
    page_size: u32,
    /// Time (ms) changes are coalesced for, after the oldest change not yet
    /// programmed, before syncing.
    #[arg(long, env = "NPM_DEBOUNCE_MS", default_value_t = npm_agent::sync::DEFAULT_DEBOUNCE_MS)]
    debounce_ms: u64,
    /// Share of identities or endpoints whose removal is held until a
    /// direct read of the API server confirms it: in one sync, or in total
    /// against the highest count programmed within the window since the
    /// last confirmation.
    #[arg(long, env = "NPM_MASS_DELETE_THRESHOLD", default_value_t = 0.5)]
    mass_delete_threshold: f64,
    /// Window (seconds) of the cumulative mass-deletion check: removals
    /// slower than this are not held.
    #[arg(long, env = "NPM_MASS_DELETE_WINDOW_SECS", default_value_t = 600)]
    mass_delete_window_secs: u64,
    /// Let egress-isolated pods reach their own node.
    #[arg(long, env = "NPM_ALLOW_HOST_EGRESS")]
    allow_host_egress: bool,
    /// Only interfaces matching this glob (e.g. `veth*`) are pod interfaces.
    #[arg(long, env = "NPM_INTERFACE_PATTERN")]
    interface_pattern: Option<String>,
    /// Deny flow log lines per second at most.
    #[arg(long, env = "NPM_FLOW_LOGS_PER_SEC", default_value_t = 10)]
    flow_logs_per_sec: u32,
}

#[derive(Parser)]
struct SimulateArgs {
    /// YAML files of Namespace, Pod and NetworkPolicy objects.
    #[arg(short = 'f', long = "file", required = true)]
    files: Vec<PathBuf>,
    /// Destination port.
    #[arg(long, default_value_t = 80)]
    port: u16,
    /// TCP, UDP or SCTP.
    #[arg(long, default_value = "TCP")]
    protocol: String,
}

fn simulate(args: SimulateArgs) -> anyhow::Result<()> {
    let mut inputs = Vec::new();
    for f in &args.files {
        let text = std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        inputs.push((f.display().to_string(), text));
    }
    let protocol = npm_policy::validate::parse_protocol(&args.protocol)
        .with_context(|| format!("--protocol {:?}: want TCP, UDP or SCTP", args.protocol))?;
    let snapshot = npm_policy::sim::load_snapshot(&inputs)?;
    for p in &snapshot.invalid_policies {
        eprintln!(
            "invalid policy {}/{} skipped: {}",
            p.namespace,
            p.name,
            p.errors.join("; ")
        );
    }
    let matrix = npm_policy::sim::matrix(&snapshot, &npm_policy::sim::sim_options(), protocol, args.port);
    print!("{}", matrix.render());
    Ok(())
}

#[derive(Parser)]
struct InspectArgs {
    /// bpffs pin directory of the eBPF dataplane.
    #[arg(long, env = "NPM_PIN_DIR")]
    pin_dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn init_logging(level: &str, format: LogFormat) -> anyhow::Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_new(level).with_context(|| format!("--log-level {level:?}"))?;
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
    Ok(())
}

async fn client(kubeconfig: Option<&PathBuf>) -> anyhow::Result<kube::Client> {
    let config = match kubeconfig {
        Some(path) => {
            let kc = kube::config::Kubeconfig::read_from(path)
                .with_context(|| format!("reading kubeconfig {}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kc, &Default::default())
                .await
                .with_context(|| format!("kubeconfig {}", path.display()))?
        }
        None => kube::Config::infer()
            .await
            .context("no kubeconfig and no in-cluster config")?,
    };
    let mut config = config;
    // The watchers and the sync loop retry with their own backoff; the
    // client's built-in retry of 429/503/504 (up to 15 attempts) would stall
    // the sync loop's direct reads for minutes during an outage.
    config.default_retry = false;
    kube::Client::try_from(config).context("building the API client")
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    // Installed first, so a SIGTERM during startup is also a clean stop
    // (seen once the agent is started) rather than the default kill.
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    anyhow::ensure!(!args.node_name.is_empty(), "NODE_NAME / --node-name must not be empty");
    anyhow::ensure!(args.page_size > 0, "--page-size must be positive");
    SyncConfig {
        mass_delete_threshold: args.mass_delete_threshold,
        ..SyncConfig::default()
    }
    .validate()?;
    let pattern = args
        .interface_pattern
        .as_deref()
        .map(InterfacePattern::new)
        .transpose()?;
    let metrics = Metrics::new()?;
    let client = client(args.kubeconfig.as_ref()).await?;
    let dataplane = dataplanes::open(
        args.dataplane,
        &DataplaneOptions {
            bpf_object: args.bpf_object.clone(),
            pin_dir: args.pin_dir.clone(),
            nft_table: args.nft_table.clone(),
        },
    )?;
    let cfg = AgentConfig {
        sync: SyncConfig {
            compile: CompileOptions {
                node_name: args.node_name.clone(),
                node_ips: agent::local_addresses(),
                allow_host_egress: args.allow_host_egress,
            },
            debounce: Duration::from_millis(args.debounce_ms),
            mass_delete_threshold: args.mass_delete_threshold,
            mass_delete_window: Duration::from_secs(args.mass_delete_window_secs),
            page_size: args.page_size,
            flow_logs_per_sec: args.flow_logs_per_sec,
            ..SyncConfig::default()
        },
        page_size: args.page_size,
        metrics_addr: Some(args.metrics_addr),
    };
    tracing::info!(node = %args.node_name, dataplane = ?args.dataplane, node_ips = ?cfg.sync.compile.node_ips, "starting");
    let running = agent::start(
        cfg,
        client,
        dataplane,
        Box::new(InterfaceResolver::new(pattern)),
        metrics,
    )
    .await?;
    tracing::info!(addr = ?running.http_addr, "serving /metrics, /healthz, /readyz");
    let name = tokio::select! {
        _ = sigterm.recv() => "SIGTERM",
        _ = sigint.recv() => "SIGINT",
        _ = running.wait() => anyhow::bail!("an agent task ended unexpectedly"),
    };
    // The select dropped the agent's handles: its watchers, sync loop and
    // HTTP server are aborted here. The dataplane is not cleared: pinned
    // maps and links (or the nft table) keep enforcing until the next agent
    // adopts them.
    tracing::info!(signal = name, "shutting down; the programmed dataplane keeps enforcing");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    init_logging(&cli.log_level, cli.log_format)?;
    match cli.command {
        Command::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .context("starting the tokio runtime")?
            .block_on(run(args)),
        Command::Inspect(args) => Ok(npm_agent::inspect::run(args.pin_dir, args.json)?),
        Command::Simulate(args) => simulate(args),
    }
}
