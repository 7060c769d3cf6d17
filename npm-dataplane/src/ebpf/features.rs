//! What the kernel must offer before the datapath is loaded
//! ([`check_kernel`]): kernel BTF, the `sched_cls` program type, every map
//! type the object declares (hash, LRU hash, array, memory-mappable array,
//! per-CPU array, LPM trie, ring buffer), every helper the programs call,
//! and a way to attach (tcx, or a `clsact` qdisc for tc). Each probe is a
//! tiny map create or program load that is closed at once; tcx is probed
//! with a `BPF_PROG_QUERY` of the tcx hook of `lo` (read-only), `clsact` by
//! adding one to `lo` in a private network namespace that exists only for
//! the probe. Nothing on the node changes.

use std::fmt;
use std::path::Path;

use aya::maps::{Array, MapData, MapType};
use aya::programs::tc::{self, TcError};
use aya::programs::{ProgramType, SchedClassifier, TcAttachType};
use aya::sys::{is_helper_supported, is_map_supported, is_program_supported, BpfHelper};

use super::links::AttachMode;

/// Kernel BTF, as aya reads it for relocations.
const KERNEL_BTF: &str = "/sys/kernel/btf/vmlinux";
/// `BPF_F_MMAPABLE`.
const BPF_F_MMAPABLE: u32 = 1 << 10;

/// The map types of the object's maps, with the kernel that added each.
const MAP_TYPES: [(MapType, &str); 6] = [
    (MapType::Hash, "hash (3.19)"),
    (MapType::Array, "array (3.19)"),
    (MapType::PerCpuArray, "per-CPU array (4.6)"),
    (MapType::LruHash, "LRU hash (4.10)"),
    (MapType::LpmTrie, "LPM trie (4.11)"),
    (MapType::RingBuf, "ring buffer (5.8)"),
];

/// The helpers the programs call, with the kernel that added each.
const HELPERS: [(BpfHelper, &str); 6] = [
    (BpfHelper::BPF_FUNC_map_lookup_elem, "bpf_map_lookup_elem (3.19)"),
    (BpfHelper::BPF_FUNC_map_update_elem, "bpf_map_update_elem (3.19)"),
    (BpfHelper::BPF_FUNC_skb_load_bytes, "bpf_skb_load_bytes (4.5)"),
    (BpfHelper::BPF_FUNC_jiffies64, "bpf_jiffies64 (5.5)"),
    (BpfHelper::BPF_FUNC_ringbuf_output, "bpf_ringbuf_output (5.8)"),
    (
        BpfHelper::BPF_FUNC_ktime_get_coarse_ns,
        "bpf_ktime_get_coarse_ns (5.11)",
    ),
];

/// One kernel feature the datapath needs and the kernel lacks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Missing {
    /// No kernel BTF at `/sys/kernel/btf/vmlinux` (`CONFIG_DEBUG_INFO_BTF`).
    Btf,
    /// The `sched_cls` program type.
    ProgramType,
    /// A map type (named with the kernel that added it).
    MapType(&'static str),
    /// `BPF_F_MMAPABLE` arrays (5.5).
    MmapableArray,
    /// A helper from `sched_cls` programs (named with its kernel).
    Helper(&'static str),
    /// tcx (6.6), asked for with `--attach tcx`.
    Tcx,
    /// The `clsact` qdisc (`sch_ingress`), asked for with `--attach tc`.
    Clsact,
    /// Neither tcx nor `clsact`: nothing to attach with.
    TcxOrClsact,
    /// A probe failed for another reason than a missing feature (a
    /// missing capability, say).
    Probe {
        /// What was probed.
        what: &'static str,
        /// The error.
        error: String,
    },
}

impl fmt::Display for Missing {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Missing::Btf => write!(f, "kernel BTF ({KERNEL_BTF}, CONFIG_DEBUG_INFO_BTF)"),
            Missing::ProgramType => f.write_str("the sched_cls (tc classifier) program type"),
            Missing::MapType(t) => write!(f, "map type {t}"),
            Missing::MmapableArray => f.write_str("memory-mappable arrays (BPF_F_MMAPABLE, 5.5)"),
            Missing::Helper(h) => write!(f, "helper {h} for sched_cls programs"),
            Missing::Tcx => f.write_str("tcx (Linux 6.6; use --attach tc or auto)"),
            Missing::Clsact => f.write_str("the clsact qdisc (sch_ingress, CONFIG_NET_SCH_INGRESS)"),
            Missing::TcxOrClsact => f.write_str("an attach point: neither tcx (6.6) nor the clsact qdisc"),
            Missing::Probe { what, error } => write!(f, "probing {what} failed: {error}"),
        }
    }
}

/// The kernel lacks what the datapath needs: every missing feature.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the kernel {release} cannot run the npm datapath; missing: {}", .missing.iter().map(ToString::to_string).collect::<Vec<_>>().join("; "))]
pub struct MissingFeatures {
    /// The running kernel's release (`/proc/sys/kernel/osrelease`, as
    /// `uname -r` prints it; `unknown` when unreadable).
    pub release: String,
    /// What is missing.
    pub missing: Vec<Missing>,
}

/// The running kernel's release, as `uname -r` prints it.
fn kernel_release() -> String {
    std::fs::read_to_string("/proc/sys/kernel/osrelease")
        .map(|r| r.trim().to_string())
        .unwrap_or_else(|_| "unknown".into())
}

/// What the attach probes found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelFeatures {
    /// tcx is there.
    pub tcx: bool,
    /// `clsact` is there (`None`: not probed, tcx is used).
    pub clsact: Option<bool>,
}

/// Whether the kernel has tcx: a `BPF_PROG_QUERY` of `lo`'s tcx ingress
/// hook succeeds where tcx exists and fails with `EINVAL` (an unknown
/// attach type) where it does not. Read-only. Kernel versions are not
/// trusted: distributions backport tcx.
pub fn tcx_supported() -> bool {
    match SchedClassifier::query_tcx("lo", TcAttachType::Ingress) {
        Ok(_) => true,
        Err(e) => {
            tracing::debug!(error = %e, "tcx probe: no tcx");
            false
        }
    }
}

/// Whether the `clsact` qdisc can be created: adds one to `lo` of a
/// private network namespace, on a thread of its own that exits with it.
/// `Err` when the probe cannot run (no `CAP_SYS_ADMIN` for the namespace).
fn clsact_supported() -> Result<bool, String> {
    std::thread::spawn(|| {
        // SAFETY: unshare of the calling thread's network namespace only.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(format!("unshare(CLONE_NEWNET): {}", std::io::Error::last_os_error()));
        }
        match tc::qdisc_add_clsact("lo") {
            Ok(()) => Ok(true),
            Err(TcError::NetlinkError(e)) if matches!(e.raw_os_error(), Some(libc::ENOENT | libc::EOPNOTSUPP)) => {
                Ok(false)
            }
            Err(e) => Err(e.to_string()),
        }
    })
    .join()
    .unwrap_or_else(|_| Err("probe thread panicked".into()))
}

fn probe_err(what: &'static str, e: impl fmt::Display) -> Missing {
    Missing::Probe {
        what,
        error: e.to_string(),
    }
}

/// Checks that the kernel offers everything the datapath needs with attach
/// mode `mode`: kernel BTF, the program type, the map types, the helpers,
/// and tcx (`Tcx`), `clsact` (`Tc`) or either (`Auto`). Returns what the
/// attach probes found, or every missing feature.
pub fn check_kernel(mode: AttachMode) -> Result<KernelFeatures, MissingFeatures> {
    let mut missing = Vec::new();
    if !Path::new(KERNEL_BTF).exists() {
        missing.push(Missing::Btf);
    }
    match is_program_supported(ProgramType::SchedClassifier) {
        Ok(true) => {
            for (helper, name) in HELPERS {
                match is_helper_supported(ProgramType::SchedClassifier, helper) {
                    Ok(true) => {}
                    Ok(false) => missing.push(Missing::Helper(name)),
                    Err(e) => missing.push(probe_err(name, e)),
                }
            }
        }
        Ok(false) => missing.push(Missing::ProgramType),
        Err(e) => missing.push(probe_err("the sched_cls program type", e)),
    }
    for (t, name) in MAP_TYPES {
        match is_map_supported(t) {
            Ok(true) => {}
            Ok(false) => missing.push(Missing::MapType(name)),
            Err(e) => missing.push(probe_err(name, e)),
        }
    }
    match Array::<MapData, u64>::create(1, BPF_F_MMAPABLE) {
        Ok(_) => {}
        Err(aya::maps::MapError::CreateError { io_error, .. }) if io_error.raw_os_error() == Some(libc::EINVAL) => {
            missing.push(Missing::MmapableArray)
        }
        Err(e) => missing.push(probe_err("memory-mappable arrays", e)),
    }
    let tcx = tcx_supported();
    let clsact = match mode {
        AttachMode::Tcx => {
            if !tcx {
                missing.push(Missing::Tcx);
            }
            None
        }
        AttachMode::Auto if tcx => None,
        AttachMode::Auto | AttachMode::Tc => match clsact_supported() {
            Ok(true) => Some(true),
            Ok(false) => {
                missing.push(if mode == AttachMode::Tc {
                    Missing::Clsact
                } else {
                    Missing::TcxOrClsact
                });
                Some(false)
            }
            Err(e) => {
                // Cannot tell: the first attach reports it.
                tracing::warn!(error = %e, "could not probe the clsact qdisc");
                None
            }
        },
    };
    if missing.is_empty() {
        Ok(KernelFeatures { tcx, clsact })
    } else {
        Err(MissingFeatures {
            release: kernel_release(),
            missing,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_names_every_missing_feature() {
        let e = MissingFeatures {
            release: "5.10.0-46-amd64".into(),
            missing: vec![
                Missing::Btf,
                Missing::MapType("ring buffer (5.8)"),
                Missing::TcxOrClsact,
            ],
        };
        let text = e.to_string();
        assert!(text.starts_with("the kernel 5.10.0-46-amd64 cannot run"), "{text}");
        assert!(text.contains("kernel BTF (/sys/kernel/btf/vmlinux"), "{text}");
        assert!(text.contains("map type ring buffer (5.8)"), "{text}");
        assert!(text.contains("neither tcx (6.6) nor the clsact qdisc"), "{text}");
        let listed = text.split_once("missing: ").map(|(_, l)| l).unwrap_or_default();
        assert_eq!(listed.split("; ").count(), 3, "{text}");
    }
}
