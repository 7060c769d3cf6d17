//! NodePort from another node to an ingress-isolated pod, with and without
//! source NAT, through the real agent binary (one per node) and the
//! kube-proxy emulation, on three nodes of the routed fabric:
//!
//! - the client is node 3 (its own netns, address `10.99.0.3`): another
//!   node's address, which npm treats as world (selected only by ipBlock);
//! - it connects to node 1's address (`10.99.0.1`) on the NodePort of
//!   - `x/np-local` (`externalTrafficPolicy: Local`, backend `x/a` on node
//!     1): no source NAT, the backend sees the client;
//!   - `x/np-cluster` (`Cluster`, backend `x/a` on node 1): masqueraded, the
//!     backend sees node 1's own address, the local node's host identity:
//!     admitted as kubelet probes are on eBPF (the documented limit), decided
//!     on the client (conntrack's original source) on nftables;
//!   - `y/np-cluster` (`Cluster`, backend `y/a` on node 2): masqueraded, the
//!     backend sees node 1's address, another node's: allowed only by an
//!     ipBlock covering it, never by one covering the client;
//! - an in-cluster client, another pod on node 1, connects to
//!   `x/np-cluster` too: masqueraded alike, admitted as the host on eBPF,
//!   decided on the pod on nftables (README, "NodePort and source NAT").
//!
//! Each backend runs an echo that answers with the source address its
//! `accept` saw, so every expectation is on what the backend really saw
//! (or on the connection not being established at all). Phases: no policy;
//! policies allowing the address each backend sees; policies allowing
//! everything but it.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`); the
//! eBPF variants also the BPF object (`NPM_EBPF_OBJECT`, as `cargo xtask
//! test` sets it).

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use npm_e2e::nodeport_fixture::{create_nodeport, ingress_from_ip_blocks, nodeport_service, source_seen, PeerEcho};
use npm_e2e::runner::{CniMode, Engine, KubeProxyMode, LiveRunner, Options};

/// The echo's port (service port, targetPort): not one the pods' own
/// servers use.
const ECHO_PORT: u16 = 8080;
/// The label the live runner puts on every pod in Service mode.
const SERVICE_LABEL: &str = "npm-e2e/pod";

fn agent_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-agent");
    assert!(p.exists(), "{} missing: cargo build --bin npm-agent", p.display());
    p
}

/// One NodePort path: a client (its netns), node 1's address and a
/// NodePort, and what it leads to.
struct Path {
    label: &'static str,
    from: String,
    dst: SocketAddr,
}

/// What a path gives: the source its backend saw, `None` when the
/// connection was not established.
type Seen = Vec<Option<IpAddr>>;

/// What a path should give.
#[derive(Clone, Debug)]
enum Want {
    /// Connected, the backend saw this source.
    From(IpAddr),
    /// Connected, the backend saw one of the receiving node's own
    /// addresses (masquerade picks the output device's address: the node
    /// address with hand-made veths, the ptp host veth's gateway address
    /// with ptp), which the agent counts as the host.
    FromNode(Vec<IpAddr>),
    /// Not connected.
    Denied,
}

impl Want {
    fn matches(&self, got: &Option<IpAddr>) -> bool {
        match (self, got) {
            (Want::From(w), Some(g)) => w == g,
            (Want::FromNode(addrs), Some(g)) => addrs.contains(g),
            (Want::Denied, None) => true,
            _ => false,
        }
    }
}

impl std::fmt::Display for Want {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Want::From(ip) => write!(f, "backend saw {ip}"),
            Want::FromNode(_) => f.write_str("backend saw an address of node 1 (host)"),
            Want::Denied => f.write_str("not connected"),
        }
    }
}

/// Node `netns`'s own IPv4 addresses (`ip -o -4 addr show`).
fn local_addresses(netns: &str) -> Vec<IpAddr> {
    let out = std::process::Command::new("ip")
        .args(["-n", netns, "-o", "-4", "addr", "show"])
        .output()
        .expect("ip addr show");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace();
            w.find(|x| *x == "inet")?;
            w.next()?.split('/').next()?.parse().ok()
        })
        .collect()
}

/// Observes every path until all match `want` (and then once more, so a
/// state that matches while the agents still converge is not accepted), or
/// 20 s passed. Returns the last observation.
fn observe(paths: &[Path], want: &[Want]) -> Seen {
    let end = Instant::now() + Duration::from_secs(20);
    let once = || -> Seen {
        std::thread::scope(|s| {
            let hs: Vec<_> = paths
                .iter()
                .map(|p| s.spawn(move || source_seen(&p.from, p.dst, Duration::from_millis(800))))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(None)).collect()
        })
    };
    let mut confirmed = false;
    loop {
        let got = once();
        if got.iter().zip(want).all(|(g, w)| w.matches(g)) {
            if confirmed {
                return got;
            }
            confirmed = true;
            std::thread::sleep(Duration::from_millis(500));
            continue;
        }
        confirmed = false;
        if Instant::now() >= end {
            return got;
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

fn show(v: &Option<IpAddr>) -> String {
    v.map_or_else(|| "not connected".to_string(), |ip| format!("backend saw {ip}"))
}

/// The packets of the named counter `name` of node `netns`'s agent table
/// (nftables dataplane; the live runner names node k's table
/// `npmconf<pid>n<k>`), for the report.
fn nft_counter(netns: &str, table: &str, name: &str) -> Option<u64> {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", netns, "nft", "list", "counter", "inet", table, name])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut words = text.split_whitespace();
    words.find(|w| *w == "packets")?;
    words.next()?.parse().ok()
}

fn nodeport(engine: Engine, kube_proxy: KubeProxyMode, cni: CniMode) {
    let opts = Options {
        engine,
        agent_bin: agent_bin(),
        nodes: 3,
        kube_proxy,
        cni,
        npm_cni_bin: PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-cni"),
        deadline: Duration::from_secs(15),
        ..Options::default()
    };
    let r = LiveRunner::start(opts).expect("start three nodes with agents and kube-proxy");
    let nodes = r.cluster().nodes().expect("a multi-node cluster");
    let node1 = IpAddr::V4(nodes.node(1).expect("node 1").ipv4);
    let client_node = nodes.node(3).expect("node 3");
    let client = client_node.netns.clone();
    let client_ip = IpAddr::V4(client_node.ipv4);
    let xa = r.cluster().pod("x", "a").expect("x/a");
    let ya = r.cluster().pod("y", "a").expect("y/a");
    assert_eq!(xa.node.as_deref(), Some("node-1"), "x/a is on the receiving node");
    assert_eq!(ya.node.as_deref(), Some("node-2"), "y/a is on another node");
    let _echo_x = PeerEcho::start(&xa.netns, ECHO_PORT).expect("echo in x/a");
    let _echo_y = PeerEcho::start(&ya.netns, ECHO_PORT).expect("echo in y/a");

    let api = r.api();
    let port = |ns: &str, name: &str, local: bool| {
        create_nodeport(api, &nodeport_service(ns, name, SERVICE_LABEL, "a", ECHO_PORT, local))
            .unwrap_or_else(|e| panic!("{e}"))
    };
    // The in-cluster client: a pod on node 1, the backend's node, that no
    // policy here selects (not `a` of x or y).
    let pod_client = r
        .cluster()
        .pods()
        .filter(|p| p.node.as_deref() == Some("node-1"))
        .filter(|p| !(p.name == "a" && (p.namespace == "x" || p.namespace == "y")))
        .min_by_key(|p| (p.namespace.clone(), p.name.clone()))
        .expect("a pod on node 1 besides x/a");
    let pod_name = pod_client.name.clone();
    let np_cluster_x = SocketAddr::new(node1, port("x", "np-cluster", false));
    let paths = [
        Path {
            label: "Local, backend x/a on node 1 (no SNAT)",
            from: client.clone(),
            dst: SocketAddr::new(node1, port("x", "np-local", true)),
        },
        Path {
            label: "Cluster, backend x/a on node 1 (SNAT to node 1)",
            from: client.clone(),
            dst: np_cluster_x,
        },
        Path {
            label: "Cluster, backend y/a on node 2 (SNAT to node 1)",
            from: client.clone(),
            dst: SocketAddr::new(node1, port("y", "np-cluster", false)),
        },
        Path {
            label: "a pod on node 1 -> Cluster, backend x/a on node 1 (SNAT to node 1)",
            from: pod_client.netns.clone(),
            dst: np_cluster_x,
        },
    ];
    let c = client_ip.to_string();
    let n1 = node1.to_string();
    let client32 = format!("{c}/32");
    let node1_32 = format!("{n1}/32");
    let host = Want::FromNode(local_addresses(&nodes.node(1).expect("node 1").netns));
    // A connection masqueraded on node 1 to its local backend: admitted as
    // the host on eBPF (no conntrack lookup there: README, "NodePort and
    // source NAT"); on nftables decided on its original source, so
    // `allowed` says whether the backend's policy admits that source.
    let masqueraded = |allowed: bool| match (engine, allowed) {
        (Engine::Nftables, false) => Want::Denied,
        _ => host.clone(),
    };
    // x/a's ingress from pods labelled `pod: <the pod client's name>` in
    // every namespace.
    let from_pod_client = serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": "x", "name": "np"},
        "spec": {
            "podSelector": {"matchLabels": {"pod": "a"}},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"pod": pod_name}}}],
                "ports": [{"protocol": "TCP", "port": ECHO_PORT}],
            }],
        },
    });
    let phases: Vec<(&str, Vec<serde_json::Value>, Vec<Want>)> = vec![
        (
            "no policy: the address each backend sees",
            vec![],
            vec![Want::From(client_ip), host.clone(), Want::From(node1), host.clone()],
        ),
        (
            "x/a allows ipBlock client/32, y/a allows ipBlock node-1/32",
            vec![
                ingress_from_ip_blocks("x", "np", "a", &[&client32], ECHO_PORT),
                ingress_from_ip_blocks("y", "np", "a", &[&node1_32], ECHO_PORT),
            ],
            // Cluster to node 1's own pod: the client began the connection
            // (nftables), or the host (eBPF); the pod client is not the
            // client's /32.
            vec![
                Want::From(client_ip),
                masqueraded(true),
                Want::From(node1),
                masqueraded(false),
            ],
        ),
        (
            "x/a allows only ipBlock 192.0.2.0/24, y/a allows ipBlock client/32 (hidden by SNAT)",
            vec![
                ingress_from_ip_blocks("x", "np", "a", &["192.0.2.0/24"], ECHO_PORT),
                ingress_from_ip_blocks("y", "np", "a", &[&client32], ECHO_PORT),
            ],
            // Local: the client is not allowed. Cluster to node 1's own
            // pod: neither the client nor the pod is covered (the host on
            // eBPF, admitted). Cluster to node 2: node 1's address is not
            // covered.
            vec![Want::Denied, masqueraded(false), Want::Denied, masqueraded(false)],
        ),
        (
            "x/a allows only ipBlock node-1/32, y/a ingress-isolated with no rule (ingress: [])",
            vec![
                ingress_from_ip_blocks("x", "np", "a", &[&node1_32], ECHO_PORT),
                ingress_from_ip_blocks("y", "np", "a", &[], ECHO_PORT),
            ],
            // node-1/32 covers the address the masquerade gave, not the
            // source that began the connection.
            vec![Want::Denied, masqueraded(false), Want::Denied, masqueraded(false)],
        ),
        (
            "x/a allows the pod client by pod selector only, y/a ingress-isolated with no rule",
            vec![from_pod_client],
            vec![Want::Denied, masqueraded(false), Want::Denied, masqueraded(true)],
        ),
    ];

    let node1_netns = nodes.node(1).expect("node 1").netns.clone();
    let node1_table = format!("npmconf{}n1", std::process::id());
    let counters = || ["in_host", "in_policy_denied"].map(|n| nft_counter(&node1_netns, &node1_table, n).unwrap_or(0));
    let mut report = Vec::new();
    let mut failed = false;
    for (i, (what, policies, want)) in phases.iter().enumerate() {
        for p in policies {
            api.apply_policy(p, i > 1).expect("apply policy");
        }
        let t0 = Instant::now();
        let before = counters();
        let got = observe(&paths, want);
        report.push(format!(
            "{engine:?}/{kube_proxy:?}/{cni:?} phase {i}: {what} ({:?})",
            t0.elapsed()
        ));
        if engine == Engine::Nftables {
            let after = counters();
            report.push(format!(
                "  node-1 nft counters during the phase: in_host +{}, in_policy_denied +{}",
                after[0].saturating_sub(before[0]),
                after[1].saturating_sub(before[1])
            ));
        }
        for ((p, g), w) in paths.iter().zip(&got).zip(want) {
            let ok = w.matches(g);
            let mark = if ok { "ok  " } else { "FAIL" };
            failed |= !ok;
            report.push(format!(
                "  {mark} {} -> {}: {}, expected {}",
                p.label,
                p.dst,
                show(g),
                w
            ));
        }
    }
    let report = report.join("\n");
    eprintln!("{report}");
    drop(_echo_x);
    drop(_echo_y);
    r.shutdown().expect("shutdown");
    assert!(npm_e2e::cluster::own_netns().is_empty(), "netns left behind");
    assert!(!failed, "NodePort verdicts differ from the documented model:\n{report}");
}

/// The nodes' addresses are shared: one cluster at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn nodeport_ebpf_nftables_kube_proxy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    nodeport(Engine::Ebpf, KubeProxyMode::Nftables, CniMode::Veth);
}

#[test]
fn nodeport_ebpf_iptables_kube_proxy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    nodeport(Engine::Ebpf, KubeProxyMode::Iptables, CniMode::Veth);
}

#[test]
fn nodeport_nftables_iptables_kube_proxy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    nodeport(Engine::Nftables, KubeProxyMode::Iptables, CniMode::Veth);
}

#[test]
fn nodeport_nftables_nftables_kube_proxy() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    nodeport(Engine::Nftables, KubeProxyMode::Nftables, CniMode::Veth);
}

#[test]
fn nodeport_ebpf_nftables_kube_proxy_ptp() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    nodeport(Engine::Ebpf, KubeProxyMode::Nftables, CniMode::Ptp);
}

#[test]
fn nodeport_nftables_iptables_kube_proxy_ptp() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    nodeport(Engine::Nftables, KubeProxyMode::Iptables, CniMode::Ptp);
}
