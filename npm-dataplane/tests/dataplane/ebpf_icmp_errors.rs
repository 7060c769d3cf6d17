//! ICMP errors of tracked flows: an ICMP error (IPv4 types 3, 11,
//! 12; ICMPv6 types 1 to 4) whose quoted header belongs to a tracked flow of
//! the endpoint passes as that flow does (`Related`); any other ICMP error
//! is decided by policy. Packet tables through `BPF_PROG_TEST_RUN`, and real
//! traffic: path-MTU discovery of an ingress-isolated pod through a router
//! (the root netns) whose next hop has MTU 1400.
//! Needs root.

use crate::ebpf_common::*;
use npm_common::{Reason, IDENTITY_ANY};
use npm_dataplane::ebpf::{EbpfDataplane, VERDICT_ALLOW, VERDICT_DROP};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction, Direction::Egress as EG, Direction::Ingress as IN};
use npm_policy::model::Protocol::{Tcp, Udp};

const POD_B: u32 = 300;
const POD_PING: u32 = 301;

/// Endpoint 1 ("a", isolated both ways): the peer B (10.0.0.2, fd00::2)
/// may reach UDP 53; "a" may open TCP 443 anywhere and ping 10.0.0.3. No
/// rule allows ICMP errors. Endpoint 2 ("c", isolated both ways) allows
/// nothing.
fn compiled() -> Compiled {
    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("a", 256, Some("10.0.0.1"), Some("fd00::1"), true, true));
    c.endpoints
        .insert(2, endpoint("c", 257, Some("10.0.0.9"), Some("fd00::9"), true, true));
    ip(&mut c, "10.0.0.1", 256, 0);
    ip(&mut c, "fd00::1", 256, 0);
    ip(&mut c, "10.0.0.9", 257, 0);
    ip(&mut c, "fd00::9", 257, 0);
    ip(&mut c, "10.0.0.2", POD_B, 0);
    ip(&mut c, "fd00::2", POD_B, 0);
    ip(&mut c, "10.0.0.3", POD_PING, 0);
    allow(&mut c, 1, IN, POD_B, Some(Udp), (53, 53), 1);
    allow(&mut c, 1, EG, IDENTITY_ANY, Some(Tcp), (443, 443), 2);
    allow(&mut c, 1, EG, POD_PING, None, (0, 65535), 3);
    c
}

struct Fixture {
    dp: EbpfDataplane,
    a: Dummy,
    c: Dummy,
    _pins: PinDir,
}

fn fixture(tag: &str) -> Fixture {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let a = Dummy::new(&format!("{tag}a"));
    let c = Dummy::new(&format!("{tag}c"));
    let mut dp = pins.open();
    dp.sync_full(&compiled(), &ifaces(&[(1, a.ifindex), (2, c.ifindex)]))
        .unwrap();
    Fixture { dp, a, c, _pins: pins }
}

type Expect = (i32, Option<Reason>);
type Row<'a> = (&'a str, Direction, u32, Vec<u8>, Expect);

fn allow_r(r: Reason) -> Expect {
    (VERDICT_ALLOW, Some(r))
}

fn deny_r(r: Reason) -> Expect {
    (VERDICT_DROP, Some(r))
}

/// Runs the rows in order (each may create conntrack state the next rely
/// on); reports every failing row.
fn check(f: &Fixture, rows: &[Row<'_>]) {
    let mut failures = Vec::new();
    for (name, dir, ifindex, pkt, want) in rows {
        let got =
            f.dp.test_run(*dir, *ifindex, pkt)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        if got != *want {
            failures.push(format!("{name}: got {got:?}, want {want:?}"));
        }
    }
    assert!(failures.is_empty(), "failing rows:\n{}", failures.join("\n"));
}

/// An ICMP error from `src` to `dst` (type, code; the 4 bytes after the
/// checksum carry a next-hop MTU of 1400) quoting the IP header and the
/// first 8 L4 bytes of the Ethernet frame `quoted`.
fn icmp4_error(src: &str, dst: &str, t: u8, code: u8, quoted: &[u8]) -> Vec<u8> {
    let mut b = vec![t, code, 0, 0, 0, 0, 0x05, 0x78];
    let ihl = ((quoted[14] & 0x0f) as usize) * 4;
    b.extend(&quoted[14..14 + ihl + 8]);
    v4(src, dst, L4::Raw(1, b))
}

/// An ICMPv6 error (type, code 0; Packet Too Big's MTU 1400) quoting the
/// IPv6 header and the first 8 L4 bytes of `quoted`.
fn icmp6_error(src: &str, dst: &str, t: u8, quoted: &[u8]) -> Vec<u8> {
    let mut b = vec![t, 0, 0, 0, 0, 0, 0x05, 0x78];
    b.extend(&quoted[14..14 + 40 + 8]);
    v6(src, dst, L4::Raw(58, b))
}

#[test]
fn icmp_errors_of_tracked_flows_pass_as_related() {
    let f = fixture("ie");
    let (a, c) = (f.a.ifindex, f.c.ifindex);
    let router = "192.168.50.1";
    let router6 = "2001:db8::1";
    // "a" opens TCP 443 to B (egress rule), B answers.
    let syn = v4("10.0.0.1", "10.0.0.2", L4::Tcp(40000, 443, 0x02));
    let data = v4("10.0.0.1", "10.0.0.2", L4::Tcp(40000, 443, 0x18));
    // B queries "a" on UDP 53 (ingress rule), "a" answers.
    let query = v4("10.0.0.2", "10.0.0.1", L4::Udp(5353, 53));
    let answer = v4("10.0.0.1", "10.0.0.2", L4::Udp(53, 5353));
    // "a" pings 10.0.0.3 (ping -M do of a too-large size).
    let echo = v4("10.0.0.1", "10.0.0.3", L4::Icmp(8, 77));
    let unknown = v4("10.0.0.1", "10.0.0.2", L4::Tcp(40001, 443, 0x18));
    let mut later_frag = data.clone();
    later_frag[20..22].copy_from_slice(&100u16.to_be_bytes());
    let syn6 = v6("fd00::1", "fd00::2", L4::Tcp(40000, 443, 0x02));
    let data6 = v6("fd00::1", "fd00::2", L4::Tcp(40000, 443, 0x18));
    let query6 = v6("fd00::2", "fd00::1", L4::Udp(5353, 53));
    let answer6 = v6("fd00::1", "fd00::2", L4::Udp(53, 5353));
    let unknown6 = v6("fd00::1", "fd00::2", L4::Tcp(40001, 443, 0x18));
    let rows: Vec<Row<'_>> = vec![
        ("tcp syn out", EG, a, syn.clone(), allow_r(Reason::Policy)),
        (
            "tcp syn-ack in",
            IN,
            a,
            v4("10.0.0.2", "10.0.0.1", L4::Tcp(443, 40000, 0x12)),
            allow_r(Reason::Tracked),
        ),
        ("tcp data out", EG, a, data.clone(), allow_r(Reason::Tracked)),
        ("udp query in", IN, a, query.clone(), allow_r(Reason::Policy)),
        ("udp answer out", EG, a, answer.clone(), allow_r(Reason::Tracked)),
        ("echo out", EG, a, echo.clone(), allow_r(Reason::Policy)),
        (
            "frag needed of the tcp flow",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &data),
            allow_r(Reason::Related),
        ),
        (
            "frag needed quoting the syn",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &syn),
            allow_r(Reason::Related),
        ),
        (
            "time exceeded of the tcp flow",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 11, 0, &data),
            allow_r(Reason::Related),
        ),
        (
            "parameter problem of the tcp flow",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 12, 0, &data),
            allow_r(Reason::Related),
        ),
        (
            "frag needed of the udp flow",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &answer),
            allow_r(Reason::Related),
        ),
        (
            "port unreachable from the peer of the udp flow",
            IN,
            a,
            icmp4_error("10.0.0.2", "10.0.0.1", 3, 3, &answer),
            allow_r(Reason::Related),
        ),
        (
            "port unreachable sent by the pod (egress)",
            EG,
            a,
            icmp4_error("10.0.0.1", "10.0.0.2", 3, 3, &query),
            allow_r(Reason::Related),
        ),
        (
            "frag needed of the ping",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &echo),
            allow_r(Reason::Related),
        ),
        (
            "frag needed of an unknown flow",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &unknown),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "error about the peer's packet sent to the pod",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &query),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "redirect (not an error) quoting the flow",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 5, 1, &data),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "error quoting a non-first fragment",
            IN,
            a,
            icmp4_error(router, "10.0.0.1", 3, 4, &later_frag),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "frag needed of a's flow at another endpoint",
            IN,
            c,
            icmp4_error(router, "10.0.0.1", 3, 4, &data),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "frag needed of a's flow addressed to another endpoint",
            IN,
            c,
            icmp4_error(router, "10.0.0.9", 3, 4, &data),
            deny_r(Reason::PolicyDenied),
        ),
        // IPv6.
        ("tcp6 syn out", EG, a, syn6.clone(), allow_r(Reason::Policy)),
        (
            "tcp6 syn-ack in",
            IN,
            a,
            v6("fd00::2", "fd00::1", L4::Tcp(443, 40000, 0x12)),
            allow_r(Reason::Tracked),
        ),
        ("udp6 query in", IN, a, query6.clone(), allow_r(Reason::Policy)),
        ("udp6 answer out", EG, a, answer6.clone(), allow_r(Reason::Tracked)),
        (
            "packet too big of the tcp6 flow",
            IN,
            a,
            icmp6_error(router6, "fd00::1", 2, &data6),
            allow_r(Reason::Related),
        ),
        (
            "time exceeded of the tcp6 flow",
            IN,
            a,
            icmp6_error(router6, "fd00::1", 3, &data6),
            allow_r(Reason::Related),
        ),
        (
            "packet too big of the udp6 flow",
            IN,
            a,
            icmp6_error(router6, "fd00::1", 2, &answer6),
            allow_r(Reason::Related),
        ),
        (
            "packet too big of an unknown flow",
            IN,
            a,
            icmp6_error(router6, "fd00::1", 2, &unknown6),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "echo request quoting the flow (not an error)",
            IN,
            a,
            icmp6_error(router6, "fd00::1", 128, &data6),
            deny_r(Reason::PolicyDenied),
        ),
        (
            "packet too big of a's flow at another endpoint",
            IN,
            c,
            icmp6_error(router6, "fd00::1", 2, &data6),
            deny_r(Reason::PolicyDenied),
        ),
    ];
    check(&f, &rows);
    // Related errors leave the flows' entries as they were: no entry for
    // the errors themselves.
    let ct = f.dp.ct_entries();
    assert!(ct.iter().all(|(k, _)| k.protocol != 1 || k.port_lo == 77), "{ct:?}");
}

// ---------------------------------------------------------------- real traffic

/// The pod (ingress-isolated; the far host may reach its TCP 8080) behind
/// the root netns, which routes to a far namespace over a link whose
/// root-side MTU is 1400 (the far side keeps 1500, so it advertises an MSS
/// of 1460).
struct PmtuNet {
    pod: PodNet,
    far: Netns,
    far_if: String,
    far_ip: String,
    dp: EbpfDataplane,
    _pins: PinDir,
    /// The root namespace routes between the pod and the far host.
    _forwarding: Forwarding,
}

impl Drop for PmtuNet {
    fn drop(&mut self) {
        sh_quiet(&["ip", "link", "del", &self.far_if]);
    }
}

fn pmtu_net(tag: &str) -> PmtuNet {
    sweep_leftovers();
    let pins = PinDir::new(tag);
    let pod = PodNet::new(tag);
    let far = test_netns(&format!("{tag}f"));
    let pid = std::process::id();
    let far_if = format!("npt{pid}{tag}f");
    // Four networks per process (tests run in parallel), 4096 processes.
    static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed) % 4;
    let slot = ((pid % 4096) * 4 + n) * 4;
    let base = u32::from(std::net::Ipv4Addr::new(198, 19, 0, 0)) + slot;
    let router_ip = std::net::Ipv4Addr::from(base + 1).to_string();
    let far_ip = std::net::Ipv4Addr::from(base + 2).to_string();
    sh_quiet(&["ip", "link", "del", &far_if]);
    sh(&[
        "ip", "link", "add", &far_if, "type", "veth", "peer", "name", "eth0", "netns", &far.name,
    ]);
    sh(&["ip", "link", "set", &far_if, "mtu", "1400"]);
    sh(&["ip", "addr", "add", &format!("{router_ip}/30"), "dev", &far_if]);
    sh(&["ip", "link", "set", &far_if, "up"]);
    ns_sh(
        &far.name,
        &["ip", "addr", "add", &format!("{far_ip}/30"), "dev", "eth0"],
    );
    ns_sh(&far.name, &["ip", "link", "set", "eth0", "up"]);
    let pod_ip = pod.pod_ip.to_string();
    let peer_ip = pod.peer_ip.to_string();
    ns_sh(&far.name, &["ip", "route", "add", &pod_ip, "via", &router_ip]);
    ns_sh(&pod.ns.name, &["ip", "route", "add", &far_ip, "via", &peer_ip]);

    let mut c = Compiled::default();
    c.endpoints
        .insert(1, endpoint("pod", 256, Some(&pod_ip), None, true, false));
    ip(&mut c, &pod_ip, 256, 0);
    ip(&mut c, &far_ip, 300, 0);
    allow(&mut c, 1, IN, 300, Some(Tcp), (8080, 8080), 1);
    let mut dp = pins.open();
    dp.sync_full(&c, &ifaces(&[(1, pod.ifindex)])).unwrap();
    PmtuNet {
        pod,
        far,
        far_if,
        far_ip,
        dp,
        _pins: pins,
        _forwarding: Forwarding::on(),
    }
}

/// Counted `Related` packets in the pod's ingress direction.
fn related_in(dp: &EbpfDataplane) -> u64 {
    let c = dp.counters().unwrap();
    c.packets(npm_common::DIR_INGRESS, Reason::Related)
}

/// `ping -M do -s 1472` (no ping binary here): echo requests of 1500
/// bytes with DF from a raw socket (`IP_PMTUDISC_DO`), id 0x4e50; prints
/// the `sendto` error of each (EMSGSIZE once the path MTU is known).
const PING_DF: &str = "import socket,struct,time,sys\n\
s=socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)\n\
s.setsockopt(socket.IPPROTO_IP, 10, 2)\n\
def ck(b):\n  t=sum(struct.unpack('!%dH' % (len(b)//2), b)); t=(t>>16)+(t&0xffff); t+=t>>16; return (~t)&0xffff\n\
for seq in range(3):\n  \
  body=struct.pack('!BBHHH',8,0,0,0x4e50,seq)+b'p'*1472\n  \
  pkt=body[:2]+struct.pack('!H',ck(body))+body[4:]\n  \
  try:\n    s.sendto(pkt,(sys.argv[1],0)); print('sent')\n  \
  except OSError as e: print(e)\n  \
  time.sleep(0.3)\n";

#[test]
fn ping_with_df_gets_its_fragmentation_needed_back() {
    let net = pmtu_net("pm");
    let pod = &net.pod.ns;
    let out = pod.exec(&["python3", "-c", PING_DF, &net.far_ip]);
    let text = String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    let route = ns_sh(&pod.name, &["ip", "route", "get", &net.far_ip]);
    assert!(
        route.contains("mtu 1400"),
        "the pod did not learn the path MTU: route {route:?}, ping: {text}"
    );
    assert!(
        text.contains("Message too long"),
        "later pings must fail locally: {text}"
    );
    assert!(related_in(&net.dp) >= 1, "no related ICMP error counted; ping: {text}");
}

#[test]
fn tcp_bulk_reply_with_df_completes() {
    let net = pmtu_net("pt");
    let pod_ip = net.pod.pod_ip.to_string();
    // The pod serves 256 KiB per request: full-size segments with DF, which
    // the router can only answer with Fragmentation Needed.
    let server = format!(
        "import socket\n\
         s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind(('{pod_ip}',8080)); s.listen(8)\n\
         while True:\n  c,_=s.accept(); c.recv(100); c.sendall(b'x'*262144); c.close()\n"
    );
    let _srv = Proc(
        std::process::Command::new("ip")
            .args(["netns", "exec", &net.pod.ns.name, "python3", "-c", &server])
            .spawn()
            .expect("spawn server"),
    );
    let client = format!(
        "import socket,sys,time\n\
         for i in range(50):\n  \
           try:\n    c=socket.create_connection(('{pod_ip}',8080), timeout=1); break\n  \
           except OSError: time.sleep(0.1)\n\
         c.settimeout(8); c.sendall(b'get\\n'); n=0\n\
         try:\n  \
           while True:\n    d=c.recv(65536)\n    \
             if not d: break\n    n+=len(d)\n\
         except socket.timeout: pass\n\
         print(n)\n"
    );
    let started = std::time::Instant::now();
    let out = ns_sh(&net.far.name, &["python3", "-c", &client]);
    let got: usize = out.trim().parse().unwrap_or(0);
    assert_eq!(
        got,
        262_144,
        "bulk reply incomplete after {:?} (path MTU not discovered)",
        started.elapsed()
    );
    assert!(related_in(&net.dp) >= 1, "no related ICMP error counted");
}
