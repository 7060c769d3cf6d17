//! Which addresses a pod uses, identity keys and allocation, and the
//! longest-prefix table of CIDR identities. Which pod owns an address is
//! [`crate::ownership`].
//!
//! Allocation rules (all ids are stable across recompiles through the
//! previous [`Compiled`]; every new number comes from [`crate::numbers`],
//! whose counters only grow, so an id is never handed to something else
//! later, and whose ranges keep pod identities below the CIDR ones):
//! - pods with equal [`IdentityKey`] share one pod identity (from
//!   `IDENTITY_FIRST_POD`);
//! - every distinct ipBlock prefix has one CIDR identity (from
//!   `IDENTITY_FIRST_CIDR`);
//! - every local pod uid has one endpoint id (from 1);
//! - every rule ([`RuleRef`]) has one rule id (from 1).

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use crate::numbers::NumberKind;
use ipnet::IpNet;

use crate::compiled::{Compiled, IdTables, IdentityKey, RuleRef};
use crate::model::{Labels, Pod, PodPhase, Snapshot};

/// Spec §6 "Pod lifecycle": a pod in phase Succeeded or Failed holds no
/// address any more; a pod without an address cannot be matched by
/// address. hostNetwork pods (spec §4, "ignore them in pod/namespace
/// selectors and treat their traffic as node-IP traffic" — our choice) are
/// never pods for enforcement: their address is the node's.
pub fn is_addressable(pod: &Pod) -> bool {
    !pod.host_network && !matches!(pod.phase, PodPhase::Succeeded | PodPhase::Failed) && !pod.ips.is_empty()
}

/// The addresses a pod uses: at most one per family (the first listed).
pub fn pod_addresses(pod: &Pod) -> impl Iterator<Item = IpAddr> + '_ {
    let v4 = pod.ips.iter().find(|i| i.is_ipv4());
    let v6 = pod.ips.iter().find(|i| i.is_ipv6());
    v4.into_iter().chain(v6).copied()
}

/// Labels of a namespace; a namespace missing from the snapshot has none.
pub fn namespace_labels<'a>(snapshot: &'a Snapshot, namespace: &str) -> Option<&'a Labels> {
    snapshot.namespaces.get(namespace).map(|n| &n.labels)
}

/// The identity key of a pod.
pub fn identity_key(pod: &Pod, namespace_labels: Option<&Labels>) -> IdentityKey {
    let mut named_ports: Vec<_> = pod
        .ports
        .iter()
        .filter_map(|p| p.name.clone().map(|n| (n, p.protocol, p.port)))
        .collect();
    named_ports.sort();
    named_ports.dedup();
    IdentityKey {
        namespace: pod.namespace.clone(),
        namespace_labels: namespace_labels.cloned().unwrap_or_default(),
        pod_labels: Labels::clone(&pod.labels),
        named_ports,
    }
}

/// An address as the datapath stores it: IPv4 mapped into `::ffff:0:0/96`.
pub fn mapped(ip: IpAddr) -> u128 {
    match ip {
        IpAddr::V4(a) => (0xffffu128 << 32) | u32::from(a) as u128,
        IpAddr::V6(a) => u128::from(a),
    }
}

/// A prefix as the datapath stores it: (mapped network, mapped length).
pub fn mapped_prefix(net: &IpNet) -> (u128, u8) {
    match net {
        IpNet::V4(n) => (mapped(IpAddr::V4(n.network())), 96 + n.prefix_len()),
        IpNet::V6(n) => (u128::from(n.network()), n.prefix_len()),
    }
}

fn mask(len: u8) -> u128 {
    if len == 0 {
        0
    } else {
        u128::MAX << (128 - len as u32)
    }
}

/// Masked network -> (prefix, identity), for one prefix length.
type PrefixMap = HashMap<u128, (IpNet, u32)>;

/// Longest-prefix match over CIDR identities in the datapath's mapped
/// address space (one table for both families, like `NPM_CIDRS`).
#[derive(Clone, Debug, Default)]
pub struct PrefixTable {
    /// (length, longest first) -> masked network -> (prefix, identity).
    by_len: Vec<(u8, PrefixMap)>,
}

impl PrefixTable {
    /// Builds the table from a prefix -> identity map.
    pub fn new(cidrs: &BTreeMap<IpNet, u32>) -> Self {
        let mut m: BTreeMap<u8, HashMap<u128, (IpNet, u32)>> = BTreeMap::new();
        for (net, id) in cidrs {
            let (addr, len) = mapped_prefix(net);
            m.entry(len).or_default().insert(addr & mask(len), (*net, *id));
        }
        PrefixTable {
            by_len: m.into_iter().rev().collect(),
        }
    }

    /// The longest prefix containing `ip` and its identity.
    pub fn longest(&self, ip: IpAddr) -> Option<(IpNet, u32)> {
        let a = mapped(ip);
        self.by_len
            .iter()
            .find_map(|(len, m)| m.get(&(a & mask(*len))).copied())
    }
}

/// Hands out ids, reusing those of the previous compile. The identity
/// keys (label maps, hashed once or twice per pod) use foldhash, several
/// times faster than the default hasher on such keys.
pub(crate) struct Allocator<'p> {
    pub(crate) tables: IdTables,
    identity_by_key: foldhash::HashMap<IdentityKey, u32>,
    rule_by_ref: HashMap<RuleRef, u32>,
    prev_endpoints: Option<&'p BTreeMap<String, u32>>,
    prev_cidrs: Option<&'p BTreeMap<IpNet, u32>>,
    prev_identity_by_key: foldhash::HashMap<&'p IdentityKey, u32>,
    prev_rule_by_ref: HashMap<&'p RuleRef, u32>,
    prev_node_by_labels: HashMap<&'p Labels, u32>,
}

impl<'p> Allocator<'p> {
    pub(crate) fn new(prev: Option<&'p Compiled>) -> Self {
        let d = IdTables::default();
        let pt = prev.map_or(&d, |c| &c.ids);
        // The previous compile's counters are the floors (never reused),
        // its limits the ranges, and its provisional numbers (a used-up
        // range) stay marked.
        let tables = pt.floors();
        Allocator {
            tables,
            identity_by_key: Default::default(),
            rule_by_ref: HashMap::new(),
            prev_endpoints: prev.map(|c| &c.ids.endpoints),
            prev_cidrs: prev.map(|c| &c.cidrs),
            prev_identity_by_key: prev
                .map(|c| c.ids.identities.iter().map(|(id, k)| (k, *id)).collect())
                .unwrap_or_default(),
            prev_rule_by_ref: prev
                .map(|c| c.ids.rules.iter().map(|(id, r)| (r, *id)).collect())
                .unwrap_or_default(),
            prev_node_by_labels: prev
                .map(|c| c.ids.node_identities.iter().map(|(id, n)| (&n.labels, *id)).collect())
                .unwrap_or_default(),
        }
    }

    /// Identity of a key: the previous one if it existed, else a new one.
    pub(crate) fn identity(&mut self, key: IdentityKey) -> u32 {
        match self.identity_by_key.entry(key) {
            Entry::Occupied(e) => *e.get(),
            Entry::Vacant(e) => {
                let id = match self.prev_identity_by_key.get(e.key()) {
                    Some(id) => *id,
                    None => self.tables.next_or_provisional(NumberKind::Identity),
                };
                *e.insert(id)
            }
        }
    }

    /// Moves the identities handed out so far into `tables.identities`.
    pub(crate) fn take_identities(&mut self) -> BTreeMap<u32, IdentityKey> {
        self.identity_by_key.drain().map(|(k, id)| (id, k)).collect()
    }

    /// Endpoint id of a pod uid.
    pub(crate) fn endpoint(&mut self, uid: &str) -> u32 {
        if let Some(id) = self.tables.endpoints.get(uid) {
            return *id;
        }
        let id = match self.prev_endpoints.and_then(|m| m.get(uid)) {
            Some(id) => *id,
            None => self.tables.next_or_provisional(NumberKind::Endpoint),
        };
        self.tables.endpoints.insert(uid.to_string(), id);
        id
    }

    /// Rule id of a rule.
    pub(crate) fn rule(&mut self, rule: &RuleRef) -> u32 {
        if let Some(id) = self.rule_by_ref.get(rule) {
            return *id;
        }
        let id = match self.prev_rule_by_ref.get(rule) {
            Some(id) => *id,
            None => self.tables.next_or_provisional(NumberKind::Rule),
        };
        self.tables.rules.insert(id, rule.clone());
        self.rule_by_ref.insert(rule.clone(), id);
        id
    }

    /// Node identity of a label set (called once per label set and
    /// compile): the previous one if it existed, else a new one from the
    /// pod identity counter.
    pub(crate) fn node_identity(&mut self, labels: &Labels, nodes: Vec<String>) -> u32 {
        let id = match self.prev_node_by_labels.get(labels) {
            Some(id) => *id,
            None => self.tables.next_or_provisional(NumberKind::Identity),
        };
        self.tables.node_identities.insert(
            id,
            crate::compiled::NodeIdentity {
                labels: labels.clone(),
                nodes,
            },
        );
        id
    }

    /// CIDR identity of a prefix (called once per prefix and compile).
    pub(crate) fn cidr(&mut self, net: &IpNet) -> u32 {
        match self.prev_cidrs.and_then(|m| m.get(net)) {
            Some(id) => *id,
            None => self.tables.next_or_provisional(NumberKind::Cidr),
        }
    }
}
