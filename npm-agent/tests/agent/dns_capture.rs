//! The DNS capture (`npm_agent::dns::Capture`) on a private netns `npmdc<pid><tag>`
//! (loopback only): a responder on 127.0.0.53:53 is the trusted server,
//! clients query it from 127.0.0.1, and the capture's NFQUEUE rules and
//! queue live in the netns. Checked with real replies:
//! - the node's DNS is not serialised behind a hold: while a reply that
//!   taught a new address is held, the next replies get through, and each
//!   held reply is released by the programming of its own version;
//! - nothing is held before the first compile, nor while syncs fail, nor
//!   beyond `max_holds`; a stopping capture lets held replies through;
//! - rules removed by a firewall reload are re-installed;
//! - NOTRACK rules for DNS (NodeLocal DNSCache) are reported.
//!
//! Needs root and `iptables` (NFQUEUE, conntrack).

use std::net::{Ipv4Addr, UdpSocket};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use npm_agent::dns::{Capture, CaptureConfig, NamesHandle};
use npm_policy::tiers::DomainPattern;
use simple_dns::rdata::{RData, A};
use simple_dns::{Name, Packet, Question, ResourceRecord, CLASS, QCLASS, QTYPE, TYPE};

use crate::common::netns::{clear_stale_netns, in_netns, sh};

const PREFIX: &str = "npmdc";
const SERVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 53);
const SERVER_S: &str = "127.0.0.53";
const QUEUE: u16 = 7;

/// Netns `npmdc<pid><tag>` with loopback up; deleted on drop.
struct Ns(String);

impl Ns {
    fn new(tag: &str) -> Ns {
        clear_stale_netns(PREFIX);
        let ns = Ns(format!("{PREFIX}{}{tag}", std::process::id()));
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &ns.0])
            .output();
        sh(&["ip", "netns", "add", &ns.0]);
        sh(&["ip", "-n", &ns.0, "link", "set", "lo", "up"]);
        ns
    }

    /// Runs `f` inside the netns (the capture, its threads and every
    /// socket of the test are there) and returns its result.
    fn run<T: Send + 'static>(&self, f: impl FnOnce() -> T + Send + 'static) -> T {
        in_netns(&self.0, f)
            .join()
            .unwrap_or_else(|e| std::panic::resume_unwind(e))
    }
}

impl Drop for Ns {
    fn drop(&mut self) {
        let _ = std::process::Command::new("ip")
            .args(["netns", "delete", &self.0])
            .output();
    }
}

/// The address the responder gives `n<k>.example.test` (and anything else):
/// 192.0.2.k.
fn address_of(name: &str) -> Ipv4Addr {
    let k = name
        .strip_prefix('n')
        .and_then(|r| r.split('.').next())
        .and_then(|k| k.parse().ok())
        .unwrap_or(200);
    Ipv4Addr::new(192, 0, 2, k)
}

/// The responder on 127.0.0.53:53 (this thread's netns), for the life of
/// the process' test (a detached thread; the netns' deletion ends it).
fn serve_dns() {
    let s = UdpSocket::bind((SERVER, 53)).expect("bind 127.0.0.53:53");
    std::thread::spawn(move || {
        let mut buf = [0u8; 1500];
        while let Ok((n, from)) = s.recv_from(&mut buf) {
            let Ok(q) = Packet::parse(&buf[..n]) else { continue };
            let mut reply = q.into_reply();
            let Some(question) = reply.questions.first() else {
                continue;
            };
            let (qname, name) = (question.qname.clone(), question.qname.to_string());
            reply.answers.push(ResourceRecord::new(
                qname,
                CLASS::IN,
                60,
                RData::A(A::from(address_of(&name))),
            ));
            if let Ok(bytes) = reply.build_bytes_vec() {
                let _ = s.send_to(&bytes, from);
            }
        }
    });
}

/// Sends a query for `name` from a new socket; the socket (for its reply).
fn query(name: &str) -> UdpSocket {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    let mut q = Packet::new_query(0x4e50);
    q.questions.push(Question::new(
        Name::new_unchecked(name),
        QTYPE::TYPE(TYPE::A),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    s.send_to(&q.build_bytes_vec().unwrap(), (SERVER, 53)).unwrap();
    s
}

/// The reply on `s` within `within` (`None`: none came).
fn reply(s: &UdpSocket, within: Duration) -> Option<Ipv4Addr> {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 1500];
    let n = s.recv(&mut buf).ok()?;
    let p = Packet::parse(&buf[..n]).ok()?;
    p.answers.iter().find_map(|a| match &a.rdata {
        RData::A(a) => Some(Ipv4Addr::from(a.address)),
        _ => None,
    })
}

/// Whether a reply is already waiting on `s` (never blocks).
fn replied(s: &UdpSocket) -> bool {
    s.set_nonblocking(true).unwrap();
    let mut buf = [0u8; 1500];
    let got = s.peek(&mut buf).is_ok();
    s.set_nonblocking(false).unwrap();
    got
}

/// Waits (at most 10 s) until `counter` reaches `n`.
fn wait_count(counter: &AtomicU64, n: u64, what: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while counter.load(Ordering::Relaxed) < n {
        assert!(
            Instant::now() < until,
            "{what}: {} < {n}",
            counter.load(Ordering::Relaxed)
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A handle whose sync loop compiled `*.example.test` and programmed.
fn compiled_handle() -> NamesHandle {
    let h = NamesHandle::default();
    h.set_patterns(vec![DomainPattern::parse("*.example.test").unwrap()]);
    h.sync_result(true);
    h
}

fn start(cfg: CaptureConfig, handle: &NamesHandle) -> Capture {
    Capture::start(cfg, handle.clone(), Arc::new(|| {})).expect("capture starts")
}

/// Long enough that an expired hold can never pass for a released one.
const HOLD: Duration = Duration::from_secs(30);
/// What a reply that is not held gets to arrive (far below `HOLD`).
const PROMPT: Duration = Duration::from_secs(10);

#[test]
fn replies_flow_while_one_is_held() {
    let ns = Ns::new("o");
    ns.run(|| {
        serve_dns();
        let handle = compiled_handle();
        let cap = start(
            CaptureConfig {
                hold: HOLD,
                ..CaptureConfig::new(vec![SERVER.into()], QUEUE)
            },
            &handle,
        );
        // n1 teaches a new address (version 1): held.
        let s1 = query("n1.example.test");
        wait_count(&cap.stats.held, 1, "n1 held");
        // A reply teaching nothing gets through meanwhile.
        let s2 = query("n2.other.test");
        assert_eq!(
            reply(&s2, PROMPT),
            Some(address_of("n2")),
            "a reply waited behind a held one"
        );
        // So does one teaching something (version 2), held in its turn.
        let s3 = query("n3.example.test");
        wait_count(&cap.stats.held, 2, "n3 held");
        assert!(!replied(&s1), "n1 released before its version was programmed");
        // Version 1 programmed: n1 released, n3 (version 2) still held.
        handle.publish_programmed(1);
        assert_eq!(reply(&s1, PROMPT), Some(address_of("n1")));
        assert!(!replied(&s3), "n3 released with version 1");
        handle.publish_programmed(2);
        assert_eq!(reply(&s3, PROMPT), Some(address_of("n3")));
        assert_eq!(cap.stats.released.load(Ordering::Relaxed), 2);
        assert_eq!(cap.stats.hold_expired.load(Ordering::Relaxed), 0);
        assert_eq!(cap.stats.learning.load(Ordering::Relaxed), 2);
        drop(cap);
    });
}

#[test]
fn no_hold_before_the_first_compile_while_syncs_fail_or_beyond_the_cap() {
    let ns = Ns::new("h");
    ns.run(|| {
        serve_dns();
        let handle = NamesHandle::default();
        let cap = start(
            CaptureConfig {
                hold: HOLD,
                max_holds: 1,
                ..CaptureConfig::new(vec![SERVER.into()], QUEUE)
            },
            &handle,
        );
        // Before the first compile (every name wanted): learned, not held.
        let s = query("n11.example.test");
        assert_eq!(
            reply(&s, PROMPT),
            Some(address_of("n11")),
            "held before the first compile"
        );
        assert_eq!(cap.stats.learning.load(Ordering::Relaxed), 1);
        assert_eq!(cap.stats.not_held_not_compiled.load(Ordering::Relaxed), 1);
        // Compiled, but the last sync failed: not held.
        handle.set_patterns(vec![DomainPattern::parse("*.example.test").unwrap()]);
        handle.sync_result(false);
        let s = query("n12.example.test");
        assert_eq!(reply(&s, PROMPT), Some(address_of("n12")), "held while syncs fail");
        assert_eq!(cap.stats.not_held_sync_unhealthy.load(Ordering::Relaxed), 1);
        // Healthy: one held; the cap (1) lets the next through at once.
        handle.sync_result(true);
        let held = query("n13.example.test");
        wait_count(&cap.stats.held, 1, "n13 held");
        let s = query("n14.example.test");
        assert_eq!(reply(&s, PROMPT), Some(address_of("n14")), "held beyond max_holds");
        assert_eq!(cap.stats.not_held_cap.load(Ordering::Relaxed), 1);
        assert_eq!(cap.stats.holding.load(Ordering::Relaxed), 1);
        assert!(!replied(&held));
        // A stopping capture lets what it holds through.
        drop(cap);
        assert_eq!(reply(&held, PROMPT), Some(address_of("n13")), "held reply lost on stop");
    });
}

/// Whether the jump to the capture's chain is in `mangle` `POSTROUTING`.
fn jump_present() -> bool {
    std::process::Command::new("iptables")
        .args(["-w", "5", "-t", "mangle", "-C", "POSTROUTING", "-j", "NPM-DNS-7"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// Replaces `mangle` with an empty table, as a firewall reload does
/// (`iptables-restore` without `--noflush`).
fn reload_mangle() {
    use std::io::Write;
    let mut child = std::process::Command::new("iptables-restore")
        .args(["-w", "5"])
        .stdin(std::process::Stdio::piped())
        .spawn()
        .expect("iptables-restore");
    child.stdin.take().unwrap().write_all(b"*mangle\nCOMMIT\n").unwrap();
    assert!(child.wait().unwrap().success(), "iptables-restore failed");
}

#[test]
fn rules_removed_by_a_reload_come_back() {
    let ns = Ns::new("r");
    ns.run(|| {
        serve_dns();
        let handle = NamesHandle::default();
        let cap = start(
            CaptureConfig {
                recheck: Duration::from_millis(200),
                ..CaptureConfig::new(vec![SERVER.into()], QUEUE)
            },
            &handle,
        );
        assert!(jump_present());
        // A firewall reload: `mangle` restored without our chain.
        reload_mangle();
        wait_count(&cap.stats.rules_reasserted, 1, "rules re-installed");
        let until = Instant::now() + PROMPT;
        while !jump_present() {
            assert!(Instant::now() < until, "the jump never came back");
            std::thread::sleep(Duration::from_millis(50));
        }
        // And the queue reads replies again.
        let s = query("n21.example.test");
        assert_eq!(reply(&s, PROMPT), Some(address_of("n21")));
        assert_eq!(
            cap.stats.learning.load(Ordering::Relaxed),
            1,
            "nothing learned after the reload"
        );
        drop(cap);
        assert!(!jump_present(), "rules left after stop");
    });
}

/// Waits (at most 10 s) until `cond` holds.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let until = Instant::now() + PROMPT;
    while !cond() {
        assert!(Instant::now() < until, "{what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn node_local_dns_notrack_rules_are_reported() {
    let ns = Ns::new("n");
    ns.run(|| {
        serve_dns();
        let handle = NamesHandle::default();
        let cap = start(
            CaptureConfig {
                recheck: Duration::from_millis(200),
                ..CaptureConfig::new(vec![SERVER.into()], QUEUE)
            },
            &handle,
        );
        assert_eq!(cap.notrack(), None, "nothing untracks DNS yet");
        // NodeLocal DNSCache's rules: its address and the server, untracked.
        let rule = ["-p", "udp", "-d", SERVER_S, "--dport", "53", "-j", "NOTRACK"];
        let mut add = vec!["iptables", "-w", "5", "-t", "raw", "-A", "OUTPUT"];
        add.extend(rule);
        sh(&add);
        wait_until("the NOTRACK rule is never reported", || cap.notrack().is_some());
        let why = cap.notrack().unwrap();
        assert!(why.contains("NOTRACK") && why.contains("127.0.0.53"), "{why}");
        // Indeed nothing is learned while it is there.
        let s = query("n31.example.test");
        assert_eq!(reply(&s, PROMPT), Some(address_of("n31")));
        assert_eq!(
            cap.stats.responses.load(Ordering::Relaxed),
            0,
            "an untracked reply was read"
        );
        let mut del = vec!["iptables", "-w", "5", "-t", "raw", "-D", "OUTPUT"];
        del.extend(rule);
        sh(&del);
        wait_until("the report never clears", || cap.notrack().is_none());
        drop(cap);
    });
}
