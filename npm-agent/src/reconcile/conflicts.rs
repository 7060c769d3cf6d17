//! IP conflicts: addresses claimed by more than one live pod. The sync
//! loop reports them (`npm_ip_conflicts_total`, a warning per new
//! conflict); the compiler gives each address to one owner.

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;

use npm_policy::model::{Pod, PodPhase, Snapshot};

/// IP conflicts of a snapshot: addresses claimed by more than one live
/// (not terminal, not hostNetwork) pod, with the claiming pods' `ns/name`.
pub fn ip_conflicts(snapshot: &Snapshot) -> BTreeSet<(IpAddr, Vec<String>)> {
    let mut claims: HashMap<IpAddr, Vec<&Pod>> = HashMap::new();
    for p in snapshot.pods.values() {
        if p.host_network || matches!(p.phase, PodPhase::Succeeded | PodPhase::Failed) {
            continue;
        }
        for ip in &p.ips {
            claims.entry(*ip).or_default().push(p);
        }
    }
    claims
        .into_iter()
        .filter(|(_, pods)| pods.len() > 1)
        .map(|(ip, pods)| {
            let mut pods: Vec<String> = pods.iter().map(|p| format!("{}/{}", p.namespace, p.name)).collect();
            pods.sort();
            (ip, pods)
        })
        .collect()
}
