//! One agent per pin directory: a second `npm-agent run` on the pin
//! directory of a running agent exits non-zero within seconds, saying
//! another agent runs there (it touches neither the kernel nor the first
//! agent, which stays ready); once the first agent stopped, a new one
//! starts on the same pin directory (the kernel released the lock).
//!
//! Real eBPF agents (`NPM_EBPF_OBJECT`), the test API server, pin dir
//! `/sys/fs/bpf/npmlk<pid>`, lock and CNI socket in a work dir. Needs root.

use std::path::{Path, PathBuf};
use std::process::Child;
use std::time::{Duration, Instant};

use crate::common::netns::clear_stale_dirs;
use crate::common::process::*;

const PREFIX: &str = "npmlk";

struct Dirs {
    pin_dir: PathBuf,
    work: PathBuf,
}

impl Drop for Dirs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        let _ = std::fs::remove_dir_all(&self.work);
    }
}

/// Kills and reaps the child on drop.
struct Agent(Child);

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn(d: &Dirs, kubeconfig: &Path, tag: &str) -> (Agent, std::net::SocketAddr, PathBuf) {
    let metrics = free_port();
    let log = d.work.join(format!("agent-{tag}.log"));
    let lock_dir = d.work.join("lock");
    let child = spawn_agent_run_with(
        &["--dataplane", "ebpf", "--lock-dir", lock_dir.to_str().unwrap()],
        &d.pin_dir,
        None,
        kubeconfig,
        &format!("nglk{}*", std::process::id()),
        metrics,
        &log,
    );
    (Agent(child), metrics, log)
}

fn wait_ready(metrics: std::net::SocketAddr, log: &Path) {
    let start = Instant::now();
    while http_get(metrics, "/readyz").map(|r| r.0) != Some(200) {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "agent not ready: {}",
            std::fs::read_to_string(log).unwrap_or_default()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_agent_on_the_same_pin_dir_refuses_to_start() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    clear_stale_dirs(std::env::temp_dir(), PREFIX);
    let pid = std::process::id();
    let d = Dirs {
        pin_dir: PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{pid}")),
        work: std::env::temp_dir().join(format!("{PREFIX}{pid}")),
    };
    std::fs::create_dir_all(&d.work).unwrap();
    let (srv, _client) = crate::common::server(true).await;
    let kubeconfig = d.work.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).unwrap();

    let (mut first, m1, log1) = spawn(&d, &kubeconfig, "1");
    tokio::task::block_in_place(|| wait_ready(m1, &log1));

    let (mut second, _, log2) = spawn(&d, &kubeconfig, "2");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = second.0.try_wait().unwrap() {
            break s;
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the second agent is still running"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let text = std::fs::read_to_string(&log2).unwrap();
    assert!(!status.success(), "{text}");
    assert!(
        text.contains(&format!(
            "another npm agent already runs on pin dir {} (lock {} held by pid {})",
            d.pin_dir.display(),
            d.work
                .join("lock")
                .join(format!("agent-sys_fs_bpf_{PREFIX}{pid}.lock"))
                .display(),
            first.0.id()
        )),
        "{text}"
    );
    assert_eq!(
        http_get(m1, "/readyz").map(|r| r.0),
        Some(200),
        "the first agent is untouched"
    );

    // The first agent stops: the lock is free again.
    // SAFETY: kill on our own child.
    unsafe { libc::kill(first.0.id() as i32, libc::SIGTERM) };
    let _ = first.0.wait();
    let (_third, m3, log3) = spawn(&d, &kubeconfig, "3");
    tokio::task::block_in_place(|| wait_ready(m3, &log3));
    drop(second);
    srv.shutdown().await;
}
