//! The debug listener reached through the API server as `kubectl
//! port-forward` reaches it: kube-rs' `Api::<Pod>::portforward` (WebSocket)
//! to the agent pod, on the test API server, whose RBAC decides from the
//! loaded Role: a user granted `create` on `pods/portforward` in the
//! agent's namespace reads every series and `/observe`; a user without it
//! gets 403, a caller without credentials 401, and nothing else.

use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::*;

fn client_with_token(srv: &npm_testapi::TestApiServer, token: Option<&str>) -> kube::Client {
    let mut config = kube::Config::new(srv.url().parse().expect("server url"));
    config.default_retry = false;
    config.auth_info.token = token.map(|t| t.to_string().into());
    kube::Client::try_from(config).expect("kube client")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_debug_listener_through_pods_portforward() {
    let (srv, client) = server(true).await;
    let mut cfg = agent_config(100);
    cfg.debug_addr = Some("127.0.0.1:0".parse().unwrap());
    let agent = start_agent(cfg, client.clone(), RecordingDataplane::default()).await;
    let port = agent.debug_addr.expect("bound").port();
    agent.metrics.audit_would_deny("team-secret", "deny-payroll", "ingress");
    // The agent pod: host network, so its IP is the node's (here loopback).
    srv.create_object(
        npm_testapi::Kind::Namespace,
        None,
        json!({"metadata": {"name": "npm-system"}}),
    )
    .unwrap();
    srv.create_object(
        npm_testapi::Kind::Pod,
        Some("npm-system"),
        json!({"metadata": {"name": "npm-agent-x", "namespace": "npm-system"},
               "spec": {"nodeName": "node-a", "hostNetwork": true,
                        "containers": [{"name": "agent", "image": "npm"}]},
               "status": {"podIP": "127.0.0.1", "phase": "Running"}}),
    )
    .unwrap();
    srv.add_rbac(&[
        json!({"kind": "Role", "metadata": {"name": "npm-debug", "namespace": "npm-system"},
               "rules": [{"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]}]}),
        json!({"kind": "RoleBinding", "metadata": {"name": "npm-debug", "namespace": "npm-system"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "npm-debug"},
               "subjects": [{"kind": "Group", "name": "sre"}]}),
    ]);
    let user = |name: &str, groups: &[&str]| npm_testapi::auth::UserInfo {
        username: name.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        ..Default::default()
    };
    srv.add_token("alice-token", user("alice", &["sre"]));
    srv.add_token("bob-token", user("bob", &["dev"]));

    // Granted: the whole /metrics of the debug listener, names included.
    let pods: Api<Pod> = Api::namespaced(client_with_token(&srv, Some("alice-token")), "npm-system");
    let mut pf = pods.portforward("npm-agent-x", &[port]).await.expect("port-forward");
    let mut s = pf.take_stream(port).expect("the port's stream");
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_string(&mut text))
        .await
        .expect("the answer within 30 s")
        .unwrap();
    assert!(text.starts_with("HTTP/1.1 200"), "{text}");
    assert!(text.contains("deny-payroll"), "{text}");
    drop(s);
    let _ = pf.join().await;

    // Not granted, or no credentials: refused before any byte reaches the agent.
    for (token, code) in [(Some("bob-token"), "403"), (Some("forged"), "401"), (None, "401")] {
        let pods: Api<Pod> = Api::namespaced(client_with_token(&srv, token), "npm-system");
        let err = pods
            .portforward("npm-agent-x", &[port])
            .await
            .err()
            .unwrap_or_else(|| panic!("{token:?}: port-forward allowed"));
        assert!(err.to_string().contains(code), "{token:?}: {err}");
    }
    drop(agent);
    srv.shutdown().await;
}
