//! Network namespace helpers for the kernel tests: commands, threads inside
//! a namespace, a TCP "ok" server and probes, routed pod namespaces.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The kit's commands, namespace threads, sweeps and forwarding guard
/// (`clear_stale_netns` is its `clear_netns_leftovers`).
// The benchmarks include this file too (`examples/bench_support`) and use
// only some of them.
#[allow(unused_imports)]
pub use npm_testkit::netns::{
    clear_netns_leftovers as clear_stale_netns, clear_stale_dirs, clear_stale_links, in_netns, pid_gone,
    remove_links_and_netns, sh, Forwarding,
};

/// A TCP server in `ns` answering "ok" on `addr` until `stop`.
pub fn serve(ns: &str, addr: SocketAddr, stop: Arc<AtomicBool>) {
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(ns, move || {
        let l = TcpListener::bind(addr).expect("bind server");
        l.set_nonblocking(true).unwrap();
        tx.send(()).unwrap();
        while !stop.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((mut s, _)) => {
                    let _ = s.write_all(b"ok");
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(5)).expect("server started");
}

/// One TCP connection from `ns` to `addr`: did it get "ok"?
pub fn probe(ns: &str, addr: SocketAddr) -> bool {
    in_netns(ns, move || {
        let Ok(mut s) = TcpStream::connect_timeout(&addr, Duration::from_millis(500)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_millis(500)));
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).is_ok() && &buf == b"ok"
    })
    .join()
    .unwrap()
}

/// Probe until the result is `want` (at most 15 s).
pub async fn expect_probe(ns: &str, addr: SocketAddr, want: bool, what: &str) {
    let start = Instant::now();
    loop {
        let ns2 = ns.to_string();
        let got = tokio::task::spawn_blocking(move || probe(&ns2, addr)).await.unwrap();
        if got == want {
            return;
        }
        assert!(
            start.elapsed() < Duration::from_secs(15),
            "probe to {addr} should be {want}: {what}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Delete the `inet` and `bridge` nft tables named `<prefix><pid>...`
/// whose process is gone (a crashed run's nftables agent).
pub fn clear_stale_nft_tables(prefix: &str) {
    let Ok(out) = Command::new("nft").args(["list", "tables"]).output() else {
        return;
    };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        for family in ["inet", "bridge"] {
            if let Some(name) = line.strip_prefix(&format!("table {family} ")) {
                if name.starts_with(prefix) && pid_gone(name, prefix) {
                    let _ = Command::new("nft").args(["delete", "table", family, name]).output();
                }
            }
        }
    }
}

/// Create pod namespace `ns` joined to the root netns by veth `host` (its
/// peer is `eth0` in `ns`): the host side gets `<subnet>.<net>.1/24`, the
/// pod `<subnet>.<net>.2/24` and a default route via the host side.
pub fn add_routed_pod(ns: &str, host: &str, subnet: &str, net: usize) {
    sh(&["ip", "netns", "add", ns]);
    sh(&["ip", "-n", ns, "link", "set", "lo", "up"]);
    sh(&[
        "ip", "link", "add", host, "type", "veth", "peer", "name", "eth0", "netns", ns,
    ]);
    sh(&["ip", "addr", "add", &format!("{subnet}.{net}.1/24"), "dev", host]);
    sh(&["ip", "link", "set", host, "up"]);
    sh(&[
        "ip",
        "-n",
        ns,
        "addr",
        "add",
        &format!("{subnet}.{net}.2/24"),
        "dev",
        "eth0",
    ]);
    sh(&["ip", "-n", ns, "link", "set", "eth0", "up"]);
    sh(&[
        "ip",
        "-n",
        ns,
        "route",
        "add",
        "default",
        "via",
        &format!("{subnet}.{net}.1"),
    ]);
}

/// Pod namespaces routed from the root namespace (see [`add_routed_pod`]),
/// a bpffs pin directory for the agent, and IPv4 forwarding, enabled while
/// it lives. On drop the servers watching `stop` stop, the veths, the
/// namespaces and the pin directory are removed and forwarding is restored.
pub struct RoutedPods<const N: usize> {
    /// The pod namespaces, `<prefix><pid><tag>`.
    pub pods: [String; N],
    /// Their host-side veths, `<veth><pid><tag>`.
    pub veths: [String; N],
    /// `/sys/fs/bpf/<prefix><pid>`.
    pub pin_dir: PathBuf,
    /// Set on drop.
    pub stop: Arc<AtomicBool>,
    _forwarding: Forwarding,
}

impl<const N: usize> RoutedPods<N> {
    /// One pod per tag; pod `i` (from 1) is `<subnet>.<i>.2/24` behind
    /// `<subnet>.<i>.1` on its veth.
    pub fn new(prefix: &str, veth: &str, tags: [&str; N], subnet: &str) -> Self {
        let pid = std::process::id();
        let t = RoutedPods {
            pods: tags.map(|x| format!("{prefix}{pid}{x}")),
            veths: tags.map(|x| format!("{veth}{pid}{x}")),
            pin_dir: PathBuf::from(format!("/sys/fs/bpf/{prefix}{pid}")),
            stop: Arc::new(AtomicBool::new(false)),
            _forwarding: Forwarding::on(),
        };
        for (i, (ns, host)) in t.pods.iter().zip(&t.veths).enumerate() {
            add_routed_pod(ns, host, subnet, i + 1);
        }
        t
    }
}

impl<const N: usize> Drop for RoutedPods<N> {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        remove_links_and_netns(&self.veths, &self.pods);
        let _ = std::fs::remove_dir_all(&self.pin_dir);
    }
}
