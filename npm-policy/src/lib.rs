//! npm's pure policy compiler. No I/O: every function here takes values and
//! returns values, so it is tested by tables, goldens and by differential
//! comparison with the reference evaluator.
//!
//! The flow: Kubernetes objects ([`convert`]) -> [`model::Snapshot`] ->
//! [`compile()`] -> [`compiled::Compiled`] -> [`compiled::CompiledDiff`],
//! which `npm-dataplane` writes to the kernel.
#![deny(missing_docs)]

pub mod compiled;
pub mod model;
