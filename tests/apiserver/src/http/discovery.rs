//! Discovery and OpenAPI: `/version`, `/api`, `/apis` and the group-version resource lists,
//! the minimal OpenAPI v3 documents kubectl reads, and the health endpoints.

use super::response::{body_response, json_response, not_found_path};
use super::AppState;
use crate::store::Kind;
use axum::body::Body;
use axum::response::Response;
use serde_json::{json, Value};

/// The `APIResourceList` entries of an API group (with the `/status` subresources).
fn api_resources(group: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for k in Kind::ALL.into_iter().filter(|k| k.group() == group) {
        let mut verbs = vec!["create", "delete", "get", "list", "patch", "update", "watch"];
        if k.namespaced() {
            verbs.insert(2, "deletecollection");
        }
        let (short, cats): (&[&str], &[&str]) = match k {
            Kind::Namespace => (&["ns"], &[]),
            Kind::Pod => (&["po"], &["all"]),
            Kind::NetworkPolicy => (&["netpol"], &[]),
            Kind::DaemonSet => (&["ds"], &["all"]),
            Kind::Event => (&["ev"], &[]),
            Kind::Service => (&["svc"], &["all"]),
            Kind::EndpointSlice => (&[], &[]),
            Kind::Node => (&["no"], &[]),
        };
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

/// The named API groups served (the core group "" is served under `/api`).
const GROUPS: [&str; 3] = ["networking.k8s.io", "apps", "discovery.k8s.io"];

/// The `APIGroup` entry of a named group (only `v1`).
fn api_group(group: &str) -> Value {
    let gv = format!("{group}/v1");
    json!({
        "name": group,
        "versions": [{"groupVersion": gv, "version": "v1"}],
        "preferredVersion": {"groupVersion": gv, "version": "v1"},
    })
}

/// Answer a non-resource path: discovery, OpenAPI, version and health, else 404.
pub(super) fn discovery(st: &AppState, path: &str) -> Response {
    let path = path.trim_end_matches('/');
    let named = |prefix: &str| {
        GROUPS
            .into_iter()
            .find(|g| path.strip_prefix(prefix).and_then(|rest| rest.strip_prefix(*g)) == Some(""))
    };
    let named_v1 = |prefix: &str| {
        GROUPS.into_iter().find(|g| {
            path.strip_prefix(prefix)
                .and_then(|rest| rest.strip_prefix(*g))
                .is_some_and(|rest| rest == "/v1")
        })
    };
    if let Some(g) = named("/apis/") {
        let mut v = api_group(g);
        v["kind"] = json!("APIGroup");
        v["apiVersion"] = json!("v1");
        return json_response(200, &v);
    }
    if let Some(g) = named_v1("/apis/") {
        return json_response(
            200,
            &json!({
                "kind": "APIResourceList", "apiVersion": "v1", "groupVersion": format!("{g}/v1"),
                "resources": api_resources(g),
            }),
        );
    }
    if let Some(g) = named_v1("/openapi/v3/apis/") {
        return json_response(200, &openapi_v3(g));
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
            "kind": "APIResourceList", "groupVersion": "v1", "resources": api_resources(""),
        }),
        "/apis" => json!({
            "kind": "APIGroupList", "apiVersion": "v1",
            "groups": GROUPS.into_iter().map(api_group).collect::<Vec<_>>(),
        }),
        "/openapi/v3" => {
            let mut paths = serde_json::Map::new();
            paths.insert(
                "api/v1".into(),
                json!({"serverRelativeURL": "/openapi/v3/api/v1?hash=npm-testapi-1"}),
            );
            for g in GROUPS {
                paths.insert(
                    format!("apis/{g}/v1"),
                    json!({"serverRelativeURL": format!("/openapi/v3/apis/{g}/v1?hash=npm-testapi-1")}),
                );
            }
            json!({ "paths": paths })
        }
        "/openapi/v3/api/v1" => openapi_v3(""),
        "/healthz" | "/readyz" | "/livez" => return body_response(200, "text/plain", Body::from("ok")),
        _ => return not_found_path(path),
    };
    json_response(200, &v)
}

/// A minimal OpenAPI v3 document for one group-version: the resource paths with their
/// operations, `x-kubernetes-group-version-kind` and the `fieldValidation` parameter, which is
/// what kubectl checks to use server-side field validation instead of a client-side schema.
fn openapi_v3(group: &str) -> Value {
    let mut paths = serde_json::Map::new();
    let param = |name: &str, loc: &str| json!({"name": name, "in": loc, "schema": {"type": "string"}, "required": loc == "path"});
    for k in Kind::ALL.into_iter().filter(|k| k.group() == group) {
        let base = if group.is_empty() {
            "/api/v1".to_string()
        } else {
            format!("/apis/{group}/v1")
        };
        let gvk = json!({"group": group, "version": "v1", "kind": k.kind()});
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
