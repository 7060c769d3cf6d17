//! Cross-node address reuse (incident 1 across nodes), on three nodes with
//! one real agent each: `y/b` on node 2, labelled `trusted`, is the only
//! peer `x/a` (node 1) may talk to, both ways. `y/b` is deleted and its
//! address is at once given to `y/q` on node 3, with other labels. Once
//! node 1's agent has seen the change (a later write on the same Pod
//! watch, `x/c` becoming trusted, is enforced on node 1), `y/q` is never
//! treated as `y/b`: it never reaches `x/a` and `x/a` never reaches it,
//! while it is reachable from node 1 and from node 2 (the route moved with
//! the address), and the trusted `z/c` (node 3) still reaches `x/a`.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`); the
//! eBPF variant also the BPF object (`NPM_EBPF_OBJECT`, as `cargo xtask
//! test` sets it).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use npm_e2e::probe::{probe_all, Probe, ProbeConfig, Proto};
use npm_e2e::runner::{parse_text, Engine, LiveRunner, Options};

const SETUP: &str = r#"
id: ip-reuse-setup
steps:
  - actions:
      - add_pod_labels: {pod: y/b, labels: {trusted: "yes"}}
      - add_pod_labels: {pod: z/c, labels: {trusted: "yes"}}
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: x, name: only-trusted}
          spec:
            podSelector: {matchLabels: {pod: a}}
            policyTypes: [Ingress, Egress]
            ingress: [{from: [{namespaceSelector: {}, podSelector: {matchLabels: {trusted: "yes"}}}]}]
            egress: [{to: [{namespaceSelector: {}, podSelector: {matchLabels: {trusted: "yes"}}}]}]
    probes:
      - port: 80
        protocol: TCP
        pods: [x/a, x/b, x/c, y/a, y/b, z/c]
        matrix:
          x/a: '000011'
          x/b: '011111'
          x/c: '011111'
          y/a: '011111'
          y/b: '111111'
          z/c: '111111'
"#;

const DELETE_YB: &str = r#"
id: ip-reuse-delete
steps:
  - actions:
      - delete_pod: {pod: y/b}
    probes: []
  - actions:
      - add_pod_labels: {pod: x/c, labels: {trusted: "yes"}}
    probes: []
"#;

fn agent_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-agent");
    assert!(p.exists(), "{} missing: cargo build --bin npm-agent", p.display());
    p
}

fn probe(r: &LiveRunner, from: &str, to: IpAddr, to_pod: &str) -> Probe {
    let (ns, name) = from.split_once('/').unwrap();
    Probe {
        src_netns: r.cluster().pod(ns, name).unwrap().netns.clone(),
        dst_pod: to_pod.to_string(),
        dst: SocketAddr::new(to, 80),
        proto: Proto::Tcp,
    }
}

/// The two tests share the node addresses and pod addresses: one at a time.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn reuse_across_nodes(engine: Engine) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let opts = Options {
        engine,
        agent_bin: agent_bin(),
        nodes: 3,
        deadline: Duration::from_secs(15),
        ..Options::default()
    };
    let mut r = LiveRunner::start(opts).expect("start three nodes");
    let setup = parse_text(SETUP).unwrap().remove(0);
    let (passed, report) = r.run_case(&setup);
    assert!(passed, "setup: {report}");
    let yb = r.cluster().pod("y", "b").unwrap();
    let (v4, v6): (Ipv4Addr, Ipv6Addr) = (yb.ipv4, yb.ipv6);
    assert_eq!(yb.node.as_deref(), Some("node-2"));
    let xa_ip = r.cluster().pod("x", "a").unwrap().ipv4;

    // Delete y/b and give its address to y/q on node 3 at once.
    let del = parse_text(DELETE_YB).unwrap().remove(0);
    let t0 = Instant::now();
    r.apply(&del.steps[0].actions[0]).expect("delete y/b");
    let labels: BTreeMap<String, String> = [("pod".to_string(), "q".to_string())].into();
    r.create_unmodelled_pod("y", "q", &labels, v4, v6, 3)
        .expect("y/q on node 3 at y/b's address");
    // The later write on the Pod watch.
    r.apply(&del.steps[1].actions[0]).expect("x/c trusted");
    let cfg = ProbeConfig {
        timeout: Duration::from_millis(500),
        threads: 8,
        sctp_log: r.cluster().sctp_log(),
    };
    let sentinel = [probe(&r, "x/a", r.cluster().pod("x", "c").unwrap().ipv4.into(), "x/c")];
    let seen = loop {
        if probe_all(&sentinel, &cfg)[0] {
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(15),
            "node 1 never enforced x/c as trusted"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    eprintln!("{engine:?}: node 1 saw the change {seen:?} after the delete");

    // From now on: never y/b's policies for y/q.
    let never = [
        probe(&r, "y/q", xa_ip.into(), "x/a"),
        probe(&r, "x/a", v4.into(), "y/q"),
        probe(&r, "y/q", r.cluster().pod("x", "a").unwrap().ipv6.into(), "x/a"),
        probe(&r, "x/a", v6.into(), "y/q"),
    ];
    let always = [
        probe(&r, "z/c", xa_ip.into(), "x/a"),
        probe(&r, "x/b", v4.into(), "y/q"),
        probe(&r, "y/a", v4.into(), "y/q"),
        probe(&r, "x/a", r.cluster().pod("x", "c").unwrap().ipv4.into(), "x/c"),
    ];
    let end = Instant::now() + Duration::from_secs(6);
    let mut rounds = 0;
    while Instant::now() < end {
        let got = probe_all(&never, &cfg);
        for (p, ok) in never.iter().zip(&got) {
            assert!(
                !ok,
                "round {rounds}: {} -> {} connected: y/q got y/b's policies",
                p.src_netns, p.dst
            );
        }
        let got = probe_all(&always, &cfg);
        for (p, ok) in always.iter().zip(&got) {
            assert!(ok, "round {rounds}: {} -> {} did not connect", p.src_netns, p.dst);
        }
        rounds += 1;
    }
    eprintln!("{engine:?}: {rounds} rounds, y/q never treated as y/b");
    r.delete_unmodelled_pod("y", "q").expect("delete y/q");
    r.shutdown().expect("shutdown");
    assert!(npm_e2e::cluster::own_netns().is_empty());
}

#[test]
fn ip_reuse_across_nodes_nftables() {
    reuse_across_nodes(Engine::Nftables);
}

#[test]
fn ip_reuse_across_nodes_ebpf() {
    reuse_across_nodes(Engine::Ebpf);
}
