//! One-shot HTTP/1.1 GETs (`Connection: close`) against the agent's
//! listeners, and the wait for a `/readyz` answer.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// (status code, body) of a whole response; code 0 when there is no
/// status line.
fn parse(text: &str) -> (u16, String) {
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_string())
        .unwrap_or_default();
    (code, body)
}

/// `GET path` on `addr`: (status code, body). Panics when the connection
/// fails.
pub async fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    get_with(addr, path, "").await
}

/// [`get`] with the extra header lines `headers` (each ending in CRLF).
pub async fn get_with(addr: SocketAddr, path: &str, headers: &str) -> (u16, String) {
    let mut s = tokio::net::TcpStream::connect(addr).await.expect("connect");
    s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\n{headers}Connection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await.unwrap();
    parse(&String::from_utf8_lossy(&buf))
}

/// A blocking `GET path` on `addr`: (status code, body); `None` when the
/// server does not answer (connect within 300 ms, read within 2 s).
pub fn http_get(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_millis(300)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(s, "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_whitespace().nth(1)?.parse::<u16>().ok()?;
    Some(parse(&text))
}

/// Polls `/readyz?verbose` until it answers `code` with a body containing
/// `want` (returned); panics with the last answer after `timeout`.
pub async fn wait_readyz(addr: SocketAddr, code: u16, want: &str, timeout: Duration) -> String {
    let mut last = (0, String::new());
    let start = Instant::now();
    while start.elapsed() < timeout {
        last = get(addr, "/readyz?verbose").await;
        if last.0 == code && last.1.contains(want) {
            return last.1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for /readyz?verbose {code} with {want:?}; last: {last:?}");
}
