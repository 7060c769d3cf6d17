//! ClusterNetworkPolicies in the incremental compiler: adding, replacing
//! and removing one, and the wholesale recomputation of the tier entries
//! (the same function as the full compile, `tiers::compile`) after every
//! change while CNPs exist. With no CNP and no tier entry it costs nothing.

use std::collections::BTreeSet;

use crate::model::{InvalidPolicy, Pod};
use crate::ownership::PodKey;
use crate::tiers::compile::{compile_tiers, set_presence, TierNodes};
use crate::tiers::{convert_cluster_policy, ClusterNetworkPolicy, ClusterPolicy};

use super::Compiler;

impl Compiler {
    /// Adds or replaces a (converted) ClusterNetworkPolicy.
    pub fn upsert_cluster_policy(&mut self, policy: ClusterPolicy) {
        self.set_cluster_policy(policy.name.clone(), Some(policy), None);
    }

    /// Converts an API ClusterNetworkPolicy and adds or replaces it. One
    /// that is not fully understood is added as the conversion makes it
    /// (failing closed, see [`crate::tiers::validate`]); its report is
    /// recorded in the snapshot's `invalid_cluster_policies` and returned
    /// as the error.
    pub fn apply_cluster_policy(&mut self, cnp: &ClusterNetworkPolicy) -> Result<(), InvalidPolicy> {
        let c = convert_cluster_policy(cnp);
        let invalid = c.invalid();
        self.set_cluster_policy(c.policy.name.clone(), Some(c.policy), invalid.clone());
        match invalid {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Removes a ClusterNetworkPolicy.
    pub fn remove_cluster_policy(&mut self, name: &str) {
        self.set_cluster_policy(name.to_string(), None, None);
    }

    fn set_cluster_policy(&mut self, name: String, policy: Option<ClusterPolicy>, invalid: Option<InvalidPolicy>) {
        self.rules.forget_cluster(&name, &mut self.out.ids);
        match policy {
            Some(p) => self.snapshot.insert_cluster_policy(p, invalid),
            None => {
                self.snapshot.remove_cluster_policy(&name);
            }
        }
        if let Some(users) = self.refresh_prefixes() {
            // New CIDR identities: the NetworkPolicy entries of the ipBlock
            // rules change too.
            let dirty: BTreeSet<PodKey> = users;
            self.emit(dirty);
        }
        self.refresh_tiers();
    }

    /// Recomputes every tier entry and every endpoint's tier presence.
    pub(super) fn refresh_tiers(&mut self) {
        if self.snapshot.cluster_policies.is_empty() && self.out.tiers.is_empty() {
            return;
        }
        let mut locals: Vec<(u32, &Pod)> = self
            .eps
            .iter()
            .filter_map(|(pk, st)| self.snapshot.pods.get(pk).map(|p| (st.id, p)))
            .collect();
        locals.sort_by_key(|(id, _)| *id);
        // The identity table is read while rule ids are handed out.
        let identities = std::mem::take(&mut self.out.ids.identities);
        let node_identities = std::mem::take(&mut self.out.ids.node_identities);
        let nodes = TierNodes {
            identities: &node_identities,
            local: self.snapshot.nodes.get(&self.opts.node_name).map(|n| &n.labels),
        };
        let (rules, ids) = (&mut self.rules, &mut self.out.ids);
        let tiers = compile_tiers(&self.snapshot, &locals, &identities, &self.out.cidrs, &nodes, |r| {
            rules.rule_id(r.clone(), ids)
        });
        self.out.ids.identities = identities;
        self.out.ids.node_identities = node_identities;
        self.out.tiers = tiers;
        set_presence(&mut self.out.endpoints, &self.out.tiers);
    }
}
