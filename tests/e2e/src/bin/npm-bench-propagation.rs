//! `npm-bench-propagation`: how long a new remote pod address takes to be
//! known on another node, from the API write to node 1's kernel state, on
//! the multi-node live cluster (three nodes, one real agent each).
//!
//! ```text
//! npm-bench-propagation [--dataplane ebpf|nftables] [--samples N]
//!                       [--warmup N] [--agent-bin PATH] [--nodes N]
//! ```
//! Setup: a NetworkPolicy on `x/a` (node 1) admits pods labelled
//! `npm-bench: propagation` from every namespace, so that on the nftables
//! dataplane their addresses are members of an identity set on node 1 (on
//! eBPF, `NPM_IPCACHE` holds every pod address in any case).
//!
//! One sample: a Pod `y/bench-<i>` scheduled on node 2 is created without
//! an IP (as the kubelet does before CNI ADD); then, at `t0`, its status is
//! written with a fresh IPv4 and IPv6 address (the kubelet's status write).
//! The sample is the time from `t0` until both addresses are in node 1's
//! kernel state: the pinned `NPM_IPCACHE` of node 1's agent (looked up with
//! the `bpf(2)` syscall, every 2 ms) or an element of a set of node 1's
//! nftables table (`nft -j list table`, in node 1's netns, back to back).
//! Then the Pod is deleted and the time until both addresses are gone is
//! the removal sample. A sample that does not complete in 15 s fails the
//! bench: there is no partial result.
//!
//! Ends with one JSON line: `{"bench":"propagation",...}` with p50, p99,
//! min, max and mean in milliseconds of both, and the mean cost of one
//! poll round (the resolution of the figures).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::Parser;
use npm_e2e::api::{pod_object, pod_path};
use npm_e2e::runner::{Engine, LiveRunner, Options};
use serde_json::{json, Value};

/// Measures remote-address propagation between nodes.
#[derive(Debug, Parser)]
#[command(name = "npm-bench-propagation")]
struct Cli {
    /// ebpf or nftables.
    #[arg(long, default_value = "ebpf")]
    dataplane: String,
    /// Measured samples (at most 150: one fresh address each).
    #[arg(long, default_value_t = 50)]
    samples: usize,
    /// Samples taken first and not counted.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// The agent binary.
    #[arg(long, default_value = "target/debug/npm-agent")]
    agent_bin: PathBuf,
    /// Nodes of the cluster (at least 2).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
}

/// Longest wait for one address change to reach node 1.
const SAMPLE_TIMEOUT: Duration = Duration::from_secs(15);
/// The label the bench pods carry and the policy on `x/a` selects.
const BENCH_LABEL: &str = "npm-bench";

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(line) => {
            println!("{line}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("npm-bench-propagation: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Node 1's kernel state, asked whether an address is in it.
enum Probe {
    /// The pinned `NPM_IPCACHE` of node 1's agent.
    Ebpf(BpfMap),
    /// Node 1's nftables table, listed in node 1's netns.
    Nft { netns: String, table: String },
}

impl Probe {
    /// Which of `addrs` are present.
    fn present(&self, addrs: &[IpAddr]) -> Result<Vec<bool>, String> {
        match self {
            Probe::Ebpf(map) => addrs.iter().map(|a| map.contains(&ip_key(*a))).collect(),
            Probe::Nft { netns, table } => {
                let out = std::process::Command::new("ip")
                    .args(["netns", "exec", netns, "nft", "-j", "list", "table", "inet", table])
                    .output()
                    .map_err(|e| format!("nft in {netns}: {e}"))?;
                if !out.status.success() {
                    return Err(format!(
                        "nft list table inet {table} in {netns}: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ));
                }
                let v: Value = serde_json::from_slice(&out.stdout).map_err(|e| format!("nft -j output: {e}"))?;
                let mut elems = Vec::new();
                for obj in v["nftables"].as_array().into_iter().flatten() {
                    if let Some(e) = obj["set"]["elem"].as_array() {
                        elems.extend(e.iter().filter_map(Value::as_str).map(str::to_string));
                    }
                }
                Ok(addrs
                    .iter()
                    .map(|a| elems.iter().any(|e| *e == a.to_string()))
                    .collect())
            }
        }
    }
}

/// The 16-byte `NPM_IPCACHE` key of an address (IPv4-mapped for IPv4).
fn ip_key(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
        IpAddr::V6(v6) => v6.octets(),
    }
}

/// A pinned BPF map opened with `BPF_OBJ_GET`, looked up with
/// `BPF_MAP_LOOKUP_ELEM` (keys of 16 bytes, values of 8: `IpKey`/`IpInfo`).
struct BpfMap {
    fd: i32,
    path: PathBuf,
}

impl BpfMap {
    const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
    const BPF_OBJ_GET: libc::c_long = 7;

    fn open(path: &Path) -> Result<Self, String> {
        let c = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // union bpf_attr for BPF_OBJ_GET: pathname (u64) at 0, bpf_fd and
        // file_flags (u32) at 8 and 12; the rest zero.
        let mut attr = [0u64; 16];
        attr[0] = c.as_ptr() as u64;
        // SAFETY: `attr` outlives the call and is as large as the kernel
        // reads (it zero-checks the tail up to the size given).
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                Self::BPF_OBJ_GET,
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr) as u32,
            )
        };
        if fd < 0 {
            return Err(format!(
                "BPF_OBJ_GET {}: {}",
                path.display(),
                std::io::Error::last_os_error()
            ));
        }
        Ok(BpfMap {
            fd: fd as i32,
            path: path.to_path_buf(),
        })
    }

    fn contains(&self, key: &[u8; 16]) -> Result<bool, String> {
        let mut value = [0u8; 8];
        // union bpf_attr for BPF_MAP_LOOKUP_ELEM: map_fd (u32) at 0, key
        // and value pointers (u64) at 8 and 16, flags at 24.
        let mut attr = [0u64; 16];
        attr[0] = self.fd as u64;
        attr[1] = key.as_ptr() as u64;
        attr[2] = value.as_mut_ptr() as u64;
        // SAFETY: key and value are the map's key and value sizes and live
        // across the call.
        let r = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                Self::BPF_MAP_LOOKUP_ELEM,
                attr.as_mut_ptr(),
                std::mem::size_of_val(&attr) as u32,
            )
        };
        if r == 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::ENOENT) {
            Ok(false)
        } else {
            Err(format!("lookup in {}: {e}", self.path.display()))
        }
    }
}

impl Drop for BpfMap {
    fn drop(&mut self) {
        // SAFETY: our own fd, closed once.
        unsafe { libc::close(self.fd) };
    }
}

/// Polls until every address is present (`want`) or absent; returns the
/// time since `t0` and the number of polls.
fn wait_for(
    probe: &Probe,
    addrs: &[IpAddr],
    want: bool,
    t0: Instant,
    gap: Duration,
) -> Result<(Duration, u32), String> {
    let mut polls = 0;
    loop {
        let got = probe.present(addrs)?;
        polls += 1;
        if got.iter().all(|p| *p == want) {
            return Ok((t0.elapsed(), polls));
        }
        if t0.elapsed() > SAMPLE_TIMEOUT {
            return Err(format!(
                "{addrs:?} still {} on node 1 after {SAMPLE_TIMEOUT:?}",
                if want { "absent" } else { "present" }
            ));
        }
        std::thread::sleep(gap);
    }
}

/// Nearest-rank summary in milliseconds.
fn summary(samples: &[Duration]) -> Value {
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let rank = |p: f64| ms[((p * ms.len() as f64).ceil() as usize).clamp(1, ms.len()) - 1];
    let round = |v: f64| (v * 10.0).round() / 10.0;
    json!({
        "p50": round(rank(0.50)),
        "p99": round(rank(0.99)),
        "min": round(ms[0]),
        "max": round(ms[ms.len() - 1]),
        "mean": round(ms.iter().sum::<f64>() / ms.len() as f64),
    })
}

fn run(cli: &Cli) -> Result<String, String> {
    let engine = match cli.dataplane.as_str() {
        "ebpf" => Engine::Ebpf,
        "nftables" => Engine::Nftables,
        other => return Err(format!("--dataplane {other:?}: use ebpf or nftables")),
    };
    let total = cli.samples + cli.warmup;
    if cli.samples == 0 || total > 150 {
        return Err(format!(
            "--samples {} --warmup {}: between 1 and 150 in all",
            cli.samples, cli.warmup
        ));
    }
    if cli.nodes < 2 {
        return Err("--nodes: at least 2".into());
    }
    let opts = Options {
        engine,
        agent_bin: cli.agent_bin.clone(),
        nodes: cli.nodes,
        ..Options::default()
    };
    let started = Instant::now();
    let mut r = LiveRunner::start(opts).map_err(|e| format!("start {} nodes: {e}", cli.nodes))?;
    eprintln!("cluster of {} nodes up in {:?}", cli.nodes, started.elapsed());
    let result = measure(&mut r, cli, engine, total);
    let _ = r.api().delete_all_policies();
    r.shutdown().map_err(|e| format!("shutdown: {e}"))?;
    result
}

fn measure(r: &mut LiveRunner, cli: &Cli, engine: Engine, total: usize) -> Result<String, String> {
    let pid = std::process::id();
    let xa = r.cluster().pod("x", "a").ok_or("no pod x/a")?;
    let yb = r.cluster().pod("y", "b").ok_or("no pod y/b")?;
    let (node1, node2) = (xa.node.clone().unwrap_or_default(), yb.node.clone().unwrap_or_default());
    if node1 != "node-1" || node2 == node1 {
        return Err(format!(
            "x/a is on {node1:?} and y/b on {node2:?}: want node-1 and another node"
        ));
    }
    let (base4, base6) = (yb.ipv4.octets(), yb.ipv6.segments());
    let probe = match engine {
        Engine::Ebpf => {
            let pin = PathBuf::from(format!("/sys/fs/bpf/npm-conformance-{pid}-n1/NPM_IPCACHE"));
            Probe::Ebpf(BpfMap::open(&pin)?)
        }
        _ => Probe::Nft {
            netns: r
                .cluster()
                .nodes()
                .and_then(|n| n.node(1))
                .map(|n| n.netns.clone())
                .ok_or("no node 1")?,
            table: format!("npmconf{pid}n1"),
        },
    };
    let gap = match probe {
        Probe::Ebpf(_) => Duration::from_millis(2),
        Probe::Nft { .. } => Duration::ZERO,
    };
    let policy = json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"namespace": "x", "name": "bench-propagation"},
        "spec": {
            "podSelector": {"matchLabels": {"pod": "a"}},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {BENCH_LABEL: "propagation"}}}]}],
        },
    });
    r.api()
        .apply_policy(&policy, false)
        .map_err(|e| format!("policy: {e}"))?;
    std::thread::sleep(Duration::from_secs(2));
    let labels = [(BENCH_LABEL.to_string(), "propagation".to_string())].into();
    let (mut add, mut remove) = (Vec::new(), Vec::new());
    let (mut polls, mut poll_time) = (0u32, Duration::ZERO);
    for i in 0..total {
        let name = format!("bench-{i}");
        let v4 = Ipv4Addr::new(base4[0], base4[1], base4[2], 100 + i as u8);
        let mut seg = base6;
        seg[7] = 0x1000 + i as u16;
        let v6 = Ipv6Addr::from(seg);
        let addrs = [IpAddr::V4(v4), IpAddr::V6(v6)];
        if probe.present(&addrs)?.iter().any(|p| *p) {
            return Err(format!("{addrs:?} already on node 1 before sample {i}"));
        }
        // Scheduled on node 2, no IP yet.
        let mut obj = pod_object("y", &name, &labels, &node2, &[]);
        obj["status"] = json!({"phase": "Pending"});
        r.api()
            .create("/api/v1/namespaces/y/pods", &obj)
            .map_err(|e| format!("create y/{name}: {e}"))?;
        // Vary the phase against the agents' debounce and resyncs.
        std::thread::sleep(Duration::from_millis(150 + (i as u64 * 37) % 250));
        let path = pod_path("y", &name);
        let status = json!({"status": {
            "phase": "Running",
            "podIP": v4.to_string(),
            "podIPs": [{"ip": v4.to_string()}, {"ip": v6.to_string()}],
        }});
        let t0 = Instant::now();
        r.api()
            .merge_patch(&format!("{path}/status"), &status)
            .map_err(|e| format!("status of y/{name}: {e}"))?;
        let (took, n) = wait_for(&probe, &addrs, true, t0, gap)?;
        polls += n;
        poll_time += took;
        std::thread::sleep(Duration::from_millis(100 + (i as u64 * 53) % 200));
        let t1 = Instant::now();
        r.api().delete(&path).map_err(|e| format!("delete y/{name}: {e}"))?;
        let (gone, n) = wait_for(&probe, &addrs, false, t1, gap)?;
        polls += n;
        poll_time += gone;
        if i >= cli.warmup {
            add.push(took);
            remove.push(gone);
        }
        eprintln!("sample {i}: known after {took:?}, gone after {gone:?}");
    }
    let rest = json!({
        "dataplane": cli.dataplane,
        "nodes": cli.nodes,
        "samples": cli.samples,
        "warmup": cli.warmup,
        "agent_bin": cli.agent_bin.display().to_string(),
        "state": match probe { Probe::Ebpf(_) => "NPM_IPCACHE", Probe::Nft { .. } => "nft set element" },
        "add_ms": summary(&add),
        "remove_ms": summary(&remove),
        "poll_interval_ms": ((poll_time.as_secs_f64() * 1e3 / polls.max(1) as f64) * 100.0).round() / 100.0,
    });
    // `bench` first, as every bench line starts (serde_json sorts keys).
    let mut line = String::from(r#"{"bench":"propagation""#);
    for (k, v) in rest.as_object().into_iter().flatten() {
        line.push_str(&format!(",{}:{v}", Value::String(k.clone())));
    }
    line.push('}');
    Ok(line)
}
