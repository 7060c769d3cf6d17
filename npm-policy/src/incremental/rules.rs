//! The rules of the incremental compiler: each rule's peer set (resolved on
//! first use, patched when identities come and go), the rule ids, and which
//! subjects (pod identities of local endpoints, see
//! [`crate::compiled::PolicyEntry`]) use which rule ([`RuleUsers`], one
//! index with both directions).

use std::collections::{BTreeMap, BTreeSet, HashMap};

use ipnet::IpNet;
use npm_common::IDENTITY_ANY;

use crate::compile::named_port_numbers;
use crate::compiled::{Compiled, Direction, IdTables, IdentityKey, RuleRef};
use crate::model::{Peer, Policy, PortSpec, Rule, Snapshot};
use crate::numbers::NumberKind;
use crate::peers::{self, IdentityGroups, PeerSet};

/// A rule: `(namespace, policy name, direction, index)`.
pub(super) type RuleKey = (String, String, Direction, usize);

/// The rule `rk` of `policy`, if it has it.
pub(super) fn rule_of<'p>(policy: &'p Policy, rk: &RuleKey) -> Option<&'p Rule> {
    match rk.2 {
        Direction::Ingress => policy.ingress.get(rk.3),
        Direction::Egress => policy.egress.get(rk.3),
    }
}

/// Which subjects use which rule, in both directions.
#[derive(Clone, Debug, Default)]
pub(super) struct RuleUsers {
    by_rule: HashMap<RuleKey, BTreeSet<u32>>,
    by_subject: HashMap<u32, Vec<RuleKey>>,
}

impl RuleUsers {
    /// Subject `s` uses rule `rk`.
    fn add(&mut self, rk: &RuleKey, s: u32) {
        if self.by_rule.entry(rk.clone()).or_default().insert(s) {
            self.by_subject.entry(s).or_default().push(rk.clone());
        }
    }

    /// Subject `s` uses no rule any more.
    fn remove_subject(&mut self, s: u32) {
        for rk in self.by_subject.remove(&s).into_iter().flatten() {
            if let Some(u) = self.by_rule.get_mut(&rk) {
                u.remove(&s);
            }
        }
    }

    /// Rule `rk` has no users any more; returns those it had.
    fn remove_rule(&mut self, rk: &RuleKey) -> BTreeSet<u32> {
        let users = self.by_rule.remove(rk).unwrap_or_default();
        for s in &users {
            if let Some(rules) = self.by_subject.get_mut(s) {
                rules.retain(|r| r != rk);
            }
        }
        users
    }

    /// The users of rule `rk`.
    fn of_rule(&self, rk: &RuleKey) -> Vec<u32> {
        self.by_rule.get(rk).into_iter().flatten().copied().collect()
    }
}

/// Peer sets, rule ids and rule users.
#[derive(Clone, Debug)]
pub(super) struct Rules {
    /// Rule -> its peers (resolved on first use).
    peers: HashMap<RuleKey, PeerSet>,
    /// Which subjects use which rule.
    users: RuleUsers,
    /// Rule -> its id (the inverse of the compiled form's `ids.rules`).
    by_ref: HashMap<RuleRef, u32>,
    /// The peer sets of the rules of a policy being replaced, by what they
    /// resolve ([`Content`]), while its new version is resolved (see
    /// [`Rules::keep_spare`]).
    spare: Vec<(Content, PeerSet)>,
}

/// What the peer set of a rule depends on besides the identities: its
/// peers and, when one is a `podSelector` alone, the policy's namespace.
/// Rules with an ipBlock peer have none (their sets also depend on the
/// CIDR prefixes, which a policy change can change).
type Content = (Option<String>, Vec<Peer>);

/// The [`Content`] of `rule` of `policy`.
fn content(policy: &Policy, rule: &Rule) -> Option<Content> {
    if rule.peers.iter().any(|p| matches!(p, Peer::IpBlock(_))) {
        return None;
    }
    let ns = rule
        .peers
        .iter()
        .any(|p| matches!(p, Peer::Pods(_)))
        .then(|| policy.namespace.clone());
    Some((ns, rule.peers.clone()))
}

impl Rules {
    /// The rule ids of a full compile `out`; no peer set resolved yet.
    pub(super) fn new(out: &Compiled) -> Rules {
        Rules {
            peers: HashMap::new(),
            users: RuleUsers::default(),
            by_ref: out.ids.rules.iter().map(|(id, r)| (r.clone(), *id)).collect(),
            spare: Vec::new(),
        }
    }

    /// Keeps the resolved peer sets of `policy`'s rules (the version being
    /// replaced) by content, for its new version's rules that resolve the
    /// same peers (a change of ports only, say): until
    /// [`Rules::clear_spare`], which the caller calls before the
    /// identities or the CIDR prefixes change.
    pub(super) fn keep_spare(&mut self, policy: &Policy) {
        for (dir, rules) in [
            (Direction::Ingress, &policy.ingress),
            (Direction::Egress, &policy.egress),
        ] {
            for (i, rule) in rules.iter().enumerate() {
                let rk: RuleKey = (policy.namespace.clone(), policy.name.clone(), dir, i);
                if let (Some(set), Some(c)) = (self.peers.get(&rk), content(policy, rule)) {
                    if !self.spare.iter().any(|(k, _)| *k == c) {
                        self.spare.push((c, set.clone()));
                    }
                }
            }
        }
    }

    /// Forgets the sets [`Rules::keep_spare`] kept.
    pub(super) fn clear_spare(&mut self) {
        self.spare.clear();
    }

    /// The id of rule `r`, a new one (recorded in `ids`) for a new rule.
    pub(super) fn rule_id(&mut self, r: RuleRef, ids: &mut IdTables) -> u32 {
        if let Some(id) = self.by_ref.get(&r) {
            return *id;
        }
        let id = ids.next_or_provisional(NumberKind::Rule);
        ids.rules.insert(id, r.clone());
        self.by_ref.insert(r, id);
        id
    }

    /// The rule id of rule `rk`.
    pub(super) fn rule_key_id(&mut self, rk: &RuleKey, ids: &mut IdTables) -> u32 {
        self.rule_id(
            RuleRef::Policy {
                namespace: rk.0.clone(),
                name: rk.1.clone(),
                direction: rk.2,
                index: rk.3,
            },
            ids,
        )
    }

    /// Forgets the rule ids of policy `key` (in `ids` too).
    pub(super) fn forget_policy(&mut self, key: &(String, String), ids: &mut IdTables) {
        let of_policy =
            |r: &RuleRef| matches!(r, RuleRef::Policy { namespace, name, .. } if *namespace == key.0 && *name == key.1);
        let gone: Vec<RuleRef> = self.by_ref.keys().filter(|r| of_policy(r)).cloned().collect();
        for r in gone {
            if let Some(id) = self.by_ref.remove(&r) {
                ids.rules.remove(&id);
            }
        }
    }

    /// Forgets the rule ids of ClusterNetworkPolicy `name` (in `ids` too).
    pub(super) fn forget_cluster(&mut self, name: &str, ids: &mut IdTables) {
        let gone: Vec<RuleRef> = self
            .by_ref
            .keys()
            .filter(|r| matches!(r, RuleRef::Cluster { name: n, .. } if n == name))
            .cloned()
            .collect();
        for r in gone {
            if let Some(id) = self.by_ref.remove(&r) {
                ids.rules.remove(&id);
            }
        }
    }

    /// The memoized peer set of rule `rk` of `policy` (resolved on first
    /// use against `ids` and `cidrs`); `None` when the rule matches no peer
    /// and emits nothing.
    pub(super) fn peers(
        &mut self,
        policy: &Policy,
        rk: &RuleKey,
        ids: &impl IdentityGroups,
        cidrs: &BTreeMap<IpNet, u32>,
    ) -> Option<PeerSet> {
        let peers = self.resolved(policy, rk, ids, cidrs);
        (!peers.is_empty()).then(|| peers.clone())
    }

    /// The memoized peer set of rule `rk` of `policy`, by reference (see
    /// [`Rules::peers`]).
    pub(super) fn resolved(
        &mut self,
        policy: &Policy,
        rk: &RuleKey,
        ids: &impl IdentityGroups,
        cidrs: &BTreeMap<IpNet, u32>,
    ) -> &PeerSet {
        if !self.peers.contains_key(rk) {
            let rule = rule_of(policy, rk).expect("a rule of the policy");
            let kept = (!self.spare.is_empty())
                .then(|| content(policy, rule))
                .flatten()
                .and_then(|c| self.spare.iter().find(|(k, _)| *k == c))
                .map(|(_, set)| set.clone());
            let set = kept.unwrap_or_else(|| peers::resolve(policy, rule, ids, cidrs));
            self.peers.insert(rk.clone(), set);
        }
        &self.peers[rk]
    }

    /// Takes over the peer sets a full compile resolved (against the same
    /// identities and CIDR identities).
    pub(super) fn adopt_peers(&mut self, peers: crate::compile::ResolvedPeers) {
        self.peers.extend(peers);
    }

    /// Drops the peer sets of the resolved rules for which `pred` holds;
    /// returns the subjects that used them (their users are forgotten).
    pub(super) fn drop_rules(&mut self, pred: impl Fn(&RuleKey) -> bool) -> BTreeSet<u32> {
        let stale: Vec<RuleKey> = self.peers.keys().filter(|rk| pred(rk)).cloned().collect();
        let mut users = BTreeSet::new();
        for rk in stale {
            self.peers.remove(&rk);
            users.extend(self.users.remove_rule(&rk));
        }
        users
    }

    /// Subject `s` uses rule `rk`.
    pub(super) fn add_user(&mut self, rk: &RuleKey, s: u32) {
        self.users.add(rk, s);
    }

    /// Subject `s` uses no rule any more.
    pub(super) fn remove_user(&mut self, s: u32) {
        self.users.remove_subject(s);
    }

    /// The subjects using rule `rk`.
    pub(super) fn users(&self, rk: &RuleKey) -> Vec<u32> {
        self.users.of_rule(rk)
    }

    /// A new identity `id` of `key`: added to the peer sets of the rules
    /// that select it. Returns those rules, and the egress rules with an
    /// empty `to` and a named port that `key` resolves (their entries are
    /// per destination pod identity, see `emit_rule`, so a new identity
    /// that resolves the name adds entries although it is not part of the
    /// rule's peer set).
    pub(super) fn add_identity(
        &mut self,
        id: u32,
        key: &IdentityKey,
        snapshot: &Snapshot,
    ) -> (Vec<RuleKey>, Vec<RuleKey>) {
        let mut matched: Vec<RuleKey> = Vec::new();
        let mut any_named: Vec<RuleKey> = Vec::new();
        for (rk, set) in self.peers.iter_mut() {
            let Some(policy) = snapshot.policies.get(&(rk.0.clone(), rk.1.clone())) else {
                continue;
            };
            let Some(rule) = rule_of(policy, rk) else { continue };
            if rule.peers.iter().any(|p| peers::selects(policy, p, key)) {
                set.pods.insert(id);
                matched.push(rk.clone());
            } else if rk.2 == Direction::Egress
                && rule.peers.is_empty()
                && rule
                    .ports
                    .iter()
                    .any(|p| matches!(&p.port, PortSpec::Named(n) if named_port_numbers(key, n, p.protocol).next().is_some()))
            {
                any_named.push(rk.clone());
            }
        }
        (matched, any_named)
    }

    /// The subjects whose entries can have peer `id`: the users of the
    /// rules whose peer set holds it, and of the rules without peers
    /// (`IDENTITY_ANY`: an egress rule with an empty `to` and a named port
    /// has entries per destination pod identity, see `emit_rule`). No
    /// other rule emits an entry towards a pod identity (ipBlocks give CIDR
    /// identities).
    pub(super) fn users_towards(&self, id: u32) -> BTreeSet<u32> {
        let mut out = BTreeSet::new();
        for (rk, set) in &self.peers {
            if set.pods.contains(&id) || set.other.contains(&IDENTITY_ANY) {
                out.extend(self.users.by_rule.get(rk).into_iter().flatten().copied());
            }
        }
        out
    }

    /// Identity `id` is gone: removed from every peer set.
    pub(super) fn drop_identity(&mut self, id: u32) {
        for set in self.peers.values_mut() {
            set.pods.remove(&id);
        }
    }
}
