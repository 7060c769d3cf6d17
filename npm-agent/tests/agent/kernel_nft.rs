//! End to end through a real kernel: the agent (real test API server, real
//! compiler, route-based interface discovery) programs the nftables
//! dataplane of a private "node" network namespace, and TCP probes between
//! two "pod" namespaces follow the policies as they change.
//!
//! Topology (names carry the process id; leftovers of crashed runs, whose
//! process is gone, are removed first):
//!
//! ```text
//! netns npmag<pid>a  eth0 10.213.1.2/24 --veth-- nga<pid>a 10.213.1.1/24 \
//!                                                                 netns npmag<pid>n (node, forwarding, nft table npm_t<pid>)
//! netns npmag<pid>b  eth0 10.213.2.2/24 --veth-- nga<pid>b 10.213.2.1/24 /
//! ```

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::netns::*;
use crate::common::*;
use npm_agent::node::InterfaceResolver;
use npm_dataplane::nft::{NftDataplane, NftOptions};

const PREFIX: &str = "npmag";

fn server_addr() -> SocketAddr {
    "10.213.2.2:8080".parse().unwrap()
}

/// Removes the namespaces (and with them the veths and the table) on drop.
struct Topology {
    node: String,
    pods: [String; 2],
    stop: Arc<AtomicBool>,
}

impl Drop for Topology {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for ns in self.pods.iter().chain([&self.node]) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

fn setup() -> Topology {
    clear_stale_netns(PREFIX);
    let pid = std::process::id();
    let node = format!("{PREFIX}{pid}n");
    let t = Topology {
        node: node.clone(),
        pods: [format!("{PREFIX}{pid}a"), format!("{PREFIX}{pid}b")],
        stop: Arc::new(AtomicBool::new(false)),
    };
    for ns in t.pods.iter().chain([&node]) {
        sh(&["ip", "netns", "add", ns]);
        sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
    }
    sh(&["ip", "netns", "exec", &node, "sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    for (i, (pod_ns, tag)) in t.pods.iter().zip(["a", "b"]).enumerate() {
        let host = format!("nga{pid}{tag}");
        let net = i + 1;
        sh(&[
            "ip", "link", "add", &host, "netns", &node, "type", "veth", "peer", "name", "eth0", "netns", pod_ns,
        ]);
        sh(&[
            "ip",
            "-n",
            &node,
            "addr",
            "add",
            &format!("10.213.{net}.1/24"),
            "dev",
            &host,
        ]);
        sh(&["ip", "-n", &node, "link", "set", &host, "up"]);
        sh(&[
            "ip",
            "-n",
            pod_ns,
            "addr",
            "add",
            &format!("10.213.{net}.2/24"),
            "dev",
            "eth0",
        ]);
        sh(&["ip", "-n", pod_ns, "link", "set", "eth0", "up"]);
        sh(&[
            "ip",
            "-n",
            pod_ns,
            "route",
            "add",
            "default",
            "via",
            &format!("10.213.{net}.1"),
        ]);
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_enforces_through_nftables_in_a_netns() {
    let topo = setup();
    serve(&topo.pods[1], server_addr(), topo.stop.clone());
    assert!(probe(&topo.pods[0], server_addr()), "a reaches b before any policy");

    let (srv, client) = two_pod_server("10.213").await;
    let table = format!("npm_t{}", std::process::id());
    let dp = NftDataplane::new(NftOptions {
        table: table.clone(),
        netns: Some(topo.node.clone()),
    })
    .expect("nft dataplane");
    let resolver = InterfaceResolver::new(None).in_netns(&topo.node);
    let agent = start_agent_with(agent_config(100), client.clone(), dp, Box::new(resolver)).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    assert_eq!(
        metric(&agent, "npm_endpoints_pending_interface"),
        0.0,
        "both interfaces found by route lookup"
    );
    expect_probe(&topo.pods[0], server_addr(), true, "no policy").await;

    create_policy(&client, "k", deny_b()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr(), false, "b is ingress-isolated").await;

    create_policy(&client, "k", allow_a()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr(), true, "a is allowed to b:8080").await;

    // Deleting pod a from the API: its address is no longer a pod of app=a.
    delete_pods(&client, vec![("k".into(), "a".into())], 1).await;
    expect_probe(&topo.pods[0], server_addr(), false, "a's address is no longer app=a").await;

    delete_policy(&client, "k", "deny-b").await;
    delete_policy(&client, "k", "allow-a").await;
    expect_probe(&topo.pods[0], server_addr(), true, "no policy left").await;
    drop(agent);
    srv.shutdown().await;
    drop(topo);
}
