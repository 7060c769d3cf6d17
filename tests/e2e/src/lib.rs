//! npm's end-to-end conformance suite on real network-namespace pods.
//!
//! - [`cluster`]: the netns cluster (pods are netns with veths to the root
//!   netns, serving TCP/UDP 80 and 81, SCTP on crafted packets).
//! - [`probe`]: parallel TCP/UDP/SCTP probes with retries.
//! - [`runner`]: runs the case catalogue (`tests/conformance/*.yaml`)
//!   against the simulator or a real agent.
#![deny(missing_docs)]

pub mod api;
pub mod cluster;
pub mod demo;
pub mod netns;
pub mod probe;
pub mod runner;
pub mod server;
