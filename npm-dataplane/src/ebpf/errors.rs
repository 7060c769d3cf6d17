//! Errors of the eBPF loader ([`EbpfError`]): each variant names what was
//! being done (map, program, interface, pin path) and carries the typed
//! aya or I/O error below it; how they become a [`DataplaneError`]; and
//! the small helpers that attach that context to an aya error.

use std::fmt;
use std::path::PathBuf;

use aya::maps::MapError;
use aya::pin::PinError;
use aya::programs::links::LinkError;
use aya::programs::ProgramError;
use aya::sys::SyscallError;

use super::loader::OBJECT_ENV;
use super::translate::TranslateError;
use crate::DataplaneError;

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
        #[source]
        source: std::io::Error,
    },
    /// bpffs could not be mounted, or a pin directory created, read or
    /// removed.
    #[error("bpffs pin directory {path}: {op}: {source}")]
    PinDir {
        /// The directory (or the pin in it).
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Loading the object (creating or adopting maps) failed.
    #[error("loading eBPF object {path}: {source}")]
    Load {
        /// The object path.
        path: PathBuf,
        /// The aya error.
        #[source]
        source: Box<aya::EbpfError>,
    },
    /// The object lacks a program.
    #[error("eBPF object has no program {program}")]
    ProgramMissing {
        /// The program name.
        program: &'static str,
    },
    /// An iptables command of the `host_in` rules failed.
    #[error("{cmd}: {message}")]
    Rule {
        /// The command.
        cmd: String,
        /// Its error output, or why it could not run.
        message: String,
    },
    /// A program operation failed.
    #[error("program {program}: {op}: {source}")]
    Program {
        /// The program name.
        program: &'static str,
        /// What was being done.
        op: String,
        /// The aya error.
        #[source]
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
        #[source]
        source: Box<MapError>,
    },
    /// An interface index names no interface.
    #[error("interface {ifindex}: no such interface: {source}")]
    Interface {
        /// The ifindex.
        ifindex: u32,
        /// The error of `if_indextoname`.
        #[source]
        source: std::io::Error,
    },
    /// A tcx link could not be adopted, converted or read.
    #[error("tcx link {path}: {op}: {source}")]
    Link {
        /// The link's pin path.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The aya error.
        #[source]
        source: Box<LinkError>,
    },
    /// A tcx link could not be pinned.
    #[error("tcx link {path}: pin: {source}")]
    PinLink {
        /// The link's pin path.
        path: PathBuf,
        /// The aya error.
        #[source]
        source: Box<PinError>,
    },
    /// A tcx link's pin could not be removed.
    #[error("tcx link {path}: unpin: {source}")]
    Unpin {
        /// The link's pin path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A netlink request about tc filters failed (listing interfaces or
    /// dumping filters).
    #[error("tc filters: {op}: {source}")]
    Netlink {
        /// What was being done.
        op: &'static str,
        /// The I/O error.
        #[source]
        source: std::io::Error,
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
    /// A configured map size is out of bounds (`--map-size-*`).
    #[error("map {map}: size {size} out of bounds (at least {min}, at most {max} entries)")]
    MapSize {
        /// Map name.
        map: &'static str,
        /// The configured size.
        size: u32,
        /// The smallest size accepted.
        min: u32,
        /// The largest size accepted.
        max: u32,
    },
    /// A pinned `NPM_FOLD` has not the size the program hashes to.
    #[error("map {map} pinned at {path}: {buckets} buckets, not the size this agent hashes to; remove the pins (`npm-agent cleanup`)")]
    PinnedFrontSize {
        /// Map name.
        map: &'static str,
        /// Its buckets.
        buckets: u32,
        /// The pin.
        path: PathBuf,
    },
    /// A map could not be mapped into memory.
    #[error("map {map}: mmap: {source}")]
    Mmap {
        /// Map name.
        map: &'static str,
        /// The error of `mmap`.
        #[source]
        source: std::io::Error,
    },
    /// The conntrack worker could not do what was asked (a batch
    /// operation failed, a purge did not complete, the thread could not
    /// start).
    #[error("conntrack worker: {source}")]
    Conntrack {
        /// What failed.
        #[source]
        source: std::io::Error,
    },
}

impl EbpfError {
    /// The step of the loader that failed: `ebpf load`, `ebpf pin
    /// directory`, `ebpf program`, `ebpf map`, `ebpf attach` or `ebpf
    /// translate`. (`Rule`, an `INPUT` rule of `host_in`, counts as
    /// attaching.)
    pub fn step(&self) -> &'static str {
        match self {
            EbpfError::ObjectMissing { .. }
            | EbpfError::ReadObject { .. }
            | EbpfError::Load { .. }
            | EbpfError::MapSize { .. }
            | EbpfError::PinnedFrontSize { .. } => "ebpf load",
            EbpfError::PinDir { .. } => "ebpf pin directory",
            EbpfError::ProgramMissing { .. } | EbpfError::Program { .. } => "ebpf program",
            EbpfError::MapMissing { .. }
            | EbpfError::Map { .. }
            | EbpfError::NotPinned { .. }
            | EbpfError::Mmap { .. }
            | EbpfError::Conntrack { .. } => "ebpf map",
            EbpfError::Interface { .. }
            | EbpfError::Link { .. }
            | EbpfError::PinLink { .. }
            | EbpfError::Unpin { .. }
            | EbpfError::Netlink { .. }
            | EbpfError::Rule { .. } => "ebpf attach",
            EbpfError::Translate(_) => "ebpf translate",
        }
    }

    /// The OS error number under this error (the first `io::Error` of its
    /// source chain), if a system call failed.
    pub fn raw_os_error(&self) -> Option<i32> {
        sources(self)
            .find_map(|e| e.downcast_ref::<std::io::Error>())
            .and_then(std::io::Error::raw_os_error)
    }

    /// The map whose update was refused because it is full: `E2BIG` (a
    /// hash at `max_entries`) or `ENOSPC` (an LPM trie) from
    /// `bpf_map_update_elem`.
    pub fn full_map(&self) -> Option<&'static str> {
        match self {
            EbpfError::Map { map, source, .. } => match &**source {
                MapError::SyscallError(SyscallError {
                    call: "bpf_map_update_elem",
                    io_error,
                }) if matches!(io_error.raw_os_error(), Some(libc::E2BIG | libc::ENOSPC)) => Some(*map),
                _ => None,
            },
            _ => None,
        }
    }

    /// Whether the kernel refused for lack of privilege: `EPERM`, or
    /// `EACCES` anywhere but a program load (where `EACCES` is the
    /// verifier rejecting the program).
    pub fn is_permission(&self) -> bool {
        match self.raw_os_error() {
            Some(libc::EPERM) => true,
            Some(libc::EACCES) => !matches!(
                self,
                EbpfError::Program { source, .. } if matches!(**source, ProgramError::LoadError { .. })
            ),
            _ => false,
        }
    }
}

/// The error and its sources, outermost first.
fn sources<'a>(
    e: &'a (dyn std::error::Error + 'static),
) -> impl Iterator<Item = &'a (dyn std::error::Error + 'static)> {
    std::iter::successors(Some(e), |e| e.source())
}

impl From<EbpfError> for DataplaneError {
    /// Sorts the loader's error by what the caller can do about it (see
    /// [`DataplaneError`]); the loader's error stays the source.
    fn from(e: EbpfError) -> Self {
        if let Some(map) = e.full_map() {
            return DataplaneError::MapFull { map, source: e };
        }
        if e.is_permission() {
            return DataplaneError::Permission {
                op: e.step(),
                source: e,
            };
        }
        match e {
            EbpfError::NotPinned { path } => DataplaneError::MissingPin { path },
            EbpfError::Translate(source) => DataplaneError::Translate(source),
            EbpfError::Interface { ifindex, .. } => DataplaneError::NoInterface { ifindex, source: e },
            EbpfError::ObjectMissing { .. }
            | EbpfError::ReadObject { .. }
            | EbpfError::ProgramMissing { .. }
            | EbpfError::MapMissing { .. }
            | EbpfError::MapSize { .. } => DataplaneError::Object { source: e },
            e => DataplaneError::KernelRefused {
                op: e.step(),
                source: e,
            },
        }
    }
}

/// Wraps an aya error of `op` in the [`EbpfError`] variant `make` builds.
fn with_op<E>(op: impl fmt::Display, make: impl FnOnce(String, Box<E>) -> EbpfError) -> impl FnOnce(E) -> EbpfError {
    let op = op.to_string();
    move |source| make(op, Box::new(source))
}

/// An [`EbpfError::Map`] of `op` on map `map`, for `map_err`.
pub(crate) fn map_err(map: &'static str, op: impl fmt::Display) -> impl FnOnce(MapError) -> EbpfError {
    with_op(op, move |op, source| EbpfError::Map { map, op, source })
}

/// An [`EbpfError::Program`] of `op` on program `program`, for `map_err`.
pub(crate) fn prog_err(program: &'static str, op: impl fmt::Display) -> impl FnOnce(ProgramError) -> EbpfError {
    with_op(op, move |op, source| EbpfError::Program { program, op, source })
}

/// An [`EbpfError::Link`] of `op` on the link pinned at `path`, for `map_err`.
pub(crate) fn link_err(path: &std::path::Path, op: &'static str) -> impl FnOnce(LinkError) -> EbpfError {
    let path = path.to_path_buf();
    move |source| EbpfError::Link {
        path,
        op,
        source: Box::new(source),
    }
}

/// True when a map error says the key was not there.
pub(crate) fn is_not_found(e: &MapError) -> bool {
    match e {
        MapError::KeyNotFound => true,
        MapError::SyscallError(s) => s.io_error.raw_os_error() == Some(libc::ENOENT),
        _ => false,
    }
}

/// The result of removing `what` from map `map`: removing an absent key is
/// no error.
pub(crate) fn removed(
    result: Result<(), MapError>,
    map: &'static str,
    what: impl fmt::Display,
) -> Result<(), EbpfError> {
    match result {
        Ok(()) => Ok(()),
        Err(e) if is_not_found(&e) => Ok(()),
        Err(e) => Err(map_err(map, format!("remove {what}"))(e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map_syscall(call: &'static str, errno: i32) -> EbpfError {
        map_err("NPM_CT", "insert k")(MapError::SyscallError(SyscallError {
            call,
            io_error: std::io::Error::from_raw_os_error(errno),
        }))
    }

    #[test]
    fn a_full_map_is_told_apart_from_a_missing_capability() {
        for errno in [libc::E2BIG, libc::ENOSPC] {
            let e = DataplaneError::from(map_syscall("bpf_map_update_elem", errno));
            assert!(e.is_map_full(), "{e}");
            assert!(matches!(e, DataplaneError::MapFull { map: "NPM_CT", .. }));
        }
        // E2BIG on another call is no full map.
        let e = DataplaneError::from(map_syscall("bpf_map_lookup_elem", libc::E2BIG));
        assert!(matches!(e, DataplaneError::KernelRefused { op: "ebpf map", .. }), "{e}");
        for errno in [libc::EPERM, libc::EACCES] {
            let e = DataplaneError::from(map_syscall("bpf_map_update_elem", errno));
            assert!(e.is_permission() && !e.is_map_full(), "{e}");
        }
        let e = DataplaneError::from(EbpfError::PinDir {
            path: "/sys/fs/bpf".into(),
            op: "mount bpffs",
            source: std::io::Error::from_raw_os_error(libc::EPERM),
        });
        assert!(
            matches!(
                e,
                DataplaneError::Permission {
                    op: "ebpf pin directory",
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn the_source_chain_keeps_the_os_error() {
        let e = map_syscall("bpf_map_update_elem", libc::E2BIG);
        assert_eq!(e.raw_os_error(), Some(libc::E2BIG));
        let d = DataplaneError::from(e);
        let chain: Vec<String> = std::iter::successors(Some(&d as &dyn std::error::Error), |e| e.source())
            .map(|e| e.to_string())
            .collect();
        assert!(chain.len() >= 3, "{chain:?}");
        assert!(chain[1].starts_with("map NPM_CT: insert k"), "{chain:?}");
    }

    #[test]
    fn other_errors_keep_their_context() {
        let path = PathBuf::from("/sys/fs/bpf/x/NPM_CT");
        let e = DataplaneError::from(EbpfError::NotPinned { path: path.clone() });
        assert!(e.is_missing_pin());
        assert!(matches!(e, DataplaneError::MissingPin { path: p } if p == path));
        let e = DataplaneError::from(EbpfError::Interface {
            ifindex: 7,
            source: std::io::Error::from_raw_os_error(libc::ENXIO),
        });
        assert!(matches!(e, DataplaneError::NoInterface { ifindex: 7, .. }), "{e}");
        let e = DataplaneError::from(EbpfError::MapMissing { map: "NPM_CT" });
        assert!(matches!(e, DataplaneError::Object { .. }), "{e}");
        let e = DataplaneError::from(EbpfError::Translate(TranslateError::BadPrefix { prefix_len: 200 }));
        assert!(matches!(e, DataplaneError::Translate(_)), "{e}");
    }
}
