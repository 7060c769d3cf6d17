//! `cargo xtask fuzz`: the packet fuzzer (`ebpf_fuzz` of the dataplane
//! test binary) for long runs: random and malformed frames through the
//! real eBPF programs with `BPF_PROG_TEST_RUN` against random compiled
//! states, judged by `docs/packet-spec.md`. Seeded and reproducible
//! (`--seed N`); bounded by `--cases N` or `--duration SECS`. The test's
//! output streams through; the run ends with its one JSON line
//! (`"bench":"fuzz"`, cases, findings). Needs root.

use std::io::{BufRead, BufReader};
use std::process::Stdio;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::{build_ebpf, cargo, ebpf_object, root};

/// The arguments of `cargo xtask fuzz`.
#[derive(Args)]
pub struct FuzzArgs {
    /// The seed (decimal or 0x hex); without it one is drawn from the clock
    /// and printed.
    #[arg(long)]
    seed: Option<String>,
    /// Stop after this many cases (default 10,000 without --duration).
    #[arg(long)]
    cases: Option<u64>,
    /// Stop after this many seconds.
    #[arg(long)]
    duration: Option<u64>,
    /// Attach mode of the endpoints' programs: tcx or tc.
    #[arg(long, default_value = "tcx")]
    attach: String,
}

/// Runs the fuzzer; fails when it found a verdict outside the
/// specification.
pub fn fuzz(a: &FuzzArgs) -> Result<()> {
    if a.attach != "tcx" && a.attach != "tc" {
        bail!("--attach {:?}: use tcx or tc", a.attach);
    }
    build_ebpf()?;
    let mut cmd = cargo();
    cmd.args(["test", "--package", "npm-dataplane", "--test", "dataplane", "--"])
        .args(["--ignored", "--exact", "ebpf_fuzz::fuzz_on_demand", "--nocapture"])
        .env("NPM_EBPF_OBJECT", ebpf_object())
        .env("NPM_FUZZ_ATTACH", &a.attach)
        .current_dir(root())
        .stdout(Stdio::piped());
    for (k, v) in [
        ("NPM_FUZZ_SEED", a.seed.clone()),
        ("NPM_FUZZ_CASES", a.cases.map(|n| n.to_string())),
        ("NPM_FUZZ_DURATION", a.duration.map(|n| n.to_string())),
    ] {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    eprintln!("xtask: $ {cmd:?}");
    let mut child = cmd.spawn().context("cannot start cargo test")?;
    let mut json = None;
    let stdout = child.stdout.take().context("no stdout")?;
    for line in BufReader::new(stdout).lines() {
        let line = line.context("read the test's output")?;
        if line.starts_with("{\"bench\":\"fuzz\"") {
            json = Some(line);
        } else {
            println!("{line}");
        }
    }
    let status = child.wait().context("wait for cargo test")?;
    match json {
        Some(j) => println!("{j}"),
        None => bail!("the fuzzer printed no result line ({status})"),
    }
    if !status.success() {
        bail!("the fuzzer found verdicts outside docs/packet-spec.md (see above)");
    }
    Ok(())
}
