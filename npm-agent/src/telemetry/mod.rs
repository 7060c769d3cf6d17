//! What the agent tells the outside: Prometheus [`metrics`] (an injected
//! registry, no global recorder), rate-limited deny flow logs
//! ([`flowlog`]), Kubernetes Events on policies it cannot fully convert
//! ([`events`]), the shared readiness and liveness state ([`health`]), the
//! live flow stream of `/observe` ([`observe`]) and the HTTP [`server`] of
//! `/metrics`, `/healthz`, `/readyz`, `/explain` and `/observe`, and the
//! reviews of the tokens that may read the named series of `/metrics`
//! ([`authz`]).

pub mod audit;
pub mod authz;
pub mod events;
pub mod flowlog;
pub mod health;
pub mod listener;
pub mod metrics;
pub mod observe;
pub mod rule_metrics;
pub mod server;

pub use self::metrics::{sample, Metrics, MetricsError, PodOperation};
pub use flowlog::FlowLog;
pub use health::{Health, HealthConfig};
pub use observe::ObserveHub;
pub use server::{ServerError, ServerState};
