//! The Helm chart `charts/npm-agent`, checked with a real `helm` binary:
//! `helm lint`, and `helm template` whose rendered RBAC and DaemonSet are
//! asserted field by field.
//!
//! helm is found through `$HELM`, else `/usr/local/bin/helm`, else `helm` on
//! `$PATH`; a missing helm fails the test (it is installed by the project's
//! setup).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

fn helm() -> PathBuf {
    if let Some(h) = std::env::var_os("HELM") {
        return PathBuf::from(h);
    }
    let local = Path::new("/usr/local/bin/helm");
    if local.exists() {
        return local.to_path_buf();
    }
    PathBuf::from("helm")
}

fn chart() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/npm-agent")
}

fn run_helm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(helm()).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run helm ({}): {e}; install it (see the project setup)",
            helm().display()
        )
    });
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn template(set: &[&str]) -> Vec<Value> {
    let chart = chart();
    let mut args = vec!["template", "rel", chart.to_str().unwrap(), "--namespace", "npm-system"];
    for s in set {
        args.push("--set");
        args.push(s);
    }
    let (ok, out, err) = run_helm(&args);
    assert!(ok, "helm template failed: {err}");
    out.split("\n---")
        .filter_map(|d| serde_yaml::from_str::<Value>(d).ok())
        .filter(|v| !v.is_null())
        .collect()
}

fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter().filter(|d| d["kind"].as_str() == Some(kind)).collect()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(|x| x.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

#[test]
fn helm_lint_passes() {
    let chart = chart();
    let (ok, out, err) = run_helm(&["lint", chart.to_str().unwrap()]);
    assert!(ok, "helm lint failed:\n{out}\n{err}");
    assert!(out.contains("0 chart(s) failed"), "{out}");
}

#[test]
fn rbac_is_read_only_on_three_resources() {
    let docs = template(&[]);
    let roles = find(&docs, "ClusterRole");
    assert_eq!(roles.len(), 1);
    let mut granted = Vec::new();
    for rule in roles[0]["rules"].as_sequence().unwrap() {
        let mut verbs = strings(&rule["verbs"]);
        verbs.sort();
        assert_eq!(verbs, ["get", "list", "watch"], "only read verbs: {rule:?}");
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                granted.push(format!("{g}/{r}"));
            }
        }
    }
    granted.sort();
    assert_eq!(granted, ["/namespaces", "/pods", "networking.k8s.io/networkpolicies"]);
    assert!(find(&docs, "Role").is_empty());
    let binding = find(&docs, "ClusterRoleBinding")[0];
    assert_eq!(binding["roleRef"]["name"], roles[0]["metadata"]["name"]);
    let sa = find(&docs, "ServiceAccount")[0];
    assert_eq!(binding["subjects"][0]["name"], sa["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["namespace"].as_str(), Some("npm-system"));
}

#[test]
fn daemonset_essentials() {
    let docs = template(&["dataplane=nftables", "logLevel=debug"]);
    let ds = find(&docs, "DaemonSet");
    assert_eq!(ds.len(), 1);
    let spec = &ds[0]["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    let sa = find(&docs, "ServiceAccount")[0];
    assert_eq!(spec["serviceAccountName"], sa["metadata"]["name"]);
    let tolerations = spec["tolerations"].as_sequence().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t["operator"].as_str() == Some("Exists") && t["key"].is_null()),
        "tolerates every taint: {tolerations:?}"
    );
    let c = &spec["containers"][0];
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(true));
    let args = strings(&c["args"]);
    assert_eq!(args[0], "run");
    for want in [
        "--dataplane=nftables",
        "--log-level=debug",
        "--metrics-addr=0.0.0.0:9090",
        "--mass-delete-threshold=0.5",
        "--mass-delete-window-secs=600",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
    }
    let env = c["env"].as_sequence().unwrap();
    let node = env
        .iter()
        .find(|e| e["name"].as_str() == Some("NODE_NAME"))
        .expect("NODE_NAME env");
    assert_eq!(
        node["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("spec.nodeName")
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"].as_str(), Some("/readyz"));
    assert_eq!(c["livenessProbe"]["httpGet"]["path"].as_str(), Some("/healthz"));
    assert_eq!(c["ports"][0]["containerPort"].as_u64(), Some(9090));
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some("/sys/fs/bpf"))
        .expect("bpffs mounted");
    let vol = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("bpffs volume");
    assert_eq!(vol["hostPath"]["path"].as_str(), Some("/sys/fs/bpf"));
    assert!(find(&docs, "ServiceMonitor").is_empty(), "off by default");
}

#[test]
fn capabilities_mode_and_service_monitor() {
    let docs = template(&[
        "privileged=false",
        "serviceMonitor.enabled=true",
        "interfacePattern=veth*",
    ]);
    let ds = find(&docs, "DaemonSet")[0];
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(false));
    let caps = strings(&c["securityContext"]["capabilities"]["add"]);
    for cap in ["NET_ADMIN", "BPF", "SYS_ADMIN"] {
        assert!(caps.iter().any(|c| c == cap), "{cap} in {caps:?}");
    }
    assert!(strings(&c["args"]).iter().any(|a| a == "--interface-pattern=veth*"));
    let sm = find(&docs, "ServiceMonitor");
    assert_eq!(sm.len(), 1);
    assert_eq!(sm[0]["spec"]["endpoints"][0]["path"].as_str(), Some("/metrics"));
}

#[test]
fn bad_dataplane_value_is_rejected() {
    let chart = chart();
    let (ok, _, err) = run_helm(&[
        "template",
        "rel",
        chart.to_str().unwrap(),
        "--set",
        "dataplane=iptables",
    ]);
    assert!(!ok);
    assert!(err.contains("values.dataplane must be ebpf or nftables"), "{err}");
}
