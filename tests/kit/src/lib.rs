//! What the workspace's tests share, instead of each test file keeping its
//! own copy (a dev-dependency only, never published):
//!
//! - [`policy`]: `npm_policy::model` builders (pods, snapshots, compile
//!   options) for the compiler's table tests;
//! - [`k8s`]: `k8s-openapi` builders (pods, namespaces) for the API
//!   server and the agent;
//! - [`netns`]: commands, network namespaces deleted on drop, threads
//!   inside a namespace, the sweep of what a crashed run left;
//! - [`http`]: one-shot HTTP GETs and the wait for a `/readyz` answer;
//! - [`rng`]: the one way a randomized test takes its seed (an
//!   environment variable, printed so that a failure can be rerun).
#![deny(missing_docs)]

pub mod http;
pub mod k8s;
pub mod netns;
pub mod policy;
pub mod rng;
