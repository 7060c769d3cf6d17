//! Conformance case files: format, parsing, the pristine model the cases
//! run on, expected matrices, and a simulated run (evaluator and compiled
//! lookup).
//!
//! # Format
//!
//! A YAML file holds one case, or a list of cases under `cases:`. Unknown
//! fields are ignored.
//!
//! ```yaml
//! cases:
//!   - id: deny-all-ingress
//!     title: optional text
//!     steps:
//!       - actions:
//!           - create_policy: { apiVersion: networking.k8s.io/v1, kind: NetworkPolicy, ... }
//!         probes:
//!           - port: 80
//!             protocol: TCP
//!             matrix:            # source -> one 1/0 per destination in `pods` order
//!               x/a: "111111111"
//!             pods: [x/a, ...]   # defaults to x/a,x/b,x/c,y/a,...,z/c
//! ```
//!
//! Actions (single-key maps, applied in order): `create_policy`,
//! `update_policy` (a NetworkPolicy), `delete_policy: {namespace, name}`,
//! `delete_all_policies: {}`, `add_namespace_labels` /
//! `set_namespace_labels: {namespace, labels}`, `add_pod_labels` /
//! `set_pod_labels: {pod: ns/name, labels}`, `create_pod: {pod, labels}`,
//! `delete_pod: {pod}`, `create_namespace: {namespace, labels}`,
//! `delete_namespace: {namespace}`.
//!
//! Placeholders in the text: `${IP:<ns>/<pod>}` (the pod's IPv4 address)
//! and `${CIDR<n>:<ns>/<pod>}` (the IPv4 /n network containing it); see
//! [`substitute`]. [`Model::apply`] resolves those left in a policy against
//! its own addresses.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use k8s_openapi::api::networking::v1::NetworkPolicy;
use serde::{Deserialize, Serialize};

use crate::compiled::{CompileOptions, Direction};
use crate::identity::PrefixTable;
use crate::model::{ContainerPort, Labels, Namespace, Pod, PodPhase, Protocol, Snapshot};

/// Errors of case files and actions.
#[derive(Debug, thiserror::Error)]
pub enum CaseError {
    /// The file is not valid YAML or does not have the case format.
    #[error("case file: {0}")]
    Parse(#[from] serde_yaml::Error),
    /// A placeholder is malformed or names an unknown pod.
    #[error("placeholder {placeholder:?}: {message}")]
    Placeholder {
        /// The placeholder text.
        placeholder: String,
        /// What is wrong.
        message: String,
    },
    /// A pod reference is not `namespace/name`.
    #[error("pod reference {0:?}: want namespace/name")]
    PodRef(String),
    /// An action names a namespace that does not exist.
    #[error("action {action}: namespace {namespace:?} does not exist")]
    NoNamespace {
        /// Action name.
        action: &'static str,
        /// Namespace.
        namespace: String,
    },
    /// An action names a pod that does not exist.
    #[error("action {action}: pod {pod:?} does not exist")]
    NoPod {
        /// Action name.
        action: &'static str,
        /// `namespace/name`.
        pod: String,
    },
    /// An action creates something that exists already.
    #[error("action {action}: {object:?} already exists")]
    Exists {
        /// Action name.
        action: &'static str,
        /// What.
        object: String,
    },
    /// A policy of an action is invalid.
    #[error("action {action}: invalid policy: {errors:?}")]
    InvalidPolicy {
        /// Action name.
        action: &'static str,
        /// Validation errors.
        errors: Vec<String>,
    },
    /// A probe's protocol is not TCP, UDP or SCTP.
    #[error("probe: unsupported protocol {0:?}")]
    Protocol(String),
    /// A probe's matrix row has the wrong length or characters.
    #[error("probe: matrix row {source_pod:?}: {message}")]
    Matrix {
        /// Row (source pod).
        source_pod: String,
        /// What is wrong.
        message: String,
    },
}

/// One case.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Case {
    /// Identifier.
    pub id: String,
    /// Title.
    #[serde(default)]
    pub title: Option<String>,
    /// Steps, in order.
    #[serde(default)]
    pub steps: Vec<Step>,
}

/// One step: actions, then probes.
#[derive(Clone, Debug, PartialEq, Deserialize)]
pub struct Step {
    /// Actions applied in order.
    #[serde(default)]
    pub actions: Vec<Action>,
    /// Probes run after the actions.
    #[serde(default)]
    pub probes: Vec<Probe>,
}

/// `namespace` + `name`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct ObjectName {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
}

/// `namespace` + `labels`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct NamespaceLabels {
    /// Namespace.
    pub namespace: String,
    /// Labels.
    #[serde(default)]
    pub labels: Labels,
}

/// `pod` (`ns/name`) + `labels`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct PodLabels {
    /// `namespace/name`.
    pub pod: String,
    /// Labels.
    #[serde(default)]
    pub labels: Labels,
}

/// `pod` (`ns/name`).
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct PodName {
    /// `namespace/name`.
    pub pod: String,
}

/// `namespace`.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize, Serialize)]
pub struct NamespaceName {
    /// Namespace.
    pub namespace: String,
}

/// Nothing (`{}`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
pub struct Empty {}

/// One action: in a case file a single-key map `name: argument`.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Create a NetworkPolicy.
    CreatePolicy(Box<NetworkPolicy>),
    /// Replace a NetworkPolicy.
    UpdatePolicy(Box<NetworkPolicy>),
    /// Delete a NetworkPolicy.
    DeletePolicy(ObjectName),
    /// Delete every NetworkPolicy.
    DeleteAllPolicies(Empty),
    /// Add (or overwrite) namespace labels.
    AddNamespaceLabels(NamespaceLabels),
    /// Replace namespace labels (`kubernetes.io/metadata.name` is kept).
    SetNamespaceLabels(NamespaceLabels),
    /// Add (or overwrite) pod labels.
    AddPodLabels(PodLabels),
    /// Replace pod labels.
    SetPodLabels(PodLabels),
    /// Create a pod (the standard container ports, the next free address).
    CreatePod(PodLabels),
    /// Delete a pod.
    DeletePod(PodName),
    /// Create a namespace (labels `ns=<name>` and the metadata label are added).
    CreateNamespace(NamespaceLabels),
    /// Delete a namespace with its pods and policies.
    DeleteNamespace(NamespaceName),
}

impl Action {
    /// The action's name as written in case files.
    pub fn name(&self) -> &'static str {
        match self {
            Action::CreatePolicy(_) => "create_policy",
            Action::UpdatePolicy(_) => "update_policy",
            Action::DeletePolicy(_) => "delete_policy",
            Action::DeleteAllPolicies(_) => "delete_all_policies",
            Action::AddNamespaceLabels(_) => "add_namespace_labels",
            Action::SetNamespaceLabels(_) => "set_namespace_labels",
            Action::AddPodLabels(_) => "add_pod_labels",
            Action::SetPodLabels(_) => "set_pod_labels",
            Action::CreatePod(_) => "create_pod",
            Action::DeletePod(_) => "delete_pod",
            Action::CreateNamespace(_) => "create_namespace",
            Action::DeleteNamespace(_) => "delete_namespace",
        }
    }
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        let map = BTreeMap::<String, serde_yaml::Value>::deserialize(d)?;
        if map.len() != 1 {
            return Err(D::Error::custom(format!(
                "an action is a map with exactly one key, got {} keys",
                map.len()
            )));
        }
        let (name, v) = map.into_iter().next().expect("one entry");
        fn arg<T: serde::de::DeserializeOwned, E: Error>(name: &str, v: serde_yaml::Value) -> Result<T, E> {
            let v = if v.is_null() {
                serde_yaml::Value::Mapping(Default::default())
            } else {
                v
            };
            serde_yaml::from_value(v).map_err(|e| E::custom(format!("{name}: {e}")))
        }
        Ok(match name.as_str() {
            "create_policy" => Action::CreatePolicy(arg(&name, v)?),
            "update_policy" => Action::UpdatePolicy(arg(&name, v)?),
            "delete_policy" => Action::DeletePolicy(arg(&name, v)?),
            "delete_all_policies" => Action::DeleteAllPolicies(Empty {}),
            "add_namespace_labels" => Action::AddNamespaceLabels(arg(&name, v)?),
            "set_namespace_labels" => Action::SetNamespaceLabels(arg(&name, v)?),
            "add_pod_labels" => Action::AddPodLabels(arg(&name, v)?),
            "set_pod_labels" => Action::SetPodLabels(arg(&name, v)?),
            "create_pod" => Action::CreatePod(arg(&name, v)?),
            "delete_pod" => Action::DeletePod(arg(&name, v)?),
            "create_namespace" => Action::CreateNamespace(arg(&name, v)?),
            "delete_namespace" => Action::DeleteNamespace(arg(&name, v)?),
            other => return Err(D::Error::custom(format!("unknown action {other:?}"))),
        })
    }
}

fn default_protocol() -> String {
    "TCP".to_string()
}

/// The default probe pod list.
pub fn default_pods() -> Vec<String> {
    ["x", "y", "z"]
        .iter()
        .flat_map(|n| ["a", "b", "c"].iter().map(move |p| format!("{n}/{p}")))
        .collect()
}

/// One probe: every source in `matrix` to every pod of `pods`.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
pub struct Probe {
    /// Destination port.
    pub port: u16,
    /// `TCP`, `UDP` or `SCTP`.
    #[serde(default = "default_protocol")]
    pub protocol: String,
    /// Source pod -> `1`/`0` per destination, in `pods` order.
    pub matrix: BTreeMap<String, String>,
    /// Destination order (and the full pod list).
    #[serde(default = "default_pods")]
    pub pods: Vec<String>,
}

impl Probe {
    /// The probe's protocol.
    pub fn protocol(&self) -> Result<Protocol, CaseError> {
        crate::validate::parse_protocol(&self.protocol).ok_or_else(|| CaseError::Protocol(self.protocol.clone()))
    }

    /// The expected matrix: rows are the sources of `matrix` (in `pods`
    /// order, then any others), columns `pods`.
    pub fn expected(&self) -> Result<Matrix, CaseError> {
        let mut rows: Vec<String> = self
            .pods
            .iter()
            .filter(|p| self.matrix.contains_key(*p))
            .cloned()
            .collect();
        rows.extend(self.matrix.keys().filter(|k| !self.pods.contains(k)).cloned());
        let mut cells = Vec::new();
        for r in &rows {
            let text: String = self.matrix[r].chars().filter(|c| !c.is_whitespace()).collect();
            if text.chars().count() != self.pods.len() {
                return Err(CaseError::Matrix {
                    source_pod: r.clone(),
                    message: format!("{} entries for {} pods", text.chars().count(), self.pods.len()),
                });
            }
            let row = text
                .chars()
                .map(|c| match c {
                    '1' | '.' => Ok(true),
                    '0' | 'X' | 'x' => Ok(false),
                    other => Err(CaseError::Matrix {
                        source_pod: r.clone(),
                        message: format!("unexpected {other:?}: want 1 or 0"),
                    }),
                })
                .collect::<Result<Vec<bool>, _>>()?;
            cells.push(row);
        }
        Ok(Matrix {
            rows,
            columns: self.pods.clone(),
            cells,
        })
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

/// A placeholder found in a case text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placeholder {
    /// `${IP:<ns>/<pod>}`.
    Ip {
        /// `ns/pod`.
        pod: String,
    },
    /// `${CIDR<n>:<ns>/<pod>}`.
    Cidr {
        /// Prefix length.
        len: u8,
        /// `ns/pod`.
        pod: String,
    },
}

/// Replaces every `${IP:ns/pod}` and `${CIDR<n>:ns/pod}` of `text`; `ip`
/// gives a pod's address (`None`: unknown pod, an error).
pub fn substitute(text: &str, ip: &dyn Fn(&str) -> Option<IpAddr>) -> Result<String, CaseError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let Some(end) = rest[i..].find('}') else {
            return Err(CaseError::Placeholder {
                placeholder: rest[i..].to_string(),
                message: "no closing }".into(),
            });
        };
        let ph = &rest[i..i + end + 1];
        let bad = |m: &str| CaseError::Placeholder {
            placeholder: ph.to_string(),
            message: m.to_string(),
        };
        let inner = &ph[2..ph.len() - 1];
        let (kind, pod) = inner
            .split_once(':')
            .ok_or_else(|| bad("want ${IP:ns/pod} or ${CIDR<n>:ns/pod}"))?;
        let addr = ip(pod).ok_or_else(|| bad("unknown pod"))?;
        if kind == "IP" {
            out.push_str(&addr.to_string());
        } else if let Some(n) = kind.strip_prefix("CIDR") {
            let len: u8 = n.parse().map_err(|_| bad("bad prefix length"))?;
            let net = ipnet::IpNet::new(addr, len).map_err(|_| bad("prefix length too long for the address"))?;
            out.push_str(&net.trunc().to_string());
        } else {
            return Err(bad("unknown placeholder kind"));
        }
        rest = &rest[i + end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// Parses a case file; placeholders stay as they are (see [`Model::apply`]).
pub fn parse_case_file(text: &str) -> Result<Vec<Case>, CaseError> {
    // Untagged enums hide the real error: try the list form explicitly.
    let v: serde_yaml::Value = serde_yaml::from_str(text)?;
    if v.get("cases").is_some() {
        #[derive(Deserialize)]
        struct Many {
            cases: Vec<Case>,
        }
        // (from_str: serde_yaml's Value does not deserialize map-form enums.)
        return Ok(serde_yaml::from_str::<Many>(text)?.cases);
    }
    Ok(vec![serde_yaml::from_str::<Case>(text)?])
}

/// Parses a case file after replacing placeholders with `ip` (see [`substitute`]).
pub fn parse_case_file_with(text: &str, ip: &dyn Fn(&str) -> Option<IpAddr>) -> Result<Vec<Case>, CaseError> {
    parse_case_file(&substitute(text, ip)?)
}

/// The node every model pod runs on.
pub const MODEL_NODE: &str = "npm-node";

/// The standard container ports of model pods: `serve-<port>-<proto>`.
pub fn model_container_ports() -> Vec<ContainerPort> {
    let mut v = Vec::new();
    for port in [80u16, 81] {
        for (p, n) in [(Protocol::Tcp, "tcp"), (Protocol::Udp, "udp"), (Protocol::Sctp, "sctp")] {
            v.push(ContainerPort {
                name: Some(format!("serve-{port}-{n}")),
                port,
                protocol: p,
            });
        }
    }
    v
}

/// The simulated cluster of the cases: a snapshot plus address allocation.
#[derive(Clone, Debug)]
pub struct Model {
    /// The cluster.
    pub snapshot: Snapshot,
    ns_index: BTreeMap<String, u16>,
    pod_index: BTreeMap<String, u16>,
    next_ns: u16,
    clock: i64,
}

fn split_pod(s: &str) -> Result<(String, String), CaseError> {
    match s.split_once('/') {
        Some((a, b)) if !a.is_empty() && !b.is_empty() => Ok((a.to_string(), b.to_string())),
        _ => Err(CaseError::PodRef(s.to_string())),
    }
}

impl Model {
    /// The pristine upstream model: namespaces x, y, z (labels `ns=<name>`
    /// and `kubernetes.io/metadata.name`), pods a, b, c in each (label
    /// `pod=<name>`, the standard ports), IPv4 `198.18.<ns>.<pod>` and IPv6
    /// `fd00:198:18::<ns>:<pod>` (1-based), all on [`MODEL_NODE`].
    pub fn upstream() -> Model {
        let mut m = Model {
            snapshot: Snapshot::default(),
            ns_index: BTreeMap::new(),
            pod_index: BTreeMap::new(),
            next_ns: 1,
            clock: 1_000,
        };
        for ns in ["x", "y", "z"] {
            m.create_namespace(ns, &Labels::new()).expect("fresh model");
            for p in ["a", "b", "c"] {
                let labels: Labels = [("pod".to_string(), p.to_string())].into();
                m.create_pod(ns, p, &labels).expect("fresh model");
            }
        }
        m
    }

    /// Compile options of the model's node (no node addresses).
    pub fn options() -> CompileOptions {
        CompileOptions {
            node_name: MODEL_NODE.to_string(),
            node_ips: vec![],
            allow_host_egress: false,
        }
    }

    /// A pod's IPv4 address.
    pub fn ip(&self, pod: &str) -> Option<IpAddr> {
        let (ns, name) = split_pod(pod).ok()?;
        self.snapshot
            .pods
            .get(&(ns, name))?
            .ips
            .iter()
            .find(|i| i.is_ipv4())
            .copied()
    }

    /// The pods, `ns/name`, sorted.
    pub fn pod_names(&self) -> Vec<String> {
        self.snapshot.pods.keys().map(|(n, p)| format!("{n}/{p}")).collect()
    }

    fn create_namespace(&mut self, ns: &str, labels: &Labels) -> Result<(), CaseError> {
        if self.snapshot.namespaces.contains_key(ns) {
            return Err(CaseError::Exists {
                action: "create_namespace",
                object: ns.to_string(),
            });
        }
        let mut l = labels.clone();
        l.entry("ns".to_string()).or_insert_with(|| ns.to_string());
        l.insert("kubernetes.io/metadata.name".to_string(), ns.to_string());
        self.snapshot.upsert_namespace(Namespace {
            name: ns.to_string(),
            labels: l,
        });
        if !self.ns_index.contains_key(ns) {
            self.ns_index.insert(ns.to_string(), self.next_ns);
            self.next_ns += 1;
        }
        Ok(())
    }

    fn create_pod(&mut self, ns: &str, name: &str, labels: &Labels) -> Result<(), CaseError> {
        let Some(nsi) = self
            .ns_index
            .get(ns)
            .copied()
            .filter(|_| self.snapshot.namespaces.contains_key(ns))
        else {
            return Err(CaseError::NoNamespace {
                action: "create_pod",
                namespace: ns.to_string(),
            });
        };
        let key = (ns.to_string(), name.to_string());
        if self.snapshot.pods.contains_key(&key) {
            return Err(CaseError::Exists {
                action: "create_pod",
                object: format!("{ns}/{name}"),
            });
        }
        let used: Vec<u16> = self
            .pod_index
            .iter()
            .filter(|(k, _)| k.starts_with(&format!("{ns}/")))
            .map(|(_, v)| *v)
            .collect();
        let pi = used.iter().max().map_or(1, |m| m + 1);
        self.pod_index.insert(format!("{ns}/{name}"), pi);
        self.clock += 1;
        let v4 = Ipv4Addr::new(198, 18, nsi as u8, pi as u8);
        let v6: Ipv6Addr = format!("fd00:198:18::{nsi}:{pi}").parse().expect("valid IPv6");
        self.snapshot.upsert_pod(Pod {
            uid: format!("{ns}-{name}-{}", self.clock),
            namespace: ns.to_string(),
            name: name.to_string(),
            labels: labels.clone(),
            ips: vec![IpAddr::V4(v4), IpAddr::V6(v6)],
            node_name: Some(MODEL_NODE.to_string()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: false,
            ports: model_container_ports(),
            created: self.clock,
        });
        Ok(())
    }

    fn policy(&self, action: &'static str, np: &NetworkPolicy) -> Result<NetworkPolicy, CaseError> {
        let text = serde_yaml::to_string(np)?;
        if !text.contains("${") {
            return Ok(np.clone());
        }
        let text = substitute(&text, &|p| self.ip(p)).map_err(|e| CaseError::Placeholder {
            placeholder: action.to_string(),
            message: e.to_string(),
        })?;
        Ok(serde_yaml::from_str(&text)?)
    }

    fn pod_mut(&mut self, action: &'static str, pod: &str) -> Result<&mut Pod, CaseError> {
        let key = split_pod(pod)?;
        self.snapshot.pods.get_mut(&key).ok_or_else(|| CaseError::NoPod {
            action,
            pod: pod.to_string(),
        })
    }

    fn ns_mut(&mut self, action: &'static str, ns: &str) -> Result<&mut Namespace, CaseError> {
        self.snapshot
            .namespaces
            .get_mut(ns)
            .ok_or_else(|| CaseError::NoNamespace {
                action,
                namespace: ns.to_string(),
            })
    }

    /// Applies one action.
    pub fn apply(&mut self, action: &Action) -> Result<(), CaseError> {
        let name = action.name();
        match action {
            Action::CreatePolicy(np) | Action::UpdatePolicy(np) => {
                let np = self.policy(name, np)?;
                self.snapshot.upsert_policy(&np).map_err(|e| CaseError::InvalidPolicy {
                    action: name,
                    errors: e.errors,
                })?;
            }
            Action::DeletePolicy(o) => self.snapshot.remove_policy(&o.namespace, &o.name),
            Action::DeleteAllPolicies(_) => {
                self.snapshot.policies.clear();
                self.snapshot.invalid_policies.clear();
            }
            Action::AddNamespaceLabels(a) => self.ns_mut(name, &a.namespace)?.labels.extend(a.labels.clone()),
            Action::SetNamespaceLabels(a) => {
                let ns = self.ns_mut(name, &a.namespace)?;
                ns.labels = a.labels.clone();
                ns.labels
                    .insert("kubernetes.io/metadata.name".to_string(), a.namespace.clone());
            }
            Action::AddPodLabels(a) => self.pod_mut(name, &a.pod)?.labels.extend(a.labels.clone()),
            Action::SetPodLabels(a) => self.pod_mut(name, &a.pod)?.labels = a.labels.clone(),
            Action::CreatePod(a) => {
                let (ns, p) = split_pod(&a.pod)?;
                self.create_pod(&ns, &p, &a.labels)?;
            }
            Action::DeletePod(a) => {
                let (ns, p) = split_pod(&a.pod)?;
                self.snapshot.remove_pod(&ns, &p).ok_or_else(|| CaseError::NoPod {
                    action: name,
                    pod: a.pod.clone(),
                })?;
            }
            Action::CreateNamespace(a) => self.create_namespace(&a.namespace, &a.labels)?,
            Action::DeleteNamespace(a) => {
                self.snapshot
                    .remove_namespace(&a.namespace)
                    .ok_or_else(|| CaseError::NoNamespace {
                        action: name,
                        namespace: a.namespace.clone(),
                    })?;
                self.snapshot.pods.retain(|(ns, _), _| ns != &a.namespace);
                self.snapshot.policies.retain(|(ns, _), _| ns != &a.namespace);
                self.snapshot.invalid_policies.retain(|p| p.namespace != a.namespace);
            }
        }
        Ok(())
    }

    /// The matrix of a probe computed by the reference evaluator and, for
    /// the same cells, by [`crate::lookup::lookup`] on the compiled form
    /// (both ends: the source's egress and the destination's ingress).
    /// Returns (evaluator, compiled). Rows are the probe's sources that
    /// exist; pods of `pods` that do not exist are skipped.
    pub fn probe(&self, sources: &[String], pods: &[String], protocol: Protocol, port: u16) -> (Matrix, Matrix) {
        let opts = Model::options();
        let compiled = crate::compile(&self.snapshot, &opts, None);
        let table = PrefixTable::new(&compiled.cidrs);
        let ep_of = |pod: &str| {
            compiled
                .endpoints
                .iter()
                .find(|(_, e)| format!("{}/{}", e.pod.namespace, e.pod.name) == pod)
                .map(|(id, _)| *id)
        };
        let rows: Vec<String> = sources.iter().filter(|s| self.ip(s).is_some()).cloned().collect();
        let cols: Vec<String> = pods.iter().filter(|s| self.ip(s).is_some()).cloned().collect();
        let mut ev = Vec::new();
        let mut co = Vec::new();
        for r in &rows {
            let src = self.ip(r).expect("filtered");
            let (mut er, mut cr) = (Vec::new(), Vec::new());
            for c in &cols {
                let dst = self.ip(c).expect("filtered");
                let flow = crate::evaluate::Flow {
                    src,
                    dst,
                    protocol: protocol.number(),
                    dst_port: port,
                };
                er.push(crate::evaluate::evaluate(&self.snapshot, &opts, &flow).allowed);
                let eg = ep_of(r).is_none_or(|e| {
                    crate::lookup::lookup_with(
                        &compiled,
                        Some(&table),
                        e,
                        Direction::Egress,
                        dst,
                        protocol.number(),
                        port,
                    )
                    .allowed
                });
                let ing = ep_of(c).is_none_or(|e| {
                    crate::lookup::lookup_with(
                        &compiled,
                        Some(&table),
                        e,
                        Direction::Ingress,
                        src,
                        protocol.number(),
                        port,
                    )
                    .allowed
                });
                cr.push(eg && ing);
            }
            ev.push(er);
            co.push(cr);
        }
        (
            Matrix {
                rows: rows.clone(),
                columns: cols.clone(),
                cells: ev,
            },
            Matrix {
                rows,
                columns: cols,
                cells: co,
            },
        )
    }
}

/// The outcome of one probe.
#[derive(Clone, Debug)]
pub struct ProbeResult {
    /// Step index.
    pub step: usize,
    /// Probe index in the step.
    pub probe: usize,
    /// Expected matrix.
    pub expected: Matrix,
    /// Matrix of the reference evaluator.
    pub actual: Matrix,
    /// Cells where the evaluator differs from the expectation.
    pub mismatches: Vec<Mismatch>,
    /// Cells where the compiled lookup differs from the evaluator (a
    /// compiler bug).
    pub compiled_mismatches: Vec<Mismatch>,
}

/// The outcome of a case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Case id.
    pub id: String,
    /// Probes run.
    pub probes: Vec<ProbeResult>,
    /// An action or probe that could not run (the case fails).
    pub error: Option<String>,
}

impl CaseResult {
    /// No error, no mismatch.
    pub fn passed(&self) -> bool {
        self.error.is_none()
            && self
                .probes
                .iter()
                .all(|p| p.mismatches.is_empty() && p.compiled_mismatches.is_empty())
    }

    /// A human report: the failing probes with their matrices.
    pub fn report(&self) -> String {
        let mut s = format!("{}: {}\n", self.id, if self.passed() { "PASS" } else { "FAIL" });
        if let Some(e) = &self.error {
            s.push_str(&format!("  error: {e}\n"));
        }
        for p in self
            .probes
            .iter()
            .filter(|p| !p.mismatches.is_empty() || !p.compiled_mismatches.is_empty())
        {
            s.push_str(&format!(
                "  step {} probe {}:\n  expected:\n{}  actual:\n{}",
                p.step,
                p.probe,
                p.expected.render(),
                p.actual.render()
            ));
            for m in &p.mismatches {
                s.push_str(&format!("    {m}\n"));
            }
            for m in &p.compiled_mismatches {
                s.push_str(&format!("    compiled disagrees with evaluator: {m}\n"));
            }
        }
        s
    }
}

/// Runs a case on [`Model::upstream`]: applies each step's actions, then
/// checks each probe against the evaluator and the compiled lookup.
pub fn run_case_simulated(case: &Case) -> CaseResult {
    let mut res = CaseResult {
        id: case.id.clone(),
        probes: Vec::new(),
        error: None,
    };
    let mut model = Model::upstream();
    for (si, step) in case.steps.iter().enumerate() {
        for a in &step.actions {
            if let Err(e) = model.apply(a) {
                res.error = Some(format!("step {si}: {e}"));
                return res;
            }
        }
        for (pi, probe) in step.probes.iter().enumerate() {
            let (proto, expected) = match probe.protocol().and_then(|p| Ok((p, probe.expected()?))) {
                Ok(v) => v,
                Err(e) => {
                    res.error = Some(format!("step {si} probe {pi}: {e}"));
                    return res;
                }
            };
            let (actual, compiled) = model.probe(&expected.rows, &probe.pods, proto, probe.port);
            let mismatches = expected.compare(&actual);
            let compiled_mismatches = actual.compare(&compiled);
            res.probes.push(ProbeResult {
                step: si,
                probe: pi,
                expected,
                actual,
                mismatches,
                compiled_mismatches,
            });
        }
    }
    res
}
