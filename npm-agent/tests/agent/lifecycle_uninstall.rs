//! `npm-agent uninstall stop-agents|wait-cleanup`, the chart's uninstall
//! hook Jobs, run as the binary against the test API server (its `apps/v1`
//! DaemonSets) with a generated kubeconfig: stop-agents deletes the agent
//! DaemonSet and returns once it is gone (and succeeds when it is gone
//! already), and times out naming the DaemonSet when it cannot be deleted;
//! wait-cleanup waits until the cleanup DaemonSet's controller saw its
//! spec and every scheduled pod is Ready, and times out naming the counts
//! and the pods (with their nodes) that are not.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::*;
use k8s_openapi::api::apps::v1::{DaemonSet, DaemonSetStatus};
use kube::api::{Api, PostParams};
use npm_testapi::FaultRule;

fn daemonset(name: &str, app: &str) -> DaemonSet {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "apps/v1", "kind": "DaemonSet",
        "metadata": {"name": name, "namespace": "kube-system"},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "template": {"metadata": {"labels": {"app": app}},
                         "spec": {"containers": [{"name": "c", "image": "npm-agent"}]}}
        }
    }))
    .unwrap()
}

/// `npm-agent uninstall <step> ...`: (success, stderr, how long it took).
async fn uninstall(kubeconfig: &Path, step: &str, ds: &str, timeout: u64) -> (bool, String, Duration) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_npm-agent"));
    cmd.args(["uninstall", step, "--namespace=kube-system"])
        .arg(format!("--daemonset={ds}"))
        .arg(format!("--timeout-seconds={timeout}"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .env_remove("KUBECONFIG");
    let start = Instant::now();
    let out = tokio::task::spawn_blocking(move || cmd.output().expect("run npm-agent uninstall"))
        .await
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        start.elapsed(),
    )
}

async fn set_status(api: &Api<DaemonSet>, name: &str, status: DaemonSetStatus) {
    let mut ds = api.get_status(name).await.unwrap();
    ds.status = Some(status);
    api.replace_status(name, &PostParams::default(), &ds).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stop_agents_deletes_the_daemonset_and_waits_until_it_is_gone() {
    let (srv, client) = server(true).await;
    let dir = std::env::temp_dir().join(format!("npm-uninstall-stop-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).unwrap();
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");
    api.create(&PostParams::default(), &daemonset("npm", "npm"))
        .await
        .unwrap();

    let (ok, err, _) = uninstall(&kubeconfig, "stop-agents", "npm", 10).await;
    assert!(ok, "{err}");
    assert!(api.get_opt("npm").await.unwrap().is_none(), "deleted");
    assert!(err.contains("agents stopped"), "{err}");
    // Gone already: success.
    let (ok, err, _) = uninstall(&kubeconfig, "stop-agents", "npm", 10).await;
    assert!(ok, "{err}");
    assert!(err.contains("nothing to stop"), "{err}");

    // It cannot be deleted: the step gives up after its timeout, naming it.
    api.create(&PostParams::default(), &daemonset("npm", "npm"))
        .await
        .unwrap();
    srv.inject(FaultRule::fail(1_000_000, 500).verb("delete"));
    let (ok, err, took) = uninstall(&kubeconfig, "stop-agents", "npm", 2).await;
    assert!(!ok);
    assert!(took < Duration::from_secs(8), "{took:?}");
    assert!(err.contains("timed out after 2s"), "{err}");
    assert!(err.contains("DaemonSet kube-system/npm still exists"), "{err}");
    assert!(err.contains("last API error: delete"), "{err}");
    srv.clear_faults();
    assert!(api.get_opt("npm").await.unwrap().is_some());
    std::fs::remove_dir_all(&dir).ok();
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wait_cleanup_waits_for_every_node_and_names_the_missing_ones() {
    let (srv, client) = server(true).await;
    let dir = std::env::temp_dir().join(format!("npm-uninstall-wait-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).unwrap();
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), "kube-system");

    // Not there at all.
    let (ok, err, _) = uninstall(&kubeconfig, "wait-cleanup", "npm-cleanup", 1).await;
    assert!(!ok);
    assert!(
        err.contains("DaemonSet kube-system/npm-cleanup: the DaemonSet does not exist"),
        "{err}"
    );

    // Created, not yet seen by its controller.
    api.create(&PostParams::default(), &daemonset("npm-cleanup", "cleanup"))
        .await
        .unwrap();
    let (ok, err, _) = uninstall(&kubeconfig, "wait-cleanup", "npm-cleanup", 1).await;
    assert!(!ok);
    assert!(err.contains("observedGeneration 0 < generation 1"), "{err}");

    // Seen, one of two nodes done; the other node's pod is not Ready.
    set_status(
        &api,
        "npm-cleanup",
        DaemonSetStatus {
            observed_generation: Some(1),
            desired_number_scheduled: 2,
            current_number_scheduled: 2,
            number_ready: 1,
            ..Default::default()
        },
    )
    .await;
    let mut waiting = pod(
        "kube-system",
        "npm-cleanup-x1",
        "node-b",
        Some("10.60.0.3"),
        &[("app", "cleanup")],
    );
    waiting.status.as_mut().unwrap().phase = Some("Pending".into());
    create_pods(&client, vec![waiting], 1).await;
    let (ok, err, took) = uninstall(&kubeconfig, "wait-cleanup", "npm-cleanup", 2).await;
    assert!(!ok);
    assert!(took < Duration::from_secs(8), "{took:?}");
    assert!(err.contains("timed out after 2s"), "{err}");
    assert!(err.contains("1/2 pods ready"), "{err}");
    assert!(err.contains("pods not ready: npm-cleanup-x1 on node-b"), "{err}");

    // Every node done while it waits: success.
    let waiter = tokio::spawn({
        let kubeconfig = kubeconfig.clone();
        async move { uninstall(&kubeconfig, "wait-cleanup", "npm-cleanup", 20).await }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;
    set_status(
        &api,
        "npm-cleanup",
        DaemonSetStatus {
            observed_generation: Some(1),
            desired_number_scheduled: 2,
            current_number_scheduled: 2,
            number_ready: 2,
            ..Default::default()
        },
    )
    .await;
    let (ok, err, took) = waiter.await.unwrap();
    assert!(ok, "{err}");
    assert!(took >= Duration::from_millis(1500), "it waited: {took:?}");
    assert!(err.contains("cleanup done on every node"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
    srv.shutdown().await;
}
