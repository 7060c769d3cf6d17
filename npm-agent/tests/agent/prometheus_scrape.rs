//! A real Prometheus (Debian's `prometheus`, `cargo xtask setup` installs
//! it) scrapes the real `npm-agent run` binary every second, and its HTTP
//! API answers the queries the chart's dashboard is built on: the
//! programming-latency histogram (count and p99) and the drop counter with
//! their labels, and `npm_build_info`. One test per dataplane.
//!
//! Setup per test: the test API server (namespace `k`, pods `k/a` and
//! `k/b` of `node-a`), two routed netns pods (`RoutedPods`, pod b serving
//! TCP 8080), the agent with the eBPF dataplane (pins under
//! `/sys/fs/bpf/npmpe<pid>`) or the nftables dataplane (table
//! `npmpn<pid>`), and Prometheus with a generated config, its TSDB in a
//! unique temp dir and its web listener on a free loopback port. Policy
//! changes: `k/deny-b` (a's probe to b is then dropped at b's ingress),
//! then `k/allow-a`. With eBPF the denied probe also produces a JSON flow
//! log line on the agent's stdout naming pod `k/b`, peer `k/a` and the
//! isolating policy `k/deny-b`.
//!
//! Leftovers of a crashed run (dead pid in the name) are removed first;
//! both children get SIGKILL if the test process dies (PDEATHSIG) and are
//! killed and reaped on drop. Needs root.

use std::net::SocketAddr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use crate::common::netns::{
    clear_stale_dirs, clear_stale_links, clear_stale_netns, expect_probe, pid_gone, serve, RoutedPods,
};
use crate::common::process::*;
use crate::common::*;
use serde_json::Value;

/// A child process, SIGKILLed and reaped on drop.
struct Reaped(Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A directory removed on drop.
struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// An nftables table (inet and bridge) deleted on drop.
struct NftTable(String);

impl Drop for NftTable {
    fn drop(&mut self) {
        for family in ["inet", "bridge"] {
            let _ = Command::new("nft").args(["delete", "table", family, &self.0]).output();
        }
    }
}

fn clear_leftovers(prefix: &str, veth: &str) {
    clear_stale_netns(prefix);
    clear_stale_links(veth);
    clear_stale_dirs("/sys/fs/bpf", prefix);
    clear_stale_dirs(std::env::temp_dir(), prefix);
    if let Ok(out) = Command::new("nft").args(["list", "tables"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut words = line.split_whitespace().skip(1);
            let (Some(family), Some(name)) = (words.next(), words.next()) else {
                continue;
            };
            if name.starts_with(prefix) && pid_gone(name, prefix) {
                let _ = Command::new("nft").args(["delete", "table", family, name]).output();
            }
        }
    }
}

fn ebpf_object() -> PathBuf {
    let path = std::env::var_os("NPM_EBPF_OBJECT").map(PathBuf::from).expect(
        "NPM_EBPF_OBJECT is not set: build the eBPF object (`cargo xtask build-ebpf`) and set \
         NPM_EBPF_OBJECT=target/bpfel-unknown-none/release/npm-ebpf",
    );
    assert!(path.exists(), "NPM_EBPF_OBJECT={} does not exist", path.display());
    path
}

/// Starts `prometheus` scraping `target` every second; its config, TSDB
/// and log live in `dir`.
fn spawn_prometheus(dir: &Path, target: SocketAddr, web: SocketAddr) -> Reaped {
    let bin = which("prometheus").expect("prometheus is not installed: run `cargo xtask setup`");
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n  evaluation_interval: 1s\n\
             scrape_configs:\n  - job_name: npm-agent\n    static_configs:\n      - targets: [\"{target}\"]\n        \
             labels:\n          node: node-a\n"
        ),
    )
    .unwrap();
    let log = std::fs::File::create(dir.join("prometheus.log")).unwrap();
    let mut cmd = Command::new(bin);
    cmd.arg(format!("--config.file={}", config.display()))
        .arg(format!("--storage.tsdb.path={}", dir.join("tsdb").display()))
        .arg(format!("--web.listen-address={web}"))
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log);
    // SAFETY: prctl is async-signal-safe; it only sets this child's
    // parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    Reaped(cmd.spawn().expect("spawn prometheus"))
}

fn which(name: &str) -> Option<PathBuf> {
    std::env::var_os("PATH")?
        .to_str()?
        .split(':')
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file())
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The result vector of an instant query (`/api/v1/query`), `None` while
/// Prometheus does not answer or answers with an error.
fn query(web: SocketAddr, promql: &str) -> Option<Vec<Value>> {
    let (code, body) = http_get(web, &format!("/api/v1/query?query={}", url_encode(promql)))?;
    if code != 200 {
        return None;
    }
    let v: Value = serde_json::from_str(&body).ok()?;
    (v["status"] == "success").then(|| v["data"]["result"].as_array().cloned())?
}

fn value(sample: &Value) -> f64 {
    sample["value"][1]
        .as_str()
        .and_then(|s| s.parse().ok())
        .unwrap_or(f64::NAN)
}

/// Polls `promql` until `accept` holds for its result (at most `timeout`);
/// returns that result.
async fn wait_query(web: SocketAddr, promql: &str, timeout: Duration, accept: impl Fn(&[Value]) -> bool) -> Vec<Value> {
    let start = Instant::now();
    let mut last = None;
    loop {
        let q = promql.to_string();
        let got = tokio::task::spawn_blocking(move || query(web, &q)).await.unwrap();
        if let Some(r) = &got {
            if accept(r) {
                return r.clone();
            }
        }
        last = got.or(last);
        assert!(
            start.elapsed() < timeout,
            "{promql}: no acceptable answer in {timeout:?}; last {last:?}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Which dataplane a run uses.
#[derive(Clone, Copy, PartialEq)]
enum Plane {
    Ebpf,
    Nft,
}

async fn scrape(plane: Plane) {
    let (prefix, veth, subnet) = match plane {
        Plane::Ebpf => ("npmpe", "ngpe", "10.226"),
        Plane::Nft => ("npmpn", "ngpn", "10.227"),
    };
    clear_leftovers(prefix, veth);
    let pid = std::process::id();
    let work = TempDir(std::env::temp_dir().join(format!("{prefix}{pid}")));
    std::fs::create_dir_all(&work.0).unwrap();
    let topo = RoutedPods::new(prefix, veth, ["a", "b"], subnet);
    let server_addr: SocketAddr = format!("{subnet}.2.2:8080").parse().unwrap();
    serve(&topo.pods[1], server_addr, topo.stop.clone());

    let (srv, client) = two_pod_server(subnet).await;
    let kubeconfig = work.0.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).expect("write kubeconfig");
    let metrics = free_port();
    let log = work.0.join("agent.log");
    let table = format!("{prefix}{pid}");
    let _table = NftTable(table.clone());
    let object = (plane == Plane::Ebpf).then(ebpf_object);
    let dataplane_args: Vec<&str> = match plane {
        Plane::Ebpf => vec!["--dataplane", "ebpf"],
        Plane::Nft => vec!["--dataplane", "nftables", "--nft-table", &table],
    };
    let _agent = Reaped(spawn_agent_run_with(
        &dataplane_args,
        &topo.pin_dir,
        object.as_deref(),
        &kubeconfig,
        &format!("{veth}{pid}*"),
        metrics,
        &log,
    ));
    let agent_log = || std::fs::read_to_string(&log).unwrap_or_default();
    let start = Instant::now();
    while http_get(metrics, "/readyz").map(|r| r.0) != Some(200) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "agent not ready:\n{}",
            agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    expect_probe(&topo.pods[0], server_addr, true, "no policy yet").await;

    let web = free_port();
    let _prom = spawn_prometheus(&work.0, metrics, web);
    // The target is up and scraped.
    let up = wait_query(web, "up{job=\"npm-agent\"}", Duration::from_secs(30), |r| {
        r.len() == 1 && value(&r[0]) == 1.0
    })
    .await;
    assert_eq!(up[0]["metric"]["instance"], metrics.to_string());
    let build = wait_query(web, "npm_build_info{job=\"npm-agent\"}", Duration::from_secs(10), |r| {
        r.len() == 1
    })
    .await;
    assert_eq!(build[0]["metric"]["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(value(&build[0]), 1.0);
    let count_q = "npm_programming_latency_seconds_count{job=\"npm-agent\",node=\"node-a\"}";
    let before = value(&wait_query(web, count_q, Duration::from_secs(10), |r| r.len() == 1).await[0]);

    // A policy change, a denied packet, another policy change.
    create_policy(&client, "k", deny_b()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr, false, "b is ingress-isolated").await;
    if plane == Plane::Ebpf {
        // The flow log names the pod, the peer pod and the isolating policy
        // (read before the next change: the names are those of the state
        // programmed when the agent reads the event).
        let deny = || {
            agent_log()
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .find(|v| v["verdict"] == "deny" && v["direction"] == "ingress")
        };
        let start = Instant::now();
        let line = loop {
            if let Some(line) = deny() {
                break line;
            }
            assert!(
                start.elapsed() < Duration::from_secs(20),
                "no deny flow log line:\n{}",
                agent_log()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let (a_ip, b_ip) = (format!("{subnet}.1.2"), format!("{subnet}.2.2"));
        assert_eq!(
            line["pod"],
            serde_json::json!({"namespace": "k", "name": "b"}),
            "{line}"
        );
        assert_eq!(
            line["peer"],
            serde_json::json!({"kind": "pod", "namespace": "k", "name": "a"}),
            "{line}"
        );
        assert_eq!(line["policies"], serde_json::json!(["k/deny-b"]), "{line}");
        assert_eq!(line["reason"], "policy-denied", "{line}");
        assert_eq!(line["protocol"], "TCP", "{line}");
        assert_eq!(line["dst"], format!("{b_ip}:8080"), "{line}");
        assert_eq!(line["peer_ip"], a_ip, "{line}");
        eprintln!("flow log: {line}");
    }
    create_policy(&client, "k", allow_a()).await.unwrap();
    expect_probe(&topo.pods[0], server_addr, true, "a allowed to b:8080").await;

    // Both changes were programmed: the histogram's count, as Prometheus
    // stored it, went up by at least two.
    let after = wait_query(web, count_q, Duration::from_secs(20), |r| {
        r.len() == 1 && value(&r[0]) >= before + 2.0
    })
    .await;
    let after = value(&after[0]);
    // The p99 over the last minute: a real number inside the buckets.
    let p99_q =
        "histogram_quantile(0.99, sum by (le) (rate(npm_programming_latency_seconds_bucket{job=\"npm-agent\"}[1m])))";
    let p99 = wait_query(web, p99_q, Duration::from_secs(20), |r| {
        r.len() == 1 && value(&r[0]).is_finite()
    })
    .await;
    let p99 = value(&p99[0]);
    assert!(p99 > 0.0 && p99 <= 30.0, "p99 {p99}");
    // The drop counter: b's ingress, reason policy-denied.
    let drops_q = "sum by (direction, reason, verdict) (npm_packets_total{job=\"npm-agent\",verdict=\"denied\"})";
    let drops = wait_query(web, drops_q, Duration::from_secs(20), |r| {
        r.iter().any(|s| {
            s["metric"]["direction"] == "ingress" && s["metric"]["reason"] == "policy-denied" && value(s) > 0.0
        })
    })
    .await;
    let denied: f64 = drops.iter().map(value).sum();
    eprintln!(
        "{}: programming latency count {before} -> {after}, p99 {:.1} ms, denied packets {denied}",
        if plane == Plane::Ebpf { "ebpf" } else { "nftables" },
        p99 * 1e3
    );

    if plane == Plane::Ebpf {
        wait_query(
            web,
            "npm_deny_events_total{job=\"npm-agent\"}",
            Duration::from_secs(20),
            |r| r.len() == 1 && value(&r[0]) > 0.0,
        )
        .await;
        // The kernel maps' fill, as the live agent publishes it: the two
        // pods' endpoint slots (their ifindexes fit the direct-mapped slot
        // array) and the ipcache entries it wrote, against the maps'
        // capacity; the ring-buffer loss counter exists from the start.
        wait_query(
            web,
            "npm_map_entries{job=\"npm-agent\",map=\"NPM_EP_SLOTS\"}",
            Duration::from_secs(20),
            |r| r.len() == 1 && value(&r[0]) >= 2.0,
        )
        .await;
        wait_query(
            web,
            "npm_map_capacity{job=\"npm-agent\",map=\"NPM_IPCACHE\"} > npm_map_entries{job=\"npm-agent\",map=\"NPM_IPCACHE\"} > 0",
            Duration::from_secs(20),
            |r| r.len() == 1,
        )
        .await;
        wait_query(
            web,
            "npm_ringbuf_events_lost_total{job=\"npm-agent\"}",
            Duration::from_secs(20),
            |r| r.len() == 1,
        )
        .await;
    }
    drop(_prom);
    drop(_agent);
    srv.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_ebpf_agent() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    scrape(Plane::Ebpf).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_nftables_agent() {
    scrape(Plane::Nft).await;
}
