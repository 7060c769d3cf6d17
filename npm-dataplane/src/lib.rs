//! The dataplanes of npm: they take the compiled policy of `npm-policy`
//! ([`npm_policy::compiled::Compiled`] and its diffs) and program the kernel.
//!
//! - [`ebpf`]: the aya loader of `npm-ebpf`: pinned maps, tcx links on each
//!   endpoint's host-side veth, incremental map writes.
//! - [`nft`]: the same compiled policy rendered as an nftables ruleset.
#![deny(missing_docs)]

pub mod ebpf;
pub mod nft;

use std::collections::BTreeMap;

use npm_policy::compiled::{Compiled, CompiledDiff};

/// Endpoint id -> ifindex of the endpoint's host-side interface.
pub type Interfaces = BTreeMap<u32, u32>;

/// An endpoint record a dataplane found programmed when it was opened
/// (left by a previous agent).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AdoptedEndpoint {
    /// Host-side interface of the record.
    pub ifindex: u32,
    /// Endpoint id the previous agent gave it.
    pub id: u32,
    /// Its IPv4 address, if any.
    pub ipv4: Option<std::net::Ipv4Addr>,
    /// Its IPv6 address, if any.
    pub ipv6: Option<std::net::Ipv6Addr>,
}

/// Packet and byte counts by direction and verdict reason, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// ((direction, reason), (packets, bytes)); reasons from `npm_common::Reason`.
    pub by_reason: BTreeMap<(u8, u8), (u64, u64)>,
}

/// Errors common to the dataplanes.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// A kernel or tool operation failed.
    #[error("{op}: {detail}")]
    Kernel {
        /// What was being done (names the map, interface or command).
        op: String,
        /// What went wrong.
        detail: String,
    },
}

/// A dataplane keeps the kernel equal to a compiled policy.
///
/// Both implementations are driven by the agent the same way: one
/// [`Dataplane::sync_full`] after the first complete list (mark and sweep
/// against what the kernel already holds, e.g. pinned state from a previous
/// agent), then [`Dataplane::apply`] with the diff of every recompile.
pub trait Dataplane {
    /// Make the kernel hold exactly `compiled`, removing anything else it holds.
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError>;
    /// Apply `diff`, which takes the programmed state to `next`. `interfaces`
    /// covers every endpoint of `next`; attach and detach follow it.
    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError>;
    /// Counters of allowed and denied packets.
    fn counters(&self) -> Result<Counters, DataplaneError>;
}
