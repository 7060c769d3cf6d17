//! The store's side of CustomResourceDefinitions: which kinds are served (a custom resource
//! only while its CRD is installed), installing a CRD on create/update (its status set, the
//! custom resources already stored re-pruned by the new schema), deleting one (its custom
//! resources deleted with it, as on a real server) and the pruning and validation of custom
//! resources by the installed schema.

use super::meta::{meta_str, now_rfc3339};
use super::{EventType, Kind, Store};
use crate::crd::{self, CnpChannel, InstalledCrd, CNP_CRD_NAME, CNP_VERSIONS};
use crate::error::{ApiError, Cause};
use crate::validate::{validate_meta, Errs};
use serde_json::Value;
use std::sync::Arc;

/// The `fieldValidation` of a write: what happens to fields of a custom resource that its
/// schema does not specify (they are pruned in every case).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FieldValidation {
    /// Drop them silently.
    Ignore,
    /// Drop them and warn (`Warning: 299 - "unknown field \"spec.x\""`), the server default.
    #[default]
    Warn,
    /// Refuse the write (400 `strict decoding error: unknown field "spec.x"`), what kubectl
    /// sends by default.
    Strict,
}

impl std::str::FromStr for FieldValidation {
    type Err = ApiError;
    fn from_str(s: &str) -> Result<Self, ApiError> {
        match s {
            "Ignore" => Ok(Self::Ignore),
            "Warn" | "" => Ok(Self::Warn),
            "Strict" => Ok(Self::Strict),
            other => Err(ApiError::BadRequest {
                message: format!(
                    "fieldValidation: Invalid value: {other:?}: fieldValidation must be one of \"Ignore\", \"Warn\" or \"Strict\""
                ),
            }),
        }
    }
}

impl Store {
    /// Whether `kind` is served now (custom resources only while their CRD is installed).
    pub fn serves(&self, kind: Kind) -> bool {
        kind != Kind::ClusterNetworkPolicy || self.cnp_crd.is_some()
    }

    /// Whether `kind` is served now at `version` (a custom resource at the versions its
    /// installed CRD marks `served`; a built-in kind at its one version).
    pub fn serves_version(&self, kind: Kind, version: &str) -> bool {
        match kind {
            Kind::ClusterNetworkPolicy => self
                .cnp_crd
                .as_ref()
                .is_some_and(|c| c.served.iter().any(|v| v == version)),
            _ => version == kind.version(),
        }
    }

    /// The versions `kind` is served at now, in order (none for a custom resource whose CRD
    /// is not installed, or that serves none).
    pub fn served_versions(&self, kind: Kind) -> Vec<String> {
        match kind {
            Kind::ClusterNetworkPolicy => self.cnp_crd.as_ref().map(|c| c.served.clone()).unwrap_or_default(),
            _ => vec![kind.version().to_string()],
        }
    }

    /// Update the installed ClusterNetworkPolicy CRD so that it serves exactly `served`
    /// (among [`CNP_VERSIONS`]; none is allowed): a `v1beta1` entry is added as a copy of
    /// the `v1alpha2` one (same schema, not the storage version) when missing, and every
    /// known version's `served` is set. The stored objects stay; an update like a CRD
    /// upgrade's (404 at a version no longer served). Not found without a CRD.
    pub fn set_cnp_served_versions(&mut self, served: &[&str]) -> Result<Arc<Value>, ApiError> {
        if let Some(v) = served.iter().find(|v| !CNP_VERSIONS.contains(v)) {
            return Err(ApiError::BadRequest {
                message: format!("ClusterNetworkPolicy version {v:?} is not one of {CNP_VERSIONS:?}"),
            });
        }
        let mut obj = (*self.get(Kind::CustomResourceDefinition, None, CNP_CRD_NAME)?).clone();
        let versions = obj["spec"]["versions"]
            .as_array_mut()
            .ok_or_else(|| ApiError::BadRequest {
                message: "the installed ClusterNetworkPolicy CRD has no spec.versions".into(),
            })?;
        let template = versions.iter().find(|v| v["name"] == "v1alpha2").cloned();
        for name in CNP_VERSIONS {
            if !versions.iter().any(|v| v["name"] == name) {
                if let Some(mut copy) = template.clone() {
                    copy["name"] = Value::from(name);
                    copy["storage"] = Value::from(false);
                    versions.push(copy);
                }
            }
        }
        for v in versions.iter_mut() {
            let name = v["name"].as_str().unwrap_or("").to_string();
            if CNP_VERSIONS.contains(&name.as_str()) {
                v["served"] = Value::from(served.contains(&name.as_str()));
            }
        }
        self.update(
            Kind::CustomResourceDefinition,
            None,
            CNP_CRD_NAME,
            obj,
            super::Sub::Main,
        )
    }

    /// The installed ClusterNetworkPolicy CRD, if any.
    pub fn cnp_crd(&self) -> Option<&Arc<InstalledCrd>> {
        self.cnp_crd.as_ref()
    }

    /// Install the vendored CRD of `channel` (create, or update the installed one), exactly as
    /// `kubectl apply -f` of the file would.
    pub fn install_cnp_crd(&mut self, channel: CnpChannel) -> Result<Arc<Value>, ApiError> {
        let obj = channel.crd_object();
        match self.get(Kind::CustomResourceDefinition, None, CNP_CRD_NAME) {
            Err(_) => self.create(Kind::CustomResourceDefinition, None, obj),
            Ok(old) => {
                let mut new = obj;
                new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"].clone();
                self.update(
                    Kind::CustomResourceDefinition,
                    None,
                    CNP_CRD_NAME,
                    new,
                    super::Sub::Main,
                )
            }
        }
    }

    /// 404 when `kind` is a custom resource whose CRD is not installed.
    pub(super) fn check_served(&self, kind: Kind) -> Result<(), ApiError> {
        if self.serves(kind) {
            Ok(())
        } else {
            Err(ApiError::NotServed {
                resource: kind.resource_ref(),
            })
        }
    }

    /// Check a CRD about to be written and set its status; the prepared schema it serves.
    pub(super) fn prepare_crd(&self, obj: &mut Value, old: Option<&Value>) -> Result<InstalledCrd, ApiError> {
        let installed = crd::install(obj).map_err(|causes| invalid(Kind::CustomResourceDefinition, obj, causes))?;
        obj["status"] = crd::crd_status(obj, old, &now_rfc3339());
        Ok(installed)
    }

    /// After a CRD write: serve its schema, and re-prune the stored custom resources by it
    /// (what a real server's reads show after a schema change; same resourceVersion, no event).
    pub(super) fn crd_installed(&mut self, installed: InstalledCrd) {
        let installed = Arc::new(installed);
        let map = &mut self.objects[Kind::ClusterNetworkPolicy.idx()];
        for v in map.values_mut() {
            let mut o = (**v).clone();
            let _ = installed.prune(&mut o);
            if o != **v {
                *v = Arc::new(o);
            }
        }
        self.cnp_crd = Some(installed);
    }

    /// Before a CRD is deleted: delete its custom resources (DELETED events) and stop serving.
    pub(super) fn crd_deleting(&mut self, name: &str) {
        if name != CNP_CRD_NAME {
            return;
        }
        let keys: Vec<String> = self.objects[Kind::ClusterNetworkPolicy.idx()].keys().cloned().collect();
        for k in keys {
            let prev = self.objects[Kind::ClusterNetworkPolicy.idx()][&k].clone();
            self.commit(
                Kind::ClusterNetworkPolicy,
                k,
                EventType::Deleted,
                (*prev).clone(),
                Some(prev),
            );
        }
        self.cnp_crd = None;
    }

    /// Prune a custom resource by its installed schema (always) and validate it (when
    /// `validate`): ObjectMeta rules, then the schema and its CEL rules.
    pub(super) fn prune_and_validate_cr(
        &mut self,
        kind: Kind,
        obj: &mut Value,
        validate: bool,
    ) -> Result<(), ApiError> {
        self.check_served(kind)?;
        let Some(installed) = self.cnp_crd.clone() else {
            return Ok(());
        };
        let pruned = installed.prune(obj);
        match self.field_validation {
            FieldValidation::Strict if !pruned.is_empty() => {
                let list: Vec<String> = pruned.iter().map(|p| format!("unknown field {p:?}")).collect();
                return Err(ApiError::BadRequest {
                    message: format!(
                        "{} in version {:?} cannot be handled as a {}: strict decoding error: {}",
                        kind.kind(),
                        kind.version(),
                        kind.kind(),
                        list.join(", ")
                    ),
                });
            }
            FieldValidation::Warn => self.pruned_fields.extend(pruned),
            _ => {}
        }
        if !validate {
            return Ok(());
        }
        let mut errs = Errs::default();
        validate_meta(obj, false, &mut errs);
        let mut causes = errs.0;
        causes.extend(installed.validate(obj));
        if causes.is_empty() {
            Ok(())
        } else {
            Err(invalid(kind, obj, causes))
        }
    }
}

/// 422 Invalid of `obj` with `causes`.
fn invalid(kind: Kind, obj: &Value, causes: Vec<Cause>) -> ApiError {
    ApiError::Invalid {
        kind: kind.kind().into(),
        group: kind.group().into(),
        group_suffix: kind.group().into(),
        name: meta_str(obj, "name").unwrap_or("").into(),
        causes,
    }
}
