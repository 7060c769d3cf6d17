//! The `ClusterNetworkPolicy` resource (`policy.networking.k8s.io/v1alpha2`,
//! cluster-scoped) as the agent watches it, and what the agent does when the
//! API server does not serve it ([`ClusterPolicyMode`]).
//!
//! The object is kept with its `spec` as raw JSON ([`ClusterNetworkPolicy`]):
//! it is decoded into npm-policy's API type one object at a time when the
//! snapshot is built, so one object the agent cannot decode (a field of a
//! newer API version, a wrong type) is reported as invalid on its own and
//! never makes the whole LIST fail (a typed watcher would fail the list,
//! and no CNP, nor anything else, would ever be programmed).
//!
//! Without the CRD (`404` on the list):
//! - `off`: never watched, never read; the CNP list counts as complete and
//!   empty from the start (for clusters that must not depend on the CRD);
//! - `auto` (default): a `404` on the list counts as a complete, empty list
//!   (the agent becomes ready and enforces NetworkPolicy); the watcher keeps
//!   retrying with its backoff (at most every 30 s), so installing the CRD
//!   later is picked up. A `404` after CNPs were listed also empties the
//!   list: that removal goes through the mass-removal guard like any other
//!   (held, confirmed by a direct read, which in `auto` treats the `404` the
//!   same way);
//! - `on`: a `404` is an error like any other: the list never completes,
//!   nothing is programmed from the incomplete state, readiness fails.
//!
//! Whatever the mode, a `403` (the agent's RBAC lacks
//! `clusternetworkpolicies`) is never an empty list: a Deny the agent
//! cannot see must not open traffic. The list stays incomplete and the
//! readiness check [`CHECK_CLUSTER_POLICIES`] names the RBAC problem.

use std::borrow::Cow;

use kube::api::ObjectMeta;
use kube::core::ClusterResourceScope;
use kube::Resource;
use serde::{Deserialize, Serialize};

/// API group of ClusterNetworkPolicy.
pub const GROUP: &str = "policy.networking.k8s.io";
/// API version of ClusterNetworkPolicy.
pub const VERSION: &str = "v1alpha2";
/// Kind.
pub const KIND: &str = "ClusterNetworkPolicy";
/// Plural resource name.
pub const PLURAL: &str = "clusternetworkpolicies";
/// The readiness check that names why the ClusterNetworkPolicy list cannot
/// complete (RBAC, CRD not served with `on`).
pub const CHECK_CLUSTER_POLICIES: &str = "cluster-network-policies";

/// A ClusterNetworkPolicy as listed and watched: metadata and the raw
/// `spec` (decoded per object when the snapshot is built; see the module
/// doc). `status` is not read.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterNetworkPolicy {
    /// Object metadata.
    #[serde(default)]
    pub metadata: ObjectMeta,
    /// The spec, as the API server sent it (`null` when absent).
    #[serde(default)]
    pub spec: serde_json::Value,
}

impl ClusterNetworkPolicy {
    /// The object's name.
    pub fn name(&self) -> &str {
        self.metadata.name.as_deref().unwrap_or("")
    }

    /// The object as the API serializes it (`apiVersion`, `kind`,
    /// `metadata`, `spec`): what npm-policy's API type decodes.
    pub fn to_api_json(&self) -> serde_json::Value {
        serde_json::json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": KIND,
            "metadata": self.metadata,
            "spec": self.spec,
        })
    }
}

impl Resource for ClusterNetworkPolicy {
    type DynamicType = ();
    type Scope = ClusterResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        KIND.into()
    }
    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }
    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }
    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Whether the agent watches ClusterNetworkPolicies, and what a `404` on
/// their list means (`--cluster-network-policies`; see the module doc).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ClusterPolicyMode {
    /// Watched; a `404` (CRD not installed) counts as a complete empty
    /// list, re-checked with the watcher's backoff.
    #[default]
    Auto,
    /// Watched; a `404` is an error (the list never completes: not ready).
    On,
    /// Not watched: no ClusterNetworkPolicy is ever enforced.
    Off,
}

impl ClusterPolicyMode {
    /// The flag's spelling.
    pub const fn name(self) -> &'static str {
        match self {
            ClusterPolicyMode::Auto => "auto",
            ClusterPolicyMode::On => "on",
            ClusterPolicyMode::Off => "off",
        }
    }
}

/// What a failed LIST of ClusterNetworkPolicies means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListFailure {
    /// The resource is not served (`404`) and the mode is `auto`: a
    /// complete, empty list.
    NotServed,
    /// The agent may not list them (`403`): a readiness problem (the
    /// message names the RBAC rule).
    Forbidden(String),
    /// Any other failure (a `404` with `on` included): the list stays
    /// incomplete; the message is the readiness reason when it is a `404`.
    Other(Option<String>),
}

/// Classify a failed LIST of ClusterNetworkPolicies under `mode`.
pub fn classify_list_error(mode: ClusterPolicyMode, e: &kube::Error) -> ListFailure {
    match e {
        kube::Error::Api(s) if s.code == 404 && mode == ClusterPolicyMode::Auto => ListFailure::NotServed,
        kube::Error::Api(s) if s.code == 404 => ListFailure::Other(Some(format!(
            "the API server does not serve {PLURAL}.{GROUP}/{VERSION} (is the CRD installed?) and \
             --cluster-network-policies=on: {}",
            s.message
        ))),
        kube::Error::Api(s) if s.code == 403 => ListFailure::Forbidden(format!(
            "forbidden to list {PLURAL}.{GROUP} (the agent's ClusterRole needs get, list, watch on them): {}",
            s.message
        )),
        _ => ListFailure::Other(None),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn api_error(code: u16) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status {
            code,
            message: "m".into(),
            ..Default::default()
        }))
    }

    #[test]
    fn resource_url_and_decoding() {
        assert_eq!(
            ClusterNetworkPolicy::url_path(&(), None),
            "/apis/policy.networking.k8s.io/v1alpha2/clusternetworkpolicies"
        );
        let o: ClusterNetworkPolicy = serde_json::from_value(serde_json::json!({
            "apiVersion": "policy.networking.k8s.io/v1alpha2", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": "x", "resourceVersion": "3"},
            "spec": {"tier": "Admin", "priority": 5, "futureField": {"a": 1}},
            "status": {"conditions": []}
        }))
        .unwrap();
        assert_eq!(o.name(), "x");
        assert_eq!(
            o.spec["futureField"]["a"], 1,
            "unknown fields are kept for the converter"
        );
        assert_eq!(o.to_api_json()["spec"]["priority"], 5);
        let bare: ClusterNetworkPolicy =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "y"}})).unwrap();
        assert!(bare.spec.is_null());
    }

    #[test]
    fn list_errors_by_mode() {
        use ClusterPolicyMode::*;
        assert_eq!(classify_list_error(Auto, &api_error(404)), ListFailure::NotServed);
        assert!(matches!(
            classify_list_error(On, &api_error(404)),
            ListFailure::Other(Some(_))
        ));
        for mode in [Auto, On] {
            assert!(matches!(
                classify_list_error(mode, &api_error(403)),
                ListFailure::Forbidden(m) if m.contains("ClusterRole")
            ));
            assert_eq!(classify_list_error(mode, &api_error(500)), ListFailure::Other(None));
        }
    }
}
