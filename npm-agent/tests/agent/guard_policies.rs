//! Issue 12 §3 (second bullet): losing most NetworkPolicies, or most
//! isolated endpoints, opens pods as surely as losing pods, so the
//! mass-deletion guard holds it too: same threshold (50%), same window,
//! same confirming direct read. Through the real test API server and the
//! real compiler, with a recording dataplane and a cache fed by hand (as
//! the watchers would, with complete lists), in the style of
//! `partial_cache.rs`.
//!
//! Namespace `g`: 20 pods of this node (`a0`..`a19`, app=a<i>: 20
//! endpoints, 20 identities) and 10 policies `p0`..`p9`, `p<i>` isolating
//! pod `a<i>` for ingress and allowing it from `a19` on port 80.

use std::collections::BTreeSet;
use std::sync::Arc;

use crate::common::*;
use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::Event;
use npm_agent::k8s::{direct_read, Cache, CompleteState};
use npm_agent::reconcile::Syncer;
use npm_agent::telemetry::Metrics;
use npm_testapi::FaultRule;

const POLICIES: usize = 10;

fn isolating(i: usize) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": format!("p{i}"), "namespace": "g"},
        "spec": {"podSelector": {"matchLabels": {"app": format!("a{i}")}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a19"}}}], "ports": [{"port": 80}]}]}
    })
}

struct Setup {
    /// The server's state, read once.
    state: CompleteState,
    cache: Arc<Cache>,
    metrics: Metrics,
    dp: RecordingDataplane,
    syncer: Syncer<RecordingDataplane>,
}

async fn setup(client: &kube::Client) -> Setup {
    create_namespaces(client, &[namespace("g", &[])]).await;
    let pods = (0..20)
        .map(|i| {
            let app = format!("a{i}");
            pod(
                "g",
                &format!("a{i}"),
                "node-a",
                Some(&format!("10.40.0.{}", i + 1)),
                &[("app", &app)],
            )
        })
        .collect();
    create_pods(client, pods, 8).await;
    for i in 0..POLICIES {
        create_policy(client, "g", isolating(i)).await.unwrap();
    }
    let metrics = Metrics::new().unwrap();
    let cache = Cache::new(metrics.clone());
    let dp = RecordingDataplane::default();
    let syncer = test_syncer(&cache, dp.clone(), client).build();
    let state = direct_read(client, 100).await.unwrap();
    assert_eq!(state.policies.len(), POLICIES);
    Setup {
        state,
        cache,
        metrics,
        dp,
        syncer,
    }
}

impl Setup {
    /// The cache's complete lists become the server's namespaces and pods
    /// and `policies`.
    fn feed(&self, policies: &[NetworkPolicy]) {
        self.cache.handle::<Namespace>(Event::Init);
        for n in &self.state.namespaces {
            self.cache.handle(Event::InitApply((**n).clone()));
        }
        self.cache.handle::<Namespace>(Event::InitDone);
        self.cache.handle::<CachedPod>(Event::Init);
        for p in &self.state.pods {
            self.cache.handle(Event::InitApply((**p).clone()));
        }
        self.cache.handle::<CachedPod>(Event::InitDone);
        self.cache.handle::<NetworkPolicy>(Event::Init);
        for p in policies {
            self.cache.handle(Event::InitApply(p.clone()));
        }
        self.cache.handle::<NetworkPolicy>(Event::InitDone);
    }

    /// The server's policies `p<i>` with `keep(i)`.
    fn policies(&self, keep: impl Fn(usize) -> bool) -> Vec<NetworkPolicy> {
        self.state
            .policies
            .iter()
            .filter(|p| {
                let i: usize = p.metadata.name.as_deref().unwrap()[1..].parse().unwrap();
                keep(i)
            })
            .map(|p| (**p).clone())
            .collect()
    }

    fn deferred(&self) -> f64 {
        npm_agent::telemetry::sample(&self.metrics.render(), "npm_destructive_actions_deferred_total").unwrap_or(0.0)
    }

    /// (isolated endpoints, policies with allow entries) in the recording
    /// dataplane.
    fn programmed(&self) -> (usize, usize) {
        let r = self.dp.lock();
        let isolated = r.state.endpoints.values().filter(|e| e.isolated_ingress).count();
        let policies: BTreeSet<String> = r
            .state
            .endpoints
            .keys()
            .flat_map(|ep| policies_of_endpoint(&r.state, *ep))
            .collect();
        (isolated, policies.len())
    }
}

/// A cache that lost 8 of 10 policies (the server still has them): held,
/// and the direct read keeps every policy and every isolated endpoint.
/// With the API server failing, the held sync removes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_most_policies_is_held_and_overruled_by_the_direct_read() {
    let (srv, client) = server(true).await;
    let mut s = setup(&client).await;
    s.feed(&s.policies(|_| true));
    let first = s.syncer.sync_once().await.unwrap();
    assert!(first.full && !first.guarded);
    assert_eq!(s.programmed(), (10, 10));

    s.feed(&s.policies(|i| i < 2));
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "losing 80% of the policies is held");
    assert_eq!(s.deferred(), 1.0);
    assert_eq!(s.programmed(), (10, 10), "the direct read kept every policy");
    assert!(s.dp.lock().inconsistent.is_empty());

    // Further changes of the bad cache stay held (the read backs off) or,
    // with the API server failing, fail: nothing is removed either way.
    srv.inject(FaultRule::fail(1000, 503));
    s.feed(&s.policies(|i| i < 3));
    let err = s.syncer.sync_once().await.unwrap_err();
    assert!(err.to_string().contains("mass deletion held"), "{err}");
    assert_eq!(s.programmed(), (10, 10));
    srv.clear_faults();
    srv.shutdown().await;
}

/// Real deletions of most policies: held, confirmed by the direct read and
/// applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn confirmed_policy_deletion_is_applied() {
    let (srv, client) = server(true).await;
    let mut s = setup(&client).await;
    s.feed(&s.policies(|_| true));
    assert!(s.syncer.sync_once().await.unwrap().full);
    for i in 2..POLICIES {
        delete_policy(&client, "g", &format!("p{i}")).await;
    }
    s.feed(&s.policies(|i| i < 2));
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "held and confirmed");
    assert_eq!(s.programmed(), (2, 2), "the confirmed deletion is applied");
    // The confirmation resets the reference: one more (small) step is
    // not held against the old high-water count.
    delete_policy(&client, "g", "p1").await;
    s.feed(&s.policies(|i| i < 1));
    let out = s.syncer.sync_once().await.unwrap();
    assert!(!out.guarded, "1 of 2 policies is 50%, not more");
    assert_eq!(s.programmed(), (1, 1));
    srv.shutdown().await;
}

/// Policies lost in small steps (10% of the original per sync, each below
/// the threshold against the state before it) are held once together they
/// cross 50% of the high-water count: the direct read restores them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gradual_policy_loss_is_held_when_the_cumulative_share_crosses() {
    let (srv, client) = server(true).await;
    let mut s = setup(&client).await;
    s.feed(&s.policies(|_| true));
    assert!(s.syncer.sync_once().await.unwrap().full);
    for step in 1..=5 {
        s.feed(&s.policies(|i| i >= step));
        let out = s.syncer.sync_once().await.unwrap();
        assert!(!out.guarded, "step {step} is below the threshold");
        assert_eq!(s.programmed(), (10 - step, 10 - step), "step {step}");
    }
    assert_eq!(s.deferred(), 0.0);
    // Step 6: 5 -> 4 policies is 20% in one step but 60% of the
    // high-water 10: held, and the direct read restores all 10.
    s.feed(&s.policies(|i| i >= 6));
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "the cumulative guard fired");
    assert_eq!(s.deferred(), 1.0);
    assert_eq!(s.programmed(), (10, 10), "the direct read restored every policy");
    assert!(s.dp.lock().inconsistent.is_empty());
    srv.shutdown().await;
}

/// The policy count stays, but the cache's versions of the policies select
/// other pods (none of this node's): most isolated endpoints would be
/// lost. Held; the direct read keeps them isolated.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn losing_most_isolated_endpoints_is_held() {
    let (srv, client) = server(true).await;
    let mut s = setup(&client).await;
    s.feed(&s.policies(|_| true));
    assert!(s.syncer.sync_once().await.unwrap().full);
    assert_eq!(s.programmed(), (10, 10));
    let elsewhere: Vec<NetworkPolicy> = s
        .policies(|_| true)
        .into_iter()
        .map(|mut p| {
            p.metadata.resource_version = Some("999999".into());
            p.spec.as_mut().unwrap().pod_selector =
                Some(serde_json::from_value(serde_json::json!({"matchLabels": {"app": "none"}})).unwrap());
            p
        })
        .collect();
    s.feed(&elsewhere);
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "losing every isolated endpoint is held");
    assert_eq!(s.programmed(), (10, 10), "the direct read kept them isolated");
    srv.shutdown().await;
}

/// A restarted agent (a new syncer on the dataplane the first one
/// programmed, whose records it adopts) whose first complete list has no
/// policy at all: the adopted records' isolated directions are the guard's
/// reference, so the sync is held and the direct read keeps every
/// endpoint isolated. With the API server failing, nothing is opened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_agent_holds_a_first_sync_that_opens_the_adopted_isolation() {
    let (srv, client) = server(true).await;
    let mut s = setup(&client).await;
    s.feed(&s.policies(|_| true));
    assert!(s.syncer.sync_once().await.unwrap().full);
    assert_eq!(s.programmed(), (10, 10));

    // Restart: a fresh cache whose policy list is (wrongly) empty.
    let restart = |s: &mut Setup| {
        s.metrics = Metrics::new().unwrap();
        s.cache = Cache::new(s.metrics.clone());
        s.syncer = test_syncer(&s.cache, s.dp.clone(), &client).build();
        s.feed(&[]);
    };
    restart(&mut s);
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "opening every adopted isolated endpoint is held");
    assert_eq!(s.deferred(), 1.0);
    assert_eq!(s.programmed(), (10, 10), "the direct read kept them isolated");

    restart(&mut s);
    let calls = s.dp.lock().calls.len();
    srv.inject(FaultRule::fail(1000, 503));
    let err = s.syncer.sync_once().await.unwrap_err();
    assert!(err.to_string().contains("mass deletion held"), "{err}");
    assert_eq!(s.dp.lock().calls.len(), calls, "nothing written");
    assert_eq!(s.programmed(), (10, 10));
    srv.clear_faults();
    srv.shutdown().await;
}
