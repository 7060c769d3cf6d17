//! The one place where the agent decides which endpoints report their
//! allowed new connections (`npm_policy::compiled::Endpoint::report_new`,
//! the datapath's `EP_REPORT_NEW`: an allow event for the first packet of
//! each new tracked flow, eBPF ring buffer or nftables NFLOG).
//!
//! With `--flow-logs-allow` the compiler itself sets `report_new` on every
//! endpoint (`CompileOptions::report_new`, set from the flag in
//! `cli.rs`), so the compiled state already is what is programmed and the
//! sync loop copies nothing. For audit mode the compiler leaves it false;
//! the sync loop calls [`apply_report_new`] on the state it is about to
//! program (after the compile and the interface filter, before the diff
//! against what is programmed) only when [`report_new_differs`], so a flag
//! change is an ordinary endpoint update of the diff, and the incremental
//! compile and its cross-check never see it.
//!
//! Conditions, OR-ed, in [`wants_report_new`]:
//! - `--flow-logs-allow` ([`SyncConfig::flow_logs_allow`]): every local
//!   endpoint;
//! - audit mode: an audited policy (`npm.io/audit: "true"`)
//!   selects the endpoint's pod in either direction
//!   ([`Audit::reports`]; the snapshot holds audited policies only in
//!   their enforced form, so the audited ones come from [`Audit`]).

use npm_policy::compiled::{Compiled, Endpoint};
use npm_policy::model::Snapshot;

use super::config::SyncConfig;
use crate::telemetry::audit::Audit;

/// Whether endpoint `ep` (of the snapshot `snapshot` that was compiled)
/// reports its allowed new connections under the settings `cfg` and the
/// audited policies of `audit`.
pub fn wants_report_new(cfg: &SyncConfig, snapshot: &Snapshot, audit: &Audit, _id: u32, ep: &Endpoint) -> bool {
    cfg.flow_logs_allow || audit.reports(snapshot, ep)
}

/// Whether [`apply_report_new`] would change anything in `compiled` (the
/// sync loop copies the compiled state only then).
pub fn report_new_differs(cfg: &SyncConfig, snapshot: &Snapshot, audit: &Audit, compiled: &Compiled) -> bool {
    compiled
        .endpoints
        .iter()
        .any(|(id, ep)| ep.report_new != wants_report_new(cfg, snapshot, audit, *id, ep))
}

/// Sets `report_new` of every endpoint of `compiled` as
/// [`wants_report_new`] decides.
pub fn apply_report_new(cfg: &SyncConfig, snapshot: &Snapshot, audit: &Audit, compiled: &mut Compiled) {
    for (id, ep) in compiled.endpoints.iter_mut() {
        ep.report_new = wants_report_new(cfg, snapshot, audit, *id, ep);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::reconcile::tests::two_endpoints as compiled;

    #[test]
    fn flow_logs_allow_flags_every_endpoint_and_only_then() {
        let snapshot = Snapshot::default();
        let audit = Audit::new();
        let mut c = compiled();
        let off = SyncConfig::default();
        assert!(!report_new_differs(&off, &snapshot, &audit, &c));
        let on = SyncConfig {
            flow_logs_allow: true,
            ..SyncConfig::default()
        };
        assert!(report_new_differs(&on, &snapshot, &audit, &c));
        apply_report_new(&on, &snapshot, &audit, &mut c);
        assert!(c.endpoints.values().all(|e| e.report_new));
        assert!(!report_new_differs(&on, &snapshot, &audit, &c));
        apply_report_new(&off, &snapshot, &audit, &mut c);
        assert!(c.endpoints.values().all(|e| !e.report_new));
    }
}
