//! Connection semantics through the sync loop: the Namespace annotation
//! `npm.io/established` reaches the dataplane as the set of `enforce`
//! endpoints before the sync programs anything, and the cut events the
//! dataplane reports become `npm_connections_cut_total`.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Namespace;
use kube::api::ObjectMeta;
use kube::runtime::watcher::Event;
use npm_common::{DenyEvent, Reason, DIR_INGRESS};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{Compiled, CompiledDiff};

use super::{endpoint_id, listed_cache, node_a, Mem};
use crate::reconcile::established::{Established, ESTABLISHED_ANNOTATION};
use crate::reconcile::AgentDataplane;

/// [`Mem`] that records each `enforce` set it is handed and reports the
/// events queued in `events`.
#[derive(Clone, Default)]
struct Recording {
    mem: Mem,
    sets: Arc<Mutex<Vec<BTreeSet<u32>>>>,
    events: Arc<Mutex<Vec<DenyEvent>>>,
}

impl Dataplane for Recording {
    fn sync_full(&mut self, c: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
        self.mem.sync_full(c, i)
    }
    fn apply(&mut self, d: &CompiledDiff, n: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
        self.mem.apply(d, n, i)
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
    fn set_established_enforce(&mut self, endpoints: BTreeSet<u32>) {
        self.sets.lock().unwrap().push(endpoints);
    }
}

impl AgentDataplane for Recording {
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}

fn namespace_a(rv: &str, established: Option<&str>) -> Namespace {
    Namespace {
        metadata: ObjectMeta {
            name: Some("a".into()),
            resource_version: Some(rv.into()),
            annotations: established.map(|v| BTreeMap::from([(ESTABLISHED_ANNOTATION.to_string(), v.to_string())])),
            ..Default::default()
        },
        ..Default::default()
    }
}

#[tokio::test]
async fn the_namespace_annotation_reaches_the_dataplane() {
    let cache = listed_cache(&[("p", "10.2.0.1")]);
    let dp = Recording::default();
    let mut syncer = node_a(&cache, dp.clone()).build();
    syncer.sync_once().await.unwrap();
    let id = endpoint_id(&dp.mem.0.lock().unwrap(), "p").expect("endpoint p");
    assert_eq!(
        dp.sets.lock().unwrap().last(),
        Some(&BTreeSet::new()),
        "keep by default"
    );

    cache.handle(Event::Apply(namespace_a("10", Some("enforce"))));
    syncer.sync_once().await.unwrap();
    assert_eq!(dp.sets.lock().unwrap().last(), Some(&BTreeSet::from([id])));

    // `keep` on the namespace wins over a cluster-wide `enforce`.
    cache.handle(Event::Apply(namespace_a("11", Some("keep"))));
    syncer.established.default = Established::Enforce;
    syncer.sync_once().await.unwrap();
    assert_eq!(dp.sets.lock().unwrap().last(), Some(&BTreeSet::new()));
    cache.handle(Event::Apply(namespace_a("12", None)));
    syncer.sync_once().await.unwrap();
    assert_eq!(dp.sets.lock().unwrap().last(), Some(&BTreeSet::from([id])));
}

#[tokio::test]
async fn cut_events_are_counted_by_namespace_and_direction() {
    let cache = listed_cache(&[("p", "10.2.0.1")]);
    let metrics = cache.metrics().clone();
    let dp = Recording::default();
    let mut syncer = node_a(&cache, dp.clone()).build();
    syncer.sync_once().await.unwrap();
    let id = endpoint_id(&dp.mem.0.lock().unwrap(), "p").expect("endpoint p");
    let cut = DenyEvent {
        endpoint: id,
        direction: DIR_INGRESS,
        reason: Reason::ConnectionCut as u8,
        protocol: 6,
        family: 4,
        ..DenyEvent::default()
    };
    let later = DenyEvent {
        reason: Reason::CutFlow as u8,
        ..cut
    };
    dp.events.lock().unwrap().extend([cut, later, cut]);
    syncer.poll_stats();
    let text = metrics.render();
    let line = text
        .lines()
        .find(|l| {
            l.starts_with("npm_connections_cut_total{")
                && l.contains(r#"namespace="a""#)
                && l.contains(r#"direction="ingress""#)
        })
        .unwrap_or_else(|| panic!("no cut series:\n{text}"));
    assert!(
        line.ends_with(" 2"),
        "one per ConnectionCut event, not per CutFlow: {line}"
    );
}
