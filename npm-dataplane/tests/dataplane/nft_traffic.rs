//! Real traffic through the nftables dataplane: a "node" network namespace
//! forwards between three "pod" namespaces joined to it by veth pairs (pods
//! have /32 and /128 addresses and default routes via the node); the table is
//! loaded in the node namespace and TCP/UDP probes over IPv4 and IPv6
//! (python3 in `ip netns exec`) check what passes: pod to pod (forward hook),
//! node to pod (output hook) and pod to node (input hook).

use std::io::{BufRead, BufReader, Write};
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS, IDENTITY_FIRST_CIDR, IDENTITY_HOST};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Counters, Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::model::Protocol;

use crate::nft_common::{
    allow, clear_leftovers, endpoint, ip, node_netns, ns_ifindex, ns_sh, route_to_pod, wire_pod, Netns, Proc, TempFile,
};

const NS_PREFIX: &str = "npmnftt";
const NODE_IP: &str = "10.77.255.254";
const NODE_IP6: &str = "fd77::ffff";
const SPOOF_IP: &str = "10.77.0.9";
const SPOOF_IP6: &str = "fd77::9";
/// 10.77.0.0/16 and fd77::/64.
const C_NET: u32 = IDENTITY_FIRST_CIDR;
const C_NET6: u32 = IDENTITY_FIRST_CIDR + 2;
/// 10.77.0.3/32 and fd77::3/128: pod c, the ipBlocks' except.
const C_EXCEPT: u32 = IDENTITY_FIRST_CIDR + 1;
const C_EXCEPT6: u32 = IDENTITY_FIRST_CIDR + 3;

const PROBE_PY: &str = r#"
import socket, sys, threading, time
def fam(a):
    return socket.AF_INET6 if ":" in a else socket.AF_INET
def tcp_echo(port, any_addr):
    s = socket.socket(fam(any_addr)); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if ":" in any_addr: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((any_addr, port)); s.listen(64)
    def handle(c):
        try:
            while True:
                d = c.recv(100)
                if not d: break
                c.sendall(d)
        except OSError: pass
        c.close()
    while True:
        c, _ = s.accept(); threading.Thread(target=handle, args=(c,), daemon=True).start()
def udp_echo(port, any_addr):
    s = socket.socket(fam(any_addr), socket.SOCK_DGRAM)
    if ":" in any_addr: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind((any_addr, port))
    while True:
        d, a = s.recvfrom(100); s.sendto(d, a)
mode = sys.argv[1]
if mode == "serve":
    for any_addr in ("0.0.0.0", "::"):
        for p in filter(None, sys.argv[2].split(",")):
            threading.Thread(target=tcp_echo, args=(int(p), any_addr), daemon=True).start()
        for p in filter(None, sys.argv[3].split(",")):
            threading.Thread(target=udp_echo, args=(int(p), any_addr), daemon=True).start()
    time.sleep(0.3); print("ready", flush=True)
    while True: time.sleep(3600)
dst, port = sys.argv[2], int(sys.argv[3])
src = sys.argv[4] if len(sys.argv) > 4 else None
if mode == "tcp":
    s = socket.socket(fam(dst)); s.settimeout(1.0)
    try:
        if src: s.bind((src, 0))
        s.connect((dst, port)); s.sendall(b"x"); ok = s.recv(10) == b"x"
    except OSError: ok = False
    sys.exit(0 if ok else 1)
if mode == "udp":
    s = socket.socket(fam(dst), socket.SOCK_DGRAM); s.settimeout(1.0)
    if src: s.bind((src, 0))
    try:
        s.sendto(b"u", (dst, port)); ok = s.recvfrom(10)[0] == b"u"
    except OSError: ok = False
    sys.exit(0 if ok else 1)
if mode == "hold":
    s = socket.socket(fam(dst)); s.settimeout(1.0)
    try:
        s.connect((dst, port)); print("connected", flush=True)
    except OSError:
        print("fail", flush=True); sys.exit(1)
    for line in sys.stdin:
        try:
            s.sendall(b"h"); ok = s.recv(10) == b"h"
        except OSError: ok = False
        print("ok" if ok else "fail", flush=True)
"#;

/// The node and pod namespaces. Field order is drop order: processes first.
struct Topo {
    procs: Vec<Proc>,
    pods: Vec<Netns>,
    node: Netns,
    script: TempFile,
    /// Endpoint id -> ifindex of the node-side veth.
    ifs: Interfaces,
}

fn pod_ip(i: usize) -> String {
    format!("10.77.0.{}", i + 1)
}

fn pod_ip6(i: usize) -> String {
    format!("fd77::{}", i + 1)
}

impl Topo {
    fn new() -> Topo {
        clear_leftovers(NS_PREFIX);
        let pid = std::process::id();
        let script = TempFile(format!("/tmp/npm_nft_probe_{pid}.py"));
        std::fs::write(&script.0, PROBE_PY).unwrap();
        let node = node_netns(
            &format!("{NS_PREFIX}{pid}node"),
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv4.conf.all.rp_filter=0",
                "net.ipv4.conf.default.rp_filter=0",
            ],
            &[format!("{NODE_IP}/32"), format!("{NODE_IP6}/128")],
        );
        let n = node.name.clone();
        let mut pods = Vec::new();
        let mut ifs = Interfaces::new();
        for i in 0..3 {
            let p = Netns::new(&format!("{NS_PREFIX}{pid}pod{i}"));
            let pn = p.name.clone();
            let host_if = format!("h{i}");
            let (_, pod_mac) = wire_pod(&n, &pn, &host_if);
            ns_sh(&pn, &["ip", "addr", "add", &format!("{}/32", pod_ip(i)), "dev", "eth0"]);
            ns_sh(
                &pn,
                &[
                    "ip",
                    "addr",
                    "add",
                    &format!("{}/128", pod_ip6(i)),
                    "dev",
                    "eth0",
                    "nodad",
                ],
            );
            let mut routes = vec![(pod_ip(i), "32", Some(NODE_IP)), (pod_ip6(i), "128", Some(NODE_IP6))];
            if i == 0 {
                // Second addresses on pod a, routed back to it by the node: only
                // the source validation stops traffic sent from them.
                ns_sh(&pn, &["ip", "addr", "add", &format!("{SPOOF_IP}/32"), "dev", "eth0"]);
                ns_sh(
                    &pn,
                    &[
                        "ip",
                        "addr",
                        "add",
                        &format!("{SPOOF_IP6}/128"),
                        "dev",
                        "eth0",
                        "nodad",
                        // Deprecated: never chosen as a source unless bound explicitly.
                        "preferred_lft",
                        "0",
                    ],
                );
                routes.push((SPOOF_IP.to_string(), "32", None));
                routes.push((SPOOF_IP6.to_string(), "128", None));
            }
            for (addr, len, src) in routes {
                route_to_pod(&n, &host_if, &pod_mac, &addr, len, src);
            }
            ifs.insert(i as u32 + 1, ns_ifindex(&n, &host_if));
            pods.push(p);
        }
        let mut topo = Topo {
            procs: Vec::new(),
            pods,
            node,
            script,
            ifs,
        };
        topo.serve(Some(1), "8000,8001,8002", "9000");
        topo.serve(Some(2), "8000", "");
        topo.serve(None, "8000", "");
        topo
    }

    fn ns(&self, at: Option<usize>) -> &str {
        match at {
            Some(i) => &self.pods[i].name,
            None => &self.node.name,
        }
    }

    /// Starts echo servers in pod `at` (None: the node) on both families.
    fn serve(&mut self, at: Option<usize>, tcp: &str, udp: &str) {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                self.ns(at),
                "python3",
                &self.script.0,
                "serve",
                tcp,
                udp,
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "server in {at:?} did not start");
        self.procs.push(Proc(child));
    }

    /// One probe (`tcp` or `udp`) from pod `from` (None: the node) to `dst`.
    fn probe(&self, from: Option<usize>, mode: &str, dst: &str, port: u16, src: Option<&str>) -> bool {
        let port = port.to_string();
        let mut args = vec![
            "netns",
            "exec",
            self.ns(from),
            "python3",
            &self.script.0,
            mode,
            dst,
            &port,
        ];
        if let Some(s) = src {
            args.push(s);
        }
        Command::new("ip").args(&args).status().unwrap().success()
    }

    /// TCP from pod to pod over IPv4 (`v6` false) or IPv6.
    fn tcp(&self, from: usize, to: usize, port: u16, v6: bool) -> bool {
        let dst = if v6 { pod_ip6(to) } else { pod_ip(to) };
        self.probe(Some(from), "tcp", &dst, port, None)
    }

    /// UDP request/reply from pod to pod.
    fn udp(&self, from: usize, to: usize, port: u16, v6: bool) -> bool {
        let dst = if v6 { pod_ip6(to) } else { pod_ip(to) };
        self.probe(Some(from), "udp", &dst, port, None)
    }
}

/// A long-lived TCP connection from a pod, exchanged on demand.
struct Held {
    _proc: Proc,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Held {
    fn open(topo: &Topo, from: usize, dst: &str, port: u16) -> Held {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &topo.pods[from].name,
                "python3",
                &topo.script.0,
                "hold",
            ])
            .args([dst.to_string(), port.to_string()])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let mut stdout = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "connected");
        Held {
            _proc: Proc(child),
            stdin,
            stdout,
        }
    }

    fn exchange(&mut self) -> bool {
        writeln!(self.stdin, "go").unwrap();
        self.stdin.flush().unwrap();
        let mut line = String::new();
        self.stdout.read_line(&mut line).unwrap();
        line.trim() == "ok"
    }
}

/// Pods a (endpoint 1, identity 256), b (2, 257), c (3, 258), dual stack,
/// and the node's addresses; ipBlocks 10.77.0.0/16 except 10.77.0.3/32 and
/// fd77::/64 except fd77::3/128. Nothing isolated.
fn base() -> Compiled {
    let mut c = Compiled::default();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let id = i as u32 + 1;
        let identity = 256 + i as u32;
        let ep = endpoint(name, identity, Some(&pod_ip(i)), Some(&pod_ip6(i)), false, false);
        c.endpoints.insert(id, ep);
        let (cidr, cidr6) = if i == 2 { (C_EXCEPT, C_EXCEPT6) } else { (C_NET, C_NET6) };
        ip(&mut c, &pod_ip(i), identity, cidr);
        ip(&mut c, &pod_ip6(i), identity, cidr6);
    }
    ip(&mut c, NODE_IP, IDENTITY_HOST, C_NET);
    ip(&mut c, NODE_IP6, IDENTITY_HOST, 0);
    c.cidrs.insert("10.77.0.0/16".parse().unwrap(), C_NET);
    c.cidrs.insert("10.77.0.3/32".parse().unwrap(), C_EXCEPT);
    c.cidrs.insert("fd77::/64".parse().unwrap(), C_NET6);
    c.cidrs.insert("fd77::3/128".parse().unwrap(), C_EXCEPT6);
    c
}

fn count(c: &Counters, dir: u8, reason: Reason) -> u64 {
    c.packets(dir, reason)
}

#[test]
fn traffic_through_nft_table() {
    let started = Instant::now();
    let topo = Topo::new();
    let table = format!("npm_t{}", std::process::id());
    let opts = NftOptions {
        table: table.clone(),
        netns: Some(topo.node.name.clone()),
    };
    let mut dp = NftDataplane::new(opts.clone()).unwrap();
    let (a, b, c) = (0, 1, 2);

    // 1. Nothing isolated: everything passes, except spoofed sources.
    let open = base();
    dp.sync_full(&open, &topo.ifs).unwrap();
    for v6 in [false, true] {
        assert!(topo.tcp(a, b, 8000, v6), "open: a -> b tcp/8000 v6={v6}");
        assert!(topo.udp(a, b, 9000, v6), "open: a -> b udp/9000 v6={v6}");
    }
    assert!(topo.tcp(c, b, 8000, false), "open: c -> b tcp/8000");
    assert!(topo.probe(Some(a), "tcp", NODE_IP, 8000, None), "open: a -> node");
    let mut held = Held::open(&topo, a, &pod_ip(b), 8000);
    let mut held6 = Held::open(&topo, a, &pod_ip6(b), 8000);
    assert!(held.exchange() && held6.exchange());
    let before = dp.counters().unwrap();
    assert!(
        !topo.probe(Some(a), "udp", &pod_ip(b), 9000, Some(SPOOF_IP)),
        "spoofed v4 source passed"
    );
    assert!(
        !topo.probe(Some(a), "udp", &pod_ip6(b), 9000, Some(SPOOF_IP6)),
        "spoofed v6 source passed"
    );
    let after = dp.counters().unwrap();
    assert!(count(&after, DIR_EGRESS, Reason::Spoofed) >= count(&before, DIR_EGRESS, Reason::Spoofed) + 2);
    assert!(count(&after, DIR_INGRESS, Reason::NotIsolated) > 0);
    assert!(count(&after, DIR_EGRESS, Reason::Tracked) > 0);

    // 2. b isolated for ingress, nothing allowed: new connections fail, the
    // established ones keep flowing; the node may still reach b.
    let mut deny = base();
    deny.endpoints.get_mut(&2).unwrap().isolated_ingress = true;
    dp.apply(&open.diff(&deny), &deny, &topo.ifs).unwrap();
    let denied_before = count(&dp.counters().unwrap(), DIR_INGRESS, Reason::PolicyDenied);
    assert!(!topo.tcp(a, b, 8000, false), "deny: a -> b tcp/8000");
    assert!(!topo.udp(a, b, 9000, false), "deny: a -> b udp/9000");
    assert!(!topo.tcp(a, b, 8000, true), "deny: a -> b tcp6/8000");
    assert!(held.exchange(), "deny: the established connection was cut");
    assert!(held6.exchange(), "deny: the established v6 connection was cut");
    assert!(
        topo.probe(None, "tcp", &pod_ip(b), 8002, None),
        "deny: node -> b (host ingress)"
    );
    assert!(
        topo.probe(None, "tcp", &pod_ip6(b), 8002, None),
        "deny: node -> b v6 (host ingress)"
    );
    let counters = dp.counters().unwrap();
    assert!(count(&counters, DIR_INGRESS, Reason::PolicyDenied) >= denied_before + 3);
    assert!(count(&counters, DIR_INGRESS, Reason::Host) > 0);
    // Counters survive the table replace of apply (kept across loads).
    assert!(count(&counters, DIR_EGRESS, Reason::Spoofed) >= count(&after, DIR_EGRESS, Reason::Spoofed));

    // 3. b allows a's identity on TCP 8000-8001 and the ipBlocks on UDP 9000.
    let mut allow_some = deny.clone();
    allow(
        &mut allow_some,
        2,
        Direction::Ingress,
        256,
        Some(Protocol::Tcp),
        (8000, 8001),
    );
    allow(
        &mut allow_some,
        2,
        Direction::Ingress,
        C_NET,
        Some(Protocol::Udp),
        (9000, 9000),
    );
    allow(
        &mut allow_some,
        2,
        Direction::Ingress,
        C_NET6,
        Some(Protocol::Udp),
        (9000, 9000),
    );
    dp.apply(&deny.diff(&allow_some), &allow_some, &topo.ifs).unwrap();
    for v6 in [false, true] {
        assert!(topo.tcp(a, b, 8000, v6), "range: a -> b tcp/8000 v6={v6}");
        assert!(topo.tcp(a, b, 8001, v6), "range: a -> b tcp/8001 v6={v6}");
        assert!(
            !topo.tcp(a, b, 8002, v6),
            "range: a -> b tcp/8002 is past the range, v6={v6}"
        );
        assert!(topo.udp(a, b, 9000, v6), "ipBlock: a (inside) -> b udp/9000 v6={v6}");
        assert!(!topo.udp(c, b, 9000, v6), "ipBlock: c (except) -> b udp/9000 v6={v6}");
    }
    assert!(!topo.tcp(c, b, 8000, false), "identity: c -> b tcp/8000");
    assert!(count(&dp.counters().unwrap(), DIR_INGRESS, Reason::Policy) > 0);

    // 4. a isolated for egress, allowed only to c on TCP: b's ingress allow
    // is not enough any more, egress to c works, the node is not reachable
    // (host egress is policy's business) until allowed.
    let mut egress = allow_some.clone();
    egress.endpoints.get_mut(&1).unwrap().isolated_egress = true;
    allow(&mut egress, 1, Direction::Egress, 258, Some(Protocol::Tcp), (0, 65535));
    dp.apply(&allow_some.diff(&egress), &egress, &topo.ifs).unwrap();
    assert!(topo.tcp(a, c, 8000, false), "egress: a -> c tcp/8000");
    assert!(topo.tcp(a, c, 8000, true), "egress: a -> c tcp6/8000");
    assert!(
        !topo.tcp(a, b, 8000, false),
        "egress: a -> b tcp/8000 needs a's egress too"
    );
    assert!(!topo.probe(Some(a), "tcp", NODE_IP, 8000, None), "egress: a -> node");
    assert!(count(&dp.counters().unwrap(), DIR_EGRESS, Reason::PolicyDenied) > 0);
    let mut host_egress = egress.clone();
    allow(&mut host_egress, 1, Direction::Egress, IDENTITY_HOST, None, (0, 65535));
    dp.apply(&egress.diff(&host_egress), &host_egress, &topo.ifs).unwrap();
    assert!(
        topo.probe(Some(a), "tcp", NODE_IP, 8000, None),
        "host egress: a -> node"
    );
    assert!(
        topo.probe(Some(a), "tcp", NODE_IP6, 8000, None),
        "host egress: a -> node v6"
    );

    // 5. Open again. A new dataplane (an agent restart) takes over the table
    // and its counters.
    let total = count(&dp.counters().unwrap(), DIR_INGRESS, Reason::PolicyDenied);
    let mut dp2 = NftDataplane::new(opts).unwrap();
    dp2.sync_full(&open, &topo.ifs).unwrap();
    assert!(count(&dp2.counters().unwrap(), DIR_INGRESS, Reason::PolicyDenied) >= total);
    assert!(topo.tcp(a, b, 8002, false), "reopened: a -> b tcp/8002");
    assert!(topo.udp(c, b, 9000, true), "reopened: c -> b udp6/9000");
    assert!(held.exchange() && held6.exchange());

    // Without the table the spoofed packets' replies come back: the drops
    // above were the table's doing.
    dp2.remove().unwrap();
    assert!(
        topo.probe(Some(a), "udp", &pod_ip(b), 9000, Some(SPOOF_IP)),
        "spoofed probe fails without the table"
    );
    assert!(
        topo.probe(Some(a), "udp", &pod_ip6(b), 9000, Some(SPOOF_IP6)),
        "spoofed v6 probe fails without the table"
    );
    eprintln!("nft traffic test took {:?}", started.elapsed());
    assert!(started.elapsed() < Duration::from_secs(90));
}
