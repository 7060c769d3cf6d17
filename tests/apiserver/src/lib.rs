//! `npm-testapi`: a small Kubernetes-compatible API server for npm's tests and local demo.
//!
//! It serves namespaces, pods (with `/status`), `networking.k8s.io/v1` networkpolicies,
//! `apps/v1` daemonsets (with `/status`), events, services (with `/status`; ClusterIPs from
//! the service CIDRs and NodePorts allocated, see [`ServiceNetwork`]),
//! `discovery.k8s.io/v1` endpointslices, nodes (cluster-scoped, with `/status`),
//! `apiextensions.k8s.io/v1` customresourcedefinitions and, once the ClusterNetworkPolicy CRD
//! is installed (`kubectl apply -f` of a vendored CRD, or [`Options::cnp_crd`]),
//! `policy.networking.k8s.io/v1alpha2` (and, when the CRD serves it, `v1beta1`)
//! clusternetworkpolicies pruned and validated by the
//! installed channel's schema (see [`crd`]), over the real REST protocol (plain HTTP, no auth), so kube-rs and `kubectl` work against
//! it: discovery, create/get/list/update/patch/delete, paginated lists with consistent
//! snapshots, label/field selectors, watches with bookmarks, compaction (410 Gone),
//! upstream-style defaulting and validation (422 with `details.causes[].field`), and
//! fault injection for tests.
//!
//! Custom resources follow a real server's CRD handling: structural pruning of fields the
//! installed schema does not specify, with the request's `fieldValidation` (`Strict`, what
//! kubectl sends, refuses them with 400; `Warn`, the default, answers `Warning` headers;
//! `Ignore`), then the schema's validation and its CEL rules (422). Deleting the CRD deletes
//! its objects. Built-in kinds keep unknown fields as before.
//!
//! Admin endpoints (plain HTTP, JSON answers; not counted in the request stats):
//!
//! - `POST /admin/compact[?revision=R]`: compact the event log (default: at the current
//!   revision). Older resourceVersions then answer 410 Expired (lists with
//!   `resourceVersionMatch=Exact`, continue tokens; watches get an ERROR event with 410).
//! - `POST /admin/fail?count=N&status=S[&path=PREFIX][&verb=V|&lists=true]`: answer the next
//!   N matching requests with status S and a Status body.
//! - `POST /admin/delay?count=N&ms=M[&path=PREFIX][&verb=V|&lists=true]`: delay them.
//! - `POST /admin/cnp-versions?served=v1beta1[,v1alpha2]`: serve ClusterNetworkPolicies at
//!   exactly these versions (`v1alpha2`, `v1beta1`: the same schema, only `apiVersion`
//!   differs; empty: none), as a CRD upgrade flipping `served` does
//!   ([`TestApiServer::set_cnp_served_versions`]).
//! - `POST /admin/clear-faults`, `POST /admin/drop-watches`,
//!   `POST /admin/validation?enabled=false|true`, `GET /admin/stats` ([`Stats`]).
//!
//! `POST /apis/authentication.k8s.io/v1/tokenreviews` and
//! `/apis/authorization.k8s.io/v1/subjectaccessreviews` answer from the tokens and RBAC
//! objects a test registers ([`TestApiServer::add_token`], [`TestApiServer::add_rbac`]; see
//! [`auth`]); requests themselves are not authenticated, except
//! `GET .../pods/{name}/portforward` (WebSocket, `v4.channel.k8s.io`), which needs a
//! registered bearer token granted `create` on `pods/portforward` (401, 403) and forwards
//! to the pod's `status.podIP` (see [`http::portforward`]).
//!
//! Verbs for fault filters: `get`, `list`, `watch`, `create`, `update`, `patch`, `delete`,
//! `deletecollection`, `discovery`; the reviews count as verb `review`. Note that kube-rs retries 429/503/504 by itself.
//!
//! ```no_run
//! # async fn demo() -> Result<(), npm_testapi::ServerError> {
//! let server = npm_testapi::TestApiServer::start(Default::default()).await?;
//! server.kubeconfig(std::path::Path::new("/tmp/kubeconfig.yaml"))?;
//! println!("serving on {}", server.url());
//! server.compact();
//! server.shutdown().await;
//! # Ok(()) }
//! ```
#![deny(missing_docs)]

pub mod auth;
pub mod crd;
pub mod error;
pub mod http;
pub mod patch;
pub mod proto;
pub mod selector;
pub mod store;
pub mod validate;
pub mod validate_network;

pub use crd::CnpChannel;
pub use error::ApiError;
pub use http::{FaultAction, FaultRule, Stats};
pub use store::{Kind, ServiceNetwork};

use http::AppState;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Errors of starting or driving the server.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Binding the listen address failed.
    #[error("binding {addr}: {source}")]
    Bind {
        /// Requested address.
        addr: SocketAddr,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Writing the kubeconfig failed.
    #[error("writing kubeconfig {path}: {source}")]
    Kubeconfig {
        /// Kubeconfig path.
        path: PathBuf,
        /// Underlying error.
        source: std::io::Error,
    },
    /// Building a runtime for a background server failed.
    #[error("creating the tokio runtime for the server: {0}")]
    Runtime(std::io::Error),
    /// Installing the ClusterNetworkPolicy CRD at startup failed.
    #[error("installing the {channel} ClusterNetworkPolicy CRD: {source}")]
    InstallCrd {
        /// The channel.
        channel: CnpChannel,
        /// Store error.
        source: Box<ApiError>,
    },
    /// Seeding an initial namespace failed.
    #[error("seeding namespace {name}: {source}")]
    Seed {
        /// Namespace name.
        name: String,
        /// Store error.
        source: Box<ApiError>,
    },
}

/// Server options.
#[derive(Debug, Clone)]
pub struct Options {
    /// Address to listen on; port 0 picks a free port.
    pub listen: SocketAddr,
    /// Whether writes are validated (defaulting always runs).
    pub validation: bool,
    /// Interval of BOOKMARK events on watches that allow bookmarks.
    pub bookmark_interval: Duration,
    /// Maximum number of events kept in the event log; older ones are compacted away.
    pub max_history: usize,
    /// Namespaces created at startup (a real cluster has `default` and `kube-system`).
    pub seed_namespaces: Vec<String>,
    /// Service CIDRs and NodePort range (default `10.96.0.0/16`, `fd00:96::/112`,
    /// 30000-32767).
    pub service_network: ServiceNetwork,
    /// Install this channel's ClusterNetworkPolicy CRD at startup (None, the default: not
    /// installed, clusternetworkpolicies answer 404 until a CRD is applied, as on a fresh
    /// cluster).
    pub cnp_crd: Option<CnpChannel>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            validation: true,
            bookmark_interval: Duration::from_secs(1),
            max_history: 1_000_000,
            seed_namespaces: vec!["default".into(), "kube-system".into()],
            service_network: ServiceNetwork::default(),
            cnp_crd: None,
        }
    }
}

/// A running server. Dropping it stops the server (as does [`TestApiServer::shutdown`]).
#[derive(Debug)]
pub struct TestApiServer {
    state: Arc<AppState>,
    shutdown_tx: Option<tokio::sync::oneshot::Sender<()>>,
    task: Option<tokio::task::JoinHandle<()>>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl TestApiServer {
    /// Start serving on the current tokio runtime.
    pub async fn start(opts: Options) -> Result<Self, ServerError> {
        let listener = tokio::net::TcpListener::bind(opts.listen)
            .await
            .map_err(|source| ServerError::Bind {
                addr: opts.listen,
                source,
            })?;
        let addr = listener.local_addr().map_err(|source| ServerError::Bind {
            addr: opts.listen,
            source,
        })?;
        let mut store = store::Store::new(opts.validation, opts.max_history);
        store.service_network = opts.service_network.clone();
        for name in &opts.seed_namespaces {
            store
                .create(Kind::Namespace, None, serde_json::json!({"metadata": {"name": name}}))
                .map_err(|source| ServerError::Seed {
                    name: name.clone(),
                    source: Box::new(source),
                })?;
        }
        if let Some(channel) = opts.cnp_crd {
            store
                .install_cnp_crd(channel)
                .map_err(|source| ServerError::InstallCrd {
                    channel,
                    source: Box::new(source),
                })?;
        }
        let state = Arc::new(AppState::new(store, opts.bookmark_interval, addr));
        let app = axum::Router::new()
            .route(
                "/api/v1/namespaces/{ns}/pods/{name}/portforward",
                axum::routing::get(http::portforward::portforward),
            )
            .fallback(http::handle)
            .with_state(state.clone());
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            let serve = axum::serve(listener, app).with_graceful_shutdown(async move {
                let _ = rx.await;
            });
            if let Err(e) = serve.await {
                tracing::error!(error = %e, "npm-testapi server stopped with an error");
            }
        });
        tracing::info!(%addr, "npm-testapi listening");
        Ok(Self {
            state,
            shutdown_tx: Some(tx),
            task: Some(task),
            runtime: None,
        })
    }

    /// Start serving on a private runtime (for synchronous test harnesses).
    pub fn start_background(opts: Options) -> Result<Self, ServerError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .thread_name("npm-testapi")
            .build()
            .map_err(ServerError::Runtime)?;
        let mut server = rt.block_on(Self::start(opts))?;
        server.runtime = Some(rt);
        Ok(server)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.state.addr
    }

    /// `http://ADDR`.
    pub fn url(&self) -> String {
        format!("http://{}", self.state.addr)
    }

    /// The kubeconfig text pointing at this server (context `npm-testapi`, namespace default).
    pub fn kubeconfig_yaml(&self) -> String {
        kubeconfig_yaml(&self.url())
    }

    /// Write a kubeconfig pointing at this server.
    pub fn kubeconfig(&self, path: &Path) -> Result<(), ServerError> {
        std::fs::write(path, self.kubeconfig_yaml()).map_err(|source| ServerError::Kubeconfig {
            path: path.to_path_buf(),
            source,
        })
    }

    /// Compact the event log at the current revision; returns it. Older resourceVersions
    /// (lists with `resourceVersionMatch=Exact`, continue tokens, watches) then get 410.
    pub fn compact(&self) -> u64 {
        self.state.store().compact(None)
    }

    /// The current resourceVersion.
    pub fn resource_version(&self) -> u64 {
        self.state.store().rev()
    }

    /// Add a fault rule (fail or delay the next matching requests).
    pub fn inject(&self, rule: FaultRule) {
        self.state.add_fault(rule);
    }

    /// Fail the next `count` requests whose path starts with `path_prefix` (all when None)
    /// with HTTP `status`.
    pub fn fail_next(&self, count: u32, status: u16, path_prefix: Option<&str>) {
        self.inject_under(FaultRule::fail(count, status), path_prefix);
    }

    /// Delay the next `count` requests whose path starts with `path_prefix` (all when None).
    pub fn delay_next(&self, count: u32, delay: Duration, path_prefix: Option<&str>) {
        self.inject_under(FaultRule::delay(count, delay), path_prefix);
    }

    /// Add `rule`, restricted to paths starting with `path_prefix` (all when None).
    fn inject_under(&self, mut rule: FaultRule, path_prefix: Option<&str>) {
        if let Some(p) = path_prefix {
            rule = rule.path(p);
        }
        self.inject(rule);
    }

    /// Remove all pending fault rules.
    pub fn clear_faults(&self) {
        self.state.clear_faults();
    }

    /// Close every open watch stream.
    pub fn drop_watches(&self) {
        self.state.drop_watches();
    }

    /// Turn validation on or off (defaulting always runs).
    pub fn set_validation(&self, enabled: bool) {
        self.state.store().validation = enabled;
    }

    /// Create an object directly in the store, bypassing HTTP (for seeding large states
    /// quickly). Same defaulting, validation, metadata and watch events as a POST.
    pub fn create_object(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        obj: serde_json::Value,
    ) -> Result<serde_json::Value, ApiError> {
        let created = self.state.store().create(kind, namespace, obj)?;
        Ok((*created).clone())
    }

    /// Install (or replace with) the vendored ClusterNetworkPolicy CRD of `channel`, as
    /// `kubectl apply -f` of its file does; returns the stored CRD. Stored
    /// clusternetworkpolicies are re-pruned by the new schema.
    pub fn install_cnp_crd(&self, channel: CnpChannel) -> Result<serde_json::Value, ApiError> {
        Ok((*self.state.store().install_cnp_crd(channel)?).clone())
    }

    /// Serve ClusterNetworkPolicies at exactly the versions `served`, among
    /// [`crd::CNP_VERSIONS`] (`v1alpha2`, `v1beta1`; none is allowed), as a CRD upgrade that
    /// flips `spec.versions[].served` does: the installed CRD is updated (a `v1beta1` entry
    /// added as a copy of `v1alpha2`'s when missing), its objects stay, discovery and the
    /// CRD list the served versions, any other version answers 404, and every open watch
    /// ends. Not found without the CRD.
    pub fn set_cnp_served_versions(&self, served: &[&str]) -> Result<(), ApiError> {
        self.state.set_cnp_served_versions(served)
    }

    /// Delete the ClusterNetworkPolicy CRD: every clusternetworkpolicy is deleted with it
    /// (DELETED events) and the resource answers 404 again.
    pub fn uninstall_cnp_crd(&self) -> Result<(), ApiError> {
        self.state
            .store()
            .delete(Kind::CustomResourceDefinition, None, crd::CNP_CRD_NAME, None, None)
            .map(|_| ())
    }

    /// Registers `token` as authenticating `user` (what a `TokenReview` of it answers).
    pub fn add_token(&self, token: &str, user: auth::UserInfo) {
        self.state.auth().add_token(token, user);
    }

    /// Loads RBAC objects (`ClusterRole`, `ClusterRoleBinding`, `Role`, `RoleBinding`;
    /// others ignored) that `SubjectAccessReview`s are decided by; returns how many.
    pub fn add_rbac(&self, objects: &[serde_json::Value]) -> usize {
        self.state.auth().add_rbac(objects)
    }

    /// Request counters.
    pub fn stats(&self) -> Stats {
        self.state.stats()
    }

    fn stop(&mut self) {
        self.state.drop_watches();
        if let Some(tx) = self.shutdown_tx.take() {
            let _ = tx.send(());
        }
    }

    /// Stop the server and wait (at most 5 s) for it to finish.
    pub async fn shutdown(mut self) {
        self.stop();
        if let Some(task) = self.task.take() {
            let abort = task.abort_handle();
            if tokio::time::timeout(Duration::from_secs(5), task).await.is_err() {
                abort.abort();
            }
        }
    }
}

impl Drop for TestApiServer {
    fn drop(&mut self) {
        self.stop();
        if let Some(task) = self.task.take() {
            task.abort();
        }
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Kubeconfig text for a server at `url` (context/cluster/user `npm-testapi`, no auth).
pub fn kubeconfig_yaml(url: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: npm-testapi\n  cluster:\n    server: {url}\ncontexts:\n- name: npm-testapi\n  context:\n    cluster: npm-testapi\n    user: npm-testapi\n    namespace: default\ncurrent-context: npm-testapi\nusers:\n- name: npm-testapi\n  user: {{}}\npreferences: {{}}\n"
    )
}
