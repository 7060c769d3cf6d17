//! Write handlers: create (POST), update (PUT), patch (PATCH, including server-side apply)
//! and delete of one object or a collection, and decoding of request bodies (JSON, YAML,
//! the protobuf namespaces kubectl sends).

use super::resource::{selectors, ResourceRequest};
use super::response::json_response;
use crate::error::ApiError;
use crate::patch::PatchKind;
use axum::body::Bytes;
use axum::http::{header, HeaderMap};
use axum::response::Response;
use serde_json::{json, Value};

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

/// POST on a collection.
pub(super) fn create(req: &ResourceRequest<'_>) -> Result<Response, ApiError> {
    let obj = parse_body(req.body, req.headers)?;
    let created = req.st.store().create(req.kind, req.ns, obj)?;
    Ok(json_response(201, &created))
}

/// PUT on an object or its `/status`.
pub(super) fn update(req: &ResourceRequest<'_>, name: &str) -> Result<Response, ApiError> {
    let obj = parse_body(req.body, req.headers)?;
    let updated = req.st.store().update(req.kind, req.ns, name, obj, req.sub)?;
    Ok(json_response(200, &updated))
}

/// PATCH on an object or its `/status`; 201 when server-side apply created it.
pub(super) fn patch(req: &ResourceRequest<'_>, name: &str) -> Result<Response, ApiError> {
    let ct = content_type(req.headers).unwrap_or("");
    let pk = PatchKind::from_content_type(ct)?;
    let (obj, created) = req.st.store().patch(req.kind, req.ns, name, pk, req.body, req.sub)?;
    Ok(json_response(if created { 201 } else { 200 }, &obj))
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
