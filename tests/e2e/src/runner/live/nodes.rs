//! The live runner on several nodes ([`crate::nodes`]): the test API
//! server on the fabric's control address, one Node object and one agent
//! per node (in the node's netns and mount namespace), pods on the node
//! that owns their namespace's subnet (hand-made veths, or the CNI chain
//! called as a runtime calls it: the Pod object first, scheduled and
//! without an IP, then ADD, then its status IPs), and the upstream model's
//! per-pod Services `s-<ns>-<pod>`.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;

use npm_sim::cases::{self, Model};
use serde_json::{json, Value};

use super::agent::AgentSpec;
use super::{api_err, LiveRunner};
use crate::api::{pod_object, pod_path};
use crate::cluster::{Cluster, PodWiring};
use crate::cni;
use crate::nodes::{ns_subnet_v4, ns_subnet_v6, Nodes, CONTROL_V4, MAX_NS_INDEX};
use crate::runner::{CniMode, Destination, KubeProxyMode, Options, RunnerError};

/// The label every live pod carries in Service mode: its Service's
/// selector (`npm-e2e/pod: <name>`). No case selects on this key, so it
/// changes no verdict; the model's own `pod` label may be changed by a
/// case.
pub const SERVICE_LABEL: &str = "npm-e2e/pod";

/// The agents' metrics port on their node address.
pub(super) const NODE_METRICS_PORT: u16 = 9090;

/// The labels of a Node object: a kubelet's `kubernetes.io/hostname` and
/// `kubernetes.io/os: linux` (the upstream node-peer tests select nodes by
/// the latter).
fn node_labels(name: &str) -> Value {
    json!({"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"})
}

/// The per-pod Service name of the upstream model.
pub fn service_name(ns: &str, pod: &str) -> String {
    format!("s-{ns}-{pod}")
}

impl LiveRunner {
    /// Starts the multi-node cluster: nodes and fabric, the API server on
    /// the control address, Node objects, the agents, then the pristine
    /// model's namespaces and pods (after the agents: npm-cni's ADD waits
    /// for the node's agent).
    pub(super) fn start_multi(opts: Options) -> Result<Self, RunnerError> {
        if opts.destination == Destination::Service && opts.kube_proxy == KubeProxyMode::None {
            return Err(RunnerError::Options(
                "--destination service needs a kube-proxy (--kube-proxy iptables|nftables)".into(),
            ));
        }
        let pid = std::process::id();
        let wiring = match opts.cni {
            CniMode::Veth => PodWiring::Veth,
            CniMode::Ptp => PodWiring::Cni(cni::Wiring::Ptp),
            CniMode::Bridge => PodWiring::Cni(cni::Wiring::Bridge),
        };
        let npm_cni = std::fs::canonicalize(&opts.npm_cni_bin).unwrap_or_else(|_| opts.npm_cni_bin.clone());
        let cluster = Cluster::with_nodes(opts.nodes, opts.fabric, wiring, &npm_cni)?;
        let (server, api, workdir, kubeconfig) = super::start_api_server(npm_testapi::Options {
            listen: SocketAddr::from((CONTROL_V4, 0)),
            ..npm_testapi::Options::default()
        })?;
        let mut r = LiveRunner {
            opts,
            agents: Vec::new(),
            plumbing: Default::default(),
            services: BTreeMap::new(),
            cluster,
            api,
            server: Some(server),
            model: Model::upstream(),
            stale: false,
            workdir,
            pin_dir: PathBuf::from(format!("/sys/fs/bpf/npm-conformance-{pid}")),
            nft_table: format!("npmconf{pid}"),
            first_probe: true,
        };
        r.register_nodes()?;
        let pristine = Model::upstream();
        for ns in pristine.snapshot.namespaces.values() {
            r.create_namespace_obj(&ns.name, &ns.labels)?;
        }
        if let Some(server) = &r.server {
            r.opts.preload.apply(server)?;
        }
        r.start_node_agents(&kubeconfig)?;
        r.start_services()?;
        for pod in pristine.snapshot.pods.values() {
            r.create_pod_live(&pristine, &pod.namespace, &pod.name)?;
        }
        r.model = pristine;
        Ok(r)
    }

    /// One Node object per node, with its addresses and pod CIDRs.
    fn register_nodes(&self) -> Result<(), RunnerError> {
        let Some(nodes) = self.cluster.nodes() else {
            return Ok(());
        };
        let count = nodes.nodes().len() as u8;
        for node in nodes.nodes() {
            let mut cidrs = Vec::new();
            for n in (1..=MAX_NS_INDEX).filter(|n| Nodes::owner_of(count, *n) == node.index) {
                cidrs.push(ns_subnet_v4(n));
                cidrs.push(ns_subnet_v6(n));
            }
            let addresses = json!([
                {"type": "InternalIP", "address": node.ipv4.to_string()},
                {"type": "InternalIP", "address": node.ipv6.to_string()},
                {"type": "Hostname", "address": node.name},
            ]);
            let obj = json!({
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": node.name, "labels": node_labels(&node.name)},
                "spec": {"podCIDR": cidrs[0], "podCIDRs": [cidrs[0], cidrs[1]]},
                "status": {"addresses": addresses},
            });
            let created = self.api.create("/api/v1/nodes", &obj).map_err(api_err)?;
            if created["status"]["addresses"] != obj["status"]["addresses"] {
                let mut o = created.clone();
                o["status"] = obj["status"].clone();
                self.api
                    .replace(&format!("/api/v1/nodes/{}/status", node.name), &o)
                    .map_err(api_err)?;
            }
        }
        Ok(())
    }

    /// The one-node cluster's Node object ([`cases::MODEL_NODE`]): its
    /// InternalIPs are the addresses of the root netns' node
    /// interface (`cluster/host_network.rs`, created here, before the
    /// agent starts), which the agent reads as this node's; its labels are
    /// a kubelet's (what a ClusterNetworkPolicy `nodes` peer selects).
    pub(super) fn register_single_node(&mut self) -> Result<(), RunnerError> {
        let (v4, v6) = self.cluster.host_address(None)?;
        let obj = json!({
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {"name": cases::MODEL_NODE, "labels": node_labels(cases::MODEL_NODE)},
            "status": {"addresses": [
                {"type": "InternalIP", "address": v4.to_string()},
                {"type": "InternalIP", "address": v6.to_string()},
                {"type": "Hostname", "address": cases::MODEL_NODE},
            ]},
        });
        let created = self.api.create("/api/v1/nodes", &obj).map_err(api_err)?;
        if created["status"]["addresses"] != obj["status"]["addresses"] {
            let mut o = created.clone();
            o["status"] = obj["status"].clone();
            self.api
                .replace(&format!("/api/v1/nodes/{}/status", cases::MODEL_NODE), &o)
                .map_err(api_err)?;
        }
        Ok(())
    }

    /// One agent per node, in the node's netns and mount namespace, each
    /// with its own NODE_NAME, pin directory and nftables table (its
    /// `/run/npm`: CNI socket and lock, is the node's); all waited for.
    fn start_node_agents(&mut self, kubeconfig: &std::path::Path) -> Result<(), RunnerError> {
        let pid = std::process::id();
        let mut started = Vec::new();
        if let Some(nodes) = self.cluster.nodes() {
            for node in nodes.nodes() {
                let pin_dir = self.node_pin_dir(node.index, false);
                let table = format!("npmconf{pid}n{}", node.index);
                let agent = self.spawn_agent(
                    kubeconfig,
                    AgentSpec {
                        node_name: &node.name,
                        node: Some(node),
                        pin_dir: &pin_dir,
                        nft_table: &table,
                        metrics: SocketAddr::new(IpAddr::V4(node.ipv4), NODE_METRICS_PORT),
                        log: self.workdir.join(format!("agent-{}.log", node.name)),
                    },
                )?;
                started.push(agent);
            }
        }
        for agent in started {
            let agent = self.wait_ready(agent)?;
            self.agents.push(agent);
        }
        Ok(())
    }

    /// The labels a live pod carries: the model's, plus the Service
    /// selector label when a kube-proxy runs.
    pub(super) fn live_labels(&self, labels: &BTreeMap<String, String>, pod: &str) -> BTreeMap<String, String> {
        let mut l = labels.clone();
        if self.opts.kube_proxy != KubeProxyMode::None {
            l.insert(SERVICE_LABEL.to_string(), pod.to_string());
        }
        l
    }

    /// Creates model pod `pod` on its node at the model's addresses, its
    /// Service (with a kube-proxy) on the `served` ports.
    pub(super) fn create_pod_on_node(
        &mut self,
        pod: &npm_policy::model::Pod,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        served: &[u16],
    ) -> Result<(), RunnerError> {
        self.create_pod_on(pod, v4, v6, served, None)
    }

    /// As [`LiveRunner::create_pod_on_node`], on node `on` (1-based) when
    /// given (CNI wiring only), else on the node owning the address's
    /// subnet.
    pub(super) fn create_pod_on(
        &mut self,
        pod: &npm_policy::model::Pod,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        served: &[u16],
        on: Option<u8>,
    ) -> Result<(), RunnerError> {
        let (ns, name, ports) = (pod.namespace.as_str(), pod.name.as_str(), &pod.ports);
        let node = match on {
            Some(k) => self.cluster.nodes().and_then(|n| n.node(k)).map(|n| n.name.clone()),
            None => self.cluster.node_name_for(v4),
        }
        .unwrap_or_default();
        let labels = self.live_labels(&pod.labels, name);
        let ips = [IpAddr::V4(v4), IpAddr::V6(v6)];
        match self.cluster.wiring() {
            PodWiring::Veth => {
                self.cluster.create_pod_at(ns, name, v4, v6)?;
                let obj = super::cnp::model_pod_object(ns, name, &labels, &node, &ips, ports);
                self.api
                    .create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
                    .map_err(api_err)?;
            }
            PodWiring::Cni(_) => {
                // As the kubelet: the Pod exists, scheduled, without an IP.
                let mut obj = super::cnp::model_pod_object(ns, name, &labels, &node, &[], ports);
                obj["status"] = json!({"phase": "Pending"});
                let created = self
                    .api
                    .create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
                    .map_err(api_err)?;
                let uid = created["metadata"]["uid"].as_str().unwrap_or_default().to_string();
                if let Err(e) = self.cluster.create_pod_cni_on(ns, name, v4, v6, &uid, on) {
                    let _ = self.api.delete(&pod_path(ns, name));
                    return Err(e.into());
                }
                let status = json!({"status": {
                    "phase": "Running",
                    "podIP": v4.to_string(),
                    "podIPs": [{"ip": v4.to_string()}, {"ip": v6.to_string()}],
                }});
                self.api
                    .merge_patch(&format!("{}/status", pod_path(ns, name)), &status)
                    .map_err(api_err)?;
            }
        }
        if self.opts.kube_proxy != KubeProxyMode::None {
            let before = self.plumbing.generations();
            self.create_service(ns, name, served)?;
            self.wait_service_programmed(ns, name, &before)?;
        }
        Ok(())
    }

    /// Creates a pod the model does not know (for tests): hand-made veth on
    /// node `node` (1-based) at `v4`/`v6`, published with `labels`; its
    /// address is routed to that node even when another node owns its
    /// subnet. [`LiveRunner::reset`] does not remove it: delete it with
    /// [`LiveRunner::delete_unmodelled_pod`].
    pub fn create_unmodelled_pod(
        &mut self,
        ns: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        node: u8,
    ) -> Result<(), RunnerError> {
        let node_name = self
            .cluster
            .nodes()
            .and_then(|n| n.node(node))
            .map(|n| n.name.clone())
            .ok_or_else(|| RunnerError::Options(format!("no node {node}")))?;
        self.cluster.create_pod_at_node(ns, name, v4, v6, Some(node))?;
        let obj = pod_object(ns, name, labels, &node_name, &[IpAddr::V4(v4), IpAddr::V6(v6)]);
        self.api
            .create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
            .map_err(api_err)?;
        Ok(())
    }

    /// Deletes a pod made by [`LiveRunner::create_unmodelled_pod`] or
    /// [`LiveRunner::create_unmodelled_pod_wired`], with its Service (the
    /// latter has one when a kube-proxy runs).
    pub fn delete_unmodelled_pod(&mut self, ns: &str, name: &str) -> Result<(), RunnerError> {
        self.delete_service(ns, name)?;
        self.api.delete(&pod_path(ns, name)).map_err(api_err)?;
        self.cluster.delete_pod(ns, name)?;
        Ok(())
    }

    /// The per-pod Service `s-<ns>-<pod>`: dual-stack, one port per served
    /// port (the topology's) and protocol, selecting the pod by
    /// [`SERVICE_LABEL`].
    pub(super) fn create_service(&mut self, ns: &str, pod: &str, served: &[u16]) -> Result<(), RunnerError> {
        let mut ports = Vec::new();
        for &port in served {
            for proto in ["TCP", "UDP", "SCTP"] {
                ports.push(json!({
                    "name": format!("serve-{port}-{}", proto.to_ascii_lowercase()),
                    "port": port,
                    "targetPort": port,
                    "protocol": proto,
                }));
            }
        }
        let obj = json!({
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"namespace": ns, "name": service_name(ns, pod)},
            "spec": {
                "type": "ClusterIP",
                "selector": {SERVICE_LABEL: pod},
                "ipFamilyPolicy": "RequireDualStack",
                "ipFamilies": ["IPv4", "IPv6"],
                "ports": ports,
            },
        });
        let created = self
            .api
            .create(&format!("/api/v1/namespaces/{ns}/services"), &obj)
            .map_err(api_err)?;
        let ips: Vec<IpAddr> = created["spec"]["clusterIPs"]
            .as_array()
            .map(|a| a.iter().filter_map(|v| v.as_str()?.parse().ok()).collect())
            .unwrap_or_default();
        if ips.is_empty() {
            return Err(RunnerError::Action {
                action: "create_service",
                message: format!("service {} got no clusterIPs: {created}", service_name(ns, pod)),
            });
        }
        self.services.insert((ns.to_string(), pod.to_string()), ips);
        Ok(())
    }

    /// Deletes the pod's Service (if any).
    pub(super) fn delete_service(&mut self, ns: &str, pod: &str) -> Result<(), RunnerError> {
        if self.services.remove(&(ns.to_string(), pod.to_string())).is_some() {
            let path = format!("/api/v1/namespaces/{ns}/services/{}", service_name(ns, pod));
            match self.api.delete(&path) {
                Ok(()) => {}
                Err(crate::api::ApiError::Status { status: 404, .. }) => {}
                Err(e) => return Err(api_err(e)),
            }
        }
        Ok(())
    }

    /// The ClusterIP of pod `ns/name`'s Service of the given family.
    pub fn service_ip(&self, ns: &str, name: &str, ipv6: bool) -> Option<IpAddr> {
        self.services
            .get(&(ns.to_string(), name.to_string()))?
            .iter()
            .find(|i| i.is_ipv6() == ipv6)
            .copied()
    }

    /// The current object of pod `ns/name` (for tests).
    pub fn pod_object(&self, ns: &str, name: &str) -> Result<Value, RunnerError> {
        self.api.get(&pod_path(ns, name)).map_err(api_err)
    }
}
