//! `cargo xtask vm`: run a command on Debian's own kernels under qemu.
//!
//! - `cargo xtask vm run --kernel debian-5.10|debian-6.1|debian-6.12 -- CMD…`
//!   boots that kernel and runs `CMD` as root in the checkout (same path,
//!   writable), printing its output and exiting with its status.
//! - `cargo xtask vm matrix` runs the kernel checks on every row (the three
//!   Debian kernels and the host's own) and ends with `N passed, M failed`.
//!
//! How a run works:
//! - The kernel is Debian's generic flavour (`linux-image-<ver>-amd64`: the
//!   cloud flavour has no 9p), the newest of its line: the name comes from
//!   the dependency of the suite's `linux-image-amd64` metapackage, read
//!   with apt from temporary lists under the cache (the mirror is the one
//!   the host's apt sources name, read at run time). The package is
//!   extracted with `dpkg-deb -x` into the cache, by package name, and
//!   `depmod` indexes its modules.
//! - No disk image: qemu's 9p shares the host's `/` read-only (the guest
//!   puts a tmpfs overlay over it, so it can write anywhere; nothing goes
//!   back to the host) and the checkout read-write, mounted at its own path.
//!   The guest thus runs the host's binaries (`ip`, `nft`, the test
//!   binaries in `target/`), with the guest kernel's modules bind-mounted at
//!   `/lib/modules/<ver>` so that `modprobe` works.
//! - A small initramfs (busybox, the 9p/virtio/overlay modules in
//!   dependency order, `vm/init.sh`) mounts all that, runs the command
//!   through `chroot`, prints `NPM-VM-EXIT <status>` and reboots, which
//!   ends qemu (`-no-reboot`).
//! - qemu: `-M q35` with single-threaded TCG (nested KVM fails on this kind
//!   of host; `NPM_VM_ACCEL=kvm` to try it), 2 vCPUs, `NPM_VM_MEMORY` MiB
//!   (2048). Multi-threaded TCG crashes 6.12 at boot (an `int3` oops in
//!   `sched_clock_idle_wakeup_event`: cross-vCPU code patching), and one
//!   host thread per guest suits a shared two-core machine.
//!   `microvm` was tried: its kernels stall calibrating the APIC timer
//!   under TCG (no PIT/HPET reference).
//!
//! arm64 (`--kernel debian-arm64`): Debian 13's `linux-image-arm64` kernel
//! under `qemu-system-aarch64 -M virt -cpu cortex-a72`, TCG, console
//! `ttyAMA0`; its `vmlinuz` (an EFI zboot image qemu 7.2 cannot boot) is
//! unpacked to `Image` once. The guest's root is the cached Debian arm64
//! root (`crate::arm64::debian_root`) instead of the host's, shared the same
//! way, with the kernel's modules as a third 9p share; busybox comes from
//! that root. The command must be an arm64 program or a script (the
//! checkout's `target/aarch64-unknown-linux-gnu/release/...`).
//!
//! The cache is `NPM_VM_CACHE` or `/var/cache/npm-vm` (outside the checkout:
//! CI clones afresh each time).

pub(crate) mod matrix;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context, Result};
use clap::Subcommand;

use crate::root;
use crate::setup::output;

/// `cargo xtask vm …`.
#[derive(Subcommand)]
pub enum VmCmd {
    /// Boot a Debian kernel under qemu and run a command as root in the
    /// checkout (same path, writable); exits with the command's status.
    Run {
        /// debian-5.10, debian-6.1, debian-6.12 or debian-arm64.
        #[arg(long)]
        kernel: String,
        /// The command and its arguments (after `--`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, required = true)]
        command: Vec<String>,
    },
    /// Every row (the Debian kernels and the host's): load, verifier,
    /// attach and Service kernel tests; ends with `N passed, M failed`.
    Matrix {
        /// Only these rows (debian-5.10, debian-6.1, debian-6.12, host,
        /// debian-arm64).
        #[arg(long = "row")]
        rows: Vec<String>,
        /// CI's subset: of the conformance steps only eBPF through
        /// ClusterIPs on two nodes (the Service subset); the kernel tests
        /// and the agent check as on demand.
        #[arg(long)]
        ci: bool,
    },
}

/// The kernel lines: name, Debian suite, version prefix, Debian
/// architecture. `debian-arm64` boots under `qemu-system-aarch64` in the
/// Debian arm64 root (`crate::arm64::debian_root`) instead of the host's.
pub const KERNELS: &[(&str, &str, &str, &str)] = &[
    ("debian-5.10", "bullseye", "5.10.", "amd64"),
    ("debian-6.1", "bookworm", "6.1.", "amd64"),
    ("debian-6.12", "trixie", "6.12.", "amd64"),
    ("debian-arm64", "trixie", "6.12.", "arm64"),
];

/// Modules the initramfs loads (with their dependencies, from
/// `modules.dep`) unless built in.
const BOOT_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p", "overlay"];

/// The marker `vm/init.sh` prints after the command.
const EXIT_MARKER: &str = "NPM-VM-EXIT ";

pub fn main(cmd: VmCmd) -> Result<()> {
    match cmd {
        VmCmd::Run { kernel, command } => {
            let status = run(&kernel, &command, &[], &mut |line| println!("{line}"))?;
            std::io::stdout().flush().ok();
            if status != 0 {
                std::process::exit(status);
            }
            Ok(())
        }
        VmCmd::Matrix { rows, ci } => matrix::matrix(&rows, ci),
    }
}

pub(crate) fn cache() -> PathBuf {
    std::env::var_os("NPM_VM_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| "/var/cache/npm-vm".into())
}

/// An extracted kernel package.
pub struct Kernel {
    /// `linux-image-…` package name.
    pub package: String,
    /// `uname -r` of the kernel.
    pub release: String,
    /// Where the package is extracted.
    pub dir: PathBuf,
    /// Debian architecture (`amd64`, `arm64`).
    pub arch: &'static str,
}

impl Kernel {
    fn vmlinuz(&self) -> PathBuf {
        self.dir.join(format!("boot/vmlinuz-{}", self.release))
    }
    /// The file qemu's `-kernel` takes. Debian's arm64 `vmlinuz` since
    /// 6.x is an EFI zboot image (a PE stub around a compressed `Image`),
    /// which qemu 7.2 cannot boot directly: its payload is unpacked once
    /// beside it (`Image`).
    fn boot_image(&self) -> Result<PathBuf> {
        let vmlinuz = self.vmlinuz();
        let data = std::fs::read(&vmlinuz).with_context(|| format!("reading {}", vmlinuz.display()))?;
        if self.arch == "amd64" || data.get(4..8) != Some(b"zimg") {
            return Ok(vmlinuz);
        }
        let image = self.dir.join("boot/Image");
        if image.exists() {
            return Ok(image);
        }
        let word = |at: usize| -> Result<usize> {
            let b = data.get(at..at + 4).context("a truncated zboot header")?;
            Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize)
        };
        let (offset, size) = (word(8)?, word(12)?);
        let payload = data
            .get(offset..offset + size)
            .context("the zboot payload lies outside the file")?;
        let method = String::from_utf8_lossy(data.get(24..32).unwrap_or_default())
            .trim_end_matches('\0')
            .to_string();
        let tool = match method.as_str() {
            "gzip" => "gzip",
            "zstd" => "zstd",
            "xzkern" | "xz" => "xz",
            other => bail!("{}: zboot compression {other:?} is not handled", vmlinuz.display()),
        };
        let mut child = Command::new(tool)
            .arg("-dc")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("running {tool}"))?;
        let mut stdin = child.stdin.take().expect("piped");
        let payload = payload.to_vec();
        let writer = std::thread::spawn(move || stdin.write_all(&payload));
        let out = child.wait_with_output()?;
        let _ = writer.join();
        if out.stdout.is_empty() {
            bail!("unpacking the zboot payload of {} ({tool}) failed", vmlinuz.display());
        }
        std::fs::write(&image, out.stdout)?;
        Ok(image)
    }
    fn modules(&self) -> PathBuf {
        self.dir.join(format!("lib/modules/{}", self.release))
    }
    /// `CONFIG_…` value in the kernel's config (`y`, `m`, or None).
    fn config(&self, key: &str) -> Option<String> {
        let cfg = std::fs::read_to_string(self.dir.join(format!("boot/config-{}", self.release))).ok()?;
        cfg.lines().find_map(|l| {
            l.strip_prefix(key)
                .and_then(|r| r.strip_prefix('='))
                .map(str::to_string)
        })
    }
}

/// The host's Debian mirrors, from its apt sources: (main archive,
/// security archive).
pub(crate) fn host_mirrors() -> Result<(String, Option<String>)> {
    let mut main = None;
    let mut security = None;
    let deb822 = std::fs::read_to_string("/etc/apt/sources.list.d/debian.sources").unwrap_or_default();
    for stanza in deb822.split("\n\n") {
        let field = |name: &str| {
            stanza
                .lines()
                .find_map(|l| l.strip_prefix(name).map(|v| v.trim().to_string()))
        };
        let (Some(uris), Some(suites)) = (field("URIs:"), field("Suites:")) else {
            continue;
        };
        let Some(uri) = uris.split_whitespace().next().map(str::to_string) else {
            continue;
        };
        if suites.contains("-security") {
            security.get_or_insert(uri);
        } else {
            main.get_or_insert(uri);
        }
    }
    // One-line format as a fallback: `deb [opts] URI suite components`.
    let list = std::fs::read_to_string("/etc/apt/sources.list").unwrap_or_default();
    for l in list.lines() {
        let words: Vec<&str> = l
            .split_whitespace()
            .filter(|w| !w.starts_with('[') && !w.ends_with(']'))
            .collect();
        if words.len() >= 3 && words[0] == "deb" {
            if words[2].contains("-security") {
                security.get_or_insert(words[1].to_string());
            } else {
                main.get_or_insert(words[1].to_string());
            }
        }
    }
    match main {
        Some(m) => Ok((m, security)),
        None => bail!("no Debian mirror in /etc/apt/sources.list.d/debian.sources or /etc/apt/sources.list"),
    }
}

/// apt with its state under `dir` (lists for `suite` only).
fn apt(tool: &str, dir: &Path, arch: &str) -> Command {
    let mut cmd = Command::new(tool);
    let d = dir.display();
    for o in [
        format!("Dir::Etc::SourceList={d}/sources.list"),
        format!("Dir::Etc::SourceParts={d}/sources.list.d"),
        format!("Dir::Etc::Preferences={d}/preferences"),
        format!("Dir::Etc::PreferencesParts={d}/preferences.d"),
        format!("Dir::State={d}"),
        format!("Dir::State::Lists={d}/lists"),
        format!("Dir::State::status={d}/status"),
        format!("Dir::Cache={d}"),
        format!("Dir::Cache::Archives={d}/archives"),
        format!("APT::Architecture={arch}"),
        "APT::Sandbox::User=root".to_string(),
        "Debug::NoLocking=1".to_string(),
    ] {
        cmd.args(["-o", &o]);
    }
    cmd.arg("-qq");
    cmd
}

/// Resolve, download and extract the newest kernel of `name`'s line.
pub fn kernel(name: &str) -> Result<Kernel> {
    let Some(&(_, suite, prefix, arch)) = KERNELS.iter().find(|k| k.0 == name) else {
        bail!(
            "unknown kernel {name:?}: one of {}",
            KERNELS.iter().map(|k| k.0).collect::<Vec<_>>().join(", ")
        );
    };
    let dir = match arch {
        "amd64" => cache().join("apt").join(suite),
        _ => cache().join("apt").join(format!("{suite}-{arch}")),
    };
    for sub in ["lists/partial", "archives/partial", "sources.list.d", "preferences.d"] {
        std::fs::create_dir_all(dir.join(sub)).with_context(|| format!("creating {}", dir.display()))?;
    }
    if !dir.join("status").exists() {
        std::fs::write(dir.join("status"), "")?;
    }
    let (main, security) = host_mirrors()?;
    let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
    let mut sources = format!("deb [signed-by={keyring}] {main} {suite} main\n");
    if let Some(sec) = security {
        sources.push_str(&format!("deb [signed-by={keyring}] {sec} {suite}-security main\n"));
    }
    std::fs::write(dir.join("sources.list"), &sources)?;
    // The lists are refreshed once a day: the newest point release is used
    // without a network round trip on every run.
    let stamp = dir.join("updated");
    let fresh = std::fs::metadata(&stamp)
        .and_then(|m| m.modified())
        .map(|t| SystemTime::now().duration_since(t).unwrap_or_default() < Duration::from_secs(86_400))
        .unwrap_or(false);
    if !fresh {
        eprintln!("xtask: vm: refreshing the {suite} package lists");
        let st = apt("apt-get", &dir, arch)
            .arg("update")
            .status()
            .context("running apt-get")?;
        if st.success() {
            std::fs::write(&stamp, "")?;
        } else if !dir
            .join("lists")
            .read_dir()?
            .any(|e| e.is_ok_and(|e| e.file_type().is_ok_and(|t| t.is_file())))
        {
            bail!("apt-get update for {suite} failed and no lists are cached");
        } else {
            eprintln!("xtask: vm: apt-get update for {suite} failed: using the cached lists");
        }
    }
    let meta = format!("linux-image-{arch}");
    let show = output(apt("apt-cache", &dir, arch).args(["show", "--no-all-versions", &meta]))
        .with_context(|| format!("apt-cache show {meta} ({suite})"))?;
    let package = show
        .lines()
        .find_map(|l| l.strip_prefix("Depends:"))
        .and_then(|deps| {
            deps.split([',', '|'])
                .map(|d| d.split_whitespace().next().unwrap_or(""))
                .find(|d| d.starts_with(&format!("linux-image-{prefix}")) && d.ends_with(&format!("-{arch}")))
        })
        .map(str::to_string)
        .with_context(|| format!("no linux-image-{prefix}*-{arch} dependency of {meta} in {suite}"))?;
    let kdir = cache().join("kernels").join(&package);
    if !kdir.join(".complete").exists() {
        eprintln!("xtask: vm: downloading {package} ({suite})");
        let dl = cache().join("download");
        let _ = std::fs::remove_dir_all(&dl);
        std::fs::create_dir_all(&dl)?;
        let st = apt("apt-get", &dir, arch)
            .args(["download", &package])
            .current_dir(&dl)
            .status()?;
        if !st.success() {
            bail!("apt-get download {package} failed");
        }
        let deb = std::fs::read_dir(&dl)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "deb"))
            .context("apt-get download left no .deb")?;
        let _ = std::fs::remove_dir_all(&kdir);
        std::fs::create_dir_all(&kdir)?;
        crate::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&kdir))?;
        // trixie's packages are usr-merged (usr/lib/modules).
        if !kdir.join("lib").exists() && kdir.join("usr/lib").is_dir() {
            std::os::unix::fs::symlink("usr/lib", kdir.join("lib"))?;
        }
        let release = release_of(&kdir)?;
        crate::run(Command::new("depmod").arg("-b").arg(&kdir).arg(&release)).context("depmod (package kmod)")?;
        std::fs::write(kdir.join(".complete"), "")?;
        let _ = std::fs::remove_dir_all(&dl);
    }
    let release = release_of(&kdir)?;
    Ok(Kernel {
        package,
        release,
        dir: kdir,
        arch,
    })
}

fn release_of(kdir: &Path) -> Result<String> {
    std::fs::read_dir(kdir.join("lib/modules"))
        .with_context(|| format!("{}/lib/modules", kdir.display()))?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .next()
        .context("the kernel package has no module directory")
}

/// Modules to load, dependencies first, from `modules.dep` (paths
/// relative to the module directory).
fn module_order(k: &Kernel, wanted: &[&str]) -> Result<Vec<String>> {
    let dep = std::fs::read_to_string(k.modules().join("modules.dep"))
        .with_context(|| format!("{}/modules.dep", k.modules().display()))?;
    let entries: Vec<(String, Vec<String>)> = dep
        .lines()
        .filter_map(|l| l.split_once(':'))
        .map(|(m, deps)| (m.to_string(), deps.split_whitespace().map(str::to_string).collect()))
        .collect();
    let module_name = |path: &str| {
        let base = path.rsplit('/').next().unwrap_or(path);
        base.split(".ko").next().unwrap_or(base).replace('-', "_")
    };
    fn visit(m: &str, entries: &[(String, Vec<String>)], out: &mut Vec<String>) {
        if out.iter().any(|o| o == m) {
            return;
        }
        if let Some((_, deps)) = entries.iter().find(|e| e.0 == m) {
            // modprobe's order: the last dependency listed loads first.
            for d in deps.iter().rev() {
                visit(d, entries, out);
            }
        }
        out.push(m.to_string());
    }
    let mut out = Vec::new();
    for w in wanted {
        let key = format!("CONFIG_{}", w.to_uppercase());
        let Some((path, _)) = entries.iter().find(|e| module_name(&e.0) == *w) else {
            // Not a module: built in (or the initramfs fails loudly below).
            eprintln!(
                "xtask: vm: {w} is not a module of {} ({key}={:?})",
                k.release,
                k.config(&key)
            );
            continue;
        };
        visit(path, &entries, &mut out);
    }
    Ok(out)
}

fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// Build the initramfs for one run into `work`.
fn initramfs(
    k: &Kernel,
    work: &Path,
    checkout: &Path,
    command: &[String],
    env: &[(String, String)],
) -> Result<PathBuf> {
    let tree = work.join("tree");
    let mods = tree.join("npm-vm/modules.d");
    std::fs::create_dir_all(tree.join("bin"))?;
    std::fs::create_dir_all(&mods)?;
    let busybox = match k.arch {
        "amd64" => PathBuf::from("/bin/busybox"),
        _ => {
            let root = guest_root(k)?;
            root.join(crate::arm64::resolve_in(&root, Path::new("/bin/busybox"))?.strip_prefix("/")?)
        }
    };
    std::fs::copy(&busybox, tree.join("bin/busybox"))
        .with_context(|| format!("copying {} (package busybox-static)", busybox.display()))?;
    let init = tree.join("init");
    std::fs::write(&init, include_str!("vm/init.sh"))?;
    for f in [&init, &tree.join("bin/busybox")] {
        std::fs::set_permissions(f, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    }
    let mut order = String::new();
    for (i, rel) in module_order(k, BOOT_MODULES)?.iter().enumerate() {
        let src = k.modules().join(rel);
        let name = format!(
            "{i:02}-{}.ko",
            rel.rsplit('/').next().unwrap_or(rel).split(".ko").next().unwrap_or(rel)
        );
        let dst = mods.join(&name);
        // busybox insmod takes plain ELF: unpack compressed modules here.
        let unpack = |tool: &str| -> Result<()> {
            let out = Command::new(tool)
                .arg("-dc")
                .arg(&src)
                .output()
                .with_context(|| format!("running {tool}"))?;
            if !out.status.success() {
                bail!("{tool} -dc {} failed", src.display());
            }
            std::fs::write(&dst, out.stdout)?;
            Ok(())
        };
        if rel.ends_with(".ko.xz") {
            unpack("xz")?;
        } else if rel.ends_with(".ko.zst") {
            unpack("zstd")?;
        } else if rel.ends_with(".ko.gz") {
            unpack("gzip")?;
        } else {
            std::fs::copy(&src, &dst)?;
        }
        order.push_str(&name);
        order.push('\n');
    }
    std::fs::write(tree.join("npm-vm/modules"), order)?;
    std::fs::write(
        tree.join("npm-vm/env"),
        format!(
            "NPM_VM_CHECKOUT={}\nNPM_VM_KVER={}\nNPM_VM_MODULES={}\nNPM_VM_MODULES_9P={}\n",
            shell_quote(&checkout.to_string_lossy()),
            shell_quote(&k.release),
            shell_quote(&k.modules().to_string_lossy()),
            if k.arch == "amd64" { "" } else { "1" },
        ),
    )?;
    let mut script = String::from(
        "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root TERM=dumb LANG=C.UTF-8\n",
    );
    for (key, value) in env {
        script.push_str(&format!("export {key}={}\n", shell_quote(value)));
    }
    script.push_str(&format!(
        "cd {} || exit 125\nexec",
        shell_quote(&checkout.to_string_lossy())
    ));
    for a in command {
        script.push(' ');
        script.push_str(&shell_quote(a));
    }
    script.push('\n');
    std::fs::write(tree.join("npm-vm/cmd"), script)?;
    let cpio = work.join("initrd.cpio");
    let out = std::fs::File::create(&cpio)?;
    let st = Command::new("sh")
        .args(["-c", "find . | cpio -o -H newc --quiet"])
        .current_dir(&tree)
        .stdout(out)
        .status()
        .context("running cpio (package cpio)")?;
    if !st.success() {
        bail!("cpio failed");
    }
    Ok(cpio)
}

/// The variables passed into the guest: the host's `NPM_*` and `RUST_*`,
/// `extra`, and `NPM_VM_KERNEL`.
fn guest_env(kernel: &str, extra: &[(String, String)]) -> Vec<(String, String)> {
    let mut env: Vec<(String, String)> = std::env::vars()
        .filter(|(k, _)| (k.starts_with("NPM_") || k.starts_with("RUST_")) && !k.starts_with("NPM_VM_"))
        .filter(|(k, _)| k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
        .collect();
    env.extend(extra.iter().cloned());
    env.push(("NPM_VM_KERNEL".into(), kernel.into()));
    env
}

/// Boot `kernel` and run `command` in the checkout; each output line goes
/// to `line`. Returns the command's exit status.
pub fn run(
    kernel_name: &str,
    command: &[String],
    extra_env: &[(String, String)],
    line: &mut dyn FnMut(&str),
) -> Result<i32> {
    let k = kernel(kernel_name)?;
    let checkout = root();
    clear_stale_runs();
    let work = cache().join(format!("run-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work)?;
    let res = (|| {
        let initrd = initramfs(&k, &work, &checkout, command, &guest_env(kernel_name, extra_env))?;
        boot(&k, &initrd, &checkout, line)
    })();
    let _ = std::fs::remove_dir_all(&work);
    res
}

/// Removes the work directories (`run-<pid>` in the cache: the initramfs
/// tree and image) that runs killed before their cleanup left, those whose
/// process is gone; a live run's (another checkout's, beside this one) is
/// kept.
fn clear_stale_runs() {
    let Ok(entries) = std::fs::read_dir(cache()) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(pid) = name.strip_prefix("run-").and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            eprintln!("xtask: vm: removing {name}, left by a run that ended before its cleanup");
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// The root the guest runs in (shared read-only over 9p): the host's for
/// amd64, the Debian arm64 root for arm64.
fn guest_root(k: &Kernel) -> Result<PathBuf> {
    match k.arch {
        "amd64" => Ok(PathBuf::from("/")),
        _ => crate::arm64::debian_root(),
    }
}

fn boot(k: &Kernel, initrd: &Path, checkout: &Path, line: &mut dyn FnMut(&str)) -> Result<i32> {
    let accel = std::env::var("NPM_VM_ACCEL").unwrap_or_else(|_| "tcg,thread=single".into());
    let memory = std::env::var("NPM_VM_MEMORY").unwrap_or_else(|_| "2048".into());
    let timeout = std::env::var("NPM_VM_TIMEOUT").unwrap_or_else(|_| "3600".into());
    let guest_root = guest_root(k)?;
    let (qemu, machine, console): (&str, &[&str], &str) = match k.arch {
        "amd64" => ("qemu-system-x86_64", &["-M", "q35", "-cpu", "max"], "ttyS0"),
        // `virt` with a Cortex-A72: `-cpu max` adds pointer authentication
        // and SVE, whose emulation slows TCG down for nothing npm uses.
        _ => ("qemu-system-aarch64", &["-M", "virt", "-cpu", "cortex-a72"], "ttyAMA0"),
    };
    let mut cmd = Command::new("timeout");
    cmd.args(["-s", "KILL", &timeout, qemu])
        .args(machine)
        .args(["-accel", &accel, "-smp", "2", "-m", &memory])
        .args([
            "-nodefaults",
            "-no-user-config",
            "-display",
            "none",
            "-serial",
            "stdio",
            "-no-reboot",
        ])
        .arg("-kernel")
        .arg(k.boot_image()?)
        .arg("-initrd")
        .arg(initrd)
        .args([
            "-append",
            &format!("console={console} quiet loglevel=1 panic=-1 reboot=t"),
        ])
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap",
            guest_root.display()
        ))
        .arg("-virtfs")
        .arg(format!(
            "local,path={},mount_tag=checkout,security_model=none",
            checkout.display()
        ))
        .args(if k.arch == "amd64" {
            Vec::new()
        } else {
            vec![
                "-virtfs".to_string(),
                format!(
                    "local,path={},mount_tag=modules,security_model=none,readonly=on",
                    k.modules().display()
                ),
            ]
        })
        .stdin(Stdio::null())
        .stdout(Stdio::piped());
    let started = Instant::now();
    eprintln!("xtask: vm: booting {} ({}) under {accel}", k.release, k.package);
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {qemu} (package qemu-system-x86 or qemu-system-arm)"))?;
    let mut reader = BufReader::new(child.stdout.take().expect("piped"));
    let mut buf = Vec::new();
    let mut status = None;
    loop {
        buf.clear();
        if reader.read_until(b'\n', &mut buf)? == 0 {
            break;
        }
        let text = String::from_utf8_lossy(&buf);
        let text = text.trim_end_matches(['\n', '\r']).trim_start_matches('\r');
        if status.is_some() {
            // After the command: the kernel's reboot messages.
            continue;
        }
        match text
            .strip_prefix(EXIT_MARKER)
            .and_then(|s| s.trim().parse::<i32>().ok())
        {
            Some(s) => status = Some(s),
            None => line(text),
        }
    }
    let qemu = child.wait()?;
    eprintln!(
        "xtask: vm: {} ran for {:.1} s (qemu {qemu})",
        k.release,
        started.elapsed().as_secs_f64()
    );
    match status {
        Some(s) => Ok(s),
        None => bail!("the guest ended without reporting the command's status (qemu {qemu})"),
    }
}
