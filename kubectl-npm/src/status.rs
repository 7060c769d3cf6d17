//! `kubectl npm status`: per node, whether the agent is ready and why not
//! (its `/readyz?verbose` checks), and what its `/metrics` says: held
//! removals, CNI chaining, kernel map fill and full maps, the reduced
//! datapath, the attach mode in use, the version; the configured dataplane
//! and attach mode (the agent pod's arguments) and the node's kernel (its
//! Node object).
//! `kubectl npm status NS/POD`: the pod's `npm.io/PolicyEnforced` and
//! `npm.io/PolicyDegraded` conditions, written by its node's agent.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::Node;
use kube::Api;
use npm_agent::explain::client::get_on;
use serde::Serialize;

use crate::cluster::{AgentPod, Cluster};
use crate::error::NpmError;
use crate::forward::{agent_error, with_agent};

/// The pod condition the agent writes: its policies are in the kernel.
pub const ENFORCED: &str = "npm.io/PolicyEnforced";
/// The pod condition of a later degraded state.
pub const DEGRADED: &str = "npm.io/PolicyDegraded";

/// One series of a Prometheus text exposition.
#[derive(Clone, Debug, PartialEq)]
pub struct Sample {
    /// The metric name.
    pub name: String,
    /// Its labels.
    pub labels: BTreeMap<String, String>,
    /// Its value.
    pub value: f64,
}

/// The samples of a Prometheus text exposition (comments skipped; a line
/// that does not parse is skipped).
pub fn parse_metrics(text: &str) -> Vec<Sample> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| {
            let (series, value) = l.trim().rsplit_once(' ')?;
            let value = value.parse().ok()?;
            let (name, labels) = match series.split_once('{') {
                Some((name, rest)) => (name, parse_labels(rest.strip_suffix('}')?)?),
                None => (series, BTreeMap::new()),
            };
            Some(Sample {
                name: name.to_string(),
                labels,
                value,
            })
        })
        .collect()
}

/// `k="v",k2="v2"` (values with `\"` and `\\` escapes).
fn parse_labels(s: &str) -> Option<BTreeMap<String, String>> {
    let mut out = BTreeMap::new();
    let mut rest = s;
    while !rest.is_empty() {
        let (k, after) = rest.split_once("=\"")?;
        let mut v = String::new();
        let mut chars = after.char_indices();
        let end = loop {
            match chars.next()? {
                (_, '\\') => v.push(chars.next()?.1),
                (i, '"') => break i,
                (_, c) => v.push(c),
            }
        };
        out.insert(k.trim_start_matches(',').trim().to_string(), v);
        rest = after[end + 1..].trim_start_matches(',');
    }
    Some(out)
}

/// A kernel map's fill.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MapFill {
    /// The pinned map's name.
    pub map: String,
    /// Entries in it.
    pub entries: u64,
    /// Its capacity.
    pub capacity: u64,
    /// The compiled state does not fit (`npm_map_full`).
    pub full: bool,
}

/// One agent's status.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct AgentStatus {
    /// The node.
    pub node: String,
    /// The agent pod (`namespace/name`).
    pub pod: String,
    /// Whether the agent says it is ready (`/readyz`); `None`: not reached.
    pub ready: Option<bool>,
    /// Its readiness checks (`/readyz?verbose`), one line each.
    pub checks: Vec<String>,
    /// Why the API server's view of the pod is not Ready, if it is not.
    pub pod_not_ready: Option<String>,
    /// The agent's version (`npm_build_info`).
    pub version: Option<String>,
    /// The configured dataplane (`--dataplane` of the pod; default `ebpf`).
    pub dataplane: String,
    /// The configured attach mode (`--attach`; default `auto`: tcx where
    /// the kernel has it, else tc).
    pub attach: String,
    /// The attach mode the programs run in (`npm_attach_mode{mode}`: what
    /// `auto` chose; eBPF only).
    pub attach_in_use: Option<String>,
    /// The node's kernel (`status.nodeInfo.kernelVersion` of its Node).
    pub kernel: Option<String>,
    /// A mass removal is held for a confirming read (`npm_held_removals`).
    pub held_removals: Option<bool>,
    /// npm-cni's entry is in the runtime's conflist (`npm_cni_chained`;
    /// absent without `--cni-conf-dir`).
    pub cni_chained: Option<bool>,
    /// The verifier refused the full datapath (`npm_datapath_reduced`).
    pub datapath_reduced: Option<bool>,
    /// Kernel map fill (eBPF), fullest first.
    pub maps: Vec<MapFill>,
    /// Why the agent could not be asked.
    pub error: Option<String>,
}

fn gauge(samples: &[Sample], name: &str) -> Option<bool> {
    samples.iter().find(|s| s.name == name).map(|s| s.value != 0.0)
}

/// Fills `st` from the agent's `/metrics` text.
pub fn from_metrics(st: &mut AgentStatus, text: &str) {
    let samples = parse_metrics(text);
    st.version = samples
        .iter()
        .find(|s| s.name == "npm_build_info")
        .and_then(|s| s.labels.get("version").cloned());
    st.held_removals = gauge(&samples, "npm_held_removals");
    st.cni_chained = gauge(&samples, "npm_cni_chained");
    st.datapath_reduced = gauge(&samples, "npm_datapath_reduced");
    st.attach_in_use = samples
        .iter()
        .find(|s| s.name == "npm_attach_mode" && s.value != 0.0)
        .and_then(|s| s.labels.get("mode").cloned());
    let of = |name: &str, map: &str| {
        samples
            .iter()
            .find(|s| s.name == name && s.labels.get("map").map(String::as_str) == Some(map))
            .map(|s| s.value)
    };
    let mut maps: Vec<MapFill> = samples
        .iter()
        .filter(|s| s.name == "npm_map_capacity")
        .filter_map(|s| {
            let map = s.labels.get("map")?;
            Some(MapFill {
                map: map.clone(),
                entries: of("npm_map_entries", map).unwrap_or(0.0) as u64,
                capacity: s.value as u64,
                full: of("npm_map_full", map).is_some_and(|v| v != 0.0),
            })
        })
        .collect();
    let fill = |m: &MapFill| m.entries as f64 / m.capacity.max(1) as f64;
    maps.sort_by(|a, b| fill(b).total_cmp(&fill(a)).then_with(|| a.map.cmp(&b.map)));
    st.maps = maps;
}

/// The status of `agent`: its pod, its `/readyz?verbose` and `/metrics`
/// through two port-forwards (one request per connection). A refused
/// port-forward is an error; an agent that does not answer is reported in
/// [`AgentStatus::error`].
pub async fn agent_status(cluster: &Cluster, agent: &AgentPod) -> Result<AgentStatus, NpmError> {
    let mut st = AgentStatus {
        node: agent.node.clone(),
        pod: agent.id(),
        pod_not_ready: agent.not_ready.clone(),
        dataplane: agent.args.get("dataplane").cloned().unwrap_or_else(|| "ebpf".into()),
        attach: agent.args.get("attach").cloned().unwrap_or_else(|| "auto".into()),
        ..Default::default()
    };
    st.kernel = Api::<Node>::all(cluster.client.clone())
        .get(&agent.node)
        .await
        .ok()
        .and_then(|n| n.status?.node_info.map(|i| i.kernel_version));
    let readyz = with_agent(cluster, agent, |s, label| get_on(s, &label, "/readyz?verbose")).await?;
    match readyz {
        Ok(a) if a.code == 200 || a.code == 503 => {
            st.ready = Some(a.code == 200);
            st.checks = a
                .body
                .lines()
                .filter(|l| !l.starts_with("readyz check"))
                .map(String::from)
                .collect();
        }
        Ok(a) => {
            st.error = Some(agent_error(agent, format!("/readyz answered {}: {}", a.status, a.body.trim())).to_string())
        }
        Err(e) => st.error = Some(agent_error(agent, e.to_string()).to_string()),
    }
    if st.error.is_none() {
        match with_agent(cluster, agent, |s, label| get_on(s, &label, "/metrics")).await? {
            Ok(a) if a.code == 200 => from_metrics(&mut st, &a.body),
            Ok(a) => st.error = Some(format!("/metrics answered {}", a.status)),
            Err(e) => st.error = Some(e.to_string()),
        }
    }
    Ok(st)
}

/// Every agent's status, by node.
pub async fn status(cluster: &Cluster) -> Result<Vec<AgentStatus>, NpmError> {
    let agents = cluster.agents().await?;
    if agents.is_empty() {
        return Err(NpmError::NoAgents {
            namespace: cluster.agent_namespace.clone(),
            selector: cluster.agent_selector.clone(),
        });
    }
    futures::future::try_join_all(agents.values().map(|a| agent_status(cluster, a))).await
}

/// The text of the agents' statuses.
pub fn render(all: &[AgentStatus]) -> String {
    let yes_no = |b: Option<bool>| match b {
        Some(true) => "yes",
        Some(false) => "no",
        None => "unknown",
    };
    let mut s = String::new();
    for st in all {
        let ready = match (st.ready, &st.error) {
            (_, Some(e)) => format!("UNKNOWN: {e}"),
            (Some(true), _) => "READY".into(),
            _ => "NOT READY".into(),
        };
        s.push_str(&format!("node {}: agent {} {ready}\n", st.node, st.pod));
        if st.ready == Some(false) {
            for c in &st.checks {
                s.push_str(&format!("  {c}\n"));
            }
        }
        if let Some(r) = &st.pod_not_ready {
            s.push_str(&format!("  pod not Ready (API server): {r}\n"));
        }
        let in_use = st
            .attach_in_use
            .as_deref()
            .map(|m| format!(", {m} in use"))
            .unwrap_or_default();
        s.push_str(&format!(
            "  version {}, dataplane {}, attach {} (configured{in_use}), kernel {}\n",
            st.version.as_deref().unwrap_or("unknown"),
            st.dataplane,
            st.attach,
            st.kernel.as_deref().unwrap_or("unknown")
        ));
        if st.error.is_none() {
            s.push_str(&format!(
                "  held removals {}, CNI chained {}, reduced datapath {}\n",
                yes_no(st.held_removals),
                st.cni_chained
                    .map_or("not configured", |c| if c { "yes" } else { "no" }),
                yes_no(st.datapath_reduced)
            ));
        }
        for m in st.maps.iter().take(5) {
            s.push_str(&format!(
                "  map {:<16} {:>9} / {:<9} {:>5.1}%{}\n",
                m.map,
                m.entries,
                m.capacity,
                100.0 * m.entries as f64 / m.capacity.max(1) as f64,
                if m.full { " FULL" } else { "" }
            ));
        }
    }
    s
}

/// A pod condition as `kubectl npm status POD` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Condition {
    /// `True` or `False`.
    pub status: String,
    /// The reason (`Enforced`, `RemovalHeld`, `MapFull`, …).
    pub reason: Option<String>,
    /// The message.
    pub message: Option<String>,
    /// Since when (RFC 3339).
    pub since: Option<String>,
}

/// One pod's enforcement.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct PodStatus {
    /// `namespace/name`.
    pub pod: String,
    /// Its node.
    pub node: Option<String>,
    /// Whether it is a host-network pod (no policy selects it: no condition).
    pub host_network: bool,
    /// `npm.io/PolicyEnforced`.
    pub enforced: Option<Condition>,
    /// `npm.io/PolicyDegraded`.
    pub degraded: Option<Condition>,
}

/// The conditions of pod `namespace/name`.
pub async fn pod_status(cluster: &Cluster, pod: &str) -> Result<PodStatus, NpmError> {
    let (ns, name) = pod
        .split_once('/')
        .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
        .ok_or_else(|| NpmError::Usage(format!("{pod:?}: want NAMESPACE/POD")))?;
    let p = cluster.pod(ns, name).await?;
    let conditions = p.status.as_ref().and_then(|s| s.conditions.clone()).unwrap_or_default();
    let find = |t: &str| {
        conditions.iter().find(|c| c.type_ == t).map(|c| Condition {
            status: c.status.clone(),
            reason: c.reason.clone(),
            message: c.message.clone(),
            since: c.last_transition_time.as_ref().map(|t| t.0.to_string()),
        })
    };
    Ok(PodStatus {
        pod: pod.into(),
        node: p.spec.as_ref().and_then(|s| s.node_name.clone()),
        host_network: p.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false),
        enforced: find(ENFORCED),
        degraded: find(DEGRADED),
    })
}

/// The text of a pod's enforcement.
pub fn render_pod(p: &PodStatus) -> String {
    let mut s = format!(
        "pod {} on node {}\n",
        p.pod,
        p.node.as_deref().unwrap_or("(not scheduled)")
    );
    let line = |t: &str, c: &Option<Condition>| match c {
        Some(c) => format!(
            "  {t}: {} ({}){}{}\n",
            c.status,
            c.reason.as_deref().unwrap_or("no reason"),
            c.since.as_deref().map(|t| format!(" since {t}")).unwrap_or_default(),
            c.message.as_deref().map(|m| format!(": {m}")).unwrap_or_default()
        ),
        None => format!("  {t}: not set\n"),
    };
    s.push_str(&line(ENFORCED, &p.enforced));
    s.push_str(&line(DEGRADED, &p.degraded));
    if p.enforced.is_none() {
        s.push_str(if p.host_network {
            "  a host-network pod: no policy selects it, the agent writes no condition\n"
        } else {
            "  the agent of its node has not written it: not synced yet, no address yet, or pod conditions disabled (podConditions.enabled=false)\n"
        });
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_fill_the_status() {
        let text = "# HELP npm_build_info x\n\
            npm_build_info{version=\"0.1.0\",git_commit=\"abc\"} 1\n\
            npm_held_removals 1\n\
            npm_cni_chained 0\n\
            npm_attach_mode{mode=\"tc\"} 1\n\
            npm_map_entries{map=\"NPM_POLICY\"} 50\n\
            npm_map_capacity{map=\"NPM_POLICY\"} 100\n\
            npm_map_full{map=\"NPM_POLICY\"} 1\n\
            npm_map_entries{map=\"NPM_IPCACHE\"} 1\n\
            npm_map_capacity{map=\"NPM_IPCACHE\"} 1000\n\
            npm_x{a=\"q\\\"uote,d\",b=\"2\"} 3\n";
        let mut st = AgentStatus::default();
        from_metrics(&mut st, text);
        assert_eq!(st.version.as_deref(), Some("0.1.0"));
        assert_eq!(
            (st.held_removals, st.cni_chained, st.datapath_reduced),
            (Some(true), Some(false), None)
        );
        assert_eq!(st.maps[0].map, "NPM_POLICY");
        assert_eq!(
            (st.maps[0].entries, st.maps[0].capacity, st.maps[0].full),
            (50, 100, true)
        );
        assert!(!st.maps[1].full);
        let x = parse_metrics(text).into_iter().find(|s| s.name == "npm_x").unwrap();
        assert_eq!(x.labels["a"], "q\"uote,d");
        assert_eq!(x.labels["b"], "2");
        st.ready = Some(true);
        assert_eq!(st.attach_in_use.as_deref(), Some("tc"));
        st.attach = "auto".into();
        let text = render(&[st]);
        assert!(text.contains("held removals yes, CNI chained no"), "{text}");
        assert!(text.contains("attach auto (configured, tc in use)"), "{text}");
    }
}
