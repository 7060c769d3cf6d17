//! The validated model of a ClusterNetworkPolicy: what the compiler, the
//! reference evaluator and the simulator work on. Built from the API object
//! by [`crate::tiers::validate`], which fails closed on what it cannot
//! understand (so every value here means exactly what it says).

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::compiled::{Direction, Tier, TierAction};
use crate::model::{Protocol, Selector};

/// The pods a ClusterNetworkPolicy applies to (`spec.subject`). Host-network
/// pods are never selected (they are never endpoints).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Subject {
    /// `namespaces`: every pod of the namespaces whose labels match.
    Namespaces(Selector),
    /// `pods`: pods matching `pods` in namespaces matching `namespaces`.
    Pods {
        /// `namespaceSelector`.
        namespaces: Selector,
        /// `podSelector`.
        pods: Selector,
    },
}

/// One peer of a rule (`from[i]` / `to[i]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ClusterPeer {
    /// `namespaces`: every pod of the matching namespaces.
    Namespaces(Selector),
    /// `pods`: matching pods of matching namespaces.
    Pods {
        /// `namespaceSelector`.
        namespaces: Selector,
        /// `podSelector`.
        pods: Selector,
    },
    /// `networks` (egress): any address inside one of the CIDRs, pod
    /// addresses included (host bits cleared, IPv4-mapped IPv6 read as IPv4).
    Networks(Vec<IpNet>),
    /// `nodes` (egress, experimental): the nodes whose labels match (other
    /// nodes' addresses by their node identity, this node's addresses as
    /// `IDENTITY_HOST`; see [`crate::nodes`]). Never a pod.
    Nodes(Selector),
    /// `domainNames` (egress, experimental, Accept rules only): the
    /// addresses of the learned names a pattern matches (see
    /// [`crate::tiers::domains`]), pod addresses included, like `networks`.
    DomainNames(Vec<crate::tiers::domains::DomainPattern>),
    /// Every peer: what a peer that cannot be understood (no field set, or
    /// an unsupported or invalid one) becomes in a `Deny` rule (fail closed;
    /// see [`crate::tiers::validate`]). The API has no such peer.
    All,
}

/// One protocol match of a rule (`protocols[i]`).
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum ClusterPort {
    /// `tcp`/`udp`/`sctp` with `destinationPort.number` (`start == end`) or
    /// `.range` (inclusive, `start < end`).
    Ports {
        /// The protocol.
        protocol: Protocol,
        /// First destination port.
        start: u16,
        /// Last destination port.
        end: u16,
    },
    /// `destinationNamedPort`: a container port name of the destination pod
    /// (ingress: the subject pod; egress: the peer pod), with the protocol
    /// of that container port. Never matches a non-pod destination.
    Named(String),
}

/// One rule of a ClusterNetworkPolicy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterRule {
    /// `name`, if given.
    pub name: Option<String>,
    /// What the rule does when it is the first match.
    pub action: TierAction,
    /// The peers (OR). Empty: the rule matches nothing (the API requires at
    /// least one peer; validation empties the peers of an `Accept` rule it
    /// cannot understand, keeping the rule's place so rule indexes stay the
    /// API's).
    pub peers: Vec<ClusterPeer>,
    /// Protocol matches (OR). Empty: all traffic, every protocol (ICMP too).
    pub ports: Vec<ClusterPort>,
}

/// A validated ClusterNetworkPolicy.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterPolicy {
    /// `metadata.name` (cluster-scoped).
    pub name: String,
    /// `spec.tier`.
    pub tier: Tier,
    /// `spec.priority`, 0..=1000: lower is checked first within the tier.
    pub priority: u32,
    /// `spec.subject`.
    pub subject: Subject,
    /// `spec.ingress`, in precedence order (index = the API's index).
    pub ingress: Vec<ClusterRule>,
    /// `spec.egress`, in precedence order (index = the API's index).
    pub egress: Vec<ClusterRule>,
}

impl ClusterPolicy {
    /// The rules of `direction`.
    pub fn rules(&self, direction: Direction) -> &[ClusterRule] {
        match direction {
            Direction::Ingress => &self.ingress,
            Direction::Egress => &self.egress,
        }
    }
}
