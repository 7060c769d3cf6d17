//! `npm-testapi`: run the test API server until interrupted.

use clap::Parser;
use std::net::SocketAddr;
use std::path::PathBuf;

/// A Kubernetes-compatible API server (namespaces, pods, networkpolicies, services, endpointslices, nodes, the ClusterNetworkPolicy CRD...) for tests and demos.
#[derive(Debug, Parser)]
#[command(name = "npm-testapi", version)]
struct Cli {
    /// Address to listen on (port 0 picks a free port; the bound address is printed).
    #[arg(long, default_value = "127.0.0.1:6443")]
    listen: SocketAddr,
    /// Write a kubeconfig pointing at the server to this path.
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Disable validation (defaulting still runs).
    #[arg(long)]
    no_validation: bool,
    /// BOOKMARK interval in milliseconds.
    #[arg(long, default_value_t = 1000)]
    bookmark_interval_ms: u64,
    /// Maximum events kept in the event log before automatic compaction.
    #[arg(long, default_value_t = 1_000_000)]
    max_history: usize,
    /// Service CIDRs, comma-separated, at most one per family (the first is primary).
    #[arg(long, value_delimiter = ',', default_values_t = ["10.96.0.0/16".parse::<ipnet::IpNet>().expect("valid"), "fd00:96::/112".parse().expect("valid")])]
    service_cidrs: Vec<ipnet::IpNet>,
    /// NodePort range, `LOW-HIGH`.
    #[arg(long, default_value = "30000-32767", value_parser = parse_port_range)]
    node_port_range: std::ops::RangeInclusive<u16>,
    /// Install the vendored ClusterNetworkPolicy CRD of this channel (`standard` or
    /// `experimental`) at start; without it clusternetworkpolicies answer 404 until a CRD is
    /// applied.
    #[arg(long, value_name = "CHANNEL")]
    cnp_crd: Option<npm_testapi::CnpChannel>,
}

/// Parse `LOW-HIGH` into a port range.
fn parse_port_range(s: &str) -> Result<std::ops::RangeInclusive<u16>, String> {
    let (lo, hi) = s
        .split_once('-')
        .ok_or_else(|| format!("expected LOW-HIGH, got {s:?}"))?;
    let lo: u16 = lo.trim().parse().map_err(|e| format!("{lo:?}: {e}"))?;
    let hi: u16 = hi.trim().parse().map_err(|e| format!("{hi:?}: {e}"))?;
    if lo == 0 || hi < lo {
        return Err(format!("invalid port range {s:?}"));
    }
    Ok(lo..=hi)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let opts = npm_testapi::Options {
        listen: cli.listen,
        validation: !cli.no_validation,
        bookmark_interval: std::time::Duration::from_millis(cli.bookmark_interval_ms.max(10)),
        max_history: cli.max_history,
        service_network: npm_testapi::ServiceNetwork {
            cidrs: cli.service_cidrs.clone(),
            node_ports: cli.node_port_range.clone(),
        },
        cnp_crd: cli.cnp_crd,
        ..Default::default()
    };
    let server = npm_testapi::TestApiServer::start(opts).await?;
    if let Some(path) = &cli.kubeconfig {
        server.kubeconfig(path)?;
    }
    println!("npm-testapi listening on {}", server.url());
    tokio::signal::ctrl_c().await?;
    server.shutdown().await;
    Ok(())
}
