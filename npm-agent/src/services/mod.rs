//! Services through kube-proxy on the eBPF dataplane: the agent side of
//! the deferred egress decision (see `npm_common::service`).
//!
//! - watchers of `v1` Services, `v1` Nodes and this node's `v1` Pods
//!   (`spec.nodeName`, for their `hostPort`s), each into a
//!   [`ListStore`]: a store's state is replaced only
//!   on `InitDone`, so nothing is ever computed from a partial list, and a
//!   failed relist keeps the last complete one (incident 2);
//! - [`keys`]: the Service keys of the complete lists (pure);
//! - [`writer`]: one OS thread that loads `node_exit` (and `node_exit_l3`
//!   for uplinks without an Ethernet header), attaches them to the node's
//!   uplinks ([`crate::node::uplinks`]) with tcx, or tc `clsact` where
//!   the kernel has no tcx, writes `host_in`'s `INPUT` rules, and keeps
//!   `NPM_SERVICES` equal to the computed keys, level-triggered (the map
//!   is read back and diffed on every pass), with a guard against mass
//!   removals.
//!
//! Nothing is written to `NPM_SERVICES` before every list completed,
//! `node_exit` is attached and `host_in`'s rules are in place: an empty
//! map defers nothing, so until then Service traffic is decided at
//! `from_pod` against the ClusterIP.

pub mod keys;
pub mod writer;

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::runtime::watcher;
use kube::runtime::WatchStreamExt;
use kube::{Api, Client, Resource};
use serde::de::DeserializeOwned;

use crate::k8s::{ListStore, StoreUpdate};
use crate::telemetry::metrics::Metrics;

pub use keys::{service_keys, ServiceKeys};
pub use writer::{ServicesError, ServicesWriter};

/// Settings of the Services side of the agent.
#[derive(Clone, Debug)]
pub struct ServicesConfig {
    /// The eBPF dataplane's pin directory (its `NPM_SERVICES` and the maps
    /// `node_exit` shares).
    pub pin_dir: PathBuf,
    /// The eBPF object (`None`: the loader's search).
    pub object: Option<PathBuf>,
    /// LIST page size of the watchers.
    pub page_size: u32,
    /// How often the uplinks are re-read and the map re-diffed without a
    /// change (also how long a mass removal is held before it is applied).
    pub resync: Duration,
    /// How `node_exit` is attached (`--attach`, as the pods' programs:
    /// `auto` is tcx where the kernel has it, else tc `clsact`).
    pub attach: npm_dataplane::ebpf::AttachMode,
    /// This node's name: its pods' `hostPort`s are keys (`None`: no
    /// hostPort keys and no Pod watcher).
    pub node_name: Option<String>,
}

impl ServicesConfig {
    /// Settings for `pin_dir` with the defaults (page size 500, resync 10 s).
    pub fn new(pin_dir: PathBuf) -> Self {
        ServicesConfig {
            pin_dir,
            object: None,
            page_size: 500,
            resync: Duration::from_secs(10),
            attach: npm_dataplane::ebpf::AttachMode::Auto,
            node_name: None,
        }
    }
}

/// The Services and Nodes as their watchers last listed them completely.
#[derive(Debug, Default)]
pub struct ServiceState {
    /// Services (all namespaces).
    pub services: Mutex<ListStore<Service>>,
    /// Nodes.
    pub nodes: Mutex<ListStore<Node>>,
    /// This node's pods (their `hostPort`s), when [`ServiceState::node_name`]
    /// is set.
    pub pods: Mutex<ListStore<Pod>>,
    /// This node's name (`None`: no hostPort keys).
    pub node_name: Option<String>,
    /// Bumped on every change of a complete state.
    generation: AtomicU64,
}

impl ServiceState {
    /// The keys of the complete lists, `None` until every one completed
    /// (this node's pods only when [`ServiceState::node_name`] is set).
    pub fn keys(&self) -> Option<ServiceKeys> {
        let s = self.services.lock().unwrap_or_else(|p| p.into_inner());
        let n = self.nodes.lock().unwrap_or_else(|p| p.into_inner());
        let (s, n) = (s.complete()?, n.complete()?);
        let mut keys = service_keys(s.iter().map(|a| a.as_ref()), n.iter().map(|a| a.as_ref()));
        if let Some(name) = &self.node_name {
            let p = self.pods.lock().unwrap_or_else(|p| p.into_inner());
            let pods = p.complete()?;
            let node = n
                .iter()
                .map(|a| a.as_ref())
                .find(|n| n.metadata.name.as_deref() == Some(name.as_str()));
            keys::add_host_port_keys(pods.iter().map(|a| a.as_ref()), node, &mut keys);
        }
        Some(keys)
    }

    /// The change counter.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn changed(&self) {
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// One kind this module watches.
trait Kind: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send + Sync + 'static {
    const NAME: &'static str;
    fn store(s: &ServiceState) -> &Mutex<ListStore<Self>>;
}

impl Kind for Service {
    const NAME: &'static str = "services";
    fn store(s: &ServiceState) -> &Mutex<ListStore<Self>> {
        &s.services
    }
}

impl Kind for Node {
    const NAME: &'static str = "nodes";
    fn store(s: &ServiceState) -> &Mutex<ListStore<Self>> {
        &s.nodes
    }
}

impl Kind for Pod {
    const NAME: &'static str = "pods";
    fn store(s: &ServiceState) -> &Mutex<ListStore<Self>> {
        &s.pods
    }
}

/// Runs the watcher of one kind forever, feeding `state`.
async fn watch<K: Kind>(api: Api<K>, config: watcher::Config, state: Arc<ServiceState>, metrics: Metrics) {
    let mut stream = watcher::watcher(api, config).default_backoff().boxed();
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                let update = K::store(&state)
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .handle(event, |_, _| {});
                if update == StoreUpdate::Changed {
                    state.changed();
                }
            }
            Err(e) => {
                metrics.error("watch");
                tracing::warn!(resource = K::NAME, error = %e, "watch failed; the last complete list stays in force");
            }
        }
    }
}

/// Starts the watchers (tokio tasks on the current runtime) and the writer
/// thread; aborting the returned tasks stops all of them (the last task
/// holds the writer thread's stop guard).
pub fn spawn(client: Client, cfg: ServicesConfig, metrics: Metrics) -> Vec<tokio::task::JoinHandle<()>> {
    let state = Arc::new(ServiceState {
        node_name: cfg.node_name.clone(),
        ..ServiceState::default()
    });
    let guard = writer::spawn_thread(cfg.clone(), state.clone(), metrics.clone());
    let paged = || watcher::Config::default().page_size(cfg.page_size);
    let mut tasks = vec![
        tokio::spawn(watch(
            Api::<Service>::all(client.clone()),
            paged(),
            state.clone(),
            metrics.clone(),
        )),
        tokio::spawn(watch(
            Api::<Node>::all(client.clone()),
            paged(),
            state.clone(),
            metrics.clone(),
        )),
    ];
    if let Some(name) = &cfg.node_name {
        let this_node = paged().fields(&format!("spec.nodeName={name}"));
        tasks.push(tokio::spawn(watch(Api::<Pod>::all(client), this_node, state, metrics)));
    }
    tasks.push(tokio::spawn(async move {
        let _guard = guard;
        std::future::pending::<()>().await
    }));
    tasks
}
