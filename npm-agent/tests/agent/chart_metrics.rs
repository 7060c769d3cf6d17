//! The chart's `/metrics` settings: the listener's address (`metrics.address`,
//! `$(HOST_IP)` the node's primary address from the downward API), who reads
//! the named series (`metrics.readers` bound to the metrics-reader
//! ClusterRole) and the ServiceMonitor's token (`serviceMonitor.bearerTokenFile` or
//! `serviceMonitor.authorization.secret`).

use crate::chart::{agent_command_line, agent_pod_spec, container, find, template};

#[test]
fn metrics_listener_address_and_readers() {
    let args = agent_command_line(&[]);
    assert!(args.contains(&"--metrics-addr=0.0.0.0:9090".to_string()), "{args:?}");
    let args = agent_command_line(&["metrics.address=$(HOST_IP)"]);
    assert!(args.contains(&"--metrics-addr=$(HOST_IP):9090".to_string()), "{args:?}");
    let docs = template(&[]);
    let agent = container(agent_pod_spec(&docs), "containers", "agent").unwrap();
    let env = agent["env"].as_sequence().unwrap();
    let host_ip = env.iter().find(|e| e["name"] == "HOST_IP").expect("HOST_IP");
    assert_eq!(host_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.hostIP");
    // No reader bound and no token sent by default.
    assert!(find(&docs, "ClusterRoleBinding")
        .iter()
        .all(|b| b["roleRef"]["name"] != "rel-npm-agent-metrics-reader"));
    let docs = template(&[
        "serviceMonitor.enabled=true",
        "serviceMonitor.bearerTokenFile=/var/run/secrets/kubernetes.io/serviceaccount/token",
        "metrics.readers[0].kind=ServiceAccount",
        "metrics.readers[0].name=prometheus-k8s",
        "metrics.readers[0].namespace=monitoring",
    ]);
    let sm = find(&docs, "ServiceMonitor")[0];
    assert_eq!(
        sm["spec"]["endpoints"][0]["bearerTokenFile"],
        "/var/run/secrets/kubernetes.io/serviceaccount/token"
    );
    let binding = find(&docs, "ClusterRoleBinding")
        .into_iter()
        .find(|b| b["roleRef"]["name"] == "rel-npm-agent-metrics-reader")
        .expect("the readers' binding");
    assert_eq!(binding["subjects"][0]["name"], "prometheus-k8s");
    assert_eq!(binding["subjects"][0]["namespace"], "monitoring");
    let docs = template(&["serviceMonitor.enabled=true"]);
    assert!(find(&docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["bearerTokenFile"].is_null());
}

/// `serviceMonitor.authorization.secret`: the Secret form newer
/// prometheus-operator versions prefer; it replaces `bearerTokenFile`.
#[test]
fn service_monitor_authorization_from_a_secret() {
    let docs = template(&[
        "serviceMonitor.enabled=true",
        "serviceMonitor.bearerTokenFile=/var/run/secrets/kubernetes.io/serviceaccount/token",
        "serviceMonitor.authorization.secret.name=prometheus-npm-token",
    ]);
    let endpoint = &find(&docs, "ServiceMonitor")[0]["spec"]["endpoints"][0];
    assert_eq!(endpoint["authorization"]["type"], "Bearer", "{endpoint:?}");
    assert_eq!(endpoint["authorization"]["credentials"]["name"], "prometheus-npm-token");
    assert_eq!(endpoint["authorization"]["credentials"]["key"], "token");
    assert!(endpoint["bearerTokenFile"].is_null(), "one token source: {endpoint:?}");
    let docs = template(&[
        "serviceMonitor.enabled=true",
        "serviceMonitor.authorization.secret.name=t",
        "serviceMonitor.authorization.secret.key=sa-token",
    ]);
    let endpoint = &find(&docs, "ServiceMonitor")[0]["spec"]["endpoints"][0];
    assert_eq!(endpoint["authorization"]["credentials"]["key"], "sa-token");
    let docs = template(&["serviceMonitor.enabled=true"]);
    assert!(find(&docs, "ServiceMonitor")[0]["spec"]["endpoints"][0]["authorization"].is_null());
}
