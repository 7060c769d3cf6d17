//! Service allocations, as the upstream API server's Service REST storage does them:
//! IP family fields (`ipFamilyPolicy`, `ipFamilies`), ClusterIPs from the service CIDRs
//! and NodePorts from the node-port range.
//!
//! Allocations are derived from the stored Services themselves (no separate bitmap), so a
//! deleted Service (or one in a deleted namespace) releases its addresses and ports at once,
//! and an address is never handed out twice.

use super::{key_of, Kind, Store};
use crate::error::{ApiError, Cause};
use crate::validate::Errs;
use crate::validate_network::uses_node_ports;
use ipnet::IpNet;
use serde_json::{json, Value};
use std::collections::HashSet;
use std::net::IpAddr;
use std::ops::RangeInclusive;

/// The cluster's service network: what ClusterIPs and NodePorts are allocated from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceNetwork {
    /// Service CIDRs, at most one per family; the first is the primary family.
    pub cidrs: Vec<IpNet>,
    /// The NodePort range.
    pub node_ports: RangeInclusive<u16>,
}

impl Default for ServiceNetwork {
    /// `10.96.0.0/16` and `fd00:96::/112` (dual-stack, IPv4 primary), NodePorts 30000-32767.
    fn default() -> Self {
        Self {
            cidrs: vec![
                "10.96.0.0/16".parse().expect("valid CIDR"),
                "fd00:96::/112".parse().expect("valid CIDR"),
            ],
            node_ports: 30000..=32767,
        }
    }
}

/// The family name of an address (`IPv4`/`IPv6`).
fn family_of(ip: &IpAddr) -> &'static str {
    if ip.is_ipv4() {
        "IPv4"
    } else {
        "IPv6"
    }
}

/// The family name of a CIDR.
fn cidr_family(c: &IpNet) -> &'static str {
    family_of(&c.addr())
}

/// The address at `offset` in `cidr`.
fn nth(cidr: &IpNet, offset: u128) -> IpAddr {
    match cidr {
        IpNet::V4(n) => IpAddr::V4((u32::from(n.network()).wrapping_add(offset as u32)).into()),
        IpNet::V6(n) => IpAddr::V6((u128::from(n.network()).wrapping_add(offset)).into()),
    }
}

/// Number of addresses in `cidr`.
fn size_of(cidr: &IpNet) -> u128 {
    let bits = u32::from(cidr.max_prefix_len() - cidr.prefix_len());
    if bits >= 128 {
        u128::MAX
    } else {
        1u128 << bits
    }
}

/// Pick a free address of `cidr` at random (then probing upwards), skipping the network
/// address, the first host (kept for the `kubernetes` Service, as upstream reserves it for
/// static use) and, for IPv4, the broadcast address.
fn pick_ip(cidr: &IpNet, used: &HashSet<IpAddr>) -> Option<IpAddr> {
    let size = size_of(cidr);
    let (first, last) = match cidr {
        IpNet::V4(_) => (2u128, size.saturating_sub(2)),
        IpNet::V6(_) => (2u128, size.saturating_sub(1)),
    };
    if last < first {
        return None;
    }
    let span = last - first + 1;
    let start = rand::random::<u128>() % span;
    let tries = span.min(1 << 20);
    (0..tries)
        .map(|i| nth(cidr, first + (start + i) % span))
        .find(|ip| !used.contains(ip))
}

/// Pick a free port of `range` at random (then probing upwards).
fn pick_port(range: &RangeInclusive<u16>, used: &HashSet<u16>) -> Option<u16> {
    let (lo, hi) = (u32::from(*range.start()), u32::from(*range.end()));
    if hi < lo {
        return None;
    }
    let span = hi - lo + 1;
    let start = rand::random_range(0..span);
    (0..span)
        .map(|i| (lo + (start + i) % span) as u16)
        .find(|p| !used.contains(p))
}

/// The strings of a JSON list field.
fn strings(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| a.iter().map(|s| s.as_str().unwrap_or("").to_string()).collect())
        .unwrap_or_default()
}

impl Store {
    /// Addresses and node ports held by Services other than `except` (a store key).
    fn service_allocations(&self, except: &str) -> (HashSet<IpAddr>, HashSet<u16>) {
        let (mut ips, mut ports) = (HashSet::new(), HashSet::new());
        for (k, s) in &self.objects[Kind::Service.idx()] {
            if k == except {
                continue;
            }
            for ip in strings(s.pointer("/spec/clusterIPs")) {
                if let Ok(ip) = ip.parse() {
                    ips.insert(ip);
                }
            }
            for p in s.pointer("/spec/ports").and_then(Value::as_array).into_iter().flatten() {
                if let Some(n) = p.get("nodePort").and_then(Value::as_u64).filter(|n| *n > 0) {
                    ports.insert(n as u16);
                }
            }
        }
        (ips, ports)
    }

    /// Fill and check the allocated fields of a Service being created (`old` None) or
    /// updated: ClusterIPs and IP families (immutable once set, carried over when a PUT
    /// omits them), and NodePorts for NodePort/LoadBalancer Services (kept across updates,
    /// dropped when the type no longer uses them). 422 on a conflict or an IP outside the
    /// ranges; nothing is written when it fails.
    pub(super) fn allocate_service(
        &self,
        ns: Option<&str>,
        obj: &mut Value,
        old: Option<&Value>,
    ) -> Result<(), ApiError> {
        let name = obj
            .pointer("/metadata/name")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_string();
        let key = key_of(ns, &name);
        let (used_ips, used_ports) = self.service_allocations(&key);
        let mut errs = Errs::default();
        if !obj.get("spec").is_some_and(Value::is_object) {
            obj["spec"] = json!({});
        }
        let old_spec = old.and_then(|o| o.get("spec")).cloned().unwrap_or(json!({}));
        let spec = obj["spec"].as_object_mut().expect("made an object above");
        let ty = spec
            .get("type")
            .and_then(Value::as_str)
            .unwrap_or("ClusterIP")
            .to_string();
        let old_ty = old_spec.get("type").and_then(Value::as_str).unwrap_or("ClusterIP");
        let net = &self.service_network;
        if ty == "ExternalName" {
            for f in ["clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"] {
                spec.remove(f);
            }
        } else {
            // A PUT that omits the allocated fields keeps them (as `patchAllocatedValues`).
            if old_ty != "ExternalName" && old.is_some() {
                let empty = |v: Option<&Value>| v.is_none_or(|v| v.is_null() || v.as_str() == Some(""));
                let ip_given = !empty(spec.get("clusterIP"));
                for f in ["clusterIP", "clusterIPs", "ipFamilyPolicy", "ipFamilies"] {
                    if f == "clusterIPs" && ip_given {
                        continue;
                    }
                    let missing =
                        empty(spec.get(f)) || spec.get(f).and_then(Value::as_array).is_some_and(|a| a.is_empty());
                    if missing {
                        if let Some(v) = old_spec.get(f) {
                            spec.insert(f.into(), v.clone());
                        }
                    }
                }
            }
            let mut ips = strings(spec.get("clusterIPs"));
            ips.retain(|s| !s.is_empty());
            let ip = spec.get("clusterIP").and_then(Value::as_str).unwrap_or("").to_string();
            if !ip.is_empty() {
                match ips.first() {
                    None => ips.push(ip.clone()),
                    Some(first) if *first != ip => {
                        errs.invalid("spec.clusterIPs", &json!(ips), "element [0] must match clusterIP")
                    }
                    Some(_) => {}
                }
            }
            let old_ips = strings(old_spec.get("clusterIPs"));
            if old_ty != "ExternalName" && !old_ips.is_empty() && ips.first() != old_ips.first() {
                errs.invalid("spec.clusterIPs[0]", &json!(ips.first()), "field is immutable");
            }
            let headless = ips.first().map(String::as_str) == Some("None");
            let parsed: Vec<Option<IpAddr>> = ips.iter().map(|s| s.parse().ok()).collect();
            let mut fams = strings(spec.get("ipFamilies"));
            let cluster_fams: Vec<&str> = net.cidrs.iter().map(cidr_family).collect();
            let dual_cluster = cluster_fams.len() > 1;
            let has_selector = spec
                .get("selector")
                .and_then(Value::as_object)
                .is_some_and(|m| !m.is_empty());
            let policy = match spec.get("ipFamilyPolicy").and_then(Value::as_str) {
                Some(p) => p.to_string(),
                None if headless && !has_selector => "RequireDualStack".into(),
                None if ips.len() > 1 => "RequireDualStack".into(),
                None if fams.len() > 1 => {
                    errs.invalid(
                        "spec.ipFamilyPolicy",
                        &Value::Null,
                        "must be RequireDualStack or PreferDualStack when multiple 'ipFamilies' are specified",
                    );
                    "PreferDualStack".into()
                }
                None => "SingleStack".into(),
            };
            // Families of the given IPs come first.
            for (i, ip) in parsed.iter().enumerate() {
                if let Some(ip) = ip {
                    let f = family_of(ip);
                    match fams.get(i) {
                        Some(want) if want != f => errs.invalid(
                            &format!("spec.ipFamilies[{i}]"),
                            &json!(want),
                            &format!("must match the family of the clusterIP {ip}"),
                        ),
                        Some(_) => {}
                        None => fams.push(f.into()),
                    }
                }
            }
            if fams.is_empty() {
                fams.push(cluster_fams.first().copied().unwrap_or("IPv4").into());
            }
            if policy == "RequireDualStack" && !dual_cluster && !headless {
                errs.invalid(
                    "spec.ipFamilyPolicy",
                    &json!(policy),
                    "this cluster is not configured for dual-stack services",
                );
            }
            let want_dual = policy == "RequireDualStack" || (policy == "PreferDualStack" && dual_cluster);
            if want_dual && fams.len() == 1 {
                if let Some(other) = cluster_fams.iter().find(|f| **f != fams[0]) {
                    fams.push((*other).into());
                }
            }
            if policy == "SingleStack" && (fams.len() > 1 || ips.len() > 1) {
                errs.invalid(
                    "spec.ipFamilies",
                    &json!(fams),
                    "when ipFamilyPolicy is SingleStack only one family may be specified",
                );
            }
            for (i, f) in fams.iter().enumerate() {
                if !cluster_fams.contains(&f.as_str()) && !headless {
                    errs.invalid(
                        &format!("spec.ipFamilies[{i}]"),
                        &json!(f),
                        "not configured on this cluster",
                    );
                }
            }
            if headless {
                spec.insert("clusterIPs".into(), json!(["None"]));
            } else {
                let mut out = Vec::new();
                for (i, fam) in fams.iter().enumerate() {
                    let Some(cidr) = net.cidrs.iter().find(|c| cidr_family(c) == fam) else {
                        continue;
                    };
                    let field = format!("spec.clusterIPs[{i}]");
                    match (ips.get(i), parsed.get(i).copied().flatten()) {
                        (Some(s), None) => errs.invalid(&field, &json!(s), "must be a valid IP address"),
                        (Some(_), Some(ip)) => {
                            let mine = old_ips.iter().any(|o| o.parse::<IpAddr>().ok() == Some(ip));
                            if !cidr.contains(&ip) {
                                errs.invalid(
                                    &field,
                                    &json!(ip.to_string()),
                                    &format!("failed to allocate IP {ip}: provided IP is not in the valid range. The range of valid IPs is {cidr}"),
                                );
                            } else if used_ips.contains(&ip) && !mine {
                                errs.invalid(
                                    &field,
                                    &json!(ip.to_string()),
                                    &format!("failed to allocate IP {ip}: provided IP is already allocated"),
                                );
                            }
                            out.push(ip.to_string());
                        }
                        (None, _) => match pick_ip(cidr, &used_ips) {
                            Some(ip) => out.push(ip.to_string()),
                            None => errs.invalid(
                                &field,
                                &Value::Null,
                                &format!("failed to allocate a serviceIP: range {cidr} is full"),
                            ),
                        },
                    }
                }
                if let Some(first) = out.first() {
                    spec.insert("clusterIP".into(), json!(first));
                }
                spec.insert("clusterIPs".into(), json!(out));
            }
            if headless {
                spec.insert("clusterIP".into(), json!("None"));
            }
            spec.insert("ipFamilyPolicy".into(), json!(policy));
            spec.insert("ipFamilies".into(), json!(fams));
        }
        self.allocate_node_ports(spec, &ty, &old_spec, &used_ports, &mut errs);
        if errs.0.is_empty() {
            Ok(())
        } else {
            Err(invalid(&name, errs.0))
        }
    }

    /// Node ports of a Service: given ones checked against the range and other Services,
    /// missing ones kept from the old object (same port and protocol) or allocated.
    fn allocate_node_ports(
        &self,
        spec: &mut serde_json::Map<String, Value>,
        ty: &str,
        old_spec: &Value,
        used: &HashSet<u16>,
        errs: &mut Errs,
    ) {
        let range = &self.service_network.node_ports;
        let old_ports: Vec<Value> = old_spec
            .get("ports")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        let Some(ports) = spec.get_mut("ports").and_then(Value::as_array_mut) else {
            return;
        };
        let proto = |p: &Value| p.get("protocol").and_then(Value::as_str).unwrap_or("TCP").to_string();
        let np_of = |p: &Value| p.get("nodePort").and_then(Value::as_u64).filter(|n| *n > 0);
        if !uses_node_ports(ty) {
            if old_spec
                .get("type")
                .and_then(Value::as_str)
                .is_some_and(uses_node_ports)
            {
                for p in ports.iter_mut().filter_map(Value::as_object_mut) {
                    p.remove("nodePort");
                }
            }
            return;
        }
        let mine: HashSet<u16> = old_ports.iter().filter_map(np_of).map(|n| n as u16).collect();
        let mut taken: Vec<(u16, String)> = Vec::new();
        for (i, p) in ports.iter_mut().enumerate() {
            if !p.is_object() {
                continue;
            }
            if np_of(p).is_none() {
                let same = old_ports
                    .iter()
                    .find(|o| o.get("port") == p.get("port") && proto(o) == proto(p));
                if let Some(n) = same.and_then(np_of) {
                    p["nodePort"] = json!(n);
                }
            }
            let Some(n) = np_of(p) else { continue };
            let field = format!("spec.ports[{i}].nodePort");
            let n16 = u16::try_from(n).unwrap_or(0);
            if n16 == 0 || !range.contains(&n16) {
                errs.invalid(
                    &field,
                    &json!(n),
                    &format!(
                        "provided port is not in the valid range. The range of valid ports is {}-{}",
                        range.start(),
                        range.end()
                    ),
                );
            } else if used.contains(&n16) && !mine.contains(&n16) {
                errs.invalid(&field, &json!(n), "provided port is already allocated");
            } else if taken.iter().any(|(t, pr)| *t == n16 && *pr == proto(p)) {
                errs.push("FieldValueDuplicate", format!("Duplicate value: {n}"), &field);
            }
            taken.push((n16, proto(p)));
        }
        let mut used_now: HashSet<u16> = used.clone();
        used_now.extend(taken.iter().map(|(n, _)| *n));
        for (i, p) in ports.iter_mut().enumerate() {
            if !p.is_object() || np_of(p).is_some() {
                continue;
            }
            match pick_port(range, &used_now) {
                Some(n) => {
                    used_now.insert(n);
                    p["nodePort"] = json!(n);
                }
                None => errs.invalid(
                    &format!("spec.ports[{i}].nodePort"),
                    &Value::Null,
                    "failed to allocate a nodePort: range is full",
                ),
            }
        }
    }
}

/// 422 Invalid for the Service `name`.
fn invalid(name: &str, causes: Vec<Cause>) -> ApiError {
    ApiError::Invalid {
        kind: Kind::Service.kind().into(),
        group: String::new(),
        group_suffix: String::new(),
        name: name.into(),
        causes,
    }
}

#[cfg(test)]
mod tests;
