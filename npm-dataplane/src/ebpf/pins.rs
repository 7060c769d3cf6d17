//! The pins on bpffs: mounting bpffs, the layout of a pin directory
//! (`<pin dir>/<map>` and `<pin dir>/links/<ifindex>-<direction>`),
//! opening a pinned map read-only, the pin directories of other map layouts
//! beside this one (`<parent>/v<N>`), the migration of an older layout's
//! flows and records on open, the retirement of its pins after a full
//! sync, and the size a pinned map keeps ([`effective_sizes`]).

use std::ffi::{CStr, OsStr};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap as BpfHashMap, MapData, MapError};
use npm_common::{maps, EndpointInfo, IpInfo, IpKey, DIR_EGRESS, DIR_INGRESS, LAYOUT_VERSION};

use super::conntrack::Flows;
use super::endpoints::{adopted_records, flags_before_layout_7, read_entries, RecordV5};
use super::errors::{map_err, EbpfError};
use super::links::{delete_filter, dir_name, ifname};
use super::loader::{actual_sizes, EffectiveSizes, MapSizes};
use super::tc_filters;
use super::{adopted_state, AdoptedState, EbpfDataplane};

const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const BPF_ROOT: &CStr = c"/sys/fs/bpf";

/// `/sys/fs/bpf`.
fn bpf_root() -> &'static Path {
    Path::new(OsStr::from_bytes(BPF_ROOT.to_bytes()))
}

/// `/sys/fs/bpf/npm/v<LAYOUT_VERSION>`.
pub fn default_pin_dir() -> PathBuf {
    bpf_root().join("npm").join(format!("v{LAYOUT_VERSION}"))
}

/// Mounts bpffs at `/sys/fs/bpf` unless it is mounted already.
pub fn ensure_bpffs() -> Result<(), EbpfError> {
    let root = bpf_root();
    let err = |op: &'static str| {
        move |source: std::io::Error| EbpfError::PinDir {
            path: root.to_path_buf(),
            op,
            source,
        }
    };
    std::fs::create_dir_all(root).map_err(err("create"))?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and struct pointer.
    if unsafe { libc::statfs(BPF_ROOT.as_ptr(), &mut st) } != 0 {
        return Err(err("statfs")(std::io::Error::last_os_error()));
    }
    #[allow(clippy::unnecessary_cast)]
    if st.f_type as i64 == BPF_FS_MAGIC {
        return Ok(());
    }
    let fstype = c"bpf";
    // SAFETY: valid C strings; no data argument.
    let rc = unsafe { libc::mount(fstype.as_ptr(), BPF_ROOT.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(err("mount bpffs")(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Mounts bpffs if needed and creates `pin_dir` with its `links/`.
pub(crate) fn prepare(pin_dir: &Path) -> Result<(), EbpfError> {
    ensure_bpffs()?;
    std::fs::create_dir_all(pin_dir.join("links")).map_err(|source| EbpfError::PinDir {
        path: pin_dir.to_path_buf(),
        op: "create",
        source,
    })
}

/// The configured and the actual sizes of the configurable maps after a
/// load under `pin_dir`. A map adopted from its pin keeps the size it was
/// created with: npm never recreates a pinned map to resize it (that would
/// drop every tracked connection, or leave a moment without the policy
/// entries); a difference is logged as a warning naming the map and both
/// sizes, and the configured size applies once the pins are gone
/// (`npm-agent cleanup`, `helm uninstall`, a reboot).
pub(crate) fn effective_sizes(
    bpf: &aya::Ebpf,
    pin_dir: &Path,
    configured: MapSizes,
) -> Result<EffectiveSizes, EbpfError> {
    let sizes = EffectiveSizes {
        configured,
        actual: MapSizes {
            // Not a size: the quota applies as configured, to pinned maps too.
            conntrack_quota_share: configured.conntrack_quota_share,
            ..actual_sizes(bpf)?
        },
    };
    for (map, actual, wanted) in sizes.pending() {
        tracing::warn!(
            map,
            pinned_size = actual,
            configured_size = wanted,
            pin = %pin_dir.join(map).display(),
            "pinned map keeps its size; the configured size applies after `npm-agent cleanup` (or `helm uninstall`) or a reboot removes the pins"
        );
    }
    Ok(sizes)
}

/// `<pin_dir>/links/<ifindex>-<direction>`: the pin of the link of pod
/// direction `dir` on `ifindex`.
pub(crate) fn link_path(pin_dir: &Path, ifindex: u32, dir: u8) -> PathBuf {
    pin_dir.join("links").join(format!("{ifindex}-{}", dir_name(dir)))
}

/// The (ifindex, pod direction) of a link pin's file name
/// `<ifindex>-ingress` or `<ifindex>-egress`.
pub(crate) fn parse_link_name(name: &str) -> Option<(u32, u8)> {
    let (i, d) = name.split_once('-')?;
    let d = match d {
        "ingress" => DIR_INGRESS,
        "egress" => DIR_EGRESS,
        _ => return None,
    };
    Some((i.parse().ok()?, d))
}

/// A file of `<pin dir>/links`: the (ifindex, pod direction) its name
/// gives (`None` for a file of another name) and its path.
pub(crate) type LinkPin = (Option<(u32, u8)>, PathBuf);

/// The files of `<pin_dir>/links`. An absent directory is
/// [`std::io::ErrorKind::NotFound`].
pub(crate) fn link_pins(pin_dir: &Path) -> Result<Vec<LinkPin>, std::io::Error> {
    Ok(std::fs::read_dir(pin_dir.join("links"))?
        .flatten()
        .map(|entry| (parse_link_name(&entry.file_name().to_string_lossy()), entry.path()))
        .collect())
}

/// Opens the map pinned as `<pin_dir>/<name>` read-only (no program is
/// loaded, nothing is created) as the typed map `T`.
pub(crate) fn open_pinned<T>(pin_dir: &Path, name: &'static str) -> Result<T, EbpfError>
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

/// The pin directories of other npm map layouts beside `pin_dir`, newest
/// first (see [`EbpfDataplane::retire_other_layouts`]).
fn other_layouts(pin_dir: &Path) -> Result<Vec<PathBuf>, EbpfError> {
    let (Some(mine), Some(parent)) = (layout_of(pin_dir), pin_dir.parent()) else {
        return Ok(Vec::new());
    };
    if mine != LAYOUT_VERSION {
        return Ok(Vec::new());
    }
    let entries = std::fs::read_dir(parent).map_err(|source| EbpfError::PinDir {
        path: parent.to_path_buf(),
        op: "read",
        source,
    })?;
    let mut found: Vec<(u32, PathBuf)> = entries
        .flatten()
        .map(|e| e.path())
        .filter_map(|p| Some((layout_of(&p)?, p)))
        .filter(|(v, p)| *v != mine && p.is_dir() && (p.join("links").is_dir() || p.join(maps::CT).exists()))
        .collect();
    found.sort_by_key(|f| std::cmp::Reverse(f.0));
    Ok(found.into_iter().map(|(_, p)| p).collect())
}

/// Whether another map layout beside `pin_dir` has tcx links pinned.
pub(crate) fn other_layouts_have_links(pin_dir: &Path) -> bool {
    other_layouts(pin_dir)
        .unwrap_or_default()
        .iter()
        .any(|p| link_pins(p).is_ok_and(|l| !l.is_empty()))
}

/// After an upgrade that changed the map layout, the new conntrack and
/// fragment maps start empty while established flows run: copies the
/// entries of the newest other layout (version 2 or later: their `CtKey`,
/// `CtKey4`, `CtValue`, `FragKey` and `FragValue` are this layout's) into
/// `flows`, when they are empty. Returns the layout copied from, when
/// entries were copied. Called on open, before any program of this layout
/// is attached to a new hook.
pub(crate) fn migrate_flows(pin_dir: &Path, flows: &mut Flows) -> Result<Option<PathBuf>, EbpfError> {
    if flows.ct_len() != 0 {
        return Ok(None);
    }
    let Some(src) = other_layouts(pin_dir)?
        .into_iter()
        .find(|p| p.file_name().and_then(|n| n.to_str()).is_some_and(|n| n != "v1") && p.join(maps::CT4).exists())
    else {
        return Ok(None);
    };
    let copied = flows.copy_from(&Flows::open_pinned(&src)?)?;
    tracing::info!(from = %src.display(), copied, "conntrack of another map layout copied");
    Ok((copied > 0).then_some(src))
}

/// [`adopted_state`] of the maps pinned in another layout's directory
/// (an older one: its flags are read with [`flags_before_layout_7`]).
/// Layout 6 stores this layout's 44-byte record; layouts 3 to 5 the
/// 40-byte record without the subject ([`RecordV5`]), read when the pinned
/// maps' value size is not this layout's (an older layout than 3, or a
/// record of another size, fails to open as typed maps).
pub(crate) fn adopted_state_at(dir: &Path) -> Result<AdoptedState, EbpfError> {
    let ipcache: BpfHashMap<MapData, IpKey, IpInfo> = open_pinned(dir, maps::IPCACHE)?;
    let current = || -> Result<_, EbpfError> {
        let slots: Array<MapData, EndpointInfo> = open_pinned(dir, maps::EP_SLOTS)?;
        let overflow: BpfHashMap<MapData, u32, EndpointInfo> = open_pinned(dir, maps::ENDPOINTS)?;
        Ok((slots, overflow))
    };
    let entries = match current() {
        Ok((slots, overflow)) => read_entries(&slots, &overflow)?,
        Err(e) => {
            let slots: Array<MapData, RecordV5> = open_pinned(dir, maps::EP_SLOTS).map_err(|_| e)?;
            let overflow: BpfHashMap<MapData, u32, RecordV5> = open_pinned(dir, maps::ENDPOINTS)?;
            read_entries(&slots, &overflow)?
        }
    };
    let older = layout_of(dir).is_some_and(|v| v < 7);
    let entries = entries
        .into_iter()
        .map(|(ifindex, mut info)| {
            if older {
                info.flags = flags_before_layout_7(info.flags);
            }
            (ifindex, info)
        })
        .collect();
    adopted_state(&ipcache, adopted_records(entries))
}

/// The layout version `N` of a pin directory named `v<N>`.
fn layout_of(dir: &Path) -> Option<u32> {
    dir.file_name()?.to_str()?.strip_prefix('v')?.parse().ok()
}

impl EbpfDataplane {
    /// Retires the pins of other map layouts beside this one
    /// (`<parent>/v<N>` for every `N` but this layout's, when the pin
    /// directory itself is named `v<LAYOUT_VERSION>`, as the default is, and
    /// the sibling holds npm pins: a `links/` directory or an `NPM_CT` map).
    /// Their pinned links (and tc filters) are the only references that keep
    /// an older (or, after a rollback, newer) agent's programs attached, with
    /// maps nobody updates any more; unpinning them detaches those programs.
    /// A link is unpinned (a filter deleted) only when this layout's program
    /// is attached to the same hook or its interface is gone, so no pod is left without a program (an
    /// endpoint whose interface could not be resolved keeps the old one
    /// until a later full sync attaches the new one). A sibling is removed
    /// once none of its links remain. Called at the end of a full sync:
    /// during the overlap both programs run, and a packet passes only if
    /// both allow it. Returns the removed directories.
    pub fn retire_other_layouts(&self) -> Result<Vec<PathBuf>, EbpfError> {
        let mut removed = Vec::new();
        for path in other_layouts(&self.pin_dir)? {
            let mut kept = 0;
            for (hook, pin) in link_pins(&path).unwrap_or_default() {
                let replaced = match hook {
                    Some((ifindex, d)) => self.links.contains_key(&(ifindex, d)) || ifname(ifindex).is_err(),
                    None => true,
                };
                if !replaced {
                    kept += 1;
                    continue;
                }
                std::fs::remove_file(&pin).map_err(|source| EbpfError::PinDir {
                    path: pin,
                    op: "unpin a retired link",
                    source,
                })?;
            }
            // Its tc filters: where this layout attached with tc they were
            // replaced (same priority and handle) and are not its any more;
            // where it attached with tcx they go now; elsewhere they stay.
            for (ifindex, d) in tc_filters::filters_of(&path)?.into_keys() {
                if self.links.contains_key(&(ifindex, d)) {
                    delete_filter(ifindex, d)?;
                } else {
                    kept += 1;
                }
            }
            if kept > 0 {
                tracing::info!(dir = %path.display(), kept, "links or filters of another map layout kept until this layout attaches there");
                continue;
            }
            std::fs::remove_dir_all(&path).map_err(|source| EbpfError::PinDir {
                path: path.clone(),
                op: "remove a retired layout",
                source,
            })?;
            tracing::info!(dir = %path.display(), "removed the pins of another map layout");
            removed.push(path);
        }
        Ok(removed)
    }
}
