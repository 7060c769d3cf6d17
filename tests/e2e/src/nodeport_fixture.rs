//! Helpers of the NodePort suite (`tests/nodeport.rs`): a TCP listener in
//! a pod's netns that answers every connection with the source address it
//! accepted it from ([`PeerEcho`]), the client side that connects from any
//! netns and reads that answer back ([`source_seen`]), NodePort Services
//! with either `externalTrafficPolicy` ([`nodeport_service`]) and ingress
//! policies allowing a list of ipBlocks ([`ingress_from_ip_blocks`]).
//!
//! The echo makes "what the backend sees" an observation, not an
//! assumption: after kube-proxy's DNAT and (for `Cluster`) masquerade, the
//! address the backend's `accept` returns is the one its ingress policy is
//! decided on.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::{json, Value};

use crate::api::{Api, ApiError};
use crate::netns::{NetnsError, NetnsHandle};

/// Errors of the NodePort fixture.
#[derive(Debug, thiserror::Error)]
pub enum FixtureError {
    /// A netns could not be opened or entered.
    #[error("netns {netns}: {source}")]
    Netns {
        /// The netns name.
        netns: String,
        /// The cause.
        source: NetnsError,
    },
    /// The echo listener could not be bound.
    #[error("echo listener in {netns} on port {port}: {source}")]
    Listen {
        /// The netns name.
        netns: String,
        /// The port.
        port: u16,
        /// The I/O error.
        source: std::io::Error,
    },
    /// An API request failed.
    #[error("{what}: {source}")]
    Api {
        /// What was asked.
        what: String,
        /// The API error.
        source: ApiError,
    },
    /// The API server's answer lacked something.
    #[error("{what}: {detail}")]
    Answer {
        /// What was asked.
        what: String,
        /// What was missing.
        detail: String,
    },
}

/// A TCP listener on `0.0.0.0:<port>` inside a netns that writes the
/// accepted connection's source address (text, then a newline) and closes
/// it. Stopped on drop.
#[derive(Debug)]
pub struct PeerEcho {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PeerEcho {
    /// Starts the listener in `netns` on TCP `port` (IPv4).
    pub fn start(netns: &str, port: u16) -> Result<PeerEcho, FixtureError> {
        let handle = NetnsHandle::open(netns).map_err(|source| FixtureError::Netns {
            netns: netns.to_string(),
            source,
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let (tx, rx) = mpsc::channel::<Result<(), FixtureError>>();
        let name = netns.to_string();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            if let Err(source) = handle.enter() {
                let _ = tx.send(Err(FixtureError::Netns { netns: name, source }));
                return;
            }
            let bound = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).and_then(|l| {
                l.set_nonblocking(true)?;
                Ok(l)
            });
            let listener = match bound {
                Ok(l) => l,
                Err(source) => {
                    let _ = tx.send(Err(FixtureError::Listen {
                        netns: name,
                        port,
                        source,
                    }));
                    return;
                }
            };
            let _ = tx.send(Ok(()));
            while !flag.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((mut conn, peer)) => {
                        let _ = conn.set_nonblocking(false);
                        let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
                        let _ = writeln!(conn, "{}", peer.ip());
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(5)),
                }
            }
        });
        match rx.recv() {
            Ok(Ok(())) => Ok(PeerEcho {
                stop,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => {
                let _ = thread.join();
                Err(FixtureError::Answer {
                    what: format!("echo listener in {netns}"),
                    detail: "the listener thread ended before binding".into(),
                })
            }
        }
    }
}

impl Drop for PeerEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Connects from `src_netns` to `dst` (TCP) and returns the source
/// address the [`PeerEcho`] behind it reported; `None` when the
/// connection was not established within `timeout` (denied) or answered
/// nothing parseable. Runs on a thread of its own, so the caller's netns
/// is left alone.
pub fn source_seen(src_netns: &str, dst: SocketAddr, timeout: Duration) -> Option<IpAddr> {
    let handle = NetnsHandle::open(src_netns).ok()?;
    std::thread::scope(|s| {
        s.spawn(|| {
            handle.enter().ok()?;
            let mut conn = TcpStream::connect_timeout(&dst, timeout).ok()?;
            conn.set_read_timeout(Some(timeout)).ok()?;
            let mut text = String::new();
            conn.read_to_string(&mut text).ok()?;
            text.trim().parse::<IpAddr>().ok()
        })
        .join()
        .ok()
        .flatten()
    })
}

/// A NodePort Service `ns/name` selecting the pods labelled
/// `selector_key: selector_value`, one TCP port `port` -> `port`, the
/// NodePort allocated by the API server, with `externalTrafficPolicy`
/// `Local` (`local`) or `Cluster`.
pub fn nodeport_service(
    ns: &str,
    name: &str,
    selector_key: &str,
    selector_value: &str,
    port: u16,
    local: bool,
) -> Value {
    json!({
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"namespace": ns, "name": name},
        "spec": {
            "type": "NodePort",
            "selector": {selector_key: selector_value},
            "externalTrafficPolicy": if local { "Local" } else { "Cluster" },
            "ports": [{"name": "echo", "port": port, "targetPort": port, "protocol": "TCP"}],
        },
    })
}

/// Creates `svc` (a [`nodeport_service`]) and returns its NodePort.
pub fn create_nodeport(api: &Api, svc: &Value) -> Result<u16, FixtureError> {
    let ns = svc["metadata"]["namespace"].as_str().unwrap_or("default");
    let name = svc["metadata"]["name"].as_str().unwrap_or_default();
    let what = format!("create service {ns}/{name}");
    let created = api
        .create(&format!("/api/v1/namespaces/{ns}/services"), svc)
        .map_err(|source| FixtureError::Api {
            what: what.clone(),
            source,
        })?;
    created["spec"]["ports"][0]["nodePort"]
        .as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .ok_or_else(|| FixtureError::Answer {
            what,
            detail: format!("no nodePort allocated: {created}"),
        })
}

/// An ingress policy `ns/name` on the pods labelled `pod: <pod>`: TCP
/// `port` from the given ipBlocks only (none: ingress-isolated, nothing
/// allowed).
pub fn ingress_from_ip_blocks(ns: &str, name: &str, pod: &str, cidrs: &[&str], port: u16) -> Value {
    let from: Vec<Value> = cidrs.iter().map(|c| json!({"ipBlock": {"cidr": c}})).collect();
    let ingress = if from.is_empty() {
        json!([])
    } else {
        json!([{"from": from, "ports": [{"protocol": "TCP", "port": port}]}])
    };
    json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": ns, "name": name},
        "spec": {
            "podSelector": {"matchLabels": {"pod": pod}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    })
}
