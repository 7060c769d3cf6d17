//! The agent's Prometheus metrics.
//!
//! A [`Metrics`] owns its own [`PrometheusRecorder`] (no global recorder):
//! `main` builds one and passes it to the watchers, the sync loop and the
//! HTTP server, and tests build their own and read [`Metrics::render`].
//!
//! Every series is listed once in [`SERIES`] with its type, unit and HELP
//! text; the registry describes all of them, so each family renders with
//! `# HELP` and `# TYPE`. Names follow the Prometheus conventions: counters
//! end in `_total`, durations are in seconds (`_seconds`), sizes in bytes
//! (`_bytes`), timestamps in Unix seconds. `npm_build_info` is a gauge of 1
//! whose labels say which build runs.

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Recorder, Unit};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use npm_common::Reason;
use npm_dataplane::ebpf::MapFill;
use npm_dataplane::Counters;

/// Errors building the metrics registry.
#[derive(Debug, thiserror::Error)]
pub enum MetricsError {
    /// The histogram bucket configuration was rejected.
    #[error("metrics: bad histogram buckets for {metric}: {detail}")]
    Buckets {
        /// Metric the buckets were for.
        metric: &'static str,
        /// What the exporter said.
        detail: String,
    },
}

/// The type of a series, as Prometheus sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Monotonic count (`_total`).
    Counter,
    /// Current value.
    Gauge,
    /// Buckets, `_sum` and `_count`.
    Histogram,
}

/// One series family the agent exports.
#[derive(Clone, Copy, Debug)]
pub struct Series {
    /// The family name (as rendered, without `_bucket`/`_sum`/`_count`).
    pub name: &'static str,
    /// Its type.
    pub kind: Kind,
    /// Its unit, if it has one (also the name's suffix).
    pub unit: Option<Unit>,
    /// The HELP text.
    pub help: &'static str,
    /// Its labels (empty: none).
    pub labels: &'static [&'static str],
}

const fn series(
    name: &'static str,
    kind: Kind,
    unit: Option<Unit>,
    labels: &'static [&'static str],
    help: &'static str,
) -> Series {
    Series {
        name,
        kind,
        unit,
        help,
        labels,
    }
}

use Kind::{Counter as C, Gauge as G, Histogram as H};
const S: Option<Unit> = Some(Unit::Seconds);
const B: Option<Unit> = Some(Unit::Bytes);
const N: Option<Unit> = Some(Unit::Count);

/// Every series family of the agent: the one list the registry describes,
/// the docs name and the chart's dashboard may query.
#[rustfmt::skip]
pub const SERIES: &[Series] = &[
    series("npm_build_info", G, None, &["version", "git_commit", "rustc"], "Always 1; the labels name the running build (git_commit and rustc only when known at build time)."),
    series("npm_sync_duration_seconds", H, S, &[], "Duration of one sync (snapshot, compile, guard, apply), in seconds."),
    series("npm_programming_latency_seconds", H, S, &[], "Seconds from the first API change of a batch being received to the kernel state being updated."),
    series("npm_syncs_total", C, N, &[], "Syncs whose changes were applied to the dataplane."),
    series("npm_invalid_policies", G, N, &[], "NetworkPolicies currently enforced only in part because they are not fully understood."),
    series("npm_invalid_cluster_network_policies", G, N, &[], "ClusterNetworkPolicies currently enforced only in part (failing closed) because they are not fully understood."),
    series("npm_policy_errors_total", C, N, &[], "Validation errors seen, one per new invalid policy version (NetworkPolicies and ClusterNetworkPolicies)."),
    series("npm_ip_conflicts_total", C, N, &[], "IP conflicts detected: two live pods claiming one IP."),
    series("npm_destructive_actions_deferred_total", C, N, &[], "Mass removals held until a direct read of the API server confirms them."),
    series("npm_deny_events_total", C, N, &[], "Deny events read from the datapath's ring buffer."),
    series("npm_deny_events_suppressed_total", C, N, &[], "Deny events read but not logged because of the flow-log rate limit."),
    series("npm_ready", G, None, &[], "1 when the first sync was applied and every readiness check passes, else 0."),
    series("npm_readiness_failures", G, None, &["check"], "1 while the readiness check fails, else 0."),
    series("npm_endpoints_pending_interface", G, N, &[], "Local endpoints whose host interface is not found yet (not enforced)."),
    series("npm_deleting_claims_expired", G, N, &[], "Deleting pods of other nodes past their grace period whose addresses no longer carry their identity."),
    series("npm_incremental_mismatch_total", C, N, &[], "Incremental compiles that differed from the full-compile cross-check."),
    series("npm_explain_mismatch_total", C, N, &[], "Explain requests whose kernel dry-run verdict differed from the agent's compiled verdict."),
    series("npm_observe_lost_total", C, N, &[], "Flow records dropped for `/observe` clients that read too slowly (each client's loss counts)."),
    series("npm_cni_add_wait_seconds", H, S, &[], "Seconds a CNI ADD waited until its endpoint was programmed."),
    series("npm_cni_chained", G, None, &[], "1 while the conflist the runtime uses holds npm-cni's entry, else 0 (only with --cni-conf-dir)."),
    series("npm_cni_rechained_total", C, N, &[], "Times npm-cni's entry was found missing from the primary CNI's conflist and put back."),
    series("npm_cni_endpoints_without_add_total", C, N, &[], "Local endpoints that appeared with no CNI ADD while npm-cni is expected to be chained (started unenforced)."),
    series("npm_cni_requests_total", C, N, &["command", "result"], "npm-cni requests answered, by command and result (ok, retry, error)."),
    series("npm_bridge_nf_unfiltered_endpoints", G, N, &["family"], "nftables: local endpoints on a bridge port whose family's bridge-nf-call sysctl is off or absent (br_netfilter not loaded): their same-bridge traffic is not filtered."),
    series("npm_interface_conflicts_total", C, N, &[], "Interfaces found claimed by more than one endpoint (the newcomers are refused)."),
    series("npm_held_removals", G, None, &[], "1 while a mass removal is held for a confirming direct read, else 0."),
    series("npm_last_sync_success_timestamp_seconds", G, S, &[], "Unix time in seconds of the last sync that completed without error."),
    series("npm_ringbuf_events_lost_total", C, N, &[], "Deny events the datapath could not write because its ring buffer was full."),
    series("npm_controller_pod_event_total", C, N, &["operation"], "Pod changes seen by the controller, by operation."),
    series("npm_watch_events_total", C, N, &["resource", "event"], "Watch events received, by resource and event type."),
    series("npm_errors_total", C, N, &["kind"], "Errors, by kind (watch, dataplane, direct-read, interface, counters...)."),
    series("npm_compiled_entries", G, N, &["table"], "Entries of the compiled state last synced, by table (ipcache, cidrs, endpoints, policy, tiers)."),
    series("npm_map_entries", G, N, &["map"], "Entries in each pinned kernel map (eBPF dataplane), by map name."),
    series("npm_map_capacity", G, N, &["map"], "Maximum entries of each pinned kernel map (eBPF dataplane), by map name."),
    series("npm_fold_fallbacks", G, N, &[], "Local endpoint directions with ClusterNetworkPolicy tier entries that are not folded into NPM_FOLD (too large for the map) and are decided by the lookups of NPM_TIERS and NPM_POLICY (same verdicts, slower)."),
    series("npm_dns_learned", G, N, &["kind"], "Names (kind=names) and addresses (kind=addresses) learned from the DNS answers of the trusted servers (--dns-server): what ClusterNetworkPolicy domainNames peers match."),
    series("npm_dns_evicted_total", C, N, &[], "Learned (name, address) pairs dropped before their TTL because the learner's bounds were reached (4,096 pairs a namespace, 256 addresses a name, 10,000 names, 16,384 addresses)."),
    series("npm_dns_responses_total", C, N, &["result"], "DNS responses of the trusted servers read (result: read = every one; learned = taught a new address; unparsable; held = parked until its addresses were programmed; released = a held one let through once programmed; hold_expired = a held one let through before; not_held_not_compiled, not_held_sync_unhealthy, not_held_cap = a learning one let through at once: no state compiled yet, the last sync failed or was held, --dns-max-holds reached)."),
    series("npm_dns_notrack", G, N, &[], "1 while raw-table NOTRACK rules exempt DNS from conntrack (NodeLocal DNSCache): no DNS answer is learned and domainNames peers deny (readiness check dns-learning)."),
    series("npm_dns_holding", G, N, &[], "DNS responses held now until their addresses are programmed (at most --dns-max-holds)."),
    series("npm_dns_rules_reasserted_total", C, N, &[], "Times the DNS learning's NFQUEUE iptables rules were found missing (a firewall reload) and re-installed."),
    series("npm_datapath_reduced", G, None, &[], "1 when the kernel's verifier refused the full eBPF datapath as too large and the reduced one runs (every decision by the policy LPMs, no precomputed layers: the same verdicts at a higher cost per packet), else 0 (eBPF dataplane only)."),
    series("npm_pod_condition_writes_total", C, N, &["result"], "Patches of local pods' npm.io/PolicyEnforced and npm.io/PolicyDegraded conditions (pods/status), by result (ok; gone: the pod was deleted or replaced; error: retried)."),
    series("npm_pod_condition_pending", G, N, &[], "Local pods whose npm conditions wait for a patch (the writer's rate limit: --pod-condition-qps, --pod-condition-burst)."),
    series("npm_map_full", G, N, &["map"], "1 while the compiled state does not fit this kernel map (eBPF dataplane) and a reduced, fail-closed state is programmed (degraded mode), else 0."),
    series("npm_packets_total", C, N, &["direction", "reason", "verdict"], "Packets classified by the datapath, by direction, reason and verdict."),
    series("npm_bytes_total", C, B, &["direction", "reason", "verdict"], "Bytes of the packets classified by the datapath, by direction, reason and verdict."),
    series("npm_tier_packets_total", C, N, &["direction", "tier", "action"], "New connections decided by a ClusterNetworkPolicy tier (admin, baseline), by direction and action (accept, deny); the datapath counters of the reasons admin-accept, admin-deny, baseline-accept and baseline-deny."),
    series("npm_audit_would_deny_total", C, N, &["namespace", "policy", "direction"], "New connections the datapath allowed that an audited NetworkPolicy (annotation npm.io/audit set to true: evaluated, not enforced) would deny, by policy namespace, policy name and direction of the pod; one per reported allow event and audited policy."),
    series("npm_rule_allowed_packets_total", C, N, &["namespace", "policy", "rule", "direction"], "Packets a NetworkPolicy rule allowed at the policy decision: the first packet of each new connection (its later packets are tracked, not re-decided: reason tracked of npm_packets_total), by policy namespace, policy name, rule index and direction; _other: beyond --rule-metrics-max or not attributable."),
    series("npm_rule_allowed_bytes_total", C, B, &["namespace", "policy", "rule", "direction"], "Bytes of the packets counted by npm_rule_allowed_packets_total."),
    series("npm_endpoint_denied_packets_total", C, N, &["namespace", "pod", "direction"], "Packets NetworkPolicy denied to an isolated pod of this node, by pod namespace, pod name and direction; _other: beyond --rule-metrics-max or not attributable."),
    series("npm_endpoint_denied_bytes_total", C, B, &["namespace", "pod", "direction"], "Bytes of the packets counted by npm_endpoint_denied_packets_total."),
    series("npm_rule_metrics_folded", G, N, &["kind"], "Live rules (kind rule) or pods (kind endpoint) counted in an _other series because --rule-metrics-max series of their kind exist."),
    series("npm_tier_bytes_total", C, B, &["direction", "tier", "action"], "Bytes of the packets decided by a ClusterNetworkPolicy tier, by direction, tier and action (the same counters as npm_tier_packets_total)."),
];

/// The (tier, action) labels of a tier reason, `None` for the others.
pub const fn tier_of(reason: Reason) -> Option<(&'static str, &'static str)> {
    match reason {
        Reason::AdminAccept => Some(("admin", "accept")),
        Reason::AdminDeny => Some(("admin", "deny")),
        Reason::BaselineAccept => Some(("baseline", "accept")),
        Reason::BaselineDeny => Some(("baseline", "deny")),
        _ => None,
    }
}

/// The four tier reasons.
const TIER_REASONS: [Reason; 4] = [
    Reason::AdminAccept,
    Reason::AdminDeny,
    Reason::BaselineAccept,
    Reason::BaselineDeny,
];

/// The families whose labels name pods or policies (namespace, policy or
/// pod labels): served only with credentials that grant `get` on the
/// non-resource URL `/metrics`, or on the loopback debug listener.
pub const NAMED_FAMILIES: [&str; 5] = [
    "npm_audit_would_deny_total",
    "npm_rule_allowed_packets_total",
    "npm_rule_allowed_bytes_total",
    "npm_endpoint_denied_packets_total",
    "npm_endpoint_denied_bytes_total",
];

/// `text` (a Prometheus text exposition) without the samples, `# HELP`
/// and `# TYPE` lines of the [`NAMED_FAMILIES`].
fn public_text(text: &str) -> String {
    let named = |line: &str| {
        let name = line
            .strip_prefix("# HELP ")
            .or_else(|| line.strip_prefix("# TYPE "))
            .unwrap_or(line);
        let name = name.split(['{', ' ']).next().unwrap_or("");
        NAMED_FAMILIES.contains(&name)
    };
    let mut out = String::with_capacity(text.len());
    for line in text.lines().filter(|l| !named(l)) {
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// Operations counted by `npm_controller_pod_event_total{operation}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodOperation {
    /// A pod appeared.
    Create,
    /// A pod changed.
    Update,
    /// A pod that had an IP now has none (incident 1).
    UpdateWithEmptyIp,
    /// A pod disappeared.
    Delete,
}

impl PodOperation {
    /// The `operation` label value.
    pub const fn label(self) -> &'static str {
        match self {
            PodOperation::Create => "create",
            PodOperation::Update => "update",
            PodOperation::UpdateWithEmptyIp => "update-with-empty-ip",
            PodOperation::Delete => "delete",
        }
    }
}

/// Every metric of the agent, as registered handles.
#[derive(Clone)]
pub struct Metrics {
    recorder: Arc<PrometheusRecorder>,
    handle: PrometheusHandle,
    /// `npm_sync_duration_seconds`: one snapshot+compile+apply.
    pub sync_duration: Histogram,
    /// `npm_programming_latency_seconds`: first event of a batch received -> kernel updated.
    pub programming_latency: Histogram,
    /// `npm_syncs_total`: successful applies.
    pub syncs: Counter,
    /// `npm_invalid_policies`: policies currently skipped as invalid.
    pub invalid_policies: Gauge,
    /// `npm_invalid_cluster_network_policies`: ClusterNetworkPolicies currently enforced only in part.
    pub invalid_cluster_policies: Gauge,
    /// `npm_policy_errors_total`: validation errors seen (each new invalid policy version).
    pub policy_errors: Counter,
    /// `npm_ip_conflicts_total`: IP conflicts (two live pods claiming one IP) detected.
    pub ip_conflicts: Counter,
    /// `npm_destructive_actions_deferred_total`: mass deletions held for a direct read.
    pub destructive_deferred: Counter,
    /// `npm_deny_events_total`: deny events read from the ring buffer.
    pub deny_events: Counter,
    /// `npm_deny_events_suppressed_total`: deny events not logged by the rate limit.
    pub deny_events_suppressed: Counter,
    /// `npm_ready`: 1 when the first sync was applied and every readiness check passes.
    pub ready: Gauge,
    /// `npm_endpoints_pending_interface`: local endpoints whose interface is not found yet.
    pub endpoints_pending: Gauge,
    /// `npm_deleting_claims_expired`: deleting pods of other nodes whose
    /// claims expired ([`crate::reconcile::expiry`]).
    pub deleting_claims_expired: Gauge,
    /// `npm_incremental_mismatch_total`: incremental compiles that differed from the full-compile cross-check.
    pub incremental_mismatch: Counter,
    /// `npm_cni_add_wait_seconds`: how long a CNI ADD waited until its endpoint was programmed.
    pub cni_add_wait: Histogram,
    /// `npm_cni_chained`: 1 while the runtime's conflist holds npm-cni's entry.
    pub cni_chained: Gauge,
    /// `npm_cni_rechained_total`: npm-cni's entry found missing and put back.
    pub cni_rechained: Counter,
    /// `npm_cni_endpoints_without_add_total`: local endpoints that appeared with no CNI ADD while chaining is expected.
    pub cni_endpoints_without_add: Counter,
    /// `npm_interface_conflicts_total`: interfaces found claimed by more than one endpoint (none of them is attached there).
    pub interface_conflicts: Counter,
    /// `npm_held_removals`: 1 while a mass removal is held for a confirming direct read, else 0.
    pub held_removals: Gauge,
    /// `npm_last_sync_success_timestamp_seconds`: Unix time of the last sync that completed without error.
    pub last_sync_success: Gauge,
    /// `npm_ringbuf_events_lost_total`: deny events the datapath could not write because its ring buffer was full.
    pub ringbuf_events_lost: Counter,
    /// `npm_explain_mismatch_total`: explain requests where the kernel's dry run disagreed with the agent.
    pub explain_mismatch: Counter,
    /// `npm_observe_lost_total`: flow records dropped for `/observe` clients that fell behind.
    pub observe_lost: Counter,
    /// What `/explain` needs (set once by `main`; unset: `/explain` answers 503).
    explain: crate::explain::ExplainSlot,
    /// The per-rule and per-endpoint series (rendered after the registry's).
    pub rules: Arc<super::rule_metrics::RuleMetrics>,
}

impl Metrics {
    /// A fresh registry with every metric registered.
    pub fn new() -> Result<Metrics, MetricsError> {
        let latency_buckets = [
            0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
        ];
        let mut builder = PrometheusBuilder::new();
        for metric in [
            "npm_sync_duration_seconds",
            "npm_programming_latency_seconds",
            "npm_cni_add_wait_seconds",
        ] {
            builder = builder
                .set_buckets_for_metric(Matcher::Full(metric.to_string()), &latency_buckets)
                .map_err(|e| MetricsError::Buckets {
                    metric,
                    detail: e.to_string(),
                })?;
        }
        let recorder = Arc::new(builder.build_recorder());
        let handle = recorder.handle();
        let r: &dyn Recorder = recorder.as_ref();
        for s in SERIES {
            match s.kind {
                Kind::Counter => r.describe_counter(s.name.into(), s.unit, s.help.into()),
                Kind::Gauge => r.describe_gauge(s.name.into(), s.unit, s.help.into()),
                Kind::Histogram => r.describe_histogram(s.name.into(), s.unit, s.help.into()),
            }
        }
        let m = metrics::with_local_recorder(r, || Metrics {
            recorder: recorder.clone(),
            handle: handle.clone(),
            sync_duration: metrics::histogram!("npm_sync_duration_seconds"),
            programming_latency: metrics::histogram!("npm_programming_latency_seconds"),
            syncs: metrics::counter!("npm_syncs_total"),
            invalid_policies: metrics::gauge!("npm_invalid_policies"),
            invalid_cluster_policies: metrics::gauge!("npm_invalid_cluster_network_policies"),
            policy_errors: metrics::counter!("npm_policy_errors_total"),
            ip_conflicts: metrics::counter!("npm_ip_conflicts_total"),
            destructive_deferred: metrics::counter!("npm_destructive_actions_deferred_total"),
            deny_events: metrics::counter!("npm_deny_events_total"),
            deny_events_suppressed: metrics::counter!("npm_deny_events_suppressed_total"),
            ready: metrics::gauge!("npm_ready"),
            endpoints_pending: metrics::gauge!("npm_endpoints_pending_interface"),
            deleting_claims_expired: metrics::gauge!("npm_deleting_claims_expired"),
            incremental_mismatch: metrics::counter!("npm_incremental_mismatch_total"),
            cni_add_wait: metrics::histogram!("npm_cni_add_wait_seconds"),
            cni_chained: metrics::gauge!("npm_cni_chained"),
            cni_rechained: metrics::counter!("npm_cni_rechained_total"),
            cni_endpoints_without_add: metrics::counter!("npm_cni_endpoints_without_add_total"),
            interface_conflicts: metrics::counter!("npm_interface_conflicts_total"),
            held_removals: metrics::gauge!("npm_held_removals"),
            last_sync_success: metrics::gauge!("npm_last_sync_success_timestamp_seconds"),
            ringbuf_events_lost: metrics::counter!("npm_ringbuf_events_lost_total"),
            explain_mismatch: metrics::counter!("npm_explain_mismatch_total"),
            observe_lost: metrics::counter!("npm_observe_lost_total"),
            explain: Default::default(),
            rules: Default::default(),
        });
        // Make the labelled families visible from the start.
        for op in [
            PodOperation::Create,
            PodOperation::Update,
            PodOperation::UpdateWithEmptyIp,
            PodOperation::Delete,
        ] {
            m.pod_event(op, 0);
        }
        for family in ["ipv4", "ipv6"] {
            m.bridge_nf_unfiltered(family, 0);
        }
        m.with(|| {
            for result in ["ok", "gone", "error"] {
                metrics::counter!("npm_pod_condition_writes_total", "result" => result).increment(0);
            }
        });
        m.pod_condition_pending(0);
        // The tier series exist from the start (0 until a CNP decides).
        m.with(|| {
            for dir in ["ingress", "egress"] {
                for r in TIER_REASONS {
                    let (tier, action) = tier_of(r).expect("a tier reason");
                    metrics::counter!("npm_tier_packets_total", "direction" => dir, "tier" => tier, "action" => action)
                        .absolute(0);
                    metrics::counter!("npm_tier_bytes_total", "direction" => dir, "tier" => tier, "action" => action)
                        .absolute(0);
                }
            }
        });
        m.with(|| {
            let mut labels = vec![metrics::Label::new("version", env!("CARGO_PKG_VERSION"))];
            labels.extend(option_env!("NPM_GIT_COMMIT").map(|c| metrics::Label::new("git_commit", c)));
            labels.extend(option_env!("NPM_RUSTC_VERSION").map(|c| metrics::Label::new("rustc", c)));
            metrics::gauge!("npm_build_info", labels).set(1.0);
            // 0 until an eBPF dataplane reports the reduced datapath.
            metrics::gauge!("npm_datapath_reduced").set(0.0);
        });
        Ok(m)
    }

    /// The Prometheus text exposition of every metric, the named series
    /// ([`NAMED_FAMILIES`]) included: for callers with credentials that
    /// grant them (see [`super::authz`]) and the loopback debug listener.
    pub fn render(&self) -> String {
        let mut text = self.handle.render();
        text.push_str(&self.rules.render());
        text
    }

    /// The exposition without the families whose labels name pods or
    /// policies ([`NAMED_FAMILIES`]): what `/metrics` answers a scrape
    /// that carries no credentials.
    pub fn render_public(&self) -> String {
        public_text(&self.handle.render())
    }

    /// Configures `/explain` (once; a second call is ignored).
    pub fn set_explain(&self, cfg: crate::explain::ExplainConfig) {
        let _ = self.explain.set(cfg);
    }

    /// The `/explain` configuration, if set.
    pub fn explain_config(&self) -> Option<crate::explain::ExplainConfig> {
        self.explain.get().cloned()
    }

    fn with<T>(&self, f: impl FnOnce() -> T) -> T {
        let r: &dyn Recorder = self.recorder.as_ref();
        metrics::with_local_recorder(r, f)
    }

    /// Count `n` pod events of one kind.
    pub fn pod_event(&self, op: PodOperation, n: u64) {
        self.with(|| metrics::counter!("npm_controller_pod_event_total", "operation" => op.label()).increment(n));
    }

    /// Count a watch event of a resource (`pods`, `namespaces`, `networkpolicies`).
    pub fn watch_event(&self, resource: &'static str, event: &'static str) {
        self.with(|| {
            metrics::counter!("npm_watch_events_total", "resource" => resource, "event" => event).increment(1)
        });
    }

    /// Count an npm-cni request (`npm_cni_requests_total{command,result}`;
    /// result `ok`, `retry` or `error`).
    pub fn cni_request(&self, command: &'static str, result: &'static str) {
        self.with(|| {
            metrics::counter!("npm_cni_requests_total", "command" => command, "result" => result).increment(1)
        });
    }

    /// Count one new connection the audited policy `namespace/policy`
    /// would deny in `direction` (`npm_audit_would_deny_total`).
    pub fn audit_would_deny(&self, namespace: &str, policy: &str, direction: &'static str) {
        let (namespace, policy) = (namespace.to_string(), policy.to_string());
        self.with(|| {
            metrics::counter!("npm_audit_would_deny_total", "namespace" => namespace, "policy" => policy, "direction" => direction)
                .increment(1)
        });
    }

    /// Count an error of a kind (`watch`, `dataplane`, `direct-read`, `interface`, ...).
    pub fn error(&self, kind: &'static str) {
        self.with(|| metrics::counter!("npm_errors_total", "kind" => kind).increment(1));
    }

    /// Set `npm_readiness_failures{check}`: 1 while the readiness check
    /// `check` fails, else 0.
    pub fn readiness_failure(&self, check: &str, failing: bool) {
        let check = check.to_string();
        self.with(|| metrics::gauge!("npm_readiness_failures", "check" => check).set(if failing { 1.0 } else { 0.0 }));
    }

    /// Set `npm_bridge_nf_unfiltered_endpoints{family}` (`ipv4`, `ipv6`).
    pub fn bridge_nf_unfiltered(&self, family: &'static str, n: usize) {
        self.with(|| metrics::gauge!("npm_bridge_nf_unfiltered_endpoints", "family" => family).set(n as f64));
    }

    /// Set the size of one table of the compiled state last synced
    /// (`npm_compiled_entries{table}`: `ipcache`, `cidrs`, `endpoints`,
    /// `policy`). The kernel maps' own fill is [`Metrics::map_fill`].
    pub fn compiled_entries(&self, table: &'static str, n: usize) {
        self.with(|| metrics::gauge!("npm_compiled_entries", "table" => table).set(n as f64));
    }

    /// Publish the kernel maps' fill: `npm_map_entries{map}` and
    /// `npm_map_capacity{map}` for each map (pinned map names, e.g.
    /// `NPM_POLICY`; see `npm_dataplane::ebpf::MapFill`).
    pub fn map_fill(&self, fill: &[MapFill]) {
        self.with(|| {
            for f in fill {
                metrics::gauge!("npm_map_entries", "map" => f.map).set(f.entries as f64);
                metrics::gauge!("npm_map_capacity", "map" => f.map).set(f.capacity as f64);
                if let Some(n) = f.fallbacks {
                    metrics::gauge!("npm_fold_fallbacks").set(n as f64);
                }
            }
        });
    }

    /// The DNS learning: `npm_dns_learned{kind}` set to (names, addresses),
    /// `npm_dns_holding` to `d.holding`, and the counters moved by what
    /// `d` counted since the last call.
    pub fn dns_learning(&self, (names, addrs): (usize, usize), d: &DnsCounts) {
        self.with(|| {
            metrics::gauge!("npm_dns_learned", "kind" => "names").set(names as f64);
            metrics::gauge!("npm_dns_learned", "kind" => "addresses").set(addrs as f64);
            metrics::gauge!("npm_dns_holding").set(d.holding as f64);
            metrics::gauge!("npm_dns_notrack").set(if d.notrack { 1.0 } else { 0.0 });
            for (result, n) in DNS_RESULTS.into_iter().zip(d.responses) {
                metrics::counter!("npm_dns_responses_total", "result" => result).increment(n);
            }
            metrics::counter!("npm_dns_evicted_total").increment(d.evicted);
            metrics::counter!("npm_dns_rules_reasserted_total").increment(d.rules_reasserted);
        });
    }

    /// Set `npm_datapath_reduced` (see its help text).
    pub fn datapath_reduced(&self, reduced: bool) {
        self.with(|| metrics::gauge!("npm_datapath_reduced").set(if reduced { 1.0 } else { 0.0 }));
    }

    /// Count one patch of a pod's npm conditions (`npm_pod_condition_writes_total{result}`).
    pub fn pod_condition_write(&self, result: &'static str) {
        self.with(|| metrics::counter!("npm_pod_condition_writes_total", "result" => result).increment(1));
    }

    /// Set `npm_pod_condition_pending`.
    pub fn pod_condition_pending(&self, n: usize) {
        self.with(|| metrics::gauge!("npm_pod_condition_pending").set(n as f64));
    }

    /// Set `npm_map_full{map}`: 1 while the compiled state does not fit
    /// `map` (degraded mode), else 0.
    pub fn map_full(&self, map: &'static str, full: bool) {
        self.with(|| metrics::gauge!("npm_map_full", "map" => map).set(if full { 1.0 } else { 0.0 }));
    }

    /// Publish the datapath's count of deny events lost to a full ring
    /// buffer (`npm_ringbuf_events_lost_total`, the kernel's running total).
    pub fn ringbuf_events_lost(&self, total: u64) {
        self.ringbuf_events_lost.absolute(total);
    }

    /// Publish the dataplane's packet counters as
    /// `npm_packets_total{direction,reason,verdict}` and `npm_bytes_total{...}`,
    /// and those of the tier reasons also as
    /// `npm_tier_packets_total{direction,tier,action}` and
    /// `npm_tier_bytes_total{...}`.
    pub fn dataplane_counters(&self, counters: &Counters) {
        self.with(|| {
            for (&(dir, reason), &(packets, bytes)) in &counters.by_reason {
                let direction = if dir == npm_common::DIR_INGRESS { "ingress" } else { "egress" };
                let known = Reason::from_u8(reason);
                if let Some((tier, action)) = known.and_then(tier_of) {
                    metrics::counter!("npm_tier_packets_total", "direction" => direction, "tier" => tier, "action" => action)
                        .absolute(packets);
                    metrics::counter!("npm_tier_bytes_total", "direction" => direction, "tier" => tier, "action" => action)
                        .absolute(bytes);
                }
                let (reason, verdict) = match known {
                    Some(r) => (r.name(), r.verdict()),
                    None => ("unknown", "unknown"),
                };
                metrics::counter!("npm_packets_total", "direction" => direction, "reason" => reason, "verdict" => verdict)
                    .absolute(packets);
                metrics::counter!("npm_bytes_total", "direction" => direction, "reason" => reason, "verdict" => verdict)
                    .absolute(bytes);
            }
        });
    }
}

/// Read one sample value from a Prometheus text exposition: the line whose
/// series (name and labels, exactly as rendered) is `series`.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

/// The readiness check of the DNS learning.
pub const CHECK_DNS_LEARNING: &str = "dns-learning";

/// The `result` labels of `npm_dns_responses_total`, in the order of
/// [`DnsCounts::responses`].
pub const DNS_RESULTS: [&str; 9] = [
    "read",
    "learned",
    "unparsable",
    "hold_expired",
    "held",
    "released",
    "not_held_not_compiled",
    "not_held_sync_unhealthy",
    "not_held_cap",
];

/// What the DNS capture counted (since the last report, for counters).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DnsCounts {
    /// `npm_dns_responses_total` by [`DNS_RESULTS`].
    pub responses: [u64; 9],
    /// `npm_dns_evicted_total`.
    pub evicted: u64,
    /// `npm_dns_rules_reasserted_total`.
    pub rules_reasserted: u64,
    /// `npm_dns_holding` (a gauge: the value now).
    pub holding: u64,
    /// `npm_dns_notrack` (a gauge: now).
    pub notrack: bool,
}

impl DnsCounts {
    /// The totals of `capture` now.
    fn of(capture: &crate::dns::Capture) -> Self {
        use std::sync::atomic::Ordering::Relaxed;
        let s = &capture.stats;
        Self {
            responses: [
                &s.responses,
                &s.learning,
                &s.unparsable,
                &s.hold_expired,
                &s.held,
                &s.released,
                &s.not_held_not_compiled,
                &s.not_held_sync_unhealthy,
                &s.not_held_cap,
            ]
            .map(|c| c.load(Relaxed)),
            evicted: capture.evicted(),
            rules_reasserted: s.rules_reasserted.load(Relaxed),
            holding: s.holding.load(Relaxed),
            notrack: capture.notrack().is_some(),
        }
    }

    /// What moved from `last` to `self` (`holding` as it is now).
    fn since(&self, last: &Self) -> Self {
        Self {
            responses: std::array::from_fn(|i| self.responses[i].saturating_sub(last.responses[i])),
            evicted: self.evicted.saturating_sub(last.evicted),
            rules_reasserted: self.rules_reasserted.saturating_sub(last.rules_reasserted),
            holding: self.holding,
            notrack: self.notrack,
        }
    }
}

/// Every 5 s, reports what the DNS capture learned and read
/// (`npm_dns_learned{kind}`, `npm_dns_responses_total{result}`,
/// `npm_dns_holding`, `npm_dns_rules_reasserted_total`, `npm_dns_notrack`)
/// and the readiness check `dns-learning` (failing while DNS is exempted
/// from conntrack); owns the capture, which stops (its rules removed) when
/// this task is aborted.
pub async fn report_dns(
    capture: crate::dns::Capture,
    metrics: Metrics,
    health: std::sync::Arc<crate::telemetry::health::Health>,
) {
    let mut last = DnsCounts::default();
    let mut tick = tokio::time::interval(std::time::Duration::from_secs(5));
    loop {
        tick.tick().await;
        let now = DnsCounts::of(&capture);
        metrics.dns_learning(capture.learned(), &now.since(&last));
        health.set_problem(CHECK_DNS_LEARNING, capture.notrack());
        last = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn public_text_has_no_names() {
        let m = Metrics::new().unwrap();
        m.audit_would_deny("team-a", "secret-policy", "ingress");
        m.ip_conflicts.increment(1);
        let full = m.render();
        assert!(full.contains("secret-policy"), "{full}");
        assert!(full.contains("# TYPE npm_rule_allowed_packets_total counter"), "{full}");
        let public = m.render_public();
        for f in NAMED_FAMILIES {
            assert!(!public.contains(f), "{f} in {public}");
        }
        assert!(
            !public.contains("secret-policy") && !public.contains("team-a"),
            "{public}"
        );
        assert!(public.contains("npm_ip_conflicts_total 1"), "{public}");
        assert!(public.contains("# TYPE npm_ready gauge"), "{public}");
    }

    #[test]
    fn counters_and_labels_render() {
        let m = Metrics::new().unwrap();
        m.pod_event(PodOperation::UpdateWithEmptyIp, 2);
        m.ip_conflicts.increment(1);
        m.programming_latency.record(0.02);
        let mut c = Counters::default();
        c.by_reason
            .insert((npm_common::DIR_EGRESS, Reason::PolicyDenied as u8), (7, 700));
        c.by_reason
            .insert((npm_common::DIR_INGRESS, Reason::AdminDeny as u8), (3, 180));
        m.dataplane_counters(&c);
        let text = m.render();
        assert_eq!(
            sample(
                &text,
                "npm_tier_packets_total{direction=\"ingress\",tier=\"admin\",action=\"deny\"}"
            ),
            Some(3.0)
        );
        assert_eq!(
            sample(
                &text,
                "npm_tier_bytes_total{direction=\"ingress\",tier=\"admin\",action=\"deny\"}"
            ),
            Some(180.0)
        );
        assert_eq!(
            sample(
                &text,
                "npm_packets_total{direction=\"ingress\",reason=\"admin-deny\",verdict=\"denied\"}"
            ),
            Some(3.0)
        );
        assert_eq!(
            sample(
                &text,
                "npm_tier_packets_total{direction=\"egress\",tier=\"baseline\",action=\"accept\"}"
            ),
            Some(0.0),
            "the tier series exist before any CNP decides"
        );
        assert_eq!(
            sample(
                &text,
                "npm_controller_pod_event_total{operation=\"update-with-empty-ip\"}"
            ),
            Some(2.0)
        );
        assert_eq!(
            sample(&text, "npm_controller_pod_event_total{operation=\"create\"}"),
            Some(0.0)
        );
        assert_eq!(sample(&text, "npm_ip_conflicts_total"), Some(1.0));
        assert_eq!(
            sample(
                &text,
                "npm_packets_total{direction=\"egress\",reason=\"policy-denied\",verdict=\"denied\"}"
            ),
            Some(7.0)
        );
        assert_eq!(sample(&text, "npm_programming_latency_seconds_count"), Some(1.0));
        assert_eq!(sample(&text, "npm_ringbuf_events_lost_total"), Some(0.0));
        m.map_fill(&[
            MapFill {
                map: "NPM_POLICY",
                entries: 3,
                capacity: 1 << 20,
                fallbacks: None,
            },
            MapFill {
                map: "NPM_FOLD",
                entries: 9,
                capacity: 1 << 18,
                fallbacks: Some(2),
            },
        ]);
        m.ringbuf_events_lost(12);
        let text = m.render();
        assert_eq!(sample(&text, "npm_map_entries{map=\"NPM_POLICY\"}"), Some(3.0));
        assert_eq!(sample(&text, "npm_map_capacity{map=\"NPM_POLICY\"}"), Some(1048576.0));
        assert_eq!(sample(&text, "npm_fold_fallbacks"), Some(2.0));
        assert_eq!(sample(&text, "npm_ringbuf_events_lost_total"), Some(12.0));
        // Two registries do not share values.
        let other = Metrics::new().unwrap();
        assert_eq!(sample(&other.render(), "npm_ip_conflicts_total"), Some(0.0));
    }

    /// Every family the registry renders, once each labelled family has a
    /// value, is in [`SERIES`] with its type and HELP text, and every entry
    /// of [`SERIES`] is rendered: the list cannot drift from the code.
    #[test]
    fn every_series_is_described_and_listed() {
        let m = Metrics::new().unwrap();
        m.watch_event("pods", "apply");
        m.audit_would_deny("ns", "audited", "ingress");
        m.cni_request("add", "ok");
        m.error("watch");
        m.readiness_failure("lists", true);
        m.compiled_entries("ipcache", 1);
        m.map_full("NPM_POLICY", false);
        m.dns_learning(
            (1, 2),
            &DnsCounts {
                responses: [3, 1, 0, 0, 0, 0, 0, 0, 0],
                ..DnsCounts::default()
            },
        );
        m.map_fill(&[MapFill {
            map: "NPM_POLICY_FRONT",
            entries: 0,
            capacity: 1,
            fallbacks: Some(0),
        }]);
        let mut c = Counters::default();
        c.by_reason
            .insert((npm_common::DIR_INGRESS, Reason::PolicyDenied as u8), (1, 60));
        m.dataplane_counters(&c);
        for h in [&m.sync_duration, &m.programming_latency, &m.cni_add_wait] {
            h.record(0.1);
        }
        let text = m.render();
        let mut rendered = std::collections::BTreeSet::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, kind) = rest.split_once(' ').unwrap();
                let s = SERIES
                    .iter()
                    .find(|s| s.name == name)
                    .unwrap_or_else(|| panic!("{name} is not in SERIES"));
                let want = match s.kind {
                    Kind::Counter => "counter",
                    Kind::Gauge => "gauge",
                    Kind::Histogram => "histogram",
                };
                assert_eq!(kind, want, "{name}");
                assert!(
                    text.contains(&format!("# HELP {name} {}", s.help)),
                    "{name} has no HELP:\n{text}"
                );
                rendered.insert(name.to_string());
            }
        }
        for s in SERIES {
            assert!(
                rendered.contains(s.name),
                "{} is listed but not rendered:\n{text}",
                s.name
            );
            match s.kind {
                Kind::Counter => assert!(s.name.ends_with("_total"), "{}", s.name),
                _ => assert!(!s.name.ends_with("_total"), "{}", s.name),
            }
            if s.unit == Some(Unit::Seconds) {
                assert!(s.name.ends_with("_seconds"), "{}", s.name);
            }
        }
        let version = format!("npm_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"));
        let line = text.lines().find(|l| l.starts_with(&version)).expect("npm_build_info");
        assert!(line.ends_with(" 1"), "{line}");
    }
}
