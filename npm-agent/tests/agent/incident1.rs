//! Incident 1 replay (IP ownership), through the real test API server and
//! compiler: pod A has an IP and an endpoint; A restarts (Running, IP
//! empty), the agent restarts, B comes up with A's old IP, and A's stale
//! status (its old IP) is written before B's create. B's endpoint must carry
//! only B's policies and A's old entries must be gone.

use std::time::Duration;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams};
use npm_policy::compiled::Compiled;

const IP: &str = "10.77.0.5";

fn identity_of(state: &Compiled, ip: &str) -> Option<u32> {
    state.ipcache.get(&ip.parse().unwrap()).map(|e| e.identity)
}

async fn set_pod_ip(client: &kube::Client, name: &str, ip: Option<&str>) {
    let api: Api<Pod> = Api::namespaced(client.clone(), "app");
    let status = match ip {
        Some(ip) => serde_json::json!({"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}),
        None => serde_json::json!({"status": {"phase": "Running", "podIP": null, "podIPs": null}}),
    };
    api.patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("patch status of {name}: {e}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_pod_never_takes_the_ip_of_the_live_one() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("app", &[])]).await;
    for (name, app, port) in [("allow-a", "a", 8080), ("allow-b", "b", 9090)] {
        create_policy(
            &client,
            "app",
            serde_json::json!({
                "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
                "metadata": {"name": name, "namespace": "app"},
                "spec": {"podSelector": {"matchLabels": {"app": app}},
                         "ingress": [{"ports": [{"port": port}]}]}
            }),
        )
        .await
        .unwrap();
    }
    create_pods(&client, vec![pod("app", "a", "node-a", Some(IP), &[("app", "a")])], 1).await;

    let dp = RecordingDataplane::default();
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("A's endpoint programmed", Duration::from_secs(20), || {
        endpoint_with_ip(&dp.lock().state, IP).is_some_and(|(_, p)| p == "app/a")
    })
    .await;
    {
        let r = dp.lock();
        let (ep, _) = endpoint_with_ip(&r.state, IP).unwrap();
        assert_eq!(policies_of_endpoint(&r.state, ep), ["app/allow-a".to_string()].into());
    }

    // A restarts: Running with an empty IP. Its old IP is evicted.
    set_pod_ip(&client, "a", None).await;
    wait_until("A's IP evicted", Duration::from_secs(20), || {
        let r = dp.lock();
        identity_of(&r.state, IP).is_none() && endpoint_with_ip(&r.state, IP).is_none()
    })
    .await;
    assert_eq!(
        metric(
            &agent,
            "npm_controller_pod_event_total{operation=\"update-with-empty-ip\"}"
        ),
        1.0
    );

    // The agent restarts (the "pinned" state stays in the recording dataplane).
    drop(agent);
    // creationTimestamp has one-second resolution: B must be newer than A.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    // A's stale status (its old IP) is processed before B's create.
    set_pod_ip(&client, "a", Some(IP)).await;
    create_pods(&client, vec![pod("app", "b", "node-a", Some(IP), &[("app", "b")])], 1).await;

    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("agent ready again", Duration::from_secs(20), || agent.is_ready()).await;
    {
        let r = dp.lock();
        assert!(
            r.calls.last().is_some_and(|c| c.full),
            "a restarted agent reconciles with sync_full"
        );
        let (ep, owner) = endpoint_with_ip(&r.state, IP).expect("the IP has an endpoint");
        assert_eq!(owner, "app/b", "the live pod owns the IP");
        assert_eq!(
            policies_of_endpoint(&r.state, ep),
            ["app/allow-b".to_string()].into(),
            "only B's policies"
        );
        let b_identity = identity_of(&r.state, IP).expect("ipcache entry");
        let b_key = &r.state.ids.identities[&b_identity];
        assert_eq!(b_key.pod_labels.get("app").map(String::as_str), Some("b"));
        assert_eq!(
            r.state
                .endpoints
                .values()
                .filter(|e| e.ipv4.map(|v| v.to_string()) == Some(IP.to_string()))
                .count(),
            1,
            "one endpoint per IP"
        );
    }
    assert!(
        metric(&agent, "npm_ip_conflicts_total") >= 1.0,
        "the conflict was counted"
    );
    drop(agent);
    srv.shutdown().await;
}
