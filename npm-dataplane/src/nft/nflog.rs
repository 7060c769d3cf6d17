//! Flow events of the nftables dataplane through NFLOG: the `log` rules the
//! endpoint and tier chains carry (`deny_log_rule`, `allow_log_rule`)
//! and the reader of their messages ([`NflogReader`]), which turns each into
//! the event type of the eBPF ring buffer ([`DenyEvent`]), so flow logs,
//! names and metrics work the same on both dataplanes.
//!
//! Each logging rule repeats the match of the rule that decides (the drop,
//! or the allow of an endpoint with `report_new`), without a verdict, right
//! before it, and carries:
//! - `limit rate` [`LOG_RATE`] (per rule): over the rate the rule does not
//!   match, so a flood costs one token-bucket test per packet and no
//!   message; the verdict of the next rule is never affected;
//! - `log group` [`NFLOG_GROUP`] `prefix "npm:<endpoint>:<direction>:<reason> "`:
//!   what the agent needs (the endpoint id, `DIR_*`, the `Reason` number);
//!   the packet itself (copied up to [`COPY_RANGE`] bytes from its network
//!   header) gives the 5-tuple.
//!
//! Allow rules log only `ct state new` packets: the first packet of a
//! connection (tracked packets returned earlier, at `ct state
//! established,related`).
//!
//! Denies logged: the final `policy_denied` drop, the tier `Deny` rules and
//! `ct state invalid`, all after the conntrack step, so a tracked packet
//! (returned at `ct state established,related`) meets no logging rule.
//! Spoofed sources are dropped and counted, not logged: their check comes
//! before conntrack, and a logging rule there would cost every egress
//! packet one more rule.

use std::io;
use std::os::fd::AsRawFd;

use netlink_packet_core::{NetlinkMessage, NetlinkPayload};
use netlink_packet_netfilter::nflog::{config_request, ConfigCmd, ConfigMode, ConfigNla, PacketNla, ULogMessage};
use netlink_packet_netfilter::{NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket};
use npm_common::{proto, DenyEvent, IpHeader, Reason, DIR_EGRESS, DIR_INGRESS};

/// The NFLOG group of the dataplane's `log` rules.
pub const NFLOG_GROUP: u16 = 20048;
/// The rate of each logging rule (`limit rate`): at most this many
/// messages per second and rule, after a burst of [`LOG_BURST`].
pub const LOG_RATE: u32 = 100;
/// The burst of each logging rule's `limit`.
pub const LOG_BURST: u32 = 32;
/// Bytes of each logged packet copied to the reader (from its network
/// header: enough for an IPv6 header and the ports).
pub const COPY_RANGE: u32 = 128;

/// Errors of the NFLOG reader.
#[derive(Debug, thiserror::Error)]
pub enum NflogError {
    /// A socket operation failed.
    #[error("NFLOG socket, group {group}: {op}: {source}")]
    Socket {
        /// The group.
        group: u16,
        /// What was done.
        op: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The kernel refused a configuration request.
    #[error("NFLOG group {group}: {what} refused: {code}")]
    Refused {
        /// The group.
        group: u16,
        /// The request.
        what: &'static str,
        /// The netlink error code.
        code: i32,
    },
    /// Entering the network namespace failed.
    #[error("network namespace {netns}: {source}")]
    Netns {
        /// The namespace name (under `/run/netns`).
        netns: String,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// The prefix of the log rules of endpoint `endpoint`, `direction`, `reason`.
pub fn prefix(endpoint: u32, direction: u8, reason: Reason) -> String {
    format!("npm:{endpoint}:{direction}:{} ", reason as u8)
}

/// Parses a prefix of [`prefix`]: (endpoint, direction, reason number).
pub fn parse_prefix(p: &str) -> Option<(u32, u8, u8)> {
    let mut it = p.trim_end().strip_prefix("npm:")?.split(':');
    let ep = it.next()?.parse().ok()?;
    let dir: u8 = it.next()?.parse().ok()?;
    let reason: u8 = it.next()?.parse().ok()?;
    if it.next().is_some() || (dir != DIR_INGRESS && dir != DIR_EGRESS) {
        return None;
    }
    Some((ep, dir, reason))
}

fn log_stmt(endpoint: u32, direction: u8, reason: Reason) -> String {
    format!(
        "limit rate {LOG_RATE}/second burst {LOG_BURST} packets log prefix \"{}\" group {NFLOG_GROUP}",
        prefix(endpoint, direction, reason)
    )
}

/// The logging rule before a drop whose match is `matched` (empty: every
/// packet reaching it).
pub(crate) fn deny_log_rule(matched: &str, endpoint: u32, direction: u8, reason: Reason) -> String {
    join(matched, &log_stmt(endpoint, direction, reason))
}

/// The logging rule before an allow whose match is `matched`, for an
/// endpoint with `report_new` (else `None`): new connections only.
pub(crate) fn allow_log_rule(
    matched: &str,
    report_new: bool,
    endpoint: u32,
    direction: u8,
    reason: Reason,
) -> Option<String> {
    report_new.then(|| {
        join(
            matched,
            &format!("ct state new {}", log_stmt(endpoint, direction, reason)),
        )
    })
}

fn join(matched: &str, stmt: &str) -> String {
    let m = matched.trim();
    if m.is_empty() {
        stmt.to_string()
    } else {
        format!("{m} {stmt}")
    }
}

/// A socket bound to [`NFLOG_GROUP`] that turns the messages of the
/// dataplane's `log` rules into [`DenyEvent`]s.
pub struct NflogReader {
    socket: Socket,
    group: u16,
}

impl std::fmt::Debug for NflogReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NflogReader").field("group", &self.group).finish()
    }
}

impl NflogReader {
    /// Binds `group` in the caller's network namespace, or in `netns` (a
    /// name under `/run/netns`; the socket stays in it).
    pub fn open(group: u16, netns: Option<&str>) -> Result<Self, NflogError> {
        let socket = match netns {
            None => Self::socket(group)?,
            Some(ns) => {
                let path = format!("/run/netns/{ns}");
                let ns_err = |source| NflogError::Netns {
                    netns: ns.to_string(),
                    source,
                };
                let file = std::fs::File::open(&path).map_err(ns_err)?;
                // A thread of its own enters the namespace: the socket is
                // created there and keeps it.
                std::thread::scope(|s| {
                    s.spawn(|| {
                        // SAFETY: setns on this (scoped, short-lived) thread only.
                        if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                            return Err(ns_err(io::Error::last_os_error()));
                        }
                        Self::socket(group)
                    })
                    .join()
                    .unwrap_or_else(|_| Err(ns_err(io::Error::other("namespace thread panicked"))))
                })?
            }
        };
        let mut r = NflogReader { socket, group };
        r.configure("bind", vec![ConfigNla::Cmd(ConfigCmd::Bind)])?;
        r.configure("copy mode", vec![ConfigNla::Mode(ConfigMode::new_packet(COPY_RANGE))])?;
        // Every message at once (the kernel's default batches up to 100
        // messages or 1 s): the rules' rate bounds the message rate.
        r.configure("queue threshold", vec![ConfigNla::QThresh(1)])?;
        r.socket.set_non_blocking(true).map_err(|source| NflogError::Socket {
            group,
            op: "set non-blocking",
            source,
        })?;
        Ok(r)
    }

    fn socket(group: u16) -> Result<Socket, NflogError> {
        let err = |op| move |source| NflogError::Socket { group, op, source };
        let mut s = Socket::new(NETLINK_NETFILTER).map_err(err("create"))?;
        s.bind_auto().map_err(err("bind"))?;
        s.connect(&netlink_sys::SocketAddr::new(0, 0)).map_err(err("connect"))?;
        // Room for bursts between two reads (the agent reads every stats tick).
        let _ = s.set_rx_buf_sz(4 << 20);
        s.set_no_enobufs(true).map_err(err("no-enobufs")).ok();
        Ok(s)
    }

    /// Sends one configuration request and waits for its acknowledgement.
    fn configure(&mut self, what: &'static str, nlas: Vec<ConfigNla>) -> Result<(), NflogError> {
        let group = self.group;
        let msg = config_request(NetfilterProtoFamily::Unspec, group, nlas);
        let mut buf = vec![0u8; msg.buffer_len()];
        msg.serialize(&mut buf);
        let err = |op| move |source| NflogError::Socket { group, op, source };
        self.socket.send(&buf, 0).map_err(err("send config"))?;
        let mut rbuf = Vec::with_capacity(8192);
        loop {
            rbuf.clear();
            let n = self.socket.recv(&mut rbuf, 0).map_err(err("receive ack"))?;
            let mut off = 0;
            while off < n.min(rbuf.len()) {
                let Ok(m) = NetlinkMessage::<NetfilterMessage>::deserialize(&rbuf[off..]) else {
                    break;
                };
                let len = m.header.length as usize;
                if let NetlinkPayload::Error(e) = m.payload {
                    return match e.code {
                        None => Ok(()),
                        Some(code) => Err(NflogError::Refused {
                            group,
                            what,
                            code: code.get(),
                        }),
                    };
                }
                if len == 0 {
                    break;
                }
                off += (len + 3) & !3;
            }
        }
    }

    /// Every event queued since the last call (never blocks). A message
    /// that is not one of the dataplane's (another prefix, a packet too
    /// short) is skipped.
    pub fn drain(&mut self) -> Vec<DenyEvent> {
        let mut out = Vec::new();
        let mut buf = Vec::with_capacity(1 << 16);
        loop {
            buf.clear();
            let n = match self.socket.recv(&mut buf, 0) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    // ENOBUFS (dropped messages) or worse: what is queued
                    // later is still read at the next call.
                    tracing::debug!(error = %e, "reading NFLOG messages");
                    break;
                }
            };
            let mut off = 0;
            while off < n.min(buf.len()) {
                let Ok(m) = NetlinkMessage::<NetfilterMessage>::deserialize(&buf[off..]) else {
                    break;
                };
                let len = m.header.length as usize;
                if let NetlinkPayload::InnerMessage(NetfilterMessage {
                    inner: NetfilterMessageInner::ULog(ULogMessage::Packet(nlas)),
                    ..
                }) = m.payload
                {
                    out.extend(event_of(&nlas));
                }
                if len == 0 {
                    break;
                }
                off += (len + 3) & !3;
            }
        }
        out
    }
}

impl super::NftDataplane {
    /// Starts reading the flow events of the table's `log` rules (binds
    /// [`NFLOG_GROUP`] in the dataplane's namespace; one reader per group
    /// and namespace: a second one is refused). Until then
    /// [`NftDataplane::poll_flow_events`](super::NftDataplane::poll_flow_events)
    /// returns nothing.
    pub fn open_flow_events(&mut self) -> Result<(), NflogError> {
        if self.nflog.is_none() {
            self.nflog = Some(NflogReader::open(NFLOG_GROUP, self.opts.netns.as_deref())?);
        }
        Ok(())
    }

    /// The deny events, and the allow events of endpoints with
    /// `report_new`, logged since the last call (empty without
    /// [`NftDataplane::open_flow_events`](super::NftDataplane::open_flow_events)).
    pub fn poll_flow_events(&mut self) -> Vec<DenyEvent> {
        self.nflog.as_mut().map(NflogReader::drain).unwrap_or_default()
    }
}

/// The event of one NFLOG packet message of the dataplane's rules.
pub fn event_of(nlas: &[PacketNla]) -> Option<DenyEvent> {
    let mut prefix_of = None;
    let mut payload: &[u8] = &[];
    let (mut indev, mut outdev, mut physin, mut physout) = (0, 0, 0, 0);
    for n in nlas {
        match n {
            PacketNla::Prefix(p) => prefix_of = p.to_str().ok().and_then(parse_prefix),
            PacketNla::Payload(p) => payload = p,
            PacketNla::IfIndexInDev(i) => indev = *i,
            PacketNla::IfIndexOutDev(i) => outdev = *i,
            PacketNla::IfIndexPhysInDev(i) => physin = *i,
            PacketNla::IfIndexPhysOutDev(i) => physout = *i,
            _ => {}
        }
    }
    let (endpoint, direction, reason) = prefix_of?;
    // The pod's side: the bridge port when there is one, else the device.
    let ifindex = if direction == DIR_INGRESS {
        if physout != 0 {
            physout
        } else {
            outdev
        }
    } else if physin != 0 {
        physin
    } else {
        indev
    };
    let mut e = DenyEvent {
        ts_ns: monotonic_ns(),
        endpoint,
        ifindex,
        direction,
        reason,
        ..DenyEvent::default()
    };
    five_tuple(payload, &mut e)?;
    Some(e)
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: a valid out pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Fills the family, protocol, addresses (IPv4-mapped for IPv4) and ports
/// (TCP, UDP, SCTP of a first fragment; else 0) of the packet `p`, which
/// starts at its network header.
pub fn five_tuple(p: &[u8], e: &mut DenyEvent) -> Option<()> {
    let h = IpHeader::parse(p)?;
    e.family = h.family;
    e.protocol = h.protocol;
    if h.family == 4 {
        e.src[10..12].copy_from_slice(&[0xff, 0xff]);
        e.src[12..].copy_from_slice(&p[12..16]);
        e.dst[10..12].copy_from_slice(&[0xff, 0xff]);
        e.dst[12..].copy_from_slice(&p[16..20]);
    } else {
        e.src.copy_from_slice(&p[8..24]);
        e.dst.copy_from_slice(&p[24..40]);
    }
    let (l4, l4_off) = (h.first_fragment, h.l4_offset);
    if l4 && matches!(e.protocol, proto::TCP | proto::UDP | proto::SCTP) && p.len() >= l4_off + 4 {
        e.sport = u16::from_be_bytes([p[l4_off], p[l4_off + 1]]);
        e.dport = u16::from_be_bytes([p[l4_off + 2], p[l4_off + 3]]);
    }
    Some(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_round_trip_and_reject_others() {
        let p = prefix(7, DIR_EGRESS, Reason::PolicyDenied);
        assert_eq!(p, "npm:7:1:16 ");
        assert_eq!(parse_prefix(&p), Some((7, DIR_EGRESS, 16)));
        for bad in ["", "npm:", "npm:7:2:16", "npm:x:1:16", "npm:7:1:16:9", "other:7:1:16"] {
            assert_eq!(parse_prefix(bad), None, "{bad}");
        }
        // nft's limit on a prefix (127 bytes) is far away.
        assert!(prefix(u32::MAX, DIR_EGRESS, Reason::BaselineDeny).len() < 32);
    }

    #[test]
    fn rules() {
        assert_eq!(
            deny_log_rule("", 3, DIR_INGRESS, Reason::PolicyDenied),
            "limit rate 100/second burst 32 packets log prefix \"npm:3:0:16 \" group 20048"
        );
        assert_eq!(
            allow_log_rule("tcp dport 80", false, 3, DIR_INGRESS, Reason::Policy),
            None
        );
        assert_eq!(
            allow_log_rule("tcp dport 80", true, 3, DIR_INGRESS, Reason::Policy).unwrap(),
            "tcp dport 80 ct state new limit rate 100/second burst 32 packets log prefix \"npm:3:0:0 \" group 20048"
        );
    }

    #[test]
    fn five_tuples() {
        let mut v4 = vec![0x45, 0, 0, 40, 0, 0, 0x40, 0, 64, 6, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2];
        v4.extend([0x04, 0xd2, 0x00, 0x50]);
        let mut e = DenyEvent::default();
        five_tuple(&v4, &mut e).unwrap();
        assert_eq!((e.family, e.protocol, e.sport, e.dport), (4, 6, 1234, 80));
        assert_eq!(&e.src[10..], &[0xff, 0xff, 10, 0, 0, 1]);
        assert_eq!(&e.dst[12..], &[10, 0, 0, 2]);
        // A later fragment has no ports.
        let mut frag = v4.clone();
        frag[7] = 1;
        let mut e = DenyEvent::default();
        five_tuple(&frag, &mut e).unwrap();
        assert_eq!((e.sport, e.dport), (0, 0));
        let mut v6 = vec![0x60, 0, 0, 0, 0, 8, 17, 64];
        v6.extend([0u8; 15]);
        v6.push(1);
        v6.extend([0u8; 15]);
        v6.push(2);
        v6.extend([0, 53, 0, 54]);
        let mut e = DenyEvent::default();
        five_tuple(&v6, &mut e).unwrap();
        assert_eq!(
            (e.family, e.protocol, e.sport, e.dport, e.src[15], e.dst[15]),
            (6, 17, 53, 54, 1, 2)
        );
        assert!(five_tuple(&[0x45, 0], &mut DenyEvent::default()).is_none());
        assert!(five_tuple(&[], &mut DenyEvent::default()).is_none());
    }
}
