//! `npm-agent cleanup`: removes everything npm put on a node, so that
//! traffic flows as without npm. Run on `helm uninstall` (a pre-delete
//! hook, after the agents stopped) or by hand; idempotent, a second run
//! succeeds and changes nothing.
//!
//! 1. eBPF: in every pin directory under `/sys/fs/bpf/npm` (every map
//!    layout `v<N>`; only `--pin-dir` when it is given) npm's tc filters
//!    whose programs use that directory's maps are deleted (the `tc` attach
//!    mode: filters are not pinned), each pinned tcx link is detached
//!    (`BPF_LINK_DETACH`, so the program leaves the hook at once even if
//!    some process still holds the link) and unpinned, then the directory
//!    is removed with its map pins, which frees the maps. A directory that
//!    is not on a bpf filesystem is refused, never removed.
//!    The `INPUT` rules of `host_in` (the chain
//!    `npm_dataplane::ebpf::host_in_chain` of each pin directory removed,
//!    in iptables and ip6tables, and `INPUT`'s jump to it) go with it, and
//!    every such chain whose program pin is gone.
//! 2. nftables: the `inet` table (`--nft-table`, default `npm`) is deleted
//!    (absent: nothing to do; no `nft` binary: no table can exist).
//! 3. DNS learning: every `NPM-DNS-<queue>` chain of iptables' and
//!    ip6tables' `mangle` table and its jump from `POSTROUTING`
//!    ([`crate::dns::capture::remove_rules`]; none: nothing to do).
//! 4. CNI: npm-cni's entry is removed from every conflist of
//!    `--cni-conf-dir` and the binary from `--cni-bin-dir`
//!    ([`npm_cni::install::uninstall`]).
//!
//! Every step runs even when an earlier one failed; the command fails if
//! any did, naming each failure.
//!
//! The tc filters are removed by npm-dataplane
//! ([`npm_dataplane::ebpf::remove_pinned_filters`]); it has no public call
//! that detaches links or removes a pin directory, so those are written
//! here with the BPF syscall and `std::fs` (the link pin layout is the
//! loader's: `<pin dir>/links/<ifindex>-<direction>`).

use std::ffi::CString;
use std::os::fd::{FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

use npm_dataplane::nft::{NftDataplane, NftError, NftOptions};

/// The magic number of a bpf filesystem (`statfs.f_type`).
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
/// `BPF_OBJ_GET`: open a pinned object.
const BPF_OBJ_GET: libc::c_long = 7;
/// `BPF_LINK_DETACH`: detach a link from its hook.
const BPF_LINK_DETACH: libc::c_long = 34;

/// What `cleanup` removes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CleanupOptions {
    /// Only this pin directory (`--pin-dir`); `None`: every directory under
    /// `pin_root`.
    pub pin_dir: Option<PathBuf>,
    /// The parent of the layouts' pin directories (`/sys/fs/bpf/npm`).
    pub pin_root: PathBuf,
    /// The nftables table (`--nft-table`).
    pub nft_table: String,
    /// The CNI configuration directory (`--cni-conf-dir`).
    pub cni_conf_dir: PathBuf,
    /// The CNI plugin directory (`--cni-bin-dir`).
    pub cni_bin_dir: PathBuf,
}

/// What `cleanup` did.
#[derive(Debug, Default)]
pub struct CleanupReport {
    /// npm's tc filters deleted: (ifindex, pod direction).
    pub filters: Vec<(u32, &'static str)>,
    /// The link pins detached and removed.
    pub links: Vec<PathBuf>,
    /// The pin directories removed.
    pub pin_dirs: Vec<PathBuf>,
    /// Whether the nftables table existed and was deleted.
    pub nft_table_removed: bool,
    /// The conflists npm-cni's entry was removed from.
    pub conflists: Vec<PathBuf>,
    /// Conflists left alone (unreadable, malformed), with the reason.
    pub conflists_skipped: Vec<(PathBuf, String)>,
    /// Whether the npm-cni binary was removed.
    pub cni_binary_removed: bool,
    /// The NFQUEUE queues of the DNS learning whose rules were removed.
    pub dns_queues: Vec<u16>,
    /// The `host_in` `INPUT` chains removed.
    pub host_in_chains: Vec<String>,
    /// The steps that failed.
    pub failures: Vec<String>,
}

/// `cleanup` did not remove everything.
#[derive(Debug, thiserror::Error)]
#[error("cleanup incomplete: {}", failures.join("; "))]
pub struct CleanupError {
    /// Each step that failed, with its error.
    pub failures: Vec<String>,
}

fn on_bpffs(path: &Path) -> std::io::Result<bool> {
    let c = CString::new(path.as_os_str().as_bytes())?;
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and struct pointer.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    #[allow(clippy::unnecessary_cast)]
    Ok(st.f_type as i64 == BPF_FS_MAGIC)
}

/// `bpf(cmd, attr)` with the attribute struct `attr`.
fn bpf<T>(cmd: libc::c_long, attr: &mut T) -> std::io::Result<libc::c_long> {
    // SAFETY: `attr` is a `#[repr(C)]` prefix of `union bpf_attr` for `cmd`,
    // valid for its size; the kernel reads (and for some commands writes) it.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr as *mut T, std::mem::size_of::<T>()) };
    if rc < 0 {
        Err(std::io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

/// Detach the link pinned at `pin` from its hook (`BPF_LINK_DETACH`).
fn detach_link(pin: &Path) -> std::io::Result<()> {
    #[repr(C)]
    struct ObjGet {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        path_fd: i32,
    }
    #[repr(C)]
    struct LinkDetach {
        link_fd: u32,
    }
    let path = CString::new(pin.as_os_str().as_bytes())?;
    let mut get = ObjGet {
        pathname: path.as_ptr() as u64,
        bpf_fd: 0,
        file_flags: 0,
        path_fd: 0,
    };
    let fd = bpf(BPF_OBJ_GET, &mut get)?;
    // SAFETY: BPF_OBJ_GET returned a new file descriptor that we own.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut detach = LinkDetach {
        link_fd: std::os::fd::AsRawFd::as_raw_fd(&fd) as u32,
    };
    bpf(BPF_LINK_DETACH, &mut detach)?;
    Ok(())
}

/// Detach and unpin every link of `<dir>/links` and `<dir>/exit`, then remove `dir` with
/// its map pins.
fn remove_pin_dir(dir: &Path, report: &mut CleanupReport) -> Result<(), String> {
    match on_bpffs(dir) {
        Ok(true) => {}
        Ok(false) => return Err(format!("{} is not on a bpf filesystem: not removed", dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(format!("{}: statfs: {e}", dir.display())),
    }
    // Before the maps go: a filter's owner is told by their ids.
    match npm_dataplane::ebpf::remove_pinned_filters(dir) {
        Ok(removed) => report.filters.extend(removed),
        Err(e) => return Err(format!("{}: tc filters: {e}", dir.display())),
    }
    // node_exit's filters (kernels without tcx), on the uplinks.
    match npm_dataplane::ebpf::remove_node_exit_filters(dir) {
        Ok(removed) => report.filters.extend(removed.into_iter().map(|i| (i, "node-exit"))),
        Err(e) => return Err(format!("{}: node-exit tc filters: {e}", dir.display())),
    }
    // The endpoint links (`links/`) and the node-exit links (`exit/`).
    let mut pins: Vec<PathBuf> = Vec::new();
    for sub in ["links", "exit"] {
        let links = dir.join(sub);
        match std::fs::read_dir(&links) {
            Ok(entries) => pins.extend(entries.flatten().map(|e| e.path())),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", links.display())),
        }
    }
    for pin in pins {
        if let Err(e) = detach_link(&pin) {
            // Unpinning still releases the link once no process holds it.
            tracing::warn!(pin = %pin.display(), error = %e, "BPF_LINK_DETACH failed; unpinning");
        }
        match std::fs::remove_file(&pin) {
            Ok(()) => report.links.push(pin),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("unpin {}: {e}", pin.display())),
        }
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => {
            report.pin_dirs.push(dir.to_path_buf());
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(format!("remove {}: {e}", dir.display())),
    }
}

/// The pin directories to remove: `--pin-dir`, or every directory under
/// the root.
fn pin_dirs(opts: &CleanupOptions) -> Result<Vec<PathBuf>, String> {
    if let Some(dir) = &opts.pin_dir {
        return Ok(vec![dir.clone()]);
    }
    match std::fs::read_dir(&opts.pin_root) {
        Ok(entries) => {
            let mut dirs: Vec<PathBuf> = entries.flatten().map(|e| e.path()).filter(|p| p.is_dir()).collect();
            dirs.sort();
            Ok(dirs)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("{}: {e}", opts.pin_root.display())),
    }
}

fn remove_ebpf(opts: &CleanupOptions, report: &mut CleanupReport) {
    let dirs = match pin_dirs(opts) {
        Ok(d) => d,
        Err(e) => {
            report.failures.push(format!("eBPF pins: {e}"));
            return;
        }
    };
    for dir in dirs {
        if let Err(e) = remove_pin_dir(&dir, report) {
            report.failures.push(format!("eBPF pins: {e}"));
        }
    }
    // The layouts' parent, once empty (a custom pin dir elsewhere keeps its parent).
    let root_is_parent = opts
        .pin_dir
        .as_ref()
        .is_none_or(|d| d.parent() == Some(opts.pin_root.as_path()));
    if root_is_parent && std::fs::remove_dir(&opts.pin_root).is_ok() {
        report.pin_dirs.push(opts.pin_root.clone());
    }
}

fn remove_nft(opts: &CleanupOptions, report: &mut CleanupReport) {
    let mut dp = match NftDataplane::new(NftOptions {
        table: opts.nft_table.clone(),
        netns: None,
    }) {
        Ok(dp) => dp,
        Err(e) => {
            report.failures.push(format!("nftables: {e}"));
            return;
        }
    };
    let exists = match dp.list_table() {
        Ok(_) => true,
        Err(NftError::Spawn { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            tracing::info!("no nft binary: no nftables table to remove");
            return;
        }
        // `nft list table` fails for a missing table: the delete below
        // (which tolerates a missing table) tells real failures apart.
        Err(_) => false,
    };
    match dp.remove() {
        Ok(()) => report.nft_table_removed = exists,
        Err(e) => report.failures.push(format!("nftables table {}: {e}", opts.nft_table)),
    }
}

/// The DNS learning's rules, whatever their queue: every `NPM-DNS-<queue>`
/// chain of `mangle` (iptables and ip6tables).
fn remove_dns(report: &mut CleanupReport) {
    let mut queues = std::collections::BTreeSet::new();
    for bin in ["iptables", "ip6tables"] {
        let Ok(out) = std::process::Command::new(bin)
            .args(["-w", "5", "-t", "mangle", "-S"])
            .output()
        else {
            continue;
        };
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let chain = line
                .strip_prefix("-N ")
                .and_then(|c| c.strip_prefix(crate::dns::capture::CHAIN_PREFIX));
            if let Some(q) = chain.and_then(|q| q.trim().parse::<u16>().ok()) {
                queues.insert(q);
            }
        }
    }
    for q in queues {
        crate::dns::capture::remove_rules(q);
        report.dns_queues.push(q);
    }
}

fn remove_cni(opts: &CleanupOptions, report: &mut CleanupReport) {
    let options = npm_cni::install::UninstallOptions {
        bin_dir: opts.cni_bin_dir.clone(),
        conf_dir: opts.cni_conf_dir.clone(),
    };
    match npm_cni::install::uninstall(&options) {
        Ok(r) => {
            report.conflists = r.conflists;
            report.conflists_skipped = r.skipped;
            report.cni_binary_removed = r.binary_removed;
        }
        Err(e) => report.failures.push(format!("npm-cni: {e}")),
    }
}

/// Remove npm from this node (see the module doc).
pub fn cleanup(opts: &CleanupOptions) -> Result<CleanupReport, CleanupError> {
    let mut report = CleanupReport::default();
    remove_ebpf(opts, &mut report);
    report.host_in_chains = npm_dataplane::ebpf::remove_stale_host_in_chains();
    remove_nft(opts, &mut report);
    remove_dns(&mut report);
    remove_cni(opts, &mut report);
    for (path, reason) in &report.conflists_skipped {
        tracing::warn!(conflist = %path.display(), %reason, "conflist left as it is");
    }
    if report.failures.is_empty() {
        Ok(report)
    } else {
        Err(CleanupError {
            failures: report.failures,
        })
    }
}
