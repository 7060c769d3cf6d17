//! The sync loop's settings, their defaults, and the check that rejects
//! settings that cannot work.

use std::time::Duration;

use npm_policy::compiled::CompileOptions;
use npm_policy::numbers::NumberLimits;

use crate::k8s::ClusterPolicyMode;
use crate::node::NodeAddresses;

/// A setting of the sync loop that cannot work.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum ConfigError {
    /// The mass-deletion threshold is not a share strictly between 0 and 1.
    #[error("--mass-delete-threshold must be within 0..1 (exclusive), got {value}")]
    MassDeleteThreshold {
        /// The value given.
        value: f64,
    },
    /// The stats interval is zero.
    #[error("stats interval must be positive, got {value:?}")]
    StatsInterval {
        /// The value given.
        value: Duration,
    },
}

/// Shortest time between two direct reads of the mass-deletion guard that
/// did not confirm a deletion (the time doubles after each such read).
pub const DIRECT_READ_MIN_BACKOFF: Duration = Duration::from_secs(1);
/// Longest time between two direct reads of the mass-deletion guard.
pub const DIRECT_READ_MAX_BACKOFF: Duration = Duration::from_secs(60);

/// Default coalescing time of changes before a sync, in milliseconds.
pub const DEFAULT_DEBOUNCE_MS: u64 = 20;

/// Settings of the sync loop.
#[derive(Clone, Debug)]
pub struct SyncConfig {
    /// Compile options (node name, node addresses, host egress).
    pub compile: CompileOptions,
    /// How long changes are coalesced, counted from the oldest change not
    /// yet programmed, before a sync.
    pub debounce: Duration,
    /// Share (0..=1) of pod identities or endpoints whose removal is held
    /// for a direct read: in one sync, or cumulatively against the highest
    /// count programmed within `mass_delete_window` since the last
    /// confirmation (see the module doc).
    pub mass_delete_threshold: f64,
    /// How long a programmed count stays the reference of the cumulative
    /// mass-deletion check, unless a direct read confirms the state earlier
    /// (which resets the reference). Removals slower than this are not held.
    pub mass_delete_window: Duration,
    /// Page size of the direct reads.
    pub page_size: u32,
    /// Longest retry backoff.
    pub max_backoff: Duration,
    /// How often dataplane counters and deny events are read.
    pub stats_interval: Duration,
    /// Deny events logged per second at most.
    pub flow_logs_per_sec: u32,
    /// `--flow-logs-allow`: every local endpoint reports its allowed new
    /// connections (`report_new`, decided in [`super::report_new`]).
    pub flow_logs_allow: bool,
    /// How often the incremental compile is checked against a full compile,
    /// in the background (`Duration::ZERO`: after every sync, one check at a
    /// time; debug builds check after every sync).
    pub cross_check_interval: Duration,
    /// This node's addresses, kept current (`None`: `compile.node_ips`
    /// stays as given). They replace `compile.node_ips`, a change
    /// recompiles, and nothing is programmed before a first successful
    /// read; while they are unreadable the last good set stays in force
    /// and the readiness check `node-addresses` fails.
    pub node_addresses: Option<NodeAddresses>,
    /// Whether ClusterNetworkPolicies are watched and what a `404` on
    /// their list means (`--cluster-network-policies`): the agent builds
    /// its cache with it ([`crate::k8s::Cache::with_cluster_policies`]);
    /// the watchers and the direct reads of the mass-removal guard follow
    /// the cache's mode.
    pub cluster_policies: ClusterPolicyMode,
    /// At every stats tick, check that the traffic of endpoints on a bridge
    /// port reaches the nftables table (`br_netfilter` and its sysctls:
    /// [`crate::node::bridge_nf`]); set with the nftables dataplane.
    pub bridge_netfilter: Option<crate::node::bridge_nf::BridgeNfConfig>,
    /// How long past its grace period a deleting pod of another node keeps
    /// claiming its address ([`super::expiry`]).
    pub deleting_claim_slack: Duration,
    /// The range of each kind of number the compiler hands out (the
    /// datapath's by default; smaller in tests): a sync that needs a
    /// number past its range is refused ([`super::SyncError::NumbersExhausted`]).
    pub numbers: NumberLimits,
    /// Connection semantics by default (`--established`), overridden per
    /// namespace by `npm.io/established` ([`super::established`]).
    pub established: super::established::Established,
}

impl Default for SyncConfig {
    fn default() -> Self {
        SyncConfig {
            compile: CompileOptions::default(),
            debounce: Duration::from_millis(DEFAULT_DEBOUNCE_MS),
            mass_delete_threshold: 0.5,
            mass_delete_window: Duration::from_secs(600),
            page_size: 500,
            max_backoff: Duration::from_secs(30),
            stats_interval: Duration::from_secs(5),
            flow_logs_per_sec: 10,
            flow_logs_allow: false,
            cross_check_interval: Duration::from_secs(300),
            node_addresses: None,
            cluster_policies: ClusterPolicyMode::Auto,
            bridge_netfilter: None,
            deleting_claim_slack: super::expiry::DEFAULT_SLACK,
            numbers: NumberLimits::default(),
            established: super::established::Established::Keep,
        }
    }
}

impl SyncConfig {
    /// Check the settings that would make the loop misbehave or panic: the
    /// mass-deletion threshold must be strictly between 0 and 1 (not NaN)
    /// and the stats interval positive.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let t = self.mass_delete_threshold;
        if !(t > 0.0 && t < 1.0) {
            return Err(ConfigError::MassDeleteThreshold { value: t });
        }
        if self.stats_interval.is_zero() {
            return Err(ConfigError::StatsInterval {
                value: self.stats_interval,
            });
        }
        Ok(())
    }
}
