//! Pods wired by the real reference CNI plugins (Debian's
//! containernetworking-plugins in `/usr/lib/cni`: `ptp` and `bridge`, with
//! `host-local` IPAM), called as a container runtime calls them: a named
//! netns under `/var/run/netns`, `CNI_COMMAND`, `CNI_CONTAINERID`,
//! `CNI_NETNS`, `CNI_IFNAME=eth0`, `CNI_PATH`, the kubelet's `CNI_ARGS`, the
//! network config on stdin. The plugin runs in the "host" namespace of the
//! pod: the agent's own, or a node namespace the test made (the plugin
//! process enters it before it starts). DEL runs on drop.
//!
//! Included by the test crates that use it with
//! `#[allow(dead_code)] #[path = "common/cni_plugins.rs"] mod cni_plugins;`
//! (each test crate uses a part of these helpers).

use std::io::Write;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

/// Where Debian installs the plugins.
pub const CNI_BIN: &str = "/usr/lib/cni";
/// The CNI version of the configurations.
pub const CNI_VERSION: &str = "1.0.0";

/// Wait (up to 10 minutes: the machine's setup may still be installing
/// them) for the plugins.
pub fn wait_for_plugins() {
    let started = Instant::now();
    while !["ptp", "bridge", "host-local"]
        .iter()
        .all(|p| Path::new(CNI_BIN).join(p).exists())
    {
        assert!(
            started.elapsed() < Duration::from_secs(600),
            "the CNI plugins never appeared in {CNI_BIN}"
        );
        std::thread::sleep(Duration::from_secs(2));
    }
}

/// Run a command; panic with its stderr when it fails.
pub fn run(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("run command");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `ip` in network namespace `netns` (or the agent's own).
pub fn ip_in(netns: Option<&str>, args: &[&str]) {
    let mut all = vec!["ip"];
    if let Some(ns) = netns {
        all.extend(["-n", ns]);
    }
    all.extend(args);
    run(&all);
}

/// A network plugin's configuration (`ptp` or `bridge`) with host-local
/// IPAM on `subnet`, its leases in `data_dir`.
pub fn ptp_conf(network: &str, subnet: &str, data_dir: &Path) -> Value {
    json!({
        "cniVersion": CNI_VERSION,
        "name": network,
        "type": "ptp",
        "ipMasq": false,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]], "dataDir": data_dir},
    })
}

/// The reference `bridge` plugin's configuration: bridge `bridge`, which
/// holds the pods' gateway (`isGateway`), host-local IPAM on `subnet`.
pub fn bridge_conf(network: &str, bridge: &str, subnet: &str, data_dir: &Path) -> Value {
    json!({
        "cniVersion": CNI_VERSION,
        "name": network,
        "type": "bridge",
        "bridge": bridge,
        "isGateway": true,
        "ipMasq": false,
        "hairpinMode": false,
        "ipam": {"type": "host-local", "ranges": [[{"subnet": subnet}]], "dataDir": data_dir},
    })
}

/// What a plugin process did.
pub struct PluginRun {
    /// Exit code.
    pub code: i32,
    /// Its stdout (the result).
    pub stdout: String,
    /// Its stderr.
    pub stderr: String,
}

/// Run plugin `plugin` with `env`, the config on stdin, inside network
/// namespace `host_netns` (or the caller's).
pub fn exec_plugin(plugin: &str, host_netns: Option<&str>, env: &[(String, String)], conf: &Value) -> PluginRun {
    let mut cmd = Command::new(Path::new(CNI_BIN).join(plugin));
    cmd.env_clear()
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let ns_file = host_netns.map(|ns| {
        let path = format!("/run/netns/{ns}");
        std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"))
    });
    if let Some(f) = &ns_file {
        let fd = f.as_raw_fd();
        // SAFETY: setns is async-signal-safe; the child enters the node's
        // network namespace before exec (the fd is open in the child).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let mut child = cmd.spawn().unwrap_or_else(|e| panic!("spawn {plugin}: {e}"));
    child
        .stdin
        .take()
        .unwrap()
        .write_all(conf.to_string().as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    PluginRun {
        code: out.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A pod sandbox wired by a reference plugin; DEL and the netns removal
/// run on drop.
pub struct CniPod {
    /// The pod's netns name (`/var/run/netns/<netns>`).
    pub netns: String,
    /// The plugin (`ptp`, `bridge`).
    pub plugin: String,
    /// The network config.
    pub conf: Value,
    /// The namespace the plugin ran in (`None`: the test's own).
    pub host_netns: Option<String>,
    /// Container id.
    pub container_id: String,
    /// Pod namespace and name.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod uid.
    pub uid: String,
    /// The ADD result.
    pub result: Value,
}

impl CniPod {
    /// Create netns `netns`, then ADD it with `plugin` and `conf` from
    /// `host_netns`, as pod `namespace/name`.
    pub fn add(
        netns: &str,
        plugin: &str,
        conf: Value,
        host_netns: Option<&str>,
        namespace: &str,
        name: &str,
    ) -> CniPod {
        wait_for_plugins();
        run(&["ip", "netns", "add", netns]);
        let mut pod = CniPod {
            netns: netns.to_string(),
            plugin: plugin.to_string(),
            conf,
            host_netns: host_netns.map(str::to_string),
            container_id: format!("{netns}-sandbox"),
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: format!("uid-{netns}"),
            result: Value::Null,
        };
        let r = exec_plugin(plugin, host_netns, &pod.env("ADD"), &pod.conf);
        assert_eq!(r.code, 0, "{plugin} ADD of {netns}: {} {}", r.stdout, r.stderr);
        pod.result = serde_json::from_str(&r.stdout).expect("ADD result JSON");
        pod
    }

    /// The runtime's environment of `command`.
    pub fn env(&self, command: &str) -> Vec<(String, String)> {
        let args = format!(
            "IgnoreUnknown=1;K8S_POD_NAMESPACE={};K8S_POD_NAME={};K8S_POD_INFRA_CONTAINER_ID={};K8S_POD_UID={}",
            self.namespace, self.name, self.container_id, self.uid
        );
        [
            ("CNI_COMMAND", command.to_string()),
            ("CNI_CONTAINERID", self.container_id.clone()),
            ("CNI_NETNS", format!("/var/run/netns/{}", self.netns)),
            ("CNI_IFNAME", "eth0".to_string()),
            ("CNI_ARGS", args),
            ("CNI_PATH", CNI_BIN.to_string()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v))
        .collect()
    }

    /// The pod's first address (without its prefix length).
    pub fn ip(&self) -> String {
        let a = self.result["ips"][0]["address"].as_str().expect("an address");
        a.split('/').next().unwrap().to_string()
    }

    /// The host-side veth: the result's interface outside the sandbox that
    /// is not the bridge.
    pub fn host_veth(&self) -> String {
        let bridge = self.conf["bridge"].as_str().unwrap_or("");
        self.result["interfaces"]
            .as_array()
            .expect("interfaces")
            .iter()
            .filter(|i| i.get("sandbox").is_none_or(|s| s.as_str() == Some("")))
            .filter_map(|i| i["name"].as_str())
            .find(|n| *n != bridge)
            .expect("a host interface")
            .to_string()
    }
}

impl Drop for CniPod {
    fn drop(&mut self) {
        if !self.result.is_null() {
            let mut conf = self.conf.clone();
            conf["prevResult"] = self.result.clone();
            let r = exec_plugin(&self.plugin, self.host_netns.as_deref(), &self.env("DEL"), &conf);
            if r.code != 0 {
                eprintln!("{} DEL of {}: {} {}", self.plugin, self.netns, r.stdout, r.stderr);
            }
        }
        let _ = Command::new("ip").args(["netns", "delete", &self.netns]).output();
    }
}

/// ifindex of interface `name` in network namespace `netns` (or the test's own).
pub fn ifindex(netns: Option<&str>, name: &str) -> u32 {
    let mut cmd = Command::new("ip");
    if let Some(ns) = netns {
        cmd.args(["-n", ns]);
    }
    let out = cmd.args(["-j", "link", "show", "dev", name]).output().unwrap();
    assert!(out.status.success(), "no interface {name}");
    let v: Value = serde_json::from_slice(&out.stdout).unwrap();
    v[0]["ifindex"].as_u64().unwrap() as u32
}

/// Whether the process named by the digits after `prefix` in `name` is gone.
pub fn stale(name: &str, prefix: &str) -> bool {
    let pid: String = name
        .strip_prefix(prefix)
        .unwrap_or("")
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    !pid.is_empty() && !Path::new(&format!("/proc/{pid}")).exists()
}

/// Remove what crashed runs of a test crate left: netns, root-namespace
/// interfaces, temp dirs, pins and nftables tables named `<prefix><pid>...`
/// whose process is gone.
pub fn clear_leftovers(prefix: &str) {
    let out = Command::new("ip")
        .args(["netns", "list"])
        .output()
        .expect("ip netns list");
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        if stale(name, prefix) {
            let _ = Command::new("ip").args(["netns", "delete", name]).output();
        }
    }
    for entry in std::fs::read_dir("/sys/class/net").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if stale(&name, prefix) {
            let _ = Command::new("ip").args(["link", "delete", &name]).output();
        }
    }
    for dir in [std::env::temp_dir(), PathBuf::from("/sys/fs/bpf")] {
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if stale(&name, prefix) {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    // nftables tables an agent of a crashed run left ("table <family> <name>").
    if let Ok(out) = Command::new("nft").args(["list", "tables"]).output() {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            if let ["table", family, name] = line.split_whitespace().collect::<Vec<_>>()[..] {
                if stale(name, prefix) {
                    let _ = Command::new("nft").args(["delete", "table", family, name]).output();
                }
            }
        }
    }
}
