//! The local endpoints and subjects of the incremental compiler:
//! re-emitting a subject's policy entries and its endpoints' records, and
//! patching a subject's entries in place when a policy is added or changed
//! or an identity appears or goes.
//!
//! Policy entries are keyed by subject, the pod identity of local endpoints
//! ([`PolicyEntry`]): a subject's entries exist while it has at least one
//! member endpoint, and every member's record carries the subject's
//! isolation.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::compile::{
    emit_named_egress_to, emit_rule, emit_rule_towards, endpoint_record, enforced_rules, host_egress_entry,
    policy_selects_key, sorted_entries, ResolvedPeers, RuleTarget,
};
use crate::compiled::{Direction, IdentityKey, PolicyEntry, PolicyMap, RuleRef};
use crate::model::Policy;
use crate::numbers::NumberKind;
use crate::ownership::PodKey;
use crate::peers::PeerSet;
use crate::policy_map::peer_range;

use super::rules::{rule_of, RuleKey};
use super::Compiler;

/// A local endpoint: its id and its subject (its pod identity).
#[derive(Clone, Debug)]
pub(super) struct EndpointState {
    /// Endpoint id.
    pub(super) id: u32,
    /// Its subject: the entries keyed by it govern the endpoint.
    pub(super) subject: u32,
}

/// Spec §1: the isolation (ingress, egress) of the pods that `policies`
/// (every policy selecting them) select: "isolated for ingress when at
/// least one policy selects it and has `Ingress` in its effective
/// `policyTypes`", the same for egress.
fn isolation<'p>(policies: impl IntoIterator<Item = &'p Policy>) -> (bool, bool) {
    policies.into_iter().fold((false, false), |(i, e), p| {
        (i || p.ingress_isolation, e || p.egress_isolation)
    })
}

/// The peers towards which the entries of a policy's rules can be, per
/// direction (ingress, egress): `None` for every peer (an egress rule
/// with an empty `to` and a named port has entries towards each pod
/// identity resolving the name, see `emit_rule`).
/// Each set is sorted, without duplicates.
pub(super) type Reach = [Option<Vec<u32>>; 2];

/// No peer in either direction.
pub(super) fn no_reach() -> Reach {
    [Some(Vec::new()), Some(Vec::new())]
}

/// The index of `dir` in a [`Reach`].
fn reach_index(dir: Direction) -> usize {
    match dir {
        Direction::Ingress => 0,
        Direction::Egress => 1,
    }
}

/// Adds `new` entries to the compiled policy map; an entry already there
/// keeps the lower rule id.
fn merge_entries(policy: &mut PolicyMap, new: BTreeMap<PolicyEntry, u32>) {
    for (e, r) in new {
        policy.insert_min(e, r);
    }
}

/// At most this many peers are patched entry by entry in
/// [`merge_towards`]; more, and the group is rebuilt.
const POINT_PATCH_PEERS: usize = 64;

/// Makes the entries of group (`s`, `dir`) towards the peers `only`
/// (`None`: every peer; sorted) exactly `fresh` (entries of that group
/// towards those peers, sorted, each once), leaving its other entries
/// alone. Towards a few peers the changed entries are written one by one;
/// otherwise the group is rebuilt in one ordered pass (the entries it keeps merged with
/// `fresh`, both in order: linear, and far cheaper than as many single
/// inserts and removals).
fn merge_towards(policy: &mut PolicyMap, s: u32, dir: Direction, only: Option<&[u32]>, fresh: Vec<(PolicyEntry, u32)>) {
    let in_fresh = |e: &PolicyEntry| fresh.binary_search_by(|(f, _)| f.cmp(e)).is_ok();
    if let Some(peers) = only.filter(|o| o.len() <= POINT_PATCH_PEERS) {
        let mut gone: Vec<PolicyEntry> = Vec::new();
        if let Some(group) = policy.group(s, dir) {
            for p in peers {
                gone.extend(
                    group
                        .range(peer_range(s, dir, *p))
                        .map(|(e, _)| *e)
                        .filter(|e| !in_fresh(e)),
                );
            }
        }
        for e in gone {
            policy.remove(&e);
        }
        for (e, r) in fresh {
            policy.insert(e, r);
        }
        return;
    }
    let old = policy.take_group(s, dir);
    let mut rest = only.unwrap_or_default();
    let mut towards_reach = |e: &PolicyEntry| match only {
        None => true,
        Some(_) => {
            // The entries come in peer order: one walk along `only`.
            rest = &rest[rest.partition_point(|p| *p < e.peer)..];
            rest.first() == Some(&e.peer)
        }
    };
    let mut merged: Vec<(PolicyEntry, u32)> = Vec::with_capacity(old.len() + fresh.len());
    let mut fresh = fresh.into_iter().peekable();
    for (e, r) in old {
        if towards_reach(&e) {
            continue;
        }
        while let Some(f) = fresh.next_if(|(f, _)| *f < e) {
            merged.push(f);
        }
        merged.push((e, r));
    }
    merged.extend(fresh);
    // In order already: the collect builds the map in one pass.
    policy.set_group(s, dir, merged.into_iter().collect());
}

/// The policies of `policies` (ordered by namespace) that select
/// the pods of identity key `key`.
fn selecting<'p>(
    policies: &'p BTreeMap<(String, String), Policy>,
    key: &'p IdentityKey,
) -> impl Iterator<Item = &'p Policy> {
    let lo = (key.namespace.clone(), String::new());
    let ns = key.namespace.clone();
    policies
        .range(lo..)
        .take_while(move |((n, _), _)| *n == ns)
        .map(|(_, p)| p)
        .filter(move |p| policy_selects_key(p, key))
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
                        let ep = ids.next_or_provisional(NumberKind::Endpoint);
                        ids.endpoints.insert(uid.to_string(), ep);
                        ep
                    }
                }
            }
        }
    }

    /// Starts from a full compile of the snapshot (entries, endpoint
    /// records, rule ids): takes over its resolved peer sets and records
    /// the rules each subject uses, as [`Compiler::emit_subjects`] of every
    /// subject would.
    pub(super) fn adopt(&mut self, peers: ResolvedPeers) {
        self.rules.adopt_peers(peers);
        for s in self.subjects.keys() {
            let Some(key) = self.out.ids.identities.get(s) else {
                continue;
            };
            for p in selecting(&self.snapshot.policies, key) {
                for (dir, i, _) in enforced_rules(p) {
                    self.rules.add_user(&(p.namespace.clone(), p.name.clone(), dir, i), *s);
                }
            }
        }
    }

    /// Re-emits the endpoint records of `dirty` (pods whose endpoint, or
    /// subject, may have changed) and the entries of the subjects they
    /// leave or join.
    pub(super) fn emit(&mut self, dirty: BTreeSet<PodKey>) {
        // Subject -> whether it had members before this call.
        let mut touched: BTreeMap<u32, bool> = BTreeMap::new();
        let had = |subjects: &HashMap<u32, BTreeSet<PodKey>>, s: u32| subjects.get(&s).is_some_and(|m| !m.is_empty());
        // The records written here, with their subject.
        let mut written: Vec<(u32, u32)> = Vec::new();
        for pk in dirty {
            // Remove what the endpoint had.
            let old = self.eps.remove(&pk);
            if let Some(old) = &old {
                self.out.endpoints.remove(&old.id);
                touched
                    .entry(old.subject)
                    .or_insert_with(|| had(&self.subjects, old.subject));
                if let Some(members) = self.subjects.get_mut(&old.subject) {
                    members.remove(&pk);
                }
            }
            let pod = self
                .snapshot
                .pods
                .get(&*pk)
                .filter(|p| p.node_name.as_deref() == Some(self.opts.node_name.as_str()));
            let owned: Vec<IpAddr> = pod.map(|p| self.addresses.owned(&pk, p)).unwrap_or_default();
            let (Some(pod), false) = (pod, owned.is_empty()) else {
                if let Some(old) = old {
                    self.out.ids.endpoints.retain(|_, v| *v != old.id);
                }
                continue;
            };
            let pod = pod.clone();
            let ep = self.endpoint_id(old.map(|o| o.id), &pod.uid);
            let subject = self.identities.of_pod(&pk);
            touched.entry(subject).or_insert_with(|| had(&self.subjects, subject));
            self.subjects.entry(subject).or_default().insert(pk.clone());
            written.push((ep, subject));
            // The isolation is the subject's (set below).
            let mut record = endpoint_record(&pod, subject, &owned, false, false);
            record.report_new = self.opts.report_new;
            // Its subject's tier entries are not re-emitted here (see
            // `tiers`).
            Self::restore_presence(&self.out.tiers, &mut record);
            self.out.endpoints.insert(ep, record);
            self.eps.insert(pk, EndpointState { id: ep, subject });
        }
        // A subject's entries are a function of its identity key alone: a
        // subject that appears or goes is emitted (or removed), with its
        // tier entries; one that keeps members keeps its entries, and only
        // the records written here take its isolation.
        let mut emit = BTreeSet::new();
        let mut kept: BTreeMap<u32, (bool, bool)> = BTreeMap::new();
        for (s, before) in touched {
            let now = had(&self.subjects, s);
            if now != before {
                self.tier_changes.subjects.insert(s);
                emit.insert(s);
            } else if now {
                if let Some(key) = self.out.ids.identities.get(&s) {
                    kept.insert(s, isolation(selecting(&self.snapshot.policies, key)));
                }
            }
        }
        for (ep, s) in written {
            if let (Some((iso_in, iso_eg)), Some(rec)) = (kept.get(&s), self.out.endpoints.get_mut(&ep)) {
                rec.isolated_ingress = *iso_in;
                rec.isolated_egress = *iso_eg;
            }
        }
        self.emit_subjects(emit);
    }

    /// Re-emits the entries of `subjects` from every rule selecting them
    /// (a subject without member endpoints any more loses its entries and
    /// is forgotten) and sets their members' isolation.
    pub(super) fn emit_subjects(&mut self, subjects: BTreeSet<u32>) {
        for s in subjects {
            self.out.policy.remove_subject(s);
            self.rules.remove_user(s);
            if self.subjects.get(&s).is_none_or(|m| m.is_empty()) {
                // A gone subject: its tier entries go too.
                self.subjects.remove(&s);
                self.tier_changes.subjects.insert(s);
                continue;
            }
            let Some(key) = self.out.ids.identities.get(&s).cloned() else {
                continue;
            };
            let policies: Vec<Policy> = selecting(&self.snapshot.policies, &key).cloned().collect();
            let (iso_in, iso_eg) = isolation(&policies);
            let mut entries = BTreeMap::new();
            for p in &policies {
                for (dir, i, rule) in enforced_rules(p) {
                    let rk: RuleKey = (p.namespace.clone(), p.name.clone(), dir, i);
                    self.rules.add_user(&rk, s);
                    let Some((peers, rid)) = self.rule_peers(p, &rk) else {
                        continue;
                    };
                    emit_rule(&mut entries, s, &key, dir, rule, &peers, &self.out.ids.identities, rid);
                }
            }
            if iso_eg && self.opts.allow_host_egress {
                let rid = self.rules.rule_id(RuleRef::HostEgress, &mut self.out.ids);
                entries.insert(host_egress_entry(s), rid);
            }
            // The subject has no entries now: its two groups are set.
            let egress = entries.split_off(&PolicyEntry {
                subject: s,
                direction: Direction::Egress,
                peer: 0,
                protocol: None,
                ports: (0, 0),
            });
            self.out.policy.set_group(s, Direction::Ingress, entries);
            self.out.policy.set_group(s, Direction::Egress, egress);
            self.set_isolation(s, iso_in, iso_eg);
        }
    }

    /// Sets the isolation of every member endpoint of subject `s`.
    fn set_isolation(&mut self, s: u32, iso_in: bool, iso_eg: bool) {
        for pk in self.subjects.get(&s).into_iter().flatten() {
            let Some(st) = self.eps.get(pk) else { continue };
            if let Some(rec) = self.out.endpoints.get_mut(&st.id) {
                rec.isolated_ingress = iso_in;
                rec.isolated_egress = iso_eg;
            }
        }
    }

    /// The [`Reach`] of the enforced rules of `policy` (its peer sets are
    /// resolved and memoized).
    pub(super) fn reach(&mut self, policy: &Policy) -> Reach {
        let mut reach = no_reach();
        for (dir, i, rule) in enforced_rules(policy) {
            let slot = &mut reach[reach_index(dir)];
            let Some(set) = slot.as_mut() else { continue };
            let named = rule
                .ports
                .iter()
                .any(|p| matches!(p.port, crate::model::PortSpec::Named(_)));
            if dir == Direction::Egress && rule.peers.is_empty() && named {
                *slot = None;
                continue;
            }
            let rk: RuleKey = (policy.namespace.clone(), policy.name.clone(), dir, i);
            let groups = self.identities.groups(&self.out.ids.identities);
            let peers = self.rules.resolved(policy, &rk, &groups, &self.out.cidrs);
            set.extend(peers.pods.iter().chain(&peers.other));
        }
        for set in reach.iter_mut().flatten() {
            set.sort_unstable();
            set.dedup();
        }
        reach
    }

    /// Policy `key` changed (or went): patches the entries of the
    /// `subjects` that its old or new version selects, in place. A
    /// subject's entries towards one peer come only from the rules that
    /// emit towards that peer, so only the entries towards the peers of
    /// `reach` (the union of the old and new versions' reaches) can
    /// change: those are emitted again from every rule of the subject
    /// restricted to them ([`emit_rule_towards`]) and merged in
    /// ([`merge_towards`]: only what differs is written); the others stay.
    /// The isolation flags and the host egress entry follow the policies
    /// selecting the subject now. The old version's rules are no longer
    /// used (their users are gone); the new version's users are recorded.
    pub(super) fn patch_policy(&mut self, key: &(String, String), subjects: BTreeSet<u32>, reach: &Reach) {
        let changed = self.snapshot.policies.get(key).cloned();
        let mut resolved: HashMap<RuleKey, Option<(PeerSet, u32)>> = HashMap::new();
        for s in subjects {
            if !self.subjects.contains_key(&s) {
                continue;
            }
            let Some(ikey) = self.out.ids.identities.get(&s).cloned() else {
                continue;
            };
            let policies: Vec<Policy> = selecting(&self.snapshot.policies, &ikey).cloned().collect();
            if let Some(p) = changed.as_ref().filter(|p| policy_selects_key(p, &ikey)) {
                for (dir, i, _) in enforced_rules(p) {
                    self.rules.add_user(&(p.namespace.clone(), p.name.clone(), dir, i), s);
                }
            }
            for dir in [Direction::Ingress, Direction::Egress] {
                let only = reach[reach_index(dir)].as_deref();
                if only.is_some_and(|o| o.is_empty()) {
                    continue;
                }
                // The entries towards `only` from every rule of the
                // subject, gathered apart (then sorted, each entry with
                // the smallest rule id, as `emit_rule` merges them) ...
                let mut fresh = Vec::new();
                for p in &policies {
                    for (d, i, rule) in enforced_rules(p).filter(|(d, _, _)| *d == dir) {
                        let rk: RuleKey = (p.namespace.clone(), p.name.clone(), d, i);
                        // Looked up once per rule, not per subject.
                        let resolved = match resolved.get(&rk) {
                            Some(r) => r,
                            None => {
                                let r = self.rule_peers(p, &rk);
                                resolved.entry(rk).or_insert(r)
                            }
                        };
                        let Some((peers, rid)) = resolved else {
                            continue;
                        };
                        let target = RuleTarget {
                            subject: s,
                            key: &ikey,
                            dir,
                            rule,
                            peers,
                            rule_id: *rid,
                        };
                        emit_rule_towards(&mut fresh, &target, &self.out.ids.identities, only);
                    }
                }
                // ... then merged into the map in one ordered walk: only
                // what differs is written (most entries towards a peer
                // come from other rules and stay).
                merge_towards(&mut self.out.policy, s, dir, only, sorted_entries(fresh));
            }
            let (iso_in, iso_eg) = isolation(&policies);
            if self.opts.allow_host_egress {
                if iso_eg {
                    let rid = self.rules.rule_id(RuleRef::HostEgress, &mut self.out.ids);
                    self.out.policy.insert(host_egress_entry(s), rid);
                } else {
                    self.out.policy.remove(&host_egress_entry(s));
                }
            }
            self.set_isolation(s, iso_in, iso_eg);
        }
    }

    /// Adds the entries of the new policy `key` to the `subjects` it
    /// selects (patched in place; the same entries as a re-emit, since a
    /// subject's entries are the union of its rules' entries, each with the
    /// smallest rule id producing it).
    pub(super) fn add_policy(&mut self, key: &(String, String), subjects: BTreeSet<u32>) {
        if subjects.is_empty() {
            return;
        }
        let policy = self.snapshot.policies[key].clone();
        for (dir, i, rule) in enforced_rules(&policy) {
            let rk: RuleKey = (policy.namespace.clone(), policy.name.clone(), dir, i);
            for s in &subjects {
                self.rules.add_user(&rk, *s);
            }
            let Some((peers, rid)) = self.rule_peers(&policy, &rk) else {
                continue;
            };
            for s in &subjects {
                let Some(ikey) = self.out.ids.identities.get(s) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_rule(&mut tmp, *s, ikey, dir, rule, &peers, &self.out.ids.identities, rid);
                merge_entries(&mut self.out.policy, tmp);
            }
        }
        for s in &subjects {
            let members: Vec<u32> = self
                .subjects
                .get(s)
                .into_iter()
                .flatten()
                .filter_map(|pk| self.eps.get(pk).map(|st| st.id))
                .collect();
            let mut iso_eg = false;
            for ep in members {
                let Some(rec) = self.out.endpoints.get_mut(&ep) else {
                    continue;
                };
                rec.isolated_ingress |= policy.ingress_isolation;
                rec.isolated_egress |= policy.egress_isolation;
                iso_eg |= rec.isolated_egress;
            }
            if iso_eg && self.opts.allow_host_egress {
                // As in `emit_subjects`: the host entry is set after the rules'.
                let rid = self.rules.rule_id(RuleRef::HostEgress, &mut self.out.ids);
                self.out.policy.insert(host_egress_entry(*s), rid);
            }
        }
    }

    /// Registers a new identity and adds its entries to the subjects whose
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
            for s in users {
                let mut tmp = BTreeMap::new();
                emit_named_egress_to(&mut tmp, s, &rule, id, &key, rid);
                merge_entries(&mut self.out.policy, tmp);
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
            for s in users {
                let Some(skey) = self.out.ids.identities.get(&s) else {
                    continue;
                };
                let mut tmp = BTreeMap::new();
                emit_rule(&mut tmp, s, skey, rk.2, rule, &only, &self.out.ids.identities, rid);
                merge_entries(&mut self.out.policy, tmp);
            }
        }
    }

    /// Forgets an identity: its entries go from every subject (patched in
    /// place, not re-emitted). Only the users of the rules that can emit
    /// entries towards it are visited (see [`super::rules::Rules::users_towards`]).
    pub(super) fn drop_identity(&mut self, id: u32) {
        if let Some(key) = self.out.ids.identities.get(&id) {
            self.tier_changes.identities.push((id, key.clone()));
        }
        let users = self.rules.users_towards(id);
        self.identities.forget(id, &mut self.out.ids.identities);
        self.rules.drop_identity(id);
        let policy = &mut self.out.policy;
        for s in users {
            for dir in [Direction::Ingress, Direction::Egress] {
                policy.remove_peer(s, dir, id);
            }
        }
    }
}
