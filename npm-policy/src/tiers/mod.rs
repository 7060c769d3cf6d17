//! ClusterNetworkPolicy (`policy.networking.k8s.io/v1alpha2`): the Admin and
//! Baseline tiers around NetworkPolicy.
//!
//! - [`api`]: the API object (serde types, upstream field names);
//! - [`model`]: the validated model ([`ClusterPolicy`]);
//! - [`validate`]: API -> model, failing closed on what is not understood;
//! - [`domains`]: `domainNames` patterns and the learned names they match;
//! - [`compile`]: ranks, the fold, [`crate::compiled::Compiled::tiers`];
//! - [`evaluate`]: the reference evaluator of one tier (API text quoted);
//! - the [`Snapshot`] methods below keep `cluster_policies` and
//!   `invalid_cluster_policies` together.
//!
//! Evaluation order per direction of a local endpoint (the evaluator, the
//! compiled lookup and both dataplanes do exactly this): ingress from the
//! node -> allow; Admin tier (first matching rule of the highest-priority
//! CNP: Accept allows, Deny drops, Pass or no match goes on);
//! NetworkPolicy (if one isolates the pod it decides); Baseline tier
//! (Accept, Deny; Pass or no match goes on); allow. Within a tier, CNPs are
//! ordered by (priority, name) — the name breaks ties the API leaves
//! undefined — and rules by index.

pub mod api;
pub mod compile;
pub mod domains;
pub mod evaluate;
pub mod model;
pub mod validate;

pub use api::ClusterNetworkPolicy;
pub use domains::{DomainPattern, LearnedNames};
pub use model::{ClusterPeer, ClusterPolicy, ClusterPort, ClusterRule, Subject};
pub use validate::{convert_cluster_policy, validate_cluster_policy, ClusterPolicyConversion};

use crate::model::{InvalidPolicy, Selector, Snapshot};
use validate::ClusterConsequence;

/// The conversion to enforce for `c`, a ClusterNetworkPolicy whose version
/// enforced so far is `current` (of the same name). Its subject not
/// understood (a typo, a field of a newer API version), a policy would
/// select no pod: an Admin Deny silently not enforced. So a version whose
/// subject is not understood keeps `current` enforced, rules included, when
/// `current`'s subject was understood (the last valid version stays); its
/// report says so ([`ClusterConsequence::KeptLastValid`]). Never a wider
/// subject than some version had: a Pass or Deny is never widened. A policy
/// that never had an understood subject selects no pod and is reported.
pub fn with_last_valid_subject(
    current: Option<&ClusterPolicy>,
    mut c: ClusterPolicyConversion,
) -> ClusterPolicyConversion {
    let unknown = c
        .problems
        .iter()
        .any(|e| e.consequence == ClusterConsequence::SelectsNothing);
    let nothing = Subject::Namespaces(Selector::nothing());
    match current {
        Some(p) if unknown && p.subject != nothing => {
            for e in &mut c.problems {
                if e.consequence == ClusterConsequence::SelectsNothing {
                    e.consequence = ClusterConsequence::KeptLastValid;
                }
            }
            ClusterPolicyConversion {
                policy: p.clone(),
                problems: c.problems,
            }
        }
        _ => c,
    }
}

impl Snapshot {
    /// Converts and adds or replaces a ClusterNetworkPolicy. One that is
    /// not fully understood is added as the conversion makes it (failing
    /// closed), its report is recorded in `invalid_cluster_policies` and
    /// returned as the error.
    pub fn upsert_cluster_policy(&mut self, cnp: &ClusterNetworkPolicy) -> Result<(), InvalidPolicy> {
        let name = cnp.metadata.name.clone().unwrap_or_default();
        let c = with_last_valid_subject(self.cluster_policies.get(&name), convert_cluster_policy(cnp));
        let invalid = c.invalid();
        self.insert_cluster_policy(c.policy, invalid.clone());
        match invalid {
            None => Ok(()),
            Some(e) => Err(e),
        }
    }

    /// Adds or replaces a converted ClusterNetworkPolicy with its report
    /// (`None`: valid); the earlier report of that name is forgotten.
    pub fn insert_cluster_policy(&mut self, policy: ClusterPolicy, invalid: Option<InvalidPolicy>) {
        self.invalid_cluster_policies.retain(|p| p.name != policy.name);
        if let Some(e) = invalid {
            self.invalid_cluster_policies.push(e);
        }
        self.cluster_policies.insert(policy.name.clone(), policy);
    }

    /// Removes a ClusterNetworkPolicy (valid or invalid).
    pub fn remove_cluster_policy(&mut self, name: &str) -> Option<ClusterPolicy> {
        self.invalid_cluster_policies.retain(|p| p.name != name);
        self.cluster_policies.remove(name)
    }
}
