//! Defaulting and validation of the service-networking kinds, following the upstream API
//! server: `v1` Services (`SetDefaults_Service`, `ValidateService` for the fields kube-proxy
//! and the tests use), `discovery.k8s.io/v1` EndpointSlices (`ValidateEndpointSlice`) and
//! `v1` Nodes (taints, addresses, pod CIDRs). ClusterIP and NodePort allocation, which needs
//! the store's state, lives in `store::alloc`.

use crate::error::Cause;
use crate::validate::{
    is_dns1123_label, is_dns1123_subdomain, is_port_name, is_qualified_name, validate_labels, validate_meta, Errs,
};
use serde_json::{json, Value};
use std::collections::HashSet;
use std::net::IpAddr;

/// Service types.
const SERVICE_TYPES: [&str; 4] = ["ClusterIP", "NodePort", "LoadBalancer", "ExternalName"];
/// Protocols of ports.
const PROTOCOLS: [&str; 3] = ["SCTP", "TCP", "UDP"];

/// RFC 1035 label (Service names): an RFC 1123 label that starts with a letter.
pub fn is_dns1035_label(s: &str) -> bool {
    is_dns1123_label(s) && s.starts_with(|c: char| c.is_ascii_lowercase())
}

/// Whether the Service type allocates node ports.
pub fn uses_node_ports(ty: &str) -> bool {
    matches!(ty, "NodePort" | "LoadBalancer")
}

/// `SetDefaults_Service`: type ClusterIP, sessionAffinity None, port protocol TCP and
/// targetPort = port, internalTrafficPolicy Cluster, externalTrafficPolicy Cluster for
/// NodePort and LoadBalancer, and an empty `status.loadBalancer`.
pub fn default_service(obj: &mut Value) {
    let Some(o) = obj.as_object_mut() else { return };
    let spec = o.entry("spec").or_insert_with(|| json!({}));
    if let Some(spec) = spec.as_object_mut() {
        let ty = spec
            .entry("type")
            .or_insert(json!("ClusterIP"))
            .as_str()
            .unwrap_or("")
            .to_string();
        spec.entry("sessionAffinity").or_insert(json!("None"));
        if ty != "ExternalName" {
            spec.entry("internalTrafficPolicy").or_insert(json!("Cluster"));
        }
        if uses_node_ports(&ty) {
            spec.entry("externalTrafficPolicy").or_insert(json!("Cluster"));
        }
        if let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) {
            for p in ports.iter_mut().filter_map(Value::as_object_mut) {
                p.entry("protocol").or_insert(json!("TCP"));
                if p.get("targetPort").is_none_or(Value::is_null) {
                    if let Some(port) = p.get("port").cloned() {
                        p.insert("targetPort".into(), port);
                    }
                }
            }
        }
    }
    let status = o.entry("status").or_insert_with(|| json!({}));
    if let Some(st) = status.as_object_mut() {
        st.entry("loadBalancer").or_insert_with(|| json!({}));
    }
}

/// `dropTypeDependentFields`: when an update changes a Service's type, fields the new type
/// does not use and that the update left as they were are dropped before validation
/// (NodePorts and externalTrafficPolicy leaving NodePort/LoadBalancer; ClusterIPs and IP
/// families when becoming ExternalName).
pub fn drop_type_dependent_fields(obj: &mut Value, old: &Value) {
    let ty = |o: &Value| {
        o.pointer("/spec/type")
            .and_then(Value::as_str)
            .unwrap_or("ClusterIP")
            .to_string()
    };
    let (new_ty, old_ty) = (ty(obj), ty(old));
    if new_ty == old_ty {
        return;
    }
    let old_spec = old.get("spec").cloned().unwrap_or(json!({}));
    let Some(spec) = obj.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    if uses_node_ports(&old_ty) && !uses_node_ports(&new_ty) {
        let old_nps: Vec<&Value> = old_spec
            .get("ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|p| p.get("nodePort"))
            .collect();
        for p in spec
            .get_mut("ports")
            .and_then(Value::as_array_mut)
            .into_iter()
            .flatten()
        {
            if let Some(p) = p.as_object_mut() {
                if p.get("nodePort").is_some_and(|n| old_nps.contains(&n)) {
                    p.remove("nodePort");
                }
            }
        }
        if spec.get("externalTrafficPolicy") == old_spec.get("externalTrafficPolicy") {
            spec.remove("externalTrafficPolicy");
        }
    }
    if new_ty == "ExternalName" {
        for f in [
            "clusterIP",
            "clusterIPs",
            "ipFamilies",
            "ipFamilyPolicy",
            "internalTrafficPolicy",
        ] {
            if spec.get(f) == old_spec.get(f) {
                spec.remove(f);
            }
        }
    }
}

/// Check a port number field (`1..=65535`).
fn check_port_number(v: Option<&Value>, field: &str, errs: &mut Errs) {
    match v.filter(|v| !v.is_null()) {
        None => errs.required(field, ""),
        Some(v) => match v.as_i64() {
            Some(n) if (1..=65535).contains(&n) => {}
            _ => errs.invalid(field, v, "must be between 1 and 65535, inclusive"),
        },
    }
}

/// Check a protocol field (absent is fine: defaulting fills TCP).
fn check_protocol(v: Option<&Value>, field: &str, errs: &mut Errs) {
    if let Some(p) = v {
        if !p.as_str().is_some_and(|s| PROTOCOLS.contains(&s)) {
            errs.not_supported(field, p, &PROTOCOLS);
        }
    }
}

/// Validate `spec.ports` of a Service.
fn validate_service_ports(spec: &Value, ty: &str, headless: bool, errs: &mut Errs) {
    let ports = match spec.get("ports") {
        None | Some(Value::Null) => &Vec::new(),
        Some(Value::Array(a)) => a,
        Some(other) => {
            errs.invalid("spec.ports", other, "must be a list of ports");
            return;
        }
    };
    if ports.is_empty() && ty != "ExternalName" && !headless {
        errs.required("spec.ports", "");
    }
    let mut names = HashSet::new();
    let mut port_protos = HashSet::new();
    for (i, p) in ports.iter().enumerate() {
        let f = format!("spec.ports[{i}]");
        if !p.is_object() {
            errs.invalid(&f, p, "must be an object");
            continue;
        }
        match p.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()) {
            None if ports.len() > 1 => errs.required(&format!("{f}.name"), ""),
            None => {}
            Some(n) => {
                if !is_dns1123_label(n) {
                    errs.invalid(
                        &format!("{f}.name"),
                        &json!(n),
                        "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', and must start and end with an alphanumeric character",
                    );
                }
                if !names.insert(n.to_string()) {
                    errs.push(
                        "FieldValueDuplicate",
                        format!("Duplicate value: {}", json!(n)),
                        &format!("{f}.name"),
                    );
                }
            }
        }
        check_port_number(p.get("port"), &format!("{f}.port"), errs);
        check_protocol(p.get("protocol"), &format!("{f}.protocol"), errs);
        let key = (
            p.get("port").and_then(Value::as_i64),
            p.get("protocol").and_then(Value::as_str).unwrap_or("TCP").to_string(),
        );
        if key.0.is_some() && !port_protos.insert(key.clone()) {
            errs.push(
                "FieldValueDuplicate",
                format!("Duplicate value: {}", json!({"port": key.0, "protocol": key.1})),
                &f,
            );
        }
        match p.get("targetPort").filter(|v| !v.is_null()) {
            None => {}
            Some(tp) => match (tp.as_i64(), tp.as_str()) {
                (Some(n), _) if (1..=65535).contains(&n) => {}
                (_, Some(s)) if is_port_name(s) => {}
                (_, Some(s)) if s.parse::<i64>().is_ok_and(|n| (1..=65535).contains(&n)) => {}
                _ => errs.invalid(
                    &format!("{f}.targetPort"),
                    tp,
                    "must be between 1 and 65535, inclusive, or a valid IANA_SVC_NAME",
                ),
            },
        }
        if let Some(np) = p.get("nodePort").filter(|v| !v.is_null() && v.as_i64() != Some(0)) {
            if !uses_node_ports(ty) {
                errs.forbidden(
                    &format!("{f}.nodePort"),
                    &format!("may not be used when `type` is '{ty}'"),
                );
            } else if !np.as_i64().is_some_and(|n| (1..=65535).contains(&n)) {
                errs.invalid(&format!("{f}.nodePort"), np, "must be between 1 and 65535, inclusive");
            }
        }
    }
}

/// Check a string enum field that may be absent.
fn check_enum(spec: &Value, key: &str, allowed: &[&str], errs: &mut Errs) {
    if let Some(v) = spec.get(key).filter(|v| !v.is_null()) {
        if !v.as_str().is_some_and(|s| allowed.contains(&s)) {
            errs.not_supported(&format!("spec.{key}"), v, allowed);
        }
    }
}

/// `ValidateService` (the parts the harness and tests meet): name (RFC 1035 label), type,
/// ports (numbers, protocols, unique names when more than one, unique port/protocol pairs,
/// targetPorts, nodePorts only for NodePort and LoadBalancer), selector labels, traffic
/// policies, session affinity, IP family fields and the form of given ClusterIPs.
pub fn validate_service(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, true, &mut errs);
    if let Some(n) = obj.pointer("/metadata/name").and_then(Value::as_str) {
        if is_dns1123_label(n) && !is_dns1035_label(n) {
            errs.invalid(
                "metadata.name",
                &json!(n),
                "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with an alphabetic character, and end with an alphanumeric character",
            );
        }
    }
    let spec = obj.get("spec").cloned().unwrap_or(json!({}));
    let ty = spec.get("type").and_then(Value::as_str).unwrap_or("ClusterIP");
    if !SERVICE_TYPES.contains(&ty) {
        errs.not_supported("spec.type", &json!(ty), &SERVICE_TYPES);
    }
    let headless = spec.get("clusterIP").and_then(Value::as_str) == Some("None");
    if headless && ty != "ClusterIP" {
        errs.invalid(
            "spec.clusterIP",
            &json!("None"),
            &format!("may not be set to 'None' for {ty} services"),
        );
    }
    if ty == "ExternalName" {
        match spec.get("externalName").and_then(Value::as_str) {
            Some(n) if is_dns1123_subdomain(n) => {}
            Some(n) => errs.invalid("spec.externalName", &json!(n), "must be a valid DNS name"),
            None => errs.required("spec.externalName", ""),
        }
    }
    validate_service_ports(&spec, ty, headless, &mut errs);
    validate_labels(spec.get("selector"), "spec.selector", &mut errs);
    check_enum(&spec, "sessionAffinity", &["ClientIP", "None"], &mut errs);
    check_enum(&spec, "internalTrafficPolicy", &["Cluster", "Local"], &mut errs);
    check_enum(&spec, "externalTrafficPolicy", &["Cluster", "Local"], &mut errs);
    if spec.get("externalTrafficPolicy").is_some_and(|v| !v.is_null()) && !uses_node_ports(ty) {
        errs.invalid(
            "spec.externalTrafficPolicy",
            &spec["externalTrafficPolicy"],
            "may only be set when `type` is 'NodePort' or 'LoadBalancer'",
        );
    }
    check_enum(
        &spec,
        "ipFamilyPolicy",
        &["PreferDualStack", "RequireDualStack", "SingleStack"],
        &mut errs,
    );
    if let Some(fams) = spec.get("ipFamilies").filter(|v| !v.is_null()) {
        match fams.as_array() {
            None => errs.invalid("spec.ipFamilies", fams, "must be a list"),
            Some(a) => {
                if a.len() > 2 {
                    errs.invalid(
                        "spec.ipFamilies",
                        fams,
                        "may specify no more than one IP for each IP family",
                    );
                }
                let mut seen = HashSet::new();
                for (i, f) in a.iter().enumerate() {
                    match f.as_str() {
                        Some(s @ ("IPv4" | "IPv6")) => {
                            if !seen.insert(s) {
                                errs.push(
                                    "FieldValueDuplicate",
                                    format!("Duplicate value: {f}"),
                                    &format!("spec.ipFamilies[{i}]"),
                                );
                            }
                        }
                        _ => errs.not_supported(&format!("spec.ipFamilies[{i}]"), f, &["IPv4", "IPv6"]),
                    }
                }
            }
        }
    }
    if let Some(ips) = spec.get("clusterIPs").and_then(Value::as_array) {
        if ips.len() > 2 {
            errs.invalid(
                "spec.clusterIPs",
                &spec["clusterIPs"],
                "may specify no more than one IP for each IP family",
            );
        }
        for (i, ip) in ips.iter().enumerate() {
            let s = ip.as_str().unwrap_or("");
            if s == "None" && i == 0 {
                continue;
            }
            if !s.is_empty() && s.parse::<IpAddr>().is_err() {
                errs.invalid(
                    &format!("spec.clusterIPs[{i}]"),
                    ip,
                    "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
                );
            }
        }
    }
    if let Some(ip) = spec.get("clusterIP").and_then(Value::as_str) {
        if !ip.is_empty() && ip != "None" && ip.parse::<IpAddr>().is_err() {
            errs.invalid(
                "spec.clusterIP",
                &json!(ip),
                "must be a valid IP address, (e.g. 10.9.8.7 or 2001:db8::ffff)",
            );
        }
    }
    errs.0
}

/// EndpointSlice defaults: port protocol TCP.
pub fn default_endpoint_slice(obj: &mut Value) {
    if let Some(ports) = obj.get_mut("ports").and_then(Value::as_array_mut) {
        for p in ports.iter_mut().filter_map(Value::as_object_mut) {
            p.entry("protocol").or_insert(json!("TCP"));
        }
    }
}

/// `ValidateEndpointSlice`: name, addressType (IPv4, IPv6 or FQDN), endpoints with 1 to 100
/// addresses of that type and at most 1000 endpoints, ports with unique (possibly empty)
/// names, valid numbers and protocols, at most 100 ports.
pub fn validate_endpoint_slice(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, false, &mut errs);
    let at = obj.get("addressType").and_then(Value::as_str);
    match at {
        Some("IPv4" | "IPv6" | "FQDN") => {}
        None => errs.required("addressType", ""),
        Some(other) => errs.not_supported("addressType", &json!(other), &["FQDN", "IPv4", "IPv6"]),
    }
    let endpoints = obj
        .get("endpoints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    if endpoints.len() > 1000 {
        errs.push(
            "FieldValueTooMany",
            "Too many: must have at most 1000 items".into(),
            "endpoints",
        );
    }
    for (i, ep) in endpoints.iter().enumerate() {
        let f = format!("endpoints[{i}]");
        let addrs = ep
            .get("addresses")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        if addrs.is_empty() {
            errs.required(&format!("{f}.addresses"), "must contain at least 1 address");
        } else if addrs.len() > 100 {
            errs.push(
                "FieldValueTooMany",
                "Too many: must have at most 100 items".into(),
                &format!("{f}.addresses"),
            );
        }
        for (j, a) in addrs.iter().enumerate() {
            let af = format!("{f}.addresses[{j}]");
            let s = a.as_str().unwrap_or("");
            let ok = match at {
                Some("IPv4") => s.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv4()),
                Some("IPv6") => s.parse::<IpAddr>().is_ok_and(|ip| ip.is_ipv6()),
                Some("FQDN") => is_dns1123_subdomain(s),
                _ => true,
            };
            if !ok {
                errs.invalid(&af, a, &format!("must be a valid {} address", at.unwrap_or("")));
            }
        }
        if let Some(n) = ep.get("nodeName").and_then(Value::as_str) {
            if !is_dns1123_subdomain(n) {
                errs.invalid(&format!("{f}.nodeName"), &json!(n), "must be a valid node name");
            }
        }
    }
    let ports = obj.get("ports").and_then(Value::as_array).cloned().unwrap_or_default();
    if ports.len() > 100 {
        errs.push(
            "FieldValueTooMany",
            "Too many: must have at most 100 items".into(),
            "ports",
        );
    }
    let mut names = HashSet::new();
    for (i, p) in ports.iter().enumerate() {
        let f = format!("ports[{i}]");
        let name = p.get("name").and_then(Value::as_str).unwrap_or("");
        if !name.is_empty() && !is_dns1123_label(name) {
            errs.invalid(&format!("{f}.name"), &json!(name), "must be a valid RFC 1123 label");
        }
        if !names.insert(name.to_string()) {
            errs.push(
                "FieldValueDuplicate",
                format!("Duplicate value: {}", json!(name)),
                &format!("{f}.name"),
            );
        }
        if let Some(port) = p.get("port").filter(|v| !v.is_null()) {
            check_port_number(Some(port), &format!("{f}.port"), &mut errs);
        }
        check_protocol(p.get("protocol"), &format!("{f}.protocol"), &mut errs);
    }
    errs.0
}

/// Taint effects.
const TAINT_EFFECTS: [&str; 3] = ["NoExecute", "NoSchedule", "PreferNoSchedule"];
/// Node address types.
const ADDRESS_TYPES: [&str; 5] = ["ExternalDNS", "ExternalIP", "Hostname", "InternalDNS", "InternalIP"];

/// Node validation: name, `spec.taints` (qualified keys, label-like values, known effects,
/// unique key/effect pairs), `spec.podCIDR(s)` and `status.addresses` (known types; IP
/// addresses for the IP types).
pub fn validate_node(obj: &Value) -> Vec<Cause> {
    let mut errs = Errs::default();
    validate_meta(obj, false, &mut errs);
    let taints = obj
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let mut seen = HashSet::new();
    for (i, t) in taints.iter().enumerate() {
        let f = format!("spec.taints[{i}]");
        let key = t.get("key").and_then(Value::as_str).unwrap_or("");
        if !is_qualified_name(key) {
            errs.invalid(
                &format!("{f}.key"),
                &json!(key),
                "name part must consist of alphanumeric characters, '-', '_' or '.'",
            );
        }
        if let Some(v) = t.get("value").and_then(Value::as_str) {
            if !crate::validate::is_label_value(v) {
                errs.invalid(
                    &format!("{f}.value"),
                    &json!(v),
                    "a valid label must be an empty string or consist of alphanumeric characters, '-', '_' or '.'",
                );
            }
        }
        let effect = t.get("effect").and_then(Value::as_str);
        match effect {
            Some(e) if TAINT_EFFECTS.contains(&e) => {}
            None | Some("") => errs.required(&format!("{f}.effect"), ""),
            Some(e) => errs.not_supported(&format!("{f}.effect"), &json!(e), &TAINT_EFFECTS),
        }
        if !seen.insert((key.to_string(), effect.unwrap_or("").to_string())) {
            errs.push(
                "FieldValueDuplicate",
                format!("Duplicate value: {}", json!({"key": key, "effect": effect})),
                &f,
            );
        }
    }
    let mut cidrs: Vec<(String, Value)> = Vec::new();
    if let Some(c) = obj.pointer("/spec/podCIDR").filter(|v| !v.is_null()) {
        cidrs.push(("spec.podCIDR".into(), c.clone()));
    }
    for (i, c) in obj
        .pointer("/spec/podCIDRs")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
    {
        cidrs.push((format!("spec.podCIDRs[{i}]"), c.clone()));
    }
    for (f, c) in cidrs {
        if c.as_str().is_none_or(|s| s.parse::<ipnet::IpNet>().is_err()) {
            errs.invalid(
                &f,
                &c,
                "must be a valid CIDR value, (e.g. 10.9.8.0/24 or 2001:db8::/64)",
            );
        }
    }
    let addrs = obj
        .pointer("/status/addresses")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for (i, a) in addrs.iter().enumerate() {
        let f = format!("status.addresses[{i}]");
        let ty = a.get("type").and_then(Value::as_str).unwrap_or("");
        if !ADDRESS_TYPES.contains(&ty) {
            errs.not_supported(&format!("{f}.type"), &json!(ty), &ADDRESS_TYPES);
        }
        let addr = a.get("address").and_then(Value::as_str).unwrap_or("");
        if addr.is_empty() {
            errs.required(&format!("{f}.address"), "");
        } else if matches!(ty, "InternalIP" | "ExternalIP") && addr.parse::<IpAddr>().is_err() {
            errs.invalid(&format!("{f}.address"), &json!(addr), "must be a valid IP address");
        }
    }
    errs.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fields(causes: Vec<Cause>) -> Vec<String> {
        causes.into_iter().map(|c| c.field).collect()
    }

    fn svc(spec: Value) -> Value {
        let mut o = json!({"metadata": {"name": "web"}, "spec": spec});
        default_service(&mut o);
        o
    }

    #[test]
    fn service_defaults() {
        let o = svc(json!({"type": "NodePort", "ports": [{"port": 80}]}));
        assert_eq!(o["spec"]["ports"][0]["protocol"], "TCP");
        assert_eq!(o["spec"]["ports"][0]["targetPort"], 80);
        assert_eq!(o["spec"]["externalTrafficPolicy"], "Cluster");
        assert_eq!(o["spec"]["sessionAffinity"], "None");
        let o = svc(json!({"ports": [{"port": 80, "targetPort": "http"}]}));
        assert_eq!(o["spec"]["type"], "ClusterIP");
        assert_eq!(o["spec"]["ports"][0]["targetPort"], "http");
        assert!(o["spec"].get("externalTrafficPolicy").is_none());
    }

    #[test]
    fn service_port_validation() {
        assert!(validate_service(&svc(json!({"ports": [{"port": 80}]}))).is_empty());
        assert_eq!(fields(validate_service(&svc(json!({})))), ["spec.ports"]);
        // Headless services may have no ports.
        assert!(validate_service(&svc(json!({"clusterIP": "None"}))).is_empty());
        assert_eq!(
            fields(validate_service(&svc(json!({"ports": [
                {"name": "a", "port": 0},
                {"port": 80, "protocol": "ICMP"},
                {"name": "a", "port": 81, "targetPort": 70000},
                {"name": "d", "port": 82, "nodePort": 30001},
            ]})))),
            [
                "spec.ports[0].port",
                "spec.ports[0].targetPort",
                "spec.ports[1].name",
                "spec.ports[1].protocol",
                "spec.ports[2].name",
                "spec.ports[2].targetPort",
                "spec.ports[3].nodePort",
            ]
        );
        assert_eq!(
            fields(validate_service(&svc(json!({"ports": [
                {"name": "a", "port": 80}, {"name": "b", "port": 80},
                {"name": "c", "port": 80, "protocol": "UDP"},
            ]})))),
            ["spec.ports[1]"]
        );
        assert_eq!(
            fields(validate_service(&svc(
                json!({"ports": [{"port": 80}], "externalTrafficPolicy": "Local"})
            ))),
            ["spec.externalTrafficPolicy"]
        );
        assert_eq!(
            fields(validate_service(&svc(
                json!({"type": "NodePort", "clusterIP": "None", "ports": [{"port": 80}]})
            ))),
            ["spec.clusterIP"]
        );
        let mut bad = svc(json!({"ports": [{"port": 80}], "ipFamilies": ["IPv4", "IPv4"], "clusterIP": "10.96.0.300"}));
        bad["metadata"]["name"] = json!("1web");
        assert_eq!(
            fields(validate_service(&bad)),
            ["metadata.name", "spec.ipFamilies[1]", "spec.clusterIP"]
        );
    }

    #[test]
    fn endpoint_slice_validation() {
        let ok = json!({"metadata": {"name": "web-1", "labels": {"kubernetes.io/service-name": "web"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.0.0.1"], "conditions": {"ready": true}, "nodeName": "n1"}],
            "ports": [{"name": "", "port": 8080, "protocol": "TCP"}]});
        assert!(validate_endpoint_slice(&ok).is_empty());
        let bad = json!({"metadata": {"name": "web-1"}, "addressType": "IPv6",
            "endpoints": [{"addresses": ["10.0.0.1"]}, {"addresses": []}],
            "ports": [{"name": "a", "port": 0}, {"name": "a", "port": 1, "protocol": "X"}]});
        assert_eq!(
            fields(validate_endpoint_slice(&bad)),
            [
                "endpoints[0].addresses[0]",
                "endpoints[1].addresses",
                "ports[0].port",
                "ports[1].name",
                "ports[1].protocol",
            ]
        );
        assert_eq!(
            fields(validate_endpoint_slice(&json!({"metadata": {"name": "x"}}))),
            ["addressType"]
        );
    }

    #[test]
    fn node_validation() {
        let ok = json!({"metadata": {"name": "node-1"},
            "spec": {"podCIDR": "10.244.1.0/24", "taints": [{"key": "npm.io/agent-not-ready", "effect": "NoSchedule"}]},
            "status": {"addresses": [{"type": "InternalIP", "address": "192.168.1.2"}, {"type": "Hostname", "address": "node-1"}]}});
        assert!(validate_node(&ok).is_empty());
        let bad = json!({"metadata": {"name": "node-1"},
            "spec": {"podCIDRs": ["10.244.1.0/33"], "taints": [
                {"key": "a", "effect": "NoSchedule"}, {"key": "a", "effect": "NoSchedule"}, {"key": "b", "effect": "Sometimes"}]},
            "status": {"addresses": [{"type": "InternalIP", "address": "node-1"}, {"type": "Other", "address": "x"}]}});
        assert_eq!(
            fields(validate_node(&bad)),
            [
                "spec.taints[1]",
                "spec.taints[2].effect",
                "spec.podCIDRs[0]",
                "status.addresses[0].address",
                "status.addresses[1].type",
            ]
        );
    }
}
