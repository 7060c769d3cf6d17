//! The agent keeps npm-cni chained: a running agent
//! (test API server, recording dataplane) with `--cni-conf-dir` on a private
//! temp directory, the conflist chained as the chart's init container
//! leaves it (`npm_cni::install::install`), and the primary CNI simulated
//! by plain file writes:
//!
//! - the conflist written anew without npm-cni (as Calico's install-cni,
//!   aws-node, flannel and kindnet do at start): the entry is back within a
//!   check, the `cni-chained` readiness check fails then passes, and
//!   `npm_cni_rechained_total` counts it;
//! - a primary that keeps doing so: the check stays failing, naming it;
//! - the conflist deleted: the check fails (and nothing is written) until
//!   the primary writes it again, which is then chained;
//! - a primary that writes a conflist that sorts first (Cilium's
//!   `05-cilium.conflist`): that one, the file the runtime uses, is chained;
//! - uninstall: after the agent stopped, `cleanup`'s CNI step
//!   ([`npm_cni::install::uninstall`]) leaves no entry that comes back; an
//!   agent still running when it runs does not chain npm-cni again either
//!   (its binary is gone), and says why;
//! - a local pod that appears with no CNI ADD is counted
//!   (`npm_cni_endpoints_without_add_total`); pods there at the first sync
//!   are not, even when their interface is found later.
//!
//! No root needed (but for the last test, which runs the real chain in a
//! netns: names `npmcnia<pid>chainadd...`, subnet 10.246.0.0/16): the
//! directories and the socket are in a temp directory named
//! `npmchain<pid>-<case>`.

use std::collections::HashSet;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cni_chain::{Network, Sandbox, Wiring};
use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use npm_agent::agent::RunningAgent;
use npm_agent::cni::{ChainConfig, CniConfig, CHECK_CNI_CHAINED};
use npm_agent::node::{Resolve, Resolved};
use npm_cni::install::{self, Entry, InstallOptions, UninstallOptions};
use npm_dataplane::Interfaces;
use npm_policy::compiled::Compiled;

/// The primary CNI's conflist, as Calico's install-cni writes it.
const CALICO: &str = r#"{
  "name": "k8s-pod-network",
  "cniVersion": "0.3.1",
  "plugins": [
    {
      "type": "calico",
      "ipam": {"type": "calico-ipam"}
    },
    {
      "type": "portmap",
      "capabilities": {"portMappings": true}
    }
  ]
}
"#;

/// Cilium's conflist (with `cni.exclusive`, Cilium also renames the others).
const CILIUM: &str = r#"{"cniVersion":"0.3.1","name":"cilium","plugins":[{"type":"cilium-cni","enable-debug":false}]}"#;

const INTERVAL: Duration = Duration::from_millis(400);

/// A node's CNI directories and the agent's socket, removed on drop.
struct Node {
    root: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

impl Node {
    /// The directories, with npm-cni installed as the init container leaves it.
    fn installed(case: &str) -> Node {
        let root = std::env::temp_dir().join(format!("npmchain{}-{case}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        for dir in ["conf", "bin", "run"] {
            std::fs::create_dir_all(root.join(dir)).unwrap();
        }
        std::fs::write(root.join("npm-cni-image-copy"), b"#!/bin/sh\nexit 0\n").unwrap();
        let node = Node { root };
        std::fs::write(node.conflist(), CALICO).unwrap();
        install::install(&InstallOptions {
            bin_dir: node.bin(),
            conf_dir: node.conf(),
            source: Some(node.root.join("npm-cni-image-copy")),
            entry: node.entry(),
            wait: Duration::ZERO,
        })
        .expect("install as the init container does");
        assert!(holds_npm_cni(&node.conflist()));
        node
    }

    fn conf(&self) -> PathBuf {
        self.root.join("conf")
    }

    fn bin(&self) -> PathBuf {
        self.root.join("bin")
    }

    fn conflist(&self) -> PathBuf {
        self.conf().join("10-calico.conflist")
    }

    fn socket(&self) -> PathBuf {
        self.root.join("run/cni.sock")
    }

    fn entry(&self) -> Entry {
        Entry {
            agent_socket: self.socket().to_string_lossy().into_owned(),
            timeout_seconds: 10,
            fail_open: false,
        }
    }

    fn cni_config(&self) -> CniConfig {
        CniConfig {
            keep_chained: Some(ChainConfig {
                conf_dir: self.conf(),
                bin_dir: self.bin(),
                source: self.root.join("npm-cni-image-copy"),
                entry: self.entry(),
                interval: INTERVAL,
            }),
            ..CniConfig::new(self.socket())
        }
    }
}

/// Whether the conflist's plugins list an `npm-cni` entry.
fn holds_npm_cni(path: &Path) -> bool {
    let Ok(text) = std::fs::read_to_string(path) else {
        return false;
    };
    let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
        return false;
    };
    v["plugins"]
        .as_array()
        .is_some_and(|p| p.iter().any(|e| e["type"] == "npm-cni"))
}

/// The `cni-chained` readiness check's failure (`None`: absent or passing).
fn chain_failure(agent: &RunningAgent) -> Option<String> {
    agent
        .health
        .readiness()
        .into_iter()
        .find(|c| c.name == CHECK_CNI_CHAINED)
        .and_then(|c| c.failure)
}

/// Whether the `cni-chained` check was reported and passes.
fn chain_ok(agent: &RunningAgent) -> bool {
    agent
        .health
        .readiness()
        .iter()
        .any(|c| c.name == CHECK_CNI_CHAINED && c.ok())
}

async fn start(node: &Node) -> (npm_testapi::TestApiServer, kube::Client, RunningAgent) {
    let (srv, client) = server(true).await;
    let mut cfg = agent_config(100);
    cfg.cni = Some(node.cni_config());
    let agent = start_agent(cfg, client.clone(), RecordingDataplane::default()).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;
    wait_until("cni-chained passes", Duration::from_secs(10), || chain_ok(&agent)).await;
    assert_eq!(metric(&agent, "npm_cni_chained"), 1.0);
    (srv, client, agent)
}

/// Polls until `done`, recording whether the `cni-chained` check failed on
/// the way (and its last reason).
async fn watch_until(agent: &RunningAgent, what: &str, mut done: impl FnMut() -> bool) -> Option<String> {
    let started = Instant::now();
    let mut failed = None;
    loop {
        if let Some(reason) = chain_failure(agent) {
            failed = Some(reason);
        }
        if done() {
            return failed;
        }
        assert!(
            started.elapsed() < Duration::from_secs(15),
            "timed out waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conflist_rewritten_without_npm_cni_is_chained_again() {
    let node = Node::installed("rewrite");
    let (_srv, _client, agent) = start(&node).await;
    assert_eq!(metric(&agent, "npm_cni_rechained_total"), 0.0);

    // Calico's install-cni at start: the file written anew, no npm-cni.
    std::fs::write(node.conflist(), CALICO).unwrap();
    let failed = watch_until(&agent, "npm-cni chained again and the check passing", || {
        holds_npm_cni(&node.conflist()) && chain_ok(&agent)
    })
    .await;
    let reason = failed.expect("the cni-chained check failed while npm-cni was not chained");
    assert!(reason.contains("10-calico.conflist"), "{reason}");
    assert_eq!(metric(&agent, "npm_cni_rechained_total"), 1.0);
    assert_eq!(metric(&agent, "npm_cni_chained"), 1.0);
    // The primary's bytes are kept; the entry is the init container's.
    let text = std::fs::read_to_string(node.conflist()).unwrap();
    assert!(text.starts_with("{\n  \"name\": \"k8s-pod-network\""), "{text}");
    assert!(text.contains(&node.socket().to_string_lossy().into_owned()), "{text}");

    // A second rewrite is counted again.
    std::fs::write(node.conflist(), CALICO).unwrap();
    wait_until("re-chained twice", Duration::from_secs(10), || {
        metric(&agent, "npm_cni_rechained_total") == 2.0
    })
    .await;
    wait_until("chained", Duration::from_secs(10), || {
        holds_npm_cni(&node.conflist()) && chain_ok(&agent)
    })
    .await;
    agent.abort();
}

/// A primary that keeps rewriting (Cilium with `cni.exclusive`): each
/// rewrite is undone, and from the third within 5 minutes on the check
/// stays failing, naming the cause, although the entry is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_primary_that_keeps_rewriting_keeps_the_check_failing() {
    let node = Node::installed("flap");
    let (_srv, _client, agent) = start(&node).await;
    for n in 1..=3 {
        std::fs::write(node.conflist(), CALICO).unwrap();
        wait_until("re-chained", Duration::from_secs(10), || {
            metric(&agent, "npm_cni_rechained_total") == f64::from(n)
        })
        .await;
    }
    tokio::time::sleep(INTERVAL * 3).await;
    assert!(holds_npm_cni(&node.conflist()));
    assert_eq!(metric(&agent, "npm_cni_chained"), 1.0);
    let reason = chain_failure(&agent).expect("still failing after 3 rewrites");
    assert!(
        reason.contains("3 times") && reason.contains("cni.exclusive"),
        "{reason}"
    );
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_conflist_is_chained_once_the_primary_writes_it_again() {
    let node = Node::installed("delete");
    let (_srv, _client, agent) = start(&node).await;

    std::fs::remove_file(node.conflist()).unwrap();
    wait_until("cni-chained fails", Duration::from_secs(10), || {
        chain_failure(&agent).is_some()
    })
    .await;
    assert_eq!(metric(&agent, "npm_cni_chained"), 0.0);
    // Nothing to chain into: the check keeps failing, nothing is written.
    tokio::time::sleep(INTERVAL * 3).await;
    let reason = chain_failure(&agent).expect("still failing");
    assert!(reason.contains("no CNI configuration"), "{reason}");
    assert!(!node.conflist().exists());

    std::fs::write(node.conflist(), CALICO).unwrap();
    wait_until("chained again", Duration::from_secs(10), || {
        holds_npm_cni(&node.conflist()) && chain_ok(&agent)
    })
    .await;
    assert_eq!(metric(&agent, "npm_cni_rechained_total"), 1.0);
    assert_eq!(metric(&agent, "npm_cni_chained"), 1.0);
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_conflist_the_runtime_uses_is_the_one_chained() {
    let node = Node::installed("first");
    let (_srv, _client, agent) = start(&node).await;

    // Cilium writes its conflist, which sorts first: the runtime uses it.
    let cilium = node.conf().join("05-cilium.conflist");
    std::fs::write(&cilium, CILIUM).unwrap();
    wait_until("05-cilium.conflist chained", Duration::from_secs(10), || {
        holds_npm_cni(&cilium) && chain_ok(&agent)
    })
    .await;
    assert_eq!(metric(&agent, "npm_cni_rechained_total"), 1.0);
    agent.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_cleanup_npm_cni_is_not_chained_again() {
    let node = Node::installed("cleanup");
    let uninstall = UninstallOptions {
        bin_dir: node.bin(),
        conf_dir: node.conf(),
    };

    // The chart's order: the agents stop, then cleanup runs.
    let (_srv, _client, agent) = start(&node).await;
    agent.abort();
    drop(agent);
    let report = install::uninstall(&uninstall).expect("cleanup's CNI step");
    assert_eq!(report.conflists, vec![node.conflist()]);
    tokio::time::sleep(INTERVAL * 4).await;
    assert!(!holds_npm_cni(&node.conflist()));
    assert!(!node.bin().join("npm-cni").exists());

    // An agent that still runs when cleanup runs does not undo it.
    let node = Node::installed("cleanup-running");
    let (_srv, _client, agent) = start(&node).await;
    install::uninstall(&UninstallOptions {
        bin_dir: node.bin(),
        conf_dir: node.conf(),
    })
    .expect("cleanup's CNI step");
    wait_until("cni-chained fails", Duration::from_secs(10), || {
        chain_failure(&agent).is_some()
    })
    .await;
    tokio::time::sleep(INTERVAL * 4).await;
    assert!(!holds_npm_cni(&node.conflist()));
    assert!(!node.bin().join("npm-cni").exists());
    let reason = chain_failure(&agent).expect("still failing");
    assert!(reason.contains("cleanup"), "{reason}");
    assert_eq!(metric(&agent, "npm_cni_rechained_total"), 0.0);
    agent.abort();
}

/// Gives every endpoint the ifindex `1000 + id`, except the endpoints whose
/// address is hidden (their interface is not found yet).
#[derive(Clone, Default)]
struct HidingResolver(Arc<Mutex<HashSet<Ipv4Addr>>>);

impl HidingResolver {
    fn hide(&self, ip: &str, hidden: bool) {
        let ip = ip.parse().unwrap();
        let mut set = self.0.lock().unwrap();
        if hidden {
            set.insert(ip);
        } else {
            set.remove(&ip);
        }
    }
}

impl Resolve for HidingResolver {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        let hidden = self.0.lock().unwrap();
        let (mut interfaces, mut missing) = (Interfaces::new(), Vec::new());
        for (id, ep) in &compiled.endpoints {
            if ep.ipv4.is_some_and(|ip| hidden.contains(&ip)) {
                missing.push(*id);
            } else {
                interfaces.insert(*id, 1000 + id);
            }
        }
        Resolved { interfaces, missing }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_pod_that_appears_without_a_cni_add_is_counted() {
    let node = Node::installed("noadd");
    let (_srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("nc", &[])]).await;
    // There before the agent: not suspect, nor when its interface is only
    // found later.
    create_pods(
        &client,
        vec![
            pod("nc", "old", "node-a", Some("10.61.0.2"), &[]),
            pod("nc", "late", "node-a", Some("10.61.0.4"), &[]),
        ],
        2,
    )
    .await;
    let mut cfg = agent_config(100);
    cfg.cni = Some(node.cni_config());
    let dp = RecordingDataplane::default();
    let resolver = HidingResolver::default();
    resolver.hide("10.61.0.4", true);
    let agent = start_agent_with(cfg, client.clone(), dp.clone(), Box::new(resolver.clone())).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;
    let programmed = |ip: &'static str| {
        let dp = dp.clone();
        move || endpoint_with_ip(&dp.lock().state, ip).is_some()
    };
    wait_until("old pod programmed", Duration::from_secs(10), programmed("10.61.0.2")).await;
    resolver.hide("10.61.0.4", false);
    wait_until("late pod programmed", Duration::from_secs(10), programmed("10.61.0.4")).await;
    assert_eq!(metric(&agent, "npm_cni_endpoints_without_add_total"), 0.0);

    // Started with npm-cni un-chained: no ADD reached the agent.
    create_pods(&client, vec![pod("nc", "new", "node-a", Some("10.61.0.3"), &[])], 1).await;
    wait_until("the new pod counted", Duration::from_secs(10), || {
        metric(&agent, "npm_cni_endpoints_without_add_total") == 1.0
    })
    .await;
    // A pod of another node is not local: not counted.
    create_pods(&client, vec![pod("nc", "remote", "node-b", Some("10.61.1.3"), &[])], 1).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(metric(&agent, "npm_cni_endpoints_without_add_total"), 1.0);
    agent.abort();
}

/// The negative: a pod started through npm-cni (`ptp`, then the real
/// npm-cni binary, as a runtime runs the chain; root, netns) is not
/// counted, while a pod of the same agent that got no ADD is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_started_through_npm_cni_is_not_counted() {
    crate::cni_chain::clear_leftovers();
    let node = Node::installed("withadd");
    let net = Arc::new(Network::new("chainadd", Wiring::Ptp, "10.246.0.0/24"));
    let (_srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("nca", &[])]).await;
    let mut cfg = agent_config(100);
    cfg.cni = Some(CniConfig {
        keep_chained: node.cni_config().keep_chained,
        ..CniConfig::new(net.socket.clone())
    });
    let dp = RecordingDataplane::default();
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;

    let mut p = pod("nca", "p", "node-a", None, &[]);
    p.status.as_mut().unwrap().phase = Some("Pending".into());
    let pods = Api::<Pod>::namespaced(client.clone(), "nca");
    let uid = pods
        .create(&PostParams::default(), &p)
        .await
        .unwrap()
        .metadata
        .uid
        .unwrap();
    let mut sb = Sandbox::new(&net, "nca", "p", &uid);
    let chain = tokio::task::block_in_place(|| sb.add());
    assert!(chain.ok(), "ADD: {:?}", chain.runs);
    let ip = sb.ip().to_string();
    let status = serde_json::json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}});
    pods.patch_status("p", &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
    assert!(endpoint_with_ip(&dp.lock().state, &ip).is_some(), "programmed at ADD");

    create_pods(&client, vec![pod("nca", "q", "node-a", Some("10.246.1.9"), &[])], 1).await;
    wait_until("the pod without ADD counted", Duration::from_secs(10), || {
        metric(&agent, "npm_cni_endpoints_without_add_total") == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(metric(&agent, "npm_cni_endpoints_without_add_total"), 1.0, "only q");
    drop(sb);
    agent.abort();
}
