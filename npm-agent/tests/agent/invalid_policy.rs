//! Issue 12 §4: invalid input fails closed. The test API server runs with
//! its validation off (an API server of another version accepted what this
//! one would reject); a NetworkPolicy with one good rule and one rule the
//! agent cannot understand keeps isolating the pod it selects: the good
//! rule's peer is allowed, every other peer is denied, and a Kubernetes
//! Event (reason `PolicyPartiallyInvalid`) on the policy names the field
//! and the value, once per policy resourceVersion.
//!
//! The real agent against a recording dataplane, then with real packets
//! through eBPF (`NPM_EBPF_OBJECT`) and nftables: three routed pod
//! namespaces `a`, `b` (the server, app=b) and `c`; the policy allows
//! app=a to b:8080 and has a second rule whose only peer is an ipBlock
//! `<subnet>.3.0/33` (c's subnet with a bad prefix). Before the fix the
//! policy was skipped: b was not isolated and c reached it.

use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::common::netns::*;
use crate::common::*;
use k8s_openapi::api::core::v1::Event;
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::api::{Api, ListParams, Patch, PatchParams};
use npm_agent::agent::RunningAgent;
use npm_agent::node::{InterfacePattern, InterfaceResolver};
use npm_agent::telemetry::events::REASON_PARTIALLY_INVALID;
use npm_dataplane::ebpf::{EbpfDataplane, EbpfOptions};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_policy::compiled::Direction;
use npm_policy::lookup::lookup;

/// `k/half-bad`: app=b is isolated; app=a may reach it on 8080 (rule 0);
/// rule 1's only peer has a bad CIDR (the rule is dropped).
fn half_bad(subnet: &str) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "half-bad", "namespace": "k"},
        "spec": {"podSelector": {"matchLabels": {"app": "b"}},
                 "ingress": [
                     {"from": [{"podSelector": {"matchLabels": {"app": "a"}}}], "ports": [{"port": 8080}]},
                     {"from": [{"ipBlock": {"cidr": format!("{subnet}.3.0/33")}}]}
                 ]}
    })
}

/// A test API server with validation off holding namespace `k` and the
/// Running pods `a`, `b`, `c` of `node-a` at `<subnet>.<1|2|3>.2`.
async fn three_pod_server(subnet: &str) -> (npm_testapi::TestApiServer, kube::Client) {
    let (srv, client) = server(false).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    let pods = ["a", "b", "c"]
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let ip = format!("{subnet}.{}.2", i + 1);
            pod("k", name, "node-a", Some(&ip), &[("app", name)])
        })
        .collect();
    create_pods(&client, pods, 3).await;
    (srv, client)
}

/// The Events with reason `PolicyPartiallyInvalid` on `k/<policy>`.
async fn policy_events(client: &kube::Client, policy: &str) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(client.clone(), "k");
    api.list(&ListParams::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| {
            e.involved_object.name.as_deref() == Some(policy)
                && e.involved_object.kind.as_deref() == Some("NetworkPolicy")
                && e.reason.as_deref() == Some(REASON_PARTIALLY_INVALID)
        })
        .collect()
}

/// Exactly `n` Events on `k/half-bad`, each naming the field, the value and
/// the dropped rule (waits for the first ones).
async fn expect_events(client: &kube::Client, subnet: &str, n: usize) -> Vec<Event> {
    wait_until_async("the Event on the policy", Duration::from_secs(15), || async {
        policy_events(client, "half-bad").await.len() >= n
    })
    .await;
    let events = policy_events(client, "half-bad").await;
    assert_eq!(events.len(), n, "{events:#?}");
    for e in &events {
        let m = e.message.as_deref().unwrap_or("");
        assert!(m.contains("spec.ingress[1].from[0].ipBlock.cidr"), "{m}");
        assert!(m.contains(&format!("\"{subnet}.3.0/33\"")), "{m}");
        assert!(m.contains("rule spec.ingress[1] dropped"), "{m}");
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!(e.involved_object.namespace.as_deref(), Some("k"));
        assert!(e.involved_object.uid.is_some() && e.involved_object.resource_version.is_some());
    }
    events
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partially_invalid_policy_keeps_isolating_and_is_reported_once_per_version() {
    let subnet = "10.218";
    let (srv, client) = three_pod_server(subnet).await;
    create_policy(&client, "k", half_bad(subnet))
        .await
        .expect("created with validation off");
    let dp = RecordingDataplane::default();
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;
    let ip = |n: u8| format!("{subnet}.{n}.2").parse().unwrap();
    {
        let r = dp.lock();
        let (b, _) = endpoint_with_ip(&r.state, &format!("{subnet}.2.2")).expect("b is an endpoint");
        assert!(r.state.endpoints[&b].isolated_ingress, "b stays isolated");
        assert_eq!(policies_of_endpoint(&r.state, b), ["k/half-bad".to_string()].into());
        assert!(
            lookup(&r.state, b, Direction::Ingress, ip(1), 6, 8080).allowed,
            "a -> b:8080"
        );
        assert!(
            !lookup(&r.state, b, Direction::Ingress, ip(1), 6, 9090).allowed,
            "a -> b:9090"
        );
        assert!(
            !lookup(&r.state, b, Direction::Ingress, ip(3), 6, 8080).allowed,
            "c -> b"
        );
        assert!(!lookup(&r.state, b, Direction::Ingress, "192.0.2.1".parse().unwrap(), 6, 8080).allowed);
    }
    assert_eq!(metric(&agent, "npm_invalid_policies"), 1.0);
    assert!(metric(&agent, "npm_policy_errors_total") >= 1.0);
    let first = expect_events(&client, subnet, 1).await;

    // More syncs of the same version: no second Event.
    create_pods(
        &client,
        vec![pod("k", "d", "node-b", Some("10.219.0.9"), &[("app", "d")])],
        1,
    )
    .await;
    wait_until("d synced", Duration::from_secs(10), || {
        dp.lock().state.ipcache.contains_key(&"10.219.0.9".parse().unwrap())
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    expect_events(&client, subnet, 1).await;

    // A new resourceVersion (a label change) still has the bad rule: one
    // more Event.
    let api: Api<NetworkPolicy> = Api::namespaced(client.clone(), "k");
    api.patch(
        "half-bad",
        &PatchParams::default(),
        &Patch::Merge(serde_json::json!({"metadata": {"labels": {"touched": "1"}}})),
    )
    .await
    .unwrap();
    let two = expect_events(&client, subnet, 2).await;
    assert!(two.iter().any(|e| e.metadata.name == first[0].metadata.name));

    // A restarted agent (and so the agent of any other node) names the
    // Event of a version the same way: no duplicate.
    drop(agent);
    let agent = start_agent(agent_config(100), client.clone(), dp.clone()).await;
    wait_until("agent ready again", Duration::from_secs(20), || agent.is_ready()).await;
    wait_until("reported again", Duration::from_secs(10), || {
        metric(&agent, "npm_invalid_policies") == 1.0
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    expect_events(&client, subnet, 2).await;
    assert_eq!(metric(&agent, "npm_errors_total{kind=\"event\"}"), 0.0);

    // Fixed: the report goes, the good rule stays.
    let mut fixed = half_bad(subnet);
    fixed["spec"]["ingress"].as_array_mut().unwrap().pop();
    let mut np: NetworkPolicy = serde_json::from_value(fixed).unwrap();
    np.metadata.resource_version = api.get("half-bad").await.unwrap().metadata.resource_version;
    api.replace("half-bad", &Default::default(), &np).await.unwrap();
    wait_until("report cleared", Duration::from_secs(10), || {
        metric(&agent, "npm_invalid_policies") == 0.0
    })
    .await;
    drop(agent);
    srv.shutdown().await;
}

/// Probes with real packets: a -> b:8080 allowed, c -> b denied, and the
/// Event exists.
async fn check_packets(client: &kube::Client, subnet: &str, pods: &[String; 3], agent: &RunningAgent) {
    let server: SocketAddr = format!("{subnet}.2.2:8080").parse().unwrap();
    expect_probe(&pods[2], server, true, "c reaches b before the policy").await;
    create_policy(client, "k", half_bad(subnet))
        .await
        .expect("created with validation off");
    expect_probe(&pods[2], server, false, "c is denied: b stays isolated").await;
    expect_probe(&pods[0], server, true, "a is allowed by the good rule").await;
    // Stable: c stays denied after a few more syncs.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!probe(&pods[2], server), "c stays denied");
    assert_eq!(metric(agent, "npm_invalid_policies"), 1.0);
    expect_events(client, subnet, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partially_invalid_policy_isolates_with_real_packets_ebpf() {
    const PREFIX: &str = "npmiv";
    clear_stale_netns(PREFIX);
    clear_stale_links("ngi");
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    let subnet = "10.216";
    let topo = RoutedPods::new(PREFIX, "ngi", ["a", "b", "c"], subnet);
    serve(
        &topo.pods[1],
        format!("{subnet}.2.2:8080").parse().unwrap(),
        topo.stop.clone(),
    );
    let (srv, client) = three_pod_server(subnet).await;
    let dp = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: topo.pin_dir.clone(),
        bench_no_ct_create: false,
        attach: npm_dataplane::ebpf::AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane (NPM_EBPF_OBJECT)");
    let pattern = InterfacePattern::new(&format!("ngi{}*", std::process::id())).unwrap();
    let resolver = InterfaceResolver::new(Some(pattern));
    let agent = start_agent_with(agent_config(100), client.clone(), dp, Box::new(resolver)).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    check_packets(&client, subnet, &topo.pods, &agent).await;
    drop(agent);
    srv.shutdown().await;
    drop(topo);
}

/// A node namespace with three routed pod namespaces (as `kernel_nft.rs`,
/// with a third pod); removed on drop.
struct NodeTopology {
    node: String,
    pods: [String; 3],
    stop: Arc<AtomicBool>,
}

impl Drop for NodeTopology {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        for ns in self.pods.iter().chain([&self.node]) {
            let _ = Command::new("ip").args(["netns", "delete", ns]).output();
        }
    }
}

fn node_topology(prefix: &str, veth: &str, subnet: &str) -> NodeTopology {
    clear_stale_netns(prefix);
    let pid = std::process::id();
    let t = NodeTopology {
        node: format!("{prefix}{pid}n"),
        pods: ["a", "b", "c"].map(|x| format!("{prefix}{pid}{x}")),
        stop: Arc::new(AtomicBool::new(false)),
    };
    for ns in t.pods.iter().chain([&t.node]) {
        sh(&["ip", "netns", "add", ns]);
        sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
    }
    sh(&["ip", "netns", "exec", &t.node, "sysctl", "-qw", "net.ipv4.ip_forward=1"]);
    for (i, (pod_ns, tag)) in t.pods.iter().zip(["a", "b", "c"]).enumerate() {
        let host = format!("{veth}{pid}{tag}");
        let net = i + 1;
        sh(&[
            "ip", "link", "add", &host, "netns", &t.node, "type", "veth", "peer", "name", "eth0", "netns", pod_ns,
        ]);
        sh(&[
            "ip",
            "-n",
            &t.node,
            "addr",
            "add",
            &format!("{subnet}.{net}.1/24"),
            "dev",
            &host,
        ]);
        sh(&["ip", "-n", &t.node, "link", "set", &host, "up"]);
        sh(&[
            "ip",
            "-n",
            pod_ns,
            "addr",
            "add",
            &format!("{subnet}.{net}.2/24"),
            "dev",
            "eth0",
        ]);
        sh(&["ip", "-n", pod_ns, "link", "set", "eth0", "up"]);
        sh(&[
            "ip",
            "-n",
            pod_ns,
            "route",
            "add",
            "default",
            "via",
            &format!("{subnet}.{net}.1"),
        ]);
    }
    t
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partially_invalid_policy_isolates_with_real_packets_nftables() {
    let subnet = "10.217";
    let topo = node_topology("npmin", "ngv", subnet);
    serve(
        &topo.pods[1],
        format!("{subnet}.2.2:8080").parse().unwrap(),
        topo.stop.clone(),
    );
    let (srv, client) = three_pod_server(subnet).await;
    let dp = NftDataplane::new(NftOptions {
        table: format!("npm_i{}", std::process::id()),
        netns: Some(topo.node.clone()),
    })
    .expect("nft dataplane");
    let resolver = InterfaceResolver::new(None).in_netns(&topo.node);
    let agent = start_agent_with(agent_config(100), client.clone(), dp, Box::new(resolver)).await;
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;
    check_packets(&client, subnet, &topo.pods, &agent).await;
    drop(agent);
    srv.shutdown().await;
    drop(topo);
}
