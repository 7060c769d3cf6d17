//! One connection to an agent's loopback debug listener through the API
//! server (`pods/portforward` of the agent pod, a WebSocket, as `kubectl
//! port-forward` opens it, with the user's own credentials), handed to the
//! blocking explain and observe clients of npm-agent as a `Read + Write`
//! stream. A stream on which nothing arrives for the cluster's idle
//! timeout (`--idle-timeout`) fails its read with `TimedOut` ([`Idle`]): a
//! hung or unreachable agent ends that request instead of hanging it.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Api;
use tokio::io::{AsyncRead, AsyncWrite, DuplexStream, ReadBuf};
use tokio::time::{Instant, Sleep};
use tokio_util::io::SyncIoBridge;

use crate::cluster::{AgentPod, Cluster};
use crate::error::{api_error, Access, NpmError};

/// The stream the clients read and write.
pub type Stream = SyncIoBridge<Idle<DuplexStream>>;

/// A stream whose reads fail with [`std::io::ErrorKind::TimedOut`] once
/// nothing has arrived for `timeout` (since it was made or since its last
/// read that returned data or its end). Writes pass through.
pub struct Idle<S> {
    inner: S,
    timeout: Duration,
    deadline: Pin<Box<Sleep>>,
}

impl<S> Idle<S> {
    /// `inner` with the idle timeout `timeout` (in a tokio runtime).
    pub fn new(inner: S, timeout: Duration) -> Self {
        Idle {
            inner,
            timeout,
            deadline: Box::pin(tokio::time::sleep(timeout)),
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Idle<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                this.deadline.as_mut().reset(Instant::now() + this.timeout);
                Poll::Ready(r)
            }
            Poll::Pending => match this.deadline.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "nothing from the agent for {} s (--idle-timeout): hung or unreachable",
                        this.timeout.as_secs_f64()
                    ),
                ))),
                Poll::Pending => Poll::Pending,
            },
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Idle<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Opens a port-forward to `agent`'s debug port and runs `f` over it on a
/// blocking thread, with a label naming the agent (`node N (pod NS/NAME)`);
/// a read after [`Cluster::idle_timeout`] without data fails ([`Idle`]).
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
    let bridge = SyncIoBridge::new(Idle::new(stream, cluster.idle_timeout));
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
    // A silent agent ([`Idle`]) says so itself.
    let hung = message.contains("(--idle-timeout)");
    let message = if !hung && (silent.iter().any(|s| message.contains(s)) || message.ends_with("answered ")) {
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
