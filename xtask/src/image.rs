//! `cargo xtask image`: the agent's OCI image, built without a container
//! daemon by `buildah` (Debian's package).
//!
//! The image is `scratch` plus exactly what the agent runs:
//! - `/usr/bin/npm-agent` (release build) and, when the workspace has it,
//!   `/usr/bin/npm-cni`; `/usr/bin/kubectl-npm`, the kubectl plugin (also
//!   left as `target/image/kubectl-npm`, the file to put on an operator's
//!   `PATH`);
//! - the BPF object at `/usr/lib/npm/npm-ebpf.o`;
//! - the tools the agent forks: `nft` (the nftables dataplane's
//!   `nft -f -` transactions and `nft -j list` reads), and `iptables` and
//!   `ip6tables` (the NFQUEUE rules of the DNS learning, `--dns-server`,
//!   with the four xtables extensions they load). No `ip`: interface
//!   and node-address discovery use netlink, and `ip netns exec` is only a
//!   test-side wrapper (`NftOptions::netns`), never set by the agent;
//! - the shared libraries of all of these, as `ldd` resolves them on the
//!   build machine, at the paths the dynamic loader looks them up under
//!   (Debian's merged `/usr`: `/lib`, `/lib64`, `/bin` and `/sbin` are links
//!   into `/usr`), `/etc/protocols`, `/etc/services` and the CA bundle
//!   `/etc/ssl/certs/ca-certificates.crt`.
//!
//! It runs as root: loading BPF programs, pinning maps and editing nftables
//! need CAP_BPF, CAP_NET_ADMIN, CAP_SYS_ADMIN and CAP_PERFMON in the
//! container, and Kubernetes grants added capabilities to uid 0 only (there
//! are no ambient capabilities for other users). The chart's
//! `capabilities` list is the set it needs.
//!
//! Output: `localhost/npm-agent:<version>` and `localhost/npm-agent:latest`
//! in the local containers storage (podman and buildah see them), and the
//! OCI archive `target/image/npm-agent.tar`.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::{cargo, ebpf_object, root, run};

mod check;
pub use check::check;
#[cfg(test)]
use check::missing_executable;

/// The image's repository in the local containers storage.
pub const REPOSITORY: &str = "localhost/npm-agent";

/// Tools the agent forks, found on the build machine's PATH, and the
/// arguments the image check runs each with (for iptables and ip6tables:
/// the help of the extensions the DNS learning's rules use, which fails
/// when one is missing).
const TOOLS: &[(&str, &str, &[&str])] = &[
    ("nft", "/usr/sbin/nft", &["--version"]),
    (
        "iptables",
        "/usr/sbin/iptables",
        &["-m", "conntrack", "-j", "NFQUEUE", "-h"],
    ),
    (
        "ip6tables",
        "/usr/sbin/ip6tables",
        &["-m", "conntrack", "-j", "NFQUEUE", "-h"],
    ),
];

/// The xtables extensions the DNS learning's rules load (`-j <chain>`,
/// `-p udp`, `-m conntrack`, `-j NFQUEUE`; `crate::dns::capture` of the
/// agent), looked up in [`XTABLES_DIRS`]: iptables opens them at run time,
/// so `ldd` does not list them.
const XTABLES_EXTENSIONS: &[&str] = &[
    "libxt_standard.so",
    "libxt_udp.so",
    "libxt_conntrack.so",
    "libxt_NFQUEUE.so",
];

/// Where iptables looks for its extensions (Debian's multiarch path first).
const XTABLES_DIRS: &[&str] = &[
    "/usr/lib/x86_64-linux-gnu/xtables",
    "/usr/lib/aarch64-linux-gnu/xtables",
    "/usr/lib/xtables",
];

/// Tools the agent no longer forks: the image check asserts that none of
/// these paths exists in the image.
const NOT_SHIPPED: &[&str] = &["/usr/sbin/ip", "/usr/bin/ip"];

/// Files from the build machine's /etc that the tools read, and the CA
/// bundle: the kube client's TLS stack refuses to start without system
/// roots even when the kubeconfig names its own CA.
const ETC_FILES: &[&str] = &["/etc/protocols", "/etc/services", "/etc/ssl/certs/ca-certificates.crt"];

/// Where the archive is written.
pub fn archive_path() -> PathBuf {
    root().join("target/image/npm-agent.tar")
}

/// The workspace version (the image tag).
pub fn version() -> Result<String> {
    let toml = std::fs::read_to_string(root().join("Cargo.toml"))?;
    workspace_key(&toml, "version").context("no version in [workspace.package]")
}

/// `key = "value"` of the root Cargo.toml's `[workspace.package]`.
fn workspace_key(toml: &str, key: &str) -> Option<String> {
    let section = toml.split("[workspace.package]").nth(1)?;
    let section = section.split("\n[").next()?;
    section.lines().find_map(|l| {
        let (k, v) = l.split_once('=')?;
        (k.trim() == key).then(|| v.trim().trim_matches('"').to_string())
    })
}

/// Where the kubectl plugin is left for operators (`kubectl npm` once it
/// is on `PATH`).
pub fn plugin_path() -> PathBuf {
    root().join("target/image/kubectl-npm")
}

/// The packages and binaries of the image's release build: `npm-agent`,
/// the kubectl plugin `kubectl-npm` and `npm-cni` (when the crate exists).
pub fn release_packages() -> Vec<&'static str> {
    let mut args = vec![
        "-p",
        "npm-agent",
        "--bin",
        "npm-agent",
        "-p",
        "kubectl-npm",
        "--bin",
        "kubectl-npm",
    ];
    if root().join("npm-cni/Cargo.toml").exists() {
        args.extend(["-p", "npm-cni", "--bin", "npm-cni"]);
    }
    args
}

/// The cargo arguments of the image's amd64 release build
/// ([`release_packages`], optimised, the stable toolchain).
pub fn release_build_args() -> Vec<&'static str> {
    let mut args = vec!["build", "--release"];
    args.extend(release_packages());
    args
}

/// An architecture of the image.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Arch {
    /// This machine's: stable toolchain, the host's tools and `ldd`.
    Amd64,
    /// Cross-built (`crate::arm64`): the Debian arm64 root's tools, its
    /// libraries resolved from `readelf` NEEDED entries.
    Arm64,
}

impl Arch {
    /// The OCI architecture name.
    pub fn oci(self) -> &'static str {
        match self {
            Arch::Amd64 => "amd64",
            Arch::Arm64 => "arm64",
        }
    }
}

/// The manifest list (OCI index) over both architectures in the local
/// containers storage (`podman manifest push --all` it to a registry).
pub const INDEX_REPOSITORY: &str = "localhost/npm-agent-multiarch";

/// Build the release binaries and the images of both architectures
/// (`arm64` false: amd64 alone), and the index over them; returns the
/// versioned tag of the amd64 image (`localhost/npm-agent:<version>`, this
/// machine's, the one the checks run in podman).
pub fn image(arm64: bool) -> Result<String> {
    crate::setup::check_image_prerequisites()?;
    crate::build_ebpf()?;
    // A no-op when `cargo xtask test` already ran it beside the conformance
    // runs (`release_build_args`).
    run(cargo().args(release_build_args()))?;
    std::fs::create_dir_all(root().join("target/image"))?;
    std::fs::copy(root().join("target/release/kubectl-npm"), plugin_path())
        .with_context(|| format!("copying the kubectl plugin to {}", plugin_path().display()))?;

    let version = version()?;
    let tag = format!("{REPOSITORY}:{version}");
    let arm_tag = format!("{REPOSITORY}:{version}-arm64");
    commit(&stage(Arch::Amd64, Path::new("/"))?, Arch::Amd64, &tag)?;
    run(Command::new("buildah").args([
        "tag",
        &tag,
        &format!("{REPOSITORY}:latest"),
        &format!("{REPOSITORY}:{version}-amd64"),
    ]))?;
    let archive = archive_path();
    let _ = std::fs::remove_file(&archive);
    if !arm64 {
        run(Command::new("buildah")
            .args(["push", &tag])
            .arg(format!("oci-archive:{}:{tag}", archive.display())))?;
        eprintln!(
            "xtask: image {tag} (and :latest; amd64 only), OCI archive {} ({:.1} MiB)",
            archive.display(),
            std::fs::metadata(&archive)?.len() as f64 / (1024.0 * 1024.0)
        );
        return Ok(tag);
    }
    crate::arm64::build()?;
    let sysroot = crate::arm64::debian_root()?;
    commit(&stage(Arch::Arm64, &sysroot)?, Arch::Arm64, &arm_tag)?;

    // The OCI index over both, in the local storage and as the archive.
    let index = format!("{INDEX_REPOSITORY}:{version}");
    let _ = Command::new("buildah").args(["manifest", "rm", &index]).output();
    run(Command::new("buildah").args(["manifest", "create", &index]))?;
    for (t, arch) in [(&tag, Arch::Amd64), (&arm_tag, Arch::Arm64)] {
        run(Command::new("buildah").args([
            "manifest",
            "add",
            "--os",
            "linux",
            "--arch",
            arch.oci(),
            &index,
            &format!("containers-storage:{t}"),
        ]))?;
    }
    run(Command::new("buildah")
        .args(["manifest", "push", "--all", &index])
        .arg(format!("oci-archive:{}:{tag}", archive.display())))?;
    let size = std::fs::metadata(&archive)?.len();
    eprintln!(
        "xtask: image {tag} (and :latest, :{version}-amd64), {arm_tag}, the index {index} over both; \
         OCI archive (the index) {} ({:.1} MiB)",
        archive.display(),
        size as f64 / (1024.0 * 1024.0)
    );
    eprintln!(
        "xtask: the kubectl plugin: {} (put it on PATH: `kubectl npm`)",
        plugin_path().display()
    );
    Ok(tag)
}

/// The files of `arch`'s image in `target/image/rootfs-<arch>`: `sysroot`
/// is where its tools and libraries come from (`/` for amd64, the Debian
/// arm64 root for arm64).
fn stage(arch: Arch, sysroot: &Path) -> Result<PathBuf> {
    let has_cni = root().join("npm-cni/Cargo.toml").exists();
    let staging = root().join(format!("target/image/rootfs-{}", arch.oci()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).with_context(|| format!("removing {}", staging.display()))?;
    }
    let release = match arch {
        Arch::Amd64 => root().join("target/release"),
        Arch::Arm64 => crate::arm64::release_dir(),
    };
    // (file on this machine, path in the image)
    let mut files: Vec<(PathBuf, PathBuf)> = vec![
        (release.join("npm-agent"), "/usr/bin/npm-agent".into()),
        (release.join("kubectl-npm"), "/usr/bin/kubectl-npm".into()),
        (ebpf_object(), "/usr/lib/npm/npm-ebpf.o".into()),
    ];
    if has_cni {
        files.push((release.join("npm-cni"), "/usr/bin/npm-cni".into()));
    }
    // In the sysroot: (path there, path in the image).
    let in_sysroot = |p: &Path| -> Result<PathBuf> {
        Ok(match arch {
            Arch::Amd64 => p.to_path_buf(),
            Arch::Arm64 => {
                let real = crate::arm64::resolve_in(sysroot, p)?;
                sysroot.join(real.strip_prefix("/").expect("absolute"))
            }
        })
    };
    for (name, default, _) in TOOLS {
        let path = match arch {
            Arch::Amd64 => which(name).unwrap_or_else(|| PathBuf::from(default)),
            Arch::Arm64 => PathBuf::from(default),
        };
        let src = in_sysroot(&path).with_context(|| format!("{name} for {}", arch.oci()))?;
        if !src.exists() {
            bail!(
                "{name} is not installed (expected at {}): run `cargo xtask setup`",
                src.display()
            );
        }
        files.push((src, path));
    }
    for f in ETC_FILES {
        // Text files: the build machine's serve both architectures.
        if Path::new(f).exists() {
            files.push((f.into(), f.into()));
        }
    }
    let xtables = XTABLES_DIRS
        .iter()
        .filter(|d| match arch {
            Arch::Amd64 => !d.contains("aarch64"),
            Arch::Arm64 => !d.contains("x86_64"),
        })
        .map(Path::new)
        .find(|d| in_sysroot(&d.join(XTABLES_EXTENSIONS[0])).is_ok_and(|p| p.exists()))
        .context("no xtables extensions directory (iptables' libxt_*.so): run `cargo xtask setup`")?;
    for e in XTABLES_EXTENSIONS {
        let p = xtables.join(e);
        let src = in_sysroot(&p).with_context(|| format!("{} is missing: run `cargo xtask setup`", p.display()))?;
        files.push((src, p));
    }
    // Shared libraries of every executable, and the dynamic loader.
    let mut libs = BTreeSet::new();
    for (src, _) in &files {
        if is_elf(src) && !src.ends_with("npm-ebpf.o") {
            match arch {
                Arch::Amd64 => {
                    for lib in shared_libraries(src)? {
                        let dest = loader_path(&lib);
                        libs.insert((lib, dest));
                    }
                }
                Arch::Arm64 => libs.extend(crate::arm64::shared_libraries(src, sysroot)?),
            }
        }
    }
    files.extend(libs);
    for (src, dest) in &files {
        let target = staging.join(dest.strip_prefix("/").unwrap_or(dest));
        std::fs::create_dir_all(target.parent().expect("absolute path"))?;
        let real = std::fs::canonicalize(src).with_context(|| format!("resolving {}", src.display()))?;
        std::fs::copy(&real, &target).with_context(|| format!("copying {} to {}", real.display(), target.display()))?;
    }
    // Debian's merged /usr, so that paths under /lib, /bin, ... resolve.
    for (link, to) in [
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("bin", "usr/bin"),
        ("sbin", "usr/sbin"),
    ] {
        let p = staging.join(link);
        if !p.exists() {
            std::fs::create_dir_all(staging.join(to))?;
            std::os::unix::fs::symlink(to, &p)?;
        }
    }
    std::fs::create_dir_all(staging.join("tmp"))?;
    std::fs::create_dir_all(staging.join("run/npm"))?;
    Ok(staging)
}

/// Commit `staging` as the image `tag` for `arch`.
fn commit(staging: &Path, arch: Arch, tag: &str) -> Result<()> {
    let version = version()?;
    let revision = crate::setup::output(Command::new("git").args(["-C"]).arg(root()).args(["rev-parse", "HEAD"]))
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "unknown".into());
    let toml = std::fs::read_to_string(root().join("Cargo.toml"))?;
    let source = workspace_key(&toml, "repository").unwrap_or_default();
    let license = workspace_key(&toml, "license").unwrap_or_default();

    let ctr = buildah_out(&["from", "scratch"])?;
    let result = (|| -> Result<()> {
        run(Command::new("buildah")
            .args(["copy", &ctr])
            .arg(format!("{}/", staging.display()))
            .arg("/"))?;
        run(Command::new("buildah").args([
            "config",
            "--os",
            "linux",
            "--arch",
            arch.oci(),
            "--entrypoint",
            r#"["/usr/bin/npm-agent"]"#,
            "--cmd",
            "",
            "--env",
            "PATH=/usr/bin:/usr/sbin",
            "--user",
            "0:0",
            "--label",
            &format!("org.opencontainers.image.version={version}"),
            "--label",
            &format!("org.opencontainers.image.revision={revision}"),
            "--label",
            &format!("org.opencontainers.image.source={source}"),
            "--label",
            &format!("org.opencontainers.image.licenses={license}"),
            "--label",
            "org.opencontainers.image.title=npm-agent",
            "--label",
            "org.opencontainers.image.description=npm: Kubernetes NetworkPolicy node agent (eBPF and nftables dataplanes)",
            &ctr,
        ]))?;
        run(Command::new("buildah").args(["commit", "--rm", "--format", "oci", &ctr, tag]))?;
        Ok(())
    })();
    if result.is_err() {
        let _ = Command::new("buildah").args(["rm", &ctr]).output();
    }
    result
}

fn buildah_out(args: &[&str]) -> Result<String> {
    let out = Command::new("buildah")
        .args(args)
        .output()
        .context("cannot start buildah")?;
    if !out.status.success() {
        bail!(
            "buildah {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn which(name: &str) -> Option<PathBuf> {
    crate::setup::output(Command::new("sh").args(["-c", &format!("command -v {name}")]))
        .map(|s| PathBuf::from(s.trim()))
        .filter(|p| p.is_absolute())
}

fn is_elf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && magic == *b"\x7fELF"
}

/// The shared libraries `ldd` resolves for `exe`, the dynamic loader included.
fn shared_libraries(exe: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(exe).output().context("cannot start ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        // A static executable: nothing to copy.
        if text.contains("not a dynamic executable") || String::from_utf8_lossy(&out.stderr).contains("not a dynamic") {
            return Ok(Vec::new());
        }
        bail!(
            "ldd {} failed: {}",
            exe.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    parse_ldd(&text).with_context(|| format!("ldd {}", exe.display()))
}

/// Paths of an `ldd` listing; fails on a library ldd could not find.
fn parse_ldd(text: &str) -> Result<Vec<PathBuf>> {
    let mut libs = Vec::new();
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty()) {
        if line.contains("not found") {
            bail!("missing library: {line}");
        }
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        match path {
            Some(p) if p.starts_with('/') => libs.push(PathBuf::from(p)),
            _ => {} // linux-vdso.so.1: provided by the kernel
        }
    }
    Ok(libs)
}

/// Where a library goes in the image: its directory as the loader sees it
/// after merged-/usr resolution, with the name ldd printed (which may be a
/// symlink on the build machine; the image gets the file itself).
fn loader_path(lib: &Path) -> PathBuf {
    let name = lib.file_name().expect("a library has a file name");
    let dir = lib.parent().unwrap_or(Path::new("/"));
    let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    dir.join(name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldd_listing_is_parsed() {
        let text = "\tlinux-vdso.so.1 (0x00007f3c49529000)\n\
                    \tlibnftables.so.1 => /lib/x86_64-linux-gnu/libnftables.so.1 (0x00007f3c49436000)\n\
                    \t/lib64/ld-linux-x86-64.so.2 (0x00007f3c4952b000)\n";
        let libs = parse_ldd(text).unwrap();
        assert_eq!(
            libs,
            vec![
                PathBuf::from("/lib/x86_64-linux-gnu/libnftables.so.1"),
                PathBuf::from("/lib64/ld-linux-x86-64.so.2")
            ]
        );
        assert!(parse_ldd("\tlibfoo.so.1 => not found\n").is_err());
    }

    #[test]
    fn missing_entrypoint_errors_are_recognised() {
        // As podman printed it on this machine for a scratch image.
        let runc = "podman run failed (exit status: 127): Error: runc: runc create failed: unable to start container process: exec: \"/usr/sbin/ip\": stat /usr/sbin/ip: no such file or directory: OCI runtime attempted to invoke a command that was not found";
        assert!(missing_executable(runc, "/usr/sbin/ip"));
        assert!(!missing_executable(runc, "/usr/bin/ip"));
        let no_image = "podman run failed (exit status: 125): Error: localhost/npm-agent:0.1.0: image not known";
        assert!(!missing_executable(no_image, "/usr/sbin/ip"));
    }

    #[test]
    fn workspace_keys_are_read() {
        let toml = "[workspace]\nmembers = []\n\n[workspace.package]\nversion = \"1.2.3\"\nrepository = \"https://x\"\n\n[workspace.dependencies]\nversion = \"9\"\n";
        assert_eq!(workspace_key(toml, "version").as_deref(), Some("1.2.3"));
        assert_eq!(workspace_key(toml, "repository").as_deref(), Some("https://x"));
    }
}
