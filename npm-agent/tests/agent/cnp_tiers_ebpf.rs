//! ClusterNetworkPolicy end to end through the eBPF dataplane: the agent
//! (real test API server with the CRD, real compiler) attaches its tcx
//! programs to two host-side veths in the root namespace and programs the
//! pinned maps; TCP probes from pod `a` to pod `b` (port 8080) follow the
//! tiers: an Admin Deny drops a (a NetworkPolicy allowing a cannot
//! override it) and is in the pinned `NPM_TIERS` map (`npm-agent inspect
//! --json`), Pass hands the decision to the NetworkPolicy, a Baseline Deny
//! applies until a NetworkPolicy isolates b, and the tier counters reach
//! `npm_tier_packets_total`.
//!
//! Needs root and the BPF object (`cargo xtask build-ebpf`). Names carry
//! the process id (netns `npmct<pid>a|b`, veths `nct<pid>a|b`, pin dir
//! `/sys/fs/bpf/npmct<pid>`); leftovers of crashed runs are removed first.
//! IPv4 forwarding of the root namespace is on for the test and restored.

use std::net::SocketAddr;
use std::time::Duration;

use crate::cnp_support::*;
use crate::common::netns::*;
use crate::common::process::inspect_json;
use crate::common::*;
use npm_agent::k8s::ClusterPolicyMode;
use npm_agent::node::{InterfacePattern, InterfaceResolver};
use npm_dataplane::ebpf::{EbpfDataplane, EbpfOptions};
use npm_testapi::CnpChannel;

const PREFIX: &str = "npmct";

fn server_addr() -> SocketAddr {
    format!("10.225.2.2:{SERVER_PORT}").parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_decide_real_packets_through_ebpf() {
    clear_stale_netns(PREFIX);
    clear_stale_links("nct");
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    let topo = RoutedPods::new(PREFIX, "nct", ["a", "b"], "10.225");
    serve(&topo.pods[1], server_addr(), topo.stop.clone());
    let a = topo.pods[0].clone();
    expect_probe(&a, server_addr(), true, "before any policy").await;

    let (srv, client) = server_with_pods("10.225", Some(CnpChannel::Standard)).await;
    let dp = EbpfDataplane::open(EbpfOptions {
        object: std::env::var_os("NPM_EBPF_OBJECT").map(Into::into),
        pin_dir: topo.pin_dir.clone(),
        bench_no_ct_create: false,
        attach: npm_dataplane::ebpf::AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane (run `cargo xtask build-ebpf` first)");
    let pattern = InterfacePattern::new(&format!("nct{}*", std::process::id())).unwrap();
    let mut cfg = agent_config(100);
    cfg.sync.cluster_policies = ClusterPolicyMode::Auto;
    let agent = start_agent_with(cfg, client.clone(), dp, Box::new(InterfaceResolver::new(Some(pattern)))).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    expect_probe(&a, server_addr(), true, "no policy").await;

    create_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Deny", "a", &[])).await;
    expect_probe(&a, server_addr(), false, "Admin Deny from a").await;
    let dump = inspect_json(&topo.pin_dir, &[]);
    let tiers = dump["tiers"].as_array().cloned().unwrap_or_default();
    assert!(
        tiers
            .iter()
            .any(|t| t["tier"] == "admin" && t["action"] == "deny" && t["direction"] == "ingress"),
        "the Admin Deny is in the pinned map: {dump}"
    );
    create_policy(&client, "k", allow_a()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    expect_probe(&a, server_addr(), false, "NetworkPolicy does not override Admin Deny").await;
    replace_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Pass", "a", &[])).await;
    expect_probe(&a, server_addr(), true, "Pass: the NetworkPolicy allows a").await;
    delete_cnp(&client, "admin-no-a").await;
    delete_policy(&client, "k", "allow-a").await;

    create_cnp(&client, cnp("baseline-no-a", "Baseline", 10, "b", "Deny", "a", &[])).await;
    expect_probe(&a, server_addr(), false, "Baseline Deny, no NetworkPolicy").await;
    create_policy(&client, "k", allow_a()).await.unwrap();
    expect_probe(&a, server_addr(), true, "a NetworkPolicy overrides Baseline").await;
    delete_cnp(&client, "baseline-no-a").await;
    delete_policy(&client, "k", "allow-a").await;
    expect_probe(&a, server_addr(), true, "all gone").await;

    for tier in ["admin", "baseline"] {
        let series = format!("npm_tier_packets_total{{direction=\"ingress\",tier=\"{tier}\",action=\"deny\"}}");
        wait_until(&series, Duration::from_secs(10), || metric(&agent, &series) > 0.0).await;
    }
    drop(agent);
    srv.shutdown().await;
    drop(topo);
}
