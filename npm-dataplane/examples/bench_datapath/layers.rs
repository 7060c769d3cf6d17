//! `--layers`: what the precomputed form of the datapath (the fold) and
//! its other switchable parts gain or cost, measured by loading the same
//! object with them switched off one at a time
//! (`BenchSwitches`) and running the same packets on every configuration,
//! interleaved: each of `--rounds N` rounds (default [`super::RUNS`])
//! applies every CNP scale (1, 100, 1,000 ClusterNetworkPolicies per tier,
//! `tiers::compiled`) in turn and runs the empty program and every
//! (configuration, row) once there, so a slow phase of the shared machine
//! hits every configuration alike. Each figure is the median over the
//! rounds, with the rounds' minimum and maximum as its spread.
//!
//! Configurations (decision rows: no conntrack entry is created, so every
//! repeat is the first packet of a new connection):
//! - `full`: production: the fold for the tiered endpoints, the LPM
//!   (`NPM_POLICY`) for NetworkPolicy alone;
//! - `general`: the general parser instead of the IPv4 fast path;
//! - `no_rule_count`: the per-rule and per-endpoint deny counters not
//!   bumped (what they cost);
//! - `reduced`: `BenchSwitches::reduced()`, the LPMs alone (the truth: the
//!   fold off).
//!
//! Tracked configurations (conntrack entries created; an ACK of an
//! established connection): `full`, `no_flow_cache` (the conntrack lookup),
//! `general` (the general parser), `reduced`.
//!
//! Rows: `np_allow` / `np_deny` (endpoint 3, isolated by a NetworkPolicy,
//! no tier), the four tier rows of `tiers.rs`
//! (`admin_accept`, `admin_deny`, `pass_policy`, `baseline_tier`), and
//! `tracked`. Also the programs' verifier figures per configuration
//! (`to_pod`: instructions the verifier processed, translated and JIT
//! sizes).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use aya::programs::{SchedClassifier, TcAttachType};
use npm_common::IDENTITY_FIRST_CIDR;
use npm_dataplane::ebpf::{AttachMode, BenchSwitches, EbpfDataplane, EbpfOptions, PROG_EMPTY, PROG_INGRESS};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction, IpEntry, PolicyEntry};
use npm_policy::model::Protocol;

use super::{frame, median, tcp_frame, veth, Cleanup, REPEAT};

/// CNPs in each tier per scale.
const SCALES: [usize; 3] = [1, 100, 1_000];

/// Decision configurations: (name, switches).
fn decision_configs() -> Vec<(&'static str, BenchSwitches)> {
    vec![
        ("full", BenchSwitches::default()),
        (
            "general",
            BenchSwitches {
                no_fast_v4: true,
                ..BenchSwitches::default()
            },
        ),
        (
            "no_rule_count",
            BenchSwitches {
                no_rule_count: true,
                ..BenchSwitches::default()
            },
        ),
        ("reduced", BenchSwitches::reduced()),
    ]
}

/// Tracked configurations: (name, switches).
fn tracked_configs() -> Vec<(&'static str, BenchSwitches)> {
    vec![
        ("full", BenchSwitches::default()),
        (
            "no_flow_cache",
            BenchSwitches {
                no_flow_cache: true,
                ..BenchSwitches::default()
            },
        ),
        (
            "general",
            BenchSwitches {
                no_fast_v4: true,
                ..BenchSwitches::default()
            },
        ),
        ("reduced", BenchSwitches::reduced()),
    ]
}

/// Endpoint 3 (10.0.0.7, identity 258), isolated for ingress by a
/// NetworkPolicy allowing identity 300 (10.0.0.2) on TCP 80, no tier.
/// (Flow-log reporting, `report_new`, is not measurable here: a repeat
/// without a conntrack entry created never reports.)
const NP_IP: [u8; 4] = [10, 0, 0, 7];

/// `tiers::compiled(n)` with the NetworkPolicy-only endpoint 3.
fn compiled(n: usize) -> Compiled {
    let mut c = super::tiers::compiled(n);
    let mut e = c.endpoints[&1].clone();
    e.pod.name = "np3".into();
    e.pod.uid = "uid-np3".into();
    e.identity = 258;
    e.ipv4 = Some(Ipv4Addr::from(NP_IP));
    e.tiers = Default::default();
    c.endpoints.insert(3, e);
    c.ipcache.insert(
        IpAddr::V4(Ipv4Addr::from(NP_IP)),
        IpEntry {
            identity: 258,
            cidr_identity: IDENTITY_FIRST_CIDR,
            owner: 0,
        },
    );
    c.policy.insert(
        PolicyEntry {
            subject: 258,
            direction: Direction::Ingress,
            peer: 300,
            protocol: Some(Protocol::Tcp),
            ports: (80, 80),
        },
        7,
    );
    c
}

/// One loaded configuration with endpoints 1 to 3 on veths of their own.
struct Setup {
    name: &'static str,
    dp: EbpfDataplane,
    /// (link name, ifindex) of endpoints 1..=3.
    links: Vec<(String, u32)>,
}

impl Setup {
    fn ifs(&self) -> BTreeMap<u32, u32> {
        self.links
            .iter()
            .enumerate()
            .map(|(i, (_, ix))| (i as u32 + 1, *ix))
            .collect()
    }
    fn ifindex(&self, ep: u32) -> u32 {
        self.links[ep as usize - 1].1
    }
    /// `to_pod`'s verifier figures, read from the program attached to
    /// endpoint 1's link: (instructions processed, translated bytes, JIT
    /// bytes).
    fn prog_figures(&self) -> (u32, u32, u32) {
        let (_, progs) = SchedClassifier::query_tcx(&self.links[0].0, TcAttachType::Egress).expect("query tcx");
        let p = progs
            .iter()
            .find(|p| p.name_as_str() == Some(PROG_INGRESS))
            .unwrap_or_else(|| panic!("{}: {PROG_INGRESS} not attached", self.name));
        (
            p.verified_instruction_count().unwrap_or(0),
            p.size_translated().unwrap_or(0),
            p.size_jitted(),
        )
    }
}

fn open(pid: u32, tag: &str, name: &'static str, no_ct: bool, switches: BenchSwitches, cleanup: &mut Cleanup) -> Setup {
    let pin = PathBuf::from(format!("/sys/fs/bpf/npm-bench-{pid}-{tag}"));
    cleanup.pins.push(pin.clone());
    let mut links = Vec::new();
    for ep in 1..=3 {
        let l = format!("npb{pid}{tag}{ep}");
        let ix = veth(&l);
        cleanup.links.push(l.clone());
        links.push((l, ix));
    }
    let dp = EbpfDataplane::open_with(
        EbpfOptions {
            object: None,
            pin_dir: pin,
            bench_no_ct_create: no_ct,
            attach: AttachMode::Tcx,
        },
        switches,
    )
    .unwrap_or_else(|e| panic!("open {name}: {e}"));
    Setup { name, dp, links }
}

/// The decision rows: (name, endpoint, frame, expected reason).
fn decision_rows() -> Vec<(&'static str, u32, Vec<u8>, npm_common::Reason)> {
    use npm_common::Reason::*;
    let ip = |d| Ipv4Addr::new(10, 0, 0, d);
    vec![
        ("np_allow", 3, frame(ip(2), ip(7), 40000, 80), Policy),
        ("np_deny", 3, frame(ip(2), ip(7), 40000, 81), PolicyDenied),
        ("admin_accept", 1, frame(ip(3), ip(1), 40000, 80), AdminAccept),
        ("admin_deny", 1, frame(ip(4), ip(1), 40000, 80), AdminDeny),
        ("pass_policy", 1, frame(ip(2), ip(1), 40000, 80), Policy),
        ("baseline_tier", 2, frame(ip(6), ip(5), 40000, 80), BaselineAccept),
    ]
}

/// Runs the layer measurement over `rounds` rounds; returns the JSON
/// results.
pub(super) fn run(pid: u32, rounds: usize) -> Vec<String> {
    let mut cleanup = Cleanup {
        links: Vec::new(),
        pins: Vec::new(),
    };
    let mut decided: Vec<Setup> = decision_configs()
        .into_iter()
        .enumerate()
        .map(|(i, (name, sw))| open(pid, &format!("d{i}"), name, true, sw, &mut cleanup))
        .collect();
    let mut tracked: Vec<Setup> = tracked_configs()
        .into_iter()
        .enumerate()
        .map(|(i, (name, sw))| open(pid, &format!("t{i}"), name, false, sw, &mut cleanup))
        .collect();
    let rows = decision_rows();
    let (peer, np) = (Ipv4Addr::new(10, 0, 0, 2), Ipv4Addr::new(10, 0, 0, 7));
    let syn = frame(peer, np, 40000, 80);
    let syn_ack = tcp_frame(np, peer, 80, 40000, 0x12);
    let ack = tcp_frame(peer, np, 40000, 80, 0x10);

    // samples[scale][(config, row)] and the baseline per scale.
    let mut samples: Vec<BTreeMap<(String, &'static str), Vec<u64>>> = vec![BTreeMap::new(); SCALES.len()];
    let mut base: Vec<Vec<u64>> = vec![Vec::new(); SCALES.len()];
    let mut figures = BTreeMap::new();
    let mut prev = Compiled::default();
    for round in 0..rounds {
        for (row_i, &n) in SCALES.iter().enumerate() {
            let next = compiled(n);
            let diff = prev.diff(&next);
            for s in decided.iter_mut().chain(tracked.iter_mut()) {
                let ifs = s.ifs();
                s.dp.apply(&diff, &next, &ifs).expect("apply");
            }
            prev = next;
            // Each row's packet is decided as the reference says, on every
            // configuration.
            for s in &decided {
                for (name, ep, pkt, want) in &rows {
                    let got =
                        (0..3).find_map(|_| s.dp.test_run(Direction::Ingress, s.ifindex(*ep), pkt).expect("check").1);
                    assert_eq!(got, Some(*want), "{} {name} at {n} CNPs", s.name);
                }
            }
            for s in &tracked {
                use npm_common::Reason::Tracked;
                let check = |dir, pkt: &[u8]| s.dp.test_run(dir, s.ifindex(3), pkt).expect("check");
                check(Direction::Ingress, &syn);
                assert_eq!(check(Direction::Egress, &syn_ack).1, Some(Tracked), "{}", s.name);
                assert_eq!(check(Direction::Ingress, &ack).1, Some(Tracked), "{}", s.name);
            }
            let run = |s: &Setup, prog, ep, pkt: &[u8]| {
                s.dp.bench_run(prog, s.ifindex(ep), pkt, REPEAT)
                    .unwrap_or_else(|e| panic!("bench run {prog}: {e}"))
                    .as_nanos() as u64
            };
            base[row_i].push(run(&decided[0], PROG_EMPTY, 3, &rows[0].2));
            for s in &decided {
                for (name, ep, pkt, _) in &rows {
                    let ns = run(s, PROG_INGRESS, *ep, pkt);
                    samples[row_i].entry((s.name.to_string(), name)).or_default().push(ns);
                }
            }
            for s in &tracked {
                let ns = run(s, PROG_INGRESS, 3, &ack);
                samples[row_i]
                    .entry((format!("tracked:{}", s.name), "tracked"))
                    .or_default()
                    .push(ns);
            }
            if round == 0 && row_i == 0 {
                for s in decided.iter().chain(&tracked) {
                    figures.insert(s.name, s.prog_figures());
                }
            }
        }
        eprintln!("layers: round {} of {rounds} done", round + 1);
    }
    let mut results = Vec::new();
    println!("to_pod per configuration: verified instructions, translated bytes, JIT bytes");
    for (name, (insns, xlated, jited)) in &figures {
        println!("{name:>24} {insns:>9} {xlated:>8} {jited:>8}");
        results.push(format!(
            r#"{{"path":"layers_prog","config":"{name}","verified_insns":{insns},"xlated_bytes":{xlated},"jited_bytes":{jited}}}"#
        ));
    }
    for (row_i, &n) in SCALES.iter().enumerate() {
        let b = median(&base[row_i]);
        let (bmin, bmax) = (
            *base[row_i].iter().min().expect("samples"),
            *base[row_i].iter().max().expect("samples"),
        );
        println!("{n} CNPs per tier: npm_empty {b} ns (rounds {bmin}..{bmax}); ns above it, median [min..max] of {rounds} rounds");
        for ((config, row), v) in &samples[row_i] {
            let m = median(v);
            let (lo, hi) = (*v.iter().min().expect("samples"), *v.iter().max().expect("samples"));
            println!(
                "{config:>24} {row:>16} {:>5} [{}..{}]",
                m as i64 - b as i64,
                lo as i64 - b as i64,
                hi as i64 - b as i64
            );
            results.push(format!(
                r#"{{"path":"layers_{row}","config":"{config}","cnps_per_tier":{n},"rounds":{rounds},"ns":{m},"min_ns":{lo},"max_ns":{hi},"baseline_ns":{b},"baseline_min_ns":{bmin},"baseline_max_ns":{bmax}}}"#
            ));
        }
    }
    drop(decided);
    drop(tracked);
    drop(cleanup);
    results
}
