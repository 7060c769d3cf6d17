//! The aya loader and programmer of the `npm-ebpf` datapath.
//!
//! [`EbpfDataplane::open`] loads the object with every map of
//! `npm_common::maps::ALL` pinned under a pin directory (default
//! `/sys/fs/bpf/npm/v<LAYOUT_VERSION>`). Maps already pinned there are
//! adopted, not recreated, so enforcement state survives an agent restart.
//!
//! Each endpoint's host-side veth gets two tcx links, pinned as
//! `<pin dir>/links/<ifindex>-ingress` (program `npm_ingress` on the tcx
//! *egress* hook: packets entering the pod) and `<ifindex>-egress`
//! (`npm_egress` on the tcx *ingress* hook: packets leaving the pod). On
//! open, every pinned link is adopted and its program replaced atomically
//! with `BPF_LINK_UPDATE`, so no packet passes unenforced during a restart.
//! Pinned links outlive the loader: the program stays attached with no
//! loader running.
//!
//! Maps are written in the order documented on
//! [`npm_policy::compiled::CompiledDiff`]: upserts (policy, ipcache and
//! CIDRs, endpoints), then removals in the same order.
//!
//! Test mode: [`EbpfDataplane::test_run`] runs a program on a crafted packet
//! with `BPF_PROG_TEST_RUN`, passing a `__sk_buff` context whose `ifindex` is
//! the endpoint's interface (the kernel binds the test skb to that device),
//! so the program sees exactly what it sees in production; nothing in the
//! program knows about test mode.

mod endpoints;
mod ipcache4;
mod policy_front;
mod shared_words;
pub mod translate;

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::lpm_trie::{Key, LpmTrie};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, MapError, PerCpuArray, RingBuf};
use aya::programs::links::{FdLink, PinnedLink};
use aya::programs::tc::{SchedClassifierLink, TcAttachOptions};
use aya::programs::{LinkOrder, ProgramError, SchedClassifier, TcAttachType};
use aya::{Ebpf, EbpfLoader, TestRun, TestRunOptions};
use ipnet::IpNet;
use npm_common::{
    counter_index, maps, Counter, CtKey, CtKey4, CtValue, DenyEvent, EndpointInfo, FragKey, FragValue, IpInfo, IpKey,
    PolicyKey, PolicyValue, Reason, COUNTER_SLOTS, DIR_EGRESS, DIR_INGRESS, LAYOUT_VERSION, POLICY_KEY_LEN,
    REASON_SLOTS,
};
use npm_common::{EP_FRONT_EGRESS, EP_FRONT_EXACT_EGRESS, EP_FRONT_EXACT_INGRESS, EP_FRONT_INGRESS};
use npm_policy::compiled::{Compiled, CompiledDiff, Direction, PolicyEntry};
use serde::Serialize;

use crate::{Counters, Dataplane, DataplaneError, Interfaces};

use endpoints::EndpointTable;
use ipcache4::Ipcache4;
use policy_front::PolicyFront;
use translate::TranslateError;

/// Every `EP_FRONT_*` flag: an endpoint without policy entries (nothing to
/// look up; its `EP_NO_*_PEER_*` flags skip every lookup anyway).
const FRONT_ALL: u32 = EP_FRONT_INGRESS | EP_FRONT_EGRESS | EP_FRONT_EXACT_INGRESS | EP_FRONT_EXACT_EGRESS;

/// Program attached on the tcx egress hook of the host-side veth (packets
/// entering the pod).
pub const PROG_INGRESS: &str = "npm_ingress";
/// Program attached on the tcx ingress hook of the host-side veth (packets
/// leaving the pod).
pub const PROG_EGRESS: &str = "npm_egress";
/// Trivial program returning `TC_ACT_UNSPEC`: the benchmark baseline.
pub const PROG_EMPTY: &str = "npm_empty";
/// Installed location of the object.
pub const INSTALLED_OBJECT: &str = "/usr/lib/npm/npm-ebpf.o";
/// Environment variable naming the object to load.
pub const OBJECT_ENV: &str = "NPM_EBPF_OBJECT";
/// Verdict of an allowed packet (`TC_ACT_UNSPEC`, tcx `TCX_NEXT`).
pub const VERDICT_ALLOW: i32 = -1;
/// Verdict of a dropped packet (`TC_ACT_SHOT`).
pub const VERDICT_DROP: i32 = 2;

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const BPF_ROOT: &str = "/sys/fs/bpf";
const ENOENT: i32 = 2;

/// Errors of the eBPF loader.
#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    /// The datapath object was not found.
    #[error("eBPF object not found (tried {tried}); run `cargo xtask build-ebpf` or set {OBJECT_ENV}")]
    ObjectMissing {
        /// The paths that were tried.
        tried: String,
    },
    /// Reading the object failed.
    #[error("reading eBPF object {path}: {source}")]
    ReadObject {
        /// The object path.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// bpffs could not be mounted or the pin directory created.
    #[error("bpffs pin directory {path}: {detail}")]
    PinDir {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// Loading the object (creating or adopting maps) failed.
    #[error("loading eBPF object {path}: {source}")]
    Load {
        /// The object path.
        path: PathBuf,
        /// The aya error.
        source: Box<aya::EbpfError>,
    },
    /// The object lacks a program.
    #[error("eBPF object has no program {program}")]
    ProgramMissing {
        /// The program name.
        program: &'static str,
    },
    /// A program operation failed.
    #[error("program {program}: {op}: {source}")]
    Program {
        /// The program name.
        program: &'static str,
        /// What was being done.
        op: String,
        /// The aya error.
        source: Box<ProgramError>,
    },
    /// The object lacks a map.
    #[error("eBPF object has no map {map}")]
    MapMissing {
        /// The map name.
        map: &'static str,
    },
    /// A map operation failed.
    #[error("map {map}: {op}: {source}")]
    Map {
        /// The map name.
        map: &'static str,
        /// What was being done (names the key).
        op: String,
        /// The aya error.
        source: Box<MapError>,
    },
    /// An interface is unknown or could not be handled.
    #[error("interface {ifindex}: {detail}")]
    Interface {
        /// The ifindex.
        ifindex: u32,
        /// What went wrong.
        detail: String,
    },
    /// A tcx link could not be attached, adopted, pinned or removed.
    #[error("tcx link {path}: {detail}")]
    Link {
        /// The link's pin path.
        path: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// A compiled entry could not be translated.
    #[error(transparent)]
    Translate(#[from] TranslateError),
    /// A map is not pinned where a read-only reader expects it.
    #[error("no map pinned at {path}")]
    NotPinned {
        /// The expected pin path.
        path: PathBuf,
    },
    /// A map could not be mapped into memory.
    #[error("map {map}: mmap: {detail}")]
    Mmap {
        /// Map name.
        map: &'static str,
        /// What failed.
        detail: String,
    },
}

impl From<EbpfError> for DataplaneError {
    fn from(e: EbpfError) -> Self {
        let op = match &e {
            EbpfError::ObjectMissing { .. } | EbpfError::ReadObject { .. } | EbpfError::Load { .. } => "ebpf load",
            EbpfError::PinDir { .. } => "ebpf pin directory",
            EbpfError::ProgramMissing { .. } | EbpfError::Program { .. } => "ebpf program",
            EbpfError::MapMissing { .. }
            | EbpfError::Map { .. }
            | EbpfError::NotPinned { .. }
            | EbpfError::Mmap { .. } => "ebpf map",
            EbpfError::Interface { .. } | EbpfError::Link { .. } => "ebpf attach",
            EbpfError::Translate(_) => "ebpf translate",
        };
        DataplaneError::Kernel {
            op: op.to_string(),
            detail: e.to_string(),
        }
    }
}

fn map_err(map: &'static str, op: impl fmt::Display) -> impl FnOnce(MapError) -> EbpfError {
    let op = op.to_string();
    move |source| EbpfError::Map {
        map,
        op,
        source: Box::new(source),
    }
}

fn prog_err(program: &'static str, op: impl fmt::Display) -> impl FnOnce(ProgramError) -> EbpfError {
    let op = op.to_string();
    move |source| EbpfError::Program {
        program,
        op,
        source: Box::new(source),
    }
}

/// True when a map error says the key was not there.
fn is_not_found(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound => true,
        MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(ENOENT),
        _ => false,
    }
}

/// Benchmark-only switches of [`EbpfDataplane::open_with`]; the defaults
/// are production behaviour.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BenchSwitches {
    /// The datapath's per-CPU flow cache is neither read nor filled, so
    /// packets of established flows always take the conntrack lookup.
    pub no_flow_cache: bool,
    /// The datapath's per-CPU decision cache is not used, so packets
    /// decided by policy always take the ipcache and policy lookups.
    pub no_decision_cache: bool,
    /// Every packet takes the datapath's general path, never its IPv4 fast
    /// path: the packet tables run both ways and must agree.
    pub no_fast_v4: bool,
    /// The datapath never probes the policy front (`NPM_POLICY_FRONT`):
    /// every policy lookup walks the LPM.
    pub no_policy_front: bool,
}

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
}

impl Default for EbpfOptions {
    fn default() -> Self {
        EbpfOptions {
            object: None,
            pin_dir: default_pin_dir(),
            bench_no_ct_create: false,
        }
    }
}

/// `/sys/fs/bpf/npm/v<LAYOUT_VERSION>`.
pub fn default_pin_dir() -> PathBuf {
    PathBuf::from(format!("{BPF_ROOT}/npm/v{LAYOUT_VERSION}"))
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

/// Mounts bpffs at `/sys/fs/bpf` unless it is mounted already.
pub fn ensure_bpffs() -> Result<(), EbpfError> {
    let root = PathBuf::from(BPF_ROOT);
    let err = |detail: String| EbpfError::PinDir {
        path: root.clone(),
        detail,
    };
    std::fs::create_dir_all(&root).map_err(|e| err(format!("create: {e}")))?;
    let c = CString::new(BPF_ROOT).map_err(|e| err(e.to_string()))?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and struct pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(err(format!("statfs: {}", std::io::Error::last_os_error())));
    }
    #[allow(clippy::unnecessary_cast)]
    if st.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    let fstype = CString::new("bpf").map_err(|e| err(e.to_string()))?;
    // SAFETY: valid C strings; no data argument.
    let rc = unsafe { libc::mount(fstype.as_ptr(), c.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(err(format!("mount bpffs: {}", std::io::Error::last_os_error())));
    }
    Ok(())
}

fn ifname(ifindex: u32) -> Result<String, EbpfError> {
    let mut buf = [0 as libc::c_char; libc::IF_NAMESIZE];
    // SAFETY: the buffer has IF_NAMESIZE bytes.
    let p = unsafe { libc::if_indextoname(ifindex, buf.as_mut_ptr()) };
    if p.is_null() {
        return Err(EbpfError::Interface {
            ifindex,
            detail: format!("no such interface: {}", std::io::Error::last_os_error()),
        });
    }
    // SAFETY: if_indextoname wrote a NUL-terminated name.
    let name = unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) };
    Ok(name.to_string_lossy().into_owned())
}

fn dir_name(dir: u8) -> &'static str {
    if dir == DIR_INGRESS {
        "ingress"
    } else {
        "egress"
    }
}

/// One endpoint in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpEndpoint {
    /// Host-side ifindex (the map key).
    pub ifindex: u32,
    /// Endpoint id.
    pub id: u32,
    /// `EP_*` flags.
    pub flags: u32,
    /// IPv4 address.
    pub ipv4: Option<std::net::Ipv4Addr>,
    /// IPv6 address.
    pub ipv6: Option<std::net::Ipv6Addr>,
    /// Attached hooks (pod directions), from the pinned links.
    pub attached: Vec<&'static str>,
}

/// One ipcache entry in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpIp {
    /// Address.
    pub addr: IpAddr,
    /// Identity.
    pub identity: u32,
    /// CIDR identity (0: none).
    pub cidr_identity: u32,
}

/// One CIDR entry in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpCidr {
    /// Prefix.
    pub prefix: IpNet,
    /// CIDR identity.
    pub identity: u32,
}

/// One policy key in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpPolicy {
    /// Endpoint id.
    pub endpoint: u32,
    /// "ingress" or "egress".
    pub direction: &'static str,
    /// Peer identity (0: any).
    pub peer: u32,
    /// Protocol number, `None` for any protocol.
    pub protocol: Option<u8>,
    /// Inclusive port range (every port for `protocol: None`).
    pub ports: (u16, u16),
    /// LPM prefix length of the key.
    pub prefix_len: u32,
    /// Rule id.
    pub rule: u32,
}

/// One counter slot in [`EbpfDump`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct DumpCounter {
    /// "ingress" or "egress".
    pub direction: &'static str,
    /// Reason name.
    pub reason: &'static str,
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// The programmed maps' contents, for `npm-agent inspect`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EbpfDump {
    /// Pin directory.
    pub pin_dir: PathBuf,
    /// `NPM_ENDPOINTS`.
    pub endpoints: Vec<DumpEndpoint>,
    /// `NPM_IPCACHE`, sorted by address.
    pub ipcache: Vec<DumpIp>,
    /// `NPM_CIDRS`, sorted by prefix.
    pub cidrs: Vec<DumpCidr>,
    /// `NPM_POLICY`, sorted.
    pub policy: Vec<DumpPolicy>,
    /// Entries of `NPM_CT` and `NPM_CT4`.
    pub ct_entries: usize,
    /// Entries of `NPM_FRAGS`.
    pub frag_entries: usize,
    /// Non-zero counters.
    pub counters: Vec<DumpCounter>,
}

/// The eBPF dataplane: the loaded object, its pinned maps and the tcx links.
pub struct EbpfDataplane {
    bpf: Ebpf,
    pin_dir: PathBuf,
    endpoints: EndpointTable,
    ipcache: BpfHashMap<MapData, IpKey, IpInfo>,
    ipcache4: Ipcache4,
    cidrs: LpmTrie<MapData, [u8; 16], u32>,
    policy: LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue>,
    front: PolicyFront,
    ct: BpfHashMap<MapData, CtKey, CtValue>,
    ct4: BpfHashMap<MapData, CtKey4, CtValue>,
    frags: BpfHashMap<MapData, FragKey, FragValue>,
    counters: PerCpuArray<MapData, Counter>,
    events: RingBuf<MapData>,
    generation: Array<MapData, u64>,
    /// (ifindex, pod direction) -> the link (pinned under `links/`).
    links: BTreeMap<(u32, u8), FdLink>,
    /// Endpoint id -> ifindex it is programmed at.
    programmed: BTreeMap<u32, u32>,
    /// Endpoint id -> the `EndpointInfo::flags` last written for it.
    written_flags: BTreeMap<u32, u32>,
    /// (pod identities, endpoints) found in the maps at open.
    adopted: (usize, usize),
    /// The endpoint records found at open.
    adopted_endpoints: Vec<crate::AdoptedEndpoint>,
    /// Whether a full sync succeeded.
    full_synced: bool,
}

impl fmt::Debug for EbpfDataplane {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EbpfDataplane")
            .field("pin_dir", &self.pin_dir)
            .field("links", &self.links.keys().collect::<Vec<_>>())
            .field("programmed", &self.programmed)
            .finish()
    }
}

fn take_map(bpf: &mut Ebpf, name: &'static str) -> Result<aya::maps::Map, EbpfError> {
    bpf.take_map(name).ok_or(EbpfError::MapMissing { map: name })
}

impl EbpfDataplane {
    /// Loads the object, creating or adopting the pinned maps under
    /// `opts.pin_dir`, and adopts every pinned link there (replacing its
    /// program atomically with the newly loaded one).
    pub fn open(opts: EbpfOptions) -> Result<Self, EbpfError> {
        Self::open_with(opts, BenchSwitches::default())
    }

    /// [`EbpfDataplane::open`] with benchmark switches (the datapath
    /// benchmark measures the conntrack lookup without the flow cache).
    pub fn open_with(opts: EbpfOptions, switches: BenchSwitches) -> Result<Self, EbpfError> {
        let object = resolve_object(opts.object.as_deref())?;
        let data = std::fs::read(&object).map_err(|source| EbpfError::ReadObject {
            path: object.clone(),
            source,
        })?;
        ensure_bpffs()?;
        let pin_dir = opts.pin_dir.clone();
        std::fs::create_dir_all(pin_dir.join("links")).map_err(|e| EbpfError::PinDir {
            path: pin_dir.clone(),
            detail: format!("create: {e}"),
        })?;
        let mut loader = EbpfLoader::new();
        for name in maps::ALL {
            loader.map_pin_path(name, pin_dir.join(name));
        }
        let bench: u8 = opts.bench_no_ct_create.into();
        loader.override_global("NPM_BENCH_NO_CT_CREATE", &bench, true);
        let no_cache: u8 = switches.no_flow_cache.into();
        loader.override_global("NPM_BENCH_NO_FLOW_CACHE", &no_cache, true);
        let no_decisions: u8 = switches.no_decision_cache.into();
        loader.override_global("NPM_BENCH_NO_DECISION_CACHE", &no_decisions, true);
        let no_fast: u8 = switches.no_fast_v4.into();
        loader.override_global("NPM_BENCH_NO_FAST_V4", &no_fast, true);
        let no_front: u8 = switches.no_policy_front.into();
        loader.override_global("NPM_BENCH_NO_POLICY_FRONT", &no_front, true);
        let mut bpf = loader.load(&data).map_err(|source| EbpfError::Load {
            path: object.clone(),
            source: Box::new(source),
        })?;
        for name in [PROG_INGRESS, PROG_EGRESS, PROG_EMPTY] {
            let prog = Self::prog_mut(&mut bpf, name)?;
            load_retrying(prog).map_err(prog_err(name, "load (verifier)"))?;
        }
        let conv = |name: &'static str| map_err(name, "open");
        let slots = Array::try_from(take_map(&mut bpf, maps::EP_SLOTS)?).map_err(conv(maps::EP_SLOTS))?;
        let overflow = BpfHashMap::try_from(take_map(&mut bpf, maps::ENDPOINTS)?).map_err(conv(maps::ENDPOINTS))?;
        let endpoints = EndpointTable::new(slots, overflow);
        let ipcache = BpfHashMap::try_from(take_map(&mut bpf, maps::IPCACHE)?).map_err(conv(maps::IPCACHE))?;
        let ipcache4 =
            Ipcache4::new(Array::try_from(take_map(&mut bpf, maps::IPCACHE4)?).map_err(conv(maps::IPCACHE4))?)?;
        let cidrs = LpmTrie::try_from(take_map(&mut bpf, maps::CIDRS)?).map_err(conv(maps::CIDRS))?;
        let policy = LpmTrie::try_from(take_map(&mut bpf, maps::POLICY)?).map_err(conv(maps::POLICY))?;
        let front = PolicyFront::new(
            Array::try_from(take_map(&mut bpf, maps::POLICY_FRONT)?).map_err(conv(maps::POLICY_FRONT))?,
        )?;
        let ct = BpfHashMap::try_from(take_map(&mut bpf, maps::CT)?).map_err(conv(maps::CT))?;
        let ct4 = BpfHashMap::try_from(take_map(&mut bpf, maps::CT4)?).map_err(conv(maps::CT4))?;
        let frags = BpfHashMap::try_from(take_map(&mut bpf, maps::FRAGS)?).map_err(conv(maps::FRAGS))?;
        let counters = PerCpuArray::try_from(take_map(&mut bpf, maps::COUNTERS)?).map_err(conv(maps::COUNTERS))?;
        let events = RingBuf::try_from(take_map(&mut bpf, maps::EVENTS)?).map_err(conv(maps::EVENTS))?;
        let generation = Array::try_from(take_map(&mut bpf, maps::GENERATION)?).map_err(conv(maps::GENERATION))?;
        let mut dp = EbpfDataplane {
            bpf,
            pin_dir,
            endpoints,
            ipcache,
            ipcache4,
            cidrs,
            policy,
            front,
            ct,
            ct4,
            frags,
            counters,
            events,
            generation,
            links: BTreeMap::new(),
            programmed: BTreeMap::new(),
            written_flags: BTreeMap::new(),
            adopted: (0, 0),
            adopted_endpoints: Vec::new(),
            full_synced: false,
        };
        dp.adopt_links()?;
        // What a previous agent programmed here; after an upgrade to this
        // layout (fresh pins, flows copied from the older layout), what it
        // programmed there: the copied flows are keyed by its endpoint ids.
        let mut adopted = match adopted_state(&dp.ipcache, &dp.endpoints) {
            Ok(a) => Some(a),
            Err(e) => {
                tracing::warn!(error = %e, "reading the adopted state (the first sync is not guarded against it)");
                None
            }
        };
        // An upgrade to this layout keeps the established flows.
        match dp.migrate_flows() {
            Ok(Some(src)) if adopted.as_ref().is_some_and(|a| a.1.is_empty()) => {
                adopted = match adopted_state_at(&src) {
                    Ok(a) => Some(a),
                    Err(e) => {
                        tracing::warn!(error = %e, from = %src.display(), "reading the older layout's endpoints; dropping the copied flows");
                        dp.purge_flows(|_| false)?;
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
        // Endpoints already programmed (adopted maps) are known by ifindex
        // only; sync_full reconciles them with the compiled state.
        Ok(dp)
    }

    fn prog_mut<'a>(bpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut SchedClassifier, EbpfError> {
        let p = bpf
            .program_mut(name)
            .ok_or(EbpfError::ProgramMissing { program: name })?;
        p.try_into().map_err(prog_err(name, "not a classifier"))
    }

    fn prog(&self, name: &'static str) -> Result<&SchedClassifier, EbpfError> {
        let p = self
            .bpf
            .program(name)
            .ok_or(EbpfError::ProgramMissing { program: name })?;
        p.try_into().map_err(prog_err(name, "not a classifier"))
    }

    /// The pin directory.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    fn link_path(&self, ifindex: u32, dir: u8) -> PathBuf {
        self.pin_dir.join("links").join(format!("{ifindex}-{}", dir_name(dir)))
    }

    fn prog_for(dir: u8) -> &'static str {
        if dir == DIR_INGRESS {
            PROG_INGRESS
        } else {
            PROG_EGRESS
        }
    }

    /// Adopts the links pinned under `links/`: each gets the newly loaded
    /// program with an atomic link update. Links whose interface is gone
    /// are unpinned.
    fn adopt_links(&mut self) -> Result<(), EbpfError> {
        let dir = self.pin_dir.join("links");
        let entries = std::fs::read_dir(&dir).map_err(|e| EbpfError::PinDir {
            path: dir.clone(),
            detail: format!("read: {e}"),
        })?;
        let mut found = Vec::new();
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let parsed = name.split_once('-').and_then(|(i, d)| {
                let i: u32 = i.parse().ok()?;
                let d = match d {
                    "ingress" => DIR_INGRESS,
                    "egress" => DIR_EGRESS,
                    _ => return None,
                };
                Some((i, d))
            });
            match parsed {
                Some(k) => found.push((k, entry.path())),
                None => tracing::warn!(path = %entry.path().display(), "ignoring unknown file in links directory"),
            }
        }
        for ((ifindex, d), path) in found {
            let link_err = |detail: String| EbpfError::Link {
                path: path.clone(),
                detail,
            };
            let pinned = match PinnedLink::from_pin(&path) {
                Ok(p) => p,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unpinning unreadable link");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            let fd: FdLink = pinned.into();
            let link = SchedClassifierLink::try_from(fd).map_err(|e| link_err(format!("not a tcx link: {e}")))?;
            let name = Self::prog_for(d);
            let prog = Self::prog_mut(&mut self.bpf, name)?;
            match prog.attach_to_link(link) {
                Ok(id) => {
                    let link = prog.take_link(id).map_err(prog_err(name, "take adopted link"))?;
                    let fd = FdLink::try_from(link).map_err(|e| link_err(format!("adopted link: {e}")))?;
                    self.links.insert((ifindex, d), fd);
                }
                Err(e) => {
                    // The interface went away: the link is defunct.
                    tracing::warn!(path = %path.display(), error = %e, "unpinning defunct link");
                    let _ = std::fs::remove_file(&path);
                }
            }
        }
        Ok(())
    }

    /// Attaches both programs to the host-side interface `ifindex` with tcx
    /// (first in the tcx chain) and pins the links. Already attached hooks
    /// are left alone.
    pub fn attach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            if self.links.contains_key(&(ifindex, d)) {
                continue;
            }
            let name = ifname(ifindex)?;
            let path = self.link_path(ifindex, d);
            let link_err = |detail: String| EbpfError::Link {
                path: path.clone(),
                detail,
            };
            let hook = if d == DIR_INGRESS {
                TcAttachType::Egress
            } else {
                TcAttachType::Ingress
            };
            let pname = Self::prog_for(d);
            let prog = Self::prog_mut(&mut self.bpf, pname)?;
            let id = prog
                .attach_with_options(&name, hook, TcAttachOptions::TcxOrder(LinkOrder::first()))
                .map_err(prog_err(pname, format!("tcx attach to {name} ({ifindex})")))?;
            let link = prog.take_link(id).map_err(prog_err(pname, "take link"))?;
            let fd = FdLink::try_from(link).map_err(|e| link_err(format!("not an fd link: {e}")))?;
            // A stale pin (interface recreated with the same ifindex) is replaced.
            let _ = std::fs::remove_file(&path);
            let pinned = fd.pin(&path).map_err(|e| link_err(format!("pin: {e}")))?;
            self.links.insert((ifindex, d), FdLink::from(pinned));
        }
        Ok(())
    }

    /// Detaches both programs from `ifindex` (unpins and closes the links).
    pub fn detach(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        for d in [DIR_INGRESS, DIR_EGRESS] {
            let path = self.link_path(ifindex, d);
            if let Some(link) = self.links.remove(&(ifindex, d)) {
                match std::fs::remove_file(&path) {
                    Ok(()) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(EbpfError::Link {
                            path,
                            detail: format!("unpin: {e}"),
                        })
                    }
                }
                drop(link);
            }
        }
        Ok(())
    }

    /// The interfaces with at least one attached hook.
    pub fn attached(&self) -> BTreeSet<u32> {
        self.links.keys().map(|(i, _)| *i).collect()
    }

    fn write_policy(&mut self, entry: &PolicyEntry, rule: u32) -> Result<(), EbpfError> {
        let value = translate::policy_value(rule);
        for k in translate::policy_keys(entry)? {
            self.policy
                .insert(&Key::new(k.prefix_len, k.data), value, 0)
                .map_err(map_err(maps::POLICY, format!("insert {entry:?}")))?;
        }
        // The front after the LPM (a word full bucket is simply left out:
        // the endpoint's direction then stays on the LPM).
        for w in translate::front_words(entry).unwrap_or_default() {
            self.front.insert(w);
        }
        Ok(())
    }

    fn remove_key<K: aya::Pod, V: aya::Pod>(
        map: &mut BpfHashMap<MapData, K, V>,
        name: &'static str,
        key: &K,
        what: impl fmt::Display,
    ) -> Result<(), EbpfError> {
        match map.remove(key) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(map_err(name, format!("remove {what}"))(e)),
        }
    }

    fn remove_lpm<K: aya::Pod, V: aya::Pod>(
        map: &mut LpmTrie<MapData, K, V>,
        name: &'static str,
        key: &Key<K>,
        what: impl fmt::Display,
    ) -> Result<(), EbpfError> {
        match map.remove(key) {
            Ok(()) => Ok(()),
            Err(e) if is_not_found(&e) => Ok(()),
            Err(e) => Err(map_err(name, format!("remove {what}"))(e)),
        }
    }

    /// Removes the keys of `entry` that no entry of `next` still produces
    /// (two entries of one peer and protocol may share an aligned block).
    fn remove_policy(&mut self, entry: &PolicyEntry, next: &Compiled) -> Result<(), EbpfError> {
        let lo = PolicyEntry {
            ports: (0, 0),
            ..*entry
        };
        let hi = PolicyEntry {
            ports: (u16::MAX, u16::MAX),
            ..*entry
        };
        let mut still: BTreeSet<PolicyKey> = BTreeSet::new();
        let mut still_words: BTreeSet<u64> = BTreeSet::new();
        for (other, _) in next.policy.range(lo..=hi) {
            if other.ports.0 <= other.ports.1 || other.protocol.is_none() {
                still.extend(translate::policy_keys(other)?);
                still_words.extend(translate::front_words(other).unwrap_or_default());
            }
        }
        // The front before the LPM: it never allows what the LPM does not.
        for w in translate::front_words(entry).unwrap_or_default() {
            if !still_words.contains(&w) {
                self.front.remove(w);
            }
        }
        for k in translate::policy_keys(entry)? {
            if !still.contains(&k) {
                Self::remove_lpm(
                    &mut self.policy,
                    maps::POLICY,
                    &Key::new(k.prefix_len, k.data),
                    format!("{entry:?}"),
                )?;
            }
        }
        Ok(())
    }

    fn write_ip(&mut self, addr: IpAddr, info: IpInfo) -> Result<(), EbpfError> {
        self.ipcache
            .insert(translate::ip_key(addr), info, 0)
            .map_err(map_err(maps::IPCACHE, format!("insert {addr}")))?;
        self.ipcache4.upsert(addr, info);
        Ok(())
    }

    /// The word in the `NPM_IPCACHE4` slot of `addr` (an IPv4 or
    /// IPv4-mapped address), whichever address it holds; 0 when empty.
    pub fn ipcache4_slot_word(&self, addr: IpAddr) -> Option<u64> {
        self.ipcache4.slot_word(addr)
    }

    /// Slots of `NPM_IPCACHE4` in use.
    pub fn ipcache4_occupied(&self) -> usize {
        self.ipcache4.occupied()
    }

    fn write_cidr(&mut self, net: &IpNet, identity: u32) -> Result<(), EbpfError> {
        let (len, addr) = translate::cidr_key(net);
        self.cidrs
            .insert(&Key::new(len, addr), identity, 0)
            .map_err(map_err(maps::CIDRS, format!("insert {net}")))
    }

    /// Writes the endpoints of `next` that have an interface and need it
    /// (new, changed in `changed`, moved to another interface, or whose
    /// `EP_NO_*_PEER_*` flags changed with the policy), attaching the
    /// programs. Endpoints without an interface are held back.
    fn program_endpoints(
        &mut self,
        next: &Compiled,
        interfaces: &Interfaces,
        changed: &BTreeSet<u32>,
    ) -> Result<(), EbpfError> {
        let peer_flags = translate::endpoint_peer_flags(next.policy.keys());
        let front_flags = self.front_flags(next);
        for (&id, ep) in &next.endpoints {
            let Some(&ifindex) = interfaces.get(&id) else {
                // No interface known (yet, or any more): nothing may stay
                // keyed by an ifindex that could be reused.
                self.written_flags.remove(&id);
                if let Some(old) = self.programmed.remove(&id) {
                    self.unprogram_ifindex(old)?;
                }
                continue;
            };
            let old = self.programmed.get(&id).copied();
            let mut info = translate::endpoint_info(id, ep);
            info.flags |= peer_flags.get(&id).copied().unwrap_or(translate::EP_NO_PEER_ALL);
            info.flags |= front_flags.get(&id).copied().unwrap_or(FRONT_ALL);
            if old == Some(ifindex)
                && !changed.contains(&id)
                && self.links.contains_key(&(ifindex, DIR_INGRESS))
                && self.written_flags.get(&id) == Some(&info.flags)
            {
                continue;
            }
            self.endpoints.replace(ifindex, info)?;
            self.written_flags.insert(id, info.flags);
            self.attach(ifindex)?;
            self.programmed.insert(id, ifindex);
            if let Some(old) = old.filter(|o| *o != ifindex) {
                if !self.programmed.values().any(|v| *v == old) {
                    self.unprogram_ifindex(old)?;
                }
            }
        }
        Ok(())
    }

    /// The `EP_FRONT_*` flags of every endpoint that has policy entries
    /// (endpoint id -> flags): `EP_FRONT_<dir>` when the front holds every
    /// word of the endpoint's entries in that direction (and each entry
    /// fits it), `EP_FRONT_EXACT_<dir>` when none of them is a wildcard. An
    /// endpoint without entries gets [`FRONT_ALL`].
    fn front_flags(&self, next: &Compiled) -> BTreeMap<u32, u32> {
        let mut flags: BTreeMap<u32, u32> = BTreeMap::new();
        for e in next.policy.keys() {
            let f = flags.entry(e.endpoint).or_insert(FRONT_ALL);
            let dir = e.direction.as_u8();
            let held = translate::front_word_iter(e).is_some_and(|mut w| w.all(|w| self.front.contains(w)));
            if !held {
                *f &= !(EP_FRONT_INGRESS << dir);
            }
            if translate::is_wildcard(e) {
                *f &= !(EP_FRONT_EXACT_INGRESS << dir);
            }
        }
        flags
    }

    /// The distinct pod identities (`IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR`)
    /// of `NPM_IPCACHE` and the endpoint records, as the maps hold them now.
    /// The (pod identities, endpoints) the pinned maps held when this
    /// loader opened them: what a previous agent programmed, (0, 0) on
    /// fresh pins (after an upgrade to this layout whose flows were copied
    /// from an older one, that layout's counts). A restarted agent's mass-deletion guard starts from it.
    pub fn adopted_counts(&self) -> (usize, usize) {
        self.adopted
    }

    /// The endpoint records the pinned maps held when this loader opened
    /// them (empty on fresh pins; after an upgrade to this layout whose
    /// flows were copied from an older one, that layout's records). A
    /// restarted agent keeps their ids for the pods they still describe.
    pub fn adopted_endpoints(&self) -> &[crate::AdoptedEndpoint] {
        &self.adopted_endpoints
    }

    /// Words in the policy front (`NPM_POLICY_FRONT`).
    pub fn policy_front_len(&self) -> usize {
        self.front.len()
    }

    fn unprogram_ifindex(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        self.endpoints.remove(ifindex)?;
        self.detach(ifindex)
    }

    /// Deletes the conntrack and fragment entries tracked under an endpoint
    /// id of `compiled` that no record of `records` describes as the same
    /// endpoint (interface and addresses): after an agent restart an id may
    /// have been given anew, and a pod must never inherit another pod's
    /// flows (with a recycled address, the same 5-tuple); an id that no
    /// record carries can only hold orphans. Flows of an id whose endpoint
    /// is unchanged are kept; those of ids no longer used go with the sweep.
    fn purge_renumbered_flows(
        &mut self,
        compiled: &Compiled,
        interfaces: &Interfaces,
        records: &[crate::AdoptedEndpoint],
    ) -> Result<(), EbpfError> {
        let by_id: BTreeMap<u32, &crate::AdoptedEndpoint> = records.iter().map(|r| (r.id, r)).collect();
        let renumbered: BTreeSet<u32> = compiled
            .endpoints
            .iter()
            .filter(|(id, ep)| {
                !by_id
                    .get(id)
                    .is_some_and(|r| interfaces.get(id) == Some(&r.ifindex) && r.ipv4 == ep.ipv4 && r.ipv6 == ep.ipv6)
            })
            .map(|(id, _)| *id)
            .collect();
        if renumbered.is_empty() {
            return Ok(());
        }
        tracing::debug!(endpoints = ?renumbered, "dropping the flows of endpoint ids no record describes as the same endpoint");
        self.purge_flows(|ep| !renumbered.contains(&ep))
    }

    /// Deletes the conntrack and fragment entries of the given endpoints.
    fn purge_flows(&mut self, keep: impl Fn(u32) -> bool) -> Result<(), EbpfError> {
        Self::purge_map(&mut self.ct, maps::CT, |k| k.endpoint, &keep)?;
        Self::purge_map(&mut self.ct4, maps::CT4, |k| k.endpoint, &keep)?;
        Self::purge_map(&mut self.frags, maps::FRAGS, |k| k.endpoint, &keep)
    }

    /// Deletes every entry of `map` whose endpoint (`endpoint_of` the key)
    /// `keep` rejects.
    fn purge_map<K: aya::Pod, V: aya::Pod>(
        map: &mut BpfHashMap<MapData, K, V>,
        name: &'static str,
        endpoint_of: impl Fn(&K) -> u32,
        keep: &impl Fn(u32) -> bool,
    ) -> Result<(), EbpfError> {
        let doomed: Vec<K> = map
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !keep(endpoint_of(k)))
            .collect();
        for k in doomed {
            Self::remove_key(map, name, &k, format_args!("endpoint {}", endpoint_of(&k)))?;
        }
        Ok(())
    }

    /// [`Dataplane::apply`] with the loader's own error type.
    pub fn apply_diff(
        &mut self,
        diff: &CompiledDiff,
        next: &Compiled,
        interfaces: &Interfaces,
    ) -> Result<(), EbpfError> {
        let result = self.apply_diff_maps(diff, next, interfaces);
        // Also after a failed apply: some maps may have changed.
        self.bump_after(result)
    }

    /// Bumps the generation after a batch of writes; the batch's own error,
    /// if any, wins over a failed bump (which is logged).
    fn bump_after(&mut self, result: Result<(), EbpfError>) -> Result<(), EbpfError> {
        match (self.bump_generation(), result) {
            (Ok(_), r) => r,
            (Err(bump), Err(e)) => {
                tracing::error!(error = %bump, "bumping the policy generation after a failed write");
                Err(e)
            }
            (Err(bump), Ok(())) => Err(bump),
        }
    }

    fn apply_diff_maps(
        &mut self,
        diff: &CompiledDiff,
        next: &Compiled,
        interfaces: &Interfaces,
    ) -> Result<(), EbpfError> {
        // 1. upserts: policy, ipcache and CIDRs, endpoints.
        for (entry, rule) in &diff.policy.upsert {
            self.write_policy(entry, *rule)?;
        }
        for (addr, e) in &diff.ipcache.upsert {
            self.write_ip(*addr, translate::ip_info(e))?;
        }
        for (net, id) in &diff.cidrs.upsert {
            self.write_cidr(net, *id)?;
        }
        let changed: BTreeSet<u32> = diff.endpoints.upsert.iter().map(|(id, _)| *id).collect();
        self.program_endpoints(next, interfaces, &changed)?;
        // 2. removals in the same order.
        for entry in &diff.policy.remove {
            self.remove_policy(entry, next)?;
        }
        for addr in &diff.ipcache.remove {
            self.ipcache4.remove(*addr);
            let k = translate::ip_key(*addr);
            Self::remove_key(&mut self.ipcache, maps::IPCACHE, &k, addr)?;
        }
        if !diff.cidrs.remove.is_empty() {
            let still: BTreeSet<(u32, [u8; 16])> = next.cidrs.keys().map(translate::cidr_key).collect();
            for net in &diff.cidrs.remove {
                let k = translate::cidr_key(net);
                if !still.contains(&k) {
                    Self::remove_lpm(&mut self.cidrs, maps::CIDRS, &Key::new(k.0, k.1), net)?;
                }
            }
        }
        let mut removed = BTreeSet::new();
        for id in &diff.endpoints.remove {
            self.written_flags.remove(id);
            if let Some(ifindex) = self.programmed.remove(id) {
                if !self.programmed.values().any(|v| *v == ifindex) {
                    self.unprogram_ifindex(ifindex)?;
                }
            }
            removed.insert(*id);
        }
        if !removed.is_empty() {
            self.purge_flows(|ep| !removed.contains(&ep))?;
        }
        Ok(())
    }

    /// [`Dataplane::sync_full`] with the loader's own error type: writes
    /// everything in `compiled`, then deletes every kernel entry (and pinned
    /// link) that is not part of it.
    pub fn sync(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), EbpfError> {
        let result = self.sync_maps(compiled, interfaces);
        // Also after a failed sync: some maps may have changed.
        self.bump_after(result)?;
        // The maps are right; a pin that cannot be removed yet is only
        // logged and retried at the next full sync.
        if let Err(e) = self.retire_other_layouts() {
            tracing::warn!(error = %e, "retiring the pins of other map layouts");
        }
        Ok(())
    }

    /// Bumps `NPM_GENERATION`: every decision the datapath cached before
    /// stops answering, so the next packets are decided from the maps as
    /// they are now. Called after every batch of map writes.
    pub fn bump_generation(&mut self) -> Result<u64, EbpfError> {
        let now = self.generation.get(&0, 0).map_err(map_err(maps::GENERATION, "read"))?;
        let next = now.wrapping_add(1).max(1);
        self.generation
            .set(0, next, 0)
            .map_err(map_err(maps::GENERATION, "bump"))?;
        Ok(next)
    }

    fn sync_maps(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), EbpfError> {
        // Flows tracked under an endpoint id that now names another pod go
        // first (adopted pins: a restarted agent may number endpoints anew).
        // Until a full sync succeeded, the records are those adopted at
        // open (after a layout upgrade, the older layout's, whose flows were
        // copied); then the kernel's.
        let records: Vec<crate::AdoptedEndpoint> = if self.full_synced {
            endpoint_records(&self.endpoints)?
        } else {
            self.adopted_endpoints.clone()
        };
        self.purge_renumbered_flows(compiled, interfaces, &records)?;
        // The IPv4 front first: a slot may only hold its address's current
        // entry (the writes below then fill the free slots).
        self.ipcache4.sweep(&compiled.ipcache);
        // The policy front likewise: words no entry wants go first, the
        // wanted ones are stored after the LPM keys below.
        let want_words: BTreeSet<u64> = compiled
            .policy
            .keys()
            .filter_map(translate::front_words)
            .flatten()
            .collect();
        self.front.sweep(&want_words);
        // Mark: write everything.
        let mut want_policy: BTreeMap<PolicyKey, u32> = BTreeMap::new();
        for (entry, rule) in &compiled.policy {
            for k in translate::policy_keys(entry)? {
                want_policy.insert(k, *rule);
            }
        }
        for (k, rule) in &want_policy {
            self.policy
                .insert(&Key::new(k.prefix_len, k.data), translate::policy_value(*rule), 0)
                .map_err(map_err(maps::POLICY, format!("insert {k:?}")))?;
        }
        for w in &want_words {
            self.front.insert(*w);
        }
        for (addr, e) in &compiled.ipcache {
            self.write_ip(*addr, translate::ip_info(e))?;
        }
        for (net, id) in &compiled.cidrs {
            self.write_cidr(net, *id)?;
        }
        // Every endpoint is rewritten: adopted maps may hold stale values.
        let all: BTreeSet<u32> = compiled.endpoints.keys().copied().collect();
        self.programmed.retain(|id, _| all.contains(id));
        self.written_flags.retain(|id, _| all.contains(id));
        self.program_endpoints(compiled, interfaces, &all)?;

        // Sweep.
        let stale: Vec<Key<[u8; POLICY_KEY_LEN]>> = self
            .policy
            .keys()
            .filter_map(Result::ok)
            .filter(|k| {
                !want_policy.contains_key(&PolicyKey {
                    prefix_len: k.prefix_len(),
                    data: k.data(),
                })
            })
            .collect();
        for k in stale {
            Self::remove_lpm(&mut self.policy, maps::POLICY, &k, "stale policy key")?;
        }
        let want_ips: BTreeSet<IpKey> = compiled.ipcache.keys().map(|a| translate::ip_key(*a)).collect();
        let stale: Vec<IpKey> = self
            .ipcache
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !want_ips.contains(k))
            .collect();
        for k in stale {
            Self::remove_key(&mut self.ipcache, maps::IPCACHE, &k, translate::ip_from_key(&k))?;
        }
        let want_cidrs: BTreeSet<(u32, [u8; 16])> = compiled.cidrs.keys().map(translate::cidr_key).collect();
        let stale: Vec<Key<[u8; 16]>> = self
            .cidrs
            .keys()
            .filter_map(Result::ok)
            .filter(|k| !want_cidrs.contains(&(k.prefix_len(), k.data())))
            .collect();
        for k in stale {
            Self::remove_lpm(&mut self.cidrs, maps::CIDRS, &k, "stale prefix")?;
        }
        let want_if: BTreeSet<u32> = self.programmed.values().copied().collect();
        let stale: Vec<u32> = self
            .endpoints
            .entries()?
            .into_iter()
            .map(|(ifindex, _)| ifindex)
            .filter(|k| !want_if.contains(k))
            .collect();
        for ifindex in stale {
            self.unprogram_ifindex(ifindex)?;
        }
        let stale_links: Vec<u32> = self.attached().into_iter().filter(|i| !want_if.contains(i)).collect();
        for ifindex in stale_links {
            self.detach(ifindex)?;
        }
        let ids: BTreeSet<u32> = self.programmed.keys().copied().collect();
        self.purge_flows(|ep| ids.contains(&ep))?;
        self.full_synced = true;
        Ok(())
    }

    /// Retires the pins of other map layouts beside this one
    /// (`<parent>/v<N>` for every `N` but this layout's, when the pin
    /// directory itself is named `v<LAYOUT_VERSION>`, as the default is, and
    /// the sibling holds npm pins: a `links/` directory or an `NPM_CT` map).
    /// Their pinned links are the only references that keep an older (or,
    /// after a rollback, newer) agent's programs attached, with maps nobody
    /// updates any more; unpinning them detaches those programs. A link is
    /// unpinned only when this layout's program is attached to the same hook
    /// or its interface is gone, so no pod is left without a program (an
    /// endpoint whose interface could not be resolved keeps the old one
    /// until a later full sync attaches the new one). A sibling is removed
    /// once none of its links remain. Called at the end of a full sync:
    /// during the overlap both programs run, and a packet passes only if
    /// both allow it. Returns the removed directories.
    pub fn retire_other_layouts(&self) -> Result<Vec<PathBuf>, EbpfError> {
        let mut removed = Vec::new();
        for path in self.other_layouts()? {
            let links = path.join("links");
            let mut kept = 0;
            if let Ok(entries) = std::fs::read_dir(&links) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let hook = name.split_once('-').and_then(|(i, d)| {
                        let d = match d {
                            "ingress" => DIR_INGRESS,
                            "egress" => DIR_EGRESS,
                            _ => return None,
                        };
                        Some((i.parse::<u32>().ok()?, d))
                    });
                    let replaced = match hook {
                        Some((ifindex, d)) => self.links.contains_key(&(ifindex, d)) || ifname(ifindex).is_err(),
                        None => true,
                    };
                    if !replaced {
                        kept += 1;
                        continue;
                    }
                    std::fs::remove_file(entry.path()).map_err(|e| EbpfError::PinDir {
                        path: entry.path(),
                        detail: format!("unpin a retired link: {e}"),
                    })?;
                }
            }
            if kept > 0 {
                tracing::info!(dir = %path.display(), kept, "links of another map layout kept until this layout attaches there");
                continue;
            }
            std::fs::remove_dir_all(&path).map_err(|e| EbpfError::PinDir {
                path: path.clone(),
                detail: format!("remove a retired layout: {e}"),
            })?;
            tracing::info!(dir = %path.display(), "removed the pins of another map layout");
            removed.push(path);
        }
        Ok(removed)
    }

    /// The pin directories of other npm map layouts beside this one, newest
    /// first (see [`EbpfDataplane::retire_other_layouts`]).
    fn other_layouts(&self) -> Result<Vec<PathBuf>, EbpfError> {
        fn version_of(p: &Path) -> Option<u32> {
            p.file_name()?.to_str()?.strip_prefix('v')?.parse().ok()
        }
        let (Some(mine), Some(parent)) = (version_of(&self.pin_dir), self.pin_dir.parent()) else {
            return Ok(Vec::new());
        };
        if mine != LAYOUT_VERSION {
            return Ok(Vec::new());
        }
        let entries = std::fs::read_dir(parent).map_err(|e| EbpfError::PinDir {
            path: parent.to_path_buf(),
            detail: format!("read: {e}"),
        })?;
        let mut found: Vec<(u32, PathBuf)> = entries
            .flatten()
            .map(|e| e.path())
            .filter_map(|p| Some((version_of(&p)?, p)))
            .filter(|(v, p)| *v != mine && p.is_dir() && (p.join("links").is_dir() || p.join(maps::CT).exists()))
            .collect();
        found.sort_by_key(|f| std::cmp::Reverse(f.0));
        Ok(found.into_iter().map(|(_, p)| p).collect())
    }

    /// After an upgrade that changed the map layout, the new conntrack and
    /// fragment maps start empty while established flows run: copies the
    /// entries of the newest other layout (version 2 or later: their
    /// `CtKey`, `CtKey4`, `CtValue`, `FragKey` and `FragValue` are this
    /// layout's) into ours, when ours are empty. Returns how many entries
    /// were copied. Called on open, before any program of this layout is
    /// attached to a new hook.
    fn migrate_flows(&mut self) -> Result<Option<PathBuf>, EbpfError> {
        if count_ct(&self.ct, &self.ct4) != 0 {
            return Ok(None);
        }
        let Some(src) = self
            .other_layouts()?
            .into_iter()
            .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n != "v1") && p.join(maps::CT4).exists())
        else {
            return Ok(None);
        };
        let ct: BpfHashMap<MapData, CtKey, CtValue> = open_pinned(&src, maps::CT)?;
        let ct4: BpfHashMap<MapData, CtKey4, CtValue> = open_pinned(&src, maps::CT4)?;
        let frags: BpfHashMap<MapData, FragKey, FragValue> = open_pinned(&src, maps::FRAGS)?;
        let mut copied = 0;
        for (k, v) in ct.iter().filter_map(Result::ok) {
            self.ct
                .insert(k, v, 0)
                .map_err(map_err(maps::CT, "copy from another layout"))?;
            copied += 1;
        }
        for (k, v) in ct4.iter().filter_map(Result::ok) {
            self.ct4
                .insert(k, v, 0)
                .map_err(map_err(maps::CT4, "copy from another layout"))?;
            copied += 1;
        }
        for (k, v) in frags.iter().filter_map(Result::ok) {
            self.frags
                .insert(k, v, 0)
                .map_err(map_err(maps::FRAGS, "copy from another layout"))?;
            copied += 1;
        }
        tracing::info!(from = %src.display(), copied, "conntrack of another map layout copied");
        Ok((copied > 0).then_some(src))
    }

    /// Counters summed over CPUs.
    pub fn read_counters(&self) -> Result<Counters, EbpfError> {
        sum_counters(&self.counters)
    }

    /// Drains the ring buffer of deny events.
    pub fn poll_deny_events(&mut self) -> Vec<DenyEvent> {
        let mut out = Vec::new();
        while let Some(item) = self.events.next() {
            if item.len() >= std::mem::size_of::<DenyEvent>() {
                // SAFETY: DenyEvent is plain old data; the read is unaligned-safe.
                let ev = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const DenyEvent) };
                out.push(ev);
            }
        }
        out
    }

    /// Number of conntrack entries (`NPM_CT` and `NPM_CT4`).
    pub fn ct_len(&self) -> usize {
        count_ct(&self.ct, &self.ct4)
    }

    /// The conntrack entries of `NPM_CT` and `NPM_CT4`; the keys of
    /// `NPM_CT4` are given in their [`CtKey`] form (IPv4-mapped addresses).
    pub fn ct_entries(&self) -> Vec<(CtKey, CtValue)> {
        self.ct
            .iter()
            .filter_map(Result::ok)
            .chain(self.ct4.iter().filter_map(Result::ok).map(|(k, v)| (k.to_key(), v)))
            .collect()
    }

    /// The programmed maps' contents.
    pub fn dump(&self) -> Result<EbpfDump, EbpfError> {
        let (ep_slots, endpoints) = self.endpoints.maps();
        dump_maps(
            &self.pin_dir,
            &MapsRef {
                ep_slots,
                endpoints,
                ipcache: &self.ipcache,
                cidrs: &self.cidrs,
                policy: &self.policy,
                ct: &self.ct,
                ct4: &self.ct4,
                frags: &self.frags,
                counters: &self.counters,
            },
            |ifindex, d| self.links.contains_key(&(ifindex, d)),
        )
    }

    fn raw_counters(&self, dir: u8) -> Result<Vec<u64>, EbpfError> {
        (0..REASON_SLOTS)
            .map(|r| {
                let idx = dir as u32 * REASON_SLOTS + r;
                debug_assert!(idx < COUNTER_SLOTS);
                self.counters
                    .get(&idx, 0)
                    .map(|v| v.iter().map(|c| c.packets).sum())
                    .map_err(map_err(maps::COUNTERS, format!("read slot {idx}")))
            })
            .collect()
    }

    fn run(
        &self,
        program: &'static str,
        ifindex: u32,
        packet: &[u8],
        repeat: u32,
    ) -> Result<aya::TestRunResult, EbpfError> {
        // `struct __sk_buff` up to and including `ifindex` (offset 40): the
        // kernel binds the test skb to that device; every other field zero.
        let mut ctx = [0u8; 44];
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        let prog = self.prog(program)?;
        prog.test_run(TestRunOptions {
            data_in: Some(packet),
            ctx_in: Some(&ctx),
            repeat,
            ..TestRunOptions::default()
        })
        .map_err(prog_err(program, format!("test run on ifindex {ifindex}")))
    }

    /// Runs the program of `dir` once on `packet` (an Ethernet frame) as if
    /// it arrived on host-side interface `ifindex` (which must exist), with
    /// `BPF_PROG_TEST_RUN`. Returns the verdict ([`VERDICT_ALLOW`] or
    /// [`VERDICT_DROP`]) and the reason, found from the counter slot that
    /// moved (`None` if other traffic moved counters at the same time).
    pub fn test_run(&self, dir: Direction, ifindex: u32, packet: &[u8]) -> Result<(i32, Option<Reason>), EbpfError> {
        let d = dir.as_u8();
        let before = self.raw_counters(d)?;
        let res = self.run(Self::prog_for(d), ifindex, packet, 1)?;
        let after = self.raw_counters(d)?;
        let moved: Vec<u8> = (0..REASON_SLOTS as u8)
            .filter(|r| after[*r as usize] != before[*r as usize])
            .collect();
        let reason = match moved.as_slice() {
            [r] => Reason::from_u8(*r),
            _ => None,
        };
        Ok((res.return_value as i32, reason))
    }

    /// Benchmark helper: runs a program `repeat` times on `packet` (as on
    /// `ifindex`) and returns the kernel's average time per run.
    pub fn bench_run(
        &self,
        program: &'static str,
        ifindex: u32,
        packet: &[u8],
        repeat: u32,
    ) -> Result<Duration, EbpfError> {
        Ok(self.run(program, ifindex, packet, repeat)?.duration)
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
}

/// Borrowed views of the maps a dump reads (from a loaded dataplane or
/// opened read-only from their pins).
struct MapsRef<'a> {
    ep_slots: &'a Array<MapData, EndpointInfo>,
    endpoints: &'a BpfHashMap<MapData, u32, EndpointInfo>,
    ipcache: &'a BpfHashMap<MapData, IpKey, IpInfo>,
    cidrs: &'a LpmTrie<MapData, [u8; 16], u32>,
    policy: &'a LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue>,
    ct: &'a BpfHashMap<MapData, CtKey, CtValue>,
    ct4: &'a BpfHashMap<MapData, CtKey4, CtValue>,
    frags: &'a BpfHashMap<MapData, FragKey, FragValue>,
    counters: &'a PerCpuArray<MapData, Counter>,
}

fn count_ct(ct: &BpfHashMap<MapData, CtKey, CtValue>, ct4: &BpfHashMap<MapData, CtKey4, CtValue>) -> usize {
    ct.keys().filter(Result::is_ok).count() + ct4.keys().filter(Result::is_ok).count()
}

fn sum_counters(counters: &PerCpuArray<MapData, Counter>) -> Result<Counters, EbpfError> {
    let mut out = Counters::default();
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        for r in Reason::ALL {
            let idx = counter_index(dir, r as u8);
            let values = counters
                .get(&idx, 0)
                .map_err(map_err(maps::COUNTERS, format!("read slot {idx}")))?;
            let (p, b) = values
                .iter()
                .fold((0u64, 0u64), |(p, b), c| (p + c.packets, b + c.bytes));
            if p != 0 || b != 0 {
                out.by_reason.insert((dir, r as u8), (p, b));
            }
        }
    }
    Ok(out)
}

/// Reads every map of `m` into an [`EbpfDump`]; `attached(ifindex, dir)`
/// tells whether the hook of pod direction `dir` is attached.
fn dump_maps(pin_dir: &Path, m: &MapsRef<'_>, attached: impl Fn(u32, u8) -> bool) -> Result<EbpfDump, EbpfError> {
    let mut endpoints: Vec<DumpEndpoint> = endpoints::read_entries(m.ep_slots, m.endpoints)?
        .into_iter()
        .map(|(ifindex, info)| DumpEndpoint {
            ifindex,
            id: info.id,
            flags: info.flags,
            ipv4: translate::endpoint_ipv4(&info),
            ipv6: translate::endpoint_ipv6(&info),
            attached: [DIR_INGRESS, DIR_EGRESS]
                .into_iter()
                .filter(|d| attached(ifindex, *d))
                .map(dir_name)
                .collect(),
        })
        .collect();
    endpoints.sort_by_key(|e| e.ifindex);
    let mut ipcache: Vec<DumpIp> = m
        .ipcache
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| DumpIp {
            addr: translate::ip_from_key(&k),
            identity: v.identity,
            cidr_identity: v.cidr_identity,
        })
        .collect();
    ipcache.sort_by_key(|e| e.addr);
    let mut cidrs = Vec::new();
    for (k, v) in m.cidrs.iter().filter_map(Result::ok) {
        cidrs.push(DumpCidr {
            prefix: translate::cidr_from_key(k.prefix_len(), k.data())?,
            identity: v,
        });
    }
    cidrs.sort_by_key(|c| c.prefix);
    let mut policy: Vec<DumpPolicy> = m
        .policy
        .iter()
        .filter_map(Result::ok)
        .map(|(k, v)| {
            let key = PolicyKey {
                prefix_len: k.prefix_len(),
                data: k.data(),
            };
            let (protocol, ports) = match translate::policy_key_ports(&key) {
                Some((p, lo, hi)) => (Some(p), (lo, hi)),
                None => (None, (0, u16::MAX)),
            };
            DumpPolicy {
                endpoint: key.endpoint(),
                direction: dir_name(key.direction()),
                peer: key.identity(),
                protocol,
                ports,
                prefix_len: key.prefix_len,
                rule: v.rule,
            }
        })
        .collect();
    policy.sort_by(|a, b| {
        (a.endpoint, a.direction, a.peer, a.protocol, a.ports).cmp(&(
            b.endpoint,
            b.direction,
            b.peer,
            b.protocol,
            b.ports,
        ))
    });
    let counters = sum_counters(m.counters)?
        .by_reason
        .into_iter()
        .filter_map(|((d, r), (packets, bytes))| {
            Some(DumpCounter {
                direction: dir_name(d),
                reason: Reason::from_u8(r)?.name(),
                packets,
                bytes,
            })
        })
        .collect();
    Ok(EbpfDump {
        pin_dir: pin_dir.to_path_buf(),
        endpoints,
        ipcache,
        cidrs,
        policy,
        ct_entries: count_ct(m.ct, m.ct4),
        frag_entries: m.frags.keys().filter(Result::is_ok).count(),
        counters,
    })
}

/// Opens the map pinned as `<pin_dir>/<name>` read-only (no program is
/// loaded, nothing is created) as the typed map `T`.
/// Loads a program, retrying when `BPF_PROG_LOAD` returns `EAGAIN`: the
/// verifier gives up with it when a signal is pending while it works (it
/// takes about 130 ms per program here), as libbpf also retries.
fn load_retrying(prog: &mut SchedClassifier) -> Result<(), ProgramError> {
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

/// (pod identities, endpoints) and the endpoint records of an ipcache and
/// endpoint table: the distinct pod identities
/// (`IDENTITY_FIRST_POD..IDENTITY_FIRST_CIDR`) of the ipcache, and every
/// record.
fn adopted_state(
    ipcache: &BpfHashMap<MapData, IpKey, IpInfo>,
    endpoints: &EndpointTable,
) -> Result<((usize, usize), Vec<crate::AdoptedEndpoint>), EbpfError> {
    let mut identities = BTreeSet::new();
    for e in ipcache.iter() {
        let (_, info) = e.map_err(|e: MapError| map_err(maps::IPCACHE, "iterate")(e))?;
        if (npm_common::IDENTITY_FIRST_POD..npm_common::IDENTITY_FIRST_CIDR).contains(&info.identity) {
            identities.insert(info.identity);
        }
    }
    let records = endpoint_records(endpoints)?;
    Ok(((identities.len(), records.len()), records))
}

/// Every endpoint record of the table: interface, id and addresses.
fn endpoint_records(endpoints: &EndpointTable) -> Result<Vec<crate::AdoptedEndpoint>, EbpfError> {
    Ok(endpoints
        .entries()?
        .into_iter()
        .map(|(ifindex, info)| crate::AdoptedEndpoint {
            ifindex,
            id: info.id,
            ipv4: translate::endpoint_ipv4(&info),
            ipv6: translate::endpoint_ipv6(&info),
        })
        .collect())
}

/// [`adopted_state`] of the maps pinned in another layout's directory
/// (layouts 3 and later share the endpoint record; an older one fails to
/// open as typed maps).
fn adopted_state_at(dir: &Path) -> Result<((usize, usize), Vec<crate::AdoptedEndpoint>), EbpfError> {
    let ipcache: BpfHashMap<MapData, IpKey, IpInfo> = open_pinned(dir, maps::IPCACHE)?;
    let slots: Array<MapData, EndpointInfo> = open_pinned(dir, maps::EP_SLOTS)?;
    let overflow: BpfHashMap<MapData, u32, EndpointInfo> = open_pinned(dir, maps::ENDPOINTS)?;
    adopted_state(&ipcache, &EndpointTable::new(slots, overflow))
}

fn open_pinned<T>(pin_dir: &Path, name: &'static str) -> Result<T, EbpfError>
where
    T: TryFrom<aya::maps::Map, Error = MapError>,
{
    let path = pin_dir.join(name);
    if !path.exists() {
        return Err(EbpfError::NotPinned { path });
    }
    let data = MapData::from_pin(&path).map_err(map_err(name, format!("open pin {}", path.display())))?;
    let map = aya::maps::Map::from_map_data(data).map_err(map_err(name, "identify map type"))?;
    T::try_from(map).map_err(map_err(name, "open as typed map (layout mismatch?)"))
}

/// The program id of every tcx link pinned under `<pin_dir>/links`, keyed
/// by (ifindex, pod direction `"ingress"`/`"egress"`). Read-only: the
/// links are opened by their pins and closed again, never updated. Pins
/// whose link cannot be opened are left out.
pub fn pinned_link_programs(pin_dir: &Path) -> Result<BTreeMap<(u32, &'static str), u32>, EbpfError> {
    let dir = pin_dir.join("links");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(BTreeMap::new()),
        Err(e) => {
            return Err(EbpfError::PinDir {
                path: dir,
                detail: format!("read: {e}"),
            })
        }
    };
    let mut out = BTreeMap::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((i, d)) = name.split_once('-') else {
            continue;
        };
        let (Ok(ifindex), Some(d)) = (
            i.parse::<u32>(),
            match d {
                "ingress" => Some(dir_name(DIR_INGRESS)),
                "egress" => Some(dir_name(DIR_EGRESS)),
                _ => None,
            },
        ) else {
            continue;
        };
        let path = entry.path();
        let link = match PinnedLink::from_pin(&path) {
            Ok(l) => FdLink::from(l),
            Err(e) => {
                tracing::debug!(path = %path.display(), error = %e, "pinned link unreadable");
                continue;
            }
        };
        let info = link.info().map_err(|e| EbpfError::Link {
            path: path.clone(),
            detail: format!("link info: {e}"),
        })?;
        out.insert((ifindex, d), info.program_id());
    }
    Ok(out)
}

/// Read-only dump of the maps pinned under `pin_dir`, for `npm-agent
/// inspect`: opens the pinned maps by path, loads no program, attaches
/// nothing and replaces no link, so inspecting never touches enforcement.
/// An endpoint's hook counts as attached when its link is pinned, its link
/// can be opened and its interface exists.
///
/// Errors: [`EbpfError::NotPinned`] when a map is not pinned there (no
/// agent ran with this pin directory), [`EbpfError::Map`] when a pinned map
/// cannot be opened or has another layout.
pub fn dump_pinned(pin_dir: &Path) -> Result<EbpfDump, EbpfError> {
    let ep_slots: Array<MapData, EndpointInfo> = open_pinned(pin_dir, maps::EP_SLOTS)?;
    let endpoints: BpfHashMap<MapData, u32, EndpointInfo> = open_pinned(pin_dir, maps::ENDPOINTS)?;
    let ipcache: BpfHashMap<MapData, IpKey, IpInfo> = open_pinned(pin_dir, maps::IPCACHE)?;
    let cidrs: LpmTrie<MapData, [u8; 16], u32> = open_pinned(pin_dir, maps::CIDRS)?;
    let policy: LpmTrie<MapData, [u8; POLICY_KEY_LEN], PolicyValue> = open_pinned(pin_dir, maps::POLICY)?;
    let ct: BpfHashMap<MapData, CtKey, CtValue> = open_pinned(pin_dir, maps::CT)?;
    let ct4: BpfHashMap<MapData, CtKey4, CtValue> = open_pinned(pin_dir, maps::CT4)?;
    let frags: BpfHashMap<MapData, FragKey, FragValue> = open_pinned(pin_dir, maps::FRAGS)?;
    let counters: PerCpuArray<MapData, Counter> = open_pinned(pin_dir, maps::COUNTERS)?;
    let links = pinned_link_programs(pin_dir)?;
    dump_maps(
        pin_dir,
        &MapsRef {
            ep_slots: &ep_slots,
            endpoints: &endpoints,
            ipcache: &ipcache,
            cidrs: &cidrs,
            policy: &policy,
            ct: &ct,
            ct4: &ct4,
            frags: &frags,
            counters: &counters,
        },
        |ifindex, d| links.contains_key(&(ifindex, dir_name(d))) && ifname(ifindex).is_ok(),
    )
}
