//! Validation of a custom resource against its CRD's structural schema, with the causes
//! (reason, message, field path) worded as the real API server words them: types, `enum`,
//! bounds, lengths, `pattern`, item and property counts, `required`, set and map lists,
//! and the CEL rules of [`super::cel`].

use super::schema::{child, AdditionalProperties, Schema};
use crate::error::Cause;
use serde_json::Value;
use std::collections::HashSet;

/// Collects causes.
struct Out(Vec<Cause>);

impl Out {
    fn push(&mut self, reason: &str, message: String, field: &str) {
        self.0.push(Cause {
            reason: reason.into(),
            message,
            field: field.into(),
        });
    }
    fn invalid(&mut self, field: &str, value: &str, detail: &str) {
        self.push("FieldValueInvalid", format!("Invalid value: {value}: {detail}"), field);
    }
}

/// The JSON type name of a value, as the upstream messages name it.
fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
        Value::Number(_) => "number",
        Value::String(_) => "string",
        Value::Array(_) => "array",
        Value::Object(_) => "object",
    }
}

/// Whether `v` is of the schema type `ty` (an integral float counts as an integer, as the
/// real server decodes it).
fn type_ok(ty: &str, v: &Value) -> bool {
    match ty {
        "object" => v.is_object(),
        "array" => v.is_array(),
        "string" => v.is_string(),
        "boolean" => v.is_boolean(),
        "number" => v.is_number(),
        "integer" => v.is_i64() || v.is_u64() || v.as_f64().is_some_and(|f| f.fract() == 0.0),
        _ => true,
    }
}

/// A value as the upstream messages quote it (`"object"`, `"array"` for compound values).
fn shown(v: &Value) -> String {
    match v {
        Value::Object(_) | Value::Array(_) => format!("\"{}\"", type_name(v)),
        other => other.to_string(),
    }
}

/// Validate a custom resource (after pruning) against its CRD's root schema. `metadata` is
/// validated by the caller (ObjectMeta rules), not by the schema.
pub fn validate_object(root: &Schema, obj: &Value) -> Vec<Cause> {
    let mut out = Out(Vec::new());
    let Some(m) = obj.as_object() else {
        out.invalid("", &shown(obj), "must be an object");
        return out.0;
    };
    for r in &root.required {
        if m.get(r).is_none_or(Value::is_null) {
            out.push("FieldValueRequired", "Required value".into(), r);
        }
    }
    for (k, v) in m {
        if matches!(k.as_str(), "apiVersion" | "kind" | "metadata") {
            continue;
        }
        if let Some(s) = root.properties.get(k) {
            node(s, v, k, &mut out);
        }
    }
    out.0
}

/// Validate `v` at `path` against `s`.
fn node(s: &Schema, v: &Value, path: &str, out: &mut Out) {
    if v.is_null() {
        if !s.nullable {
            if let Some(ty) = &s.ty {
                out.push(
                    "FieldValueTypeInvalid",
                    format!("Invalid value: \"null\": {path} in body must be of type {ty}: \"null\""),
                    path,
                );
            }
        }
        return;
    }
    if s.int_or_string {
        if !(v.is_string() || type_ok("integer", v)) {
            out.push(
                "FieldValueTypeInvalid",
                format!(
                    "Invalid value: \"{t}\": {path} in body must be of type integer-or-string: \"{t}\"",
                    t = type_name(v)
                ),
                path,
            );
            return;
        }
    } else if let Some(ty) = &s.ty {
        if !type_ok(ty, v) {
            out.push(
                "FieldValueTypeInvalid",
                format!(
                    "Invalid value: \"{t}\": {path} in body must be of type {ty}: \"{t}\"",
                    t = type_name(v)
                ),
                path,
            );
            return;
        }
    }
    if let Some(allowed) = &s.enum_values {
        if !allowed.contains(v) {
            let list: Vec<String> = allowed.iter().map(Value::to_string).collect();
            out.push(
                "FieldValueNotSupported",
                format!("Unsupported value: {v}: supported values: {}", list.join(", ")),
                path,
            );
        }
    }
    match v {
        Value::Number(n) => number(s, n.as_f64().unwrap_or(0.0), v, path, out),
        Value::String(st) => string(s, st, v, path, out),
        Value::Array(items) => array(s, items, path, out),
        Value::Object(m) => object(s, m, path, out),
        _ => {}
    }
    for rule in &s.validations {
        let Some(compiled) = rule.compiled else { continue };
        if compiled.eval(v) == Some(false) {
            let field = match rule.field_path.as_deref() {
                Some(fp) if !fp.is_empty() => format!("{path}{fp}"),
                _ => path.to_string(),
            };
            let msg = rule
                .message
                .clone()
                .unwrap_or_else(|| format!("failed rule: {}", rule.rule));
            let reason = rule.reason.as_deref().unwrap_or("FieldValueInvalid");
            out.push(reason, format!("Invalid value: \"{}\": {msg}", type_name(v)), &field);
        }
    }
}

fn number(s: &Schema, f: f64, v: &Value, path: &str, out: &mut Out) {
    if let Some(max) = s.maximum {
        if f > max || (s.exclusive_maximum && f == max) {
            let rel = if s.exclusive_maximum {
                "less than"
            } else {
                "less than or equal to"
            };
            out.invalid(path, &v.to_string(), &format!("{path} in body should be {rel} {max}"));
        }
    }
    if let Some(min) = s.minimum {
        if f < min || (s.exclusive_minimum && f == min) {
            let rel = if s.exclusive_minimum {
                "greater than"
            } else {
                "greater than or equal to"
            };
            out.invalid(path, &v.to_string(), &format!("{path} in body should be {rel} {min}"));
        }
    }
}

fn string(s: &Schema, st: &str, v: &Value, path: &str, out: &mut Out) {
    let len = st.chars().count() as u64;
    if let Some(max) = s.max_length {
        if len > max {
            out.push(
                "FieldValueTooLong",
                format!("Too long: may not be more than {max} bytes"),
                path,
            );
        }
    }
    if let Some(min) = s.min_length {
        if len < min {
            out.invalid(
                path,
                &v.to_string(),
                &format!("{path} in body should be at least {min} chars long"),
            );
        }
    }
    if let (Some(re), Some(p)) = (&s.regex, &s.pattern) {
        if !re.is_match(st) {
            out.invalid(path, &v.to_string(), &format!("{path} in body should match '{p}'"));
        }
    }
}

fn array(s: &Schema, items: &[Value], path: &str, out: &mut Out) {
    let n = items.len() as u64;
    if let Some(max) = s.max_items {
        if n > max {
            out.push(
                "FieldValueTooMany",
                format!("Too many: {n}: must have at most {max} items"),
                path,
            );
        }
    }
    if let Some(min) = s.min_items {
        if n < min {
            out.invalid(
                path,
                &n.to_string(),
                &format!("{path} in body should have at least {min} items"),
            );
        }
    }
    match s.list_type.as_deref() {
        Some("set") => {
            let mut seen = HashSet::new();
            for (i, it) in items.iter().enumerate() {
                if !seen.insert(it.to_string()) {
                    out.push(
                        "FieldValueDuplicate",
                        format!("Duplicate value: {it}"),
                        &format!("{path}[{i}]"),
                    );
                }
            }
        }
        Some("map") if !s.list_map_keys.is_empty() => {
            let mut seen = HashSet::new();
            for (i, it) in items.iter().enumerate() {
                let key: Vec<String> = s
                    .list_map_keys
                    .iter()
                    .map(|k| it.get(k).map(Value::to_string).unwrap_or_default())
                    .collect();
                if !seen.insert(key.clone()) {
                    out.push(
                        "FieldValueDuplicate",
                        format!("Duplicate value: {{{}}}", key.join(", ")),
                        &format!("{path}[{i}]"),
                    );
                }
            }
        }
        _ => {}
    }
    if let Some(is) = &s.items {
        for (i, it) in items.iter().enumerate() {
            node(is, it, &format!("{path}[{i}]"), out);
        }
    }
}

fn object(s: &Schema, m: &serde_json::Map<String, Value>, path: &str, out: &mut Out) {
    let n = m.len() as u64;
    if let Some(max) = s.max_properties {
        if n > max {
            out.push(
                "FieldValueTooMany",
                format!("Too many: {n}: must have at most {max} items"),
                path,
            );
        }
    }
    if let Some(min) = s.min_properties {
        if n < min {
            out.invalid(
                path,
                &n.to_string(),
                &format!("{path} in body should have at least {min} properties"),
            );
        }
    }
    for r in &s.required {
        if m.get(r).is_none_or(Value::is_null) {
            out.push("FieldValueRequired", "Required value".into(), &child(path, r));
        }
    }
    for (k, v) in m {
        if let Some(ps) = s.properties.get(k) {
            node(ps, v, &child(path, k), out);
        } else if let Some(AdditionalProperties::Schema(ap)) = &s.additional_properties {
            node(ap, v, &format!("{path}[{k}]"), out);
        }
    }
}
