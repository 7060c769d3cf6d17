//! npm's pure policy compiler. No I/O: every function here takes values and
//! returns values, so it is tested by tables, goldens and by differential
//! comparison with the reference evaluator.
//!
//! The flow: Kubernetes objects ([`convert`], checked by [`validate`]) ->
//! [`model::Snapshot`] -> [`compile()`] -> [`compiled::Compiled`] ->
//! [`compiled::CompiledDiff`], which `npm-dataplane` writes to the kernel.
//! [`incremental::Compiler`] keeps caches and updates the compiled form
//! for one changed pod, namespace or policy in well under a millisecond at
//! 10,000 pods; `compile()` stays the reference entry point. Both take
//! IP ownership from [`ownership`] (the one rule of which pod owns an
//! address) and resolve rule peers with the same (private) `peers` module.
//! [`evaluate`] decides flows straight from the specification; [`lookup`]
//! does what the datapath does on a [`compiled::Compiled`]. The simulator
//! (`npmctl`, snapshots from YAML files, matrices) and the conformance case
//! format are the `npm-sim` crate.
#![deny(missing_docs)]

pub mod adopt;
pub mod analysis;
pub mod audit;
pub mod compile;
pub mod compiled;
pub mod convert;
pub mod evaluate;
pub mod fold;
pub mod identity;
pub mod incremental;
pub mod lookup;
pub mod model;
pub mod nodes;
pub mod numbers;
pub mod ownership;
mod peers;
pub mod policy_map;
pub mod render;
pub mod selector;
pub mod tiers;
pub mod validate;

pub use compile::compile;
