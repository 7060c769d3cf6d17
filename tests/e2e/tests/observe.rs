//! `npm-agent observe` against a live agent (single node, x/y/z pods): a
//! policy isolates `y/b` for ingress and allows `x/a` on TCP 80 only,
//! another denies all ingress of `x/a`.
//! Three real clients follow the agent's `/observe` (`--json`): one with no
//! filter, one with `--pod y/b --verdict deny`, one with `--namespace z`;
//! a fourth connection subscribes and never reads. Real denied probes
//! (`x/a -> y/b:81`, `z/c -> y/b:80`, `z/c -> x/a:80`) must show up in the first stream as
//! deny records naming the pod, the peer pod, the direction and the
//! isolating policy; the filtered streams must carry only what their
//! filter lets through (and what it lets through); stopping one client and
//! the reader that never reads must not disturb the first, which keeps
//! receiving. A client against a closed port, and a client whose agent
//! stops, fail with a clear error.
//!
//! Needs root and the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`); the eBPF variant also the BPF object
//! (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npm_e2e::fixtures::{agent_bin, probe_config, start_with_setup, tcp_probe as probe, wait_enforced};
use npm_e2e::probe::{probe_all, Probe, ProbeConfig};
use npm_e2e::runner::Engine;
use serde_json::Value;

const SETUP: &str = r#"
id: observe-setup
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
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: x, name: deny-a}
          spec:
            podSelector: {matchLabels: {pod: a}}
            policyTypes: [Ingress]
    probes: []
"#;

/// A running `npm-agent observe --json` and what it printed so far.
struct Observer {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
    stderr: Arc<Mutex<String>>,
}

impl Observer {
    /// `npm-agent observe --json` with `filters`.
    fn start(agent: &str, filters: &[&str]) -> Observer {
        Self::spawn(agent, &[&["--json"], filters].concat())
    }

    /// `npm-agent observe` with `args`, once it is subscribed.
    fn spawn(agent: &str, args: &[&str]) -> Observer {
        let mut child = Command::new(agent_bin())
            .args(["observe", "--agent", agent])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run npm-agent observe");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let (out, err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
        let l = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                l.lock().unwrap().push(line);
            }
        });
        let e = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut s = e.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        let o = Observer { child, lines, stderr };
        // Subscribed once the client says so (the agent's first line).
        o.wait_stderr("observing flows", Duration::from_secs(10));
        o
    }

    fn wait_stderr(&self, what: &str, within: Duration) {
        let until = Instant::now() + within;
        while !self.stderr.lock().unwrap().contains(what) {
            assert!(
                Instant::now() < until,
                "observe never printed {what:?}; stderr: {}",
                self.stderr.lock().unwrap()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The records of a `--json` client.
    fn records(&self) -> Vec<Value> {
        let lines = self.lines.lock().unwrap().clone();
        lines
            .iter()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
            .collect()
    }

    fn lines(&self) -> Vec<String> {
        self.lines.lock().unwrap().clone()
    }
}

impl Drop for Observer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn pod_is(v: &Value, ns: &str, name: &str) -> bool {
    v["namespace"] == ns && v["name"] == name
}

/// A deny of `pod`'s ingress from the pod `peer` on port `port`, naming
/// the isolating policy `policy`.
fn is_deny_into(v: &Value, pod: (&str, &str), peer: (&str, &str), port: u16, policy: &str) -> bool {
    v["verdict"] == "deny"
        && v["direction"] == "ingress"
        && v["reason"] == "policy-denied"
        && pod_is(&v["pod"], pod.0, pod.1)
        && v["peer"]["kind"] == "pod"
        && pod_is(&v["peer"], peer.0, peer.1)
        && v["dst"].as_str().is_some_and(|d| d.ends_with(&format!(":{port}")))
        && v["policies"].as_array().is_some_and(|p| p.iter().any(|p| p == policy))
}

/// A deny of `y/b`'s ingress from `peer` on `port` (by `y/allow-xa-80`).
fn is_deny_into_b(v: &Value, peer: (&str, &str), port: u16) -> bool {
    is_deny_into(v, ("y", "b"), peer, port, "y/allow-xa-80")
}

/// The deny of `z/c -> x/a:80` (by `x/deny-a`).
fn is_deny_c_to_a(v: &Value) -> bool {
    is_deny_into(v, ("x", "a"), ("z", "c"), 80, "x/deny-a")
}

fn involves(v: &Value, ns: &str) -> bool {
    v["pod"]["namespace"] == ns || (v["peer"]["kind"] == "pod" && v["peer"]["namespace"] == ns)
}

/// Probes `denied` until `seen` holds for the records of `o` (15 s).
fn probe_until(o: &Observer, denied: &[Probe], cfg: &ProbeConfig, what: &str, seen: impl Fn(&[Value]) -> bool) {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        assert!(probe_all(denied, cfg).iter().all(|ok| !ok), "a denied probe connected");
        std::thread::sleep(Duration::from_millis(300));
        if seen(&o.records()) {
            return;
        }
        assert!(Instant::now() < until, "{what}: not seen; got {:#?}", o.records());
    }
}

fn run(engine: Engine) {
    let t0 = Instant::now();
    let r = start_with_setup(engine, &["--flow-logs-per-sec", "100"], SETUP);
    let cfg = probe_config(&r, 2);
    let allowed = [probe(&r, "x/a", "y/b", 80)];
    let from_a = [probe(&r, "x/a", "y/b", 81)];
    let from_c = [probe(&r, "z/c", "y/b", 80)];
    let c_to_a = [probe(&r, "z/c", "x/a", 80)];
    // Until 80 connects and 81 does not.
    wait_enforced(&format!("{engine:?}"), &cfg, &allowed, &from_a);
    let agent = format!("http://{}", r.debug_addr().expect("the agent's debug address"));
    eprintln!("{engine:?}: enforced after {:?}", t0.elapsed());

    let all = Observer::start(&agent, &[]);
    let b_denies = Observer::start(&agent, &["--pod", "y/b", "--verdict", "deny"]);
    let ns_z = Observer::start(&agent, &["--namespace", "z"]);
    let allows = Observer::start(&agent, &["--verdict", "allow"]);
    // The human form, for x/a only.
    let text = Observer::spawn(&agent, &["--pod", "x/a"]);
    // A subscriber that never reads its stream.
    let mut idle = TcpStream::connect(r.debug_addr().unwrap()).expect("connect");
    write!(idle, "GET /observe HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();

    probe_until(&all, &from_a, &cfg, "x/a -> y/b:81 deny", |v| {
        v.iter().any(|v| is_deny_into_b(v, ("x", "a"), 81))
    });
    probe_until(&all, &from_c, &cfg, "z/c -> y/b:80 deny", |v| {
        v.iter().any(|v| is_deny_into_b(v, ("z", "c"), 80))
    });
    probe_until(&all, &c_to_a, &cfg, "z/c -> x/a:80 deny", |v| {
        v.iter().any(is_deny_c_to_a)
    });
    // The filtered clients got them too (their records arrive together).
    std::thread::sleep(Duration::from_millis(500));
    let (b, z) = (b_denies.records(), ns_z.records());
    eprintln!(
        "{engine:?}: all {} records, y/b denies {}, namespace z {}; first: {}",
        all.records().len(),
        b.len(),
        z.len(),
        all.records()[0]
    );
    assert!(b.iter().any(|v| is_deny_into_b(v, ("x", "a"), 81)), "{b:#?}");
    assert!(b.iter().any(|v| is_deny_into_b(v, ("z", "c"), 80)), "{b:#?}");
    for v in &b {
        assert_eq!(v["verdict"], "deny", "--verdict deny let through {v}");
        assert!(
            pod_is(&v["pod"], "y", "b") || pod_is(&v["peer"], "y", "b"),
            "--pod y/b let through {v}"
        );
    }
    assert!(z.iter().any(|v| is_deny_into_b(v, ("z", "c"), 80)), "{z:#?}");
    assert!(z.iter().any(is_deny_c_to_a), "{z:#?}");
    assert!(!z.iter().any(|v| is_deny_into_b(v, ("x", "a"), 81)), "{z:#?}");
    assert!(z.iter().all(|v| involves(v, "z")), "--namespace z let through {z:#?}");
    let text = text.lines();
    eprintln!("{engine:?}: npm-agent observe --pod x/a:\n{}", text.join("\n"));
    assert!(
        text.iter().any(|l| l.starts_with("DENY       ingress y/b <- x/a (")
            && l.contains(":81 TCP) reason=policy-denied policies=y/allow-xa-80")),
        "{text:#?}"
    );
    assert!(
        text.iter().any(|l| l.starts_with("DENY       ingress x/a <- z/c (")
            && l.ends_with(":80 TCP) reason=policy-denied policies=x/deny-a")),
        "{text:#?}"
    );
    assert!(
        !text.iter().any(|l| l.contains("y/b <- z/c")),
        "--pod x/a let through {text:#?}"
    );
    // Only denies were produced (no allow events are asked for).
    assert!(
        allows.records().iter().all(|v| v["verdict"] == "allow"),
        "{:#?}",
        allows.records()
    );

    eprintln!("{engine:?}: streams checked after {:?}", t0.elapsed());
    // Stopping one client and the one that never reads does not disturb
    // the first: it keeps receiving.
    drop(b_denies);
    drop(idle);
    let before = all.records().len();
    probe_until(&all, &from_a, &cfg, "a deny after other clients left", |v| {
        v[before..].iter().any(|v| is_deny_into_b(v, ("x", "a"), 81))
    });

    // A closed port: a clear error, not a hang.
    let out = Command::new(agent_bin())
        .args(["observe", "--agent", "http://127.0.0.1:1"])
        .output()
        .expect("run npm-agent observe");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "observe of a closed port succeeded");
    assert!(err.contains("cannot connect to the agent at 127.0.0.1:1"), "{err}");
    // A bad filter: the agent's 400, named.
    let out = Command::new(agent_bin())
        .args(["observe", "--agent", &agent, "--pod", "nonamespace"])
        .output()
        .expect("run npm-agent observe");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("NAMESPACE/POD"), "{err}");

    eprintln!("{engine:?}: errors checked after {:?}", t0.elapsed());
    // The agent stops: the follower ends with an error naming it.
    let mut all = all;
    drop(ns_z);
    drop(allows);
    r.shutdown().expect("shutdown");
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = all.child.try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "observe kept running after the agent stopped");
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(!status.success());
    all.wait_stderr("closed the stream", Duration::from_secs(2));
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn observe_ebpf() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf);
}

/// The nftables dataplane's denies come through NFLOG (`nft/nflog.rs`).
#[test]
fn observe_nftables() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables);
}
