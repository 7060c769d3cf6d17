//! The real `kubectl` against npm-testapi: create, get, replace, apply
//! (client- and server-side), label, delete of a NetworkPolicy and a namespace, and a
//! validation error surfaced with its field.

mod common;

use common::{write, Kubectl, TempDir};
use npm_testapi::{Options, TestApiServer};
use std::process::Command;

fn policy(port: u16, extra_label: &str) -> String {
    format!(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata:\n  name: web\n  namespace: demo\n  labels: {{v: \"{extra_label}\"}}\nspec:\n  podSelector:\n    matchLabels: {{app: web}}\n  ingress:\n  - from:\n    - namespaceSelector:\n        matchLabels: {{kubernetes.io/metadata.name: demo}}\n    ports:\n    - port: {port}\n"
    )
}

#[test]
fn kubectl_manages_namespaces_and_network_policies() {
    let dir = TempDir::new("kubectl");
    let server = TestApiServer::start_background(Options::default()).expect("server starts");
    let kubeconfig = dir.0.join("kubeconfig.yaml");
    server.kubeconfig(&kubeconfig).expect("kubeconfig written");
    let k = Kubectl {
        kubeconfig,
        cache: dir.0.join("cache"),
    };

    // Namespaces: `create namespace` (protobuf body) and `create -f` (JSON body).
    assert!(k
        .ok(&["create", "namespace", "demo"])
        .contains("namespace/demo created"));
    let ns_file = write(
        &dir.0,
        "ns.yaml",
        "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: other\n  labels: {team: x}\n",
    );
    k.ok(&["create", "-f", &ns_file]);
    let ns = k.json(&["get", "namespace", "other"]);
    assert_eq!(ns["metadata"]["labels"]["kubernetes.io/metadata.name"], "other");
    assert_eq!(ns["metadata"]["labels"]["team"], "x");
    let listed = k.ok(&["get", "namespaces"]);
    for n in ["default", "demo", "other", "kube-system"] {
        assert!(listed.contains(n), "{listed}");
    }
    k.ok(&["label", "namespace", "demo", "env=test"]);
    assert_eq!(k.json(&["get", "ns", "demo"])["metadata"]["labels"]["env"], "test");

    // NetworkPolicy: create (defaulted), replace, client-side apply, server-side apply.
    let f = write(&dir.0, "np.yaml", &policy(80, "1"));
    assert!(k
        .ok(&["create", "-f", &f])
        .contains("networkpolicy.networking.k8s.io/web created"));
    let np = k.json(&["get", "networkpolicy", "web", "-n", "demo"]);
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["protocol"], "TCP");
    assert_eq!(np["metadata"]["generation"], 1);
    let f = write(&dir.0, "np.yaml", &policy(81, "2"));
    assert!(k.ok(&["replace", "-f", &f]).contains("replaced"));
    let np = k.json(&["get", "netpol", "web", "-n", "demo"]);
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 81);
    assert_eq!(np["metadata"]["generation"], 2);
    let f = write(&dir.0, "np.yaml", &policy(82, "3"));
    k.ok(&["apply", "-f", &f]);
    let np = k.json(&["get", "netpol", "web", "-n", "demo"]);
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 82);
    assert!(np["metadata"]["annotations"]["kubectl.kubernetes.io/last-applied-configuration"].is_string());
    let f = write(&dir.0, "np.yaml", &policy(83, "4"));
    assert!(k
        .ok(&["apply", "--server-side", "-f", &f])
        .contains("serverside-applied"));
    let np = k.json(&["get", "netpol", "web", "-n", "demo"]);
    assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 83);
    assert_eq!(np["metadata"]["labels"]["v"], "4");
    assert!(k.ok(&["get", "netpol", "-A"]).contains("web"));

    // A second policy created by apply (object absent: POST).
    let f2 = write(&dir.0, "np2.yaml", &policy(80, "1").replace("name: web", "name: web2"));
    assert!(k.ok(&["apply", "-f", &f2]).contains("web2 created"));

    // Validation errors surface with the field.
    let bad = write(
        &dir.0,
        "bad.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: bad, namespace: demo}\nspec:\n  podSelector: {}\n  ingress:\n  - from:\n    - {}\n",
    );
    let o = k.run(&["create", "-f", &bad]);
    assert!(!o.ok);
    assert!(
        o.stderr.contains("is invalid") && o.stderr.contains("spec.ingress[0].from[0]"),
        "{}",
        o.stderr
    );

    // Delete the policy, then the namespace (which removes the remaining policy).
    assert!(k.ok(&["delete", "-f", &f]).contains("deleted"));
    let o = k.run(&["get", "netpol", "web", "-n", "demo"]);
    assert!(!o.ok && o.stderr.contains("NotFound"), "{}", o.stderr);
    k.ok(&["delete", "namespace", "demo"]);
    let o = k.run(&["get", "ns", "demo"]);
    assert!(!o.ok && o.stderr.contains("not found"), "{}", o.stderr);
    let left = k.ok(&["get", "netpol", "-A", "-o", "name"]);
    assert!(left.trim().is_empty(), "{left}");
    drop(server);
}

/// Kills the child process on drop (also when the test panics).
struct ChildGuard(std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn binary_writes_kubeconfig_and_honours_no_validation() {
    use std::io::BufRead;
    let dir = TempDir::new("binary");
    let kubeconfig = dir.0.join("kubeconfig.yaml");
    let mut child = ChildGuard(
        Command::new(env!("CARGO_BIN_EXE_npm-testapi"))
            .args(["--listen", "127.0.0.1:0", "--no-validation", "--kubeconfig"])
            .arg(&kubeconfig)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start npm-testapi"),
    );
    let stdout = child.0.stdout.take().expect("stdout piped");
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read the listening line");
    let url = line
        .trim()
        .strip_prefix("npm-testapi listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_string();
    assert!(url.starts_with("http://127.0.0.1:") && !url.ends_with(":0"), "{url}");
    let kc = std::fs::read_to_string(&kubeconfig).expect("kubeconfig written");
    assert!(kc.contains(&format!("server: {url}")), "{kc}");
    let k = Kubectl {
        kubeconfig,
        cache: dir.0.join("cache"),
    };
    assert!(k.ok(&["get", "namespaces"]).contains("default"));
    // With --no-validation an invalid policy is stored (and still defaulted).
    let bad = write(
        &dir.0,
        "bad.yaml",
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: bad, namespace: default}\nspec:\n  podSelector: {}\n  ingress:\n  - from:\n    - {}\n",
    );
    k.ok(&["create", "-f", &bad]);
    let np = k.json(&["get", "netpol", "bad"]);
    assert_eq!(np["spec"]["policyTypes"], serde_json::json!(["Ingress"]));
    drop(child);
}
