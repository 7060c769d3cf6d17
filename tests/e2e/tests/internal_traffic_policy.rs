//! `internalTrafficPolicy: Local` through the real agents and the
//! kube-proxy emulation, on both dataplanes, two nodes of the routed
//! fabric: a ClusterIP Service (no selector) with a hand-written
//! EndpointSlice of two backends, `x/a` on node 1 and `y/a` on node 2.
//! kube-proxy leads each node's pods to that node's backend only, so a
//! client on node 1 always meets `x/a`'s ingress policy and one on node 2
//! `y/a`'s: with one backend denying every ingress, every connection of
//! the clients on its node fails and every connection of the others
//! succeeds (with both backends chosen at random, about half of each
//! would).
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`); the
//! eBPF variant also the BPF object (`NPM_EBPF_OBJECT`).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use npm_e2e::nodeport_fixture::{ingress_from_ip_blocks, source_seen, PeerEcho};
use npm_e2e::runner::{CniMode, Engine, KubeProxyMode, LiveRunner, Options};
use serde_json::json;

/// The backends' echo port (service port and targetPort).
const PORT: u16 = 8080;
/// Connections per client and observation.
const TRIES: usize = 12;

fn agent_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-agent");
    assert!(p.exists(), "{} missing: cargo build --bin npm-agent", p.display());
    p
}

/// How many of `TRIES` connections from `netns` to `dst` were established.
fn connected(netns: &str, dst: SocketAddr) -> usize {
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..TRIES)
            .map(|_| s.spawn(move || source_seen(netns, dst, Duration::from_millis(800)).is_some()))
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(false))
            .filter(|ok| *ok)
            .count()
    })
}

fn internal_local(engine: Engine, kube_proxy: KubeProxyMode) {
    let opts = Options {
        engine,
        agent_bin: agent_bin(),
        nodes: 2,
        kube_proxy,
        cni: CniMode::Veth,
        npm_cni_bin: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-cni"),
        deadline: Duration::from_secs(15),
        ..Options::default()
    };
    let r = LiveRunner::start(opts).expect("start two nodes with agents and kube-proxy");
    let xa = r.cluster().pod("x", "a").expect("x/a");
    let ya = r.cluster().pod("y", "a").expect("y/a");
    assert_eq!(xa.node.as_deref(), Some("node-1"));
    assert_eq!(ya.node.as_deref(), Some("node-2"));
    let _echo_x = PeerEcho::start(&xa.netns, PORT).expect("echo in x/a");
    let _echo_y = PeerEcho::start(&ya.netns, PORT).expect("echo in y/a");
    // A client on each node that no policy here selects.
    let client_on = |node: &str| {
        r.cluster()
            .pods()
            .filter(|p| p.node.as_deref() == Some(node) && p.name != "a")
            .min_by_key(|p| (p.namespace.clone(), p.name.clone()))
            .map(|p| p.netns.clone())
            .unwrap_or_else(|| panic!("a client pod on {node}"))
    };
    let (c1, c2) = (client_on("node-1"), client_on("node-2"));

    let api = r.api();
    let svc = api
        .create(
            "/api/v1/namespaces/x/services",
            &json!({
                "apiVersion": "v1", "kind": "Service",
                "metadata": {"namespace": "x", "name": "itp"},
                "spec": {"type": "ClusterIP", "internalTrafficPolicy": "Local",
                         "ports": [{"name": "echo", "port": PORT, "targetPort": PORT, "protocol": "TCP"}]},
            }),
        )
        .expect("create the Service");
    assert_eq!(svc["spec"]["internalTrafficPolicy"], "Local", "{svc}");
    let cluster_ip: IpAddr = svc["spec"]["clusterIP"]
        .as_str()
        .and_then(|s| s.parse().ok())
        .expect("a ClusterIP");
    api.create(
        "/apis/discovery.k8s.io/v1/namespaces/x/endpointslices",
        &json!({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"namespace": "x", "name": "itp-1",
                         "labels": {"kubernetes.io/service-name": "itp",
                                    "endpointslice.kubernetes.io/managed-by": "npm-e2e-test"}},
            "addressType": "IPv4",
            "ports": [{"name": "echo", "port": PORT, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [xa.ipv4.to_string()], "nodeName": "node-1", "conditions": {"ready": true}},
                {"addresses": [ya.ipv4.to_string()], "nodeName": "node-2", "conditions": {"ready": true}},
            ],
        }),
    )
    .expect("create the EndpointSlice");
    let dst = SocketAddr::new(cluster_ip, PORT);

    // (policy denying every ingress of one backend, connections wanted from
    // the node-1 client and the node-2 client)
    let phases = [
        ("no policy", None, (TRIES, TRIES)),
        (
            "y/a denies every ingress",
            Some(ingress_from_ip_blocks("y", "itp", "a", &[], PORT)),
            (TRIES, 0),
        ),
        (
            "x/a denies every ingress, y/a's policy removed",
            Some(ingress_from_ip_blocks("x", "itp", "a", &[], PORT)),
            (0, TRIES),
        ),
    ];
    let mut report = Vec::new();
    let mut failed = false;
    for (i, (what, policy, want)) in phases.iter().enumerate() {
        if i == 2 {
            api.delete(&npm_e2e::api::policy_path("y", "itp"))
                .expect("delete y/itp");
        }
        if let Some(p) = policy {
            api.apply_policy(p, false).expect("apply policy");
        }
        let end = Instant::now() + Duration::from_secs(20);
        let mut confirmed = false;
        let got = loop {
            let got = (connected(&c1, dst), connected(&c2, dst));
            if got == *want {
                if confirmed {
                    break got;
                }
                confirmed = true;
                std::thread::sleep(Duration::from_millis(500));
                continue;
            }
            confirmed = false;
            if Instant::now() >= end {
                break got;
            }
            std::thread::sleep(Duration::from_millis(300));
        };
        let ok = got == *want;
        failed |= !ok;
        report.push(format!(
            "{} {engine:?}/{kube_proxy:?} phase {i}: {what}: connected (node-1 client, node-2 client) {got:?} of {TRIES}, want {want:?}",
            if ok { "ok  " } else { "FAIL" }
        ));
    }
    let report = report.join("\n");
    eprintln!("{report}");
    drop(_echo_x);
    drop(_echo_y);
    r.shutdown().expect("shutdown");
    assert!(npm_e2e::cluster::own_netns().is_empty(), "netns left behind");
    assert!(!failed, "internalTrafficPolicy: Local verdicts:\n{report}");
}

/// The nodes' addresses are shared: one cluster at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn internal_local_ebpf_iptables_kube_proxy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    internal_local(Engine::Ebpf, KubeProxyMode::Iptables);
}

#[test]
fn internal_local_nftables_nftables_kube_proxy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    internal_local(Engine::Nftables, KubeProxyMode::Nftables);
}
