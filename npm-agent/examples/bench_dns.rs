//! DNS learning benchmark: the added latency of DNS replies through the
//! learner (`npm_agent::dns::Capture`: the NFQUEUE reader, its rules, the
//! learner with a state file) at 1,000 replies/s, 10% of them teaching a new
//! address, on a private netns `npmbd<pid>` (loopback: a responder on
//! 127.0.0.53:53 answers every query at once, one client sends queries on
//! a fixed schedule and timestamps each reply).
//!
//! Three phases of the same load:
//! - `baseline`: no capture (the kernel path alone);
//! - `restart`: the capture runs, no state compiled yet and no sync (an
//!   agent (re)start: every name wanted, nothing may be held);
//! - `steady`: a state compiled (`*.example.test` wanted), syncs succeed: a
//!   simulated sync loop programs each new version `SYNC_MS` after it
//!   appears (default 30 ms, the sync latency the review measured: 20-60
//!   ms), and teaching replies are held until then.
//!
//! Reports p50/p99 reply latency per phase and kind (teaching or not), and
//! the p99 added over the baseline. Targets: during a restart every reply,
//! and in steady state every non-teaching reply, p99 added <= 1 ms (nothing
//! waits behind a held reply); a teaching reply in steady state is held for
//! the sync that programs it, which is the sync under way when it came or
//! the next one: p99 <= 2 x SYNC_MS + 10 ms. Ends with one JSON line
//! (`"bench":"dns"`).
//!
//! Runs as root (netns, iptables). `cargo xtask bench dns [-- SECONDS SYNC_MS]`.

use std::collections::HashMap;
use std::net::{Ipv4Addr, UdpSocket};
use std::os::fd::AsRawFd;
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use npm_agent::dns::{Capture, CaptureConfig, NamesHandle};
use npm_policy::tiers::DomainPattern;
use simple_dns::rdata::{RData, A};
use simple_dns::{Name, Packet, Question, ResourceRecord, CLASS, QCLASS, QTYPE, TYPE};

const SERVER: Ipv4Addr = Ipv4Addr::new(127, 0, 0, 53);
const RATE: u32 = 1_000;
/// One query in `TEACH_EVERY` asks a name never asked before.
const TEACH_EVERY: u32 = 10;
const TARGET_ADDED_P99_MS: f64 = 1.0;
const TARGET_HELD_SLACK_MS: f64 = 10.0;

fn sh(args: &[&str]) {
    let out = Command::new(args[0]).args(&args[1..]).output().expect("run");
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Netns `npmbd<pid>`, deleted on drop (leftovers of crashed runs first).
struct Netns(String);

impl Netns {
    fn new() -> Netns {
        let out = Command::new("ip").args(["netns", "list"]).output().expect("ip netns");
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let name = line.split_whitespace().next().unwrap_or("");
            if let Some(pid) = name.strip_prefix("npmbd") {
                if !std::path::Path::new(&format!("/proc/{pid}")).exists() {
                    let _ = Command::new("ip").args(["netns", "delete", name]).output();
                }
            }
        }
        let ns = Netns(format!("npmbd{}", std::process::id()));
        sh(&["ip", "netns", "add", &ns.0]);
        sh(&["ip", "-n", &ns.0, "link", "set", "lo", "up"]);
        ns
    }

    /// Moves the calling thread into the netns.
    fn enter(&self) {
        let f = std::fs::File::open(format!("/run/netns/{}", self.0)).expect("open netns");
        // SAFETY: setns on this thread only, with a valid namespace fd.
        let rc = unsafe { libc::setns(f.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "delete", &self.0]).output();
    }
}

/// The address of name number `k`: 10.x.y.z.
fn address(k: u32) -> Ipv4Addr {
    Ipv4Addr::from(0x0a00_0000 | (k & 0x00ff_ffff))
}

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
            let qname = question.qname.clone();
            let name = qname.to_string();
            let k: u32 = name
                .strip_prefix('n')
                .and_then(|r| r.split('.').next())
                .and_then(|k| k.parse().ok())
                .unwrap_or(0);
            reply.answers.push(ResourceRecord::new(
                qname,
                CLASS::IN,
                300,
                RData::A(A::from(address(k))),
            ));
            if let Ok(bytes) = reply.build_bytes_vec() {
                let _ = s.send_to(&bytes, from);
            }
        }
    });
}

fn query_bytes(id: u16, name: &str) -> Vec<u8> {
    let mut q = Packet::new_query(id);
    q.questions.push(Question::new(
        Name::new_unchecked(name),
        QTYPE::TYPE(TYPE::A),
        QCLASS::CLASS(CLASS::IN),
        false,
    ));
    q.build_bytes_vec().expect("query")
}

/// The latencies (ms) of one phase, by kind.
#[derive(Default)]
struct Phase {
    teaching: Vec<f64>,
    other: Vec<f64>,
    lost: usize,
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let i = ((v.len() as f64 - 1.0) * p).round() as usize;
    v[i]
}

/// Sends `RATE` queries/s for `secs` (each `TEACH_EVERY`th for a new name
/// `n<next>.example.test`, the others for one of 50 known names), and
/// records each reply's latency.
fn run_phase(secs: u32, next_new: &mut u32) -> Phase {
    let sock = UdpSocket::bind("127.0.0.1:0").unwrap();
    sock.connect((SERVER, 53)).unwrap();
    let recv = sock.try_clone().unwrap();
    recv.set_read_timeout(Some(Duration::from_millis(200))).unwrap();
    let sent: Arc<Mutex<HashMap<u16, (Instant, bool)>>> = Arc::default();
    let done = Arc::new(AtomicBool::new(false));
    let (sent2, done2) = (sent.clone(), done.clone());
    let receiver = std::thread::spawn(move || {
        let mut phase = Phase::default();
        let mut buf = [0u8; 1500];
        loop {
            match recv.recv(&mut buf) {
                Ok(n) if n >= 2 => {
                    let at = Instant::now();
                    let id = u16::from_be_bytes([buf[0], buf[1]]);
                    if let Some((t, teaching)) = sent2.lock().unwrap().remove(&id) {
                        let ms = at.duration_since(t).as_secs_f64() * 1e3;
                        if teaching {
                            phase.teaching.push(ms)
                        } else {
                            phase.other.push(ms)
                        }
                    }
                }
                _ => {
                    if done2.load(Ordering::Relaxed) {
                        break;
                    }
                }
            }
        }
        phase.lost = sent2.lock().unwrap().len();
        phase
    });
    let total = secs * RATE;
    let start = Instant::now();
    let step = Duration::from_secs(1) / RATE;
    for i in 0..total {
        let at = start + step * i;
        let now = Instant::now();
        if at > now {
            std::thread::sleep(at - now);
        }
        let teaching = i % TEACH_EVERY == 0;
        let name = if teaching {
            *next_new += 1;
            format!("n{}.example.test", *next_new)
        } else {
            format!("n{}.example.test", 1 + i % 50)
        };
        let id = (i % 65_536) as u16;
        let bytes = query_bytes(id, &name);
        sent.lock().unwrap().insert(id, (Instant::now(), teaching));
        let _ = sock.send(&bytes);
    }
    std::thread::sleep(Duration::from_secs(2));
    done.store(true, Ordering::Relaxed);
    receiver.join().unwrap()
}

/// Programs each new version `sync` after the capture woke it (as the
/// agent's sync loop: woken by a change, one sync at a time), while `on`.
fn sync_loop(handle: NamesHandle, sync: Duration, on: Arc<AtomicBool>, woken: std::sync::mpsc::Receiver<()>) {
    std::thread::spawn(move || {
        while woken.recv().is_ok() {
            while woken.try_recv().is_ok() {}
            if !on.load(Ordering::Relaxed) {
                continue;
            }
            // The sync compiles the names of now, and programs them.
            let v = handle.current().version;
            std::thread::sleep(sync);
            handle.publish_programmed(v);
        }
    });
}

fn summary(name: &str, p: &mut Phase, base_p99: f64) -> serde_json::Value {
    let mut all: Vec<f64> = p.teaching.iter().chain(&p.other).copied().collect();
    let out = serde_json::json!({
        "replies": all.len(),
        "lost": p.lost,
        "p50_ms": pct(&mut all, 0.5),
        "p99_ms": pct(&mut all, 0.99),
        "other_p99_ms": pct(&mut p.other, 0.99),
        "teaching_p50_ms": pct(&mut p.teaching, 0.5),
        "teaching_p99_ms": pct(&mut p.teaching, 0.99),
        "added_p99_ms": pct(&mut all, 0.99) - base_p99,
        "other_added_p99_ms": pct(&mut p.other, 0.99) - base_p99,
    });
    eprintln!("{name}: {out}");
    out
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let secs: u32 = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(10);
    let sync_ms: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(30);
    let ns = Netns::new();
    ns.enter();
    serve_dns();
    let mut next_new = 1_000;
    // Warm-up: the 50 known names resolve (and, with the capture, are
    // learned) before the measured phases.
    let mut base = run_phase(secs, &mut next_new);
    let mut base_all: Vec<f64> = base.teaching.iter().chain(&base.other).copied().collect();
    let base_p99 = pct(&mut base_all, 0.99);
    let baseline = summary("baseline", &mut base, base_p99);

    let dir = std::env::temp_dir().join(format!("npmbd{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let handle = NamesHandle::default();
    let cfg = CaptureConfig {
        state_file: Some(dir.join("names.json")),
        ..CaptureConfig::new(vec![SERVER.into()], 9)
    };
    let (tx, rx) = std::sync::mpsc::channel();
    let tx = Mutex::new(tx);
    let wake: Arc<dyn Fn() + Send + Sync> = Arc::new(move || {
        let _ = tx.lock().unwrap_or_else(|e| e.into_inner()).send(());
    });
    let capture = Capture::start(cfg, handle.clone(), wake).expect("capture");
    let on = Arc::new(AtomicBool::new(false));
    sync_loop(handle.clone(), Duration::from_millis(sync_ms), on.clone(), rx);
    // An agent (re)start: nothing compiled, no sync.
    let mut restart = run_phase(secs, &mut next_new);
    let restart = summary("restart", &mut restart, base_p99);
    assert_eq!(
        capture.stats.held.load(Ordering::Relaxed),
        0,
        "held before the first compile"
    );
    // Compiled, syncs succeed: teaching replies are held for their sync.
    handle.set_patterns(vec![DomainPattern::parse("*.example.test").unwrap()]);
    handle.sync_result(true);
    on.store(true, Ordering::Relaxed);
    let v = handle.current().version;
    handle.publish_programmed(v);
    let mut steady = run_phase(secs, &mut next_new);
    let steady = summary("steady", &mut steady, base_p99);
    let s = &capture.stats;
    let counts = serde_json::json!({
        "read": s.responses.load(Ordering::Relaxed),
        "learned": s.learning.load(Ordering::Relaxed),
        "held": s.held.load(Ordering::Relaxed),
        "released": s.released.load(Ordering::Relaxed),
        "hold_expired": s.hold_expired.load(Ordering::Relaxed),
        "not_held_not_compiled": s.not_held_not_compiled.load(Ordering::Relaxed),
        "not_held_cap": s.not_held_cap.load(Ordering::Relaxed),
    });
    drop(capture);
    let _ = std::fs::remove_dir_all(&dir);
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    let met = f(&restart, "added_p99_ms") <= TARGET_ADDED_P99_MS
        && f(&steady, "other_added_p99_ms") <= TARGET_ADDED_P99_MS
        && f(&steady, "teaching_p99_ms") <= 2.0 * sync_ms as f64 + TARGET_HELD_SLACK_MS
        && restart["lost"] == 0
        && steady["lost"] == 0;
    println!(
        "{}",
        serde_json::json!({
            "bench": "dns",
            "rate_per_s": RATE,
            "teaching_share": 1.0 / f64::from(TEACH_EVERY),
            "seconds_per_phase": secs,
            "profile": if cfg!(debug_assertions) { "dev" } else { "release" },
            "sync_ms": sync_ms,
            "baseline": baseline,
            "restart": restart,
            "steady": steady,
            "capture": counts,
            "target": {
                "added_p99_ms": TARGET_ADDED_P99_MS,
                "teaching_p99_ms": 2.0 * sync_ms as f64 + TARGET_HELD_SLACK_MS,
            },
            "met": met,
        })
    );
}
