//! `/healthz`, `/readyz` and `/metrics` of a running agent: not ready while
//! the lists cannot complete (the API server fails every list), ready after
//! the first sync, metrics in the Prometheus text format.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;
use npm_testapi::FaultRule;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_readiness_and_metrics() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("app", &[])]).await;
    create_pods(
        &client,
        vec![pod("app", "a", "node-a", Some("10.55.0.2"), &[("app", "a")])],
        1,
    )
    .await;
    srv.inject(FaultRule::fail(1_000_000, 500).path("/api/v1/pods").verb("list"));

    let mut cfg = agent_config(100);
    cfg.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let dp = RecordingDataplane::default();
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;
    let addr = agent.http_addr.expect("bound");

    assert_eq!(get(addr, "/healthz").await.0, 200);
    // Namespaces and policies list fine, pods never complete: not ready.
    wait_until_async("namespaces listed", Duration::from_secs(10), || async {
        agent.cache.namespaces.lock().unwrap().is_listed()
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, body) = get(addr, "/readyz").await;
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("lists complete=false"), "{body}");
    assert!(
        dp.lock().calls.is_empty(),
        "nothing programmed before all lists complete"
    );

    srv.clear_faults();
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    let (code, _) = get(addr, "/readyz").await;
    assert_eq!(code, 200);
    let (code, metrics) = get(addr, "/metrics").await;
    assert_eq!(code, 200);
    assert!(metrics.contains("npm_ready 1"), "{metrics}");
    assert!(metrics.contains("npm_sync_duration_seconds_bucket"), "{metrics}");
    assert!(
        metrics.contains("npm_compiled_entries{table=\"ipcache\"} 1"),
        "{metrics}"
    );
    assert!(
        metrics.contains("npm_controller_pod_event_total{operation=\"create\"} 1"),
        "{metrics}"
    );
    drop(agent);
    srv.shutdown().await;
}

/// The status of `GET path` (its status line only: `/observe` streams).
async fn status(addr: SocketAddr, path: &str) -> u16 {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = [0u8; 12];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut buf))
        .await
        .expect("a status line")
        .unwrap();
    String::from_utf8_lossy(&buf[9..12]).parse().unwrap_or(0)
}

/// `/explain` and `/observe` (pod names, policy names, flows) are served
/// on the debug listener only, never on the metrics listener that the
/// node's address exposes to every pod: there they are 404.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flows_and_verdicts_are_not_on_the_metrics_listener() {
    let (srv, client) = server(true).await;
    let mut cfg = agent_config(100);
    cfg.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    cfg.debug_addr = Some("127.0.0.1:0".parse().unwrap());
    let agent = start_agent(cfg, client.clone(), RecordingDataplane::default()).await;
    let metrics = agent.http_addr.expect("metrics bound");
    let debug = agent.debug_addr.expect("debug bound");
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;
    for path in ["/observe", "/explain?from=a/b&to=c/d&port=80"] {
        assert_eq!(status(metrics, path).await, 404, "{path} on the metrics listener");
    }
    // /observe streams: only its status line is read.
    assert_eq!(status(debug, "/observe").await, 200);
    // The debug listener answers them (explain: 400 for pods it does not
    // know, or 503 before the explain configuration is set; never 404).
    let (code, body) = get(debug, "/explain?from=a/b&to=c/d&port=80").await;
    assert_ne!(code, 404, "{body}");
    // The health endpoints stay where the kubelet probes; the debug
    // listener has every series of /metrics (see
    // metrics_names_need_a_granted_token) and answers /readyz too, with
    // its checks (what `kubectl npm status` reads through a port-forward),
    // but not /healthz.
    assert_eq!(get(metrics, "/readyz").await.0, 200);
    let (code, body) = get(debug, "/readyz?verbose").await;
    assert_eq!(code, 200, "/readyz on the debug listener: {body}");
    assert!(body.contains("readyz check passed"), "{body}");
    assert_eq!(get(debug, "/healthz").await.0, 404, "/healthz on the debug listener");
    drop(agent);
    srv.shutdown().await;
}

/// Names of pods and policies on the node's `/metrics` only for a token
/// granted `get` on `/metrics` by the chart's own ClusterRole
/// (`<release>-npm-agent-metrics-reader`, bound as `metrics.readers` binds
/// it): without a token the series naming them are absent, an unknown
/// token gets 401, an authenticated user without the grant 403, the
/// granted one 200 with the names. The loopback debug listener serves
/// every series.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_names_need_a_granted_token() {
    let (srv, client) = server(true).await;
    let docs = crate::chart::template(&[
        "metrics.readers[0].kind=ServiceAccount",
        "metrics.readers[0].name=prometheus",
        "metrics.readers[0].namespace=monitoring",
    ]);
    let rbac: Vec<serde_json::Value> = ["ClusterRole", "ClusterRoleBinding"]
        .into_iter()
        .flat_map(|k| crate::chart::find(&docs, k))
        .map(|d| serde_json::to_value(d).unwrap())
        .collect();
    assert_eq!(srv.add_rbac(&rbac), 4);
    let user = |name: &str| npm_testapi::auth::UserInfo {
        username: name.into(),
        ..Default::default()
    };
    srv.add_token("granted", user("system:serviceaccount:monitoring:prometheus"));
    srv.add_token("ungranted", user("system:serviceaccount:default:curious-pod"));

    let mut cfg = agent_config(100);
    cfg.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    cfg.debug_addr = Some("127.0.0.1:0".parse().unwrap());
    let agent = start_agent(cfg, client.clone(), RecordingDataplane::default()).await;
    let (addr, debug) = (agent.http_addr.expect("bound"), agent.debug_addr.expect("bound"));
    agent.metrics.audit_would_deny("team-secret", "deny-payroll", "ingress");
    let named = |t: &str| {
        t.contains("deny-payroll")
            || t.contains("team-secret")
            || t.contains("npm_rule_allowed_packets_total")
            || t.contains("npm_endpoint_denied_packets_total")
            || t.contains("npm_audit_would_deny_total")
    };

    let (code, public) = get(addr, "/metrics").await;
    assert_eq!(code, 200, "{public}");
    assert!(public.contains("npm_ready"), "{public}");
    assert!(!named(&public), "names without credentials:\n{public}");

    let (code, body) = get_with(addr, "/metrics", "Authorization: Bearer forged\r\n").await;
    assert_eq!(code, 401, "{body}");
    assert!(!named(&body), "{body}");
    let (code, body) = get_with(addr, "/metrics", "Authorization: Basic Zm9vOmJhcg==\r\n").await;
    assert_eq!(code, 401, "{body}");
    let (code, body) = get_with(addr, "/metrics", "Authorization: Bearer ungranted\r\n").await;
    assert_eq!(code, 403, "{body}");
    assert!(!named(&body), "{body}");

    let (code, full) = get_with(addr, "/metrics", "Authorization: Bearer granted\r\n").await;
    assert_eq!(code, 200, "{full}");
    assert!(
        full.contains(
            r#"npm_audit_would_deny_total{namespace="team-secret",policy="deny-payroll",direction="ingress"} 1"#
        ),
        "{full}"
    );
    assert!(full.contains("# TYPE npm_rule_allowed_packets_total counter"), "{full}");
    // A second scrape is answered from the cache (no new reviews).
    let reviews = || srv.stats().by_verb.get("review").copied().unwrap_or(0);
    let before = reviews();
    assert!(before >= 2, "a TokenReview and a SubjectAccessReview were asked");
    let (code, _) = get_with(addr, "/metrics", "Authorization: Bearer granted\r\n").await;
    assert_eq!(code, 200);
    assert_eq!(reviews(), before, "a cached decision asks no review");

    let (code, debug_text) = get(debug, "/metrics").await;
    assert_eq!(code, 200);
    assert!(debug_text.contains("deny-payroll"), "{debug_text}");
    drop(agent);
    srv.shutdown().await;
}

/// `/observe` streams beyond the bound get 429 while the open ones keep
/// streaming; a closed stream frees its slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn observe_streams_are_bounded() {
    use npm_agent::telemetry::server::MAX_OBSERVE;
    let (srv, client) = server(true).await;
    let mut cfg = agent_config(100);
    cfg.debug_addr = Some("127.0.0.1:0".parse().unwrap());
    let agent = start_agent(cfg, client.clone(), RecordingDataplane::default()).await;
    let debug = agent.debug_addr.expect("bound");
    let open = || async move {
        let mut s = tokio::net::TcpStream::connect(debug).await.expect("connect");
        s.write_all(b"GET /observe HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
        let mut head = Vec::new();
        let mut b = [0u8; 1];
        while !head.ends_with(b"\r\n\r\n") {
            if s.read(&mut b).await.unwrap_or(0) == 0 {
                break;
            }
            head.push(b[0]);
        }
        let code: u16 = String::from_utf8_lossy(&head)
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .unwrap_or(0);
        (code, s)
    };
    let mut streams = Vec::new();
    for _ in 0..MAX_OBSERVE {
        let (code, s) = open().await;
        assert_eq!(code, 200);
        streams.push(s);
    }
    let (code, _) = open().await;
    assert_eq!(code, 429, "a stream beyond {MAX_OBSERVE}");
    // The debug listener still answers other requests.
    let (code, _) = get(debug, "/metrics").await;
    assert_eq!(code, 200);
    drop(streams.pop());
    wait_until_async("a freed slot", Duration::from_secs(30), || async {
        open().await.0 == 200
    })
    .await;
    drop(agent);
    srv.shutdown().await;
}
