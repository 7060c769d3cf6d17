//! Bad input: with the API server's validation switched off, each invalid
//! NetworkPolicy form (and a pod with a malformed IP) produces a log line
//! naming the object and the field, and metrics; the valid policies keep
//! being enforced.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::*;

#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl LogBuf {
    fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

fn policy(name: &str, ingress: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    let mut spec = serde_json::json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": ingress});
    if let (Some(s), Some(e)) = (spec.as_object_mut(), extra.as_object()) {
        s.extend(e.clone());
    }
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "bad"},
        "spec": spec
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_policies_are_logged_counted_and_skipped() {
    let logs = LogBuf::default();
    let sink = logs.clone();
    tracing_subscriber::fmt()
        .with_writer(move || sink.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::INFO)
        .try_init()
        .expect("this test installs the process's only tracing subscriber");

    let (srv, client) = server(false).await;
    create_namespaces(&client, &[namespace("bad", &[])]).await;
    let none = serde_json::json!({});
    // (name, ingress rules, extra spec fields, a field path the error must name)
    let invalid = [
        (
            "p-cidr",
            serde_json::json!([{"from": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}]),
            none.clone(),
            "ipBlock.cidr",
        ),
        (
            "p-except",
            serde_json::json!([{"from": [{"ipBlock": {"cidr": "10.0.0.0/16", "except": ["10.1.0.0/24"]}}]}]),
            none.clone(),
            "except[0]",
        ),
        (
            "p-endport",
            serde_json::json!([{"ports": [{"port": 100, "endPort": 50}]}]),
            none.clone(),
            "endPort",
        ),
        (
            "p-emptypeer",
            serde_json::json!([{"from": [{}]}]),
            none.clone(),
            "from[0]",
        ),
        (
            "p-mixedpeer",
            serde_json::json!([{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}]),
            none.clone(),
            "from[0]",
        ),
        (
            "p-protocol",
            serde_json::json!([{"ports": [{"protocol": "ICMP", "port": 1}]}]),
            none.clone(),
            "protocol",
        ),
        (
            "p-operator",
            serde_json::json!([{"from": [{"podSelector": {"matchExpressions": [{"key": "k", "operator": "Foo", "values": ["v"]}]}}]}]),
            none.clone(),
            "operator",
        ),
        (
            "p-types",
            serde_json::json!([]),
            serde_json::json!({"policyTypes": ["Sideways"]}),
            "policyTypes",
        ),
    ];
    for (name, ingress, extra, _) in &invalid {
        create_policy(&client, "bad", policy(name, ingress.clone(), extra.clone()))
            .await
            .unwrap_or_else(|e| panic!("create {name} with validation off: {e}"));
    }
    create_policy(
        &client,
        "bad",
        policy("good", serde_json::json!([{"ports": [{"port": 8080}]}]), none.clone()),
    )
    .await
    .unwrap();
    create_pods(
        &client,
        vec![
            pod("bad", "web", "node-a", Some("10.88.0.2"), &[("app", "web")]),
            pod("bad", "broken-ip", "node-a", Some("10.88.0.999"), &[("app", "web")]),
        ],
        2,
    )
    .await;

    let dp = RecordingDataplane::default();
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;
    wait_until("web enforced", Duration::from_secs(10), || {
        endpoint_with_ip(&dp.lock().state, "10.88.0.2").is_some()
    })
    .await;

    assert_eq!(metric(&agent, "npm_invalid_policies"), invalid.len() as f64);
    assert!(metric(&agent, "npm_policy_errors_total") >= invalid.len() as f64);
    let text = logs.text();
    for (name, _, _, field) in &invalid {
        let line = text
            .lines()
            .find(|l| l.contains(&format!("bad/{name}")) && l.contains("invalid NetworkPolicy"))
            .unwrap_or_else(|| panic!("no log line for bad/{name} in:\n{text}"));
        assert!(line.contains(field), "log line for {name} names {field}: {line}");
    }
    assert!(
        text.lines()
            .any(|l| l.contains("bad/broken-ip") && l.contains("pod skipped")),
        "the malformed pod IP is logged:\n{text}"
    );
    {
        let r = dp.lock();
        let (ep, _) = endpoint_with_ip(&r.state, "10.88.0.2").unwrap();
        assert_eq!(
            policies_of_endpoint(&r.state, ep),
            ["bad/good".to_string()].into(),
            "the valid policy is enforced"
        );
        assert!(r.state.endpoints.values().all(|e| e.isolated_ingress));
    }

    // Removing one invalid policy lowers the gauge.
    delete_policy(&client, "bad", "p-cidr").await;
    wait_until("gauge lowered", Duration::from_secs(10), || {
        metric(&agent, "npm_invalid_policies") == (invalid.len() - 1) as f64
    })
    .await;
    drop(agent);
    srv.shutdown().await;
}
