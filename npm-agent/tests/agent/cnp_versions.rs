//! A `404` on the ClusterNetworkPolicy list is never "none" by itself
//!: an agent over a recording dataplane (no root: the
//! compiled tier entries of every write are counted by [`TierWatch`])
//! enforces an Admin Deny (b from a), then the API server
//!
//! - stops serving `v1alpha2` while it serves `v1beta1` (a CRD upgrade
//!   flipping `served`): no write ever removes a tier entry, and the agent
//!   reads `v1beta1` (a second Deny, a from b, created through `v1beta1`
//!   only, is programmed), also after a relist there;
//! - answers 404 on the `v1alpha2` list while its CRD still serves it (an
//!   API server still starting its CRD handlers): no write removes a tier
//!   entry, readiness names the reason, `npm_errors_total{kind=
//!   "cluster-policies-unknown"}` counts it, and the agent is ready again
//!   once the list works; the same with the watch (not only the list)
//!   answering 404;
//! - the same, then the CRD is deleted: only then (discovery confirms it)
//!   the Deny goes, through the mass-removal guard.
//!
//! `discover` itself answers the same from the CRD and, when the agent may
//! not read CRDs (403), from API discovery.
//!
//! Each relist is forced as `cnp_relist` forces it (a write the CNP watch
//! does not see, compacted, watches dropped: the resumed watch gets 410).

use std::time::{Duration, Instant};

use crate::cnp_support::*;
use crate::common::*;
use kube::api::{Api, DynamicObject, PostParams};
use kube::core::ApiResource;
use npm_agent::agent::RunningAgent;
use npm_agent::k8s::cluster_policy::CHECK_CLUSTER_POLICIES;
use npm_agent::k8s::{direct_read_with, ClusterPolicyMode, WatchError};
use npm_testapi::{CnpChannel, FaultRule, TestApiServer};
use std::sync::{Arc, Mutex};

const CNP_PATH: &str = "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies";
const INITS: &str = "npm_watch_events_total{resource=\"clusternetworkpolicies\",event=\"init\"}";
const UNKNOWN: &str = "npm_errors_total{kind=\"cluster-policies-unknown\"}";
const DEFERRED: &str = "npm_destructive_actions_deferred_total";

/// A test API server with the CRD, pods `k/a`, `k/b` and the Admin Deny
/// `admin-no-a` (b from a, all traffic), and a ready agent over a recording
/// dataplane whose tier entries `TierWatch` counts.
async fn enforced(subnet: &str) -> (TestApiServer, kube::Client, RunningAgent, Arc<Mutex<TierLog>>, usize) {
    let (srv, client) = server_with_pods(subnet, Some(CnpChannel::Standard)).await;
    create_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Deny", "a", &[])).await;
    let (dp, log) = TierWatch::new(RecordingDataplane::default());
    let agent = start_agent(agent_config(100), client.clone(), dp).await;
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    wait_until("the Deny is programmed", Duration::from_secs(10), || {
        log.lock().unwrap().tiers > 0
    })
    .await;
    let tiers = log.lock().unwrap().tiers;
    (srv, client, agent, log, tiers)
}

/// Make the agent's CNP watch relist (at least one more `init`).
async fn force_relist(srv: &TestApiServer, client: &kube::Client, agent: &RunningAgent) {
    let inits = metric(agent, INITS);
    let t0 = Instant::now();
    while metric(agent, INITS) <= inits {
        assert!(t0.elapsed() < Duration::from_secs(30), "the CNP watch never relisted");
        create_namespaces(client, &[namespace(&format!("bump{}", t0.elapsed().as_millis()), &[])]).await;
        srv.compact();
        srv.drop_watches();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}

/// Every write so far kept the tier entries: none removed one, and each
/// left at least `tiers`.
fn no_tier_entry_ever_removed(log: &Mutex<TierLog>, tiers: usize, when: &str) {
    let log = log.lock().unwrap();
    for (i, (full, removed, after)) in log.writes.iter().enumerate() {
        assert!(
            *removed == 0 && *after >= tiers,
            "{when}: write {i} (full: {full}) removed {removed} tier entries, left {after} of {tiers}: {:?}",
            log.writes
        );
    }
}

/// Create pod `k/<name>` (app=c) on node-a and wait for the write that
/// programs it (a completed sync after whatever the API server did).
async fn sync_with_a_new_pod(client: &kube::Client, log: &Mutex<TierLog>, name: &str, ip: &str) {
    let writes = log.lock().unwrap().writes.len();
    create_pods(client, vec![pod("k", name, "node-a", Some(ip), &[("app", "c")])], 1).await;
    wait_until("a sync programs the new pod", Duration::from_secs(20), || {
        log.lock().unwrap().writes.len() > writes
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_version_no_longer_served_is_read_at_the_served_one_without_a_gap() {
    let (srv, client, agent, log, tiers) = enforced("10.241").await;

    // The CRD upgrade: v1alpha2 no longer served, v1beta1 served (same
    // schema, the objects stay); every watch ends.
    srv.set_cnp_served_versions(&["v1beta1"]).expect("switch versions");
    // A Deny written through v1beta1 only: programmed once the agent reads v1beta1.
    let v1beta1 = ApiResource {
        group: "policy.networking.k8s.io".into(),
        version: "v1beta1".into(),
        api_version: "policy.networking.k8s.io/v1beta1".into(),
        kind: "ClusterNetworkPolicy".into(),
        plural: "clusternetworkpolicies".into(),
    };
    let mut obj = cnp("admin-no-b", "Admin", 20, "a", "Deny", "b", &[9000]);
    obj["apiVersion"] = "policy.networking.k8s.io/v1beta1".into();
    let obj: DynamicObject = serde_json::from_value(obj).unwrap();
    Api::<DynamicObject>::all_with(client.clone(), &v1beta1)
        .create(&PostParams::default(), &obj)
        .await
        .expect("create through v1beta1");
    wait_until(
        "the Deny created through v1beta1 is programmed",
        Duration::from_secs(40),
        || log.lock().unwrap().tiers > tiers,
    )
    .await;
    no_tier_entry_ever_removed(&log, tiers, "switching to v1beta1");
    // The guard's direct read reads v1beta1 too.
    let read = direct_read_with(&client, 100, ClusterPolicyMode::Auto)
        .await
        .expect("direct read");
    assert_eq!(read.cluster_policies.len(), 2, "both Denies, read at v1beta1");
    // A relist at v1beta1 keeps them too.
    force_relist(&srv, &client, &agent).await;
    sync_with_a_new_pod(&client, &log, "c", "10.241.3.2").await;
    no_tier_entry_ever_removed(&log, tiers, "relisted at v1beta1");
    assert_eq!(failing_check(&agent, CHECK_CLUSTER_POLICIES), None);
    assert!(agent.health.is_ready(), "{:?}", agent.health.readiness());
    assert_eq!(metric(&agent, UNKNOWN), 0.0);
    drop(agent);
    srv.shutdown().await;
}

/// Fail every CNP list at v1alpha2 with 404 (the CRD still serving it),
/// relist, and wait for the readiness reason (or a write that removed tier
/// entries, which fails the test): the reason.
async fn unknown_404(
    srv: &TestApiServer,
    client: &kube::Client,
    agent: &RunningAgent,
    log: &Mutex<TierLog>,
    tiers: usize,
) -> String {
    srv.inject(FaultRule::fail(100_000, 404).path(CNP_PATH).verb("list"));
    force_relist(srv, client, agent).await;
    wait_until("readiness says why", Duration::from_secs(30), || {
        failing_check(agent, CHECK_CLUSTER_POLICIES).is_some() || log.lock().unwrap().tiers < tiers
    })
    .await;
    no_tier_entry_ever_removed(log, tiers, "404 with the CRD served");
    failing_check(agent, CHECK_CLUSTER_POLICIES).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_while_the_crd_is_still_served_keeps_the_denies_and_is_unready() {
    let (srv, client, agent, log, tiers) = enforced("10.242").await;
    let why = unknown_404(&srv, &client, &agent, &log, tiers).await;
    assert!(why.contains("404") && why.contains("stay enforced"), "{why}");
    assert!(!agent.health.is_ready(), "unknown is not ready");
    assert!(metric(&agent, UNKNOWN) >= 1.0);
    sync_with_a_new_pod(&client, &log, "c", "10.242.3.2").await;
    no_tier_entry_ever_removed(&log, tiers, "404 with the CRD served");
    assert_eq!(metric(&agent, DEFERRED), 0.0, "nothing was even proposed for removal");

    // The API server is up: the list works, the agent is ready again.
    srv.clear_faults();
    wait_until("ready again", Duration::from_secs(60), || agent.health.is_ready()).await;
    assert_eq!(failing_check(&agent, CHECK_CLUSTER_POLICIES), None);
    sync_with_a_new_pod(&client, &log, "d", "10.242.4.2").await;
    no_tier_entry_ever_removed(&log, tiers, "after the 404s");

    // The same on the watch: every CNP request answers 404 and the watch
    // is dropped (its resumed watch gets the 404, not a 410).
    let unknown = metric(&agent, UNKNOWN);
    srv.inject(FaultRule::fail(100_000, 404).path(CNP_PATH));
    srv.drop_watches();
    wait_until("readiness says why (watch)", Duration::from_secs(30), || {
        metric(&agent, UNKNOWN) > unknown && failing_check(&agent, CHECK_CLUSTER_POLICIES).is_some()
    })
    .await;
    sync_with_a_new_pod(&client, &log, "e", "10.242.5.2").await;
    no_tier_entry_ever_removed(&log, tiers, "404 on the watch with the CRD served");
    srv.clear_faults();
    wait_until("ready again (watch)", Duration::from_secs(60), || {
        agent.health.is_ready()
    })
    .await;
    drop(agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_denies_go_only_once_discovery_confirms_the_crd_deleted() {
    let (srv, client, agent, log, tiers) = enforced("10.243").await;
    unknown_404(&srv, &client, &agent, &log, tiers).await;
    sync_with_a_new_pod(&client, &log, "c", "10.243.3.2").await;
    no_tier_entry_ever_removed(&log, tiers, "404 with the CRD served");
    // The guard's direct read fails the same way: a held removal would stay held.
    let read = direct_read_with(&client, 100, ClusterPolicyMode::Auto).await;
    assert!(
        matches!(read, Err(WatchError::ClusterPoliciesUnknown(_))),
        "{:?}",
        read.map(|r| r.cluster_policies.len())
    );

    // The CRD deleted: discovery confirms, the removal goes through the guard.
    let deferred = metric(&agent, DEFERRED);
    srv.uninstall_cnp_crd().expect("delete the CRD");
    wait_until("the Deny goes with its CRD", Duration::from_secs(60), || {
        log.lock().unwrap().tiers == 0
    })
    .await;
    assert!(
        metric(&agent, DEFERRED) > deferred,
        "the removal went through the guard"
    );
    wait_until("ready without the CRD", Duration::from_secs(30), || {
        agent.health.is_ready()
    })
    .await;
    assert_eq!(failing_check(&agent, CHECK_CLUSTER_POLICIES), None);
    let read = direct_read_with(&client, 100, ClusterPolicyMode::Auto)
        .await
        .expect("direct read");
    assert!(read.cluster_policies.is_empty(), "confirmed absent: none");
    drop(agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_agent_started_after_the_upgrade_reads_the_served_version() {
    let (srv, client) = server_with_pods("10.244", Some(CnpChannel::Standard)).await;
    create_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Deny", "a", &[])).await;
    srv.set_cnp_served_versions(&["v1beta1"]).expect("switch versions");
    let (dp, log) = TierWatch::new(RecordingDataplane::default());
    let agent = start_agent(agent_config(100), client.clone(), dp).await;
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    let writes = log.lock().unwrap().writes.clone();
    assert!(
        !writes.is_empty() && writes.iter().all(|(_, _, after)| *after > 0),
        "every write enforces the Deny read at v1beta1: {writes:?}"
    );
    assert!(agent.health.is_ready(), "{:?}", agent.health.readiness());
    drop(agent);
    srv.shutdown().await;
}

/// What `discover` answers, from the CRD and (when the agent may not read
/// CRDs: 403) from API discovery: the same in each server state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_reads_the_crd_or_falls_back_to_api_discovery() {
    use npm_agent::k8s::cluster_policy::{discover, Served};
    let (srv, client) = server_with_pods("10.245", Some(CnpChannel::Standard)).await;
    let crd_path = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions";
    let both = |want: fn(&Served) -> bool, what: &'static str| {
        let (srv, client) = (&srv, client.clone());
        async move {
            let from_crd = discover(&client).await.expect("discovery");
            assert!(want(&from_crd), "{what} (CRD): {from_crd:?}");
            srv.inject(FaultRule::fail(1, 403).path(crd_path).verb("get"));
            let from_apis = discover(&client).await.expect("discovery");
            assert!(want(&from_apis), "{what} (API discovery): {from_apis:?}");
            srv.clear_faults();
        }
    };
    both(|s| *s == Served::Version("v1alpha2"), "installed").await;
    srv.set_cnp_served_versions(&["v1alpha2", "v1beta1"]).unwrap();
    both(|s| *s == Served::Version("v1alpha2"), "both served: the first").await;
    srv.set_cnp_served_versions(&["v1beta1"]).unwrap();
    both(|s| *s == Served::Version("v1beta1"), "v1beta1 only").await;
    srv.set_cnp_served_versions(&[]).unwrap();
    both(|s| matches!(s, Served::Absent(_)), "none served").await;
    srv.uninstall_cnp_crd().unwrap();
    both(|s| matches!(s, Served::Absent(_)), "deleted").await;
    // Any other failure is no answer.
    srv.inject(FaultRule::fail(1, 500).path(crd_path).verb("get"));
    assert!(discover(&client).await.is_err());
    srv.shutdown().await;
}
