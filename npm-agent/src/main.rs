//! `npm-agent`: the node agent binary. Only wiring lives here: parse the
//! command line ([`cli`]), set up logging, build the agent's context
//! (API client, dataplane, metrics, settings) and start its tasks; see the
//! library modules for the logic.

mod cli;

use std::path::PathBuf;

use anyhow::Context as _;
use clap::Parser;
use cli::{Cli, Command, LogFormat, RunArgs};
use npm_agent::agent;
use npm_agent::dataplanes;
use npm_agent::node::{local_addresses, InterfacePattern, InterfaceResolver};
use npm_agent::reconcile::SyncConfig;
use npm_agent::telemetry::Metrics;
use tokio::signal::unix::{signal, SignalKind};

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
    let dataplane = dataplanes::open(args.dataplane, &args.dataplane_options())?;
    let cfg = args.agent_config(local_addresses());
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
        Command::Simulate(args) => npm_agent::simulate::run(&args.files, args.port, &args.protocol),
    }
}
