//! The agent's HTTP endpoints: `/metrics` (Prometheus text; the series
//! naming pods and policies only for a bearer token granted `get` on the
//! non-resource URL `/metrics`, see [`authz`](super::authz)), `/explain`
//! (read-only, [`crate::explain`]), `/observe` (the live flow stream,
//! read-only, [`super::observe`]), `/healthz`
//! (the sync loop makes progress) and `/readyz` (all four lists completed,
//! the first sync applied and no other readiness check fails; see
//! [`health`](super::health)). `?verbose` lists the checks one per line,
//! as the kube-apiserver does; a ready agent's plain `/readyz` answers
//! `200 ready`.

use std::net::SocketAddr;
use std::sync::Arc;

use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;

use super::authz::{Decision, MetricsAuth};
use super::health::{Check, Health, CHECK_LISTS};
use super::listener::Bounds;
use super::metrics::Metrics;
use crate::k8s::Cache;

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
    /// Readiness and liveness checks.
    pub health: Arc<Health>,
    /// What the sync loop last programmed (`/explain`).
    pub programmed: crate::explain::ProgrammedView,
    /// The flow-log records the sync loop publishes (`/observe`).
    pub observe: super::observe::ObserveHub,
    /// The reviews of scrape tokens (`/metrics` on the metrics listener).
    pub auth: Arc<MetricsAuth>,
    /// The bounds of `/explain` and `/observe` work.
    pub slots: Slots,
}

/// How many `/explain` answers are computed at once (each runs the
/// classifier's dry run on a blocking thread) and how many `/observe`
/// streams are open at once; a request beyond either gets 429.
#[derive(Clone, Debug)]
pub struct Slots {
    /// `/explain` requests being answered.
    pub explain: Arc<tokio::sync::Semaphore>,
    /// `/observe` streams open.
    pub observe: Arc<tokio::sync::Semaphore>,
}

/// Default bound of concurrent `/explain` answers.
pub const MAX_EXPLAIN: usize = 2;
/// Default bound of open `/observe` streams.
pub const MAX_OBSERVE: usize = 8;

impl Default for Slots {
    fn default() -> Self {
        Slots {
            explain: Arc::new(tokio::sync::Semaphore::new(MAX_EXPLAIN)),
            observe: Arc::new(tokio::sync::Semaphore::new(MAX_OBSERVE)),
        }
    }
}

/// The 429 answer of a request beyond `what`'s bound.
pub fn too_many(what: &str, max: usize) -> Response {
    (
        StatusCode::TOO_MANY_REQUESTS,
        [(header::RETRY_AFTER, "1")],
        format!("{what}: {max} requests are being answered already; retry later\n"),
    )
        .into_response()
}

const PROMETHEUS_TEXT: &str = "text/plain; version=0.0.4";

/// `/metrics` of the node's address: without credentials the series that
/// name no pod or policy; with a bearer token granted `get` on `/metrics`
/// every series; 401 for a token the API server does not authenticate, 403
/// for one without the grant, 503 when the reviews fail.
async fn metrics(State(s): State<ServerState>, headers: HeaderMap) -> Response {
    match s.auth.decide(&headers).await {
        Ok(Decision::Anonymous) => {
            ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], s.metrics.render_public()).into_response()
        }
        Ok(Decision::Allowed) => ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], s.metrics.render()).into_response(),
        Ok(Decision::Unauthenticated(why)) => {
            (StatusCode::UNAUTHORIZED, format!("Unauthorized: {why}\n")).into_response()
        }
        Ok(Decision::Forbidden(why)) => (StatusCode::FORBIDDEN, format!("Forbidden: {why}\n")).into_response(),
        Err(e) => {
            tracing::warn!(error = %e, "a /metrics scrape's token could not be reviewed");
            (
                StatusCode::SERVICE_UNAVAILABLE,
                "the scrape's token could not be reviewed (see the agent's log)\n",
            )
                .into_response()
        }
    }
}

/// `/metrics` of the loopback debug listener: every series.
async fn metrics_full(State(s): State<ServerState>) -> impl IntoResponse {
    ([(header::CONTENT_TYPE, PROMETHEUS_TEXT)], s.metrics.render())
}

/// Whether the query asks for the verbose form (`?verbose`,
/// `?verbose=true` or `?verbose=1`).
fn verbose(uri: &Uri) -> bool {
    uri.query().unwrap_or("").split('&').any(|kv| {
        let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
        k == "verbose" && !matches!(v, "false" | "0")
    })
}

/// The verbose body of `checks`: one line per check, then `<name> check
/// passed` or `<name> check failed`.
fn verbose_body(endpoint: &str, checks: &[Check]) -> String {
    let mut body: String = checks.iter().map(|c| c.line() + "\n").collect();
    let ok = checks.iter().all(Check::ok);
    body.push_str(&format!("{endpoint} check {}\n", if ok { "passed" } else { "failed" }));
    body
}

fn failed_names(checks: &[Check]) -> String {
    let names: Vec<&str> = checks.iter().filter(|c| !c.ok()).map(|c| c.name.as_str()).collect();
    names.join(", ")
}

/// The answer of a health endpoint: 200 or 503 by `checks`; the verbose
/// listing when asked, else `ok_body` or the failure text `failed` gives.
fn answer(
    endpoint: &str,
    uri: &Uri,
    checks: &[Check],
    ok_body: &str,
    failed: impl FnOnce() -> String,
) -> (StatusCode, String) {
    let ok = checks.iter().all(Check::ok);
    let code = if ok {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    if verbose(uri) {
        (code, verbose_body(endpoint, checks))
    } else if ok {
        (code, ok_body.into())
    } else {
        (code, failed())
    }
}

async fn healthz(State(s): State<ServerState>, uri: Uri) -> (StatusCode, String) {
    let checks = s.health.liveness();
    answer("healthz", &uri, &checks, "ok\n", || {
        format!("healthz check failed: {}\n", failed_names(&checks))
    })
}

/// The `lists` check: which of the four lists has not completed.
fn lists_check(cache: &Cache) -> Check {
    let missing: Vec<&str> = [
        ("pods", cache.pods.lock().unwrap_or_else(|p| p.into_inner()).is_listed()),
        (
            "namespaces",
            cache.namespaces.lock().unwrap_or_else(|p| p.into_inner()).is_listed(),
        ),
        (
            "networkpolicies",
            cache.policies.lock().unwrap_or_else(|p| p.into_inner()).is_listed(),
        ),
        (
            crate::k8s::cluster_policy::PLURAL,
            cache
                .cluster_policies
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .is_listed(),
        ),
    ]
    .into_iter()
    .filter(|(_, done)| !done)
    .map(|(name, _)| name)
    .collect();
    Check {
        name: CHECK_LISTS.into(),
        failure: (!missing.is_empty()).then(|| format!("no complete list yet of {}", missing.join(", "))),
    }
}

async fn readyz(State(s): State<ServerState>, uri: Uri) -> (StatusCode, String) {
    let lists = lists_check(&s.cache);
    let listed = lists.ok();
    let mut checks = vec![lists];
    checks.extend(s.health.readiness());
    answer("readyz", &uri, &checks, "ready\n", || {
        format!(
            "not ready: lists complete={listed}, first sync applied={}; failed checks: {} (see /readyz?verbose)\n",
            s.health.first_sync_done(),
            failed_names(&checks)
        )
    })
}

/// The router of the metrics listener: `/metrics`, `/healthz`, `/readyz`
/// (what the kubelet and Prometheus reach on the node's address). Nothing
/// here names a flow or answers a reachability question, and nothing names
/// a pod or policy without a granted token.
pub fn router(state: ServerState) -> Router {
    Router::new()
        .route("/metrics", get(metrics))
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// The router of the debug listener: `/explain`, `/observe` and the whole
/// `/metrics`, which name pods, policies and flows, and `/readyz` (the
/// same checks as the metrics listener's, so that `kubectl npm status`
/// reads why an agent is not ready through the same port-forward). It listens on loopback (`--debug-addr`,
/// `127.0.0.1:9091`): reached from the node itself, or through the API
/// server with `kubectl port-forward` to the agent pod, which needs the
/// caller's RBAC grant of `pods/portforward` in the agent's namespace (the
/// agent is a host-network pod: its loopback is the node's, which no other
/// pod's network namespace reaches).
pub fn debug_router(state: ServerState) -> Router {
    Router::new()
        .route("/explain", get(crate::explain::handler))
        .route("/observe", get(super::observe::handler))
        .route("/metrics", get(metrics_full))
        .route("/readyz", get(readyz))
        .with_state(state)
}

/// Bind `addr`; returns the bound address and the future serving `router`
/// within `bounds` (see [`super::listener`]).
pub async fn bind(
    addr: SocketAddr,
    router: Router,
    bounds: Bounds,
) -> Result<(SocketAddr, impl std::future::Future<Output = std::io::Result<()>>), ServerError> {
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| ServerError::Bind { addr, source })?;
    let local = listener
        .local_addr()
        .map_err(|source| ServerError::Bind { addr, source })?;
    Ok((local, super::listener::serve(listener, router, bounds)))
}
