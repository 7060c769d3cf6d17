//! The addresses claimed by live pods, kept up to date pod by pod: the IP
//! conflicts of the incremental compile's snapshot, at no cost when there
//! are none.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use npm_policy::model::{Pod as ModelPod, PodPhase, Snapshot};

use crate::k8s::ObjKey;

/// Addresses claimed by live pods (not terminal, not hostNetwork), kept up
/// to date pod by pod, so that the IP conflicts of a sync cost nothing when
/// there are none.
#[derive(Default)]
pub(super) struct Claims {
    by_ip: HashMap<IpAddr, BTreeSet<ObjKey>>,
    conflicted: BTreeSet<IpAddr>,
}

impl Claims {
    fn live(p: &ModelPod) -> bool {
        !p.host_network && !matches!(p.phase, PodPhase::Succeeded | PodPhase::Failed)
    }

    /// Pod `key` changes from `old` to `new`.
    pub(super) fn update(&mut self, key: &ObjKey, old: Option<&ModelPod>, new: Option<&ModelPod>) {
        for ip in old.filter(|p| Self::live(p)).into_iter().flat_map(|p| &p.ips) {
            if let Some(set) = self.by_ip.get_mut(ip) {
                set.remove(key);
                match set.len() {
                    0 => {
                        self.by_ip.remove(ip);
                        self.conflicted.remove(ip);
                    }
                    1 => {
                        self.conflicted.remove(ip);
                    }
                    _ => {}
                }
            }
        }
        for ip in new.filter(|p| Self::live(p)).into_iter().flat_map(|p| &p.ips) {
            let set = self.by_ip.entry(*ip).or_default();
            set.insert(key.clone());
            if set.len() > 1 {
                self.conflicted.insert(*ip);
            }
        }
    }

    pub(super) fn of(snapshot: &Snapshot) -> Claims {
        let mut c = Claims::default();
        for (key, p) in &snapshot.pods {
            c.update(key, None, Some(p));
        }
        c
    }

    /// Same result as [`crate::reconcile::conflicts::ip_conflicts`] of the snapshot.
    pub(super) fn conflicts(&self) -> BTreeSet<(IpAddr, Vec<String>)> {
        self.conflicted
            .iter()
            .filter_map(|ip| {
                let pods = self.by_ip.get(ip)?;
                Some((*ip, pods.iter().map(|(ns, name)| format!("{ns}/{name}")).collect()))
            })
            .collect()
    }
}
