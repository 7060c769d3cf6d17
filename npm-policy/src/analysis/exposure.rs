//! `npmctl exposure`: per namespace and direction, the pods no policy
//! isolates, and the pods that outside addresses reach (ingress) or that
//! reach outside addresses (egress), with the rule that opens each.
//!
//! "Outside the cluster" is decided here, documented in the README: an
//! address that no pod and no Node object holds and that is outside every
//! cluster CIDR. The cluster CIDRs are given (`--cluster-cidr`); without
//! them they are the /16 (IPv4) and /64 (IPv6) networks holding the pods'
//! addresses (kind's `10.244.0.0/16`, the demo's `198.18.0.0/16`). Each
//! region of outside addresses that the policies' CIDRs cut
//! ([`super::universe`]) is decided by the reference evaluator for every
//! run of ports; an opening lists the regions and ports one rule allows.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use serde::Serialize;

use super::universe::{describe_runs, live_pods, EndKind, PortRun, Region, Universe};
use crate::compiled::{CompileOptions, Direction};
use crate::evaluate::{evaluate_direction_with_peer, EndReason};
use crate::identity::pod_addresses;
use crate::model::Snapshot;
use crate::tiers::evaluate::{selects, End};

/// One rule that opens a pod to (or from) outside addresses.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Opening {
    /// The rule, in words (`networkpolicy/ns/name ingress[0]`, `not
    /// isolated`, a ClusterNetworkPolicy rule).
    pub rule: String,
    /// Every outside address (all regions of the family) is opened.
    pub any_address: bool,
    /// The regions opened.
    pub regions: Vec<String>,
    /// The ports opened (`TCP 80`, `UDP all`, `other protocols`).
    pub ports: Vec<String>,
}

/// One pod in one direction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodExposure {
    /// `namespace/name`.
    pub pod: String,
    /// The NetworkPolicies and ClusterNetworkPolicies that isolate it in
    /// this direction (empty: unprotected, everything is allowed).
    pub isolated_by: Vec<String>,
    /// The rules opening it to outside addresses.
    pub outside: Vec<Opening>,
}

/// One namespace in one direction.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct NamespaceExposure {
    /// Namespace.
    pub namespace: String,
    /// `ingress` or `egress`.
    pub direction: Direction,
    /// The pods no policy isolates.
    pub unprotected: Vec<String>,
    /// The pods open to (ingress) or towards (egress) outside addresses.
    pub exposed: Vec<PodExposure>,
}

/// The report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Exposure {
    /// The cluster CIDRs used (given or derived).
    pub cluster_cidrs: Vec<IpNet>,
    /// Per namespace and direction (namespaces with pods only).
    pub namespaces: Vec<NamespaceExposure>,
}

/// The default cluster CIDRs: the /16 or /64 of each pod address.
pub fn default_cluster_cidrs(snapshot: &Snapshot) -> Vec<IpNet> {
    let set: BTreeSet<IpNet> = live_pods(snapshot)
        .flat_map(pod_addresses)
        .map(|ip| {
            IpNet::new(ip, if ip.is_ipv4() { 16 } else { 64 })
                .expect("prefix")
                .trunc()
        })
        .collect();
    set.into_iter().collect()
}

/// The reason of an end verdict in words.
pub fn reason_text(reason: &EndReason, dir: Direction) -> String {
    match reason {
        EndReason::NotAPod => "not a pod".into(),
        EndReason::NotIsolated => {
            "not isolated (no NetworkPolicy isolates it, no ClusterNetworkPolicy rule decides)".into()
        }
        EndReason::FromNode => "from the pod's node (always allowed)".into(),
        EndReason::HostEgress => "to the node (allow_host_egress)".into(),
        EndReason::Rule { policy, index } => format!("networkpolicy/{policy} {}[{index}]", dir.name()),
        EndReason::Denied => "isolated and no rule allows".into(),
        EndReason::Tier(m) => {
            let mut s = format!("clusternetworkpolicy/{} {}[{}]", m.policy, dir.name(), m.index);
            if let Some(n) = &m.rule_name {
                s.push_str(&format!(" {n:?}"));
            }
            format!("{s} ({} tier {:?})", m.tier.name(), m.action)
        }
    }
}

/// The exposure of `snapshot`; `cluster_cidrs` empty: the default.
pub fn exposure(snapshot: &Snapshot, opts: &CompileOptions, cluster_cidrs: &[IpNet]) -> Exposure {
    let cidrs: Vec<IpNet> = if cluster_cidrs.is_empty() {
        default_cluster_cidrs(snapshot)
    } else {
        cluster_cidrs.iter().map(|n| n.trunc()).collect()
    };
    let universe = Universe::new(snapshot, &cidrs);
    let outside: Vec<(IpAddr, &Region)> = universe
        .ends
        .iter()
        .filter_map(|e| match &e.kind {
            EndKind::Region(r) if !cidrs.iter().any(|c| c.contains(&r.prefix)) => Some((e.ip, r)),
            _ => None,
        })
        .collect();
    let mut per_ns: BTreeMap<(String, Direction), NamespaceExposure> = BTreeMap::new();
    for pod in live_pods(snapshot).filter(|p| !p.host_network) {
        let families: BTreeSet<bool> = pod_addresses(pod).map(|ip| ip.is_ipv4()).collect();
        for dir in [Direction::Ingress, Direction::Egress] {
            let name = format!("{}/{}", pod.namespace, pod.name);
            let mut isolated_by: Vec<String> = snapshot
                .policies
                .values()
                .filter(|p| {
                    crate::compile::policy_selects(p, pod)
                        && match dir {
                            Direction::Ingress => p.ingress_isolation,
                            Direction::Egress => p.egress_isolation,
                        }
                })
                .map(|p| format!("networkpolicy/{}/{}", p.namespace, p.name))
                .collect();
            isolated_by.extend(
                snapshot
                    .cluster_policies
                    .values()
                    .filter(|c| !c.rules(dir).is_empty() && selects(snapshot, c, pod))
                    .map(|c| format!("clusternetworkpolicy/{}", c.name)),
            );
            // rule -> (regions, runs)
            let mut open: BTreeMap<String, (BTreeSet<Region>, BTreeSet<PortRun>)> = BTreeMap::new();
            let candidates: Vec<&(IpAddr, &Region)> = outside
                .iter()
                .filter(|(ip, _)| families.contains(&ip.is_ipv4()))
                .collect();
            for (ip, region) in &candidates {
                for run in &universe.ports {
                    let v = evaluate_direction_with_peer(
                        snapshot,
                        opts,
                        pod,
                        dir,
                        End::new(*ip, None),
                        run.protocol,
                        run.start,
                    );
                    if v.allowed {
                        let e = open.entry(reason_text(&v.reason, dir)).or_default();
                        e.0.insert((*region).clone());
                        e.1.insert(*run);
                    }
                }
            }
            let entry = per_ns
                .entry((pod.namespace.clone(), dir))
                .or_insert_with(|| NamespaceExposure {
                    namespace: pod.namespace.clone(),
                    direction: dir,
                    unprotected: vec![],
                    exposed: vec![],
                });
            if isolated_by.is_empty() {
                entry.unprotected.push(name.clone());
            }
            if !open.is_empty() {
                let outside_of_family = candidates.len();
                entry.exposed.push(PodExposure {
                    pod: name,
                    isolated_by,
                    outside: open
                        .into_iter()
                        .map(|(rule, (regions, runs))| Opening {
                            rule,
                            any_address: regions.len() == outside_of_family,
                            regions: regions.iter().map(|r| r.to_string()).collect(),
                            ports: describe_runs(&runs),
                        })
                        .collect(),
                });
            }
        }
    }
    Exposure {
        cluster_cidrs: cidrs,
        namespaces: per_ns.into_values().collect(),
    }
}

impl std::fmt::Display for Exposure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let c: Vec<String> = self.cluster_cidrs.iter().map(|c| c.to_string()).collect();
        writeln!(f, "outside = not a pod or node address, not in {}", c.join(", "))?;
        for ns in &self.namespaces {
            writeln!(f, "namespace {} {}:", ns.namespace, ns.direction.name())?;
            if ns.unprotected.is_empty() {
                writeln!(f, "  unprotected: none")?;
            } else {
                writeln!(
                    f,
                    "  unprotected (no policy isolates, open to every address): {}",
                    ns.unprotected.join(", ")
                )?;
            }
            let towards = if ns.direction == Direction::Ingress {
                "reachable from outside"
            } else {
                "reaches outside"
            };
            for p in ns.exposed.iter().filter(|p| !p.isolated_by.is_empty()) {
                for o in &p.outside {
                    let whom = if o.any_address {
                        "any outside address".to_string()
                    } else {
                        o.regions.join("; ")
                    };
                    writeln!(
                        f,
                        "  {towards}: {} {} [{}] by {}",
                        p.pod,
                        whom,
                        o.ports.join(", "),
                        o.rule
                    )?;
                }
            }
        }
        Ok(())
    }
}
