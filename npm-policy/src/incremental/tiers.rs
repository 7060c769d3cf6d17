//! ClusterNetworkPolicies in the incremental compiler: adding, replacing
//! and removing one, and the recomputation of only the tier entries a
//! change touches, with the function of the full compile
//! (`tiers::compile::compile_tiers_scoped`) restricted to some subjects
//! (pod identities of local endpoints, see
//! [`crate::compiled::TierEntry`]), a tier and some peer identities: an
//! entry of one (subject, direction, tier, peer) depends only on that
//! subject's identity key and on the rules that match that peer, never on
//! another subject.
//!
//! What a change touches, recorded in [`TierChanges`] by the code that
//! makes the change and recomputed by [`Compiler::refresh_tiers`]:
//! - a CNP created, replaced or deleted: its tier's entries, for the
//!   subjects its old and new `subject` select and the peers its old and
//!   new rules resolve to (the old ones resolved before the change); the
//!   CNPs whose ranks moved (the CNPs of its old and new priority in its
//!   tier, see `ranked_rules`) are re-ranked in place (below);
//! - a pod identity that appears or goes (a pod or namespace change): the
//!   entries of that identity, on the subjects of every CNP with a
//!   `namespaces`/`pods` peer matching its key (or an all-peers egress rule
//!   with a named port, which resolves the name per identity);
//! - a subject that appears (its first local endpoint) or goes (its last):
//!   all its entries (a pod or namespace relabel gives the pods a new
//!   identity, so a new subject);
//! - the node identities or this node's labels (a Node change), the CIDR
//!   prefixes (an ipBlock or `networks` change): all entries of the
//!   subjects of the CNPs with a `nodes` (resp. `networks`) peer.
//!
//! The CNPs whose ranks moved without changing themselves keep their
//! entries, which get the new rank values (the order of their rules among
//! every rule but the changed CNP's is the same): nothing is recomputed for
//! them. The subjects whose entries were recomputed or re-ranked are
//! recorded for [`Compiler::take_tier_touched`], so a caller diffs only
//! those subjects' entries.
//!
//! The tests (`tests.rs`) compare the result with the full compile after
//! every step of random sequences. With no CNP and no tier entry it costs
//! nothing.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use crate::compiled::{Direction, Endpoint, IdentityKey, RuleRef, Tier, TierEntry, TierPresence, TierValue};
use crate::model::{InvalidPolicy, Snapshot};
use crate::tiers::compile::{
    compile_tiers_scoped, peer_selects_pod, policy_peer_ids, ranked_rules, subject_selects, Scope, TierFacts,
};
use crate::tiers::domains::{domain_prefixes, LearnedNames};
use crate::tiers::{
    convert_cluster_policy, with_last_valid_subject, ClusterNetworkPolicy, ClusterPeer, ClusterPolicy, ClusterPort,
};

use super::Compiler;

/// What changed since the tier entries were last brought up to date (see
/// the module doc); emptied by [`Compiler::refresh_tiers`].
#[derive(Clone, Debug, Default)]
pub(super) struct TierChanges {
    /// Subjects whose tier entries are all recomputed (gone ones lose
    /// theirs).
    pub(super) subjects: BTreeSet<u32>,
    /// Pod identities that appeared or went, with their keys.
    pub(super) identities: Vec<(u32, IdentityKey)>,
    /// The node identities or this node's labels may have changed.
    pub(super) nodes: bool,
    /// The CIDR prefixes changed.
    pub(super) cidrs: bool,
    /// The learned names changed (`domainNames` peers).
    pub(super) domains: bool,
    /// Narrower recomputations (a CNP change).
    jobs: Vec<Job>,
    /// The subjects whose tier entries were recomputed since the last
    /// [`Compiler::take_tier_touched`] (`None`: every one; a new compiler).
    /// Kept across [`Compiler::refresh_tiers`].
    touched: Option<BTreeSet<u32>>,
}

/// One recomputation: the tier entries of `subjects` in `scope`.
#[derive(Clone, Debug, Default)]
struct Job {
    subjects: BTreeSet<u32>,
    scope: Scope,
}

/// The ranks of each CNP's rules in `tier` (both directions, in order).
fn tier_ranks(snapshot: &Snapshot, tier: Tier) -> HashMap<String, Vec<u32>> {
    let mut out: HashMap<String, Vec<u32>> = HashMap::new();
    for dir in [Direction::Ingress, Direction::Egress] {
        for r in ranked_rules(snapshot, tier, dir) {
            match out.get_mut(r.policy.name.as_str()) {
                Some(v) => v.push(r.rank),
                None => {
                    out.insert(r.policy.name.clone(), vec![r.rank]);
                }
            }
        }
    }
    out
}

/// Subject `subject`'s tier presence from the entries.
pub(super) fn presence_of(tiers: &BTreeMap<TierEntry, TierValue>, subject: u32) -> TierPresence {
    let mut p = TierPresence::default();
    for direction in [Direction::Ingress, Direction::Egress] {
        for tier in [Tier::Admin, Tier::Baseline] {
            let has = tiers
                .range(TierEntry::first(subject, direction, tier, 0)..)
                .next()
                .is_some_and(|(e, _)| e.subject == subject && e.direction == direction && e.tier == tier);
            if has {
                p.set(tier, direction);
            }
        }
    }
    p
}

/// Removes the tier entries of subject `subject` in `scope`.
fn remove_scoped(tiers: &mut BTreeMap<TierEntry, TierValue>, subject: u32, scope: &Scope) {
    let mut keys: Vec<TierEntry> = Vec::new();
    for direction in [Direction::Ingress, Direction::Egress] {
        for tier in [Tier::Admin, Tier::Baseline] {
            if scope.tiers.as_ref().is_some_and(|t| !t.contains(&tier)) {
                continue;
            }
            let same = |e: &TierEntry| e.subject == subject && e.direction == direction && e.tier == tier;
            match &scope.peers {
                None => keys.extend(
                    tiers
                        .range(TierEntry::first(subject, direction, tier, 0)..)
                        .take_while(|(e, _)| same(e))
                        .map(|(e, _)| *e),
                ),
                Some(peers) => {
                    for peer in peers {
                        keys.extend(
                            tiers
                                .range(TierEntry::first(subject, direction, tier, *peer)..)
                                .take_while(|(e, _)| same(e) && e.peer == *peer)
                                .map(|(e, _)| *e),
                        );
                    }
                }
            }
        }
    }
    for k in keys {
        tiers.remove(&k);
    }
}

/// Does a rule with peers `peers` and ports `ports` resolve differently
/// when the pod identity `key` appears or goes?
fn rule_sees_identity(peers: &[ClusterPeer], ports: &[ClusterPort], key: &IdentityKey) -> bool {
    peers.iter().any(|p| match p {
        ClusterPeer::Namespaces(_) | ClusterPeer::Pods { .. } => peer_selects_pod(p, key),
        // Resolved to IDENTITY_ANY, but an egress named port is resolved
        // per destination identity (`emit`): an identity with a named
        // port changes those entries.
        ClusterPeer::All => !key.named_ports.is_empty() && ports.iter().any(|p| matches!(p, ClusterPort::Named(_))),
        ClusterPeer::Networks(_) | ClusterPeer::Nodes(_) | ClusterPeer::DomainNames(_) => false,
    })
}

/// Does one of `policy`'s rules resolve differently when pod identity
/// `key` appears or goes?
fn identity_affects(policy: &ClusterPolicy, key: &IdentityKey) -> bool {
    policy
        .ingress
        .iter()
        .chain(&policy.egress)
        .any(|r| rule_sees_identity(&r.peers, &r.ports, key))
}

/// The CIDRs of `policy`'s `networks` peers and the host prefixes its
/// `domainNames` peers stand for with the learned names `learned`.
fn networks_of(policy: &ClusterPolicy, learned: &LearnedNames) -> BTreeSet<ipnet::IpNet> {
    let mut out = BTreeSet::new();
    for r in policy.ingress.iter().chain(&policy.egress) {
        for p in &r.peers {
            match p {
                ClusterPeer::Networks(nets) => out.extend(nets.iter().copied()),
                ClusterPeer::DomainNames(names) => out.extend(domain_prefixes(names, learned)),
                _ => {}
            }
        }
    }
    out
}

/// Is `policy` affected through its `nodes` peers (node identities),
/// `networks` peers (CIDR prefixes) or `domainNames` peers (CIDR prefixes,
/// learned names)?
fn nodes_or_cidrs_affected(policy: &ClusterPolicy, changes: &TierChanges) -> bool {
    policy.ingress.iter().chain(&policy.egress).any(|r| {
        r.peers.iter().any(|p| match p {
            ClusterPeer::Nodes(_) => changes.nodes,
            ClusterPeer::Networks(_) => changes.cidrs,
            ClusterPeer::DomainNames(_) => changes.cidrs || changes.domains,
            _ => false,
        })
    })
}

impl Compiler {
    /// Replaces the learned names (what `domainNames` peers match, see
    /// [`crate::tiers::domains`]): the CIDR prefixes their addresses add
    /// or drop, then the tier entries of the subjects of every CNP with a
    /// `domainNames` peer. Nothing happens when they are unchanged.
    pub fn set_domain_names(&mut self, learned: LearnedNames) {
        if self.snapshot.domain_names == learned {
            return;
        }
        self.snapshot.domain_names = learned;
        if let Some(users) = self.refresh_prefixes() {
            // New CIDR identities: the NetworkPolicy entries of the
            // ipBlock rules change too.
            self.emit_subjects(users);
        }
        self.tier_changes.domains = true;
        self.refresh_tiers();
    }

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
        let name = cnp.metadata.name.clone().unwrap_or_default();
        let c = with_last_valid_subject(self.snapshot.cluster_policies.get(&name), convert_cluster_policy(cnp));
        let invalid = c.invalid();
        self.set_cluster_policy(c.policy.name.clone(), Some(c.policy), invalid.clone());
        match invalid {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Keeps an earlier converted version of a ClusterNetworkPolicy in
    /// place of a version that cannot be used, with the report of the
    /// version that could not (recorded in the snapshot's
    /// `invalid_cluster_policies`, so that the pods it selects are told).
    pub fn keep_cluster_policy(&mut self, policy: ClusterPolicy, invalid: Option<InvalidPolicy>) {
        self.set_cluster_policy(policy.name.clone(), Some(policy), invalid);
    }

    /// Removes a ClusterNetworkPolicy.
    pub fn remove_cluster_policy(&mut self, name: &str) {
        self.set_cluster_policy(name.to_string(), None, None);
    }

    fn set_cluster_policy(&mut self, name: String, policy: Option<ClusterPolicy>, invalid: Option<InvalidPolicy>) {
        // The old version's job (its endpoints, tier and peers, resolved
        // before the change: a CIDR identity it alone used goes with it),
        // and the ranks of its tier(s) before the change.
        let old = self.snapshot.cluster_policies.get(&name).map(|p| self.cnp_job(p));
        let tiers: BTreeSet<Tier> = old
            .iter()
            .flat_map(|j| j.scope.tiers.iter().flatten().copied())
            .chain(policy.as_ref().map(|p| p.tier))
            .collect();
        let before: Vec<(Tier, HashMap<String, Vec<u32>>)> =
            tiers.iter().map(|t| (*t, tier_ranks(&self.snapshot, *t))).collect();
        // The CIDR prefixes are a union over every policy: they can change
        // only when this one's `networks` do.
        let learned = &self.snapshot.domain_names;
        let old_networks = self
            .snapshot
            .cluster_policies
            .get(&name)
            .map(|p| networks_of(p, learned));
        let networks_changed =
            old_networks.unwrap_or_default() != policy.as_ref().map(|p| networks_of(p, learned)).unwrap_or_default();
        self.rules.forget_cluster(&name, &mut self.out.ids);
        match policy {
            Some(p) => self.snapshot.insert_cluster_policy(p, invalid),
            None => {
                self.snapshot.remove_cluster_policy(&name);
            }
        }
        if networks_changed {
            if let Some(users) = self.refresh_prefixes() {
                // New CIDR identities: the NetworkPolicy entries of the
                // ipBlock rules change too.
                self.emit_subjects(users);
            }
        }
        let mut jobs: Vec<Job> = old.into_iter().collect();
        if let Some(new) = self.snapshot.cluster_policies.get(&name) {
            jobs.push(self.cnp_job(new));
        }
        // Every other CNP whose ranks moved (same tier, same priority as
        // the old or new version, later name; all of them should the tier
        // fall back to dense ranks): the order of their rules among
        // themselves and every rule but this CNP's is the same, so their
        // entries stay and only carry new ranks (`rerank`); where this
        // CNP's rules take part, its jobs recompute them.
        let mut moved: BTreeSet<String> = BTreeSet::new();
        for (tier, old_ranks) in before {
            let new_ranks = tier_ranks(&self.snapshot, tier);
            for (n, r) in new_ranks {
                if n == name || old_ranks.get(&n).is_none_or(|o| *o == r) {
                    continue;
                }
                moved.insert(n);
            }
        }
        self.rerank(&moved);
        self.tier_changes.jobs.extend(jobs);
        self.refresh_tiers();
    }

    /// Gives the tier entries of the (unchanged) CNPs `moved` the ranks
    /// their rules have now: each entry whose rule is one of theirs, on the
    /// subjects they select (the only ones where their rules emit
    /// entries). Valid because the new ranks keep the order of
    /// every rule but the changed CNP's (ranks follow (priority, name,
    /// index)), and the fold depends only on that order.
    fn rerank(&mut self, moved: &BTreeSet<String>) {
        if moved.is_empty() {
            return;
        }
        let mut subjects: BTreeSet<u32> = BTreeSet::new();
        for n in moved {
            if let Some(p) = self.snapshot.cluster_policies.get(n) {
                subjects.extend(self.cnp_subjects(p));
            }
        }
        let mut rank: HashMap<(Tier, Direction, &str, usize), u32> = HashMap::new();
        for tier in [Tier::Admin, Tier::Baseline] {
            for dir in [Direction::Ingress, Direction::Egress] {
                for r in ranked_rules(&self.snapshot, tier, dir) {
                    if moved.contains(&r.policy.name) {
                        rank.insert((tier, dir, r.policy.name.as_str(), r.index), r.rank);
                    }
                }
            }
        }
        // Rule id -> its new rank (`None`: not a rule of `moved`).
        let mut by_rule: HashMap<u32, Option<u32>> = HashMap::new();
        let rules = &self.out.ids.rules;
        for id in &subjects {
            let lo = TierEntry::first(*id, Direction::Ingress, Tier::Admin, 0);
            for (e, v) in self.out.tiers.range_mut(lo..) {
                if e.subject != *id {
                    break;
                }
                let new = *by_rule.entry(v.rule).or_insert_with(|| match rules.get(&v.rule) {
                    Some(RuleRef::Cluster {
                        tier,
                        name,
                        direction,
                        index,
                    }) => rank.get(&(*tier, *direction, name.as_str(), *index)).copied(),
                    _ => None,
                });
                if let Some(r) = new {
                    v.rank = r;
                }
            }
        }
        if let Some(t) = &mut self.tier_changes.touched {
            t.extend(subjects);
        }
    }

    /// What a change of `policy` touches: the tier entries of its tier,
    /// for the subjects it selects and the peers its rules resolve to
    /// (now).
    fn cnp_job(&self, policy: &ClusterPolicy) -> Job {
        let nodes = TierFacts {
            identities: &self.out.ids.node_identities,
            local: self.snapshot.nodes.get(&self.opts.node_name).map(|n| &n.labels),
            learned: &self.snapshot.domain_names,
        };
        Job {
            subjects: self.cnp_subjects(policy).into_iter().collect(),
            scope: Scope {
                tiers: Some([policy.tier].into()),
                peers: policy_peer_ids(policy, &self.out.ids.identities, &self.out.cidrs, &nodes),
            },
        }
    }

    /// The subjects (pod identities of local endpoints) `policy`'s
    /// `subject` selects.
    fn cnp_subjects(&self, policy: &ClusterPolicy) -> Vec<u32> {
        let ids = &self.out.ids.identities;
        self.subjects
            .keys()
            .filter(|s| {
                ids.get(*s)
                    .is_some_and(|k| subject_selects(&policy.subject, &k.pod_labels, &k.namespace_labels))
            })
            .copied()
            .collect()
    }

    /// Brings the tier entries up to date with the changes recorded since
    /// the last call: the entries they touch (see the module doc) are
    /// recomputed, the others stay.
    pub(super) fn refresh_tiers(&mut self) {
        let mut changes = std::mem::take(&mut self.tier_changes);
        self.tier_changes.touched = changes.touched.take();
        if self.snapshot.cluster_policies.is_empty() && self.out.tiers.is_empty() {
            return;
        }
        let mut jobs = changes.jobs.clone();
        // New and gone subjects: everything of theirs.
        let mut full = changes.subjects.clone();
        if changes.nodes || changes.cidrs || changes.domains {
            for p in self.snapshot.cluster_policies.values() {
                if nodes_or_cidrs_affected(p, &changes) {
                    full.extend(self.cnp_subjects(p));
                }
            }
        }
        if !full.is_empty() {
            jobs.push(Job {
                subjects: full,
                scope: Scope::default(),
            });
        }
        // An identity that appeared or went: its own entries, on the
        // subjects of the CNPs whose peers see it (an identity that went
        // had entries only there).
        if !changes.identities.is_empty() {
            let mut subjects = BTreeSet::new();
            for p in self.snapshot.cluster_policies.values() {
                if changes.identities.iter().any(|(_, k)| identity_affects(p, k)) {
                    subjects.extend(self.cnp_subjects(p));
                }
            }
            jobs.push(Job {
                subjects,
                scope: Scope {
                    tiers: None,
                    peers: Some(changes.identities.iter().map(|(id, _)| *id).collect()),
                },
            });
        }
        // One recomputation per tier scope: the union of the subjects and
        // of the peers (a superset of each job's entries is recomputed, so
        // the result is the same; the fixed costs are paid once).
        let mut merged: BTreeMap<Option<BTreeSet<Tier>>, Job> = BTreeMap::new();
        for job in jobs {
            if job.subjects.is_empty() {
                continue;
            }
            match merged.get_mut(&job.scope.tiers) {
                None => {
                    merged.insert(job.scope.tiers.clone(), job);
                }
                Some(m) => {
                    m.subjects.extend(job.subjects);
                    m.scope.peers = match (m.scope.peers.take(), job.scope.peers) {
                        (Some(mut a), Some(b)) => {
                            a.extend(b);
                            Some(a)
                        }
                        _ => None,
                    };
                }
            }
        }
        for job in merged.into_values() {
            self.recompute_tiers(&job);
        }
    }

    /// Recomputes the tier entries of `job` and the presence of its
    /// subjects' endpoints (a subject without endpoints any more just
    /// loses its entries).
    fn recompute_tiers(&mut self, job: &Job) {
        let dirty = &job.subjects;
        if let Some(t) = &mut self.tier_changes.touched {
            t.extend(dirty);
        }
        for id in dirty {
            remove_scoped(&mut self.out.tiers, *id, &job.scope);
        }
        // The identity table is read while rule ids are handed out.
        let identities = std::mem::take(&mut self.out.ids.identities);
        let locals: Vec<(u32, &IdentityKey)> = dirty
            .iter()
            .filter(|s| self.subjects.contains_key(*s))
            .filter_map(|s| identities.get(s).map(|k| (*s, k)))
            .collect();
        let node_identities = std::mem::take(&mut self.out.ids.node_identities);
        let nodes = TierFacts {
            identities: &node_identities,
            local: self.snapshot.nodes.get(&self.opts.node_name).map(|n| &n.labels),
            learned: &self.snapshot.domain_names,
        };
        let (rules, ids) = (&mut self.rules, &mut self.out.ids);
        let tiers = compile_tiers_scoped(
            &self.snapshot,
            &locals,
            &identities,
            &self.out.cidrs,
            &nodes,
            &job.scope,
            |r| rules.rule_id(r.clone(), ids),
        );
        drop(locals);
        self.out.ids.identities = identities;
        self.out.ids.node_identities = node_identities;
        self.out.tiers.extend(tiers);
        for s in dirty {
            let presence = presence_of(&self.out.tiers, *s);
            for pk in self.subjects.get(s).into_iter().flatten() {
                let Some(st) = self.eps.get(pk) else { continue };
                if let Some(ep) = self.out.endpoints.get_mut(&st.id) {
                    ep.tiers = presence;
                }
            }
        }
    }

    /// The subjects whose tier entries may have changed since the last
    /// call (`None`: any; the first call on a new compiler), and starts a
    /// new record. Every other subject's entries are as they were, so a
    /// caller holding the compiled form of the last call diffs only these
    /// ([`crate::compiled::Compiled::diff_with_tiers_of`]).
    pub fn take_tier_touched(&mut self) -> Option<BTreeSet<u32>> {
        self.tier_changes.touched.replace(BTreeSet::new())
    }

    /// Sets the tier presence of a (re-emitted) endpoint record from the
    /// current tier entries of its subject.
    pub(super) fn restore_presence(tiers: &BTreeMap<TierEntry, TierValue>, ep: &mut Endpoint) {
        ep.tiers = presence_of(tiers, ep.identity);
    }
}
