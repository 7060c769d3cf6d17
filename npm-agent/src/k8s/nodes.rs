//! The Nodes the agent watches: other nodes'
//! addresses become node identities in the compiler
//! (`npm_policy::nodes`), not world. The store keeps a slim projection of
//! each Node ([`NODE_PROJECTION`]): its name, uid, resourceVersion, labels
//! and `status.addresses`; everything else (images, conditions and their
//! heartbeats, daemon endpoints, spec) is dropped. A Node update that
//! changes none of the kept fields (a kubelet heartbeat every 10 s per
//! node) is no change: it neither wakes the sync loop nor recompiles.

use k8s_openapi::api::core::v1::{Node, NodeStatus};
use kube::api::ObjectMeta;

use super::store::Projection;

/// The slim Node: name, uid, resourceVersion, labels and
/// `status.addresses` only.
pub fn slim_node(n: Node) -> Node {
    let m = n.metadata;
    Node {
        metadata: ObjectMeta {
            name: m.name,
            uid: m.uid,
            resource_version: m.resource_version,
            labels: m.labels,
            ..ObjectMeta::default()
        },
        spec: None,
        status: n.status.map(|s| NodeStatus {
            addresses: s.addresses,
            ..NodeStatus::default()
        }),
    }
}

/// Whether two slim Nodes differ in nothing the compiler reads (name,
/// labels, addresses; the resourceVersion and uid are not compared: a Node
/// recreated with the same labels and addresses compiles the same).
pub fn same_node(a: &Node, b: &Node) -> bool {
    let labels = |n: &Node| n.metadata.labels.clone().unwrap_or_default();
    let addresses = |n: &Node| n.status.as_ref().and_then(|s| s.addresses.clone()).unwrap_or_default();
    a.metadata.name == b.metadata.name && labels(a) == labels(b) && addresses(a) == addresses(b)
}

/// The projection of the Node store.
pub const NODE_PROJECTION: Projection<Node> = Projection {
    project: slim_node,
    same: same_node,
};

#[cfg(test)]
mod tests {
    use k8s_openapi::api::core::v1::{ContainerImage, NodeAddress, NodeCondition, NodeSpec};
    use kube::runtime::watcher::Event;

    use super::*;
    use crate::k8s::{ListStore, StoreUpdate};

    fn node(rv: &str, role: &str, ip: &str, heartbeat: &str) -> Node {
        Node {
            metadata: ObjectMeta {
                name: Some("n1".into()),
                resource_version: Some(rv.into()),
                labels: Some([("role".to_string(), role.to_string())].into()),
                annotations: Some([("a".to_string(), "b".to_string())].into()),
                ..Default::default()
            },
            spec: Some(NodeSpec {
                pod_cidr: Some("10.0.0.0/24".into()),
                ..Default::default()
            }),
            status: Some(NodeStatus {
                addresses: Some(vec![NodeAddress {
                    type_: "InternalIP".into(),
                    address: ip.into(),
                }]),
                conditions: Some(vec![NodeCondition {
                    type_: "Ready".into(),
                    status: "True".into(),
                    message: Some(heartbeat.into()),
                    ..Default::default()
                }]),
                images: Some(vec![ContainerImage {
                    names: Some(vec![format!("img@{heartbeat}")]),
                    size_bytes: Some(1),
                }]),
                ..Default::default()
            }),
        }
    }

    #[test]
    fn the_projection_keeps_labels_and_addresses_only() {
        let n = slim_node(node("1", "x", "10.0.0.2", "t1"));
        assert!(n.spec.is_none());
        assert!(n.metadata.annotations.is_none());
        let s = n.status.unwrap();
        assert!(s.conditions.is_none() && s.images.is_none());
        assert_eq!(s.addresses.unwrap()[0].address, "10.0.0.2");
        assert_eq!(n.metadata.labels.unwrap()["role"], "x");
        assert_eq!(n.metadata.resource_version.as_deref(), Some("1"));
    }

    #[test]
    fn a_heartbeat_is_no_change_and_keeps_the_stored_object() {
        let mut store = ListStore::projected(NODE_PROJECTION);
        store.handle(Event::Init, |_, _| {});
        store.handle(Event::InitApply(node("1", "x", "10.0.0.2", "t1")), |_, _| {});
        assert_eq!(store.handle(Event::InitDone, |_, _| {}), StoreUpdate::Changed);
        let stored = store.complete().unwrap().iter().next().unwrap().clone();
        let mut changes = 0;
        let u = store.handle(Event::Apply(node("2", "x", "10.0.0.2", "t2")), |_, _| changes += 1);
        assert_eq!(u, StoreUpdate::Unchanged);
        assert_eq!(changes, 0);
        let now = store.complete().unwrap().iter().next().unwrap().clone();
        assert!(std::sync::Arc::ptr_eq(&stored, &now), "the stored object stays");
        // A relist with only heartbeats changed keeps the pointer too.
        store.handle(Event::Init, |_, _| {});
        store.handle(Event::InitApply(node("3", "x", "10.0.0.2", "t3")), |_, _| {});
        store.handle(Event::InitDone, |_, _| {});
        let relisted = store.complete().unwrap().iter().next().unwrap().clone();
        assert!(std::sync::Arc::ptr_eq(&stored, &relisted));
        // A label change and an address change are changes.
        let u = store.handle(Event::Apply(node("4", "y", "10.0.0.2", "t3")), |_, _| {});
        assert_eq!(u, StoreUpdate::Changed);
        let u = store.handle(Event::Apply(node("5", "y", "10.0.0.3", "t3")), |_, _| {});
        assert_eq!(u, StoreUpdate::Changed);
    }
}
