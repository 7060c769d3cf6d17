//! LoadBalancer IPs and `externalIPs` through the kernel's real NAT (issue
//! 39): kube-proxy DNATs a pod's connection to either to the Service's
//! backends, as for a ClusterIP. With their keys in `NPM_SERVICES` (the
//! agent writes them since issue 39: `npm-agent/src/services/keys.rs`)
//! the sender's egress is decided for the backend kube-proxy chose; the
//! usual "the internet but not the cluster" egress rule (ipBlock
//! `0.0.0.0/0` except the pod range) then reaches no in-cluster backend
//! through them. Without the keys (the agent before) the same rule
//! decided the address the pod sent to, a world address it allows, and
//! every backend answered: the control case below shows it.
//!
//! Topology and helpers are the parent module's (pods as namespaces on the
//! root namespace, a kube-proxy-style nft DNAT table); the load balancer
//! and external addresses are in 198.18.0.0/15, outside the pods'
//! 100.64.0.0/10, unique per process. Needs root.

use std::net::Ipv4Addr;

use super::{block, compiled, count, interfaces, probe, serve, wait_tcp, write_keys, NatTable, Pod, PROBES};
use crate::ebpf_common::*;
use npm_common::{IDENTITY_FIRST_CIDR, SVC_CLUSTER_IP, SVC_EXTERNAL_IP, SVC_LOAD_BALANCER};
use npm_dataplane::ebpf::EbpfDataplane;
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

/// CIDR identity of `0.0.0.0/0`.
const C_WORLD: u32 = IDENTITY_FIRST_CIDR + 1;
/// CIDR identity of the `except` (`100.64.0.0/10`, the pods).
const C_PODS: u32 = IDENTITY_FIRST_CIDR + 2;

/// Endpoint 1 (egress-isolated) may reach the world but the pods
/// (`0.0.0.0/0` except `100.64.0.0/10`, any port) and b1 (endpoint 2) on
/// 8080; b2 (endpoint 3) is not allowed.
fn internet_but_not_the_cluster(c: &mut Compiled) {
    c.cidrs.insert("0.0.0.0/0".parse().unwrap(), C_WORLD);
    c.cidrs.insert("100.64.0.0/10".parse().unwrap(), C_PODS);
    for e in c.ipcache.values_mut() {
        e.cidr_identity = C_PODS;
    }
    allow(c, 1, Direction::Egress, C_WORLD, None, (0, 65535), 100);
}

/// A LoadBalancer Service with an externalIP and two local backends: a
/// connection from `a` to the load balancer's IP or to the external IP is
/// decided for the backend kube-proxy chose (b1 allowed by pod, b2 denied:
/// it is in the `except`), never against the address `a` sent to.
#[test]
fn load_balancer_and_external_ips_are_decided_for_the_chosen_backend() {
    sweep_leftovers();
    let (base, cips) = block(10);
    let cip = Ipv4Addr::from(cips + 1);
    let lb = Ipv4Addr::from(u32::from(Ipv4Addr::new(198, 18, 0, 0)) + (std::process::id() % 32768) * 4);
    let ext = Ipv4Addr::from(u32::from(lb) + 1);
    let a = Pod::new("xa", base, 0);
    let b1 = Pod::new("xb1", base, 1);
    let b2 = Pod::new("xb2", base, 2);
    let _servers = [
        serve(&b1.ns.name, b1.ip, "b1", &[8080], &[]),
        serve(&b2.ns.name, b2.ip, "b2", &[8080], &[]),
    ];
    let backends = vec![b1.ip, b2.ip];
    let _nat = NatTable::new(
        "x",
        &[
            (cip, 443, "tcp", backends.clone(), 8080),
            (lb, 443, "tcp", backends.clone(), 8080),
            (ext, 443, "tcp", backends, 8080),
        ],
    );
    wait_tcp(&a.ns.name, b1.ip, 8080);
    wait_tcp(&a.ns.name, b2.ip, 8080);

    let pins = PinDir::new("svc-ext");
    let mut dp: EbpfDataplane = pins.open();
    let pods = [(&a, true, true), (&b1, false, false), (&b2, false, false)];
    let ifs = interfaces(&[&a, &b1, &b2]);
    let mut c = compiled(&pods, &[], &[(2, Protocol::Tcp, 8080)]);
    internet_but_not_the_cluster(&mut c);
    dp.sync_full(&c, &ifs).unwrap();

    // Control: only the ClusterIP is a key (what the agent wrote before
    // issue 39). The load balancer's IP is decided before the DNAT, as a
    // world address the rule allows: b2 is reached.
    write_keys(&pins, &[(cip, 443, SVC_CLUSTER_IP)]);
    let r = probe(&a.ns.name, lb, 443, "tcp", PROBES);
    assert!(
        count(&r, "b2") > 0 && count(&r, "FAIL") == 0,
        "control (no key): the world rule should reach both backends: {r:?}"
    );

    // The keys the agent writes now: every address kube-proxy DNATs.
    write_keys(
        &pins,
        &[
            (cip, 443, SVC_CLUSTER_IP),
            (lb, 443, SVC_LOAD_BALANCER),
            (ext, 443, SVC_EXTERNAL_IP),
        ],
    );
    dp.poll_deny_events();
    for (what, dst) in [("ClusterIP", cip), ("load balancer IP", lb), ("externalIP", ext)] {
        let r = probe(&a.ns.name, dst, 443, "tcp", PROBES);
        assert_eq!(count(&r, "b2"), 0, "{what}: b2 is in the except: {r:?}");
        assert!(count(&r, "b1") > 0, "{what}: the allowed backend is reached: {r:?}");
        assert!(count(&r, "FAIL") > 0, "{what}: no connection was DNATed to b2: {r:?}");
        assert_eq!(count(&r, "b1") + count(&r, "FAIL"), PROBES, "{what}: {r:?}");
    }
    let b2_mapped = b2.ip.to_ipv6_mapped().octets();
    let denies = dp.poll_deny_events();
    assert!(
        denies
            .iter()
            .any(|e| e.direction == npm_common::DIR_EGRESS && e.endpoint == 1 && e.dst == b2_mapped),
        "no egress deny of a towards b2: {denies:?}"
    );
    // The world itself stays allowed: the rule is not broken by the keys.
    assert_eq!(probe(&a.ns.name, b1.ip, 8080, "tcp", 1), ["b1"]);
}
