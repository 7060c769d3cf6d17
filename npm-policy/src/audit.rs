//! Audit mode: a NetworkPolicy annotated `npm.io/audit: "true"` is
//! converted and evaluated but never enforced; what it would deny is
//! decided here ([`AuditView::would_deny`]) so the agent can log and count
//! it ("would deny") on live traffic.
//!
//! # Where an audited policy is kept out of enforcement (one point)
//!
//! [`crate::validate::convert_policy`], the one conversion every policy
//! goes through (the full [`crate::compile()`] through
//! [`crate::model::Snapshot::upsert_policy`], the incremental compiler
//! through [`crate::incremental::Compiler::apply_policy`]), reads the
//! annotation ([`audit_annotation`]). For an audited policy it returns the
//! policy's *enforced form* as `PolicyConversion::policy` ([`enforced_form`]:
//! same namespace and name, selects no pod, isolates nothing, no rules) and
//! the real policy in `PolicyConversion::audited`. So `Snapshot::policies`
//! holds an audited policy only as its enforced form: neither compiler can
//! emit anything for it (no endpoint selected, no rule, no ipBlock prefix),
//! the flow logs and explain do not name it as isolating a pod, and the
//! mass-removal guard still counts the object. The real forms are built
//! from the API objects again by [`audited_policies`].
//!
//! # Bad input fails closed
//!
//! An annotation value other than `"true"` or `"false"` is reported like
//! any other field the conversion does not understand (log, metric, an
//! Event on the policy) and the policy is **enforced**: an operator who
//! mistyped `audit` must not open traffic.
//!
//! # Would deny
//!
//! NetworkPolicies are a union: an audited policy can only deny a
//! connection by isolating a pod in a direction where no enforced policy
//! isolates it (the enforced ones would otherwise decide, and they allowed
//! it). The decision is the reference evaluator ([`crate::evaluate`]) run
//! twice, on the enforced snapshot and on the *merged* one (enforced plus
//! audited, audited treated as enforced): a connection is *would deny* for
//! a pod and direction when the first allows and the second denies. The
//! audited policies named are those selecting the pod in that direction;
//! each of them alone would deny it (none of them has a rule allowing it,
//! or the union would allow it, and no enforced policy isolates the pod
//! there, or the enforced rules would have decided).

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;

use k8s_openapi::api::networking::v1 as netv1;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;

use crate::compile::policy_selects;
use crate::compiled::{CompileOptions, Direction};
use crate::evaluate::{evaluate_direction_with_peer, EndVerdict};
use crate::model::{Operator, Pod, Policy, Requirement, Selector, Snapshot};
use crate::tiers::evaluate::End;

/// The annotation that puts a NetworkPolicy in audit mode (`"true"`).
pub const AUDIT_ANNOTATION: &str = "npm.io/audit";

/// The field path of the annotation, as validation errors name it.
pub const AUDIT_FIELD: &str = "metadata.annotations[\"npm.io/audit\"]";

/// The annotation has a value other than `"true"` or `"false"`: the
/// policy is enforced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unsupported value {value:?}: must be \"true\" or \"false\"; the policy is enforced, not audited")]
pub struct AuditAnnotationError {
    /// The value found.
    pub value: String,
}

/// Whether `meta` puts its policy in audit mode: `Ok(true)` for
/// `npm.io/audit: "true"`, `Ok(false)` without the annotation or for
/// `"false"`, an error (the policy is enforced) for any other value.
pub fn audit_annotation(meta: &ObjectMeta) -> Result<bool, AuditAnnotationError> {
    match meta.annotations.as_ref().and_then(|a| a.get(AUDIT_ANNOTATION)) {
        None => Ok(false),
        Some(v) if v == "true" => Ok(true),
        Some(v) if v == "false" => Ok(false),
        Some(v) => Err(AuditAnnotationError { value: v.clone() }),
    }
}

/// The selector of an enforced form: one `In` requirement without values
/// on [`AUDIT_ANNOTATION`] (a form the API rejects), matching no pod.
fn audited_selector() -> Selector {
    Selector {
        match_labels: Default::default(),
        match_expressions: vec![Requirement {
            key: AUDIT_ANNOTATION.to_string(),
            operator: Operator::In,
            values: Vec::new(),
        }],
    }
}

/// What an audited policy enforces: nothing. Same namespace and name,
/// selects no pod, isolates no direction, no rules.
pub fn enforced_form(policy: &Policy) -> Policy {
    Policy {
        namespace: policy.namespace.clone(),
        name: policy.name.clone(),
        pod_selector: audited_selector(),
        ingress_isolation: false,
        egress_isolation: false,
        ingress: Vec::new(),
        egress: Vec::new(),
    }
}

/// Whether `policy` (from `Snapshot::policies`) is the enforced form of
/// an audited policy.
pub fn is_enforced_form(policy: &Policy) -> bool {
    *policy == enforced_form(policy)
}

/// The audited policies among `policies` (API objects), each converted as
/// far as it is understood, by (namespace, name). A policy whose
/// annotation is not `"true"` is not among them (enforced).
pub fn audited_policies<'a>(
    policies: impl IntoIterator<Item = &'a netv1::NetworkPolicy>,
) -> BTreeMap<(String, String), Policy> {
    policies
        .into_iter()
        .filter(|np| audit_annotation(&np.metadata) == Ok(true))
        .filter_map(|np| crate::validate::convert_policy(np).audited)
        .map(|p| ((p.namespace.clone(), p.name.clone()), p))
        .collect()
}

/// Whether one of `audited` selects `pod` in either direction (the agent
/// asks the datapath to report this pod's new connections).
pub fn selected_by_audited<'a>(audited: impl IntoIterator<Item = &'a Policy>, pod: &Pod) -> bool {
    !pod.host_network
        && audited
            .into_iter()
            .any(|p| (p.ingress_isolation || p.egress_isolation) && policy_selects(p, pod))
}

/// One new connection an audited policy would deny, at one end.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WouldDeny {
    /// The direction, from the pod.
    pub direction: Direction,
    /// The pod (`namespace`, `name`).
    pub pod: (String, String),
    /// The audited policies selecting the pod in this direction, each of
    /// which alone would deny the connection, sorted.
    pub policies: Vec<(String, String)>,
    /// The reference evaluator's verdict on the enforced snapshot
    /// (allowed).
    pub enforced: EndVerdict,
    /// Its verdict with the audited policies enforced too (denied).
    pub audited: EndVerdict,
}

/// The merged snapshot (enforced and audited policies, the audited ones
/// treated as enforced) of one state, with its audited policies.
#[derive(Clone, Debug)]
pub struct AuditView {
    merged: Snapshot,
    audited: BTreeMap<(String, String), Policy>,
    /// Address -> its owner pod (`crate::ownership::ip_owners`, with the
    /// node addresses of the options the view was built for).
    owners: HashMap<IpAddr, (String, String)>,
    node_ips: Vec<IpAddr>,
}

impl AuditView {
    /// The view of `enforced` (a snapshot whose audited policies are in
    /// their enforced form) with the real forms `audited`. The address
    /// owners are found once, for the node addresses of `opts`.
    pub fn new(enforced: &Snapshot, opts: &CompileOptions, audited: BTreeMap<(String, String), Policy>) -> AuditView {
        let mut merged = enforced.clone();
        for (k, p) in &audited {
            merged.policies.insert(k.clone(), p.clone());
        }
        let owners = crate::ownership::ip_owners(&merged, &opts.node_ips)
            .into_iter()
            .map(|(ip, p)| (ip, (p.namespace.clone(), p.name.clone())))
            .collect();
        AuditView {
            merged,
            audited,
            owners,
            node_ips: opts.node_ips.clone(),
        }
    }

    /// Whether the view was built for these node addresses (else build it
    /// again: the address owners depend on them).
    pub fn is_for(&self, opts: &CompileOptions) -> bool {
        self.node_ips == opts.node_ips
    }

    /// The merged snapshot.
    pub fn merged(&self) -> &Snapshot {
        &self.merged
    }

    /// The audited policies.
    pub fn audited(&self) -> &BTreeMap<(String, String), Policy> {
        &self.audited
    }

    /// The pod of `snapshot` (the merged one or the one it was built from)
    /// owning `ip`: from the owners found once when `opts` has the node
    /// addresses the view was built for, else found again.
    fn peer_pod<'s>(&self, snapshot: &'s Snapshot, opts: &CompileOptions, ip: IpAddr) -> Option<&'s Pod> {
        if self.node_ips == opts.node_ips {
            self.owners.get(&ip).and_then(|k| snapshot.pods.get(k))
        } else {
            crate::evaluate::pod_at(snapshot, opts, ip)
        }
    }

    /// The audited policies selecting `pod` in `direction`, sorted.
    pub fn selecting(&self, pod: &Pod, direction: Direction) -> Vec<(String, String)> {
        self.audited
            .iter()
            .filter(|(_, p)| match direction {
                Direction::Ingress => p.ingress_isolation,
                Direction::Egress => p.egress_isolation,
            })
            .filter(|(_, p)| policy_selects(p, pod))
            .map(|(k, _)| k.clone())
            .collect()
    }

    /// Whether the audited policies would deny the new connection of pod
    /// `pod` (namespace, name) in `direction` with `peer_ip`, `protocol`,
    /// `port` (the destination port) that `enforced` (the snapshot this
    /// view was built from) allows. `None`: not would-deny (allowed by
    /// both, denied by the enforced state already, or the pod is unknown).
    // Eight arguments with `self`: the two snapshots' context, the pod's
    // end and the flow, as a datapath allow event reports it; no type holds
    // them.
    #[allow(clippy::too_many_arguments)]
    pub fn would_deny(
        &self,
        enforced: &Snapshot,
        opts: &CompileOptions,
        pod: &(String, String),
        direction: Direction,
        peer_ip: IpAddr,
        protocol: u8,
        port: u16,
    ) -> Option<WouldDeny> {
        let p = enforced.pods.get(pod)?;
        // Without an audited policy selecting the pod in this direction,
        // the merged snapshot selects it exactly as the enforced one does
        // (same policies, same rules): the same verdict.
        let policies = self.selecting(p, direction);
        if policies.is_empty() {
            return None;
        }
        let peer = |s| End::new(peer_ip, self.peer_pod(s, opts, peer_ip));
        let before = evaluate_direction_with_peer(enforced, opts, p, direction, peer(enforced), protocol, port);
        if !before.allowed {
            return None;
        }
        let merged_pod = self.merged.pods.get(pod)?;
        let after = evaluate_direction_with_peer(
            &self.merged,
            opts,
            merged_pod,
            direction,
            peer(&self.merged),
            protocol,
            port,
        );
        if after.allowed {
            return None;
        }
        Some(WouldDeny {
            direction,
            pod: pod.clone(),
            policies,
            enforced: before,
            audited: after,
        })
    }
}
