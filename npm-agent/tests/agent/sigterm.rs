//! SIGTERM (how a DaemonSet pod is stopped) and SIGINT of the real
//! `npm-agent run` binary: the agent logs "shutting down" and exits 0 within
//! a few seconds, its HTTP server is gone, and the eBPF dataplane state it
//! programmed (pinned maps and tcx links, same programs) is left in place so
//! enforcement continues until the next agent adopts it.
//!
//! After the exit, `npm-agent inspect` (with no eBPF object available)
//! reads the same state and leaves the links alone.
//!
//! Setup: the test API server, a generated kubeconfig, a veth pair
//! `ngs<pid><tag>`/`ngs<pid><tag>p` in the root namespace whose host end
//! has 10.217.<n>.1/24 (the pod `k/b` with 10.217.<n>.2 on this node routes
//! there), and pin dir `/sys/fs/bpf/npmst<pid>-<tag>`. Leftovers of crashed
//! runs (dead pid in the name) are removed first; everything is removed on
//! drop. The agent child gets SIGKILL if the test ends early (guard) or the
//! test process dies (PDEATHSIG). Needs root.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus};
use std::time::{Duration, Instant};

use crate::common::netns::{clear_stale_dirs, clear_stale_links, pid_gone, sh};
use crate::common::process::*;
use crate::common::*;
use npm_dataplane::ebpf::{dump_pinned, pinned_link_programs, EbpfDump};

const PREFIX: &str = "npmst";
const VETH: &str = "ngs";

/// The veth pair, the pin dir and the work dir; removed on drop.
struct Fixture {
    host_if: String,
    pod_ip: String,
    pin_dir: PathBuf,
    work_dir: PathBuf,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["link", "delete", &self.host_if]).output();
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

fn clear_leftovers() {
    clear_stale_links(VETH);
    for dir in ["/sys/fs/bpf".into(), std::env::temp_dir()] {
        clear_stale_dirs(dir, PREFIX);
    }
}

fn setup(tag: &str, net: u8) -> Fixture {
    clear_leftovers();
    let pid = std::process::id();
    let f = Fixture {
        host_if: format!("{VETH}{pid}{tag}"),
        pod_ip: format!("10.217.{net}.2"),
        pin_dir: PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{pid}-{tag}")),
        work_dir: std::env::temp_dir().join(format!("{PREFIX}{pid}-{tag}")),
    };
    let peer = format!("{}p", f.host_if);
    let _ = Command::new("ip").args(["link", "delete", &f.host_if]).output();
    let _ = std::fs::remove_dir_all(&f.pin_dir);
    std::fs::create_dir_all(&f.work_dir).expect("create the work dir");
    sh(&["ip", "link", "add", &f.host_if, "type", "veth", "peer", "name", &peer]);
    sh(&["ip", "addr", "add", &format!("10.217.{net}.1/24"), "dev", &f.host_if]);
    sh(&["ip", "link", "set", &peer, "up"]);
    sh(&["ip", "link", "set", &f.host_if, "up"]);
    f
}

/// The agent child; SIGKILLed and reaped on drop if still running.
struct AgentProcess {
    child: Child,
    log: PathBuf,
    metrics: SocketAddr,
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        if matches!(self.child.try_wait(), Ok(None)) {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

impl AgentProcess {
    fn spawn(f: &Fixture, kubeconfig: &Path) -> Self {
        Self::spawn_with(f, kubeconfig, &["--dataplane", "ebpf"])
    }

    fn spawn_with(f: &Fixture, kubeconfig: &Path, dataplane_args: &[&str]) -> Self {
        let metrics = free_port();
        let log = f.work_dir.join("agent.log");
        let child = spawn_agent_run_with(
            dataplane_args,
            &f.pin_dir,
            None,
            kubeconfig,
            &format!("{}*", f.host_if),
            metrics,
            &log,
        );
        AgentProcess { child, log, metrics }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Status code of `GET path`, `None` when the server does not answer.
    fn get_status(&self, path: &str) -> Option<u16> {
        http_get(self.metrics, path).map(|(code, _)| code)
    }

    /// Polls until `cond` holds; panics with the agent's log after `timeout`
    /// or if the agent exits.
    async fn wait_for(&mut self, what: &str, timeout: Duration, mut cond: impl FnMut(&Self) -> bool) {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the agent exited with {status:?} before {what}:\n{}", self.log_text());
            }
            if cond(self) {
                return;
            }
            assert!(
                start.elapsed() < timeout,
                "{what}: not after {timeout:?}; log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sends `signal` and waits (at most `timeout`) for the exit.
    async fn signal_and_wait(&mut self, signal: libc::c_int, timeout: Duration) -> (ExitStatus, Duration) {
        let start = Instant::now();
        // SAFETY: plain kill(2) of our own, not yet reaped, child.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, signal) };
        assert_eq!(rc, 0, "kill({signal}): {}", std::io::Error::last_os_error());
        loop {
            if let Some(status) = self.child.try_wait().expect("wait for the agent") {
                return (status, start.elapsed());
            }
            assert!(
                start.elapsed() < timeout,
                "the agent did not exit within {timeout:?} of signal {signal}; log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The endpoint of the pod at `ip` in `dump`, if both hooks are attached.
fn attached_endpoint(dump: &EbpfDump, ip: &str) -> bool {
    dump.endpoints
        .iter()
        .any(|e| e.ipv4.map(|a| a.to_string()).as_deref() == Some(ip) && e.attached == ["ingress", "egress"])
}

/// Allow of TCP 8080 into the endpoint of `ip` (a key of its subject).
fn has_allow_8080(dump: &EbpfDump, ip: &str) -> bool {
    let Some(ep) = dump
        .endpoints
        .iter()
        .find(|e| e.ipv4.map(|a| a.to_string()).as_deref() == Some(ip))
    else {
        return false;
    };
    dump.policy.iter().any(|p| {
        p.subject == ep.subject
            && p.direction == "ingress"
            && p.protocol == Some(6)
            && p.ports.0 <= 8080
            && p.ports.1 >= 8080
    })
}

/// The API server with namespace `k`, pod `k/a` on another node, pod
/// `k/b` (at `f.pod_ip`) on this node, and policy `allow-a` (TCP 8080 from
/// `a` into `b`).
async fn cluster(f: &Fixture) -> npm_testapi::TestApiServer {
    let (srv, client) = server(true).await;
    create_namespaces(&client, &[namespace("k", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("k", "a", "node-b", Some("10.99.0.5"), &[("app", "a")]),
            pod("k", "b", "node-a", Some(&f.pod_ip), &[("app", "b")]),
        ],
        2,
    )
    .await;
    create_policy(
        &client,
        "k",
        serde_json::json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": {"name": "allow-a", "namespace": "k"},
            "spec": {"podSelector": {"matchLabels": {"app": "b"}},
                     "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "a"}}}],
                                  "ports": [{"port": 8080}]}]}}),
    )
    .await
    .expect("create policy");
    srv
}

async fn stops_cleanly_on(signal: libc::c_int, tag: &str, net: u8) {
    let f = setup(tag, net);
    let srv = cluster(&f).await;
    let kubeconfig = f.work_dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).expect("write kubeconfig");

    let mut agent = AgentProcess::spawn(&f, &kubeconfig);
    agent
        .wait_for("/readyz 200", Duration::from_secs(30), |a| {
            a.get_status("/readyz") == Some(200)
        })
        .await;
    let pin_dir = f.pin_dir.clone();
    let ip = f.pod_ip.clone();
    agent
        .wait_for("endpoint b attached with its policy", Duration::from_secs(20), |_| {
            dump_pinned(&pin_dir)
                .map(|d| attached_endpoint(&d, &ip) && has_allow_8080(&d, &ip))
                .unwrap_or(false)
        })
        .await;
    let before = dump_pinned(&f.pin_dir).expect("dump while running");
    let links_before = pinned_link_programs(&f.pin_dir).expect("links while running");
    assert_eq!(links_before.len(), 2, "{links_before:?}");

    let (status, took) = agent.signal_and_wait(signal, Duration::from_secs(5)).await;
    let log = agent.log_text();
    assert!(
        status.success(),
        "exit status {status:?} after signal {signal}; log:\n{log}"
    );
    assert!(log.contains("shutting down"), "no \"shutting down\" in the log:\n{log}");
    eprintln!("signal {signal}: exited in {took:?}");

    // The HTTP server is gone with the process.
    assert_eq!(agent.get_status("/healthz"), None, "HTTP server still answering");
    // The dataplane state is left in place: same maps content, same links
    // carrying the same programs.
    let after = dump_pinned(&f.pin_dir).expect("pinned state after the agent exited");
    assert_eq!(after.endpoints, before.endpoints);
    // This node's own addresses (`IDENTITY_HOST`) follow the root netns,
    // where concurrent tests add and remove interfaces: a sync between the
    // dump and the signal may take one in or out. Every other entry is this
    // agent's state and must be left as it was.
    let not_host = |d: &EbpfDump| -> Vec<_> {
        d.ipcache
            .iter()
            .filter(|e| e.identity != npm_common::IDENTITY_HOST)
            .cloned()
            .collect()
    };
    assert_eq!(not_host(&after), not_host(&before));
    assert_eq!(after.policy, before.policy);
    assert!(
        attached_endpoint(&after, &f.pod_ip) && has_allow_8080(&after, &f.pod_ip),
        "{after:?}"
    );
    assert_eq!(
        pinned_link_programs(&f.pin_dir).expect("links after exit"),
        links_before
    );

    // `inspect` reads that state with no eBPF object at hand and leaves
    // the links (and their programs) as they are.
    let no_object = f.work_dir.join("no-such-object.o");
    let json = inspect_json(&f.pin_dir, &[("NPM_EBPF_OBJECT", no_object.as_os_str())]);
    assert!(
        json["endpoints"]
            .as_array()
            .is_some_and(|eps| eps.iter().any(|e| e["ipv4"] == f.pod_ip.as_str())),
        "{json}"
    );
    assert_eq!(
        pinned_link_programs(&f.pin_dir).expect("links after inspect"),
        links_before
    );
    drop(agent);
    drop(srv);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_stops_cleanly_and_keeps_enforcement() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    stops_cleanly_on(libc::SIGTERM, "t", (std::process::id() % 100) as u8 + 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigint_stops_cleanly_and_keeps_enforcement() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    stops_cleanly_on(libc::SIGINT, "i", (std::process::id() % 100) as u8 + 101).await;
}

/// `nft list table inet <table>`, `None` when there is no such table.
fn nft_table(table: &str) -> Option<String> {
    let out = Command::new("nft")
        .args(["list", "table", "inet", table])
        .output()
        .expect("run nft");
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Deletes the nft table on drop.
struct NftTable(String);

impl Drop for NftTable {
    fn drop(&mut self) {
        for family in ["inet", "bridge"] {
            let _ = Command::new("nft").args(["delete", "table", family, &self.0]).output();
        }
    }
}

/// Deletes `inet`/`bridge` `npmst<pid>` tables whose process is gone.
fn clear_stale_tables() {
    let Ok(out) = Command::new("nft").args(["list", "tables"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        for family in ["inet", "bridge"] {
            let Some(name) = line.strip_prefix(&format!("table {family} ")) else {
                continue;
            };
            if name.starts_with(PREFIX) && pid_gone(name, PREFIX) {
                let _ = Command::new("nft").args(["delete", "table", family, name]).output();
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_nftables_keeps_the_table() {
    clear_stale_tables();
    let f = setup("n", (std::process::id() % 50) as u8 + 201);
    let table = format!("npmst{}n", std::process::id());
    let _guard = NftTable(table.clone());
    let srv = cluster(&f).await;
    let kubeconfig = f.work_dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).expect("write kubeconfig");

    let mut agent = AgentProcess::spawn_with(&f, &kubeconfig, &["--dataplane", "nftables", "--nft-table", &table]);
    agent
        .wait_for("/readyz 200", Duration::from_secs(30), |a| {
            a.get_status("/readyz") == Some(200)
        })
        .await;
    // The table carries pod b's ingress allow of TCP 8080 from pod a.
    let (t, ip) = (table.clone(), f.pod_ip.clone());
    agent
        .wait_for("the table with b's rules", Duration::from_secs(20), |_| {
            nft_table(&t).is_some_and(|r| r.contains("8080") && r.contains(&ip) && r.contains("10.99.0.5"))
        })
        .await;
    let before = nft_table(&table).expect("table while running");

    let (status, _) = agent.signal_and_wait(libc::SIGTERM, Duration::from_secs(5)).await;
    let log = agent.log_text();
    assert!(status.success(), "exit status {status:?}; log:\n{log}");
    assert!(log.contains("shutting down"), "no \"shutting down\" in the log:\n{log}");
    assert_eq!(agent.get_status("/healthz"), None, "HTTP server still answering");
    // The ruleset is left as it was: it keeps enforcing until the next agent.
    let after = nft_table(&table).expect("the table is still there after the exit");
    // Counter values move with any packet (an IPv6 router solicitation of
    // the pod's interface): both inline counters and named counter objects
    // are left out of the comparison. So are the elements of the sets of
    // the node's own addresses (`id_2_*`, the host identity, and
    // `not_world_*`, every known address): other tests of this binary add
    // addresses to the node (the root netns) at any time, and the agent
    // follows them until it stops.
    let stable = |s: &str| {
        let mut out = Vec::new();
        let (mut in_node_set, mut skipping) = (false, false);
        for l in s.lines() {
            if skipping {
                skipping = !l.trim_end().ends_with('}');
                continue;
            }
            if l.starts_with("\tset ") {
                in_node_set = ["id_2_v4", "id_2_v6", "not_world_v4", "not_world_v6"]
                    .iter()
                    .any(|n| l.starts_with(&format!("\tset {n} ")));
            }
            if in_node_set && l.trim_start().starts_with("elements = {") {
                out.push("\t\telements = <the node's addresses>".to_string());
                skipping = !l.trim_end().ends_with('}');
                continue;
            }
            if l.trim_start().starts_with("packets ") {
                continue;
            }
            out.push(l.split(" counter packets").next().unwrap_or(l).to_string());
        }
        out
    };
    assert_eq!(stable(&after), stable(&before));
    drop(agent);
    drop(srv);
}
