//! Connection semantics on eBPF: endpoint 1 (`10.0.0.1`,
//! isolated both ways) has a tracked UDP flow to the pod `10.0.0.2` (its
//! egress) and a tracked TCP connection from it (its ingress). Then a
//! policy change denies both (the allow entries go, the peer stays the
//! same pod). Under `keep` their next packets pass as tracked; under
//! `enforce`, once the change's apply (or full sync) returned, the next
//! packet of each is decided again and dropped (`ConnectionCut`, one deny
//! event naming the direction that now denies), and every later packet of
//! the connection, from either side, is dropped too (`CutFlow`: the entry
//! stays, marked cut, so the other side cannot open it again in its own
//! direction); a new TCP connection is decided by the policy. A change
//! that still allows the flows keeps them (decided again once, then
//! tracked). A reply packet is decided as its connection's original
//! packet. Through `BPF_PROG_TEST_RUN`; the per-CPU flow cache is on
//! (its slot must not vouch for a flow past its endpoint's epoch). Needs
//! root.

use std::collections::BTreeSet;

use crate::ebpf_common::*;
use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS};
use npm_dataplane::ebpf::{EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Egress as EG, Direction::Ingress as IN, IpEntry};
use npm_policy::model::Protocol::{Tcp, Udp};

const PEER: u32 = 300;

/// Endpoint 1 with, when `allowed`, UDP 5000 to and TCP 80 from the pod
/// `10.0.0.2` (identity `PEER`, always the same owner); `extra` adds an
/// unrelated allow (a change that denies nothing).
fn state(allowed: bool, extra: bool) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), Some("fd00::1"), true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "fd00::1", 256, 0);
    for peer in ["10.0.0.2", "fd00::2"] {
        c.ipcache.insert(
            peer.parse().unwrap(),
            IpEntry {
                identity: PEER,
                cidr_identity: 0,
                owner: IpEntry::pod_owner("peer"),
            },
        );
    }
    if allowed {
        allow(&mut c, 1, EG, PEER, Some(Udp), (5000, 5000), 1);
        allow(&mut c, 1, IN, PEER, Some(Tcp), (80, 80), 2);
    }
    if extra {
        allow(&mut c, 1, IN, PEER, Some(Tcp), (8080, 8080), 3);
    }
    c
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Via {
    Diff,
    FullSync,
}

const TRACKED: (i32, Option<Reason>) = (VERDICT_ALLOW, Some(Reason::Tracked));
const CUT: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::ConnectionCut));
const DENY: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::PolicyDenied));
const CUT_FLOW: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::CutFlow));

struct Fixture {
    _pins: PinDir,
    a: Dummy,
    dp: EbpfDataplane,
    c: Compiled,
}

impl Fixture {
    /// A dataplane on a fresh interface with both flows established, the
    /// endpoint under `enforce` or not.
    fn new(tag: &str, enforce: bool) -> Fixture {
        sweep_leftovers();
        let pins = PinDir::new(tag);
        let a = Dummy::new(&format!("{tag}a"));
        let mut dp = pins.open();
        dp.set_established_enforce(if enforce { BTreeSet::from([1]) } else { BTreeSet::new() });
        let c = state(true, false);
        dp.sync_full(&c, &ifaces(&[(1, a.ifindex)])).unwrap();
        let mut f = Fixture { _pins: pins, a, dp, c };
        assert_eq!(f.run(EG, udp_out()), (VERDICT_ALLOW, Some(Reason::Policy)));
        assert_eq!(f.run(IN, udp_back()), TRACKED);
        assert_eq!(f.run(EG, udp_out()), TRACKED);
        assert_eq!(f.run(IN, tcp_in(0x02)), (VERDICT_ALLOW, Some(Reason::Policy)));
        assert_eq!(f.run(EG, tcp_back(0x12)), TRACKED);
        assert_eq!(f.run(IN, tcp_in(0x10)), TRACKED);
        f.dp.poll_deny_events();
        f
    }

    fn run(&mut self, dir: npm_policy::compiled::Direction, pkt: Vec<u8>) -> (i32, Option<Reason>) {
        self.dp.test_run(dir, self.a.ifindex, &pkt).unwrap()
    }

    /// Programs `next` `via` a diff or a full sync.
    fn change(&mut self, next: Compiled, via: Via) {
        let ifs = ifaces(&[(1, self.a.ifindex)]);
        match via {
            Via::Diff => self.dp.apply(&self.c.diff(&next), &next, &ifs).unwrap(),
            Via::FullSync => self.dp.sync_full(&next, &ifs).unwrap(),
        }
        self.c = next;
    }

    /// The cut events since the last call: (direction, protocol).
    fn cuts(&mut self) -> Vec<(u8, u8)> {
        self.dp
            .poll_deny_events()
            .into_iter()
            .filter(|e| e.reason == Reason::ConnectionCut as u8)
            .map(|e| (e.direction, e.protocol))
            .collect()
    }
}

/// The packets dropped as parts of cut connections, both directions.
fn cut_flow_drops(dp: &EbpfDataplane) -> u64 {
    dp.counters().unwrap().packets_both_ways(Reason::CutFlow)
}

fn udp_out() -> Vec<u8> {
    v4("10.0.0.1", "10.0.0.2", L4::Udp(40000, 5000))
}
fn udp_back() -> Vec<u8> {
    v4("10.0.0.2", "10.0.0.1", L4::Udp(5000, 40000))
}
fn tcp_in(flags: u8) -> Vec<u8> {
    v4("10.0.0.2", "10.0.0.1", L4::Tcp(41000, 80, flags))
}
fn tcp_back(flags: u8) -> Vec<u8> {
    v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 41000, flags))
}

/// `keep`: the denying change leaves both flows tracked (no cut, no
/// event), by a diff and by a full sync.
#[test]
fn keep_lets_tracked_flows_pass_after_a_deny() {
    for (tag, via) in [("esk", Via::Diff), ("eskf", Via::FullSync)] {
        let mut f = Fixture::new(tag, false);
        let epoch = f.dp.endpoint_epoch(f.a.ifindex).unwrap();
        f.change(state(false, false), via);
        assert_eq!(
            f.dp.endpoint_epoch(f.a.ifindex).unwrap(),
            epoch,
            "{via:?}: keep never moves"
        );
        assert_eq!(f.run(EG, udp_out()), TRACKED, "{via:?}");
        assert_eq!(f.run(IN, tcp_in(0x10)), TRACKED, "{via:?}");
        assert!(f.cuts().is_empty(), "{via:?}");
    }
}

/// `enforce`: after the denying change's apply returned, the next packet
/// of the UDP flow and of the TCP connection is dropped as a cut, one
/// event each in the direction that now denies; their entries are gone,
/// so the next packet is a plain deny. Without the epoch (the code before
/// issue #45, which is what `keep` still does) both passed as tracked.
#[test]
fn enforce_cuts_tracked_flows_the_new_policy_denies() {
    for (tag, via) in [("ese", Via::Diff), ("esef", Via::FullSync)] {
        let mut f = Fixture::new(tag, true);
        f.change(state(false, false), via);
        assert_eq!(f.run(EG, udp_out()), CUT, "{via:?}");
        assert_eq!(f.run(IN, tcp_in(0x10)), CUT, "{via:?}");
        assert_eq!(f.cuts(), vec![(DIR_EGRESS, 17), (DIR_INGRESS, 6)], "{via:?}");
        // Every later packet of both, whichever side sends it, each
        // counted (`cut-flow`).
        let counted = cut_flow_drops(&f.dp);
        for _ in 0..2 {
            assert_eq!(f.run(EG, udp_out()), CUT_FLOW, "{via:?}");
            assert_eq!(f.run(IN, udp_back()), CUT_FLOW, "{via:?}");
            assert_eq!(f.run(IN, tcp_in(0x10)), CUT_FLOW, "{via:?}");
            assert_eq!(f.run(EG, tcp_back(0x10)), CUT_FLOW, "{via:?}");
        }
        assert_eq!(cut_flow_drops(&f.dp) - counted, 8, "{via:?}");
        assert!(f.cuts().is_empty(), "{via:?}: a cut is reported once");
        // A new connection on the same tuple is decided by the policy.
        assert_eq!(f.run(IN, tcp_in(0x02)), DENY, "{via:?}");
    }
}

/// `enforce`: after a cut, the side whose own direction allows it cannot
/// open the connection again by sending first: the pod's segment (its
/// egress allows TCP to the peer) is dropped, and so is the peer's next
/// one. Had the entry been removed,
/// the pod's segment would have opened a new flow in its egress direction
/// (allowed) and the peer's segments would have passed as its replies.
#[test]
fn enforce_a_cut_cannot_be_reopened_by_the_other_side() {
    let mut f = Fixture::new("eso", true);
    // The pod's egress allows anything towards the peer on TCP.
    let mut next = state(false, false);
    allow(&mut next, 1, EG, PEER, Some(Tcp), (0, 65535), 4);
    f.change(next, Via::Diff);
    // The peer's segment is cut (ingress of TCP 80 denies now).
    assert_eq!(f.run(IN, tcp_in(0x10)), CUT);
    // The pod answers first: not a new flow of its egress.
    assert_eq!(f.run(EG, tcp_back(0x10)), CUT_FLOW);
    assert_eq!(f.run(IN, tcp_in(0x10)), CUT_FLOW);
}

/// `enforce`: a reply packet is decided as its connection's original
/// packet: the UDP flow's reply (ingress hook) is cut for the egress that
/// opened it, the TCP connection's reply (egress hook) for its ingress.
#[test]
fn enforce_decides_a_reply_as_its_original_packet() {
    let mut f = Fixture::new("esr", true);
    f.change(state(false, false), Via::Diff);
    assert_eq!(f.run(IN, udp_back()), CUT);
    assert_eq!(f.run(EG, tcp_back(0x10)), CUT);
    assert_eq!(f.cuts(), vec![(DIR_EGRESS, 17), (DIR_INGRESS, 6)]);
}

/// `enforce`: a change that still allows the flows keeps them: decided
/// again once (allowed), then tracked under the new epoch; nothing cut.
#[test]
fn enforce_keeps_flows_the_new_policy_still_allows() {
    let mut f = Fixture::new("esa", true);
    let epoch = f.dp.endpoint_epoch(f.a.ifindex).unwrap();
    f.change(state(true, true), Via::Diff);
    assert_ne!(
        f.dp.endpoint_epoch(f.a.ifindex).unwrap(),
        epoch,
        "the change moved the epoch"
    );
    for _ in 0..2 {
        assert_eq!(f.run(EG, udp_out()), TRACKED);
        assert_eq!(f.run(IN, udp_back()), TRACKED);
        assert_eq!(f.run(IN, tcp_in(0x10)), TRACKED);
        assert_eq!(f.run(EG, tcp_back(0x10)), TRACKED);
    }
    assert!(f.cuts().is_empty());
    // And a later denying change still cuts them.
    f.change(state(false, true), Via::Diff);
    assert_eq!(f.run(EG, udp_out()), CUT);
    assert_eq!(f.run(IN, tcp_in(0x10)), CUT);
}

/// An endpoint moved from `keep` to `enforce` has its flows decided at the
/// next change, the ones of the other endpoint only under `enforce`: the
/// set handed to the dataplane is what counts, per endpoint.
#[test]
fn only_enforce_endpoints_are_cut() {
    let mut f = Fixture::new("esm", false);
    f.dp.set_established_enforce(BTreeSet::from([2]));
    f.change(state(false, false), Via::Diff);
    assert_eq!(f.run(EG, udp_out()), TRACKED);
    f.dp.set_established_enforce(BTreeSet::from([1]));
    f.change(state(false, true), Via::Diff);
    assert_eq!(f.run(EG, udp_out()), CUT);
    assert_eq!(f.run(IN, tcp_in(0x10)), CUT);
}

/// An ICMP error from `src` to `dst` (IPv4 type 3 code 4, Fragmentation
/// Needed, or ICMPv6 type 2, Packet Too Big, by the family of `quoted`)
/// quoting the IP header and the first 8 L4 bytes of the frame `quoted`.
fn icmp_error(src: &str, dst: &str, quoted: &[u8]) -> Vec<u8> {
    let v4_frame = quoted[14] >> 4 == 4;
    let t = if v4_frame { 3 } else { 2 };
    let code = if v4_frame { 4 } else { 0 };
    let mut b = vec![t, code, 0, 0, 0, 0, 0x05, 0x78];
    let ihl = if v4_frame {
        ((quoted[14] & 0x0f) as usize) * 4
    } else {
        40
    };
    b.extend(&quoted[14..14 + ihl + 8]);
    if v4_frame {
        v4(src, dst, L4::Raw(1, b))
    } else {
        v6(src, dst, L4::Raw(58, b))
    }
}

fn udp6_out() -> Vec<u8> {
    v6("fd00::1", "fd00::2", L4::Udp(40000, 5000))
}
fn udp6_back() -> Vec<u8> {
    v6("fd00::2", "fd00::1", L4::Udp(5000, 40000))
}

const RELATED: (i32, Option<Reason>) = (VERDICT_ALLOW, Some(Reason::Related));

/// `enforce`: an ICMP error (IPv4 and IPv6) quoting a tracked flow the
/// new policy denies does not pass as related: the first one, arriving
/// before any packet of the flow, has the flow decided again and is
/// dropped as its cut (one cut event); later ones, and the errors of a
/// flow an ordinary packet cut, are dropped as `cut-flow`. Before this,
/// both passed as `Related` (run against the object without the fix:
/// `RELATED` where `CUT` and `CUT_FLOW` are expected).
#[test]
fn enforce_drops_the_icmp_errors_of_a_cut_flow() {
    for (tag, via) in [("esi", Via::Diff), ("esif", Via::FullSync)] {
        let mut f = Fixture::new(tag, true);
        assert_eq!(f.run(EG, udp6_out()), (VERDICT_ALLOW, Some(Reason::Policy)));
        assert_eq!(f.run(IN, udp6_back()), TRACKED);
        let router = "192.168.50.1";
        let router6 = "2001:db8::1";
        // Before the change, the errors of both flows pass as related.
        assert_eq!(f.run(IN, icmp_error(router, "10.0.0.1", &udp_out())), RELATED);
        assert_eq!(f.run(IN, icmp_error(router6, "fd00::1", &udp6_out())), RELATED);
        assert_eq!(f.run(IN, icmp_error(router, "10.0.0.1", &tcp_back(0x10))), RELATED);
        f.change(state(false, false), via);
        // The UDP flows: the error comes first and cuts them.
        assert_eq!(f.run(IN, icmp_error(router, "10.0.0.1", &udp_out())), CUT, "{via:?}");
        assert_eq!(f.run(IN, icmp_error(router6, "fd00::1", &udp6_out())), CUT, "{via:?}");
        // The cut events name the connections, not their errors.
        assert_eq!(f.cuts(), vec![(DIR_EGRESS, 17), (DIR_EGRESS, 17)], "{via:?}");
        for _ in 0..2 {
            assert_eq!(
                f.run(IN, icmp_error(router, "10.0.0.1", &udp_out())),
                CUT_FLOW,
                "{via:?}"
            );
            assert_eq!(
                f.run(IN, icmp_error(router6, "fd00::1", &udp6_out())),
                CUT_FLOW,
                "{via:?}"
            );
        }
        assert_eq!(f.run(EG, udp_out()), CUT_FLOW, "{via:?}");
        assert_eq!(f.run(EG, udp6_out()), CUT_FLOW, "{via:?}");
        // The TCP connection: cut by its own packet, then its error.
        assert_eq!(f.run(IN, tcp_in(0x10)), CUT, "{via:?}");
        assert_eq!(
            f.run(IN, icmp_error(router, "10.0.0.1", &tcp_back(0x10))),
            CUT_FLOW,
            "{via:?}"
        );
        // An error the pod sends about a cut flow's packet: dropped too.
        assert_eq!(
            f.run(EG, icmp_error("10.0.0.1", "10.0.0.2", &tcp_in(0x10))),
            CUT_FLOW,
            "{via:?}"
        );
        assert_eq!(f.cuts(), vec![(DIR_INGRESS, 6)], "{via:?}");
    }
}

/// `enforce`, a change that still allows the flows: an ICMP error quoting
/// one passes as related, and has the flow decided again on the way (its
/// next packet is tracked under the new epoch, nothing is cut); under
/// `keep` a denying change leaves the errors related.
#[test]
fn icmp_errors_of_allowed_or_kept_flows_stay_related() {
    let mut f = Fixture::new("esia", true);
    f.change(state(true, true), Via::Diff);
    let err = icmp_error("192.168.50.1", "10.0.0.1", &udp_out());
    assert_eq!(f.run(IN, err.clone()), RELATED);
    assert_eq!(f.run(IN, err.clone()), RELATED);
    assert_eq!(f.run(EG, udp_out()), TRACKED);
    assert!(f.cuts().is_empty());
    let mut k = Fixture::new("esik", false);
    k.change(state(false, false), Via::Diff);
    assert_eq!(k.run(IN, err), RELATED);
    assert!(k.cuts().is_empty());
}

/// A switch to `enforce` alone (the Namespace annotation, nothing else
/// changed: the sync loop applies an empty diff) judges the endpoint's
/// kept flows by the policy in force: the flows that a denying change left
/// tracked under `keep` are cut at their next packet. Without the switch
/// moving the epoch (before: only a change that touched the endpoint's
/// decisions did), both passed as tracked.
#[test]
fn a_switch_to_enforce_alone_judges_the_kept_flows() {
    for (tag, via) in [("esw", Via::Diff), ("eswf", Via::FullSync)] {
        let mut f = Fixture::new(tag, false);
        f.change(state(false, false), Via::Diff);
        assert_eq!(f.run(EG, udp_out()), TRACKED, "{via:?}: keep");
        f.dp.set_established_enforce(BTreeSet::from([1]));
        f.change(state(false, false), via);
        assert_eq!(f.run(EG, udp_out()), CUT, "{via:?}");
        assert_eq!(f.run(IN, tcp_in(0x10)), CUT, "{via:?}");
        assert_eq!(f.cuts(), vec![(DIR_EGRESS, 17), (DIR_INGRESS, 6)], "{via:?}");
    }
}

/// An endpoint that leaves `enforce` keeps its flows through a denying
/// change, and has them judged again when it comes back (by an empty
/// apply). Fails without the switch moving the epoch.
#[test]
fn leaving_enforce_and_coming_back_judges_the_kept_flows() {
    let mut f = Fixture::new("esb", true);
    f.dp.set_established_enforce(BTreeSet::new());
    f.change(state(true, false), Via::Diff);
    f.change(state(false, false), Via::Diff);
    assert_eq!(f.run(EG, udp_out()), TRACKED, "keep: the flow outlives the deny");
    f.dp.set_established_enforce(BTreeSet::from([1]));
    f.change(state(false, false), Via::Diff);
    assert_eq!(f.run(EG, udp_out()), CUT);
}
