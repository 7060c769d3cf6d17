//! Flow logs with names on stdout against a live agent (single node, x/y/z
//! pods; issue 16), on both dataplanes: a policy isolates `y/b` for ingress
//! and allows `x/a` on TCP 80 only; the agent runs with `--flow-logs-allow`.
//! Real probes: the denied `x/a -> y/b:81` must give a `"verdict":"deny"`
//! JSON line on the agent's stdout naming the pod, the peer pod, the
//! direction, the reason and the isolating policy (on nftables through
//! NFLOG, as on eBPF through the ring buffer); the allowed
//! `x/a -> y/b:80` an `"verdict":"allow"` line (reason `policy`) naming
//! the same.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::time::{Duration, Instant};

use npm_e2e::fixtures::{probe_config, start_with_setup, tcp_probe as probe, ALLOW_XA_80};
use npm_e2e::probe::probe_all;
use npm_e2e::runner::{Engine, LiveRunner};
use serde_json::Value;

/// The flow log lines of the agent's stdout (its log file holds stdout
/// and stderr: the JSON lines with a `verdict`).
fn flow_lines(r: &LiveRunner) -> Vec<Value> {
    let text = std::fs::read_to_string(r.workdir().join("agent.log")).unwrap_or_default();
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v.get("verdict").is_some() && v.get("peer").is_some())
        .collect()
}

fn pod_is(v: &Value, ns: &str, name: &str) -> bool {
    v["namespace"] == ns && v["name"] == name
}

/// A line of `verdict` for `y/b`'s ingress from `x/a` on `port`, with
/// `reason`, naming the isolating policy.
fn into_b(v: &Value, verdict: &str, reason: &str, port: u16) -> bool {
    v["verdict"] == verdict
        && v["reason"] == reason
        && v["direction"] == "ingress"
        && pod_is(&v["pod"], "y", "b")
        && v["peer"]["kind"] == "pod"
        && pod_is(&v["peer"], "x", "a")
        && v["protocol"] == "TCP"
        && v["dst"].as_str().is_some_and(|d| d.ends_with(&format!(":{port}")))
        && v["policies"]
            .as_array()
            .is_some_and(|p| p.iter().any(|p| p == "y/allow-xa-80"))
}

fn run(engine: Engine) {
    let t0 = Instant::now();
    let r = start_with_setup(
        engine,
        &["--flow-logs-per-sec", "100", "--flow-logs-allow"],
        ALLOW_XA_80,
    );
    let cfg = probe_config(&r, 2);
    let allowed = [probe(&r, "x/a", "y/b", 80)];
    let denied = [probe(&r, "x/a", "y/b", 81)];
    // Probe until both lines are on stdout (the agent reads events every
    // stats tick; the first probes may race the policy's programming).
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let ok = probe_all(&allowed, &cfg)[0];
        let refused = !probe_all(&denied, &cfg)[0];
        std::thread::sleep(Duration::from_millis(500));
        let lines = flow_lines(&r);
        let deny = lines.iter().any(|v| into_b(v, "deny", "policy-denied", 81));
        let allow = lines.iter().any(|v| into_b(v, "allow", "policy", 80));
        if ok && refused && deny && allow {
            eprintln!(
                "{engine:?}: {} flow lines; e.g. {}",
                lines.len(),
                lines.iter().find(|v| into_b(v, "allow", "policy", 80)).unwrap()
            );
            break;
        }
        assert!(
            Instant::now() < until,
            "{engine:?}: deny line {deny}, allow line {allow} (probes: allowed {ok}, refused {refused}); lines: {lines:#?}"
        );
    }
    r.shutdown().expect("shutdown");
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn flow_logs_ebpf() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn flow_logs_nftables() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables);
}
