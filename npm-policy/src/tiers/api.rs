//! The API object `ClusterNetworkPolicy`, `policy.networking.k8s.io/v1alpha2`
//! (kubernetes-sigs/network-policy-api, `apis/v1alpha2`), as serde types with
//! the upstream field names and shape, the experimental-channel fields
//! included (`nodes`, `domainNames`, `destinationNamedPort`).
//!
//! Everything an API server of another version (or with validation off)
//! might omit or spell differently deserializes: enumerations are strings,
//! required scalars are `Option`s, and unknown fields are ignored. So a
//! peer that only sets a field newer than this agent deserializes as a peer
//! with no field set, which [`crate::tiers::validate`] fails closed. Nothing
//! here is validated; [`crate::tiers::validate::convert_cluster_policy`]
//! turns an object into the model.
//!
//! The types implement `k8s_openapi::Resource` and `Metadata`, so kube-rs
//! can list and watch them (`Api::<ClusterNetworkPolicy>::all`).

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector, ListMeta, ObjectMeta};
use serde::{Deserialize, Serialize};

/// The API group.
pub const GROUP: &str = "policy.networking.k8s.io";
/// The API version.
pub const VERSION: &str = "v1alpha2";
/// `apiVersion` of the object.
pub const API_VERSION: &str = "policy.networking.k8s.io/v1alpha2";
/// `kind` of the object.
pub const KIND: &str = "ClusterNetworkPolicy";
/// The resource's plural (URL path segment).
pub const PLURAL: &str = "clusternetworkpolicies";

fn api_version() -> String {
    API_VERSION.to_string()
}

fn kind() -> String {
    KIND.to_string()
}

fn list_kind() -> String {
    format!("{KIND}List")
}

/// A cluster-wide network policy (cluster-scoped, short name `cnp`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicy {
    /// `policy.networking.k8s.io/v1alpha2`.
    #[serde(default = "api_version")]
    pub api_version: String,
    /// `ClusterNetworkPolicy`.
    #[serde(default = "kind")]
    pub kind: String,
    /// Standard object metadata (only `name` matters to the policy).
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The desired behaviour.
    #[serde(default)]
    pub spec: ClusterNetworkPolicySpec,
    /// Status reported by implementations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub status: Option<ClusterNetworkPolicyStatus>,
}

impl Default for ClusterNetworkPolicy {
    fn default() -> Self {
        ClusterNetworkPolicy {
            api_version: api_version(),
            kind: kind(),
            metadata: ObjectMeta::default(),
            spec: ClusterNetworkPolicySpec::default(),
            status: None,
        }
    }
}

/// A list of [`ClusterNetworkPolicy`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyList {
    /// `policy.networking.k8s.io/v1alpha2`.
    #[serde(default = "api_version")]
    pub api_version: String,
    /// `ClusterNetworkPolicyList`.
    #[serde(default = "list_kind")]
    pub kind: String,
    /// List metadata.
    #[serde(default)]
    pub metadata: ListMeta,
    /// The policies.
    #[serde(default)]
    pub items: Vec<ClusterNetworkPolicy>,
}

/// `spec` (`ClusterNetworkPolicySpec`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySpec {
    /// `Admin` or `Baseline` (required).
    #[serde(default)]
    pub tier: String,
    /// 0..=1000, lower is checked first within the tier (required).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
    /// The pods the policy applies to (required; exactly one field).
    #[serde(default)]
    pub subject: ClusterNetworkPolicySubject,
    /// Ingress rules, in precedence order (at most 25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ingress: Option<Vec<ClusterNetworkPolicyIngressRule>>,
    /// Egress rules, in precedence order (at most 25).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egress: Option<Vec<ClusterNetworkPolicyEgressRule>>,
}

/// `status`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyStatus {
    /// Conditions.
    #[serde(default)]
    pub conditions: Vec<Condition>,
}

/// `spec.subject`: exactly one field must be set; host-network pods are
/// never selected.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicySubject {
    /// All pods of the namespaces matching this selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Pods matching a namespace AND a pod selector.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// `NamespacedPod`: pods matching `podSelector` in namespaces matching
/// `namespaceSelector` (an empty selector selects all).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NamespacedPod {
    /// Namespace selector.
    #[serde(default)]
    pub namespace_selector: LabelSelector,
    /// Pod selector.
    #[serde(default)]
    pub pod_selector: LabelSelector,
}

/// One ingress rule.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyIngressRule {
    /// Optional name (at most 100 characters), for observability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `Accept`, `Deny` or `Pass` (required).
    #[serde(default)]
    pub action: String,
    /// Sources (1..=25 items).
    #[serde(default)]
    pub from: Vec<ClusterNetworkPolicyIngressPeer>,
    /// Protocol/port matches; absent: all traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ClusterNetworkPolicyProtocol>>,
}

/// One egress rule.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyEgressRule {
    /// Optional name (at most 100 characters), for observability.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// `Accept`, `Deny` or `Pass` (required).
    #[serde(default)]
    pub action: String,
    /// Destinations (1..=25 items).
    #[serde(default)]
    pub to: Vec<ClusterNetworkPolicyEgressPeer>,
    /// Protocol/port matches; absent: all traffic.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocols: Option<Vec<ClusterNetworkPolicyProtocol>>,
}

/// An ingress peer: exactly one field must be set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyIngressPeer {
    /// All pods of the matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods of matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
}

/// An egress peer: exactly one field must be set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyEgressPeer {
    /// All pods of the matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespaces: Option<LabelSelector>,
    /// Matching pods of matching namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pods: Option<NamespacedPod>,
    /// Nodes by label (experimental channel).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nodes: Option<LabelSelector>,
    /// CIDRs (1..=25); they match pod addresses too.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub networks: Option<Vec<String>>,
    /// Domain names (experimental channel; Accept rules only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub domain_names: Option<Vec<String>>,
}

/// `ClusterNetworkPolicyProtocol`: exactly one field must be set.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ClusterNetworkPolicyProtocol {
    /// TCP matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tcp: Option<ClusterNetworkPolicyProtocolTcp>,
    /// UDP matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub udp: Option<ClusterNetworkPolicyProtocolUdp>,
    /// SCTP matches.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sctp: Option<ClusterNetworkPolicyProtocolSctp>,
    /// A container port name of the destination pod (experimental).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_named_port: Option<String>,
}

/// The attributes of one L4 protocol (`ClusterNetworkPolicyProtocolTCP`,
/// `...UDP` and `...SCTP` have this same shape).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ProtocolPorts {
    /// The destination port; the API requires it (MinProperties=1).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub destination_port: Option<Port>,
}

/// `ClusterNetworkPolicyProtocolTCP`.
pub type ClusterNetworkPolicyProtocolTcp = ProtocolPorts;
/// `ClusterNetworkPolicyProtocolUDP`.
pub type ClusterNetworkPolicyProtocolUdp = ProtocolPorts;
/// `ClusterNetworkPolicyProtocolSCTP`.
pub type ClusterNetworkPolicyProtocolSctp = ProtocolPorts;

/// `Port`: exactly one of `number` or `range`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Port {
    /// A port number, 1..=65535.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number: Option<i32>,
    /// An inclusive range, `start < end`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub range: Option<PortRange>,
}

/// `PortRange`: inclusive `start..=end`, `start < end`, both 1..=65535.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PortRange {
    /// First port.
    #[serde(default)]
    pub start: i32,
    /// Last port.
    #[serde(default)]
    pub end: i32,
}

impl k8s_openapi::Resource for ClusterNetworkPolicy {
    const API_VERSION: &'static str = API_VERSION;
    const GROUP: &'static str = GROUP;
    const KIND: &'static str = KIND;
    const VERSION: &'static str = VERSION;
    const URL_PATH_SEGMENT: &'static str = PLURAL;
    type Scope = k8s_openapi::ClusterResourceScope;
}

impl k8s_openapi::ListableResource for ClusterNetworkPolicy {
    const LIST_KIND: &'static str = "ClusterNetworkPolicyList";
}

impl k8s_openapi::Metadata for ClusterNetworkPolicy {
    type Ty = ObjectMeta;
    fn metadata(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn metadata_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}
