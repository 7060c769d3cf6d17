//! Small helpers the live-agent tests (`tests/*.rs`) share: the agent
//! binary they start, a live runner that has run a setup case, the probe
//! settings and the wait until a policy is enforced, a TCP probe between
//! two pods of a live cluster, and the one-policy setup several of them
//! start from.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use crate::probe::{probe_all, Probe, ProbeConfig, Proto};
use crate::runner::{parse_text, Engine, LiveRunner, Options};

/// The `npm-agent` binary a live test starts: `NPM_AGENT_BIN`, else the
/// workspace's debug build (a clear panic when it was not built).
pub fn agent_bin() -> PathBuf {
    let p = std::env::var_os("NPM_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-agent"));
    assert!(p.exists(), "{} missing: cargo build --bin npm-agent", p.display());
    p
}

/// A live runner on `engine` (the agent of [`agent_bin`] with the extra
/// flags `agent_args`, a probe deadline of 10 s) that has run the one-step
/// case `setup` (panics if the case fails).
pub fn start_with_setup(engine: Engine, agent_args: &[&str], setup: &str) -> LiveRunner {
    let mut r = LiveRunner::start(Options {
        engine,
        agent_bin: agent_bin(),
        deadline: Duration::from_secs(10),
        agent_args: agent_args.iter().map(|a| a.to_string()).collect(),
        ..Options::default()
    })
    .expect("start the live runner");
    let case = parse_text(setup).expect("setup case").remove(0);
    let (passed, report) = r.run_case(&case);
    assert!(passed, "setup: {report}");
    r
}

/// The probe settings of the live tests: 500 ms an attempt, `threads`
/// probe threads.
pub fn probe_config(r: &LiveRunner, threads: usize) -> ProbeConfig {
    ProbeConfig {
        timeout: Duration::from_millis(500),
        threads,
        sctp_log: r.cluster().sctp_log(),
    }
}

/// Probes every 200 ms until each of `allowed` connects and none of
/// `denied` does; panics with `what` after 15 s.
pub fn wait_enforced(what: &str, cfg: &ProbeConfig, allowed: &[Probe], denied: &[Probe]) {
    let until = Instant::now() + Duration::from_secs(15);
    while !(probe_all(allowed, cfg).iter().all(|ok| *ok) && probe_all(denied, cfg).iter().all(|ok| !ok)) {
        assert!(Instant::now() < until, "{what}: the policy was never enforced");
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The live agent's whole `/metrics` text, the series naming pods and
/// policies included: read on its loopback debug listener, as through
/// `kubectl port-forward` (the node's `/metrics` serves them only to a
/// granted token). Panics when it cannot be read.
pub fn scrape_metrics(r: &LiveRunner) -> String {
    let addr = r.debug_addr().expect("the agent's debug address");
    let out = std::process::Command::new("curl")
        .args(["-sf", &format!("http://{addr}/metrics")])
        .output()
        .expect("curl /metrics");
    assert!(out.status.success(), "curl /metrics failed");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A TCP probe from pod `from` (`NS/POD`) to pod `to`'s IPv4 address on
/// `port` (panics on a pod the cluster does not have).
pub fn tcp_probe(r: &LiveRunner, from: &str, to: &str, port: u16) -> Probe {
    let (ns, name) = from.split_once('/').expect("NS/POD");
    let (tns, tname) = to.split_once('/').expect("NS/POD");
    Probe {
        src_netns: r.cluster().pod(ns, name).expect("source pod").netns.clone(),
        dst_pod: to.to_string(),
        dst: SocketAddr::new(r.cluster().pod(tns, tname).expect("destination pod").ipv4.into(), port),
        proto: Proto::Tcp,
    }
}

/// A one-step case on the x/y/z model: `y/allow-xa-80` isolates `y/b`'s
/// ingress and allows TCP 80 from `x/a` (no probes).
pub const ALLOW_XA_80: &str = r#"
id: allow-xa-80-setup
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
