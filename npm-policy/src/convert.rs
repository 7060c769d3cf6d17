//! Kubernetes API objects (k8s-openapi, v1_34) -> [`crate::model`] types,
//! the [`Snapshot`] builders, and YAML loading of multi-document files.
//!
//! Policies go through [`crate::validate::convert_policy`]: each lands in
//! [`Snapshot::policies`] as far as it is understood (a policy with a part
//! that cannot be understood keeps isolating the pods it selects; only that
//! part is dropped), and the report of each one that is not fully
//! understood in [`Snapshot::invalid_policies`].

use std::net::IpAddr;

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::networking::v1 as netv1;

use crate::model::{ContainerPort, Namespace, Node, Pod, PodPhase, Protocol, Snapshot};
use crate::validate::{convert_policy, parse_protocol};

/// Errors converting API objects.
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// An object lacks metadata.name.
    #[error("{kind} without metadata.name")]
    MissingName {
        /// Object kind.
        kind: &'static str,
    },
    /// A node address does not parse.
    #[error("node {object}: {field}: invalid IP {value:?}")]
    BadNodeIp {
        /// Node name.
        object: String,
        /// Field path.
        field: String,
        /// The value.
        value: String,
    },
    /// A pod address does not parse.
    #[error("pod {object}: {field}: invalid IP {value:?}")]
    BadPodIp {
        /// `namespace/name`.
        object: String,
        /// Field path.
        field: String,
        /// The text.
        value: String,
    },
    /// A container port is out of range or has an unknown protocol.
    #[error("pod {object}: {field}: {message}")]
    BadContainerPort {
        /// `namespace/name`.
        object: String,
        /// Field path.
        field: String,
        /// What is wrong.
        message: String,
    },
}

/// Errors loading YAML.
#[derive(Debug, thiserror::Error)]
pub enum YamlError {
    /// A document is not valid YAML.
    #[error("document {index}: {source}")]
    Syntax {
        /// Document index (0-based).
        index: usize,
        /// Parser error.
        source: serde_yaml::Error,
    },
    /// A document does not deserialize into its kind.
    #[error("document {index} ({kind} {name}): {source}")]
    Object {
        /// Document index (0-based).
        index: usize,
        /// Kind.
        kind: String,
        /// metadata.name, if any.
        name: String,
        /// Deserialization error.
        source: serde_yaml::Error,
    },
    /// A document has a kind other than Namespace, Pod, NetworkPolicy,
    /// ClusterNetworkPolicy, List.
    #[error("document {index}: unsupported kind {kind:?} (want Namespace, Pod, NetworkPolicy, ClusterNetworkPolicy, Node or List)")]
    UnsupportedKind {
        /// Document index.
        index: usize,
        /// Kind.
        kind: String,
    },
    /// Converting an object failed.
    #[error("document {index}: {source}")]
    Convert {
        /// Document index.
        index: usize,
        /// Conversion error.
        source: ConvertError,
    },
}

/// Objects read from YAML.
#[derive(Clone, Debug, Default)]
pub struct Objects {
    /// Namespaces.
    pub namespaces: Vec<corev1::Namespace>,
    /// Pods.
    pub pods: Vec<corev1::Pod>,
    /// NetworkPolicies.
    pub policies: Vec<netv1::NetworkPolicy>,
    /// ClusterNetworkPolicies (add them with
    /// [`Snapshot::upsert_cluster_policy`]).
    pub cluster_policies: Vec<crate::tiers::ClusterNetworkPolicy>,
    /// Nodes (convert them with [`node_from_api`]).
    pub nodes: Vec<corev1::Node>,
}

impl Objects {
    /// Appends the objects of `other`.
    pub fn extend(&mut self, other: Objects) {
        self.namespaces.extend(other.namespaces);
        self.pods.extend(other.pods);
        self.policies.extend(other.policies);
        self.cluster_policies.extend(other.cluster_policies);
        self.nodes.extend(other.nodes);
    }
}

fn push_value(out: &mut Objects, index: usize, v: serde_yaml::Value) -> Result<(), YamlError> {
    if v.is_null() {
        return Ok(());
    }
    let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or("").to_string();
    let name = v
        .get("metadata")
        .and_then(|m| m.get("name"))
        .and_then(|n| n.as_str())
        .unwrap_or("")
        .to_string();
    let wrap = |source| YamlError::Object {
        index,
        kind: kind.clone(),
        name: name.clone(),
        source,
    };
    match kind.as_str() {
        "Namespace" => out.namespaces.push(serde_yaml::from_value(v).map_err(wrap)?),
        "Pod" => out.pods.push(serde_yaml::from_value(v).map_err(wrap)?),
        "NetworkPolicy" => out.policies.push(serde_yaml::from_value(v).map_err(wrap)?),
        "ClusterNetworkPolicy" => out.cluster_policies.push(serde_yaml::from_value(v).map_err(wrap)?),
        "Node" => out.nodes.push(serde_yaml::from_value(v).map_err(wrap)?),
        "List" | "NamespaceList" | "PodList" | "NetworkPolicyList" | "ClusterNetworkPolicyList" | "NodeList" => {
            if let Some(items) = v.get("items").and_then(|i| i.as_sequence()) {
                for item in items.clone() {
                    push_value(out, index, item)?;
                }
            }
        }
        _ => return Err(YamlError::UnsupportedKind { index, kind }),
    }
    Ok(())
}

/// Parses a multi-document YAML text of Namespace, Pod, NetworkPolicy,
/// ClusterNetworkPolicy, Node (and `List`) objects.
pub fn load_yaml(text: &str) -> Result<Objects, YamlError> {
    use serde::Deserialize;
    let mut out = Objects::default();
    for (index, doc) in serde_yaml::Deserializer::from_str(text).enumerate() {
        let v = serde_yaml::Value::deserialize(doc).map_err(|source| YamlError::Syntax { index, source })?;
        push_value(&mut out, index, v)?;
    }
    Ok(out)
}

/// Converts a Namespace; adds `kubernetes.io/metadata.name` as the API
/// server does.
pub fn namespace_from_api(ns: &corev1::Namespace) -> Result<Namespace, ConvertError> {
    let name = ns
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Namespace" })?;
    let mut labels = ns.metadata.labels.clone().unwrap_or_default();
    labels.insert("kubernetes.io/metadata.name".to_string(), name.clone());
    Ok(Namespace { name, labels })
}

/// Converts a Pod. `status.podIPs` (else `status.podIP`) give the
/// addresses; container ports of init containers count too (sidecars).
pub fn pod_from_api(p: &corev1::Pod) -> Result<Pod, ConvertError> {
    let name = p
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Pod" })?;
    let namespace = p.metadata.namespace.clone().unwrap_or_else(|| "default".to_string());
    let object = format!("{namespace}/{name}");
    let status = p.status.clone().unwrap_or_default();
    let mut texts: Vec<(String, String)> = status
        .pod_ips
        .iter()
        .flatten()
        .enumerate()
        .map(|(i, ip)| (format!("status.podIPs[{i}].ip"), ip.ip.clone()))
        .collect();
    if texts.is_empty() {
        if let Some(ip) = status.pod_ip.clone().filter(|s| !s.is_empty()) {
            texts.push(("status.podIP".to_string(), ip));
        }
    }
    let mut ips: Vec<IpAddr> = Vec::new();
    for (field, t) in texts {
        let ip: IpAddr = t.parse().map_err(|_| ConvertError::BadPodIp {
            object: object.clone(),
            field,
            value: t.clone(),
        })?;
        if !ips.iter().any(|x| x.is_ipv4() == ip.is_ipv4()) {
            ips.push(ip);
        }
    }
    let phase = match status.phase.as_deref() {
        Some("Running") => PodPhase::Running,
        Some("Succeeded") => PodPhase::Succeeded,
        Some("Failed") => PodPhase::Failed,
        Some("Unknown") => PodPhase::Unknown,
        _ => PodPhase::Pending,
    };
    let spec = p.spec.clone().unwrap_or_default();
    let mut ports = Vec::new();
    let containers = spec
        .init_containers
        .iter()
        .flatten()
        .map(|c| ("initContainers", c))
        .chain(spec.containers.iter().map(|c| ("containers", c)));
    let mut counters = std::collections::BTreeMap::<&str, usize>::new();
    for (field, c) in containers {
        let ci = counters.entry(field).or_default();
        for (pi, cp) in c.ports.iter().flatten().enumerate() {
            let path = format!("spec.{field}[{ci}].ports[{pi}]");
            if !(1..=65535).contains(&cp.container_port) {
                return Err(ConvertError::BadContainerPort {
                    object,
                    field: format!("{path}.containerPort"),
                    message: format!("{} out of range", cp.container_port),
                });
            }
            let protocol = match cp.protocol.as_deref() {
                None => Protocol::Tcp,
                Some(s) => parse_protocol(s).ok_or_else(|| ConvertError::BadContainerPort {
                    object: object.clone(),
                    field: format!("{path}.protocol"),
                    message: format!("unsupported protocol {s:?}"),
                })?,
            };
            ports.push(ContainerPort {
                name: cp.name.clone(),
                port: cp.container_port as u16,
                protocol,
            });
        }
        *ci += 1;
    }
    Ok(Pod {
        uid: p.metadata.uid.clone().unwrap_or_else(|| object.clone()),
        namespace,
        name,
        labels: p.metadata.labels.clone().unwrap_or_default().into(),
        ips,
        node_name: spec.node_name.clone(),
        phase,
        deleting: p.metadata.deletion_timestamp.is_some(),
        host_network: spec.host_network.unwrap_or(false),
        ports,
        created: p
            .metadata
            .creation_timestamp
            .as_ref()
            .map(|t| t.0.as_second())
            .unwrap_or(0),
    })
}

/// Converts a Node: its labels and its `status.addresses` of type
/// `InternalIP` and `ExternalIP` (in API order, duplicates dropped;
/// `Hostname`, `InternalDNS`, `ExternalDNS` are names, not addresses). An
/// address that does not parse is an error naming it.
pub fn node_from_api(n: &corev1::Node) -> Result<Node, ConvertError> {
    let name = n
        .metadata
        .name
        .clone()
        .ok_or(ConvertError::MissingName { kind: "Node" })?;
    let mut addresses: Vec<IpAddr> = Vec::new();
    let listed = n.status.as_ref().and_then(|s| s.addresses.as_ref());
    for (i, a) in listed.into_iter().flatten().enumerate() {
        if a.type_ != "InternalIP" && a.type_ != "ExternalIP" {
            continue;
        }
        let ip: IpAddr = a.address.trim().parse().map_err(|_| ConvertError::BadNodeIp {
            object: name.clone(),
            field: format!("status.addresses[{i}].address"),
            value: a.address.clone(),
        })?;
        // An IPv4-mapped IPv6 address is the IPv4 address (as for pods'
        // addresses in the datapath's mapped space).
        let ip = ip.to_canonical();
        if !addresses.contains(&ip) {
            addresses.push(ip);
        }
    }
    Ok(Node {
        name,
        labels: n.metadata.labels.clone().unwrap_or_default(),
        addresses,
    })
}

impl Snapshot {
    /// Adds or replaces a Node.
    pub fn upsert_node(&mut self, node: Node) {
        self.nodes.insert(node.name.clone(), node);
    }

    /// Removes a Node.
    pub fn remove_node(&mut self, name: &str) -> Option<Node> {
        self.nodes.remove(name)
    }

    /// Builds a snapshot from API objects. Policies that are not fully
    /// understood are kept without the parts that cannot be understood and
    /// reported in `invalid_policies`; a namespace or pod that cannot be
    /// converted is an error.
    pub fn from_objects(
        namespaces: &[corev1::Namespace],
        pods: &[corev1::Pod],
        policies: &[netv1::NetworkPolicy],
    ) -> Result<Snapshot, ConvertError> {
        let mut s = Snapshot::default();
        for ns in namespaces {
            s.upsert_namespace(namespace_from_api(ns)?);
        }
        for p in pods {
            s.upsert_pod(pod_from_api(p)?);
        }
        for np in policies {
            let _invalid_recorded = s.upsert_policy(np);
        }
        Ok(s)
    }

    /// Adds or replaces a namespace.
    pub fn upsert_namespace(&mut self, ns: Namespace) {
        self.namespaces.insert(ns.name.clone(), ns);
    }

    /// Removes a namespace (its pods and policies stay until removed too,
    /// as with API watch events).
    pub fn remove_namespace(&mut self, name: &str) -> Option<Namespace> {
        self.namespaces.remove(name)
    }

    /// Adds or replaces a pod.
    pub fn upsert_pod(&mut self, pod: Pod) {
        self.pods.insert((pod.namespace.clone(), pod.name.clone()), pod);
    }

    /// Removes a pod.
    pub fn remove_pod(&mut self, namespace: &str, name: &str) -> Option<Pod> {
        self.pods.remove(&(namespace.to_string(), name.to_string()))
    }

    /// Converts and adds or replaces a policy. One that is not fully
    /// understood is added without the parts that cannot be understood (it
    /// keeps isolating the pods it selects; see [`crate::validate`]), its
    /// report is recorded in `invalid_policies` and returned as the error.
    pub fn upsert_policy(&mut self, np: &netv1::NetworkPolicy) -> Result<(), crate::model::InvalidPolicy> {
        let c = convert_policy(np);
        let (ns, name) = (c.policy.namespace.clone(), c.policy.name.clone());
        self.remove_policy(&ns, &name);
        let invalid = c.invalid();
        self.policies.insert((ns, name), c.policy);
        match invalid {
            None => Ok(()),
            Some(e) => {
                self.invalid_policies.push(e.clone());
                Err(e)
            }
        }
    }

    /// Removes a policy (valid or invalid).
    pub fn remove_policy(&mut self, namespace: &str, name: &str) {
        self.policies.remove(&(namespace.to_string(), name.to_string()));
        self.invalid_policies
            .retain(|p| !(p.namespace == namespace && p.name == name));
    }
}
