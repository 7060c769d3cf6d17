//! The CNI facts of this node on the pods the compiler sees: each pod is
//! converted from its API object and then overlaid with the facts
//! ([`NodeFacts::overlay`], before IP ownership is decided), and the pods
//! whose claim on an address the overlay removed are remembered, so that
//! the incremental compile knows which pods a change of the facts touches.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use npm_policy::convert::{pod_from_api, ConvertError};
use npm_policy::model::Pod as ModelPod;

use crate::cni::NodeFacts;
use crate::k8s::pods::Pod;
use crate::k8s::ObjKey;

/// Convert `pod` and overlay the facts on it; also returns the addresses
/// the overlay took from it (an attachment of another pod holds them).
///
/// A mirror pod (the API's copy of a static pod) whose static pod the
/// facts hold under the mirror pod's own namespace and name
/// ([`NodeFacts::holds`]) is compiled under the static pod's uid, the one
/// the runtime gave npm-cni: its endpoint is then the attachment's, keyed
/// as CNI requests wait for it. Any other object keeps its own uid.
pub(super) fn convert_pod(pod: &Pod, facts: &NodeFacts) -> Result<(ModelPod, Vec<IpAddr>), ConvertError> {
    let mut model = pod_from_api(&pod.to_api())?;
    // The interned labels of the stored pod (the conversion's copy is
    // dropped): the snapshot shares them with the store and with every
    // pod of equal labels.
    model.labels = pod.pod_labels();
    if let Some(runtime_uid) = pod.mirror_of() {
        if facts.holds(runtime_uid, &model.namespace, &model.name) {
            model.uid = runtime_uid.to_string();
        }
    }
    let stripped = facts.overlay(&mut model);
    Ok((model, stripped))
}

/// The pods whose claim on an address the overlay removed, both ways.
#[derive(Clone, Debug, Default)]
pub(super) struct Stripped {
    by_ip: HashMap<IpAddr, BTreeSet<ObjKey>>,
    by_pod: HashMap<ObjKey, Vec<IpAddr>>,
}

impl Stripped {
    /// Pod `key` was converted again: the overlay took `ips` from it.
    pub(super) fn set(&mut self, key: &ObjKey, ips: Vec<IpAddr>) {
        self.remove(key);
        if ips.is_empty() {
            return;
        }
        for ip in &ips {
            self.by_ip.entry(*ip).or_default().insert(key.clone());
        }
        self.by_pod.insert(key.clone(), ips);
    }

    /// Pod `key` is gone (or could not be converted).
    pub(super) fn remove(&mut self, key: &ObjKey) {
        let Some(ips) = self.by_pod.remove(key) else { return };
        for ip in ips {
            if let Some(set) = self.by_ip.get_mut(&ip) {
                set.remove(key);
                if set.is_empty() {
                    self.by_ip.remove(&ip);
                }
            }
        }
    }

    /// The pods the overlay took `ip` from.
    pub(super) fn pods_of(&self, ip: &IpAddr) -> impl Iterator<Item = &ObjKey> {
        self.by_ip.get(ip).into_iter().flatten()
    }
}
