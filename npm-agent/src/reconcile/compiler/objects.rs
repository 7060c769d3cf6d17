//! The object diff of two complete states ([`Objects::diff`]: the subtrees
//! the two share are skipped; an object counts as changed unless it is the
//! same pointer or has the same resourceVersion and uid).

use std::sync::Arc;

use kube::Resource;

use crate::k8s::{ObjKey, Objects};

/// `(namespace, name)` of an object, borrowed (no allocation).
pub(super) fn key_ref<K: Resource>(o: &K) -> (&str, &str) {
    let m = o.meta();
    (m.namespace.as_deref().unwrap_or(""), m.name.as_deref().unwrap_or(""))
}

/// Objects of `current` added or changed since `last`, and keys of `last`
/// gone from `current`; `last` becomes (a copy of) `current`.
pub(super) fn diff_objects<K: Resource>(last: &mut Objects<K>, current: &Objects<K>) -> (Vec<Arc<K>>, Vec<ObjKey>) {
    let diff = last.diff(current);
    *last = current.clone();
    diff
}
