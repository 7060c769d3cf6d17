//! The kube-proxy emulation on real netns and the kernel's real NAT, in both modes: a
//! "node" netns routing for two backend netns and a client netns (another node); a dual-stack
//! NodePort Service with TCP and UDP ports and its EndpointSlices in the test API server.
//! Checked by connections through the NAT, with the source address each backend sees:
//! ClusterIP reaches both backends (TCP, UDP, IPv6); NodePort with
//! `externalTrafficPolicy: Cluster` is source-NATed to the node, with `Local` reaches only
//! the node's endpoint and keeps the client's address; hairpin (a backend reaching itself
//! through its Service) is masqueraded; an endpoint removed from its slice gets no more
//! connections; stopping removes every rule. Then the EndpointSlice controller feeding it
//! from Pods, with a named targetPort.
//!
//! Needs root, `nft`, `iptables(-restore)`, `ip6tables(-restore)`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use npm_e2e::api::Api;
use npm_e2e::endpointslices::EndpointSliceController;
use npm_e2e::kube_proxy::{run_in, KubeProxy, Mode};
use npm_e2e::netns::{ip, NetnsHandle};
use serde_json::{json, Value};

const NODE_NAME: &str = "kp-node";

/// Delete netns of crashed earlier runs (`kpx<pid>...` whose pid is gone).
fn clear_leftovers() {
    let Ok(list) = ip(&["netns", "list"]) else { return };
    for line in list.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix("kpx") else { continue };
        let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
        if !pid.is_empty() && !std::path::Path::new("/proc").join(&pid).exists() {
            let _ = ip(&["netns", "del", name]);
        }
    }
}

/// The topology; dropping it deletes the netns.
struct Topo {
    names: Vec<String>,
    node: String,
    cli: String,
    b: [String; 2],
}

impl Drop for Topo {
    fn drop(&mut self) {
        for n in &self.names {
            let _ = ip(&["netns", "del", n]);
        }
    }
}

/// `10.241.<net>.<host>` and `fd00:241:<net>::<host>`.
fn addrs(net: u8, host: u8) -> (IpAddr, IpAddr) {
    (
        format!("10.241.{net}.{host}").parse().unwrap(),
        format!("fd00:241:{net}::{host}").parse().unwrap(),
    )
}

fn topo(tag: &str) -> Topo {
    clear_leftovers();
    let t = format!("kpx{}{tag}", std::process::id());
    let node = format!("{t}-node");
    let cli = format!("{t}-cli");
    let b = [format!("{t}-b1"), format!("{t}-b2")];
    let names = vec![node.clone(), cli.clone(), b[0].clone(), b[1].clone()];
    for n in &names {
        let _ = ip(&["netns", "del", n]);
        ip(&["netns", "add", n]).unwrap();
        ip(&["-n", n, "link", "set", "lo", "up"]).unwrap();
    }
    // Networks: 1 = b1, 2 = b2, 9 = client; the node is .1 on each.
    for (peer, net) in [(&b[0], 1u8), (&b[1], 2), (&cli, 9)] {
        let dev = format!("v{net}");
        ip(&[
            "-n", &node, "link", "add", &dev, "type", "veth", "peer", "name", "eth0", "netns", peer,
        ])
        .unwrap();
        let (n4, n6) = addrs(net, 1);
        let (p4, p6) = addrs(net, 2);
        ip(&["-n", &node, "addr", "add", &format!("{n4}/24"), "dev", &dev]).unwrap();
        ip(&["-n", &node, "addr", "add", &format!("{n6}/64"), "dev", &dev, "nodad"]).unwrap();
        ip(&["-n", &node, "link", "set", &dev, "up"]).unwrap();
        ip(&["-n", peer, "addr", "add", &format!("{p4}/24"), "dev", "eth0"]).unwrap();
        ip(&["-n", peer, "addr", "add", &format!("{p6}/64"), "dev", "eth0", "nodad"]).unwrap();
        ip(&["-n", peer, "link", "set", "eth0", "up"]).unwrap();
        ip(&["-n", peer, "route", "add", "default", "via", &n4.to_string()]).unwrap();
        ip(&["-n", peer, "-6", "route", "add", "default", "via", &n6.to_string()]).unwrap();
    }
    Topo { names, node, cli, b }
}

/// Run `f` on a thread inside netns `ns`.
fn in_ns<R: Send + 'static>(ns: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let h = NetnsHandle::open(ns).unwrap();
    std::thread::spawn(move || {
        h.enter().unwrap();
        f()
    })
    .join()
    .unwrap()
}

/// A backend: TCP on 8080 and UDP on 5353 (both families), answering `<name> <peer-ip>`.
struct Backend {
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

fn backend(ns: &str, name: &str) -> Backend {
    let stop = Arc::new(AtomicBool::new(false));
    let (tcp, udp) = in_ns(ns, || {
        (
            TcpListener::bind("[::]:8080").unwrap(),
            UdpSocket::bind("[::]:5353").unwrap(),
        )
    });
    tcp.set_nonblocking(true).unwrap();
    udp.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
    let (n1, n2, s1, s2) = (name.to_string(), name.to_string(), stop.clone(), stop.clone());
    let t1 = std::thread::spawn(move || {
        while !s1.load(Ordering::SeqCst) {
            match tcp.accept() {
                Ok((mut c, peer)) => {
                    let _ = writeln!(c, "{n1} {}", peer.ip().to_canonical());
                }
                Err(_) => std::thread::sleep(Duration::from_millis(2)),
            }
        }
    });
    let t2 = std::thread::spawn(move || {
        let mut buf = [0u8; 64];
        while !s2.load(Ordering::SeqCst) {
            if let Ok((_, peer)) = udp.recv_from(&mut buf) {
                let _ = udp.send_to(format!("{n2} {}", peer.ip().to_canonical()).as_bytes(), peer);
            }
        }
    });
    Backend {
        stop,
        threads: vec![t1, t2],
    }
}

/// `count` fresh connections (or datagrams from fresh sockets) from netns `ns` to `dst`:
/// the answers `(backend, peer it saw)`, None for a failed attempt.
fn probe(ns: &str, dst: SocketAddr, udp: bool, count: usize) -> Vec<Option<(String, IpAddr)>> {
    in_ns(ns, move || {
        (0..count)
            .map(|_| {
                let line = if udp {
                    let bind = if dst.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" };
                    let s = UdpSocket::bind(bind).ok()?;
                    s.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
                    s.send_to(b"hi", dst).ok()?;
                    let mut buf = [0u8; 64];
                    let n = s.recv(&mut buf).ok()?;
                    String::from_utf8_lossy(&buf[..n]).to_string()
                } else {
                    let c = TcpStream::connect_timeout(&dst, Duration::from_millis(500)).ok()?;
                    c.set_read_timeout(Some(Duration::from_millis(500))).ok()?;
                    let mut l = String::new();
                    BufReader::new(c).read_line(&mut l).ok()?;
                    l
                };
                let (who, peer) = line.trim().split_once(' ')?;
                Some((who.to_string(), peer.parse().ok()?))
            })
            .collect()
    })
}

/// Counts per (backend, peer).
fn tally(r: &[Option<(String, IpAddr)>]) -> BTreeMap<(String, IpAddr), usize> {
    let mut m = BTreeMap::new();
    for (w, p) in r.iter().flatten() {
        *m.entry((w.clone(), *p)).or_default() += 1;
    }
    m
}

/// Probe until `ok` holds for a whole batch (rules are applied asynchronously).
fn eventually(what: &str, ns: &str, dst: SocketAddr, udp: bool, ok: impl Fn(&[Option<(String, IpAddr)>]) -> bool) {
    let t0 = Instant::now();
    loop {
        let r = probe(ns, dst, udp, 40);
        if ok(&r) {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: to {dst} got {:?}",
            tally(&r)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn slice(name: &str, fam: &str, eps: &[(IpAddr, &str)]) -> Value {
    let eps: Vec<Value> = eps
        .iter()
        .map(|(ip, node)| json!({"addresses": [ip.to_string()], "nodeName": node, "conditions": {"ready": true}}))
        .collect();
    json!({"metadata": {"name": name, "labels": {"kubernetes.io/service-name": "web"}}, "addressType": fam,
        "endpoints": eps,
        "ports": [{"name": "tcp", "port": 8080, "protocol": "TCP"}, {"name": "udp", "port": 5353, "protocol": "UDP"}]})
}

fn only(r: &[Option<(String, IpAddr)>], who: &str, peer: IpAddr) -> bool {
    r.iter()
        .all(|x| x.as_ref().is_some_and(|(w, p)| w == who && *p == peer))
}

fn run_mode(mode: Mode, tag: &str) {
    let t0 = Instant::now();
    let t = topo(tag);
    let server = npm_testapi::TestApiServer::start_background(Default::default()).unwrap();
    let api = Api::new(server.addr());
    let _b1 = backend(&t.b[0], "b1");
    let _b2 = backend(&t.b[1], "b2");
    let svc = api
        .create(
            "/api/v1/namespaces/default/services",
            &json!({"metadata": {"name": "web"}, "spec": {"type": "NodePort", "ipFamilyPolicy": "RequireDualStack",
                "ports": [{"name": "tcp", "port": 80, "targetPort": 8080}, {"name": "udp", "port": 53, "targetPort": 5353, "protocol": "UDP"}]}}),
        )
        .unwrap();
    let cip4: IpAddr = svc["spec"]["clusterIPs"][0].as_str().unwrap().parse().unwrap();
    let cip6: IpAddr = svc["spec"]["clusterIPs"][1].as_str().unwrap().parse().unwrap();
    let np = svc["spec"]["ports"][0]["nodePort"].as_u64().unwrap() as u16;
    let ((b1, b1_6), (b2, b2_6)) = (addrs(1, 2), addrs(2, 2));
    let coll = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices";
    // b1 is on this node, b2 counts as another node's.
    api.create(coll, &slice("web-v4", "IPv4", &[(b1, NODE_NAME), (b2, "other")]))
        .unwrap();
    api.create(coll, &slice("web-v6", "IPv6", &[(b1_6, NODE_NAME), (b2_6, "other")]))
        .unwrap();
    let kp = KubeProxy::start(&t.node, mode, api.clone(), NODE_NAME).unwrap();
    assert!(
        kp.wait_synced(Duration::from_secs(10)),
        "not synced: {:?}",
        kp.last_error()
    );
    let cli = addrs(9, 2).0;
    let both = |peer_b1: IpAddr, peer_b2: IpAddr| {
        move |r: &[Option<(String, IpAddr)>]| {
            let m = tally(r);
            r.iter().all(Option::is_some)
                && m.keys()
                    .all(|k| *k == ("b1".into(), peer_b1) || *k == ("b2".into(), peer_b2))
                && m.len() == 2
        }
    };
    // ClusterIP, TCP and UDP, IPv4 and IPv6: both backends, the client's address kept.
    eventually(
        "ClusterIP TCP",
        &t.cli,
        SocketAddr::new(cip4, 80),
        false,
        both(cli, cli),
    );
    eventually("ClusterIP UDP", &t.cli, SocketAddr::new(cip4, 53), true, both(cli, cli));
    let cli6 = addrs(9, 2).1;
    eventually(
        "ClusterIP TCP v6",
        &t.cli,
        SocketAddr::new(cip6, 80),
        false,
        both(cli6, cli6),
    );
    eventually(
        "ClusterIP UDP v6",
        &t.cli,
        SocketAddr::new(cip6, 53),
        true,
        both(cli6, cli6),
    );
    // NodePort from another node, policy Cluster: SNAT to the node's address on each link.
    let node_v4 = addrs(9, 1).0;
    eventually(
        "NodePort Cluster",
        &t.cli,
        SocketAddr::new(node_v4, np),
        false,
        both(addrs(1, 1).0, addrs(2, 1).0),
    );
    // Hairpin: b1 through its own Service reaches itself masqueraded (and b2 unmasqueraded).
    eventually(
        "hairpin",
        &t.b[0],
        SocketAddr::new(cip4, 80),
        false,
        both(addrs(1, 1).0, b1),
    );
    eventually(
        "hairpin v6",
        &t.b[0],
        SocketAddr::new(cip6, 80),
        false,
        both(addrs(1, 1).1, b1_6),
    );
    // NodePort, policy Local: only this node's endpoint, the client's address kept.
    let patch = json!({"spec": {"externalTrafficPolicy": "Local"}});
    api.request_raw(
        "PATCH",
        "/api/v1/namespaces/default/services/web",
        "application/merge-patch+json",
        Some(&patch),
    )
    .unwrap();
    eventually("NodePort Local", &t.cli, SocketAddr::new(node_v4, np), false, |r| {
        only(r, "b1", cli)
    });
    // Endpoint removal: b1 leaves the slices; only b2 answers.
    let path = format!("{coll}/web-v4");
    let mut cur = api.get(&path).unwrap();
    cur["endpoints"] = slice("x", "IPv4", &[(b2, "other")])["endpoints"].clone();
    let removed = Instant::now();
    api.replace(&path, &cur).unwrap();
    eventually("after removal", &t.cli, SocketAddr::new(cip4, 80), false, |r| {
        only(r, "b2", cli)
    });
    eprintln!(
        "{mode:?}: endpoint removal in effect {:?} after the API write (with 40 probes)",
        removed.elapsed()
    );
    // Local NodePort without a local endpoint drops.
    let r = probe(&t.cli, SocketAddr::new(node_v4, np), false, 3);
    assert!(r.iter().all(Option::is_none), "no local endpoint: {r:?}");
    // Stopping removes the rules.
    let gen = kp.applied_generation();
    assert!(gen >= 3, "one apply per change: {gen}");
    kp.stop();
    match mode {
        Mode::Nftables => {
            assert!(run_in(&t.node, "nft", &["list", "table", "ip", "kube-proxy"], None).is_err());
            assert!(run_in(&t.node, "nft", &["list", "table", "ip6", "kube-proxy"], None).is_err());
        }
        Mode::Iptables => {
            for bin in ["iptables-save", "ip6tables-save"] {
                let s = run_in(&t.node, bin, &[], None).unwrap();
                assert!(!s.contains("KUBE-"), "{bin} after stop:\n{s}");
            }
        }
    }
    let r = probe(&t.cli, SocketAddr::new(cip4, 80), false, 2);
    assert!(r.iter().all(Option::is_none), "no DNAT after stop: {r:?}");
    eprintln!("{mode:?}: {:?}", t0.elapsed());
}

#[test]
fn nftables_mode_cluster_ip_node_port_hairpin_udp_ipv6() {
    run_mode(Mode::Nftables, "n");
}

#[test]
fn iptables_mode_cluster_ip_node_port_hairpin_udp_ipv6() {
    run_mode(Mode::Iptables, "i");
}

/// Pods in the API, the controller making their slices (a named targetPort resolved per
/// Pod), kube-proxy (nftables) DNATing to them; a Pod turning not ready leaves the slices.
#[test]
fn endpointslice_controller_feeds_kube_proxy() {
    let t = topo("c");
    let server = npm_testapi::TestApiServer::start_background(Default::default()).unwrap();
    let api = Api::new(server.addr());
    let _b1 = backend(&t.b[0], "b1");
    let _b2 = backend(&t.b[1], "b2");
    for (name, ip) in [("p1", addrs(1, 2).0), ("p2", addrs(2, 2).0)] {
        api.create(
            "/api/v1/namespaces/default/pods",
            &json!({"metadata": {"name": name, "labels": {"app": "web"}},
                "spec": {"nodeName": NODE_NAME, "containers": [{"name": "c", "image": "x", "ports": [{"name": "serve", "containerPort": 8080}]}]},
                "status": {"phase": "Running", "podIPs": [{"ip": ip.to_string()}]}}),
        )
        .unwrap();
    }
    let svc = api
        .create(
            "/api/v1/namespaces/default/services",
            &json!({"metadata": {"name": "web"}, "spec": {"selector": {"app": "web"}, "ports": [{"port": 80, "targetPort": "serve"}]}}),
        )
        .unwrap();
    let cip: IpAddr = svc["spec"]["clusterIP"].as_str().unwrap().parse().unwrap();
    let ctl = EndpointSliceController::start(api.clone()).unwrap();
    assert!(ctl.wait_synced(Duration::from_secs(10)), "{:?}", ctl.last_error());
    let kp = KubeProxy::start(&t.node, Mode::Nftables, api.clone(), NODE_NAME).unwrap();
    assert!(kp.wait_synced(Duration::from_secs(10)), "{:?}", kp.last_error());
    let cli = addrs(9, 2).0;
    eventually("both pods", &t.cli, SocketAddr::new(cip, 80), false, |r| {
        let m = tally(r);
        r.iter().all(Option::is_some) && m.len() == 2 && m.keys().all(|(_, p)| *p == cli)
    });
    let patch = json!({"status": {"conditions": [{"type": "Ready", "status": "False"}]}});
    api.request_raw(
        "PATCH",
        "/api/v1/namespaces/default/pods/p1/status",
        "application/merge-patch+json",
        Some(&patch),
    )
    .unwrap();
    eventually("p1 not ready", &t.cli, SocketAddr::new(cip, 80), false, |r| {
        only(r, "b2", cli)
    });
    let slices = api
        .get("/apis/discovery.k8s.io/v1/endpointslices?labelSelector=kubernetes.io%2Fservice-name%3Dweb")
        .unwrap();
    let items = slices["items"].as_array().unwrap();
    assert_eq!(items.len(), 1, "{slices}");
    assert_eq!(items[0]["ports"][0]["port"], 8080);
    kp.stop();
    ctl.stop();
}
