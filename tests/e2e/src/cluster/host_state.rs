//! Host-wide state shared by the clusters of every process: the exclusive
//! cluster lock (`/run/npm-e2e/cluster.lock`) and the sysctls of the root
//! netns the clusters need, forwarding and the host-network pods' ports
//! reserved out of the ephemeral range (values found before the first
//! cluster, restored after the last one of any process).

use super::pid_alive;
use crate::netns::{sysctl_get, sysctl_set, NetnsError};

/// Where clusters of every process record the sysctl values found before
/// the first of them turned forwarding on, and who is using them.
const STATE_DIR: &str = "/run/npm-e2e";
const FORWARDING_KEYS: [&str; 3] = [
    "net.ipv4.ip_forward",
    "net.ipv6.conf.all.forwarding",
    "net.ipv4.ip_local_reserved_ports",
];

/// The value a cluster needs for `key`, given the value found (`orig`).
fn wanted(key: &str, orig: &str) -> String {
    if key != "net.ipv4.ip_local_reserved_ports" {
        return "1".into();
    }
    let range = super::host_network_port_range();
    match orig.trim() {
        "" => range,
        o => format!("{o},{range}"),
    }
}

fn state_io(what: &str, source: std::io::Error) -> NetnsError {
    NetnsError::Sysctl {
        key: format!("{STATE_DIR}/{what}"),
        source,
    }
}

/// Runs `f` holding an exclusive flock on the state directory's lock file.
fn with_state_lock<T>(f: impl FnOnce() -> Result<T, NetnsError>) -> Result<T, NetnsError> {
    std::fs::create_dir_all(STATE_DIR).map_err(|e| state_io("", e))?;
    let lock = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(format!("{STATE_DIR}/lock"))
        .map_err(|e| state_io("lock", e))?;
    use std::os::fd::AsRawFd;
    // SAFETY: flock on an open fd; released when `lock` is closed.
    unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    let r = f();
    drop(lock);
    r
}

/// This process's hold on the host-wide cluster lock: (clusters alive, the
/// locked file).
static CLUSTER_LOCK: std::sync::Mutex<(usize, Option<std::fs::File>)> = std::sync::Mutex::new((0, None));

pub(super) fn cluster_lock_acquire() -> Result<(), NetnsError> {
    use std::os::fd::AsRawFd;
    let mut g = CLUSTER_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    if g.0 == 0 {
        std::fs::create_dir_all(STATE_DIR).map_err(|e| state_io("", e))?;
        let path = format!("{STATE_DIR}/cluster.lock");
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(|e| state_io("cluster.lock", e))?;
        // SAFETY: flock on an open fd.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } != 0 {
            let holder = std::fs::read_to_string(&path).unwrap_or_default();
            eprintln!(
                "npm-e2e: waiting for another netns cluster to finish (pid {}; they share the pod addresses)",
                holder.trim()
            );
            // SAFETY: as above, blocking.
            if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
                return Err(state_io("cluster.lock", std::io::Error::last_os_error()));
            }
        }
        let _ = std::fs::write(&path, std::process::id().to_string());
        g.1 = Some(f);
    }
    g.0 += 1;
    Ok(())
}

pub(super) fn cluster_lock_release() {
    let mut g = CLUSTER_LOCK.lock().unwrap_or_else(|e| e.into_inner());
    g.0 = g.0.saturating_sub(1);
    if g.0 == 0 {
        g.1 = None; // closing the file releases the flock
    }
}

/// Registers `owner` as a user of forwarding; the first user (no `.orig`
/// file yet) records the current values. Then forwarding is turned on and
/// the host-network ports reserved.
pub(super) fn forwarding_acquire(owner: &str) -> Result<(), NetnsError> {
    with_state_lock(|| {
        for key in FORWARDING_KEYS {
            let orig = format!("{STATE_DIR}/{key}.orig");
            if !std::path::Path::new(&orig).exists() {
                let cur = sysctl_get(key)?;
                std::fs::write(&orig, cur).map_err(|e| state_io(key, e))?;
            }
            let found = std::fs::read_to_string(&orig).map_err(|e| state_io(key, e))?;
            sysctl_set(key, &wanted(key, &found))?;
        }
        std::fs::write(format!("{STATE_DIR}/owner-{owner}"), "").map_err(|e| state_io("owner", e))
    })
}

/// Unregisters `owner`; when no live owner is left (in any process), the
/// recorded values are restored, so concurrent runs do not switch
/// forwarding off under each other.
pub(super) fn forwarding_release(owner: &str) -> Result<(), NetnsError> {
    with_state_lock(|| {
        let _ = std::fs::remove_file(format!("{STATE_DIR}/owner-{owner}"));
        let mut live = 0;
        for e in std::fs::read_dir(STATE_DIR).map_err(|e| state_io("", e))?.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(rest) = name.strip_prefix("owner-") else {
                continue;
            };
            let pid: u32 = rest.split('-').next().and_then(|p| p.parse().ok()).unwrap_or(0);
            if pid != 0 && pid_alive(pid) {
                live += 1;
            } else {
                let _ = std::fs::remove_file(e.path());
            }
        }
        if live > 0 {
            return Ok(());
        }
        for key in FORWARDING_KEYS {
            let orig = format!("{STATE_DIR}/{key}.orig");
            if let Ok(v) = std::fs::read_to_string(&orig) {
                // With a newline: an empty value (no reserved port) is then
                // written, not skipped.
                sysctl_set(key, &format!("{}\n", v.trim()))?;
                let _ = std::fs::remove_file(&orig);
            }
        }
        Ok(())
    })
}
