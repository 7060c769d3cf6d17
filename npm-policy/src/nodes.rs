//! Other nodes' addresses: which Node an address
//! belongs to and the node identities, the one rule both compilers and the
//! reference evaluator use.
//!
//! The rule:
//! - this node (`CompileOptions::node_name`) is never a node identity: its
//!   addresses are `CompileOptions::node_ips` (from netlink) with
//!   `IDENTITY_HOST`; its Node object only lends its labels to a
//!   ClusterNetworkPolicy `nodes` peer (which then matches `IDENTITY_HOST`);
//! - every address (InternalIP, ExternalIP) of every other Node is a node
//!   address, except one of this node's `node_ips` (the host wins);
//! - two other nodes listing the same address: the first by name owns it
//!   (deterministic; the API does not allow it on a sane cluster);
//! - a pod owning an address wins over a node listing it (hostNetwork pods
//!   never own one: their address is their node's, so a node address only
//!   collides with a pod address on a misconfigured cluster; the pod wins
//!   so that pod policy never silently stops applying to a pod);
//! - other nodes with equal labels share one node identity, numbered from
//!   the pod identity space (`IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR`),
//!   kept across recompiles by label set ([`crate::compiled::IdTables::node_identities`])
//!   and adopted on restart like pod identities ([`crate::adopt`]). A
//!   node identity exists while some other node with those labels has an
//!   address (shadowed by a pod or not).
//!
//! What selects node addresses: NetworkPolicy `ipBlock` only (spec: node
//! traffic is selected by ipBlock; `podSelector`/`namespaceSelector`
//! never match them: they select pod identities only); ClusterNetworkPolicy
//! `networks` (by CIDR) and `nodes` (by node labels); an empty peer list
//! (`IDENTITY_ANY`).

use std::collections::BTreeMap;
use std::net::IpAddr;

use crate::compiled::CompileOptions;
use crate::model::{Labels, Node, Snapshot};

/// The other nodes' addresses and label groups of a snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeTable<'a> {
    /// Node address -> the node owning it (before pod ownership).
    pub addresses: BTreeMap<IpAddr, &'a Node>,
    /// Label set -> the names of the other nodes with it and at least one
    /// node address, sorted.
    pub groups: BTreeMap<&'a Labels, Vec<String>>,
}

impl<'a> NodeTable<'a> {
    /// The node addresses and groups of `snapshot` seen from `opts.node_name`.
    pub fn new(snapshot: &'a Snapshot, opts: &CompileOptions) -> NodeTable<'a> {
        let mut t = NodeTable::default();
        for node in snapshot.nodes.values() {
            if node.name == opts.node_name {
                continue;
            }
            let mut any = false;
            for ip in &node.addresses {
                if opts.node_ips.contains(ip) {
                    continue;
                }
                any = true;
                // Nodes come in name order: the first keeps a shared address.
                t.addresses.entry(*ip).or_insert(node);
            }
            if any {
                t.groups.entry(&node.labels).or_default().push(node.name.clone());
            }
        }
        t
    }
}

/// The labels of the node at `ip` for a `nodes` peer, ignoring pods (the
/// caller asks only when no pod owns `ip`): this node's labels for one of
/// `opts.node_ips` (when its Node object is known), another node's for one
/// of its addresses, else `None`.
pub fn node_labels_at<'a>(snapshot: &'a Snapshot, opts: &CompileOptions, ip: IpAddr) -> Option<&'a Labels> {
    if opts.node_ips.contains(&ip) {
        return snapshot.nodes.get(&opts.node_name).map(|n| &n.labels);
    }
    snapshot
        .nodes
        .values()
        .find(|n| n.name != opts.node_name && n.addresses.contains(&ip))
        .map(|n| &n.labels)
}

/// The name of the node owning `ip` as a node address (another node; see
/// the module rule, pods ignored).
pub fn node_name_at<'a>(snapshot: &'a Snapshot, opts: &CompileOptions, ip: IpAddr) -> Option<&'a str> {
    if opts.node_ips.contains(&ip) {
        return None;
    }
    snapshot
        .nodes
        .values()
        .find(|n| n.name != opts.node_name && n.addresses.contains(&ip))
        .map(|n| n.name.as_str())
}
