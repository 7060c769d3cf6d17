//! The live runner: the in-process API server, the netns cluster and the
//! agent, started once and torn down at the end. Its agent process is
//! [`agent`], bringing the live cluster to the model and applying actions
//! is [`cluster`], probing and comparing matrices is [`probing`].

mod agent;
mod cluster;
mod cnp;
mod nodes;
mod probing;
mod restart;
mod services;
mod timed;

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use npm_sim::cases::Model;

use super::{Engine, Options, RunnerError};
use crate::api::{Api, ApiError};
use crate::cluster::Cluster;

use agent::Agent;
pub use timed::{preload_ip, preload_pod, preload_policy, Preload, WiredTimes, PRELOAD_NAMESPACES};

/// The live runner: API server, netns cluster, agent.
pub struct LiveRunner {
    opts: Options,
    // Field order is drop order: the agents stop before the cluster and the
    // API server go away.
    agents: Vec<Agent>,
    /// kube-proxies and the EndpointSlice controller (multi-node runs).
    plumbing: services::ServicePlumbing,
    cluster: Cluster,
    /// ClusterIPs of the per-pod Services (`s-<ns>-<pod>`), by pod.
    services: BTreeMap<(String, String), Vec<IpAddr>>,
    api: Api,
    server: Option<npm_testapi::TestApiServer>,
    model: Model,
    /// The live cluster may differ from `model` in ways the runner does not
    /// know: an action or a reset failed half-way. The next reset starts
    /// from a clean slate ([`LiveRunner::reset_to`]).
    stale: bool,
    workdir: PathBuf,
    pin_dir: PathBuf,
    nft_table: String,
    first_probe: bool,
}

impl std::fmt::Debug for LiveRunner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveRunner")
            .field("engine", &self.opts.engine)
            .field("workdir", &self.workdir)
            .finish()
    }
}

fn api_err(e: ApiError) -> RunnerError {
    RunnerError::Api(e)
}

impl LiveRunner {
    /// Starts the API server, builds and publishes the pristine cluster and
    /// starts the agent.
    pub fn start(opts: Options) -> Result<Self, RunnerError> {
        let pid = std::process::id();
        if opts.multi_node() {
            return Self::start_multi(opts);
        }
        let (server, api, workdir, kubeconfig) = start_api_server(npm_testapi::Options::default())?;
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/npm-conformance-{pid}"));
        let nft_table = format!("npmconf{pid}");
        let mut r = LiveRunner {
            opts,
            agents: Vec::new(),
            plumbing: Default::default(),
            services: BTreeMap::new(),
            cluster: Cluster::new()?,
            api,
            server: Some(server),
            model: Model::upstream(),
            stale: false,
            workdir,
            pin_dir,
            nft_table,
            first_probe: true,
        };
        r.register_single_node()?;
        // Publish and build the pristine model.
        let pristine = Model::upstream();
        for ns in pristine.snapshot.namespaces.values() {
            r.create_namespace_obj(&ns.name, &ns.labels)?;
        }
        for pod in pristine.snapshot.pods.values() {
            r.create_pod_live(&pristine, &pod.namespace, &pod.name)?;
        }
        r.model = pristine;
        r.start_agent(&kubeconfig)?;
        Ok(r)
    }

    /// The REST client of the in-process API server.
    pub fn api(&self) -> &Api {
        &self.api
    }

    /// The in-process API server (fault injection, compaction).
    pub fn api_server(&self) -> Option<&npm_testapi::TestApiServer> {
        self.server.as_ref()
    }

    /// The netns cluster.
    pub fn cluster(&self) -> &Cluster {
        &self.cluster
    }

    /// The model the live cluster is kept equal to.
    pub fn model(&self) -> &Model {
        &self.model
    }

    /// The kubeconfig pointing at the in-process API server (the one the
    /// agent uses).
    pub fn kubeconfig_path(&self) -> PathBuf {
        self.workdir.join("kubeconfig")
    }

    /// The runner's scratch directory (kubeconfig, agent log); not removed
    /// by [`LiveRunner::shutdown`].
    pub fn workdir(&self) -> &Path {
        &self.workdir
    }

    /// The agent's bpffs pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// The agent's nftables table name.
    pub fn nft_table(&self) -> &str {
        &self.nft_table
    }

    /// The agent's metrics/health address (`/metrics`, `/readyz`), while it
    /// runs.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.agents.first().map(|a| a.metrics)
    }

    /// The first agent's `/explain` and `/observe` address (its loopback:
    /// reachable from the root netns for the one-node cluster's agent).
    pub fn debug_addr(&self) -> Option<SocketAddr> {
        self.agents.first().map(|a| a.debug)
    }

    /// The dataplane the agents run.
    pub fn engine(&self) -> Engine {
        self.opts.engine
    }

    /// Every agent's `/explain` and `/observe` address, one per node in
    /// node order (each on the loopback of its node's netns: enter it, as
    /// a kubelet's port-forward enters the pod's, to connect).
    pub fn debug_addrs(&self) -> Vec<SocketAddr> {
        self.agents.iter().map(|a| a.debug).collect()
    }

    /// Every agent's metrics/health address (one per node).
    pub fn metrics_addrs(&self) -> Vec<SocketAddr> {
        self.agents.iter().map(|a| a.metrics).collect()
    }

    /// Why an agent is gone, if one exited.
    pub fn agent_exited(&mut self) -> Option<String> {
        self.agents.iter_mut().find_map(|a| a.exited())
    }

    /// One-node runs: kills the agent with SIGKILL (as a crash: nothing of
    /// its shutdown runs; its pins or nftables table stay and keep
    /// enforcing). [`LiveRunner::start_agent_again`] starts the next one.
    pub fn kill_agent(&mut self) {
        for mut a in std::mem::take(&mut self.agents) {
            a.kill();
        }
    }

    /// One-node runs: starts an agent with the same flags after
    /// [`LiveRunner::kill_agent`]; it adopts what the killed one left and
    /// this returns once it is ready.
    pub fn start_agent_again(&mut self) -> Result<(), RunnerError> {
        let kubeconfig = self.kubeconfig_path();
        self.start_agent(&kubeconfig)
    }

    /// Stops the agent, tears the cluster down, stops the API server and
    /// removes the agent's pins and nftables table.
    pub fn shutdown(mut self) -> Result<(), RunnerError> {
        self.shutdown_inner()
    }

    fn shutdown_inner(&mut self) -> Result<(), RunnerError> {
        for mut a in std::mem::take(&mut self.agents) {
            a.stop();
            if let Some(p) = &a.pin_dir {
                let _ = std::fs::remove_dir_all(p);
            }
        }
        self.plumbing.stop();
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        for fam in ["inet", "ip", "ip6", "bridge", "netdev"] {
            let _ = Command::new("nft")
                .args(["delete", "table", fam, &self.nft_table])
                .stderr(Stdio::null())
                .status();
        }
        self.server.take();
        Ok(())
    }
}

impl Drop for LiveRunner {
    fn drop(&mut self) {
        let _ = self.shutdown_inner();
    }
}

/// Starts the test API server with `options`, and the runner's scratch
/// directory `npm-conformance-<pid>` holding a kubeconfig that points at it:
/// (server, client, scratch directory, kubeconfig path). The
/// ClusterNetworkPolicy CRD (experimental channel, unless `options` names
/// one) is installed at startup.
pub(super) fn start_api_server(
    options: npm_testapi::Options,
) -> Result<(npm_testapi::TestApiServer, Api, PathBuf, PathBuf), RunnerError> {
    let options = npm_testapi::Options {
        cnp_crd: options.cnp_crd.or(Some(npm_testapi::CnpChannel::Experimental)),
        ..options
    };
    let server =
        npm_testapi::TestApiServer::start_background(options).map_err(|e| RunnerError::ApiServer(e.to_string()))?;
    let api = Api::new(server.addr());
    let workdir = std::env::temp_dir().join(format!("npm-conformance-{}", std::process::id()));
    std::fs::create_dir_all(&workdir).map_err(|source| RunnerError::Read {
        path: workdir.clone(),
        source,
    })?;
    let kubeconfig = workdir.join("kubeconfig");
    server
        .kubeconfig(&kubeconfig)
        .map_err(|e| RunnerError::ApiServer(e.to_string()))?;
    Ok((server, api, workdir, kubeconfig))
}
