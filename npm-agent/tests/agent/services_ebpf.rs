//! The agent's Services side against the test API server and the kernel:
//! Services and Nodes become `NPM_SERVICES` keys (ClusterIP ports and
//! externalIPs and LoadBalancer ingress IPs with the service ports, node
//! address x NodePort), level-triggered (an entry written behind the
//! agent's back is removed, a deleted Service's keys go), and `node_exit`
//! is attached to this node's uplinks and never to an endpoint's interface,
//! after `host_in`'s `INPUT` rules are in place.
//! Needs root (bpffs, tcx).

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use crate::common::*;
use k8s_openapi::api::core::v1::{Node, Pod, Service};
use kube::api::{Api, DeleteParams, PostParams};
use npm_agent::node::netlink::Netlink;
use npm_agent::node::uplinks::read_uplinks;
use npm_agent::services::ServicesConfig;
use npm_agent::telemetry::metrics::Metrics;
use npm_common::{proto, SVC_CLUSTER_IP, SVC_EXTERNAL_IP, SVC_HOST_PORT, SVC_LOAD_BALANCER, SVC_NODE_PORT};
use npm_dataplane::ebpf::{AttachMode, EbpfDataplane, EbpfOptions, ServicePort, ServicesMap};

/// A pin directory of this test, removed on drop.
struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn key(a: &str, port: u16, protocol: u8) -> ServicePort {
    ServicePort {
        addr: a.parse::<IpAddr>().unwrap(),
        port,
        protocol,
    }
}

fn entries(pins: &Pins) -> BTreeMap<ServicePort, u32> {
    ServicesMap::open(&pins.0).unwrap().entries().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn services_and_nodes_become_npm_services_and_node_exit_sits_on_the_uplinks() {
    npm_dataplane::ebpf::ensure_bpffs().unwrap();
    let pins = Pins(PathBuf::from(format!(
        "/sys/fs/bpf/npm-test-{}-agent-services",
        std::process::id()
    )));
    let _ = std::fs::remove_dir_all(&pins.0);
    // The dataplane pins the maps (NPM_SERVICES among them).
    let _dp = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: pins.0.clone(),
        bench_no_ct_create: false,
        attach: AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane");
    // A key nobody asked for: the first complete sync removes it.
    let stale = key("10.96.9.9", 9, proto::TCP);
    ServicesMap::open(&pins.0)
        .unwrap()
        .sync(&BTreeMap::from([(stale, SVC_CLUSTER_IP)]))
        .unwrap();

    let (_srv, client) = server(false).await;
    let services: Api<Service> = Api::namespaced(client.clone(), "kube-system");
    let dns: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "kube-dns", "namespace": "kube-system"},
        "spec": {"clusterIP": "10.96.0.10", "clusterIPs": ["10.96.0.10"],
                 "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                           {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]}
    }))
    .unwrap();
    let web: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "web", "namespace": "kube-system"},
        "spec": {"type": "NodePort", "clusterIP": "10.96.1.1",
                 "ports": [{"port": 80, "targetPort": 8080, "nodePort": 30080, "protocol": "TCP"}]}
    }))
    .unwrap();
    // A LoadBalancer with an externalIP: kube-proxy DNATs both, and the
    // load balancer's IP, but not the one in `ipMode: Proxy`.
    let edge: Service = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "edge", "namespace": "kube-system"},
        "spec": {"type": "LoadBalancer", "clusterIP": "10.96.2.2", "externalIPs": ["198.51.100.7"],
                 "ports": [{"port": 443, "targetPort": 8443, "nodePort": 30443, "protocol": "TCP"}]},
        "status": {"loadBalancer": {"ingress": [{"ip": "203.0.113.5", "ipMode": "VIP"},
                                                {"ip": "203.0.113.9", "ipMode": "Proxy"}]}}
    }))
    .unwrap();
    services.create(&PostParams::default(), &dns).await.unwrap();
    services.create(&PostParams::default(), &web).await.unwrap();
    let created = services.create(&PostParams::default(), &edge).await.unwrap();
    if created
        .status
        .as_ref()
        .and_then(|s| s.load_balancer.as_ref())
        .and_then(|l| l.ingress.as_ref())
        .is_none()
    {
        let mut with_status = created.clone();
        with_status.status = edge.status.clone();
        services
            .replace_status("edge", &PostParams::default(), &with_status)
            .await
            .expect("service status");
    }
    let nodes: Api<Node> = Api::all(client.clone());
    let node: Node = serde_json::from_value(serde_json::json!({
        "metadata": {"name": "node-a"},
        "status": {"addresses": [{"type": "InternalIP", "address": "192.0.2.77"},
                                 {"type": "Hostname", "address": "node-a"}]}
    }))
    .unwrap();
    let created = nodes.create(&PostParams::default(), &node).await.unwrap();
    if created.status.as_ref().and_then(|s| s.addresses.as_ref()).is_none() {
        let mut with_status = created.clone();
        with_status.status = node.status.clone();
        nodes
            .replace_status("node-a", &PostParams::default(), &with_status)
            .await
            .expect("node status");
    }

    // Two pods with a hostPort: this node's is a key at its address, the
    // other node's is not (its DNAT happens there).
    let pods: Api<Pod> = Api::namespaced(client.clone(), "default");
    for (name, node_name, host_port) in [("ingress-a", "node-a", 8443), ("ingress-b", "node-b", 9443)] {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": "default"},
            "spec": {"nodeName": node_name, "containers": [{"name": "c", "image": "x",
                "ports": [{"containerPort": 443, "hostPort": host_port}]}]},
        }))
        .unwrap();
        pods.create(&PostParams::default(), &pod).await.unwrap();
    }

    let mut cfg = ServicesConfig::new(pins.0.clone());
    cfg.resync = Duration::from_millis(500);
    cfg.node_name = Some("node-a".into());
    let metrics = Metrics::new().unwrap();
    let tasks = npm_agent::services::spawn(client.clone(), cfg, metrics.clone());

    let want = BTreeMap::from([
        (key("10.96.0.10", 53, proto::UDP), SVC_CLUSTER_IP),
        (key("10.96.0.10", 53, proto::TCP), SVC_CLUSTER_IP),
        (key("10.96.1.1", 80, proto::TCP), SVC_CLUSTER_IP),
        (key("192.0.2.77", 30080, proto::TCP), SVC_NODE_PORT),
        (key("10.96.2.2", 443, proto::TCP), SVC_CLUSTER_IP),
        (key("198.51.100.7", 443, proto::TCP), SVC_EXTERNAL_IP),
        (key("203.0.113.5", 443, proto::TCP), SVC_LOAD_BALANCER),
        (key("192.0.2.77", 30443, proto::TCP), SVC_NODE_PORT),
        (key("192.0.2.77", 8443, proto::TCP), SVC_HOST_PORT),
    ]);
    wait_until("NPM_SERVICES holds the keys", Duration::from_secs(20), || {
        entries(&pins) == want
    })
    .await;

    // Keys are written only once host_in's INPUT rules are in place: the
    // chain of this pin directory decides with its pinned program.
    let chain = npm_dataplane::ebpf::host_in_chain(&pins.0);
    let iptables = |args: &[&str]| {
        let out = std::process::Command::new("iptables").args(args).output().unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let rules = iptables(&["-w", "5", "-S", &chain]);
    let pin = pins.0.join("host_in");
    assert!(rules.contains(&format!("--object-pinned {}", pin.display())), "{rules}");
    assert!(iptables(&["-w", "5", "-S", "INPUT"]).contains(&format!("-j {chain}")));
    // ... and the metric says so (set at the resync that attached).
    wait_until("npm_host_in_mode says decided", Duration::from_secs(5), || {
        let text = metrics.render();
        text.contains("npm_host_in_mode{mode=\"decided\"} 1") && text.contains("npm_host_in_mode{mode=\"drop-all\"} 0")
    })
    .await;

    // node_exit is on exactly the uplinks the netlink rule picks (the
    // endpoint interfaces excluded), each with a pin under exit/.
    let mut nl = Netlink::open(None).unwrap();
    let up = read_uplinks(&mut nl, &BTreeSet::new()).unwrap();
    assert!(!up.chosen.is_empty(), "this host has a default route");
    for ifindex in up.chosen.keys() {
        assert!(
            pins.0.join("exit").join(ifindex.to_string()).exists(),
            "node_exit not pinned on uplink {ifindex} ({up:?})"
        );
    }

    // Written behind the agent's back: removed again (level-triggered).
    ServicesMap::open(&pins.0)
        .unwrap()
        .sync(&want.clone().into_iter().chain([(stale, SVC_CLUSTER_IP)]).collect())
        .unwrap();
    wait_until("the stray key is removed", Duration::from_secs(10), || {
        entries(&pins) == want
    })
    .await;

    // A deleted Service's keys go.
    services.delete("web", &DeleteParams::default()).await.unwrap();
    let mut after = want.clone();
    after.remove(&key("10.96.1.1", 80, proto::TCP));
    after.remove(&key("192.0.2.77", 30080, proto::TCP));
    wait_until(
        "the deleted Service's keys are removed",
        Duration::from_secs(10),
        || entries(&pins) == after,
    )
    .await;

    for t in &tasks {
        t.abort();
    }
    // The writer thread stops within a tick of its guard's drop.
    tokio::time::sleep(Duration::from_millis(600)).await;
    // Cleanup removes the node-exit pins with the pin directory.
    let removed = npm_dataplane::ebpf::remove_node_exit_pins(&pins.0).unwrap();
    assert_eq!(
        removed.into_iter().collect::<BTreeSet<u32>>(),
        up.chosen.keys().copied().collect()
    );
    // With the pin directory gone, its host_in chain is stale and removed.
    drop(_dp);
    drop(pins);
    assert!(npm_dataplane::ebpf::remove_stale_host_in_chains().contains(&chain));
}
