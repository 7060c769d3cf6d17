//! The nftables dataplane's br_netfilter check through a running agent
//! (`node::bridge_nf`): a pod whose interface is a port of a Linux bridge,
//! with `net.bridge.bridge-nf-call-iptables` 0, makes `/readyz` fail its
//! `bridge-netfilter` check naming the sysctl and counts the pod in
//! `npm_bridge_nf_unfiltered_endpoints{family="ipv4"}`; with the sysctl
//! back to 1 the agent is ready again; an agent without the check (the
//! eBPF dataplane) is ready whatever the sysctl.
//!
//! The bridge, its port and the sysctls are in a network namespace of the
//! test's own (`npmbnfa<pid>`): the bridge-nf-call sysctls are per
//! namespace, so no other test and not the host see the change. The
//! dataplane is the recording one; the resolver puts the pod on the port.

use std::process::Command;
use std::time::Duration;

use crate::common::*;
use npm_agent::node::bridge_nf::{BridgeNfConfig, CHECK_BRIDGE_NETFILTER};
use npm_agent::node::{Resolve, Resolved};
use npm_policy::compiled::Compiled;

const NS: &str = "bnf";

struct Netns(String);

impl Netns {
    fn new() -> Netns {
        let ns = Netns(format!("npmbnfa{}", std::process::id()));
        let _ = Command::new("ip").args(["netns", "del", &ns.0]).output();
        run(&["ip", "netns", "add", &ns.0]);
        ns
    }

    fn exec(&self, args: &[&str]) -> String {
        let mut full = vec!["ip", "netns", "exec", &self.0];
        full.extend_from_slice(args);
        run(&full)
    }

    fn ifindex(&self, name: &str) -> u32 {
        self.exec(&["cat", &format!("/sys/class/net/{name}/ifindex")])
            .trim()
            .parse()
            .unwrap()
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

fn run(args: &[&str]) -> String {
    let out = Command::new(args[0]).args(&args[1..]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Every endpoint on interface `0`.
struct OnInterface(u32);

impl Resolve for OnInterface {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        Resolved {
            interfaces: compiled.endpoints.keys().map(|&id| (id, self.0)).collect(),
            missing: Vec::new(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bridged_pod_without_bridge_nf_call_makes_the_agent_unready() {
    let ns = Netns::new();
    ns.exec(&["ip", "link", "add", "br0", "type", "bridge"]);
    ns.exec(&["ip", "link", "add", "v0", "type", "veth", "peer", "name", "v1"]);
    ns.exec(&["ip", "link", "set", "v0", "master", "br0"]);
    let port = ns.ifindex("v0");
    ns.exec(&["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=0"]);

    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace(NS, &[])]).await;
    create_pods(
        &client,
        vec![pod(NS, "p", "node-a", Some("10.250.0.2"), &[("app", "p")])],
        1,
    )
    .await;

    // Without the check (the eBPF dataplane): ready whatever the sysctl.
    let plain = start_agent_with(
        agent_config(100),
        client.clone(),
        RecordingDataplane::default(),
        Box::new(OnInterface(port)),
    )
    .await;
    wait_until("agent without the check ready", Duration::from_secs(20), || {
        plain.health.is_ready()
    })
    .await;
    drop(plain);

    let mut cfg = agent_config(100);
    cfg.sync.bridge_netfilter = Some(BridgeNfConfig {
        netns: Some(ns.0.clone()),
    });
    let agent = start_agent_with(
        cfg,
        client.clone(),
        RecordingDataplane::default(),
        Box::new(OnInterface(port)),
    )
    .await;
    let unfiltered = "npm_bridge_nf_unfiltered_endpoints{family=\"ipv4\"}";
    wait_until("the bridged pod counted", Duration::from_secs(20), || {
        metric(&agent, unfiltered) == 1.0
    })
    .await;
    let failure = agent
        .health
        .readiness()
        .into_iter()
        .find(|c| c.name == CHECK_BRIDGE_NETFILTER)
        .and_then(|c| c.failure)
        .expect("the bridge-netfilter check fails");
    assert!(failure.contains("net.bridge.bridge-nf-call-iptables is 0"), "{failure}");
    assert!(!agent.health.is_ready(), "/readyz fails");
    assert_eq!(
        metric(&agent, "npm_readiness_failures{check=\"bridge-netfilter\"}"),
        1.0
    );
    assert_eq!(
        metric(&agent, "npm_bridge_nf_unfiltered_endpoints{family=\"ipv6\"}"),
        0.0
    );

    ns.exec(&["sysctl", "-qw", "net.bridge.bridge-nf-call-iptables=1"]);
    wait_until("ready with the sysctl on", Duration::from_secs(20), || {
        agent.health.is_ready()
    })
    .await;
    assert_eq!(metric(&agent, unfiltered), 0.0);
    drop(agent);
    srv.shutdown().await;
}
