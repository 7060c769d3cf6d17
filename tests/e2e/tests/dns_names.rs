//! ClusterNetworkPolicy `domainNames` on a live agent (both dataplanes),
//! single node, x/y/z pods. `z/c` runs a DNS server (this test's
//! responder) that the agent trusts (`--dns-server`); namespace `x` may
//! send DNS to it (Admin Accept), may reach `b.y.example.test` on TCP 80
//! (Admin Accept, `domainNames`), and nothing else (Admin Deny of
//! `0.0.0.0/0`). Checked with real packets:
//! - before `x/a` resolves the name, `x/a -> y/b:80` is denied;
//! - the first connection right after the answer (same thread, no pause)
//!   connects: the agent held the response until the address was
//!   programmed;
//! - a name no peer names (`c.y.example.test`) teaches nothing;
//! - a forged answer (from `y/c`, not the trusted server, port 53) teaches
//!   nothing;
//! - the learned name is in the state file; with the agent killed (its rule
//!   left, no reader) DNS is still answered; the next agent keeps allowing
//!   a learned address (TTL 300 s);
//! - `npm_dns_responses_total{result="learned"}` counts the response;
//! - after the answer's TTL (2 s, grace 0) the address is denied again;
//! - stopping the agent removes its NFQUEUE rules.
//!
//! Needs root, `iptables`/`ip6tables` (NFQUEUE target) and the agent binary
//! (`cargo build --bin npm-agent`, or `NPM_AGENT_BIN`); the eBPF variant
//! also the BPF object (`NPM_EBPF_OBJECT`, as `cargo xtask test` sets it).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_e2e::fixtures::{probe_config, scrape_metrics, start_with_setup, tcp_probe as probe, wait_enforced};
use npm_e2e::netns::NetnsHandle;
use npm_e2e::probe::probe_all;
use npm_e2e::runner::Engine;
use simple_dns::rdata::{RData, A};
use simple_dns::{Name, Packet, PacketFlag, Question, ResourceRecord, CLASS, QCLASS, QTYPE, TYPE};

/// The model's addresses (`198.18.<ns>.<pod>`).
const ZC: Ipv4Addr = Ipv4Addr::new(198, 18, 3, 3);
const YB: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
const YC: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 3);
const XB: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);

/// One Admin-tier ClusterNetworkPolicy of namespace `x` with one egress
/// rule (`rule`: its fields after `name`), as a case action.
fn cnp(name: &str, priority: u32, rule: &str) -> String {
    format!(
        r#"
      - create_cluster_network_policy:
          apiVersion: policy.networking.k8s.io/v1alpha2
          kind: ClusterNetworkPolicy
          metadata: {{name: {name}}}
          spec:
            tier: Admin
            priority: {priority}
            subject: {{namespaces: {{matchLabels: {{ns: x}}}}}}
            egress:
              - name: {name}
                {rule}"#
    )
}

/// The setup case: DNS to `z/c`, the names, deny the rest.
fn setup() -> String {
    let dns = "action: Accept
                to: [{pods: {namespaceSelector: {matchLabels: {ns: z}}, podSelector: {matchLabels: {pod: c}}}}]
                protocols: [{udp: {destinationPort: {number: 53}}}]";
    let names = r#"action: Accept
                to: [{domainNames: ["b.y.example.test", "*.other.example.test"]}]
                protocols: [{tcp: {destinationPort: {number: 80}}}]"#;
    let deny = r#"action: Deny
                to: [{networks: ["0.0.0.0/0"]}]"#;
    format!(
        "id: dns-names-setup\nsteps:\n  - actions:{}{}{}\n    probes: []\n",
        cnp("x-dns", 10, dns),
        cnp("x-names", 20, names),
        cnp("x-deny", 30, deny)
    )
}

/// What the responder answers: `b.y.example.test` and `c.y.example.test`
/// with their pods' addresses, TTL 2 s, and `xb.other.example.test`
/// (`x/b`), TTL 300 s.
fn answer_for(name: &str) -> Option<Ipv4Addr> {
    match name {
        "b.y.example.test" => Some(YB),
        "c.y.example.test" => Some(YC),
        "xb.other.example.test" => Some(XB),
        _ => None,
    }
}

/// A DNS response to `query` (A records only).
fn respond(query: &[u8]) -> Option<Vec<u8>> {
    let q = Packet::parse(query).ok()?;
    let mut reply = q.into_reply();
    let name = reply.questions.first()?.qname.to_string();
    if let Some(ip) = answer_for(&name) {
        let qname = reply.questions[0].qname.clone();
        // TTL 2 s, but 300 s for the name the restart keeps.
        let ttl = if name.starts_with("xb.") { 300 } else { 2 };
        reply
            .answers
            .push(ResourceRecord::new(qname, CLASS::IN, ttl, RData::A(A::from(ip))));
    }
    reply.build_bytes_vec().ok()
}

/// The responder on `z/c` UDP 53 until `stop`.
fn serve_dns(netns: String, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        NetnsHandle::open(&netns).unwrap().enter().unwrap();
        let s = UdpSocket::bind("0.0.0.0:53").expect("bind UDP 53 in z/c");
        s.set_read_timeout(Some(Duration::from_millis(100))).unwrap();
        let mut buf = [0u8; 1500];
        while !stop.load(Ordering::Relaxed) {
            if let Ok((n, from)) = s.recv_from(&mut buf) {
                if let Some(r) = respond(&buf[..n]) {
                    let _ = s.send_to(&r, from);
                }
            }
        }
    })
}

/// A query for `name` from `netns` to the responder; returns the A
/// addresses of the answer, then tries one TCP connection (500 ms) to
/// `then` at once, on the same thread: (addresses, connected).
fn resolve_then_connect(netns: &str, name: &str, then: SocketAddr) -> (Vec<Ipv4Addr>, bool) {
    let (netns, name) = (netns.to_string(), name.to_string());
    std::thread::spawn(move || {
        NetnsHandle::open(&netns).unwrap().enter().unwrap();
        let s = UdpSocket::bind("0.0.0.0:0").unwrap();
        s.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
        let mut q = Packet::new_query(0x4e50);
        q.set_flags(PacketFlag::RECURSION_DESIRED);
        q.questions.push(Question::new(
            Name::new_unchecked(&name),
            QTYPE::TYPE(TYPE::A),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        s.send_to(&q.build_bytes_vec().unwrap(), (ZC, 53))
            .expect("send the query");
        let mut buf = [0u8; 1500];
        let n = s.recv(&mut buf).expect("an answer from the trusted server");
        let r = Packet::parse(&buf[..n]).unwrap();
        let addrs = r
            .answers
            .iter()
            .filter_map(|a| match &a.rdata {
                RData::A(a) => Some(Ipv4Addr::from(a.address)),
                _ => None,
            })
            .collect();
        let connected = TcpStream::connect_timeout(&then, Duration::from_millis(500)).is_ok();
        (addrs, connected)
    })
    .join()
    .unwrap()
}

/// A forged answer for `b.y.example.test` -> `y/c` sent from `y/c` (port
/// 53) to `x/a`'s port 53000: not a reply to a query to the trusted server.
fn forge(from_netns: &str, to: Ipv4Addr) {
    let from_netns = from_netns.to_string();
    std::thread::spawn(move || {
        NetnsHandle::open(&from_netns).unwrap().enter().unwrap();
        let s = UdpSocket::bind("0.0.0.0:53").unwrap();
        let mut p = Packet::new_reply(0x4e51);
        let name = Name::new_unchecked("b.y.example.test");
        p.questions.push(Question::new(
            name.clone(),
            QTYPE::TYPE(TYPE::A),
            QCLASS::CLASS(CLASS::IN),
            false,
        ));
        p.answers
            .push(ResourceRecord::new(name, CLASS::IN, 300, RData::A(A::from(YC))));
        s.send_to(&p.build_bytes_vec().unwrap(), (to, 53000)).unwrap();
    })
    .join()
    .unwrap();
}

/// Whether one probe connects.
fn allowed(p: &npm_e2e::probe::Probe, cfg: &npm_e2e::probe::ProbeConfig) -> bool {
    probe_all(std::slice::from_ref(p), cfg)[0]
}

/// Whether `chain` is in `mangle` of the root netns.
fn chain_present(chain: &str) -> bool {
    std::process::Command::new("iptables")
        .args(["-w", "5", "-t", "mangle", "-S"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).contains(chain))
        .unwrap_or(false)
}

fn run(engine: Engine, queue: u16) {
    let t0 = Instant::now();
    let chain = format!("NPM-DNS-{queue}");
    let dir = std::env::temp_dir().join(format!("npm-dns-{}-{queue}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let state = dir.join("names.json");
    let queue_s = queue.to_string();
    let server = ZC.to_string();
    let args = [
        "--dns-server",
        server.as_str(),
        "--dns-queue",
        queue_s.as_str(),
        "--dns-grace-secs",
        "0",
        "--dns-min-ttl-secs",
        "0",
        "--dns-hold-ms",
        "3000",
        "--dns-state-file",
        state.to_str().unwrap(),
    ];
    let mut r = start_with_setup(engine, &args, &setup());
    assert_eq!(r.cluster().pod("z", "c").unwrap().ipv4, ZC, "the model's addresses");
    assert_eq!(r.cluster().pod("y", "b").unwrap().ipv4, YB);
    assert!(
        chain_present(&chain),
        "{engine:?}: the NFQUEUE chain {chain} is installed"
    );
    let stop = Arc::new(AtomicBool::new(false));
    let dns = serve_dns(r.cluster().pod("z", "c").unwrap().netns.clone(), stop.clone());
    let cfg = probe_config(&r, 2);
    let xa = r.cluster().pod("x", "a").unwrap().netns.clone();
    let to_yb = probe(&r, "x/a", "y/b", 80);
    let to_yc = probe(&r, "x/a", "y/c", 80);
    // Enforced: nothing learned, the Deny decides.
    wait_enforced(&format!("{engine:?}"), &cfg, &[], &[to_yb.clone(), to_yc.clone()]);
    // The name no peer names: answered, not learned.
    let (a, connected) = resolve_then_connect(&xa, "c.y.example.test", SocketAddr::new(IpAddr::V4(YC), 80));
    assert_eq!(a, [YC]);
    assert!(!connected, "{engine:?}: c.y.example.test is named by no peer");
    // The name of the peer: the first connection right after the answer
    // goes through (the response was held until the address was allowed).
    let (a, connected) = resolve_then_connect(&xa, "b.y.example.test", SocketAddr::new(IpAddr::V4(YB), 80));
    assert_eq!(a, [YB]);
    assert!(connected, "{engine:?}: x/a -> y/b:80 refused right after the answer");
    // The state file holds what was learned (before its TTL ends; saved
    // off the replies' path within 500 ms).
    let until = Instant::now() + Duration::from_secs(5);
    let saved = loop {
        let saved = std::fs::read_to_string(&state).unwrap_or_default();
        if saved.contains("b.y.example.test") || Instant::now() > until {
            break saved;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        saved.contains("b.y.example.test") && !saved.contains("c.y.example.test"),
        "{saved}"
    );
    assert!(!allowed(&to_yc, &cfg), "{engine:?}: y/c must stay denied");
    // A forged answer from elsewhere teaches nothing.
    forge(
        &r.cluster().pod("y", "c").unwrap().netns,
        r.cluster().pod("x", "a").unwrap().ipv4,
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(!allowed(&to_yc, &cfg), "{engine:?}: a forged answer opened y/c");
    // Metrics: the learning response counted (reported every 5 s).
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let m = scrape_metrics(&r);
        if m.contains("npm_dns_responses_total{result=\"learned\"} ")
            && !m.contains("npm_dns_responses_total{result=\"learned\"} 0")
        {
            break;
        }
        assert!(
            Instant::now() < until,
            "{engine:?}: npm_dns_responses_total{{result=learned}} never moved:\n{m}"
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    // A restarted agent keeps what was learned (its state file): a name
    // with a long TTL stays allowed through the restart and after.
    let to_xb = probe(&r, "x/a", "x/b", 80);
    assert!(!allowed(&to_xb, &cfg), "{engine:?}: x/b before its name is resolved");
    let (a, connected) = resolve_then_connect(&xa, "xb.other.example.test", SocketAddr::new(IpAddr::V4(XB), 80));
    assert_eq!(a, [XB]);
    assert!(connected, "{engine:?}: x/a -> x/b:80 refused right after the answer");
    // Killed (a crash): its rule stays with no reader, and DNS still flows
    // (`--queue-bypass`): the pods only stop teaching addresses.
    r.kill_agent();
    assert!(chain_present(&chain), "{engine:?}: the killed agent's chain stays");
    let (a, _) = resolve_then_connect(&xa, "c.y.example.test", SocketAddr::new(IpAddr::V4(YC), 80));
    assert_eq!(a, [YC], "{engine:?}: DNS answered while no agent reads the queue");
    r.start_agent_again().expect("start the agent again");
    assert!(chain_present(&chain), "{engine:?}: the restarted agent's chain");
    assert!(
        allowed(&to_xb, &cfg),
        "{engine:?}: the restarted agent forgot xb.other.example.test"
    );
    // TTL 2 s, grace 0: denied again soon after.
    let until = Instant::now() + Duration::from_secs(10);
    while allowed(&to_yb, &cfg) {
        assert!(
            Instant::now() < until,
            "{engine:?}: the expired address is still allowed"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    stop.store(true, Ordering::Relaxed);
    dns.join().unwrap();
    r.shutdown().expect("shutdown");
    assert!(!chain_present(&chain), "{engine:?}: {chain} left behind");
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!("{engine:?}: {:?}", t0.elapsed());
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// The queue of this run (unique per process and dataplane).
fn queue(offset: u16) -> u16 {
    30000 + (std::process::id() % 10000) as u16 * 2 + offset
}

#[test]
fn dns_names_ebpf() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Ebpf, queue(0));
}

#[test]
fn dns_names_nftables() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    run(Engine::Nftables, queue(1));
}

/// The rules a killed agent leaves (its chain, the jump to it) are removed
/// by `npm-agent cleanup`, whatever their queue.
#[test]
fn cleanup_removes_the_rules_a_killed_agent_left() {
    // Not beside a live run (cleanup removes every NPM-DNS chain).
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let q = queue(1000).to_string();
    let chain = format!("NPM-DNS-{q}");
    let ipt = |args: &[&str]| {
        let ok = std::process::Command::new("iptables")
            .args(["-w", "5", "-t", "mangle"])
            .args(args)
            .status()
            .unwrap()
            .success();
        assert!(ok, "iptables {args:?}");
    };
    ipt(&["-N", &chain]);
    ipt(&[
        "-A",
        &chain,
        "-p",
        "udp",
        "-j",
        "NFQUEUE",
        "--queue-num",
        &q,
        "--queue-bypass",
    ]);
    ipt(&["-I", "POSTROUTING", "-j", &chain]);
    assert!(chain_present(&chain));
    let dir = std::env::temp_dir().join(format!("npm-dns-cleanup-{}", std::process::id()));
    std::fs::create_dir_all(dir.join("conf")).unwrap();
    std::fs::create_dir_all(dir.join("bin")).unwrap();
    let pins = format!("/sys/fs/bpf/npm-dns-cleanup-{}", std::process::id());
    std::fs::create_dir_all(&pins).unwrap();
    let out = std::process::Command::new(npm_e2e::fixtures::agent_bin())
        .arg("cleanup")
        .arg(format!("--pin-dir={pins}"))
        .arg(format!("--cni-conf-dir={}", dir.join("conf").display()))
        .arg(format!("--cni-bin-dir={}", dir.join("bin").display()))
        .arg(format!("--nft-table=npmdnsclean{}", std::process::id()))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "cleanup failed: {err}");
    assert!(!chain_present(&chain), "{chain} left after cleanup: {err}");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir(&pins);
}
