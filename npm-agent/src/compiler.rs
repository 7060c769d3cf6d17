//! The agent's two calls into the compiler (`npm-policy`): API objects ->
//! [`Snapshot`], and [`Snapshot`] -> [`Compiled`].
//!
//! Objects are converted one by one so that a pod or namespace the converter
//! rejects (a malformed IP, say) is logged and skipped instead of stopping
//! enforcement of everything else; invalid policies are kept by the
//! converter in `Snapshot::invalid_policies`.

use npm_policy::compiled::{CompileOptions, Compiled};
use npm_policy::convert::{namespace_from_api, pod_from_api};
use npm_policy::model::Snapshot;

use crate::watch::CompleteState;

/// Build the snapshot of a complete state. Objects that cannot be converted
/// are logged (naming the object and the field) and left out.
pub fn snapshot(state: &CompleteState) -> Snapshot {
    let mut s = Snapshot::default();
    for ns in &state.namespaces {
        match namespace_from_api(ns) {
            Ok(n) => s.upsert_namespace(n),
            Err(e) => tracing::error!(error = %e, "namespace skipped"),
        }
    }
    for p in &state.pods {
        match pod_from_api(p) {
            Ok(p) => s.upsert_pod(p),
            Err(e) => tracing::error!(error = %e, "pod skipped"),
        }
    }
    for np in &state.policies {
        // Invalid policies are recorded in `s.invalid_policies`; the sync
        // loop logs and counts them.
        let _ = s.upsert_policy(np);
    }
    s
}

/// Compile a snapshot, reusing the previous compile's ids.
pub fn compile(snapshot: &Snapshot, opts: &CompileOptions, prev: Option<&Compiled>) -> Compiled {
    npm_policy::compile(snapshot, opts, prev)
}
