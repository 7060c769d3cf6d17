//! Capturing the DNS responses of trusted servers to this node's pods
//! ([`Capture`]): the rules of [`super::rules`] send every UDP reply of a
//! connection a pod opened to a trusted server's port 53 to an NFQUEUE this
//! module reads ([`super::nfqueue`]). Each response is parsed, its answers
//! learned ([`Learner`]), and, when that changed the learned names, the
//! response is parked until the sync loop has programmed them (at most
//! [`CaptureConfig::hold`]): the pod then connects to an address already
//! allowed. Every response is accepted, never dropped: the queue is
//! `--queue-bypass` (no reader: the kernel lets the packet through) and
//! fail-open (a full queue too), so a stopped agent never breaks DNS; it
//! only stops learning.
//!
//! The node's DNS is never serialised behind a hold: the reader keeps
//! reading while responses are parked, issues each verdict as soon as it
//! is due (out of order: a parked response waits only for its own
//! version, until its own deadline), holds nothing before the first
//! compile or while syncs fail or are held ([`NamesHandle::may_hold`]),
//! and parks at most [`CaptureConfig::max_holds`] responses at once.
//!
//! Only replies to queries sent to a trusted server are read: a pod cannot
//! teach the agent an address by sending a forged answer from elsewhere
//! (NPEP-133: "implementations that operate by snooping DNS responses on
//! the wire MUST only trust responses originating from the canonical DNS
//! server").

use std::collections::VecDeque;
use std::net::IpAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::handle::{lock, NamesHandle, NoHold};
use super::learner::{parse_response, Learner, Limits, NO_NAMESPACE};
use super::nfqueue::{NfQueue, Packet};
pub use super::rules::{chain_name, remove_rules, RulesError, CHAIN_PREFIX};

/// Packets the kernel queues for the reader before fail-open lets the
/// next ones through unread.
const QUEUE_MAX_LEN: u32 = 4096;

/// What [`Capture`] needs.
#[derive(Clone, Debug)]
pub struct CaptureConfig {
    /// The trusted DNS servers (the addresses pods send their queries to:
    /// the cluster DNS Service's ClusterIPs).
    pub servers: Vec<IpAddr>,
    /// The NFQUEUE number (one agent per number; it also names the chain).
    pub queue: u16,
    /// Longest time a response that taught a new address is held for its
    /// programming.
    pub hold: Duration,
    /// Most responses held at once; beyond, a response that taught a new
    /// address is let through at once (counted).
    pub max_holds: usize,
    /// How often the rules are checked (and re-installed when a firewall
    /// reload removed them).
    pub recheck: Duration,
    /// The learner's limits and grace.
    pub limits: Limits,
    /// Where the learned names are kept across restarts (`None`: not kept).
    pub state_file: Option<PathBuf>,
}

impl CaptureConfig {
    /// The defaults for `servers` on `queue`: hold 1 s, 256 holds at once,
    /// rules checked every 5 s, default limits, no state file.
    pub fn new(servers: Vec<IpAddr>, queue: u16) -> Self {
        Self {
            servers,
            queue,
            hold: Duration::from_secs(1),
            max_holds: 256,
            recheck: Duration::from_secs(5),
            limits: Limits::default(),
            state_file: None,
        }
    }
}

/// Errors of the capture.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// An iptables command failed.
    #[error(transparent)]
    Rule(#[from] RulesError),
    /// The queue could not be opened or bound.
    #[error("NFQUEUE {queue}: {op}: {message}")]
    Queue {
        /// The queue number.
        queue: u16,
        /// What was done.
        op: &'static str,
        /// The error.
        message: String,
    },
    /// The capture thread could not be started.
    #[error("capture thread: {0}")]
    Thread(#[source] std::io::Error),
}

/// The UDP payload of an IPv4 or IPv6 packet (no IPv6 extension headers),
/// `None` for anything else.
pub fn udp_payload(p: &[u8]) -> Option<&[u8]> {
    let h = npm_common::IpHeader::parse(p)?;
    if h.protocol != npm_common::proto::UDP || !h.first_fragment {
        return None;
    }
    p.get(h.l4_offset + 8..)
}

/// The destination address of an IPv4 or IPv6 packet.
pub fn destination(p: &[u8]) -> Option<IpAddr> {
    match p.first()? >> 4 {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(p.get(16..20)?).ok()?)),
        6 => Some(IpAddr::from(<[u8; 16]>::try_from(p.get(24..40)?).ok()?).to_canonical()),
        _ => None,
    }
}

/// What the capture counts (read by the metrics).
#[derive(Debug, Default)]
pub struct CaptureStats {
    /// Responses read.
    pub responses: AtomicU64,
    /// Responses that taught a new (name, address).
    pub learning: AtomicU64,
    /// Packets that were not a parsable DNS response.
    pub unparsable: AtomicU64,
    /// Responses released before their names were programmed (the hold
    /// expired).
    pub hold_expired: AtomicU64,
    /// Responses held (parked) until their names were programmed.
    pub held: AtomicU64,
    /// Held responses released because their names were programmed.
    pub released: AtomicU64,
    /// Learning responses let through at once: no state compiled yet.
    pub not_held_not_compiled: AtomicU64,
    /// Learning responses let through at once: the last sync failed, was
    /// held or had incomplete lists.
    pub not_held_sync_unhealthy: AtomicU64,
    /// Learning responses let through at once: `max_holds` were held.
    pub not_held_cap: AtomicU64,
    /// Responses held now.
    pub holding: AtomicU64,
    /// Times the rules were found missing and re-installed.
    pub rules_reasserted: AtomicU64,
    /// Why replies cannot be read (DNS exempted from conntrack:
    /// [`super::notrack::detect`]), checked with the rules.
    pub notrack: Mutex<Option<String>>,
}

impl CaptureStats {
    fn not_held(&self, why: NoHold) -> &AtomicU64 {
        match why {
            NoHold::NotCompiled => &self.not_held_not_compiled,
            NoHold::SyncUnhealthy => &self.not_held_sync_unhealthy,
            NoHold::Cap => &self.not_held_cap,
        }
    }
}

/// An eventfd that wakes the reader (a programmed version, a stop).
struct Waker(OwnedFd);

impl Waker {
    fn new() -> std::io::Result<Waker> {
        // SAFETY: eventfd(2) with constant flags; the result is checked.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd(2) and is owned by no one else.
        Ok(Waker(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 readable bytes; a full counter (EAGAIN) already wakes.
        unsafe { libc::write(self.0.as_raw_fd(), one.as_ptr().cast(), 8) };
    }

    fn drain(&self) {
        let mut buf = [0u8; 8];
        // SAFETY: reads at most 8 bytes into `buf`; EAGAIN when not woken.
        unsafe { libc::read(self.0.as_raw_fd(), buf.as_mut_ptr().cast(), 8) };
    }
}

/// The running capture: the queue reader, the expiry of learned names and
/// the rules' check. Dropping it stops the reader (the responses it holds
/// are let through) and removes the rules.
pub struct Capture {
    cfg: CaptureConfig,
    stop: Arc<AtomicBool>,
    /// Ends the reader (after `stop` and the rules' removal).
    reader_stop: Arc<AtomicBool>,
    waker: Arc<Waker>,
    /// Taken while the rules are checked or changed.
    rules: Arc<Mutex<()>>,
    /// What the capture counts.
    pub stats: Arc<CaptureStats>,
    learner: Arc<Mutex<Learner>>,
}

impl Capture {
    /// Loads the learned names kept by an earlier run, binds the queue (in
    /// the calling thread's network namespace), installs the rules and
    /// starts reading the queue; `wake` wakes the sync loop after the names
    /// changed.
    pub fn start(
        cfg: CaptureConfig,
        handle: NamesHandle,
        wake: Arc<dyn Fn() + Send + Sync>,
    ) -> Result<Capture, CaptureError> {
        let learner = match &cfg.state_file {
            Some(path) => Learner::load(path, Instant::now(), SystemTime::now(), cfg.limits).unwrap_or_else(|e| {
                tracing::warn!(error = %e, path = %path.display(), "learned DNS names not loaded; starting empty");
                Learner::new(cfg.limits)
            }),
            None => Learner::new(cfg.limits),
        };
        handle.set_learning();
        if handle.set(learner.names()).is_some() {
            wake();
        }
        let learner = Arc::new(Mutex::new(learner));
        // The sync loop builds the names when it compiles (not each reply,
        // and never while holding the learner's lock; lock order: the
        // handle's current names, then the learner; the reader never takes
        // the former while it holds the latter).
        let source = learner.clone();
        handle.set_source(Arc::new(move || {
            // A constant-time copy under the lock; built without it.
            let snapshot = lock(&source).snapshot();
            snapshot.names()
        }));
        let q_err = |op: &'static str| {
            move |e: std::io::Error| CaptureError::Queue {
                queue: cfg.queue,
                op,
                message: e.to_string(),
            }
        };
        let queue = NfQueue::bind(cfg.queue, QUEUE_MAX_LEN).map_err(q_err("bind"))?;
        let waker = Arc::new(Waker::new().map_err(q_err("eventfd"))?);
        let w = waker.clone();
        handle.set_programmed_waker(Arc::new(move || w.wake()));
        super::rules::install_rules(&cfg.servers, cfg.queue)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(CaptureStats::default());
        let rules = Arc::new(Mutex::new(()));
        let ctx = Ctx {
            cfg: cfg.clone(),
            handle,
            wake,
            learner: learner.clone(),
            stats: stats.clone(),
            stop: stop.clone(),
            unsaved: Arc::new(AtomicBool::new(false)),
            saving: Arc::new(Mutex::new(())),
        };
        let reader = ctx.clone();
        let reader_waker = waker.clone();
        let reader_stop = Arc::new(AtomicBool::new(false));
        let end = reader_stop.clone();
        std::thread::Builder::new()
            .name("npm-dns".into())
            .spawn(move || reader.read(queue, &reader_waker, &end))
            .map_err(CaptureError::Thread)?;
        let expiry = ctx.clone();
        std::thread::Builder::new()
            .name("npm-dns-expiry".into())
            .spawn(move || {
                let mut ticks = 0u32;
                while !expiry.stop.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(500));
                    expiry.expire();
                    // What the reader learned (saved here, off the path of
                    // the replies), and every 5 s refreshed expiries (a
                    // re-resolved name changes no name).
                    ticks += 1;
                    if expiry.unsaved.swap(false, Ordering::Relaxed) || ticks.is_multiple_of(10) {
                        expiry.save_copy();
                    }
                }
                if expiry.unsaved.swap(false, Ordering::Relaxed) {
                    expiry.save_copy();
                }
            })
            .map_err(CaptureError::Thread)?;
        let checker = ctx;
        let checker_rules = rules.clone();
        std::thread::Builder::new()
            .name("npm-dns-rules".into())
            .spawn(move || checker.recheck_rules(&checker_rules))
            .map_err(CaptureError::Thread)?;
        tracing::info!(queue = cfg.queue, servers = ?cfg.servers, "learning DNS answers for domainNames peers");
        Ok(Capture {
            cfg,
            stop,
            reader_stop,
            waker,
            rules,
            stats,
            learner,
        })
    }

    /// (names, addresses) learned now.
    pub fn learned(&self) -> (usize, usize) {
        lock(&self.learner).len()
    }

    /// Why DNS replies cannot be read on this node (`None`: nothing found),
    /// as last checked.
    pub fn notrack(&self) -> Option<String> {
        lock(&self.stats.notrack).clone()
    }

    /// (name, address) pairs the learner's bounds evicted so far.
    pub fn evicted(&self) -> u64 {
        lock(&self.learner).evicted()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        // The reader first lets through what it holds and holds nothing
        // more (a queued packet is lost when the rules change under it),
        // then the rules go, then the reader ends.
        let _rules = lock(&self.rules);
        self.stop.store(true, Ordering::Relaxed);
        self.waker.wake();
        remove_rules(self.cfg.queue);
        self.reader_stop.store(true, Ordering::Relaxed);
        self.waker.wake();
    }
}

/// A response held until version `version` of the names is programmed or
/// `deadline` passed.
struct Parked {
    id: u32,
    version: u64,
    deadline: Instant,
}

#[derive(Clone)]
struct Ctx {
    cfg: CaptureConfig,
    handle: NamesHandle,
    wake: Arc<dyn Fn() + Send + Sync>,
    learner: Arc<Mutex<Learner>>,
    stats: Arc<CaptureStats>,
    stop: Arc<AtomicBool>,
    /// The learner changed since it was last saved.
    unsaved: Arc<AtomicBool>,
    /// Held while a copy is taken and written: the reader and the expiry
    /// thread both save, through one temporary file, and a later save
    /// always writes a later copy.
    saving: Arc<Mutex<()>>,
}

/// Milliseconds from `now` to `until`, rounded up (for poll(2)).
fn poll_ms(now: Instant, until: Instant) -> i32 {
    let d = until.saturating_duration_since(now);
    i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
}

impl Ctx {
    /// Publishes a change of the learner's names (the caller holds the
    /// learner's lock): the sync loop is woken (it builds the names when it
    /// compiles), the expiry thread saves them within 500 ms; returns the
    /// version that holds the change.
    fn publish(&self, _learner: &Learner) -> Option<u64> {
        let v = self.handle.changed();
        self.unsaved.store(true, Ordering::Relaxed);
        (self.wake)();
        Some(v)
    }

    /// Writes a copy of the learner to the state file (if any), encoding
    /// and writing it without the lock the reader takes.
    fn save_copy(&self) {
        if self.cfg.state_file.is_some() {
            let _saving = lock(&self.saving);
            let copy = lock(&self.learner).clone();
            self.save(&copy);
        }
    }

    /// Writes the learner to the state file (if any); a failure is logged.
    fn save(&self, learner: &Learner) {
        if let Some(path) = &self.cfg.state_file {
            if let Err(e) = learner.save(path, Instant::now(), SystemTime::now()) {
                tracing::warn!(error = %e, "learned DNS names not saved");
            }
        }
    }

    /// The reader: waits for queued packets or a programmed version (or
    /// the deadline of the oldest held response), reads every queued
    /// packet, and issues each verdict as soon as it is due.
    fn read(self, mut queue: NfQueue, waker: &Waker, end: &AtomicBool) {
        let mut parked: VecDeque<Parked> = VecDeque::new();
        while !end.load(Ordering::Relaxed) {
            let timeout = parked.front().map_or(-1, |p| poll_ms(Instant::now(), p.deadline));
            let mut fds = [
                libc::pollfd {
                    fd: queue.raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: waker.0.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: two valid pollfds.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, timeout) };
            if rc < 0 && std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
                tracing::warn!(error = %std::io::Error::last_os_error(), "NFQUEUE poll failed");
                std::thread::sleep(Duration::from_millis(100));
            }
            waker.drain();
            loop {
                match queue.try_recv() {
                    Ok(packets) if packets.is_empty() => break,
                    Ok(packets) => self.on_batch(&mut queue, &mut parked, packets),
                    Err(e) => {
                        tracing::warn!(error = %e, "NFQUEUE read failed");
                        break;
                    }
                }
                self.release(&mut queue, &mut parked);
            }
            self.release(&mut queue, &mut parked);
            if self.stop.load(Ordering::Relaxed) {
                // Stopping: what is held goes through, nothing more is held.
                for p in parked.drain(..) {
                    self.accept(&mut queue, p.id);
                }
            }
        }
        // Ended (the rules are gone): what is still queued goes through.
        while let Ok(packets) = queue.try_recv() {
            if packets.is_empty() {
                break;
            }
            for p in packets {
                self.accept(&mut queue, p.id);
            }
        }
        for p in parked {
            self.accept(&mut queue, p.id);
        }
        self.stats.holding.store(0, Ordering::Relaxed);
    }

    fn accept(&self, queue: &mut NfQueue, id: u32) {
        if let Err(e) = queue.accept(id) {
            tracing::warn!(error = %e, id, "NFQUEUE verdict failed");
        }
    }

    /// The responses read at once: each learned; those that taught
    /// nothing accepted at once; the names published once for the batch
    /// (building them is linear in what is learned), then each response
    /// that taught something parked for that version, or accepted at once
    /// when nothing may be held.
    fn on_batch(&self, queue: &mut NfQueue, parked: &mut VecDeque<Parked>, packets: Vec<Packet>) {
        let mut learning: Vec<u32> = Vec::new();
        let mut accept: Vec<u32> = Vec::new();
        let version = {
            let mut l = lock(&self.learner);
            for p in packets {
                self.stats.responses.fetch_add(1, Ordering::Relaxed);
                match udp_payload(&p.payload).map(parse_response) {
                    Some(Ok(answers)) => {
                        // The namespace of the pod the reply goes to (its bound).
                        let ns = destination(&p.payload).and_then(|ip| self.handle.namespace_of(ip));
                        let ns = ns.as_deref().unwrap_or(NO_NAMESPACE);
                        if l.learn(Instant::now(), ns, &answers, |n| self.handle.wants(n)) {
                            self.stats.learning.fetch_add(1, Ordering::Relaxed);
                            learning.push(p.id);
                            continue;
                        }
                    }
                    _ => {
                        self.stats.unparsable.fetch_add(1, Ordering::Relaxed);
                    }
                }
                accept.push(p.id);
            }
            if learning.is_empty() {
                None
            } else {
                self.publish(&l)
            }
        };
        for id in accept {
            self.accept(queue, id);
        }
        let holds = !self.cfg.hold.is_zero() && !self.stop.load(Ordering::Relaxed);
        let Some(version) = version.filter(|_| holds) else {
            for id in learning {
                self.accept(queue, id);
            }
            return;
        };
        let deadline = Instant::now() + self.cfg.hold;
        for id in learning {
            let cap = if parked.len() >= self.cfg.max_holds {
                Err(NoHold::Cap)
            } else {
                Ok(())
            };
            match self.handle.may_hold().and(cap) {
                Ok(()) => {
                    self.stats.held.fetch_add(1, Ordering::Relaxed);
                    parked.push_back(Parked { id, version, deadline });
                }
                Err(why) => {
                    self.stats.not_held(why).fetch_add(1, Ordering::Relaxed);
                    self.accept(queue, id);
                }
            }
        }
        self.stats.holding.store(parked.len() as u64, Ordering::Relaxed);
    }

    /// Lets through every held response whose version is programmed or
    /// whose deadline passed (versions and deadlines grow in arrival
    /// order, so those are at the front).
    ///
    /// A client never gets an answer that a restarted agent would have
    /// forgotten: before the first of them goes, what was learned is
    /// written to the state file if it changed since the last save (a
    /// crash right after the answer must not deny, for the client's whole
    /// cache lifetime, what the client was just told).
    fn release(&self, queue: &mut NfQueue, parked: &mut VecDeque<Parked>) {
        if parked.is_empty() {
            return;
        }
        let (programmed, now) = (self.handle.programmed(), Instant::now());
        let due = parked
            .front()
            .is_some_and(|p| p.version <= programmed || p.deadline <= now);
        if due && self.unsaved.swap(false, Ordering::Relaxed) {
            self.save_copy();
        }
        while let Some(p) = parked.front() {
            if p.version <= programmed {
                self.stats.released.fetch_add(1, Ordering::Relaxed);
            } else if p.deadline <= now {
                self.stats.hold_expired.fetch_add(1, Ordering::Relaxed);
            } else {
                break;
            }
            let id = p.id;
            parked.pop_front();
            self.accept(queue, id);
        }
        self.stats.holding.store(parked.len() as u64, Ordering::Relaxed);
    }

    /// Records what [`super::notrack::detect`] finds (logged when it
    /// changes).
    fn check_notrack(&self) {
        let found = super::notrack::detect(&self.cfg.servers);
        let mut cur = lock(&self.stats.notrack);
        if *cur != found {
            match &found {
                Some(why) => tracing::warn!(
                    "{why}: see README, \"NodeLocal DNSCache\" (run node-cache with -setupiptables=false, pods \
                     on its link-local address, --dns-server set to it)"
                ),
                None => tracing::info!("no NOTRACK rule exempts DNS from conntrack any more; DNS answers are learned"),
            }
            *cur = found;
        }
    }

    /// Every `recheck`, checks the rules; re-installs them when any is
    /// missing (a firewall reload), logged and counted. Also looks for DNS
    /// exempted from conntrack.
    fn recheck_rules(self, rules: &Mutex<()>) {
        let step = Duration::from_millis(100);
        let mut next = Instant::now() + self.cfg.recheck;
        self.check_notrack();
        while !self.stop.load(Ordering::Relaxed) {
            std::thread::sleep(step);
            if Instant::now() < next {
                continue;
            }
            next = Instant::now() + self.cfg.recheck;
            self.check_notrack();
            let _held = lock(rules);
            if self.stop.load(Ordering::Relaxed) || super::rules::rules_present(&self.cfg.servers, self.cfg.queue) {
                continue;
            }
            self.stats.rules_reasserted.fetch_add(1, Ordering::Relaxed);
            match super::rules::install_rules(&self.cfg.servers, self.cfg.queue) {
                Ok(()) => tracing::warn!(
                    queue = self.cfg.queue,
                    "the DNS learning's NFQUEUE rules were removed (a firewall reload?); re-installed"
                ),
                Err(e) => tracing::error!(
                    error = %e,
                    queue = self.cfg.queue,
                    "the DNS learning's NFQUEUE rules were removed and cannot be re-installed; nothing is learned"
                ),
            }
        }
    }

    /// Drops the expired addresses and the names no pattern wants any more.
    fn expire(&self) {
        let mut l = lock(&self.learner);
        let mut changed = l.expire(Instant::now());
        if self.handle.patterns().is_some() {
            changed |= l.retain(|n| self.handle.wants(n));
        }
        if changed {
            self.publish(&l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_udp_payload_of_v4_and_v6_packets() {
        let mut v4 = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17];
        v4.resize(20, 0);
        v4.extend([0, 53, 0x9c, 0x40, 0, 12, 0, 0]);
        v4.extend([1, 2, 3, 4]);
        assert_eq!(udp_payload(&v4), Some(&[1u8, 2, 3, 4][..]));
        let mut tcp = v4.clone();
        tcp[9] = 6;
        assert_eq!(udp_payload(&tcp), None);
        let mut v6 = vec![0x60, 0, 0, 0, 0, 12, 17, 64];
        v6.resize(40, 0);
        v6.extend([0, 53, 0x9c, 0x40, 0, 12, 0, 0, 9]);
        assert_eq!(udp_payload(&v6), Some(&[9u8][..]));
        v4[16..20].copy_from_slice(&[10, 1, 2, 3]);
        assert_eq!(destination(&v4), Some(IpAddr::from([10, 1, 2, 3])));
        v6[39] = 7;
        assert_eq!(destination(&v6), "::7".parse().ok());
        assert_eq!(destination(&[0x45, 0]), None);
        assert_eq!(udp_payload(&[0x45, 0]), None);
        assert_eq!(udp_payload(&[]), None);
    }
}
