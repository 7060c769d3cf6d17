//! Several nodes on one machine: every node is a network namespace joined
//! to the others by a fabric, with a private mount namespace of its own.
//!
//! - **Fabric** (routed, like kindnet without overlay): a netns
//!   `<tag>-fab` holding the bridge `br0`; each node's `eth0` is a veth
//!   whose peer is a port of that bridge, with the node address
//!   `10.99.0.<k>/24` and `fd00:99::<k>/64`. The root netns joins the
//!   bridge too (`10.99.0.254`, `fd00:99::fe`): it is the control plane
//!   (the test API server listens there) and reaches the agents' metrics.
//! - **Pod subnets**: namespace index `n` (the model's: x=1, y=2, z=3, …)
//!   has the subnets `198.18.n.0/24` and `fd00:198:18::n:0/112` (the
//!   model's pod addresses), owned by node `((n-1) mod N) + 1`; every node
//!   and the root netns route the subnets of the others via their node
//!   address. A node's pod CIDR is the union of its namespaces' subnets:
//!   with 3 nodes and the upstream model, node k holds exactly
//!   `198.18.k.0/24`. Keeping a namespace on one node keeps the
//!   catalogue's `${CIDR24:…}` placeholders meaning "that namespace", as
//!   on the one-node cluster.
//! - **Mount namespace**: a holder process (`sleep`) per node sits in the
//!   node's netns and in a private mount namespace (`unshare --mount
//!   --propagation slave`) where `/sys` is the node's own sysfs (so
//!   `/sys/class/net` lists the node's interfaces), `/sys/fs/bpf` the host's
//!   bpffs, and `/run/npm` and `/var/lib/cni` per-node directories. The
//!   agent and every CNI plugin of the node run there
//!   ([`Node::command`]), so they see what a real node would see and
//!   nothing of the other nodes.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::netns::{ip, ip_batch, NetnsError};

/// The address of the root netns (the control plane) on the fabric.
pub const CONTROL_V4: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 254);
/// The IPv6 address of the root netns on the fabric.
pub const CONTROL_V6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, 0xfe);
/// Where the per-node directories live (`<tag>-n<k>/`).
pub const NODES_DIR: &str = "/run/npm-e2e/nodes";
/// The highest namespace index whose subnets are routed.
pub const MAX_NS_INDEX: u8 = 35;

/// Errors of the node set.
#[derive(Debug, thiserror::Error)]
pub enum NodeError {
    /// A netns, link or route operation failed.
    #[error("node {node}: {source}")]
    Netns {
        /// The node name (or "fabric").
        node: String,
        /// The cause.
        source: NetnsError,
    },
    /// A per-node directory could not be made.
    #[error("node {node}: {path}: {source}")]
    Io {
        /// The node name.
        node: String,
        /// The path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The mount-namespace holder did not come up.
    #[error("node {node}: the mount namespace holder failed: {message}")]
    Holder {
        /// The node name.
        node: String,
        /// What happened.
        message: String,
    },
    /// Bad node count.
    #[error("--nodes must be between 1 and 9, not {0}")]
    Count(usize),
}

/// How the nodes are joined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fabric {
    /// Routed on the fabric bridge, no overlay (kindnet-like).
    Routed,
    /// A VXLAN overlay (`vxlan0`, VNI 42, UDP 4789, MTU 1450; static FDB
    /// and neighbour entries, as flannel's vxlan backend programs them)
    /// over the fabric bridge; pod subnets are routed over the overlay and
    /// pods get MTU 1450.
    Vxlan,
}

impl Fabric {
    /// The pods' MTU on this fabric (`None`: the default 1500).
    pub fn pod_mtu(self) -> Option<u32> {
        match self {
            Fabric::Routed => None,
            Fabric::Vxlan => Some(VXLAN_MTU),
        }
    }
}

/// The overlay's MTU (1500 minus the VXLAN encapsulation).
pub const VXLAN_MTU: u32 = 1450;

/// The overlay address and MAC of node `k`.
fn overlay(k: u8) -> (Ipv4Addr, Ipv6Addr, String) {
    (
        Ipv4Addr::new(10, 98, 0, k),
        Ipv6Addr::new(0xfd00, 0x98, 0, 0, 0, 0, 0, k as u16),
        format!("0e:00:00:00:00:{k:02x}"),
    )
}

/// One node: its netns, addresses and mount-namespace holder.
#[derive(Debug)]
pub struct Node {
    /// 1-based index.
    pub index: u8,
    /// The Node object's name (`node-<k>`).
    pub name: String,
    /// The node's netns name.
    pub netns: String,
    /// Node address on the fabric (IPv4).
    pub ipv4: Ipv4Addr,
    /// Node address on the fabric (IPv6).
    pub ipv6: Ipv6Addr,
    /// The per-node directory (`run-npm`, `var-lib-cni`, `bin`, …).
    pub dir: PathBuf,
    holder: Option<Child>,
}

impl Node {
    /// The node's `/run/npm` as the host sees it.
    pub fn run_npm(&self) -> PathBuf {
        self.dir.join("run-npm")
    }

    /// The node's `/var/lib/cni` as the host sees it.
    pub fn var_lib_cni(&self) -> PathBuf {
        self.dir.join("var-lib-cni")
    }

    /// The node's CNI plugin directory (`CNI_PATH`): the reference plugins
    /// and `npm-cni`, as symlinks.
    pub fn cni_bin(&self) -> PathBuf {
        self.dir.join("bin")
    }

    /// The pid of the process holding the node's mount namespace.
    pub fn holder_pid(&self) -> Option<u32> {
        self.holder.as_ref().map(Child::id)
    }

    /// A command that runs `program` inside the node: its netns and its
    /// private mount namespace (via `nsenter`, which execs `program` in
    /// place, so the child's pid is the program's).
    pub fn command(&self, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        if let Some(pid) = self.holder_pid() {
            cmd.args(enter_mount_args(pid));
        }
        cmd.arg(format!("--net=/run/netns/{}", self.netns))
            .arg("--")
            .arg(program);
        cmd
    }

    /// The node's addresses.
    pub fn addresses(&self) -> [IpAddr; 2] {
        [IpAddr::V4(self.ipv4), IpAddr::V6(self.ipv6)]
    }
}

/// `nsenter`'s arguments entering the mount namespace of the node holder
/// `holder`: the namespace, and the holder's root directory as the root.
/// Entering a mount namespace moves the root to the namespace's own root
/// mount; when the runner itself runs chrooted (the `cargo xtask vm`
/// guests: the Debian or host root is a `chroot` inside the initramfs),
/// that root is the initramfs and the program's path (the checkout) does not
/// exist there. The holder's root (`/proc/<holder>/root`) is the same tree
/// the runner sees, so paths resolve alike; without a chroot it is the
/// namespace's `/` and nothing changes. (The working directory is that
/// root, as without `--root`.)
pub fn enter_mount_args(holder: u32) -> [String; 2] {
    [
        format!("--mount=/proc/{holder}/ns/mnt"),
        format!("--root=/proc/{holder}/root"),
    ]
}

/// The nodes and their fabric. Dropping it removes them.
#[derive(Debug)]
pub struct Nodes {
    tag: String,
    fabric: String,
    root_if: String,
    nodes: Vec<Node>,
    torn_down: bool,
    /// Addresses routed to a node other than their subnet's owner.
    moved: std::sync::Mutex<std::collections::BTreeMap<Ipv4Addr, Ipv6Addr>>,
}

/// The IPv6 group that reads like the decimal index (`12` -> `0x12`).
fn hexish(v: u8) -> u16 {
    u16::from_str_radix(&v.to_string(), 16).unwrap_or(v as u16)
}

/// The IPv4 subnet of namespace index `n`.
pub fn ns_subnet_v4(n: u8) -> String {
    format!("198.18.{n}.0/24")
}

/// The IPv6 subnet of namespace index `n`.
pub fn ns_subnet_v6(n: u8) -> String {
    format!("fd00:198:18::{:x}:0/112", hexish(n))
}

/// The pod gateway of namespace index `n`'s subnets (an address pods never
/// get: the model's pod indexes stop at 35).
pub fn ns_gateways(n: u8) -> (String, String) {
    (format!("198.18.{n}.254"), format!("fd00:198:18::{:x}:fffe", hexish(n)))
}

impl Nodes {
    /// Builds `count` nodes named after `tag` (the cluster's unique prefix,
    /// which the leftover cleaner of [`crate::cluster`] recognises).
    pub fn new(tag: &str, count: usize, fabric_mode: Fabric) -> Result<Nodes, NodeError> {
        if !(1..=9).contains(&count) {
            return Err(NodeError::Count(count));
        }
        fabric_acquire();
        clear_leftover_holders();
        let fabric = format!("{tag}-fab");
        let root_if = format!("{tag}fr");
        let mut set = Nodes {
            tag: tag.to_string(),
            fabric: fabric.clone(),
            root_if: root_if.clone(),
            nodes: Vec::new(),
            torn_down: false,
            moved: Default::default(),
        };
        let ferr = |source| NodeError::Netns {
            node: "fabric".into(),
            source,
        };
        let _ = ip(&["netns", "del", &fabric]);
        let _ = ip(&["link", "del", &root_if]);
        ip(&["netns", "add", &fabric]).map_err(ferr)?;
        ip_batch(
            Some(&fabric),
            &[
                "link set lo up".into(),
                "link add br0 type bridge".into(),
                "link set br0 up".into(),
            ],
        )
        .map_err(ferr)?;
        ip_batch(
            None,
            &[
                format!("link add {root_if} type veth peer name ctl netns {fabric}"),
                format!("addr add {CONTROL_V4}/24 dev {root_if}"),
                format!("addr add {CONTROL_V6}/64 dev {root_if} nodad"),
                format!("link set {root_if} up"),
            ],
        )
        .map_err(ferr)?;
        ip_batch(
            Some(&fabric),
            &["link set ctl master br0".into(), "link set ctl up".into()],
        )
        .map_err(ferr)?;
        for k in 1..=count as u8 {
            let node = set.add_node(k)?;
            set.nodes.push(node);
        }
        if fabric_mode == Fabric::Vxlan {
            set.add_overlay()?;
        }
        // Routes to every namespace subnet: on each node (the ones it does
        // not own) and in the root netns.
        let count = count as u8;
        for n in 1..=MAX_NS_INDEX {
            let owner = Self::owner_of(count, n);
            let via4 = Ipv4Addr::new(10, 99, 0, owner);
            let via6 = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, owner as u16);
            let lines = vec![
                format!("route replace {} via {via4}", ns_subnet_v4(n)),
                format!("route replace {} via {via6}", ns_subnet_v6(n)),
            ];
            ip_batch(None, &lines).map_err(ferr)?;
            let (o4, o6, _) = overlay(owner);
            let node_lines = match fabric_mode {
                Fabric::Routed => lines.clone(),
                Fabric::Vxlan => vec![
                    format!("route replace {} via {o4} dev vxlan0 onlink", ns_subnet_v4(n)),
                    format!("route replace {} via {o6} dev vxlan0 onlink", ns_subnet_v6(n)),
                ],
            };
            for node in set.nodes.iter().filter(|nd| nd.index != owner) {
                ip_batch(Some(&node.netns), &node_lines).map_err(|source| NodeError::Netns {
                    node: node.name.clone(),
                    source,
                })?;
            }
        }
        Ok(set)
    }

    /// The VXLAN overlay: `vxlan0` on every node, static FDB entries and
    /// neighbours for the other nodes.
    fn add_overlay(&self) -> Result<(), NodeError> {
        for node in &self.nodes {
            let err = |source| NodeError::Netns {
                node: node.name.clone(),
                source,
            };
            let (a4, a6, mac) = overlay(node.index);
            let mut lines = vec![
                format!(
                    "link add vxlan0 address {mac} mtu {VXLAN_MTU} type vxlan id 42 local {} dstport 4789 nolearning dev eth0",
                    node.ipv4
                ),
                format!("addr add {a4}/24 dev vxlan0"),
                format!("addr add {a6}/64 dev vxlan0 nodad"),
                "link set vxlan0 up".into(),
            ];
            for other in self.nodes.iter().filter(|o| o.index != node.index) {
                let (o4, o6, omac) = overlay(other.index);
                lines.push(format!("neigh replace {o4} lladdr {omac} dev vxlan0 nud permanent"));
                lines.push(format!("neigh replace {o6} lladdr {omac} dev vxlan0 nud permanent"));
            }
            ip_batch(Some(&node.netns), &lines).map_err(err)?;
            for other in self.nodes.iter().filter(|o| o.index != node.index) {
                let (_, _, omac) = overlay(other.index);
                let dst = other.ipv4.to_string();
                let out = Command::new("bridge")
                    .args(["-n", &node.netns, "fdb", "append", &omac, "dev", "vxlan0", "dst", &dst])
                    .output()
                    .map_err(|source| {
                        err(NetnsError::Spawn {
                            args: "bridge fdb append".into(),
                            source,
                        })
                    })?;
                if !out.status.success() {
                    return Err(err(NetnsError::Ip {
                        args: format!("bridge -n {} fdb append {omac} dev vxlan0 dst {dst}", node.netns),
                        stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
                    }));
                }
            }
        }
        Ok(())
    }

    /// The node (1-based) that owns namespace index `n`'s subnets.
    pub fn owner_of(count: u8, n: u8) -> u8 {
        ((n.max(1) - 1) % count.max(1)) + 1
    }

    fn add_node(&self, k: u8) -> Result<Node, NodeError> {
        let name = format!("node-{k}");
        let netns = format!("{}-n{k}", self.tag);
        let err = |source| NodeError::Netns {
            node: name.clone(),
            source,
        };
        let _ = ip(&["netns", "del", &netns]);
        ip(&["netns", "add", &netns]).map_err(err)?;
        let v4 = Ipv4Addr::new(10, 99, 0, k);
        let v6 = Ipv6Addr::new(0xfd00, 0x99, 0, 0, 0, 0, 0, k as u16);
        ip_batch(
            Some(&self.fabric),
            &[
                format!("link add n{k} type veth peer name eth0 netns {netns}"),
                format!("link set n{k} master br0"),
                format!("link set n{k} up"),
            ],
        )
        .map_err(err)?;
        ip_batch(
            Some(&netns),
            &[
                "link set lo up".into(),
                format!("addr add {v4}/24 dev eth0"),
                format!("addr add {v6}/64 dev eth0 nodad"),
                "link set eth0 up".into(),
                format!("route add default via {CONTROL_V4}"),
                format!("route add default via {CONTROL_V6}"),
            ],
        )
        .map_err(err)?;
        let dir = PathBuf::from(NODES_DIR).join(&netns);
        let _ = std::fs::remove_dir_all(&dir);
        for sub in ["run-npm", "var-lib-cni/results", "bpffs", "bin"] {
            mkdir(&name, &dir.join(sub))?;
        }
        for host in ["/run/npm", "/var/lib/cni"] {
            mkdir(&name, Path::new(host))?;
        }
        let mut node = Node {
            index: k,
            name: name.clone(),
            netns: netns.clone(),
            ipv4: v4,
            ipv6: v6,
            dir,
            holder: None,
        };
        node_sysctls(&node).map_err(err)?;
        node.holder = Some(start_holder(&node)?);
        Ok(node)
    }

    /// Routes `v4`/32 and `v6`/128 to node `k` on every other node and in
    /// the root netns when `k` is not the owner of the address's namespace
    /// subnet; otherwise removes such overrides (the subnet route applies).
    pub fn route_address(&self, k: u8, v4: Ipv4Addr, v6: Ipv6Addr) -> Result<(), NetnsError> {
        let owner = Self::owner_of(self.nodes.len() as u8, v4.octets()[2]);
        let mut moved = self.moved.lock().unwrap_or_else(|e| e.into_inner());
        let target = self.node(k).map(|n| (n.ipv4, n.ipv6));
        let others = || {
            std::iter::once(None).chain(
                self.nodes
                    .iter()
                    .filter(|n| n.index != k)
                    .map(|n| Some(n.netns.as_str())),
            )
        };
        match target {
            Some((via4, via6)) if owner != k => {
                for netns in others() {
                    ip_batch(
                        netns,
                        &[
                            format!("route replace {v4}/32 via {via4}"),
                            format!("route replace {v6}/128 via {via6}"),
                        ],
                    )?;
                }
                moved.insert(v4, v6);
            }
            _ => {
                // Back on its subnet's node: drop the override, if any.
                if let Some(v6) = moved.remove(&v4) {
                    for netns in others() {
                        let _ = ip_batch(netns, &[format!("route del {v4}/32")]);
                        let _ = ip_batch(netns, &[format!("route del {v6}/128")]);
                    }
                }
            }
        }
        Ok(())
    }

    /// The nodes, in index order.
    pub fn nodes(&self) -> &[Node] {
        &self.nodes
    }

    /// Node `k` (1-based).
    pub fn node(&self, k: u8) -> Option<&Node> {
        self.nodes.iter().find(|n| n.index == k)
    }

    /// The node that hosts pods of namespace index `n`.
    pub fn node_for_namespace(&self, n: u8) -> &Node {
        let k = Self::owner_of(self.nodes.len() as u8, n);
        &self.nodes[(k - 1) as usize]
    }

    /// Removes the nodes, their holders and the fabric.
    pub fn teardown(&mut self) {
        if self.torn_down {
            return;
        }
        self.torn_down = true;
        for node in &mut self.nodes {
            if let Some(mut h) = node.holder.take() {
                let _ = h.kill();
                let _ = h.wait();
            }
            let _ = ip(&["netns", "del", &node.netns]);
            let _ = std::fs::remove_dir_all(&node.dir);
        }
        for n in 1..=MAX_NS_INDEX {
            let _ = ip(&["route", "del", &ns_subnet_v4(n)]);
            let _ = ip(&["-6", "route", "del", &ns_subnet_v6(n)]);
        }
        let _ = ip(&["link", "del", &self.root_if]);
        let _ = ip(&["netns", "del", &self.fabric]);
        fabric_release();
    }
}

impl Drop for Nodes {
    fn drop(&mut self) {
        self.teardown();
    }
}

/// Whether this process has a fabric (they share `10.99.0.0/24` in the
/// root netns): a second one waits until the first is torn down. Other
/// processes are kept out by the cluster lock.
static FABRIC: (std::sync::Mutex<bool>, std::sync::Condvar) = (std::sync::Mutex::new(false), std::sync::Condvar::new());

fn fabric_acquire() {
    let mut busy = FABRIC.0.lock().unwrap_or_else(|e| e.into_inner());
    while *busy {
        busy = FABRIC.1.wait(busy).unwrap_or_else(|e| e.into_inner());
    }
    *busy = true;
}

fn fabric_release() {
    *FABRIC.0.lock().unwrap_or_else(|e| e.into_inner()) = false;
    FABRIC.1.notify_all();
}

fn mkdir(node: &str, path: &Path) -> Result<(), NodeError> {
    std::fs::create_dir_all(path).map_err(|source| NodeError::Io {
        node: node.to_string(),
        path: path.to_path_buf(),
        source,
    })
}

/// Forwarding on, DAD off (addresses usable at once), and the host-network
/// pods' ports kept out of the ephemeral range (a connection of the node's
/// agent or kube-proxy would otherwise take one now and then, and the
/// pod's server could not bind it), in the node's netns.
fn node_sysctls(node: &Node) -> Result<(), NetnsError> {
    let reserved = format!(
        "net.ipv4.ip_local_reserved_ports={}",
        crate::cluster::host_network_port_range()
    );
    run_in_netns(
        &node.netns,
        &[
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
            "net.ipv6.conf.all.accept_dad=0",
            "net.ipv6.conf.default.accept_dad=0",
            &reserved,
        ],
    )
}

/// Runs a command inside a named netns (`ip netns exec`).
pub fn run_in_netns(netns: &str, args: &[&str]) -> Result<(), NetnsError> {
    let mut full = vec!["netns", "exec", netns];
    full.extend_from_slice(args);
    ip(&full).map(drop)
}

/// The holder's script: the node's own sysfs, the host's bpffs, per-node
/// `/run/npm` and `/var/lib/cni`; then it waits forever.
const HOLDER_SCRIPT: &str = r#"set -e
d="$1"
mount --bind /sys/fs/bpf "$d/bpffs"
mount -t sysfs sysfs /sys
mount --bind "$d/bpffs" /sys/fs/bpf
mount --bind "$d/run-npm" /run/npm
mount --bind "$d/var-lib-cni" /var/lib/cni
echo "$$" > "$d/holder.pid"
exec sleep 1000000000
"#;

fn start_holder(node: &Node) -> Result<Child, NodeError> {
    let herr = |message: String| NodeError::Holder {
        node: node.name.clone(),
        message,
    };
    let pidfile = node.dir.join("holder.pid");
    let mut child = Command::new("nsenter")
        .arg(format!("--net=/run/netns/{}", node.netns))
        .args([
            "--",
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "--",
            "sh",
            "-c",
            HOLDER_SCRIPT,
            "sh",
        ])
        .arg(&node.dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| herr(format!("spawn: {e}")))?;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        if let Ok(Some(st)) = child.try_wait() {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                use std::io::Read;
                let _ = e.read_to_string(&mut err);
            }
            return Err(herr(format!("exited with {st}: {}", err.trim())));
        }
        if std::fs::read_to_string(&pidfile).is_ok_and(|p| p.trim() == child.id().to_string()) {
            return Ok(child);
        }
        if Instant::now() >= end {
            let _ = child.kill();
            let _ = child.wait();
            return Err(herr("not ready after 10 s".into()));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Kills the mount-namespace holders and agents of crashed runs: per-node
/// directories whose owning process (the pid in the cluster tag) is gone.
pub fn clear_leftover_holders() {
    let Ok(rd) = std::fs::read_dir(NODES_DIR) else {
        return;
    };
    for e in rd.flatten() {
        let name = e.file_name().to_string_lossy().to_string();
        let Some(owner) = crate::cluster::owner_pid_of(&name) else {
            continue;
        };
        if Path::new(&format!("/proc/{owner}")).exists() {
            continue;
        }
        for file in ["holder.pid", "agent.pid"] {
            let Some(pid) = std::fs::read_to_string(e.path().join(file))
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok())
            else {
                continue;
            };
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline);
            if cmdline.contains("sleep") || cmdline.contains("npm-agent") {
                // SAFETY: signalling a process of a crashed run of ours
                // (recorded pid, checked command line).
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_dir_all(e.path());
    }
}
