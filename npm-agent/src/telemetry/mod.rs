//! What the agent tells the outside: Prometheus [`metrics`] (an injected
//! registry, no global recorder), rate-limited deny flow logs
//! ([`flowlog`]), and the HTTP [`server`] of `/metrics`, `/healthz` and
//! `/readyz`.

pub mod flowlog;
pub mod metrics;
pub mod server;

pub use self::metrics::{sample, Metrics, MetricsError, PodOperation};
pub use flowlog::FlowLog;
pub use server::{ServerError, ServerState};
