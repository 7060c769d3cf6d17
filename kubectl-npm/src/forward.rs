//! One connection to an agent's loopback debug listener through the API
//! server (`pods/portforward` of the agent pod, a WebSocket, as `kubectl
//! port-forward` opens it, with the user's own credentials), handed to the
//! blocking explain and observe clients of npm-agent as a `Read + Write`
//! stream.

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::io::DuplexStream;
use tokio_util::io::SyncIoBridge;

use crate::cluster::{AgentPod, Cluster};
use crate::error::{api_error, Access, NpmError};

/// The stream the clients read and write.
pub type Stream = SyncIoBridge<DuplexStream>;

/// Opens a port-forward to `agent`'s debug port and runs `f` over it on a
/// blocking thread, with a label naming the agent (`node N (pod NS/NAME)`).
/// A refused port-forward is [`NpmError::Forbidden`] naming `create` on
/// `pods/portforward` in the agent's namespace.
pub async fn with_agent<T, F>(cluster: &Cluster, agent: &AgentPod, f: F) -> Result<T, NpmError>
where
    F: FnOnce(Stream, String) -> T + Send + 'static,
    T: Send + 'static,
{
    let api = Api::<Pod>::namespaced(cluster.client.clone(), &agent.namespace);
    let port = agent.debug_port;
    let mut pf = api.portforward(&agent.name, &[port]).await.map_err(|e| {
        api_error(
            e,
            Access::new("create", "pods/portforward", Some(&agent.namespace)),
            &format!("port-forward to the agent pod {} port {port}", agent.id()),
        )
    })?;
    let stream = pf.take_stream(port).ok_or_else(|| NpmError::Agent {
        node: agent.node.clone(),
        pod: agent.id(),
        ready: String::new(),
        message: format!("the port-forward has no stream for port {port}"),
    })?;
    let bridge = SyncIoBridge::new(stream);
    let label = format!("node {} (pod {}, port {port})", agent.node, agent.id());
    let out = tokio::task::spawn_blocking(move || f(bridge, label)).await;
    pf.abort();
    out.map_err(|e| NpmError::Agent {
        node: agent.node.clone(),
        pod: agent.id(),
        ready: String::new(),
        message: format!("the request failed: {e}"),
    })
}

/// The [`NpmError::Agent`] of `agent` for `message`, with its readiness.
pub fn agent_error(agent: &AgentPod, message: String) -> NpmError {
    // An empty status line or a broken stream: nothing listened on the
    // port (the forward connected to no listener) or the connection broke
    // before an answer.
    let silent = [
        "answered : ",
        "broken pipe",
        "Broken pipe",
        "reset by peer",
        "end of file",
    ];
    let message = if silent.iter().any(|s| message.contains(s)) || message.ends_with("answered ") {
        format!(
            "no answer on its debug port {} (is the agent running, and is its --debug-addr another port? see --debug-port): {message}",
            agent.debug_port
        )
    } else {
        message
    };
    NpmError::Agent {
        node: agent.node.clone(),
        pod: agent.id(),
        ready: agent
            .not_ready
            .as_ref()
            .map(|r| format!(", not ready: {r}"))
            .unwrap_or_default(),
        message,
    }
}
