//! Incident 2: partial-cache safety, through the real test API server and
//! the real compiler, with a recording dataplane.
//!
//! 3,000 pods are listed with page size 100 while the server compacts its
//! history mid-list (the next continue token answers 410 Gone). The agent
//! must program nothing from the partial list, relist, and program all
//! 3,000. Then a mass disappearance is held by the guard and confirmed by a
//! direct read, and a cache that (wrongly) lost most pods is overruled by the
//! direct read so nothing live is deleted.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::Event;
use npm_agent::metrics::Metrics;
use npm_agent::sync::Syncer;
use npm_agent::watch::{direct_read, Cache};
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
    wait_until("5 pages listed", Duration::from_secs(20), || {
        srv.stats().by_verb.get("list").copied().unwrap_or(0) >= before_lists + 5
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
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("big", &[])]).await;
    let pods: Vec<Pod> = big_pods().into_iter().take(300).collect();
    create_pods(&client, pods, 64).await;

    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    let dp = RecordingDataplane::default();
    let mut cfg = agent_config(100).sync;
    cfg.page_size = 100;
    let mut syncer = Syncer::new(
        cfg,
        cache.clone(),
        metrics.clone(),
        dp.clone(),
        Box::new(FixedResolver),
        Some(client.clone()),
    );

    // Feed the cache a full list, as the watchers would.
    let state = direct_read(&client, 100).await.unwrap();
    let feed = |pods: &[Arc<Pod>]| {
        cache.handle::<Pod>(Event::Init);
        for p in pods {
            cache.handle(Event::InitApply((**p).clone()));
        }
        cache.handle::<Pod>(Event::InitDone);
    };
    cache.handle::<Namespace>(Event::Init);
    for n in &state.namespaces {
        cache.handle(Event::InitApply((**n).clone()));
    }
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    cache.handle::<NetworkPolicy>(Event::InitDone);
    feed(&state.pods);
    let first = syncer.sync_once().await.unwrap();
    assert!(first.full && !first.guarded);
    assert_eq!(dp.lock().state.ipcache.len(), 300);

    // The cache now believes only 30 pods exist.
    feed(&state.pods[..30]);
    let out = syncer.sync_once().await.unwrap();
    assert!(out.guarded, "the guard fired");
    {
        let r = dp.lock();
        assert_eq!(r.state.ipcache.len(), 300, "the direct read kept every live pod");
        assert!(r.calls.iter().all(|c| c.ipcache_removed == 0));
    }
    assert_eq!(
        npm_agent::metrics::sample(&metrics.render(), "npm_destructive_actions_deferred_total"),
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
