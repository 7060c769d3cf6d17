//! Flow events of the nftables dataplane, read through NFLOG
//! (`npm_dataplane::nft::nflog`): real TCP connections between pod
//! namespaces through a node namespace that holds the table. A denied
//! connection gives deny events with the endpoint, direction, reason and
//! 5-tuple; an allowed new connection of an endpoint with `report_new`
//! gives exactly one allow event, its tracked packets none, and the same
//! connection of an unflagged endpoint none. Needs root.

use std::net::{IpAddr, Ipv4Addr};

use npm_common::{DenyEvent, Reason, DIR_INGRESS};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

use crate::nft_common::allow;
use crate::nft_common::tier_topo::{base, pod_ip, Topo, A, B, C, EP_B, ID_A};

fn v4(b: [u8; 16]) -> IpAddr {
    assert_eq!(&b[..12], &[0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff]);
    IpAddr::V4(Ipv4Addr::new(b[12], b[13], b[14], b[15]))
}

fn ip_of(pod: usize) -> IpAddr {
    pod_ip(pod).parse().unwrap()
}

/// b isolated for ingress, a may reach its TCP 8000; b reports new
/// connections when `report_new`.
fn policy(report_new: bool) -> Compiled {
    let mut c = base();
    let b = c.endpoints.get_mut(&EP_B).unwrap();
    b.isolated_ingress = true;
    b.report_new = report_new;
    allow(
        &mut c,
        EP_B,
        Direction::Ingress,
        ID_A,
        Some(Protocol::Tcp),
        (8000, 8000),
    );
    c
}

/// The events about connections from pod `from` to b's TCP 8000.
fn to_b(events: &[DenyEvent], from: usize) -> Vec<DenyEvent> {
    events
        .iter()
        .filter(|e| e.family == 4 && v4(e.src) == ip_of(from) && v4(e.dst) == ip_of(B) && e.dport == 8000)
        .copied()
        .collect()
}

#[test]
fn nflog_deny_and_allow_events_of_real_connections() {
    let topo = Topo::new("nflog");
    let mut dp = topo.dataplane("nflog");
    dp.open_flow_events()
        .expect("bind the NFLOG group in the node namespace");
    let unflagged = policy(false);
    dp.sync_full(&unflagged, &topo.ifs).unwrap();
    let _ = dp.poll_flow_events();
    let b_if = topo.ifs[&EP_B];

    // Denied: c -> b, deny events (the SYN and its retransmissions, within
    // the rate) naming b, ingress, policy-denied, the 5-tuple.
    assert_eq!(topo.tcp(C, B, 8000), "timeout");
    let events = dp.poll_flow_events();
    let denied = to_b(&events, C);
    assert!(!denied.is_empty(), "no deny event: {events:?}");
    for e in &denied {
        assert!(!e.is_allow(), "{e:?}");
        assert_eq!(
            (e.endpoint, e.direction, e.reason),
            (EP_B, DIR_INGRESS, Reason::PolicyDenied as u8)
        );
        assert_eq!((e.protocol, e.ifindex), (6, b_if));
        assert_ne!(e.sport, 0);
    }
    assert!(
        denied.iter().all(|e| e.sport == denied[0].sport),
        "one connection: {denied:?}"
    );

    // Allowed, unflagged: nothing.
    assert_eq!(topo.tcp(A, B, 8000), "ok");
    let events = dp.poll_flow_events();
    assert!(to_b(&events, A).is_empty(), "unflagged endpoint logged: {events:?}");

    // Allowed, flagged: exactly one allow event (the SYN); the handshake's
    // ACK, the data and the FIN (tracked) none.
    let flagged = policy(true);
    dp.apply(&unflagged.diff(&flagged), &flagged, &topo.ifs).unwrap();
    let _ = dp.poll_flow_events();
    assert_eq!(topo.tcp(A, B, 8000), "ok");
    let events = dp.poll_flow_events();
    let allowed = to_b(&events, A);
    assert_eq!(allowed.len(), 1, "one allow event per new connection: {events:?}");
    let e = allowed[0];
    assert!(e.is_allow());
    assert_eq!(
        (e.endpoint, e.direction, e.reason),
        (EP_B, DIR_INGRESS, Reason::Policy as u8)
    );
    assert_eq!((e.protocol, e.ifindex), (6, b_if));
    assert_ne!(e.sport, 0);
    // Still denied for c, as a deny.
    assert_eq!(topo.tcp(C, B, 8000), "timeout");
    let events = dp.poll_flow_events();
    assert!(!to_b(&events, C).is_empty() && to_b(&events, C).iter().all(|e| !e.is_allow()));
    dp.remove().unwrap();
}
