//! The snapshot the compiler works on: pods, namespaces and validated
//! policies, built from k8s-openapi types (see [`crate::convert`]).
//!
//! A [`Snapshot`] is the complete, current state of the cluster as the agent
//! knows it. The compiler never sees events, only snapshots (level-triggered).

use std::collections::BTreeMap;
use std::fmt;
use std::net::IpAddr;
use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// Labels of a pod or a namespace.
pub type Labels = BTreeMap<String, String>;

/// A pod's labels behind a shared pointer: pods with equal labels (the
/// replicas of a workload) can share one map, and a copy of a pod shares
/// it with the original (the agent interns them: one allocation per
/// distinct label set, not per pod). Reads see a [`Labels`] (`Deref`);
/// a write copies the map first when it is shared (`DerefMut`). Equal
/// when the maps are equal; serialized as the map.
#[derive(Clone, Default, Eq, PartialOrd, Ord)]
pub struct PodLabels(Arc<Labels>);

impl PodLabels {
    /// Labels sharing the map of `shared`.
    pub fn from_shared(shared: Arc<Labels>) -> Self {
        PodLabels(shared)
    }

    /// The shared map (two pods share their labels when these are
    /// `Arc::ptr_eq`).
    pub fn shared(&self) -> &Arc<Labels> {
        &self.0
    }
}

impl PartialEq for PodLabels {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.0 == other.0
    }
}

impl std::hash::Hash for PodLabels {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.0.hash(state)
    }
}

impl Deref for PodLabels {
    type Target = Labels;
    fn deref(&self) -> &Labels {
        &self.0
    }
}

impl DerefMut for PodLabels {
    fn deref_mut(&mut self) -> &mut Labels {
        Arc::make_mut(&mut self.0)
    }
}

impl fmt::Debug for PodLabels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl From<Labels> for PodLabels {
    fn from(l: Labels) -> Self {
        PodLabels(Arc::new(l))
    }
}

impl<const N: usize> From<[(String, String); N]> for PodLabels {
    fn from(l: [(String, String); N]) -> Self {
        PodLabels(Arc::new(l.into()))
    }
}

impl FromIterator<(String, String)> for PodLabels {
    fn from_iter<I: IntoIterator<Item = (String, String)>>(iter: I) -> Self {
        PodLabels(Arc::new(iter.into_iter().collect()))
    }
}

impl Serialize for PodLabels {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for PodLabels {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        Labels::deserialize(d).map(PodLabels::from)
    }
}

/// L4 protocol of a NetworkPolicy port or a container port.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Protocol {
    /// TCP (the default).
    #[serde(rename = "TCP")]
    Tcp,
    /// UDP.
    #[serde(rename = "UDP")]
    Udp,
    /// SCTP.
    #[serde(rename = "SCTP")]
    Sctp,
}

impl Protocol {
    /// IP protocol number.
    pub const fn number(self) -> u8 {
        match self {
            Protocol::Tcp => npm_common::proto::TCP,
            Protocol::Udp => npm_common::proto::UDP,
            Protocol::Sctp => npm_common::proto::SCTP,
        }
    }
    /// The protocol with this IP protocol number.
    pub const fn from_number(n: u8) -> Option<Protocol> {
        match n {
            npm_common::proto::TCP => Some(Protocol::Tcp),
            npm_common::proto::UDP => Some(Protocol::Udp),
            npm_common::proto::SCTP => Some(Protocol::Sctp),
            _ => None,
        }
    }
}

/// A namespace.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Namespace {
    /// Name.
    pub name: String,
    /// Labels, including `kubernetes.io/metadata.name`.
    pub labels: Labels,
}

/// A named container port of a pod.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ContainerPort {
    /// Port name (`None` when unnamed).
    pub name: Option<String>,
    /// Container port number.
    pub port: u16,
    /// Protocol (defaults to TCP).
    pub protocol: Protocol,
}

/// Pod phase as far as enforcement cares.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PodPhase {
    /// Pending.
    Pending,
    /// Running.
    Running,
    /// Succeeded: terminal, holds no IP any more.
    Succeeded,
    /// Failed: terminal, holds no IP any more.
    Failed,
    /// Unknown.
    Unknown,
}

/// A pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pod {
    /// metadata.uid.
    pub uid: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Labels (shared: see [`PodLabels`]).
    pub labels: PodLabels,
    /// status.podIPs (at most one per family is used).
    pub ips: Vec<IpAddr>,
    /// spec.nodeName.
    pub node_name: Option<String>,
    /// status.phase.
    pub phase: PodPhase,
    /// metadata.deletionTimestamp is set.
    pub deleting: bool,
    /// spec.hostNetwork.
    pub host_network: bool,
    /// Container ports of all containers.
    pub ports: Vec<ContainerPort>,
    /// metadata.creationTimestamp as seconds since the epoch (0 when unknown);
    /// breaks IP ownership ties between two live pods.
    pub created: i64,
}

/// A label selector requirement operator.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Operator {
    /// Key present with one of the values.
    In,
    /// Key absent, or its value is not one of the values.
    NotIn,
    /// Key present (any value, the empty one too).
    Exists,
    /// Key absent.
    DoesNotExist,
}

/// One matchExpressions requirement.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Requirement {
    /// Label key.
    pub key: String,
    /// Operator.
    pub operator: Operator,
    /// Values (empty for Exists and DoesNotExist).
    pub values: Vec<String>,
}

/// A validated label selector: matchLabels AND matchExpressions. The empty
/// selector matches everything.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Selector {
    /// matchLabels.
    pub match_labels: Labels,
    /// matchExpressions.
    pub match_expressions: Vec<Requirement>,
}

impl Selector {
    /// The key of the requirement of [`Selector::nothing`].
    pub const NOTHING_KEY: &'static str = "npm.io/unparseable-selector";

    /// A selector that matches no labels: one `In` requirement without
    /// values (a form the API rejects, so no selector an API server
    /// accepted looks like it). It stands for a policy's `podSelector`
    /// that cannot be evaluated (see [`crate::validate`]).
    pub fn nothing() -> Selector {
        Selector {
            match_labels: Labels::new(),
            match_expressions: vec![Requirement {
                key: Selector::NOTHING_KEY.to_string(),
                operator: Operator::In,
                values: Vec::new(),
            }],
        }
    }
}

/// A validated ipBlock.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct IpBlock {
    /// cidr (normalised: host bits cleared).
    pub cidr: IpNet,
    /// except entries, each a strict subset of `cidr`.
    pub except: Vec<IpNet>,
}

/// A validated NetworkPolicyPeer: exactly one form.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Peer {
    /// podSelector only: pods of the policy's namespace.
    Pods(Selector),
    /// namespaceSelector only: all pods of the matching namespaces.
    Namespaces(Selector),
    /// Both in one peer: matching pods in matching namespaces.
    PodsInNamespaces {
        /// namespaceSelector.
        namespaces: Selector,
        /// podSelector.
        pods: Selector,
    },
    /// ipBlock.
    IpBlock(IpBlock),
}

/// The port part of a validated NetworkPolicyPort.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum PortSpec {
    /// No port: every port of the protocol.
    All,
    /// `port..=end_port` (`end_port == port` without endPort).
    Range(u16, u16),
    /// A named port, resolved against the destination pod.
    Named(String),
}

/// A validated NetworkPolicyPort.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Port {
    /// Protocol (defaulted to TCP).
    pub protocol: Protocol,
    /// Port or range or name.
    pub port: PortSpec,
}

/// A validated ingress or egress rule.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rule {
    /// Ports; empty matches every port and protocol.
    pub ports: Vec<Port>,
    /// Peers (`from` or `to`); empty matches every peer.
    pub peers: Vec<Peer>,
}

/// A validated NetworkPolicy with defaulting applied.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// spec.podSelector (pods of `namespace`).
    pub pod_selector: Selector,
    /// Effective policyTypes contains Ingress.
    pub ingress_isolation: bool,
    /// Effective policyTypes contains Egress.
    pub egress_isolation: bool,
    /// Ingress rules.
    pub ingress: Vec<Rule>,
    /// Egress rules.
    pub egress: Vec<Rule>,
}

/// The report of a policy that is not fully understood. The policy itself
/// is in [`Snapshot::policies`] without the parts that cannot be understood
/// (it keeps isolating the pods it selects; see [`crate::validate`]).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct InvalidPolicy {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Every error, each naming the field, the value and what was dropped.
    pub errors: Vec<String>,
}

/// A Node of the cluster: its labels and addresses. Another node's
/// addresses get a node identity (see [`crate::nodes`]); this node's own
/// addresses are `CompileOptions::node_ips` (`IDENTITY_HOST`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    /// metadata.name.
    pub name: String,
    /// metadata.labels.
    pub labels: Labels,
    /// status.addresses of type InternalIP and ExternalIP, in API order,
    /// without duplicates.
    pub addresses: Vec<IpAddr>,
}

/// The complete cluster state the compiler works on.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Namespaces by name.
    pub namespaces: BTreeMap<String, Namespace>,
    /// Pods by (namespace, name).
    pub pods: BTreeMap<(String, String), Pod>,
    /// Policies by (namespace, name), each as far as it is understood; an
    /// audited policy (`npm.io/audit: "true"`) only in its enforced form,
    /// which selects no pod ([`crate::audit`]).
    pub policies: BTreeMap<(String, String), Policy>,
    /// The reports of the policies that are not fully understood (each is
    /// also in `policies`, without the parts it could not understand).
    pub invalid_policies: Vec<InvalidPolicy>,
    /// ClusterNetworkPolicies by name, each as the conversion makes it
    /// (failing closed where it is not understood; see
    /// [`crate::tiers::validate`]).
    #[serde(default)]
    pub cluster_policies: BTreeMap<String, crate::tiers::ClusterPolicy>,
    /// The reports of the ClusterNetworkPolicies that are not fully
    /// understood (`namespace` empty; each is also in `cluster_policies`).
    #[serde(default)]
    pub invalid_cluster_policies: Vec<InvalidPolicy>,
    /// Nodes by name (this node included: its labels are matched by a
    /// ClusterNetworkPolicy `nodes` peer; its addresses are not used).
    #[serde(default)]
    pub nodes: BTreeMap<String, Node>,
    /// Names learned from DNS answers (see [`crate::tiers::domains`]): what
    /// a ClusterNetworkPolicy `domainNames` peer matches. Not API state:
    /// the agent's DNS learning keeps it (each answer for its TTL).
    #[serde(default)]
    pub domain_names: crate::tiers::domains::LearnedNames,
}
