//! Writes to the store: create, update (PUT and `/status`), patch (including server-side
//! apply creating a missing object) and delete (cascading from a namespace), with type
//! checks, immutable metadata, generation bumps, defaulting and validation.

use super::meta::{meta_str, new_uid, now_rfc3339, random_suffix, rv_of, set_rv};
use super::{key_of, EventType, Kind, Store};
use crate::error::ApiError;
use crate::patch::{apply_patch, PatchKind};
use crate::{validate, validate_network};
use serde_json::{json, Value};
use std::ops::Bound;
use std::sync::Arc;

/// Subresource addressed by a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sub {
    /// The main resource (status changes are ignored for kinds with a status subresource).
    Main,
    /// The `/status` subresource (only status changes are kept).
    Status,
}

/// 409 Conflict on the object `name` of `kind`.
fn conflict(kind: Kind, name: &str, detail: String) -> ApiError {
    ApiError::Conflict {
        resource: kind.resource_ref(),
        group: kind.group().into(),
        name: name.into(),
        detail,
    }
}

/// 409 when the precondition `want` on `metadata.<field>` of `old` does not hold
/// (`label` names the field in the message, as the real server words it).
fn check_precondition(
    kind: Kind,
    name: &str,
    old: &Value,
    field: &str,
    label: &str,
    want: Option<&str>,
) -> Result<(), ApiError> {
    if let Some(want) = want {
        if Some(want) != meta_str(old, field) {
            return Err(conflict(
                kind,
                name,
                format!(
                    "Precondition failed: {label} in precondition: {want}, {label} in object meta: {}",
                    meta_str(old, field).unwrap_or("")
                ),
            ));
        }
    }
    Ok(())
}

/// Set the object's `kind` and `apiVersion` to those of `kind`.
fn set_type_meta(kind: Kind, obj: &mut Value) {
    obj["kind"] = json!(kind.kind());
    obj["apiVersion"] = json!(kind.api_version());
}

impl Store {
    fn default_and_validate(&mut self, kind: Kind, obj: &mut Value) -> Result<(), ApiError> {
        if kind == Kind::ClusterNetworkPolicy {
            return self.prune_and_validate_cr(kind, obj, self.validation);
        }
        match kind {
            Kind::Namespace => validate::default_namespace(obj),
            Kind::Pod => validate::default_pod(obj),
            Kind::NetworkPolicy => validate::default_network_policy(obj),
            Kind::DaemonSet => validate::default_daemon_set(obj),
            Kind::Event | Kind::Node | Kind::ClusterNetworkPolicy => {}
            Kind::CustomResourceDefinition => crate::crd::default_crd(obj),
            Kind::Service => validate_network::default_service(obj),
            Kind::EndpointSlice => validate_network::default_endpoint_slice(obj),
        }
        if !self.validation {
            return Ok(());
        }
        let causes = match kind {
            Kind::Namespace => validate::validate_namespace(obj),
            Kind::Pod => validate::validate_pod(obj),
            Kind::NetworkPolicy => validate::validate_network_policy(obj),
            Kind::DaemonSet => validate::validate_daemon_set(obj),
            Kind::Event => validate::validate_event(obj),
            Kind::Service => validate_network::validate_service(obj),
            Kind::EndpointSlice => validate_network::validate_endpoint_slice(obj),
            Kind::Node => validate_network::validate_node(obj),
            // The CRD itself is checked by `prepare_crd` (also without validation: it
            // must be servable); custom resources returned above.
            Kind::CustomResourceDefinition | Kind::ClusterNetworkPolicy => Vec::new(),
        };
        if causes.is_empty() {
            Ok(())
        } else {
            Err(ApiError::Invalid {
                kind: kind.kind().into(),
                group: kind.group().into(),
                group_suffix: kind.group().into(),
                name: meta_str(obj, "name").unwrap_or("").into(),
                causes,
            })
        }
    }

    fn check_type(kind: Kind, obj: &Value) -> Result<(), ApiError> {
        if !obj.is_object() {
            return Err(ApiError::BadRequest {
                message: format!("the body of a {} must be a JSON object", kind.kind()),
            });
        }
        for (field, want) in [("kind", kind.kind()), ("apiVersion", kind.api_version())] {
            if let Some(v) = obj.get(field) {
                if v.as_str() != Some(want) && !v.is_null() {
                    return Err(ApiError::BadRequest {
                        message: format!("the object's {field} {v} does not match the request's {want:?}"),
                    });
                }
            }
        }
        if let Some(m) = obj.get("metadata") {
            if !m.is_object() && !m.is_null() {
                return Err(ApiError::BadRequest {
                    message: "metadata must be an object".into(),
                });
            }
        }
        Ok(())
    }

    fn ensure_namespace(&self, ns: &str) -> Result<(), ApiError> {
        if self.objects[Kind::Namespace.idx()].contains_key(ns) {
            Ok(())
        } else {
            Err(Self::not_found(Kind::Namespace, ns))
        }
    }

    /// Create an object (POST). `ns` is the namespace from the URL for namespaced kinds.
    pub fn create(&mut self, kind: Kind, ns: Option<&str>, mut obj: Value) -> Result<Arc<Value>, ApiError> {
        Self::check_type(kind, &obj)?;
        set_type_meta(kind, &mut obj);
        if !obj.get("metadata").is_some_and(Value::is_object) {
            obj["metadata"] = json!({});
        }
        let meta = obj["metadata"].as_object_mut().expect("set above");
        let name = match meta.get("name").and_then(Value::as_str) {
            Some(n) if !n.is_empty() => n.to_string(),
            _ => match meta.get("generateName").and_then(Value::as_str) {
                Some(g) if !g.is_empty() => {
                    let n = format!("{g}{}", random_suffix());
                    meta.insert("name".into(), json!(n));
                    n
                }
                _ => String::new(),
            },
        };
        if kind.namespaced() {
            let url_ns = ns.unwrap_or("default");
            if let Some(body_ns) = meta.get("namespace").and_then(Value::as_str) {
                if !body_ns.is_empty() && body_ns != url_ns {
                    return Err(ApiError::BadRequest {
                        message:
                            "the namespace of the provided object does not match the namespace sent on the request"
                                .into(),
                    });
                }
            }
            meta.insert("namespace".into(), json!(url_ns));
        } else {
            meta.remove("namespace");
        }
        meta.remove("resourceVersion");
        meta.remove("deletionTimestamp");
        meta.remove("managedFields");
        meta.insert("uid".into(), json!(new_uid()));
        meta.insert("creationTimestamp".into(), json!(now_rfc3339()));
        if kind != Kind::Namespace {
            meta.insert("generation".into(), json!(1));
        }
        if kind == Kind::ClusterNetworkPolicy {
            // The status subresource is enabled: a create does not set status.
            if let Some(o) = obj.as_object_mut() {
                o.remove("status");
            }
        }
        self.default_and_validate(kind, &mut obj)?;
        let crd = match kind {
            Kind::CustomResourceDefinition => Some(self.prepare_crd(&mut obj, None)?),
            _ => None,
        };
        let ns_owned = kind.namespaced().then(|| ns.unwrap_or("default").to_string());
        if kind == Kind::Service {
            self.allocate_service(ns_owned.as_deref(), &mut obj, None)?;
        }
        if let Some(n) = &ns_owned {
            self.ensure_namespace(n)?;
        }
        let key = key_of(ns_owned.as_deref(), &name);
        if self.objects[kind.idx()].contains_key(&key) {
            return Err(ApiError::AlreadyExists {
                resource: kind.resource_ref(),
                group: kind.group().into(),
                name,
            });
        }
        let created = self.commit(kind, key, EventType::Added, obj, None);
        if let Some(c) = crd {
            self.crd_installed(c);
        }
        Ok(created)
    }

    /// Replace an object (PUT, also the final step of PATCH).
    pub fn update(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        mut new: Value,
        sub: Sub,
    ) -> Result<Arc<Value>, ApiError> {
        Self::check_type(kind, &new)?;
        let key = key_of(ns, name);
        let old = self.objects[kind.idx()]
            .get(&key)
            .cloned()
            .ok_or_else(|| Self::not_found(kind, name))?;
        if !new.get("metadata").is_some_and(Value::is_object) {
            new["metadata"] = json!({});
        }
        if let Some(n) = meta_str(&new, "name") {
            if n != name {
                return Err(ApiError::BadRequest {
                    message: format!("the name of the object ({n}) does not match the name on the URL ({name})"),
                });
            }
        }
        if let Some(rv) = meta_str(&new, "resourceVersion") {
            if !rv.is_empty() && rv != meta_str(&old, "resourceVersion").unwrap_or("") {
                return Err(conflict(
                    kind,
                    name,
                    "the object has been modified; please apply your changes to the latest version and try again"
                        .into(),
                ));
            }
        }
        let uid = meta_str(&new, "uid").filter(|u| !u.is_empty());
        check_precondition(kind, name, &old, "uid", "UID", uid)?;
        let mut obj = match sub {
            Sub::Status => {
                let mut o = (*old).clone();
                o["status"] = new.get("status").cloned().unwrap_or(json!({}));
                o
            }
            Sub::Main => {
                if kind.has_status() {
                    match old.get("status") {
                        Some(s) => new["status"] = s.clone(),
                        None => {
                            if let Some(o) = new.as_object_mut() {
                                o.remove("status");
                            }
                        }
                    }
                }
                new
            }
        };
        set_type_meta(kind, &mut obj);
        {
            let meta = obj["metadata"].as_object_mut().expect("metadata is an object");
            meta.insert("name".into(), json!(name));
            if let Some(ns) = ns {
                meta.insert("namespace".into(), json!(ns));
            }
            for f in ["uid", "creationTimestamp", "generation"] {
                match old["metadata"].get(f) {
                    Some(v) => meta.insert(f.into(), v.clone()),
                    None => meta.remove(f),
                };
            }
            meta.remove("managedFields");
        }
        if kind == Kind::Service {
            validate_network::drop_type_dependent_fields(&mut obj, &old);
        }
        self.default_and_validate(kind, &mut obj)?;
        let crd = match kind {
            Kind::CustomResourceDefinition => Some(self.prepare_crd(&mut obj, Some(&old))?),
            _ => None,
        };
        if kind == Kind::Service {
            self.allocate_service(ns, &mut obj, Some(&old))?;
        }
        if kind == Kind::EndpointSlice && obj.get("addressType") != old.get("addressType") {
            return Err(ApiError::Invalid {
                kind: kind.kind().into(),
                group: kind.group().into(),
                group_suffix: kind.group().into(),
                name: name.into(),
                causes: vec![crate::error::Cause {
                    reason: "FieldValueInvalid".into(),
                    message: format!("Invalid value: {}: field is immutable", obj["addressType"]),
                    field: "addressType".into(),
                }],
            });
        }
        if kind != Kind::Namespace && obj.get("spec") != old.get("spec") {
            let g = old.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(0);
            obj["metadata"]["generation"] = json!(g + 1);
        }
        set_rv(&mut obj, rv_of(&old));
        if obj == *old {
            return Ok(old);
        }
        let updated = self.commit(kind, key, EventType::Modified, obj, Some(old));
        if let Some(c) = crd {
            self.crd_installed(c);
        }
        Ok(updated)
    }

    /// Patch an object (PATCH). Server-side apply creates the object when it is missing.
    /// Returns the object and whether it was created.
    pub fn patch(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        pk: PatchKind,
        body: &[u8],
        sub: Sub,
    ) -> Result<(Arc<Value>, bool), ApiError> {
        let old = match self.get(kind, ns, name) {
            Ok(o) => o,
            Err(e) => {
                if pk == PatchKind::Apply && sub == Sub::Main {
                    let mut obj = json!({"metadata": {"name": name}});
                    apply_patch(&mut obj, pk, body)?;
                    if meta_str(&obj, "name") != Some(name) {
                        return Err(ApiError::BadRequest {
                            message: "the name of the applied object does not match the URL".into(),
                        });
                    }
                    return Ok((self.create(kind, ns, obj)?, true));
                }
                return Err(e);
            }
        };
        let mut obj = (*old).clone();
        apply_patch(&mut obj, pk, body)?;
        if pk == PatchKind::Apply {
            // An apply configuration never carries a precondition.
            set_rv(&mut obj, rv_of(&old));
        }
        Ok((self.update(kind, ns, name, obj, sub)?, false))
    }

    /// Delete an object; deleting a namespace first deletes every object in it.
    /// `precondition_rv`/`precondition_uid` come from DeleteOptions.preconditions.
    pub fn delete(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        precondition_rv: Option<&str>,
        precondition_uid: Option<&str>,
    ) -> Result<Arc<Value>, ApiError> {
        let key = key_of(ns, name);
        let old = self.get(kind, ns, name)?;
        check_precondition(kind, name, &old, "resourceVersion", "ResourceVersion", precondition_rv)?;
        check_precondition(kind, name, &old, "uid", "UID", precondition_uid)?;
        if kind == Kind::CustomResourceDefinition {
            self.crd_deleting(name);
        }
        if kind == Kind::Namespace {
            let prefix = format!("{name}/");
            for k in Kind::ALL.into_iter().filter(|k| k.namespaced()) {
                let keys: Vec<String> = self.objects[k.idx()]
                    .range::<String, _>((Bound::Included(&prefix), Bound::Unbounded))
                    .take_while(|(key, _)| key.starts_with(&prefix))
                    .map(|(key, _)| key.clone())
                    .collect();
                for ck in keys {
                    let prev = self.objects[k.idx()][&ck].clone();
                    self.commit(k, ck, EventType::Deleted, (*prev).clone(), Some(prev));
                }
            }
        }
        Ok(self.commit(kind, key, EventType::Deleted, (*old).clone(), Some(old)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn daemon_set_status_generation_and_namespace_cascade() {
        let mut s = Store::new(true, 1000);
        s.create(Kind::Namespace, None, json!({"metadata": {"name": "ns"}}))
            .unwrap();
        let ds = json!({"metadata": {"name": "agent"}, "spec": {
            "selector": {"matchLabels": {"app": "a"}},
            "template": {"metadata": {"labels": {"app": "a"}}, "spec": {"containers": []}}}});
        let created = s.create(Kind::DaemonSet, Some("ns"), ds.clone()).unwrap();
        assert_eq!(created["apiVersion"], "apps/v1");
        assert_eq!(created["kind"], "DaemonSet");
        assert_eq!(created["metadata"]["generation"], 1);
        // A status write keeps the spec and the generation.
        let mut st = (*created).clone();
        st["status"] = json!({"observedGeneration": 1, "desiredNumberScheduled": 2, "numberReady": 1});
        let updated = s.update(Kind::DaemonSet, Some("ns"), "agent", st, Sub::Status).unwrap();
        assert_eq!(updated["status"]["numberReady"], 1);
        assert_eq!(updated["metadata"]["generation"], 1);
        // A spec change bumps the generation and keeps the status.
        let mut spec = (*updated).clone();
        spec["spec"]["minReadySeconds"] = json!(5);
        spec["status"] = json!({});
        let updated = s.update(Kind::DaemonSet, Some("ns"), "agent", spec, Sub::Main).unwrap();
        assert_eq!(updated["metadata"]["generation"], 2);
        assert_eq!(updated["status"]["desiredNumberScheduled"], 2);
        // Invalid: the selector does not select the template.
        let mut bad = ds;
        bad["metadata"]["name"] = json!("bad");
        bad["spec"]["template"]["metadata"]["labels"] = json!({"app": "b"});
        assert!(matches!(
            s.create(Kind::DaemonSet, Some("ns"), bad),
            Err(ApiError::Invalid { .. })
        ));
        // Deleting the namespace deletes its DaemonSets.
        s.delete(Kind::Namespace, None, "ns", None, None).unwrap();
        assert!(s.get(Kind::DaemonSet, Some("ns"), "agent").is_err());
    }
}
