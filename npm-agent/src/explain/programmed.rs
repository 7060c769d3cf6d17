//! The state the sync loop last programmed, as `/explain` reads it: the
//! compiled state exactly as written to the dataplane (after the interface
//! filter and a degraded-mode fit, ids included), with the snapshot and
//! compile options it was compiled from. Nothing is compiled per request.
//!
//! Copied on demand: copying the compiled state and the snapshot costs tens
//! of milliseconds at 10,000 pods (an incremental sync takes well under
//! one), so the loop does not copy after every sync. After each successful
//! sync it only bumps a generation ([`ProgrammedView::synced`]); a reader
//! whose copy is older asks the loop ([`ProgrammedView::current`]), which
//! copies between two syncs ([`ProgrammedView::wanted`],
//! [`ProgrammedView::publish`]); later readers share that copy until the
//! next sync. A reader waits at most for the sync under way. After a sync
//! that failed once it had compiled (the loop's compiled state is then not
//! what is programmed), a reader gets the copy of the last successful sync
//! if it was made, else [`ViewError::Uncertain`] until a sync succeeds.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{Duration, SystemTime};

use npm_policy::compiled::{CompileOptions, Compiled};
use npm_policy::model::Snapshot;
use tokio::sync::Notify;

/// One programmed state.
#[derive(Clone, Debug)]
pub struct Programmed {
    /// The compiled state as programmed (ids included).
    pub compiled: Compiled,
    /// The snapshot it was compiled from (the CNI facts overlaid; during a
    /// held removal, the held objects included).
    pub snapshot: Snapshot,
    /// The compile options (this node's name and addresses, host egress).
    pub options: CompileOptions,
    /// The sync generation it is the state of.
    pub generation: u64,
    /// When it was copied.
    pub at: SystemTime,
    /// When it was copied (monotonic: the copy rate limit).
    pub copied: std::time::Instant,
}

/// The shortest time between two copies the sync loop is asked for (see
/// [`ProgrammedView::current`]): a flood of `/explain` after every sync
/// costs the loop at most one copy per interval.
pub const COPY_INTERVAL: Duration = Duration::from_secs(1);

/// Why no programmed state could be read.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ViewError {
    /// Nothing was programmed yet.
    #[error("the agent has programmed nothing yet (its first sync has not completed)")]
    NotProgrammed,
    /// The sync loop did not answer in time (a long sync under way).
    #[error("the sync loop did not hand over its programmed state within {0:?} (a long sync under way?)")]
    Busy(Duration),
    /// The last sync failed after compiling: what is programmed is not
    /// known exactly until a sync succeeds.
    #[error("the last sync failed; what is programmed is uncertain until a sync succeeds (see /readyz?verbose)")]
    Uncertain,
}

#[derive(Debug, Default)]
struct Inner {
    slot: RwLock<Option<Arc<Programmed>>>,
    /// Successful syncs so far (0: nothing programmed).
    synced: AtomicU64,
    /// A sync compiled and has not succeeded (yet): the loop's compiled
    /// state may not be what is programmed.
    unsettled: AtomicBool,
    /// A reader wants a copy of the current generation.
    wanted: Notify,
    /// A copy was published.
    published: Notify,
}

/// The shared slot of the last programmed state; clones share it.
#[derive(Clone, Debug, Default)]
pub struct ProgrammedView(Arc<Inner>);

impl ProgrammedView {
    /// The sync loop: a sync is about to compile (until [`Self::synced`],
    /// the loop cannot hand over an exact copy).
    pub fn syncing(&self) {
        self.0.unsettled.store(true, Ordering::Release);
    }

    /// The sync loop: a sync succeeded (what is programmed may have
    /// changed).
    pub fn synced(&self) {
        self.0.synced.fetch_add(1, Ordering::AcqRel);
        self.0.unsettled.store(false, Ordering::Release);
    }

    /// Whether the loop's compiled state is what is programmed (no sync
    /// failed since the last successful one).
    pub fn is_settled(&self) -> bool {
        !self.0.unsettled.load(Ordering::Acquire)
    }

    /// The sync loop: it cannot hand over a copy (see [`Self::is_settled`]);
    /// wakes the waiting readers.
    pub fn refuse(&self) {
        self.0.published.notify_waiters();
    }

    /// The sync loop: resolves when a reader waits for a copy.
    pub async fn wanted(&self) {
        self.0.wanted.notified().await
    }

    /// Whether the published copy is older than the last sync.
    pub fn is_stale(&self) -> bool {
        let synced = self.0.synced.load(Ordering::Acquire);
        self.slot().is_none_or(|p| p.generation != synced)
    }

    /// The sync loop: publish a copy of what is programmed (the current
    /// generation) and wake the readers waiting for it.
    pub fn publish(&self, compiled: &Compiled, snapshot: &Snapshot, options: &CompileOptions) {
        let p = Arc::new(Programmed {
            compiled: compiled.clone(),
            snapshot: snapshot.clone(),
            options: options.clone(),
            generation: self.0.synced.load(Ordering::Acquire),
            at: SystemTime::now(),
            copied: std::time::Instant::now(),
        });
        // The old copy is dropped after the lock is released.
        let _old = self.0.slot.write().unwrap_or_else(|e| e.into_inner()).replace(p);
        self.0.published.notify_waiters();
    }

    fn slot(&self) -> Option<Arc<Programmed>> {
        self.0.slot.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// The state of the last successful sync: the shared copy when it is
    /// current, else a fresh one the sync loop makes (waiting at most
    /// `within`).
    pub async fn current(&self, within: Duration) -> Result<Arc<Programmed>, ViewError> {
        let until = tokio::time::Instant::now() + within;
        // The loop answered without a current copy (it refused, or a sync
        // finished in between).
        let mut answered = false;
        loop {
            let synced = self.0.synced.load(Ordering::Acquire);
            if synced == 0 {
                return Err(ViewError::NotProgrammed);
            }
            if let Some(p) = self.slot().filter(|p| p.generation == synced) {
                return Ok(p);
            }
            if answered && !self.is_settled() {
                return Err(ViewError::Uncertain);
            }
            // At most one copy per COPY_INTERVAL, however many readers: a
            // stale copy younger than that is waited out first (the wait
            // counts in `within`).
            if let Some(age) = self.slot().map(|p| p.copied.elapsed()) {
                if age < COPY_INTERVAL {
                    let next = tokio::time::Instant::now() + (COPY_INTERVAL - age);
                    if next >= until {
                        return Err(ViewError::Busy(within));
                    }
                    tokio::time::sleep_until(next).await;
                    continue;
                }
            }
            let published = self.0.published.notified();
            tokio::pin!(published);
            // Registered before the loop is asked: its answer is not missed.
            published.as_mut().enable();
            self.0.wanted.notify_one();
            if tokio::time::timeout_at(until, published).await.is_err() {
                return Err(ViewError::Busy(within));
            }
            answered = true;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sync loop that copies the state whenever a reader wants it and it
    /// is stale, counting its copies.
    fn copying_loop(view: &ProgrammedView) -> (tokio::task::JoinHandle<()>, Arc<AtomicU64>) {
        let lp = view.clone();
        let copies = Arc::new(AtomicU64::new(0));
        let n = copies.clone();
        let task = tokio::spawn(async move {
            loop {
                lp.wanted().await;
                if lp.is_stale() {
                    n.fetch_add(1, Ordering::Relaxed);
                    lp.publish(&Compiled::default(), &Snapshot::default(), &CompileOptions::default());
                }
            }
        });
        (task, copies)
    }

    /// Readers after every sync, in a flood: the loop copies at most once
    /// per COPY_INTERVAL, and every reader gets the current state.
    #[tokio::test]
    async fn copies_are_rate_limited() {
        let view = ProgrammedView::default();
        let (task, copies) = copying_loop(&view);
        view.synced();
        let first = view.current(Duration::from_secs(5)).await.unwrap();
        view.synced();
        let readers: Vec<_> = (0..20)
            .map(|_| {
                let v = view.clone();
                tokio::spawn(async move { v.current(Duration::from_secs(5)).await })
            })
            .collect();
        for r in readers {
            let p = r.await.unwrap().unwrap();
            assert_eq!(p.generation, 2);
            assert!(p.copied.duration_since(first.copied) >= COPY_INTERVAL);
        }
        assert_eq!(copies.load(Ordering::Relaxed), 2, "one copy per sync, not per reader");
        // Within the interval, a reader that cannot wait long enough is told busy.
        view.synced();
        assert_eq!(
            view.current(Duration::from_millis(10)).await.unwrap_err(),
            ViewError::Busy(Duration::from_millis(10))
        );
        task.abort();
    }

    #[tokio::test]
    async fn readers_get_a_copy_of_the_last_sync_made_on_demand() {
        let view = ProgrammedView::default();
        let wait = Duration::from_millis(200);
        assert_eq!(view.current(wait).await.unwrap_err(), ViewError::NotProgrammed);
        view.synced();
        // Nobody copies: the reader times out.
        assert_eq!(view.current(wait).await.unwrap_err(), ViewError::Busy(wait));
        // A loop that copies when asked.
        let (task, copies) = copying_loop(&view);
        let a = view.current(Duration::from_secs(5)).await.unwrap();
        let b = view.current(Duration::from_secs(5)).await.unwrap();
        assert_eq!((a.generation, copies.load(Ordering::Relaxed)), (1, 1));
        assert!(Arc::ptr_eq(&a, &b), "a current copy is shared");
        view.synced();
        let c = view.current(Duration::from_secs(5)).await.unwrap();
        assert_eq!((c.generation, copies.load(Ordering::Relaxed)), (2, 2));
        task.abort();
        // A sync that compiled and failed: the loop refuses; the reader is
        // told, not given a mix of old and new.
        view.syncing();
        view.synced();
        view.syncing();
        let lp = view.clone();
        let task = tokio::spawn(async move {
            loop {
                lp.wanted().await;
                if lp.is_settled() {
                    lp.publish(&Compiled::default(), &Snapshot::default(), &CompileOptions::default());
                } else {
                    lp.refuse();
                }
            }
        });
        assert_eq!(
            view.current(Duration::from_secs(5)).await.unwrap_err(),
            ViewError::Uncertain
        );
        view.synced();
        assert_eq!(view.current(Duration::from_secs(5)).await.unwrap().generation, 4);
        task.abort();
    }
}
