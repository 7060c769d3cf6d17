//! Issue 12 §2 for the nftables dataplane: a restarted agent's first full
//! sync is guarded against the table a previous agent left, like the eBPF
//! dataplane's against its pinned maps. A first agent programs 20 isolated
//! pods into a real nft table (in a network namespace of its own); a new
//! `NftDataplane` on that table reports the identities, endpoints and
//! isolation it found; a restarted agent whose cache (wrongly) holds 2 of
//! the 20 pods and no policy is held (no client confirms it) and the table
//! keeps enforcing what it held.
//!
//! Names carry the process id (netns `npmrq<pid>`, table `npm_rq<pid>`);
//! leftovers of crashed runs go first.

use std::process::Command;
use std::sync::Arc;

use crate::common::netns::*;
use crate::common::*;
use npm_agent::k8s::{direct_read, Cache};
use npm_agent::reconcile::{SyncError, Syncer};
use npm_agent::telemetry::Metrics;
use npm_dataplane::nft::{NftDataplane, NftOptions};

const PREFIX: &str = "npmrq";

struct Netns(String);

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "delete", &self.0]).output();
    }
}

fn isolate_all() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "isolate", "namespace": "q"},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "p0"}}}], "ports": [{"port": 80}]}]}
    })
}

fn nft(ns: &str, table: &str) -> NftDataplane {
    NftDataplane::new(NftOptions {
        table: table.into(),
        netns: Some(ns.into()),
    })
    .unwrap()
}

fn syncer(cache: &Arc<Cache>, dp: NftDataplane) -> Syncer<NftDataplane> {
    Syncer::builder(cache.clone(), dp)
        .config(agent_config(100).sync)
        .resolver(Box::new(FixedResolver))
        .build()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_nft_agent_is_guarded_against_the_table_it_found() {
    clear_stale_netns(PREFIX);
    let pid = std::process::id();
    let ns = Netns(format!("{PREFIX}{pid}"));
    sh(&["ip", "netns", "add", &ns.0]);
    let table = format!("npm_rq{pid}");

    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("q", &[])]).await;
    let pods = (0..20)
        .map(|i| {
            pod(
                "q",
                &format!("p{i}"),
                "node-a",
                Some(&format!("10.43.0.{}", i + 1)),
                &[("app", &format!("p{i}"))],
            )
        })
        .collect();
    create_pods(&client, pods, 8).await;
    create_policy(&client, "q", isolate_all()).await.unwrap();
    let state = direct_read(&client, 100).await.unwrap();

    // No table yet: nothing adopted.
    let dp = nft(&ns.0, &table);
    assert!(dp.adopted().is_none());
    let cache = Cache::new(Metrics::new().unwrap());
    feed_cache(&cache, &state, |_| true);
    let mut first = syncer(&cache, dp);
    first.sync_once().await.unwrap();
    let listed = first.dataplane().list_table().unwrap();
    drop(first);

    let dp = nft(&ns.0, &table);

    // The restarted agent's cache holds 2 pods and no policy: held.
    let cache = Cache::new(Metrics::new().unwrap());
    let mut partial = state.clone();
    partial.policies.clear();
    feed_cache(&cache, &partial, |p| {
        matches!(p.metadata.name.as_deref(), Some("p0" | "p1"))
    });
    let mut restarted = syncer(&cache, dp);
    match restarted.sync_once().await {
        Err(SyncError::NoDirectReader { what }) => eprintln!("held: {what}"),
        other => panic!("the first sync must be held against the adopted table: {other:?}"),
    }
    assert_eq!(
        restarted.dataplane().list_table().unwrap(),
        listed,
        "the table keeps enforcing what it held"
    );
    assert_eq!(restarted.dataplane().full_loads(), 0);
    // What the new dataplane reported from the table.
    let adopted = restarted.dataplane().adopted().expect("the table is read").clone();
    // The table names the identities its rules refer to (here p0's).
    assert_eq!(adopted.identities, 1);
    assert_eq!(adopted.endpoints.len(), 20);
    assert!(adopted
        .endpoints
        .iter()
        .all(|e| e.isolated_ingress && e.isolated_egress));
    assert!(adopted.endpoints.iter().all(|e| e.ipv4.is_some()));
    drop(restarted);
    srv.shutdown().await;
    drop(ns);
}
