//! The multi-node cluster with pods wired by the real reference CNI plugins
//! chained with npm-cni, enforced by one real agent per node (nftables
//! dataplane): Node objects with their addresses; every Pod scheduled on
//! the node that owns its namespace's subnet, its CNI result cached in the
//! node's `/var/lib/cni/results` in libcni's `cniCacheV1` format with the
//! Pod's uid in `cniArgs`, its host veth in the node's netns (not the
//! root's), its status IPs published; a default-deny policy enforced for
//! same-node and cross-node sources alike; DEL removing the cache entry
//! and the IPAM lease; teardown leaving no netns, holder or directory.
//!
//! Needs root, the reference plugins in /usr/lib/cni, and the agent and
//! npm-cni binaries (`cargo build --bin npm-agent --bin npm-cni`).

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use base64::Engine as _;
use npm_e2e::api::pod_path;
use npm_e2e::runner::{parse_text, CniMode, Engine, LiveRunner, Options};
use serde_json::Value;

fn bin(name: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../target/debug")
        .join(name);
    assert!(p.exists(), "{} missing: cargo build --bin {name}", p.display());
    p
}

const DENY_X: &str = r#"
id: nodes-deny-ingress-x
steps:
  - actions:
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: x, name: deny-ingress}
          spec: {podSelector: {}, policyTypes: [Ingress]}
    probes:
      - port: 80
        protocol: TCP
        matrix:
          x/a: '000111111'
          x/b: '000111111'
          x/c: '000111111'
          y/a: '000111111'
          y/b: '000111111'
          y/c: '000111111'
          z/a: '000111111'
          z/b: '000111111'
          z/c: '000111111'
  - actions:
      - delete_pod: {pod: y/b}
    probes: []
"#;

fn link_exists(netns: Option<&str>, name: &str) -> bool {
    let mut cmd = Command::new("ip");
    if let Some(n) = netns {
        cmd.args(["-n", n]);
    }
    cmd.args(["link", "show", "dev", name])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false)
}

#[test]
fn cni_pods_on_three_nodes_enforced_by_their_agents() {
    let opts = Options {
        engine: Engine::Nftables,
        agent_bin: bin("npm-agent"),
        npm_cni_bin: bin("npm-cni"),
        nodes: 3,
        cni: CniMode::Ptp,
        deadline: Duration::from_secs(15),
        startup_deadline: Duration::from_secs(30),
        ..Options::default()
    };
    let t0 = std::time::Instant::now();
    let mut r = LiveRunner::start(opts).expect("start the three-node cluster");
    eprintln!("three nodes, nine CNI pods, three agents ready in {:?}", t0.elapsed());
    let api = r.api().clone();
    let nodes = r.cluster().nodes().expect("nodes");
    assert_eq!(nodes.nodes().len(), 3);
    for node in nodes.nodes() {
        let obj = api
            .get(&format!("/api/v1/nodes/{}", node.name))
            .expect("the Node object");
        let addrs: Vec<&str> = obj["status"]["addresses"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|a| a["address"].as_str())
            .collect();
        assert!(addrs.contains(&node.ipv4.to_string().as_str()), "{obj}");
        assert!(addrs.contains(&node.ipv6.to_string().as_str()), "{obj}");
        assert!(
            node.run_npm().join("cni.sock").exists(),
            "node {}'s agent listens on its own /run/npm/cni.sock",
            node.name
        );
    }

    for pod in r.cluster().pods() {
        let obj = api.get(&pod_path(&pod.namespace, &pod.name)).unwrap();
        let node = pod.node.clone().expect("scheduled");
        assert_eq!(obj["spec"]["nodeName"], node.as_str());
        let n = pod.ipv4.octets()[2];
        assert_eq!(
            node,
            nodes.node_for_namespace(n).name,
            "{} on its namespace's node",
            pod.key()
        );
        let ips: Vec<&str> = obj["status"]["podIPs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| i["ip"].as_str())
            .collect();
        assert_eq!(ips, [pod.ipv4.to_string(), pod.ipv6.to_string()]);
        let uid = obj["metadata"]["uid"].as_str().unwrap();
        let att = pod.attachment.as_ref().expect("a CNI attachment");
        let cache: Value =
            serde_json::from_slice(&std::fs::read(att.cache_path()).expect("the cached result")).unwrap();
        assert_eq!(cache["kind"], "cniCacheV1");
        assert_eq!(cache["containerId"], att.container_id.as_str());
        assert_eq!(cache["ifName"], "eth0");
        assert_eq!(cache["networkName"], "npm-e2e");
        assert!(
            cache["cniArgs"]
                .as_array()
                .unwrap()
                .iter()
                .any(|kv| kv[0] == "K8S_POD_UID" && kv[1] == uid),
            "{cache}"
        );
        let addrs: Vec<&str> = cache["result"]["ips"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| i["address"].as_str())
            .collect();
        assert_eq!(
            addrs,
            [format!("{}/24", pod.ipv4), format!("{}/112", pod.ipv6)],
            "{cache}"
        );
        let config: Value = serde_json::from_slice(
            &base64::engine::general_purpose::STANDARD
                .decode(cache["config"].as_str().unwrap())
                .unwrap(),
        )
        .unwrap();
        assert_eq!(config["plugins"][0]["type"], "ptp");
        assert_eq!(config["plugins"][1]["type"], "npm-cni");
        assert!(
            link_exists(pod.node_netns.as_deref(), &pod.host_if),
            "{}'s veth {} in its node",
            pod.key(),
            pod.host_if
        );
        assert!(
            !link_exists(None, &pod.host_if),
            "{} is not in the root netns",
            pod.host_if
        );
    }
    let node2 = nodes.node(2).unwrap();
    let lease = node2.var_lib_cni().join("networks/npm-e2e/198.18.2.2");
    assert!(lease.exists(), "host-local's lease of y/b in node-2's /var/lib/cni");
    let yb_cache = r
        .cluster()
        .pod("y", "b")
        .unwrap()
        .attachment
        .as_ref()
        .unwrap()
        .cache_path();

    // Default deny in x: blocked from x's own node and from the others.
    let case = parse_text(DENY_X).expect("parse").remove(0);
    let (passed, report) = r.run_case(&case);
    assert!(passed, "{report}");
    assert!(!yb_cache.exists(), "DEL removed the cache entry of y/b");
    assert!(!lease.exists(), "DEL released y/b's address");
    r.reset().expect("reset");
    assert!(lease.exists(), "y/b wired again");

    let dirs: Vec<PathBuf> = r
        .cluster()
        .nodes()
        .unwrap()
        .nodes()
        .iter()
        .map(|n| n.dir.clone())
        .collect();
    r.shutdown().expect("shutdown");
    assert!(
        npm_e2e::cluster::own_netns().is_empty(),
        "{:?}",
        npm_e2e::cluster::own_netns()
    );
    for d in dirs {
        assert!(!d.exists(), "{} removed", d.display());
    }
}
