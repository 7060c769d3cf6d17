//! `meta.k8s.io/v1` Table answers for custom resources (what `kubectl get` asks for with
//! `Accept: application/json;as=Table;...`): the Name column, the CRD's
//! `additionalPrinterColumns` (dates as ages, like `5m`), and each row's object as
//! `PartialObjectMetadata` (or the whole object with `includeObject=Object`).

use crate::crd::{InstalledCrd, PrinterColumn};
use axum::http::{header, HeaderMap};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::Arc;

/// Whether the client asks for a Table (the first acceptable type is `as=Table`).
pub(super) fn wants_table(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .and_then(|a| a.split(',').next())
        .is_some_and(|first| first.split(';').any(|p| p.trim() == "as=Table"))
}

/// A duration as Kubernetes' `HumanDuration` prints it (`45s`, `3m20s`, `5h`, `12d`, `2y30d`).
pub(super) fn human_duration(secs: i64) -> String {
    let s = secs.max(0);
    let (m, h) = (s / 60, s / 3600);
    if s < 120 {
        format!("{s}s")
    } else if m < 10 {
        if s % 60 == 0 {
            format!("{m}m")
        } else {
            format!("{m}m{}s", s % 60)
        }
    } else if m < 180 {
        format!("{m}m")
    } else if h < 8 {
        if m % 60 == 0 {
            format!("{h}h")
        } else {
            format!("{h}h{}m", m % 60)
        }
    } else if h < 48 {
        format!("{h}h")
    } else if h < 24 * 8 {
        if h % 24 == 0 {
            format!("{}d", h / 24)
        } else {
            format!("{}d{}h", h / 24, h % 24)
        }
    } else if h < 24 * 365 * 2 {
        format!("{}d", h / 24)
    } else if h < 24 * 365 * 8 {
        let y = h / (24 * 365);
        let d = (h % (24 * 365)) / 24;
        if d == 0 {
            format!("{y}y")
        } else {
            format!("{y}y{d}d")
        }
    } else {
        format!("{}y", h / (24 * 365))
    }
}

/// The cell of `col` for `obj`.
fn cell(col: &PrinterColumn, obj: &Value, now: i64) -> Value {
    let Some(v) = col.value(obj) else {
        return Value::Null;
    };
    match (col.ty.as_str(), v) {
        ("date", Value::String(t)) => match t.parse::<jiff::Timestamp>() {
            Ok(ts) => json!(human_duration(now - ts.as_second())),
            Err(_) => json!("<invalid>"),
        },
        ("string", Value::String(s)) => json!(s),
        ("string", other) => json!(other.to_string()),
        (_, other) => other.clone(),
    }
}

/// The row object: `PartialObjectMetadata`, or the object itself with `includeObject=Object`.
fn row_object(obj: &Value, q: &HashMap<String, String>) -> Value {
    match q.get("includeObject").map(String::as_str) {
        Some("Object") => obj.clone(),
        Some("None") => Value::Null,
        _ => json!({
            "kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj.get("metadata").cloned().unwrap_or(json!({})),
        }),
    }
}

/// A Table of `items` with the list `metadata`.
pub(super) fn table(crd: &InstalledCrd, items: &[Arc<Value>], metadata: Value, q: &HashMap<String, String>) -> Value {
    let now = jiff::Timestamp::now().as_second();
    let mut columns = vec![json!({
        "name": "Name", "type": "string", "format": "name", "priority": 0,
        "description": "Name must be unique within a namespace. Is required when creating resources, although some resources may allow a client to request the generation of an appropriate name automatically. Name is primarily intended for creation idempotence and configuration definition. Cannot be updated. More info: https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names",
    })];
    columns.extend(crd.printer_columns.iter().map(|c| {
        json!({"name": c.name, "type": c.ty, "format": c.format, "description": c.description, "priority": c.priority})
    }));
    let rows: Vec<Value> = items
        .iter()
        .map(|o| {
            let mut cells = vec![o.pointer("/metadata/name").cloned().unwrap_or(Value::Null)];
            cells.extend(crd.printer_columns.iter().map(|c| cell(c, o, now)));
            json!({"cells": cells, "object": row_object(o, q)})
        })
        .collect();
    json!({
        "kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": metadata,
        "columnDefinitions": columns, "rows": rows,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ages_print_like_kubectl() {
        let cases = [
            (5, "5s"),
            (119, "119s"),
            (200, "3m20s"),
            (600, "10m"),
            (3 * 3600 + 60, "3h1m"),
            (30 * 3600, "30h"),
            (3 * 86400 + 3600, "3d1h"),
            (40 * 86400, "40d"),
            (3 * 365 * 86400 + 86400, "3y1d"),
        ];
        for (s, want) in cases {
            assert_eq!(human_duration(s), want, "{s}");
        }
    }

    #[test]
    fn table_is_asked_for_by_the_first_accepted_type() {
        let mut h = HeaderMap::new();
        h.insert(
            header::ACCEPT,
            "application/json;as=Table;v=v1;g=meta.k8s.io,application/json"
                .parse()
                .unwrap(),
        );
        assert!(wants_table(&h));
        h.insert(header::ACCEPT, "application/json".parse().unwrap());
        assert!(!wants_table(&h));
    }
}
