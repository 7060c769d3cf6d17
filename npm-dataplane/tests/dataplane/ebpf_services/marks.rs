//! Marks owned by others: between `from_pod` (tc ingress, before
//! netfilter) and the programs that take a deferred Service decision
//! (`to_pod`, `node_exit` at tc egress; `host_in` at `INPUT`), other
//! software rewrites the skb mark. Each case puts one such owner's
//! rewrite in nft chains at every hook in between (prerouting, input,
//! forward, postrouting, at mangle priority) and checks that each Service
//! flow is still decided under its own sender's egress policy: two
//! clients with opposite policies, one Service with a local backend
//! (`to_pod`) and a remote one (`node_exit`), one with a backend on the
//! node's host network (`host_in`).
//!
//! - Calico: the bits of its default `IptablesMarkMask` (`0xffff0000`)
//!   rewritten, here to a value that happens to be the other client's
//!   ifindex (Calico's accept, pass and endpoint mark bits can spell any
//!   value there). The mark used to carry the sender's ifindex in those
//!   bits: a's flows were decided under c's policy (a reached the remote
//!   backend only c may reach, never its own), and `host_in` found no
//!   endpoint and let c's packets to the host through.
//! - Cilium: its magic nibble `0x0f00` set (`0x0200`). The mark used to
//!   carry its magic there: no consumer saw a deferral, every flow passed
//!   undecided.
//! - kube-proxy: the masquerade and drop bits (`0x4000 | 0x8000`) set, and
//!   the flows masqueraded at postrouting as kube-proxy does for marked
//!   packets (`--masquerade-all`): the source `to_pod` and `node_exit` see
//!   is the node's. The old mark kept clear of these bits: a regression
//!   guard, and the SNAT case of finding the sender without the mark.
//!
//! Topology and helpers are the parent module's. Needs root.

use std::collections::BTreeSet;
use std::net::Ipv4Addr;

use super::{
    block, compiled_at, count, host_in, identity, interfaces, probe, program_services, serve, wait_tcp, NatTable, Pod,
    SecondNode, PROBES,
};
use crate::ebpf_common::*;
use npm_common::{proto, DIR_EGRESS, IDENTITY_HOST};
use npm_dataplane::ebpf::{AttachMode, EbpfDataplane, HostInMode, NodeExit};
use npm_dataplane::Dataplane;
use npm_policy::compiled::Direction;
use npm_policy::model::Protocol;

/// Whose mark rewrite sits between `from_pod` and the consumers.
#[derive(Clone, Copy, Debug)]
enum Owner {
    Calico,
    Cilium,
    KubeProxy,
}

/// An nft table of the root netns with `owner`'s mark rewrite at every
/// hook between tc ingress and tc egress or `INPUT` (and, for kube-proxy,
/// the masquerade of packets with its mark); deleted on drop.
struct MarkRules(String);

impl MarkRules {
    /// The rules for packets from `clients` only (tests run in parallel
    /// in one root netns).
    fn new(tag: &str, owner: Owner, other_ifindex: u32, clients: &[Ipv4Addr]) -> MarkRules {
        for t in dead_names(
            sh(&["nft", "list", "tables", "ip"])
                .lines()
                .filter_map(|l| l.strip_prefix("table ip ").map(str::to_string)),
            "npmmark",
        ) {
            sh_quiet(&["nft", "delete", "table", "ip", &t]);
        }
        let name = format!("npmmark{}x{tag}", std::process::id());
        sh_quiet(&["nft", "delete", "table", "ip", &name]);
        let set = match owner {
            Owner::Calico => format!("meta mark set meta mark & 0x0000ffff | {:#x}", other_ifindex << 16),
            Owner::Cilium => "meta mark set meta mark & 0xfffff0ff | 0x00000200".to_string(),
            Owner::KubeProxy => "meta mark set meta mark | 0x0000c000".to_string(),
        };
        let from = format!(
            "ip saddr {{ {} }}",
            clients.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(", ")
        );
        let mut chains = String::new();
        for hook in ["prerouting", "input", "forward", "postrouting"] {
            chains.push_str(&format!(
                "  chain m{hook} {{\n    type filter hook {hook} priority mangle; policy accept;\n    {from} {set}\n  }}\n"
            ));
        }
        if let Owner::KubeProxy = owner {
            chains.push_str(&format!(
                "  chain masq {{\n    type nat hook postrouting priority srcnat; policy accept;\n    {from} meta mark & 0x4000 == 0x4000 masquerade\n  }}\n"
            ));
        }
        let path = format!("/tmp/{name}.nft");
        let _f = TempFile(path.clone());
        std::fs::write(&path, format!("table ip {name} {{\n{chains}}}\n")).unwrap();
        sh(&["nft", "-f", &path]);
        MarkRules(name)
    }
}

impl Drop for MarkRules {
    fn drop(&mut self) {
        sh_quiet(&["nft", "delete", "table", "ip", &self.0]);
    }
}

#[test]
fn calico_marks_leave_each_flow_to_its_sender_tcx() {
    marks_case("ka", 8, Owner::Calico, AttachMode::Tcx);
}

#[test]
fn calico_marks_leave_each_flow_to_its_sender_tc() {
    marks_case("ta", 9, Owner::Calico, AttachMode::Tc);
}

#[test]
fn cilium_marks_leave_each_flow_to_its_sender_tcx() {
    marks_case("ki", 11, Owner::Cilium, AttachMode::Tcx);
}

#[test]
fn cilium_marks_leave_each_flow_to_its_sender_tc() {
    marks_case("ti", 12, Owner::Cilium, AttachMode::Tc);
}

#[test]
fn kube_proxy_marks_and_masquerade_leave_each_flow_to_its_sender_tcx() {
    marks_case("kk", 13, Owner::KubeProxy, AttachMode::Tcx);
}

#[test]
fn kube_proxy_marks_and_masquerade_leave_each_flow_to_its_sender_tc() {
    marks_case("tk", 14, Owner::KubeProxy, AttachMode::Tc);
}

/// Clients a and c (both egress-isolated); Service 1 (TCP 80) DNATed at
/// random to b1 (a local pod) or r2 (a pod of the second node, past the
/// uplink with `node_exit`), Service 2 (TCP 443) to the node's own
/// address on 9443 (`host_in`). a may reach b1 and the host's 9443; c may
/// reach r2 only. `owner`'s mark rewrite in between.
fn marks_case(tag: &str, t: u32, owner: Owner, mode: AttachMode) {
    sweep_leftovers();
    let pid = std::process::id();
    let (base, cips) = block(t);
    let (cip1, cip2) = (Ipv4Addr::from(cips + 1), Ipv4Addr::from(cips + 2));
    let a = Pod::new(&format!("{tag}a"), base, 0);
    let c = Pod::new(&format!("{tag}c"), base, 1);
    let mut b1 = Pod::new(&format!("{tag}b"), base, 2);
    b1.servers.push(serve(&b1.ns.name, b1.ip, "b1", &[8080], &[]));
    let SecondNode {
        node2,
        uplink,
        here,
        there,
        _uplink_guard,
    } = SecondNode::new(&format!("smk2{tag}"), &format!("npt{pid}m{tag}"), base);
    ns_sh(
        &node2.name,
        &["ip", "route", "add", "default", "via", &here.to_string()],
    );
    let r2 = Ipv4Addr::from(base + 5 * 4 + 1);
    ns_sh(&node2.name, &["ip", "addr", "add", &format!("{r2}/32"), "dev", "lo"]);
    sh(&[
        "ip",
        "route",
        "add",
        &format!("{r2}/32"),
        "via",
        &there.to_string(),
        "dev",
        &uplink,
    ]);
    let _s2 = serve(&node2.name, r2, "r2", &[8080], &[]);
    // The host-network backend: a server on the node's address (a's
    // gateway) in the root netns.
    let node_ip = Ipv4Addr::from(base + 1);
    let code = format!(
        "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{node_ip}',9443)); s.listen(64)\nwhile True:\n  c,_=s.accept(); c.sendall(b'host'); c.close()\n"
    );
    let _host = Proc(
        std::process::Command::new("python3")
            .args(["-c", &code])
            .spawn()
            .expect("spawn python3 server"),
    );
    let _nat = NatTable::new(
        &format!("m{tag}"),
        &[
            (cip1, 80, "tcp", vec![b1.ip, r2], 8080),
            (cip2, 443, "tcp", vec![node_ip], 9443),
        ],
    );
    for ns in [&a.ns.name, &c.ns.name] {
        wait_tcp(ns, b1.ip, 8080);
        wait_tcp(ns, r2, 8080);
        wait_tcp(ns, node_ip, 9443);
    }

    let pins = PinDir::new(&format!("svc-mark{tag}"));
    let mut dp: EbpfDataplane = pins.open_in(mode);
    // a = 1, c = 2, b1 = 3, r2 = identity(4).
    let mut st = compiled_at(
        &[(a.ip, true, true), (c.ip, false, true), (b1.ip, false, false)],
        &[r2],
        &[(3, Protocol::Tcp, 8080)],
    );
    ip(&mut st, &node_ip.to_string(), IDENTITY_HOST, 0);
    allow(
        &mut st,
        1,
        Direction::Egress,
        IDENTITY_HOST,
        Some(Protocol::Tcp),
        (9443, 9443),
        20,
    );
    allow(
        &mut st,
        2,
        Direction::Egress,
        identity(4),
        Some(Protocol::Tcp),
        (8080, 8080),
        21,
    );
    dp.sync_full(&st, &interfaces(&[&a, &c, &b1])).unwrap();
    program_services(&pins, &[(cip1, 80, proto::TCP), (cip2, 443, proto::TCP)]);
    let mut exit = NodeExit::open_in(None, &pins.path, mode).expect("load node_exit");
    let up = ifindex_of(&uplink);
    exit.set_interfaces(&BTreeSet::from([up])).expect("attach node_exit");
    let hi = host_in(&pins);
    assert_eq!(hi.mode(), HostInMode::Decided, "xt_bpf available");
    let _rules = MarkRules::new(tag, owner, c.ifindex, &[a.ip, c.ip]);
    dp.poll_deny_events();

    let ra = probe(&a.ns.name, cip1, 80, "tcp", PROBES);
    let rc = probe(&c.ns.name, cip1, 80, "tcp", PROBES);
    let ha = probe(&a.ns.name, cip2, 443, "tcp", 2);
    let hc = probe(&c.ns.name, cip2, 443, "tcp", 2);
    let denies = dp.poll_deny_events();
    let what = format!("{owner:?} {mode:?}: a {ra:?}, c {rc:?}, host: a {ha:?} c {hc:?}");
    // a's flows under a's policy: b1 (to_pod) allowed, r2 (node_exit)
    // denied; c's the other way round.
    assert_eq!(count(&ra, "b1") + count(&ra, "FAIL"), PROBES, "{what}");
    assert!(count(&ra, "b1") > 0 && count(&ra, "FAIL") > 0, "{what}");
    assert_eq!(count(&rc, "r2") + count(&rc, "FAIL"), PROBES, "{what}");
    assert!(count(&rc, "r2") > 0 && count(&rc, "FAIL") > 0, "{what}");
    // host_in: a may reach the host's 9443, c may not.
    assert_eq!(ha, ["host"; 2], "{what}");
    assert_eq!(hc, ["FAIL"; 2], "{what}");
    // And each deny names its sender.
    let denied = |ep: u32, dst: Ipv4Addr, dport: u16| {
        denies.iter().any(|e| {
            e.direction == DIR_EGRESS && e.endpoint == ep && e.dst == dst.to_ipv6_mapped().octets() && e.dport == dport
        })
    };
    assert!(denied(1, r2, 8080), "no deny of a towards r2: {denies:?}");
    assert!(denied(2, b1.ip, 8080), "no deny of c towards b1: {denies:?}");
    assert!(denied(2, node_ip, 9443), "no deny of c towards the host: {denies:?}");
    drop(exit);
}

/// A bridged pod: its host-side veth a port of bridge `br` (which holds
/// the gateway), the pod at /30 number `slot` of `base`.
struct BridgedPod {
    ns: Netns,
    host_if: String,
    ifindex: u32,
    ip: Ipv4Addr,
}

impl BridgedPod {
    fn new(tag: &str, br: &str, base: u32, slot: u32) -> BridgedPod {
        let ns = test_netns(&format!("s{tag}"));
        let host_if = format!("npt{}s{tag}", std::process::id());
        let pod_if = format!("{host_if}x");
        assert!(pod_if.len() < 16, "{pod_if}");
        sh_quiet(&["ip", "link", "del", &host_if]);
        sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &pod_if]);
        sh(&["ip", "link", "set", &pod_if, "netns", &ns.name]);
        sh(&["ip", "link", "set", &host_if, "master", br]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        let gw = Ipv4Addr::from(base + slot * 4 + 1);
        let ip = Ipv4Addr::from(base + slot * 4 + 2);
        ns_sh(&ns.name, &["ip", "addr", "add", &format!("{ip}/30"), "dev", &pod_if]);
        ns_sh(&ns.name, &["ip", "link", "set", &pod_if, "up"]);
        ns_sh(&ns.name, &["ip", "route", "add", "default", "via", &gw.to_string()]);
        let ifindex = ifindex_of(&host_if);
        BridgedPod {
            ns,
            host_if,
            ifindex,
            ip,
        }
    }
}

impl Drop for BridgedPod {
    fn drop(&mut self) {
        sh_quiet(&["ip", "link", "del", &self.host_if]);
    }
}

/// A bridged client: its packets to a Service are routed by the node,
/// so they enter it by the bridge (`ingress_ifindex` is the bridge's, no
/// endpoint's). The sender is then found by the source `from_pod`
/// recorded (`NPM_DEFER_SRC`): a's flows are decided under a's policy at
/// a routed local backend's `to_pod` (allowed) and at `node_exit` (denied).
/// Masqueraded on the way (kube-proxy's `--masquerade-all`), the source
/// is the node's and no sender is found: every flow is denied and
/// counted, as no endpoint's (fail closed), never passed.
#[test]
fn bridged_senders_are_found_by_source_and_fail_closed_when_masqueraded() {
    sweep_leftovers();
    let pid = std::process::id();
    let (base, cips) = block(15);
    let cip = Ipv4Addr::from(cips + 1);
    let br = format!("npt{pid}brg");
    sh_quiet(&["ip", "link", "del", &br]);
    sh(&["ip", "link", "add", &br, "type", "bridge"]);
    let _br_guard = super::LinkGuard(br.clone());
    sh(&[
        "ip",
        "addr",
        "add",
        &format!("{}/30", Ipv4Addr::from(base + 1)),
        "dev",
        &br,
    ]);
    sh(&["ip", "link", "set", &br, "up"]);
    let a = BridgedPod::new("bga", &br, base, 0);
    let mut b1 = Pod::new("bgb", base, 2);
    b1.servers.push(serve(&b1.ns.name, b1.ip, "b1", &[8080], &[]));
    let SecondNode {
        node2,
        uplink,
        here,
        there,
        _uplink_guard,
    } = SecondNode::new("smk2bg", &format!("npt{pid}mbg"), base);
    ns_sh(
        &node2.name,
        &["ip", "route", "add", "default", "via", &here.to_string()],
    );
    let r2 = Ipv4Addr::from(base + 5 * 4 + 1);
    ns_sh(&node2.name, &["ip", "addr", "add", &format!("{r2}/32"), "dev", "lo"]);
    sh(&[
        "ip",
        "route",
        "add",
        &format!("{r2}/32"),
        "via",
        &there.to_string(),
        "dev",
        &uplink,
    ]);
    let _s2 = serve(&node2.name, r2, "r2", &[8080], &[]);
    let _nat = NatTable::new("mbg", &[(cip, 80, "tcp", vec![b1.ip, r2], 8080)]);
    wait_tcp(&a.ns.name, b1.ip, 8080);
    wait_tcp(&a.ns.name, r2, 8080);

    let pins = PinDir::new("svc-markbg");
    let mut dp: EbpfDataplane = pins.open();
    // a = 1 (may reach b1 = 2 only), b1 = 2; r2 = identity(3).
    let st = compiled_at(
        &[(a.ip, false, true), (b1.ip, false, false)],
        &[r2],
        &[(2, Protocol::Tcp, 8080)],
    );
    let ifs = std::collections::BTreeMap::from([(1, a.ifindex), (2, b1.ifindex)]);
    dp.sync_full(&st, &ifs).unwrap();
    program_services(&pins, &[(cip, 80, proto::TCP)]);
    let mut exit = NodeExit::open(None, &pins.path).expect("load node_exit");
    exit.set_interfaces(&BTreeSet::from([ifindex_of(&uplink)]))
        .expect("attach node_exit");
    dp.poll_deny_events();

    let r = probe(&a.ns.name, cip, 80, "tcp", PROBES);
    assert_eq!(count(&r, "b1") + count(&r, "FAIL"), PROBES, "{r:?}");
    assert!(count(&r, "b1") > 0 && count(&r, "FAIL") > 0, "{r:?}");
    let denies = dp.poll_deny_events();
    assert!(
        denies.iter().any(|e| e.direction == DIR_EGRESS
            && e.endpoint == 1
            && e.ifindex == a.ifindex
            && e.dst == r2.to_ipv6_mapped().octets()),
        "no deny of a towards r2: {denies:?}"
    );

    // Masqueraded before the decision: no sender, every flow denied.
    let masq = format!("npmmark{pid}xbgm");
    sh_quiet(&["nft", "delete", "table", "ip", &masq]);
    let path = format!("/tmp/{masq}.nft");
    let _f = TempFile(path.clone());
    std::fs::write(
        &path,
        format!(
            "table ip {masq} {{\n  chain masq {{\n    type nat hook postrouting priority srcnat; policy accept;\n    ip saddr {} masquerade\n  }}\n}}\n",
            a.ip
        ),
    )
    .unwrap();
    sh(&["nft", "-f", &path]);
    let _masq = MarkRules(masq);
    let before = dp.counters().unwrap();
    let r = probe(&a.ns.name, cip, 80, "tcp", 6);
    let after = dp.counters().unwrap();
    assert_eq!(r, ["FAIL"; 6], "a masqueraded flow passed undecided");
    let denied = |c: &npm_dataplane::Counters| {
        c.by_reason
            .get(&(DIR_EGRESS, npm_common::Reason::PolicyDenied as u8))
            .map_or(0, |&(p, _)| p)
    };
    assert!(denied(&after) - denied(&before) >= 6, "the denies were not counted");
    let denies = dp.poll_deny_events();
    let brx = ifindex_of(&br);
    assert!(
        denies
            .iter()
            .any(|e| e.direction == DIR_EGRESS && e.endpoint == 0 && e.ifindex == brx),
        "no deny of an unknown sender on the bridge: {denies:?}"
    );
    drop(exit);
}
