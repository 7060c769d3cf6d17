//! `kubectl npm why` (the built binary) on the three-node netns cluster
//! (`x/*` on node-1, `y/*` on node-2, `z/*` on node-3, an agent per node)
//! against its test API server, on eBPF and on nftables: for a matrix of
//! pod pairs on one node and across nodes, allowed and denied, decided by
//! a NetworkPolicy rule, by a NetworkPolicy that isolates, by a
//! ClusterNetworkPolicy rule of the Admin or of the Baseline tier, or by
//! nothing (not isolated), each direction comes from the agent of its
//! pod's node (both asked through `pods/portforward` of their agent pods)
//! with the deciding rule, the kernel's dry-run verdict agrees (eBPF;
//! `null` on nftables), and the verdict is what a real connection gets.
//!
//! Each agent's debug listener is on its node netns' loopback; the agent
//! pods' port-forward reaches it as a kubelet does, by entering the
//! node's netns (`npm_e2e::plugin`: a relay thread, since the test API
//! server connects to a host-network pod's address on this machine).
//!
//! Needs root, the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`) and, for eBPF, the BPF object (`NPM_EBPF_OBJECT`).

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use npm_e2e::fixtures::{agent_bin, probe_config, tcp_probe, wait_enforced};
use npm_e2e::probe::probe_all;
use npm_e2e::runner::{parse_text, Engine, LiveRunner, Options};
use serde_json::{json, Value};

/// The policies of the matrix: two NetworkPolicies (x/a's ingress from
/// x/c; y/b's from x/a on TCP 80), an Admin ClusterNetworkPolicy (y's
/// ingress: deny from z; z's: accept from z) and a Baseline one (z's
/// ingress: deny from everyone).
const SETUP: &str = r#"
id: why-nodes-setup
steps:
  - actions:
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: x, name: allow-xc-to-xa}
          spec:
            podSelector: {matchLabels: {pod: a}}
            policyTypes: [Ingress]
            ingress:
              - from: [{podSelector: {matchLabels: {pod: c}}}]
                ports: [{protocol: TCP, port: 80}]
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: y, name: allow-xa-80}
          spec:
            podSelector: {matchLabels: {pod: b}}
            policyTypes: [Ingress]
            ingress:
              - from:
                  - namespaceSelector: {matchLabels: {ns: x}}
                    podSelector: {matchLabels: {pod: a}}
                ports: [{protocol: TCP, port: 80}]
      - create_cluster_network_policy:
          apiVersion: policy.networking.k8s.io/v1alpha2
          kind: ClusterNetworkPolicy
          metadata: {name: admin-y}
          spec:
            tier: Admin
            priority: 5
            subject: {namespaces: {matchLabels: {ns: y}}}
            ingress:
              - name: deny-from-z
                action: Deny
                from: [{namespaces: {matchLabels: {ns: z}}}]
      - create_cluster_network_policy:
          apiVersion: policy.networking.k8s.io/v1alpha2
          kind: ClusterNetworkPolicy
          metadata: {name: admin-z}
          spec:
            tier: Admin
            priority: 6
            subject: {namespaces: {matchLabels: {ns: z}}}
            ingress:
              - name: accept-from-z
                action: Accept
                from: [{namespaces: {matchLabels: {ns: z}}}]
      - create_cluster_network_policy:
          apiVersion: policy.networking.k8s.io/v1alpha2
          kind: ClusterNetworkPolicy
          metadata: {name: baseline-z}
          spec:
            tier: Baseline
            priority: 1
            subject: {namespaces: {matchLabels: {ns: z}}}
            ingress:
              - name: deny-all
                action: Deny
                from: [{namespaces: {}}]
    probes: []
"#;

/// What decides the receiver's ingress of a pair.
#[derive(Clone, Copy, Debug)]
enum Decider {
    /// Nothing isolates the receiver.
    NotIsolated,
    /// The NetworkPolicy `ns/name`'s `ingress[0]` allows.
    NpRule(&'static str, &'static str),
    /// The NetworkPolicy `ns/name` isolates and no rule allows.
    NpIsolates(&'static str, &'static str),
    /// The ClusterNetworkPolicy `name` (tier, priority) whose rule
    /// `ingress[0]` of this name has this action.
    Cnp(&'static str, &'static str, u32, &'static str, &'static str),
}

/// One row: from, to, port, allowed, decider.
type Row = (&'static str, &'static str, u16, bool, Decider);

const MATRIX: [Row; 8] = [
    // One node.
    ("x/c", "x/a", 80, true, Decider::NpRule("x", "allow-xc-to-xa")),
    ("x/b", "x/a", 80, false, Decider::NpIsolates("x", "allow-xc-to-xa")),
    (
        "z/a",
        "z/b",
        80,
        true,
        Decider::Cnp("admin-z", "Admin", 6, "accept-from-z", "Accept"),
    ),
    // Across nodes.
    ("x/a", "y/b", 80, true, Decider::NpRule("y", "allow-xa-80")),
    ("x/a", "y/b", 81, false, Decider::NpIsolates("y", "allow-xa-80")),
    (
        "z/c",
        "y/b",
        80,
        false,
        Decider::Cnp("admin-y", "Admin", 5, "deny-from-z", "Deny"),
    ),
    (
        "x/a",
        "z/b",
        80,
        false,
        Decider::Cnp("baseline-z", "Baseline", 1, "deny-all", "Deny"),
    ),
    ("y/a", "x/c", 80, true, Decider::NotIsolated),
];

fn direction<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["directions"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["direction"] == name))
        .unwrap_or_else(|| panic!("no {name} direction: {v}"))
}

fn why(kubeconfig: &Path, from: &str, to: &str, port: u16) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["why", from, to, "--port", &port.to_string(), "-o", "json"])
        .output()
        .expect("run kubectl-npm");
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "why {from} {to} {port}: {stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}"))
}

fn run(engine: Engine) {
    let mut r = LiveRunner::start(Options {
        engine,
        agent_bin: agent_bin(),
        nodes: 3,
        deadline: Duration::from_secs(15),
        ..Options::default()
    })
    .expect("start three nodes");
    let case = parse_text(SETUP).expect("the setup case").remove(0);
    let (passed, report) = r.run_case(&case);
    assert!(passed, "setup: {report}");
    let cfg = probe_config(&r, 2);
    let probes: Vec<_> = MATRIX
        .iter()
        .map(|(from, to, port, allowed, _)| (tcp_probe(&r, from, to, *port), *allowed))
        .collect();
    let allowed: Vec<_> = probes.iter().filter(|p| p.1).map(|p| p.0.clone()).collect();
    let denied: Vec<_> = probes.iter().filter(|p| !p.1).map(|p| p.0.clone()).collect();
    // Every pair gets its verdict on the wire before the agents are asked.
    wait_enforced(&format!("{engine:?} matrix"), &cfg, &allowed, &denied);
    let alice = npm_e2e::plugin::register(&r, &r.workdir().join("admin.kubeconfig")).expect("register the agents");
    let node_of = |pod: &str| {
        let (ns, name) = pod.split_once('/').unwrap();
        r.cluster()
            .pod(ns, name)
            .and_then(|p| p.node.clone())
            .expect("a scheduled pod")
    };
    for (from, to, port, allowed, decider) in MATRIX {
        let v = why(&alice, from, to, port);
        let row = format!("{engine:?} {from} -> {to} :{port}: {v}");
        let (egress, ingress) = (direction(&v, "egress"), direction(&v, "ingress"));
        assert_eq!(v["verdict"], if allowed { "allow" } else { "deny" }, "{row}");
        // Each direction as the agent of its own pod's node decided it.
        assert_eq!(
            (egress["local"].as_bool(), ingress["local"].as_bool()),
            (Some(true), Some(true)),
            "{row}"
        );
        assert_eq!(egress["node"], node_of(from), "{row}");
        assert_eq!(ingress["node"], node_of(to), "{row}");
        assert_eq!(egress["verdict"], "allow", "{row}");
        assert_eq!(ingress["verdict"], v["verdict"], "{row}");
        let policy = &ingress["policies"][0];
        match decider {
            Decider::NotIsolated => {
                assert_eq!(ingress["reason"], "NotIsolated", "{row}");
                assert_eq!(ingress["policies"], json!([]), "{row}");
            }
            Decider::NpRule(ns, name) => assert_eq!(
                (
                    &policy["kind"],
                    &policy["namespace"],
                    &policy["name"],
                    &policy["rule"],
                    &policy["effect"]
                ),
                (
                    &json!("NetworkPolicy"),
                    &json!(ns),
                    &json!(name),
                    &json!("ingress[0]"),
                    &json!("allow")
                ),
                "{row}"
            ),
            Decider::NpIsolates(ns, name) => {
                assert_eq!(ingress["reason"], "PolicyDenied", "{row}");
                assert_eq!(
                    (&policy["namespace"], &policy["name"], &policy["effect"]),
                    (&json!(ns), &json!(name), &json!("isolates")),
                    "{row}"
                );
            }
            Decider::Cnp(name, tier, priority, rule, action) => assert_eq!(
                [
                    &policy["kind"],
                    &policy["name"],
                    &policy["tier"],
                    &policy["priority"],
                    &policy["rule"],
                    &policy["rule_name"],
                    &policy["effect"]
                ],
                [
                    &json!("ClusterNetworkPolicy"),
                    &json!(name),
                    &json!(tier),
                    &json!(priority),
                    &json!("ingress[0]"),
                    &json!(rule),
                    &json!(action)
                ],
                "{row}"
            ),
        }
        // The kernel's dry run of both directions agrees (eBPF), none on
        // nftables.
        assert_eq!(v["mismatch"], Value::Null, "{row}");
        for d in [egress, ingress] {
            match engine {
                Engine::Ebpf => assert_eq!(d["kernel"]["verdict"], d["verdict"], "{row}"),
                _ => assert_eq!(d["kernel"], Value::Null, "{row}"),
            }
        }
    }
    // The text names the ClusterNetworkPolicy by tier, name, priority and
    // rule name.
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .arg("--kubeconfig")
        .arg(&alice)
        .args(["why", "z/c", "y/b", "--port", "80"])
        .output()
        .expect("run kubectl-npm");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains(r#"ClusterNetworkPolicy Admin admin-y (priority 5) ingress[0] "deny-from-z" (Deny)"#),
        "{text}"
    );
    // And the wire still says the same after the agents were asked.
    for (p, allowed) in &probes {
        assert_eq!(
            probe_all(std::slice::from_ref(p), &cfg)[0],
            *allowed,
            "{engine:?} {p:?}"
        );
    }
    r.shutdown().expect("shutdown");
}

/// One three-node cluster at a time (shared node and pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn kubectl_npm_why_across_nodes_on_ebpf() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn kubectl_npm_why_across_nodes_on_nftables() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Engine::Nftables);
}
