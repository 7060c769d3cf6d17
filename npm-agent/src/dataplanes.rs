//! Opening the dataplane the agent was asked for (`--dataplane`), and the
//! [`AgentDataplane`] glue of each implementation.

use std::path::PathBuf;

use npm_common::DenyEvent;
use npm_dataplane::ebpf::{
    check_kernel, default_pin_dir, AttachMode, EbpfDataplane, EbpfOptions, MapSizes, MissingFeatures,
};
use npm_dataplane::nft::{NftDataplane, NftOptions};
use npm_dataplane::AdoptedEndpoint;

use crate::sync::AgentDataplane;

/// Errors opening a dataplane.
#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    /// The nftables dataplane rejected its options.
    #[error("nftables dataplane (table {table:?}): {source}")]
    Nft {
        /// Table name.
        table: String,
        /// The error.
        #[source]
        source: npm_dataplane::nft::NftError,
    },
    /// The kernel lacks what the eBPF datapath needs (checked before
    /// anything is loaded; names every missing feature).
    #[error("eBPF dataplane: {0}")]
    Kernel(#[from] MissingFeatures),
    /// The eBPF dataplane could not be opened.
    #[error("eBPF dataplane (pin dir {pin_dir:?}, object {object:?}): {detail}")]
    Ebpf {
        /// Pin directory asked for.
        pin_dir: Option<PathBuf>,
        /// Object asked for.
        object: Option<PathBuf>,
        /// What went wrong.
        detail: String,
    },
}

/// Which dataplane programs the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum DataplaneKind {
    /// The eBPF datapath (tcx programs on the pods' host-side interfaces).
    Ebpf,
    /// The nftables table.
    Nftables,
}

/// Options of both dataplanes.
#[derive(Clone, Debug, Default)]
pub struct DataplaneOptions {
    /// eBPF object path (`None`: the loader's default search).
    pub bpf_object: Option<PathBuf>,
    /// bpffs pin directory (`None`: the loader's default).
    pub pin_dir: Option<PathBuf>,
    /// How the eBPF programs are attached (`--attach`).
    pub attach: AttachMode,
    /// Sizes of the eBPF maps created (`--map-size-*`; pinned maps keep
    /// theirs).
    pub map_sizes: MapSizes,
    /// nftables table name.
    pub nft_table: String,
}

impl AgentDataplane for NftDataplane {
    /// The connections cut under `enforce` since the last call, then the
    /// NFLOG events of the table's `log` rules (`npm_dataplane::nft::nflog`).
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        let mut events = self.take_cut_events();
        events.extend(self.poll_flow_events());
        events
    }
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        self.adopted().map(|a| (a.identities, a.endpoints.len()))
    }
    fn adopted_endpoints(&self) -> Vec<AdoptedEndpoint> {
        self.adopted().map(|a| a.endpoints.clone()).unwrap_or_default()
    }
    /// The table's tier chains (one per endpoint, direction and tier with
    /// entries).
    fn adopted_tier_directions(&self) -> Option<usize> {
        self.adopted().map(|a| a.tier_chains)
    }
}

/// Open the dataplane of `kind`.
pub fn open(kind: DataplaneKind, opts: &DataplaneOptions) -> Result<Box<dyn AgentDataplane>, OpenError> {
    match kind {
        DataplaneKind::Nftables => {
            let mut dp = NftDataplane::new(NftOptions {
                table: opts.nft_table.clone(),
                netns: None,
            })
            .map_err(|source| OpenError::Nft {
                table: opts.nft_table.clone(),
                source,
            })?;
            // Flow events are best effort: without them the dataplane still
            // enforces (the flow log stays empty).
            if let Err(e) = dp.open_flow_events() {
                tracing::warn!(error = %e, "nftables flow events (NFLOG) unavailable: no flow logs");
            }
            Ok(Box::new(dp))
        }
        DataplaneKind::Ebpf => open_ebpf(opts),
    }
}

impl AgentDataplane for EbpfDataplane {
    fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        EbpfDataplane::poll_deny_events(self)
    }
    fn adopted_counts(&self) -> Option<(usize, usize)> {
        Some(EbpfDataplane::adopted_counts(self))
    }
    fn adopted_endpoints(&self) -> Vec<AdoptedEndpoint> {
        EbpfDataplane::adopted_endpoints(self).to_vec()
    }
    /// The adopted endpoint records' tier flags (per endpoint, each
    /// direction and tier with entries).
    fn adopted_tier_directions(&self) -> Option<usize> {
        Some(
            EbpfDataplane::adopted_endpoints(self)
                .iter()
                .map(|e| e.tiered_directions as usize)
                .sum(),
        )
    }
    fn adopted_numbers(&self) -> npm_policy::adopt::AdoptedNumbers {
        EbpfDataplane::adopted_numbers(self).clone()
    }
    fn map_fill(&self) -> Vec<npm_dataplane::ebpf::MapFill> {
        EbpfDataplane::map_fill(self)
    }
    fn events_lost(&self) -> Option<u64> {
        EbpfDataplane::events_lost(self).ok()
    }
    fn reduced_datapath(&self) -> Option<bool> {
        Some(EbpfDataplane::reduced_datapath(self))
    }
    fn attach_mode(&self) -> Option<&'static str> {
        Some(match EbpfDataplane::attach_mode(self) {
            npm_dataplane::ebpf::AttachMode::Tc => "tc",
            _ => "tcx",
        })
    }
    fn fit(
        &self,
        programmed: Option<&npm_policy::compiled::Compiled>,
        diff: Option<&npm_policy::compiled::CompiledDiff>,
        target: &npm_policy::compiled::Compiled,
    ) -> Result<Option<npm_dataplane::ebpf::Fitted>, npm_dataplane::DataplaneError> {
        if let Some(d) = diff {
            if self.diff_fits(d)? {
                return Ok(None);
            }
        }
        Ok(EbpfDataplane::fit(self, programmed, target)?)
    }
}

/// The eBPF dataplane's options for `opts` (default pin dir when unset).
pub fn ebpf_options(opts: &DataplaneOptions) -> EbpfOptions {
    EbpfOptions {
        object: opts.bpf_object.clone(),
        pin_dir: opts.pin_dir.clone().unwrap_or_else(default_pin_dir),
        bench_no_ct_create: false,
        attach: opts.attach,
    }
}

fn open_ebpf(opts: &DataplaneOptions) -> Result<Box<dyn AgentDataplane>, OpenError> {
    let eo = ebpf_options(opts);
    let features = check_kernel(eo.attach)?;
    tracing::info!(attach = %eo.attach, tcx = features.tcx, clsact = ?features.clsact, "kernel features checked");
    let dp = EbpfDataplane::open_sized(eo.clone(), opts.map_sizes).map_err(|e| OpenError::Ebpf {
        pin_dir: Some(eo.pin_dir.clone()),
        object: eo.object.clone(),
        detail: e.to_string(),
    })?;
    Ok(Box::new(dp))
}
