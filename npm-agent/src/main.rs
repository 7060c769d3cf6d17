//! `npm-agent`: the node agent binary. Only wiring lives here: parse the
//! command line ([`cli`]), set up logging, build the agent's context
//! (API client, dataplane, metrics, settings) and start its tasks; see the
//! library modules for the logic.

mod cli;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context as _;
use clap::{Parser, ValueEnum};
use cli::{CleanupArgs, Cli, Command, ExplainArgs, LogFormat, ObserveArgs, RunArgs, UninstallStep};
use npm_agent::agent;
use npm_agent::dataplanes;
use npm_agent::dataplanes::DataplaneKind;
use npm_agent::explain;
use npm_agent::lifecycle::cleanup::CleanupOptions;
use npm_agent::lifecycle::lock::AgentLock;
use npm_agent::lifecycle::uninstall;
use npm_agent::node::{InterfacePattern, InterfaceResolver, NodeAddresses};
use npm_agent::reconcile::SyncConfig;
use npm_agent::telemetry::Metrics;
use npm_dataplane::nft::{NftDataplane, NftOptions};
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

/// The checks `run` makes before it touches anything (also `run
/// --dry-run`'s); returns the interface pattern.
fn validate(args: &RunArgs) -> anyhow::Result<Option<InterfacePattern>> {
    anyhow::ensure!(!args.node_name.is_empty(), "NODE_NAME / --node-name must not be empty");
    anyhow::ensure!(args.page_size > 0, "--page-size must be positive");
    anyhow::ensure!(args.max_apply_failures > 0, "--max-apply-failures must be at least 1");
    anyhow::ensure!(
        args.max_held_removal_secs > 0,
        "--max-held-removal-secs must be positive"
    );
    SyncConfig {
        mass_delete_threshold: args.mass_delete_threshold,
        ..SyncConfig::default()
    }
    .validate()?;
    if args.dataplane == DataplaneKind::Nftables {
        // Checks the table name; touches nothing.
        NftDataplane::new(NftOptions {
            table: args.nft_table.clone(),
            netns: None,
        })
        .with_context(|| format!("--nft-table {:?}", args.nft_table))?;
    }
    Ok(args
        .interface_pattern
        .as_deref()
        .map(InterfacePattern::new)
        .transpose()?)
}

/// The name of a value of a `clap::ValueEnum`.
fn value_name(v: impl ValueEnum) -> String {
    v.to_possible_value()
        .map(|p| p.get_name().to_string())
        .unwrap_or_default()
}

/// `run --dry-run`: validate as `run` does, print the effective
/// configuration as JSON, touch nothing.
fn dry_run(log_level: &str, log_format: LogFormat, args: &RunArgs) -> anyhow::Result<()> {
    validate(args)?;
    let dp = args.dataplane_options();
    let (key, _) = args.lock_key();
    let config = serde_json::json!({
        "node_name": args.node_name,
        "kubeconfig": args.kubeconfig,
        "dataplane": value_name(args.dataplane),
        "bpf_object": dp.bpf_object,
        "attach": dp.attach.to_string(),
        "pin_dir": dataplanes::ebpf_options(&dp).pin_dir,
        "map_sizes": dp.map_sizes,
        "nft_table": args.nft_table,
        "metrics_addr": args.metrics_addr.to_string(),
        "page_size": args.page_size,
        "debounce_ms": args.debounce_ms,
        "mass_delete_threshold": args.mass_delete_threshold,
        "mass_delete_window_secs": args.mass_delete_window_secs,
        "allow_host_egress": args.allow_host_egress,
        "interface_pattern": args.interface_pattern,
        "flow_logs_per_sec": args.flow_logs_per_sec,
        "flow_logs_allow": args.flow_logs_allow,
        "cluster_network_policies": args.cluster_network_policies.name(),
        "established": args.established.to_string(),
        "cni_socket": args.cni_socket,
        "cni_chain": args.agent_config(Vec::new()).cni.and_then(|c| c.keep_chained).map(|c| serde_json::json!({
            "conf_dir": c.conf_dir,
            "bin_dir": c.bin_dir,
            "source": c.source,
            "agent_socket": c.entry.agent_socket,
            "timeout_seconds": c.entry.timeout_seconds,
            "fail_open": c.entry.fail_open,
            "interval_secs": c.interval.as_secs(),
        })),
        "lock_file": args.lock_dir.join(npm_agent::lifecycle::lock::lock_file_name(&key)),
        "max_held_removal_secs": args.max_held_removal_secs,
        "max_apply_failures": args.max_apply_failures,
        "dns": args.agent_config(Vec::new()).dns.map(|d| serde_json::json!({
            "servers": d.servers,
            "queue": d.queue,
            "hold_ms": d.hold.as_millis() as u64,
            "grace_secs": d.limits.grace.as_secs(),
            "state_file": d.state_file,
        })),
        "log_level": log_level,
        "log_format": value_name(log_format),
    });
    println!("{}", serde_json::to_string_pretty(&config)?);
    Ok(())
}

/// `explain`: ask the agent, print its report (JSON or text, the mismatch
/// first); exit 0 whatever the verdict.
fn explain_cmd(args: ExplainArgs) -> anyhow::Result<()> {
    let q = explain::ExplainQuery {
        from: args.from,
        to: args.to,
        port: args.port,
        protocol: Some(args.protocol),
    };
    let (report, raw) = explain::client::fetch(&args.agent, &q)?;
    if args.json {
        println!("{raw}");
    } else {
        print!("{}", explain::client::render(&report));
    }
    Ok(())
}

/// `observe`: follow the agent's flow records until interrupted (or the
/// stream fails: an error naming the agent).
fn observe_cmd(args: ObserveArgs) -> anyhow::Result<()> {
    let q = explain::observe_client::ObserveQuery {
        namespace: args.namespace,
        pod: args.pod,
        verdict: args.verdict,
    };
    let (mut out, mut notes) = (std::io::stdout().lock(), std::io::stderr());
    Ok(explain::observe_client::follow(
        &args.agent,
        &q,
        args.json,
        &mut out,
        &mut notes,
    )?)
}

/// `cleanup`: print what was removed; fail naming what was not.
fn cleanup(args: CleanupArgs) -> anyhow::Result<()> {
    let default = npm_dataplane::ebpf::default_pin_dir();
    let opts = CleanupOptions {
        pin_dir: args.pin_dir,
        pin_root: default.parent().unwrap_or(&default).to_path_buf(),
        nft_table: args.nft_table,
        cni_conf_dir: args.cni_conf_dir,
        cni_bin_dir: args.cni_bin_dir,
    };
    let r = npm_agent::lifecycle::cleanup::cleanup(&opts)?;
    tracing::info!(
        tc_filters = r.filters.len(),
        links = r.links.len(),
        pin_dirs = ?r.pin_dirs,
        nft_table_removed = r.nft_table_removed,
        conflists = ?r.conflists,
        cni_binary_removed = r.cni_binary_removed,
        dns_queues = ?r.dns_queues,
        host_in_chains = ?r.host_in_chains,
        "npm removed from this node"
    );
    Ok(())
}

/// `uninstall <step>`.
async fn uninstall(step: UninstallStep) -> anyhow::Result<()> {
    let (args, stop) = match step {
        UninstallStep::StopAgents(a) => (a, true),
        UninstallStep::WaitCleanup(a) => (a, false),
    };
    let client = client(args.kubeconfig.as_ref()).await?;
    let target = uninstall::Target {
        namespace: args.namespace,
        daemonset: args.daemonset,
        timeout: Duration::from_secs(args.timeout_seconds),
        poll: Duration::from_millis(500),
    };
    if stop {
        uninstall::stop_agents(&client, &target).await?;
    } else {
        uninstall::wait_cleanup(&client, &target).await?;
    }
    Ok(())
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the tokio runtime")
}

async fn run(args: RunArgs) -> anyhow::Result<()> {
    // Installed first, so a SIGTERM during startup is also a clean stop
    // (seen once the agent is started) rather than the default kill.
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    let pattern = validate(&args)?;
    // Before anything touches the kernel: a second agent on the same pin
    // directory stops here. Held until the process exits.
    let (key, what) = args.lock_key();
    let lock = AgentLock::acquire(&args.lock_dir, &key, &what)?;
    tracing::info!(lock = %lock.path().display(), "holding the agent lock of {what}");
    let metrics = Metrics::new()?;
    metrics.rules.set_max(args.rule_metrics_max);
    let client = client(args.kubeconfig.as_ref()).await?;
    let dataplane = dataplanes::open(args.dataplane, &args.dataplane_options())?;
    // This node's addresses, kept current through netlink (the sync loop
    // programs nothing before a first successful read).
    let mut cfg = args.agent_config(Vec::new());
    let node_addresses = NodeAddresses::watch(None);
    tracing::info!(node = %args.node_name, dataplane = ?args.dataplane, node_ips = ?node_addresses.current(), "starting");
    metrics.set_explain(explain::ExplainConfig {
        node_name: cfg.sync.compile.node_name.clone(),
        kernel: match args.dataplane {
            DataplaneKind::Ebpf => explain::KernelView::Ebpf {
                pin_dir: dataplanes::ebpf_options(&args.dataplane_options()).pin_dir,
            },
            DataplaneKind::Nftables => explain::KernelView::Nftables,
        },
    });
    cfg.sync.node_addresses = Some(node_addresses);
    let services_client = client.clone();
    let mut running = agent::start_with_health(
        cfg,
        args.health_config(),
        client,
        dataplane,
        Box::new(InterfaceResolver::new(pattern)),
        metrics,
    )
    .await?;
    // eBPF only: Service keys and `node_exit` on the uplinks, so that the
    // egress of a connection through a ClusterIP or NodePort is decided
    // against the backend kube-proxy chose (the nftables dataplane decides
    // after the DNAT already).
    if args.dataplane == DataplaneKind::Ebpf {
        let mut services =
            npm_agent::services::ServicesConfig::new(dataplanes::ebpf_options(&args.dataplane_options()).pin_dir);
        services.object = args.bpf_object.clone();
        services.page_size = args.page_size;
        services.attach = args.attach;
        services.node_name = Some(args.node_name.clone());
        running.start_services(services_client, services);
    }
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
        Command::Run(args) if args.dry_run => dry_run(&cli.log_level, cli.log_format, &args),
        Command::Run(args) => runtime()?.block_on(run(args)),
        Command::Inspect(args) => Ok(npm_agent::inspect::run(args.pin_dir, args.json)?),
        Command::Explain(args) => explain_cmd(args),
        Command::Observe(args) => observe_cmd(args),
        Command::Simulate(args) => npm_agent::simulate::run(&args.files, args.port, &args.protocol),
        Command::MountBpffs(args) => {
            let outcome = npm_agent::lifecycle::bpffs::mount_bpffs(&args.path)?;
            tracing::info!(path = %args.path.display(), ?outcome, "bpffs");
            Ok(())
        }
        Command::Cleanup(args) => cleanup(args),
        Command::Pause => {
            let name = runtime()?.block_on(npm_agent::lifecycle::pause::pause())?;
            tracing::info!(signal = name, "pause: stopping");
            Ok(())
        }
        Command::Uninstall(args) => runtime()?.block_on(uninstall(args.step)),
    }
}
