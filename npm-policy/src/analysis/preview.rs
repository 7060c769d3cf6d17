//! `npmctl preview`: recorded flows decided on the current state and on the
//! state with new objects applied; the flows whose verdict changes,
//! grouped by pod pair, with what decides each end before and after.
//!
//! A flow's ends are named pods where the record names them (resolved by
//! namespace/name in each state, so the objects' addresses need not be
//! the cluster's), otherwise addresses. The records are the agent's flow
//! log (`npm-agent observe`, `kubectl npm observe -o json`): they hold
//! denied flows always, allowed flows only with `--flow-logs-allow`, so a
//! change that would deny traffic shows only for recorded allowed flows.

use std::collections::BTreeMap;
use std::net::IpAddr;

use serde::Serialize;

use super::exposure::reason_text;
use super::universe::protocol_name;
use crate::compiled::CompileOptions;
use crate::evaluate::{evaluate, EndVerdict, Flow};
use crate::identity::pod_addresses;
use crate::model::{Protocol, Snapshot};

/// One end of a recorded flow.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(untagged)]
pub enum FlowEnd {
    /// A pod by name, with the address recorded.
    Pod {
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// The recorded address.
        ip: IpAddr,
    },
    /// Not a pod (or a pod the record does not name): an address.
    Address {
        /// The address.
        ip: IpAddr,
    },
}

impl FlowEnd {
    /// `ns/name` or the address.
    pub fn label(&self) -> String {
        match self {
            FlowEnd::Pod { namespace, name, .. } => format!("{namespace}/{name}"),
            FlowEnd::Address { ip } => ip.to_string(),
        }
    }

    /// The address in `snapshot`: the named pod's address of the recorded
    /// family, else the recorded one; `false` when a named pod is missing.
    fn resolve(&self, snapshot: &Snapshot) -> (IpAddr, bool) {
        match self {
            FlowEnd::Pod { namespace, name, ip } => match snapshot.pods.get(&(namespace.clone(), name.clone())) {
                Some(p) => (
                    pod_addresses(p).find(|a| a.is_ipv4() == ip.is_ipv4()).unwrap_or(*ip),
                    true,
                ),
                None => (*ip, false),
            },
            FlowEnd::Address { ip } => (*ip, true),
        }
    }
}

/// One distinct recorded flow (source ports ignored).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct RecordedFlow {
    /// Source.
    pub src: FlowEnd,
    /// Destination.
    pub dst: FlowEnd,
    /// IP protocol number.
    pub protocol: u8,
    /// Destination port.
    pub dst_port: u16,
}

/// A flow's verdict on one state, with what decides each end.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Side {
    /// Both ends allow.
    pub allowed: bool,
    /// The source's egress, in words.
    pub egress: String,
    /// The destination's ingress, in words.
    pub ingress: String,
}

fn end_text(v: &EndVerdict) -> String {
    format!(
        "{} ({})",
        if v.allowed { "allowed" } else { "DENIED" },
        reason_text(&v.reason, v.direction)
    )
}

/// One changed flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Change {
    /// `TCP/80`, `ICMP`.
    pub port: String,
    /// The records of it.
    pub records: usize,
    /// On the current state.
    pub before: Side,
    /// With the new objects applied.
    pub after: Side,
}

/// The changes of one (source, destination) pair.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PairChanges {
    /// Source (`ns/name` or address).
    pub from: String,
    /// Destination.
    pub to: String,
    /// The changed flows.
    pub flows: Vec<Change>,
}

/// The report.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Preview {
    /// Distinct flows replayed.
    pub flows: usize,
    /// Records replayed.
    pub records: usize,
    /// Flows whose current-state verdict differs from the recorded one
    /// (the objects do not describe the cluster that recorded them, or
    /// audit mode recorded them): (flow, recorded verdict).
    pub disagree_with_record: usize,
    /// Pods the records name that a state lacks (their recorded address
    /// was used).
    pub missing_pods: Vec<String>,
    /// Newly allowed flows, by pair.
    pub opened: Vec<PairChanges>,
    /// Newly denied flows, by pair.
    pub closed: Vec<PairChanges>,
}

/// Replays `flows` (each with its record count and, if any, the recorded
/// verdict: `true` allowed) on `current` and on `new`.
pub fn preview(
    current: &Snapshot,
    new: &Snapshot,
    opts: &CompileOptions,
    flows: &BTreeMap<RecordedFlow, (usize, Option<bool>)>,
) -> Preview {
    let mut missing = std::collections::BTreeSet::new();
    let mut decide = |s: &Snapshot, f: &RecordedFlow| {
        let (src, a) = f.src.resolve(s);
        let (dst, b) = f.dst.resolve(s);
        for (ok, e) in [(a, &f.src), (b, &f.dst)] {
            if !ok {
                missing.insert(e.label());
            }
        }
        evaluate(
            s,
            opts,
            &Flow {
                src,
                dst,
                protocol: f.protocol,
                dst_port: f.dst_port,
            },
        )
    };
    let mut opened: BTreeMap<(String, String), Vec<Change>> = BTreeMap::new();
    let mut closed: BTreeMap<(String, String), Vec<Change>> = BTreeMap::new();
    let (mut records, mut disagree) = (0, 0);
    for (f, (count, recorded)) in flows {
        records += count;
        let before = decide(current, f);
        let after = decide(new, f);
        if recorded.is_some_and(|r| r != before.allowed) {
            disagree += 1;
        }
        if before.allowed == after.allowed {
            continue;
        }
        let side = |v: &crate::evaluate::Verdict| Side {
            allowed: v.allowed,
            egress: end_text(&v.egress),
            ingress: end_text(&v.ingress),
        };
        let port = if Protocol::from_number(f.protocol).is_some() {
            format!("{}/{}", protocol_name(f.protocol), f.dst_port)
        } else {
            protocol_name(f.protocol)
        };
        let target = if after.allowed { &mut opened } else { &mut closed };
        target.entry((f.src.label(), f.dst.label())).or_default().push(Change {
            port,
            records: *count,
            before: side(&before),
            after: side(&after),
        });
    }
    let pairs = |m: BTreeMap<(String, String), Vec<Change>>| {
        m.into_iter()
            .map(|((from, to), flows)| PairChanges { from, to, flows })
            .collect()
    };
    Preview {
        flows: flows.len(),
        records,
        disagree_with_record: disagree,
        missing_pods: missing.into_iter().collect(),
        opened: pairs(opened),
        closed: pairs(closed),
    }
}

impl std::fmt::Display for Preview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{} records, {} distinct flows: {} newly denied, {} newly allowed",
            self.records,
            self.flows,
            self.closed.iter().map(|p| p.flows.len()).sum::<usize>(),
            self.opened.iter().map(|p| p.flows.len()).sum::<usize>()
        )?;
        if self.disagree_with_record > 0 {
            writeln!(
                f,
                "note: {} flows are decided differently on the current objects than recorded",
                self.disagree_with_record
            )?;
        }
        if !self.missing_pods.is_empty() {
            writeln!(
                f,
                "note: pods not in the objects (recorded address used): {}",
                self.missing_pods.join(", ")
            )?;
        }
        for (title, list) in [("NEWLY DENIED", &self.closed), ("NEWLY ALLOWED", &self.opened)] {
            for p in list {
                writeln!(f, "{title} {} -> {}", p.from, p.to)?;
                for c in &p.flows {
                    writeln!(f, "  {} ({} records)", c.port, c.records)?;
                    // The ends whose decision changed (both in the JSON).
                    for (end, before, after) in [
                        ("egress", &c.before.egress, &c.after.egress),
                        ("ingress", &c.before.ingress, &c.after.ingress),
                    ] {
                        if before != after {
                            writeln!(f, "    {end}: {before} -> {after}")?;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}
