//! The Pods the agent watches, as a slim type of their own: the
//! watcher deserializes each Pod straight into [`Pod`], which has only the
//! fields the compiler reads, so a cluster of 100,000 pods costs the agent
//! a few hundred bytes per pod instead of k8s-openapi's full `Pod` (about
//! 2.2 KiB inline, plus 2.1 KiB per container, before any string).
//!
//! Kept: `metadata` (name, namespace, uid, resourceVersion, labels,
//! creationTimestamp, deletionTimestamp: the rest is dropped by
//! [`POD_PROJECTION`]), `spec.nodeName`, `spec.hostNetwork`, the name and
//! `ports` of every container and init container (named ports), and
//! `status.phase`, `status.podIP`, `status.podIPs`. Everything else
//! (volumes, images, env, resources, conditions, container statuses) is
//! never read, so it is never stored; and a Pod update that changes only
//! such fields (a readiness condition, a restart count) is no change: it
//! neither wakes the sync loop nor recompiles.
//!
//! The labels ([`intern_labels`]) and the strings most pods hold equal
//! (`spec.nodeName`, `status.phase`, container names: [`intern_str`]) are
//! interned as a pod is decoded: one copy each, shared by the pods.
//!
//! The field names are k8s-openapi's, so code reading a Pod reads this one
//! the same way; [`Pod::to_api`] gives the k8s-openapi object the policy
//! compiler's conversion (`npm_policy::convert::pod_from_api`) takes.

use std::borrow::Cow;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1 as corev1;
use k8s_openapi::api::core::v1::{ContainerPort, PodIP};
use kube::api::ObjectMeta;
use kube::core::NamespaceResourceScope;
use kube::Resource;
use npm_policy::model::{Labels, PodLabels};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::store::Projection;

/// The annotation the kubelet puts on the mirror pod of a static pod: the
/// static pod's uid (its config hash), which is what the runtime passes
/// npm-cni as `K8S_POD_UID`; the mirror pod's own `metadata.uid` differs.
pub const MIRROR_ANNOTATION: &str = "kubernetes.io/config.mirror";

/// A Pod, slim: what the compiler reads and nothing else.
///
/// Its labels are moved out of `metadata` by [`slim_pod`] into
/// [`Pod::labels`], interned ([`intern_labels`]): the pods with equal
/// labels share one map, and so do their converted copies in the
/// compiler. Serialized with the labels back in `metadata`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
pub struct Pod {
    /// Standard object metadata (slimmed by [`POD_PROJECTION`]; its
    /// `labels` are `None` once slimmed: they are in [`Pod::labels`]).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// `metadata.labels` of a slimmed pod, interned (empty before
    /// [`slim_pod`]: read [`Pod::labels`] through [`Pod::pod_labels`]).
    #[serde(skip)]
    pub labels: PodLabels,
    /// The kept part of `spec`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spec: Option<PodSpec>,
    /// The kept part of `status`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<PodStatus>,
}

impl Serialize for Pod {
    /// As the API object: the labels in `metadata`.
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        #[derive(Serialize)]
        struct Api<'a> {
            metadata: Cow<'a, ObjectMeta>,
            #[serde(skip_serializing_if = "Option::is_none")]
            spec: &'a Option<PodSpec>,
            #[serde(skip_serializing_if = "Option::is_none")]
            status: &'a Option<PodStatus>,
        }
        let metadata = match self.metadata.labels {
            None if !self.labels.is_empty() => Cow::Owned(ObjectMeta {
                labels: Some(Labels::clone(&self.labels)),
                ..self.metadata.clone()
            }),
            _ => Cow::Borrowed(&self.metadata),
        };
        Api {
            metadata,
            spec: &self.spec,
            status: &self.status,
        }
        .serialize(s)
    }
}

/// The label sets of the pods, each held once ([`intern_labels`]).
struct Interned {
    sets: HashSet<Arc<Labels>>,
    /// When the set has this many entries, the ones no pod holds any more
    /// are dropped first (so the set stays within twice the live ones).
    purge_at: usize,
}

static INTERNED: Mutex<Option<Interned>> = Mutex::new(None);

/// The shared copy of `labels`: the pods with equal labels share one map
/// (a Deployment's replicas have equal labels), instead of one map per pod
/// in the store and one more in the compiler's snapshot. Label sets no pod
/// holds any more are dropped when the set has doubled since the last
/// purge.
pub fn intern_labels(labels: Labels) -> PodLabels {
    let mut guard = INTERNED.lock().unwrap_or_else(|e| e.into_inner());
    let interned = guard.get_or_insert_with(|| Interned {
        sets: HashSet::new(),
        purge_at: 1024,
    });
    if let Some(shared) = interned.sets.get(&labels) {
        return PodLabels::from_shared(shared.clone());
    }
    if interned.sets.len() >= interned.purge_at {
        // Under the lock nobody can clone an entry held only here.
        interned.sets.retain(|s| Arc::strong_count(s) > 1);
        interned.purge_at = (interned.sets.len() * 2).max(1024);
    }
    let shared = Arc::new(labels);
    interned.sets.insert(shared.clone());
    PodLabels::from_shared(shared)
}

/// The strings many pods hold equal (node names, phases, container
/// names), each held once ([`intern_str`]).
struct InternedStrs {
    strs: HashSet<Arc<str>>,
    /// As [`Interned::purge_at`].
    purge_at: usize,
}

static INTERNED_STRS: Mutex<Option<InternedStrs>> = Mutex::new(None);

/// The shared copy of `s`: the pods of one node share one copy of its
/// name, every Running pod one `Running`, the replicas of a workload one
/// copy of each container name (a pointer each instead of a string of
/// their own). Strings no pod holds any more are dropped when the set has
/// doubled since the last purge.
pub fn intern_str(s: &str) -> Arc<str> {
    let mut guard = INTERNED_STRS.lock().unwrap_or_else(|e| e.into_inner());
    let interned = guard.get_or_insert_with(|| InternedStrs {
        strs: HashSet::new(),
        purge_at: 1024,
    });
    if let Some(shared) = interned.strs.get(s) {
        return shared.clone();
    }
    if interned.strs.len() >= interned.purge_at {
        interned.strs.retain(|s| Arc::strong_count(s) > 1);
        interned.purge_at = (interned.strs.len() * 2).max(1024);
    }
    let shared: Arc<str> = Arc::from(s);
    interned.strs.insert(shared.clone());
    shared
}

fn de_interned<'de, D: Deserializer<'de>>(d: D) -> Result<Arc<str>, D::Error> {
    Cow::<str>::deserialize(d).map(|s| intern_str(&s))
}

fn de_interned_opt<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Arc<str>>, D::Error> {
    Option::<Cow<str>>::deserialize(d).map(|s| s.map(|s| intern_str(&s)))
}

fn ser_str<S: Serializer>(v: &Arc<str>, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(v)
}

fn ser_str_opt<S: Serializer>(v: &Option<Arc<str>>, s: S) -> Result<S::Ok, S::Error> {
    v.as_deref().serialize(s)
}

/// The kept part of a Pod's `spec`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodSpec {
    /// `spec.nodeName`: the node the pod is bound to (interned).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_interned_opt",
        serialize_with = "ser_str_opt"
    )]
    pub node_name: Option<Arc<str>>,
    /// `spec.hostNetwork`: host-network pods are never endpoints.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_network: Option<bool>,
    /// `spec.containers`: names and ports only.
    #[serde(default)]
    pub containers: Vec<Container>,
    /// `spec.initContainers`: names and ports only (sidecars serve ports).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub init_containers: Option<Vec<Container>>,
}

/// A container's name and ports.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
pub struct Container {
    /// The container name (interned).
    #[serde(default, deserialize_with = "de_interned", serialize_with = "ser_str")]
    pub name: Arc<str>,
    /// Its ports (named ports resolve against them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ports: Option<Vec<ContainerPort>>,
}

/// The kept part of a Pod's `status`.
#[derive(Clone, Debug, Default, PartialEq, Deserialize, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct PodStatus {
    /// `status.phase` (interned).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "de_interned_opt",
        serialize_with = "ser_str_opt"
    )]
    pub phase: Option<Arc<str>>,
    /// `status.podIP`.
    #[serde(default, rename = "podIP", skip_serializing_if = "Option::is_none")]
    pub pod_ip: Option<String>,
    /// `status.podIPs`.
    #[serde(default, rename = "podIPs", skip_serializing_if = "Option::is_none")]
    pub pod_ips: Option<Vec<PodIP>>,
}

impl Resource for Pod {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        "Pod".into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        "".into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn api_version(_: &()) -> Cow<'_, str> {
        "v1".into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        "pods".into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

fn container_to_api(c: &Container) -> corev1::Container {
    corev1::Container {
        name: c.name.to_string(),
        ports: c.ports.clone(),
        ..Default::default()
    }
}

fn container_from_api(c: corev1::Container) -> Container {
    Container {
        name: intern_str(&c.name),
        ports: c.ports,
    }
}

impl Pod {
    /// The uid of the static pod this is the mirror pod of
    /// ([`MIRROR_ANNOTATION`]); `None` for any other pod.
    pub fn mirror_of(&self) -> Option<&str> {
        self.metadata
            .annotations
            .as_ref()?
            .get(MIRROR_ANNOTATION)
            .map(String::as_str)
            .filter(|u| !u.is_empty())
    }

    /// Whether this object is the pod the runtime names `uid` in CNI_ARGS:
    /// its own uid, or for a mirror pod its static pod's.
    pub fn has_runtime_uid(&self, uid: &str) -> bool {
        self.metadata.uid.as_deref() == Some(uid) || self.mirror_of() == Some(uid)
    }

    /// The pod's labels: [`Pod::labels`], or, on a pod that was not
    /// slimmed, its `metadata.labels` (interned).
    pub fn pod_labels(&self) -> PodLabels {
        match &self.metadata.labels {
            Some(l) => intern_labels(l.clone()),
            None if self.labels.is_empty() => intern_labels(Labels::new()),
            None => self.labels.clone(),
        }
    }

    /// The k8s-openapi Pod with the kept fields (what
    /// `npm_policy::convert::pod_from_api` converts). Built per conversion,
    /// which happens only when the pod changed.
    pub fn to_api(&self) -> corev1::Pod {
        let mut metadata = self.metadata.clone();
        if metadata.labels.is_none() && !self.labels.is_empty() {
            metadata.labels = Some(Labels::clone(&self.labels));
        }
        corev1::Pod {
            metadata,
            spec: self.spec.as_ref().map(|s| corev1::PodSpec {
                node_name: s.node_name.as_deref().map(String::from),
                host_network: s.host_network,
                containers: s.containers.iter().map(container_to_api).collect(),
                init_containers: s
                    .init_containers
                    .as_ref()
                    .map(|cs| cs.iter().map(container_to_api).collect()),
                ..Default::default()
            }),
            status: self.status.as_ref().map(|s| corev1::PodStatus {
                phase: s.phase.as_deref().map(String::from),
                pod_ip: s.pod_ip.clone(),
                pod_ips: s.pod_ips.clone(),
                ..Default::default()
            }),
        }
    }
}

impl From<corev1::Pod> for Pod {
    /// The slim copy of a full Pod (test fixtures, YAML).
    fn from(p: corev1::Pod) -> Self {
        slim_pod(Pod {
            metadata: p.metadata,
            labels: PodLabels::default(),
            spec: p.spec.map(|s| PodSpec {
                node_name: s.node_name.as_deref().map(intern_str),
                host_network: s.host_network,
                containers: s.containers.into_iter().map(container_from_api).collect(),
                init_containers: s
                    .init_containers
                    .map(|cs| cs.into_iter().map(container_from_api).collect()),
            }),
            status: p.status.map(|s| PodStatus {
                phase: s.phase.as_deref().map(intern_str),
                pod_ip: s.pod_ip,
                pod_ips: s.pod_ips,
            }),
        })
    }
}

/// The slim metadata: name, namespace, uid, resourceVersion,
/// creationTimestamp, deletionTimestamp, deletionGracePeriodSeconds and the [`MIRROR_ANNOTATION`]
/// (owner references, finalizers, generateName, other annotations and the
/// rest are dropped); the labels move to [`Pod::labels`], interned.
pub fn slim_pod(p: Pod) -> Pod {
    let mut m = p.metadata;
    let labels = match m.labels.take() {
        Some(l) => intern_labels(l),
        None if p.labels.is_empty() => intern_labels(Labels::new()),
        None => p.labels,
    };
    let mirror = m
        .annotations
        .and_then(|mut a| a.remove(MIRROR_ANNOTATION))
        .map(|v| [(MIRROR_ANNOTATION.to_string(), v)].into());
    Pod {
        metadata: ObjectMeta {
            name: m.name,
            namespace: m.namespace,
            uid: m.uid,
            resource_version: m.resource_version,
            annotations: mirror,
            creation_timestamp: m.creation_timestamp,
            deletion_timestamp: m.deletion_timestamp,
            deletion_grace_period_seconds: m.deletion_grace_period_seconds,
            ..ObjectMeta::default()
        },
        labels,
        spec: p.spec,
        status: p.status,
    }
}

/// Whether two slim Pods differ in nothing but their resourceVersion (the
/// uid is compared: a pod recreated under the same name is a change).
pub fn same_pod(a: &Pod, b: &Pod) -> bool {
    let (x, y) = (&a.metadata, &b.metadata);
    x.name == y.name
        && x.namespace == y.namespace
        && x.uid == y.uid
        && x.labels == y.labels
        && a.labels == b.labels
        && x.annotations == y.annotations
        && x.creation_timestamp == y.creation_timestamp
        && x.deletion_timestamp == y.deletion_timestamp
        && x.deletion_grace_period_seconds == y.deletion_grace_period_seconds
        && a.spec == b.spec
        && a.status == b.status
}

/// The projection of the Pod store.
pub const POD_PROJECTION: Projection<Pod> = Projection {
    project: slim_pod,
    same: same_pod,
};

#[cfg(test)]
mod tests {
    use super::*;

    /// A Pod as the API server sends it, with fields the agent never reads.
    const API_POD: &str = r#"{
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "shop", "uid": "u1", "resourceVersion": "7",
                     "labels": {"app": "web"}, "ownerReferences": [{"apiVersion": "apps/v1",
                     "kind": "StatefulSet", "name": "web", "uid": "s1"}],
                     "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"nodeName": "n1", "volumes": [{"name": "v", "emptyDir": {}}],
                 "containers": [{"name": "c", "image": "nginx", "env": [{"name": "A", "value": "b"}],
                                 "ports": [{"name": "http", "containerPort": 80}]}],
                 "initContainers": [{"name": "side", "image": "envoy", "restartPolicy": "Always",
                                     "ports": [{"name": "admin", "containerPort": 9901, "protocol": "TCP"}]}]},
        "status": {"phase": "Running", "podIP": "10.0.0.5", "podIPs": [{"ip": "10.0.0.5"}, {"ip": "fd00::5"}],
                   "conditions": [{"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "c", "ready": true, "restartCount": 0, "image": "nginx",
                                          "imageID": "x"}]}
    }"#;

    #[test]
    fn deserializes_only_what_the_compiler_reads() {
        let slim = slim_pod(serde_json::from_str::<Pod>(API_POD).unwrap());
        let full: corev1::Pod = serde_json::from_str(API_POD).unwrap();
        // The conversion the compiler does gives the same model pod from
        // the slim object as from the full one.
        assert_eq!(
            npm_policy::convert::pod_from_api(&slim.to_api()).unwrap(),
            npm_policy::convert::pod_from_api(&full).unwrap()
        );
        assert_eq!(Pod::from(full), slim);
        assert!(slim.metadata.owner_references.is_none());
        let spec = slim.spec.as_ref().unwrap();
        assert_eq!(
            spec.init_containers.as_ref().unwrap()[0].ports.as_ref().unwrap()[0].container_port,
            9901
        );
    }

    #[test]
    fn the_mirror_annotation_is_kept_others_are_dropped() {
        let mut json: serde_json::Value = serde_json::from_str(API_POD).unwrap();
        json["metadata"]["annotations"] = serde_json::json!({
            "kubernetes.io/config.mirror": "hash-1", "kubernetes.io/config.hash": "hash-1", "other": "x"});
        let mirror = crate::k8s::strip(slim_pod(serde_json::from_value::<Pod>(json).unwrap()));
        assert_eq!(
            mirror.metadata.annotations,
            Some([(MIRROR_ANNOTATION.to_string(), "hash-1".to_string())].into())
        );
        assert_eq!(mirror.mirror_of(), Some("hash-1"));
        assert!(mirror.has_runtime_uid("hash-1") && mirror.has_runtime_uid("u1"));
        assert!(!mirror.has_runtime_uid("u2"));
        let plain = slim_pod(serde_json::from_str::<Pod>(API_POD).unwrap());
        assert_eq!(plain.mirror_of(), None);
        assert!(!same_pod(&plain, &mirror), "the annotation is part of the pod");
    }

    #[test]
    fn a_status_condition_change_is_no_change_an_address_change_is() {
        let a = slim_pod(serde_json::from_str::<Pod>(API_POD).unwrap());
        let mut json: serde_json::Value = serde_json::from_str(API_POD).unwrap();
        json["metadata"]["resourceVersion"] = "8".into();
        json["status"]["conditions"][0]["status"] = "False".into();
        let b = slim_pod(serde_json::from_value(json.clone()).unwrap());
        assert!(same_pod(&a, &b), "readiness condition flip is not a change");
        json["status"]["podIPs"][0]["ip"] = "10.0.0.6".into();
        let c = slim_pod(serde_json::from_value(json.clone()).unwrap());
        assert!(!same_pod(&a, &c), "a new address is a change");
        json["status"]["podIPs"][0]["ip"] = "10.0.0.5".into();
        json["metadata"]["uid"] = "u2".into();
        let d = slim_pod(serde_json::from_value(json).unwrap());
        assert!(!same_pod(&a, &d), "a recreated pod is a change");
    }
}
