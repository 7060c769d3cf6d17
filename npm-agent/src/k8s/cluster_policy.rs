//! The `ClusterNetworkPolicy` resource (`policy.networking.k8s.io`,
//! cluster-scoped, read at `v1alpha2` or `v1beta1`: [`VERSIONS`]) as the
//! agent watches it, and what the agent does when the API server does not
//! serve it ([`ClusterPolicyMode`]).
//!
//! The object is kept with its `spec` as raw JSON ([`ClusterNetworkPolicy`]):
//! it is decoded into npm-policy's API type one object at a time when the
//! snapshot is built, so one object the agent cannot decode (a field of a
//! newer API version, a wrong type) is reported as invalid on its own and
//! never makes the whole LIST fail (a typed watcher would fail the list,
//! and no CNP, nor anything else, would ever be programmed).
//!
//! A `404` on the list (or watch) never means "none" by itself: an API
//! server still starting its CRD handlers, or a CRD upgrade that stops
//! serving a version, answers 404 while the objects exist. The agent asks
//! [`discover`] (the CRD through `apiextensions.k8s.io`, else API discovery
//! of the group) what is served, and [`after_not_found`] decides:
//! - another version the agent understands is served (`v1alpha2` no longer,
//!   `v1beta1` yes): read that one ([`ClusterNetworkPolicyV1beta1`]: the
//!   same schema); the last complete list stays programmed until the new
//!   version's list completes, so enforcement has no gap;
//! - the version is still served (discovery lists it, the list 404s), or
//!   discovery fails: "unknown": the last state stays, the readiness check
//!   [`CHECK_CLUSTER_POLICIES`] says why, `npm_errors_total{kind=
//!   "cluster-policies-unknown"}` counts it;
//! - discovery confirms it absent (the CRD does not exist, or serves no
//!   version the agent understands): by mode, below.
//!
//! Confirmed absent:
//! - `off`: never watched, never read; the CNP list counts as complete and
//!   empty from the start (for clusters that must not depend on the CRD);
//! - `auto` (default): the CNP list counts as complete and empty (the agent
//!   becomes ready and enforces NetworkPolicy); the watcher keeps retrying
//!   with its backoff (at most every 30 s), so installing the CRD later is
//!   picked up. When CNPs were listed before, their removal goes through
//!   the mass-removal guard like any other (held, confirmed by a direct
//!   read, which asks discovery the same way);
//! - `on`: an error like any other: the list never completes, nothing is
//!   programmed from the incomplete state, readiness fails.
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
/// API version of ClusterNetworkPolicy the agent reads first (and the one
/// npm-policy's API type decodes; [`VERSIONS`] share its schema).
pub const VERSION: &str = "v1alpha2";
/// The versions the agent understands, in order of preference: `v1beta1`
/// is announced with the same schema as `v1alpha2`.
pub const VERSIONS: [&str; 2] = [VERSION, "v1beta1"];
/// The name of the ClusterNetworkPolicy CRD.
pub const CRD_NAME: &str = "clusternetworkpolicies.policy.networking.k8s.io";
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

/// `impl Resource` for a cluster-scoped ClusterNetworkPolicy type read at
/// `version`, whose metadata is at `self.$meta` (the two versions share
/// the schema).
macro_rules! cluster_policy_resource {
    ($ty:ty, $version:expr, $($meta:tt).+) => {
        impl Resource for $ty {
            type DynamicType = ();
            type Scope = ClusterResourceScope;

            fn kind(_: &()) -> Cow<'_, str> {
                KIND.into()
            }
            fn group(_: &()) -> Cow<'_, str> {
                GROUP.into()
            }
            fn version(_: &()) -> Cow<'_, str> {
                $version.into()
            }
            fn plural(_: &()) -> Cow<'_, str> {
                PLURAL.into()
            }
            fn meta(&self) -> &ObjectMeta {
                &self.$($meta).+
            }
            fn meta_mut(&mut self) -> &mut ObjectMeta {
                &mut self.$($meta).+
            }
        }
    };
}

cluster_policy_resource!(ClusterNetworkPolicy, VERSION, metadata);

/// A [`ClusterNetworkPolicy`] read at `policy.networking.k8s.io/v1beta1`
/// (the same schema; what the watcher and the direct read use when
/// discovery says `v1alpha2` is no longer served).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(transparent)]
pub struct ClusterNetworkPolicyV1beta1(pub ClusterNetworkPolicy);

cluster_policy_resource!(ClusterNetworkPolicyV1beta1, VERSIONS[1], 0.metadata);

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

/// What a failed LIST (or watch) of ClusterNetworkPolicies means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ListFailure {
    /// `404`: what it means is for discovery to say ([`discover`],
    /// [`after_not_found`]).
    NotFound,
    /// The agent may not list them (`403`): a readiness problem (the
    /// message names the RBAC rule).
    Forbidden(String),
    /// Any other failure: the list stays incomplete (a transient error).
    Other,
}

/// Classify a failed LIST (or watch) of ClusterNetworkPolicies.
pub fn classify_list_error(e: &kube::Error) -> ListFailure {
    match e {
        kube::Error::Api(s) if s.code == 404 => ListFailure::NotFound,
        kube::Error::Api(s) if s.code == 403 => ListFailure::Forbidden(format!(
            "forbidden to list {PLURAL}.{GROUP} (the agent's ClusterRole needs get, list, watch on them): {}",
            s.message
        )),
        _ => ListFailure::Other,
    }
}

/// What discovery says about ClusterNetworkPolicy ([`discover`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Served {
    /// Served at this version (the first of [`VERSIONS`] served).
    Version(&'static str),
    /// Confirmed absent: the CRD does not exist, or serves none of
    /// [`VERSIONS`] (why).
    Absent(String),
}

/// The first of [`VERSIONS`] among `served`.
pub fn preferred(served: &[&str]) -> Option<&'static str> {
    VERSIONS.into_iter().find(|v| served.contains(v))
}

fn served_or_absent(served: &[&str], source: &str) -> Served {
    match preferred(served) {
        Some(v) => Served::Version(v),
        None => Served::Absent(format!(
            "{source} serves no ClusterNetworkPolicy version the agent understands ({}; served: {served:?})",
            VERSIONS.join(", ")
        )),
    }
}

/// Ask the API server which ClusterNetworkPolicy version it serves: the
/// CRD ([`CRD_NAME`] through `apiextensions.k8s.io`; stored in etcd, so it
/// answers even while the server's CRD handlers are starting) and, when the
/// agent may not read CRDs (`403`), API discovery (`/apis`, the group's
/// versions). A failure (any other error) is no answer: "unknown".
pub async fn discover(client: &kube::Client) -> Result<Served, kube::Error> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crds: kube::Api<CustomResourceDefinition> = kube::Api::all(client.clone());
    match crds.get_opt(CRD_NAME).await {
        Ok(None) => Ok(Served::Absent(format!("the CRD {CRD_NAME} does not exist"))),
        Ok(Some(crd)) => {
            let served: Vec<&str> = crd
                .spec
                .versions
                .iter()
                .filter(|v| v.served)
                .map(|v| v.name.as_str())
                .collect();
            Ok(served_or_absent(&served, &format!("the CRD {CRD_NAME}")))
        }
        Err(kube::Error::Api(s)) if s.code == 403 => {
            let groups = client.list_api_groups().await?;
            let served: Vec<&str> = groups
                .groups
                .iter()
                .filter(|g| g.name == GROUP)
                .flat_map(|g| g.versions.iter().map(|v| v.version.as_str()))
                .collect();
            Ok(served_or_absent(&served, &format!("API discovery of {GROUP}")))
        }
        Err(e) => Err(e),
    }
}

/// What a `404` on the list (or watch) of ClusterNetworkPolicies at
/// `version` means, given discovery's answer ([`discover`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NotFound {
    /// Another version is served: read that one (the last complete list
    /// stays in force until its list completes).
    Switch(&'static str),
    /// Confirmed absent and the mode is `auto`: a complete, empty list
    /// (why).
    Absent(String),
    /// Not confirmed (or the mode is `on`): the last complete list stays,
    /// the agent is not ready; the readiness reason.
    Unknown(String),
}

/// Decide what a `404` at `version` means under `mode`, from `discovery`
/// (see the module doc).
pub fn after_not_found(mode: ClusterPolicyMode, version: &str, discovery: Result<Served, kube::Error>) -> NotFound {
    match discovery {
        Ok(Served::Version(v)) if v != version => NotFound::Switch(v),
        Ok(Served::Version(v)) => NotFound::Unknown(format!(
            "the API server answers 404 for {PLURAL}.{GROUP}/{v} but says it serves that version (an API server \
             still starting its CRD handlers?): the last ClusterNetworkPolicies stay enforced until a list completes"
        )),
        Ok(Served::Absent(why)) if mode == ClusterPolicyMode::Auto => NotFound::Absent(why),
        Ok(Served::Absent(why)) => NotFound::Unknown(format!(
            "the API server does not serve {PLURAL}.{GROUP} (is the CRD installed?) and \
             --cluster-network-policies=on: {why}"
        )),
        Err(e) => NotFound::Unknown(format!(
            "the API server answers 404 for {PLURAL}.{GROUP}/{version} and discovery could not confirm whether \
             it is served ({e}): the last ClusterNetworkPolicies stay enforced"
        )),
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
    fn list_errors() {
        assert_eq!(classify_list_error(&api_error(404)), ListFailure::NotFound);
        assert!(matches!(
            classify_list_error(&api_error(403)),
            ListFailure::Forbidden(m) if m.contains("ClusterRole")
        ));
        assert_eq!(classify_list_error(&api_error(500)), ListFailure::Other);
    }

    #[test]
    fn a_404_is_absent_only_when_discovery_confirms_it() {
        use ClusterPolicyMode::*;
        let absent = || Ok(Served::Absent("no CRD".into()));
        assert_eq!(
            after_not_found(Auto, "v1alpha2", absent()),
            NotFound::Absent("no CRD".into())
        );
        assert!(matches!(
            after_not_found(On, "v1alpha2", absent()),
            NotFound::Unknown(m) if m.contains("CRD") && m.contains("--cluster-network-policies=on")
        ));
        for mode in [Auto, On] {
            assert_eq!(
                after_not_found(mode, "v1alpha2", Ok(Served::Version("v1beta1"))),
                NotFound::Switch("v1beta1")
            );
            assert_eq!(
                after_not_found(mode, "v1beta1", Ok(Served::Version("v1alpha2"))),
                NotFound::Switch("v1alpha2")
            );
            assert!(matches!(
                after_not_found(mode, "v1alpha2", Ok(Served::Version("v1alpha2"))),
                NotFound::Unknown(m) if m.contains("stay enforced")
            ));
            assert!(matches!(
                after_not_found(mode, "v1alpha2", Err(api_error(500))),
                NotFound::Unknown(_)
            ));
        }
        assert_eq!(preferred(&["v1beta1", "v1alpha2"]), Some("v1alpha2"));
        assert_eq!(preferred(&["v1", "v1beta1"]), Some("v1beta1"));
        assert_eq!(preferred(&["v1"]), None);
        assert!(matches!(served_or_absent(&[], "the CRD"), Served::Absent(m) if m.contains("served: []")));
    }

    #[test]
    fn the_v1beta1_resource_shares_the_object() {
        assert_eq!(
            ClusterNetworkPolicyV1beta1::url_path(&(), None),
            "/apis/policy.networking.k8s.io/v1beta1/clusternetworkpolicies"
        );
        let o: ClusterNetworkPolicyV1beta1 = serde_json::from_value(serde_json::json!({
            "apiVersion": "policy.networking.k8s.io/v1beta1", "kind": "ClusterNetworkPolicy",
            "metadata": {"name": "x"}, "spec": {"tier": "Admin"}
        }))
        .unwrap();
        assert_eq!(o.0.name(), "x");
        assert_eq!(o.0.to_api_json()["apiVersion"], "policy.networking.k8s.io/v1alpha2");
    }
}
