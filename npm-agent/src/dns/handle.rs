//! The learned names as the capture and the sync loop share them
//! ([`NamesHandle`]): the current version (what the next sync compiles),
//! the `domainNames` patterns of the state last compiled (which names are
//! worth learning) and the version last programmed, which a held DNS
//! response waits for.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use npm_policy::model::Snapshot;
use npm_policy::tiers::{ClusterPeer, DomainPattern, LearnedNames};

/// One version of the learned names.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Learned {
    /// Bumped by every change (0: none yet).
    pub version: u64,
    /// Name -> addresses.
    pub names: LearnedNames,
}

#[derive(Default)]
struct Inner {
    current: Mutex<Arc<Learned>>,
    /// The version of the names now: bumped by each change the source
    /// made ([`NamesHandle::changed`]); `current` catches up when read.
    latest: std::sync::atomic::AtomicU64,
    /// Builds the names now (the capture's learner), when `current` is
    /// behind `latest`.
    source: Mutex<Option<NamesSource>>,
    /// `None` until the first sync compiled a state.
    patterns: Mutex<Option<Arc<Vec<DomainPattern>>>>,
    programmed: Mutex<u64>,
    programmed_cv: Condvar,
    /// A capture feeds these names.
    learning: std::sync::atomic::AtomicBool,
    /// The last sync programmed its state (false until the first does,
    /// and after a sync failed, was held or had incomplete lists).
    sync_healthy: std::sync::atomic::AtomicBool,
    /// This node's pods' addresses -> namespace, as last compiled (what a
    /// reply's destination is attributed to).
    namespaces: Mutex<Arc<BTreeMap<IpAddr, String>>>,
    /// Called after each newly programmed version (the capture's reader
    /// waits on it together with its queue).
    programmed_waker: Mutex<Option<Arc<dyn Fn() + Send + Sync>>>,
}

/// What builds the learned names on demand (see [`NamesHandle::set_source`]).
pub type NamesSource = Arc<dyn Fn() -> LearnedNames + Send + Sync>;

/// Why a response that taught something is not held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NoHold {
    /// No state compiled yet (agent start).
    NotCompiled,
    /// The last sync failed, was held or had incomplete lists.
    SyncUnhealthy,
    /// As many responses as allowed are held already.
    Cap,
}

impl NoHold {
    /// The label of the metric.
    pub fn as_str(self) -> &'static str {
        match self {
            NoHold::NotCompiled => "not_held_not_compiled",
            NoHold::SyncUnhealthy => "not_held_sync_unhealthy",
            NoHold::Cap => "not_held_cap",
        }
    }
}

/// The learned names of this node as the DNS capture and the sync loop
/// share them. Cloning shares them. The default holds none (an agent that
/// learns no names).
#[derive(Clone, Default)]
pub struct NamesHandle {
    inner: Arc<Inner>,
}

/// Locks `m`, taking the value of a poisoned lock as it is.
pub(super) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The `domainNames` patterns of every ClusterNetworkPolicy of `snapshot`.
pub fn patterns_of(snapshot: &Snapshot) -> Vec<DomainPattern> {
    let mut out: Vec<DomainPattern> = Vec::new();
    for p in snapshot.cluster_policies.values() {
        for r in p.ingress.iter().chain(&p.egress) {
            for peer in &r.peers {
                if let ClusterPeer::DomainNames(names) = peer {
                    out.extend(names.iter().cloned());
                }
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

/// The addresses of the pods of node `node` in `snapshot` (host-network
/// pods excluded: their address is the node's) -> their namespace.
pub fn pod_namespaces_of(snapshot: &Snapshot, node: &str) -> BTreeMap<IpAddr, String> {
    (snapshot.pods.values())
        .filter(|p| p.node_name.as_deref() == Some(node) && !p.host_network)
        .flat_map(|p| p.ips.iter().map(|ip| (ip.to_canonical(), p.namespace.clone())))
        .collect()
}

impl NamesHandle {
    /// Records this node's pods' addresses -> namespace (the sync loop,
    /// after each compile).
    pub fn set_pod_namespaces(&self, map: BTreeMap<IpAddr, String>) {
        let mut cur = lock(&self.inner.namespaces);
        if **cur != map {
            *cur = Arc::new(map);
        }
    }

    /// The namespace of this node's pod with address `ip` (as last
    /// compiled).
    pub fn namespace_of(&self, ip: IpAddr) -> Option<String> {
        lock(&self.inner.namespaces).get(&ip.to_canonical()).cloned()
    }

    /// The current version: built from the source (once per change, when
    /// read: by the sync loop, not on the path of each DNS reply) when a
    /// change was recorded since.
    pub fn current(&self) -> Arc<Learned> {
        let mut cur = lock(&self.inner.current);
        // Read before building: the names built hold at least this
        // version's changes.
        let latest = self.inner.latest.load(std::sync::atomic::Ordering::Acquire);
        if latest > cur.version {
            if let Some(source) = lock(&self.inner.source).clone() {
                *cur = Arc::new(Learned {
                    version: latest,
                    names: source(),
                });
            }
        }
        cur.clone()
    }

    /// Replaces the names; returns the new version, `None` when they are
    /// unchanged.
    pub fn set(&self, names: LearnedNames) -> Option<u64> {
        let mut cur = lock(&self.inner.current);
        if cur.names == names {
            return None;
        }
        let version = cur
            .version
            .max(self.inner.latest.load(std::sync::atomic::Ordering::Acquire))
            + 1;
        self.inner.latest.store(version, std::sync::atomic::Ordering::Release);
        *cur = Arc::new(Learned { version, names });
        Some(version)
    }

    /// Sets what builds the names when [`NamesHandle::current`] is behind
    /// the changes recorded with [`NamesHandle::changed`].
    pub fn set_source(&self, source: NamesSource) {
        *lock(&self.inner.source) = Some(source);
    }

    /// Records that the source's names changed (after the change is made;
    /// the caller may hold the source's lock: this takes no lock); returns
    /// the version that holds the change. `latest` is never behind
    /// `current`'s version, so this is a new version.
    pub fn changed(&self) -> u64 {
        self.inner.latest.fetch_add(1, std::sync::atomic::Ordering::AcqRel) + 1
    }

    /// Records the patterns of the state the sync loop compiled; true when
    /// they changed.
    pub fn set_patterns(&self, patterns: Vec<DomainPattern>) -> bool {
        let mut p = lock(&self.inner.patterns);
        if p.as_deref() == Some(&patterns) {
            return false;
        }
        *p = Some(Arc::new(patterns));
        true
    }

    /// The patterns of the state last compiled (`None`: nothing compiled
    /// yet).
    pub fn patterns(&self) -> Option<Arc<Vec<DomainPattern>>> {
        lock(&self.inner.patterns).clone()
    }

    /// Whether a pattern of the state last compiled matches `name` (before
    /// the first compile: every name, so that nothing loaded is dropped
    /// before the policies are known).
    pub fn wants(&self, name: &str) -> bool {
        match self.patterns() {
            Some(p) => p.iter().any(|p| p.matches(name)),
            None => true,
        }
    }

    /// Marks these names as fed by a capture ([`crate::dns::Capture`]).
    pub fn set_learning(&self) {
        self.inner.learning.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a capture feeds these names (else `domainNames` peers match
    /// nothing).
    pub fn learning(&self) -> bool {
        self.inner.learning.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Records that a sync programmed version `version` (the sync loop
    /// calls it after each successful apply).
    pub fn publish_programmed(&self, version: u64) {
        let mut p = lock(&self.inner.programmed);
        if version > *p {
            *p = version;
            self.inner.programmed_cv.notify_all();
            drop(p);
            if let Some(wake) = lock(&self.inner.programmed_waker).clone() {
                wake();
            }
        }
    }

    /// Sets what is called after each newly programmed version.
    pub fn set_programmed_waker(&self, wake: Arc<dyn Fn() + Send + Sync>) {
        *lock(&self.inner.programmed_waker) = Some(wake);
    }

    /// Records the outcome of a sync (the sync loop calls it after each):
    /// `healthy` when it programmed the state from complete lists.
    pub fn sync_result(&self, healthy: bool) {
        self.inner
            .sync_healthy
            .store(healthy, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a DNS response may be held for its programming now: a state
    /// was compiled (before, every name is wanted and no sync can be
    /// counted on soon) and the last sync programmed its state (while syncs
    /// fail or are held, a hold would only ever expire). Otherwise the
    /// response is let through at once.
    pub fn may_hold(&self) -> Result<(), NoHold> {
        if self.patterns().is_none() {
            Err(NoHold::NotCompiled)
        } else if !self.inner.sync_healthy.load(std::sync::atomic::Ordering::Relaxed) {
            Err(NoHold::SyncUnhealthy)
        } else {
            Ok(())
        }
    }

    /// The version last programmed.
    pub fn programmed(&self) -> u64 {
        *lock(&self.inner.programmed)
    }

    /// Blocks until version `version` is programmed or `timeout` passed;
    /// true when programmed.
    pub fn wait_programmed(&self, version: u64, timeout: Duration) -> bool {
        let until = Instant::now() + timeout;
        let mut p = lock(&self.inner.programmed);
        while *p < version {
            let left = until.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            p = self
                .inner
                .programmed_cv
                .wait_timeout(p, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn versions_patterns_and_the_programmed_wait() {
        let h = NamesHandle::default();
        assert_eq!(h.current().version, 0);
        assert!(h.wants("anything.example"), "before the first compile every name");
        let names: LearnedNames = [("a.example.com".to_string(), ["192.0.2.1".parse().unwrap()].into())].into();
        assert_eq!(h.set(names.clone()), Some(1));
        assert_eq!(h.set(names), None, "unchanged");
        h.set_patterns(vec![DomainPattern::parse("*.example.com").unwrap()]);
        assert!(h.wants("a.example.com") && !h.wants("example.com"));
        assert!(!h.wait_programmed(1, Duration::from_millis(20)));
        let h2 = h.clone();
        let t = std::thread::spawn(move || h2.wait_programmed(1, Duration::from_secs(5)));
        std::thread::sleep(Duration::from_millis(20));
        h.publish_programmed(1);
        assert!(t.join().unwrap());
        assert_eq!(h.programmed(), 1);
    }

    #[test]
    fn changes_are_built_from_the_source_when_read() {
        let h = NamesHandle::default();
        let names: LearnedNames = [("a.io".to_string(), ["192.0.2.1".parse().unwrap()].into())].into();
        assert_eq!(h.set(names.clone()), Some(1));
        let built = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let (b, src) = (built.clone(), names.clone());
        h.set_source(Arc::new(move || {
            b.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let mut n = src.clone();
            n.insert("b.io".into(), ["192.0.2.2".parse().unwrap()].into());
            n
        }));
        assert_eq!(h.current().version, 1, "no change recorded: not built");
        assert_eq!((h.changed(), h.changed()), (2, 3));
        let cur = h.current();
        assert_eq!((cur.version, cur.names.len()), (3, 2));
        assert_eq!(h.current().version, 3);
        assert_eq!(
            built.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "built once for two changes"
        );
    }

    #[test]
    fn holds_only_after_a_compile_while_syncs_succeed() {
        let h = NamesHandle::default();
        h.sync_result(true);
        assert_eq!(h.may_hold(), Err(NoHold::NotCompiled));
        h.set_patterns(vec![]);
        assert_eq!(h.may_hold(), Ok(()));
        h.sync_result(false);
        assert_eq!(h.may_hold(), Err(NoHold::SyncUnhealthy));
        let woken = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let w = woken.clone();
        h.set_programmed_waker(Arc::new(move || {
            w.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }));
        h.publish_programmed(3);
        h.publish_programmed(2);
        assert_eq!(
            woken.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "woken by a new version only"
        );
    }
}
