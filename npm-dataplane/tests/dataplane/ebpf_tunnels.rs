//! Service egress over real L3 tunnels: kube-proxy-style DNAT of a
//! ClusterIP to two backends on a second node, reached over an IPIP tunnel
//! (Calico's `tunl0` shape) or WireGuard (Calico's and Cilium's
//! encryption, Flannel's `wireguard` backend), with `node_exit` on the
//! underlay and `node_exit_l3` on the tunnel device, as the agent attaches
//! them. Real connections through the real encapsulation: the allowed
//! backend answers, the denied one is never reached, its deny reported.
//!
//! These need the `ipip` and `wireguard` modules, which the host kernel of
//! the development machine lacks: they are `#[ignore]`d in the host's
//! suite and run by the VM rows of `cargo xtask vm matrix` (Debian's
//! kernels, `--include-ignored`), one of which CI runs. Needs root.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use crate::ebpf_common::*;
use crate::ebpf_services::{
    block, compiled, count, interfaces, probe, program_services, serve, wait_tcp, LinkGuard, NatTable, Pod, SecondNode,
    PROBES,
};
use npm_common::{proto, DIR_EGRESS};
use npm_dataplane::ebpf::{EbpfDataplane, NodeExit};
use npm_dataplane::Dataplane;
use npm_policy::model::Protocol;

/// The tunnel between the two nodes.
#[derive(Clone, Copy, Debug)]
enum Kind {
    Ipip,
    Wireguard,
}

/// IPIP (`ip link add type ipip`): a 20-byte outer IPv4 header, protocol 4.
#[test]
#[ignore = "needs the ipip module: run by the VM rows of `cargo xtask vm matrix`"]
fn service_backends_over_ipip_are_decided_before_the_encapsulation() {
    tunnel_case(Kind::Ipip, "i", 8);
}

/// WireGuard: the inner packet encrypted into a UDP datagram of the node.
#[test]
#[ignore = "needs the wireguard module: run by the VM rows of `cargo xtask vm matrix`"]
fn service_backends_over_wireguard_are_decided_before_the_encryption() {
    tunnel_case(Kind::Wireguard, "w", 9);
}

/// A WireGuard key pair (private, public) from `wg`.
fn wg_keys() -> (String, String) {
    let private = sh(&["wg", "genkey"]).trim().to_string();
    let public = sh(&["sh", "-c", &format!("echo {private} | wg pubkey")])
        .trim()
        .to_string();
    (private, public)
}

/// Configures WireGuard device `dev` (in `ns`, or the root netns) with
/// `private` key, listening on `port`, one peer `peer_public` at
/// `endpoint` for `allowed`.
fn wg_set(ns: Option<&str>, dev: &str, private: &str, port: u16, peer_public: &str, endpoint: &str, allowed: &str) {
    let key_file = format!("/tmp/npm-wg-{}-{dev}.key", std::process::id());
    let _f = TempFile(key_file.clone());
    std::fs::write(&key_file, private).unwrap();
    let port = port.to_string();
    let args = [
        "wg",
        "set",
        dev,
        "private-key",
        &key_file,
        "listen-port",
        &port,
        "peer",
        peer_public,
        "endpoint",
        endpoint,
        "allowed-ips",
        allowed,
    ];
    match ns {
        Some(ns) => ns_sh(ns, &args),
        None => sh(&args),
    };
}

/// The case: pod `a` on this node, egress-isolated, allowed to backend r1
/// only; a ClusterIP DNATed at random to r1 or r2, both on node 2, routed
/// into the tunnel.
fn tunnel_case(kind: Kind, tag: &str, t: u32) {
    sweep_leftovers();
    let pid = std::process::id();
    let (base, cips) = block(t);
    let cip = Ipv4Addr::from(cips + 3);
    let a = Pod::new(&format!("u{tag}"), base, 0);

    // The underlay: a routed veth to the second node's namespace.
    let SecondNode {
        node2,
        uplink,
        here,
        there,
        _uplink_guard,
    } = SecondNode::new(&format!("unode2{tag}"), &format!("npt{pid}uu{tag}"), base);

    // The tunnel: `tdev` here, `t0` on node 2.
    let tdev = format!("npt{pid}ut{tag}");
    sh_quiet(&["ip", "link", "del", &tdev]);
    match kind {
        Kind::Ipip => {
            sh_quiet(&["modprobe", "ipip"]);
            let (h, th) = (here.to_string(), there.to_string());
            sh(&["ip", "link", "add", &tdev, "type", "ipip", "local", &h, "remote", &th]);
            ns_sh(
                &node2.name,
                &["ip", "link", "add", "t0", "type", "ipip", "local", &th, "remote", &h],
            );
        }
        Kind::Wireguard => {
            sh_quiet(&["modprobe", "wireguard"]);
            sh(&["ip", "link", "add", &tdev, "type", "wireguard"]);
            ns_sh(&node2.name, &["ip", "link", "add", "t0", "type", "wireguard"]);
        }
    }
    let _tunnel_guard = LinkGuard(tdev.clone());
    // Two remote "pods" (addresses of node 2), routed into the tunnel
    // without a gateway; the pod's replies routed back into it.
    let r1 = Ipv4Addr::from(base + 5 * 4 + 1);
    let r2 = Ipv4Addr::from(base + 5 * 4 + 2);
    if let Kind::Wireguard = kind {
        let (k1, p1) = wg_keys();
        let (k2, p2) = wg_keys();
        let (port1, port2) = (51000 + (pid % 200) as u16 * 2, 51001 + (pid % 200) as u16 * 2);
        wg_set(
            None,
            &tdev,
            &k1,
            port1,
            &p2,
            &format!("{there}:{port2}"),
            &format!("{r1}/32,{r2}/32"),
        );
        wg_set(
            Some(&node2.name),
            "t0",
            &k2,
            port2,
            &p1,
            &format!("{here}:{port1}"),
            &format!("{}/32", a.ip),
        );
    }
    sh(&["ip", "link", "set", &tdev, "up"]);
    ns_sh(&node2.name, &["ip", "link", "set", "t0", "up"]);
    for r in [r1, r2] {
        ns_sh(&node2.name, &["ip", "addr", "add", &format!("{r}/32"), "dev", "lo"]);
        sh(&["ip", "route", "add", &format!("{r}/32"), "dev", &tdev]);
    }
    ns_sh(
        &node2.name,
        &["ip", "route", "add", &format!("{}/32", a.ip), "dev", "t0"],
    );
    let _s1 = serve(&node2.name, r1, "r1", &[8080], &[]);
    let _s2 = serve(&node2.name, r2, "r2", &[8080], &[]);
    let _nat = NatTable::new(&format!("u{tag}"), &[(cip, 80, "tcp", vec![r1, r2], 8080)]);
    // Both reachable through the tunnel before any program is attached.
    wait_tcp(&a.ns.name, r1, 8080);
    wait_tcp(&a.ns.name, r2, 8080);

    let pins = PinDir::new(&format!("svc-tun{tag}"));
    let mut dp: EbpfDataplane = pins.open();
    // r1 is identity(2), r2 identity(3): only r1 is allowed.
    dp.sync_full(
        &compiled(&[(&a, true, true)], &[r1, r2], &[(2, Protocol::Tcp, 8080)]),
        &interfaces(&[&a]),
    )
    .unwrap();
    program_services(&pins, &[(cip, 80, proto::TCP)]);
    // As the agent attaches: every device a route leaves by, the
    // underlay (Ethernet: `node_exit`) and the tunnel (`node_exit_l3`).
    let mut exit = NodeExit::open(None, &pins.path).expect("load node_exit");
    let (up, tun) = (ifindex_of(&uplink), ifindex_of(&tdev));
    exit.set_interfaces(&BTreeSet::from([up, tun]))
        .expect("attach node_exit");
    assert_eq!(exit.program_on(up), Some("node_exit"));
    assert_eq!(exit.program_on(tun), Some("node_exit_l3"), "{kind:?} is an L3 device");
    dp.poll_deny_events();

    let r = probe(&a.ns.name, cip, 80, "tcp", PROBES);
    assert_eq!(count(&r, "r1") + count(&r, "FAIL"), PROBES, "{kind:?}: {r:?}");
    assert!(
        count(&r, "r1") > 0,
        "{kind:?}: no connection reached the allowed backend through the tunnel: {r:?}"
    );
    assert!(
        count(&r, "FAIL") > 0,
        "{kind:?}: the denied backend was reached through the tunnel, or never chosen: {r:?}"
    );
    let denies = dp.poll_deny_events();
    assert!(
        denies
            .iter()
            .any(|e| e.direction == DIR_EGRESS && e.ifindex == a.ifindex && e.dst == r2.to_ipv6_mapped().octets()),
        "{kind:?}: no egress deny of a towards r2: {denies:?}"
    );
    exit.set_interfaces(&BTreeSet::new()).unwrap();
}
