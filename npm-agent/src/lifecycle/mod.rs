//! A node's npm lifecycle outside the sync loop: what the chart's init
//! containers, uninstall hooks and the agent's start-up run.
//!
//! - [`bpffs`]: `npm-agent mount-bpffs`: bpffs on the host before any agent;
//! - [`lock`]: one agent per pin directory (`--lock-dir`);
//! - [`cleanup`]: `npm-agent cleanup`: every program, pin, nftables table
//!   and npm-cni entry removed from a node;
//! - [`uninstall`]: `npm-agent uninstall stop-agents|wait-cleanup`: the
//!   pre-delete hook Jobs (stop the agents, wait for every node's cleanup);
//! - [`pause`]: `npm-agent pause`: the cleanup pods' main container.

pub mod bpffs;
pub mod cleanup;
pub mod lock;
pub mod pause;
pub mod uninstall;
