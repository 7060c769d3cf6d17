//! The enforcement bench at CI size (`npm_e2e::enforcement`; `cargo xtask
//! bench enforcement` runs it at 100,000 pods): its machinery, asserted on
//! events, never on the figures. A small run (1,000 preloaded pods, 100
//! policies, 4 probed pairs, 8 policy changes and 2 new pods a phase,
//! churn at 100 writes/s) must observe every policy change (creates,
//! updates and deletes, each flipping its pair's verdict) and every new
//! pod's four verdicts, see no probe contradict an observed verdict nor
//! any connect on a new pod's denied pairs (fail-closed pod start), time
//! npm-cni's ADD of every new pod in both phases, write churn, and end
//! with a line holding every field.
//!
//! On eBPF and on nftables, about 15-25 s each (half of it setup). Needs root, the agent and npm-cni (`cargo
//! build --bin npm-agent --bin npm-cni`) and the BPF object
//! (`NPM_EBPF_OBJECT`).

use std::path::PathBuf;
use std::time::Duration;

use npm_e2e::enforcement::{self, EnforcementOptions};
use npm_e2e::fixtures::agent_bin;
use npm_e2e::runner::Engine;

fn npm_cni_bin() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-cni");
    assert!(p.exists(), "{} missing: cargo build --bin npm-cni", p.display());
    p
}

/// One cluster at a time in this process (the fabric's control address).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn enforcement_bench_observes_every_change_ebpf() {
    small_run(Engine::Ebpf, "ebpf");
}

#[test]
fn enforcement_bench_observes_every_change_nftables() {
    small_run(Engine::Nftables, "nftables");
}

fn small_run(engine: Engine, name: &str) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let opts = EnforcementOptions {
        engine,
        agent_bin: agent_bin(),
        npm_cni_bin: npm_cni_bin(),
        pods: 1_000,
        policies: 100,
        pairs: 4,
        interval: Duration::from_millis(10),
        probe_timeout: Duration::from_millis(250),
        changes: 8,
        new_pods: 2,
        churn_rate: 100,
        op_gap: Duration::from_millis(50),
        deadline: Duration::from_secs(10),
        startup_deadline: Duration::from_secs(60),
    };
    let mut out = Vec::new();
    let r = enforcement::run(&opts, &mut out).expect("the bench runs");
    let out = String::from_utf8_lossy(&out).to_string();
    let line = r.json_line();
    eprintln!("{out}{line}");
    // Every change was written and observed: 4 pairs x 4 stages over the
    // two phases are one create, two updates and one delete each.
    assert_eq!(r.changes.len(), 16, "{out}");
    assert_eq!(r.missed(), 0, "changes or pods not observed:\n{out}");
    let kinds = |k: &str| r.changes.iter().filter(|c| c.kind == k).count();
    assert_eq!((kinds("create"), kinds("update"), kinds("delete")), (4, 8, 4));
    assert!(r.changes.iter().any(|c| c.churn) && r.changes.iter().any(|c| !c.churn));
    assert!(r.changes.iter().all(|c| c.observed_at.is_some_and(|t| t >= c.sent)));
    assert_eq!(r.flaps, 0, "probes contradicted an observed verdict:\n{out}");
    // Every new pod: npm-cni's ADD timed, its four verdicts seen.
    assert_eq!(r.new_pods.len(), 4);
    assert_eq!(r.new_pods.iter().filter(|p| p.churn).count(), 2);
    assert!(r
        .new_pods
        .iter()
        .all(|p| p.cni_hold_ms > 0.0 && p.cni_hold_ms <= p.chain_add_ms));
    assert!(
        r.new_pods.iter().all(|p| p.agent_wait_ms.is_some()),
        "the agent's CNI wait unread"
    );
    // Fail-closed pod start: no probe of a denied pair of a new pod
    // connected, from the first one sent after ADD returned.
    assert_eq!(r.new_pods.iter().map(|p| p.wrong_allows).sum::<usize>(), 0, "{line}");
    assert!(r.churn_achieved > 0.0 && r.churn_errors == 0, "churn: {line}");
    assert!(r.probes > 100, "{line}");
    let v: serde_json::Value = serde_json::from_str(&line).expect("one JSON line");
    assert!(line.starts_with(r#"{"bench":"enforcement""#));
    for f in [
        "dataplane",
        "pods",
        "policies",
        "policy_p50_ms",
        "policy_p90_ms",
        "policy_p99_ms",
        "pod_p99_ms",
        "cni_hold_p50_ms",
        "cni_hold_p99_ms",
        "cni_hold_idle_p99_ms",
        "cni_hold_churn_p99_ms",
        "pairs",
        "probe_interval_ms",
    ] {
        assert!(v[f].is_number() || v[f].is_string(), "{f} missing or null in {line}");
    }
    assert_eq!(v["dataplane"], name);
    assert_eq!(v["pods"], 1_000);
}
