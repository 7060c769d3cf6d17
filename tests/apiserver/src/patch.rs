//! Patch formats: JSON merge patch, strategic merge patch (as merge patch), JSON patch and
//! server-side apply (as a merge of the applied configuration).

use crate::error::ApiError;
use serde_json::Value;

/// The patch types a client may send (from the request's Content-Type).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    /// `application/merge-patch+json` (RFC 7386).
    Merge,
    /// `application/strategic-merge-patch+json`: a merge patch where lists of the pod API with
    /// a merge key (containers, ports, env, volumes, conditions...) merge element-wise, and
    /// the `$patch` / `$deleteFromPrimitiveList` directives are honoured; other lists are
    /// replaced.
    Strategic,
    /// `application/json-patch+json` (RFC 6902).
    Json,
    /// `application/apply-patch+yaml`: the applied configuration is merged onto the live
    /// object (fields the configuration no longer mentions are not removed).
    Apply,
}

impl PatchKind {
    /// Map a Content-Type to a patch kind.
    pub fn from_content_type(ct: &str) -> Result<Self, ApiError> {
        let base = ct.split(';').next().unwrap_or("").trim();
        match base {
            "application/merge-patch+json" => Ok(Self::Merge),
            "application/strategic-merge-patch+json" => Ok(Self::Strategic),
            "application/json-patch+json" => Ok(Self::Json),
            "application/apply-patch+yaml" | "application/apply-patch+cbor" => Ok(Self::Apply),
            _ => Err(ApiError::UnsupportedMediaType {
                content_type: ct.to_string(),
            }),
        }
    }
}

/// RFC 7386 merge patch.
pub fn merge_patch(target: &mut Value, patch: &Value) {
    if let Value::Object(p) = patch {
        if !target.is_object() {
            *target = Value::Object(Default::default());
        }
        let t = target.as_object_mut().expect("made an object above");
        for (k, v) in p {
            if v.is_null() {
                t.remove(k);
            } else {
                merge_patch(t.entry(k.clone()).or_insert(Value::Null), v);
            }
        }
    } else {
        *target = patch.clone();
    }
}

/// Remove strategic-merge-patch directives (`$setElementOrder/...`, `$retainKeys`, `$patch`,
/// `$deleteFromPrimitiveList/...`) so the rest can be applied as a merge patch.
pub fn strip_directives(v: &mut Value) {
    match v {
        Value::Object(m) => {
            m.retain(|k, _| !k.starts_with('$'));
            for x in m.values_mut() {
                strip_directives(x);
            }
        }
        Value::Array(a) => {
            for x in a.iter_mut() {
                strip_directives(x);
            }
        }
        _ => {}
    }
}

/// Merge keys of the strategic-merge lists of the served kinds (field name -> key).
fn merge_key(field: &str) -> Option<&'static str> {
    Some(match field {
        "containers"
        | "initContainers"
        | "ephemeralContainers"
        | "env"
        | "volumes"
        | "imagePullSecrets"
        | "containerStatuses"
        | "initContainerStatuses"
        | "resourceClaims" => "name",
        "ports" => "containerPort",
        "volumeMounts" => "mountPath",
        "volumeDevices" => "devicePath",
        "conditions" | "readinessGates" => "type",
        "podIPs" | "hostIPs" => "ip",
        _ => return None,
    })
}

/// Strategic merge patch (RFC 7386 plus merge-keyed lists and `$` directives).
pub fn strategic_merge(target: &mut Value, patch: &Value) {
    let Value::Object(p) = patch else {
        *target = patch.clone();
        return;
    };
    if p.get("$patch").and_then(Value::as_str) == Some("replace") {
        let mut clean = patch.clone();
        strip_directives(&mut clean);
        *target = clean;
        return;
    }
    if !target.is_object() {
        *target = Value::Object(Default::default());
    }
    let t = target.as_object_mut().expect("made an object above");
    for (k, v) in p {
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Some(del)) = (t.get_mut(field), v.as_array()) {
                list.retain(|x| !del.contains(x));
            }
            continue;
        }
        if k.starts_with('$') {
            continue;
        }
        if v.is_null() {
            t.remove(k);
            continue;
        }
        // Service ports merge on `port`, container ports on `containerPort`.
        let key = match merge_key(k) {
            Some("containerPort")
                if v.as_array().is_some_and(|a| {
                    a.iter()
                        .any(|i| i.get("containerPort").is_none() && i.get("port").is_some())
                }) =>
            {
                Some("port")
            }
            other => other,
        };
        match (key, v, t.get_mut(k)) {
            (Some(key), Value::Array(items), Some(Value::Array(existing))) if items.iter().all(Value::is_object) => {
                for item in items {
                    let id = item.get(key);
                    let pos = id.and_then(|id| existing.iter().position(|e| e.get(key) == Some(id)));
                    let delete = item.get("$patch").and_then(Value::as_str) == Some("delete");
                    match (pos, delete) {
                        (Some(i), true) => {
                            existing.remove(i);
                        }
                        (None, true) => {}
                        (Some(i), false) => strategic_merge(&mut existing[i], item),
                        (None, false) => {
                            let mut clean = item.clone();
                            strip_directives(&mut clean);
                            existing.push(clean);
                        }
                    }
                }
            }
            _ => {
                let slot = t.entry(k.clone()).or_insert(Value::Null);
                if v.is_object() {
                    strategic_merge(slot, v);
                } else {
                    let mut clean = v.clone();
                    strip_directives(&mut clean);
                    *slot = clean;
                }
            }
        }
    }
}

/// Merge without treating null as deletion (used for apply).
fn merge_apply(target: &mut Value, cfg: &Value) {
    match (target, cfg) {
        (Value::Object(t), Value::Object(c)) => {
            for (k, v) in c {
                match t.get_mut(k) {
                    Some(existing) => merge_apply(existing, v),
                    None => {
                        t.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (t, c) => *t = c.clone(),
    }
}

fn unescape(tok: &str) -> String {
    tok.replace("~1", "/").replace("~0", "~")
}

fn bad(msg: String) -> ApiError {
    ApiError::BadRequest { message: msg }
}

fn split_ptr(path: &str) -> Result<(String, String), ApiError> {
    if path.is_empty() {
        return Err(bad("json patch: empty path cannot be modified".into()));
    }
    let idx = path
        .rfind('/')
        .ok_or_else(|| bad(format!("json patch: invalid path {path:?}")))?;
    Ok((path[..idx].to_string(), unescape(&path[idx + 1..])))
}

fn json_add(doc: &mut Value, path: &str, value: Value) -> Result<(), ApiError> {
    let (parent, last) = split_ptr(path)?;
    let p = doc
        .pointer_mut(&parent)
        .ok_or_else(|| bad(format!("json patch: missing parent of path {path:?}")))?;
    match p {
        Value::Object(m) => {
            m.insert(last, value);
            Ok(())
        }
        Value::Array(a) => {
            if last == "-" {
                a.push(value);
                return Ok(());
            }
            let i: usize = last
                .parse()
                .map_err(|_| bad(format!("json patch: bad array index in {path:?}")))?;
            if i > a.len() {
                return Err(bad(format!("json patch: index out of range in {path:?}")));
            }
            a.insert(i, value);
            Ok(())
        }
        _ => Err(bad(format!("json patch: parent of {path:?} is not a container"))),
    }
}

fn json_remove(doc: &mut Value, path: &str) -> Result<Value, ApiError> {
    let (parent, last) = split_ptr(path)?;
    let p = doc
        .pointer_mut(&parent)
        .ok_or_else(|| bad(format!("json patch: missing parent of path {path:?}")))?;
    match p {
        Value::Object(m) => m
            .remove(&last)
            .ok_or_else(|| bad(format!("json patch: path {path:?} does not exist"))),
        Value::Array(a) => {
            let i: usize = last
                .parse()
                .map_err(|_| bad(format!("json patch: bad array index in {path:?}")))?;
            if i >= a.len() {
                return Err(bad(format!("json patch: index out of range in {path:?}")));
            }
            Ok(a.remove(i))
        }
        _ => Err(bad(format!("json patch: parent of {path:?} is not a container"))),
    }
}

/// RFC 6902 JSON patch.
pub fn json_patch(doc: &mut Value, ops: &Value) -> Result<(), ApiError> {
    let ops = ops
        .as_array()
        .ok_or_else(|| bad("json patch: body must be an array of operations".into()))?;
    for op in ops {
        let name = op.get("op").and_then(Value::as_str).unwrap_or("");
        let path = op
            .get("path")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("json patch: operation {op} has no path")))?;
        let value = || {
            op.get("value")
                .cloned()
                .ok_or_else(|| bad(format!("json patch: operation {op} has no value")))
        };
        let from = || {
            op.get("from")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(format!("json patch: operation {op} has no from")))
        };
        match name {
            "add" => json_add(doc, path, value()?)?,
            "remove" => {
                json_remove(doc, path)?;
            }
            "replace" => {
                let target = doc
                    .pointer_mut(path)
                    .ok_or_else(|| bad(format!("json patch: path {path:?} does not exist")))?;
                *target = value()?;
            }
            "move" => {
                let v = json_remove(doc, from()?)?;
                json_add(doc, path, v)?;
            }
            "copy" => {
                let v = doc
                    .pointer(from()?)
                    .cloned()
                    .ok_or_else(|| bad(format!("json patch: from path of {op} does not exist")))?;
                json_add(doc, path, v)?;
            }
            "test" => {
                if doc.pointer(path) != Some(&value()?) {
                    return Err(ApiError::Invalid {
                        kind: "JSONPatch".into(),
                        group: String::new(),
                        group_suffix: "".into(),
                        name: String::new(),
                        causes: vec![crate::error::Cause {
                            reason: "FieldValueInvalid".into(),
                            message: "test operation failed".into(),
                            field: path.to_string(),
                        }],
                    });
                }
            }
            other => return Err(bad(format!("json patch: unknown operation {other:?}"))),
        }
    }
    Ok(())
}

/// Apply a patch body of the given kind to `target`.
pub fn apply_patch(target: &mut Value, kind: PatchKind, body: &[u8]) -> Result<(), ApiError> {
    match kind {
        PatchKind::Merge | PatchKind::Strategic => {
            let p: Value = serde_json::from_slice(body).map_err(|e| bad(format!("error decoding patch: {e}")))?;
            if kind == PatchKind::Strategic {
                strategic_merge(target, &p);
            } else {
                merge_patch(target, &p);
            }
            Ok(())
        }
        PatchKind::Json => {
            let p: Value = serde_json::from_slice(body).map_err(|e| bad(format!("error decoding patch: {e}")))?;
            json_patch(target, &p)
        }
        PatchKind::Apply => {
            let cfg: Value = serde_yaml::from_slice(body)
                .map_err(|e| bad(format!("error decoding YAML apply configuration: {e}")))?;
            merge_apply(target, &cfg);
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn merge_patch_removes_nulls_and_replaces_lists() {
        let mut d = json!({"a": 1, "b": {"c": 2, "d": 3}, "l": [1, 2]});
        merge_patch(&mut d, &json!({"a": null, "b": {"c": 5}, "l": [9]}));
        assert_eq!(d, json!({"b": {"c": 5, "d": 3}, "l": [9]}));
    }

    #[test]
    fn json_patch_ops() {
        let mut d = json!({"a": {"b": [1, 2]}});
        json_patch(
            &mut d,
            &json!([
                {"op": "add", "path": "/a/b/-", "value": 3},
                {"op": "replace", "path": "/a/b/0", "value": 0},
                {"op": "remove", "path": "/a/b/1"},
                {"op": "add", "path": "/x", "value": "y"},
                {"op": "test", "path": "/x", "value": "y"}
            ]),
        )
        .unwrap();
        assert_eq!(d, json!({"a": {"b": [0, 3]}, "x": "y"}));
        assert!(json_patch(&mut d, &json!([{"op": "remove", "path": "/nope"}])).is_err());
        assert!(json_patch(&mut d, &json!([{"op": "test", "path": "/x", "value": 1}])).is_err());
    }

    #[test]
    fn strategic_merge_keyed_lists() {
        let mut pod = json!({"spec": {"containers": [
            {"name": "a", "image": "a:1", "ports": [{"containerPort": 80, "name": "http"}]},
            {"name": "b", "image": "b:1"}
        ]}, "status": {"conditions": [{"type": "Ready", "status": "False"}], "podIPs": [{"ip": "10.0.0.1"}]},
        "metadata": {"finalizers": ["x", "y"]}});
        apply_patch(
            &mut pod,
            PatchKind::Strategic,
            br#"{"$setElementOrder/containers": [{"name": "a"}, {"name": "c"}],
                 "spec": {"containers": [{"name": "a", "image": "a:2"}, {"name": "b", "$patch": "delete"}, {"name": "c", "image": "c:1"}]},
                 "status": {"conditions": [{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}]},
                 "metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}}"#,
        )
        .unwrap();
        assert_eq!(
            pod["spec"]["containers"],
            json!([
                {"name": "a", "image": "a:2", "ports": [{"containerPort": 80, "name": "http"}]},
                {"name": "c", "image": "c:1"}
            ])
        );
        assert_eq!(
            pod["status"]["conditions"],
            json!([{"type": "Ready", "status": "True"}, {"type": "Initialized", "status": "True"}])
        );
        assert_eq!(pod["metadata"]["finalizers"], json!(["y"]));
        // Lists without a merge key (policy rules) are replaced.
        let mut np = json!({"spec": {"ingress": [{"from": []}, {}]}});
        apply_patch(&mut np, PatchKind::Strategic, br#"{"spec": {"ingress": [{}]}}"#).unwrap();
        assert_eq!(np["spec"]["ingress"], json!([{}]));
    }

    #[test]
    fn strategic_directives_stripped() {
        let mut d = json!({"metadata": {"labels": {"a": "1"}}});
        apply_patch(
            &mut d,
            PatchKind::Strategic,
            br#"{"$setElementOrder/x": [1], "metadata": {"labels": {"b": "2", "$patch": "merge"}}}"#,
        )
        .unwrap();
        assert_eq!(d, json!({"metadata": {"labels": {"a": "1", "b": "2"}}}));
    }
}
