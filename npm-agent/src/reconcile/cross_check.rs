//! The safety net of the incremental compile: a full compile of the same
//! complete state, every `cross_check_interval` (every sync in debug
//! builds), on a thread of its own so that it never delays a sync. A
//! difference is logged, counted in `npm_incremental_mismatch_total`, wakes
//! the loop, and the next sync rebuilds from the complete state.

use std::sync::mpsc;
use std::time::Instant;

use super::dataplane::AgentDataplane;
use super::syncer::Syncer;
use crate::k8s::CompleteState;

impl<D: AgentDataplane> Syncer<D> {
    /// Collect the result of a finished background cross-check.
    pub(super) fn poll_cross_check(&mut self) {
        let Some(rx) = &self.cross_check else { return };
        match rx.try_recv() {
            Err(mpsc::TryRecvError::Empty) => return,
            Ok(None) => {}
            Ok(Some(m)) => {
                self.metrics.incremental_mismatch.increment(1);
                tracing::error!(
                    changes = m.changes,
                    "incremental compile differs from the full compile; trusting the full compile (rebuilding)"
                );
                self.rebuild_pending = true;
            }
            Err(mpsc::TryRecvError::Disconnected) => {
                self.metrics.error("cross-check");
                tracing::error!("the background cross-check stopped without a result");
            }
        }
        self.cross_check = None;
    }

    /// Start a background cross-check of the compile of `state` when one
    /// is due and none is running.
    pub(super) fn start_cross_check(&mut self, state: &CompleteState) {
        let due = cfg!(debug_assertions) || self.last_cross_check.elapsed() >= self.cfg.cross_check_interval;
        if !due || self.cross_check.is_some() {
            return;
        }
        self.last_cross_check = Instant::now();
        let job = self.incremental.cross_check_job(state);
        let cache = self.cache.clone();
        let (tx, rx) = mpsc::channel();
        let spawned = std::thread::Builder::new()
            .name("npm-cross-check".into())
            .spawn(move || {
                let result = job();
                let mismatch = result.is_some();
                let _ = tx.send(result);
                if mismatch {
                    // Wake the sync loop: its next sync rebuilds.
                    cache.mark_changed();
                }
            });
        match spawned {
            Ok(_) => self.cross_check = Some(rx),
            Err(e) => tracing::warn!(error = %e, "could not start the background cross-check"),
        }
    }
}
