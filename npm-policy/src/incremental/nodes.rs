//! Nodes in the incremental compiler: adding, replacing and removing a
//! Node recomputes the node identities and the node ipcache entries
//! wholesale (one pass over the Nodes, the rule of [`crate::nodes`]), then
//! the tier entries of the CNPs with a `nodes` peer (see `tiers`). A pod that gives up an
//! address a node lists hands it back to the node (`Compiler::release`).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use npm_common::IDENTITY_ANY;

use crate::compiled::{Compiled, IpEntry, NodeIdentity};
use crate::model::{Labels, Node};
use crate::nodes::NodeTable;
use crate::numbers::NumberKind;

use super::Compiler;

/// The node ipcache entries (node address -> node identity) wanted by
/// `table`, numbered by the node identities of `compiled`.
pub(super) fn node_entries(table: &NodeTable<'_>, compiled: &Compiled) -> BTreeMap<IpAddr, u32> {
    let by_labels: HashMap<&Labels, u32> = compiled
        .ids
        .node_identities
        .iter()
        .map(|(id, n)| (&n.labels, *id))
        .collect();
    table
        .addresses
        .iter()
        .filter_map(|(ip, n)| by_labels.get(&n.labels).map(|id| (*ip, *id)))
        .collect()
}

impl Compiler {
    /// Adds or replaces a Node (this node's too: its labels are matched by
    /// ClusterNetworkPolicy `nodes` peers).
    pub fn upsert_node(&mut self, node: Node) {
        self.snapshot.nodes.insert(node.name.clone(), node);
        self.refresh_nodes();
    }

    /// Removes a Node.
    pub fn remove_node(&mut self, name: &str) {
        if self.snapshot.nodes.remove(name).is_some() {
            self.refresh_nodes();
        }
    }

    /// Recomputes the node identities (kept by label set) and the node
    /// ipcache entries (a pod owning the address and this node's addresses
    /// win), then the tier entries.
    fn refresh_nodes(&mut self) {
        let table = NodeTable::new(&self.snapshot, &self.opts);
        let old_by_labels: HashMap<&Labels, u32> = self
            .out
            .ids
            .node_identities
            .iter()
            .map(|(id, n)| (&n.labels, *id))
            .collect();
        // The counters, apart from the tables borrowed above.
        let mut numbers = self.out.ids.floors();
        let mut ids: BTreeMap<u32, NodeIdentity> = BTreeMap::new();
        let mut id_of: HashMap<&Labels, u32> = HashMap::new();
        for (labels, names) in &table.groups {
            let id = match old_by_labels.get(labels) {
                Some(id) => *id,
                None => numbers.next_or_provisional(NumberKind::Identity),
            };
            ids.insert(
                id,
                NodeIdentity {
                    labels: (*labels).clone(),
                    nodes: names.clone(),
                },
            );
            id_of.insert(labels, id);
        }
        let entries: BTreeMap<IpAddr, u32> = table.addresses.iter().map(|(ip, n)| (*ip, id_of[&n.labels])).collect();
        drop(old_by_labels);
        drop(id_of);
        drop(table);
        // Node identities are never pod identities: an ipcache entry with
        // the old number is the node's own (not a pod's, not the host's).
        for (ip, id) in &self.node_entries {
            if entries.get(ip) != Some(id) && self.out.ipcache.get(ip).is_some_and(|e| e.identity == *id) {
                self.out.ipcache.remove(ip);
            }
        }
        for (ip, id) in &entries {
            if self.addresses.owner(*ip).is_none() && !self.opts.node_ips.contains(ip) {
                let cidr = self.lpm.longest(*ip).map_or(IDENTITY_ANY, |(_, c)| c);
                self.out.ipcache.insert(
                    *ip,
                    IpEntry {
                        identity: *id,
                        cidr_identity: cidr,
                        owner: 0,
                    },
                );
            }
        }
        self.out.ids.raise_to(&numbers);
        self.out.ids.node_identities = ids;
        self.node_entries = entries;
        self.tier_changes.nodes = true;
        self.refresh_tiers();
    }
}
