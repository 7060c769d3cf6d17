//! [`Objects`]: the objects of one kind by key, as a persistent ordered
//! map. A store's complete state, the [`super::CompleteState`] a sync works
//! on and the state the compiler last converted are copies of one map that
//! share its structure: a copy is a pointer, an update copies only the
//! path to the changed key, and the [`Objects::diff`] of two copies visits
//! only the subtrees they do not share. So the per-sync work of the object
//! diff follows the change, not the cluster.
//!
//! The diff stays level-triggered: it compares two complete states, never
//! a list of events. After a relist the new state shares no structure with
//! the old one (the store builds it from the list), and the diff walks
//! both whole, exactly as a diff of two sorted lists did.

use std::fmt;
use std::sync::Arc;

use imbl::ordmap::DiffItem;
use imbl::OrdMap;
use kube::Resource;

use super::store::{key_of, ObjKey};

/// One stored object. Two are equal when the object cannot have changed:
/// the same pointer, or the same resourceVersion (set) and uid.
struct Stored<K>(Arc<K>);

impl<K> Clone for Stored<K> {
    fn clone(&self) -> Self {
        Stored(self.0.clone())
    }
}

impl<K: Resource> PartialEq for Stored<K> {
    fn eq(&self, other: &Self) -> bool {
        #[cfg(test)]
        tests::COMPARED.with(|c| c.set(c.get() + 1));
        !changed(&self.0, &other.0)
    }
}

/// Whether the stored object `old` and the current `new` may differ.
pub fn changed<K: Resource>(old: &Arc<K>, new: &Arc<K>) -> bool {
    if Arc::ptr_eq(old, new) {
        return false;
    }
    let (o, n) = (old.meta(), new.meta());
    o.resource_version.is_none() || o.resource_version != n.resource_version || o.uid != n.uid
}

/// The objects of one kind, one per `(namespace, name)`, in key order.
/// Cloning is O(1) and the clones share structure.
pub struct Objects<K> {
    map: OrdMap<Arc<ObjKey>, Stored<K>>,
}

impl<K> Clone for Objects<K> {
    fn clone(&self) -> Self {
        Objects { map: self.map.clone() }
    }
}

impl<K> Default for Objects<K> {
    fn default() -> Self {
        Objects { map: OrdMap::new() }
    }
}

impl<K> fmt::Debug for Objects<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.map.keys()).finish()
    }
}

impl<K: Resource> Objects<K> {
    /// No objects.
    pub fn new() -> Self {
        Objects::default()
    }

    /// How many objects.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The objects in key order.
    pub fn iter(&self) -> impl DoubleEndedIterator<Item = &Arc<K>> + ExactSizeIterator + '_ {
        self.map.values().map(|s| &s.0)
    }

    /// The keys in order.
    pub fn keys(&self) -> impl DoubleEndedIterator<Item = &ObjKey> + ExactSizeIterator + '_ {
        self.map.keys().map(|k| k.as_ref())
    }

    /// The object of `key`.
    pub fn get(&self, key: &ObjKey) -> Option<&Arc<K>> {
        self.map.get(key).map(|s| &s.0)
    }

    /// Whether an object of `key` is here.
    pub fn contains_key(&self, key: &ObjKey) -> bool {
        self.map.contains_key(key)
    }

    /// `(key, object)` pairs in key order.
    pub fn entries(&self) -> impl DoubleEndedIterator<Item = (&ObjKey, &Arc<K>)> + ExactSizeIterator + '_ {
        self.map.iter().map(|(k, s)| (k.as_ref(), &s.0))
    }

    /// Store `obj` under its key; returns the object it replaces.
    pub fn insert(&mut self, obj: Arc<K>) -> Option<Arc<K>> {
        let key = key_of(obj.as_ref());
        self.insert_at(key, obj)
    }

    /// Store `obj` under `key` (its [`key_of`], computed by the caller);
    /// returns the object it replaces.
    pub fn insert_at(&mut self, key: ObjKey, obj: Arc<K>) -> Option<Arc<K>> {
        self.map.insert(Arc::new(key), Stored(obj)).map(|s| s.0)
    }

    /// Remove the object of `key`; returns it.
    pub fn remove(&mut self, key: &ObjKey) -> Option<Arc<K>> {
        self.map.remove(key).map(|s| s.0)
    }

    /// Keep only the objects `keep` accepts.
    pub fn retain(&mut self, mut keep: impl FnMut(&Arc<K>) -> bool) {
        let gone: Vec<Arc<ObjKey>> = self
            .map
            .iter()
            .filter(|(_, s)| !keep(&s.0))
            .map(|(k, _)| k.clone())
            .collect();
        for k in gone {
            self.map.remove(&k);
        }
    }

    /// Remove every object.
    pub fn clear(&mut self) {
        self.map.clear();
    }

    /// Whether both are copies of the same map, unchanged since.
    pub fn ptr_eq(&self, other: &Self) -> bool {
        self.map.ptr_eq(&other.map)
    }

    /// The objects of `new` added or changed since `self` (see
    /// [`changed`]), and the keys of `self` gone from `new`, in key order.
    /// Subtrees the two share are skipped without a look at them.
    pub fn diff(&self, new: &Objects<K>) -> (Vec<Arc<K>>, Vec<ObjKey>) {
        let mut upserts = Vec::new();
        let mut removed = Vec::new();
        for item in self.map.diff(&new.map) {
            match item {
                DiffItem::Add(_, n) | DiffItem::Update { new: (_, n), .. } => upserts.push(n.0.clone()),
                DiffItem::Remove(k, _) => removed.push(ObjKey::clone(k)),
            }
        }
        (upserts, removed)
    }
}

impl<K: Resource> FromIterator<Arc<K>> for Objects<K> {
    /// One object per key: of two with the same key, the later one.
    fn from_iter<I: IntoIterator<Item = Arc<K>>>(iter: I) -> Self {
        let mut out = Objects::new();
        for o in iter {
            out.insert(o);
        }
        out
    }
}

impl<K: Resource> From<std::collections::BTreeMap<ObjKey, Arc<K>>> for Objects<K> {
    fn from(m: std::collections::BTreeMap<ObjKey, Arc<K>>) -> Self {
        Objects {
            map: m.into_iter().map(|(k, o)| (Arc::new(k), Stored(o))).collect(),
        }
    }
}

impl<K: Resource> From<Vec<Arc<K>>> for Objects<K> {
    fn from(v: Vec<Arc<K>>) -> Self {
        v.into_iter().collect()
    }
}

impl<K: Resource> Extend<Arc<K>> for Objects<K> {
    fn extend<I: IntoIterator<Item = Arc<K>>>(&mut self, iter: I) {
        for o in iter {
            self.insert(o);
        }
    }
}

impl<'a, K: Resource> IntoIterator for &'a Objects<K> {
    type Item = &'a Arc<K>;
    type IntoIter = Box<dyn Iterator<Item = &'a Arc<K>> + 'a>;
    fn into_iter(self) -> Self::IntoIter {
        Box::new(self.iter())
    }
}

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::ObjectMeta;

    use super::*;

    thread_local! {
        /// How many pairs of objects a diff compared (counted by
        /// `Stored::eq`).
        pub(super) static COMPARED: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
    }

    fn compared() -> usize {
        COMPARED.with(|c| c.replace(0))
    }

    /// The diff of two copies of 100,000 objects that differ in one key
    /// compares a few objects along the changed path, not all of them; a
    /// rebuilt map with the same objects compares every one.
    #[test]
    fn a_diff_skips_what_the_copies_share() {
        let base: Objects<ConfigMap> = (0..100_000).map(|i| cm("a", &format!("o{i:06}"), "1")).collect();
        let mut next = base.clone();
        next.insert(cm("a", "o050000", "2"));
        compared();
        let (up, gone) = base.diff(&next);
        assert_eq!(names(&up), ["o050000"]);
        assert!(gone.is_empty());
        let n = compared();
        assert!((1..1_000).contains(&n), "compared {n} objects for one change");
        // A map built anew from the same objects shares no structure.
        let rebuilt: Objects<ConfigMap> = base.iter().cloned().collect();
        compared();
        assert_eq!(base.diff(&rebuilt), (vec![], vec![]));
        assert_eq!(compared(), 100_000);
    }

    fn cm(ns: &str, name: &str, rv: &str) -> Arc<ConfigMap> {
        Arc::new(ConfigMap {
            metadata: ObjectMeta {
                namespace: Some(ns.into()),
                name: Some(name.into()),
                resource_version: Some(rv.into()),
                uid: Some(format!("{ns}/{name}")),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        })
    }

    fn names(v: &[Arc<ConfigMap>]) -> Vec<String> {
        v.iter().map(|o| o.metadata.name.clone().unwrap()).collect()
    }

    #[test]
    fn a_copy_changed_in_a_few_keys_diffs_to_those_keys() {
        let base: Objects<ConfigMap> = (0..5000).map(|i| cm("a", &format!("o{i:05}"), "1")).collect();
        let mut next = base.clone();
        assert!(next.ptr_eq(&base));
        assert_eq!(base.diff(&next), (vec![], vec![]));
        next.insert(cm("a", "o00007", "2"));
        next.insert(cm("a", "o00007b", "1"));
        next.remove(&("a".into(), "o04000".into()));
        // Same resourceVersion and uid, a new pointer: not a change.
        next.insert(cm("a", "o00100", "1"));
        let (up, gone) = base.diff(&next);
        assert_eq!(names(&up), ["o00007", "o00007b"]);
        assert_eq!(gone, [("a".to_string(), "o04000".to_string())]);
        // The base is untouched by the copy's changes.
        assert_eq!(base.len(), 5000);
        assert_eq!(next.len(), 5000);
        assert_eq!(
            base.get(&("a".into(), "o00007".into()))
                .unwrap()
                .metadata
                .resource_version
                .as_deref(),
            Some("1")
        );
    }

    #[test]
    fn a_rebuilt_map_diffs_whole_and_keeps_key_order() {
        let a: Objects<ConfigMap> = vec![cm("b", "x", "1"), cm("a", "y", "1"), cm("a", "x", "1")].into();
        assert_eq!(names(&a.iter().cloned().collect::<Vec<_>>()), ["x", "y", "x"]);
        assert_eq!(a.keys().next(), Some(&("a".to_string(), "x".to_string())));
        // A later object of the same key wins.
        let b: Objects<ConfigMap> = vec![cm("a", "x", "1"), cm("a", "y", "1"), cm("a", "y", "3")].into();
        let (up, gone) = a.diff(&b);
        assert_eq!(names(&up), ["y"]);
        assert_eq!(gone, [("b".to_string(), "x".to_string())]);
        // No resourceVersion: always a change unless the same pointer.
        let mut c = Objects::new();
        let unversioned = Arc::new(ConfigMap {
            metadata: ObjectMeta {
                name: Some("u".into()),
                ..ObjectMeta::default()
            },
            ..ConfigMap::default()
        });
        c.insert(unversioned.clone());
        let d: Objects<ConfigMap> = vec![Arc::new((*unversioned).clone())].into();
        assert_eq!(c.diff(&d).0.len(), 1);
        assert_eq!(c.diff(&c.clone()).0.len(), 0);
    }

    /// Random edits on copies of large maps: the diff of each pair is the
    /// diff of the same two states as plain ordered maps.
    #[test]
    fn the_diff_of_shared_copies_equals_a_plain_diff() {
        use std::collections::BTreeMap;
        let mut rnd = npm_testkit::rng::xorshift(0x9e37_79b9_7f4a_7c15);
        let mut next = move |n: u64| rnd() % n;
        let mut plain: BTreeMap<ObjKey, Arc<ConfigMap>> = BTreeMap::new();
        let mut objects = Objects::new();
        for i in 0..3000 {
            let o = cm("n", &format!("o{i}"), "1");
            plain.insert(key_of(o.as_ref()), o.clone());
            objects.insert(o);
        }
        for round in 0..200 {
            let (old_plain, old) = (plain.clone(), objects.clone());
            for _ in 0..next(40) {
                let name = format!("o{}", next(3500));
                let k = ("n".to_string(), name.clone());
                match next(3) {
                    0 => {
                        plain.remove(&k);
                        objects.remove(&k);
                    }
                    _ => {
                        let o = cm("n", &name, &format!("{round}"));
                        plain.insert(k, o.clone());
                        objects.insert(o);
                    }
                }
            }
            let mut want_up = Vec::new();
            let mut want_gone = Vec::new();
            for (k, o) in &old_plain {
                match plain.get(k) {
                    None => want_gone.push(k.clone()),
                    Some(n) if changed(o, n) => want_up.push(n.clone()),
                    Some(_) => {}
                }
            }
            want_up.extend(
                plain
                    .iter()
                    .filter(|(k, _)| !old_plain.contains_key(*k))
                    .map(|(_, o)| o.clone()),
            );
            want_up.sort_by_key(|a| key_of(a.as_ref()));
            let (up, gone) = old.diff(&objects);
            assert_eq!(names(&up), names(&want_up), "round {round}");
            assert_eq!(gone, want_gone, "round {round}");
            assert!(objects.keys().eq(plain.keys()), "round {round}");
        }
    }
}
