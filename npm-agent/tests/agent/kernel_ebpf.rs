//! End to end through the eBPF dataplane: the agent (real test API server,
//! real compiler, route-based interface discovery restricted by
//! `--interface-pattern`) programs tcx programs and pinned maps on two
//! host-side veths in the root namespace; TCP probes between two pod
//! namespaces follow the policies. Enforcement survives the agent
//! stopping (pinned state), `npm-agent inspect --json` reads the pinned
//! maps, and a restarted agent adopts and reconciles them.
//!
//! Names carry the process id (netns `npmae<pid>a|b`, veths `nge<pid>a|b`,
//! pin dir `/sys/fs/bpf/npmae<pid>`); leftovers of crashed runs are removed
//! first. IPv4 forwarding of the root namespace is switched on for the test
//! and restored afterwards.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::netns::*;
use crate::common::process::*;
use crate::common::*;
use npm_agent::agent::RunningAgent;
use npm_agent::node::{InterfacePattern, InterfaceResolver};
use npm_dataplane::ebpf::{EbpfDataplane, EbpfOptions};

const PREFIX: &str = "npmae";

fn server_addr() -> SocketAddr {
    "10.214.2.2:8080".parse().unwrap()
}

/// Pods `a` and `b`, routed from the root namespace.
type Topology = RoutedPods<2>;

fn clear_leftovers() {
    clear_stale_netns(PREFIX);
    clear_stale_links("nge");
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
}

fn setup() -> Topology {
    clear_leftovers();
    RoutedPods::new(PREFIX, "nge", ["a", "b"], "10.214")
}

async fn start(topo: &Topology, client: &kube::Client) -> RunningAgent {
    let dp = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: topo.pin_dir.clone(),
        bench_no_ct_create: false,
        attach: npm_dataplane::ebpf::AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane (run `cargo xtask build-ebpf` first)");
    let pattern = InterfacePattern::new(&format!("nge{}*", std::process::id())).unwrap();
    let resolver = InterfaceResolver::new(Some(pattern));
    start_agent_with(agent_config(100), client.clone(), dp, Box::new(resolver)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn agent_enforces_through_ebpf_and_survives_restart() {
    let topo = setup();
    serve(&topo.pods[1], server_addr(), topo.stop.clone());
    assert!(probe(&topo.pods[0], server_addr()), "a reaches b before any policy");

    let (srv, client) = two_pod_server("10.214").await;
    let agent = start(&topo, &client).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    assert_eq!(metric(&agent, "npm_endpoints_pending_interface"), 0.0);
    expect_probe(&topo.pods[0], server_addr(), true, "no policy").await;

    create_policy(&client, "k", deny_b()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr(), false, "b is ingress-isolated").await;
    create_policy(&client, "k", allow_a()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr(), true, "a allowed to b:8080").await;
    // The dataplane counters reach the metrics.
    wait_until("counters exported", Duration::from_secs(10), || {
        metric(
            &agent,
            "npm_packets_total{direction=\"ingress\",reason=\"policy-denied\",verdict=\"denied\"}",
        ) >= 1.0
    })
    .await;

    // The agent stops: the pinned programs and maps keep enforcing.
    drop(agent);
    tokio::time::sleep(Duration::from_millis(300)).await;
    expect_probe(&topo.pods[0], server_addr(), true, "still allowed with no agent").await;

    // inspect reads the pinned maps.
    let dump = inspect_json(&topo.pin_dir, &[]);
    let eps = dump["endpoints"].as_array().unwrap();
    assert_eq!(eps.len(), 2, "{dump}");
    assert!(
        eps.iter()
            .any(|e| e["ipv4"] == "10.214.2.2" && e["flags"].as_u64().unwrap() & 1 == 1),
        "b isolated: {dump}"
    );
    let ipcache: Vec<&str> = dump["ipcache"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["addr"].as_str())
        .collect();
    assert!(
        ipcache.contains(&"10.214.1.2") && ipcache.contains(&"10.214.2.2"),
        "{ipcache:?}"
    );
    assert!(!dump["policy"].as_array().unwrap().is_empty());

    // A restarted agent adopts the pinned state and keeps reconciling.
    let agent = start(&topo, &client).await;
    wait_until("ready again", Duration::from_secs(20), || agent.is_ready()).await;
    expect_probe(&topo.pods[0], server_addr(), true, "after restart").await;
    delete_policy(&client, "k", "allow-a").await;
    expect_probe(&topo.pods[0], server_addr(), false, "allow removed after restart").await;
    drop(agent);
    srv.shutdown().await;
    drop(topo);
}
