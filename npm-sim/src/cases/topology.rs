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
//!   (`dns`) and 5353, SCTP 9003 and 9005; and the host-network namespace
//!   `network-policy-conformance-forbidden-forrest` of the node-peer tests:
//!   StatefulSet `centaur` (pods `centaur-0/1`, label `conformance-house:
//!   forbidden-forrest`, `hostNetwork: true`) serving upstream's host
//!   network ports [`HOST_NETWORK_PORTS`] (34345..34352: TCP on the first
//!   two, UDP on the third and fifth, SCTP on the seventh and eighth).
//!
//! Host-network pods have no address of their own: a pod's address is its
//! node's ([`Topology::nodes`]). Two of them never share a node upstream
//! (the same host ports: the scheduler spreads them), so host-network pod
//! `i` is on model node `i` (`centaur-0` on [`crate::cases::MODEL_NODE`],
//! the node every other pod is on, `centaur-1` on `npm-node-2`); the live
//! runner places them the same way relative to the first namespace's node
//! (on one node both share it and its servers).

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

/// The host-network StatefulSet of the network-policy-api topology:
/// (house, StatefulSet name).
pub const HOST_NETWORK_HOUSE: (&str, &str) = ("forbidden-forrest", "centaur");

/// Upstream's host network ports (`HostNetworkPorts`, the suite's default
/// range 34345..34352): `[0]`, `[1]` TCP, `[2]`, `[4]` UDP (`[3]`, `[5]`:
/// the HTTP ports of upstream's UDP servers), `[6]`, `[7]` SCTP.
pub const HOST_NETWORK_PORTS: [u16; 8] = [34345, 34346, 34347, 34348, 34349, 34350, 34351, 34352];

/// One node of a topology's model: name, labels, addresses (IPv4, IPv6).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologyNode {
    /// Node name.
    pub name: String,
    /// Labels (`kubernetes.io/os: linux`, `kubernetes.io/hostname`).
    pub labels: Labels,
    /// Its InternalIPs: IPv4 `198.19.254.<k>`, IPv6 `fd00:198:19::<k>`.
    pub addresses: [std::net::IpAddr; 2],
}

/// The model address pair of node `k` (1-based): `198.19.254.<k>` and
/// `fd00:198:19::<k>` (the live one-node runner gives its node the
/// addresses of `k = 1`).
pub fn node_addresses(k: u8) -> [std::net::IpAddr; 2] {
    [
        std::net::IpAddr::V4(std::net::Ipv4Addr::new(198, 19, 254, k)),
        std::net::IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0x198, 0x19, 0, 0, 0, 0, k as u16)),
    ]
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
    /// The pods are host-network pods (`spec.hostNetwork`): pod `i` has
    /// the addresses of [`Topology::nodes`]`[i]` and is on that node.
    pub host_network: bool,
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
                    host_network: false,
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
                    host_network: false,
                })
                .chain(std::iter::once({
                    let (house, set) = HOST_NETWORK_HOUSE;
                    TopologyNamespace {
                        name: house_namespace(house),
                        labels: one("conformance-house", house),
                        pods: (0..2)
                            .map(|i| (format!("{set}-{i}"), one("conformance-house", house)))
                            .collect(),
                        host_network: true,
                    }
                }))
                .collect(),
        }
    }

    /// The Node objects of the model (none for [`Topology::Xyz`], as
    /// before; two for [`Topology::NetworkPolicyApi`], the hosts of its
    /// host-network pods): node 1 is [`crate::cases::MODEL_NODE`], the node
    /// of every other pod and the node whose view the simulator compiles,
    /// node `k` > 1 is `npm-node-<k>`. Labels `kubernetes.io/os: linux`
    /// (what upstream's `nodes` peers select) and `kubernetes.io/hostname`.
    pub fn nodes(&self) -> Vec<TopologyNode> {
        let count = self
            .namespaces()
            .iter()
            .filter(|n| n.host_network)
            .map(|n| n.pods.len())
            .max()
            .unwrap_or(0);
        (1..=count as u8)
            .map(|k| {
                let name = if k == 1 {
                    crate::cases::MODEL_NODE.to_string()
                } else {
                    format!("{}-{k}", crate::cases::MODEL_NODE)
                };
                let labels: Labels = [
                    ("kubernetes.io/os".to_string(), "linux".to_string()),
                    ("kubernetes.io/hostname".to_string(), name.clone()),
                ]
                .into();
                TopologyNode {
                    name,
                    labels,
                    addresses: node_addresses(k),
                }
            })
            .collect()
    }

    /// The container ports of the host-network pods: upstream's named ports
    /// `web-<port>` (TCP, `[0]`, `[1]`) and `dns-<port>` (UDP, `[2]`,
    /// `[4]`); its SCTP containers declare none.
    pub fn host_network_container_ports(&self) -> Vec<ContainerPort> {
        let p = HOST_NETWORK_PORTS;
        [
            (p[0], Protocol::Tcp, "web"),
            (p[1], Protocol::Tcp, "web"),
            (p[2], Protocol::Udp, "dns"),
            (p[4], Protocol::Udp, "dns"),
        ]
        .into_iter()
        .map(|(port, protocol, n)| ContainerPort {
            name: Some(format!("{n}-{port}")),
            port,
            protocol,
        })
        .collect()
    }

    /// The TCP/UDP ports the host-network servers listen on (each for TCP
    /// and UDP, SCTP answered on every port): all of
    /// [`HOST_NETWORK_PORTS`], a superset of upstream's servers.
    pub fn host_network_served_ports(&self) -> Vec<u16> {
        match self {
            Topology::Xyz => vec![],
            Topology::NetworkPolicyApi => HOST_NETWORK_PORTS.to_vec(),
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
    /// of a probe (host-network pods are left out: a probe names them).
    pub fn default_pods(&self) -> Vec<String> {
        self.namespaces()
            .iter()
            .filter(|ns| !ns.host_network)
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

    #[test]
    fn host_network_pods_have_one_node_each() {
        let t = Topology::NetworkPolicyApi;
        let host: Vec<_> = t.namespaces().into_iter().filter(|n| n.host_network).collect();
        assert_eq!(host.len(), 1);
        assert_eq!(host[0].name, "network-policy-conformance-forbidden-forrest");
        assert_eq!(host[0].pods[1].0, "centaur-1");
        let nodes = t.nodes();
        assert_eq!(nodes.len(), 2);
        assert_eq!(nodes[0].name, crate::cases::MODEL_NODE);
        assert_eq!(nodes[1].labels["kubernetes.io/os"], "linux");
        assert_ne!(nodes[0].addresses, nodes[1].addresses);
        assert!(Topology::Xyz.nodes().is_empty());
        assert_eq!(t.host_network_container_ports()[2].name.as_deref(), Some("dns-34347"));
    }
}
