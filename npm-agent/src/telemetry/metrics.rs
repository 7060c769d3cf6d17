//! The agent's Prometheus metrics.
//!
//! A [`Metrics`] owns its own [`PrometheusRecorder`] (no global recorder):
//! `main` builds one and passes it to the watchers, the sync loop and the
//! HTTP server, and tests build their own and read [`Metrics::render`].

use std::sync::Arc;

use metrics::{Counter, Gauge, Histogram, Recorder};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle, PrometheusRecorder};
use npm_common::Reason;
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
    /// `npm_incremental_mismatch_total`: incremental compiles that differed from the full-compile cross-check.
    pub incremental_mismatch: Counter,
    /// `npm_cni_add_wait_seconds`: how long a CNI ADD waited until its endpoint was programmed.
    pub cni_add_wait: Histogram,
    /// `npm_interface_conflicts_total`: interfaces found claimed by more than one endpoint (none of them is attached there).
    pub interface_conflicts: Counter,
    /// `npm_held_removals`: 1 while a mass removal is held for a confirming direct read, else 0.
    pub held_removals: Gauge,
    /// `npm_last_sync_success_timestamp_seconds`: Unix time of the last sync that completed without error.
    pub last_sync_success: Gauge,
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
        let m = metrics::with_local_recorder(r, || Metrics {
            recorder: recorder.clone(),
            handle: handle.clone(),
            sync_duration: metrics::histogram!("npm_sync_duration_seconds"),
            programming_latency: metrics::histogram!("npm_programming_latency_seconds"),
            syncs: metrics::counter!("npm_syncs_total"),
            invalid_policies: metrics::gauge!("npm_invalid_policies"),
            policy_errors: metrics::counter!("npm_policy_errors_total"),
            ip_conflicts: metrics::counter!("npm_ip_conflicts_total"),
            destructive_deferred: metrics::counter!("npm_destructive_actions_deferred_total"),
            deny_events: metrics::counter!("npm_deny_events_total"),
            deny_events_suppressed: metrics::counter!("npm_deny_events_suppressed_total"),
            ready: metrics::gauge!("npm_ready"),
            endpoints_pending: metrics::gauge!("npm_endpoints_pending_interface"),
            incremental_mismatch: metrics::counter!("npm_incremental_mismatch_total"),
            cni_add_wait: metrics::histogram!("npm_cni_add_wait_seconds"),
            interface_conflicts: metrics::counter!("npm_interface_conflicts_total"),
            held_removals: metrics::gauge!("npm_held_removals"),
            last_sync_success: metrics::gauge!("npm_last_sync_success_timestamp_seconds"),
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
        Ok(m)
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        self.handle.render()
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

    /// Set a map occupancy gauge (`npm_map_entries{map}`).
    pub fn map_entries(&self, map: &'static str, n: usize) {
        self.with(|| metrics::gauge!("npm_map_entries", "map" => map).set(n as f64));
    }

    /// Publish the dataplane's packet counters as
    /// `npm_packets_total{direction,reason,verdict}` and `npm_bytes_total{...}`.
    pub fn dataplane_counters(&self, counters: &Counters) {
        self.with(|| {
            for (&(dir, reason), &(packets, bytes)) in &counters.by_reason {
                let direction = if dir == npm_common::DIR_INGRESS { "ingress" } else { "egress" };
                let (reason, verdict) = match Reason::from_u8(reason) {
                    Some(r) => (r.name(), if r.is_deny() { "denied" } else { "allowed" }),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counters_and_labels_render() {
        let m = Metrics::new().unwrap();
        m.pod_event(PodOperation::UpdateWithEmptyIp, 2);
        m.ip_conflicts.increment(1);
        m.programming_latency.record(0.02);
        let mut c = Counters::default();
        c.by_reason
            .insert((npm_common::DIR_EGRESS, Reason::PolicyDenied as u8), (7, 700));
        m.dataplane_counters(&c);
        let text = m.render();
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
        // Two registries do not share values.
        let other = Metrics::new().unwrap();
        assert_eq!(sample(&other.render(), "npm_ip_conflicts_total"), Some(0.0));
    }
}
