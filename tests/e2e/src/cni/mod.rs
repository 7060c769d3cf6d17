//! Pods wired as a container runtime wires them: the node's conflist (the
//! reference `ptp` or `bridge` plugin with `host-local` IPAM, then
//! `npm-cni`, as the chart chains it), each plugin called inside the node
//! (its netns and mount namespace, [`crate::nodes::Node::command`]) with
//! the runtime's `CNI_*` environment, `CNI_ARGS`
//! `IgnoreUnknown=1;K8S_POD_NAMESPACE=…;K8S_POD_NAME=…;K8S_POD_INFRA_CONTAINER_ID=…;K8S_POD_UID=…`,
//! its entry on stdin with `name`, `cniVersion`, `runtimeConfig` (for the
//! capabilities it declares) and the previous plugin's result as
//! `prevResult`, as libcni does. After ADD the result is cached under the
//! node's `/var/lib/cni/results/<network>-<containerID>-<ifname>` in
//! libcni's `cniCacheV1` format; DEL runs the chain in reverse order with
//! the cached result as `prevResult` and removes the entry.
//!
//! Pods ask for the model's addresses through the `ips` capability
//! (`runtimeConfig.ips`, which host-local honours), so the catalogue's
//! addresses and CIDR placeholders stay what they are on one node.

use std::io::Write;
use std::net::{Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use base64::Engine as _;
use serde_json::{json, Value};

use crate::nodes::{ns_gateways, ns_subnet_v4, ns_subnet_v6, Node, Nodes, MAX_NS_INDEX};

/// Where Debian's containernetworking-plugins live.
pub const REFERENCE_PLUGINS: &str = "/usr/lib/cni";
/// The CNI version of the conflist.
pub const CNI_VERSION: &str = "1.0.0";
/// The network's name (the conflist's `name`).
pub const NETWORK: &str = "npm-e2e";
/// The interface name inside the pod.
pub const IFNAME: &str = "eth0";

/// Errors of the CNI runtime.
#[derive(Debug, thiserror::Error)]
pub enum CniError {
    /// A plugin could not be started.
    #[error("{plugin} {command}: spawn: {source}")]
    Spawn {
        /// The plugin type.
        plugin: String,
        /// CNI_COMMAND.
        command: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A plugin failed (its CNI error on stdout).
    #[error("{plugin} {command} of {pod}: exit {code}: {stdout} {stderr}")]
    Plugin {
        /// The plugin type.
        plugin: String,
        /// CNI_COMMAND.
        command: String,
        /// The pod (`ns/name`).
        pod: String,
        /// Exit code.
        code: i32,
        /// Its stdout.
        stdout: String,
        /// Its stderr.
        stderr: String,
    },
    /// A result could not be parsed.
    #[error("{plugin} ADD of {pod}: result is not JSON: {detail}")]
    Result {
        /// The plugin type.
        plugin: String,
        /// The pod.
        pod: String,
        /// What was wrong.
        detail: String,
    },
    /// The result cache could not be written or removed.
    #[error("result cache {path}: {source}")]
    Cache {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A plugin binary is missing.
    #[error("CNI plugin {0} is missing (run `cargo xtask setup`, and `cargo build -p npm-cni`)")]
    Missing(PathBuf),
}

/// The interface plugin of the network.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wiring {
    /// `ptp`: one routed veth per pod.
    Ptp,
    /// `bridge`: veths on the bridge `cni0`, which holds the gateways.
    Bridge,
}

impl Wiring {
    /// The plugin type.
    pub fn plugin(self) -> &'static str {
        match self {
            Wiring::Ptp => "ptp",
            Wiring::Bridge => "bridge",
        }
    }
}

/// The node's view of the runtime: where it calls plugins and caches
/// results. Cheap to clone; pods keep one for their DEL.
#[derive(Clone, Debug)]
pub struct NodeRuntime {
    /// The node's name.
    pub node: String,
    /// The node's netns.
    pub netns: String,
    /// The pid of the node's mount-namespace holder
    /// ([`crate::nodes::enter_mount_args`]).
    pub mount_holder: Option<u32>,
    /// `CNI_PATH` (host path, also valid inside the node).
    pub cni_path: PathBuf,
    /// The node's `/var/lib/cni` as the host sees it.
    pub var_lib_cni: PathBuf,
    /// The node's conflist.
    pub conflist: Value,
}

/// One pod's attachment: what DEL needs.
#[derive(Clone, Debug)]
pub struct Attachment {
    /// The node's runtime.
    pub runtime: NodeRuntime,
    /// `CNI_CONTAINERID`.
    pub container_id: String,
    /// The pod netns name.
    pub netns: String,
    /// Pod namespace.
    pub namespace: String,
    /// Pod name.
    pub name: String,
    /// Pod uid.
    pub uid: String,
    /// The requested addresses (`runtimeConfig.ips`).
    pub ips: Vec<String>,
    /// The chain's final result.
    pub result: Value,
    /// The network configuration this pod is wired with (the node's; with
    /// `bridge`, narrowed to the pod's namespace subnet and its bridge).
    pub conflist: Value,
    /// Wall time of each plugin's ADD of the last [`Attachment::add`], by
    /// plugin type, in chain order (what the runtime waited for each: the
    /// enforcement bench reads npm-cni's hold here).
    pub add_timings: Vec<(String, std::time::Duration)>,
}

/// The conflist of `node`: `wiring` with host-local ranges on the subnets
/// of the namespaces the node owns, default routes, the `ips` capability;
/// then npm-cni on the default socket (`/run/npm/cni.sock`, the node's).
///
/// The reference `bridge` plugin holds one IPv4 gateway per bridge, so a
/// bridged pod is wired with this list narrowed to its namespace's subnet
/// on the bridge `cni<n>` ([`Attachment::new`]): in the three-node
/// upstream model every node has exactly one (`cni1`, `cni2`, `cni3`);
/// namespaces created by a case add a bridge on their node.
pub fn conflist(nodes: &Nodes, node: &Node, wiring: Wiring, mtu: Option<u32>) -> Value {
    let count = nodes.nodes().len() as u8;
    let mut v4 = Vec::new();
    let mut v6 = Vec::new();
    for n in 1..=MAX_NS_INDEX {
        if Nodes::owner_of(count, n) != node.index {
            continue;
        }
        let (g4, g6) = ns_gateways(n);
        v4.push(json!({"subnet": ns_subnet_v4(n), "gateway": g4}));
        v6.push(json!({"subnet": ns_subnet_v6(n), "gateway": g6}));
    }
    let ipam = json!({
        "type": "host-local",
        "ranges": [v4, v6],
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
    });
    let mut first = match wiring {
        Wiring::Ptp => json!({"type": "ptp", "ipMasq": false}),
        Wiring::Bridge => json!({
            "type": "bridge", "bridge": "cni1", "isGateway": true, "ipMasq": false, "hairpinMode": true,
        }),
    };
    first["capabilities"] = json!({"ips": true});
    first["ipam"] = ipam;
    if let Some(mtu) = mtu {
        first["mtu"] = json!(mtu);
    }
    json!({
        "cniVersion": CNI_VERSION,
        "name": NETWORK,
        "plugins": [first, {"type": "npm-cni", "agentSocket": "/run/npm/cni.sock", "timeoutSeconds": 10, "failOpen": false}],
    })
}

/// Prepares the node's `CNI_PATH` (symlinks to the reference plugins and
/// to `npm_cni`) and returns its runtime.
pub fn node_runtime(node: &Node, conflist: Value, npm_cni: &Path) -> Result<NodeRuntime, CniError> {
    let bin = node.cni_bin();
    for p in ["ptp", "bridge", "host-local", "loopback"] {
        let src = Path::new(REFERENCE_PLUGINS).join(p);
        if !src.exists() {
            return Err(CniError::Missing(src));
        }
        link(&src, &bin.join(p))?;
    }
    if !npm_cni.exists() {
        return Err(CniError::Missing(npm_cni.to_path_buf()));
    }
    link(npm_cni, &bin.join("npm-cni"))?;
    Ok(NodeRuntime {
        node: node.name.clone(),
        netns: node.netns.clone(),
        mount_holder: node.holder_pid(),
        cni_path: bin,
        var_lib_cni: node.var_lib_cni(),
        conflist,
    })
}

fn link(src: &Path, dst: &Path) -> Result<(), CniError> {
    let _ = std::fs::remove_file(dst);
    let src = std::fs::canonicalize(src).unwrap_or_else(|_| src.to_path_buf());
    std::os::unix::fs::symlink(&src, dst).map_err(|source| CniError::Cache {
        path: dst.to_path_buf(),
        source,
    })
}

impl NodeRuntime {
    fn run_plugin(
        &self,
        plugin: &Value,
        env: &[(String, String)],
        stdin: &Value,
    ) -> Result<(i32, String, String), CniError> {
        let ty = plugin["type"].as_str().unwrap_or("").to_string();
        let command = env
            .iter()
            .find(|(k, _)| k == "CNI_COMMAND")
            .map(|(_, v)| v.clone())
            .unwrap_or_default();
        let bin = self.cni_path.join(&ty);
        let mut cmd = std::process::Command::new("nsenter");
        if let Some(pid) = self.mount_holder {
            cmd.args(crate::nodes::enter_mount_args(pid));
        }
        cmd.arg(format!("--net=/run/netns/{}", self.netns))
            .arg("--")
            .arg(&bin)
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .envs(env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let spawn_err = |source| CniError::Spawn {
            plugin: ty.clone(),
            command: command.clone(),
            source,
        };
        let mut child = cmd.spawn().map_err(spawn_err)?;
        if let Some(mut si) = child.stdin.take() {
            si.write_all(stdin.to_string().as_bytes()).map_err(spawn_err)?;
        }
        let out = child.wait_with_output().map_err(spawn_err)?;
        Ok((
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stdout).trim().to_string(),
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ))
    }
}

/// The list with its ranges narrowed to namespace index `n`'s subnets and
/// gateways (whatever node owns them): the list a node's chain wires a pod
/// with at an address moved there from another node's subnet.
pub fn with_only_subnet(list: &Value, n: u8) -> Value {
    let mut list = list.clone();
    let (g4, g6) = ns_gateways(n);
    list["plugins"][0]["ipam"]["ranges"] = json!([
        [{"subnet": ns_subnet_v4(n), "gateway": g4}],
        [{"subnet": ns_subnet_v6(n), "gateway": g6}],
    ]);
    list
}

/// The list with npm-cni's `timeoutSeconds` set to `secs`: how long its ADD
/// (and DEL) waits for the node's agent.
pub fn with_npm_cni_timeout(list: &Value, secs: u64) -> Value {
    let mut list = list.clone();
    if let Some(plugins) = list["plugins"].as_array_mut() {
        for p in plugins.iter_mut().filter(|p| p["type"] == "npm-cni") {
            p["timeoutSeconds"] = json!(secs);
        }
    }
    list
}

/// For a `bridge` list: the list narrowed to namespace index `n`'s subnets
/// on the bridge `cni<n>`; any other list unchanged.
fn narrowed(list: &Value, n: u8) -> Value {
    let mut list = list.clone();
    let first = &mut list["plugins"][0];
    if first["type"] != "bridge" {
        return list;
    }
    first["bridge"] = json!(format!("cni{n}"));
    let (s4, s6) = (ns_subnet_v4(n), ns_subnet_v6(n));
    if let Some(sets) = first["ipam"]["ranges"].as_array_mut() {
        for set in sets {
            if let Some(ranges) = set.as_array_mut() {
                ranges.retain(|r| r["subnet"] == s4.as_str() || r["subnet"] == s6.as_str());
            }
        }
    }
    list
}

impl Attachment {
    /// A new attachment of pod `namespace/name` (uid `uid`) in netns
    /// `netns`, asking for `v4` and `v6`.
    pub fn new(
        runtime: &NodeRuntime,
        netns: &str,
        namespace: &str,
        name: &str,
        uid: &str,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
    ) -> Attachment {
        Attachment {
            runtime: runtime.clone(),
            container_id: format!("{netns}-sandbox"),
            netns: netns.to_string(),
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: uid.to_string(),
            ips: vec![v4.to_string(), v6.to_string()],
            result: Value::Null,
            conflist: narrowed(&runtime.conflist, v4.octets()[2]),
            add_timings: Vec::new(),
        }
    }

    fn pod(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn cni_args(&self) -> Vec<(String, String)> {
        vec![
            ("IgnoreUnknown".into(), "1".into()),
            ("K8S_POD_NAMESPACE".into(), self.namespace.clone()),
            ("K8S_POD_NAME".into(), self.name.clone()),
            ("K8S_POD_INFRA_CONTAINER_ID".into(), self.container_id.clone()),
            ("K8S_POD_UID".into(), self.uid.clone()),
        ]
    }

    fn env(&self, command: &str) -> Vec<(String, String)> {
        let args = self
            .cni_args()
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect::<Vec<_>>()
            .join(";");
        vec![
            ("CNI_COMMAND".into(), command.into()),
            ("CNI_CONTAINERID".into(), self.container_id.clone()),
            ("CNI_NETNS".into(), format!("/var/run/netns/{}", self.netns)),
            ("CNI_IFNAME".into(), IFNAME.into()),
            ("CNI_ARGS".into(), args),
            ("CNI_PATH".into(), self.runtime.cni_path.display().to_string()),
        ]
    }

    /// One plugin's stdin, as libcni builds it.
    fn stdin(&self, plugin: &Value, prev: Option<&Value>) -> Value {
        let mut conf = plugin.clone();
        conf["name"] = json!(NETWORK);
        conf["cniVersion"] = self.conflist["cniVersion"].clone();
        if plugin["capabilities"]["ips"].as_bool() == Some(true) {
            conf["runtimeConfig"] = json!({"ips": self.ips});
        }
        if let Some(p) = prev {
            conf["prevResult"] = p.clone();
        }
        conf
    }

    fn plugins(&self) -> Vec<Value> {
        self.conflist["plugins"].as_array().cloned().unwrap_or_default()
    }

    /// The cache file (host path).
    pub fn cache_path(&self) -> PathBuf {
        self.runtime
            .var_lib_cni
            .join("results")
            .join(format!("{NETWORK}-{}-{IFNAME}", self.container_id))
    }

    /// CNI ADD of the conflist; on success the result is cached and kept.
    /// A failed chain is undone with DEL, as a runtime does.
    pub fn add(&mut self) -> Result<&Value, CniError> {
        let mut prev: Option<Value> = None;
        self.add_timings.clear();
        for plugin in self.plugins() {
            let ty = plugin["type"].as_str().unwrap_or("").to_string();
            let t0 = std::time::Instant::now();
            let (code, stdout, stderr) =
                self.runtime
                    .run_plugin(&plugin, &self.env("ADD"), &self.stdin(&plugin, prev.as_ref()))?;
            self.add_timings.push((ty.clone(), t0.elapsed()));
            if code != 0 {
                self.result = prev.unwrap_or(Value::Null);
                let _ = self.del();
                return Err(CniError::Plugin {
                    plugin: ty,
                    command: "ADD".into(),
                    pod: self.pod(),
                    code,
                    stdout,
                    stderr,
                });
            }
            prev = Some(serde_json::from_str(&stdout).map_err(|e| CniError::Result {
                plugin: ty,
                pod: self.pod(),
                detail: e.to_string(),
            })?);
        }
        self.result = prev.unwrap_or(Value::Null);
        self.write_cache()?;
        Ok(&self.result)
    }

    fn write_cache(&self) -> Result<(), CniError> {
        let config = base64::engine::general_purpose::STANDARD.encode(self.conflist.to_string());
        let cached = json!({
            "kind": "cniCacheV1",
            "containerId": self.container_id,
            "config": config,
            "ifName": IFNAME,
            "networkName": NETWORK,
            "netns": format!("/var/run/netns/{}", self.netns),
            "cniArgs": self.cni_args().iter().map(|(k, v)| json!([k, v])).collect::<Vec<_>>(),
            "capabilityArgs": {"ips": self.ips},
            "result": self.result,
        });
        let path = self.cache_path();
        std::fs::write(&path, cached.to_string()).map_err(|source| CniError::Cache { path, source })
    }

    /// CNI DEL of the conflist in reverse order (with the cached result as
    /// `prevResult`), then the cache entry is removed. Every plugin is
    /// called even when one fails; the first failure is returned.
    pub fn del(&mut self) -> Result<(), CniError> {
        let prev = if self.result.is_null() {
            None
        } else {
            Some(self.result.clone())
        };
        let mut first = None;
        for plugin in self.plugins().iter().rev() {
            let ty = plugin["type"].as_str().unwrap_or("").to_string();
            match self
                .runtime
                .run_plugin(plugin, &self.env("DEL"), &self.stdin(plugin, prev.as_ref()))
            {
                Ok((0, _, _)) => {}
                Ok((code, stdout, stderr)) => {
                    first.get_or_insert(CniError::Plugin {
                        plugin: ty,
                        command: "DEL".into(),
                        pod: self.pod(),
                        code,
                        stdout,
                        stderr,
                    });
                }
                Err(e) => {
                    first.get_or_insert(e);
                }
            }
        }
        self.result = Value::Null;
        let path = self.cache_path();
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                first.get_or_insert(CniError::Cache { path, source });
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The host-side interfaces of the result (for `bridge`: the bridge
    /// and the veth).
    pub fn host_interfaces(&self) -> Vec<String> {
        self.result["interfaces"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter(|i| i.get("sandbox").is_none_or(|s| s.as_str() == Some("")))
                    .filter_map(|i| i["name"].as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default()
    }
}
