//! This node's own addresses: identity HOST in the compiled policy.
//!
//! They are read through netlink (an `RTM_GETADDR` dump: every global-scope
//! address of every interface but the interfaces that hold Service
//! addresses, see [`service_address_link`]) and kept current: a thread subscribed to the
//! IPv4 and IPv6 address groups reads them again after every change (and
//! after lost notifications), and publishes a new set when it differs.
//! When they cannot be read, the last good set stays in force and
//! [`NodeAddresses::readiness_problem`] says why the agent is not ready;
//! "no addresses" is never published for a failed read.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::watch;

use super::netlink::{self, LinkKind, Netlink, NetlinkError};

/// `RTNLGRP_IPV4_IFADDR`.
const GROUP_IPV4_IFADDR: u32 = 5;
/// `RTNLGRP_IPV6_IFADDR`.
const GROUP_IPV6_IFADDR: u32 = 9;
/// How often the watcher wakes up without a notification (to retry a
/// failed read and to see whether its handles are gone).
const TICK: Duration = Duration::from_millis(500);

/// Interfaces that hold Service addresses by name, whatever their kind:
/// kube-proxy's IPVS mode puts every ClusterIP (and externalIP,
/// LoadBalancer IP) on `kube-ipvs0`, kube-router's service proxy on
/// `kube-dummy-if`, and NodeLocal DNSCache its listen addresses (169.254.20.10
/// and, beside kube-proxy in iptables mode, the cluster DNS ClusterIP) on
/// `nodelocaldns` (its default `-interfacename`).
pub const SERVICE_ADDRESS_LINKS: [&str; 3] = ["kube-ipvs0", "kube-dummy-if", "nodelocaldns"];

/// Why the addresses of interface `name` of kind `kind` are not this
/// node's own (`None`: they are): a name of [`SERVICE_ADDRESS_LINKS`], or
/// a `dummy` interface (`IFLA_INFO_KIND`), where the Service proxies and
/// node-local caches above keep their virtual addresses. Traffic to such
/// an address is a Service's (DNATed or answered by a proxy), not the
/// node's: taking it as HOST would decide it as egress to the node, and
/// every Service change would recompile everything.
pub fn service_address_link(name: &str, kind: Option<&LinkKind>) -> Option<&'static str> {
    if let Some(known) = SERVICE_ADDRESS_LINKS.iter().find(|n| **n == name) {
        return Some(known);
    }
    match kind {
        Some(LinkKind::Other(k)) if k == "dummy" => Some("a dummy interface"),
        _ => None,
    }
}

/// The node's addresses of one read and the global addresses left out.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressRead {
    /// This node's addresses, sorted, without duplicates.
    pub addresses: Vec<IpAddr>,
    /// Addresses left out (on an interface of [`service_address_link`]),
    /// with the interface's name, sorted.
    pub left_out: Vec<(IpAddr, String)>,
}

/// Read this node's addresses once: every global-scope address of every
/// interface but those of [`service_address_link`], sorted, without
/// duplicates.
pub fn read_addresses(nl: &mut Netlink) -> Result<Vec<IpAddr>, NetlinkError> {
    Ok(read_node_addresses(nl)?.addresses)
}

/// [`read_addresses`], with the addresses left out.
pub fn read_node_addresses(nl: &mut Netlink) -> Result<AddressRead, NetlinkError> {
    // Addresses first: every link that holds one of them exists before
    // its address, so the link dump after knows it (a link deleted in
    // between takes its addresses along; the notification rereads).
    let all = nl.addresses()?;
    let links = nl.links()?;
    let mut kept = BTreeSet::new();
    let mut left_out = BTreeSet::new();
    for a in all.into_iter().filter(|a| a.global) {
        let skip = links
            .get(&a.index)
            .filter(|l| service_address_link(&l.name, l.kind.as_ref()).is_some());
        match skip {
            Some(l) => {
                left_out.insert((a.ip, l.name.clone()));
            }
            None => {
                kept.insert(a.ip);
            }
        }
    }
    Ok(AddressRead {
        addresses: kept.into_iter().collect(),
        left_out: left_out.into_iter().collect(),
    })
}

/// What the watcher publishes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AddressState {
    /// The last set read successfully (`None`: never read).
    pub addresses: Option<Arc<Vec<IpAddr>>>,
    /// Bumped each time `addresses` changes.
    pub generation: u64,
    /// Why the last read failed (`None`: it succeeded).
    pub problem: Option<String>,
}

/// A handle on the node address watcher (cheap to clone). The watcher
/// thread stops once every handle is dropped.
#[derive(Clone, Debug)]
pub struct NodeAddresses {
    rx: watch::Receiver<AddressState>,
}

impl NodeAddresses {
    /// Read the addresses of network namespace `netns` (a name under
    /// `/run/netns` or a path; `None`: the agent's own) and watch them.
    /// The first read is made before this returns; when it fails the
    /// handle reports the problem and the thread keeps retrying.
    pub fn watch(netns: Option<&str>) -> NodeAddresses {
        let (tx, rx) = watch::channel(AddressState::default());
        let netns = netns.map(str::to_string);
        // Subscribe before the first dump, so no change is missed.
        let events = open_events(netns.as_deref());
        let mut w = Watcher {
            tx,
            netns,
            nl: None,
            events,
        };
        w.reread();
        std::thread::Builder::new()
            .name("npm-node-addresses".into())
            .spawn(move || w.run())
            .expect("spawn the node address watcher");
        NodeAddresses { rx }
    }

    /// A fixed set (no watcher): for tests and for callers that know the
    /// addresses.
    pub fn fixed(addresses: Vec<IpAddr>) -> NodeAddresses {
        let (tx, rx) = watch::channel(AddressState {
            addresses: Some(Arc::new(addresses)),
            generation: 1,
            problem: None,
        });
        // The sender may go: the receiver keeps the last value.
        drop(tx);
        NodeAddresses { rx }
    }

    /// The current state (last good set, its generation, the read problem).
    pub fn state(&self) -> AddressState {
        self.rx.borrow().clone()
    }

    /// The last set read successfully (`None`: never read).
    pub fn current(&self) -> Option<Arc<Vec<IpAddr>>> {
        self.rx.borrow().addresses.clone()
    }

    /// Why the agent is not ready because of its node addresses, if it is
    /// not: `node addresses unreadable: <error>`.
    pub fn readiness_problem(&self) -> Option<String> {
        self.rx
            .borrow()
            .problem
            .as_ref()
            .map(|p| format!("node addresses unreadable: {p}"))
    }

    /// Wait until the state changes (`false`: the watcher is gone).
    pub async fn changed(&mut self) -> bool {
        self.rx.changed().await.is_ok()
    }
}

struct Watcher {
    tx: watch::Sender<AddressState>,
    netns: Option<String>,
    nl: Option<Netlink>,
    events: Result<netlink_sys::Socket, NetlinkError>,
}

fn open_events(netns: Option<&str>) -> Result<netlink_sys::Socket, NetlinkError> {
    let socket = netlink::socket_in(netns)?;
    for group in [GROUP_IPV4_IFADDR, GROUP_IPV6_IFADDR] {
        socket.add_membership(group).map_err(|source| NetlinkError::Io {
            op: "subscribe to address changes",
            source,
        })?;
    }
    netlink::set_recv_timeout(&socket, TICK)?;
    Ok(socket)
}

impl Watcher {
    /// Read the addresses; publish them when they changed, or the problem.
    fn reread(&mut self) {
        let result = match &mut self.nl {
            Some(nl) => read_node_addresses(nl),
            None => Netlink::open(self.netns.as_deref()).and_then(|mut nl| {
                let r = read_node_addresses(&mut nl);
                self.nl = Some(nl);
                r
            }),
        };
        match result {
            Ok(AddressRead { addresses, left_out }) => {
                self.tx.send_if_modified(|s| {
                    let mut changed = s.problem.take().is_some();
                    if s.addresses.as_deref() != Some(&addresses) {
                        tracing::info!(
                            node_ips = ?addresses,
                            service_addresses_left_out = left_out.len(),
                            "node addresses"
                        );
                        s.addresses = Some(Arc::new(addresses));
                        s.generation += 1;
                        changed = true;
                    }
                    changed
                });
            }
            Err(e) => {
                // A fresh socket next time.
                self.nl = None;
                let problem = e.to_string();
                self.tx.send_if_modified(|s| {
                    if s.problem.as_deref() == Some(problem.as_str()) {
                        return false;
                    }
                    tracing::error!(error = %problem, "node addresses unreadable; keeping the last good set");
                    s.problem = Some(problem);
                    true
                });
            }
        }
    }

    fn run(mut self) {
        let mut buf = vec![0u8; 64 * 1024];
        while !self.tx.is_closed() {
            let failed = self.tx.borrow().problem.is_some();
            let socket = match &self.events {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(error = %e, "address change notifications unavailable; retrying");
                    std::thread::sleep(TICK);
                    self.events = open_events(self.netns.as_deref());
                    // Changes may have been missed meanwhile.
                    self.reread();
                    continue;
                }
            };
            let mut b = &mut buf[..];
            match socket.recv(&mut b, 0) {
                Ok(_) => {
                    // Coalesce what else is queued, then read once.
                    loop {
                        let mut b = &mut buf[..];
                        if socket.recv(&mut b, libc::MSG_DONTWAIT).is_err() {
                            break;
                        }
                    }
                    self.reread();
                }
                Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => {
                    if failed {
                        self.reread();
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                    // Notifications were lost: read everything again.
                    self.reread();
                }
                Err(e) => {
                    self.events = Err(NetlinkError::Io {
                        op: "receive address changes",
                        source: e,
                    });
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_address_links_are_recognised_by_name_and_kind() {
        let dummy = LinkKind::Other("dummy".into());
        let bridge = LinkKind::Bridge;
        // kube-proxy's IPVS interface and NodeLocal DNSCache's, whatever
        // their kind (a dummy on a real node).
        assert_eq!(service_address_link("kube-ipvs0", Some(&dummy)), Some("kube-ipvs0"));
        assert_eq!(service_address_link("kube-ipvs0", Some(&bridge)), Some("kube-ipvs0"));
        assert_eq!(service_address_link("nodelocaldns", Some(&dummy)), Some("nodelocaldns"));
        assert_eq!(service_address_link("kube-dummy-if", None), Some("kube-dummy-if"));
        // Any dummy interface.
        assert_eq!(service_address_link("svc0", Some(&dummy)), Some("a dummy interface"));
        // The node's own interfaces.
        assert_eq!(service_address_link("eth0", None), None);
        assert_eq!(service_address_link("cni0", Some(&bridge)), None);
        assert_eq!(service_address_link("veth1", Some(&LinkKind::Veth)), None);
        assert_eq!(
            service_address_link("vxlan.calico", Some(&LinkKind::Other("vxlan".into()))),
            None
        );
        assert_eq!(
            service_address_link("kube-ipvs", Some(&LinkKind::Other("ifb".into()))),
            None
        );
    }
}
