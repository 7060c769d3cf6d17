//! The simulator behind `npmctl`: builds a snapshot from YAML texts and
//! computes reachability matrices and flow explanations with the reference
//! evaluator.
//!
//! The snapshot loading and matrices are `npm_policy::sim` (re-exported
//! here) while `npm-agent matrix` still calls them there.

use npm_policy::compiled::CompileOptions;
use npm_policy::evaluate::{evaluate, Flow, Verdict};
use npm_policy::model::{Protocol, Snapshot};
pub use npm_policy::sim::{load_snapshot, matrix, pods, sim_options, Matrix, Mismatch, SimError, SIM_NODE};

/// Errors of [`explain`].
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// A pod reference does not name an addressable pod.
    #[error("pod {0:?} not found or without an address (want namespace/name)")]
    NoPod(String),
}

/// Explains the flow from pod `from` to pod `to` (`namespace/name`).
pub fn explain(
    snapshot: &Snapshot,
    opts: &CompileOptions,
    from: &str,
    to: &str,
    protocol: Protocol,
    port: u16,
) -> Result<Verdict, ExplainError> {
    let pods = pods(snapshot);
    let ip = |n: &str| {
        pods.iter()
            .find(|(p, _)| p == n)
            .map(|(_, ip)| *ip)
            .ok_or_else(|| ExplainError::NoPod(n.to_string()))
    };
    let (src, dst) = (ip(from)?, ip(to)?);
    Ok(evaluate(
        snapshot,
        opts,
        &Flow {
            src,
            dst,
            protocol: protocol.number(),
            dst_port: port,
        },
    ))
}
