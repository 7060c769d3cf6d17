//! The `npm.io/agent-not-ready:NoSchedule` taint of this agent's Node
//!: a node registered with it (kubelet
//! `--register-with-taints=npm.io/agent-not-ready=:NoSchedule`) gets no
//! pods scheduled until its agent enforces policy; the agent removes it
//! once its first full sync is applied ([`Health::first_sync_done`]).
//!
//! - **Only ours goes.** The removal is one JSON patch (RFC 6902) of
//!   `spec.taints`: a `test` of the whole list as it was read, then a
//!   `replace` with the same list minus the taints with our key and effect
//!   `NoSchedule`. Any concurrent change of the taints (another controller
//!   adding or removing one) fails the `test` (HTTP 422, or 409), and the
//!   agent reads the Node again and recomputes: it never writes back a
//!   stale list, so it never drops (or revives) another controller's taint.
//!   A strategic merge patch would not do: `spec.taints` merges by `key`
//!   there, so a shorter list removes nothing; a merge patch with a
//!   `resourceVersion` precondition would work too, but conflicts on every
//!   unrelated write to the Node (status heartbeats, labels), while the
//!   `test` covers exactly the list it rewrites.
//! - **Idempotent.** A Node without our taint is not written at all; a
//!   Node that does not exist (or an API server that serves no `nodes`)
//!   ends the task with a log line.
//! - **Retried.** Other errors (no RBAC `nodes` `patch`, the API server
//!   down) are retried with backoff (0.5 s doubling to 30 s), counted in
//!   `npm_errors_total{kind="node-taint"}`.
//! - **Once.** The taint is not put back when the agent becomes unready
//!   later: it gates the node's first scheduling only; `/readyz` tells the
//!   rest.
//!
//! The Node is read as a [`DynamicObject`], so that the `test` compares the
//! list exactly as the API server serialized it (no round trip through
//! typed fields).

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Node;
use kube::api::{Api, ApiResource, DynamicObject, Patch, PatchParams};
use serde_json::{json, Value};

use crate::telemetry::{Health, Metrics};

/// The taint's key.
pub const NOT_READY_TAINT_KEY: &str = "npm.io/agent-not-ready";
/// The taint's effect (a taint is identified by key and effect).
pub const NOT_READY_TAINT_EFFECT: &str = "NoSchedule";
/// How often the task looks whether the first full sync is done.
const POLL: Duration = Duration::from_millis(200);
/// The first wait after a failed attempt (doubling).
const FIRST_RETRY: Duration = Duration::from_millis(500);
/// The longest wait between attempts.
const MAX_RETRY: Duration = Duration::from_secs(30);

/// Why one removal attempt failed.
#[derive(Debug, thiserror::Error)]
pub enum TaintError {
    /// Reading the Node failed.
    #[error("reading Node {node}: {source}")]
    Get {
        /// The Node.
        node: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// The patch was refused (a conflict means the taints changed since
    /// they were read).
    #[error("patching the taints of Node {node}: {source}")]
    Patch {
        /// The Node.
        node: String,
        /// kube's error.
        #[source]
        source: kube::Error,
    },
    /// The JSON patch could not be built.
    #[error("building the JSON patch of Node {node}: {source}")]
    Encode {
        /// The Node.
        node: String,
        /// serde's error.
        #[source]
        source: serde_json::Error,
    },
}

impl TaintError {
    /// Whether the taints changed between the read and the patch (the
    /// `test` failed): read again at once.
    pub fn is_conflict(&self) -> bool {
        matches!(self, TaintError::Patch { source: kube::Error::Api(s), .. } if s.code == 409 || s.code == 422)
    }
}

/// What one attempt did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The taint was there and has been removed.
    Removed,
    /// The Node has no such taint: nothing was written.
    Absent,
    /// There is no such Node (or no `nodes` resource): nothing was written.
    NoNode,
}

/// Whether `taint` (one element of `spec.taints`) is ours.
pub fn is_not_ready_taint(taint: &Value) -> bool {
    taint.get("key").and_then(Value::as_str) == Some(NOT_READY_TAINT_KEY)
        && taint.get("effect").and_then(Value::as_str) == Some(NOT_READY_TAINT_EFFECT)
}

/// The JSON patch that removes our taints from `taints` (the Node's
/// `spec.taints` as read), or `None` when there is none of ours: a `test`
/// of the list as read, then a `replace` with every other taint, in order.
pub fn removal_patch(taints: &[Value]) -> Option<Value> {
    if !taints.iter().any(is_not_ready_taint) {
        return None;
    }
    let kept: Vec<&Value> = taints.iter().filter(|t| !is_not_ready_taint(t)).collect();
    Some(json!([
        {"op": "test", "path": "/spec/taints", "value": taints},
        {"op": "replace", "path": "/spec/taints", "value": kept},
    ]))
}

fn nodes(client: kube::Client) -> Api<DynamicObject> {
    Api::all_with(client, &ApiResource::erase::<Node>(&()))
}

/// One attempt: read Node `node`, remove our taint if it has it.
pub async fn remove_once(client: &kube::Client, node: &str) -> Result<Outcome, TaintError> {
    let api = nodes(client.clone());
    let obj = match api.get_opt(node).await {
        Ok(Some(obj)) => obj,
        Ok(None) => return Ok(Outcome::NoNode),
        Err(source) => {
            return Err(TaintError::Get {
                node: node.to_string(),
                source,
            })
        }
    };
    let taints = obj
        .data
        .pointer("/spec/taints")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    let Some(patch) = removal_patch(&taints) else {
        return Ok(Outcome::Absent);
    };
    let patch = serde_json::from_value(patch).map_err(|source| TaintError::Encode {
        node: node.to_string(),
        source,
    })?;
    api.patch(node, &PatchParams::default(), &Patch::<()>::Json(patch))
        .await
        .map_err(|source| TaintError::Patch {
            node: node.to_string(),
            source,
        })?;
    Ok(Outcome::Removed)
}

/// Wait for the first full sync, then remove our taint from Node `node`,
/// retrying until it is done (the agent's task; see the module doc).
pub async fn remove_after_first_sync(client: kube::Client, node: String, health: Arc<Health>, metrics: Metrics) {
    if node.is_empty() {
        return;
    }
    while !health.first_sync_done() {
        tokio::time::sleep(POLL).await;
    }
    let mut backoff = FIRST_RETRY;
    loop {
        match remove_once(&client, &node).await {
            Ok(Outcome::Removed) => {
                tracing::info!(node = %node, taint = NOT_READY_TAINT_KEY, "first full sync applied: removed the not-ready taint");
                return;
            }
            Ok(Outcome::Absent) => {
                tracing::debug!(node = %node, "the Node has no not-ready taint");
                return;
            }
            Ok(Outcome::NoNode) => {
                tracing::info!(node = %node, "no Node object of this name: no not-ready taint to remove");
                return;
            }
            Err(e) if e.is_conflict() => {
                tracing::debug!(node = %node, error = %e, "the Node's taints changed meanwhile; reading it again");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => {
                metrics.error("node-taint");
                tracing::warn!(node = %node, error = %e, retry_in_ms = backoff.as_millis() as u64, "removing the not-ready taint failed");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_RETRY);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_our_taint_goes_and_the_list_is_tested_as_read() {
        let taints = vec![
            json!({"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "timeAdded": "2026-01-01T00:00:00Z"}),
            json!({"key": NOT_READY_TAINT_KEY, "effect": "NoSchedule"}),
            json!({"key": NOT_READY_TAINT_KEY, "effect": "NoExecute"}),
            json!({"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}),
        ];
        let patch = removal_patch(&taints).unwrap();
        assert_eq!(patch[0], json!({"op": "test", "path": "/spec/taints", "value": taints}));
        assert_eq!(patch[1]["op"], "replace");
        assert_eq!(
            patch[1]["value"],
            json!([taints[0], taints[2], taints[3]]),
            "same key with another effect is another taint"
        );
        // With a value (`--register-with-taints=npm.io/agent-not-ready=x:NoSchedule`) it is ours too.
        let only = vec![json!({"key": NOT_READY_TAINT_KEY, "value": "x", "effect": "NoSchedule"})];
        assert_eq!(removal_patch(&only).unwrap()[1]["value"], json!([]));
    }

    #[test]
    fn no_taint_of_ours_writes_nothing() {
        assert_eq!(removal_patch(&[]), None);
        assert_eq!(
            removal_patch(&[json!({"key": "dedicated", "effect": "NoSchedule"})]),
            None
        );
    }
}
