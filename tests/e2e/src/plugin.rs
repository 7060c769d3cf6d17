//! What `kubectl npm` needs of a live cluster, as the chart provides it
//! in a real one: an agent pod per node in `kube-system` (the chart's
//! labels, host network, `--debug-addr` in its arguments) and a user
//! granted `create` on `pods/portforward` there. The test API server's
//! port-forward connects to a host-network pod's address on this machine,
//! so a node agent's loopback listener (in its node netns) is reached
//! through a relay that enters the node's netns per connection, as a
//! kubelet's port-forward enters the pod's.

use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};

use serde_json::json;

use crate::netns::NetnsHandle;
use crate::runner::{Engine, LiveRunner};

/// The token of the user [`register`] grants (`npm-admin`, group
/// `npm-admins`).
pub const ADMIN_TOKEN: &str = "npm-admin-token";

/// A listener on this machine's loopback whose connections are relayed
/// to `target` inside the netns `netns`; returns its port. The relay
/// lives as long as the process.
pub fn relay(netns: &str, target: SocketAddr) -> std::io::Result<u16> {
    let l = TcpListener::bind("127.0.0.1:0")?;
    let port = l.local_addr()?.port();
    let netns = netns.to_string();
    std::thread::spawn(move || {
        for client in l.incoming() {
            let Ok(client) = client else { break };
            let netns = netns.clone();
            std::thread::spawn(move || {
                // This thread only: the connection is made in the node.
                if NetnsHandle::open(&netns).and_then(|h| h.enter()).is_err() {
                    return;
                }
                let Ok(agent) = TcpStream::connect(target) else {
                    return;
                };
                let (Ok(mut to_agent), Ok(mut from_client)) = (agent.try_clone(), client.try_clone()) else {
                    return;
                };
                let up = std::thread::spawn(move || {
                    let _ = std::io::copy(&mut from_client, &mut to_agent);
                    let _ = to_agent.shutdown(Shutdown::Write);
                });
                let (mut agent, mut client) = (agent, client);
                let _ = std::io::copy(&mut agent, &mut client);
                let _ = client.shutdown(Shutdown::Write);
                let _ = up.join();
            });
        }
    });
    Ok(port)
}

/// Registers the agent pod of each node of `r` (its debug listener
/// reached directly on the one-node cluster, through a [`relay`] into the
/// node on several), the Role and RoleBinding granting `create` on
/// `pods/portforward` in `kube-system` to group `npm-admins`, and the
/// token [`ADMIN_TOKEN`] of its user `npm-admin`; writes that user's
/// kubeconfig to `path`.
pub fn register(r: &LiveRunner, path: &Path) -> Result<PathBuf, String> {
    let srv = r.api_server().ok_or("no in-process API server")?;
    // Already there when registered twice: the error is ignored.
    let _ = srv.create_object(
        npm_testapi::Kind::Namespace,
        None,
        json!({"metadata": {"name": "kube-system"}}),
    );
    let dataplane = match r.engine() {
        Engine::Nftables => "nftables",
        _ => "ebpf",
    };
    let debug = r.debug_addrs();
    let agents: Vec<(String, u16)> = match r.cluster().nodes() {
        Some(nodes) => {
            if nodes.nodes().len() != debug.len() {
                return Err(format!("{} nodes, {} agents", nodes.nodes().len(), debug.len()));
            }
            let mut out = Vec::new();
            for (node, addr) in nodes.nodes().iter().zip(&debug) {
                let port = relay(&node.netns, *addr).map_err(|e| format!("a relay into {}: {e}", node.netns))?;
                out.push((node.name.clone(), port));
            }
            out
        }
        None => {
            let addr = debug.first().ok_or("no agent")?;
            vec![(npm_sim::cases::MODEL_NODE.to_string(), addr.port())]
        }
    };
    for (node, port) in agents {
        srv.create_object(
            npm_testapi::Kind::Pod,
            Some("kube-system"),
            json!({"metadata": {"name": format!("npm-agent-{node}"), "namespace": "kube-system",
                                "labels": {"app.kubernetes.io/name": "npm-agent", "app.kubernetes.io/instance": "npm"}},
                   "spec": {"nodeName": node, "hostNetwork": true,
                            "containers": [{"name": "agent", "image": "localhost/npm-agent:latest",
                                            "args": ["run", format!("--dataplane={dataplane}"),
                                                     format!("--debug-addr=127.0.0.1:{port}")]}]},
                   "status": {"podIP": "127.0.0.1", "phase": "Running",
                              "conditions": [{"type": "Ready", "status": "True"}]}}),
        )
        .map_err(|e| format!("the agent pod of {node}: {e:?}"))?;
    }
    srv.add_rbac(&[
        json!({"kind": "Role", "metadata": {"name": "npm-admin", "namespace": "kube-system"},
               "rules": [{"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]}]}),
        json!({"kind": "RoleBinding", "metadata": {"name": "npm-admin", "namespace": "kube-system"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "npm-admin"},
               "subjects": [{"kind": "Group", "name": "npm-admins"}]}),
    ]);
    srv.add_token(
        ADMIN_TOKEN,
        npm_testapi::auth::UserInfo {
            username: "npm-admin".into(),
            groups: vec!["npm-admins".into()],
            ..Default::default()
        },
    );
    let text = format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: npm-testapi\n  cluster:\n    server: {}\ncontexts:\n- name: npm-testapi\n  context:\n    cluster: npm-testapi\n    user: npm-admin\n    namespace: default\ncurrent-context: npm-testapi\nusers:\n- name: npm-admin\n  user:\n    token: {ADMIN_TOKEN}\n",
        srv.url()
    );
    std::fs::write(path, text).map_err(|e| format!("{}: {e}", path.display()))?;
    Ok(path.to_path_buf())
}
