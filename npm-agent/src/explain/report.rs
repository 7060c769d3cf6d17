//! The explain report: both directions of a flow decided on the state the
//! sync loop last programmed (`npm_policy::lookup` over its compiled form),
//! named, with the reference evaluator's text, and the kernel's dry-run
//! verdict.

use std::net::IpAddr;

use npm_common::Reason;
use npm_dataplane::ebpf::explain::KernelVerdict;
use npm_policy::compiled::{Compiled, Direction, RuleRef, TierAction, TierValue};
use npm_policy::evaluate::{evaluate, EndVerdict, Flow};
use npm_policy::lookup::LookupResult;
use npm_policy::model::{Protocol, Snapshot};
use serde::{Deserialize, Serialize};

use super::programmed::Programmed;
use super::{ExplainConfig, ExplainError, ExplainQuery, KernelView};

/// A policy rule (or an isolating policy) that took part in a decision.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PolicyRef {
    /// `NetworkPolicy` or `ClusterNetworkPolicy`.
    pub kind: String,
    /// Namespace (`None` for a ClusterNetworkPolicy).
    pub namespace: Option<String>,
    /// Name.
    pub name: String,
    /// The rule (`ingress[0]`, `egress[2]`); `None` for a policy that only
    /// isolates the pod.
    pub rule: Option<String>,
    /// `ingress` or `egress`, from the decided endpoint.
    pub direction: String,
    /// `allow` (a NetworkPolicy rule), `isolates` (selects the pod and no
    /// rule of it allows), or the tier rule's action: `Accept`, `Deny`,
    /// `Pass`.
    pub effect: String,
    /// The tier of a ClusterNetworkPolicy (`Admin`, `Baseline`).
    pub tier: Option<String>,
    /// A ClusterNetworkPolicy's priority in its tier.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<u32>,
    /// The `name` of a ClusterNetworkPolicy rule, when it has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rule_name: Option<String>,
}

/// The kernel's verdict of one hook.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct KernelReport {
    /// `allow` or `deny`.
    pub verdict: String,
    /// The datapath's reason (`Policy`, `PolicyDenied`, `AdminDeny`, …).
    pub reason: String,
    /// The attached program that ran.
    pub program_id: u32,
    /// The host-side interface.
    pub ifindex: u32,
}

impl KernelReport {
    /// The kernel verdict that stands for a flow's `directions`: the first
    /// deny, else the first verdict.
    pub fn of_flow(directions: &[DirectionReport]) -> Option<KernelReport> {
        let kernels: Vec<&KernelReport> = directions.iter().filter_map(|d| d.kernel.as_ref()).collect();
        kernels
            .iter()
            .find(|k| k.verdict == "deny")
            .or(kernels.first())
            .map(|k| (*k).clone())
    }
}

/// One direction of the flow.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DirectionReport {
    /// `egress` (of the sender) or `ingress` (of the receiver).
    pub direction: String,
    /// The pod at this end (`namespace/name`), if any.
    pub pod: Option<String>,
    /// Whether this node decides it (a local endpoint).
    pub local: bool,
    /// The local endpoint's id (local endpoints only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<u32>,
    /// The local endpoint's policy subject: its pod identity, the key of
    /// the NetworkPolicy entries that govern it (shared by the endpoints
    /// of that identity; local endpoints only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subject: Option<u32>,
    /// The pod's node, when it is a pod.
    pub node: Option<String>,
    /// `allow` or `deny` (the agent's view: the compiled lookup; for a
    /// direction decided elsewhere, the reference evaluator's).
    pub verdict: String,
    /// The compiled lookup's reason (local endpoints).
    pub reason: Option<String>,
    /// One line as `npmctl explain` prints it (the reference evaluator).
    pub text: String,
    /// The rules and policies that decided it.
    pub policies: Vec<PolicyRef>,
    /// The kernel's verdict (`None`: not local, nftables, or failed).
    pub kernel: Option<KernelReport>,
    /// Why there is no kernel verdict for a local endpoint on eBPF.
    pub kernel_error: Option<String>,
    /// The disagreement of the agent and the kernel, if any.
    pub mismatch: Option<String>,
}

/// The answer of `GET /explain`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExplainReport {
    /// `allow` when both directions allow.
    pub verdict: String,
    /// Source address.
    pub from: IpAddr,
    /// Destination address.
    pub to: IpAddr,
    /// `TCP`, `UDP` or `SCTP`.
    pub protocol: String,
    /// Destination port.
    pub port: u16,
    /// The rules and policies of both directions.
    pub policies: Vec<PolicyRef>,
    /// The kernel's verdict over the local hooks (`deny` if one denies);
    /// `null` when no hook ran (nftables, or no local endpoint).
    pub kernel: Option<KernelReport>,
    /// The first disagreement of agent and kernel.
    pub mismatch: Option<String>,
    /// Sender's egress, then receiver's ingress.
    pub directions: Vec<DirectionReport>,
}

impl ExplainReport {
    /// The report of a flow from its two directions (sender's egress,
    /// receiver's ingress): `allow` when both allow, their policies, the
    /// kernel's verdict over them ([`KernelReport::of_flow`]) and the first
    /// mismatch.
    pub fn of_directions(
        (from, to): (IpAddr, IpAddr),
        protocol: String,
        port: u16,
        directions: Vec<DirectionReport>,
    ) -> ExplainReport {
        ExplainReport {
            verdict: verdict(directions.iter().all(|d| d.verdict == "allow")),
            from,
            to,
            protocol,
            port,
            policies: directions.iter().flat_map(|d| d.policies.clone()).collect(),
            kernel: KernelReport::of_flow(&directions),
            mismatch: directions.iter().find_map(|d| d.mismatch.clone()),
            directions,
        }
    }
}

fn verdict(allowed: bool) -> String {
    if allowed { "allow" } else { "deny" }.into()
}

fn reason_name(r: Reason) -> String {
    format!("{r:?}")
}

/// Resolves `NAMESPACE/POD` or an address; `family` picks the pod address
/// of that family (`Some(true)`: IPv6) when the other end is an address.
fn resolve(snapshot: &Snapshot, arg: &'static str, value: &str, v6: Option<bool>) -> Result<IpAddr, ExplainError> {
    if let Ok(ip) = value.parse::<IpAddr>() {
        return Ok(ip);
    }
    let Some((ns, name)) = value.split_once('/') else {
        return Err(ExplainError::BadEndpoint {
            arg,
            value: value.into(),
        });
    };
    let no_pod = || ExplainError::NoPod { arg, pod: value.into() };
    let pod = snapshot
        .pods
        .get(&(ns.to_string(), name.to_string()))
        .ok_or_else(no_pod)?;
    pod.ips
        .iter()
        .copied()
        .find(|ip| v6.is_none_or(|v6| ip.is_ipv6() == v6))
        .ok_or_else(no_pod)
}

/// The named rules of a compiled lookup result.
/// A ClusterNetworkPolicy's priority and rule names come from the
/// `snapshot` the state was compiled from.
fn named(
    compiled: &Compiled,
    snapshot: &Snapshot,
    dir: Direction,
    admin: Option<TierValue>,
    rule: Option<u32>,
) -> Vec<PolicyRef> {
    let mut out = Vec::new();
    let tier_ref = |v: TierValue| match compiled.ids.rules.get(&v.rule) {
        Some(RuleRef::Cluster { tier, name, index, .. }) => {
            let policy = snapshot.cluster_policies.get(name);
            Some(PolicyRef {
                kind: "ClusterNetworkPolicy".into(),
                namespace: None,
                name: name.clone(),
                rule: Some(format!("{}[{index}]", dir.name())),
                direction: dir.name().into(),
                effect: format!("{:?}", v.action),
                tier: Some(tier.name().into()),
                priority: policy.map(|p| p.priority),
                rule_name: policy.and_then(|p| p.rules(dir).get(*index)?.name.clone()),
            })
        }
        _ => None,
    };
    // An Admin Pass that moved the decision on is part of it.
    if let Some(v) = admin.filter(|v| v.action == TierAction::Pass) {
        out.extend(tier_ref(v));
    }
    let Some(rule) = rule else {
        return out;
    };
    match compiled.ids.rules.get(&rule) {
        Some(RuleRef::Policy {
            namespace, name, index, ..
        }) => out.push(PolicyRef {
            kind: "NetworkPolicy".into(),
            namespace: Some(namespace.clone()),
            name: name.clone(),
            rule: Some(format!("{}[{index}]", dir.name())),
            direction: dir.name().into(),
            effect: "allow".into(),
            tier: None,
            priority: None,
            rule_name: None,
        }),
        Some(RuleRef::HostEgress) => out.push(PolicyRef {
            kind: "Setting".into(),
            namespace: None,
            name: "allow-host-egress".into(),
            rule: None,
            direction: dir.name().into(),
            effect: "allow".into(),
            tier: None,
            priority: None,
            rule_name: None,
        }),
        Some(RuleRef::Cluster { .. }) => {
            let v = compiled.tiers.values().find(|v| v.rule == rule).copied();
            out.extend(v.and_then(tier_ref));
        }
        None => {}
    }
    out
}

/// The policies isolating the pod (the evaluator's `selected_by`).
fn isolating(end: &EndVerdict) -> Vec<PolicyRef> {
    end.selected_by
        .iter()
        .map(|p| {
            let (ns, name) = p.split_once('/').unwrap_or(("", p));
            PolicyRef {
                kind: "NetworkPolicy".into(),
                namespace: Some(ns.into()),
                name: name.into(),
                rule: None,
                direction: end.direction.name().into(),
                effect: "isolates".into(),
                tier: None,
                priority: None,
                rule_name: None,
            }
        })
        .collect()
}

/// The disagreement of the compiled lookup `agent` and the kernel's
/// dry run `kernel` on `ifindex`, if their verdicts differ. A kernel
/// verdict from a tracked flow (`Tracked`, `Related`) is not compared:
/// policy decides new connections only.
pub(crate) fn mismatch(
    dir: Direction,
    pod: Option<&str>,
    agent: &LookupResult,
    kernel: &KernelVerdict,
    ifindex: u32,
) -> Option<String> {
    let tracked = matches!(kernel.reason, Some(Reason::Tracked | Reason::Related));
    if kernel.allowed == agent.allowed || tracked {
        return None;
    }
    let reason = kernel
        .reason
        .map_or_else(|| format!("reason {}", kernel.reason_code), reason_name);
    Some(format!(
        "MISMATCH on {} of {}: the agent says {} ({:?}), the kernel says {} ({reason}, program {}, ifindex {ifindex})",
        dir.name(),
        pod.unwrap_or("?"),
        verdict(agent.allowed),
        agent.reason,
        verdict(kernel.allowed),
        kernel.program_id
    ))
}

/// Explains the flow of `q` on the programmed state `programmed`
/// (blocking: on eBPF it runs the attached programs).
pub fn explain(cfg: &ExplainConfig, programmed: &Programmed, q: &ExplainQuery) -> Result<ExplainReport, ExplainError> {
    let protocol = match q.protocol.as_deref().unwrap_or("TCP").to_ascii_uppercase().as_str() {
        "TCP" => Protocol::Tcp,
        "UDP" => Protocol::Udp,
        "SCTP" => Protocol::Sctp,
        other => return Err(ExplainError::Protocol(other.into())),
    };
    let (snapshot, compiled, opts) = (&programmed.snapshot, &programmed.compiled, &programmed.options);
    let v6 = |s: &str| s.parse::<IpAddr>().ok().map(|ip| ip.is_ipv6());
    let src = resolve(snapshot, "from", &q.from, v6(&q.to))?;
    let dst = resolve(snapshot, "to", &q.to, Some(src.is_ipv6()))?;
    if src.is_ipv6() != dst.is_ipv6() {
        return Err(ExplainError::Family(src, dst));
    }
    let flow = Flow {
        src,
        dst,
        protocol: protocol.number(),
        dst_port: q.port,
    };
    let reference = evaluate(snapshot, opts, &flow);
    let mut directions = Vec::new();
    for (dir, end) in [
        (Direction::Egress, &reference.egress),
        (Direction::Ingress, &reference.ingress),
    ] {
        directions.push(direction(cfg, snapshot, compiled, dir, end, &flow));
    }
    let protocol = format!("{protocol:?}").to_ascii_uppercase();
    Ok(ExplainReport::of_directions((src, dst), protocol, q.port, directions))
}

/// One direction: the compiled lookup for a local endpoint (else the
/// reference evaluator's verdict, marked not local) and the kernel run;
/// this end is the source for egress, the destination for ingress.
fn direction(
    cfg: &ExplainConfig,
    snapshot: &Snapshot,
    compiled: &Compiled,
    dir: Direction,
    end: &EndVerdict,
    flow: &Flow,
) -> DirectionReport {
    let (me, peer) = match dir {
        Direction::Egress => (flow.src, flow.dst),
        Direction::Ingress => (flow.dst, flow.src),
    };
    let pod = end.pod.clone();
    let node = pod.as_ref().and_then(|p| {
        let (ns, name) = p.split_once('/')?;
        snapshot.pods.get(&(ns.into(), name.into()))?.node_name.clone()
    });
    let local = compiled.endpoints.iter().find(|(_, e)| {
        pod.as_deref() == Some(&format!("{}/{}", e.pod.namespace, e.pod.name))
            || e.ipv4.map(IpAddr::V4) == Some(me)
            || e.ipv6.map(IpAddr::V6) == Some(me)
    });
    let mut r = DirectionReport {
        direction: dir.name().into(),
        pod,
        local: local.is_some(),
        endpoint: local.map(|(id, _)| *id),
        subject: local.map(|(_, e)| e.identity),
        node,
        verdict: verdict(end.allowed),
        reason: None,
        text: end.to_string(),
        policies: Vec::new(),
        kernel: None,
        kernel_error: None,
        mismatch: None,
    };
    let Some((&ep, _)) = local else {
        if r.node.as_deref() == Some(cfg.node_name.as_str()) {
            // A pod of this node the last sync left out (its interface
            // was not found yet): nothing enforces its policy here yet.
            r.text = format!("{} (a pod of this node, not programmed yet)", r.text);
        } else if r.pod.is_some() {
            r.text = format!(
                "{} (decided on node {}, not here)",
                r.text,
                r.node.as_deref().unwrap_or("?")
            );
        }
        return r;
    };
    let res = npm_policy::lookup::lookup(compiled, ep, dir, peer, flow.protocol, flow.dst_port);
    r.verdict = verdict(res.allowed);
    r.reason = Some(reason_name(res.reason));
    r.policies = named(compiled, snapshot, dir, res.admin, res.rule);
    if res.reason == Reason::PolicyDenied {
        r.policies.extend(isolating(end));
    }
    let KernelView::Ebpf { pin_dir } = &cfg.kernel else {
        return r;
    };
    let run = npm_dataplane::ebpf::explain::endpoint_interface(pin_dir, me).and_then(|found| {
        let Some((ifindex, _)) = found else {
            return Ok(None);
        };
        let packet = npm_dataplane::ebpf::explain::crafted_packet(flow.src, flow.dst, flow.protocol, flow.dst_port)?;
        npm_dataplane::ebpf::explain::explain_run(pin_dir, ifindex, dir, &packet).map(|k| Some((ifindex, k)))
    });
    match run {
        Ok(Some((ifindex, k))) => {
            let reason = k
                .reason
                .map_or_else(|| format!("reason {}", k.reason_code), reason_name);
            r.mismatch = mismatch(dir, r.pod.as_deref(), &res, &k, ifindex);
            r.kernel = Some(KernelReport {
                verdict: verdict(k.allowed),
                reason,
                program_id: k.program_id,
                ifindex,
            });
        }
        Ok(None) => {
            r.kernel_error = Some(format!("no endpoint record for {me} in the kernel maps"));
            // Without a record the kernel enforces nothing on that pod.
            if !res.allowed {
                r.mismatch = Some(format!(
                    "MISMATCH on {} of {}: the agent says deny ({:?}), the kernel has no endpoint record for {me} (allows everything)",
                    dir.name(),
                    r.pod.as_deref().unwrap_or("?"),
                    res.reason
                ));
            }
        }
        Err(e) => r.kernel_error = Some(e.to_string()),
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::{IDENTITY_ANY, IDENTITY_WORLD};

    fn agent(allowed: bool, reason: Reason) -> LookupResult {
        LookupResult {
            allowed,
            reason,
            rule: None,
            admin: None,
            baseline: None,
            peer_identity: IDENTITY_WORLD,
            cidr_identity: IDENTITY_ANY,
        }
    }

    fn kernel(allowed: bool, reason: Reason) -> KernelVerdict {
        KernelVerdict {
            allowed,
            reason: Some(reason),
            reason_code: reason as u8,
            program_id: 7,
        }
    }

    #[test]
    fn a_verdict_disagreement_is_a_mismatch_a_tracked_flow_is_not() {
        let denied = agent(false, Reason::PolicyDenied);
        let m = mismatch(
            Direction::Ingress,
            Some("y/b"),
            &denied,
            &kernel(true, Reason::NotIsolated),
            9,
        )
        .expect("a mismatch");
        assert!(
            m.starts_with("MISMATCH on ingress of y/b: the agent says deny (PolicyDenied)"),
            "{m}"
        );
        assert!(
            m.contains("the kernel says allow (NotIsolated, program 7, ifindex 9)"),
            "{m}"
        );
        assert_eq!(
            mismatch(
                Direction::Ingress,
                None,
                &denied,
                &kernel(false, Reason::PolicyDenied),
                9
            ),
            None
        );
        assert_eq!(
            mismatch(Direction::Egress, None, &denied, &kernel(true, Reason::Tracked), 9),
            None
        );
        let allowed = agent(true, Reason::Policy);
        assert!(mismatch(Direction::Egress, None, &allowed, &kernel(false, Reason::AdminDeny), 9).is_some());
    }
}
