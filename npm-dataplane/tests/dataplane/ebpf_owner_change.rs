//! Incident 1 in the eBPF conntrack: an address that changes hands never
//! carries the old owner's connections. Endpoint 1 (`10.0.0.1`, isolated
//! both ways) has a tracked UDP flow to the peer `10.0.0.2` and a tracked
//! TCP connection from it; the peer is a pod elsewhere (its conntrack
//! entries are keyed by endpoint 1 only). When the peer address passes to
//! another pod (a new owner, `IpEntry::owner`) or leaves its pod, the
//! flows are purged and the next packet of each is decided anew; a relabel
//! of the same pod (same owner) keeps them (established connections are
//! kept across policy changes). Through `BPF_PROG_TEST_RUN`, by a diff and
//! by a full sync. The purge runs on the conntrack worker, off the sync
//! thread: the next packet after the worker completed the batch's
//! request (`wait_flow_purges`, an event, never a sleep) meets the new
//! owner. The per-CPU flow cache, which vouches for a purged flow for at
//! most 250 ms, is off here. Needs root.

use crate::ebpf_common::*;
use npm_common::Reason;
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP, WORKER_THREAD};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Egress as EG, Direction::Ingress as IN, IpEntry};
use npm_policy::model::Protocol::{Tcp, Udp};

/// A bound that only a broken worker reaches (a pass over these maps
/// takes milliseconds): the tests wait for the completion event.
const PURGE_WAIT: std::time::Duration = std::time::Duration::from_secs(60);

const ALLOWED: u32 = 300;
const DENIED: u32 = 301;

/// Endpoint 1 allowed UDP 5000 to, and TCP 80 from, identity `ALLOWED`;
/// the peer `10.0.0.2` with `identity`, held by the pod with UID `owner`
/// (`None`: the address belongs to no pod).
fn state(peer: Option<(u32, &str)>) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    if let Some((identity, owner)) = peer {
        c.ipcache.insert(
            "10.0.0.2".parse().unwrap(),
            IpEntry {
                identity,
                cidr_identity: 0,
                owner: IpEntry::pod_owner(owner),
            },
        );
    }
    allow(&mut c, 1, EG, ALLOWED, Some(Udp), (5000, 5000), 1);
    allow(&mut c, 1, IN, ALLOWED, Some(Tcp), (80, 80), 2);
    c
}

/// How the next state reaches the kernel.
#[derive(Clone, Copy, Debug)]
enum Via {
    Diff,
    FullSync,
}

/// Opens a dataplane on a fresh interface with `state(first)`, opens the two
/// flows, moves to `state(next)` `via` a diff or a full sync, and returns the
/// (verdict, reason) of the next packet of the UDP flow (egress) and of the
/// TCP connection (ingress).
fn after_change(tag: &str, first: (u32, &str), next: Option<(u32, &str)>, via: Via) -> [(i32, Option<Reason>); 2] {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let a = Dummy::new(&format!("{tag}a"));
    let switches = BenchSwitches {
        no_flow_cache: true,
        ..BenchSwitches::default()
    };
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    let ifs = ifaces(&[(1, a.ifindex)]);
    let c1 = state(Some(first));
    dp.sync_full(&c1, &ifs).unwrap();
    let run = |dp: &EbpfDataplane, dir, pkt: Vec<u8>| dp.test_run(dir, a.ifindex, &pkt).unwrap();
    let udp_out = || v4("10.0.0.1", "10.0.0.2", L4::Udp(40000, 5000));
    let udp_back = || v4("10.0.0.2", "10.0.0.1", L4::Udp(5000, 40000));
    let tcp_in = |flags| v4("10.0.0.2", "10.0.0.1", L4::Tcp(41000, 80, flags));
    let tcp_back = |flags| v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 41000, flags));
    let allow = |r| (VERDICT_ALLOW, Some(r));
    // The two flows, established with the first owner.
    assert_eq!(run(&dp, EG, udp_out()), allow(Reason::Policy));
    assert_eq!(run(&dp, IN, udp_back()), allow(Reason::Tracked));
    assert_eq!(run(&dp, EG, udp_out()), allow(Reason::Tracked));
    assert_eq!(run(&dp, IN, tcp_in(0x02)), allow(Reason::Policy));
    assert_eq!(run(&dp, EG, tcp_back(0x12)), allow(Reason::Tracked));
    assert_eq!(run(&dp, IN, tcp_in(0x10)), allow(Reason::Tracked));

    let c2 = state(next);
    match via {
        Via::Diff => dp.apply(&c1.diff(&c2), &c2, &ifs).unwrap(),
        Via::FullSync => dp.sync_full(&c2, &ifs).unwrap(),
    }
    // The purge is complete once the worker says so, on its own thread.
    let done = dp.wait_flow_purges(PURGE_WAIT).unwrap();
    assert_eq!(done.completed, done.requested);
    assert_eq!(done.thread.as_deref(), Some(WORKER_THREAD));
    [run(&dp, EG, udp_out()), run(&dp, IN, tcp_in(0x10))]
}

const DENY: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::PolicyDenied));
const TRACKED: (i32, Option<Reason>) = (VERDICT_ALLOW, Some(Reason::Tracked));

/// A new pod with other labels on the old owner's address: the old flows
/// are gone, the new owner is denied both ways. Without the purge both
/// packets passed as tracked.
#[test]
fn a_new_owner_with_other_labels_gets_no_old_flow() {
    for (tag, via) in [("ocd", Via::Diff), ("ocf", Via::FullSync)] {
        let got = after_change(tag, (ALLOWED, "old"), Some((DENIED, "new")), via);
        assert_eq!(got, [DENY, DENY], "{via:?}");
    }
}

/// A new pod with the same labels (the same identity: only the owner
/// tells): the UDP flow's next packet is a new flow, decided (and allowed)
/// again; the TCP segment without a handshake of its own is not a new
/// connection and finds no tracked one.
#[test]
fn a_new_owner_with_the_same_labels_is_decided_anew() {
    for (tag, via) in [("osd", Via::Diff), ("osf", Via::FullSync)] {
        let got = after_change(tag, (ALLOWED, "old"), Some((ALLOWED, "new")), via);
        assert_eq!(got[0], (VERDICT_ALLOW, Some(Reason::Policy)), "{via:?}");
        assert_ne!(got[1], TRACKED, "{via:?}");
    }
}

/// The address leaves its pod (a pod that lost its IP): its flows go.
#[test]
fn an_address_that_leaves_its_pod_loses_its_flows() {
    for (tag, via) in [("old", Via::Diff), ("olf", Via::FullSync)] {
        let got = after_change(tag, (ALLOWED, "old"), None, via);
        assert_eq!(got, [DENY, DENY], "{via:?}");
    }
}

/// The same pod relabelled (a new identity, the same owner): its
/// established flows are kept, as every policy change keeps them.
#[test]
fn a_relabelled_owner_keeps_its_flows() {
    for (tag, via) in [("ord", Via::Diff), ("orf", Via::FullSync)] {
        let got = after_change(tag, (ALLOWED, "old"), Some((DENIED, "old")), via);
        assert_eq!(got, [TRACKED, TRACKED], "{via:?}");
    }
}
