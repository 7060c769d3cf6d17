//! The topology of the tier tests (`nft_tiers.rs`): a node namespace
//! forwarding between three pod namespaces (veth pairs, /32 and /128
//! addresses), each pod serving TCP 8000 and 8001 and UDP 9000 on both
//! families, probes that tell a refusal from a timeout, and the compiled
//! base state (three endpoints, the node, one ipBlock).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use npm_common::{Reason, IDENTITY_FIRST_CIDR, IDENTITY_HOST};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Counters, Dataplane, Interfaces};
use npm_policy::compiled::Compiled;

use super::{
    clear_leftovers, endpoint, ip, node_netns, ns_ifindex, ns_sh, route_to_pod, wire_pod, Netns, Proc, TempFile,
};

pub const NS_PREFIX: &str = "npmnfttier";
pub const NODE_IP: &str = "10.78.255.254";
pub const NODE_IP6: &str = "fd78::ffff";
/// 10.78.0.0/16: every pod's CIDR identity.
pub const C_NET: u32 = IDENTITY_FIRST_CIDR;
pub const A: usize = 0;
pub const B: usize = 1;
pub const C: usize = 2;
/// Identities of pods a, b, c.
pub const ID_A: u32 = 256;
pub const ID_C: u32 = 258;
/// Endpoint ids of pods a, b, c.
pub const EP_A: u32 = 1;
pub const EP_B: u32 = 2;

pub const PROBE_PY: &str = r#"
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
        for p in (8000, 8001):
            threading.Thread(target=tcp_echo, args=(p, any_addr), daemon=True).start()
        threading.Thread(target=udp_echo, args=(9000, any_addr), daemon=True).start()
    time.sleep(0.3); print("ready", flush=True)
    while True: time.sleep(3600)
dst, port = sys.argv[2], int(sys.argv[3])
if mode == "tcp":
    s = socket.socket(fam(dst)); s.settimeout(1.0)
    try:
        s.connect((dst, port)); s.sendall(b"x"); print("ok" if s.recv(10) == b"x" else "error")
    except ConnectionRefusedError: print("refused")
    except socket.timeout: print("timeout")
    except OSError as e: print("error " + str(e))
if mode == "udp":
    s = socket.socket(fam(dst), socket.SOCK_DGRAM); s.settimeout(1.0)
    try:
        s.sendto(b"u", (dst, port)); print("ok" if s.recvfrom(10)[0] == b"u" else "error")
    except socket.timeout: print("timeout")
    except OSError as e: print("error " + str(e))
"#;

/// The node and pod namespaces. Field order is drop order: processes first.
pub struct Topo {
    pub procs: Vec<Proc>,
    pub pods: Vec<Netns>,
    pub node: Netns,
    pub script: TempFile,
    /// Endpoint id -> ifindex of the node-side veth.
    pub ifs: Interfaces,
}

pub fn pod_ip(i: usize) -> String {
    format!("10.78.0.{}", i + 1)
}

pub fn pod_ip6(i: usize) -> String {
    format!("fd78::{}", i + 1)
}

impl Topo {
    /// Three pods serving TCP 8000, 8001 and UDP 9000 on both families;
    /// `test` makes the namespace names unique.
    pub fn new(test: &str) -> Topo {
        clear_leftovers(NS_PREFIX);
        let pid = std::process::id();
        let script = TempFile(format!("/tmp/npm_nft_tiers_{test}_{pid}.py"));
        std::fs::write(&script.0, PROBE_PY).unwrap();
        let node = node_netns(
            &format!("{NS_PREFIX}{pid}{test}n"),
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
            let p = Netns::new(&format!("{NS_PREFIX}{pid}{test}p{i}"));
            let pn = p.name.clone();
            let host_if = format!("h{i}");
            let (_, pod_mac) = wire_pod(&n, &pn, &host_if);
            ns_sh(&pn, &["ip", "addr", "add", &format!("{}/32", pod_ip(i)), "dev", "eth0"]);
            let v6 = format!("{}/128", pod_ip6(i));
            ns_sh(&pn, &["ip", "addr", "add", &v6, "dev", "eth0", "nodad"]);
            route_to_pod(&n, &host_if, &pod_mac, &pod_ip(i), "32", Some(NODE_IP));
            route_to_pod(&n, &host_if, &pod_mac, &pod_ip6(i), "128", Some(NODE_IP6));
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
        for i in 0..3 {
            topo.serve(Some(i));
        }
        topo.serve(None);
        topo
    }

    pub fn ns(&self, at: Option<usize>) -> &str {
        match at {
            Some(i) => &self.pods[i].name,
            None => &self.node.name,
        }
    }

    pub fn serve(&mut self, at: Option<usize>) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", self.ns(at), "python3", &self.script.0, "serve"])
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

    /// One probe (`tcp` or `udp`) from `from` (None: the node) to `dst`:
    /// `ok`, `refused` (TCP RST), `timeout` or `error ...`.
    pub fn probe(&self, from: Option<usize>, mode: &str, dst: &str, port: u16) -> String {
        let port = port.to_string();
        let args = [
            "netns",
            "exec",
            self.ns(from),
            "python3",
            &self.script.0,
            mode,
            dst,
            &port,
        ];
        let out = Command::new("ip").args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    /// Many probes at once (`(from, mode, dst, port)`, as [`Topo::probe`]),
    /// their results in order: one timeout for the whole batch.
    pub fn probe_all(&self, probes: &[(Option<usize>, &str, String, u16)]) -> Vec<String> {
        let children: Vec<_> = probes
            .iter()
            .map(|(from, mode, dst, port)| {
                Command::new("ip")
                    .args(["netns", "exec", self.ns(*from), "python3", &self.script.0, mode, dst])
                    .arg(port.to_string())
                    .stdout(Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        children
            .into_iter()
            .map(|c| {
                String::from_utf8_lossy(&c.wait_with_output().unwrap().stdout)
                    .trim()
                    .to_string()
            })
            .collect()
    }

    /// TCP pod to pod, IPv4.
    pub fn tcp(&self, from: usize, to: usize, port: u16) -> String {
        self.probe(Some(from), "tcp", &pod_ip(to), port)
    }

    /// TCP pod to pod, IPv6.
    pub fn tcp6(&self, from: usize, to: usize, port: u16) -> String {
        self.probe(Some(from), "tcp", &pod_ip6(to), port)
    }

    /// UDP request/reply pod to pod, IPv4.
    pub fn udp(&self, from: usize, to: usize) -> String {
        self.probe(Some(from), "udp", &pod_ip(to), 9000)
    }

    /// One ICMP echo pod to pod, IPv4.
    pub fn ping(&self, from: usize, to: usize) -> bool {
        let args = ["netns", "exec", self.ns(Some(from)), "ping", "-c1", "-W1", "-q"];
        Command::new("ip")
            .args(args)
            .arg(pod_ip(to))
            .stdout(Stdio::null())
            .status()
            .unwrap()
            .success()
    }

    /// A dataplane on a table unique to the test, in the node namespace.
    pub fn dataplane(&self, test: &str) -> NftDataplane {
        NftDataplane::new(NftOptions {
            table: format!("npm_{test}_{}", std::process::id()),
            netns: Some(self.node.name.clone()),
        })
        .unwrap()
    }
}

/// Pods a (endpoint 1, identity 256), b (2, 257), c (3, 258), dual stack,
/// the node's addresses, the ipBlock 10.78.0.0/16; nothing isolated, no tiers.
pub fn base() -> Compiled {
    let mut c = Compiled::default();
    for (i, name) in ["a", "b", "c"].iter().enumerate() {
        let identity = 256 + i as u32;
        let ep = endpoint(name, identity, Some(&pod_ip(i)), Some(&pod_ip6(i)), false, false);
        c.endpoints.insert(i as u32 + 1, ep);
        ip(&mut c, &pod_ip(i), identity, C_NET);
        ip(&mut c, &pod_ip6(i), identity, 0);
    }
    ip(&mut c, NODE_IP, IDENTITY_HOST, C_NET);
    ip(&mut c, NODE_IP6, IDENTITY_HOST, 0);
    c.cidrs.insert("10.78.0.0/16".parse().unwrap(), C_NET);
    c
}

pub fn count(c: &Counters, dir: u8, reason: Reason) -> u64 {
    c.packets(dir, reason)
}

/// Counter deltas of the reasons the tests look at.
pub struct Deltas {
    pub before: Counters,
}

impl Deltas {
    pub fn start(dp: &NftDataplane) -> Deltas {
        Deltas {
            before: dp.counters().unwrap(),
        }
    }
    pub fn of(&self, dp: &NftDataplane, dir: u8, reason: Reason) -> u64 {
        count(&dp.counters().unwrap(), dir, reason) - count(&self.before, dir, reason)
    }
}
