//! Pod start with npm-cni, on real components: the test API
//! server, the agent with its CNI socket and a real dataplane (eBPF on the
//! pods' host-side veths, or an nftables table of the root namespace), and
//! pods wired by the real `ptp` plugin chained with the real `npm-cni`
//! binary as a runtime runs a conflist.
//!
//! Namespace `cni` has a deny-all ingress policy and a policy that lets
//! only pods `app=a` into pods `app=new`. The new pods' objects exist first
//! (scheduled to this node, no IP); then ADD, 1 or 20 at once. Right after
//! a pod's ADD returns a server listens in it, and a denied pod `c` and the
//! allowed pod `a` probe it in tight loops; the pod's IP is published in its
//! status only 500 ms after ADD returned. `c` must never connect, `a` at
//! once. With the agent stopped, ADD fails within `timeoutSeconds` (or
//! succeeds with `failOpen`).
//!
//! The same runs with the `bridge` plugin on eBPF. The ADD wait (npm-cni's
//! run) is printed as p50/p99. Names carry the process id
//! (`npmcnia<pid>...`); leftovers of crashed runs are removed.

use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::cni_chain::*;
use crate::common::netns::*;
use crate::common::*;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, Patch, PatchParams, PostParams};
use npm_agent::agent::RunningAgent;
use npm_agent::cni::CniConfig;
use npm_agent::dataplanes::{self, DataplaneKind, DataplaneOptions};
use npm_agent::node::{InterfacePattern, InterfaceResolver};
use serde_json::json;

/// The kernel tests of this file run one at a time (they share the CPU
/// budget that their timing depends on).
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

const NS: &str = "cni";
const PORT: u16 = 8080;
/// How long the probes run after a pod's ADD returned.
const PROBE_WINDOW: Duration = Duration::from_millis(1500);
/// When the pod's IP is published, after its ADD returned.
const PUBLISH_AFTER: Duration = Duration::from_millis(500);

/// The policies of the scenario.
async fn policies(client: &kube::Client) {
    create_policy(
        client,
        NS,
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "deny-all", "namespace": NS},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]}
        }),
    )
    .await
    .unwrap();
    create_policy(
        client,
        NS,
        json!({
            "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "allow-a", "namespace": NS},
            "spec": {"podSelector": {"matchLabels": {"app": "new"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}],
                                  "ports": [{"port": PORT}]}]}
        }),
    )
    .await
    .unwrap();
}

/// Create the Pod object `cni/<name>` (this node, Pending, no IP) and
/// return its uid.
pub async fn create_pending_pod(client: &kube::Client, name: &str, app: &str) -> String {
    let mut p = pod(NS, name, "node-a", None, &[("app", app)]);
    p.status.as_mut().unwrap().phase = Some("Pending".into());
    let created = Api::<Pod>::namespaced(client.clone(), NS)
        .create(&PostParams::default(), &p)
        .await
        .unwrap_or_else(|e| panic!("create pod {name}: {e}"));
    created.metadata.uid.expect("the API server gives a uid")
}

/// What the kubelet does once the sandbox is up: Running with its IP.
async fn publish_ip(client: &kube::Client, name: &str, ip: std::net::IpAddr) {
    let status = json!({"status": {"phase": "Running", "podIP": ip.to_string(), "podIPs": [{"ip": ip.to_string()}]}});
    Api::<Pod>::namespaced(client.clone(), NS)
        .patch_status(name, &PatchParams::default(), &Patch::Merge(&status))
        .await
        .unwrap_or_else(|e| panic!("publish the IP of {name}: {e}"));
}

/// A pod wired and published (peers `a` and `c`).
async fn running_pod(client: &kube::Client, net: &Arc<Network>, name: &str, app: &str) -> Sandbox {
    let uid = create_pending_pod(client, name, app).await;
    let mut sb = Sandbox::new(net, NS, name, &uid);
    let chain = tokio::task::block_in_place(|| sb.add());
    assert!(chain.ok(), "ADD of {name}: {:?}", chain.runs);
    publish_ip(client, name, sb.ip()).await;
    sb
}

/// Connections from netns `src` to `dst` in a tight loop (20 ms connect
/// timeout) until `until`: successes and the time of the first, from `t0`.
fn probe_loop(src: &str, dst: SocketAddr, t0: Instant, until: Instant) -> (u32, u32, Option<Duration>) {
    in_netns(src, move || {
        use std::io::Read;
        let (mut ok, mut tries, mut first) = (0, 0, None);
        while Instant::now() < until {
            tries += 1;
            let Ok(mut s) = TcpStream::connect_timeout(&dst, Duration::from_millis(20)) else {
                continue;
            };
            let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
            let mut buf = [0u8; 2];
            if s.read_exact(&mut buf).is_ok() && &buf == b"ok" {
                ok += 1;
                first.get_or_insert(t0.elapsed());
            }
        }
        (ok, tries, first)
    })
    .join()
    .unwrap()
}

/// What one new pod saw.
#[derive(Debug)]
struct Outcome {
    name: String,
    add_wait: Duration,
    denied_connects: u32,
    denied_tries: u32,
    allowed_connects: u32,
    allowed_first: Option<Duration>,
}

struct Cluster {
    srv: npm_testapi::TestApiServer,
    client: kube::Client,
    agent: Option<RunningAgent>,
    net: Arc<Network>,
    a: Sandbox,
    c: Sandbox,
    kind: DataplaneKind,
    pin_dir: PathBuf,
    table: String,
    _forwarding: Forwarding,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.agent.take();
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        if self.kind == DataplaneKind::Nftables {
            for family in ["inet", "bridge"] {
                let _ = std::process::Command::new("nft")
                    .args(["delete", "table", family, &self.table])
                    .output();
            }
        }
    }
}

async fn cluster(kind: DataplaneKind, wiring: Wiring, tag: &str, subnet: &str) -> Cluster {
    clear_leftovers();
    let forwarding = Forwarding::on();
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace(NS, &[])]).await;
    policies(&client).await;
    let pid = std::process::id();
    let net = Arc::new(Network::new(tag, wiring, subnet));
    let socket = net.socket.clone();
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{pid}{tag}"));
    let table = format!("{PREFIX}{pid}{tag}");
    let dp = dataplanes::open(
        kind,
        &DataplaneOptions {
            bpf_object: std::env::var_os("NPM_EBPF_OBJECT").map(PathBuf::from),
            pin_dir: Some(pin_dir.clone()),
            nft_table: table.clone(),
            ..DataplaneOptions::default()
        },
    )
    .expect("open the dataplane (eBPF needs NPM_EBPF_OBJECT)");
    let mut cfg = agent_config(100);
    cfg.cni = Some(CniConfig::new(socket));
    // Route lookup finds nothing: every interface comes from npm-cni.
    let resolver = InterfaceResolver::new(Some(InterfacePattern::new("npmcninone*").unwrap()));
    let agent = start_agent_with(cfg, client.clone(), dp, Box::new(resolver)).await;
    wait_until("agent ready", Duration::from_secs(20), || agent.is_ready()).await;
    let a = running_pod(&client, &net, "a", "a").await;
    let c = running_pod(&client, &net, "c", "c").await;
    Cluster {
        srv,
        client,
        agent: Some(agent),
        net,
        a,
        c,
        kind,
        pin_dir,
        table,
        _forwarding: forwarding,
    }
}

/// `n` new pods started at once; returns what each saw.
async fn start_new_pods(cl: &Cluster, n: usize, prefix: &str) -> Vec<Outcome> {
    let mut sandboxes = Vec::new();
    for i in 0..n {
        let name = format!("{prefix}{i}");
        let uid = create_pending_pod(&cl.client, &name, "new").await;
        sandboxes.push(Sandbox::new(&cl.net, NS, &name, &uid));
    }
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<(String, std::net::IpAddr, Instant)>();
    let (a_ns, c_ns) = (cl.a.netns.clone(), cl.c.netns.clone());
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let runs: Vec<_> = sandboxes
        .into_iter()
        .map(|mut sb| {
            let (tx, a_ns, c_ns, stop) = (tx.clone(), a_ns.clone(), c_ns.clone(), stop.clone());
            std::thread::spawn(move || {
                let chain = sb.add();
                let returned = Instant::now();
                assert!(chain.ok(), "ADD of {}: {:?}", sb.name, chain.runs);
                let dst = SocketAddr::new(sb.ip(), PORT);
                tx.send((sb.name.clone(), sb.ip(), returned)).unwrap();
                // The container starts: a server listens at once.
                serve(&sb.netns, dst, stop);
                let until = returned + PROBE_WINDOW;
                let c = std::thread::spawn(move || probe_loop(&c_ns, dst, returned, until));
                let a = probe_loop(&a_ns, dst, returned, until);
                let c = c.join().unwrap();
                let outcome = Outcome {
                    name: sb.name.clone(),
                    add_wait: chain.last().elapsed,
                    denied_connects: c.0,
                    denied_tries: c.1,
                    allowed_connects: a.0,
                    allowed_first: a.2,
                };
                (outcome, sb)
            })
        })
        .collect();
    drop(tx);
    // The kubelet publishes each pod's IP 500 ms after its ADD returned.
    let client = cl.client.clone();
    let publisher = tokio::spawn(async move {
        let mut pending = Vec::new();
        while let Some((name, ip, returned)) = rx.recv().await {
            let client = client.clone();
            pending.push(tokio::spawn(async move {
                tokio::time::sleep_until((returned + PUBLISH_AFTER).into()).await;
                publish_ip(&client, &name, ip).await;
            }));
        }
        for p in pending {
            p.await.unwrap();
        }
    });
    let mut outcomes = Vec::new();
    let mut keep = Vec::new();
    for r in runs {
        let (o, sb) = tokio::task::spawn_blocking(move || r.join().unwrap()).await.unwrap();
        outcomes.push(o);
        keep.push(sb);
    }
    publisher.await.unwrap();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    drop(keep);
    outcomes
}

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let i = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[i]
}

fn check(outcomes: &[Outcome], what: &str) {
    let mut waits: Vec<Duration> = outcomes.iter().map(|o| o.add_wait).collect();
    waits.sort();
    eprintln!(
        "{what}: ADD wait (npm-cni) p50 {:?} p99 {:?} max {:?} over {} pods",
        percentile(&waits, 0.5),
        percentile(&waits, 0.99),
        waits.last().unwrap(),
        waits.len()
    );
    for o in outcomes {
        eprintln!(
            "{what}: {}: denied c connected {} of {} tries; allowed a connected {} times, first after {:?}",
            o.name, o.denied_connects, o.denied_tries, o.allowed_connects, o.allowed_first
        );
    }
    for o in outcomes {
        assert_eq!(o.denied_connects, 0, "{what}: the denied pod reached {}: {o:?}", o.name);
        assert!(o.denied_tries >= 10, "{what}: too few denied probes: {o:?}");
        let first = o
            .allowed_first
            .unwrap_or_else(|| panic!("{what}: a never reached {}: {o:?}", o.name));
        assert!(
            first < Duration::from_millis(300),
            "{what}: a reached {} only after {first:?}",
            o.name
        );
    }
}

/// With the agent stopped, ADD fails within `timeoutSeconds` with "try
/// again later" (11), or succeeds with `failOpen`.
async fn agent_stopped(mut cl: Cluster) {
    cl.agent.take();
    let uid = create_pending_pod(&cl.client, "late", "new").await;
    let socket = cl.net.socket.clone();
    let net = Network::new("down", Wiring::Ptp, "10.239.0.0/24")
        .npm_cni_options(json!({"agentSocket": socket, "timeoutSeconds": 2}));
    let net = Arc::new(net);
    let mut sb = Sandbox::new(&net, NS, "late", &uid);
    let chain = tokio::task::block_in_place(|| sb.add());
    assert!(!chain.ok(), "ADD succeeded without an agent");
    let run = chain.last();
    assert_eq!(run.json()["code"], 11, "{run:?}");
    eprintln!("agent stopped: ADD failed after {:?} (timeoutSeconds 2)", run.elapsed);
    assert!(
        run.elapsed >= Duration::from_millis(1800) && run.elapsed < Duration::from_secs(3),
        "{run:?}"
    );
    drop(sb);
    let open = Network::new("open", Wiring::Ptp, "10.239.1.0/24")
        .npm_cni_options(json!({"agentSocket": socket, "timeoutSeconds": 1, "failOpen": true}));
    let open = Arc::new(open);
    let mut sb = Sandbox::new(&open, NS, "late", &uid);
    let chain = tokio::task::block_in_place(|| sb.add());
    assert!(chain.ok(), "failOpen ADD failed: {:?}", chain.runs);
    assert!(chain.last().stderr.contains("failOpen"), "{:?}", chain.last());
    drop(sb);
    let srv = std::mem::replace(&mut cl.srv, server(true).await.0);
    drop(cl);
    srv.shutdown().await;
}

async fn scenario(kind: DataplaneKind, wiring: Wiring, tag: &str, subnet: &str) {
    let _serial = SERIAL.lock().await;
    let cl = cluster(kind, wiring, tag, subnet).await;
    let one = start_new_pods(&cl, 1, "one").await;
    check(&one, &format!("{kind:?} {wiring:?}, 1 pod"));
    let twenty = start_new_pods(&cl, 20, "many").await;
    check(&twenty, &format!("{kind:?} {wiring:?}, 20 pods at once"));
    agent_stopped(cl).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_pods_are_enforced_before_add_returns_ebpf() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    scenario(DataplaneKind::Ebpf, Wiring::Ptp, "e", "10.237.0.0/24").await;
}

/// The same with the `bridge` plugin (the eBPF dataplane: bridged traffic
/// between two ports of one bridge never reaches the IP forward hook that
/// the nftables table hooks, so only eBPF on the veths sees it).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_bridged_pods_are_enforced_before_add_returns_ebpf() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    scenario(DataplaneKind::Ebpf, Wiring::Bridge, "w", "10.229.0.0/24").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_pods_are_enforced_before_add_returns_nftables() {
    scenario(DataplaneKind::Nftables, Wiring::Ptp, "n", "10.238.0.0/24").await;
}
