//! Wiring of one agent (its context and its tasks): the watchers, the
//! sync loop and the HTTP server, sharing one cache, one metrics registry
//! and one readiness flag (used by `main` and the tests).

use std::net::SocketAddr;
use std::sync::Arc;

use crate::k8s::{spawn_watchers, Cache};
use crate::node::Resolve;
use crate::reconcile::{AgentDataplane, Readiness, SyncConfig, Syncer};
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
}

/// A running agent's handles.
pub struct RunningAgent {
    /// The shared cache (tests inspect it).
    pub cache: Arc<Cache>,
    /// The metrics registry.
    pub metrics: Metrics,
    /// Readiness flag.
    pub readiness: Arc<Readiness>,
    /// Bound address of the HTTP server.
    pub http_addr: Option<SocketAddr>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl RunningAgent {
    /// Whether all lists completed and the first sync was applied.
    pub fn is_ready(&self) -> bool {
        self.cache.all_listed() && self.readiness.first_sync_done()
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
/// sync loop over `dataplane`, and the HTTP server.
pub async fn start<D: AgentDataplane + 'static>(
    cfg: AgentConfig,
    client: kube::Client,
    dataplane: D,
    resolver: Box<dyn Resolve>,
    metrics: Metrics,
) -> Result<RunningAgent, ServerError> {
    let cache = Cache::new(metrics.clone());
    let syncer = Syncer::builder(cache.clone(), dataplane)
        .config(cfg.sync.clone())
        .resolver(resolver)
        .client(client.clone())
        .build();
    let readiness = syncer.readiness();
    let mut tasks = Vec::new();
    let mut http_addr = None;
    if let Some(addr) = cfg.metrics_addr {
        let state = ServerState {
            metrics: metrics.clone(),
            cache: cache.clone(),
            readiness: readiness.clone(),
        };
        let (bound, serve) = server::bind(addr, state).await?;
        http_addr = Some(bound);
        tasks.push(tokio::spawn(async move {
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "metrics server stopped");
            }
        }));
    }
    tasks.push(tokio::spawn(syncer.run()));
    tasks.extend(spawn_watchers(client, cfg.page_size, &cache, &metrics));
    Ok(RunningAgent {
        cache,
        metrics,
        readiness,
        http_addr,
        tasks,
    })
}
