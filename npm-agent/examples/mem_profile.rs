//! Heap profile of the agent's state by part, without the API server or
//! the kernel: a counting allocator measures the heap held after each
//! stage of the agent's pipeline at the bench's shape (`bench_agent`: ten
//! namespaces, one policy per ten pods, one label per pod from 100 values,
//! 1 % of the pods local), and reports bytes per pod for each part:
//!
//! - the pod store (the slim pods of a complete list, as the watcher
//!   deserializes them);
//! - the relist buffer (a second list of the same pods beside the first,
//!   before `InitDone`);
//! - the converted snapshot (npm-policy's model), then the incremental
//!   compiler built from it (snapshot, caches, compiled tables).
//!
//! `cargo run --release -p npm-agent --example mem_profile [-- PODS]`
//! (ends with one JSON line).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::runtime::watcher::Event;
use npm_agent::cni::NodeFacts;
use npm_agent::k8s::pods::Pod;
use npm_agent::k8s::Cache;
use npm_agent::reconcile::compiler::{self, Incremental, LastValid};
use npm_agent::telemetry::Metrics;
use npm_policy::compiled::CompileOptions;

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards every call to the system allocator unchanged; only
// counts the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LIVE.fetch_add(l.size(), Ordering::Relaxed);
        // SAFETY: the caller's layout, passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: a pointer of this allocator with its layout.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LIVE.fetch_add(new, Ordering::Relaxed);
        LIVE.fetch_sub(l.size(), Ordering::Relaxed);
        // SAFETY: as `dealloc` and `alloc`.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

fn ip_of(i: usize) -> String {
    format!("10.{}.{}.{}", 100 + i / 65536, (i / 256) % 256, i % 256)
}

/// The bench's pod, as the API server sends it (with a uid,
/// resourceVersion and creationTimestamp as a real one has).
fn pod_json(i: usize, namespaces: usize) -> String {
    let ns = format!("bench{}", i % namespaces);
    let node = if i.is_multiple_of(100) { "node-a" } else { "node-b" };
    let ip = ip_of(i);
    serde_json::json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p{i}"), "namespace": ns,
                     "uid": format!("0b6f3c5e-{i:04x}-4d1f-9a3e-5c2f8e7d{i:04x}"),
                     "resourceVersion": format!("{}", 1000 + i),
                     "creationTimestamp": "2026-12-07T10:00:00Z",
                     "labels": {"app": format!("g{}", i % 100)}},
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "agnhost"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}
    })
    .to_string()
}

fn policy(i: usize, namespaces: usize) -> NetworkPolicy {
    serde_json::from_value(serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": format!("np{i}"), "namespace": format!("bench{}", i % namespaces),
                     "uid": format!("u-np{i}"), "resourceVersion": "1"},
        "spec": {"podSelector": {"matchLabels": {"app": format!("g{}", i % 100)}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": format!("g{}", (i + 1) % 100)}}}],
                              "ports": [{"port": 1000 + (i % 100) as i32}]}]}
    }))
    .unwrap()
}

fn list_pods(cache: &Cache, pods: usize, namespaces: usize) {
    cache.handle::<Pod>(Event::Init);
    for i in 0..pods {
        let p: Pod = serde_json::from_str(&pod_json(i, namespaces)).unwrap();
        cache.handle(Event::InitApply(p));
    }
}

fn main() -> anyhow::Result<()> {
    let pods: usize = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(100_000);
    let policies = pods / 10;
    let namespaces = 10;
    let per_pod = |bytes: usize| bytes as f64 / pods as f64;
    let mut parts = serde_json::Map::new();
    let mut report = |name: &str, bytes: usize| {
        eprintln!(
            "{name:>24}: {:>8.1} MB {:>7.0} B/pod",
            bytes as f64 / 1e6,
            per_pod(bytes)
        );
        parts.insert(format!("{name}_b_per_pod"), serde_json::json!(per_pod(bytes).round()));
    };

    let cache = Cache::new(Metrics::new()?);
    let base = live();
    cache.handle::<Namespace>(Event::Init);
    for n in 0..namespaces {
        let ns: Namespace = serde_json::from_value(
            serde_json::json!({"metadata": {"name": format!("bench{n}"), "uid": format!("ns{n}"), "resourceVersion": "1"}}),
        )?;
        cache.handle(Event::InitApply(ns));
    }
    cache.handle::<Namespace>(Event::InitDone);
    cache.handle::<NetworkPolicy>(Event::Init);
    for i in 0..policies {
        cache.handle(Event::InitApply(policy(i, namespaces)));
    }
    cache.handle::<NetworkPolicy>(Event::InitDone);
    let t = live();
    report("policies", t - base);
    list_pods(&cache, pods, namespaces);
    cache.handle::<Pod>(Event::InitDone);
    let stored = live();
    report("pod_store", stored - t);

    // A relist of the same pods (new resourceVersions would make them all
    // changes; the same ones keep the stored pointers).
    list_pods(&cache, pods, namespaces);
    report("relist_buffer_same", live() - stored);
    cache.handle::<Pod>(Event::InitDone);
    let state = cache.complete().expect("all listed");
    let facts = Arc::new(NodeFacts::default());
    let opts = CompileOptions {
        node_name: "node-a".into(),
        node_ips: Vec::new(),
        allow_host_egress: false,
        report_new: false,
    };
    let before = live();
    let snapshot = compiler::snapshot(&state, &facts, &LastValid::default());
    report("snapshot", live() - before);
    drop(snapshot);
    let before = live();
    let inc = Incremental::new(&state, &facts, &opts, None);
    let compiled = live() - before;
    report("incremental_compiler", compiled);
    eprintln!(
        "compiled: {} ipcache, {} endpoints, {} policy entries",
        inc.compiled().ipcache.len(),
        inc.compiled().endpoints.len(),
        inc.compiled().policy.len()
    );
    report("total", live() - base);
    parts.insert("pods".into(), pods.into());
    println!("{}", serde_json::Value::Object(parts));
    Ok(())
}
