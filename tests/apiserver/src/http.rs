//! HTTP layer: routing of the Kubernetes REST paths, discovery, watch streaming and the
//! fault-injection admin endpoints.

use crate::error::ApiError;
use crate::patch::PatchKind;
use crate::selector::{FieldSelector, LabelSelector, Selectors};
use crate::store::{EventType, Kind, ListOpts, Store, Sub};
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// What a fault rule does to a matching request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultAction {
    /// Answer this HTTP status (with a Status body) instead of serving the request.
    Fail(u16),
    /// Wait this long before serving the request.
    Delay(Duration),
}

/// A fault applied to the next `count` requests that match.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FaultRule {
    /// How many more requests this rule applies to.
    pub count: u32,
    /// What to do.
    pub action: FaultAction,
    /// Only requests whose path starts with this prefix.
    pub path_prefix: Option<String>,
    /// Only requests of this verb (`get`, `list`, `watch`, `create`, `update`, `patch`,
    /// `delete`, `deletecollection`, `discovery`).
    pub verb: Option<String>,
}

impl FaultRule {
    /// Fail the next `count` requests with HTTP `status`.
    pub fn fail(count: u32, status: u16) -> Self {
        Self {
            count,
            action: FaultAction::Fail(status),
            path_prefix: None,
            verb: None,
        }
    }
    /// Delay the next `count` requests by `delay`.
    pub fn delay(count: u32, delay: Duration) -> Self {
        Self {
            count,
            action: FaultAction::Delay(delay),
            path_prefix: None,
            verb: None,
        }
    }
    /// Restrict to paths starting with `prefix`.
    pub fn path(mut self, prefix: &str) -> Self {
        self.path_prefix = Some(prefix.to_string());
        self
    }
    /// Restrict to one verb (e.g. `list`).
    pub fn verb(mut self, verb: &str) -> Self {
        self.verb = Some(verb.to_string());
        self
    }
    fn matches(&self, path: &str, verb: &str) -> bool {
        self.count > 0
            && self.path_prefix.as_deref().is_none_or(|p| path.starts_with(p))
            && self.verb.as_deref().is_none_or(|v| v == verb)
    }
}

/// Request counters, as reported by `GET /admin/stats`.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Stats {
    /// All API requests (admin requests excluded).
    pub requests: u64,
    /// Requests by verb.
    pub by_verb: BTreeMap<String, u64>,
    /// Requests answered with an injected failure.
    pub injected_failures: u64,
    /// Requests delayed by an injected delay.
    pub injected_delays: u64,
    /// Watches currently open.
    pub open_watches: u64,
    /// Watches opened since start.
    pub watches_started: u64,
    /// The store's current resourceVersion.
    pub resource_version: u64,
    /// The store's compaction revision.
    pub compacted_revision: u64,
}

/// Shared state of a running server.
#[derive(Debug)]
pub struct AppState {
    /// The object store.
    pub store: Mutex<Store>,
    /// Pending fault rules.
    pub faults: Mutex<Vec<FaultRule>>,
    counters: Mutex<Stats>,
    open_watches: AtomicU64,
    drop_watches: tokio::sync::watch::Sender<u64>,
    /// Interval of BOOKMARK events for watches that allow them.
    pub bookmark_interval: Duration,
    /// Address the server listens on.
    pub addr: SocketAddr,
}

impl AppState {
    /// New state around a store.
    pub fn new(store: Store, bookmark_interval: Duration, addr: SocketAddr) -> Self {
        let (drop_watches, _) = tokio::sync::watch::channel(0);
        Self {
            store: Mutex::new(store),
            faults: Mutex::new(Vec::new()),
            counters: Mutex::new(Stats::default()),
            open_watches: AtomicU64::new(0),
            drop_watches,
            bookmark_interval,
            addr,
        }
    }

    /// Lock the store (a poisoned lock is recovered: the store has no invariants spanning
    /// a panic point).
    pub fn store(&self) -> MutexGuard<'_, Store> {
        self.store.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn faults(&self) -> MutexGuard<'_, Vec<FaultRule>> {
        self.faults.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn counters(&self) -> MutexGuard<'_, Stats> {
        self.counters.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Add a fault rule.
    pub fn add_fault(&self, rule: FaultRule) {
        self.faults().push(rule);
    }

    /// Remove all fault rules.
    pub fn clear_faults(&self) {
        self.faults().clear();
    }

    /// End every open watch stream (clients see the stream close and re-watch).
    pub fn drop_watches(&self) {
        self.drop_watches.send_modify(|g| *g += 1);
    }

    /// Current counters.
    pub fn stats(&self) -> Stats {
        let mut s = self.counters().clone();
        s.open_watches = self.open_watches.load(Ordering::SeqCst);
        let st = self.store();
        s.resource_version = st.rev();
        s.compacted_revision = st.compacted();
        s
    }

    /// Take the first matching fault for this request (decrementing its count).
    fn take_fault(&self, path: &str, verb: &str, delay: bool) -> Option<FaultAction> {
        let mut f = self.faults();
        let idx = f
            .iter()
            .position(|r| r.matches(path, verb) && matches!(r.action, FaultAction::Delay(_)) == delay)?;
        f[idx].count -= 1;
        let action = f[idx].action;
        if f[idx].count == 0 {
            f.remove(idx);
        }
        Some(action)
    }
}

fn json_response(code: u16, v: &Value) -> Response {
    bytes_response(code, serde_json::to_vec(v).unwrap_or_default())
}

fn bytes_response(code: u16, body: Vec<u8>) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn err_response(e: &ApiError) -> Response {
    json_response(e.code(), &e.to_status())
}

/// A parsed resource path.
#[derive(Debug)]
struct Target {
    kind: Kind,
    ns: Option<String>,
    name: Option<String>,
    sub: Option<String>,
}

fn kind_for(group: &str, plural: &str) -> Option<Kind> {
    Kind::ALL
        .into_iter()
        .find(|k| k.group() == group && k.plural() == plural)
}

fn parse_target(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", "networking.k8s.io", "v1", rest @ ..] => ("networking.k8s.io", rest),
        _ => return None,
    };
    let t = |kind, ns: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        Some(Target {
            kind,
            ns: ns.map(str::to_string),
            name: name.map(str::to_string),
            sub: sub.map(str::to_string),
        })
    };
    match rest {
        [plural] => t(kind_for(group, plural)?, None, None, None),
        ["namespaces", ns, plural] if group.is_empty() && matches!(*plural, "status" | "finalize") => {
            t(Kind::Namespace, None, Some(ns), Some(plural))
        }
        ["namespaces", ns, plural] => {
            let k = kind_for(group, plural)?;
            k.namespaced().then_some(())?;
            t(k, Some(ns), None, None)
        }
        ["namespaces", ns, plural, name] => {
            let k = kind_for(group, plural)?;
            k.namespaced().then_some(())?;
            t(k, Some(ns), Some(name), None)
        }
        ["namespaces", ns, plural, name, sub] => {
            let k = kind_for(group, plural)?;
            k.namespaced().then_some(())?;
            t(k, Some(ns), Some(name), Some(sub))
        }
        [plural, name] => {
            let k = kind_for(group, plural)?;
            (!k.namespaced()).then_some(())?;
            t(k, None, Some(name), None)
        }
        _ => None,
    }
}

fn query_map(uri: &Uri) -> HashMap<String, String> {
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(uri)
        .map(|q| q.0)
        .unwrap_or_default()
}

fn is_true(q: &HashMap<String, String>, k: &str) -> bool {
    matches!(q.get(k).map(String::as_str), Some("true" | "1"))
}

fn verb_of(method: &Method, target: Option<&Target>, q: &HashMap<String, String>) -> &'static str {
    let Some(t) = target else {
        return "discovery";
    };
    match (method.as_str(), t.name.is_some()) {
        ("GET", _) if is_true(q, "watch") => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "other",
    }
}

/// The single request handler behind every path.
pub async fn handle(
    State(st): State<Arc<AppState>>,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let path = uri.path().to_string();
    let q = query_map(&uri);
    tracing::debug!(%method, %uri, content_type = ?headers.get(header::CONTENT_TYPE), accept = ?headers.get(header::ACCEPT), "request");
    if let Some(admin) = path.strip_prefix("/admin/") {
        return admin_handle(&st, &method, admin, &q);
    }
    let target = parse_target(&path);
    let verb = verb_of(&method, target.as_ref(), &q);
    {
        let mut c = st.counters();
        c.requests += 1;
        *c.by_verb.entry(verb.to_string()).or_default() += 1;
    }
    if let Some(FaultAction::Delay(d)) = st.take_fault(&path, verb, true) {
        st.counters().injected_delays += 1;
        tokio::time::sleep(d).await;
    }
    if let Some(FaultAction::Fail(code)) = st.take_fault(&path, verb, false) {
        st.counters().injected_failures += 1;
        return err_response(&ApiError::Injected { code });
    }
    match target {
        None => discovery(&st, &path),
        Some(t) => match resource(&st, &method, t, &q, &headers, &body).await {
            Ok(r) => r,
            Err(e) => err_response(&e),
        },
    }
}

fn not_found_path(path: &str) -> Response {
    json_response(
        404,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("the server could not find the requested resource ({path})"),
            "reason": "NotFound", "details": {}, "code": 404
        }),
    )
}

fn api_resources(group: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for k in Kind::ALL.into_iter().filter(|k| k.group() == group) {
        let mut verbs = vec!["create", "delete", "get", "list", "patch", "update", "watch"];
        if k.namespaced() {
            verbs.insert(2, "deletecollection");
        }
        let (short, cats): (&[&str], &[&str]) = match k {
            Kind::Namespace => (&["ns"], &[]),
            Kind::Pod => (&["po"], &["all"]),
            Kind::NetworkPolicy => (&["netpol"], &[]),
        };
        let mut r = json!({
            "name": k.plural(), "singularName": k.singular(), "namespaced": k.namespaced(),
            "kind": k.kind(), "verbs": verbs,
        });
        if !short.is_empty() {
            r["shortNames"] = json!(short);
        }
        if !cats.is_empty() {
            r["categories"] = json!(cats);
        }
        out.push(r);
        if k.has_status() {
            out.push(json!({
                "name": format!("{}/status", k.plural()), "singularName": "",
                "namespaced": k.namespaced(), "kind": k.kind(), "verbs": ["get", "patch", "update"],
            }));
        }
    }
    out
}

fn discovery(st: &AppState, path: &str) -> Response {
    let group_net = json!({
        "name": "networking.k8s.io",
        "versions": [{"groupVersion": "networking.k8s.io/v1", "version": "v1"}],
        "preferredVersion": {"groupVersion": "networking.k8s.io/v1", "version": "v1"},
    });
    let v = match path.trim_end_matches('/') {
        "/version" => json!({
            "major": "1", "minor": "34", "emulationMajor": "1", "emulationMinor": "34",
            "gitVersion": "v1.34.0-npm-testapi", "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean", "buildDate": "2025-08-27T00:00:00Z", "goVersion": "go1.24.6",
            "compiler": "gc", "platform": "linux/amd64",
        }),
        "/api" => json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": st.addr.to_string()}],
        }),
        "/api/v1" => json!({
            "kind": "APIResourceList", "groupVersion": "v1", "resources": api_resources(""),
        }),
        "/apis" => json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [group_net]}),
        "/apis/networking.k8s.io" => {
            let mut g = group_net;
            g["kind"] = json!("APIGroup");
            g["apiVersion"] = json!("v1");
            g
        }
        "/apis/networking.k8s.io/v1" => json!({
            "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "networking.k8s.io/v1",
            "resources": api_resources("networking.k8s.io"),
        }),
        "/openapi/v3" => json!({"paths": {
            "api/v1": {"serverRelativeURL": "/openapi/v3/api/v1?hash=npm-testapi-1"},
            "apis/networking.k8s.io/v1": {"serverRelativeURL": "/openapi/v3/apis/networking.k8s.io/v1?hash=npm-testapi-1"},
        }}),
        "/openapi/v3/api/v1" => openapi_v3(""),
        "/openapi/v3/apis/networking.k8s.io/v1" => openapi_v3("networking.k8s.io"),
        "/healthz" | "/readyz" | "/livez" => {
            return Response::builder()
                .header(header::CONTENT_TYPE, "text/plain")
                .body(Body::from("ok"))
                .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
        }
        _ => return not_found_path(path),
    };
    json_response(200, &v)
}

/// A minimal OpenAPI v3 document for one group-version: the resource paths with their
/// operations, `x-kubernetes-group-version-kind` and the `fieldValidation` parameter, which is
/// what kubectl checks to use server-side field validation instead of a client-side schema.
fn openapi_v3(group: &str) -> Value {
    let mut paths = serde_json::Map::new();
    let param = |name: &str, loc: &str| json!({"name": name, "in": loc, "schema": {"type": "string"}, "required": loc == "path"});
    for k in Kind::ALL.into_iter().filter(|k| k.group() == group) {
        let base = if group.is_empty() {
            "/api/v1".to_string()
        } else {
            format!("/apis/{group}/v1")
        };
        let gvk = json!({"group": group, "version": "v1", "kind": k.kind()});
        let op = |action: &str, extra: &[Value]| {
            let mut params = vec![
                param("fieldValidation", "query"),
                param("fieldManager", "query"),
                param("dryRun", "query"),
            ];
            params.extend_from_slice(extra);
            json!({
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": params,
                "responses": {"200": {"description": "OK"}},
            })
        };
        let (coll, item, mut item_params) = if k.namespaced() {
            (
                format!("{base}/namespaces/{{namespace}}/{}", k.plural()),
                format!("{base}/namespaces/{{namespace}}/{}/{{name}}", k.plural()),
                vec![param("namespace", "path")],
            )
        } else {
            (
                format!("{base}/{}", k.plural()),
                format!("{base}/{}/{{name}}", k.plural()),
                vec![],
            )
        };
        let coll_params = item_params.clone();
        item_params.push(param("name", "path"));
        paths.insert(
            coll,
            json!({
                "get": op("list", &coll_params),
                "post": op("post", &coll_params),
            }),
        );
        paths.insert(
            item.clone(),
            json!({
                "get": op("get", &item_params),
                "put": op("put", &item_params),
                "patch": op("patch", &item_params),
                "delete": op("delete", &item_params),
            }),
        );
        if k.has_status() {
            paths.insert(
                format!("{item}/status"),
                json!({
                    "get": op("get", &item_params),
                    "put": op("put", &item_params),
                    "patch": op("patch", &item_params),
                }),
            );
        }
    }
    json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.34.0"},
        "paths": paths,
        "components": {"schemas": {}},
    })
}

fn selectors(kind: Kind, q: &HashMap<String, String>) -> Result<Selectors, ApiError> {
    Ok(Selectors {
        labels: LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))?,
        fields: FieldSelector::parse(
            q.get("fieldSelector").map(String::as_str).unwrap_or(""),
            kind.field_labels(),
        )?,
    })
}

fn parse_body(body: &Bytes, headers: &HeaderMap) -> Result<Value, ApiError> {
    let ct = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("application/json");
    if ct.contains("protobuf") {
        return crate::proto::decode_namespace(body);
    }
    if ct.contains("cbor") {
        return Err(ApiError::UnsupportedMediaType {
            content_type: ct.to_string(),
        });
    }
    if ct.contains("yaml") {
        serde_yaml::from_slice(body).map_err(|e| ApiError::BadRequest {
            message: format!("error decoding YAML body: {e}"),
        })
    } else {
        serde_json::from_slice(body).map_err(|e| ApiError::BadRequest {
            message: format!("error decoding JSON body: {e}"),
        })
    }
}

async fn resource(
    st: &Arc<AppState>,
    method: &Method,
    t: Target,
    q: &HashMap<String, String>,
    headers: &HeaderMap,
    body: &Bytes,
) -> Result<Response, ApiError> {
    if is_true(q, "dryRun") || q.get("dryRun").is_some_and(|v| v == "All") {
        return Err(ApiError::BadRequest {
            message: "dryRun is not supported by npm-testapi".into(),
        });
    }
    let kind = t.kind;
    let ns = t.ns.as_deref();
    let sub = match t.sub.as_deref() {
        None => Sub::Main,
        Some("status") if kind.has_status() => Sub::Status,
        Some(other) => {
            return Err(ApiError::BadRequest {
                message: format!("subresource {other:?} is not served for {}", kind.plural()),
            })
        }
    };
    if kind.namespaced() && ns.is_none() && (t.name.is_some() || *method != Method::GET) {
        return Err(ApiError::MethodNotAllowed);
    }
    match (method.as_str(), t.name.as_deref()) {
        ("GET", name) if is_true(q, "watch") => {
            let mut sel = selectors(kind, q)?;
            if let Some(n) = name {
                sel.fields.terms.push(("metadata.name".into(), n.into(), false));
            }
            Ok(watch(st.clone(), kind, t.ns.clone(), sel, q))
        }
        ("GET", Some(name)) => {
            let obj = st.store().get(kind, ns, name)?;
            Ok(json_response(200, &obj))
        }
        ("GET", None) => {
            let opts = ListOpts {
                namespace: t.ns.clone(),
                selectors: selectors(kind, q)?,
                limit: match q.get("limit") {
                    Some(l) => Some(l.parse().map_err(|_| ApiError::BadRequest {
                        message: format!("invalid limit {l:?}"),
                    })?),
                    None => None,
                },
                continue_token: q.get("continue").cloned(),
                resource_version: q.get("resourceVersion").cloned(),
                resource_version_match: q.get("resourceVersionMatch").cloned(),
            };
            let page = st.store().list(kind, &opts)?;
            Ok(bytes_response(200, page.to_json_bytes()))
        }
        ("POST", None) => {
            let obj = parse_body(body, headers)?;
            let created = st.store().create(kind, ns, obj)?;
            Ok(json_response(201, &created))
        }
        ("PUT", Some(name)) => {
            let obj = parse_body(body, headers)?;
            let updated = st.store().update(kind, ns, name, obj, sub)?;
            Ok(json_response(200, &updated))
        }
        ("PATCH", Some(name)) => {
            let ct = headers
                .get(header::CONTENT_TYPE)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("");
            let pk = PatchKind::from_content_type(ct)?;
            let (obj, created) = st.store().patch(kind, ns, name, pk, body, sub)?;
            Ok(json_response(if created { 201 } else { 200 }, &obj))
        }
        ("DELETE", Some(name)) => {
            let opts: Value = if body.is_empty() {
                json!({})
            } else {
                parse_body(body, headers)?
            };
            let pre_rv = opts.pointer("/preconditions/resourceVersion").and_then(Value::as_str);
            let pre_uid = opts.pointer("/preconditions/uid").and_then(Value::as_str);
            let obj = st.store().delete(kind, ns, name, pre_rv, pre_uid)?;
            Ok(json_response(200, &obj))
        }
        ("DELETE", None) => {
            let sel = selectors(kind, q)?;
            let mut store = st.store();
            let victims: Vec<String> = store
                .current(kind, ns)
                .into_iter()
                .filter(|o| sel.matches(o))
                .filter_map(|o| o.pointer("/metadata/name").and_then(Value::as_str).map(str::to_string))
                .collect();
            let mut items = Vec::new();
            for n in victims {
                items.push((*store.delete(kind, ns, &n, None, None)?).clone());
            }
            let rv = store.rev();
            Ok(json_response(
                200,
                &json!({
                    "kind": format!("{}List", kind.kind()), "apiVersion": kind.api_version(),
                    "metadata": {"resourceVersion": rv.to_string()}, "items": items,
                }),
            ))
        }
        _ => Err(ApiError::MethodNotAllowed),
    }
}

struct WatchGuard(Arc<AppState>);

impl Drop for WatchGuard {
    fn drop(&mut self) {
        self.0.open_watches.fetch_sub(1, Ordering::SeqCst);
    }
}

/// One watch event as a JSON line (`{"type":...,"object":...}`).
fn event_line(ty: &str, obj: &Value) -> Bytes {
    let mut v = format!("{{\"type\":\"{ty}\",\"object\":").into_bytes();
    // Writing a JSON value into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut v, obj);
    v.extend_from_slice(b"}\n");
    Bytes::from(v)
}

fn bookmark(kind: Kind, rv: u64, initial_end: bool) -> Bytes {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    event_line(
        "BOOKMARK",
        &json!({"kind": kind.kind(), "apiVersion": kind.api_version(), "metadata": meta}),
    )
}

fn watch(st: Arc<AppState>, kind: Kind, ns: Option<String>, sel: Selectors, q: &HashMap<String, String>) -> Response {
    let rv_param = q.get("resourceVersion").cloned().unwrap_or_default();
    let bookmarks = is_true(q, "allowWatchBookmarks");
    let send_initial = is_true(q, "sendInitialEvents");
    let timeout = q
        .get("timeoutSeconds")
        .and_then(|s| s.parse::<u64>().ok())
        .map(Duration::from_secs);
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(1024);
    st.open_watches.fetch_add(1, Ordering::SeqCst);
    st.counters().watches_started += 1;
    let guard = WatchGuard(st.clone());
    let mut drop_rx = st.drop_watches.subscribe();
    drop_rx.borrow_and_update();
    tokio::spawn(async move {
        let _guard = guard;
        let in_scope = |o: &Value| {
            ns.as_deref()
                .is_none_or(|n| o.pointer("/metadata/namespace").and_then(Value::as_str) == Some(n))
                && sel.matches(o)
        };
        let deadline = timeout.map(|t| tokio::time::Instant::now() + t);
        let (mut rev_rx, mut cursor, initial) = {
            let store = st.store();
            let rev_rx = store.subscribe();
            let initial = rv_param.is_empty() || rv_param == "0" || send_initial;
            let cursor = if initial {
                store.rev()
            } else {
                match rv_param.parse::<u64>() {
                    Ok(n) => n,
                    Err(_) => {
                        let e = ApiError::BadRequest {
                            message: format!("invalid resource version {rv_param:?}"),
                        };
                        let _ = tx.try_send(event_line("ERROR", &e.to_status()));
                        return;
                    }
                }
            };
            let mut lines = Vec::new();
            if initial {
                for o in store.current(kind, ns.as_deref()) {
                    if in_scope(&o) {
                        lines.push(event_line("ADDED", &o));
                    }
                }
            }
            drop(store);
            (rev_rx, cursor, lines)
        };
        for l in initial {
            if tx.send(l).await.is_err() {
                return;
            }
        }
        if send_initial && bookmarks && tx.send(bookmark(kind, cursor, true)).await.is_err() {
            return;
        }
        let mut tick = tokio::time::interval(st.bookmark_interval);
        tick.tick().await;
        rev_rx.mark_changed();
        loop {
            let sleep_deadline = async {
                match deadline {
                    Some(d) => tokio::time::sleep_until(d).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                changed = rev_rx.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    let (lines, terminal) = {
                        let store = st.store();
                        match store.events_after(kind, cursor) {
                            Err(e) => (vec![event_line("ERROR", &e.to_status())], true),
                            Ok(evs) => {
                                let mut lines = Vec::new();
                                for ev in evs {
                                    let now_in = in_scope(&ev.obj);
                                    let was_in = ev.prev.as_deref().is_some_and(&in_scope);
                                    match ev.ty {
                                        EventType::Added if now_in => lines.push(event_line("ADDED", &ev.obj)),
                                        EventType::Deleted if was_in || now_in => lines.push(event_line("DELETED", &ev.obj)),
                                        EventType::Modified => match (was_in, now_in) {
                                            (true, true) => lines.push(event_line("MODIFIED", &ev.obj)),
                                            (false, true) => lines.push(event_line("ADDED", &ev.obj)),
                                            (true, false) => {
                                                let mut o = ev.prev.as_deref().cloned().unwrap_or(Value::Null);
                                                o["metadata"]["resourceVersion"] = json!(ev.rev.to_string());
                                                lines.push(event_line("DELETED", &o));
                                            }
                                            (false, false) => {}
                                        },
                                        _ => {}
                                    }
                                }
                                cursor = cursor.max(store.rev());
                                (lines, false)
                            }
                        }
                    };
                    for l in lines {
                        if tx.send(l).await.is_err() {
                            return;
                        }
                    }
                    if terminal {
                        return;
                    }
                }
                _ = tick.tick(), if bookmarks => {
                    if tx.send(bookmark(kind, cursor, false)).await.is_err() {
                        return;
                    }
                }
                _ = drop_rx.changed() => return,
                _ = sleep_deadline => return,
                _ = tx.closed() => return,
            }
        }
    });
    let stream = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<Bytes, std::convert::Infallible>(b), rx))
    });
    Response::builder()
        .status(200)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CACHE_CONTROL, "no-cache, private")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

fn admin_handle(st: &AppState, method: &Method, what: &str, q: &HashMap<String, String>) -> Response {
    let num = |k: &str, d: u64| -> Result<u64, ApiError> {
        match q.get(k) {
            None => Ok(d),
            Some(v) => v.parse().map_err(|_| ApiError::BadRequest {
                message: format!("admin: parameter {k}={v:?} is not a number"),
            }),
        }
    };
    let rule_filters = |mut r: FaultRule| {
        if let Some(p) = q.get("path") {
            r = r.path(p);
        }
        if let Some(v) = q.get("verb") {
            r = r.verb(v);
        } else if is_true(q, "lists") {
            r = r.verb("list");
        }
        r
    };
    let res: Result<Value, ApiError> = (|| match (method.as_str(), what) {
        ("POST", "compact") => {
            let upto = q.get("revision").map(|_| num("revision", 0)).transpose()?;
            let mut s = st.store();
            let c = s.compact(upto);
            Ok(json!({"compactedRevision": c, "resourceVersion": s.rev()}))
        }
        ("POST", "fail") => {
            let code = num("status", 500)?;
            if !(400..=599).contains(&code) {
                return Err(ApiError::BadRequest {
                    message: format!("admin: status {code} is not an error status"),
                });
            }
            let r = rule_filters(FaultRule::fail(num("count", 1)? as u32, code as u16));
            st.add_fault(r);
            Ok(json!({"ok": true}))
        }
        ("POST", "delay") => {
            let r = rule_filters(FaultRule::delay(
                num("count", 1)? as u32,
                Duration::from_millis(num("ms", 1000)?),
            ));
            st.add_fault(r);
            Ok(json!({"ok": true}))
        }
        ("POST", "clear-faults") => {
            st.clear_faults();
            Ok(json!({"ok": true}))
        }
        ("POST", "drop-watches") => {
            st.drop_watches();
            Ok(json!({"ok": true}))
        }
        ("POST", "validation") => {
            let enabled = !matches!(q.get("enabled").map(String::as_str), Some("false" | "0"));
            st.store().validation = enabled;
            Ok(json!({"validation": enabled}))
        }
        ("GET", "stats") => serde_json::to_value(st.stats()).map_err(|e| ApiError::BadRequest {
            message: format!("admin: stats do not serialize: {e}"),
        }),
        _ => Err(ApiError::BadRequest {
            message: format!("admin: unknown endpoint {method} /admin/{what}"),
        }),
    })();
    match res {
        Ok(v) => json_response(200, &v),
        Err(e) => err_response(&e),
    }
}
