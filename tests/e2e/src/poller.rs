//! A background thread that runs one pass of a level-triggered loop every interval until
//! stopped, and records what the callers of the emulated controllers ask about: whether a
//! pass has succeeded yet, how many passes succeeded, and the error of the last failed
//! attempt. The EndpointSlice controller and the kube-proxy emulation run on it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// What one pass did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pass {
    /// The pass did its work: counted, marks the poller synced, clears the last error.
    Done,
    /// The pass had nothing to do: the recorded state is left as it is.
    Idle,
    /// The pass failed: its error becomes the last error.
    Failed(String),
}

/// State shared with the background thread.
#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    synced: AtomicBool,
    done: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl Shared {
    fn record(&self, pass: Pass) {
        match pass {
            Pass::Idle => {}
            Pass::Done => {
                // The error first: whoever sees the pass counted sees it cleared.
                self.set_error(None);
                self.done.fetch_add(1, Ordering::SeqCst);
                self.synced.store(true, Ordering::SeqCst);
            }
            Pass::Failed(e) => self.set_error(Some(e)),
        }
    }

    fn set_error(&self, e: Option<String>) {
        if let Ok(mut g) = self.last_error.lock() {
            *g = e;
        }
    }
}

/// A running polling thread; dropping it stops it (and waits for the pass under way).
#[derive(Debug)]
pub struct Poller {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Poller {
    /// Start thread `name` running `pass` now and then every `interval` (the interval is
    /// slept after each pass) until [`Poller::halt`] or drop.
    pub fn spawn(
        name: String,
        interval: Duration,
        mut pass: impl FnMut() -> Pass + Send + 'static,
    ) -> std::io::Result<Poller> {
        let shared = Arc::new(Shared::default());
        let sh = shared.clone();
        let thread = std::thread::Builder::new().name(name).spawn(move || {
            while !sh.stop.load(Ordering::SeqCst) {
                sh.record(pass());
                std::thread::sleep(interval);
            }
        })?;
        Ok(Poller {
            shared,
            thread: Some(thread),
        })
    }

    /// Wait up to `timeout` until one pass was [`Pass::Done`]; whether one was.
    pub fn wait_synced(&self, timeout: Duration) -> bool {
        let t0 = Instant::now();
        while !self.synced() && t0.elapsed() < timeout {
            std::thread::sleep(Duration::from_millis(20));
        }
        self.synced()
    }

    /// Whether a pass was [`Pass::Done`] yet.
    pub fn synced(&self) -> bool {
        self.shared.synced.load(Ordering::SeqCst)
    }

    /// How many passes were [`Pass::Done`].
    pub fn done_count(&self) -> u64 {
        self.shared.done.load(Ordering::SeqCst)
    }

    /// The error of the last failed pass, unless a pass was done since.
    pub fn last_error(&self) -> Option<String> {
        self.shared.last_error.lock().map(|e| e.clone()).unwrap_or(None)
    }

    /// Stop the thread and wait for it; true when a running thread was stopped by this
    /// call (false when it was halted before).
    pub fn halt(&mut self) -> bool {
        self.shared.stop.store(true, Ordering::SeqCst);
        match self.thread.take() {
            Some(t) => {
                let _ = t.join();
                true
            }
            None => false,
        }
    }
}

impl Drop for Poller {
    fn drop(&mut self) {
        self.halt();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_done_idle_and_failed_passes() {
        let mut n = 0u32;
        let mut p = Poller::spawn("poller-test".into(), Duration::from_millis(1), move || {
            n += 1;
            match n {
                1 => Pass::Failed("first".into()),
                2 => Pass::Idle,
                3 | 4 => Pass::Done,
                5 => Pass::Failed("fifth".into()),
                _ => Pass::Idle,
            }
        })
        .unwrap();
        assert!(p.wait_synced(Duration::from_secs(5)));
        let fifth = || p.last_error().as_deref() == Some("fifth");
        let t0 = Instant::now();
        while !fifth() && t0.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert!(fifth(), "{:?}", p.last_error());
        // Idle passes after the fifth keep its error; only Done passes are counted.
        std::thread::sleep(Duration::from_millis(30));
        assert!(fifth(), "{:?}", p.last_error());
        assert_eq!(p.done_count(), 2);
        assert!(p.halt());
        assert!(!p.halt());
    }
}
