//! Endpoint ids across an agent restart, through the real test API server
//! and the real compiler, with a recording dataplane whose state outlives
//! the syncer (like pinned maps outlive an agent).
//!
//! A restarted agent keeps the id of every pod whose interface still holds
//! that pod's record (same interface, same addresses), so its tracked flows
//! stay; every other endpoint, including a new pod that recycled an old
//! pod's address, is numbered above all adopted ids, so no pod is ever
//! decided under an id another pod's record had.

use std::collections::BTreeMap;
use std::hash::{DefaultHasher, Hash, Hasher};
use std::sync::Arc;

use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams};
use npm_agent::k8s::{direct_read, Cache};
use npm_agent::node::{Resolve, Resolved};
use npm_agent::reconcile::Syncer;
use npm_agent::telemetry::Metrics;
use npm_policy::compiled::Compiled;

/// Each pod's interface is its own (a new pod gets a new veth): the ifindex
/// is derived from the pod uid.
struct PerPodResolver;

impl Resolve for PerPodResolver {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        let interfaces = compiled
            .endpoints
            .iter()
            .map(|(id, ep)| {
                let mut h = DefaultHasher::new();
                ep.pod.uid.hash(&mut h);
                (*id, 2000 + (h.finish() % 1_000_000) as u32)
            })
            .collect();
        Resolved {
            interfaces,
            missing: Vec::new(),
        }
    }
}

fn local_pod(i: usize) -> Pod {
    pod(
        "web",
        &format!("p{i}"),
        "node-a",
        Some(&format!("10.30.0.{}", i + 1)),
        &[("app", "web")],
    )
}

/// Pod name -> (uid, endpoint id) of what the dataplane holds.
fn ids_by_name(dp: &RecordingDataplane) -> BTreeMap<String, (String, u32)> {
    dp.lock()
        .state
        .endpoints
        .iter()
        .map(|(id, ep)| (ep.pod.name.clone(), (ep.pod.uid.clone(), *id)))
        .collect()
}

/// Feeds a cache the cluster as a direct read sees it now, keeping only
/// the pods `keep` accepts.
async fn feed(client: &kube::Client, cache: &Arc<Cache>, keep: impl Fn(&CachedPod) -> bool) {
    let state = direct_read(client, 100).await.unwrap();
    feed_cache(cache, &state, keep);
}

/// A syncer on `dp`.
fn syncer(dp: &RecordingDataplane, client: &kube::Client, cache: &Arc<Cache>) -> Syncer<RecordingDataplane> {
    test_syncer(cache, dp.clone(), client)
        .resolver(Box::new(PerPodResolver))
        .build()
}

/// A first agent that saw p10..p19 first (ids 1..=10), then p0..p9 (ids
/// 11..=20): its numbering follows history, not the pods' order. Returns
/// what it programmed (pod name -> (uid, id)).
async fn first_agent(dp: &RecordingDataplane, client: &kube::Client) -> BTreeMap<String, (String, u32)> {
    create_namespaces(client, &[namespace("web", &[])]).await;
    let cache = Cache::new(Metrics::new().unwrap());
    let mut first = syncer(dp, client, &cache);
    create_pods(client, (10..20).map(local_pod).collect(), 8).await;
    feed(client, &cache, |_| true).await;
    first.sync_once().await.unwrap();
    create_pods(client, (0..10).map(local_pod).collect(), 8).await;
    feed(client, &cache, |_| true).await;
    first.sync_once().await.unwrap();
    let before = ids_by_name(dp);
    assert_eq!(before.len(), 20);
    assert!(before.values().all(|(_, id)| (1..=20).contains(id)));
    assert_ne!(before["p0"].1, 1, "the history order differs from the name order");
    before
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_or_retried_first_sync_keeps_the_adopted_ids() {
    let (srv, client) = server(true).await;
    let dp = RecordingDataplane::default();
    let before = first_agent(&dp, &client).await;

    // A restarted agent whose cache (wrongly) holds 2 of the 20 pods: its
    // first sync is held against the adopted state, and the direct read
    // (all 20 pods) is compiled with the adopted ids.
    let cache = Cache::new(Metrics::new().unwrap());
    feed(&client, &cache, |p| {
        matches!(p.metadata.name.as_deref(), Some("p0" | "p1"))
    })
    .await;
    let mut restarted = syncer(&dp, &client, &cache);
    assert!(restarted.sync_once().await.unwrap().guarded);
    assert_eq!(ids_by_name(&dp), before, "ids kept through the direct read");
    drop(restarted);

    // A restarted agent whose first write fails: the retry keeps them too.
    dp.lock().fail_next = 1;
    let cache = Cache::new(Metrics::new().unwrap());
    feed(&client, &cache, |_| true).await;
    let mut restarted = syncer(&dp, &client, &cache);
    assert!(restarted.sync_once().await.is_err(), "the first write fails");
    restarted.sync_once().await.unwrap();
    assert_eq!(ids_by_name(&dp), before, "ids kept through a failed first write");
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_agent_keeps_the_ids_of_unchanged_pods_and_numbers_the_rest_above() {
    let (srv, client) = server(true).await;
    let dp = RecordingDataplane::default();
    let before = first_agent(&dp, &client).await;

    // While the agent is down: p5 is deleted and a new pod q5 takes its
    // address (a recycled IP, incident 1); p20 is new.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "web");
    pods.delete("p5", &DeleteParams::default()).await.unwrap();
    let mut q5 = local_pod(5);
    q5.metadata.name = Some("q5".into());
    create_pods(&client, vec![q5, local_pod(20)], 2).await;

    // The restarted agent.
    let cache = Cache::new(Metrics::new().unwrap());
    let mut restarted = syncer(&dp, &client, &cache);
    feed(&client, &cache, |_| true).await;
    restarted.sync_once().await.unwrap();
    let after = ids_by_name(&dp);
    assert_eq!(after.len(), 21);
    for (name, (uid, id)) in &before {
        if name == "p5" {
            continue;
        }
        assert_eq!(after.get(name), Some(&(uid.clone(), *id)), "{name} keeps its id");
    }
    let (_, q5_id) = &after["q5"];
    let (_, p20_id) = &after["p20"];
    assert!(
        *q5_id > 20,
        "the pod on p5's address is numbered above the adopted ids: {q5_id}"
    );
    assert!(*p20_id > 20, "a new pod is numbered above the adopted ids: {p20_id}");
    assert_ne!(q5_id, p20_id);
    srv.shutdown().await;
}
