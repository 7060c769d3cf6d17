//! Degraded mode on a running agent: real test API server, real
//! compiler and sync loop, a real eBPF dataplane whose `NPM_POLICY` holds
//! 64 keys (pins `/sys/fs/bpf/npmhf<pid>`, two veths). A NetworkPolicy
//! that needs more keys than fit does not stop the node: the rest is
//! programmed, the endpoint whose allows did not fit is isolated with no
//! allow (never "not isolated"), `npm_map_full{map="NPM_POLICY"}` is 1 and
//! `/readyz?verbose` names the map and its sizes; after the policy shrinks
//! the whole state is in the kernel and the report clears. Also: the
//! chart's `mapSizes` values reach the agent binary's flags. Needs root
//! (bpffs, veths) and helm.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::common::netns::clear_stale_dirs;
use crate::common::*;
use k8s_openapi::api::core::v1::Event;
use kube::Api;
use npm_agent::agent::{start_with_health, RunningAgent};
use npm_agent::node::{Resolve, Resolved};
use npm_agent::telemetry::events::REASON_MAP_FULL;
use npm_agent::telemetry::{HealthConfig, Metrics};
use npm_common::{maps, EP_ISOLATED_INGRESS};
use npm_dataplane::ebpf::{dump_pinned, AttachMode, EbpfDataplane, EbpfOptions, MapSizes};
use npm_policy::compiled::Compiled;

const PREFIX: &str = "npmhf";

/// Pins and veths of one test, removed on drop.
struct Kernel {
    pins: PathBuf,
    veths: Vec<String>,
}

impl Drop for Kernel {
    fn drop(&mut self) {
        for v in &self.veths {
            let _ = Command::new("ip").args(["link", "del", v]).output();
        }
        let _ = std::fs::remove_dir_all(&self.pins);
    }
}

fn veth(name: &str) -> u32 {
    let _ = Command::new("ip").args(["link", "del", name]).output();
    let peer = format!("{name}p");
    let ok = Command::new("ip")
        .args(["link", "add", name, "type", "veth", "peer", "name", &peer])
        .status()
        .unwrap()
        .success();
    assert!(ok, "ip link add {name}");
    assert!(Command::new("ip")
        .args(["link", "set", name, "up"])
        .status()
        .unwrap()
        .success());
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .unwrap()
        .trim()
        .parse()
        .unwrap()
}

/// Endpoints by address -> the test's veths.
struct ByAddress(BTreeMap<IpAddr, u32>);

impl Resolve for ByAddress {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        let mut interfaces = BTreeMap::new();
        let mut missing = Vec::new();
        for (id, ep) in &compiled.endpoints {
            match ep.ipv4.and_then(|a| self.0.get(&IpAddr::V4(a))) {
                Some(i) => {
                    interfaces.insert(*id, *i);
                }
                None => missing.push(*id),
            }
        }
        Resolved { interfaces, missing }
    }
}
/// Policy `app/<name>`: pods `app=<target>` admit pods `role=client` on `ports`.
fn policy(name: &str, target: &str, ports: impl Iterator<Item = u16>) -> serde_json::Value {
    let ports: Vec<_> = ports.map(|p| serde_json::json!({"port": p})).collect();
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "app"},
        "spec": {"podSelector": {"matchLabels": {"app": target}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}], "ports": ports}]}
    })
}

/// (subject, flags) of the endpoint at `ifindex`, and the number of
/// `NPM_POLICY` keys of each subject (policy keys are keyed by the
/// endpoints' pod identity), read from the pinned maps.
fn kernel_state(pins: &Path, ifindex: u32) -> (Option<(u32, u32)>, BTreeMap<u32, usize>) {
    let dump = dump_pinned(pins).expect("dump pins");
    let ep = dump
        .endpoints
        .iter()
        .find(|e| e.ifindex == ifindex)
        .map(|e| (e.subject, e.flags));
    let mut keys = BTreeMap::new();
    for p in &dump.policy {
        *keys.entry(p.subject).or_insert(0) += 1;
    }
    (ep, keys)
}
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_policy_map_degrades_fail_closed_reports_and_recovers() {
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    npm_dataplane::ebpf::ensure_bpffs().unwrap();
    let pid = std::process::id();
    let k = Kernel {
        pins: PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{pid}")),
        veths: vec![format!("{PREFIX}{pid}a"), format!("{PREFIX}{pid}b")],
    };
    let _ = std::fs::remove_dir_all(&k.pins);
    let (if_a, if_b) = (veth(&k.veths[0]), veth(&k.veths[1]));

    let (_srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("app", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("app", "a", "node-a", Some("10.57.0.2"), &[("app", "a")]),
            pod("app", "b", "node-a", Some("10.57.0.3"), &[("app", "b")]),
            pod("app", "cl", "node-b", Some("10.57.1.9"), &[("role", "client")]),
        ],
        3,
    )
    .await;
    // a: 1 key; b: 70 keys (one per port); 71 > 64.
    create_policy(&client, "app", policy("pa", "a", [80].into_iter()))
        .await
        .unwrap();
    create_policy(&client, "app", policy("pb", "b", 1000..1070))
        .await
        .unwrap();

    let sizes = MapSizes {
        policy: 64,
        ..MapSizes::default()
    };
    let dp = EbpfDataplane::open_sized(
        EbpfOptions {
            object: None,
            pin_dir: k.pins.clone(),
            bench_no_ct_create: false,
            attach: AttachMode::Tcx,
        },
        sizes,
    )
    .unwrap_or_else(|e| panic!("open: {e}"));
    let mut cfg = agent_config(100);
    cfg.metrics_addr = Some("127.0.0.1:0".parse().unwrap());
    let resolver = ByAddress(
        [("10.57.0.2", if_a), ("10.57.0.3", if_b)]
            .into_iter()
            .map(|(a, i)| (a.parse().unwrap(), i))
            .collect(),
    );
    let agent: RunningAgent = start_with_health(
        cfg,
        HealthConfig::default(),
        client.clone(),
        dp,
        Box::new(resolver),
        Metrics::new().unwrap(),
    )
    .await
    .expect("start agent");
    let addr = agent.http_addr.unwrap();

    // Degraded: the first sync is applied, the map named with its sizes.
    let body = wait_readyz(
        addr,
        503,
        "[-]map-capacity failed: map NPM_POLICY is full: 71 entries needed, 64 fit",
        Duration::from_secs(30),
    )
    .await;
    assert!(body.contains("[+]first-sync ok"), "{body}");
    assert!(body.contains("1 written, 1 subject directions"), "{body}");
    let full = format!("npm_map_full{{map=\"{}\"}}", maps::POLICY);
    assert_eq!(metric(&agent, &full), 1.0);
    assert!(agent.metrics.render().contains("# HELP npm_map_full"));
    // In the kernel: a's allow is there; b is programmed, ingress-isolated,
    // without a single allow (deny, never "not isolated").
    let (ep_a, keys) = kernel_state(&k.pins, if_a);
    let (ep_b, _) = kernel_state(&k.pins, if_b);
    let (subject_a, _) = ep_a.expect("a programmed");
    let (subject_b, flags_b) = ep_b.expect("b programmed");
    assert_ne!(subject_a, subject_b, "a and b have identities of their own");
    assert_ne!(flags_b & EP_ISOLATED_INGRESS, 0, "b isolated");
    assert_eq!(keys, BTreeMap::from([(subject_a, 1)]), "only a's allow");
    // A Warning Event on the Node names the map and its sizes.
    wait_until_async("the map-full Event on the Node", Duration::from_secs(15), || async {
        !map_full_events(&client).await.is_empty()
    })
    .await;
    let events = map_full_events(&client).await;
    assert_eq!(events.len(), 1, "{events:#?}");
    let m = events[0].message.clone().unwrap_or_default();
    assert!(m.contains("map NPM_POLICY is full: 71 entries needed, 64 fit"), "{m}");
    assert_eq!(events[0].type_.as_deref(), Some("Warning"));

    // The policy shrinks to 30 ports: the whole state, and the report clears.
    delete_policy(&client, "app", "pb").await;
    create_policy(&client, "app", policy("pb2", "b", 1000..1030))
        .await
        .unwrap();
    wait_readyz(addr, 200, "[+]map-capacity ok", Duration::from_secs(30)).await;
    assert_eq!(get(addr, "/readyz").await, (200, "ready\n".to_string()));
    assert_eq!(metric(&agent, &full), 0.0);
    let (_, keys) = kernel_state(&k.pins, if_b);
    assert_eq!(keys, BTreeMap::from([(subject_a, 1), (subject_b, 30)]));
    // One entry into degraded mode, one Event (not one per sync).
    assert_eq!(map_full_events(&client).await.len(), 1);
    drop(agent);
}

/// The `NpmMapFull` Events on Node `node-a` (namespace `default`).
async fn map_full_events(client: &kube::Client) -> Vec<Event> {
    let api: Api<Event> = Api::namespaced(client.clone(), "default");
    api.list(&Default::default())
        .await
        .expect("list events")
        .items
        .into_iter()
        .filter(|e| {
            e.reason.as_deref() == Some(REASON_MAP_FULL)
                && e.involved_object.kind.as_deref() == Some("Node")
                && e.involved_object.name.as_deref() == Some("node-a")
        })
        .collect()
}

/// `helm template` of the chart with `set`: the agent container's args.
fn chart_agent_args(set: &[&str]) -> Vec<String> {
    let chart = Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/npm-agent");
    let helm = std::env::var_os("HELM")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("helm"));
    let mut cmd = Command::new(helm);
    cmd.args(["template", "rel", chart.to_str().unwrap()]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().expect("run helm (installed by `cargo xtask setup`)");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    // The DaemonSet's agent container: from `- run` to `env:`.
    let (_, rest) = text.split_once("            - run\n").expect("agent args");
    let (args, _) = rest.split_once("          env:").unwrap();
    std::iter::once("run".to_string())
        .chain(
            args.lines()
                .filter_map(|l| l.trim().strip_prefix("- ").map(String::from)),
        )
        .collect()
}

#[test]
fn chart_map_sizes_reach_the_agent_flags() {
    let bin = env!("CARGO_BIN_EXE_npm-agent");
    let args = chart_agent_args(&[
        "mapSizes.policy=64",
        "mapSizes.conntrack=100000",
        // Layout 7 has no fronts: a leftover value renders no flag.
        "mapSizes.policyFront=1024",
    ]);
    assert!(args.contains(&"--map-size-policy=64".to_string()), "{args:?}");
    assert!(!args.iter().any(|a| a.contains("front")), "{args:?}");
    let out = Command::new(bin)
        .args(&args)
        .arg("--dry-run")
        .env("NODE_NAME", "n1")
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cfg: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(cfg["map_sizes"]["policy"], 64);
    assert_eq!(cfg["map_sizes"]["conntrack"], 100000);
    assert_eq!(cfg["map_sizes"]["ipcache"], npm_common::sizes::IPCACHE);
    // By default no size flag: the agent's defaults, today's sizes.
    let args = chart_agent_args(&[]);
    assert!(!args.iter().any(|a| a.starts_with("--map-size")), "{args:?}");
    let out = Command::new(bin)
        .args(&args)
        .arg("--dry-run")
        .env("NODE_NAME", "n1")
        .output()
        .unwrap();
    let cfg: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(cfg["map_sizes"]["policy"], npm_common::sizes::POLICY);
    assert_eq!(cfg["map_sizes"]["conntrack"], npm_common::sizes::CT);
    // Below the minimum: the agent refuses, naming the flag.
    let args = chart_agent_args(&["mapSizes.policy=10"]);
    let out = Command::new(bin)
        .args(&args)
        .arg("--dry-run")
        .env("NODE_NAME", "n1")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--map-size-policy") && err.contains("64"), "{err}");
}
