//! HTTP responses: JSON and byte bodies, API errors as `Status` objects, and the 404 of
//! an unknown path.

use crate::error::ApiError;
use axum::body::Body;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

/// A response with status `code`, the given `Content-Type` and body.
pub(super) fn body_response(code: u16, content_type: &str, body: Body) -> Response {
    Response::builder()
        .status(StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header(header::CONTENT_TYPE, content_type)
        .body(body)
        .unwrap_or_else(|_| StatusCode::INTERNAL_SERVER_ERROR.into_response())
}

/// A JSON document as the response body.
pub(super) fn json_response(code: u16, v: &Value) -> Response {
    bytes_response(code, serde_json::to_vec(v).unwrap_or_default())
}

/// Already serialised JSON as the response body.
pub(super) fn bytes_response(code: u16, body: Vec<u8>) -> Response {
    body_response(code, "application/json", Body::from(body))
}

/// An API error as its HTTP status and `Status` body.
pub(super) fn err_response(e: &ApiError) -> Response {
    json_response(e.code(), &e.to_status())
}

/// The 404 `Status` of a path the server does not serve.
pub(super) fn not_found_path(path: &str) -> Response {
    json_response(
        404,
        &json!({
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("the server could not find the requested resource ({path})"),
            "reason": "NotFound", "details": {}, "code": 404
        }),
    )
}
