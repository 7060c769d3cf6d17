//! Service traffic through the nftables dataplane: a kube-proxy-style DNAT
//! (nftables mode: `nat` prerouting at priority `dstnat` = -100, one
//! random choice among the backends with `numgen random mod 2`) of a
//! ClusterIP to two backend pods, and policies that allow one backend.
//! The dataplane's filter hooks run at priority `filter` (0), after the
//! DNAT: they see the backend's address and port, so the sender's egress
//! and the backend's ingress are decided for the backend the kernel chose,
//! and the replies (un-NATed by conntrack) pass as `ct state established`.
//!
//! Topology: a node namespace routes between pods `client` (10.78.0.1),
//! `b1` (10.78.0.2) and `b2` (10.78.0.3) on their own veths; ClusterIP
//! 10.96.0.10:80 is DNATed to `b1:8080` or `b2:8080`. Each backend answers
//! its name, so the client sees which one it reached. A LoadBalancer IP
//! (203.0.113.5) and an externalIP (198.51.100.7) of the same Service are
//! DNATed alike, as kube-proxy does for a pod's connections to them.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use npm_common::IDENTITY_HOST;
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

use crate::nft_common::{
    allow, clear_leftovers, endpoint, ip, node_netns, ns_ifindex, ns_sh, route_to_pod, wire_pod, Netns, Proc, TempFile,
};

const NS_PREFIX: &str = "npmnftv";
const NODE_IP: &str = "10.78.255.254";
const CLUSTER_IP: &str = "10.96.0.10";
const LB_IP: &str = "203.0.113.5";
const EXTERNAL_IP: &str = "198.51.100.7";
const PODS: [(&str, &str); 3] = [("client", "10.78.0.1"), ("b1", "10.78.0.2"), ("b2", "10.78.0.3")];
const ATTEMPTS: usize = 24;

const PY: &str = r#"
import socket, sys
if sys.argv[1] == "serve":
    name, addr = sys.argv[2], sys.argv[3]
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((addr, 8080)); s.listen(64)
    print("ready", flush=True)
    while True:
        c, _ = s.accept()
        try:
            c.sendall(name.encode())
        finally:
            c.close()
else:
    for _ in range(int(sys.argv[3])):
        try:
            c = socket.create_connection((sys.argv[2], 80), timeout=0.4)
            c.settimeout(0.4)
            print(c.recv(16).decode() or "empty", flush=True)
            c.close()
        except OSError:
            print("denied", flush=True)
"#;

/// Field order is drop order: servers before namespaces.
struct Topo {
    servers: Vec<Proc>,
    pods: Vec<Netns>,
    node: Netns,
    script: TempFile,
    ifs: Interfaces,
}

/// The topology of test `tag` (a letter, never a digit, which would read
/// as part of the pid and make the netns another run's leftover: its names
/// apart from the other tests', which run in parallel).
fn setup(tag: &str) -> Topo {
    setup_with(tag, "")
}

/// [`setup`] with `extra` (chains) in kube-proxy's `nat` table.
fn setup_with(tag: &str, extra: &str) -> Topo {
    clear_leftovers(NS_PREFIX);
    let pid = std::process::id();
    let script = TempFile(format!("/tmp/npm_nft_services_{pid}{tag}.py"));
    std::fs::write(&script.0, PY).unwrap();
    let node = node_netns(
        &format!("{NS_PREFIX}{pid}{tag}node"),
        &["net.ipv4.ip_forward=1", "net.ipv4.conf.all.rp_filter=0"],
        &[format!("{NODE_IP}/32")],
    );
    let n = node.name.clone();
    let mut pods = Vec::new();
    let mut ifs = Interfaces::new();
    for (i, (name, addr)) in PODS.iter().enumerate() {
        let ns = Netns::new(&format!("{NS_PREFIX}{pid}{tag}{name}"));
        let host_if = format!("s{i}");
        let (_, pod_mac) = wire_pod(&n, &ns.name, &host_if);
        ns_sh(&ns.name, &["ip", "addr", "add", &format!("{addr}/32"), "dev", "eth0"]);
        route_to_pod(&n, &host_if, &pod_mac, addr, "32", Some(NODE_IP));
        ifs.insert(i as u32 + 1, ns_ifindex(&n, &host_if));
        pods.push(ns);
    }
    // kube-proxy's nftables mode, reduced to one service: DNAT in nat
    // prerouting (dstnat), a random backend per new connection.
    let kp = format!(
        "table ip kp {{\n chain pre {{\n  type nat hook prerouting priority dstnat; policy accept;\n  \
         ip daddr {{ {CLUSTER_IP}, {LB_IP}, {EXTERNAL_IP} }} tcp dport 80 dnat to numgen random mod 2 map {{ 0 : {} . 8080, 1 : {} . 8080 }}\n }}\n{extra}}}\n",
        PODS[1].1, PODS[2].1
    );
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &n, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(nft.stdin.as_mut().unwrap(), kp.as_bytes()).unwrap();
    drop(nft.stdin.take());
    assert!(nft.wait().unwrap().success(), "load the DNAT:\n{kp}");
    let mut topo = Topo {
        servers: Vec::new(),
        pods,
        node,
        script,
        ifs,
    };
    for (i, (name, addr)) in PODS.iter().enumerate().skip(1) {
        topo.serve(i, name, addr);
    }
    topo
}

impl Topo {
    /// Starts the test server of pod `i` (`name`, listening on `addr`) in
    /// its netns and waits until it is ready.
    fn serve(&mut self, i: usize, name: &str, addr: &str) {
        let script = self.script.0.clone();
        self.spawn_server(i, &[&script, "serve", name, addr]);
    }

    /// Runs `python3 ARGS` in pod `i`'s netns, waits for its `ready`
    /// line, and keeps it until the topology is dropped.
    fn spawn_server(&mut self, i: usize, args: &[&str]) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.pods[i].name, "python3"])
            .args(args)
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        self.servers.push(Proc(child));
    }
}

/// `ATTEMPTS` connections from the client to the ClusterIP: how many
/// reached b1, b2, and how many were denied.
fn connect_all(topo: &Topo) -> (usize, usize, usize) {
    connect_to(topo, CLUSTER_IP)
}

/// `ATTEMPTS` connections from the client to `dst`:80.
fn connect_to(topo: &Topo, dst: &str) -> (usize, usize, usize) {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.pods[0].name,
            "python3",
            &topo.script.0,
            "connect",
            dst,
        ])
        .arg(ATTEMPTS.to_string())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let n = |w: &str| text.lines().filter(|l| l.trim() == w).count();
    let got = (n("b1"), n("b2"), n("denied"));
    assert_eq!(got.0 + got.1 + got.2, ATTEMPTS, "client output: {text}");
    got
}

/// Three endpoints (client 256, b1 257, b2 258) and the node as host.
fn base() -> Compiled {
    let mut c = Compiled::default();
    for (i, (name, addr)) in PODS.iter().enumerate() {
        let id = i as u32 + 1;
        c.endpoints
            .insert(id, endpoint(name, 255 + id, Some(addr), None, false, false));
        ip(&mut c, addr, 255 + id, 0);
    }
    ip(&mut c, NODE_IP, IDENTITY_HOST, 0);
    c
}

#[test]
fn cluster_ip_connections_reach_only_the_allowed_backend() {
    let topo = setup("c");
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_s{}", std::process::id()),
        netns: Some(topo.node.name.clone()),
    })
    .unwrap();
    // Without policy both backends are reached (the DNAT really spreads).
    dp.sync_full(&base(), &topo.ifs).unwrap();
    let (b1, b2, denied) = connect_all(&topo);
    assert!(
        b1 > 0 && b2 > 0 && denied == 0,
        "no policy: b1 {b1}, b2 {b2}, denied {denied}"
    );

    // The client's egress allows b1 on 8080 only (and its ingress nothing:
    // the replies pass as tracked traffic).
    let mut egress = base();
    let client = egress.endpoints.get_mut(&1).unwrap();
    client.isolated_egress = true;
    client.isolated_ingress = true;
    allow(
        &mut egress,
        1,
        Direction::Egress,
        257,
        Some(Protocol::Tcp),
        (8080, 8080),
    );
    dp.apply(&base().diff(&egress), &egress, &topo.ifs).unwrap();
    let (b1, b2, denied) = connect_all(&topo);
    assert!(
        b1 > 0 && b2 == 0 && denied > 0,
        "client egress to b1 only: b1 {b1}, b2 {b2}, denied {denied}"
    );

    // The backends' ingress: b1 allows the client, b2 nothing.
    let mut ingress = base();
    ingress.endpoints.get_mut(&2).unwrap().isolated_ingress = true;
    ingress.endpoints.get_mut(&3).unwrap().isolated_ingress = true;
    allow(
        &mut ingress,
        2,
        Direction::Ingress,
        256,
        Some(Protocol::Tcp),
        (8080, 8080),
    );
    dp.apply(&egress.diff(&ingress), &ingress, &topo.ifs).unwrap();
    let (b1, b2, denied) = connect_all(&topo);
    assert!(
        b1 > 0 && b2 == 0 && denied > 0,
        "b1 admits the client, b2 nobody: b1 {b1}, b2 {b2}, denied {denied}"
    );

    // A rule for the ClusterIP's port (80) allows nothing: the verdict is
    // taken on the backend's port.
    let mut port80 = base();
    port80.endpoints.get_mut(&1).unwrap().isolated_egress = true;
    allow(&mut port80, 1, Direction::Egress, 257, Some(Protocol::Tcp), (80, 80));
    allow(&mut port80, 1, Direction::Egress, 258, Some(Protocol::Tcp), (80, 80));
    dp.apply(&ingress.diff(&port80), &port80, &topo.ifs).unwrap();
    let (b1, b2, denied) = connect_all(&topo);
    assert!(
        b1 == 0 && b2 == 0 && denied == ATTEMPTS,
        "port 80 rules: b1 {b1}, b2 {b2}, denied {denied}"
    );
    dp.remove().unwrap();
}

/// A LoadBalancer IP and an externalIP are DNATed by kube-proxy before the
/// filter hooks: the "internet but not the cluster" egress rule (ipBlock
/// `0.0.0.0/0` except the pods' `10.78.0.0/16`) reaches no backend through
/// them, the allowed backend (b1 by pod) is reached, b2 is not.
#[test]
fn load_balancer_and_external_ips_are_decided_for_the_chosen_backend() {
    let topo = setup("x");
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_sx{}", std::process::id()),
        netns: Some(topo.node.name.clone()),
    })
    .unwrap();
    let world = npm_common::IDENTITY_FIRST_CIDR + 1;
    let pods = npm_common::IDENTITY_FIRST_CIDR + 2;
    let mut c = base();
    c.cidrs.insert("0.0.0.0/0".parse().unwrap(), world);
    c.cidrs.insert("10.78.0.0/16".parse().unwrap(), pods);
    for (_, addr) in PODS {
        c.ipcache.get_mut(&addr.parse().unwrap()).unwrap().cidr_identity = pods;
    }
    c.endpoints.get_mut(&1).unwrap().isolated_egress = true;
    allow(&mut c, 1, Direction::Egress, world, None, (0, 65535));
    allow(&mut c, 1, Direction::Egress, 257, Some(Protocol::Tcp), (8080, 8080));
    dp.sync_full(&c, &topo.ifs).unwrap();
    for dst in [CLUSTER_IP, LB_IP, EXTERNAL_IP] {
        let (b1, b2, denied) = connect_to(&topo, dst);
        assert!(
            b1 > 0 && b2 == 0 && denied > 0,
            "{dst}: the world but not the pods, and b1: b1 {b1}, b2 {b2}, denied {denied}"
        );
    }
    dp.remove().unwrap();
}

/// A second address of the node (host identity too), the source of a node
/// process's connection that the masquerade rewrites.
const NODE_IP2: &str = "10.78.255.253";

/// Connections masqueraded to the node's address on the way to the backend
/// (kube-proxy's masquerade of a NodePort or LoadBalancer connection with
/// `externalTrafficPolicy: Cluster`, of a hairpin, `--masquerade-all`;
/// here `snat` to the node address in `nat` postrouting, priority srcnat)
/// are decided on conntrack's original source: the client pod, not the
/// host it became. b1 admits the client, b2 nobody: only b1 is reached
/// (before the `_nat` chains both were, admitted as the host). A node
/// process's connection, masqueraded alike, still begins at a host address
/// and is admitted as the host.
#[test]
fn masqueraded_connections_are_decided_on_their_original_source() {
    let masq = format!(
        " chain post {{\n  type nat hook postrouting priority srcnat; policy accept;\n  \
         ip daddr {{ {}, {} }} tcp dport 8080 counter snat ip to {NODE_IP}\n }}\n",
        PODS[1].1, PODS[2].1
    );
    let topo = setup_with("m", &masq);
    ns_sh(
        &topo.node.name,
        &["ip", "addr", "add", &format!("{NODE_IP2}/32"), "dev", "lo"],
    );
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_sm{}", std::process::id()),
        netns: Some(topo.node.name.clone()),
    })
    .unwrap();
    let mut c = base();
    ip(&mut c, NODE_IP2, IDENTITY_HOST, 0);
    c.endpoints.get_mut(&2).unwrap().isolated_ingress = true;
    c.endpoints.get_mut(&3).unwrap().isolated_ingress = true;
    allow(&mut c, 2, Direction::Ingress, 256, Some(Protocol::Tcp), (8080, 8080));
    dp.sync_full(&c, &topo.ifs).unwrap();
    let (b1, b2, denied) = connect_all(&topo);
    assert!(
        b1 > 0 && b2 == 0 && denied > 0,
        "masqueraded: b1 admits the client, b2 nobody: b1 {b1}, b2 {b2}, denied {denied}"
    );
    // The masquerade really happened: the `snat` rule (first packet of
    // each connection) counted the client's connections.
    let post = Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.node.name,
            "nft",
            "list",
            "chain",
            "ip",
            "kp",
            "post",
        ])
        .output()
        .unwrap();
    let post = String::from_utf8_lossy(&post.stdout);
    let packets: u64 = post
        .split_whitespace()
        .skip_while(|w| *w != "packets")
        .nth(1)
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    assert!(packets >= ATTEMPTS as u64, "the masquerade counted {packets}:\n{post}");
    // A node process from its second address, masqueraded to the first:
    // the host, admitted by b2 which admits no pod.
    let out = Command::new("ip")
        .args(["netns", "exec", &topo.node.name, "python3", "-c"])
        .arg(format!(
            "import socket\nc = socket.create_connection(('{}', 8080), timeout=2, source_address=('{NODE_IP2}', 0))\n\
             c.settimeout(2)\nprint(c.recv(16).decode())",
            PODS[2].1
        ))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "b2",
        "a node process is the host: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    dp.remove().unwrap();
}

/// A Service whose only backend is the client itself (hairpin).
const HAIRPIN_IP: &str = "10.96.0.11";

/// A pod reaching itself through its own Service (hairpin): kube-proxy
/// DNATs to the pod and masquerades the connection (its source is the
/// endpoint), so the pod sees the node's address. It is decided on the
/// pod itself: admitted by an ingress rule allowing its own pod identity,
/// denied by an ingress policy allowing nothing (before the `_nat` chains
/// it was admitted as the host either way).
#[test]
fn hairpin_connections_are_decided_on_the_pod_itself() {
    let (client, client_ip) = PODS[0];
    let hairpin = format!(
        " chain hairpin_pre {{\n  type nat hook prerouting priority dstnat; policy accept;\n  \
         ip daddr {HAIRPIN_IP} tcp dport 80 dnat to {client_ip}:8080\n }}\n \
         chain hairpin_post {{\n  type nat hook postrouting priority srcnat; policy accept;\n  \
         ip saddr {client_ip} ip daddr {client_ip} tcp dport 8080 counter snat ip to {NODE_IP}\n }}\n"
    );
    let mut topo = setup_with("h", &hairpin);
    topo.serve(0, client, client_ip);
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_sh{}", std::process::id()),
        netns: Some(topo.node.name.clone()),
    })
    .unwrap();
    // (reached itself, denied) out of `ATTEMPTS` connections to the Service.
    let hairpin_connects = |topo: &Topo| {
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &topo.pods[0].name,
                "python3",
                &topo.script.0,
                "connect",
                HAIRPIN_IP,
            ])
            .arg(ATTEMPTS.to_string())
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let n = |w: &str| text.lines().filter(|l| l.trim() == w).count();
        let got = (n(client), n("denied"));
        assert_eq!(got.0 + got.1, ATTEMPTS, "client output: {text}");
        got
    };
    // Its ingress allows its own pod identity on 8080: it reaches itself.
    let mut itself = base();
    itself.endpoints.get_mut(&1).unwrap().isolated_ingress = true;
    allow(
        &mut itself,
        1,
        Direction::Ingress,
        256,
        Some(Protocol::Tcp),
        (8080, 8080),
    );
    dp.sync_full(&itself, &topo.ifs).unwrap();
    assert_eq!(hairpin_connects(&topo), (ATTEMPTS, 0), "allowed to reach itself");
    // Its ingress allows nothing: it does not, though it arrives as the node.
    let mut nothing = base();
    nothing.endpoints.get_mut(&1).unwrap().isolated_ingress = true;
    dp.apply(&itself.diff(&nothing), &nothing, &topo.ifs).unwrap();
    assert_eq!(hairpin_connects(&topo), (0, ATTEMPTS), "denied to reach itself");
    let post = Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.node.name,
            "nft",
            "list",
            "chain",
            "ip",
            "kp",
            "hairpin_post",
        ])
        .output()
        .unwrap();
    let post = String::from_utf8_lossy(&post.stdout);
    assert!(
        !post.contains("packets 0 "),
        "the hairpin masquerade did not happen:\n{post}"
    );
    dp.remove().unwrap();
}

/// IPv6 addresses of the node and of the pods (client, b1, b2).
const NODE_IP6: &str = "fd00:78::ffff";
const PODS6: [&str; 3] = ["fd00:78::1", "fd00:78::2", "fd00:78::3"];
/// An IPv6 ClusterIP.
const CLUSTER_IP6: &str = "fd00:96::10";

/// An IPv6 Service (kube-proxy's `ip6` NAT: DNAT of the ClusterIP to one
/// of two backends, then the masquerade to the node's IPv6 address, as for
/// a `Cluster` NodePort on the backend's node): the client's egress and the
/// backends' ingress are decided for the backend chosen and on the source
/// that began the connection (`ct original ip6 saddr`): b1 admits the
/// client, b2 nobody, so only b1 is reached (before the `_nat` chains b2
/// was too, admitted as the host).
#[test]
fn ipv6_services_are_decided_for_the_backend_on_the_original_source() {
    let mut topo = setup("s");
    let n = topo.node.name.clone();
    ns_sh(&n, &["sysctl", "-qw", "net.ipv6.conf.all.forwarding=1"]);
    ns_sh(
        &n,
        &["ip", "-6", "addr", "add", &format!("{NODE_IP6}/128"), "dev", "lo"],
    );
    for (i, addr) in PODS6.iter().enumerate() {
        let pod = topo.pods[i].name.clone();
        ns_sh(
            &pod,
            &[
                "ip",
                "-6",
                "addr",
                "add",
                &format!("{addr}/128"),
                "dev",
                "eth0",
                "nodad",
            ],
        );
        let out = Command::new("ip")
            .args(["netns", "exec", &pod, "cat", "/sys/class/net/eth0/address"])
            .output()
            .unwrap();
        let mac = String::from_utf8_lossy(&out.stdout).trim().to_string();
        route_to_pod(&n, &format!("s{i}"), &mac, addr, "128", Some(NODE_IP6));
    }
    let kp6 = format!(
        "table ip6 kp6 {{\n chain pre {{\n  type nat hook prerouting priority dstnat; policy accept;\n  \
         ip6 daddr {CLUSTER_IP6} tcp dport 80 dnat to numgen random mod 2 map {{ 0 : {} . 8080, 1 : {} . 8080 }}\n }}\n \
         chain post {{\n  type nat hook postrouting priority srcnat; policy accept;\n  \
         ip6 daddr {{ {}, {} }} tcp dport 8080 counter snat ip6 to {NODE_IP6}\n }}\n}}\n",
        PODS6[1], PODS6[2], PODS6[1], PODS6[2]
    );
    let mut nft = Command::new("ip")
        .args(["netns", "exec", &n, "nft", "-f", "-"])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(nft.stdin.as_mut().unwrap(), kp6.as_bytes()).unwrap();
    drop(nft.stdin.take());
    assert!(nft.wait().unwrap().success(), "load the ip6 NAT:\n{kp6}");
    let serve6 = "import socket, sys\n\
                  s = socket.socket(socket.AF_INET6); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
                  s.bind((sys.argv[2], 8080)); s.listen(64)\n\
                  print('ready', flush=True)\n\
                  while True:\n    c, _ = s.accept()\n    c.sendall(sys.argv[1].encode()); c.close()\n";
    for i in 1..3 {
        topo.spawn_server(i, &["-c", serve6, PODS[i].0, PODS6[i]]);
    }
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_s6{}", std::process::id()),
        netns: Some(n.clone()),
    })
    .unwrap();
    let mut c = Compiled::default();
    for (i, (name, addr)) in PODS.iter().enumerate() {
        let id = i as u32 + 1;
        c.endpoints
            .insert(id, endpoint(name, 255 + id, Some(addr), Some(PODS6[i]), i > 0, false));
        ip(&mut c, addr, 255 + id, 0);
        ip(&mut c, PODS6[i], 255 + id, 0);
    }
    ip(&mut c, NODE_IP, IDENTITY_HOST, 0);
    ip(&mut c, NODE_IP6, IDENTITY_HOST, 0);
    allow(&mut c, 2, Direction::Ingress, 256, Some(Protocol::Tcp), (8080, 8080));
    dp.sync_full(&c, &topo.ifs).unwrap();
    let (b1, b2, denied) = connect_to(&topo, CLUSTER_IP6);
    assert!(
        b1 > 0 && b2 == 0 && denied > 0,
        "IPv6, masqueraded: b1 admits the client, b2 nobody: b1 {b1}, b2 {b2}, denied {denied}"
    );
    let post = Command::new("ip")
        .args(["netns", "exec", &n, "nft", "list", "chain", "ip6", "kp6", "post"])
        .output()
        .unwrap();
    let post = String::from_utf8_lossy(&post.stdout);
    assert!(
        !post.contains("packets 0 "),
        "the ip6 masquerade did not happen:\n{post}"
    );
    dp.remove().unwrap();
}

/// A hostPort through the real `portmap` CNI plugin (containernetworking
/// plugins, `/usr/lib/cni/portmap`, its iptables DNAT of the node's
/// address and the hostPort to the pod): node:9090 leads to b2:8080. The
/// client's egress is decided for b2 and its port (after the DNAT), and
/// b2's ingress on the client: b2 admitting only b1 denies the client,
/// admitting the client lets it in; the client's egress allowing only b1
/// denies it.
#[test]
fn host_ports_are_decided_for_the_pod_behind_them() {
    const PORTMAP: &str = "/usr/lib/cni/portmap";
    if !std::path::Path::new(PORTMAP).exists() {
        panic!("{PORTMAP} missing: install containernetworking-plugins");
    }
    let topo = setup("p");
    let b2 = &topo.pods[2].name;
    let conf = format!(
        r#"{{"cniVersion": "1.0.0", "name": "npm-test", "type": "portmap", "snat": true,
            "runtimeConfig": {{"portMappings": [{{"hostPort": 9090, "containerPort": 8080, "protocol": "tcp"}}]}},
            "prevResult": {{"cniVersion": "1.0.0",
                "interfaces": [{{"name": "eth0", "sandbox": "/var/run/netns/{b2}"}}],
                "ips": [{{"address": "{}/32", "interface": 0}}]}}}}"#,
        PODS[2].1
    );
    let mut add = Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.node.name,
            "env",
            "CNI_COMMAND=ADD",
            "CNI_CONTAINERID=npmtestp",
        ])
        .arg(format!("CNI_NETNS=/var/run/netns/{b2}"))
        .args(["CNI_IFNAME=eth0", "CNI_PATH=/usr/lib/cni", PORTMAP])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(add.stdin.as_mut().unwrap(), conf.as_bytes()).unwrap();
    drop(add.stdin.take());
    let out = add.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "portmap ADD: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_sp{}", std::process::id()),
        netns: Some(topo.node.name.clone()),
    })
    .unwrap();
    let host_port = |topo: &Topo| {
        let out = Command::new("ip")
            .args(["netns", "exec", &topo.pods[0].name, "python3", "-c"])
            .arg(format!(
                "import socket\nfor _ in range(6):\n    try:\n        c = socket.create_connection(('{NODE_IP}', 9090), timeout=0.4)\n        \
                 c.settimeout(0.4); print(c.recv(16).decode() or 'empty', flush=True); c.close()\n    except OSError:\n        print('denied', flush=True)\n"
            ))
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        (
            text.lines().filter(|l| l.trim() == "b2").count(),
            text.lines().filter(|l| l.trim() == "denied").count(),
        )
    };
    // No policy: the DNAT really leads to b2.
    dp.sync_full(&base(), &topo.ifs).unwrap();
    assert_eq!(host_port(&topo), (6, 0), "no policy");
    // b2 admits b1 only: the client is denied.
    let mut only_b1 = base();
    only_b1.endpoints.get_mut(&3).unwrap().isolated_ingress = true;
    allow(
        &mut only_b1,
        3,
        Direction::Ingress,
        257,
        Some(Protocol::Tcp),
        (8080, 8080),
    );
    dp.apply(&base().diff(&only_b1), &only_b1, &topo.ifs).unwrap();
    assert_eq!(host_port(&topo), (0, 6), "b2 admits b1 only");
    // b2 admits the client on 8080 (the pod's port, not the hostPort).
    let mut client_in = base();
    client_in.endpoints.get_mut(&3).unwrap().isolated_ingress = true;
    allow(
        &mut client_in,
        3,
        Direction::Ingress,
        256,
        Some(Protocol::Tcp),
        (8080, 8080),
    );
    dp.apply(&only_b1.diff(&client_in), &client_in, &topo.ifs).unwrap();
    assert_eq!(host_port(&topo), (6, 0), "b2 admits the client");
    // The client's egress allows b1 (and the node itself) only: denied.
    let mut egress = client_in.clone();
    egress.endpoints.get_mut(&1).unwrap().isolated_egress = true;
    allow(
        &mut egress,
        1,
        Direction::Egress,
        257,
        Some(Protocol::Tcp),
        (8080, 8080),
    );
    allow(
        &mut egress,
        1,
        Direction::Egress,
        IDENTITY_HOST,
        Some(Protocol::Tcp),
        (9090, 9090),
    );
    dp.apply(&client_in.diff(&egress), &egress, &topo.ifs).unwrap();
    assert_eq!(
        host_port(&topo),
        (0, 6),
        "the client's egress allows b1 and the node's 9090 only"
    );
    dp.remove().unwrap();
    let mut del = Command::new("ip")
        .args([
            "netns",
            "exec",
            &topo.node.name,
            "env",
            "CNI_COMMAND=DEL",
            "CNI_CONTAINERID=npmtestp",
        ])
        .arg(format!("CNI_NETNS=/var/run/netns/{b2}"))
        .args(["CNI_IFNAME=eth0", "CNI_PATH=/usr/lib/cni", PORTMAP])
        .stdin(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(del.stdin.as_mut().unwrap(), conf.as_bytes()).unwrap();
    drop(del.stdin.take());
    let _ = del.wait();
}
