//! Reconciling the kernel with the cluster: the level-triggered sync loop
//! and its safety guards.
//!
//! Any change of a complete store marks the state dirty; changes are
//! coalesced for `debounce` after the oldest change not yet programmed (a
//! change that arrived while a sync was running is not made to wait a full
//! debounce again), then the loop takes the complete stores (never events)
//! and brings a long-lived [`compiler::Incremental`] up to them: the objects
//! added, changed or removed since the previous sync's complete state are
//! converted and compiled, nothing else (a diff of complete states, so event
//! order never matters). The first sync, and the first after a failed apply,
//! rebuild it with a full compile (keeping the previous compile's ids). As a
//! safety net a full compile is compared with the incremental one every
//! `cross_check_interval` (every sync in debug builds), on a thread of its
//! own so that it never delays a sync; a difference is logged, counted in
//! `npm_incremental_mismatch_total`, and the full compile is trusted: the
//! next sync (woken at once) rebuilds the compiler from the complete state.
//! The loop then finds the endpoints' interfaces, diffs the compiled state
//! against what is programmed (a merge walk of the ordered maps) and applies
//! the diff through the [`Dataplane`](npm_dataplane::Dataplane); the record of what is programmed is
//! updated with the same diff, not copied. The first apply of an agent's
//! life is a [`Dataplane::sync_full`](npm_dataplane::Dataplane::sync_full) (mark and sweep against pinned state
//! left by a previous agent, which keeps enforcing until then); so is the
//! first one after a failed apply, whose effect on the kernel is unknown.
//! Dataplane errors are retried with exponential backoff.
//!
//! Mass-deletion guard (incident 2): a resync is held when it would remove
//! more than `mass_delete_threshold` (default 50%) of the pod identities or
//! of the endpoints (and of the NetworkPolicies, isolated endpoint
//! directions, ClusterNetworkPolicies and tier entries: see [`guard`]),
//! measured two ways:
//! - in one step: the share of the programmed identities (endpoints) that
//!   the new state no longer has;
//! - cumulatively: the share by which the number of identities (endpoints)
//!   fell below its *reference*, the highest number programmed within the
//!   last `mass_delete_window` since the last confirmation. Removals spread
//!   over many syncs, each below the threshold (a cache that shrinks by 10%
//!   per sync), are held once together they cross it.
//!
//! The guard holds the removals, not the sync: while a removal is held
//! (its direct read deferred, failed or impossible), everything else is
//! programmed, with the held old objects kept ([`hold`]), and the sync
//! reports the hold as its error (readiness, retry).
//!
//! A held resync is confirmed by a direct read: the agent reads the four
//! resources (ClusterNetworkPolicies as `--cluster-network-policies` says)
//! straight from the API server (a fresh paginated LIST, not the
//! cache) and programs what that read says. The reference is reset to what
//! was then programmed: a direct read confirms the state. Otherwise the
//! reference only forgets counts older than the window, so a legitimate
//! scale-down proceeds without a direct read when it is slower than the
//! window, and with one (confirmed) when it is faster. A failed direct read
//! programs nothing and is retried. Direct reads back off: after a read
//! that does not confirm a deletion (or fails), a held sync stays held
//! without reading for `DIRECT_READ_MIN_BACKOFF`, doubling up to
//! `DIRECT_READ_MAX_BACKOFF`; a read that confirms a deletion resets it.
//!
//! A restarted agent has programmed nothing itself, but its dataplane may
//! have adopted a previous agent's state (pinned maps): before its first
//! sync the reference starts from the counts the dataplane reports
//! ([`AgentDataplane::adopted_counts`]), from the isolated directions
//! of the adopted endpoint records ([`AgentDataplane::adopted_endpoints`])
//! and from the tiered endpoint directions
//! ([`AgentDataplane::adopted_tier_directions`]), so a first sync that
//! would remove most of what the previous agent enforced (pods, isolation
//! or Admin and Baseline entries, e.g. a first list with no policy or no
//! ClusterNetworkPolicy) is held like any other. Its
//! first compile also keeps the adopted endpoint ids of the pods whose
//! interface still holds their record with the same addresses, and numbers
//! every other endpoint above all adopted ids
//! ([`AgentDataplane::adopted_endpoints`]).
//!
//! Files, one concern each:
//! - [`config`]: the loop's settings ([`SyncConfig`]) and their validation;
//! - [`dataplane`]: the dataplane as the loop drives it ([`AgentDataplane`]);
//! - [`syncer`]: one sync attempt ([`Syncer::sync_once`]): compile, guard,
//!   resolve interfaces, apply, record what is programmed;
//! - [`run`]: the loop around it: debounce, retry backoff, stats polling;
//! - [`guard`]: the mass-deletion guard, its window and the direct reads
//!   that confirm a held sync (with their backoff);
//! - [`hold`]: what a held sync programs: everything but the held
//!   removals (additions and label changes go through, an address a new
//!   live pod claims moves to it);
//! - [`adoption`]: what a restarted agent takes over from the adopted state
//!   (endpoint ids, the guard's first reference);
//! - [`cross_check`]: the background full compile that checks the
//!   incremental one;
//! - [`enforced`]: each local pod's `npm.io/PolicyEnforced` reason after
//!   a sync attempt (written by `k8s::pod_conditions`);
//! - [`established`]: connection semantics (`keep`/`enforce`):
//!   which endpoints' established connections follow policy changes;
//! - [`report_new`]: which endpoints report their allowed new connections
//!   (`--flow-logs-allow`, audit mode), set on the state to program;
//! - [`compiler`]: the calls into `npm-policy` (API objects -> snapshot ->
//!   compiled form, incrementally).

pub mod adoption;
pub mod builder;
pub mod compiler;
pub mod config;
pub mod cross_check;
pub mod dataplane;
pub mod enforced;
pub mod established;
pub mod expiry;
pub mod guard;
pub mod hold;
pub mod memory;
pub mod numbers;
pub mod report_new;
pub mod run;
pub mod syncer;

pub use builder::SyncerBuilder;
pub use config::{ConfigError, SyncConfig, DEFAULT_DEBOUNCE_MS, DIRECT_READ_MAX_BACKOFF, DIRECT_READ_MIN_BACKOFF};
pub use dataplane::AgentDataplane;
pub use guard::{mass_removal, GuardReference};
pub use run::SyncThread;
pub use syncer::{Readiness, SyncError, SyncOutcome, Syncer};

#[cfg(test)]
mod tests;
