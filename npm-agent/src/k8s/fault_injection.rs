//! Test-only fault injection, to prove that the chaos soak's oracle
//! (`cargo xtask chaos --inject`, `tests/e2e/src/chaos/`) can fail.
//!
//! `NPM_TEST_SKIP_DELETE=<resource>` (a plural name the cache watches:
//! `networkpolicies`, `pods`, `namespaces`, …) makes the agent drop every
//! watch `Delete` event of that resource: the removal is skipped until the
//! next complete relist brings the truth back. A deleted NetworkPolicy that
//! allowed a flow while another one isolates its pod keeps allowing it, the
//! fail-open shape every removal path must avoid. Never set it outside a
//! test; the agent logs a warning for every event it drops.

use std::sync::OnceLock;

/// The environment variable naming the resource whose deletes are dropped.
pub const SKIP_DELETE_ENV: &str = "NPM_TEST_SKIP_DELETE";

fn skipped_resource() -> Option<&'static str> {
    static V: OnceLock<Option<String>> = OnceLock::new();
    V.get_or_init(|| std::env::var(SKIP_DELETE_ENV).ok().filter(|v| !v.is_empty()))
        .as_deref()
}

/// Whether a watch `Delete` of `resource` is to be dropped (the injected
/// fault is on for it).
pub fn skip_delete(resource: &str) -> bool {
    skipped_resource() == Some(resource)
}
