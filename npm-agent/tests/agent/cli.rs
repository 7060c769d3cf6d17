//! The `npm-agent` binary's command line: `simulate` through the compiler's
//! simulator, `inspect` on a pin directory without state, and `run`
//! rejecting bad settings with clear errors.

use std::process::Command;

fn agent(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npm-agent"))
        .args(args)
        .env_remove("NODE_NAME")
        .env_remove("KUBECONFIG")
        .output()
        .expect("run npm-agent");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn simulate_prints_a_reachability_matrix() {
    let dir = std::env::temp_dir().join(format!("npm-agent-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("objs.yaml");
    std::fs::write(
        &file,
        r#"apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: v1
kind: Pod
metadata: {name: a, namespace: x, labels: {app: a}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: b, namespace: x, labels: {app: b}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: deny-b, namespace: x}
spec: {podSelector: {matchLabels: {app: b}}, policyTypes: [Ingress]}
"#,
    )
    .unwrap();
    let (ok, out, err) = agent(&["simulate", "-f", file.to_str().unwrap(), "--port", "80"]);
    std::fs::remove_dir_all(&dir).ok();
    assert!(ok, "simulate failed: {err}");
    assert!(out.contains("x/a") && out.contains("x/b"), "{out}");
    // b is ingress-isolated: a->b denied, b->a allowed: both verdicts appear.
    assert!(out.contains('X') && out.contains('.'), "{out}");
}

#[test]
fn inspect_without_pinned_state_is_a_clear_error() {
    let dir = format!("/tmp/npm-agent-nopin-{}", std::process::id());
    let (ok, _, err) = agent(&["inspect", "--pin-dir", &dir]);
    assert!(!ok);
    assert!(err.contains("no pinned npm maps under"), "{err}");
}

#[test]
fn run_rejects_bad_settings() {
    let (ok, _, err) = agent(&["run"]);
    assert!(!ok);
    assert!(err.contains("--node-name") || err.contains("NODE_NAME"), "{err}");
    let (ok, _, err) = agent(&["run", "--node-name", "n", "--mass-delete-threshold", "1.5"]);
    assert!(!ok);
    assert!(err.contains("--mass-delete-threshold must be within 0..1"), "{err}");
    let (ok, _, err) = agent(&["run", "--node-name", "n", "--interface-pattern", "a/b"]);
    assert!(!ok);
    assert!(err.contains("--interface-pattern"), "{err}");
    let (ok, _, err) = agent(&["run", "--node-name", "n", "--dataplane", "iptables"]);
    assert!(!ok);
    assert!(err.contains("iptables"), "{err}");
}
