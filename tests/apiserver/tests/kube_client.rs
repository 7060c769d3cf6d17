//! kube-rs 5 against npm-testapi: CRUD, status, patches, pagination, compaction, selected
//! watches, fault injection, validation and defaulting (the kube-runtime watcher and raw
//! watch recovery are in `kube_watch.rs`).

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::{Client, Config};
use npm_testapi::{Options, TestApiServer};
use serde_json::{json, Value};
use std::time::{Duration, Instant};

async fn start() -> (TestApiServer, Client) {
    start_with(Options {
        bookmark_interval: Duration::from_millis(200),
        ..Default::default()
    })
    .await
}

async fn start_with(opts: Options) -> (TestApiServer, Client) {
    let server = TestApiServer::start(opts).await.expect("server starts");
    let config = Config::new(server.url().parse().expect("url parses"));
    let client = Client::try_from(config).expect("client builds");
    (server, client)
}

fn ns_obj(name: &str) -> Namespace {
    serde_json::from_value(json!({"metadata": {"name": name, "labels": {"team": "a"}}})).unwrap()
}

fn pod_obj(name: &str, labels: Value) -> Pod {
    serde_json::from_value(json!({
        "metadata": {"name": name, "labels": labels},
        "spec": {"containers": [{"name": "c", "image": "agnhost:2.52",
                  "ports": [{"containerPort": 80, "name": "http"}]}]}
    }))
    .unwrap()
}

fn np_obj(name: &str, spec: Value) -> NetworkPolicy {
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": spec})).unwrap()
}

fn api_err(e: kube::Error) -> Box<kube::core::Status> {
    match e {
        kube::Error::Api(s) => s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

async fn raw(client: &Client, method: &str, uri: &str, ct: &str, body: Vec<u8>) -> Result<String, kube::Error> {
    let req = http::Request::builder()
        .method(method)
        .uri(uri)
        .header("content-type", ct)
        .body(body)
        .unwrap();
    client.request_text(req).await
}

#[tokio::test]
async fn crud_namespaces_pods_and_policies() {
    let (server, client) = start().await;
    let pp = PostParams::default();
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let ns = namespaces.create(&pp, &ns_obj("crud")).await.unwrap();
    let labels = ns.metadata.labels.clone().unwrap();
    assert_eq!(labels["kubernetes.io/metadata.name"], "crud");
    assert_eq!(labels["team"], "a");
    assert_eq!(ns.status.unwrap().phase.as_deref(), Some("Active"));
    assert!(ns.metadata.uid.is_some() && ns.metadata.creation_timestamp.is_some());
    let e = api_err(namespaces.create(&pp, &ns_obj("crud")).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (409, "AlreadyExists"));
    let all: Vec<String> = namespaces
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .into_iter()
        .map(|n| n.metadata.name.unwrap())
        .collect();
    assert_eq!(all, ["crud", "default", "kube-system"]);

    // Pods: create, get, defaulting, status subresource, update conflicts, patches.
    let pods: Api<Pod> = Api::namespaced(client.clone(), "crud");
    let p = pods.create(&pp, &pod_obj("web", json!({"app": "web"}))).await.unwrap();
    let rv1: u64 = p.metadata.resource_version.clone().unwrap().parse().unwrap();
    assert_eq!(p.status.as_ref().unwrap().phase.as_deref(), Some("Pending"));
    assert_eq!(p.metadata.generation, Some(1));
    let c = &p.spec.as_ref().unwrap().containers[0];
    assert_eq!(c.ports.as_ref().unwrap()[0].protocol.as_deref(), Some("TCP"));
    let got = pods.get("web").await.unwrap();
    assert_eq!(got.metadata.uid, p.metadata.uid);
    let missing = api_err(pods.get("nope").await.unwrap_err());
    assert_eq!((missing.code, missing.reason.as_str()), (404, "NotFound"));
    let other_ns: Api<Pod> = Api::namespaced(client.clone(), "absent");
    let e = api_err(other_ns.create(&pp, &pod_obj("x", json!({}))).await.unwrap_err());
    assert_eq!(e.code, 404);
    assert!(e.message.contains("namespaces \"absent\" not found"), "{}", e.message);

    // Status via the subresource; status in a main-resource update is ignored.
    let st = pods
        .patch_status(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"phase": "Running", "podIP": "10.0.0.5"}})),
        )
        .await
        .unwrap();
    assert_eq!(st.status.as_ref().unwrap().pod_ip.as_deref(), Some("10.0.0.5"));
    let mut upd = st.clone();
    upd.status.as_mut().unwrap().phase = Some("Failed".into());
    upd.metadata.labels.as_mut().unwrap().insert("v".into(), "2".into());
    let upd = pods.replace("web", &pp, &upd).await.unwrap();
    assert_eq!(upd.status.as_ref().unwrap().phase.as_deref(), Some("Running"));
    assert_eq!(upd.metadata.labels.as_ref().unwrap()["v"], "2");
    let rv2: u64 = upd.metadata.resource_version.clone().unwrap().parse().unwrap();
    assert!(rv2 > rv1);
    let mut st2 = upd.clone();
    st2.status.as_mut().unwrap().phase = Some("Succeeded".into());
    let st2 = pods.replace_status("web", &pp, &st2).await.unwrap();
    assert_eq!(st2.status.unwrap().phase.as_deref(), Some("Succeeded"));
    // Stale resourceVersion on update: 409 Conflict.
    let e = api_err(pods.replace("web", &pp, &upd).await.unwrap_err());
    assert_eq!((e.code, e.reason.as_str()), (409, "Conflict"));

    // Merge, strategic (as merge), JSON patch, server-side apply.
    let m = pods
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"v": null, "m": "1"}}})),
        )
        .await
        .unwrap();
    let l = m.metadata.labels.unwrap();
    assert!(!l.contains_key("v") && l["m"] == "1" && l["app"] == "web");
    let s = pods
        .patch(
            "web",
            &PatchParams::default(),
            &Patch::Strategic(json!({"metadata": {"labels": {"s": "1"}}})),
        )
        .await
        .unwrap();
    assert_eq!(s.metadata.labels.unwrap()["s"], "1");
    let out = raw(
        &client,
        "PATCH",
        "/api/v1/namespaces/crud/pods/web",
        "application/json-patch+json",
        br#"[{"op":"add","path":"/metadata/labels/j","value":"1"},{"op":"remove","path":"/metadata/labels/s"}]"#
            .to_vec(),
    )
    .await
    .unwrap();
    let v: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["metadata"]["labels"]["j"], "1");
    assert!(v["metadata"]["labels"].get("s").is_none());
    let applied = pods
        .patch(
            "applied",
            &PatchParams::apply("npm-test"),
            &Patch::Apply(
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "applied"},
                "spec": {"containers": [{"name": "c", "image": "x:1"}]}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(applied.metadata.namespace.as_deref(), Some("crud"));
    let applied2 = pods
        .patch(
            "applied",
            &PatchParams::apply("npm-test"),
            &Patch::Apply(
                json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "applied", "labels": {"a": "b"}}}),
            ),
        )
        .await
        .unwrap();
    assert_eq!(applied2.metadata.labels.unwrap()["a"], "b");
    assert_eq!(applied2.metadata.uid, applied.metadata.uid);

    // Network policies: defaulting on create, generation bump on spec change.
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "crud");
    let np = nps
        .create(
            &pp,
            &np_obj(
                "allow",
                json!({"podSelector": {}, "ingress": [{"ports": [{"port": 80}]}], "egress": [{}]}),
            ),
        )
        .await
        .unwrap();
    let spec = np.spec.clone().unwrap();
    assert_eq!(spec.policy_types.unwrap(), ["Ingress", "Egress"]);
    assert_eq!(
        spec.ingress.unwrap()[0].ports.as_ref().unwrap()[0].protocol.as_deref(),
        Some("TCP")
    );
    let np2 = nps
        .patch(
            "allow",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"egress": null, "policyTypes": null}})),
        )
        .await
        .unwrap();
    assert_eq!(np2.spec.unwrap().policy_types.unwrap(), ["Ingress"]);
    assert_eq!(np2.metadata.generation, Some(2));
    let all_nps: Api<NetworkPolicy> = Api::all(client.clone());
    assert_eq!(all_nps.list(&ListParams::default()).await.unwrap().items.len(), 1);

    // Deleting returns the object; deleting a namespace deletes its objects.
    let del = pods.delete("applied", &DeleteParams::default()).await.unwrap();
    assert!(del.is_left());
    assert_eq!(api_err(pods.get("applied").await.unwrap_err()).code, 404);
    let cluster_pods: Api<Pod> = Api::all(client.clone());
    assert_eq!(cluster_pods.list(&ListParams::default()).await.unwrap().items.len(), 1);
    namespaces.delete("crud", &DeleteParams::default()).await.unwrap();
    assert!(cluster_pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .is_empty());
    assert!(all_nps.list(&ListParams::default()).await.unwrap().items.is_empty());
    server.shutdown().await;
}

#[tokio::test]
async fn selectors_on_list_and_watch() {
    let (server, client) = start().await;
    let pp = PostParams::default();
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for (name, app, node) in [("a", "web", "n1"), ("b", "db", "n1"), ("c", "web", "n2")] {
        let mut p = pod_obj(name, json!({"app": app}));
        p.spec.as_mut().unwrap().node_name = Some(node.into());
        pods.create(&pp, &p).await.unwrap();
    }
    let names = |l: kube::core::ObjectList<Pod>| -> Vec<String> {
        l.items.into_iter().map(|p| p.metadata.name.unwrap()).collect()
    };
    assert_eq!(
        names(pods.list(&ListParams::default().labels("app=web")).await.unwrap()),
        ["a", "c"]
    );
    assert_eq!(
        names(
            pods.list(&ListParams::default().labels("app in (db),app!=web"))
                .await
                .unwrap()
        ),
        ["b"]
    );
    assert_eq!(
        names(
            pods.list(&ListParams::default().fields("spec.nodeName=n1"))
                .await
                .unwrap()
        ),
        ["a", "b"]
    );
    assert_eq!(
        names(
            pods.list(&ListParams::default().fields("metadata.name=c,spec.nodeName=n2"))
                .await
                .unwrap()
        ),
        ["c"]
    );
    let e = api_err(
        pods.list(&ListParams::default().fields("spec.bogus=1"))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 400);

    // A watch with a label selector: label changes move objects in and out of it.
    let rv = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut w = pods
        .watch(&WatchParams::default().labels("app=web").timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    pods.patch(
        "b",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "web"}}})),
    )
    .await
    .unwrap();
    pods.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"app": "gone"}}})),
    )
    .await
    .unwrap();
    pods.patch(
        "c",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"x": "1"}}})),
    )
    .await
    .unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        match w.try_next().await.unwrap().unwrap() {
            WatchEvent::Added(p) => seen.push(format!("ADDED {}", p.metadata.name.unwrap())),
            WatchEvent::Modified(p) => seen.push(format!("MODIFIED {}", p.metadata.name.unwrap())),
            WatchEvent::Deleted(p) => seen.push(format!("DELETED {}", p.metadata.name.unwrap())),
            WatchEvent::Bookmark(_) => {}
            WatchEvent::Error(e) => panic!("watch error {e:?}"),
        }
    }
    assert_eq!(seen, ["ADDED b", "DELETED a", "MODIFIED c"]);
    server.shutdown().await;
}

#[tokio::test]
async fn paginated_lists_are_consistent_snapshots_and_expire_on_compaction() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    for i in 0..250 {
        pods.create(&pp, &pod_obj(&format!("p{i:03}"), json!({"i": i.to_string()})))
            .await
            .unwrap();
    }
    let first = pods.list(&ListParams::default().limit(100)).await.unwrap();
    assert_eq!(first.items.len(), 100);
    assert_eq!(first.metadata.remaining_item_count, Some(150));
    let snapshot_rv = first.metadata.resource_version.clone().unwrap();
    let token = first.metadata.continue_.clone().unwrap();
    // Changes after the first page are invisible to the rest of this list.
    pods.delete("p200", &DeleteParams::default()).await.unwrap();
    pods.create(&pp, &pod_obj("p150x", json!({}))).await.unwrap();
    pods.patch(
        "p201",
        &PatchParams::default(),
        &Patch::Merge(json!({"metadata": {"labels": {"changed": "1"}}})),
    )
    .await
    .unwrap();
    let mut names: Vec<String> = first.items.iter().map(|p| p.metadata.name.clone().unwrap()).collect();
    let mut cont = Some(token.clone());
    while let Some(c) = cont {
        let page = pods
            .list(&ListParams::default().limit(100).continue_token(&c))
            .await
            .unwrap();
        assert_eq!(page.metadata.resource_version.as_deref(), Some(snapshot_rv.as_str()));
        for p in &page.items {
            if p.metadata.name.as_deref() == Some("p201") {
                assert!(!p.metadata.labels.as_ref().unwrap().contains_key("changed"));
            }
        }
        names.extend(page.items.into_iter().map(|p| p.metadata.name.unwrap()));
        cont = page.metadata.continue_.filter(|c| !c.is_empty());
    }
    let expected: Vec<String> = (0..250).map(|i| format!("p{i:03}")).collect();
    assert_eq!(names, expected);
    // An exact list at the snapshot revision sees the same state; the current one does not.
    let exact = pods
        .list(
            &ListParams::default()
                .at(&snapshot_rv)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .unwrap();
    assert_eq!(exact.items.len(), 250);
    assert!(exact.items.iter().any(|p| p.metadata.name.as_deref() == Some("p200")));
    assert_eq!(pods.list(&ListParams::default()).await.unwrap().items.len(), 250);
    assert!(pods.get("p200").await.is_err());

    // Compaction mid-pagination: the continue token expires with 410.
    server.compact();
    let e = api_err(
        pods.list(&ListParams::default().limit(100).continue_token(&token))
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
    let e = api_err(
        pods.list(
            &ListParams::default()
                .at(&snapshot_rv)
                .matching(kube::api::VersionMatch::Exact),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, 410);
    // A fresh list works.
    assert_eq!(
        pods.list(&ListParams::default().limit(100)).await.unwrap().items.len(),
        100
    );
    server.shutdown().await;
}

#[tokio::test]
async fn ten_thousand_pods_paginate_fast() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    // Seed through the library (same store path as a POST), then check one HTTP create.
    let t0 = Instant::now();
    for i in 0..9_999 {
        let p = serde_json::to_value(pod_obj(&format!("pod-{i:05}"), json!({"app": "scale"}))).unwrap();
        server
            .create_object(npm_testapi::Kind::Pod, Some("default"), p)
            .unwrap();
    }
    pods.create(&PostParams::default(), &pod_obj("pod-09999", json!({"app": "scale"})))
        .await
        .unwrap();
    let created = t0.elapsed();
    let t1 = Instant::now();
    let mut pages = 0;
    let mut total = 0;
    let mut cont: Option<String> = None;
    let mut slowest = Duration::ZERO;
    loop {
        let mut lp = ListParams::default().limit(100);
        if let Some(c) = &cont {
            lp = lp.continue_token(c);
        }
        let tp = Instant::now();
        let page = pods.list(&lp).await.unwrap();
        slowest = slowest.max(tp.elapsed());
        pages += 1;
        total += page.items.len();
        cont = page.metadata.continue_.filter(|c| !c.is_empty());
        if cont.is_none() {
            break;
        }
    }
    let listed = t1.elapsed();
    assert_eq!((pages, total), (100, 10_000));
    // The same walk without client-side decoding into typed Pods (server cost + transfer).
    let t2 = Instant::now();
    let mut raw_pages = 0;
    let mut uri = "/api/v1/namespaces/default/pods?limit=100".to_string();
    loop {
        let text = raw(&client, "GET", &uri, "application/json", vec![]).await.unwrap();
        let v: Value = serde_json::from_str(&text).unwrap();
        raw_pages += 1;
        match v["metadata"]["continue"].as_str() {
            Some(c) => uri = format!("/api/v1/namespaces/default/pods?limit=100&continue={c}"),
            None => break,
        }
    }
    let raw_listed = t2.elapsed();
    assert_eq!(raw_pages, 100);
    eprintln!(
        "10k pods: created in {created:?}; 100 pages of 100 in {listed:?} ({:?}/page typed, slowest {slowest:?}); raw JSON {:?}/page",
        listed / 100,
        raw_listed / 100
    );
    // Generous bound for an unoptimised build on a shared 2-core machine.
    assert!(listed / 100 < Duration::from_millis(100), "pages too slow: {listed:?}");
    server.shutdown().await;
}

#[tokio::test]
async fn fault_injection_via_library_and_admin_endpoint() {
    let (server, client) = start().await;
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    // (kube-rs retries 503/429/504 by itself, so inject a 500.)
    server.fail_next(2, 500, Some("/api/v1/namespaces/default/pods"));
    for _ in 0..2 {
        let e = api_err(pods.list(&ListParams::default()).await.unwrap_err());
        assert_eq!(e.code, 500);
    }
    pods.list(&ListParams::default()).await.unwrap();
    // Admin endpoint: fail only list requests.
    raw(
        &client,
        "POST",
        "/admin/fail?count=1&status=500&lists=true",
        "application/json",
        vec![],
    )
    .await
    .unwrap();
    pods.create(&PostParams::default(), &pod_obj("ok", json!({})))
        .await
        .unwrap();
    assert_eq!(api_err(pods.list(&ListParams::default()).await.unwrap_err()).code, 500);
    pods.list(&ListParams::default()).await.unwrap();
    // Delay.
    raw(
        &client,
        "POST",
        "/admin/delay?count=1&ms=300&path=/api/v1/namespaces/default/pods/ok",
        "application/json",
        vec![],
    )
    .await
    .unwrap();
    let t = Instant::now();
    pods.get("ok").await.unwrap();
    assert!(t.elapsed() >= Duration::from_millis(300));
    let t = Instant::now();
    pods.get("ok").await.unwrap();
    assert!(t.elapsed() < Duration::from_millis(300));
    // Compaction through the admin endpoint.
    let rv = pods
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    pods.create(&PostParams::default(), &pod_obj("ok2", json!({})))
        .await
        .unwrap();
    let out: Value = serde_json::from_str(
        &raw(&client, "POST", "/admin/compact", "application/json", vec![])
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(out["compactedRevision"].as_u64(), Some(server.resource_version()));
    let e = api_err(
        pods.list(&ListParams::default().at(&rv).matching(kube::api::VersionMatch::Exact))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 410);
    let stats: Value = serde_json::from_str(
        &raw(&client, "GET", "/admin/stats", "application/json", vec![])
            .await
            .unwrap(),
    )
    .unwrap();
    assert_eq!(stats["injectedFailures"], 3);
    assert_eq!(stats["injectedDelays"], 1);
    assert!(stats["byVerb"]["list"].as_u64().unwrap() >= 6);
    assert_eq!(stats["byVerb"]["create"], 2);
    let e = raw(&client, "POST", "/admin/nonsense", "application/json", vec![])
        .await
        .unwrap_err();
    assert_eq!(api_err(e).code, 400);
    server.shutdown().await;
}

#[tokio::test]
async fn invalid_policies_answer_422_with_the_field_unless_validation_is_off() {
    let (server, client) = start().await;
    let nps: Api<NetworkPolicy> = Api::namespaced(client.clone(), "default");
    let pp = PostParams::default();
    let cases = [
        (
            json!({"podSelector": {}, "ingress": [{"from": [{}]}]}),
            "spec.ingress[0].from[0]",
        ),
        (
            json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "namespaceSelector": {}}]}]}),
            "spec.ingress[0].from[0]",
        ),
        (
            json!({"podSelector": {}, "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.0.0.0/8"]}}]}]}),
            "spec.egress[0].to[0].ipBlock.except[0]",
        ),
        (
            json!({"podSelector": {}, "egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.300/16"}}]}]}),
            "spec.egress[0].to[0].ipBlock.cidr",
        ),
        (
            json!({"podSelector": {}, "ingress": [{"ports": [{"port": 70000}]}]}),
            "spec.ingress[0].ports[0].port",
        ),
        (
            json!({"podSelector": {}, "ingress": [{"ports": [{"port": "no_such"}]}]}),
            "spec.ingress[0].ports[0].port",
        ),
        (
            json!({"podSelector": {}, "ingress": [{"ports": [{"port": "http", "endPort": 90}]}]}),
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            json!({"podSelector": {}, "ingress": [{"ports": [{"port": 100, "endPort": 90}]}]}),
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            json!({"podSelector": {}, "ingress": [{"ports": [{"protocol": "ICMP"}]}]}),
            "spec.ingress[0].ports[0].protocol",
        ),
        (
            json!({"podSelector": {}, "policyTypes": ["Ingress", "Both"]}),
            "spec.policyTypes[1]",
        ),
        (
            json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "In", "values": []}]}}),
            "spec.podSelector.matchExpressions[0].values",
        ),
    ];
    for (i, (spec, field)) in cases.iter().enumerate() {
        let e = api_err(
            nps.create(&pp, &np_obj(&format!("bad{i}"), spec.clone()))
                .await
                .unwrap_err(),
        );
        assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"), "case {i}");
        let causes = e.details.as_ref().expect("details").causes.clone();
        assert!(
            causes.iter().any(|c| c.field == *field),
            "case {i}: expected field {field}, got {causes:?}"
        );
        assert!(e.message.contains(field), "case {i}: {}", e.message);
    }
    // Updates are validated too.
    let good = nps
        .create(&pp, &np_obj("good", json!({"podSelector": {}})))
        .await
        .unwrap();
    let e = api_err(
        nps.patch(
            "good",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"ingress": [{"from": [{}]}]}})),
        )
        .await
        .unwrap_err(),
    );
    assert_eq!(e.code, 422);
    assert_eq!(
        nps.get("good").await.unwrap().metadata.resource_version,
        good.metadata.resource_version
    );
    // Validation off (admin endpoint): invalid objects are stored, defaulting still applies.
    raw(
        &client,
        "POST",
        "/admin/validation?enabled=false",
        "application/json",
        vec![],
    )
    .await
    .unwrap();
    let stored = nps.create(&pp, &np_obj("bad0", cases[0].0.clone())).await.unwrap();
    assert_eq!(stored.spec.unwrap().policy_types.unwrap(), ["Ingress"]);
    server.set_validation(true);
    assert_eq!(
        api_err(nps.create(&pp, &np_obj("bad1", cases[0].0.clone())).await.unwrap_err()).code,
        422
    );
    server.shutdown().await;
}

#[tokio::test]
async fn background_server_and_kubeconfig() {
    let server = tokio::task::spawn_blocking(|| TestApiServer::start_background(Options::default()).unwrap())
        .await
        .unwrap();
    let path = std::env::temp_dir().join(format!("npm-testapi-kc-{}.yaml", std::process::id()));
    server.kubeconfig(&path).unwrap();
    let kc = kube::config::Kubeconfig::read_from(&path).unwrap();
    let config = Config::from_custom_kubeconfig(kc, &Default::default()).await.unwrap();
    std::fs::remove_file(&path).unwrap();
    let client = Client::try_from(config).unwrap();
    let v = client.apiserver_version().await.unwrap();
    assert_eq!((v.major.as_str(), v.minor.as_str()), ("1", "34"));
    let nss: Api<Namespace> = Api::all(client);
    assert_eq!(nss.list(&ListParams::default()).await.unwrap().items.len(), 2);
    tokio::task::spawn_blocking(move || drop(server)).await.unwrap();
}
