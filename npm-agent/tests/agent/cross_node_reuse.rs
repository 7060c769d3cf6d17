//! Incident 1 across nodes: a pod of another node is deleted and its
//! address may be given to a new pod at once, whose status has not reached
//! this agent yet. The deleting pod keeps its address's identity only for
//! its grace period (on this agent's clock) plus the slack; then the
//! address carries no pod identity, with no other change from the API
//! server, until its next owner arrives and takes it.

use std::time::{Duration, Instant};

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};

const OLD_IP: &str = "10.77.1.5";

fn identity_of(state: &npm_policy::compiled::Compiled, ip: &str) -> Option<u32> {
    state.ipcache.get(&ip.parse().unwrap()).map(|e| e.identity)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleting_remote_pod_loses_its_address_after_its_grace_period() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("app", &[])]).await;
    create_policy(
        &client,
        "app",
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "from-old", "namespace": "app"},
            "spec": {"podSelector": {"matchLabels": {"app": "b"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "old"}}}]}]}
        }),
    )
    .await
    .unwrap();
    create_pods(
        &client,
        vec![
            pod("app", "b", "node-a", Some("10.77.0.9"), &[("app", "b")]),
            pod("app", "old", "node-b", Some(OLD_IP), &[("app", "old")]),
        ],
        2,
    )
    .await;
    let dp = RecordingDataplane::default();
    let mut cfg = agent_config(100);
    cfg.sync.deleting_claim_slack = Duration::from_secs(1);
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;
    wait_until("the remote pod's address programmed", Duration::from_secs(20), || {
        identity_of(&dp.lock().state, OLD_IP).is_some()
    })
    .await;
    let old_identity = identity_of(&dp.lock().state, OLD_IP).unwrap();

    // The pod is deleted with a 2 s grace period (as the API server marks
    // a graceful deletion) and nothing else happens.
    let api: Api<Pod> = Api::namespaced(client.clone(), "app");
    let deleted = Instant::now();
    api.patch(
        "old",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {
            "deletionTimestamp": "2026-01-01T00:00:00Z",
            "deletionGracePeriodSeconds": 2,
        }})),
    )
    .await
    .expect("mark the pod deleting");
    // Within its grace period the deleting pod still owns its address.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(
        deleted.elapsed() < Duration::from_secs(3),
        "the check ran too late to mean anything"
    );
    assert_eq!(identity_of(&dp.lock().state, OLD_IP), Some(old_identity));
    assert_eq!(metric(&agent, "npm_deleting_claims_expired"), 0.0);
    // Past grace and slack: the address carries no pod identity.
    wait_until("the claim expired", Duration::from_secs(20), || {
        identity_of(&dp.lock().state, OLD_IP).is_none()
    })
    .await;
    assert!(
        deleted.elapsed() >= Duration::from_secs(3),
        "expired before grace + slack"
    );
    assert_eq!(metric(&agent, "npm_deleting_claims_expired"), 1.0);

    // The next owner arrives and takes the address with its own identity.
    create_pods(
        &client,
        vec![pod("app", "new", "node-b", Some(OLD_IP), &[("app", "new")])],
        1,
    )
    .await;
    wait_until("the new owner's identity", Duration::from_secs(20), || {
        identity_of(&dp.lock().state, OLD_IP).is_some_and(|id| id != old_identity)
    })
    .await;
    drop(agent);
    srv.shutdown().await;
}
