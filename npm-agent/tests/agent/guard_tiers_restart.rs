//! A restarted agent's mass-deletion guard starts from the tier entries it
//! adopted: its dataplane reports the
//! tiered endpoint directions a previous agent programmed
//! (`AgentDataplane::adopted_tier_directions`: the nftables table's tier
//! chains; here the recording dataplane's endpoints), so a first complete
//! list without the ClusterNetworkPolicies (however it came about) is held
//! instead of removing every adopted Deny, and the direct read decides.
//!
//! Through the real test API server and compiler, with a cache fed by hand,
//! in the style of `guard_policies.rs`: namespace `g`, 4 pods of this node
//! (`a0`..`a3`, app=a<i>) and 3 Admin Deny CNPs `deny-<i>` (subject a<i>,
//! from a3); over a recording dataplane (no root), and over a real nftables
//! table in a network namespace of its own as `restart_numbers_nft.rs`
//! (root; netns `npmtr<pid>`, table `npm_tr<pid>`): a new `NftDataplane`
//! on the table reports its tier chains, and the restarted agent's first
//! sync without the CNPs is held with the table unchanged.

use std::process::Command;
use std::sync::Arc;

use crate::cnp_support::cnp;
use crate::common::*;
use kube::runtime::watcher::Event;
use npm_agent::k8s::{direct_read_with, Cache, ClusterNetworkPolicy, ClusterPolicyMode, CompleteState};
use npm_agent::reconcile::{SyncError, Syncer};
use npm_agent::telemetry::Metrics;
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_testapi::{CnpChannel, FaultRule, Options, TestApiServer};

struct Setup {
    state: CompleteState,
    cache: Arc<Cache>,
    metrics: Metrics,
    dp: RecordingDataplane,
    syncer: Syncer<RecordingDataplane>,
}

impl Setup {
    /// A fresh agent (cache, metrics, syncer) on the same dataplane, its
    /// cache fed the server's namespaces and pods, no NetworkPolicy and the
    /// ClusterNetworkPolicies `cnps`.
    fn start(&mut self, client: &kube::Client, cnps: &[ClusterNetworkPolicy]) {
        self.metrics = Metrics::new().unwrap();
        self.cache = Cache::with_cluster_policies(self.metrics.clone(), ClusterPolicyMode::Auto);
        self.syncer = test_syncer(&self.cache, self.dp.clone(), client).build();
        feed(&self.cache, &self.state, cnps);
    }

    /// Tier entries in the recording dataplane.
    fn tiers(&self) -> usize {
        self.dp.lock().state.tiers.len()
    }

    fn deferred(&self) -> f64 {
        npm_agent::telemetry::sample(&self.metrics.render(), "npm_destructive_actions_deferred_total").unwrap_or(0.0)
    }
}

/// The test API server with the CRD, the pods (`<subnet>.0.<i+1>`) and the
/// CNPs; its state, read once.
async fn cluster(subnet: &str) -> (TestApiServer, kube::Client, CompleteState) {
    let srv = TestApiServer::start(Options {
        cnp_crd: Some(CnpChannel::Standard),
        ..Options::default()
    })
    .await
    .unwrap();
    let client = client_for(&srv);
    create_namespaces(&client, &[namespace("g", &[])]).await;
    let pods = (0..4)
        .map(|i| {
            let app = format!("a{i}");
            pod(
                "g",
                &app,
                "node-a",
                Some(&format!("{subnet}.0.{}", i + 1)),
                &[("app", &app)],
            )
        })
        .collect();
    create_pods(&client, pods, 4).await;
    for i in 0..3 {
        crate::cnp_support::create_cnp(
            &client,
            cnp(&format!("deny-{i}"), "Admin", 10, &format!("a{i}"), "Deny", "a3", &[]),
        )
        .await;
    }
    let state = direct_read_with(&client, 100, ClusterPolicyMode::Auto).await.unwrap();
    assert_eq!(state.cluster_policies.len(), 3);
    (srv, client, state)
}

/// A cache in `auto` fed `state`'s namespaces and pods, no NetworkPolicy
/// and the ClusterNetworkPolicies `cnps`.
fn fed(state: &CompleteState, cnps: &[ClusterNetworkPolicy]) -> Arc<Cache> {
    let cache = Cache::with_cluster_policies(Metrics::new().unwrap(), ClusterPolicyMode::Auto);
    feed(&cache, state, cnps);
    cache
}

/// Feeds `cache` complete lists of `state`'s namespaces and pods, no
/// NetworkPolicy and the ClusterNetworkPolicies `cnps`.
fn feed(cache: &Cache, state: &CompleteState, cnps: &[ClusterNetworkPolicy]) {
    let mut no_policies = state.clone();
    no_policies.policies = Default::default();
    feed_cache(cache, &no_policies, |_| true);
    cache.handle::<ClusterNetworkPolicy>(Event::Init);
    for c in cnps {
        cache.handle(Event::InitApply(c.clone()));
    }
    cache.handle::<ClusterNetworkPolicy>(Event::InitDone);
}

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "delete", &self.0]).output();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_nft_agent_holds_a_first_sync_that_removes_the_adopted_tier_chains() {
    use crate::common::netns::{clear_stale_netns, sh};
    clear_stale_netns("npmtr");
    let pid = std::process::id();
    let ns = Netns(format!("npmtr{pid}"));
    sh(&["ip", "netns", "add", &ns.0]);
    let table = format!("npm_tr{pid}");
    let nft = || {
        NftDataplane::new(NftOptions {
            table: table.clone(),
            netns: Some(ns.0.clone()),
        })
        .unwrap()
    };
    let syncer = |cache: &Arc<Cache>, dp: NftDataplane| {
        Syncer::builder(cache.clone(), dp)
            .config(agent_config(100).sync)
            .resolver(Box::new(FixedResolver))
            .build()
    };
    let (srv, _client, state) = cluster("10.45").await;
    let cnps: Vec<ClusterNetworkPolicy> = state.cluster_policies.iter().map(|c| (**c).clone()).collect();
    let mut first = syncer(&fed(&state, &cnps), nft());
    first.sync_once().await.unwrap();
    let listed = first.dataplane().list_table().unwrap();
    drop(first);

    // Restarted, its first complete CNP list (wrongly) empty, no client to
    // confirm: held against the adopted tier chains, the table unchanged.
    let mut restarted = syncer(&fed(&state, &[]), nft());
    match restarted.sync_once().await {
        Err(SyncError::NoDirectReader { what }) => {
            assert!(what.contains("tiered endpoint directions"), "{what}")
        }
        other => panic!("the first sync must be held against the adopted tier chains: {other:?}"),
    }
    let adopted = restarted.dataplane().adopted().expect("the table is read").clone();
    assert_eq!(adopted.tier_chains, 3, "a0..a2, ingress, Admin");
    assert_eq!(restarted.dataplane().list_table().unwrap(), listed, "the Denies stay");
    drop(restarted);
    srv.shutdown().await;
    drop(ns);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn restarted_agent_holds_a_first_sync_that_removes_the_adopted_tiers() {
    let (srv, client, state) = cluster("10.41").await;
    let metrics = Metrics::new().unwrap();
    let cache = Cache::with_cluster_policies(metrics.clone(), ClusterPolicyMode::Auto);
    let dp = RecordingDataplane::default();
    let syncer = test_syncer(&cache, dp.clone(), &client).build();
    let mut s = Setup {
        state,
        cache,
        metrics,
        dp,
        syncer,
    };
    let cnps: Vec<ClusterNetworkPolicy> = s.state.cluster_policies.iter().map(|c| (**c).clone()).collect();
    s.start(&client, &cnps);
    assert!(s.syncer.sync_once().await.unwrap().full);
    let tiers = s.tiers();
    assert!(tiers > 0, "the Denies are programmed");

    // Restart; the first complete CNP list is (wrongly) empty and the API
    // server fails every request: held, nothing written, the Denies stay.
    s.start(&client, &[]);
    let calls = s.dp.lock().calls.len();
    srv.inject(FaultRule::fail(1000, 503));
    let err = s.syncer.sync_once().await.unwrap_err();
    assert!(err.to_string().contains("mass deletion held"), "{err}");
    assert!(s.deferred() >= 1.0);
    assert_eq!(s.dp.lock().calls.len(), calls, "nothing written");
    assert_eq!(s.tiers(), tiers);

    // The API server answers: the direct read (which has the CNPs) decides.
    srv.clear_faults();
    s.start(&client, &[]);
    let out = s.syncer.sync_once().await.unwrap();
    assert!(out.guarded, "held, then confirmed or overruled by the direct read");
    assert_eq!(s.tiers(), tiers, "the direct read kept the Denies");
    srv.shutdown().await;
}
