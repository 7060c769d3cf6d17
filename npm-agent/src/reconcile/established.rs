//! Connection semantics: whether a local pod's established
//! connections follow policy changes. `keep`: a tracked connection keeps
//! flowing until it ends or idles out, whatever the policy becomes (new
//! connections meet the new policy). `enforce`: after the sync that
//! programmed a change, the pod's tracked connections that the new policy
//! denies stop passing and their conntrack entries are removed, each one
//! counted (`npm_connections_cut_total{namespace,direction}`) and logged
//! as a flow record (`reason":"connection-cut"`).
//!
//! The cluster-wide default is `--established` (chart `established`); the
//! annotation `npm.io/established: keep|enforce` on a Namespace overrides
//! it for the pods of that namespace (the pod whose direction now denies:
//! an ingress cut follows the receiving pod's namespace, an egress cut the
//! sender's). A value the agent does not understand is read as `enforce`
//! (fail closed: the stricter semantics) and reported once per value.
//! [`enforce_set`] is what the sync loop hands the dataplane
//! (`Dataplane::set_established_enforce`) before each apply or full sync.
//! A switch to `enforce` alone (the annotation, nothing else changed)
//! takes effect at that sync: the loop applies the (empty) diff when an
//! endpoint entered the set ([`EstablishedModes::entered_enforce`]), and
//! the dataplane judges that endpoint's tracked connections by the policy
//! in force.

use std::collections::{BTreeMap, BTreeSet};

use k8s_openapi::api::core::v1::Namespace;
use npm_policy::compiled::Compiled;

use crate::k8s::objects::Objects;

/// The Namespace annotation that chooses the connection semantics of its
/// pods (`keep` or `enforce`), overriding `--established`.
pub const ESTABLISHED_ANNOTATION: &str = "npm.io/established";

/// Connection semantics on a policy change.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Established {
    /// Tracked connections keep flowing until they end (today's
    /// behaviour, Calico's).
    #[default]
    Keep,
    /// Tracked connections the new policy denies are cut after the sync
    /// that programmed it (Cilium re-checks every packet).
    Enforce,
}

impl Established {
    /// The annotation's value: `keep` or `enforce`, else `None`.
    pub fn parse(v: &str) -> Option<Established> {
        match v.trim() {
            "keep" => Some(Established::Keep),
            "enforce" => Some(Established::Enforce),
            _ => None,
        }
    }
}

impl std::fmt::Display for Established {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Established::Keep => "keep",
            Established::Enforce => "enforce",
        })
    }
}

/// The semantics of each namespace with the annotation, and the
/// namespaces whose value was not understood (read as `enforce`).
pub fn namespace_modes(namespaces: &Objects<Namespace>) -> (BTreeMap<String, Established>, BTreeSet<String>) {
    let mut modes = BTreeMap::new();
    let mut invalid = BTreeSet::new();
    for ns in namespaces.iter() {
        let Some(v) = ns
            .metadata
            .annotations
            .as_ref()
            .and_then(|a| a.get(ESTABLISHED_ANNOTATION))
        else {
            continue;
        };
        let name = ns.metadata.name.clone().unwrap_or_default();
        let mode = Established::parse(v).unwrap_or_else(|| {
            invalid.insert(format!("{name}={v:?}"));
            Established::Enforce
        });
        modes.insert(name, mode);
    }
    (modes, invalid)
}

/// The endpoints of `compiled` under `enforce`: those of a namespace
/// annotated `enforce`, and, with `default` `enforce`, those of every
/// namespace not annotated `keep`.
pub fn enforce_set(default: Established, modes: &BTreeMap<String, Established>, compiled: &Compiled) -> BTreeSet<u32> {
    compiled
        .endpoints
        .iter()
        .filter(|(_, ep)| modes.get(&ep.pod.namespace).copied().unwrap_or(default) == Established::Enforce)
        .map(|(id, _)| *id)
        .collect()
}

/// The sync loop's view: the default, the invalid values reported so
/// far (each reported once) and the `enforce` set of the last sync that
/// programmed the dataplane.
#[derive(Debug, Default)]
pub struct EstablishedModes {
    /// `--established`.
    pub default: Established,
    reported: BTreeSet<String>,
    programmed: BTreeSet<u32>,
}

impl EstablishedModes {
    /// Modes with the cluster-wide `default`.
    pub fn new(default: Established) -> Self {
        EstablishedModes {
            default,
            reported: BTreeSet::new(),
            programmed: BTreeSet::new(),
        }
    }

    /// Whether `enforce` has an endpoint that the last programmed sync's
    /// set did not (an annotation or flag switched to `enforce`): its
    /// tracked connections must be judged now, so the sync calls the
    /// dataplane even when nothing else changed.
    pub fn entered_enforce(&self, enforce: &BTreeSet<u32>) -> bool {
        !enforce.is_subset(&self.programmed)
    }

    /// Records the `enforce` set of a sync that programmed the dataplane.
    pub fn programmed(&mut self, enforce: BTreeSet<u32>) {
        self.programmed = enforce;
    }

    /// [`enforce_set`] for the namespaces of the complete state, reporting
    /// each annotation value not understood once.
    pub fn enforce_set(&mut self, namespaces: &Objects<Namespace>, compiled: &Compiled) -> BTreeSet<u32> {
        let (modes, invalid) = namespace_modes(namespaces);
        for bad in invalid.difference(&self.reported) {
            tracing::warn!(namespace = %bad, annotation = ESTABLISHED_ANNOTATION, "annotation value not understood (keep or enforce): read as enforce");
        }
        self.reported = invalid;
        enforce_set(self.default, &modes, compiled)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn ns(name: &str, v: Option<&str>) -> Arc<Namespace> {
        let mut n = Namespace::default();
        n.metadata.name = Some(name.into());
        n.metadata.annotations = v.map(|v| BTreeMap::from([(ESTABLISHED_ANNOTATION.to_string(), v.to_string())]));
        Arc::new(n)
    }

    #[test]
    fn the_annotation_overrides_the_default_and_bad_values_enforce() {
        let mut objs = Objects::new();
        for n in [
            ns("a", Some("enforce")),
            ns("b", Some("keep")),
            ns("c", None),
            ns("d", Some("sometimes")),
        ] {
            objs.insert(n);
        }
        let (modes, invalid) = namespace_modes(&objs);
        assert_eq!(modes.get("a"), Some(&Established::Enforce));
        assert_eq!(modes.get("b"), Some(&Established::Keep));
        assert_eq!(modes.get("c"), None);
        assert_eq!(modes.get("d"), Some(&Established::Enforce));
        assert_eq!(invalid.len(), 1);

        let mut c = crate::reconcile::tests::two_endpoints();
        let ids: Vec<u32> = c.endpoints.keys().copied().collect();
        for (i, ep) in c.endpoints.values_mut().enumerate() {
            ep.pod.namespace = ["a", "b"][i % 2].to_string();
        }
        let keep = enforce_set(Established::Keep, &modes, &c);
        assert_eq!(keep, BTreeSet::from([ids[0]]));
        for ep in c.endpoints.values_mut() {
            ep.pod.namespace = "c".into();
        }
        assert!(enforce_set(Established::Keep, &modes, &c).is_empty());
        assert_eq!(enforce_set(Established::Enforce, &modes, &c).len(), 2);
    }
}
