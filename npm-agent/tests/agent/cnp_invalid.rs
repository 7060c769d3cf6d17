//! A ClusterNetworkPolicy the agent does not fully understand (an egress
//! peer with no field this agent knows: a field of a newer API version; the
//! server's validation is off so that it is stored as written) is enforced
//! failing closed and reported: logged, counted in
//! `npm_invalid_cluster_network_policies` and `npm_policy_errors_total`,
//! and a `PolicyPartiallyInvalid` Warning Event on the CNP (namespace
//! `default`, as for every cluster-scoped object) names the field. Through
//! the real agent, test API server (standard CRD) and compiler, with a
//! recording dataplane.

use std::time::Duration;

use crate::cnp_support::*;
use crate::common::*;
use k8s_openapi::api::core::v1::Event;
use kube::api::{Api, ListParams};
use npm_testapi::CnpChannel;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_cnp_is_reported_with_an_event() {
    let (srv, client) = server_with_pods("10.238", Some(CnpChannel::Standard)).await;
    let dp = RecordingDataplane::default();
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    assert_eq!(metric(&agent, "npm_invalid_cluster_network_policies"), 0.0);
    srv.set_validation(false);
    create_cnp(
        &client,
        json!({
            "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": "to-future"},
            "spec": {
                "tier": "Admin", "priority": 3,
                "subject": {"namespaces": {}},
                "egress": [{"action": "Deny", "to": [{"futurePeer": {"zone": "z1"}}]}]
            }
        }),
    )
    .await;
    wait_until("reported", Duration::from_secs(10), || {
        metric(&agent, "npm_invalid_cluster_network_policies") == 1.0
    })
    .await;
    assert!(metric(&agent, "npm_policy_errors_total") >= 1.0);
    let events: Api<Event> = Api::namespaced(client.clone(), "default");
    let mut found = None;
    for _ in 0..100 {
        let list = events.list(&ListParams::default()).await.unwrap();
        found = list
            .items
            .into_iter()
            .find(|e| e.involved_object.name.as_deref() == Some("to-future"));
        if found.is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = found.expect("an Event on the CNP in namespace default");
    assert_eq!(e.involved_object.kind.as_deref(), Some("ClusterNetworkPolicy"));
    assert_eq!(
        e.involved_object.api_version.as_deref(),
        Some("policy.networking.k8s.io/v1alpha2")
    );
    assert_eq!(e.involved_object.namespace, None);
    assert_eq!(e.reason.as_deref(), Some("PolicyPartiallyInvalid"));
    assert_eq!(e.type_.as_deref(), Some("Warning"));
    let m = e.message.unwrap_or_default();
    assert!(m.contains("spec.egress[0].to[0]") && m.contains("fails closed"), "{m}");
    delete_cnp(&client, "to-future").await;
    wait_until("no longer reported", Duration::from_secs(20), || {
        metric(&agent, "npm_invalid_cluster_network_policies") == 0.0
    })
    .await;
    drop(agent);
    srv.shutdown().await;
}

/// The readiness check `cluster-policy-subjects` of the agent.
fn subjects_check(agent: &npm_agent::agent::RunningAgent) -> Option<String> {
    agent
        .health
        .readiness()
        .into_iter()
        .find(|c| c.name == npm_agent::telemetry::health::CHECK_CLUSTER_POLICY_SUBJECTS)
        .and_then(|c| c.failure)
}

fn admin_deny(name: &str, subject: serde_json::Value) -> serde_json::Value {
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": {
            "tier": "Admin", "priority": 4,
            "subject": subject,
            "ingress": [{"action": "Deny", "from": [{"namespaces": {}}]}]
        }
    })
}

/// A ClusterNetworkPolicy whose subject was never understood selects no
/// pod: the agent's readiness says so, by name, until its subject is
/// fixed. One whose last valid subject stays enforced is not reported so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cnp_that_never_had_a_valid_subject_fails_readiness() {
    let (srv, client) = server_with_pods("10.239", Some(CnpChannel::Standard)).await;
    let agent = start_agent(agent_config(100), client.clone(), RecordingDataplane::default()).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    srv.set_validation(false);
    // Valid first (compiled: its tier entries programmed), then a subject
    // of a newer API version: the last valid version stays enforced;
    // readiness holds.
    create_cnp(&client, admin_deny("kept", json!({"namespaces": {}}))).await;
    wait_until("the valid version programmed", Duration::from_secs(10), || {
        metric(&agent, "npm_compiled_entries{table=\"tiers\"}") > 0.0
    })
    .await;
    replace_cnp(&client, admin_deny("kept", json!({"futureSubject": {"zone": "z1"}}))).await;
    wait_until("reported invalid", Duration::from_secs(10), || {
        metric(&agent, "npm_invalid_cluster_network_policies") == 1.0
    })
    .await;
    assert_eq!(subjects_check(&agent), None);
    assert!(agent.health.is_ready());
    let tiers = || metric(&agent, "npm_compiled_entries{table=\"tiers\"}");
    let kept = tiers();
    assert!(kept > 0.0, "the last valid version stays enforced");
    // Never valid: not ready, by name.
    create_cnp(&client, admin_deny("typo", json!({"futureSubject": {"zone": "z1"}}))).await;
    wait_until("not ready", Duration::from_secs(10), || !agent.health.is_ready()).await;
    let why = subjects_check(&agent).expect("the subjects check fails");
    assert!(why.contains("typo") && !why.contains("kept"), "{why}");
    assert!(why.contains("selects no pod"), "{why}");
    // The kept version survives the syncs since, their full-compile
    // cross-checks (every sync in a debug build) and a rebuild: the full
    // compile agrees, nothing was rebuilt without it.
    for i in 0..3 {
        let syncs = metric(&agent, "npm_syncs_total");
        let ip = format!("10.239.9.{}", i + 1);
        create_pods(
            &client,
            vec![pod("k", &format!("more-{i}"), "node-b", Some(&ip), &[("app", "a")])],
            1,
        )
        .await;
        wait_until("another sync", Duration::from_secs(10), || {
            metric(&agent, "npm_syncs_total") > syncs
        })
        .await;
    }
    assert_eq!(tiers(), kept, "the kept version's entries stay programmed");
    assert_eq!(metric(&agent, "npm_incremental_mismatch_total"), 0.0);
    // Its subject fixed: ready again.
    replace_cnp(&client, admin_deny("typo", json!({"namespaces": {}}))).await;
    wait_until("ready again", Duration::from_secs(10), || agent.health.is_ready()).await;
    assert_eq!(subjects_check(&agent), None);
    drop(agent);
    srv.shutdown().await;
}
