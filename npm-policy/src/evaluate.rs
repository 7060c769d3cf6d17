//! The reference evaluator: decides a flow straight from the specification
//! on the [`Snapshot`], with no compiled state. The compiler is tested
//! against it. Per end: ingress from the node, the Admin tier, NetworkPolicy,
//! the Baseline tier, allow (the tiers: [`crate::tiers::evaluate`]).

use std::fmt;
use std::net::IpAddr;

use crate::compiled::{CompileOptions, Direction, Tier, TierAction};
use crate::identity::namespace_labels;
use crate::model::{Peer, Pod, Policy, PortSpec, Rule, Snapshot};
use crate::ownership::ip_owners;
use crate::tiers::evaluate::{applies, tier_match, End, TierMatch};

/// One new connection: `src` opens it to `dst`:`dst_port`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// Source address.
    pub src: IpAddr,
    /// Destination address.
    pub dst: IpAddr,
    /// IP protocol number.
    pub protocol: u8,
    /// Destination port (0 for protocols without ports).
    pub dst_port: u16,
}

/// Why one end allowed or denied.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum EndReason {
    /// The end is not a pod (or a hostNetwork pod): it imposes nothing.
    NotAPod,
    /// No policy isolates the pod in this direction.
    NotIsolated,
    /// Ingress from an address of the pod's node: always allowed.
    FromNode,
    /// Egress to the node, allowed by `allow_host_egress`.
    HostEgress,
    /// Allowed by rule `index` of policy `policy` (`namespace/name`).
    Rule {
        /// `namespace/name`.
        policy: String,
        /// Rule index in the direction's list.
        index: usize,
    },
    /// Isolated and no rule allows.
    Denied,
    /// Accepted or denied by a ClusterNetworkPolicy rule.
    Tier(TierMatch),
}

/// The verdict of one end of a flow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EndVerdict {
    /// The direction, from this end.
    pub direction: Direction,
    /// The pod (`namespace/name`) at this end, if any.
    pub pod: Option<String>,
    /// The policies (`namespace/name`) selecting the pod for this direction.
    pub selected_by: Vec<String>,
    /// The outcome.
    pub allowed: bool,
    /// Why.
    pub reason: EndReason,
    /// The first matching ClusterNetworkPolicy rule of each tier that was
    /// consulted (a `Pass` that moved on, or the final Accept/Deny).
    pub tiers: Vec<TierMatch>,
}

/// The verdict of a flow: both ends must allow it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Verdict {
    /// Both ends allow it.
    pub allowed: bool,
    /// The source's egress.
    pub egress: EndVerdict,
    /// The destination's ingress.
    pub ingress: EndVerdict,
}

impl EndVerdict {
    /// The verdict of an end that is not a pod (or a hostNetwork pod): it
    /// imposes nothing.
    fn not_a_pod(direction: Direction) -> Self {
        EndVerdict {
            direction,
            pod: None,
            selected_by: vec![],
            allowed: true,
            reason: EndReason::NotAPod,
            tiers: vec![],
        }
    }
}

impl fmt::Display for EndVerdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let who = self.pod.as_deref().unwrap_or("(not a pod)");
        write!(
            f,
            "{} of {who}: {}",
            self.direction.name(),
            if self.allowed { "allowed" } else { "DENIED" }
        )?;
        if !self.selected_by.is_empty() {
            write!(f, " [selected by {}]", self.selected_by.join(", "))?;
        }
        for t in self.tiers.iter().filter(|t| t.action == TierAction::Pass) {
            write!(f, " [{t}]")?;
        }
        match &self.reason {
            EndReason::NotAPod => write!(f, ": not a pod, imposes nothing"),
            EndReason::NotIsolated => write!(f, ": not isolated"),
            EndReason::FromNode => write!(f, ": from the pod's node, always allowed"),
            EndReason::HostEgress => write!(f, ": to the node, allowed by allow_host_egress"),
            EndReason::Rule { policy, index } => write!(f, ": by {policy} {}[{index}]", self.direction.name()),
            EndReason::Denied => write!(f, ": isolated and no rule allows"),
            EndReason::Tier(t) => write!(f, ": {t}"),
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", if self.allowed { "ALLOWED" } else { "DENIED" })?;
        writeln!(f, "  {}", self.egress)?;
        write!(f, "  {}", self.ingress)
    }
}

/// The pod owning an address (ownership rules of
/// [`crate::ownership::ip_owners`]; node addresses are never pods).
pub fn pod_at<'a>(snapshot: &'a Snapshot, opts: &CompileOptions, ip: IpAddr) -> Option<&'a Pod> {
    ip_owners(snapshot, &opts.node_ips).get(&ip).copied()
}

/// Decides a flow.
pub fn evaluate(snapshot: &Snapshot, opts: &CompileOptions, flow: &Flow) -> Verdict {
    let owners = ip_owners(snapshot, &opts.node_ips);
    let end = |ip: IpAddr, dir: Direction, peer: IpAddr| match owners.get(&ip) {
        Some(pod) => direction_verdict(
            snapshot,
            opts,
            pod,
            dir,
            End::new(peer, owners.get(&peer).copied()),
            flow.protocol,
            flow.dst_port,
        ),
        None => EndVerdict::not_a_pod(dir),
    };
    let egress = end(flow.src, Direction::Egress, flow.dst);
    let ingress = end(flow.dst, Direction::Ingress, flow.src);
    Verdict {
        allowed: egress.allowed && ingress.allowed,
        egress,
        ingress,
    }
}

/// Decides one end: `pod` in `direction` with `peer_ip` (the destination
/// for egress, the source for ingress).
pub fn evaluate_direction(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    pod: &Pod,
    direction: Direction,
    peer_ip: IpAddr,
    protocol: u8,
    port: u16,
) -> EndVerdict {
    let peer = End::new(peer_ip, pod_at(snapshot, opts, peer_ip));
    direction_verdict(snapshot, opts, pod, direction, peer, protocol, port)
}

/// [`evaluate_direction`] with the peer's pod already known (`peer.pod`:
/// the owner of `peer.ip` by [`pod_at`], `None` for no pod): saves the pass
/// over every pod that finding it takes, for callers deciding many flows
/// of one snapshot (audit mode, `crate::audit`). `peer.node` is looked up
/// when it is `None`.
pub fn evaluate_direction_with_peer(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    pod: &Pod,
    direction: Direction,
    peer: End<'_>,
    protocol: u8,
    port: u16,
) -> EndVerdict {
    direction_verdict(snapshot, opts, pod, direction, peer, protocol, port)
}

/// Decides one end: `pod` in `dir` with the other end `peer` (its node
/// looked up here when no pod owns its address and it names none).
fn direction_verdict(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    pod: &Pod,
    dir: Direction,
    peer: End<'_>,
    protocol: u8,
    port: u16,
) -> EndVerdict {
    let (peer_ip, peer_pod) = (peer.ip, peer.pod);
    let name = format!("{}/{}", pod.namespace, pod.name);
    // Spec §4: hostNetwork pods are ignored (our choice): no restriction.
    if pod.host_network {
        return EndVerdict::not_a_pod(dir);
    }
    // §1: "isolated for ingress when at least one policy selects it and has
    // `Ingress` in its effective `policyTypes`" (same for Egress).
    let selecting: Vec<&Policy> = snapshot
        .policies
        .values()
        .filter(|p| p.namespace == pod.namespace && p.pod_selector.matches(&pod.labels))
        .filter(|p| match dir {
            Direction::Ingress => p.ingress_isolation,
            Direction::Egress => p.egress_isolation,
        })
        .collect();
    let selected_by: Vec<String> = selecting
        .iter()
        .map(|p| format!("{}/{}", p.namespace, p.name))
        .collect();
    let mut tiers: Vec<TierMatch> = Vec::new();
    let v = |allowed, reason, tiers: &Vec<TierMatch>| EndVerdict {
        direction: dir,
        pod: Some(name.clone()),
        selected_by: selected_by.clone(),
        allowed,
        reason,
        tiers: tiers.clone(),
    };
    // "A pod that is not isolated in a direction has no restrictions" (and
    // no ClusterNetworkPolicy affects it: "CNPs with no ingress rules do
    // not affect ingress traffic", the same for egress).
    if selecting.is_empty() && !applies(snapshot, pod, dir) {
        return v(true, EndReason::NotIsolated, &tiers);
    }
    let peer_is_node = opts.node_ips.contains(&peer_ip);
    // The node the other end belongs to, when no pod owns it (for a
    // ClusterNetworkPolicy `nodes` peer; `crate::nodes`).
    let end = End {
        node: match peer_pod {
            Some(_) => None,
            None => peer
                .node
                .or_else(|| crate::nodes::node_labels_at(snapshot, opts, peer_ip)),
        },
        ..peer
    };
    // A tier's first matching rule: `Some(the verdict)` when it decides
    // (Accept, Deny); a Pass (recorded in `tiers`) or no match moves on.
    let decides = |tier: Tier, tiers: &mut Vec<TierMatch>| {
        let m = tier_match(snapshot, tier, pod, dir, end, protocol, port)?;
        tiers.push(m.clone());
        match m.action {
            TierAction::Accept => Some((true, EndReason::Tier(m))),
            TierAction::Deny => Some((false, EndReason::Tier(m))),
            // "Pass: Skips all further ClusterNetworkPolicy rules in the
            // current tier [...] and passes evaluation to the next tier"
            // (in the Baseline tier: on to the default).
            TierAction::Pass => None,
        }
    };
    // §7: "always allow ingress from the local node" (before every tier:
    // npm's documented choice, so that kubelet probes always work).
    if dir == Direction::Ingress && peer_is_node {
        return v(true, EndReason::FromNode, &tiers);
    }
    // "Policy tiers are evaluated in the following order: Admin tier,
    // NetworkPolicy tier, Baseline tier". "If Admin tier has made a final
    // decision (Accept or Deny) on a connection, then no further evaluation
    // is done."
    if let Some((allowed, reason)) = decides(Tier::Admin, &mut tiers) {
        return v(allowed, reason, &tiers);
    }
    // "v1.NetworkPolicy always makes a final decision for selected pods.
    // Further evaluation only happens for Pods not selected by a
    // v1.NetworkPolicy."
    if !selecting.is_empty() {
        // §7: egress to the node per setting.
        if dir == Direction::Egress && peer_is_node && opts.allow_host_egress {
            return v(true, EndReason::HostEgress, &tiers);
        }
        // "the **union** of the rules of every policy that applies".
        for p in &selecting {
            let rules = match dir {
                Direction::Ingress => &p.ingress,
                Direction::Egress => &p.egress,
            };
            for (i, r) in rules.iter().enumerate() {
                if rule_matches(snapshot, p, r, dir, pod, end, (protocol, port)) {
                    return v(
                        true,
                        EndReason::Rule {
                            policy: format!("{}/{}", p.namespace, p.name),
                            index: i,
                        },
                        &tiers,
                    );
                }
            }
        }
        return v(false, EndReason::Denied, &tiers);
    }
    // "Baseline tier is a cluster-wide policy that can be overridden by the
    // v1.NetworkPolicy. If Baseline tier has made a final decision (Accept
    // or Deny) on a connection, then no further evaluation is done."
    if let Some((allowed, reason)) = decides(Tier::Baseline, &mut tiers) {
        return v(allowed, reason, &tiers);
    }
    // "If a given connection wasn't allowed or denied by any of the tiers,
    // the default kubernetes policy is applied, which says that all pods
    // can communicate with each other."
    v(true, EndReason::NotIsolated, &tiers)
}

/// Does `peer` (one NetworkPolicyPeer of `policy`) select the peer?
pub(crate) fn peer_matches(
    snapshot: &Snapshot,
    policy: &Policy,
    peer: &Peer,
    peer_ip: IpAddr,
    peer_pod: Option<&Pod>,
) -> bool {
    let ns_labels = |p: &Pod| namespace_labels(snapshot, &p.namespace).cloned().unwrap_or_default();
    match peer {
        // "matching pods in the **policy's own namespace**"
        Peer::Pods(sel) => peer_pod.is_some_and(|p| p.namespace == policy.namespace && sel.matches(&p.labels)),
        // "**all** pods in namespaces whose *namespace labels* match"
        Peer::Namespaces(sel) => peer_pod.is_some_and(|p| sel.matches(&ns_labels(p))),
        // "pods matching podSelector **AND** in a namespace matching namespaceSelector"
        Peer::PodsInNamespaces { namespaces, pods } => {
            peer_pod.is_some_and(|p| namespaces.matches(&ns_labels(p)) && pods.matches(&p.labels))
        }
        // "IP inside `cidr` and not inside any `except` entry" (any address,
        // pod IPs too). Other nodes' addresses (node identities,
        // `crate::nodes`) are selected by ipBlock only: the spec says node
        // traffic is selected by ipBlock; the pod/namespace forms above
        // need a pod (`peer_pod`), which a node address never is.
        Peer::IpBlock(b) => b.cidr.contains(&peer_ip) && !b.except.iter().any(|e| e.contains(&peer_ip)),
    }
}

/// Does rule `rule` of `policy` (for `pod` in `dir`) match the other end
/// `end` on (`protocol`, `port`)?
fn rule_matches(
    snapshot: &Snapshot,
    policy: &Policy,
    rule: &Rule,
    dir: Direction,
    pod: &Pod,
    end: End<'_>,
    (protocol, port): (u8, u16),
) -> bool {
    let (peer_ip, peer_pod) = (end.ip, end.pod);
    // §3: "Traffic matches a rule only if it matches **both** lists." and
    // "An empty or missing `from`/`to` matches all peers".
    let peer_ok = |p: &Peer| peer_matches(snapshot, policy, p, peer_ip, peer_pod);
    let any_peer = rule.peers.is_empty() || rule.peers.iter().any(peer_ok);
    if !any_peer {
        return false;
    }
    // "An empty or missing `ports` matches all ports and protocols."
    if rule.ports.is_empty() {
        return true;
    }
    rule.ports.iter().any(|p| {
        if p.protocol.number() != protocol {
            return false;
        }
        match &p.port {
            PortSpec::All => true,
            PortSpec::Range(a, b) => *a <= port && port <= *b,
            // "A **named** `port` is resolved against the **destination
            // pod's** containerPorts [...] The name **and** the protocol must
            // match."
            PortSpec::Named(name) => {
                let resolves = |d: &Pod| {
                    d.ports
                        .iter()
                        .any(|c| c.name.as_deref() == Some(name.as_str()) && c.protocol == p.protocol && c.port == port)
                };
                match dir {
                    Direction::Ingress => resolves(pod),
                    // Egress: "for egress the peer pod". The destination
                    // must be a pod (`peer_pod` is only set for an address
                    // owned by a live, non-hostNetwork pod; never for a
                    // node address) that resolves the name, and either the
                    // `to` is empty ("matches all peers", §3) or a
                    // pod/namespace selector peer of this rule selects it.
                    // "Implementations cannot resolve a name for a non-pod
                    // (ipBlock) destination, so in practice it matches
                    // nothing there": world addresses never match, and a
                    // pod reached only through an ipBlock peer does not
                    // either (the name is not resolved through a CIDR).
                    Direction::Egress => {
                        peer_pod.is_some_and(resolves)
                            && (rule.peers.is_empty()
                                || rule
                                    .peers
                                    .iter()
                                    .any(|pe| !matches!(pe, Peer::IpBlock(_)) && peer_ok(pe)))
                    }
                }
            }
        }
    })
}
