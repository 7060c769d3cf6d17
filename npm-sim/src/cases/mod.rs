//! Conformance case files: the format and its parsing. The pristine model
//! the cases run on is [`Model`], placeholders are [`substitute`], the
//! simulated run (evaluator and compiled lookup) is [`run_case_simulated`];
//! expected and observed matrices are [`Matrix`].
//!
//! # Format
//!
//! A YAML file holds one case, or a list of cases under `cases:`. Unknown
//! fields are ignored.
//!
//! ```yaml
//! cases:
//!   - id: deny-all-ingress
//!     title: optional text
//!     steps:
//!       - actions:
//!           - create_policy: { apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, ... }
//!         probes:
//!           - port: 80
//!             protocol: TCP
//!             matrix:            # source -> one 1/0 per destination in `pods` order
//!               x/a: "111111111"
//!             pods: [x/a, ...]   # defaults to x/a,x/b,x/c,y/a,...,z/c
//! ```
//!
//! Actions (single-key maps, applied in order): `create_policy`,
//! `update_policy` (a NetworkPolicy), `delete_policy: {namespace, name}`,
//! `delete_all_policies: {}`, `add_namespace_labels` /
//! `set_namespace_labels: {namespace, labels}`, `add_pod_labels` /
//! `set_pod_labels: {pod: ns/name, labels}`, `create_pod: {pod, labels}`,
//! `delete_pod: {pod}`, `create_namespace: {namespace, labels}`,
//! `delete_namespace: {namespace}`,
//! `create_cluster_network_policy` / `update_cluster_network_policy` (a
//! ClusterNetworkPolicy object, `policy.networking.k8s.io/v1alpha2`; update
//! replaces the same-named one) and `delete_cluster_network_policy: {name}`.
//!
//! Topology: `topology: xyz` (the default: namespaces x, y, z with pods a,
//! b, c) or `topology: network-policy-api` (the ClusterNetworkPolicy
//! conformance houses), on a case or at the top of a file holding `cases:`
//! (the default of its cases); see [`Topology`]. A probe's `pods` default
//! to every pod of the case's topology.
//!
//! Placeholders in the text: `${IP:<ns>/<pod>}` (the pod's IPv4 address)
//! and `${CIDR<n>:<ns>/<pod>}` (the IPv4 /n network containing it); see
//! [`substitute`]. [`Model::apply`] resolves those left in a policy against
//! its own addresses.

mod model;
mod placeholder;
mod run;
mod topology;

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::model::{Labels, Protocol};
use serde::{Deserialize, Serialize};

pub use crate::sim::{Matrix, Mismatch};
pub use model::{model_container_ports, Model, MODEL_NODE};
pub use placeholder::{substitute, Placeholder};
pub use run::{run_case_simulated, CaseResult, ProbeResult};
pub use topology::{
    house_namespace, node_addresses, Topology, TopologyNamespace, TopologyNode, HOST_NETWORK_HOUSE, HOST_NETWORK_PORTS,
    HOUSES,
};

/// Errors of case files and actions.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    /// The file is not valid YAML or does not have the case format.
    #[error("case file: {0}")]
    Parse(#[from] serde_yaml::Error),
    /// A placeholder is malformed or names an unknown pod.
    #[error("placeholder {placeholder:?}: {message}")]
    Placeholder {
        /// The placeholder text.
        placeholder: String,
        /// What is wrong.
        message: String,
    },
    /// A pod reference is not `namespace/name`.
    #[error("pod reference {0:?}: want namespace/name")]
    PodRef(String),
    /// An action names a namespace that does not exist.
    #[error("action {action}: namespace {namespace:?} does not exist")]
    NoNamespace {
        /// Action name.
        action: &'static str,
        /// Namespace.
        namespace: String,
    },
    /// An action names a pod that does not exist.
    #[error("action {action}: pod {pod:?} does not exist")]
    NoPod {
        /// Action name.
        action: &'static str,
        /// `namespace/name`.
        pod: String,
    },
    /// An action creates something that exists already.
    #[error("action {action}: {object:?} already exists")]
    Exists {
        /// Action name.
        action: &'static str,
        /// What.
        object: String,
    },
    /// A policy of an action is invalid.
    #[error("action {action}: invalid policy: {errors:?}")]
    InvalidPolicy {
        /// Action name.
        action: &'static str,
        /// Validation errors.
        errors: Vec<String>,
    },
    /// A ClusterNetworkPolicy of an action is not an object with a
    /// `metadata.name`.
    #[error("action {action}: {message}")]
    ClusterPolicyObject {
        /// Action name.
        action: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A probe's protocol is not TCP, UDP or SCTP.
    #[error("probe: unsupported protocol {0:?}")]
    Protocol(String),
    /// A probe's matrix row has the wrong length or characters.
    #[error("probe: matrix row {source_pod:?}: {message}")]
    Matrix {
        /// Row (source pod).
        source_pod: String,
        /// What is wrong.
        message: String,
    },
}

/// One case.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Case {
    /// Identifier.
    pub id: String,
    /// Title.
    #[serde(default)]
    pub title: Option<String>,
    /// The topology (`None`: the file's, else [`Topology::Xyz`]).
    #[serde(default)]
    pub topology: Option<Topology>,
    /// Steps, in order.
    #[serde(default)]
    pub steps: Vec<Step>,
}

impl Case {
    /// The topology the case runs on.
    pub fn topology(&self) -> Topology {
        self.topology.unwrap_or_default()
    }
}

/// One step: actions, then probes.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Step {
    /// Actions applied in order.
    #[serde(default)]
    pub actions: Vec<Action>,
    /// Probes run after the actions.
    #[serde(default)]
    pub probes: Vec<Probe>,
}

/// `namespace` + `name`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ObjectName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// `namespace` + `labels`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct NamespaceLabels {
    /// Namespace.
    pub namespace: String,
    /// Labels.
    #[serde(default)]
    pub labels: Labels,
}

/// `pod` (`ns/name`) + `labels`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct PodLabels {
    /// `namespace/name`.
    pub pod: String,
    /// Labels.
    #[serde(default)]
    pub labels: Labels,
}

/// `pod` (`ns/name`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct PodName {
    /// `namespace/name`.
    pub pod: String,
}

/// `namespace`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct NamespaceName {
    /// Namespace.
    pub namespace: String,
}

/// `name` of a cluster-scoped object.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ClusterObjectName {
    /// Name.
    pub name: String,
}

/// A ClusterNetworkPolicy object as written in the case file (passed as it
/// is to the API server in live runs, converted by npm-policy in simulated
/// ones). Parsing checks that it is a map with a `metadata.name`.
#[derive(Clone, Debug, PartialEq)]
pub struct ClusterPolicyObject(pub serde_yaml::Value);

impl ClusterPolicyObject {
    /// `metadata.name`.
    pub fn name(&self) -> &str {
        self.0
            .get("metadata")
            .and_then(|m| m.get("name"))
            .and_then(|n| n.as_str())
            .unwrap_or_default()
    }
}

/// Nothing (`{}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct Empty {}

/// One action: in a case file a single-key map `name: argument`.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Create a NetworkPolicy.
    CreatePolicy(Box<NetworkPolicy>),
    /// Replace a NetworkPolicy.
    UpdatePolicy(Box<NetworkPolicy>),
    /// Delete a NetworkPolicy.
    DeletePolicy(ObjectName),
    /// Delete every NetworkPolicy.
    DeleteAllPolicies(Empty),
    /// Add (or overwrite) namespace labels.
    AddNamespaceLabels(NamespaceLabels),
    /// Replace namespace labels (`kubernetes.io/metadata.name` is kept).
    SetNamespaceLabels(NamespaceLabels),
    /// Add (or overwrite) pod labels.
    AddPodLabels(PodLabels),
    /// Replace pod labels.
    SetPodLabels(PodLabels),
    /// Create a pod (the standard container ports, the next free address).
    CreatePod(PodLabels),
    /// Delete a pod.
    DeletePod(PodName),
    /// Create a namespace (labels `ns=<name>` and the metadata label are added).
    CreateNamespace(NamespaceLabels),
    /// Delete a namespace with its pods and policies.
    DeleteNamespace(NamespaceName),
    /// Create a ClusterNetworkPolicy.
    CreateClusterNetworkPolicy(Box<ClusterPolicyObject>),
    /// Replace the same-named ClusterNetworkPolicy.
    UpdateClusterNetworkPolicy(Box<ClusterPolicyObject>),
    /// Delete a ClusterNetworkPolicy.
    DeleteClusterNetworkPolicy(ClusterObjectName),
}

impl Action {
    /// The action's name as written in case files.
    pub fn name(&self) -> &'static str {
        match self {
            Action::CreatePolicy(_) => "create_policy",
            Action::UpdatePolicy(_) => "update_policy",
            Action::DeletePolicy(_) => "delete_policy",
            Action::DeleteAllPolicies(_) => "delete_all_policies",
            Action::AddNamespaceLabels(_) => "add_namespace_labels",
            Action::SetNamespaceLabels(_) => "set_namespace_labels",
            Action::AddPodLabels(_) => "add_pod_labels",
            Action::SetPodLabels(_) => "set_pod_labels",
            Action::CreatePod(_) => "create_pod",
            Action::DeletePod(_) => "delete_pod",
            Action::CreateNamespace(_) => "create_namespace",
            Action::DeleteNamespace(_) => "delete_namespace",
            Action::CreateClusterNetworkPolicy(_) => "create_cluster_network_policy",
            Action::UpdateClusterNetworkPolicy(_) => "update_cluster_network_policy",
            Action::DeleteClusterNetworkPolicy(_) => "delete_cluster_network_policy",
        }
    }
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let map = BTreeMap::<String, serde_yaml::Value>::deserialize(d)?;
        if map.len() != 1 {
            return Err(D::Error::custom(format!(
                "an action is a map with exactly one key, got {} keys",
                map.len()
            )));
        }
        let (name, v) = map.into_iter().next().expect("one entry");
        fn arg<T: serde::de::DeserializeOwned, E: Error>(name: &str, v: serde_yaml::Value) -> Result<T, E> {
            let v = if v.is_null() {
                serde_yaml::Value::Mapping(Default::default())
            } else {
                v
            };
            serde_yaml::from_value(v).map_err(|e| E::custom(format!("{name}: {e}")))
        }
        fn cnp<E: Error>(name: &str, v: serde_yaml::Value) -> Result<ClusterPolicyObject, E> {
            let o = ClusterPolicyObject(v);
            if !o.0.is_mapping() {
                return Err(E::custom(format!("{name}: want a ClusterNetworkPolicy object")));
            }
            if o.name().is_empty() {
                return Err(E::custom(format!("{name}: the object has no metadata.name")));
            }
            Ok(o)
        }
        Ok(match name.as_str() {
            "create_policy" => Action::CreatePolicy(arg(&name, v)?),
            "update_policy" => Action::UpdatePolicy(arg(&name, v)?),
            "delete_policy" => Action::DeletePolicy(arg(&name, v)?),
            "delete_all_policies" => Action::DeleteAllPolicies(Empty {}),
            "add_namespace_labels" => Action::AddNamespaceLabels(arg(&name, v)?),
            "set_namespace_labels" => Action::SetNamespaceLabels(arg(&name, v)?),
            "add_pod_labels" => Action::AddPodLabels(arg(&name, v)?),
            "set_pod_labels" => Action::SetPodLabels(arg(&name, v)?),
            "create_pod" => Action::CreatePod(arg(&name, v)?),
            "delete_pod" => Action::DeletePod(arg(&name, v)?),
            "create_namespace" => Action::CreateNamespace(arg(&name, v)?),
            "delete_namespace" => Action::DeleteNamespace(arg(&name, v)?),
            "create_cluster_network_policy" => Action::CreateClusterNetworkPolicy(Box::new(cnp(&name, v)?)),
            "update_cluster_network_policy" => Action::UpdateClusterNetworkPolicy(Box::new(cnp(&name, v)?)),
            "delete_cluster_network_policy" => Action::DeleteClusterNetworkPolicy(arg(&name, v)?),
            other => return Err(D::Error::custom(format!("unknown action {other:?}"))),
        })
    }
}

fn default_protocol() -> String {
    "TCP".to_string()
}

/// The default probe pod list.
pub fn default_pods() -> Vec<String> {
    ["x", "y", "z"]
        .iter()
        .flat_map(|n| ["a", "b", "c"].iter().map(move |p| format!("{n}/{p}")))
        .collect()
}

/// One probe: every source in `matrix` to every pod of `pods`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Probe {
    /// Destination port.
    pub port: u16,
    /// `TCP`, `UDP` or `SCTP`.
    #[serde(default = "default_protocol")]
    pub protocol: String,
    /// Source pod -> `1`/`0` per destination, in `pods` order.
    pub matrix: BTreeMap<String, String>,
    /// Destination order (and the full pod list); empty in the file: every
    /// pod of the case's topology (filled by [`parse_case_file`]).
    #[serde(default)]
    pub pods: Vec<String>,
}

impl Probe {
    /// The probe's protocol.
    pub fn protocol(&self) -> Result<Protocol, CaseError> {
        npm_policy::validate::parse_protocol(&self.protocol).ok_or_else(|| CaseError::Protocol(self.protocol.clone()))
    }

    /// The expected matrix: rows are the sources of `matrix` (in `pods`
    /// order, then any others), columns `pods`.
    pub fn expected(&self) -> Result<Matrix, CaseError> {
        let mut rows: Vec<String> = self
            .pods
            .iter()
            .filter(|p| self.matrix.contains_key(*p))
            .cloned()
            .collect();
        rows.extend(self.matrix.keys().filter(|k| !self.pods.contains(k)).cloned());
        let mut cells = Vec::new();
        for r in &rows {
            let text: String = self.matrix[r].chars().filter(|c| !c.is_whitespace()).collect();
            if text.chars().count() != self.pods.len() {
                return Err(CaseError::Matrix {
                    source_pod: r.clone(),
                    message: format!("{} entries for {} pods", text.chars().count(), self.pods.len()),
                });
            }
            let row = text
                .chars()
                .map(|c| match c {
                    '1' | '.' => Ok(true),
                    '0' | 'X' | 'x' => Ok(false),
                    other => Err(CaseError::Matrix {
                        source_pod: r.clone(),
                        message: format!("unexpected {other:?}: want 1 or 0"),
                    }),
                })
                .collect::<Result<Vec<bool>, _>>()?;
            cells.push(row);
        }
        Ok(Matrix {
            rows,
            columns: self.pods.clone(),
            cells,
        })
    }
}

/// Parses a case file; placeholders stay as they are (see [`Model::apply`]).
pub fn parse_case_file(text: &str) -> Result<Vec<Case>, CaseError> {
    // Untagged enums hide the real error: try the list form explicitly.
    let v: serde_yaml::Value = serde_yaml::from_str(text)?;
    let mut cases = if v.get("cases").is_some() {
        #[derive(Deserialize)]
        struct Many {
            #[serde(default)]
            topology: Option<Topology>,
            cases: Vec<Case>,
        }
        // (from_str: serde_yaml's Value does not deserialize map-form enums.)
        let many = serde_yaml::from_str::<Many>(text)?;
        let mut cases = many.cases;
        for c in &mut cases {
            c.topology = c.topology.or(many.topology);
        }
        cases
    } else {
        vec![serde_yaml::from_str::<Case>(text)?]
    };
    for c in &mut cases {
        let pods = c.topology().default_pods();
        for p in c.steps.iter_mut().flat_map(|s| s.probes.iter_mut()) {
            if p.pods.is_empty() {
                p.pods = pods.clone();
            }
        }
    }
    Ok(cases)
}

/// Parses a case file after replacing placeholders with `ip` (see [`substitute`]).
pub fn parse_case_file_with(text: &str, ip: &dyn Fn(&str) -> Option<IpAddr>) -> Result<Vec<Case>, CaseError> {
    parse_case_file(&substitute(text, ip)?)
}
