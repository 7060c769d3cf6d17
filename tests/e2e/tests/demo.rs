//! Runs the `npm-demo` binary against the real agent:
//!
//! - `--once` on the eBPF dataplane: the BEFORE matrix is all reachable, the
//!   AFTER matrix of example 01 is exactly "x/b, x/c unreachable from
//!   everyone; x/a reachable only from y/*", exit status 0, nothing left
//!   behind (netns, veths, pins, nft table, scratch dir, kubeconfig).
//! - watch mode on the nftables dataplane: example 02 is applied through the
//!   demo's kubeconfig's API server while the demo runs; the demo prints the
//!   changed matrix; SIGINT tears everything down and exits 0. Before
//!   that, `kubectl npm why` and `status` with the demo's kubeconfig give
//!   the agent's verdicts of example 01 and its readiness.
//!
//! Prerequisites (CI builds them first): `target/debug/npm-agent` (or
//! `NPM_AGENT_BIN`), `target/debug/kubectl-npm` (or `KUBECTL_NPM_BIN`) and,
//! for eBPF, the object named by `NPM_EBPF_OBJECT`.
//! When they are missing the tests FAIL with a message saying what to build.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npm_e2e::api::Api;
use npm_e2e::demo::{self, AFTER_MARKER, BEFORE_MARKER, CHANGED_MARKER};

/// The live cluster uses the model's fixed addresses: one demo at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn agent_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("NPM_AGENT_BIN") {
        return PathBuf::from(p);
    }
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("target"));
    target.join("debug/npm-agent")
}

/// The kubectl plugin (`KUBECTL_NPM_BIN`, else the workspace's debug
/// build; a clear panic when it was not built).
fn kubectl_npm_bin() -> PathBuf {
    let p = std::env::var_os("KUBECTL_NPM_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| agent_bin().with_file_name("kubectl-npm"));
    assert!(
        p.is_file(),
        "prerequisite missing: {} (cargo build -p kubectl-npm, or set KUBECTL_NPM_BIN)",
        p.display()
    );
    p
}

fn require_prerequisites(ebpf: bool) {
    let agent = agent_bin();
    assert!(
        agent.is_file(),
        "prerequisite missing: the agent binary {} does not exist; build it first (cargo build --bin npm-agent) or set NPM_AGENT_BIN",
        agent.display()
    );
    if ebpf {
        let obj = std::env::var_os("NPM_EBPF_OBJECT").unwrap_or_else(|| {
            panic!("prerequisite missing: NPM_EBPF_OBJECT is not set; build the BPF object (cargo xtask build-ebpf) and set NPM_EBPF_OBJECT to target/bpfel-unknown-none/release/npm-ebpf")
        });
        assert!(
            Path::new(&obj).is_file(),
            "prerequisite missing: the BPF object {} (NPM_EBPF_OBJECT) does not exist; build it first",
            Path::new(&obj).display()
        );
    }
}

/// A unique state dir, removed on drop.
struct StateDir(PathBuf);

impl StateDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("npm-demo-test-{}-{tag}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        StateDir(p)
    }
}

impl Drop for StateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Kills the demo (SIGTERM, then SIGKILL) if the test fails half-way.
struct DemoProc {
    child: Child,
    out: Arc<Mutex<String>>,
}

impl DemoProc {
    fn start(args: &[&str], state: &Path) -> DemoProc {
        let mut child = Command::new(env!("CARGO_BIN_EXE_npm-demo"))
            .arg("--agent-bin")
            .arg(agent_bin())
            .arg("--examples")
            .arg(repo_root().join("examples"))
            .arg("--state-dir")
            .arg(state)
            .arg("--wait-secs")
            .arg("300")
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawning npm-demo");
        let out = Arc::new(Mutex::new(String::new()));
        for stream in [
            Box::new(child.stdout.take().expect("stdout")) as Box<dyn std::io::Read + Send>,
            Box::new(child.stderr.take().expect("stderr")),
        ] {
            let out = out.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    out.lock().unwrap_or_else(|e| e.into_inner()).push_str(&(line + "\n"));
                }
            });
        }
        DemoProc { child, out }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    fn output(&self) -> String {
        self.out.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Waits until the output contains `text` (panics with the output after
    /// `max`, or when the demo exits first).
    fn wait_for(&mut self, text: &str, max: Duration) -> String {
        let end = Instant::now() + max;
        loop {
            let o = self.output();
            if let Some(i) = o.find(text) {
                // The matrix after the marker has 10 more lines.
                if o[i..].lines().count() >= 11 {
                    return o;
                }
            }
            if let Ok(Some(st)) = self.child.try_wait() {
                std::thread::sleep(Duration::from_millis(200));
                panic!("npm-demo exited ({st}) before printing {text:?}:\n{}", self.output());
            }
            assert!(Instant::now() < end, "no {text:?} after {max:?}:\n{o}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn wait_exit(&mut self, max: Duration) -> std::process::ExitStatus {
        let end = Instant::now() + max;
        loop {
            if let Ok(Some(st)) = self.child.try_wait() {
                // Let the reader threads drain the pipes.
                std::thread::sleep(Duration::from_millis(300));
                return st;
            }
            assert!(
                Instant::now() < end,
                "npm-demo still running after {max:?}:\n{}",
                self.output()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for DemoProc {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // SAFETY: signalling the child we started, by its pid.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let end = Instant::now() + Duration::from_secs(20);
            while Instant::now() < end {
                if let Ok(Some(_)) = self.child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The matrix printed after the first line containing `marker` (after
/// `from`): (rows, columns, cells).
fn parse_matrix(out: &str, marker: &str, from: usize) -> (Vec<String>, Vec<String>, Vec<Vec<bool>>) {
    let i = out[from..]
        .find(marker)
        .unwrap_or_else(|| panic!("no {marker:?} in:\n{out}"))
        + from;
    let mut lines = out[i..].lines().skip(1);
    let cols: Vec<String> = lines
        .next()
        .expect("header")
        .split_whitespace()
        .map(String::from)
        .collect();
    assert_eq!(cols, demo::model_pods(), "matrix header after {marker:?}:\n{out}");
    let mut rows = Vec::new();
    let mut cells = Vec::new();
    for _ in 0..cols.len() {
        let l = lines.next().expect("matrix row");
        let mut it = l.split_whitespace();
        rows.push(it.next().expect("row name").to_string());
        let row: Vec<bool> = it
            .map(|c| match c {
                "." => true,
                "X" => false,
                other => panic!("unexpected cell {other:?} in {l:?}"),
            })
            .collect();
        assert_eq!(row.len(), cols.len(), "row {l:?}");
        cells.push(row);
    }
    assert_eq!(rows, cols, "row names after {marker:?}");
    (rows, cols, cells)
}

/// Example 01: x/b, x/c blocked from everyone; x/a only from y/*.
fn expected_after_01(from: &str, to: &str) -> bool {
    if from == to {
        return true;
    }
    match to {
        "x/b" | "x/c" => false,
        "x/a" => from.starts_with("y/"),
        _ => true,
    }
}

/// Example 01 and 02: y/* may only reach z/* (TCP 80-81) and DNS.
fn expected_after_02(from: &str, to: &str) -> bool {
    if from == to {
        return true;
    }
    if from.starts_with("y/") && !to.starts_with("z/") {
        return false;
    }
    expected_after_01(from, to)
}

fn assert_matrix(out: &str, marker: &str, from: usize, want: &dyn Fn(&str, &str) -> bool) {
    let (rows, cols, cells) = parse_matrix(out, marker, from);
    for (ri, r) in rows.iter().enumerate() {
        for (ci, c) in cols.iter().enumerate() {
            assert_eq!(
                cells[ri][ci],
                want(r, c),
                "{r} -> {c} in the matrix after {marker:?}:\n{out}"
            );
        }
    }
}

/// Nothing of demo process `pid` remains.
fn assert_clean(pid: u32, state: &Path) {
    let owned = |name: &str| {
        name.strip_prefix(&format!("npmc{pid:x}"))
            .and_then(|r| r.chars().next())
            .is_some_and(|c| !c.is_ascii_hexdigit())
    };
    let netns = Command::new("ip").args(["netns", "list"]).output().expect("ip netns");
    let netns = String::from_utf8_lossy(&netns.stdout).to_string();
    let left: Vec<&str> = netns
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| owned(n))
        .collect();
    assert!(left.is_empty(), "netns left behind: {left:?}");
    let links = Command::new("ip")
        .args(["-o", "link", "show"])
        .output()
        .expect("ip link");
    let links = String::from_utf8_lossy(&links.stdout).to_string();
    let left: Vec<&str> = links
        .lines()
        .filter_map(|l| l.split(':').nth(1).map(|s| s.trim().split('@').next().unwrap_or("")))
        .filter(|n| owned(n))
        .collect();
    assert!(left.is_empty(), "links left behind: {left:?}");
    let pins = PathBuf::from(format!("/sys/fs/bpf/{}{pid}", demo::PIN_DIR_PREFIX));
    assert!(!pins.exists(), "pin dir {} left behind", pins.display());
    let work = std::env::temp_dir().join(format!("{}{pid}", demo::PIN_DIR_PREFIX));
    assert!(!work.exists(), "scratch dir {} left behind", work.display());
    assert!(
        !state.join("kubeconfig").exists(),
        "the demo's kubeconfig was left behind"
    );
    let tables = Command::new("nft").args(["list", "tables"]).output().expect("nft");
    let tables = String::from_utf8_lossy(&tables.stdout).to_string();
    let table = format!("{}{pid}", demo::NFT_TABLE_PREFIX);
    assert!(
        !tables.split_whitespace().any(|t| t == table),
        "nft table {table} left behind:\n{tables}"
    );
}

#[test]
fn once_on_ebpf_prints_the_expected_matrices_and_leaves_nothing() {
    require_prerequisites(true);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let state = StateDir::new("once");
    let mut d = DemoProc::start(&["--once", "--dataplane", "ebpf"], &state.0);
    let st = d.wait_exit(Duration::from_secs(400));
    let out = d.output();
    assert!(st.success(), "npm-demo --once exited with {st}:\n{out}");
    assert!(
        out.contains("kubectl --kubeconfig ") && out.contains("apply -f ") && out.contains(demo::SECOND_EXAMPLE),
        "no kubectl hint:\n{out}"
    );
    assert!(out.contains("/metrics"), "no metrics URL:\n{out}");
    assert_matrix(&out, BEFORE_MARKER, 0, &|_, _| true);
    assert_matrix(&out, AFTER_MARKER, 0, &expected_after_01);
    assert_clean(d.pid(), &state.0);
}

#[test]
fn watch_on_nftables_shows_a_live_change_and_sigint_tears_down() {
    require_prerequisites(false);
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let state = StateDir::new("watch");
    let mut d = DemoProc::start(&["--dataplane", "nftables", "--watch-secs", "1"], &state.0);
    let out = d.wait_for(AFTER_MARKER, Duration::from_secs(400));
    assert_matrix(&out, BEFORE_MARKER, 0, &|_, _| true);
    assert_matrix(&out, AFTER_MARKER, 0, &expected_after_01);

    // kubectl npm with the demo's kubeconfig: the agent's verdicts of
    // example 01 (x/a open to y on TCP 80, x/b closed) and its status.
    let kubectl_npm = |args: &[&str]| {
        let out = Command::new(kubectl_npm_bin())
            .arg("--kubeconfig")
            .arg(state.0.join("kubeconfig"))
            .args(args)
            .output()
            .expect("run kubectl-npm");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "kubectl npm {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_str::<serde_json::Value>(&text).unwrap_or_else(|e| panic!("{e}: {text}"))
    };
    let open = kubectl_npm(&["why", "y/a", "x/a", "--port", "80", "-o", "json"]);
    assert_eq!(open["verdict"], "allow", "{open}");
    assert!(open.to_string().contains("allow-y-to-a"), "{open}");
    let shut = kubectl_npm(&["why", "y/a", "x/b", "--port", "80", "-o", "json"]);
    assert_eq!(shut["verdict"], "deny", "{shut}");
    assert!(shut.to_string().contains("default-deny-ingress"), "{shut}");
    let status = kubectl_npm(&["status", "-o", "json"]);
    assert_eq!(status[0]["ready"], true, "{status}");

    // Apply example 02 through the API server the printed kubeconfig names.
    let kubeconfig = std::fs::read_to_string(state.0.join("kubeconfig")).expect("the demo's kubeconfig");
    let server = kubeconfig
        .lines()
        .find_map(|l| l.trim().strip_prefix("server: http://"))
        .expect("server line in the kubeconfig");
    let addr: SocketAddr = server.trim_end_matches('/').parse().expect("server address");
    let api = Api::new(addr);
    let seen = out.len();
    for p in demo::read_policies(&repo_root().join("examples").join(demo::SECOND_EXAMPLE)).expect("example 02") {
        api.apply_policy(&p, true).expect("applying example 02");
    }
    // The demo reports the change (possibly in several steps while the agent
    // converges); the last reported matrix must be the expected one.
    let end = Instant::now() + Duration::from_secs(60);
    loop {
        let out = d.wait_for(CHANGED_MARKER, Duration::from_secs(60));
        let Some(last) = out[seen..].rfind(CHANGED_MARKER).map(|i| i + seen) else {
            assert!(
                Instant::now() < end,
                "the demo reported no change after example 02:\n{out}"
            );
            std::thread::sleep(Duration::from_millis(500));
            continue;
        };
        if out[last..].lines().count() < 11 {
            std::thread::sleep(Duration::from_millis(200));
            continue;
        }
        let (rows, cols, cells) = parse_matrix(&out, CHANGED_MARKER, last);
        let done = rows.iter().enumerate().all(|(ri, r)| {
            cols.iter()
                .enumerate()
                .all(|(ci, c)| cells[ri][ci] == expected_after_02(r, c))
        });
        if done {
            assert!(
                out[last..].contains("y/egress-to-z"),
                "the change report does not list the policy:\n{out}"
            );
            break;
        }
        assert!(
            Instant::now() < end,
            "the demo never showed example 02's matrix:\n{out}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // SAFETY: signalling the child we started, by its pid.
    unsafe { libc::kill(d.pid() as i32, libc::SIGINT) };
    let st = d.wait_exit(Duration::from_secs(60));
    let out = d.output();
    assert!(st.success(), "npm-demo exited with {st} after SIGINT:\n{out}");
    assert!(out.contains("npm-demo: done"), "no teardown report:\n{out}");
    assert_clean(d.pid(), &state.0);
}
