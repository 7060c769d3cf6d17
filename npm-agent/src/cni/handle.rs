//! The facts shared by the CNI server and the sync loop ([`FactsHandle`]):
//! the current [`NodeFacts`] (persisted on every change), and what the last
//! successful sync programmed for them, which CNI requests wait on.

use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::watch;

use super::facts::{NodeFacts, Programmed};
use super::persist;

struct Inner {
    facts: Mutex<Arc<NodeFacts>>,
    programmed: watch::Sender<Arc<Programmed>>,
    /// Where every change is written (`None`: not persisted).
    state_file: Option<PathBuf>,
    /// The generation last written to `state_file`.
    written: Mutex<u64>,
}

/// The CNI facts of this node as the CNI server and the sync loop share
/// them. Cloning shares them. The default holds no facts and persists
/// nothing (an agent without a CNI server).
#[derive(Clone)]
pub struct FactsHandle {
    inner: Arc<Inner>,
}

impl Default for FactsHandle {
    fn default() -> Self {
        FactsHandle::new(NodeFacts::default(), None)
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl FactsHandle {
    /// A handle starting from `facts`, writing every change to `state_file`.
    pub fn new(facts: NodeFacts, state_file: Option<PathBuf>) -> FactsHandle {
        let generation = facts.generation();
        FactsHandle {
            inner: Arc::new(Inner {
                facts: Mutex::new(Arc::new(facts)),
                programmed: watch::Sender::new(Arc::new(Programmed::default())),
                state_file,
                written: Mutex::new(generation),
            }),
        }
    }

    /// The current facts (one consistent version).
    pub fn current(&self) -> Arc<NodeFacts> {
        lock(&self.inner.facts).clone()
    }

    /// Change the facts with `f`; when the generation moved, the new
    /// version is written to the state file (atomically; a failure is
    /// logged, the facts stay in force). Returns `f`'s result and the new
    /// version.
    pub fn update<T>(&self, f: impl FnOnce(&mut NodeFacts) -> T) -> (T, Arc<NodeFacts>) {
        let (out, now) = {
            let mut facts = lock(&self.inner.facts);
            let out = f(Arc::make_mut(&mut facts));
            (out, facts.clone())
        };
        self.persist(&now);
        (out, now)
    }

    fn persist(&self, facts: &NodeFacts) {
        let Some(path) = &self.inner.state_file else { return };
        let mut written = lock(&self.inner.written);
        // A later version may have been written already by a concurrent
        // update: never write an older one over it.
        if facts.generation() <= *written {
            return;
        }
        match persist::save(path, facts) {
            Ok(()) => *written = facts.generation(),
            Err(e) => tracing::error!(error = %e, "CNI attachments not saved; a restarted agent will not know them"),
        }
    }

    /// Publish what a successful sync programmed (the sync loop calls it).
    pub fn publish(&self, programmed: Programmed) {
        self.inner.programmed.send_if_modified(|cur| {
            if **cur == programmed {
                return false;
            }
            *cur = Arc::new(programmed);
            true
        });
    }

    /// What the last successful sync programmed.
    pub fn programmed(&self) -> Arc<Programmed> {
        self.inner.programmed.borrow().clone()
    }

    /// A receiver of every later publication.
    pub fn subscribe(&self) -> watch::Receiver<Arc<Programmed>> {
        self.inner.programmed.subscribe()
    }
}
