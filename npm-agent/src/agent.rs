//! Wiring of one agent (its context and its tasks): the watchers, the
//! sync loop, the HTTP server and the removal of the Node's not-ready taint
//! after the first full sync (`k8s::taint`), sharing one cache, one metrics
//! registry and one health state (used by `main` and the tests).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::cni::{self, CniConfig, CniContext, CniServerError, FactsHandle, NodeFacts};
use crate::k8s::{spawn_watchers, Cache};
use crate::node::Resolve;
use crate::reconcile::{AgentDataplane, SyncConfig, Syncer};
use crate::telemetry::events::EventRecorder;
use crate::telemetry::health::{Health, HealthConfig};
use crate::telemetry::listener::Bounds;
use crate::telemetry::metrics::Metrics;
use crate::telemetry::server::{self, ServerError, ServerState};

/// Settings of an agent.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// The sync loop's settings (node name, debounce, guard threshold...).
    pub sync: SyncConfig,
    /// LIST page size of the watchers.
    pub page_size: u32,
    /// Address of `/metrics`, `/healthz`, `/readyz` (`None`: no server).
    pub metrics_addr: Option<SocketAddr>,
    /// Address of `/explain` and `/observe` (`None`: not served; see
    /// [`crate::telemetry::server::debug_router`]).
    pub debug_addr: Option<SocketAddr>,
    /// The npm-cni socket (`None`: no CNI server; the agent then learns
    /// pods' addresses and interfaces from the API server and routes only).
    pub cni: Option<CniConfig>,
    /// Learning the DNS answers of trusted servers for ClusterNetworkPolicy
    /// `domainNames` peers (`None`: no learning; such peers match
    /// nothing).
    pub dns: Option<crate::dns::CaptureConfig>,
    /// Write the local pods' `npm.io/PolicyEnforced` conditions at this
    /// rate (`None`: not written; see [`crate::k8s::pod_conditions`]).
    pub pod_conditions: Option<crate::k8s::pod_conditions::PodConditionsConfig>,
}

/// Why an agent could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The HTTP server could not listen.
    #[error(transparent)]
    Http(#[from] ServerError),
    /// The npm-cni socket could not be served.
    #[error(transparent)]
    Cni(#[from] CniServerError),
    /// The DNS capture could not be started.
    #[error("learning DNS answers: {0}")]
    Dns(#[from] crate::dns::CaptureError),
    /// The sync loop's thread (or its runtime) could not be created.
    #[error("starting the sync thread: {0}")]
    SyncThread(#[source] std::io::Error),
}

/// A running agent's handles.
pub struct RunningAgent {
    /// The shared cache (tests inspect it).
    pub cache: Arc<Cache>,
    /// The metrics registry.
    pub metrics: Metrics,
    /// Readiness and liveness state (what `/readyz` and `/healthz` report).
    pub health: Arc<Health>,
    /// Bound address of the HTTP server.
    pub http_addr: Option<SocketAddr>,
    /// The bound address of `/explain` and `/observe`, if served.
    pub debug_addr: Option<SocketAddr>,
    /// This node's CNI facts (empty without a CNI server).
    pub cni_facts: FactsHandle,
    /// The bounds of `/explain` and `/observe` (tests hold slots).
    pub slots: server::Slots,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningAgent {
    /// Whether all lists completed and the first sync was applied.
    pub fn is_ready(&self) -> bool {
        self.cache.all_listed() && self.health.first_sync_done()
    }

    /// Stop every task of the agent (the dataplane state stays programmed).
    pub fn abort(&self) {
        for t in &self.tasks {
            t.abort();
        }
    }

    /// Starts the Services side of the eBPF dataplane on the current
    /// runtime ([`crate::services`]: Services and Nodes watched into
    /// `NPM_SERVICES`, `node_exit` on the uplinks); its tasks are this
    /// agent's (aborted with it). Not for the nftables dataplane, which
    /// decides after the DNAT by itself.
    pub fn start_services(&mut self, client: kube::Client, cfg: crate::services::ServicesConfig) {
        self.tasks
            .extend(crate::services::spawn(client, cfg, self.metrics.clone()));
    }

    /// Wait until a task ends (normally never).
    pub async fn wait(mut self) {
        for t in std::mem::take(&mut self.tasks) {
            let _ = t.await;
        }
    }
}

impl Drop for RunningAgent {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Start an agent on the current tokio runtime: watchers on `client`, the
/// sync loop over `dataplane`, and the HTTP server, with the default
/// health settings: [`start_with_health`] with [`HealthConfig::default`].
pub async fn start<D>(cfg: AgentConfig, client: kube::Client, dp: D, r: Box<dyn Resolve>, m: Metrics) -> Started
where
    D: AgentDataplane + 'static,
{
    start_with_health(cfg, HealthConfig::default(), client, dp, r, m).await
}

/// What [`start`] and [`start_with_health`] return.
pub type Started = Result<RunningAgent, StartError>;

/// [`start`] with the readiness and liveness settings `health`.
pub async fn start_with_health<D: AgentDataplane + 'static>(
    cfg: AgentConfig,
    health: HealthConfig,
    client: kube::Client,
    dataplane: D,
    resolver: Box<dyn Resolve>,
    metrics: Metrics,
) -> Started {
    // Nodes are watched: other nodes' addresses are node identities.
    let cache = Cache::watching_nodes(metrics.clone(), cfg.sync.cluster_policies);
    let cni_facts = match &cfg.cni {
        Some(c) => {
            let path = cni::persist::state_file_for(&c.socket);
            let facts = cni::persist::load(&path).unwrap_or_else(|e| {
                tracing::error!(error = %e, "CNI attachments of a previous agent not restored");
                NodeFacts::default()
            });
            tracing::info!(
                attachments = facts.attachments().count(),
                tombstones = facts.tombstones().count(),
                file = %path.display(),
                "CNI facts restored"
            );
            FactsHandle::new(facts, Some(path))
        }
        None => FactsHandle::default(),
    };
    let health = Arc::new(Health::new(health).with_metrics(metrics.clone()));
    let (events, events_task) =
        EventRecorder::spawn(client.clone(), cfg.sync.compile.node_name.clone(), metrics.clone());
    // Shared by the sync loop (which writes them) and the HTTP server.
    let programmed = crate::explain::ProgrammedView::default();
    let observe = crate::telemetry::ObserveHub::default();
    // The names learned from DNS answers (`--dns-server`): loaded from the
    // state file before the first sync, so that a restarted agent keeps
    // allowing what its pods resolved.
    let dns_names = crate::dns::NamesHandle::default();
    let capture = match &cfg.dns {
        Some(c) => {
            let wake_cache = cache.clone();
            let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || wake_cache.mark_changed());
            Some(crate::dns::Capture::start(c.clone(), dns_names.clone(), wake)?)
        }
        None => None,
    };
    let syncer = Syncer::builder(cache.clone(), dataplane)
        .programmed_view(programmed.clone())
        .observe(observe.clone())
        .config(cfg.sync.clone())
        .resolver(resolver)
        .client(client.clone())
        .events(events)
        .health(health.clone())
        .node_facts(cni_facts.clone())
        .expect_cni_adds(cfg.cni.as_ref().is_some_and(|c| c.keep_chained.is_some()))
        .dns_names(dns_names);
    let mut tasks = vec![events_task];
    let syncer = match cfg.pod_conditions {
        Some(c) => {
            let (writer, task) = crate::k8s::pod_conditions::spawn(client.clone(), c, metrics.clone());
            tasks.push(task);
            syncer.pod_conditions(writer)
        }
        None => syncer,
    }
    .build();
    if let Some(capture) = capture {
        tasks.push(tokio::spawn(crate::telemetry::metrics::report_dns(
            capture,
            metrics.clone(),
            health.clone(),
        )));
    }
    let mut http_addr = None;
    let mut debug_addr = None;
    let slots = server::Slots::default();
    let state = ServerState {
        metrics: metrics.clone(),
        cache: cache.clone(),
        health: health.clone(),
        programmed,
        observe,
        auth: Arc::new(crate::telemetry::authz::MetricsAuth::new(client.clone())),
        slots: slots.clone(),
    };
    for (addr, router, bounds, bound_to, what) in [
        (
            cfg.metrics_addr,
            server::router(state.clone()),
            Bounds::METRICS,
            &mut http_addr,
            "metrics server",
        ),
        (
            cfg.debug_addr,
            server::debug_router(state),
            Bounds::DEBUG,
            &mut debug_addr,
            "debug server",
        ),
    ] {
        let Some(addr) = addr else { continue };
        let (bound, serve) = server::bind(addr, router, bounds).await?;
        *bound_to = Some(bound);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "{what} stopped");
            }
        }));
    }
    if let Some(c) = &cfg.cni {
        let ctx = CniContext {
            facts: cni_facts.clone(),
            cache: cache.clone(),
            readiness: health.clone(),
            sync_marker: Arc::new(cni::status::SyncMarker::for_socket(&c.socket)),
            metrics: metrics.clone(),
            node_name: cfg.sync.compile.node_name.clone(),
            wait_bound: c.wait_bound,
        };
        // Facts of a previous agent whose veth is gone are dropped before
        // the first sync compiles them.
        cni::handler::prune(&ctx);
        tasks.push(tokio::spawn(cni::server::bind(&c.socket, ctx.clone())?));
        tasks.push(tokio::spawn(cni::handler::maintain(ctx)));
        if let Some(chain) = &c.keep_chained {
            let chain = cni::chain::Chain::new(chain.clone(), health.clone(), metrics.clone());
            tasks.push(tokio::spawn(cni::chain::keep_chained(chain)));
        }
    }
    // The sync loop on its own OS thread (a long sync never stalls the
    // watchers or the health endpoints); aborting this task stops it.
    let sync_thread = syncer.spawn_thread().map_err(StartError::SyncThread)?;
    tasks.push(tokio::spawn(async move {
        let _thread = sync_thread;
        std::future::pending::<()>().await
    }));
    tasks.push(tokio::spawn(crate::k8s::taint::remove_after_first_sync(
        client.clone(),
        cfg.sync.compile.node_name.clone(),
        health.clone(),
        metrics.clone(),
    )));
    tasks.extend(spawn_watchers(client, cfg.page_size, &cache, &metrics, &health));
    Ok(RunningAgent {
        cache,
        metrics,
        health,
        http_addr,
        debug_addr,
        cni_facts,
        slots,
        tasks,
    })
}
