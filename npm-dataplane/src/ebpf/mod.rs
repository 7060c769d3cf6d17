//! The aya loader and programmer of the `npm-ebpf` datapath.
//!
//! [`EbpfDataplane::open`] loads the object with every map of
//! `npm_common::maps::ALL` pinned under a pin directory (default
//! `/sys/fs/bpf/npm/v<LAYOUT_VERSION>`). Maps already pinned there are
//! adopted, not recreated, so enforcement state survives an agent restart.
//!
//! Each endpoint's host-side veth gets two programs (`to_pod` on the
//! *egress* hook: packets entering the pod; `from_pod` on the *ingress*
//! hook: packets leaving the pod), attached in one of two modes
//! ([`AttachMode`]): tcx links pinned as `<pin dir>/links/<ifindex>-ingress`
//! and `<ifindex>-egress` (Linux 6.6), or a `clsact` qdisc with npm's
//! netlink `bpf` filters (fixed priority and handle). On open, every pinned
//! link and every npm filter of this pin directory is adopted and its
//! program replaced atomically (`BPF_LINK_UPDATE`; a filter replace at the
//! same priority and handle), so no packet passes unenforced during a
//! restart. Both outlive the loader: the program stays attached with no
//! loader running. [`check_kernel`] tells what the kernel lacks before
//! anything is loaded.
//!
//! Maps are written in the order documented on
//! [`npm_policy::compiled::CompiledDiff`]: upserts (policy and tier
//! entries, ipcache and CIDRs, endpoints), then removals in the same order.
//!
//! Where each step lives:
//!
//! | file | owns |
//! |---|---|
//! | `loader.rs` | finding the object, loading it with pinned maps, the verifier load (`EAGAIN` retry) |
//! | `pins.rs` | bpffs, the pin directory layout, other layouts: migration on open, retirement after a full sync |
//! | `links.rs` | the attach modes: tcx links and tc filters, attach, detach and adoption |
//! | `services.rs` | `NPM_SERVICES`, the Service keys whose egress decision is deferred past the DNAT, written level-triggered |
//! | `node_exit.rs` | the `node_exit` program on the node's interfaces towards other nodes (its own load, pinned tcx links under `exit/`) |
//! | `tc_filters.rs` | npm's tc priority and handle, the netlink dump of `clsact` filters, which belong to a pin directory |
//! | `features.rs` | the kernel feature check ([`check_kernel`]) and the tcx probe |
//! | `fill.rs` | how full each map is ([`MapFill`]), counted from what the writer wrote |
//! | `fit.rs` | degraded mode: the largest fail-closed part of a compiled state that fits the maps ([`Fitted`]) |
//! | `writer.rs` | apply and full sync in the documented order, the sweep, flow purges |
//! | `ct_worker.rs` | the conntrack worker thread: flow purges and quota passes off the sync thread |
//! | `batch.rs` | the `bpf(2)` batch lookups and deletes (a chunk of entries a syscall) |
//! | `endpoints.rs`, `ipcache.rs` (+ `ipcache4.rs`), `cidr.rs`, `policy.rs` (+ `policy_flags.rs`), `tiers.rs`, `fold.rs`, `conntrack.rs`, `counters.rs` | one map table each: its keys, writes, removals and sweep |
//! | `translate.rs` | compiled entries -> map keys and values (no kernel access) |
//! | `dump.rs` | reading the maps back (`inspect`) |
//! | `errors.rs` | [`EbpfError`] and its conversion into [`crate::DataplaneError`] |
//! | `testing.rs` | `BPF_PROG_TEST_RUN` helpers and benchmark switches (feature `testing`) |
//! | `explain.rs` | `npm-agent explain`: a dry run of the attached program on a crafted packet |

mod adopt_numbers;
mod batch;
mod cidr;
mod conntrack;
mod counters;
mod ct_worker;
mod dump;
mod endpoints;
mod epochs;
mod errors;
pub mod explain;
mod features;
mod fill;
mod fit;
mod fold;
mod host_in;
mod ipcache;
mod ipcache4;
mod links;
mod loader;
mod node_exit;
mod pins;
mod policy;
mod policy_flags;
mod services;
mod shared_words;
pub mod tc_filters;
#[cfg(feature = "testing")]
mod testing;
mod tiers;
pub mod translate;
mod writer;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use aya::maps::{HashMap as BpfHashMap, MapData};
use aya::Ebpf;
use npm_common::{maps, CtKey, CtValue, DenyEvent, IpInfo, IpKey};
use npm_policy::compiled::{Compiled, CompiledDiff};

use crate::{AdoptedEndpoint, Counters, Dataplane, DataplaneError, Interfaces};

pub use ct_worker::{FlowPurges, QUOTA_PASS_INTERVAL, WORKER_THREAD};
pub use dump::{
    dump_pinned, pinned_link_programs, DumpCidr, DumpCounter, DumpEndpoint, DumpIp, DumpPolicy, DumpTier, EbpfDump,
};
pub use errors::EbpfError;
pub use features::{check_kernel, tcx_supported, KernelFeatures, Missing, MissingFeatures};
pub use fill::{MapFill, DATAPATH_COUNT_INTERVAL};
pub use fit::{Fitted, Shortfall};
pub use host_in::{
    host_in_chain, host_in_pin, remove_host_in_rules, remove_stale_host_in_chains, HostIn, HostInMode,
    HOST_IN_CHAIN_PREFIX, PROG_HOST_IN,
};
pub use links::{remove_pinned_filters, AttachMode};
#[cfg(feature = "testing")]
pub use loader::BenchSwitches;
pub use loader::{
    pinned_ct_cap, pressure_threshold, resolve_object, EffectiveSizes, MapSizes, INSTALLED_OBJECT, MAP_SIZE_MAX,
    MAP_SIZE_MIN, OBJECT_ENV,
};
pub use node_exit::{exit_dir, exit_program, remove_node_exit_filters, remove_node_exit_pins, NodeExit};
pub use pins::{default_pin_dir, ensure_bpffs};
pub use services::{ServicePort, ServicesMap, ServicesSync};
#[cfg(feature = "testing")]
pub use testing::TracedRun;

use cidr::CidrTable;
use conntrack::Flows;
use counters::Reports;
use endpoints::EndpointTable;
use fold::FoldTable;
use ipcache::IpcacheTable;
use links::Hook;
use policy::PolicyTable;
use tiers::TierTable;

/// Program attached on the egress hook of the host-side veth (packets
/// entering the pod).
pub const PROG_INGRESS: &str = "to_pod";
/// Program attached on the ingress hook of the host-side veth (packets
/// leaving the pod).
pub const PROG_EGRESS: &str = "from_pod";
/// Program attached on the egress hook of the node's interfaces towards
/// other nodes: the deferred egress decision of Service traffic
/// ([`NodeExit`]).
pub const PROG_NODE_EXIT: &str = "node_exit";
/// [`PROG_NODE_EXIT`] for devices without an Ethernet header (IPIP,
/// WireGuard, GRE, TUN): the packet starts at its IP header.
pub const PROG_NODE_EXIT_L3: &str = "node_exit_l3";
/// Trivial program returning `TC_ACT_UNSPEC`: the benchmark baseline.
pub const PROG_EMPTY: &str = "npm_empty";
/// Verdict of an allowed packet (`TC_ACT_UNSPEC`, tcx `TCX_NEXT`).
pub const VERDICT_ALLOW: i32 = -1;
/// Verdict of a dropped packet (`TC_ACT_SHOT`).
pub const VERDICT_DROP: i32 = 2;

/// How to open the dataplane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EbpfOptions {
    /// The object to load; `None` resolves it with [`resolve_object`].
    pub object: Option<PathBuf>,
    /// Where maps and links are pinned (adopted when already there).
    pub pin_dir: PathBuf,
    /// Benchmark only: allowed new flows do not create conntrack entries, so
    /// repeated test runs measure the policy path. Never set in production.
    pub bench_no_ct_create: bool,
    /// How the programs are attached: tcx, tc, or `Auto` (tcx where the
    /// kernel has it, else tc; the mode found on the node is kept).
    pub attach: AttachMode,
}

impl Default for EbpfOptions {
    fn default() -> Self {
        EbpfOptions {
            object: None,
            pin_dir: default_pin_dir(),
            bench_no_ct_create: false,
            attach: AttachMode::Auto,
        }
    }
}

/// The eBPF dataplane: the loaded object, its pinned maps and the attached
/// hooks (tcx links or tc filters).
pub struct EbpfDataplane {
    bpf: Ebpf,
    pin_dir: PathBuf,
    endpoints: EndpointTable,
    ipcache: IpcacheTable,
    cidrs: CidrTable,
    policy: PolicyTable,
    tiers: TierTable,
    /// `NPM_FOLD`: the folded decisions of subjects with tier entries.
    fold: FoldTable,
    flows: Flows,
    /// The conntrack worker: purges and the quota's recount, off the sync
    /// thread (`ct_worker.rs`).
    ct_worker: ct_worker::CtWorker,
    reports: Reports,
    /// `NPM_EP_EPOCH` and the endpoints under connection semantics
    /// `enforce` (`epochs.rs`).
    epochs: epochs::Epochs,
    /// (ifindex, pod direction) -> the attached hook (a tcx link pinned
    /// under `links/`, or npm's tc filter).
    links: BTreeMap<(u32, u8), Hook>,
    /// Hooks where an npm tc filter of this pin directory runs besides the
    /// tcx link in `links` (a mode change interrupted by a restart).
    doubled: BTreeSet<(u32, u8)>,
    /// The attach mode in use (never `Auto`).
    mode: AttachMode,
    /// Endpoint id -> ifindex it is programmed at.
    programmed: BTreeMap<u32, u32>,
    /// Endpoint id -> the record last written for it (subject and flags
    /// included).
    written: BTreeMap<u32, npm_common::EndpointInfo>,
    /// (pod identities, endpoints) found in the maps at open.
    adopted: (usize, usize),
    /// The endpoint records found at open.
    adopted_endpoints: Vec<AdoptedEndpoint>,
    /// The identity, CIDR and rule numbers found at open.
    adopted_numbers: npm_policy::adopt::AdoptedNumbers,
    /// Whether a full sync succeeded.
    full_synced: bool,
    /// What the writer wrote, counted (`fill.rs`).
    fill: fill::Fill,
    /// The configured and the actual sizes of the configurable maps.
    sizes: EffectiveSizes,
    /// The programs were loaded without their precomputed form
    /// ([`loader::BenchSwitches::reduced`]).
    reduced: bool,
    /// The owner ([`npm_policy::compiled::IpEntry::owner`]) of each pod
    /// address written to the ipcache since open: an address that leaves
    /// it or comes back under another owner has its flows purged
    /// (`writer.rs`). Empty after open (the kernel's ipcache holds no
    /// owners): a change of hands while no agent ran is not seen.
    owners: std::collections::HashMap<std::net::IpAddr, u64>,
}

impl fmt::Debug for EbpfDataplane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EbpfDataplane")
            .field("pin_dir", &self.pin_dir)
            .field("mode", &self.mode)
            .field("links", &self.links.keys().collect::<Vec<_>>())
            .field("programmed", &self.programmed)
            .finish()
    }
}

/// What a previous agent left in an ipcache and endpoint table: ((pod
/// identities, endpoints), the endpoint records).
type AdoptedState = ((usize, usize), Vec<AdoptedEndpoint>);

/// The [`AdoptedState`] of an ipcache and the records of an endpoint
/// table: the distinct pod identities
/// (`IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR`) of the ipcache, and every
/// record.
fn adopted_state(
    ipcache: &BpfHashMap<MapData, IpKey, IpInfo>,
    records: Vec<AdoptedEndpoint>,
) -> Result<AdoptedState, EbpfError> {
    let identities = ipcache::pod_identities(ipcache)?;
    Ok(((identities, records.len()), records))
}

impl EbpfDataplane {
    /// Loads the object, creating or adopting the pinned maps under
    /// `opts.pin_dir`, and adopts every pinned link there (replacing its
    /// program atomically with the newly loaded one).
    pub fn open(opts: EbpfOptions) -> Result<Self, EbpfError> {
        Self::open_sized(opts, MapSizes::default())
    }

    /// [`EbpfDataplane::open`] creating the configurable maps with `sizes`
    /// (validated first: [`MapSizes::validate`]). A map already pinned keeps
    /// its own size: the pins are adopted so that enforcement and tracked
    /// connections survive the restart, the difference is logged, and the
    /// configured size applies once the pins are removed (`npm-agent
    /// cleanup`, a reboot); [`EbpfDataplane::map_sizes`] tells both.
    pub fn open_sized(opts: EbpfOptions, sizes: MapSizes) -> Result<Self, EbpfError> {
        Self::open_switched_sized(opts, sizes, loader::BenchSwitches::default())
    }

    /// [`EbpfDataplane::open`] with benchmark switches (the defaults in
    /// production).
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    fn open_switched(opts: EbpfOptions, switches: loader::BenchSwitches) -> Result<Self, EbpfError> {
        Self::open_switched_sized(opts, MapSizes::default(), switches)
    }

    fn open_switched_sized(
        opts: EbpfOptions,
        map_sizes: MapSizes,
        switches: loader::BenchSwitches,
    ) -> Result<Self, EbpfError> {
        map_sizes.validate()?;
        let (object, data) = loader::read_object(opts.object.as_deref())?;
        let pin_dir = opts.pin_dir.clone();
        pins::prepare(&pin_dir)?;
        let load = |switches| loader::load(&object, &data, &pin_dir, &map_sizes, opts.bench_no_ct_create, switches);
        // Where the kernel's verifier refuses the whole program (older
        // verifiers prune less): the datapath without its precomputed
        // form, the same verdicts from the LPMs.
        let (mut bpf, reduced) = loader::load_or_reduced(loader::Programs::Pods, switches, load)?;
        let sizes = pins::effective_sizes(&bpf, &pin_dir, map_sizes)?;
        let endpoints = EndpointTable::take(&mut bpf)?;
        let ipcache = IpcacheTable::take(&mut bpf)?;
        let cidrs = CidrTable::take(&mut bpf)?;
        let policy = PolicyTable::take(&mut bpf)?;
        let tiers = TierTable::take(&mut bpf)?;
        let fold = FoldTable::take(&mut bpf)?;
        let flows = Flows::take(&mut bpf)?;
        let ct_worker = {
            let quota: aya::maps::Array<MapData, u64> = loader::take_map(&mut bpf, maps::CT_QUOTA)?;
            let (words, _) =
                shared_words::SharedWords::map_array(aya::maps::IterableMap::map(&quota), 1, maps::CT_QUOTA)?;
            let fill: aya::maps::Array<MapData, u64> = loader::take_map(&mut bpf, maps::CT_FILL)?;
            let (fill, _) = shared_words::SharedWords::map_array(aya::maps::IterableMap::map(&fill), 1, maps::CT_FILL)?;
            // The pressure thresholds, from the sizes the maps have (a
            // pinned map keeps its own), before any program of this load
            // is attached.
            let threshold = loader::node_pressure_threshold(sizes.actual.conntrack);
            for base in [npm_common::CT_FILL_CT, npm_common::CT_FILL_CT4] {
                fill.words()[(base + npm_common::CT_FILL_PRESSURE) as usize]
                    .store(threshold, std::sync::atomic::Ordering::Release);
            }
            let [ct, ct4, frags] = flows.dup_fds()?;
            let cap = loader::ct_cap(&map_sizes, switches);
            // For the programs loaded beside the pins (`load_beside_pins`).
            for base in [npm_common::CT_FILL_CT, npm_common::CT_FILL_CT4] {
                fill.words()[(base + npm_common::CT_FILL_CAP) as usize]
                    .store(u64::from(cap), std::sync::atomic::Ordering::Release);
            }
            let cap = if cap == u32::MAX { u64::MAX } else { cap as u64 };
            ct_worker::CtWorker::start(
                ct,
                ct4,
                frags,
                std::sync::Arc::new(words),
                std::sync::Arc::new(fill),
                cap,
            )?
        };
        let reports = Reports::take(&mut bpf)?;
        let epochs = epochs::Epochs::take(&mut bpf)?;
        let mut dp = EbpfDataplane {
            bpf,
            pin_dir,
            endpoints,
            ipcache,
            cidrs,
            policy,
            tiers,
            fold,
            flows,
            ct_worker,
            reports,
            epochs,
            links: BTreeMap::new(),
            doubled: BTreeSet::new(),
            mode: opts.attach,
            programmed: BTreeMap::new(),
            written: BTreeMap::new(),
            adopted: (0, 0),
            adopted_endpoints: Vec::new(),
            adopted_numbers: Default::default(),
            full_synced: false,
            fill: Default::default(),
            sizes,
            reduced,
            owners: Default::default(),
        };
        dp.adopt_links()?;
        let tc_on_node = dp.adopt_filters()?;
        let tcx_on_node = pins::other_layouts_have_links(&dp.pin_dir);
        dp.mode = dp.resolve_mode(opts.attach, tc_on_node, tcx_on_node);
        // What a previous agent programmed here; after an upgrade to this
        // layout (fresh pins, flows copied from the older layout), what it
        // programmed there: the copied flows are keyed by its endpoint ids.
        let mut adopted = match dp
            .endpoints
            .records()
            .and_then(|records| adopted_state(dp.ipcache.hash(), records))
        {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::warn!(error = %e, "reading the adopted state (the first sync is not guarded against it)");
                None
            }
        };
        // An upgrade to this layout keeps the established flows.
        match pins::migrate_flows(&dp.pin_dir, &mut dp.flows) {
            Ok(Some(src)) if adopted.as_ref().is_some_and(|a| a.1.is_empty()) => {
                adopted = match pins::adopted_state_at(&src) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        tracing::warn!(error = %e, from = %src.display(), "reading the older layout's endpoints; dropping the copied flows");
                        dp.flows.purge(|_| false)?;
                        None
                    }
                };
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "copying the conntrack of another map layout"),
        }
        if let Some((counts, records)) = adopted {
            dp.adopted = counts;
            dp.adopted_endpoints = records;
        }
        // The numbers of this layout's maps (a restarted agent keeps their
        // meaning; unreadable: every number is handed out anew, above none).
        let numbers = dp.endpoints.entries().and_then(|records| {
            adopt_numbers::read_numbers(
                dp.ipcache.hash(),
                dp.cidrs.trie(),
                dp.policy.lpm(),
                dp.tiers.lpm(),
                &records,
            )
        });
        match numbers {
            Ok(n) => dp.adopted_numbers = n,
            Err(e) => tracing::warn!(error = %e, "reading the adopted identity numbers"),
        }
        // The maps' fill counted from what they hold (adopted or copied
        // entries no add of this program counted).
        dp.ct_worker.recount();
        // Endpoints already programmed (adopted maps) are known by ifindex
        // only; sync_full reconciles them with the compiled state.
        Ok(dp)
    }

    /// The mode to attach in: a forced mode as asked; `Auto` keeps the mode
    /// in place on this node (tcx links pinned here or by another map
    /// layout, `tcx_on_node`, win over npm tc filters of any pin directory,
    /// `tc_on_node`), else tcx where the kernel has it, else tc.
    fn resolve_mode(&self, asked: AttachMode, tc_on_node: bool, tcx_on_node: bool) -> AttachMode {
        let tcx = tcx_on_node || self.links.values().any(|h| matches!(h, Hook::Tcx(_)));
        let tc = tc_on_node || !self.doubled.is_empty() || self.links.values().any(|h| matches!(h, Hook::Tc));
        let mode = match asked {
            AttachMode::Auto if tcx => AttachMode::Tcx,
            AttachMode::Auto if tc => AttachMode::Tc,
            AttachMode::Auto if tcx_supported() => AttachMode::Tcx,
            AttachMode::Auto => AttachMode::Tc,
            forced => forced,
        };
        let found = match (tcx, tc) {
            (true, true) => "tcx and tc",
            (true, false) => "tcx",
            (false, true) => "tc",
            (false, false) => "none",
        };
        if (mode == AttachMode::Tcx && tc) || (mode == AttachMode::Tc && tcx) {
            tracing::warn!(asked = %asked, found, mode = %mode, "hooks of the other attach mode are replaced as endpoints are attached");
        } else {
            tracing::info!(asked = %asked, found, mode = %mode, "attach mode");
        }
        mode
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// The endpoints whose established connections follow policy changes
    /// (connection semantics `enforce`), from the next apply or full sync
    /// on: after a batch that may change what such an endpoint's policy
    /// decides, its decision epoch moves (`NPM_EP_EPOCH`) and each of its
    /// tracked flows is decided again on its next packet; an endpoint that
    /// enters the set has its epoch moved by the next apply or full sync
    /// whatever it changes (even an empty diff). The others keep their
    /// flows (`keep`).
    pub fn set_established_enforce(&mut self, endpoints: BTreeSet<u32>) {
        self.epochs.set_enforce(endpoints);
    }

    /// What the conntrack worker did (`ct_worker.rs`): the latest request
    /// ticket, the completed one, its passes and what they deleted.
    pub fn flow_purges(&self) -> FlowPurges {
        self.ct_worker.stats()
    }

    /// Waits until every flow purge requested so far (by the batches
    /// written before this call) is complete: from then on no entry they
    /// doomed is left, so the next packet of such a flow is decided anew.
    /// An error if a pass failed meanwhile or `timeout` passed. The
    /// writer never waits for it (except for renumbered endpoint ids at a
    /// full sync, which must lose their flows before they are programmed).
    pub fn wait_flow_purges(&self, timeout: std::time::Duration) -> Result<FlowPurges, EbpfError> {
        self.ct_worker.wait(self.ct_worker.requested(), timeout)?;
        Ok(self.ct_worker.stats())
    }

    /// Each programmed endpoint's conntrack quota, by endpoint id: (an
    /// upper bound of the live entries it holds, the new connections
    /// refused to it at the cap, a running total). Endpoints whose
    /// ifindexes share a slot (`npm_common::ep_epoch_slot`) share both.
    pub fn conntrack_quota(&self) -> Vec<(u32, u64, u64)> {
        self.ct_worker.quota()
    }

    /// (fill, pressure threshold) of `NPM_CT` and of `NPM_CT4`
    /// (`NPM_CT_FILL`): the per-endpoint conntrack cap applies to a new
    /// entry of a map while its fill is at or above its threshold. The
    /// fill is the datapath's count from above (one per entry written),
    /// moved to what the map holds by each pass of the conntrack worker.
    pub fn conntrack_pressure(&self) -> [(u64, u64); 2] {
        self.ct_worker.pressure()
    }

    /// The decision epoch of the endpoint on `ifindex` (`NPM_EP_EPOCH`).
    pub fn endpoint_epoch(&self, ifindex: u32) -> Result<u32, EbpfError> {
        self.epochs.get(ifindex)
    }

    /// Whether the endpoint programs run the reduced datapath: every
    /// decision by the LPMs, without the precomputed layers (the kernel's
    /// verifier refused the full programs as too large, or the reduced
    /// switches were asked for). Same verdicts, a higher cost per packet.
    pub fn reduced_datapath(&self) -> bool {
        self.reduced
    }

    /// The configured sizes of the configurable maps and the sizes they
    /// have (a map adopted from its pin keeps the size it was created with).
    pub fn map_sizes(&self) -> &EffectiveSizes {
        &self.sizes
    }

    /// The (pod identities, endpoints) the pinned maps held when this
    /// loader opened them: what a previous agent programmed, (0, 0) on
    /// fresh pins (after an upgrade to this layout whose flows were copied
    /// from an older one, that layout's counts). A restarted agent's
    /// mass-deletion guard starts from it.
    pub fn adopted_counts(&self) -> (usize, usize) {
        self.adopted
    }

    /// The endpoint records the pinned maps held when this loader opened
    /// them (empty on fresh pins; after an upgrade to this layout whose
    /// flows were copied from an older one, that layout's records). A
    /// restarted agent keeps their ids for the pods they still describe.
    pub fn adopted_endpoints(&self) -> &[AdoptedEndpoint] {
        &self.adopted_endpoints
    }

    /// The word in the `NPM_IPCACHE4` slot of `addr` (an IPv4 or
    /// IPv4-mapped address), whichever address it holds; 0 when empty.
    pub fn ipcache4_slot_word(&self, addr: IpAddr) -> Option<u64> {
        self.ipcache.v4().slot_word(addr)
    }

    /// Slots of `NPM_IPCACHE4` in use.
    pub fn ipcache4_occupied(&self) -> usize {
        self.ipcache.v4().occupied()
    }

    /// Entries of the folded decisions (`NPM_FOLD`).
    pub fn fold_len(&self) -> usize {
        self.fold.len()
    }

    /// Counters summed over CPUs.
    pub fn read_counters(&self) -> Result<Counters, EbpfError> {
        self.reports.counters()
    }

    /// Drains the ring buffer of deny events.
    pub fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        self.reports.drain_events()
    }

    /// Number of conntrack entries (`NPM_CT` and `NPM_CT4`).
    pub fn ct_len(&self) -> usize {
        self.flows.ct_len()
    }

    /// The conntrack entries of `NPM_CT` and `NPM_CT4`; the keys of
    /// `NPM_CT4` are given in their [`CtKey`] form (IPv4-mapped addresses).
    pub fn ct_entries(&self) -> Vec<(CtKey, CtValue)> {
        self.flows.ct_entries()
    }
}

impl Dataplane for EbpfDataplane {
    fn sync_full(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.sync(compiled, interfaces).map_err(Into::into)
    }

    fn apply(&mut self, diff: &CompiledDiff, next: &Compiled, interfaces: &Interfaces) -> Result<(), DataplaneError> {
        self.apply_diff(diff, next, interfaces).map_err(Into::into)
    }

    fn counters(&self) -> Result<Counters, DataplaneError> {
        self.read_counters().map_err(Into::into)
    }

    fn set_established_enforce(&mut self, endpoints: BTreeSet<u32>) {
        EbpfDataplane::set_established_enforce(self, endpoints)
    }
}
