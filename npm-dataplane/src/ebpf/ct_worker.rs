//! The conntrack worker: a thread of its own that deletes flows and keeps
//! each endpoint's conntrack quota (`NPM_CT_QUOTA`) close to what the
//! endpoint really holds, so that the sync thread never walks
//! `NPM_CT`/`NPM_CT4`/`NPM_FRAGS`.
//!
//! The writer hands it requests and goes on: the flows of peer addresses
//! that changed hands ([`CtWorker::purge_peers`]), of endpoint ids that
//! no longer run here (the *kept* ids, [`CtWorker::keep`]: every other
//! id's flows go), of ids that must lose their flows before they are
//! programmed ([`CtWorker::purge_ids_now`], which waits). Each request
//! gets a ticket; a *pass* takes every pending request at once and walks
//! each map once with `BPF_MAP_LOOKUP_BATCH`, deleting with
//! `BPF_MAP_DELETE_BATCH` (a few thousand entries a syscall instead of one
//! syscall per key), so a burst of batches costs one walk. The guarantee:
//! once [`CtWorker::completed`] reaches a request's ticket, no entry that
//! existed when the request was made and matches it is left (entries
//! created by packets after it may be deleted too: that only makes their
//! next packet decided again).
//!
//! The same walk deletes the entries that idled out (an idled-out entry
//! answers as absent: deleting it changes no verdict) and counts the live
//! entries of each endpoint's quota slot; the slot's `CT_QUOTA_HELD` is
//! then moved by the difference between the entries found and its
//! snapshot taken before the walk (an atomic add or subtraction beside
//! the datapath's atomic adds; see `correct_words`). Each map's fill
//! (`NPM_CT_FILL`'s `CT_FILL_ENTRIES`, which the datapath raises with
//! every entry it writes and which gates the quota: see
//! `npm_common::CT_QUOTA_SHARE_DEFAULT`) is moved the same way to the entries the
//! walk left. A pass also runs without a request, at most once per
//! [`QUOTA_PASS_INTERVAL`], while the quota is on and a map's fill is at
//! two thirds of its pressure threshold or more: idled-out entries stay
//! in an LRU map until evicted, so without it a busy endpoint's dead flows
//! would push the fill to the threshold; and under pressure the slots'
//! counts are corrected every few seconds (an endpoint whose flows ended
//! gets below its cap again).

use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use npm_common::{
    ct_timeout_ns, ep_epoch_slot, sizes, CtKey, CtKey4, CtValue, FragKey, FragValue, CT_FILL_CT, CT_FILL_CT4,
    CT_FILL_ENTRIES, CT_FILL_PRESSURE, CT_QUOTA_HELD, CT_QUOTA_REFUSED, CT_QUOTA_WORDS, V4_MAPPED_PREFIX,
};

use super::batch;
use super::errors::EbpfError;
use super::shared_words::SharedWords;

/// The worker thread's name (what [`FlowPurges::thread`] reports).
pub const WORKER_THREAD: &str = "npm-conntrack";
/// How often the worker looks at the quota words.
const QUOTA_POLL: Duration = Duration::from_secs(1);
/// The least time between two passes that no request asked for.
pub const QUOTA_PASS_INTERVAL: Duration = Duration::from_secs(5);

/// What the worker did, for metrics and tests.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct FlowPurges {
    /// The latest request's ticket.
    pub requested: u64,
    /// Every request up to this ticket is complete.
    pub completed: u64,
    /// Passes run (walks of the three maps).
    pub passes: u64,
    /// Entries deleted by every pass (purged or idled out).
    pub deleted: u64,
    /// Passes that failed (their requests are retried by the next pass).
    pub failures: u64,
    /// The last pass's duration.
    pub last_pass: Duration,
    /// The entries the last pass walked (all three maps).
    pub last_walked: u64,
    /// The thread the last pass ran on.
    pub thread: Option<String>,
}

/// The pending work and the worker's view of the endpoints.
#[derive(Default)]
struct State {
    /// Endpoint ids whose flows go at the next pass.
    drop_ids: HashSet<u32>,
    /// Peer addresses (IPv6, IPv4-mapped) whose flows go at the next pass.
    peers: HashSet<[u8; 16]>,
    /// The endpoint ids whose flows are kept; every other id's go. `None`
    /// until the first full sync published it: nothing is swept by id.
    keep: Option<HashSet<u32>>,
    /// Endpoint id -> its quota slot (programmed endpoints).
    slots: HashMap<u32, u32>,
    requested: u64,
    taken: u64,
    stop: bool,
    stats: FlowPurges,
    last_error: Option<String>,
}

struct Shared {
    state: Mutex<State>,
    /// The worker waits on it for requests.
    wake: Condvar,
    /// Waiters for a ticket wait on it.
    done: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The maps a pass walks (duplicated descriptors, owned by the worker),
/// the mapped quota words and the mapped fill words (`NPM_CT_FILL`).
struct Maps {
    ct: OwnedFd,
    ct4: OwnedFd,
    frags: OwnedFd,
    quota: Arc<SharedWords>,
    fill: Arc<SharedWords>,
    /// `NPM_CT_CAP` as loaded (`u64::MAX`: no quota).
    cap: u64,
}

/// The handle the dataplane keeps: requests in, the thread stopped and
/// joined on drop.
pub(crate) struct CtWorker {
    shared: Arc<Shared>,
    quota: Arc<SharedWords>,
    fill: Arc<SharedWords>,
    thread: Option<JoinHandle<()>>,
}

impl CtWorker {
    /// Starts the worker on duplicates of the three flow maps'
    /// descriptors, the mapped quota words and the mapped fill words
    /// (`cap`: the datapath's `NPM_CT_CAP`, `u64::MAX` when the quota is
    /// off).
    pub(crate) fn start(
        ct: OwnedFd,
        ct4: OwnedFd,
        frags: OwnedFd,
        quota: Arc<SharedWords>,
        fill: Arc<SharedWords>,
        cap: u64,
    ) -> Result<Self, EbpfError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            wake: Condvar::new(),
            done: Condvar::new(),
        });
        let maps = Maps {
            ct,
            ct4,
            frags,
            quota: quota.clone(),
            fill: fill.clone(),
            cap,
        };
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(WORKER_THREAD.into())
            .spawn(move || run(&s, &maps))
            .map_err(|source| EbpfError::Conntrack { source })?;
        Ok(CtWorker {
            shared,
            quota,
            fill,
            thread: Some(thread),
        })
    }

    fn request(&self, f: impl FnOnce(&mut State)) -> u64 {
        let mut st = self.shared.lock();
        f(&mut st);
        st.requested += 1;
        st.stats.requested = st.requested;
        self.shared.wake.notify_one();
        st.requested
    }

    /// The flows naming one of `peers` go (addresses that changed hands).
    /// Returns the request's ticket.
    pub(crate) fn purge_peers(&self, peers: HashSet<[u8; 16]>) -> u64 {
        self.request(|st| st.peers.extend(peers))
    }

    /// Before a batch may program endpoints: `ids` join the kept ids, so
    /// that no pass sweeps the flows a new endpoint creates before the
    /// batch's end publishes it ([`CtWorker::keep`]).
    pub(crate) fn keep_also(&self, ids: impl IntoIterator<Item = u32>) {
        let mut st = self.shared.lock();
        if let Some(keep) = st.keep.as_mut() {
            keep.extend(ids);
        }
    }

    /// After a batch: the programmed endpoints (id -> host-side ifindex).
    /// Their ids are the kept ones (every other id's flows go at the next
    /// pass, requested here when one went: `sweep`); the ifindexes give
    /// the quota slots. Returns the request's ticket, if one was made.
    pub(crate) fn keep(&self, programmed: &std::collections::BTreeMap<u32, u32>, sweep: bool) -> Option<u64> {
        let mut st = self.shared.lock();
        st.keep = Some(programmed.keys().copied().collect());
        st.slots = programmed.iter().map(|(id, i)| (*id, ep_epoch_slot(*i))).collect();
        drop(st);
        sweep.then(|| self.request(|_| {}))
    }

    /// The flows of `ids` go, now: returns once a pass deleted them (or
    /// failed: its error).
    pub(crate) fn purge_ids_now(&self, ids: HashSet<u32>, timeout: Duration) -> Result<(), EbpfError> {
        let ticket = self.request(|st| st.drop_ids.extend(ids));
        self.wait(ticket, timeout)
    }

    /// A pass with nothing to delete: the fill and quota words are moved
    /// to what the maps hold (after the loader copied flows from another
    /// layout, or adopted maps a program without the fill count wrote).
    /// Returns the request's ticket.
    pub(crate) fn recount(&self) -> u64 {
        self.request(|_| {})
    }

    /// (fill, pressure threshold) of `NPM_CT` and of `NPM_CT4`, as the
    /// datapath reads them.
    pub(crate) fn pressure(&self) -> [(u64, u64); 2] {
        let w = self.fill.words();
        [CT_FILL_CT, CT_FILL_CT4].map(|base| {
            (
                w[(base + CT_FILL_ENTRIES) as usize].load(Ordering::Relaxed),
                w[(base + CT_FILL_PRESSURE) as usize].load(Ordering::Relaxed),
            )
        })
    }

    /// The latest ticket.
    pub(crate) fn requested(&self) -> u64 {
        self.shared.lock().requested
    }

    /// Waits until every request up to `ticket` is complete; an error when
    /// a pass failed meanwhile (the request stays pending) or `timeout`
    /// passed.
    pub(crate) fn wait(&self, ticket: u64, timeout: Duration) -> Result<(), EbpfError> {
        let deadline = Instant::now() + timeout;
        let mut st = self.shared.lock();
        let failures = st.stats.failures;
        while st.stats.completed < ticket {
            if st.stats.failures > failures {
                return Err(purge_err(st.last_error.clone().unwrap_or_default()));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(purge_err(format!("request {ticket} not complete after {timeout:?}")));
            }
            st = self
                .shared
                .done
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        Ok(())
    }

    /// What the worker did.
    pub(crate) fn stats(&self) -> FlowPurges {
        self.shared.lock().stats.clone()
    }

    /// (held, refused) of each quota slot of the programmed endpoints, by
    /// endpoint id (endpoints sharing a slot report the same words).
    pub(crate) fn quota(&self) -> Vec<(u32, u64, u64)> {
        let slots = self.shared.lock().slots.clone();
        let w = self.quota.words();
        let mut out: Vec<(u32, u64, u64)> = slots
            .into_iter()
            .map(|(id, slot)| {
                let base = (slot * CT_QUOTA_WORDS) as usize;
                (
                    id,
                    w[base + CT_QUOTA_HELD as usize].load(Ordering::Relaxed),
                    w[base + CT_QUOTA_REFUSED as usize].load(Ordering::Relaxed),
                )
            })
            .collect();
        out.sort_unstable();
        out
    }
}

impl Drop for CtWorker {
    fn drop(&mut self) {
        self.shared.lock().stop = true;
        self.shared.wake.notify_one();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn purge_err(msg: String) -> EbpfError {
    EbpfError::Conntrack {
        source: io::Error::other(msg),
    }
}

/// One pass's work, taken from the state.
struct Job {
    ticket: u64,
    drop_ids: HashSet<u32>,
    peers: HashSet<[u8; 16]>,
    keep: Option<HashSet<u32>>,
    slots: HashMap<u32, u32>,
}

fn run(shared: &Shared, maps: &Maps) {
    let mut last_pass: Option<Instant> = None;
    let mut st = shared.lock();
    loop {
        if st.stop {
            return;
        }
        let asked = st.requested > st.taken;
        let quota_due =
            !asked && last_pass.is_none_or(|t| t.elapsed() >= QUOTA_PASS_INTERVAL) && fill_near_pressure(maps);
        if !asked && !quota_due {
            st = shared
                .wake
                .wait_timeout(st, QUOTA_POLL)
                .unwrap_or_else(|p| p.into_inner())
                .0;
            continue;
        }
        let job = Job {
            ticket: st.requested,
            drop_ids: std::mem::take(&mut st.drop_ids),
            peers: std::mem::take(&mut st.peers),
            keep: st.keep.clone(),
            slots: st.slots.clone(),
        };
        st.taken = job.ticket;
        drop(st);
        let started = Instant::now();
        let result = pass(maps, &job);
        last_pass = Some(Instant::now());
        st = shared.lock();
        match result {
            Ok((walked, deleted)) => {
                st.stats.completed = job.ticket;
                st.stats.passes += 1;
                st.stats.deleted += deleted;
                st.stats.last_pass = started.elapsed();
                st.stats.last_walked = walked;
                st.stats.thread = std::thread::current().name().map(str::to_string);
                if deleted > 0 {
                    tracing::debug!(walked, deleted, took = ?st.stats.last_pass, "conntrack pass");
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "conntrack pass failed; retrying");
                st.stats.failures += 1;
                st.last_error = Some(e.to_string());
                // The requests stay pending for the next pass.
                st.drop_ids.extend(job.drop_ids);
                st.peers.extend(job.peers);
                st.taken = st.stats.completed;
                shared.done.notify_all();
                st = shared
                    .wake
                    .wait_timeout(st, QUOTA_POLL)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
                continue;
            }
        }
        shared.done.notify_all();
    }
}

/// Whether the quota is on and a conntrack map's fill is at two thirds
/// of its pressure threshold or more (a threshold of 0: always).
fn fill_near_pressure(maps: &Maps) -> bool {
    if maps.cap == u64::MAX {
        return false;
    }
    let w = maps.fill.words();
    [CT_FILL_CT, CT_FILL_CT4].iter().any(|base| {
        let fill = w[(base + CT_FILL_ENTRIES) as usize].load(Ordering::Relaxed);
        let threshold = w[(base + CT_FILL_PRESSURE) as usize].load(Ordering::Relaxed);
        fill.saturating_mul(3) >= threshold.saturating_mul(2)
    })
}

/// `CLOCK_MONOTONIC` in ns (the datapath's coarse clock has the same
/// origin and lags it by at most a tick).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// The peer addresses of a job, as each conntrack map's keys hold them.
struct Peers {
    /// IPv6 and IPv4-mapped (`NPM_CT`, `NPM_FRAGS`).
    v6: HashSet<[u8; 16]>,
    /// The IPv4-mapped ones as IPv4 (`NPM_CT4`).
    v4: HashSet<[u8; 4]>,
}

/// A conntrack map's key, as the walk reads it: `NPM_CT`'s [`CtKey`] and
/// `NPM_CT4`'s [`CtKey4`] (one walk for both, [`walk_ct`]).
trait WalkedKey: Copy {
    fn endpoint(&self) -> u32;
    fn protocol(&self) -> u8;
    /// Whether either address of the flow is one of `peers`.
    fn names(&self, peers: &Peers) -> bool;
}

impl WalkedKey for CtKey {
    fn endpoint(&self) -> u32 {
        self.endpoint
    }
    fn protocol(&self) -> u8 {
        self.protocol
    }
    fn names(&self, peers: &Peers) -> bool {
        peers.v6.contains(&self.addr_lo) || peers.v6.contains(&self.addr_hi)
    }
}

impl WalkedKey for CtKey4 {
    fn endpoint(&self) -> u32 {
        self.endpoint
    }
    fn protocol(&self) -> u8 {
        self.protocol
    }
    fn names(&self, peers: &Peers) -> bool {
        peers.v4.contains(&self.addr_lo) || peers.v4.contains(&self.addr_hi)
    }
}

/// What a walk of one conntrack map did.
#[derive(Default)]
struct Walked {
    walked: u64,
    deleted: u64,
    /// The entries walked and not deleted.
    left: u64,
}

/// Walks the conntrack map `fd` (keys `K`) and deletes the entries of a
/// `gone` endpoint, naming one of `peers`, or for which `count` (which
/// counts the live ones) says they idled out.
fn walk_ct<K: WalkedKey>(
    fd: i32,
    peers: &Peers,
    gone: &impl Fn(u32) -> bool,
    count: &mut impl FnMut(u32, &CtValue, u8) -> bool,
) -> io::Result<Walked> {
    let mut w = Walked::default();
    let mut doomed: Vec<K> = Vec::new();
    batch::for_each::<K, CtValue>(fd, |keys, values| {
        w.walked += keys.len() as u64;
        for (k, v) in keys.iter().zip(values) {
            if gone(k.endpoint()) || k.names(peers) || count(k.endpoint(), v, k.protocol()) {
                doomed.push(*k);
            }
        }
    })?;
    w.left = w.walked - doomed.len() as u64;
    w.deleted = batch::delete(fd, &doomed)?;
    Ok(w)
}

/// The words at `indexes` of `words` with their values now (the
/// snapshot [`correct_words`] moves from), those above 0.
fn snapshot(words: &[AtomicU64], indexes: impl Iterator<Item = u32>) -> Vec<(u32, u64)> {
    indexes
        .map(|i| (i, words[i as usize].load(Ordering::Acquire)))
        .filter(|(_, v)| *v > 0)
        .collect()
}

/// One walk of the three maps for `job`; returns (entries walked,
/// entries deleted).
fn pass(maps: &Maps, job: &Job) -> io::Result<(u64, u64)> {
    let now = monotonic_ns();
    let peers = Peers {
        v6: job.peers.clone(),
        v4: job
            .peers
            .iter()
            .filter(|a| a[..12] == V4_MAPPED_PREFIX)
            .map(|a| [a[12], a[13], a[14], a[15]])
            .collect(),
    };
    let gone = |id: u32| job.drop_ids.contains(&id) || job.keep.as_ref().is_some_and(|k| !k.contains(&id));
    // The quota and fill words before the walk (see `correct_words`).
    let words = maps.quota.words();
    let fill = maps.fill.words();
    let slots: HashSet<u32> = job.slots.values().copied().collect();
    let quota_on = maps.cap != u64::MAX;
    let before = if quota_on {
        snapshot(
            words,
            (0..sizes::ENDPOINT_SLOTS).map(|s| s * CT_QUOTA_WORDS + CT_QUOTA_HELD),
        )
    } else {
        Vec::new()
    };
    let fill_index = [CT_FILL_CT + CT_FILL_ENTRIES, CT_FILL_CT4 + CT_FILL_ENTRIES];
    let fill_before = snapshot(fill, fill_index.into_iter());
    let mut live: HashMap<u32, u64> = HashMap::new();
    let mut count = |id: u32, v: &CtValue, proto: u8| -> bool {
        // Idled out: answers as absent, deleted.
        if now.saturating_sub(v.last_seen_ns) > ct_timeout_ns(proto, v.flags) {
            return true;
        }
        if let Some(slot) = job.slots.get(&id) {
            *live.entry(*slot * CT_QUOTA_WORDS + CT_QUOTA_HELD).or_default() += 1;
        }
        false
    };
    let ct = walk_ct::<CtKey>(maps.ct.as_raw_fd(), &peers, &gone, &mut count)?;
    let ct4 = walk_ct::<CtKey4>(maps.ct4.as_raw_fd(), &peers, &gone, &mut count)?;
    let (mut walked, mut deleted) = (ct.walked + ct4.walked, ct.deleted + ct4.deleted);
    let mut doomed_frags: Vec<FragKey> = Vec::new();
    batch::for_each::<FragKey, FragValue>(maps.frags.as_raw_fd(), |keys, _| {
        walked += keys.len() as u64;
        for k in keys {
            if gone(k.endpoint) || peers.v6.contains(&k.src) || peers.v6.contains(&k.dst) {
                doomed_frags.push(*k);
            }
        }
    })?;
    deleted += batch::delete(maps.frags.as_raw_fd(), &doomed_frags)?;
    if quota_on {
        // Slots of no programmed endpoint are only lowered once the kept
        // ids are known: their entries are then swept as orphans.
        let programmed = |i: u32| slots.contains(&((i - CT_QUOTA_HELD) / CT_QUOTA_WORDS)) || job.keep.is_some();
        correct_words(words, &before, &live, programmed);
    }
    let left: HashMap<u32, u64> = fill_index.into_iter().zip([ct.left, ct4.left]).collect();
    correct_words(fill, &fill_before, &left, |_| true);
    Ok((walked, deleted))
}

/// Moves each word (by index) of `words` from its snapshot `before` the
/// walk to what the walk `found` there, keeping every later add:
/// `word += found - before`; only words `movable` says may move. For a
/// quota slot's `CT_QUOTA_HELD` (found: its live entries) and a map's
/// `CT_FILL_ENTRIES` (found: the entries the walk left). Sound as an
/// upper bound: an entry present at the snapshot and still present is
/// found (the batch walk visits every bucket once), an entry created
/// since added one after the snapshot; an entry created just before the
/// snapshot but inserted after its bucket was walked (a few, one per CPU
/// at most) is the only one missed. It also counts entries no add counted
/// (copied from an older layout, or made by a program without the count).
fn correct_words(words: &[AtomicU64], before: &[(u32, u64)], found: &HashMap<u32, u64>, movable: impl Fn(u32) -> bool) {
    let snapshot: HashMap<u32, u64> = before.iter().copied().collect();
    let touched: HashSet<u32> = snapshot.keys().chain(found.keys()).copied().collect();
    for i in touched {
        if !movable(i) {
            continue;
        }
        let was = snapshot.get(&i).copied().unwrap_or(0);
        let now = found.get(&i).copied().unwrap_or(0);
        let word = &words[i as usize];
        if was > now {
            word.fetch_sub(was - now, Ordering::AcqRel);
        } else if now > was {
            word.fetch_add(now - was, Ordering::AcqRel);
        }
    }
}
