//! `cargo xtask`: npm's build, setup, test, conformance and benchmark driver.
//!
//! - `cargo xtask setup`: install everything a fresh machine lacks (idempotent).
//! - `cargo xtask build-ebpf`: build the BPF object with the nightly toolchain.
//! - `cargo xtask build --arch amd64|arm64`: the release binaries of the
//!   image (arm64: cross-built, `arm64.rs`).
//! - `cargo xtask lint`: rustfmt, dependency policy, clippy (workspace and
//!   npm-ebpf), docs.
//! - `cargo xtask deps`: the dependency policy (`xtask/deps-policy.yaml`).
//! - `cargo xtask test`: setup, lint, build, and run the whole suite (CI runs this).
//! - `cargo xtask demo`: the local demo cluster (netns pods, test API server, agent).
//! - `cargo xtask conformance [...]`: the conformance catalogue on real netns pods
//!   (`--nodes N --cni veth|ptp|bridge --kube-proxy none|iptables|nftables
//!   --destination pod|service`: several node netns, each with its agent).
//! - `cargo xtask bench datapath|compile|agent|cnp|traffic|dns|propagation|enforcement`: the
//!   benchmarks (`propagation` runs the three-node cluster: one multi-node run at a time;
//!   `enforcement -- --dataplane ebpf|nftables`: latency seen by probes between netns pods).
//! - `cargo xtask fuzz [--seed N] [--cases N | --duration SECS] [--attach tcx|tc]`:
//!   the packet fuzzer (random and malformed frames through the real eBPF
//!   programs, judged by `docs/packet-spec.md`; ends with one JSON line).
//! - `cargo xtask chaos --dataplane ebpf|nftables [--duration SECS] [--seed N] [--inject]`:
//!   the chaos soak on the two-node cluster (seeded changes and faults,
//!   continuous probes, an oracle; ends with one JSON line, `"bench":"chaos"`).
//! - `cargo xtask image`: the agent's OCI images, amd64 and arm64, and the
//!   OCI index over both (buildah, no daemon).
//! - `cargo xtask vm run --kernel debian-6.1 -- CMD`, `cargo xtask vm matrix`:
//!   Debian's kernels under qemu (`vm.rs`).

mod arm64;
mod deps;
mod fuzz;
mod image;
mod setup;
mod vm;

use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "xtask", about = "npm build, setup, test and benchmark driver")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Install what a fresh machine lacks: packages, rust-src, bpf-linker, helm.
    Setup,
    /// Build the eBPF object (target/bpfel-unknown-none/release/npm-ebpf).
    BuildEbpf,
    /// Release build of npm-agent, npm-cni and kubectl-npm for an
    /// architecture: `amd64` (stable, target/release) or `arm64` (nightly
    /// with `-Z build-std`, Debian's aarch64 cross gcc,
    /// target/aarch64-unknown-linux-gnu/release).
    Build {
        /// amd64 or arm64.
        #[arg(long, default_value = "amd64")]
        arch: String,
    },
    /// Setup, lint, build everything and run the whole test suite.
    Test {
        /// Skip `setup` (the machine is known to be ready).
        #[arg(long)]
        no_setup: bool,
    },
    /// rustfmt --check, the dependency policy, clippy -D warnings (the
    /// workspace and npm-ebpf) and cargo doc with warnings denied: the
    /// suite's first stage.
    Lint,
    /// The dependency policy (xtask/deps-policy.yaml: licences, sources,
    /// duplicate versions) over `cargo metadata`; part of `lint`.
    Deps,
    /// Run the conformance catalogue (arguments go to npm-conformance).
    Conformance {
        /// Arguments for npm-conformance, e.g. `--dataplane ebpf --filter ID`,
        /// or `--nodes 3 --cni ptp --kube-proxy iptables --destination service`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The chaos soak: a seeded schedule of changes and faults on the
    /// two-node cluster, continuous probes judged by an oracle; ends with
    /// one JSON line (arguments go to npm-chaos: `--dataplane ebpf|nftables
    /// --duration SECS --seed N --inject`).
    Chaos {
        /// Arguments for npm-chaos.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The local demo: test API server, 3x3 netns cluster and the agent.
    Demo {
        /// Arguments for the demo, e.g. `--dataplane nftables`.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Build the agent's OCI images with buildah: amd64
    /// (`localhost/npm-agent:<version>` and :latest), arm64
    /// (`:<version>-arm64`), the index over both
    /// (`localhost/npm-agent-multiarch:<version>`), and
    /// target/image/npm-agent.tar (the index, as an OCI archive).
    Image {
        /// Then run the image checks that `cargo xtask test` runs (and the
        /// arm64 one).
        #[arg(long)]
        check: bool,
        /// The amd64 image alone (no cross build, no index).
        #[arg(long)]
        amd64_only: bool,
    },
    /// Benchmarks: datapath, compile, agent, cnp, traffic, dns, propagation,
    /// enforcement or all.
    Bench {
        /// Which benchmark.
        which: String,
        /// Extra arguments for the benchmark program.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// The packet fuzzer: random and malformed frames through the real eBPF
    /// programs (BPF_PROG_TEST_RUN) against random compiled states, judged
    /// by docs/packet-spec.md; ends with one JSON line. Needs root.
    Fuzz(fuzz::FuzzArgs),
    /// Debian kernels under qemu: `vm run --kernel debian-6.1 -- CMD`,
    /// `vm matrix` (see xtask/src/vm.rs).
    Vm {
        #[command(subcommand)]
        cmd: vm::VmCmd,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Setup => setup::setup(),
        Cmd::BuildEbpf => build_ebpf(),
        Cmd::Build { arch } => match arch.as_str() {
            "amd64" | "x86_64" => run(cargo().args(image::release_build_args())),
            "arm64" | "aarch64" => arm64::build(),
            other => Err(anyhow::anyhow!("unknown architecture {other:?}: amd64 or arm64")),
        },
        Cmd::Test { no_setup } => test(no_setup),
        Cmd::Lint => lint(),
        Cmd::Deps => deps::deps(),
        Cmd::Conformance { args } => conformance(&args),
        Cmd::Chaos { args } => chaos(&args),
        Cmd::Demo { args } => demo(&args),
        Cmd::Bench { which, args } => bench(&which, &args),
        Cmd::Image { check, amd64_only } => {
            image::image(!amd64_only).and_then(|tag| if check { image::check(&tag, !amd64_only) } else { Ok(()) })
        }
        Cmd::Fuzz(a) => fuzz::fuzz(&a),
        Cmd::Vm { cmd } => vm::main(cmd),
    };
    match res {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The workspace root.
pub fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask lives in the workspace")
        .to_path_buf()
}

/// Path of the built BPF object.
pub fn ebpf_object() -> PathBuf {
    root().join("target/bpfel-unknown-none/release/npm-ebpf")
}

/// Run a command in the workspace root, failing with its name on error.
pub fn run(cmd: &mut Command) -> Result<()> {
    let shown = format!("{cmd:?}");
    eprintln!("xtask: $ {shown}");
    let status = cmd
        .current_dir(root())
        .status()
        .with_context(|| format!("cannot start {shown}"))?;
    if !status.success() {
        bail!("{shown} failed with {status}");
    }
    Ok(())
}

pub(crate) fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// `rustup run nightly cargo <subcommand>` on `npm-ebpf` for its target
/// (`--release`, `bpfel-unknown-none`, `core` built from rust-src), without
/// the stable toolchain's variables that `cargo xtask` inherits.
fn ebpf_cargo(subcommand: &str) -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", subcommand])
        .args(["--package", "npm-ebpf", "--release"])
        .args(["--target", "bpfel-unknown-none", "-Z", "build-std=core"]);
    cmd.env_remove("RUSTFLAGS");
    cmd.env_remove("RUSTC");
    cmd.env_remove("RUSTC_WRAPPER");
    cmd.env_remove("CARGO");
    cmd
}

pub(crate) fn build_ebpf() -> Result<()> {
    setup::check_ebpf_prerequisites()?;
    let mut cmd = ebpf_cargo("build");
    // BTF for the object; the linker is bpf-linker (found on PATH by rustc).
    cmd.env(
        "CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS",
        "-C debuginfo=2 -C link-arg=--btf",
    );
    run(&mut cmd)?;
    let obj = ebpf_object();
    if !obj.exists() {
        bail!("the BPF build succeeded but {} is missing", obj.display());
    }
    eprintln!("xtask: BPF object at {}", obj.display());
    Ok(())
}

/// The first stage of the suite, each step stopping at its first failure:
/// rustfmt, the dependency policy, clippy with warnings denied on the
/// workspace and on `npm-ebpf` (nightly, its BPF target), and the docs with
/// warnings denied.
fn lint() -> Result<()> {
    let started = Instant::now();
    let step = |name: &str, cmd: &mut Command| -> Result<()> {
        let t = Instant::now();
        run(cmd).with_context(|| format!("lint: {name}"))?;
        eprintln!("xtask: lint: {name} passed in {:.0} s", t.elapsed().as_secs_f64());
        Ok(())
    };
    step("rustfmt", cargo().args(["fmt", "--all", "--", "--check"]))?;
    deps::deps().context("lint: deps")?;
    step(
        "clippy",
        cargo().args([
            "clippy",
            "--workspace",
            "--exclude",
            "npm-ebpf",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ]),
    )?;
    // Clippy does not link: no bpf-linker needed, only nightly with
    // rust-src and clippy.
    setup::check_ebpf_toolchain(&["rust-src", "clippy"])?;
    step("clippy npm-ebpf", ebpf_cargo("clippy").args(["--", "-D", "warnings"]))?;
    step(
        "doc",
        cargo()
            .args(["doc", "--workspace", "--exclude", "npm-ebpf", "--no-deps"])
            .env("RUSTDOCFLAGS", "-D warnings"),
    )?;
    eprintln!("xtask: lint passed in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// The whole suite, as CI runs it.
/// The `cargo xtask vm matrix` row CI runs (the others run on demand).
const CI_VM_ROW: &str = "debian-6.1";

/// A copy of this xtask binary that later builds cannot replace.
///
/// `cargo test --workspace` relinks `target/debug/xtask` with the
/// workspace's unified features, which unlinks the file this process was
/// started from: `current_exe()` then names `xtask (deleted)`. The running
/// image stays readable through `/proc/self/exe`, so it is copied out
/// before a background stage runs it.
fn pinned_self() -> Result<std::path::PathBuf> {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = root().join("target/tmp");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    // Copies left by earlier runs (one per run, named by its pid).
    for old in std::fs::read_dir(&dir)?.flatten() {
        if old.file_name().to_string_lossy().starts_with("xtask-self-") {
            let _ = std::fs::remove_file(old.path());
        }
    }
    let dest = dir.join(format!("xtask-self-{}", std::process::id()));
    std::fs::copy("/proc/self/exe", &dest).with_context(|| format!("copying /proc/self/exe to {}", dest.display()))?;
    std::fs::set_permissions(&dest, std::fs::Permissions::from_mode(0o755))
        .with_context(|| format!("making {} executable", dest.display()))?;
    Ok(dest)
}

fn test(no_setup: bool) -> Result<()> {
    let started = Instant::now();
    if !no_setup {
        setup::setup()?;
    }
    // Fast first: a formatting, clippy or doc failure stops the run in
    // minutes, before the BPF build, the kernel tests and the conformance
    // runs.
    lint()?;
    build_ebpf()?;
    // Binaries the end-to-end tests start (agent, test API server, conformance runner).
    run(cargo().args(["build", "--workspace", "--exclude", "npm-ebpf", "--bins"]))?;
    // Three tests at a time on two cores: most kernel and live-agent tests
    // wait on packets, timers and child processes, not on the CPU. Tests
    // that must not overlap take their binary's lock (tc attach vs auto
    // mode, multi-node clusters a host-wide one).
    run(cargo()
        .args([
            "test",
            "--workspace",
            "--exclude",
            "npm-ebpf",
            "--no-fail-fast",
            "--",
            "--test-threads",
            "3",
        ])
        .env("NPM_EBPF_OBJECT", ebpf_object()))?;
    // The CI matrix (the whole catalogue, probed over IPv4; `--ipv6` runs are
    // manual, see the notes), chosen
    // for the 40-minute budget:
    // - without a kernel (`simulate`);
    // - eBPF with the pods' programs forced to tc clsact filters (the mode
    //   of kernels before 6.6; `node_exit` uses tcx where it exists), three
    //   nodes, pods wired by the reference `bridge` plugin chained with
    //   npm-cni, probed through kube-proxy (nftables mode) ClusterIPs:
    //   Service egress decided for the chosen backend;
    // - nftables, three nodes, `ptp` pods, kube-proxy in iptables mode,
    //   probed through ClusterIPs.
    // The one-node runs (`cargo xtask conformance --dataplane
    // ebpf|nftables`, tcx by default) are covered by these and by the kernel
    // tests, which run every attach test in both modes.
    // The live runs wait 500 ms for a probe (default 1 s): a denied probe is
    // one that got no answer in that time, and an allowed one answers in
    // milliseconds here (a slow one is retried until the deadline, so the
    // shorter wait cannot fail a case). Every step waits it out twice (its
    // round and the confirmation): 540 s -> 385 s per three-node run.
    // The image's release build (about 5 minutes of both cores) runs at the
    // lowest CPU priority while the conformance runs, which mostly wait on
    // probes, use the debug binaries built above: they share no cargo
    // lock (`target/release` vs `target/debug`).
    let release = Background::start(cargo().args(image::release_build_args()), "release-build")?;
    // The VM row: Debian 12's 6.1 kernel under qemu (TCG, one core): no
    // tcx (tc clsact filters), its own verifier (the full datapath of
    // layout 8 loads; the reduced one where it would not), real IPIP and
    // WireGuard, and the Service conformance subset (`--ci`:
    // `default-deny*` on eBPF through ClusterIPs on two nodes; the one-node
    // and nftables steps run on demand: with them the row took 22 minutes
    // beside the foreground runs, about 7 more than those); its checks are
    // listed in `xtask/src/vm/matrix.rs`. Beside the conformance runs, as
    // the release build; everything it starts was built above.
    let vm_row = Background::start(
        Command::new(pinned_self()?).args(["vm", "matrix", "--ci", "--row", CI_VM_ROW]),
        "vm-matrix",
    )?;
    for args in [
        &["--dataplane", "simulate"][..],
        &[
            "--dataplane",
            "ebpf",
            "--attach",
            "tc",
            "--nodes",
            "3",
            "--cni",
            "bridge",
            "--kube-proxy",
            "nftables",
            "--destination",
            "service",
            "--probe-timeout-ms",
            "500",
        ][..],
        &[
            "--dataplane",
            "nftables",
            "--nodes",
            "3",
            "--cni",
            "ptp",
            "--kube-proxy",
            "iptables",
            "--destination",
            "service",
            "--probe-timeout-ms",
            "500",
        ][..],
    ] {
        // The binaries were built above (`--workspace --bins`).
        conformance_with(&args.iter().map(|s| s.to_string()).collect::<Vec<_>>())?;
    }
    release.finish()?;
    let vm_log = vm_row.finish()?;
    // The row's verdicts and figures (checks, seconds, verified
    // instructions) in the suite's output.
    for l in vm_log
        .lines()
        .filter(|l| l.starts_with(CI_VM_ROW) || l.contains(" passed, "))
    {
        eprintln!("xtask: vm: {l}");
    }
    // The shipped artefact: the OCI image, run as the chart runs it (its
    // release build already ran beside the conformance runs).
    // amd64 alone: the arm64 cross build (nightly `-Z build-std`, std and
    // every dependency from source) does not fit the suite's budget on two
    // cores; `cargo xtask image` builds both.
    let tag = image::image(false)?;
    image::check(&tag, false)?;
    eprintln!("xtask: whole suite passed in {:.0} s", started.elapsed().as_secs_f64());
    Ok(())
}

/// A command run beside the rest of the suite at the lowest CPU priority,
/// its output kept in `target/xtask-<name>.log` (printed if it fails).
struct Background {
    child: std::process::Child,
    shown: String,
    log: PathBuf,
}

impl Background {
    fn start(cmd: &mut Command, name: &str) -> Result<Self> {
        let log = root().join(format!("target/xtask-{name}.log"));
        let out = std::fs::File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let mut nice = Command::new("nice");
        nice.args(["-n", "19"]).arg(cmd.get_program()).args(cmd.get_args());
        for (k, v) in cmd.get_envs() {
            match v {
                Some(v) => nice.env(k, v),
                None => nice.env_remove(k),
            };
        }
        let shown = format!("{nice:?}");
        eprintln!("xtask: $ {shown} > {} (in the background)", log.display());
        let child = nice
            .current_dir(root())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("cannot start {shown}"))?;
        Ok(Self { child, shown, log })
    }

    /// Waits for it; its log is printed when it failed, and returned when
    /// it succeeded.
    fn finish(mut self) -> Result<String> {
        let status = self
            .child
            .wait()
            .with_context(|| format!("waiting for {}", self.shown))?;
        if !status.success() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            eprintln!("{log}");
            bail!("{} failed with {status}", self.shown);
        }
        eprintln!("xtask: background {} done", self.shown);
        Ok(std::fs::read_to_string(&self.log).unwrap_or_default())
    }
}

impl Drop for Background {
    /// A suite that stops early (a failed run) does not leave the build
    /// running.
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `cargo build --bin B` of each of `bins` (the dev profile).
pub(crate) fn build_bins(bins: &[&str]) -> Result<()> {
    let mut c = cargo();
    c.arg("build");
    for b in bins {
        c.args(["--bin", b]);
    }
    run(&mut c)
}

fn conformance(args: &[String]) -> Result<()> {
    let simulate = args.windows(2).any(|w| w[0] == "--dataplane" && w[1] == "simulate");
    if !simulate && !ebpf_object().exists() {
        build_ebpf()?;
    }
    // npm-cni: the CNI chain of `--cni ptp|bridge` calls it on each node.
    build_bins(&["npm-agent", "npm-cni", "npm-conformance"])?;
    conformance_with(args)
}

/// The chaos soak (`npm-chaos`) on freshly built binaries.
fn chaos(args: &[String]) -> Result<()> {
    if !ebpf_object().exists() {
        build_ebpf()?;
    }
    build_bins(&["npm-agent", "npm-cni", "npm-chaos"])?;
    let mut cmd = Command::new(root().join("target/debug/npm-chaos"));
    cmd.arg("--agent-bin")
        .arg(root().join("target/debug/npm-agent"))
        .arg("--npm-cni-bin")
        .arg(root().join("target/debug/npm-cni"))
        .args(args)
        .env("NPM_EBPF_OBJECT", ebpf_object());
    run(&mut cmd)
}

/// The conformance runner on built binaries; `args` may name another
/// `--agent-bin` (the image checks run the agent from its image).
pub fn conformance_with(args: &[String]) -> Result<()> {
    let args = agent_flags(args);
    let args = &args[..];
    let mut cmd = Command::new(root().join("target/debug/npm-conformance"));
    if !args.iter().any(|a| a == "--agent-bin" || a.starts_with("--agent-bin=")) {
        cmd.arg("--agent-bin").arg(root().join("target/debug/npm-agent"));
    }
    if !args.iter().any(|a| a == "--cases") {
        cmd.arg("--cases").arg(root().join("tests/conformance"));
    }
    if !args
        .iter()
        .any(|a| a == "--npm-cni-bin" || a.starts_with("--npm-cni-bin="))
    {
        cmd.arg("--npm-cni-bin").arg(root().join("target/debug/npm-cni"));
    }
    cmd.args(args).env("NPM_EBPF_OBJECT", ebpf_object());
    run(&mut cmd)
}

/// `--attach MODE` (or `--attach=MODE`) is the agent's flag: passed on to
/// it as `--agent-arg=--attach=MODE`; every other argument is the runner's.
fn agent_flags(args: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "--attach" {
            if let Some(mode) = it.next() {
                out.push(format!("--agent-arg=--attach={mode}"));
            }
        } else if let Some(mode) = a.strip_prefix("--attach=") {
            out.push(format!("--agent-arg=--attach={mode}"));
        } else {
            out.push(a.clone());
        }
    }
    out
}

fn demo(args: &[String]) -> Result<()> {
    setup::setup()?;
    build_ebpf()?;
    // kubectl-npm: the demo's kubeconfig works with `kubectl npm`.
    build_bins(&["npm-agent", "npm-cni", "npm-demo", "kubectl-npm"])?;
    let mut cmd = Command::new(root().join("target/debug/npm-demo"));
    cmd.arg("--agent-bin")
        .arg(root().join("target/debug/npm-agent"))
        .arg("--npm-cni-bin")
        .arg(root().join("target/debug/npm-cni"))
        .arg("--examples")
        .arg(root().join("examples"))
        .args(args)
        .env("NPM_EBPF_OBJECT", ebpf_object());
    run(&mut cmd)
}

fn bench(which: &str, args: &[String]) -> Result<()> {
    let (package, example) = match which {
        "datapath" => {
            build_ebpf()?;
            ("npm-dataplane", "bench_datapath")
        }
        "compile" => ("npm-policy", "bench_compile"),
        "agent" => {
            build_ebpf()?;
            ("npm-agent", "bench_agent")
        }
        // 1,000 CNPs: API write -> NPM_TIERS and NPM_FOLD (not in `all`).
        "cnp" => {
            build_ebpf()?;
            ("npm-agent", "bench_cnp")
        }
        "traffic" => {
            build_ebpf()?;
            ("npm-dataplane", "bench_traffic")
        }
        // DNS reply latency through the learner (root: netns, iptables).
        "dns" => ("npm-agent", "bench_dns"),
        // Multi-node (fixed fabric addresses): not part of `all`.
        "propagation" => return bench_propagation(args),
        // Probes between netns pods on one node (not in `all`).
        "enforcement" => return bench_enforcement(args),
        "all" => {
            for w in ["compile", "datapath", "agent", "traffic"] {
                bench(w, args)?;
            }
            return Ok(());
        }
        other => {
            bail!("unknown benchmark {other:?}: use datapath, compile, agent, cnp, traffic, dns, propagation, enforcement or all")
        }
    };
    run(cargo()
        .args(["run", "--release", "--package", package, "--example", example, "--"])
        .args(args)
        .env("NPM_EBPF_OBJECT", ebpf_object()))
}

/// `bench enforcement`: policy and pod enforcement latency seen by probes
/// between netns pods, and npm-cni's hold of CNI ADD
/// (`npm-bench-enforcement`; release builds of the agent, npm-cni and the
/// harness, whose in-process API server feeds the agent).
fn bench_enforcement(args: &[String]) -> Result<()> {
    let args: Vec<&String> = args.iter().skip_while(|a| *a == "--").collect();
    if !ebpf_object().exists() {
        build_ebpf()?;
    }
    run(cargo().args([
        "build",
        "--release",
        "--bin",
        "npm-agent",
        "--bin",
        "npm-cni",
        "--bin",
        "npm-bench-enforcement",
    ]))?;
    let release = root().join("target/release");
    let mut cmd = Command::new(release.join("npm-bench-enforcement"));
    if !args
        .iter()
        .any(|a| *a == "--agent-bin" || a.starts_with("--agent-bin="))
    {
        cmd.arg("--agent-bin").arg(release.join("npm-agent"));
    }
    if !args
        .iter()
        .any(|a| *a == "--npm-cni-bin" || a.starts_with("--npm-cni-bin="))
    {
        cmd.arg("--npm-cni-bin").arg(release.join("npm-cni"));
    }
    run(cmd.args(&args).env("NPM_EBPF_OBJECT", ebpf_object()))
}

/// `bench propagation`: a new remote pod address, API write to node 1's
/// kernel state, on the three-node cluster (`npm-bench-propagation`).
fn bench_propagation(args: &[String]) -> Result<()> {
    if !ebpf_object().exists() {
        build_ebpf()?;
    }
    build_bins(&["npm-agent", "npm-bench-propagation"])?;
    let mut cmd = Command::new(root().join("target/debug/npm-bench-propagation"));
    if !args.iter().any(|a| a == "--agent-bin" || a.starts_with("--agent-bin=")) {
        cmd.arg("--agent-bin").arg(root().join("target/debug/npm-agent"));
    }
    run(cmd.args(args).env("NPM_EBPF_OBJECT", ebpf_object()))
}
