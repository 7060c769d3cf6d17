//! The seeded schedule of the soak: which step comes next (drawn from the
//! seeded generator and the cluster as the schedule left it, so a seed
//! replays the same steps), the objects it writes (pods, labels,
//! NetworkPolicies, an invalid one) and the snapshot the oracle judges by.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::model::{Pod, PodPhase, Snapshot};
use npm_sim::cases::{
    model_container_ports, Action, ClusterObjectName, ClusterPolicyObject, NamespaceLabels, ObjectName, PodLabels,
    PodName,
};
use rand::rngs::StdRng;
use rand::Rng;
use serde_json::{json, Value};

/// The namespaces of the soak (the upstream model's).
pub const NAMESPACES: [&str; 3] = ["x", "y", "z"];
const ROLES: [&str; 3] = ["web", "db", "client"];
const TIERS: [&str; 2] = ["front", "back"];
/// Pods below which none is deleted.
const MIN_PODS: usize = 6;
/// Pods above which none is created.
const MAX_PODS: usize = 14;
/// Pods whose status lost their addresses, at most at once.
const MAX_LOST: usize = 2;
/// Highest pod index the model may hand out in a namespace.
const MAX_POD_INDEX: u32 = 200;

/// One step of the schedule.
#[derive(Clone, Debug)]
pub enum Step {
    /// A modelled action (pods, labels, NetworkPolicies), through the runner.
    Model(Action),
    /// A pod the model does not know at a freed address, wired by the CNI
    /// chain on the node of the address's namespace or on another node.
    Reuse {
        /// `ns/name`.
        pod: String,
        /// Labels.
        labels: BTreeMap<String, String>,
        /// Addresses.
        v4: Ipv4Addr,
        /// IPv6 address.
        v6: Ipv6Addr,
        /// Node (1-based).
        node: u8,
    },
    /// Delete a reuse pod.
    DeleteReuse(String),
    /// A Running pod's status loses its addresses (`podIP`, `podIPs`
    /// emptied by a status patch): its sandbox, interface and address stay,
    /// as when a kubelet publishes a status without them.
    LoseIp(String),
    /// The addresses of a pod that lost them are published again.
    RestoreIp(String),
    /// A NetworkPolicy npm-policy cannot fully convert, written with the
    /// API server's validation off (an API server of another version).
    Invalid(Box<NetworkPolicy>),
    /// Delete the invalid policy.
    DeleteInvalid(String, String),
    /// `kill -9` node `k`'s agent; started again after `down_secs`.
    KillAgent {
        /// Node.
        node: u8,
        /// Seconds until the restart.
        down_secs: u64,
    },
    /// An API server fault.
    Fault(Fault),
    /// npm-cni's ADD times out: node `node`'s agent is stopped (SIGSTOP)
    /// while the CNI chain wires pod `pod` at a freed address of that node
    /// with a short `timeoutSeconds`. The ADD must fail (npm-cni fails
    /// closed) and the runtime's DEL follows; the agent then continues and
    /// finds both requests waiting. Once the agents are ready, the address
    /// goes to a new pod with `next_labels` (a [`Step::Reuse`]): the stale
    /// ADD must give it nothing.
    CniTimeout(CniTimeoutPod),
}

/// The pod of a [`Step::CniTimeout`].
#[derive(Clone, Debug)]
pub struct CniTimeoutPod {
    /// `ns/name` of the pod whose ADD times out.
    pub pod: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// The labels of the address's next owner (`<pod>n`).
    pub next_labels: BTreeMap<String, String>,
    /// IPv4 address.
    pub v4: Ipv4Addr,
    /// IPv6 address.
    pub v6: Ipv6Addr,
    /// Node (1-based): the address's subnet's.
    pub node: u8,
}

/// The API server faults of the schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// The watches dropped, the history compacted and the next pod list
    /// answered 410 Gone: the agents relist.
    GoneMidList,
    /// Every watch dropped.
    DroppedWatches,
    /// Lists and watches answer 503 for `secs` (writes go on).
    Outage(u64),
    /// The ClusterNetworkPolicy resource answers 404 for `secs`.
    CnpNotFound(u64),
    /// The next 20 lists and watches take 1.5 s.
    Slow,
}

impl Step {
    /// A one-line description.
    pub fn describe(&self) -> String {
        match self {
            Step::Model(a) => describe_action(a),
            Step::Reuse {
                pod, v4, node, labels, ..
            } => {
                format!("reuse {v4} as {pod} on node-{node} {labels:?}")
            }
            Step::DeleteReuse(p) => format!("delete reuse pod {p}"),
            Step::LoseIp(p) => format!("pod {p} loses its addresses (status)"),
            Step::RestoreIp(p) => format!("pod {p} gets its addresses back (status)"),
            Step::Invalid(np) => format!(
                "invalid policy {}/{}",
                np.metadata.namespace.as_deref().unwrap_or(""),
                np.metadata.name.as_deref().unwrap_or("")
            ),
            Step::DeleteInvalid(ns, n) => format!("delete invalid policy {ns}/{n}"),
            Step::KillAgent { node, down_secs } => format!("kill -9 agent of node-{node} for {down_secs}s"),
            Step::Fault(f) => format!("fault {f:?}"),
            Step::CniTimeout(CniTimeoutPod {
                pod, v4, node, labels, ..
            }) => format!("npm-cni ADD of {pod} at {v4} on node-{node} {labels:?} times out (agent stopped)"),
        }
    }
}

fn describe_action(a: &Action) -> String {
    match a {
        Action::CreatePolicy(np) | Action::UpdatePolicy(np) => format!(
            "{} {}/{} {}",
            a.name(),
            np.metadata.namespace.as_deref().unwrap_or(""),
            np.metadata.name.as_deref().unwrap_or(""),
            serde_json::to_string(&np.spec).unwrap_or_default()
        ),
        Action::DeletePolicy(o) => format!("delete_policy {}/{}", o.namespace, o.name),
        Action::SetPodLabels(p) | Action::CreatePod(p) => format!("{} {} {:?}", a.name(), p.pod, p.labels),
        Action::DeletePod(p) => format!("delete_pod {}", p.pod),
        Action::SetNamespaceLabels(n) => format!("set_namespace_labels {} {:?}", n.namespace, n.labels),
        Action::CreateClusterNetworkPolicy(o) | Action::UpdateClusterNetworkPolicy(o) => format!(
            "{} {} {}",
            a.name(),
            o.name(),
            serde_json::to_string(o.0.get("spec").unwrap_or(&serde_yaml::Value::Null)).unwrap_or_default()
        ),
        Action::DeleteClusterNetworkPolicy(o) => format!("delete_cluster_network_policy {}", o.name),
        other => other.name().to_string(),
    }
}

/// A pod of the soak that the model does not know (at a reused address).
#[derive(Clone, Debug)]
pub struct ReusePod {
    /// Labels.
    pub labels: BTreeMap<String, String>,
    /// IPv4.
    pub v4: Ipv4Addr,
    /// IPv6.
    pub v6: Ipv6Addr,
    /// Node (1-based).
    pub node: u8,
    /// Its creation order (newer than every model pod).
    pub created: i64,
}

/// What the schedule knows beyond the runner's model: reuse pods, freed
/// addresses, the invalid policy, counters.
#[derive(Debug, Default)]
pub struct World {
    /// Reuse pods by `ns/name`.
    pub reuse: BTreeMap<String, ReusePod>,
    /// Addresses of deleted pods nobody holds now (namespace, v4, v6).
    pub freed: Vec<(String, Ipv4Addr, Ipv6Addr)>,
    /// The invalid policies in the API server.
    pub invalid: BTreeMap<(String, String), NetworkPolicy>,
    /// Pods created per namespace (the model's next index).
    pub created: BTreeMap<String, u32>,
    /// Model pods whose status lost their addresses (`ns/name`).
    pub lost: std::collections::BTreeSet<String>,
    /// Counter of names.
    pub next: u32,
    /// An API fault is running.
    pub fault_running: bool,
    /// An agent is down.
    pub agent_down: bool,
    /// The fault-injected run: no agent kill and no API fault is drawn
    /// (each relists, which brings the dropped deletes back), and the
    /// policies of [`injected_step`] are never drawn for an update or a
    /// deletion, so the injected fault is what the oracle must see.
    pub injected: bool,
}

/// The Pod of a reuse pod `ns/name`.
pub fn reuse_pod(key: &str, p: &ReusePod) -> Pod {
    let (ns, name) = key.split_once('/').unwrap_or(("", ""));
    Pod {
        uid: format!("reuse-{ns}-{name}-{}", p.created),
        namespace: ns.to_string(),
        name: name.to_string(),
        labels: p.labels.clone().into(),
        ips: vec![IpAddr::V4(p.v4), IpAddr::V6(p.v6)],
        node_name: Some(format!("node-{}", p.node)),
        phase: PodPhase::Running,
        deleting: false,
        host_network: false,
        ports: model_container_ports(),
        created: p.created,
    }
}

/// The snapshot the oracle judges by: the model's, the reuse pods and the
/// invalid policies (converted as the agent converts them: what cannot be
/// understood dropped, the pods selected still isolated).
pub fn oracle_snapshot(model: &Snapshot, world: &World) -> Snapshot {
    let mut s = model.clone();
    for key in &world.lost {
        if let Some((ns, name)) = key.split_once('/') {
            if let Some(p) = s.pods.get_mut(&(ns.to_string(), name.to_string())) {
                p.ips.clear();
            }
        }
    }
    for (key, p) in &world.reuse {
        s.upsert_pod(reuse_pod(key, p));
    }
    for np in world.invalid.values() {
        // Err: recorded as invalid, kept without what it cannot convert.
        let _ = s.upsert_policy(np);
    }
    s
}

/// The model pods of `world.lost` with the addresses their sandboxes
/// keep: each node's agent holds its own such pods by npm-cni's facts
/// (the oracle's per-node view).
pub fn lost_pods(model: &Snapshot, world: &World, nodes: u8) -> Vec<(u8, Pod)> {
    world
        .lost
        .iter()
        .filter_map(|key| key.split_once('/'))
        .filter_map(|(ns, name)| model.pods.get(&(ns.to_string(), name.to_string())).cloned())
        .filter_map(|p| Some((p.ips.iter().find_map(|ip| node_of_address(nodes, *ip))?, p)))
        .collect()
}

/// The node (1-based) of the pod at `ip`: the owner of the namespace
/// subnet the address is in (the third octet of `198.18.<n>.x`, the
/// seventh group of `fd00:198:18::<n>:x`), as the cluster wires pods.
pub fn node_of_address(nodes: u8, ip: IpAddr) -> Option<u8> {
    let n = match ip {
        IpAddr::V4(a) => a.octets()[2],
        IpAddr::V6(a) => u8::try_from(a.segments()[6]).ok()?,
    };
    Some(crate::nodes::Nodes::owner_of(nodes, n))
}

fn pick<'a, T>(rng: &mut StdRng, v: &'a [T]) -> &'a T {
    &v[rng.random_range(0..v.len())]
}

fn pod_labels(rng: &mut StdRng, name: &str) -> BTreeMap<String, String> {
    [
        ("pod".to_string(), name.to_string()),
        ("role".to_string(), pick(rng, &ROLES).to_string()),
    ]
    .into()
}

/// A random peer: pods by role, namespaces by tier or name, both, or an
/// ipBlock around the pod subnets.
fn peer(rng: &mut StdRng) -> Value {
    match rng.random_range(0..5) {
        0 => json!({"podSelector": {"matchLabels": {"role": pick(rng, &ROLES)}}}),
        1 => json!({"namespaceSelector": {"matchLabels": {"tier": pick(rng, &TIERS)}}}),
        2 => json!({
            "namespaceSelector": {"matchLabels": {"ns": pick(rng, &NAMESPACES)}},
            "podSelector": {"matchLabels": {"role": pick(rng, &ROLES)}},
        }),
        3 => json!({"namespaceSelector": {"matchLabels": {"ns": pick(rng, &NAMESPACES)}}}),
        _ => {
            let n = rng.random_range(1..=3);
            json!({"ipBlock": {"cidr": format!("198.18.{n}.0/24"), "except": [format!("198.18.{n}.1/32")]}})
        }
    }
}

fn ports(rng: &mut StdRng) -> Value {
    match rng.random_range(0..4) {
        0 => json!([{"protocol": "TCP", "port": 80}]),
        1 => json!([{"protocol": "UDP", "port": 80}]),
        2 => json!([{"protocol": "TCP", "port": 81}, {"protocol": "UDP", "port": 80}]),
        _ => Value::Null,
    }
}

fn rule(rng: &mut StdRng, key: &str) -> Value {
    let peers: Vec<Value> = (0..rng.random_range(1..=2)).map(|_| peer(rng)).collect();
    let mut r = json!({ key: peers });
    let p = ports(rng);
    if !p.is_null() {
        r["ports"] = p;
    }
    r
}

/// A random valid NetworkPolicy `ns/name`: a pod selector by role (or
/// all), Ingress, Egress or both, 0 to 2 rules each (0: deny that way).
pub fn random_policy(rng: &mut StdRng, ns: &str, name: &str) -> NetworkPolicy {
    let selector = if rng.random_bool(0.3) {
        json!({})
    } else {
        json!({"matchLabels": {"role": pick(rng, &ROLES)}})
    };
    let types: Vec<&str> = match rng.random_range(0..4) {
        0 | 1 => vec!["Ingress"],
        2 => vec!["Egress"],
        _ => vec!["Ingress", "Egress"],
    };
    let mut spec = json!({"podSelector": selector, "policyTypes": types});
    if types.contains(&"Ingress") {
        let rules: Vec<Value> = (0..rng.random_range(0..=2)).map(|_| rule(rng, "from")).collect();
        spec["ingress"] = json!(rules);
    }
    if types.contains(&"Egress") {
        let rules: Vec<Value> = (0..rng.random_range(0..=2)).map(|_| rule(rng, "to")).collect();
        spec["egress"] = json!(rules);
    }
    let obj = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": ns, "name": name},
        "spec": spec,
    });
    serde_json::from_value(obj).expect("a NetworkPolicy")
}

/// ClusterNetworkPolicies above which none is created.
const MAX_CNPS: usize = 4;

/// A random ClusterNetworkPolicy peer: namespaces by tier or name, pods by
/// role in a namespace, or (egress) a network around the pod subnets.
fn cnp_peer(rng: &mut StdRng, egress: bool) -> Value {
    match rng.random_range(0..if egress { 4 } else { 3 }) {
        0 => json!({"namespaces": {"matchLabels": {"tier": pick(rng, &TIERS)}}}),
        1 => json!({"namespaces": {"matchLabels": {"ns": pick(rng, &NAMESPACES)}}}),
        2 => json!({"pods": {
            "namespaceSelector": {"matchLabels": {"ns": pick(rng, &NAMESPACES)}},
            "podSelector": {"matchLabels": {"role": pick(rng, &ROLES)}},
        }}),
        _ => json!({"networks": [format!("198.18.{}.0/24", rng.random_range(1..=3))]}),
    }
}

/// A random ClusterNetworkPolicy `name` (`policy.networking.k8s.io/
/// v1alpha2`): Admin (Accept, Deny, Pass) or Baseline (Accept, Deny) at
/// `priority`, a subject by namespace tier or by pods of a role, one or two
/// rules in one or both directions, some on a port.
pub fn random_cluster_policy(rng: &mut StdRng, name: &str, priority: u32) -> ClusterPolicyObject {
    let admin = rng.random_bool(0.6);
    let subject = if rng.random_bool(0.5) {
        json!({"namespaces": {"matchLabels": {"tier": pick(rng, &TIERS)}}})
    } else {
        json!({"pods": {
            "namespaceSelector": {},
            "podSelector": {"matchLabels": {"role": pick(rng, &ROLES)}},
        }})
    };
    let actions: &[&str] = if admin {
        &["Accept", "Deny", "Pass"]
    } else {
        &["Accept", "Deny"]
    };
    let mut spec = json!({
        "tier": if admin { "Admin" } else { "Baseline" },
        "priority": priority,
        "subject": subject,
    });
    let (ingress, egress) = match rng.random_range(0..3) {
        0 => (true, false),
        1 => (false, true),
        _ => (true, true),
    };
    for (on, key, peers_key, egress) in [(ingress, "ingress", "from", false), (egress, "egress", "to", true)] {
        if !on {
            continue;
        }
        let rules: Vec<Value> = (0..rng.random_range(1..=2))
            .map(|i| {
                let mut r = json!({
                    "name": format!("{key}-{i}"),
                    "action": pick(rng, actions),
                    peers_key: [cnp_peer(rng, egress)],
                });
                match rng.random_range(0..3) {
                    0 => r["protocols"] = json!([{"tcp": {"destinationPort": {"number": 80}}}]),
                    1 => r["protocols"] = json!([{"udp": {"destinationPort": {"number": 80}}}]),
                    _ => {}
                }
                r
            })
            .collect();
        spec[key] = json!(rules);
    }
    let obj = json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": name},
        "spec": spec,
    });
    ClusterPolicyObject(serde_yaml::to_value(obj).expect("a ClusterNetworkPolicy as YAML"))
}

/// A priority of `tier`'s range that no ClusterNetworkPolicy of `model`
/// uses (two overlapping policies of one priority have no defined order).
fn free_priority(rng: &mut StdRng, model: &Snapshot) -> Option<u32> {
    let used: Vec<u32> = model.cluster_policies.values().map(|p| p.priority).collect();
    let free: Vec<u32> = (0..20).filter(|p| !used.contains(p)).collect();
    (!free.is_empty()).then(|| *pick(rng, &free))
}

/// The schedule's first steps: the upstream pods get roles (`a` web, `b`
/// db, `c` client) and the namespaces tiers (`x`, `z` front, `y` back), so
/// the random selectors select; then ingress default-deny in namespaces
/// `x` and `y` (most clusters start so), on which the random policies
/// allow.
pub fn baseline() -> Vec<Step> {
    let mut steps = Vec::new();
    for (ns, tier) in [("x", "front"), ("y", "back"), ("z", "front")] {
        for (pod, role) in [("a", "web"), ("b", "db"), ("c", "client")] {
            steps.push(Step::Model(Action::SetPodLabels(PodLabels {
                pod: format!("{ns}/{pod}"),
                labels: [
                    ("pod".to_string(), pod.to_string()),
                    ("role".to_string(), role.to_string()),
                ]
                .into(),
            })));
        }
        steps.push(Step::Model(Action::SetNamespaceLabels(NamespaceLabels {
            namespace: ns.to_string(),
            labels: [
                ("ns".to_string(), ns.to_string()),
                ("tier".to_string(), tier.to_string()),
            ]
            .into(),
        })));
    }
    steps.extend(["x", "y"].iter().map(|ns| {
        let obj = json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"namespace": ns, "name": "default-deny"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        });
        Step::Model(Action::CreatePolicy(Box::new(
            serde_json::from_value(obj).expect("a NetworkPolicy"),
        )))
    }));
    steps
}

/// The name prefix of the fault-injected run's own policies.
const INJECTED_PREFIX: &str = "inject-";

/// The steps the fault-injected run adds at fixed ticks, whatever the
/// seed draws: at tick 5 an ingress default-deny of namespace `x` and a
/// policy allowing every ingress there, at tick 15 the deletion of the
/// allow. With the agents dropping NetworkPolicy deletes, the allow
/// outlives its object, and the probes of the pairs that deletion flipped
/// connect where no legal state allows it: the run's violations do not
/// depend on what the seed happens to schedule (it draws no update or
/// deletion of these two, and no relisting fault: see [`World::injected`]).
pub fn injected_step(tick: u64) -> Vec<Step> {
    let policy = |name: &str, spec: Value| {
        let obj = json!({
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"namespace": "x", "name": format!("{INJECTED_PREFIX}{name}")},
            "spec": spec,
        });
        Step::Model(Action::CreatePolicy(Box::new(
            serde_json::from_value(obj).expect("a NetworkPolicy"),
        )))
    };
    match tick {
        5 => vec![
            policy("deny", json!({"podSelector": {}, "policyTypes": ["Ingress"]})),
            policy(
                "allow",
                json!({"podSelector": {}, "policyTypes": ["Ingress"], "ingress": [{}]}),
            ),
        ],
        15 => vec![Step::Model(Action::DeletePolicy(ObjectName {
            namespace: "x".to_string(),
            name: format!("{INJECTED_PREFIX}allow"),
        }))],
        _ => vec![],
    }
}

/// A NetworkPolicy that is not fully understood: an ipBlock with a /33
/// beside a valid peer, isolating the pods of `role`.
pub fn invalid_policy(rng: &mut StdRng, ns: &str, name: &str) -> NetworkPolicy {
    let obj = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": ns, "name": name},
        "spec": {
            "podSelector": {"matchLabels": {"role": pick(rng, &ROLES)}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"ipBlock": {"cidr": "198.18.0.0/33"}}, peer(rng)]}],
        },
    });
    serde_json::from_value(obj).expect("a NetworkPolicy")
}

/// Draws the next step from the seeded generator and the current cluster
/// (`model`: the runner's snapshot). `nodes` is the node count.
pub fn next_step(rng: &mut StdRng, model: &Snapshot, world: &mut World, nodes: u8) -> Step {
    let pods: Vec<String> = model.pods.keys().map(|(n, p)| format!("{n}/{p}")).collect();
    let total = pods.len() + world.reuse.len();
    let policies: Vec<(String, String)> = model
        .policies
        .keys()
        .filter(|(_, name)| !(world.injected && name.starts_with(INJECTED_PREFIX)))
        .cloned()
        .collect();
    loop {
        let roll = rng.random_range(0..100);
        world.next += 1;
        let n = world.next;
        match roll {
            0..=9 if total < MAX_PODS => {
                let ns = pick(rng, &NAMESPACES).to_string();
                let c = world.created.entry(ns.clone()).or_insert(3);
                if *c >= MAX_POD_INDEX {
                    continue;
                }
                *c += 1;
                let name = format!("p{n}");
                return Step::Model(Action::CreatePod(PodLabels {
                    pod: format!("{ns}/{name}"),
                    labels: pod_labels(rng, &name),
                }));
            }
            10..=17 if total > MIN_PODS && !pods.is_empty() => {
                return Step::Model(Action::DeletePod(PodName {
                    pod: pick(rng, &pods).clone(),
                }))
            }
            24..=27 if world.lost.len() < MAX_LOST => {
                let candidates: Vec<&String> = pods.iter().filter(|p| !world.lost.contains(*p)).collect();
                if candidates.is_empty() {
                    continue;
                }
                return Step::LoseIp(pick(rng, &candidates).to_string());
            }
            28..=29 if !world.lost.is_empty() => {
                let lost: Vec<&String> = world.lost.iter().collect();
                return Step::RestoreIp(pick(rng, &lost).to_string());
            }
            18..=23 if !pods.is_empty() => {
                let pod = pick(rng, &pods).clone();
                let name = pod.split_once('/').map(|(_, p)| p).unwrap_or("").to_string();
                return Step::Model(Action::SetPodLabels(PodLabels {
                    pod,
                    labels: pod_labels(rng, &name),
                }));
            }
            30..=37 if !world.freed.is_empty() && total < MAX_PODS => {
                let i = rng.random_range(0..world.freed.len());
                let (ns, v4, v6) = world.freed[i].clone();
                let name = format!("r{n}");
                // Half of the reuses give the address to a pod of another
                // node, as IPAMs that move addresses between nodes do (that
                // node's CNI chain wires it from the address's subnet, the
                // other nodes route it there).
                let owner = crate::nodes::Nodes::owner_of(nodes, v4.octets()[2]);
                let node = if nodes > 1 && rng.random_bool(0.5) {
                    owner % nodes + 1
                } else {
                    owner
                };
                return Step::Reuse {
                    pod: format!("{ns}/{name}"),
                    labels: pod_labels(rng, &name),
                    v4,
                    v6,
                    node,
                };
            }
            38..=42 if !world.reuse.is_empty() => {
                let keys: Vec<String> = world.reuse.keys().cloned().collect();
                return Step::DeleteReuse(pick(rng, &keys).clone());
            }
            43..=75 if rng.random_range(0..4) == 0 => {
                // One policy change in four is a ClusterNetworkPolicy's.
                let cnps: Vec<String> = model.cluster_policies.keys().cloned().collect();
                match rng.random_range(0..3) {
                    0 if cnps.len() < MAX_CNPS => {
                        if let Some(priority) = free_priority(rng, model) {
                            let cnp = random_cluster_policy(rng, &format!("cnp{n}"), priority);
                            return Step::Model(Action::CreateClusterNetworkPolicy(Box::new(cnp)));
                        }
                    }
                    1 if !cnps.is_empty() => {
                        let name = pick(rng, &cnps).clone();
                        let priority = model.cluster_policies[&name].priority;
                        let cnp = random_cluster_policy(rng, &name, priority);
                        return Step::Model(Action::UpdateClusterNetworkPolicy(Box::new(cnp)));
                    }
                    2 if !cnps.is_empty() => {
                        let name = pick(rng, &cnps).clone();
                        return Step::Model(Action::DeleteClusterNetworkPolicy(ClusterObjectName { name }));
                    }
                    _ => {}
                }
                continue;
            }
            43..=54 => {
                let ns = pick(rng, &NAMESPACES);
                return Step::Model(Action::CreatePolicy(Box::new(random_policy(
                    rng,
                    ns,
                    &format!("np{n}"),
                ))));
            }
            55..=63 if !policies.is_empty() => {
                let (ns, name) = pick(rng, &policies).clone();
                return Step::Model(Action::UpdatePolicy(Box::new(random_policy(rng, &ns, &name))));
            }
            64..=75 if !policies.is_empty() => {
                let (ns, name) = pick(rng, &policies).clone();
                return Step::Model(Action::DeletePolicy(ObjectName { namespace: ns, name }));
            }
            76..=78 => {
                if let Some((ns, name)) = world.invalid.keys().next().cloned() {
                    return Step::DeleteInvalid(ns, name);
                }
                let ns = pick(rng, &NAMESPACES);
                return Step::Invalid(Box::new(invalid_policy(rng, ns, &format!("bad{n}"))));
            }
            79..=85 => {
                let ns = pick(rng, &NAMESPACES).to_string();
                let labels: BTreeMap<String, String> = [
                    ("ns".to_string(), ns.clone()),
                    ("tier".to_string(), pick(rng, &TIERS).to_string()),
                ]
                .into();
                return Step::Model(Action::SetNamespaceLabels(NamespaceLabels { namespace: ns, labels }));
            }
            86..=99 if world.injected => continue,
            86..=89 if !world.agent_down && !world.freed.is_empty() && rng.random_bool(0.3) => {
                let i = rng.random_range(0..world.freed.len());
                let (ns, v4, v6) = world.freed[i].clone();
                let name = format!("t{n}");
                return Step::CniTimeout(CniTimeoutPod {
                    pod: format!("{ns}/{name}"),
                    labels: pod_labels(rng, &name),
                    next_labels: pod_labels(rng, &format!("{name}n")),
                    v4,
                    v6,
                    node: crate::nodes::Nodes::owner_of(nodes, v4.octets()[2]),
                });
            }
            86..=89 if !world.agent_down => {
                return Step::KillAgent {
                    node: rng.random_range(1..=nodes.max(1)),
                    down_secs: rng.random_range(1..=5),
                }
            }
            90..=99 if !world.fault_running => {
                let f = match rng.random_range(0..9) {
                    0 | 1 => Fault::GoneMidList,
                    2 | 3 => Fault::DroppedWatches,
                    4 | 5 => Fault::Outage(rng.random_range(3..=10)),
                    6 | 7 => Fault::CnpNotFound(rng.random_range(3..=10)),
                    _ => Fault::Slow,
                };
                return Step::Fault(f);
            }
            _ => continue,
        }
    }
}

/// A [`Step::CniTimeout`] at the first freed address of node `node`'s
/// subnets (`None`: none is free), with fixed labels: a forced step draws
/// nothing from the schedule's generator.
pub fn cni_timeout_on(world: &mut World, node: u8, nodes: u8) -> Option<Step> {
    let (ns, v4, v6) = world
        .freed
        .iter()
        .find(|(_, v4, _)| crate::nodes::Nodes::owner_of(nodes, v4.octets()[2]) == node)?
        .clone();
    world.next += 1;
    let name = format!("t{}", world.next);
    let labels = |pod: &str, role: &str| -> BTreeMap<String, String> {
        [
            ("pod".to_string(), pod.to_string()),
            ("role".to_string(), role.to_string()),
        ]
        .into()
    };
    Some(Step::CniTimeout(CniTimeoutPod {
        pod: format!("{ns}/{name}"),
        labels: labels(&name, ROLES[0]),
        next_labels: labels(&format!("{name}n"), ROLES[1 % ROLES.len()]),
        v4,
        v6,
        node,
    }))
}

/// The deletion of a model pod whose address is on node `node`'s subnets
/// (the last such pod by key, not one whose status lost its addresses):
/// what frees an address there for a forced [`Step::CniTimeout`].
pub fn free_one_on(model: &Snapshot, world: &World, node: u8, nodes: u8) -> Option<Step> {
    model
        .pods
        .keys()
        .rev()
        .map(|(n, p)| format!("{n}/{p}"))
        .find(|k| {
            !world.lost.contains(k)
                && addresses_of(model, k)
                    .is_some_and(|(_, v4, _)| crate::nodes::Nodes::owner_of(nodes, v4.octets()[2]) == node)
        })
        .map(|pod| Step::Model(Action::DeletePod(PodName { pod })))
}

/// The freed address of a deleted pod of `snapshot` (`ns/name`), if any.
pub fn addresses_of(snapshot: &Snapshot, pod: &str) -> Option<(String, Ipv4Addr, Ipv6Addr)> {
    let (ns, name) = pod.split_once('/')?;
    let p = snapshot.pods.get(&(ns.to_string(), name.to_string()))?;
    let v4 = p.ips.iter().find_map(|i| match i {
        IpAddr::V4(a) => Some(*a),
        _ => None,
    })?;
    let v6 = p.ips.iter().find_map(|i| match i {
        IpAddr::V6(a) => Some(*a),
        _ => None,
    })?;
    Some((ns.to_string(), v4, v6))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn a_seed_replays_the_same_steps() {
        let model = npm_sim::cases::Model::upstream();
        let run = |seed| {
            let mut rng = StdRng::seed_from_u64(seed);
            let mut w = World::default();
            (0..50)
                .map(|_| next_step(&mut rng, &model.snapshot, &mut w, 2).describe())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
    }

    #[test]
    fn the_schedule_changes_cluster_policies_the_model_accepts() {
        // Every drawn step that is a modelled action applies to the model
        // (a ClusterNetworkPolicy the conversion refuses would fail a live
        // soak), and ClusterNetworkPolicies are created, updated and
        // deleted, with distinct priorities.
        let mut model = npm_sim::cases::Model::upstream();
        let mut rng = StdRng::seed_from_u64(11);
        let mut w = World::default();
        let mut seen = BTreeMap::<&str, usize>::new();
        for _ in 0..600 {
            if let Step::Model(a) = next_step(&mut rng, &model.snapshot, &mut w, 2) {
                *seen.entry(a.name()).or_default() += 1;
                model.apply(&a).unwrap_or_else(|e| panic!("{}: {e}", a.name()));
            }
            let mut priorities: Vec<u32> = model.snapshot.cluster_policies.values().map(|p| p.priority).collect();
            let n = priorities.len();
            priorities.sort_unstable();
            priorities.dedup();
            assert_eq!(priorities.len(), n, "two ClusterNetworkPolicies share a priority");
            assert!(n <= MAX_CNPS);
        }
        for name in [
            "create_cluster_network_policy",
            "update_cluster_network_policy",
            "delete_cluster_network_policy",
        ] {
            assert!(
                seen.get(name).copied().unwrap_or(0) > 0,
                "no {name} in 600 steps: {seen:?}"
            );
        }
    }

    #[test]
    fn pods_lose_and_regain_their_addresses_in_the_oracle_snapshot() {
        // As the runner applies them: LoseIp adds to `lost`, RestoreIp and
        // a deletion remove; the oracle's snapshot has no address for a
        // lost pod, and its per-node view keeps the addresses.
        let mut model = npm_sim::cases::Model::upstream();
        let mut rng = StdRng::seed_from_u64(5);
        let mut w = World::default();
        let (mut lose, mut restore) = (0, 0);
        for _ in 0..600 {
            match next_step(&mut rng, &model.snapshot, &mut w, 2) {
                Step::LoseIp(p) => {
                    assert!(model.ip(&p).is_some(), "{p} is a model pod");
                    assert!(w.lost.insert(p), "a lost pod loses its addresses again");
                    lose += 1;
                }
                Step::RestoreIp(p) => {
                    assert!(w.lost.remove(&p), "{p} had not lost its addresses");
                    restore += 1;
                }
                Step::Model(a) => {
                    if let Action::DeletePod(p) = &a {
                        w.lost.remove(&p.pod);
                    }
                    model.apply(&a).unwrap_or_else(|e| panic!("{}: {e}", a.name()));
                }
                _ => {}
            }
            assert!(w.lost.len() <= MAX_LOST);
            let s = oracle_snapshot(&model.snapshot, &w);
            let kept = lost_pods(&model.snapshot, &w, 2);
            assert_eq!(kept.len(), w.lost.len());
            for (_, p) in &kept {
                assert!(!p.ips.is_empty());
                assert!(s.pods[&(p.namespace.clone(), p.name.clone())].ips.is_empty());
            }
        }
        assert!(lose > 0 && restore > 0, "lose {lose}, restore {restore} in 600 steps");
    }

    #[test]
    fn the_invalid_policy_isolates_in_the_oracle_snapshot() {
        let mut rng = StdRng::seed_from_u64(1);
        let model = npm_sim::cases::Model::upstream();
        let mut w = World::default();
        let np = invalid_policy(&mut rng, "x", "bad");
        w.invalid.insert(("x".into(), "bad".into()), np);
        let s = oracle_snapshot(&model.snapshot, &w);
        assert_eq!(s.invalid_policies.len(), 1);
        assert!(s.policies.contains_key(&("x".to_string(), "bad".to_string())));
    }
}
