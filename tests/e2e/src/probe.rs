//! Probes: from a pod's netns to an IP and port, per protocol, in parallel.
//!
//! - TCP: a connect (handshake completed = connected).
//! - UDP: a datagram carrying a nonce that must come back (the pod servers
//!   echo).
//! - SCTP: the kernel has no SCTP sockets, so SCTP is decided on crafted
//!   packets: an SCTP INIT (correct CRC32c) is sent from the source pod with
//!   a raw socket; the destination pod's raw receiver logs it and answers
//!   with a crafted INIT-ACK (verification tag = the INIT's initiate tag);
//!   the probe succeeds when the INIT arrived at the right pod and port and
//!   the INIT-ACK came back (so reply traffic is exercised too).

use std::collections::HashMap;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::netns::NetnsHandle;
use crate::server::{send_raw, SctpHeader, SctpLog, IPPROTO_SCTP, SCTP_INIT, SCTP_INIT_ACK};

/// The L4 protocol of a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proto {
    /// TCP connect.
    Tcp,
    /// UDP request/reply.
    Udp,
    /// SCTP INIT on crafted packets.
    Sctp,
}

impl std::fmt::Display for Proto {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Proto::Tcp => "TCP",
            Proto::Udp => "UDP",
            Proto::Sctp => "SCTP",
        })
    }
}

/// One probe: from the pod in `src_netns` to `dst` (served by pod `dst_pod`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Probe {
    /// Source pod netns name.
    pub src_netns: String,
    /// Destination pod (`ns/name`); SCTP arrivals are checked against it.
    pub dst_pod: String,
    /// Destination address and port.
    pub dst: SocketAddr,
    /// Protocol.
    pub proto: Proto,
}

/// Probe settings.
#[derive(Clone, Debug)]
pub struct ProbeConfig {
    /// Timeout of a single attempt.
    pub timeout: Duration,
    /// Worker threads.
    pub threads: usize,
    /// The cluster's SCTP arrival log (needed for SCTP probes).
    pub sctp_log: Arc<SctpLog>,
}

static NONCE: AtomicU32 = AtomicU32::new(1);

fn nonce() -> u32 {
    let n = NONCE.fetch_add(1, Ordering::Relaxed);
    // Mix in the pid so concurrent processes do not share nonces.
    let v = (std::process::id() << 16) ^ n.wrapping_mul(0x9e37_79b9);
    if v == 0 {
        1
    } else {
        v
    }
}

pub use crate::server::{crc32c, sctp_packet};

/// Builds an SCTP INIT (verification tag 0) with the given ports and
/// initiate tag, with a correct checksum.
pub fn sctp_init_packet(src_port: u16, dst_port: u16, tag: u32) -> Vec<u8> {
    sctp_packet(&SctpHeader {
        src_port,
        dst_port,
        vtag: 0,
        chunk: SCTP_INIT,
        init_tag: tag,
    })
}

fn probe_tcp(dst: SocketAddr, timeout: Duration) -> bool {
    TcpStream::connect_timeout(&dst, timeout).is_ok()
}

fn probe_udp(dst: SocketAddr, timeout: Duration) -> bool {
    let bind: SocketAddr = match dst {
        SocketAddr::V4(_) => "0.0.0.0:0".parse().expect("literal"),
        SocketAddr::V6(_) => "[::]:0".parse().expect("literal"),
    };
    let Ok(sock) = UdpSocket::bind(bind) else {
        return false;
    };
    if sock.connect(dst).is_err() {
        return false;
    }
    let msg = format!("npm-probe-{}", nonce());
    if sock.send(msg.as_bytes()).is_err() {
        return false;
    }
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 256];
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || sock.set_read_timeout(Some(left)).is_err() {
            return false;
        }
        match sock.recv(&mut buf) {
            Ok(n) if &buf[..n] == msg.as_bytes() => return true,
            Ok(_) => continue,
            Err(_) => return false,
        }
    }
}

fn probe_sctp(dst: SocketAddr, dst_pod: &str, timeout: Duration, log: &SctpLog) -> bool {
    let family = if dst.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: plain socket(2); the fd is owned right away.
    let fd = unsafe { libc::socket(family, libc::SOCK_RAW | libc::SOCK_CLOEXEC, IPPROTO_SCTP) };
    if fd < 0 {
        return false;
    }
    // SAFETY: fresh valid fd.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tag = nonce();
    let sport = 32768 + (tag % 28000) as u16;
    let pkt = sctp_init_packet(sport, dst.port(), tag);
    if send_raw(fd.as_raw_fd(), dst.ip(), &pkt).is_err() {
        return false;
    }
    // The INIT must arrive at the destination pod on the right port, and
    // its INIT-ACK (sent back by the destination's receiver) must come back.
    let t0 = Instant::now();
    let arrived = match log.wait_for_chunk(tag, SCTP_INIT, timeout) {
        Some(a) => a.pod == dst_pod && a.dst_port == dst.port(),
        None => false,
    };
    arrived
        && log
            .wait_for_chunk(tag, SCTP_INIT_ACK, timeout.saturating_sub(t0.elapsed()))
            .is_some()
}

/// Runs one probe attempt on the calling thread (which it moves into the
/// source netns). Returns whether it connected.
pub fn probe_once(p: &Probe, cfg: &ProbeConfig, ns: &NetnsHandle) -> bool {
    if ns.enter().is_err() {
        return false;
    }
    match p.proto {
        Proto::Tcp => probe_tcp(p.dst, cfg.timeout),
        Proto::Udp => probe_udp(p.dst, cfg.timeout),
        Proto::Sctp => probe_sctp(p.dst, &p.dst_pod, cfg.timeout, &cfg.sctp_log),
    }
}

/// Runs every probe once, in parallel on `cfg.threads` threads; the result
/// has the same order as `probes`.
pub fn probe_all(probes: &[Probe], cfg: &ProbeConfig) -> Vec<bool> {
    let next = AtomicUsize::new(0);
    let results: Vec<std::sync::Mutex<bool>> = probes.iter().map(|_| std::sync::Mutex::new(false)).collect();
    let threads = cfg.threads.max(1).min(probes.len().max(1));
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| {
                let mut handles: HashMap<String, NetnsHandle> = HashMap::new();
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= probes.len() {
                        break;
                    }
                    let p = &probes[i];
                    if !handles.contains_key(&p.src_netns) {
                        match NetnsHandle::open(&p.src_netns) {
                            Ok(h) => {
                                handles.insert(p.src_netns.clone(), h);
                            }
                            Err(_) => continue, // no such pod: not connected
                        }
                    }
                    let ok = probe_once(p, cfg, &handles[&p.src_netns]);
                    *results[i].lock().unwrap_or_else(|e| e.into_inner()) = ok;
                }
            });
        }
    });
    results
        .into_iter()
        .map(|m| m.into_inner().unwrap_or_else(|e| e.into_inner()))
        .collect()
}

/// Probes until every result equals `expected` or `deadline` passes: the
/// first round runs everything, later rounds only re-run the probes that
/// disagree (pausing `interval` between rounds). With `confirm`, a matching
/// matrix must match again in one more full round `interval` later (so a
/// stale state that happens to match the expectation while the agent is
/// still converging is not accepted). Returns the last observed values and
/// the number of rounds.
pub fn probe_until(
    probes: &[Probe],
    expected: &[bool],
    cfg: &ProbeConfig,
    deadline: Duration,
    interval: Duration,
    confirm: bool,
) -> (Vec<bool>, usize) {
    let end = Instant::now() + deadline;
    let mut observed = probe_all(probes, cfg);
    let mut rounds = 1;
    let mut confirmed = false;
    loop {
        let wrong: Vec<usize> = (0..probes.len()).filter(|&i| observed[i] != expected[i]).collect();
        if wrong.is_empty() {
            if confirmed || !confirm {
                return (observed, rounds);
            }
            std::thread::sleep(interval);
            observed = probe_all(probes, cfg);
            rounds += 1;
            confirmed = true;
            continue;
        }
        confirmed = false;
        if Instant::now() + interval >= end {
            return (observed, rounds);
        }
        std::thread::sleep(interval);
        let subset: Vec<Probe> = wrong.iter().map(|&i| probes[i].clone()).collect();
        let again = probe_all(&subset, cfg);
        for (k, &i) in wrong.iter().enumerate() {
            observed[i] = again[k];
        }
        rounds += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_known_vector() {
        // RFC 3720 B.4: 32 bytes of zeros.
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn init_packet_layout() {
        let p = sctp_init_packet(1234, 80, 0xdead_beef);
        assert_eq!(p.len(), 32);
        let h = crate::server::parse_sctp(&p).expect("parses");
        assert_eq!(
            (h.src_port, h.dst_port, h.vtag, h.chunk, h.init_tag),
            (1234, 80, 0, SCTP_INIT, 0xdead_beef)
        );
        let mut z = p.clone();
        z[8..12].fill(0);
        assert_eq!(u32::from_le_bytes([p[8], p[9], p[10], p[11]]), crc32c(&z));
    }
}
