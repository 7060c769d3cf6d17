//! `/readyz` and `/healthz` tell the truth, on a running agent
//! (real test API server, real compiler, a recording dataplane that can be
//! made to fail): not ready before the first full sync, with each check's
//! reason in `/readyz?verbose`; ready after it (plain `200 ready`); not
//! ready again while applies fail several times in a row, while a kernel
//! map is full, and while a mass removal has been held longer than the
//! limit; ready again once a sync goes through. `/healthz` answers 200 on
//! a live agent (the watchdog's stall case is unit-tested with an injected
//! clock in `telemetry::health`).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;
use npm_agent::agent::{start_with_health, RunningAgent};
use npm_agent::reconcile::AgentDataplane;
use npm_agent::telemetry::{HealthConfig, Metrics};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{Compiled, CompiledDiff};
use npm_testapi::FaultRule;
/// How the flaky dataplane fails its writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// A kernel error.
    Kernel,
    /// The policy map is full.
    MapFull,
}

/// The recording dataplane, failing every write while `fail` is set.
#[derive(Clone, Default)]
struct FlakyDataplane {
    inner: RecordingDataplane,
    fail: Arc<Mutex<Option<Failure>>>,
}

impl FlakyDataplane {
    fn set(&self, f: Option<Failure>) {
        *self.fail.lock().unwrap() = f;
    }
    fn check(&self) -> Result<(), DataplaneError> {
        match *self.fail.lock().unwrap() {
            None => Ok(()),
            Some(Failure::Kernel) => Err(DataplaneError::Kernel {
                op: "apply (flaky dataplane)".into(),
                detail: "injected failure".into(),
            }),
            Some(Failure::MapFull) => Err(DataplaneError::MapFull {
                map: "NPM_POLICY",
                source: npm_dataplane::ebpf::EbpfError::MapMissing { map: "NPM_POLICY" },
            }),
        }
    }
}

impl Dataplane for FlakyDataplane {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.check()?;
        self.inner.sync_full(compiled, interfaces)
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.check()?;
        self.inner.apply(diff, next, interfaces)
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
}

impl AgentDataplane for FlakyDataplane {}

/// An agent with the HTTP server on a free port and the health settings `health`.
async fn agent_with(client: &kube::Client, dp: impl AgentDataplane + 'static, health: HealthConfig) -> RunningAgent {
    let mut cfg = agent_config(100);
    cfg.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    start_with_health(
        cfg,
        health,
        client.clone(),
        dp,
        Box::new(FixedResolver),
        Metrics::new().unwrap(),
    )
    .await
    .expect("start agent")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readyz_names_each_check_before_and_after_the_first_sync() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("app", &[])]).await;
    create_pods(
        &client,
        vec![pod("app", "a", "node-a", Some("10.56.0.2"), &[("app", "a")])],
        1,
    )
    .await;
    // The pods list never completes: no first sync.
    srv.inject(FaultRule::fail(1_000_000, 500).path("/api/v1/pods").verb("list"));
    let agent = agent_with(&client, RecordingDataplane::default(), HealthConfig::default()).await;
    let addr = agent.http_addr.unwrap();
    wait_until_async("namespaces listed", Duration::from_secs(10), || async {
        agent.cache.namespaces.lock().unwrap().is_listed()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;

    let (code, body) = get(addr, "/readyz?verbose").await;
    assert_eq!(code, 503, "{body}");
    assert_eq!(
        body,
        "[-]lists failed: no complete list yet of pods\n\
         [-]first-sync failed: no full sync applied yet\n\
         [+]held-removal ok\n\
         [+]apply-failures ok\n\
         [+]map-capacity ok\n\
         readyz check failed\n"
    );
    let (code, body) = get(addr, "/readyz").await;
    assert_eq!(code, 503);
    assert!(body.contains("lists complete=false"), "{body}");
    assert!(body.contains("failed checks: lists, first-sync"), "{body}");
    let (code, body) = get(addr, "/healthz?verbose").await;
    assert_eq!((code, body.as_str()), (200, "[+]sync-loop ok\nhealthz check passed\n"));
    assert_eq!(metric(&agent, "npm_ready"), 0.0);
    assert_eq!(metric(&agent, "npm_readiness_failures{check=\"first-sync\"}"), 1.0);

    srv.clear_faults();
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    assert_eq!(get(addr, "/readyz").await, (200, "ready\n".to_string()));
    let (code, body) = get(addr, "/readyz?verbose").await;
    assert_eq!(code, 200);
    assert_eq!(
        body,
        "[+]lists ok\n[+]first-sync ok\n[+]held-removal ok\n[+]apply-failures ok\n[+]map-capacity ok\nreadyz check passed\n"
    );
    assert_eq!(get(addr, "/healthz").await, (200, "ok\n".to_string()));
    assert_eq!(metric(&agent, "npm_ready"), 1.0);
    assert_eq!(metric(&agent, "npm_readiness_failures{check=\"first-sync\"}"), 0.0);
    assert_eq!(metric(&agent, "npm_held_removals"), 0.0);
    assert!(metric(&agent, "npm_last_sync_success_timestamp_seconds") > 1.7e9);
    drop(agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_applies_and_a_full_map_make_it_unready_until_an_apply_succeeds() {
    let (srv, client) = two_pod_server("10.57").await;
    let dp = FlakyDataplane::default();
    let agent = agent_with(&client, dp.clone(), HealthConfig::default()).await;
    let addr = agent.http_addr.unwrap();
    wait_readyz(addr, 200, "readyz check passed", Duration::from_secs(30)).await;

    // Every write fails: after 3 in a row (retries back off from 100 ms) the
    // agent is not ready, with the last error.
    dp.set(Some(Failure::Kernel));
    create_policy(&client, "k", deny_b()).await.unwrap();
    let body = wait_readyz(
        addr,
        503,
        "applies failed in a row (limit 3); last: apply (flaky dataplane): injected failure",
        Duration::from_secs(20),
    )
    .await;
    assert!(body.contains("[-]apply-failures failed: "), "{body}");
    assert!(body.contains("[+]map-capacity ok"), "{body}");
    dp.set(None);
    wait_readyz(addr, 200, "[+]apply-failures ok", Duration::from_secs(20)).await;
    assert_eq!(get(addr, "/readyz").await, (200, "ready\n".to_string()));

    // A full map: unready from the first failure on.
    dp.set(Some(Failure::MapFull));
    create_policy(&client, "k", allow_a()).await.unwrap();
    wait_readyz(
        addr,
        503,
        "[-]map-capacity failed: map NPM_POLICY is full",
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(metric(&agent, "npm_readiness_failures{check=\"map-capacity\"}"), 1.0);
    dp.set(None);
    wait_readyz(addr, 200, "[+]map-capacity ok", Duration::from_secs(20)).await;
    assert_eq!(metric(&agent, "npm_ready"), 1.0);
    drop(agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removal_held_longer_than_the_limit_makes_it_unready() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("web", &[])]).await;
    let pods = (0..4)
        .map(|i| {
            pod(
                "web",
                &format!("p{i}"),
                "node-a",
                Some(&format!("10.58.0.{}", i + 2)),
                &[("app", "web")],
            )
        })
        .collect();
    create_pods(&client, pods, 4).await;
    let dp = RecordingDataplane::default();
    let health = HealthConfig {
        max_held_removal: Duration::from_secs(1),
        ..HealthConfig::default()
    };
    let agent = agent_with(&client, dp.clone(), health).await;
    let addr = agent.http_addr.unwrap();
    wait_readyz(addr, 200, "readyz check passed", Duration::from_secs(30)).await;
    assert_eq!(dp.lock().state.endpoints.len(), 4);

    // 3 of the 4 endpoints go while direct reads fail: the removal is held.
    srv.inject(FaultRule::fail(1_000_000, 500).path("/api/v1/pods").verb("list"));
    delete_pods(&client, (1..4).map(|i| ("web".into(), format!("p{i}"))).collect(), 3).await;
    wait_until("removal held", Duration::from_secs(20), || {
        metric(&agent, "npm_held_removals") == 1.0
    })
    .await;
    let body = wait_readyz(
        addr,
        503,
        "[-]held-removal failed: a removal has been held for ",
        Duration::from_secs(20),
    )
    .await;
    assert!(body.contains("(limit 1s): "), "{body}");
    assert!(body.contains("3/4 endpoints would be removed"), "{body}");
    assert_eq!(dp.lock().state.endpoints.len(), 4, "nothing removed while held");

    // The direct read works again and confirms: removed, ready again.
    srv.clear_faults();
    wait_readyz(addr, 200, "[+]held-removal ok", Duration::from_secs(60)).await;
    assert_eq!(dp.lock().state.endpoints.len(), 1);
    assert_eq!(metric(&agent, "npm_held_removals"), 0.0);
    drop(agent);
    srv.shutdown().await;
}
