//! Discovery and OpenAPI: `/version`, `/api`, `/apis` and the group-version resource lists,
//! the minimal OpenAPI v3 documents kubectl reads, and the health endpoints. Custom resources
//! appear only while their CRD is installed, with the CRD's short names and categories.

use super::response::{body_response, json_response, not_found_path};
use super::AppState;
use crate::store::{Kind, Store};
use axum::body::Body;
use axum::response::Response;
use serde_json::{json, Value};

/// Short names and categories of a kind (a custom resource's come from its CRD).
fn names_of(store: &Store, k: Kind) -> (Vec<String>, Vec<String>) {
    let own = |s: &[&str], c: &[&str]| {
        (
            s.iter().map(|x| x.to_string()).collect(),
            c.iter().map(|x| x.to_string()).collect(),
        )
    };
    match k {
        Kind::Namespace => own(&["ns"], &[]),
        Kind::Pod => own(&["po"], &["all"]),
        Kind::NetworkPolicy => own(&["netpol"], &[]),
        Kind::DaemonSet => own(&["ds"], &["all"]),
        Kind::Event => own(&["ev"], &[]),
        Kind::Service => own(&["svc"], &["all"]),
        Kind::EndpointSlice => own(&[], &[]),
        Kind::Node => own(&["no"], &[]),
        Kind::CustomResourceDefinition => own(&["crd", "crds"], &[]),
        Kind::ClusterNetworkPolicy => store
            .cnp_crd()
            .map(|c| (c.short_names.clone(), c.categories.clone()))
            .unwrap_or_default(),
    }
}

/// The `APIResourceList` entries of a group-version (with the `/status` subresources).
fn api_resources(store: &Store, group: &str, version: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for k in Kind::ALL
        .into_iter()
        .filter(|k| k.group() == group && store.serves_version(*k, version))
    {
        let mut verbs = vec!["create", "delete", "get", "list", "patch", "update", "watch"];
        if k.namespaced() || matches!(k, Kind::CustomResourceDefinition | Kind::ClusterNetworkPolicy) {
            verbs.insert(2, "deletecollection");
        }
        let (short, cats) = names_of(store, k);
        let mut r = json!({
            "name": k.plural(), "singularName": k.singular(), "namespaced": k.namespaced(),
            "kind": k.kind(), "verbs": verbs,
        });
        if !short.is_empty() {
            r["shortNames"] = json!(short);
        }
        if !cats.is_empty() {
            r["categories"] = json!(cats);
        }
        out.push(r);
        if k.has_status() {
            out.push(json!({
                "name": format!("{}/status", k.plural()), "singularName": "",
                "namespaced": k.namespaced(), "kind": k.kind(), "verbs": ["get", "patch", "update"],
            }));
        }
    }
    out
}

/// The named group-versions served now, in a stable order (the core group "" is served
/// under `/api`; a custom resource's group at the versions its CRD serves).
fn group_versions(store: &Store) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = Vec::new();
    for k in Kind::ALL.into_iter().filter(|k| !k.group().is_empty()) {
        for v in store.served_versions(k) {
            if !out.iter().any(|(g, ov)| *g == k.group() && *ov == v) {
                out.push((k.group(), v));
            }
        }
    }
    out
}

/// The `APIGroup` entry of a named group with its served versions (the first preferred).
fn api_group(group: &str, versions: &[&str]) -> Value {
    let entry = |v: &str| json!({"groupVersion": format!("{group}/{v}"), "version": v});
    json!({
        "name": group,
        "versions": versions.iter().map(|v| entry(v)).collect::<Vec<_>>(),
        "preferredVersion": versions.first().map(|v| entry(v)).unwrap_or(Value::Null),
    })
}

/// The named groups served now with their versions, in order.
fn groups<'a>(gvs: &'a [(&'static str, String)]) -> Vec<(&'static str, Vec<&'a str>)> {
    let mut out: Vec<(&'static str, Vec<&str>)> = Vec::new();
    for (g, v) in gvs {
        match out.iter_mut().find(|(og, _)| og == g) {
            Some((_, vs)) => vs.push(v.as_str()),
            None => out.push((g, vec![v.as_str()])),
        }
    }
    out
}

/// Answer a non-resource path: discovery, OpenAPI, version and health, else 404.
pub(super) fn discovery(st: &AppState, path: &str) -> Response {
    let path = path.trim_end_matches('/');
    let store = st.store();
    let gvs = group_versions(&store);
    let named = groups(&gvs);
    let group_of = |prefix: &str| {
        named
            .iter()
            .find(|(g, _)| path.strip_prefix(prefix).and_then(|rest| rest.strip_prefix(*g)) == Some(""))
    };
    let gv_of = |prefix: &str| {
        gvs.iter().find(|(g, v)| {
            path.strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix(*g))
                .and_then(|rest| rest.strip_prefix('/'))
                == Some(v.as_str())
        })
    };
    if let Some((g, vs)) = group_of("/apis/") {
        let mut doc = api_group(g, vs);
        doc["kind"] = json!("APIGroup");
        doc["apiVersion"] = json!("v1");
        return json_response(200, &doc);
    }
    if let Some((g, v)) = gv_of("/apis/") {
        return json_response(
            200,
            &json!({
                "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{g}/{v}"),
                "resources": api_resources(&store, g, v),
            }),
        );
    }
    if let Some((g, v)) = gv_of("/openapi/v3/apis/") {
        return json_response(200, &openapi_v3(&store, g, v));
    }
    let v = match path {
        "/version" => json!({
            "major": "1", "minor": "34", "emulationMajor": "1", "emulationMinor": "34",
            "gitVersion": "v1.34.0-npm-testapi", "gitCommit": "0000000000000000000000000000000000000000",
            "gitTreeState": "clean", "buildDate": "2025-08-27T00:00:00Z", "goVersion": "go1.24.6",
            "compiler": "gc", "platform": "linux/amd64",
        }),
        "/api" => json!({
            "kind": "APIVersions", "versions": ["v1"],
            "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": st.addr.to_string()}],
        }),
        "/api/v1" => json!({
            "kind": "APIResourceList", "groupVersion": "v1", "resources": api_resources(&store, "", "v1"),
        }),
        "/apis" => json!({
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": named.iter().map(|(g, vs)| api_group(g, vs)).collect::<Vec<_>>(),
        }),
        "/openapi/v3" => {
            let mut paths = serde_json::Map::new();
            paths.insert(
                "api/v1".into(),
                json!({"serverRelativeURL": "/openapi/v3/api/v1?hash=npm-testapi-1"}),
            );
            for (g, v) in &gvs {
                paths.insert(
                    format!("apis/{g}/{v}"),
                    json!({"serverRelativeURL": format!("/openapi/v3/apis/{g}/{v}?hash=npm-testapi-1")}),
                );
            }
            json!({ "paths": paths })
        }
        "/openapi/v3/api/v1" => openapi_v3(&store, "", "v1"),
        "/healthz" | "/readyz" | "/livez" => return body_response(200, "text/plain", Body::from("ok")),
        _ => return not_found_path(path),
    };
    json_response(200, &v)
}

/// A minimal OpenAPI v3 document for one group-version: the resource paths with their
/// operations, `x-kubernetes-group-version-kind` and the `fieldValidation` parameter, which is
/// what kubectl checks to use server-side field validation instead of a client-side schema.
fn openapi_v3(store: &Store, group: &str, version: &str) -> Value {
    let mut paths = serde_json::Map::new();
    let param = |name: &str, loc: &str| json!({"name": name, "in": loc, "schema": {"type": "string"}, "required": loc == "path"});
    for k in Kind::ALL
        .into_iter()
        .filter(|k| k.group() == group && store.serves_version(*k, version))
    {
        let base = if group.is_empty() {
            "/api/v1".to_string()
        } else {
            format!("/apis/{group}/{version}")
        };
        let gvk = json!({"group": group, "version": version, "kind": k.kind()});
        let op = |action: &str, extra: &[Value]| {
            let mut params = vec![
                param("fieldValidation", "query"),
                param("fieldManager", "query"),
                param("dryRun", "query"),
            ];
            params.extend_from_slice(extra);
            json!({
                "x-kubernetes-action": action,
                "x-kubernetes-group-version-kind": gvk,
                "parameters": params,
                "responses": {"200": {"description": "OK"}},
            })
        };
        let (coll, item, mut item_params) = if k.namespaced() {
            (
                format!("{base}/namespaces/{{namespace}}/{}", k.plural()),
                format!("{base}/namespaces/{{namespace}}/{}/{{name}}", k.plural()),
                vec![param("namespace", "path")],
            )
        } else {
            (
                format!("{base}/{}", k.plural()),
                format!("{base}/{}/{{name}}", k.plural()),
                vec![],
            )
        };
        let coll_params = item_params.clone();
        item_params.push(param("name", "path"));
        paths.insert(
            coll,
            json!({
                "get": op("list", &coll_params),
                "post": op("post", &coll_params),
            }),
        );
        paths.insert(
            item.clone(),
            json!({
                "get": op("get", &item_params),
                "put": op("put", &item_params),
                "patch": op("patch", &item_params),
                "delete": op("delete", &item_params),
            }),
        );
        if k.has_status() {
            paths.insert(
                format!("{item}/status"),
                json!({
                    "get": op("get", &item_params),
                    "put": op("put", &item_params),
                    "patch": op("patch", &item_params),
                }),
            );
        }
    }
    json!({
        "openapi": "3.0.0",
        "info": {"title": "Kubernetes", "version": "v1.34.0"},
        "paths": paths,
        "components": {"schemas": {}},
    })
}
