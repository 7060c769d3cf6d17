//! The errors of `kubectl npm`, each saying what to do: which permission is
//! missing (the verb, the resource and the namespace, as `kubectl auth
//! can-i` takes them), which agent is missing or not ready.

use std::fmt;

/// An API request `kubectl npm` makes: what RBAC must grant for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Access {
    /// The verb (`get`, `list`, `create`).
    pub verb: &'static str,
    /// The resource, with its subresource (`pods`, `pods/portforward`).
    pub resource: &'static str,
    /// The namespace; `None`: cluster-wide (every namespace).
    pub namespace: Option<String>,
}

impl Access {
    /// `verb` on `resource` in `namespace` (`None`: every namespace).
    pub fn new(verb: &'static str, resource: &'static str, namespace: Option<&str>) -> Self {
        Access {
            verb,
            resource,
            namespace: namespace.map(String::from),
        }
    }
}

impl fmt::Display for Access {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.namespace {
            Some(ns) => write!(
                f,
                "`{}` on `{}` in namespace {ns} (check: kubectl auth can-i {} {} -n {ns})",
                self.verb, self.resource, self.verb, self.resource
            ),
            None => write!(
                f,
                "`{}` on `{}` in every namespace (check: kubectl auth can-i {} {} --all-namespaces)",
                self.verb, self.resource, self.verb, self.resource
            ),
        }
    }
}

/// Errors of `kubectl npm`.
#[derive(Debug, thiserror::Error)]
pub enum NpmError {
    /// No usable kubeconfig.
    #[error("cannot load the kubeconfig: {0}")]
    Config(String),
    /// The API server refused the request: RBAC does not grant it.
    #[error("forbidden: you need {access}")]
    Forbidden {
        /// What was refused.
        access: Access,
    },
    /// The API server did not accept the credentials.
    #[error("unauthorized: the API server did not accept your credentials for {what} (is your kubeconfig's user or token still valid?)")]
    Unauthorized {
        /// The request.
        what: String,
    },
    /// An object that is not there.
    #[error("{0} not found")]
    NotFound(String),
    /// Any other failure of an API request.
    #[error("{what}: {message}")]
    Api {
        /// The request.
        what: String,
        /// The error.
        message: String,
    },
    /// A pod not scheduled to a node yet: no agent decides for it.
    #[error("pod {0} is not scheduled to a node yet: no agent enforces its policies")]
    NotScheduled(String),
    /// No agent pod on a node.
    #[error(
        "no npm agent on node {node}: no pod with labels {selector} in namespace {namespace} runs there (is the chart installed there? see --agent-namespace, --agent-selector)"
    )]
    NoAgent {
        /// The node.
        node: String,
        /// Where the agents were looked for.
        namespace: String,
        /// Their label selector.
        selector: String,
    },
    /// No agent pod at all.
    #[error(
        "no npm agent pods with labels {selector} in namespace {namespace} (see --agent-namespace, --agent-selector)"
    )]
    NoAgents {
        /// Where the agents were looked for.
        namespace: String,
        /// Their label selector.
        selector: String,
    },
    /// An agent that answered with an error, or could not be reached.
    #[error("the agent on node {node} (pod {pod}){ready}: {message}")]
    Agent {
        /// The node.
        node: String,
        /// `namespace/name` of the agent pod.
        pod: String,
        /// `", not ready: …"` when the API server says the agent pod is not ready.
        ready: String,
        /// What went wrong.
        message: String,
    },
    /// A bad argument.
    #[error("{0}")]
    Usage(String),
    /// `observe`: every followed stream ended, these with an error
    /// (each printed when it ended).
    #[error("the flow streams of {failed} of {streams} nodes failed (see above)")]
    Streams {
        /// Streams that ended with an error.
        failed: usize,
        /// Streams followed.
        streams: usize,
    },
    /// `lint` found errors (printed already).
    #[error("the policies have errors (see the findings)")]
    Findings,
    /// Writing the output failed.
    #[error("writing the output: {0}")]
    Output(String),
}

/// The error of an API request `what` that needs `access`.
pub fn api_error(e: kube::Error, access: Access, what: &str) -> NpmError {
    let code = match &e {
        kube::Error::Api(s) => Some(s.code),
        kube::Error::UpgradeConnection(kube::client::UpgradeConnectionError::ProtocolSwitch(s)) => Some(s.as_u16()),
        _ => None,
    };
    match code {
        Some(403) => NpmError::Forbidden { access },
        Some(401) => NpmError::Unauthorized { what: what.into() },
        Some(404) => NpmError::NotFound(what.into()),
        _ => NpmError::Api {
            what: what.into(),
            message: e.to_string(),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_names_the_verb_resource_and_namespace() {
        let refused =
            |code: u16| kube::Error::Api(kube::core::Status::failure("no", "Refused").with_code(code).boxed());
        let e = api_error(
            refused(403),
            Access::new("create", "pods/portforward", Some("kube-system")),
            "x",
        );
        assert_eq!(
            e.to_string(),
            "forbidden: you need `create` on `pods/portforward` in namespace kube-system \
             (check: kubectl auth can-i create pods/portforward -n kube-system)"
        );
        let e = api_error(refused(401), Access::new("get", "pods", None), "reading pod x/a");
        assert!(e.to_string().starts_with("unauthorized"), "{e}");
        let e = api_error(refused(500), Access::new("list", "pods", None), "listing pods");
        assert!(e.to_string().starts_with("listing pods: "), "{e}");
        assert!(Access::new("list", "pods", None)
            .to_string()
            .contains("--all-namespaces"));
    }
}
