//! Shared helpers of the ClusterNetworkPolicy agent tests (`cnp_*.rs`): a
//! test API server with the CRD and two pods, CNP objects and their
//! writes through the API, a private "node" network namespace with two
//! "pod" namespaces for the nftables dataplane, and a dataplane wrapper
//! that records every tier entry a write removed.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kube::api::{Api, DeleteParams, PostParams};
use npm_agent::agent::RunningAgent;
use npm_agent::k8s::ClusterPolicyMode;
use npm_agent::node::InterfaceResolver;
use npm_agent::reconcile::AgentDataplane;
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{Compiled, CompiledDiff};
use npm_policy::tiers::ClusterNetworkPolicy as ApiCnp;
use npm_testapi::{CnpChannel, Options, TestApiServer};
use serde_json::{json, Value};

use crate::common::netns::{clear_stale_netns, sh};
use crate::common::*;

/// The server pod `k/b` listens on this port (TCP).
pub const SERVER_PORT: u16 = 8080;

/// A test API server with the standard-channel CRD (or none), namespace
/// `k` and the Running pods `k/a` (app=a, `<subnet>.1.2`) and `k/b`
/// (app=b, `<subnet>.2.2`) of `node-a`.
pub async fn server_with_pods(subnet: &str, crd: Option<CnpChannel>) -> (TestApiServer, kube::Client) {
    let srv = TestApiServer::start(Options {
        cnp_crd: crd,
        ..Options::default()
    })
    .await
    .expect("start test API server");
    let client = client_for(&srv);
    create_namespaces(&client, &[namespace("k", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("k", "a", "node-a", Some(&format!("{subnet}.1.2")), &[("app", "a")]),
            pod("k", "b", "node-a", Some(&format!("{subnet}.2.2")), &[("app", "b")]),
        ],
        2,
    )
    .await;
    (srv, client)
}

/// A ClusterNetworkPolicy of `tier` and `priority` whose subject is the
/// pods app=`subject` (any namespace), with one ingress rule `action` from
/// the pods app=`from`, on TCP `ports` (empty: all traffic).
pub fn cnp(name: &str, tier: &str, priority: u32, subject: &str, action: &str, from: &str, ports: &[u16]) -> Value {
    let mut rule = json!({
        "name": format!("{action}-from-{from}").to_lowercase(),
        "action": action,
        "from": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": from}}}}]
    });
    if !ports.is_empty() {
        rule["protocols"] = ports
            .iter()
            .map(|p| json!({"tcp": {"destinationPort": {"number": p}}}))
            .collect();
    }
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "tier": tier, "priority": priority,
            "subject": {"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": subject}}}},
            "ingress": [rule]
        }
    })
}

fn cnps(client: &kube::Client) -> Api<ApiCnp> {
    Api::all(client.clone())
}

/// Create a ClusterNetworkPolicy from JSON.
pub async fn create_cnp(client: &kube::Client, obj: Value) {
    let o: ApiCnp = serde_json::from_value(obj).expect("CNP JSON");
    cnps(client)
        .create(&PostParams::default(), &o)
        .await
        .unwrap_or_else(|e| panic!("create CNP {:?}: {e}", o.metadata.name));
}

/// Replace the same-named ClusterNetworkPolicy by `obj`.
pub async fn replace_cnp(client: &kube::Client, obj: Value) {
    let mut o: ApiCnp = serde_json::from_value(obj).expect("CNP JSON");
    let name = o.metadata.name.clone().expect("a name");
    let current = cnps(client).get(&name).await.expect("get CNP");
    o.metadata.resource_version = current.metadata.resource_version;
    cnps(client)
        .replace(&name, &PostParams::default(), &o)
        .await
        .unwrap_or_else(|e| panic!("replace CNP {name}: {e}"));
}

/// Delete the ClusterNetworkPolicy `name`.
pub async fn delete_cnp(client: &kube::Client, name: &str) {
    cnps(client)
        .delete(name, &DeleteParams::default())
        .await
        .unwrap_or_else(|e| panic!("delete CNP {name}: {e}"));
}

/// A "node" network namespace `<prefix><pid>n` (forwarding on) with the
/// pods `<prefix><pid>a` (`<subnet>.1.2`) and `<prefix><pid>b`
/// (`<subnet>.2.2`) behind veths; all removed on drop (the namespaces take
/// the veths and the nft table with them), as the servers watching `stop`.
pub struct NodeNet {
    /// The node namespace (where the agent's nft table lives).
    pub node: String,
    /// The pod namespaces: `a`, `b`.
    pub pods: [String; 2],
    /// The address prefix (`<subnet>.<1|2>.2` are the pods).
    pub subnet: String,
    /// Set on drop.
    pub stop: Arc<AtomicBool>,
}

impl Drop for NodeNet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for ns in self.pods.iter().chain([&self.node]) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

impl NodeNet {
    /// Build it (leftovers of crashed runs with `prefix`, whose process is
    /// gone, are removed first) and serve TCP [`SERVER_PORT`] in pod `b`.
    pub fn new(prefix: &str, subnet: &str) -> NodeNet {
        clear_stale_netns(prefix);
        let pid = std::process::id();
        let node = format!("{prefix}{pid}n");
        let t = NodeNet {
            node: node.clone(),
            pods: [format!("{prefix}{pid}a"), format!("{prefix}{pid}b")],
            subnet: subnet.to_string(),
            stop: Arc::new(AtomicBool::new(false)),
        };
        for ns in t.pods.iter().chain([&node]) {
            sh(&["ip", "netns", "add", ns]);
            sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        }
        sh(&["ip", "netns", "exec", &node, "sysctl", "-qw", "net.ipv4.ip_forward=1"]);
        for (i, (pod_ns, tag)) in t.pods.iter().zip(["a", "b"]).enumerate() {
            let host = format!("v{prefix}{pid}{tag}");
            let net = i + 1;
            sh(&[
                "ip", "link", "add", &host, "netns", &node, "type", "veth", "peer", "name", "eth0", "netns", pod_ns,
            ]);
            let gw = format!("{subnet}.{net}.1");
            sh(&["ip", "-n", &node, "addr", "add", &format!("{gw}/24"), "dev", &host]);
            sh(&["ip", "-n", &node, "link", "set", &host, "up"]);
            let addr = format!("{subnet}.{net}.2/24");
            sh(&["ip", "-n", pod_ns, "addr", "add", &addr, "dev", "eth0"]);
            sh(&["ip", "-n", pod_ns, "link", "set", "eth0", "up"]);
            sh(&["ip", "-n", pod_ns, "route", "add", "default", "via", &gw]);
        }
        crate::common::netns::serve(&t.pods[1], t.server(), t.stop.clone());
        t
    }

    /// Pod b's server.
    pub fn server(&self) -> SocketAddr {
        format!("{}.2.2:{SERVER_PORT}", self.subnet).parse().unwrap()
    }

    /// Probe b's server from a until the result is `want` (at most 15 s).
    pub async fn expect(&self, want: bool, what: &str) {
        crate::common::netns::expect_probe(&self.pods[0], self.server(), want, what).await;
    }

    /// Probe b's server from a `n` times, 100 ms apart: how many connected.
    pub async fn connects(&self, n: usize) -> usize {
        let mut ok = 0;
        for _ in 0..n {
            let (ns, addr) = (self.pods[0].clone(), self.server());
            ok += usize::from(
                tokio::task::spawn_blocking(move || crate::common::netns::probe(&ns, addr))
                    .await
                    .unwrap(),
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        ok
    }

    /// The nftables dataplane of the node namespace (table `<tag><pid>`).
    pub fn nft(&self, tag: &str) -> NftDataplane {
        NftDataplane::new(NftOptions {
            table: format!("{tag}{}", std::process::id()),
            netns: Some(self.node.clone()),
        })
        .expect("nft dataplane")
    }

    /// The agent over `dp`, finding the veths by route in the node
    /// namespace, with ClusterNetworkPolicies in `mode`.
    pub async fn agent(
        &self,
        client: &kube::Client,
        dp: impl AgentDataplane + 'static,
        mode: ClusterPolicyMode,
    ) -> RunningAgent {
        let mut cfg = agent_config(20);
        cfg.sync.cluster_policies = mode;
        let resolver = InterfaceResolver::new(None).in_netns(&self.node);
        start_agent_with(cfg, client.clone(), dp, Box::new(resolver)).await
    }
}

/// What [`TierWatch`] saw: per write, the tier entries it removed.
#[derive(Debug, Default)]
pub struct TierLog {
    /// (full write, tier entries removed, tier entries after) per write.
    pub writes: Vec<(bool, usize, usize)>,
    /// The tier entries last written.
    pub tiers: usize,
}

/// A dataplane that records, for every write it passes on to the real one,
/// how many tier entries it removed (a `sync_full` removes every entry the
/// previous state had and the new one lacks).
pub struct TierWatch<D> {
    /// The real dataplane.
    pub inner: D,
    /// The record, shared with the test.
    pub log: Arc<Mutex<TierLog>>,
    last: Compiled,
}

impl<D> TierWatch<D> {
    /// Wrap `inner`.
    pub fn new(inner: D) -> (Self, Arc<Mutex<TierLog>>) {
        let log = Arc::new(Mutex::new(TierLog::default()));
        (
            TierWatch {
                inner,
                log: log.clone(),
                last: Compiled::default(),
            },
            log,
        )
    }
}

impl<D: Dataplane> Dataplane for TierWatch<D> {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.sync_full(compiled, interfaces)?;
        let removed = self
            .last
            .tiers
            .keys()
            .filter(|k| !compiled.tiers.contains_key(k))
            .count();
        let mut log = self.log.lock().unwrap();
        log.writes.push((true, removed, compiled.tiers.len()));
        log.tiers = compiled.tiers.len();
        self.last = compiled.clone();
        Ok(())
    }

    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.apply(diff, next, interfaces)?;
        let removed = diff.tiers.remove.len();
        let mut log = self.log.lock().unwrap();
        log.writes.push((false, removed, next.tiers.len()));
        log.tiers = next.tiers.len();
        self.last = next.clone();
        Ok(())
    }

    fn counters(&self) -> Result<Counters, DataplaneError> {
        self.inner.counters()
    }
}

impl<D: AgentDataplane> AgentDataplane for TierWatch<D> {}

/// Whether the verbose `/readyz` checks of `agent` fail `check`, and why.
pub fn failing_check(agent: &RunningAgent, check: &str) -> Option<String> {
    agent
        .health
        .readiness()
        .into_iter()
        .find(|c| c.name == check)
        .and_then(|c| c.failure)
}
