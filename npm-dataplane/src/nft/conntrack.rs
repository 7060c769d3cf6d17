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
//! The entries are found by a dump of the table (both families) and
//! deleted one by one by their original tuple, echoed as the kernel
//! dumped it (every protocol's tuple, ICMP's id included, as it was).

use std::collections::BTreeMap;
use std::io;
use std::net::IpAddr;
use std::os::fd::AsRawFd;

use netlink_packet_core::{NetlinkHeader, NetlinkMessage, NetlinkPayload, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST};
use netlink_packet_netfilter::conntrack::{ConntrackAttribute, ConntrackMessage, IPTuple, Tuple};
use netlink_packet_netfilter::{NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily};
use netlink_sys::{protocols::NETLINK_NETFILTER, Socket};
use npm_policy::compiled::{Compiled, IpEntry};

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

/// Deletes, in the caller's network namespace, every conntrack entry whose
/// tuples name one of `addrs`. Returns how many were deleted (an entry
/// gone meanwhile is not an error).
fn flush_here(addrs: &[IpAddr]) -> Result<usize, ConntrackError> {
    let err = |op| move |source| ConntrackError::Socket { op, source };
    let mut s = Socket::new(NETLINK_NETFILTER).map_err(err("create"))?;
    s.bind_auto().map_err(err("bind"))?;
    s.connect(&netlink_sys::SocketAddr::new(0, 0)).map_err(err("connect"))?;
    let _ = s.set_rx_buf_sz(4 << 20);
    let wanted: Vec<IpAddr> = addrs.iter().map(|a| a.to_canonical()).collect();
    let mut deleted = 0;
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        let mut victims: Vec<Vec<Tuple>> = Vec::new();
        let dump = request(family, ConntrackMessage::Get(Vec::new()), NLM_F_REQUEST | NLM_F_DUMP);
        exchange(&mut s, "dump", &dump, |c| {
            let ConntrackMessage::New(attrs) = c else { return };
            let mut orig = None;
            let mut hit = false;
            for a in attrs {
                match a {
                    ConntrackAttribute::CtaTupleOrig(t) => {
                        hit |= tuple_addrs(&t).any(|x| wanted.contains(&x));
                        orig = Some(t);
                    }
                    ConntrackAttribute::CtaTupleReply(t) => {
                        hit |= tuple_addrs(&t).any(|x| wanted.contains(&x));
                    }
                    _ => {}
                }
            }
            if let (true, Some(t)) = (hit, orig) {
                victims.push(t);
            }
        })?;
        for t in victims {
            let del = request(
                family,
                ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(t)]),
                NLM_F_REQUEST | NLM_F_ACK,
            );
            match exchange(&mut s, "delete", &del, |_| {}) {
                Ok(()) => deleted += 1,
                // ENOENT: gone meanwhile (expired, or deleted with its twin).
                Err(ConntrackError::Refused { code, .. }) if code == -libc::ENOENT => {}
                Err(e) => return Err(e),
            }
        }
    }
    Ok(deleted)
}

/// Deletes every conntrack entry whose original or reply tuple names one of
/// `addrs`, in `netns` (a name under `/run/netns`) or the caller's network
/// namespace. Returns how many were deleted.
pub fn flush_addresses(netns: Option<&str>, addrs: &[IpAddr]) -> Result<usize, ConntrackError> {
    if addrs.is_empty() {
        return Ok(0);
    }
    let Some(ns) = netns else {
        return flush_here(addrs);
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
            flush_here(addrs)
        })
        .join()
        .unwrap_or_else(|_| Err(ns_err(io::Error::other("namespace thread panicked"))))
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
