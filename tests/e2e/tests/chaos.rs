//! The chaos soak at CI size (`npm_e2e::chaos`; `cargo xtask chaos` runs it
//! long): a short seeded schedule of changes and faults on the two-node
//! cluster with the real agents, judged by the oracle.
//!
//! - `chaos_clean_seed_ebpf`: 60 s of seed 102, node 2's agent killed at
//!   20 s (a map-layout change) and, from 30 s, an npm-cni ADD on node 1
//!   timing out with its agent stopped: no violation, no liveness failure,
//!   npm-cni failed closed, and the probes saw both verdicts (the oracle
//!   judged something).
//! - `chaos_injected_fault_nftables`: the agents drop every NetworkPolicy
//!   watch delete (`NPM_TEST_SKIP_DELETE=networkpolicies`): a deleted
//!   policy keeps allowing what the remaining ones isolate, and the oracle
//!   must report violations. The run adds, whatever the seed draws, an
//!   ingress default-deny and an allow-all-ingress policy in `x` at tick 5
//!   and the allow's deletion at tick 15 (`schedule::injected_step`), and
//!   draws no relisting fault, so the violation does not hang on one short
//!   window of the random schedule.
//!
//! About 2.5 minutes together (each: ~20 s of setup, 60 s of schedule, up
//! to 25 s for the last faults to end). Needs root, the agent and npm-cni
//! (`cargo build --bin npm-agent --bin npm-cni`) and, for eBPF, the BPF
//! object (`NPM_EBPF_OBJECT`).

use std::path::PathBuf;

use npm_e2e::chaos::{self, oracle::Bounds, ChaosOptions};
use npm_e2e::fixtures::agent_bin;
use npm_e2e::runner::Engine;

/// One multi-node cluster at a time in this process.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn npm_cni_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-cni");
    assert!(p.exists(), "{} missing: cargo build --bin npm-cni", p.display());
    p
}

/// Forced steps beside the drawn ones: a `kill -9` and an npm-cni timeout,
/// each `(tick, node)`.
#[derive(Default)]
struct Forced {
    kill_at: Option<(u64, u8)>,
    cni_timeout_at: Option<(u64, u8)>,
}

fn soak(engine: Engine, seed: u64, duration: u64, inject: bool, forced: Forced) -> (chaos::Report, String) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let opts = ChaosOptions {
        engine,
        duration,
        seed,
        agent_bin: agent_bin(),
        npm_cni_bin: npm_cni_bin(),
        inject,
        bounds: Bounds::default(),
        kill_at: forced.kill_at,
        cni_timeout_at: forced.cni_timeout_at,
    };
    let mut out = Vec::new();
    let report = chaos::run(&opts, &mut out).expect("the soak runs");
    let out = String::from_utf8_lossy(&out).to_string();
    eprintln!("{out}{}", report.json_line());
    (report, out)
}

#[test]
fn chaos_clean_seed_ebpf() {
    // Node 2's agent is killed at 20 s: its restart changes its map layout.
    // From 30 s, an npm-cni ADD on node 1 times out with its agent stopped.
    let forced = Forced {
        kill_at: Some((20, 2)),
        cni_timeout_at: Some((30, 1)),
    };
    let (r, out) = soak(Engine::Ebpf, 102, 60, false, forced);
    assert!(r.probes >= 200, "too few probes: {}", r.probes);
    assert!(
        r.connected > 0 && r.connected < r.probes,
        "the probes saw one verdict only"
    );
    assert!(r.states > 10, "too few states: {}", r.states);
    let (via, via_ok) = r.via_service;
    assert!(
        via >= 20 && via_ok > 0 && via_ok < via,
        "too few probes through ClusterIPs, or one verdict only: {via} probes, {via_ok} connected"
    );
    // Node 2's forced restart, and any drawn one (a seed draws the same
    // steps only while the agents' readiness falls on the same ticks).
    let (changed, retired) = r.layout_changes;
    assert!(
        changed >= 1 && retired == changed,
        "restarts across the layout change, their old pins retired: {changed}, {retired}:\n{out}"
    );
    // npm-cni failed closed (an ADD that succeeded is a violation) and the
    // address went to another pod.
    assert!(r.cni_timeouts >= 1, "no npm-cni timeout ran:\n{out}");
    assert_eq!(r.violations, 0, "violations:\n{out}");
    assert_eq!(r.liveness_failures, 0, "liveness failures:\n{out}");
}

#[test]
fn chaos_injected_fault_nftables() {
    let (r, out) = soak(Engine::Nftables, 102, 60, true, Forced::default());
    assert!(
        r.violations > 0,
        "the agents dropped NetworkPolicy deletes, the oracle saw no violation:\n{out}"
    );
    assert!(out.contains("VIOLATION (seed 102)") && out.contains("replay: cargo xtask chaos"));
}
