//! The model-to-cluster step of the live runner: the live objects and
//! netns pods follow the runner's [`Model`] (the pristine model before each
//! case, then each action applied to both).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use npm_sim::cases::{self, Action, Model, Topology};
use serde_json::{json, Value};

use super::{api_err, LiveRunner};
use crate::api::{namespace_path, pod_path, policy_path};
use crate::runner::{remap_cidr_placeholders_v6, KubeProxyMode, RunnerError};

fn model_pod_ip(model: &Model, pod: &str, v6: bool) -> Option<IpAddr> {
    let (ns, name) = pod.split_once('/')?;
    model
        .snapshot
        .pods
        .get(&(ns.to_string(), name.to_string()))?
        .ips
        .iter()
        .find(|i| i.is_ipv6() == v6)
        .copied()
}

impl LiveRunner {
    pub(super) fn create_namespace_obj(&self, ns: &str, labels: &BTreeMap<String, String>) -> Result<(), RunnerError> {
        self.api
            .create(
                "/api/v1/namespaces",
                &json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}),
            )
            .map_err(api_err)?;
        Ok(())
    }

    /// Creates the netns of `ns/name` at the address `model` gives it and
    /// publishes the pod.
    pub(super) fn create_pod_live(&mut self, model: &Model, ns: &str, name: &str) -> Result<(), RunnerError> {
        let key = format!("{ns}/{name}");
        let pod = model
            .snapshot
            .pods
            .get(&(ns.to_string(), name.to_string()))
            .ok_or_else(|| RunnerError::Action {
                action: "create_pod",
                message: format!("pod {key} is not in the model"),
            })?
            .clone();
        if pod.host_network {
            return self.create_host_network_pod_live(model, &pod);
        }
        let v4 = pod.ips.iter().find_map(|i| match i {
            IpAddr::V4(a) => Some(*a),
            _ => None,
        });
        let v6 = pod.ips.iter().find_map(|i| match i {
            IpAddr::V6(a) => Some(*a),
            _ => None,
        });
        let (v4, v6): (Ipv4Addr, Ipv6Addr) = match (v4, v6) {
            (Some(a), Some(b)) => (a, b),
            _ => {
                return Err(RunnerError::Action {
                    action: "create_pod",
                    message: format!("model pod {key} lacks an IPv4 or IPv6 address"),
                })
            }
        };
        self.serve_topology_ports(model);
        if self.opts.multi_node() {
            let served = model.topology().served_ports();
            return self.create_pod_on_node(&pod, v4, v6, &served);
        }
        self.cluster.create_pod_at(ns, name, v4, v6)?;
        let obj = super::cnp::model_pod_object(
            ns,
            name,
            &pod.labels,
            cases::MODEL_NODE,
            &[IpAddr::V4(v4), IpAddr::V6(v6)],
            &pod.ports,
        );
        self.api
            .create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
            .map_err(api_err)?;
        Ok(())
    }

    /// Creates host-network pod `pod` of `model`: on the one-node cluster
    /// its only node; with nodes, model node `k` (1 = the node of every
    /// other model pod) becomes the `k-1`th node after the one hosting the
    /// topology's first namespace (the houses: gryffindor's node for
    /// `centaur-0`, the next one for `centaur-1`, so both a same-node and a
    /// cross-node path are probed on several nodes). Its address is that
    /// node's, its servers the node's; no CNI. With a kube-proxy it gets
    /// its per-pod Service too, whose backend is then on a node's host
    /// network (the shape of `kubernetes.default` on k3s and kind): a
    /// client on the same node reaches it by local delivery, one on
    /// another node through that node's uplink.
    fn create_host_network_pod_live(&mut self, model: &Model, pod: &npm_policy::model::Pod) -> Result<(), RunnerError> {
        let topo = model.topology();
        let k = topo
            .nodes()
            .iter()
            .position(|n| pod.node_name.as_deref() == Some(n.name.as_str()))
            .unwrap_or(0) as u8;
        let node = self.cluster.nodes().map(|nodes| {
            let count = nodes.nodes().len().max(1) as u8;
            let base = crate::nodes::Nodes::owner_of(count, topo.first_namespace_index() as u8);
            ((base - 1 + k) % count) + 1
        });
        let ports = topo.host_network_served_ports();
        let p = self
            .cluster
            .create_host_network_pod(&pod.namespace, &pod.name, node, &ports)?;
        let ips = [IpAddr::V4(p.ipv4), IpAddr::V6(p.ipv6)];
        let node_name = p.node.clone().unwrap_or_else(|| cases::MODEL_NODE.to_string());
        let labels = self.live_labels(&pod.labels, &pod.name);
        let obj = super::cnp::host_network_pod_object(&pod.namespace, &pod.name, &labels, &node_name, &ips, &pod.ports);
        self.api
            .create(&format!("/api/v1/namespaces/{}/pods", pod.namespace), &obj)
            .map_err(api_err)?;
        if self.opts.kube_proxy != KubeProxyMode::None {
            let before = self.plumbing.generations();
            self.create_service(&pod.namespace, &pod.name, &ports)?;
            self.wait_service_programmed(&pod.namespace, &pod.name, &before)?;
        }
        Ok(())
    }

    fn delete_pod_live(&mut self, ns: &str, name: &str) -> Result<(), RunnerError> {
        self.delete_service(ns, name)?;
        self.api.delete(&pod_path(ns, name)).map_err(api_err)?;
        if self.cluster.pod(ns, name).is_some() {
            self.cluster.delete_pod(ns, name)?;
        }
        Ok(())
    }

    /// Brings the live cluster back to the pristine x, y, z model.
    pub fn reset(&mut self) -> Result<(), RunnerError> {
        self.reset_to(Topology::Xyz)
    }

    /// Brings the live cluster to the pristine model of `topology`: every
    /// NetworkPolicy and ClusterNetworkPolicy deleted, namespaces and pods
    /// of other topologies deleted, the topology's created (at their model
    /// addresses, serving its ports) or relabelled.
    ///
    /// After a failed action or reset the runner no longer knows what is
    /// live: this reset then first deletes every namespace the API server
    /// lists (but `default` and `kube-*`), every pod of the netns cluster
    /// and their Services, and builds the topology from nothing, so one
    /// failure does not fail every case after it.
    pub fn reset_to(&mut self, topology: Topology) -> Result<(), RunnerError> {
        let from_scratch = self.stale;
        self.stale = true;
        self.api.delete_all_policies().map_err(api_err)?;
        self.delete_all_cluster_policies()?;
        let pristine = Model::new(topology);
        let mut cur = self.model.clone();
        if from_scratch {
            self.clear_live()?;
            cur.snapshot.namespaces.clear();
            cur.snapshot.pods.clear();
        }
        // Extra namespaces (with their pods).
        for ns in cur.snapshot.namespaces.keys() {
            if !pristine.snapshot.namespaces.contains_key(ns) {
                self.api.delete(&namespace_path(ns)).map_err(api_err)?;
                let pods: Vec<String> = self
                    .cluster
                    .pods()
                    .filter(|p| &p.namespace == ns)
                    .map(|p| p.name.clone())
                    .collect();
                for p in pods {
                    self.delete_service(ns, &p)?;
                    self.cluster.delete_pod(ns, &p)?;
                }
            }
        }
        // Pods that are extra or at another address.
        for (k, pod) in &cur.snapshot.pods {
            if !pristine.snapshot.namespaces.contains_key(&k.0) {
                continue;
            }
            let keep = pristine.snapshot.pods.get(k).is_some_and(|p| p.ips == pod.ips);
            if !keep {
                self.delete_pod_live(&k.0, &k.1)?;
            }
        }
        // Namespaces: missing or with other labels.
        for (name, ns) in &pristine.snapshot.namespaces {
            match cur.snapshot.namespaces.get(name) {
                None => self.create_namespace_obj(name, &ns.labels)?,
                Some(c) if c.labels != ns.labels => self
                    .api
                    .set_labels(&namespace_path(name), &ns.labels)
                    .map_err(api_err)?,
                Some(_) => {}
            }
        }
        // Pods: missing or with other labels.
        for (k, pod) in &pristine.snapshot.pods {
            let live = cur.snapshot.pods.get(k).filter(|p| p.ips == pod.ips);
            let ns_was_deleted = !cur.snapshot.namespaces.contains_key(&k.0);
            match live {
                Some(c) if !ns_was_deleted => {
                    if c.labels != pod.labels {
                        let labels = self.live_labels(&pod.labels, &k.1);
                        self.api.set_labels(&pod_path(&k.0, &k.1), &labels).map_err(api_err)?;
                    }
                }
                _ => {
                    if self.cluster.pod(&k.0, &k.1).is_some() {
                        self.delete_service(&k.0, &k.1)?;
                        self.cluster.delete_pod(&k.0, &k.1)?;
                    }
                    self.create_pod_live(&pristine, &k.0, &k.1)?;
                }
            }
        }
        self.model = pristine;
        self.stale = false;
        Ok(())
    }

    /// Deletes every namespace the API server lists but `default` and
    /// `kube-*` (with their pods), every pod of the netns cluster and
    /// every per-pod Service.
    fn clear_live(&mut self) -> Result<(), RunnerError> {
        let list = self.api.get("/api/v1/namespaces").map_err(api_err)?;
        for item in list["items"].as_array().cloned().unwrap_or_default() {
            let Some(name) = item["metadata"]["name"].as_str() else {
                continue;
            };
            if name != "default" && !name.starts_with("kube-") {
                self.api.delete(&namespace_path(name)).map_err(api_err)?;
            }
        }
        let services: Vec<(String, String)> = self.services.keys().cloned().collect();
        for (ns, pod) in services {
            self.delete_service(&ns, &pod)?;
        }
        let pods: Vec<(String, String)> = self
            .cluster
            .pods()
            .map(|p| (p.namespace.clone(), p.name.clone()))
            .collect();
        for (ns, pod) in pods {
            self.cluster.delete_pod(&ns, &pod)?;
        }
        Ok(())
    }

    pub(super) fn policy_json(&self, action: &'static str, np: &impl serde::Serialize) -> Result<Value, RunnerError> {
        let v = serde_json::to_value(np).map_err(|e| RunnerError::Action {
            action,
            message: format!("serialising the policy: {e}"),
        })?;
        let text = v.to_string();
        if !text.contains("${") {
            return Ok(v);
        }
        let v6 = self.opts.ipv6;
        let text = if v6 { remap_cidr_placeholders_v6(&text) } else { text };
        let model = &self.model;
        let sub = cases::substitute(&text, &|p| model_pod_ip(model, p, v6)).map_err(|e| RunnerError::Action {
            action,
            message: e.to_string(),
        })?;
        serde_json::from_str(&sub).map_err(|e| RunnerError::Action {
            action,
            message: format!("policy after substitution: {e}"),
        })
    }

    /// Applies one action to the live cluster (and to the runner's model).
    /// A failed action leaves the live cluster unknown: the next reset
    /// starts from a clean slate.
    pub fn apply(&mut self, action: &Action) -> Result<(), RunnerError> {
        let r = self.apply_action(action);
        if r.is_err() {
            self.stale = true;
        }
        r
    }

    fn apply_action(&mut self, action: &Action) -> Result<(), RunnerError> {
        let name = action.name();
        let aerr = |e: cases::CaseError| RunnerError::Action {
            action: name,
            message: e.to_string(),
        };
        match action {
            Action::CreatePolicy(np) | Action::UpdatePolicy(np) => {
                let mut v = self.policy_json(name, np)?;
                if v.get("apiVersion").is_none() {
                    v["apiVersion"] = json!("networking.k8s.io/v1");
                    v["kind"] = json!("NetworkPolicy");
                }
                self.api
                    .apply_policy(&v, matches!(action, Action::UpdatePolicy(_)))
                    .map_err(api_err)?;
                // The model gets the placeholder-resolved policy too (it
                // resolves IPv4 placeholders itself).
                self.model.apply(action).map_err(aerr)?;
            }
            Action::DeletePolicy(o) => {
                self.api.delete(&policy_path(&o.namespace, &o.name)).map_err(api_err)?;
                self.model.apply(action).map_err(aerr)?;
            }
            Action::DeleteAllPolicies(_) => {
                self.api.delete_all_policies().map_err(api_err)?;
                self.model.apply(action).map_err(aerr)?;
            }
            Action::AddNamespaceLabels(a) | Action::SetNamespaceLabels(a) => {
                self.model.apply(action).map_err(aerr)?;
                let labels = self.model.snapshot.namespaces[&a.namespace].labels.clone();
                self.api
                    .set_labels(&namespace_path(&a.namespace), &labels)
                    .map_err(api_err)?;
            }
            Action::AddPodLabels(a) | Action::SetPodLabels(a) => {
                self.model.apply(action).map_err(aerr)?;
                let (ns, p) = a.pod.split_once('/').unwrap_or(("", ""));
                let labels = self.model.snapshot.pods[&(ns.to_string(), p.to_string())]
                    .labels
                    .clone();
                let labels = self.live_labels(&labels, p);
                self.api.set_labels(&pod_path(ns, p), &labels).map_err(api_err)?;
            }
            Action::CreatePod(a) => {
                self.model.apply(action).map_err(aerr)?;
                let (ns, p) = a.pod.split_once('/').unwrap_or(("", ""));
                let model = self.model.clone();
                self.create_pod_live(&model, ns, p)?;
            }
            Action::DeletePod(a) => {
                self.model.apply(action).map_err(aerr)?;
                let (ns, p) = a.pod.split_once('/').unwrap_or(("", ""));
                self.delete_pod_live(ns, p)?;
            }
            Action::CreateNamespace(a) => {
                self.model.apply(action).map_err(aerr)?;
                let labels = self.model.snapshot.namespaces[&a.namespace].labels.clone();
                self.create_namespace_obj(&a.namespace, &labels)?;
            }
            Action::CreateClusterNetworkPolicy(o) | Action::UpdateClusterNetworkPolicy(o) => {
                // The model first: it checks existence and validity, so an
                // action the case gets wrong fails with the model's error.
                self.model.apply(action).map_err(aerr)?;
                let update = matches!(action, Action::UpdateClusterNetworkPolicy(_));
                self.apply_cluster_policy(name, o, update)?;
            }
            Action::DeleteClusterNetworkPolicy(o) => {
                self.model.apply(action).map_err(aerr)?;
                self.delete_cluster_policy(&o.name)?;
            }
            Action::DeleteNamespace(a) => {
                self.model.apply(action).map_err(aerr)?;
                self.api.delete(&namespace_path(&a.namespace)).map_err(api_err)?;
                let pods: Vec<String> = self
                    .cluster
                    .pods()
                    .filter(|p| p.namespace == a.namespace)
                    .map(|p| p.name.clone())
                    .collect();
                for p in pods {
                    self.delete_service(&a.namespace, &p)?;
                    self.cluster.delete_pod(&a.namespace, &p)?;
                }
            }
        }
        Ok(())
    }
}
