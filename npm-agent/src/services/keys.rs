//! The Service keys of `NPM_SERVICES` computed from complete lists of
//! Services and Nodes (pure: no I/O): every address kube-proxy DNATs for
//! a pod's traffic with every service port: the ClusterIPs
//! (`spec.clusterIPs`, else `spec.clusterIP`), `spec.externalIPs` and the
//! LoadBalancer ingress IPs (`status.loadBalancer.ingress[].ip`, but not
//! those of `ipMode: Proxy`, which kube-proxy leaves to the load balancer);
//! and every node address (`status.addresses` of type `InternalIP` or
//! `ExternalIP`) with every NodePort. A headless Service (`None`) and an
//! `ExternalName` Service have no ClusterIP, and kube-proxy serves none of
//! their addresses; a port whose protocol is not TCP, UDP or SCTP is
//! skipped; an address that does not parse is skipped (and counted).

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::core::v1::ServiceSpec;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use npm_common::{proto, SVC_CLUSTER_IP, SVC_EXTERNAL_IP, SVC_HOST_PORT, SVC_LOAD_BALANCER, SVC_NODE_PORT};
use npm_dataplane::ebpf::ServicePort;

/// The computed keys and what was skipped.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ServiceKeys {
    /// Key -> `SVC_*` flags (a key both a ClusterIP port and a NodePort,
    /// which a valid cluster never has, gets both).
    pub keys: BTreeMap<ServicePort, u32>,
    /// Addresses or protocols that could not be used (`ns/name: what`).
    pub skipped: Vec<String>,
}

/// The protocol number of a Service port's protocol (default TCP).
fn protocol(p: Option<&str>) -> Option<u8> {
    match p.unwrap_or("TCP") {
        "TCP" => Some(proto::TCP),
        "UDP" => Some(proto::UDP),
        "SCTP" => Some(proto::SCTP),
        _ => None,
    }
}

/// The addresses of a Node that kube-proxy serves NodePorts on.
fn node_addresses(node: &Node, skipped: &mut Vec<String>) -> Vec<IpAddr> {
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let mut out = Vec::new();
    for a in node
        .status
        .as_ref()
        .and_then(|s| s.addresses.as_ref())
        .into_iter()
        .flatten()
    {
        if a.type_ != "InternalIP" && a.type_ != "ExternalIP" {
            continue;
        }
        match a.address.parse::<IpAddr>() {
            Ok(ip) => out.push(canonical(ip)),
            Err(_) => skipped.push(format!("node {name}: address {:?}", a.address)),
        }
    }
    out
}

/// The addresses other than ClusterIPs that kube-proxy DNATs to the
/// Service's backends, each with its `SVC_*` flag: `spec.externalIPs`
/// and the LoadBalancer ingress IPs (not `ipMode: Proxy`; an ingress with
/// only a hostname has none).
fn external_addresses(svc: &Service, spec: &ServiceSpec, id: &str, skipped: &mut Vec<String>) -> Vec<(IpAddr, u32)> {
    let mut out = Vec::new();
    for e in spec.external_ips.iter().flatten() {
        match e.parse::<IpAddr>() {
            Ok(ip) => out.push((canonical(ip), SVC_EXTERNAL_IP)),
            Err(_) => skipped.push(format!("service {id}: externalIP {e:?}")),
        }
    }
    let ingress = svc
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|lb| lb.ingress.as_ref());
    for i in ingress.into_iter().flatten() {
        let Some(a) = i.ip.as_deref().filter(|a| !a.is_empty()) else {
            continue;
        };
        if i.ip_mode.as_deref() == Some("Proxy") {
            continue;
        }
        match a.parse::<IpAddr>() {
            Ok(ip) => out.push((canonical(ip), SVC_LOAD_BALANCER)),
            Err(_) => skipped.push(format!("service {id}: loadBalancer ingress IP {a:?}")),
        }
    }
    out
}

/// IPv4-mapped IPv6 is IPv4.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// The keys of `services` and `nodes` (both complete lists).
pub fn service_keys<'a>(
    services: impl IntoIterator<Item = &'a Service>,
    nodes: impl IntoIterator<Item = &'a Node>,
) -> ServiceKeys {
    let mut out = ServiceKeys::default();
    let mut node_ips: Vec<IpAddr> = Vec::new();
    for n in nodes {
        node_ips.extend(node_addresses(n, &mut out.skipped));
    }
    node_ips.sort();
    node_ips.dedup();
    for svc in services {
        let Some(spec) = svc.spec.as_ref() else { continue };
        let id = format!(
            "{}/{}",
            svc.metadata.namespace.as_deref().unwrap_or_default(),
            svc.metadata.name.as_deref().unwrap_or_default()
        );
        if spec.type_.as_deref() == Some("ExternalName") {
            continue;
        }
        let mut cluster_ips: Vec<IpAddr> = Vec::new();
        let listed = spec
            .cluster_ips
            .clone()
            .filter(|l| !l.is_empty())
            .or_else(|| spec.cluster_ip.clone().map(|c| vec![c]))
            .unwrap_or_default();
        for c in listed {
            if c.is_empty() || c == "None" {
                continue;
            }
            match c.parse::<IpAddr>() {
                Ok(ip) => cluster_ips.push(canonical(ip)),
                Err(_) => out.skipped.push(format!("service {id}: clusterIP {c:?}")),
            }
        }
        // kube-proxy serves nothing of a Service without a ClusterIP.
        let external = if cluster_ips.is_empty() {
            Vec::new()
        } else {
            external_addresses(svc, spec, &id, &mut out.skipped)
        };
        for p in spec.ports.iter().flatten() {
            let Some(pr) = protocol(p.protocol.as_deref()) else {
                out.skipped.push(format!("service {id}: protocol {:?}", p.protocol));
                continue;
            };
            let Ok(port) = u16::try_from(p.port) else {
                out.skipped.push(format!("service {id}: port {}", p.port));
                continue;
            };
            for ip in &cluster_ips {
                let k = ServicePort {
                    addr: *ip,
                    port,
                    protocol: pr,
                };
                *out.keys.entry(k).or_default() |= SVC_CLUSTER_IP;
            }
            for (ip, flag) in &external {
                let k = ServicePort {
                    addr: *ip,
                    port,
                    protocol: pr,
                };
                *out.keys.entry(k).or_default() |= flag;
            }
            if let Some(np) = p.node_port.and_then(|n| u16::try_from(n).ok()).filter(|n| *n != 0) {
                for ip in &node_ips {
                    let k = ServicePort {
                        addr: *ip,
                        port: np,
                        protocol: pr,
                    };
                    *out.keys.entry(k).or_default() |= SVC_NODE_PORT;
                }
            }
        }
    }
    out
}

/// Adds the keys of this node's pods' `hostPort`s (the `portmap` CNI
/// plugin DNATs node:hostPort to the pod): the `hostIP` when it is set
/// and not the unspecified address, else every address of `node` (this
/// node; `None`: not listed, such ports are skipped and counted). A pod
/// that has finished (`Succeeded`, `Failed`) has no sandbox and no DNAT.
/// A port without `hostPort` (or 0) is not mapped.
pub fn add_host_port_keys<'a>(pods: impl IntoIterator<Item = &'a Pod>, node: Option<&Node>, out: &mut ServiceKeys) {
    let mut skipped = Vec::new();
    let node_ips = node.map(|n| node_addresses(n, &mut skipped));
    for pod in pods {
        let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
        if matches!(phase, Some("Succeeded" | "Failed")) {
            continue;
        }
        let id = format!(
            "{}/{}",
            pod.metadata.namespace.as_deref().unwrap_or_default(),
            pod.metadata.name.as_deref().unwrap_or_default()
        );
        let ports = pod
            .spec
            .iter()
            .flat_map(|s| s.containers.iter().chain(s.init_containers.iter().flatten()))
            .flat_map(|c| c.ports.iter().flatten());
        for p in ports {
            let Some(hp) = p.host_port.filter(|n| *n != 0) else {
                continue;
            };
            let (Ok(port), Some(pr)) = (u16::try_from(hp), protocol(p.protocol.as_deref())) else {
                skipped.push(format!("pod {id}: hostPort {hp}/{:?}", p.protocol));
                continue;
            };
            let addrs = match p.host_ip.as_deref().filter(|a| !a.is_empty()) {
                Some(a) => match a.parse::<IpAddr>() {
                    Ok(ip) if !ip.is_unspecified() => vec![canonical(ip)],
                    Ok(_) => node_ips.clone().unwrap_or_default(),
                    Err(_) => {
                        skipped.push(format!("pod {id}: hostIP {a:?}"));
                        continue;
                    }
                },
                None => node_ips.clone().unwrap_or_default(),
            };
            if addrs.is_empty() {
                skipped.push(format!("pod {id}: hostPort {hp} without a node address"));
            }
            for addr in addrs {
                *out.keys
                    .entry(ServicePort {
                        addr,
                        port,
                        protocol: pr,
                    })
                    .or_default() |= SVC_HOST_PORT;
            }
        }
    }
    out.skipped.extend(skipped);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn svc(name: &str, v: serde_json::Value) -> Service {
        let mut s: Service = serde_json::from_value(serde_json::json!({
            "metadata": {"namespace": "default", "name": name},
            "spec": v,
        }))
        .unwrap();
        s.metadata.name = Some(name.into());
        s
    }

    fn node(addrs: &[(&str, &str)]) -> Node {
        let addresses: Vec<serde_json::Value> = addrs
            .iter()
            .map(|(t, a)| serde_json::json!({"type": t, "address": a}))
            .collect();
        serde_json::from_value(serde_json::json!({
            "metadata": {"name": "n1"},
            "status": {"addresses": addresses},
        }))
        .unwrap()
    }

    fn key(a: &str, port: u16, protocol: u8) -> ServicePort {
        ServicePort {
            addr: a.parse().unwrap(),
            port,
            protocol,
        }
    }

    #[test]
    fn cluster_ips_and_node_ports_of_complete_lists() {
        let dns = svc(
            "kube-dns",
            serde_json::json!({"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10", "fd00::10"],
                "ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]}),
        );
        let web = svc(
            "web",
            serde_json::json!({"type": "NodePort", "clusterIP": "10.96.1.1",
                "ports": [{"port": 80, "targetPort": 8080, "nodePort": 30080}]}),
        );
        let headless = svc("h", serde_json::json!({"clusterIP": "None", "ports": [{"port": 80}]}));
        let ext = svc(
            "e",
            serde_json::json!({"type": "ExternalName", "externalName": "x.example"}),
        );
        let n = node(&[
            ("InternalIP", "192.0.2.10"),
            ("Hostname", "n1"),
            ("ExternalIP", "::ffff:198.51.100.1"),
        ]);
        let got = service_keys([&dns, &web, &headless, &ext], [&n]);
        let want: BTreeMap<ServicePort, u32> = [
            (key("10.96.0.10", 53, proto::UDP), SVC_CLUSTER_IP),
            (key("10.96.0.10", 53, proto::TCP), SVC_CLUSTER_IP),
            (key("fd00::10", 53, proto::UDP), SVC_CLUSTER_IP),
            (key("fd00::10", 53, proto::TCP), SVC_CLUSTER_IP),
            (key("10.96.1.1", 80, proto::TCP), SVC_CLUSTER_IP),
            (key("192.0.2.10", 30080, proto::TCP), SVC_NODE_PORT),
            (key("198.51.100.1", 30080, proto::TCP), SVC_NODE_PORT),
        ]
        .into_iter()
        .collect();
        assert_eq!(got.keys, want);
        assert!(got.skipped.is_empty(), "{:?}", got.skipped);
    }

    /// A hostPort is a key at every address of this node, or at its
    /// `hostIP`; not a container port without one, nor a finished pod's.
    #[test]
    fn host_ports_of_this_nodes_pods_are_keys() {
        let pod = |name: &str, phase: &str, ports: serde_json::Value| -> Pod {
            serde_json::from_value(serde_json::json!({
                "metadata": {"namespace": "default", "name": name},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "ports": ports}]},
                "status": {"phase": phase},
            }))
            .unwrap()
        };
        let ingress = pod(
            "ingress",
            "Running",
            serde_json::json!([
                {"containerPort": 8080, "hostPort": 80},
                {"containerPort": 8443, "hostPort": 443, "hostIP": "192.0.2.10"},
                {"containerPort": 53, "hostPort": 5353, "protocol": "UDP", "hostIP": "0.0.0.0"},
                {"containerPort": 9000},
                {"containerPort": 9001, "hostPort": 0},
            ]),
        );
        let done = pod(
            "done",
            "Succeeded",
            serde_json::json!([{"containerPort": 8080, "hostPort": 81}]),
        );
        let n = node(&[("InternalIP", "192.0.2.10"), ("ExternalIP", "198.51.100.1")]);
        let mut got = ServiceKeys::default();
        add_host_port_keys([&ingress, &done], Some(&n), &mut got);
        let want: BTreeMap<ServicePort, u32> = [
            (key("192.0.2.10", 80, proto::TCP), SVC_HOST_PORT),
            (key("198.51.100.1", 80, proto::TCP), SVC_HOST_PORT),
            (key("192.0.2.10", 443, proto::TCP), SVC_HOST_PORT),
            (key("192.0.2.10", 5353, proto::UDP), SVC_HOST_PORT),
            (key("198.51.100.1", 5353, proto::UDP), SVC_HOST_PORT),
        ]
        .into_iter()
        .collect();
        assert_eq!(got.keys, want);
        assert!(got.skipped.is_empty(), "{:?}", got.skipped);
        // This node not listed: the ports without a hostIP are skipped.
        let mut got = ServiceKeys::default();
        add_host_port_keys([&ingress], None, &mut got);
        assert_eq!(got.keys.len(), 1, "{:?}", got.keys);
        assert_eq!(got.skipped.len(), 2, "{:?}", got.skipped);
    }

    /// externalIPs and LoadBalancer ingress IPs are keys with every
    /// service port, as kube-proxy DNATs them; not an `ipMode: Proxy`
    /// ingress, nor a hostname-only one, nor those of a headless Service.
    #[test]
    fn external_and_load_balancer_ips_are_keys() {
        let mut lb = svc(
            "lb",
            serde_json::json!({"type": "LoadBalancer", "clusterIP": "10.96.2.2",
                "externalIPs": ["198.51.100.7", "2001:db8::7"],
                "ports": [{"port": 443, "nodePort": 30443}, {"port": 53, "protocol": "UDP", "nodePort": 30053}]}),
        );
        lb.status = Some(
            serde_json::from_value(serde_json::json!({"loadBalancer": {"ingress": [
                {"ip": "203.0.113.5", "ipMode": "VIP"},
                {"ip": "203.0.113.6"},
                {"ip": "203.0.113.9", "ipMode": "Proxy"},
                {"hostname": "lb.example"},
            ]}}))
            .unwrap(),
        );
        let mut headless = svc(
            "h",
            serde_json::json!({"clusterIP": "None", "externalIPs": ["198.51.100.8"], "ports": [{"port": 80}]}),
        );
        headless.status = lb.status.clone();
        let got = service_keys([&lb, &headless], []);
        let mut want: BTreeMap<ServicePort, u32> = BTreeMap::new();
        for (port, pr) in [(443, proto::TCP), (53, proto::UDP)] {
            want.insert(key("10.96.2.2", port, pr), SVC_CLUSTER_IP);
            want.insert(key("198.51.100.7", port, pr), SVC_EXTERNAL_IP);
            want.insert(key("2001:db8::7", port, pr), SVC_EXTERNAL_IP);
            want.insert(key("203.0.113.5", port, pr), SVC_LOAD_BALANCER);
            want.insert(key("203.0.113.6", port, pr), SVC_LOAD_BALANCER);
        }
        assert_eq!(got.keys, want);
        assert!(got.skipped.is_empty(), "{:?}", got.skipped);

        let bad = svc(
            "bad",
            serde_json::json!({"clusterIP": "10.96.2.3", "externalIPs": ["nope"], "ports": [{"port": 80}]}),
        );
        let got = service_keys([&bad], []);
        assert_eq!(got.keys.len(), 1);
        assert_eq!(
            got.skipped,
            vec!["service default/bad: externalIP \"nope\"".to_string()]
        );
    }

    #[test]
    fn bad_addresses_and_protocols_are_skipped_and_named() {
        let bad = svc(
            "bad",
            serde_json::json!({"clusterIP": "10.96.300.1", "ports": [{"port": 80, "protocol": "ICMP"}]}),
        );
        let got = service_keys([&bad], [&node(&[("InternalIP", "nope")])]);
        assert!(got.keys.is_empty());
        assert_eq!(got.skipped.len(), 3, "{:?}", got.skipped);
    }
}
