//! Installing npm-cni on a node and removing it: the binary in the CNI plugin directory and its
//! entry in the conflist the runtime uses (what `npm-cni install` and `npm-cni uninstall` run, and
//! what `npm-agent cleanup` can call).
//!
//! Install first finds and checks the conflist (so that a refusal changes nothing), then copies
//! the binary, then chains the entry: a pod never meets an entry whose binary is missing. Uninstall
//! removes the entries first and the binary last, for the same reason.

mod conflist;
mod files;
mod json_text;

use std::fmt;
use std::fs;
use std::io;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use thiserror::Error;

pub use conflist::{config_files, is_conflist, Entry, CONFIG_EXTENSIONS, PLUGIN_TYPE};
use conflist::{Conflist, Problem};

use crate::version;

/// Where the installer copies itself from by default: the running executable.
pub const SELF_EXE: &str = "/proc/self/exe";

/// How often the installer looks for a conflist while it waits for one.
const POLL_INTERVAL: Duration = Duration::from_millis(250);

/// How many times a conflist rewritten under the installer's feet is read again.
const REWRITE_ATTEMPTS: usize = 5;

/// What `install` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallOptions {
    /// The host's CNI plugin directory (`/opt/cni/bin`).
    pub bin_dir: PathBuf,
    /// The host's CNI configuration directory (`/etc/cni/net.d`).
    pub conf_dir: PathBuf,
    /// The binary to copy; [`SELF_EXE`] if `None`.
    pub source: Option<PathBuf>,
    /// The values of the conflist entry.
    pub entry: Entry,
    /// How long to wait for the primary CNI to write a conflist (zero: fail at once).
    pub wait: Duration,
}

/// What `uninstall` does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UninstallOptions {
    /// The host's CNI plugin directory.
    pub bin_dir: PathBuf,
    /// The host's CNI configuration directory.
    pub conf_dir: PathBuf,
}

/// What happened to a file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// It already held what was wanted; not rewritten.
    Unchanged,
    /// It did not exist and was written.
    Created,
    /// It was rewritten.
    Updated,
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Change::Unchanged => "unchanged",
            Change::Created => "created",
            Change::Updated => "updated",
        })
    }
}

/// The outcome of `install`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstallReport {
    /// `bin_dir/npm-cni`.
    pub binary: PathBuf,
    /// What happened to it.
    pub binary_change: Change,
    /// The conflist that holds the entry.
    pub conflist: PathBuf,
    /// What happened to it (`Created` is not used: the conflist is the primary CNI's).
    pub conflist_change: Change,
}

/// The outcome of `uninstall`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UninstallReport {
    /// The conflists an entry was removed from.
    pub conflists: Vec<PathBuf>,
    /// Conflists left as they were because they could not be read or parsed, with the reason.
    pub skipped: Vec<(PathBuf, String)>,
    /// Whether `bin_dir/npm-cni` was removed (false: it was not there).
    pub binary_removed: bool,
}

/// Why `install` or `uninstall` failed. Nothing was changed unless the variant says so.
#[derive(Debug, Error)]
pub enum InstallError {
    /// The configuration directory does not exist.
    #[error("CNI configuration directory {} does not exist{}", dir.display(), waited_for(*waited))]
    ConfDirMissing {
        /// The directory.
        dir: PathBuf,
        /// How long the installer waited for it.
        waited: Duration,
    },
    /// The configuration directory holds no configuration file.
    #[error(
        "no CNI configuration (*.conflist) in {}{}: npm-cni is chained into the conflist of the \
         node's primary CNI, which writes it when it starts; pass --wait-seconds to wait for it",
        dir.display(), waited_for(*waited)
    )]
    NoConflist {
        /// The directory.
        dir: PathBuf,
        /// How long the installer waited for one.
        waited: Duration,
    },
    /// The file the runtime uses is a single plugin's configuration.
    #[error(
        "{} is a single-plugin CNI configuration and, first by name in its directory, the one the \
         runtime uses: npm-cni can only be chained in a conflist (a .conflist file with a \"plugins\" \
         list); configure the primary CNI to write a conflist{}",
        path.display(),
        shadowed.as_ref().map(|s| format!(" (it shadows {})", s.display())).unwrap_or_default()
    )]
    SinglePluginConfig {
        /// The file.
        path: PathBuf,
        /// The first conflist after it, which the runtime does not read.
        shadowed: Option<PathBuf>,
    },
    /// The conflist cannot be parsed or is not a usable conflist.
    #[error("{}: not a usable CNI conflist: {reason}", path.display())]
    Malformed {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The conflist's `cniVersion` is one npm-cni does not speak: every pod's ADD would fail.
    #[error(
        "{}: cniVersion {version:?} is not supported by npm-cni (it supports {}); chaining it would \
         make every pod's ADD fail",
        path.display(), version::SUPPORTED_VERSIONS.join(", ")
    )]
    UnsupportedVersion {
        /// The file.
        path: PathBuf,
        /// Its `cniVersion` (empty if it has none).
        version: String,
    },
    /// The conflist kept changing while the installer rewrote it.
    #[error("{} changed {REWRITE_ATTEMPTS} times while npm-cni rewrote it; try again", path.display())]
    KeptChanging {
        /// The file.
        path: PathBuf,
    },
    /// A file operation failed.
    #[error("{action} {}: {source}", path.display())]
    Io {
        /// What was being done ("read", "write", ...).
        action: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The error.
        source: io::Error,
    },
}

impl InstallError {
    fn io<'a>(action: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> Self + 'a {
        move |source| InstallError::Io {
            action,
            path: path.to_owned(),
            source,
        }
    }

    /// Whether waiting longer may help: the primary CNI may not have written its conflist yet (or
    /// not completely).
    fn may_pass(&self) -> bool {
        matches!(
            self,
            InstallError::ConfDirMissing { .. } | InstallError::NoConflist { .. } | InstallError::Malformed { .. }
        )
    }

    fn after_waiting(mut self, waited_for: Duration) -> Self {
        if let InstallError::ConfDirMissing { waited, .. } | InstallError::NoConflist { waited, .. } = &mut self {
            *waited = waited_for;
        }
        self
    }
}

fn waited_for(waited: Duration) -> String {
    if waited.is_zero() {
        String::new()
    } else {
        format!(" (waited {}s)", waited.as_secs())
    }
}

/// Copies the binary into `bin_dir` and chains npm-cni's entry into the conflist the runtime uses.
pub fn install(options: &InstallOptions) -> Result<InstallReport, InstallError> {
    let started = Instant::now();
    let (path, text, list) = loop {
        match find_conflist(&options.conf_dir) {
            Ok(found) => break found,
            Err(e) if e.may_pass() && started.elapsed() < options.wait => {
                std::thread::sleep(POLL_INTERVAL.min(options.wait.saturating_sub(started.elapsed())));
            }
            Err(e) => return Err(e.after_waiting(options.wait)),
        }
    };

    let source = options.source.as_deref().unwrap_or(Path::new(SELF_EXE));
    let binary_bytes = fs::read(source).map_err(InstallError::io("read", source))?;
    let binary = options.bin_dir.join(PLUGIN_TYPE);
    let binary_change = if files::holds(&binary, &binary_bytes) {
        Change::Unchanged
    } else {
        let existed = binary.exists();
        files::write_atomically(&binary, &binary_bytes, 0o755).map_err(InstallError::io("write", &binary))?;
        if existed {
            Change::Updated
        } else {
            Change::Created
        }
    };

    let conflist_change = chain_into(&path, text, list, &options.entry)?;
    Ok(InstallReport {
        binary,
        binary_change,
        conflist: path,
        conflist_change,
    })
}

/// Whether the conflist the runtime uses holds npm-cni's entry with exactly the values of `entry`
/// (what [`install`] would leave unchanged): `Ok((path, true))` if it does, `Ok((path, false))` if
/// that conflist is usable but lacks the entry (or holds other values), an error as [`install`]
/// reports it when there is no usable conflist. Reads the directory and one file; changes nothing.
pub fn chained(conf_dir: &Path, entry: &Entry) -> Result<(PathBuf, bool), InstallError> {
    let (path, text, list) = find_conflist(conf_dir)?;
    let holds = list.with_entry(entry) == text;
    Ok((path, holds))
}

/// Chains `entry` into `path` (read as `text`, parsed as `list`), reading the file again when it
/// was rewritten in between; the rewrite is a temporary file renamed over it.
fn chain_into(path: &Path, mut text: String, mut list: Conflist, entry: &Entry) -> Result<Change, InstallError> {
    for _ in 0..REWRITE_ATTEMPTS {
        let new_text = list.with_entry(entry);
        if new_text == text {
            return Ok(Change::Unchanged);
        }
        if files::replace_if_unchanged(path, text.as_bytes(), new_text.as_bytes())
            .map_err(InstallError::io("rewrite", path))?
        {
            return Ok(Change::Updated);
        }
        text = fs::read_to_string(path).map_err(InstallError::io("read", path))?;
        list = usable_conflist(path, text.clone())?;
    }
    Err(InstallError::KeptChanging { path: path.to_owned() })
}

/// Removes npm-cni's entry from every conflist of `conf_dir` that has one, then the binary.
/// Succeeds when nothing is installed, and when either directory is missing.
pub fn uninstall(options: &UninstallOptions) -> Result<UninstallReport, InstallError> {
    let mut report = UninstallReport::default();
    let conf_files = match config_files(&options.conf_dir) {
        Ok(files) => files,
        Err(e) if e.kind() == io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(InstallError::io("list", &options.conf_dir)(e)),
    };
    for path in conf_files.into_iter().filter(|p| is_conflist(p)) {
        match remove_entry(&files::resolve(&path))? {
            Removal::Removed => report.conflists.push(path),
            Removal::Absent => {}
            Removal::Skipped(reason) => report.skipped.push((path, reason)),
        }
    }
    let binary = options.bin_dir.join(PLUGIN_TYPE);
    report.binary_removed = files::remove_if_present(&binary).map_err(InstallError::io("remove", &binary))?;
    Ok(report)
}

/// What [`remove_entry`] did to one conflist.
enum Removal {
    Removed,
    Absent,
    Skipped(String),
}

fn remove_entry(path: &Path) -> Result<Removal, InstallError> {
    for _ in 0..REWRITE_ATTEMPTS {
        let text = match fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) => return Ok(Removal::Skipped(format!("read: {e}"))),
        };
        let list = match Conflist::parse(text.clone()) {
            Ok(list) => list,
            Err(Problem::Malformed(reason)) => return Ok(Removal::Skipped(reason)),
            Err(Problem::SinglePlugin) => return Ok(Removal::Skipped("it has no \"plugins\" list".into())),
        };
        if !list.has_entry() {
            return Ok(Removal::Absent);
        }
        let new_text = list.without_entry();
        if files::replace_if_unchanged(path, text.as_bytes(), new_text.as_bytes())
            .map_err(InstallError::io("rewrite", path))?
        {
            return Ok(Removal::Removed);
        }
    }
    Err(InstallError::KeptChanging { path: path.to_owned() })
}

/// The file the runtime uses, if it is a conflist npm-cni can be chained into (the file itself if
/// it is reached through a symlink).
fn find_conflist(dir: &Path) -> Result<(PathBuf, String, Conflist), InstallError> {
    let files = config_files(dir).map_err(|e| match e.kind() {
        io::ErrorKind::NotFound => InstallError::ConfDirMissing {
            dir: dir.to_owned(),
            waited: Duration::ZERO,
        },
        _ => InstallError::io("list", dir)(e),
    })?;
    let Some(first) = files.first() else {
        return Err(InstallError::NoConflist {
            dir: dir.to_owned(),
            waited: Duration::ZERO,
        });
    };
    if !is_conflist(first) {
        return Err(InstallError::SinglePluginConfig {
            path: first.clone(),
            shadowed: files.iter().find(|p| is_conflist(p)).cloned(),
        });
    }
    // A symlinked conflist stays a link: its target is rewritten.
    let path = files::resolve(first);
    let text = fs::read_to_string(&path).map_err(InstallError::io("read", &path))?;
    let list = usable_conflist(&path, text.clone())?;
    Ok((path, text, list))
}

fn usable_conflist(path: &Path, text: String) -> Result<Conflist, InstallError> {
    let list = Conflist::parse(text).map_err(|problem| match problem {
        Problem::Malformed(reason) => InstallError::Malformed {
            path: path.to_owned(),
            reason,
        },
        Problem::SinglePlugin => InstallError::Malformed {
            path: path.to_owned(),
            reason: "it is a single plugin's configuration, with no \"plugins\" list".into(),
        },
    })?;
    let cni_version = list.cni_version().unwrap_or_default();
    if !version::is_supported(cni_version) {
        return Err(InstallError::UnsupportedVersion {
            path: path.to_owned(),
            version: cni_version.to_owned(),
        });
    }
    if !list.has_primary() {
        return Err(InstallError::Malformed {
            path: path.to_owned(),
            reason: "it lists no plugin besides npm-cni, which must follow the plugin that creates the pod's interface"
                .into(),
        });
    }
    Ok(list)
}
