//! The mass-removal guard covers ClusterNetworkPolicies: losing most of
//! them at once is held like losing pods or NetworkPolicies, because a lost
//! Deny opens traffic. Four Admin Deny CNPs (b from a; the one of port 8080
//! among them) are programmed into the nftables dataplane of a private
//! node namespace; three are deleted through the API while every
//! CNP LIST fails (so the guard's confirming direct read cannot succeed):
//! the removal is held (a's connections to b:8080 stay dropped,
//! `npm_held_removals` is 1, `npm_destructive_actions_deferred_total`
//! counts it) while additions still go through (a new Deny of another port
//! is programmed during the hold); once the LISTs work again the direct
//! read confirms the deletion and it is applied (a connects).
//!
//! Needs root. Names carry the process id (netns `npmcg<pid>{n,a,b}`).

use std::time::Duration;

use crate::cnp_support::*;
use crate::common::*;
use npm_agent::k8s::ClusterPolicyMode;
use npm_testapi::{CnpChannel, FaultRule};

const PREFIX: &str = "npmcg";
const CNP_PATH: &str = "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_most_cnps_at_once_is_held_until_confirmed() {
    let net = NodeNet::new(PREFIX, "10.233");
    let (srv, client) = server_with_pods("10.233", Some(CnpChannel::Standard)).await;
    let ports = [SERVER_PORT, 8081, 8082, 8083];
    for p in ports {
        create_cnp(&client, cnp(&format!("deny-{p}"), "Admin", 10, "b", "Deny", "a", &[p])).await;
    }
    let (dp, log) = TierWatch::new(net.nft(PREFIX));
    let agent = net.agent(&client, dp, ClusterPolicyMode::Auto).await;
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    net.expect(false, "deny-8080 drops a").await;
    let programmed = log.lock().unwrap().tiers;

    // Every CNP LIST fails from now on: no direct read can confirm.
    srv.inject(FaultRule::fail(100_000, 500).path(CNP_PATH).verb("list"));
    // 8080's last: however the deletions fall into syncs, the one that
    // removes it crosses the threshold (3 of 4; 2 of 4 is not most).
    for p in [8081, 8082, SERVER_PORT] {
        delete_cnp(&client, &format!("deny-{p}")).await;
    }
    wait_until("the removal is held", Duration::from_secs(10), || {
        metric(&agent, "npm_held_removals") == 1.0
    })
    .await;
    assert!(metric(&agent, "npm_destructive_actions_deferred_total") >= 1.0);
    assert!(
        metric(&agent, "npm_errors_total{kind=\"direct-read\"}") >= 1.0,
        "the direct read failed"
    );
    // An addition during the hold is programmed.
    create_cnp(&client, cnp("deny-9000", "Admin", 10, "b", "Deny", "a", &[9000])).await;
    wait_until(
        "the addition is programmed during the hold",
        Duration::from_secs(10),
        || log.lock().unwrap().tiers > programmed,
    )
    .await;
    assert_eq!(
        net.connects(10).await,
        0,
        "held: the deleted Deny of 8080 still drops a"
    );
    assert!(
        log.lock().unwrap().tiers > programmed,
        "the held CNPs keep their entries"
    );

    // The API answers again: the direct read confirms, the deletion applies.
    srv.clear_faults();
    net.expect(true, "the confirmed deletion opened 8080").await;
    wait_until("no longer held", Duration::from_secs(10), || {
        metric(&agent, "npm_held_removals") == 0.0
    })
    .await;
    drop(agent);
    srv.shutdown().await;
    drop(net);
}
