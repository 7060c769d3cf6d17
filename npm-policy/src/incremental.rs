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
//! - a new policy: its entries are added in place to the local endpoints it
//!   selects (nothing else is re-emitted);
//! - a changed or removed policy: its rules' peer sets are dropped and the
//!   local endpoints its old or new version selects are re-emitted; when
//!   the set of ipBlock prefixes changes (also for a new policy),
//!   CIDR identities of every address are recomputed and every rule with an
//!   ipBlock is resolved again.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use npm_common::{IDENTITY_ANY, IDENTITY_HOST};

use crate::compile::{
    block_allows_prefix, cidr_prefixes, emit_named_egress_to, emit_rule, named_port_numbers, policy_selects, PeerSet,
    ALL_PORTS,
};
use crate::compiled::{
    CompileOptions, Compiled, Direction, Endpoint, IdentityKey, IpEntry, PodRef, PolicyEntry, RuleRef,
};
use crate::identity::{identity_key, is_addressable, namespace_labels, pod_addresses, PrefixTable};
use crate::model::{Namespace, Peer, Pod, PodPhase, Policy, PortSpec, Snapshot};

type PodKey = (String, String);
type RuleKey = (String, String, Direction, usize);

/// An incremental compiler for one node.
#[derive(Clone, Debug)]
pub struct Compiler {
    opts: CompileOptions,
    snapshot: Snapshot,
    out: Compiled,
    lpm: PrefixTable,
    /// Address -> pods claiming it (addressable pods only, no node addresses).
    claims: HashMap<IpAddr, BTreeSet<PodKey>>,
    /// Address -> owning pod.
    owner: HashMap<IpAddr, PodKey>,
    /// Pod -> its identity (pods owning an address).
    pod_id: HashMap<PodKey, u32>,
    id_refs: HashMap<u32, usize>,
    id_by_key: HashMap<IdentityKey, u32>,
    /// Namespace -> identities of its pods.
    by_ns: BTreeMap<String, BTreeSet<u32>>,
    memo: HashMap<RuleKey, PeerSet>,
    rule_users: HashMap<RuleKey, BTreeSet<PodKey>>,
    rule_by_ref: HashMap<RuleRef, u32>,
    /// Local endpoint -> (endpoint id, its entries, rules it uses).
    eps: HashMap<PodKey, (u32, Vec<PolicyEntry>, Vec<RuleKey>)>,
}

fn rank(pod: &Pod) -> (bool, i64, &str) {
    (
        pod.phase == PodPhase::Running && !pod.deleting,
        pod.created,
        pod.uid.as_str(),
    )
}

/// Does `peer` of `policy` select pods of identity `key`?
fn peer_selects(policy: &Policy, peer: &Peer, key: &IdentityKey) -> bool {
    match peer {
        Peer::Pods(sel) => key.namespace == policy.namespace && sel.matches(&key.pod_labels),
        Peer::Namespaces(sel) => sel.matches(&key.namespace_labels),
        Peer::PodsInNamespaces { namespaces, pods } => {
            namespaces.matches(&key.namespace_labels) && pods.matches(&key.pod_labels)
        }
        Peer::IpBlock(_) => false,
    }
}

impl Compiler {
    /// Compiles `snapshot` (with [`crate::compile()`], keeping the ids of
    /// `prev`) and builds the caches.
    pub fn new(snapshot: Snapshot, opts: CompileOptions, prev: Option<&Compiled>) -> Compiler {
        let out = crate::compile(&snapshot, &opts, prev);
        let mut c = Compiler {
            lpm: PrefixTable::new(&out.cidrs),
            claims: HashMap::new(),
            owner: HashMap::new(),
            pod_id: HashMap::new(),
            id_refs: HashMap::new(),
            id_by_key: out.ids.identities.iter().map(|(id, k)| (k.clone(), *id)).collect(),
            by_ns: BTreeMap::new(),
            memo: HashMap::new(),
            rule_users: HashMap::new(),
            rule_by_ref: out.ids.rules.iter().map(|(id, r)| (r.clone(), *id)).collect(),
            eps: HashMap::new(),
            opts,
            snapshot,
            out,
        };
        for (id, k) in &c.out.ids.identities {
            c.by_ns.entry(k.namespace.clone()).or_default().insert(*id);
        }
        let keys: Vec<PodKey> = c.snapshot.pods.keys().cloned().collect();
        for pk in &keys {
            let pod = &c.snapshot.pods[pk];
            if is_addressable(pod) {
                for ip in pod_addresses(pod).filter(|ip| !c.opts.node_ips.contains(ip)) {
                    c.claims.entry(ip).or_default().insert(pk.clone());
                }
            }
        }
        let ips: Vec<IpAddr> = c.claims.keys().copied().collect();
        for ip in ips {
            if let Some(w) = c.winner(ip) {
                c.owner.insert(ip, w);
            }
        }
        for pk in &keys {
            if let Some(ip) = pod_addresses(&c.snapshot.pods[pk]).find(|ip| c.owner.get(ip) == Some(pk)) {
                let id = c.out.ipcache[&ip].identity;
                c.pod_id.insert(pk.clone(), id);
                *c.id_refs.entry(id).or_default() += 1;
            }
        }
        for e in c.out.endpoints.clone().into_iter() {
            let pk = (e.1.pod.namespace.clone(), e.1.pod.name.clone());
            c.eps.insert(pk.clone(), (e.0, Vec::new(), Vec::new()));
        }
        // Re-emit every endpoint: fills the entry lists and peer caches
        // (the entries are the same as compile's).
        let all: BTreeSet<PodKey> = c.eps.keys().cloned().collect();
        c.out.policy.clear();
        c.emit(all);
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

    fn winner(&self, ip: IpAddr) -> Option<PodKey> {
        self.claims
            .get(&ip)?
            .iter()
            .max_by(|a, b| rank(&self.snapshot.pods[*a]).cmp(&rank(&self.snapshot.pods[*b])))
            .cloned()
    }

    fn claimed(&self, pod: Option<&Pod>) -> Vec<IpAddr> {
        pod.filter(|p| is_addressable(p))
            .map(|p| pod_addresses(p).filter(|ip| !self.opts.node_ips.contains(ip)).collect())
            .unwrap_or_default()
    }

    /// Adds or replaces a pod.
    pub fn upsert_pod(&mut self, pod: Pod) {
        let key = (pod.namespace.clone(), pod.name.clone());
        self.set_pod(key, Some(pod));
    }

    /// Removes a pod.
    pub fn remove_pod(&mut self, namespace: &str, name: &str) {
        self.set_pod((namespace.to_string(), name.to_string()), None);
    }

    fn set_pod(&mut self, key: PodKey, pod: Option<Pod>) {
        let old_ips = self.claimed(self.snapshot.pods.get(&key));
        let new_ips = self.claimed(pod.as_ref());
        let mut touched: BTreeSet<PodKey> = [key.clone()].into();
        // Unregister the old pod before replacing it.
        self.release(&touched);
        for ip in &old_ips {
            if let Some(set) = self.claims.get_mut(ip) {
                set.remove(&key);
                if set.is_empty() {
                    self.claims.remove(ip);
                }
            }
        }
        match pod {
            Some(p) => {
                self.snapshot.pods.insert(key.clone(), p);
            }
            None => {
                self.snapshot.pods.remove(&key);
            }
        }
        for ip in &new_ips {
            self.claims.entry(*ip).or_default().insert(key.clone());
        }
        let mut others = BTreeSet::new();
        for ip in old_ips.iter().chain(&new_ips) {
            let w = self.winner(*ip);
            let cur = self.owner.get(ip).cloned();
            if w != cur {
                others.extend(cur.clone().filter(|c| *c != key));
                others.extend(w.clone().filter(|c| *c != key));
            }
            match w {
                Some(w) => self.owner.insert(*ip, w),
                None => self.owner.remove(ip),
            };
        }
        self.release(&others);
        touched.extend(others);
        self.acquire(touched);
    }

    /// Removes the identities and ipcache entries of `pods` (first half of
    /// a refresh).
    fn release(&mut self, pods: &BTreeSet<PodKey>) {
        for pk in pods {
            // An identity left without pods is dropped only after the
            // refresh: a pod that comes back with the same key keeps it.
            if let Some(id) = self.pod_id.remove(pk) {
                let r = self.id_refs.get_mut(&id).expect("counted");
                *r -= 1;
            }
            if let Some(pod) = self.snapshot.pods.get(pk) {
                for ip in pod_addresses(pod) {
                    if self.out.ipcache.get(&ip).is_some_and(|e| e.identity != IDENTITY_HOST)
                        && self.owner.get(&ip).is_none_or(|o| o == pk)
                    {
                        self.out.ipcache.remove(&ip);
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
            let Some(pod) = self.snapshot.pods.get(pk) else {
                continue;
            };
            let owned: Vec<IpAddr> = pod_addresses(pod).filter(|ip| self.owner.get(ip) == Some(pk)).collect();
            if owned.is_empty() {
                continue;
            }
            let key = identity_key(pod, namespace_labels(&self.snapshot, &pod.namespace));
            let id = match self.id_by_key.get(&key) {
                Some(id) => *id,
                None => {
                    let id = self.out.ids.next_identity;
                    self.out.ids.next_identity += 1;
                    self.add_identity(id, key);
                    id
                }
            };
            *self.id_refs.entry(id).or_default() += 1;
            self.pod_id.insert(pk.clone(), id);
            for ip in owned {
                let cidr = self.lpm.longest(ip).map_or(IDENTITY_ANY, |(_, c)| c);
                self.out.ipcache.insert(
                    ip,
                    IpEntry {
                        identity: id,
                        cidr_identity: cidr,
                    },
                );
            }
        }
        let orphans: Vec<u32> = self
            .id_refs
            .iter()
            .filter(|(_, r)| **r == 0)
            .map(|(id, _)| *id)
            .collect();
        for id in orphans {
            self.id_refs.remove(&id);
            self.drop_identity(id);
        }
        self.emit(dirty);
    }

    /// Forgets an identity: its entries go from every endpoint (patched in
    /// place, not re-emitted).
    fn drop_identity(&mut self, id: u32) {
        if let Some(k) = self.out.ids.identities.remove(&id) {
            self.id_by_key.remove(&k);
            if let Some(s) = self.by_ns.get_mut(&k.namespace) {
                s.remove(&id);
                if s.is_empty() {
                    self.by_ns.remove(&k.namespace);
                }
            }
        }
        for set in self.memo.values_mut() {
            set.pods.remove(&id);
        }
        let policy = &mut self.out.policy;
        for (_, entries, _) in self.eps.values_mut() {
            entries.retain(|e| {
                if e.peer == id {
                    policy.remove(e);
                    false
                } else {
                    true
                }
            });
        }
    }

    /// Registers a new identity and adds its entries to the endpoints whose
    /// rules select it (patched in place).
    fn add_identity(&mut self, id: u32, key: IdentityKey) {
        self.by_ns.entry(key.namespace.clone()).or_default().insert(id);
        self.out.ids.identities.insert(id, key.clone());
        self.id_by_key.insert(key.clone(), id);
        let mut matched: Vec<RuleKey> = Vec::new();
        // Egress rules with an empty `to` and a named port: their entries
        // are per destination pod identity (see `emit_rule`), so a new
        // identity that resolves the name adds entries, although it is not
        // part of the rule's peer set.
        let mut any_named: Vec<RuleKey> = Vec::new();
        for (rk, set) in self.memo.iter_mut() {
            let Some(policy) = self.snapshot.policies.get(&(rk.0.clone(), rk.1.clone())) else {
                continue;
            };
            let rules = match rk.2 {
                Direction::Ingress => &policy.ingress,
                Direction::Egress => &policy.egress,
            };
            let Some(rule) = rules.get(rk.3) else { continue };
            if rule.peers.iter().any(|p| peer_selects(policy, p, &key)) {
                set.pods.insert(id);
                matched.push(rk.clone());
            } else if rk.2 == Direction::Egress
                && rule.peers.is_empty()
                && rule
                    .ports
                    .iter()
                    .any(|p| matches!(&p.port, PortSpec::Named(n) if named_port_numbers(&key, n, p.protocol).next().is_some()))
            {
                any_named.push(rk.clone());
            }
        }
        for rk in any_named {
            let users: Vec<PodKey> = self.rule_users.get(&rk).into_iter().flatten().cloned().collect();
            if users.is_empty() {
                continue;
            }
            let policy = &self.snapshot.policies[&(rk.0.clone(), rk.1.clone())];
            let rule = policy.egress[rk.3].clone();
            let rid = self.rule_key_id(&rk);
            for pk in users {
                let Some((ep, entries, _)) = self.eps.get_mut(&pk) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_named_egress_to(&mut tmp, *ep, &rule, id, &key, rid);
                merge_entries(&mut self.out.policy, entries, tmp);
            }
        }
        let only = PeerSet {
            pods: [id].into(),
            other: BTreeSet::new(),
        };
        for rk in matched {
            let users: Vec<PodKey> = self.rule_users.get(&rk).into_iter().flatten().cloned().collect();
            if users.is_empty() {
                continue;
            }
            let policy = self.snapshot.policies[&(rk.0.clone(), rk.1.clone())].clone();
            let rule = match rk.2 {
                Direction::Ingress => &policy.ingress[rk.3],
                Direction::Egress => &policy.egress[rk.3],
            };
            let rid = self.rule_key_id(&rk);
            for pk in users {
                let Some((ep, entries, _)) = self.eps.get_mut(&pk) else {
                    continue;
                };
                let Some(pod) = self.snapshot.pods.get(&pk) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_rule(&mut tmp, *ep, pod, rk.2, rule, &only, &self.out.ids.identities, rid);
                merge_entries(&mut self.out.policy, entries, tmp);
            }
        }
    }

    /// Resolves the peers of a rule against the current identities.
    fn resolve(&self, policy: &Policy, dir: Direction, index: usize) -> PeerSet {
        let rules = match dir {
            Direction::Ingress => &policy.ingress,
            Direction::Egress => &policy.egress,
        };
        let rule = &rules[index];
        let mut set = PeerSet::default();
        if rule.peers.is_empty() {
            set.other.insert(IDENTITY_ANY);
            return set;
        }
        let ids = &self.out.ids.identities;
        for peer in &rule.peers {
            match peer {
                Peer::IpBlock(b) => {
                    for (net, id) in &self.out.cidrs {
                        if block_allows_prefix(b, net) {
                            set.other.insert(*id);
                        }
                    }
                }
                Peer::Pods(_) => {
                    for id in self.by_ns.get(&policy.namespace).into_iter().flatten() {
                        if peer_selects(policy, peer, &ids[id]) {
                            set.pods.insert(*id);
                        }
                    }
                }
                Peer::Namespaces(sel) | Peer::PodsInNamespaces { namespaces: sel, .. } => {
                    for group in self.by_ns.values() {
                        let Some(first) = group.iter().next() else { continue };
                        if !sel.matches(&ids[first].namespace_labels) {
                            continue;
                        }
                        for id in group {
                            if peer_selects(policy, peer, &ids[id]) {
                                set.pods.insert(*id);
                            }
                        }
                    }
                }
            }
        }
        set
    }

    /// The memoized peer set of rule `rk` (resolved on first use) and its
    /// rule id; `None` when the rule matches no peer and emits nothing.
    fn rule_peers(&mut self, policy: &Policy, rk: RuleKey) -> Option<(PeerSet, u32)> {
        let (_, _, dir, index) = rk;
        let peers = match self.memo.get(&rk) {
            Some(set) => set,
            None => {
                let set = self.resolve(policy, dir, index);
                self.memo.entry(rk.clone()).or_insert(set)
            }
        };
        if peers.pods.is_empty() && peers.other.is_empty() {
            return None;
        }
        let peers = peers.clone();
        let rid = self.rule_key_id(&rk);
        Some((peers, rid))
    }

    /// The rule id of rule `rk` (`(namespace, name, direction, index)`).
    fn rule_key_id(&mut self, rk: &RuleKey) -> u32 {
        self.rule_id(RuleRef::Policy {
            namespace: rk.0.clone(),
            name: rk.1.clone(),
            direction: rk.2,
            index: rk.3,
        })
    }

    fn rule_id(&mut self, r: RuleRef) -> u32 {
        if let Some(id) = self.rule_by_ref.get(&r) {
            return *id;
        }
        let id = self.out.ids.next_rule;
        self.out.ids.next_rule += 1;
        self.out.ids.rules.insert(id, r.clone());
        self.rule_by_ref.insert(r, id);
        id
    }

    /// Re-emits the entries and endpoint records of `dirty`.
    fn emit(&mut self, dirty: BTreeSet<PodKey>) {
        for pk in dirty {
            // Remove what the endpoint had.
            let old = self.eps.remove(&pk);
            if let Some((ep, entries, rules)) = &old {
                for e in entries {
                    self.out.policy.remove(e);
                }
                for rk in rules {
                    if let Some(u) = self.rule_users.get_mut(rk) {
                        u.remove(&pk);
                    }
                }
                self.out.endpoints.remove(ep);
            }
            let pod = self
                .snapshot
                .pods
                .get(&pk)
                .filter(|p| p.node_name.as_deref() == Some(self.opts.node_name.as_str()));
            let owned: Vec<IpAddr> = pod
                .map(|p| pod_addresses(p).filter(|ip| self.owner.get(ip) == Some(&pk)).collect())
                .unwrap_or_default();
            let (Some(pod), false) = (pod, owned.is_empty()) else {
                if let Some((ep, _, _)) = old {
                    self.out.ids.endpoints.retain(|_, v| *v != ep);
                }
                continue;
            };
            let pod = pod.clone();
            // A different pod (uid) under the same name: a new endpoint id.
            let ep = match old {
                Some((ep, _, _)) if self.out.ids.endpoints.get(&pod.uid) == Some(&ep) => ep,
                other => {
                    if let Some((ep, _, _)) = other {
                        self.out.ids.endpoints.retain(|_, v| *v != ep);
                    }
                    match self.out.ids.endpoints.get(&pod.uid) {
                        Some(ep) => *ep,
                        None => {
                            let ep = self.out.ids.next_endpoint;
                            self.out.ids.next_endpoint += 1;
                            self.out.ids.endpoints.insert(pod.uid.clone(), ep);
                            ep
                        }
                    }
                }
            };
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
            let mut used = Vec::new();
            for p in &selecting {
                for (dir, on, rules) in [
                    (Direction::Ingress, p.ingress_isolation, &p.ingress),
                    (Direction::Egress, p.egress_isolation, &p.egress),
                ] {
                    if !on {
                        continue;
                    }
                    for (i, rule) in rules.iter().enumerate() {
                        let rk: RuleKey = (p.namespace.clone(), p.name.clone(), dir, i);
                        self.rule_users.entry(rk.clone()).or_default().insert(pk.clone());
                        used.push(rk.clone());
                        let Some((peers, rid)) = self.rule_peers(p, rk) else {
                            continue;
                        };
                        emit_rule(&mut entries, ep, &pod, dir, rule, &peers, &self.out.ids.identities, rid);
                    }
                }
            }
            if iso_eg && self.opts.allow_host_egress {
                let rid = self.rule_id(RuleRef::HostEgress);
                entries.insert(
                    PolicyEntry {
                        endpoint: ep,
                        direction: Direction::Egress,
                        peer: IDENTITY_HOST,
                        protocol: None,
                        ports: ALL_PORTS,
                    },
                    rid,
                );
            }
            let keys: Vec<PolicyEntry> = entries.keys().copied().collect();
            self.out.policy.extend(entries);
            self.out.endpoints.insert(
                ep,
                Endpoint {
                    pod: PodRef {
                        namespace: pod.namespace.clone(),
                        name: pod.name.clone(),
                        uid: pod.uid.clone(),
                    },
                    identity: self.pod_id[&pk],
                    ipv4: owned.iter().find_map(|i| match i {
                        IpAddr::V4(a) => Some(*a),
                        _ => None,
                    }),
                    ipv6: owned.iter().find_map(|i| match i {
                        IpAddr::V6(a) => Some(*a),
                        _ => None,
                    }),
                    isolated_ingress: iso_in,
                    isolated_egress: iso_eg,
                },
            );
            self.eps.insert(pk, (ep, keys, used));
        }
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
            .map(|(k, _)| k.clone())
            .collect();
        self.release(&pods);
        self.acquire(pods);
    }

    /// Adds or replaces a (validated) policy.
    pub fn upsert_policy(&mut self, policy: Policy) {
        let key = (policy.namespace.clone(), policy.name.clone());
        self.set_policy(key, Some(policy));
    }

    /// Validates an API NetworkPolicy and adds or replaces it; an invalid
    /// one replaces (stops enforcing) an earlier valid version and is
    /// recorded in the snapshot's `invalid_policies`.
    pub fn apply_policy(
        &mut self,
        np: &k8s_openapi::api::networking::v1::NetworkPolicy,
    ) -> Result<(), crate::model::InvalidPolicy> {
        match crate::validate::validate_policy(np) {
            Ok(p) => {
                self.upsert_policy(p);
                Ok(())
            }
            Err(e) => {
                self.remove_policy(&e.namespace, &e.name);
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
        let mut dirty: BTreeSet<PodKey> = BTreeSet::new();
        // Its cached rules go; their users and every local endpoint of the
        // namespace are re-emitted.
        let stale: Vec<RuleKey> = self
            .memo
            .keys()
            .filter(|rk| rk.0 == key.0 && rk.1 == key.1)
            .cloned()
            .collect();
        for rk in stale {
            self.memo.remove(&rk);
            dirty.extend(self.rule_users.remove(&rk).into_iter().flatten());
        }
        let old_ref = |r: &RuleRef, key: &(String, String)| matches!(r, RuleRef::Policy { namespace, name, .. } if *namespace == key.0 && *name == key.1);
        let gone: Vec<RuleRef> = self.rule_by_ref.keys().filter(|r| old_ref(r, &key)).cloned().collect();
        for r in gone {
            if let Some(id) = self.rule_by_ref.remove(&r) {
                self.out.ids.rules.remove(&id);
            }
        }
        self.snapshot
            .invalid_policies
            .retain(|p| !(p.namespace == key.0 && p.name == key.1));
        let existed = self.snapshot.policies.contains_key(&key);
        // The endpoints the old version selected (a policy without rules
        // has no rule users but isolates them).
        dirty.extend(self.selected_by(&key));
        match policy {
            Some(p) => self.snapshot.policies.insert(key.clone(), p),
            None => self.snapshot.policies.remove(&key),
        };
        // The endpoints the old version selected use its rules (in `dirty`
        // already); of the others only those the new version selects
        // change.
        let selected = self.selected_by(&key);
        let mut prefixes_changed = false;
        // ipBlock prefixes.
        let prefixes = cidr_prefixes(&self.snapshot);
        if prefixes.iter().ne(self.out.cidrs.keys()) {
            prefixes_changed = true;
            let mut cidrs = BTreeMap::new();
            for net in prefixes {
                let id = match self.out.cidrs.get(&net) {
                    Some(id) => *id,
                    None => {
                        let id = self.out.ids.next_cidr;
                        self.out.ids.next_cidr += 1;
                        id
                    }
                };
                cidrs.insert(net, id);
            }
            self.out.cidrs = cidrs;
            self.lpm = PrefixTable::new(&self.out.cidrs);
            for (ip, e) in self.out.ipcache.iter_mut() {
                e.cidr_identity = self.lpm.longest(*ip).map_or(IDENTITY_ANY, |(_, c)| c);
            }
            let blocks: Vec<RuleKey> = self
                .memo
                .keys()
                .filter(|rk| {
                    self.snapshot
                        .policies
                        .get(&(rk.0.clone(), rk.1.clone()))
                        .is_some_and(|p| {
                            let rules = if rk.2 == Direction::Ingress {
                                &p.ingress
                            } else {
                                &p.egress
                            };
                            rules
                                .get(rk.3)
                                .is_some_and(|r| r.peers.iter().any(|x| matches!(x, Peer::IpBlock(_))))
                        })
                })
                .cloned()
                .collect();
            for rk in blocks {
                self.memo.remove(&rk);
                dirty.extend(self.rule_users.remove(&rk).into_iter().flatten());
            }
        }
        if !existed && !prefixes_changed && dirty.is_empty() {
            // A new policy: its entries are added to the endpoints it
            // selects, the others stay as they are.
            self.add_policy(&key, selected);
        } else {
            dirty.extend(selected);
            self.emit(dirty);
        }
    }

    /// The local endpoints that policy `key` (of the snapshot) selects.
    fn selected_by(&self, key: &(String, String)) -> BTreeSet<PodKey> {
        let Some(p) = self.snapshot.policies.get(key) else {
            return BTreeSet::new();
        };
        self.eps
            .keys()
            .filter(|pk| pk.0 == key.0)
            .filter(|pk| self.snapshot.pods.get(*pk).is_some_and(|pod| policy_selects(p, pod)))
            .cloned()
            .collect()
    }

    /// Adds the entries of the new policy `key` to the local endpoints
    /// `eps` it selects (patched in place; the same entries as a re-emit,
    /// since an endpoint's entries are the union of its rules' entries, each
    /// with the smallest rule id producing it).
    fn add_policy(&mut self, key: &(String, String), eps: BTreeSet<PodKey>) {
        if eps.is_empty() {
            return;
        }
        let policy = self.snapshot.policies[key].clone();
        for (dir, on, rules) in [
            (Direction::Ingress, policy.ingress_isolation, &policy.ingress),
            (Direction::Egress, policy.egress_isolation, &policy.egress),
        ] {
            if !on {
                continue;
            }
            for (i, rule) in rules.iter().enumerate() {
                let rk: RuleKey = (policy.namespace.clone(), policy.name.clone(), dir, i);
                self.rule_users
                    .entry(rk.clone())
                    .or_default()
                    .extend(eps.iter().cloned());
                for pk in &eps {
                    if let Some((_, _, used)) = self.eps.get_mut(pk) {
                        used.push(rk.clone());
                    }
                }
                let Some((peers, rid)) = self.rule_peers(&policy, rk) else {
                    continue;
                };
                for pk in &eps {
                    let (Some((ep, entries, _)), Some(pod)) = (self.eps.get_mut(pk), self.snapshot.pods.get(pk)) else {
                        continue;
                    };
                    let mut tmp = BTreeMap::new();
                    emit_rule(&mut tmp, *ep, pod, dir, rule, &peers, &self.out.ids.identities, rid);
                    merge_entries(&mut self.out.policy, entries, tmp);
                }
            }
        }
        for pk in &eps {
            let Some((ep, _, _)) = self.eps.get(pk) else { continue };
            let ep = *ep;
            let Some(rec) = self.out.endpoints.get_mut(&ep) else {
                continue;
            };
            rec.isolated_ingress |= policy.ingress_isolation;
            rec.isolated_egress |= policy.egress_isolation;
            if rec.isolated_egress && self.opts.allow_host_egress {
                // As in `emit`: the host entry is set after the rules'.
                let rid = self.rule_id(RuleRef::HostEgress);
                let e = PolicyEntry {
                    endpoint: ep,
                    direction: Direction::Egress,
                    peer: IDENTITY_HOST,
                    protocol: None,
                    ports: ALL_PORTS,
                };
                if self.out.policy.insert(e, rid).is_none() {
                    if let Some((_, entries, _)) = self.eps.get_mut(pk) {
                        entries.push(e);
                    }
                }
            }
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
