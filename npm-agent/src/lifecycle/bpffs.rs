//! `npm-agent mount-bpffs --path=DIR`: mounts a bpf filesystem at `DIR`
//! (creating the directory) unless one is mounted there already, as read
//! from `/proc/self/mountinfo`; running it again changes nothing. The
//! chart's privileged init container runs it on the host's `/sys/fs/bpf`
//! (Bidirectional propagation), so every agent finds its pins on the
//! host's bpffs.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};

/// Errors of `mount-bpffs`.
#[derive(Debug, thiserror::Error)]
pub enum BpffsError {
    /// The mount point could not be created or resolved.
    #[error("mount point {path}: {op}: {source}")]
    MountPoint {
        /// The directory.
        path: PathBuf,
        /// What was being done.
        op: &'static str,
        /// The error.
        #[source]
        source: std::io::Error,
    },
    /// `/proc/self/mountinfo` could not be read.
    #[error("reading /proc/self/mountinfo: {0}")]
    MountInfo(#[source] std::io::Error),
    /// `mount(2)` failed.
    #[error("mounting bpffs at {path}: {source} (needs CAP_SYS_ADMIN: a privileged container)")]
    Mount {
        /// The mount point.
        path: PathBuf,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}

/// What `mount-bpffs` did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MountOutcome {
    /// A bpf filesystem was mounted there already: nothing was done.
    AlreadyMounted,
    /// bpffs was mounted.
    Mounted,
}

/// Undo the octal escapes of a mountinfo path field (`\040` for a space,
/// `\011`, `\012`, `\134`).
fn unescape(field: &str) -> Vec<u8> {
    let b = field.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            let digit = |c: u8| u32::from(c - b'0');
            let v = digit(b[i + 1]) * 64 + digit(b[i + 2]) * 8 + digit(b[i + 3]);
            out.push(v as u8);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    out
}

/// The filesystem type of the topmost mount at `mount_point` in the
/// mountinfo text `mountinfo` (later lines are mounted over earlier ones),
/// if anything is mounted there.
pub fn fs_type_at(mountinfo: &str, mount_point: &Path) -> Option<String> {
    let want = mount_point.as_os_str().as_bytes();
    mountinfo
        .lines()
        .filter_map(|line| {
            // id parent major:minor root mount-point options [optional...] - fstype source super
            let mut fields = line.split(' ');
            let point = fields.nth(4)?;
            let (_, after) = line.split_once(" - ")?;
            let fstype = after.split(' ').next()?;
            (unescape(point) == want).then(|| fstype.to_string())
        })
        .next_back()
}

/// Mount bpffs at `path` unless a bpf filesystem is mounted there already
/// (idempotent). Creates the directory.
pub fn mount_bpffs(path: &Path) -> Result<MountOutcome, BpffsError> {
    let err = |op: &'static str| {
        move |source| BpffsError::MountPoint {
            path: path.to_path_buf(),
            op,
            source,
        }
    };
    std::fs::create_dir_all(path).map_err(err("create"))?;
    let point = std::fs::canonicalize(path).map_err(err("resolve"))?;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").map_err(BpffsError::MountInfo)?;
    if fs_type_at(&mountinfo, &point).as_deref() == Some("bpf") {
        return Ok(MountOutcome::AlreadyMounted);
    }
    let target = CString::new(point.as_os_str().as_bytes()).map_err(|e| err("encode")(e.into()))?;
    let fstype = c"bpf";
    // SAFETY: valid NUL-terminated strings; no data argument.
    let rc = unsafe { libc::mount(fstype.as_ptr(), target.as_ptr(), fstype.as_ptr(), 0, std::ptr::null()) };
    if rc != 0 {
        return Err(BpffsError::Mount {
            path: point,
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(MountOutcome::Mounted)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
30 22 0:26 / /sys/fs/bpf rw,nosuid,nodev,noexec,relatime shared:9 - bpf bpf rw,mode=700
41 22 0:40 / /tmp/a\\040b rw,relatime - tmpfs tmpfs rw
42 41 0:41 / /tmp/a\\040b rw,relatime - bpf bpf rw
43 22 0:42 / /tmp/c rw,relatime - bpf bpf rw
44 43 0:43 / /tmp/c rw,relatime - tmpfs tmpfs rw
";

    #[test]
    fn the_topmost_mount_decides() {
        assert_eq!(fs_type_at(MOUNTINFO, Path::new("/sys/fs/bpf")).as_deref(), Some("bpf"));
        assert_eq!(fs_type_at(MOUNTINFO, Path::new("/tmp/a b")).as_deref(), Some("bpf"));
        assert_eq!(
            fs_type_at(MOUNTINFO, Path::new("/tmp/c")).as_deref(),
            Some("tmpfs"),
            "a tmpfs over the bpffs hides it"
        );
        assert_eq!(fs_type_at(MOUNTINFO, Path::new("/sys/fs")), None);
    }
}
