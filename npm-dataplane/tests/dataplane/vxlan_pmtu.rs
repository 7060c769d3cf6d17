//! Path-MTU discovery across a VXLAN fabric with real traffic,
//! on both dataplanes, IPv4 (Fragmentation Needed) and IPv6 (Packet Too
//! Big).
//!
//! Two "node" network namespaces joined by an underlay veth (MTU 1500),
//! each with a real `vxlan` device (MTU 1450) towards the other, routed
//! like flannel (the other node's pod prefix via a permanent neighbour on
//! the vxlan device). A pod namespace on each node (MTU 1500, /32 and /128
//! addresses, routes and neighbours as `netns_common` wires pods). The
//! sender pod S on node A sends full-size packets with DF (TCP, and
//! `ping -M do`) to the receiver R on node B; node A cannot forward them
//! into its vxlan device and answers S itself with ICMP Fragmentation
//! Needed / Packet Too Big (MTU 1450).
//!
//! Each node runs its own dataplane on its pod's host-side veth: R is
//! ingress-isolated and allows S on TCP [`PORT`] only; S is
//! ingress-isolated with no ingress rule at all. The errors reach S from
//! node A's address, which the compiled state does not list as a node
//! (`IDENTITY_HOST`) address: the error is judged as one from another node
//! or an underlay router would be, so only the match of its quoted header
//! to S's tracked flow (eBPF: `icmp_error.rs`; nftables: `ct state
//! related`) lets it in. (With node A's addresses as HOST, as the agent
//! programs them, step 8 passes errors of the local node anyway.)
//!
//! Asserted per dataplane and family: `ping -M do` of a too-large size
//! gets the error back (its MTU is printed) rather than a silent timeout;
//! S's route cache then holds MTU 1450; a bulk TCP transfer (8 MiB, DF is
//! Linux's default for TCP, `tcp_mtu_probing` off so nothing but the
//! ICMP error can rescue it) completes within [`BULK_TIMEOUT_S`]; the
//! dataplane is in the path (R denies another port, S denies a
//! connection from R). Needs root and `ping` (iputils).

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use crate::ebpf_common::*;
use npm_dataplane::ebpf::EbpfDataplane;
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction, PolicyEntry};
use npm_policy::model::Protocol;
use npm_testkit::netns::in_netns_scoped;

/// Prefix of this test's namespaces: `npmvx<pid><tag><role>`.
const NS_PREFIX: &str = "npmvx";
/// The port R allows S on.
const PORT: u16 = 5001;
/// A port R listens on that no rule allows.
const DENIED_PORT: u16 = 5002;
/// A port S listens on (S allows no ingress at all).
const S_PORT: u16 = 5003;
/// Bytes of the bulk transfer.
const BULK_BYTES: usize = 8 << 20;
/// Time the bulk transfer may take (it takes well under a second with the
/// error delivered; without it TCP retransmits into the black hole).
const BULK_TIMEOUT_S: u32 = 20;
/// The vxlan devices' MTU (the pods have 1500).
const VXLAN_MTU: u32 = 1450;

const S_IP: &str = "10.210.1.2";
const S_IP6: &str = "fd10:1::2";
const R_IP: &str = "10.210.2.2";
const R_IP6: &str = "fd10:2::2";
const S_IDENTITY: u32 = 256;
const R_IDENTITY: u32 = 257;

/// Per node: (underlay address, node address on lo, its IPv6, vxlan MAC,
/// own pod prefix's gateway, IPv6 link-local gateway).
const NODE_A: Node = Node {
    underlay: "192.168.210.1",
    addr: "10.210.255.1",
    addr6: "fd10:ff::1",
    vx_mac: "02:00:0a:d2:00:01",
    gw: "10.210.1.0",
    gw6: "fe80::a",
    pods: ("10.210.1.0/24", "fd10:1::/64"),
};
const NODE_B: Node = Node {
    underlay: "192.168.210.2",
    addr: "10.210.255.2",
    addr6: "fd10:ff::2",
    vx_mac: "02:00:0a:d2:00:02",
    gw: "10.210.2.0",
    gw6: "fe80::b",
    pods: ("10.210.2.0/24", "fd10:2::/64"),
};

/// One node's fabric addresses.
struct Node {
    underlay: &'static str,
    addr: &'static str,
    addr6: &'static str,
    vx_mac: &'static str,
    /// The address the other node routes this node's pod prefix via.
    gw: &'static str,
    gw6: &'static str,
    pods: (&'static str, &'static str),
}

const SERVER_PY: &str = r#"
import socket, sys, threading, time
mode = sys.argv[1]
if mode == "serve":
    def handle(c):
        n = 0
        try:
            c.settimeout(60)
            while True:
                d = c.recv(65536)
                if not d: break
                n += len(d)
            c.sendall(str(n).encode())
        except OSError: pass
        c.close()
    def listen(port, fam, addr):
        s = socket.socket(fam); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if fam == socket.AF_INET6: s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        s.bind((addr, port)); s.listen(16)
        while True:
            c, _ = s.accept(); threading.Thread(target=handle, args=(c,), daemon=True).start()
    for p in sys.argv[2].split(","):
        for fam, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
            threading.Thread(target=listen, args=(int(p), fam, addr), daemon=True).start()
    time.sleep(0.3); print("ready", flush=True)
    while True: time.sleep(3600)
dst, port, size, timeout = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
t0 = time.monotonic()
try:
    s = socket.socket(fam); s.settimeout(2.0)
    s.connect((dst, port))
    s.settimeout(timeout)
    s.sendall(b"x" * size)
    s.shutdown(socket.SHUT_WR)
    got = b""
    while True:
        d = s.recv(64)
        if not d: break
        got += d
    print("OK %d %.3f" % (int(got), time.monotonic() - t0), flush=True)
except Exception as e:
    print("FAIL %s %.3f" % (type(e).__name__, time.monotonic() - t0), flush=True)
"#;

/// The two nodes and their pods. Field order is drop order: servers,
/// pods, nodes.
struct Fabric {
    procs: Vec<Proc>,
    s: Netns,
    r: Netns,
    a: Netns,
    b: Netns,
    script: TempFile,
    /// Endpoint 1 -> S's host-side ifindex in node A.
    ifs_a: Interfaces,
    /// Endpoint 1 -> R's host-side ifindex in node B.
    ifs_b: Interfaces,
}

impl Fabric {
    /// Builds the fabric of the test `tag`, after removing what crashed
    /// runs left.
    fn new(tag: &str) -> Fabric {
        assert!(
            Command::new("ping")
                .arg("-V")
                .output()
                .is_ok_and(|o| o.status.success()),
            "ping (iputils-ping) is not installed: run `cargo xtask setup`"
        );
        clear_netns_leftovers(NS_PREFIX);
        sweep_leftovers();
        let pid = std::process::id();
        let name = |role: &str| format!("{NS_PREFIX}{pid}{tag}{role}");
        let sysctls = [
            "net.ipv4.ip_forward=1",
            "net.ipv6.conf.all.forwarding=1",
            "net.ipv4.conf.all.rp_filter=0",
            "net.ipv4.conf.default.rp_filter=0",
        ];
        let lo = |n: &Node| [format!("{}/32", n.addr), format!("{}/128", n.addr6)];
        let a = node_netns(&name("na"), &sysctls, &lo(&NODE_A));
        let b = node_netns(&name("nb"), &sysctls, &lo(&NODE_B));
        // The underlay: one veth between the nodes, MTU 1500.
        ns_sh(
            &a.name,
            &[
                "ip", "link", "add", "ul", "type", "veth", "peer", "name", "ul", "netns", &b.name,
            ],
        );
        for (ns, n) in [(&a, &NODE_A), (&b, &NODE_B)] {
            ns_sh(
                &ns.name,
                &["ip", "addr", "add", &format!("{}/24", n.underlay), "dev", "ul"],
            );
            ns_sh(&ns.name, &["ip", "link", "set", "ul", "up"]);
        }
        // The vxlan devices and the routes to the other node's pods.
        for (ns, me, peer) in [(&a, &NODE_A, &NODE_B), (&b, &NODE_B, &NODE_A)] {
            let n = ns.name.as_str();
            ns_sh(
                n,
                &[
                    "ip",
                    "link",
                    "add",
                    "vx",
                    "type",
                    "vxlan",
                    "id",
                    "42",
                    "local",
                    me.underlay,
                    "remote",
                    peer.underlay,
                    "dstport",
                    "4789",
                    "dev",
                    "ul",
                ],
            );
            let mtu = VXLAN_MTU.to_string();
            ns_sh(n, &["ip", "link", "set", "vx", "address", me.vx_mac, "mtu", &mtu, "up"]);
            for (gw, prefix, fam) in [(peer.gw, peer.pods.0, "-4"), (peer.gw6, peer.pods.1, "-6")] {
                ns_sh(
                    n,
                    &[
                        "ip",
                        fam,
                        "neigh",
                        "add",
                        gw,
                        "lladdr",
                        peer.vx_mac,
                        "dev",
                        "vx",
                        "nud",
                        "permanent",
                    ],
                );
                let mut route = vec!["ip", fam, "route", "add", prefix, "via", gw, "dev", "vx"];
                if fam == "-4" {
                    route.push("onlink");
                }
                ns_sh(n, &route);
            }
        }
        // The pods.
        let s = Netns::new(&name("ps"));
        let r = Netns::new(&name("pr"));
        let mut ifs_a = Interfaces::new();
        let mut ifs_b = Interfaces::new();
        for (node, me, pod, host_if, ip4, ip6, ifs) in [
            (&a, &NODE_A, &s, "hs", S_IP, S_IP6, &mut ifs_a),
            (&b, &NODE_B, &r, "hr", R_IP, R_IP6, &mut ifs_b),
        ] {
            let (_, pod_mac) = wire_pod(&node.name, &pod.name, host_if);
            ns_sh(&pod.name, &["ip", "addr", "add", &format!("{ip4}/32"), "dev", "eth0"]);
            ns_sh(
                &pod.name,
                &["ip", "addr", "add", &format!("{ip6}/128"), "dev", "eth0", "nodad"],
            );
            // Only the ICMP error may teach a sender the path MTU.
            ns_sh(&pod.name, &["sysctl", "-qw", "net.ipv4.tcp_mtu_probing=0"]);
            route_to_pod(&node.name, host_if, &pod_mac, ip4, "32", Some(me.addr));
            route_to_pod(&node.name, host_if, &pod_mac, ip6, "128", Some(me.addr6));
            ifs.insert(1, ns_ifindex(&node.name, host_if));
        }
        let script = TempFile(format!("/tmp/npm_vxlan_pmtu_{pid}_{tag}.py"));
        std::fs::write(&script.0, SERVER_PY).unwrap();
        let mut f = Fabric {
            procs: Vec::new(),
            s,
            r,
            a,
            b,
            script,
            ifs_a,
            ifs_b,
        };
        let servers = [
            (f.r.name.clone(), format!("{PORT},{DENIED_PORT}")),
            (f.s.name.clone(), S_PORT.to_string()),
        ];
        for (ns, ports) in servers {
            f.serve(&ns, &ports);
        }
        f
    }

    /// Starts the server of the script in `ns` on `ports` (TCP, both
    /// families).
    fn serve(&mut self, ns: &str, ports: &str) {
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "python3", &self.script.0, "serve", ports])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready", "server in {ns} did not start");
        self.procs.push(Proc(child));
    }

    /// Sends `bytes` from namespace `from` to `dst`:`port` over TCP and
    /// reads the count the server received: `OK <count> <seconds>` or
    /// `FAIL <error> <seconds>`.
    fn send(&self, from: &str, dst: &str, port: u16, bytes: usize, timeout_s: u32) -> String {
        let (port, bytes, timeout) = (port.to_string(), bytes.to_string(), timeout_s.to_string());
        ns_sh(from, &["python3", &self.script.0, "send", dst, &port, &bytes, &timeout])
            .trim()
            .to_string()
    }

    /// `ping -M do` of `size` payload bytes from S to `dst`: its whole
    /// output (it gets no reply in any case: R allows no ICMP).
    fn ping_df(&self, dst: &str, size: u32) -> String {
        let fam = if dst.contains(':') { "-6" } else { "-4" };
        let size = size.to_string();
        let out = self.s.exec(&[
            "ping", fam, "-n", "-c", "3", "-i", "0.3", "-W", "1", "-M", "do", "-s", &size, dst,
        ]);
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    }

    /// Forgets every path MTU S learned.
    fn flush_pmtu(&self) {
        ns_sh(&self.s.name, &["ip", "-4", "route", "flush", "cache"]);
        ns_sh(&self.s.name, &["ip", "-6", "route", "flush", "cache"]);
    }

    /// `ip route get dst` in S.
    fn route_get(&self, dst: &str) -> String {
        ns_sh(&self.s.name, &["ip", "route", "get", dst])
    }
}

/// The compiled state of node A (`a` true: endpoint 1 is S) or node B
/// (endpoint 1 is R, allowing S on TCP [`PORT`]): both ingress-isolated,
/// neither egress-isolated; both pods in the ipcache; no node address.
fn compiled(a: bool) -> Compiled {
    let mut c = Compiled::default();
    let (name, id, v4, v6) = if a {
        ("s", S_IDENTITY, S_IP, S_IP6)
    } else {
        ("r", R_IDENTITY, R_IP, R_IP6)
    };
    c.endpoints
        .insert(1, endpoint(name, id, Some(v4), Some(v6), true, false));
    for (addr, id) in [
        (S_IP, S_IDENTITY),
        (S_IP6, S_IDENTITY),
        (R_IP, R_IDENTITY),
        (R_IP6, R_IDENTITY),
    ] {
        ip(&mut c, addr, id, 0);
    }
    if !a {
        c.policy.insert(
            PolicyEntry {
                subject: R_IDENTITY,
                direction: Direction::Ingress,
                peer: S_IDENTITY,
                protocol: Some(Protocol::Tcp),
                ports: (PORT, PORT),
            },
            1,
        );
    }
    c
}

/// The assertions, once the fabric's dataplanes are programmed.
fn check_pmtu(f: &Fabric, what: &str) {
    // The dataplanes are in the path: R denies a port no rule allows, S
    // any connection, R allows S on PORT.
    let small = |from: &str, dst: &str, port: u16| f.send(from, dst, port, 1000, 3);
    for (r_ip, s_ip) in [(R_IP, S_IP), (R_IP6, S_IP6)] {
        assert!(
            small(&f.s.name, r_ip, PORT).starts_with("OK 1000"),
            "{what}: S to R:{PORT}"
        );
        assert!(
            small(&f.s.name, r_ip, DENIED_PORT).starts_with("FAIL"),
            "{what}: R allowed {DENIED_PORT}"
        );
        assert!(
            small(&f.r.name, s_ip, S_PORT).starts_with("FAIL"),
            "{what}: S's ingress is not isolated"
        );
    }
    // Every check runs (a failure is collected, not raised at once), so a
    // run without the error's delivery shows each symptom.
    let mut failed = Vec::new();
    for (dst, size) in [(R_IP, 1472u32), (R_IP6, 1452)] {
        // The error of a too-large ping reaches S: ping prints its MTU
        // (the first as "Frag needed ... (mtu = 1450)" / "Packet too big:
        // mtu=1450", the next as local errors once the MTU is cached).
        f.flush_pmtu();
        assert!(!f.route_get(dst).contains("mtu"), "{what}: {}", f.route_get(dst));
        let out = f.ping_df(dst, size);
        let got_error =
            out.contains("Frag needed") || out.contains("Packet too big") || out.contains("message too long");
        if !(got_error && out.contains(&VXLAN_MTU.to_string())) {
            failed.push(format!(
                "ping -M do -s {size} {dst} got no Fragmentation Needed / Packet Too Big:\n{out}"
            ));
        }
        let route = f.route_get(dst);
        if !route.contains(&format!("mtu {VXLAN_MTU}")) {
            failed.push(format!("after the ping, S's route cache holds no path MTU: {route}"));
        }
        // A bulk transfer with DF from a cold cache completes: the error
        // taught S the path MTU.
        f.flush_pmtu();
        let out = f.send(&f.s.name, dst, PORT, BULK_BYTES, BULK_TIMEOUT_S);
        if !out.starts_with(&format!("OK {BULK_BYTES} ")) {
            failed.push(format!("bulk transfer to {dst} did not complete: {out}"));
        }
        let route = f.route_get(dst);
        if !route.contains(&format!("mtu {VXLAN_MTU}")) {
            failed.push(format!(
                "after the transfer, S's route cache holds no path MTU: {route}"
            ));
        }
        eprintln!("{what}: {dst}: bulk {out}; route: {}", route.trim());
    }
    assert!(failed.is_empty(), "{what}:\n{}", failed.join("\n"));
}

/// The eBPF dataplane on both nodes.
#[test]
fn ebpf_pmtu_across_vxlan() {
    let f = Fabric::new("e");
    let pins_a = PinDir::new("vxpmtu-a");
    let pins_b = PinDir::new("vxpmtu-b");
    let open = |pins: &PinDir, ns: &str, c: &Compiled, ifs: &Interfaces| {
        let opts = pins.options();
        in_netns_scoped(ns, move || {
            let mut dp = EbpfDataplane::open(opts).unwrap_or_else(|e| panic!("open in {ns}: {e}"));
            dp.sync_full(c, ifs).unwrap_or_else(|e| panic!("sync in {ns}: {e}"));
            dp
        })
    };
    let dp_a = open(&pins_a, &f.a.name, &compiled(true), &f.ifs_a);
    let dp_b = open(&pins_b, &f.b.name, &compiled(false), &f.ifs_b);
    let before = dp_a.counters().unwrap();
    check_pmtu(&f, "ebpf");
    // The errors passed S's ingress as related to its flows.
    let after = dp_a.counters().unwrap();
    let related = |c: &npm_dataplane::Counters| c.packets(npm_common::DIR_INGRESS, npm_common::Reason::Related);
    assert!(related(&after) > related(&before), "no ICMP error counted as related");
    drop((dp_a, dp_b));
}

/// The nftables dataplane on both nodes.
#[test]
fn nft_pmtu_across_vxlan() {
    let f = Fabric::new("n");
    let mut dps = Vec::new();
    for (ns, c, ifs) in [
        (&f.a.name, compiled(true), &f.ifs_a),
        (&f.b.name, compiled(false), &f.ifs_b),
    ] {
        let mut dp = NftDataplane::new(NftOptions {
            table: "npmvx".into(),
            netns: Some(ns.clone()),
        })
        .unwrap_or_else(|e| panic!("nft in {ns}: {e}"));
        dp.sync_full(&c, ifs)
            .unwrap_or_else(|e| panic!("nft sync in {ns}: {e}"));
        dps.push(dp);
    }
    check_pmtu(&f, "nftables");
}
