//! Connection semantics on nftables, with real kernel
//! conntrack entries: pod 1 (10.82.0.2) keeps a UDP flow and a TCP
//! connection open to pod 0 (10.82.0.1, ingress-isolated, admitting pod 1
//! on UDP 5000 and TCP 5001). Then a policy change removes both allows
//! (the same pods, the same owners). Under `keep` the two established
//! flows keep working; under `enforce`, once the change's apply returned,
//! the next exchanges of each fail: their conntrack entries were marked
//! cut through ctnetlink, and the table drops their packets both ways.
//! Each cut is a flow event (`ConnectionCut`, ingress of endpoint 1), and
//! every packet the table drops for a cut is counted (`cut-flow`),
//! including an ICMP error that conntrack relates to a cut flow (it
//! carries the flow's mark). Needs root.

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

/// What [`after_deny`] saw after the deny.
struct Outcome {
    /// The UDP flow still answered.
    udp: bool,
    /// The TCP connection still answered.
    tcp: bool,
    /// The cut events: (direction, protocol).
    cuts: Vec<(u8, u8)>,
    /// `cut-flow` drops counted for one more datagram of the UDP flow.
    counted_per_datagram: u64,
    /// `cut-flow` drops counted for an ICMP port unreachable that the
    /// client sends about the UDP flow.
    counted_for_icmp_error: u64,
}

/// The packets the table dropped as parts of cut connections, both
/// directions.
fn cut_flow_drops(dp: &NftDataplane) -> u64 {
    dp.counters().unwrap().packets_both_ways(Reason::CutFlow)
}

/// The `cut-flow` drops counted since `before`; when `expect` any, waits
/// (at most 2 s) for the first to be counted: the packet may still be on
/// its way through the veths.
fn counted_since(dp: &NftDataplane, before: u64, expect: bool) -> u64 {
    for _ in 0..40 {
        let n = cut_flow_drops(dp) - before;
        if n > 0 || !expect {
            return n;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    0
}

/// An ICMP port unreachable from `ns` (the client, `client`) to `server`,
/// quoting a datagram of the UDP flow from `server`:5000 to the client's
/// port of that flow (read with `ss`): what a client whose socket closed
/// would send. A raw socket; the kernel relates it to the flow's entry.
fn send_port_unreachable(ns: &str, client: Ipv4Addr, server: Ipv4Addr) {
    let ss = ns_sh(
        ns,
        &["ss", "-Hnu", "state", "established", "dst", &format!("{server}:5000")],
    );
    let port: u16 = ss
        .split_whitespace()
        .find_map(|w| w.strip_prefix(&format!("{client}:")).and_then(|p| p.parse().ok()))
        .unwrap_or_else(|| panic!("no UDP socket to the server in {ss:?}"));
    let code = format!(
        "import socket,struct\n\
         def ck(b):\n  b=b+b'\\0'*(len(b)%2); t=sum(struct.unpack('!%dH' % (len(b)//2), b)); t=(t>>16)+(t&0xffff); t+=t>>16; return (~t)&0xffff\n\
         ip=struct.pack('!BBHHHBBH4s4s',0x45,0,29,1,0,64,17,0,socket.inet_aton('{server}'),socket.inet_aton('{client}'))\n\
         ip=ip[:10]+struct.pack('!H',ck(ip))+ip[12:]\n\
         udp=struct.pack('!HHHH',5000,{port},9,0)\n\
         body=struct.pack('!BBHI',3,3,0,0)+ip+udp\n\
         body=body[:2]+struct.pack('!H',ck(body))+body[4:]\n\
         s=socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\n\
         s.sendto(body,('{server}',0))\n"
    );
    ns_sh(ns, &["python3", "-c", &code]);
}

/// Sets up the two pods, programs `state(true)` with endpoint 1 under
/// `enforce` or not, establishes both flows (the TCP connection only
/// `with_tcp`: its retransmissions are dropped, and counted, at their own
/// pace), programs `state(false)` by a diff, and returns what happened
/// next ([`Outcome`]). With `switch` (and `enforce` false), endpoint 1
/// is then switched to `enforce` alone, by an apply of an empty diff (what
/// the sync loop does for an annotation change), once both flows were
/// seen to outlive the deny.
fn after_deny(tag: &str, enforce: bool, with_tcp: bool, switch: bool) -> Outcome {
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
    let mut tcp = with_tcp.then(|| {
        (0..20)
            .map(|_| {
                let mut f = SocketFlow::new(&pods[1].name, true, ips[0], 5001);
                f.ask().then_some(f)
            })
            .find_map(|f| f)
            .expect("the TCP server never answered")
    });
    assert!(udp.ask(), "the UDP flow is established");
    if let Some(tcp) = &mut tcp {
        assert!(tcp.ask(), "the TCP connection is established");
    }
    assert!(dp.take_cut_events().is_empty());

    let second = state(false);
    dp.apply(&first.diff(&second), &second, &ifs).unwrap();
    let enforce = enforce || switch;
    if switch {
        assert!(udp.ask(), "keep: the UDP flow outlives the deny");
        if let Some(tcp) = &mut tcp {
            assert!(tcp.ask(), "keep: the TCP connection outlives the deny");
        }
        dp.set_established_enforce(BTreeSet::from([1]));
        dp.apply(&second.diff(&second), &second, &ifs).unwrap();
    }
    // Each asked twice: a cut stays cut whichever side sends next (the
    // kernel would pick a deleted TCP entry up again from the server's
    // next segment, in the server's direction: the entry is marked instead).
    let u = udp.ask() || udp.ask();
    let t = tcp.as_mut().is_some_and(|tcp| tcp.ask() || tcp.ask());
    let cuts = dp
        .take_cut_events()
        .into_iter()
        .filter(|e| e.reason == Reason::ConnectionCut as u8 && e.endpoint == 1)
        .map(|e| (e.direction, e.protocol))
        .collect();
    // One more datagram, then an ICMP error about the flow: each dropped
    // packet of a cut flow is counted, every time.
    let before = cut_flow_drops(&dp);
    let again = udp.ask();
    assert_eq!(again, u, "the UDP flow changed its mind");
    let counted_per_datagram = counted_since(&dp, before, enforce);
    let before = cut_flow_drops(&dp);
    send_port_unreachable(&pods[1].name, ips[1], ips[0]);
    let counted_for_icmp_error = counted_since(&dp, before, enforce);
    // A new connection is denied either way (the policy, not a cut).
    assert!(!SocketFlow::new(&pods[1].name, false, ips[0], 5000).ask());
    Outcome {
        udp: u,
        tcp: t,
        cuts,
        counted_per_datagram,
        counted_for_icmp_error,
    }
}

/// `keep`: both established flows outlive the deny.
#[test]
fn keep_lets_established_flows_outlive_a_deny() {
    let o = after_deny("npmestk", false, true, false);
    assert!(o.udp, "the UDP flow was cut under keep");
    assert!(o.tcp, "the TCP connection was cut under keep");
    assert!(o.cuts.is_empty());
    assert_eq!((o.counted_per_datagram, o.counted_for_icmp_error), (0, 0));
}

/// `enforce`: the next exchange of both fails once the apply returned,
/// and each cut is one event of endpoint 1's ingress. Without the cut (the
/// code before issue #45, which is what `keep` still does) both answered.
#[test]
fn enforce_cuts_established_flows_the_new_policy_denies() {
    let mut o = after_deny("npmeste", true, true, false);
    assert!(!o.udp, "the UDP flow outlived the deny under enforce");
    assert!(!o.tcp, "the TCP connection outlived the deny under enforce");
    o.cuts.sort();
    assert_eq!(o.cuts, vec![(DIR_INGRESS, 6), (DIR_INGRESS, 17)]);
    assert!(o.counted_per_datagram >= 1, "a dropped datagram was not counted");
}

/// `enforce`, the UDP flow alone (nothing else sends): every packet the
/// table drops for the cut is counted as `cut-flow`, one per datagram
/// (without the counter on the mark's rule: 0), and an ICMP error that
/// conntrack relates to the cut flow is dropped by the mark too and
/// counted (the kernel gives a related packet its connection's entry, and
/// so its mark; had it passed as `related`: 0).
#[test]
fn enforce_counts_every_dropped_packet_of_a_cut_flow() {
    let o = after_deny("npmestc", true, false, false);
    assert!(!o.udp, "the UDP flow outlived the deny under enforce");
    assert_eq!(o.cuts, vec![(DIR_INGRESS, 17)]);
    assert_eq!(o.counted_per_datagram, 1, "one datagram, one counted drop");
    assert_eq!(o.counted_for_icmp_error, 1, "the related ICMP error passed");
}

/// A switch to `enforce` alone (an apply of an empty diff, as the sync
/// loop makes for the annotation) cuts the flows that a denying change
/// left under `keep`: the conntrack pass runs at every apply.
#[test]
fn a_switch_to_enforce_alone_cuts_the_kept_flows() {
    let mut o = after_deny("npmests", false, true, true);
    assert!(!o.udp, "the UDP flow outlived the switch to enforce");
    assert!(!o.tcp, "the TCP connection outlived the switch to enforce");
    o.cuts.sort();
    assert_eq!(o.cuts, vec![(DIR_INGRESS, 6), (DIR_INGRESS, 17)]);
}
