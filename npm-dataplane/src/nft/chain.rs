//! The rules of the endpoint chains of the `inet` table: the NetworkPolicy
//! chain `ep_<id>_<in|out>` of each endpoint and direction, and the
//! ClusterNetworkPolicy tier chains `ep_<id>_<in|out>_admin` and
//! `ep_<id>_<in|out>_baseline` it jumps to (see the module documentation
//! of [`super`] for the order of the steps).
//!
//! A tier chain holds the [`TierEntry`]s of one endpoint, direction and
//! tier as rules sorted by [`TierValue::rank`], so the first rule a packet
//! matches is the lowest-ranked entry among those holding it, whatever its
//! peer identity (pod or node, CIDR, [`IDENTITY_ANY`]): the tier's decision
//! of the datapath's lookup (the compiler folds every less specific rule
//! into the more specific entries of the same identity, so an entry is
//! never shadowed by a lower-ranked, less specific one it does not carry).
//! `Accept` ends the packet's evaluation of the hook with `accept`,
//! `Deny` drops it (silently: no RST, no ICMP), `Pass` `return`s to the
//! endpoint chain, which goes on with the next step; a packet no rule
//! matches returns at the end of the chain (the tier does not decide).

use std::collections::BTreeMap;

use npm_common::{Reason, IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD};
use npm_policy::compiled::{Direction, Endpoint, PolicyEntry, Tier, TierAction, TierEntry, TierValue};
use npm_policy::model::Protocol;

use super::nflog::{allow_log_rule, deny_log_rule};
use super::ranges::Family;
use super::render::{chain_name, counter_name, set_name, PeerSet, ICMPV6_CONTROL};

/// The reasons the tier chains of either direction count, each with a named
/// counter (`in_admin_accept`, ...). Declared only in tables that have (or
/// had) tier chains, so a table without ClusterNetworkPolicies is exactly as
/// before.
pub(crate) const TIER_REASONS: [Reason; 4] = [
    Reason::AdminAccept,
    Reason::AdminDeny,
    Reason::BaselineAccept,
    Reason::BaselineDeny,
];

/// Which source address an ingress chain decides on.
///
/// A connection source-NATed on this node (`ct status snat`: kube-proxy's
/// masquerade of a NodePort or LoadBalancer connection with
/// `externalTrafficPolicy: Cluster`, of a hairpin, `--masquerade-all`)
/// reaches the pod from a node address; its ingress is decided on the
/// source it had before the NAT, conntrack's original tuple, in the copy
/// `ep_<id>_in_nat` of the chain (and `ep_<id>_in_nat_admin`,
/// `_nat_baseline` of its tier chains). Everything else, untracked packets
/// included (they have no original tuple), is decided on the packet's own
/// source, which for a tracked packet not source-NATed is the original one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Source {
    /// `ip saddr` / `ip6 saddr` (egress: the destination, always).
    Packet,
    /// `ct original ip saddr` / `ct original ip6 saddr` (ingress only).
    Original,
}

impl Source {
    /// The (IPv4, IPv6) selectors of the peer of `direction`.
    const fn selectors(self, direction: Direction) -> (&'static str, &'static str) {
        match (direction, self) {
            (Direction::Egress, _) => ("ip daddr", "ip6 daddr"),
            (Direction::Ingress, Source::Packet) => ("ip saddr", "ip6 saddr"),
            (Direction::Ingress, Source::Original) => ("ct original ip saddr", "ct original ip6 saddr"),
        }
    }
}

/// Name of the tier chain of an endpoint, a direction and a tier, e.g.
/// `ep_7_in_admin`.
pub fn tier_chain_name(endpoint: u32, direction: Direction, tier: Tier) -> String {
    tier_chain_name_from(endpoint, direction, tier, Source::Packet)
}

/// [`tier_chain_name`] of the chains deciding on `source`: the original
/// source's are `ep_<id>_in_nat_admin` and `ep_<id>_in_nat_baseline`.
pub(crate) fn tier_chain_name_from(endpoint: u32, direction: Direction, tier: Tier, source: Source) -> String {
    let t = match tier {
        Tier::Admin => "admin",
        Tier::Baseline => "baseline",
    };
    format!("{}_{t}", chain_name_from(endpoint, direction, source))
}

/// The endpoint chain deciding on `source`: [`chain_name`], or
/// `ep_<id>_in_nat` for the original source.
pub(crate) fn chain_name_from(endpoint: u32, direction: Direction, source: Source) -> String {
    match source {
        Source::Packet => chain_name(endpoint, direction),
        Source::Original => format!("{}_nat", chain_name(endpoint, direction)),
    }
}

/// The tier entries of one (subject, direction, tier), sorted by rank.
pub(crate) type TierRules<'a> = BTreeMap<(u32, Direction, Tier), Vec<(&'a TierEntry, &'a TierValue)>>;

/// Groups `tiers` by (subject, direction, tier), each group sorted by
/// rank (then by entry, so the order is deterministic).
pub(crate) fn group_tiers(tiers: &BTreeMap<TierEntry, TierValue>) -> TierRules<'_> {
    let mut out: TierRules<'_> = BTreeMap::new();
    for (entry, value) in tiers {
        out.entry((entry.subject, entry.direction, entry.tier))
            .or_default()
            .push((entry, value));
    }
    for list in out.values_mut() {
        list.sort_by_key(|(e, v)| (v.rank, **e));
    }
    out
}

/// The (reason, verdict) of a deciding tier action; `None` for `Pass`.
const fn decision(tier: Tier, action: TierAction) -> Option<(Reason, &'static str)> {
    match (tier, action) {
        (Tier::Admin, TierAction::Accept) => Some((Reason::AdminAccept, "accept")),
        (Tier::Admin, TierAction::Deny) => Some((Reason::AdminDeny, "drop")),
        (Tier::Baseline, TierAction::Accept) => Some((Reason::BaselineAccept, "accept")),
        (Tier::Baseline, TierAction::Deny) => Some((Reason::BaselineDeny, "drop")),
        (_, TierAction::Pass) => None,
    }
}

/// The rules of a tier chain: one per entry and family in rank order
/// (entries with an empty port range and peers without addresses are left
/// out: they match nothing).
///
/// A `Deny` rule is preceded by its NFLOG rule (same match), an `Accept`
/// rule too when the endpoint (`id`) has `report_new` (`super::nflog`).
pub(crate) fn tier_rules(
    id: u32,
    report_new: bool,
    direction: Direction,
    tier: Tier,
    entries: &[(&TierEntry, &TierValue)],
    sets: &BTreeMap<u32, PeerSet>,
    source: Source,
) -> Vec<String> {
    let mut out = Vec::new();
    let d = direction.as_u8();
    for (entry, value) in entries {
        let Some(l4) = l4_match(entry.protocol, entry.ports) else {
            continue;
        };
        let log = match decision(tier, value.action) {
            Some((reason, "drop")) => Some(deny_log_rule(&l4, id, d, reason)),
            Some((reason, _)) => allow_log_rule(&l4, report_new, id, d, reason),
            None => None,
        };
        if let Some(log) = log {
            peer_rules(&mut out, direction, entry.peer, &format!(" {log}"), sets, source);
        }
        let rule = value.rule;
        let tail = match decision(tier, value.action) {
            Some((reason, verdict)) => format!(
                "{l4} counter name \"{}\" {verdict} comment \"rule {rule}\"",
                counter_name(direction.as_u8(), reason)
            ),
            None => format!("{l4} return comment \"rule {rule} pass\""),
        };
        peer_rules(&mut out, direction, entry.peer, &tail, sets, source);
    }
    out
}

/// The L4 part of a policy or tier rule: protocol and destination ports
/// (nothing for `protocol: None`, which matches every protocol, ICMP
/// included), or `None` when the entry can match nothing (an empty port
/// range).
fn l4_match(protocol: Option<Protocol>, ports: (u16, u16)) -> Option<String> {
    let Some(proto) = protocol else {
        return Some(String::new());
    };
    let name = match proto {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    };
    let (lo, hi) = ports;
    if lo > hi {
        return None;
    }
    if lo == 0 && hi == u16::MAX {
        Some(format!(" meta l4proto {name}"))
    } else if lo == hi {
        Some(format!(" meta l4proto {name} th dport {lo}"))
    } else {
        Some(format!(" meta l4proto {name} th dport {lo}-{hi}"))
    }
}

/// Which tier chains an endpoint chain jumps to (their names), for one
/// direction.
#[derive(Clone, Debug, Default)]
pub(crate) struct TierJumps {
    /// The Admin chain, when the endpoint has Admin entries.
    pub(crate) admin: Option<String>,
    /// The Baseline chain, when the endpoint has Baseline entries.
    pub(crate) baseline: Option<String>,
}

/// The rules of one endpoint's chain for one direction.
///
/// Without tier chains this is the NetworkPolicy chain as it always was
/// (not isolated: `not_isolated` right after conntrack). With tier chains:
/// host ingress first (before every tier), then `jump` to the Admin chain,
/// then NetworkPolicy when it isolates the endpoint, else `jump` to the
/// Baseline chain and `not_isolated`. An ingress chain that decides
/// (isolated or tiered) sends a connection source-NATed on this node to its
/// original-source copy first ([`Source`], [`original_source_rules`]).
///
/// Every drop is preceded by its NFLOG rule (same match, rate-limited), and
/// every allow of an endpoint with `report_new` too (`ct state new` only):
/// `super::nflog`. `id` is the endpoint's id (the log prefix); `entries`
/// are the policy entries of its subject (`ep.identity`) in `direction`.
pub(crate) fn endpoint_rules(
    id: u32,
    ep: &Endpoint,
    direction: Direction,
    entries: &[(&PolicyEntry, u32)],
    tiers: &TierJumps,
    sets: &BTreeMap<u32, PeerSet>,
) -> Vec<String> {
    let d = direction.as_u8();
    let c = |r: Reason| counter_name(d, r);
    let mut out = vec![format!(
        "icmpv6 type {ICMPV6_CONTROL} counter name \"{}\" return",
        c(Reason::Icmpv6Control)
    )];
    if direction == Direction::Egress {
        // Source validation: only the endpoint's own addresses may leave it.
        let spoofed = c(Reason::Spoofed);
        let v4 = match ep.ipv4 {
            Some(a) => format!("ip saddr != {a}"),
            None => "meta nfproto ipv4".to_string(),
        };
        let v6 = match ep.ipv6 {
            Some(a) => format!("ip6 saddr != {a}"),
            None => "meta nfproto ipv6".to_string(),
        };
        // Not logged: a logging rule here would cost every egress packet,
        // tracked ones included, one more rule (the drops logged all come
        // after the conntrack step).
        for m in [v4, v6] {
            out.push(format!("{m} counter name \"{spoofed}\" drop"));
        }
    }
    out.push(format!(
        "ct state established,related counter name \"{}\" return",
        c(Reason::Tracked)
    ));
    out.push(deny_log_rule("ct state invalid", id, d, Reason::Malformed));
    out.push(format!(
        "ct state invalid counter name \"{}\" drop",
        c(Reason::Malformed)
    ));
    if decides_original_source(ep, direction, tiers) {
        // Source-NATed on this node: decided on the original source
        // (`Source`), host admission included. Untracked packets do not
        // match `ct status` and stay here.
        out.push(format!(
            "ct status snat goto {}",
            chain_name_from(id, direction, Source::Original)
        ));
    }
    decision_rules(&mut out, id, ep, direction, entries, tiers, sets, Source::Packet);
    out
}

/// Whether the endpoint's chain of `direction` has an original-source copy
/// ([`original_source_rules`]): ingress that policy or a tier decides.
pub(crate) fn decides_original_source(ep: &Endpoint, direction: Direction, tiers: &TierJumps) -> bool {
    direction == Direction::Ingress && (ep.isolated_ingress || tiers.admin.is_some() || tiers.baseline.is_some())
}

/// The rules of `ep_<id>_in_nat`: the ingress decision of
/// [`endpoint_rules`] on the original source of a connection source-NATed
/// on this node (see [`Source`]); `tiers` names the `_nat` tier chains.
/// A packet reaches it by `goto` from `ep_<id>_in`, past its conntrack
/// steps (so only `ct state new` packets). Only a connection that began
/// at a host address (the host set, or loopback: a node process reaching a
/// NodePort on `localhost`) is admitted as the host.
pub(crate) fn original_source_rules(
    id: u32,
    ep: &Endpoint,
    entries: &[(&PolicyEntry, u32)],
    tiers: &TierJumps,
    sets: &BTreeMap<u32, PeerSet>,
) -> Vec<String> {
    let mut out = Vec::new();
    decision_rules(
        &mut out,
        id,
        ep,
        Direction::Ingress,
        entries,
        tiers,
        sets,
        Source::Original,
    );
    out
}

/// The decision steps of an endpoint chain after conntrack: host ingress,
/// the tiers, NetworkPolicy, the final drop; peers matched on `source`.
#[allow(clippy::too_many_arguments)]
fn decision_rules(
    out: &mut Vec<String>,
    id: u32,
    ep: &Endpoint,
    direction: Direction,
    entries: &[(&PolicyEntry, u32)],
    tiers: &TierJumps,
    sets: &BTreeMap<u32, PeerSet>,
    source: Source,
) {
    let d = direction.as_u8();
    let c = |r: Reason| counter_name(d, r);
    let allow_log = |m: &str, r: Reason| allow_log_rule(m, ep.report_new, id, d, r);
    let isolated = match direction {
        Direction::Ingress => ep.isolated_ingress,
        Direction::Egress => ep.isolated_egress,
    };
    let tiered = tiers.admin.is_some() || tiers.baseline.is_some();
    if !isolated && !tiered {
        out.extend(allow_log("", Reason::NotIsolated));
        out.push(format!("counter name \"{}\" return", c(Reason::NotIsolated)));
        return;
    }
    if direction == Direction::Ingress {
        // From this node (kubelet probes): allowed before every tier.
        let (v4, v6) = source.selectors(direction);
        let mut host_matches = Vec::new();
        if let Some(host) = sets.get(&IDENTITY_HOST) {
            for (family, sel) in [(Family::V4, v4), (Family::V6, v6)] {
                if !host.elements(family).is_empty() {
                    host_matches.push(format!("{sel} @{}", set_name(IDENTITY_HOST, family)));
                }
            }
        }
        if source == Source::Original {
            // A node process's connection to a NodePort on `localhost`
            // (`route_localnet`) begins at a loopback address.
            host_matches.push(format!("{v4} 127.0.0.0/8"));
            host_matches.push(format!("{v6} ::1"));
        }
        for m in host_matches {
            out.extend(allow_log(&m, Reason::Host));
            out.push(format!("{m} counter name \"{}\" return", c(Reason::Host)));
        }
    }
    if let Some(admin) = &tiers.admin {
        out.push(format!("jump {admin}"));
    }
    if !isolated {
        if let Some(baseline) = &tiers.baseline {
            out.push(format!("jump {baseline}"));
        }
        out.extend(allow_log("", Reason::NotIsolated));
        out.push(format!("counter name \"{}\" return", c(Reason::NotIsolated)));
        return;
    }
    for (entry, rule) in entries {
        let Some(l4) = l4_match(entry.protocol, entry.ports) else {
            continue;
        };
        if let Some(log) = allow_log(&l4, Reason::Policy) {
            peer_rules(out, direction, entry.peer, &format!(" {log}"), sets, source);
        }
        // The anonymous `counter` is the rule's own (read back per rule id
        // from its comment: `super::rule_counts`).
        let tail = format!(
            "{l4} counter name \"{}\" counter return comment \"rule {rule}\"",
            c(Reason::Policy)
        );
        peer_rules(out, direction, entry.peer, &tail, sets, source);
    }
    // The anonymous `counter`: this endpoint's denies (`super::rule_counts`).
    out.push(deny_log_rule("", id, d, Reason::PolicyDenied));
    out.push(format!("counter name \"{}\" counter drop", c(Reason::PolicyDenied)));
}

/// Pushes the rules matching `peer` (the source for ingress, the
/// destination for egress) followed by `tail` (which starts with a space,
/// or is the whole rule for [`IDENTITY_ANY`]): one per family that has
/// addresses, one `!= @not_world_*` per family for [`IDENTITY_WORLD`],
/// none for a peer without a set.
fn peer_rules(
    out: &mut Vec<String>,
    direction: Direction,
    peer: u32,
    tail: &str,
    sets: &BTreeMap<u32, PeerSet>,
    source: Source,
) {
    if peer == IDENTITY_ANY {
        out.push(tail.trim_start().to_string());
        return;
    }
    let (v4_peer, v6_peer) = source.selectors(direction);
    let Some(set) = sets.get(&peer) else { return };
    for (family, sel) in [(Family::V4, v4_peer), (Family::V6, v6_peer)] {
        let name = set_name(peer, family);
        if peer == IDENTITY_WORLD {
            out.push(format!("{sel} != @{name}{tail}"));
        } else if !set.elements(family).is_empty() {
            out.push(format!("{sel} @{name}{tail}"));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_policy::compiled::PodRef;

    fn entry(peer: u32, protocol: Option<Protocol>, ports: (u16, u16)) -> TierEntry {
        TierEntry {
            subject: 1,
            direction: Direction::Ingress,
            tier: Tier::Admin,
            peer,
            protocol,
            ports,
        }
    }

    fn value(action: TierAction, rank: u32, rule: u32) -> TierValue {
        TierValue { action, rank, rule }
    }

    /// Rules come out in rank order (not entry order), with the verdict of
    /// their action; Pass returns; an empty port range is left out.
    #[test]
    fn tier_rules_are_in_rank_order_with_their_verdicts() {
        let mut tiers = BTreeMap::new();
        tiers.insert(entry(IDENTITY_ANY, None, (0, 65535)), value(TierAction::Deny, 9, 40));
        tiers.insert(
            entry(IDENTITY_ANY, Some(Protocol::Tcp), (80, 80)),
            value(TierAction::Accept, 2, 41),
        );
        tiers.insert(
            entry(IDENTITY_ANY, Some(Protocol::Udp), (53, 54)),
            value(TierAction::Pass, 5, 42),
        );
        tiers.insert(
            entry(IDENTITY_ANY, Some(Protocol::Sctp), (9, 8)),
            value(TierAction::Deny, 0, 43),
        );
        let groups = group_tiers(&tiers);
        let list = &groups[&(1, Direction::Ingress, Tier::Admin)];
        let rules = tier_rules(
            1,
            false,
            Direction::Ingress,
            Tier::Admin,
            list,
            &BTreeMap::new(),
            Source::Packet,
        );
        let deny_log = "limit rate 100/second burst 32 packets log prefix \"npm:1:0:20 \" group 20048";
        assert_eq!(
            rules,
            [
                "meta l4proto tcp th dport 80 counter name \"in_admin_accept\" accept comment \"rule 41\"",
                "meta l4proto udp th dport 53-54 return comment \"rule 42 pass\"",
                deny_log,
                "counter name \"in_admin_deny\" drop comment \"rule 40\"",
            ]
        );
        // With report_new the accept logs its new connections too.
        let rules = tier_rules(
            1,
            true,
            Direction::Ingress,
            Tier::Admin,
            list,
            &BTreeMap::new(),
            Source::Packet,
        );
        assert_eq!(
            rules[0],
            "meta l4proto tcp th dport 80 ct state new limit rate 100/second burst 32 packets \
             log prefix \"npm:1:0:9 \" group 20048"
        );
        assert_eq!(rules.len(), 5);
    }

    /// An endpoint with tier chains: host first, Admin before NetworkPolicy,
    /// Baseline only when not isolated.
    #[test]
    fn endpoint_chain_order_with_tiers() {
        let ep = Endpoint {
            pod: PodRef {
                namespace: "n".into(),
                name: "p".into(),
                uid: "u".into(),
            },
            identity: 256,
            ipv4: Some("10.0.0.1".parse().unwrap()),
            ipv6: None,
            isolated_ingress: false,
            isolated_egress: false,
            tiers: Default::default(),
            report_new: false,
        };
        let jumps = TierJumps {
            admin: Some("ep_1_in_admin".into()),
            baseline: Some("ep_1_in_baseline".into()),
        };
        let rules = endpoint_rules(1, &ep, Direction::Ingress, &[], &jumps, &BTreeMap::new());
        let tail: Vec<&str> = rules[4..].iter().map(String::as_str).collect();
        assert_eq!(
            tail,
            [
                "ct status snat goto ep_1_in_nat",
                "jump ep_1_in_admin",
                "jump ep_1_in_baseline",
                "counter name \"in_not_isolated\" return"
            ]
        );
        let isolated = Endpoint {
            isolated_ingress: true,
            ..ep.clone()
        };
        let rules = endpoint_rules(1, &isolated, Direction::Ingress, &[], &jumps, &BTreeMap::new());
        let tail: Vec<&str> = rules[4..].iter().map(String::as_str).collect();
        assert_eq!(
            tail,
            [
                "ct status snat goto ep_1_in_nat",
                "jump ep_1_in_admin",
                "limit rate 100/second burst 32 packets log prefix \"npm:1:0:16 \" group 20048",
                "counter name \"in_policy_denied\" counter drop"
            ],
            "Baseline is not consulted when NetworkPolicy isolates"
        );
        // No tier chains: exactly the NetworkPolicy chain.
        let rules = endpoint_rules(1, &ep, Direction::Ingress, &[], &TierJumps::default(), &BTreeMap::new());
        assert_eq!(rules.last().unwrap(), "counter name \"in_not_isolated\" return");
        assert_eq!(rules.len(), 5);
        // report_new: the not-isolated return logs new connections first.
        let reported = Endpoint {
            report_new: true,
            ..ep.clone()
        };
        let rules = endpoint_rules(
            1,
            &reported,
            Direction::Ingress,
            &[],
            &TierJumps::default(),
            &BTreeMap::new(),
        );
        assert_eq!(
            rules[rules.len() - 2],
            "ct state new limit rate 100/second burst 32 packets log prefix \"npm:1:0:1 \" group 20048"
        );
    }
}
