//! Kernel conntrack entries of addresses that changed owner
//! ([`flush_addresses`]): the nftables dataplane's endpoint chains let
//! `ct state established,related` pass before any policy, so an entry of
//! an address's previous owner (a deleted pod whose address a new pod got,
//! or the same address under a new pod UID) would keep a flow the new
//! owner's policy denies alive, over UDP indefinitely. After every table
//! change the dataplane deletes, through ctnetlink, every entry whose
//! original or reply tuple names an address that left its endpoint or
//! changed owner ([`changed_owners`]), so the next packet of such a flow is
//! new and meets the new owner's policy.
//!
//! Connection semantics `enforce`: after a
//! table change, every entry of a connection that an `enforce` endpoint's
//! new policy denies ([`denied`]: `npm_policy::lookup` on the state just
//! loaded, on the addresses and port the ruleset decides on) is marked
//! cut ([`CT_MARK_CUT`]), and the table drops its packets both ways.
//!
//! The entries are found by a dump of the table (both families) and
//! deleted one by one by their original tuple, echoed as the kernel
//! dumped it (every protocol's tuple, ICMP's id included, as it was).

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, ProtoTuple, Tuple};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket};
use npm_common::Reason;
use npm_policy::compiled::{Compiled, Direction, IpEntry};

/// A ctnetlink operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackError {
    /// The network namespace could not be entered.
    #[error("netns {netns}: {source}")]
    Netns {
        /// Its name under `/run/netns`.
        netns: String,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A socket operation failed.
    #[error("ctnetlink {op}: {source}")]
    Socket {
        /// What was done.
        op: &'static str,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The kernel refused a request.
    #[error("ctnetlink {op}: refused with errno {code}")]
    Refused {
        /// What was asked.
        op: &'static str,
        /// The (negative) error code.
        code: i32,
    },
}

/// Each pod address with its owner ([`IpEntry::owner`], the pod UID
/// hashed): the pods of other nodes from the ipcache, and the local
/// endpoints.
pub fn owners(c: &Compiled) -> BTreeMap<IpAddr, u64> {
    let mut out: BTreeMap<IpAddr, u64> = c
        .ipcache
        .iter()
        .filter(|(_, e)| e.owner != 0)
        .map(|(a, e)| (*a, e.owner))
        .collect();
    for e in c.endpoints.values() {
        for a in [e.ipv4.map(IpAddr::V4), e.ipv6.map(IpAddr::V6)].into_iter().flatten() {
            out.insert(a, IpEntry::pod_owner(&e.pod.uid));
        }
    }
    out
}

/// The addresses of `old` that `new` no longer has, or has under another
/// owner.
pub fn changed_owners(old: &BTreeMap<IpAddr, u64>, new: &BTreeMap<IpAddr, u64>) -> Vec<IpAddr> {
    old.iter()
        .filter(|(a, uid)| new.get(*a) != Some(*uid))
        .map(|(a, _)| *a)
        .collect()
}

/// A ctnetlink request of `msg` for `family` with `flags`.
fn request(family: NetfilterProtoFamily, msg: ConntrackMessage, flags: u16) -> Vec<u8> {
    let mut hdr = NetlinkHeader::default();
    hdr.flags = flags;
    let mut m = NetlinkMessage::new(
        hdr,
        NetlinkPayload::from(NetfilterMessage::new(NetfilterHeader::new(family, 0, 0), msg)),
    );
    m.finalize();
    let mut buf = vec![0u8; m.buffer_len()];
    m.serialize(&mut buf);
    buf
}

/// The addresses of a tuple attribute list.
fn tuple_addrs(t: &[Tuple]) -> impl Iterator<Item = IpAddr> + '_ {
    t.iter()
        .filter_map(|t| match t {
            Tuple::Ip(ips) => Some(ips),
            _ => None,
        })
        .flatten()
        .filter_map(|ip| match ip {
            IPTuple::SourceAddress(a) | IPTuple::DestinationAddress(a) => Some(a.to_canonical()),
            _ => None,
        })
}

/// Sends `buf` and reads the answers until the dump's end or the
/// acknowledgement, handing each conntrack message to `each`.
fn exchange(
    s: &mut Socket,
    op: &'static str,
    buf: &[u8],
    mut each: impl FnMut(ConntrackMessage),
) -> Result<(), ConntrackError> {
    let err = |op| move |source| ConntrackError::Socket { op, source };
    s.send(buf, 0).map_err(err(op))?;
    let mut rbuf = Vec::with_capacity(1 << 16);
    loop {
        rbuf.clear();
        let n = s.recv(&mut rbuf, 0).map_err(err(op))?;
        let mut off = 0;
        while off < n.min(rbuf.len()) {
            let Ok(m) = NetlinkMessage::<NetfilterMessage>::deserialize(&rbuf[off..]) else {
                // A message this crate cannot parse: skip it by its length.
                let len = u32::from_ne_bytes(rbuf[off..off + 4].try_into().unwrap_or([0; 4])) as usize;
                if len == 0 {
                    return Ok(());
                }
                off += (len + 3) & !3;
                continue;
            };
            let len = m.header.length as usize;
            match m.payload {
                NetlinkPayload::Done(_) => return Ok(()),
                NetlinkPayload::Error(e) => {
                    return match e.code {
                        None => Ok(()),
                        Some(code) => Err(ConntrackError::Refused { op, code: code.get() }),
                    };
                }
                NetlinkPayload::InnerMessage(NetfilterMessage {
                    inner: NetfilterMessageInner::Conntrack(c),
                    ..
                }) => each(c),
                _ => {}
            }
            if len == 0 {
                return Ok(());
            }
            off += (len + 3) & !3;
        }
    }
}

/// The conntrack mark bit of a connection cut under `enforce`
/// ([`cut_denied`]): the table's base chains drop every packet of an entry
/// that carries it, both ways, before any endpoint chain, counting each
/// (`cut-flow`); an ICMP error related to the entry carries its mark and
/// is dropped too. The only conntrack mark bit npm uses: it is set by an
/// update that keeps the other bits, and tested masked.
pub const CT_MARK_CUT: u32 = 0x0000_0040;

/// What [`act_on_picked`] does with an entry it picked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Act {
    /// Delete it.
    Delete,
    /// Set these bits of its mark (an update of the entry).
    Mark(u32),
}

/// Dumps, in the caller's network namespace, every conntrack entry (both
/// families) and deletes or marks (`act`) those for which `pick` (given the
/// original and the reply tuple and the entry's mark) returns something;
/// returns what it returned for each entry acted on (an entry gone
/// meanwhile is not an error, and not returned).
fn act_on_picked<T>(
    act: Act,
    mut pick: impl FnMut(&[Tuple], &[Tuple], u32) -> Option<T>,
) -> Result<Vec<T>, ConntrackError> {
    let err = |op| move |source| ConntrackError::Socket { op, source };
    let mut s = Socket::new(NETLINK_NETFILTER).map_err(err("create"))?;
    s.bind_auto().map_err(err("bind"))?;
    s.connect(&netlink_sys::SocketAddr::new(0, 0)).map_err(err("connect"))?;
    let _ = s.set_rx_buf_sz(4 << 20);
    let mut done = Vec::new();
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        let mut victims: Vec<(Vec<Tuple>, u32, T)> = Vec::new();
        let dump = request(family, ConntrackMessage::Get(Vec::new()), NLM_F_REQUEST | NLM_F_DUMP);
        exchange(&mut s, "dump", &dump, |c| {
            let ConntrackMessage::New(attrs) = c else { return };
            let (mut orig, mut reply, mut mark) = (None, None, 0);
            for a in attrs {
                match a {
                    ConntrackAttribute::CtaTupleOrig(t) => orig = Some(t),
                    ConntrackAttribute::CtaTupleReply(t) => reply = Some(t),
                    ConntrackAttribute::CtaMark(m) => mark = m,
                    _ => {}
                }
            }
            let Some(o) = orig else { return };
            let r = reply.unwrap_or_default();
            if let Some(v) = pick(&o, &r, mark) {
                victims.push((o, mark, v));
            }
        })?;
        for (t, mark, v) in victims {
            let (op, msg) = match act {
                Act::Delete => (
                    "delete",
                    ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(t)]),
                ),
                Act::Mark(bits) => (
                    "mark",
                    ConntrackMessage::New(vec![
                        ConntrackAttribute::CtaTupleOrig(t),
                        ConntrackAttribute::CtaMark(mark | bits),
                    ]),
                ),
            };
            let req = request(family, msg, NLM_F_REQUEST | NLM_F_ACK);
            match exchange(&mut s, op, &req, |_| {}) {
                Ok(()) => done.push(v),
                // ENOENT: gone meanwhile (expired, or deleted with its twin).
                Err(ConntrackError::Refused { code, .. }) if code == -libc::ENOENT => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(done)
}

/// Deletes, in the caller's network namespace, every conntrack entry whose
/// tuples name one of `addrs`. Returns how many were deleted.
fn flush_here(addrs: &[IpAddr]) -> Result<usize, ConntrackError> {
    let wanted: Vec<IpAddr> = addrs.iter().map(|a| a.to_canonical()).collect();
    let hit = |t: &[Tuple]| tuple_addrs(t).any(|x| wanted.contains(&x));
    Ok(act_on_picked(Act::Delete, |o, r, _| (hit(o) || hit(r)).then_some(()))?.len())
}

/// Runs `f` in `netns` (a name under `/run/netns`, on a thread of its own)
/// or, without one, in the caller's network namespace.
fn in_netns<T: Send>(
    netns: Option<&str>,
    f: impl FnOnce() -> Result<T, ConntrackError> + Send,
) -> Result<T, ConntrackError> {
    let Some(ns) = netns else {
        return f();
    };
    let ns_err = |source| ConntrackError::Netns {
        netns: ns.to_string(),
        source,
    };
    let file = std::fs::File::open(format!("/run/netns/{ns}")).map_err(ns_err)?;
    // A thread of its own enters the namespace and exits with it.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            // SAFETY: setns on this (scoped, short-lived) thread only.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(ns_err(io::Error::last_os_error()));
            }
            f()
        })
        .join()
        .unwrap_or_else(|_| Err(ns_err(io::Error::other("namespace thread panicked"))))
    })
}

/// Deletes every conntrack entry whose original or reply tuple names one of
/// `addrs`, in `netns` (a name under `/run/netns`) or the caller's network
/// namespace. Returns how many were deleted.
pub fn flush_addresses(netns: Option<&str>, addrs: &[IpAddr]) -> Result<usize, ConntrackError> {
    if addrs.is_empty() {
        return Ok(0);
    }
    in_netns(netns, || flush_here(addrs))
}

/// What connection semantics read of a conntrack entry: the protocol, the
/// original tuple's source (the opener, before any SNAT) and the reply
/// tuple (after kube-proxy's DNAT and masquerade: its source is the
/// destination the opener reached, its destination the source that
/// destination saw, its source port the destination port).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Flow {
    /// Protocol number.
    pub protocol: u8,
    /// The original tuple's source address.
    pub orig_src: IpAddr,
    /// The original tuple's source port (0 without ports).
    pub orig_sport: u16,
    /// The reply tuple's source address (the destination reached).
    pub reply_src: IpAddr,
    /// The reply tuple's destination address (the source it saw).
    pub reply_dst: IpAddr,
    /// The reply tuple's source port (the destination port reached; 0
    /// without ports).
    pub reply_sport: u16,
}

impl Flow {
    /// The flow of an entry's original and reply tuples, when both name
    /// their addresses.
    pub fn of(orig: &[Tuple], reply: &[Tuple]) -> Option<Flow> {
        let (osrc, _, proto, osport, _) = tuple_parts(orig)?;
        let (rsrc, rdst, _, rsport, _) = tuple_parts(reply)?;
        Some(Flow {
            protocol: proto,
            orig_src: osrc,
            orig_sport: osport,
            reply_src: rsrc,
            reply_dst: rdst,
            reply_sport: rsport,
        })
    }
}

/// (source, destination, protocol, source port, destination port) of a
/// tuple; ports 0 when it has none.
fn tuple_parts(t: &[Tuple]) -> Option<(IpAddr, IpAddr, u8, u16, u16)> {
    let (mut src, mut dst, mut proto, mut sport, mut dport) = (None, None, None, 0, 0);
    for part in t {
        match part {
            Tuple::Ip(ips) => {
                for ip in ips {
                    match ip {
                        IPTuple::SourceAddress(a) => src = Some(a.to_canonical()),
                        IPTuple::DestinationAddress(a) => dst = Some(a.to_canonical()),
                        _ => {}
                    }
                }
            }
            Tuple::Proto(ps) => {
                for p in ps {
                    match p {
                        ProtoTuple::Protocol(pr) => proto = Some(u8::from(*pr)),
                        ProtoTuple::SourcePort(x) => sport = *x,
                        ProtoTuple::DestinationPort(x) => dport = *x,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    Some((src?, dst?, proto?, sport, dport))
}

/// A tracked connection the current policy denies for an `enforce`
/// endpoint, whose conntrack entry is (to be) deleted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    /// The endpoint whose direction now denies.
    pub endpoint: u32,
    /// That direction.
    pub direction: Direction,
    /// The policy's reason (a deny reason).
    pub reason: Reason,
    /// The connection.
    pub flow: Flow,
}

/// The cut of `flow` under `c`, when one of the `enforce` endpoints of
/// `by_addr` (address -> endpoint id) opened it and its egress now denies
/// it, or received it and its ingress now denies it: the decision the
/// ruleset takes for a new connection, on the addresses it decides on
/// (egress: the destination after the DNAT; ingress: the opener's source
/// before any source NAT on this node, as the `_nat` chains decide a
/// masqueraded connection; a loopback opener, a node process, is decided
/// on the node address it was masqueraded to), by [`npm_policy::lookup`]
/// on `c`.
pub fn denied(c: &Compiled, by_addr: &BTreeMap<IpAddr, u32>, flow: &Flow) -> Option<Cut> {
    let port = match flow.protocol {
        6 | 17 | 132 => flow.reply_sport,
        _ => 0,
    };
    let check = |ep: u32, direction: Direction, peer: IpAddr| {
        let r = npm_policy::lookup::lookup(c, ep, direction, peer, flow.protocol, port);
        (!r.allowed).then_some(Cut {
            endpoint: ep,
            direction,
            reason: r.reason,
            flow: *flow,
        })
    };
    let egress = by_addr
        .get(&flow.orig_src)
        .and_then(|&ep| check(ep, Direction::Egress, flow.reply_src));
    egress.or_else(|| {
        by_addr.get(&flow.reply_src).and_then(|&ep| {
            let opener = if flow.orig_src.is_loopback() {
                flow.reply_dst
            } else {
                flow.orig_src
            };
            check(ep, Direction::Ingress, opener)
        })
    })
}

/// Connection semantics `enforce` on nftables: marks ([`CT_MARK_CUT`]), in
/// `netns` or the caller's network namespace, the conntrack entry of every
/// connection of an endpoint of `enforce` that `c` (the state just loaded)
/// denies ([`denied`]) and that is not cut yet: the table's base chains
/// drop its packets, both ways, until the entry times out. (Deleting the
/// entry would not do: the kernel picks a TCP connection up from any
/// segment, `nf_conntrack_tcp_loose`, so the first segment of the other
/// side, whose own policy may allow it, would open it again as a new
/// connection in its direction, and the cut side would pass as its
/// replies.) Returns the cuts.
pub fn cut_denied(netns: Option<&str>, c: &Compiled, enforce: &BTreeSet<u32>) -> Result<Vec<Cut>, ConntrackError> {
    let mut by_addr = BTreeMap::new();
    for (id, e) in c.endpoints.iter().filter(|(id, _)| enforce.contains(id)) {
        for a in [e.ipv4.map(IpAddr::V4), e.ipv6.map(IpAddr::V6)].into_iter().flatten() {
            by_addr.insert(a, *id);
        }
    }
    if by_addr.is_empty() {
        return Ok(Vec::new());
    }
    in_netns(netns, || {
        act_on_picked(Act::Mark(CT_MARK_CUT), |o, r, mark| {
            if mark & CT_MARK_CUT != 0 {
                return None;
            }
            Flow::of(o, r).and_then(|f| denied(c, &by_addr, &f))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_owners_are_the_addresses_gone_or_reowned() {
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let c: IpAddr = "10.0.0.3".parse().unwrap();
        let old = BTreeMap::from([(a, 1), (b, 2), (c, 3)]);
        let new = BTreeMap::from([(a, 1), (b, 9)]);
        assert_eq!(changed_owners(&old, &new), vec![b, c]);
        assert!(changed_owners(&new, &new).is_empty());
    }

    /// `denied`: the egress of the opener and the ingress of the
    /// receiver, on the addresses after the NAT (the reply tuple), each
    /// only for an `enforce` endpoint and only when the policy denies.
    #[test]
    fn denied_decides_the_connection_as_the_ruleset_would() {
        use npm_policy::compiled::{Endpoint, PodRef, PolicyEntry, TierPresence};
        use npm_policy::model::Protocol;
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let mut c = Compiled::default();
        for (id, addr, identity) in [(1u32, a, 256u32), (2, b, 300)] {
            c.endpoints.insert(
                id,
                Endpoint {
                    pod: PodRef {
                        namespace: "n".into(),
                        name: format!("p{id}"),
                        uid: format!("u{id}"),
                    },
                    identity,
                    ipv4: match addr {
                        IpAddr::V4(v) => Some(v),
                        _ => None,
                    },
                    ipv6: None,
                    isolated_ingress: id == 1,
                    isolated_egress: false,
                    tiers: TierPresence::default(),
                    report_new: false,
                },
            );
            c.ipcache.insert(
                addr,
                IpEntry {
                    identity,
                    cidr_identity: 0,
                    owner: 0,
                },
            );
        }
        let flow = Flow {
            protocol: 17,
            orig_src: b,
            orig_sport: 40000,
            reply_src: a,
            reply_dst: b,
            reply_sport: 5000,
        };
        let enforce_1 = BTreeMap::from([(a, 1)]);
        let cut = denied(&c, &enforce_1, &flow).expect("no allow: the ingress of 1 denies");
        assert_eq!(
            (cut.endpoint, cut.direction, cut.reason),
            (1, Direction::Ingress, Reason::PolicyDenied)
        );
        // The opener (2) is not isolated: under enforce alone it cuts nothing.
        assert_eq!(denied(&c, &BTreeMap::from([(b, 2)]), &flow), None);
        // An allow of UDP 5000 from 300: nothing to cut.
        c.policy.insert(
            PolicyEntry {
                subject: 256,
                direction: Direction::Ingress,
                peer: 300,
                protocol: Some(Protocol::Udp),
                ports: (5000, 5000),
            },
            1,
        );
        assert_eq!(denied(&c, &enforce_1, &flow), None);
        // Another port of the same peer is still denied.
        let other = Flow {
            reply_sport: 5001,
            ..flow
        };
        assert!(denied(&c, &enforce_1, &other).is_some());
        // Masqueraded to the node on the way in (a NodePort with
        // `externalTrafficPolicy: Cluster`): decided on the opener, as the
        // `_nat` chains decide it, never admitted as the host it became.
        let host: IpAddr = "10.0.255.1".parse().unwrap();
        c.ipcache.insert(
            host,
            IpEntry {
                identity: npm_common::IDENTITY_HOST,
                cidr_identity: 0,
                owner: 0,
            },
        );
        let masq = |opener: &str| Flow {
            orig_src: opener.parse().unwrap(),
            reply_dst: host,
            ..flow
        };
        assert!(denied(&c, &enforce_1, &masq("192.0.2.9")).is_some(), "a world opener");
        assert_eq!(denied(&c, &enforce_1, &masq(&b.to_string())), None, "the allowed pod");
        assert_eq!(denied(&c, &enforce_1, &masq("10.0.255.1")), None, "the node itself");
        assert_eq!(
            denied(&c, &enforce_1, &masq("127.0.0.1")),
            None,
            "a node process on localhost"
        );
    }

    /// Pods of other nodes count (their ipcache owner), nodes and the host
    /// do not (owner 0), local endpoints by their UID.
    #[test]
    fn owners_are_every_pod_address() {
        let mut c = Compiled::default();
        let entry = |owner| IpEntry {
            identity: 300,
            cidr_identity: 0,
            owner,
        };
        let remote: IpAddr = "10.0.1.2".parse().unwrap();
        let node: IpAddr = "192.168.0.2".parse().unwrap();
        c.ipcache.insert(remote, entry(IpEntry::pod_owner("r")));
        c.ipcache.insert(node, entry(0));
        assert_eq!(owners(&c), BTreeMap::from([(remote, IpEntry::pod_owner("r"))]));
    }
}
