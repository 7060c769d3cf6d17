//! API defaulting and conversion of a NetworkPolicy: k8s-openapi
//! `NetworkPolicy` -> [`Policy`] as far as it is understood, plus the
//! [`FieldError`]s of what is not ([`convert_policy`]); [`validate_policy`]
//! is the strict form (any error makes it an [`InvalidPolicy`]).
//!
//! Defaulting (spec §2): "If `policyTypes` is non-empty, it is used as given
//! [...] If it is empty or absent, the API server sets it to `[Ingress]`, and
//! appends `Egress` only if `len(spec.egress) != 0`." and "NetworkPolicyPort
//! `protocol` defaults to `TCP`".
//!
//! # Invalid input fails closed
//!
//! An API server of another version (or one with validation off) may hand
//! the agent a policy it cannot fully understand. Skipping such a policy
//! would un-isolate the pods it selects (fail open), so the policy is kept
//! and only what cannot be understood is dropped, each drop narrowing what
//! is allowed, never widening it. Rules are OR-ed and so are the peers of
//! a rule: dropping a rule or one of several peers only removes allowances.
//! An *empty* peer list or port list means "everyone" / "every port", so a
//! drop that would empty one drops the whole rule instead.
//!
//! | what cannot be understood | what is dropped ([`Consequence`]) |
//! |---|---|
//! | `ipBlock.cidr` or an `except` entry that does not parse, an `except` that is not a strict subset of `cidr` | the peer |
//! | a peer with no field, or `ipBlock` with a selector | the peer |
//! | a peer's `podSelector`/`namespaceSelector` (bad operator, empty key, `In`/`NotIn` without values, `Exists`/`DoesNotExist` with values, a label key or value the API would reject, in `matchLabels` or `matchExpressions`) | the peer |
//! | every peer of a rule | the rule |
//! | a port: protocol, number out of range, `endPort` < `port`, `endPort` without `port` or with a named port, a bad port name | the rule (without that port the rule would allow other ports, or every port) |
//! | the policy's own `spec.podSelector` | the policy selects no pod |
//! | a `policyTypes` entry other than `Ingress`/`Egress` | read as both: the selected pods are isolated for ingress and egress |
//! | more than two `policyTypes` entries, an empty `metadata.name` | nothing: reported, enforced as written |
//! | an `npm.io/audit` annotation other than `"true"`/`"false"` | nothing: reported, **enforced** (not audited; [`crate::audit`]) |
//!
//! A label key or value the API would reject is not matched literally:
//! with `NotIn` or `DoesNotExist` on a key no pod can have, the
//! requirement would match every pod (a peer allowing the whole cluster,
//! a `spec.podSelector` isolating the whole namespace), so it makes the
//! selector invalid like the other selector errors.
//!
//! Why a policy whose own `podSelector` cannot be evaluated selects
//! nothing rather than every pod of its namespace: the selector is the
//! only statement of *whom* the author meant to isolate. Reading it as
//! `{}` (or dropping the bad requirement, which also widens it) would
//! isolate pods the author never named, possibly every workload of the
//! namespace: a self-inflicted outage caused by a typo in an unrelated
//! policy. Selecting nothing leaves every pod exactly as the other
//! policies make it, and the agent reports the policy loudly (log, metric,
//! a Kubernetes Event). An unknown `policyTypes` entry is different: the
//! pods are known (the author selected them for isolation) and only the
//! direction is not, so the safe reading is both directions, which can
//! only affect the pods the author chose.
//!
//! The agent reports every [`FieldError`] (its field path, the value and
//! the [`Consequence`]); this module does no I/O.

use std::fmt;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1 as netv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::model::{
    InvalidPolicy, IpBlock, Operator, Peer, Policy, Port, PortSpec, Protocol, Requirement, Rule, Selector,
};

/// What the conversion does about one [`FieldError`] (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Consequence {
    /// Reported only: what the policy says is still clear, it is enforced
    /// as written.
    Reported,
    /// The peer at this path (`spec.ingress[0].from[1]`) is dropped; its
    /// rule keeps its other peers.
    PeerDropped(String),
    /// The rule at this path (`spec.egress[2]`) is dropped: it allows
    /// nothing (the policy keeps its other rules and its isolation).
    RuleDropped(String),
    /// The policy selects no pod (its `spec.podSelector` cannot be
    /// evaluated).
    SelectsNothing,
    /// The `policyTypes` entry is read as both `Ingress` and `Egress`.
    BothDirections,
}

impl fmt::Display for Consequence {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Consequence::Reported => f.write_str("reported; the policy is enforced as written"),
            Consequence::PeerDropped(p) => write!(f, "peer {p} dropped; its rule keeps its other peers"),
            Consequence::RuleDropped(p) => write!(f, "rule {p} dropped; the selected pods stay isolated"),
            Consequence::SelectsNothing => f.write_str("the policy selects no pod"),
            Consequence::BothDirections => {
                f.write_str("read as Ingress and Egress: the selected pods are isolated both ways")
            }
        }
    }
}

/// One validation error: the object, the field path, what is wrong (with
/// the value) and what the conversion drops for it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{object}: {field}: {message} ({consequence})")]
pub struct FieldError {
    /// `namespace/name` of the policy.
    pub object: String,
    /// Field path, e.g. `spec.ingress[0].from[1].ipBlock.except[0]`.
    pub field: String,
    /// What is wrong, quoting the value.
    pub message: String,
    /// What is dropped for it.
    pub consequence: Consequence,
}

/// Collects errors while walking one policy.
struct Ctx<'a> {
    object: &'a str,
    errors: Vec<FieldError>,
}

impl Ctx<'_> {
    fn err(&mut self, field: impl fmt::Display, message: impl Into<String>) {
        self.errors.push(FieldError {
            object: self.object.to_string(),
            field: field.to_string(),
            message: message.into(),
            consequence: Consequence::Reported,
        });
    }

    /// The errors recorded since `from` get `consequence`.
    fn since(&mut self, from: usize, consequence: &Consequence) {
        for e in &mut self.errors[from..] {
            e.consequence = consequence.clone();
        }
    }
}

/// True when `s` is a label name part: at most 63 characters of
/// `[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?`, or empty when
/// `empty_ok` (a label value may be empty).
fn valid_label_name(s: &str, empty_ok: bool) -> bool {
    let b = s.as_bytes();
    if b.is_empty() {
        return empty_ok;
    }
    b.len() <= 63
        && b[0].is_ascii_alphanumeric()
        && b[b.len() - 1].is_ascii_alphanumeric()
        && b.iter()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
}

/// True when `s` is a DNS-1123 subdomain (a label key's prefix): at most
/// 253 characters, dot-separated parts of `[a-z0-9]([-a-z0-9]*[a-z0-9])?`.
fn valid_dns_subdomain(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 253
        && s.split('.').all(|part| {
            let b = part.as_bytes();
            !b.is_empty()
                && b[0].is_ascii_alphanumeric()
                && b[b.len() - 1].is_ascii_alphanumeric()
                && b.iter()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
        })
}

/// True when `key` is a label key the API accepts (a qualified name: an
/// optional DNS-subdomain prefix and `/`, then a name part).
fn valid_label_key(key: &str) -> bool {
    match key.split_once('/') {
        Some((prefix, name)) => valid_dns_subdomain(prefix) && valid_label_name(name, false),
        None => valid_label_name(key, false),
    }
}

/// Records an error at `path` when `key` is not a valid label key.
fn check_label_key(ctx: &mut Ctx<'_>, path: &str, key: &str) {
    if !valid_label_key(key) {
        ctx.err(
            path,
            format!("invalid label key {key:?}: must be a qualified name ([prefix/]name, name at most 63 characters)"),
        );
    }
}

/// Records an error at `path` when `value` is not a valid label value.
fn check_label_value(ctx: &mut Ctx<'_>, path: &str, value: &str) {
    if !valid_label_name(value, true) {
        ctx.err(
            path,
            format!("invalid label value {value:?}: must be empty or at most 63 alphanumeric, '-', '_' or '.' characters, starting and ending alphanumeric"),
        );
    }
}

/// Validates and defaults a label selector at `path`; `None` when invalid
/// (errors are recorded).
fn selector(ctx: &mut Ctx<'_>, path: &str, sel: &LabelSelector) -> Option<Selector> {
    let before = ctx.errors.len();
    let mut out = Selector {
        match_labels: sel.match_labels.clone().unwrap_or_default(),
        match_expressions: Vec::new(),
    };
    for (k, v) in &out.match_labels {
        check_label_key(ctx, &format!("{path}.matchLabels"), k);
        check_label_value(ctx, &format!("{path}.matchLabels[{k}]"), v);
    }
    for (i, e) in sel.match_expressions.iter().flatten().enumerate() {
        let p = format!("{path}.matchExpressions[{i}]");
        if e.key.is_empty() {
            ctx.err(format!("{p}.key"), "key \"\" must not be empty");
        } else {
            check_label_key(ctx, &format!("{p}.key"), &e.key);
        }
        for (j, v) in e.values.iter().flatten().enumerate() {
            check_label_value(ctx, &format!("{p}.values[{j}]"), v);
        }
        let values = e.values.clone().unwrap_or_default();
        let op = match e.operator.as_str() {
            "In" => Operator::In,
            "NotIn" => Operator::NotIn,
            "Exists" => Operator::Exists,
            "DoesNotExist" => Operator::DoesNotExist,
            other => {
                ctx.err(
                    format!("{p}.operator"),
                    format!("unsupported operator {other:?}: must be In, NotIn, Exists or DoesNotExist"),
                );
                continue;
            }
        };
        match op {
            Operator::In | Operator::NotIn if values.is_empty() => ctx.err(
                format!("{p}.values"),
                format!("values [] must be non-empty for operator {}", e.operator),
            ),
            Operator::Exists | Operator::DoesNotExist if !values.is_empty() => ctx.err(
                format!("{p}.values"),
                format!("values {values:?} must be empty for operator {}", e.operator),
            ),
            _ => {}
        }
        out.match_expressions.push(Requirement {
            key: e.key.clone(),
            operator: op,
            values,
        });
    }
    (ctx.errors.len() == before).then_some(out)
}

/// Parses a CIDR, clearing host bits (the API accepts them); the error
/// quotes the text. An IPv4-mapped IPv6 prefix (`::ffff:a.b.c.d/96+n`) is
/// the IPv4 prefix `a.b.c.d/n`: the datapath stores IPv4 mapped, so both
/// would be one kernel key. Shared with the ClusterNetworkPolicy
/// validation (`networks`).
pub(crate) fn normalize_cidr(s: &str) -> Result<IpNet, String> {
    match s.trim().parse::<IpNet>() {
        Ok(IpNet::V6(v6)) if v6.prefix_len() >= 96 && v6.network().to_ipv4_mapped().is_some() => {
            let a = v6.network().to_ipv4_mapped().expect("checked");
            Ok(IpNet::V4(ipnet::Ipv4Net::new(a, v6.prefix_len() - 96).expect("length <= 32")).trunc())
        }
        Ok(n) => Ok(n.trunc()),
        Err(e) => Err(format!("invalid CIDR {s:?}: {e}")),
    }
}

/// Parses a CIDR ([`normalize_cidr`]), recording an error at `path`.
fn parse_cidr(ctx: &mut Ctx<'_>, path: &str, s: &str) -> Option<IpNet> {
    match normalize_cidr(s) {
        Ok(n) => Some(n),
        Err(e) => {
            ctx.err(path, e);
            None
        }
    }
}

/// Validates a label selector at `path` (the rules of NetworkPolicy
/// selectors): the selector, or every (field, message) wrong with it.
/// Shared with the ClusterNetworkPolicy validation.
pub(crate) fn check_selector(path: &str, sel: &LabelSelector) -> Result<Selector, Vec<(String, String)>> {
    let mut ctx = Ctx {
        object: "",
        errors: Vec::new(),
    };
    match selector(&mut ctx, path, sel) {
        Some(s) => Ok(s),
        None => Err(ctx.errors.into_iter().map(|e| (e.field, e.message)).collect()),
    }
}

/// True when `inner` is a strict subset of `outer`.
pub fn strict_subset(inner: &IpNet, outer: &IpNet) -> bool {
    match (inner, outer) {
        (IpNet::V4(i), IpNet::V4(o)) => i.prefix_len() > o.prefix_len() && o.contains(&i.network()),
        (IpNet::V6(i), IpNet::V6(o)) => i.prefix_len() > o.prefix_len() && o.contains(&i.network()),
        _ => false,
    }
}

fn peer(ctx: &mut Ctx<'_>, path: &str, p: &netv1::NetworkPolicyPeer) -> Option<Peer> {
    let before = ctx.errors.len();
    let n = p.pod_selector.is_some() as u8 + p.namespace_selector.is_some() as u8 + p.ip_block.is_some() as u8;
    if n == 0 {
        ctx.err(
            path,
            "empty peer {}: must specify a peer: podSelector, namespaceSelector or ipBlock",
        );
        return None;
    }
    if let Some(b) = p.ip_block.as_ref().filter(|_| n > 1) {
        ctx.err(
            path,
            format!(
                "ipBlock {:?} may not be specified together with podSelector or namespaceSelector",
                b.cidr
            ),
        );
        return None;
    }
    if let Some(b) = &p.ip_block {
        let bp = format!("{path}.ipBlock");
        let cidr = parse_cidr(ctx, &format!("{bp}.cidr"), &b.cidr);
        let mut except = Vec::new();
        for (i, e) in b.except.iter().flatten().enumerate() {
            let ep = format!("{bp}.except[{i}]");
            if let Some(en) = parse_cidr(ctx, &ep, e) {
                if let Some(c) = &cidr {
                    if !strict_subset(&en, c) {
                        ctx.err(&ep, format!("{e:?} must be a strict subset of cidr {:?}", b.cidr));
                    }
                }
                except.push(en);
            }
        }
        return (ctx.errors.len() == before)
            .then(|| IpBlock {
                cidr: cidr.expect("valid when no error"),
                except,
            })
            .map(Peer::IpBlock);
    }
    let pods = p
        .pod_selector
        .as_ref()
        .map(|s| selector(ctx, &format!("{path}.podSelector"), s));
    let nss = p
        .namespace_selector
        .as_ref()
        .map(|s| selector(ctx, &format!("{path}.namespaceSelector"), s));
    match (pods, nss) {
        (Some(Some(pods)), None) => Some(Peer::Pods(pods)),
        (None, Some(Some(ns))) => Some(Peer::Namespaces(ns)),
        (Some(Some(pods)), Some(Some(namespaces))) => Some(Peer::PodsInNamespaces { namespaces, pods }),
        _ => None,
    }
}

/// True for an IANA service name as the API requires of named ports: at most
/// 15 characters, lower-case alphanumerics and '-', at least one letter, no
/// leading, trailing or double '-'.
pub fn is_port_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 15
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && s.bytes().any(|b| b.is_ascii_lowercase())
        && !s.starts_with('-')
        && !s.ends_with('-')
        && !s.contains("--")
}

/// Parses a protocol name as the API spells it.
pub fn parse_protocol(s: &str) -> Option<Protocol> {
    match s {
        "TCP" => Some(Protocol::Tcp),
        "UDP" => Some(Protocol::Udp),
        "SCTP" => Some(Protocol::Sctp),
        _ => None,
    }
}

fn port(ctx: &mut Ctx<'_>, path: &str, p: &netv1::NetworkPolicyPort) -> Option<Port> {
    let before = ctx.errors.len();
    let protocol = match p.protocol.as_deref() {
        None => Protocol::Tcp,
        Some(s) => parse_protocol(s).unwrap_or_else(|| {
            ctx.err(
                format!("{path}.protocol"),
                format!("unsupported protocol {s:?}: must be TCP, UDP or SCTP"),
            );
            Protocol::Tcp
        }),
    };
    let spec = match (&p.port, p.end_port) {
        (None, None) => PortSpec::All,
        (None, Some(e)) => {
            ctx.err(
                format!("{path}.endPort"),
                format!("endPort {e} may not be specified when port is not specified"),
            );
            PortSpec::All
        }
        (Some(IntOrString::Int(n)), end) => {
            let n = *n;
            if !(1..=65535).contains(&n) {
                ctx.err(
                    format!("{path}.port"),
                    format!("{n} must be between 1 and 65535, inclusive"),
                );
            }
            let e = end.unwrap_or(n);
            if end.is_some() && !(1..=65535).contains(&e) {
                ctx.err(
                    format!("{path}.endPort"),
                    format!("{e} must be between 1 and 65535, inclusive"),
                );
            } else if e < n {
                ctx.err(
                    format!("{path}.endPort"),
                    format!("{e} must be greater than or equal to port {n}"),
                );
            }
            PortSpec::Range(n.clamp(0, 65535) as u16, e.clamp(0, 65535) as u16)
        }
        (Some(IntOrString::String(name)), end) => {
            if !is_port_name(name) {
                ctx.err(
                    format!("{path}.port"),
                    format!("{name:?} is not a valid port name (IANA_SVC_NAME)"),
                );
            }
            if let Some(e) = end {
                ctx.err(
                    format!("{path}.endPort"),
                    format!("endPort {e} may not be specified when port is the named port {name:?}"),
                );
            }
            PortSpec::Named(name.clone())
        }
    };
    (ctx.errors.len() == before).then_some(Port { protocol, port: spec })
}

/// The ports and peers (`from` or `to`) of one API rule.
type RuleParts<'a> = (
    Option<&'a Vec<netv1::NetworkPolicyPort>>,
    Option<&'a Vec<netv1::NetworkPolicyPeer>>,
);

/// The rules of one direction, `spec.<direction>[i]`, whose peers are in
/// field `peer_field`; `parts` gives a rule's ports and peers. Rules that
/// cannot be understood are left out (see [`rule`]).
fn rules<'a, R>(
    ctx: &mut Ctx<'_>,
    direction: &str,
    peer_field: &str,
    list: Option<&'a Vec<R>>,
    parts: impl Fn(&'a R) -> RuleParts<'a>,
) -> Vec<Rule> {
    list.into_iter()
        .flatten()
        .enumerate()
        .filter_map(|(i, r)| {
            let (ports, peers) = parts(r);
            rule(ctx, &format!("spec.{direction}[{i}]"), peer_field, ports, peers)
        })
        .collect()
}

/// One rule, or `None` when it is dropped: a port that cannot be
/// understood drops the rule (without it the rule would allow other ports,
/// or every port once no port is left); a peer that cannot be understood
/// is dropped alone, unless no peer is left (an empty peer list allows
/// everyone), which drops the rule.
fn rule(
    ctx: &mut Ctx<'_>,
    path: &str,
    peer_field: &str,
    ports: Option<&Vec<netv1::NetworkPolicyPort>>,
    peers: Option<&Vec<netv1::NetworkPolicyPeer>>,
) -> Option<Rule> {
    let before = ctx.errors.len();
    let mut r = Rule::default();
    let mut port_error = false;
    for (i, p) in ports.into_iter().flatten().enumerate() {
        match port(ctx, &format!("{path}.ports[{i}]"), p) {
            Some(p) => r.ports.push(p),
            None => port_error = true,
        }
    }
    let given = peers.map_or(0, Vec::len);
    for (i, p) in peers.into_iter().flatten().enumerate() {
        let peer_path = format!("{path}.{peer_field}[{i}]");
        let from = ctx.errors.len();
        match peer(ctx, &peer_path, p) {
            Some(p) => r.peers.push(p),
            None => ctx.since(from, &Consequence::PeerDropped(peer_path)),
        }
    }
    if port_error || (given > 0 && r.peers.is_empty()) {
        ctx.since(before, &Consequence::RuleDropped(path.to_string()));
        return None;
    }
    Some(r)
}

/// A NetworkPolicy as far as it is understood, and what is not (see the
/// module doc): `problems` is empty for a valid policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyConversion {
    /// The defaulted policy without the parts that cannot be understood;
    /// it keeps isolating the pods it selects.
    pub policy: Policy,
    /// Every error, each naming the field, the value and what was dropped.
    pub problems: Vec<FieldError>,
    /// The policy as far as it is understood when it is audited
    /// (`npm.io/audit: "true"`, see [`crate::audit`]); `policy` is then its
    /// enforced form, which selects no pod.
    pub audited: Option<Policy>,
}

impl PolicyConversion {
    /// The policy's report when it has problems (its errors as text, each
    /// naming the object, the field, the value and the consequence).
    pub fn invalid(&self) -> Option<InvalidPolicy> {
        (!self.problems.is_empty()).then(|| InvalidPolicy {
            namespace: self.policy.namespace.clone(),
            name: self.policy.name.clone(),
            errors: self.problems.iter().map(|e| e.to_string()).collect(),
        })
    }
}

/// Defaults and converts a NetworkPolicy as far as it is understood (see
/// the module doc for what is dropped). The namespace defaults to
/// `default` when the object has none (raw YAML). An audited policy
/// (`npm.io/audit: "true"`) comes back as its enforced form, which selects
/// no pod, with the converted policy in `audited` ([`crate::audit`]).
pub fn convert_policy(np: &netv1::NetworkPolicy) -> PolicyConversion {
    let namespace = np.metadata.namespace.clone().unwrap_or_else(|| "default".to_string());
    let name = np.metadata.name.clone().unwrap_or_default();
    let object = format!("{namespace}/{name}");
    let mut ctx = Ctx {
        object: &object,
        errors: Vec::new(),
    };
    if name.is_empty() {
        ctx.err("metadata.name", "name \"\" must not be empty");
    }
    let spec = np.spec.clone().unwrap_or_default();
    let from = ctx.errors.len();
    let pod_selector = match &spec.pod_selector {
        Some(s) => selector(&mut ctx, "spec.podSelector", s).unwrap_or_else(|| {
            ctx.since(from, &Consequence::SelectsNothing);
            Selector::nothing()
        }),
        None => Selector::default(),
    };
    let types = spec.policy_types.clone().unwrap_or_default();
    let (mut ing, mut eg) = (false, false);
    if types.is_empty() {
        ing = true;
        eg = spec.egress.as_ref().is_some_and(|e| !e.is_empty());
    } else {
        if types.len() > 2 {
            ctx.err(
                "spec.policyTypes",
                format!("{types:?} may not have more than 2 entries, has {}", types.len()),
            );
        }
        for (i, t) in types.iter().enumerate() {
            match t.as_str() {
                "Ingress" => ing = true,
                "Egress" => eg = true,
                other => {
                    // Which direction was meant is unknown: both.
                    ctx.err(
                        format!("spec.policyTypes[{i}]"),
                        format!("unsupported value {other:?}: must be Ingress or Egress"),
                    );
                    ctx.since(ctx.errors.len() - 1, &Consequence::BothDirections);
                    (ing, eg) = (true, true);
                }
            }
        }
    }
    let ingress = rules(&mut ctx, "ingress", "from", spec.ingress.as_ref(), |r| {
        (r.ports.as_ref(), r.from.as_ref())
    });
    let egress = rules(&mut ctx, "egress", "to", spec.egress.as_ref(), |r| {
        (r.ports.as_ref(), r.to.as_ref())
    });
    let policy = Policy {
        namespace,
        name,
        pod_selector,
        ingress_isolation: ing,
        egress_isolation: eg,
        ingress,
        egress,
    };
    // Audit mode: the one point where an audited policy is kept out of
    // enforcement; a bad value is reported and the policy enforced.
    let audit = crate::audit::audit_annotation(&np.metadata).unwrap_or_else(|e| {
        ctx.err(crate::audit::AUDIT_FIELD, e.to_string());
        false
    });
    let (policy, audited) = match audit {
        true => (crate::audit::enforced_form(&policy), Some(policy)),
        false => (policy, None),
    };
    PolicyConversion {
        policy,
        problems: ctx.errors,
        audited,
    }
}

/// Defaults and validates a NetworkPolicy strictly: the policy when it is
/// fully understood, else every error ([`convert_policy`] gives the part
/// that is understood).
pub fn validate_policy(np: &netv1::NetworkPolicy) -> Result<Policy, InvalidPolicy> {
    let c = convert_policy(np);
    match c.invalid() {
        Some(e) => Err(e),
        None => Ok(c.policy),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_keys_and_values_follow_the_api_rules() {
        for ok in [
            "app",
            "a",
            "app.kubernetes.io/name",
            "x-y_z.w",
            "example.com/A9",
            &"a".repeat(63),
        ] {
            assert!(valid_label_key(ok), "{ok:?}");
        }
        for bad in [
            "",
            "Bad Key!",
            "-app",
            "app-",
            "/app",
            "Example.com/app",
            "a..b/c",
            "a/b/c",
            &"a".repeat(64),
        ] {
            assert!(!valid_label_key(bad), "{bad:?}");
        }
        assert!(valid_label_name("", true));
        assert!(!valid_label_name("not a value!", true));
        assert!(!valid_label_name(&"v".repeat(64), true));
    }
}
