//! The catalogue of series: every family the agent exports, with its type,
//! unit, labels and HELP text ([`SERIES`]), the tier labels of the datapath's
//! reasons, and the families whose labels name pods or policies.

use metrics::Unit;
use npm_common::Reason;

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
    series("npm_attach_mode", G, None, &["mode"], "1 for the attach mode the eBPF datapath's programs run in on this node: tcx or tc (what --attach auto chose: tcx links where the kernel has them and no tc filters of npm are in place, else tc clsact filters); absent with nftables."),
    series("npm_host_in_mode", G, None, &["mode"], "1 for what the INPUT chain's rule does with a Service packet deferred to a backend on this node's host network: decided (host_in, the xt_bpf match, decides it as egress to the host) or drop-all (the xt_bpf match was refused: every such packet is dropped, fail closed; the error is logged). eBPF dataplane only, once the Services writer is up."),
    series("npm_datapath_reduced", G, None, &[], "1 when the kernel's verifier refused the full eBPF datapath as too large and the reduced one runs (every decision by the policy LPMs, no precomputed layers: the same verdicts at a higher cost per packet), else 0 (eBPF dataplane only)."),
    series("npm_pod_condition_writes_total", C, N, &["result"], "Patches of local pods' npm.io/PolicyEnforced and npm.io/PolicyDegraded conditions (pods/status), by result (ok; gone: the pod was deleted or replaced; error: retried)."),
    series("npm_pod_condition_pending", G, N, &[], "Local pods whose npm conditions wait for a patch (the writer's rate limit: --pod-condition-qps, --pod-condition-burst)."),
    series("npm_map_full", G, N, &["map"], "1 while the compiled state does not fit this kernel map (eBPF dataplane) and a reduced, fail-closed state is programmed (degraded mode), else 0."),
    series("npm_packets_total", C, N, &["direction", "reason", "verdict"], "Packets classified by the datapath, by direction, reason and verdict."),
    series("npm_bytes_total", C, B, &["direction", "reason", "verdict"], "Bytes of the packets classified by the datapath, by direction, reason and verdict."),
    series("npm_tier_packets_total", C, N, &["direction", "tier", "action"], "New connections decided by a ClusterNetworkPolicy tier (admin, baseline), by direction and action (accept, deny); the datapath counters of the reasons admin-accept, admin-deny, baseline-accept and baseline-deny."),
    series("npm_connections_cut_total", C, N, &["namespace", "direction"], "Established connections cut after a policy change under connection semantics enforce (--established, annotation npm.io/established on the Namespace): the new policy of the pod's direction denies them, their conntrack entry is removed and their next packet dropped; by the pod's namespace and that direction. One per connection (eBPF: from its deny event, which the datapath's event budget may drop under a flood; nftables: one per conntrack entry deleted)."),
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
pub(super) const TIER_REASONS: [Reason; 4] = [
    Reason::AdminAccept,
    Reason::AdminDeny,
    Reason::BaselineAccept,
    Reason::BaselineDeny,
];

/// The families whose labels name pods or policies (namespace, policy or
/// pod labels): served only with credentials that grant `get` on the
/// non-resource URL `/metrics`, or on the loopback debug listener.
pub const NAMED_FAMILIES: [&str; 6] = [
    "npm_connections_cut_total",
    "npm_audit_would_deny_total",
    "npm_rule_allowed_packets_total",
    "npm_rule_allowed_bytes_total",
    "npm_endpoint_denied_packets_total",
    "npm_endpoint_denied_bytes_total",
];

/// `text` (a Prometheus text exposition) without the samples, `# HELP`
/// and `# TYPE` lines of the [`NAMED_FAMILIES`].
pub(super) fn public_text(text: &str) -> String {
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
