//! Host-network pods (`spec.hostNetwork: true`) of the netns cluster: a
//! pod that has its node's addresses and whose servers run in the node's
//! own network namespace, as a kubelet runs such a pod.
//!
//! - The node: with nodes ([`crate::nodes`]) node `k`'s netns and fabric
//!   addresses; the one-node cluster's node is the root netns, whose node
//!   address is on an interface `<tag>-h` (one end of a veth pair whose
//!   other end `<tag>-hp` is in the root netns too), holding
//!   [`npm_sim::cases::node_addresses`]`(1)` (a fixed address, unlike the
//!   machine's own, so the model and the Node object can name it; removed
//!   on teardown, and by the leftover cleaner after a crash).
//! - The servers: one set per node, shared by every host-network pod there
//!   (two pods on one node share its ports, as they would share the node's
//!   sockets; upstream's scheduler never puts two of these pods on one
//!   node, the one-node cluster has to), started with the first pod and
//!   stopped with the last: TCP accept and UDP echo bound to the node
//!   addresses (a node netns has several addresses: an echo from a
//!   wildcard socket could leave from another one, which the probe's
//!   connected socket would not take; upstream binds its UDP servers to
//!   `status.hostIP` for the same reason), and a [`PodServer`] with no
//!   ports for its raw SCTP receivers, logging arrivals as
//!   [`PodNet::receiver`] (`host/<node>`).
//! - No veth, no netns of its own, no CNI call (a kubelet calls no CNI
//!   plugin for a host-network pod).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, TcpListener, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use super::{host_err, Cluster, ClusterError, PodNet};
use crate::netns::{ip, ip_batch, NetnsHandle};
use crate::server::{PodServer, ServerError};

impl Cluster {
    /// The interface holding the one-node cluster's node address.
    fn host_node_if_name(&self) -> String {
        format!("{}-h", self.tag)
    }

    /// The node addresses of node `node` (1-based; `None`: the one-node
    /// cluster, whose node interface is created on first use).
    pub fn host_address(&mut self, node: Option<u8>) -> Result<(Ipv4Addr, Ipv6Addr), ClusterError> {
        if let Some(k) = node {
            let n = self
                .nodes
                .as_ref()
                .and_then(|n| n.node(k))
                .ok_or_else(|| ClusterError::Wiring {
                    pod: format!("node {k}"),
                    message: "no such node".into(),
                })?;
            return Ok((n.ipv4, n.ipv6));
        }
        let [std::net::IpAddr::V4(v4), std::net::IpAddr::V6(v6)] = npm_sim::cases::node_addresses(1) else {
            unreachable!("node_addresses is (IPv4, IPv6)")
        };
        if !self.host_node_if {
            let dev = self.host_node_if_name();
            let _ = ip(&["link", "del", &dev]);
            // A veth pair with both ends here (no `dummy` module on every
            // kernel): the addresses on one end are local addresses.
            let lines = vec![
                format!("link add {dev} type veth peer name {dev}p"),
                format!("link set {dev}p up"),
                format!("link set {dev} up"),
                format!("addr add {v4}/32 dev {dev}"),
                format!("addr add {v6}/128 dev {dev} nodad"),
            ];
            if let Err(e) = ip_batch(None, &lines) {
                let _ = ip(&["link", "del", &dev]);
                return Err(host_err(e));
            }
            self.host_node_if = true;
        }
        Ok((v4, v6))
    }

    /// Creates host-network pod `ns/name` on node `node` (`None`: the
    /// one-node cluster): the node's addresses, the node's servers on
    /// `ports` (TCP and UDP; SCTP on every port), started if this is the
    /// node's first host-network pod.
    pub fn create_host_network_pod(
        &mut self,
        ns: &str,
        name: &str,
        node: Option<u8>,
        ports: &[u16],
    ) -> Result<&PodNet, ClusterError> {
        let key = format!("{ns}/{name}");
        let k = (ns.to_string(), name.to_string());
        if self.pods.contains_key(&k) {
            return Err(ClusterError::PodExists(key));
        }
        let (v4, v6) = self.host_address(node)?;
        let (netns, node_netns, node_name) = match node.and_then(|i| self.nodes.as_ref()?.node(i)) {
            Some(n) => (n.netns.clone(), Some(n.netns.clone()), Some(n.name.clone())),
            // The root netns: the runner's process is there (its probe and
            // server threads enter other netns, the main thread does not).
            None => (format!("/proc/{}/ns/net", std::process::id()), None, None),
        };
        let pod = PodNet {
            namespace: ns.to_string(),
            name: name.to_string(),
            netns: netns.clone(),
            host_if: String::new(),
            ipv4: v4,
            ipv6: v6,
            node_netns,
            node: node_name,
            attachment: None,
            server: None,
            host_network: true,
        };
        let receiver = pod.receiver();
        if !self.host_servers.contains_key(&node) {
            let sctp =
                PodServer::start(&netns, &receiver, &[], self.sctp.clone()).map_err(|source| ClusterError::Server {
                    pod: key.clone(),
                    source,
                })?;
            let addrs = [IpAddr::V4(v4), IpAddr::V6(v6)];
            let socks =
                HostServer::start(&netns, &addrs, ports).map_err(|source| ClusterError::Server { pod: key, source })?;
            self.host_servers.insert(node, (sctp, socks));
        }
        self.pods.insert(k.clone(), pod);
        Ok(&self.pods[&k])
    }

    /// Forgets host-network pod `pod` (removed from the pod table): stops
    /// its node's servers when no other host-network pod is left there.
    pub(super) fn release_host_network_pod(&mut self, pod: &PodNet) {
        let node = self.node_index_of(pod);
        let others = self
            .pods
            .values()
            .any(|p| p.host_network && self.node_index_of(p) == node);
        if !others {
            if let Some((sctp, socks)) = self.host_servers.remove(&node) {
                sctp.stop();
                drop(socks);
            }
        }
    }

    fn node_index_of(&self, pod: &PodNet) -> Option<u8> {
        let nodes = self.nodes.as_ref()?;
        let name = pod.node.as_deref()?;
        nodes.nodes().iter().find(|n| n.name == name).map(|n| n.index)
    }

    /// Stops every host-network server and removes the node
    /// interface (teardown).
    pub(super) fn teardown_host_network(&mut self) {
        for (_, (sctp, socks)) in std::mem::take(&mut self.host_servers) {
            sctp.stop();
            drop(socks);
        }
        if std::mem::take(&mut self.host_node_if) {
            let _ = ip(&["link", "del", &self.host_node_if_name()]);
        }
    }
}

/// TCP accept and UDP echo on `ports` of the node addresses, on one thread
/// inside the node's netns; stopped on drop.
#[derive(Debug)]
pub(super) struct HostServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

fn bind_all(addrs: &[IpAddr], ports: &[u16]) -> Result<(Vec<TcpListener>, Vec<UdpSocket>), ServerError> {
    let (mut tcp, mut udp) = (Vec::new(), Vec::new());
    for &a in addrs {
        for &p in ports {
            let sock = |what: &str, source| ServerError::Socket {
                what: format!("{what} {a}:{p} (host network)"),
                source,
            };
            let l = TcpListener::bind((a, p)).map_err(|e| sock("tcp", e))?;
            l.set_nonblocking(true).map_err(|e| sock("tcp", e))?;
            tcp.push(l);
            let u = UdpSocket::bind((a, p)).map_err(|e| sock("udp", e))?;
            u.set_nonblocking(true).map_err(|e| sock("udp", e))?;
            udp.push(u);
        }
    }
    Ok((tcp, udp))
}

impl HostServer {
    fn start(netns: &str, addrs: &[IpAddr], ports: &[u16]) -> Result<HostServer, ServerError> {
        let handle = NetnsHandle::open(netns)?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let (tx, rx) = mpsc::channel();
        let (addrs, ports) = (addrs.to_vec(), ports.to_vec());
        let thread = std::thread::Builder::new()
            .name("srv-host-network".into())
            .spawn(move || {
                let socks = handle
                    .enter()
                    .map_err(ServerError::from)
                    .and_then(|_| bind_all(&addrs, &ports));
                let (tcp, udp) = match socks {
                    Ok(s) => {
                        let _ = tx.send(Ok(()));
                        s
                    }
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                let mut buf = [0u8; 2048];
                // Non-blocking sockets, polled every 2 ms: a handful of
                // sockets for the few probes of the node-peer cases.
                while !stop2.load(Ordering::Relaxed) {
                    for l in &tcp {
                        // Accept and close: the probe only needs the handshake.
                        while let Ok((conn, _)) = l.accept() {
                            drop(conn);
                        }
                    }
                    for u in &udp {
                        while let Ok((n, from)) = u.recv_from(&mut buf) {
                            let _ = u.send_to(&buf[..n], from);
                        }
                    }
                    std::thread::sleep(Duration::from_millis(2));
                }
            })
            .map_err(|source| ServerError::Socket {
                what: "spawning the host-network server thread".into(),
                source,
            })?;
        match rx.recv() {
            Ok(Ok(())) => Ok(HostServer {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err(ServerError::Thread("host network".into())),
        }
    }
}

impl Drop for HostServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
