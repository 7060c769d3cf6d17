//! Bridged pods, end to end with the real
//! `npm-agent` binary on the eBPF dataplane: three pods `a`, `b`, `c` wired
//! by the real reference `bridge` plugin (host-local IPAM) to one bridge in
//! the root namespace, as flannel's `cni0`, kubenet and the reference
//! bridge wire them. An ingress policy on `b` allowing only `a`: `c` is
//! denied, `a` is allowed, and nothing else is disturbed (`c` and `b` still
//! reach `a`). The agent's programs sit on the pods' host veths (the bridge
//! ports), never on the bridge.
//!
//! Names are `npmnb<pid>...` (netns `npmnb<pid>a|b|c`, bridge
//! `npmnb<pid>br`, pin dir `/sys/fs/bpf/npmnb<pid>`); leftovers of crashed
//! runs are removed first. IPv4 forwarding of the root namespace (which
//! the plugin turns on for its gateway) is restored afterwards.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::cni_plugins::{bridge_conf, clear_leftovers, ifindex, CniPod};
use crate::common::netns::{expect_probe, probe, serve, Forwarding};
use crate::common::process::{free_port, http_get, inspect_json, spawn_agent_run};
use crate::common::*;

const PREFIX: &str = "npmnb";

/// The pods, the bridge, the agent's files; all removed on drop.
struct Topology {
    pods: Vec<CniPod>,
    bridge: String,
    pin_dir: PathBuf,
    work_dir: PathBuf,
    /// IPv4 forwarding on (the bridge plugin turns it on too), shared.
    _forwarding: Forwarding,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    agent: Option<Child>,
}

impl Drop for Topology {
    fn drop(&mut self) {
        if let Some(mut a) = self.agent.take() {
            let _ = a.kill();
            let _ = a.wait();
        }
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        self.pods.clear();
        let _ = Command::new("ip").args(["link", "delete", &self.bridge]).output();
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

fn setup() -> Topology {
    clear_leftovers(PREFIX);
    let pid = std::process::id();
    let work_dir = std::env::temp_dir().join(format!("{PREFIX}{pid}"));
    std::fs::create_dir_all(&work_dir).unwrap();
    let bridge = format!("{PREFIX}{pid}br");
    let mut t = Topology {
        pods: Vec::new(),
        bridge: bridge.clone(),
        pin_dir: PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{pid}")),
        _forwarding: Forwarding::on(),
        stop: Default::default(),
        agent: None,
        work_dir,
    };
    for name in ["a", "b", "c"] {
        let conf = bridge_conf("npmnb-bridge", &bridge, "10.235.0.0/24", &t.work_dir.join("ipam"));
        t.pods.push(CniPod::add(
            &format!("{PREFIX}{pid}{name}"),
            "bridge",
            conf,
            None,
            "k",
            name,
        ));
    }
    t
}

fn addr(pod: &CniPod) -> SocketAddr {
    format!("{}:8080", pod.ip()).parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bridged_pods_are_enforced_on_their_bridge_ports() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    let object = PathBuf::from(std::env::var("NPM_EBPF_OBJECT").expect("NPM_EBPF_OBJECT: a built BPF object"));
    let mut topo = setup();
    let (a, b, c) = (&topo.pods[0], &topo.pods[1], &topo.pods[2]);
    serve(&a.netns, addr(a), topo.stop.clone());
    serve(&b.netns, addr(b), topo.stop.clone());
    for (from, to, what) in [(a, b, "a->b"), (c, b, "c->b"), (c, a, "c->a"), (b, a, "b->a")] {
        assert!(probe(&from.netns, addr(to)), "{what} before the agent");
    }

    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    create_pods(
        &client,
        topo.pods
            .iter()
            .map(|p| pod("k", &p.name, "node-a", Some(&p.ip()), &[("app", &p.name)]))
            .collect(),
        3,
    )
    .await;
    let kubeconfig = topo.work_dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).expect("write kubeconfig");
    let metrics = free_port();
    let log = topo.work_dir.join("agent.log");
    topo.agent = Some(spawn_agent_run(
        &topo.pin_dir,
        Some(&object),
        &kubeconfig,
        // Any name: discovery alone must find the bridge ports.
        "*",
        metrics,
        &log,
    ));
    let (a, b, c) = (&topo.pods[0], &topo.pods[1], &topo.pods[2]);
    let start = Instant::now();
    while !matches!(http_get(metrics, "/readyz"), Some((200, _))) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "agent not ready: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    expect_probe(&a.netns, addr(b), true, "a->b, no policy").await;
    expect_probe(&c.netns, addr(b), true, "c->b, no policy").await;

    create_policy(&client, "k", deny_b()).await.unwrap();
    create_policy(&client, "k", allow_a()).await.unwrap();
    expect_probe(&c.netns, addr(b), false, "c->b denied by b's ingress policy").await;
    expect_probe(&a.netns, addr(b), true, "a->b allowed").await;
    // Nothing else is disturbed.
    expect_probe(&c.netns, addr(a), true, "c->a (a is not isolated)").await;
    expect_probe(&b.netns, addr(a), true, "b->a (b's egress is not isolated)").await;
    for _ in 0..5 {
        assert!(!probe(&c.netns, addr(b)), "c->b stays denied");
        assert!(probe(&a.netns, addr(b)), "a->b stays allowed");
    }
    // Every pod has its endpoint on its own bridge port, none on the bridge.
    let bridge_ifindex = ifindex(None, &topo.bridge);
    let start = Instant::now();
    loop {
        let dump = inspect_json(&topo.pin_dir, &[]);
        let mut got: Vec<u64> = dump["endpoints"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|e| e["ifindex"].as_u64())
            .collect();
        got.sort_unstable();
        let mut want: Vec<u64> = topo
            .pods
            .iter()
            .map(|p| u64::from(ifindex(None, &p.host_veth())))
            .collect();
        want.sort_unstable();
        assert!(
            !got.contains(&u64::from(bridge_ifindex)),
            "an endpoint on the bridge itself: {dump}"
        );
        if got == want {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(20),
            "endpoints on {got:?}, want the bridge ports {want:?}: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    srv.shutdown().await;
    drop(topo);
}
