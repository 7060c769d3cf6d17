//! Bridged pods on the nftables dataplane, end to
//! end with the real `npm-agent` binary and real nftables: pods `a`, `b`,
//! `c` wired by the real reference `bridge` plugin (host-local IPAM) to one
//! bridge in the root namespace (br_netfilter on, as on Kubernetes nodes),
//! plus a routed pod `d` (a veth with its own subnet) and the node itself.
//!
//! 1. Without any policy, every pair still connects once the agent runs:
//!    bridged pod to bridged pod (L2 through br_netfilter), bridged to
//!    routed and back (routed through the bridge device), pod to node and
//!    node to pod (nothing else is disturbed).
//! 2. An ingress policy on `b` allowing only `a`: `c` and `d` are denied,
//!    `a` and the node are allowed, `b`'s own connections still work.
//! 3. An egress policy on `c` allowing only `a` on 8080: `c` reaches `a`,
//!    not `d` (routed) nor the node, and `d` still connects to `c` (the
//!    replies leave `c` as tracked traffic).
//!
//! Names are `npmnbn<pid>...` (netns `npmnbn<pid>a|b|c|d`, bridge
//! `npmnbn<pid>br`, table `npmnbn<pid>`); leftovers of crashed runs are
//! removed first. IPv4 forwarding is restored afterwards.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cni_plugins::{bridge_conf, clear_leftovers, CniPod};
use crate::common::netns::{add_routed_pod, expect_probe, pid_gone, probe, serve, Forwarding};
use crate::common::process::{free_port, http_get, spawn_agent_run_with};
use crate::common::*;

const PREFIX: &str = "npmnbn";
const SUBNET: &str = "10.236.0.0/24";
const GATEWAY: &str = "10.236.0.1";
/// The routed pod: `10.236.1.2` behind `10.236.1.1` on its veth.
const ROUTED: &str = "10.236.1.2";
const NODE_PORT: u16 = 8081;

/// The pods, the bridge, the agent, its table; all removed on drop.
struct Topology {
    agent: Option<Child>,
    pods: Vec<CniPod>,
    routed_ns: String,
    routed_veth: String,
    bridge: String,
    table: String,
    work_dir: PathBuf,
    /// IPv4 forwarding on (the bridge plugin turns it on too), shared.
    _forwarding: Forwarding,
    stop: Arc<AtomicBool>,
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        self.stop.store(true, Ordering::SeqCst);
        self.pods.clear();
        for family in ["inet", "bridge"] {
            let _ = Command::new("nft")
                .args(["delete", "table", family, &self.table])
                .output();
        }
        let _ = Command::new("ip").args(["link", "delete", &self.routed_veth]).output();
        let _ = Command::new("ip").args(["netns", "delete", &self.routed_ns]).output();
        let _ = Command::new("ip").args(["link", "delete", &self.bridge]).output();
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

/// Deletes the `inet` and `bridge` tables `npmnbn<pid>` whose process is gone.
fn clear_stale_tables() {
    let Ok(out) = Command::new("nft").args(["list", "tables"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let mut words = line.split_whitespace().skip(1);
        let (Some(family), Some(name)) = (words.next(), words.next()) else {
            continue;
        };
        if name.starts_with(PREFIX) && pid_gone(name, PREFIX) {
            let _ = Command::new("nft").args(["delete", "table", family, name]).output();
        }
    }
}

fn setup() -> Topology {
    clear_leftovers(PREFIX);
    clear_stale_tables();
    let pid = std::process::id();
    let work_dir = std::env::temp_dir().join(format!("{PREFIX}{pid}"));
    std::fs::create_dir_all(&work_dir).unwrap();
    let mut t = Topology {
        agent: None,
        pods: Vec::new(),
        routed_ns: format!("{PREFIX}{pid}d"),
        routed_veth: format!("{PREFIX}{pid}vd"),
        bridge: format!("{PREFIX}{pid}br"),
        table: format!("{PREFIX}{pid}"),
        _forwarding: Forwarding::on(),
        stop: Arc::default(),
        work_dir,
    };
    for name in ["a", "b", "c"] {
        let mut conf = bridge_conf("npmnbn-bridge", &t.bridge, SUBNET, &t.work_dir.join("ipam"));
        // The pods' default route via the bridge (the plugin adds it only
        // with isDefaultGateway), so they reach the routed pod.
        conf["isDefaultGateway"] = serde_json::Value::Bool(true);
        t.pods.push(CniPod::add(
            &format!("{PREFIX}{pid}{name}"),
            "bridge",
            conf,
            None,
            "k",
            name,
        ));
    }
    // 10.236.1.2/24 behind 10.236.1.1 on the veth: routed, like ptp.
    add_routed_pod(&t.routed_ns, &t.routed_veth, "10.236", 1);
    t
}

fn addr(ip: &str) -> SocketAddr {
    format!("{ip}:8080").parse().unwrap()
}

/// A TCP server in this (the node's) namespace answering "ok" until `stop`.
fn serve_on_node(addr: SocketAddr, stop: Arc<AtomicBool>) {
    let l = TcpListener::bind(addr).expect("bind node server");
    l.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((mut s, _)) => {
                    let _ = s.write_all(b"ok");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
}

/// One TCP connection from the node to `addr`: did it get "ok"?
fn probe_from_node(addr: SocketAddr) -> bool {
    let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
    let mut buf = [0u8; 2];
    s.read_exact(&mut buf).is_ok() && &buf == b"ok"
}

/// Where a probe starts: a pod namespace or the node.
#[derive(Clone)]
enum From {
    Pod(String),
    Node,
}

async fn expect(from: &From, to: SocketAddr, want: bool, what: &str) {
    match from {
        From::Pod(ns) => expect_probe(ns, to, want, what).await,
        From::Node => {
            let start = Instant::now();
            while tokio::task::spawn_blocking(move || probe_from_node(to)).await.unwrap() != want {
                assert!(start.elapsed() < Duration::from_secs(15), "{what}: should be {want}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
}

fn probe_now(from: &From, to: SocketAddr) -> bool {
    match from {
        From::Pod(ns) => probe(ns, to),
        From::Node => probe_from_node(to),
    }
}

/// `nft list table <family> <table>`, empty when missing.
fn list(family: &str, table: &str) -> String {
    let out = Command::new("nft")
        .args(["list", "table", family, table])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridged_pods_are_enforced_by_nftables_and_nothing_else_is_disturbed() {
    let started = Instant::now();
    let mut topo = setup();
    let ips: Vec<String> = topo.pods.iter().map(CniPod::ip).collect();
    for (p, ip) in topo.pods.iter().zip(&ips) {
        serve(&p.netns, addr(ip), topo.stop.clone());
    }
    serve(&topo.routed_ns, addr(ROUTED), topo.stop.clone());
    let node: SocketAddr = format!("{GATEWAY}:{NODE_PORT}").parse().unwrap();
    serve_on_node(node, topo.stop.clone());

    // Every source, every destination (name, where from, where to).
    let mut ends: Vec<(String, From, SocketAddr)> = topo
        .pods
        .iter()
        .zip(&ips)
        .map(|(p, ip)| (p.name.clone(), From::Pod(p.netns.clone()), addr(ip)))
        .collect();
    ends.push(("d".into(), From::Pod(topo.routed_ns.clone()), addr(ROUTED)));
    ends.push(("node".into(), From::Node, node));
    let pairs: Vec<(String, From, SocketAddr)> = ends
        .iter()
        .flat_map(|(n1, f, _)| {
            ends.iter()
                .filter(move |(n2, _, _)| n2 != n1)
                .map(move |(n2, _, to)| (format!("{n1}->{n2}"), f.clone(), *to))
        })
        .collect();
    for (what, from, to) in &pairs {
        expect(from, *to, true, &format!("{what} before the agent")).await;
    }

    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    let mut pods: Vec<_> = topo
        .pods
        .iter()
        .zip(&ips)
        .map(|(p, ip)| pod("k", &p.name, "node-a", Some(ip), &[("app", &p.name)]))
        .collect();
    pods.push(pod("k", "d", "node-a", Some(ROUTED), &[("app", "d")]));
    create_pods(&client, pods, 4).await;
    let kubeconfig = topo.work_dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).expect("write kubeconfig");
    let log = topo.work_dir.join("agent.log");
    let metrics = free_port();
    topo.agent = Some(spawn_agent_run_with(
        &["--dataplane", "nftables", "--nft-table", &topo.table],
        &topo.work_dir.join("pins"),
        None,
        &kubeconfig,
        "*",
        metrics,
        &log,
    ));
    let log_text = || std::fs::read_to_string(&log).unwrap_or_default();
    let start = Instant::now();
    while !matches!(http_get(metrics, "/readyz"), Some((200, _))) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "agent not ready: {}",
            log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Every pod is dispatched on its own interface (the bridge ports and
    // d's veth), never on the bridge.
    // (`nft list` names the interfaces of an iface_index map.)
    let mut ports: Vec<String> = topo.pods.iter().map(CniPod::host_veth).collect();
    ports.push(topo.routed_veth.clone());
    let bridge = format!("\"{}\" : jump", topo.bridge);
    let start = Instant::now();
    loop {
        let inet = list("inet", &topo.table);
        let bridge_table = list("bridge", &topo.table);
        let dispatched = ports.iter().all(|p| {
            inet.contains(&format!("\"{p}\" : jump ep_")) && bridge_table.contains(&format!("\"{p}\" : jump port_"))
        });
        assert!(!inet.contains(&bridge), "an endpoint on the bridge itself:\n{inet}");
        if dispatched {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "ports {ports:?} not all dispatched:\n{inet}\n{bridge_table}\n{}",
            log_text()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // 1. No policy: nothing is disturbed.
    for (what, from, to) in &pairs {
        expect(from, *to, true, &format!("{what}, agent running, no policy")).await;
    }

    // 2. b's ingress allows only a.
    let (a, b, c) = (&topo.pods[0], &topo.pods[1], &topo.pods[2]);
    let d = From::Pod(topo.routed_ns.clone());
    let (pa, pb, pc) = (
        From::Pod(a.netns.clone()),
        From::Pod(b.netns.clone()),
        From::Pod(c.netns.clone()),
    );
    let (ta, tb, tc, td) = (addr(&ips[0]), addr(&ips[1]), addr(&ips[2]), addr(ROUTED));
    create_policy(&client, "k", deny_b()).await.unwrap();
    create_policy(&client, "k", allow_a()).await.unwrap();
    expect(&pc, tb, false, "c->b denied by b's ingress policy (bridged)").await;
    expect(
        &d,
        tb,
        false,
        "d->b denied by b's ingress policy (routed to a bridged pod)",
    )
    .await;
    expect(&pa, tb, true, "a->b allowed").await;
    expect(&From::Node, tb, true, "node->b allowed (host)").await;
    for (from, to, what) in [
        (&pc, ta, "c->a (a is not isolated)"),
        (&pb, ta, "b->a (b's egress is not isolated)"),
        (&pb, td, "b->d"),
        (&pb, node, "b->node"),
        (&d, tc, "d->c"),
    ] {
        expect(from, to, true, what).await;
    }
    for _ in 0..5 {
        assert!(!probe_now(&pc, tb), "c->b stays denied");
        assert!(!probe_now(&d, tb), "d->b stays denied");
        assert!(probe_now(&pa, tb), "a->b stays allowed");
    }

    // 3. c's egress allows only a on 8080.
    create_policy(
        &client,
        "k",
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "c-egress", "namespace": "k"},
            "spec": {"podSelector": {"matchLabels": {"app": "c"}}, "policyTypes": ["Egress"],
                     "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": 8080}]}]}
        }),
    )
    .await
    .unwrap();
    expect(&pc, td, false, "c->d denied by c's egress (routed from a bridged pod)").await;
    expect(&pc, node, false, "c->node denied by c's egress").await;
    expect(&pc, ta, true, "c->a allowed by c's egress (bridged)").await;
    expect(&d, tc, true, "d->c: c's replies are tracked").await;
    expect(&pa, tc, true, "a->c: c's replies are tracked").await;
    expect(&From::Node, tc, true, "node->c: c's replies are tracked").await;
    // The decisions were taken by the nft table: its drop counters moved.
    let inet = list("inet", &topo.table);
    assert!(
        !inet.contains("counter in_policy_denied {\n\t\tpackets 0 ")
            && !inet.contains("counter out_policy_denied {\n\t\tpackets 0 "),
        "no policy drop counted:\n{inet}"
    );
    srv.shutdown().await;
    drop(topo);
    eprintln!("bridged nft test took {:?}", started.elapsed());
}
