//! `npm-agent mount-bpffs --path=DIR` on a fresh mount point: a tmpfs the
//! test mounts, with `DIR` a directory inside it that does not exist yet.
//! The first run creates `DIR` and mounts bpffs there; the second finds it
//! mounted and mounts nothing more (one bpf mount at `DIR` in
//! `/proc/self/mountinfo`). A bpffs hidden under a tmpfs mounted over it
//! does not count: the topmost mount decides. Needs root.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use npm_testkit::netns::sh;

/// The tmpfs mount point; unmounted (with everything on it) and removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        for _ in 0..4 {
            let _ = Command::new("umount").arg("-l").arg(&self.0).output();
        }
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The filesystem types mounted at `path`, bottom first.
fn mounts_at(path: &Path) -> Vec<String> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").unwrap();
    info.lines()
        .filter(|l| l.split(' ').nth(4) == Some(path.to_str().unwrap()))
        .filter_map(|l| Some(l.split_once(" - ")?.1.split(' ').next()?.to_string()))
        .collect()
}

fn is_bpffs(path: &Path) -> bool {
    let c = CString::new(path.as_os_str().as_bytes()).unwrap();
    // SAFETY: statfs writes into the zeroed struct we own.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: valid C string and struct pointer.
    assert_eq!(unsafe { libc::statfs(c.as_ptr(), &mut st) }, 0);
    #[allow(clippy::unnecessary_cast)]
    let magic = st.f_type as i64;
    magic == 0xcafe_4a11
}

fn mount_bpffs(path: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_npm-agent"))
        .arg("mount-bpffs")
        .arg(format!("--path={}", path.display()))
        .output()
        .expect("run npm-agent mount-bpffs");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "mount-bpffs failed: {err}");
    err
}

#[test]
fn mount_bpffs_mounts_once_on_a_fresh_mount_point() {
    let scratch = Scratch(std::env::temp_dir().join(format!("npmbf{}", std::process::id())));
    std::fs::create_dir_all(&scratch.0).unwrap();
    sh(&["mount", "-t", "tmpfs", "tmpfs", scratch.0.to_str().unwrap()]);
    let dir = scratch.0.join("bpf");
    assert!(!dir.exists());

    let log = mount_bpffs(&dir);
    assert!(log.contains("Mounted"), "{log}");
    assert!(is_bpffs(&dir), "bpffs at {}", dir.display());
    assert_eq!(mounts_at(&dir), ["bpf"]);

    let log = mount_bpffs(&dir);
    assert!(log.contains("AlreadyMounted"), "{log}");
    assert_eq!(mounts_at(&dir), ["bpf"], "the second run mounted nothing");
    // Pins work there.
    std::fs::create_dir(dir.join("npm")).expect("a directory on the bpffs");

    // A tmpfs over the bpffs hides it: mount-bpffs mounts a bpffs on top.
    sh(&["mount", "-t", "tmpfs", "tmpfs", dir.to_str().unwrap()]);
    assert!(!is_bpffs(&dir));
    mount_bpffs(&dir);
    assert_eq!(mounts_at(&dir), ["bpf", "tmpfs", "bpf"]);
    assert!(is_bpffs(&dir));
    drop(scratch);
}
