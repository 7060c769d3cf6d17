//! Incident 2: partial-cache safety, through the real test API server and
//! the real compiler, with a recording dataplane.
//!
//! 3,000 pods are listed with page size 100 while the server compacts its
//! history mid-list (the next continue token answers 410 Gone). The agent
//! must program nothing from the partial list, relist, and program all
//! 3,000. Then a mass disappearance is held by the guard and confirmed by a
//! direct read, and a cache that (wrongly) lost most pods is overruled by the
//! direct read so nothing live is deleted.

use std::sync::Arc;
use std::time::Duration;

use crate::common::*;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::Event;
use npm_agent::k8s::{direct_read, Cache};
use npm_agent::reconcile::{AgentDataplane, SyncError, Syncer};
use npm_agent::telemetry::Metrics;
use npm_testapi::FaultRule;

const PODS: usize = 3000;

fn pod_ip(i: usize) -> String {
    format!("10.{}.{}.{}", 20 + i / 65536, (i / 256) % 256, i % 256)
}

/// 3,000 pods in namespace `big`, 60 per `app` label (50 identities); the
/// first 20 are on this node (`node-a`).
fn big_pods() -> Vec<Pod> {
    (0..PODS)
        .map(|i| {
            let node = if i < 20 { "node-a" } else { "node-b" };
            let app = format!("g{}", i / 60);
            pod("big", &format!("p{i}"), node, Some(&pod_ip(i)), &[("app", &app)])
        })
        .collect()
}

/// A test API server holding namespace `big` and the first 300 `big_pods`.
async fn server_with_300_pods() -> (npm_testapi::TestApiServer, kube::Client) {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("big", &[])]).await;
    let pods: Vec<Pod> = big_pods().into_iter().take(300).collect();
    create_pods(&client, pods, 64).await;
    (srv, client)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partial_list_is_never_programmed_and_mass_deletion_is_confirmed() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("big", &[])]).await;
    create_policy(
        &client,
        "big",
        serde_json::json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "allow-g0", "namespace": "big"},
            "spec": {"podSelector": {"matchLabels": {"app": "g0"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "g1"}}}]}]}
        }),
    )
    .await
    .unwrap();
    create_pods(&client, big_pods(), 64).await;

    // Slow the pod list down so that the compaction lands mid-list.
    srv.inject(
        FaultRule::delay(40, Duration::from_millis(40))
            .path("/api/v1/pods")
            .verb("list"),
    );
    let dp = RecordingDataplane::default();
    let mut cfg = agent_config(100);
    cfg.sync.debounce = Duration::from_millis(400);
    let before_lists = srv.stats().by_verb.get("list").copied().unwrap_or(0);
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;

    // Wait until a few pages are in, then write (so the list's revision is
    // older than the head) and compact: the next continue answers 410.
    // Namespaces, NetworkPolicies, ClusterNetworkPolicies, Nodes, then
    // two pod pages (a page is counted when it arrives, served 40 ms later).
    wait_until("6 lists made", Duration::from_secs(20), || {
        srv.stats().by_verb.get("list").copied().unwrap_or(0) >= before_lists + 6
    })
    .await;
    assert!(dp.lock().calls.is_empty(), "nothing programmed mid-list");
    create_namespaces(&client, &[namespace("bump", &[])]).await;
    srv.compact();

    wait_until("agent ready", Duration::from_secs(60), || agent.is_ready()).await;
    {
        let r = dp.lock();
        assert_eq!(r.calls[0].full as u8, 1, "first write is a sync_full");
        assert_eq!(r.calls[0].ipcache_after, PODS, "first write carries the complete list");
        assert!(
            r.calls
                .iter()
                .all(|c| c.ipcache_removed == 0 && c.endpoints_removed == 0),
            "{:?}",
            r.calls
        );
        assert_eq!(r.state.ipcache.len(), PODS);
        assert_eq!(r.state.endpoints.len(), 20);
        assert!(r.inconsistent.is_empty(), "{:?}", r.inconsistent);
    }
    let pods_inits = metric(&agent, "npm_watch_events_total{resource=\"pods\",event=\"init\"}");
    assert!(
        pods_inits >= 2.0,
        "the pod list restarted after 410 (inits: {pods_inits})"
    );
    assert!(
        metric(&agent, "npm_errors_total{kind=\"watch\"}") >= 1.0,
        "the 410 was seen"
    );
    assert_eq!(
        metric(&agent, "npm_controller_pod_event_total{operation=\"create\"}"),
        PODS as f64
    );

    // Mass disappearance: 2,000 pods (33 of 50 identities, 20 of 20 local
    // endpoints) are really deleted. The guard holds it and confirms with a
    // direct read before applying.
    let lists_before_guard = srv.stats().by_verb.get("list").copied().unwrap_or(0);
    let doomed: Vec<_> = (0..2000).map(|i| ("big".to_string(), format!("p{i}"))).collect();
    delete_pods(&client, doomed, 64).await;
    wait_until("deletion programmed", Duration::from_secs(60), || {
        dp.lock().state.ipcache.len() == PODS - 2000
    })
    .await;
    assert!(metric(&agent, "npm_destructive_actions_deferred_total") >= 1.0);
    let direct_lists = srv.stats().by_verb.get("list").copied().unwrap_or(0) - lists_before_guard;
    assert!(
        direct_lists >= 3,
        "a direct read of the three resources happened ({direct_lists} lists)"
    );
    assert_eq!(dp.lock().state.endpoints.len(), 0);
    drop(agent);
    srv.shutdown().await;
}

/// A cache that lost most pods (as a controller trusting a partial list
/// would) never deletes live pods: the guard's direct read overrules it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfirmed_mass_deletion_is_not_applied() {
    let (srv, client) = server_with_300_pods().await;

    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    let dp = RecordingDataplane::default();
    let mut syncer = test_syncer(&cache, dp.clone(), &client).build();

    // Feed the cache a full list, as the watchers would.
    let state = direct_read(&client, 100).await.unwrap();
    let first30: std::collections::BTreeSet<_> = state.pods.iter().take(30).map(|p| p.metadata.name.clone()).collect();
    feed_cache(&cache, &state, |_| true);
    let first = syncer.sync_once().await.unwrap();
    assert!(first.full && !first.guarded);
    assert_eq!(dp.lock().state.ipcache.len(), 300);

    // The cache now believes only 30 pods exist.
    feed_cache(&cache, &state, |p| first30.contains(&p.metadata.name));
    let out = syncer.sync_once().await.unwrap();
    assert!(out.guarded, "the guard fired");
    {
        let r = dp.lock();
        assert_eq!(r.state.ipcache.len(), 300, "the direct read kept every live pod");
        assert!(r.calls.iter().all(|c| c.ipcache_removed == 0));
    }
    assert_eq!(
        npm_agent::telemetry::sample(&metrics.render(), "npm_destructive_actions_deferred_total"),
        Some(1.0)
    );

    // With the API server failing, a held deletion programs nothing.
    srv.inject(FaultRule::fail(1000, 503));
    let err = syncer.sync_once().await.unwrap_err();
    assert!(err.to_string().contains("mass deletion held"), "{err}");
    assert_eq!(dp.lock().state.ipcache.len(), 300);
    srv.clear_faults();
    srv.shutdown().await;
}

/// 100 pods in namespace `gradual`, each with a label of its own (100 pod
/// identities); the first 20 are on this node (20 endpoints).
fn gradual_pods() -> Vec<Pod> {
    (0..100)
        .map(|i| {
            let node = if i < 20 { "node-a" } else { "node-b" };
            let app = format!("a{i}");
            pod(
                "gradual",
                &format!("g{i}"),
                node,
                Some(&format!("10.30.0.{}", i + 1)),
                &[("app", &app)],
            )
        })
        .collect()
}

/// Whether pod `g<i>` of `gradual_pods` is left after `step` steps of 10
/// (those with `i % 10 >= step`): each step removes 10 identities and 2
/// endpoints.
fn left_after(p: &CachedPod, step: usize) -> bool {
    let name = p.metadata.name.as_deref().unwrap_or("");
    let i: usize = name.trim_start_matches('g').parse().unwrap();
    i % 10 >= step
}

/// A syncer over a recording dataplane, its cache fed by hand (as the
/// watchers would, with complete lists), and the metrics.
struct GradualSetup {
    /// The server's objects of `gradual_pods`.
    all: Vec<CachedPod>,
    cache: Arc<Cache>,
    metrics: Metrics,
    dp: RecordingDataplane,
    syncer: Syncer<RecordingDataplane>,
}

async fn gradual_setup(client: &kube::Client) -> GradualSetup {
    create_namespaces(client, &[namespace("gradual", &[])]).await;
    create_pods(client, gradual_pods(), 32).await;
    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    let dp = RecordingDataplane::default();
    let syncer = test_syncer(&cache, dp.clone(), client).build();
    let state = direct_read(client, 100).await.unwrap();
    cache.handle::<Namespace>(Event::Init);
    for n in &state.namespaces {
        cache.handle(Event::InitApply((**n).clone()));
    }
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    cache.handle::<NetworkPolicy>(Event::InitDone);
    let s = GradualSetup {
        all: state.pods.iter().map(|p| (**p).clone()).collect(),
        cache,
        metrics,
        dp,
        syncer,
    };
    s.feed(&s.after_steps(0));
    s
}

impl GradualSetup {
    /// The pod store's complete list becomes `pods`.
    fn feed(&self, pods: &[CachedPod]) {
        self.cache.handle::<CachedPod>(Event::Init);
        for p in pods {
            self.cache.handle(Event::InitApply(p.clone()));
        }
        self.cache.handle::<CachedPod>(Event::InitDone);
    }

    /// The server's pods left after `step` steps (see `left_after`).
    fn after_steps(&self, step: usize) -> Vec<CachedPod> {
        self.all.iter().filter(|p| left_after(p, step)).cloned().collect()
    }

    fn deferred(&self) -> f64 {
        npm_agent::telemetry::sample(&self.metrics.render(), "npm_destructive_actions_deferred_total").unwrap_or(0.0)
    }

    /// (ipcache entries, endpoints) in the recording dataplane.
    fn programmed(&self) -> (usize, usize) {
        let r = self.dp.lock();
        (r.state.ipcache.len(), r.state.endpoints.len())
    }
}

/// A cache that loses identities and endpoints in small steps (10% of the
/// original per sync, each step below the 50% threshold against the state
/// before it) is held once the cumulative loss crosses 50%: the held step
/// removes nothing, and the direct read (the server still has every pod)
/// restores what the cache lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradual_mass_deletion_is_held_when_cumulative_share_crosses() {
    let (srv, client) = server(true).await;
    let mut s = gradual_setup(&client).await;
    let first = s.syncer.sync_once().await.unwrap();
    assert!(first.full && !first.guarded);
    assert_eq!(s.programmed(), (100, 20));

    // Steps 1-5: 10 identities and 2 endpoints fewer each; the cumulative
    // loss reaches 50% (not more): applied, not held.
    for step in 1..=5 {
        s.feed(&s.after_steps(step));
        let out = s.syncer.sync_once().await.unwrap();
        assert!(!out.guarded, "step {step} is below the threshold");
        assert_eq!(s.programmed(), (100 - 10 * step, 20 - 2 * step), "step {step}");
    }
    assert_eq!(s.deferred(), 0.0);

    // Step 6: 50 -> 40 identities is 20% in one step but 60% of the
    // high-water 100: held and confirmed with a direct read.
    let calls_before = s.dp.lock().calls.len();
    s.feed(&s.after_steps(6));
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "the cumulative guard fired");
    assert_eq!(s.deferred(), 1.0);
    {
        let r = s.dp.lock();
        let calls = &r.calls[calls_before..];
        assert!(!calls.is_empty());
        assert!(
            calls.iter().all(|c| c.ipcache_removed == 0 && c.endpoints_removed == 0),
            "nothing removed by the held sync: {calls:?}"
        );
        assert!(r.inconsistent.is_empty(), "{:?}", r.inconsistent);
    }
    assert_eq!(s.programmed(), (100, 20), "the direct read restored every live pod");
    srv.shutdown().await;
}

/// A real scale-down in small steps (the server and the cache agree) is
/// held once the cumulative loss crosses 50%, confirmed by the direct read
/// and applied; the confirmation resets the reference, so the next small
/// step proceeds without a direct read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_gradual_scale_down_proceeds() {
    let (srv, client) = server(true).await;
    let mut s = gradual_setup(&client).await;
    assert!(s.syncer.sync_once().await.unwrap().full);
    assert_eq!(s.programmed(), (100, 20));
    for step in 1..=7 {
        let gone: Vec<(String, String)> = gradual_pods()
            .iter()
            .enumerate()
            .filter(|(i, _)| i % 10 == step - 1)
            .map(|(_, p)| ("gradual".to_string(), p.metadata.name.clone().unwrap()))
            .collect();
        delete_pods(&client, gone, 16).await;
        s.feed(&s.after_steps(step));
        let out = s.syncer.sync_once().await.unwrap();
        assert_eq!(
            out.guarded,
            step == 6,
            "step {step}: held only when the cumulative share crosses 50%"
        );
        assert_eq!(s.deferred(), if step >= 6 { 1.0 } else { 0.0 }, "step {step}");
        assert_eq!(
            s.programmed(),
            (100 - 10 * step, 20 - 2 * step),
            "step {step}: the confirmed removal is applied"
        );
    }
    assert!(s.dp.lock().inconsistent.is_empty());
    srv.shutdown().await;
}

/// Direct reads back off: while a cache that lost most pods keeps changing,
/// the held syncs do not each make a full LIST of the cluster; the next
/// read comes after the backoff (1 s, then 2 s), and a read that confirms a
/// real deletion resets it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn direct_reads_back_off_while_held() {
    let (srv, client) = server(true).await;
    let mut s = gradual_setup(&client).await;
    let lists = || srv.stats().by_verb.get("list").copied().unwrap_or(0);
    assert!(s.syncer.sync_once().await.unwrap().full);
    assert_eq!(s.programmed(), (100, 20));

    // The cache loses 60% of the pods (the server still has them): held,
    // read, overruled.
    let before = lists();
    s.feed(&s.after_steps(6));
    assert!(s.syncer.sync_once().await.unwrap().guarded);
    assert_eq!(lists() - before, 3, "one direct read of the three resources");
    assert_eq!(s.programmed(), (100, 20));

    // Further changes of the same bad cache stay held without a read.
    let before = lists();
    for step in [7, 6, 8] {
        s.feed(&s.after_steps(step));
        let err = s.syncer.sync_once().await.unwrap_err();
        assert!(
            matches!(err, SyncError::DirectReadDeferred { retry_in, .. } if retry_in <= Duration::from_secs(1)),
            "{err}"
        );
    }
    assert_eq!(lists(), before, "no direct read inside the backoff");
    assert_eq!(s.programmed(), (100, 20), "nothing removed while held");

    // After the backoff the next read happens; the one after it waits 2 s.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert!(s.syncer.sync_once().await.unwrap().guarded);
    assert_eq!(lists() - before, 3);
    s.feed(&s.after_steps(7));
    let err = s.syncer.sync_once().await.unwrap_err();
    assert!(
        matches!(err, SyncError::DirectReadDeferred { retry_in, .. } if retry_in > Duration::from_millis(1500)),
        "the backoff doubled: {err}"
    );

    // A real deletion, confirmed by the read after the backoff, resets it:
    // the next held deletion is read at once.
    let gone: Vec<(String, String)> = s
        .all
        .iter()
        .filter(|p| !left_after(p, 7))
        .map(|p| ("gradual".to_string(), p.metadata.name.clone().unwrap()))
        .collect();
    delete_pods(&client, gone, 16).await;
    tokio::time::sleep(Duration::from_millis(2100)).await;
    assert!(s.syncer.sync_once().await.unwrap().guarded);
    assert_eq!(s.programmed(), (30, 6), "the confirmed deletion is applied");
    let before = lists();
    s.feed(&s.after_steps(9));
    assert!(
        s.syncer.sync_once().await.unwrap().guarded,
        "read at once after a confirmation"
    );
    assert_eq!(lists() - before, 3);
    assert!(s.dp.lock().inconsistent.is_empty());
    srv.shutdown().await;
}

/// A restarted agent (a new syncer on the state a previous one programmed)
/// whose first full list is complete but holds far fewer pods: its first
/// sync is held against the adopted state and confirmed by a direct read,
/// which keeps every live pod; with the API server failing, nothing is
/// removed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_agent_guards_its_first_sync_against_the_adopted_state() {
    let (srv, client) = server_with_300_pods().await;
    let state = direct_read(&client, 100).await.unwrap();
    let dp = RecordingDataplane::default();
    let new_syncer = |cache: &Arc<Cache>| test_syncer(cache, dp.clone(), &client).build();
    let first30: std::collections::BTreeSet<_> = state.pods.iter().take(30).map(|p| p.metadata.name.clone()).collect();
    let feed = |cache: &Arc<Cache>, all: bool| feed_cache(cache, &state, |p| all || first30.contains(&p.metadata.name));

    // The first agent programs all 300 pods (5 identities, 20 endpoints).
    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    feed(&cache, true);
    let mut first = new_syncer(&cache);
    assert!(!first.sync_once().await.unwrap().guarded);
    assert_eq!(dp.lock().state.ipcache.len(), 300);
    assert_eq!(dp.adopted_counts(), Some((5, 20)));
    drop(first);

    // A restarted agent whose list holds 30 pods (1 identity): held, and the
    // direct read programs the 300 live pods.
    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    feed(&cache, false);
    let mut restarted = new_syncer(&cache);
    let out = restarted.sync_once().await.unwrap();
    assert!(out.guarded, "the first sync after a restart is guarded");
    assert_eq!(
        dp.lock().state.ipcache.len(),
        300,
        "the direct read kept every live pod"
    );
    assert_eq!(
        npm_agent::telemetry::sample(&metrics.render(), "npm_destructive_actions_deferred_total"),
        Some(1.0)
    );
    drop(restarted);

    // Another restart with the API server failing: nothing is programmed.
    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    feed(&cache, false);
    let mut restarted = new_syncer(&cache);
    let calls = dp.lock().calls.len();
    srv.inject(FaultRule::fail(1000, 503));
    let err = restarted.sync_once().await.unwrap_err();
    assert!(err.to_string().contains("mass deletion held"), "{err}");
    assert_eq!(dp.lock().calls.len(), calls, "nothing written");
    assert_eq!(dp.lock().state.ipcache.len(), 300);
    srv.clear_faults();
    srv.shutdown().await;
}
