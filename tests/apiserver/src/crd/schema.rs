//! A CRD version's structural schema (`openAPIV3Schema`): its deserialised form, the
//! preparation step that compiles `pattern`s and recognises `x-kubernetes-validations`
//! rules (refusing what it cannot evaluate), and structural pruning (dropping every field the
//! schema does not specify, as the real API server does on write).

use super::cel::CelRule;
use crate::error::Cause;
use serde::Deserialize;
use serde_json::Value;
use std::collections::BTreeMap;

/// `additionalProperties`: a boolean or a schema for every value of a map.
#[derive(Debug, Clone, Deserialize)]
#[serde(untagged)]
pub enum AdditionalProperties {
    /// `true` keeps unknown fields, `false` forbids (prunes) them.
    Allowed(bool),
    /// The schema of every value.
    Schema(Box<Schema>),
}

/// One `x-kubernetes-validations` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ValidationRule {
    /// The CEL expression.
    pub rule: String,
    /// The message of a failure (`failed rule: <rule>` when absent).
    #[serde(default)]
    pub message: Option<String>,
    /// The machine-readable reason (`FieldValueInvalid` when absent).
    #[serde(default)]
    pub reason: Option<String>,
    /// A relative field path the failure is reported at.
    #[serde(default)]
    pub field_path: Option<String>,
    /// The recognised rule (filled in by [`Schema::prepare`]).
    #[serde(skip)]
    pub(super) compiled: Option<CelRule>,
}

/// A node of a structural schema. Keys the server does not act on (`description`,
/// `x-kubernetes-map-type`, `example`, ...) are ignored.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Schema {
    /// `type`: object, array, string, integer, number, boolean (None: any).
    #[serde(rename = "type", default)]
    pub ty: Option<String>,
    /// Known properties of an object.
    #[serde(default)]
    pub properties: BTreeMap<String, Schema>,
    /// Schema of array items.
    #[serde(default)]
    pub items: Option<Box<Schema>>,
    /// Values of a map.
    #[serde(default)]
    pub additional_properties: Option<AdditionalProperties>,
    /// Required properties.
    #[serde(default)]
    pub required: Vec<String>,
    /// Allowed values.
    #[serde(rename = "enum", default)]
    pub enum_values: Option<Vec<Value>>,
    /// Inclusive (unless `exclusiveMinimum`) lower bound of a number.
    #[serde(default)]
    pub minimum: Option<f64>,
    /// Inclusive (unless `exclusiveMaximum`) upper bound of a number.
    #[serde(default)]
    pub maximum: Option<f64>,
    /// Whether `minimum` is exclusive.
    #[serde(default)]
    pub exclusive_minimum: bool,
    /// Whether `maximum` is exclusive.
    #[serde(default)]
    pub exclusive_maximum: bool,
    /// Minimum array length.
    #[serde(default)]
    pub min_items: Option<u64>,
    /// Maximum array length.
    #[serde(default)]
    pub max_items: Option<u64>,
    /// Minimum number of object properties.
    #[serde(default)]
    pub min_properties: Option<u64>,
    /// Maximum number of object properties.
    #[serde(default)]
    pub max_properties: Option<u64>,
    /// Minimum string length (characters).
    #[serde(default)]
    pub min_length: Option<u64>,
    /// Maximum string length (characters).
    #[serde(default)]
    pub max_length: Option<u64>,
    /// Regular expression a string must match.
    #[serde(default)]
    pub pattern: Option<String>,
    /// Whether `null` is accepted.
    #[serde(default)]
    pub nullable: bool,
    /// Keep fields the schema does not specify.
    #[serde(rename = "x-kubernetes-preserve-unknown-fields", default)]
    pub preserve_unknown_fields: bool,
    /// An integer or a string.
    #[serde(rename = "x-kubernetes-int-or-string", default)]
    pub int_or_string: bool,
    /// An embedded object: `apiVersion`, `kind` and `metadata` are kept.
    #[serde(rename = "x-kubernetes-embedded-resource", default)]
    pub embedded_resource: bool,
    /// `atomic`, `set` or `map` for arrays.
    #[serde(rename = "x-kubernetes-list-type", default)]
    pub list_type: Option<String>,
    /// Keys of a `map` list.
    #[serde(rename = "x-kubernetes-list-map-keys", default)]
    pub list_map_keys: Vec<String>,
    /// CEL validation rules.
    #[serde(rename = "x-kubernetes-validations", default)]
    pub validations: Vec<ValidationRule>,
    /// The compiled `pattern` (filled in by [`Schema::prepare`]).
    #[serde(skip)]
    pub(super) regex: Option<regex::Regex>,
}

/// `path.key` (just `key` at the root).
pub(super) fn child(path: &str, key: &str) -> String {
    if path.is_empty() {
        key.to_string()
    } else {
        format!("{path}.{key}")
    }
}

impl Schema {
    /// Compile `pattern`s and recognise the CEL rules of this node and all below it;
    /// `path` is the node's path inside the CRD (for the causes). A pattern that does not
    /// compile or a rule npm-testapi cannot evaluate is a cause: the CRD is refused rather
    /// than served with a validation silently missing.
    pub fn prepare(&mut self, path: &str, causes: &mut Vec<Cause>) {
        if let Some(p) = &self.pattern {
            match regex::Regex::new(p) {
                Ok(r) => self.regex = Some(r),
                Err(e) => causes.push(Cause {
                    reason: "FieldValueInvalid".into(),
                    message: format!("Invalid value: {p:?}: pattern does not compile: {e}"),
                    field: child(path, "pattern"),
                }),
            }
        }
        for (i, v) in self.validations.iter_mut().enumerate() {
            match CelRule::recognise(&v.rule) {
                Some(r) => v.compiled = Some(r),
                None => causes.push(Cause {
                    reason: "FieldValueForbidden".into(),
                    message: format!(
                        "Forbidden: npm-testapi cannot evaluate the CEL rule {:?} (it evaluates only the rules of the vendored ClusterNetworkPolicy CRDs)",
                        v.rule
                    ),
                    field: format!("{}[{i}].rule", child(path, "x-kubernetes-validations")),
                }),
            }
        }
        let props = child(path, "properties");
        for (k, s) in &mut self.properties {
            s.prepare(&format!("{props}[{k}]"), causes);
        }
        if let Some(items) = &mut self.items {
            items.prepare(&child(path, "items"), causes);
        }
        if let Some(AdditionalProperties::Schema(s)) = &mut self.additional_properties {
            s.prepare(&child(path, "additionalProperties"), causes);
        }
    }

    /// Structural pruning of an object at the root of a custom resource: `apiVersion`,
    /// `kind` and `metadata` are kept as they are, every other field is pruned by the schema.
    /// The paths of the pruned fields (`spec.egress[0].to[1].nodes`) are appended to `pruned`.
    pub fn prune_root(&self, obj: &mut Value, pruned: &mut Vec<String>) {
        let Some(m) = obj.as_object_mut() else { return };
        let meta = |k: &str| matches!(k, "apiVersion" | "kind" | "metadata");
        m.retain(|k, _| {
            let keep = meta(k) || self.keeps(k);
            if !keep {
                pruned.push(k.clone());
            }
            keep
        });
        for (k, v) in m.iter_mut() {
            if !meta(k) {
                if let Some(s) = self.properties.get(k) {
                    s.prune(v, k, pruned);
                }
            }
        }
    }

    /// Whether an object of this schema keeps the field `k` (known, or unknown fields kept).
    fn keeps(&self, k: &str) -> bool {
        self.properties.contains_key(k)
            || self.preserve_unknown_fields
            || matches!(self.additional_properties, Some(AdditionalProperties::Allowed(true)))
            || matches!(self.additional_properties, Some(AdditionalProperties::Schema(_)))
    }

    /// Drop the fields of `v` (at `path`) this schema does not specify, recursively; their
    /// paths are appended to `pruned`.
    pub fn prune(&self, v: &mut Value, path: &str, pruned: &mut Vec<String>) {
        match v {
            Value::Object(m) => {
                let embedded = self.embedded_resource;
                m.retain(|k, _| {
                    let keep = (embedded && matches!(k.as_str(), "apiVersion" | "kind" | "metadata")) || self.keeps(k);
                    if !keep {
                        pruned.push(child(path, k));
                    }
                    keep
                });
                for (k, val) in m.iter_mut() {
                    if let Some(s) = self.properties.get(k) {
                        s.prune(val, &child(path, k), pruned);
                    } else if let Some(AdditionalProperties::Schema(s)) = &self.additional_properties {
                        s.prune(val, &format!("{path}[{k}]"), pruned);
                    }
                }
            }
            Value::Array(items) => {
                if let Some(s) = &self.items {
                    for (i, it) in items.iter_mut().enumerate() {
                        s.prune(it, &format!("{path}[{i}]"), pruned);
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn schema(v: Value) -> Schema {
        let mut s: Schema = serde_json::from_value(v).unwrap();
        let mut causes = Vec::new();
        s.prepare("", &mut causes);
        assert!(causes.is_empty(), "{causes:?}");
        s
    }

    #[test]
    fn prunes_unknown_fields_at_every_depth_and_keeps_maps() {
        let s = schema(json!({"type": "object", "properties": {
            "spec": {"type": "object", "properties": {
                "rules": {"type": "array", "items": {"type": "object", "properties": {"a": {"type": "string"}}}},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                "free": {"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}}}));
        let mut obj = json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n", "odd": 1},
            "spec": {"rules": [{"a": "1", "b": 2}], "labels": {"k": "v"}, "free": {"x": {"y": 1}}, "gone": true},
            "extra": 1});
        let mut pruned = Vec::new();
        s.prune_root(&mut obj, &mut pruned);
        assert_eq!(pruned, ["extra", "spec.gone", "spec.rules[0].b"]);
        assert_eq!(
            obj,
            json!({"apiVersion": "x/v1", "kind": "K", "metadata": {"name": "n", "odd": 1},
                "spec": {"rules": [{"a": "1"}], "labels": {"k": "v"}, "free": {"x": {"y": 1}}}})
        );
    }

    #[test]
    fn an_unknown_cel_rule_or_a_bad_pattern_refuses_the_schema() {
        let mut s: Schema = serde_json::from_value(json!({"type": "object", "properties": {
            "a": {"type": "string", "pattern": "("},
            "b": {"type": "object", "x-kubernetes-validations": [{"rule": "self.x.size() > 2"}]}}}))
        .unwrap();
        let mut causes = Vec::new();
        s.prepare("spec.versions[0].schema.openAPIV3Schema", &mut causes);
        let fields: Vec<&str> = causes.iter().map(|c| c.field.as_str()).collect();
        assert_eq!(
            fields,
            [
                "spec.versions[0].schema.openAPIV3Schema.properties[a].pattern",
                "spec.versions[0].schema.openAPIV3Schema.properties[b].x-kubernetes-validations[0].rule"
            ]
        );
    }
}
