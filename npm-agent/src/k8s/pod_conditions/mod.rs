//! The pod condition `npm.io/PolicyEnforced`: whether the
//! NetworkPolicies and ClusterNetworkPolicies selecting a pod, as of the
//! state the agent last compiled, are in the kernel for that pod on its
//! node.
//!
//! The agent of the pod's node decides each local pod's [`Reason`] after
//! every sync attempt (`reconcile::enforced`) and hands the whole set to
//! the writer task ([`PodConditions::publish`], never blocking the sync
//! loop). The writer ([`writer`]) patches `pods/status` (a strategic merge
//! patch keyed by condition type: the kubelet's and other controllers'
//! conditions stay as they are) only when the condition's status or reason
//! changes, at most `qps` writes a second with bursts of `burst` (a token
//! bucket), each pod written once for its latest state however many syncs
//! changed it meanwhile.
//!
//! The two conditions, and what they mean for a readiness gate
//! (`readinessGates: [{conditionType: npm.io/PolicyEnforced}]`), decided
//! by [`conditions_for`]:
//! - a pod that has never been enforced gets `PolicyEnforced=False` with
//!   the reason, then `True` (reason `Enforced`, with its transition time)
//!   once its entries are in the kernel: the gate holds the pod's **first**
//!   readiness until then;
//! - a pod that has been `True` keeps `PolicyEnforced=True` (a fail-closed
//!   event must not take running pods out of their Services); a later
//!   degraded state is reported in the second condition
//!   `npm.io/PolicyDegraded=True` with the reason, back to `False` (reason
//!   `Enforced`) when it clears. `PolicyDegraded` is written only on pods
//!   that have been `True`.
//!
//! Host-network pods are never endpoints (no policy selects them): they get
//! neither condition. Nor do pods without an address yet (not endpoints
//! either): a gated pod stays unready until it has one and it is enforced.
//! A pod whose object was replaced by another of the same name is never
//! written (the patch carries the uid: the API server refuses a uid
//! change).

pub mod writer;

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::PodCondition;
use serde_json::{json, Value};

pub use writer::{spawn, PodConditions, PodConditionsConfig};

/// The condition type: the pod's policies are in the kernel.
pub const ENFORCED: &str = "npm.io/PolicyEnforced";
/// The condition type of a pod that was enforced and is degraded now.
pub const DEGRADED: &str = "npm.io/PolicyDegraded";

/// Why a pod is, or is not, enforced (the conditions' `reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// Its entries, as last compiled, are in the kernel.
    Enforced,
    /// Its host interface is not found yet: nothing is attached for it.
    NoInterface,
    /// A mass removal is held for a confirming direct read: what is
    /// programmed keeps objects the cluster may have removed.
    RemovalHeld,
    /// A kernel map is full: a reduced, fail-closed state is programmed.
    MapFull,
    /// A policy selecting the pod is not fully understood: it is enforced
    /// without the parts that cannot be (failing closed for a
    /// ClusterNetworkPolicy).
    PolicyInvalid,
    /// The last sync did not complete (a dataplane error, the API state not
    /// listed, this node's addresses unknown): what the kernel holds for
    /// the pod is not known to be the compiled state.
    AgentNotSynced,
}

impl Reason {
    /// The `reason` string.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Enforced => "Enforced",
            Reason::NoInterface => "NoInterface",
            Reason::RemovalHeld => "RemovalHeld",
            Reason::MapFull => "MapFull",
            Reason::PolicyInvalid => "PolicyInvalid",
            Reason::AgentNotSynced => "AgentNotSynced",
        }
    }

    /// The `message`.
    pub fn message(self) -> &'static str {
        match self {
            Reason::Enforced => "the policies selecting the pod, as last compiled, are in the kernel of its node",
            Reason::NoInterface => "the pod's host interface is not found yet; nothing is enforced for it",
            Reason::RemovalHeld => {
                "a mass removal is held for a confirming read of the API server; the kernel keeps objects the cluster may have removed"
            }
            Reason::MapFull => {
                "a kernel map is full: a reduced, fail-closed state is programmed (see the agent's map-capacity readiness check)"
            }
            Reason::PolicyInvalid => {
                "a policy selecting the pod is not fully understood and is enforced without those parts (see its Warning Event)"
            }
            Reason::AgentNotSynced => "the agent's last sync did not complete; the kernel state is not known to be current",
        }
    }
}

/// One local pod and its reason, as the sync loop decided it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodState {
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// The reason.
    pub reason: Reason,
}

/// The local pods by uid, each with its reason: the whole set of one sync.
pub type Desired = BTreeMap<String, PodState>;

/// (status, reason) of a condition.
pub type Written = (String, String);

/// The npm conditions a pod carries (status, reason of each), read from
/// its `status.conditions`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Current {
    /// `npm.io/PolicyEnforced`.
    pub enforced: Option<Written>,
    /// `npm.io/PolicyDegraded`.
    pub degraded: Option<Written>,
}

impl Current {
    /// The npm conditions among `conditions`.
    pub fn of(conditions: &[PodCondition]) -> Current {
        let find = |t: &str| {
            conditions
                .iter()
                .find(|c| c.type_ == t)
                .map(|c| (c.status.clone(), c.reason.clone().unwrap_or_default()))
        };
        Current {
            enforced: find(ENFORCED),
            degraded: find(DEGRADED),
        }
    }
}

/// The conditions to write for a pod whose conditions are `current` and
/// whose reason is now `reason` (empty: nothing changes). See the module
/// doc for the rules.
pub fn conditions_for(current: &Current, reason: Reason) -> Current {
    let was_true = current.enforced.as_ref().is_some_and(|(s, _)| s == "True");
    let enforced_reason = Reason::Enforced.as_str().to_string();
    let mut next = Current::default();
    if reason == Reason::Enforced {
        let want = ("True".to_string(), enforced_reason.clone());
        if current.enforced.as_ref() != Some(&want) {
            next.enforced = Some(want);
        }
        // A degraded report clears.
        if current.degraded.as_ref().is_some_and(|(s, _)| s != "False") {
            next.degraded = Some(("False".into(), enforced_reason));
        }
    } else if was_true {
        let want = ("True".to_string(), reason.as_str().to_string());
        if current.degraded.as_ref() != Some(&want) {
            next.degraded = Some(want);
        }
    } else {
        let want = ("False".to_string(), reason.as_str().to_string());
        if current.enforced.as_ref() != Some(&want) {
            next.enforced = Some(want);
        }
    }
    next
}

/// The strategic merge patch of `pods/status` that writes `next` (the
/// conditions [`conditions_for`] returned) onto a pod whose npm conditions
/// are `current`, at `now` (RFC 3339). A condition's `lastTransitionTime`
/// is set only when its status changes (a new reason alone keeps it).
/// `uid` makes the API server refuse the patch on another pod of the same
/// name.
pub fn patch(uid: &str, current: &Current, next: &Current, now: &str) -> Value {
    let mut conditions = Vec::new();
    for (t, cur, want) in [
        (ENFORCED, &current.enforced, &next.enforced),
        (DEGRADED, &current.degraded, &next.degraded),
    ] {
        let Some((status, reason)) = want else { continue };
        let r = match reason.as_str() {
            "Enforced" => Reason::Enforced,
            "NoInterface" => Reason::NoInterface,
            "RemovalHeld" => Reason::RemovalHeld,
            "MapFull" => Reason::MapFull,
            "PolicyInvalid" => Reason::PolicyInvalid,
            _ => Reason::AgentNotSynced,
        };
        let mut c = json!({"type": t, "status": status, "reason": reason, "message": r.message()});
        if cur.as_ref().is_none_or(|(s, _)| s != status) {
            c["lastTransitionTime"] = json!(now);
        }
        conditions.push(c);
    }
    json!({"metadata": {"uid": uid}, "status": {"conditions": conditions}})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn w(s: &str, r: &str) -> Option<Written> {
        Some((s.into(), r.into()))
    }

    #[test]
    fn a_new_pod_goes_false_then_true() {
        let none = Current::default();
        let n = conditions_for(&none, Reason::NoInterface);
        assert_eq!(n.enforced, w("False", "NoInterface"));
        assert_eq!(n.degraded, None);
        let now = Current {
            enforced: w("False", "NoInterface"),
            degraded: None,
        };
        assert_eq!(conditions_for(&now, Reason::NoInterface), Current::default());
        let n = conditions_for(&now, Reason::MapFull);
        assert_eq!(n.enforced, w("False", "MapFull"));
        let n = conditions_for(&now, Reason::Enforced);
        assert_eq!(n.enforced, w("True", "Enforced"));
        assert_eq!(n.degraded, None);
    }

    #[test]
    fn an_enforced_pod_stays_true_and_reports_degraded() {
        let t = Current {
            enforced: w("True", "Enforced"),
            degraded: None,
        };
        assert_eq!(conditions_for(&t, Reason::Enforced), Current::default());
        let n = conditions_for(&t, Reason::RemovalHeld);
        assert_eq!(n.enforced, None, "never False again");
        assert_eq!(n.degraded, w("True", "RemovalHeld"));
        let d = Current {
            enforced: w("True", "Enforced"),
            degraded: w("True", "RemovalHeld"),
        };
        assert_eq!(conditions_for(&d, Reason::RemovalHeld), Current::default());
        let n = conditions_for(&d, Reason::Enforced);
        assert_eq!(n.enforced, None);
        assert_eq!(n.degraded, w("False", "Enforced"));
    }

    #[test]
    fn the_patch_keys_by_type_and_keeps_transition_time_on_reason_changes() {
        let cur = Current {
            enforced: w("False", "NoInterface"),
            degraded: None,
        };
        let p = patch(
            "u1",
            &cur,
            &conditions_for(&cur, Reason::MapFull),
            "2026-01-01T00:00:00Z",
        );
        assert_eq!(p["metadata"]["uid"], "u1");
        let c = &p["status"]["conditions"][0];
        assert_eq!(c["type"], ENFORCED);
        assert_eq!(c["status"], "False");
        assert_eq!(c["reason"], "MapFull");
        assert!(c.get("lastTransitionTime").is_none(), "{p}");
        let p = patch(
            "u1",
            &cur,
            &conditions_for(&cur, Reason::Enforced),
            "2026-01-01T00:00:00Z",
        );
        assert_eq!(
            p["status"]["conditions"][0]["lastTransitionTime"],
            "2026-01-01T00:00:00Z"
        );
    }
}
