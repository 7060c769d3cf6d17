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

/// [`Mem`] that records each `enforce` set it is handed and the sizes of
/// the diffs it applies, and reports the events queued in `events`.
#[derive(Clone, Default)]
struct Recording {
    mem: Mem,
    sets: Arc<Mutex<Vec<BTreeSet<u32>>>>,
    applies: Arc<Mutex<Vec<usize>>>,
    events: Arc<Mutex<Vec<DenyEvent>>>,
}

impl Dataplane for Recording {
    fn sync_full(&mut self, c: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
        self.mem.sync_full(c, i)
    }
    fn apply(&mut self, d: &CompiledDiff, n: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
        self.applies.lock().unwrap().push(d.len());
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

/// A switch of the annotation to `enforce`, nothing else changed: the
/// sync hands the new set and applies (an empty diff), so that the
/// dataplane judges the pod's kept connections now (the dataplane tests
/// `a_switch_to_enforce_alone_judges_the_kept_flows` show the cut). A
/// later sync with nothing new applies nothing; a switch back to `keep`
/// needs no apply, a switch to `enforce` again does. Before, the empty
/// diff was never applied: the switch waited for the next policy change.
#[tokio::test]
async fn a_switch_to_enforce_alone_is_applied() {
    let cache = listed_cache(&[("p", "10.2.0.1")]);
    let dp = Recording::default();
    let mut syncer = node_a(&cache, dp.clone()).build();
    syncer.sync_once().await.unwrap();
    let id = endpoint_id(&dp.mem.0.lock().unwrap(), "p").expect("endpoint p");
    syncer.sync_once().await.unwrap();
    let applied = |dp: &Recording| std::mem::take(&mut *dp.applies.lock().unwrap());
    let _ = applied(&dp);

    cache.handle(Event::Apply(namespace_a("10", Some("enforce"))));
    syncer.sync_once().await.unwrap();
    assert_eq!(dp.sets.lock().unwrap().last(), Some(&BTreeSet::from([id])));
    assert_eq!(applied(&dp), vec![0], "the switch alone is applied, an empty diff");
    syncer.sync_once().await.unwrap();
    assert_eq!(applied(&dp), Vec::<usize>::new(), "nothing new, nothing applied");

    cache.handle(Event::Apply(namespace_a("11", Some("keep"))));
    syncer.sync_once().await.unwrap();
    assert_eq!(applied(&dp), Vec::<usize>::new(), "leaving enforce cuts nothing");
    cache.handle(Event::Apply(namespace_a("12", Some("enforce"))));
    syncer.sync_once().await.unwrap();
    assert_eq!(applied(&dp), vec![0], "coming back is judged again");
}
