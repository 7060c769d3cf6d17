//! ClusterNetworkPolicy API object -> [`ClusterPolicy`] as far as it is
//! understood, plus a [`ClusterFieldError`] for everything that is not
//! ([`convert_cluster_policy`]); [`validate_cluster_policy`] is the strict
//! form. [`convert_cluster_policy_value`] / [`convert_cluster_policy_yaml`]
//! read the object from JSON or YAML (the simulator's case files).
//!
//! # Invalid input fails closed
//!
//! The API's own rule for a peer with no field set ("the deployed CRD is of
//! an incompatible version with an unknown field"): "For "Accept" rules,
//! "fail closed" means: "treat the rule as matching no traffic". For "Deny"
//! and "Pass" rules, "fail closed" means: "treat the rule as a 'Deny all'
//! rule"". The conversion applies that rule to everything it cannot
//! understand, using two facts: an Accept rule that matches less never
//! allows more, and a rule turned into a Deny (or a Deny that matches more)
//! never allows more. A Pass rule is never widened or narrowed (either can
//! let a later rule allow more): a Pass rule with a problem becomes a Deny.
//!
//! | what cannot be understood | what the conversion does ([`ClusterConsequence`]) |
//! |---|---|
//! | a peer with no field (a newer field), `domainNames` outside an Accept rule of the Admin tier (NPEP-133) or with a name the API's pattern refuses, a bad `nodes` selector, an empty or unparsable `networks`, a bad selector | Accept: the peer matches nothing; Deny/Pass: the rule becomes Deny of every peer |
//! | an empty `from`/`to` | Accept: matches nothing; Deny/Pass: Deny of every peer |
//! | a protocol entry with no field or several, `tcp`/`udp`/`sctp` without a port, a port not 1..=65535, a range without `start < end`, a bad port name | Accept: the entry is dropped (the rule matches nothing once none is left); Deny/Pass: the rule becomes Deny of all traffic of its peers |
//! | an action other than `Accept`, `Deny`, `Pass` | the rule is a Deny |
//! | a tier other than `Admin`/`Baseline`, no `priority` | deny-only in the Admin tier (priority 0 when missing): every Accept rule matches nothing, every Pass rule is a Deny |
//! | a `priority` outside 0..=1000 | clamped, reported |
//! | a subject with no field or both, or a bad subject selector | the policy selects no pod (as a NetworkPolicy with a bad `podSelector`: the selector is the only statement of whom the author meant) |
//! | more than 25 rules/peers/protocols/CIDRs, a rule name over 100 characters, an empty name, a named port with a `networks` peer | reported only |
//!
//! A named port never matches a `networks` or `domainNames` destination (the API forbids
//! the combination; the model gives it no meaning there).

use std::fmt;

use ipnet::IpNet;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;

use super::api::{self, ClusterNetworkPolicy, ClusterNetworkPolicyEgressPeer, ClusterNetworkPolicyProtocol};
use super::domains::DomainPattern;
use super::model::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};
use crate::compiled::{Tier, TierAction};
use crate::model::{InvalidPolicy, Protocol, Selector};
use crate::validate::{check_selector, is_port_name, normalize_cidr};

/// The API's limit on rules per direction, peers per rule, protocols per
/// rule and CIDRs per peer.
pub const MAX_ITEMS: usize = 25;
/// The highest priority value the API accepts.
pub const MAX_PRIORITY: u32 = 1000;

/// What the conversion does about one [`ClusterFieldError`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ClusterConsequence {
    /// Reported only: enforced as written (or clamped, as the message says).
    Reported,
    /// The peer at this path matches nothing (its Accept rule keeps its
    /// other peers).
    PeerMatchesNothing(String),
    /// The rule at this path matches nothing (an Accept rule).
    RuleMatchesNothing(String),
    /// A protocol entry of the Accept rule at this path is dropped (the
    /// rule keeps its other entries).
    ProtocolDropped(String),
    /// The rule at this path is a Deny of every peer (on its protocols).
    DenyEveryPeer(String),
    /// The rule at this path is a Deny of all traffic of its peers.
    DenyAllTraffic(String),
    /// The rule at this path is a Deny (its peers and protocols as written).
    Deny(String),
    /// The policy is deny-only in the Admin tier: its Accept rules match
    /// nothing, its Pass rules are Denies.
    DenyOnly,
    /// The policy selects no pod (no earlier version of it had a subject
    /// this agent understood).
    SelectsNothing,
    /// The subject is not understood: the last version of the policy whose
    /// subject was stays enforced, rules included
    /// ([`super::with_last_valid_subject`]).
    KeptLastValid,
}

impl fmt::Display for ClusterConsequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ClusterConsequence::Reported => f.write_str("reported; enforced as written"),
            ClusterConsequence::PeerMatchesNothing(p) => write!(f, "peer {p} matches nothing"),
            ClusterConsequence::RuleMatchesNothing(p) => write!(f, "rule {p} matches nothing"),
            ClusterConsequence::ProtocolDropped(p) => {
                write!(f, "protocol dropped; rule {p} keeps its other protocols")
            }
            ClusterConsequence::DenyEveryPeer(p) => write!(f, "rule {p} denies every peer (fail closed)"),
            ClusterConsequence::DenyAllTraffic(p) => {
                write!(f, "rule {p} denies all traffic of its peers (fail closed)")
            }
            ClusterConsequence::Deny(p) => write!(f, "rule {p} is a Deny (fail closed)"),
            ClusterConsequence::DenyOnly => f.write_str(
                "the policy is deny-only in the Admin tier: Accept rules match nothing, Pass rules deny (fail closed)",
            ),
            ClusterConsequence::SelectsNothing => f.write_str("the policy selects no pod"),
            ClusterConsequence::KeptLastValid => {
                f.write_str("the last version with an understood subject stays enforced, rules included")
            }
        }
    }
}

/// One validation error: the policy, the field path, what is wrong (quoting
/// the value) and what the conversion does about it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("clusternetworkpolicy {object}: {field}: {message} ({consequence})")]
pub struct ClusterFieldError {
    /// The policy's name.
    pub object: String,
    /// Field path, e.g. `spec.egress[0].to[1].networks[0]`.
    pub field: String,
    /// What is wrong.
    pub message: String,
    /// What is done about it.
    pub consequence: ClusterConsequence,
}

/// Errors reading a ClusterNetworkPolicy from JSON or YAML.
#[derive(Debug, thiserror::Error)]
pub enum ClusterParseError {
    /// The JSON value does not have the object's shape.
    #[error("clusternetworkpolicy {name:?}: {source}")]
    Json {
        /// metadata.name, if readable.
        name: String,
        /// The error.
        source: serde_json::Error,
    },
    /// The YAML text does not parse or does not have the object's shape.
    #[error("clusternetworkpolicy YAML: {source}")]
    Yaml {
        /// The error.
        source: serde_yaml::Error,
    },
    /// The object is of another kind.
    #[error("kind {kind:?} is not {}", api::KIND)]
    WrongKind {
        /// The kind found.
        kind: String,
    },
}

/// A ClusterNetworkPolicy as far as it is understood, and what is not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ClusterPolicyConversion {
    /// The policy, failing closed where it is not understood.
    pub policy: ClusterPolicy,
    /// Every error; empty for a valid policy.
    pub problems: Vec<ClusterFieldError>,
}

impl ClusterPolicyConversion {
    /// The policy's report when it has problems (`namespace` is empty: the
    /// object is cluster-scoped).
    pub fn invalid(&self) -> Option<InvalidPolicy> {
        (!self.problems.is_empty()).then(|| InvalidPolicy {
            namespace: String::new(),
            name: self.policy.name.clone(),
            errors: self.problems.iter().map(|e| e.to_string()).collect(),
        })
    }
}

/// Collects errors while walking one policy.
struct Ctx {
    object: String,
    errors: Vec<ClusterFieldError>,
}

impl Ctx {
    fn err(&mut self, field: impl fmt::Display, message: impl Into<String>, consequence: ClusterConsequence) {
        self.errors.push(ClusterFieldError {
            object: self.object.clone(),
            field: field.to_string(),
            message: message.into(),
            consequence,
        });
    }

    /// The errors recorded since `from` get `consequence`.
    fn since(&mut self, from: usize, consequence: &ClusterConsequence) {
        for e in &mut self.errors[from..] {
            e.consequence = consequence.clone();
        }
    }

    /// A selector, or `None` with its errors recorded.
    fn selector(&mut self, path: &str, sel: &LabelSelector) -> Option<Selector> {
        match check_selector(path, sel) {
            Ok(s) => Some(s),
            Err(errs) => {
                for (field, message) in errs {
                    self.err(field, message, ClusterConsequence::Reported);
                }
                None
            }
        }
    }

    fn limit(&mut self, path: &str, what: &str, n: usize) {
        if n > MAX_ITEMS {
            self.err(
                path,
                format!("{n} {what}: must have at most {MAX_ITEMS} items"),
                ClusterConsequence::Reported,
            );
        }
    }
}

/// A peer of a rule whose action is `Accept` when `accept`, in a policy of
/// tier `tier`, or `None` (errors recorded, consequence set by the caller).
fn peer(
    ctx: &mut Ctx,
    path: &str,
    p: &ClusterNetworkPolicyEgressPeer,
    accept: bool,
    tier: Tier,
) -> Option<ClusterPeer> {
    let set = [
        p.namespaces.is_some(),
        p.pods.is_some(),
        p.nodes.is_some(),
        p.networks.is_some(),
        p.domain_names.is_some(),
    ]
    .iter()
    .filter(|b| **b)
    .count();
    if set == 0 {
        ctx.err(
            path,
            "peer {} has no field this agent knows (a newer API version?): exactly one must be set",
            ClusterConsequence::Reported,
        );
        return None;
    }
    if set > 1 {
        ctx.err(
            path,
            "peer has several fields: exactly one must be set",
            ClusterConsequence::Reported,
        );
        return None;
    }
    if let Some(s) = &p.nodes {
        // Experimental `nodes`: a label selector over Nodes.
        return ctx.selector(&format!("{path}.nodes"), s).map(ClusterPeer::Nodes);
    }
    if let Some(d) = &p.domain_names {
        // "DomainNames is only supported for Accept rules" (the API's CEL
        // rule refuses it elsewhere; a Deny or Pass on names could not be
        // enforced safely: the answers known may be incomplete).
        let dp = format!("{path}.domainNames");
        if !accept {
            ctx.err(
                dp,
                "domainNames may only be used with Accept action",
                ClusterConsequence::Reported,
            );
            return None;
        }
        // NPEP-133 (network-policy-api PR #366, May 2026): "DomainNames is
        // only supported in the Admin tier", a CEL rule the API enforces;
        // a Baseline policy cannot carry it (an Accept of names below every
        // NetworkPolicy would be a second, weaker allow list).
        if tier != Tier::Admin {
            ctx.err(
                dp,
                "domainNames may only be used in the Admin tier (NPEP-133)",
                ClusterConsequence::Reported,
            );
            return None;
        }
        if d.is_empty() {
            ctx.err(
                dp,
                "domainNames [] must have at least one name",
                ClusterConsequence::Reported,
            );
            return None;
        }
        ctx.limit(&dp, "domain names", d.len());
        let before = ctx.errors.len();
        let mut out: Vec<DomainPattern> = Vec::new();
        for (i, n) in d.iter().enumerate() {
            match DomainPattern::parse(n) {
                Ok(p) if !out.contains(&p) => out.push(p),
                Ok(_) => {}
                Err(e) => ctx.err(format!("{dp}[{i}]"), e, ClusterConsequence::Reported),
            }
        }
        // The compiler matches the names against the learned answers it is
        // given (`Snapshot::domain_names`).
        return (ctx.errors.len() == before).then_some(ClusterPeer::DomainNames(out));
    }
    if let Some(s) = &p.namespaces {
        return ctx
            .selector(&format!("{path}.namespaces"), s)
            .map(ClusterPeer::Namespaces);
    }
    if let Some(np) = &p.pods {
        let ns = ctx.selector(&format!("{path}.pods.namespaceSelector"), &np.namespace_selector);
        let pods = ctx.selector(&format!("{path}.pods.podSelector"), &np.pod_selector);
        return match (ns, pods) {
            (Some(namespaces), Some(pods)) => Some(ClusterPeer::Pods { namespaces, pods }),
            _ => None,
        };
    }
    let nets = p.networks.as_ref().expect("the one field set");
    if nets.is_empty() {
        ctx.err(
            format!("{path}.networks"),
            "networks [] must have at least one CIDR",
            ClusterConsequence::Reported,
        );
        return None;
    }
    ctx.limit(&format!("{path}.networks"), "CIDRs", nets.len());
    let before = ctx.errors.len();
    let mut out: Vec<IpNet> = Vec::new();
    for (i, n) in nets.iter().enumerate() {
        match normalize_cidr(n) {
            Ok(net) => {
                if !out.contains(&net) {
                    out.push(net);
                }
            }
            Err(e) => ctx.err(format!("{path}.networks[{i}]"), e, ClusterConsequence::Reported),
        }
    }
    (ctx.errors.len() == before).then_some(ClusterPeer::Networks(out))
}

/// A port number 1..=65535, or an error message.
fn port_number(n: i32) -> Result<u16, String> {
    if (1..=65535).contains(&n) {
        Ok(n as u16)
    } else {
        Err(format!("{n} must be between 1 and 65535, inclusive"))
    }
}

/// A protocol entry, or `None` (errors recorded, consequence set by the
/// caller).
fn protocol(ctx: &mut Ctx, path: &str, p: &ClusterNetworkPolicyProtocol) -> Option<ClusterPort> {
    let mut set: Vec<(Protocol, &api::ProtocolPorts)> = Vec::new();
    if let Some(t) = &p.tcp {
        set.push((Protocol::Tcp, t));
    }
    if let Some(u) = &p.udp {
        set.push((Protocol::Udp, u));
    }
    if let Some(s) = &p.sctp {
        set.push((Protocol::Sctp, s));
    }
    let n = set.len() + p.destination_named_port.is_some() as usize;
    if n != 1 {
        let m = if n == 0 {
            "protocol {} has no field this agent knows (a newer API version?): exactly one of tcp, udp, sctp, destinationNamedPort must be set"
        } else {
            "protocol has several fields: exactly one of tcp, udp, sctp, destinationNamedPort must be set"
        };
        ctx.err(path, m, ClusterConsequence::Reported);
        return None;
    }
    if let Some(name) = &p.destination_named_port {
        if !is_port_name(name) {
            ctx.err(
                format!("{path}.destinationNamedPort"),
                format!("{name:?} is not a valid port name (IANA_SVC_NAME)"),
                ClusterConsequence::Reported,
            );
            return None;
        }
        return Some(ClusterPort::Named(name.clone()));
    }
    let (proto, pp) = set[0];
    let ppath = format!("{path}.{}.destinationPort", proto_field(proto));
    let Some(port) = &pp.destination_port else {
        ctx.err(
            ppath,
            "missing: destinationPort must be set (a newer field?)",
            ClusterConsequence::Reported,
        );
        return None;
    };
    match (port.number, &port.range) {
        (Some(n), None) => match port_number(n) {
            Ok(n) => Some(ClusterPort::Ports {
                protocol: proto,
                start: n,
                end: n,
            }),
            Err(e) => {
                ctx.err(format!("{ppath}.number"), e, ClusterConsequence::Reported);
                None
            }
        },
        (None, Some(r)) => {
            let before = ctx.errors.len();
            let s = port_number(r.start)
                .map_err(|e| ctx.err(format!("{ppath}.range.start"), e, ClusterConsequence::Reported));
            let e =
                port_number(r.end).map_err(|e| ctx.err(format!("{ppath}.range.end"), e, ClusterConsequence::Reported));
            if let (Ok(s), Ok(e)) = (s, e) {
                if s >= e {
                    ctx.err(
                        format!("{ppath}.range"),
                        format!("start {s} must be less than end {e}"),
                        ClusterConsequence::Reported,
                    );
                }
                if ctx.errors.len() == before {
                    return Some(ClusterPort::Ports {
                        protocol: proto,
                        start: s,
                        end: e,
                    });
                }
            }
            None
        }
        (None, None) => {
            ctx.err(
                ppath,
                "neither number nor range is set (a newer field?): exactly one must be",
                ClusterConsequence::Reported,
            );
            None
        }
        (Some(n), Some(r)) => {
            ctx.err(
                ppath,
                format!(
                    "both number {n} and range {}-{} are set: exactly one must be",
                    r.start, r.end
                ),
                ClusterConsequence::Reported,
            );
            None
        }
    }
}

fn proto_field(p: Protocol) -> &'static str {
    match p {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    }
}

/// Parses an action as the API spells it.
pub fn parse_action(s: &str) -> Option<TierAction> {
    match s {
        "Accept" => Some(TierAction::Accept),
        "Deny" => Some(TierAction::Deny),
        "Pass" => Some(TierAction::Pass),
        _ => None,
    }
}

/// Parses a tier as the API spells it.
pub fn parse_tier(s: &str) -> Option<Tier> {
    match s {
        "Admin" => Some(Tier::Admin),
        "Baseline" => Some(Tier::Baseline),
        _ => None,
    }
}

/// One rule (see the module doc for what fails closed how).
// Nine arguments: the ingress and egress rules are two API types whose
// fields the two callers pass one by one into this one conversion.
#[allow(clippy::too_many_arguments)]
fn rule(
    ctx: &mut Ctx,
    path: &str,
    peer_field: &str,
    name: Option<&String>,
    action: &str,
    peers: &[ClusterNetworkPolicyEgressPeer],
    protocols: Option<&Vec<ClusterNetworkPolicyProtocol>>,
    tier: Tier,
    deny_only: bool,
) -> ClusterRule {
    if let Some(n) = name.filter(|n| n.chars().count() > 100) {
        ctx.err(
            format!("{path}.name"),
            format!("{n:?} must be at most 100 characters"),
            ClusterConsequence::Reported,
        );
    }
    let mut act = match parse_action(action) {
        Some(a) => a,
        None => {
            ctx.err(
                format!("{path}.action"),
                format!("unsupported action {action:?}: must be Accept, Deny or Pass"),
                ClusterConsequence::Deny(path.to_string()),
            );
            TierAction::Deny
        }
    };
    if deny_only && act == TierAction::Pass {
        act = TierAction::Deny;
    }
    let mut out = ClusterRule {
        name: name.cloned(),
        action: act,
        peers: Vec::new(),
        ports: Vec::new(),
    };
    let accept = act == TierAction::Accept;
    // Peers.
    ctx.limit(&format!("{path}.{peer_field}"), "peers", peers.len());
    let mut every_peer = false;
    if peers.is_empty() {
        let c = if accept {
            ClusterConsequence::RuleMatchesNothing(path.to_string())
        } else {
            every_peer = true;
            ClusterConsequence::DenyEveryPeer(path.to_string())
        };
        ctx.err(
            format!("{path}.{peer_field}"),
            format!("{peer_field} [] must have at least one peer"),
            c,
        );
    }
    for (i, p) in peers.iter().enumerate() {
        let pp = format!("{path}.{peer_field}[{i}]");
        let from = ctx.errors.len();
        match peer(ctx, &pp, p, accept, tier) {
            Some(p) => out.peers.push(p),
            None if accept => ctx.since(from, &ClusterConsequence::PeerMatchesNothing(pp)),
            None => {
                every_peer = true;
                ctx.since(from, &ClusterConsequence::DenyEveryPeer(path.to_string()));
            }
        }
    }
    // Protocols.
    let protocols = protocols.map(Vec::as_slice).unwrap_or_default();
    ctx.limit(&format!("{path}.protocols"), "protocols", protocols.len());
    let mut all_traffic = false;
    let mut dropped: Vec<(usize, usize)> = Vec::new();
    for (i, p) in protocols.iter().enumerate() {
        let pp = format!("{path}.protocols[{i}]");
        let from = ctx.errors.len();
        match protocol(ctx, &pp, p) {
            Some(p) => out.ports.push(p),
            None if accept => dropped.push((from, ctx.errors.len())),
            None => {
                all_traffic = true;
                ctx.since(from, &ClusterConsequence::DenyAllTraffic(path.to_string()));
            }
        }
    }
    // Accept: a dropped entry narrows the rule; with none left the rule
    // would match all traffic, so it matches nothing instead.
    let dropped_all = accept && !protocols.is_empty() && out.ports.is_empty();
    for (from, to) in dropped {
        let c = if dropped_all {
            ClusterConsequence::RuleMatchesNothing(path.to_string())
        } else {
            ClusterConsequence::ProtocolDropped(path.to_string())
        };
        for e in &mut ctx.errors[from..to] {
            e.consequence = c.clone();
        }
    }
    if out
        .peers
        .iter()
        .any(|p| matches!(p, ClusterPeer::Networks(_) | ClusterPeer::DomainNames(_)))
        && out.ports.iter().any(|p| matches!(p, ClusterPort::Named(_)))
    {
        ctx.err(
            path,
            "a networks or domainNames peer cannot be set with destinationNamedPort (a named port never matches an address peer)",
            ClusterConsequence::Reported,
        );
    }
    if !accept && (every_peer || all_traffic) && act == TierAction::Pass {
        // "For Deny and Pass rules, fail closed means: treat the rule as a
        // 'Deny all' rule."
        out.action = TierAction::Deny;
    }
    if accept && (dropped_all || deny_only) {
        out.peers.clear();
    }
    if every_peer {
        out.peers = vec![ClusterPeer::All];
    }
    if all_traffic {
        out.ports.clear();
    }
    out
}

/// The egress form of an ingress peer (the same two fields; the others
/// unset).
fn ingress_peer(p: &api::ClusterNetworkPolicyIngressPeer) -> ClusterNetworkPolicyEgressPeer {
    ClusterNetworkPolicyEgressPeer {
        namespaces: p.namespaces.clone(),
        pods: p.pods.clone(),
        ..Default::default()
    }
}

/// Converts a ClusterNetworkPolicy as far as it is understood (see the
/// module doc for what fails closed how).
pub fn convert_cluster_policy(cnp: &ClusterNetworkPolicy) -> ClusterPolicyConversion {
    let name = cnp.metadata.name.clone().unwrap_or_default();
    let mut ctx = Ctx {
        object: name.clone(),
        errors: Vec::new(),
    };
    if name.is_empty() {
        ctx.err(
            "metadata.name",
            "name \"\" must not be empty",
            ClusterConsequence::Reported,
        );
    }
    let spec = &cnp.spec;
    let mut deny_only = false;
    let tier = match parse_tier(&spec.tier) {
        Some(t) => t,
        None => {
            ctx.err(
                "spec.tier",
                format!("unsupported tier {:?}: must be Admin or Baseline", spec.tier),
                ClusterConsequence::DenyOnly,
            );
            deny_only = true;
            Tier::Admin
        }
    };
    let priority = match spec.priority {
        None => {
            ctx.err(
                "spec.priority",
                "missing: priority is required",
                ClusterConsequence::DenyOnly,
            );
            deny_only = true;
            0
        }
        Some(p) if p < 0 || p > MAX_PRIORITY as i32 => {
            let c = p.clamp(0, MAX_PRIORITY as i32) as u32;
            ctx.err(
                "spec.priority",
                format!("{p} must be between 0 and {MAX_PRIORITY}, inclusive (clamped to {c})"),
                ClusterConsequence::Reported,
            );
            c
        }
        Some(p) => p as u32,
    };
    let from = ctx.errors.len();
    let subject = match (&spec.subject.namespaces, &spec.subject.pods) {
        (Some(s), None) => ctx.selector("spec.subject.namespaces", s).map(Subject::Namespaces),
        (None, Some(np)) => {
            let ns = ctx.selector("spec.subject.pods.namespaceSelector", &np.namespace_selector);
            let pods = ctx.selector("spec.subject.pods.podSelector", &np.pod_selector);
            match (ns, pods) {
                (Some(namespaces), Some(pods)) => Some(Subject::Pods { namespaces, pods }),
                _ => None,
            }
        }
        (None, None) => {
            ctx.err(
                "spec.subject",
                "subject {} has no field this agent knows (a newer API version?): exactly one of namespaces, pods must be set",
                ClusterConsequence::Reported,
            );
            None
        }
        (Some(_), Some(_)) => {
            ctx.err(
                "spec.subject",
                "both namespaces and pods are set: exactly one must be",
                ClusterConsequence::Reported,
            );
            None
        }
    };
    let subject = subject.unwrap_or_else(|| {
        ctx.since(from, &ClusterConsequence::SelectsNothing);
        Subject::Namespaces(Selector::nothing())
    });
    let ingress_rules = spec.ingress.as_deref().unwrap_or_default();
    let egress_rules = spec.egress.as_deref().unwrap_or_default();
    ctx.limit("spec.ingress", "rules", ingress_rules.len());
    ctx.limit("spec.egress", "rules", egress_rules.len());
    let ingress = ingress_rules
        .iter()
        .enumerate()
        .map(|(i, r)| {
            let peers: Vec<_> = r.from.iter().map(ingress_peer).collect();
            rule(
                &mut ctx,
                &format!("spec.ingress[{i}]"),
                "from",
                r.name.as_ref(),
                &r.action,
                &peers,
                r.protocols.as_ref(),
                tier,
                deny_only,
            )
        })
        .collect();
    let egress = egress_rules
        .iter()
        .enumerate()
        .map(|(i, r)| {
            rule(
                &mut ctx,
                &format!("spec.egress[{i}]"),
                "to",
                r.name.as_ref(),
                &r.action,
                &r.to,
                r.protocols.as_ref(),
                tier,
                deny_only,
            )
        })
        .collect();
    ClusterPolicyConversion {
        policy: ClusterPolicy {
            name,
            tier,
            priority,
            subject,
            ingress,
            egress,
        },
        problems: ctx.errors,
    }
}

/// Converts a ClusterNetworkPolicy strictly: the policy when it is fully
/// understood, else its report.
pub fn validate_cluster_policy(cnp: &ClusterNetworkPolicy) -> Result<ClusterPolicy, InvalidPolicy> {
    let c = convert_cluster_policy(cnp);
    match c.invalid() {
        Some(e) => Err(e),
        None => Ok(c.policy),
    }
}

/// Reads the API object from a JSON value (`kind`, when present, must be
/// `ClusterNetworkPolicy`); unknown fields are ignored.
pub fn cluster_policy_from_value(v: &serde_json::Value) -> Result<ClusterNetworkPolicy, ClusterParseError> {
    if let Some(kind) = v.get("kind").and_then(|k| k.as_str()).filter(|k| *k != api::KIND) {
        return Err(ClusterParseError::WrongKind { kind: kind.to_string() });
    }
    serde_json::from_value(v.clone()).map_err(|source| ClusterParseError::Json {
        name: v
            .pointer("/metadata/name")
            .and_then(|n| n.as_str())
            .unwrap_or("")
            .to_string(),
        source,
    })
}

/// [`convert_cluster_policy`] of the object in a JSON value.
pub fn convert_cluster_policy_value(v: &serde_json::Value) -> Result<ClusterPolicyConversion, ClusterParseError> {
    cluster_policy_from_value(v).map(|c| convert_cluster_policy(&c))
}

/// [`convert_cluster_policy`] of the object in a YAML (or JSON) text.
pub fn convert_cluster_policy_yaml(text: &str) -> Result<ClusterPolicyConversion, ClusterParseError> {
    let v: serde_json::Value = serde_yaml::from_str(text).map_err(|source| ClusterParseError::Yaml { source })?;
    convert_cluster_policy_value(&v)
}
