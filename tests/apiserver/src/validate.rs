//! Defaulting and validation, following the upstream API server for the served kinds
//! (`SetDefaults_NetworkPolicy`, `ValidateNetworkPolicy`, object metadata and label rules,
//! and the pod and namespace defaults the agent relies on).

use crate::error::Cause;
use serde_json::{json, Map, Value};

/// Collects validation causes.
#[derive(Debug, Default)]
pub struct Errs(pub Vec<Cause>);

impl Errs {
    pub(crate) fn required(&mut self, field: &str, msg: &str) {
        let message = if msg.is_empty() {
            "Required value".to_string()
        } else {
            format!("Required value: {msg}")
        };
        self.push("FieldValueRequired", message, field);
    }
    pub(crate) fn invalid(&mut self, field: &str, value: &Value, msg: &str) {
        self.push("FieldValueInvalid", format!("Invalid value: {value}: {msg}"), field);
    }
    pub(crate) fn not_supported(&mut self, field: &str, value: &Value, allowed: &[&str]) {
        let allowed: Vec<String> = allowed.iter().map(|a| format!("\"{a}\"")).collect();
        self.push(
            "FieldValueNotSupported",
            format!("Unsupported value: {value}: supported values: {}", allowed.join(", ")),
            field,
        );
    }
    pub(crate) fn forbidden(&mut self, field: &str, msg: &str) {
        self.push("FieldValueForbidden", format!("Forbidden: {msg}"), field);
    }
    pub(crate) fn push(&mut self, reason: &str, message: String, field: &str) {
        self.0.push(Cause {
            reason: reason.into(),
            message,
            field: field.into(),
        });
    }
}

fn alnum(c: char) -> bool {
    c.is_ascii_lowercase() || c.is_ascii_digit()
}

/// RFC 1123 label: lowercase alphanumerics and '-', at most 63, alphanumeric at both ends.
pub fn is_dns1123_label(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| alnum(c) || c == '-')
        && s.starts_with(alnum)
        && s.ends_with(alnum)
}

/// RFC 1123 subdomain: dot-separated labels, at most 253 characters.
pub fn is_dns1123_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|l| {
            !l.is_empty() && l.chars().all(|c| alnum(c) || c == '-') && l.starts_with(alnum) && l.ends_with(alnum)
        })
}

fn is_name_part(s: &str) -> bool {
    let an = |c: char| c.is_ascii_alphanumeric();
    !s.is_empty()
        && s.len() <= 63
        && s.chars().all(|c| an(c) || c == '-' || c == '_' || c == '.')
        && s.starts_with(an)
        && s.ends_with(an)
}

/// A qualified name (label key): `[prefix/]name`.
pub fn is_qualified_name(s: &str) -> bool {
    match s.split_once('/') {
        Some((prefix, name)) => is_dns1123_subdomain(prefix) && is_name_part(name),
        None => is_name_part(s),
    }
}

/// A label value: empty, or a name part.
pub fn is_label_value(s: &str) -> bool {
    s.is_empty() || is_name_part(s)
}

/// IANA_SVC_NAME: 1-15 lowercase alphanumerics or '-', at least one letter, no leading,
/// trailing or doubled '-'.
pub fn is_port_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.chars().all(|c| alnum(c) || c == '-')
        && s.chars().any(|c| c.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// Validate `metadata.labels` at `field`.
pub fn validate_labels(labels: Option<&Value>, field: &str, errs: &mut Errs) {
    let Some(labels) = labels else { return };
    if labels.is_null() {
        return;
    }
    let Some(m) = labels.as_object() else {
        errs.invalid(field, labels, "must be a map of string keys to string values");
        return;
    };
    for (k, v) in m {
        if !is_qualified_name(k) {
            errs.invalid(
                field,
                &json!(k),
                "name part must consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            );
        }
        match v.as_str() {
            Some(s) if is_label_value(s) => {}
            _ => errs.invalid(
                &format!("{field}[{k}]"),
                v,
                "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.', and must start and end with an alphanumeric character",
            ),
        }
    }
}

/// Validate object metadata: the name (label or subdomain rules) and labels.
pub fn validate_meta(obj: &Value, name_is_label: bool, errs: &mut Errs) {
    match obj.pointer("/metadata/name").and_then(Value::as_str) {
        None | Some("") => errs.required("metadata.name", "name or generateName is required"),
        Some(n) => {
            let ok = if name_is_label {
                is_dns1123_label(n)
            } else {
                is_dns1123_subdomain(n)
            };
            if !ok {
                errs.invalid(
                    "metadata.name",
                    &json!(n),
                    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.', and must start and end with an alphanumeric character",
                );
            }
        }
    }
    validate_labels(obj.pointer("/metadata/labels"), "metadata.labels", errs);
}

/// Validate a metav1.LabelSelector at `field`.
pub fn validate_label_selector(sel: &Value, field: &str, errs: &mut Errs) {
    let Some(m) = sel.as_object() else {
        errs.invalid(field, sel, "must be a label selector object");
        return;
    };
    validate_labels(m.get("matchLabels"), &format!("{field}.matchLabels"), errs);
    let Some(exprs) = m.get("matchExpressions") else {
        return;
    };
    if exprs.is_null() {
        return;
    }
    let Some(exprs) = exprs.as_array() else {
        errs.invalid(&format!("{field}.matchExpressions"), exprs, "must be a list");
        return;
    };
    for (i, e) in exprs.iter().enumerate() {
        let f = format!("{field}.matchExpressions[{i}]");
        let key = e.get("key").and_then(Value::as_str).unwrap_or("");
        if !is_qualified_name(key) {
            errs.invalid(&format!("{f}.key"), &json!(key), "must be a valid label key");
        }
        let values: Vec<&Value> = e
            .get("values")
            .and_then(Value::as_array)
            .map(|v| v.iter().collect())
            .unwrap_or_default();
        match e.get("operator").and_then(Value::as_str).unwrap_or("") {
            "In" | "NotIn" => {
                if values.is_empty() {
                    errs.required(
                        &format!("{f}.values"),
                        "must be specified when `operator` is 'In' or 'NotIn'",
                    );
                }
            }
            "Exists" | "DoesNotExist" => {
                if !values.is_empty() {
                    errs.forbidden(
                        &format!("{f}.values"),
                        "may not be specified when `operator` is 'Exists' or 'DoesNotExist'",
                    );
                }
            }
            other => errs.invalid(&format!("{f}.operator"), &json!(other), "not a valid selector operator"),
        }
        for (j, v) in values.iter().enumerate() {
            if !v.as_str().is_some_and(is_label_value) {
                errs.invalid(&format!("{f}.values[{j}]"), v, "must be a valid label value");
            }
        }
    }
}

/// `SetDefaults_NetworkPolicy` + `SetDefaults_NetworkPolicyPort`.
pub fn default_network_policy(obj: &mut Value) {
    let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
        if let Some(o) = obj.as_object_mut() {
            o.insert("spec".into(), json!({"podSelector": {}, "policyTypes": ["Ingress"]}));
        }
        return;
    };
    spec.entry("podSelector").or_insert_with(|| json!({}));
    for dir in ["ingress", "egress"] {
        if let Some(rules) = spec.get_mut(dir).and_then(Value::as_array_mut) {
            for rule in rules {
                if let Some(ports) = rule.get_mut("ports").and_then(Value::as_array_mut) {
                    for p in ports {
                        if let Some(p) = p.as_object_mut() {
                            if p.get("protocol").is_none_or(Value::is_null) {
                                p.insert("protocol".into(), json!("TCP"));
                            }
                        }
                    }
                }
            }
        }
    }
    let empty_types = spec
        .get("policyTypes")
        .is_none_or(|t| t.as_array().is_none_or(|a| a.is_empty()));
    if empty_types {
        let has_egress = spec
            .get("egress")
            .and_then(Value::as_array)
            .is_some_and(|e| !e.is_empty());
        let types = if has_egress {
            json!(["Ingress", "Egress"])
        } else {
            json!(["Ingress"])
        };
        spec.insert("policyTypes".into(), types);
    }
}

fn validate_port(port: &Value, f: &str, errs: &mut Errs) {
    let Some(p) = port.as_object() else {
        errs.invalid(f, port, "must be an object");
        return;
    };
    if let Some(proto) = p.get("protocol") {
        if !matches!(proto.as_str(), Some("TCP" | "UDP" | "SCTP")) {
            errs.not_supported(&format!("{f}.protocol"), proto, &["SCTP", "TCP", "UDP"]);
        }
    }
    let port_v = p.get("port").filter(|v| !v.is_null());
    let end_v = p.get("endPort").filter(|v| !v.is_null());
    let mut numeric: Option<i64> = None;
    if let Some(pv) = port_v {
        if let Some(n) = pv.as_i64() {
            if !(1..=65535).contains(&n) {
                errs.invalid(&format!("{f}.port"), pv, "must be between 1 and 65535, inclusive");
            }
            numeric = Some(n);
        } else if let Some(s) = pv.as_str() {
            if !is_port_name(s) {
                errs.invalid(
                    &format!("{f}.port"),
                    pv,
                    "must be a valid IANA_SVC_NAME (at most 15 characters, lowercase alphanumerics or '-', at least one letter, no leading, trailing or consecutive '-')",
                );
            }
        } else {
            errs.invalid(&format!("{f}.port"), pv, "must be an integer or a string");
        }
    }
    if let Some(ev) = end_v {
        match ev.as_i64() {
            None => errs.invalid(&format!("{f}.endPort"), ev, "must be an integer"),
            Some(e) => {
                if port_v.is_none() {
                    errs.required(&format!("{f}.port"), "must be specified when endPort is specified");
                } else if numeric.is_none() {
                    errs.invalid(
                        &format!("{f}.endPort"),
                        ev,
                        "may not be specified when `port` is non-numeric",
                    );
                } else if numeric.is_some_and(|n| e < n) {
                    errs.invalid(&format!("{f}.endPort"), ev, "must be greater than or equal to `port`");
                }
                if !(1..=65535).contains(&e) {
                    errs.invalid(&format!("{f}.endPort"), ev, "must be between 1 and 65535, inclusive");
                }
            }
        }
    }
}

fn validate_ip_block(b: &Value, f: &str, errs: &mut Errs) {
    let cidr_v = b.get("cidr").and_then(Value::as_str).unwrap_or("");
    if cidr_v.is_empty() {
        errs.required(&format!("{f}.cidr"), "");
        return;
    }
    let cidr: ipnet::IpNet = match cidr_v.parse() {
        Ok(c) => c,
        Err(_) => {
            errs.invalid(
                &format!("{f}.cidr"),
                &json!(cidr_v),
                "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
            );
            return;
        }
    };
    let excepts = b.get("except").and_then(Value::as_array).cloned().unwrap_or_default();
    for (i, e) in excepts.iter().enumerate() {
        let ef = format!("{f}.except[{i}]");
        let parsed: Option<ipnet::IpNet> = e.as_str().and_then(|s| s.parse().ok());
        match parsed {
            None => errs.invalid(
                &ef,
                e,
                "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
            ),
            Some(ex) => {
                let ok = cidr.contains(&ex.network()) && ex.prefix_len() > cidr.prefix_len();
                let same_family = matches!(
                    (cidr, ex),
                    (ipnet::IpNet::V4(_), ipnet::IpNet::V4(_)) | (ipnet::IpNet::V6(_), ipnet::IpNet::V6(_))
                );
                if !ok || !same_family {
                    errs.invalid(&ef, e, "must be a strict subset of `cidr`");
                }
            }
        }
    }
}

fn validate_peer(peer: &Value, f: &str, errs: &mut Errs) {
    let present = |k: &str| peer.get(k).is_some_and(|v| !v.is_null());
    let mut n = 0;
    if present("podSelector") {
        n += 1;
        validate_label_selector(&peer["podSelector"], &format!("{f}.podSelector"), errs);
    }
    if present("namespaceSelector") {
        n += 1;
        validate_label_selector(&peer["namespaceSelector"], &format!("{f}.namespaceSelector"), errs);
    }
    if present("ipBlock") {
        n += 1;
        validate_ip_block(&peer["ipBlock"], &format!("{f}.ipBlock"), errs);
    }
    if n == 0 {
        errs.required(f, "must specify a peer");
    } else if n > 1 && present("ipBlock") {
        errs.forbidden(f, "may not specify both ipBlock and another peer");
    }
}

/// `ValidateNetworkPolicy` (spec part) plus metadata.
pub fn validate_network_policy(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, false, &mut errs);
    let spec = obj.get("spec").cloned().unwrap_or(json!({}));
    match spec.get("podSelector") {
        Some(sel) if !sel.is_null() => validate_label_selector(sel, "spec.podSelector", &mut errs),
        _ => {}
    }
    for (dir, peers_key) in [("ingress", "from"), ("egress", "to")] {
        let Some(rules) = spec.get(dir).filter(|v| !v.is_null()) else {
            continue;
        };
        let Some(rules) = rules.as_array() else {
            errs.invalid(&format!("spec.{dir}"), rules, "must be a list of rules");
            continue;
        };
        for (i, rule) in rules.iter().enumerate() {
            let rf = format!("spec.{dir}[{i}]");
            if let Some(ports) = rule.get("ports").and_then(Value::as_array) {
                for (j, p) in ports.iter().enumerate() {
                    validate_port(p, &format!("{rf}.ports[{j}]"), &mut errs);
                }
            }
            if let Some(peers) = rule.get(peers_key).and_then(Value::as_array) {
                for (j, p) in peers.iter().enumerate() {
                    validate_peer(p, &format!("{rf}.{peers_key}[{j}]"), &mut errs);
                }
            }
        }
    }
    if let Some(types) = spec.get("policyTypes").and_then(Value::as_array) {
        if types.len() > 2 {
            errs.invalid(
                "spec.policyTypes",
                &Value::Array(types.clone()),
                "may not specify more than two policyTypes",
            );
        } else {
            for (i, t) in types.iter().enumerate() {
                if !matches!(t.as_str(), Some("Ingress" | "Egress")) {
                    errs.not_supported(&format!("spec.policyTypes[{i}]"), t, &["Ingress", "Egress"]);
                }
            }
        }
    }
    errs.0
}

/// Pod defaults the agent and clients rely on (phase, restart/DNS policy, port protocol...).
pub fn default_pod(obj: &mut Value) {
    let Some(o) = obj.as_object_mut() else { return };
    if let Some(spec) = object_field(o, "spec") {
        spec.entry("restartPolicy").or_insert(json!("Always"));
        spec.entry("dnsPolicy").or_insert(json!("ClusterFirst"));
        spec.entry("schedulerName").or_insert(json!("default-scheduler"));
        spec.entry("terminationGracePeriodSeconds").or_insert(json!(30));
        spec.entry("securityContext").or_insert(json!({}));
        spec.entry("enableServiceLinks").or_insert(json!(true));
        for key in ["containers", "initContainers"] {
            if let Some(cs) = spec.get_mut(key).and_then(Value::as_array_mut) {
                for c in cs.iter_mut().filter_map(Value::as_object_mut) {
                    let image = c.get("image").and_then(Value::as_str).unwrap_or("");
                    let last = image.rsplit('/').next().unwrap_or("");
                    let latest = !last.contains(':') || last.ends_with(":latest");
                    let pull = if latest && !image.contains('@') {
                        "Always"
                    } else {
                        "IfNotPresent"
                    };
                    c.entry("imagePullPolicy").or_insert(json!(pull));
                    c.entry("terminationMessagePath")
                        .or_insert(json!("/dev/termination-log"));
                    c.entry("terminationMessagePolicy").or_insert(json!("File"));
                    c.entry("resources").or_insert(json!({}));
                    if let Some(ps) = c.get_mut("ports").and_then(Value::as_array_mut) {
                        for p in ps.iter_mut().filter_map(Value::as_object_mut) {
                            p.entry("protocol").or_insert(json!("TCP"));
                        }
                    }
                }
            }
        }
    }
    default_phase(o, "Pending");
}

/// The object field `key` of `o`, inserted as `{}` when missing (None when not an object).
fn object_field<'a>(o: &'a mut Map<String, Value>, key: &str) -> Option<&'a mut Map<String, Value>> {
    o.entry(key).or_insert_with(|| json!({})).as_object_mut()
}

/// Default `status.phase` to `phase`.
fn default_phase(o: &mut Map<String, Value>, phase: &str) {
    if let Some(status) = object_field(o, "status") {
        status.entry("phase").or_insert(json!(phase));
    }
}

/// Pod validation: metadata, at least one container with a name and an image, and
/// container port numbers, names and protocols.
pub fn validate_pod(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, false, &mut errs);
    let containers = obj.pointer("/spec/containers").and_then(Value::as_array);
    match containers {
        None => errs.required("spec.containers", ""),
        Some(cs) if cs.is_empty() => errs.required("spec.containers", ""),
        Some(cs) => {
            for (i, c) in cs.iter().enumerate() {
                let f = format!("spec.containers[{i}]");
                match c.get("name").and_then(Value::as_str) {
                    Some(n) if is_dns1123_label(n) => {}
                    Some(n) => errs.invalid(
                        &format!("{f}.name"),
                        &json!(n),
                        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-'",
                    ),
                    None => errs.required(&format!("{f}.name"), ""),
                }
                if c.get("image").and_then(Value::as_str).unwrap_or("").is_empty() {
                    errs.required(&format!("{f}.image"), "");
                }
                let ports = c.get("ports").and_then(Value::as_array);
                for (j, p) in ports.into_iter().flatten().enumerate() {
                    let pf = format!("{f}.ports[{j}]");
                    match p.get("containerPort").and_then(Value::as_i64) {
                        Some(n) if (1..=65535).contains(&n) => {}
                        Some(n) => errs.invalid(
                            &format!("{pf}.containerPort"),
                            &json!(n),
                            "must be between 1 and 65535, inclusive",
                        ),
                        None => errs.required(&format!("{pf}.containerPort"), ""),
                    }
                    if let Some(n) = p.get("name").and_then(Value::as_str) {
                        if !is_port_name(n) {
                            errs.invalid(&format!("{pf}.name"), &json!(n), "must be a valid IANA_SVC_NAME");
                        }
                    }
                    if let Some(proto) = p.get("protocol") {
                        if !matches!(proto.as_str(), Some("TCP" | "UDP" | "SCTP")) {
                            errs.not_supported(&format!("{pf}.protocol"), proto, &["SCTP", "TCP", "UDP"]);
                        }
                    }
                }
            }
        }
    }
    errs.0
}

/// Namespace defaults: the immutable `kubernetes.io/metadata.name` label, the `kubernetes`
/// finalizer and phase Active.
pub fn default_namespace(obj: &mut Value) {
    let name = obj
        .pointer("/metadata/name")
        .and_then(Value::as_str)
        .unwrap_or("")
        .to_string();
    if let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut) {
        let labels = meta.entry("labels").or_insert_with(|| json!({}));
        if !labels.is_object() {
            *labels = json!({});
        }
        labels["kubernetes.io/metadata.name"] = json!(name);
    }
    if let Some(o) = obj.as_object_mut() {
        if let Some(spec) = object_field(o, "spec") {
            spec.entry("finalizers").or_insert(json!(["kubernetes"]));
        }
        default_phase(o, "Active");
    }
}

/// Namespace validation: the name is an RFC 1123 label.
pub fn validate_namespace(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, true, &mut errs);
    errs.0
}

/// DaemonSet defaults (`SetDefaults_DaemonSet`): a `RollingUpdate` strategy with
/// `maxUnavailable: 1` and `maxSurge: 0`, and `revisionHistoryLimit: 10`.
pub fn default_daemon_set(obj: &mut Value) {
    let Some(o) = obj.as_object_mut() else {
        return;
    };
    let Some(spec) = object_field(o, "spec") else {
        return;
    };
    spec.entry("revisionHistoryLimit").or_insert(json!(10));
    let strategy = spec.entry("updateStrategy").or_insert_with(|| json!({}));
    if let Some(st) = strategy.as_object_mut() {
        let ty = st.entry("type").or_insert(json!("RollingUpdate")).clone();
        if ty == "RollingUpdate" {
            let ru = st.entry("rollingUpdate").or_insert_with(|| json!({}));
            if let Some(ru) = ru.as_object_mut() {
                ru.entry("maxUnavailable").or_insert(json!(1));
                ru.entry("maxSurge").or_insert(json!(0));
            }
        }
    }
}

/// DaemonSet validation (`ValidateDaemonSet`, the parts the tests meet): the name, a
/// required selector that is a valid label selector, and template labels that it selects.
pub fn validate_daemon_set(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, false, &mut errs);
    match obj.pointer("/spec/selector") {
        None | Some(Value::Null) => errs.required("spec.selector", ""),
        Some(sel) => {
            validate_label_selector(sel, "spec.selector", &mut errs);
            let labels = obj.pointer("/spec/template/metadata/labels");
            let selected = sel
                .get("matchLabels")
                .and_then(Value::as_object)
                .is_none_or(|want| want.iter().all(|(k, v)| labels.and_then(|l| l.get(k)) == Some(v)));
            if !selected {
                errs.invalid(
                    "spec.template.metadata.labels",
                    labels.unwrap_or(&Value::Null),
                    "`selector` does not match template `labels`",
                );
            }
        }
    }
    if obj.pointer("/spec/template").is_none_or(Value::is_null) {
        errs.required("spec.template", "");
    }
    errs.0
}

/// Event validation (`ValidateEventCreate`, the parts the tests meet): the name, a
/// required `involvedObject` whose namespace is the Event's.
pub fn validate_event(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, false, &mut errs);
    match obj.get("involvedObject") {
        None | Some(Value::Null) => errs.required("involvedObject", ""),
        Some(o) => {
            let ns = obj.pointer("/metadata/namespace").and_then(Value::as_str).unwrap_or("");
            let involved = o.get("namespace").and_then(Value::as_str).unwrap_or("");
            if !involved.is_empty() && involved != ns {
                errs.invalid(
                    "involvedObject.namespace",
                    &json!(involved),
                    "does not match event.namespace",
                );
            }
        }
    }
    errs.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn np(spec: Value) -> Value {
        json!({"metadata": {"name": "p"}, "spec": spec})
    }

    fn fields(spec: Value) -> Vec<String> {
        let mut o = np(spec);
        default_network_policy(&mut o);
        validate_network_policy(&o).into_iter().map(|c| c.field).collect()
    }

    #[test]
    fn defaulting_policy_types_and_protocol() {
        let mut o = np(json!({"podSelector": {}, "egress": [], "ingress": [{"ports": [{"port": 80}]}]}));
        default_network_policy(&mut o);
        assert_eq!(o["spec"]["policyTypes"], json!(["Ingress"]));
        assert_eq!(o["spec"]["ingress"][0]["ports"][0]["protocol"], "TCP");
        let mut o = np(json!({"podSelector": {}, "egress": [{}]}));
        default_network_policy(&mut o);
        assert_eq!(o["spec"]["policyTypes"], json!(["Ingress", "Egress"]));
        let mut o = np(json!({"policyTypes": ["Egress"], "egress": [{}]}));
        default_network_policy(&mut o);
        assert_eq!(o["spec"]["policyTypes"], json!(["Egress"]));
        assert_eq!(o["spec"]["podSelector"], json!({}));
    }

    #[test]
    fn validation_fields() {
        assert!(fields(json!({"podSelector": {}})).is_empty());
        assert_eq!(
            fields(json!({"ingress": [{"from": [{}]}]})),
            ["spec.ingress[0].from[0]"]
        );
        assert_eq!(
            fields(json!({"ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}]})),
            ["spec.ingress[0].from[0]"]
        );
        assert_eq!(
            fields(
                json!({"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.0.0.0/8", "11.0.0.0/16", "10.1.0.0/16"]}}]}]})
            ),
            [
                "spec.egress[0].to[0].ipBlock.except[0]",
                "spec.egress[0].to[0].ipBlock.except[1]"
            ]
        );
        assert_eq!(
            fields(json!({"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0/8"}}]}]})),
            ["spec.egress[0].to[0].ipBlock.cidr"]
        );
        assert_eq!(
            fields(
                json!({"ingress": [{"ports": [{"port": 0}, {"port": "Bad_Name"}, {"port": "http", "endPort": 90}, {"port": 90, "endPort": 80}, {"endPort": 80}, {"protocol": "ICMP"}]}]})
            ),
            [
                "spec.ingress[0].ports[0].port",
                "spec.ingress[0].ports[1].port",
                "spec.ingress[0].ports[2].endPort",
                "spec.ingress[0].ports[3].endPort",
                "spec.ingress[0].ports[4].port",
                "spec.ingress[0].ports[5].protocol"
            ]
        );
        assert_eq!(
            fields(json!({"policyTypes": ["Ingress", "Sideways"]})),
            ["spec.policyTypes[1]"]
        );
        assert_eq!(
            fields(
                json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}, {"key": "b", "operator": "Exists", "values": ["x"]}, {"key": "c", "operator": "Near"}]}})
            ),
            [
                "spec.podSelector.matchExpressions[0].values",
                "spec.podSelector.matchExpressions[1].values",
                "spec.podSelector.matchExpressions[2].operator"
            ]
        );
    }

    #[test]
    fn names() {
        assert!(is_port_name("http"));
        assert!(!is_port_name("8080"));
        assert!(!is_port_name("a--b"));
        assert!(is_dns1123_label("ns-1"));
        assert!(!is_dns1123_label("Ns"));
        assert!(is_qualified_name("kubernetes.io/metadata.name"));
        assert!(!is_qualified_name("-bad"));
    }
    #[test]
    fn daemon_set_defaults_and_validation() {
        let mut ds = json!({"metadata": {"name": "agent"}, "spec": {
            "selector": {"matchLabels": {"app": "a"}},
            "template": {"metadata": {"labels": {"app": "a"}}, "spec": {"containers": []}}}});
        default_daemon_set(&mut ds);
        assert_eq!(ds["spec"]["updateStrategy"]["type"], "RollingUpdate");
        assert_eq!(ds["spec"]["updateStrategy"]["rollingUpdate"]["maxUnavailable"], 1);
        assert_eq!(ds["spec"]["revisionHistoryLimit"], 10);
        assert!(validate_daemon_set(&ds).is_empty());
        let fields = |ds: Value| -> Vec<String> { validate_daemon_set(&ds).into_iter().map(|c| c.field).collect() };
        assert_eq!(
            fields(json!({"metadata": {"name": "Bad_Name"}, "spec": {}})),
            ["metadata.name", "spec.selector", "spec.template"]
        );
        assert_eq!(
            fields(json!({"metadata": {"name": "a"}, "spec": {
                "selector": {"matchLabels": {"app": "a"}},
                "template": {"metadata": {"labels": {"app": "b"}}}}})),
            ["spec.template.metadata.labels"]
        );
    }
}
