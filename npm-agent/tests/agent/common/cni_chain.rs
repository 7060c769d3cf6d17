//! Pods wired as a container runtime runs a conflist whose last plugin is
//! npm-cni: the reference interface plugin (`ptp` or `bridge`, host-local
//! IPAM in a private temp dir; configurations and the plugin runner of
//! [`cni_plugins`](crate::cni_plugins)), then the real `npm-cni` binary,
//! each with the runtime's `CNI_*` environment and its entry on stdin with
//! `name`, `cniVersion` and the previous plugin's result as `prevResult`
//! inserted, as libcni does; DEL runs them in reverse order with the ADD
//! result as `prevResult`.
//!
//! npm-cni's own harness (`npm-cni/tests/common`) cannot be included here:
//! it names its binary with `env!("CARGO_BIN_EXE_npm-cni")`, which cargo
//! defines only in npm-cni's own test crates. The binary used here is the
//! workspace's `target/<profile>/npm-cni`, next to `npm-agent`.
//!
//! Included with `#[path = "common/cni_chain.rs"] mod cni_chain;`, after
//! `cni_plugins`.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::cni_plugins::{bridge_conf, exec_plugin, ptp_conf, wait_for_plugins, CNI_BIN, CNI_VERSION};

/// Prefix of everything these helpers create (netns, temp dirs, bridges,
/// pin dirs, nft tables): `npmcnia<pid>...`.
pub const PREFIX: &str = "npmcnia";

/// The `npm-cni` binary of this build (`cargo build -p npm-cni` makes it).
pub fn npm_cni_binary() -> PathBuf {
    let path = Path::new(env!("CARGO_BIN_EXE_npm-agent")).with_file_name("npm-cni");
    assert!(
        path.exists(),
        "{} missing: run `cargo build -p npm-cni` first",
        path.display()
    );
    path
}

/// Remove what crashed runs left (names `PREFIX<pid>...` of gone processes).
pub fn clear_leftovers() {
    crate::cni_plugins::clear_leftovers(PREFIX);
}

/// What one plugin process did.
#[derive(Clone, Debug)]
pub struct Run {
    /// Exit code.
    pub code: i32,
    /// Its stdout (a result or an error).
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
    /// How long it ran.
    pub elapsed: Duration,
}

impl Run {
    /// stdout as JSON.
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("stdout is not JSON ({e}): {:?}", self.stdout))
    }
}

/// Run the npm-cni binary with a clean environment, as a runtime does.
fn exec_npm_cni(env: &[(String, String)], conf: &Value) -> Run {
    use std::io::Write;
    let started = Instant::now();
    let mut child = Command::new(npm_cni_binary())
        .env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn npm-cni");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    Run {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).trim().to_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: started.elapsed(),
    }
}

/// Run one conflist entry.
fn exec_entry(plugin: &Value, env: &[(String, String)], conf: &Value) -> Run {
    match plugin["type"].as_str().unwrap() {
        "npm-cni" => exec_npm_cni(env, conf),
        other => {
            let started = Instant::now();
            let r = exec_plugin(other, None, env, conf);
            Run {
                code: r.code,
                stdout: r.stdout.trim().to_owned(),
                stderr: r.stderr,
                elapsed: started.elapsed(),
            }
        }
    }
}

/// Which interface plugin the network uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wiring {
    /// `ptp`: one routed veth per pod.
    Ptp,
    /// `bridge`: veths on one bridge that holds the gateway.
    Bridge,
}

/// A CNI network: its conflist (interface plugin, then npm-cni), a private
/// directory (IPAM leases, the agent socket's directory).
pub struct Network {
    /// `name` of the network.
    pub name: String,
    /// Private directory (removed on drop).
    pub dir: PathBuf,
    /// The conflist's plugins, in order.
    pub plugins: Vec<Value>,
    /// The bridge, with [`Wiring::Bridge`].
    pub bridge: Option<String>,
    /// The agent socket npm-cni is told (`<dir>/run/cni.sock` unless set).
    pub socket: PathBuf,
}

impl Network {
    /// A network of `wiring` on `subnet` (e.g. `10.231.0.0/24`) whose
    /// npm-cni entry talks to `<dir>/run/cni.sock` with `timeoutSeconds` 10.
    pub fn new(tag: &str, wiring: Wiring, subnet: &str) -> Network {
        wait_for_plugins();
        let name = format!("{PREFIX}{}{tag}", std::process::id());
        let dir = std::env::temp_dir().join(&name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let ipam_dir = dir.join("ipam");
        let (first, bridge) = match wiring {
            Wiring::Ptp => (ptp_conf(&name, subnet, &ipam_dir), None),
            Wiring::Bridge => (bridge_conf(&name, &name, subnet, &ipam_dir), Some(name.clone())),
        };
        let socket = dir.join("run/cni.sock");
        Network {
            plugins: vec![
                first,
                json!({"type": "npm-cni", "agentSocket": socket, "timeoutSeconds": 10}),
            ],
            name,
            dir,
            bridge,
            socket,
        }
    }

    /// Set keys of the npm-cni entry (`timeoutSeconds`, `failOpen`;
    /// `agentSocket` also sets [`Network::socket`]).
    pub fn npm_cni_options(mut self, extra: Value) -> Network {
        let entry = self.plugins.last_mut().unwrap();
        for (k, v) in extra.as_object().unwrap() {
            entry[k] = v.clone();
        }
        if let Some(s) = extra["agentSocket"].as_str() {
            self.socket = s.into();
        }
        self
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        if let Some(br) = &self.bridge {
            let _ = Command::new("ip").args(["link", "delete", br]).output();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// What a chained ADD did.
#[derive(Debug)]
pub struct ChainRun {
    /// Each plugin's run, in order (up to the first failure).
    pub runs: Vec<Run>,
}

impl ChainRun {
    /// Whether every plugin succeeded.
    pub fn ok(&self) -> bool {
        self.runs.iter().all(|r| r.code == 0)
    }

    /// The last plugin's run (npm-cni's when the chain got that far).
    pub fn last(&self) -> &Run {
        self.runs.last().unwrap()
    }
}

/// A pod sandbox on a [`Network`] (a netns) of the pod `namespace/name`
/// with the API server's `uid`. DEL and the netns removal run on drop.
pub struct Sandbox {
    /// The network.
    pub net: Arc<Network>,
    /// netns name (`/var/run/netns/<netns>`).
    pub netns: String,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod uid.
    pub uid: String,
    /// The ADD result (the last plugin's output), once added.
    pub result: Option<Value>,
}

static NEXT: Mutex<u32> = Mutex::new(0);

impl Sandbox {
    /// A fresh sandbox (netns) for the pod `namespace/name` with `uid`.
    pub fn new(net: &Arc<Network>, namespace: &str, name: &str, uid: &str) -> Sandbox {
        let n = {
            let mut next = NEXT.lock().unwrap_or_else(|e| e.into_inner());
            *next += 1;
            *next
        };
        let pid = std::process::id();
        let netns = format!("{PREFIX}{pid}s{n}");
        crate::cni_plugins::run(&["ip", "netns", "add", &netns]);
        Sandbox {
            net: net.clone(),
            netns,
            container_id: format!("{PREFIX}{pid}c{n}"),
            namespace: namespace.into(),
            name: name.into(),
            uid: uid.into(),
            result: None,
        }
    }

    /// The runtime's `CNI_*` environment of `command`.
    pub fn env(&self, command: &str) -> Vec<(String, String)> {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            self.namespace, self.name, self.container_id, self.uid
        );
        [
            ("CNI_COMMAND", command.to_owned()),
            ("CNI_CONTAINERID", self.container_id.clone()),
            ("CNI_NETNS", format!("/var/run/netns/{}", self.netns)),
            ("CNI_IFNAME", "eth0".to_owned()),
            ("CNI_ARGS", args),
            ("CNI_PATH", CNI_BIN.to_owned()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect()
    }

    /// One plugin's stdin: its entry with `name`, `cniVersion` and
    /// `prevResult` inserted.
    fn conf(&self, plugin: &Value, prev: Option<&Value>) -> Value {
        let mut conf = plugin.clone();
        conf["name"] = self.net.name.clone().into();
        conf["cniVersion"] = CNI_VERSION.into();
        if let Some(prev) = prev {
            conf["prevResult"] = prev.clone();
        }
        conf
    }

    /// CNI ADD of the conflist. On success `result` is the last plugin's
    /// output; a failed chain is undone with DEL, as a runtime does.
    pub fn add(&mut self) -> ChainRun {
        let mut runs = Vec::new();
        let mut prev: Option<Value> = None;
        for plugin in &self.net.plugins {
            let run = exec_entry(plugin, &self.env("ADD"), &self.conf(plugin, prev.as_ref()));
            let ok = run.code == 0;
            if ok {
                prev = Some(run.json());
            }
            runs.push(run);
            if !ok {
                break;
            }
        }
        let chain = ChainRun { runs };
        self.result = prev;
        if !chain.ok() {
            self.del();
        }
        chain
    }

    /// CNI DEL of the conflist, in reverse order (no-op before ADD).
    pub fn del(&mut self) -> Vec<Run> {
        let Some(result) = self.result.take() else {
            return Vec::new();
        };
        self.net
            .plugins
            .iter()
            .rev()
            .map(|plugin| exec_entry(plugin, &self.env("DEL"), &self.conf(plugin, Some(&result))))
            .collect()
    }

    /// CNI CHECK of the npm-cni entry (with the ADD result as `prevResult`).
    pub fn check_npm_cni(&self) -> Run {
        let plugin = self.net.plugins.last().unwrap();
        exec_npm_cni(&self.env("CHECK"), &self.conf(plugin, self.result.as_ref()))
    }

    /// The pod's IPv4 address from the ADD result.
    pub fn ip(&self) -> IpAddr {
        let r = self.result.as_ref().expect("added");
        let cidr = r["ips"][0]["address"].as_str().unwrap();
        cidr.split('/').next().unwrap().parse().unwrap()
    }

    /// The host-side interfaces the result lists (for `bridge`: the bridge,
    /// then the veth).
    pub fn host_interfaces(&self) -> Vec<String> {
        let r = self.result.as_ref().expect("added");
        r["interfaces"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|i| i.get("sandbox").is_none_or(|s| s.as_str() == Some("")))
            .map(|i| i["name"].as_str().unwrap().to_string())
            .collect()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        self.del();
        let _ = Command::new("ip").args(["netns", "delete", &self.netns]).output();
    }
}
