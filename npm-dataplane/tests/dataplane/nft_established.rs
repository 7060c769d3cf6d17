//! Connection semantics (issue #45) on nftables, with real kernel
//! conntrack entries: pod 1 (10.82.0.2) keeps a UDP flow and a TCP
//! connection open to pod 0 (10.82.0.1, ingress-isolated, admitting pod 1
//! on UDP 5000 and TCP 5001). Then a policy change removes both allows
//! (the same pods, the same owners). Under `keep` the two established
//! flows keep working; under `enforce`, once the change's apply returned,
//! the next exchanges of each fail: their conntrack entries were marked
//! cut through ctnetlink, and the table drops their packets both ways.
//! Each cut is a flow event (`ConnectionCut`, ingress of endpoint 1).
//! Needs root.

use std::collections::{BTreeMap, BTreeSet};
use std::net::Ipv4Addr;
use std::process::Command;

use crate::ebpf_common::*;
use crate::nft_common::SocketFlow;
use npm_common::{Reason, DIR_INGRESS};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

/// Pod 0 admits pod 1 (identity 300) on UDP 5000 and TCP 5001 when
/// `admit`; the same pods (owners) either way.
fn state(admit: bool) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("server", 256, Some("10.82.0.1"), None, true, false));
    c.endpoints
        .insert(2, endpoint("client", 300, Some("10.82.0.2"), None, false, false));
    ip(&mut c, "10.82.0.1", 256, 0);
    ip(&mut c, "10.82.0.2", 300, 0);
    if admit {
        allow(&mut c, 1, Direction::Ingress, 300, Some(Protocol::Udp), (5000, 5000), 1);
        allow(&mut c, 1, Direction::Ingress, 300, Some(Protocol::Tcp), (5001, 5001), 2);
    }
    c
}

/// Sets up the two pods, programs `state(true)` with endpoint 1 under
/// `enforce` or not, establishes both flows, programs `state(false)` by a
/// diff, and returns whether the UDP flow and the TCP connection still
/// answer, and the cut events: (direction, protocol).
fn after_deny(tag: &str, enforce: bool) -> (bool, bool, Vec<(u8, u8)>) {
    clear_netns_leftovers(tag);
    let pid = std::process::id();
    let node = node_netns(
        &format!("{tag}{pid}node"),
        &["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"],
        &["10.82.255.254/32".to_string()],
    );
    let ips = [Ipv4Addr::new(10, 82, 0, 1), Ipv4Addr::new(10, 82, 0, 2)];
    let mut pods = Vec::new();
    let mut ifs = BTreeMap::new();
    for (i, ip) in ips.iter().enumerate() {
        let p = Netns::new(&format!("{tag}{pid}pod{i}"));
        let host_if = format!("h{i}");
        let (_, mac) = wire_pod(&node.name, &p.name, &host_if);
        ns_sh(&p.name, &["ip", "addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        route_to_pod(&node.name, &host_if, &mac, &ip.to_string(), "32", Some("10.82.255.254"));
        ifs.insert(i as u32 + 1, ns_ifindex(&node.name, &host_if));
        pods.push(p);
    }
    let code = "import socket,threading\n\
        def h(c):\n  while True:\n    d=c.recv(64)\n    if not d: break\n    c.sendall(d)\n\
        t=socket.socket(); t.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); t.bind(('0.0.0.0',5001)); t.listen(8)\n\
        u=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('0.0.0.0',5000))\n\
        def udp():\n  while True:\n    d,a=u.recvfrom(64); u.sendto(b'a',a)\n\
        threading.Thread(target=udp, daemon=True).start()\n\
        while True:\n  c,_=t.accept(); threading.Thread(target=h, args=(c,), daemon=True).start()\n";
    let _server = Proc(
        Command::new("ip")
            .args(["netns", "exec", &pods[0].name, "python3", "-c", code])
            .spawn()
            .expect("spawn server"),
    );
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("{tag}{pid}"),
        netns: Some(node.name.clone()),
    })
    .expect("nft dataplane");
    dp.set_established_enforce(if enforce { BTreeSet::from([1]) } else { BTreeSet::new() });
    let first = state(true);
    dp.sync_full(&first, &ifs).unwrap();
    let mut udp = SocketFlow::new(&pods[1].name, false, ips[0], 5000);
    assert!(udp.establish(), "the UDP server never answered");
    // The server may start after the TCP client's connect: retry.
    let mut tcp = (0..20)
        .map(|_| {
            let mut f = SocketFlow::new(&pods[1].name, true, ips[0], 5001);
            f.ask().then_some(f)
        })
        .find_map(|f| f)
        .expect("the TCP server never answered");
    assert!(udp.ask() && tcp.ask(), "both flows are established");
    assert!(dp.take_cut_events().is_empty());

    let second = state(false);
    dp.apply(&first.diff(&second), &second, &ifs).unwrap();
    // Each asked twice: a cut stays cut whichever side sends next (the
    // kernel would pick a deleted TCP entry up again from the server's
    // next segment, in the server's direction: the entry is marked instead).
    let (u, t) = (udp.ask() || udp.ask(), tcp.ask() || tcp.ask());
    let cuts = dp
        .take_cut_events()
        .into_iter()
        .filter(|e| e.reason == Reason::ConnectionCut as u8 && e.endpoint == 1)
        .map(|e| (e.direction, e.protocol))
        .collect();
    // A new connection is denied either way (the policy, not a cut).
    assert!(!SocketFlow::new(&pods[1].name, false, ips[0], 5000).ask());
    (u, t, cuts)
}

/// `keep`: both established flows outlive the deny.
#[test]
fn keep_lets_established_flows_outlive_a_deny() {
    let (udp, tcp, cuts) = after_deny("npmestk", false);
    assert!(udp, "the UDP flow was cut under keep");
    assert!(tcp, "the TCP connection was cut under keep");
    assert!(cuts.is_empty());
}

/// `enforce`: the next exchange of both fails once the apply returned,
/// and each cut is one event of endpoint 1's ingress. Without the cut (the
/// code before issue #45, which is what `keep` still does) both answered.
#[test]
fn enforce_cuts_established_flows_the_new_policy_denies() {
    let (udp, tcp, mut cuts) = after_deny("npmeste", true);
    assert!(!udp, "the UDP flow outlived the deny under enforce");
    assert!(!tcp, "the TCP connection outlived the deny under enforce");
    cuts.sort();
    assert_eq!(cuts, vec![(DIR_INGRESS, 6), (DIR_INGRESS, 17)]);
}
