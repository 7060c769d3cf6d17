//! The simulator behind `npmctl` and `npm-agent simulate`: builds a
//! snapshot from YAML texts and computes reachability matrices and flow
//! explanations with the reference evaluator.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr};

use npm_policy::compiled::CompileOptions;
use npm_policy::convert::{load_yaml, ConvertError, Objects, YamlError};
use npm_policy::evaluate::{evaluate, Flow, Verdict};
use npm_policy::identity::{is_addressable, pod_addresses};
use npm_policy::model::{PodPhase, Protocol, Snapshot};
use npm_policy::tiers::api::KIND;
use npm_policy::tiers::validate::{convert_cluster_policy_yaml, ClusterParseError, ClusterPolicyConversion};

/// Errors of the simulator.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    /// A YAML input failed to load.
    #[error("{input}: {source}")]
    Yaml {
        /// Which input (file name).
        input: String,
        /// The error.
        source: YamlError,
    },
    /// An object failed to convert.
    #[error("{0}")]
    Convert(#[from] ConvertError),
    /// A ClusterNetworkPolicy document does not have the object's shape.
    #[error("{input}: {source}")]
    ClusterPolicy {
        /// Which input (file name).
        input: String,
        /// The error.
        source: ClusterParseError,
    },
}

/// Splits a multi-document YAML text into its ClusterNetworkPolicy objects
/// (also the items of a `List` or `ClusterNetworkPolicyList`) and the text
/// of every other document (for [`load_yaml`]; a document that was only
/// ClusterNetworkPolicies becomes `null`, so document indexes in its errors
/// stay those of the input).
fn split_cluster_policies(text: &str) -> Result<(Vec<serde_yaml::Value>, String), serde_yaml::Error> {
    use serde::Deserialize;
    /// The document without its ClusterNetworkPolicies (`Null` if nothing
    /// is left).
    fn walk(v: serde_yaml::Value, cnps: &mut Vec<serde_yaml::Value>) -> serde_yaml::Value {
        let kind = v.get("kind").and_then(|k| k.as_str()).unwrap_or("").to_string();
        match kind.as_str() {
            KIND => {
                cnps.push(v);
                serde_yaml::Value::Null
            }
            "ClusterNetworkPolicyList" | "List" => {
                let items = v
                    .get("items")
                    .and_then(|i| i.as_sequence())
                    .cloned()
                    .unwrap_or_default();
                let other: Vec<serde_yaml::Value> = items
                    .into_iter()
                    .map(|i| walk(i, cnps))
                    .filter(|i| !i.is_null())
                    .collect();
                if other.is_empty() {
                    return serde_yaml::Value::Null;
                }
                let mut list = serde_yaml::Mapping::new();
                list.insert("kind".into(), "List".into());
                list.insert("items".into(), serde_yaml::Value::Sequence(other));
                serde_yaml::Value::Mapping(list)
            }
            _ => v,
        }
    }
    let (mut cnps, mut rest) = (Vec::new(), Vec::new());
    for doc in serde_yaml::Deserializer::from_str(text) {
        let v = serde_yaml::Value::deserialize(doc)?;
        rest.push(walk(v, &mut cnps));
    }
    let mut out = String::new();
    for v in rest {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&v)?);
    }
    Ok((cnps, out))
}

/// The node the simulator compiles for.
pub const SIM_NODE: &str = "npm-node";

/// The objects of named YAML texts and their ClusterNetworkPolicies,
/// converted.
fn parse_inputs(inputs: &[(String, String)]) -> Result<(Objects, Vec<ClusterPolicyConversion>), SimError> {
    let mut objs = Objects::default();
    let mut cnps = Vec::new();
    for (name, text) in inputs {
        let (mine, rest) = split_cluster_policies(text).map_err(|e| SimError::Yaml {
            input: name.clone(),
            source: YamlError::Syntax { index: 0, source: e },
        })?;
        objs.extend(load_yaml(&rest).map_err(|source| SimError::Yaml {
            input: name.clone(),
            source,
        })?);
        for v in mine {
            let text = serde_yaml::to_string(&v).map_err(|e| SimError::Yaml {
                input: name.clone(),
                source: YamlError::Syntax { index: 0, source: e },
            })?;
            let conv = convert_cluster_policy_yaml(&text).map_err(|source| SimError::ClusterPolicy {
                input: name.clone(),
                source,
            })?;
            cnps.push(conv);
        }
    }
    Ok((objs, cnps))
}

/// Builds a snapshot from named YAML texts (`(name, text)`) of Namespace,
/// Pod, NetworkPolicy and ClusterNetworkPolicy objects (the latter
/// converted by npm-policy; one not fully understood is kept as converted,
/// failing closed, and reported in `invalid_cluster_policies`). Pods without
/// `status.podIP(s)` get a synthetic address in `10.244.0.0/16` and, when
/// without a phase, phase Running; pods without `spec.nodeName` run on
/// [`SIM_NODE`]. Namespaces referenced by pods or policies but not defined
/// are created with just their metadata label.
pub fn load_snapshot(inputs: &[(String, String)]) -> Result<Snapshot, SimError> {
    let (objs, cnps) = parse_inputs(inputs)?;
    let mut snap = Snapshot::from_objects(&objs.namespaces, &objs.pods, &objs.policies)?;
    for conv in cnps {
        let invalid = conv.invalid();
        snap.insert_cluster_policy(conv.policy, invalid);
    }
    let raw_phase: std::collections::BTreeMap<(String, String), bool> = objs
        .pods
        .iter()
        .map(|p| {
            let key = (
                p.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
                p.metadata.name.clone().unwrap_or_default(),
            );
            (key, p.status.as_ref().and_then(|s| s.phase.as_ref()).is_some())
        })
        .collect();
    let used: std::collections::BTreeSet<IpAddr> = snap.pods.values().flat_map(|p| p.ips.iter().copied()).collect();
    let mut next = 1u32;
    for (key, pod) in snap.pods.iter_mut() {
        if pod.node_name.is_none() {
            pod.node_name = Some(SIM_NODE.to_string());
        }
        if !raw_phase.get(key).copied().unwrap_or(false) {
            pod.phase = PodPhase::Running;
        }
        if pod.ips.is_empty() && !pod.host_network {
            let ip = loop {
                let ip = IpAddr::V4(Ipv4Addr::new(10, 244, (next / 250) as u8, (next % 250 + 1) as u8));
                next += 1;
                if !used.contains(&ip) {
                    break ip;
                }
            };
            pod.ips.push(ip);
        }
    }
    let namespaces: Vec<String> = snap
        .pods
        .keys()
        .map(|k| k.0.clone())
        .chain(snap.policies.keys().map(|k| k.0.clone()))
        .collect();
    for ns in namespaces {
        if !snap.namespaces.contains_key(&ns) {
            let labels = [("kubernetes.io/metadata.name".to_string(), ns.clone())].into();
            snap.upsert_namespace(npm_policy::model::Namespace { name: ns, labels });
        }
    }
    Ok(snap)
}

/// Applies named YAML texts to `snapshot` as `kubectl apply` would: each
/// Namespace, Pod, NetworkPolicy and ClusterNetworkPolicy replaces the one
/// of its kind, namespace and name (pods as given: no address is made up,
/// so a pod without `status.podIPs` is no endpoint). For `preview` on a
/// live cluster's state.
pub fn apply_yaml(snapshot: &mut Snapshot, inputs: &[(String, String)]) -> Result<(), SimError> {
    let (objs, cnps) = parse_inputs(inputs)?;
    for ns in &objs.namespaces {
        snapshot.upsert_namespace(npm_policy::convert::namespace_from_api(ns)?);
    }
    for p in &objs.pods {
        snapshot.upsert_pod(npm_policy::convert::pod_from_api(p)?);
    }
    for np in &objs.policies {
        // An invalid policy is recorded in `invalid_policies`.
        let _ = snapshot.upsert_policy(np);
    }
    for conv in cnps {
        let invalid = conv.invalid();
        snapshot.insert_cluster_policy(conv.policy, invalid);
    }
    Ok(())
}

/// Compile options of the simulator.
pub fn sim_options() -> CompileOptions {
    CompileOptions {
        node_name: SIM_NODE.to_string(),
        node_ips: vec![],
        allow_host_egress: false,
        report_new: false,
    }
}

/// The addressable pods (`namespace/name`), sorted, with their first address.
pub fn pods(snapshot: &Snapshot) -> Vec<(String, IpAddr)> {
    snapshot
        .pods
        .values()
        .filter(|p| is_addressable(p))
        .filter_map(|p| {
            pod_addresses(p)
                .next()
                .map(|ip| (format!("{}/{}", p.namespace, p.name), ip))
        })
        .collect()
}

/// The reachability matrix over every addressable pod.
pub fn matrix(snapshot: &Snapshot, opts: &CompileOptions, protocol: Protocol, port: u16) -> Matrix {
    let pods = pods(snapshot);
    let names: Vec<String> = pods.iter().map(|(n, _)| n.clone()).collect();
    let cells = pods
        .iter()
        .map(|(_, src)| {
            pods.iter()
                .map(|(_, dst)| {
                    evaluate(
                        snapshot,
                        opts,
                        &Flow {
                            src: *src,
                            dst: *dst,
                            protocol: protocol.number(),
                            dst_port: port,
                        },
                    )
                    .allowed
                })
                .collect()
        })
        .collect();
    Matrix {
        rows: names.clone(),
        columns: names,
        cells,
    }
}

/// A reachability matrix: `cells[r][c]` says whether `rows[r]` reaches
/// `columns[c]`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matrix {
    /// Source pods (`ns/name`).
    pub rows: Vec<String>,
    /// Destination pods (`ns/name`).
    pub columns: Vec<String>,
    /// Reachability.
    pub cells: Vec<Vec<bool>>,
}

/// One cell where two matrices differ.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Source pod.
    pub from: String,
    /// Destination pod.
    pub to: String,
    /// Expected reachability.
    pub expected: bool,
    /// Observed reachability.
    pub actual: bool,
}

impl fmt::Display for Mismatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = |b: bool| if b { "reachable" } else { "blocked" };
        write!(
            f,
            "{} -> {}: expected {}, got {}",
            self.from,
            self.to,
            w(self.expected),
            w(self.actual)
        )
    }
}

impl Matrix {
    /// The cell for (`from`, `to`), if both are in the matrix.
    pub fn get(&self, from: &str, to: &str) -> Option<bool> {
        let r = self.rows.iter().position(|x| x == from)?;
        let c = self.columns.iter().position(|x| x == to)?;
        Some(self.cells[r][c])
    }

    /// Renders the upstream-style table: `.` reachable, `X` blocked.
    pub fn render(&self) -> String {
        let w = self
            .rows
            .iter()
            .chain(&self.columns)
            .map(|s| s.len())
            .max()
            .unwrap_or(1);
        let mut s = format!("{:w$}", "");
        for c in &self.columns {
            s.push_str(&format!(" {c:>w$}"));
        }
        s.push('\n');
        for (r, row) in self.rows.iter().zip(&self.cells) {
            s.push_str(&format!("{r:w$}"));
            for v in row {
                s.push_str(&format!(" {:>w$}", if *v { "." } else { "X" }));
            }
            s.push('\n');
        }
        s
    }

    /// The cells where `actual` differs from `self` (the expectation), for
    /// the cells both have; the diagonal (a pod to itself) is ignored.
    pub fn compare(&self, actual: &Matrix) -> Vec<Mismatch> {
        let mut out = Vec::new();
        for (ri, r) in self.rows.iter().enumerate() {
            for (ci, c) in self.columns.iter().enumerate() {
                if r == c {
                    continue;
                }
                if let Some(a) = actual.get(r, c) {
                    let e = self.cells[ri][ci];
                    if a != e {
                        out.push(Mismatch {
                            from: r.clone(),
                            to: c.clone(),
                            expected: e,
                            actual: a,
                        });
                    }
                }
            }
        }
        out
    }
}

/// Errors of [`explain`].
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// A pod reference does not name an addressable pod.
    #[error("pod {0:?} not found or without an address (want namespace/name)")]
    NoPod(String),
}

/// The first addresses of the addressable pods `from` and `to`
/// (`namespace/name`).
pub fn pod_pair(snapshot: &Snapshot, from: &str, to: &str) -> Result<(IpAddr, IpAddr), ExplainError> {
    let pods = pods(snapshot);
    let ip = |n: &str| {
        pods.iter()
            .find(|(p, _)| p == n)
            .map(|(_, ip)| *ip)
            .ok_or_else(|| ExplainError::NoPod(n.to_string()))
    };
    Ok((ip(from)?, ip(to)?))
}

/// Explains the flow from pod `from` to pod `to` (`namespace/name`).
pub fn explain(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    from: &str,
    to: &str,
    protocol: Protocol,
    port: u16,
) -> Result<Verdict, ExplainError> {
    let (src, dst) = pod_pair(snapshot, from, to)?;
    Ok(evaluate(
        snapshot,
        opts,
        &Flow {
            src,
            dst,
            protocol: protocol.number(),
            dst_port: port,
        },
    ))
}
