//! npm's policy tooling on top of the pure compiler `npm-policy`: the
//! `npmctl` simulator and the conformance case format.
//!
//! - [`sim`]: snapshots from YAML texts, reachability matrices and flow
//!   explanations by the reference evaluator (behind `npmctl`);
//! - [`analysis`]: flow records read for `npmctl preview` (the analyses
//!   behind `lint`, `exposure` and `preview` are `npm_policy::analysis`);
//! - [`cases`]: conformance case files (format, placeholders, the pristine
//!   model the cases run on, simulated runs on the evaluator and the
//!   compiled lookup), shared by `npmctl cases` and the e2e runner.
#![deny(missing_docs)]

pub mod analysis;
pub mod cases;
pub mod ports;
pub mod sim;
