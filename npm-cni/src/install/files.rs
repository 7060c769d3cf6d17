//! Atomic file replacement: a temporary file in the target's directory, written and fsynced, then
//! renamed over the target and the directory fsynced. A runtime (or a node crash) sees the old file
//! or the new one, never a part; a running plugin binary is never overwritten in place.

use std::fs::{self, File, OpenOptions, Permissions};
use std::io::{self, Write};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

/// The temporary sibling of `target`. Its name starts with a dot and ends in `.npm-cni-tmp`, so no
/// runtime takes it for a configuration file (those end in `.conf`, `.conflist` or `.json`).
fn temp_path(target: &Path) -> PathBuf {
    let name = target.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    target.with_file_name(format!(".{name}.{}.npm-cni-tmp", std::process::id()))
}

/// Writes `contents` to `target` atomically with permissions `mode`.
pub fn write_atomically(target: &Path, contents: &[u8], mode: u32) -> io::Result<()> {
    let temp = temp_path(target);
    let result = (|| {
        let _ = fs::remove_file(&temp);
        let mut file = OpenOptions::new().write(true).create_new(true).mode(mode).open(&temp)?;
        file.write_all(contents)?;
        // Explicitly: `mode` at creation is filtered by the umask.
        file.set_permissions(Permissions::from_mode(mode))?;
        file.sync_all()?;
        fs::rename(&temp, target)?;
        sync_parent(target)
    })();
    if result.is_err() {
        let _ = fs::remove_file(&temp);
    }
    result
}

/// Replaces `target`, whose content was `expected`, with `contents`, keeping its permissions and
/// owner; `Ok(false)` (and nothing written) if the file no longer holds `expected` (another writer
/// got there first: the caller reads it again). The check happens after the new content is on disk
/// and right before the rename, which leaves the smallest window a rename-based writer allows.
pub fn replace_if_unchanged(target: &Path, expected: &[u8], contents: &[u8]) -> io::Result<bool> {
    let meta = fs::metadata(target)?;
    let temp = temp_path(target);
    let result = (|| {
        let _ = fs::remove_file(&temp);
        let mut file = OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&temp)?;
        file.write_all(contents)?;
        file.set_permissions(Permissions::from_mode(meta.mode() & 0o7777))?;
        // Best effort: an unprivileged installer cannot give a file away.
        let _ = std::os::unix::fs::fchown(&file, Some(meta.uid()), Some(meta.gid()));
        file.sync_all()?;
        if fs::read(target)? != expected {
            return Ok(false);
        }
        fs::rename(&temp, target)?;
        sync_parent(target)?;
        Ok(true)
    })();
    if !matches!(result, Ok(true)) {
        let _ = fs::remove_file(&temp);
    }
    result
}

/// The file `path` names, through any symlinks; `path` itself if that fails (reading it then
/// reports why).
pub fn resolve(path: &Path) -> PathBuf {
    fs::canonicalize(path).unwrap_or_else(|_| path.to_owned())
}

/// Whether `path` is a regular file with exactly `contents`.
pub fn holds(path: &Path, contents: &[u8]) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.len() == contents.len() as u64)
        && fs::read(path).is_ok_and(|c| c == contents)
}

/// Removes `path`; `Ok(false)` if it did not exist.
pub fn remove_if_present(path: &Path) -> io::Result<bool> {
    match fs::remove_file(path) {
        Ok(()) => {
            sync_parent(path)?;
            Ok(true)
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(e),
    }
}

fn sync_parent(path: &Path) -> io::Result<()> {
    match path.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => File::open(dir)?.sync_all(),
        _ => File::open(".")?.sync_all(),
    }
}
