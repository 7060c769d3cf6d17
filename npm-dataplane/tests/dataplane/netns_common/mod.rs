//! Helpers shared by the eBPF and nftables dataplane tests: commands (also
//! inside a network namespace), network namespaces deleted on drop, the
//! sweep of namespaces left by a crashed run, child processes and files
//! removed on drop, node/pod veth wiring and the compiled-form builders.
#![allow(dead_code)]

use std::net::IpAddr;
use std::process::Child;

use npm_policy::compiled::{Compiled, Endpoint, IpEntry, PodRef};
/// The kit's commands, namespaces, sweeps and forwarding guard.
// The traffic benchmark includes this file too (`examples/bench_traffic`)
// and uses only some of them.
#[allow(unused_imports)]
pub use npm_testkit::netns::{clear_netns_leftovers, dead_names, dir_names, ns_sh, sh, sh_quiet, Forwarding, Netns};

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
