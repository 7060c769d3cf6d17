//! `kill -9` of the real `npm-agent` binary under traffic: an allowed,
//! established TCP flow keeps flowing, denied traffic stays denied, and a
//! new agent process on the same pin directory adopts the pinned state and
//! converges without a single failed round trip.
//!
//! Topology: three pod namespaces (`a` client, `s` server, `c` denied
//! client) behind host-side veths in the root namespace; the agent binary
//! runs with `--dataplane ebpf` against the test API server through a
//! generated kubeconfig. The flow is one long-lived TCP connection a->s
//! exchanging 4 bytes every ~10 ms; a round trip that errors or takes more
//! than 500 ms is a failure, and the TCP retransmission counters of both
//! ends must stay 0 (a dropped segment is retransmitted, so this sees drops
//! that a 500 ms timeout would hide).
//!
//! Names carry the process id (netns `npmrk<pid>a|s|c`, veths
//! `ngk<pid>a|s|c`, pin dir `/sys/fs/bpf/npmrk<pid>`); leftovers of crashed
//! runs are removed first. IPv4 forwarding of the root namespace is
//! switched on for the test and restored afterwards. The agent child gets
//! SIGKILL when the test ends (guard) or the test thread dies (PDEATHSIG).

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::common::netns::*;
use crate::common::process::*;
use crate::common::*;

const PREFIX: &str = "npmrk";
const VETH: &str = "ngk";
/// A round trip slower than this is a failure.
const RTT_LIMIT: Duration = Duration::from_millis(500);

fn server_addr() -> SocketAddr {
    "10.215.2.2:8080".parse().unwrap()
}

/// The routed pod namespaces (a, s, c), their pin dir and a work dir;
/// removed on drop.
struct Topology {
    /// Namespaces of a, s, c.
    routed: RoutedPods<3>,
    work_dir: PathBuf,
}

impl Drop for Topology {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.work_dir);
    }
}

fn clear_leftovers() {
    clear_stale_netns(PREFIX);
    clear_stale_links(VETH);
    for dir in ["/sys/fs/bpf", "/tmp"] {
        clear_stale_dirs(dir, PREFIX);
    }
}

fn setup() -> Topology {
    clear_leftovers();
    let work_dir = std::env::temp_dir().join(format!("{PREFIX}{}", std::process::id()));
    std::fs::create_dir_all(&work_dir).expect("create the work dir");
    Topology {
        routed: RoutedPods::new(PREFIX, VETH, ["a", "s", "c"], "10.215"),
        work_dir,
    }
}

/// Total retransmitted segments of a TCP socket.
fn total_retrans(s: &TcpStream) -> u32 {
    // SAFETY: tcp_info is plain data; getsockopt writes at most `len` bytes.
    let mut info: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: valid socket fd, pointer and length of `info`.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        )
    };
    assert_eq!(rc, 0, "getsockopt TCP_INFO: {}", std::io::Error::last_os_error());
    info.tcpi_total_retrans
}

/// Server in the `s` namespace: every connection gets "ok", then its bytes
/// are echoed until EOF. Retransmissions of the echo connections are summed
/// into `retrans` when they close; `closed` counts closed connections.
struct EchoServer {
    retrans: Arc<AtomicU64>,
    accepted: Arc<AtomicU64>,
    closed: Arc<AtomicU64>,
}

fn echo_server(ns: &str, addr: SocketAddr, stop: Arc<AtomicBool>) -> EchoServer {
    let retrans = Arc::new(AtomicU64::new(0));
    let accepted = Arc::new(AtomicU64::new(0));
    let closed = Arc::new(AtomicU64::new(0));
    let (r2, a2, c2) = (retrans.clone(), accepted.clone(), closed.clone());
    let (tx, rx) = std::sync::mpsc::channel();
    in_netns(ns, move || {
        let l = TcpListener::bind(addr).expect("bind echo server");
        l.set_nonblocking(true).unwrap();
        tx.send(()).unwrap();
        while !stop.load(Ordering::SeqCst) {
            match l.accept() {
                Ok((mut s, _)) => {
                    a2.fetch_add(1, Ordering::SeqCst);
                    let (stop, r2, c2) = (stop.clone(), r2.clone(), c2.clone());
                    // Accepted sockets are created in the listener's namespace.
                    std::thread::spawn(move || {
                        let _ = s.set_nonblocking(false);
                        let _ = s.set_nodelay(true);
                        let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
                        if s.write_all(b"ok").is_err() {
                            return;
                        }
                        let mut buf = [0u8; 64];
                        while !stop.load(Ordering::SeqCst) {
                            match s.read(&mut buf) {
                                Ok(0) => break,
                                Ok(n) => {
                                    if s.write_all(&buf[..n]).is_err() {
                                        break;
                                    }
                                }
                                Err(e)
                                    if matches!(
                                        e.kind(),
                                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                    ) => {}
                                Err(_) => break,
                            }
                        }
                        r2.fetch_add(u64::from(total_retrans(&s)), Ordering::SeqCst);
                        c2.fetch_add(1, Ordering::SeqCst);
                    });
                }
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(5)).expect("echo server started");
    EchoServer {
        retrans,
        accepted,
        closed,
    }
}

/// The long-lived flow's counters.
#[derive(Default)]
struct FlowStats {
    rounds: AtomicU64,
    failures: AtomicU64,
    max_rtt_us: AtomicU64,
    client_retrans: AtomicU64,
    first_failure: Mutex<Option<String>>,
    done: AtomicBool,
}

impl FlowStats {
    fn rounds(&self) -> u64 {
        self.rounds.load(Ordering::SeqCst)
    }
    fn failures(&self) -> u64 {
        self.failures.load(Ordering::SeqCst)
    }
    fn fail(&self, what: String) {
        self.failures.fetch_add(1, Ordering::SeqCst);
        self.first_failure.lock().unwrap().get_or_insert(what);
    }
    fn summary(&self) -> String {
        format!(
            "{} round trips, {} failed (first: {:?}), max rtt {} us, client retransmissions {}",
            self.rounds(),
            self.failures(),
            self.first_failure.lock().unwrap(),
            self.max_rtt_us.load(Ordering::SeqCst),
            self.client_retrans.load(Ordering::SeqCst)
        )
    }
}

/// Open the flow from namespace `ns` and run it on a thread until `stop`.
fn start_flow(ns: &str, addr: SocketAddr, stop: Arc<AtomicBool>) -> (Arc<FlowStats>, std::thread::JoinHandle<()>) {
    let stats = Arc::new(FlowStats::default());
    let st = stats.clone();
    let (tx, rx) = std::sync::mpsc::channel();
    let handle = in_netns(ns, move || {
        let mut s = match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
            Ok(s) => s,
            Err(e) => {
                st.fail(format!("connect: {e}"));
                st.done.store(true, Ordering::SeqCst);
                tx.send(()).ok();
                return;
            }
        };
        s.set_nodelay(true).unwrap();
        s.set_read_timeout(Some(RTT_LIMIT)).unwrap();
        let mut hello = [0u8; 2];
        if let Err(e) = s.read_exact(&mut hello) {
            st.fail(format!("greeting: {e}"));
        }
        tx.send(()).ok();
        let mut seq: u32 = 0;
        while !stop.load(Ordering::SeqCst) && st.failures() == 0 {
            seq = seq.wrapping_add(1);
            let t0 = Instant::now();
            let mut back = [0u8; 4];
            let res = s.write_all(&seq.to_be_bytes()).and_then(|_| s.read_exact(&mut back));
            let rtt = t0.elapsed();
            match res {
                Err(e) => st.fail(format!("round trip {seq} after {rtt:?}: {e}")),
                Ok(()) if back != seq.to_be_bytes() => st.fail(format!("round trip {seq}: echoed {back:?}")),
                Ok(()) if rtt > RTT_LIMIT => st.fail(format!("round trip {seq} took {rtt:?}")),
                Ok(()) => {
                    st.rounds.fetch_add(1, Ordering::SeqCst);
                    st.max_rtt_us.fetch_max(rtt.as_micros() as u64, Ordering::SeqCst);
                }
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        st.client_retrans.store(u64::from(total_retrans(&s)), Ordering::SeqCst);
        st.done.store(true, Ordering::SeqCst);
    });
    rx.recv_timeout(Duration::from_secs(5)).expect("flow started");
    (stats, handle)
}

/// The agent binary as a child process; SIGKILLed and reaped on drop.
struct AgentProcess {
    child: Child,
    log: PathBuf,
    metrics: SocketAddr,
}

impl AgentProcess {
    fn spawn(topo: &Topology, object: &Path, kubeconfig: &Path, generation: u32) -> Self {
        let metrics = free_port();
        let log = topo.work_dir.join(format!("agent{generation}.log"));
        let child = spawn_agent_run(
            &topo.routed.pin_dir,
            Some(object),
            kubeconfig,
            &format!("{VETH}{}*", std::process::id()),
            metrics,
            &log,
        );
        AgentProcess { child, log, metrics }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// `kill -9` and reap.
    fn kill9(&mut self) {
        // SAFETY: plain kill(2) of our own child.
        let rc = unsafe { libc::kill(self.child.id() as libc::pid_t, libc::SIGKILL) };
        assert_eq!(rc, 0, "kill -9 agent: {}", std::io::Error::last_os_error());
        let status = self.child.wait().expect("reap the agent");
        assert!(!status.success(), "the agent should have died of SIGKILL: {status:?}");
    }

    /// HTTP GET `path` on the agent's metrics address: (status code, body).
    fn get(&self, path: &str) -> Option<(u16, String)> {
        http_get(self.metrics, path)
    }

    /// Wait for `/readyz` 200; panic with the agent's log after `timeout`.
    async fn wait_ready(&mut self, timeout: Duration) -> Duration {
        let start = Instant::now();
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                panic!("the agent exited with {status:?}:\n{}", self.log_text());
            }
            if matches!(self.get("/readyz"), Some((200, _))) {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "agent not ready after {timeout:?}; log:\n{}",
                self.log_text()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for AgentProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The text without ANSI colour sequences (`ESC [ ... m`).
fn strip_ansi(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            for c in chars.by_ref() {
                if c == 'm' {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn ebpf_object() -> PathBuf {
    let path = std::env::var_os("NPM_EBPF_OBJECT").map(PathBuf::from).expect(
        "NPM_EBPF_OBJECT is not set: build the eBPF object (`cargo xtask build-ebpf`) and set \
         NPM_EBPF_OBJECT=target/bpfel-unknown-none/release/npm-ebpf",
    );
    assert!(
        path.is_file(),
        "NPM_EBPF_OBJECT={} does not exist: build it with `cargo xtask build-ebpf`",
        path.display()
    );
    path
}

/// One new TCP connection from `ns` to the server: was it let through and
/// greeted? The verdict is taken on the SYN, so the connect gets 1 s; the
/// greeting needs the server thread to run, so it gets 3 s (the test
/// machine's CPUs are shared and may be busy).
fn probe_now(ns: &str) -> bool {
    in_netns(ns, || {
        let Ok(mut s) = TcpStream::connect_timeout(&server_addr(), Duration::from_secs(1)) else {
            return false;
        };
        let _ = s.set_read_timeout(Some(Duration::from_secs(3)));
        let mut buf = [0u8; 2];
        s.read_exact(&mut buf).is_ok() && &buf == b"ok"
    })
    .join()
    .expect("probe thread")
}

/// What a failed check saw: repeated timed probes, the pinned state and the
/// agent's log.
fn diagnose(topo: &Topology, agent: Option<&AgentProcess>) -> String {
    let mut text = String::new();
    for (who, ns) in [("a", &topo.routed.pods[0]), ("c", &topo.routed.pods[2])] {
        let tries: Vec<String> = (0..5)
            .map(|_| {
                let t0 = Instant::now();
                let ok = probe_now(ns);
                std::thread::sleep(Duration::from_millis(100));
                format!("{ok} in {:?}", t0.elapsed())
            })
            .collect();
        text += &format!("probes from {who} now: {tries:?}\n");
    }
    let out = Command::new(env!("CARGO_BIN_EXE_npm-agent"))
        .args(["inspect", "--json", "--pin-dir"])
        .arg(&topo.routed.pin_dir)
        .output();
    if let Ok(out) = out {
        text += &format!(
            "inspect: {}{}\n",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    if let Some(agent) = agent {
        text += &format!("agent log:\n{}", agent.log_text());
    }
    text
}

fn policy(name: &str, from_app: &str) -> serde_json::Value {
    serde_json::json!({"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "k"},
        "spec": {"podSelector": {"matchLabels": {"app": "s"}},
                 "policyTypes": ["Ingress"],
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": from_app}}}],
                              "ports": [{"protocol": "TCP", "port": 8080}]}]}})
}

/// While `dur` passes, the flow must keep making progress with no failure.
async fn flow_progresses(flow: &FlowStats, dur: Duration, what: &str) -> u64 {
    let start = Instant::now();
    let r0 = flow.rounds();
    let mut last = (Instant::now(), r0);
    while start.elapsed() < dur {
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(flow.failures(), 0, "{what}: {}", flow.summary());
        let r = flow.rounds();
        if r > last.1 {
            last = (Instant::now(), r);
        }
        assert!(
            last.0.elapsed() < Duration::from_secs(1),
            "{what}: the flow stalled: {}",
            flow.summary()
        );
    }
    flow.rounds() - r0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_under_traffic_keeps_enforcing_and_restart_converges() {
    // An `auto` agent: no other test's npm tc filters on the node meanwhile.
    let _tc = crate::TC_FILTERS.read().await;
    let object = ebpf_object();
    let topo = setup();
    let [ns_a, ns_s, ns_c] = topo.routed.pods.clone();
    let echo = echo_server(&ns_s, server_addr(), topo.routed.stop.clone());
    assert!(probe_now(&ns_a), "a reaches s before any agent");
    assert!(probe_now(&ns_c), "c reaches s before any agent");

    let (srv, client) = server(true).await;
    let kubeconfig = topo.work_dir.join("kubeconfig");
    srv.kubeconfig(&kubeconfig).expect("write kubeconfig");
    create_namespaces(&client, &[namespace("k", &[])]).await;
    create_pods(
        &client,
        vec![
            pod("k", "a", "node-a", Some("10.215.1.2"), &[("app", "a")]),
            pod("k", "s", "node-a", Some("10.215.2.2"), &[("app", "s")]),
            pod("k", "c", "node-a", Some("10.215.3.2"), &[("app", "c")]),
        ],
        3,
    )
    .await;
    // s allows ingress from a on 8080; c is thereby denied.
    create_policy(&client, "k", policy("allow-a", "a")).await.unwrap();

    let mut agent = AgentProcess::spawn(&topo, &object, &kubeconfig, 1);
    let first_ready = agent.wait_ready(Duration::from_secs(30)).await;
    expect_probe(&ns_c, server_addr(), false, "c denied by allow-a").await;
    expect_probe(&ns_a, server_addr(), true, "a allowed by allow-a").await;
    let (code, body) = agent.get("/metrics").expect("GET /metrics");
    assert_eq!(code, 200);
    assert!(body.contains("npm_"), "metrics served: {body}");

    let flow_stop = Arc::new(AtomicBool::new(false));
    let (flow, flow_thread) = start_flow(&ns_a, server_addr(), flow_stop.clone());
    let before_kill = flow_progresses(&flow, Duration::from_millis(500), "before the kill").await;
    assert!(before_kill > 10, "the flow runs: {}", flow.summary());

    // kill -9: no agent at all for ~2 s.
    agent.kill9();
    let killed_at = Instant::now();
    let rounds_at_kill = flow.rounds();
    let _ = flow_progresses(&flow, Duration::from_millis(700), "right after kill -9").await;
    let (a_ok, c_ok) = tokio::task::spawn_blocking({
        let (a, c) = (ns_a.clone(), ns_c.clone());
        move || (probe_now(&a), probe_now(&c))
    })
    .await
    .unwrap();
    assert!(
        a_ok,
        "a new connection from a is allowed with no agent\n{}",
        diagnose(&topo, None)
    );
    assert!(
        !c_ok,
        "a new connection from c is denied with no agent\n{}",
        diagnose(&topo, None)
    );
    // What enforces now is the pinned state: inspect reads it.
    let dump = inspect_json(&topo.routed.pin_dir, &[]);
    let eps = dump["endpoints"].as_array().expect("endpoints in inspect");
    assert_eq!(eps.len(), 3, "three pinned endpoints: {dump}");
    assert!(
        eps.iter()
            .any(|e| e["ipv4"] == "10.215.2.2" && e["flags"].as_u64().unwrap_or(0) & 1 == 1),
        "s is ingress-isolated in the pinned maps: {dump}"
    );
    assert!(
        !dump["policy"].as_array().expect("policy in inspect").is_empty(),
        "pinned policy entries: {dump}"
    );
    let ids_of = |eps: &[serde_json::Value]| -> std::collections::BTreeMap<String, u64> {
        eps.iter()
            .map(|e| (e["ipv4"].to_string(), e["id"].as_u64().expect("endpoint id")))
            .collect()
    };
    let ids_before = ids_of(eps);
    let rest = Duration::from_secs(2).saturating_sub(killed_at.elapsed());
    flow_progresses(&flow, rest, "with no agent").await;

    // A new agent process on the same pin dir adopts the pinned state.
    let mut agent = AgentProcess::spawn(&topo, &object, &kubeconfig, 2);
    let restart_started = Instant::now();
    let flow_at_restart = flow.rounds();
    let no_agent_rounds = flow_at_restart - rounds_at_kill;
    let no_agent_time = killed_at.elapsed();
    // The flow keeps going while the new agent loads and syncs.
    let mut second_ready = None;
    while second_ready.is_none() {
        assert_eq!(flow.failures(), 0, "during the restart: {}", flow.summary());
        if let Some(status) = agent.child.try_wait().unwrap() {
            panic!("the new agent exited with {status:?}:\n{}", agent.log_text());
        }
        if matches!(agent.get("/readyz"), Some((200, _))) {
            second_ready = Some(restart_started.elapsed());
        }
        assert!(
            restart_started.elapsed() < Duration::from_secs(30),
            "the new agent is not ready after 30 s; log:\n{}",
            agent.log_text()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second_ready = second_ready.unwrap();
    // The restarted agent kept every endpoint's id (same pods, same
    // interfaces, same addresses), read back from the pinned maps; its log
    // says they were matched against the adopted records (a fresh
    // numbering would give these three pods the same ids).
    let dump = inspect_json(&topo.routed.pin_dir, &[]);
    let eps = dump["endpoints"].as_array().expect("endpoints in inspect");
    assert_eq!(ids_of(eps), ids_before, "endpoint ids across the restart: {dump}");
    let log = strip_ansi(&agent.log_text());
    assert!(
        log.lines()
            .any(|l| l.contains("endpoint ids of the adopted state kept") && l.contains("kept=3")),
        "the restarted agent kept the 3 adopted ids; log:\n{log}"
    );
    let after_ready = flow_progresses(&flow, Duration::from_secs(1), "after the restart").await;
    let restart_rounds = flow.rounds() - flow_at_restart;
    let (a_ok, c_ok) = tokio::task::spawn_blocking({
        let (a, c) = (ns_a.clone(), ns_c.clone());
        move || (probe_now(&a), probe_now(&c))
    })
    .await
    .unwrap();
    assert!(a_ok, "a allowed after the restart\n{}", diagnose(&topo, Some(&agent)));
    assert!(
        !c_ok,
        "c still denied after the restart\n{}",
        diagnose(&topo, Some(&agent))
    );

    // The new agent reconciles: allowing c converges.
    let change = Instant::now();
    create_policy(&client, "k", policy("allow-c", "c")).await.unwrap();
    expect_probe(&ns_c, server_addr(), true, "c allowed by allow-c after the restart").await;
    let converged = change.elapsed();
    assert!(probe_now(&ns_a), "a still allowed\n{}", diagnose(&topo, Some(&agent)));
    assert_eq!(agent.child.try_wait().unwrap(), None, "the new agent keeps running");

    flow_stop.store(true, Ordering::SeqCst);
    flow_thread.join().expect("flow thread");
    // The server side of each connection records its retransmissions when
    // it sees EOF.
    wait_until("every accepted connection closed", Duration::from_secs(5), || {
        echo.closed.load(Ordering::SeqCst) == echo.accepted.load(Ordering::SeqCst)
    })
    .await;
    eprintln!(
        "kill -9 under traffic: first agent ready in {first_ready:?}; flow {before_kill} round trips before \
         the kill, {no_agent_rounds} with no agent (for {no_agent_time:?}), {restart_rounds} from the restart until 1 s after \
         ready (new agent ready in {second_ready:?}, {after_ready} after ready); policy change converged in \
         {converged:?}; total: {}; server retransmissions {}",
        flow.summary(),
        echo.retrans.load(Ordering::SeqCst)
    );
    assert!(flow.done.load(Ordering::SeqCst));
    assert_eq!(flow.failures(), 0, "{}", flow.summary());
    assert_eq!(
        flow.client_retrans.load(Ordering::SeqCst),
        0,
        "no client segment was dropped: {}",
        flow.summary()
    );
    assert_eq!(echo.retrans.load(Ordering::SeqCst), 0, "no server segment was dropped");
    drop(agent);
    srv.shutdown().await;
    drop(topo);
}
