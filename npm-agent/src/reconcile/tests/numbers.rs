//! The number ranges at the sync: a sync whose compile needs a pod
//! identity past its range is refused with a readiness reason and a
//! metric, and the last good state stays programmed; a number is never
//! recycled to a new label set.

use std::net::IpAddr;

use kube::runtime::watcher::Event;
use npm_common::IDENTITY_FIRST_POD;
use npm_policy::numbers::{NumberKind, NumberLimits};

use super::{listed_cache, node_a, node_a_config, Mem};
use crate::k8s::pods::Pod as ApiPod;
use crate::reconcile::numbers::CHECK_NUMBER_SPACE;
use crate::reconcile::{SyncConfig, SyncError};
use crate::telemetry::metrics::sample;

fn app_pod(name: &str, app: &str, ip: &str, rv: u64) -> ApiPod {
    (*crate::reconcile::compiler::tests::pod("a", name, rv, ip, app, "node-a")).clone()
}

/// The failure of the `number-space` readiness check, if it fails.
fn number_space(syncer: &crate::reconcile::Syncer<Mem>) -> Option<String> {
    syncer
        .readiness()
        .readiness()
        .into_iter()
        .find(|c| c.name == CHECK_NUMBER_SPACE)
        .and_then(|c| c.failure)
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[tokio::test]
async fn a_sync_past_the_identity_range_is_refused_and_the_last_good_state_stays() {
    // Room for two pod identities: "web" and "db".
    let cfg = SyncConfig {
        numbers: NumberLimits {
            identity_end: IDENTITY_FIRST_POD + 2,
            ..NumberLimits::default()
        },
        // Removals in this test are not what it is about.
        mass_delete_threshold: 0.99,
        ..node_a_config()
    };
    let cache = listed_cache(&[]);
    for (i, name) in ["w1", "w2", "w3"].iter().enumerate() {
        cache.handle(Event::Apply(app_pod(
            name,
            "web",
            &format!("10.2.0.{}", i + 1),
            10 + i as u64,
        )));
    }
    cache.handle(Event::Apply(app_pod("db", "db", "10.2.0.9", 20)));
    let metrics = cache.metrics().clone();
    let dp = Mem::default();
    let mut syncer = node_a(&cache, dp.clone()).config(cfg).build();
    assert!(syncer.sync_once().await.unwrap().full);
    assert_eq!(number_space(&syncer), None);
    let programmed = dp.0.lock().unwrap().clone();
    assert_eq!(programmed.ids.identities.len(), 2);
    assert_eq!(programmed.endpoints.len(), 4);

    // A third label set (a Job's run): no number is left for it.
    cache.handle(Event::Apply(app_pod("job", "job-1", "10.2.0.20", 30)));
    let refused = syncer.sync_once().await;
    match &refused {
        Err(SyncError::NumbersExhausted { source }) => {
            assert_eq!(source.kind, NumberKind::Identity);
            assert_eq!(source.end, IDENTITY_FIRST_POD + 2);
        }
        other => panic!("expected the sync to be refused, got {other:?}"),
    }
    let reason = number_space(&syncer).expect("the number-space readiness check fails");
    assert!(reason.contains("identity numbers exhausted"), "{reason}");
    assert!(!syncer.readiness().is_ready());
    let errors = || sample(&metrics.render(), "npm_errors_total{kind=\"numbers\"}").unwrap_or(0.0);
    assert_eq!(errors(), 1.0);
    // Nothing of the refused compile reached the kernel: the job pod has no
    // address entry and no endpoint; everything else is as it was.
    {
        let k = dp.0.lock().unwrap();
        assert!(!k.ipcache.contains_key(&ip("10.2.0.20")));
        assert_eq!(k.ipcache, programmed.ipcache);
        assert_eq!(k.endpoints, programmed.endpoints);
        assert_eq!(k.policy, programmed.policy);
    }
    assert_eq!(syncer.programmed().unwrap().0.ids, programmed.ids);

    // "db" goes: its number is not recycled for the job (conntrack
    // entries and policy keys may still name it), so the job is still
    // refused; "db"'s removal waits with it (nothing is programmed).
    cache.handle(Event::Delete(app_pod("db", "db", "10.2.0.9", 31)));
    assert!(matches!(
        syncer.sync_once().await,
        Err(SyncError::NumbersExhausted { .. })
    ));
    assert_eq!(errors(), 2.0);
    assert!(dp.0.lock().unwrap().ipcache.contains_key(&ip("10.2.0.9")));

    // The job goes too: the sync goes through and the check clears.
    cache.handle(Event::Delete(app_pod("job", "job-1", "10.2.0.20", 32)));
    let ok = syncer.sync_once().await.unwrap();
    assert!(ok.applied);
    assert_eq!(number_space(&syncer), None);
    let k = dp.0.lock().unwrap();
    assert!(!k.ipcache.contains_key(&ip("10.2.0.9")));
    assert!(k.ipcache.contains_key(&ip("10.2.0.1")));
    assert_eq!(k.endpoints.len(), 3);
}
