//! Issue 12 §2, "restarts keep every number's meaning", on real kernel
//! maps: a first agent (the real syncer, compiler and eBPF dataplane on two
//! routed veth pods) numbers identities in history order; while it is
//! down, the cluster churns (the pod that had the first identity is
//! deleted, the local client pod is recreated under another name and other
//! labels on the same address, a new allowed pod appears). The restarted
//! agent would number in snapshot order and hand the client's address the
//! number the deleted allowed pod had; its first sync writes the ipcache
//! before it sweeps the old policy keys.
//!
//! Checked: during the restart and first sync, a probe thread in the
//! client's namespace opens connections to ports of the server that
//! neither the old nor the new state allows the client (each to a new port,
//! so no cached decision answers), and none gets through; a control port
//! allowed to everyone does. And map level: every pod identity in the
//! kernel after the first sync that was there before stands for exactly
//! the same addresses.
//!
//! Names carry the process id (netns `npmrn<pid>a|b`, veths `ngn<pid>a|b`,
//! pin dir `/sys/fs/bpf/npmrn<pid>`); leftovers of crashed runs go first.

use std::collections::{BTreeMap, BTreeSet};
use std::io::ErrorKind;
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::netns::*;
use crate::common::*;
use npm_agent::k8s::{direct_read, Cache};
use npm_agent::node::{InterfacePattern, InterfaceResolver};
use npm_agent::reconcile::Syncer;
use npm_agent::telemetry::Metrics;
use npm_dataplane::ebpf::{EbpfDataplane, EbpfDump, EbpfOptions};

const PREFIX: &str = "npmrn";
const SUBNET: &str = "10.228";
/// Remote pods sharing one identity, at addresses above the client's, so
/// the ipcache writes after the client's take a while (the window).
const GHOSTS: usize = 3000;
/// Ports of the server only `role=friend` may reach.
const FRIEND_PORTS: (u16, u16) = (20000, 29999);
/// A port every pod may reach (the probes' control).
const OPEN_PORT: u16 = 8000;

fn server_ip() -> IpAddr {
    format!("{SUBNET}.2.2").parse().unwrap()
}

fn client_ip() -> String {
    format!("{SUBNET}.1.2")
}

fn clear_leftovers() {
    clear_stale_netns(PREFIX);
    clear_stale_links("ngn");
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
}

fn open(topo: &RoutedPods<2>) -> EbpfDataplane {
    EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: topo.pin_dir.clone(),
        bench_no_ct_create: false,
        attach: npm_dataplane::ebpf::AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane (run `cargo xtask build-ebpf` first)")
}

fn syncer(topo: &RoutedPods<2>, cache: &Arc<Cache>, client: &kube::Client) -> Syncer<EbpfDataplane> {
    let pattern = InterfacePattern::new(&format!("ngn{}*", std::process::id())).unwrap();
    test_syncer(cache, open(topo), client)
        .resolver(Box::new(InterfaceResolver::new(Some(pattern))))
        .build()
}

async fn feed(client: &kube::Client, cache: &Arc<Cache>) {
    let state = direct_read(client, 500).await.unwrap();
    feed_cache(cache, &state, |_| true);
}

/// The server `b` accepts from `role=friend` on the friend ports and from
/// everyone on the open port.
fn server_policy() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "friends-only", "namespace": "k"},
        "spec": {"podSelector": {"matchLabels": {"app": "b"}}, "policyTypes": ["Ingress"],
                 "ingress": [
                     {"from": [{"podSelector": {"matchLabels": {"role": "friend"}}}],
                      "ports": [{"protocol": "TCP", "port": FRIEND_PORTS.0, "endPort": FRIEND_PORTS.1}]},
                     {"ports": [{"protocol": "TCP", "port": OPEN_PORT}]}
                 ]}
    })
}

/// Pod identity -> the addresses carrying it, in a dump.
fn identities(d: &EbpfDump) -> BTreeMap<u32, BTreeSet<IpAddr>> {
    let mut out: BTreeMap<u32, BTreeSet<IpAddr>> = BTreeMap::new();
    for e in &d.ipcache {
        if (npm_common::IDENTITY_FIRST_POD..npm_common::IDENTITY_FIRST_CIDR).contains(&e.identity) {
            out.entry(e.identity).or_default().insert(e.addr);
        }
    }
    out
}

/// Whether a TCP connect to `addr` got an answer (connected or refused:
/// the SYN passed the policy) within `timeout`.
fn reached(addr: SocketAddr, timeout: Duration) -> bool {
    match TcpStream::connect_timeout(&addr, timeout) {
        Ok(_) => true,
        Err(e) => e.kind() == ErrorKind::ConnectionRefused,
    }
}

/// Probes from the client's namespace until `stop`: each probe to a new
/// friend port (never answered from a cached decision), every tenth to the
/// open port. Returns (friend ports reached, probes, open-port probes
/// reached).
fn start_probes(ns: &str, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(Vec<u16>, usize, usize)> {
    in_netns(ns, move || {
        let (mut leaked, mut n, mut open_ok) = (Vec::new(), 0usize, 0usize);
        let mut port = FRIEND_PORTS.0;
        while !stop.load(Ordering::SeqCst) {
            n += 1;
            if n % 10 == 0 {
                open_ok += reached(SocketAddr::new(server_ip(), OPEN_PORT), Duration::from_millis(50)) as usize;
                continue;
            }
            if reached(SocketAddr::new(server_ip(), port), Duration::from_millis(2)) {
                leaked.push(port);
            }
            port = if port >= FRIEND_PORTS.1 {
                FRIEND_PORTS.0
            } else {
                port + 1
            };
        }
        (leaked, n, open_ok)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_after_churn_never_gives_an_address_another_pods_number() {
    clear_leftovers();
    let topo = RoutedPods::new(PREFIX, "ngn", ["a", "b"], SUBNET);
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    // History: the allowed remote pod first (the first identity), then the
    // rest.
    create_pods(
        &client,
        vec![pod("k", "zfriend", "node-b", Some("10.99.0.1"), &[("role", "friend")])],
        1,
    )
    .await;
    create_policy(&client, "k", server_policy()).await.unwrap();
    let cache = Cache::new(Metrics::new().unwrap());
    let mut first = syncer(&topo, &cache, &client);
    feed(&client, &cache).await;
    first.sync_once().await.unwrap();
    let mut pods = vec![
        pod("k", "a", "node-a", Some(&client_ip()), &[("role", "stranger")]),
        pod("k", "b", "node-a", Some(&server_ip().to_string()), &[("app", "b")]),
    ];
    pods.extend((0..GHOSTS).map(|i| {
        let ip = format!("10.240.{}.{}", i / 250, i % 250 + 1);
        pod("k", &format!("g{i:05}"), "node-b", Some(&ip), &[("role", "ghost")])
    }));
    create_pods(&client, pods, 16).await;
    feed(&client, &cache).await;
    first.sync_once().await.unwrap();
    assert_eq!(first.programmed().unwrap().1.len(), 2, "both veths attached");
    for _ in 0..3 {
        assert!(
            !reached(SocketAddr::new(server_ip(), FRIEND_PORTS.0), Duration::from_millis(200)),
            "the stranger is denied the friend ports"
        );
    }
    let before = first.dataplane().dump().unwrap();
    drop(first);

    // While the agent is down: the friend is deleted, the client pod is
    // recreated as `a0` (sorting first, other labels) on the same address,
    // a new friend appears.
    delete_pods(
        &client,
        vec![("k".into(), "zfriend".into()), ("k".into(), "a".into())],
        2,
    )
    .await;
    create_pods(
        &client,
        vec![
            pod("k", "a0", "node-a", Some(&client_ip()), &[("role", "stranger2")]),
            pod("k", "zfriend2", "node-b", Some("10.99.0.2"), &[("role", "friend")]),
        ],
        2,
    )
    .await;

    // The restart, probed throughout.
    let stop = Arc::new(AtomicBool::new(false));
    let probes = start_probes(&topo.pods[0], stop.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let started = Instant::now();
    let cache = Cache::new(Metrics::new().unwrap());
    let mut restarted = syncer(&topo, &cache, &client);
    feed(&client, &cache).await;
    let outcome = restarted.sync_once().await.unwrap();
    assert!(outcome.full && !outcome.guarded, "{outcome:?}");
    let sync_time = started.elapsed();
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::SeqCst);
    let (leaked, n, open_ok) = probes.join().unwrap();
    let after = restarted.dataplane().dump().unwrap();
    eprintln!(
        "restart and first sync took {sync_time:?}; {n} probes, {} leaked, open port reached {open_ok} times",
        leaked.len()
    );

    // Map level: no number changed meaning.
    let (old, new) = (identities(&before), identities(&after));
    let changed: Vec<_> = new
        .iter()
        .filter(|(id, addrs)| old.get(id).is_some_and(|o| o != *addrs))
        .map(|(id, addrs)| {
            (
                id,
                old[id].iter().take(2).collect::<Vec<_>>(),
                addrs.iter().take(2).collect::<Vec<_>>(),
            )
        })
        .collect();
    assert!(changed.is_empty(), "identities whose addresses changed: {changed:?}");
    assert!(open_ok > 0, "the control probes reach the open port");
    assert!(
        leaked.is_empty(),
        "the stranger reached friend ports during the restart: {leaked:?}"
    );
    for _ in 0..3 {
        assert!(!reached(
            SocketAddr::new(server_ip(), FRIEND_PORTS.1),
            Duration::from_millis(200)
        ));
    }
    drop(restarted);
    srv.shutdown().await;
    drop(topo);
}
