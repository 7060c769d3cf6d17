//! Other nodes' addresses are node identities in the kernel (issue 11,
//! "Other nodes"), through the real agent over the eBPF dataplane and the
//! test API server: 50 other Nodes (`node-00`..`node-49`, InternalIP
//! `10.241.0.<10+i>`, label `zone=z<i%2>`) and this node's Node (`node-a`)
//! are created; the pinned `NPM_IPCACHE` then holds each other node's
//! address with a node identity (two: one per label set), never world
//! (absent), and this node's Node lends no address. Then:
//! - a heartbeat-only status update (conditions) writes nothing and does
//!   not even sync;
//! - a label change moves the node to another node identity;
//! - a relist of the Nodes cut by `410 Gone` mid-list (page size 20, the
//!   history compacted under the third page) never removes a node address
//!   from the kernel, and all are there afterwards;
//! - a deleted Node's address leaves the ipcache (world again);
//! - deleting most Nodes is held by the mass-removal guard (counted as a
//!   deferred destructive action) until a direct read confirms it.
//!
//! Needs root and the BPF object (`cargo xtask build-ebpf`). Names carry
//! the process id (pin dir `/sys/fs/bpf/npmnd<pid>`); leftovers of crashed
//! runs are removed first. No pod, no interface is attached.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::netns::*;
use crate::common::*;
use k8s_openapi::api::core::v1::{Node, NodeAddress, NodeCondition, NodeStatus};
use kube::api::{Api, DeleteParams, ObjectMeta, PostParams};
use npm_agent::k8s::ClusterPolicyMode;
use npm_agent::reconcile::AgentDataplane;
use npm_dataplane::ebpf::{dump_pinned, EbpfDataplane, EbpfOptions};
use npm_dataplane::{Counters, Dataplane, DataplaneError, Interfaces};
use npm_policy::compiled::{Compiled, CompiledDiff};
use npm_testapi::FaultRule;

const PREFIX: &str = "npmnd";
const NODES_PATH: &str = "/api/v1/nodes";
const INITS: &str = "npm_watch_events_total{resource=\"nodes\",event=\"init\"}";
const APPLIES: &str = "npm_watch_events_total{resource=\"nodes\",event=\"apply\"}";
const SYNCS: &str = "npm_sync_duration_seconds_count";
const DEFERRED: &str = "npm_destructive_actions_deferred_total";
const OTHERS: u8 = 50;

fn address(i: u8) -> IpAddr {
    format!("10.241.0.{}", 10 + i).parse().unwrap()
}

fn is_node_address(ip: &IpAddr) -> bool {
    matches!(ip, IpAddr::V4(v4) if v4.octets()[..3] == [10, 241, 0])
}

fn node(name: &str, zone: &str, ip: IpAddr, heartbeat: &str) -> Node {
    Node {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([("zone".to_string(), zone.to_string())].into()),
            ..Default::default()
        },
        spec: None,
        status: Some(NodeStatus {
            addresses: Some(vec![
                NodeAddress {
                    type_: "InternalIP".into(),
                    address: ip.to_string(),
                },
                NodeAddress {
                    type_: "Hostname".into(),
                    address: name.into(),
                },
            ]),
            conditions: Some(vec![NodeCondition {
                type_: "Ready".into(),
                status: "True".into(),
                message: Some(format!("kubelet heartbeat {heartbeat}")),
                ..Default::default()
            }]),
            ..Default::default()
        }),
    }
}

/// Create `n` (its status too: the API may drop it on create).
async fn create_node(api: &Api<Node>, n: Node) {
    let created = api.create(&PostParams::default(), &n).await.expect("create node");
    if created.status.as_ref().and_then(|s| s.addresses.as_ref())
        != n.status.as_ref().and_then(|s| s.addresses.as_ref())
    {
        put_status(api, created, n.status.unwrap()).await;
    }
}

async fn put_status(api: &Api<Node>, mut current: Node, status: NodeStatus) {
    current.status = Some(status);
    let name = current.metadata.name.clone().unwrap();
    api.replace_status(&name, &PostParams::default(), &current)
        .await
        .expect("replace node status");
}

/// The pinned ipcache: address -> identity.
fn pinned(pin_dir: &std::path::Path) -> BTreeMap<IpAddr, u32> {
    let dump = dump_pinned(pin_dir).expect("dump the pinned maps");
    dump.ipcache.iter().map(|e| (e.addr, e.identity)).collect()
}

/// What the wrapper saw: writes with a non-empty ipcache change, and node
/// addresses removed from the ipcache by any write.
#[derive(Debug, Default)]
struct NodeLog {
    ipcache_writes: usize,
    node_removals: usize,
}

/// The eBPF dataplane, counting what each write does to node addresses.
struct NodeWatch<D> {
    inner: D,
    log: Arc<Mutex<NodeLog>>,
    last: Compiled,
}

impl<D: Dataplane> Dataplane for NodeWatch<D> {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.sync_full(compiled, interfaces)?;
        let removed = (self.last.ipcache.keys())
            .filter(|ip| is_node_address(ip) && !compiled.ipcache.contains_key(ip))
            .count();
        let mut log = self.log.lock().unwrap();
        log.ipcache_writes += 1;
        log.node_removals += removed;
        self.last = compiled.clone();
        Ok(())
    }

    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.inner.apply(diff, next, interfaces)?;
        let mut log = self.log.lock().unwrap();
        if !diff.ipcache.upsert.is_empty() || !diff.ipcache.remove.is_empty() {
            log.ipcache_writes += 1;
        }
        log.node_removals += diff.ipcache.remove.iter().filter(|ip| is_node_address(ip)).count();
        self.last = next.clone();
        Ok(())
    }

    fn counters(&self) -> Result<Counters, DataplaneError> {
        self.inner.counters()
    }
}

impl<D: AgentDataplane> AgentDataplane for NodeWatch<D> {}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_nodes_are_node_identities_in_the_kernel() {
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    let topo = RoutedPods::<0>::new(PREFIX, "nni", [], "10.241");
    let (srv, client) = server(false).await;
    let nodes: Api<Node> = Api::all(client.clone());
    for i in 0..OTHERS {
        create_node(
            &nodes,
            node(&format!("node-{i:02}"), &format!("z{}", i % 2), address(i), "0"),
        )
        .await;
    }
    create_node(&nodes, node("node-a", "z0", "10.241.1.1".parse().unwrap(), "0")).await;

    let dp = EbpfDataplane::open(EbpfOptions {
        object: std::env::var_os("NPM_EBPF_OBJECT").map(Into::into),
        pin_dir: topo.pin_dir.clone(),
        bench_no_ct_create: false,
        attach: npm_dataplane::ebpf::AttachMode::Tcx,
    })
    .expect("open the eBPF dataplane (run `cargo xtask build-ebpf` first)");
    let log = Arc::new(Mutex::new(NodeLog::default()));
    let dp = NodeWatch {
        inner: dp,
        log: log.clone(),
        last: Compiled::default(),
    };
    let mut cfg = agent_config(20);
    cfg.sync.cluster_policies = ClusterPolicyMode::Off;
    let agent = start_agent(cfg, client.clone(), dp).await;
    wait_until("ready", Duration::from_secs(30), || agent.is_ready()).await;

    // Every other node's address has a node identity; one per label set.
    let ipc = pinned(&topo.pin_dir);
    let ids: Vec<u32> = (0..OTHERS)
        .map(|i| {
            *ipc.get(&address(i))
                .unwrap_or_else(|| panic!("node-{i:02} is in the ipcache: {ipc:?}"))
        })
        .collect();
    assert!(
        ids.iter()
            .all(|id| *id >= npm_common::IDENTITY_FIRST_POD && *id < npm_common::IDENTITY_FIRST_CIDR),
        "node identities come from the pod identity space, not world/host: {ids:?}"
    );
    let (z0, z1) = (ids[0], ids[1]);
    assert_ne!(z0, z1, "two label sets, two identities");
    assert!(ids
        .iter()
        .enumerate()
        .all(|(i, id)| *id == if i % 2 == 0 { z0 } else { z1 }));
    assert!(
        !ipc.contains_key(&"10.241.1.1".parse::<IpAddr>().unwrap()),
        "this node's Node lends no address"
    );

    // A heartbeat (conditions only): no sync, no write.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (writes, syncs, applies) = (
        log.lock().unwrap().ipcache_writes,
        metric(&agent, SYNCS),
        metric(&agent, APPLIES),
    );
    let current = nodes.get("node-08").await.unwrap();
    put_status(&nodes, current, node("node-08", "z0", address(8), "1").status.unwrap()).await;
    wait_until("the heartbeat reached the agent", Duration::from_secs(10), || {
        metric(&agent, APPLIES) > applies
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(log.lock().unwrap().ipcache_writes, writes, "a heartbeat writes nothing");
    assert_eq!(metric(&agent, SYNCS), syncs, "a heartbeat does not even sync");

    // A label change moves the node to another node identity.
    let mut n7 = nodes.get("node-07").await.unwrap();
    n7.metadata.labels = Some([("zone".to_string(), "z9".to_string())].into());
    nodes.replace("node-07", &PostParams::default(), &n7).await.unwrap();
    wait_until("node-07 has its own identity", Duration::from_secs(10), || {
        pinned(&topo.pin_dir)
            .get(&address(7))
            .is_some_and(|id| ![z0, z1].contains(id) && *id >= npm_common::IDENTITY_FIRST_POD)
    })
    .await;
    assert_eq!(pinned(&topo.pin_dir)[&address(9)], z1, "the other z1 nodes keep theirs");

    // A relist cut by 410 under its third page: no node address removed.
    let removals = log.lock().unwrap().node_removals;
    assert_eq!(removals, 0);
    srv.inject(
        FaultRule::delay(1000, Duration::from_millis(400))
            .path(NODES_PATH)
            .verb("list"),
    );
    let inits = metric(&agent, INITS);
    let delays0 = srv.stats().injected_delays;
    let t0 = Instant::now();
    while metric(&agent, INITS) <= inits {
        assert!(t0.elapsed() < Duration::from_secs(20), "the node watch never relisted");
        create_namespaces(&client, &[namespace(&format!("bump{}", t0.elapsed().as_millis()), &[])]).await;
        srv.compact();
        srv.drop_watches();
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    wait_until("two pages of the relist", Duration::from_secs(20), || {
        srv.stats().injected_delays >= delays0 + 3
    })
    .await;
    create_namespaces(&client, &[namespace("bump-mid-list", &[])]).await;
    srv.compact();
    for _ in 0..10 {
        let ipc = pinned(&topo.pin_dir);
        assert!(
            (0..OTHERS).all(|i| ipc.contains_key(&address(i))),
            "every node address stays during the relist"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    wait_until("the relist restarted after the 410", Duration::from_secs(20), || {
        metric(&agent, INITS) >= inits + 2.0
    })
    .await;
    srv.clear_faults();
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(log.lock().unwrap().node_removals, 0, "no write removed a node address");
    let ipc = pinned(&topo.pin_dir);
    assert!(
        (0..OTHERS).all(|i| ipc.contains_key(&address(i))),
        "all there after the relist"
    );

    // A deleted Node's address is world again (not in the ipcache).
    nodes.delete("node-03", &DeleteParams::default()).await.unwrap();
    wait_until("node-03's address left the ipcache", Duration::from_secs(10), || {
        !pinned(&topo.pin_dir).contains_key(&address(3))
    })
    .await;
    assert_eq!(log.lock().unwrap().node_removals, 1);

    // Most Nodes deleted: held by the guard, applied once a direct read
    // confirms it.
    let deferred = metric(&agent, DEFERRED);
    for i in (0..OTHERS).filter(|i| *i != 3 && *i >= 10) {
        nodes
            .delete(&format!("node-{i:02}"), &DeleteParams::default())
            .await
            .unwrap();
    }
    wait_until("the removal was confirmed and applied", Duration::from_secs(30), || {
        let ipc = pinned(&topo.pin_dir);
        (10..OTHERS).all(|i| !ipc.contains_key(&address(i)))
    })
    .await;
    assert!(
        metric(&agent, DEFERRED) > deferred,
        "the mass removal of Nodes was held first"
    );
    let ipc = pinned(&topo.pin_dir);
    assert!(
        (0..10).filter(|i| *i != 3).all(|i| ipc.contains_key(&address(i))),
        "the rest stay"
    );
    agent.abort();
}
