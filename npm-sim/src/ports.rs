//! `npmctl ports`: every protocol and destination port of the connections
//! from one pod to another, in runs of ports decided alike, with what
//! decides each end (the source's egress, the destination's ingress). The
//! compiled form of the simulator's node, folded per peer class
//! ([`npm_policy::fold`]): the decisions the datapath takes, for all 65,536
//! ports at once.

use std::collections::BTreeSet;
use std::fmt;

use npm_common::Reason;
use npm_policy::compiled::{CompileOptions, Compiled, Direction, RuleRef};
use npm_policy::fold::{fold, Decision, Folded, PeerClass, PORTED};
use npm_policy::lookup::lookup;
use npm_policy::model::{Protocol, Snapshot};

use crate::sim::{pod_pair, ExplainError};

/// One run of the report: destination ports `ports` of `protocol` (`None`:
/// every protocol other than TCP, UDP and SCTP, which have no ports),
/// decided alike at both ends.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PortsRow {
    /// TCP, UDP, SCTP, or `None` for every other protocol.
    pub protocol: Option<Protocol>,
    /// First and last destination port (0, 0 without ports).
    pub ports: (u16, u16),
    /// The source's egress decision.
    pub egress: Decision,
    /// The destination's ingress decision.
    pub ingress: Decision,
}

impl PortsRow {
    /// Both ends allow it.
    pub fn allowed(&self) -> bool {
        self.egress.allowed() && self.ingress.allowed()
    }
}

/// [`ports`]' answer.
#[derive(Clone, Debug)]
pub struct PortsReport {
    /// Source pod (`namespace/name`).
    pub from: String,
    /// Destination pod.
    pub to: String,
    /// The runs: per protocol of TCP, UDP and SCTP, covering every port in
    /// order, then the other protocols.
    pub rows: Vec<PortsRow>,
    /// What decides each row's ends, in words (same order as `rows`).
    why: Vec<(String, String)>,
}

/// The connections from pod `from` to pod `to` (`namespace/name`), every
/// protocol and destination port, as the datapath of the simulator's node
/// decides them (both pods are local there).
pub fn ports(snapshot: &Snapshot, opts: &CompileOptions, from: &str, to: &str) -> Result<PortsReport, ExplainError> {
    let (src, dst) = pod_pair(snapshot, from, to)?;
    let c = npm_policy::compile(snapshot, opts, None);
    let endpoint = |n: &str| {
        c.endpoints
            .iter()
            .find(|(_, e)| format!("{}/{}", e.pod.namespace, e.pod.name) == n)
            .map(|(id, _)| *id)
            .ok_or_else(|| ExplainError::NoPod(n.to_string()))
    };
    let side = |ep: u32, dir: Direction, peer| -> Folded {
        // The peer's class, as step 8 resolves its address.
        let r = lookup(&c, ep, dir, peer, 1, 0);
        let class = PeerClass {
            identity: r.peer_identity,
            cidr_identity: r.cidr_identity,
        };
        fold(&c, ep, dir, class).expect("a compiled endpoint")
    };
    let egress = side(endpoint(from)?, Direction::Egress, dst);
    let ingress = side(endpoint(to)?, Direction::Ingress, src);
    let mut rows = Vec::new();
    for (i, protocol) in PORTED.iter().enumerate() {
        // Both ends' run starts: between two, both decisions hold.
        let starts: BTreeSet<u16> = egress.ported[i]
            .iter()
            .chain(&ingress.ported[i])
            .map(|r| r.lo)
            .collect();
        let starts: Vec<u16> = starts.into_iter().collect();
        for (k, lo) in starts.iter().enumerate() {
            let hi = starts.get(k + 1).map_or(u16::MAX, |next| next - 1);
            let (e, n) = (
                egress.decide(protocol.number(), *lo),
                ingress.decide(protocol.number(), *lo),
            );
            match rows.last_mut() {
                Some(PortsRow {
                    protocol: Some(p),
                    ports,
                    egress,
                    ingress,
                }) if p == protocol && *egress == e && *ingress == n => ports.1 = hi,
                _ => rows.push(PortsRow {
                    protocol: Some(*protocol),
                    ports: (*lo, hi),
                    egress: e,
                    ingress: n,
                }),
            }
        }
    }
    rows.push(PortsRow {
        protocol: None,
        ports: (0, 0),
        egress: egress.other,
        ingress: ingress.other,
    });
    let why = rows
        .iter()
        .map(|r| (describe(&c, snapshot, r.egress), describe(&c, snapshot, r.ingress)))
        .collect();
    Ok(PortsReport {
        from: from.to_string(),
        to: to.to_string(),
        rows,
        why,
    })
}

/// What decided `d`, in words: the reason and the deciding rule.
fn describe(c: &Compiled, s: &Snapshot, d: Decision) -> String {
    let what = match d.reason {
        Reason::Policy => "allowed by NetworkPolicy",
        Reason::PolicyDenied => "isolated by NetworkPolicy, no rule allows it",
        Reason::NotIsolated => "not isolated, no tier decides",
        Reason::Host => "from this node",
        Reason::AdminAccept => "accepted by the Admin tier",
        Reason::AdminDeny => "denied by the Admin tier",
        Reason::BaselineAccept => "accepted by the Baseline tier",
        Reason::BaselineDeny => "denied by the Baseline tier",
        other => other.name(),
    };
    let rule = match d.rule.and_then(|r| c.ids.rules.get(&r)) {
        Some(RuleRef::Policy {
            namespace,
            name,
            direction,
            index,
        }) => format!(": networkpolicy {namespace}/{name} {} rule {index}", direction.name()),
        Some(RuleRef::Cluster {
            name, direction, index, ..
        }) => {
            let rule_name = s
                .cluster_policies
                .get(name)
                .and_then(|p| p.rules(*direction).get(*index))
                .and_then(|r| r.name.clone())
                .map(|n| format!(" ({n})"))
                .unwrap_or_default();
            format!(
                ": clusternetworkpolicy {name} {} rule {index}{rule_name}",
                direction.name()
            )
        }
        Some(RuleRef::HostEgress) => ": the host-egress setting".to_string(),
        None => String::new(),
    };
    format!("{what}{rule}")
}

impl fmt::Display for PortsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{} -> {}:", self.from, self.to)?;
        for (r, (egress, ingress)) in self.rows.iter().zip(&self.why) {
            let what = match r.protocol {
                None => "other protocols".to_string(),
                Some(p) if r.ports.0 == r.ports.1 => format!("{} {}", protocol_name(p), r.ports.0),
                Some(p) => format!("{} {}-{}", protocol_name(p), r.ports.0, r.ports.1),
            };
            let verdict = if r.allowed() { "allowed" } else { "DENIED" };
            writeln!(f, "  {what}: {verdict}")?;
            writeln!(f, "    egress of {}: {egress}", self.from)?;
            writeln!(f, "    ingress of {}: {ingress}", self.to)?;
        }
        Ok(())
    }
}

/// The upper-case name of a protocol with ports.
fn protocol_name(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "TCP",
        Protocol::Udp => "UDP",
        Protocol::Sctp => "SCTP",
    }
}
