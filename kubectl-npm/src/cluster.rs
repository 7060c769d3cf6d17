//! The cluster as the user's kubeconfig sees it: the pods named on the
//! command line, their nodes, and the npm agent pod of each node (the
//! chart's DaemonSet: labels `app.kubernetes.io/name=npm-agent`, namespace
//! `kube-system` unless told otherwise) with the port of its loopback debug
//! listener (`--debug-addr` of its container, default 9091).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::Path;

use k8s_openapi::api::core::v1::Pod;
use kube::api::ListParams;
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Api, Client, Config};

use crate::error::{api_error, Access, NpmError};

/// The agents' default namespace (the chart's documented install).
pub const DEFAULT_AGENT_NAMESPACE: &str = "kube-system";
/// The chart's selector labels of the agent pods.
pub const DEFAULT_AGENT_SELECTOR: &str = "app.kubernetes.io/name=npm-agent";
/// The agent's default debug port (`--debug-addr 127.0.0.1:9091`).
pub const DEFAULT_DEBUG_PORT: u16 = 9091;

/// The kube client of the user's kubeconfig: `kubeconfig` (else
/// `$KUBECONFIG`, `~/.kube/config` or the in-cluster config, as
/// `Client::try_default`) and `context` (else the current one).
pub async fn client(kubeconfig: Option<&Path>, context: Option<&str>) -> Result<Client, NpmError> {
    let cfg = |e: &dyn std::fmt::Display| NpmError::Config(e.to_string());
    let opts = KubeConfigOptions {
        context: context.map(String::from),
        ..Default::default()
    };
    let config = match (kubeconfig, context) {
        (Some(path), _) => {
            let kc = Kubeconfig::read_from(path).map_err(|e| cfg(&e))?;
            Config::from_custom_kubeconfig(kc, &opts).await.map_err(|e| cfg(&e))?
        }
        (None, Some(_)) => Config::from_kubeconfig(&opts).await.map_err(|e| cfg(&e))?,
        (None, None) => Config::infer().await.map_err(|e| cfg(&e))?,
    };
    Client::try_from(config).map_err(|e| cfg(&e))
}

/// One npm agent pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AgentPod {
    /// Its namespace.
    pub namespace: String,
    /// Its name.
    pub name: String,
    /// The node it runs on.
    pub node: String,
    /// The port of its debug listener.
    pub debug_port: u16,
    /// `None` when the pod is Ready, else why not (from its conditions).
    pub not_ready: Option<String>,
    /// The container's `--dataplane` and `--attach` (as configured).
    pub args: BTreeMap<String, String>,
}

impl AgentPod {
    /// `namespace/name`.
    pub fn id(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }
}

/// The `--flag=value` and `--flag value` arguments of a container's
/// command line.
fn flags(args: &[String]) -> BTreeMap<String, String> {
    let mut out = BTreeMap::new();
    let mut it = args.iter().peekable();
    while let Some(a) = it.next() {
        let Some(flag) = a.strip_prefix("--") else { continue };
        match flag.split_once('=') {
            Some((k, v)) => {
                out.insert(k.to_string(), v.to_string());
            }
            None => {
                if let Some(v) = it.next_if(|v| !v.starts_with("--")) {
                    out.insert(flag.to_string(), v.clone());
                }
            }
        }
    }
    out
}

/// Why `pod` is not Ready (`None` when it is).
pub fn not_ready(pod: &Pod) -> Option<String> {
    let status = pod.status.as_ref();
    let ready = status
        .and_then(|s| s.conditions.as_ref())
        .and_then(|c| c.iter().find(|c| c.type_ == "Ready"));
    match ready {
        Some(c) if c.status == "True" => None,
        Some(c) => Some(match (&c.reason, &c.message) {
            (Some(r), Some(m)) => format!("{r}: {m}"),
            (Some(r), None) => r.clone(),
            _ => "the pod's Ready condition is not True".into(),
        }),
        None => Some(format!(
            "phase {}, no Ready condition",
            status.and_then(|s| s.phase.as_deref()).unwrap_or("unknown")
        )),
    }
}

/// What `kubectl npm` reads in the cluster.
#[derive(Clone)]
pub struct Cluster {
    /// The user's client.
    pub client: Client,
    /// Where the agents run.
    pub agent_namespace: String,
    /// The agents' label selector.
    pub agent_selector: String,
    /// A debug port overriding the agents' own (`--debug-port`).
    pub debug_port: Option<u16>,
    /// How long an agent's connection may stay silent before it is given
    /// up (`--idle-timeout`; the agents' `/observe` sends a keepalive
    /// every 10 s).
    pub idle_timeout: std::time::Duration,
}

impl Cluster {
    /// The pod `namespace/name`.
    pub async fn pod(&self, namespace: &str, name: &str) -> Result<Pod, NpmError> {
        Api::<Pod>::namespaced(self.client.clone(), namespace)
            .get(name)
            .await
            .map_err(|e| {
                api_error(
                    e,
                    Access::new("get", "pods", Some(namespace)),
                    &format!("pod {namespace}/{name}"),
                )
            })
    }

    /// The pods of `namespace` (`None`: every namespace), of the field
    /// selector `fields` if any.
    pub async fn pods(&self, namespace: Option<&str>, fields: Option<&str>) -> Result<Vec<Pod>, NpmError> {
        let api = match namespace {
            Some(ns) => Api::<Pod>::namespaced(self.client.clone(), ns),
            None => Api::<Pod>::all(self.client.clone()),
        };
        let mut lp = ListParams::default();
        if let Some(f) = fields {
            lp = lp.fields(f);
        }
        let what = match namespace {
            Some(ns) => format!("listing the pods of namespace {ns}"),
            None => "listing pods".into(),
        };
        api.list(&lp)
            .await
            .map(|l| l.items)
            .map_err(|e| api_error(e, Access::new("list", "pods", namespace), &what))
    }

    /// The node of a `NAMESPACE/POD` or address argument: `Ok(None)` for an
    /// address no pod holds (outside the cluster, or a node's).
    pub async fn node_of(&self, endpoint: &str) -> Result<Option<(String, String)>, NpmError> {
        if let Ok(ip) = endpoint.parse::<IpAddr>() {
            let pods = self.pods(None, Some(&format!("status.podIP={ip}"))).await?;
            // The field selector matches the primary address only; the
            // filter also guards against a server that ignored it.
            let holder = pods.into_iter().find(|p| {
                let s = p.status.as_ref();
                s.and_then(|s| s.pod_ips.as_ref())
                    .is_some_and(|ips| ips.iter().any(|i| i.ip.parse::<IpAddr>().ok() == Some(ip)))
                    || s.and_then(|s| s.pod_ip.as_deref()).and_then(|i| i.parse().ok()) == Some(ip)
            });
            return Ok(holder.and_then(|p| {
                let id = format!(
                    "{}/{}",
                    p.metadata.namespace.as_deref().unwrap_or(""),
                    p.metadata.name.as_deref().unwrap_or("")
                );
                p.spec.and_then(|s| s.node_name).map(|n| (id, n))
            }));
        }
        let (ns, name) = endpoint
            .split_once('/')
            .filter(|(ns, name)| !ns.is_empty() && !name.is_empty())
            .ok_or_else(|| NpmError::Usage(format!("{endpoint:?} is neither NAMESPACE/POD nor an IP address")))?;
        let pod = self.pod(ns, name).await?;
        let node = pod
            .spec
            .and_then(|s| s.node_name)
            .ok_or_else(|| NpmError::NotScheduled(endpoint.into()))?;
        Ok(Some((endpoint.into(), node)))
    }

    /// The agent pods, by node.
    pub async fn agents(&self) -> Result<BTreeMap<String, AgentPod>, NpmError> {
        let api = Api::<Pod>::namespaced(self.client.clone(), &self.agent_namespace);
        let list = api
            .list(&ListParams::default().labels(&self.agent_selector))
            .await
            .map_err(|e| {
                api_error(
                    e,
                    Access::new("list", "pods", Some(&self.agent_namespace)),
                    "listing the npm agent pods",
                )
            })?;
        let mut out = BTreeMap::new();
        for pod in list.items {
            let Some(node) = pod.spec.as_ref().and_then(|s| s.node_name.clone()) else {
                continue;
            };
            // A pod being replaced: prefer the one that is running.
            if pod.metadata.deletion_timestamp.is_some() && out.contains_key(&node) {
                continue;
            }
            let container = pod.spec.as_ref().and_then(|s| {
                s.containers
                    .iter()
                    .find(|c| c.name == "agent")
                    .or_else(|| s.containers.first())
            });
            let args: Vec<String> = container
                .map(|c| {
                    c.command
                        .iter()
                        .flatten()
                        .chain(c.args.iter().flatten())
                        .cloned()
                        .collect()
                })
                .unwrap_or_default();
            let flags = flags(&args);
            let debug_port = self.debug_port.unwrap_or_else(|| {
                flags
                    .get("debug-addr")
                    .and_then(|a| a.parse::<std::net::SocketAddr>().ok())
                    .map_or(DEFAULT_DEBUG_PORT, |a| a.port())
            });
            let not_ready = not_ready(&pod);
            let agent = AgentPod {
                namespace: self.agent_namespace.clone(),
                name: pod.metadata.name.clone().unwrap_or_default(),
                node: node.clone(),
                debug_port,
                not_ready,
                args: flags
                    .into_iter()
                    .filter(|(k, _)| k == "dataplane" || k == "attach")
                    .collect(),
            };
            out.insert(node, agent);
        }
        Ok(out)
    }

    /// The agent of `node` among `agents`.
    pub fn agent_of<'a>(&self, agents: &'a BTreeMap<String, AgentPod>, node: &str) -> Result<&'a AgentPod, NpmError> {
        agents.get(node).ok_or_else(|| NpmError::NoAgent {
            node: node.into(),
            namespace: self.agent_namespace.clone(),
            selector: self.agent_selector.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn container_flags_in_both_forms() {
        let args: Vec<String> = [
            "run",
            "--dataplane=ebpf",
            "--debug-addr",
            "127.0.0.1:9191",
            "--flag",
            "--x=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let f = flags(&args);
        assert_eq!(f.get("dataplane").map(String::as_str), Some("ebpf"));
        assert_eq!(f.get("debug-addr").map(String::as_str), Some("127.0.0.1:9191"));
        assert_eq!(f.get("x").map(String::as_str), Some("1"));
        assert!(!f.contains_key("flag"));
    }
}
