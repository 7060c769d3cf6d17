//! Kubernetes Events on the NetworkPolicies the agent cannot fully convert
//!: such a policy is enforced as far as it is understood
//! (`npm_policy::validate`), and the operator learns about it from a
//! `Warning` Event with reason [`REASON_PARTIALLY_INVALID`] on the policy,
//! whose message names each field path, its value and what was dropped.
//!
//! One Event per policy resourceVersion: the sync loop hands the complete
//! set of reports of each compile to [`EventRecorder::report`], which
//! sends only those not in the previous set; the Event's name is derived
//! from the policy and its uid and resourceVersion ([`PolicyReport::event_name`]),
//! so a restarted agent, or the agent of another node, creates the same
//! object and gets `AlreadyExists` instead of a duplicate. Events are
//! created by a task of their own (core `v1` Events; the chart grants
//! `events` `create` in both API groups): the sync loop never waits on the
//! API server for them. A create that fails is retried with backoff, then
//! counted in `npm_errors_total{kind="event"}` and logged.
//!
//! ClusterNetworkPolicies that are not fully understood get the same Event
//! ([`PolicyReport::cluster`]): they are cluster-scoped, so the Event is
//! created in namespace [`CLUSTER_EVENT_NAMESPACE`] (where Kubernetes puts
//! the Events of cluster-scoped objects) and its involvedObject has no
//! namespace.
//!
//! A kernel map that the compiled state does not fit (degraded mode, see
//! `reconcile::syncer`) gets a `Warning` Event with reason
//! [`REASON_MAP_FULL`] on this node's Node object ([`MapFullReport`]), once
//! each time the map enters degraded mode (not on every sync while it
//! stays there), beside the log line, `npm_map_full{map}` and the
//! `map-capacity` readiness check.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::core::v1::{Event, EventSource, ObjectReference};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
use kube::api::{Api, PostParams};
use npm_policy::model::InvalidPolicy;
use tokio::sync::mpsc;

use super::metrics::Metrics;
use crate::k8s::Objects;

/// The reason of the Event on a policy that is not fully understood.
pub const REASON_PARTIALLY_INVALID: &str = "PolicyPartiallyInvalid";
/// The reason of the Event on the Node whose agent programs a reduced,
/// fail-closed state because a kernel map is full.
pub const REASON_MAP_FULL: &str = "NpmMapFull";
/// The namespace of the Events on cluster-scoped objects.
pub const CLUSTER_EVENT_NAMESPACE: &str = "default";
/// `reportingComponent` (and `source.component`) of the agent's Events.
pub const REPORTING_COMPONENT: &str = "npm-agent";
/// The longest Event message (the `events.k8s.io` limit of `note`).
pub const MAX_MESSAGE: usize = 1024;
/// Attempts to create one Event before it is given up (and counted).
const ATTEMPTS: u32 = 5;
/// The wait after the first failed attempt (doubling).
const FIRST_RETRY: Duration = Duration::from_millis(500);

/// One policy that is not fully understood, at one resourceVersion.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyReport {
    /// A ClusterNetworkPolicy (cluster-scoped; `namespace` is empty), else
    /// a NetworkPolicy.
    pub cluster: bool,
    /// Namespace of the policy (empty for a ClusterNetworkPolicy).
    pub namespace: String,
    /// Name of the policy.
    pub name: String,
    /// metadata.uid.
    pub uid: String,
    /// metadata.resourceVersion.
    pub resource_version: String,
    /// The conversion's errors, each naming the field, the value and what
    /// was dropped.
    pub errors: Vec<String>,
}

/// One kernel map the programmed state did not fit, on this node: the
/// subject of a [`REASON_MAP_FULL`] Event on the Node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MapFullReport {
    /// The map (`NPM_POLICY`, `NPM_IPCACHE`, ...).
    pub map: String,
    /// What did not fit and what was programmed instead (the shortfall's
    /// own description: entries needed, capacity, written, reduced).
    pub detail: String,
}

impl MapFullReport {
    /// The Event's message: the shortfall and what to do about it, cut to
    /// [`MAX_MESSAGE`] bytes.
    pub fn message(&self) -> String {
        let mut m = format!(
            "{}; enforcement of what was programmed is kept and nothing is opened; raise the map size (chart value \
             mapSizes) or reduce the policy",
            self.detail
        );
        truncate(&mut m);
        m
    }

    /// The core `v1` Event on Node `node` (in [`CLUSTER_EVENT_NAMESPACE`]),
    /// named after the node, the map and the time, so each entry into
    /// degraded mode is its own Event.
    pub fn event(&self, node: &str) -> Event {
        let now = k8s_openapi::jiff::Timestamp::now();
        let stamp = now.as_nanosecond().to_string();
        let hash = fnv64(&[node, &self.map, &stamp]);
        let mut event = base_event(node, now, REASON_MAP_FULL, self.message(), "Program");
        event.metadata = ObjectMeta {
            name: Some(format!("{}.{hash:016x}", dns_prefix(node, "node"))),
            namespace: Some(CLUSTER_EVENT_NAMESPACE.to_string()),
            ..ObjectMeta::default()
        };
        event.involved_object = ObjectReference {
            api_version: Some("v1".into()),
            kind: Some("Node".into()),
            name: Some(node.to_string()),
            ..ObjectReference::default()
        };
        event
    }
}

/// `name` made a valid DNS-subdomain prefix (at most 200 characters),
/// `fallback` when nothing is left.
fn dns_prefix(name: &str, fallback: &str) -> String {
    let mut prefix: String = name
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '.' | '-') => c,
            _ => '-',
        })
        .take(200)
        .collect();
    while prefix.ends_with(['.', '-']) {
        prefix.pop();
    }
    let prefix = prefix.trim_start_matches(['.', '-']);
    if prefix.is_empty() {
        fallback.to_string()
    } else {
        prefix.to_string()
    }
}

/// Cuts `m` to [`MAX_MESSAGE`] bytes (on a character boundary, ending in
/// `...`).
fn truncate(m: &mut String) {
    if m.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE - 3;
        while !m.is_char_boundary(end) {
            end -= 1;
        }
        m.truncate(end);
        m.push_str("...");
    }
}

/// The fields every Event of the agent of `node` shares: a `Warning` of
/// `reason` with `message`, timestamps `now`, reported by the agent.
fn base_event(node: &str, now: k8s_openapi::jiff::Timestamp, reason: &str, message: String, action: &str) -> Event {
    Event {
        reason: Some(reason.into()),
        message: Some(message),
        type_: Some("Warning".into()),
        action: Some(action.into()),
        count: Some(1),
        first_timestamp: Some(Time(now)),
        last_timestamp: Some(Time(now)),
        event_time: Some(MicroTime(now)),
        reporting_component: Some(REPORTING_COMPONENT.into()),
        reporting_instance: Some(node.to_string()),
        source: Some(EventSource {
            component: Some(REPORTING_COMPONENT.into()),
            host: Some(node.to_string()),
        }),
        ..Event::default()
    }
}

/// What the Event task is asked to create.
#[derive(Debug)]
enum Pending {
    /// A policy not fully understood.
    Policy(PolicyReport),
    /// A kernel map full on this node.
    MapFull(MapFullReport),
}

/// The key of "one Event per policy resourceVersion": namespace, name,
/// uid, resourceVersion.
type ReportKey = (String, String, String, String);

/// FNV-1a, 64 bits: a hash that stays the same across builds and
/// processes (the Event name must be the same on every node).
fn fnv64(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.bytes().chain([0u8]) {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

impl PolicyReport {
    /// The key of "one Event per policy resourceVersion".
    fn key(&self) -> ReportKey {
        (
            self.namespace.clone(),
            self.name.clone(),
            self.uid.clone(),
            self.resource_version.clone(),
        )
    }

    /// The Event's name: the policy's name (made a valid DNS subdomain
    /// and cut to 200 characters) and a stable hash of the namespace,
    /// name, uid and resourceVersion.
    pub fn event_name(&self) -> String {
        let fallback = if self.cluster {
            "clusternetworkpolicy"
        } else {
            "networkpolicy"
        };
        let hash = fnv64(&[&self.namespace, &self.name, &self.uid, &self.resource_version]);
        format!("{}.{hash:016x}", dns_prefix(&self.name, fallback))
    }

    /// The Event's message: what is enforced, then each error (field path,
    /// value, what was dropped), cut to [`MAX_MESSAGE`] bytes.
    pub fn message(&self) -> String {
        let object = if self.cluster {
            format!("{}: ", self.name)
        } else {
            format!("{}/{}: ", self.namespace, self.name)
        };
        let errors: Vec<&str> = self
            .errors
            .iter()
            .map(|e| e.strip_prefix(&object).unwrap_or(e))
            .collect();
        let mut m = if self.cluster {
            format!(
                "ClusterNetworkPolicy only partly understood; what cannot be understood fails closed (a peer it \
                 cannot read matches nothing in an Accept rule and everything in a Deny or Pass rule): {}",
                errors.join("; ")
            )
        } else {
            format!(
                "NetworkPolicy only partly understood; it keeps isolating the pods it selects, only what cannot be \
                 understood is dropped: {}",
                errors.join("; ")
            )
        };
        truncate(&mut m);
        m
    }

    /// The namespace the Event is created in.
    pub fn event_namespace(&self) -> &str {
        if self.cluster {
            CLUSTER_EVENT_NAMESPACE
        } else {
            &self.namespace
        }
    }

    /// The core `v1` Event on the policy, reported by the agent of `node`.
    pub fn event(&self, node: &str) -> Event {
        let now = k8s_openapi::jiff::Timestamp::now();
        let (api_version, kind) = if self.cluster {
            (
                format!(
                    "{}/{}",
                    crate::k8s::cluster_policy::GROUP,
                    crate::k8s::cluster_policy::VERSION
                ),
                crate::k8s::cluster_policy::KIND,
            )
        } else {
            ("networking.k8s.io/v1".to_string(), "NetworkPolicy")
        };
        let mut event = base_event(node, now, REASON_PARTIALLY_INVALID, self.message(), "Enforce");
        event.metadata = ObjectMeta {
            name: Some(self.event_name()),
            namespace: Some(self.event_namespace().to_string()),
            ..ObjectMeta::default()
        };
        event.involved_object = ObjectReference {
            api_version: Some(api_version),
            kind: Some(kind.into()),
            namespace: (!self.cluster).then(|| self.namespace.clone()),
            name: Some(self.name.clone()),
            uid: Some(self.uid.clone()).filter(|u| !u.is_empty()),
            resource_version: Some(self.resource_version.clone()).filter(|r| !r.is_empty()),
            ..ObjectReference::default()
        };
        event
    }
}

/// The reports of the policies of `invalid` (the snapshot's
/// `invalid_policies`), each with the uid and resourceVersion of its API
/// object in `policies` (looked up by key).
pub fn reports_of(invalid: &[InvalidPolicy], policies: &Objects<NetworkPolicy>) -> Vec<PolicyReport> {
    invalid
        .iter()
        .map(|p| {
            let meta = policies
                .get(&(p.namespace.clone(), p.name.clone()))
                .map(|np| &np.metadata);
            PolicyReport {
                cluster: false,
                namespace: p.namespace.clone(),
                name: p.name.clone(),
                uid: meta.and_then(|m| m.uid.clone()).unwrap_or_default(),
                resource_version: meta.and_then(|m| m.resource_version.clone()).unwrap_or_default(),
                errors: p.errors.clone(),
            }
        })
        .collect()
}

/// The reports of the ClusterNetworkPolicies of `invalid` (name, errors),
/// each with the uid and resourceVersion of its API object in `policies`
/// (looked up by key: cluster-scoped, so an empty namespace).
pub fn cluster_reports_of(
    invalid: &[(String, Vec<String>)],
    policies: &Objects<crate::k8s::ClusterNetworkPolicy>,
) -> Vec<PolicyReport> {
    invalid
        .iter()
        .map(|(name, errors)| {
            let meta = policies.get(&(String::new(), name.clone())).map(|p| &p.metadata);
            PolicyReport {
                cluster: true,
                namespace: String::new(),
                name: name.clone(),
                uid: meta.and_then(|m| m.uid.clone()).unwrap_or_default(),
                resource_version: meta.and_then(|m| m.resource_version.clone()).unwrap_or_default(),
                errors: errors.clone(),
            }
        })
        .collect()
}

/// Sends the Events of new reports to a task that creates them (see the
/// module doc). Cloning shares the task and the set of known reports.
#[derive(Clone, Debug)]
pub struct EventRecorder {
    tx: mpsc::UnboundedSender<Pending>,
    known: Arc<Mutex<BTreeSet<ReportKey>>>,
}

impl EventRecorder {
    /// A recorder whose task (spawned on the current tokio runtime, it
    /// ends when every recorder is dropped) creates the Events with
    /// `client`, as the agent of node `node`.
    pub fn spawn(client: kube::Client, node: String, metrics: Metrics) -> (EventRecorder, tokio::task::JoinHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run(rx, client, node, metrics));
        (
            EventRecorder {
                tx,
                known: Arc::default(),
            },
            task,
        )
    }

    /// The complete set of reports of the current compile: an Event is
    /// sent for each report whose policy resourceVersion was not in the
    /// previous set. Never blocks.
    pub fn report(&self, reports: Vec<PolicyReport>) {
        let mut known = self.known.lock().unwrap_or_else(|p| p.into_inner());
        let current: BTreeSet<_> = reports.iter().map(PolicyReport::key).collect();
        for r in reports {
            if !known.contains(&r.key()) && self.tx.send(Pending::Policy(r)).is_err() {
                tracing::warn!("policy event task stopped; Event not created");
            }
        }
        *known = current;
    }

    /// A kernel map entered degraded mode: an Event on this node's Node
    /// object. Never blocks.
    pub fn map_full(&self, report: MapFullReport) {
        if self.tx.send(Pending::MapFull(report)).is_err() {
            tracing::warn!("event task stopped; map-full Event not created");
        }
    }
}

/// Creates one Event: `Ok` also when it exists already (another agent or an
/// earlier run created it).
async fn create(client: &kube::Client, namespace: &str, event: &Event) -> Result<(), kube::Error> {
    let api: Api<Event> = Api::namespaced(client.clone(), namespace);
    match api.create(&PostParams::default(), event).await {
        Ok(_) => Ok(()),
        Err(kube::Error::Api(s)) if s.is_already_exists() || s.code == 409 => Ok(()),
        Err(e) => Err(e),
    }
}

async fn run(mut rx: mpsc::UnboundedReceiver<Pending>, client: kube::Client, node: String, metrics: Metrics) {
    while let Some(pending) = rx.recv().await {
        // (what the Event is on, its namespace, the Event, its reason)
        let (subject, namespace, event, reason) = match &pending {
            Pending::Policy(report) => (
                if report.cluster {
                    format!("clusternetworkpolicy {}", report.name)
                } else {
                    format!("{}/{}", report.namespace, report.name)
                },
                report.event_namespace().to_string(),
                report.event(&node),
                REASON_PARTIALLY_INVALID,
            ),
            Pending::MapFull(report) => (
                format!("node {node} (map {})", report.map),
                CLUSTER_EVENT_NAMESPACE.to_string(),
                report.event(&node),
                REASON_MAP_FULL,
            ),
        };
        let name = event.metadata.name.clone().unwrap_or_default();
        let mut wait = FIRST_RETRY;
        for attempt in 1..=ATTEMPTS {
            match create(&client, &namespace, &event).await {
                Ok(()) => {
                    tracing::info!(%subject, event = %name, reason, "Event recorded");
                    break;
                }
                Err(e) if attempt == ATTEMPTS => {
                    metrics.error("event");
                    tracing::error!(%subject, error = %e, "Event not created");
                }
                Err(e) => {
                    tracing::debug!(%subject, error = %e, attempt, "creating the Event failed; retrying");
                    tokio::time::sleep(wait).await;
                    wait *= 2;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(name: &str, rv: &str) -> PolicyReport {
        PolicyReport {
            cluster: false,
            namespace: "ns".into(),
            name: name.into(),
            uid: "u1".into(),
            resource_version: rv.into(),
            errors: vec![format!(
                "ns/{name}: spec.ingress[1].from[0].ipBlock.cidr: invalid CIDR \"10.0.0.0/33\" (rule spec.ingress[1] dropped)"
            )],
        }
    }

    #[test]
    fn names_are_stable_valid_and_per_resource_version() {
        let a = report("allow-web", "7");
        assert_eq!(a.event_name(), report("allow-web", "7").event_name());
        assert_ne!(a.event_name(), report("allow-web", "8").event_name());
        assert!(a.event_name().starts_with("allow-web."));
        let odd = report(&format!("{}-Bad_Name-", "x".repeat(300)), "1").event_name();
        assert!(odd.len() <= 253, "{}", odd.len());
        assert!(odd
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '.' || c == '-'));
        assert_eq!(report("--", "1").event_name().split('.').next(), Some("networkpolicy"));
    }

    #[test]
    fn message_names_field_value_and_drop_and_is_bounded() {
        let m = report("p", "1").message();
        assert!(m.contains("spec.ingress[1].from[0].ipBlock.cidr"), "{m}");
        assert!(m.contains("\"10.0.0.0/33\""), "{m}");
        assert!(m.contains("rule spec.ingress[1] dropped"), "{m}");
        assert!(!m.contains("ns/p: "), "the object is the Event's involvedObject: {m}");
        let mut long = report("p", "1");
        long.errors = vec!["é".repeat(2000)];
        assert!(long.message().len() <= MAX_MESSAGE);
    }

    #[test]
    fn a_cluster_policy_event_is_in_default_without_namespace() {
        let mut r = report("deny-metadata", "4");
        r.cluster = true;
        r.namespace = String::new();
        r.errors = vec!["deny-metadata: spec.egress[0].to[0]: no peer field set (fails closed)".into()];
        let e = r.event("node-a");
        assert_eq!(e.metadata.namespace.as_deref(), Some(CLUSTER_EVENT_NAMESPACE));
        assert_eq!(e.involved_object.kind.as_deref(), Some("ClusterNetworkPolicy"));
        assert_eq!(
            e.involved_object.api_version.as_deref(),
            Some("policy.networking.k8s.io/v1alpha2")
        );
        assert_eq!(e.involved_object.namespace, None);
        let m = e.message.unwrap();
        assert!(m.starts_with("ClusterNetworkPolicy only partly understood"), "{m}");
        assert!(
            m.contains("spec.egress[0].to[0]") && !m.contains("deny-metadata: "),
            "{m}"
        );
        assert!(r.event_name().starts_with("deny-metadata."));
    }

    #[test]
    fn a_map_full_event_is_on_the_node_and_names_the_map() {
        let r = MapFullReport {
            map: "NPM_POLICY".into(),
            detail: "map NPM_POLICY is full: 71 entries needed, 64 fit".into(),
        };
        let e = r.event("node-a");
        assert_eq!(e.metadata.namespace.as_deref(), Some(CLUSTER_EVENT_NAMESPACE));
        assert!(e.metadata.name.as_deref().unwrap().starts_with("node-a."));
        assert_eq!(e.involved_object.kind.as_deref(), Some("Node"));
        assert_eq!(e.involved_object.name.as_deref(), Some("node-a"));
        assert_eq!(e.involved_object.namespace, None);
        assert_eq!(e.reason.as_deref(), Some(REASON_MAP_FULL));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        let m = e.message.unwrap();
        assert!(m.contains("NPM_POLICY is full") && m.contains("mapSizes"), "{m}");
    }

    #[tokio::test]
    async fn only_new_resource_versions_are_sent() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let r = EventRecorder {
            tx,
            known: Arc::default(),
        };
        r.report(vec![report("a", "1"), report("b", "1")]);
        r.report(vec![report("a", "1"), report("b", "1")]);
        r.report(vec![report("a", "2"), report("b", "1")]);
        let mut sent = Vec::new();
        while let Ok(Pending::Policy(x)) = rx.try_recv() {
            sent.push((x.name, x.resource_version));
        }
        let want = [("a", "1"), ("b", "1"), ("a", "2")].map(|(n, v)| (n.to_string(), v.to_string()));
        assert_eq!(sent, want);
    }
}
