//! Peer resolution: the peers of one rule as identities ([`PeerSet`]),
//! shared by the full compiler ([`crate::compile()`]) and the incremental
//! compiler, which hold their pod identities differently
//! ([`IdentityGroups`]).

use std::collections::{BTreeMap, BTreeSet};

use ipnet::IpNet;
use npm_common::IDENTITY_ANY;

use crate::compile::block_allows_prefix;
use crate::compiled::IdentityKey;
use crate::model::{Peer, Policy, Rule, Selector};

/// The peers of one rule, resolved to identities.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct PeerSet {
    /// Pod identities (selected through pod/namespace selectors).
    pub(crate) pods: BTreeSet<u32>,
    /// CIDR identities (ipBlocks) and `IDENTITY_ANY` (no peers).
    pub(crate) other: BTreeSet<u32>,
}

impl PeerSet {
    /// True when the rule matches no peer (and emits nothing).
    pub(crate) fn is_empty(&self) -> bool {
        self.pods.is_empty() && self.other.is_empty()
    }
}

/// The pod identities of a compile, grouped by namespace (every identity of
/// a group has the namespace's labels).
pub(crate) trait IdentityGroups {
    /// The identities of pods in namespace `ns`.
    fn in_namespace(&self, ns: &str) -> impl Iterator<Item = (u32, &IdentityKey)>;
    /// Every namespace's identities.
    fn groups(&self) -> impl Iterator<Item = impl Iterator<Item = (u32, &IdentityKey)> + Clone>;
}

/// The identity groups of the namespaces whose labels `sel` matches.
fn matching_namespaces<'a>(
    ids: &'a impl IdentityGroups,
    sel: &'a Selector,
) -> impl Iterator<Item = impl Iterator<Item = (u32, &'a IdentityKey)>> {
    ids.groups()
        .filter(|g| g.clone().next().is_some_and(|(_, k)| sel.matches(&k.namespace_labels)))
}

/// Does `peer` of `policy` select the pods of identity `key`? The one
/// predicate of NetworkPolicy's pod and namespace peers: the full compile
/// ([`resolve`]) and the incremental compiler (an identity that appears)
/// both ask it. ipBlocks select CIDR identities, never a pod identity.
pub(crate) fn selects(policy: &Policy, peer: &Peer, key: &IdentityKey) -> bool {
    match peer {
        // "`podSelector` only | matching pods in the **policy's own namespace**"
        Peer::Pods(sel) => key.namespace == policy.namespace && sel.matches(&key.pod_labels),
        // "`namespaceSelector` only | **all** pods in namespaces whose
        // *namespace labels* match; `{}` = every namespace"
        Peer::Namespaces(sel) => sel.matches(&key.namespace_labels),
        // "both in **one** peer | pods matching podSelector **AND** in a
        // namespace matching namespaceSelector"
        Peer::PodsInNamespaces { namespaces, pods } => {
            namespaces.matches(&key.namespace_labels) && pods.matches(&key.pod_labels)
        }
        Peer::IpBlock(_) => false,
    }
}

/// Resolves the peers of `rule` of `policy` against the pod identities
/// `ids` and the CIDR identities `cidrs`.
pub(crate) fn resolve(
    policy: &Policy,
    rule: &Rule,
    ids: &impl IdentityGroups,
    cidrs: &BTreeMap<IpNet, u32>,
) -> PeerSet {
    let mut set = PeerSet::default();
    // Spec §3: "An empty or missing `from`/`to` matches all peers,
    // including any IP outside the cluster."
    if rule.peers.is_empty() {
        set.other.insert(IDENTITY_ANY);
        return set;
    }
    // Spec §3: "Inside a list, items are combined with OR".
    // Other nodes' addresses (node identities, `crate::nodes`): the spec
    // says node traffic is selected by ipBlock, so only `IpBlock` (through
    // the CIDR identity every node address carries) and an empty peer list
    // (`IDENTITY_ANY`) reach them; the selector forms below iterate pod
    // identities only (`ids` holds no node identity), so they never do.
    for peer in &rule.peers {
        // The pod and namespace forms: the identities [`selects`] takes,
        // among the groups that can hold them (the policy's namespace, or
        // the namespaces whose labels match: one selector match per
        // namespace instead of one per identity).
        match peer {
            Peer::Pods(_) => {
                let chosen = ids
                    .in_namespace(&policy.namespace)
                    .filter(|(_, k)| selects(policy, peer, k));
                set.pods.extend(chosen.map(|(id, _)| id));
            }
            Peer::Namespaces(sel) => {
                for g in matching_namespaces(ids, sel) {
                    set.pods.extend(g.map(|(id, _)| id));
                }
            }
            Peer::PodsInNamespaces { namespaces: sel, .. } => {
                for g in matching_namespaces(ids, sel) {
                    set.pods
                        .extend(g.filter(|(_, k)| selects(policy, peer, k)).map(|(id, _)| id));
                }
            }
            // "`ipBlock{cidr, except}` | source (ingress) or destination
            // (egress) IP inside `cidr` and not inside any `except`
            // entry"; "In practice it matches **any** address,
            // including pod IPs": pod IPs carry a CIDR identity too.
            Peer::IpBlock(b) => {
                for (net, id) in cidrs {
                    if block_allows_prefix(b, net) {
                        set.other.insert(*id);
                    }
                }
            }
        }
    }
    set
}
