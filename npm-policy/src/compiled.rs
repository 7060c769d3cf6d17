//! The compiled form: what the dataplanes program, keyed the way the
//! datapath looks packets up (see `npm-common` for the kernel layout and the
//! lookup precedence). The compiler defines it; `npm-dataplane` consumes it
//! (eBPF maps and nftables both render it).
//!
//! Every map is ordered so that two compiles of the same snapshot are equal
//! and [`Compiled::diff`] is minimal.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

use crate::model::{Labels, Protocol};
use crate::numbers::{NumberLimits, NumbersExhausted};
pub use crate::policy_map::PolicyMap;

/// Direction as seen from the endpoint (pod).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Direction {
    /// Into the pod.
    Ingress,
    /// Out of the pod.
    Egress,
}

impl Direction {
    /// The `npm_common::DIR_*` value.
    pub const fn as_u8(self) -> u8 {
        match self {
            Direction::Ingress => npm_common::DIR_INGRESS,
            Direction::Egress => npm_common::DIR_EGRESS,
        }
    }
    /// Lower-case name.
    pub const fn name(self) -> &'static str {
        match self {
            Direction::Ingress => "ingress",
            Direction::Egress => "egress",
        }
    }
}

/// Settings of one compile.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompileOptions {
    /// Local endpoints are the pods with `spec.nodeName` equal to this.
    pub node_name: String,
    /// This node's addresses: identity `IDENTITY_HOST`. Ingress from them is
    /// always allowed.
    pub node_ips: Vec<IpAddr>,
    /// Whether an egress-isolated pod may still reach its own node (the
    /// specification is ambiguous; default: no, policy governs it).
    pub allow_host_egress: bool,
    /// Every local endpoint reports its allowed new connections
    /// ([`Endpoint::report_new`]; the agent's `--flow-logs-allow`). Off,
    /// the compiler leaves `report_new` false and the agent sets it per
    /// endpoint where audit mode wants it.
    #[serde(default)]
    pub report_new: bool,
}

/// What a pod identity stands for: pods with equal keys share the identity.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct IdentityKey {
    /// Namespace.
    pub namespace: String,
    /// The namespace's labels.
    pub namespace_labels: Labels,
    /// The pod's labels.
    pub pod_labels: Labels,
    /// The pod's named container ports (name, protocol, port), sorted: pods
    /// that resolve a named port differently must not share an identity, or
    /// an egress rule with a named port would allow one pod's number on
    /// another.
    pub named_ports: Vec<(String, Protocol, u16)>,
}

/// What a node identity stands for: the other nodes with equal labels
/// share it (numbered like pod identities, kept while the label set exists).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeIdentity {
    /// The nodes' labels (the identity's key).
    pub labels: Labels,
    /// The names of the other nodes that have these labels and at least
    /// one node address (shadowed by a pod or not), sorted (for logs).
    pub nodes: Vec<String>,
}

/// Exact-address entry of the ipcache (pods cluster-wide, node addresses).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpEntry {
    /// Pod identity, node identity or `IDENTITY_HOST`.
    pub identity: u32,
    /// Identity of the longest ipBlock prefix containing the address, 0 for none.
    pub cidr_identity: u32,
    /// Who holds the address: [`IpEntry::pod_owner`] of the owning pod's
    /// UID, 0 for a node or host address. Identities are shared by every
    /// pod with the same labels, so only this tells that an address changed
    /// hands (a recycled pod IP): the dataplanes then drop the connections
    /// the old owner had with local pods. Not written to the kernel's
    /// ipcache.
    #[serde(default)]
    pub owner: u64,
}

impl IpEntry {
    /// The [`IpEntry::owner`] of a pod's addresses: its UID hashed (FNV-1a,
    /// 64 bits), never 0.
    pub fn pod_owner(uid: &str) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in uid.bytes() {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h.max(1)
    }
}

/// A pod, by reference.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PodRef {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// metadata.uid.
    pub uid: String,
}

/// A local endpoint (a pod on this node that has an address).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Endpoint {
    /// The pod.
    pub pod: PodRef,
    /// The pod's identity: also its policy *subject*, the `subject` of the
    /// [`PolicyEntry`]s that govern it.
    pub identity: u32,
    /// IPv4 address.
    pub ipv4: Option<Ipv4Addr>,
    /// IPv6 address.
    pub ipv6: Option<Ipv6Addr>,
    /// Some policy selects it for ingress.
    pub isolated_ingress: bool,
    /// Some policy selects it for egress.
    pub isolated_egress: bool,
    /// Which ClusterNetworkPolicy tiers have entries for its subject, per
    /// direction (derived from [`Compiled::tiers`]: the datapath skips a
    /// tier's lookups when its flag is clear).
    pub tiers: TierPresence,
    /// Report the new connections this endpoint's dataplane allows (both
    /// directions): the datapath emits an allow event for the packet that
    /// creates each new tracked flow, rate-limited like deny events. Set
    /// for endpoints an audited policy (`npm.io/audit: "true"`) selects,
    /// or for every endpoint with `--flow-logs-allow`; it never changes a
    /// verdict.
    #[serde(default)]
    pub report_new: bool,
}

/// Which ClusterNetworkPolicy tiers have [`TierEntry`]s for one endpoint,
/// per direction. All false: the endpoint is decided by NetworkPolicy
/// alone, exactly as without ClusterNetworkPolicies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct TierPresence {
    /// Admin-tier entries for ingress.
    pub admin_ingress: bool,
    /// Admin-tier entries for egress.
    pub admin_egress: bool,
    /// Baseline-tier entries for ingress.
    pub baseline_ingress: bool,
    /// Baseline-tier entries for egress.
    pub baseline_egress: bool,
}

impl TierPresence {
    /// Whether `tier` has entries in `direction`.
    pub const fn has(&self, tier: Tier, direction: Direction) -> bool {
        match (tier, direction) {
            (Tier::Admin, Direction::Ingress) => self.admin_ingress,
            (Tier::Admin, Direction::Egress) => self.admin_egress,
            (Tier::Baseline, Direction::Ingress) => self.baseline_ingress,
            (Tier::Baseline, Direction::Egress) => self.baseline_egress,
        }
    }
    /// Marks `tier` as having entries in `direction`.
    pub fn set(&mut self, tier: Tier, direction: Direction) {
        match (tier, direction) {
            (Tier::Admin, Direction::Ingress) => self.admin_ingress = true,
            (Tier::Admin, Direction::Egress) => self.admin_egress = true,
            (Tier::Baseline, Direction::Ingress) => self.baseline_ingress = true,
            (Tier::Baseline, Direction::Egress) => self.baseline_egress = true,
        }
    }
    /// No tier has entries in either direction.
    pub const fn is_empty(&self) -> bool {
        !(self.admin_ingress || self.admin_egress || self.baseline_ingress || self.baseline_egress)
    }
}

/// A ClusterNetworkPolicy tier (`spec.tier`). Per direction the order is:
/// Admin, then NetworkPolicy (when it isolates the pod), then Baseline,
/// then allow.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Tier {
    /// `Admin`: decided before NetworkPolicy.
    Admin,
    /// `Baseline`: decided after NetworkPolicy, when none isolates the pod.
    Baseline,
}

impl Tier {
    /// The API spelling.
    pub const fn name(self) -> &'static str {
        match self {
            Tier::Admin => "Admin",
            Tier::Baseline => "Baseline",
        }
    }
}

/// What the first matching rule of a tier does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum TierAction {
    /// Allow (final; replies too).
    Accept,
    /// Drop silently (final).
    Deny,
    /// Skip the rest of the tier: go on to the next step of the order.
    Pass,
}

/// One entry of a tier's table for one subject (the pod identity of local
/// endpoints, as for [`PolicyEntry`]) and direction.
///
/// The compiler guarantees, for one (`subject`, `direction`, `tier`,
/// `peer`): the entries of one protocol have disjoint port ranges, and at
/// most one entry has `protocol: None`. A packet's match for one peer
/// identity is its *most specific* entry: the entry of its protocol whose
/// range holds its destination port, else the `protocol: None` entry.
/// That entry's [`TierValue`] is the first rule of the tier (lowest
/// [`TierValue::rank`]) that matches the packet for that identity (the
/// compiler folds every less specific rule into the more specific
/// entries). The tier's decision for a packet is, among its peer
/// identities (pod or node identity, CIDR identity, `IDENTITY_ANY`), the
/// matched entry with the lowest rank; no entry: the tier does not decide.
/// This is exactly an LPM lookup per identity and a minimum over three.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TierEntry {
    /// The pod identity of the local endpoints the entry applies to.
    pub subject: u32,
    /// Direction from the endpoint.
    pub direction: Direction,
    /// Tier.
    pub tier: Tier,
    /// Peer identity (pod, node, CIDR) or `IDENTITY_ANY`.
    pub peer: u32,
    /// `None`: every protocol and port (see the type's documentation).
    pub protocol: Option<Protocol>,
    /// Inclusive destination port range (`0..=65535` for every port);
    /// ignored when `protocol` is `None`.
    pub ports: (u16, u16),
}

impl TierEntry {
    /// The lowest entry of subject `subject`, direction `direction`, tier
    /// `tier` and peer `peer` (`protocol: None`, ports `(0, 0)`): the
    /// entries of one subject are contiguous, ordered by direction, tier,
    /// then peer, so a range from it walks that peer's entries.
    pub fn first(subject: u32, direction: Direction, tier: Tier, peer: u32) -> TierEntry {
        TierEntry {
            subject,
            direction,
            tier,
            peer,
            protocol: None,
            ports: (0, 0),
        }
    }
}

/// The decision of a [`TierEntry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TierValue {
    /// The rule's action.
    pub action: TierAction,
    /// The rule's place in its tier's total order (priority, then the
    /// policy name, then the rule's index): lower is decided first. Unique
    /// per rule within a tier and direction; below 2^30. Not necessarily
    /// dense (see `tiers::compile::ranked_rules`): only the comparison
    /// matters.
    pub rank: u32,
    /// Rule id ([`IdTables::rules`]: a [`RuleRef::Cluster`]).
    pub rule: u32,
}

/// One allow entry of the policy map.
///
/// Entries are keyed by *subject*, not by endpoint: what NetworkPolicy
/// allows a pod is a function of its identity key alone (namespace, its
/// labels, the pod's labels, its named ports), so every local endpoint of
/// pod identity `S` ([`Endpoint::identity`]) is governed by the entries
/// with `subject: S`, and two endpoints of one identity share them (no
/// entry is repeated per endpoint). An identity is a subject while at
/// least one local endpoint has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct PolicyEntry {
    /// The pod identity of the local endpoints the entry applies to.
    pub subject: u32,
    /// Direction from the endpoint.
    pub direction: Direction,
    /// Peer identity (pod, CIDR, `IDENTITY_HOST`) or `IDENTITY_ANY`.
    pub peer: u32,
    /// `None`: every protocol and port (a rule without ports).
    pub protocol: Option<Protocol>,
    /// Inclusive destination port range (`0..=65535` for every port);
    /// ignored when `protocol` is `None`.
    pub ports: (u16, u16),
}

/// Where an allow entry comes from.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum RuleRef {
    /// Rule `index` of the `direction` rules of policy `namespace/name`.
    Policy {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Direction.
        direction: Direction,
        /// Index in `ingress` or `egress`.
        index: usize,
    },
    /// The `allow_host_egress` setting.
    HostEgress,
    /// Rule `index` of the `direction` rules of ClusterNetworkPolicy `name`.
    Cluster {
        /// The policy's tier.
        tier: Tier,
        /// Name (the policy is cluster-scoped).
        name: String,
        /// Direction.
        direction: Direction,
        /// Index in `ingress` or `egress`.
        index: usize,
    },
}

/// The compiled policy of one node.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Compiled {
    /// Exact addresses -> identities (every pod with an address, cluster-wide,
    /// and this node's addresses).
    pub ipcache: BTreeMap<IpAddr, IpEntry>,
    /// ipBlock prefixes (`cidr` and `except` entries) -> CIDR identity.
    /// The longest prefix containing an address is its CIDR identity.
    pub cidrs: BTreeMap<IpNet, u32>,
    /// Local endpoints by endpoint id.
    pub endpoints: BTreeMap<u32, Endpoint>,
    /// Allow entries (keyed by subject: the endpoints' pod identity, see
    /// [`PolicyEntry`]) -> rule id, one map per (subject, direction).
    pub policy: PolicyMap,
    /// ClusterNetworkPolicy tier entries, keyed by subject (see [`TierEntry`]).
    pub tiers: BTreeMap<TierEntry, TierValue>,
    /// Allocation state, kept so that ids are stable across recompiles.
    pub ids: IdTables,
}

/// Allocation tables of a compile; [`crate::compile()`] reuses those of the
/// previous compile, so ids stay stable while what they stand for exists.
/// New numbers and floors go through [`crate::numbers`] only.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdTables {
    /// Pod identity -> what it stands for.
    pub identities: BTreeMap<u32, IdentityKey>,
    /// Node identity -> what it stands for (from the same number space as
    /// pod identities; see [`crate::nodes`]).
    #[serde(default)]
    pub node_identities: BTreeMap<u32, NodeIdentity>,
    /// Pod uid -> endpoint id.
    pub endpoints: BTreeMap<String, u32>,
    /// Rule id -> rule.
    pub rules: BTreeMap<u32, RuleRef>,
    /// Next endpoint id to hand out. Endpoint ids are never reused, so a new
    /// pod can never inherit a deleted pod's conntrack or fragment state.
    pub next_endpoint: u32,
    /// Next pod identity to hand out (never reused while the agent runs).
    pub next_identity: u32,
    /// Next rule id to hand out.
    pub next_rule: u32,
    /// Next CIDR identity to hand out (from `IDENTITY_FIRST_CIDR`).
    pub next_cidr: u32,
    /// The range of each kind of number (kept from compile to compile
    /// like the counters; see [`crate::numbers`]).
    #[serde(default, skip_serializing_if = "NumberLimits::is_default")]
    pub limits: NumberLimits,
    /// Set when a number this compile needed was past its range (see
    /// [`IdTables::exhausted`]): the compile must not be programmed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub exhausted: Option<NumbersExhausted>,
    /// How many provisional numbers (past a used-up range) this compile
    /// and the ones it follows handed out, from `u32::MAX` down.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub provisional: u32,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Changes to one map: entries to write, keys to delete.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MapDiff<K, V> {
    /// Entries added or changed.
    pub upsert: Vec<(K, V)>,
    /// Keys removed.
    pub remove: Vec<K>,
}

impl<K, V> Default for MapDiff<K, V> {
    fn default() -> Self {
        MapDiff {
            upsert: Vec::new(),
            remove: Vec::new(),
        }
    }
}

impl MapDiff<PolicyEntry, u32> {
    /// [`MapDiff::apply_to`] for the grouped policy map.
    pub fn apply_to_policy(&self, map: &mut PolicyMap) {
        for k in &self.remove {
            map.remove(k);
        }
        for (k, v) in &self.upsert {
            map.insert(*k, *v);
        }
    }
}

impl<K: Ord + Clone, V: PartialEq + Clone> MapDiff<K, V> {
    /// The minimal changes that turn `old` into `new`.
    pub fn between(old: &BTreeMap<K, V>, new: &BTreeMap<K, V>) -> Self {
        let mut d = MapDiff::default();
        d.extend_between(old.iter(), new.iter());
        d
    }

    /// Adds the changes that turn the entries `old` into `new` (both in key
    /// order; e.g. the same key range of two maps).
    pub fn extend_between<'a>(
        &mut self,
        old: impl Iterator<Item = (&'a K, &'a V)>,
        new: impl Iterator<Item = (&'a K, &'a V)>,
    ) where
        K: 'a,
        V: 'a,
    {
        // One merge walk over both ordered sequences: linear, no lookups.
        let d = self;
        let (mut o, mut n) = (old.peekable(), new.peekable());
        loop {
            match (o.peek(), n.peek()) {
                (None, None) => break,
                (Some((ok, _)), None) => {
                    d.remove.push((*ok).clone());
                    o.next();
                }
                (None, Some((nk, nv))) => {
                    d.upsert.push(((*nk).clone(), (*nv).clone()));
                    n.next();
                }
                (Some((ok, ov)), Some((nk, nv))) => match ok.cmp(nk) {
                    std::cmp::Ordering::Less => {
                        d.remove.push((*ok).clone());
                        o.next();
                    }
                    std::cmp::Ordering::Greater => {
                        d.upsert.push(((*nk).clone(), (*nv).clone()));
                        n.next();
                    }
                    std::cmp::Ordering::Equal => {
                        if ov != nv {
                            d.upsert.push(((*nk).clone(), (*nv).clone()));
                        }
                        o.next();
                        n.next();
                    }
                },
            }
        }
    }

    /// Applies the diff to `map` (what [`MapDiff::between`]`(map, new)`
    /// gives turns `map` into `new`).
    pub fn apply_to(&self, map: &mut BTreeMap<K, V>) {
        for k in &self.remove {
            map.remove(k);
        }
        for (k, v) in &self.upsert {
            map.insert(k.clone(), v.clone());
        }
    }

    /// Nothing to change.
    pub fn is_empty(&self) -> bool {
        self.upsert.is_empty() && self.remove.is_empty()
    }

    /// Number of changes.
    pub fn len(&self) -> usize {
        self.upsert.len() + self.remove.len()
    }
}

/// What a dataplane applies to go from one compiled form to the next.
///
/// Apply order that never opens a gap in enforcement (the loader follows it):
/// policy upserts, ipcache and CIDR upserts, endpoint upserts, then policy
/// removals, ipcache and CIDR removals, endpoint removals. New allows exist
/// before an address or an isolation flag points at them; old allows go only
/// after nothing needs them.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompiledDiff {
    /// ipcache changes.
    pub ipcache: MapDiff<IpAddr, IpEntry>,
    /// CIDR prefix changes.
    pub cidrs: MapDiff<IpNet, u32>,
    /// Endpoint changes.
    pub endpoints: MapDiff<u32, Endpoint>,
    /// Policy entry changes.
    pub policy: MapDiff<PolicyEntry, u32>,
    /// Tier entry changes (applied with the policy entries: upserts first,
    /// removals after the endpoints).
    pub tiers: MapDiff<TierEntry, TierValue>,
}

impl CompiledDiff {
    /// Nothing to change.
    pub fn is_empty(&self) -> bool {
        self.ipcache.is_empty()
            && self.cidrs.is_empty()
            && self.endpoints.is_empty()
            && self.policy.is_empty()
            && self.tiers.is_empty()
    }
    /// Number of changes.
    pub fn len(&self) -> usize {
        self.ipcache.len() + self.cidrs.len() + self.endpoints.len() + self.policy.len() + self.tiers.len()
    }
}

impl Compiled {
    /// The minimal diff from `self` (what is programmed) to `next`.
    pub fn diff(&self, next: &Compiled) -> CompiledDiff {
        self.diff_with_tiers_of(next, None)
    }

    /// [`Compiled::diff`] when the tier entries of `self` and `next` can
    /// differ only for the subjects `tier_subjects` (`None`: any): only
    /// those subjects' tier entries are compared, not every entry (the
    /// incremental compiler says which subjects, see
    /// [`crate::incremental::Compiler::take_tier_touched`]). Debug builds
    /// check the result against the full comparison.
    pub fn diff_with_tiers_of(&self, next: &Compiled, tier_subjects: Option<&BTreeSet<u32>>) -> CompiledDiff {
        let tiers = match tier_subjects {
            None => MapDiff::between(&self.tiers, &next.tiers),
            Some(subjects) => {
                let mut tiers = MapDiff::default();
                for &id in subjects {
                    let lo = TierEntry {
                        subject: id,
                        direction: Direction::Ingress,
                        tier: Tier::Admin,
                        peer: 0,
                        protocol: None,
                        ports: (0, 0),
                    };
                    let same = |(e, _): &(&TierEntry, &TierValue)| e.subject == id;
                    tiers.extend_between(
                        self.tiers.range(lo..).take_while(same),
                        next.tiers.range(lo..).take_while(same),
                    );
                }
                debug_assert_eq!(
                    tiers,
                    MapDiff::between(&self.tiers, &next.tiers),
                    "tier entries changed outside the subjects named"
                );
                tiers
            }
        };
        CompiledDiff {
            ipcache: MapDiff::between(&self.ipcache, &next.ipcache),
            cidrs: MapDiff::between(&self.cidrs, &next.cidrs),
            endpoints: MapDiff::between(&self.endpoints, &next.endpoints),
            policy: {
                let mut d = MapDiff::default();
                d.extend_between(self.policy.iter(), next.policy.iter());
                d
            },
            tiers,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The merge-walk diff is minimal and `apply_to` turns the old map into
    /// the new one, over many overlapping pairs of maps.
    #[test]
    fn map_diff_between_and_apply_to() {
        let mut rnd = npm_testkit::rng::xorshift(7);
        for _ in 0..200 {
            let n = (rnd() % 40) as usize;
            let old: BTreeMap<u32, u32> = (0..n).map(|_| ((rnd() % 50) as u32, (rnd() % 3) as u32)).collect();
            let new: BTreeMap<u32, u32> = (0..n).map(|_| ((rnd() % 50) as u32, (rnd() % 3) as u32)).collect();
            let d = MapDiff::between(&old, &new);
            let want_upsert: Vec<(u32, u32)> = new
                .iter()
                .filter(|(k, v)| old.get(k) != Some(v))
                .map(|(k, v)| (*k, *v))
                .collect();
            let want_remove: Vec<u32> = old.keys().filter(|k| !new.contains_key(k)).copied().collect();
            assert_eq!(d.upsert, want_upsert);
            assert_eq!(d.remove, want_remove);
            let mut applied = old.clone();
            d.apply_to(&mut applied);
            assert_eq!(applied, new);
            assert!(MapDiff::between(&new, &new).is_empty());
        }
    }
}
