//! `kubectl npm lint`, `exposure` and `preview`: `npmctl`'s analyses
//! (`npm_policy::analysis`) on the live cluster's state, read once as the
//! agent reads it (`npm_agent::k8s::direct_read`: Namespaces, Pods,
//! NetworkPolicies, ClusterNetworkPolicies when served, Nodes) and
//! converted as the agent converts it. Needs `list` on those five
//! resources, cluster-wide. No agent is asked.

use std::path::{Path, PathBuf};

use ipnet::IpNet;
use npm_agent::k8s::WatchError;
use npm_policy::model::Snapshot;

use crate::cluster::Cluster;
use crate::error::{api_error, Access, NpmError};
use crate::output::{print, Output};

/// Objects per page of the lists.
const PAGE: u32 = 500;

/// The cluster's state as a snapshot.
pub async fn live_snapshot(cluster: &Cluster) -> Result<Snapshot, NpmError> {
    let state = npm_agent::k8s::direct_read(&cluster.client, PAGE)
        .await
        .map_err(|e| match e {
            WatchError::DirectList { resource, source } => {
                api_error(source, Access::new("list", resource, None), &format!("list {resource}"))
            }
            other => NpmError::Api {
                what: "reading the cluster's state".into(),
                message: other.to_string(),
            },
        })?;
    Ok(npm_agent::reconcile::compiler::snapshot(
        &state,
        &npm_agent::cni::NodeFacts::default(),
        &npm_agent::reconcile::compiler::LastValid::default(),
    ))
}

/// The compile options of the analyses: no node of the cluster is "this
/// node" (ingress from a node is not special-cased).
fn options() -> npm_policy::compiled::CompileOptions {
    npm_sim::sim::sim_options()
}

/// `kubectl npm lint`; `Ok(false)` when a finding is an error.
pub async fn lint(cluster: &Cluster, output: Output) -> Result<bool, NpmError> {
    let s = live_snapshot(cluster).await?;
    let findings = npm_policy::analysis::lint::lint(&s, &options());
    let errors = findings
        .iter()
        .filter(|f| f.severity == npm_policy::analysis::lint::Severity::Error)
        .count();
    print(&findings, output, || {
        let mut out: String = findings.iter().map(|f| format!("{f}\n")).collect();
        out.push_str(&format!("{} findings ({errors} errors)\n", findings.len()));
        out
    })?;
    Ok(errors == 0)
}

/// `kubectl npm exposure`.
pub async fn exposure(cluster: &Cluster, cidrs: &[IpNet], output: Output) -> Result<(), NpmError> {
    let s = live_snapshot(cluster).await?;
    let e = npm_policy::analysis::exposure::exposure(&s, &options(), cidrs);
    print(&e, output, || e.to_string())
}

fn read(path: &Path) -> Result<String, NpmError> {
    if path.as_os_str() == "-" {
        return std::io::read_to_string(std::io::stdin()).map_err(|e| NpmError::Usage(format!("stdin: {e}")));
    }
    std::fs::read_to_string(path).map_err(|e| NpmError::Usage(format!("{}: {e}", path.display())))
}

/// `kubectl npm preview [--apply FILE]... [--delete OBJECT]... --flows FILE`.
pub async fn preview(
    cluster: &Cluster,
    apply: &[PathBuf],
    delete: &[String],
    flows: &Path,
    output: Output,
) -> Result<(), NpmError> {
    let current = live_snapshot(cluster).await?;
    let mut inputs = Vec::new();
    for f in apply {
        inputs.push((f.display().to_string(), read(f)?));
    }
    let mut new = current.clone();
    npm_sim::sim::apply_yaml(&mut new, &inputs).map_err(|e| NpmError::Usage(e.to_string()))?;
    for d in delete {
        npm_sim::analysis::delete_object(&mut new, d).map_err(NpmError::Usage)?;
    }
    let records = npm_sim::analysis::parse_flow_records(&read(flows)?)
        .map_err(|e| NpmError::Usage(format!("{}: {e}", flows.display())))?;
    if records.allowed == 0 {
        eprintln!(
            "warning: no allowed flow recorded (the agents log allowed flows only with --flow-logs-allow): \
             a change that would deny traffic cannot show"
        );
    }
    let p = npm_policy::analysis::preview::preview(&current, &new, &options(), &records.flows);
    print(&p, output, || p.to_string())
}
