//! The npm node agent: watches pods, namespaces and NetworkPolicies, keeps
//! the kernel dataplane equal to the compiled policy of its node, and
//! exports metrics and health.
//!
//! - [`watch`]: watchers and the complete-list-only cache (incident 2);
//! - [`compiler`]: the calls into `npm-policy`;
//! - [`dataplanes`]: opening the eBPF or nftables dataplane;
//! - [`inspect`]: `npm-agent inspect`;
//! - [`endpoints`]: host-side interfaces of local endpoints;
//! - [`sync`]: the level-triggered sync loop and the mass-deletion guard;
//! - [`metrics`], [`server`]: Prometheus metrics, `/healthz`, `/readyz`;
//! - [`flowlog`]: rate-limited deny flow logs;
//! - [`agent`]: wiring of all of the above (used by `main` and the tests).
#![deny(missing_docs)]

pub mod agent;
pub mod compiler;
pub mod dataplanes;
pub mod endpoints;
pub mod flowlog;
pub mod inspect;
pub mod metrics;
pub mod server;
pub mod sync;
pub mod watch;
