//! The compiler: [`Snapshot`] -> [`Compiled`] for one node.
//!
//! Every branch quotes the specification digest
//! (`shared/reference/networkpolicy-semantics.md`) it implements.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use ipnet::{IpNet, Ipv4Net};
use npm_common::{IDENTITY_ANY, IDENTITY_HOST};

use crate::compiled::{
    CompileOptions, Compiled, Direction, Endpoint, IdentityKey, IpEntry, PodRef, PolicyEntry, RuleRef,
};
use crate::identity::{identity_key, mapped_prefix, namespace_labels, Allocator, PrefixTable};
use crate::model::{IpBlock, Labels, Peer, Pod, Policy, PortSpec, Protocol, Rule, Snapshot};
use crate::ownership::ip_owners;
use crate::peers::{self, IdentityGroups, PeerSet};

/// Every port.
pub(crate) const ALL_PORTS: (u16, u16) = (0, u16::MAX);

/// True when CIDR identity prefix `p` is allowed by `block`.
///
/// Spec §4: ipBlock selects an "IP inside `cidr` and not inside any
/// `except` entry". The datapath gives an address the identity of the
/// longest prefix `L` of `cidrs` containing it, and `cidrs` holds `C` and
/// every `Ei` of every block. Allowing every prefix `P` with `P ⊆ C` and
/// `P ⊄ Ei` for all i is exact:
/// - `a ∈ C`, `a ∉ ∪Ei`: `C` contains `a`, so `L` exists and is at least as
///   long as `C`; two prefixes containing `a` are nested, so `L ⊆ C`. `L`
///   contains `a ∉ Ei`, so `L ⊄ Ei`: allowed.
/// - `a ∈ Ei`: `Ei` contains `a`, so `L ⊆ Ei`: denied.
/// - `a ∉ C`: `L` (if any) contains `a`, so `L ⊄ C`: denied; no `L` gives
///   identity 0, which only matches `IDENTITY_ANY` entries.
///
/// Families never mix: an IPv6 prefix never contains an IPv4 prefix. In
/// the datapath IPv4 is mapped into `::ffff:0:0/96`, so an IPv6 prefix of
/// length <= 96 covering that range would wrongly be the longest match of
/// IPv4 addresses; [`compile`] then adds `0.0.0.0/0`, which is longer in
/// the mapped space and is allowed only by IPv4 blocks with `cidr` /0.
pub fn block_allows_prefix(block: &IpBlock, p: &IpNet) -> bool {
    contains_net(&block.cidr, p) && !block.except.iter().any(|e| contains_net(e, p))
}

/// `inner ⊆ outer`, same family only.
pub(crate) fn contains_net(outer: &IpNet, inner: &IpNet) -> bool {
    match (outer, inner) {
        (IpNet::V4(o), IpNet::V4(i)) => o.prefix_len() <= i.prefix_len() && o.contains(&i.network()),
        (IpNet::V6(o), IpNet::V6(i)) => o.prefix_len() <= i.prefix_len() && o.contains(&i.network()),
        _ => false,
    }
}

/// The CIDR identity prefixes of a snapshot: every `cidr` and `except`
/// prefix of every valid policy (spec §4, ipBlock) and every `networks`
/// CIDR of every ClusterNetworkPolicy (shared: one identity per prefix),
/// the host prefix of every learned address a `domainNames` peer matches,
/// plus `0.0.0.0/0` when an IPv6 prefix covers the IPv4-mapped range (see
/// [`block_allows_prefix`]).
pub fn cidr_prefixes(snapshot: &Snapshot) -> BTreeSet<IpNet> {
    let mut set = BTreeSet::new();
    for p in snapshot.policies.values() {
        for r in p.ingress.iter().chain(&p.egress) {
            for peer in &r.peers {
                if let Peer::IpBlock(b) = peer {
                    set.insert(b.cidr);
                    set.extend(b.except.iter().copied());
                }
            }
        }
    }
    for p in snapshot.cluster_policies.values() {
        for r in p.ingress.iter().chain(&p.egress) {
            for peer in &r.peers {
                match peer {
                    crate::tiers::ClusterPeer::Networks(nets) => set.extend(nets.iter().copied()),
                    // The hosts of the learned names: a prefix each.
                    crate::tiers::ClusterPeer::DomainNames(names) => {
                        set.extend(crate::tiers::domains::domain_prefixes(names, &snapshot.domain_names))
                    }
                    _ => {}
                }
            }
        }
    }
    let v4_mapped_range = (0xffffu128 << 32, 96u8);
    let covers_v4 = set.iter().any(|n| {
        let (addr, len) = mapped_prefix(n);
        n.addr().is_ipv6() && len <= 96 && (len == 0 || (addr ^ v4_mapped_range.0) >> (128 - len as u32) == 0)
    });
    if covers_v4 {
        set.insert(IpNet::V4(
            Ipv4Net::new(std::net::Ipv4Addr::UNSPECIFIED, 0).expect("/0 is valid"),
        ));
    }
    set
}

/// True when `policy` selects `pod` (spec §1: "`spec.podSelector` selects
/// pods **in that namespace only**. An empty selector `{}` selects all
/// pods in the namespace").
pub fn policy_selects(policy: &Policy, pod: &Pod) -> bool {
    policy.namespace == pod.namespace && policy.pod_selector.matches(&pod.labels)
}

/// [`policy_selects`] for the pods of identity key `key` (a subject).
pub fn policy_selects_key(policy: &Policy, key: &IdentityKey) -> bool {
    policy.namespace == key.namespace && policy.pod_selector.matches(&key.pod_labels)
}

/// Pod identities grouped by namespace, as the peer resolution reads them.
struct ByNamespace<'a>(BTreeMap<&'a str, Vec<(u32, &'a IdentityKey)>>);

impl IdentityGroups for ByNamespace<'_> {
    fn in_namespace(&self, ns: &str) -> impl Iterator<Item = (u32, &IdentityKey)> {
        self.0.get(ns).into_iter().flatten().map(|(id, k)| (*id, *k))
    }

    fn groups(&self) -> impl Iterator<Item = impl Iterator<Item = (u32, &IdentityKey)> + Clone> {
        self.0.values().map(|g| g.iter().map(|(id, k)| (*id, *k)))
    }
}

/// Resolver of rule peers to identities, shared by the endpoints of a
/// compile.
struct Resolver<'a> {
    /// Pod identities grouped by namespace.
    by_namespace: ByNamespace<'a>,
    /// CIDR identities.
    cidrs: &'a BTreeMap<IpNet, u32>,
    /// Memo: (policy, direction, rule index) -> peers.
    memo: HashMap<(&'a str, &'a str, Direction, usize), PeerSet>,
    /// The first rule resolved for each [`PeerContent`]: rules with the
    /// same content have the same peers (many policies repeat a selector).
    by_content: HashMap<PeerContent<'a>, (&'a str, &'a str, Direction, usize)>,
}

/// What the peers of a rule depend on (the identities and CIDR identities
/// of the compile aside): its peers and, when one is a `podSelector`
/// alone, the policy's namespace.
type PeerContent<'a> = (Option<&'a str>, &'a [Peer]);

impl<'a> Resolver<'a> {
    fn peers(&mut self, policy: &'a Policy, dir: Direction, index: usize, rule: &'a Rule) -> &PeerSet {
        let key = (policy.namespace.as_str(), policy.name.as_str(), dir, index);
        if !self.memo.contains_key(&key) {
            let ns = rule
                .peers
                .iter()
                .any(|p| matches!(p, Peer::Pods(_)))
                .then_some(policy.namespace.as_str());
            let set = match self.by_content.get(&(ns, rule.peers.as_slice())) {
                Some(same) => self.memo[same].clone(),
                None => {
                    self.by_content.insert((ns, rule.peers.as_slice()), key);
                    peers::resolve(policy, rule, &self.by_namespace, self.cidrs)
                }
            };
            self.memo.insert(key, set);
        }
        &self.memo[&key]
    }
}

/// The port numbers that pods of identity `key` give to the named port
/// `name` with `protocol` (spec §5: "The name **and** the protocol must
/// match").
pub(crate) fn named_port_numbers<'k>(
    key: &'k IdentityKey,
    name: &'k str,
    protocol: Protocol,
) -> impl Iterator<Item = u16> + 'k {
    key.named_ports
        .iter()
        .filter(move |(n, p, _)| n == name && *p == protocol)
        .map(|(_, _, n)| *n)
}

/// Emits the entries that egress rule `rule` (with an empty `to`) gives
/// subject `subject` towards the pods of identity `id` (key `key`)
/// through its named ports; the other ports of the rule are covered by
/// `IDENTITY_ANY` entries and emit nothing here. Used by the incremental
/// compiler when an identity appears; the same entries as [`emit_rule`].
pub(crate) fn emit_named_egress_to(
    out: &mut BTreeMap<PolicyEntry, u32>,
    subject: u32,
    rule: &Rule,
    id: u32,
    key: &IdentityKey,
    rule_id: u32,
) {
    for port in &rule.ports {
        if let PortSpec::Named(name) = &port.port {
            for n in named_port_numbers(key, name, port.protocol) {
                let e = PolicyEntry {
                    subject,
                    direction: Direction::Egress,
                    peer: id,
                    protocol: Some(port.protocol),
                    ports: (n, n),
                };
                let slot = out.entry(e).or_insert(rule_id);
                *slot = (*slot).min(rule_id);
            }
        }
    }
}

/// Emits the entries of one rule for one subject (the pod identity
/// `subject`, of key `key`).
// Eight arguments: the fields of a [`RuleTarget`] and the tables, for the
// four callers that have them at hand; [`emit_rule_towards`] takes the
// target.
#[allow(clippy::too_many_arguments)]
pub(crate) fn emit_rule(
    out: &mut BTreeMap<PolicyEntry, u32>,
    subject: u32,
    key: &IdentityKey,
    dir: Direction,
    rule: &Rule,
    peers: &PeerSet,
    identities: &BTreeMap<u32, IdentityKey>,
    rule_id: u32,
) {
    let target = RuleTarget {
        subject,
        key,
        dir,
        rule,
        peers,
        rule_id,
    };
    emit_rule_towards(out, &target, identities, None);
}

/// One rule of one subject, as [`emit_rule_towards`] emits it.
pub(crate) struct RuleTarget<'a> {
    /// The subject (a pod identity of local endpoints, see [`PolicyEntry`]).
    pub(crate) subject: u32,
    /// Its identity key (namespace, labels, named ports).
    pub(crate) key: &'a IdentityKey,
    /// The rule's direction.
    pub(crate) dir: Direction,
    /// The rule.
    pub(crate) rule: &'a Rule,
    /// Its resolved peers.
    pub(crate) peers: &'a PeerSet,
    /// Its rule id.
    pub(crate) rule_id: u32,
}

/// Appends the elements of `set` that are in `only` (sorted) to `out`:
/// lookups of the smaller side in the larger when one is much smaller,
/// else one merge walk of both.
fn intersect_into(set: &BTreeSet<u32>, only: &[u32], out: &mut Vec<u32>) {
    if only.len().saturating_mul(16) < set.len() {
        out.extend(only.iter().filter(|p| set.contains(p)));
    } else if set.len().saturating_mul(16) < only.len() {
        out.extend(set.iter().filter(|p| only.binary_search(p).is_ok()));
    } else {
        let mut rest = only;
        for p in set {
            let skip = rest.partition_point(|o| o < p);
            rest = &rest[skip..];
            match rest.first() {
                None => break,
                Some(o) if o == p => out.push(*p),
                Some(_) => {}
            }
        }
    }
}

/// The peers of `peers` that are in `only` (sorted; every one: `None`):
/// the pod identities first, then the others, and how many pod
/// identities there are.
fn peers_in(peers: &PeerSet, only: Option<&[u32]>) -> (Vec<u32>, usize) {
    match only {
        None => (
            peers.pods.iter().chain(&peers.other).copied().collect(),
            peers.pods.len(),
        ),
        Some(o) => {
            let mut out = Vec::new();
            intersect_into(&peers.pods, o, &mut out);
            let n = out.len();
            intersect_into(&peers.other, o, &mut out);
            (out, n)
        }
    }
}

/// Where the emitters put entries: an entry emitted twice keeps the
/// smaller rule id.
pub(crate) trait EntrySink {
    /// Adds entry `e` of rule `rule_id`.
    fn put_min(&mut self, e: PolicyEntry, rule_id: u32);
}

impl EntrySink for BTreeMap<PolicyEntry, u32> {
    fn put_min(&mut self, e: PolicyEntry, rule_id: u32) {
        let slot = self.entry(e).or_insert(rule_id);
        *slot = (*slot).min(rule_id);
    }
}

/// Unordered, with repeats: [`sorted_entries`] makes it a map's entries.
impl EntrySink for Vec<(PolicyEntry, u32)> {
    fn put_min(&mut self, e: PolicyEntry, rule_id: u32) {
        self.push((e, rule_id));
    }
}

/// Sorts the entries gathered in a `Vec` sink and keeps, of each entry,
/// its smallest rule id: the entries a map sink would hold, in order.
pub(crate) fn sorted_entries(mut v: Vec<(PolicyEntry, u32)>) -> Vec<(PolicyEntry, u32)> {
    v.sort_unstable();
    // Sorted by (entry, rule id): the first of each entry has the smallest id.
    v.dedup_by(|later, first| later.0 == first.0);
    v
}

/// [`emit_rule`] restricted to the entries towards the peer identities in
/// `only` (sorted; `None`: every entry). The entries of a subject towards one
/// peer depend only on the rules that emit towards that peer, so the
/// restricted emission of every rule of a subject is exactly the subset
/// of its entries whose peer is in `only` (the incremental compiler
/// patches a policy change that way).
pub(crate) fn emit_rule_towards(
    out: &mut impl EntrySink,
    target: &RuleTarget<'_>,
    identities: &BTreeMap<u32, IdentityKey>,
    only: Option<&[u32]>,
) {
    let (key, dir, rule, peers) = (target.key, target.dir, target.rule, target.peers);
    let mut put = |peer: u32, protocol, ports: (u16, u16)| {
        let e = PolicyEntry {
            subject: target.subject,
            direction: dir,
            peer,
            protocol,
            ports,
        };
        out.put_min(e, target.rule_id);
    };
    let (targets, pod_targets) = peers_in(peers, only);
    let all_peers = || targets.iter().copied();
    // Spec §3: "An empty or missing `ports` matches all ports and protocols."
    if rule.ports.is_empty() {
        for peer in all_peers() {
            put(peer, None, ALL_PORTS);
        }
        return;
    }
    for port in &rule.ports {
        // Spec §5: "`protocol` is one of TCP, UDP or SCTP (default TCP). The
        // rule matches only traffic of that protocol."
        let proto = Some(port.protocol);
        match &port.port {
            // "If `port` is absent, the rule matches every port of that protocol."
            PortSpec::All => all_peers().for_each(|p| put(p, proto, ALL_PORTS)),
            // "`endPort` [...] gives the inclusive range `port..endPort`."
            PortSpec::Range(a, b) => all_peers().for_each(|p| put(p, proto, (*a, *b))),
            // "A **named** `port` is resolved against the **destination
            // pod's** containerPorts: for ingress the selected pod, for
            // egress the peer pod. The name **and** the protocol must match."
            PortSpec::Named(name) => match dir {
                Direction::Ingress => {
                    // The destination is the endpoint itself, whatever the
                    // peer: named ports work with any peer form. The
                    // subject's key holds its pods' named ports.
                    for n in named_port_numbers(key, name, port.protocol) {
                        all_peers().for_each(|p| put(p, proto, (n, n)));
                    }
                }
                Direction::Egress => {
                    // Per destination pod identity (its key holds the
                    // pod's named ports, so the resolution is exact per
                    // identity). With an empty `to` ("matches all peers",
                    // §3) every pod identity of the cluster is a candidate
                    // destination; otherwise the pods selected by the
                    // rule's pod/namespace selectors. "Implementations
                    // cannot resolve a name for a non-pod (ipBlock)
                    // destination, so in practice it matches nothing
                    // there": ipBlock peers, world and node addresses get
                    // no entry (nor do pods reached only through an
                    // ipBlock: the name is not resolved through a CIDR).
                    let mut towards = |id: u32, k: &IdentityKey| {
                        for n in named_port_numbers(k, name, port.protocol) {
                            put(id, proto, (n, n));
                        }
                    };
                    let known = |id: &u32| identities.get(id).map(|k| (*id, k));
                    match (rule.peers.is_empty(), only) {
                        (true, None) => identities.iter().for_each(|(id, k)| towards(*id, k)),
                        (true, Some(o)) => o.iter().filter_map(known).for_each(|(id, k)| towards(id, k)),
                        (false, None) => peers.pods.iter().filter_map(known).for_each(|(id, k)| towards(id, k)),
                        (false, Some(_)) => targets[..pod_targets]
                            .iter()
                            .filter_map(known)
                            .for_each(|(id, k)| towards(id, k)),
                    }
                }
            },
        }
    }
}

/// The rules `policy` enforces, with their direction and index: those of
/// each direction it isolates. Rules of a direction the policy does not
/// isolate are ignored (policyTypes decides which lists apply).
pub(crate) fn enforced_rules(policy: &Policy) -> impl Iterator<Item = (Direction, usize, &Rule)> {
    [
        (Direction::Ingress, policy.ingress_isolation, &policy.ingress),
        (Direction::Egress, policy.egress_isolation, &policy.egress),
    ]
    .into_iter()
    .filter(|(_, on, _)| *on)
    .flat_map(|(dir, _, rules)| rules.iter().enumerate().map(move |(i, r)| (dir, i, r)))
}

/// The entry of subject `subject` towards its node. Spec §7: "let policy
/// govern egress to the node. Make the egress choice configurable": an
/// endpoint isolated for egress gets it with `allow_host_egress`.
pub(crate) fn host_egress_entry(subject: u32) -> PolicyEntry {
    PolicyEntry {
        subject,
        direction: Direction::Egress,
        peer: IDENTITY_HOST,
        protocol: None,
        ports: ALL_PORTS,
    }
}

/// The endpoint record of local pod `pod` with identity `identity`, owning
/// the addresses `ips` (`report_new` false: the caller sets it from
/// [`CompileOptions::report_new`]).
pub(crate) fn endpoint_record(
    pod: &Pod,
    identity: u32,
    ips: &[IpAddr],
    isolated_ingress: bool,
    isolated_egress: bool,
) -> Endpoint {
    Endpoint {
        pod: PodRef {
            namespace: pod.namespace.clone(),
            name: pod.name.clone(),
            uid: pod.uid.clone(),
        },
        identity,
        ipv4: ips.iter().find_map(|i| match i {
            IpAddr::V4(a) => Some(*a),
            _ => None,
        }),
        ipv6: ips.iter().find_map(|i| match i {
            IpAddr::V6(a) => Some(*a),
            _ => None,
        }),
        isolated_ingress,
        isolated_egress,
        tiers: Default::default(),
        report_new: false,
    }
}

/// Compiles a snapshot for the node `opts.node_name`. With `prev` (the
/// previous result), every id of something that still exists is kept, so
/// [`Compiled::diff`] is minimal.
pub fn compile(snapshot: &Snapshot, opts: &CompileOptions, prev: Option<&Compiled>) -> Compiled {
    compile_with_peers(snapshot, opts, prev).0
}

/// The peer sets a compile resolved: rule `(namespace, policy name,
/// direction, index)` -> its peers, for every enforced rule of a policy
/// selecting a local endpoint.
pub(crate) type ResolvedPeers = HashMap<(String, String, Direction, usize), PeerSet>;

/// [`compile`], also returning the peer sets it resolved (the incremental
/// compiler starts from them instead of resolving every rule again).
pub(crate) fn compile_with_peers(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    prev: Option<&Compiled>,
) -> (Compiled, ResolvedPeers) {
    let mut alloc = Allocator::new(prev);
    let mut out = Compiled::default();

    // CIDR identities: stable per prefix.
    for net in cidr_prefixes(snapshot) {
        let id = alloc.cidr(&net);
        out.cidrs.insert(net, id);
    }
    let lpm = PrefixTable::new(&out.cidrs);
    let cidr_of = |ip: IpAddr| lpm.longest(ip).map_or(IDENTITY_ANY, |(_, id)| id);

    // IP ownership: an address maps to at most one pod (see `ip_owners`).
    let owners = ip_owners(snapshot, &opts.node_ips);
    let mut owned: HashMap<(&str, &str), Vec<IpAddr>> = HashMap::new();
    for (ip, pod) in &owners {
        owned
            .entry((pod.namespace.as_str(), pod.name.as_str()))
            .or_default()
            .push(*ip);
    }

    // Pod identities, cluster-wide, for pods that own an address.
    // (In snapshot order, so that new ids are handed out deterministically.)
    let mut pod_identity: HashMap<(&str, &str), u32> = HashMap::with_capacity(owned.len());
    for pod in snapshot.pods.values() {
        let key = (pod.namespace.as_str(), pod.name.as_str());
        let Some(ips) = owned.get_mut(&key) else { continue };
        ips.sort();
        let id = alloc.identity(identity_key(pod, namespace_labels(snapshot, &pod.namespace)));
        pod_identity.insert(key, id);
        for ip in ips {
            out.ipcache.insert(
                *ip,
                IpEntry {
                    identity: id,
                    cidr_identity: cidr_of(*ip),
                    owner: IpEntry::pod_owner(&pod.uid),
                },
            );
        }
    }
    // Other nodes' addresses: node identities (see `crate::nodes`); a pod
    // owning the address wins, this node's addresses (below) win.
    let node_table = crate::nodes::NodeTable::new(snapshot, opts);
    let mut node_id: HashMap<&Labels, u32> = HashMap::new();
    for (labels, names) in &node_table.groups {
        node_id.insert(labels, alloc.node_identity(labels, names.clone()));
    }
    for (ip, node) in &node_table.addresses {
        if owners.contains_key(ip) {
            continue;
        }
        out.ipcache.insert(
            *ip,
            IpEntry {
                identity: node_id[&node.labels],
                cidr_identity: cidr_of(*ip),
                owner: 0,
            },
        );
    }
    // Spec §7: "always allow ingress from the local node": node addresses
    // have IDENTITY_HOST; the datapath allows ingress from it (step 8).
    for ip in &opts.node_ips {
        out.ipcache.insert(
            *ip,
            IpEntry {
                identity: IDENTITY_HOST,
                cidr_identity: cidr_of(*ip),
                owner: 0,
            },
        );
    }

    // Taken out while rules are allocated, put back at the end.
    let identities = alloc.take_identities();
    let mut resolver = Resolver {
        by_namespace: ByNamespace(BTreeMap::new()),
        cidrs: &out.cidrs,
        memo: HashMap::new(),
        by_content: HashMap::new(),
    };
    for (id, k) in &identities {
        resolver
            .by_namespace
            .0
            .entry(k.namespace.as_str())
            .or_default()
            .push((*id, k));
    }

    // Policies by namespace.
    let mut policies_by_ns: HashMap<&str, Vec<&Policy>> = HashMap::new();
    for p in snapshot.policies.values() {
        policies_by_ns.entry(p.namespace.as_str()).or_default().push(p);
    }

    let mut policy = BTreeMap::new();
    let mut endpoints = BTreeMap::new();
    // Subject (pod identity) -> its isolation (ingress, egress), once its
    // entries are emitted: the endpoints of one identity share them.
    let mut subjects: HashMap<u32, (bool, bool)> = HashMap::new();
    // Local endpoints: pods of this node that own an address (not
    // hostNetwork, not terminal: `is_addressable`).
    for pod in snapshot.pods.values() {
        if pod.node_name.as_deref() != Some(opts.node_name.as_str()) {
            continue;
        }
        let key = (pod.namespace.as_str(), pod.name.as_str());
        let Some(ips) = owned.get(&key) else { continue };
        let ep = alloc.endpoint(&pod.uid);
        let subject = pod_identity[&key];
        let (iso_in, iso_eg) = match subjects.get(&subject) {
            Some(iso) => *iso,
            None => {
                let iso = emit_subject(
                    &mut policy,
                    subject,
                    &identities[&subject],
                    &policies_by_ns,
                    &mut resolver,
                    &identities,
                    &mut alloc,
                    opts,
                );
                subjects.insert(subject, iso);
                iso
            }
        };
        let mut record = endpoint_record(pod, subject, ips, iso_in, iso_eg);
        record.report_new = opts.report_new;
        endpoints.insert(ep, record);
    }
    // ClusterNetworkPolicy tiers (see `tiers::compile`), per subject.
    let mut locals: Vec<(u32, &IdentityKey)> = subjects.keys().map(|s| (*s, &identities[s])).collect();
    locals.sort_by_key(|(s, _)| *s);
    let node_identities = alloc.tables.node_identities.clone();
    let nodes = crate::tiers::compile::TierFacts {
        identities: &node_identities,
        local: snapshot.nodes.get(&opts.node_name).map(|n| &n.labels),
        learned: &snapshot.domain_names,
    };
    out.tiers =
        crate::tiers::compile::compile_tiers(snapshot, &locals, &identities, &out.cidrs, &nodes, |r| alloc.rule(r));
    crate::tiers::compile::set_presence(&mut endpoints, &out.tiers);
    out.endpoints = endpoints;
    out.policy = policy.into();
    out.ids = alloc.tables;
    let peers = resolver
        .memo
        .into_iter()
        .map(|((ns, name, dir, i), set)| ((ns.to_string(), name.to_string(), dir, i), set))
        .collect();
    drop(resolver.by_namespace);
    out.ids.identities = identities;
    (out, peers)
}

/// Emits the entries of subject `subject` (identity key `key`): the union
/// of the rules of every policy selecting its pods, and the host egress
/// entry. Returns its isolation (ingress, egress).
// Eight arguments: the subject, the full compile's tables and allocator it
// borrows separately (a struct of them would borrow the compile whole).
#[allow(clippy::too_many_arguments)]
fn emit_subject<'a>(
    out: &mut BTreeMap<PolicyEntry, u32>,
    subject: u32,
    key: &IdentityKey,
    policies_by_ns: &HashMap<&str, Vec<&'a Policy>>,
    resolver: &mut Resolver<'a>,
    identities: &BTreeMap<u32, IdentityKey>,
    alloc: &mut Allocator,
    opts: &CompileOptions,
) -> (bool, bool) {
    let selecting: Vec<&Policy> = policies_by_ns
        .get(key.namespace.as_str())
        .into_iter()
        .flatten()
        .copied()
        .filter(|p| policy_selects_key(p, key))
        .collect();
    // Spec §1: "A pod is **isolated for ingress** when at least one
    // policy selects it and has `Ingress` in its effective
    // `policyTypes`. The same rule, with `Egress` [...]. The two are
    // independent".
    let iso_in = selecting.iter().any(|p| p.ingress_isolation);
    let iso_eg = selecting.iter().any(|p| p.egress_isolation);
    // "A pod that is isolated in a direction accepts only the
    // connections allowed by the **union** of the rules of every
    // policy that applies to it in that direction."
    for p in &selecting {
        for (dir, i, rule) in enforced_rules(p) {
            let peers = resolver.peers(p, dir, i, rule);
            if peers.is_empty() {
                continue;
            }
            let rid = alloc.rule(&RuleRef::Policy {
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                direction: dir,
                index: i,
            });
            emit_rule(out, subject, key, dir, rule, peers, identities, rid);
        }
    }
    if iso_eg && opts.allow_host_egress {
        let rid = alloc.rule(&RuleRef::HostEgress);
        out.insert(host_egress_entry(subject), rid);
    }
    (iso_in, iso_eg)
}
