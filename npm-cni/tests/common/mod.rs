//! Shared helpers of npm-cni's integration tests: running plugin binaries as a runtime does, a pod
//! sandbox (a named netns) wired by the real reference `ptp` plugin, and stand-in agents on a unix
//! socket. Privileged: needs root (netns, veth).
// Each test crate uses a part of these helpers.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Once;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

pub const PREFIX: &str = "npmcnit-";
pub const CNI_BIN: &str = "/usr/lib/cni";
pub const NETWORK: &str = "npmcnit-net";
pub const CNI_VERSION: &str = "1.0.0";

static SETUP: Once = Once::new();
static NEXT_SUBNET: AtomicU8 = AtomicU8::new(10);

/// Waits for the CNI plugins and removes what crashed earlier runs left (the netns and dirs of test
/// processes that are gone).
pub fn setup() {
    SETUP.call_once(|| {
        let ptp = Path::new(CNI_BIN).join("ptp");
        let started = Instant::now();
        while !ptp.exists() || !Path::new(CNI_BIN).join("host-local").exists() {
            assert!(
                started.elapsed() < Duration::from_secs(600),
                "{} never appeared",
                ptp.display()
            );
            thread::sleep(Duration::from_secs(2));
        }
        // Names are PREFIX<pid>-...: only those of dead processes are stale (test crates may run at once).
        let stale = |name: &str| {
            name.strip_prefix(PREFIX)
                .and_then(|rest| rest.split('-').next())
                .and_then(|pid| pid.parse::<u32>().ok())
                .is_some_and(|pid| pid != std::process::id() && !Path::new(&format!("/proc/{pid}")).exists())
        };
        let netns = Command::new("ip")
            .args(["netns", "list"])
            .output()
            .expect("ip netns list");
        for line in String::from_utf8_lossy(&netns.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            if stale(name) {
                let _ = Command::new("ip").args(["netns", "del", name]).status();
            }
        }
        for entry in std::fs::read_dir(std::env::temp_dir()).expect("temp dir").flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if stale(&name) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    });
}

/// A fresh private directory `PREFIX<pid>-<case>` under the temp dir.
pub fn temp_dir(case: &str) -> PathBuf {
    setup();
    let dir = std::env::temp_dir().join(format!("{PREFIX}{}-{case}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// What a plugin process did.
pub struct Run {
    pub code: i32,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
}

impl Run {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }

    /// Asserts a CNI error result with `code` and returns it.
    pub fn cni_error(&self, code: u32) -> Value {
        assert_ne!(self.code, 0, "expected failure; stdout {:?}", self.stdout);
        assert!(!self.stderr.contains("panicked"), "plugin panicked: {}", self.stderr);
        let error = self.json();
        assert_eq!(error["code"], code, "unexpected error {error}; stderr {}", self.stderr);
        assert!(
            error["msg"].as_str().is_some_and(|m| !m.is_empty()),
            "no msg in {error}"
        );
        let version = error["cniVersion"].as_str().unwrap_or_default();
        assert!(npm_cni::version::SUPPORTED_VERSIONS.contains(&version), "{error}");
        error
    }
}

/// Runs a plugin binary with a clean environment, as a runtime does.
pub fn exec(binary: &Path, env: &[(String, String)], stdin: &str) -> Run {
    let started = Instant::now();
    let mut child = Command::new(binary)
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn {}: {e}", binary.display()));
    child.stdin.take().unwrap().write_all(stdin.as_bytes()).unwrap();
    let output = child.wait_with_output().unwrap();
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

pub fn npm_cni() -> &'static Path {
    Path::new(env!("CARGO_BIN_EXE_npm-cni"))
}

/// A pod sandbox wired by `ptp`: its netns, its ADD result and its private directory.
pub struct Pod {
    pub cni_version: &'static str,
    pub netns: String,
    pub container_id: String,
    pub namespace: String,
    pub name: String,
    pub uid: String,
    pub dir: PathBuf,
    pub ptp_conf: Value,
    pub result: Value,
}

impl Pod {
    pub fn new(case: &str) -> Self {
        Self::with_version(case, CNI_VERSION)
    }

    /// A pod of a conflist with `cniVersion` = `cni_version`.
    pub fn with_version(case: &str, cni_version: &'static str) -> Self {
        let mut pod = Self::unwired(case, cni_version);
        let run = exec(
            &Path::new(CNI_BIN).join("ptp"),
            &pod.env("ADD"),
            &pod.plugin_conf(&pod.ptp_conf, None),
        );
        assert_eq!(run.code, 0, "ptp ADD failed: {} {}", run.stdout, run.stderr);
        pod.result = run.json();
        pod
    }

    /// A sandbox (netns, directory, ids and a `ptp` entry) that no plugin has wired yet; `result`
    /// stays null, so dropping it does not call ptp DEL.
    pub fn unwired(case: &str, cni_version: &'static str) -> Self {
        setup();
        let subnet = NEXT_SUBNET.fetch_add(1, Ordering::SeqCst);
        let pid = std::process::id();
        let netns = format!("{PREFIX}{pid}-{subnet}");
        let dir = std::env::temp_dir().join(&netns);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let status = Command::new("ip").args(["netns", "add", &netns]).status().unwrap();
        assert!(status.success(), "ip netns add {netns}");
        let ptp_conf = json!({
            "type": "ptp",
            "ipMasq": false,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": format!("10.199.{subnet}.0/24")}]],
                "dataDir": dir.join("ipam"),
            },
        });
        Pod {
            cni_version,
            container_id: format!("npmcnit{pid}c{subnet}"),
            namespace: "npmcni-test".into(),
            name: format!("{case}-{subnet}"),
            uid: format!("00000000-0000-4000-8000-{pid:06}{subnet:06}"),
            netns,
            dir,
            ptp_conf,
            result: Value::Null,
        }
    }

    pub fn netns_path(&self) -> String {
        format!("/var/run/netns/{}", self.netns)
    }

    pub fn cni_args(&self) -> String {
        format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            self.namespace, self.name, self.container_id, self.uid
        )
    }

    pub fn env(&self, command: &str) -> Vec<(String, String)> {
        self.env_with_args(command, &self.cni_args())
    }

    pub fn env_with_args(&self, command: &str, args: &str) -> Vec<(String, String)> {
        [
            ("CNI_COMMAND", command.to_owned()),
            ("CNI_CONTAINERID", self.container_id.clone()),
            ("CNI_NETNS", self.netns_path()),
            ("CNI_IFNAME", "eth0".to_owned()),
            ("CNI_ARGS", args.to_owned()),
            ("CNI_PATH", CNI_BIN.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// The request configuration libcni derives from a conflist entry: `name`, `cniVersion` and
    /// (for every plugin but the first) `prevResult` inserted, every other key passed through.
    pub fn plugin_conf(&self, plugin: &Value, prev_result: Option<&Value>) -> String {
        let mut conf = plugin.clone();
        conf["name"] = NETWORK.into();
        conf["cniVersion"] = self.cni_version.into();
        if let Some(prev) = prev_result {
            conf["prevResult"] = prev.clone();
        }
        conf.to_string()
    }

    /// npm-cni's chained configuration with `prevResult` = ptp's result.
    pub fn npm_conf(&self, extra: Value) -> String {
        let mut plugin = json!({"type": "npm-cni", "agentSocket": self.socket(), "timeoutSeconds": 1});
        for (k, v) in extra.as_object().unwrap() {
            plugin[k] = v.clone();
        }
        self.plugin_conf(&plugin, Some(&self.result))
    }

    pub fn socket(&self) -> PathBuf {
        self.dir.join("agent.sock")
    }

    pub fn npm(&self, command: &str, extra: Value) -> Run {
        exec(npm_cni(), &self.env(command), &self.npm_conf(extra))
    }

    pub fn host_veth(&self) -> String {
        let interfaces = self.result["interfaces"].as_array().unwrap();
        let host = interfaces
            .iter()
            .find(|i| i.get("sandbox").is_none_or(|s| s.as_str() == Some("")))
            .unwrap();
        host["name"].as_str().unwrap().to_owned()
    }

    pub fn ip(&self) -> String {
        self.result["ips"][0]["address"].as_str().unwrap().to_owned()
    }
}

impl Drop for Pod {
    fn drop(&mut self) {
        if !self.result.is_null() {
            let run = exec(
                &Path::new(CNI_BIN).join("ptp"),
                &self.env("DEL"),
                &self.plugin_conf(&self.ptp_conf, Some(&self.result)),
            );
            if run.code != 0 {
                eprintln!("ptp DEL failed: {} {}", run.stdout, run.stderr);
            }
        }
        let _ = Command::new("ip").args(["netns", "del", &self.netns]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A stand-in agent: answers `connections` connections with `answer(request line)` and returns the
/// raw request lines it received.
pub fn fake_agent(
    socket: &Path,
    connections: usize,
    answer: impl Fn(&[u8]) -> Option<Vec<u8>> + Send + 'static,
) -> JoinHandle<Vec<Vec<u8>>> {
    let listener = UnixListener::bind(socket).unwrap();
    thread::spawn(move || {
        let mut received = Vec::new();
        for _ in 0..connections {
            let (stream, _) = listener.accept().unwrap();
            let mut line = Vec::new();
            BufReader::new(&stream).read_until(b'\n', &mut line).unwrap();
            match answer(&line) {
                Some(bytes) => (&stream).write_all(&bytes).unwrap(),
                // Never answer: hold the connection until the client gives up and closes it.
                None => {
                    let _ = (&stream).read_to_end(&mut Vec::new());
                }
            }
            received.push(line);
        }
        received
    })
}
