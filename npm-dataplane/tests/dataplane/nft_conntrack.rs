//! The nftables dataplane and kernel conntrack when an address changes
//! owner (incident 1): a UDP flow a peer keeps alive to an address must not
//! outlive its owner. The endpoint chains let established flows pass before
//! any policy, so the dataplane deletes the conntrack entries of every
//! address that left its endpoint or got a new pod UID; the flow's next
//! packet then meets the new owner's policy. Needs root.

use std::net::Ipv4Addr;
use std::process::Command;

use crate::ebpf_common::*;
use crate::nft_common::SocketFlow;
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

/// Pod 0 (10.81.0.1, endpoint 1) answers UDP 5000 and admits pod 1
/// (10.81.0.2, endpoint 2) while its first owner holds the address; a new
/// pod (another UID, another identity, isolated with no rule) gets the
/// same address: the client's established flow, kept alive across the
/// change, is denied from the first packet after it.
#[test]
fn a_flow_to_an_address_that_changed_owner_meets_the_new_owners_policy() {
    clear_netns_leftovers("npmctn");
    let pid = std::process::id();
    let node = node_netns(
        &format!("npmctn{pid}node"),
        &["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"],
        &["10.81.255.254/32".to_string()],
    );
    let ips = [Ipv4Addr::new(10, 81, 0, 1), Ipv4Addr::new(10, 81, 0, 2)];
    let mut pods = Vec::new();
    let mut ifs = std::collections::BTreeMap::new();
    for (i, ip) in ips.iter().enumerate() {
        let p = Netns::new(&format!("npmctn{pid}pod{i}"));
        let host_if = format!("h{i}");
        let (_, mac) = wire_pod(&node.name, &p.name, &host_if);
        ns_sh(&p.name, &["ip", "addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        route_to_pod(&node.name, &host_if, &mac, &ip.to_string(), "32", Some("10.81.255.254"));
        ifs.insert(i as u32 + 1, ns_ifindex(&node.name, &host_if));
        pods.push(p);
    }
    let code = "import socket\nu=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0',5000))\nwhile True:\n  d,a=u.recvfrom(64); u.sendto(b'a',a)\n";
    let _server = Proc(
        Command::new("ip")
            .args(["netns", "exec", &pods[0].name, "python3", "-c", code])
            .spawn()
            .expect("spawn server"),
    );

    // The first owner admits pod 1 on UDP 5000.
    let state = |owner: &str, identity: u32, admit: bool| {
        let mut c = Compiled::default();
        let mut e = endpoint(owner, identity, Some("10.81.0.1"), None, true, false);
        e.pod.uid = format!("uid-{owner}");
        c.endpoints.insert(1, e);
        c.endpoints
            .insert(2, endpoint("client", 300, Some("10.81.0.2"), None, false, false));
        ip(&mut c, "10.81.0.1", identity, 0);
        ip(&mut c, "10.81.0.2", 300, 0);
        if admit {
            allow(&mut c, 1, Direction::Ingress, 300, Some(Protocol::Udp), (5000, 5000), 1);
        }
        c
    };
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npmctn{pid}"),
        netns: Some(node.name.clone()),
    })
    .expect("nft dataplane");
    let first = state("old", 256, true);
    dp.sync_full(&first, &ifs).unwrap();
    let mut flow = SocketFlow::new(&pods[1].name, false, ips[0], 5000);
    let mut up = false;
    for _ in 0..20 {
        if flow.ask() {
            up = true;
            break;
        }
    }
    assert!(up, "the first owner's server never answered");
    assert!(flow.ask() && flow.ask(), "the flow is established");

    // The address changes owner: a new pod UID and identity, isolated with
    // no rule. The same flow's next packets are denied.
    let second = state("new", 257, false);
    dp.apply(&first.diff(&second), &second, &ifs).unwrap();
    assert!(dp.conntrack_flushed() >= 1, "no conntrack entry deleted");
    assert!(!flow.ask(), "the old owner's flow passed to the new owner");
    assert!(!flow.ask());
    // A fresh flow is denied too (the policy, not only the flush).
    assert!(!SocketFlow::new(&pods[1].name, false, ips[0], 5000).ask());
}
