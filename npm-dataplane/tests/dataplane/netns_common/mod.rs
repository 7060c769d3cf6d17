//! Helpers shared by the eBPF and nftables dataplane tests: commands (also
//! inside a network namespace), network namespaces deleted on drop, the
//! sweep of namespaces left by a crashed run, child processes and files
//! removed on drop, node/pod veth wiring and the compiled-form builders.
#![allow(dead_code)]

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::{Child, Command};

use npm_policy::compiled::{Compiled, Endpoint, IpEntry, PodRef};

/// Runs a command, panicking with its output on failure.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("spawn {args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command, ignoring failure.
pub fn sh_quiet(args: &[&str]) {
    let _ = Command::new(args[0]).args(&args[1..]).output();
}

/// Runs a command in a namespace, panicking if it fails.
pub fn ns_sh(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

fn pid_alive(pid: u32) -> bool {
    PathBuf::from(format!("/proc/{pid}")).exists()
}

/// Names `<prefix><pid>...` whose pid is dead: leftovers of a crashed run.
pub fn dead_names(names: impl Iterator<Item = String>, prefix: &str) -> Vec<String> {
    names
        .filter(|n| n.starts_with(prefix))
        .filter(|n| {
            let digits: String = n[prefix.len()..].chars().take_while(|c| c.is_ascii_digit()).collect();
            digits.parse::<u32>().map(|p| !pid_alive(p)).unwrap_or(false)
        })
        .collect()
}

/// Names of the entries of a directory (empty if it cannot be read).
pub fn dir_names(dir: &str) -> Vec<String> {
    match std::fs::read_dir(dir) {
        Ok(rd) => rd
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Deletes namespaces named `<prefix><pid>...` whose owning test process is
/// gone (left over by a crashed run).
pub fn clear_netns_leftovers(prefix: &str) {
    for n in dead_names(dir_names("/run/netns").into_iter(), prefix) {
        sh_quiet(&["ip", "netns", "del", &n]);
    }
}

/// A network namespace deleted on drop (also on panic).
pub struct Netns {
    /// Its name under /run/netns.
    pub name: String,
}

impl Netns {
    /// Creates `name` (deleting a stale one of the same name first) with
    /// its loopback up.
    pub fn new(name: &str) -> Netns {
        sh_quiet(&["ip", "netns", "del", name]);
        sh(&["ip", "netns", "add", name]);
        sh(&["ip", "-n", name, "link", "set", "lo", "up"]);
        Netns { name: name.to_string() }
    }

    /// Runs a command inside the namespace.
    pub fn exec(&self, args: &[&str]) -> std::process::Output {
        Command::new("ip")
            .args(["netns", "exec", &self.name])
            .args(args)
            .output()
            .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        sh_quiet(&["ip", "netns", "del", &self.name]);
    }
}

/// A "node" namespace `name`: the sysctls `sysctls` (`key=value`) set and
/// the addresses `lo_addrs` (with prefix length) on its loopback.
pub fn node_netns(name: &str, sysctls: &[&str], lo_addrs: &[String]) -> Netns {
    let node = Netns::new(name);
    for kv in sysctls {
        ns_sh(name, &["sysctl", "-qw", kv]);
    }
    for a in lo_addrs {
        ns_sh(name, &["ip", "addr", "add", a, "dev", "lo"]);
    }
    node
}

/// A child process killed on drop.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A file removed on drop.
pub struct TempFile(pub String);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The MAC address of `dev` in namespace `ns`.
pub fn mac(ns: &str, dev: &str) -> String {
    ns_sh(ns, &["cat", &format!("/sys/class/net/{dev}/address")])
        .trim()
        .to_string()
}

/// The ifindex of `dev` in namespace `ns`.
pub fn ns_ifindex(ns: &str, dev: &str) -> u32 {
    ns_sh(ns, &["cat", &format!("/sys/class/net/{dev}/ifindex")])
        .trim()
        .parse()
        .unwrap()
}

/// Joins namespace `pod` to namespace `node` by a veth pair (`host_if` in
/// the node, `eth0` in the pod), both up, and gives the pod static
/// neighbours and default routes via the node (169.254.1.1 and fe80::1):
/// no ARP/ND timing in the probes. Returns (node-side MAC, pod-side MAC).
pub fn wire_pod(node: &str, pod: &str, host_if: &str) -> (String, String) {
    ns_sh(
        node,
        &[
            "ip", "link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", pod,
        ],
    );
    ns_sh(node, &["ip", "link", "set", host_if, "up"]);
    ns_sh(pod, &["ip", "link", "set", "eth0", "up"]);
    let host_mac = mac(node, host_if);
    let pod_mac = mac(pod, "eth0");
    let neigh = |family: &str, gw: &str| {
        ns_sh(
            pod,
            &[
                "ip",
                family,
                "neigh",
                "add",
                gw,
                "lladdr",
                &host_mac,
                "dev",
                "eth0",
                "nud",
                "permanent",
            ],
        )
    };
    neigh("-4", "169.254.1.1");
    ns_sh(
        pod,
        &[
            "ip",
            "route",
            "add",
            "default",
            "via",
            "169.254.1.1",
            "dev",
            "eth0",
            "onlink",
        ],
    );
    neigh("-6", "fe80::1");
    ns_sh(
        pod,
        &["ip", "-6", "route", "add", "default", "via", "fe80::1", "dev", "eth0"],
    );
    (host_mac, pod_mac)
}

/// In namespace `node`: a permanent neighbour entry for `addr` (at
/// `pod_mac` on `host_if`) and a route `addr/len` over `host_if`, with
/// preferred source `src` if given.
pub fn route_to_pod(node: &str, host_if: &str, pod_mac: &str, addr: &str, len: &str, src: Option<&str>) {
    let family = if addr.contains(':') { "-6" } else { "-4" };
    ns_sh(
        node,
        &[
            "ip",
            family,
            "neigh",
            "add",
            addr,
            "lladdr",
            pod_mac,
            "dev",
            host_if,
            "nud",
            "permanent",
        ],
    );
    let dst = format!("{addr}/{len}");
    let mut route = vec!["ip", family, "route", "add", dst.as_str(), "dev", host_if];
    if let Some(src) = src {
        route.extend(["src", src]);
    }
    ns_sh(node, &route);
}

/// A local endpoint for a hand-built compiled form (namespace `default`,
/// uid `uid-<name>`).
pub fn endpoint(name: &str, identity: u32, v4: Option<&str>, v6: Option<&str>, iso_in: bool, iso_eg: bool) -> Endpoint {
    Endpoint {
        pod: PodRef {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        },
        identity,
        ipv4: v4.map(|a| a.parse().unwrap()),
        ipv6: v6.map(|a| a.parse().unwrap()),
        isolated_ingress: iso_in,
        isolated_egress: iso_eg,
        tiers: Default::default(),
        report_new: false,
    }
}

/// Adds an ipcache entry.
pub fn ip(c: &mut Compiled, addr: &str, identity: u32, cidr_identity: u32) {
    c.ipcache.insert(
        addr.parse::<IpAddr>().unwrap(),
        IpEntry {
            identity,
            cidr_identity,
            owner: 0,
        },
    );
}

const FORWARD: &str = "/proc/sys/net/ipv4/ip_forward";

/// How many [`Forwarding`]s live in this process, and the value before the
/// first.
static FORWARDING: std::sync::Mutex<(usize, String)> = std::sync::Mutex::new((0, String::new()));

/// IPv4 forwarding of the root namespace on while it lives, for fixtures
/// whose pods are routed through the root namespace (a Kubernetes node
/// always forwards; a fresh machine may not). Shared by the tests of the
/// process, which run in parallel: the value found before the first is
/// restored after the last, never while another test still needs it.
pub struct Forwarding(());

impl Forwarding {
    /// Switches forwarding on.
    pub fn on() -> Forwarding {
        let mut f = FORWARDING.lock().unwrap_or_else(|e| e.into_inner());
        if f.0 == 0 {
            f.1 = std::fs::read_to_string(FORWARD).unwrap_or_else(|_| "0\n".into());
            std::fs::write(FORWARD, "1\n").expect("enable IPv4 forwarding");
        }
        f.0 += 1;
        Forwarding(())
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        let mut f = FORWARDING.lock().unwrap_or_else(|e| e.into_inner());
        f.0 -= 1;
        if f.0 == 0 {
            let _ = std::fs::write(FORWARD, &f.1);
        }
    }
}
