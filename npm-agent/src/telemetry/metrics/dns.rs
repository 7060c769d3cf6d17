//! What the DNS learning reports: the counts of its capture, turned into
//! series every 5 s, and its readiness check.

use super::Metrics;

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
