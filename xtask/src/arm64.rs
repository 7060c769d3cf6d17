//! arm64 (`aarch64-unknown-linux-gnu`): the cross build, the Debian arm64
//! root, and the library collection for arm64 executables.
//!
//! Toolchains:
//! - the user-space binaries (`npm-agent`, `npm-cni`, `kubectl-npm`, and
//!   the test programs the arm64 VM row runs) are built by **nightly**
//!   (`rustup run nightly cargo build -Z build-std=std,panic_abort --target
//!   aarch64-unknown-linux-gnu`): only the x86_64 standard library is
//!   installed and rustup cannot download the aarch64 one, so `std` is
//!   compiled from nightly's `rust-src`. The linker (and the C compiler of
//!   `ring`'s build script) is Debian's `gcc-aarch64-linux-gnu` (glibc 2.36,
//!   `libc6-dev-arm64-cross`), so the binaries need Debian 12's glibc or newer.
//!   Output: `target/aarch64-unknown-linux-gnu/release/`.
//! - the BPF object is architecture-neutral bytecode: the same
//!   `target/bpfel-unknown-none/release/npm-ebpf` (nightly, `build-ebpf`)
//!   goes into both images.
//! - the amd64 binaries stay on the stable toolchain of `rust-toolchain.toml`.
//!
//! The Debian arm64 root (`<vm cache>/arm64/root-<hash of its packages>`, Debian 12, built once by
//! `debootstrap --foreign` and completed by running its second stage under
//! `qemu-aarch64-static` through binfmt_misc) provides the arm64 `nft`,
//! `iptables` and their libraries for the arm64 image, the sysroot its
//! executables' libraries are resolved against (`readelf` NEEDED entries:
//! `ldd` cannot inspect arm64 executables here), and the root the arm64 VM
//! row's guest runs in.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::OsString;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{root, run};

/// The Rust target triple.
pub const TARGET: &str = "aarch64-unknown-linux-gnu";

/// Debian's cross linker (package `gcc-aarch64-linux-gnu`).
pub const LINKER: &str = "aarch64-linux-gnu-gcc";

/// Where the cross build leaves its binaries.
pub fn release_dir() -> PathBuf {
    root().join("target").join(TARGET).join("release")
}

/// `rustup run nightly cargo <subcommand>` for arm64 with `std` built from
/// rust-src, linked by Debian's cross gcc, without the stable toolchain's
/// variables that `cargo xtask` inherits.
pub fn cross_cargo(subcommand: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", subcommand])
        .args(["--release", "--target", TARGET, "-Z", "build-std=std,panic_abort"])
        .env("CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER", LINKER)
        .env("CC_aarch64_unknown_linux_gnu", LINKER)
        .env("AR_aarch64_unknown_linux_gnu", "aarch64-linux-gnu-ar");
    for v in ["RUSTFLAGS", "RUSTC", "RUSTC_WRAPPER", "CARGO"] {
        cmd.env_remove(v);
    }
    cmd
}

/// Fail early, by name, when the cross build cannot work.
pub fn check_prerequisites() -> Result<()> {
    crate::setup::check_ebpf_toolchain(&["rust-src"])?;
    if crate::setup::output(Command::new(LINKER).arg("--version")).is_none() {
        bail!("{LINKER} is not installed: run `cargo xtask setup` (or `apt-get install gcc-aarch64-linux-gnu`)");
    }
    Ok(())
}

/// Build the image's binaries for arm64 (`npm-agent`, `kubectl-npm`, `npm-cni`).
pub fn build() -> Result<()> {
    check_prerequisites()?;
    run(cross_cargo("build").args(crate::image::release_packages()))?;
    for bin in ["npm-agent", "kubectl-npm"] {
        let p = release_dir().join(bin);
        if !p.exists() {
            bail!("the arm64 build succeeded but {} is missing", p.display());
        }
    }
    eprintln!("xtask: arm64 binaries in {}", release_dir().display());
    Ok(())
}

/// The arm64 binaries the `debian-arm64` row of `cargo xtask vm matrix`
/// runs: the image's ([`build`]), the conformance runner, and the
/// `npm-dataplane` kernel test binary (returned).
pub fn build_vm_row() -> Result<PathBuf> {
    build()?;
    run(cross_cargo("build").args(["-p", "npm-e2e", "--bin", "npm-conformance"]))?;
    crate::vm::matrix::dataplane_test_binary(cross_cargo("test"), "arm64 ")
}

/// The Debian suite of the arm64 root (its glibc, 2.36, is the one the
/// cross gcc links against).
pub const ROOT_SUITE: &str = "bookworm";

/// Packages of the arm64 root beyond debootstrap's `minbase`: the tools
/// the image ships (`nftables`, `iptables`), and what the VM row's guest
/// runs (ip, modprobe, busybox for its initramfs, ping, python3 for a
/// Service test, ps, and the CA bundle the agent's API client loads even
/// for a server it skips verifying: without one it stops at "building the
/// API client").
pub const ROOT_PACKAGES: &[&str] = &[
    "ca-certificates",
    "nftables",
    "iptables",
    "iproute2",
    "kmod",
    "busybox-static",
    "iputils-ping",
    "python3-minimal",
    "procps",
];

/// The cache key of the arm64 root: its suite and packages.
fn root_key() -> String {
    format!("{ROOT_SUITE} {}\n", ROOT_PACKAGES.join(","))
}

/// The directory name of the root of key `key` (`root-` and a 64-bit FNV-1a
/// hash of it): a root with other packages is another directory, so a
/// stale root is never used, and checkouts of different package lists
/// (branches, the CI's) do not rebuild each other's.
fn root_dir_name(key: &str) -> String {
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    });
    format!("root-{h:016x}")
}

/// The Debian arm64 root, built on first use and cached (outside the
/// checkout, beside the VM kernels) under a name derived from
/// [`ROOT_SUITE`] and [`ROOT_PACKAGES`] ([`root_dir_name`]): changing the
/// list builds a new root.
pub fn debian_root() -> Result<PathBuf> {
    let dir = crate::vm::cache().join("arm64");
    let want = root_key();
    let name = root_dir_name(&want);
    let root = dir.join(&name);
    let stamp = root.join(".npm-root");
    if std::fs::read_to_string(&stamp).is_ok_and(|s| s == want) {
        return Ok(root);
    }
    for tool in ["debootstrap", "qemu-aarch64-static"] {
        if crate::setup::output(Command::new("sh").args(["-c", &format!("command -v {tool}")])).is_none() {
            bail!("{tool} is not installed: run `cargo xtask setup`");
        }
    }
    binfmt()?;
    let (mirror, _) = crate::vm::host_mirrors()?;
    let partial = dir.join(format!("{name}.partial"));
    std::fs::create_dir_all(&dir)?;
    // Reused when a first stage completed (the download is most of it).
    if !partial.join("debootstrap/debootstrap").exists() || partial.join("debootstrap/npm-failed").exists() {
        let _ = std::fs::remove_dir_all(&partial);
        eprintln!("xtask: arm64: debootstrap --foreign {ROOT_SUITE} (first stage)");
        run(Command::new("debootstrap")
            .args(["--arch=arm64", "--foreign", "--variant=minbase"])
            .arg(format!("--include={}", ROOT_PACKAGES.join(",")))
            .arg(ROOT_SUITE)
            .arg(&partial)
            .arg(&mirror))?;
    }
    eprintln!("xtask: arm64: debootstrap second stage under qemu-user (a few minutes)");
    let second = run(Command::new("chroot")
        .arg(&partial)
        .args(["/debootstrap/debootstrap", "--second-stage"]));
    if let Err(e) = second {
        let _ = std::fs::write(partial.join("debootstrap/npm-failed"), "");
        return Err(e.context("the arm64 root's second stage (see debootstrap/debootstrap.log in the root)"));
    }
    let _ = std::fs::remove_dir_all(&root);
    std::fs::rename(&partial, &root)?;
    std::fs::write(&stamp, want)?;
    eprintln!("xtask: arm64: Debian root at {}", root.display());
    Ok(root)
}

/// arm64 executables run under `qemu-aarch64-static` through binfmt_misc
/// (the entry Debian's `qemu-user-static` ships, with the `F` flag: the
/// interpreter is opened now, so it works inside a chroot).
pub fn binfmt() -> Result<()> {
    let dir = Path::new("/proc/sys/fs/binfmt_misc");
    if !dir.join("register").exists() {
        run(Command::new("mount")
            .args(["-t", "binfmt_misc", "binfmt_misc"])
            .arg(dir))
        .context("mounting binfmt_misc")?;
    }
    if dir.join("qemu-aarch64").exists() {
        return Ok(());
    }
    let conf = std::fs::read_to_string("/usr/lib/binfmt.d/qemu-aarch64.conf")
        .context("/usr/lib/binfmt.d/qemu-aarch64.conf (package qemu-user-static)")?;
    std::fs::write(dir.join("register"), conf.trim()).context("registering qemu-aarch64 with binfmt_misc")?;
    Ok(())
}

/// `path` (absolute, inside `sysroot`) with every symbolic link resolved
/// inside `sysroot`: an absolute link target is taken from the sysroot, not
/// the build machine (Debian's alternatives are absolute links:
/// `/usr/sbin/iptables` -> `/etc/alternatives/iptables` -> `/usr/sbin/iptables-nft`).
pub fn resolve_in(sysroot: &Path, path: &Path) -> Result<PathBuf> {
    let mut todo: Vec<OsString> = Vec::new();
    push_components(&mut todo, path);
    let mut cur = PathBuf::from("/");
    let mut hops = 0;
    while let Some(c) = todo.pop() {
        if c == ".." {
            cur.pop();
            continue;
        }
        let next = cur.join(&c);
        let host = sysroot.join(next.strip_prefix("/").expect("absolute"));
        let meta =
            std::fs::symlink_metadata(&host).with_context(|| format!("{} in {}", path.display(), sysroot.display()))?;
        if meta.file_type().is_symlink() {
            hops += 1;
            if hops > 40 {
                bail!("{} in {}: too many symbolic links", path.display(), sysroot.display());
            }
            let target = std::fs::read_link(&host)?;
            if target.is_absolute() {
                cur = PathBuf::from("/");
            }
            push_components(&mut todo, &target);
        } else {
            cur = next;
        }
    }
    Ok(cur)
}

/// `p`'s components onto the stack `todo`, the first on top.
fn push_components(todo: &mut Vec<OsString>, p: &Path) {
    let comps: Vec<OsString> = p
        .components()
        .filter_map(|c| match c {
            Component::Normal(s) => Some(s.to_os_string()),
            Component::ParentDir => Some("..".into()),
            _ => None,
        })
        .collect();
    todo.extend(comps.into_iter().rev());
}

/// The `NEEDED` entries of `readelf -d` output.
pub fn parse_needed(text: &str) -> Vec<String> {
    text.lines()
        .filter(|l| l.contains("(NEEDED)"))
        .filter_map(|l| {
            let (_, rest) = l.split_once('[')?;
            Some(rest.split(']').next()?.to_string())
        })
        .collect()
}

/// The program interpreter of `readelf -l` output.
pub fn parse_interpreter(text: &str) -> Option<String> {
    text.lines().find_map(|l| {
        let rest = l.split("Requesting program interpreter:").nth(1)?;
        Some(rest.trim().trim_end_matches(']').trim().to_string())
    })
}

/// Where the arm64 loader looks (Debian's multiarch directories first).
const LIBRARY_DIRS: &[&str] = &[
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib",
    "/usr/lib",
];

fn readelf(args: &[&str], file: &Path) -> Result<String> {
    let out = Command::new("readelf")
        .args(args)
        .arg(file)
        .output()
        .context("cannot start readelf (package binutils)")?;
    if !out.status.success() {
        bail!(
            "readelf {args:?} {} failed: {}",
            file.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The shared libraries `exe` loads, transitively, and its program
/// interpreter, resolved in `sysroot` as the arm64 loader resolves them:
/// (file to copy on this machine, path in the image). Fails on a library
/// the sysroot does not have.
pub fn shared_libraries(exe: &Path, sysroot: &Path) -> Result<Vec<(PathBuf, PathBuf)>> {
    let mut found: BTreeMap<PathBuf, PathBuf> = BTreeMap::new();
    let mut queue = VecDeque::from([exe.to_path_buf()]);
    let mut seen = std::collections::BTreeSet::new();
    while let Some(file) = queue.pop_front() {
        if !seen.insert(file.clone()) {
            continue;
        }
        if let Some(interp) = parse_interpreter(&readelf(&["-lW"], &file)?) {
            let interp = Path::new(&interp);
            let real = resolve_in(sysroot, interp)
                .with_context(|| format!("the program interpreter of {}", file.display()))?;
            let dir = resolve_in(sysroot, interp.parent().unwrap_or(Path::new("/")))?;
            let dest = dir.join(interp.file_name().context("interpreter without a name")?);
            found.insert(dest, sysroot.join(real.strip_prefix("/").expect("absolute")));
        }
        for name in parse_needed(&readelf(&["-dW"], &file)?) {
            let hit = LIBRARY_DIRS.iter().find_map(|d| {
                let real = resolve_in(sysroot, &Path::new(d).join(&name)).ok()?;
                let dir = resolve_in(sysroot, Path::new(d)).ok()?;
                Some((dir.join(&name), sysroot.join(real.strip_prefix("/").expect("absolute"))))
            });
            let Some((dest, src)) = hit else {
                bail!(
                    "{} needs {name}, which {} does not have",
                    file.display(),
                    sysroot.display()
                );
            };
            if let std::collections::btree_map::Entry::Vacant(e) = found.entry(dest) {
                queue.push_back(src.clone());
                e.insert(src);
            }
        }
    }
    Ok(found.into_iter().map(|(dest, src)| (src, dest)).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readelf_output_is_parsed() {
        // As readelf 2.40 printed it for the arm64 agent.
        let dynamic = "Dynamic section at offset 0x1c1e2d8 contains 30 entries:\n  \
            Tag        Type                         Name/Value\n \
            0x0000000000000001 (NEEDED)             Shared library: [libgcc_s.so.1]\n \
            0x0000000000000001 (NEEDED)             Shared library: [libc.so.6]\n \
            0x000000000000000e (SONAME)             Library soname: [libx.so.1]\n";
        assert_eq!(parse_needed(dynamic), vec!["libgcc_s.so.1", "libc.so.6"]);
        let program =
            "  INTERP         0x000238 0x0000000000000238 0x0000000000000238 0x00001b 0x00001b R   0x1\n      \
            [Requesting program interpreter: /lib/ld-linux-aarch64.so.1]\n";
        assert_eq!(
            parse_interpreter(program).as_deref(),
            Some("/lib/ld-linux-aarch64.so.1")
        );
        assert_eq!(parse_interpreter("no interpreter here"), None);
    }

    #[test]
    fn the_root_is_keyed_by_its_packages() {
        let key = root_key();
        assert!(key.contains("ca-certificates"), "the agent needs a CA bundle: {key}");
        let name = root_dir_name(&key);
        assert_eq!(name, root_dir_name(&key));
        assert_eq!(name.len(), "root-".len() + 16);
        // The list before ca-certificates joined it names another root.
        let without: Vec<&str> = ROOT_PACKAGES
            .iter()
            .copied()
            .filter(|p| *p != "ca-certificates")
            .collect();
        assert_ne!(name, root_dir_name(&format!("{ROOT_SUITE} {}\n", without.join(","))));
        assert_ne!(name, root_dir_name(&key.replace(ROOT_SUITE, "trixie")));
    }

    #[test]
    fn links_resolve_inside_the_sysroot() {
        let dir = std::env::temp_dir().join(format!("npm-xtask-resolve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("usr/sbin")).unwrap();
        std::fs::create_dir_all(dir.join("usr/lib/aarch64-linux-gnu")).unwrap();
        std::fs::create_dir_all(dir.join("etc/alternatives")).unwrap();
        std::fs::write(dir.join("usr/sbin/xtables-nft-multi"), "").unwrap();
        std::fs::write(dir.join("usr/lib/aarch64-linux-gnu/libmnl.so.0.2.0"), "").unwrap();
        use std::os::unix::fs::symlink;
        // merged /usr (relative), alternatives (absolute), a library's soname link.
        symlink("usr/lib", dir.join("lib")).unwrap();
        symlink("/etc/alternatives/iptables", dir.join("usr/sbin/iptables")).unwrap();
        symlink("/usr/sbin/iptables-nft", dir.join("etc/alternatives/iptables")).unwrap();
        symlink("xtables-nft-multi", dir.join("usr/sbin/iptables-nft")).unwrap();
        symlink("libmnl.so.0.2.0", dir.join("usr/lib/aarch64-linux-gnu/libmnl.so.0")).unwrap();
        assert_eq!(
            resolve_in(&dir, Path::new("/usr/sbin/iptables")).unwrap(),
            PathBuf::from("/usr/sbin/xtables-nft-multi")
        );
        assert_eq!(
            resolve_in(&dir, Path::new("/lib/aarch64-linux-gnu/libmnl.so.0")).unwrap(),
            PathBuf::from("/usr/lib/aarch64-linux-gnu/libmnl.so.0.2.0")
        );
        assert_eq!(
            resolve_in(&dir, Path::new("/lib/aarch64-linux-gnu")).unwrap(),
            PathBuf::from("/usr/lib/aarch64-linux-gnu")
        );
        // A name the sysroot lacks is an error, even when this machine has it.
        assert!(resolve_in(&dir, Path::new("/usr/sbin/nft-missing")).is_err());
        symlink("/bin/sh", dir.join("usr/sbin/outside")).unwrap();
        assert!(resolve_in(&dir, Path::new("/usr/sbin/outside")).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
