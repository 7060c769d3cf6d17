//! Per-rule and per-endpoint counters on a live agent, single
//! node, x/y/z pods: a policy isolates `y/b` for ingress and allows `x/a`
//! on TCP 80 (its ingress rule 0). After real probes, the agent's
//! `/metrics` must show `npm_rule_allowed_packets_total` of that rule by
//! namespace, policy name, rule and direction, moved by at least the
//! allowed probes (one per new connection), and
//! `npm_endpoint_denied_packets_total` of pod `y/b` moved by the denied
//! probes; no rule was folded (`npm_rule_metrics_folded`). Both dataplanes.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::time::{Duration, Instant};

use npm_e2e::fixtures::{
    probe_config, scrape_metrics, start_with_setup, tcp_probe as probe, wait_enforced, ALLOW_XA_80,
};
use npm_e2e::probe::probe_all;
use npm_e2e::runner::Engine;

const RULE: &str = r#"npm_rule_allowed_packets_total{namespace="y",policy="allow-xa-80",rule="0",direction="ingress"}"#;
const RULE_BYTES: &str =
    r#"npm_rule_allowed_bytes_total{namespace="y",policy="allow-xa-80",rule="0",direction="ingress"}"#;
const DENIED: &str = r#"npm_endpoint_denied_packets_total{namespace="y",pod="b",direction="ingress"}"#;

/// The value of `series` (name and labels exactly as rendered), 0 if absent.
fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| {
            let (name, v) = l.rsplit_once(' ')?;
            (name == series).then(|| v.parse().ok()).flatten()
        })
        .unwrap_or(0.0)
}

fn run(engine: Engine) {
    let t0 = Instant::now();
    let r = start_with_setup(engine, &[], ALLOW_XA_80);
    let cfg = probe_config(&r, 2);
    let allowed = [probe(&r, "x/a", "y/b", 80)];
    let denied = [probe(&r, "z/c", "y/b", 80)];
    wait_enforced(&format!("{engine:?}"), &cfg, &allowed, &denied);
    let before = scrape_metrics(&r);
    let (rule0, denied0) = (value(&before, RULE), value(&before, DENIED));
    for _ in 0..3 {
        assert!(probe_all(&allowed, &cfg)[0], "{engine:?}: x/a -> y/b:80 refused");
        assert!(!probe_all(&denied, &cfg)[0], "{engine:?}: z/c -> y/b:80 connected");
    }
    // The agent folds the kernel's counters on its stats tick (5 s).
    let until = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let t = scrape_metrics(&r);
        if value(&t, RULE) >= rule0 + 3.0 && value(&t, DENIED) >= denied0 + 3.0 {
            break t;
        }
        assert!(
            Instant::now() < until,
            "{engine:?}: the named series did not move (before: {rule0}, {denied0}):\n{t}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("npm_rule_") || l.starts_with("npm_endpoint_denied"))
        .collect();
    eprintln!("{engine:?}:\n{}", lines.join("\n"));
    // One SYN of 60 to 80 bytes per counted connection.
    let (p, b) = (value(&text, RULE), value(&text, RULE_BYTES));
    assert!(b >= p * 40.0 && b <= p * 100.0, "{engine:?}: {p} packets, {b} bytes");
    assert!(text.contains("# HELP npm_rule_allowed_packets_total "), "{text}");
    assert!(
        text.contains("# TYPE npm_endpoint_denied_packets_total counter"),
        "{text}"
    );
    assert_eq!(value(&text, r#"npm_rule_metrics_folded{kind="rule"}"#), 0.0, "{text}");
    r.shutdown().expect("shutdown");
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn rule_metrics_ebpf() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn rule_metrics_nftables() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables);
}
