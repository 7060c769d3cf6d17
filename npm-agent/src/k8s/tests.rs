//! Unit tests of the stores and the cache.

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::ObjectMeta;
use kube::runtime::watcher::Event;

use super::pods::{Pod, PodStatus};
use super::Cache;
use crate::telemetry::metrics::{sample, Metrics};

fn pod(name: &str, rv: &str, ip: Option<&str>) -> Pod {
    Pod {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some("ns".into()),
            resource_version: Some(rv.into()),
            annotations: Some([("a".to_string(), "b".to_string())].into()),
            ..Default::default()
        },
        status: Some(PodStatus {
            pod_ip: ip.map(String::from),
            ..Default::default()
        }),
        ..Default::default()
    }
}

#[test]
fn relist_keeps_last_complete_state_until_init_done() {
    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    cache.handle::<Pod>(Event::Init);
    cache.handle(Event::InitApply(pod("a", "1", Some("10.0.0.1"))));
    assert!(
        cache.pods.lock().unwrap().complete().is_none(),
        "a partial first list is not trusted"
    );
    cache.handle::<Pod>(Event::InitDone);
    cache.handle(Event::InitApply(pod("x", "1", None)));
    assert_eq!(cache.pods.lock().unwrap().names(), vec!["a"]);
    // Relist interrupted (410): a new Init throws the partial buffer away.
    cache.handle::<Pod>(Event::Init);
    cache.handle(Event::InitApply(pod("b", "2", Some("10.0.0.2"))));
    assert_eq!(
        cache.pods.lock().unwrap().names(),
        vec!["a"],
        "last complete state stays"
    );
    assert!(cache.complete().is_none(), "namespaces and policies not listed yet");
    cache.handle::<Pod>(Event::Init);
    cache.handle(Event::InitApply(pod("a", "1", Some("10.0.0.1"))));
    cache.handle(Event::InitApply(pod("b", "2", Some("10.0.0.2"))));
    cache.handle::<Pod>(Event::InitDone);
    assert_eq!(cache.pods.lock().unwrap().names(), vec!["a", "b"]);
    let stored = cache
        .pods
        .lock()
        .unwrap()
        .complete()
        .unwrap()
        .get(&("ns".into(), "a".into()))
        .unwrap()
        .clone();
    assert!(stored.metadata.annotations.is_none(), "annotations stripped");
    cache.handle(Event::Apply(pod("b", "3", None)));
    cache.handle(Event::Delete(pod("a", "4", None)));
    cache.handle::<Namespace>(Event::Init);
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    cache.handle::<NetworkPolicy>(Event::InitDone);
    let state = cache.complete().expect("all listed");
    assert_eq!(state.pods.len(), 1);
    let text = metrics.render();
    let get = |op: &str| sample(&text, &format!("npm_controller_pod_event_total{{operation=\"{op}\"}}")).unwrap();
    assert_eq!(get("create"), 2.0, "a (first list) and b (relist)");
    assert_eq!(get("update-with-empty-ip"), 1.0);
    assert_eq!(get("delete"), 1.0);
}

fn cnp(name: &str, rv: &str) -> super::ClusterNetworkPolicy {
    super::ClusterNetworkPolicy {
        metadata: ObjectMeta {
            name: Some(name.into()),
            resource_version: Some(rv.into()),
            ..Default::default()
        },
        spec: serde_json::json!({"tier": "Admin", "priority": 1}),
    }
}

fn list_core_kinds(cache: &Cache) {
    cache.handle::<Pod>(Event::Init);
    cache.handle::<Pod>(Event::InitDone);
    cache.handle::<Namespace>(Event::Init);
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    cache.handle::<NetworkPolicy>(Event::InitDone);
}

/// ClusterNetworkPolicies follow the complete-list rule: nothing is
/// complete before their first full list, a relist cut mid-way keeps the
/// last complete list, and "not served" is a complete empty list.
#[test]
fn cluster_policies_follow_the_complete_list_rule() {
    use super::{ClusterNetworkPolicy, ClusterPolicyMode};
    let cache = Cache::with_cluster_policies(Metrics::new().unwrap(), ClusterPolicyMode::Auto);
    list_core_kinds(&cache);
    assert!(cache.complete().is_none(), "no CNP list yet: nothing is complete");
    assert!(!cache.all_listed());
    cache.handle::<ClusterNetworkPolicy>(Event::Init);
    cache.handle(Event::InitApply(cnp("deny-a", "1")));
    assert!(cache.complete().is_none(), "a partial first CNP list is not trusted");
    cache.handle::<ClusterNetworkPolicy>(Event::InitDone);
    let names = |c: &Cache| -> Vec<String> {
        c.complete()
            .unwrap()
            .cluster_policies
            .iter()
            .map(|p| p.name().to_string())
            .collect()
    };
    assert_eq!(names(&cache), ["deny-a"]);
    // A relist cut by 410: its buffer never replaces the complete list.
    cache.handle::<ClusterNetworkPolicy>(Event::Init);
    cache.handle(Event::InitApply(cnp("other", "2")));
    cache.handle::<ClusterNetworkPolicy>(Event::Init);
    assert_eq!(names(&cache), ["deny-a"], "last complete state stays");
    // The API stops serving them (404 in auto): a complete empty list.
    assert!(cache.mark_cluster_policies_absent());
    assert!(names(&cache).is_empty());
    assert!(!cache.mark_cluster_policies_absent(), "already empty: nothing changes");

    let off = Cache::with_cluster_policies(Metrics::new().unwrap(), ClusterPolicyMode::Off);
    list_core_kinds(&off);
    assert!(
        off.complete().unwrap().cluster_policies.is_empty(),
        "off: complete and empty"
    );
    assert_eq!(
        Cache::new(Metrics::new().unwrap()).cluster_policy_mode(),
        ClusterPolicyMode::Off
    );
}

/// A relist holds one copy of the pods it finds unchanged, not two: each
/// relisted pod equal to the stored one is buffered as the stored pointer
/// when it arrives, a changed one as its new copy; the complete
/// state stays the last one until `InitDone`.
#[test]
fn relist_buffers_unchanged_objects_as_the_stored_pointers() {
    let cache = Cache::new(Metrics::new().unwrap());
    cache.handle::<Pod>(Event::Init);
    cache.handle(Event::InitApply(pod("a", "1", Some("10.0.0.1"))));
    cache.handle(Event::InitApply(pod("b", "1", Some("10.0.0.2"))));
    cache.handle::<Pod>(Event::InitDone);
    let stored = |name: &str| {
        cache
            .pods
            .lock()
            .unwrap()
            .complete()
            .unwrap()
            .get(&("ns".into(), name.into()))
            .unwrap()
            .clone()
    };
    let (a, b) = (stored("a"), stored("b"));
    // Only the store (and the two clones just taken) hold them.
    let (a_refs, b_refs) = (std::sync::Arc::strong_count(&a), std::sync::Arc::strong_count(&b));
    cache.handle::<Pod>(Event::Init);
    // `a` unchanged (a new resourceVersion only), `b` with a new address.
    cache.handle(Event::InitApply(pod("a", "2", Some("10.0.0.1"))));
    cache.handle(Event::InitApply(pod("b", "2", Some("10.0.0.3"))));
    assert_eq!(
        std::sync::Arc::strong_count(&a),
        a_refs + 1,
        "the relist buffers the stored `a`, not a second copy"
    );
    assert_eq!(
        std::sync::Arc::strong_count(&b),
        b_refs,
        "a changed `b` is its new copy"
    );
    assert!(
        std::sync::Arc::ptr_eq(&stored("b"), &b),
        "the last complete state stays until InitDone"
    );
    cache.handle::<Pod>(Event::InitDone);
    assert!(std::sync::Arc::ptr_eq(&stored("a"), &a));
    let new_b = stored("b");
    assert_eq!(new_b.status.as_ref().unwrap().pod_ip.as_deref(), Some("10.0.0.3"));
}

/// A pod as the watcher decodes it, with `labels` (its address changes
/// with `rv`).
fn labelled(name: &str, rv: &str, labels: serde_json::Value) -> Pod {
    serde_json::from_value(serde_json::json!({
        "metadata": {"name": name, "namespace": "shared", "uid": format!("u-{name}"),
                     "resourceVersion": rv, "labels": labels},
        "spec": {"nodeName": "n1", "containers": [{"name": "c"}]},
        "status": {"phase": "Running", "podIP": format!("10.9.{rv}.{}", name.len())}
    }))
    .unwrap()
}

/// Pods with equal labels share one label map in the store, across a
/// relist (new objects of the same pods, a new pod), and the compiler's
/// snapshot shares it too; the labels read the same as the API object's.
#[test]
fn equal_labels_share_one_map_in_the_store_and_the_snapshot() {
    use std::sync::Arc;

    use crate::cni::NodeFacts;
    use crate::reconcile::compiler::{snapshot, LastValid};

    let web = serde_json::json!({"app": "shared-web", "tier": "front"});
    let cache = Cache::new(Metrics::new().unwrap());
    for kind in [0, 1] {
        match kind {
            0 => cache.handle::<Namespace>(Event::Init),
            _ => cache.handle::<NetworkPolicy>(Event::Init),
        };
        match kind {
            0 => cache.handle::<Namespace>(Event::InitDone),
            _ => cache.handle::<NetworkPolicy>(Event::InitDone),
        };
    }
    cache.handle::<Pod>(Event::Init);
    cache.handle(Event::InitApply(labelled("a", "1", web.clone())));
    cache.handle(Event::InitApply(labelled("bb", "1", web.clone())));
    cache.handle(Event::InitApply(labelled(
        "ccc",
        "1",
        serde_json::json!({"app": "shared-db"}),
    )));
    cache.handle::<Pod>(Event::InitDone);
    let labels_of = |state: &super::CompleteState, name: &str| {
        let key = ("shared".to_string(), name.to_string());
        state.pods.get(&key).unwrap().labels.shared().clone()
    };
    let first = cache.complete().unwrap();
    let (a, b, c) = (
        labels_of(&first, "a"),
        labels_of(&first, "bb"),
        labels_of(&first, "ccc"),
    );
    assert!(Arc::ptr_eq(&a, &b), "equal labels, one map");
    assert!(!Arc::ptr_eq(&a, &c));
    assert_eq!(a.get("tier").map(String::as_str), Some("front"));
    assert_eq!(c.len(), 1);
    let stored = first.pods.get(&("shared".into(), "a".into())).unwrap();
    assert!(stored.metadata.labels.is_none(), "not kept twice");
    assert_eq!(stored.to_api().metadata.labels.as_ref(), Some(a.as_ref()));
    assert_eq!(
        serde_json::to_value(stored.as_ref()).unwrap()["metadata"]["labels"],
        web,
        "serialized as the API object"
    );

    // A relist: every pod a new object (a new address), one more.
    cache.handle::<Pod>(Event::Init);
    cache.handle(Event::InitApply(labelled("a", "2", web.clone())));
    cache.handle(Event::InitApply(labelled("bb", "2", web.clone())));
    cache.handle(Event::InitApply(labelled("dddd", "2", web.clone())));
    cache.handle::<Pod>(Event::InitDone);
    let second = cache.complete().unwrap();
    let new_a = second.pods.get(&("shared".into(), "a".into())).unwrap();
    assert!(!Arc::ptr_eq(new_a, stored), "the relist stored a new object");
    for name in ["a", "bb", "dddd"] {
        assert!(Arc::ptr_eq(&labels_of(&second, name), &a), "{name} after the relist");
    }

    // The compiler's pods hold the same map.
    let s = snapshot(&second, &NodeFacts::default(), &LastValid::default());
    for name in ["a", "bb", "dddd"] {
        let model = &s.pods[&("shared".to_string(), name.to_string())];
        assert!(Arc::ptr_eq(model.labels.shared(), &a), "{name} in the snapshot");
    }
}

/// Pods on one node share one copy of the node's name, of their phase and
/// of equal container names in the store (interned as they are decoded),
/// and read and serialize as the API object's strings.
#[test]
fn node_names_phases_and_container_names_are_one_copy_in_the_store() {
    use std::sync::Arc;

    let cache = Cache::new(Metrics::new().unwrap());
    cache.handle::<Pod>(Event::Init);
    for name in ["a", "bb"] {
        cache.handle(Event::InitApply(labelled(name, "1", serde_json::json!({"app": "x"}))));
    }
    let mut other: serde_json::Value = serde_json::to_value(labelled("ccc", "1", serde_json::json!({}))).unwrap();
    other["spec"]["nodeName"] = "n2".into();
    other["spec"]["containers"][0]["name"] = "side".into();
    other["status"]["phase"] = "Pending".into();
    cache.handle(Event::InitApply(serde_json::from_value::<Pod>(other).unwrap()));
    cache.handle::<Pod>(Event::InitDone);
    let store = cache.pods.lock().unwrap();
    let pod = |name: &str| {
        store
            .complete()
            .unwrap()
            .get(&("shared".into(), name.into()))
            .unwrap()
            .clone()
    };
    let (a, b, c) = (pod("a"), pod("bb"), pod("ccc"));
    let node = |p: &Pod| p.spec.as_ref().unwrap().node_name.clone().unwrap();
    let phase = |p: &Pod| p.status.as_ref().unwrap().phase.clone().unwrap();
    let container = |p: &Pod| p.spec.as_ref().unwrap().containers[0].name.clone();
    assert!(Arc::ptr_eq(&node(&a), &node(&b)), "one node name");
    assert!(Arc::ptr_eq(&phase(&a), &phase(&b)), "one phase");
    assert!(Arc::ptr_eq(&container(&a), &container(&b)), "one container name");
    assert_eq!((&*node(&a), &*node(&c)), ("n1", "n2"));
    assert_eq!((&*phase(&a), &*phase(&c)), ("Running", "Pending"));
    assert_eq!((&*container(&a), &*container(&c)), ("c", "side"));
    let api = serde_json::to_value(c.as_ref()).unwrap();
    assert_eq!(api["spec"]["nodeName"], "n2");
    assert_eq!(api["status"]["phase"], "Pending");
    assert_eq!(api["spec"]["containers"][0]["name"], "side");
    let full = c.to_api();
    assert_eq!(full.spec.unwrap().node_name.as_deref(), Some("n2"));
    assert_eq!(full.status.unwrap().phase.as_deref(), Some("Pending"));
}
