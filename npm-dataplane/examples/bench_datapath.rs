//! Per-packet cost of the datapath, measured in the kernel with
//! `BPF_PROG_TEST_RUN` repeat (the kernel reports the average time per run).
//!
//! Run as root: `cargo run --release -p npm-dataplane --example bench_datapath`
//! (after `cargo xtask build-ebpf`).
//!
//! What is measured, per (policy entries, ipcache entries) scale, each path
//! on its own loaded object (own veth, own pins):
//! - `baseline`: `npm_empty` (returns at once) on the same frame: the fixed
//!   cost of a test run of a classifier.
//! - `policy`: a TCP SYN from a known pod (ipcache hit) to an isolated
//!   endpoint, allowed by an entry of the pod's identity, decided by the
//!   lookups: the object is loaded with the benchmark switch
//!   `NPM_BENCH_NO_CT_CREATE` (no conntrack entry is created, so every
//!   repeat is a new connection): parse, endpoint slot, IPv4 ipcache
//!   front, the `NPM_POLICY` LPM lookup (its value names the allowing
//!   rule, for `NPM_RULE_COUNT`), counters. A SYN skips the conntrack
//!   lookup (a new connection is decided by policy). Not included: the
//!   conntrack insert a real new connection does once.
//! - `deny`: a TCP SYN to a port no entry allows, from a pod that also has a
//!   CIDR identity, decided by the lookups: ipcache front hit, one policy
//!   lookup that misses (the endpoint has no CIDR-peer and no any-peer
//!   ingress entry, so its `EP_NO_*_PEER_*` flags skip those two lookups;
//!   no entry is a wildcard, so the exact-port probe is the only one),
//!   counters, a deny event (once the ring buffer is full, nobody drains it
//!   during the run, the event output fails fast).
//! - `tracked`: a data packet (ACK) of an established connection on a
//!   normally loaded object: one run of the SYN created its conntrack entry
//!   and one run of the SYN-ACK on the egress program marked it replied, so
//!   the connection is in the per-CPU flow cache: parse, endpoint slot,
//!   flow-cache hit. This is what every packet of an established IPv4 flow
//!   costs but the first after each 250 ms on a CPU.
//! - `tracked_ct` (extra): the same ACK with the flow cache switched off:
//!   the conntrack hash lookup in `NPM_CT4` that the first packet of a flow
//!   on a CPU, one packet every 250 ms after, and IPv6 flows pay.
//!
//! - `tracked_enforce`, `tracked_ct_enforce`: `tracked` and `tracked_ct`
//!   with the endpoint under connection semantics `enforce`:
//!   each round's apply moves its decision epoch, the connection is then
//!   established anew, so the ACK is tracked under the current epoch (what
//!   every tracked packet costs while nothing changed; `keep` pays the same
//!   epoch read, the bar is `tracked` <= empty + 20 ns).
//!
//! Each number is the median of 5 runs (`--rounds N`) of 1,000,000 repeats. The runs are
//! interleaved: each of the 5 rounds applies every scale in turn and runs
//! the baseline and every path once there, so a slow phase of a shared VM
//! hits all scales, paths and the baseline alike. Each result carries its
//! row's baseline (`baseline_ns`); the top-level `baseline_ns` is the
//! median of the rows'. The last line of output is one JSON object.
//!
//! Then the ClusterNetworkPolicy rows (`tier_*` paths, at 1, 100 and 1,000
//! CNPs per tier; see `bench_datapath/tiers.rs`), on their own setups.
//! Arguments: `--no-tiers` skips them, `--tiers-only` runs only them,
//! `--rounds N` takes N interleaved rounds instead of 5 (every mode), and
//! `--layers` runs only the layer measurement (`bench_datapath/layers.rs`:
//! the same packets with the fold and the other switchable parts off,
//! interleaved; the figures of `docs/datapath-layers.md`).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::Command;

use npm_dataplane::ebpf::{
    AttachMode, BenchSwitches, EbpfDataplane, EbpfOptions, PROG_EGRESS, PROG_EMPTY, PROG_INGRESS, VERDICT_ALLOW,
};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, Direction, Endpoint, IpEntry, PodRef, PolicyEntry};
use npm_policy::model::Protocol;

#[path = "bench_datapath/layers.rs"]
mod layers;
#[path = "bench_datapath/tiers.rs"]
mod tiers;

const REPEAT: u32 = 1_000_000;
/// Interleaved rounds unless `--rounds N` says otherwise.
const RUNS: usize = 5;
/// The rounds of this run.
static ROUNDS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();

/// The interleaved rounds of this run ([`RUNS`] or `--rounds N`).
fn runs() -> usize {
    ROUNDS.get().copied().unwrap_or(RUNS)
}

/// The command line.
struct Args {
    tiers_only: bool,
    no_tiers: bool,
    layers: bool,
    rounds: usize,
}

impl Args {
    fn parse(mut it: impl Iterator<Item = String>) -> Result<Args, String> {
        let mut a = Args {
            tiers_only: false,
            no_tiers: false,
            layers: false,
            rounds: RUNS,
        };
        while let Some(arg) = it.next() {
            match arg.as_str() {
                "--tiers-only" => a.tiers_only = true,
                "--no-tiers" => a.no_tiers = true,
                "--layers" => a.layers = true,
                "--rounds" => {
                    let v = it.next().ok_or("--rounds needs a number")?;
                    a.rounds = v
                        .parse()
                        .ok()
                        .filter(|n| *n >= 1)
                        .ok_or(format!("--rounds {v:?}: not a number of rounds (1 or more)"))?;
                }
                other => return Err(format!("unknown argument {other:?}")),
            }
        }
        Ok(a)
    }
}
const POLICY_SCALES: [usize; 3] = [1, 1_000, 10_000];
const IPCACHE_SCALES: [usize; 3] = [100, 10_000, 100_000];

struct Cleanup {
    links: Vec<String>,
    pins: Vec<PathBuf>,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for l in &self.links {
            let _ = Command::new("ip").args(["link", "del", l]).output();
        }
        for p in &self.pins {
            let _ = std::fs::remove_dir_all(p);
        }
    }
}

/// Removes what crashed or killed runs left: pin directories
/// `npm-bench-<pid>-*` and veths `npb<pid>*` of processes that are gone.
fn sweep_leftovers() {
    let dead = |pid: &str| pid.parse::<u32>().is_ok() && !std::path::Path::new(&format!("/proc/{pid}")).exists();
    if let Ok(dir) = std::fs::read_dir("/sys/fs/bpf") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if let Some(pid) = name.strip_prefix("npm-bench-").and_then(|r| r.split('-').next()) {
                if dead(pid) {
                    let _ = std::fs::remove_dir_all(e.path());
                }
            }
        }
    }
    if let Ok(dir) = std::fs::read_dir("/sys/class/net") {
        for e in dir.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            // npb<pid><tag>, the peer with a trailing "x".
            if let Some(rest) = name.strip_prefix("npb") {
                let pid: String = rest.chars().take_while(char::is_ascii_digit).collect();
                if dead(&pid) && !name.ends_with('x') {
                    let _ = Command::new("ip").args(["link", "del", &name]).output();
                }
            }
        }
    }
}

fn veth(name: &str) -> u32 {
    let _ = Command::new("ip").args(["link", "del", name]).output();
    let peer = format!("{name}x");
    let ok = Command::new("ip")
        .args(["link", "add", name, "type", "veth", "peer", "name", &peer])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "creating veth {name} failed (run as root)");
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .expect("ifindex")
        .trim()
        .parse()
        .expect("ifindex number")
}

/// A TCP SYN.
fn frame(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16) -> Vec<u8> {
    tcp_frame(src, dst, sport, dport, 0x02)
}

/// An Ethernet/IPv4/TCP frame with the given TCP flags.
fn tcp_frame(src: Ipv4Addr, dst: Ipv4Addr, sport: u16, dport: u16, flags: u8) -> Vec<u8> {
    let mut f = vec![0x02, 0, 0, 0, 0, 1, 0x02, 0, 0, 0, 0, 2, 0x08, 0x00];
    let mut ip = vec![0x45, 0, 0, 40, 0, 1, 0x40, 0, 64, 6, 0, 0];
    ip.extend(src.octets());
    ip.extend(dst.octets());
    ip.extend(sport.to_be_bytes());
    ip.extend(dport.to_be_bytes());
    ip.extend([0, 0, 0, 1, 0, 0, 0, 0, 0x50, flags, 0xff, 0xff, 0, 0, 0, 0]);
    f.extend(ip);
    f
}

/// Endpoint 1 (10.0.0.1, isolated both ways), `ipcache` addresses (the
/// peer 10.0.0.2 among them) and `policy` entries (the one allowing the
/// peer's identity TCP 80 among them; the others spread over identities and
/// port ranges).
fn compiled(policy: usize, ipcache: usize) -> Compiled {
    let mut c = Compiled::default();
    c.endpoints.insert(
        1,
        Endpoint {
            pod: PodRef {
                namespace: "bench".into(),
                name: "server".into(),
                uid: "uid-server".into(),
            },
            identity: 256,
            ipv4: Some(Ipv4Addr::new(10, 0, 0, 1)),
            ipv6: None,
            isolated_ingress: true,
            isolated_egress: true,
            tiers: Default::default(),
            report_new: false,
        },
    );
    c.ipcache.insert(
        IpAddr::V4(Ipv4Addr::new(10, 0, 0, 2)),
        IpEntry {
            identity: 300,
            cidr_identity: npm_common::IDENTITY_FIRST_CIDR,
            owner: 0,
        },
    );
    for i in 0..ipcache.saturating_sub(1) {
        let n = i as u32 + 3;
        let addr = Ipv4Addr::new(10, (n >> 16) as u8 + 1, (n >> 8) as u8, n as u8);
        c.ipcache.insert(
            IpAddr::V4(addr),
            IpEntry {
                identity: 1000 + (i as u32 % 5000),
                cidr_identity: 0,
                owner: 0,
            },
        );
    }
    // Entries are keyed by the endpoint's subject, its pod identity.
    let subject = c.endpoints[&1].identity;
    c.policy.insert(
        PolicyEntry {
            subject,
            direction: Direction::Ingress,
            peer: 300,
            protocol: Some(Protocol::Tcp),
            ports: (80, 80),
        },
        0,
    );
    for i in 1..policy {
        let lo = 1024 + (i as u16 % 30_000) * 2;
        c.policy.insert(
            PolicyEntry {
                subject,
                direction: if i % 2 == 0 {
                    Direction::Ingress
                } else {
                    Direction::Egress
                },
                peer: 1000 + (i as u32 % 5000),
                protocol: Some(if i % 3 == 0 { Protocol::Udp } else { Protocol::Tcp }),
                ports: (lo, lo + (i as u16 % 7)),
            },
            i as u32,
        );
    }
    c
}

/// One measured case: a program of a setup on a frame.
type Case<'a> = (&'a Setup, &'static str, &'a [u8]);

/// Runs every case once ([`REPEAT`] repeats); ns per packet of each.
fn measure_once(cases: &[Case<'_>]) -> Vec<u64> {
    cases
        .iter()
        .map(|(s, prog, pkt)| {
            s.dp.bench_run(prog, s.ifindex, pkt, REPEAT)
                .unwrap_or_else(|e| panic!("bench run {prog}: {e}"))
                .as_nanos() as u64
        })
        .collect()
}

/// The median of the samples.
fn median(v: &[u64]) -> u64 {
    let mut v = v.to_vec();
    v.sort_unstable();
    v[v.len() / 2]
}

/// One loaded dataplane of the benchmark, on its own veth and pin dir.
struct Setup {
    dp: EbpfDataplane,
    ifindex: u32,
}

fn main() {
    sweep_leftovers();
    let pid = std::process::id();
    let args = match Args::parse(std::env::args().skip(1)) {
        Ok(a) => a,
        Err(e) => {
            eprintln!("bench_datapath: {e} (use --tiers-only, --no-tiers, --layers, --rounds N)");
            std::process::exit(2);
        }
    };
    ROUNDS.set(args.rounds).expect("rounds set once");
    if args.layers {
        let results = layers::run(pid, args.rounds);
        println!(
            r#"{{"bench":"datapath","mode":"layers","results":[{}]}}"#,
            results.join(",")
        );
        return;
    }
    if args.tiers_only {
        let results = tiers::run(pid);
        println!(r#"{{"bench":"datapath","results":[{}]}}"#, results.join(","));
        return;
    }
    let with_tiers = !args.no_tiers;
    // (tag, no conntrack create, switches)
    let kinds = [
        ("p", true, BenchSwitches::default()),
        ("t", false, BenchSwitches::default()),
        (
            "c",
            false,
            BenchSwitches {
                no_flow_cache: true,
                ..BenchSwitches::default()
            },
        ),
        // The same two under connection semantics `enforce`.
        ("e", false, BenchSwitches::default()),
        (
            "f",
            false,
            BenchSwitches {
                no_flow_cache: true,
                ..BenchSwitches::default()
            },
        ),
    ];
    let links: Vec<String> = kinds.iter().map(|(t, _, _)| format!("npb{pid}{t}")).collect();
    let pins: Vec<PathBuf> = kinds
        .iter()
        .map(|(t, _, _)| PathBuf::from(format!("/sys/fs/bpf/npm-bench-{pid}-{t}")))
        .collect();
    let _cleanup = Cleanup {
        links: links.clone(),
        pins: pins.clone(),
    };
    let mut setups: Vec<Setup> = kinds
        .iter()
        .zip(links.iter().zip(&pins))
        .map(|((_, no_ct, switches), (link, pin))| Setup {
            ifindex: veth(link),
            dp: EbpfDataplane::open_with(
                EbpfOptions {
                    object: None,
                    pin_dir: pin.clone(),
                    bench_no_ct_create: *no_ct,
                    attach: AttachMode::Tcx,
                },
                *switches,
            )
            .unwrap_or_else(|e| panic!("open: {e}")),
        })
        .collect();
    for s in &mut setups[3..] {
        s.dp.set_established_enforce([1].into_iter().collect());
    }

    let peer = Ipv4Addr::new(10, 0, 0, 2);
    let me = Ipv4Addr::new(10, 0, 0, 1);
    let allowed = frame(peer, me, 40000, 80);
    let denied = frame(peer, me, 40001, 81);
    let syn_ack = tcp_frame(me, peer, 80, 40000, 0x12);
    let ack = tcp_frame(peer, me, 40000, 80, 0x10);

    let s0 = &setups[0];
    // Touch the egress program too, so both are known to verify and run.
    let _ = s0
        .dp
        .bench_run(PROG_EGRESS, s0.ifindex, &allowed, 1)
        .expect("egress run");

    let mut prev = Compiled::default();
    let mut results = Vec::new();
    let mut baselines = Vec::new();
    let paths = [
        "policy",
        "deny",
        "tracked",
        "tracked_ct",
        "tracked_enforce",
        "tracked_ct_enforce",
    ];
    print!("{:>8} {:>8} {:>11}", "policy", "ipcache", "baseline_ns");
    for p in paths {
        print!(" {:>13}", format!("{p}_ns"));
    }
    println!();
    // Rounds over all scales: each round applies every scale in turn and
    // measures every case once, so a slow phase of the shared VM hits all
    // scales and paths alike; the figure is the median over the rounds.
    let scales: Vec<(usize, usize)> = POLICY_SCALES
        .iter()
        .flat_map(|&p| IPCACHE_SCALES.iter().map(move |&n| (p, n)))
        .collect();
    let mut samples: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); paths.len() + 1]; scales.len()];
    for _ in 0..runs() {
        for (row, &(p, n)) in scales.iter().enumerate() {
            let next = compiled(p, n);
            let diff = prev.diff(&next);
            for s in &mut setups {
                let ifs: BTreeMap<u32, u32> = [(1, s.ifindex)].into_iter().collect();
                s.dp.apply(&diff, &next, &ifs).expect("apply");
            }
            prev = next;

            let [sp, st, sc, se, sf] = &setups[..] else {
                unreachable!("five setups")
            };
            let check = sp.dp.test_run(Direction::Ingress, sp.ifindex, &allowed).expect("check");
            assert_eq!(check, (VERDICT_ALLOW, Some(npm_common::Reason::Policy)));
            let check = sp.dp.test_run(Direction::Ingress, sp.ifindex, &denied).expect("check");
            assert_eq!(check.1, Some(npm_common::Reason::PolicyDenied));
            // Establish the connection on both tracked setups: SYN in,
            // SYN-ACK out; then its ACKs are tracked.
            for s in [st, sc, se, sf] {
                let check = s.dp.test_run(Direction::Ingress, s.ifindex, &allowed).expect("check");
                assert_eq!(check.0, VERDICT_ALLOW);
                let check = s.dp.test_run(Direction::Egress, s.ifindex, &syn_ack).expect("check");
                assert_eq!(check, (VERDICT_ALLOW, Some(npm_common::Reason::Tracked)));
                let check = s.dp.test_run(Direction::Ingress, s.ifindex, &ack).expect("check");
                assert_eq!(check, (VERDICT_ALLOW, Some(npm_common::Reason::Tracked)));
            }
            let cases: [Case<'_>; 7] = [
                (sp, PROG_EMPTY, &allowed),
                (sp, PROG_INGRESS, &allowed),
                (sp, PROG_INGRESS, &denied),
                (st, PROG_INGRESS, &ack),
                (sc, PROG_INGRESS, &ack),
                (se, PROG_INGRESS, &ack),
                (sf, PROG_INGRESS, &ack),
            ];
            for (i, ns) in measure_once(&cases).into_iter().enumerate() {
                samples[row][i].push(ns);
            }
        }
    }
    for (row, &(p, n)) in scales.iter().enumerate() {
        let m: Vec<u64> = samples[row].iter().map(|v| median(v)).collect();
        let row_baseline = m[0];
        baselines.push(row_baseline);
        print!("{p:>8} {n:>8} {row_baseline:>11}");
        for (path, ns) in paths.iter().zip(&m[1..]) {
            print!(" {ns:>13}");
            results.push(format!(
                r#"{{"path":"{path}","policy_entries":{p},"ipcache_entries":{n},"ns":{ns},"baseline_ns":{row_baseline}}}"#
            ));
        }
        println!();
    }
    baselines.sort_unstable();
    let baseline = baselines[baselines.len() / 2];
    println!("baseline (npm_empty, median of the rows): {baseline} ns");
    if with_tiers {
        results.extend(tiers::run(pid));
    }
    println!(
        r#"{{"bench":"datapath","baseline_ns":{baseline},"results":[{}]}}"#,
        results.join(",")
    );
}
