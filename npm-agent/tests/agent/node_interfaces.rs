//! Interface discovery on interfaces made by the real reference CNI
//! plugins (`ptp` and `bridge` with `host-local` IPAM, called as a runtime
//! calls them), inside a private "node" network namespace so the host is
//! not disturbed. The node has an uplink (a veth to a "fabric" namespace,
//! holding the node address and the default route) and a dummy-like
//! interface (`ifb`) holding another node address.
//!
//! Each pod resolves to its own host veth; addresses that route to the
//! uplink, the dummy, the bridge itself, a local address or nowhere resolve
//! to nothing; a pod whose host route is removed keeps its veth while the
//! veth exists (fail closed) and is dropped when the veth is deleted; an
//! interface claimed by two endpoints stays with the incumbent, the
//! newcomer is refused and the conflict counted; a bridged pod whose MAC is
//! momentarily unknown keeps its interface.
//!
//! Names are `npmni<pid><tag>...`; leftovers of crashed runs are removed first.

use std::net::IpAddr;
use std::time::{Duration, Instant};

use crate::cni_plugins::*;
use npm_agent::node::{InterfacePattern, InterfaceResolver, Resolve, Resolved};
use npm_policy::compiled::{Compiled, Endpoint, PodRef};

const PREFIX: &str = "npmni";

/// The node and fabric namespaces, removed on drop (after the pods).
struct Node {
    node: String,
    fabric: String,
    ipam: std::path::PathBuf,
    /// `10.<net>.0.0/16` is this node's range.
    net: u8,
}

impl Node {
    /// Node `npmni<pid><tag>n` with uplink `npmni<pid><tag>u`
    /// (`10.<net>.0.2/24`, default route via the fabric's `10.<net>.0.1`)
    /// and dummy `npmni<pid><tag>d` (`10.<net>.3.1/24`).
    fn new(tag: &str, net: u8) -> Node {
        clear_leftovers(PREFIX);
        let pid = std::process::id();
        let n = Node {
            node: format!("{PREFIX}{pid}{tag}n"),
            fabric: format!("{PREFIX}{pid}{tag}f"),
            ipam: std::env::temp_dir().join(format!("{PREFIX}{pid}{tag}-ipam")),
            net,
        };
        let node = Some(n.node.as_str());
        let fabric = Some(n.fabric.as_str());
        for ns in [&n.node, &n.fabric] {
            run(&["ip", "netns", "add", ns]);
            ip_in(Some(ns), &["link", "set", "lo", "up"]);
        }
        run(&["ip", "netns", "exec", &n.node, "sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        let uplink = format!("{PREFIX}{pid}{tag}u");
        ip_in(
            node,
            &[
                "link", "add", &uplink, "type", "veth", "peer", "name", "eth0", "netns", &n.fabric,
            ],
        );
        ip_in(node, &["addr", "add", &format!("10.{net}.0.2/24"), "dev", &uplink]);
        ip_in(node, &["link", "set", &uplink, "up"]);
        ip_in(fabric, &["addr", "add", &format!("10.{net}.0.1/24"), "dev", "eth0"]);
        ip_in(fabric, &["link", "set", "eth0", "up"]);
        ip_in(node, &["route", "add", "default", "via", &format!("10.{net}.0.1")]);
        let dummy = format!("{PREFIX}{pid}{tag}d");
        // (This kernel has no `dummy` module: `ifb` is the same kind of
        // device for routing, an interface that is not a veth.)
        ip_in(node, &["link", "add", &dummy, "type", "ifb"]);
        ip_in(node, &["addr", "add", &format!("10.{net}.3.1/24"), "dev", &dummy]);
        ip_in(node, &["link", "set", &dummy, "up"]);
        n
    }

    fn uplink(&self) -> String {
        self.node.trim_end_matches('n').to_string() + "u"
    }

    fn dummy(&self) -> String {
        self.node.trim_end_matches('n').to_string() + "d"
    }

    fn bridge(&self) -> String {
        self.node.trim_end_matches('n').to_string() + "b"
    }

    /// A pod `<i>` wired by `ptp` (`10.<net>.1.0/24`).
    fn ptp_pod(&self, i: u32) -> CniPod {
        let conf = ptp_conf("npmni-ptp", &format!("10.{}.1.0/24", self.net), &self.ipam);
        CniPod::add(
            &format!("{}p{i}", self.node),
            "ptp",
            conf,
            Some(&self.node),
            "k",
            &format!("p{i}"),
        )
    }

    /// A pod `<i>` wired by `bridge` (bridge `...b`, `10.<net>.2.0/24`).
    fn bridge_pod(&self, i: u32) -> CniPod {
        let conf = bridge_conf(
            "npmni-bridge",
            &self.bridge(),
            &format!("10.{}.2.0/24", self.net),
            &self.ipam,
        );
        CniPod::add(
            &format!("{}p{i}", self.node),
            "bridge",
            conf,
            Some(&self.node),
            "k",
            &format!("p{i}"),
        )
    }

    fn ifindex(&self, name: &str) -> u32 {
        ifindex(Some(&self.node), name)
    }

    fn ip(&self, args: &[&str]) {
        ip_in(Some(&self.node), args);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        for ns in [&self.node, &self.fabric] {
            let _ = std::process::Command::new("ip").args(["netns", "delete", ns]).output();
        }
        let _ = std::fs::remove_dir_all(&self.ipam);
    }
}

/// A compiled state whose endpoints are `(id, address)`.
fn compiled(endpoints: &[(u32, String)]) -> Compiled {
    let mut c = Compiled::default();
    for (id, ip) in endpoints {
        let ip: IpAddr = ip.parse().unwrap();
        c.endpoints.insert(
            *id,
            Endpoint {
                pod: PodRef {
                    namespace: "k".into(),
                    name: format!("ep{id}"),
                    uid: format!("uid{id}"),
                },
                identity: 300,
                ipv4: match ip {
                    IpAddr::V4(a) => Some(a),
                    IpAddr::V6(_) => None,
                },
                ipv6: match ip {
                    IpAddr::V6(a) => Some(a),
                    IpAddr::V4(_) => None,
                },
                isolated_ingress: false,
                isolated_egress: false,
                tiers: Default::default(),
                report_new: false,
            },
        );
    }
    c
}

/// Resolve until `done` holds (bridged pods need their MAC resolved
/// first), at most 10 s.
fn resolve_until(r: &mut InterfaceResolver, c: &Compiled, done: impl Fn(&Resolved) -> bool) -> Resolved {
    let start = Instant::now();
    loop {
        let resolved = r.resolve(c);
        if done(&resolved) {
            return resolved;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "resolution never converged: {resolved:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn ptp_and_bridge_pods_resolve_to_their_own_host_veth_and_nothing_else_does() {
    let node = Node::new("a", 231);
    let pods = [node.ptp_pod(1), node.ptp_pod(2), node.bridge_pod(3), node.bridge_pod(4)];
    let net = node.net;
    let mut eps: Vec<(u32, String)> = pods.iter().zip(1..).map(|(p, id)| (id, p.ip())).collect();
    // Addresses that must never resolve to an interface.
    let refused = [
        (
            10,
            format!("10.{net}.0.7"),
            "on the uplink's subnet (the default-route device)",
        ),
        (11, format!("10.{net}.0.2"), "the uplink's node address"),
        (12, format!("10.{net}.3.5"), "on the dummy's subnet"),
        (13, format!("10.{net}.3.1"), "the dummy's node address"),
        (
            14,
            format!("10.{net}.2.1"),
            "the bridge's own address (the pods' gateway)",
        ),
        (15, format!("10.{net}.2.200"), "on the bridge, but no pod has it"),
        (16, "192.0.2.9".to_string(), "routed through the default gateway"),
        (17, format!("10.{net}.1.1"), "ptp's gateway address on the host veths"),
    ];
    eps.extend(refused.iter().map(|(id, ip, _)| (*id, ip.clone())));
    let c = compiled(&eps);
    let mut r = InterfaceResolver::new(None).in_netns(&node.node);
    let resolved = resolve_until(&mut r, &c, |res| (1..=4).all(|id| res.interfaces.contains_key(&id)));
    for (pod, id) in pods.iter().zip(1u32..) {
        assert_eq!(
            resolved.interfaces[&id],
            node.ifindex(&pod.host_veth()),
            "{} pod {} ({}) must resolve to its host veth {}",
            pod.plugin,
            pod.netns,
            pod.ip(),
            pod.host_veth()
        );
    }
    let never = [
        node.ifindex(&node.uplink()),
        node.ifindex(&node.dummy()),
        node.ifindex(&node.bridge()),
        node.ifindex("lo"),
    ];
    for (id, ip, what) in &refused {
        assert!(
            !resolved.interfaces.contains_key(id),
            "{ip} ({what}) resolved to {:?}",
            resolved.interfaces.get(id)
        );
        assert!(resolved.missing.contains(id), "{ip} ({what}) is not reported missing");
    }
    assert!(
        resolved.interfaces.values().all(|i| !never.contains(i)),
        "{resolved:?} uses the uplink, dummy, bridge or lo ({never:?})"
    );
    assert_eq!(r.take_new_conflicts(), 0);

    // A bridged pod whose MAC is momentarily unknown (neighbour entry and
    // learned port gone) keeps its interface meanwhile.
    let mac = pods[2].result["interfaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["sandbox"].as_str().is_some_and(|s| !s.is_empty()))
        .and_then(|i| i["mac"].as_str())
        .unwrap()
        .to_string();
    node.ip(&["neigh", "flush", "dev", &node.bridge()]);
    run(&[
        "ip",
        "netns",
        "exec",
        &node.node,
        "bridge",
        "fdb",
        "del",
        &mac,
        "dev",
        &pods[2].host_veth(),
        "master",
    ]);
    let again = r.resolve(&c);
    assert_eq!(
        again.interfaces.get(&3),
        resolved.interfaces.get(&3),
        "an unknown MAC keeps the previous interface"
    );

    // A pod once attached whose host route goes away keeps its veth while
    // that veth exists (it stays enforced); a pod never attached with no
    // route is attached nowhere.
    node.ip(&["route", "del", &format!("{}/32", pods[0].ip())]);
    let after = r.resolve(&c);
    assert_eq!(
        after.interfaces.get(&1),
        resolved.interfaces.get(&1),
        "without its host route, {} keeps its veth",
        pods[0].ip(),
    );
    assert!(!after.missing.contains(&1), "{after:?}");
    assert_eq!(
        after.interfaces.get(&2),
        resolved.interfaces.get(&2),
        "the other pods stay"
    );
    assert_eq!(after.interfaces.get(&4), resolved.interfaces.get(&4));
    let mut fresh = InterfaceResolver::new(None).in_netns(&node.node);
    let first = fresh.resolve(&compiled(&[(1, pods[0].ip())]));
    assert!(first.interfaces.is_empty(), "{first:?}");
    assert_eq!(first.missing, vec![1]);

    // CNI DEL removes the veth: the endpoint is dropped, not kept (also
    // the one without a route, once its veth is gone).
    let [p1, p2, p3, p4] = pods;
    drop(p2);
    let after_del = r.resolve(&c);
    assert!(!after_del.interfaces.contains_key(&2), "{after_del:?}");
    assert_eq!(after_del.interfaces.get(&1), resolved.interfaces.get(&1));
    drop(p1);
    let after_del = r.resolve(&c);
    assert!(!after_del.interfaces.contains_key(&1), "{after_del:?}");
    assert!(after_del.missing.contains(&1));
    drop((p3, p4));
}

#[test]
fn an_interface_claimed_by_two_endpoints_stays_with_the_incumbent_and_is_counted() {
    let node = Node::new("b", 232);
    let pod = node.ptp_pod(1);
    let veth = pod.host_veth();
    // A second address routed to the same veth, claimed by another endpoint.
    let other = format!("10.{}.1.99", node.net);
    node.ip(&["route", "add", &format!("{other}/32"), "dev", &veth, "scope", "link"]);
    let both = compiled(&[(1, pod.ip()), (2, other.clone())]);
    let mut r = InterfaceResolver::new(None).in_netns(&node.node);
    // Two newcomers: neither is the incumbent, both are refused.
    let resolved = r.resolve(&both);
    assert!(resolved.interfaces.is_empty(), "{resolved:?}");
    assert_eq!(resolved.missing, vec![1, 2]);
    assert_eq!(r.take_new_conflicts(), 1);
    r.resolve(&both);
    assert_eq!(r.take_new_conflicts(), 0, "a conflict is counted once");
    let alone = compiled(&[(1, pod.ip())]);
    let resolved = r.resolve(&alone);
    assert_eq!(resolved.interfaces.get(&1), Some(&node.ifindex(&veth)));
    // The incumbent keeps its veth; the newcomer is refused and counted.
    let resolved = r.resolve(&both);
    assert_eq!(resolved.interfaces, [(1, node.ifindex(&veth))].into());
    assert_eq!(resolved.missing, vec![2]);
    assert_eq!(r.take_new_conflicts(), 1, "a conflict that comes back is counted again");
    r.resolve(&both);
    assert_eq!(r.take_new_conflicts(), 0);

    // A spoof: pod 2's address now resolves to pod 3's veth. Pod 3 keeps
    // it, pod 2 stays on its own veth (enforced), counted.
    let p2 = node.ptp_pod(2);
    let p3 = node.ptp_pod(3);
    let two = compiled(&[(2, p2.ip()), (3, p3.ip())]);
    let mut s = InterfaceResolver::new(None).in_netns(&node.node);
    let before = s.resolve(&two);
    let (v2, v3) = (node.ifindex(&p2.host_veth()), node.ifindex(&p3.host_veth()));
    assert_eq!(before.interfaces, [(2, v2), (3, v3)].into());
    node.ip(&[
        "route",
        "replace",
        &format!("{}/32", p2.ip()),
        "dev",
        &p3.host_veth(),
        "scope",
        "link",
    ]);
    let spoofed = s.resolve(&two);
    assert_eq!(spoofed.interfaces, [(2, v2), (3, v3)].into(), "{spoofed:?}");
    assert!(spoofed.missing.is_empty());
    assert_eq!(s.take_new_conflicts(), 1);
    drop((p2, p3));

    // --interface-pattern keeps its meaning: only matching names.
    let mut only = InterfaceResolver::new(Some(InterfacePattern::new(&veth).unwrap())).in_netns(&node.node);
    assert_eq!(only.resolve(&alone).interfaces.get(&1), Some(&node.ifindex(&veth)));
    let mut none = InterfaceResolver::new(Some(InterfacePattern::new("cali*").unwrap())).in_netns(&node.node);
    assert_eq!(none.resolve(&alone).missing, vec![1]);
    drop(pod);
}

#[test]
fn ipv6_ptp_and_bridge_pods_resolve_to_their_own_host_veth() {
    let node = Node::new("c", 236);
    let range = |v4: &str, v6: &str| serde_json::json!([[{"subnet": v4}], [{"subnet": v6}]]);
    let mut ptp = ptp_conf("npmni-ptp6", "", &node.ipam);
    ptp["ipam"]["ranges"] = range("10.236.1.0/24", "fd00:236:1::/64");
    let mut br = bridge_conf("npmni-br6", &node.bridge(), "", &node.ipam);
    br["ipam"]["ranges"] = range("10.236.2.0/24", "fd00:236:2::/64");
    let pods = [
        CniPod::add(&format!("{}p1", node.node), "ptp", ptp, Some(&node.node), "k", "p1"),
        CniPod::add(&format!("{}p2", node.node), "bridge", br, Some(&node.node), "k", "p2"),
    ];
    let v6 = |p: &CniPod| {
        p.result["ips"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| i["address"].as_str())
            .find(|a| a.contains(':'))
            .expect("an IPv6 address")
            .split('/')
            .next()
            .unwrap()
            .to_string()
    };
    // IPv6 only: the endpoints have no IPv4 address to fall back on.
    let c = compiled(&[(1, v6(&pods[0])), (2, v6(&pods[1])), (3, "fd00:236:2::99".into())]);
    let mut r = InterfaceResolver::new(None).in_netns(&node.node);
    let resolved = resolve_until(&mut r, &c, |res| res.interfaces.len() == 2);
    for (pod, id) in pods.iter().zip(1u32..) {
        assert_eq!(
            resolved.interfaces.get(&id),
            Some(&node.ifindex(&pod.host_veth())),
            "{} pod at {}",
            pod.plugin,
            v6(pod)
        );
    }
    assert_eq!(resolved.missing, vec![3], "no pod holds fd00:236:2::99");
    drop(pods);
}
