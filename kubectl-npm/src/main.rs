//! `kubectl-npm`, the kubectl plugin of npm (`kubectl npm …` once it is on
//! `PATH`): asks the npm agents through the API server, with the user's
//! kubeconfig and RBAC, over `pods/portforward` to each agent's loopback
//! debug listener (the channel `kubectl port-forward` uses):
//!
//! - [`why`]: why a flow is allowed or denied, each direction by the agent
//!   of the node that decides it, with the kernel's dry-run verdict;
//! - [`observe`]: the live flow records of the selected pods' nodes;
//! - [`status`]: per node, the agent's readiness and what its metrics say;
//!   per pod, its `npm.io/PolicyEnforced` condition;
//! - [`analyze`]: `lint`, `exposure` and `preview`, `npmctl`'s analyses on
//!   the live state (read from the API server; no agent is asked).
//!
//! The agents and pods are found by [`cluster`], the port-forward is
//! [`forward`], errors ([`error`]) name the missing permission or the agent
//! that is missing or not ready.

mod analyze;
mod cluster;
mod error;
mod forward;
mod observe;
mod output;
mod status;
mod why;

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{CommandFactory, Parser, Subcommand};
use npm_agent::explain::observe_client::ObserveQuery;
use npm_agent::explain::ExplainQuery;

use cluster::{Cluster, DEFAULT_AGENT_NAMESPACE, DEFAULT_AGENT_SELECTOR};
use error::NpmError;
use output::{print, Output};

#[derive(Parser)]
#[command(
    name = "kubectl-npm",
    bin_name = "kubectl npm",
    version,
    about = "npm's kubectl plugin: why a flow is allowed or denied, live flows, agent status, policy analysis",
    long_about = "npm's kubectl plugin. It reaches the npm agents through the API server with your \
kubeconfig: `create` on `pods/portforward` in the agents' namespace (to reach each agent's loopback \
debug listener), `list` on `pods` there, and `get` on the pods you name."
)]
struct Cli {
    /// Kubeconfig file (default: $KUBECONFIG, ~/.kube/config, or in-cluster).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// Kubeconfig context (default: the current one).
    #[arg(long, global = true)]
    context: Option<String>,
    /// Output format.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    /// Namespace of the npm agent pods (the chart's release namespace).
    #[arg(long, global = true, env = "NPM_AGENT_NAMESPACE", default_value = DEFAULT_AGENT_NAMESPACE)]
    agent_namespace: String,
    /// Label selector of the npm agent pods.
    #[arg(long, global = true, env = "NPM_AGENT_SELECTOR", default_value = DEFAULT_AGENT_SELECTOR)]
    agent_selector: String,
    /// The agents' debug port (default: the port of each agent pod's
    /// --debug-addr argument, else 9091).
    #[arg(long, global = true)]
    debug_port: Option<u16>,
    /// Seconds an agent's connection may stay silent before it is given
    /// up (the agents' flow stream sends a keepalive every 10 s).
    #[arg(long, global = true, value_name = "SECONDS", default_value = "30", value_parser = seconds)]
    idle_timeout: Duration,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Why a flow is allowed or denied: each direction as the agent of its
    /// pod's node decides it (the deciding NetworkPolicy rule, or the
    /// ClusterNetworkPolicy tier and rule, or the policies isolating the
    /// pod) and, on eBPF, the kernel's own dry-run verdict; a disagreement
    /// is printed first (MISMATCH).
    Why {
        /// The sender: NAMESPACE/POD or an IP address.
        from: String,
        /// The receiver: NAMESPACE/POD or an IP address.
        to: String,
        /// Destination port.
        #[arg(long)]
        port: u16,
        /// TCP, UDP or SCTP.
        #[arg(long, default_value = "TCP")]
        protocol: String,
    },
    /// Follow the live flow records (denies; allows with the agents'
    /// --flow-logs-allow) of the nodes hosting the selected pods, each
    /// line with its node, until interrupted.
    Observe {
        /// Records whose pod or peer pod is in this namespace.
        #[arg(short = 'n', long)]
        namespace: Option<String>,
        /// Records whose pod or peer pod is NAMESPACE/POD.
        #[arg(long)]
        pod: Option<String>,
        /// allow, deny or would-deny.
        #[arg(long)]
        verdict: Option<String>,
        /// Seconds a record may wait for the other nodes' records to be
        /// printed in time order; a record arriving later than that after
        /// an earlier-stamped one is printed out of order.
        #[arg(long, value_name = "SECONDS", default_value = "1", value_parser = seconds)]
        sort_window: Duration,
    },
    /// Per node: is the agent ready, and why not; held removals, CNI
    /// chaining, map fill, dataplane, attach mode and kernel. With a pod
    /// (NAMESPACE/POD): whether its policies are enforced, and since when.
    Status {
        /// NAMESPACE/POD.
        pod: Option<String>,
    },
    /// Findings about the cluster's policies (as `npmctl lint`): shadowed,
    /// overlapping or dead ClusterNetworkPolicy rules, Pass rules without
    /// effect, policies and peers selecting nothing, undefined named
    /// ports. Exits 1 when a finding is an error. Needs `list` on
    /// namespaces, pods, networkpolicies, clusternetworkpolicies, nodes.
    Lint,
    /// Per namespace and direction, the pods no policy isolates and the
    /// rules opening pods to addresses outside the cluster (as `npmctl
    /// exposure`).
    Exposure {
        /// The cluster's pod CIDRs (repeatable; default: the /16 or /64 of
        /// each pod address).
        #[arg(long = "cluster-cidr")]
        cluster_cidrs: Vec<ipnet::IpNet>,
    },
    /// Replays recorded flows (`kubectl npm observe -o json` lines; allowed
    /// flows need the agents' --flow-logs-allow) on the live state and on
    /// it with the files applied; lists the flows whose verdict changes.
    Preview {
        /// Objects to apply on top of the live state (repeatable).
        #[arg(long = "apply", short = 'f', required_unless_present = "delete")]
        apply: Vec<PathBuf>,
        /// Objects to remove: networkpolicy/NAMESPACE/NAME or
        /// clusternetworkpolicy/NAME (repeatable).
        #[arg(long = "delete")]
        delete: Vec<String>,
        /// The flow records, one JSON object a line (`-`: stdin).
        #[arg(long)]
        flows: PathBuf,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completion {
        /// The shell.
        shell: clap_complete::Shell,
    },
}

/// A `--…-timeout`/`--…-window` value: seconds, fractions allowed.
fn seconds(s: &str) -> Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .and_then(|f| Duration::try_from_secs_f64(f).ok())
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("{s:?}: want a positive number of seconds"))
}

async fn run(cli: Cli) -> Result<(), NpmError> {
    if let Cmd::Completion { shell } = cli.cmd {
        let mut cmd = Cli::command();
        let mut script = Vec::new();
        clap_complete::generate(shell, &mut cmd, "kubectl-npm", &mut script);
        return output::write_stdout(&script);
    }
    let cluster = Cluster {
        client: cluster::client(cli.kubeconfig.as_deref(), cli.context.as_deref()).await?,
        agent_namespace: cli.agent_namespace,
        agent_selector: cli.agent_selector,
        debug_port: cli.debug_port,
        idle_timeout: cli.idle_timeout,
    };
    match cli.cmd {
        Cmd::Why {
            from,
            to,
            port,
            protocol,
        } => {
            let q = ExplainQuery {
                from,
                to,
                port,
                protocol: Some(protocol),
            };
            let report = why::why(&cluster, q).await?;
            print(&report, cli.output, || npm_agent::explain::client::render(&report))
        }
        Cmd::Observe {
            namespace,
            pod,
            verdict,
            sort_window,
        } => {
            let q = ObserveQuery {
                namespace,
                pod,
                verdict,
            };
            observe::observe(&cluster, q, cli.output, sort_window).await
        }
        Cmd::Status { pod: Some(pod) } => {
            let st = status::pod_status(&cluster, &pod).await?;
            print(&st, cli.output, || status::render_pod(&st))
        }
        Cmd::Status { pod: None } => {
            let all = status::status(&cluster).await?;
            print(&all, cli.output, || status::render(&all))
        }
        Cmd::Lint => {
            if analyze::lint(&cluster, cli.output).await? {
                Ok(())
            } else {
                Err(NpmError::Findings)
            }
        }
        Cmd::Exposure { cluster_cidrs } => analyze::exposure(&cluster, &cluster_cidrs, cli.output).await,
        Cmd::Preview { apply, delete, flows } => analyze::preview(&cluster, &apply, &delete, &flows, cli.output).await,
        Cmd::Completion { .. } => Ok(()),
    }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}
