//! `pods/portforward` over WebSocket, as `kubectl port-forward` and kube-rs
//! (`Api::<Pod>::portforward`) speak it (subprotocol `v4.channel.k8s.io`):
//! binary frames prefixed by a channel byte, channels `2i` (data) and
//! `2i+1` (errors) for the `i`th port of `?ports=`, each opened by the
//! server with the port number (2 bytes, little-endian). The server
//! connects to the pod's `status.podIP` (a test's pod at `127.0.0.1` is a
//! host-network pod of this machine) and copies bytes both ways.
//!
//! Unlike the other paths, this one authenticates: the caller's bearer
//! token must be registered ([`crate::auth::Auth::add_token`], else 401)
//! and its user granted `create` on `pods/portforward` in the pod's
//! namespace by the loaded RBAC objects (else 403), as the real API server
//! decides (a WebSocket `GET` needs `create`).

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use futures_util::{SinkExt, StreamExt};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_tungstenite::tungstenite::handshake::derive_accept_key;
use tokio_tungstenite::tungstenite::protocol::Role;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::WebSocketStream;

use super::response::{err_response, json_response};
use super::route::query_map;
use super::AppState;
use crate::auth::Attributes;
use crate::error::ApiError;
use crate::store::Kind;

/// The subprotocol served.
pub const PROTOCOL: &str = "v4.channel.k8s.io";

fn status(code: u16, reason: &str, message: String) -> Response {
    json_response(
        code,
        &serde_json::json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                            "message": message, "reason": reason, "code": code}),
    )
}

fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(header::AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")
        .map(str::trim)
}

/// `GET /api/v1/namespaces/{ns}/pods/{name}/portforward?ports=P[,P...]`.
pub async fn portforward(
    State(st): State<Arc<AppState>>,
    Path((ns, name)): Path<(String, String)>,
    req: Request,
) -> Response {
    let q = query_map(req.uri());
    let headers = req.headers();
    let user = match bearer(headers).and_then(|t| st.auth().user(t)) {
        Some(u) => u,
        None => return status(401, "Unauthorized", "Unauthorized".into()),
    };
    let attrs = Attributes {
        verb: "create".into(),
        resource: "pods".into(),
        subresource: "portforward".into(),
        namespace: ns.clone(),
        name: name.clone(),
        ..Default::default()
    };
    let mut groups: Vec<&str> = user.groups.iter().map(String::as_str).collect();
    groups.push("system:authenticated");
    if !st.auth().allowed(&user.username, &groups, &attrs) {
        return status(
            403,
            "Forbidden",
            format!(
                "pods \"{name}\" is forbidden: User \"{}\" cannot create resource \"pods/portforward\" in API group \"\" in the namespace \"{ns}\"",
                user.username
            ),
        );
    }
    let pod = match st.store().get(Kind::Pod, Some(&ns), &name) {
        Ok(p) => p,
        Err(e) => return err_response(&e),
    };
    let Some(ip) = pod["status"]["podIP"].as_str().and_then(|s| s.parse::<IpAddr>().ok()) else {
        return err_response(&ApiError::BadRequest {
            message: format!("pod {ns}/{name} has no IP to forward to"),
        });
    };
    let ports: Option<Vec<u16>> = q
        .get("ports")
        .map(|p| p.split(',').map(|x| x.trim().parse().ok()).collect())
        .unwrap_or(None);
    let ports = match ports {
        Some(p) if !p.is_empty() && p.len() <= 64 => p,
        _ => {
            return err_response(&ApiError::BadRequest {
                message: "ports: a comma-separated list of 1 to 64 port numbers is required".into(),
            })
        }
    };
    let offered = headers
        .get(header::SEC_WEBSOCKET_PROTOCOL)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let (Some(key), true) = (
        headers.get(header::SEC_WEBSOCKET_KEY),
        offered.split(',').any(|p| p.trim() == PROTOCOL),
    ) else {
        return err_response(&ApiError::BadRequest {
            message: format!("a WebSocket upgrade with subprotocol {PROTOCOL} is required"),
        });
    };
    let accept = derive_accept_key(key.as_bytes());
    let upgrade = hyper::upgrade::on(req);
    tokio::spawn(async move {
        let Ok(io) = upgrade.await else { return };
        let ws = WebSocketStream::from_raw_socket(TokioIo::new(io), Role::Server, None).await;
        forward(ws, ip, ports).await;
    });
    Response::builder()
        .status(StatusCode::SWITCHING_PROTOCOLS)
        .header(header::CONNECTION, "Upgrade")
        .header(header::UPGRADE, "websocket")
        .header(header::SEC_WEBSOCKET_ACCEPT, accept)
        .header(header::SEC_WEBSOCKET_PROTOCOL, PROTOCOL)
        .body(Body::empty())
        .unwrap_or_else(|_| status(500, "InternalError", "upgrade response".into()))
}

/// What the pod side sends toward the WebSocket.
enum Out {
    Frame(Vec<u8>),
    Closed,
}

/// Copies between the WebSocket and one TCP connection per port.
async fn forward<S>(ws: WebSocketStream<S>, ip: IpAddr, ports: Vec<u16>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + Send + 'static,
{
    let (mut sink, mut stream) = ws.split();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Out>(16);
    let mut writers = Vec::new();
    for (i, &port) in ports.iter().enumerate() {
        let (data, err) = (2 * i as u8, 2 * i as u8 + 1);
        for ch in [data, err] {
            let [lo, hi] = port.to_le_bytes();
            if sink.send(Message::binary(vec![ch, lo, hi])).await.is_err() {
                return;
            }
        }
        match tokio::net::TcpStream::connect(SocketAddr::new(ip, port)).await {
            Ok(conn) => {
                let (mut r, w) = conn.into_split();
                writers.push(Some(w));
                let tx = tx.clone();
                tokio::spawn(async move {
                    let mut buf = vec![0u8; 16 * 1024];
                    loop {
                        match r.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(n) => {
                                let mut f = Vec::with_capacity(n + 1);
                                f.push(data);
                                f.extend_from_slice(&buf[..n]);
                                if tx.send(Out::Frame(f)).await.is_err() {
                                    return;
                                }
                            }
                        }
                    }
                    let _ = tx.send(Out::Closed).await;
                });
            }
            Err(e) => {
                writers.push(None);
                let mut f = vec![err];
                f.extend_from_slice(format!("error forwarding port {port} to pod: {e}").as_bytes());
                let _ = tx.send(Out::Frame(f)).await;
                let _ = tx.send(Out::Closed).await;
            }
        }
    }
    drop(tx);
    let mut open = ports.len();
    loop {
        tokio::select! {
            out = rx.recv() => match out {
                Some(Out::Frame(f)) => {
                    if sink.send(Message::binary(f)).await.is_err() {
                        return;
                    }
                }
                Some(Out::Closed) => {
                    open -= 1;
                    if open == 0 {
                        let _ = sink.send(Message::Close(None)).await;
                        return;
                    }
                }
                None => return,
            },
            msg = stream.next() => match msg {
                Some(Ok(Message::Binary(b))) if b.len() > 1 => {
                    let i = (b[0] / 2) as usize;
                    if b[0] % 2 == 0 {
                        if let Some(Some(w)) = writers.get_mut(i) {
                            if w.write_all(&b[1..]).await.is_err() {
                                writers[i] = None;
                            }
                        }
                    }
                }
                Some(Ok(Message::Close(_))) | None | Some(Err(_)) => return,
                Some(Ok(_)) => {}
            },
        }
    }
}
