//! Allow events of new connections: an endpoint whose compiled
//! record has `report_new` (`EP_REPORT_NEW`) sends one allow event to
//! `NPM_EVENTS` for the packet that opens each new tracked flow, none for
//! its tracked packets; an unflagged endpoint sends none; an explain dry
//! run sends none. Real TCP connections across a veth into a pod netns
//! (both the IPv4 fast path and the general path). Needs root.

use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::Duration;

use crate::ebpf_common::*;
use npm_common::{DenyEvent, Reason, DIR_INGRESS};
use npm_dataplane::ebpf::{explain, BenchSwitches, EbpfDataplane};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol::Tcp;

const TCP_PORT: u16 = 8080;
const UDP_PORT: u16 = 8081;

/// The pod's policy (the peer may reach TCP 8080) with `report_new` set as
/// asked on its endpoint.
fn policy(net: &PodNet, report_new: bool) -> Compiled {
    let mut c = pod_policy(net, &[(Tcp, TCP_PORT)]);
    c.endpoints.get_mut(&1).expect("endpoint 1").report_new = report_new;
    c
}

/// A connection to the pod's echo server with one line echoed.
fn connect(net: &PodNet) -> (TcpStream, BufReader<TcpStream>) {
    let s = TcpStream::connect_timeout(&SocketAddr::from((net.pod_ip, TCP_PORT)), Duration::from_secs(3))
        .expect("connect to the pod");
    s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let r = BufReader::new(s.try_clone().unwrap());
    let mut c = (s, r);
    echo(&mut c, "hello\n");
    c
}

fn echo(c: &mut (TcpStream, BufReader<TcpStream>), line: &str) {
    c.0.write_all(line.as_bytes()).unwrap();
    let mut got = String::new();
    c.1.read_line(&mut got).unwrap();
    assert_eq!(got, line);
}

/// The events of the connection from local `port` (the readiness probes
/// made before the program was attached may still have packets in flight,
/// untracked, hence denied), all of which must be allow events (nothing of
/// this connection is denied).
fn of_port(events: &[DenyEvent], port: u16) -> Vec<DenyEvent> {
    let mine: Vec<DenyEvent> = events
        .iter()
        .filter(|e| e.sport == port || e.dport == port)
        .copied()
        .collect();
    assert!(mine.iter().all(DenyEvent::is_allow), "unexpected deny event: {mine:?}");
    mine
}

fn run(tag: &str, general: bool) {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let mut net = PodNet::new(tag);
    net.start_servers(TCP_PORT, &[UDP_PORT]);
    // Before any program is attached: the servers answer.
    net.wait_ready(TCP_PORT, UDP_PORT);
    let switches = BenchSwitches {
        no_fast_v4: general,
        no_flow_cache: general,
        ..BenchSwitches::default()
    };
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    let ifs = ifaces(&[(1, net.ifindex)]);
    let unflagged = policy(&net, false);
    dp.sync_full(&unflagged, &ifs).unwrap();
    let _ = dp.poll_deny_events();

    // Unflagged: a new connection and its traffic send nothing.
    let mut c = connect(&net);
    echo(&mut c, "more\n");
    let port = c.0.local_addr().unwrap().port();
    let events = of_port(&dp.poll_deny_events(), port);
    assert!(events.is_empty(), "unflagged endpoint sent events: {events:?}");
    drop(c);

    // Flagged: exactly one allow event for the new connection, the SYN.
    let flagged = policy(&net, true);
    dp.apply(&unflagged.diff(&flagged), &flagged, &ifs).unwrap();
    let _ = dp.poll_deny_events();
    let mut c = connect(&net);
    let local = c.0.local_addr().unwrap();
    let events = of_port(&dp.poll_deny_events(), local.port());
    assert_eq!(events.len(), 1, "one allow event per new connection: {events:?}");
    let e = events[0];
    assert_eq!(e.endpoint, 1);
    assert_eq!(e.ifindex, net.ifindex);
    assert_eq!(e.direction, DIR_INGRESS);
    assert_eq!(e.reason, Reason::Policy as u8);
    assert_eq!((e.protocol, e.family), (6, 4));
    assert_eq!((e.sport, e.dport), (local.port(), TCP_PORT));
    let v4 = |b: [u8; 16]| IpAddr::from([b[12], b[13], b[14], b[15]]);
    assert_eq!(v4(e.src), IpAddr::V4(net.peer_ip));
    assert_eq!(v4(e.dst), IpAddr::V4(net.pod_ip));
    assert_eq!(&e.src[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);

    // Tracked packets (both directions) send none.
    for i in 0..5 {
        echo(&mut c, &format!("tracked {i}\n"));
    }
    let events = of_port(&dp.poll_deny_events(), local.port());
    assert!(events.is_empty(), "tracked packets sent events: {events:?}");

    // A dry run (npm-agent explain) of a new connection sends none.
    let pkt = explain::crafted_packet(IpAddr::V4(net.peer_ip), IpAddr::V4(net.pod_ip), 6, TCP_PORT).unwrap();
    let verdict = explain::explain_run(&pins.path, net.ifindex, Direction::Ingress, &pkt).unwrap();
    assert!(verdict.allowed, "{verdict:?}");
    let events: Vec<DenyEvent> = dp.poll_deny_events().into_iter().filter(DenyEvent::is_allow).collect();
    assert!(events.is_empty(), "a dry run sent events: {events:?}");

    // A second connection: one more event.
    let c2 = connect(&net);
    let port2 = c2.0.local_addr().unwrap().port();
    let events = of_port(&dp.poll_deny_events(), port2);
    assert_eq!(events.len(), 1, "{events:?}");
    assert_eq!(events[0].sport, port2);
}

#[test]
fn allow_events_of_new_connections_fast_path() {
    run("ae", false);
}

#[test]
fn allow_events_of_new_connections_general_path() {
    run("aeg", true);
}
