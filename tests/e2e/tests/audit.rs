//! Audit mode against a live agent (single node, x/y/z pods; issue 16): a
//! deny-all-ingress NetworkPolicy on `y/b` annotated `npm.io/audit: "true"`
//! is not enforced, and what it would deny is reported.
//!
//! - every real probe still connects (the audited policy changes no
//!   verdict), those into `y/b` included;
//! - the agent's flow stream (`npm-agent observe --json`) carries a
//!   `"verdict":"would-deny"` record naming the audited policy for exactly
//!   the probes the reference evaluator says it would deny
//!   (`npm_policy::audit::AuditView` on the runner's model of the
//!   cluster), and none for the others; `npm_audit_would_deny_total` counts
//!   them;
//! - the annotation removed, the same policy is enforced: the probes into
//!   `y/b` fail, the others still connect.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npm_e2e::fixtures::{agent_bin, tcp_probe as probe};
use npm_e2e::probe::{probe_all, Probe, ProbeConfig};
use npm_e2e::runner::{parse_text, Engine, LiveRunner, Options};
use npm_policy::audit::{audited_policies, AuditView};
use npm_policy::compiled::Direction;
use npm_policy::convert::{load_yaml, Objects};
use serde_json::Value;

const POLICY: &str = r#"
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  namespace: y
  name: audit-deny-b
  annotations: {npm.io/audit: "true"}
spec:
  podSelector: {matchLabels: {pod: b}}
  policyTypes: [Ingress]
"#;

/// (source, destination, port) of every probe.
const PROBES: &[(&str, &str, u16)] = &[
    ("x/a", "y/b", 80),
    ("z/c", "y/b", 81),
    ("y/a", "y/b", 80),
    ("y/b", "x/a", 80),
    ("x/a", "y/c", 80),
    ("z/c", "x/b", 81),
];

/// A running `npm-agent observe --json` and the records it printed.
struct Observer {
    child: Child,
    records: Arc<Mutex<Vec<Value>>>,
}

impl Observer {
    fn start(agent: &str) -> Observer {
        let mut child = Command::new(agent_bin())
            .args(["observe", "--json", "--agent", agent])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run npm-agent observe");
        let records = Arc::new(Mutex::new(Vec::new()));
        let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let r = records.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let v = serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
                r.lock().unwrap().push(v);
            }
        });
        // Subscribed once the client says so.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if line.contains("observing flows") {
                    if let Some(tx) = tx.take() {
                        let _ = tx.send(());
                    }
                }
            }
        });
        rx.recv_timeout(Duration::from_secs(10)).expect("observe subscribed");
        Observer { child, records }
    }

    /// The would-deny records so far, as (pod, direction, peer pod, port).
    fn would_deny(&self) -> Vec<(Key, Value)> {
        self.records
            .lock()
            .unwrap()
            .iter()
            .filter(|v| v["verdict"] == "would-deny")
            .map(|v| (key_of(v), v.clone()))
            .collect()
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// (pod, direction, peer pod, destination port).
type Key = (String, String, String, u16);

fn key_of(v: &Value) -> Key {
    let pod = format!(
        "{}/{}",
        v["pod"]["namespace"].as_str().unwrap_or("?"),
        v["pod"]["name"].as_str().unwrap_or("?")
    );
    let peer = format!(
        "{}/{}",
        v["peer"]["namespace"].as_str().unwrap_or("?"),
        v["peer"]["name"].as_str().unwrap_or("?")
    );
    let port = v["dst"]
        .as_str()
        .and_then(|d| d.rsplit_once(':'))
        .and_then(|(_, p)| p.parse().ok())
        .unwrap_or(0);
    (pod, v["direction"].as_str().unwrap_or("?").to_string(), peer, port)
}

fn split(p: &str) -> (String, String) {
    let (a, b) = p.split_once('/').unwrap();
    (a.to_string(), b.to_string())
}

/// What the reference evaluator says the audited policy (the one of
/// `objects`) would deny, per probe: the would-deny records expected (one
/// per end it would deny).
fn expected(r: &LiveRunner, objects: &Objects) -> BTreeSet<Key> {
    let model = r.model();
    let opts = model.compile_options();
    let view = AuditView::new(&model.snapshot, &opts, audited_policies(&objects.policies));
    let mut want = BTreeSet::new();
    for &(from, to, port) in PROBES {
        let (src, dst) = (model.ip(from).unwrap(), model.ip(to).unwrap());
        for (pod, dir, peer, peer_name) in [(from, Direction::Egress, dst, to), (to, Direction::Ingress, src, from)] {
            if view
                .would_deny(&model.snapshot, &opts, &split(pod), dir, peer, 6, port)
                .is_some()
            {
                want.insert((pod.to_string(), dir.name().to_string(), peer_name.to_string(), port));
            }
        }
    }
    want
}

/// The last lines of the agent's log (stdout and stderr), for failures.
fn agent_log(r: &LiveRunner) -> String {
    let text = std::fs::read_to_string(r.workdir().join("agent.log")).unwrap_or_default();
    let lines: Vec<&str> = text
        .lines()
        .filter(|l| !l.contains("sync phases") && !l.contains("incremental update"))
        .collect();
    let inspect = Command::new(agent_bin())
        .args(["inspect", "--pin-dir"])
        .arg(r.pin_dir())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default();
    format!(
        "{}\ninspect:\n{inspect}",
        lines[lines.len().saturating_sub(40)..].join("\n")
    )
}

fn metric(r: &LiveRunner, series: &str) -> Option<f64> {
    // The debug listener's /metrics: the named series included.
    let addr = r.debug_addr().expect("debug address");
    let out = Command::new("curl")
        .args(["-s", &format!("http://{addr}/metrics")])
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (name, value) = l.rsplit_once(' ')?;
        (name == series).then(|| value.parse().ok()).flatten()
    })
}

fn run(engine: Engine) {
    let t0 = Instant::now();
    let mut r = LiveRunner::start(Options {
        engine,
        agent_bin: agent_bin(),
        deadline: Duration::from_secs(10),
        agent_args: vec!["--flow-logs-per-sec".into(), "100".into()],
        ..Options::default()
    })
    .expect("start the live runner");
    let agent = format!("http://{}", r.debug_addr().expect("the agent's debug address"));
    let observer = Observer::start(&agent);
    let case = format!(
        "id: audit-setup\nsteps:\n  - actions:\n      - create_policy:\n{}\n    probes: []\n",
        POLICY
            .trim()
            .lines()
            .map(|l| format!("          {l}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    let (passed, report) = r.run_case(&parse_text(&case).unwrap().remove(0));
    assert!(passed, "setup: {report}");
    let stored = r
        .api()
        .get(&npm_e2e::api::policy_path("y", "audit-deny-b"))
        .expect("the policy");
    assert_eq!(stored["metadata"]["annotations"]["npm.io/audit"], "true", "{stored}");
    let objects = load_yaml(POLICY).unwrap();
    let want = expected(&r, &objects);
    assert_eq!(
        want.len(),
        3,
        "the evaluator: every probe into y/b, nothing else: {want:?}"
    );
    let cfg = ProbeConfig {
        timeout: Duration::from_millis(500),
        threads: 2,
        sctp_log: r.cluster().sctp_log(),
    };
    let probes: Vec<Probe> = PROBES.iter().map(|&(f, t, p)| probe(&r, f, t, p)).collect();
    // Probe until every expected would-deny record is seen; every probe
    // connects every time (the audited policy is not enforced).
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let ok = probe_all(&probes, &cfg);
        for (i, ok) in ok.iter().enumerate() {
            assert!(
                ok,
                "{engine:?}: {:?} did not connect: the audited policy changed a verdict",
                PROBES[i]
            );
        }
        std::thread::sleep(Duration::from_millis(300));
        let seen: BTreeSet<Key> = observer.would_deny().into_iter().map(|(k, _)| k).collect();
        if want.is_subset(&seen) {
            break;
        }
        assert!(
            Instant::now() < until,
            "{engine:?}: would-deny records missing: want {want:?}, seen {seen:?}; records {:#?}\nagent log:\n{}",
            observer.records.lock().unwrap(),
            agent_log(&r)
        );
    }
    // Late records of the last round.
    std::thread::sleep(Duration::from_millis(1500));
    let records = observer.would_deny();
    let seen: BTreeSet<Key> = records.iter().map(|(k, _)| k.clone()).collect();
    assert_eq!(
        seen, want,
        "{engine:?}: would-deny for exactly the evaluator's probes: {records:#?}"
    );
    for (_, v) in &records {
        assert_eq!(v["policies"], serde_json::json!(["y/audit-deny-b"]), "{v}");
    }
    let count = metric(
        &r,
        "npm_audit_would_deny_total{namespace=\"y\",policy=\"audit-deny-b\",direction=\"ingress\"}",
    )
    .expect("npm_audit_would_deny_total");
    assert!(count >= records.len() as f64, "{count} < {} records", records.len());
    eprintln!(
        "{engine:?}: {} would-deny records, metric {count}; first: {}",
        records.len(),
        records[0].1
    );

    // The annotation removed: the policy is enforced.
    let mut enforced = objects.policies[0].clone();
    enforced.metadata.annotations = None;
    let update = format!(
        "id: audit-enforce\nsteps:\n  - actions:\n      - update_policy: {}\n    probes: []\n",
        serde_json::to_string(&enforced).unwrap()
    );
    let (passed, report) = r.run_case(&parse_text(&update).unwrap().remove(0));
    assert!(passed, "enforce: {report}");
    let into_b: Vec<usize> = (0..PROBES.len()).filter(|&i| PROBES[i].1 == "y/b").collect();
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let ok = probe_all(&probes, &cfg);
        let enforcing = into_b.iter().all(|&i| !ok[i]);
        if enforcing {
            for (i, ok) in ok.iter().enumerate() {
                assert!(into_b.contains(&i) || *ok, "{engine:?}: {:?} denied", PROBES[i]);
            }
            break;
        }
        assert!(
            Instant::now() < until,
            "{engine:?}: the policy was never enforced: {ok:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    drop(observer);
    r.shutdown().expect("shutdown");
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn audit_ebpf() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn audit_nftables() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables);
}
