//! Finding and loading the datapath object: where the object is looked up
//! ([`resolve_object`]), the `EbpfLoader` set up with every map pinned
//! under the pin directory, the configured map sizes ([`MapSizes`]) and the
//! benchmark globals, the verifier load of each program (retried on
//! `EAGAIN`), the sizes the maps really have (a pinned map keeps the size
//! it was created with: [`EffectiveSizes`]), and taking the programs and
//! maps out of the loaded object.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

use aya::programs::{ProgramError, SchedClassifier};
use aya::{Ebpf, EbpfLoader};
use npm_common::{maps, sizes};

use super::errors::{map_err, prog_err, EbpfError};
use super::{PROG_EGRESS, PROG_EMPTY, PROG_INGRESS};

/// Installed location of the object.
pub const INSTALLED_OBJECT: &str = "/usr/lib/npm/npm-ebpf.o";
/// Environment variable naming the object to load.
pub const OBJECT_ENV: &str = "NPM_EBPF_OBJECT";

/// Switches of the datapath's precomputed layers, read-only globals the
/// verifier prunes on: benchmark-only through `EbpfDataplane::open_with`
/// (feature `testing`), and [`BenchSwitches::reduced`] where the kernel's
/// verifier refuses the whole program as too large. The defaults are
/// production behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BenchSwitches {
    /// The datapath's per-CPU flow cache is neither read nor filled, so
    /// packets of established flows always take the conntrack lookup.
    pub no_flow_cache: bool,
    /// Every packet takes the datapath's general path, never its IPv4 fast
    /// path: the packet tables run both ways and must agree.
    pub no_fast_v4: bool,
    /// The datapath never reads the folded decisions (`NPM_FOLD`): every
    /// decision takes the tiers' and NetworkPolicy's lookups.
    pub no_fold: bool,
    /// The datapath bumps no per-rule or per-endpoint deny counter
    /// (`NPM_RULE_COUNT`, `NPM_EP_DENIES`): measurement only, what the
    /// counters cost per decision.
    pub no_rule_count: bool,
    /// No per-endpoint conntrack quota (`NPM_CT_CAP` at its maximum): an
    /// endpoint's new flows may evict every other endpoint's entries, as
    /// before the quota (the control of the quota's test).
    pub no_ct_quota: bool,
    /// Fault injection: the datapath treats every conntrack insert as
    /// refused by the kernel (it writes no entry), so a test can see what
    /// a failed LRU insert does to the packet (dropped as
    /// `conntrack-failed`, counted, the quota's charge taken back).
    pub ct_insert_fails: bool,
}

/// The `max_entries` of the maps whose size scales with the cluster, set at
/// load time (`npm-agent run --map-size-*`). A map created by this load
/// gets the configured size; a map adopted from its pin keeps the size it
/// was created with (see [`EffectiveSizes`]). The arrays the datapath
/// indexes directly (`NPM_EP_SLOTS` by ifindex, `NPM_IPCACHE4` and
/// `NPM_FOLD` by hash bits compiled into the program) are not
/// configurable.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct MapSizes {
    /// `NPM_POLICY`: NetworkPolicy LPM keys.
    pub policy: u32,
    /// `NPM_TIERS`: ClusterNetworkPolicy tier LPM keys.
    pub tiers: u32,
    /// `NPM_IPCACHE`: exact addresses known cluster-wide.
    pub ipcache: u32,
    /// `NPM_CIDRS`: distinct ipBlock prefixes.
    pub cidrs: u32,
    /// `NPM_CT` and `NPM_CT4` (each): tracked connections (LRU).
    pub conntrack: u32,
    /// The per-endpoint conntrack quota: while a conntrack map is under
    /// pressure (its fill at or above [`pressure_threshold`]), an endpoint
    /// holding more than `1 / conntrack_quota_share` of the map has its
    /// new flows dropped (`conntrack-quota`); below the threshold no
    /// endpoint is capped, so an endpoint that legitimately opens many
    /// short flows (a DNS server: with the 120 s UDP idle time, 550 new
    /// flows a second hold a quarter of the default map) keeps them while
    /// the map has room. Default [`npm_common::CT_QUOTA_SHARE_DEFAULT`]
    /// (an eighth: why, there); 0: no quota.
    pub conntrack_quota_share: u32,
}

impl Default for MapSizes {
    fn default() -> Self {
        MapSizes {
            policy: sizes::POLICY,
            tiers: sizes::TIERS,
            ipcache: sizes::IPCACHE,
            cidrs: sizes::CIDRS,
            conntrack: sizes::CT,
            conntrack_quota_share: npm_common::CT_QUOTA_SHARE_DEFAULT,
        }
    }
}

/// The smallest size [`MapSizes::validate`] accepts for any map: below it
/// a node's own addresses and one endpoint's policy may not fit.
pub const MAP_SIZE_MIN: u32 = 64;
/// The largest size [`MapSizes::validate`] accepts (2^26 entries: a policy
/// LPM that large takes several GiB of kernel memory when full).
pub const MAP_SIZE_MAX: u32 = 1 << 26;

impl MapSizes {
    /// (map name, configured size) of every configurable map.
    pub fn by_map(&self) -> [(&'static str, u32); 6] {
        [
            (maps::POLICY, self.policy),
            (maps::TIERS, self.tiers),
            (maps::IPCACHE, self.ipcache),
            (maps::CIDRS, self.cidrs),
            (maps::CT, self.conntrack),
            (maps::CT4, self.conntrack),
        ]
    }

    /// Checks every size against [`MAP_SIZE_MIN`]..=[`MAP_SIZE_MAX`]; the
    /// error names the map, the value and the bounds.
    pub fn validate(&self) -> Result<(), EbpfError> {
        for (map, size) in self.by_map() {
            if !(MAP_SIZE_MIN..=MAP_SIZE_MAX).contains(&size) {
                return Err(EbpfError::MapSize {
                    map,
                    size,
                    min: MAP_SIZE_MIN,
                    max: MAP_SIZE_MAX,
                });
            }
        }
        Ok(())
    }
}

/// The `max_entries` the kernel reports for the configurable maps after
/// the load: the configured size for a map this load created, the pinned
/// map's own size for an adopted one.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct EffectiveSizes {
    /// What was configured.
    pub configured: MapSizes,
    /// What the maps have.
    pub actual: MapSizes,
}

impl EffectiveSizes {
    /// The maps whose pinned size differs from the configured one:
    /// (map, actual, configured).
    pub fn pending(&self) -> Vec<(&'static str, u32, u32)> {
        self.actual
            .by_map()
            .into_iter()
            .zip(self.configured.by_map())
            .filter(|((_, a), (_, c))| a != c)
            .map(|((m, a), (_, c))| (m, a, c))
            .collect()
    }
}

/// The `max_entries` of each configurable map of the loaded object, as the
/// kernel reports it.
pub(crate) fn actual_sizes(bpf: &Ebpf) -> Result<MapSizes, EbpfError> {
    let get = |name: &'static str| -> Result<u32, EbpfError> {
        let map = bpf.map(name).ok_or(EbpfError::MapMissing { map: name })?;
        let data: &aya::maps::MapData = match map {
            aya::maps::Map::LpmTrie(d) | aya::maps::Map::HashMap(d) | aya::maps::Map::LruHashMap(d) => d,
            _ => return Err(EbpfError::MapMissing { map: name }),
        };
        Ok(data.info().map_err(map_err(name, "read map info"))?.max_entries())
    };
    let ct = get(maps::CT)?;
    let ct4 = get(maps::CT4)?;
    Ok(MapSizes {
        policy: get(maps::POLICY)?,
        tiers: get(maps::TIERS)?,
        ipcache: get(maps::IPCACHE)?,
        cidrs: get(maps::CIDRS)?,
        conntrack: ct.min(ct4),
        // Not a size: the quota is a setting of the load (`effective_sizes`
        // puts the configured one).
        conntrack_quota_share: 0,
    })
}

/// The object to load: `explicit` if given, else `$NPM_EBPF_OBJECT`, else the
/// workspace build output, else [`INSTALLED_OBJECT`].
pub fn resolve_object(explicit: Option<&Path>) -> Result<PathBuf, EbpfError> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(EbpfError::ObjectMissing {
                tried: p.display().to_string(),
            })
        };
    }
    let mut tried = Vec::new();
    if let Some(p) = std::env::var_os(OBJECT_ENV) {
        let p = PathBuf::from(p);
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p);
    }
    let dev = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bpfel-unknown-none/release/npm-ebpf");
    let installed = PathBuf::from(INSTALLED_OBJECT);
    for p in [dev, installed] {
        if p.is_file() {
            return Ok(p);
        }
        tried.push(p);
    }
    Err(EbpfError::ObjectMissing {
        tried: tried
            .iter()
            .map(|p| p.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
    })
}

/// Reads the object (`explicit`, or the one [`resolve_object`] finds).
pub(crate) fn read_object(explicit: Option<&Path>) -> Result<(PathBuf, Vec<u8>), EbpfError> {
    let object = resolve_object(explicit)?;
    let data = std::fs::read(&object).map_err(|source| EbpfError::ReadObject {
        path: object.clone(),
        source,
    })?;
    Ok((object, data))
}

impl BenchSwitches {
    /// The datapath without its precomputed form (the folded decisions):
    /// every decision is taken by the LPMs, the truth, with the same
    /// verdicts, at a higher per-packet cost. The verifier prunes the
    /// fold's branches (the switch is a read-only global), so the programs
    /// it must walk are smaller: what a kernel whose verifier refuses the
    /// full program as too large (`E2BIG`) loads.
    pub fn reduced() -> Self {
        BenchSwitches {
            no_fold: true,
            ..BenchSwitches::default()
        }
    }

    /// These switches with the precomputed form off too
    /// ([`BenchSwitches::reduced`]): what a verifier that refuses the
    /// programs with `self` as too large is offered next.
    pub fn with_reduced(self) -> Self {
        let off = BenchSwitches::reduced();
        BenchSwitches {
            no_fold: off.no_fold,
            ..self
        }
    }

    /// Whether the precomputed form is off.
    pub fn is_reduced(self) -> bool {
        self == self.with_reduced()
    }
}

/// Whether `e` is the verifier refusing a program as too large (`E2BIG`
/// from `BPF_PROG_LOAD`: the 1,000,000-instruction complexity limit).
pub(crate) fn too_large(e: &EbpfError) -> bool {
    matches!(e, EbpfError::Program { .. }) && e.raw_os_error() == Some(libc::E2BIG)
}

/// The programs loaded together, each with its own verdict from the
/// verifier.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Programs {
    /// `from_pod`, `to_pod` (and the empty program).
    Pods = 1,
    /// `node_exit`, `node_exit_l3`.
    NodeExit = 2,
    /// `host_in`.
    HostIn = 4,
}

/// The [`Programs`] this kernel's verifier refused as too large, so this
/// process does not walk a million instructions again for each open (the
/// verifier is deterministic for a kernel and an object).
static REFUSED: AtomicU8 = AtomicU8::new(0);

/// Runs `load` with `switches`; where the kernel's verifier refuses the
/// programs as too large (now, or earlier in this process), with the
/// precomputed form off as well ([`BenchSwitches::with_reduced`]: the
/// same verdicts, decided by the LPMs). Returns what `load` gave and
/// whether the reduced datapath was loaded.
pub(crate) fn load_or_reduced<T>(
    programs: Programs,
    switches: BenchSwitches,
    load: impl Fn(BenchSwitches) -> Result<T, EbpfError>,
) -> Result<(T, bool), EbpfError> {
    if switches.is_reduced() || REFUSED.load(Ordering::Relaxed) & programs as u8 != 0 {
        return Ok((load(switches.with_reduced())?, true));
    }
    match load(switches) {
        Err(e) if too_large(&e) => {
            tracing::warn!(error = %e, programs = ?programs, "the kernel's verifier refused the full datapath as too large: loading it without its precomputed form (the fold); the verdicts are the same, decided by the LPMs at a higher cost per packet");
            REFUSED.fetch_or(programs as u8, Ordering::Relaxed);
            Ok((load(switches.with_reduced())?, true))
        }
        r => Ok((r?, false)),
    }
}

/// Sets the switches' read-only globals on `loader`.
fn set_switches(loader: &mut EbpfLoader, switches: BenchSwitches) {
    for (name, on) in [
        ("NPM_BENCH_NO_FLOW_CACHE", switches.no_flow_cache),
        ("NPM_BENCH_NO_FAST_V4", switches.no_fast_v4),
        ("NPM_BENCH_NO_FOLD", switches.no_fold),
        ("NPM_BENCH_NO_RULE_COUNT", switches.no_rule_count),
        ("NPM_BENCH_CT_INSERT_FAILS", switches.ct_insert_fails),
    ] {
        const ON: u8 = 1;
        const OFF: u8 = 0;
        loader.override_global(name, if on { &ON } else { &OFF }, true);
    }
}

/// Loads the object `explicit` (`None`: the loader's search) with every map
/// of `maps::ALL` adopted from `pin_dir` (pinned there by the endpoint
/// programs' loader), `switches` and the endpoint programs' conntrack cap
/// ([`pinned_ct_cap`]), for the programs that share the endpoints' maps
/// (`node_exit`, `host_in`); no program is loaded yet.
pub(crate) fn load_beside_pins(
    explicit: Option<&Path>,
    pin_dir: &Path,
    switches: BenchSwitches,
) -> Result<Ebpf, EbpfError> {
    let (object, data) = read_object(explicit)?;
    let mut loader = EbpfLoader::new();
    for name in maps::ALL {
        loader.map_pin_path(name, pin_dir.join(name));
    }
    set_switches(&mut loader, switches);
    // The endpoint programs' conntrack cap (the configured share, or no
    // quota), else the object's default.
    let cap = pinned_ct_cap(pin_dir);
    if let Some(cap) = &cap {
        loader.override_global("NPM_CT_CAP", cap, true);
    }
    loader.load(&data).map_err(|source| EbpfError::Load {
        path: object,
        source: Box::new(source),
    })
}

/// The `NPM_CT_CAP` the endpoint programs of `pin_dir` were loaded with,
/// as their loader wrote it in the pinned `NPM_CT_FILL`
/// (`npm_common::CT_FILL_CAP`); `None` when none was written or the map
/// is not readable (the programs loaded beside the pins then keep the
/// object's default).
pub fn pinned_ct_cap(pin_dir: &Path) -> Option<u32> {
    let fill: aya::maps::Array<aya::maps::MapData, u64> = match super::pins::open_pinned(pin_dir, maps::CT_FILL) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, "reading the endpoint programs' conntrack cap; keeping the object's default");
            return None;
        }
    };
    let word = fill.get(&(npm_common::CT_FILL_CT + npm_common::CT_FILL_CAP), 0).ok()?;
    (word != 0).then(|| u32::try_from(word).unwrap_or(u32::MAX))
}

/// Loads the object `data` (read from `object`) with every map of
/// `maps::ALL` pinned under `pin_dir` (adopted when already pinned there),
/// the configurable maps created with `map_sizes`, the benchmark globals
/// set, and every program through the verifier.
pub(crate) fn load(
    object: &Path,
    data: &[u8],
    pin_dir: &Path,
    map_sizes: &MapSizes,
    bench_no_ct_create: bool,
    switches: BenchSwitches,
) -> Result<Ebpf, EbpfError> {
    map_sizes.validate()?;
    let mut loader = EbpfLoader::new();
    for name in maps::ALL {
        loader.map_pin_path(name, pin_dir.join(name));
    }
    for (name, size) in map_sizes.by_map() {
        loader.map_max_entries(name, size);
    }
    let bench: u8 = bench_no_ct_create.into();
    loader.override_global("NPM_BENCH_NO_CT_CREATE", &bench, true);
    let cap = ct_cap(map_sizes, switches);
    loader.override_global("NPM_CT_CAP", &cap, true);
    set_switches(&mut loader, switches);
    let mut bpf = loader.load(data).map_err(|source| EbpfError::Load {
        path: object.to_path_buf(),
        source: Box::new(source),
    })?;
    for name in [PROG_INGRESS, PROG_EGRESS, PROG_EMPTY] {
        let prog = prog_mut(&mut bpf, name)?;
        load_retrying(prog).map_err(prog_err(name, "load (verifier)"))?;
    }
    Ok(bpf)
}

/// The datapath's per-endpoint conntrack cap (`NPM_CT_CAP`): the
/// configured conntrack size over [`MapSizes::conntrack_quota_share`] (a
/// pinned map of another size keeps the configured cap), or no cap when
/// the share is 0 or under [`BenchSwitches::no_ct_quota`]. It applies only
/// while the map of the new entry is under pressure
/// ([`pressure_threshold`]).
pub(crate) fn ct_cap(map_sizes: &MapSizes, switches: BenchSwitches) -> u32 {
    if switches.no_ct_quota || map_sizes.conntrack_quota_share == 0 {
        u32::MAX
    } else {
        (map_sizes.conntrack / map_sizes.conntrack_quota_share).max(1)
    }
}

/// The kernel's `LOCAL_FREE_TARGET` (`kernel/bpf/bpf_lru_list.c`): the
/// free nodes a CPU takes at once from an LRU map's global free list
/// into its own.
const LRU_LOCAL_FREE_TARGET: u64 = 128;

/// The fill of a conntrack map of `size` entries at which it is under
/// pressure (`NPM_CT_FILL`'s threshold, written by the loader): three
/// quarters of the map, lower where the node has many CPUs. The LRU
/// evicts before the map is full: each CPU keeps up to 128 free nodes of
/// its own (`LOCAL_FREE_TARGET`), and a CPU that finds its own list empty
/// evicts as soon as the global free list holds fewer than that many, so
/// with `cpus` possible CPUs the first eviction may come with
/// `128 * (cpus - 1)` nodes still free on other CPUs and fewer than 128
/// in the global list. The threshold stays `128 * (cpus + 1)` below the
/// size, which also covers the CPUs racing past the cap (one entry
/// each). The quarter above the threshold is what endpoints within their
/// cap may still fill while the others are refused. 0 (a tiny map on a
/// large node): always under pressure.
pub fn pressure_threshold(size: u32, cpus: usize) -> u64 {
    let size = u64::from(size);
    let reserve = (size / 4).max(LRU_LOCAL_FREE_TARGET * (cpus as u64 + 1));
    size.saturating_sub(reserve)
}

/// [`pressure_threshold`] with this node's possible CPUs (those an LRU
/// map keeps free lists for).
pub(crate) fn node_pressure_threshold(size: u32) -> u64 {
    let cpus = aya::util::nr_cpus().unwrap_or_else(|(path, e)| {
        tracing::warn!(path, error = %e, "reading the possible CPUs; assuming 256 for the conntrack pressure threshold");
        256
    });
    pressure_threshold(size, cpus)
}

/// Loads a program, retrying when `BPF_PROG_LOAD` returns `EAGAIN`: the
/// verifier gives up with it when a signal is pending while it works (it
/// takes about 130 ms per program here), as libbpf also retries.
pub(crate) fn load_retrying(prog: &mut SchedClassifier) -> Result<(), ProgramError> {
    let mut attempts = 0;
    loop {
        match prog.load() {
            Err(ProgramError::LoadError { io_error, .. })
                if io_error.raw_os_error() == Some(libc::EAGAIN) && attempts < 5 =>
            {
                attempts += 1;
                tracing::debug!(attempts, "BPF_PROG_LOAD interrupted (EAGAIN); retrying");
            }
            r => return r,
        }
    }
}

/// The classifier `name` of the object, for attaching.
pub(crate) fn prog_mut<'a>(bpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier, EbpfError> {
    let p = bpf
        .program_mut(name)
        .ok_or(EbpfError::ProgramMissing { program: name })?;
    p.try_into().map_err(prog_err(name, "not a classifier"))
}

/// The classifier `name` of the object.
#[cfg(feature = "testing")]
pub(crate) fn prog<'a>(bpf: &'a Ebpf, name: &'static str) -> Result<&'a SchedClassifier, EbpfError> {
    let p = bpf.program(name).ok_or(EbpfError::ProgramMissing { program: name })?;
    p.try_into().map_err(prog_err(name, "not a classifier"))
}

/// Takes the map `name` out of the object as the typed map `T`.
pub(crate) fn take_map<T>(bpf: &mut Ebpf, name: &'static str) -> Result<T, EbpfError>
where
    T: TryFrom<aya::maps::Map, Error = aya::maps::MapError>,
{
    let map = bpf.take_map(name).ok_or(EbpfError::MapMissing { map: name })?;
    T::try_from(map).map_err(super::errors::map_err(name, "open"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_conntrack_quota_is_on_by_default_and_off_at_share_0() {
        let default = MapSizes::default();
        assert_eq!(default.conntrack_quota_share, npm_common::CT_QUOTA_SHARE_DEFAULT);
        assert_eq!(
            ct_cap(&default, BenchSwitches::default()),
            sizes::CT / npm_common::CT_QUOTA_SHARE_DEFAULT
        );
        let quarter = MapSizes {
            conntrack: 1024,
            conntrack_quota_share: 4,
            ..MapSizes::default()
        };
        assert_eq!(ct_cap(&quarter, BenchSwitches::default()), 256);
        let off = MapSizes {
            conntrack_quota_share: 0,
            ..MapSizes::default()
        };
        assert_eq!(ct_cap(&off, BenchSwitches::default()), u32::MAX);
        let switched_off = BenchSwitches {
            no_ct_quota: true,
            ..BenchSwitches::default()
        };
        assert_eq!(ct_cap(&quarter, switched_off), u32::MAX);
    }

    #[test]
    fn the_pressure_threshold_leaves_the_lrus_per_cpu_free_lists_room() {
        // Three quarters of the default map on a small node.
        assert_eq!(pressure_threshold(sizes::CT, 2), u64::from(sizes::CT) * 3 / 4);
        assert_eq!(pressure_threshold(sizes::CT, 64), u64::from(sizes::CT) * 3 / 4);
        // Lower where 128 free nodes a CPU weigh more than a quarter.
        assert_eq!(pressure_threshold(sizes::CT, 1024), u64::from(sizes::CT) - 128 * 1025);
        assert_eq!(pressure_threshold(4096, 2), 3072);
        assert_eq!(pressure_threshold(4096, 16), 4096 - 128 * 17);
        // A map too small for the node: always under pressure.
        assert_eq!(pressure_threshold(1024, 8), 0);
    }
}
