//! API defaulting and validation of a NetworkPolicy: k8s-openapi
//! `NetworkPolicy` -> [`Policy`], or an [`InvalidPolicy`] whose errors each
//! name the object and the field path.
//!
//! Defaulting (spec §2): "If `policyTypes` is non-empty, it is used as given
//! [...] If it is empty or absent, the API server sets it to `[Ingress]`, and
//! appends `Egress` only if `len(spec.egress) != 0`." and "NetworkPolicyPort
//! `protocol` defaults to `TCP`".

use std::fmt;

use ipnet::IpNet;
use k8s_openapi::api::networking::v1 as netv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;

use crate::model::{
    InvalidPolicy, IpBlock, Operator, Peer, Policy, Port, PortSpec, Protocol, Requirement, Rule, Selector,
};

/// One validation error: the object, the field path and what is wrong.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{object}: {field}: {message}")]
pub struct FieldError {
    /// `namespace/name` of the policy.
    pub object: String,
    /// Field path, e.g. `spec.ingress[0].from[1].ipBlock.except[0]`.
    pub field: String,
    /// What is wrong.
    pub message: String,
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
        });
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
    for (i, e) in sel.match_expressions.iter().flatten().enumerate() {
        let p = format!("{path}.matchExpressions[{i}]");
        if e.key.is_empty() {
            ctx.err(format!("{p}.key"), "must not be empty");
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
                format!("must be non-empty for operator {}", e.operator),
            ),
            Operator::Exists | Operator::DoesNotExist if !values.is_empty() => ctx.err(
                format!("{p}.values"),
                format!("must be empty for operator {}", e.operator),
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

/// Parses a CIDR, clearing host bits (the API accepts them).
fn parse_cidr(ctx: &mut Ctx<'_>, path: &str, s: &str) -> Option<IpNet> {
    match s.trim().parse::<IpNet>() {
        // An IPv4-mapped IPv6 prefix (`::ffff:a.b.c.d/96+n`) is the IPv4
        // prefix `a.b.c.d/n`: the datapath stores IPv4 mapped, so both
        // would be one kernel key.
        Ok(IpNet::V6(v6)) if v6.prefix_len() >= 96 && v6.network().to_ipv4_mapped().is_some() => {
            let a = v6.network().to_ipv4_mapped().expect("checked");
            Some(IpNet::V4(ipnet::Ipv4Net::new(a, v6.prefix_len() - 96).expect("length <= 32")).trunc())
        }
        Ok(n) => Some(n.trunc()),
        Err(e) => {
            ctx.err(path, format!("invalid CIDR {s:?}: {e}"));
            None
        }
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
        ctx.err(path, "must specify a peer: podSelector, namespaceSelector or ipBlock");
        return None;
    }
    if p.ip_block.is_some() && n > 1 {
        ctx.err(
            path,
            "may not specify ipBlock together with podSelector or namespaceSelector",
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
        (None, Some(_)) => {
            ctx.err(
                format!("{path}.endPort"),
                "may not be specified when port is not specified",
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
            if end.is_some() {
                ctx.err(
                    format!("{path}.endPort"),
                    "may not be specified when port is a named port",
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
/// field `peer_field`; `parts` gives a rule's ports and peers.
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
        .map(|(i, r)| {
            let (ports, peers) = parts(r);
            rule(ctx, &format!("spec.{direction}[{i}]"), peer_field, ports, peers)
        })
        .collect()
}

fn rule(
    ctx: &mut Ctx<'_>,
    path: &str,
    peer_field: &str,
    ports: Option<&Vec<netv1::NetworkPolicyPort>>,
    peers: Option<&Vec<netv1::NetworkPolicyPeer>>,
) -> Rule {
    let mut r = Rule::default();
    for (i, p) in ports.into_iter().flatten().enumerate() {
        if let Some(p) = port(ctx, &format!("{path}.ports[{i}]"), p) {
            r.ports.push(p);
        }
    }
    for (i, p) in peers.into_iter().flatten().enumerate() {
        if let Some(p) = peer(ctx, &format!("{path}.{peer_field}[{i}]"), p) {
            r.peers.push(p);
        }
    }
    r
}

/// Defaults and validates a NetworkPolicy. The namespace defaults to
/// `default` when the object has none (raw YAML).
pub fn validate_policy(np: &netv1::NetworkPolicy) -> Result<Policy, InvalidPolicy> {
    let namespace = np.metadata.namespace.clone().unwrap_or_else(|| "default".to_string());
    let name = np.metadata.name.clone().unwrap_or_default();
    let object = format!("{namespace}/{name}");
    let mut ctx = Ctx {
        object: &object,
        errors: Vec::new(),
    };
    if name.is_empty() {
        ctx.err("metadata.name", "must not be empty");
    }
    let spec = np.spec.clone().unwrap_or_default();
    let pod_selector = match &spec.pod_selector {
        Some(s) => selector(&mut ctx, "spec.podSelector", s).unwrap_or_default(),
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
                format!("may not have more than 2 entries, has {}", types.len()),
            );
        }
        for (i, t) in types.iter().enumerate() {
            match t.as_str() {
                "Ingress" => ing = true,
                "Egress" => eg = true,
                other => ctx.err(
                    format!("spec.policyTypes[{i}]"),
                    format!("unsupported value {other:?}: must be Ingress or Egress"),
                ),
            }
        }
    }
    let ingress = rules(&mut ctx, "ingress", "from", spec.ingress.as_ref(), |r| {
        (r.ports.as_ref(), r.from.as_ref())
    });
    let egress = rules(&mut ctx, "egress", "to", spec.egress.as_ref(), |r| {
        (r.ports.as_ref(), r.to.as_ref())
    });
    if !ctx.errors.is_empty() {
        return Err(InvalidPolicy {
            namespace,
            name,
            errors: ctx.errors.iter().map(|e| e.to_string()).collect(),
        });
    }
    Ok(Policy {
        namespace,
        name,
        pod_selector,
        ingress_isolation: ing,
        egress_isolation: eg,
        ingress,
        egress,
    })
}
