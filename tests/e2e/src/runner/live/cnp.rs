//! ClusterNetworkPolicies and topologies in the live runner: the case
//! actions `create_/update_/delete_cluster_network_policy` as REST calls on
//! `policy.networking.k8s.io/v1alpha2` `clusternetworkpolicies` (the test
//! API server serves them once the CRD is installed: the runner starts it
//! with the experimental channel's CRD, so named ports and the other
//! experimental fields are kept), the removal of every CNP when a case
//! starts, and the Pod objects of a topology (its container ports; a
//! host-network pod's with `hostNetwork` and its node's addresses).

use std::collections::BTreeMap;
use std::net::IpAddr;

use npm_policy::model::{ContainerPort, Protocol};
use npm_sim::cases::{self, ClusterPolicyObject};
use serde_json::{json, Value};

use super::{api_err, LiveRunner};
use crate::api::ApiError;
use crate::runner::RunnerError;

/// The collection path of ClusterNetworkPolicies.
pub const CNP_COLLECTION: &str = "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies";

/// The path of ClusterNetworkPolicy `name`.
pub fn cnp_path(name: &str) -> String {
    format!("{CNP_COLLECTION}/{name}")
}

impl LiveRunner {
    /// Creates (or, with `update`, replaces) a ClusterNetworkPolicy of a
    /// case action, placeholders resolved for the run's address family.
    pub(super) fn apply_cluster_policy(
        &mut self,
        action: &'static str,
        obj: &ClusterPolicyObject,
        update: bool,
    ) -> Result<(), RunnerError> {
        let mut v = self.policy_json(action, &obj.0)?;
        if v.get("apiVersion").is_none() {
            v["apiVersion"] = json!("policy.networking.k8s.io/v1alpha2");
            v["kind"] = json!("ClusterNetworkPolicy");
        }
        let name = obj.name().to_string();
        if !update {
            self.api.create(CNP_COLLECTION, &v).map_err(api_err)?;
            return Ok(());
        }
        let cur = self.api.get(&cnp_path(&name)).map_err(api_err)?;
        v["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"].clone();
        self.api.replace(&cnp_path(&name), &v).map_err(api_err)?;
        Ok(())
    }

    /// Deletes ClusterNetworkPolicy `name`.
    pub(super) fn delete_cluster_policy(&mut self, name: &str) -> Result<(), RunnerError> {
        self.api.delete(&cnp_path(name)).map_err(api_err)
    }

    /// Deletes every ClusterNetworkPolicy (none when the CRD is not
    /// installed: the collection answers 404).
    pub(super) fn delete_all_cluster_policies(&mut self) -> Result<(), RunnerError> {
        let list = match self.api.get(CNP_COLLECTION) {
            Ok(l) => l,
            Err(ApiError::Status { status: 404, .. }) => return Ok(()),
            Err(e) => return Err(api_err(e)),
        };
        for item in list["items"].as_array().cloned().unwrap_or_default() {
            if let Some(name) = item["metadata"]["name"].as_str() {
                match self.api.delete(&cnp_path(name)) {
                    Ok(()) | Err(ApiError::Status { status: 404, .. }) => {}
                    Err(e) => return Err(api_err(e)),
                }
            }
        }
        Ok(())
    }

    /// Points the cluster's pod servers at the ports of `model`'s topology
    /// (for the pods created next).
    pub(super) fn serve_topology_ports(&mut self, model: &cases::Model) {
        self.cluster.set_served_ports(&model.topology().served_ports());
    }
}

/// The Pod object the runner publishes for a model pod: one container per
/// container port of the model (name `cont-<port name>`), on node `node`,
/// Running, with its IPs (none: a Pending pod, as before its CNI ADD).
pub fn model_pod_object(
    ns: &str,
    name: &str,
    labels: &BTreeMap<String, String>,
    node: &str,
    ips: &[IpAddr],
    ports: &[ContainerPort],
) -> Value {
    let containers: Vec<Value> = ports
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let proto = match p.protocol {
                Protocol::Tcp => "TCP",
                Protocol::Udp => "UDP",
                Protocol::Sctp => "SCTP",
            };
            let port_name = p.name.clone().unwrap_or_else(|| format!("p{i}"));
            json!({
                "name": format!("cont-{port_name}"),
                "image": "npm-e2e/netns-server",
                "ports": [{
                    "name": p.name,
                    "containerPort": p.port,
                    "protocol": proto,
                }],
            })
        })
        .collect();
    let containers = if containers.is_empty() {
        vec![json!({"name": "cont", "image": "npm-e2e/netns-server"})]
    } else {
        containers
    };
    let pod_ips: Vec<Value> = ips.iter().map(|ip| json!({"ip": ip.to_string()})).collect();
    json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"namespace": ns, "name": name, "labels": labels},
        "spec": {"nodeName": node, "containers": containers},
        "status": {
            "phase": "Running",
            "podIP": ips.first().map(|i| i.to_string()),
            "podIPs": pod_ips,
        },
    })
}

/// The Pod object of a host-network model pod: [`model_pod_object`] with
/// `spec.hostNetwork: true`, `status.podIP(s)` the node's addresses `ips`
/// and `status.hostIP` the first of them (as a kubelet reports it).
pub fn host_network_pod_object(
    ns: &str,
    name: &str,
    labels: &BTreeMap<String, String>,
    node: &str,
    ips: &[IpAddr],
    ports: &[ContainerPort],
) -> Value {
    let mut o = model_pod_object(ns, name, labels, node, ips, ports);
    o["spec"]["hostNetwork"] = json!(true);
    o["status"]["hostIP"] = json!(ips.first().map(|i| i.to_string()));
    o["status"]["hostIPs"] = o["status"]["podIPs"].clone();
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pod_object_carries_the_topology_ports() {
        let ports = cases::Topology::NetworkPolicyApi.container_ports();
        let o = model_pod_object(
            "network-policy-conformance-gryffindor",
            "harry-potter-0",
            &BTreeMap::new(),
            "n",
            &[],
            &ports,
        );
        let names: Vec<&str> = o["spec"]["containers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["ports"][0]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["web", "dns"]);
        assert_eq!(o["spec"]["containers"][1]["ports"][0]["protocol"], "UDP");
        assert_eq!(o["spec"]["containers"][1]["ports"][0]["containerPort"], 53);
    }
}
