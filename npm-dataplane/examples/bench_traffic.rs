//! What a pod sees: TCP throughput, request/response rate and new
//! connections per second between two pods on one node, with no dataplane,
//! the eBPF dataplane and the nftables dataplane, each with 1, 1,000 and
//! 10,000 policy entries on the receiving endpoint.
//!
//! Run as root: `cargo xtask bench traffic [-- --duration S --rounds N]`
//! (or `cargo run --release -p npm-dataplane --example bench_traffic --`
//! with `NPM_EBPF_OBJECT` set, after `cargo xtask build-ebpf`). Needs
//! `iperf3` (Debian's package).
//!
//! Each of the 7 rows has its own node namespace and two pod namespaces
//! (client and server) wired as the netns cluster wires pods
//! (`tests/netns_common`): veth pairs, /32 pod addresses, routes on the
//! node. The eBPF rows each load their own object (own pins) and attach it
//! to both host-side veths; the nftables rows load their table in their
//! node namespace. Both are programmed directly (`sync_full`) with a
//! synthetic compiled state: both pods are endpoints, the server is
//! isolated for ingress and holds N ingress entries, one of which allows
//! the client's identity on TCP 5201-5203 (the others: other identities,
//! TCP and UDP, short port ranges); the client is not isolated. The "none"
//! row has no dataplane (`policy_entries` 0). Before measuring, each row
//! checks that the allowed port connects and that a port no entry allows
//! does not (it does in the "none" row): the dataplane is in the path.
//!
//! Per row and round: iperf3 (one stream, `--duration` seconds, receiver's
//! rate), 1-byte ping-pong on one connection (`--duration` seconds), and
//! new connections (connect, 1-byte request and reply, close; the client
//! closes first) for `--duration` seconds; the clients run in threads that
//! entered the client namespace, the servers in threads of the server
//! namespace. The rows are interleaved: each of the `--rounds` rounds runs
//! one metric on every row in turn, then the next metric, starting one row
//! later than the round before, so the drift of a shared machine hits all
//! rows alike. Each figure is the median over the rounds; the table also
//! gives, per row, the median over the rounds of the ratio to the "none"
//! sample of the same round. The process raises its scheduling priority
//! (`--nice`, default -10; 0 keeps it) so that other work on the machine
//! disturbs the figures less, and pins every client to CPU 0 and every
//! server to CPU 1 (`--no-pin`: not pinned; see `bench_traffic/load.rs`).
//! Defaults: 1 s, 7 rounds, about 3 minutes. The last line of output is
//! one JSON object.

#[path = "bench_traffic/load.rs"]
mod load;
#[path = "../tests/dataplane/netns_common/mod.rs"]
mod netns_common;
#[path = "bench_traffic/stats.rs"]
mod stats;
#[path = "bench_traffic/topo.rs"]
mod topo;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use topo::{Kind, Topo, DENIED_PORT, RR_PORT};

/// The policy sizes of the dataplane rows.
const SIZES: [usize; 3] = [1, 1_000, 10_000];

/// The command line: `--duration S` (whole seconds per measurement, default
/// 1), `--rounds N` (default 7), `--nice N` (default -10),
/// `--bpf-stats` (the kernel's run time of the eBPF rows' programs) and
/// `--no-pin`.
struct Args {
    duration: u32,
    rounds: usize,
    nice: i32,
    bpf_stats: bool,
    /// Clients on CPU 0, servers on CPU 1 (`--no-pin`: the scheduler's
    /// choice).
    pin: bool,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        duration: 1,
        rounds: 7,
        nice: -10,
        bpf_stats: false,
        pin: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        let mut value = |name: &str| {
            it.next()
                .ok_or_else(|| format!("{name} needs a value"))
                .and_then(|v| v.parse::<u32>().map_err(|e| format!("{name} {v:?}: {e}")))
                .and_then(|v| {
                    if v == 0 {
                        Err(format!("{name} must be at least 1"))
                    } else {
                        Ok(v)
                    }
                })
        };
        match a.as_str() {
            "--duration" => args.duration = value("--duration")?,
            "--rounds" => args.rounds = value("--rounds")? as usize,
            "--bpf-stats" => args.bpf_stats = true,
            "--no-pin" => args.pin = false,
            "--nice" => {
                let v = it.next().ok_or("--nice needs a value")?;
                args.nice = v
                    .parse::<i32>()
                    .ok()
                    .filter(|n| (-20..=19).contains(n))
                    .ok_or_else(|| format!("--nice {v:?}: a number from -20 to 19"))?;
            }
            other => {
                return Err(format!(
                    "unknown argument {other:?}: use --duration S --rounds N --nice N --bpf-stats --no-pin"
                ))
            }
        }
    }
    Ok(args)
}

/// One row: its topology and the samples of each round.
struct Row {
    kind: Kind,
    entries: usize,
    topo: Topo,
    gbps: Vec<f64>,
    rr: Vec<f64>,
    conn: Vec<f64>,
    /// `--bpf-stats`: the row's programs (id → name).
    programs: BTreeMap<u32, String>,
    /// `--bpf-stats`: per metric, per program: (invocations, run time ns).
    bpf: [BTreeMap<String, (u64, u64)>; 3],
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// `--bpf-stats`: per eBPF row and metric, each program's invocations per
/// unit (GB, transaction, connection), its ns per invocation, and the share
/// of the measured wall time (`secs`) spent in the programs.
fn print_bpf_stats(rows: &[Row], secs: f64) {
    println!("eBPF programs on the traffic (kernel run-time accounting):");
    for row in rows.iter().filter(|r| !r.programs.is_empty()) {
        for (metric, (name, samples, unit)) in
            [("gbps", &row.gbps, 8.0), ("rr", &row.rr, 1.0), ("conn", &row.conn, 1.0)]
                .into_iter()
                .enumerate()
        {
            // Units moved in the measured time: GB for iperf3 (from the
            // rate), transactions or connections otherwise.
            let units: f64 = samples.iter().sum::<f64>() / samples.len() as f64 * secs / unit;
            let mut total_ns = 0u64;
            let mut parts = Vec::new();
            for (prog, &(n, ns)) in &row.bpf[metric] {
                total_ns += ns;
                parts.push(format!(
                    "{prog} {:.1}/{} at {:.0} ns",
                    n as f64 / units,
                    if metric == 0 { "GB" } else { "op" },
                    ns as f64 / n.max(1) as f64
                ));
            }
            println!(
                "{:>6} {name:>4}: {}; {:.2}% of the wall time in the programs",
                row.entries,
                parts.join(", "),
                total_ns as f64 / (secs * 1e9) * 100.0
            );
        }
    }
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn main() {
    let args = parse_args().unwrap_or_else(|e| {
        eprintln!("bench_traffic: {e}");
        std::process::exit(2);
    });
    let ok = std::process::Command::new("iperf3")
        .arg("--version")
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("bench_traffic: iperf3 not found (apt-get install iperf3)");
        std::process::exit(2);
    }
    if args.nice != 0 {
        // SAFETY: plain syscall on the calling thread (0: itself); the
        // threads and processes started later inherit the value.
        let rc = unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, args.nice) };
        if rc != 0 {
            eprintln!(
                "bench_traffic: setpriority {}: {} (continuing)",
                args.nice,
                std::io::Error::last_os_error()
            );
        }
    }
    topo::sweep_leftovers();
    let pinned = load::pin(args.pin);
    let started = Instant::now();
    println!(
        "traffic bench: {} s per measurement, {} rounds, nice {}, {} cpus, {}, load {}",
        args.duration,
        args.rounds,
        args.nice,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0),
        if pinned {
            "clients on cpu 0, servers on cpu 1"
        } else {
            "not pinned"
        },
        loadavg()
    );

    let mut specs = vec![("none".to_string(), Kind::None, 0)];
    for (kind, tag) in [(Kind::Ebpf, "e"), (Kind::Nft, "f")] {
        specs.extend(SIZES.iter().map(|&n| (format!("{tag}{n}"), kind, n)));
    }
    let mut rows: Vec<Row> = Vec::new();
    for (tag, kind, entries) in specs {
        let t = Instant::now();
        let topo = Topo::new(&tag, kind, entries);
        load::start_servers(&topo.server.name);
        assert!(
            load::connects(&topo.client.name, RR_PORT),
            "{} {entries}: the allowed port does not connect",
            kind.name()
        );
        let denied_connects = load::connects(&topo.client.name, DENIED_PORT);
        assert_eq!(
            denied_connects,
            kind == Kind::None,
            "{} {entries}: a port no entry allows {}",
            kind.name(),
            if denied_connects {
                "connects: the dataplane is not in the path"
            } else {
                "does not connect without a dataplane"
            }
        );
        println!("row {:>8} {entries:>6}: ready in {:?}", kind.name(), t.elapsed());
        let row_pins = topo.pin_dir().map(|p| p.to_path_buf());
        rows.push(Row {
            kind,
            entries,
            topo,
            gbps: Vec::new(),
            rr: Vec::new(),
            conn: Vec::new(),
            programs: match (args.bpf_stats, row_pins) {
                (true, Some(dir)) => stats::linked_programs(&dir),
                _ => BTreeMap::new(),
            },
            bpf: Default::default(),
        });
    }

    let d = Duration::from_secs(args.duration.into());
    let _stats = args.bpf_stats.then(stats::enable);
    println!(
        "{:>5} {:>8} {:>6} {:>10} {:>8}",
        "round", "plane", "policy", "metric", "value"
    );
    let n = rows.len();
    for round in 0..args.rounds {
        // One metric over every row, then the next: the samples compared
        // are seconds apart; the first row moves by one each round.
        for metric in 0..3 {
            for j in 0..n {
                let row = &mut rows[(j + round) % n];
                let client = row.topo.client.name.clone();
                let before = stats::snapshot(&row.programs);
                let (name, value) = match metric {
                    0 => ("gbps", load::iperf(&client, args.duration)),
                    1 => ("rr_per_s", load::rr(&client, d)),
                    _ => ("conn_per_s", load::conn(&client, d)),
                };
                [&mut row.gbps, &mut row.rr, &mut row.conn][metric].push(value);
                for (prog, (n, ns)) in stats::snapshot(&row.programs) {
                    let (n0, ns0) = before.get(&prog).copied().unwrap_or_default();
                    let e = row.bpf[metric].entry(prog).or_default();
                    e.0 += n - n0;
                    e.1 += ns - ns0;
                }
                println!(
                    "{round:>5} {:>8} {:>6} {name:>10} {value:>8.2}",
                    row.kind.name(),
                    row.entries
                );
            }
        }
    }

    // The ratio to "none" of the same round (seconds apart), median over
    // the rounds: less exposed to drift than the ratio of the medians.
    let ratio = |a: &[f64], b: &[f64]| median(&a.iter().zip(b).map(|(x, y)| x / y).collect::<Vec<_>>());
    println!(
        "medians over {} rounds (in brackets: median over the rounds of the ratio to none in the same round):",
        args.rounds
    );
    let mut results = Vec::new();
    for row in &rows {
        let (g, r, c) = (median(&row.gbps), median(&row.rr), median(&row.conn));
        let base = &rows[0];
        let allowed = row
            .topo
            .policy_allowed()
            .map(|n| format!(", {n} packets allowed by policy"))
            .unwrap_or_default();
        println!(
            "{:>8} {:>6}: {g:>6.2} Gbit/s ({:.3}), {r:>7.0} rr/s ({:.3}), {c:>6.0} conn/s ({:.3}){allowed}",
            row.kind.name(),
            row.entries,
            ratio(&row.gbps, &base.gbps),
            ratio(&row.rr, &base.rr),
            ratio(&row.conn, &base.conn)
        );
        results.push(format!(
            r#"{{"dataplane":"{}","policy_entries":{},"gbps":{g:.3},"rr_per_s":{r:.0},"conn_per_s":{c:.0}}}"#,
            row.kind.name(),
            row.entries
        ));
    }
    if args.bpf_stats {
        print_bpf_stats(&rows, args.rounds as f64 * d.as_secs_f64());
    }
    println!("load {} after {:?}", loadavg(), started.elapsed());
    drop(rows);
    println!(r#"{{"bench":"traffic","results":[{}]}}"#, results.join(","));
}
