//! Who claims and who owns each address, for the incremental compiler:
//! the [`Claims`] of [`crate::ownership`] (the one ownership rule) and the
//! owner of every claimed address, updated together pod by pod.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use crate::identity::pod_addresses;
use crate::model::{Pod, Snapshot};
use crate::ownership::{Claims, PodKey};

/// The claims on addresses and the current owner of each one.
#[derive(Clone, Debug)]
pub(super) struct Addresses {
    /// Address -> pods claiming it (addressable pods only, no node addresses).
    claims: Claims,
    /// Address -> owning pod.
    owner: HashMap<IpAddr, PodKey>,
}

impl Addresses {
    /// The claims and owners of every pod of `snapshot`. Each owner's key
    /// is the copy its claim holds (one copy of the key per pod).
    pub(super) fn new(snapshot: &Snapshot, node_ips: &[IpAddr]) -> Addresses {
        let claims = Claims::of(snapshot, node_ips);
        // The claimant of the greatest rank, as `Claims::owner` (ranks of
        // distinct pods differ): pods are looked up only for addresses
        // with several claimants.
        let mut owner: HashMap<IpAddr, PodKey> = HashMap::with_capacity(snapshot.pods.len());
        for (ip, claimants) in claims.claimants() {
            let won = match claimants {
                [one] => Some(one),
                _ => claims.owner(ip, &snapshot.pods),
            };
            if let Some(w) = won {
                owner.insert(ip, w.clone());
            }
        }
        Addresses { claims, owner }
    }

    /// The claims.
    pub(super) fn claims(&self) -> &Claims {
        &self.claims
    }

    /// The pod owning `ip`.
    pub(super) fn owner(&self, ip: IpAddr) -> Option<&PodKey> {
        self.owner.get(&ip)
    }

    /// The addresses of `pod` (key `key`) that it owns.
    pub(super) fn owned(&self, key: &(String, String), pod: &Pod) -> Vec<IpAddr> {
        pod_addresses(pod)
            .filter(|ip| self.owner.get(ip).is_some_and(|o| **o == *key))
            .collect()
    }

    /// Pod `key` changed from `old` to what `pods` (the snapshot's pods, up
    /// to date) holds; returns the other pods that won or lost an address.
    pub(super) fn update(
        &mut self,
        key: &PodKey,
        old: Option<&Pod>,
        pods: &BTreeMap<(String, String), Pod>,
    ) -> BTreeSet<PodKey> {
        let touched = self.claims.update(key, old, pods.get(&**key));
        let mut others = BTreeSet::new();
        for ip in touched {
            let w = self.claims.owner(ip, pods).cloned();
            let cur = self.owner.get(&ip).cloned();
            if w != cur {
                others.extend(cur.filter(|c| c != key));
                others.extend(w.clone().filter(|c| c != key));
            }
            match w {
                Some(w) => self.owner.insert(ip, w),
                None => self.owner.remove(&ip),
            };
        }
        others
    }
}
