//! Routing: parsing a Kubernetes REST path into a [`Target`] (kind, namespace, name,
//! subresource), the query string, and the verb a request counts as (for stats and faults).

use crate::crd::CNP_VERSIONS;
use crate::store::Kind;
use axum::http::{Method, Uri};
use std::collections::HashMap;

/// A parsed resource path.
#[derive(Debug)]
pub(super) struct Target {
    /// The resource kind.
    pub(super) kind: Kind,
    /// The version of the path (one of the kind's versions).
    pub(super) version: String,
    /// Namespace from the path.
    pub(super) ns: Option<String>,
    /// Object name (None for a collection).
    pub(super) name: Option<String>,
    /// Subresource (`status`, `finalize`, ...).
    pub(super) sub: Option<String>,
}

/// The kind served at `plural` in API group `group`, version `version` (ClusterNetworkPolicy
/// at any of [`CNP_VERSIONS`]; which ones are served now is the installed CRD's).
fn kind_for(group: &str, version: &str, plural: &str) -> Option<Kind> {
    Kind::ALL.into_iter().find(|k| {
        let version_ok = match k {
            Kind::ClusterNetworkPolicy => CNP_VERSIONS.contains(&version),
            _ => k.version() == version,
        };
        k.group() == group && version_ok && k.plural() == plural
    })
}

/// Parse a resource path; None for discovery and unknown paths. Whether the kind is served
/// now (a custom resource needs its CRD) is checked by the caller.
pub(super) fn parse_target(path: &str) -> Option<Target> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').collect();
    let (group, version, rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", "v1", rest),
        ["apis", group, version, rest @ ..] if !group.is_empty() => (*group, *version, rest),
        _ => return None,
    };
    if rest.is_empty() {
        return None;
    }
    let kind_for = |group: &str, plural: &str| kind_for(group, version, plural);
    let t = |kind, ns: Option<&str>, name: Option<&str>, sub: Option<&str>| {
        Some(Target {
            kind,
            version: version.to_string(),
            ns: ns.map(str::to_string),
            name: name.map(str::to_string),
            sub: sub.map(str::to_string),
        })
    };
    match rest {
        [plural] => t(kind_for(group, plural)?, None, None, None),
        ["namespaces", ns, plural] if group.is_empty() && matches!(*plural, "status" | "finalize") => {
            t(Kind::Namespace, None, Some(ns), Some(plural))
        }
        ["namespaces", ns, plural] => {
            let k = kind_for(group, plural)?;
            k.namespaced().then_some(())?;
            t(k, Some(ns), None, None)
        }
        ["namespaces", ns, plural, name] => {
            let k = kind_for(group, plural)?;
            k.namespaced().then_some(())?;
            t(k, Some(ns), Some(name), None)
        }
        ["namespaces", ns, plural, name, sub] => {
            let k = kind_for(group, plural)?;
            k.namespaced().then_some(())?;
            t(k, Some(ns), Some(name), Some(sub))
        }
        [plural, name] => {
            let k = kind_for(group, plural)?;
            (!k.namespaced()).then_some(())?;
            t(k, None, Some(name), None)
        }
        [plural, name, sub] => {
            let k = kind_for(group, plural)?;
            (!k.namespaced()).then_some(())?;
            t(k, None, Some(name), Some(sub))
        }
        _ => None,
    }
}

/// The query parameters (empty when they do not parse).
pub(super) fn query_map(uri: &Uri) -> HashMap<String, String> {
    axum::extract::Query::<HashMap<String, String>>::try_from_uri(uri)
        .map(|q| q.0)
        .unwrap_or_default()
}

/// Whether the boolean query parameter `k` is set (`true` or `1`).
pub(super) fn is_true(q: &HashMap<String, String>, k: &str) -> bool {
    matches!(q.get(k).map(String::as_str), Some("true" | "1"))
}

/// The verb of a request, as counted in [`super::Stats::by_verb`] and matched by fault rules.
pub(super) fn verb_of(method: &Method, target: Option<&Target>, q: &HashMap<String, String>) -> &'static str {
    let Some(t) = target else {
        return "discovery";
    };
    match (method.as_str(), t.name.is_some()) {
        ("GET", _) if is_true(q, "watch") => "watch",
        ("GET", true) => "get",
        ("GET", false) => "list",
        ("POST", _) => "create",
        ("PUT", _) => "update",
        ("PATCH", _) => "patch",
        ("DELETE", true) => "delete",
        ("DELETE", false) => "deletecollection",
        _ => "other",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn apps_daemonsets_are_routed() {
        let t = parse_target("/apis/apps/v1/namespaces/kube-system/daemonsets/agent/status").unwrap();
        assert_eq!(t.kind, Kind::DaemonSet);
        assert_eq!(t.ns.as_deref(), Some("kube-system"));
        assert_eq!(t.name.as_deref(), Some("agent"));
        assert_eq!(t.sub.as_deref(), Some("status"));
        assert_eq!(parse_target("/apis/apps/v1/daemonsets").unwrap().kind, Kind::DaemonSet);
        // Namespaced only; not in another group.
        assert!(parse_target("/apis/apps/v1/daemonsets/agent").is_none());
        assert!(parse_target("/api/v1/namespaces/ns/daemonsets").is_none());
    }

    #[test]
    fn services_endpointslices_and_nodes_are_routed() {
        let t = parse_target("/api/v1/nodes/n1/status").unwrap();
        assert_eq!(
            (t.kind, t.ns, t.name.as_deref(), t.sub.as_deref()),
            (Kind::Node, None, Some("n1"), Some("status"))
        );
        let t = parse_target("/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies/a/status").unwrap();
        assert_eq!(
            (t.kind, t.ns, t.name.as_deref(), t.sub.as_deref()),
            (Kind::ClusterNetworkPolicy, None, Some("a"), Some("status"))
        );
        assert!(parse_target("/apis/policy.networking.k8s.io/v1/clusternetworkpolicies").is_none());
        let t = parse_target("/apis/policy.networking.k8s.io/v1beta1/clusternetworkpolicies/a").unwrap();
        assert_eq!((t.kind, t.version.as_str()), (Kind::ClusterNetworkPolicy, "v1beta1"));
        assert!(parse_target("/apis/policy.networking.k8s.io/v1alpha2").is_none());
        let t = parse_target("/apis/apiextensions.k8s.io/v1/customresourcedefinitions/x.y").unwrap();
        assert_eq!(
            (t.kind, t.name.as_deref()),
            (Kind::CustomResourceDefinition, Some("x.y"))
        );
        assert_eq!(parse_target("/api/v1/nodes").unwrap().kind, Kind::Node);
        assert!(parse_target("/api/v1/namespaces/ns/nodes/n1").is_none());
        let t = parse_target("/api/v1/namespaces/ns/services/s/status").unwrap();
        assert_eq!((t.kind, t.sub.as_deref()), (Kind::Service, Some("status")));
        let t = parse_target("/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices/s-1").unwrap();
        assert_eq!((t.kind, t.name.as_deref()), (Kind::EndpointSlice, Some("s-1")));
        assert_eq!(
            parse_target("/apis/discovery.k8s.io/v1/endpointslices").unwrap().kind,
            Kind::EndpointSlice
        );
    }
}
