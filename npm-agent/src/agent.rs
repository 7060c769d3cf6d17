//! Wiring of one agent (its context and its tasks): the watchers, the
//! sync loop and the HTTP server, sharing one cache, one metrics registry
//! and one health state (used by `main` and the tests).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::cni::{self, CniConfig, CniContext, CniServerError, FactsHandle, NodeFacts};
use crate::k8s::{spawn_watchers, Cache};
use crate::node::Resolve;
use crate::reconcile::{AgentDataplane, SyncConfig, Syncer};
use crate::telemetry::events::EventRecorder;
use crate::telemetry::health::{Health, HealthConfig};
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
    /// The npm-cni socket (`None`: no CNI server; the agent then learns
    /// pods' addresses and interfaces from the API server and routes only).
    pub cni: Option<CniConfig>,
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
    /// This node's CNI facts (empty without a CNI server).
    pub cni_facts: FactsHandle,
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
/// health settings ([`start_with_health`]).
pub async fn start<D: AgentDataplane + 'static>(
    cfg: AgentConfig,
    client: kube::Client,
    dataplane: D,
    resolver: Box<dyn Resolve>,
    metrics: Metrics,
) -> Result<RunningAgent, StartError> {
    start_with_health(cfg, HealthConfig::default(), client, dataplane, resolver, metrics).await
}

/// [`start`] with the readiness and liveness settings `health`.
pub async fn start_with_health<D: AgentDataplane + 'static>(
    cfg: AgentConfig,
    health: HealthConfig,
    client: kube::Client,
    dataplane: D,
    resolver: Box<dyn Resolve>,
    metrics: Metrics,
) -> Result<RunningAgent, StartError> {
    let cache = Cache::new(metrics.clone());
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
    let syncer = Syncer::builder(cache.clone(), dataplane)
        .config(cfg.sync.clone())
        .resolver(resolver)
        .client(client.clone())
        .events(events)
        .health(health.clone())
        .node_facts(cni_facts.clone())
        .build();
    let mut tasks = vec![events_task];
    let mut http_addr = None;
    if let Some(addr) = cfg.metrics_addr {
        let state = ServerState {
            metrics: metrics.clone(),
            cache: cache.clone(),
            health: health.clone(),
        };
        let (bound, serve) = server::bind(addr, state).await?;
        http_addr = Some(bound);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        }));
    }
    if let Some(c) = &cfg.cni {
        let ctx = CniContext {
            facts: cni_facts.clone(),
            cache: cache.clone(),
            readiness: health.clone(),
            metrics: metrics.clone(),
            node_name: cfg.sync.compile.node_name.clone(),
            wait_bound: c.wait_bound,
        };
        // Facts of a previous agent whose veth is gone are dropped before
        // the first sync compiles them.
        cni::handler::prune(&ctx);
        tasks.push(tokio::spawn(cni::server::bind(&c.socket, ctx.clone())?));
        tasks.push(tokio::spawn(cni::handler::maintain(ctx)));
    }
    tasks.push(tokio::spawn(syncer.run()));
    tasks.extend(spawn_watchers(client, cfg.page_size, &cache, &metrics));
    Ok(RunningAgent {
        cache,
        metrics,
        health,
        http_addr,
        cni_facts,
        tasks,
    })
}
