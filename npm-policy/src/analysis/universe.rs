//! The finite set of probes the analyses decide: every pod, every node
//! address, one address of each region the policies' CIDRs cut the
//! address space into, and one port of each run of ports the policies and
//! the pods' container ports cut each protocol into. Within one region and
//! one run every flow is decided alike by the evaluator (the policies name
//! no finer distinction), so deciding the probes decides every flow.

use std::collections::BTreeSet;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;
use serde::Serialize;

use crate::identity::{is_addressable, pod_addresses};
use crate::model::{Labels, Peer, Pod, PortSpec, Protocol, Snapshot};
use crate::tiers::{ClusterPeer, ClusterPort};

/// One region of the address space: the addresses of `prefix` outside
/// `except` (the policies' and the cluster's CIDRs nested in it) and
/// outside every pod and node address.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Region {
    /// The smallest CIDR holding the region.
    pub prefix: IpNet,
    /// The CIDRs cut out of it (host routes of pods and nodes not listed).
    pub except: Vec<IpNet>,
}

impl fmt::Display for Region {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.prefix)?;
        if !self.except.is_empty() {
            let e: Vec<String> = self.except.iter().map(|n| n.to_string()).collect();
            write!(f, " except {}", e.join(", "))?;
        }
        Ok(())
    }
}

/// What one probe end is.
#[derive(Clone, Debug)]
pub enum EndKind<'a> {
    /// A pod (addressable, not hostNetwork).
    Pod(&'a Pod),
    /// An address of a Node object (its labels for `nodes` peers).
    Node {
        /// The node's name.
        name: String,
        /// Its labels.
        labels: &'a Labels,
    },
    /// A representative address of a region.
    Region(Region),
}

/// One probe end: an address and what it is.
#[derive(Clone, Debug)]
pub struct ProbeEnd<'a> {
    /// The address.
    pub ip: IpAddr,
    /// What it is.
    pub kind: EndKind<'a>,
}

impl ProbeEnd<'_> {
    /// The pod at this end, if any.
    pub fn pod(&self) -> Option<&Pod> {
        match &self.kind {
            EndKind::Pod(p) => Some(p),
            _ => None,
        }
    }

    /// The node labels at this end, if it is a node address.
    pub fn node_labels(&self) -> Option<&Labels> {
        match &self.kind {
            EndKind::Node { labels, .. } => Some(labels),
            _ => None,
        }
    }

    /// `ns/name`, `node/NAME` or the region.
    pub fn label(&self) -> String {
        match &self.kind {
            EndKind::Pod(p) => format!("{}/{}", p.namespace, p.name),
            EndKind::Node { name, .. } => format!("node/{name} ({})", self.ip),
            EndKind::Region(r) => r.to_string(),
        }
    }
}

/// One run of destination ports of one protocol, decided alike.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct PortRun {
    /// IP protocol number (TCP, UDP, SCTP; ICMP stands for every protocol
    /// without ports).
    pub protocol: u8,
    /// First port (the probe's port).
    pub start: u16,
    /// Last port.
    pub end: u16,
}

/// The protocols with ports.
pub const PORTED: [Protocol; 3] = [Protocol::Tcp, Protocol::Udp, Protocol::Sctp];

/// The probes of a snapshot.
#[derive(Clone, Debug)]
pub struct Universe<'a> {
    /// Every probe end.
    pub ends: Vec<ProbeEnd<'a>>,
    /// Every run of ports (covering all of TCP, UDP and SCTP in order, then
    /// one run for the other protocols).
    pub ports: Vec<PortRun>,
}

/// The pods the analyses consider: addressable, not hostNetwork.
pub fn live_pods(snapshot: &Snapshot) -> impl Iterator<Item = &Pod> {
    snapshot.pods.values().filter(|p| is_addressable(p))
}

fn host(ip: IpAddr) -> IpNet {
    IpNet::new(ip, if ip.is_ipv4() { 32 } else { 128 }).expect("host prefix")
}

fn next_addr(ip: IpAddr) -> Option<IpAddr> {
    match ip {
        IpAddr::V4(a) => u32::from(a).checked_add(1).map(|n| IpAddr::V4(Ipv4Addr::from(n))),
        IpAddr::V6(a) => u128::from(a).checked_add(1).map(|n| IpAddr::V6(Ipv6Addr::from(n))),
    }
}

/// The CIDRs the policies name (ipBlock cidr and except, `networks`).
pub fn policy_cidrs(snapshot: &Snapshot) -> BTreeSet<IpNet> {
    let mut out = BTreeSet::new();
    for p in snapshot.policies.values() {
        for r in p.ingress.iter().chain(&p.egress) {
            for peer in &r.peers {
                if let Peer::IpBlock(b) = peer {
                    out.insert(b.cidr.trunc());
                    out.extend(b.except.iter().map(|e| e.trunc()));
                }
            }
        }
    }
    for c in snapshot.cluster_policies.values() {
        for r in c.ingress.iter().chain(&c.egress) {
            for peer in &r.peers {
                if let ClusterPeer::Networks(nets) = peer {
                    out.extend(nets.iter().map(|n| n.trunc()));
                }
            }
        }
    }
    out
}

/// The regions cut by `cidrs` (plus the roots of each family in use), each
/// with a representative address outside every host route of `hosts`.
fn regions(cidrs: &BTreeSet<IpNet>, hosts: &BTreeSet<IpAddr>) -> Vec<(IpAddr, Region)> {
    let mut all: BTreeSet<IpNet> = cidrs.clone();
    all.extend(hosts.iter().map(|ip| host(*ip)));
    let v6 = all.iter().any(|n| matches!(n, IpNet::V6(_)));
    all.insert("0.0.0.0/0".parse().expect("root"));
    if v6 {
        all.insert("::/0".parse().expect("root"));
    }
    let list: Vec<IpNet> = all.into_iter().collect();
    let mut out = Vec::new();
    for p in &list {
        if hosts.contains(&p.network()) && p.prefix_len() == p.max_prefix_len() {
            continue;
        }
        // The maximal prefixes strictly inside `p`, in address order (the
        // family is laminar: two prefixes nest or are disjoint).
        let inner: Vec<&IpNet> = list.iter().filter(|q| *q != p && p.contains(*q)).collect();
        let children: Vec<&IpNet> = inner
            .iter()
            .copied()
            .filter(|q| !inner.iter().any(|r| r != q && r.contains(*q)))
            .collect();
        let mut children = children;
        children.sort_by_key(|c| c.network());
        let mut candidate = Some(p.network());
        for c in &children {
            match candidate {
                Some(a) if c.contains(&a) => candidate = next_addr(c.broadcast()).filter(|n| p.contains(n)),
                _ => break,
            }
        }
        if let Some(ip) = candidate {
            let except = children
                .iter()
                .filter(|c| c.prefix_len() != c.max_prefix_len() || !hosts.contains(&c.network()))
                .map(|c| **c)
                .collect();
            out.push((ip, Region { prefix: *p, except }));
        }
    }
    out
}

impl<'a> Universe<'a> {
    /// The probes of `snapshot`; `extra_cidrs` (the cluster's own ranges,
    /// for the exposure report) cut regions too.
    pub fn new(snapshot: &'a Snapshot, extra_cidrs: &[IpNet]) -> Self {
        let mut ends = Vec::new();
        let mut hosts = BTreeSet::new();
        for p in live_pods(snapshot) {
            for ip in pod_addresses(p) {
                hosts.insert(ip);
                ends.push(ProbeEnd {
                    ip,
                    kind: EndKind::Pod(p),
                });
            }
        }
        for n in snapshot.nodes.values() {
            for ip in &n.addresses {
                if hosts.insert(*ip) {
                    ends.push(ProbeEnd {
                        ip: *ip,
                        kind: EndKind::Node {
                            name: n.name.clone(),
                            labels: &n.labels,
                        },
                    });
                }
            }
        }
        let mut cidrs = policy_cidrs(snapshot);
        cidrs.extend(extra_cidrs.iter().map(|n| n.trunc()));
        for (ip, region) in regions(&cidrs, &hosts) {
            ends.push(ProbeEnd {
                ip,
                kind: EndKind::Region(region),
            });
        }
        Universe {
            ends,
            ports: port_runs(snapshot),
        }
    }
}

/// The runs of ports of each protocol the policies and container ports cut.
fn port_runs(snapshot: &Snapshot) -> Vec<PortRun> {
    let mut cuts: [BTreeSet<u32>; 3] = Default::default();
    let idx = |p: Protocol| PORTED.iter().position(|x| *x == p).expect("ported");
    let mut cut = |p: Protocol, a: u16, b: u16| {
        let c = &mut cuts[idx(p)];
        c.insert(a as u32);
        c.insert(b as u32 + 1);
    };
    for p in snapshot.policies.values() {
        for r in p.ingress.iter().chain(&p.egress) {
            for port in &r.ports {
                if let PortSpec::Range(a, b) = port.port {
                    cut(port.protocol, a, b);
                }
            }
        }
    }
    for c in snapshot.cluster_policies.values() {
        for r in c.ingress.iter().chain(&c.egress) {
            for port in &r.ports {
                if let ClusterPort::Ports { protocol, start, end } = port {
                    cut(*protocol, *start, *end);
                }
            }
        }
    }
    // Named ports resolve to container ports: each is a run of its own.
    for p in snapshot.pods.values() {
        for c in &p.ports {
            cut(c.protocol, c.port, c.port);
        }
    }
    let mut out = Vec::new();
    for (i, proto) in PORTED.iter().enumerate() {
        let mut points: Vec<u32> = cuts[i].iter().copied().filter(|p| *p <= 65535).collect();
        points.insert(0, 0);
        points.dedup();
        for (j, start) in points.iter().enumerate() {
            let end = points.get(j + 1).map(|n| n - 1).unwrap_or(65535);
            out.push(PortRun {
                protocol: proto.number(),
                start: *start as u16,
                end: end as u16,
            });
        }
    }
    out.push(PortRun {
        protocol: npm_common::proto::ICMP,
        start: 0,
        end: 0,
    });
    out
}

/// A protocol's name.
pub fn protocol_name(p: u8) -> String {
    match Protocol::from_number(p) {
        Some(Protocol::Tcp) => "TCP".into(),
        Some(Protocol::Udp) => "UDP".into(),
        Some(Protocol::Sctp) => "SCTP".into(),
        None if p == npm_common::proto::ICMP => "ICMP".into(),
        None => p.to_string(),
    }
}

/// Runs in words, adjacent runs of a protocol merged: `TCP 80-81`,
/// `UDP all`, `other protocols`.
pub fn describe_runs(runs: &BTreeSet<PortRun>) -> Vec<String> {
    let mut out = Vec::new();
    for proto in PORTED {
        let mut merged: Vec<(u16, u16)> = Vec::new();
        for r in runs.iter().filter(|r| r.protocol == proto.number()) {
            match merged.last_mut() {
                Some(last) if last.1 as u32 + 1 == r.start as u32 => last.1 = r.end,
                _ => merged.push((r.start, r.end)),
            }
        }
        let name = protocol_name(proto.number());
        for (a, b) in merged {
            out.push(match (a, b) {
                (0, 65535) => format!("{name} all"),
                (a, b) if a == b => format!("{name} {a}"),
                (a, b) => format!("{name} {a}-{b}"),
            });
        }
    }
    if runs.iter().any(|r| Protocol::from_number(r.protocol).is_none()) {
        out.push("other protocols".into());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regions_cut_nested_cidrs_and_skip_hosts() {
        let cidrs: BTreeSet<IpNet> = ["10.0.0.0/8", "10.1.0.0/16"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let hosts: BTreeSet<IpAddr> = ["10.0.0.0".parse().unwrap()].into();
        let r = regions(&cidrs, &hosts);
        let got: Vec<(String, String)> = r.iter().map(|(ip, g)| (ip.to_string(), g.to_string())).collect();
        assert_eq!(
            got,
            vec![
                ("0.0.0.0".to_string(), "0.0.0.0/0 except 10.0.0.0/8".to_string()),
                ("10.0.0.1".to_string(), "10.0.0.0/8 except 10.1.0.0/16".to_string()),
                ("10.1.0.0".to_string(), "10.1.0.0/16".to_string()),
            ]
        );
    }

    #[test]
    fn a_fully_covered_prefix_has_no_region() {
        let cidrs: BTreeSet<IpNet> = ["10.0.0.0/31", "10.0.0.0/32", "10.0.0.1/32"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        let r = regions(&cidrs, &BTreeSet::new());
        let prefixes: Vec<String> = r.iter().map(|(_, g)| g.prefix.to_string()).collect();
        assert_eq!(prefixes, vec!["0.0.0.0/0", "10.0.0.0/32", "10.0.0.1/32"]);
    }
}
