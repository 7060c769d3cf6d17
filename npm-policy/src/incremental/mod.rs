//! The incremental compiler: a [`Compiler`] holds the snapshot, the
//! compiled form and caches (address claims, pod identities with reference
//! counts, per-rule peer identity sets and the endpoints using them), and
//! updates only what a change touches. [`crate::compile()`] stays the
//! reference; tests check that both give the same tables.
//!
//! What a change touches:
//! - a pod: its addresses' ownership (and so the pods that win or lose
//!   them), its identity, its ipcache entries; identities that appear or
//!   disappear update the cached peer sets, and every local endpoint using a
//!   changed peer set, plus the pod itself when local, is re-emitted; a new
//!   identity also gets the entries of the egress rules with an empty `to`
//!   whose named ports it resolves (spec §5: resolved per destination pod);
//! - a namespace: the identities of its pods, as above;
//! - a Node: the node identities and node ipcache entries, wholesale
//!   (`nodes`), then the tier entries;
//! - a new policy: its entries are added in place to the local endpoints it
//!   selects (nothing else is re-emitted);
//! - a ClusterNetworkPolicy (and, when CNPs exist, any change): the tier
//!   entries of the endpoints the change touches are recomputed (`tiers`:
//!   the endpoints of the CNP's old and new subject and of the CNPs whose
//!   ranks moved; for a pod, namespace or Node change those of the CNPs
//!   whose peers see a changed identity, plus the changed endpoints); a
//!   change of the `networks` prefixes recomputes CIDR identities as for
//!   ipBlocks;
//! - a changed or removed policy: its rules' peer sets are dropped (a new
//!   rule with the same peers as an old one takes its set over, see
//!   `Rules::keep_spare`) and the local endpoints its old or new version
//!   selects are patched: only their entries towards the peers of the old
//!   or new version's rules are emitted again, from every rule of the
//!   endpoint (`patch_policy`; an egress rule with an empty `to` and a
//!   named port reaches every pod identity: that direction is emitted
//!   again whole); when the set of ipBlock prefixes changes (also for a
//!   new policy), CIDR identities of every address are recomputed, every
//!   rule with an ipBlock is resolved again and the endpoints using them
//!   are re-emitted.
//!
//! The state, each part with the one place that updates it:
//! - `addresses`: who claims and who owns each address
//!   ([`crate::ownership`]'s rule);
//! - `identities`: each pod's identity, reference counts, identities by key
//!   and by namespace (with the compiled identity table);
//! - `rules`: each rule's peer set, the rule ids, which endpoints use which
//!   rule;
//! - `endpoints`: each local endpoint's id and entries, and the emitting
//!   and patching of endpoints.

mod addresses;
mod endpoints;
mod identities;
mod nodes;
mod rules;
mod tiers;

#[cfg(test)]
mod tests;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use npm_common::{IDENTITY_ANY, IDENTITY_HOST};

use crate::compile::{cidr_prefixes, policy_selects_key};
use crate::compiled::{CompileOptions, Compiled, IpEntry};
use crate::identity::{identity_key, namespace_labels, pod_addresses, PrefixTable};
use crate::model::{Namespace, Peer, Pod, Policy, Snapshot};
use crate::numbers::NumberKind;
use crate::ownership::{Claims, PodKey};

use addresses::Addresses;
use endpoints::EndpointState;
use identities::PodIdentities;
use rules::{rule_of, Rules};

/// The union of two reaches (`None`: every peer).
fn union_reach(a: endpoints::Reach, b: endpoints::Reach) -> endpoints::Reach {
    let [ai, ae] = a;
    let [bi, be] = b;
    let union = |x: Option<Vec<u32>>, y: Option<Vec<u32>>| match (x, y) {
        (Some(mut x), Some(y)) => {
            if x != y {
                x.extend(y);
                x.sort_unstable();
                x.dedup();
            }
            Some(x)
        }
        _ => None,
    };
    [union(ai, bi), union(ae, be)]
}

/// An incremental compiler for one node.
#[derive(Clone, Debug)]
pub struct Compiler {
    opts: CompileOptions,
    snapshot: Snapshot,
    out: Compiled,
    lpm: PrefixTable,
    /// Who claims and who owns each address.
    addresses: Addresses,
    /// Pod identities.
    identities: PodIdentities,
    /// Peer sets, rule ids and rule users.
    rules: Rules,
    /// Local endpoint -> its id and subject.
    eps: HashMap<PodKey, EndpointState>,
    /// Subject (pod identity with local endpoints) -> its member
    /// endpoints; its entries are the compiled policy map's keyed by it.
    subjects: HashMap<u32, BTreeSet<PodKey>>,
    /// Node address -> node identity (before pod ownership; see
    /// `crate::nodes`).
    node_entries: BTreeMap<IpAddr, u32>,
    /// What changed since the tier entries were last brought up to date.
    tier_changes: tiers::TierChanges,
}

impl Compiler {
    /// Compiles `snapshot` (with [`crate::compile()`], keeping the ids of
    /// `prev`) and builds the caches.
    pub fn new(snapshot: Snapshot, opts: CompileOptions, prev: Option<&Compiled>) -> Compiler {
        let (out, peers) = crate::compile::compile_with_peers(&snapshot, &opts, prev);
        let addresses = Addresses::new(&snapshot, &opts.node_ips);
        let identities = PodIdentities::new(&out, &snapshot, &addresses);
        let node_entries = nodes::node_entries(&crate::nodes::NodeTable::new(&snapshot, &opts), &out);
        let eps: HashMap<PodKey, EndpointState> = out
            .endpoints
            .iter()
            .map(|(id, e)| {
                let st = EndpointState {
                    id: *id,
                    subject: e.identity,
                };
                (PodKey::new(e.pod.namespace.clone(), e.pod.name.clone()), st)
            })
            .collect();
        let mut subjects: HashMap<u32, BTreeSet<PodKey>> = HashMap::new();
        for (pk, st) in &eps {
            subjects.entry(st.subject).or_default().insert(pk.clone());
        }
        let mut c = Compiler {
            lpm: PrefixTable::new(&out.cidrs),
            addresses,
            identities,
            rules: Rules::new(&out),
            eps,
            subjects,
            node_entries,
            tier_changes: Default::default(),
            opts,
            snapshot,
            out,
        };
        // The entries are compile's; the peer caches and rule users are
        // what re-emitting every endpoint would record.
        c.adopt(peers);
        c.refresh_tiers();
        c
    }

    /// The compiled form.
    pub fn compiled(&self) -> &Compiled {
        &self.out
    }

    /// The snapshot.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// Takes the compiler apart: its snapshot and compiled form (to update
    /// the snapshot and build a new compiler from it, keeping the ids,
    /// without a copy of either).
    pub fn into_parts(self) -> (Snapshot, Compiled) {
        (self.snapshot, self.out)
    }

    /// The options.
    pub fn options(&self) -> &CompileOptions {
        &self.opts
    }

    /// The claims on addresses of the snapshot's pods (its IP conflicts are
    /// [`Claims::conflicts`]).
    pub fn claims(&self) -> &Claims {
        self.addresses.claims()
    }

    /// The copies of pod `key`'s key held by the claims, the owners and
    /// the identities (tests: one copy is shared by all three).
    #[cfg(test)]
    pub(crate) fn key_copies(&self, key: &(String, String)) -> Vec<&PodKey> {
        let mut copies: Vec<&PodKey> = Vec::new();
        for (ip, claimants) in self.addresses.claims().claimants() {
            if let Some(k) = claimants.iter().find(|k| ***k == *key) {
                copies.push(k);
                copies.extend(self.addresses.owner(ip).filter(|o| ***o == *key));
            }
        }
        copies.extend(self.identities.key_of(key));
        copies
    }

    /// Adds or replaces a pod.
    pub fn upsert_pod(&mut self, pod: Pod) {
        let key = PodKey::new(pod.namespace.clone(), pod.name.clone());
        self.set_pod(key, Some(pod));
    }

    /// Removes a pod.
    pub fn remove_pod(&mut self, namespace: &str, name: &str) {
        self.set_pod(PodKey::new(namespace, name), None);
    }

    fn set_pod(&mut self, key: PodKey, pod: Option<Pod>) {
        let mut touched: BTreeSet<PodKey> = [key.clone()].into();
        // Unregister the old pod before replacing it.
        self.release(&touched);
        let old = match pod {
            Some(p) => self.snapshot.pods.insert((*key).clone(), p),
            None => self.snapshot.pods.remove(&*key),
        };
        let others = self.addresses.update(&key, old.as_ref(), &self.snapshot.pods);
        self.release(&others);
        touched.extend(others);
        self.acquire(touched);
        self.refresh_tiers();
    }

    /// Removes the identities and ipcache entries of `pods` (first half of
    /// a refresh).
    fn release(&mut self, pods: &BTreeSet<PodKey>) {
        for pk in pods {
            self.identities.release(pk);
            if let Some(pod) = self.snapshot.pods.get(&**pk) {
                for ip in pod_addresses(pod) {
                    if self.out.ipcache.get(&ip).is_some_and(|e| e.identity != IDENTITY_HOST)
                        && self.addresses.owner(ip).is_none_or(|o| o == pk)
                    {
                        self.out.ipcache.remove(&ip);
                        // A node listing the address gets it back (the pod
                        // takes it again in `acquire` if it still owns it).
                        if let Some(id) = self.node_entries.get(&ip) {
                            let cidr = self.lpm.longest(ip).map_or(IDENTITY_ANY, |(_, c)| c);
                            self.out.ipcache.insert(
                                ip,
                                IpEntry {
                                    identity: *id,
                                    cidr_identity: cidr,
                                    owner: 0,
                                },
                            );
                        }
                    }
                }
            }
        }
    }

    /// Gives `pods` their identities and ipcache entries (second half of a
    /// refresh) and re-emits what changed.
    fn acquire(&mut self, pods: BTreeSet<PodKey>) {
        let mut dirty: BTreeSet<PodKey> = BTreeSet::new();
        for pk in &pods {
            dirty.insert(pk.clone());
            let Some(pod) = self.snapshot.pods.get(&**pk) else {
                continue;
            };
            let owned: Vec<IpAddr> = self.addresses.owned(pk, pod);
            if owned.is_empty() {
                continue;
            }
            let key = identity_key(pod, namespace_labels(&self.snapshot, &pod.namespace));
            let owner = IpEntry::pod_owner(&pod.uid);
            let id = match self.identities.get(&key, &self.out.ids.identities) {
                Some(id) => id,
                None => {
                    let id = self.out.ids.next_or_provisional(NumberKind::Identity);
                    self.add_identity(id, key);
                    id
                }
            };
            // The owner's key: the copy the claims hold, not another.
            let shared = self.addresses.owner(owned[0]).unwrap_or(pk).clone();
            self.identities.assign(shared, id);
            for ip in owned {
                let cidr = self.lpm.longest(ip).map_or(IDENTITY_ANY, |(_, c)| c);
                self.out.ipcache.insert(
                    ip,
                    IpEntry {
                        identity: id,
                        cidr_identity: cidr,
                        owner,
                    },
                );
            }
        }
        for id in self.identities.take_orphans() {
            self.drop_identity(id);
        }
        // A pod or namespace change that changes what a CNP's subject or
        // named port sees gives the pods a new identity: a new subject,
        // whose tier entries `emit` has `refresh_tiers` compute.
        self.emit(dirty);
    }

    /// Adds or replaces a namespace.
    pub fn upsert_namespace(&mut self, ns: Namespace) {
        let name = ns.name.clone();
        self.snapshot.namespaces.insert(name.clone(), ns);
        self.refresh_namespace(&name);
    }

    /// Removes a namespace (its pods stay until removed, like watch events).
    pub fn remove_namespace(&mut self, name: &str) {
        self.snapshot.namespaces.remove(name);
        self.refresh_namespace(name);
    }

    fn refresh_namespace(&mut self, name: &str) {
        let lo = (name.to_string(), String::new());
        let pods: BTreeSet<PodKey> = self
            .snapshot
            .pods
            .range(lo..)
            .take_while(|(k, _)| k.0 == name)
            .map(|(k, _)| PodKey::from(k))
            .collect();
        self.release(&pods);
        self.acquire(pods);
        self.refresh_tiers();
    }

    /// Adds or replaces a (validated) policy.
    pub fn upsert_policy(&mut self, policy: Policy) {
        let key = (policy.namespace.clone(), policy.name.clone());
        self.set_policy(key, Some(policy));
    }

    /// Converts an API NetworkPolicy and adds or replaces it. One that is
    /// not fully understood is added without the parts that cannot be
    /// understood (it keeps isolating the pods it selects; see
    /// [`crate::validate`]); its report is recorded in the snapshot's
    /// `invalid_policies` and returned as the error.
    pub fn apply_policy(
        &mut self,
        np: &k8s_openapi::api::networking::v1::NetworkPolicy,
    ) -> Result<(), crate::model::InvalidPolicy> {
        let c = crate::validate::convert_policy(np);
        let invalid = c.invalid();
        // Replaces the policy and forgets its earlier report.
        self.upsert_policy(c.policy);
        match invalid {
            None => Ok(()),
            Some(e) => {
                self.snapshot.invalid_policies.push(e.clone());
                Err(e)
            }
        }
    }

    /// Removes a policy.
    pub fn remove_policy(&mut self, namespace: &str, name: &str) {
        self.set_policy((namespace.to_string(), name.to_string()), None);
    }

    fn set_policy(&mut self, key: (String, String), policy: Option<Policy>) {
        // Where the old version's entries are (before its peer sets go).
        let old_reach = match self.snapshot.policies.get(&key).cloned() {
            Some(old) => {
                let reach = self.reach(&old);
                self.rules.keep_spare(&old);
                reach
            }
            None => endpoints::no_reach(),
        };
        // Its cached rules go; their users are patched (or re-emitted).
        let mut dirty: BTreeSet<u32> = self.rules.drop_rules(|rk| rk.0 == key.0 && rk.1 == key.1);
        self.rules.forget_policy(&key, &mut self.out.ids);
        self.snapshot
            .invalid_policies
            .retain(|p| !(p.namespace == key.0 && p.name == key.1));
        let existed = self.snapshot.policies.contains_key(&key);
        // The CIDR prefixes are those of every policy's ipBlocks (and of the
        // ClusterNetworkPolicies, which refresh them on their own changes):
        // they can change only when the old or new version has an ipBlock.
        let has_block = |p: &Policy| {
            p.ingress
                .iter()
                .chain(&p.egress)
                .any(|r| r.peers.iter().any(|x| matches!(x, Peer::IpBlock(_))))
        };
        let blocks = self.snapshot.policies.get(&key).is_some_and(has_block) || policy.as_ref().is_some_and(has_block);
        // The subjects the old version selected (a policy without rules
        // has no rule users but isolates them).
        dirty.extend(self.selected_by(&key));
        match policy {
            Some(p) => self.snapshot.policies.insert(key.clone(), p),
            None => self.snapshot.policies.remove(&key),
        };
        // The subjects the old version selected use its rules (in `dirty`
        // already); of the others only those the new version selects
        // change.
        let selected = self.selected_by(&key);
        let prefixes_changed = match blocks.then(|| self.refresh_prefixes()).flatten() {
            Some(users) => {
                dirty.extend(users);
                true
            }
            None => false,
        };
        if !existed && !prefixes_changed && dirty.is_empty() {
            // A new policy: its entries are added to the subjects it
            // selects, the others stay as they are.
            self.add_policy(&key, selected);
        } else if !prefixes_changed {
            // A changed or removed policy: the entries towards the peers
            // of its old or new version are patched on the subjects
            // either selects.
            let new_reach = match self.snapshot.policies.get(&key).cloned() {
                Some(new) => self.reach(&new),
                None => endpoints::no_reach(),
            };
            let reach = union_reach(old_reach, new_reach);
            dirty.extend(selected);
            self.patch_policy(&key, dirty, &reach);
        } else {
            dirty.extend(selected);
            self.emit_subjects(dirty);
        }
        self.rules.clear_spare();
        self.refresh_tiers();
    }

    /// Recomputes the CIDR identities when the set of prefixes (ipBlocks
    /// and ClusterNetworkPolicy `networks`) changed: every address's CIDR
    /// identity, and the peer sets of every rule with an ipBlock are
    /// dropped. Returns the subjects that used those rules, `None` when
    /// the prefixes did not change.
    fn refresh_prefixes(&mut self) -> Option<BTreeSet<u32>> {
        let prefixes = cidr_prefixes(&self.snapshot);
        if prefixes.iter().eq(self.out.cidrs.keys()) {
            return None;
        }
        {
            let mut cidrs = BTreeMap::new();
            for net in prefixes {
                let id = match self.out.cidrs.get(&net) {
                    Some(id) => *id,
                    None => self.out.ids.next_or_provisional(NumberKind::Cidr),
                };
                cidrs.insert(net, id);
            }
            self.out.cidrs = cidrs;
            self.tier_changes.cidrs = true;
            self.lpm = PrefixTable::new(&self.out.cidrs);
            for (ip, e) in self.out.ipcache.iter_mut() {
                e.cidr_identity = self.lpm.longest(*ip).map_or(IDENTITY_ANY, |(_, c)| c);
            }
            let policies = &self.snapshot.policies;
            Some(self.rules.drop_rules(|rk| {
                policies
                    .get(&(rk.0.clone(), rk.1.clone()))
                    .and_then(|p| rule_of(p, rk))
                    .is_some_and(|r| r.peers.iter().any(|x| matches!(x, Peer::IpBlock(_))))
            }))
        }
    }

    /// The subjects that policy `key` (of the snapshot) selects.
    fn selected_by(&self, key: &(String, String)) -> BTreeSet<u32> {
        let Some(p) = self.snapshot.policies.get(key) else {
            return BTreeSet::new();
        };
        let ids = &self.out.ids.identities;
        self.subjects
            .keys()
            .filter(|s| ids.get(*s).is_some_and(|k| policy_selects_key(p, k)))
            .copied()
            .collect()
    }
}
