//! hostPorts through the kernel's real NAT (issue 39, item 5): the
//! `portmap` CNI plugin DNATs node:hostPort to the pod in `PREROUTING`, as
//! kube-proxy does a ClusterIP. With the key in `NPM_SERVICES` (the agent
//! writes this node's pods' hostPorts, `SVC_HOST_PORT`:
//! `npm-agent/src/services/keys.rs`) the sender's egress is decided for the
//! pod behind the hostPort. Without it (the agent before) `from_pod`
//! decided the node's address before the DNAT: a pod allowed to reach the
//! node (`--allow-host-egress`, an ipBlock covering it) reached every
//! hostPort backend past its egress policy; the control case shows it.
//!
//! The DNAT is the parent module's nft table (the same rule portmap
//! writes with iptables: destination a local address and the hostPort,
//! to the pod and its containerPort). Needs root.

use std::net::Ipv4Addr;

use super::{block, compiled, count, identity, interfaces, probe, serve, wait_tcp, write_keys, NatTable, Pod, PROBES};
use crate::ebpf_common::*;
use npm_common::{IDENTITY_HOST, SVC_HOST_PORT};
use npm_dataplane::ebpf::EbpfDataplane;
use npm_dataplane::Dataplane;
use npm_policy::compiled::Direction;
use npm_policy::model::Protocol;

/// Pod `a` (egress-isolated) may reach the node on any port (as with
/// `--allow-host-egress`) but not pod `b`; `b` serves 8080 behind the
/// node's hostPort 9090. Through the hostPort, `a` is denied (decided for
/// `b`), and allowed once its policy allows `b` on 8080 (the containerPort).
#[test]
fn host_ports_are_decided_for_the_pod_behind_them() {
    sweep_leftovers();
    let (base, _) = block(16);
    let a = Pod::new("pa", base, 0);
    let b = Pod::new("pb", base, 1);
    // The node's address (a's gateway) and the hostPort's DNAT to b.
    let node_ip = Ipv4Addr::from(base + 1);
    let _server = serve(&b.ns.name, b.ip, "b", &[8080], &[]);
    let _nat = NatTable::new("p", &[(node_ip, 9090, "tcp", vec![b.ip], 8080)]);
    wait_tcp(&a.ns.name, b.ip, 8080);

    let pins = PinDir::new("svc-hostport");
    let mut dp: EbpfDataplane = pins.open();
    let ifs = interfaces(&[&a, &b]);
    let mut node_only = compiled(&[(&a, false, true), (&b, false, false)], &[], &[]);
    ip(&mut node_only, &node_ip.to_string(), IDENTITY_HOST, 0);
    allow(
        &mut node_only,
        1,
        Direction::Egress,
        IDENTITY_HOST,
        None,
        (0, 65535),
        100,
    );
    dp.sync_full(&node_only, &ifs).unwrap();

    // Control: no key (the agent before). The node's address is decided
    // before the DNAT, as the host a may reach: b is reached.
    write_keys(&pins, &[]);
    let r = probe(&a.ns.name, node_ip, 9090, "tcp", PROBES);
    assert_eq!(
        count(&r, "b"),
        PROBES,
        "control (no key): the host rule reaches b: {r:?}"
    );

    // The key the agent writes now: decided for b, which a may not reach.
    write_keys(&pins, &[(node_ip, 9090, SVC_HOST_PORT)]);
    dp.poll_deny_events();
    let r = probe(&a.ns.name, node_ip, 9090, "tcp", PROBES);
    assert_eq!(count(&r, "FAIL"), PROBES, "through the hostPort, b is denied: {r:?}");
    let denies = dp.poll_deny_events();
    let b_mapped = b.ip.to_ipv6_mapped().octets();
    assert!(
        denies
            .iter()
            .any(|e| e.direction == npm_common::DIR_EGRESS && e.endpoint == 1 && e.dst == b_mapped && e.dport == 8080),
        "no egress deny of a towards b:8080: {denies:?}"
    );

    // a may reach b on 8080 (the containerPort, after the DNAT): allowed.
    let mut with_b = node_only.clone();
    allow(
        &mut with_b,
        1,
        Direction::Egress,
        identity(2),
        Some(Protocol::Tcp),
        (8080, 8080),
        101,
    );
    dp.sync_full(&with_b, &ifs).unwrap();
    let r = probe(&a.ns.name, node_ip, 9090, "tcp", PROBES);
    assert_eq!(count(&r, "b"), PROBES, "allowed to b on 8080: {r:?}");
}
