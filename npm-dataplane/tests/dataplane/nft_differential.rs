//! Differential test of the nftables dataplane against the compiler's
//! reference of the datapath (`npm_policy::lookup::lookup`): random compiled
//! policies over three pods and an outside host are loaded into a node
//! namespace, a batch of TCP SYNs and UDP datagrams is sent between every
//! pair over IPv4 and IPv6, and what arrives (captured with a packet socket
//! in each receiver) must be exactly what the reference allows: the
//! sender's egress (if it is a pod) and the receiver's ingress (if it is a
//! pod). Pod 1 also sends from an address that is not its own: dropped
//! (spoofed), as the datapath drops it.
//!
//! Two topologies: routed pods (each on its own veth with /32 routes), and
//! bridged pods (their host veths are ports of one bridge in the node, as
//! the reference `bridge` CNI wires them, br_netfilter on: pod-to-pod
//! traffic is bridged at L2, traffic to the node and the outside host is
//! routed through the bridge device). The outside host is routed in both.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::IpAddr;
use std::process::{ChildStdin, ChildStdout, Command, Stdio};
use std::time::Instant;

use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::{Compiled, Direction};
use npm_policy::lookup::lookup;

use crate::nft_common::{
    clear_leftovers, mac, node_netns, ns_ifindex, ns_sh, route_to_pod, wire_pod, Netns, Proc, TempFile,
};
use crate::random_compiled::{random_policies, Pod, Rng, NODE_IP, NODE_IP6, OUTSIDE_V4, OUTSIDE_V6, PODS};

const NS_PREFIX: &str = "npmnftd";
const PORTS: [u16; 4] = [999, 1000, 1004, 1010];

const CAPTURE_PY: &str = r#"
import socket, struct, sys, threading, time
mode = sys.argv[1]
if mode == "capture":
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
    s.bind(("eth0", 0))
    print("ready", flush=True)
    while True:
        data, addr = s.recvfrom(65535)
        if addr[2] == 4:  # PACKET_OUTGOING
            continue
        eth = struct.unpack("!H", data[12:14])[0]
        if eth == 0x0800:
            ihl = (data[14] & 15) * 4
            proto = data[23]
            src = socket.inet_ntop(socket.AF_INET, data[26:30]); dst = socket.inet_ntop(socket.AF_INET, data[30:34])
            l4 = data[14 + ihl:]
        elif eth == 0x86dd:
            proto = data[20]
            src = socket.inet_ntop(socket.AF_INET6, data[22:38]); dst = socket.inet_ntop(socket.AF_INET6, data[38:54])
            l4 = data[54:]
        else:
            continue
        if proto == 6 and len(l4) >= 14 and (l4[13] & 0x12) == 0x02:
            name = "tcp"
        elif proto == 17 and len(l4) >= 8:
            name = "udp"
        else:
            continue
        dport = struct.unpack("!H", l4[2:4])[0]
        print(f"{src} {dst} {name} {dport}", flush=True)
if mode == "send":
    socks = []
    for line in sys.stdin:
        src, dst, proto, port = line.split()
        fam = socket.AF_INET6 if ":" in dst else socket.AF_INET
        if proto == "udp":
            u = socket.socket(fam, socket.SOCK_DGRAM); u.bind((src, 0))
            u.sendto(b"p", (dst, int(port))); u.close()
        else:
            t = socket.socket(fam, socket.SOCK_STREAM); t.bind((src, 0)); t.setblocking(False)
            try:
                t.connect((dst, int(port)))
            except BlockingIOError:
                pass
            except OSError:
                pass
            socks.append(t)
    time.sleep(0.4)
    for t in socks:
        t.close()
    print("done", flush=True)
"#;

/// A participant: a namespace with addresses; pods are endpoints 1..=3.
struct Host {
    ns: Netns,
    endpoint: Option<u32>,
    v4: Vec<String>,
    v6: Vec<String>,
    /// Addresses the host also sends from that are not its endpoint's.
    spoof: Vec<String>,
}

/// Captured packets of one receiver, read by a thread into a shared set.
type Seen = std::sync::Arc<std::sync::Mutex<BTreeSet<(String, String, String, u16)>>>;

/// Field order is drop order: processes before namespaces.
struct Topo {
    captures: Vec<Proc>,
    hosts: Vec<Host>,
    node: Netns,
    script: TempFile,
    ifs: Interfaces,
    seen: Seen,
}

impl Topo {
    fn new(bridged: bool) -> Topo {
        clear_leftovers(NS_PREFIX);
        let tag = if bridged { "b" } else { "r" };
        let pid = format!("{}{tag}", std::process::id());
        let script = TempFile(format!("/tmp/npm_nft_capture_{pid}.py"));
        std::fs::write(&script.0, CAPTURE_PY).unwrap();
        let node = node_netns(
            &format!("{NS_PREFIX}{pid}node"),
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv4.conf.all.rp_filter=0",
            ],
            &[format!("{NODE_IP}/32"), format!("{NODE_IP6}/128")],
        );
        let n = node.name.clone();
        if bridged {
            ns_sh(&n, &["ip", "link", "add", "br0", "type", "bridge"]);
            ns_sh(&n, &["ip", "link", "set", "br0", "up"]);
        }
        let br_mac = if bridged { mac(&n, "br0") } else { String::new() };
        let mut pod_macs: Vec<(String, String)> = Vec::new();
        // Three pods and an outside host with addresses in and out of the ipBlocks.
        let specs: [(Option<u32>, &[&str], &[&str]); 4] = [
            (Some(PODS[0].ep), &[PODS[0].v4], &[PODS[0].v6]),
            (Some(PODS[1].ep), &[PODS[1].v4], &[PODS[1].v6]),
            (Some(PODS[2].ep), &[PODS[2].v4], &[PODS[2].v6]),
            (None, &OUTSIDE_V4, &OUTSIDE_V6),
        ];
        let mut hosts = Vec::new();
        let mut ifs = Interfaces::new();
        for (i, (ep, v4, v6)) in specs.iter().enumerate() {
            let ns = Netns::new(&format!("{NS_PREFIX}{pid}h{i}"));
            let pn = ns.name.clone();
            let host_if = format!("h{i}");
            let (_, pod_mac) = wire_pod(&n, &pn, &host_if);
            // Pod 1 also holds (and sends from) addresses that are not its endpoint's.
            let spoof: Vec<String> = if *ep == Some(1) {
                vec!["10.77.0.9".into(), "fd77::9".into()]
            } else {
                Vec::new()
            };
            // A bridged pod: its veth is a bridge port, the gateway's MAC is the bridge's.
            let bridged_pod = bridged && ep.is_some();
            let dev = if bridged_pod {
                ns_sh(&n, &["ip", "link", "set", &host_if, "master", "br0"]);
                for gw in ["169.254.1.1", "fe80::1"] {
                    ns_sh(
                        &pn,
                        &[
                            "ip",
                            "neigh",
                            "replace",
                            gw,
                            "lladdr",
                            &br_mac,
                            "dev",
                            "eth0",
                            "nud",
                            "permanent",
                        ],
                    );
                }
                pod_macs.push((pn.clone(), pod_mac.clone()));
                "br0".to_string()
            } else {
                host_if.clone()
            };
            for a in v4
                .iter()
                .copied()
                .chain(spoof.iter().map(String::as_str).filter(|a| !a.contains(':')))
            {
                ns_sh(&pn, &["ip", "addr", "add", &format!("{a}/32"), "dev", "eth0"]);
                route_to_pod(&n, &dev, &pod_mac, a, "32", Some(NODE_IP));
            }
            for a in v6
                .iter()
                .copied()
                .chain(spoof.iter().map(String::as_str).filter(|a| a.contains(':')))
            {
                ns_sh(&pn, &["ip", "addr", "add", &format!("{a}/128"), "dev", "eth0", "nodad"]);
                route_to_pod(&n, &dev, &pod_mac, a, "128", Some(NODE_IP6));
            }
            if let Some(ep) = ep {
                ifs.insert(*ep, ns_ifindex(&n, &host_if));
            }
            hosts.push(Host {
                ns,
                endpoint: *ep,
                v4: v4.iter().map(|s| s.to_string()).collect(),
                v6: v6.iter().map(|s| s.to_string()).collect(),
                spoof,
            });
        }
        // Bridged pods reach each other at L2: on-link routes and neighbours.
        for (i, (pn, _)) in pod_macs.iter().enumerate() {
            for (j, (_, other_mac)) in pod_macs.iter().enumerate() {
                if i == j {
                    continue;
                }
                let h = &hosts[j];
                for (a, len) in h.v4.iter().map(|a| (a, "32")).chain(h.v6.iter().map(|a| (a, "128"))) {
                    let family = if a.contains(':') { "-6" } else { "-4" };
                    ns_sh(
                        pn,
                        &[
                            "ip",
                            family,
                            "neigh",
                            "add",
                            a,
                            "lladdr",
                            other_mac,
                            "dev",
                            "eth0",
                            "nud",
                            "permanent",
                        ],
                    );
                    ns_sh(
                        pn,
                        &["ip", family, "route", "add", &format!("{a}/{len}"), "dev", "eth0"],
                    );
                }
            }
        }
        let mut topo = Topo {
            captures: Vec::new(),
            hosts,
            node,
            script,
            ifs,
            seen: Seen::default(),
        };
        for i in 0..topo.hosts.len() {
            topo.capture(i);
        }
        topo
    }

    fn capture(&mut self, i: usize) {
        let mut child = Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.hosts[i].ns.name,
                "python3",
                &self.script.0,
                "capture",
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "ready");
        let seen = self.seen.clone();
        std::thread::spawn(move || {
            for line in out.lines() {
                let Ok(line) = line else { break };
                let f: Vec<&str> = line.split_whitespace().collect();
                if let [src, dst, proto, port] = f[..] {
                    let port: u16 = port.parse().unwrap_or(0);
                    seen.lock()
                        .unwrap()
                        .insert((src.into(), dst.into(), proto.into(), port));
                }
            }
        });
        self.captures.push(Proc(child));
    }
}

/// The random state of one round over the topology's pods
/// ([`random_policies`]).
fn random_compiled(rng: &mut Rng, topo: &Topo) -> Compiled {
    let pods: Vec<Pod<'_>> = topo
        .hosts
        .iter()
        .filter_map(|h| {
            h.endpoint.map(|ep| Pod {
                ep,
                v4: &h.v4[0],
                v6: &h.v6[0],
            })
        })
        .collect();
    random_policies(rng, &pods, 8)
}

/// What the reference says about a packet from `src` (host index, address)
/// to `dst`.
fn expected(c: &Compiled, topo: &Topo, src: (usize, &str), dst: (usize, &str), proto: &str, port: u16) -> bool {
    let p = if proto == "tcp" { 6 } else { 17 };
    let src_ip: IpAddr = src.1.parse().unwrap();
    let dst_ip: IpAddr = dst.1.parse().unwrap();
    let egress = match topo.hosts[src.0].endpoint {
        // Not the endpoint's own source address: spoofed.
        Some(_) if topo.hosts[src.0].spoof.iter().any(|a| a == src.1) => false,
        Some(ep) => lookup(c, ep, Direction::Egress, dst_ip, p, port).allowed,
        None => true,
    };
    let ingress = match topo.hosts[dst.0].endpoint {
        Some(ep) => lookup(c, ep, Direction::Ingress, src_ip, p, port).allowed,
        None => true,
    };
    egress && ingress
}

fn send_batch(topo: &Topo, from: usize, lines: &[String]) -> (Proc, ChildStdout) {
    send_from(topo, &topo.hosts[from].ns.name, lines)
}

/// Waits, before any table is loaded, until the topology delivers a UDP
/// datagram between every pair the probes use (each source address to each
/// destination address of its family). A freshly built node can drop the
/// first IPv6 datagrams it forwards onto a new bridge for a second or two;
/// without this the first comparison would blame nftables for the kernel's
/// warm-up. Nothing is filtered yet, so every pair must arrive.
fn warm_up(topo: &Topo) {
    let mut want: Vec<(usize, String, String)> = Vec::new();
    for (si, s) in topo.hosts.iter().enumerate() {
        for (di, d) in topo.hosts.iter().enumerate() {
            if si == di || (s.endpoint.is_none() && d.endpoint.is_none()) {
                continue;
            }
            for sa in s.v4.iter().chain(s.v6.iter()) {
                for da in d.v4.iter().chain(d.v6.iter()) {
                    if sa.contains(':') == da.contains(':') {
                        want.push((si, sa.clone(), da.clone()));
                    }
                }
            }
        }
    }
    let port = 39999;
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let missing: Vec<&(usize, String, String)> = {
            let seen = topo.seen.lock().unwrap();
            want.iter()
                .filter(|(_, sa, da)| !seen.contains(&(sa.clone(), da.clone(), "udp".to_string(), port)))
                .collect()
        };
        if missing.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the topology never delivered (no table loaded): {missing:?}"
        );
        for si in 0..topo.hosts.len() {
            let lines: Vec<String> = missing
                .iter()
                .filter(|m| m.0 == si)
                .map(|(_, sa, da)| format!("{sa} {da} udp {port}"))
                .collect();
            if lines.is_empty() {
                continue;
            }
            let (proc_, out) = send_batch(topo, si, &lines);
            let mut line = String::new();
            BufReader::new(out).read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "done");
            drop(proc_);
        }
        std::thread::sleep(std::time::Duration::from_millis(250));
    }
    topo.seen.lock().unwrap().clear();
}

/// Runs the sender in namespace `ns` with one probe per line.
fn send_from(topo: &Topo, ns: &str, lines: &[String]) -> (Proc, ChildStdout) {
    let mut child = Command::new("ip")
        .args(["netns", "exec", ns, "python3", &topo.script.0, "send"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin: ChildStdin = child.stdin.take().unwrap();
    for l in lines {
        writeln!(stdin, "{l}").unwrap();
    }
    drop(stdin);
    let out = child.stdout.take().unwrap();
    (Proc(child), out)
}

#[test]
fn nft_matches_reference_lookup() {
    differential(false);
}

#[test]
fn nft_matches_reference_lookup_with_bridged_pods() {
    differential(true);
}

fn differential(bridged: bool) {
    let started = Instant::now();
    let topo = Topo::new(bridged);
    warm_up(&topo);
    let mut dp = NftDataplane::new(NftOptions {
        table: format!("npm_t{}{}", std::process::id(), if bridged { "b" } else { "r" }),
        netns: Some(topo.node.name.clone()),
    })
    .unwrap();
    let mut total = 0;
    let mut allowed = 0;
    let mut prev: Option<Compiled> = None;
    for seed in 1..=8u64 {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ seed);
        let compiled = random_compiled(&mut rng, &topo);
        // The first policy is loaded whole, the others by incremental updates.
        match &prev {
            None => dp.sync_full(&compiled, &topo.ifs).unwrap(),
            Some(p) => dp.apply(&p.diff(&compiled), &compiled, &topo.ifs).unwrap(),
        }
        topo.seen.lock().unwrap().clear();

        // Every (source address, destination address) pair of one family
        // with a pod on at least one side.
        let mut probes: Vec<(usize, String, usize, String, &str, u16)> = Vec::new();
        for (si, s) in topo.hosts.iter().enumerate() {
            for (di, d) in topo.hosts.iter().enumerate() {
                if si == di || (s.endpoint.is_none() && d.endpoint.is_none()) {
                    continue;
                }
                let fam = |a: &String| a.contains(':');
                for (sa, da) in
                    s.v4.iter()
                        .flat_map(|a| d.v4.iter().map(move |b| (a, b)))
                        .chain(s.v6.iter().flat_map(|a| d.v6.iter().map(move |b| (a, b))))
                        .chain(s.spoof.iter().flat_map(|a| {
                            d.v4.iter()
                                .chain(d.v6.iter())
                                .filter(move |b| fam(a) == fam(b))
                                .map(move |b| (a, b))
                        }))
                {
                    for proto in ["tcp", "udp"] {
                        for port in PORTS {
                            probes.push((si, sa.clone(), di, da.clone(), proto, port));
                        }
                    }
                }
            }
        }
        let mut running = Vec::new();
        for si in 0..topo.hosts.len() {
            let lines: Vec<String> = probes
                .iter()
                .filter(|p| p.0 == si)
                .map(|p| format!("{} {} {} {}", p.1, p.3, p.4, p.5))
                .collect();
            running.push(send_batch(&topo, si, &lines));
        }
        for (proc_, out) in running {
            let mut line = String::new();
            BufReader::new(out).read_line(&mut line).unwrap();
            assert_eq!(line.trim(), "done");
            drop(proc_);
        }
        // A sentinel datagram from the node to every receiver (ingress from
        // the node is always allowed, the outside host has no chain): once a
        // receiver's capture has printed it, it has printed every probe that
        // reached it before.
        let sentinel_port = 40000 + seed as u16;
        let sentinels: Vec<(String, String, String, u16)> = topo
            .hosts
            .iter()
            .map(|h| (NODE_IP.to_string(), h.v4[0].clone(), "udp".to_string(), sentinel_port))
            .collect();
        let lines: Vec<String> = sentinels
            .iter()
            .map(|(s, d, p, port)| format!("{s} {d} {p} {port}"))
            .collect();
        let (proc_, out) = send_from(&topo, &topo.node.name, &lines);
        let mut line = String::new();
        BufReader::new(out).read_line(&mut line).unwrap();
        assert_eq!(line.trim(), "done");
        drop(proc_);
        let deadline = Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let seen = topo.seen.lock().unwrap();
            if sentinels.iter().all(|s| seen.contains(s)) {
                break;
            }
            drop(seen);
            assert!(
                Instant::now() < deadline,
                "seed {seed}: a capture never reported the sentinel"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let seen = topo.seen.lock().unwrap().clone();
        let mut mismatches = Vec::new();
        for (si, sa, di, da, proto, port) in &probes {
            let want = expected(&compiled, &topo, (*si, sa), (*di, da), proto, *port);
            let got = seen.contains(&(sa.clone(), da.clone(), proto.to_string(), *port));
            total += 1;
            allowed += usize::from(want);
            if want != got {
                mismatches.push(format!("{sa} -> {da} {proto}/{port}: reference {want}, nft {got}"));
            }
        }
        assert!(
            mismatches.is_empty(),
            "seed {seed}: {} of {} probes differ:\n{}\ncompiled: {compiled:#?}\ntable:\n{}",
            mismatches.len(),
            probes.len(),
            mismatches.join("\n"),
            dp.list_table().unwrap_or_default()
        );
        prev = Some(compiled);
    }
    assert_eq!(dp.full_loads(), 1, "an incremental update fell back to a full replace");
    eprintln!(
        "{} pods: {total} probes ({allowed} allowed) matched the reference in {:?}",
        if bridged { "bridged" } else { "routed" },
        started.elapsed()
    );
    // Both outcomes were exercised.
    assert!(
        allowed > total / 10 && allowed < total * 9 / 10,
        "{allowed} of {total} allowed"
    );
}
