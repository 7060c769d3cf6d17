//! `/healthz`, `/readyz` and `/metrics` of a running agent: not ready while
//! the lists cannot complete (the API server fails every list), ready after
//! the first sync, metrics in the Prometheus text format.

use std::net::SocketAddr;
use std::time::Duration;

use crate::common::*;
use npm_testapi::FaultRule;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

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
    for path in ["/metrics", "/readyz"] {
        assert_eq!(get(debug, path).await.0, 404, "{path} on the debug listener");
    }
    assert_eq!(get(metrics, "/readyz").await.0, 200);
    drop(agent);
    srv.shutdown().await;
}
