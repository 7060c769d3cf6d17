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

/// podman's options on this machine: crun rejects the hybrid cgroup layout,
/// and rlimits cannot be raised above the session's.
const PODMAN_RUN: &[&str] = &[
    "run",
    "--rm",
    "--runtime",
    "runc",
    "--ulimit",
    "nofile=4096:4096",
    "--ulimit",
    "nproc=4096:4096",
];

/// Prefix of the containers the image checks start (removed afterwards,
/// and before, when a crashed run left them).
const CONTAINER_PREFIX: &str = "npm-agent-xtask-";

/// The image checks of `cargo xtask test`: the image prints its version,
/// accepts the arguments the chart renders, and runs as the agent of the
/// netns cluster with exactly the chart's capabilities and the DNS
/// learning on (the conformance smoke cases, `default-deny*`, pass with
/// it). Prints `image: N passed, M failed`.
pub fn check(tag: &str, arm64: bool) -> Result<()> {
    remove_leftover_containers();
    let version = version()?;
    let mut passed = 0;
    let mut failed = Vec::new();
    let mut record = |name: &str, res: Result<()>| match res {
        Ok(()) => {
            eprintln!("xtask: image check {name}: ok");
            passed += 1;
        }
        Err(e) => {
            eprintln!("xtask: image check {name}: FAILED: {e:#}");
            failed.push(name.to_string());
        }
    };
    record("version", check_version(tag, &version));
    if arm64 {
        record("arm64", check_arm64(&version));
    }
    record("tools", check_tools(tag));
    record("chart-arguments", check_chart_arguments(tag));
    record("conformance-smoke", check_conformance_smoke(tag));
    remove_leftover_containers();
    println!("image: {passed} passed, {} failed", failed.len());
    if !failed.is_empty() {
        bail!("image checks failed: {}", failed.join(", "));
    }
    Ok(())
}

fn podman(args: &[&str]) -> Result<String> {
    let out = Command::new("podman")
        .args(args)
        .output()
        .context("cannot start podman")?;
    if !out.status.success() {
        bail!(
            "podman {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn check_version(tag: &str, version: &str) -> Result<()> {
    let mut args = PODMAN_RUN.to_vec();
    args.extend([tag, "--version"]);
    let out = podman(&args)?;
    let want = format!("npm-agent {version}");
    if out.trim() != want {
        bail!("`--version` printed {:?}, expected {want:?}", out.trim());
    }
    // The kubectl plugin runs in the image too (its libraries resolve).
    let mut args = PODMAN_RUN.to_vec();
    args.extend(["--entrypoint", "/usr/bin/kubectl-npm", tag, "--version"]);
    let out = podman(&args)?;
    let want = format!("kubectl-npm {version}");
    if out.trim() != want {
        bail!("`kubectl-npm --version` printed {:?}, expected {want:?}", out.trim());
    }
    Ok(())
}

/// The arm64 image, mounted (`buildah mount`), its executables run under
/// qemu-user with the image as their root (`qemu-aarch64-static -L`, so
/// the loader and every library come from the image: this machine has no
/// arm64 libraries outside the Debian arm64 root): the agent's and the
/// plugin's `--version`, and the image's loader resolving every library
/// of each tool of [`TOOLS`] and each xtables extension. Also checks the
/// agent is an AArch64 executable and the index lists both architectures.
fn check_arm64(version: &str) -> Result<()> {
    let tag = format!("{REPOSITORY}:{version}-arm64");
    let ctr = buildah_out(&["from", "--pull=never", "--arch", "arm64", &tag])?;
    let res = (|| -> Result<()> {
        let mnt = PathBuf::from(buildah_out(&["mount", &ctr])?);
        let header = crate::setup::output(Command::new("readelf").arg("-h").arg(mnt.join("usr/bin/npm-agent")))
            .context("readelf -h on the arm64 agent")?;
        if !header.lines().any(|l| l.contains("Machine:") && l.contains("AArch64")) {
            bail!("the arm64 image's agent is not an AArch64 executable");
        }
        let qemu = |exe: &str, args: &[&str]| -> Result<String> {
            let out = Command::new("qemu-aarch64-static")
                .arg("-L")
                .arg(&mnt)
                .arg(mnt.join(exe.trim_start_matches('/')))
                .args(args)
                .output()
                .context("cannot start qemu-aarch64-static (package qemu-user-static)")?;
            if !out.status.success() {
                bail!(
                    "{exe} {args:?} under qemu-aarch64 failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        for (exe, name) in [
            ("/usr/bin/npm-agent", "npm-agent"),
            ("/usr/bin/kubectl-npm", "kubectl-npm"),
        ] {
            let out = qemu(exe, &["--version"])?;
            let want = format!("{name} {version}");
            if out != want {
                bail!("arm64 `{name} --version` printed {out:?}, expected {want:?}");
            }
        }
        // nft and iptables open a netfilter netlink socket before anything
        // else, which qemu-user does not emulate ("Protocol not
        // supported"): the image's own loader lists what each needs
        // instead, failing (127) on a library the image lacks.
        let loader = "/lib/ld-linux-aarch64.so.1";
        let mut listed: Vec<String> = TOOLS.iter().map(|(_, path, _)| path.to_string()).collect();
        listed.extend(
            XTABLES_DIRS
                .iter()
                .filter(|d| d.contains("aarch64"))
                .flat_map(|d| XTABLES_EXTENSIONS.iter().map(move |e| format!("{d}/{e}"))),
        );
        for path in &listed {
            let out = qemu(loader, &["--list", path]).with_context(|| format!("arm64 {path} in the image"))?;
            if out.contains("not found") || !out.contains("libc.so.6") {
                bail!("arm64 {path}: the image's loader listed {out:?}");
            }
        }
        Ok(())
    })();
    let _ = Command::new("buildah").args(["umount", &ctr]).output();
    let _ = Command::new("buildah").args(["rm", &ctr]).output();
    res?;
    let index = buildah_out(&["manifest", "inspect", &format!("{INDEX_REPOSITORY}:{version}")])?;
    let index: serde_json::Value = serde_json::from_str(&index).context("the index's JSON")?;
    let mut arches: Vec<&str> = index["manifests"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter_map(|m| m["platform"]["architecture"].as_str())
                .collect()
        })
        .unwrap_or_default();
    arches.sort_unstable();
    if arches != ["amd64", "arm64"] {
        bail!("the index lists {arches:?}, expected amd64 and arm64");
    }
    Ok(())
}

/// Each tool of [`TOOLS`] runs in the image (its libraries resolve); each
/// path of [`NOT_SHIPPED`] is absent (starting it fails for the missing file).
fn check_tools(tag: &str) -> Result<()> {
    for (name, default, args) in TOOLS {
        let path = which(name).unwrap_or_else(|| PathBuf::from(default));
        let path = path.to_string_lossy();
        let mut run = PODMAN_RUN.to_vec();
        run.extend(["--entrypoint", &path, tag]);
        run.extend(args.iter());
        podman(&run).with_context(|| format!("{name} in the image"))?;
    }
    for path in NOT_SHIPPED {
        let mut run = PODMAN_RUN.to_vec();
        run.extend(["--entrypoint", path, tag]);
        match podman(&run) {
            Ok(out) => bail!("{path} exists in the image and ran: {}", out.trim()),
            Err(e) if missing_executable(&format!("{e:#}"), path) => {}
            Err(e) => bail!("{path}: starting it failed, but not for a missing file: {e:#}"),
        }
    }
    Ok(())
}

/// Whether a container runtime's error says that the entrypoint `path`
/// does not exist (runc: `stat <path>: no such file or directory`; crun:
/// `executable file <path> not found ...: No such file or directory`).
fn missing_executable(err: &str, path: &str) -> bool {
    err.contains(path) && err.to_ascii_lowercase().contains("no such file or directory")
}

/// `helm template` with `--set` values, as YAML documents.
fn helm_template(set: &[&str]) -> Result<Vec<serde_yaml::Value>> {
    let mut cmd = Command::new(helm());
    cmd.args(["template", "npm"])
        .arg(root().join("charts/npm-agent"))
        .args(["--namespace", "kube-system"]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().context("cannot start helm")?;
    if !out.status.success() {
        bail!("helm template failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(serde_yaml::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect())
}

fn helm() -> PathBuf {
    let local = Path::new("/usr/local/bin/helm");
    if local.exists() {
        local.to_path_buf()
    } else {
        PathBuf::from("helm")
    }
}

/// The agent container of the rendered DaemonSet.
fn agent_container(docs: &[serde_yaml::Value]) -> Result<serde_yaml::Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some("DaemonSet"))
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .find(|c| c["name"].as_str() == Some("agent"))
        .context("the rendered chart has no DaemonSet container named agent")
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// The rendered DaemonSet's command and arguments are accepted by the
/// image's own binary (`run ... --dry-run` validates and exits).
fn check_chart_arguments(tag: &str) -> Result<()> {
    for set in [
        &[][..],
        &["privileged=false"][..],
        &["dataplane=nftables", "cniPreset=calico"][..],
        &["dns.servers={10.96.0.10,fd00:96::a}"][..],
    ] {
        let agent = agent_container(&helm_template(set)?)?;
        let command = strings(&agent["command"]);
        let entry = command.first().context("the agent container has no command")?.clone();
        let mut args: Vec<String> = PODMAN_RUN.iter().map(|s| s.to_string()).collect();
        // NODE_NAME comes from the downward API in the DaemonSet.
        args.extend(["-e".to_string(), "NODE_NAME=node-a".to_string()]);
        args.extend(["--entrypoint".to_string(), entry, tag.to_string()]);
        args.extend(command.iter().skip(1).cloned());
        args.extend(strings(&agent["args"]));
        args.push("--dry-run".into());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        podman(&refs).with_context(|| format!("chart values {set:?}"))?;
    }
    Ok(())
}

/// The capabilities the chart gives an unprivileged agent.
fn chart_capabilities() -> Result<Vec<String>> {
    let agent = agent_container(&helm_template(&["privileged=false"])?)?;
    let caps = strings(&agent["securityContext"]["capabilities"]["add"]);
    if caps.is_empty() {
        bail!("the chart's unprivileged agent has no capabilities listed");
    }
    Ok(caps)
}

/// The conformance smoke cases with the image as the agent, run the way
/// the chart runs it with `privileged=false`: host network, bpffs mounted
/// from the host, exactly the chart's capabilities.
fn check_conformance_smoke(tag: &str) -> Result<()> {
    let caps = chart_capabilities()?;
    let wrapper = root().join("target/image/npm-agent-podman");
    let script = format!(
        "#!/bin/sh\n\
         # The agent image as the chart runs it (written by `cargo xtask image`).\n\
         exec podman {run} --name {prefix}$$ --network host --cap-drop all --cap-add {caps} \\\n  \
         --security-opt seccomp=unconfined --security-opt apparmor=unconfined \\\n  \
         --mount type=bind,src=/sys/fs/bpf,dst=/sys/fs/bpf,bind-propagation=rslave \\\n  \
         -v /tmp:/tmp -e NODE_NAME -e RUST_LOG {tag} \"$@\"\n",
        run = PODMAN_RUN.join(" "),
        prefix = CONTAINER_PREFIX,
        caps = caps.join(","),
    );
    std::fs::write(&wrapper, script)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    // With the DNS learning on: the image's iptables must install its
    // NFQUEUE rules from inside the container (the agent refuses to start
    // otherwise). 198.18.3.3 is the model's z/c; the queue is this check's.
    let queue = format!("--dns-queue={}", 40000 + std::process::id() % 20000);
    let state = format!("/tmp/npm-image-check-dns-{}.json", std::process::id());
    let result = crate::conformance_with(&[
        "--dataplane".into(),
        "ebpf".into(),
        "--filter".into(),
        "default-deny".into(),
        "--agent-bin".into(),
        wrapper.display().to_string(),
        "--agent-arg=--dns-server=198.18.3.3".into(),
        format!("--agent-arg={queue}"),
        format!("--agent-arg=--dns-state-file={state}"),
    ]);
    let _ = std::fs::remove_file(&state);
    result
}

fn remove_leftover_containers() {
    let Ok(out) = podman(&["ps", "-a", "--format", "{{.Names}}"]) else {
        return;
    };
    for name in out.lines().filter(|n| n.starts_with(CONTAINER_PREFIX)) {
        let _ = podman(&["rm", "-f", name]);
    }
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
