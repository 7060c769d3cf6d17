//! Without the ClusterNetworkPolicy CRD (the API answers 404 on
//! `clusternetworkpolicies`):
//!
//! - `--cluster-network-policies=auto` (the default): the agent becomes
//!   ready and enforces NetworkPolicy (real packets through the nftables
//!   dataplane of a private node namespace); the CRD installed later is
//!   picked up (an Admin Deny created then drops packets); the CRD deleted
//!   again empties the CNP list through the mass-removal guard (held, and
//!   confirmed by a direct read that also sees the 404);
//! - `on`: the agent is not ready and says why (nothing is programmed);
//! - a 403 on the list (RBAC) is never an empty list, whatever the mode:
//!   not ready, naming the ClusterRole, until the list works.
//!
//! The kernel test needs root; names carry the process id (netns
//! `npmcc<pid>{n,a,b}`).

use std::time::Duration;

use crate::cnp_support::*;
use crate::common::*;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, PostParams};
use npm_agent::k8s::cluster_policy::CHECK_CLUSTER_POLICIES;
use npm_agent::k8s::ClusterPolicyMode;
use npm_testapi::crd::CNP_CRD_STANDARD_YAML;
use npm_testapi::FaultRule;

const PREFIX: &str = "npmcc";
const CNP_PATH: &str = "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies";

fn crds(client: &kube::Client) -> Api<CustomResourceDefinition> {
    Api::all(client.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_crd_the_agent_is_ready_and_enforces_network_policy() {
    let net = NodeNet::new(PREFIX, "10.234");
    let (srv, client) = server_with_pods("10.234", None).await;
    let agent = net.agent(&client, net.nft(PREFIX), ClusterPolicyMode::Auto).await;
    wait_until("ready without the CRD", Duration::from_secs(20), || agent.is_ready()).await;
    assert_eq!(failing_check(&agent, CHECK_CLUSTER_POLICIES), None);
    assert!(agent.health.is_ready(), "{:?}", agent.health.readiness());
    net.expect(true, "no policy").await;
    create_policy(&client, "k", deny_b()).await.unwrap();
    net.expect(false, "NetworkPolicy isolates b").await;
    create_policy(&client, "k", allow_a()).await.unwrap();
    net.expect(true, "NetworkPolicy allows a").await;

    // The CRD installed later: CNPs are watched from then on.
    let crd: CustomResourceDefinition = serde_yaml::from_str(CNP_CRD_STANDARD_YAML).expect("vendored CRD");
    crds(&client)
        .create(&PostParams::default(), &crd)
        .await
        .expect("install the CRD");
    create_cnp(&client, cnp("admin-no-a", "Admin", 10, "b", "Deny", "a", &[])).await;
    wait_until_async(
        "the CNP is enforced once the CRD exists",
        Duration::from_secs(45),
        || async { net.connects(1).await == 0 },
    )
    .await;
    assert!(agent.health.is_ready(), "{:?}", agent.health.readiness());

    // The CRD deleted: its CNPs go (a removal of all of them, held until a
    // direct read, which sees the 404 as the empty list, confirms it).
    let deferred = metric(&agent, "npm_destructive_actions_deferred_total");
    crds(&client)
        .delete(&crd.metadata.name.clone().unwrap(), &DeleteParams::default())
        .await
        .expect("delete the CRD");
    net.expect(true, "the CNPs are gone with their CRD: the NetworkPolicy decides")
        .await;
    assert!(
        metric(&agent, "npm_destructive_actions_deferred_total") > deferred,
        "the removal went through the guard"
    );
    wait_until("ready again", Duration::from_secs(20), || agent.health.is_ready()).await;
    drop(agent);
    srv.shutdown().await;
    drop(net);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_on_a_missing_crd_keeps_the_agent_unready() {
    let (srv, client) = server_with_pods("10.235", None).await;
    let dp = RecordingDataplane::default();
    let mut cfg = agent_config(100);
    cfg.sync.cluster_policies = ClusterPolicyMode::On;
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;
    wait_until("the CNP check fails", Duration::from_secs(20), || {
        failing_check(&agent, CHECK_CLUSTER_POLICIES).is_some()
    })
    .await;
    let why = failing_check(&agent, CHECK_CLUSTER_POLICIES).unwrap();
    assert!(
        why.contains("CRD") && why.contains("--cluster-network-policies=on"),
        "{why}"
    );
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!agent.is_ready());
    assert!(
        dp.lock().calls.is_empty(),
        "nothing programmed from an incomplete state"
    );
    drop(agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forbidden_list_is_a_readiness_problem_not_an_empty_list() {
    let (srv, client) = server_with_pods("10.236", None).await;
    srv.inject(FaultRule::fail(100_000, 403).path(CNP_PATH).verb("list"));
    let dp = RecordingDataplane::default();
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("the CNP check fails", Duration::from_secs(20), || {
        failing_check(&agent, CHECK_CLUSTER_POLICIES).is_some()
    })
    .await;
    let why = failing_check(&agent, CHECK_CLUSTER_POLICIES).unwrap();
    assert!(why.contains("ClusterRole"), "{why}");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(!agent.is_ready(), "a 403 is not an empty list");
    assert!(
        dp.lock().calls.is_empty(),
        "nothing programmed from an incomplete state"
    );
    // RBAC fixed: the list (a 404 here, no CRD) completes at the next retry.
    srv.clear_faults();
    wait_until("ready once the list works", Duration::from_secs(40), || {
        agent.is_ready()
    })
    .await;
    assert_eq!(failing_check(&agent, CHECK_CLUSTER_POLICIES), None);
    assert!(!dp.lock().calls.is_empty());
    drop(agent);
    srv.shutdown().await;
}
