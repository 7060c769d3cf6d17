//! The kube-proxy view of the cluster: from full lists of Services and EndpointSlices, the
//! service ports of one IP family with their ready endpoints, as kube-proxy's
//! `ServicePortName`s and endpoint maps (sorted, so a state renders to the same rules).

use std::collections::BTreeSet;
use std::net::IpAddr;

use serde_json::Value;

/// The EndpointSlice label naming the Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// One endpoint of a service port.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Endpoint {
    /// Backend address.
    pub ip: IpAddr,
    /// Backend port (the resolved targetPort).
    pub port: u16,
    /// Whether the endpoint is on this node (`nodeName`).
    pub local: bool,
}

/// One port of one Service in one family (kube-proxy's `ServicePortName` plus its IP).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServicePort {
    /// Namespace of the Service.
    pub namespace: String,
    /// Name of the Service.
    pub name: String,
    /// Name of the port (may be empty when the Service has one port).
    pub port_name: String,
    /// Protocol in nft/iptables spelling: `tcp`, `udp`, `sctp`.
    pub proto: &'static str,
    /// The ClusterIP of this family.
    pub cluster_ip: IpAddr,
    /// The Service port.
    pub port: u16,
    /// The NodePort, for NodePort and LoadBalancer Services.
    pub node_port: Option<u16>,
    /// `externalTrafficPolicy: Local`.
    pub external_local: bool,
    /// `internalTrafficPolicy: Local`: the ClusterIP leads to this node's
    /// endpoints only (none: dropped).
    pub internal_local: bool,
    /// Ready endpoints, sorted and deduplicated.
    pub endpoints: Vec<Endpoint>,
}

impl ServicePort {
    /// `ns/name/proto/portname`, the identity kube-proxy names chains after.
    pub fn id(&self) -> String {
        format!("{}/{}/{}/{}", self.namespace, self.name, self.proto, self.port_name)
    }

    /// The endpoints on this node.
    pub fn local_endpoints(&self) -> Vec<&Endpoint> {
        self.endpoints.iter().filter(|e| e.local).collect()
    }
}

/// Protocol spelling of the rules for an API protocol (None: not one kube-proxy serves).
fn proto_of(p: Option<&str>) -> Option<&'static str> {
    match p.unwrap_or("TCP") {
        "TCP" => Some("tcp"),
        "UDP" => Some("udp"),
        "SCTP" => Some("sctp"),
        _ => None,
    }
}

fn str_at<'a>(v: &'a Value, ptr: &str) -> &'a str {
    v.pointer(ptr).and_then(Value::as_str).unwrap_or("")
}

fn port_at(v: &Value, key: &str) -> Option<u16> {
    v.get(key)
        .and_then(Value::as_u64)
        .and_then(|n| u16::try_from(n).ok())
        .filter(|n| *n > 0)
}

/// The service ports of family `v6` from full lists of Services and EndpointSlices, for the
/// node `node_name`. Headless and ExternalName Services have none; endpoints whose
/// `conditions.ready` is false are left out (absent means ready, as the API says).
pub fn service_ports(services: &[Value], slices: &[Value], node_name: &str, v6: bool) -> Vec<ServicePort> {
    let addr_type = if v6 { "IPv6" } else { "IPv4" };
    let mut out = Vec::new();
    for svc in services {
        let ns = str_at(svc, "/metadata/namespace");
        let name = str_at(svc, "/metadata/name");
        let ty = svc.pointer("/spec/type").and_then(Value::as_str).unwrap_or("ClusterIP");
        if ty == "ExternalName" {
            continue;
        }
        let ips: Vec<IpAddr> = svc
            .pointer("/spec/clusterIPs")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
            .filter_map(|s| s.as_str()?.parse().ok())
            .collect();
        let Some(cluster_ip) = ips.into_iter().find(|ip: &IpAddr| ip.is_ipv6() == v6) else {
            continue;
        };
        let node_ports = matches!(ty, "NodePort" | "LoadBalancer");
        let external_local = svc.pointer("/spec/externalTrafficPolicy").and_then(Value::as_str) == Some("Local");
        let internal_local = svc.pointer("/spec/internalTrafficPolicy").and_then(Value::as_str) == Some("Local");
        let my_slices: Vec<&Value> = slices
            .iter()
            .filter(|s| {
                str_at(s, "/metadata/namespace") == ns
                    && s.pointer("/metadata/labels")
                        .and_then(|l| l.get(SERVICE_NAME_LABEL))
                        .and_then(Value::as_str)
                        == Some(name)
                    && str_at(s, "/addressType") == addr_type
            })
            .collect();
        for p in svc
            .pointer("/spec/ports")
            .and_then(Value::as_array)
            .into_iter()
            .flatten()
        {
            let (Some(proto), Some(port)) = (proto_of(p.get("protocol").and_then(Value::as_str)), port_at(p, "port"))
            else {
                continue;
            };
            let port_name = p.get("name").and_then(Value::as_str).unwrap_or("").to_string();
            let mut eps = BTreeSet::new();
            for s in &my_slices {
                let sp = s
                    .get("ports")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                    .find(|sp| {
                        sp.get("name").and_then(Value::as_str).unwrap_or("") == port_name
                            && proto_of(sp.get("protocol").and_then(Value::as_str)) == Some(proto)
                    });
                let Some(ep_port) = sp.and_then(|sp| port_at(sp, "port")) else {
                    continue;
                };
                for e in s.get("endpoints").and_then(Value::as_array).into_iter().flatten() {
                    if e.pointer("/conditions/ready").and_then(Value::as_bool) == Some(false) {
                        continue;
                    }
                    let local = !node_name.is_empty() && e.get("nodeName").and_then(Value::as_str) == Some(node_name);
                    for a in e.get("addresses").and_then(Value::as_array).into_iter().flatten() {
                        if let Some(ip) = a
                            .as_str()
                            .and_then(|s| s.parse::<IpAddr>().ok())
                            .filter(|ip| ip.is_ipv6() == v6)
                        {
                            eps.insert(Endpoint {
                                ip,
                                port: ep_port,
                                local,
                            });
                        }
                    }
                }
            }
            out.push(ServicePort {
                namespace: ns.to_string(),
                name: name.to_string(),
                port_name,
                proto,
                cluster_ip,
                port,
                node_port: if node_ports { port_at(p, "nodePort") } else { None },
                external_local,
                internal_local,
                endpoints: eps.into_iter().collect(),
            });
        }
    }
    out.sort_by_key(|sp| sp.id());
    out
}

/// A short stable hash of `s` (FNV-1a 64, 16 uppercase hex digits) for chain names.
pub fn chain_hash(s: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016X}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn ports_endpoints_families_and_readiness() {
        let svcs = vec![
            json!({"metadata": {"namespace": "x", "name": "web"}, "spec": {"type": "NodePort",
                "externalTrafficPolicy": "Local", "clusterIPs": ["10.96.0.10", "fd00:96::a"],
                "ports": [{"name": "http", "port": 80, "protocol": "TCP", "nodePort": 30080},
                          {"name": "dns", "port": 53, "protocol": "UDP", "nodePort": 30053}]}}),
            json!({"metadata": {"namespace": "x", "name": "headless"}, "spec": {"clusterIPs": ["None"], "ports": [{"port": 80}]}}),
        ];
        let slices = vec![
            json!({"metadata": {"namespace": "x", "name": "web-a", "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}, {"name": "dns", "port": 5353, "protocol": "UDP"}],
                "endpoints": [{"addresses": ["10.0.0.2"], "nodeName": "n1"},
                              {"addresses": ["10.0.0.3"], "nodeName": "n2", "conditions": {"ready": true}},
                              {"addresses": ["10.0.0.4"], "conditions": {"ready": false}}]}),
            json!({"metadata": {"namespace": "y", "name": "web-b", "labels": {"kubernetes.io/service-name": "web"}},
                "addressType": "IPv4", "ports": [{"name": "http", "port": 1}], "endpoints": [{"addresses": ["10.9.9.9"]}]}),
        ];
        let v4 = service_ports(&svcs, &slices, "n1", false);
        assert_eq!(v4.len(), 2);
        assert_eq!(v4[0].id(), "x/web/tcp/http");
        assert_eq!(v4[0].node_port, Some(30080));
        assert!(v4[0].external_local);
        let eps: Vec<(String, u16, bool)> = v4[0]
            .endpoints
            .iter()
            .map(|e| (e.ip.to_string(), e.port, e.local))
            .collect();
        assert_eq!(eps, [("10.0.0.2".into(), 8080, true), ("10.0.0.3".into(), 8080, false)]);
        assert_eq!(v4[1].id(), "x/web/udp/dns");
        assert_eq!(v4[1].endpoints[0].port, 5353);
        let v6 = service_ports(&svcs, &slices, "n1", true);
        assert_eq!(v6.len(), 2);
        assert!(v6[0].endpoints.is_empty(), "no IPv6 slice");
        assert_eq!(v6[0].cluster_ip.to_string(), "fd00:96::a");
    }
}
