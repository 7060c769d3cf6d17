//! ClusterNetworkPolicy end to end through a real kernel: the agent (real
//! test API server with the ClusterNetworkPolicy CRD, real compiler,
//! route-based interface discovery) programs the nftables dataplane of a
//! private "node" network namespace, and TCP probes from pod `a` to pod
//! `b` (port 8080) follow the tiers as CNPs and NetworkPolicies are
//! created, replaced and deleted through the API:
//!
//! 1. an Admin Deny (b from a) drops a's connections; a NetworkPolicy that
//!    allows a cannot override it (Admin comes first);
//! 2. the same CNP replaced by Pass: the NetworkPolicy decides (allowed);
//! 3. an Admin Deny on another port only: no effect on 8080;
//! 4. a Baseline Deny: applies while no NetworkPolicy isolates b, a
//!    NetworkPolicy allowing a overrides it;
//! 5. the counters: `npm_tier_packets_total{tier="admin",action="deny"}`
//!    counted the dropped SYNs.
//!
//! Needs root. Names carry the process id (netns `npmcn<pid>{n,a,b}`, nft
//! table `npmcn<pid>` inside the node netns); leftovers of crashed runs are
//! removed first.

use std::time::Duration;

use crate::cnp_support::*;
use crate::common::*;
use npm_agent::k8s::ClusterPolicyMode;
use npm_testapi::CnpChannel;

const PREFIX: &str = "npmcn";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_decide_real_packets_through_nftables() {
    let net = NodeNet::new(PREFIX, "10.231");
    net.expect(true, "a reaches b before any policy").await;
    let (srv, client) = server_with_pods("10.231", Some(CnpChannel::Standard)).await;
    let agent = net.agent(&client, net.nft(PREFIX), ClusterPolicyMode::Auto).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    net.expect(true, "no policy").await;

    // 1. Admin Deny b <- a: dropped, whatever NetworkPolicy says.
    create_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Deny", "a", &[])).await;
    net.expect(false, "Admin Deny from a").await;
    create_policy(&client, "k", allow_a()).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        net.connects(3).await,
        0,
        "a NetworkPolicy allowing a does not override Admin Deny"
    );

    // 2. Pass: the NetworkPolicy (allow a to b:8080) decides.
    replace_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Pass", "a", &[])).await;
    net.expect(true, "Admin Pass -> NetworkPolicy allows a").await;
    // A higher-priority (lower number) Deny on the same traffic wins over the Pass.
    create_cnp(
        &client,
        cnp("admin-first", "Admin", 5, "b", "Deny", "a", &[SERVER_PORT]),
    )
    .await;
    net.expect(false, "priority 5 Deny before priority 10 Pass").await;
    delete_cnp(&client, "admin-first").await;
    net.expect(true, "the Deny is gone").await;

    // 3. A Deny of another port leaves 8080 alone.
    replace_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Deny", "a", &[9999])).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(net.connects(3).await, 3, "Admin Deny of TCP 9999 only");
    delete_cnp(&client, "admin-no-a").await;
    delete_policy(&client, "k", "allow-a").await;

    // 4. Baseline Deny: decides only while no NetworkPolicy isolates b.
    create_cnp(&client, cnp("baseline-no-a", "Baseline", 10, "b", "Deny", "a", &[])).await;
    net.expect(false, "Baseline Deny, no NetworkPolicy").await;
    create_policy(&client, "k", allow_a()).await.unwrap();
    net.expect(true, "a NetworkPolicy allowing a overrides Baseline").await;
    delete_policy(&client, "k", "allow-a").await;
    net.expect(false, "Baseline Deny again").await;
    delete_cnp(&client, "baseline-no-a").await;
    net.expect(true, "all gone").await;

    // 5. The tier counters reached the metrics.
    wait_until("admin deny counted", Duration::from_secs(10), || {
        metric(
            &agent,
            "npm_tier_packets_total{direction=\"ingress\",tier=\"admin\",action=\"deny\"}",
        ) > 0.0
    })
    .await;
    wait_until("baseline deny counted", Duration::from_secs(10), || {
        metric(
            &agent,
            "npm_tier_packets_total{direction=\"ingress\",tier=\"baseline\",action=\"deny\"}",
        ) > 0.0
    })
    .await;
    assert_eq!(metric(&agent, "npm_invalid_cluster_network_policies"), 0.0);
    drop(agent);
    srv.shutdown().await;
    drop(net);
}
