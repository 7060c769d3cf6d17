//! The object store: objects as JSON, one global revision counter, an event log since the
//! last compaction (for watches and consistent paginated lists), defaulting and validation.

use crate::error::ApiError;
use crate::patch::{apply_patch, PatchKind};
use crate::selector::Selectors;
use crate::validate;
use base64::Engine as _;
use serde_json::{json, Value};
use std::collections::{BTreeMap, VecDeque};
use std::ops::Bound;
use std::sync::Arc;

/// The resource kinds the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1` namespaces (cluster-scoped).
    Namespace,
    /// `v1` pods (namespaced, with a status subresource).
    Pod,
    /// `networking.k8s.io/v1` networkpolicies (namespaced).
    NetworkPolicy,
}

impl Kind {
    /// All kinds.
    pub const ALL: [Kind; 3] = [Kind::Namespace, Kind::Pod, Kind::NetworkPolicy];

    fn idx(self) -> usize {
        self as usize
    }
    /// Plural resource name as used in URLs.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Namespace => "namespaces",
            Kind::Pod => "pods",
            Kind::NetworkPolicy => "networkpolicies",
        }
    }
    /// Singular resource name.
    pub fn singular(self) -> &'static str {
        match self {
            Kind::Namespace => "namespace",
            Kind::Pod => "pod",
            Kind::NetworkPolicy => "networkpolicy",
        }
    }
    /// API group ("" for core).
    pub fn group(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io",
            _ => "",
        }
    }
    /// `apiVersion` of objects of this kind.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            _ => "v1",
        }
    }
    /// `kind` of objects of this kind.
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Pod => "Pod",
            Kind::NetworkPolicy => "NetworkPolicy",
        }
    }
    /// Whether objects live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::Namespace)
    }
    /// `plural[.group]`, as used in error messages.
    pub fn resource_ref(self) -> String {
        if self.group().is_empty() {
            self.plural().to_string()
        } else {
            format!("{}.{}", self.plural(), self.group())
        }
    }
    /// Fields accepted in field selectors.
    pub fn field_labels(self) -> &'static [&'static str] {
        match self {
            Kind::Namespace => &["metadata.name", "status.phase"],
            Kind::Pod => &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
            Kind::NetworkPolicy => &["metadata.name", "metadata.namespace"],
        }
    }
    /// Whether this kind has a `/status` subresource.
    pub fn has_status(self) -> bool {
        !matches!(self, Kind::NetworkPolicy)
    }
}

/// Watch event types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventType {
    /// Object created.
    Added,
    /// Object changed.
    Modified,
    /// Object removed.
    Deleted,
}

impl EventType {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            EventType::Added => "ADDED",
            EventType::Modified => "MODIFIED",
            EventType::Deleted => "DELETED",
        }
    }
}

/// One entry of the event log.
#[derive(Debug, Clone)]
pub struct Event {
    /// Revision this change produced.
    pub rev: u64,
    /// Kind of the object.
    pub kind: Kind,
    /// Store key (`ns/name` or `name`).
    pub key: String,
    /// Event type.
    pub ty: EventType,
    /// Object after the change (for deletions: the last state, with the deletion revision).
    pub obj: Arc<Value>,
    /// Object before the change (None for creations).
    pub prev: Option<Arc<Value>>,
}

/// Parameters of a list request.
#[derive(Debug, Clone, Default)]
pub struct ListOpts {
    /// Restrict to one namespace.
    pub namespace: Option<String>,
    /// Label and field selectors.
    pub selectors: Selectors,
    /// Page size (`limit`); None or 0 means all.
    pub limit: Option<usize>,
    /// Continue token of a previous page.
    pub continue_token: Option<String>,
    /// `resourceVersion` parameter.
    pub resource_version: Option<String>,
    /// `resourceVersionMatch` parameter.
    pub resource_version_match: Option<String>,
}

/// One page of a list: shares the stored objects, serialised outside the store lock.
#[derive(Debug, Clone)]
pub struct ListPage {
    /// Kind of the items.
    pub kind: Kind,
    /// The list's `metadata` (resourceVersion, continue, remainingItemCount).
    pub metadata: Value,
    /// The objects.
    pub items: Vec<Arc<Value>>,
}

impl ListPage {
    /// Serialise as a `<Kind>List` JSON document.
    pub fn to_json_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(256 + self.items.len() * 1024);
        out.extend_from_slice(
            format!(
                "{{\"kind\":\"{}List\",\"apiVersion\":\"{}\",\"metadata\":",
                self.kind.kind(),
                self.kind.api_version()
            )
            .as_bytes(),
        );
        // Writing JSON values into a Vec cannot fail.
        let _ = serde_json::to_writer(&mut out, &self.metadata);
        out.extend_from_slice(b",\"items\":[");
        for (i, item) in self.items.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            let _ = serde_json::to_writer(&mut out, item.as_ref());
        }
        out.extend_from_slice(b"]}");
        out
    }

    /// The page as a JSON value.
    pub fn to_value(&self) -> Value {
        json!({
            "kind": format!("{}List", self.kind.kind()),
            "apiVersion": self.kind.api_version(),
            "metadata": self.metadata,
            "items": self.items.iter().map(|i| (**i).clone()).collect::<Vec<_>>(),
        })
    }
}

/// Subresource addressed by a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sub {
    /// The main resource (status changes are ignored for kinds with a status subresource).
    Main,
    /// The `/status` subresource (only status changes are kept).
    Status,
}

/// The object store.
#[derive(Debug)]
pub struct Store {
    rev: u64,
    compacted: u64,
    objects: [BTreeMap<String, Arc<Value>>; 3],
    ns_counts: [std::collections::HashMap<String, usize>; 3],
    history: VecDeque<Event>,
    max_history: usize,
    /// Whether validation runs on writes.
    pub validation: bool,
    notify: tokio::sync::watch::Sender<u64>,
}

fn now_rfc3339() -> String {
    let now = jiff::Timestamp::now();
    jiff::Timestamp::from_second(now.as_second()).unwrap_or(now).to_string()
}

fn new_uid() -> String {
    let mut b: u128 = rand::random();
    b = (b & !(0xf << 76)) | (0x4 << 76);
    b = (b & !(0x3 << 62)) | (0x2 << 62);
    let h = format!("{b:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

fn random_suffix() -> String {
    const CHARS: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    (0..5)
        .map(|_| CHARS[rand::random_range(0..CHARS.len())] as char)
        .collect()
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata")?.get(field)?.as_str()
}

fn rv_of(obj: &Value) -> u64 {
    meta_str(obj, "resourceVersion")
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

fn set_rv(obj: &mut Value, rev: u64) {
    if let Some(m) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        m.insert("resourceVersion".into(), json!(rev.to_string()));
    }
}

fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse().map_err(|_| ApiError::BadRequest {
        message: format!("invalid resource version {s:?}"),
    })
}

/// Decoded continue token.
#[derive(serde::Serialize, serde::Deserialize)]
struct ContinueToken {
    v: String,
    rv: u64,
    start: String,
    /// Items returned by earlier pages (for remainingItemCount).
    #[serde(default)]
    off: usize,
}

fn encode_continue(rv: u64, last_key: &str, off: usize) -> String {
    let t = ContinueToken {
        v: "meta.k8s.io/v1".into(),
        rv,
        start: last_key.to_string(),
        off,
    };
    let raw = serde_json::to_vec(&t).expect("continue token serializes");
    base64::engine::general_purpose::URL_SAFE.encode(raw)
}

fn decode_continue(s: &str) -> Result<ContinueToken, ApiError> {
    let bad = || ApiError::BadRequest {
        message: format!("continue key is not valid: {s:?}"),
    };
    let raw = base64::engine::general_purpose::URL_SAFE.decode(s).map_err(|_| bad())?;
    let t: ContinueToken = serde_json::from_slice(&raw).map_err(|_| bad())?;
    if t.v != "meta.k8s.io/v1" {
        return Err(bad());
    }
    Ok(t)
}

/// Message of the 410 answered to a too-old continue token (as the real server words it).
pub const CONTINUE_EXPIRED: &str = "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.";

/// Key of an object in its kind's map.
pub fn key_of(ns: Option<&str>, name: &str) -> String {
    match ns {
        Some(ns) => format!("{ns}/{name}"),
        None => name.to_string(),
    }
}

impl Store {
    /// An empty store. `max_history` bounds the event log: older events are compacted away.
    pub fn new(validation: bool, max_history: usize) -> Self {
        let (notify, _) = tokio::sync::watch::channel(1);
        Self {
            rev: 1,
            compacted: 1,
            objects: Default::default(),
            ns_counts: Default::default(),
            history: VecDeque::new(),
            max_history: max_history.max(1),
            validation,
            notify,
        }
    }

    /// Current (latest) revision.
    pub fn rev(&self) -> u64 {
        self.rev
    }

    /// Revision at and above which history is still available.
    pub fn compacted(&self) -> u64 {
        self.compacted
    }

    /// Subscribe to revision changes (the value is the latest revision).
    pub fn subscribe(&self) -> tokio::sync::watch::Receiver<u64> {
        self.notify.subscribe()
    }

    /// Number of objects of a kind.
    pub fn count(&self, kind: Kind) -> usize {
        self.objects[kind.idx()].len()
    }

    /// Drop the event log up to `upto` (default: the current revision).
    /// Returns the new compaction revision.
    pub fn compact(&mut self, upto: Option<u64>) -> u64 {
        let upto = upto.unwrap_or(self.rev).min(self.rev).max(self.compacted);
        while self.history.front().is_some_and(|e| e.rev <= upto) {
            self.history.pop_front();
        }
        self.compacted = upto;
        upto
    }

    fn not_found(kind: Kind, name: &str) -> ApiError {
        ApiError::NotFound {
            resource: kind.resource_ref(),
            group: kind.group().into(),
            name: name.into(),
        }
    }

    fn commit(
        &mut self,
        kind: Kind,
        key: String,
        ty: EventType,
        mut obj: Value,
        prev: Option<Arc<Value>>,
    ) -> Arc<Value> {
        self.rev += 1;
        set_rv(&mut obj, self.rev);
        let obj = Arc::new(obj);
        let ns = key.split_once('/').map(|(ns, _)| ns.to_string());
        match ty {
            EventType::Deleted => {
                if self.objects[kind.idx()].remove(&key).is_some() {
                    if let Some(c) = ns.and_then(|ns| self.ns_counts[kind.idx()].get_mut(&ns)) {
                        *c = c.saturating_sub(1);
                    }
                }
            }
            _ => {
                if self.objects[kind.idx()].insert(key.clone(), obj.clone()).is_none() {
                    if let Some(ns) = ns {
                        *self.ns_counts[kind.idx()].entry(ns).or_default() += 1;
                    }
                }
            }
        }
        self.history.push_back(Event {
            rev: self.rev,
            kind,
            key,
            ty,
            obj: obj.clone(),
            prev,
        });
        if self.history.len() > self.max_history {
            if let Some(e) = self.history.pop_front() {
                self.compacted = e.rev;
            }
        }
        self.notify.send_replace(self.rev);
        obj
    }

    fn default_and_validate(&self, kind: Kind, obj: &mut Value) -> Result<(), ApiError> {
        match kind {
            Kind::Namespace => validate::default_namespace(obj),
            Kind::Pod => validate::default_pod(obj),
            Kind::NetworkPolicy => validate::default_network_policy(obj),
        }
        if !self.validation {
            return Ok(());
        }
        let causes = match kind {
            Kind::Namespace => validate::validate_namespace(obj),
            Kind::Pod => validate::validate_pod(obj),
            Kind::NetworkPolicy => validate::validate_network_policy(obj),
        };
        if causes.is_empty() {
            Ok(())
        } else {
            Err(ApiError::Invalid {
                kind: kind.kind().into(),
                group: kind.group().into(),
                group_suffix: kind.group().into(),
                name: meta_str(obj, "name").unwrap_or("").into(),
                causes,
            })
        }
    }

    fn check_type(kind: Kind, obj: &Value) -> Result<(), ApiError> {
        if !obj.is_object() {
            return Err(ApiError::BadRequest {
                message: format!("the body of a {} must be a JSON object", kind.kind()),
            });
        }
        for (field, want) in [("kind", kind.kind()), ("apiVersion", kind.api_version())] {
            if let Some(v) = obj.get(field) {
                if v.as_str() != Some(want) && !v.is_null() {
                    return Err(ApiError::BadRequest {
                        message: format!("the object's {field} {v} does not match the request's {want:?}"),
                    });
                }
            }
        }
        if let Some(m) = obj.get("metadata") {
            if !m.is_object() && !m.is_null() {
                return Err(ApiError::BadRequest {
                    message: "metadata must be an object".into(),
                });
            }
        }
        Ok(())
    }

    fn ensure_namespace(&self, ns: &str) -> Result<(), ApiError> {
        if self.objects[Kind::Namespace.idx()].contains_key(ns) {
            Ok(())
        } else {
            Err(Self::not_found(Kind::Namespace, ns))
        }
    }

    /// Get one object.
    pub fn get(&self, kind: Kind, ns: Option<&str>, name: &str) -> Result<Arc<Value>, ApiError> {
        self.objects[kind.idx()]
            .get(&key_of(ns, name))
            .cloned()
            .ok_or_else(|| Self::not_found(kind, name))
    }

    /// Create an object (POST). `ns` is the namespace from the URL for namespaced kinds.
    pub fn create(&mut self, kind: Kind, ns: Option<&str>, mut obj: Value) -> Result<Arc<Value>, ApiError> {
        Self::check_type(kind, &obj)?;
        obj["kind"] = json!(kind.kind());
        obj["apiVersion"] = json!(kind.api_version());
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        let meta = obj["metadata"].as_object_mut().expect("set above");
        let name = match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => match meta.get("generateName").and_then(Value::as_str) {
                Some(g) if !g.is_empty() => {
                    let n = format!("{g}{}", random_suffix());
                    meta.insert("name".into(), json!(n));
                    n
                }
                _ => String::new(),
            },
        };
        if kind.namespaced() {
            let url_ns = ns.unwrap_or("default");
            if let Some(body_ns) = meta.get("namespace").and_then(Value::as_str) {
                if !body_ns.is_empty() && body_ns != url_ns {
                    return Err(ApiError::BadRequest {
                        message:
                            "the namespace of the provided object does not match the namespace sent on the request"
                                .into(),
                    });
                }
            }
            meta.insert("namespace".into(), json!(url_ns));
        } else {
            meta.remove("namespace");
        }
        meta.remove("resourceVersion");
        meta.remove("deletionTimestamp");
        meta.remove("managedFields");
        meta.insert("uid".into(), json!(new_uid()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        if kind != Kind::Namespace {
            meta.insert("generation".into(), json!(1));
        }
        self.default_and_validate(kind, &mut obj)?;
        let ns_owned = kind.namespaced().then(|| ns.unwrap_or("default").to_string());
        if let Some(n) = &ns_owned {
            self.ensure_namespace(n)?;
        }
        let key = key_of(ns_owned.as_deref(), &name);
        if self.objects[kind.idx()].contains_key(&key) {
            return Err(ApiError::AlreadyExists {
                resource: kind.resource_ref(),
                group: kind.group().into(),
                name,
            });
        }
        Ok(self.commit(kind, key, EventType::Added, obj, None))
    }

    /// Replace an object (PUT, also the final step of PATCH).
    pub fn update(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        mut new: Value,
        sub: Sub,
    ) -> Result<Arc<Value>, ApiError> {
        Self::check_type(kind, &new)?;
        let key = key_of(ns, name);
        let old = self.objects[kind.idx()]
            .get(&key)
            .cloned()
            .ok_or_else(|| Self::not_found(kind, name))?;
        if !new.get("metadata").is_some_and(Value::is_object) {
            new["metadata"] = json!({});
        }
        if let Some(n) = meta_str(&new, "name") {
            if n != name {
                return Err(ApiError::BadRequest {
                    message: format!("the name of the object ({n}) does not match the name on the URL ({name})"),
                });
            }
        }
        if let Some(rv) = meta_str(&new, "resourceVersion") {
            if !rv.is_empty() && rv != meta_str(&old, "resourceVersion").unwrap_or("") {
                return Err(ApiError::Conflict {
                    resource: kind.resource_ref(),
                    group: kind.group().into(),
                    name: name.into(),
                    detail:
                        "the object has been modified; please apply your changes to the latest version and try again"
                            .into(),
                });
            }
        }
        if let Some(uid) = meta_str(&new, "uid") {
            if !uid.is_empty() && Some(uid) != meta_str(&old, "uid") {
                return Err(ApiError::Conflict {
                    resource: kind.resource_ref(),
                    group: kind.group().into(),
                    name: name.into(),
                    detail: format!(
                        "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                        meta_str(&old, "uid").unwrap_or("")
                    ),
                });
            }
        }
        let mut obj = match sub {
            Sub::Status => {
                let mut o = (*old).clone();
                o["status"] = new.get("status").cloned().unwrap_or(json!({}));
                o
            }
            Sub::Main => {
                if kind.has_status() {
                    match old.get("status") {
                        Some(s) => new["status"] = s.clone(),
                        None => {
                            if let Some(o) = new.as_object_mut() {
                                o.remove("status");
                            }
                        }
                    }
                }
                new
            }
        };
        obj["kind"] = json!(kind.kind());
        obj["apiVersion"] = json!(kind.api_version());
        {
            let meta = obj["metadata"].as_object_mut().expect("metadata is an object");
            meta.insert("name".into(), json!(name));
            if let Some(ns) = ns {
                meta.insert("namespace".into(), json!(ns));
            }
            for f in ["uid", "creationTimestamp", "generation"] {
                match old["metadata"].get(f) {
                    Some(v) => meta.insert(f.into(), v.clone()),
                    None => meta.remove(f),
                };
            }
            meta.remove("managedFields");
        }
        self.default_and_validate(kind, &mut obj)?;
        if kind != Kind::Namespace && obj.get("spec") != old.get("spec") {
            let g = old.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(0);
            obj["metadata"]["generation"] = json!(g + 1);
        }
        set_rv(&mut obj, rv_of(&old));
        if obj == *old {
            return Ok(old);
        }
        Ok(self.commit(kind, key, EventType::Modified, obj, Some(old)))
    }

    /// Patch an object (PATCH). Server-side apply creates the object when it is missing.
    /// Returns the object and whether it was created.
    pub fn patch(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        pk: PatchKind,
        body: &[u8],
        sub: Sub,
    ) -> Result<(Arc<Value>, bool), ApiError> {
        let old = match self.get(kind, ns, name) {
            Ok(o) => o,
            Err(e) => {
                if pk == PatchKind::Apply && sub == Sub::Main {
                    let mut obj = json!({"metadata": {"name": name}});
                    apply_patch(&mut obj, pk, body)?;
                    if meta_str(&obj, "name") != Some(name) {
                        return Err(ApiError::BadRequest {
                            message: "the name of the applied object does not match the URL".into(),
                        });
                    }
                    return Ok((self.create(kind, ns, obj)?, true));
                }
                return Err(e);
            }
        };
        let mut obj = (*old).clone();
        apply_patch(&mut obj, pk, body)?;
        if pk == PatchKind::Apply {
            // An apply configuration never carries a precondition.
            set_rv(&mut obj, rv_of(&old));
        }
        Ok((self.update(kind, ns, name, obj, sub)?, false))
    }

    /// Delete an object; deleting a namespace first deletes every object in it.
    /// `precondition_rv`/`precondition_uid` come from DeleteOptions.preconditions.
    pub fn delete(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        precondition_rv: Option<&str>,
        precondition_uid: Option<&str>,
    ) -> Result<Arc<Value>, ApiError> {
        let key = key_of(ns, name);
        let old = self.get(kind, ns, name)?;
        let conflict = |detail: String| ApiError::Conflict {
            resource: kind.resource_ref(),
            group: kind.group().into(),
            name: name.into(),
            detail,
        };
        if let Some(rv) = precondition_rv {
            if Some(rv) != meta_str(&old, "resourceVersion") {
                return Err(conflict(format!(
                    "Precondition failed: ResourceVersion in precondition: {rv}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion").unwrap_or("")
                )));
            }
        }
        if let Some(uid) = precondition_uid {
            if Some(uid) != meta_str(&old, "uid") {
                return Err(conflict(format!(
                    "Precondition failed: UID in precondition: {uid}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or("")
                )));
            }
        }
        if kind == Kind::Namespace {
            let prefix = format!("{name}/");
            for k in [Kind::Pod, Kind::NetworkPolicy] {
                let keys: Vec<String> = self.objects[k.idx()]
                    .range::<String, _>((Bound::Included(&prefix), Bound::Unbounded))
                    .take_while(|(key, _)| key.starts_with(&prefix))
                    .map(|(key, _)| key.clone())
                    .collect();
                for ck in keys {
                    let prev = self.objects[k.idx()][&ck].clone();
                    self.commit(k, ck, EventType::Deleted, (*prev).clone(), Some(prev));
                }
            }
        }
        Ok(self.commit(kind, key, EventType::Deleted, (*old).clone(), Some(old)))
    }

    /// State of the keys of `kind` that changed after `rv` as they were at `rv`.
    fn overrides(&self, kind: Kind, rv: u64) -> BTreeMap<String, Option<Arc<Value>>> {
        let mut out = BTreeMap::new();
        for e in self.history.iter().rev() {
            if e.rev <= rv {
                break;
            }
            if e.kind == kind {
                out.insert(e.key.clone(), e.prev.clone());
            }
        }
        out
    }

    /// Objects of `kind` at revision `rv` (which must be >= the compaction point), in key
    /// order, starting after `after` and restricted to keys with `prefix`.
    pub fn snapshot_iter<'a>(
        &'a self,
        kind: Kind,
        rv: u64,
        prefix: &'a str,
        after: Option<&'a str>,
        overrides: &'a BTreeMap<String, Option<Arc<Value>>>,
    ) -> impl Iterator<Item = (&'a String, &'a Arc<Value>)> + 'a {
        let _ = rv;
        let owned_after = after.map(str::to_string);
        let lower: (Bound<String>, Bound<String>) = match owned_after {
            Some(a) => (Bound::Excluded(a), Bound::Unbounded),
            None => (Bound::Included(prefix.to_string()), Bound::Unbounded),
        };
        let mut base = self.objects[kind.idx()]
            .range(lower.clone())
            .filter(move |(k, _)| !overrides.contains_key(*k))
            .peekable();
        let mut over = overrides
            .range(lower)
            .filter_map(|(k, v)| v.as_ref().map(|v| (k, v)))
            .peekable();
        std::iter::from_fn(move || {
            let take_base = match (base.peek(), over.peek()) {
                (None, None) => return None,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some((bk, _)), Some((ok, _))) => bk < ok,
            };
            if take_base {
                base.next()
            } else {
                over.next()
            }
        })
        .take_while(move |(k, _)| k.starts_with(prefix))
    }

    /// Number of objects with keys under `prefix` at the snapshot described by `overrides`.
    fn count_at(&self, kind: Kind, prefix: &str, overrides: &BTreeMap<String, Option<Arc<Value>>>) -> usize {
        let current = match prefix.strip_suffix('/') {
            Some(ns) => self.ns_counts[kind.idx()].get(ns).copied().unwrap_or(0),
            None => self.objects[kind.idx()].len(),
        };
        let map = &self.objects[kind.idx()];
        let (mut plus, mut minus) = (0usize, 0usize);
        for (k, v) in overrides.iter().filter(|(k, _)| k.starts_with(prefix)) {
            if map.contains_key(k) {
                minus += 1;
            }
            if v.is_some() {
                plus += 1;
            }
        }
        (current + plus).saturating_sub(minus)
    }

    /// List objects (GET on a collection), returning one page of the `<Kind>List`.
    pub fn list(&self, kind: Kind, opts: &ListOpts) -> Result<ListPage, ApiError> {
        let nonempty = |o: &Option<String>| o.as_deref().filter(|s| !s.is_empty()).map(str::to_string);
        let rv_param = nonempty(&opts.resource_version);
        let mut offset = 0usize;
        let (snap_rv, after) = if let Some(c) = nonempty(&opts.continue_token) {
            if rv_param.is_some() {
                return Err(ApiError::BadRequest {
                    message: "specifying resource version is not allowed when using continue".into(),
                });
            }
            let t = decode_continue(&c)?;
            if t.rv < self.compacted {
                return Err(ApiError::Expired {
                    message: CONTINUE_EXPIRED.into(),
                });
            }
            if t.rv > self.rev {
                return Err(ApiError::BadRequest {
                    message: format!("continue key is not valid: revision {} is in the future", t.rv),
                });
            }
            offset = t.off;
            (t.rv, Some(t.start))
        } else {
            match rv_param.as_deref() {
                None | Some("0") => (self.rev, None),
                Some(s) => {
                    let n = parse_rv(s)?;
                    if n > self.rev {
                        return Err(ApiError::TooLargeResourceVersion {
                            requested: n,
                            current: self.rev,
                        });
                    }
                    if opts.resource_version_match.as_deref() == Some("Exact") {
                        if n < self.compacted {
                            return Err(ApiError::Expired {
                                message: format!("too old resource version: {n} ({})", self.compacted),
                            });
                        }
                        (n, None)
                    } else {
                        (self.rev, None)
                    }
                }
            }
        };
        let overrides = if snap_rv < self.rev {
            self.overrides(kind, snap_rv)
        } else {
            BTreeMap::new()
        };
        let prefix = match (&opts.namespace, kind.namespaced()) {
            (Some(ns), true) => format!("{ns}/"),
            _ => String::new(),
        };
        let limit = opts.limit.filter(|l| *l > 0);
        let mut iter = self
            .snapshot_iter(kind, snap_rv, &prefix, after.as_deref(), &overrides)
            .filter(|(_, o)| opts.selectors.matches(o));
        let mut items = Vec::new();
        let mut last_key = None;
        for (k, o) in iter.by_ref() {
            items.push(o.clone());
            last_key = Some(k.clone());
            if limit.is_some_and(|l| items.len() >= l) {
                break;
            }
        }
        let mut metadata = json!({"resourceVersion": snap_rv.to_string()});
        if limit.is_some_and(|l| items.len() >= l) && iter.next().is_some() {
            let returned = offset + items.len();
            metadata["continue"] = json!(encode_continue(snap_rv, last_key.as_deref().unwrap_or(""), returned));
            if opts.selectors.is_empty() {
                let total = self.count_at(kind, &prefix, &overrides);
                metadata["remainingItemCount"] = json!(total.saturating_sub(returned));
            }
        }
        Ok(ListPage { kind, metadata, items })
    }

    /// Events of `kind` after revision `from`, or 410 Expired when `from` is compacted.
    pub fn events_after(&self, kind: Kind, from: u64) -> Result<Vec<Event>, ApiError> {
        if from < self.compacted {
            return Err(ApiError::Expired {
                message: format!("too old resource version: {from} ({})", self.compacted),
            });
        }
        let start = self.history.partition_point(|e| e.rev <= from);
        Ok(self
            .history
            .range(start..)
            .filter(|e| e.kind == kind)
            .cloned()
            .collect())
    }

    /// Current objects of a kind, optionally restricted to a namespace.
    pub fn current(&self, kind: Kind, ns: Option<&str>) -> Vec<Arc<Value>> {
        let prefix = match (ns, kind.namespaced()) {
            (Some(ns), true) => format!("{ns}/"),
            _ => String::new(),
        };
        self.objects[kind.idx()]
            .range(prefix.clone()..)
            .take_while(|(k, _)| k.starts_with(&prefix))
            .map(|(_, v)| v.clone())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(name: &str) -> Value {
        json!({"metadata": {"name": name, "labels": {"app": "x"}},
               "spec": {"containers": [{"name": "c", "image": "i:1"}]}})
    }

    #[test]
    fn pages_count_remaining_items_at_the_snapshot() {
        let mut s = Store::new(true, 1_000_000);
        for ns in ["a", "b"] {
            s.create(Kind::Namespace, None, json!({"metadata": {"name": ns}}))
                .unwrap();
        }
        for i in 0..250 {
            s.create(Kind::Pod, Some("a"), pod(&format!("p{i:03}"))).unwrap();
        }
        s.create(Kind::Pod, Some("b"), pod("other")).unwrap();
        let mut opts = ListOpts {
            namespace: Some("a".into()),
            limit: Some(100),
            ..Default::default()
        };
        let first = s.list(Kind::Pod, &opts).unwrap();
        assert_eq!(first.metadata["remainingItemCount"], 150);
        // Changes after the first page: one deletion ahead, one creation ahead, one in "b".
        s.delete(Kind::Pod, Some("a"), "p180", None, None).unwrap();
        s.create(Kind::Pod, Some("a"), pod("p150x")).unwrap();
        s.create(Kind::Pod, Some("b"), pod("other2")).unwrap();
        opts.continue_token = first.metadata["continue"].as_str().map(str::to_string);
        let second = s.list(Kind::Pod, &opts).unwrap();
        assert_eq!(second.metadata["remainingItemCount"], 50);
        let names: Vec<&str> = second
            .items
            .iter()
            .map(|o| o["metadata"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names.first(), Some(&"p100"));
        assert!(names.contains(&"p180") && !names.contains(&"p150x"));
        opts.continue_token = second.metadata["continue"].as_str().map(str::to_string);
        let third = s.list(Kind::Pod, &opts).unwrap();
        assert_eq!(third.items.len(), 50);
        assert!(third.metadata.get("continue").is_none());
        // The serialised page is the same document as the value form.
        let v: Value = serde_json::from_slice(&third.to_json_bytes()).unwrap();
        assert_eq!(v, third.to_value());
        assert_eq!(v["kind"], "PodList");
        // Current state: 250 pods in "a".
        opts.continue_token = None;
        opts.limit = None;
        assert_eq!(s.list(Kind::Pod, &opts).unwrap().items.len(), 250);
    }
}
