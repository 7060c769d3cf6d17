//! A minimal NFQUEUE client ([`NfQueue`]) over a raw `NETLINK_NETFILTER`
//! socket: bind one queue (whole packets, fail-open), read the queued
//! packets without blocking, and issue each one's verdict in any order.
//!
//! Why not a crate: the reader must wait on the queue and on "a sync
//! programmed something" at once (`poll` on the socket and an eventfd) and
//! issue verdicts out of order, which needs the socket's descriptor; the
//! `nfq` crate keeps it private.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// `NFNL_SUBSYS_QUEUE`.
const SUBSYS_QUEUE: u16 = 3;
/// `NFQNL_MSG_PACKET`, `NFQNL_MSG_VERDICT`, `NFQNL_MSG_CONFIG`.
const MSG_PACKET: u16 = 0;
const MSG_VERDICT: u16 = 1;
const MSG_CONFIG: u16 = 2;
/// `NFQA_CFG_CMD`, `NFQA_CFG_PARAMS`, `NFQA_CFG_QUEUE_MAXLEN`,
/// `NFQA_CFG_MASK`, `NFQA_CFG_FLAGS`.
const CFG_CMD: u16 = 1;
const CFG_PARAMS: u16 = 2;
const CFG_QUEUE_MAXLEN: u16 = 3;
const CFG_MASK: u16 = 4;
const CFG_FLAGS: u16 = 5;
/// `NFQNL_CFG_CMD_BIND`, `NFQNL_CFG_CMD_UNBIND`.
const CMD_BIND: u8 = 1;
const CMD_UNBIND: u8 = 2;
/// `NFQNL_COPY_PACKET`.
const COPY_PACKET: u8 = 2;
/// `NFQA_CFG_F_FAIL_OPEN`.
const F_FAIL_OPEN: u32 = 1;
/// `NFQA_PACKET_HDR`, `NFQA_VERDICT_HDR`, `NFQA_PAYLOAD`.
const A_PACKET_HDR: u16 = 1;
const A_VERDICT_HDR: u16 = 2;
const A_PAYLOAD: u16 = 10;
/// `NF_ACCEPT`.
const NF_ACCEPT: u32 = 1;
/// `NLMSG_ERROR`, `NLMSG_DONE`; `NLM_F_REQUEST`, `NLM_F_ACK`.
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
const F_REQUEST: u16 = 1;
const F_ACK: u16 = 4;
/// `SOL_NETLINK`, `NETLINK_NO_ENOBUFS`.
const SOL_NETLINK: libc::c_int = 270;
const NETLINK_NO_ENOBUFS: libc::c_int = 5;
/// Bytes copied of each packet (a DNS response over UDP fits).
const COPY_RANGE: u32 = 0xffff;
/// The receive buffer (a whole packet and its attributes, several per read).
const RECV_BUF: usize = 256 * 1024;

/// One queued packet: its id (for the verdict) and its bytes (from the IP
/// header on).
#[derive(Debug)]
pub struct Packet {
    /// The kernel's packet id.
    pub id: u32,
    /// The packet, from its IP header.
    pub payload: Vec<u8>,
}

/// One bound NFQUEUE queue.
#[derive(Debug)]
pub struct NfQueue {
    fd: OwnedFd,
    queue: u16,
    seq: u32,
    buf: Vec<u8>,
}

/// Appends a netlink attribute (`type`, `data`), padded to 4 bytes.
fn put_attr(msg: &mut Vec<u8>, kind: u16, data: &[u8]) {
    let len = u16::try_from(4 + data.len()).unwrap_or(u16::MAX);
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&kind.to_ne_bytes());
    msg.extend_from_slice(data);
    while !msg.len().is_multiple_of(4) {
        msg.push(0);
    }
}

/// The 4-byte alignment of netlink.
fn align(n: usize) -> usize {
    (n + 3) & !3
}

/// A native-endian u16/u32 at `at` of `b`.
fn ne16(b: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_ne_bytes(b.get(at..at + 2)?.try_into().ok()?))
}
fn ne32(b: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_ne_bytes(b.get(at..at + 4)?.try_into().ok()?))
}

impl NfQueue {
    /// Opens a netfilter netlink socket (in the calling thread's network
    /// namespace), binds queue `queue` (whole packets, fail-open: a full
    /// queue lets packets through) with room for `max_len` packets.
    pub fn bind(queue: u16, max_len: u32) -> io::Result<NfQueue> {
        // SAFETY: socket(2) with constant arguments; the result is checked.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_RAW | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
                libc::NETLINK_NETFILTER,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by socket(2) and is owned by no one else.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: an all-zero sockaddr_nl is valid (pid 0: the kernel assigns one).
        let mut addr: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
        addr.nl_family = libc::AF_NETLINK as libc::sa_family_t;
        // SAFETY: `addr` is a valid sockaddr_nl of the size passed.
        let rc = unsafe {
            libc::bind(
                fd.as_raw_fd(),
                (&raw const addr).cast(),
                std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
            )
        };
        if rc < 0 {
            return Err(io::Error::last_os_error());
        }
        let on: libc::c_int = 1;
        // SAFETY: an int option of the size passed; a failure only means
        // ENOBUFS may be reported (handled by the reader).
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                SOL_NETLINK,
                NETLINK_NO_ENOBUFS,
                (&raw const on).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let rcvbuf: libc::c_int = 4 * 1024 * 1024;
        // SAFETY: as above; a smaller buffer only means fail-open sooner.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVBUFFORCE,
                (&raw const rcvbuf).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
        let mut q = NfQueue {
            fd,
            queue,
            seq: 0,
            buf: vec![0u8; RECV_BUF],
        };
        q.config(CFG_CMD, &[CMD_BIND, 0, 0, 0])?;
        let mut params = COPY_RANGE.to_be_bytes().to_vec();
        params.push(COPY_PACKET);
        q.config(CFG_PARAMS, &params)?;
        q.config(CFG_QUEUE_MAXLEN, &max_len.to_be_bytes())?;
        q.config_flags(F_FAIL_OPEN, F_FAIL_OPEN)?;
        Ok(q)
    }

    /// The socket, to poll for readability.
    pub fn raw_fd(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// A netlink message of `kind` (in the queue subsystem) for this queue,
    /// the nfgenmsg header included, `attrs` appended by `fill`.
    fn message(&mut self, kind: u16, flags: u16, fill: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
        self.seq = self.seq.wrapping_add(1);
        let mut m = Vec::with_capacity(64);
        m.extend_from_slice(&0u32.to_ne_bytes());
        m.extend_from_slice(&((SUBSYS_QUEUE << 8) | kind).to_ne_bytes());
        m.extend_from_slice(&(F_REQUEST | flags).to_ne_bytes());
        m.extend_from_slice(&self.seq.to_ne_bytes());
        m.extend_from_slice(&0u32.to_ne_bytes());
        // nfgenmsg: family AF_UNSPEC, version 0, res_id (big-endian).
        m.extend_from_slice(&[0, 0]);
        m.extend_from_slice(&self.queue.to_be_bytes());
        fill(&mut m);
        let len = u32::try_from(m.len()).unwrap_or(u32::MAX);
        m[..4].copy_from_slice(&len.to_ne_bytes());
        m
    }

    fn send(&self, msg: &[u8]) -> io::Result<()> {
        // SAFETY: `msg` is a readable buffer of the length passed; the
        // socket is bound, so no address is needed.
        let n = unsafe { libc::send(self.fd.as_raw_fd(), msg.as_ptr().cast(), msg.len(), 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Sends a config attribute and waits for the kernel's acknowledgement.
    fn config(&mut self, attr: u16, data: &[u8]) -> io::Result<()> {
        let msg = self.message(MSG_CONFIG, F_ACK, |m| put_attr(m, attr, data));
        self.send(&msg)?;
        self.wait_ack()
    }

    fn config_flags(&mut self, mask: u32, flags: u32) -> io::Result<()> {
        let msg = self.message(MSG_CONFIG, F_ACK, |m| {
            put_attr(m, CFG_MASK, &mask.to_be_bytes());
            put_attr(m, CFG_FLAGS, &flags.to_be_bytes());
        });
        self.send(&msg)?;
        self.wait_ack()
    }

    /// Reads until the acknowledgement of the last request (packets queued
    /// meanwhile cannot come: the queue is not bound before the first ack,
    /// and the rules are installed after binding).
    fn wait_ack(&mut self) -> io::Result<()> {
        let seq = self.seq;
        loop {
            self.wait_readable(Some(5000))?;
            let n = self.recv_raw()?;
            let mut at = 0;
            while at + 16 <= n {
                let len = ne32(&self.buf, at).unwrap_or(0) as usize;
                let kind = ne16(&self.buf, at + 4).unwrap_or(0);
                let mseq = ne32(&self.buf, at + 8).unwrap_or(0);
                if len < 16 || at + len > n {
                    break;
                }
                if kind == NLMSG_ERROR && mseq == seq {
                    let errno = ne32(&self.buf, at + 16).map_or(0, |e| (e as i32).unsigned_abs());
                    return if errno == 0 {
                        Ok(())
                    } else {
                        Err(io::Error::from_raw_os_error(errno as i32))
                    };
                }
                at += align(len);
            }
        }
    }

    /// Waits until the socket is readable (`timeout_ms`: `None` forever).
    fn wait_readable(&self, timeout_ms: Option<i32>) -> io::Result<()> {
        let mut p = libc::pollfd {
            fd: self.fd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        let rc = unsafe { libc::poll(&raw mut p, 1, timeout_ms.unwrap_or(-1)) };
        match rc {
            rc if rc < 0 => Err(io::Error::last_os_error()),
            0 => Err(io::Error::new(io::ErrorKind::TimedOut, "no answer from nfnetlink")),
            _ => Ok(()),
        }
    }

    /// One non-blocking read into the buffer; its length.
    fn recv_raw(&mut self) -> io::Result<usize> {
        // SAFETY: `buf` is a writable buffer of the length passed.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                self.buf.as_mut_ptr().cast(),
                self.buf.len(),
                libc::MSG_DONTWAIT,
            )
        };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(n as usize)
    }

    /// The packets queued now (none when nothing is waiting); never blocks.
    /// A read error other than "nothing to read" is returned (ENOBUFS: the
    /// kernel dropped messages; fail-open let those packets through).
    pub fn try_recv(&mut self) -> io::Result<Vec<Packet>> {
        let n = match self.recv_raw() {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(Vec::new()),
            Err(e) => return Err(e),
        };
        let mut out = Vec::new();
        let mut at = 0;
        while at + 16 <= n {
            let len = ne32(&self.buf, at).unwrap_or(0) as usize;
            let kind = ne16(&self.buf, at + 4).unwrap_or(0);
            if len < 16 || at + len > n {
                break;
            }
            if kind == (SUBSYS_QUEUE << 8) | MSG_PACKET {
                if let Some(p) = parse_packet(&self.buf[at + 16..at + len]) {
                    out.push(p);
                }
            } else if kind == NLMSG_DONE {
                break;
            }
            at += align(len);
        }
        Ok(out)
    }

    /// Accepts packet `id`.
    pub fn accept(&mut self, id: u32) -> io::Result<()> {
        let msg = self.message(MSG_VERDICT, 0, |m| {
            let mut hdr = NF_ACCEPT.to_be_bytes().to_vec();
            hdr.extend_from_slice(&id.to_be_bytes());
            put_attr(m, A_VERDICT_HDR, &hdr);
        });
        self.send(&msg)
    }
}

impl Drop for NfQueue {
    fn drop(&mut self) {
        // The kernel drops packets still queued on unbind (as on close):
        // the owner lets them through first.
        let msg = self.message(MSG_CONFIG, 0, |m| put_attr(m, CFG_CMD, &[CMD_UNBIND, 0, 0, 0]));
        let _ = self.send(&msg);
    }
}

/// The packet of an `NFQNL_MSG_PACKET` message's body (after nlmsghdr).
fn parse_packet(body: &[u8]) -> Option<Packet> {
    let mut at = 4; // nfgenmsg
    let (mut id, mut payload) = (None, None);
    while at + 4 <= body.len() {
        let len = ne16(body, at)? as usize;
        let kind = ne16(body, at + 2)? & 0x3fff;
        if len < 4 || at + len > body.len() {
            break;
        }
        let data = &body[at + 4..at + len];
        match kind {
            A_PACKET_HDR => id = Some(u32::from_be_bytes(data.get(..4)?.try_into().ok()?)),
            A_PAYLOAD => payload = Some(data.to_vec()),
            _ => {}
        }
        at += align(len);
    }
    Some(Packet {
        id: id?,
        payload: payload.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_packet_message_gives_its_id_and_payload() {
        let mut body = vec![0u8, 0, 0, 7];
        let mut hdr = 0x0102_0304u32.to_be_bytes().to_vec();
        hdr.extend_from_slice(&[8, 0, 3]);
        put_attr(&mut body, A_PACKET_HDR, &hdr);
        put_attr(&mut body, 5, &[0, 0, 0, 1]);
        put_attr(&mut body, A_PAYLOAD, &[0x45, 1, 2]);
        let p = parse_packet(&body).expect("parses");
        assert_eq!(p.id, 0x0102_0304);
        assert_eq!(p.payload, [0x45, 1, 2]);
        assert!(parse_packet(&[0, 0, 0, 7]).is_none(), "no header, no packet");
    }
}
