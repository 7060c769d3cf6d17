//! The continuous prober of the enforcement bench: one thread that, every
//! interval, starts a non-blocking TCP connect for each probed pair from
//! the source pod's netns (entered with `setns` only when the source
//! changes) and polls the connects in flight until the next tick. A
//! connect that completes is an allow; one refused, unreachable or still
//! pending after the timeout is a deny. Each sample is stamped with the
//! moment its SYN was sent, so a verdict is placed to within one interval
//! whatever the timeout. Sockets close with `SO_LINGER` 0 (a reset): no
//! `TIME_WAIT` piles up in the pods.
//!
//! One thread, no busy loop: the cost is one socket, one connect and one
//! poll wake-up per pair and interval, so the 2 cores stay with the agent.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::NetnsHandle;

/// One result: when the SYN was sent and whether the connect completed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// When the connect started.
    pub sent: Instant,
    /// Whether it completed (an allow).
    pub ok: bool,
}

#[derive(Debug)]
struct PairState {
    src_netns: String,
    dst: SocketAddr,
    active: bool,
    samples: Vec<Sample>,
    /// Send times of the connects in flight.
    inflight: Vec<Instant>,
}

#[derive(Debug, Default)]
struct Shared {
    stop: AtomicBool,
    pairs: Mutex<Vec<PairState>>,
    ticks: AtomicUsize,
}

/// A running prober; dropping it stops it.
#[derive(Debug)]
pub struct Prober {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    interval: Duration,
}

struct InFlight {
    pair: usize,
    sent: Instant,
    fd: OwnedFd,
}

impl Prober {
    /// Starts the thread: a round every `interval`, connects given up after
    /// `timeout`.
    pub fn start(interval: Duration, timeout: Duration) -> std::io::Result<Prober> {
        let shared = Arc::new(Shared::default());
        let sh = shared.clone();
        let thread = std::thread::Builder::new()
            .name("enforcement-prober".into())
            .spawn(move || run(&sh, interval, timeout))?;
        Ok(Prober {
            shared,
            thread: Some(thread),
            interval,
        })
    }

    /// The configured interval.
    pub fn interval(&self) -> Duration {
        self.interval
    }

    /// Starts probing `dst` from the pod in `src_netns` (empty: the netns
    /// the prober was started in); returns the pair's id.
    pub fn add(&self, src_netns: &str, dst: SocketAddr) -> usize {
        let mut pairs = lock(&self.shared.pairs);
        pairs.push(PairState {
            src_netns: src_netns.to_string(),
            dst,
            active: true,
            samples: Vec::new(),
            inflight: Vec::new(),
        });
        pairs.len() - 1
    }

    /// Stops probing pair `id` (its samples are kept).
    pub fn remove(&self, id: usize) {
        if let Some(p) = lock(&self.shared.pairs).get_mut(id) {
            p.active = false;
        }
    }

    /// Pair `id`'s samples sent at or after `from`, in send order, up to
    /// the first one still in flight (so that no later sample is read
    /// before an earlier one is known).
    pub fn samples_since(&self, id: usize, from: Instant) -> Vec<Sample> {
        let pairs = lock(&self.shared.pairs);
        let Some(p) = pairs.get(id) else {
            return Vec::new();
        };
        let horizon = p.inflight.iter().min().copied();
        let mut v: Vec<Sample> = p
            .samples
            .iter()
            .filter(|s| s.sent >= from && horizon.is_none_or(|h| s.sent < h))
            .copied()
            .collect();
        v.sort_by_key(|s| s.sent);
        v
    }

    /// Samples taken so far, over every pair.
    pub fn sample_count(&self) -> usize {
        lock(&self.shared.pairs).iter().map(|p| p.samples.len()).sum()
    }

    /// Rounds run so far.
    pub fn rounds(&self) -> usize {
        self.shared.ticks.load(Ordering::Relaxed)
    }

    /// Stops the thread and waits for it.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Prober {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The first sample of `samples` (in send order) with verdict `want` that
/// the next sample confirms: a lone contrary result (a lost SYN) is not
/// taken for a change. `None` until two such samples in a row are known.
pub fn first_confirmed(samples: &[Sample], want: bool) -> Option<Sample> {
    samples
        .windows(2)
        .find(|w| w[0].ok == want && w[1].ok == want)
        .map(|w| w[0])
}

fn sockaddr(dst: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: an all-zero sockaddr_storage is valid.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match dst {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_in fits in sockaddr_storage.
            unsafe { std::ptr::write(std::ptr::addr_of_mut!(ss).cast::<libc::sockaddr_in>(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: sockaddr_in6 fits in sockaddr_storage.
            unsafe { std::ptr::write(std::ptr::addr_of_mut!(ss).cast::<libc::sockaddr_in6>(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Starts a non-blocking connect: `Ok(Some(true|false))` when it finished
/// at once, `Ok(None)` while in progress.
fn connect_start(dst: SocketAddr) -> std::io::Result<(OwnedFd, Option<bool>)> {
    let family = if dst.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(family, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh valid fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let linger = libc::linger {
        l_onoff: 1,
        l_linger: 0,
    };
    // SAFETY: setsockopt with a valid linger struct and its size.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            std::ptr::addr_of!(linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        )
    };
    let (ss, len) = sockaddr(dst);
    // SAFETY: ss holds a sockaddr of length len.
    let rc = unsafe { libc::connect(fd.as_raw_fd(), std::ptr::addr_of!(ss).cast(), len) };
    if rc == 0 {
        return Ok((fd, Some(true)));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINPROGRESS) {
        Ok((fd, None))
    } else {
        Ok((fd, Some(false)))
    }
}

fn so_error(fd: &OwnedFd) -> i32 {
    let mut err: libc::c_int = 0;
    let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: getsockopt into a c_int with its size.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            std::ptr::addr_of_mut!(err).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return -1;
    }
    err
}

fn record(shared: &Shared, pair: usize, sent: Instant, ok: bool) {
    let mut pairs = lock(&shared.pairs);
    if let Some(p) = pairs.get_mut(pair) {
        p.samples.push(Sample { sent, ok });
        if let Some(i) = p.inflight.iter().position(|t| *t == sent) {
            p.inflight.swap_remove(i);
        }
    }
}

fn run(shared: &Shared, interval: Duration, timeout: Duration) {
    let mut handles: HashMap<String, NetnsHandle> = HashMap::new();
    let own = NetnsHandle::current().ok();
    let mut inflight: Vec<InFlight> = Vec::new();
    let mut current_ns: Option<String> = None;
    let mut next_tick = Instant::now();
    while !shared.stop.load(Ordering::Relaxed) {
        // A round: one connect per active pair, grouped by source netns.
        let mut todo: Vec<(usize, String, SocketAddr)> = lock(&shared.pairs)
            .iter()
            .enumerate()
            .filter(|(_, p)| p.active)
            .map(|(i, p)| (i, p.src_netns.clone(), p.dst))
            .collect();
        todo.sort_by(|a, b| a.1.cmp(&b.1));
        // Handles of netns no active pair probes from are let go (a
        // deleted pod's netns is not kept alive by the prober).
        handles.retain(|k, _| todo.iter().any(|t| &t.1 == k));
        if current_ns
            .as_ref()
            .is_some_and(|c| !c.is_empty() && !handles.contains_key(c))
        {
            current_ns = None;
        }
        for (pair, ns, dst) in todo {
            if current_ns.as_deref() != Some(ns.as_str()) {
                if ns.is_empty() {
                    match &own {
                        Some(h) if h.enter().is_ok() => {}
                        _ => continue,
                    }
                    current_ns = Some(ns.clone());
                } else {
                    if !handles.contains_key(&ns) {
                        match NetnsHandle::open(&ns) {
                            Ok(h) => {
                                handles.insert(ns.clone(), h);
                            }
                            Err(_) => continue,
                        }
                    }
                    if handles[&ns].enter().is_err() {
                        continue;
                    }
                    current_ns = Some(ns.clone());
                }
            }
            let sent = Instant::now();
            match connect_start(dst) {
                Ok((_, Some(ok))) => record(shared, pair, sent, ok),
                Ok((fd, None)) => {
                    if let Some(p) = lock(&shared.pairs).get_mut(pair) {
                        p.inflight.push(sent);
                    }
                    inflight.push(InFlight { pair, sent, fd });
                }
                Err(_) => record(shared, pair, sent, false),
            }
        }
        shared.ticks.fetch_add(1, Ordering::Relaxed);
        next_tick += interval;
        let now = Instant::now();
        if next_tick < now {
            // Behind (the machine is loaded): skip the missed rounds.
            next_tick = now + interval;
        }
        // Poll the connects in flight until the next round.
        loop {
            let now = Instant::now();
            let wait = next_tick.saturating_duration_since(now);
            if inflight.is_empty() {
                std::thread::sleep(wait);
                break;
            }
            let mut fds: Vec<libc::pollfd> = inflight
                .iter()
                .map(|f| libc::pollfd {
                    fd: f.fd.as_raw_fd(),
                    events: libc::POLLOUT,
                    revents: 0,
                })
                .collect();
            let ms = wait.as_millis().min(1000) as libc::c_int;
            // SAFETY: fds is a valid array of pollfd of the given length.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
            if rc > 0 {
                for i in (0..fds.len()).rev() {
                    if fds[i].revents == 0 {
                        continue;
                    }
                    let f = inflight.swap_remove(i);
                    let ok = so_error(&f.fd) == 0 && fds[i].revents & (libc::POLLERR | libc::POLLHUP) == 0;
                    record(shared, f.pair, f.sent, ok);
                }
            }
            // Connects older than the timeout, not completed by the poll
            // just made (so a prober descheduled past the timeout never
            // takes a completed connect for a deny): a deny.
            let now = Instant::now();
            let mut k = 0;
            while k < inflight.len() {
                if now.duration_since(inflight[k].sent) >= timeout {
                    let f = inflight.swap_remove(k);
                    record(shared, f.pair, f.sent, false);
                } else {
                    k += 1;
                }
            }
            if now >= next_tick {
                break;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_needs_two_samples_in_a_row() {
        let t = Instant::now();
        let s = |ms: u64, ok: bool| Sample {
            sent: t + Duration::from_millis(ms),
            ok,
        };
        let v = [s(0, true), s(10, false), s(20, true), s(30, false), s(40, false)];
        assert_eq!(first_confirmed(&v, false), Some(s(30, false)));
        assert_eq!(first_confirmed(&v[..4], false), None);
        assert_eq!(first_confirmed(&v, true), None);
    }

    #[test]
    fn probes_a_listener_and_a_closed_port() {
        // Loopback of the current netns: no root needed.
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let open = l.local_addr().unwrap();
        let closed = {
            let c = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            c.local_addr().unwrap()
        };
        let mut p = Prober::start(Duration::from_millis(5), Duration::from_millis(200)).unwrap();
        let a = p.add("", open);
        let b = p.add("", closed);
        let t0 = Instant::now();
        while (p.samples_since(a, t0).len() < 3 || p.samples_since(b, t0).len() < 3)
            && t0.elapsed() < Duration::from_secs(10)
        {
            std::thread::sleep(Duration::from_millis(5));
        }
        p.stop();
        assert!(p.samples_since(a, t0).iter().all(|s| s.ok));
        assert!(p.samples_since(b, t0).iter().all(|s| !s.ok));
        assert!(p.samples_since(a, t0).len() >= 3 && p.samples_since(b, t0).len() >= 3);
    }
}
