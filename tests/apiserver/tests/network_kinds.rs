//! Services, EndpointSlices and Nodes through kube-rs and the real `kubectl`: allocation
//! seen by a client, label-selected lists and watches of EndpointSlices, Node taint removal
//! by strategic-merge and JSON patch (as the agent's readiness taint is removed), the
//! Node `/status` subresource and discovery.

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::core::v1::{Node, Service};
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams, WatchEvent, WatchParams};
use kube::{Client, Config};
use npm_testapi::{Options, TestApiServer};
use serde_json::{json, Value};
use std::process::Command;
use std::time::Duration;

async fn start() -> (TestApiServer, Client) {
    let server = TestApiServer::start(Options::default()).await.expect("server starts");
    let client = Client::try_from(Config::new(server.url().parse().expect("url"))).expect("client");
    (server, client)
}

fn from<T: serde::de::DeserializeOwned>(v: Value) -> T {
    serde_json::from_value(v).expect("object deserializes")
}

fn slice(name: &str, svc: &str, ip: &str) -> EndpointSlice {
    from(json!({
        "metadata": {"name": name, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": [ip], "conditions": {"ready": true}, "nodeName": "node-1"}],
        "ports": [{"name": "http", "port": 8080}],
    }))
}

#[tokio::test]
async fn services_allocate_and_release() {
    let (_server, client) = start().await;
    let pp = PostParams::default();
    let svcs: Api<Service> = Api::namespaced(client.clone(), "default");
    let s = svcs
        .create(
            &pp,
            &from(json!({"metadata": {"name": "web"}, "spec": {"type": "NodePort", "selector": {"app": "web"},
                "ports": [{"name": "http", "port": 80, "targetPort": "http"}, {"name": "dns", "port": 53, "protocol": "UDP"}]}})),
        )
        .await
        .unwrap();
    let spec = s.spec.unwrap();
    let ip: std::net::Ipv4Addr = spec.cluster_ip.clone().unwrap().parse().unwrap();
    assert_eq!(ip.octets()[..2], [10, 96]);
    assert_eq!(spec.cluster_ips.unwrap(), [spec.cluster_ip.clone().unwrap()]);
    assert_eq!(spec.ip_families.unwrap(), ["IPv4"]);
    assert_eq!(spec.external_traffic_policy.as_deref(), Some("Cluster"));
    let ports = spec.ports.unwrap();
    let nps: Vec<i32> = ports.iter().map(|p| p.node_port.unwrap()).collect();
    assert!(
        nps.iter().all(|n| (30000..=32767).contains(n)) && nps[0] != nps[1],
        "{nps:?}"
    );
    // A duplicate node port is refused with its field.
    let e = svcs
        .create(
            &pp,
            &from(json!({"metadata": {"name": "other"}, "spec": {"type": "NodePort",
                "ports": [{"port": 80, "nodePort": nps[0]}]}})),
        )
        .await
        .unwrap_err();
    let kube::Error::Api(st) = e else { panic!("{e:?}") };
    assert_eq!(st.code, 422);
    assert!(st.message.contains("spec.ports[0].nodePort"), "{}", st.message);
    // A field selector on the ClusterIP finds it; deleting releases IP and port.
    let lp = ListParams::default().fields(&format!("spec.clusterIP={ip}"));
    assert_eq!(svcs.list(&lp).await.unwrap().items.len(), 1);
    svcs.delete("web", &DeleteParams::default()).await.unwrap();
    svcs.create(
        &pp,
        &from(
            json!({"metadata": {"name": "other"}, "spec": {"type": "NodePort", "clusterIP": ip.to_string(),
            "ports": [{"port": 80, "nodePort": nps[0]}]}}),
        ),
    )
    .await
    .unwrap();
}

#[tokio::test]
async fn endpoint_slices_by_service_label_and_watch() {
    let (_server, client) = start().await;
    let pp = PostParams::default();
    let slices: Api<EndpointSlice> = Api::namespaced(client.clone(), "default");
    let wp = WatchParams::default().labels("kubernetes.io/service-name=web");
    let mut stream = slices.watch(&wp, "0").await.unwrap().boxed();
    slices.create(&pp, &slice("web-a", "web", "10.0.0.1")).await.unwrap();
    slices.create(&pp, &slice("db-a", "db", "10.0.0.2")).await.unwrap();
    let lp = ListParams::default().labels("kubernetes.io/service-name=web");
    let listed = slices.list(&lp).await.unwrap();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(
        listed.items[0].ports.as_ref().unwrap()[0].protocol.as_deref(),
        Some("TCP")
    );
    slices
        .patch(
            "web-a",
            &PatchParams::default(),
            &Patch::Merge(json!({"endpoints": [{"addresses": ["10.0.0.3"], "conditions": {"ready": false}}]})),
        )
        .await
        .unwrap();
    slices.delete("web-a", &DeleteParams::default()).await.unwrap();
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let ev = tokio::time::timeout(Duration::from_secs(5), stream.try_next())
            .await
            .expect("watch event in time")
            .unwrap()
            .expect("stream open");
        match ev {
            WatchEvent::Added(s) => seen.push(("ADDED", s.metadata.name.unwrap())),
            WatchEvent::Modified(s) => {
                assert_eq!(s.endpoints[0].addresses, ["10.0.0.3"]);
                seen.push(("MODIFIED", s.metadata.name.unwrap()))
            }
            WatchEvent::Deleted(s) => seen.push(("DELETED", s.metadata.name.unwrap())),
            _ => {}
        }
    }
    let want: Vec<(&str, String)> = ["ADDED", "MODIFIED", "DELETED"]
        .into_iter()
        .map(|t| (t, "web-a".to_string()))
        .collect();
    assert_eq!(seen, want, "the db slice is not seen");
    // addressType is immutable; addresses must be of it.
    let mut bad = slice("v6", "web", "10.0.0.9");
    bad.address_type = "IPv6".into();
    assert!(slices.create(&pp, &bad).await.is_err());
}

#[tokio::test]
async fn node_taint_removed_by_patch() {
    let (_server, client) = start().await;
    let nodes: Api<Node> = Api::all(client.clone());
    let n = nodes
        .create(
            &PostParams::default(),
            &from(
                json!({"metadata": {"name": "node-1", "labels": {"kubernetes.io/hostname": "node-1"}},
                "spec": {"podCIDR": "10.244.1.0/24", "taints": [
                    {"key": "npm.io/agent-not-ready", "effect": "NoSchedule"},
                    {"key": "other", "value": "x", "effect": "NoExecute"}]},
                "status": {"addresses": [{"type": "InternalIP", "address": "192.168.50.1"}]}}),
            ),
        )
        .await
        .unwrap();
    assert!(n.metadata.namespace.is_none());
    assert_eq!(n.status.unwrap().addresses.unwrap()[0].address, "192.168.50.1");
    // Strategic merge: the list of taints is replaced by the one sent.
    let kept = json!([{"key": "other", "value": "x", "effect": "NoExecute"}]);
    let n = nodes
        .patch(
            "node-1",
            &PatchParams::default(),
            &Patch::Strategic(json!({"spec": {"taints": kept}})),
        )
        .await
        .unwrap();
    let taints = n.spec.unwrap().taints.unwrap();
    assert_eq!(taints.len(), 1);
    assert_eq!(taints[0].key, "other");
    // JSON patch removing by index, with a test guard.
    let ops = json!([
        {"op": "test", "path": "/spec/taints/0/key", "value": "other"},
        {"op": "remove", "path": "/spec/taints/0"}]);
    let req = http::Request::builder()
        .method("PATCH")
        .uri("/api/v1/nodes/node-1")
        .header("content-type", "application/json-patch+json")
        .body(serde_json::to_vec(&ops).unwrap())
        .unwrap();
    let n: Value = serde_json::from_str(&client.request_text(req).await.unwrap()).unwrap();
    assert!(n["spec"].get("taints").is_none_or(|t| t == &json!([])), "{n}");
    // Status through the subresource; field selector on the name.
    let n = nodes
        .patch_status(
            "node-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"status": {"addresses": [{"type": "InternalIP", "address": "192.168.50.2"}]}})),
        )
        .await
        .unwrap();
    assert_eq!(n.status.unwrap().addresses.unwrap()[0].address, "192.168.50.2");
    let lp = ListParams::default().fields("metadata.name=node-1");
    assert_eq!(nodes.list(&lp).await.unwrap().items.len(), 1);
    let bad = nodes
        .patch(
            "node-1",
            &PatchParams::default(),
            &Patch::Merge(json!({"spec": {"taints": [{"key": "a", "effect": "Sometimes"}]}})),
        )
        .await;
    assert!(bad.is_err());
}

#[test]
fn kubectl_services_slices_and_taints() {
    let server = TestApiServer::start_background(Options::default()).expect("server starts");
    let dir = std::env::temp_dir().join(format!("npm-testapi-netkinds-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let kc = dir.join("kubeconfig");
    server.kubeconfig(&kc).unwrap();
    let run = |args: &[&str]| -> String {
        let out = Command::new("/usr/bin/kubectl")
            .arg("--kubeconfig")
            .arg(&kc)
            .arg("--cache-dir")
            .arg(dir.join("cache"))
            .args(args)
            .output()
            .expect("run kubectl");
        assert!(
            out.status.success(),
            "kubectl {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let manifest = dir.join("m.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: v1\nkind: Service\nmetadata: {name: web}\nspec:\n  selector: {app: web}\n  ports: [{port: 80, targetPort: 8080}]\n---\napiVersion: discovery.k8s.io/v1\nkind: EndpointSlice\nmetadata:\n  name: web-x\n  labels: {kubernetes.io/service-name: web}\naddressType: IPv4\nendpoints: [{addresses: [10.1.0.5]}]\nports: [{port: 8080}]\n---\napiVersion: v1\nkind: Node\nmetadata: {name: node-1}\nspec:\n  taints: [{key: npm.io/agent-not-ready, effect: NoSchedule}]\n",
    )
    .unwrap();
    run(&["apply", "-f", manifest.to_str().unwrap()]);
    let svc: Value = serde_json::from_str(&run(&["get", "svc", "web", "-o", "json"])).unwrap();
    assert!(svc["spec"]["clusterIP"].as_str().unwrap().starts_with("10.96."));
    let eps: Value = serde_json::from_str(&run(&[
        "get",
        "endpointslices",
        "-l",
        "kubernetes.io/service-name=web",
        "-o",
        "json",
    ]))
    .unwrap();
    assert_eq!(eps["items"].as_array().unwrap().len(), 1);
    run(&["taint", "nodes", "node-1", "npm.io/agent-not-ready:NoSchedule-"]);
    let node: Value = serde_json::from_str(&run(&["get", "no", "node-1", "-o", "json"])).unwrap();
    assert!(
        node["spec"]
            .get("taints")
            .is_none_or(|t| t.as_array().is_some_and(|a| a.is_empty())),
        "{node}"
    );
    run(&["delete", "-f", manifest.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
}
