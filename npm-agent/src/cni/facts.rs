//! The facts npm-cni told the agent about this node ([`NodeFacts`]): the
//! live attachments (pod, host-side veth, addresses) and the tombstones of
//! pods whose sandbox was deleted, and the overlay they put on the pods the
//! compiler sees (see the [module doc](super) for the rule).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use npm_cni::proto::PodRef;
use npm_dataplane::Interfaces;
use npm_policy::compiled::Compiled;
use serde::{Deserialize, Serialize};

use crate::k8s::ObjKey;
use crate::node::interfaces::apply_attached;
use crate::node::Resolved;

/// The key of an attachment, as the CNI spec keys them: container id and
/// interface name inside the pod.
pub type AttachmentKey = (String, String);

/// One pod network attachment of this node, learned from CNI ADD.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Attachment {
    /// The network's name from the CNI configuration.
    pub network: String,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// `CNI_IFNAME`.
    pub ifname: String,
    /// `CNI_NETNS`.
    pub netns: String,
    /// The pod, from `CNI_ARGS`.
    pub pod: PodRef,
    /// The host-side veth of the pod.
    pub host_interface: String,
    /// Its ifindex when ADD was served.
    pub ifindex: u32,
    /// The pod's addresses (the first of each family is used).
    pub ips: Vec<IpAddr>,
    /// Order of the ADDs: of two attachments of one pod, or claiming one
    /// address, the later one is current.
    pub seq: u64,
}

impl Attachment {
    /// `namespace/name` of the pod, for logs.
    pub fn pod_name(&self) -> String {
        format!("{}/{}", self.pod.namespace, self.pod.name)
    }

    fn pod_key(&self) -> ObjKey {
        (self.pod.namespace.clone(), self.pod.name.clone())
    }
}

/// What the compiler sees of an attached pod: its addresses (at most one
/// per family, in the order the CNI result gave them).
fn used_addresses(ips: &[IpAddr]) -> Vec<IpAddr> {
    let v4 = ips.iter().find(|i| i.is_ipv4());
    let v6 = ips.iter().find(|i| i.is_ipv6());
    v4.into_iter().chain(v6).copied().collect()
}

/// The CNI facts of this node: live attachments and tombstones, with a
/// generation that every change raises. Cloned on change (copy on write):
/// a sync works on one version, whole.
#[derive(Clone, Debug, Default)]
pub struct NodeFacts {
    generation: u64,
    next_seq: u64,
    attachments: BTreeMap<AttachmentKey, Attachment>,
    /// Pod uid -> `namespace/name` of the pod, for the pods whose sandbox
    /// was deleted while the API object may still exist.
    tombstones: BTreeMap<String, PodRef>,
    /// Derived: pod uid -> key of its current attachment (the latest).
    by_uid: HashMap<String, AttachmentKey>,
    /// Derived: address -> pod uid of the current attachment claiming it.
    claimed: HashMap<IpAddr, String>,
}

/// How one version of the facts differs from another, for the incremental
/// compile: the pods whose own facts changed, and the addresses whose
/// CNI owner changed (every pod claiming one must be looked at again).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FactsChange {
    /// `namespace/name` of the pods whose attachment or tombstone changed.
    pub pods: BTreeSet<ObjKey>,
    /// Addresses claimed by a different pod (or by none) now.
    pub addresses: BTreeSet<IpAddr>,
}

impl FactsChange {
    /// Nothing changed.
    pub fn is_empty(&self) -> bool {
        self.pods.is_empty() && self.addresses.is_empty()
    }
}

/// An endpoint as a successful sync programmed it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ProgrammedEndpoint {
    /// Endpoint id.
    pub id: u32,
    /// Interface it is programmed on.
    pub ifindex: u32,
}

/// What the last successful sync programmed for the attached pods.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Programmed {
    /// The generation of the facts that sync compiled.
    pub generation: u64,
    /// Pod uid -> its endpoint, for every pod with an attachment whose
    /// endpoint was programmed with the attachment's addresses.
    pub endpoints: HashMap<String, ProgrammedEndpoint>,
}

impl NodeFacts {
    /// Facts restored from a state file (see [`super::persist`]).
    pub fn restore(attachments: Vec<Attachment>, tombstones: Vec<PodRef>) -> NodeFacts {
        let mut f = NodeFacts {
            next_seq: attachments.iter().map(|a| a.seq + 1).max().unwrap_or(0),
            attachments: attachments
                .into_iter()
                .map(|a| ((a.container_id.clone(), a.ifname.clone()), a))
                .collect(),
            tombstones: tombstones.into_iter().map(|p| (p.uid.clone(), p)).collect(),
            ..NodeFacts::default()
        };
        f.reindex();
        f
    }

    /// The generation: raised by every change.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Every attachment, by key.
    pub fn attachments(&self) -> impl Iterator<Item = &Attachment> {
        self.attachments.values()
    }

    /// The tombstoned pods.
    pub fn tombstones(&self) -> impl Iterator<Item = &PodRef> {
        self.tombstones.values()
    }

    /// The attachment with this key.
    pub fn attachment(&self, key: &AttachmentKey) -> Option<&Attachment> {
        self.attachments.get(key)
    }

    /// The current attachment of pod `uid` (its latest).
    pub fn current(&self, uid: &str) -> Option<&Attachment> {
        self.attachments.get(self.by_uid.get(uid)?)
    }

    /// Whether pod `uid` is tombstoned.
    pub fn is_tombstoned(&self, uid: &str) -> bool {
        self.tombstones.contains_key(uid)
    }

    /// Whether the facts hold pod `uid` (a current attachment or a
    /// tombstone) under exactly `namespace/name`: how a mirror pod is
    /// matched to the static pod the runtime attached (the runtime's uid is
    /// the static pod's, named by the mirror pod's
    /// `kubernetes.io/config.mirror`). The name is part of the match, so an
    /// object of another name carrying that annotation never takes the
    /// attachment's addresses (incident 1).
    pub fn holds(&self, uid: &str, namespace: &str, name: &str) -> bool {
        let named = |p: &PodRef| p.namespace == namespace && p.name == name;
        self.current(uid).is_some_and(|a| named(&a.pod)) || self.tombstones.get(uid).is_some_and(named)
    }

    fn reindex(&mut self) {
        self.by_uid.clear();
        self.claimed.clear();
        let mut latest: Vec<&Attachment> = self.attachments.values().collect();
        latest.sort_by_key(|a| a.seq);
        for a in latest {
            let key = (a.container_id.clone(), a.ifname.clone());
            self.by_uid.insert(a.pod.uid.clone(), key);
        }
        // Only a pod's current attachment claims addresses; of two claiming
        // one address, the later ADD.
        let mut current: Vec<&Attachment> = self.by_uid.values().map(|k| &self.attachments[k]).collect();
        current.sort_by_key(|a| a.seq);
        for a in current {
            for ip in used_addresses(&a.ips) {
                self.claimed.insert(ip, a.pod.uid.clone());
            }
        }
    }

    fn changed(&mut self) {
        self.generation += 1;
        self.reindex();
    }

    /// Record the attachment of an ADD (replacing one with the same key),
    /// lift the pod's tombstone, and drop older attachments of other pods
    /// that claim one of its addresses (IPAM handed the address out again,
    /// so their sandbox is gone). Returns the attachments dropped.
    pub fn add(&mut self, mut attachment: Attachment) -> Vec<Attachment> {
        attachment.seq = self.next_seq;
        self.next_seq += 1;
        let ips = used_addresses(&attachment.ips);
        let key = (attachment.container_id.clone(), attachment.ifname.clone());
        let stale: Vec<AttachmentKey> = self
            .attachments
            .iter()
            .filter(|(k, a)| **k != key && a.pod.uid != attachment.pod.uid && a.ips.iter().any(|i| ips.contains(i)))
            .map(|(k, _)| k.clone())
            .collect();
        let dropped: Vec<Attachment> = stale.iter().filter_map(|k| self.attachments.remove(k)).collect();
        for d in &dropped {
            self.tombstone_if_detached(&d.pod);
        }
        self.tombstones.remove(&attachment.pod.uid);
        self.attachments.insert(key, attachment);
        self.changed();
        dropped
    }

    /// Tombstone `pod` unless it still has an attachment.
    fn tombstone_if_detached(&mut self, pod: &PodRef) {
        if !self.attachments.values().any(|a| a.pod.uid == pod.uid) {
            self.tombstones.insert(pod.uid.clone(), pod.clone());
        }
    }

    /// CNI DEL of attachment `key` (of `pod`, when the runtime names it):
    /// the attachment goes and the pod is tombstoned unless it has another
    /// attachment. Returns the attachment removed and whether anything
    /// changed (an unknown attachment of a named pod that has none left
    /// tombstones it too: a restarted agent may have lost the record).
    pub fn del(&mut self, key: &AttachmentKey, pod: Option<&PodRef>) -> (Option<Attachment>, bool) {
        let removed = self.attachments.remove(key);
        let pod = removed.as_ref().map(|a| &a.pod).or(pod).cloned();
        let before = self.tombstones.len();
        if let Some(pod) = &pod {
            if !self.tombstones.contains_key(&pod.uid) {
                self.tombstone_if_detached(pod);
            }
        }
        let changed = removed.is_some() || self.tombstones.len() != before;
        if changed {
            self.changed();
        }
        (removed, changed)
    }

    /// Remove the attachments `gone` says are gone (a GC, a vanished veth),
    /// tombstoning their pods unless attached otherwise. Returns them.
    pub fn remove_where(&mut self, gone: impl Fn(&Attachment) -> bool) -> Vec<Attachment> {
        let keys: Vec<AttachmentKey> = self
            .attachments
            .iter()
            .filter(|(_, a)| gone(a))
            .map(|(k, _)| k.clone())
            .collect();
        let removed: Vec<Attachment> = keys.iter().filter_map(|k| self.attachments.remove(k)).collect();
        for a in &removed {
            self.tombstone_if_detached(&a.pod);
        }
        if !removed.is_empty() {
            self.changed();
        }
        removed
    }

    /// Lift the tombstones `lift` accepts (their pod object is gone).
    /// Returns the pods whose tombstone went.
    pub fn lift_tombstones(&mut self, lift: impl Fn(&PodRef) -> bool) -> Vec<PodRef> {
        let uids: Vec<String> = self
            .tombstones
            .values()
            .filter(|p| lift(p))
            .map(|p| p.uid.clone())
            .collect();
        let lifted: Vec<PodRef> = uids.iter().filter_map(|u| self.tombstones.remove(u)).collect();
        if !lifted.is_empty() {
            self.changed();
        }
        lifted
    }

    /// The overlay on one pod as converted from the API: a tombstoned pod
    /// has no address; an attached pod has its attachment's addresses;
    /// any other pod loses its claim on an address a current attachment
    /// holds. Returns the addresses taken from that other pod.
    pub fn overlay(&self, pod: &mut npm_policy::model::Pod) -> Vec<IpAddr> {
        if self.tombstones.contains_key(&pod.uid) {
            pod.ips.clear();
            return Vec::new();
        }
        if let Some(a) = self.current(&pod.uid) {
            pod.ips = used_addresses(&a.ips);
            return Vec::new();
        }
        if self.claimed.is_empty() {
            return Vec::new();
        }
        let mut stripped = Vec::new();
        pod.ips.retain(|ip| {
            let held = self.claimed.contains_key(ip);
            if held {
                stripped.push(*ip);
            }
            !held
        });
        stripped
    }

    /// How these facts differ from `old` as far as the compiler sees them.
    pub fn change_since(&self, old: &NodeFacts) -> FactsChange {
        let mut change = FactsChange::default();
        if self.generation == old.generation {
            return change;
        }
        let view = |f: &NodeFacts, uid: &str| -> Option<Option<Vec<IpAddr>>> {
            if f.tombstones.contains_key(uid) {
                return Some(None);
            }
            f.current(uid).map(|a| Some(used_addresses(&a.ips)))
        };
        let pods = self
            .attachments
            .values()
            .chain(old.attachments.values())
            .map(|a| (&a.pod, a.pod_key()))
            .chain(
                self.tombstones
                    .values()
                    .chain(old.tombstones.values())
                    .map(|p| (p, (p.namespace.clone(), p.name.clone()))),
            );
        for (pod, key) in pods {
            if view(self, &pod.uid) != view(old, &pod.uid) {
                change.pods.insert(key);
            }
        }
        for (ip, uid) in &self.claimed {
            if old.claimed.get(ip) != Some(uid) {
                change.addresses.insert(*ip);
            }
        }
        for ip in old.claimed.keys() {
            if !self.claimed.contains_key(ip) {
                change.addresses.insert(*ip);
            }
        }
        change
    }

    /// The interfaces of the attached endpoints of `compiled` (endpoint id
    /// -> its attachment's veth ifindex).
    pub fn attached_interfaces(&self, compiled: &Compiled) -> Interfaces {
        if self.by_uid.is_empty() {
            return Interfaces::new();
        }
        compiled
            .endpoints
            .iter()
            .filter_map(|(id, ep)| Some((*id, self.current(&ep.pod.uid)?.ifindex)))
            .collect()
    }

    /// The interfaces of the attached endpoints of `compiled`: each
    /// endpoint of an attached pod is on its attachment's veth, whatever
    /// `resolved` (the route-based resolver) found, and an endpoint the
    /// resolver put on an attached veth is dropped from it.
    pub fn override_interfaces(&self, compiled: &Compiled, resolved: &mut Resolved) {
        apply_attached(resolved, &self.attached_interfaces(compiled));
    }

    /// What a successful sync of these facts programmed for the attached
    /// pods: the endpoints of `compiled` on `interfaces` that carry their
    /// attachment's addresses on its veth.
    pub fn programmed(&self, compiled: &Compiled, interfaces: &Interfaces) -> Programmed {
        let mut endpoints = HashMap::new();
        let attached = if self.by_uid.is_empty() {
            None
        } else {
            Some(&compiled.endpoints)
        };
        for (id, ep) in attached.into_iter().flatten() {
            let Some(a) = self.current(&ep.pod.uid) else {
                continue;
            };
            let ips = used_addresses(&a.ips);
            let carries_all = !ips.is_empty()
                && ips.iter().all(|ip| match ip {
                    IpAddr::V4(v4) => ep.ipv4 == Some(*v4),
                    IpAddr::V6(v6) => ep.ipv6 == Some(*v6),
                });
            if carries_all && interfaces.get(id) == Some(&a.ifindex) {
                endpoints.insert(
                    ep.pod.uid.clone(),
                    ProgrammedEndpoint {
                        id: *id,
                        ifindex: a.ifindex,
                    },
                );
            }
        }
        Programmed {
            generation: self.generation,
            endpoints,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_policy::model::{Pod, PodPhase};

    fn pod_ref(name: &str) -> PodRef {
        PodRef {
            namespace: "ns".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
    }

    fn attachment(container: &str, pod: &str, ip: &str) -> Attachment {
        Attachment {
            network: "net".into(),
            container_id: container.into(),
            ifname: "eth0".into(),
            netns: format!("/var/run/netns/{container}"),
            pod: pod_ref(pod),
            host_interface: format!("veth{container}"),
            ifindex: 10,
            ips: vec![ip.parse().unwrap()],
            seq: 0,
        }
    }

    fn model(name: &str, ips: &[&str]) -> Pod {
        Pod {
            uid: format!("uid-{name}"),
            namespace: "ns".into(),
            name: name.into(),
            labels: Default::default(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            node_name: Some("node-a".into()),
            phase: PodPhase::Pending,
            deleting: false,
            host_network: false,
            ports: vec![],
            created: 0,
        }
    }

    fn ips(p: &Pod) -> Vec<String> {
        p.ips.iter().map(|i| i.to_string()).collect()
    }

    #[test]
    fn overlay_gives_attached_pods_their_addresses_and_strips_stale_claims() {
        let mut f = NodeFacts::default();
        f.add(attachment("c1", "new", "10.0.0.5"));
        let mut new = model("new", &[]);
        assert!(f.overlay(&mut new).is_empty());
        assert_eq!(ips(&new), ["10.0.0.5"]);
        // The API still shows another pod with that address: it loses it.
        let mut old = model("old", &["10.0.0.5", "fd00::5"]);
        assert_eq!(f.overlay(&mut old), vec!["10.0.0.5".parse::<IpAddr>().unwrap()]);
        assert_eq!(ips(&old), ["fd00::5"]);
        // DEL: tombstoned, no address even though the API has one.
        let g = f.generation();
        let (removed, changed) = f.del(&("c1".into(), "eth0".into()), None);
        assert!(removed.is_some() && changed && f.generation() > g);
        let mut new = model("new", &["10.0.0.5"]);
        f.overlay(&mut new);
        assert!(new.ips.is_empty());
        // A DEL again changes nothing; a new ADD lifts the tombstone.
        assert_eq!(f.del(&("c1".into(), "eth0".into()), None), (None, false));
        f.add(attachment("c2", "new", "10.0.0.6"));
        assert!(!f.is_tombstoned("uid-new"));
        let mut new = model("new", &["10.0.0.5"]);
        f.overlay(&mut new);
        assert_eq!(ips(&new), ["10.0.0.6"]);
    }

    #[test]
    fn a_reused_address_moves_to_the_later_attachment() {
        let mut f = NodeFacts::default();
        f.add(attachment("c1", "a", "10.0.0.5"));
        let dropped = f.add(attachment("c2", "b", "10.0.0.5"));
        assert_eq!(dropped.len(), 1);
        assert!(f.is_tombstoned("uid-a"));
        let mut b = model("b", &[]);
        f.overlay(&mut b);
        assert_eq!(ips(&b), ["10.0.0.5"]);
    }

    #[test]
    fn changes_name_the_pods_and_addresses_to_look_at_again() {
        let mut f = NodeFacts::default();
        let empty = f.clone();
        f.add(attachment("c1", "a", "10.0.0.5"));
        let change = f.change_since(&empty);
        assert_eq!(change.pods, [("ns".to_string(), "a".to_string())].into());
        assert_eq!(change.addresses, ["10.0.0.5".parse().unwrap()].into());
        assert!(f.change_since(&f.clone()).is_empty());
        // Lifting a tombstone of a pod whose object is gone.
        let before = f.clone();
        f.del(&("c1".into(), "eth0".into()), None);
        let change = f.change_since(&before);
        assert_eq!(change.pods.len(), 1);
        assert_eq!(change.addresses.len(), 1);
        let lifted = f.lift_tombstones(|p| p.name == "a");
        assert_eq!(lifted.len(), 1);
        assert!(!f.is_tombstoned("uid-a"));
    }

    #[test]
    fn a_pod_is_held_under_its_uid_and_name_only() {
        let mut f = NodeFacts::default();
        f.add(attachment("c1", "static", "10.0.0.5"));
        assert!(f.holds("uid-static", "ns", "static"));
        assert!(!f.holds("uid-static", "ns", "impostor"), "another name");
        assert!(!f.holds("uid-static", "other", "static"), "another namespace");
        assert!(!f.holds("uid-other", "ns", "static"));
        f.del(&("c1".into(), "eth0".into()), None);
        assert!(f.holds("uid-static", "ns", "static"), "tombstoned");
        assert!(!f.holds("uid-static", "ns", "impostor"));
    }

    #[test]
    fn restore_keeps_the_order_of_adds() {
        let mut f = NodeFacts::default();
        f.add(attachment("c1", "a", "10.0.0.5"));
        f.add(attachment("c2", "a", "10.0.0.6"));
        let restored = NodeFacts::restore(f.attachments().cloned().collect(), Vec::new());
        assert_eq!(restored.current("uid-a").unwrap().container_id, "c2");
        let mut r = restored;
        let next = r.add(attachment("c3", "b", "10.0.0.7"));
        assert!(next.is_empty());
        assert!(r.current("uid-b").unwrap().seq > r.current("uid-a").unwrap().seq);
    }
}
