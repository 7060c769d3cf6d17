//! What CNI STATUS means (CNI 1.1.0; containerd 2.x and CRI-O call it every
//! few seconds and set the node's `NetworkReady` from it): **the agent
//! answers, and a full sync has been applied on this node since it booted**,
//! by this agent or by an earlier one.
//!
//! The second half is kept in a marker file next to the socket
//! ([`MARKER_FILE_NAME`]) holding the kernel's boot id
//! (`/proc/sys/kernel/random/boot_id`), written once the agent's first full
//! sync is applied. The kernel state a sync programs (pinned maps and
//! programs, or the nftables table) outlives the agent process but not a
//! reboot, so:
//!
//! - an agent restart (rollout, crash, OOM) does not flip `NetworkReady`:
//!   the restarted agent answers "ok" at once, before its own first sync,
//!   since what was programmed stays enforced and every ADD still waits for
//!   its pod to be programmed;
//! - an agent that cannot list (API outage, RBAC) after a restart does not
//!   keep the node NotReady (and its pods evicted): it answers "ok" too, and
//!   its readiness (`/readyz`) says what is wrong;
//! - after a reboot nothing is programmed until a first full sync: STATUS
//!   fails (code 50) until then, as it should (the marker of the previous
//!   boot names another boot id, whatever filesystem holds it);
//! - an agent that does not answer fails STATUS (npm-cni's code 50).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};

/// Name of the marker file, next to the socket.
pub const MARKER_FILE_NAME: &str = "synced-boot-id";

/// Where the kernel tells the id of the current boot.
pub const BOOT_ID_PATH: &str = "/proc/sys/kernel/random/boot_id";

/// Errors writing the marker.
#[derive(Debug, thiserror::Error)]
pub enum MarkerError {
    /// The boot id is unknown, so no marker can be trusted.
    #[error("the boot id ({BOOT_ID_PATH}) is unreadable: no sync marker is written")]
    NoBootId,
    /// Writing or renaming failed.
    #[error("sync marker {path}: {source}")]
    Io {
        /// The marker file.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// The marker of "a full sync was applied on this node since it booted".
#[derive(Debug)]
pub struct SyncMarker {
    path: PathBuf,
    boot_id: Option<String>,
    written: AtomicBool,
    /// A failure to write it was logged (once).
    warned: AtomicBool,
}

/// The boot id of the running kernel, if readable.
pub fn current_boot_id() -> Option<String> {
    std::fs::read_to_string(BOOT_ID_PATH)
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

impl SyncMarker {
    /// The marker next to the socket `socket`, for the running boot.
    pub fn for_socket(socket: &Path) -> SyncMarker {
        let path = socket.parent().unwrap_or(Path::new(".")).join(MARKER_FILE_NAME);
        SyncMarker::at(path, current_boot_id())
    }

    /// The marker at `path` for boot `boot_id` (`None`: unknown, nothing
    /// is ever trusted or written).
    pub fn at(path: PathBuf, boot_id: Option<String>) -> SyncMarker {
        SyncMarker {
            path,
            boot_id,
            written: AtomicBool::new(false),
            warned: AtomicBool::new(false),
        }
    }

    /// The marker file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether a full sync was applied since this boot (by any agent): the
    /// file names the running boot.
    pub fn synced_this_boot(&self) -> bool {
        if self.written.load(Ordering::Acquire) {
            return true;
        }
        let Some(boot) = &self.boot_id else {
            return false;
        };
        std::fs::read_to_string(&self.path).is_ok_and(|s| s.trim() == boot)
    }

    /// Record that a full sync was applied (atomically: temporary file,
    /// fsync, rename); written once per agent.
    pub fn record(&self) -> Result<(), MarkerError> {
        if self.written.load(Ordering::Acquire) {
            return Ok(());
        }
        let boot = self.boot_id.as_ref().ok_or(MarkerError::NoBootId)?;
        let io = |source| MarkerError::Io {
            path: self.path.clone(),
            source,
        };
        let tmp = self.path.with_extension("tmp");
        let mut f = std::fs::File::create(&tmp).map_err(io)?;
        f.write_all(format!("{boot}\n").as_bytes()).map_err(io)?;
        f.sync_all().map_err(io)?;
        std::fs::rename(&tmp, &self.path).map_err(io)?;
        self.written.store(true, Ordering::Release);
        Ok(())
    }
}

/// The answer to STATUS: `Ok` when a full sync is applied by this agent
/// (`synced_now`; the marker is then written) or was since this boot (the
/// marker), else why not.
pub fn answer(synced_now: bool, marker: &SyncMarker) -> Result<(), String> {
    if synced_now {
        if let Err(e) = marker.record() {
            if !marker.warned.swap(true, Ordering::AcqRel) {
                tracing::warn!(error = %e, "CNI STATUS: the sync marker is not written; a restarted agent answers STATUS only after its own first sync");
            }
        }
        return Ok(());
    }
    if marker.synced_this_boot() {
        return Ok(());
    }
    Err(
        "no full sync has been applied on this node since it booted (the agent is listing the API or compiling; \
         see /readyz)"
            .to_string(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("npm-status-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_sync_of_this_boot_survives_the_agent_another_boots_does_not() {
        let d = dir("boot");
        let path = d.join(MARKER_FILE_NAME);
        let first = SyncMarker::at(path.clone(), Some("boot-1".into()));
        assert!(answer(false, &first).is_err(), "nothing synced yet");
        assert!(answer(true, &first).is_ok());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "boot-1\n");
        // A restarted agent, before (or without) its own first sync.
        let restarted = SyncMarker::at(path.clone(), Some("boot-1".into()));
        assert!(answer(false, &restarted).is_ok());
        // After a reboot the file (if it survived) names another boot.
        let rebooted = SyncMarker::at(path.clone(), Some("boot-2".into()));
        assert!(answer(false, &rebooted).is_err());
        // An unknown boot id trusts nothing and writes nothing.
        let unknown = SyncMarker::at(d.join("other"), None);
        assert!(answer(true, &unknown).is_ok(), "this agent's own sync counts");
        assert!(!d.join("other").exists());
        assert!(answer(false, &SyncMarker::at(d.join("other"), None)).is_err());
        assert!(current_boot_id().is_some(), "the kernel names its boot");
        let _ = std::fs::remove_dir_all(&d);
    }
}
