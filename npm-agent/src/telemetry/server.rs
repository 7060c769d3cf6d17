//! The agent's HTTP endpoints: `/metrics` (Prometheus text), `/healthz`
//! (the process is alive) and `/readyz` (all three lists completed and the
//! first sync applied).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;

use super::metrics::Metrics;
use crate::k8s::Cache;
use crate::reconcile::Readiness;

/// Errors of the HTTP server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// The listen address could not be bound.
    #[error("metrics server: cannot listen on {addr}: {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What the handlers read.
#[derive(Clone)]
pub struct ServerState {
    /// Metrics to render.
    pub metrics: Metrics,
    /// List completion.
    pub cache: Arc<Cache>,
    /// First-sync flag.
    pub readiness: Arc<Readiness>,
}

async fn metrics(State(s): State<ServerState>) -> impl IntoResponse {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        s.metrics.render(),
    )
}

async fn healthz() -> &'static str {
    "ok\n"
}

async fn readyz(State(s): State<ServerState>) -> (StatusCode, String) {
    let listed = s.cache.all_listed();
    let synced = s.readiness.first_sync_done();
    if listed && synced {
        (StatusCode::OK, "ready\n".into())
    } else {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            format!("not ready: lists complete={listed}, first sync applied={synced}\n"),
        )
    }
}

/// The router of the three endpoints.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Bind `addr`; returns the bound address and the serving future.
pub async fn bind(
    addr: SocketAddr,
    state: ServerState,
) -> Result<(SocketAddr, impl std::future::Future<Output = std::io::Result<()>>), ServerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServerError::Bind { addr, source })?;
    Ok((local, async move { axum::serve(listener, router(state)).await }))
}
