//! Issue 12 §3 (third bullet): while the mass-deletion guard holds a
//! removal, additions and label changes keep being programmed, and an
//! address that a new live pod claims moves to it at once (incident 1 must
//! not come back through a held sync). Through the real test API server
//! and the real compiler, with a recording dataplane and a cache fed by
//! hand; the syncer has no API client, so no direct read can confirm the
//! removal and it stays held. Verdicts are decided on the recorded state
//! with `npm_policy::lookup` (the datapath's decision on a compiled state).
//!
//! Namespace `h`: server `s` (app=s, 10.42.0.100) accepts TCP 80 only from
//! app=friend; pods `a0`..`a9` (app=old, 10.42.0.1..10) are this node's.

use std::net::IpAddr;
use std::sync::Arc;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use npm_agent::k8s::{direct_read, Cache, CompleteState};
use npm_agent::reconcile::{SyncError, Syncer};
use npm_agent::telemetry::Metrics;
use npm_policy::compiled::{Compiled, Direction};

const SERVER: &str = "10.42.0.100";

fn friends_only() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "friends-only", "namespace": "h"},
        "spec": {"podSelector": {"matchLabels": {"app": "s"}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "friend"}}}], "ports": [{"port": 80}]}]}
    })
}

fn a(i: usize, app: &str) -> Pod {
    pod(
        "h",
        &format!("a{i}"),
        "node-a",
        Some(&format!("10.42.0.{}", i + 1)),
        &[("app", app)],
    )
}

/// Pod `name` of `state` (the server's object: its uid) with label app=`app`.
fn relabel(state: &CompleteState, name: &str, app: &str) -> CachedPod {
    let mut p = (**state
        .pods
        .iter()
        .find(|p| p.metadata.name.as_deref() == Some(name))
        .unwrap())
    .clone();
    p.metadata.labels = Some([("app".to_string(), app.to_string())].into());
    // As the watchers would see it: a new resourceVersion.
    let rv = p.metadata.resource_version.take().unwrap_or_default();
    p.metadata.resource_version = Some(format!("{rv}-{app}"));
    p
}

/// Whether the recorded state lets `peer` open TCP 80 to the server.
fn server_allows(state: &Compiled, peer: &str) -> bool {
    let (ep, _) = endpoint_with_ip(state, SERVER).expect("server programmed");
    let peer: IpAddr = peer.parse().unwrap();
    npm_policy::lookup::lookup(state, ep, Direction::Ingress, peer, 6, 80).allowed
}

/// The pod (`ns/name`) whose identity the ipcache gives `ip`, if any.
fn ipcache_owner(state: &Compiled, ip: &str) -> Option<String> {
    let e = state.ipcache.get(&ip.parse::<IpAddr>().unwrap())?;
    let key = state.ids.identities.get(&e.identity)?;
    Some(format!("{}:{:?}", key.namespace, key.pod_labels))
}

/// A server with `s` and `a0..a9`, a syncer without a client that has
/// programmed it all, and the state it programmed.
async fn setup() -> (
    npm_testapi::TestApiServer,
    kube::Client,
    Arc<Cache>,
    RecordingDataplane,
    Syncer<RecordingDataplane>,
) {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("h", &[])]).await;
    let mut pods: Vec<Pod> = (0..10).map(|i| a(i, "old")).collect();
    pods.push(pod("h", "s", "node-a", Some(SERVER), &[("app", "s")]));
    create_pods(&client, pods, 8).await;
    create_policy(&client, "h", friends_only()).await.unwrap();
    let cache = Cache::new(Metrics::new().unwrap());
    let dp = RecordingDataplane::default();
    let mut syncer = Syncer::builder(cache.clone(), dp.clone())
        .config(agent_config(100).sync)
        .resolver(Box::new(FixedResolver))
        .build();
    let state = direct_read(&client, 100).await.unwrap();
    feed_cache(&cache, &state, |_| true);
    syncer.sync_once().await.unwrap();
    assert_eq!(dp.lock().state.endpoints.len(), 11);
    (srv, client, cache, dp, syncer)
}

/// The cache loses `a0..a8` (a mass removal the guard holds) and gets
/// `extra` besides; `a9` is replaced by `a9_as`.
fn feed_lossy(cache: &Cache, state: &CompleteState, a9_as: CachedPod, extra: Vec<Pod>) {
    let mut s = state.clone();
    s.pods.retain(|p| matches!(p.metadata.name.as_deref(), Some("s")));
    s.pods.insert(Arc::new(a9_as));
    s.pods.extend(extra.into_iter().map(|p| Arc::new(CachedPod::from(p))));
    feed_cache(cache, &s, |_| true);
}

/// The sync is held (no client confirms the removal), yet it programmed.
async fn sync_held(syncer: &mut Syncer<RecordingDataplane>, dp: &RecordingDataplane) {
    let writes = dp.lock().calls.len();
    match syncer.sync_once().await {
        Err(SyncError::NoDirectReader { what }) => eprintln!("held: {what}"),
        other => panic!("the removal must be held: {other:?}"),
    }
    assert!(dp.lock().calls.len() > writes, "the held sync programmed the rest");
    let r = dp.lock();
    for i in 1..9 {
        let ip = format!("10.42.0.{}", i + 1);
        assert_eq!(
            endpoint_with_ip(&r.state, &ip).map(|e| e.1),
            Some(format!("h/a{i}")),
            "held: a{i} keeps its endpoint"
        );
        assert!(
            r.state.ipcache.contains_key(&ip.parse::<IpAddr>().unwrap()),
            "held: a{i} keeps its address"
        );
    }
    assert!(r.inconsistent.is_empty(), "{:?}", r.inconsistent);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_addition_during_a_hold_is_enforced() {
    let (srv, client, cache, dp, mut syncer) = setup().await;
    let state = direct_read(&client, 100).await.unwrap();
    assert!(!server_allows(&dp.lock().state, "10.42.0.50"), "nobody at .50 yet");
    let friend = pod("h", "n1", "node-b", Some("10.42.0.50"), &[("app", "friend")]);
    let local = pod("h", "n2", "node-a", Some("10.42.0.60"), &[("app", "friend")]);
    feed_lossy(&cache, &state, relabel(&state, "a9", "old"), vec![friend, local]);
    sync_held(&mut syncer, &dp).await;
    let r = dp.lock().state.clone();
    assert!(
        server_allows(&r, "10.42.0.50"),
        "the new friend is allowed during the hold"
    );
    assert!(server_allows(&r, "10.42.0.60"));
    assert_eq!(
        endpoint_with_ip(&r, "10.42.0.60").map(|e| e.1),
        Some("h/n2".into()),
        "a new local pod gets its endpoint"
    );
    assert!(!server_allows(&r, "10.42.0.10"), "a9 is still no friend");
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_label_change_during_a_hold_is_enforced() {
    let (srv, client, cache, dp, mut syncer) = setup().await;
    let state = direct_read(&client, 100).await.unwrap();
    assert!(!server_allows(&dp.lock().state, "10.42.0.10"));
    // a9 becomes a friend while a0..a8 are held.
    feed_lossy(&cache, &state, relabel(&state, "a9", "friend"), vec![]);
    sync_held(&mut syncer, &dp).await;
    assert!(
        server_allows(&dp.lock().state, "10.42.0.10"),
        "a9 relabelled friend is allowed during the hold"
    );
    // And back: the change away from friend is enforced too.
    feed_lossy(&cache, &state, relabel(&state, "a9", "old"), vec![]);
    sync_held(&mut syncer, &dp).await;
    assert!(
        !server_allows(&dp.lock().state, "10.42.0.10"),
        "a9 relabelled back is denied during the hold"
    );
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_claimed_by_a_new_live_pod_moves_to_it_during_a_hold() {
    let (srv, client, cache, dp, mut syncer) = setup().await;
    let state = direct_read(&client, 100).await.unwrap();
    // a0 is a friend for this test: its address is allowed to the server.
    let mut st = state.clone();
    st.pods.retain(|p| p.metadata.name.as_deref() != Some("a0"));
    st.pods.insert(Arc::new(relabel(&state, "a0", "friend")));
    feed_cache(&cache, &st, |_| true);
    syncer.sync_once().await.unwrap();
    assert!(server_allows(&dp.lock().state, "10.42.0.1"), "a0 (friend) allowed");
    // The cache loses a0..a8 (held) and a new live pod, no friend, takes
    // a0's address (incident 1): it must not carry a0's allowance.
    let thief = pod("h", "n3", "node-a", Some("10.42.0.1"), &[("app", "stranger")]);
    feed_lossy(&cache, &st, relabel(&st, "a9", "old"), vec![thief]);
    let writes = dp.lock().calls.len();
    assert!(
        matches!(syncer.sync_once().await, Err(SyncError::NoDirectReader { .. })),
        "held"
    );
    assert!(dp.lock().calls.len() > writes);
    let r = dp.lock().state.clone();
    assert!(
        !server_allows(&r, "10.42.0.1"),
        "the address moved to the stranger at once"
    );
    assert_eq!(
        endpoint_with_ip(&r, "10.42.0.1").map(|e| e.1),
        Some("h/n3".into()),
        "the new live pod owns the address; the held a0 no longer does"
    );
    assert_eq!(ipcache_owner(&r, "10.42.0.1"), Some("h:{\"app\": \"stranger\"}".into()));
    for i in 1..9 {
        let ip = format!("10.42.0.{}", i + 1);
        assert_eq!(
            endpoint_with_ip(&r, &ip).map(|e| e.1),
            Some(format!("h/a{i}")),
            "a{i} held"
        );
    }
    srv.shutdown().await;
}
