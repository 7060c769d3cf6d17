//! Write handlers: create (POST), update (PUT), patch (PATCH, including server-side apply)
//! and delete of one object or a collection, and decoding of request bodies (JSON, YAML,
//! the protobuf namespaces kubectl sends).

use super::resource::{selectors, ResourceRequest};
use super::response::json_response;
use crate::error::ApiError;
use crate::patch::PatchKind;
use crate::store::{FieldValidation, Store};
use axum::body::Bytes;
use axum::http::{header, HeaderMap, HeaderValue};
use axum::response::Response;
use serde_json::{json, Value};
use std::sync::Arc;

/// The request's `Content-Type`, when present and readable.
fn content_type(headers: &HeaderMap) -> Option<&str> {
    headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok())
}

/// Decode a request body by its `Content-Type` (JSON when absent).
fn parse_body(body: &Bytes, headers: &HeaderMap) -> Result<Value, ApiError> {
    let ct = content_type(headers).unwrap_or("application/json");
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

/// Run one write with the request's `fieldValidation` (for custom resources), answering
/// its object with `code` (or 201 when the write says it created) and one `Warning` header
/// per pruned unknown field when the mode is `Warn`.
fn with_field_validation<F>(req: &ResourceRequest<'_>, code: u16, write: F) -> Result<Response, ApiError>
where
    F: FnOnce(&mut Store) -> Result<(Arc<Value>, bool), ApiError>,
{
    let fv: FieldValidation = req.q.get("fieldValidation").map(String::as_str).unwrap_or("").parse()?;
    let (res, pruned) = {
        let mut store = req.st.store();
        store.field_validation = fv;
        store.pruned_fields.clear();
        let res = write(&mut store);
        store.field_validation = FieldValidation::default();
        (res, std::mem::take(&mut store.pruned_fields))
    };
    let (obj, created) = res?;
    let mut resp = json_response(if created { 201 } else { code }, &obj);
    for p in pruned {
        let text = format!(
            "299 - \"unknown field {}\"",
            serde_json::to_string(&p).unwrap_or_default().replace('"', "\\\"")
        );
        if let Ok(v) = HeaderValue::from_str(&text) {
            resp.headers_mut().append(header::WARNING, v);
        }
    }
    Ok(resp)
}

/// POST on a collection.
pub(super) fn create(req: &ResourceRequest<'_>) -> Result<Response, ApiError> {
    let obj = parse_body(req.body, req.headers)?;
    with_field_validation(req, 201, |s| Ok((s.create(req.kind, req.ns, obj)?, true)))
}

/// PUT on an object or its `/status`.
pub(super) fn update(req: &ResourceRequest<'_>, name: &str) -> Result<Response, ApiError> {
    let obj = parse_body(req.body, req.headers)?;
    with_field_validation(req, 200, |s| {
        Ok((s.update(req.kind, req.ns, name, obj, req.sub)?, false))
    })
}

/// PATCH on an object or its `/status`; 201 when server-side apply created it.
pub(super) fn patch(req: &ResourceRequest<'_>, name: &str) -> Result<Response, ApiError> {
    let ct = content_type(req.headers).unwrap_or("");
    let pk = PatchKind::from_content_type(ct)?;
    with_field_validation(req, 200, |s| s.patch(req.kind, req.ns, name, pk, req.body, req.sub))
}

/// DELETE of one object, honouring the DeleteOptions preconditions.
pub(super) fn delete(req: &ResourceRequest<'_>, name: &str) -> Result<Response, ApiError> {
    let opts: Value = if req.body.is_empty() {
        json!({})
    } else {
        parse_body(req.body, req.headers)?
    };
    let pre_rv = opts.pointer("/preconditions/resourceVersion").and_then(Value::as_str);
    let pre_uid = opts.pointer("/preconditions/uid").and_then(Value::as_str);
    let obj = req.st.store().delete(req.kind, req.ns, name, pre_rv, pre_uid)?;
    Ok(json_response(200, &obj))
}

/// DELETE of a collection: every object matching the selectors, answered as a `<Kind>List`.
pub(super) fn delete_collection(req: &ResourceRequest<'_>) -> Result<Response, ApiError> {
    let (kind, ns) = (req.kind, req.ns);
    let sel = selectors(kind, req.q)?;
    let mut store = req.st.store();
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
