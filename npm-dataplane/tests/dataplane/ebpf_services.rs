//! Services through the kernel's real NAT: traffic a pod sends
//! to a ClusterIP is decided, at the sender's egress, as NetworkPolicy
//! decides it for the backend kube-proxy chose; replies pass, also to an
//! ingress-isolated client.
//!
//! The root network namespace plays the node: pods are network namespaces
//! joined to it by veths (the endpoint programs on the host sides), a
//! host-side nft table (unique per test) DNATs each ClusterIP:port the way
//! kube-proxy's nftables mode does (`numgen random mod N vmap` to one chain
//! per backend, `dnat to backend:targetPort`), and `NPM_SERVICES` holds the
//! ClusterIP ports. A second "node" namespace, reached over a routed veth
//! (the uplink, with `node_exit` on it), holds remote backends. Needs root.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr};

use crate::ebpf_common::*;
use npm_common::{proto, Reason, DIR_EGRESS, IDENTITY_HOST, SVC_CLUSTER_IP};
use npm_dataplane::ebpf::{
    host_in_chain, remove_stale_host_in_chains, AttachMode, BenchSwitches, EbpfDataplane, HostIn, HostInMode, NodeExit,
    ServicePort, ServicesMap,
};
use npm_dataplane::{Counters, Dataplane};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

/// Probes per case: with two backends chosen at random, the chance that
/// one is never chosen is 2^-23.
pub(crate) const PROBES: usize = 24;

/// Addresses of this process's test `t` (0..32): a /26 of 100.64.0.0/10,
/// its first 12 /30s for pods and links, its last 16 addresses for
/// ClusterIPs.
pub(crate) fn block(t: u32) -> (u32, u32) {
    assert!(t < 32, "block {t}: 32 per process");
    let n = (std::process::id() % 2048) * 32 + t;
    let base = u32::from(Ipv4Addr::new(100, 64, 0, 0)) + n * 64;
    (base, base + 48)
}

/// A pod: a netns joined to the root netns by a veth (`host_if` in the
/// root netns, a /30 with the gateway on the host side) with a default
/// route via the gateway, and its servers.
pub(crate) struct Pod {
    pub(crate) ns: Netns,
    host_if: String,
    pub(crate) ifindex: u32,
    pub(crate) ip: Ipv4Addr,
    servers: Vec<Proc>,
    /// Routed through the root namespace.
    _forwarding: Forwarding,
}

impl Pod {
    /// Pod `tag` (at most 3 characters) in /30 number `slot` of `base`.
    pub(crate) fn new(tag: &str, base: u32, slot: u32) -> Pod {
        let pid = std::process::id();
        let ns = test_netns(&format!("s{tag}"));
        let host_if = format!("npt{pid}s{tag}");
        let pod_if = format!("{host_if}x");
        assert!(pod_if.len() < 16, "{pod_if}");
        sh_quiet(&["ip", "link", "del", &host_if]);
        sh(&["ip", "link", "add", &host_if, "type", "veth", "peer", "name", &pod_if]);
        sh(&["ip", "link", "set", &pod_if, "netns", &ns.name]);
        let gw = Ipv4Addr::from(base + slot * 4 + 1);
        let ip = Ipv4Addr::from(base + slot * 4 + 2);
        sh(&["ip", "addr", "add", &format!("{gw}/30"), "dev", &host_if]);
        sh(&["ip", "link", "set", &host_if, "up"]);
        ns_sh(&ns.name, &["ip", "addr", "add", &format!("{ip}/30"), "dev", &pod_if]);
        ns_sh(&ns.name, &["ip", "link", "set", &pod_if, "up"]);
        ns_sh(&ns.name, &["ip", "route", "add", "default", "via", &gw.to_string()]);
        let ifindex = ifindex_of(&host_if);
        Pod {
            ns,
            host_if,
            ifindex,
            ip,
            servers: Vec::new(),
            _forwarding: Forwarding::on(),
        }
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        self.servers.clear();
        sh_quiet(&["ip", "link", "del", &self.host_if]);
    }
}

/// Starts, in namespace `ns`, servers bound to `ip` that answer every TCP
/// connection on `tcp` and every UDP datagram on `udp` with `name`.
pub(crate) fn serve(ns: &str, ip: Ipv4Addr, name: &str, tcp: &[u16], udp: &[u16]) -> Proc {
    let list = |p: &[u16]| p.iter().map(|p| p.to_string()).collect::<Vec<_>>().join(",");
    let code = format!(
        "import socket,select\n\
         ss=[]\n\
         for p in [{tcp}]:\n  s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{ip}',p)); s.listen(64); ss.append(s)\n\
         for p in [{udp}]:\n  u=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('{ip}',p)); ss.append(u)\n\
         while True:\n  r,_,_=select.select(ss,[],[])\n  for s in r:\n    if s.type==socket.SOCK_STREAM:\n      c,_=s.accept(); c.sendall(b'{name}'); c.close()\n    else:\n      d,a=s.recvfrom(2048); s.sendto(b'{name}',a)\n",
        tcp = list(tcp),
        udp = list(udp),
    );
    Proc(
        std::process::Command::new("ip")
            .args(["netns", "exec", ns, "python3", "-c", &code])
            .spawn()
            .expect("spawn python3 server"),
    )
}

/// `n` probes from namespace `ns` to `dst`:`port` over `proto` ("tcp":
/// a connection that reads the server's name; "udp": a fresh socket that
/// sends a query, sends it again on the same socket (the same flow) if no
/// answer came, then a second query, and reads both answers). One line
/// each: the answer, or `FAIL`.
pub(crate) fn probe(ns: &str, dst: Ipv4Addr, port: u16, proto: &str, n: usize) -> Vec<String> {
    let code = format!(
        "import socket\n\
         for i in range({n}):\n  try:\n\
         \x20   if '{proto}'=='tcp':\n      s=socket.create_connection(('{dst}',{port}),timeout=0.6); s.settimeout(0.6); d=s.recv(64); s.close()\n\
         \x20   else:\n      s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(0.6)\n      s.sendto(b'q',('{dst}',{port}))\n      try:\n        d,_=s.recvfrom(64)\n      except socket.timeout:\n        s.sendto(b'q',('{dst}',{port})); d,_=s.recvfrom(64)\n      s.sendto(b'q',('{dst}',{port})); e,_=s.recvfrom(64)\n      assert d==e\n      s.close()\n\
         \x20   print(d.decode() or 'EMPTY', flush=True)\n  except Exception:\n    print('FAIL', flush=True)\n"
    );
    ns_sh(ns, &["python3", "-c", &code])
        .lines()
        .map(str::to_string)
        .collect()
}

/// Waits until `ns` reaches `dst`:`port` over TCP (servers up).
pub(crate) fn wait_tcp(ns: &str, dst: Ipv4Addr, port: u16) {
    for _ in 0..50 {
        if probe(ns, dst, port, "tcp", 1)[0] != "FAIL" {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    panic!("{dst}:{port} not reachable from {ns}");
}

/// A kube-proxy-style nft table in the root netns (`npmsvc<pid>x<tag>`),
/// deleted on drop.
pub(crate) struct NatTable(String);

impl NatTable {
    /// DNAT of each (ClusterIP, port, protocol, backends, target port), as
    /// kube-proxy's nftables mode: a random choice among per-backend
    /// chains.
    pub(crate) fn new(tag: &str, services: &[(Ipv4Addr, u16, &str, Vec<Ipv4Addr>, u16)]) -> NatTable {
        for t in dead_names(nft_tables().into_iter(), "npmsvc") {
            sh_quiet(&["nft", "delete", "table", "ip", &t]);
        }
        let name = format!("npmsvc{}x{tag}", std::process::id());
        sh_quiet(&["nft", "delete", "table", "ip", &name]);
        let mut chains = String::new();
        let mut rules = String::new();
        for (i, (cip, port, l4, backends, target)) in services.iter().enumerate() {
            let mut vmap = Vec::new();
            for (j, b) in backends.iter().enumerate() {
                chains.push_str(&format!(
                    "  chain ep{i}x{j} {{\n    meta l4proto {l4} dnat to {b}:{target}\n  }}\n"
                ));
                vmap.push(format!("{j} : goto ep{i}x{j}"));
            }
            rules.push_str(&format!(
                "    ip daddr {cip} {l4} dport {port} numgen random mod {} vmap {{ {} }}\n",
                backends.len(),
                vmap.join(", ")
            ));
        }
        let script = format!(
            "table ip {name} {{\n{chains}  chain pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n{rules}  }}\n}}\n"
        );
        let path = format!("/tmp/{name}.nft");
        let _f = TempFile(path.clone());
        std::fs::write(&path, script).unwrap();
        sh(&["nft", "-f", &path]);
        NatTable(name)
    }
}

impl Drop for NatTable {
    fn drop(&mut self) {
        sh_quiet(&["nft", "delete", "table", "ip", &self.0]);
    }
}

/// The names of the `ip` tables in the root netns.
fn nft_tables() -> Vec<String> {
    sh(&["nft", "list", "tables", "ip"])
        .lines()
        .filter_map(|l| l.strip_prefix("table ip ").map(str::to_string))
        .collect()
}

/// `NPM_SERVICES` holding exactly `keys` ((address, port, flag), TCP).
pub(crate) fn write_keys(pins: &PinDir, keys: &[(Ipv4Addr, u16, u32)]) {
    let wanted: BTreeMap<ServicePort, u32> = keys
        .iter()
        .map(|&(a, port, flag)| {
            let k = ServicePort {
                addr: IpAddr::V4(a),
                port,
                protocol: proto::TCP,
            };
            (k, flag)
        })
        .collect();
    let mut m = ServicesMap::open(&pins.path).expect("open NPM_SERVICES");
    m.sync(&wanted).expect("sync NPM_SERVICES");
    assert_eq!(m.entries().unwrap(), wanted);
}

/// `NPM_SERVICES` holding exactly `ports` ((ClusterIP, port, protocol)).
pub(crate) fn program_services(pins: &PinDir, ports: &[(Ipv4Addr, u16, u8)]) {
    let wanted: BTreeMap<ServicePort, u32> = ports
        .iter()
        .map(|&(a, port, protocol)| {
            (
                ServicePort {
                    addr: IpAddr::V4(a),
                    port,
                    protocol,
                },
                SVC_CLUSTER_IP,
            )
        })
        .collect();
    let mut m = ServicesMap::open(&pins.path).expect("open NPM_SERVICES");
    m.sync(&wanted).expect("sync NPM_SERVICES");
    assert_eq!(m.entries().unwrap(), wanted);
}

/// Pod identities: 256 + the endpoint id.
pub(crate) fn identity(ep: u32) -> u32 {
    255 + ep
}

/// Endpoints 1.. for `pods` ((pod, isolated ingress, isolated egress)),
/// their ipcache entries, `remote` addresses as pods of other nodes (ids
/// after the local ones), and the egress allows of endpoint 1 to the
/// given endpoint or remote numbers and ports.
pub(crate) fn compiled(
    pods: &[(&Pod, bool, bool)],
    remote: &[Ipv4Addr],
    allow_from_1: &[(u32, Protocol, u16)],
) -> Compiled {
    let pods: Vec<(Ipv4Addr, bool, bool)> = pods.iter().map(|(p, i, e)| (p.ip, *i, *e)).collect();
    compiled_at(&pods, remote, allow_from_1)
}

/// [`compiled`] by pod addresses.
fn compiled_at(
    pods: &[(Ipv4Addr, bool, bool)],
    remote: &[Ipv4Addr],
    allow_from_1: &[(u32, Protocol, u16)],
) -> Compiled {
    let mut c = Compiled::default();
    for (i, (p, iso_in, iso_eg)) in pods.iter().enumerate() {
        let ep = i as u32 + 1;
        let a = p.to_string();
        c.endpoints.insert(
            ep,
            endpoint(&format!("p{ep}"), identity(ep), Some(&a), None, *iso_in, *iso_eg),
        );
        ip(&mut c, &a, identity(ep), 0);
    }
    for (i, r) in remote.iter().enumerate() {
        ip(&mut c, &r.to_string(), identity((pods.len() + i) as u32 + 1), 0);
    }
    for (rule, (to, pr, port)) in allow_from_1.iter().enumerate() {
        allow(
            &mut c,
            1,
            Direction::Egress,
            identity(*to),
            Some(*pr),
            (*port, *port),
            rule as u32,
        );
    }
    c
}

pub(crate) fn interfaces(pods: &[&Pod]) -> BTreeMap<u32, u32> {
    pods.iter()
        .enumerate()
        .map(|(i, p)| (i as u32 + 1, p.ifindex))
        .collect()
}

/// Packets counted on the egress direction with reason `r`.
fn egress_packets(c: &Counters, r: Reason) -> u64 {
    c.packets(DIR_EGRESS, r)
}

pub(crate) fn count(results: &[String], what: &str) -> usize {
    results.iter().filter(|r| *r == what).count()
}

/// A Service with two local backends of which a's egress policy allows
/// one: connections through the ClusterIP reach only the allowed one (those
/// DNATed to the other are dropped, and the deny says so); with both
/// allowed every connection succeeds; a's ingress is isolated (no ingress
/// rule), so every reply passes only as the flow's reply.
#[test]
fn cluster_ip_is_decided_for_the_chosen_backend() {
    cluster_ip_case("", 0, false);
}

/// [`cluster_ip_is_decided_for_the_chosen_backend`] with every packet on
/// the general path (no IPv4 fast path, no flow cache).
#[test]
fn cluster_ip_is_decided_for_the_chosen_backend_general_path() {
    cluster_ip_case("g", 3, true);
}

/// The ClusterIP case; `tag` and `t` keep the two variants apart.
fn cluster_ip_case(tag: &str, t: u32, general: bool) {
    sweep_leftovers();
    let (base, cips) = block(t);
    let cip = Ipv4Addr::from(cips + 1);
    let a = Pod::new(&format!("{tag}a"), base, 0);
    let mut b1 = Pod::new(&format!("{tag}b1"), base, 1);
    let mut b2 = Pod::new(&format!("{tag}b2"), base, 2);
    b1.servers.push(serve(&b1.ns.name, b1.ip, "b1", &[8080], &[]));
    b2.servers.push(serve(&b2.ns.name, b2.ip, "b2", &[8080], &[]));
    let _nat = NatTable::new(&format!("c{tag}"), &[(cip, 80, "tcp", vec![b1.ip, b2.ip], 8080)]);
    wait_tcp(&a.ns.name, b1.ip, 8080);
    wait_tcp(&a.ns.name, b2.ip, 8080);

    let pins = PinDir::new(&format!("svc-cip{tag}"));
    let switches = BenchSwitches {
        no_fast_v4: general,
        no_flow_cache: general,
        ..BenchSwitches::default()
    };
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    let pods = [(&a, true, true), (&b1, false, false), (&b2, false, false)];
    let ifs = interfaces(&[&a, &b1, &b2]);
    dp.sync_full(&compiled(&pods, &[], &[(2, Protocol::Tcp, 8080)]), &ifs)
        .unwrap();
    program_services(&pins, &[(cip, 80, proto::TCP)]);
    dp.poll_deny_events();

    // Only b1 is allowed: every answer is b1's, some connections fail.
    let before = dp.counters().unwrap();
    let r = probe(&a.ns.name, cip, 80, "tcp", PROBES);
    let after = dp.counters().unwrap();
    assert_eq!(count(&r, "b1") + count(&r, "FAIL"), PROBES, "{r:?}");
    assert!(
        count(&r, "b1") > 0,
        "no connection through the ClusterIP reached b1: {r:?}"
    );
    assert!(
        count(&r, "FAIL") > 0,
        "no connection was DNATed to b2 (or b2 was allowed): {r:?}"
    );
    let denies = dp.poll_deny_events();
    let b2_mapped = b2.ip.to_ipv6_mapped().octets();
    assert!(
        denies
            .iter()
            .any(|e| e.direction == DIR_EGRESS && e.endpoint == 1 && e.dst == b2_mapped && e.dport == 8080),
        "no egress deny of a towards b2:8080: {denies:?}"
    );
    // Each connection's SYN passed from_pod undecided (deferred), and
    // none was counted there as allowed by policy: the decisions after the
    // DNAT are to_pod's (the denies counted on a's egress).
    let grew = |r: Reason| egress_packets(&after, r) - egress_packets(&before, r);
    assert!(
        grew(Reason::Deferred) >= PROBES as u64,
        "deferred: {}",
        grew(Reason::Deferred)
    );
    assert_eq!(grew(Reason::Policy), 0, "deferred packets counted as policy-allowed");
    assert!(grew(Reason::PolicyDenied) >= count(&r, "FAIL") as u64);
    // Direct traffic to b2 stays denied, to b1 allowed (by policy, at
    // from_pod: counted as such, nothing deferred).
    assert_eq!(probe(&a.ns.name, b2.ip, 8080, "tcp", 1), ["FAIL"]);
    assert_eq!(probe(&a.ns.name, b1.ip, 8080, "tcp", 1), ["b1"]);
    let direct = dp.counters().unwrap();
    assert!(egress_packets(&direct, Reason::Policy) > egress_packets(&after, Reason::Policy));
    assert_eq!(
        egress_packets(&direct, Reason::Deferred),
        egress_packets(&after, Reason::Deferred)
    );

    // Both allowed: every connection succeeds, both backends answer.
    let both = [(2, Protocol::Tcp, 8080), (3, Protocol::Tcp, 8080)];
    dp.sync_full(&compiled(&pods, &[], &both), &ifs).unwrap();
    let r = probe(&a.ns.name, cip, 80, "tcp", PROBES);
    assert_eq!(count(&r, "FAIL"), 0, "{r:?}");
    assert!(count(&r, "b1") > 0 && count(&r, "b2") > 0, "{r:?}");
}

/// The usual "allow UDP and TCP 53 to the kube-dns pods" egress rule, used
/// through the DNS ClusterIP: queries get their answers (UDP: two queries
/// on one socket, the second on the flow the first reply confirmed), and
/// anything else from the pod stays denied.
#[test]
fn dns_through_the_cluster_ip() {
    sweep_leftovers();
    let (base, cips) = block(1);
    let dns_ip = Ipv4Addr::from(cips + 2);
    let a = Pod::new("d", base, 0);
    let mut dns = Pod::new("dns", base, 1);
    let other = Pod::new("o", base, 2);
    dns.servers
        .push(serve(&dns.ns.name, dns.ip, "dns", &[53, 8080], &[53, 5353]));
    let _nat = NatTable::new(
        "d",
        &[
            (dns_ip, 53, "udp", vec![dns.ip], 53),
            (dns_ip, 53, "tcp", vec![dns.ip], 53),
            (dns_ip, 5353, "udp", vec![dns.ip], 5353),
        ],
    );
    wait_tcp(&a.ns.name, dns.ip, 53);

    let pins = PinDir::new("svc-dns");
    let mut dp: EbpfDataplane = pins.open();
    let pods = [(&a, true, true), (&dns, false, false), (&other, false, false)];
    let ifs = interfaces(&[&a, &dns, &other]);
    let rules = [(2, Protocol::Udp, 53), (2, Protocol::Tcp, 53)];
    dp.sync_full(&compiled(&pods, &[], &rules), &ifs).unwrap();
    program_services(
        &pins,
        &[
            (dns_ip, 53, proto::UDP),
            (dns_ip, 53, proto::TCP),
            (dns_ip, 5353, proto::UDP),
        ],
    );

    assert_eq!(probe(&a.ns.name, dns_ip, 53, "udp", 4), ["dns"; 4]);
    assert_eq!(probe(&a.ns.name, dns_ip, 53, "tcp", 2), ["dns"; 2]);
    // A port the rule does not name, through a Service too: denied.
    assert_eq!(probe(&a.ns.name, dns_ip, 5353, "udp", 2), ["FAIL"; 2]);
    assert_eq!(probe(&a.ns.name, dns.ip, 8080, "tcp", 1), ["FAIL"]);
}

/// A Service whose two backends are on another node (a namespace reached
/// over a routed veth, the uplink): the packet leaves through the uplink
/// after the DNAT, where `node_exit` takes the deferred decision: only the
/// allowed backend is reached.
#[test]
fn remote_backends_are_decided_where_the_packet_leaves_the_node() {
    remote_case("", 2, AttachMode::Tcx);
}

/// [`remote_backends_are_decided_where_the_packet_leaves_the_node`] with
/// `node_exit` as a tc `clsact` filter, as on kernels without tcx (5.11
/// to 6.5): the same verdicts.
#[test]
fn remote_backends_are_decided_on_tc_clsact_too() {
    remote_case("t", 5, AttachMode::Tc);
}

/// The remote-backend case; `tag` and `t` keep the variants apart.
fn remote_case(tag: &str, t: u32, mode: AttachMode) {
    sweep_leftovers();
    let pid = std::process::id();
    let (base, cips) = block(t);
    let cip = Ipv4Addr::from(cips + 3);
    let a = Pod::new(&format!("r{tag}"), base, 0);
    // The second node: a veth from the root netns, routed.
    let SecondNode {
        node2,
        uplink,
        here,
        there,
        _uplink_guard,
    } = SecondNode::new(&format!("snode2{tag}"), &format!("npt{pid}sup{tag}"), base);
    ns_sh(
        &node2.name,
        &["ip", "route", "add", "default", "via", &here.to_string()],
    );
    // Two remote "pods" (addresses of node 2), routed via node 2.
    let r1 = Ipv4Addr::from(base + 5 * 4 + 1);
    let r2 = Ipv4Addr::from(base + 5 * 4 + 2);
    for r in [r1, r2] {
        ns_sh(&node2.name, &["ip", "addr", "add", &format!("{r}/32"), "dev", "lo"]);
        sh(&[
            "ip",
            "route",
            "add",
            &format!("{r}/32"),
            "via",
            &there.to_string(),
            "dev",
            &uplink,
        ]);
    }
    let _s1 = serve(&node2.name, r1, "r1", &[8080], &[]);
    let _s2 = serve(&node2.name, r2, "r2", &[8080], &[]);
    let _nat = NatTable::new(&format!("r{tag}"), &[(cip, 80, "tcp", vec![r1, r2], 8080)]);
    wait_tcp(&a.ns.name, r1, 8080);
    wait_tcp(&a.ns.name, r2, 8080);

    let pins = PinDir::new(&format!("svc-remote{tag}"));
    // The pods' programs in the same mode: a kernel without tcx has only tc.
    let mut dp: EbpfDataplane = pins.open_in(mode);
    let pods = [(&a, true, true)];
    // r1 is identity(2), r2 identity(3): only r1 is allowed.
    dp.sync_full(
        &compiled(&pods, &[r1, r2], &[(2, Protocol::Tcp, 8080)]),
        &interfaces(&[&a]),
    )
    .unwrap();
    program_services(&pins, &[(cip, 80, proto::TCP)]);
    let mut exit = NodeExit::open_in(None, &pins.path, mode).expect("load node_exit");
    assert_eq!(exit.mode(), mode);
    let up = ifindex_of(&uplink);
    exit.set_interfaces(&BTreeSet::from([up])).expect("attach node_exit");
    assert_eq!(exit.attached(), BTreeSet::from([up]));
    assert_eq!(exit.program_on(up), Some("node_exit"));
    assert_eq!(
        pins.path.join("exit").join(up.to_string()).exists(),
        mode == AttachMode::Tcx
    );
    assert_eq!(
        exit_filter_names(up),
        if mode == AttachMode::Tc {
            vec!["node_exit"]
        } else {
            vec![]
        }
    );
    dp.poll_deny_events();

    let r = probe(&a.ns.name, cip, 80, "tcp", PROBES);
    assert_eq!(count(&r, "r1") + count(&r, "FAIL"), PROBES, "{r:?}");
    assert!(
        count(&r, "r1") > 0,
        "no connection reached the allowed remote backend: {r:?}"
    );
    assert!(
        count(&r, "FAIL") > 0,
        "the denied remote backend was reached or never chosen: {r:?}"
    );
    let denies = dp.poll_deny_events();
    assert!(
        denies
            .iter()
            .any(|e| e.direction == DIR_EGRESS && e.ifindex == a.ifindex && e.dst == r2.to_ipv6_mapped().octets()),
        "no egress deny of a towards r2: {denies:?}"
    );

    // A restarted agent adopts the attachment (its program replaced in
    // place) and keeps deciding.
    drop(exit);
    let mut exit = NodeExit::open_in(None, &pins.path, mode).expect("reopen node_exit");
    assert_eq!(exit.attached(), BTreeSet::from([up]), "adopted");
    let r = probe(&a.ns.name, cip, 80, "tcp", PROBES);
    assert!(count(&r, "r1") > 0 && count(&r, "FAIL") > 0, "after adoption: {r:?}");

    // Detached: the pin or filter goes, and the programs on the uplink with it.
    exit.set_interfaces(&BTreeSet::new()).unwrap();
    assert!(!pins.path.join("exit").join(up.to_string()).exists());
    if mode == AttachMode::Tcx {
        assert_eq!(tcx_prog_ids(&uplink).1, Vec::<u32>::new());
    }
    assert_eq!(exit_filter_names(up), Vec::<String>::new());
}

/// A TUN device (no Ethernet header: the packet starts at its IP header
/// at tc, as on IPIP, WireGuard and GRE devices) held by this test, whose
/// reader records the (destination, TCP destination port) of every packet
/// that leaves by it.
struct Tun {
    name: String,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    seen: std::sync::Arc<std::sync::Mutex<Vec<(Ipv4Addr, u16)>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl Tun {
    fn new(name: &str) -> Tun {
        use std::os::fd::AsRawFd;
        assert!(name.len() < 16, "{name}");
        sh_quiet(&["ip", "link", "del", name]);
        // A kernel with `tun` as a module (Debian's) has no /dev/net/tun
        // until it is loaded.
        sh_quiet(&["modprobe", "tun"]);
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/net/tun")
            .expect("open /dev/net/tun");
        // struct ifreq: the name, then the flags (IFF_TUN | IFF_NO_PI).
        let mut ifr = [0u8; 40];
        ifr[..name.len()].copy_from_slice(name.as_bytes());
        ifr[16..18].copy_from_slice(&(0x0001u16 | 0x1000).to_ne_bytes());
        const TUNSETIFF: libc::c_ulong = 0x4004_54ca;
        // SAFETY: a valid fd and a 40-byte ifreq.
        let r = unsafe { libc::ioctl(f.as_raw_fd(), TUNSETIFF, ifr.as_mut_ptr()) };
        assert_eq!(r, 0, "TUNSETIFF: {}", std::io::Error::last_os_error());
        sh(&["ip", "link", "set", name, "up"]);
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (st, sn) = (stop.clone(), seen.clone());
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !st.load(std::sync::atomic::Ordering::Acquire) {
                let mut pfd = libc::pollfd {
                    fd: f.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                };
                // SAFETY: one valid pollfd.
                if unsafe { libc::poll(&mut pfd, 1, 100) } <= 0 {
                    continue;
                }
                // SAFETY: reads into buf.
                let n = unsafe { libc::read(f.as_raw_fd(), buf.as_mut_ptr() as *mut libc::c_void, buf.len()) };
                if n >= 24 && buf[0] >> 4 == 4 && buf[9] == 6 {
                    let ihl = (buf[0] & 0x0f) as usize * 4;
                    let dst = Ipv4Addr::new(buf[16], buf[17], buf[18], buf[19]);
                    let dport = u16::from_be_bytes([buf[ihl + 2], buf[ihl + 3]]);
                    sn.lock().unwrap().push((dst, dport));
                }
            }
        });
        Tun {
            name: name.to_string(),
            stop,
            seen,
            reader: Some(reader),
        }
    }

    fn seen(&self) -> Vec<(Ipv4Addr, u16)> {
        self.seen.lock().unwrap().clone()
    }
}

impl Drop for Tun {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        sh_quiet(&["ip", "link", "del", &self.name]);
    }
}

/// A Service whose two backends are reached over an L3 tunnel device (a
/// TUN device here; IPIP `tunl0` and WireGuard are the same shape: no
/// Ethernet header, routes without a gateway for WireGuard): `node_exit_l3`
/// on the device decides the deferred egress against the inner packet's
/// backend, never the outer header; only packets to the allowed backend
/// leave by the tunnel. Before `node_exit_l3`, such a device was only
/// reported and both backends were reached.
#[test]
fn backends_behind_an_l3_tunnel_are_decided_before_the_encapsulation() {
    sweep_leftovers();
    let pid = std::process::id();
    let (base, cips) = block(6);
    let cip = Ipv4Addr::from(cips + 6);
    let a = Pod::new("l", base, 0);
    let tun = Tun::new(&format!("npt{pid}tun"));
    // Two remote "pods" routed into the tunnel (no gateway, as WireGuard's).
    let r1 = Ipv4Addr::from(base + 5 * 4 + 1);
    let r2 = Ipv4Addr::from(base + 5 * 4 + 2);
    for r in [r1, r2] {
        sh(&["ip", "route", "add", &format!("{r}/32"), "dev", &tun.name]);
    }
    let _nat = NatTable::new("l", &[(cip, 80, "tcp", vec![r1, r2], 8080)]);

    let pins = PinDir::new("svc-l3");
    let mut dp: EbpfDataplane = pins.open();
    dp.sync_full(
        &compiled(&[(&a, true, true)], &[r1, r2], &[(2, Protocol::Tcp, 8080)]),
        &interfaces(&[&a]),
    )
    .unwrap();
    program_services(&pins, &[(cip, 80, proto::TCP)]);
    let mut exit = NodeExit::open(None, &pins.path).expect("load node_exit");
    let t = ifindex_of(&tun.name);
    exit.set_interfaces(&BTreeSet::from([t])).expect("attach node_exit_l3");
    assert_eq!(exit.program_on(t), Some("node_exit_l3"));
    dp.poll_deny_events();

    // Nobody answers behind the tunnel: every probe fails; what matters is
    // what left by it.
    let r = probe(&a.ns.name, cip, 80, "tcp", 16);
    assert_eq!(count(&r, "FAIL"), 16, "{r:?}");
    let seen = tun.seen();
    assert!(
        seen.contains(&(r1, 8080)),
        "no SYN to the allowed backend left by the tunnel: {seen:?}"
    );
    assert!(
        !seen.iter().any(|(d, _)| *d == r2),
        "a packet to the denied backend left by the tunnel: {seen:?}"
    );
    let denies = dp.poll_deny_events();
    assert!(
        denies
            .iter()
            .any(|e| e.direction == DIR_EGRESS && e.endpoint == 1 && e.dst == r2.to_ipv6_mapped().octets()),
        "no egress deny of a towards r2: {denies:?}"
    );
    exit.set_interfaces(&BTreeSet::new()).unwrap();
}

/// The names of the `bpf` filters on the egress hook of `ifindex`.
pub(crate) fn exit_filter_names(ifindex: u32) -> Vec<String> {
    npm_dataplane::ebpf::tc_filters::list_filters(ifindex, aya::programs::TcAttachType::Egress)
        .unwrap_or_default()
        .into_iter()
        .map(|f| f.name)
        .collect()
}

/// The names of the chains of iptables' `filter` table.
fn iptables_chains(bin: &str) -> Vec<String> {
    sh(&[bin, "-w", "5", "-S"])
        .lines()
        .filter_map(|l| l.strip_prefix("-N ").map(str::to_string))
        .collect()
}

/// `host_in` [`HostIn::open`]ed for `pins` with the agent's chain name
/// (opening removes the chains of pin directories that are gone: those of
/// crashed runs, whose directories `sweep_leftovers` removed).
fn host_in(pins: &PinDir) -> HostIn {
    HostIn::open(None, &pins.path, &host_in_chain(&pins.path)).expect("load host_in and write its INPUT rules")
}

/// `/explain`'s dry run writes no conntrack state: a pending Service entry
/// (a UDP query to a ClusterIP whose backend the policy denies, so no reply
/// ever confirms it) is not confirmed by a crafted "reply" run through
/// `to_pod`, and dry runs of a tracked flow's packet and of an unknown
/// flow leave every entry as it was (flags and timestamps). Before, the
/// crafted reply set `CT_SEEN_REPLY`: later packets of the flow passed
/// `from_pod` as tracked, undecided.
#[test]
fn a_dry_run_confirms_no_pending_entry_and_writes_no_conntrack() {
    use npm_dataplane::ebpf::explain;
    use npm_policy::compiled::Direction as D;
    sweep_leftovers();
    let (base, cips) = block(7);
    let cip = Ipv4Addr::from(cips + 7);
    let a = Pod::new("d", base, 0);
    let mut b = Pod::new("db", base, 1);
    b.servers.push(serve(&b.ns.name, b.ip, "b", &[8080], &[8080]));
    let _nat = NatTable::new("d", &[(cip, 80, "udp", vec![b.ip], 8080)]);
    wait_tcp(&a.ns.name, b.ip, 8080);
    let pins = PinDir::new("svc-dry");
    let mut dp: EbpfDataplane = pins.open();
    // a may reach b on TCP 8080 only: its UDP query through the ClusterIP
    // is deferred, then denied at b's to_pod (its entry stays pending).
    dp.sync_full(
        &compiled(
            &[(&a, true, true), (&b, false, false)],
            &[],
            &[(2, Protocol::Tcp, 8080)],
        ),
        &interfaces(&[&a, &b]),
    )
    .unwrap();
    program_services(&pins, &[(cip, 80, proto::UDP)]);
    let sport = 40_123;
    ns_sh(
        &a.ns.name,
        &[
            "python3",
            "-c",
            &format!("import socket\nu=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(('{}',{sport})); u.sendto(b'q',('{cip}',80))\n", a.ip),
        ],
    );
    // A tracked flow too: a TCP connection to b.
    assert_eq!(probe(&a.ns.name, b.ip, 8080, "tcp", 1), ["b"]);
    let pending = |dp: &EbpfDataplane| {
        dp.ct_entries()
            .into_iter()
            .filter(|(k, v)| k.protocol == proto::UDP && v.flags & npm_common::CT_PENDING != 0)
            .collect::<Vec<_>>()
    };
    let before = pending(&dp);
    assert_eq!(
        before.len(),
        1,
        "the deferred query's pending entry: {:?}",
        dp.ct_entries()
    );
    assert_eq!(before[0].1.flags & npm_common::CT_SEEN_REPLY, 0);
    std::thread::sleep(std::time::Duration::from_millis(150));
    let all_before = dp.ct_entries();

    // The crafted reply: from the ClusterIP's port to a's source port.
    let mut reply = explain::crafted_packet(IpAddr::V4(cip), IpAddr::V4(a.ip), proto::UDP, sport).unwrap();
    let l4 = 14 + 20;
    reply[l4..l4 + 2].copy_from_slice(&80u16.to_be_bytes());
    let v = explain::explain_run(&pins.path, a.ifindex, D::Ingress, &reply).unwrap();
    assert!(v.allowed, "the reply of a pending flow passes: {v:?}");
    // A tracked packet and an unknown flow, both directions.
    for (src, dst, port, dir, ifindex) in [
        (b.ip, a.ip, 8080, D::Ingress, a.ifindex),
        (a.ip, b.ip, 8080, D::Egress, a.ifindex),
        (a.ip, b.ip, 9999, D::Egress, a.ifindex),
        (b.ip, a.ip, 9999, D::Ingress, a.ifindex),
    ] {
        let pkt = explain::crafted_packet(IpAddr::V4(src), IpAddr::V4(dst), proto::TCP, port).unwrap();
        explain::explain_run(&pins.path, ifindex, dir, &pkt).unwrap();
    }
    assert_eq!(pending(&dp), before, "a dry run confirmed the pending entry");
    assert_eq!(dp.ct_entries(), all_before, "a dry run wrote conntrack state");
}

/// The host-backend tests' states for endpoints `at` (endpoint 1 is a):
/// a may reach only endpoint 2 on TCP 8080 (the host denied), then also the
/// host on TCP 9443, the backend's port; `node_ip` is the ipcache's host
/// entry, as the agent's node addresses are.
fn host_backend_states(at: &[(Ipv4Addr, bool, bool)], node_ip: &str) -> (Compiled, Compiled) {
    let mut denied = compiled_at(at, &[], &[(2, Protocol::Tcp, 8080)]);
    ip(&mut denied, node_ip, IDENTITY_HOST, 0);
    let mut allowed = denied.clone();
    allow(
        &mut allowed,
        1,
        Direction::Egress,
        IDENTITY_HOST,
        Some(Protocol::Tcp),
        (9443, 9443),
        7,
    );
    (denied, allowed)
}

/// A Service whose backend is on the node's own host network (kube-proxy
/// DNATs the ClusterIP to a node address, as for `kubernetes.default` on
/// k3s or kind): the packet is delivered to the node after the DNAT and
/// crosses no tc egress hook, so `host_in`, in the `INPUT` chain, takes
/// the deferred decision. Denied while a's egress policy allows only a
/// pod, allowed once it allows the host on the backend's port, as a
/// direct connection to the node address is.
#[test]
fn host_network_backends_are_decided_at_input() {
    sweep_leftovers();
    let (base, cips) = block(4);
    let cip = Ipv4Addr::from(cips + 4);
    let a = Pod::new("h", base, 0);
    let b = Pod::new("hb", base, 1);
    // The node's own address (a's gateway) with a server on the root
    // netns: the host-network backend.
    let node_ip = Ipv4Addr::from(base + 1);
    let code = format!(
        "import socket\ns=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('{node_ip}',9443)); s.listen(64)\nwhile True:\n  c,_=s.accept(); c.sendall(b'host'); c.close()\n"
    );
    let _server = Proc(
        std::process::Command::new("python3")
            .args(["-c", &code])
            .spawn()
            .expect("spawn python3 server"),
    );
    let _nat = NatTable::new("h", &[(cip, 443, "tcp", vec![node_ip], 9443)]);
    wait_tcp(&a.ns.name, node_ip, 9443);

    let pins = PinDir::new("svc-host");
    let mut dp: EbpfDataplane = pins.open();
    let ifs = interfaces(&[&a, &b]);
    let (denied, allowed) = host_backend_states(&[(a.ip, true, true), (b.ip, false, false)], &node_ip.to_string());
    // a may reach only pod b on 8080.
    dp.sync_full(&denied, &ifs).unwrap();
    program_services(&pins, &[(cip, 443, proto::TCP)]);
    let mut hi = host_in(&pins);
    assert_eq!(
        hi.mode(),
        HostInMode::Decided,
        "the xt_bpf match is available on this kernel"
    );
    let rules = sh(&["iptables", "-w", "5", "-S", hi.chain()]);
    assert!(rules.contains("--object-pinned"), "{rules}");
    dp.poll_deny_events();

    // Denied through the ClusterIP, as directly, and the deny says where.
    let before = dp.counters().unwrap();
    assert_eq!(probe(&a.ns.name, cip, 443, "tcp", 3), ["FAIL"; 3]);
    let after = dp.counters().unwrap();
    let grew = |r: Reason| egress_packets(&after, r) - egress_packets(&before, r);
    assert!(grew(Reason::Deferred) >= 3, "deferred: {}", grew(Reason::Deferred));
    assert!(
        grew(Reason::PolicyDenied) >= 3,
        "denied: {}",
        grew(Reason::PolicyDenied)
    );
    let denies = dp.poll_deny_events();
    assert_eq!(probe(&a.ns.name, node_ip, 9443, "tcp", 1), ["FAIL"]);
    assert!(
        denies.iter().any(|e| e.direction == DIR_EGRESS
            && e.endpoint == 1
            && e.dst == node_ip.to_ipv6_mapped().octets()
            && e.dport == 9443),
        "no egress deny of a towards the node's {node_ip}:9443: {denies:?}"
    );

    // Another program flushed the chain: ensure() writes it again.
    sh(&["iptables", "-w", "5", "-F", hi.chain()]);
    assert!(hi.ensure().unwrap(), "the flushed chain was not noticed");
    assert!(!hi.ensure().unwrap(), "the rules were rewritten although intact");
    assert_eq!(probe(&a.ns.name, cip, 443, "tcp", 1), ["FAIL"]);

    // a may reach the host on 9443 (the backend's port, after the DNAT):
    // allowed through the ClusterIP, as directly.
    dp.sync_full(&allowed, &ifs).unwrap();
    assert_eq!(probe(&a.ns.name, cip, 443, "tcp", 3), ["host"; 3]);
    assert_eq!(probe(&a.ns.name, node_ip, 9443, "tcp", 1), ["host"]);

    // A second pin directory's chain (another layout's dataplane), first in
    // INPUT: its program holds no endpoint of a, so it leaves a's packets
    // to a's chain. Once its directory is gone, its chain is stale and
    // removed.
    let pins2 = PinDir::new("svc-host2");
    let dp2: EbpfDataplane = pins2.open();
    let chain2 = host_in_chain(&pins2.path);
    let hi2 = HostIn::open(None, &pins2.path, &chain2).expect("second host_in");
    assert_eq!(probe(&a.ns.name, cip, 443, "tcp", 2), ["host"; 2]);
    drop((hi2, dp2, pins2));
    assert!(remove_stale_host_in_chains().contains(&chain2));
    assert!(!iptables_chains("iptables").contains(&chain2));
    assert!(
        iptables_chains("iptables").contains(&hi.chain().to_string()),
        "a live chain was removed"
    );

    // Removed: the chain and the pin go.
    let chain = hi.chain().to_string();
    hi.remove();
    assert!(!iptables_chains("iptables").contains(&chain));
    assert!(!pins.path.join("host_in").exists());
}

/// The nftables dataplane decides in the forward hook, after the DNAT:
/// the same Service with two backends of which one is allowed, in a node
/// namespace with the nft dataplane's table and the kube-proxy-style DNAT
/// table, gives the same verdicts as the eBPF dataplane.
#[test]
fn nftables_decides_for_the_chosen_backend_too() {
    use npm_dataplane::nft::{NftDataplane, NftOptions};
    clear_netns_leftovers("npmsvcn");
    let pid = std::process::id();
    let node = node_netns(
        &format!("npmsvcn{pid}node"),
        &["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"],
        &["10.78.255.254/32".to_string()],
    );
    let mut pods = Vec::new();
    let mut ifs = BTreeMap::new();
    let mut servers = Vec::new();
    let ips: Vec<Ipv4Addr> = (1..=3).map(|i| Ipv4Addr::new(10, 78, 0, i)).collect();
    for (i, ip) in ips.iter().enumerate() {
        let p = Netns::new(&format!("npmsvcn{pid}pod{i}"));
        let host_if = format!("h{i}");
        let (_, pod_mac) = wire_pod(&node.name, &p.name, &host_if);
        ns_sh(&p.name, &["ip", "addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        route_to_pod(
            &node.name,
            &host_if,
            &pod_mac,
            &ip.to_string(),
            "32",
            Some("10.78.255.254"),
        );
        ifs.insert(i as u32 + 1, ns_ifindex(&node.name, &host_if));
        if i > 0 {
            servers.push(serve(&p.name, *ip, &format!("b{i}"), &[8080], &[]));
        }
        pods.push(p);
    }
    let cip = Ipv4Addr::new(10, 78, 200, 1);
    let script = format!(
        "table ip svc {{\n  chain ep0 {{\n    meta l4proto tcp dnat to {b1}:8080\n  }}\n  chain ep1 {{\n    meta l4proto tcp dnat to {b2}:8080\n  }}\n  chain pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n    ip daddr {cip} tcp dport 80 numgen random mod 2 vmap {{ 0 : goto ep0, 1 : goto ep1 }}\n  }}\n}}\n",
        b1 = ips[1],
        b2 = ips[2]
    );
    let path = TempFile(format!("/tmp/npmsvcn{pid}.nft"));
    std::fs::write(&path.0, script).unwrap();
    ns_sh(&node.name, &["nft", "-f", &path.0]);
    wait_tcp(&pods[0].name, ips[1], 8080);
    wait_tcp(&pods[0].name, ips[2], 8080);

    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npmsvcn{pid}"),
        netns: Some(node.name.clone()),
    })
    .expect("nft dataplane");
    let at = [(ips[0], true, true), (ips[1], false, false), (ips[2], false, false)];
    dp.sync_full(&compiled_at(&at, &[], &[(2, Protocol::Tcp, 8080)]), &ifs)
        .unwrap();
    let r = probe(&pods[0].name, cip, 80, "tcp", PROBES);
    assert_eq!(count(&r, "b1") + count(&r, "FAIL"), PROBES, "{r:?}");
    assert!(count(&r, "b1") > 0 && count(&r, "FAIL") > 0, "{r:?}");
    drop(servers);
}

/// [`host_network_backends_are_decided_at_input`] on the nftables
/// dataplane, in a node namespace: a ClusterIP DNATed to the node's own
/// address is decided as egress to the host (denied while a may reach
/// only a pod, allowed once it may reach the host on the backend's port).
#[test]
fn nftables_decides_host_network_backends_too() {
    use npm_dataplane::nft::{NftDataplane, NftOptions};
    clear_netns_leftovers("npmsvch");
    let pid = std::process::id();
    let node_ip = "10.79.255.254";
    let node = node_netns(
        &format!("npmsvch{pid}node"),
        &["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"],
        &[format!("{node_ip}/32")],
    );
    let mut pods = Vec::new();
    let mut ifs = BTreeMap::new();
    let ips: Vec<Ipv4Addr> = (1..=2).map(|i| Ipv4Addr::new(10, 79, 0, i)).collect();
    for (i, ip) in ips.iter().enumerate() {
        let p = Netns::new(&format!("npmsvch{pid}pod{i}"));
        let host_if = format!("h{i}");
        let (_, pod_mac) = wire_pod(&node.name, &p.name, &host_if);
        ns_sh(&p.name, &["ip", "addr", "add", &format!("{ip}/32"), "dev", "eth0"]);
        route_to_pod(&node.name, &host_if, &pod_mac, &ip.to_string(), "32", Some(node_ip));
        ifs.insert(i as u32 + 1, ns_ifindex(&node.name, &host_if));
        pods.push(p);
    }
    let node_addr: Ipv4Addr = node_ip.parse().unwrap();
    let _server = serve(&node.name, node_addr, "host", &[9443], &[]);
    let cip = Ipv4Addr::new(10, 79, 200, 1);
    let script = format!(
        "table ip svc {{\n  chain pre {{\n    type nat hook prerouting priority dstnat; policy accept;\n    ip daddr {cip} tcp dport 443 dnat to {node_ip}:9443\n  }}\n}}\n"
    );
    let path = TempFile(format!("/tmp/npmsvch{pid}.nft"));
    std::fs::write(&path.0, script).unwrap();
    ns_sh(&node.name, &["nft", "-f", &path.0]);
    wait_tcp(&pods[0].name, node_addr, 9443);

    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npmsvch{pid}"),
        netns: Some(node.name.clone()),
    })
    .expect("nft dataplane");
    let (denied, allowed) = host_backend_states(&[(ips[0], true, true), (ips[1], false, false)], node_ip);
    dp.sync_full(&denied, &ifs).unwrap();
    assert_eq!(probe(&pods[0].name, cip, 443, "tcp", 2), ["FAIL"; 2]);
    assert_eq!(probe(&pods[0].name, node_addr, 9443, "tcp", 1), ["FAIL"]);
    dp.sync_full(&allowed, &ifs).unwrap();
    assert_eq!(probe(&pods[0].name, cip, 443, "tcp", 2), ["host"; 2]);
    assert_eq!(probe(&pods[0].name, node_addr, 9443, "tcp", 1), ["host"]);
}

/// A second node: network namespace `node2` joined to the root netns (this
/// node) by a routed veth, `uplink` on this side with `here`, its peer in
/// `node2` with `there` (the /30 number 4 of `base`).
pub(crate) struct SecondNode {
    pub(crate) node2: Netns,
    pub(crate) uplink: String,
    pub(crate) here: Ipv4Addr,
    pub(crate) there: Ipv4Addr,
    pub(crate) _uplink_guard: LinkGuard,
}

impl SecondNode {
    /// The node `ns_tag` (its netns) with uplink `uplink` (at most 14
    /// characters: its peer takes one more).
    pub(crate) fn new(ns_tag: &str, uplink: &str, base: u32) -> SecondNode {
        let node2 = test_netns(ns_tag);
        let peer_if = format!("{uplink}x");
        sh_quiet(&["ip", "link", "del", uplink]);
        sh(&["ip", "link", "add", uplink, "type", "veth", "peer", "name", &peer_if]);
        sh(&["ip", "link", "set", &peer_if, "netns", &node2.name]);
        let guard = LinkGuard(uplink.to_string());
        let here = Ipv4Addr::from(base + 4 * 4 + 1);
        let there = Ipv4Addr::from(base + 4 * 4 + 2);
        sh(&["ip", "addr", "add", &format!("{here}/30"), "dev", uplink]);
        sh(&["ip", "link", "set", uplink, "up"]);
        ns_sh(
            &node2.name,
            &["ip", "addr", "add", &format!("{there}/30"), "dev", &peer_if],
        );
        ns_sh(&node2.name, &["ip", "link", "set", &peer_if, "up"]);
        ns_sh(&node2.name, &["ip", "link", "set", "lo", "up"]);
        SecondNode {
            node2,
            uplink: uplink.to_string(),
            here,
            there,
            _uplink_guard: guard,
        }
    }
}

/// An interface deleted on drop.
pub(crate) struct LinkGuard(pub(crate) String);

impl Drop for LinkGuard {
    fn drop(&mut self) {
        sh_quiet(&["ip", "link", "del", &self.0]);
    }
}

/// LoadBalancer IPs and externalIPs (a module of its own: this file is long).
mod external;
/// hostPorts (the `portmap` plugin's DNAT of node:hostPort).
mod host_port;
/// Marks owned by others (Calico, Cilium, kube-proxy) between `from_pod`
/// and the deferred decisions.
mod marks;
