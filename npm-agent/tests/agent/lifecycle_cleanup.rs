//! `npm-agent cleanup` after a real agent run, on both dataplanes: the
//! agent (the binary, real test API server) enforces a deny policy between
//! two routed pod namespaces, is stopped (SIGTERM: its kernel state keeps
//! enforcing, the denied probe still fails), and `cleanup` then leaves no
//! program attached to the pods' interfaces (read through the kernel's tcx
//! query), no pin, no nftables table, no npm-cni entry in the conflist and
//! no npm-cni binary, and traffic flows as without npm: the denied probe
//! connects. A second cleanup succeeds and changes nothing.
//!
//! The eBPF agent runs once per attach mode (tcx links, tc filters).
//!
//! Names carry the process id (netns `npml{c,t,n}<pid>a|b`, veths
//! `ngl{c,t,n}<pid>*`, pin dirs `/sys/fs/bpf/npml{c,t,n}<pid>`, nft table
//! `npmln<pid>`). Needs root and, for
//! eBPF, `NPM_EBPF_OBJECT`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use crate::common::netns::*;
use crate::common::process::*;
use crate::common::*;
use aya::programs::tc::{SchedClassifier, TcAttachType};

/// The agent child; killed and reaped on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The work dir (kubeconfig, logs, CNI dirs); removed on drop.
struct Work(PathBuf);

impl Drop for Work {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

const CONFLIST: &str = r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"ptp","ipam":{"type":"host-local"}},{"type":"npm-cni","agentSocket":"/run/npm/cni.sock"}]}"#;

/// The programs attached to `ifname`, both hooks, in both attach modes the
/// loader has: tcx (the kernel's tcx query) and tc (the `clsact` filters'
/// netlink dump): `(hook, mode, program name)`.
fn attached_programs(ifname: &str) -> Vec<(TcAttachType, &'static str, String)> {
    let ifindex = std::fs::read_to_string(format!("/sys/class/net/{ifname}/ifindex"))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let mut out = Vec::new();
    for hook in [TcAttachType::Ingress, TcAttachType::Egress] {
        if let Ok((_, progs)) = SchedClassifier::query_tcx(ifname, hook) {
            out.extend(
                progs
                    .iter()
                    .map(|p| (hook, "tcx", p.name_as_str().unwrap_or("?").to_string())),
            );
        }
        let filters = npm_dataplane::ebpf::tc_filters::list_filters(ifindex, hook).expect("dump tc filters");
        out.extend(filters.into_iter().map(|f| (hook, "tc", f.name)));
    }
    out
}

fn nft_table_exists(table: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "inet", table])
        .output()
        .expect("run nft")
        .status
        .success()
}

fn cleanup(pin_dir: &Path, conf: &Path, bin: &Path, table: &str) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_npm-agent"))
        .arg("cleanup")
        .arg(format!("--pin-dir={}", pin_dir.display()))
        .arg(format!("--cni-conf-dir={}", conf.display()))
        .arg(format!("--cni-bin-dir={}", bin.display()))
        .arg(format!("--nft-table={table}"))
        .output()
        .expect("run npm-agent cleanup");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "cleanup failed: {err}");
    err
}

/// One run: agent with `dataplane_args`, deny policy, SIGTERM, cleanup.
async fn agent_then_cleanup(prefix: &str, veth: &str, subnet: &str, dataplane_args: &[&str], table: &str) {
    clear_stale_netns(prefix);
    clear_stale_links(veth);
    clear_stale_dirs("/sys/fs/bpf", prefix);
    clear_stale_dirs(std::env::temp_dir(), prefix);
    clear_stale_nft_tables(prefix);
    let pid = std::process::id();
    let topo = RoutedPods::new(prefix, veth, ["a", "b"], subnet);
    let work = Work(std::env::temp_dir().join(format!("{prefix}{pid}")));
    let (conf, bin) = (work.0.join("net.d"), work.0.join("bin"));
    std::fs::create_dir_all(&conf).unwrap();
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(conf.join("10-k8s.conflist"), CONFLIST).unwrap();
    std::fs::write(bin.join("npm-cni"), b"#!/bin/false\n").unwrap();
    std::fs::write(bin.join("ptp"), b"#!/bin/false\n").unwrap();

    let server: SocketAddr = format!("{subnet}.2.2:8080").parse().unwrap();
    serve(&topo.pods[1], server, topo.stop.clone());
    // The topology delivers before npm (polled: a new veth under load may take
    // a moment; the first probe of the full suite once missed).
    expect_probe(&topo.pods[0], server, true, "a reaches b before npm").await;
    let (srv, client) = two_pod_server(subnet).await;
    let kubeconfig = work.0.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).unwrap();

    let mut args = dataplane_args.to_vec();
    args.extend(["--lock-dir", work.0.to_str().unwrap()]);
    let metrics = free_port();
    let log = work.0.join("agent.log");
    let mut agent = Agent(spawn_agent_run_with(
        &args,
        &topo.pin_dir,
        None,
        &kubeconfig,
        &format!("{veth}{pid}*"),
        metrics,
        &log,
    ));
    let start = Instant::now();
    while http_get(metrics, "/readyz").map(|r| r.0) != Some(200) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "agent not ready: {}",
            std::fs::read_to_string(&log).unwrap_or_default()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    create_policy(&client, "k", deny_b()).await.unwrap();
    expect_probe(&topo.pods[0], server, false, "b is ingress-isolated").await;

    // SAFETY: kill on our own child.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    assert!(agent.0.wait().unwrap().success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !probe(&topo.pods[0], server),
        "the stopped agent's state still enforces"
    );
    if dataplane_args.contains(&"ebpf") {
        assert!(topo.pin_dir.exists());
        let mode = if dataplane_args.contains(&"tc") { "tc" } else { "tcx" };
        let before = attached_programs(&topo.veths[1]);
        assert!(
            before.iter().any(|(_, m, _)| *m == mode),
            "{mode} programs attached before cleanup: {before:?}"
        );
    } else {
        assert!(nft_table_exists(table));
    }

    let text = cleanup(&topo.pin_dir, &conf, &bin, table);
    assert!(text.contains("npm removed from this node"), "{text}");
    assert!(!topo.pin_dir.exists(), "no pin left");
    for v in &topo.veths {
        assert_eq!(attached_programs(v), [], "no program attached to {v}");
    }
    assert!(!nft_table_exists(table), "no nftables table left");
    let list = std::fs::read_to_string(conf.join("10-k8s.conflist")).unwrap();
    assert!(!list.contains("npm-cni"), "{list}");
    assert!(list.contains("\"ptp\""), "the other plugins stay: {list}");
    assert!(!bin.join("npm-cni").exists(), "npm-cni binary removed");
    assert!(bin.join("ptp").exists());
    expect_probe(&topo.pods[0], server, true, "traffic flows as without npm").await;

    // Idempotent.
    cleanup(&topo.pin_dir, &conf, &bin, table);
    assert!(probe(&topo.pods[0], server));
    srv.shutdown().await;
    drop(topo);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_after_an_ebpf_agent_with_tcx_links_leaves_nothing_and_traffic_flows() {
    let table = format!("npmlc{}", std::process::id());
    let args = ["--dataplane", "ebpf", "--attach", "tcx"];
    agent_then_cleanup("npmlc", "nglc", "10.218", &args, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_after_an_ebpf_agent_with_tc_filters_leaves_nothing_and_traffic_flows() {
    // npm tc filters on the node: no `auto` agent of another test meanwhile.
    let _tc = crate::TC_FILTERS.write().await;
    let table = format!("npmlt{}", std::process::id());
    let args = ["--dataplane", "ebpf", "--attach", "tc"];
    agent_then_cleanup("npmlt", "nglt", "10.220", &args, &table).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cleanup_after_an_nftables_agent_leaves_nothing_and_traffic_flows() {
    let table = format!("npmln{}", std::process::id());
    agent_then_cleanup(
        "npmln",
        "ngln",
        "10.219",
        &["--dataplane", "nftables", "--nft-table", &table],
        &table,
    )
    .await;
}
