//! API errors rendered as Kubernetes `Status` objects.

use serde_json::{json, Value};

/// One cause of an `Invalid` (422) error, as in `details.causes[]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Cause {
    /// Machine-readable reason, e.g. `FieldValueRequired`.
    pub reason: String,
    /// Human-readable message, e.g. `Required value: must specify a peer`.
    pub message: String,
    /// The offending field path, e.g. `spec.ingress[0].from[0]`.
    pub field: String,
}

/// An error answered to a client: HTTP status code plus a Kubernetes `Status` body.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ApiError {
    /// 404: the named object (or its namespace) does not exist.
    #[error("{resource} \"{name}\" not found")]
    NotFound {
        /// Plural resource with group, e.g. `networkpolicies.networking.k8s.io`.
        resource: String,
        /// API group, empty for core.
        group: String,
        /// Object name.
        name: String,
    },
    /// 409: create of an object whose name is taken.
    #[error("{resource} \"{name}\" already exists")]
    AlreadyExists {
        /// Plural resource with group.
        resource: String,
        /// API group, empty for core.
        group: String,
        /// Object name.
        name: String,
    },
    /// 409: stale resourceVersion / failed precondition on update, patch or delete.
    #[error("Operation cannot be fulfilled on {resource} \"{name}\": {detail}")]
    Conflict {
        /// Plural resource with group.
        resource: String,
        /// API group, empty for core.
        group: String,
        /// Object name.
        name: String,
        /// Why the operation failed.
        detail: String,
    },
    /// 410: a resourceVersion or continue token older than the compaction point.
    #[error("{message}")]
    Expired {
        /// Explanation, e.g. `too old resource version: 5 (10)`.
        message: String,
    },
    /// 422: validation failed.
    #[error("{kind}.{group_suffix} \"{name}\" is invalid: {}", render_causes(.causes))]
    Invalid {
        /// Kind, e.g. `NetworkPolicy`.
        kind: String,
        /// API group, empty for core.
        group: String,
        /// `networking.k8s.io` or empty (the `.group` suffix of the message).
        group_suffix: String,
        /// Object name.
        name: String,
        /// The failed fields.
        causes: Vec<Cause>,
    },
    /// 400: malformed request (bad body, bad selector, bad parameter).
    #[error("{message}")]
    BadRequest {
        /// Explanation.
        message: String,
    },
    /// 405: the verb is not supported on this path.
    #[error("the server does not allow this method on the requested resource")]
    MethodNotAllowed,
    /// 415: unsupported patch content type.
    #[error("the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {content_type})")]
    UnsupportedMediaType {
        /// The content type that was sent.
        content_type: String,
    },
    /// 504: a resourceVersion newer than the store's.
    #[error("Too large resource version: {requested}, current: {current}")]
    TooLargeResourceVersion {
        /// The requested resourceVersion.
        requested: u64,
        /// The store's current resourceVersion.
        current: u64,
    },
    /// 404: the resource is not served (a custom resource whose CRD is not installed).
    #[error("the server could not find the requested resource ({resource})")]
    NotServed {
        /// Plural resource with group.
        resource: String,
    },
    /// Any status injected by the fault-injection admin endpoint.
    #[error("injected fault: {code}")]
    Injected {
        /// HTTP status code to answer.
        code: u16,
    },
}

fn render_causes(causes: &[Cause]) -> String {
    let parts: Vec<String> = causes.iter().map(|c| format!("{}: {}", c.field, c.message)).collect();
    if parts.len() == 1 {
        parts[0].clone()
    } else {
        format!("[{}]", parts.join(", "))
    }
}

impl ApiError {
    /// The HTTP status code of this error.
    pub fn code(&self) -> u16 {
        match self {
            ApiError::NotFound { .. } | ApiError::NotServed { .. } => 404,
            ApiError::AlreadyExists { .. } | ApiError::Conflict { .. } => 409,
            ApiError::Expired { .. } => 410,
            ApiError::Invalid { .. } => 422,
            ApiError::BadRequest { .. } => 400,
            ApiError::MethodNotAllowed => 405,
            ApiError::UnsupportedMediaType { .. } => 415,
            ApiError::TooLargeResourceVersion { .. } => 504,
            ApiError::Injected { code } => *code,
        }
    }

    /// The `reason` field of the Status object.
    pub fn reason(&self) -> &'static str {
        match self {
            ApiError::NotFound { .. } | ApiError::NotServed { .. } => "NotFound",
            ApiError::AlreadyExists { .. } => "AlreadyExists",
            ApiError::Conflict { .. } => "Conflict",
            ApiError::Expired { .. } => "Expired",
            ApiError::Invalid { .. } => "Invalid",
            ApiError::BadRequest { .. } => "BadRequest",
            ApiError::MethodNotAllowed => "MethodNotAllowed",
            ApiError::UnsupportedMediaType { .. } => "UnsupportedMediaType",
            ApiError::TooLargeResourceVersion { .. } => "Timeout",
            ApiError::Injected { code } => match code {
                429 => "TooManyRequests",
                500 => "InternalError",
                503 => "ServiceUnavailable",
                504 => "Timeout",
                404 => "NotFound",
                409 => "Conflict",
                410 => "Expired",
                _ => "InternalError",
            },
        }
    }

    /// Render as a `Status` object.
    pub fn to_status(&self) -> Value {
        let mut status = json!({
            "kind": "Status",
            "apiVersion": "v1",
            "metadata": {},
            "status": "Failure",
            "message": self.to_string(),
            "reason": self.reason(),
            "code": self.code(),
        });
        let details = match self {
            ApiError::NotFound { resource, group, name }
            | ApiError::AlreadyExists { resource, group, name }
            | ApiError::Conflict {
                resource, group, name, ..
            } => Some(json!({
                "name": name,
                "group": group,
                "kind": resource.split('.').next().unwrap_or(resource),
            })),
            ApiError::Invalid {
                kind,
                group,
                name,
                causes,
                ..
            } => Some(json!({
                "name": name,
                "group": group,
                "kind": kind,
                "causes": causes.iter().map(|c| json!({
                    "reason": c.reason,
                    "message": c.message,
                    "field": c.field,
                })).collect::<Vec<_>>(),
            })),
            ApiError::TooLargeResourceVersion { .. } => Some(json!({
                "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
                "retryAfterSeconds": 1,
            })),
            _ => None,
        };
        if let Some(d) = details {
            status["details"] = d;
        }
        status
    }
}
