//! Builders of `k8s-openapi` objects, as a test writes them to the API
//! server.

use k8s_openapi::api::core::v1::{Container, ContainerPort, Namespace, Pod, PodIP, PodSpec, PodStatus};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

fn labels_of(labels: &[(&str, &str)]) -> Option<std::collections::BTreeMap<String, String>> {
    Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect())
}

/// A namespace with labels.
pub fn namespace(name: &str, labels: &[(&str, &str)]) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: labels_of(labels),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// A Running pod on `node` with `ip` (None: no IP yet) and labels; one
/// container with the named port `http` (TCP 80).
pub fn pod(ns: &str, name: &str, node: &str, ip: Option<&str>, labels: &[(&str, &str)]) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(ns.into()),
            labels: labels_of(labels),
            ..Default::default()
        },
        spec: Some(PodSpec {
            node_name: Some(node.into()),
            containers: vec![Container {
                name: "c".into(),
                image: Some("agnhost".into()),
                ports: Some(vec![ContainerPort {
                    name: Some("http".into()),
                    container_port: 80,
                    protocol: Some("TCP".into()),
                    ..Default::default()
                }]),
                ..Default::default()
            }],
            ..Default::default()
        }),
        status: Some(PodStatus {
            phase: Some("Running".into()),
            pod_ip: ip.map(String::from),
            pod_ips: ip.map(|i| vec![PodIP { ip: i.into() }]),
            ..Default::default()
        }),
    }
}
