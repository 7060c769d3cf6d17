//! The reference evaluator of the ClusterNetworkPolicy tiers: decides one
//! tier for one end of a flow straight from the API's documentation
//! (`apis/v1alpha2/clusternetworkpolicy_types.go`, quoted beside each
//! branch), on the model, with no compiled state. [`crate::evaluate`]
//! places the tiers around NetworkPolicy.

use std::net::IpAddr;

use crate::compiled::{Direction, Tier, TierAction};
use crate::identity::namespace_labels;
use crate::model::{Labels, Pod, Snapshot};

use super::model::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};

/// The rule of a tier that matched a flow first.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierMatch {
    /// The tier.
    pub tier: Tier,
    /// The rule's action.
    pub action: TierAction,
    /// The policy's name.
    pub policy: String,
    /// The policy's priority.
    pub priority: u32,
    /// The rule's index in the direction's list.
    pub index: usize,
    /// The rule's `name`, if any.
    pub rule_name: Option<String>,
}

impl std::fmt::Display for TierMatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} tier: {:?} by clusternetworkpolicy {} (priority {}) rule {}",
            self.tier.name(),
            self.action,
            self.policy,
            self.priority,
            self.index
        )?;
        if let Some(n) = &self.rule_name {
            write!(f, " {n:?}")?;
        }
        Ok(())
    }
}

/// Does the subject select `pod`? "Subject defines the pods to which this
/// ClusterNetworkPolicy applies." "Note that host-networked pods are not
/// included in subject selection."
pub fn selects(snapshot: &Snapshot, policy: &ClusterPolicy, pod: &Pod) -> bool {
    if pod.host_network {
        return false;
    }
    let empty = Labels::new();
    let ns = namespace_labels(snapshot, &pod.namespace).unwrap_or(&empty);
    match &policy.subject {
        // "Namespaces is used to select pods via namespace selectors."
        Subject::Namespaces(sel) => sel.matches(ns),
        // "Pods is used to select pods via namespace AND pod selectors."
        Subject::Pods { namespaces, pods } => namespaces.matches(ns) && pods.matches(&pod.labels),
    }
}

/// True when some CNP (of either tier) selects `pod` and has rules in
/// `direction` ("CNPs with no ingress rules do not affect ingress
/// traffic", the same for egress).
pub fn applies(snapshot: &Snapshot, pod: &Pod, direction: Direction) -> bool {
    snapshot
        .cluster_policies
        .values()
        .any(|p| !p.rules(direction).is_empty() && selects(snapshot, p, pod))
}

/// The other end of a flow: its address, the pod owning it (if any) and,
/// when no pod owns it, the labels of the node it belongs to (if any; see
/// [`crate::nodes::node_labels_at`]).
#[derive(Clone, Copy, Debug)]
pub struct End<'a> {
    /// The address.
    pub ip: IpAddr,
    /// The pod owning it (by [`crate::evaluate::pod_at`]), `None` for no
    /// pod.
    pub pod: Option<&'a Pod>,
    /// The labels of the node it belongs to, for `nodes` peers; only read
    /// when `pod` is `None` (a pod address is never a node).
    pub node: Option<&'a Labels>,
}

impl<'a> End<'a> {
    /// The end at `ip`, owned by `pod`, of no known node.
    pub fn new(ip: IpAddr, pod: Option<&'a Pod>) -> Self {
        End { ip, pod, node: None }
    }
}

/// Does `peer` match the other end?
pub(crate) fn peer_matches(snapshot: &Snapshot, peer: &ClusterPeer, end: End<'_>) -> bool {
    let (peer_ip, peer_pod) = (end.ip, end.pod);
    let empty = Labels::new();
    let ns = |p: &Pod| namespace_labels(snapshot, &p.namespace).unwrap_or(&empty).clone();
    match peer {
        // "Namespaces defines a way to select all pods within a set of
        // Namespaces. Note that host-networked pods are not included in
        // this type of peer." (`peer_pod` is never a host-network pod.)
        ClusterPeer::Namespaces(sel) => peer_pod.is_some_and(|p| sel.matches(&ns(p))),
        // "Pods defines a way to select a set of pods in a set of
        // namespaces."
        ClusterPeer::Pods { namespaces, pods } => {
            peer_pod.is_some_and(|p| namespaces.matches(&ns(p)) && pods.matches(&p.labels))
        }
        // "Networks defines a way to select peers via CIDR blocks [...]
        // note that cluster-internal traffic will be checked against the
        // rule as well." "Networks matches both regular IP traffic and ICMP
        // traffic to/from the specified CIDRs."
        ClusterPeer::Networks(nets) => nets.iter().any(|n| n.contains(&peer_ip)),
        // "DomainNames provides a way to specify domain names as peers."
        // "`kubernetes.io` matches only `kubernetes.io`"; "'*' [...]
        // matches one or more entire labels": the addresses of the learned
        // answers of the names matched (see `tiers::domains`), pod
        // addresses included.
        ClusterPeer::DomainNames(names) => {
            crate::tiers::domains::domain_matches(names, &snapshot.domain_names, peer_ip)
        }
        // "Nodes defines a way to select a set of nodes in the cluster
        // (based on the node's labels). This field follows standard label
        // selector semantics; if present but empty, it selects all Nodes."
        // A pod address is never a node (a pod owning it wins).
        ClusterPeer::Nodes(sel) => peer_pod.is_none() && end.node.is_some_and(|l| sel.matches(l)),
        // A peer that could not be understood, in a Deny rule: "For "Deny"
        // and "Pass" rules, "fail closed" means: "treat the rule as a 'Deny
        // all' rule"".
        ClusterPeer::All => true,
    }
}

/// Does `rule` match the flow? "If any element matches the source of
/// incoming traffic [the destination of outgoing traffic] then the
/// specified action is applied"; the protocols narrow it.
pub(crate) fn rule_matches(
    snapshot: &Snapshot,
    rule: &ClusterRule,
    dir: Direction,
    pod: &Pod,
    end: End<'_>,
    protocol: u8,
    port: u16,
) -> bool {
    let peer_pod = end.pod;
    // An empty peer list matches nothing ("This field must be defined and
    // contain at least one item"; validation empties it for an Accept rule
    // it cannot understand: "treat the rule as matching no traffic").
    if !rule.peers.iter().any(|p| peer_matches(snapshot, p, end)) {
        return false;
    }
    // "Protocols allows for more fine-grain matching of traffic on
    // protocol-specific attributes such as the port. If unspecified,
    // protocol-specific attributes will not be used to match traffic."
    if rule.ports.is_empty() {
        return true;
    }
    rule.ports.iter().any(|p| match p {
        // "TCP/UDP/SCTP specific protocol matches" with "DestinationPort":
        // "Number defines a network port value." / "PortRange defines an
        // inclusive range of ports from the assigned Start value to End
        // value."
        ClusterPort::Ports {
            protocol: proto,
            start,
            end,
        } => proto.number() == protocol && *start <= port && port <= *end,
        // "DestinationNamedPort selects a destination port on a pod based
        // on the ContainerPort name. You can't use this in a rule that
        // targets resources without named ports (e.g. Nodes or Networks)."
        ClusterPort::Named(name) => {
            let resolves = |d: &Pod| {
                d.ports.iter().any(|c| {
                    c.name.as_deref() == Some(name.as_str()) && c.protocol.number() == protocol && c.port == port
                })
            };
            match dir {
                // Ingress: the destination is the subject pod.
                Direction::Ingress => resolves(pod),
                // Egress: the destination is the peer pod, matched by a
                // peer that has named ports (not `networks`).
                Direction::Egress => {
                    peer_pod.is_some_and(resolves)
                        && rule.peers.iter().any(|pe| {
                            !matches!(
                                pe,
                                ClusterPeer::Networks(_) | ClusterPeer::Nodes(_) | ClusterPeer::DomainNames(_)
                            ) && peer_matches(snapshot, pe, end)
                        })
                }
            }
        }
    })
}

/// The first matching rule of `tier` for `pod` in `dir` with the other end
/// `end`, or `None` when no rule of the tier matches. `end.node` (from
/// [`crate::nodes::node_labels_at`]) is what `nodes` peers match, only
/// when no pod owns the address.
pub fn tier_match(
    snapshot: &Snapshot,
    tier: Tier,
    pod: &Pod,
    dir: Direction,
    end: End<'_>,
    protocol: u8,
    port: u16,
) -> Option<TierMatch> {
    let end = End {
        node: if end.pod.is_some() { None } else { end.node },
        ..end
    };
    // "Priority is a value from 0 to 1000 indicating the precedence of the
    // policy within its tier. Policies with lower priority values have
    // higher precedence, and are checked before policies with higher
    // priority values in the same tier." "If two (or more) policies in the
    // same tier with the same priority could match a connection, then the
    // implementation can apply any of the matching policies": npm checks
    // them in name order (deterministic).
    let mut policies: Vec<&ClusterPolicy> = snapshot
        .cluster_policies
        .values()
        .filter(|p| p.tier == tier && selects(snapshot, p, pod))
        .collect();
    policies.sort_by(|a, b| a.priority.cmp(&b.priority).then_with(|| a.name.cmp(&b.name)));
    for p in policies {
        // "The relative precedence of ingress [egress] rules within a
        // single CNP object (all of which share the priority) will be
        // determined by the order in which the rule is written."
        for (index, rule) in p.rules(dir).iter().enumerate() {
            if rule_matches(snapshot, rule, dir, pod, end, protocol, port) {
                // Accept: "No further ingress [egress] ClusterNetworkPolicy
                // or NetworkPolicy rules will be processed"; Deny: "Drops
                // the selected traffic. No further ClusterNetworkPolicy or
                // NetworkPolicy rules will be processed."; Pass: "Skips all
                // further ClusterNetworkPolicy rules in the current tier for
                // the selected traffic, and passes evaluation to the next
                // tier." All three end the tier: the caller acts on it.
                return Some(TierMatch {
                    tier,
                    action: rule.action,
                    policy: p.name.clone(),
                    priority: p.priority,
                    index,
                    rule_name: rule.name.clone(),
                });
            }
        }
    }
    None
}
