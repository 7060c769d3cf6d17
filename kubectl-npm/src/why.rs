//! `kubectl npm why FROM TO --port P`: each direction of the flow asked of
//! the agent that decides it (the sender's egress on the sender's node,
//! the receiver's ingress on the receiver's node), through the API server,
//! and merged into one report of npm-agent's explain shape: the verdict,
//! the deciding rule, the kernel's dry-run verdict, a mismatch first.

use std::collections::BTreeMap;

use npm_agent::explain::client::fetch_on;
use npm_agent::explain::{DirectionReport, ExplainQuery, ExplainReport};

use crate::cluster::Cluster;
use crate::error::NpmError;
use crate::forward::{agent_error, with_agent};

/// Asks the agents of the nodes of `q`'s ends and merges their answers.
pub async fn why(cluster: &Cluster, q: ExplainQuery) -> Result<ExplainReport, NpmError> {
    let from = cluster.node_of(&q.from).await?;
    let to = cluster.node_of(&q.to).await?;
    let mut nodes: Vec<String> = [&from, &to].into_iter().flatten().map(|(_, n)| n.clone()).collect();
    nodes.dedup();
    if nodes.is_empty() {
        return Err(NpmError::Usage(format!(
            "neither {} nor {} is a pod of the cluster: no npm agent decides that flow",
            q.from, q.to
        )));
    }
    let agents = cluster.agents().await?;
    let asks = nodes.iter().map(|node| {
        let q = q.clone();
        let agents = &agents;
        async move {
            let agent = cluster.agent_of(agents, node)?;
            let report = with_agent(cluster, agent, move |s, label| fetch_on(s, &label, &q))
                .await?
                .map_err(|e| agent_error(agent, e.to_string()))?;
            Ok::<_, NpmError>((node.clone(), report.0))
        }
    });
    let reports: BTreeMap<String, ExplainReport> = futures::future::try_join_all(asks).await?.into_iter().collect();
    fn node(end: &Option<(String, String)>) -> Option<&str> {
        end.as_ref().map(|(_, n)| n.as_str())
    }
    merge(&reports, node(&from), node(&to))
        .ok_or_else(|| NpmError::Usage("the agents' reports have no directions".into()))
}

fn direction<'a>(r: &'a ExplainReport, name: &str) -> Option<&'a DirectionReport> {
    r.directions.iter().find(|d| d.direction == name)
}

/// One report of the agents' `reports` (by node): the egress as the
/// sender's node (`from`) decided it, the ingress as the receiver's node
/// (`to`) did; an end that is no pod is taken from the other node's report.
pub fn merge(reports: &BTreeMap<String, ExplainReport>, from: Option<&str>, to: Option<&str>) -> Option<ExplainReport> {
    let any = reports.values().next()?;
    let of = |node: Option<&str>| node.and_then(|n| reports.get(n)).unwrap_or(any);
    let egress = direction(of(from), "egress")?.clone();
    let ingress = direction(of(to), "ingress")?.clone();
    let base = of(to);
    Some(ExplainReport::of_directions(
        (base.from, base.to),
        base.protocol.clone(),
        base.port,
        vec![egress, ingress],
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(direction: &str, local: bool, verdict: &str, node: &str) -> DirectionReport {
        DirectionReport {
            direction: direction.into(),
            pod: Some(format!("p/{direction}")),
            local,
            endpoint: None,
            subject: None,
            node: Some(node.into()),
            verdict: verdict.into(),
            reason: None,
            text: format!("{direction} on {node}"),
            policies: Vec::new(),
            kernel: local.then(|| npm_agent::explain::KernelReport {
                verdict: verdict.into(),
                reason: "Policy".into(),
                program_id: 1,
                ifindex: 2,
            }),
            kernel_error: None,
            mismatch: (local && verdict == "deny").then(|| format!("MISMATCH on {node}")),
        }
    }

    fn report(egress: DirectionReport, ingress: DirectionReport) -> ExplainReport {
        let ends = ("10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap());
        ExplainReport::of_directions(ends, "TCP".into(), 80, vec![egress, ingress])
    }

    /// Each direction comes from the node that decides it: the sender's
    /// node's egress (local there), the receiver's node's ingress.
    #[test]
    fn each_direction_from_its_own_node() {
        let mut reports = BTreeMap::new();
        // n1 hosts the sender: its egress is local (allow); it sees the
        // ingress only by the evaluator (allow, not local).
        reports.insert(
            "n1".to_string(),
            report(dir("egress", true, "allow", "n1"), dir("ingress", false, "allow", "n2")),
        );
        // n2 hosts the receiver: its ingress denies.
        reports.insert(
            "n2".to_string(),
            report(dir("egress", false, "allow", "n1"), dir("ingress", true, "deny", "n2")),
        );
        let m = merge(&reports, Some("n1"), Some("n2")).unwrap();
        assert_eq!(m.verdict, "deny");
        assert!(m.directions.iter().all(|d| d.local), "{m:?}");
        assert_eq!(m.kernel.as_ref().map(|k| k.verdict.as_str()), Some("deny"));
        assert_eq!(m.mismatch.as_deref(), Some("MISMATCH on n2"));
        // The sender is an address outside the cluster: n2's report alone.
        let only: BTreeMap<_, _> = reports.into_iter().filter(|(n, _)| n == "n2").collect();
        let m = merge(&only, None, Some("n2")).unwrap();
        assert_eq!((m.directions[0].local, m.directions[1].local), (false, true));
        assert!(merge(&BTreeMap::new(), None, None).is_none());
    }
}
