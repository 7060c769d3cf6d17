//! HTTP layer: the single request handler behind every path, which counts the request,
//! applies injected faults and dispatches to the admin endpoints, discovery or the
//! resource handlers.
//!
//! Routing lives in `route`, resource reads (get/list) in `resource`, writes in `write`,
//! watches in `watch`, discovery and OpenAPI in `discovery`, the admin endpoints in `admin`,
//! fault rules in `fault`, the shared state in `state`, response helpers in `response` and
//! the Table answers of custom resources in `table`.

mod admin;
mod discovery;
mod fault;
pub mod portforward;
mod resource;
mod response;
mod route;
mod state;
mod table;
mod watch;
mod write;

pub use fault::{FaultAction, FaultRule};
pub use state::{AppState, Stats};

use crate::error::ApiError;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, Method, Uri};
use axum::response::Response;
use futures_util::StreamExt;
use response::err_response;
use route::{parse_target, query_map, verb_of};
use std::sync::Arc;

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
        return admin::admin_handle(&st, &method, admin, &q);
    }
    if let Some(res) = review(&st, &method, &path, &body) {
        let mut c = st.counters();
        c.requests += 1;
        *c.by_verb.entry("review".into()).or_default() += 1;
        return res;
    }
    let target = parse_target(&path);
    let verb = verb_of(&method, target.as_ref(), &q);
    {
        let mut c = st.counters();
        c.requests += 1;
        *c.by_verb.entry(verb.to_string()).or_default() += 1;
        if let (Some(t), true) = (
            &target,
            matches!(verb, "create" | "update" | "patch" | "delete" | "deletecollection"),
        ) {
            let resource = match &t.sub {
                Some(sub) => format!("{}/{sub}", t.kind.plural()),
                None => t.kind.plural().to_string(),
            };
            *c.writes.entry(resource).or_default() += 1;
        }
    }
    if let Some(FaultAction::Delay(d)) = st.take_fault(&path, verb, true) {
        st.counters().injected_delays += 1;
        tokio::time::sleep(d).await;
    }
    if let Some(FaultAction::Fail(code)) = st.take_fault(&path, verb, false) {
        st.counters().injected_failures += 1;
        return err_response(&ApiError::Injected { code });
    }
    if let Some(t) = &target {
        if !st.store().serves_version(t.kind, &t.version) {
            return response::not_found_path(&path);
        }
    }
    // A custom resource at a version other than the stored one: conversion `None`, only
    // `apiVersion` differs (in the request body and in every object answered).
    let converted = target
        .as_ref()
        .filter(|t| t.version != t.kind.version())
        .map(|t| (t.kind.api_version(), format!("{}/{}", t.kind.group(), t.version)));
    let body = match &converted {
        Some((stored, asked)) => replace_api_version(&body, asked, stored),
        None => body,
    };
    let res = match target {
        None => discovery::discovery(&st, &path),
        Some(t) => match resource::resource(&st, &method, t, &q, &headers, &body).await {
            Ok(r) => r,
            Err(e) => err_response(&e),
        },
    };
    match converted {
        Some((stored, asked)) => {
            let (parts, body) = res.into_parts();
            let chunks = body
                .into_data_stream()
                .map(move |chunk| chunk.map(|b| replace_api_version(&b, stored, &asked)));
            Response::from_parts(parts, axum::body::Body::from_stream(chunks))
        }
        None => res,
    }
}

/// `POST` of a `TokenReview` or `SubjectAccessReview` (answered from
/// [`crate::auth::Auth`], never stored); `None` for any other request.
fn review(st: &AppState, method: &Method, path: &str, body: &Bytes) -> Option<Response> {
    let tokens = path == "/apis/authentication.k8s.io/v1/tokenreviews";
    let access = path == "/apis/authorization.k8s.io/v1/subjectaccessreviews";
    if *method != Method::POST || !(tokens || access) {
        return None;
    }
    let v: serde_json::Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return Some(err_response(&ApiError::BadRequest {
                message: format!("the review is not JSON: {e}"),
            }))
        }
    };
    let auth = st.auth();
    let answer = if tokens {
        auth.token_review(&v)
    } else {
        auth.access_review(&v)
    };
    Some(response::json_response(201, &answer))
}

/// `bytes` with every JSON string `"from"` replaced by `"to"` (an `apiVersion` value; the
/// answers and watch lines of the server are compact JSON, one event per chunk).
fn replace_api_version(bytes: &Bytes, from: &str, to: &str) -> Bytes {
    let (from, to) = (format!("\"{from}\""), format!("\"{to}\""));
    match std::str::from_utf8(bytes) {
        Ok(text) if text.contains(&from) => Bytes::from(text.replace(&from, &to)),
        _ => bytes.clone(),
    }
}
