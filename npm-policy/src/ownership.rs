//! IP ownership (ARCHITECTURE.md invariant 2, incident 1), defined once:
//! which addresses a pod claims, which pod owns an address that several
//! pods claim, and the conflicts (addresses with more than one claimant).
//!
//! - A pod claims its [`claimed_addresses`]: only an addressable pod
//!   ([`is_addressable`]: not hostNetwork, not Succeeded or Failed, with an
//!   address), only the addresses it uses ([`pod_addresses`]: the first of
//!   each family), never a node address (those belong to the node).
//! - Of the pods claiming one address the one with the greatest [`rank`]
//!   owns it: "the live one wins (Running and not deleting, then the
//!   newest, then the greater uid)"; a stale object of a pod that is gone
//!   never takes the address of the pod that holds it now. Two pods equal
//!   on all three (the same uid twice) are ordered by `namespace/name`, the
//!   smaller first.
//!
//! The full compiler uses [`ip_owners`], the incremental compiler keeps a
//! [`Claims`] up to date pod by pod, and both report conflicts with
//! [`Claims::conflicts`] (or [`conflicts`] of a whole snapshot).

use std::borrow::Borrow;
use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;
use std::ops::Deref;
use std::sync::Arc;

use crate::identity::{is_addressable, pod_addresses};
use crate::model::{Pod, PodPhase, Snapshot};

/// A pod's key in a [`Snapshot`]: `(namespace, name)`, shared. The
/// incremental compiler keeps a pod's key in several tables (the
/// claimants of its addresses, their owners, its identity, its endpoint);
/// each holds a pointer to one copy instead of two strings of its own
/// (the claims hold the copy the others clone). Compares, orders and
/// hashes as the `(namespace, name)` pair, which it borrows as, so a
/// table keyed by it is searched with a `&(String, String)`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PodKey {
    shared: Arc<(String, String)>,
}

impl PodKey {
    /// The key of pod `name` in `namespace`.
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> PodKey {
        PodKey {
            shared: Arc::new((namespace.into(), name.into())),
        }
    }

    /// Whether `self` and `other` are one copy (not only equal).
    pub fn shares(&self, other: &PodKey) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }
}

impl From<&(String, String)> for PodKey {
    fn from(k: &(String, String)) -> PodKey {
        PodKey {
            shared: Arc::new(k.clone()),
        }
    }
}

impl Deref for PodKey {
    type Target = (String, String);
    fn deref(&self) -> &(String, String) {
        &self.shared
    }
}

impl Borrow<(String, String)> for PodKey {
    fn borrow(&self) -> &(String, String) {
        &self.shared
    }
}

/// The addresses `pod` claims: none unless it is addressable, else the
/// first address of each family, without the node's addresses.
pub fn claimed_addresses<'a>(pod: &'a Pod, node_ips: &'a [IpAddr]) -> impl Iterator<Item = IpAddr> + 'a {
    is_addressable(pod)
        .then(|| pod_addresses(pod))
        .into_iter()
        .flatten()
        .filter(move |ip| !node_ips.contains(ip))
}

/// The ownership rank of a pod: of two pods claiming one address the
/// greater rank owns it. Ordered by: Running and not deleting, then
/// `created` (newer is greater), then uid, then the smaller
/// `namespace/name`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Rank<'a> {
    live: bool,
    created: i64,
    uid: &'a str,
    key: Reverse<(&'a str, &'a str)>,
}

/// The ownership rank of `pod` (see [`Rank`]).
pub fn rank(pod: &Pod) -> Rank<'_> {
    Rank {
        live: pod.phase == PodPhase::Running && !pod.deleting,
        created: pod.created,
        uid: pod.uid.as_str(),
        key: Reverse((pod.namespace.as_str(), pod.name.as_str())),
    }
}

/// Address -> the pod that owns it, over a whole snapshot; addresses in
/// `node_ips` belong to the node, never to a pod.
pub fn ip_owners<'a>(snapshot: &'a Snapshot, node_ips: &[IpAddr]) -> HashMap<IpAddr, &'a Pod> {
    let mut owners: HashMap<IpAddr, &Pod> = HashMap::with_capacity(snapshot.pods.len() * 2);
    for pod in snapshot.pods.values() {
        for ip in claimed_addresses(pod, node_ips) {
            owners
                .entry(ip)
                .and_modify(|cur| {
                    if rank(pod) > rank(cur) {
                        *cur = pod;
                    }
                })
                .or_insert(pod);
        }
    }
    owners
}

/// The claims on addresses, kept up to date pod by pod: address -> the
/// pods claiming it, and the addresses claimed by more than one pod (so
/// that the conflicts cost nothing when there are none).
///
/// The claimants of an address are a sorted `Vec` (almost always of one
/// pod), not a `BTreeSet`: a set's first node holds room for 11 keys
/// (about 540 bytes for one), a `Vec` of one key 48 bytes, which is
/// about half a KiB per pod of the cluster.
#[derive(Clone, Debug, Default)]
pub struct Claims {
    node_ips: Vec<IpAddr>,
    by_ip: HashMap<IpAddr, Vec<PodKey>>,
    conflicted: BTreeSet<IpAddr>,
}

impl Claims {
    /// No claims yet; addresses in `node_ips` are never claimed.
    pub fn new(node_ips: &[IpAddr]) -> Claims {
        Claims {
            node_ips: node_ips.to_vec(),
            ..Claims::default()
        }
    }

    /// The claims of every pod of `snapshot`.
    pub fn of(snapshot: &Snapshot, node_ips: &[IpAddr]) -> Claims {
        let mut c = Claims::new(node_ips);
        for (key, pod) in &snapshot.pods {
            c.update(&key.into(), None, Some(pod));
        }
        c
    }

    /// Pod `key` changes from `old` to `new` (`None`: absent). Returns the
    /// addresses whose claims were looked at: those of `old`, then those of
    /// `new`.
    pub fn update(&mut self, key: &PodKey, old: Option<&Pod>, new: Option<&Pod>) -> Vec<IpAddr> {
        let old: Vec<IpAddr> = old
            .into_iter()
            .flat_map(|p| claimed_addresses(p, &self.node_ips))
            .collect();
        let new: Vec<IpAddr> = new
            .into_iter()
            .flat_map(|p| claimed_addresses(p, &self.node_ips))
            .collect();
        for &ip in &old {
            if let Some(set) = self.by_ip.get_mut(&ip) {
                if let Ok(i) = set.binary_search(key) {
                    set.remove(i);
                }
                match set.len() {
                    0 => {
                        self.by_ip.remove(&ip);
                        self.conflicted.remove(&ip);
                    }
                    1 => {
                        self.conflicted.remove(&ip);
                    }
                    _ => {}
                }
            }
        }
        for &ip in &new {
            // Room for one: a `Vec`'s first growth makes room for four.
            let set = self.by_ip.entry(ip).or_insert_with(|| Vec::with_capacity(1));
            if let Err(i) = set.binary_search(key) {
                set.insert(i, key.clone());
            }
            if set.len() > 1 {
                self.conflicted.insert(ip);
            }
        }
        [old, new].concat()
    }

    /// Every claimed address.
    pub fn addresses(&self) -> impl Iterator<Item = IpAddr> + '_ {
        self.by_ip.keys().copied()
    }

    /// Every claimed address with its claimants (sorted; their keys are
    /// the copies the claims hold).
    pub fn claimants(&self) -> impl Iterator<Item = (IpAddr, &[PodKey])> + '_ {
        self.by_ip.iter().map(|(ip, pods)| (*ip, pods.as_slice()))
    }

    /// The pod owning `ip` (the claimant of the greatest [`rank`]); `pods`
    /// holds every claimant (the snapshot's pods).
    pub fn owner<'a>(&'a self, ip: IpAddr, pods: &BTreeMap<(String, String), Pod>) -> Option<&'a PodKey> {
        self.by_ip.get(&ip)?.iter().max_by_key(|k| rank(&pods[&***k]))
    }

    /// The addresses claimed by more than one pod, with the claiming pods'
    /// `namespace/name`, sorted.
    pub fn conflicts(&self) -> BTreeSet<(IpAddr, Vec<String>)> {
        self.conflicted
            .iter()
            .filter_map(|ip| {
                let pods = self.by_ip.get(ip)?;
                Some((*ip, pods.iter().map(|k| format!("{}/{}", k.0, k.1)).collect()))
            })
            .collect()
    }
}

/// The conflicts of a whole snapshot (as [`Claims::conflicts`]).
pub fn conflicts(snapshot: &Snapshot, node_ips: &[IpAddr]) -> BTreeSet<(IpAddr, Vec<String>)> {
    Claims::of(snapshot, node_ips).conflicts()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, uid: &str, created: i64, phase: PodPhase, ips: &[&str]) -> Pod {
        Pod {
            uid: uid.to_string(),
            namespace: ns.to_string(),
            name: name.to_string(),
            labels: Default::default(),
            ips: ips.iter().map(|i| i.parse().unwrap()).collect(),
            node_name: None,
            phase,
            deleting: false,
            host_network: false,
            ports: vec![],
            created,
        }
    }

    fn snapshot(pods: Vec<Pod>) -> Snapshot {
        let mut s = Snapshot::default();
        for p in pods {
            s.pods.insert((p.namespace.clone(), p.name.clone()), p);
        }
        s
    }

    const IP: &str = "10.0.0.1";

    /// Each case: two pods `x/a` and `x/b` claiming `IP` (unless said
    /// otherwise), the node addresses, the expected owner and conflict.
    #[test]
    fn ownership_table() {
        use PodPhase::*;
        let running = |name: &str, uid: &str, created: i64| pod("x", name, uid, created, Running, &[IP]);
        let mut deleting = running("a", "u9", 9);
        deleting.deleting = true;
        let mut host = running("a", "u9", 9);
        host.host_network = true;
        #[allow(clippy::type_complexity)]
        let cases: Vec<(&str, Vec<Pod>, Vec<&str>, Option<&str>, bool)> = vec![
            (
                "a single claimant owns",
                vec![running("a", "u1", 1)],
                vec![],
                Some("a"),
                false,
            ),
            (
                "Running beats Pending, even older",
                vec![running("a", "u1", 1), pod("x", "b", "u2", 2, Pending, &[IP])],
                vec![],
                Some("a"),
                true,
            ),
            (
                "not deleting beats deleting, even older",
                vec![deleting, running("b", "u1", 1)],
                vec![],
                Some("b"),
                true,
            ),
            (
                "the newer of two live pods",
                vec![running("a", "u1", 2), running("b", "u2", 1)],
                vec![],
                Some("a"),
                true,
            ),
            (
                "the newer of two non-live pods",
                vec![
                    pod("x", "a", "u1", 1, Pending, &[IP]),
                    pod("x", "b", "u2", 2, Unknown, &[IP]),
                ],
                vec![],
                Some("b"),
                true,
            ),
            (
                "equal age: the greater uid",
                vec![running("a", "u1", 1), running("b", "u2", 1)],
                vec![],
                Some("b"),
                true,
            ),
            (
                "equal uid and age: the smaller name",
                vec![running("a", "u1", 1), running("b", "u1", 1)],
                vec![],
                Some("a"),
                true,
            ),
            (
                "a Succeeded pod claims nothing",
                vec![pod("x", "a", "u9", 9, Succeeded, &[IP]), running("b", "u1", 1)],
                vec![],
                Some("b"),
                false,
            ),
            (
                "a Failed pod claims nothing",
                vec![pod("x", "a", "u9", 9, Failed, &[IP]), running("b", "u1", 1)],
                vec![],
                Some("b"),
                false,
            ),
            (
                "a hostNetwork pod claims nothing",
                vec![host, running("b", "u1", 1)],
                vec![],
                Some("b"),
                false,
            ),
            (
                "a node address is never a pod's",
                vec![running("a", "u1", 1), running("b", "u2", 2)],
                vec![IP],
                None,
                false,
            ),
            (
                "a second address of a family is not claimed",
                vec![
                    pod("x", "a", "u9", 9, Running, &["10.0.0.9", IP]),
                    running("b", "u1", 1),
                ],
                vec![],
                Some("b"),
                false,
            ),
            (
                "one pod listing an address twice is no conflict",
                vec![pod("x", "a", "u1", 1, Running, &[IP, IP])],
                vec![],
                Some("a"),
                false,
            ),
        ];
        let ip: IpAddr = IP.parse().unwrap();
        for (what, pods, node, owner, conflict) in cases {
            let node: Vec<IpAddr> = node.iter().map(|i| i.parse().unwrap()).collect();
            let snap = snapshot(pods);
            let full = ip_owners(&snap, &node).get(&ip).map(|p| p.name.clone());
            assert_eq!(full.as_deref(), owner, "{what}: ip_owners");
            let claims = Claims::of(&snap, &node);
            let inc = claims.owner(ip, &snap.pods).map(|k| k.1.clone());
            assert_eq!(inc.as_deref(), owner, "{what}: Claims::owner");
            assert_eq!(
                conflicts(&snap, &node).iter().any(|(i, _)| *i == ip),
                conflict,
                "{what}: conflicts"
            );
            // The same claims built in the other order, then emptied.
            let mut c = Claims::new(&node);
            for (k, p) in snap.pods.iter().rev() {
                c.update(&k.into(), None, Some(p));
            }
            assert_eq!(c.conflicts(), claims.conflicts(), "{what}: order");
            for (k, p) in &snap.pods {
                c.update(&k.into(), Some(p), None);
            }
            assert!(
                c.addresses().next().is_none() && c.conflicts().is_empty(),
                "{what}: emptied"
            );
        }
    }

    #[test]
    fn conflicts_name_the_claimants() {
        let snap = snapshot(vec![
            pod("y", "b", "u2", 2, PodPhase::Running, &[IP]),
            pod("x", "a", "u1", 1, PodPhase::Pending, &[IP]),
        ]);
        let want: BTreeSet<(IpAddr, Vec<String>)> =
            [(IP.parse().unwrap(), vec!["x/a".to_string(), "y/b".to_string()])].into();
        assert_eq!(conflicts(&snap, &[]), want);
    }
}
