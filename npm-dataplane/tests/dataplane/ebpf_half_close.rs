//! TCP half-close: a flow keeps the established timeout until
//! both sides sent a FIN (or a RST was seen); only then the short closing
//! timeout. Conntrack state transitions through `BPF_PROG_TEST_RUN` (the
//! entry's age set through the pinned map), and real traffic: a client that
//! shut down its sending side still gets the reply its server sends 20 s
//! later. Needs root.

use std::io::{Read, Write};
use std::net::Shutdown;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::ebpf_common::*;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use npm_common::{
    ct_timeout_ns, maps, proto, CtKey4, CtValue, Reason, CT_CLOSING, CT_FIN_HI, CT_FIN_LO, CT_RST, CT_SEEN_REPLY,
    CT_TIMEOUT_TCP_CLOSING_NS, CT_TIMEOUT_TCP_NS,
};
use npm_dataplane::ebpf::{BenchSwitches, EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction::Egress as EG, Direction::Ingress as IN};
use npm_policy::model::Protocol::Tcp;

const POD_B: u32 = 300;

/// Endpoint 1 ("a", 10.0.0.1, isolated both ways): B (10.0.0.2) may reach
/// its TCP 80; nothing may leave it but replies.
fn compiled() -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), None, true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "10.0.0.2", POD_B, 0);
    allow(&mut c, 1, IN, POD_B, Some(Tcp), (80, 80), 1);
    c
}

struct Fixture {
    dp: EbpfDataplane,
    ep: Dummy,
    pins: PinDir,
}

/// `general`: every packet on the general path (no IPv4 fast path, no
/// flow cache), so both paths are covered.
fn fixture(tag: &str, general: bool) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let ep = Dummy::new(tag);
    let switches = BenchSwitches {
        no_fast_v4: general,
        no_flow_cache: general,
        ..BenchSwitches::default()
    };
    let mut dp = EbpfDataplane::open_with(pins.options(), switches).unwrap_or_else(|e| panic!("open: {e}"));
    dp.sync_full(&compiled(), &ifaces(&[(1, ep.ifindex)])).unwrap();
    Fixture { dp, ep, pins }
}

fn ct4(pin_dir: &Path) -> BpfHashMap<MapData, CtKey4, CtValue> {
    let data = MapData::from_pin(pin_dir.join(maps::CT4)).expect("open pinned NPM_CT4");
    BpfHashMap::try_from(Map::from_map_data(data).expect("map")).expect("typed NPM_CT4")
}

/// The one conntrack entry.
fn entry(f: &Fixture) -> (CtKey4, CtValue) {
    let ct = ct4(&f.pins.path);
    let all: Vec<(CtKey4, CtValue)> = ct.iter().map(|e| e.expect("entry")).collect();
    assert_eq!(all.len(), 1, "{all:?}");
    all[0]
}

/// Makes the entry's last packet `secs` seconds older (the idle time the
/// next packet sees).
fn age(f: &Fixture, secs: u64) {
    let (k, mut v) = entry(f);
    v.last_seen_ns -= secs * 1_000_000_000;
    ct4(&f.pins.path).insert(k, v, 0).expect("age the entry");
}

fn run(f: &Fixture, dir: npm_policy::compiled::Direction, pkt: &[u8]) -> (i32, Option<Reason>) {
    f.dp.test_run(dir, f.ep.ifindex, pkt).unwrap()
}

const TRACKED: (i32, Option<Reason>) = (VERDICT_ALLOW, Some(Reason::Tracked));
const DENIED: (i32, Option<Reason>) = (VERDICT_DROP, Some(Reason::PolicyDenied));

/// B connects to a:80 from `port`; the handshake's last ACK returns.
fn establish(f: &Fixture, port: u16) {
    let syn = v4("10.0.0.2", "10.0.0.1", L4::Tcp(port, 80, 0x02));
    assert_eq!(run(f, IN, &syn), (VERDICT_ALLOW, Some(Reason::Policy)));
    assert_eq!(
        run(f, EG, &v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, port, 0x12))),
        TRACKED
    );
    assert_eq!(
        run(f, IN, &v4("10.0.0.2", "10.0.0.1", L4::Tcp(port, 80, 0x10))),
        TRACKED
    );
}

#[test]
fn half_close_keeps_the_established_timeout() {
    half_close_keeps_the_established_timeout_on(fixture("hc", false));
}

#[test]
fn half_close_keeps_the_established_timeout_general_path() {
    half_close_keeps_the_established_timeout_on(fixture("hcg", true));
}

fn half_close_keeps_the_established_timeout_on(f: Fixture) {
    establish(&f, 42000);
    // The client (B, the key's hi side: 10.0.0.2 > 10.0.0.1) sends its FIN.
    let fin_b = v4("10.0.0.2", "10.0.0.1", L4::Tcp(42000, 80, 0x11));
    assert_eq!(run(&f, IN, &fin_b), TRACKED);
    // Idle for 20 s, past the closing timeout: the server's data still
    // leaves as tracked (no egress rule would allow it).
    age(&f, 20);
    let data_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42000, 0x18));
    assert_eq!(run(&f, EG, &data_a), TRACKED, "half-closed flow lost after 20 s idle");
    let (_, v) = entry(&f);
    assert_eq!(v.flags & (CT_FIN_LO | CT_FIN_HI | CT_RST), CT_FIN_HI, "{v:?}");
    assert_ne!(v.flags & CT_SEEN_REPLY, 0);
    assert_eq!(ct_timeout_ns(proto::TCP, v.flags), CT_TIMEOUT_TCP_NS);
    assert_eq!(run(&f, EG, &data_a), TRACKED);
    // The server's FIN: both sides done, the short timeout starts.
    let fin_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42000, 0x11));
    assert_eq!(run(&f, EG, &fin_a), TRACKED);
    let (_, v) = entry(&f);
    assert_eq!(
        v.flags & (CT_FIN_LO | CT_FIN_HI | CT_RST),
        CT_FIN_LO | CT_FIN_HI,
        "{v:?}"
    );
    assert_eq!(ct_timeout_ns(proto::TCP, v.flags), CT_TIMEOUT_TCP_CLOSING_NS);
    // The last ACK within the closing timeout passes; 11 s later the flow
    // is gone.
    let ack_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42000, 0x10));
    assert_eq!(run(&f, EG, &ack_a), TRACKED);
    age(&f, 11);
    assert_eq!(run(&f, EG, &ack_a), DENIED);
}

#[test]
fn a_rst_still_closes_at_once() {
    for general in [false, true] {
        let f = fixture(if general { "hrg" } else { "hr" }, general);
        establish(&f, 42001);
        // A FIN from the server, then a RST from the client.
        let fin_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42001, 0x11));
        assert_eq!(run(&f, EG, &fin_a), TRACKED);
        let (_, v) = entry(&f);
        assert_eq!(v.flags & (CT_FIN_LO | CT_FIN_HI | CT_RST), CT_FIN_LO);
        let rst_b = v4("10.0.0.2", "10.0.0.1", L4::Tcp(42001, 80, 0x04));
        assert_eq!(run(&f, IN, &rst_b), TRACKED);
        let (_, v) = entry(&f);
        assert_ne!(v.flags & CT_RST, 0);
        assert_ne!(v.flags & CT_CLOSING, 0);
        assert_eq!(ct_timeout_ns(proto::TCP, v.flags), CT_TIMEOUT_TCP_CLOSING_NS);
        age(&f, 11);
        let data_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42001, 0x18));
        assert_eq!(run(&f, EG, &data_a), DENIED, "general={general}");

        // A RST alone on an established flow.
        establish(&f, 42002);
        let rst_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42002, 0x14));
        assert_eq!(run(&f, EG, &rst_a), TRACKED);
        let ct = ct4(&f.pins.path);
        let (k, mut v) = ct
            .iter()
            .map(|e| e.unwrap())
            .find(|(k, _)| k.port_hi == 42002)
            .expect("entry of 42002");
        assert_eq!(v.flags & (CT_FIN_LO | CT_FIN_HI | CT_RST), CT_RST);
        v.last_seen_ns -= 11_000_000_000;
        ct4(&f.pins.path).insert(k, v, 0).unwrap();
        let data_a = v4("10.0.0.1", "10.0.0.2", L4::Tcp(80, 42002, 0x18));
        assert_eq!(run(&f, EG, &data_a), DENIED, "general={general}");
    }
}

/// Real traffic: the pod (isolated both ways, the root netns peer may
/// reach its TCP 8080) reads the request until the client's FIN, waits
/// 20 s and sends its reply; the client, which shut down its sending side
/// at once, receives it.
#[test]
fn half_closed_connection_idle_for_20_s_gets_its_reply() {
    sweep_leftovers();
    let pins = PinDir::new("hcv");
    let net = PodNet::new("hv");
    let pod_ip = net.pod_ip.to_string();
    let server = format!(
        "import socket,time\n\
         s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('{pod_ip}',8080)); s.listen(8)\n\
         while True:\n  c,_=s.accept(); req=b''\n  \
           while True:\n    d=c.recv(100)\n    \
             if not d: break\n    req+=d\n  \
           time.sleep(20); c.sendall(b'reply to '+req); c.close()\n"
    );
    let _srv = Proc(
        std::process::Command::new("ip")
            .args(["netns", "exec", &net.ns.name, "python3", "-c", &server])
            .spawn()
            .expect("spawn server"),
    );
    let mut dp = pins.open();
    let policy = pod_policy(&net, &[(Tcp, 8080)]);
    dp.sync_full(&policy, &ifaces(&[(1, net.ifindex)])).unwrap();

    let addr = std::net::SocketAddr::from((net.pod_ip, 8080));
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut conn = loop {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(500)) {
            Ok(c) => break c,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(e) => panic!("connect: {e}"),
        }
    };
    conn.write_all(b"hello").unwrap();
    conn.shutdown(Shutdown::Write).unwrap();
    let started = Instant::now();
    conn.set_read_timeout(Some(Duration::from_secs(35))).unwrap();
    let mut reply = Vec::new();
    let res = conn.read_to_end(&mut reply);
    assert!(
        res.is_ok() && reply == b"reply to hello",
        "after {:?}: {res:?}, got {:?}",
        started.elapsed(),
        String::from_utf8_lossy(&reply)
    );
    assert!(started.elapsed() >= Duration::from_secs(19), "the reply came too early");
}
