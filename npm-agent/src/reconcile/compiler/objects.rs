//! The object diff of two complete states: both are walked once in key
//! order, and an object counts as changed unless it is the same pointer or
//! has the same resourceVersion and uid.

use std::sync::Arc;

use kube::Resource;

use crate::k8s::{key_of, ObjKey};

/// Whether the stored object `old` and the current `new` may differ.
fn changed<K: Resource>(old: &Arc<K>, new: &Arc<K>) -> bool {
    if Arc::ptr_eq(old, new) {
        return false;
    }
    let (o, n) = (old.meta(), new.meta());
    o.resource_version.is_none() || o.resource_version != n.resource_version || o.uid != n.uid
}

/// `(namespace, name)` of an object, borrowed (no allocation).
pub(super) fn key_ref<K: Resource>(o: &K) -> (&str, &str) {
    let m = o.meta();
    (m.namespace.as_deref().unwrap_or(""), m.name.as_deref().unwrap_or(""))
}

/// `objs` ordered by key, one object per key (the last one given wins).
/// The stores hand out their objects in key order already: then this is a
/// linear check and a copy of the pointers.
pub(super) fn sorted<K: Resource>(objs: &[Arc<K>]) -> Vec<Arc<K>> {
    if objs.windows(2).all(|w| key_ref(w[0].as_ref()) < key_ref(w[1].as_ref())) {
        return objs.to_vec();
    }
    let mut v = objs.to_vec();
    v.sort_by(|a, b| key_ref(a.as_ref()).cmp(&key_ref(b.as_ref())));
    let mut out: Vec<Arc<K>> = Vec::with_capacity(v.len());
    for o in v {
        match out.last_mut() {
            Some(last) if key_ref(last.as_ref()) == key_ref(o.as_ref()) => *last = o,
            _ => out.push(o),
        }
    }
    out
}

/// Objects of `current` added or changed since `last`, and keys of `last`
/// gone from `current`; `last` becomes `current`. Both are walked once in
/// key order (pointer-equal objects are skipped without a look at them).
pub(super) fn diff_objects<K: Resource>(last: &mut Vec<Arc<K>>, current: &[Arc<K>]) -> (Vec<Arc<K>>, Vec<ObjKey>) {
    let current = sorted(current);
    let mut upserts = Vec::new();
    let mut removed = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < last.len() || j < current.len() {
        let ord = match (last.get(i), current.get(j)) {
            (Some(o), Some(n)) if Arc::ptr_eq(o, n) => std::cmp::Ordering::Equal,
            (Some(o), Some(n)) => key_ref(o.as_ref()).cmp(&key_ref(n.as_ref())),
            (Some(_), None) => std::cmp::Ordering::Less,
            _ => std::cmp::Ordering::Greater,
        };
        match ord {
            std::cmp::Ordering::Less => {
                removed.push(key_of(last[i].as_ref()));
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                upserts.push(current[j].clone());
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                if changed(&last[i], &current[j]) {
                    upserts.push(current[j].clone());
                }
                i += 1;
                j += 1;
            }
        }
    }
    *last = current;
    (upserts, removed)
}
