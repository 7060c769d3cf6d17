//! The tier compiler: the ClusterNetworkPolicies of a snapshot ->
//! [`Compiled::tiers`](crate::compiled::Compiled::tiers) for the subjects
//! (the pod identities of local endpoints, as for NetworkPolicy entries:
//! what a CNP decides for a pod is a function of its identity key), shared
//! by the full ([`crate::compile()`]) and the incremental compiler (which
//! recomputes only the entries a change touches, with
//! `compile_tiers_scoped`: some subjects, a tier, some peers).
//!
//! Ranks: the CNPs of a tier are ordered by (priority ascending, name
//! ascending) and their rules of one direction by index; a rule's rank
//! follows that order (see [`ranked_rules`]: sparse, so one CNP's change
//! re-ranks only its priority's CNPs). "The first matching rule of the
//! highest-priority matching CNP" is the matching rule of lowest rank.
//!
//! The fold (see [`TierEntry`]): per (subject, direction, tier, peer
//! identity), every rule that matches that identity contributes items
//! (protocol or none, port range, value). [`fold`] turns them into entries
//! whose lookup — the entry of the packet's protocol holding its port, else
//! the `protocol: None` entry — gives the lowest-rank item covering the
//! packet: the `None` entry holds the lowest-rank protocol-less item; each
//! protocol's port line is cut at every range boundary and each piece
//! holds the lowest rank among the items covering it, the protocol-less
//! ones included (so "Deny all" at rank 1 and "Accept TCP 80" at rank 3
//! give a TCP 80 entry with the rank-1 Deny, which is left out because the
//! `None` entry already says it). Pieces equal to the `None` entry's value
//! are left out, adjacent equal pieces are merged.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ipnet::IpNet;
use npm_common::IDENTITY_ANY;

use super::domains::domain_prefixes;
use super::model::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};
use crate::compile::{contains_net, ALL_PORTS};
use crate::compiled::{Direction, Endpoint, IdentityKey, RuleRef, Tier, TierEntry, TierPresence, TierValue};
use crate::model::{Labels, Protocol, Snapshot};

/// The largest rank a rule can have: the last below the datapath's bound
/// ([`npm_common::TIER_MAX_RANK`], the one owner of the rank's width).
pub const MAX_RANK: u32 = npm_common::TIER_MAX_RANK - 1;

/// One rule of a tier in evaluation order.
#[derive(Clone, Copy, Debug)]
pub struct RankedRule<'a> {
    /// Its policy.
    pub policy: &'a ClusterPolicy,
    /// Its direction.
    pub direction: Direction,
    /// Its index in the policy's rules of `direction`.
    pub index: usize,
    /// The rule.
    pub rule: &'a ClusterRule,
    /// Its rank (position in the tier's order for `direction`).
    pub rank: u32,
}

impl RankedRule<'_> {
    /// The rule's [`RuleRef::Cluster`].
    pub fn rule_ref(&self) -> RuleRef {
        RuleRef::Cluster {
            tier: self.policy.tier,
            name: self.policy.name.clone(),
            direction: self.direction,
            index: self.index,
        }
    }
}

/// The CNPs of `tier` in evaluation order: priority ascending, then name
/// ascending (the API leaves equal priorities undefined; the name makes
/// the order total and deterministic).
pub fn tier_policies(snapshot: &Snapshot, tier: Tier) -> Vec<&ClusterPolicy> {
    let mut v: Vec<&ClusterPolicy> = snapshot.cluster_policies.values().filter(|p| p.tier == tier).collect();
    v.sort_by(|a, b| (a.priority, &a.name).cmp(&(b.priority, &b.name)));
    v
}

/// The rules of `tier` in `direction` with their ranks, in rank order.
///
/// The rank is sparse, so that a change of one CNP re-ranks only the CNPs
/// of its own priority: `priority << 20 | position among the CNPs of that
/// priority (by name) << 5 | rule index`. Should a tier ever hold 2^15
/// CNPs of one priority or a rule index of 32 or more (the API allows 25),
/// its ranks are the dense positions instead. Either way the order is
/// (priority, name, index), ranks are unique per tier and direction and
/// below 2^30.
pub fn ranked_rules(snapshot: &Snapshot, tier: Tier, direction: Direction) -> Vec<RankedRule<'_>> {
    let policies = tier_policies(snapshot, tier);
    let mut out = Vec::new();
    let mut sparse = true;
    let mut pos = 0u32;
    let mut last_priority = None;
    for policy in &policies {
        if last_priority != Some(policy.priority) {
            pos = 0;
            last_priority = Some(policy.priority);
        }
        for (index, rule) in policy.rules(direction).iter().enumerate() {
            sparse &= policy.priority <= 1000 && pos < (1 << 15) && index < 32;
            out.push(RankedRule {
                policy,
                direction,
                index,
                rule,
                rank: (policy.priority.min(1000) << 20) | (pos.min((1 << 15) - 1) << 5) | (index.min(31) as u32),
            });
        }
        pos += 1;
    }
    if !sparse {
        for (i, r) in out.iter_mut().enumerate() {
            r.rank = (i as u32).min(MAX_RANK);
        }
    }
    out
}

/// True when `subject` selects a pod with labels `pod_labels` in a
/// namespace with labels `ns_labels`.
pub fn subject_selects(subject: &Subject, pod_labels: &Labels, ns_labels: &Labels) -> bool {
    match subject {
        Subject::Namespaces(sel) => sel.matches(ns_labels),
        Subject::Pods { namespaces, pods } => namespaces.matches(ns_labels) && pods.matches(pod_labels),
    }
}

/// What `nodes` and `domainNames` peers resolve against besides the
/// identities: the node identities (other nodes, see [`crate::nodes`]),
/// this node's labels (a match is `IDENTITY_HOST`) and the learned names.
#[derive(Clone, Copy, Debug)]
pub struct TierFacts<'a> {
    /// Node identity -> its labels and nodes.
    pub identities: &'a BTreeMap<u32, crate::compiled::NodeIdentity>,
    /// This node's labels (`None`: its Node object is not known; a `nodes`
    /// peer then never matches this node).
    pub local: Option<&'a Labels>,
    /// The snapshot's learned names (`domainNames` peers).
    pub learned: &'a crate::tiers::domains::LearnedNames,
}

/// The peers of one rule as identities.
#[derive(Clone, Debug, Default)]
struct Peers {
    /// Pod identities selected by `namespaces`/`pods` peers.
    pods: Vec<u32>,
    /// Node identities and `IDENTITY_HOST` (`nodes`), CIDR identities
    /// (`networks`) and `IDENTITY_ANY` (the fail-closed
    /// [`ClusterPeer::All`]).
    other: Vec<u32>,
    /// [`ClusterPeer::All`] is among the peers.
    all: bool,
}

impl Peers {
    fn is_empty(&self) -> bool {
        self.pods.is_empty() && self.other.is_empty()
    }
    fn ids(&self) -> impl Iterator<Item = u32> + '_ {
        self.pods.iter().chain(&self.other).copied()
    }
}

/// Pod identities grouped by namespace (every identity of a group has its
/// namespace's labels): a namespace selector is matched once per
/// namespace.
type Groups<'a> = Vec<Group<'a>>;

/// One namespace's labels and its pod identities.
type Group<'a> = (&'a Labels, Vec<(u32, &'a IdentityKey)>);

fn groups(identities: &BTreeMap<u32, IdentityKey>) -> Groups<'_> {
    let mut by: BTreeMap<&str, Group<'_>> = BTreeMap::new();
    for (id, k) in identities {
        by.entry(k.namespace.as_str())
            .or_insert_with(|| (&k.namespace_labels, Vec::new()))
            .1
            .push((*id, k));
    }
    by.into_values().collect()
}

/// Does `peer` select the pods of identity `key`? The one predicate of
/// ClusterNetworkPolicy's pod peers: the full compile ([`peer_ids`]), a
/// scoped recompute ([`peer_ids_among`]) and the incremental compiler (an
/// identity that appears or goes) all ask it. The other peers select
/// node, CIDR or every identity, never one pod identity by its labels.
pub(crate) fn peer_selects_pod(peer: &ClusterPeer, key: &IdentityKey) -> bool {
    match peer {
        // "Namespaces defines a way to select all pods within a set of
        // Namespaces."
        ClusterPeer::Namespaces(sel) => sel.matches(&key.namespace_labels),
        // "Pods defines a way to select a set of pods in a set of
        // namespaces."
        ClusterPeer::Pods { namespaces, pods } => {
            namespaces.matches(&key.namespace_labels) && pods.matches(&key.pod_labels)
        }
        ClusterPeer::Networks(_) | ClusterPeer::Nodes(_) | ClusterPeer::DomainNames(_) | ClusterPeer::All => false,
    }
}

/// The identities one peer stands for (pod identities, or CIDR
/// identities and `IDENTITY_ANY`), memoized per distinct peer.
fn peer_ids<'p>(
    peer: &'p ClusterPeer,
    groups: &Groups<'_>,
    cidrs: &BTreeMap<IpNet, u32>,
    nodes: &TierFacts<'_>,
    memo: &mut HashMap<&'p ClusterPeer, Vec<u32>>,
) -> Vec<u32> {
    if let Some(v) = memo.get(peer) {
        return v.clone();
    }
    let v: Vec<u32> = match peer {
        ClusterPeer::Namespaces(sel) => groups
            .iter()
            .filter(|(ns, _)| sel.matches(ns))
            .flat_map(|(_, g)| g.iter().map(|(id, _)| *id))
            .collect(),
        // The namespaces whose labels match first (one selector match per
        // namespace), then the identities the predicate takes.
        ClusterPeer::Pods { namespaces, .. } => groups
            .iter()
            .filter(|(ns, _)| namespaces.matches(ns))
            .flat_map(|(_, g)| g.iter().filter(|(_, k)| peer_selects_pod(peer, k)).map(|(id, _)| *id))
            .collect(),
        // "Networks defines a way to select peers via CIDR blocks [...]
        // cluster-internal traffic will be checked against the rule as
        // well": every CIDR identity nested in a network (pod addresses
        // carry the CIDR identity of their longest prefix).
        ClusterPeer::Networks(nets) => cidrs
            .iter()
            .filter(|(p, _)| nets.iter().any(|n| contains_net(n, p)))
            .map(|(_, id)| *id)
            .collect(),
        // "DomainNames provides a way to specify domain names as peers":
        // the CIDR identities of the host prefixes of the learned
        // addresses of the names matched (each is a prefix of the compile,
        // see `cidr_prefixes`).
        ClusterPeer::DomainNames(names) => domain_prefixes(names, nodes.learned)
            .iter()
            .filter_map(|p| cidrs.get(p).copied())
            .collect(),
        // "Nodes defines a way to select a set of nodes in the cluster
        // (based on the node's labels)": the node identities of the other
        // nodes whose labels match, and IDENTITY_HOST when this node's do.
        ClusterPeer::Nodes(sel) => {
            let mut v: Vec<u32> = nodes
                .identities
                .iter()
                .filter(|(_, n)| sel.matches(&n.labels))
                .map(|(id, _)| *id)
                .collect();
            if nodes.local.is_some_and(|l| sel.matches(l)) {
                v.push(npm_common::IDENTITY_HOST);
            }
            v
        }
        ClusterPeer::All => vec![IDENTITY_ANY],
    };
    memo.insert(peer, v.clone());
    v
}

/// The identities of `only` that one peer stands for: [`peer_ids`]
/// restricted to `only`, found by matching each identity of `only` against
/// the peer instead of resolving the peer against every identity (a
/// recompute scoped to a few peers then costs what its scope holds).
fn peer_ids_among(
    peer: &ClusterPeer,
    only: &BTreeSet<u32>,
    identities: &BTreeMap<u32, IdentityKey>,
    cidr_of: &HashMap<u32, IpNet>,
    nodes: &TierFacts<'_>,
) -> Vec<u32> {
    let pick = |f: &dyn Fn(u32) -> bool| only.iter().copied().filter(|id| f(*id)).collect();
    match peer {
        ClusterPeer::Namespaces(_) | ClusterPeer::Pods { .. } => {
            pick(&|id| identities.get(&id).is_some_and(|k| peer_selects_pod(peer, k)))
        }
        ClusterPeer::Networks(nets) => pick(&|id| {
            cidr_of
                .get(&id)
                .is_some_and(|p| nets.iter().any(|n| contains_net(n, p)))
        }),
        ClusterPeer::DomainNames(names) => {
            let hosts = domain_prefixes(names, nodes.learned);
            pick(&|id| cidr_of.get(&id).is_some_and(|p| hosts.contains(p)))
        }
        ClusterPeer::Nodes(sel) => pick(&|id| {
            nodes.identities.get(&id).is_some_and(|n| sel.matches(&n.labels))
                || (id == npm_common::IDENTITY_HOST && nodes.local.is_some_and(|l| sel.matches(l)))
        }),
        ClusterPeer::All => pick(&|id| id == IDENTITY_ANY),
    }
}

/// The peers of `rule` as identities, each peer's identities given by
/// `ids_of`.
fn resolve_with<'p>(rule: &'p ClusterRule, mut ids_of: impl FnMut(&'p ClusterPeer) -> Vec<u32>) -> Peers {
    let mut pods = std::collections::BTreeSet::new();
    let mut other = std::collections::BTreeSet::new();
    let mut all = false;
    for peer in &rule.peers {
        let ids = ids_of(peer);
        match peer {
            ClusterPeer::Namespaces(_) | ClusterPeer::Pods { .. } => pods.extend(ids),
            // Nodes and names have no named ports: `other`, like CIDRs.
            ClusterPeer::Networks(_) | ClusterPeer::Nodes(_) | ClusterPeer::DomainNames(_) => other.extend(ids),
            ClusterPeer::All => {
                all = true;
                other.extend(ids);
            }
        }
    }
    Peers {
        pods: pods.into_iter().collect(),
        other: other.into_iter().collect(),
        all,
    }
}

/// One contribution of a rule to one (subject, direction, tier, peer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Item {
    /// `None`: every protocol and port.
    pub protocol: Option<Protocol>,
    /// Inclusive port range (ignored with `protocol: None`).
    pub ports: (u16, u16),
    /// The rule's value.
    pub value: TierValue,
}

/// Folds the items of one (subject, direction, tier, peer) into entries
/// (protocol, ports, value) as the module doc says.
pub fn fold(items: &[Item]) -> Vec<(Option<Protocol>, (u16, u16), TierValue)> {
    let mut out = Vec::new();
    let none = items
        .iter()
        .filter(|i| i.protocol.is_none())
        .map(|i| i.value)
        .min_by_key(|v| v.rank);
    if let Some(v) = none {
        out.push((None, ALL_PORTS, v));
    }
    for proto in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
        // Sweep over the port line: events at `start` (+) and `end + 1` (-).
        let mut events: Vec<(u32, bool, TierValue)> = Vec::new();
        for i in items.iter().filter(|i| i.protocol == Some(proto)) {
            events.push((i.ports.0 as u32, true, i.value));
            events.push((i.ports.1 as u32 + 1, false, i.value));
        }
        if events.is_empty() {
            continue;
        }
        events.sort_by_key(|e| (e.0, e.1));
        let mut active: BTreeMap<u32, (TierValue, usize)> = BTreeMap::new();
        let mut pieces: Vec<(u32, u32, TierValue)> = Vec::new();
        let mut k = 0;
        while k < events.len() {
            let pos = events[k].0;
            while k < events.len() && events[k].0 == pos {
                let (_, start, v) = events[k];
                if start {
                    active.entry(v.rank).or_insert((v, 0)).1 += 1;
                } else if let Some(slot) = active.get_mut(&v.rank) {
                    slot.1 -= 1;
                    if slot.1 == 0 {
                        active.remove(&v.rank);
                    }
                }
                k += 1;
            }
            let Some((_, (best, _))) = active.iter().next() else {
                continue;
            };
            let end = events.get(k).map_or(u16::MAX as u32 + 1, |e| e.0);
            let value = match none {
                Some(n) if n.rank < best.rank => n,
                _ => *best,
            };
            if pos < end && Some(value) != none {
                match pieces.last_mut() {
                    Some(last) if last.1 == pos && last.2 == value => last.1 = end,
                    _ => pieces.push((pos, end, value)),
                }
            }
        }
        for (a, b, v) in pieces {
            out.push((Some(proto), (a as u16, (b - 1) as u16), v));
        }
    }
    out
}

/// Adds the items of the ranked rule `ranked` (value `value`, peers
/// `peers`) for the subject of identity key `key` to `acc` (only those of
/// the peers in `only`, if given).
fn emit(
    acc: &mut HashMap<u32, Vec<Item>>,
    key: &IdentityKey,
    ranked: &RankedRule<'_>,
    peers: &Peers,
    identities: &BTreeMap<u32, IdentityKey>,
    value: TierValue,
    only: Option<&BTreeSet<u32>>,
) {
    let (dir, rule) = (ranked.direction, ranked.rule);
    // Rules come in rank order: an item covered by an earlier item of the
    // same peer (protocol-less, or the same protocol with a range holding
    // this one) can never be the lowest rank of a packet; it is left out.
    let mut put = |peer: u32, protocol: Option<Protocol>, ports: (u16, u16)| {
        if only.is_some_and(|o| !o.contains(&peer)) {
            return;
        }
        let items = acc.entry(peer).or_default();
        let covered = items.iter().any(|i| {
            i.value.rank <= value.rank
                && (i.protocol.is_none() || (i.protocol == protocol && i.ports.0 <= ports.0 && ports.1 <= i.ports.1))
        });
        if !covered {
            items.push(Item { protocol, ports, value });
        }
    };
    // "Protocols [...] If unspecified, protocol-specific attributes will
    // not be used to match traffic": every protocol, ICMP too.
    if rule.ports.is_empty() {
        for id in peers.ids() {
            put(id, None, ALL_PORTS);
        }
        return;
    }
    for port in &rule.ports {
        match port {
            ClusterPort::Ports { protocol, start, end } => {
                for id in peers.ids() {
                    put(id, Some(*protocol), (*start, *end));
                }
            }
            // "DestinationNamedPort selects a destination port on a pod
            // based on the ContainerPort name."
            ClusterPort::Named(name) => match dir {
                // The destination is the endpoint itself (its key holds
                // its pods' named ports).
                Direction::Ingress => {
                    for (_, proto, num) in key.named_ports.iter().filter(|(n, _, _)| n == name) {
                        for id in peers.ids() {
                            put(id, Some(*proto), (*num, *num));
                        }
                    }
                }
                // The destination is the peer pod: per pod identity (its
                // key holds its named ports); never a CIDR or a non-pod.
                Direction::Egress => {
                    let mut named = |id: u32, k: &IdentityKey| {
                        for (n, proto, num) in &k.named_ports {
                            if n == name {
                                put(id, Some(*proto), (*num, *num));
                            }
                        }
                    };
                    if peers.all {
                        for (id, k) in identities {
                            named(*id, k);
                        }
                    } else {
                        for id in &peers.pods {
                            if let Some(k) = identities.get(id) {
                                named(*id, k);
                            }
                        }
                    }
                }
            },
        }
    }
}

/// The tier entries of the subjects `locals` (pod identity of local
/// endpoints, its key) of `snapshot`, against the pod identities `identities`, CIDR identities
/// `cidrs` and the nodes `nodes`; `rule_id` numbers the rules that emit entries.
pub(crate) fn compile_tiers(
    snapshot: &Snapshot,
    locals: &[(u32, &IdentityKey)],
    identities: &BTreeMap<u32, IdentityKey>,
    cidrs: &BTreeMap<IpNet, u32>,
    nodes: &TierFacts<'_>,
    rule_id: impl FnMut(&RuleRef) -> u32,
) -> BTreeMap<TierEntry, TierValue> {
    compile_tiers_scoped(snapshot, locals, identities, cidrs, nodes, &Scope::default(), rule_id)
}

/// Which part of the tier entries [`compile_tiers_scoped`] computes.
#[derive(Clone, Debug, Default)]
pub(crate) struct Scope {
    /// Only these tiers (`None`: both).
    pub(crate) tiers: Option<BTreeSet<Tier>>,
    /// Only the entries of these peer identities (`None`: every peer).
    pub(crate) peers: Option<BTreeSet<u32>>,
}

impl Scope {
    fn has_tier(&self, tier: Tier) -> bool {
        self.tiers.as_ref().is_none_or(|t| t.contains(&tier))
    }
}

/// The peer identities whose tier entries `policy`'s rules can produce,
/// against the same tables as [`compile_tiers`]; `None` when that is every
/// pod identity (an egress rule with a peer standing for every peer and a
/// named port, resolved per destination identity).
pub(crate) fn policy_peer_ids(
    policy: &ClusterPolicy,
    identities: &BTreeMap<u32, IdentityKey>,
    cidrs: &BTreeMap<IpNet, u32>,
    nodes: &TierFacts<'_>,
) -> Option<BTreeSet<u32>> {
    let named_all = policy.egress.iter().any(|r| {
        r.peers.iter().any(|p| matches!(p, ClusterPeer::All))
            && r.ports.iter().any(|p| matches!(p, ClusterPort::Named(_)))
    });
    if named_all {
        return None;
    }
    let groups = groups(identities);
    let mut memo = HashMap::new();
    let mut out = BTreeSet::new();
    for r in policy.ingress.iter().chain(&policy.egress) {
        out.extend(resolve_with(r, |peer| peer_ids(peer, &groups, cidrs, nodes, &mut memo)).ids());
    }
    Some(out)
}

/// [`compile_tiers`] restricted to `scope`: exactly the entries of
/// `compile_tiers` that are in the scope (an entry of one (subject,
/// direction, tier, peer) depends only on the rules matching that peer).
pub(crate) fn compile_tiers_scoped(
    snapshot: &Snapshot,
    locals: &[(u32, &IdentityKey)],
    identities: &BTreeMap<u32, IdentityKey>,
    cidrs: &BTreeMap<IpNet, u32>,
    nodes: &TierFacts<'_>,
    scope: &Scope,
    mut rule_id: impl FnMut(&RuleRef) -> u32,
) -> BTreeMap<TierEntry, TierValue> {
    let mut out = BTreeMap::new();
    if snapshot.cluster_policies.is_empty() || locals.is_empty() || scope.peers.as_ref().is_some_and(|p| p.is_empty()) {
        return out;
    }
    let only = scope.peers.as_ref();
    // "host-networked pods are not included in subject selection": they are
    // never endpoints.
    let mut selected: HashMap<&str, Vec<usize>> = HashMap::new();
    for p in snapshot.cluster_policies.values().filter(|p| scope.has_tier(p.tier)) {
        let sel: Vec<usize> = locals
            .iter()
            .enumerate()
            .filter(|(_, (_, key))| subject_selects(&p.subject, &key.pod_labels, &key.namespace_labels))
            .map(|(i, _)| i)
            .collect();
        selected.insert(p.name.as_str(), sel);
    }
    // A scope of a few peers matches them against each rule's peers; a
    // wide one (or none) resolves each peer against every identity once.
    let direct = only.is_some_and(|o| o.len().saturating_mul(8) <= identities.len() + cidrs.len());
    let groups = if direct { Vec::new() } else { groups(identities) };
    let cidr_of: HashMap<u32, IpNet> = if direct {
        cidrs.iter().map(|(net, id)| (*id, *net)).collect()
    } else {
        HashMap::new()
    };
    let mut memo: HashMap<&ClusterPeer, Vec<u32>> = HashMap::new();
    let mut resolved: HashMap<&[ClusterPeer], std::rc::Rc<Peers>> = HashMap::new();
    for tier in [Tier::Admin, Tier::Baseline].into_iter().filter(|t| scope.has_tier(*t)) {
        for dir in [Direction::Ingress, Direction::Egress] {
            // Subject index -> peer identity -> items.
            let mut acc: Vec<HashMap<u32, Vec<Item>>> = vec![HashMap::new(); locals.len()];
            // (peers, ports) -> the subjects that already have a rule of
            // exactly that match at a lower rank: a later equal rule is
            // never the first match there.
            let mut seen: HashMap<(&[ClusterPeer], &[ClusterPort]), std::collections::HashSet<usize>> = HashMap::new();
            for r in ranked_rules(snapshot, tier, dir) {
                let eps = &selected[r.policy.name.as_str()];
                if eps.is_empty() || r.rule.peers.is_empty() {
                    continue;
                }
                let peers = match resolved.get(r.rule.peers.as_slice()) {
                    Some(p) => p.clone(),
                    None => {
                        let p = match only {
                            Some(o) if direct => {
                                let p =
                                    resolve_with(r.rule, |peer| peer_ids_among(peer, o, identities, &cidr_of, nodes));
                                #[cfg(debug_assertions)]
                                {
                                    let all = crate::tiers::compile::groups(identities);
                                    let mut memo = HashMap::new();
                                    let mut full =
                                        resolve_with(r.rule, |peer| peer_ids(peer, &all, cidrs, nodes, &mut memo));
                                    full.pods.retain(|id| o.contains(id));
                                    full.other.retain(|id| o.contains(id));
                                    debug_assert_eq!((&p.pods, &p.other, p.all), (&full.pods, &full.other, full.all));
                                }
                                p
                            }
                            _ => {
                                let mut p =
                                    resolve_with(r.rule, |peer| peer_ids(peer, &groups, cidrs, nodes, &mut memo));
                                if let Some(o) = only {
                                    p.pods.retain(|id| o.contains(id));
                                    p.other.retain(|id| o.contains(id));
                                }
                                p
                            }
                        };
                        let p = std::rc::Rc::new(p);
                        resolved.insert(r.rule.peers.as_slice(), p.clone());
                        p
                    }
                };
                // (With `all`, an egress named port still resolves per
                // destination identity, see `emit`.)
                if peers.is_empty() && !(peers.all && dir == Direction::Egress) {
                    continue;
                }
                let value = TierValue {
                    action: r.rule.action,
                    rank: r.rank,
                    rule: rule_id(&r.rule_ref()),
                };
                let done = seen
                    .entry((r.rule.peers.as_slice(), r.rule.ports.as_slice()))
                    .or_default();
                for i in eps {
                    if done.insert(*i) {
                        emit(&mut acc[*i], locals[*i].1, &r, &peers, identities, value, only);
                    }
                }
            }
            for (i, by_peer) in acc.into_iter().enumerate() {
                for (peer, items) in by_peer {
                    for (protocol, ports, value) in fold(&items) {
                        out.insert(
                            TierEntry {
                                subject: locals[i].0,
                                direction: dir,
                                tier,
                                peer,
                                protocol,
                                ports,
                            },
                            value,
                        );
                    }
                }
            }
        }
    }
    out
}

/// Sets every endpoint's [`Endpoint::tiers`] from the entries: a tier and
/// direction is present iff it has an entry for the endpoint's subject.
pub(crate) fn set_presence(endpoints: &mut BTreeMap<u32, Endpoint>, tiers: &BTreeMap<TierEntry, TierValue>) {
    let mut presence: HashMap<u32, TierPresence> = HashMap::new();
    for e in tiers.keys() {
        presence.entry(e.subject).or_default().set(e.tier, e.direction);
    }
    for ep in endpoints.values_mut() {
        ep.tiers = presence.get(&ep.identity).copied().unwrap_or_default();
    }
}
