//! The local endpoints of the incremental compiler: re-emitting an
//! endpoint's record and policy entries, and patching the entries in place
//! when a policy is added or an identity appears or goes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::compile::{
    emit_named_egress_to, emit_rule, endpoint_record, enforced_rules, host_egress_entry, policy_selects,
};
use crate::compiled::{IdentityKey, PolicyEntry, RuleRef};
use crate::model::Policy;
use crate::ownership::PodKey;
use crate::peers::PeerSet;

use super::rules::{rule_of, RuleKey};
use super::Compiler;

/// A local endpoint: its id and the policy entries it put in the compiled
/// policy map (entries it shares with another endpoint's rule are listed
/// by the first one).
#[derive(Clone, Debug)]
pub(super) struct EndpointState {
    /// Endpoint id.
    pub(super) id: u32,
    /// Its entries.
    entries: Vec<PolicyEntry>,
}

impl EndpointState {
    /// An endpoint of a full compile, before its entries are emitted.
    pub(super) fn new(id: u32) -> EndpointState {
        EndpointState {
            id,
            entries: Vec::new(),
        }
    }
}

/// Adds `new` entries to the compiled policy map; an entry already there
/// keeps the lower rule id, a new one is also recorded in the endpoint's
/// `owned` list.
fn merge_entries(
    policy: &mut BTreeMap<PolicyEntry, u32>,
    owned: &mut Vec<PolicyEntry>,
    new: BTreeMap<PolicyEntry, u32>,
) {
    for (e, r) in new {
        match policy.get_mut(&e) {
            Some(cur) => *cur = (*cur).min(r),
            None => {
                policy.insert(e, r);
                owned.push(e);
            }
        }
    }
}

impl Compiler {
    /// The memoized peer set of rule `rk` of `policy` and its rule id;
    /// `None` when the rule matches no peer and emits nothing.
    fn rule_peers(&mut self, policy: &Policy, rk: &RuleKey) -> Option<(PeerSet, u32)> {
        let groups = self.identities.groups(&self.out.ids.identities);
        let peers = self.rules.peers(policy, rk, &groups, &self.out.cidrs)?;
        let rid = self.rules.rule_key_id(rk, &mut self.out.ids);
        Some((peers, rid))
    }

    /// The endpoint id of `uid`, whose endpoint had id `old`: kept when it
    /// is the same pod; a different pod (uid) under the same name gets a
    /// new endpoint id.
    fn endpoint_id(&mut self, old: Option<u32>, uid: &str) -> u32 {
        let ids = &mut self.out.ids;
        match old {
            Some(ep) if ids.endpoints.get(uid) == Some(&ep) => ep,
            other => {
                if let Some(ep) = other {
                    ids.endpoints.retain(|_, v| *v != ep);
                }
                match ids.endpoints.get(uid) {
                    Some(ep) => *ep,
                    None => {
                        let ep = ids.next_endpoint;
                        ids.next_endpoint += 1;
                        ids.endpoints.insert(uid.to_string(), ep);
                        ep
                    }
                }
            }
        }
    }

    /// Re-emits the entries and endpoint records of `dirty`.
    pub(super) fn emit(&mut self, dirty: BTreeSet<PodKey>) {
        for pk in dirty {
            // Remove what the endpoint had.
            let old = self.eps.remove(&pk);
            self.rules.remove_user(&pk);
            if let Some(old) = &old {
                for e in &old.entries {
                    self.out.policy.remove(e);
                }
                self.out.endpoints.remove(&old.id);
            }
            let pod = self
                .snapshot
                .pods
                .get(&pk)
                .filter(|p| p.node_name.as_deref() == Some(self.opts.node_name.as_str()));
            let owned: Vec<IpAddr> = pod.map(|p| self.addresses.owned(&pk, p)).unwrap_or_default();
            let (Some(pod), false) = (pod, owned.is_empty()) else {
                if let Some(old) = old {
                    self.out.ids.endpoints.retain(|_, v| *v != old.id);
                    // Its tier entries go.
                    self.tier_changes.endpoints.insert(old.id);
                }
                continue;
            };
            let pod = pod.clone();
            let old_id = old.map(|o| o.id);
            let ep = self.endpoint_id(old_id, &pod.uid);
            if old_id != Some(ep) {
                // A new endpoint (or a new id): tier entries of its own.
                self.tier_changes.endpoints.extend(old_id);
                self.tier_changes.endpoints.insert(ep);
            }
            let lo = (pod.namespace.clone(), String::new());
            let selecting: Vec<Policy> = self
                .snapshot
                .policies
                .range(lo..)
                .take_while(|((ns, _), _)| *ns == pod.namespace)
                .map(|(_, p)| p)
                .filter(|p| policy_selects(p, &pod))
                .cloned()
                .collect();
            let iso_in = selecting.iter().any(|p| p.ingress_isolation);
            let iso_eg = selecting.iter().any(|p| p.egress_isolation);
            let mut entries = BTreeMap::new();
            for p in &selecting {
                for (dir, i, rule) in enforced_rules(p) {
                    let rk: RuleKey = (p.namespace.clone(), p.name.clone(), dir, i);
                    self.rules.add_user(&rk, &pk);
                    let Some((peers, rid)) = self.rule_peers(p, &rk) else {
                        continue;
                    };
                    emit_rule(&mut entries, ep, &pod, dir, rule, &peers, &self.out.ids.identities, rid);
                }
            }
            if iso_eg && self.opts.allow_host_egress {
                let rid = self.rules.rule_id(RuleRef::HostEgress, &mut self.out.ids);
                entries.insert(host_egress_entry(ep), rid);
            }
            let keys: Vec<PolicyEntry> = entries.keys().copied().collect();
            self.out.policy.extend(entries);
            let identity = self.identities.of_pod(&pk);
            let mut record = endpoint_record(&pod, identity, &owned, iso_in, iso_eg);
            // Its tier entries are not re-emitted here (see `tiers`).
            Self::restore_presence(&self.out.tiers, ep, &mut record);
            self.out.endpoints.insert(ep, record);
            self.eps.insert(pk, EndpointState { id: ep, entries: keys });
        }
    }

    /// Adds the entries of the new policy `key` to the local endpoints
    /// `eps` it selects (patched in place; the same entries as a re-emit,
    /// since an endpoint's entries are the union of its rules' entries, each
    /// with the smallest rule id producing it).
    pub(super) fn add_policy(&mut self, key: &(String, String), eps: BTreeSet<PodKey>) {
        if eps.is_empty() {
            return;
        }
        let policy = self.snapshot.policies[key].clone();
        for (dir, i, rule) in enforced_rules(&policy) {
            let rk: RuleKey = (policy.namespace.clone(), policy.name.clone(), dir, i);
            for pk in &eps {
                self.rules.add_user(&rk, pk);
            }
            let Some((peers, rid)) = self.rule_peers(&policy, &rk) else {
                continue;
            };
            for pk in &eps {
                let (Some(ep), Some(pod)) = (self.eps.get_mut(pk), self.snapshot.pods.get(pk)) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_rule(&mut tmp, ep.id, pod, dir, rule, &peers, &self.out.ids.identities, rid);
                merge_entries(&mut self.out.policy, &mut ep.entries, tmp);
            }
        }
        for pk in &eps {
            let Some(ep) = self.eps.get(pk).map(|e| e.id) else {
                continue;
            };
            let Some(rec) = self.out.endpoints.get_mut(&ep) else {
                continue;
            };
            rec.isolated_ingress |= policy.ingress_isolation;
            rec.isolated_egress |= policy.egress_isolation;
            if rec.isolated_egress && self.opts.allow_host_egress {
                // As in `emit`: the host entry is set after the rules'.
                let rid = self.rules.rule_id(RuleRef::HostEgress, &mut self.out.ids);
                let e = host_egress_entry(ep);
                if self.out.policy.insert(e, rid).is_none() {
                    if let Some(state) = self.eps.get_mut(pk) {
                        state.entries.push(e);
                    }
                }
            }
        }
    }

    /// Registers a new identity and adds its entries to the endpoints whose
    /// rules select it (patched in place).
    pub(super) fn add_identity(&mut self, id: u32, key: IdentityKey) {
        self.identities.register(id, key.clone(), &mut self.out.ids.identities);
        self.tier_changes.identities.push((id, key.clone()));
        let (matched, any_named) = self.rules.add_identity(id, &key, &self.snapshot);
        for rk in any_named {
            let users = self.rules.users(&rk);
            if users.is_empty() {
                continue;
            }
            let policy = &self.snapshot.policies[&(rk.0.clone(), rk.1.clone())];
            let rule = policy.egress[rk.3].clone();
            let rid = self.rules.rule_key_id(&rk, &mut self.out.ids);
            for pk in users {
                let Some(ep) = self.eps.get_mut(&pk) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_named_egress_to(&mut tmp, ep.id, &rule, id, &key, rid);
                merge_entries(&mut self.out.policy, &mut ep.entries, tmp);
            }
        }
        let only = PeerSet {
            pods: [id].into(),
            other: BTreeSet::new(),
        };
        for rk in matched {
            let users = self.rules.users(&rk);
            if users.is_empty() {
                continue;
            }
            let policy = self.snapshot.policies[&(rk.0.clone(), rk.1.clone())].clone();
            let rule = rule_of(&policy, &rk).expect("a matched rule");
            let rid = self.rules.rule_key_id(&rk, &mut self.out.ids);
            for pk in users {
                let Some(ep) = self.eps.get_mut(&pk) else {
                    continue;
                };
                let Some(pod) = self.snapshot.pods.get(&pk) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_rule(&mut tmp, ep.id, pod, rk.2, rule, &only, &self.out.ids.identities, rid);
                merge_entries(&mut self.out.policy, &mut ep.entries, tmp);
            }
        }
    }

    /// Forgets an identity: its entries go from every endpoint (patched in
    /// place, not re-emitted).
    pub(super) fn drop_identity(&mut self, id: u32) {
        if let Some(key) = self.out.ids.identities.get(&id) {
            self.tier_changes.identities.push((id, key.clone()));
        }
        self.identities.forget(id, &mut self.out.ids.identities);
        self.rules.drop_identity(id);
        let policy = &mut self.out.policy;
        for ep in self.eps.values_mut() {
            ep.entries.retain(|e| {
                if e.peer == id {
                    policy.remove(e);
                    false
                } else {
                    true
                }
            });
        }
    }
}
