//! Unit tests of the sync loop, and their fixture: in-memory dataplanes,
//! a resolver that finds every interface, a complete cache of node
//! `node-a`, and [`node_a`], the syncer builder the tests start from.

mod config;
mod established;
mod guard;
mod numbers;
mod syncer;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::ObjectMeta;
use kube::runtime::watcher::Event;
use npm_common::IDENTITY_FIRST_POD;
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{CompileOptions, Compiled, CompiledDiff, IdentityKey};

use super::{AgentDataplane, SyncConfig, Syncer, SyncerBuilder};
use crate::k8s::pods::Pod as ApiPod;
use crate::k8s::Cache;
use crate::node::{Resolve, Resolved};
use crate::telemetry::metrics::Metrics;

/// An in-memory dataplane: the "kernel" is a compiled state.
#[derive(Clone, Default)]
struct Mem(Arc<Mutex<Compiled>>);

impl Dataplane for Mem {
    fn sync_full(&mut self, compiled: &Compiled, _: &Interfaces) -> Result<(), DataplaneError> {
        *self.0.lock().unwrap() = compiled.clone();
        Ok(())
    }
    fn apply(&mut self, diff: &CompiledDiff, _: &Compiled, _: &Interfaces) -> Result<(), DataplaneError> {
        let mut k = self.0.lock().unwrap();
        diff.ipcache.apply_to(&mut k.ipcache);
        diff.cidrs.apply_to(&mut k.cidrs);
        diff.endpoints.apply_to(&mut k.endpoints);
        diff.policy.apply_to_policy(&mut k.policy);
        Ok(())
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
}

impl AgentDataplane for Mem {}

struct AllFound;

impl Resolve for AllFound {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        Resolved {
            interfaces: compiled.endpoints.keys().map(|&id| (id, 100 + id)).collect(),
            missing: Vec::new(),
        }
    }
}

/// A dataplane that fails its first `fail_applies` applies and first
/// `fail_full` full syncs; each failure first writes the target's
/// endpoints (a failure midway), like a real partial write.
#[derive(Clone, Default)]
struct Flaky {
    mem: Mem,
    fail_applies: Arc<AtomicUsize>,
    fail_full: Arc<AtomicUsize>,
}

fn take_failure(n: &AtomicUsize) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

fn injected() -> DataplaneError {
    DataplaneError::Kernel {
        op: "test".into(),
        detail: "injected failure".into(),
    }
}

impl Dataplane for Flaky {
    fn sync_full(&mut self, compiled: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
        if take_failure(&self.fail_full) {
            self.mem.0.lock().unwrap().endpoints = compiled.endpoints.clone();
            return Err(injected());
        }
        self.mem.sync_full(compiled, i)
    }
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, i: &Interfaces) -> Result<(), DataplaneError> {
        if take_failure(&self.fail_applies) {
            diff.endpoints.apply_to(&mut self.mem.0.lock().unwrap().endpoints);
            return Err(injected());
        }
        self.mem.apply(diff, next, i)
    }
    fn counters(&self) -> Result<Counters, DataplaneError> {
        Ok(Counters::default())
    }
}

impl AgentDataplane for Flaky {}

fn node_a_config() -> SyncConfig {
    SyncConfig {
        compile: CompileOptions {
            node_name: "node-a".into(),
            node_ips: Vec::new(),
            allow_host_egress: false,
            report_new: false,
        },
        ..SyncConfig::default()
    }
}

/// A complete cache with namespace `a` (no policies) and `pods`.
fn listed_cache(pods: &[(&str, &str)]) -> Arc<Cache> {
    let cache = Cache::new(Metrics::new().unwrap());
    cache.handle::<Namespace>(Event::Init);
    cache.handle(Event::InitApply(Namespace {
        metadata: ObjectMeta {
            name: Some("a".into()),
            resource_version: Some("1".into()),
            ..Default::default()
        },
        ..Default::default()
    }));
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    cache.handle::<NetworkPolicy>(Event::InitDone);
    cache.handle::<ApiPod>(Event::Init);
    for (i, (name, ip)) in pods.iter().enumerate() {
        cache.handle(Event::InitApply(named_pod(name, ip, 2 + i as u64)));
    }
    cache.handle::<ApiPod>(Event::InitDone);
    cache
}

fn named_pod(name: &str, ip: &str, rv: u64) -> ApiPod {
    (*crate::reconcile::compiler::tests::pod("a", name, rv, ip, name, "node-a")).clone()
}

fn endpoint_id(c: &Compiled, name: &str) -> Option<u32> {
    c.ids.endpoints.get(&format!("uid-a-{name}")).copied()
}

/// A compile with `ids` pod identities (and no endpoints).
fn with_identities(ids: usize) -> Compiled {
    let mut c = Compiled::default();
    for i in 0..ids as u32 {
        let key = IdentityKey {
            namespace: "ns".into(),
            namespace_labels: Default::default(),
            pod_labels: [("app".to_string(), format!("a{i}"))].into(),
            named_ports: Vec::new(),
        };
        c.ids.identities.insert(IDENTITY_FIRST_POD + i, key);
    }
    c
}

/// The syncer the tests start from: node `node-a` over `dp`, reading
/// `cache`, every interface found, no client (mass deletions stay held).
fn node_a<D: AgentDataplane>(cache: &Arc<Cache>, dp: D) -> SyncerBuilder<D> {
    Syncer::builder(cache.clone(), dp)
        .config(node_a_config())
        .resolver(Box::new(AllFound))
}

/// A compiled state of two endpoints, 1 and 2 (pods `ns/p1` and `ns/p2`,
/// uids `u1` and `u2`, identity 256, no addresses, not isolated).
pub(crate) fn two_endpoints() -> Compiled {
    use npm_policy::compiled::{Endpoint, PodRef};
    let mut c = Compiled::default();
    for id in [1, 2] {
        c.endpoints.insert(
            id,
            Endpoint {
                pod: PodRef {
                    namespace: "ns".into(),
                    name: format!("p{id}"),
                    uid: format!("u{id}"),
                },
                identity: 256,
                ipv4: None,
                ipv6: None,
                isolated_ingress: false,
                isolated_egress: false,
                tiers: Default::default(),
                report_new: false,
            },
        );
    }
    c
}
