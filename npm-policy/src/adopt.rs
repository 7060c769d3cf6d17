//! The numbers a restarted agent adopts from the state a previous agent
//! left in the kernel: which pod identities and CIDR identities keep their number,
//! and the floors every new number is handed out above. Pure: the
//! dataplane reads [`AdoptedNumbers`] from its maps, [`seed`] turns them
//! and a first compile into the `prev` of the real compile
//! ([`crate::compile()`], [`crate::incremental::Compiler::new`]).
//!
//! The rule. What a number means in the kernel is the set of addresses
//! that carry it (the policy keys naming it are that set's allowances).
//! A pod identity `N` is kept for identity key `K` only when the addresses
//! that carried `N` are exactly the addresses `K` has now; every other key
//! gets a number above every adopted one. A restarted agent rewrites the
//! ipcache before it sweeps the old policy keys, so during its first sync
//! every address carries either its old number (with the old allowances)
//! or its new one (with the new allowances), never a number that used to
//! stand for other addresses. CIDR identities are kept by prefix (the
//! prefix is their whole meaning); rule ids are only values (they
//! attribute verdicts) and are numbered above every adopted one.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use ipnet::IpNet;
use npm_common::{IDENTITY_FIRST_CIDR, IDENTITY_FIRST_POD};

use crate::compiled::{Compiled, IdTables};
use crate::numbers::NumberKind;

/// The numbers found in a previous agent's kernel state.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdoptedNumbers {
    /// Pod identity (`IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR`) -> the
    /// addresses that carry it.
    pub identities: BTreeMap<u32, BTreeSet<IpAddr>>,
    /// Prefix -> its CIDR identity.
    pub cidrs: BTreeMap<IpNet, u32>,
    /// The highest rule id found (0: none).
    pub max_rule: u32,
    /// The highest policy subject found (the `subject` of the policy keys
    /// and of the endpoint records; 0: none). Subjects are pod
    /// identities: a new pod identity is numbered above it too, so a
    /// number whose policy keys are still in the kernel is never given to
    /// another identity key (one with no address left in the ipcache
    /// included).
    #[doc(alias = "subject")]
    pub max_subject: u32,
}

impl AdoptedNumbers {
    /// Whether nothing was adopted.
    pub fn is_empty(&self) -> bool {
        self.identities.is_empty() && self.cidrs.is_empty() && self.max_rule == 0 && self.max_subject == 0
    }

    /// The highest pod identity adopted, if any.
    pub fn max_identity(&self) -> Option<u32> {
        self.identities.keys().next_back().copied()
    }

    /// The highest CIDR identity adopted, if any.
    pub fn max_cidr(&self) -> Option<u32> {
        self.cidrs.values().max().copied()
    }
}

/// The addresses of each pod (and node) identity of `compiled`'s ipcache.
pub fn addresses_by_identity(compiled: &Compiled) -> BTreeMap<u32, BTreeSet<IpAddr>> {
    let mut out: BTreeMap<u32, BTreeSet<IpAddr>> = BTreeMap::new();
    for (ip, e) in &compiled.ipcache {
        if (IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR).contains(&e.identity) {
            out.entry(e.identity).or_default().insert(*ip);
        }
    }
    out
}

/// The `prev` of a compile that keeps the adopted numbers' meaning: from a
/// first compile `fresh` of the current state (numbered without regard to
/// the adopted state; only its identity keys and their addresses are
/// used), each identity key whose addresses are exactly those of an
/// adopted identity keeps that identity, each adopted prefix still wanted
/// keeps its CIDR identity, and every counter starts above every adopted
/// number. The endpoint ids are the caller's (`ids.endpoints`,
/// `next_endpoint` stay empty/0).
pub fn seed(fresh: &Compiled, adopted: &AdoptedNumbers) -> Compiled {
    let by_addresses: HashMap<&BTreeSet<IpAddr>, u32> = adopted
        .identities
        .iter()
        .filter(|(id, a)| (IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR).contains(*id) && !a.is_empty())
        .map(|(id, a)| (a, *id))
        .collect();
    let mut identities = BTreeMap::new();
    let mut node_identities = BTreeMap::new();
    for (fresh_id, addrs) in addresses_by_identity(fresh) {
        let Some(old) = by_addresses.get(&addrs) else {
            continue;
        };
        // Node identities share the pod identity space and are adopted by
        // the same rule (their addresses are exactly the adopted set).
        if let Some(key) = fresh.ids.identities.get(&fresh_id) {
            identities.insert(*old, key.clone());
        } else if let Some(n) = fresh.ids.node_identities.get(&fresh_id) {
            node_identities.insert(*old, n.clone());
        }
    }
    let cidrs: BTreeMap<IpNet, u32> = fresh
        .cidrs
        .keys()
        .filter_map(|net| adopted.cidrs.get(net).map(|id| (*net, *id)))
        .filter(|(_, id)| *id >= IDENTITY_FIRST_CIDR)
        .collect();
    let mut ids = IdTables {
        identities,
        node_identities,
        ..IdTables::default()
    };
    // Every counter above every adopted number (a policy subject is a pod
    // identity too).
    if let Some(m) = adopted.max_identity() {
        ids.raise_floor(NumberKind::Identity, m.saturating_add(1));
    }
    ids.raise_floor(NumberKind::Identity, adopted.max_subject.saturating_add(1));
    if let Some(m) = adopted.max_cidr() {
        ids.raise_floor(NumberKind::Cidr, m.saturating_add(1));
    }
    ids.raise_floor(NumberKind::Rule, adopted.max_rule.saturating_add(1));
    for kind in [NumberKind::Identity, NumberKind::Cidr] {
        ids.raise_floor(kind, kind.first());
    }
    Compiled {
        ids,
        cidrs,
        ..Compiled::default()
    }
}
