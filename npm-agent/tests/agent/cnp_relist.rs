//! Incident 2 for ClusterNetworkPolicies: a relist of the CNPs cut by
//! `410 Gone` mid-list never removes a tier entry. 61 Admin Deny CNPs (b
//! from a, one TCP port each; the one of port 8080, `zz-deny-8080`, sorts
//! last) are programmed into the nftables dataplane of a private node
//! namespace; then the agent's CNP watch is made to relist (its watch
//! resumes from a compacted revision: 410), the relist is slowed page by
//! page (page size 20) and the history is compacted again after two pages,
//! so the third page's continue token answers 410 and the list restarts.
//! Throughout, no write to the dataplane removes a tier entry (a wrapper
//! counts them) and a's connections to b:8080 stay dropped; afterwards all
//! entries are there.
//!
//! Needs root. Names carry the process id (netns `npmcr<pid>{n,a,b}`).

use std::time::{Duration, Instant};

use crate::cnp_support::*;
use crate::common::*;
use npm_agent::k8s::ClusterPolicyMode;
use npm_testapi::{CnpChannel, FaultRule};

const PREFIX: &str = "npmcr";
const CNP_PATH: &str = "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies";
const INITS: &str = "npm_watch_events_total{resource=\"clusternetworkpolicies\",event=\"init\"}";
const INIT_DONES: &str = "npm_watch_events_total{resource=\"clusternetworkpolicies\",event=\"init-done\"}";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cnp_relist_cut_by_410_never_removes_tier_entries() {
    let net = NodeNet::new(PREFIX, "10.232");
    let (srv, client) = server_with_pods("10.232", Some(CnpChannel::Standard)).await;
    for i in 0..60u16 {
        create_cnp(
            &client,
            cnp(&format!("deny-{i:02}"), "Admin", 10, "b", "Deny", "a", &[9000 + i]),
        )
        .await;
    }
    create_cnp(
        &client,
        cnp("zz-deny-8080", "Admin", 10, "b", "Deny", "a", &[SERVER_PORT]),
    )
    .await;
    let (dp, log) = TierWatch::new(net.nft(PREFIX));
    let agent = net.agent(&client, dp, ClusterPolicyMode::Auto).await;
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    net.expect(false, "zz-deny-8080 drops a").await;
    let programmed = log.lock().unwrap().tiers;
    assert!(programmed >= 61, "one entry per CNP at least: {programmed}");
    let writes_before = log.lock().unwrap().writes.len();

    // Slow every CNP list page down, then make the CNP watch relist.
    let (inits, dones) = (metric(&agent, INITS), metric(&agent, INIT_DONES));
    srv.inject(
        FaultRule::delay(1000, Duration::from_millis(400))
            .path(CNP_PATH)
            .verb("list"),
    );
    let delays0 = srv.stats().injected_delays;
    let t0 = Instant::now();
    while metric(&agent, INITS) <= inits {
        assert!(t0.elapsed() < Duration::from_secs(20), "the CNP watch never relisted");
        // A write the CNP watch does not see, compacted: its resumed watch gets 410.
        create_namespaces(&client, &[namespace(&format!("bump{}", t0.elapsed().as_millis()), &[])]).await;
        srv.compact();
        srv.drop_watches();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Two pages served, the third delayed: compact under it.
    wait_until("two pages of the relist", Duration::from_secs(20), || {
        srv.stats().injected_delays >= delays0 + 3
    })
    .await;
    create_namespaces(&client, &[namespace("bump-mid-list", &[])]).await;
    srv.compact();
    let during = net.connects(10).await;
    wait_until("the relist restarted after the 410", Duration::from_secs(20), || {
        metric(&agent, INITS) >= inits + 2.0
    })
    .await;
    assert!(
        metric(&agent, "npm_errors_total{kind=\"watch\"}") >= 1.0,
        "the 410 mid-list was seen"
    );
    wait_until("the relist completed", Duration::from_secs(30), || {
        metric(&agent, INIT_DONES) > dones
    })
    .await;
    srv.clear_faults();
    let after = net.connects(3).await;
    {
        let log = log.lock().unwrap();
        let removing: Vec<_> = log.writes[writes_before..].iter().filter(|w| w.1 > 0).collect();
        assert!(removing.is_empty(), "no write removed a tier entry: {removing:?}");
        assert_eq!(log.tiers, programmed, "every tier entry is still programmed");
    }
    assert_eq!((during, after), (0, 0), "a stayed dropped during and after the relist");
    drop(agent);
    srv.shutdown().await;
    drop(net);
}
