//! Issue 43: the pod conditions `npm.io/PolicyEnforced` and
//! `npm.io/PolicyDegraded`, written by a running agent (real test API
//! server, real compiler, sync loop and writer) on both dataplanes:
//! - eBPF (pins `/sys/fs/bpf/npmpc<pid>`, veths `npmpc<pid>*` in the root
//!   namespace, `NPM_POLICY` sized 64 keys);
//! - nftables (table `npmpc<pid>` in netns `npmpc<pid>n`, veths there).
//!
//! A pod's condition turns `True` only once its endpoint is in the kernel
//! (the pinned endpoint record, the table's `dispatch_in` element, read
//! when `True` is seen); it is `False` (reason `NoInterface`) while its
//! interface is not found and nothing is programmed for it; while a
//! removal is held (the confirming direct read fails), a new pod is
//! `False` (`RemovalHeld`) and an enforced pod stays `True` with
//! `npm.io/PolicyDegraded=True`; both come back once the hold is confirmed.
//! eBPF also: a full `NPM_POLICY` (`MapFull`), the same way. And the write
//! rate: under pod churn, the patches of `pods/status` counted at the test
//! API server never exceed the token bucket's bound. Needs root (bpffs,
//! veths, netns, nft).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::cni_plugins::ifindex;
use crate::common::netns::{clear_stale_dirs, clear_stale_links, clear_stale_netns};
use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use npm_agent::agent::AgentConfig;
use npm_agent::k8s::pod_conditions::{PodConditionsConfig, DEGRADED, ENFORCED};
use npm_agent::node::{Resolve, Resolved};
use npm_agent::reconcile::AgentDataplane;
use npm_dataplane::ebpf::{dump_pinned, AttachMode, EbpfDataplane, EbpfOptions, MapSizes};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_policy::compiled::Compiled;
use npm_testapi::FaultRule;

const PREFIX: &str = "npmpc";

/// Endpoints by address -> ifindex, changed by the test while the agent
/// runs (an interface "appears" when its address is added).
#[derive(Clone, Default)]
struct Shared(Arc<Mutex<BTreeMap<IpAddr, u32>>>);

impl Shared {
    fn add(&self, ip: &str, ifindex: u32) {
        self.0.lock().unwrap().insert(ip.parse().unwrap(), ifindex);
    }
}

impl Resolve for Shared {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        let map = self.0.lock().unwrap();
        let mut interfaces = BTreeMap::new();
        let mut missing = Vec::new();
        for (id, ep) in &compiled.endpoints {
            match ep.ipv4.and_then(|a| map.get(&IpAddr::V4(a))) {
                Some(i) => {
                    interfaces.insert(*id, *i);
                }
                None => missing.push(*id),
            }
        }
        Resolved { interfaces, missing }
    }
}

/// Where the test looks for a pod's endpoint, and what it removes on drop.
enum Kernel {
    Ebpf { pins: PathBuf, veths: Vec<String> },
    Nft { netns: String, table: String },
}

impl Drop for Kernel {
    fn drop(&mut self) {
        match self {
            Kernel::Ebpf { pins, veths } => {
                for v in veths.iter() {
                    let _ = Command::new("ip").args(["link", "del", v]).output();
                }
                let _ = std::fs::remove_dir_all(pins);
            }
            Kernel::Nft { netns, .. } => {
                let _ = Command::new("ip").args(["netns", "delete", netns]).output();
            }
        }
    }
}

impl Kernel {
    fn netns(&self) -> Option<&str> {
        match self {
            Kernel::Ebpf { .. } => None,
            Kernel::Nft { netns, .. } => Some(netns),
        }
    }

    /// A veth `name` (host side) where the dataplane looks; its ifindex.
    fn veth(&mut self, name: &str) -> u32 {
        let mut ip = vec!["ip"];
        if let Some(ns) = self.netns() {
            ip.extend(["-n", ns]);
        }
        let peer = format!("{name}p");
        let run = |args: &[&str]| {
            let mut all = ip.clone();
            all.extend_from_slice(args);
            let out = Command::new(all[0]).args(&all[1..]).output().unwrap();
            assert!(
                out.status.success(),
                "{all:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        run(&["link", "add", name, "type", "veth", "peer", "name", &peer]);
        run(&["link", "set", name, "up"]);
        if let Kernel::Ebpf { veths, .. } = self {
            veths.push(name.to_string());
        }
        ifindex(self.netns(), name)
    }

    /// Whether the endpoint of interface `name` (`ifindex`) is in the
    /// kernel: its endpoint record (eBPF) or its `dispatch_in` element
    /// (nftables).
    fn has_endpoint(&self, name: &str, ifindex: u32) -> bool {
        match self {
            Kernel::Ebpf { pins, .. } => dump_pinned(pins)
                .expect("dump pins")
                .endpoints
                .iter()
                .any(|e| e.ifindex == ifindex),
            Kernel::Nft { netns, table } => {
                let out = Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        netns,
                        "nft",
                        "list",
                        "map",
                        "inet",
                        table,
                        "dispatch_in",
                    ])
                    .output()
                    .unwrap();
                let text = String::from_utf8_lossy(&out.stdout);
                text.split(['{', ',', '}'])
                    .map(str::trim)
                    .any(|e| e.starts_with(&format!("\"{name}\" :")) || e.starts_with(&format!("{ifindex} :")))
            }
        }
    }
}

/// The (status, reason) of condition `t` of pod `ns/name`.
async fn condition(client: &kube::Client, ns: &str, name: &str, t: &str) -> Option<(String, String)> {
    let pod = Api::<Pod>::namespaced(client.clone(), ns).get_status(name).await.ok()?;
    pod.status?
        .conditions?
        .into_iter()
        .find(|c| c.type_ == t)
        .map(|c| (c.status, c.reason.unwrap_or_default()))
}

async fn wait_condition(client: &kube::Client, name: &str, t: &str, status: &str, reason: &str) {
    let want = Some((status.to_string(), reason.to_string()));
    let mut last = None;
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        last = condition(client, "pc", name, t).await;
        if last == want {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("pod pc/{name}: timed out waiting for {t}={status} ({reason}); last: {last:?}");
}

fn config() -> AgentConfig {
    let mut cfg = agent_config(100);
    cfg.pod_conditions = Some(PodConditionsConfig { qps: 50.0, burst: 10 });
    cfg
}

/// Policy `pc/<name>`: pods `app=<target>` admit `role=client` on `ports`.
fn policy(name: &str, target: &str, ports: impl Iterator<Item = u16>) -> serde_json::Value {
    let ports: Vec<_> = ports.map(|p| serde_json::json!({"port": p})).collect();
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "pc"},
        "spec": {"podSelector": {"matchLabels": {"app": target}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}], "ports": ports}]}
    })
}

/// The scenario on one dataplane: `net` is the second octet of its
/// addresses; `map_full` runs the full-map step (eBPF: `NPM_POLICY` holds
/// 64 keys).
async fn scenario<D: AgentDataplane + 'static>(mut k: Kernel, dp: D, net: u8, map_full: bool) {
    let ip = |host: u8| format!("10.{net}.0.{host}");
    let pid = std::process::id();
    let names: Vec<String> = ["a", "b", "c", "e"]
        .iter()
        .map(|t| format!("{PREFIX}{pid}{t}"))
        .collect();
    let (if_a, if_b, if_c, if_e) = (
        k.veth(&names[0]),
        k.veth(&names[1]),
        k.veth(&names[2]),
        k.veth(&names[3]),
    );
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("pc", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("pc", "a", "node-a", Some(&ip(2)), &[("app", "a")]),
            pod("pc", "b", "node-a", Some(&ip(3)), &[("app", "b")]),
            pod(
                "pc",
                "cl",
                "node-b",
                Some(&format!("10.{net}.1.9")),
                &[("role", "client")],
            ),
            pod(
                "pc",
                "cl2",
                "node-b",
                Some(&format!("10.{net}.1.10")),
                &[("role", "client2")],
            ),
            // Host-network pods are not subjects: no condition.
            {
                let mut p = pod("pc", "hn", "node-a", Some("192.0.2.77"), &[("app", "a")]);
                p.spec.as_mut().unwrap().host_network = Some(true);
                p
            },
        ],
        3,
    )
    .await;
    create_policy(&client, "pc", policy("pa", "a", [80].into_iter()))
        .await
        .unwrap();
    let resolver = Shared::default();
    resolver.add(&ip(2), if_a);
    let agent = start_agent_with(config(), client.clone(), dp, Box::new(resolver.clone())).await;

    // a: True only with its endpoint in the kernel; b: no interface yet.
    wait_condition(&client, "a", ENFORCED, "True", "Enforced").await;
    assert!(k.has_endpoint(&names[0], if_a), "a True: its endpoint is in the kernel");
    wait_condition(&client, "b", ENFORCED, "False", "NoInterface").await;
    assert!(!k.has_endpoint(&names[1], if_b), "b False: nothing programmed for it");
    let t = Api::<Pod>::namespaced(client.clone(), "pc")
        .get_status("a")
        .await
        .unwrap();
    let c = t.status.unwrap().conditions.unwrap();
    let a_enforced = c.iter().find(|c| c.type_ == ENFORCED).unwrap();
    assert!(a_enforced.last_transition_time.is_some(), "{a_enforced:?}");
    assert_eq!(condition(&client, "pc", "hn", ENFORCED).await, None, "host-network pod");
    // b's interface appears: True, with its endpoint in the kernel.
    resolver.add(&ip(3), if_b);
    wait_condition(&client, "b", ENFORCED, "True", "Enforced").await;
    assert!(k.has_endpoint(&names[1], if_b), "b True: its endpoint is in the kernel");

    // A held removal: b and both clients go (3 of 4 pod identities) while
    // every LIST of pods fails, so the direct read cannot confirm it.
    srv.inject(FaultRule::fail(100_000, 500).path("/api/v1/pods").verb("list"));
    delete_pods(
        &client,
        vec![
            ("pc".into(), "b".into()),
            ("pc".into(), "cl".into()),
            ("pc".into(), "cl2".into()),
        ],
        3,
    )
    .await;
    wait_condition(&client, "a", DEGRADED, "True", "RemovalHeld").await;
    assert_eq!(
        condition(&client, "pc", "a", ENFORCED).await,
        Some(("True".into(), "Enforced".into())),
        "an enforced pod is never turned False again (its Services keep it)"
    );
    // A new pod during the hold: not True.
    resolver.add(&ip(4), if_c);
    create_pods(
        &client,
        vec![pod("pc", "c", "node-a", Some(&ip(4)), &[("app", "c")])],
        1,
    )
    .await;
    wait_condition(&client, "c", ENFORCED, "False", "RemovalHeld").await;
    // The hold is confirmed: c True with its endpoint in the kernel, a's
    // degraded report clears.
    srv.clear_faults();
    wait_condition(&client, "c", ENFORCED, "True", "Enforced").await;
    assert!(k.has_endpoint(&names[2], if_c), "c True: its endpoint is in the kernel");
    wait_condition(&client, "a", DEGRADED, "False", "Enforced").await;

    if map_full {
        // 70 keys for app=c: NPM_POLICY (64) is full.
        create_pods(
            &client,
            vec![pod(
                "pc",
                "cl",
                "node-b",
                Some(&format!("10.{net}.1.9")),
                &[("role", "client")],
            )],
            1,
        )
        .await;
        create_policy(&client, "pc", policy("pc", "c", 1000..1070))
            .await
            .unwrap();
        wait_condition(&client, "c", DEGRADED, "True", "MapFull").await;
        assert_eq!(
            condition(&client, "pc", "c", ENFORCED).await,
            Some(("True".into(), "Enforced".into()))
        );
        // A new pod while the map is full: False.
        resolver.add(&ip(5), if_e);
        create_pods(
            &client,
            vec![pod("pc", "e", "node-a", Some(&ip(5)), &[("app", "e")])],
            1,
        )
        .await;
        wait_condition(&client, "e", ENFORCED, "False", "MapFull").await;
        delete_policy(&client, "pc", "pc").await;
        wait_condition(&client, "e", ENFORCED, "True", "Enforced").await;
        assert!(k.has_endpoint(&names[3], if_e), "e True: its endpoint is in the kernel");
        wait_condition(&client, "c", DEGRADED, "False", "Enforced").await;
    }
    let writes = srv.stats().writes.get("pods/status").copied().unwrap_or(0);
    assert!(writes > 0 && metric(&agent, "npm_pod_condition_writes_total{result=\"ok\"}") > 0.0);
    drop(agent);
    srv.shutdown().await;
    drop(k);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_conditions_follow_the_kernel_ebpf() {
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    clear_stale_links(PREFIX);
    npm_dataplane::ebpf::ensure_bpffs().unwrap();
    let pins = PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&pins);
    let k = Kernel::Ebpf {
        pins: pins.clone(),
        veths: Vec::new(),
    };
    let dp = EbpfDataplane::open_sized(
        EbpfOptions {
            object: None,
            pin_dir: pins,
            bench_no_ct_create: false,
            attach: AttachMode::Tcx,
        },
        MapSizes {
            policy: 64,
            ..MapSizes::default()
        },
    )
    .unwrap_or_else(|e| panic!("open: {e}"));
    scenario(k, dp, 71, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_conditions_follow_the_kernel_nftables() {
    clear_stale_netns(PREFIX);
    let pid = std::process::id();
    let netns = format!("{PREFIX}{pid}n");
    let _ = Command::new("ip").args(["netns", "delete", &netns]).output();
    assert!(Command::new("ip")
        .args(["netns", "add", &netns])
        .status()
        .unwrap()
        .success());
    let table = format!("{PREFIX}{pid}");
    let dp = NftDataplane::new(NftOptions {
        table: table.clone(),
        netns: Some(netns.clone()),
    })
    .expect("nft dataplane");
    scenario(Kernel::Nft { netns, table }, dp, 72, false).await;
}

/// Under churn (60 local pods created, then 30 deleted and 30 more
/// created), the patches of `pods/status` counted at the test API server
/// stay within the token bucket's bound at every moment (`burst` + `qps` x
/// the seconds since the agent started), each pod is written, and nothing
/// is written without a transition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pod_condition_writes_stay_within_the_rate_limit() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("pc", &[])]).await;
    let (qps, burst) = (10.0, 5u32);
    let mut cfg = agent_config(100);
    cfg.pod_conditions = Some(PodConditionsConfig { qps, burst });
    let started = Instant::now();
    // No interface for any pod: each new pod is one transition (None ->
    // False NoInterface).
    let agent = start_agent_with(
        cfg,
        client.clone(),
        RecordingDataplane::default(),
        Box::new(Shared::default()),
    )
    .await;
    let writes = || srv.stats().writes.get("pods/status").copied().unwrap_or(0);
    let bound = |t: Duration| f64::from(burst) + qps * t.as_secs_f64() + 1.0;
    let mk = |range: std::ops::Range<u32>| {
        range
            .map(|i| {
                pod(
                    "pc",
                    &format!("p{i}"),
                    "node-a",
                    Some(&format!("10.73.{}.{}", i / 200, i % 200 + 2)),
                    &[("app", "x")],
                )
            })
            .collect::<Vec<_>>()
    };
    create_pods(&client, mk(0..60), 8).await;
    let mut max_ratio: f64 = 0.0;
    let mut churned: Option<Instant> = None;
    let check = |max_ratio: &mut f64| {
        let (w, t) = (writes(), started.elapsed());
        assert!(
            (w as f64) <= bound(t),
            "{w} patches after {t:?}: more than burst {burst} + {qps}/s allow"
        );
        *max_ratio = max_ratio.max(w as f64 / bound(t));
        (w, t)
    };
    loop {
        let (w, t) = check(&mut max_ratio);
        match churned {
            None if w >= 30 => {
                delete_pods(&client, (0..30).map(|i| ("pc".into(), format!("p{i}"))).collect(), 8).await;
                create_pods(&client, mk(60..90), 8).await;
                churned = Some(Instant::now());
            }
            Some(at) if at.elapsed() > Duration::from_secs(1) && metric(&agent, "npm_pod_condition_pending") == 0.0 => {
                break;
            }
            _ => {}
        }
        assert!(
            t < Duration::from_secs(60),
            "churn not written after {t:?}: {w} patches"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Every pod left is written; the limit was what paced the writes.
    for i in 30..90 {
        assert_eq!(
            condition(&client, "pc", &format!("p{i}"), ENFORCED).await,
            Some(("False".into(), "NoInterface".into())),
            "p{i}"
        );
        check(&mut max_ratio);
    }
    assert!(max_ratio > 0.4, "the writes were paced by the limit: {max_ratio}");
    // No transition, no write: an unrelated policy change.
    let before = writes();
    create_policy(&client, "pc", policy("other", "nobody", [80].into_iter()))
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(writes(), before, "no write without a transition");
    drop(agent);
    srv.shutdown().await;
}

/// A NetworkPolicy that is not fully understood (an ipBlock `/33`; the test
/// API server's validation off, as an API server of another version might
/// accept it) is reported on the pods it selects only: an enforced one gets
/// `npm.io/PolicyDegraded=True` (`PolicyInvalid`), a new one
/// `PolicyEnforced=False` (`PolicyInvalid`); both clear once it is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_policy_is_reported_on_the_pods_it_selects() {
    let (srv, client) = server(false).await;
    create_namespaces(&client, &[namespace("pc", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("pc", "x", "node-a", Some("10.74.0.2"), &[("app", "b")]),
            pod("pc", "y", "node-a", Some("10.74.0.3"), &[("app", "c")]),
        ],
        2,
    )
    .await;
    let agent = start_agent(config(), client.clone(), RecordingDataplane::default()).await;
    wait_condition(&client, "x", ENFORCED, "True", "Enforced").await;
    wait_condition(&client, "y", ENFORCED, "True", "Enforced").await;
    let half_bad = serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": "half-bad", "namespace": "pc"},
        "spec": {"podSelector": {"matchLabels": {"app": "b"}},
                 "ingress": [{"from": [{"ipBlock": {"cidr": "10.74.3.0/33"}}]}]}
    });
    create_policy(&client, "pc", half_bad).await.unwrap();
    wait_condition(&client, "x", DEGRADED, "True", "PolicyInvalid").await;
    create_pods(
        &client,
        vec![pod("pc", "z", "node-a", Some("10.74.0.4"), &[("app", "b")])],
        1,
    )
    .await;
    wait_condition(&client, "z", ENFORCED, "False", "PolicyInvalid").await;
    assert_eq!(condition(&client, "pc", "y", DEGRADED).await, None, "y is not selected");
    delete_policy(&client, "pc", "half-bad").await;
    wait_condition(&client, "z", ENFORCED, "True", "Enforced").await;
    wait_condition(&client, "x", DEGRADED, "False", "Enforced").await;
    assert_eq!(condition(&client, "pc", "y", DEGRADED).await, None);
    drop(agent);
    srv.shutdown().await;
}

/// Patches that fail (here a 403, as a missing grant or the admission
/// policy would answer) are retried with a growing wait, not at the rate
/// limit; once they pass, every pod is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failing_patches_back_off() {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("pc", &[])]).await;
    let pods = (0..10)
        .map(|i| {
            pod(
                "pc",
                &format!("f{i}"),
                "node-a",
                Some(&format!("10.75.0.{}", i + 2)),
                &[("app", "f")],
            )
        })
        .collect();
    create_pods(&client, pods, 4).await;
    srv.inject(
        FaultRule::fail(100_000, 403)
            .path("/api/v1/namespaces/pc/pods/")
            .verb("patch"),
    );
    let agent = start_agent(config(), client.clone(), RecordingDataplane::default()).await;
    let writes = || srv.stats().writes.get("pods/status").copied().unwrap_or(0);
    wait_until("a first refused patch", Duration::from_secs(20), || writes() > 0).await;
    tokio::time::sleep(Duration::from_secs(3)).await;
    // 0.5 + 1 + 2 s of waits: at most 4 attempts in these 3 s (the limit
    // alone, 10 + 50/s, would allow 160).
    let refused = writes();
    assert!(refused <= 5, "{refused} refused patches in 3 s");
    assert!(metric(&agent, "npm_pod_condition_writes_total{result=\"error\"}") >= 1.0);
    srv.clear_faults();
    for i in 0..10 {
        wait_condition(&client, &format!("f{i}"), ENFORCED, "True", "Enforced").await;
    }
    drop(agent);
    srv.shutdown().await;
}
