//! A small synchronous rtnetlink client (`netlink-sys` sockets,
//! `netlink-packet-route` messages): dumps of links, addresses, routes,
//! neighbours and the bridge FDB, route lookups sent in batches, and the
//! neighbour-resolution trigger. One [`Netlink`] is one socket, reused for
//! every request; it may be opened inside another network namespace (the
//! socket stays bound to the namespace it was created in).

use std::net::IpAddr;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::Duration;

use netlink_packet_core::{
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_DUMP_INTR,
    NLM_F_MULTIPART, NLM_F_REQUEST,
};
use netlink_packet_route::address::{AddressAttribute, AddressMessage, AddressScope};
use netlink_packet_route::link::{InfoKind, LinkAttribute, LinkInfo, LinkMessage};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{RouteAddress, RouteAttribute, RouteFlags, RouteHeader, RouteMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use netlink_sys::{protocols::NETLINK_ROUTE, Socket};

/// Errors of the netlink client.
#[derive(Debug, thiserror::Error)]
pub enum NetlinkError {
    /// The network namespace could not be entered.
    #[error("entering network namespace {path}: {source}")]
    Netns {
        /// The namespace file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// A socket call failed.
    #[error("netlink {op}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// The kernel refused a request.
    #[error("netlink {op}: the kernel answered {source}")]
    Kernel {
        /// The request.
        op: &'static str,
        /// The errno the kernel answered.
        #[source]
        source: std::io::Error,
    },
    /// The kernel's answer could not be decoded.
    #[error("netlink {op}: undecodable answer: {detail}")]
    Decode {
        /// The request.
        op: &'static str,
        /// What was wrong.
        detail: String,
    },
    /// A dump kept changing while it was read.
    #[error("netlink {op}: the dump was interrupted by changes {attempts} times in a row")]
    Interrupted {
        /// The request.
        op: &'static str,
        /// Attempts made.
        attempts: u32,
    },
}

/// How long one receive may block before the request counts as failed.
const RECV_TIMEOUT: Duration = Duration::from_secs(5);
/// Receive buffer: larger than any datagram the kernel sends a dump in.
const RECV_BUF: usize = 256 * 1024;
/// Route lookups sent in one datagram.
const BATCH: usize = 64;
/// Attempts of a dump the kernel flags as interrupted.
const DUMP_ATTEMPTS: u32 = 3;

/// One network interface, as the link dump describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Link {
    /// Interface index.
    pub index: u32,
    /// Interface name.
    pub name: String,
    /// `IFLA_INFO_KIND` (`veth`, `bridge`, `dummy`...), `None` for physical devices and `lo`.
    pub kind: Option<LinkKind>,
    /// The bridge (or bond...) it is a port of (`IFLA_MASTER`).
    pub master: Option<u32>,
}

/// The kinds of interface the resolver tells apart.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LinkKind {
    /// One end of a veth pair.
    Veth,
    /// A Linux bridge.
    Bridge,
    /// Anything else (its `IFLA_INFO_KIND`).
    Other(String),
}

/// One interface address.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Address {
    /// Interface index.
    pub index: u32,
    /// The address (`IFA_LOCAL`, else `IFA_ADDRESS`).
    pub ip: IpAddr,
    /// Prefix length.
    pub prefix_len: u8,
    /// Global scope (not link, host or site).
    pub global: bool,
}

/// A route: a dump entry, or the FIB entry a lookup matched.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// Unicast (not local, blackhole, unreachable...).
    pub unicast: bool,
    /// Prefix length of the destination.
    pub dst_len: u8,
    /// Destination (`None`: the default route).
    pub dst: Option<IpAddr>,
    /// The route has a gateway (or a multipath next hop with one).
    pub gateway: bool,
    /// Output interfaces (several for a multipath route).
    pub oifs: Vec<u32>,
    /// The kernel made it from an interface address (`proto kernel`).
    pub proto_kernel: bool,
    /// Routing table.
    pub table: u32,
}

/// One IPv4/IPv6 neighbour entry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Neighbour {
    /// Interface index.
    pub index: u32,
    /// The neighbour's address.
    pub ip: IpAddr,
    /// Its link-layer address, when known.
    pub mac: Option<Vec<u8>>,
    /// The entry is usable (reachable, stale, delay, probe, permanent or noarp).
    pub valid: bool,
}

/// One bridge forwarding entry (`AF_BRIDGE` neighbour).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FdbEntry {
    /// The bridge port.
    pub port: u32,
    /// The bridge (`NDA_MASTER`), when the entry is the bridge's.
    pub bridge: Option<u32>,
    /// The MAC address.
    pub mac: Vec<u8>,
    /// A local entry (the port's or the bridge's own address).
    pub local: bool,
}

/// One request's answer in a batch of route lookups.
pub type Lookup = Result<Option<Route>, NetlinkError>;

/// An rtnetlink socket and its request sequence.
pub struct Netlink {
    socket: Socket,
    seq: u32,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Netlink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Netlink").field("fd", &self.socket.as_raw_fd()).finish()
    }
}

/// The file of a network namespace given by name (`/run/netns/<name>`) or path.
pub fn netns_path(netns: &str) -> PathBuf {
    if netns.contains('/') {
        PathBuf::from(netns)
    } else {
        Path::new("/run/netns").join(netns)
    }
}

fn io(op: &'static str) -> impl FnOnce(std::io::Error) -> NetlinkError {
    move |source| NetlinkError::Io { op, source }
}

/// Create a socket in the current network namespace.
fn new_socket() -> Result<Socket, NetlinkError> {
    let mut socket = Socket::new(NETLINK_ROUTE).map_err(io("socket"))?;
    socket.bind_auto().map_err(io("bind"))?;
    Ok(socket)
}

/// Create a socket inside network namespace `netns` (name or path): on a
/// short-lived thread that enters it, so the calling thread stays where it is.
pub fn socket_in(netns: Option<&str>) -> Result<Socket, NetlinkError> {
    let Some(ns) = netns else {
        return new_socket();
    };
    let path = netns_path(ns);
    std::thread::scope(|s| {
        s.spawn(|| {
            let file = std::fs::File::open(&path).map_err(|source| NetlinkError::Netns {
                path: path.clone(),
                source,
            })?;
            // SAFETY: setns on this (scoped, short-lived) thread only, with a
            // valid namespace fd.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(NetlinkError::Netns {
                    path: path.clone(),
                    source: std::io::Error::last_os_error(),
                });
            }
            new_socket()
        })
        .join()
        .unwrap_or_else(|_| {
            Err(NetlinkError::Io {
                op: "socket",
                source: std::io::Error::other("the namespace thread panicked"),
            })
        })
    })
}

/// Set a receive timeout on a socket (`None`: block).
pub fn set_recv_timeout(socket: &Socket, timeout: Duration) -> Result<(), NetlinkError> {
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: timeout.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: a valid socket fd and a timeval of the announced size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(NetlinkError::Io {
            op: "setsockopt SO_RCVTIMEO",
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(())
}

/// Decode the netlink messages of one datagram.
pub fn decode_datagram(
    op: &'static str,
    mut data: &[u8],
) -> Result<Vec<NetlinkMessage<RouteNetlinkMessage>>, NetlinkError> {
    let mut out = Vec::new();
    while data.len() >= 16 {
        let len = u32::from_ne_bytes([data[0], data[1], data[2], data[3]]) as usize;
        if len < 16 || len > data.len() {
            return Err(NetlinkError::Decode {
                op,
                detail: format!("message length {len} in a datagram of {}", data.len()),
            });
        }
        let msg =
            NetlinkMessage::<RouteNetlinkMessage>::deserialize(&data[..len]).map_err(|e| NetlinkError::Decode {
                op,
                detail: e.to_string(),
            })?;
        out.push(msg);
        data = &data[((len + 3) & !3).min(data.len())..];
    }
    Ok(out)
}

fn errno(e: &netlink_packet_core::ErrorMessage) -> std::io::Error {
    e.to_io()
}

impl Netlink {
    /// A socket in network namespace `netns` (a name under `/run/netns` or
    /// a path), or in the agent's own.
    pub fn open(netns: Option<&str>) -> Result<Self, NetlinkError> {
        let socket = socket_in(netns)?;
        set_recv_timeout(&socket, RECV_TIMEOUT)?;
        Ok(Netlink {
            socket,
            seq: 0,
            buf: vec![0; RECV_BUF],
        })
    }

    fn next_seq(&mut self) -> u32 {
        self.seq = self.seq.wrapping_add(1).max(1);
        self.seq
    }

    fn encode(&mut self, msg: RouteNetlinkMessage, flags: u16, out: &mut Vec<u8>) -> u32 {
        let seq = self.next_seq();
        let mut header = NetlinkHeader::default();
        header.flags = flags;
        header.sequence_number = seq;
        let mut nl = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(msg));
        nl.finalize();
        let start = out.len();
        out.resize(start + nl.buffer_len(), 0);
        nl.serialize(&mut out[start..]);
        seq
    }

    fn send(&self, op: &'static str, data: &[u8]) -> Result<(), NetlinkError> {
        let n = self.socket.send(data, 0).map_err(io(op))?;
        if n != data.len() {
            return Err(NetlinkError::Io {
                op,
                source: std::io::Error::other(format!("sent {n} of {} bytes", data.len())),
            });
        }
        Ok(())
    }

    fn recv(&mut self, op: &'static str) -> Result<Vec<NetlinkMessage<RouteNetlinkMessage>>, NetlinkError> {
        let mut b = &mut self.buf[..];
        let n = self.socket.recv(&mut b, libc::MSG_TRUNC).map_err(io(op))?;
        if n > RECV_BUF {
            return Err(NetlinkError::Decode {
                op,
                detail: format!("datagram of {n} bytes truncated"),
            });
        }
        decode_datagram(op, &self.buf[..n])
    }

    /// A dump request: every answer message until `NLMSG_DONE` (retried
    /// when the kernel flags the dump as interrupted by a change).
    pub fn dump(
        &mut self,
        op: &'static str,
        msg: RouteNetlinkMessage,
    ) -> Result<Vec<RouteNetlinkMessage>, NetlinkError> {
        for _ in 0..DUMP_ATTEMPTS {
            let mut data = Vec::new();
            let seq = self.encode(msg.clone(), NLM_F_REQUEST | NLM_F_DUMP, &mut data);
            self.send(op, &data)?;
            let mut out = Vec::new();
            let mut interrupted = false;
            'recv: loop {
                for m in self.recv(op)? {
                    if m.header.sequence_number != seq {
                        continue; // an answer to an earlier, abandoned request
                    }
                    interrupted |= m.header.flags & NLM_F_DUMP_INTR != 0;
                    match m.payload {
                        NetlinkPayload::Done(_) => break 'recv,
                        NetlinkPayload::Error(e) if e.code.is_some() => {
                            return Err(NetlinkError::Kernel { op, source: errno(&e) })
                        }
                        NetlinkPayload::InnerMessage(inner) => out.push(inner),
                        _ => {}
                    }
                    if m.header.flags & NLM_F_MULTIPART == 0 {
                        break 'recv;
                    }
                }
            }
            if !interrupted {
                return Ok(out);
            }
        }
        Err(NetlinkError::Interrupted {
            op,
            attempts: DUMP_ATTEMPTS,
        })
    }

    /// Every interface, by index.
    pub fn links(&mut self) -> Result<std::collections::HashMap<u32, Link>, NetlinkError> {
        let msgs = self.dump("link dump", RouteNetlinkMessage::GetLink(LinkMessage::default()))?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewLink(l) => Some(link_of(&l)),
                _ => None,
            })
            .map(|l| (l.index, l))
            .collect())
    }

    /// Every interface address (IPv4 and IPv6).
    pub fn addresses(&mut self) -> Result<Vec<Address>, NetlinkError> {
        let msgs = self.dump(
            "address dump",
            RouteNetlinkMessage::GetAddress(AddressMessage::default()),
        )?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewAddress(a) => address_of(&a),
                _ => None,
            })
            .collect())
    }

    /// Every route of every table (IPv4 and IPv6).
    pub fn routes(&mut self) -> Result<Vec<Route>, NetlinkError> {
        let msgs = self.dump("route dump", RouteNetlinkMessage::GetRoute(RouteMessage::default()))?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewRoute(r) => Some(route_of(&r)),
                _ => None,
            })
            .collect())
    }

    /// The IPv4 or IPv6 neighbour entries.
    pub fn neighbours(&mut self, v6: bool) -> Result<Vec<Neighbour>, NetlinkError> {
        let mut req = NeighbourMessage::default();
        req.header.family = if v6 { AddressFamily::Inet6 } else { AddressFamily::Inet };
        let msgs = self.dump("neighbour dump", RouteNetlinkMessage::GetNeighbour(req))?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewNeighbour(n) => neighbour_of(&n),
                _ => None,
            })
            .collect())
    }

    /// The forwarding entries of every bridge (`AF_BRIDGE` neighbours).
    pub fn fdb(&mut self) -> Result<Vec<FdbEntry>, NetlinkError> {
        let mut req = NeighbourMessage::default();
        req.header.family = AddressFamily::Bridge;
        let msgs = self.dump("bridge fdb dump", RouteNetlinkMessage::GetNeighbour(req))?;
        Ok(msgs
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewNeighbour(n) => fdb_of(&n),
                _ => None,
            })
            .collect())
    }

    /// Look up the routes to `ips` as `ip route get fibmatch` does (the
    /// FIB entry each lookup matches), `BATCH` requests per datagram.
    /// `Ok(None)`: the kernel has no route (unreachable, prohibited,
    /// blackholed).
    pub fn route_lookups(&mut self, ips: &[IpAddr]) -> Vec<Lookup> {
        let mut out = Vec::with_capacity(ips.len());
        for chunk in ips.chunks(BATCH) {
            match self.route_lookup_batch(chunk) {
                Ok(answers) => out.extend(answers),
                Err(e) => {
                    let detail = e.to_string();
                    out.extend(chunk.iter().map(|_| {
                        Err(NetlinkError::Io {
                            op: "route lookup",
                            source: std::io::Error::other(detail.clone()),
                        })
                    }));
                }
            }
        }
        out
    }

    fn route_lookup_batch(&mut self, ips: &[IpAddr]) -> Result<Vec<Lookup>, NetlinkError> {
        const OP: &str = "route lookup";
        let mut data = Vec::new();
        let mut seqs = Vec::with_capacity(ips.len());
        for &ip in ips {
            let mut req = RouteMessage::default();
            req.header.address_family = if ip.is_ipv4() {
                AddressFamily::Inet
            } else {
                AddressFamily::Inet6
            };
            req.header.destination_prefix_length = if ip.is_ipv4() { 32 } else { 128 };
            req.header.flags = RouteFlags::FibMatch;
            req.attributes.push(RouteAttribute::Destination(RouteAddress::from(ip)));
            seqs.push(self.encode(RouteNetlinkMessage::GetRoute(req), NLM_F_REQUEST, &mut data));
        }
        self.send(OP, &data)?;
        let first = seqs[0];
        let mut answers: Vec<Option<Lookup>> = (0..ips.len()).map(|_| None).collect();
        let mut pending = ips.len();
        while pending > 0 {
            for m in self.recv(OP)? {
                let i = m.header.sequence_number.wrapping_sub(first) as usize;
                if i >= answers.len() || seqs[i] != m.header.sequence_number || answers[i].is_some() {
                    continue;
                }
                let answer = match m.payload {
                    NetlinkPayload::InnerMessage(RouteNetlinkMessage::NewRoute(r)) => Ok(Some(route_of(&r))),
                    NetlinkPayload::Error(e) => match e.raw_code().abs() {
                        libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EACCES | libc::EINVAL | libc::ESRCH => Ok(None),
                        _ => Err(NetlinkError::Kernel {
                            op: OP,
                            source: errno(&e),
                        }),
                    },
                    other => Err(NetlinkError::Decode {
                        op: OP,
                        detail: format!("unexpected answer {other:?}"),
                    }),
                };
                answers[i] = Some(answer);
                pending -= 1;
            }
        }
        Ok(answers.into_iter().map(|a| a.expect("every answer received")).collect())
    }

    /// Ask the kernel to resolve the link-layer address of `ip` on
    /// interface `index` (as sending a packet there would: `NTF_USE` on a
    /// created entry), so a later neighbour dump has it.
    pub fn trigger_neighbour(&mut self, index: u32, ip: IpAddr) -> Result<(), NetlinkError> {
        const OP: &str = "neighbour resolution";
        let mut req = NeighbourMessage::default();
        req.header.family = if ip.is_ipv4() {
            AddressFamily::Inet
        } else {
            AddressFamily::Inet6
        };
        req.header.ifindex = index;
        req.header.state = NeighbourState::None;
        req.header.flags = NeighbourFlags::Use;
        req.attributes.push(NeighbourAttribute::Destination(match ip {
            IpAddr::V4(a) => NeighbourAddress::Inet(a),
            IpAddr::V6(a) => NeighbourAddress::Inet6(a),
        }));
        let mut data = Vec::new();
        let seq = self.encode(
            RouteNetlinkMessage::NewNeighbour(req),
            NLM_F_REQUEST | NLM_F_ACK | NLM_F_CREATE,
            &mut data,
        );
        self.send(OP, &data)?;
        loop {
            for m in self.recv(OP)? {
                if m.header.sequence_number != seq {
                    continue;
                }
                if let NetlinkPayload::Error(e) = m.payload {
                    return match e.code {
                        None => Ok(()),
                        Some(_) => Err(NetlinkError::Kernel {
                            op: OP,
                            source: errno(&e),
                        }),
                    };
                }
            }
        }
    }
}

fn link_of(l: &LinkMessage) -> Link {
    let mut link = Link {
        index: l.header.index,
        name: String::new(),
        kind: None,
        master: None,
    };
    for a in &l.attributes {
        match a {
            LinkAttribute::IfName(n) => link.name = n.clone(),
            LinkAttribute::Controller(m) => link.master = Some(*m),
            LinkAttribute::LinkInfo(infos) => {
                for i in infos {
                    if let LinkInfo::Kind(k) = i {
                        link.kind = Some(match k {
                            InfoKind::Veth => LinkKind::Veth,
                            InfoKind::Bridge => LinkKind::Bridge,
                            other => LinkKind::Other(other.to_string()),
                        });
                    }
                }
            }
            _ => {}
        }
    }
    link
}

fn address_of(a: &AddressMessage) -> Option<Address> {
    let mut local = None;
    let mut address = None;
    for attr in &a.attributes {
        match attr {
            AddressAttribute::Local(ip) => local = Some(*ip),
            AddressAttribute::Address(ip) => address = Some(*ip),
            _ => {}
        }
    }
    Some(Address {
        index: a.header.index,
        ip: local.or(address)?,
        prefix_len: a.header.prefix_len,
        global: a.header.scope == AddressScope::Universe,
    })
}

fn ip_of(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

fn route_of(r: &RouteMessage) -> Route {
    use netlink_packet_route::route::{RouteProtocol, RouteType};
    let h: &RouteHeader = &r.header;
    let mut route = Route {
        unicast: h.kind == RouteType::Unicast,
        dst_len: h.destination_prefix_length,
        dst: None,
        gateway: false,
        oifs: Vec::new(),
        proto_kernel: h.protocol == RouteProtocol::Kernel,
        table: u32::from(h.table),
    };
    for a in &r.attributes {
        match a {
            RouteAttribute::Destination(d) => route.dst = ip_of(d),
            RouteAttribute::Gateway(_) | RouteAttribute::Via(_) => route.gateway = true,
            RouteAttribute::Oif(i) => route.oifs.push(*i),
            RouteAttribute::Table(t) => route.table = *t,
            RouteAttribute::MultiPath(hops) => {
                for hop in hops {
                    route.oifs.push(hop.interface_index);
                    route.gateway |= hop
                        .attributes
                        .iter()
                        .any(|a| matches!(a, RouteAttribute::Gateway(_) | RouteAttribute::Via(_)));
                }
            }
            _ => {}
        }
    }
    route
}

fn neighbour_of(n: &NeighbourMessage) -> Option<Neighbour> {
    let mut ip = None;
    let mut mac = None;
    for a in &n.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => ip = Some(IpAddr::V4(*v4)),
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => ip = Some(IpAddr::V6(*v6)),
            NeighbourAttribute::LinkLayerAddress(l) if !l.is_empty() => mac = Some(l.clone()),
            _ => {}
        }
    }
    let valid = matches!(
        n.header.state,
        NeighbourState::Reachable
            | NeighbourState::Stale
            | NeighbourState::Delay
            | NeighbourState::Probe
            | NeighbourState::Permanent
            | NeighbourState::Noarp
    );
    Some(Neighbour {
        index: n.header.ifindex,
        ip: ip?,
        mac,
        valid,
    })
}

fn fdb_of(n: &NeighbourMessage) -> Option<FdbEntry> {
    let mut mac = None;
    let mut bridge = None;
    for a in &n.attributes {
        match a {
            NeighbourAttribute::LinkLayerAddress(l) => mac = Some(l.clone()),
            NeighbourAttribute::Controller(m) => bridge = Some(*m),
            _ => {}
        }
    }
    Some(FdbEntry {
        port: n.header.ifindex,
        bridge,
        mac: mac?,
        local: n.header.state == NeighbourState::Permanent,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_is_found_and_local_routes_are_not_unicast() {
        let mut nl = Netlink::open(None).unwrap();
        let links = nl.links().unwrap();
        assert!(links.values().any(|l| l.name == "lo"), "{links:?}");
        let answers = nl.route_lookups(&["127.0.0.1".parse().unwrap(), "::1".parse().unwrap()]);
        assert_eq!(answers.len(), 2);
        for a in answers {
            if let Some(r) = a.unwrap() {
                assert!(!r.unicast, "{r:?}");
            }
        }
    }

    #[test]
    fn decode_rejects_a_bad_length() {
        assert!(decode_datagram("test", &[255, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
        assert!(decode_datagram("test", &[]).unwrap().is_empty());
    }
}
