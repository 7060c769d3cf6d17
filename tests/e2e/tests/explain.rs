//! `npm-agent explain` against a live agent (single node, x/y/z pods): a
//! policy isolates `y/b` for ingress and allows `x/a` on TCP 80 only.
//! Explain (the real CLI, `--json`, against the agent's `/explain`) must
//! say allow on 80 naming the policy and its rule, deny on 81 naming the
//! isolating policy; on eBPF the kernel's verdict (the attached programs
//! run as a dry run) must agree, on nftables it is `null`. On eBPF the
//! dry runs must leave no conntrack entry (the pinned maps counted by
//! `npm-agent inspect` before and after), count no packet, and a real
//! probe afterwards still behaves per policy. An IP address works as an
//! endpoint as well as `NS/POD`.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use npm_e2e::probe::{probe_all, Probe, ProbeConfig, Proto};
use npm_e2e::runner::{parse_text, Engine, LiveRunner, Options};
use serde_json::Value;

const SETUP: &str = r#"
id: explain-setup
steps:
  - actions:
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: y, name: allow-xa-80}
          spec:
            podSelector: {matchLabels: {pod: b}}
            policyTypes: [Ingress]
            ingress:
              - from:
                  - namespaceSelector: {matchLabels: {ns: x}}
                    podSelector: {matchLabels: {pod: a}}
                ports: [{protocol: TCP, port: 80}]
    probes: []
"#;

fn agent_bin() -> PathBuf {
    let p = std::env::var_os("NPM_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-agent"));
    assert!(p.exists(), "{} missing: cargo build --bin npm-agent", p.display());
    p
}

/// `npm-agent explain --json` from `from` to `to` on TCP `port`.
fn explain(r: &LiveRunner, from: &str, to: &str, port: u16, json: bool) -> String {
    let addr = r.metrics_addr().expect("the agent's metrics address");
    let mut cmd = Command::new(agent_bin());
    cmd.args([
        "explain",
        "--agent",
        &format!("http://{addr}"),
        "--from",
        from,
        "--to",
        to,
    ])
    .args(["--port", &port.to_string(), "--protocol", "TCP"]);
    if json {
        cmd.arg("--json");
    }
    let out = cmd.output().expect("run npm-agent explain");
    assert!(
        out.status.success(),
        "explain failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("utf-8")
}

fn explain_json(r: &LiveRunner, from: &str, to: &str, port: u16) -> Value {
    let text = explain(r, from, to, port, true);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
}

/// `ct_entries` and the non-zero counters of `npm-agent inspect --json`.
fn inspect(r: &LiveRunner) -> (u64, Value) {
    let out = Command::new(agent_bin())
        .args(["inspect", "--json", "--pin-dir"])
        .arg(r.pin_dir())
        .output()
        .expect("run npm-agent inspect");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: Value = serde_json::from_slice(&out.stdout).expect("inspect JSON");
    // Only y/b receives these: nothing else moves them while explain runs.
    let policy: Vec<Value> = v["counters"]
        .as_array()
        .expect("counters")
        .iter()
        .filter(|c| c["direction"] == "ingress" && c["reason"].as_str().is_some_and(|r| r.contains("olic")))
        .cloned()
        .collect();
    (v["ct_entries"].as_u64().expect("ct_entries"), Value::Array(policy))
}

fn probe(r: &LiveRunner, from: &str, to: &str, port: u16) -> Probe {
    let (ns, name) = from.split_once('/').unwrap();
    let (tns, tname) = to.split_once('/').unwrap();
    Probe {
        src_netns: r.cluster().pod(ns, name).unwrap().netns.clone(),
        dst_pod: to.to_string(),
        dst: SocketAddr::new(r.cluster().pod(tns, tname).unwrap().ipv4.into(), port),
        proto: Proto::Tcp,
    }
}

fn ingress(v: &Value) -> &Value {
    v["directions"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["direction"] == "ingress"))
        .expect("an ingress direction")
}

fn run(engine: Engine) {
    let t0 = Instant::now();
    let mut r = LiveRunner::start(Options {
        engine,
        agent_bin: agent_bin(),
        deadline: Duration::from_secs(10),
        ..Options::default()
    })
    .expect("start the live runner");
    let setup = parse_text(SETUP).unwrap().remove(0);
    let (passed, report) = r.run_case(&setup);
    assert!(passed, "setup: {report}");
    let cfg = ProbeConfig {
        timeout: Duration::from_millis(500),
        threads: 2,
        sctp_log: r.cluster().sctp_log(),
    };
    let allowed = [probe(&r, "x/a", "y/b", 80)];
    let denied = [probe(&r, "x/a", "y/b", 81), probe(&r, "z/c", "y/b", 80)];
    // Enforced: 80 connects, 81 and z/c do not.
    let until = Instant::now() + Duration::from_secs(15);
    while !(probe_all(&allowed, &cfg)[0] && probe_all(&denied, &cfg).iter().all(|ok| !ok)) {
        assert!(Instant::now() < until, "{engine:?}: the policy was never enforced");
        std::thread::sleep(Duration::from_millis(200));
    }
    let before = (engine == Engine::Ebpf).then(|| inspect(&r));

    let allow = explain_json(&r, "x/a", "y/b", 80);
    let deny = explain_json(&r, "x/a", "y/b", 81);
    let by_ip = explain_json(&r, &r.cluster().pod("z", "c").unwrap().ipv4.to_string(), "y/b", 80);
    let text = explain(&r, "x/a", "y/b", 81, false);
    eprintln!("{engine:?} allow: {allow}\n{engine:?} deny: {deny}\n{engine:?} text:\n{text}");

    assert_eq!(allow["verdict"], "allow", "{allow}");
    assert_eq!(allow["mismatch"], Value::Null, "{allow}");
    let rule = &ingress(&allow)["policies"][0];
    assert_eq!(
        (&rule["namespace"], &rule["name"], &rule["rule"], &rule["effect"]),
        (
            &"y".into(),
            &"allow-xa-80".into(),
            &"ingress[0]".into(),
            &"allow".into()
        ),
        "{allow}"
    );
    assert_eq!(ingress(&allow)["reason"], "Policy", "{allow}");
    assert_eq!(deny["verdict"], "deny", "{deny}");
    assert_eq!(deny["mismatch"], Value::Null, "{deny}");
    assert_eq!(ingress(&deny)["reason"], "PolicyDenied", "{deny}");
    let iso = &ingress(&deny)["policies"][0];
    assert_eq!(
        (&iso["namespace"], &iso["name"], &iso["effect"]),
        (&"y".into(), &"allow-xa-80".into(), &"isolates".into()),
        "{deny}"
    );
    assert_eq!(by_ip["verdict"], "deny", "{by_ip}");
    assert!(text.starts_with("DENIED "), "{text}");
    assert!(text.contains("y/allow-xa-80"), "{text}");

    match engine {
        Engine::Ebpf => {
            for (v, verdict, reason) in [
                (&allow, "allow", "Policy"),
                (&deny, "deny", "PolicyDenied"),
                (&by_ip, "deny", "PolicyDenied"),
            ] {
                let k = &ingress(v)["kernel"];
                assert_eq!((&k["verdict"], &k["reason"]), (&verdict.into(), &reason.into()), "{v}");
                assert_eq!(v["kernel"]["verdict"], verdict, "{v}");
            }
            // x/a's egress is local and not isolated: its program ran too.
            let egress = &allow["directions"][0];
            assert_eq!(egress["kernel"]["reason"], "NotIsolated", "{allow}");
            let (ct_before, counters_before) = before.unwrap();
            let (ct_after, counters_after) = inspect(&r);
            // Without the dry run: one entry per allowed hook (x/a's egress
            // and y/b's ingress on 80, z/c's egress) at least. The agent may
            // expire the probes' closed flows meanwhile, never add one.
            assert!(
                ct_after <= ct_before,
                "explain created conntrack entries: {ct_before} -> {ct_after}"
            );
            assert_eq!(counters_after, counters_before, "explain moved the verdict counters");
            assert!(text.contains("kernel: deny (PolicyDenied)"), "{text}");
        }
        _ => {
            assert_eq!(allow["kernel"], Value::Null, "{allow}");
            assert_eq!(ingress(&deny)["kernel"], Value::Null, "{deny}");
            assert!(text.contains("kernel: null"), "{text}");
        }
    }
    // A real probe afterwards still behaves per policy.
    assert!(probe_all(&allowed, &cfg)[0], "{engine:?}: 80 no longer connects");
    assert!(
        probe_all(&denied, &cfg).iter().all(|ok| !ok),
        "{engine:?}: 81 or z/c connects"
    );
    let metrics = std::process::Command::new("curl")
        .args(["-s", &format!("http://{}/metrics", r.metrics_addr().unwrap())])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    if !metrics.is_empty() {
        assert!(metrics.contains("npm_explain_mismatch_total 0"), "{metrics}");
    }
    r.shutdown().expect("shutdown");
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn explain_ebpf() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn explain_nftables() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables);
}
