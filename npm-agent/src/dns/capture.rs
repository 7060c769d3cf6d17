//! Capturing the DNS responses of trusted servers to this node's pods
//! ([`Capture`]): an NFQUEUE rule (iptables, table `mangle`, chain
//! `POSTROUTING`, jumping to a chain of ours, [`chain_name`]) sends every
//! UDP reply of a connection a pod opened to a trusted server's port 53
//! (conntrack's original destination: the address the pod asked, a
//! Service ClusterIP included) to a queue this module reads. Each response
//! is parsed, its answers learned ([`Learner`]), and, when that changed
//! the learned names, the response is held until the sync loop has
//! programmed them (at most [`CaptureConfig::hold`]): the pod then
//! connects to an address already allowed. Every response is accepted,
//! never dropped: the queue is `--queue-bypass` (no reader: the kernel
//! lets the packet through) and fail-open (a full queue too), so a
//! stopped agent never breaks DNS; it only stops learning.
//!
//! Only replies to queries sent to a trusted server are read: a pod cannot
//! teach the agent an address by sending a forged answer from elsewhere
//! (NPEP-133: "implementations that operate by snooping DNS responses on
//! the wire MUST only trust responses originating from the canonical DNS
//! server").
//!
//! Why iptables: the nftables `queue` statement needs `nft_queue`, which
//! kernels do not all have (this project's CI kernel has none), while the
//! `NFQUEUE` target of iptables (`xt_NFQUEUE`, also through iptables-nft)
//! is on every Kubernetes node kube-proxy runs on.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use super::handle::{lock, NamesHandle};
use super::learner::{parse_response, Learner, Limits};

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
    /// The learner's limits and grace.
    pub limits: Limits,
    /// Where the learned names are kept across restarts (`None`: not kept).
    pub state_file: Option<PathBuf>,
}

/// Errors of the capture.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// An iptables command failed.
    #[error("{cmd}: {message}")]
    Rule {
        /// The command line.
        cmd: String,
        /// Its error output, or why it could not run.
        message: String,
    },
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

/// The prefix of the chains of the DNS learning (`NPM-DNS-<queue>`).
pub const CHAIN_PREFIX: &str = "NPM-DNS-";

/// The chain of queue `queue` (in `mangle` of iptables and ip6tables).
pub fn chain_name(queue: u16) -> String {
    format!("{CHAIN_PREFIX}{queue}")
}

fn run(bin: &str, args: &[&str]) -> Result<(), CaptureError> {
    let cmd = format!("{bin} {}", args.join(" "));
    let out = Command::new(bin).args(args).output().map_err(|e| CaptureError::Rule {
        cmd: cmd.clone(),
        message: e.to_string(),
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(CaptureError::Rule {
            cmd,
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Removes the rules of queue `queue` (the jump, then the chain), in both
/// families; what is not there is no error.
pub fn remove_rules(queue: u16) {
    let chain = chain_name(queue);
    for bin in ["iptables", "ip6tables"] {
        while run(bin, &["-w", "5", "-t", "mangle", "-D", "POSTROUTING", "-j", &chain]).is_ok() {}
        let _ = run(bin, &["-w", "5", "-t", "mangle", "-F", &chain]);
        let _ = run(bin, &["-w", "5", "-t", "mangle", "-X", &chain]);
    }
}

/// Installs the rules of `cfg` (after removing any left by an earlier run).
fn install_rules(cfg: &CaptureConfig) -> Result<(), CaptureError> {
    remove_rules(cfg.queue);
    let chain = chain_name(cfg.queue);
    let queue = cfg.queue.to_string();
    for (bin, v6) in [("iptables", false), ("ip6tables", true)] {
        let servers: Vec<String> = cfg
            .servers
            .iter()
            .filter(|s| s.is_ipv6() == v6)
            .map(ToString::to_string)
            .collect();
        if servers.is_empty() {
            continue;
        }
        run(bin, &["-w", "5", "-t", "mangle", "-N", &chain])?;
        for s in &servers {
            run(
                bin,
                &[
                    "-w",
                    "5",
                    "-t",
                    "mangle",
                    "-A",
                    &chain,
                    "-p",
                    "udp",
                    "-m",
                    "conntrack",
                    "--ctdir",
                    "REPLY",
                    "--ctorigdst",
                    s,
                    "--ctorigdstport",
                    "53",
                    "-j",
                    "NFQUEUE",
                    "--queue-num",
                    &queue,
                    "--queue-bypass",
                ],
            )?;
        }
        run(bin, &["-w", "5", "-t", "mangle", "-I", "POSTROUTING", "-j", &chain])?;
    }
    Ok(())
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

/// What the capture counts (read by the metrics).
#[derive(Debug, Default)]
pub struct CaptureStats {
    /// Responses read.
    pub responses: std::sync::atomic::AtomicU64,
    /// Responses that taught a new (name, address).
    pub learning: std::sync::atomic::AtomicU64,
    /// Packets that were not a parsable DNS response.
    pub unparsable: std::sync::atomic::AtomicU64,
    /// Responses released before their names were programmed (the hold
    /// expired).
    pub hold_expired: std::sync::atomic::AtomicU64,
}

/// The running capture: the queue reader and the expiry of learned names.
/// Dropping it removes the rules (the threads end with the process; with
/// no rule they get no more packets).
pub struct Capture {
    queue: u16,
    stop: Arc<AtomicBool>,
    /// What the capture counts.
    pub stats: Arc<CaptureStats>,
    learner: Arc<Mutex<Learner>>,
}

impl Capture {
    /// Loads the learned names kept by an earlier run, installs the rules,
    /// binds the queue and starts reading it; `wake` wakes the sync loop
    /// after the names changed.
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
        let q_err = |op: &'static str| {
            move |e: std::io::Error| CaptureError::Queue {
                queue: cfg.queue,
                op,
                message: e.to_string(),
            }
        };
        let mut queue = nfq::Queue::open().map_err(|e| CaptureError::Queue {
            queue: cfg.queue,
            op: "open",
            message: e.to_string(),
        })?;
        queue.bind(cfg.queue).map_err(q_err("bind"))?;
        queue.set_fail_open(cfg.queue, true).map_err(q_err("fail-open"))?;
        install_rules(&cfg)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(CaptureStats::default());
        let ctx = Ctx {
            cfg: cfg.clone(),
            handle,
            wake,
            learner: learner.clone(),
            stats: stats.clone(),
        };
        let reader = ctx.clone();
        std::thread::Builder::new()
            .name("npm-dns".into())
            .spawn(move || reader.read(queue))
            .map_err(CaptureError::Thread)?;
        let expiry = ctx;
        let stop2 = stop.clone();
        std::thread::Builder::new()
            .name("npm-dns-expiry".into())
            .spawn(move || {
                let mut ticks = 0u32;
                while !stop2.load(Ordering::Relaxed) {
                    std::thread::sleep(Duration::from_millis(500));
                    expiry.expire();
                    // Refreshed expiries (a re-resolved name changes no
                    // name, so nothing saved it) reach the state file every
                    // 5 s.
                    ticks += 1;
                    if ticks.is_multiple_of(10) {
                        expiry.save(&lock(&expiry.learner));
                    }
                }
            })
            .map_err(CaptureError::Thread)?;
        tracing::info!(queue = cfg.queue, servers = ?cfg.servers, "learning DNS answers for domainNames peers");
        Ok(Capture {
            queue: cfg.queue,
            stop,
            stats,
            learner,
        })
    }

    /// (names, addresses) learned now.
    pub fn learned(&self) -> (usize, usize) {
        lock(&self.learner).len()
    }

    /// (name, address) pairs the learner's bounds evicted so far.
    pub fn evicted(&self) -> u64 {
        lock(&self.learner).evicted()
    }
}

impl Drop for Capture {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        remove_rules(self.queue);
    }
}

#[derive(Clone)]
struct Ctx {
    cfg: CaptureConfig,
    handle: NamesHandle,
    wake: Arc<dyn Fn() + Send + Sync>,
    learner: Arc<Mutex<Learner>>,
    stats: Arc<CaptureStats>,
}

impl Ctx {
    /// Publishes the learner's names (after a change): persisted, handed to
    /// the sync loop; returns the new version.
    fn publish(&self, learner: &Learner) -> Option<u64> {
        let v = self.handle.set(learner.names())?;
        self.save(learner);
        (self.wake)();
        Some(v)
    }

    /// Writes the learner to the state file (if any); a failure is logged.
    fn save(&self, learner: &Learner) {
        if let Some(path) = &self.cfg.state_file {
            if let Err(e) = learner.save(path, Instant::now(), SystemTime::now()) {
                tracing::warn!(error = %e, "learned DNS names not saved");
            }
        }
    }

    /// The reader: each response learned, held while its new names are
    /// programmed, then accepted.
    fn read(self, mut queue: nfq::Queue) {
        loop {
            let mut msg = match queue.recv() {
                Ok(m) => m,
                Err(e) => {
                    tracing::warn!(error = %e, "NFQUEUE read failed");
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            };
            self.stats.responses.fetch_add(1, Ordering::Relaxed);
            let answers = udp_payload(msg.get_payload()).map(parse_response);
            let version = match answers {
                Some(Ok(answers)) => {
                    let mut l = lock(&self.learner);
                    if l.learn(Instant::now(), &answers, |n| self.handle.wants(n)) {
                        self.stats.learning.fetch_add(1, Ordering::Relaxed);
                        self.publish(&l)
                    } else {
                        None
                    }
                }
                _ => {
                    self.stats.unparsable.fetch_add(1, Ordering::Relaxed);
                    None
                }
            };
            if let Some(v) = version {
                if !self.handle.wait_programmed(v, self.cfg.hold) {
                    self.stats.hold_expired.fetch_add(1, Ordering::Relaxed);
                }
            }
            msg.set_verdict(nfq::Verdict::Accept);
            if let Err(e) = queue.verdict(msg) {
                tracing::warn!(error = %e, "NFQUEUE verdict failed");
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
        assert_eq!(udp_payload(&[0x45, 0]), None);
        assert_eq!(udp_payload(&[]), None);
    }
}
