//! The traffic of the benchmark: TCP bulk throughput (iperf3, one stream),
//! the 1-byte request/response rate on one connection and the rate of new
//! connections (connect, 1-byte request and reply, close), the servers of
//! the latter two (threads inside the server pod's namespace) and the
//! check that the dataplane is in the path (a port no entry allows).
//!
//! Placement ([`pin`], on by default, `--no-pin` off): on a machine with
//! two CPUs or more, every client (iperf3 `-c`, the request/response and
//! connection loops) runs on CPU 0 and every server (iperf3 `-s` through
//! the client's `-A 0,1`, the server threads) on CPU 1, for every row
//! alike. Left to the scheduler, the two ends sometimes shared a CPU and
//! sometimes not, which moved one row's samples by more than the targets'
//! margins.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::topo::{enter_netns, in_netns, CONN_PORT, DENIED_PORT, IPERF_PORT, RR_PORT, SERVER_IP};

const IO_TIMEOUT: Duration = Duration::from_secs(3);

/// The CPU of the clients, when pinned.
const CLIENT_CPU: usize = 0;
/// The CPU of the servers, when pinned.
const SERVER_CPU: usize = 1;

/// Whether clients and servers are pinned ([`pin`]).
static PINNED: AtomicBool = AtomicBool::new(false);

/// Pin the clients to CPU 0 and the servers to CPU 1 from now on, when
/// `on` and the machine has two CPUs or more; returns whether they are.
/// Call before [`start_servers`].
pub fn pin(on: bool) -> bool {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pinned = on && cpus >= 2;
    PINNED.store(pinned, Ordering::Relaxed);
    pinned
}

/// Moves the calling thread to `cpu` when pinning is on (threads it
/// spawns inherit the placement).
fn place(cpu: usize) {
    if !PINNED.load(Ordering::Relaxed) {
        return;
    }
    // SAFETY: a zeroed cpu_set_t is a valid empty set; CPU_SET writes one
    // bit of it; sched_setaffinity(0, ...) changes only this thread.
    let rc = unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set)
    };
    assert!(
        rc == 0,
        "sched_setaffinity cpu {cpu}: {}",
        std::io::Error::last_os_error()
    );
}

fn server_addr(port: u16) -> SocketAddr {
    SocketAddr::from((SERVER_IP.parse::<Ipv4Addr>().expect("server address"), port))
}

/// Starts the request/response, new-connection and denied-port servers in
/// namespace `ns` (threads that live as long as the process) and returns
/// once they listen.
pub fn start_servers(ns: &str) {
    let (tx, rx) = mpsc::channel();
    for (port, serve) in [
        (RR_PORT, serve_rr as fn(TcpStream)),
        (CONN_PORT, serve_conn as fn(TcpStream)),
        (DENIED_PORT, std::mem::drop::<TcpStream> as fn(TcpStream)),
    ] {
        let (ns, tx) = (ns.to_string(), tx.clone());
        std::thread::spawn(move || {
            enter_netns(&ns);
            place(SERVER_CPU);
            let listener = TcpListener::bind(("0.0.0.0", port)).unwrap_or_else(|e| panic!("bind {port} in {ns}: {e}"));
            tx.send(()).expect("ready");
            for conn in listener.incoming().flatten() {
                let _ = conn.set_nodelay(true);
                let _ = conn.set_read_timeout(Some(IO_TIMEOUT));
                if port == RR_PORT {
                    std::thread::spawn(move || serve(conn));
                } else {
                    serve(conn);
                }
            }
        });
    }
    for _ in 0..3 {
        rx.recv_timeout(Duration::from_secs(10)).expect("servers listening");
    }
}

/// Echoes 1-byte requests until the peer closes.
fn serve_rr(mut conn: TcpStream) {
    let mut b = [0u8; 1];
    while conn.read_exact(&mut b).is_ok() {
        if conn.write_all(&b).is_err() {
            break;
        }
    }
}

/// Answers one 1-byte request, then waits for the client's close (the
/// client closes first, so its side holds the TIME_WAIT).
fn serve_conn(mut conn: TcpStream) {
    let mut b = [0u8; 1];
    if conn.read_exact(&mut b).is_ok() && conn.write_all(&b).is_ok() {
        let _ = conn.read(&mut b);
    }
}

/// Whether a connection from namespace `client` to the server's port
/// `port` is established within 700 ms (a dropped SYN times out).
pub fn connects(client: &str, port: u16) -> bool {
    in_netns(client, || {
        TcpStream::connect_timeout(&server_addr(port), Duration::from_millis(700)).is_ok()
    })
}

/// One request/response run from namespace `client`: 1-byte ping-pong on
/// one connection (Nagle off) for `d`; transactions per second.
pub fn rr(client: &str, d: Duration) -> f64 {
    in_netns(client, || {
        place(CLIENT_CPU);
        let mut s =
            TcpStream::connect_timeout(&server_addr(RR_PORT), IO_TIMEOUT).unwrap_or_else(|e| panic!("rr connect: {e}"));
        s.set_nodelay(true).expect("nodelay");
        s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
        let mut b = [1u8; 1];
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < d {
            s.write_all(&b).unwrap_or_else(|e| panic!("rr write: {e}"));
            s.read_exact(&mut b).unwrap_or_else(|e| panic!("rr read: {e}"));
            n += 1;
        }
        n as f64 / start.elapsed().as_secs_f64()
    })
}

/// One new-connection run from namespace `client` for `d`: connect, a
/// 1-byte request and its reply, close; connections per second.
pub fn conn(client: &str, d: Duration) -> f64 {
    in_netns(client, || {
        place(CLIENT_CPU);
        let addr = server_addr(CONN_PORT);
        let mut b = [1u8; 1];
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < d {
            let mut s = TcpStream::connect_timeout(&addr, IO_TIMEOUT).unwrap_or_else(|e| panic!("connection {n}: {e}"));
            s.set_nodelay(true).expect("nodelay");
            s.set_read_timeout(Some(IO_TIMEOUT)).expect("timeout");
            s.write_all(&b).unwrap_or_else(|e| panic!("connection {n} write: {e}"));
            s.read_exact(&mut b)
                .unwrap_or_else(|e| panic!("connection {n} read: {e}"));
            n += 1;
        }
        n as f64 / start.elapsed().as_secs_f64()
    })
}

/// One iperf3 run (one TCP stream, `secs` seconds) from namespace
/// `client` (placed by `-A` when pinned); the receiver's throughput in
/// Gbit/s.
pub fn iperf(client: &str, secs: u32) -> f64 {
    let mut cmd = Command::new("ip");
    cmd.args(["netns", "exec", client, "iperf3", "-J", "-c", SERVER_IP, "-p"])
        .arg(IPERF_PORT.to_string());
    if PINNED.load(Ordering::Relaxed) {
        // This client on CLIENT_CPU, the server on SERVER_CPU for this test.
        cmd.arg("-A").arg(format!("{CLIENT_CPU},{SERVER_CPU}"));
    }
    let out = cmd
        .arg("-t")
        .arg(secs.to_string())
        .output()
        .unwrap_or_else(|e| panic!("spawn iperf3 -c: {e}"));
    let text = String::from_utf8_lossy(&out.stdout);
    let json: serde_json::Value =
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("iperf3 output is not JSON ({e}): {text}"));
    if let Some(err) = json.get("error") {
        panic!("iperf3 failed in {client}: {err}");
    }
    let bps = json["end"]["sum_received"]["bits_per_second"]
        .as_f64()
        .unwrap_or_else(|| panic!("iperf3 output without end.sum_received.bits_per_second: {text}"));
    bps / 1e9
}
