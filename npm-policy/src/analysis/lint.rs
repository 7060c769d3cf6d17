//! `npmctl lint`: findings about the policies of a snapshot, each naming
//! the objects and rules, with a severity.
//!
//! The ClusterNetworkPolicy findings come from deciding every probe of
//! [`Universe`] (every pod as subject, against every pod, node address,
//! address region and port run) with the reference evaluator's own rule
//! matching, in the evaluator's order:
//!
//! - **shadowed-rule**: a CNP rule that matches flows but decides none of
//!   them: an earlier rule of its tier (an earlier rule of the same CNP, or
//!   a CNP checked first: lower priority, or equal priority and a smaller
//!   name), or, for a Baseline rule, the Admin tier or a NetworkPolicy
//!   isolating the pod, decides each first. `warning`; `info` when every
//!   shadowing rule has the same action (the rule is only redundant).
//! - **rule-matches-nothing**: a CNP rule no probe matches (`warning`).
//! - **equal-priority-overlap**: two CNPs of one tier with the same
//!   priority whose rules both match a flow their tier reaches; the API
//!   leaves their order undefined (npm takes name order). `error` when
//!   their actions differ, `info` when the same.
//! - **pass-no-effect**: a Pass rule whose every flow ends with the same
//!   verdict as without the rule (`info`).
//! - **selects-no-pod**: a NetworkPolicy or CNP that selects no pod
//!   (`warning`).
//! - **peer-matches-nothing**: a pod or namespace peer (or a CNP `nodes`
//!   peer) that matches no pod (node) of the objects (`warning`).
//! - **named-port-undefined**: a named port that no pod the rule can reach
//!   defines with that protocol (`warning`).
//! - **invalid**: a policy not fully understood (`error`; enforced failing
//!   closed, see [`crate::validate`]).
//!
//! Findings are about the objects given: a selector that matches no pod
//! today may match one tomorrow.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use serde::Serialize;

use super::universe::{live_pods, protocol_name, ProbeEnd, Universe};
use crate::audit::is_enforced_form;
use crate::compile::policy_selects;
use crate::compiled::{CompileOptions, Direction, Tier, TierAction};
use crate::evaluate::{evaluate_direction_with_peer, peer_matches};
use crate::model::{Peer, Pod, PortSpec, Protocol, Rule, Snapshot};
use crate::tiers::evaluate::{rule_matches, selects, End};
use crate::tiers::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule};

/// How bad a finding is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Severity {
    /// The policies do not do what they say, or differ across
    /// implementations.
    Error,
    /// Probably a mistake.
    Warning,
    /// Worth knowing; harmless.
    Info,
}

impl Severity {
    /// Lower case name.
    pub fn name(self) -> &'static str {
        match self {
            Severity::Error => "error",
            Severity::Warning => "warning",
            Severity::Info => "info",
        }
    }
}

/// One finding.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
pub struct Finding {
    /// Severity.
    pub severity: Severity,
    /// The kind (`shadowed-rule`, ...; see the module documentation).
    pub kind: &'static str,
    /// The object and rule the finding is about, e.g.
    /// `clusternetworkpolicy/x ingress[1] "allow-web"`.
    pub object: String,
    /// The other objects and rules involved.
    pub related: Vec<String>,
    /// What is wrong, in words.
    pub message: String,
}

impl fmt::Display for Finding {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}: {} {}: {}",
            self.severity.name(),
            self.kind,
            self.object,
            self.message
        )?;
        for r in &self.related {
            write!(f, "\n    {r}")?;
        }
        Ok(())
    }
}

/// A CNP rule's name in findings: `clusternetworkpolicy/NAME ingress[i] "rule"`.
fn cnp_rule(p: &ClusterPolicy, dir: Direction, i: usize) -> String {
    let r = &p.rules(dir)[i];
    let mut s = format!("clusternetworkpolicy/{} {}[{i}]", p.name, dir.name());
    if let Some(n) = &r.name {
        s.push_str(&format!(" {n:?}"));
    }
    s
}

/// A CNP rule with its tier, priority and action, for `related`.
fn cnp_rule_long(p: &ClusterPolicy, dir: Direction, i: usize) -> String {
    format!(
        "{} ({} tier, priority {}, {:?})",
        cnp_rule(p, dir, i),
        p.tier.name(),
        p.priority,
        p.rules(dir)[i].action
    )
}

fn np_name(p: &crate::model::Policy) -> String {
    format!("networkpolicy/{}/{}", p.namespace, p.name)
}

/// What decided a probe before a shadowed rule.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
enum Shadower {
    /// A CNP rule (policy name, direction, index) with its action.
    Rule(String, Direction, usize, TierAction),
    /// A NetworkPolicy isolating the pod (Baseline rules only).
    NetworkPolicy(String),
    /// Ingress from the pod's node, always allowed.
    Node,
}

#[derive(Default)]
struct RuleStats {
    matched: bool,
    decided: bool,
    shadowers: BTreeSet<Shadower>,
    /// A Pass rule: reached, and the verdict differs without it somewhere.
    pass_reached: bool,
    pass_changes: bool,
    example: Option<String>,
}

type RuleKey = (String, Direction, usize);

/// Two equal-priority CNPs of one tier matching one flow: the pairs of
/// their first matching rules, whether some pair's actions differ, an
/// example flow.
type Overlap = (BTreeSet<(String, String)>, bool, String);

/// The findings about `snapshot`, sorted by severity, kind and object.
pub fn lint(snapshot: &Snapshot, opts: &CompileOptions) -> Vec<Finding> {
    let mut out = Vec::new();
    invalid(snapshot, &mut out);
    let mut static_rules: BTreeSet<RuleKey> = BTreeSet::new();
    network_policies(snapshot, &mut out);
    cluster_static(snapshot, &mut out, &mut static_rules);
    cluster_dynamic(snapshot, opts, &mut out, &static_rules);
    out.sort();
    out.dedup();
    out
}

fn invalid(snapshot: &Snapshot, out: &mut Vec<Finding>) {
    for p in &snapshot.invalid_policies {
        out.push(Finding {
            severity: Severity::Error,
            kind: "invalid",
            object: format!("networkpolicy/{}/{}", p.namespace, p.name),
            related: p.errors.clone(),
            message: "not fully understood: enforced without the parts that cannot be understood".into(),
        });
    }
    for p in &snapshot.invalid_cluster_policies {
        out.push(Finding {
            severity: Severity::Error,
            kind: "invalid",
            object: format!("clusternetworkpolicy/{}", p.name),
            related: p.errors.clone(),
            message: "not fully understood: enforced failing closed where it cannot be understood".into(),
        });
    }
}

/// Does some pod of `pods` define container port `name` with `protocol`?
fn defines<'a>(mut pods: impl Iterator<Item = &'a Pod>, name: &str, protocol: Option<Protocol>) -> bool {
    pods.any(|p| {
        p.ports
            .iter()
            .any(|c| c.name.as_deref() == Some(name) && protocol.is_none_or(|pr| pr == c.protocol))
    })
}

fn network_policies(snapshot: &Snapshot, out: &mut Vec<Finding>) {
    let pods: Vec<&Pod> = live_pods(snapshot).filter(|p| !p.host_network).collect();
    for p in snapshot.policies.values().filter(|p| !is_enforced_form(p)) {
        let selected: Vec<&Pod> = pods.iter().copied().filter(|pod| policy_selects(p, pod)).collect();
        if selected.is_empty() {
            out.push(Finding {
                severity: Severity::Warning,
                kind: "selects-no-pod",
                object: np_name(p),
                related: vec![],
                message: format!(
                    "its podSelector matches no pod of namespace {}: it isolates nothing",
                    p.namespace
                ),
            });
        }
        for (dir, rules) in [(Direction::Ingress, &p.ingress), (Direction::Egress, &p.egress)] {
            for (i, rule) in rules.iter().enumerate() {
                let rule_name = format!("{} {}[{i}]", np_name(p), dir.name());
                let matched = |peer: &Peer| pods.iter().any(|q| peer_matches(snapshot, p, peer, q.ips[0], Some(*q)));
                let dead: Vec<usize> = rule
                    .peers
                    .iter()
                    .enumerate()
                    .filter(|(_, peer)| !matches!(peer, Peer::IpBlock(_)) && !matched(peer))
                    .map(|(j, _)| j)
                    .collect();
                for j in &dead {
                    let all = dead.len() == rule.peers.len();
                    out.push(Finding {
                        severity: Severity::Warning,
                        kind: "peer-matches-nothing",
                        object: format!("{rule_name} peer[{j}]"),
                        related: vec![],
                        message: if all {
                            "matches no pod of the objects (no peer of the rule does: the rule allows nothing)".into()
                        } else {
                            "matches no pod of the objects".into()
                        },
                    });
                }
                named_ports_np(snapshot, p, rule, dir, &selected, &pods, &rule_name, out);
            }
        }
    }
}

#[allow(clippy::too_many_arguments)] // one call site; the pieces of one rule
fn named_ports_np(
    snapshot: &Snapshot,
    p: &crate::model::Policy,
    rule: &Rule,
    dir: Direction,
    selected: &[&Pod],
    pods: &[&Pod],
    rule_name: &str,
    out: &mut Vec<Finding>,
) {
    for (k, port) in rule.ports.iter().enumerate() {
        let PortSpec::Named(name) = &port.port else { continue };
        let ok = match dir {
            // Resolved against the selected pod (none selected: reported
            // as selects-no-pod already).
            Direction::Ingress => selected.is_empty() || defines(selected.iter().copied(), name, Some(port.protocol)),
            // Resolved against the peer pod a pod or namespace peer selects.
            Direction::Egress => defines(
                pods.iter().copied().filter(|q| {
                    rule.peers.is_empty()
                        || rule.peers.iter().any(|pe| {
                            !matches!(pe, Peer::IpBlock(_)) && peer_matches(snapshot, p, pe, q.ips[0], Some(*q))
                        })
                }),
                name,
                Some(port.protocol),
            ),
        };
        if !ok {
            out.push(Finding {
                severity: Severity::Warning,
                kind: "named-port-undefined",
                object: format!("{rule_name} ports[{k}]"),
                related: vec![],
                message: format!(
                    "no {} pod defines a {} container port named {name:?}: it matches nothing",
                    if dir == Direction::Ingress { "selected" } else { "peer" },
                    protocol_name(port.protocol.number())
                ),
            });
        }
    }
}

fn cluster_static(snapshot: &Snapshot, out: &mut Vec<Finding>, static_rules: &mut BTreeSet<RuleKey>) {
    let pods: Vec<&Pod> = live_pods(snapshot).filter(|p| !p.host_network).collect();
    for c in snapshot.cluster_policies.values() {
        let subjects: Vec<&Pod> = pods.iter().copied().filter(|p| selects(snapshot, c, p)).collect();
        if subjects.is_empty() {
            out.push(Finding {
                severity: Severity::Warning,
                kind: "selects-no-pod",
                object: format!("clusternetworkpolicy/{}", c.name),
                related: vec![],
                message: "its subject matches no pod: it applies to nothing".into(),
            });
            // Its rules match nothing for that reason alone: not reported
            // again one by one.
            for dir in [Direction::Ingress, Direction::Egress] {
                for i in 0..c.rules(dir).len() {
                    static_rules.insert((c.name.clone(), dir, i));
                }
            }
        }
        for dir in [Direction::Ingress, Direction::Egress] {
            for (i, rule) in c.rules(dir).iter().enumerate() {
                let name = cnp_rule(c, dir, i);
                let pod_matches = |peer: &ClusterPeer, q: &Pod| {
                    crate::tiers::evaluate::peer_matches(snapshot, peer, End::new(q.ips[0], Some(q)))
                };
                let mut dead = Vec::new();
                for (j, peer) in rule.peers.iter().enumerate() {
                    let live = match peer {
                        ClusterPeer::Namespaces(_) | ClusterPeer::Pods { .. } => {
                            pods.iter().any(|q| pod_matches(peer, q))
                        }
                        ClusterPeer::Nodes(sel) => snapshot.nodes.values().any(|n| sel.matches(&n.labels)),
                        _ => true,
                    };
                    if !live {
                        dead.push(j);
                    }
                }
                for j in &dead {
                    out.push(Finding {
                        severity: Severity::Warning,
                        kind: "peer-matches-nothing",
                        object: format!("{name} peer[{j}]"),
                        related: vec![],
                        message: "matches no pod or node of the objects".into(),
                    });
                    static_rules.insert((c.name.clone(), dir, i));
                }
                for (k, port) in rule.ports.iter().enumerate() {
                    let ClusterPort::Named(pname) = port else { continue };
                    let ok = match dir {
                        Direction::Ingress => subjects.is_empty() || defines(subjects.iter().copied(), pname, None),
                        Direction::Egress => defines(
                            pods.iter().copied().filter(|q| {
                                rule.peers.iter().any(|pe| {
                                    matches!(
                                        pe,
                                        ClusterPeer::Namespaces(_) | ClusterPeer::Pods { .. } | ClusterPeer::All
                                    ) && pod_matches(pe, q)
                                })
                            }),
                            pname,
                            None,
                        ),
                    };
                    if !ok {
                        out.push(Finding {
                            severity: Severity::Warning,
                            kind: "named-port-undefined",
                            object: format!("{name} protocols[{k}]"),
                            related: vec![],
                            message: format!(
                                "no {} pod defines a container port named {pname:?}: it matches nothing",
                                if dir == Direction::Ingress { "subject" } else { "peer" }
                            ),
                        });
                        static_rules.insert((c.name.clone(), dir, i));
                    }
                }
            }
        }
    }
}

/// A rule of a tier, in the evaluator's order, for one subject pod.
struct Ordered<'a> {
    policy: &'a ClusterPolicy,
    index: usize,
    rule: &'a ClusterRule,
}

/// The CNPs of `tier` selecting `pod`, in the evaluator's order.
fn tier_policies<'a>(snapshot: &'a Snapshot, tier: Tier, pod: &Pod) -> Vec<&'a ClusterPolicy> {
    let mut v: Vec<&ClusterPolicy> = snapshot
        .cluster_policies
        .values()
        .filter(|p| p.tier == tier && selects(snapshot, p, pod))
        .collect();
    v.sort_by(|a, b| a.priority.cmp(&b.priority).then_with(|| a.name.cmp(&b.name)));
    v
}

/// The pods and ends the walk needs: one pod per (namespace, labels,
/// container ports), the subject side's whole input; and the probe ends
/// in classes decided alike as peers: pods by (namespace, labels,
/// container ports, the policy CIDRs holding the address), at most two
/// members each (one besides a subject of the class), every other end
/// alone. Keeps the walk quadratic in classes, not in pods.
fn classes<'a>(snapshot: &'a Snapshot, universe: &'a Universe<'a>) -> (Vec<&'a Pod>, Vec<Vec<&'a ProbeEnd<'a>>>) {
    type PodClass<'a> = (&'a str, &'a crate::model::Labels, &'a [crate::model::ContainerPort]);
    let key = |p: &'a Pod| -> PodClass<'a> { (p.namespace.as_str(), &p.labels, p.ports.as_slice()) };
    let mut subjects: BTreeMap<PodClass<'a>, &'a Pod> = BTreeMap::new();
    for p in live_pods(snapshot).filter(|p| !p.host_network) {
        subjects.entry(key(p)).or_insert(p);
    }
    let cidrs = super::universe::policy_cidrs(snapshot);
    let mut pods: BTreeMap<(PodClass<'a>, bool, Vec<&ipnet::IpNet>), Vec<&'a ProbeEnd<'a>>> = BTreeMap::new();
    let mut ends = Vec::new();
    for e in &universe.ends {
        match e.pod() {
            Some(p) => {
                let holding: Vec<&ipnet::IpNet> = cidrs.iter().filter(|c| c.contains(&e.ip)).collect();
                let members = pods.entry((key(p), e.ip.is_ipv4(), holding)).or_default();
                if members.len() < 2 {
                    members.push(e);
                }
            }
            None => ends.push(vec![e]),
        }
    }
    ends.extend(pods.into_values());
    (subjects.into_values().collect(), ends)
}

fn rule_key(o: &Ordered<'_>, dir: Direction) -> RuleKey {
    (o.policy.name.clone(), dir, o.index)
}

fn allowed_of(action: TierAction) -> Option<bool> {
    match action {
        TierAction::Accept => Some(true),
        TierAction::Deny => Some(false),
        TierAction::Pass => None,
    }
}

fn cluster_dynamic(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    out: &mut Vec<Finding>,
    static_rules: &BTreeSet<RuleKey>,
) {
    if snapshot.cluster_policies.is_empty() {
        return;
    }
    let universe = Universe::new(snapshot, &[]);
    let mut stats: BTreeMap<RuleKey, RuleStats> = BTreeMap::new();
    for c in snapshot.cluster_policies.values() {
        for dir in [Direction::Ingress, Direction::Egress] {
            for i in 0..c.rules(dir).len() {
                stats.insert((c.name.clone(), dir, i), RuleStats::default());
            }
        }
    }
    // (policy a, policy b, direction) -> (actions seen, example).
    let mut overlaps: BTreeMap<(String, String, Direction), Overlap> = BTreeMap::new();
    let (subjects, end_classes) = classes(snapshot, &universe);
    for pod in subjects {
        for dir in [Direction::Ingress, Direction::Egress] {
            let isolating: Option<String> = snapshot
                .policies
                .values()
                .find(|p| {
                    policy_selects(p, pod)
                        && match dir {
                            Direction::Ingress => p.ingress_isolation,
                            Direction::Egress => p.egress_isolation,
                        }
                })
                .map(np_name);
            let tiers: Vec<(Tier, Vec<Ordered<'_>>)> = [Tier::Admin, Tier::Baseline]
                .into_iter()
                .map(|t| {
                    let rules = tier_policies(snapshot, t, pod)
                        .into_iter()
                        .flat_map(|p| {
                            p.rules(dir)
                                .iter()
                                .enumerate()
                                .map(move |(index, rule)| Ordered { policy: p, index, rule })
                        })
                        .collect();
                    (t, rules)
                })
                .collect();
            if tiers.iter().all(|(_, r)| r.is_empty()) {
                continue;
            }
            for class in &end_classes {
                // A member other than the pod itself (its own traffic is
                // no flow): any decides as every member does.
                let Some(end) = class.iter().find(|e| !e.pod().is_some_and(|p| std::ptr::eq(p, pod))) else {
                    continue;
                };
                let tend = End {
                    ip: end.ip,
                    pod: end.pod(),
                    node: end.node_labels(),
                };
                let from_node = dir == Direction::Ingress && opts.node_ips.contains(&end.ip);
                for run in &universe.ports {
                    let mut admin_decided: Option<Shadower> = None;
                    for (tier, rules) in &tiers {
                        let matching: Vec<&Ordered<'_>> = rules
                            .iter()
                            .filter(|o| rule_matches(snapshot, o.rule, dir, pod, tend, run.protocol, run.start))
                            .collect();
                        let Some(first) = matching.first() else { continue };
                        let pre_empted = if from_node {
                            Some(Shadower::Node)
                        } else if *tier == Tier::Baseline {
                            admin_decided.clone().or(isolating.clone().map(Shadower::NetworkPolicy))
                        } else {
                            None
                        };
                        let first_shadower =
                            Shadower::Rule(first.policy.name.clone(), dir, first.index, first.rule.action);
                        for (n, o) in matching.iter().enumerate() {
                            let st = stats.get_mut(&rule_key(o, dir)).expect("every rule");
                            st.matched = true;
                            if n == 0 && pre_empted.is_none() {
                                st.decided = true;
                            } else {
                                st.shadowers.insert(if n == 0 {
                                    pre_empted.clone().expect("pre-empted")
                                } else {
                                    first_shadower.clone()
                                });
                                if st.example.is_none() {
                                    st.example = Some(example(pod, dir, end, run));
                                }
                            }
                        }
                        if *tier == Tier::Admin && first.rule.action != TierAction::Pass {
                            admin_decided = Some(first_shadower.clone());
                        }
                        if pre_empted.is_none() && first.rule.action == TierAction::Pass {
                            // The verdict with the Pass, and without it: the
                            // next matching rule of the tier decides, or
                            // (Pass, none) the same as the Pass.
                            let with =
                                evaluate_direction_with_peer(snapshot, opts, pod, dir, tend, run.protocol, run.start)
                                    .allowed;
                            let without = matching.get(1).and_then(|o| allowed_of(o.rule.action)).unwrap_or(with);
                            let st = stats.get_mut(&rule_key(first, dir)).expect("every rule");
                            st.pass_reached = true;
                            st.pass_changes |= with != without;
                        }
                        // Equal priorities: the first priority with a match;
                        // each CNP's first matching rule there.
                        if pre_empted.is_none() {
                            let prio = first.policy.priority;
                            let mut firsts: Vec<&Ordered<'_>> = Vec::new();
                            for o in matching.iter().filter(|o| o.policy.priority == prio) {
                                if !firsts.iter().any(|f| f.policy.name == o.policy.name) {
                                    firsts.push(o);
                                }
                            }
                            for (a, b) in firsts.iter().zip(firsts.iter().skip(1)) {
                                let k = (a.policy.name.clone(), b.policy.name.clone(), dir);
                                let e = overlaps
                                    .entry(k)
                                    .or_insert_with(|| (BTreeSet::new(), false, example(pod, dir, end, run)));
                                e.0.insert((
                                    cnp_rule_long(a.policy, dir, a.index),
                                    cnp_rule_long(b.policy, dir, b.index),
                                ));
                                e.1 |= a.rule.action != b.rule.action;
                            }
                            // The first of them also shadows later equal
                            // ones for npm; their order is the API's
                            // undefined one, reported as an overlap.
                        }
                    }
                }
            }
        }
    }
    for ((name, dir, i), st) in &stats {
        let c = &snapshot.cluster_policies[name];
        let object = cnp_rule(c, *dir, *i);
        let rule = &c.rules(*dir)[*i];
        if !st.matched {
            if !static_rules.contains(&(name.clone(), *dir, *i)) {
                out.push(Finding {
                    severity: Severity::Warning,
                    kind: "rule-matches-nothing",
                    object,
                    related: vec![],
                    message: "matches no flow between the objects' pods, nodes and addresses".into(),
                });
            }
            continue;
        }
        if !st.decided {
            // Shadowed by equal-priority CNPs only: reported as an overlap.
            let only_equal = st.shadowers.iter().all(|s| match s {
                Shadower::Rule(n, _, _, _) => {
                    let o = &snapshot.cluster_policies[n];
                    n != name && o.priority == c.priority && o.tier == c.tier
                }
                _ => false,
            });
            if only_equal {
                continue;
            }
            let same = st
                .shadowers
                .iter()
                .all(|s| matches!(s, Shadower::Rule(_, _, _, a) if *a == rule.action));
            let related = st
                .shadowers
                .iter()
                .map(|s| match s {
                    Shadower::Rule(n, d, j, _) => cnp_rule_long(&snapshot.cluster_policies[n], *d, *j),
                    Shadower::NetworkPolicy(n) => format!("{n} (isolates the pod: the Baseline tier is not consulted)"),
                    Shadower::Node => "ingress from the pod's node (always allowed)".into(),
                })
                .collect();
            out.push(Finding {
                severity: if same { Severity::Info } else { Severity::Warning },
                kind: "shadowed-rule",
                object,
                related,
                message: format!(
                    "{:?} never decides: every flow it matches is decided first by the rules below{} (e.g. {})",
                    rule.action,
                    if same {
                        ", with the same action: it is redundant"
                    } else {
                        ""
                    },
                    st.example.as_deref().unwrap_or("-")
                ),
            });
            continue;
        }
        if rule.action == TierAction::Pass && st.pass_reached && !st.pass_changes {
            out.push(Finding {
                severity: Severity::Info,
                kind: "pass-no-effect",
                object,
                related: vec![],
                message: "every flow it passes ends with the same verdict as without it".into(),
            });
        }
    }
    for ((a, b, dir), (pairs, differ, ex)) in overlaps {
        let (pa, pb) = (&snapshot.cluster_policies[&a], &snapshot.cluster_policies[&b]);
        let mut related: Vec<String> = Vec::new();
        for (x, y) in pairs {
            related.push(format!("{x} and {y}"));
        }
        out.push(Finding {
            severity: if differ { Severity::Error } else { Severity::Info },
            kind: "equal-priority-overlap",
            object: format!("clusternetworkpolicy/{a} and clusternetworkpolicy/{b} {}", dir.name()),
            related,
            message: format!(
                "same {} tier priority {} and both match some flows (e.g. {ex}): the API leaves their order undefined (npm checks {a} first){}",
                pa.tier.name(),
                pb.priority,
                if differ { "; their actions differ, so the verdict depends on the implementation" } else { "" }
            ),
        });
    }
}

fn example(pod: &Pod, dir: Direction, end: &ProbeEnd<'_>, run: &super::universe::PortRun) -> String {
    let me = format!("{}/{}", pod.namespace, pod.name);
    let port = if Protocol::from_number(run.protocol).is_some() {
        format!("{}/{}", protocol_name(run.protocol), run.start)
    } else {
        protocol_name(run.protocol)
    };
    match dir {
        Direction::Ingress => format!("{} -> {me} {port}", end.label()),
        Direction::Egress => format!("{me} -> {} {port}", end.label()),
    }
}
