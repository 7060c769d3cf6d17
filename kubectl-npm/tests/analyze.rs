//! `kubectl npm lint`, `exposure` and `preview` (the built binary) on the
//! state of the test API server: the analyses read the live objects
//! (pods with their `status.podIPs`, NetworkPolicies, the
//! ClusterNetworkPolicies of the installed CRD) as the agent reads them.
//! No agent and no root needed.

use std::path::{Path, PathBuf};
use std::process::Command;

use npm_testapi::{CnpChannel, Kind, Options, TestApiServer};
use serde_json::{json, Value};

fn server() -> TestApiServer {
    let s = TestApiServer::start_background(Options {
        cnp_crd: Some(CnpChannel::Standard),
        ..Options::default()
    })
    .expect("the test API server");
    for ns in ["x", "y"] {
        s.create_object(
            Kind::Namespace,
            None,
            json!({"metadata": {"name": ns, "labels": {"ns": ns}}}),
        )
        .unwrap();
    }
    for (ns, pod, ip) in [("x", "a", "10.244.1.1"), ("y", "b", "10.244.2.2")] {
        s.create_object(
            Kind::Pod,
            Some(ns),
            json!({
                "metadata": {"name": pod, "namespace": ns, "labels": {"pod": pod}},
                "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i",
                    "ports": [{"name": "http", "containerPort": 80, "protocol": "TCP"}]}]},
                "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
            }),
        )
        .unwrap();
    }
    s
}

fn cnp(name: &str, action: &str) -> Value {
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": {"tier": "Admin", "priority": 7,
            "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
            "ingress": [{"name": format!("{action}-y"), "action": action,
                "from": [{"namespaces": {"matchLabels": {"ns": "y"}}}]}]}
    })
}

fn kubectl_npm(kubeconfig: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .expect("run kubectl-npm");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn dir(test: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("kubectl-npm-analyze-{test}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn lint_reads_the_live_cluster_policies() {
    let s = server();
    let d = dir("lint");
    let kc = d.join("lint.kubeconfig");
    s.kubeconfig(&kc).unwrap();
    // Clean first: no finding, exit 0.
    let (code, out, err) = kubectl_npm(&kc, &["lint"]);
    assert_eq!(code, 0, "{out}{err}");
    assert_eq!(out, "0 findings (0 errors)\n");
    // Two Admin CNPs at one priority, Accept and Deny of y -> x.
    s.create_object(Kind::ClusterNetworkPolicy, None, cnp("open", "Accept"))
        .unwrap();
    s.create_object(Kind::ClusterNetworkPolicy, None, cnp("shut", "Deny"))
        .unwrap();
    let (code, out, err) = kubectl_npm(&kc, &["lint", "-o", "json"]);
    assert_eq!(code, 1, "{out}{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 1, "{v:#}");
    assert_eq!(v[0]["kind"], "equal-priority-overlap");
    assert_eq!(v[0]["severity"], "error");
    assert_eq!(
        v[0]["object"],
        "clusternetworkpolicy/open and clusternetworkpolicy/shut ingress"
    );
    std::fs::remove_dir_all(&d).unwrap();
}

#[test]
fn exposure_and_preview_on_the_live_state() {
    let s = server();
    let d = dir("exposure");
    let kc = d.join("exp.kubeconfig");
    s.kubeconfig(&kc).unwrap();
    s.create_object(
        Kind::NetworkPolicy,
        Some("x"),
        json!({"metadata": {"name": "https-anywhere", "namespace": "x"},
               "spec": {"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "0.0.0.0/0"}}],
                        "ports": [{"port": 443}]}]}}),
    )
    .unwrap();
    let (code, out, err) = kubectl_npm(&kc, &["exposure", "-o", "json"]);
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["cluster_cidrs"], json!(["10.244.0.0/16"]));
    let x_in = v["namespaces"]
        .as_array()
        .unwrap()
        .iter()
        .find(|n| n["namespace"] == "x" && n["direction"] == "Ingress")
        .unwrap();
    assert_eq!(x_in["unprotected"], json!([]));
    assert_eq!(x_in["exposed"][0]["pod"], "x/a");
    assert_eq!(
        x_in["exposed"][0]["outside"][0]["rule"],
        "networkpolicy/x/https-anywhere ingress[0]"
    );
    assert_eq!(x_in["exposed"][0]["outside"][0]["ports"], json!(["TCP 443"]));
    assert_eq!(x_in["exposed"][0]["outside"][0]["any_address"], true);
    // preview: the same policy without the pod network closes y/b -> x/a
    // on 443 (0.0.0.0/0 holds the pods' addresses too).
    let apply = d.join("world-only.yaml");
    std::fs::write(
        &apply,
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: https-anywhere, namespace: x}\n\
         spec: {podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 0.0.0.0/0, except: [10.244.0.0/16]}}], ports: [{port: 443}]}]}\n",
    )
    .unwrap();
    let flows = d.join("flows.jsonl");
    std::fs::write(
        &flows,
        concat!(
            r#"{"verdict":"allow","reason":"policy","direction":"ingress","pod":{"namespace":"x","name":"a"},"peer":{"kind":"pod","namespace":"y","name":"b"},"peer_ip":"10.244.2.2","policies":["x/https-anywhere"],"protocol":"TCP","src":"10.244.2.2:41000","dst":"10.244.1.1:443","endpoint":3,"ifindex":7,"node":"n1"}"#,
            "\n"
        ),
    )
    .unwrap();
    let (code, out, err) = kubectl_npm(
        &kc,
        &[
            "preview",
            "--apply",
            apply.to_str().unwrap(),
            "--flows",
            flows.to_str().unwrap(),
            "-o",
            "json",
        ],
    );
    assert_eq!(code, 0, "{err}");
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(
        (v["flows"].as_u64(), v["disagree_with_record"].as_u64()),
        (Some(1), Some(0)),
        "{v:#}"
    );
    assert_eq!(v["opened"], json!([]));
    assert_eq!(
        (v["closed"][0]["from"].as_str(), v["closed"][0]["to"].as_str()),
        (Some("y/b"), Some("x/a"))
    );
    let change = &v["closed"][0]["flows"][0];
    assert_eq!(change["port"], "TCP/443");
    assert_eq!(
        change["before"]["ingress"],
        "allowed (networkpolicy/x/https-anywhere ingress[0])"
    );
    assert_eq!(change["after"]["ingress"], "DENIED (isolated and no rule allows)");
    std::fs::remove_dir_all(&d).unwrap();
}
