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
use std::path::PathBuf;

use npm_policy::compiled::{Compiled, CompiledDiff};

use ebpf::translate::TranslateError;
use ebpf::EbpfError;
use nft::NftError;

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
    /// Whether the record isolates the endpoint for ingress
    /// (`EP_ISOLATED_INGRESS`).
    pub isolated_ingress: bool,
    /// Whether the record isolates the endpoint for egress
    /// (`EP_ISOLATED_EGRESS`).
    pub isolated_egress: bool,
    /// How many of its (ClusterNetworkPolicy tier, direction) pairs have
    /// entries (the eBPF record's `EP_ADMIN_*`/`EP_BASELINE_*` flags, 0 to
    /// 4); 0 where the dataplane tells them otherwise (nftables counts its
    /// tier chains).
    pub tiered_directions: u8,
}

/// Packet and byte counts by direction and verdict reason, summed over CPUs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// ((direction, reason), (packets, bytes)); reasons from `npm_common::Reason`.
    pub by_reason: BTreeMap<(u8, u8), (u64, u64)>,
    /// Per-rule allows and per-endpoint denies, as the kernel counts them
    /// (the agent folds them into `npm_rule_*` and `npm_endpoint_*`).
    pub rules: RuleCounts,
}

impl Counters {
    /// The packets counted in direction `dir` for `reason` (0 if none).
    pub fn packets(&self, dir: u8, reason: npm_common::Reason) -> u64 {
        self.by_reason.get(&(dir, reason as u8)).map_or(0, |c| c.0)
    }

    /// The packets counted for `reason`, both directions.
    pub fn packets_both_ways(&self, reason: npm_common::Reason) -> u64 {
        [npm_common::DIR_INGRESS, npm_common::DIR_EGRESS]
            .iter()
            .map(|d| self.packets(*d, reason))
            .sum()
    }
}

/// The kernel's per-rule and per-endpoint counters: running totals of
/// individual kernel counters ([`KernelCount::source`]), which the reader
/// turns into increments (a total lower than the last reading restarted
/// from 0: its counter was recreated).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RuleCounts {
    /// What [`KernelCount::key`] of `allowed` is: `None` the rule id itself
    /// (nftables), `Some(n)` the rule id modulo `n` (the eBPF slot,
    /// `npm_common::rule_slot`; key `n` is an allow whose rule the
    /// datapath could not tell).
    pub rule_modulus: Option<u32>,
    /// What [`KernelCount::key`] of `denied` is: `None` the endpoint id,
    /// `Some(n)` the endpoint id modulo `n` (eBPF).
    pub endpoint_modulus: Option<u32>,
    /// Packets allowed at a policy decision (the first packet of each new
    /// connection) by NetworkPolicy rule, non-zero counters only.
    pub allowed: Vec<KernelCount>,
    /// Packets NetworkPolicy denied (`Reason::PolicyDenied`) by endpoint and
    /// direction, non-zero counters only.
    pub denied: Vec<KernelCount>,
}

/// One kernel counter's running totals.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct KernelCount {
    /// Which kernel counter (stable while it exists: an eBPF slot, an
    /// nftables rule handle with its chain).
    pub source: u64,
    /// The rule (allowed) or endpoint (denied), see [`RuleCounts`].
    pub key: u32,
    /// `npm_common::DIR_INGRESS` or `DIR_EGRESS`.
    pub direction: u8,
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// Errors of the dataplanes, sorted by what the caller can do about them:
/// a full map ([`DataplaneError::is_map_full`]: raise the map size or shed
/// state) is told apart from a missing capability
/// ([`DataplaneError::is_permission`]: the agent lacks `CAP_BPF`,
/// `CAP_NET_ADMIN` or bpffs access) and from a missing pin
/// ([`DataplaneError::is_missing_pin`]). Each variant keeps the
/// dataplane's own error ([`EbpfError`], [`NftError`]) as its source, and
/// that one the aya or I/O error below it.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    /// A map update was refused because the map is full (`E2BIG` from a
    /// hash at `max_entries`, `ENOSPC` from an LPM trie).
    #[error("map {map} is full: {source}")]
    MapFull {
        /// The full map.
        map: &'static str,
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// The kernel refused for lack of privilege (`EPERM`, or `EACCES`
    /// outside the verifier).
    #[error("{op}: permission denied: {source}")]
    Permission {
        /// The step that was refused ([`EbpfError::step`]).
        op: &'static str,
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// A map is not pinned where a reader expects it.
    #[error("no map pinned at {}", path.display())]
    MissingPin {
        /// The expected pin path.
        path: PathBuf,
    },
    /// An interface index names no interface (the pod's veth is gone).
    #[error("ebpf attach: {source}")]
    NoInterface {
        /// The ifindex.
        ifindex: u32,
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// The eBPF object is missing, unreadable, or lacks a program or map
    /// this loader needs.
    #[error("ebpf object: {source}")]
    Object {
        /// The loader's error.
        #[source]
        source: EbpfError,
    },
    /// A compiled entry cannot be expressed in the maps.
    #[error("ebpf translate: {0}")]
    Translate(#[from] TranslateError),
    /// The kernel refused an operation for another reason.
    #[error("{op}: {source}")]
    KernelRefused {
        /// The step that was refused ([`EbpfError::step`]).
        op: &'static str,
        /// The loader's error (with the aya or I/O error as its source).
        #[source]
        source: EbpfError,
    },
    /// An `nft` command failed.
    #[error("{op}: {source}")]
    Nft {
        /// The command line (or the name that was rejected).
        op: String,
        /// The nftables dataplane's error.
        #[source]
        source: NftError,
    },
    /// A failure known only as text: for implementations of [`Dataplane`]
    /// outside this crate (test doubles); the dataplanes of this crate
    /// report the typed variants above.
    #[error("{op}: {detail}")]
    Kernel {
        /// What was being done.
        op: String,
        /// What went wrong.
        detail: String,
    },
}

impl DataplaneError {
    /// Whether a map is full ([`DataplaneError::MapFull`]).
    pub fn is_map_full(&self) -> bool {
        matches!(self, DataplaneError::MapFull { .. })
    }

    /// Whether a privilege is missing ([`DataplaneError::Permission`]).
    pub fn is_permission(&self) -> bool {
        matches!(self, DataplaneError::Permission { .. })
    }

    /// Whether a map is not pinned where expected
    /// ([`DataplaneError::MissingPin`]).
    pub fn is_missing_pin(&self) -> bool {
        matches!(self, DataplaneError::MissingPin { .. })
    }
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
    /// Connection semantics: the endpoint ids whose established
    /// connections follow policy changes (`enforce`); every other endpoint
    /// keeps its tracked connections until they end (`keep`). Takes effect
    /// from the next [`Dataplane::apply`] or [`Dataplane::sync_full`]: once
    /// that call has programmed a change, a tracked connection of an
    /// `enforce` endpoint that the new policy denies stops passing (eBPF:
    /// its next packet is decided again and dropped, its conntrack entry
    /// marked cut; nftables: its kernel conntrack entry is marked cut
    /// through ctnetlink). An endpoint that enters the set has its tracked
    /// connections judged by the policy in force at that next call, even
    /// an [`Dataplane::apply`] of an empty diff (which the sync loop makes
    /// for an annotation change alone). The default ignores it (a
    /// dataplane without connection tracking of its own).
    fn set_established_enforce(&mut self, _endpoints: std::collections::BTreeSet<u32>) {}
}
