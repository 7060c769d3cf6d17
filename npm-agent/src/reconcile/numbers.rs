//! The agent's side of the numbers the compiler hands out
//! ([`npm_policy::numbers`] owns them): the floor a rebuild starts from
//! when nothing is programmed yet, and the refusal of a compiled state
//! with a number past its range (pod identities reaching
//! `IDENTITY_FIRST_CIDR`, or a smaller range of [`SyncConfig::numbers`]).
//!
//! Such a sync fails closed: nothing is applied (the last good state stays
//! programmed, and pods that need the new numbers get no endpoint record,
//! so npm-cni keeps holding them), the readiness check
//! [`CHECK_NUMBER_SPACE`] fails with the reason, `npm_errors_total{kind="numbers"}`
//! counts the refused syncs, and the next sync rebuilds from what is
//! programmed (dropping the provisional numbers, which reached no kernel
//! map).

use npm_policy::compiled::{Compiled, IdTables};

use super::config::SyncConfig;
use super::syncer::SyncError;
use crate::telemetry::health::Health;
use crate::telemetry::metrics::Metrics;

/// The readiness check that fails while a sync is refused for want of a
/// number.
pub const CHECK_NUMBER_SPACE: &str = "number-space";

/// The `prev` of a rebuild when nothing is programmed: no number kept, the
/// counters of a failed attempt (whose numbers the kernel may hold) as
/// floors, and the configured ranges.
pub(super) fn unprogrammed_floor(attempted: Option<&IdTables>, cfg: &SyncConfig) -> Compiled {
    let mut ids = attempted.map(IdTables::floors).unwrap_or_default();
    ids.limits = cfg.numbers;
    Compiled {
        ids,
        ..Compiled::default()
    }
}

/// Refuses `compiled` when one of its numbers is past its range (and
/// reports it); clears a report otherwise.
pub(super) fn check(compiled: &Compiled, health: &Health, metrics: &Metrics) -> Result<(), SyncError> {
    match compiled.ids.exhausted() {
        None => {
            // The check is listed from the first refusal on (a cleared
            // one passes).
            let failing = health
                .readiness()
                .iter()
                .any(|c| c.name == CHECK_NUMBER_SPACE && !c.ok());
            if failing {
                health.set_problem(CHECK_NUMBER_SPACE, None);
            }
            Ok(())
        }
        Some(e) => {
            metrics.error("numbers");
            health.set_problem(CHECK_NUMBER_SPACE, Some(e.to_string()));
            Err(SyncError::NumbersExhausted { source: e.clone() })
        }
    }
}
