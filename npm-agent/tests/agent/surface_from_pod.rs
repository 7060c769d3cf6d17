//! The agent's surface as a pod sees it. The agent runs on the "node" (the
//! root namespace) with the eBPF dataplane, its metrics listener bound to
//! the node's address as the chart's `metrics.address: $(HOST_IP)` binds it
//! and its debug listener on the node's loopback. Traffic and policies make
//! every named series exist (the node itself reads them on the debug
//! listener, with `/explain` naming the policy). From inside pod `a`'s
//! network namespace:
//! - the node's `/metrics` answers without a single pod or policy name;
//! - `/observe` and `/explain` are 404 there;
//! - the debug port is unreachable, on the node's address and on the pod's
//!   own loopback.
//!
//! And `/explain` beyond its bound of concurrent answers gets 429 with
//! `Retry-After: 1`, then answers again once a slot is free.
//!
//! Names carry the process id (netns `npmsv<pid>a|b`, veths
//! `ngv<pid>a|b`, pin dir `/sys/fs/bpf/npmsv<pid>`); leftovers of crashed
//! runs are removed first.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use crate::common::netns::*;
use crate::common::*;
use npm_agent::explain::{ExplainConfig, KernelView};
use npm_agent::node::{InterfacePattern, InterfaceResolver};
use npm_dataplane::ebpf::{EbpfDataplane, EbpfOptions};

const PREFIX: &str = "npmsv";
const SUBNET: &str = "10.246";

/// `GET path` over a blocking socket: the status and the body, or the
/// connection's error.
fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(3))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf)?;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((code, text))
}

/// `GET path` from inside the network namespace `ns`.
fn http_get_in(ns: &str, addr: SocketAddr, path: &'static str) -> std::io::Result<(u16, String)> {
    in_netns(ns, move || http_get(addr, path))
        .join()
        .expect("the probe thread")
}

/// Whether `text` names a pod, a namespace or a policy of the test.
fn names(text: &str) -> bool {
    ["allow-a", "deny-b", "pod=\"", "namespace=\"k\"", "policy=\""]
        .iter()
        .any(|n| text.contains(n))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pod_reads_no_names_flows_or_verdicts_from_the_node() {
    clear_stale_netns(PREFIX);
    clear_stale_links("ngv");
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    let topo = RoutedPods::new(PREFIX, "ngv", ["a", "b"], SUBNET);
    let server_addr: SocketAddr = format!("{SUBNET}.2.2:8080").parse().unwrap();
    serve(&topo.pods[1], server_addr, topo.stop.clone());

    let (srv, client) = two_pod_server(SUBNET).await;
    let dp = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: topo.pin_dir.clone(),
        bench_no_ct_create: false,
        attach: npm_dataplane::ebpf::AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane (run `cargo xtask build-ebpf` first)");
    let pattern = InterfacePattern::new(&format!("ngv{}*", std::process::id())).unwrap();
    let mut cfg = agent_config(100);
    // The node's address as pod `a` reaches it (its gateway).
    cfg.metrics_addr = Some(format!("{SUBNET}.1.1:0").parse().unwrap());
    cfg.debug_addr = Some("127.0.0.1:0".parse().unwrap());
    let agent = start_agent_with(cfg, client.clone(), dp, Box::new(InterfaceResolver::new(Some(pattern)))).await;
    agent.metrics.set_explain(ExplainConfig {
        node_name: "node-a".into(),
        kernel: KernelView::Ebpf {
            pin_dir: topo.pin_dir.clone(),
        },
    });
    let metrics = agent.http_addr.expect("metrics bound");
    let debug = agent.debug_addr.expect("debug bound");
    wait_until("ready", Duration::from_secs(20), || agent.is_ready()).await;

    // A denied flow, then an allowed one: every named family has samples.
    create_policy(&client, "k", deny_b()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr, false, "b is ingress-isolated").await;
    create_policy(&client, "k", allow_a()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr, true, "a allowed to b:8080").await;
    wait_until("named series exported", Duration::from_secs(20), || {
        let full = agent.metrics.render();
        full.contains("policy=\"allow-a\"") && full.contains("pod=\"b\"")
    })
    .await;
    // The node reads the names on its loopback.
    let (code, full) = http_get(debug, "/metrics").expect("debug /metrics");
    assert_eq!(code, 200, "{full}");
    assert!(names(&full), "the debug listener serves the names:\n{full}");
    let (code, why) = http_get(debug, "/explain?from=k/a&to=k/b&port=8080").expect("debug /explain");
    assert_eq!(code, 200, "{why}");
    assert!(why.contains("allow-a"), "explain names the allowing policy:\n{why}");

    // What pod `a` reads from the node.
    let pod = topo.pods[0].clone();
    let (code, public) = http_get_in(&pod, metrics, "/metrics").expect("the node's /metrics from the pod");
    assert_eq!(code, 200, "{public}");
    assert!(public.contains("npm_ready 1"), "{public}");
    assert!(!names(&public), "a pod reads names on the node's /metrics:\n{public}");
    for path in ["/observe", "/explain?from=k/a&to=k/b&port=8080"] {
        let (code, body) = http_get_in(&pod, metrics, path).expect("the node's metrics port from the pod");
        assert_eq!(code, 404, "{path} from a pod:\n{body}");
        assert!(!names(&body), "{body}");
    }
    let node_debug = SocketAddr::new(metrics.ip(), debug.port());
    for addr in [node_debug, debug] {
        let r = http_get_in(&pod, addr, "/observe");
        assert!(r.is_err(), "the debug listener at {addr} answers a pod: {r:?}");
    }

    // /explain beyond its bound: 429, then answers once a slot is free.
    let held: Vec<_> = (0..npm_agent::telemetry::server::MAX_EXPLAIN)
        .map(|_| agent.slots.explain.clone().try_acquire_owned().expect("a free slot"))
        .collect();
    let (code, busy) = http_get(debug, "/explain?from=k/a&to=k/b&port=8080").expect("debug /explain");
    assert_eq!(code, 429, "{busy}");
    assert!(busy.to_ascii_lowercase().contains("retry-after: 1"), "{busy}");
    drop(held);
    let (code, why) = http_get(debug, "/explain?from=k/a&to=k/b&port=8080").expect("debug /explain");
    assert_eq!(code, 200, "{why}");

    drop(agent);
    srv.shutdown().await;
}
