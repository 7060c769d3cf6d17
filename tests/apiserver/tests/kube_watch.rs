//! kube-rs 5 watches against npm-testapi: the kube-runtime watcher (initial and live
//! events, recovery from 410), raw watches from a compacted version, bookmarks, and the
//! streaming-list watcher with its initial-events-end bookmark.

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use kube::runtime::watcher;
use kube::{Client, Config};
use npm_testapi::{FaultRule, Options, TestApiServer};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn start() -> (TestApiServer, Client) {
    let server = TestApiServer::start(Options {
        bookmark_interval: Duration::from_millis(200),
        ..Default::default()
    })
    .await
    .expect("server starts");
    let client = Client::try_from(Config::new(server.url().parse().expect("url parses"))).expect("client builds");
    (server, client)
}

fn pod_obj(name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "agnhost:2.52",
                  "ports": [{"containerPort": 80, "name": "http"}]}]}
    }))
    .unwrap()
}

type WatcherStream = futures::stream::BoxStream<'static, watcher::Result<watcher::Event<Pod>>>;

async fn next_result(s: &mut WatcherStream) -> watcher::Result<watcher::Event<Pod>> {
    tokio::time::timeout(Duration::from_secs(10), s.next())
        .await
        .expect("watcher event within 10 s")
        .expect("stream continues")
}

async fn next(s: &mut WatcherStream) -> watcher::Event<Pod> {
    next_result(s).await.expect("watcher ok")
}

#[tokio::test]
async fn watcher_sees_init_and_live_events() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    pods.create(&pp, &pod_obj("before", json!({}))).await.unwrap();
    let mut stream = watcher(pods.clone(), watcher::Config::default().page_size(1)).boxed();
    assert!(matches!(next(&mut stream).await, watcher::Event::Init));
    match next(&mut stream).await {
        watcher::Event::InitApply(p) => assert_eq!(p.metadata.name.as_deref(), Some("before")),
        other => panic!("expected InitApply, got {other:?}"),
    }
    assert!(matches!(next(&mut stream).await, watcher::Event::InitDone));
    pods.create(&pp, &pod_obj("after", json!({}))).await.unwrap();
    match next(&mut stream).await {
        watcher::Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("after")),
        other => panic!("expected Apply, got {other:?}"),
    }
    pods.delete("before", &DeleteParams::default()).await.unwrap();
    match next(&mut stream).await {
        watcher::Event::Delete(p) => assert_eq!(p.metadata.name.as_deref(), Some("before")),
        other => panic!("expected Delete, got {other:?}"),
    }

    // Recovery: the watcher's next watch is delayed, meanwhile a pod is created and the
    // log compacted, so the re-watch gets 410 and the watcher relists.
    server.inject(FaultRule::delay(1, Duration::from_millis(700)).verb("watch"));
    server.drop_watches();
    tokio::time::sleep(Duration::from_millis(200)).await;
    pods.create(&pp, &pod_obj("during", json!({}))).await.unwrap();
    server.compact();
    let mut relisted = Vec::new();
    let mut saw_410 = false;
    loop {
        let ev = match next_result(&mut stream).await {
            Err(watcher::Error::WatchError(s)) if s.code == 410 => {
                saw_410 = true;
                continue;
            }
            other => other.expect("watcher ok"),
        };
        match ev {
            watcher::Event::Init => relisted.clear(),
            watcher::Event::InitApply(p) => relisted.push(p.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("expected a relist after 410, got {other:?}"),
        }
    }
    assert!(saw_410, "the re-watch should have been answered 410");
    assert_eq!(relisted, ["after", "during"]);
    assert!(server.stats().injected_delays >= 1);
    pods.delete("after", &DeleteParams::default()).await.unwrap();
    assert!(matches!(next(&mut stream).await, watcher::Event::Delete(_)));
    server.shutdown().await;
}

#[tokio::test]
async fn watch_from_compacted_version_gets_410_and_bookmarks_flow() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    let old_rv = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    pods.create(&pp, &pod_obj("x", json!({}))).await.unwrap();
    // Before compaction, watching from the old version replays the creation.
    let mut w = pods
        .watch(&WatchParams::default().timeout(5), &old_rv)
        .await
        .unwrap()
        .boxed();
    match w.try_next().await.unwrap().unwrap() {
        WatchEvent::Added(p) => assert_eq!(p.metadata.name.as_deref(), Some("x")),
        other => panic!("expected ADDED, got {other:?}"),
    }
    drop(w);
    server.compact();
    let mut w = pods
        .watch(&WatchParams::default().timeout(5), &old_rv)
        .await
        .unwrap()
        .boxed();
    match w.try_next().await.unwrap().unwrap() {
        WatchEvent::Error(s) => assert_eq!((s.code, s.reason.as_str()), (410, "Expired")),
        other => panic!("expected ERROR 410, got {other:?}"),
    }
    // Bookmarks carry the current resourceVersion.
    let cur = server.resource_version().to_string();
    let mut w = pods
        .watch(
            &WatchParams {
                bookmarks: true,
                ..Default::default()
            }
            .timeout(5),
            &cur,
        )
        .await
        .unwrap()
        .boxed();
    match tokio::time::timeout(Duration::from_secs(3), w.try_next())
        .await
        .unwrap()
        .unwrap()
        .unwrap()
    {
        WatchEvent::Bookmark(b) => assert_eq!(b.metadata.resource_version, cur),
        other => panic!("expected BOOKMARK, got {other:?}"),
    }
    // timeoutSeconds ends the stream.
    let t = Instant::now();
    let mut w = pods
        .watch(&WatchParams::default().timeout(1), &cur)
        .await
        .unwrap()
        .boxed();
    loop {
        match tokio::time::timeout(Duration::from_secs(5), w.try_next())
            .await
            .unwrap()
            .unwrap()
        {
            None => break,
            Some(WatchEvent::Bookmark(_)) => {}
            Some(other) => panic!("expected only bookmarks, got {other:?}"),
        }
    }
    assert!(t.elapsed() >= Duration::from_millis(900));
    server.shutdown().await;
}

#[tokio::test]
async fn streaming_list_watcher_uses_initial_events_and_end_bookmark() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    for n in ["s1", "s2"] {
        pods.create(&pp, &pod_obj(n, json!({}))).await.unwrap();
    }
    let mut stream: WatcherStream = watcher(pods.clone(), watcher::Config::default().streaming_lists()).boxed();
    assert!(matches!(next(&mut stream).await, watcher::Event::Init));
    let mut names = Vec::new();
    loop {
        match next(&mut stream).await {
            watcher::Event::InitApply(p) => names.push(p.metadata.name.unwrap()),
            watcher::Event::InitDone => break,
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(names, ["s1", "s2"]);
    pods.create(&pp, &pod_obj("s3", json!({}))).await.unwrap();
    match next(&mut stream).await {
        watcher::Event::Apply(p) => assert_eq!(p.metadata.name.as_deref(), Some("s3")),
        other => panic!("expected Apply, got {other:?}"),
    }
    assert_eq!(server.stats().by_verb.get("list"), None);
    server.shutdown().await;
}
