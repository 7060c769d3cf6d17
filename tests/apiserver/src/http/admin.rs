//! Admin endpoints under `/admin/`: compaction, fault rules, dropping watches, toggling
//! validation and the request stats (see the crate documentation).

use super::response::{err_response, json_response};
use super::route::is_true;
use super::{AppState, FaultRule};
use crate::error::ApiError;
use axum::http::Method;
use axum::response::Response;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::time::Duration;

/// Serve `METHOD /admin/{what}`; answers are JSON (not counted in the request stats).
pub(super) fn admin_handle(st: &AppState, method: &Method, what: &str, q: &HashMap<String, String>) -> Response {
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
        ("POST", "cnp-versions") => {
            let served: Vec<&str> = q
                .get("served")
                .map(|v| v.split(',').filter(|s| !s.is_empty()).collect())
                .unwrap_or_default();
            st.set_cnp_served_versions(&served)?;
            Ok(json!({"served": served}))
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
