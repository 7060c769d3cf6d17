//! The bounded HTTP listeners of the agent: at most
//! [`Bounds::max_connections`] connections at once, at most
//! [`Bounds::max_per_peer`] from one source address (a busy pod cannot
//! take the kubelet's probes' room), a connection beyond either bound is
//! closed as soon as it is accepted (refused, nothing read); one request
//! per connection (no keep-alive: an idle client holds no slot), the
//! request head within [`Bounds::header_timeout`] (a slow client is
//! closed), and, where set, the whole exchange within
//! [`Bounds::connection_timeout`] (the metrics listener; the debug
//! listener's `/observe` streams are long by design and bounded by their
//! own count, see [`super::observe`]).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;

/// The bounds of one listener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Connections served at once.
    pub max_connections: usize,
    /// Connections served at once from one source address.
    pub max_per_peer: usize,
    /// The request head must arrive within this.
    pub header_timeout: Duration,
    /// The whole connection must end within this (`None`: unbounded).
    pub connection_timeout: Option<Duration>,
}

impl Bounds {
    /// The metrics listener (`/metrics`, `/healthz`, `/readyz` on the node's
    /// address): 64 connections, 8 per source address, the head within
    /// 5 s, each connection done within 30 s.
    pub const METRICS: Bounds = Bounds {
        max_connections: 64,
        max_per_peer: 8,
        header_timeout: Duration::from_secs(5),
        connection_timeout: Some(Duration::from_secs(30)),
    };

    /// The loopback debug listener (`/explain`, `/observe`, `/metrics`): 32
    /// connections (all from loopback: no per-peer bound beyond that), the
    /// head within 5 s, no overall timeout (streams).
    pub const DEBUG: Bounds = Bounds {
        max_connections: 32,
        max_per_peer: 32,
        header_timeout: Duration::from_secs(5),
        connection_timeout: None,
    };
}

/// The connections being served, in total and by source address.
#[derive(Debug, Default)]
struct Open {
    total: usize,
    by_peer: HashMap<IpAddr, usize>,
}

/// A served connection's slot, given back when dropped.
struct Slot {
    open: Arc<Mutex<Open>>,
    peer: IpAddr,
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut o = self.open.lock().unwrap_or_else(|p| p.into_inner());
        o.total = o.total.saturating_sub(1);
        if let Some(n) = o.by_peer.get_mut(&self.peer) {
            *n -= 1;
            if *n == 0 {
                o.by_peer.remove(&self.peer);
            }
        }
    }
}

/// A slot for a connection from `peer`, if both bounds leave room.
fn admit(open: &Arc<Mutex<Open>>, peer: IpAddr, b: &Bounds) -> Option<Slot> {
    let mut o = open.lock().unwrap_or_else(|p| p.into_inner());
    let from_peer = o.by_peer.get(&peer).copied().unwrap_or(0);
    if o.total >= b.max_connections || from_peer >= b.max_per_peer {
        return None;
    }
    o.total += 1;
    *o.by_peer.entry(peer).or_default() += 1;
    Some(Slot {
        open: open.clone(),
        peer,
    })
}

/// Serves `router` on `listener` within `bounds` until the task is
/// aborted. Accept errors (e.g. out of file descriptors) are retried after
/// a pause; they never end the listener.
pub async fn serve(listener: tokio::net::TcpListener, router: Router, bounds: Bounds) -> std::io::Result<()> {
    let open = Arc::new(Mutex::new(Open::default()));
    loop {
        let (stream, peer): (tokio::net::TcpStream, SocketAddr) = match listener.accept().await {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(error = %e, "HTTP listener: accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let Some(slot) = admit(&open, peer.ip(), &bounds) else {
            tracing::debug!(%peer, "HTTP listener: connection refused (bound reached)");
            drop(stream);
            continue;
        };
        let service = TowerToHyperService::new(router.clone());
        tokio::spawn(async move {
            let _slot = slot;
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(bounds.header_timeout)
                .keep_alive(false)
                .serve_connection(TokioIo::new(stream), service);
            let done = match bounds.connection_timeout {
                Some(t) => tokio::time::timeout(t, conn).await.ok(),
                None => Some(conn.await),
            };
            if let Some(Err(e)) = done {
                tracing::debug!(%peer, error = %e, "HTTP connection ended with an error");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpSocket, TcpStream};

    /// A connection to `to` from the loopback address `from`.
    async fn connect(from: [u8; 4], to: SocketAddr) -> TcpStream {
        let s = TcpSocket::new_v4().unwrap();
        s.bind(SocketAddr::from((from, 0))).unwrap();
        s.connect(to).await.unwrap()
    }

    /// The status of `GET /healthz` on `s` (`None`: closed without an answer).
    async fn healthz(mut s: TcpStream) -> Option<u16> {
        s.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await.ok()?;
        let mut buf = Vec::new();
        let _ = s.read_to_end(&mut buf).await;
        String::from_utf8_lossy(&buf).split_whitespace().nth(1)?.parse().ok()
    }

    async fn start(bounds: Bounds) -> SocketAddr {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let router = Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        tokio::spawn(serve(l, router, bounds));
        addr
    }

    /// `max_connections` at once, `max_per_peer` from one source, the
    /// head within `header_timeout`, no connection timeout.
    fn bounds(max_connections: usize, max_per_peer: usize, header_timeout: Duration) -> Bounds {
        Bounds {
            max_connections,
            max_per_peer,
            header_timeout,
            connection_timeout: None,
        }
    }

    /// `/healthz` from 127.0.0.1 until it is served (the server frees a
    /// closed connection's slot when it sees the close), at most 100 tries.
    async fn served_again(addr: SocketAddr) -> Option<u16> {
        for _ in 0..100 {
            let served = healthz(connect([127, 0, 0, 1], addr).await).await;
            if served.is_some() {
                return served;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        None
    }

    /// More connections than the bounds: the excess is closed unanswered,
    /// other sources are still served, a freed slot serves again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn connections_beyond_the_bounds_are_refused() {
        let addr = start(bounds(6, 3, Duration::from_secs(120))).await;
        let mut held = Vec::new();
        for _ in 0..3 {
            held.push(connect([127, 0, 0, 1], addr).await);
        }
        // One request to 127.0.0.2 is served after the three were accepted
        // (accepted in order): the peer bound is reached.
        assert_eq!(healthz(connect([127, 0, 0, 2], addr).await).await, Some(200));
        assert_eq!(healthz(connect([127, 0, 0, 1], addr).await).await, None, "peer bound");
        for _ in 0..3 {
            held.push(connect([127, 0, 0, 3], addr).await);
        }
        assert_eq!(healthz(connect([127, 0, 0, 4], addr).await).await, None, "total bound");
        // Freed slots serve again (the server sees the close and frees them).
        held.clear();
        let served = served_again(addr).await;
        assert_eq!(served, Some(200));
    }

    /// A client that sends no request head is closed after the header
    /// timeout (its slot freed); one request per connection.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn idle_and_finished_connections_are_closed() {
        let addr = start(bounds(1, 1, Duration::from_millis(300))).await;
        let mut idle = connect([127, 0, 0, 1], addr).await;
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_secs(30), idle.read(&mut buf))
            .await
            .expect("the idle connection is closed by the server");
        assert!(matches!(n, Ok(0) | Err(_)), "{n:?}");
        drop(idle);
        let served = served_again(addr).await;
        assert_eq!(served, Some(200), "the slot was freed");
        // No keep-alive: after one answer the server closes (read_to_end in
        // healthz returned), so a second request needs a new connection.
    }

    #[test]
    fn admission_by_total_and_peer() {
        let b = Bounds {
            max_connections: 3,
            max_per_peer: 2,
            ..Bounds::METRICS
        };
        let open = Arc::new(Mutex::new(Open::default()));
        let (a, c) = (IpAddr::from([10, 0, 0, 1]), IpAddr::from([10, 0, 0, 2]));
        let a1 = admit(&open, a, &b).unwrap();
        let _a2 = admit(&open, a, &b).unwrap();
        assert!(admit(&open, a, &b).is_none(), "per-peer bound");
        let c1 = admit(&open, c, &b).unwrap();
        assert!(admit(&open, c, &b).is_none(), "total bound");
        drop(a1);
        assert!(admit(&open, a, &b).is_some(), "a freed slot makes room");
        drop(c1);
        assert_eq!(open.lock().unwrap().by_peer.get(&c), None);
    }
}
