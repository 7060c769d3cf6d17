//! CustomResourceDefinitions: the vendored ClusterNetworkPolicy CRDs (standard and
//! experimental channels of bundle v0.2.0, under `tests/apiserver/crds/`), the checks a CRD
//! must pass to be installed, what an installed CRD serves ([`InstalledCrd`]: names, short
//! names, the served version's structural schema), pruning and validation of custom
//! resources by that schema, and the status the server gives an installed CRD.
//!
//! Only the ClusterNetworkPolicy CRD (`clusternetworkpolicies.policy.networking.k8s.io`,
//! cluster-scoped, version `v1alpha2`) can be installed; any other CRD is refused with a
//! 422 naming the reason, as is a CRD whose CEL rules npm-testapi cannot evaluate.

mod cel;
mod schema;
mod validate;

pub use cel::is_cidr;
pub use schema::{AdditionalProperties, Schema, ValidationRule};

use crate::error::Cause;
use serde_json::{json, Value};

/// Name of the ClusterNetworkPolicy CRD.
pub const CNP_CRD_NAME: &str = "clusternetworkpolicies.policy.networking.k8s.io";

/// The ClusterNetworkPolicy versions the server can serve: `v1alpha2` (the vendored CRDs'
/// only version) and `v1beta1` (announced with the same schema; a CRD lists it as a copy
/// of `v1alpha2`, see [`crate::TestApiServer::set_cnp_served_versions`]). Conversion
/// between them is `None`: only `apiVersion` differs.
pub const CNP_VERSIONS: [&str; 2] = ["v1alpha2", "v1beta1"];

/// The vendored standard-channel ClusterNetworkPolicy CRD (YAML, with its attribution header).
pub const CNP_CRD_STANDARD_YAML: &str =
    include_str!("../../crds/policy.networking.k8s.io_clusternetworkpolicies.standard.yaml");
/// The vendored experimental-channel ClusterNetworkPolicy CRD (YAML, with its attribution
/// header).
pub const CNP_CRD_EXPERIMENTAL_YAML: &str =
    include_str!("../../crds/policy.networking.k8s.io_clusternetworkpolicies.experimental.yaml");

/// A release channel of the ClusterNetworkPolicy CRD.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CnpChannel {
    /// The standard channel (no `nodes` or `domainNames` egress peers).
    Standard,
    /// The experimental channel.
    Experimental,
}

impl CnpChannel {
    /// The channel's CRD as YAML text (what `kubectl apply -f` would send).
    pub fn crd_yaml(self) -> &'static str {
        match self {
            CnpChannel::Standard => CNP_CRD_STANDARD_YAML,
            CnpChannel::Experimental => CNP_CRD_EXPERIMENTAL_YAML,
        }
    }

    /// Path of the vendored CRD file (absolute, inside this crate), e.g. for `kubectl apply -f`.
    pub fn crd_path(self) -> std::path::PathBuf {
        let file = match self {
            CnpChannel::Standard => "policy.networking.k8s.io_clusternetworkpolicies.standard.yaml",
            CnpChannel::Experimental => "policy.networking.k8s.io_clusternetworkpolicies.experimental.yaml",
        };
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("crds").join(file)
    }

    /// The channel's CRD as a JSON object.
    pub fn crd_object(self) -> Value {
        // The vendored files are tested to parse (see the tests below).
        serde_yaml::from_str(self.crd_yaml()).unwrap_or(Value::Null)
    }

    /// `standard` or `experimental`.
    pub fn as_str(self) -> &'static str {
        match self {
            CnpChannel::Standard => "standard",
            CnpChannel::Experimental => "experimental",
        }
    }
}

impl std::str::FromStr for CnpChannel {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "standard" => Ok(CnpChannel::Standard),
            "experimental" => Ok(CnpChannel::Experimental),
            other => Err(format!(
                "unknown ClusterNetworkPolicy CRD channel {other:?} (standard or experimental)"
            )),
        }
    }
}

impl std::fmt::Display for CnpChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What an installed CRD serves.
#[derive(Debug, Clone)]
pub struct InstalledCrd {
    /// `spec.names.shortNames`.
    pub short_names: Vec<String>,
    /// `spec.names.categories`.
    pub categories: Vec<String>,
    /// The `policy.networking.k8s.io/channel` annotation, when present.
    pub channel: Option<String>,
    /// The versions served (`served: true`), among [`CNP_VERSIONS`], in the CRD's order.
    pub served: Vec<String>,
    /// The served version's schema, prepared.
    pub schema: Schema,
    /// The served version's `additionalPrinterColumns` (the columns of `kubectl get`).
    pub printer_columns: Vec<PrinterColumn>,
}

/// One `additionalPrinterColumns` entry.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PrinterColumn {
    /// Column name.
    pub name: String,
    /// `string`, `integer`, `number`, `boolean` or `date`.
    #[serde(rename = "type")]
    pub ty: String,
    /// Column format.
    #[serde(default)]
    pub format: String,
    /// Column description.
    #[serde(default)]
    pub description: String,
    /// 0: shown by default; more: shown with `-o wide`.
    #[serde(default)]
    pub priority: i32,
    /// A simple JSONPath: `.field.field...`.
    pub json_path: String,
}

impl PrinterColumn {
    /// The value at the column's path in `obj` (None when absent).
    pub fn value<'a>(&self, obj: &'a Value) -> Option<&'a Value> {
        self.json_path
            .strip_prefix('.')?
            .split('.')
            .try_fold(obj, |v, k| v.get(k))
    }
}

/// Whether `p` is a JSONPath npm-testapi evaluates: `.a.b.c` with plain field names.
fn simple_json_path(p: &str) -> bool {
    p.strip_prefix('.').is_some_and(|rest| {
        rest.split('.')
            .all(|k| !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-'))
    })
}

impl InstalledCrd {
    /// Structural pruning of a custom resource: fields the schema does not specify are
    /// dropped (an experimental field sent to a standard-channel server disappears). Returns
    /// the paths of the dropped fields.
    pub fn prune(&self, obj: &mut Value) -> Vec<String> {
        let mut pruned = Vec::new();
        self.schema.prune_root(obj, &mut pruned);
        pruned
    }

    /// Validate a pruned custom resource against the schema and its CEL rules.
    pub fn validate(&self, obj: &Value) -> Vec<Cause> {
        validate::validate_object(&self.schema, obj)
    }
}

/// A cause at `field`.
fn cause(reason: &str, message: String, field: &str) -> Cause {
    Cause {
        reason: reason.into(),
        message,
        field: field.into(),
    }
}

/// Defaults of a CRD (`names.singular`, `names.listKind`, `conversion.strategy`), as the real
/// server sets them.
pub fn default_crd(obj: &mut Value) {
    let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    if let Some(names) = spec.get_mut("names").and_then(Value::as_object_mut) {
        let kind = names.get("kind").and_then(Value::as_str).unwrap_or("").to_string();
        if names.get("singular").and_then(Value::as_str).is_none_or(str::is_empty) {
            names.insert("singular".into(), json!(kind.to_lowercase()));
        }
        if names.get("listKind").and_then(Value::as_str).is_none_or(str::is_empty) {
            names.insert("listKind".into(), json!(format!("{kind}List")));
        }
    }
    spec.entry("conversion").or_insert_with(|| json!({"strategy": "None"}));
}

/// Check a CRD and prepare what it serves; the causes of a refusal otherwise (answered
/// as 422 Invalid).
pub fn install(crd: &Value) -> Result<InstalledCrd, Vec<Cause>> {
    let mut causes = Vec::new();
    let s = |p: &str| crd.pointer(p).and_then(Value::as_str).unwrap_or("");
    let (group, plural, kind, scope) = (
        s("/spec/group"),
        s("/spec/names/plural"),
        s("/spec/names/kind"),
        s("/spec/scope"),
    );
    let name = s("/metadata/name");
    if name != format!("{plural}.{group}") {
        causes.push(cause(
            "FieldValueInvalid",
            format!("Invalid value: {name:?}: must be spec.names.plural+\".\"+spec.group"),
            "metadata.name",
        ));
    }
    if (group, plural, kind, scope)
        != (
            "policy.networking.k8s.io",
            "clusternetworkpolicies",
            "ClusterNetworkPolicy",
            "Cluster",
        )
    {
        causes.push(cause(
            "FieldValueForbidden",
            format!("Forbidden: npm-testapi serves only the ClusterNetworkPolicy CRD ({CNP_CRD_NAME}, kind ClusterNetworkPolicy, scope Cluster)"),
            "spec",
        ));
        return Err(causes);
    }
    let versions = crd
        .pointer("/spec/versions")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let storage = versions.iter().filter(|v| v["storage"] == json!(true)).count();
    if storage != 1 {
        causes.push(cause(
            "FieldValueInvalid",
            format!("Invalid value: {storage}: must have exactly one version marked as storage version"),
            "spec.versions",
        ));
    }
    let mut installed = None;
    let mut served = Vec::new();
    for (i, v) in versions.iter().enumerate() {
        let field = format!("spec.versions[{i}]");
        let vname = v["name"].as_str().unwrap_or("");
        if !CNP_VERSIONS.contains(&vname) {
            if v["served"] == json!(true) {
                causes.push(cause(
                    "FieldValueForbidden",
                    format!(
                        "Forbidden: npm-testapi serves ClusterNetworkPolicy only at {}, not {vname:?}",
                        CNP_VERSIONS.join(" or ")
                    ),
                    &format!("{field}.name"),
                ));
            }
            continue;
        }
        if v["served"] == json!(true) {
            served.push(vname.to_string());
        }
        if installed.is_some() {
            // The versions share one schema (conversion `None`): the first one's is served.
            continue;
        }
        let sfield = format!("{field}.schema.openAPIV3Schema");
        let Some(raw) = v.pointer("/schema/openAPIV3Schema") else {
            causes.push(cause(
                "FieldValueRequired",
                "Required value: schemas are required".into(),
                &sfield,
            ));
            continue;
        };
        let columns: Vec<PrinterColumn> = match v.get("additionalPrinterColumns") {
            None | Some(Value::Null) => Vec::new(),
            Some(c) => match serde_json::from_value(c.clone()) {
                Ok(c) => c,
                Err(e) => {
                    causes.push(cause(
                        "FieldValueInvalid",
                        format!("Invalid value: \"array\": {e}"),
                        &format!("{field}.additionalPrinterColumns"),
                    ));
                    Vec::new()
                }
            },
        };
        for (j, c) in columns.iter().enumerate() {
            if !simple_json_path(&c.json_path) {
                causes.push(cause(
                    "FieldValueForbidden",
                    format!(
                        "Forbidden: npm-testapi evaluates only simple JSONPaths (.a.b), not {:?}",
                        c.json_path
                    ),
                    &format!("{field}.additionalPrinterColumns[{j}].jsonPath"),
                ));
            }
        }
        match serde_json::from_value::<Schema>(raw.clone()) {
            Ok(mut schema) => {
                schema.prepare(&sfield, &mut causes);
                installed = Some((schema, columns));
            }
            Err(e) => causes.push(cause(
                "FieldValueInvalid",
                format!("Invalid value: \"object\": not a structural schema: {e}"),
                &sfield,
            )),
        }
    }
    let Some((schema, printer_columns)) = installed.filter(|_| causes.is_empty()) else {
        if causes.is_empty() {
            causes.push(cause(
                "FieldValueRequired",
                format!(
                    "Required value: one of the versions {} must be defined",
                    CNP_VERSIONS.join(", ")
                ),
                "spec.versions",
            ));
        }
        return Err(causes);
    };
    let strings = |p: &str| -> Vec<String> {
        crd.pointer(p)
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).map(str::to_string).collect())
            .unwrap_or_default()
    };
    Ok(InstalledCrd {
        short_names: strings("/spec/names/shortNames"),
        categories: strings("/spec/names/categories"),
        channel: crd
            .pointer("/metadata/annotations/policy.networking.k8s.io~1channel")
            .and_then(Value::as_str)
            .map(str::to_string),
        served,
        schema,
        printer_columns,
    })
}

/// The status of an installed CRD: accepted names, the `NamesAccepted` and `Established`
/// conditions (times kept from `old` when it had them) and the stored versions.
pub fn crd_status(crd: &Value, old: Option<&Value>, now: &str) -> Value {
    let since = |ty: &str| {
        old.and_then(|o| o.pointer("/status/conditions"))
            .and_then(Value::as_array)
            .and_then(|cs| cs.iter().find(|c| c["type"] == ty))
            .and_then(|c| c["lastTransitionTime"].as_str())
            .unwrap_or(now)
            .to_string()
    };
    json!({
        "acceptedNames": crd.pointer("/spec/names").cloned().unwrap_or(json!({})),
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts",
             "message": "no conflicts found", "lastTransitionTime": since("NamesAccepted")},
            {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
             "message": "the initial names have been accepted", "lastTransitionTime": since("Established")},
        ],
        "storedVersions": ["v1alpha2"],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_vendored_channels_install_and_differ_in_the_experimental_peers() {
        for ch in [CnpChannel::Standard, CnpChannel::Experimental] {
            let obj = ch.crd_object();
            assert_eq!(obj["metadata"]["name"], CNP_CRD_NAME, "{ch}");
            let inst = install(&obj).unwrap_or_else(|c| panic!("{ch}: {c:?}"));
            assert_eq!(inst.short_names, ["cnp"]);
            let cols: Vec<&str> = inst.printer_columns.iter().map(|c| c.name.as_str()).collect();
            assert_eq!(cols, ["Tier", "Priority", "Age"]);
            assert_eq!(inst.channel.as_deref(), Some(ch.as_str()));
            assert_eq!(std::fs::read_to_string(ch.crd_path()).unwrap(), ch.crd_yaml());
            let to = &inst.schema.properties["spec"].properties["egress"]
                .items
                .as_ref()
                .unwrap()
                .properties["to"];
            let peers = &to.items.as_ref().unwrap().properties;
            assert_eq!(peers.contains_key("nodes"), ch == CnpChannel::Experimental);
        }
    }

    #[test]
    fn other_crds_and_unknown_rules_are_refused() {
        let mut other = CnpChannel::Standard.crd_object();
        other["spec"]["names"]["plural"] = json!("widgets");
        other["metadata"]["name"] = json!("widgets.policy.networking.k8s.io");
        let c = install(&other).unwrap_err();
        assert_eq!(c[0].field, "spec");
        let mut rule = CnpChannel::Standard.crd_object();
        rule["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]["x-kubernetes-validations"] =
            json!([{"rule": "self.priority != 7"}]);
        let c = install(&rule).unwrap_err();
        assert_eq!(
            c[0].field,
            "spec.versions[0].schema.openAPIV3Schema.properties[spec].x-kubernetes-validations[0].rule"
        );
        assert!(c[0].message.contains("cannot evaluate"), "{}", c[0].message);
    }
}
