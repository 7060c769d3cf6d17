//! The resource kinds the server serves and their naming: URL plural, group, apiVersion,
//! `kind`, scope, field-selector labels and whether a `/status` subresource exists.

/// The resource kinds the server serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    /// `v1` namespaces (cluster-scoped).
    Namespace,
    /// `v1` pods (namespaced, with a status subresource).
    Pod,
    /// `networking.k8s.io/v1` networkpolicies (namespaced).
    NetworkPolicy,
}

impl Kind {
    /// All kinds.
    pub const ALL: [Kind; 3] = [Kind::Namespace, Kind::Pod, Kind::NetworkPolicy];

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
        }
    }
    /// Singular resource name.
    pub fn singular(self) -> &'static str {
        match self {
            Kind::Namespace => "namespace",
            Kind::Pod => "pod",
            Kind::NetworkPolicy => "networkpolicy",
        }
    }
    /// API group ("" for core).
    pub fn group(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io",
            _ => "",
        }
    }
    /// `apiVersion` of objects of this kind.
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::NetworkPolicy => "networking.k8s.io/v1",
            _ => "v1",
        }
    }
    /// `kind` of objects of this kind.
    pub fn kind(self) -> &'static str {
        match self {
            Kind::Namespace => "Namespace",
            Kind::Pod => "Pod",
            Kind::NetworkPolicy => "NetworkPolicy",
        }
    }
    /// Whether objects live in a namespace.
    pub fn namespaced(self) -> bool {
        !matches!(self, Kind::Namespace)
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
            Kind::NetworkPolicy => &["metadata.name", "metadata.namespace"],
        }
    }
    /// Whether this kind has a `/status` subresource.
    pub fn has_status(self) -> bool {
        !matches!(self, Kind::NetworkPolicy)
    }
}
