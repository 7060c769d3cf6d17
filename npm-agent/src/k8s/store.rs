//! One resource kind's store: the last complete list, and the buffer of a
//! (re)list in progress that replaces it only on `InitDone`; the object
//! keys and the stripping of fields the agent never reads; a kind-specific
//! [`Projection`] (Nodes keep only what the compiler reads) under which an
//! update that changes nothing projected is not a change at all.

use std::collections::BTreeMap;
use std::sync::Arc;

use kube::runtime::watcher::Event;
use kube::{Resource, ResourceExt};

use super::objects::Objects;

/// `namespace/name` of an object (`name` for cluster-scoped ones).
pub type ObjKey = (String, String);

/// A kind-specific slim copy of the objects a store keeps: `project`
/// drops what the agent never reads (after [`strip`]), and `same` says
/// whether two projected objects differ in anything but their
/// resourceVersion. An `Apply`, or a relisted object, that is `same` as the
/// stored one keeps the stored object (the same pointer: the compiler's
/// object diff skips it) and is not a change (no wake-up, no recompile).
#[derive(Debug)]
pub struct Projection<K> {
    /// The slim copy of an object.
    pub project: fn(K) -> K,
    /// Whether two projected objects are equal but for their resourceVersion.
    pub same: fn(&K, &K) -> bool,
}

impl<K> Clone for Projection<K> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<K> Copy for Projection<K> {}

/// The objects of one resource kind, trusting only complete lists.
#[derive(Debug)]
pub struct ListStore<K> {
    complete: Option<Objects<K>>,
    pending: Option<BTreeMap<ObjKey, Arc<K>>>,
    lists_completed: u64,
    projection: Option<Projection<K>>,
}

impl<K> Default for ListStore<K> {
    fn default() -> Self {
        ListStore {
            complete: None,
            pending: None,
            lists_completed: 0,
            projection: None,
        }
    }
}

impl<K> ListStore<K> {
    /// An empty store keeping the objects as `projection` makes them.
    pub fn projected(projection: Projection<K>) -> Self {
        ListStore {
            projection: Some(projection),
            ..ListStore::default()
        }
    }
}

/// What a watch event did to a store (the sync loop is woken for `Changed`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreUpdate {
    /// Nothing visible changed (a buffered InitApply, or Init).
    Buffered,
    /// An `Apply` that changed nothing the store's [`Projection`] keeps
    /// (a Node heartbeat): the stored object stays, nobody is woken.
    Unchanged,
    /// The complete state changed.
    Changed,
}

impl<K: Resource + Clone> ListStore<K> {
    /// Whether a full list has completed at least once.
    pub fn is_listed(&self) -> bool {
        self.complete.is_some()
    }

    /// Whether a relist is in progress (its objects are not trusted yet).
    pub fn is_relisting(&self) -> bool {
        self.pending.is_some()
    }

    /// Number of full lists completed.
    pub fn lists_completed(&self) -> u64 {
        self.lists_completed
    }

    /// The last complete state, `None` before the first full list (a
    /// clone of it is O(1): see [`Objects`]).
    pub fn complete(&self) -> Option<&Objects<K>> {
        self.complete.as_ref()
    }

    /// Apply one watcher event. `on_change(old, new)` is called for every
    /// object change of the complete state (with both `None`-able sides).
    pub fn handle(&mut self, event: Event<K>, mut on_change: impl FnMut(Option<&K>, Option<&K>)) -> StoreUpdate {
        match event {
            Event::Init => {
                self.pending = Some(BTreeMap::new());
                StoreUpdate::Buffered
            }
            Event::InitApply(obj) => {
                let obj = self.slim(obj);
                let key = key_of(&obj);
                // A relisted object equal to the stored one is buffered as
                // the stored pointer right away (the new copy is dropped
                // here, not at `InitDone`): a relist then holds one copy of
                // the unchanged objects, not two. The buffer is
                // still only trusted on `InitDone`.
                let kept = self
                    .projection
                    .zip(self.complete.as_ref())
                    .and_then(|(p, complete)| complete.get(&key).filter(|o| (p.same)(o, &obj)).cloned());
                self.pending
                    .get_or_insert_with(BTreeMap::new)
                    .insert(key, kept.unwrap_or_else(|| Arc::new(obj)));
                StoreUpdate::Buffered
            }
            Event::InitDone => {
                let mut new = self.pending.take().unwrap_or_default();
                let old = self.complete.take().unwrap_or_default();
                if let Some(p) = self.projection {
                    // Relisted objects equal to the stored ones keep the
                    // stored pointers (nothing to convert again).
                    for (k, n) in new.iter_mut() {
                        if let Some(o) = old.get(k).filter(|o| !Arc::ptr_eq(o, n) && (p.same)(o, n)) {
                            *n = o.clone();
                        }
                    }
                }
                for (k, o) in old.entries() {
                    match new.get(k) {
                        None => on_change(Some(o), None),
                        Some(n)
                            if !Arc::ptr_eq(o, n) && resource_version(o.as_ref()) != resource_version(n.as_ref()) =>
                        {
                            on_change(Some(o), Some(n))
                        }
                        Some(_) => {}
                    }
                }
                for (k, n) in &new {
                    if !old.contains_key(k) {
                        on_change(None, Some(n));
                    }
                }
                // Built anew: shares no structure with the old state, so
                // the next object diff walks both whole.
                self.complete = Some(Objects::from(new));
                self.lists_completed += 1;
                StoreUpdate::Changed
            }
            Event::Apply(obj) => {
                let obj = Arc::new(self.slim(obj));
                let projection = self.projection;
                let Some(complete) = self.complete.as_mut() else {
                    // Cannot happen with kube's watcher (Apply only follows
                    // InitDone); if it did, a partial state is not trusted.
                    self.pending
                        .get_or_insert_with(BTreeMap::new)
                        .insert(key_of(obj.as_ref()), obj);
                    return StoreUpdate::Buffered;
                };
                let key = key_of(obj.as_ref());
                if let (Some(p), Some(old)) = (projection, complete.get(&key)) {
                    if (p.same)(old, &obj) {
                        return StoreUpdate::Unchanged;
                    }
                }
                let old = complete.insert_at(key, obj.clone());
                on_change(old.as_deref(), Some(&obj));
                StoreUpdate::Changed
            }
            Event::Delete(obj) => {
                let Some(complete) = self.complete.as_mut() else {
                    if let Some(p) = self.pending.as_mut() {
                        p.remove(&key_of(&obj));
                    }
                    return StoreUpdate::Buffered;
                };
                let old = complete.remove(&key_of(&obj));
                on_change(old.as_deref().or(Some(&obj)), None);
                StoreUpdate::Changed
            }
        }
    }
}

impl<K: Resource> ListStore<K> {
    /// [`strip`], then this store's projection.
    fn slim(&self, obj: K) -> K {
        let obj = strip(obj);
        match self.projection {
            Some(p) => (p.project)(obj),
            None => obj,
        }
    }
}

fn resource_version<K: Resource>(o: &K) -> Option<&String> {
    o.meta().resource_version.as_ref()
}

/// `(namespace, name)` of an object; cluster-scoped objects have an empty namespace.
pub fn key_of<K: Resource>(o: &K) -> ObjKey {
    (
        o.meta().namespace.clone().unwrap_or_default(),
        o.meta().name.clone().unwrap_or_default(),
    )
}

/// The annotations [`strip`] keeps: `npm.io/audit`, which puts a
/// NetworkPolicy in audit mode (`npm_policy::audit`),
/// `kubernetes.io/config.mirror`, the uid of a mirror pod's static pod
/// (what the runtime passes npm-cni: [`super::pods::Pod::mirror_of`]), and
/// `npm.io/established`, a Namespace's connection semantics
/// ([`crate::reconcile::established`]).
pub const KEPT_ANNOTATIONS: [&str; 3] = [
    npm_policy::audit::AUDIT_ANNOTATION,
    super::pods::MIRROR_ANNOTATION,
    crate::reconcile::established::ESTABLISHED_ANNOTATION,
];

/// Drop the fields the agent never reads (managedFields, annotations but
/// [`KEPT_ANNOTATIONS`]) so the cache of a large cluster stays small.
pub fn strip<K: Resource>(mut o: K) -> K {
    let m = o.meta_mut();
    m.managed_fields = None;
    m.annotations = m.annotations.take().and_then(|mut a| {
        let kept: BTreeMap<String, String> = KEPT_ANNOTATIONS
            .iter()
            .filter_map(|k| a.remove(*k).map(|v| (k.to_string(), v)))
            .collect();
        (!kept.is_empty()).then_some(kept)
    });
    o
}

impl<K: Resource> ListStore<K> {
    /// Name of the objects of the complete state (for tests and logs).
    pub fn names(&self) -> Vec<String>
    where
        K: ResourceExt,
    {
        self.complete
            .as_ref()
            .map(|c| c.iter().map(|o| o.name_any()).collect())
            .unwrap_or_default()
    }
}
