//! The resource kinds the server serves and their naming: URL plural, group, apiVersion,
//! `kind`, scope, field-selector labels and whether a `/status` subresource exists.
//! New kinds go at the end of [`Kind`] (the store indexes its maps by the variant).

/// The resource kinds the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1` namespaces (cluster-scoped).
    Namespace,
    /// `v1` pods (namespaced, with a status subresource).
    Pod,
    /// `networking.k8s.io/v1` networkpolicies (namespaced).
    NetworkPolicy,
    /// `apps/v1` daemonsets (namespaced, with a status subresource): what the chart's
    /// uninstall hooks read and delete.
    DaemonSet,
    /// `v1` events (namespaced): what the agent reports on NetworkPolicies it
    /// cannot fully convert.
    Event,
    /// `v1` services (namespaced, with a status subresource): ClusterIPs and NodePorts
    /// are allocated by the store.
    Service,
    /// `discovery.k8s.io/v1` endpointslices (namespaced).
    EndpointSlice,
    /// `v1` nodes (cluster-scoped, with a status subresource).
    Node,
    /// `apiextensions.k8s.io/v1` customresourcedefinitions (cluster-scoped, with a status
    /// subresource). Only the ClusterNetworkPolicy CRD is accepted (see [`crate::crd`]).
    CustomResourceDefinition,
    /// `policy.networking.k8s.io/v1alpha2` clusternetworkpolicies (cluster-scoped, with a
    /// status subresource): served only while their CRD is installed; pruned and validated
    /// by the installed CRD's schema.
    ClusterNetworkPolicy,
}

impl Kind {
    /// All kinds.
    pub const ALL: [Kind; 10] = [
        Kind::Namespace,
        Kind::Pod,
        Kind::NetworkPolicy,
        Kind::DaemonSet,
        Kind::Event,
        Kind::Service,
        Kind::EndpointSlice,
        Kind::Node,
        Kind::CustomResourceDefinition,
        Kind::ClusterNetworkPolicy,
    ];

    /// Index of the kind's maps in the store.
    pub(super) fn idx(self) -> usize {
        self as usize
    }
    /// Plural resource name as used in URLs.
    pub fn plural(self) -> &'static str {
        match self {
            Kind::Namespace => "namespaces",
            Kind::Pod => "pods",
            Kind::NetworkPolicy => "networkpolicies",
            Kind::DaemonSet => "daemonsets",
            Kind::Event => "events",
            Kind::Service => "services",
            Kind::EndpointSlice => "endpointslices",
            Kind::Node => "nodes",
            Kind::CustomResourceDefinition => "customresourcedefinitions",
            Kind::ClusterNetworkPolicy => "clusternetworkpolicies",
        }
    }
    /// Singular resource name.
    pub fn singular(self) -> &'static str {
        match self {
            Kind::Namespace => "namespace",
            Kind::Pod => "pod",
            Kind::NetworkPolicy => "networkpolicy",
            Kind::DaemonSet => "daemonset",
            Kind::Event => "event",
            Kind::Service => "service",
            Kind::EndpointSlice => "endpointslice",
            Kind::Node => "node",
            Kind::CustomResourceDefinition => "customresourcedefinition",
            Kind::ClusterNetworkPolicy => "clusternetworkpolicy",
        }
    }
    /// API group ("" for core).
    pub fn group(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io",
            Kind::DaemonSet => "apps",
            Kind::EndpointSlice => "discovery.k8s.io",
            Kind::CustomResourceDefinition => "apiextensions.k8s.io",
            Kind::ClusterNetworkPolicy => "policy.networking.k8s.io",
            _ => "",
        }
    }
    /// API version within the group.
    pub fn version(self) -> &'static str {
        match self {
            Kind::ClusterNetworkPolicy => "v1alpha2",
            _ => "v1",
        }
    }
    /// `apiVersion` of objects of this kind.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            Kind::DaemonSet => "apps/v1",
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::CustomResourceDefinition => "apiextensions.k8s.io/v1",
            Kind::ClusterNetworkPolicy => "policy.networking.k8s.io/v1alpha2",
            _ => "v1",
        }
    }
    /// `kind` of objects of this kind.
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Pod => "Pod",
            Kind::NetworkPolicy => "NetworkPolicy",
            Kind::DaemonSet => "DaemonSet",
            Kind::Event => "Event",
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::Node => "Node",
            Kind::CustomResourceDefinition => "CustomResourceDefinition",
            Kind::ClusterNetworkPolicy => "ClusterNetworkPolicy",
        }
    }
    /// Whether objects live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(
            self,
            Kind::Namespace | Kind::Node | Kind::CustomResourceDefinition | Kind::ClusterNetworkPolicy
        )
    }
    /// `plural[.group]`, as used in error messages.
    pub fn resource_ref(self) -> String {
        if self.group().is_empty() {
            self.plural().to_string()
        } else {
            format!("{}.{}", self.plural(), self.group())
        }
    }
    /// Fields accepted in field selectors.
    pub fn field_labels(self) -> &'static [&'static str] {
        match self {
            Kind::Namespace => &["metadata.name", "status.phase"],
            Kind::Pod => &[
                "metadata.name",
                "metadata.namespace",
                "spec.nodeName",
                "spec.restartPolicy",
                "spec.schedulerName",
                "spec.serviceAccountName",
                "spec.hostNetwork",
                "status.phase",
                "status.podIP",
                "status.nominatedNodeName",
            ],
            Kind::NetworkPolicy | Kind::DaemonSet | Kind::EndpointSlice => &["metadata.name", "metadata.namespace"],
            Kind::Service => &["metadata.name", "metadata.namespace", "spec.clusterIP", "spec.type"],
            Kind::Node => &["metadata.name", "spec.unschedulable"],
            Kind::CustomResourceDefinition | Kind::ClusterNetworkPolicy => &["metadata.name"],
            Kind::Event => &[
                "metadata.name",
                "metadata.namespace",
                "involvedObject.kind",
                "involvedObject.namespace",
                "involvedObject.name",
                "involvedObject.uid",
                "involvedObject.apiVersion",
                "involvedObject.resourceVersion",
                "reason",
                "reportingComponent",
                "type",
            ],
        }
    }
    /// Whether this kind has a `/status` subresource.
    pub fn has_status(self) -> bool {
        !matches!(self, Kind::NetworkPolicy | Kind::Event | Kind::EndpointSlice)
    }
}
