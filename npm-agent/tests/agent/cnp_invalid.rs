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
