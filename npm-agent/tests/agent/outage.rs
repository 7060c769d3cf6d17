//! API server outage: every list and watch fails and open watches are
//! dropped for a while (`NPM_TEST_OUTAGE_SECS`, default 30 s as the issue
//! asks). Enforcement stays exactly as programmed during the
//! outage; afterwards the agent reconnects and catches up with the changes
//! made meanwhile.

use std::time::{Duration, Instant};

use crate::common::*;
use npm_testapi::FaultRule;

fn outage() -> Duration {
    let secs = std::env::var("NPM_TEST_OUTAGE_SECS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(30);
    Duration::from_secs(secs)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outage_keeps_enforcement_and_agent_catches_up() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("app", &[])]).await;
    create_policy(
        &client,
        "app",
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-all", "namespace": "app"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
        }),
    )
    .await
    .unwrap();
    let pods = (0..50)
        .map(|i| {
            pod(
                "app",
                &format!("p{i}"),
                if i < 10 { "node-a" } else { "node-b" },
                Some(&format!("10.66.0.{}", i + 1)),
                &[("app", "x")],
            )
        })
        .collect();
    create_pods(&client, pods, 16).await;

    let dp = RecordingDataplane::default();
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("synced", Duration::from_secs(20), || {
        agent.is_ready() && dp.lock().state.ipcache.len() == 50
    })
    .await;
    // Settled: the first sync may be followed by one that catches up with
    // watch events of the initial list; no write for a second, then the
    // outage starts (an agent that kept writing would fail here).
    let mut calls_before = dp.lock().calls.len();
    let settle = Instant::now();
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = dp.lock().calls.len();
        if now == calls_before {
            break;
        }
        assert!(
            settle.elapsed() < Duration::from_secs(10),
            "the agent keeps writing without a change"
        );
        calls_before = now;
    }
    let before = dp.lock().state.clone();

    // Outage: lists and watches fail, open watches are cut.
    srv.inject(FaultRule::fail(1_000_000, 503).verb("list"));
    srv.inject(FaultRule::fail(1_000_000, 503).verb("watch"));
    srv.drop_watches();
    // Changes made during the outage (writes still go through).
    create_pods(
        &client,
        (50..60)
            .map(|i| {
                pod(
                    "app",
                    &format!("p{i}"),
                    "node-a",
                    Some(&format!("10.66.0.{}", i + 1)),
                    &[("app", "x")],
                )
            })
            .collect(),
        8,
    )
    .await;
    delete_pods(
        &client,
        (45..50).map(|i| ("app".to_string(), format!("p{i}"))).collect(),
        8,
    )
    .await;

    let start = Instant::now();
    while start.elapsed() < outage() {
        {
            let r = dp.lock();
            assert_eq!(r.calls.len(), calls_before, "nothing is written during the outage");
            assert_eq!(r.state, before, "enforcement unchanged during the outage");
        }
        assert!(agent.is_ready(), "the last complete state stays in force");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(srv.stats().injected_failures > 0, "the outage was real");

    srv.clear_faults();
    let healed = Instant::now();
    wait_until("caught up", outage() + Duration::from_secs(45), || {
        let r = dp.lock();
        r.state.ipcache.len() == 55 && endpoint_with_ip(&r.state, "10.66.0.60").is_some()
    })
    .await;
    eprintln!(
        "outage of {:?}: caught up {:?} after the API server came back",
        outage(),
        healed.elapsed()
    );
    {
        let r = dp.lock();
        assert!(
            !r.state.ipcache.contains_key(&"10.66.0.50".parse().unwrap()),
            "deleted pod gone"
        );
        assert_eq!(r.state.endpoints.len(), 20);
        assert!(r.inconsistent.is_empty());
    }
    assert!(metric(&agent, "npm_errors_total{kind=\"watch\"}") >= 1.0);
    drop(agent);
    srv.shutdown().await;
}
