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
//!
//! The catalogue of series is in [`series`], the DNS learning's reports in
//! [`dns`].

pub mod dns;
pub mod series;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use npm_common::Reason;
use npm_dataplane::ebpf::MapFill;
use npm_dataplane::Counters;

pub use dns::{report_dns, DnsCounts, CHECK_DNS_LEARNING, DNS_RESULTS};
use series::{public_text, TIER_REASONS};
pub use series::{tier_of, Kind, Series, NAMED_FAMILIES, SERIES};

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

    /// Count one established connection cut under connection semantics
    /// `enforce` (`npm_connections_cut_total`): `namespace` of the pod
    /// whose `direction` now denies it.
    pub fn connection_cut(&self, namespace: &str, direction: &'static str) {
        let namespace = namespace.to_string();
        self.with(|| {
            metrics::counter!("npm_connections_cut_total", "namespace" => namespace, "direction" => direction)
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

    /// Set `npm_attach_mode{mode}` (see its help text).
    pub fn attach_mode(&self, mode: &'static str) {
        self.with(|| metrics::gauge!("npm_attach_mode", "mode" => mode).set(1.0));
    }

    /// Set `npm_host_in_mode{mode}` (see its help text): `mode` 1, the
    /// other 0.
    pub fn host_in_mode(&self, drop_all: bool) {
        self.with(|| {
            let (on, off) = if drop_all {
                ("drop-all", "decided")
            } else {
                ("decided", "drop-all")
            };
            metrics::gauge!("npm_host_in_mode", "mode" => on).set(1.0);
            metrics::gauge!("npm_host_in_mode", "mode" => off).set(0.0);
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
