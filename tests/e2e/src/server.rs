//! The servers inside a pod: TCP accept and UDP echo on the served ports,
//! and raw SCTP receivers that log every SCTP packet that arrives (the
//! kernel has no SCTP sockets here, so SCTP probes are decided on crafted
//! packets).

use std::collections::VecDeque;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, UdpSocket};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::netns::{NetnsError, NetnsHandle};

/// IP protocol number of SCTP.
pub const IPPROTO_SCTP: i32 = 132;

/// Errors of the pod servers.
#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    /// Entering the pod netns failed.
    #[error(transparent)]
    Netns(#[from] NetnsError),
    /// A socket could not be created or bound.
    #[error("{what}: {source}")]
    Socket {
        /// Which socket (e.g. `tcp [::]:80`).
        what: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The server thread died before it was ready.
    #[error("server thread of {0} exited before it was ready")]
    Thread(String),
}

/// One SCTP packet received by a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SctpArrival {
    /// The receiving pod (`ns/name`).
    pub pod: String,
    /// Source address of the packet.
    pub src: IpAddr,
    /// SCTP destination port.
    pub dst_port: u16,
    /// The probe's nonce: the initiate tag of an INIT, the verification
    /// tag of an INIT-ACK.
    pub tag: u32,
    /// The chunk type: 1 (INIT) or 2 (INIT-ACK).
    pub chunk: u8,
}

/// SCTP chunk type INIT.
pub const SCTP_INIT: u8 = 1;
/// SCTP chunk type INIT-ACK.
pub const SCTP_INIT_ACK: u8 = 2;

/// The fields of a crafted SCTP packet the probes use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SctpHeader {
    /// Source port.
    pub src_port: u16,
    /// Destination port.
    pub dst_port: u16,
    /// Verification tag of the common header.
    pub vtag: u32,
    /// Type of the first chunk.
    pub chunk: u8,
    /// Initiate tag of an INIT or INIT-ACK chunk.
    pub init_tag: u32,
}

/// The log of SCTP packets received by all pods of a cluster.
#[derive(Debug, Default)]
pub struct SctpLog {
    arrivals: Mutex<VecDeque<SctpArrival>>,
    cond: Condvar,
}

impl SctpLog {
    const KEEP: usize = 4096;

    fn push(&self, a: SctpArrival) {
        let mut q = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
        if q.len() >= Self::KEEP {
            q.pop_front();
        }
        q.push_back(a);
        self.cond.notify_all();
    }

    /// Waits up to `timeout` for an INIT with this nonce; returns it.
    pub fn wait_for(&self, tag: u32, timeout: Duration) -> Option<SctpArrival> {
        self.wait_for_chunk(tag, SCTP_INIT, timeout)
    }

    /// Waits up to `timeout` for an arrival of this chunk type with this
    /// nonce; returns it.
    pub fn wait_for_chunk(&self, tag: u32, chunk: u8, timeout: Duration) -> Option<SctpArrival> {
        let deadline = Instant::now() + timeout;
        let mut q = self.arrivals.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(a) = q.iter().find(|a| a.tag == tag && a.chunk == chunk) {
                return Some(a.clone());
            }
            let now = Instant::now();
            if now >= deadline {
                return None;
            }
            q = self
                .cond
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

/// The servers of one pod, running on one thread inside its netns.
#[derive(Debug)]
pub struct PodServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct Sockets {
    tcp: Vec<TcpListener>,
    udp: Vec<UdpSocket>,
    raw4: OwnedFd,
    raw6: OwnedFd,
}

fn raw_socket(family: i32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain socket(2) call; the fd is owned right away.
    let fd = unsafe {
        libc::socket(
            family,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            IPPROTO_SCTP,
        )
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh, valid descriptor.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn open_sockets(ports: &[u16]) -> Result<Sockets, ServerError> {
    let mut tcp = Vec::new();
    let mut udp = Vec::new();
    for &p in ports {
        // [::] is dual-stack (bindv6only=0), so it serves IPv4 too.
        let l = TcpListener::bind((Ipv6Addr::UNSPECIFIED, p)).map_err(|source| ServerError::Socket {
            what: format!("tcp [::]:{p}"),
            source,
        })?;
        l.set_nonblocking(true).map_err(|source| ServerError::Socket {
            what: format!("tcp [::]:{p} nonblocking"),
            source,
        })?;
        tcp.push(l);
        let u = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, p)).map_err(|source| ServerError::Socket {
            what: format!("udp [::]:{p}"),
            source,
        })?;
        u.set_nonblocking(true).map_err(|source| ServerError::Socket {
            what: format!("udp [::]:{p} nonblocking"),
            source,
        })?;
        udp.push(u);
    }
    let raw4 = raw_socket(libc::AF_INET).map_err(|source| ServerError::Socket {
        what: "raw sctp ipv4".into(),
        source,
    })?;
    let raw6 = raw_socket(libc::AF_INET6).map_err(|source| ServerError::Socket {
        what: "raw sctp ipv6".into(),
        source,
    })?;
    for (fd, v6, what) in [
        (&raw4, false, "raw sctp ipv4 pktinfo"),
        (&raw6, true, "raw sctp ipv6 pktinfo"),
    ] {
        want_pktinfo(fd.as_raw_fd(), v6).map_err(|source| ServerError::Socket {
            what: what.into(),
            source,
        })?;
    }
    Ok(Sockets { tcp, udp, raw4, raw6 })
}

/// Parses an SCTP packet (common header + first chunk, which must be an
/// INIT or INIT-ACK).
pub fn parse_sctp(pkt: &[u8]) -> Option<SctpHeader> {
    if pkt.len() < 12 + 8 {
        return None;
    }
    let chunk = pkt[12];
    if chunk != SCTP_INIT && chunk != SCTP_INIT_ACK {
        return None;
    }
    Some(SctpHeader {
        src_port: u16::from_be_bytes([pkt[0], pkt[1]]),
        dst_port: u16::from_be_bytes([pkt[2], pkt[3]]),
        vtag: u32::from_be_bytes([pkt[4], pkt[5], pkt[6], pkt[7]]),
        chunk,
        init_tag: u32::from_be_bytes([pkt[16], pkt[17], pkt[18], pkt[19]]),
    })
}

/// CRC32c (Castagnoli), as SCTP uses it.
pub fn crc32c(data: &[u8]) -> u32 {
    let mut crc: u32 = !0;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0x82F6_3B78 & mask);
        }
    }
    !crc
}

/// Builds an SCTP packet: common header plus one INIT or INIT-ACK chunk
/// (a_rwnd 65535, one stream each way, initial TSN = initiate tag), with a
/// correct checksum.
pub fn sctp_packet(h: &SctpHeader) -> Vec<u8> {
    let mut p = Vec::with_capacity(32);
    p.extend_from_slice(&h.src_port.to_be_bytes());
    p.extend_from_slice(&h.dst_port.to_be_bytes());
    p.extend_from_slice(&h.vtag.to_be_bytes());
    p.extend_from_slice(&0u32.to_be_bytes()); // checksum placeholder
    p.push(h.chunk);
    p.push(0); // flags
    p.extend_from_slice(&20u16.to_be_bytes()); // chunk length
    p.extend_from_slice(&h.init_tag.to_be_bytes());
    p.extend_from_slice(&65535u32.to_be_bytes()); // a_rwnd
    p.extend_from_slice(&1u16.to_be_bytes()); // outbound streams
    p.extend_from_slice(&1u16.to_be_bytes()); // inbound streams
    p.extend_from_slice(&h.init_tag.to_be_bytes()); // initial TSN
    let c = crc32c(&p);
    p[8..12].copy_from_slice(&c.to_le_bytes());
    p
}

/// `addr` as a socket address (port 0) for `sendto`/`bind`, with its length.
fn sockaddr_of(addr: IpAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data, large enough for both.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        IpAddr::V4(a) => {
            // SAFETY: sockaddr_storage holds a sockaddr_in.
            let sin: &mut libc::sockaddr_in = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast() };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        IpAddr::V6(a) => {
            // SAFETY: sockaddr_storage holds a sockaddr_in6.
            let sin6: &mut libc::sockaddr_in6 = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast() };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_addr.s6_addr = a.octets();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// Sends a raw SCTP packet to `dst` on a raw socket.
pub fn send_raw(fd: RawFd, dst: IpAddr, pkt: &[u8]) -> std::io::Result<()> {
    let (sa, len) = sockaddr_of(dst);
    // SAFETY: valid buffer and sockaddr of the stated size.
    let rc = unsafe {
        libc::sendto(
            fd,
            pkt.as_ptr().cast(),
            pkt.len(),
            0,
            (&sa as *const libc::sockaddr_storage).cast(),
            len,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// Asks the kernel to tell, with each packet `fd` receives, the address it
/// was sent to (`IP_PKTINFO` / `IPV6_RECVPKTINFO`).
fn want_pktinfo(fd: RawFd, v6: bool) -> std::io::Result<()> {
    let on: libc::c_int = 1;
    let (level, name) = if v6 {
        (libc::IPPROTO_IPV6, libc::IPV6_RECVPKTINFO)
    } else {
        (libc::IPPROTO_IP, libc::IP_PKTINFO)
    };
    // SAFETY: a valid int option of the stated size.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// One packet of a raw socket: its length in `buf`, the sender and the
/// address it was sent to (from the packet-info control message).
fn recv_raw(fd: RawFd, v6: bool, buf: &mut [u8]) -> Option<(usize, IpAddr, Option<IpAddr>)> {
    // SAFETY: plain data, filled by recvmsg.
    let mut sa: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut control = [0u64; 16];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: plain data; every pointer set below is valid for its length.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_name = (&mut sa as *mut libc::sockaddr_storage).cast();
    msg.msg_namelen = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: msg describes valid buffers.
    let n = unsafe { libc::recvmsg(fd, &mut msg, 0) };
    if n <= 0 {
        return None;
    }
    let src = if v6 {
        // SAFETY: an AF_INET6 raw socket fills a sockaddr_in6.
        let sin6: &libc::sockaddr_in6 = unsafe { &*(&sa as *const libc::sockaddr_storage).cast() };
        IpAddr::V6(Ipv6Addr::from(sin6.sin6_addr.s6_addr))
    } else {
        // SAFETY: an AF_INET raw socket fills a sockaddr_in.
        let sin: &libc::sockaddr_in = unsafe { &*(&sa as *const libc::sockaddr_storage).cast() };
        IpAddr::V4(Ipv4Addr::from(sin.sin_addr.s_addr.to_ne_bytes()))
    };
    let mut dst = None;
    // SAFETY: walking the control messages recvmsg wrote, with the libc
    // macros; each data pointer is read as the type its level/type says.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&msg);
        while !c.is_null() {
            let (level, kind) = ((*c).cmsg_level, (*c).cmsg_type);
            if level == libc::IPPROTO_IP && kind == libc::IP_PKTINFO {
                let info = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::in_pktinfo);
                dst = Some(IpAddr::V4(Ipv4Addr::from(info.ipi_addr.s_addr.to_ne_bytes())));
            } else if level == libc::IPPROTO_IPV6 && kind == libc::IPV6_PKTINFO {
                let info = std::ptr::read_unaligned(libc::CMSG_DATA(c) as *const libc::in6_pktinfo);
                dst = Some(IpAddr::V6(Ipv6Addr::from(info.ipi6_addr.s6_addr)));
            }
            c = libc::CMSG_NXTHDR(&msg, c);
        }
    }
    Some((n as usize, src, dst))
}

/// Sends `pkt` to `to` from the local address `from` (a raw socket bound
/// to it), so a reply leaves from the address the request was sent to,
/// as an SCTP endpoint's would, whatever the route's preferred source.
fn send_raw_from(from: IpAddr, to: IpAddr, pkt: &[u8]) -> std::io::Result<()> {
    let family = if from.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    let fd = raw_socket(family)?;
    let (sa, len) = sockaddr_of(from);
    // SAFETY: a valid sockaddr of the stated size.
    if unsafe { libc::bind(fd.as_raw_fd(), (&sa as *const libc::sockaddr_storage).cast(), len) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    send_raw(fd.as_raw_fd(), to, pkt)
}

fn drain_raw(fd: RawFd, v6: bool, pod: &str, log: &SctpLog) {
    let mut buf = [0u8; 2048];
    while let Some((n, src, dst)) = recv_raw(fd, v6, &mut buf) {
        let pkt = &buf[..n];
        let sctp = if v6 {
            pkt
        } else {
            // IPv4 raw sockets deliver the IP header too.
            if pkt.len() < 20 {
                continue;
            }
            let ihl = ((pkt[0] & 0x0f) as usize) * 4;
            if pkt.len() < ihl {
                continue;
            }
            &pkt[ihl..]
        };
        let Some(h) = parse_sctp(sctp) else {
            continue;
        };
        if h.chunk == SCTP_INIT {
            // Answer like an SCTP endpoint would: an INIT-ACK whose
            // verification tag is the INIT's initiate tag (the reply of the
            // association, which conntrack and the datapaths must pass),
            // from the address the INIT was sent to (a host-network pod's
            // node has several; conntrack only takes that one's reply).
            let ack = sctp_packet(&SctpHeader {
                src_port: h.dst_port,
                dst_port: h.src_port,
                vtag: h.init_tag,
                chunk: SCTP_INIT_ACK,
                init_tag: !h.init_tag | 1,
            });
            let _ = match dst {
                Some(local) => send_raw_from(local, src, &ack),
                None => send_raw(fd, src, &ack),
            };
        }
        log.push(SctpArrival {
            pod: pod.to_string(),
            src,
            dst_port: h.dst_port,
            tag: if h.chunk == SCTP_INIT { h.init_tag } else { h.vtag },
            chunk: h.chunk,
        });
    }
}

fn serve(s: Sockets, stop: &AtomicBool, pod: &str, log: &SctpLog) {
    let mut fds: Vec<libc::pollfd> = Vec::new();
    for l in &s.tcp {
        fds.push(pollfd(l.as_raw_fd()));
    }
    for u in &s.udp {
        fds.push(pollfd(u.as_raw_fd()));
    }
    fds.push(pollfd(s.raw4.as_raw_fd()));
    fds.push(pollfd(s.raw6.as_raw_fd()));
    let nt = s.tcp.len();
    let nu = s.udp.len();
    let mut buf = [0u8; 2048];
    while !stop.load(Ordering::Relaxed) {
        for f in fds.iter_mut() {
            f.revents = 0;
        }
        // SAFETY: fds is a valid array of pollfd of the given length.
        let rc = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 100) };
        if rc <= 0 {
            continue;
        }
        for (i, f) in fds.iter().enumerate() {
            if f.revents == 0 {
                continue;
            }
            if i < nt {
                // Accept and close: the probe only needs the handshake.
                while let Ok((conn, _)) = s.tcp[i].accept() {
                    drop(conn);
                }
            } else if i < nt + nu {
                let u = &s.udp[i - nt];
                while let Ok((n, from)) = u.recv_from(&mut buf) {
                    let _ = u.send_to(&buf[..n], from);
                }
            } else if i == nt + nu {
                drain_raw(s.raw4.as_raw_fd(), false, pod, log);
            } else {
                drain_raw(s.raw6.as_raw_fd(), true, pod, log);
            }
        }
    }
}

fn pollfd(fd: RawFd) -> libc::pollfd {
    libc::pollfd {
        fd,
        events: libc::POLLIN,
        revents: 0,
    }
}

impl PodServer {
    /// Starts the servers of pod `pod` inside netns `netns`.
    pub fn start(netns: &str, pod: &str, ports: &[u16], log: Arc<SctpLog>) -> Result<PodServer, ServerError> {
        let handle = NetnsHandle::open(netns)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Result<(), ServerError>>();
        let ports = ports.to_vec();
        let pod_name = pod.to_string();
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name(format!("srv-{pod}"))
            .spawn(move || {
                let socks = handle
                    .enter()
                    .map_err(ServerError::from)
                    .and_then(|_| open_sockets(&ports));
                match socks {
                    Ok(s) => {
                        let _ = tx.send(Ok(()));
                        serve(s, &stop2, &pod_name, &log);
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                    }
                }
            })
            .map_err(|source| ServerError::Socket {
                what: format!("spawning the server thread of {pod}"),
                source,
            })?;
        match rx.recv() {
            Ok(Ok(())) => Ok(PodServer {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(ServerError::Thread(pod.to_string())),
        }
    }

    /// Stops the servers and closes their sockets.
    pub fn stop(mut self) {
        self.stop_inner();
    }

    fn stop_inner(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        self.stop_inner();
    }
}
