//! The topologies a case can run on: which namespaces and pods the
//! pristine model has, their labels, their container ports and the ports
//! their servers listen on.
//!
//! - [`Topology::Xyz`] (`xyz`, the default): kubernetes' netpol e2e model,
//!   namespaces x, y, z with pods a, b, c (label `pod=<name>`, namespaces
//!   `ns=<name>`), serving TCP/UDP/SCTP 80 and 81 (`serve-<port>-<proto>`).
//! - [`Topology::NetworkPolicyApi`] (`network-policy-api`): the topology of
//!   the ClusterNetworkPolicy conformance suite of
//!   kubernetes-sigs/network-policy-api: namespaces
//!   `network-policy-conformance-<house>` (label `conformance-house:
//!   <house>`) with two StatefulSet pods each (`harry-potter-0/1` in
//!   gryffindor, `draco-malfoy-0/1` in slytherin, `cedric-diggory-0/1` in
//!   hufflepuff, `luna-lovegood-0/1` in ravenclaw; label `conformance-house:
//!   <house>`), serving TCP 80 (container port `web`) and 8080, UDP 53
//!   (`dns`) and 5353, SCTP 9003 and 9005. The host-network
//!   `forbidden-forrest` namespace of the node-peer tests is not part of it
//!   (node peers are not supported).

use npm_policy::model::{ContainerPort, Labels, Protocol};
use serde::{Deserialize, Serialize};

/// The houses of the network-policy-api conformance topology with the
/// names of their StatefulSets.
pub const HOUSES: [(&str, &str); 4] = [
    ("gryffindor", "harry-potter"),
    ("slytherin", "draco-malfoy"),
    ("hufflepuff", "cedric-diggory"),
    ("ravenclaw", "luna-lovegood"),
];

/// The namespace of a house: `network-policy-conformance-<house>`.
pub fn house_namespace(house: &str) -> String {
    format!("network-policy-conformance-{house}")
}

/// A topology a case declares (`topology:` of the case or of its file).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Deserialize, Serialize)]
pub enum Topology {
    /// Namespaces x, y, z with pods a, b, c (the default).
    #[default]
    #[serde(rename = "xyz", alias = "upstream")]
    Xyz,
    /// The ClusterNetworkPolicy conformance topology of
    /// kubernetes-sigs/network-policy-api (four houses, two pods each).
    #[serde(rename = "network-policy-api", alias = "houses")]
    NetworkPolicyApi,
}

/// One namespace of a topology.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyNamespace {
    /// Name.
    pub name: String,
    /// Labels (the metadata-name label and, for [`Topology::Xyz`], `ns` are
    /// added by the model).
    pub labels: Labels,
    /// Pods: name and labels.
    pub pods: Vec<(String, Labels)>,
}

impl Topology {
    /// The name written in case files.
    pub fn name(&self) -> &'static str {
        match self {
            Topology::Xyz => "xyz",
            Topology::NetworkPolicyApi => "network-policy-api",
        }
    }

    /// The namespaces and pods of the pristine model, in address order.
    pub fn namespaces(&self) -> Vec<TopologyNamespace> {
        let one = |k: &str, v: &str| -> Labels { [(k.to_string(), v.to_string())].into() };
        match self {
            Topology::Xyz => ["x", "y", "z"]
                .iter()
                .map(|ns| TopologyNamespace {
                    name: ns.to_string(),
                    labels: Labels::new(),
                    pods: ["a", "b", "c"].iter().map(|p| (p.to_string(), one("pod", p))).collect(),
                })
                .collect(),
            Topology::NetworkPolicyApi => HOUSES
                .iter()
                .map(|(house, set)| TopologyNamespace {
                    name: house_namespace(house),
                    labels: one("conformance-house", house),
                    pods: (0..2)
                        .map(|i| (format!("{set}-{i}"), one("conformance-house", house)))
                        .collect(),
                })
                .collect(),
        }
    }

    /// The first namespace address index (`198.18.<index>.<pod>`): the
    /// houses use 11..14 so that their addresses never collide with x, y, z
    /// (1..3) when one run switches between topologies.
    pub fn first_namespace_index(&self) -> u16 {
        match self {
            Topology::Xyz => 1,
            Topology::NetworkPolicyApi => 11,
        }
    }

    /// Whether the model adds `ns=<name>` to every namespace (the netpol
    /// e2e convention; the houses carry only their declared labels).
    pub fn adds_ns_label(&self) -> bool {
        matches!(self, Topology::Xyz)
    }

    /// The container ports of every pod of this topology.
    pub fn container_ports(&self) -> Vec<ContainerPort> {
        match self {
            Topology::Xyz => crate::cases::model_container_ports(),
            Topology::NetworkPolicyApi => vec![
                ContainerPort {
                    name: Some("web".to_string()),
                    port: 80,
                    protocol: Protocol::Tcp,
                },
                ContainerPort {
                    name: Some("dns".to_string()),
                    port: 53,
                    protocol: Protocol::Udp,
                },
            ],
        }
    }

    /// The ports every live pod serves (TCP accept and UDP echo on each;
    /// SCTP is answered on every port by the live cluster's raw receiver),
    /// and the ports of its per-pod Service (each for TCP, UDP and SCTP).
    /// The houses: TCP 80, 8080, UDP 53, 5353, SCTP 9003, 9005, each opened
    /// for TCP and UDP (a superset of the upstream servers: no case expects
    /// a connection to a port its upstream server does not serve).
    pub fn served_ports(&self) -> Vec<u16> {
        match self {
            Topology::Xyz => vec![80, 81],
            Topology::NetworkPolicyApi => vec![80, 8080, 53, 5353, 9003, 9005],
        }
    }

    /// Every pod, `namespace/name`, in address order: the default `pods`
    /// of a probe.
    pub fn default_pods(&self) -> Vec<String> {
        self.namespaces()
            .iter()
            .flat_map(|ns| ns.pods.iter().map(move |(p, _)| format!("{}/{p}", ns.name)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topology_names_parse() {
        let t: Topology = serde_yaml::from_str("network-policy-api").unwrap();
        assert_eq!(t, Topology::NetworkPolicyApi);
        let t: Topology = serde_yaml::from_str("houses").unwrap();
        assert_eq!(t, Topology::NetworkPolicyApi);
        let t: Topology = serde_yaml::from_str("xyz").unwrap();
        assert_eq!(t, Topology::Xyz);
        assert!(serde_yaml::from_str::<Topology>("moon").is_err());
        assert_eq!(Topology::NetworkPolicyApi.default_pods().len(), 8);
        assert_eq!(
            Topology::NetworkPolicyApi.default_pods()[0],
            "network-policy-conformance-gryffindor/harry-potter-0"
        );
        assert_eq!(Topology::Xyz.default_pods(), crate::cases::default_pods());
    }
}
