//! npm's pure policy compiler. No I/O: every function here takes values and
//! returns values, so it is tested by tables, goldens and by differential
//! comparison with the reference evaluator.
//!
//! The flow: Kubernetes objects ([`convert`], checked by [`validate`]) ->
//! [`model::Snapshot`] -> [`compile()`] -> [`compiled::Compiled`] ->
//! [`compiled::CompiledDiff`], which `npm-dataplane` writes to the kernel.
//! [`incremental::Compiler`] keeps caches and updates the compiled form
//! for one changed pod, namespace or policy in well under a millisecond at
//! 10,000 pods; `compile()` stays the reference entry point.
//! [`evaluate`] decides flows straight from the specification; [`lookup`]
//! does what the datapath does on a [`compiled::Compiled`]; [`cases`] and
//! [`sim`] run conformance cases and matrices on the two.
#![deny(missing_docs)]

pub mod cases;
pub mod compile;
pub mod compiled;
pub mod convert;
pub mod evaluate;
pub mod identity;
pub mod incremental;
pub mod lookup;
pub mod model;
pub mod render;
pub mod selector;
pub mod sim;
pub mod validate;

pub use compile::compile;
