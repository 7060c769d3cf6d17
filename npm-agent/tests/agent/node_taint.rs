//! The `npm.io/agent-not-ready:NoSchedule` taint, with the
//! real `npm-agent run` binary (nftables dataplane) against the test API
//! server: Node `node-a` is registered with our taint and another
//! controller's taint; the agent's first full sync is held by failing every
//! pod LIST (fault injection) and its first taint PATCHes fail too.
//!
//! - while the sync is held (`/readyz` 503, `first-sync` failing) the taint
//!   stays, however long;
//! - once the lists go through, the taint is gone, never before `/readyz`
//!   answered 200 (both polled together), the other taint is left exactly
//!   as it was, and the failed PATCHes were retried (counted in
//!   `npm_errors_total{kind="node-taint"}`);
//! - a second agent on a Node without the taint writes nothing (the Node's
//!   resourceVersion does not move).
//!
//! Needs root (nftables); the table `inet npmnt<pid>` is removed on drop,
//! stale ones of crashed runs first.

use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::common::netns::{clear_stale_dirs, pid_gone};
use crate::common::process::*;
use crate::common::*;
use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, PostParams};
use npm_testapi::FaultRule;
use serde_json::{json, Value};

const PREFIX: &str = "npmnt";

/// The nft table and work dir of the test; removed on drop.
struct Fixture {
    table: String,
    work_dir: PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        for family in ["inet", "bridge"] {
            let _ = Command::new("nft")
                .args(["delete", "table", family, &self.table])
                .output();
        }
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

fn clear_leftovers() {
    clear_stale_dirs(std::env::temp_dir(), PREFIX);
    let Ok(out) = Command::new("nft").args(["list", "tables"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        for family in ["inet", "bridge"] {
            if let Some(name) = line.strip_prefix(&format!("table {family} ")) {
                if name.starts_with(PREFIX) && pid_gone(name, PREFIX) {
                    let _ = Command::new("nft").args(["delete", "table", family, name]).output();
                }
            }
        }
    }
}

/// The agent child; SIGKILLed and reaped on drop.
struct Agent {
    child: Child,
    log: PathBuf,
    metrics: std::net::SocketAddr,
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Agent {
    fn spawn(f: &Fixture, kubeconfig: &std::path::Path, tag: &str) -> Agent {
        let metrics = free_port();
        let log = f.work_dir.join(format!("agent-{tag}.log"));
        let child = spawn_agent_run_with(
            &["--dataplane", "nftables", "--nft-table", &f.table],
            &f.work_dir.join("pins"),
            None,
            kubeconfig,
            "npmnt-none*",
            metrics,
            &log,
        );
        Agent { child, log, metrics }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn alive(&mut self) {
        if let Some(status) = self.child.try_wait().unwrap() {
            panic!("the agent exited with {status:?}:\n{}", self.log_text());
        }
    }

    fn readyz(&self) -> Option<(u16, String)> {
        http_get(self.metrics, "/readyz?verbose")
    }

    fn metric(&self, series: &str) -> Option<f64> {
        let (_, text) = http_get(self.metrics, "/metrics")?;
        npm_agent::telemetry::sample(&text, series)
    }
}

fn our_taint() -> Value {
    json!({"key": "npm.io/agent-not-ready", "effect": "NoSchedule"})
}

fn other_taint() -> Value {
    json!({"key": "example.com/dedicated", "value": "infra", "effect": "NoSchedule"})
}

/// Node `node-a`'s `spec.taints` and resourceVersion.
async fn taints(api: &Api<Node>) -> (Vec<Value>, String) {
    let node = api.get("node-a").await.expect("get node-a");
    let v = serde_json::to_value(&node).unwrap();
    let taints = v
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    (taints, node.metadata.resource_version.unwrap_or_default())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn taint_is_removed_only_after_the_first_full_sync_and_only_ours() {
    clear_leftovers();
    let pid = std::process::id();
    let f = Fixture {
        table: format!("{PREFIX}{pid}"),
        work_dir: std::env::temp_dir().join(format!("{PREFIX}{pid}")),
    };
    std::fs::create_dir_all(&f.work_dir).unwrap();
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    create_pods(
        &client,
        vec![pod("k", "a", "node-b", Some("10.99.0.5"), &[("app", "a")])],
        1,
    )
    .await;
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-a"},
        "spec": {"taints": [other_taint(), our_taint()]},
    }))
    .unwrap();
    nodes
        .create(&PostParams::default(), &node)
        .await
        .expect("create node-a");
    let kubeconfig = f.work_dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).unwrap();

    // Hold the first full sync: every pod LIST fails. The first two taint
    // PATCHes fail as well (retried with backoff).
    srv.inject(FaultRule::fail(1_000_000, 500).path("/api/v1/pods").verb("list"));
    srv.inject(FaultRule::fail(2, 500).path("/api/v1/nodes").verb("patch"));
    let mut agent = Agent::spawn(&f, &kubeconfig, "first");

    let held = Instant::now();
    let mut seen_unready = false;
    while held.elapsed() < Duration::from_secs(5) {
        agent.alive();
        if let Some((code, body)) = agent.readyz() {
            assert_ne!(code, 200, "ready while every pod LIST fails: {body}");
            assert!(body.contains("[-]first-sync failed"), "{body}");
            seen_unready = true;
        }
        let (t, _) = taints(&nodes).await;
        assert!(
            t.contains(&our_taint()),
            "taint removed before the first full sync: {t:?}; log:\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        seen_unready,
        "the agent never answered /readyz; log:\n{}",
        agent.log_text()
    );

    // Let the lists through: the taint goes, never before /readyz is 200.
    srv.clear_faults();
    srv.inject(FaultRule::fail(2, 500).path("/api/v1/nodes").verb("patch"));
    let released = Instant::now();
    let mut ready_at = None;
    let removed_at = loop {
        agent.alive();
        // Readiness first, then the taint: a taint seen gone was removed
        // after this readiness answer.
        let ready = agent.readyz().is_some_and(|(code, _)| code == 200);
        let (t, _) = taints(&nodes).await;
        if ready && ready_at.is_none() {
            ready_at = Some(released.elapsed());
        }
        if !t.contains(&our_taint()) {
            assert!(
                ready_at.is_some(),
                "the taint is gone while /readyz is not 200; log:\n{}",
                agent.log_text()
            );
            assert_eq!(t, vec![other_taint()], "the other taint must stay as it was");
            break released.elapsed();
        }
        assert!(
            released.elapsed() < Duration::from_secs(60),
            "taint still there 60 s after the lists were let through (ready: {ready_at:?}); log:\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let ready_at = ready_at.unwrap();
    eprintln!("after releasing the lists: ready at {ready_at:?}, taint removed at {removed_at:?}");
    let errors = agent.metric("npm_errors_total{kind=\"node-taint\"}");
    assert_eq!(errors, Some(2.0), "two failed PATCHes, retried");
    assert!(agent.log_text().contains("removed the not-ready taint"));

    // A second agent on a Node without our taint writes nothing.
    drop(agent);
    let (_, rv) = taints(&nodes).await;
    let mut second = Agent::spawn(&f, &kubeconfig, "second");
    let start = Instant::now();
    while second.readyz().is_none_or(|(code, _)| code != 200) {
        second.alive();
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "second agent not ready:\n{}",
            second.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (t, rv_after) = taints(&nodes).await;
    assert_eq!((t, rv_after), (vec![other_taint()], rv), "the Node was written again");
    assert_eq!(second.metric("npm_errors_total{kind=\"node-taint\"}"), None);
    drop(second);
    drop(srv);
}

/// The `test` precondition against the test API server: a removal computed
/// from a taint list that another controller changed meanwhile is refused
/// (a conflict), [`remove_once`] reads the Node again and removes only ours;
/// a Node without it, or no Node, is not written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stale_taint_list_is_refused_and_only_ours_is_removed() {
    use kube::api::{Patch, PatchParams};
    use npm_agent::k8s::taint::{removal_patch, remove_once, Outcome, TaintError};

    let (_srv, client) = server(true).await;
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "node-a"},
        "spec": {"taints": [our_taint(), other_taint()]},
    }))
    .unwrap();
    nodes.create(&PostParams::default(), &node).await.unwrap();
    let (stale, _) = taints(&nodes).await;
    // Another controller adds a taint after our read.
    let third = json!({"key": "example.com/maintenance", "effect": "NoExecute"});
    let merge = json!({"spec": {"taints": [our_taint(), other_taint(), third]}});
    nodes
        .patch("node-a", &PatchParams::default(), &Patch::Merge(&merge))
        .await
        .unwrap();
    let patch = serde_json::from_value(removal_patch(&stale).unwrap()).unwrap();
    let err = nodes
        .patch("node-a", &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .expect_err("a patch from a stale list must be refused");
    let err = TaintError::Patch {
        node: "node-a".into(),
        source: err,
    };
    assert!(err.is_conflict(), "{err:?}");
    let (now, _) = taints(&nodes).await;
    assert_eq!(now, vec![our_taint(), other_taint(), third.clone()], "nothing written");

    assert_eq!(remove_once(&client, "node-a").await.unwrap(), Outcome::Removed);
    let (now, rv) = taints(&nodes).await;
    assert_eq!(now, vec![other_taint(), third]);
    assert_eq!(remove_once(&client, "node-a").await.unwrap(), Outcome::Absent);
    assert_eq!(taints(&nodes).await.1, rv, "a Node without our taint is not written");
    assert_eq!(remove_once(&client, "node-x").await.unwrap(), Outcome::NoNode);
}
