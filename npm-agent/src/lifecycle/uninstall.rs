//! `npm-agent uninstall stop-agents|wait-cleanup`: the two Jobs of the
//! chart's pre-delete hooks (see `charts/npm-agent/README.md`).
//!
//! - [`stop_agents`] deletes the agent DaemonSet with
//!   `propagationPolicy=Foreground` (the API server keeps it until its pods
//!   are gone) and waits until a GET answers 404, so no agent re-creates
//!   what the cleanup removes. A DaemonSet already gone is success.
//! - [`wait_cleanup`] waits until the cleanup DaemonSet's controller has
//!   seen its spec (`status.observedGeneration >= metadata.generation`) and
//!   every pod it schedules is Ready (`numberReady ==
//!   desiredNumberScheduled`): each Ready pod's init container ran
//!   `npm-agent cleanup` successfully.
//!
//! Both give up after their timeout with an error naming what remains (the
//! DaemonSet's counts and the pods that are not ready, with their nodes).
//! API errors are retried until then.

use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, DeleteParams, ListParams};

/// Errors of the uninstall steps.
#[derive(Debug, thiserror::Error)]
pub enum UninstallError {
    /// The step did not finish in time.
    #[error("timed out after {}s: {remains}", timeout.as_secs())]
    Timeout {
        /// The timeout.
        timeout: Duration,
        /// What was left (the DaemonSet, its pods, the last API error).
        remains: String,
    },
}

/// What one uninstall step waits on.
#[derive(Clone, Debug)]
pub struct Target {
    /// The namespace (`--namespace`).
    pub namespace: String,
    /// The DaemonSet (`--daemonset`).
    pub daemonset: String,
    /// How long to wait (`--timeout-seconds`).
    pub timeout: Duration,
    /// Time between two reads.
    pub poll: Duration,
}

impl Target {
    fn name(&self) -> String {
        format!("DaemonSet {}/{}", self.namespace, self.daemonset)
    }
}

/// The pods the DaemonSet selects (by its `matchLabels`) that are not
/// Ready, as `pod on node`; `None` when they cannot be listed.
async fn unready_pods(client: &kube::Client, t: &Target, ds: &DaemonSet) -> Option<Vec<String>> {
    let labels = ds.spec.as_ref()?.selector.match_labels.as_ref()?;
    let selector: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
    let pods: Api<Pod> = Api::namespaced(client.clone(), &t.namespace);
    let list = pods
        .list(&ListParams::default().labels(&selector.join(",")))
        .await
        .ok()?;
    Some(
        list.items
            .iter()
            .filter(|p| {
                !p.status
                    .as_ref()
                    .and_then(|s| s.conditions.as_ref())
                    .is_some_and(|c| c.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
            })
            .map(|p| {
                let node = p
                    .spec
                    .as_ref()
                    .and_then(|s| s.node_name.as_deref())
                    .unwrap_or("(unscheduled)");
                format!("{} on {node}", p.metadata.name.as_deref().unwrap_or("?"))
            })
            .collect(),
    )
}

/// The DaemonSet's state as one phrase (generation, counts).
fn describe(ds: &DaemonSet) -> String {
    let generation = ds.metadata.generation.unwrap_or(0);
    let status = ds.status.clone().unwrap_or_default();
    let observed = status.observed_generation.unwrap_or(0);
    let mut s = format!(
        "{}/{} pods ready, {} scheduled",
        status.number_ready, status.desired_number_scheduled, status.current_number_scheduled
    );
    if observed < generation {
        s.push_str(&format!(
            ", observedGeneration {observed} < generation {generation} (the controller has not seen the spec)"
        ));
    }
    if ds.metadata.deletion_timestamp.is_some() {
        s.push_str(", being deleted");
    }
    s
}

async fn remains(client: &kube::Client, t: &Target, ds: &DaemonSet, last_error: &Option<String>) -> String {
    let mut s = format!("{} still exists ({})", t.name(), describe(ds));
    if let Some(pods) = unready_pods(client, t, ds).await {
        if !pods.is_empty() {
            s.push_str(&format!("; pods not ready: {}", pods.join(", ")));
        }
    }
    if let Some(e) = last_error {
        s.push_str(&format!("; last API error: {e}"));
    }
    s
}

/// Delete the DaemonSet (foreground) and wait until it is gone.
pub async fn stop_agents(client: &kube::Client, t: &Target) -> Result<(), UninstallError> {
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), &t.namespace);
    let deadline = tokio::time::Instant::now() + t.timeout;
    let mut deleted = false;
    let mut last_error = None;
    let mut last_seen: Option<DaemonSet> = None;
    loop {
        match api.get_opt(&t.daemonset).await {
            Ok(None) => {
                if deleted || last_seen.is_some() {
                    tracing::info!(daemonset = %t.name(), "agents stopped: the DaemonSet is gone");
                } else {
                    tracing::info!(daemonset = %t.name(), "no such DaemonSet: nothing to stop");
                }
                return Ok(());
            }
            Ok(Some(ds)) => {
                if !deleted {
                    match api.delete(&t.daemonset, &DeleteParams::foreground()).await {
                        Ok(_) => {
                            deleted = true;
                            tracing::info!(daemonset = %t.name(), "deleted (foreground); waiting for its pods to go");
                        }
                        Err(kube::Error::Api(e)) if e.code == 404 => return Ok(()),
                        Err(e) => last_error = Some(format!("delete: {e}")),
                    }
                }
                last_seen = Some(ds);
            }
            Err(e) => last_error = Some(format!("get: {e}")),
        }
        if tokio::time::Instant::now() + t.poll > deadline {
            let remains = match &last_seen {
                Some(ds) => remains(client, t, ds, &last_error).await,
                None => format!(
                    "{} could not be read; last API error: {}",
                    t.name(),
                    last_error.as_deref().unwrap_or("none")
                ),
            };
            return Err(UninstallError::Timeout {
                timeout: t.timeout,
                remains,
            });
        }
        tokio::time::sleep(t.poll).await;
    }
}

/// Whether the DaemonSet's controller has seen its spec and every pod it
/// schedules is Ready.
pub fn rolled_out(ds: &DaemonSet) -> bool {
    let Some(status) = &ds.status else {
        return false;
    };
    let generation = ds.metadata.generation.unwrap_or(0);
    status.observed_generation.unwrap_or(0) >= generation && status.number_ready == status.desired_number_scheduled
}

/// Wait until the DaemonSet is Ready on every node it is scheduled to.
pub async fn wait_cleanup(client: &kube::Client, t: &Target) -> Result<(), UninstallError> {
    let api: Api<DaemonSet> = Api::namespaced(client.clone(), &t.namespace);
    let deadline = tokio::time::Instant::now() + t.timeout;
    let mut last_error = None;
    let mut last_seen: Option<DaemonSet> = None;
    loop {
        match api.get_opt(&t.daemonset).await {
            Ok(Some(ds)) if rolled_out(&ds) => {
                tracing::info!(daemonset = %t.name(), state = %describe(&ds), "cleanup done on every node");
                return Ok(());
            }
            Ok(Some(ds)) => last_seen = Some(ds),
            Ok(None) => {
                last_seen = None;
                last_error = Some("the DaemonSet does not exist".into());
            }
            Err(e) => last_error = Some(format!("get: {e}")),
        }
        if tokio::time::Instant::now() + t.poll > deadline {
            let remains = match &last_seen {
                Some(ds) => {
                    let mut s = format!("{} is not ready ({})", t.name(), describe(ds));
                    if let Some(pods) = unready_pods(client, t, ds).await {
                        if !pods.is_empty() {
                            s.push_str(&format!("; pods not ready: {}", pods.join(", ")));
                        }
                    }
                    if let Some(e) = &last_error {
                        s.push_str(&format!("; last API error: {e}"));
                    }
                    s
                }
                None => format!("{}: {}", t.name(), last_error.as_deref().unwrap_or("not found")),
            };
            return Err(UninstallError::Timeout {
                timeout: t.timeout,
                remains,
            });
        }
        tokio::time::sleep(t.poll).await;
    }
}
