//! Resource requests: checks common to every verb (dryRun, subresource, namespace scope),
//! dispatch by method to the read, watch and write handlers, and the read handlers
//! (get and paginated list) with their selector and paging parameters (as Tables for a
//! custom resource when asked).

use super::response::{bytes_response, json_response};
use super::route::{is_true, Target};
use super::watch::watch;
use super::{table, write, AppState};
use crate::crd::InstalledCrd;
use crate::error::ApiError;
use crate::selector::{FieldSelector, LabelSelector, Selectors};
use crate::store::{Kind, ListOpts, Store, Sub};
use axum::body::Bytes;
use axum::http::{HeaderMap, Method};
use axum::response::Response;
use serde_json::json;
use std::collections::HashMap;
use std::sync::Arc;

/// The label and field selectors of the query.
pub(super) fn selectors(kind: Kind, q: &HashMap<String, String>) -> Result<Selectors, ApiError> {
    Ok(Selectors {
        labels: LabelSelector::parse(q.get("labelSelector").map(String::as_str).unwrap_or(""))?,
        fields: FieldSelector::parse(
            q.get("fieldSelector").map(String::as_str).unwrap_or(""),
            kind.field_labels(),
        )?,
    })
}

/// A request on a resource path, as the get, list and write handlers see it.
pub(super) struct ResourceRequest<'a> {
    /// Server state.
    pub(super) st: &'a AppState,
    /// Resource kind.
    pub(super) kind: Kind,
    /// Namespace from the path.
    pub(super) ns: Option<&'a str>,
    /// Addressed subresource.
    pub(super) sub: Sub,
    /// Query parameters.
    pub(super) q: &'a HashMap<String, String>,
    /// Request headers.
    pub(super) headers: &'a HeaderMap,
    /// Request body.
    pub(super) body: &'a Bytes,
}

/// Serve a request on a resource path.
pub(super) async fn resource(
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
    let req = ResourceRequest {
        st,
        kind,
        ns,
        sub,
        q,
        headers,
        body,
    };
    match (method.as_str(), t.name.as_deref()) {
        ("GET", name) if is_true(q, "watch") => {
            let mut sel = selectors(kind, q)?;
            if let Some(n) = name {
                sel.fields.terms.push(("metadata.name".into(), n.into(), false));
            }
            Ok(watch(st.clone(), kind, t.ns.clone(), sel, q))
        }
        ("GET", Some(name)) => get(&req, name),
        ("GET", None) => list(&req),
        ("POST", None) => write::create(&req),
        ("PUT", Some(name)) => write::update(&req, name),
        ("PATCH", Some(name)) => write::patch(&req, name),
        ("DELETE", Some(name)) => write::delete(&req, name),
        ("DELETE", None) => write::delete_collection(&req),
        _ => Err(ApiError::MethodNotAllowed),
    }
}

/// GET of one object.
fn get(req: &ResourceRequest<'_>, name: &str) -> Result<Response, ApiError> {
    let (obj, crd) = {
        let store = req.st.store();
        (store.get(req.kind, req.ns, name)?, table_crd(req, &store))
    };
    if let Some(crd) = crd {
        let rv = obj.pointer("/metadata/resourceVersion").cloned().unwrap_or_default();
        return Ok(json_response(
            200,
            &table::table(&crd, &[obj], json!({"resourceVersion": rv}), req.q),
        ));
    }
    Ok(json_response(200, &obj))
}

/// The CRD whose printer columns answer this request, when it asks for a Table of a
/// custom resource.
fn table_crd(req: &ResourceRequest<'_>, store: &Store) -> Option<Arc<InstalledCrd>> {
    if req.kind == Kind::ClusterNetworkPolicy && table::wants_table(req.headers) {
        store.cnp_crd().cloned()
    } else {
        None
    }
}

/// GET of a collection: one page of the list, serialised outside the store lock.
fn list(req: &ResourceRequest<'_>) -> Result<Response, ApiError> {
    let (kind, q) = (req.kind, req.q);
    let opts = ListOpts {
        namespace: req.ns.map(str::to_string),
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
    let (page, crd) = {
        let store = req.st.store();
        (store.list(kind, &opts)?, table_crd(req, &store))
    };
    if let Some(crd) = crd {
        return Ok(json_response(200, &table::table(&crd, &page.items, page.metadata, q)));
    }
    Ok(bytes_response(200, page.to_json_bytes()))
}
