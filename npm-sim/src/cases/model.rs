//! The pristine model the cases run on ([`Model::new`] of a [`Topology`];
//! [`Model::upstream`]: namespaces x, y, z with pods a, b, c), the actions
//! applied to it, and its probe matrices by the reference evaluator and the
//! compiled lookup.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::compiled::{CompileOptions, Direction};
use npm_policy::identity::PrefixTable;
use npm_policy::model::{ContainerPort, Labels, Namespace, Node, Pod, PodPhase, Protocol, Snapshot};

use super::{substitute, Action, CaseError, ClusterPolicyObject, Matrix, Topology, TopologyNode};

/// The node every model pod runs on.
pub const MODEL_NODE: &str = "npm-node";

/// The standard container ports of model pods: `serve-<port>-<proto>`.
pub fn model_container_ports() -> Vec<ContainerPort> {
    let mut v = Vec::new();
    for port in [80u16, 81] {
        for (p, n) in [(Protocol::Tcp, "tcp"), (Protocol::Udp, "udp"), (Protocol::Sctp, "sctp")] {
            v.push(ContainerPort {
                name: Some(format!("serve-{port}-{n}")),
                port,
                protocol: p,
            });
        }
    }
    v
}

/// The simulated cluster of the cases: a snapshot plus address allocation.
#[derive(Clone, Debug)]
pub struct Model {
    /// The cluster.
    pub snapshot: Snapshot,
    topology: Topology,
    ns_index: BTreeMap<String, u16>,
    pod_index: BTreeMap<String, u16>,
    next_ns: u16,
    clock: i64,
}

fn split_pod(s: &str) -> Result<(String, String), CaseError> {
    match s.split_once('/') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_string(), b.to_string())),
        _ => Err(CaseError::PodRef(s.to_string())),
    }
}

impl Model {
    /// The pristine upstream model: namespaces x, y, z (labels `ns=<name>`
    /// and `kubernetes.io/metadata.name`), pods a, b, c in each (label
    /// `pod=<name>`, the standard ports), IPv4 `198.18.<ns>.<pod>` and IPv6
    /// `fd00:198:18::<ns>:<pod>` (1-based), all on [`MODEL_NODE`].
    pub fn upstream() -> Model {
        Model::new(Topology::Xyz)
    }

    /// The pristine model of `topology`: its namespaces and pods (in
    /// order: namespace index from [`Topology::first_namespace_index`], pod
    /// index from 1), the topology's container ports, all on [`MODEL_NODE`].
    /// IPv4 `198.18.<ns>.<pod>`, IPv6 `fd00:198:18::<ns>:<pod>`.
    pub fn new(topology: Topology) -> Model {
        let mut m = Model {
            snapshot: Snapshot::default(),
            topology,
            ns_index: BTreeMap::new(),
            pod_index: BTreeMap::new(),
            next_ns: topology.first_namespace_index(),
            clock: 1_000,
        };
        let nodes = topology.nodes();
        for n in &nodes {
            m.snapshot.nodes.insert(
                n.name.clone(),
                Node {
                    name: n.name.clone(),
                    labels: n.labels.clone(),
                    addresses: n.addresses.to_vec(),
                },
            );
        }
        for ns in topology.namespaces() {
            m.create_namespace(&ns.name, &ns.labels).expect("fresh model");
            for (i, (p, labels)) in ns.pods.iter().enumerate() {
                if ns.host_network {
                    m.create_host_network_pod(&ns.name, p, labels, &nodes[i]);
                } else {
                    m.create_pod(&ns.name, p, labels).expect("fresh model");
                }
            }
        }
        m
    }

    /// A host-network pod of the topology on `node`: its addresses are the
    /// node's, it owns none of them (`host_network`).
    fn create_host_network_pod(&mut self, ns: &str, name: &str, labels: &Labels, node: &TopologyNode) {
        self.clock += 1;
        self.snapshot.upsert_pod(Pod {
            uid: format!("{ns}-{name}-{}", self.clock),
            namespace: ns.to_string(),
            name: name.to_string(),
            labels: labels.clone().into(),
            ips: node.addresses.to_vec(),
            node_name: Some(node.name.clone()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: true,
            ports: self.topology.host_network_container_ports(),
            created: self.clock,
        });
    }

    /// The topology the model was built from.
    pub fn topology(&self) -> Topology {
        self.topology
    }

    /// Compile options of the model's node (no node addresses).
    pub fn options() -> CompileOptions {
        CompileOptions {
            node_name: MODEL_NODE.to_string(),
            node_ips: vec![],
            allow_host_egress: false,
            report_new: false,
        }
    }

    /// Compile options of this model's node: [`Model::options`] with the
    /// addresses of the [`MODEL_NODE`] Node object when the topology has
    /// one (its host-network pods' node), as an agent there reads them.
    pub fn compile_options(&self) -> CompileOptions {
        let mut o = Model::options();
        if let Some(n) = self.snapshot.nodes.get(MODEL_NODE) {
            o.node_ips = n.addresses.clone();
        }
        o
    }

    /// Whether `pod` (`namespace/name`) is a host-network pod.
    pub fn is_host_network(&self, pod: &str) -> bool {
        split_pod(pod)
            .ok()
            .and_then(|k| self.snapshot.pods.get(&k))
            .is_some_and(|p| p.host_network)
    }

    /// A pod's IPv4 address.
    pub fn ip(&self, pod: &str) -> Option<IpAddr> {
        let (ns, name) = split_pod(pod).ok()?;
        self.snapshot
            .pods
            .get(&(ns, name))?
            .ips
            .iter()
            .find(|i| i.is_ipv4())
            .copied()
    }

    /// The pods, `ns/name`, sorted.
    pub fn pod_names(&self) -> Vec<String> {
        self.snapshot.pods.keys().map(|(n, p)| format!("{n}/{p}")).collect()
    }

    fn create_namespace(&mut self, ns: &str, labels: &Labels) -> Result<(), CaseError> {
        if self.snapshot.namespaces.contains_key(ns) {
            return Err(CaseError::Exists {
                action: "create_namespace",
                object: ns.to_string(),
            });
        }
        let mut l = labels.clone();
        if self.topology.adds_ns_label() {
            l.entry("ns".to_string()).or_insert_with(|| ns.to_string());
        }
        l.insert("kubernetes.io/metadata.name".to_string(), ns.to_string());
        self.snapshot.upsert_namespace(Namespace {
            name: ns.to_string(),
            labels: l,
        });
        if !self.ns_index.contains_key(ns) {
            self.ns_index.insert(ns.to_string(), self.next_ns);
            self.next_ns += 1;
        }
        Ok(())
    }

    fn create_pod(&mut self, ns: &str, name: &str, labels: &Labels) -> Result<(), CaseError> {
        let Some(nsi) = self
            .ns_index
            .get(ns)
            .copied()
            .filter(|_| self.snapshot.namespaces.contains_key(ns))
        else {
            return Err(CaseError::NoNamespace {
                action: "create_pod",
                namespace: ns.to_string(),
            });
        };
        let key = (ns.to_string(), name.to_string());
        if self.snapshot.pods.contains_key(&key) {
            return Err(CaseError::Exists {
                action: "create_pod",
                object: format!("{ns}/{name}"),
            });
        }
        let used: Vec<u16> = self
            .pod_index
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{ns}/")))
            .map(|(_, v)| *v)
            .collect();
        let pi = used.iter().max().map_or(1, |m| m + 1);
        self.pod_index.insert(format!("{ns}/{name}"), pi);
        self.clock += 1;
        let v4 = Ipv4Addr::new(198, 18, nsi as u8, pi as u8);
        let v6: Ipv6Addr = format!("fd00:198:18::{nsi}:{pi}").parse().expect("valid IPv6");
        self.snapshot.upsert_pod(Pod {
            uid: format!("{ns}-{name}-{}", self.clock),
            namespace: ns.to_string(),
            name: name.to_string(),
            labels: labels.clone().into(),
            ips: vec![IpAddr::V4(v4), IpAddr::V6(v6)],
            node_name: Some(MODEL_NODE.to_string()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: false,
            ports: self.topology.container_ports(),
            created: self.clock,
        });
        Ok(())
    }

    fn policy(&self, action: &'static str, np: &NetworkPolicy) -> Result<NetworkPolicy, CaseError> {
        let text = serde_yaml::to_string(np)?;
        if !text.contains("${") {
            return Ok(np.clone());
        }
        let text = substitute(&text, &|p| self.ip(p)).map_err(|e| CaseError::Placeholder {
            placeholder: action.to_string(),
            message: e.to_string(),
        })?;
        Ok(serde_yaml::from_str(&text)?)
    }

    /// The ClusterNetworkPolicy of an action with its placeholders resolved
    /// against the model's IPv4 addresses.
    pub fn resolve_cluster_policy(
        &self,
        action: &'static str,
        obj: &ClusterPolicyObject,
    ) -> Result<ClusterPolicyObject, CaseError> {
        let text = serde_yaml::to_string(&obj.0)?;
        if !text.contains("${") {
            return Ok(obj.clone());
        }
        let text = substitute(&text, &|p| self.ip(p)).map_err(|e| CaseError::Placeholder {
            placeholder: action.to_string(),
            message: e.to_string(),
        })?;
        Ok(ClusterPolicyObject(serde_yaml::from_str(&text)?))
    }

    fn has_cluster_policy(&self, name: &str) -> bool {
        self.snapshot.cluster_policies.contains_key(name)
    }

    /// Converts and stores a ClusterNetworkPolicy (npm-policy's conversion);
    /// one that is not fully understood is an error of the action (as an
    /// invalid NetworkPolicy is).
    fn upsert_cluster_policy(&mut self, action: &'static str, obj: &ClusterPolicyObject) -> Result<(), CaseError> {
        let text = serde_yaml::to_string(&obj.0)?;
        let conv = npm_policy::tiers::validate::convert_cluster_policy_yaml(&text).map_err(|e| {
            CaseError::ClusterPolicyObject {
                action,
                message: e.to_string(),
            }
        })?;
        let invalid = conv.invalid();
        self.snapshot.insert_cluster_policy(conv.policy, invalid.clone());
        match invalid {
            None => Ok(()),
            Some(e) => Err(CaseError::InvalidPolicy {
                action,
                errors: e.errors,
            }),
        }
    }

    fn remove_cluster_policy(&mut self, name: &str) {
        self.snapshot.remove_cluster_policy(name);
    }

    fn pod_mut(&mut self, action: &'static str, pod: &str) -> Result<&mut Pod, CaseError> {
        let key = split_pod(pod)?;
        self.snapshot.pods.get_mut(&key).ok_or_else(|| CaseError::NoPod {
            action,
            pod: pod.to_string(),
        })
    }

    fn ns_mut(&mut self, action: &'static str, ns: &str) -> Result<&mut Namespace, CaseError> {
        self.snapshot
            .namespaces
            .get_mut(ns)
            .ok_or_else(|| CaseError::NoNamespace {
                action,
                namespace: ns.to_string(),
            })
    }

    /// Applies one action.
    pub fn apply(&mut self, action: &Action) -> Result<(), CaseError> {
        let name = action.name();
        match action {
            Action::CreatePolicy(np) | Action::UpdatePolicy(np) => {
                let np = self.policy(name, np)?;
                self.snapshot.upsert_policy(&np).map_err(|e| CaseError::InvalidPolicy {
                    action: name,
                    errors: e.errors,
                })?;
            }
            Action::DeletePolicy(o) => self.snapshot.remove_policy(&o.namespace, &o.name),
            Action::DeleteAllPolicies(_) => {
                self.snapshot.policies.clear();
                self.snapshot.invalid_policies.clear();
            }
            Action::AddNamespaceLabels(a) => self.ns_mut(name, &a.namespace)?.labels.extend(a.labels.clone()),
            Action::SetNamespaceLabels(a) => {
                let ns = self.ns_mut(name, &a.namespace)?;
                ns.labels = a.labels.clone();
                ns.labels
                    .insert("kubernetes.io/metadata.name".to_string(), a.namespace.clone());
            }
            Action::AddPodLabels(a) => self.pod_mut(name, &a.pod)?.labels.extend(a.labels.clone()),
            Action::SetPodLabels(a) => self.pod_mut(name, &a.pod)?.labels = a.labels.clone().into(),
            Action::CreatePod(a) => {
                let (ns, p) = split_pod(&a.pod)?;
                self.create_pod(&ns, &p, &a.labels)?;
            }
            Action::DeletePod(a) => {
                let (ns, p) = split_pod(&a.pod)?;
                self.snapshot.remove_pod(&ns, &p).ok_or_else(|| CaseError::NoPod {
                    action: name,
                    pod: a.pod.clone(),
                })?;
            }
            Action::CreateNamespace(a) => self.create_namespace(&a.namespace, &a.labels)?,
            Action::CreateClusterNetworkPolicy(o) | Action::UpdateClusterNetworkPolicy(o) => {
                let exists = self.has_cluster_policy(o.name());
                match action {
                    Action::CreateClusterNetworkPolicy(_) if exists => {
                        return Err(CaseError::Exists {
                            action: name,
                            object: format!("ClusterNetworkPolicy {}", o.name()),
                        })
                    }
                    Action::UpdateClusterNetworkPolicy(_) if !exists => {
                        return Err(CaseError::ClusterPolicyObject {
                            action: name,
                            message: format!("ClusterNetworkPolicy {:?} does not exist", o.name()),
                        })
                    }
                    _ => {}
                }
                let o = self.resolve_cluster_policy(name, o)?;
                self.upsert_cluster_policy(name, &o)?;
            }
            Action::DeleteClusterNetworkPolicy(o) => {
                if !self.has_cluster_policy(&o.name) {
                    return Err(CaseError::ClusterPolicyObject {
                        action: name,
                        message: format!("ClusterNetworkPolicy {:?} does not exist", o.name),
                    });
                }
                self.remove_cluster_policy(&o.name);
            }
            Action::DeleteNamespace(a) => {
                self.snapshot
                    .remove_namespace(&a.namespace)
                    .ok_or_else(|| CaseError::NoNamespace {
                        action: name,
                        namespace: a.namespace.clone(),
                    })?;
                self.snapshot.pods.retain(|(ns, _), _| ns != &a.namespace);
                self.snapshot.policies.retain(|(ns, _), _| ns != &a.namespace);
                self.snapshot.invalid_policies.retain(|p| p.namespace != a.namespace);
            }
        }
        Ok(())
    }

    /// The matrix of a probe computed by the reference evaluator and, for
    /// the same cells, by [`npm_policy::lookup::lookup`] on the compiled form
    /// (both ends: the source's egress and the destination's ingress).
    /// Returns (evaluator, compiled). Rows are the probe's sources that
    /// exist; pods of `pods` that do not exist are skipped.
    pub fn probe(&self, sources: &[String], pods: &[String], protocol: Protocol, port: u16) -> (Matrix, Matrix) {
        let opts = self.compile_options();
        let compiled = npm_policy::compile(&self.snapshot, &opts, None);
        let table = PrefixTable::new(&compiled.cidrs);
        let ep_of = |pod: &str| {
            compiled
                .endpoints
                .iter()
                .find(|(_, e)| format!("{}/{}", e.pod.namespace, e.pod.name) == pod)
                .map(|(id, _)| *id)
        };
        // An endpoint's side of a flow with `peer`, as the datapath decides
        // it; a pod without an endpoint allows.
        let allows = |ep: Option<u32>, dir: Direction, peer: IpAddr| {
            ep.is_none_or(|e| {
                npm_policy::lookup::lookup_with(&compiled, Some(&table), e, dir, peer, protocol.number(), port).allowed
            })
        };
        let rows: Vec<String> = sources.iter().filter(|s| self.ip(s).is_some()).cloned().collect();
        let cols: Vec<String> = pods.iter().filter(|s| self.ip(s).is_some()).cloned().collect();
        let mut ev = Vec::new();
        let mut co = Vec::new();
        for r in &rows {
            let src = self.ip(r).expect("filtered");
            let (mut er, mut cr) = (Vec::new(), Vec::new());
            for c in &cols {
                let dst = self.ip(c).expect("filtered");
                let flow = npm_policy::evaluate::Flow {
                    src,
                    dst,
                    protocol: protocol.number(),
                    dst_port: port,
                };
                er.push(npm_policy::evaluate::evaluate(&self.snapshot, &opts, &flow).allowed);
                let eg = allows(ep_of(r), Direction::Egress, dst);
                let ing = allows(ep_of(c), Direction::Ingress, src);
                cr.push(eg && ing);
            }
            ev.push(er);
            co.push(cr);
        }
        (
            Matrix {
                rows: rows.clone(),
                columns: cols.clone(),
                cells: ev,
            },
            Matrix {
                rows,
                columns: cols,
                cells: co,
            },
        )
    }
}
