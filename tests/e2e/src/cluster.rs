//! The netns cluster: every pod is a network namespace with a veth to the
//! root netns, its own IPv4 /32 and IPv6 /128, and small TCP/UDP servers on
//! ports 80 and 81 (plus a raw SCTP receiver for crafted-packet probes).
//!
//! Addresses follow the upstream model: namespace index `n` (x=1, y=2, z=3,
//! then the next free index) and pod index `p` (a=1, b=2, c=3, then the next
//! free one in that namespace) give `198.18.n.p` and `fd00:198:18::n:p`.
//!
//! With nodes ([`Cluster::with_nodes`], [`crate::nodes`]) the host side of
//! a pod is in the netns of the node owning its namespace's subnet, and
//! pods are wired either by hand-made veths or by the CNI chain
//! ([`crate::cni`], [`Cluster::create_pod_cni`]; DEL on removal). The
//! host-wide lock and forwarding state are in `cluster/host_state.rs`,
//! host-network pods (the node's addresses and netns) in
//! `cluster/host_network.rs`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::cni::{self, Attachment, CniError, NodeRuntime};
use crate::netns::{ip, ip_batch, NetnsError};
use crate::nodes::{run_in_netns, Fabric, NodeError, Nodes};
use crate::server::{PodServer, SctpLog, ServerError};

/// Prefix of every netns and host-side interface the cluster creates.
pub const NAME_PREFIX: &str = "npmc";

/// Port numbers every pod serves on (TCP, UDP; SCTP via the raw receiver).
pub const SERVED_PORTS: [u16; 2] = [80, 81];

/// The MAC address of every host-side veth (pods use a static neighbour
/// entry for the 169.254.1.1 gateway, so no ARP is needed for it).
const HOST_MAC: &str = "ee:ee:ee:ee:ee:ee";

mod host_network;
mod host_state;
use host_state::{cluster_lock_acquire, cluster_lock_release, forwarding_acquire, forwarding_release};

static INSTANCE: AtomicU32 = AtomicU32::new(0);

/// Errors of the netns cluster.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// A netns or link operation failed.
    #[error("pod {pod}: {source}")]
    Netns {
        /// The pod (`ns/name`) or "host".
        pod: String,
        /// The cause.
        source: NetnsError,
    },
    /// A pod's servers could not be started.
    #[error("pod {pod}: {source}")]
    Server {
        /// The pod (`ns/name`).
        pod: String,
        /// The cause.
        source: ServerError,
    },
    /// The pod exists already.
    #[error("pod {0} exists already")]
    PodExists(String),
    /// The pod does not exist.
    #[error("pod {0} does not exist")]
    NoSuchPod(String),
    /// Namespace or pod indexes ran out (36 per level).
    #[error("no free index for {0} (at most 35 namespaces and 35 pods per namespace)")]
    OutOfIndexes(String),
    /// The nodes or their fabric failed.
    #[error(transparent)]
    Node(#[from] NodeError),
    /// A CNI plugin failed.
    #[error(transparent)]
    Cni(Box<CniError>),
    /// The operation needs another wiring (e.g. a CNI pod without a uid).
    #[error("pod {pod}: {message}")]
    Wiring {
        /// The pod.
        pod: String,
        /// What is wrong.
        message: String,
    },
}

impl From<CniError> for ClusterError {
    fn from(e: CniError) -> Self {
        ClusterError::Cni(Box::new(e))
    }
}

/// How pods are wired to their node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodWiring {
    /// Hand-made veths with /32 and /128 routes (the default).
    Veth,
    /// The reference CNI plugins chained with npm-cni.
    Cni(cni::Wiring),
}

/// One pod of the cluster.
#[derive(Debug)]
pub struct PodNet {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Netns name (`npmc<pid><inst>-<ns>-<pod>`).
    pub netns: String,
    /// Host-side veth name.
    pub host_if: String,
    /// IPv4 address.
    pub ipv4: Ipv4Addr,
    /// IPv6 address.
    pub ipv6: Ipv6Addr,
    /// The node netns the host side lives in (`None`: the root netns).
    pub node_netns: Option<String>,
    /// The node's name (`None`: the single-node cluster in the root netns).
    pub node: Option<String>,
    /// The CNI attachment (CNI wiring).
    pub attachment: Option<Attachment>,
    server: Option<PodServer>,
    /// A host-network pod (`cluster/host_network.rs`): the node's
    /// addresses, `netns` is the node's, served by the node's servers.
    pub host_network: bool,
}

impl PodNet {
    /// `ns/name`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
    /// The name its servers log SCTP arrivals under: `ns/name`, or
    /// `host/<node>` for a host-network pod (`host/root` on the one-node
    /// cluster), whose node's servers answer for every such pod there.
    pub fn receiver(&self) -> String {
        if self.host_network {
            format!("host/{}", self.node.as_deref().unwrap_or("root"))
        } else {
            self.key()
        }
    }
    /// The pod's address of the given family.
    pub fn ip(&self, ipv6: bool) -> IpAddr {
        if ipv6 {
            IpAddr::V6(self.ipv6)
        } else {
            IpAddr::V4(self.ipv4)
        }
    }
}

/// The host-network pods' ports (`npm_sim::cases::HOST_NETWORK_PORTS`) as
/// an `ip_local_reserved_ports` range (`first-last`): reserved in every
/// netns such a pod's servers bind in, so that no outgoing connection takes
/// one of them as its ephemeral port first.
pub fn host_network_port_range() -> String {
    let p = npm_sim::cases::HOST_NETWORK_PORTS;
    debug_assert!(p.windows(2).all(|w| w[1] == w[0] + 1), "a contiguous range");
    format!("{}-{}", p[0], p[p.len() - 1])
}

/// The IPv4 address of pod index `p` in namespace index `n`.
pub fn pod_ipv4(n: u8, p: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 18, n, p)
}

/// The IPv6 address of pod index `p` in namespace index `n`
/// (`fd00:198:18::n:p`, the decimal digits written as hex groups).
pub fn pod_ipv6(n: u8, p: u8) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0x198, 0x18, 0, 0, 0, hexish(n), hexish(p))
}

/// `12` -> `0x12`: the group reads like the decimal index.
fn hexish(v: u8) -> u16 {
    u16::from_str_radix(&v.to_string(), 16).unwrap_or(v as u16)
}

/// The fixed index of the upstream namespaces and pods (x,y,z / a,b,c).
fn fixed_index(name: &str, table: &[&str]) -> Option<u8> {
    table.iter().position(|n| *n == name).map(|i| i as u8 + 1)
}

const B36: &[u8] = b"0123456789abcdefghijklmnopqrstuvwxyz";

/// The netns cluster. Dropping it tears everything down.
#[derive(Debug)]
pub struct Cluster {
    tag: String,
    ns_index: BTreeMap<String, u8>,
    pod_index: BTreeMap<(String, String), u8>,
    pods: BTreeMap<(String, String), PodNet>,
    owner: String,
    sctp: Arc<SctpLog>,
    next_if: u32,
    torn_down: bool,
    wiring: PodWiring,
    runtimes: Vec<NodeRuntime>,
    pod_mtu: Option<u32>,
    /// TCP/UDP ports the servers of pods created from now on listen on
    /// ([`SERVED_PORTS`] unless [`Cluster::set_served_ports`] changed them).
    served_ports: Vec<u16>,
    /// The servers of host-network pods, by node (`None`: the root netns).
    host_servers: BTreeMap<Option<u8>, (PodServer, host_network::HostServer)>,
    /// The one-node cluster's node interface (`cluster/host_network.rs`) exists.
    host_node_if: bool,
    /// npm-cni's `timeoutSeconds` for the next CNI pods (`None`: the
    /// list's own).
    npm_cni_timeout: Option<u64>,
    // Last: removed after the pods.
    nodes: Option<Nodes>,
}

impl Cluster {
    /// An empty cluster: clears leftovers of crashed earlier runs, turns on
    /// forwarding in the root netns (the values found before are restored
    /// when the last cluster of any process is torn down; they are kept in
    /// `/run/npm-e2e`).
    ///
    /// Clusters use the same pod addresses (the model's), so only one
    /// process at a time may have clusters: this waits for an exclusive
    /// host-wide lock (`/run/npm-e2e/cluster.lock`), held until the
    /// process's last cluster is torn down.
    pub fn new() -> Result<Self, ClusterError> {
        cluster_lock_acquire().map_err(host_err)?;
        clear_leftovers();
        let pid = std::process::id();
        let inst = INSTANCE.fetch_add(1, Ordering::SeqCst);
        // The instance letter is not a hex digit, so the pid (hex) before it
        // can be parsed back by the leftover cleaner.
        let letter = (b'g' + (inst % 20) as u8) as char;
        let tag = format!("{NAME_PREFIX}{pid:x}{letter}");
        let owner = format!("{pid}-{inst}");
        if let Err(e) = forwarding_acquire(&owner) {
            cluster_lock_release();
            return Err(host_err(e));
        }
        Ok(Cluster {
            tag,
            ns_index: BTreeMap::new(),
            pod_index: BTreeMap::new(),
            pods: BTreeMap::new(),
            owner,
            sctp: Arc::new(SctpLog::default()),
            next_if: 0,
            torn_down: false,
            wiring: PodWiring::Veth,
            runtimes: Vec::new(),
            pod_mtu: None,
            served_ports: SERVED_PORTS.to_vec(),
            host_servers: BTreeMap::new(),
            host_node_if: false,
            npm_cni_timeout: None,
            nodes: None,
        })
    }

    /// An empty cluster of `count` nodes ([`crate::nodes`]) on `fabric`
    /// whose pods are wired by `wiring` (with CNI wiring, `npm_cni` is the
    /// npm-cni binary). Pods get the fabric's MTU ([`Fabric::pod_mtu`]).
    pub fn with_nodes(
        count: usize,
        fabric: Fabric,
        wiring: PodWiring,
        npm_cni: &std::path::Path,
    ) -> Result<Self, ClusterError> {
        let mut c = Cluster::new()?;
        let nodes = Nodes::new(&c.tag, count, fabric)?;
        let mtu = fabric.pod_mtu();
        c.pod_mtu = mtu;
        if let PodWiring::Cni(w) = wiring {
            for node in nodes.nodes() {
                let list = cni::conflist(&nodes, node, w, mtu);
                c.runtimes.push(cni::node_runtime(node, list, npm_cni)?);
            }
        }
        c.wiring = wiring;
        c.nodes = Some(nodes);
        Ok(c)
    }

    /// The nodes (`None`: the single-node cluster in the root netns).
    pub fn nodes(&self) -> Option<&Nodes> {
        self.nodes.as_ref()
    }

    /// How pods are wired.
    pub fn wiring(&self) -> PodWiring {
        self.wiring
    }

    /// The node index (1-based) a pod at `v4` lives on: the owner of its
    /// namespace subnet (`198.18.n.0/24`).
    pub fn node_index_for(&self, v4: Ipv4Addr) -> Option<u8> {
        let nodes = self.nodes.as_ref()?;
        Some(Nodes::owner_of(nodes.nodes().len() as u8, v4.octets()[2]))
    }

    /// The node's name for a pod at `v4` (`None` without nodes).
    pub fn node_name_for(&self, v4: Ipv4Addr) -> Option<String> {
        let k = self.node_index_for(v4)?;
        self.nodes.as_ref()?.node(k).map(|n| n.name.clone())
    }

    /// Creates a pod wired by the CNI chain on its node: netns, ADD (the
    /// result cached), servers. `uid` is the Pod object's uid.
    pub fn create_pod_cni(
        &mut self,
        ns: &str,
        name: &str,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        uid: &str,
    ) -> Result<&PodNet, ClusterError> {
        self.create_pod_cni_on(ns, name, v4, v6, uid, None)
    }

    /// As [`Cluster::create_pod_cni`], on node `on` (1-based) when given.
    /// An address of another node's subnet (an address moved between
    /// nodes, as some IPAMs do) is asked from that subnet's range by the
    /// node's chain, and routed to the node by the others
    /// ([`Nodes::route_address`]; [`Cluster::delete_pod`] takes the routes
    /// back).
    pub fn create_pod_cni_on(
        &mut self,
        ns: &str,
        name: &str,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        uid: &str,
        on: Option<u8>,
    ) -> Result<&PodNet, ClusterError> {
        let key = format!("{ns}/{name}");
        let k = (ns.to_string(), name.to_string());
        if self.pods.contains_key(&k) {
            return Err(ClusterError::PodExists(key));
        }
        let owner = self.node_index_for(v4).ok_or_else(|| ClusterError::Wiring {
            pod: key.clone(),
            message: "CNI pods need nodes".into(),
        })?;
        let node_k = on.unwrap_or(owner);
        let runtime = self
            .runtimes
            .get(node_k as usize - 1)
            .cloned()
            .ok_or_else(|| ClusterError::Wiring {
                pod: key.clone(),
                message: "the cluster does not wire pods with CNI".into(),
            })?;
        let netns = format!("{}-{}-{}", self.tag, ns, name);
        let err = |source| ClusterError::Netns {
            pod: key.clone(),
            source,
        };
        let _ = ip(&["netns", "del", &netns]);
        ip(&["netns", "add", &netns]).map_err(err)?;
        let prep = ip_batch(Some(&netns), &["link set lo up".into()]).and_then(|_| {
            run_in_netns(
                &netns,
                &[
                    "sysctl",
                    "-qw",
                    "net.ipv6.conf.all.accept_dad=0",
                    "net.ipv6.conf.default.accept_dad=0",
                ],
            )
        });
        if let Err(e) = prep {
            let _ = ip(&["netns", "del", &netns]);
            return Err(err(e));
        }
        let mut att = Attachment::new(&runtime, &netns, ns, name, uid, v4, v6);
        if let Some(secs) = self.npm_cni_timeout {
            att.conflist = crate::cni::with_npm_cni_timeout(&att.conflist, secs);
        }
        if node_k != owner {
            if self.wiring != PodWiring::Cni(crate::cni::Wiring::Ptp) {
                let _ = ip(&["netns", "del", &netns]);
                return Err(ClusterError::Wiring {
                    pod: key,
                    message: "an address on another node than its subnet's needs ptp wiring".into(),
                });
            }
            att.conflist = crate::cni::with_only_subnet(&att.conflist, v4.octets()[2]);
            if let Some(nodes) = self.nodes.as_ref() {
                if let Err(e) = nodes.route_address(node_k, v4, v6) {
                    let _ = ip(&["netns", "del", &netns]);
                    return Err(err(e));
                }
            }
        }
        if let Err(e) = att.add() {
            let _ = ip(&["netns", "del", &netns]);
            return Err(e.into());
        }
        // The veth is the last host-side interface (`bridge` lists the
        // bridge first).
        let host_if = att.host_interfaces().pop().unwrap_or_default();
        let mut pod = PodNet {
            namespace: ns.to_string(),
            name: name.to_string(),
            netns: netns.clone(),
            host_if,
            ipv4: v4,
            ipv6: v6,
            node_netns: Some(runtime.netns.clone()),
            node: Some(runtime.node.clone()),
            attachment: Some(att),
            server: None,
            host_network: false,
        };
        match PodServer::start(&netns, &key, &self.served_ports, self.sctp.clone()) {
            Ok(s) => pod.server = Some(s),
            Err(source) => {
                let _ = remove_pod(&mut pod);
                return Err(ClusterError::Server { pod: key, source });
            }
        }
        self.pods.insert(k.clone(), pod);
        Ok(&self.pods[&k])
    }

    /// Builds a cluster with the given pods (`(namespace, pod)` pairs).
    pub fn with_pods(pods: &[(&str, &str)]) -> Result<Self, ClusterError> {
        let mut c = Cluster::new()?;
        for (ns, name) in pods {
            c.create_pod(ns, name)?;
        }
        Ok(c)
    }

    /// The upstream cluster: namespaces x, y, z with pods a, b, c each.
    pub fn upstream() -> Result<Self, ClusterError> {
        let mut pods = Vec::new();
        for ns in ["x", "y", "z"] {
            for p in ["a", "b", "c"] {
                pods.push((ns, p));
            }
        }
        Cluster::with_pods(&pods)
    }

    /// The shared log of received SCTP packets.
    pub fn sctp_log(&self) -> Arc<SctpLog> {
        self.sctp.clone()
    }

    fn namespace_index(&mut self, ns: &str) -> Result<u8, ClusterError> {
        if let Some(i) = self.ns_index.get(ns) {
            return Ok(*i);
        }
        let i = match fixed_index(ns, &["x", "y", "z"]) {
            Some(i) => i,
            None => (4..36u8)
                .find(|i| !self.ns_index.values().any(|v| v == i))
                .ok_or_else(|| ClusterError::OutOfIndexes(format!("namespace {ns}")))?,
        };
        self.ns_index.insert(ns.to_string(), i);
        Ok(i)
    }

    fn pod_idx(&mut self, ns: &str, name: &str) -> Result<u8, ClusterError> {
        let k = (ns.to_string(), name.to_string());
        if let Some(i) = self.pod_index.get(&k) {
            return Ok(*i);
        }
        let i = match fixed_index(name, &["a", "b", "c"]) {
            Some(i) => i,
            None => (4..36u8)
                .find(|i| !self.pod_index.iter().any(|((n, _), v)| n == ns && v == i))
                .ok_or_else(|| ClusterError::OutOfIndexes(format!("pod {ns}/{name}")))?,
        };
        self.pod_index.insert(k, i);
        Ok(i)
    }

    /// npm-cni's `timeoutSeconds` for the CNI pods created from now on
    /// (`None`: the list's own, 10 s).
    pub fn set_npm_cni_timeout(&mut self, secs: Option<u64>) {
        self.npm_cni_timeout = secs;
    }

    /// The TCP/UDP ports the servers of pods created from now on listen on
    /// (the conformance runner sets its topology's; SCTP is answered on
    /// every port).
    pub fn set_served_ports(&mut self, ports: &[u16]) {
        self.served_ports = ports.to_vec();
    }

    /// The address a pod has (or would get), without creating it.
    pub fn address_of(&mut self, ns: &str, name: &str) -> Result<(Ipv4Addr, Ipv6Addr), ClusterError> {
        let n = self.namespace_index(ns)?;
        let p = self.pod_idx(ns, name)?;
        Ok((pod_ipv4(n, p), pod_ipv6(n, p)))
    }

    /// Creates a pod at the cluster's own address for it (upstream indexes:
    /// x,y,z / a,b,c, then the next free index).
    pub fn create_pod(&mut self, ns: &str, name: &str) -> Result<&PodNet, ClusterError> {
        if self.pods.contains_key(&(ns.to_string(), name.to_string())) {
            return Err(ClusterError::PodExists(format!("{ns}/{name}")));
        }
        let (v4, v6) = self.address_of(ns, name)?;
        self.create_pod_at(ns, name, v4, v6)
    }

    /// Creates a pod with the given addresses: netns, veth, addresses,
    /// routes, servers (on the node owning the address's namespace subnet,
    /// with nodes).
    pub fn create_pod_at(&mut self, ns: &str, name: &str, v4: Ipv4Addr, v6: Ipv6Addr) -> Result<&PodNet, ClusterError> {
        self.create_pod_at_node(ns, name, v4, v6, None)
    }

    /// As [`Cluster::create_pod_at`], on node `node` (1-based) when given:
    /// an address that moved to a node other than its subnet's owner gets
    /// /32 and /128 routes to that node on the others and in the root netns
    /// (as when a pod CIDR block or a VPC address moves between nodes).
    pub fn create_pod_at_node(
        &mut self,
        ns: &str,
        name: &str,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        node: Option<u8>,
    ) -> Result<&PodNet, ClusterError> {
        let key = format!("{ns}/{name}");
        let k = (ns.to_string(), name.to_string());
        if self.pods.contains_key(&k) {
            return Err(ClusterError::PodExists(key));
        }
        if self.next_if >= 36 * 36 {
            return Err(ClusterError::OutOfIndexes(format!("interface for pod {key}")));
        }
        if self.wiring != PodWiring::Veth {
            return Err(ClusterError::Wiring {
                pod: key,
                message: "the cluster wires pods with CNI: use create_pod_cni".into(),
            });
        }
        let node_k = node.or_else(|| self.node_index_for(v4));
        let node_netns = node_k
            .and_then(|k| self.nodes.as_ref()?.node(k))
            .map(|n| n.netns.clone());
        let node_name = node_k
            .and_then(|k| self.nodes.as_ref()?.node(k))
            .map(|n| n.name.clone());
        if let (Some(k), Some(nodes)) = (node_k, self.nodes.as_ref()) {
            nodes.route_address(k, v4, v6).map_err(|source| ClusterError::Netns {
                pod: key.clone(),
                source,
            })?;
        }
        let ifn = self.next_if;
        self.next_if += 1;
        let netns = format!("{}-{}-{}", self.tag, ns, name);
        let host_if = format!(
            "{}{}{}",
            self.tag,
            B36[(ifn / 36) as usize] as char,
            B36[(ifn % 36) as usize] as char
        );
        let err = |source| ClusterError::Netns {
            pod: key.clone(),
            source,
        };
        // Remove any stale object of the same name (a pod deleted and
        // recreated, or an earlier run of this very pid).
        let nn = node_netns.as_deref();
        let mtu = self.pod_mtu.map(|m| format!("mtu {m} ")).unwrap_or_default();
        let host_ip = |args: &[&str]| -> Result<String, NetnsError> {
            match nn {
                Some(n) => {
                    let mut all = vec!["-n", n];
                    all.extend_from_slice(args);
                    ip(&all)
                }
                None => ip(args),
            }
        };
        let _ = ip(&["netns", "del", &netns]);
        let _ = host_ip(&["link", "del", &host_if]);
        ip(&["netns", "add", &netns]).map_err(err)?;
        let mut pod = PodNet {
            namespace: ns.to_string(),
            name: name.to_string(),
            netns: netns.clone(),
            host_if: host_if.clone(),
            ipv4: v4,
            ipv6: v6,
            node_netns: node_netns.clone(),
            node: node_name,
            attachment: None,
            server: None,
            host_network: false,
        };
        let setup = || -> Result<(), NetnsError> {
            let host = vec![
                format!("link add {host_if} {mtu}address {HOST_MAC} type veth peer name eth0 {mtu}netns {netns}"),
                format!("link set {host_if} up"),
                format!("addr add fe80::1/64 dev {host_if} nodad"),
                format!("route replace {v4}/32 dev {host_if} scope link"),
            ];
            ip_batch(nn, &host)?;
            let inside = vec![
                "link set lo up".to_string(),
                "link set eth0 up".to_string(),
                format!("addr add {v4}/32 dev eth0"),
                format!("addr add {v6}/128 dev eth0 nodad"),
                format!("neigh replace 169.254.1.1 lladdr {HOST_MAC} dev eth0 nud permanent"),
                format!("neigh replace fe80::1 lladdr {HOST_MAC} dev eth0 nud permanent"),
                "route add default via 169.254.1.1 dev eth0 onlink".to_string(),
                "route add default via fe80::1 dev eth0".to_string(),
            ];
            ip_batch(Some(&netns), &inside)?;
            // The /128 route needs the link to be up in both ends; add it
            // after the batch.
            host_ip(&["-6", "route", "replace", &format!("{v6}/128"), "dev", &host_if])?;
            match nn {
                Some(n) => run_in_netns(n, &["sysctl", "-qw", &format!("net.ipv4.conf.{host_if}.proxy_arp=1")])?,
                None => {
                    let _ = std::fs::write(format!("/proc/sys/net/ipv4/conf/{host_if}/proxy_arp"), "1");
                }
            }
            Ok(())
        };
        if let Err(e) = setup() {
            let _ = ip(&["netns", "del", &netns]);
            let _ = host_ip(&["link", "del", &host_if]);
            return Err(err(e));
        }
        match PodServer::start(&netns, &key, &self.served_ports, self.sctp.clone()) {
            Ok(s) => pod.server = Some(s),
            Err(source) => {
                let _ = ip(&["netns", "del", &netns]);
                let _ = host_ip(&["link", "del", &host_if]);
                return Err(ClusterError::Server { pod: key, source });
            }
        }
        self.pods.insert(k.clone(), pod);
        Ok(&self.pods[&k])
    }

    /// Deletes a pod: stops its servers, deletes its netns and veth.
    pub fn delete_pod(&mut self, ns: &str, name: &str) -> Result<(), ClusterError> {
        let k = (ns.to_string(), name.to_string());
        let mut pod = self
            .pods
            .remove(&k)
            .ok_or_else(|| ClusterError::NoSuchPod(format!("{ns}/{name}")))?;
        if pod.host_network {
            self.release_host_network_pod(&pod);
            return Ok(());
        }
        let removed = remove_pod(&mut pod).map_err(|source| ClusterError::Netns {
            pod: format!("{ns}/{name}"),
            source,
        });
        // A pod on another node than its address's subnet owner: the
        // address goes back to its owner's routes, unless another pod
        // holds it now (a pod on its owner node never moved the routes).
        if let (Some(nodes), Some(owner)) = (self.nodes.as_ref(), self.node_index_for(pod.ipv4)) {
            let owner_name = nodes.node(owner).map(|n| n.name.clone());
            let moved = pod.node.is_some() && pod.node != owner_name;
            let held = self.pods.values().any(|p| p.ipv4 == pod.ipv4);
            if moved && !held {
                let _ = nodes.route_address(owner, pod.ipv4, pod.ipv6);
            }
        }
        removed
    }

    /// The pod `ns/name`, if it exists.
    pub fn pod(&self, ns: &str, name: &str) -> Option<&PodNet> {
        self.pods.get(&(ns.to_string(), name.to_string()))
    }

    /// All pods, by (namespace, name).
    pub fn pods(&self) -> impl Iterator<Item = &PodNet> {
        self.pods.values()
    }

    /// Tears everything down: pods, veths, netns, sysctls.
    pub fn teardown(mut self) -> Result<(), ClusterError> {
        self.teardown_inner()
    }

    fn teardown_inner(&mut self) -> Result<(), ClusterError> {
        if self.torn_down {
            return Ok(());
        }
        self.torn_down = true;
        let mut first_err = None;
        for (_, mut pod) in std::mem::take(&mut self.pods) {
            if pod.host_network {
                continue;
            }
            if let Err(source) = remove_pod(&mut pod) {
                first_err.get_or_insert(ClusterError::Netns { pod: pod.key(), source });
            }
        }
        self.teardown_host_network();
        if let Some(mut nodes) = self.nodes.take() {
            nodes.teardown();
        }
        if let Err(source) = forwarding_release(&self.owner) {
            first_err.get_or_insert(host_err(source));
        }
        cluster_lock_release();
        match first_err {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if let Err(e) = self.teardown_inner() {
            eprintln!("npm-e2e: cluster teardown: {e}");
        }
    }
}

fn host_err(source: NetnsError) -> ClusterError {
    ClusterError::Netns {
        pod: "host".into(),
        source,
    }
}

fn remove_pod(pod: &mut PodNet) -> Result<(), NetnsError> {
    // Close the sockets first: they hold references on the netns.
    if let Some(s) = pod.server.take() {
        s.stop();
    }
    // A runtime's DEL: the chain in reverse order, then the cache entry.
    let mut del_err = None;
    if let Some(att) = pod.attachment.as_mut() {
        if let Err(e) = att.del() {
            eprintln!("npm-e2e: CNI DEL of {}: {e}", pod.key());
            del_err = Some(e);
        }
    }
    let r = ip(&["netns", "del", &pod.netns]);
    // Deleting the netns destroys eth0 and with it the host end; make sure.
    if pod.attachment.is_none() {
        match &pod.node_netns {
            Some(n) => {
                let _ = ip(&["-n", n, "link", "del", &pod.host_if]);
            }
            None => {
                let _ = ip(&["link", "del", &pod.host_if]);
            }
        }
    }
    r.map(|_| ())?;
    match del_err {
        Some(e) => Err(NetnsError::Ip {
            args: format!("CNI DEL of {}", pod.key()),
            stderr: e.to_string(),
        }),
        None => Ok(()),
    }
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Parses the pid out of a `npmc<hex pid><letter>...` name (netns, links
/// and per-node directories of a cluster).
pub fn owner_pid_of(name: &str) -> Option<u32> {
    owner_pid(name)
}

/// Parses the pid out of a `npmc<hex pid><letter>...` name.
fn owner_pid(name: &str) -> Option<u32> {
    let rest = name.strip_prefix(NAME_PREFIX)?;
    let hex: String = rest.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
    if hex.is_empty() || hex.len() == rest.len() {
        return None;
    }
    u32::from_str_radix(&hex, 16).ok()
}

/// Removes netns and links left behind by a crashed earlier run (a name with
/// our prefix whose owning process is gone).
pub fn clear_leftovers() {
    if let Ok(list) = ip(&["netns", "list"]) {
        for line in list.lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            if let Some(pid) = owner_pid(name) {
                if !pid_alive(pid) {
                    let _ = ip(&["netns", "del", name]);
                }
            }
        }
    }
    if let Ok(list) = ip(&["-o", "link", "show"]) {
        for line in list.lines() {
            // "12: npmc1a2bgxa@if2: <...>"
            let name = line
                .split(':')
                .nth(1)
                .map(|s| s.trim().split('@').next().unwrap_or(""))
                .unwrap_or("");
            if let Some(pid) = owner_pid(name) {
                if !pid_alive(pid) {
                    let _ = ip(&["link", "del", name]);
                }
            }
        }
    }
}

/// Netns names with our prefix that belong to this process (for tests that
/// check teardown).
pub fn own_netns() -> Vec<String> {
    let pid = std::process::id();
    ip(&["netns", "list"])
        .map(|l| {
            l.lines()
                .filter_map(|line| line.split_whitespace().next())
                .filter(|n| owner_pid(n) == Some(pid))
                .map(str::to_string)
                .collect()
        })
        .unwrap_or_default()
}

/// Links with our prefix that belong to this process.
pub fn own_links() -> Vec<String> {
    let pid = std::process::id();
    ip(&["-o", "link", "show"])
        .map(|l| {
            l.lines()
                .filter_map(|line| line.split(':').nth(1))
                .map(|s| s.trim().split('@').next().unwrap_or("").to_string())
                .filter(|n| owner_pid(n) == Some(pid))
                .collect()
        })
        .unwrap_or_default()
}
