//! ClusterNetworkPolicies into the snapshot or the incremental compiler:
//! each API object (kept with a raw `spec`, see
//! [`crate::k8s::cluster_policy`]) is decoded into npm-policy's API type
//! ([`npm_policy::tiers::validate::cluster_policy_from_value`]) and
//! converted by npm-policy (`Snapshot::upsert_cluster_policy`,
//! `Compiler::apply_cluster_policy`), one object at a time.
//!
//! - A policy that converts with problems is in the snapshot as the
//!   conversion makes it (failing closed where it is not understood) and
//!   its report is the snapshot's `invalid_cluster_policies`;
//! - an object that cannot be decoded at all (its JSON does not have the
//!   API's shape: no API server that validates against the CRD schema sends
//!   one, but a schema served without validation, or a field this agent's
//!   decoder is stricter about, can) cannot say whom it selects: the last
//!   version of the same object (uid) whose subject was understood
//!   ([`LastValid`]) stays enforced, rules included, as for a subject that
//!   is not understood; an object that never had one is left out of the
//!   snapshot. Both are reported the same way ([`Unparsed`]; the second
//!   with the consequence that fails readiness, `cluster-policy-subjects`),
//!   and every other policy is enforced. A partial view is not the truth:
//!   an update the agent cannot read never removes the Denies it had.

use std::collections::BTreeMap;

use npm_policy::incremental::Compiler;
use npm_policy::model::{InvalidPolicy, Selector, Snapshot};
use npm_policy::tiers::validate::{cluster_policy_from_value, ClusterConsequence};
use npm_policy::tiers::{ClusterPolicy, Subject};

use crate::k8s::ClusterNetworkPolicy;

/// The ClusterNetworkPolicies that could not be decoded, by name, with
/// their reports.
pub type Unparsed = BTreeMap<String, InvalidPolicy>;

/// npm-policy's API object of `cnp`, or (recorded in `unparsed`) the
/// report of an object that cannot be decoded; `kept` says whether a
/// previous version of the object stays enforced instead.
fn decode(
    cnp: &ClusterNetworkPolicy,
    unparsed: &mut Unparsed,
    kept: bool,
) -> Option<npm_policy::tiers::ClusterNetworkPolicy> {
    let name = cnp.name().to_string();
    match cluster_policy_from_value(&cnp.to_api_json()) {
        Ok(api) => {
            unparsed.remove(&name);
            Some(api)
        }
        Err(e) => {
            tracing::debug!(policy = %name, error = %e, "ClusterNetworkPolicy cannot be decoded");
            let consequence = if kept {
                ClusterConsequence::KeptLastValid
            } else {
                ClusterConsequence::SelectsNothing
            };
            unparsed.insert(name.clone(), unparsed_report(&name, &e.to_string(), consequence));
            None
        }
    }
}

/// The report of the undecodable object `name`.
fn unparsed_report(name: &str, error: &str, consequence: ClusterConsequence) -> InvalidPolicy {
    InvalidPolicy {
        namespace: String::new(),
        name: name.to_string(),
        errors: vec![format!(
            "{error} (the object cannot be decoded: {consequence}; the other policies are enforced)"
        )],
    }
}

/// The last version of each ClusterNetworkPolicy whose subject this agent
/// understood, with the uid of its object: what a version whose subject is
/// not understood keeps enforced (`npm_policy::tiers::with_last_valid_subject`).
/// The incremental compiler has it as the policy's current version; a
/// snapshot built from scratch (a rebuild, the cross-check's full compile)
/// has no current version, so it is seeded from here: without it a rebuild
/// would turn the kept version into a policy that selects no pod (its
/// Admin Denies enforced nowhere). A policy deleted, or recreated under its
/// name (another uid), has no last valid version.
#[derive(Clone, Debug, Default)]
pub struct LastValid(BTreeMap<String, (Option<String>, ClusterPolicy)>);

impl LastValid {
    /// Record the version of `name` in `snapshot` when its subject is
    /// understood; forget `name` when `object` is gone.
    pub(super) fn record(&mut self, snapshot: &Snapshot, name: &str, object: Option<&ClusterNetworkPolicy>) {
        let Some(object) = object else {
            self.0.remove(name);
            return;
        };
        let uid = object.metadata.uid.clone();
        match snapshot.cluster_policies.get(name) {
            Some(p) if p.subject != Subject::Namespaces(Selector::nothing()) => {
                self.0.insert(name.to_string(), (uid, p.clone()));
            }
            // Not understood now: the entry of the same object stays.
            _ => {
                if self.0.get(name).is_some_and(|(u, _)| *u != uid) {
                    self.0.remove(name);
                }
            }
        }
    }

    /// The last valid version of `cnp`'s object, if any.
    fn of(&self, cnp: &ClusterNetworkPolicy) -> Option<&ClusterPolicy> {
        self.0
            .get(cnp.name())
            .filter(|(uid, _)| *uid == cnp.metadata.uid)
            .map(|(_, p)| p)
    }
}

/// Convert `cnp` into `snapshot` (replacing the policy of that name), or
/// record it in `unparsed` when it cannot be decoded. A snapshot without a
/// version of it yet starts from its last valid version, if any; an
/// undecodable one keeps that version (reported on the pods it selects),
/// or is left out when there is none.
pub(super) fn upsert(snapshot: &mut Snapshot, unparsed: &mut Unparsed, cnp: &ClusterNetworkPolicy, last: &LastValid) {
    if !snapshot.cluster_policies.contains_key(cnp.name()) {
        if let Some(p) = last.of(cnp) {
            snapshot.insert_cluster_policy(p.clone(), None);
        }
    }
    let kept = last.of(cnp);
    match decode(cnp, unparsed, kept.is_some()) {
        // Invalid ones are recorded in `invalid_cluster_policies`.
        Some(api) => {
            let _ = snapshot.upsert_cluster_policy(&api);
        }
        None => match kept {
            Some(p) => snapshot.insert_cluster_policy(p.clone(), unparsed.get(cnp.name()).cloned()),
            None => {
                snapshot.remove_cluster_policy(cnp.name());
            }
        },
    }
}

/// [`upsert`] into the incremental compiler.
pub(super) fn apply(compiler: &mut Compiler, unparsed: &mut Unparsed, cnp: &ClusterNetworkPolicy, last: &LastValid) {
    let kept = last.of(cnp);
    match decode(cnp, unparsed, kept.is_some()) {
        Some(api) => {
            let _ = compiler.apply_cluster_policy(&api);
        }
        None => match kept {
            Some(p) => compiler.keep_cluster_policy(p.clone(), unparsed.get(cnp.name()).cloned()),
            None => compiler.remove_cluster_policy(cnp.name()),
        },
    }
}

/// Remove the ClusterNetworkPolicy `name` (decoded or not) from `snapshot`.
pub(super) fn remove(snapshot: &mut Snapshot, unparsed: &mut Unparsed, name: &str) {
    snapshot.remove_cluster_policy(name);
    unparsed.remove(name);
}

/// [`remove`] from the incremental compiler.
pub(super) fn remove_compiled(compiler: &mut Compiler, unparsed: &mut Unparsed, name: &str) {
    compiler.remove_cluster_policy(name);
    unparsed.remove(name);
}

/// The reports of the snapshot's invalid ClusterNetworkPolicies and of the
/// undecodable ones, by name.
pub fn invalid_cluster_policies(snapshot: &Snapshot, unparsed: &Unparsed) -> BTreeMap<String, Vec<String>> {
    snapshot
        .invalid_cluster_policies
        .iter()
        .chain(unparsed.values())
        .map(|p| (p.name.clone(), p.errors.clone()))
        .collect()
}
