//! Cross-node address reuse (incident 1 across nodes), on three nodes with
//! one real agent each: `y/b` on node 2, labelled `trusted`, is the only
//! peer `x/a` (node 1) may talk to, both ways. Its address is given to
//! `y/q` on node 3, with other labels, in the order that made incident 1:
//! the new pod first, while the API still holds `y/b` as Running (node 2
//! has not reported the deletion yet; the address is routed to node 3);
//! then `y/b` is deleted. Once node 1's agent has seen each change (a later
//! write on the same Pod watch, `x/c` then `x/b` becoming trusted, is
//! enforced on node 1), `y/q` is never treated as `y/b`: it never reaches
//! `x/a` and `x/a` never reaches it, while it is reachable from node 1 (and
//! from node 2 once `y/b` is gone), and the trusted `z/c` (node 3) still
//! reaches `x/a`. While both claim the address, the one ownership rule
//! (`npm_policy::ownership`: the live, then the newer pod owns it) gives it
//! to `y/q`: with "the first claimant keeps it" both tests fail.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

use npm_e2e::fixtures::agent_bin;
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

const LATER: &str = r#"
id: ip-reuse-later
steps:
  - actions:
      - add_pod_labels: {pod: x/c, labels: {trusted: "yes"}}
      - delete_pod: {pod: y/b}
      - add_pod_labels: {pod: x/b, labels: {trusted: "yes"}}
    probes: []
"#;

fn probe(r: &LiveRunner, from: &str, to: IpAddr, to_pod: &str) -> Probe {
    let (ns, name) = from.split_once('/').unwrap();
    Probe {
        src_netns: r.cluster().pod(ns, name).unwrap().netns.clone(),
        dst_pod: to_pod.to_string(),
        dst: SocketAddr::new(to, 80),
        proto: Proto::Tcp,
    }
}

/// Probes `sentinel` until it connects (15 s at most from `t0`).
fn wait_connects(sentinel: &[Probe], cfg: &ProbeConfig, t0: Instant, what: &str) -> Duration {
    loop {
        if probe_all(sentinel, cfg)[0] {
            return t0.elapsed();
        }
        assert!(t0.elapsed() < Duration::from_secs(15), "node 1 never enforced {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// For `span`: every probe of `never` fails and every one of `always`
/// connects, round after round; returns the rounds.
fn never_and_always(never: &[Probe], always: &[Probe], cfg: &ProbeConfig, span: Duration, phase: &str) -> usize {
    let end = Instant::now() + span;
    let mut rounds = 0;
    while Instant::now() < end {
        for (p, ok) in never.iter().zip(probe_all(never, cfg)) {
            assert!(
                !ok,
                "{phase}, round {rounds}: {} -> {} connected: y/q got y/b's policies",
                p.src_netns, p.dst
            );
        }
        for (p, ok) in always.iter().zip(probe_all(always, cfg)) {
            assert!(
                ok,
                "{phase}, round {rounds}: {} -> {} did not connect",
                p.src_netns, p.dst
            );
        }
        rounds += 1;
    }
    rounds
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

    let created = |r: &LiveRunner, ns: &str, name: &str| {
        let obj = r.pod_object(ns, name).expect("pod object");
        obj["metadata"]["creationTimestamp"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let yb_created = created(&r, "y", "b");
    let later = parse_text(LATER).unwrap().remove(0);
    let later = &later.steps[0].actions;
    let cfg = ProbeConfig {
        timeout: Duration::from_millis(500),
        threads: 8,
        sctp_log: r.cluster().sctp_log(),
    };
    let pod_v4 = |r: &LiveRunner, ns: &str, name: &str| -> IpAddr { r.cluster().pod(ns, name).unwrap().ipv4.into() };
    let pod_v6 = |r: &LiveRunner, ns: &str, name: &str| -> IpAddr { r.cluster().pod(ns, name).unwrap().ipv6.into() };

    // 1. y/q on node 3 at y/b's addresses while the API still holds y/b
    // Running: y/q, the newer live pod, owns them.
    let t0 = Instant::now();
    let labels: BTreeMap<String, String> = [("pod".to_string(), "q".to_string())].into();
    r.create_unmodelled_pod("y", "q", &labels, v4, v6, 3)
        .expect("y/q on node 3 at y/b's address");
    assert!(
        created(&r, "y", "q") > yb_created,
        "y/q must be newer than y/b ({yb_created})"
    );
    r.apply(&later[0]).expect("x/c trusted");
    let seen = wait_connects(
        &[probe(&r, "x/a", pod_v4(&r, "x", "c"), "x/c")],
        &cfg,
        t0,
        "x/c trusted",
    );
    eprintln!("{engine:?}: node 1 saw y/q (y/b still listed) {seen:?} after it was written");
    let never = [
        probe(&r, "y/q", xa_ip.into(), "x/a"),
        probe(&r, "x/a", v4.into(), "y/q"),
        probe(&r, "y/q", pod_v6(&r, "x", "a"), "x/a"),
        probe(&r, "x/a", v6.into(), "y/q"),
    ];
    let always = [
        probe(&r, "z/c", xa_ip.into(), "x/a"),
        probe(&r, "x/b", v4.into(), "y/q"),
        probe(&r, "x/a", pod_v4(&r, "x", "c"), "x/c"),
    ];
    let rounds = never_and_always(&never, &always, &cfg, Duration::from_secs(4), "both listed");
    eprintln!("{engine:?}: both listed: {rounds} rounds, y/q never treated as y/b");

    // 2. y/b deleted; x/b trusted is the later write.
    let t1 = Instant::now();
    r.apply(&later[1]).expect("delete y/b");
    r.apply(&later[2]).expect("x/b trusted");
    let seen = wait_connects(
        &[probe(&r, "x/a", pod_v4(&r, "x", "b"), "x/b")],
        &cfg,
        t1,
        "x/b trusted",
    );
    eprintln!("{engine:?}: node 1 saw the change {seen:?} after the delete");
    let always = [
        probe(&r, "z/c", xa_ip.into(), "x/a"),
        probe(&r, "x/b", v4.into(), "y/q"),
        probe(&r, "y/a", v4.into(), "y/q"),
        probe(&r, "x/a", pod_v4(&r, "x", "c"), "x/c"),
    ];
    let rounds = never_and_always(&never, &always, &cfg, Duration::from_secs(6), "after the delete");
    eprintln!("{engine:?}: after the delete: {rounds} rounds, y/q never treated as y/b");
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
