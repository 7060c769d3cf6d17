//! Audit mode in the agent: the datapath's allow events of the
//! endpoints an audited NetworkPolicy (`npm.io/audit: "true"`) selects are
//! decided again against the audited policies, and those they would deny
//! become flow-log lines with `"verdict":"would-deny"` and the count
//! `npm_audit_would_deny_total{namespace,policy,direction}`.
//!
//! The audited policies never reach the compiler (`npm_policy::audit`:
//! the conversion gives the compilers their enforced form, which selects no
//! pod), so they change no verdict. [`Audit`] keeps their real forms,
//! converted from the API objects of the state last compiled
//! ([`Audit::refresh`]), and answers two questions:
//!
//! - which endpoints the datapath must report new connections of
//!   ([`Audit::reports`]: a pod an audited policy selects in either
//!   direction; this sets `Endpoint::report_new`, beside
//!   `--flow-logs-allow`);
//! - whether one allow event is *would deny* ([`Audit::decide`]): the
//!   reference evaluator (`npm_policy::evaluate`) on the enforced snapshot
//!   allows the event's direction, and on the merged snapshot (audited
//!   policies treated as enforced, `npm_policy::audit::AuditView`) denies
//!   it. The reference evaluator rather than a compiled lookup on a second
//!   compile: it needs no compile of the merged state per sync (the merged
//!   snapshot is copied only when an event of an audited endpoint arrives
//!   after a change), it is the specification the compilers are tested
//!   against, and it costs one pass over the pods and policies per event,
//!   for the few events the datapath reports (its event budget bounds
//!   them).
//!
//! The metric counts every would-deny event read, one per audited policy
//! named (labels: only audited policies, so the cardinality is bounded by
//! them); the lines are rate-limited with the flow logs.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_common::DenyEvent;
use npm_policy::audit::{audited_policies, selected_by_audited, AuditView, WouldDeny};
use npm_policy::compiled::{CompileOptions, Compiled, Direction, Endpoint};
use npm_policy::model::{Policy, Snapshot};

use super::flowlog::{FlowRecord, Names};
use super::{FlowLog, Metrics};
use crate::k8s::Objects;

/// The flow-log verdict of a would-deny line.
pub const WOULD_DENY: &str = "would-deny";

/// The audited policies of the state last compiled, the merged view of
/// that state (built when first needed after a change) and the rate limit
/// of the would-deny lines.
#[derive(Debug, Default)]
pub struct Audit {
    /// Would-deny lines per one-second window (0: none are written; the
    /// metric still counts).
    per_sec: u32,
    window: Option<Instant>,
    logged: u32,
    suppressed: u64,
    /// The policies of the last [`Audit::refresh`] (a copy that shares
    /// structure with the store's).
    seen: Objects<NetworkPolicy>,
    /// The audited ones among them, the API objects [`Audit::audited`] was
    /// converted from.
    sources: Objects<NetworkPolicy>,
    audited: BTreeMap<(String, String), Policy>,
    view: Option<AuditView>,
}

/// The endpoint and flow of one event: (pod, direction, peer, protocol,
/// destination port).
type EventFlow = ((String, String), Direction, IpAddr, u8, u16);

/// The [`EventFlow`] of `e`, at an endpoint of `compiled`.
fn flow_of(compiled: &Compiled, e: &DenyEvent) -> Option<EventFlow> {
    let ep = compiled.endpoints.get(&e.endpoint)?;
    let (src, dst) = (addr(e.family, e.src), addr(e.family, e.dst));
    let (direction, peer) = if e.direction == npm_common::DIR_INGRESS {
        (Direction::Ingress, src)
    } else {
        (Direction::Egress, dst)
    };
    Some((
        (ep.pod.namespace.clone(), ep.pod.name.clone()),
        direction,
        peer,
        e.protocol,
        e.dport,
    ))
}

fn addr(family: u8, b: [u8; 16]) -> IpAddr {
    if family == 4 {
        IpAddr::V4(std::net::Ipv4Addr::new(b[12], b[13], b[14], b[15]))
    } else {
        IpAddr::V6(std::net::Ipv6Addr::from(b))
    }
}

impl Audit {
    /// No audited policies; at most 100 would-deny lines per second.
    pub fn new() -> Audit {
        Audit::with_rate(100)
    }

    /// No audited policies; at most `per_sec` would-deny lines per second
    /// (`--flow-logs-per-sec`, a budget of their own beside the deny and
    /// allow lines).
    pub fn with_rate(per_sec: u32) -> Audit {
        Audit {
            per_sec,
            ..Audit::default()
        }
    }

    /// Write what the rate allows of `records` to `flowlog`'s writer
    /// (stdout and `/observe`); returns how many were suppressed. When a
    /// window closes with suppressed lines, their count is logged.
    pub fn log(&mut self, records: &[FlowRecord], flowlog: &mut FlowLog, now: Instant) -> u64 {
        let mut suppressed = 0;
        for r in records {
            let fresh = self
                .window
                .is_none_or(|start| now.saturating_duration_since(start) >= Duration::from_secs(1));
            if fresh {
                if self.suppressed > 0 {
                    tracing::warn!(
                        suppressed = self.suppressed,
                        "would-deny flow logs suppressed by the rate limit"
                    );
                }
                self.window = Some(now);
                self.logged = 0;
                self.suppressed = 0;
            }
            if self.logged < self.per_sec {
                self.logged += 1;
                flowlog.write_record(r);
            } else {
                self.suppressed += 1;
                suppressed += 1;
            }
        }
        suppressed
    }

    /// Take the audited policies of `policies` (the API objects of the
    /// state just compiled, annotations kept by the stores): only the
    /// policies that changed since the last call are looked at (the diff of
    /// two copies of one [`Objects`]), and the audited ones converted again
    /// when one of them changed; the merged view is rebuilt when next
    /// needed (the snapshot changed too).
    pub fn refresh(&mut self, policies: &Objects<NetworkPolicy>) {
        self.view = None;
        let (upserts, removed) = self.seen.diff(policies);
        self.seen = policies.clone();
        let mut changed = false;
        for key in &removed {
            changed |= self.sources.remove(key).is_some();
        }
        for np in upserts {
            if npm_policy::audit::audit_annotation(&np.metadata) == Ok(true) {
                self.sources.insert(np);
                changed = true;
            } else {
                changed |= self.sources.remove(&crate::k8s::key_of(np.as_ref())).is_some();
            }
        }
        if changed {
            self.audited = audited_policies(self.sources.iter().map(|np| np.as_ref()));
        }
    }

    /// The audited policies (their real forms), by (namespace, name).
    pub fn audited(&self) -> &BTreeMap<(String, String), Policy> {
        &self.audited
    }

    /// Whether the datapath must report the new connections of `ep`: an
    /// audited policy selects its pod (of `snapshot`) in either direction.
    pub fn reports(&self, snapshot: &Snapshot, ep: &Endpoint) -> bool {
        if self.audited.is_empty() {
            return false;
        }
        let key = (ep.pod.namespace.clone(), ep.pod.name.clone());
        snapshot
            .pods
            .get(&key)
            .is_some_and(|p| selected_by_audited(self.audited.values(), p))
    }

    /// Whether the allow event `e` of an endpoint of `compiled` (the
    /// programmed state) is one the audited policies would deny, decided
    /// on `snapshot` (the snapshot compiled, audited policies in their
    /// enforced form).
    pub fn decide(
        &mut self,
        e: &DenyEvent,
        compiled: &Compiled,
        snapshot: &Snapshot,
        opts: &CompileOptions,
    ) -> Option<WouldDeny> {
        if self.audited.is_empty() || !e.is_allow() {
            return None;
        }
        let (pod, direction, peer, protocol, port) = flow_of(compiled, e)?;
        if self.view.as_ref().is_some_and(|v| !v.is_for(opts)) {
            self.view = None;
        }
        let audited = &self.audited;
        let view = self
            .view
            .get_or_insert_with(|| AuditView::new(snapshot, opts, audited.clone()));
        view.would_deny(snapshot, opts, &pod, direction, peer, protocol, port)
    }

    /// Decide every allow event of `events`: count each would-deny one in
    /// `metrics` (per audited policy named) and return its flow-log
    /// record (named by `names`, `"verdict":"would-deny"`, `policies` the
    /// audited policies that would deny it).
    pub fn would_deny(
        &mut self,
        events: &[DenyEvent],
        names: &Names<'_>,
        compiled: Option<&Compiled>,
        snapshot: &Snapshot,
        opts: &CompileOptions,
        metrics: &Metrics,
    ) -> Vec<FlowRecord> {
        let Some(compiled) = compiled else {
            return Vec::new();
        };
        let mut out = Vec::new();
        for e in events.iter().filter(|e| e.is_allow()) {
            let Some(w) = self.decide(e, compiled, snapshot, opts) else {
                continue;
            };
            for (ns, name) in &w.policies {
                metrics.audit_would_deny(ns, name, w.direction.name());
            }
            out.push(record(names, e, &w));
        }
        out
    }
}

/// The flow-log record of a would-deny event.
pub fn record(names: &Names<'_>, e: &DenyEvent, w: &WouldDeny) -> FlowRecord {
    let mut r = names.record(e);
    r.verdict = WOULD_DENY;
    r.policies = w.policies.iter().map(|(ns, n)| format!("{ns}/{n}")).collect();
    r
}

#[cfg(test)]
mod tests;
