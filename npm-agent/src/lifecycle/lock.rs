//! One agent per pin directory (or nftables table): `npm-agent run` takes
//! an exclusive `flock` on `<lock dir>/agent-<name>.lock` (`--lock-dir`,
//! default `/run/npm`, a host path the chart mounts) before it touches the
//! kernel, and holds it for the life of the process; a second agent on
//! the same pin directory finds it taken and refuses to start. bpffs holds
//! no regular files, hence a lock on a host path rather than in the pin
//! directory. The kernel releases the lock when the process dies, however
//! it dies, so a stale lock file never blocks a restarted agent.

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

/// Default of `--lock-dir`.
pub const DEFAULT_LOCK_DIR: &str = "/run/npm";

/// Errors taking the lock.
#[derive(Debug, thiserror::Error)]
pub enum LockError {
    /// Another agent holds the lock.
    #[error(
        "another npm agent already runs on {what} (lock {} held{}); refusing to start a second one",
        path.display(),
        holder.as_deref().map(|p| format!(" by pid {p}")).unwrap_or_default()
    )]
    Held {
        /// The pin directory (or table) the lock is for.
        what: String,
        /// The lock file.
        path: PathBuf,
        /// The pid the holder wrote into the file, if readable.
        holder: Option<String>,
    },
    /// The lock file could not be created or locked.
    #[error("lock file {}: {op}: {source}", path.display())]
    Io {
        /// The lock file (or its directory).
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The file name of the lock of `key` (a pin directory, or `nft-<table>`):
/// `agent-<key>.lock` with every character other than ASCII letters,
/// digits, `.`, `-` and `_` replaced by `_`, and the leading `/` dropped
/// (`/sys/fs/bpf/npm/v5` -> `agent-sys_fs_bpf_npm_v5.lock`).
pub fn lock_file_name(key: &str) -> String {
    let key = key.trim_start_matches('/').trim_end_matches('/');
    let sanitized: String = key
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("agent-{sanitized}.lock")
}

/// The lock of one pin directory (or table), held while this value lives.
#[derive(Debug)]
pub struct AgentLock {
    path: PathBuf,
    // Closing the file releases the lock.
    _file: File,
}

impl AgentLock {
    /// Take the lock of `key` (described as `what` in errors) in
    /// `lock_dir` (created if missing), without waiting: fails with
    /// [`LockError::Held`] when another process holds it. Writes this
    /// process's pid into the file.
    pub fn acquire(lock_dir: &Path, key: &str, what: &str) -> Result<AgentLock, LockError> {
        let path = lock_dir.join(lock_file_name(key));
        let io = |op: &'static str, path: &Path| {
            let path = path.to_path_buf();
            move |source| LockError::Io { path, op, source }
        };
        std::fs::create_dir_all(lock_dir).map_err(io("create the directory", lock_dir))?;
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .map_err(io("open", &path))?;
        // SAFETY: flock on a file descriptor we own.
        if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EWOULDBLOCK) {
                let mut holder = String::new();
                let _ = file.read_to_string(&mut holder);
                let holder = holder.trim();
                return Err(LockError::Held {
                    what: what.to_string(),
                    path,
                    holder: (!holder.is_empty()).then(|| holder.to_string()),
                });
            }
            return Err(io("flock", &path)(e));
        }
        file.set_len(0).map_err(io("truncate", &path))?;
        file.rewind().map_err(io("rewind", &path))?;
        writeln!(file, "{}", std::process::id()).map_err(io("write the pid", &path))?;
        Ok(AgentLock { path, _file: file })
    }

    /// The lock file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_names_are_sanitized() {
        assert_eq!(lock_file_name("/sys/fs/bpf/npm/v5"), "agent-sys_fs_bpf_npm_v5.lock");
        assert_eq!(lock_file_name("/sys/fs/bpf/npm/v5/"), "agent-sys_fs_bpf_npm_v5.lock");
        assert_eq!(lock_file_name("nft-npm"), "agent-nft-npm.lock");
        assert_eq!(lock_file_name("/a b/../c"), "agent-a_b_.._c.lock");
    }

    #[test]
    fn a_second_lock_on_the_same_key_is_refused_until_the_first_is_dropped() {
        let dir = std::env::temp_dir().join(format!("npm-lock-unit-{}", std::process::id()));
        let first = AgentLock::acquire(&dir, "/sys/fs/bpf/x", "pin dir /sys/fs/bpf/x").unwrap();
        // flock locks belong to the open file description: a second open
        // in the same process conflicts like another process would.
        let err = AgentLock::acquire(&dir, "/sys/fs/bpf/x", "pin dir /sys/fs/bpf/x").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("another npm agent already runs on pin dir /sys/fs/bpf/x"),
            "{msg}"
        );
        assert!(msg.contains(&format!("by pid {}", std::process::id())), "{msg}");
        AgentLock::acquire(&dir, "/sys/fs/bpf/y", "pin dir /sys/fs/bpf/y").expect("another key is free");
        drop(first);
        AgentLock::acquire(&dir, "/sys/fs/bpf/x", "pin dir /sys/fs/bpf/x").expect("free again");
        std::fs::remove_dir_all(&dir).ok();
    }
}
