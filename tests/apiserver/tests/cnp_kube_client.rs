//! ClusterNetworkPolicy through kube-rs: 404 before the CRD, the CRD created as a typed
//! `CustomResourceDefinition`, kube's discovery resolving the kind, watches (ADDED, MODIFIED,
//! DELETED, bookmarks, 410 after compaction, DELETED for every object when the CRD goes),
//! paginated lists with continue tokens, fault injection, pruning by channel and 422 causes.

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{
    Api, DeleteParams, DynamicObject, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams,
};
use kube::core::{ApiResource, GroupVersionKind};
use kube::discovery::{Discovery, Scope};
use kube::{Client, Config};
use npm_testapi::{CnpChannel, Options, TestApiServer};
use serde_json::{json, Value};
use std::time::Duration;

async fn start(cnp_crd: Option<CnpChannel>) -> (TestApiServer, Client) {
    let server = TestApiServer::start(Options {
        bookmark_interval: Duration::from_millis(200),
        cnp_crd,
        ..Default::default()
    })
    .await
    .expect("server starts");
    let client = Client::try_from(Config::new(server.url().parse().expect("url"))).expect("client");
    (server, client)
}

fn gvk() -> GroupVersionKind {
    GroupVersionKind::gvk("policy.networking.k8s.io", "v1alpha2", "ClusterNetworkPolicy")
}

fn cnps(client: &Client) -> Api<DynamicObject> {
    Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(&gvk(), "clusternetworkpolicies"),
    )
}

fn cnp(name: &str, priority: i64, egress_to: Value) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": {"tier": "Baseline", "priority": priority, "subject": {"namespaces": {}},
                 "egress": [{"action": "Deny", "to": egress_to}]},
    }))
    .expect("object")
}

fn api_err(e: kube::Error) -> Box<kube::core::Status> {
    match e {
        kube::Error::Api(s) => s,
        other => panic!("expected an API error, got {other:?}"),
    }
}

fn name_of(o: &DynamicObject) -> String {
    o.metadata.name.clone().unwrap_or_default()
}

#[tokio::test]
async fn crd_created_by_kube_then_discovered_watched_and_paged() {
    let (server, client) = start(None).await;
    let api = cnps(&client);
    let e = api_err(api.list(&ListParams::default()).await.unwrap_err());
    assert_eq!(e.code, 404);

    // The vendored CRD as a typed object, created through kube.
    let crd: CustomResourceDefinition = serde_yaml::from_str(CnpChannel::Standard.crd_yaml()).expect("CRD parses");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let created = crds.create(&PostParams::default(), &crd).await.expect("CRD created");
    let status = created.status.expect("status set");
    let established = status.conditions.unwrap_or_default();
    assert!(established
        .iter()
        .any(|c| c.type_ == "Established" && c.status == "True"));
    assert_eq!(status.stored_versions, Some(vec!["v1alpha2".to_string()]));
    let e = api_err(crds.create(&PostParams::default(), &crd).await.unwrap_err());
    assert_eq!(e.code, 409);

    // kube's discovery resolves the kind, cluster-scoped.
    let discovery = Discovery::new(client.clone())
        .filter(&["policy.networking.k8s.io"])
        .run()
        .await
        .expect("discovery");
    let (ar, caps) = discovery.resolve_gvk(&gvk()).expect("ClusterNetworkPolicy discovered");
    assert_eq!(ar.plural, "clusternetworkpolicies");
    assert!(matches!(caps.scope, Scope::Cluster));

    // A watch from the list's resourceVersion sees ADDED, MODIFIED, DELETED and bookmarks.
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut stream = api
        .watch(&WatchParams::default().timeout(20), &rv)
        .await
        .unwrap()
        .boxed();
    let pp = PostParams::default();
    api.create(&pp, &cnp("a", 5, json!([{"networks": ["10.0.0.0/8"]}])))
        .await
        .unwrap();
    api.patch(
        "a",
        &PatchParams::default(),
        &Patch::Merge(json!({"spec": {"priority": 6}})),
    )
    .await
    .unwrap();
    api.delete("a", &DeleteParams::default()).await.unwrap();
    let mut seen = Vec::new();
    let mut bookmarks = 0;
    while seen.len() < 3 {
        let ev = tokio::time::timeout(Duration::from_secs(10), stream.try_next())
            .await
            .expect("event in time")
            .expect("watch ok")
            .expect("stream open");
        match ev {
            WatchEvent::Added(o) => seen.push(format!("ADDED {}", name_of(&o))),
            WatchEvent::Modified(o) => {
                assert_eq!(o.data["spec"]["priority"], 6);
                seen.push(format!("MODIFIED {}", name_of(&o)))
            }
            WatchEvent::Deleted(o) => seen.push(format!("DELETED {}", name_of(&o))),
            WatchEvent::Bookmark(_) => bookmarks += 1,
            WatchEvent::Error(e) => panic!("watch error {e:?}"),
        }
    }
    assert_eq!(seen, ["ADDED a", "MODIFIED a", "DELETED a"]);
    while bookmarks == 0 {
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Bookmark(b)))) => {
                assert_eq!(b.types.kind, "ClusterNetworkPolicy");
                bookmarks += 1;
            }
            other => panic!("expected a bookmark, got {other:?}"),
        }
    }

    // Paginated lists with continue tokens; compaction expires the token (410).
    for i in 0..5 {
        api.create(&pp, &cnp(&format!("p{i}"), i, json!([{"networks": ["10.0.0.0/8"]}])))
            .await
            .unwrap();
    }
    let first = api.list(&ListParams::default().limit(2)).await.unwrap();
    assert_eq!(first.items.iter().map(name_of).collect::<Vec<_>>(), ["p0", "p1"]);
    assert_eq!(first.metadata.remaining_item_count, Some(3));
    let token = first.metadata.continue_.clone().expect("continue token");
    api.delete("p3", &DeleteParams::default()).await.unwrap();
    let second = api
        .list(&ListParams::default().limit(2).continue_token(&token))
        .await
        .unwrap();
    // The consistent snapshot still has p3.
    assert_eq!(second.items.iter().map(name_of).collect::<Vec<_>>(), ["p2", "p3"]);
    let token2 = second.metadata.continue_.clone().expect("continue token");
    server.compact();
    let e = api_err(
        api.list(&ListParams::default().limit(2).continue_token(&token2))
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (410, "Expired"));
    let e = tokio::time::timeout(Duration::from_secs(5), async {
        let mut s = api
            .watch(&WatchParams::default().timeout(5), &rv)
            .await
            .unwrap()
            .boxed();
        s.try_next().await
    })
    .await
    .expect("answer in time");
    match e {
        Ok(Some(WatchEvent::Error(s))) => assert_eq!(s.code, 410),
        other => panic!("expected a 410 ERROR event, got {other:?}"),
    }

    // Fault injection applies to the new kind's paths.
    server.fail_next(1, 500, Some("/apis/policy.networking.k8s.io/"));
    let e = api_err(api.list(&ListParams::default()).await.unwrap_err());
    assert_eq!(e.code, 500);
    assert_eq!(api.list(&ListParams::default()).await.unwrap().items.len(), 4);

    // Deleting the CRD deletes every CNP (a watch sees DELETED) and the resource is gone.
    let rv = api
        .list(&ListParams::default())
        .await
        .unwrap()
        .metadata
        .resource_version
        .unwrap();
    let mut stream = api
        .watch(&WatchParams::default().timeout(10), &rv)
        .await
        .unwrap()
        .boxed();
    crds.delete(npm_testapi::crd::CNP_CRD_NAME, &DeleteParams::default())
        .await
        .unwrap();
    let mut deleted = Vec::new();
    while deleted.len() < 4 {
        match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
            Ok(Ok(Some(WatchEvent::Deleted(o)))) => deleted.push(name_of(&o)),
            other => panic!("expected DELETED, got {other:?}"),
        }
    }
    deleted.sort();
    assert_eq!(deleted, ["p0", "p1", "p2", "p4"]);
    // ... and then the watch ends (its resource is gone).
    match tokio::time::timeout(Duration::from_secs(5), stream.try_next()).await {
        Ok(Ok(None)) => {}
        other => panic!("expected the watch to end, got {other:?}"),
    }
    assert_eq!(api_err(api.list(&ListParams::default()).await.unwrap_err()).code, 404);
    let e = api_err(
        api.create(&pp, &cnp("late", 1, json!([{"networks": ["10.0.0.0/8"]}])))
            .await
            .unwrap_err(),
    );
    assert_eq!(e.code, 404);
    server.shutdown().await;
}

#[tokio::test]
async fn channels_prune_differently_and_invalid_objects_get_422_causes() {
    let nodes_peer = json!([{"nodes": {"matchLabels": {"role": "infra"}}}]);
    // Standard: the experimental `nodes` peer is pruned; the empty peer left is refused.
    let (server, client) = start(Some(CnpChannel::Standard)).await;
    let api = cnps(&client);
    let e = api_err(
        api.create(&PostParams::default(), &cnp("n", 1, nodes_peer.clone()))
            .await
            .unwrap_err(),
    );
    assert_eq!((e.code, e.reason.as_str()), (422, "Invalid"));
    let causes = e.details.expect("details").causes;
    assert_eq!(causes.len(), 1, "{causes:?}");
    assert_eq!(causes[0].field, "spec.egress[0].to[0]");
    // An unknown field under a known one is dropped (fieldValidation defaults to Warn).
    let mut o = cnp("u", 1, json!([{"networks": ["10.0.0.0/8"]}]));
    o.data["spec"]["egress"][0]["futureField"] = json!({"x": 1});
    o.data["spec"]["futureTop"] = json!(true);
    let stored = api.create(&PostParams::default(), &o).await.unwrap();
    assert!(stored.data["spec"].get("futureTop").is_none(), "{:?}", stored.data);
    assert!(stored.data["spec"]["egress"][0].get("futureField").is_none());
    assert_eq!(stored.data["spec"]["egress"][0]["to"][0]["networks"][0], "10.0.0.0/8");
    // Several causes at once, each with its field.
    let mut bad = cnp("bad", 2000, json!([{"networks": ["10.0.0.0/40"]}]));
    bad.data["spec"]["tier"] = json!("Root");
    let e = api_err(api.create(&PostParams::default(), &bad).await.unwrap_err());
    let mut fields: Vec<String> = e
        .details
        .expect("details")
        .causes
        .into_iter()
        .map(|c| c.field)
        .collect();
    fields.sort();
    assert_eq!(
        fields,
        ["spec.egress[0].to[0].networks[0]", "spec.priority", "spec.tier"]
    );

    // Switching the server to the experimental channel: nodes is kept.
    server
        .install_cnp_crd(CnpChannel::Experimental)
        .expect("experimental CRD");
    let stored = api
        .create(&PostParams::default(), &cnp("n", 1, nodes_peer))
        .await
        .unwrap();
    assert_eq!(
        stored.data["spec"]["egress"][0]["to"][0]["nodes"]["matchLabels"]["role"],
        "infra"
    );
    // Back to standard: the stored object reads pruned (the empty peer left behind).
    server.install_cnp_crd(CnpChannel::Standard).expect("standard CRD");
    let read = api.get("n").await.unwrap();
    assert_eq!(read.data["spec"]["egress"][0]["to"][0], json!({}));
    // Server-side apply of a CNP works too (created, then changed).
    let ssa = PatchParams::apply("test").force();
    let applied = api
        .patch(
            "ssa",
            &ssa,
            &Patch::Apply(cnp("ssa", 3, json!([{"networks": ["fd00::/8"]}]))),
        )
        .await
        .unwrap();
    assert_eq!(applied.data["spec"]["priority"], 3);
    let list = api.list(&ListParams::default()).await.unwrap();
    let mut names: Vec<String> = list.items.iter().map(name_of).collect();
    names.sort();
    assert_eq!(names, ["n", "ssa", "u"]);
    server.shutdown().await;
}

#[tokio::test]
async fn served_versions_switch_mid_run() {
    let (server, client) = start(Some(CnpChannel::Standard)).await;
    let alpha = cnps(&client);
    let beta: Api<DynamicObject> = Api::all_with(
        client.clone(),
        &ApiResource::from_gvk_with_plural(
            &GroupVersionKind::gvk("policy.networking.k8s.io", "v1beta1", "ClusterNetworkPolicy"),
            "clusternetworkpolicies",
        ),
    );
    alpha
        .create(
            &PostParams::default(),
            &cnp("a", 1, json!([{"networks": ["10.0.0.0/8"]}])),
        )
        .await
        .expect("create at v1alpha2");
    assert_eq!(api_err(beta.list(&ListParams::default()).await.unwrap_err()).code, 404);
    let watch = alpha
        .watch(&WatchParams::default(), "0")
        .await
        .expect("watch at v1alpha2");

    // v1beta1 served too: same objects, converted apiVersion; the open watch ends.
    server
        .set_cnp_served_versions(&["v1alpha2", "v1beta1"])
        .expect("switch");
    assert_eq!(
        watch.collect::<Vec<_>>().await.len(),
        1,
        "the ADDED event, then the end"
    );
    let listed = beta.list(&ListParams::default()).await.expect("list at v1beta1");
    assert_eq!(listed.items.len(), 1);
    let raw: Value = serde_json::from_str(
        &client
            .request_text(
                http::Request::get("/apis/policy.networking.k8s.io/v1beta1/clusternetworkpolicies/a")
                    .body(Vec::new())
                    .unwrap(),
            )
            .await
            .expect("get at v1beta1"),
    )
    .unwrap();
    assert_eq!(raw["apiVersion"], "policy.networking.k8s.io/v1beta1");
    let group: Value = serde_json::from_str(
        &client
            .request_text(
                http::Request::get("/apis/policy.networking.k8s.io")
                    .body(Vec::new())
                    .unwrap(),
            )
            .await
            .expect("group discovery"),
    )
    .unwrap();
    assert_eq!(group["versions"].as_array().map(Vec::len), Some(2), "{group}");
    let crd: CustomResourceDefinition = Api::all(client.clone())
        .get("clusternetworkpolicies.policy.networking.k8s.io")
        .await
        .expect("the CRD");
    let served: Vec<(String, bool)> = crd.spec.versions.iter().map(|v| (v.name.clone(), v.served)).collect();
    assert_eq!(served, [("v1alpha2".to_string(), true), ("v1beta1".to_string(), true)]);

    // v1alpha2 no longer served: 404 there, writes through v1beta1 are stored.
    server.set_cnp_served_versions(&["v1beta1"]).expect("switch");
    assert_eq!(api_err(alpha.list(&ListParams::default()).await.unwrap_err()).code, 404);
    let mut b = cnp("b", 2, json!([{"networks": ["10.0.0.0/8"]}]));
    b.types.as_mut().unwrap().api_version = "policy.networking.k8s.io/v1beta1".into();
    let created = beta
        .create(&PostParams::default(), &b)
        .await
        .expect("create at v1beta1");
    assert_eq!(created.types.unwrap().api_version, "policy.networking.k8s.io/v1beta1");
    let mut names: Vec<String> = beta
        .list(&ListParams::default())
        .await
        .unwrap()
        .items
        .iter()
        .map(name_of)
        .collect();
    names.sort();
    assert_eq!(names, ["a", "b"]);
    let apis = client.list_api_groups().await.unwrap();
    let versions: Vec<&str> = apis
        .groups
        .iter()
        .filter(|g| g.name == "policy.networking.k8s.io")
        .flat_map(|g| g.versions.iter().map(|v| v.version.as_str()))
        .collect();
    assert_eq!(versions, ["v1beta1"]);

    // None served: the CRD stays, discovery no longer lists the group.
    server.set_cnp_served_versions(&[]).expect("switch");
    assert_eq!(api_err(beta.list(&ListParams::default()).await.unwrap_err()).code, 404);
    assert!(client
        .list_api_groups()
        .await
        .unwrap()
        .groups
        .iter()
        .all(|g| g.name != "policy.networking.k8s.io"));
    server.shutdown().await;
}
