//! The pod identities of the incremental compiler: which identity each pod
//! has, how many pods use each one, and the identities by key and by
//! namespace. The identity table itself is the compiled form's
//! (`ids.identities`); [`PodIdentities::register`] and
//! [`PodIdentities::forget`] update it together with the indexes here.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::hash::BuildHasher;

use foldhash::fast::RandomState;

use crate::compiled::{Compiled, IdentityKey};
use crate::model::Snapshot;
use crate::ownership::PodKey;
use crate::peers::IdentityGroups;

use super::addresses::Addresses;

/// Pod identities with reference counts and indexes.
#[derive(Clone, Debug)]
pub(super) struct PodIdentities {
    /// Pod -> its identity (pods owning an address).
    of_pod: HashMap<PodKey, u32>,
    /// Identity -> pods having it.
    refs: HashMap<u32, usize>,
    /// Hash of a key -> the identities whose key has that hash (almost
    /// always one): the keys themselves are in the identity table, not
    /// copied here.
    by_hash: HashMap<u64, Vec<u32>>,
    /// The hasher of `by_hash` (foldhash: the keys are label maps).
    hasher: RandomState,
    /// Namespace -> identities of its pods.
    by_namespace: BTreeMap<String, BTreeSet<u32>>,
}

impl PodIdentities {
    /// The identities of a full compile `out` of `snapshot`, each pod
    /// having the identity of the ipcache entry of an address it owns.
    pub(super) fn new(out: &Compiled, snapshot: &Snapshot, addresses: &Addresses) -> PodIdentities {
        let mut ids = PodIdentities {
            of_pod: HashMap::with_capacity(snapshot.pods.len()),
            refs: HashMap::with_capacity(out.ids.identities.len()),
            by_hash: HashMap::with_capacity(out.ids.identities.len()),
            hasher: RandomState::default(),
            by_namespace: BTreeMap::new(),
        };
        for (id, k) in &out.ids.identities {
            ids.by_hash.entry(ids.hasher.hash_one(k)).or_default().push(*id);
            match ids.by_namespace.get_mut(&k.namespace) {
                Some(set) => {
                    set.insert(*id);
                }
                None => {
                    ids.by_namespace.insert(k.namespace.clone(), [*id].into());
                }
            }
        }
        for (pk, pod) in &snapshot.pods {
            if let Some(ip) = addresses.owned(pk, pod).first() {
                // The owner's key: the copy the claims hold.
                let shared = addresses.owner(*ip).expect("owned").clone();
                ids.assign(shared, out.ipcache[ip].identity);
            }
        }
        ids
    }

    /// The identity of key `key` in `table` (the identity table), if
    /// there is one.
    pub(super) fn get(&self, key: &IdentityKey, table: &BTreeMap<u32, IdentityKey>) -> Option<u32> {
        self.by_hash
            .get(&self.hasher.hash_one(key))?
            .iter()
            .copied()
            .find(|id| table.get(id) == Some(key))
    }

    /// The identity of pod `pk` (which owns an address).
    pub(super) fn of_pod(&self, pk: &PodKey) -> u32 {
        self.of_pod[pk]
    }

    /// The key of pod `pk` as this table holds it (tests: which copy).
    #[cfg(test)]
    pub(super) fn key_of(&self, pk: &(String, String)) -> Option<&PodKey> {
        self.of_pod.get_key_value(pk).map(|(k, _)| k)
    }

    /// Pod `pk` has identity `id`.
    pub(super) fn assign(&mut self, pk: PodKey, id: u32) {
        *self.refs.entry(id).or_default() += 1;
        self.of_pod.insert(pk, id);
    }

    /// Pod `pk` gives its identity up. An identity left without pods is
    /// dropped only by [`PodIdentities::take_orphans`], after a refresh: a
    /// pod that comes back with the same key keeps it.
    pub(super) fn release(&mut self, pk: &PodKey) {
        if let Some(id) = self.of_pod.remove(pk) {
            let r = self.refs.get_mut(&id).expect("counted");
            *r -= 1;
        }
    }

    /// The identities without pods, no longer counted.
    pub(super) fn take_orphans(&mut self) -> Vec<u32> {
        let orphans: Vec<u32> = self.refs.iter().filter(|(_, r)| **r == 0).map(|(id, _)| *id).collect();
        for id in &orphans {
            self.refs.remove(id);
        }
        orphans
    }

    /// Registers the new identity `id` of `key` in `table` and here.
    pub(super) fn register(&mut self, id: u32, key: IdentityKey, table: &mut BTreeMap<u32, IdentityKey>) {
        self.by_namespace.entry(key.namespace.clone()).or_default().insert(id);
        self.by_hash.entry(self.hasher.hash_one(&key)).or_default().push(id);
        table.insert(id, key);
    }

    /// Forgets identity `id` in `table` and here.
    pub(super) fn forget(&mut self, id: u32, table: &mut BTreeMap<u32, IdentityKey>) {
        if let Some(k) = table.remove(&id) {
            let h = self.hasher.hash_one(&k);
            if let Some(ids) = self.by_hash.get_mut(&h) {
                ids.retain(|i| *i != id);
                if ids.is_empty() {
                    self.by_hash.remove(&h);
                }
            }
            if let Some(s) = self.by_namespace.get_mut(&k.namespace) {
                s.remove(&id);
                if s.is_empty() {
                    self.by_namespace.remove(&k.namespace);
                }
            }
        }
    }

    /// The identities grouped by namespace, with their keys from `table`,
    /// for the peer resolution.
    pub(super) fn groups<'a>(&'a self, table: &'a BTreeMap<u32, IdentityKey>) -> Groups<'a> {
        Groups {
            by_namespace: &self.by_namespace,
            table,
        }
    }
}

/// [`PodIdentities`] by namespace with the keys of the identity table.
pub(super) struct Groups<'a> {
    by_namespace: &'a BTreeMap<String, BTreeSet<u32>>,
    table: &'a BTreeMap<u32, IdentityKey>,
}

impl IdentityGroups for Groups<'_> {
    fn in_namespace(&self, ns: &str) -> impl Iterator<Item = (u32, &IdentityKey)> {
        let table = self.table;
        self.by_namespace
            .get(ns)
            .into_iter()
            .flatten()
            .map(move |id| (*id, &table[id]))
    }

    fn groups(&self) -> impl Iterator<Item = impl Iterator<Item = (u32, &IdentityKey)> + Clone> {
        let table = self.table;
        self.by_namespace
            .values()
            .map(move |g| g.iter().map(move |id| (*id, &table[id])))
    }
}
