//! Issue 12 §5, "the sync runs on its own thread": with a dataplane whose
//! writes block for seconds (a long compile or syscall burst), the agent's
//! health endpoints keep answering and its watchers keep updating the
//! cache while a sync is under way. The test runs the agent on a
//! current-thread runtime: were the sync a task of that runtime, its
//! blocking write would stall every other task of the agent.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::common::process::http_get;
use crate::common::*;
use npm_agent::agent::start_with_health;
use npm_agent::reconcile::AgentDataplane;
use npm_agent::telemetry::{HealthConfig, Metrics};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{Compiled, CompiledDiff};

/// How long each write of [`SlowDataplane`] blocks its thread.
const WRITE_TIME: Duration = Duration::from_secs(3);

/// A recording dataplane whose every write blocks for [`WRITE_TIME`]
/// (`std::thread::sleep`: the thread is busy, as in a syscall burst).
#[derive(Clone, Default)]
struct SlowDataplane {
    inner: RecordingDataplane,
    writing: Arc<AtomicBool>,
    writes: Arc<AtomicUsize>,
}

impl SlowDataplane {
    fn write(&self, f: impl FnOnce() -> Result<(), DataplaneError>) -> Result<(), DataplaneError> {
        self.writing.store(true, Ordering::SeqCst);
        std::thread::sleep(WRITE_TIME);
        let r = f();
        self.writes.fetch_add(1, Ordering::SeqCst);
        self.writing.store(false, Ordering::SeqCst);
        r
    }
}

impl Dataplane for SlowDataplane {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        let mut inner = self.inner.clone();
        self.write(|| inner.sync_full(compiled, interfaces))
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        let mut inner = self.inner.clone();
        self.write(|| inner.apply(diff, next, interfaces))
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
}

impl AgentDataplane for SlowDataplane {}

/// `GET path` from a blocking thread (the runtime stays free).
async fn get(addr: SocketAddr, path: &'static str) -> Option<(u16, String)> {
    tokio::task::spawn_blocking(move || http_get(addr, path)).await.unwrap()
}

async fn wait_for(what: &str, timeout: Duration, cond: impl Fn() -> bool) {
    let start = Instant::now();
    while !cond() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Whether the agent's cache holds pod `k/<name>`.
fn cached(agent: &npm_agent::agent::RunningAgent, name: &str) -> bool {
    agent.cache.complete().is_some_and(|s| {
        s.pods
            .iter()
            .any(|p: &Arc<CachedPod>| p.metadata.name.as_deref() == Some(name))
    })
}

#[tokio::test(flavor = "current_thread")]
async fn health_and_watchers_answer_while_a_sync_blocks() {
    let (srv, client) = two_pod_server("10.219").await;
    let dp = SlowDataplane::default();
    let mut cfg = agent_config(100);
    cfg.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let agent = start_with_health(
        cfg,
        HealthConfig::default(),
        client.clone(),
        dp.clone(),
        Box::new(FixedResolver),
        Metrics::new().unwrap(),
    )
    .await
    .expect("start agent");
    let addr = agent.http_addr.unwrap();

    // The first sync (a full write) is under way and blocks its thread.
    wait_for("the first write to start", Duration::from_secs(10), || {
        dp.writing.load(Ordering::SeqCst)
    })
    .await;
    let busy_from = Instant::now();
    // Health answers, at once, each time.
    for path in ["/healthz", "/readyz?verbose", "/metrics"] {
        let t = Instant::now();
        let got = get(addr, path).await;
        assert!(got.is_some(), "{path} answers during a blocked sync");
        assert!(
            t.elapsed() < Duration::from_millis(500),
            "{path} took {:?} during a blocked sync",
            t.elapsed()
        );
    }
    assert_eq!(get(addr, "/healthz").await.unwrap().0, 200);
    assert_ne!(
        get(addr, "/readyz").await.unwrap().0,
        200,
        "not ready before the first sync"
    );
    // The watchers keep updating the cache.
    create_pods(
        &client,
        vec![pod("k", "c", "node-a", Some("10.219.3.2"), &[("app", "c")])],
        1,
    )
    .await;
    wait_for("the watcher to see pod c", Duration::from_secs(2), || {
        cached(&agent, "c")
    })
    .await;
    assert!(
        dp.writing.load(Ordering::SeqCst) && dp.writes.load(Ordering::SeqCst) == 0,
        "all of this happened while the first write was blocked ({:?} in)",
        busy_from.elapsed()
    );

    // The loop goes on: the first sync lands, then pod c is programmed.
    wait_for("ready", Duration::from_secs(20), || agent.is_ready()).await;
    wait_for("pod c programmed", Duration::from_secs(20), || {
        endpoint_with_ip(&dp.inner.lock().state, "10.219.3.2").is_some()
    })
    .await;
    assert_eq!(get(addr, "/readyz").await.unwrap().0, 200);
    drop(agent);
    srv.shutdown().await;
}
