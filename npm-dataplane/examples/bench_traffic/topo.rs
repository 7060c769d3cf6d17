//! The benchmark's topologies: one "node" network namespace per row with
//! two "pod" namespaces joined to it by veth pairs, wired as the netns
//! cluster wires pods (`tests/netns_common`: /32 pod addresses, default
//! routes via 169.254.1.1, routes and permanent neighbours on the node), the
//! row's dataplane programmed on the node's side of both veths, the
//! synthetic compiled state (the server's N ingress entries), the thread
//! helper that runs code inside a namespace (setns), and the removal of what
//! a crashed run left.

use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use npm_dataplane::ebpf::{AttachMode, EbpfDataplane, EbpfOptions};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction, PolicyEntry};
use npm_policy::model::Protocol;

use crate::netns_common::{
    clear_netns_leftovers, dead_names, dir_names, endpoint, ip, node_netns, ns_ifindex, ns_sh, route_to_pod, wire_pod,
    Netns, Proc,
};
/// The kit's thread helpers: run code inside a namespace (setns).
pub use npm_testkit::netns::{enter_netns, in_netns_scoped as in_netns};

/// Prefix of every namespace of the benchmark: `npmbt<pid>-<row>-<role>`.
pub const NS_PREFIX: &str = "npmbt";
/// Prefix of the eBPF rows' pin directories under /sys/fs/bpf.
const PIN_PREFIX: &str = "npmbt-";
/// The client pod (endpoint 1), the sender.
pub const CLIENT_IP: &str = "10.78.0.1";
/// The server pod (endpoint 2), the receiving endpoint that holds the
/// policy entries.
pub const SERVER_IP: &str = "10.78.0.2";
const NODE_IP: &str = "10.78.255.254";
const CLIENT_IDENTITY: u32 = 256;
const SERVER_IDENTITY: u32 = 257;
/// iperf3's port (control and data connections).
pub const IPERF_PORT: u16 = 5201;
/// The request/response server's port.
pub const RR_PORT: u16 = 5202;
/// The new-connection server's port.
pub const CONN_PORT: u16 = 5203;
/// A port the server listens on that no entry allows: the check that the
/// dataplane is in the path.
pub const DENIED_PORT: u16 = 5210;

/// Which dataplane a row runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    /// Nothing attached, no table: the bare veth path.
    None,
    /// The eBPF classifier on both host-side veths.
    Ebpf,
    /// The nftables table in the node namespace.
    Nft,
}

impl Kind {
    /// The name in the JSON line.
    pub fn name(self) -> &'static str {
        match self {
            Kind::None => "none",
            Kind::Ebpf => "ebpf",
            Kind::Nft => "nftables",
        }
    }
}

/// A pin directory removed on drop.
pub struct PinDir(pub PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The programmed dataplane of a row (dropped before its namespaces).
pub enum Plane {
    /// No dataplane.
    None,
    /// The loaded object and its pins (the object is dropped first).
    Ebpf {
        /// The loaded, attached object.
        dp: Box<EbpfDataplane>,
        /// Its pin directory, removed after it.
        pins: PinDir,
    },
    /// The nftables dataplane (its table goes with the node namespace).
    Nft(Box<NftDataplane>),
}

/// One row's namespaces. Field order is drop order: the dataplane, the
/// processes, then the namespaces.
pub struct Topo {
    /// The row's dataplane.
    pub plane: Plane,
    /// The iperf3 server, killed on drop.
    _procs: Vec<Proc>,
    /// The client pod's namespace.
    pub client: Netns,
    /// The server pod's namespace.
    pub server: Netns,
    /// The node's namespace (the dataplane lives here).
    pub node: Netns,
}

/// Removes what killed or crashed runs left: the processes still running in
/// namespaces `npmbt<pid>-…` of processes that are gone (their iperf3
/// servers), those namespaces, and pin directories `npmbt-<pid>-…`.
pub fn sweep_leftovers() {
    for ns in dead_names(dir_names("/run/netns").into_iter(), NS_PREFIX) {
        let Ok(out) = Command::new("ip").args(["netns", "pids", &ns]).output() else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        for pid in text.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: a signal to a process of a leftover namespace.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    clear_netns_leftovers(NS_PREFIX);
    for n in dead_names(dir_names("/sys/fs/bpf").into_iter(), PIN_PREFIX) {
        let _ = std::fs::remove_dir_all(format!("/sys/fs/bpf/{n}"));
    }
}

/// The compiled state of a row: both pods endpoints (the client not
/// isolated, the server isolated for ingress with `entries` ingress
/// entries: the one allowing the client's identity TCP 5201-5203 and
/// `entries - 1` others over 5,000 other identities, TCP and UDP, short
/// port ranges), the node's address and one address per other identity.
pub fn compiled(entries: usize) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints.insert(
        1,
        endpoint("client", CLIENT_IDENTITY, Some(CLIENT_IP), None, false, false),
    );
    c.endpoints.insert(
        2,
        endpoint("server", SERVER_IDENTITY, Some(SERVER_IP), None, true, false),
    );
    ip(&mut c, CLIENT_IP, CLIENT_IDENTITY, 0);
    ip(&mut c, SERVER_IP, SERVER_IDENTITY, 0);
    ip(&mut c, NODE_IP, npm_common::IDENTITY_HOST, 0);
    // The server's entries, keyed by its subject (its pod identity).
    c.policy.insert(
        PolicyEntry {
            subject: SERVER_IDENTITY,
            direction: Direction::Ingress,
            peer: CLIENT_IDENTITY,
            protocol: Some(Protocol::Tcp),
            ports: (IPERF_PORT, CONN_PORT),
        },
        0,
    );
    for i in 1..entries {
        let lo = 1024 + (i as u16 % 30_000) * 2;
        c.policy.insert(
            PolicyEntry {
                subject: SERVER_IDENTITY,
                direction: Direction::Ingress,
                peer: 1000 + (i as u32 % 5000),
                protocol: Some(if i % 3 == 0 { Protocol::Udp } else { Protocol::Tcp }),
                ports: (lo, lo + (i as u16 % 7)),
            },
            i as u32,
        );
    }
    for k in 0..entries.saturating_sub(1).min(5000) {
        let addr = format!("10.79.{}.{}", k >> 8, k & 255);
        ip(&mut c, &addr, 1000 + k as u32, 0);
    }
    assert_eq!(c.policy.len(), entries, "distinct policy entries");
    c
}

impl Topo {
    /// Builds the namespaces of row `tag`, starts the iperf3 server in the
    /// server pod and programs the dataplane `kind` with `entries` entries.
    pub fn new(tag: &str, kind: Kind, entries: usize) -> Topo {
        let pid = std::process::id();
        let base = format!("{NS_PREFIX}{pid}-{tag}");
        let node = node_netns(
            &format!("{base}-node"),
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
            &[format!("{NODE_IP}/32")],
        );
        let client = Netns::new(&format!("{base}-cli"));
        let server = Netns::new(&format!("{base}-srv"));
        let mut ifs = Interfaces::new();
        for (id, pod, addr, host_if) in [(1, &client, CLIENT_IP, "h1"), (2, &server, SERVER_IP, "h2")] {
            let (_, pod_mac) = wire_pod(&node.name, &pod.name, host_if);
            ns_sh(&pod.name, &["ip", "addr", "add", &format!("{addr}/32"), "dev", "eth0"]);
            route_to_pod(&node.name, host_if, &pod_mac, addr, "32", Some(NODE_IP));
            ifs.insert(id, ns_ifindex(&node.name, host_if));
        }
        // The client opens tens of thousands of short connections: the
        // whole port range, and TIME_WAIT ports reused.
        for kv in ["net.ipv4.ip_local_port_range=1024 65535", "net.ipv4.tcp_tw_reuse=1"] {
            ns_sh(&client.name, &["sysctl", "-qw", kv]);
        }
        let mut iperf = Command::new("ip");
        iperf
            .args(["netns", "exec", &server.name, "iperf3", "-s", "-p"])
            .arg(IPERF_PORT.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        // SAFETY: prctl only, between fork and exec: the server dies with
        // this process even when it is killed (`ip netns exec` execs it in
        // place, and the signal setting survives the exec).
        unsafe {
            iperf.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let iperf = iperf
            .spawn()
            .unwrap_or_else(|e| panic!("spawn iperf3 -s (apt-get install iperf3): {e}"));
        let mut topo = Topo {
            plane: Plane::None,
            _procs: vec![Proc(iperf)],
            client,
            server,
            node,
        };
        topo.wait_listening(IPERF_PORT);
        let state = if kind == Kind::None {
            None
        } else {
            Some(compiled(entries))
        };
        let state = state.as_ref();
        topo.plane = match kind {
            Kind::None => Plane::None,
            Kind::Ebpf => {
                let pins = PinDir(PathBuf::from(format!("/sys/fs/bpf/{PIN_PREFIX}{pid}-{tag}")));
                let opts = EbpfOptions {
                    object: None,
                    pin_dir: pins.0.clone(),
                    bench_no_ct_create: false,
                    attach: AttachMode::Auto,
                };
                // Attached from inside the node namespace: the ifindexes
                // are the node's.
                let dp = in_netns(&topo.node.name, || {
                    let mut dp = EbpfDataplane::open(opts).unwrap_or_else(|e| panic!("eBPF open: {e}"));
                    dp.sync_full(state.expect("a state"), &ifs)
                        .unwrap_or_else(|e| panic!("eBPF sync: {e}"));
                    dp
                });
                Plane::Ebpf { dp: Box::new(dp), pins }
            }
            Kind::Nft => {
                let mut dp = NftDataplane::new(NftOptions {
                    table: format!("npm_bt{pid}"),
                    netns: Some(topo.node.name.clone()),
                })
                .unwrap_or_else(|e| panic!("nft: {e}"));
                dp.sync_full(state.expect("a state"), &ifs)
                    .unwrap_or_else(|e| panic!("nft sync: {e}"));
                Plane::Nft(Box::new(dp))
            }
        };
        topo
    }

    /// Waits until something listens on TCP `port` in the server pod.
    fn wait_listening(&self, port: u16) {
        let deadline = Instant::now() + Duration::from_secs(10);
        let filter = format!("sport = :{port}");
        loop {
            let out = self.server.exec(&["ss", "-Hltn", &filter]);
            if out.status.success() && !out.stdout.is_empty() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "nothing listens on {port} in {}",
                self.server.name
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The pin directory of an eBPF row.
    pub fn pin_dir(&self) -> Option<&std::path::Path> {
        match &self.plane {
            Plane::Ebpf { pins, .. } => Some(&pins.0),
            _ => None,
        }
    }

    /// Packets the dataplane counted as allowed by policy on ingress (None:
    /// no dataplane with counters).
    pub fn policy_allowed(&self) -> Option<u64> {
        let counters = match &self.plane {
            Plane::None => return None,
            Plane::Ebpf { dp, .. } => dp.counters(),
            Plane::Nft(dp) => dp.counters(),
        }
        .unwrap_or_else(|e| panic!("counters: {e}"));
        Some(counters.packets(npm_common::DIR_INGRESS, npm_common::Reason::Policy))
    }
}
