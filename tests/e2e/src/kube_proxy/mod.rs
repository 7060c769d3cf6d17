//! A kube-proxy for one node of the netns cluster: it programs the node netns' DNAT for
//! ClusterIP and NodePort Services from Services and EndpointSlices, the way kube-proxy does
//! in its `nftables` mode ([`nft`]) or its `iptables` mode ([`iptables`]). No kube-proxy
//! binary exists here; the kernel's NAT is the real one.
//!
//! Level-triggered: a background thread lists ALL Services and EndpointSlices every
//! interval, computes the node's whole state ([`model`]) and, when it changed (or every
//! [`RESYNC`] anyway), replaces the rules atomically: one `nft -f` transaction, or one
//! `iptables-restore --noflush` per family rewriting kube-proxy's own chains. A failed list
//! keeps the rules last applied: nothing is ever programmed from a partial view.

pub mod iptables;
pub mod model;
pub mod nft;

use std::collections::BTreeSet;
use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::api::Api;
use crate::poller::{Pass, Poller};
use model::{service_ports, ServicePort};

/// How often the full lists are read.
pub const INTERVAL: Duration = Duration::from_millis(100);
/// Rules are re-applied at least this often even when nothing changed.
pub const RESYNC: Duration = Duration::from_secs(30);

/// Errors of the kube-proxy emulation.
#[derive(Debug, thiserror::Error)]
pub enum KubeProxyError {
    /// A command could not be started.
    #[error("running {cmd}: {source}")]
    Spawn {
        /// The command line.
        cmd: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// A command failed.
    #[error("{cmd} failed: {stderr}")]
    Command {
        /// The command line.
        cmd: String,
        /// Its standard error.
        stderr: String,
    },
    /// The background thread could not be started.
    #[error("starting the kube-proxy thread of {netns}: {source}")]
    Thread {
        /// The node netns.
        netns: String,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An unknown mode name.
    #[error("unknown kube-proxy mode {0:?} (iptables or nftables)")]
    Mode(String),
}

/// The proxy mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `--proxy-mode iptables`: iptables-restore of KUBE-* chains in the nat table.
    Iptables,
    /// `--proxy-mode nftables`: `table ip kube-proxy` and `table ip6 kube-proxy`.
    Nftables,
}

impl std::str::FromStr for Mode {
    type Err = KubeProxyError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "iptables" => Ok(Mode::Iptables),
            "nftables" => Ok(Mode::Nftables),
            other => Err(KubeProxyError::Mode(other.to_string())),
        }
    }
}

/// Run `program args` inside `netns` (via `ip netns exec`), feeding `stdin`; its stdout.
pub fn run_in(netns: &str, program: &str, args: &[&str], stdin: Option<&str>) -> Result<String, KubeProxyError> {
    let cmd = format!("ip netns exec {netns} {program} {}", args.join(" "));
    let mut child = Command::new("ip")
        .args(["netns", "exec", netns, program])
        .args(args)
        .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| KubeProxyError::Spawn {
            cmd: cmd.clone(),
            source,
        })?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes())
            .map_err(|source| KubeProxyError::Spawn {
                cmd: cmd.clone(),
                source,
            })?;
    }
    let out = child.wait_with_output().map_err(|source| KubeProxyError::Spawn {
        cmd: cmd.clone(),
        source,
    })?;
    if !out.status.success() {
        return Err(KubeProxyError::Command {
            cmd,
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `iptables` or `ip6tables` (and their `-save`/`-restore`).
fn ipt(v6: bool, suffix: &str) -> String {
    format!("{}{suffix}", if v6 { "ip6tables" } else { "iptables" })
}

/// Apply the whole state of both families to `netns`.
fn apply(netns: &str, mode: Mode, v4: &[ServicePort], v6: &[ServicePort]) -> Result<(), KubeProxyError> {
    match mode {
        Mode::Nftables => {
            let script = nft::render(v4, false) + &nft::render(v6, true);
            run_in(netns, "nft", &["-f", "-"], Some(&script)).map(|_| ())
        }
        Mode::Iptables => {
            for (ports, is6) in [(v4, false), (v6, true)] {
                let save = run_in(netns, &ipt(is6, "-save"), &["-t", "nat"], None)?;
                let text = iptables::render(ports, &iptables::kube_chains(&save));
                run_in(netns, &ipt(is6, "-restore"), &["-w", "5", "--noflush"], Some(&text))?;
                for (table, chain, spec) in iptables::HOOKS {
                    let spec: Vec<&str> = spec.split_whitespace().collect();
                    let mut check = vec!["-w", "5", "-t", table, "-C", chain];
                    check.extend(&spec);
                    if run_in(netns, &ipt(is6, ""), &check, None).is_err() {
                        let mut ins = vec!["-w", "5", "-t", table, "-I", chain, "1"];
                        ins.extend(&spec);
                        run_in(netns, &ipt(is6, ""), &ins, None)?;
                    }
                }
            }
            Ok(())
        }
    }
}

/// A running kube-proxy for one node; dropping it stops it and removes its rules.
#[derive(Debug)]
pub struct KubeProxy {
    netns: String,
    mode: Mode,
    poller: Poller,
}

/// The `items` of a full list, None when the answer is not a list.
fn items(v: Value) -> Option<Vec<Value>> {
    match v.get("items") {
        Some(Value::Array(a)) => Some(a.clone()),
        Some(Value::Null) => Some(Vec::new()),
        _ => None,
    }
}

impl KubeProxy {
    /// Start a kube-proxy for node `node_name` whose network namespace is `node_netns`
    /// (a name under /run/netns): enables forwarding (and, where the node has a bridge
    /// netfilter, `bridge-nf-call-ip(6)tables`, which bridged pods need as on any node),
    /// removes leftover rules of a crashed run, then syncs in the background.
    pub fn start(node_netns: &str, mode: Mode, api: Api, node_name: &str) -> Result<KubeProxy, KubeProxyError> {
        run_in(
            node_netns,
            "sysctl",
            &["-qw", "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
            None,
        )?;
        // Present only with br_netfilter (per-netns since 5.3); a missing key is fine.
        let _ = run_in(
            node_netns,
            "sysctl",
            &[
                "-qw",
                "net.bridge.bridge-nf-call-iptables=1",
                "net.bridge.bridge-nf-call-ip6tables=1",
            ],
            None,
        );
        Self::cleanup(node_netns, mode);
        let (netns, node) = (node_netns.to_string(), node_name.to_string());
        let mut applied = Applied {
            state: None,
            at: Instant::now(),
        };
        let poller = Poller::spawn(format!("kube-proxy-{node_name}"), INTERVAL, move || {
            sync_pass(&netns, mode, &api, &node, &mut applied)
        })
        .map_err(|source| KubeProxyError::Thread {
            netns: node_netns.to_string(),
            source,
        })?;
        Ok(KubeProxy {
            netns: node_netns.to_string(),
            mode,
            poller,
        })
    }

    /// Wait until the first full state was applied.
    pub fn wait_synced(&self, timeout: Duration) -> bool {
        self.poller.wait_synced(timeout)
    }

    /// How many times rules were applied (each apply is one whole-state replacement).
    pub fn applied_generation(&self) -> u64 {
        self.poller.done_count()
    }

    /// The last list or apply error, if the last attempt failed.
    pub fn last_error(&self) -> Option<String> {
        self.poller.last_error()
    }

    /// Stop the thread and remove the rules.
    pub fn stop(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if self.poller.halt() {
            Self::cleanup(&self.netns, self.mode);
        }
    }

    /// Remove every rule a kube-proxy of `mode` left in `node_netns` (best effort: a
    /// missing table or chain is not an error).
    pub fn cleanup(node_netns: &str, mode: Mode) {
        match mode {
            Mode::Nftables => {
                let _ = run_in(node_netns, "nft", &["-f", "-"], Some(&nft::cleanup_script()));
            }
            Mode::Iptables => {
                for v6 in [false, true] {
                    for (table, chain, spec) in iptables::HOOKS {
                        let spec: Vec<&str> = spec.split_whitespace().collect();
                        let mut del = vec!["-w", "5", "-t", table, "-D", chain];
                        del.extend(&spec);
                        while run_in(node_netns, &ipt(v6, ""), &del, None).is_ok() {}
                    }
                    let chains = |t: &str| -> BTreeSet<String> {
                        run_in(node_netns, &ipt(v6, "-save"), &["-t", t], None)
                            .map(|s| iptables::kube_chains(&s))
                            .unwrap_or_default()
                    };
                    let text = iptables::cleanup(&chains("nat"), &chains("filter"));
                    let _ = run_in(node_netns, &ipt(v6, "-restore"), &["-w", "5", "--noflush"], Some(&text));
                }
            }
        }
    }
}

impl Drop for KubeProxy {
    fn drop(&mut self) {
        self.halt();
    }
}

/// The state last applied and when.
struct Applied {
    state: Option<(Vec<ServicePort>, Vec<ServicePort>)>,
    at: Instant,
}

/// One pass of the background loop: full lists, whole state, atomic apply on change (or
/// every [`RESYNC`]). A failed list keeps the rules last applied.
fn sync_pass(netns: &str, mode: Mode, api: &Api, node: &str, applied: &mut Applied) -> Pass {
    let lists = api
        .get("/api/v1/services")
        .map_err(|e| e.to_string())
        .and_then(|s| items(s).ok_or_else(|| "services: not a list".to_string()))
        .and_then(|s| {
            api.get("/apis/discovery.k8s.io/v1/endpointslices")
                .map_err(|e| e.to_string())
                .and_then(|e| items(e).ok_or_else(|| "endpointslices: not a list".to_string()))
                .map(|e| (s, e))
        });
    let (svcs, slices) = match lists {
        Err(e) => return Pass::Failed(format!("list: {e} (keeping the last applied rules)")),
        Ok(l) => l,
    };
    let state = (
        service_ports(&svcs, &slices, node, false),
        service_ports(&svcs, &slices, node, true),
    );
    if applied.state.as_ref() == Some(&state) && applied.at.elapsed() < RESYNC {
        return Pass::Idle;
    }
    match apply(netns, mode, &state.0, &state.1) {
        Ok(()) => {
            applied.state = Some(state);
            applied.at = Instant::now();
            Pass::Done
        }
        Err(e) => Pass::Failed(format!("apply: {e}")),
    }
}
