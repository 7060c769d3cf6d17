//! What the agent does with what npm-cni tells it, through the real
//! plugins (`ptp` or `bridge`, then the real `npm-cni` binary, chained as a
//! runtime runs a conflist), the test API server and the agent's CNI
//! socket; the dataplane is the recording one, so the tests read exactly
//! what was programmed.
//!
//! - ADD programs the endpoint on the pod's veth with the CNI addresses
//!   before the kubelet publishes them; CHECK and STATUS answer; a
//!   restarted agent re-learns the attachment from its state file; DEL
//!   evicts the endpoint and its address at once although the API object
//!   lingers with it; the tombstone goes with the object.
//! - Incident 1 with CNI facts: a stale object claiming the address IPAM
//!   hands to a new pod never owns it.
//! - `bridge`: the endpoint is on the veth, never on the bridge.
//! - GC drops the attachments the runtime no longer lists.
//! - STATUS: a restarted agent that cannot list the API answers "ok" (a
//!   full sync was applied on this node since it booted); an agent of a
//!   node where none was answers "retry".
//! - A static pod: the runtime passes the static pod's uid, the API holds
//!   its mirror pod (another uid, the static one in
//!   `kubernetes.io/config.mirror`): ADD is answered once the mirror pod's
//!   endpoint is programmed, the tombstone holds while the mirror object
//!   lingers, and an object of another name carrying the same annotation
//!   never gets the attachment's address.
//!
//! Names carry the process id (`npmcnia<pid>...`).

use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use crate::cni_chain::*;
use crate::cni_plugins::ifindex;
use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use npm_agent::agent::RunningAgent;
use npm_agent::cni::CniConfig;
use npm_cni::proto::{self, ConnectMode, Request};
use serde_json::json;

const NS: &str = "f";

async fn pending_pod(client: &kube::Client, name: &str, app: &str) -> String {
    let mut p = pod(NS, name, "node-a", None, &[("app", app)]);
    p.status.as_mut().unwrap().phase = Some("Pending".into());
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &p)
        .await
        .unwrap_or_else(|e| panic!("create pod {name}: {e}"))
        .metadata
        .uid
        .unwrap()
}

async fn publish_ip(client: &kube::Client, name: &str, ip: IpAddr) {
    let status = json!({"status": {"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]}});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap();
}

async fn agent(client: &kube::Client, dp: &RecordingDataplane, net: &Network) -> RunningAgent {
    let mut cfg = agent_config(100);
    cfg.cni = Some(CniConfig::new(net.socket.clone()));
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;
    agent
}

async fn setup(tag: &str, wiring: Wiring, subnet: &str) -> (npm_testapi::TestApiServer, kube::Client, Arc<Network>) {
    clear_leftovers();
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace(NS, &[])]).await;
    create_policy(
        &client,
        NS,
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "web", "namespace": NS},
            "spec": {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [{"ports": [{"port": 80}]}]}
        }),
    )
    .await
    .unwrap();
    (srv, client, Arc::new(Network::new(tag, wiring, subnet)))
}

fn add(sb: &mut Sandbox) {
    let chain = tokio::task::block_in_place(|| sb.add());
    assert!(chain.ok(), "ADD of {}: {:?}", sb.name, chain.runs);
}

fn exchange(net: &Network, request: &Request) -> proto::Response {
    proto::exchange(&net.socket, request, Duration::from_secs(10), ConnectMode::Once).expect("the agent answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn add_check_restart_del_and_tombstone() {
    let (srv, client, net) = setup("a", Wiring::Ptp, "10.241.0.0/24").await;
    let dp = RecordingDataplane::default();
    let first = agent(&client, &dp, &net).await;
    assert!(exchange(&net, &Request::Status).ok);

    let uid = pending_pod(&client, "p", "web").await;
    let mut sb = Sandbox::new(&net, NS, "p", &uid);
    add(&mut sb);
    let ip = sb.ip().to_string();
    let veth = sb.host_interfaces()[0].clone();
    {
        // Programmed before the IP is in the pod's status.
        let r = dp.lock();
        let (id, name) = endpoint_with_ip(&r.state, &ip).expect("endpoint programmed at ADD");
        assert_eq!(name, "f/p");
        assert_eq!(r.interfaces.get(&id), Some(&ifindex(None, &veth)), "on the pod's veth");
        assert_eq!(policies_of_endpoint(&r.state, id), ["f/web".to_string()].into());
    }
    let check = tokio::task::block_in_place(|| sb.check_npm_cni());
    assert_eq!(check.code, 0, "{check:?}");
    let state_file = net.socket.with_file_name(npm_agent::cni::persist::STATE_FILE_NAME);
    let saved: serde_json::Value = serde_json::from_slice(&std::fs::read(&state_file).unwrap()).unwrap();
    assert_eq!(saved["attachments"][0]["pod"]["uid"], uid.as_str(), "{saved}");
    assert!(metric(&first, "npm_cni_add_wait_seconds_count") >= 1.0);
    assert_eq!(
        metric(&first, "npm_cni_requests_total{command=\"add\",result=\"ok\"}"),
        1.0
    );
    publish_ip(&client, "p", sb.ip()).await;

    // A restarted agent knows the attachment from the state file.
    drop(first);
    let second = agent(&client, &dp, &net).await;
    assert_eq!(second.cni_facts.current().attachments().count(), 1);
    wait_until("CHECK passes after the restart", Duration::from_secs(10), || {
        tokio::task::block_in_place(|| sb.check_npm_cni()).code == 0
    })
    .await;

    // DEL: evicted at once, though the object still has the address.
    let runs = tokio::task::block_in_place(|| sb.del());
    assert!(runs.iter().all(|r| r.code == 0), "{runs:?}");
    {
        let r = dp.lock();
        assert_eq!(
            endpoint_with_ip(&r.state, &ip),
            None,
            "endpoint evicted when DEL returned"
        );
        assert!(!r.state.ipcache.contains_key(&ip.parse().unwrap()), "address evicted");
    }
    assert!(second.cni_facts.current().is_tombstoned(&uid));
    // The tombstone holds while the object lingers, and goes with it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(endpoint_with_ip(&dp.lock().state, &ip), None);
    delete_pods(&client, vec![(NS.into(), "p".into())], 1).await;
    wait_until("tombstone lifted", Duration::from_secs(10), || {
        !second.cni_facts.current().is_tombstoned(&uid)
    })
    .await;
    drop(sb);
    drop(second);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_object_never_takes_the_address_of_the_attached_pod() {
    let (srv, client, net) = setup("i", Wiring::Ptp, "10.242.0.0/24").await;
    // host-local hands out .2 first: a stale object of a gone pod has it.
    create_pods(
        &client,
        vec![pod(NS, "old", "node-a", Some("10.242.0.2"), &[("app", "old")])],
        1,
    )
    .await;
    let dp = RecordingDataplane::default();
    let agent = agent(&client, &dp, &net).await;
    let uid = pending_pod(&client, "new", "web").await;
    let mut sb = Sandbox::new(&net, NS, "new", &uid);
    add(&mut sb);
    assert_eq!(sb.ip().to_string(), "10.242.0.2");
    {
        let r = dp.lock();
        let (id, name) = endpoint_with_ip(&r.state, "10.242.0.2").unwrap();
        assert_eq!(name, "f/new", "the attached pod owns its address");
        assert_eq!(r.state.endpoints.len(), 1, "the stale object has no endpoint");
        assert_eq!(policies_of_endpoint(&r.state, id), ["f/web".to_string()].into());
        let identity = r.state.ipcache[&"10.242.0.2".parse().unwrap()].identity;
        assert_eq!(
            identity, r.state.endpoints[&id].identity,
            "the address carries the new pod's identity"
        );
    }
    // The stale object is written again after the new pod's status: no change.
    publish_ip(&client, "new", sb.ip()).await;
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(
            "old",
            &PatchParams::default(),
            &Patch::Merge(
                &json!({"status": {"phase": "Running", "podIP": "10.242.0.2", "podIPs": [{"ip": "10.242.0.2"}]}}),
            ),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        endpoint_with_ip(&dp.lock().state, "10.242.0.2").map(|e| e.1).as_deref(),
        Some("f/new")
    );
    drop(sb);
    drop(agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridge_pods_are_attached_on_their_veth_and_gc_evicts() {
    let (srv, client, net) = setup("b", Wiring::Bridge, "10.243.0.0/24").await;
    let dp = RecordingDataplane::default();
    let agent = agent(&client, &dp, &net).await;
    let uid = pending_pod(&client, "w", "web").await;
    let mut sb = Sandbox::new(&net, NS, "w", &uid);
    add(&mut sb);
    let hosts = sb.host_interfaces();
    assert_eq!(hosts.len(), 2, "bridge lists the bridge and the veth: {hosts:?}");
    assert_eq!(Some(&hosts[0]), net.bridge.as_ref());
    {
        let r = dp.lock();
        let (id, _) = endpoint_with_ip(&r.state, &sb.ip().to_string()).unwrap();
        assert_eq!(r.interfaces.get(&id), Some(&ifindex(None, &hosts[1])), "on the veth");
        assert_ne!(
            r.interfaces.get(&id),
            Some(&ifindex(None, &hosts[0])),
            "never the bridge"
        );
    }
    // GC with no valid attachment of this network evicts it.
    let gc = exchange(
        &net,
        &Request::Gc(proto::GcRequest {
            network: net.name.clone(),
            valid_attachments: Vec::new(),
        }),
    );
    assert!(gc.ok, "{gc:?}");
    assert_eq!(endpoint_with_ip(&dp.lock().state, &sb.ip().to_string()), None);
    assert_eq!(agent.cni_facts.current().attachments().count(), 0);
    drop(sb);
    drop(agent);
    srv.shutdown().await;
}

/// The uid the kubelet gives a static pod (its config hash) and passes the
/// runtime; the API server gives its mirror pod another.
const STATIC_UID: &str = "6f1c0e2b3a4d5e6f7a8b9c0d1e2f3a4b";

async fn mirror_pod(client: &kube::Client, name: &str, phase: &str, ip: Option<&str>) -> String {
    let mut p = pod(NS, name, "node-a", ip, &[("app", "web")]);
    p.metadata.annotations = Some(
        [
            ("kubernetes.io/config.mirror".to_string(), STATIC_UID.to_string()),
            ("kubernetes.io/config.hash".to_string(), STATIC_UID.to_string()),
            ("kubernetes.io/config.source".to_string(), "file".to_string()),
        ]
        .into(),
    );
    p.status.as_mut().unwrap().phase = Some(phase.into());
    Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &p)
        .await
        .unwrap_or_else(|e| panic!("create pod {name}: {e}"))
        .metadata
        .uid
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_static_pod_is_matched_to_its_mirror_pod() {
    let (srv, client, net) = setup("s", Wiring::Ptp, "10.248.0.0/24").await;
    let dp = RecordingDataplane::default();
    let agent = agent(&client, &dp, &net).await;
    let mirror_uid = mirror_pod(&client, "etcd-node-a", "Pending", None).await;
    assert_ne!(mirror_uid, STATIC_UID);
    // Another object carrying the same annotation (any pod author can set
    // it), with an address of its own.
    mirror_pod(&client, "impostor", "Running", Some("10.248.9.9")).await;
    let mut sb = Sandbox::new(&net, NS, "etcd-node-a", STATIC_UID);
    add(&mut sb);
    let ip = sb.ip().to_string();
    let veth = sb.host_interfaces()[0].clone();
    {
        let r = dp.lock();
        let (id, name) = endpoint_with_ip(&r.state, &ip).expect("the static pod's endpoint programmed at ADD");
        assert_eq!(name, "f/etcd-node-a", "the mirror pod, not the impostor");
        assert_eq!(r.interfaces.get(&id), Some(&ifindex(None, &veth)), "on the pod's veth");
        assert_eq!(policies_of_endpoint(&r.state, id), ["f/web".to_string()].into());
        assert_eq!(r.state.endpoints[&id].pod.uid, STATIC_UID, "keyed by the runtime's uid");
        let owner = r.state.ipcache[&ip.parse().unwrap()].identity;
        assert_eq!(
            owner, r.state.endpoints[&id].identity,
            "the address is the static pod's"
        );
    }
    let check = tokio::task::block_in_place(|| sb.check_npm_cni());
    assert_eq!(check.code, 0, "{check:?}");
    publish_ip(&client, "etcd-node-a", sb.ip()).await;

    // DEL: evicted; the tombstone holds while the mirror object lingers
    // with the address (past a pass of the maintenance loop).
    let runs = tokio::task::block_in_place(|| sb.del());
    assert!(runs.iter().all(|r| r.code == 0), "{runs:?}");
    assert_eq!(endpoint_with_ip(&dp.lock().state, &ip), None, "evicted at DEL");
    tokio::time::sleep(npm_agent::cni::handler::MAINTAIN_INTERVAL + Duration::from_millis(500)).await;
    assert!(
        agent.cni_facts.current().is_tombstoned(STATIC_UID),
        "held while the mirror pod lingers"
    );
    assert_eq!(endpoint_with_ip(&dp.lock().state, &ip), None);
    delete_pods(&client, vec![(NS.into(), "etcd-node-a".into())], 1).await;
    wait_until("tombstone lifted", Duration::from_secs(10), || {
        !agent.cni_facts.current().is_tombstoned(STATIC_UID)
    })
    .await;
    drop(sb);
    drop(agent);
    srv.shutdown().await;
}

/// An agent on `net` over a client whose API server may be gone, not
/// waiting for readiness: once its socket answers.
async fn agent_unready(client: &kube::Client, dp: &RecordingDataplane, net: &Network) -> RunningAgent {
    let mut cfg = agent_config(100);
    cfg.cni = Some(CniConfig::new(net.socket.clone()));
    let agent = start_agent(cfg, client.clone(), dp.clone()).await;
    wait_until("the CNI socket answers", Duration::from_secs(10), || {
        proto::exchange(&net.socket, &Request::Status, Duration::from_secs(2), ConnectMode::Once).is_ok()
    })
    .await;
    agent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_holds_across_a_restart_that_cannot_list() {
    let (srv, client, net) = setup("t", Wiring::Ptp, "10.249.0.0/24").await;
    let dp = RecordingDataplane::default();
    let first = agent(&client, &dp, &net).await;
    assert!(exchange(&net, &Request::Status).ok);
    drop(first);
    // The API server goes: the restarted agent never completes a list.
    srv.shutdown().await;
    let second = agent_unready(&client, &dp, &net).await;
    let status = exchange(&net, &Request::Status);
    assert!(status.ok, "a sync was applied on this node since it booted: {status:?}");
    assert!(!second.is_ready(), "its readiness says it cannot list");
    // A node where no sync was applied since it booted (no marker).
    let fresh = Arc::new(Network::new("u", Wiring::Ptp, "10.249.1.0/24"));
    let third = agent_unready(&client, &dp, &fresh).await;
    let status = exchange(&fresh, &Request::Status);
    assert!(!status.ok && status.retry, "{status:?}");
    assert!(
        status.error.as_deref().unwrap_or("").contains("since it booted"),
        "{status:?}"
    );
    drop(third);
    drop(second);
}
