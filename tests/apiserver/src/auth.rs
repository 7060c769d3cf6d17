//! Tokens and RBAC: what `TokenReview` and `SubjectAccessReview` answer.
//!
//! The server itself authenticates nobody (plain HTTP, every request is
//! served); what it keeps here is what a component under test asks about a
//! third party: tokens registered by the test ([`Auth::add_token`]) and the
//! RBAC objects it loads ([`Auth::add_rbac`]: `ClusterRole`,
//! `ClusterRoleBinding`, `Role`, `RoleBinding` as JSON, e.g. a chart's
//! rendered manifests), evaluated as the real authorizer does: rules are
//! additive (no deny), a verb or resource `*` matches all, a non-resource
//! URL ending in `*` matches by prefix, a `RoleBinding` grants only in its
//! namespace, and a ServiceAccount subject is the user
//! `system:serviceaccount:<ns>:<name>`. Aggregated ClusterRoles are not
//! resolved.

use std::collections::{BTreeMap, HashMap};

use serde_json::{json, Value};

/// Who a token authenticates as.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UserInfo {
    /// `user.username`.
    pub username: String,
    /// `user.uid`.
    pub uid: String,
    /// `user.groups` (`system:authenticated` is added on review).
    pub groups: Vec<String>,
    /// `user.extra` (e.g. `authentication.kubernetes.io/node-name`).
    pub extra: BTreeMap<String, Vec<String>>,
}

/// The attributes one access review asks about.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Attributes {
    /// Verb (`get`, `create`...).
    pub verb: String,
    /// A non-resource URL (`/metrics`), or empty for a resource request.
    pub path: String,
    /// API group of the resource (`""` for core).
    pub group: String,
    /// Resource (`pods`).
    pub resource: String,
    /// Subresource (`portforward`), or empty.
    pub subresource: String,
    /// Namespace, empty for cluster-scoped or all namespaces.
    pub namespace: String,
    /// Object name, or empty.
    pub name: String,
}

/// Tokens and RBAC objects.
#[derive(Debug, Default)]
pub struct Auth {
    tokens: HashMap<String, UserInfo>,
    /// ClusterRoles by name and Roles by (namespace, name): their rules.
    cluster_roles: HashMap<String, Vec<Value>>,
    roles: HashMap<(String, String), Vec<Value>>,
    /// Bindings: (namespace of a RoleBinding or `None`, roleRef kind, roleRef name, subjects).
    bindings: Vec<(Option<String>, String, String, Vec<Value>)>,
}

fn strs(v: &Value) -> Vec<&str> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default()
}

fn has(list: &[&str], want: &str) -> bool {
    list.iter().any(|x| *x == "*" || *x == want)
}

impl Auth {
    /// Registers `token` as authenticating `user`.
    pub fn add_token(&mut self, token: &str, user: UserInfo) {
        self.tokens.insert(token.to_string(), user);
    }

    /// Loads RBAC objects (other kinds are ignored); returns how many were loaded.
    pub fn add_rbac(&mut self, objects: &[Value]) -> usize {
        let mut n = 0;
        for o in objects {
            let meta = &o["metadata"];
            let name = meta["name"].as_str().unwrap_or("").to_string();
            let ns = meta["namespace"].as_str().unwrap_or("default").to_string();
            let rules = o["rules"].as_array().cloned().unwrap_or_default();
            let binding = |ns: Option<String>| {
                (
                    ns,
                    o["roleRef"]["kind"].as_str().unwrap_or("").to_string(),
                    o["roleRef"]["name"].as_str().unwrap_or("").to_string(),
                    o["subjects"].as_array().cloned().unwrap_or_default(),
                )
            };
            match o["kind"].as_str() {
                Some("ClusterRole") => {
                    self.cluster_roles.insert(name, rules);
                }
                Some("Role") => {
                    self.roles.insert((ns, name), rules);
                }
                Some("ClusterRoleBinding") => self.bindings.push(binding(None)),
                Some("RoleBinding") => self.bindings.push(binding(Some(ns))),
                _ => continue,
            }
            n += 1;
        }
        n
    }

    /// The user `token` authenticates, if registered.
    pub fn user(&self, token: &str) -> Option<UserInfo> {
        self.tokens.get(token).cloned()
    }

    /// The answer to a `TokenReview` body.
    pub fn token_review(&self, review: &Value) -> Value {
        let token = review["spec"]["token"].as_str().unwrap_or("");
        let status = match self.tokens.get(token) {
            Some(u) => {
                let mut groups = u.groups.clone();
                groups.push("system:authenticated".into());
                json!({"authenticated": true, "user": {
                    "username": u.username, "uid": u.uid, "groups": groups, "extra": u.extra}})
            }
            None => json!({"authenticated": false, "error": "invalid bearer token"}),
        };
        json!({"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
               "metadata": {}, "spec": review["spec"], "status": status})
    }

    /// The answer to a `SubjectAccessReview` body.
    pub fn access_review(&self, review: &Value) -> Value {
        let spec = &review["spec"];
        let user = spec["user"].as_str().unwrap_or("");
        let groups = strs(&spec["groups"]);
        let attrs = if spec["nonResourceAttributes"].is_object() {
            let a = &spec["nonResourceAttributes"];
            Attributes {
                verb: a["verb"].as_str().unwrap_or("").into(),
                path: a["path"].as_str().unwrap_or("").into(),
                ..Default::default()
            }
        } else {
            let a = &spec["resourceAttributes"];
            let s = |k: &str| a[k].as_str().unwrap_or("").to_string();
            Attributes {
                verb: s("verb"),
                group: s("group"),
                resource: s("resource"),
                subresource: s("subresource"),
                namespace: s("namespace"),
                name: s("name"),
                ..Default::default()
            }
        };
        let allowed = self.allowed(user, &groups, &attrs);
        let mut status = json!({"allowed": allowed});
        if !allowed {
            status["reason"] = json!("no RBAC rule grants it");
        }
        json!({"apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
               "metadata": {}, "spec": spec, "status": status})
    }

    /// Whether RBAC grants `attrs` to `user` in `groups`.
    pub fn allowed(&self, user: &str, groups: &[&str], attrs: &Attributes) -> bool {
        self.bindings.iter().any(|(bns, kind, role, subjects)| {
            let subject = subjects.iter().any(|s| {
                let name = s["name"].as_str().unwrap_or("");
                match s["kind"].as_str() {
                    Some("User") => name == user,
                    Some("Group") => groups.contains(&name),
                    Some("ServiceAccount") => {
                        let ns = s["namespace"].as_str().or(bns.as_deref()).unwrap_or("");
                        user == format!("system:serviceaccount:{ns}:{name}")
                    }
                    _ => false,
                }
            });
            if !subject {
                return false;
            }
            // A RoleBinding grants in its namespace only (never non-resource URLs).
            if let Some(ns) = bns {
                if !attrs.path.is_empty() || *ns != attrs.namespace {
                    return false;
                }
            }
            let rules = match kind.as_str() {
                "ClusterRole" => self.cluster_roles.get(role),
                "Role" => bns.as_ref().and_then(|ns| self.roles.get(&(ns.clone(), role.clone()))),
                _ => None,
            };
            rules.is_some_and(|rs| rs.iter().any(|r| rule_matches(r, attrs)))
        })
    }
}

fn rule_matches(r: &Value, a: &Attributes) -> bool {
    if !has(&strs(&r["verbs"]), &a.verb) {
        return false;
    }
    if !a.path.is_empty() {
        return strs(&r["nonResourceURLs"]).iter().any(|u| match u.strip_suffix('*') {
            Some(prefix) => a.path.starts_with(prefix),
            None => *u == a.path,
        });
    }
    let resource = if a.subresource.is_empty() {
        a.resource.clone()
    } else {
        format!("{}/{}", a.resource, a.subresource)
    };
    let names = strs(&r["resourceNames"]);
    has(&strs(&r["apiGroups"]), &a.group)
        && has(&strs(&r["resources"]), &resource)
        && (names.is_empty() || (!a.name.is_empty() && names.contains(&a.name.as_str())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rbac() -> Auth {
        let mut a = Auth::default();
        a.add_rbac(&[
            json!({"kind": "ClusterRole", "metadata": {"name": "metrics-reader"},
                   "rules": [{"nonResourceURLs": ["/metrics"], "verbs": ["get"]}]}),
            json!({"kind": "ClusterRoleBinding", "metadata": {"name": "prom"},
                   "roleRef": {"kind": "ClusterRole", "name": "metrics-reader"},
                   "subjects": [{"kind": "ServiceAccount", "name": "prometheus", "namespace": "monitoring"}]}),
            json!({"kind": "Role", "metadata": {"name": "debug", "namespace": "npm-system"},
                   "rules": [{"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]}]}),
            json!({"kind": "RoleBinding", "metadata": {"name": "debug", "namespace": "npm-system"},
                   "roleRef": {"kind": "Role", "name": "debug"},
                   "subjects": [{"kind": "Group", "name": "sre"}]}),
        ]);
        a
    }

    #[test]
    fn non_resource_and_namespaced_grants() {
        let a = rbac();
        let metrics = Attributes {
            verb: "get".into(),
            path: "/metrics".into(),
            ..Default::default()
        };
        assert!(a.allowed("system:serviceaccount:monitoring:prometheus", &[], &metrics));
        assert!(!a.allowed("system:serviceaccount:default:prometheus", &[], &metrics));
        let post = Attributes {
            verb: "post".into(),
            ..metrics.clone()
        };
        assert!(!a.allowed("system:serviceaccount:monitoring:prometheus", &[], &post));
        let pf = Attributes {
            verb: "create".into(),
            resource: "pods".into(),
            subresource: "portforward".into(),
            namespace: "npm-system".into(),
            name: "npm-agent-x".into(),
            ..Default::default()
        };
        assert!(a.allowed("alice", &["sre"], &pf));
        assert!(!a.allowed("alice", &["dev"], &pf));
        let other_ns = Attributes {
            namespace: "default".into(),
            ..pf.clone()
        };
        assert!(!a.allowed("alice", &["sre"], &other_ns));
    }

    #[test]
    fn token_review_answers() {
        let mut a = rbac();
        a.add_token(
            "t1",
            UserInfo {
                username: "alice".into(),
                ..Default::default()
            },
        );
        let ok = a.token_review(&json!({"spec": {"token": "t1"}}));
        assert_eq!(ok["status"]["authenticated"], true);
        assert_eq!(ok["status"]["user"]["username"], "alice");
        let bad = a.token_review(&json!({"spec": {"token": "nope"}}));
        assert_eq!(bad["status"]["authenticated"], false);
    }
}
