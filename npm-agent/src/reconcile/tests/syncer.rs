//! Sync attempts over the in-memory dataplanes: the background
//! cross-check's repair, ids never reused after a failed apply, retries.

use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use kube::runtime::watcher::Event;

use super::{endpoint_id, listed_cache, named_pod, node_a, node_a_config, Flaky, Mem};
use crate::reconcile::{SyncConfig, SyncError};
use crate::telemetry::metrics::sample;

/// The background cross-check catches a change the incremental compile
/// missed: the mismatch is counted, the sync loop is woken (a change is
/// marked unprogrammed) and the next sync rebuilds and programs the
/// full compile's result.
#[tokio::test]
async fn background_cross_check_repairs_a_missed_change() {
    let cache = listed_cache(&[("p", "10.2.0.1")]);
    let metrics = cache.metrics().clone();
    let dp = Mem::default();
    let mut syncer = node_a(&cache, dp.clone()).build();
    assert!(syncer.sync_once().await.unwrap().full);
    let (old, new): (IpAddr, IpAddr) = ("10.2.0.1".parse().unwrap(), "10.2.0.9".parse().unwrap());
    assert!(dp.0.lock().unwrap().ipcache.contains_key(&old));

    // The pod moves; the incremental compiler is made to miss it.
    cache.handle(Event::Apply(named_pod("p", "10.2.0.9", 3)));
    let state = cache.complete().unwrap();
    syncer.incremental.pretend_compiled(&state);
    let _ = cache.take_first_unprogrammed();
    let missed = syncer.sync_once().await.unwrap();
    assert!(!missed.applied, "the missed change is not programmed by this sync");
    let mismatches = || sample(&metrics.render(), "npm_incremental_mismatch_total").unwrap_or(0.0);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut woken = false;
    while mismatches() < 1.0 || !dp.0.lock().unwrap().ipcache.contains_key(&new) {
        assert!(Instant::now() < deadline, "the cross-check did not repair the state");
        tokio::time::sleep(Duration::from_millis(10)).await;
        // Debug builds start a cross-check after every sync (one at a
        // time); a sync also collects a finished one's result.
        woken |= cache.take_first_unprogrammed().is_some();
        syncer.sync_once().await.unwrap();
    }
    // The checker wakes the loop right after handing over its result.
    let deadline = Instant::now() + Duration::from_secs(5);
    while !woken && Instant::now() < deadline {
        woken = cache.first_unprogrammed().is_some();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    assert!(woken, "the mismatch woke the sync loop");
    assert_eq!(mismatches(), 1.0);
    let k = dp.0.lock().unwrap();
    assert!(!k.ipcache.contains_key(&old));
    assert_eq!(
        k.endpoints.values().next().and_then(|e| e.ipv4),
        Some("10.2.0.9".parse().unwrap())
    );
}

/// B2: an apply that fails midway may leave new endpoint ids in the
/// kernel; the rebuild after it must not hand them out again.
#[tokio::test]
async fn failed_apply_never_reuses_endpoint_ids() {
    let cache = listed_cache(&[("p", "10.2.0.1")]);
    let dp = Flaky::default();
    let mut syncer = node_a(&cache, dp.clone()).build();
    assert!(syncer.sync_once().await.unwrap().full);
    // Pod b comes; its apply fails after writing b's endpoint.
    cache.handle(Event::Apply(named_pod("b", "10.2.0.2", 10)));
    dp.fail_applies.store(1, Ordering::SeqCst);
    assert!(matches!(
        syncer.sync_once().await,
        Err(SyncError::Dataplane { op: "apply", .. })
    ));
    let failed_id = {
        let k = dp.mem.0.lock().unwrap();
        *k.endpoints.keys().max().unwrap()
    };
    // b goes, c comes: c must not get b's id (and its conntrack).
    cache.handle(Event::Delete(named_pod("b", "10.2.0.2", 11)));
    cache.handle(Event::Apply(named_pod("c", "10.2.0.3", 12)));
    assert!(syncer.sync_once().await.unwrap().full);
    let prog = &syncer.programmed().unwrap().0;
    let c = endpoint_id(prog, "c").unwrap();
    assert!(
        c > failed_id,
        "pod c got endpoint id {c}, not above the failed apply's {failed_id}"
    );
    assert!(endpoint_id(prog, "b").is_none());
}

/// B2: the same when the very first (full) sync fails: nothing is
/// programmed yet, but the kernel may hold the attempted ids.
#[tokio::test]
async fn failed_first_sync_never_reuses_endpoint_ids() {
    let cache = listed_cache(&[("b", "10.2.0.2")]);
    let dp = Flaky::default();
    dp.fail_full.store(1, Ordering::SeqCst);
    let mut syncer = node_a(&cache, dp.clone()).build();
    assert!(matches!(
        syncer.sync_once().await,
        Err(SyncError::Dataplane { op: "sync_full", .. })
    ));
    let failed_id = *dp.mem.0.lock().unwrap().endpoints.keys().max().unwrap();
    cache.handle(Event::Delete(named_pod("b", "10.2.0.2", 11)));
    cache.handle(Event::Apply(named_pod("c", "10.2.0.3", 12)));
    assert!(syncer.sync_once().await.unwrap().full);
    let c = endpoint_id(&syncer.programmed().unwrap().0, "c").unwrap();
    assert!(
        c > failed_id,
        "pod c got endpoint id {c}, not above the failed sync's {failed_id}"
    );
}

/// B3: retries keep firing when the backoff is longer than the stats
/// interval (the stats tick must not postpone them).
#[tokio::test]
async fn retries_fire_although_the_stats_tick_is_shorter() {
    let cache = listed_cache(&[("p", "10.2.0.1")]);
    let dp = Flaky::default();
    // Backoff 100, 200, 400 ms: each longer than the 20 ms stats tick.
    dp.fail_full.store(3, Ordering::SeqCst);
    let cfg = SyncConfig {
        debounce: Duration::from_millis(1),
        stats_interval: Duration::from_millis(20),
        ..node_a_config()
    };
    let syncer = node_a(&cache, dp.clone()).config(cfg).build();
    let readiness = syncer.readiness();
    let task = tokio::spawn(syncer.run());
    let deadline = Instant::now() + Duration::from_secs(10);
    while !readiness.first_sync_done() {
        assert!(
            Instant::now() < deadline,
            "the failed sync was not retried ({} failures left)",
            dp.fail_full.load(Ordering::SeqCst)
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    task.abort();
    assert_eq!(dp.fail_full.load(Ordering::SeqCst), 0);
    assert!(dp
        .mem
        .0
        .lock()
        .unwrap()
        .ipcache
        .contains_key(&"10.2.0.1".parse::<IpAddr>().unwrap()));
}
