//! What the agent benchmarks (`bench_agent`, `bench_cnp`) share: real veth
//! pairs handed to local endpoints, their cleanup (also of crashed runs,
//! by the pid in a name), and the percentile of the latency samples.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::Command;

use npm_agent::node::{Resolve, Resolved};
use npm_policy::compiled::Compiled;

// The tests' netns helpers (leftover detection by the pid in a name).
#[allow(dead_code)]
#[path = "../../tests/agent/common/netns.rs"]
mod netns;

/// Hands each local endpoint one of the veth interfaces (stable while the
/// endpoint exists).
pub struct PoolResolver {
    /// Interfaces not handed out.
    pub free: Vec<u32>,
    /// Endpoint id -> ifindex.
    pub assigned: BTreeMap<u32, u32>,
}

impl Resolve for PoolResolver {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        let gone: Vec<u32> = self
            .assigned
            .keys()
            .filter(|id| !compiled.endpoints.contains_key(id))
            .copied()
            .collect();
        for id in gone {
            if let Some(i) = self.assigned.remove(&id) {
                self.free.push(i);
            }
        }
        let mut missing = Vec::new();
        for id in compiled.endpoints.keys() {
            if !self.assigned.contains_key(id) {
                match self.free.pop() {
                    Some(i) => {
                        self.assigned.insert(*id, i);
                    }
                    None => missing.push(*id),
                }
            }
        }
        Resolved {
            interfaces: self.assigned.clone(),
            missing,
        }
    }
}

/// The veth links and the pin directory of this run; removed on drop.
pub struct Kernel {
    /// The host-side veth names.
    pub links: Vec<String>,
    /// The bench agent's bpffs pin directory.
    pub pin_dir: PathBuf,
}

impl Drop for Kernel {
    fn drop(&mut self) {
        delete_links(&self.links);
        let _ = std::fs::remove_dir_all(&self.pin_dir);
    }
}

/// Runs `ip -batch` over `lines`.
pub fn ip_batch(lines: &[String]) -> anyhow::Result<()> {
    use std::io::Write;
    let mut child = Command::new("ip")
        .args(["-force", "-batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()?;
    child
        .stdin
        .take()
        .ok_or_else(|| anyhow::anyhow!("ip -batch: no stdin"))?
        .write_all(lines.join("\n").as_bytes())?;
    let out = child.wait_with_output()?;
    anyhow::ensure!(
        out.status.success(),
        "ip -batch failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}

/// Deletes the links `names` (one batch; errors ignored).
pub fn delete_links(names: &[String]) {
    let lines: Vec<String> = names.iter().map(|n| format!("link delete {n}")).collect();
    if !lines.is_empty() {
        let _ = ip_batch(&lines);
    }
}

/// Removes links and pin directories of earlier runs whose process is gone.
fn clear_leftovers(link_prefix: &str, pin_prefix: &str) {
    let mut stale = Vec::new();
    for entry in std::fs::read_dir("/sys/class/net").into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(link_prefix) && netns::pid_gone(&name, link_prefix) {
            stale.push(name);
        }
    }
    // One `ip -batch` for the (many) stale veths.
    delete_links(&stale);
    netns::clear_stale_dirs("/sys/fs/bpf", pin_prefix);
}

/// Creates `n` veth pairs (up) named `<link_prefix><pid>x<k>` (peers
/// `...y<k>`), after removing leftovers of crashed runs, and returns the
/// guard (pin directory `/sys/fs/bpf/<pin_prefix><pid>`) and their ifindexes.
pub fn setup_kernel(n: usize, link_prefix: &str, pin_prefix: &str) -> anyhow::Result<(Kernel, Vec<u32>)> {
    clear_leftovers(link_prefix, pin_prefix);
    let pid = std::process::id();
    let kernel = Kernel {
        links: (0..n).map(|k| format!("{link_prefix}{pid}x{k}")).collect(),
        pin_dir: PathBuf::from(format!("/sys/fs/bpf/{pin_prefix}{pid}")),
    };
    let mut lines = Vec::new();
    for l in &kernel.links {
        // The peer (`...y<n>`) goes with it when the link is deleted.
        let peer = l.replacen('x', "y", 1);
        lines.push(format!("link add name {l} type veth peer name {peer}"));
        lines.push(format!("link set {l} up"));
        lines.push(format!("link set {peer} up"));
    }
    ip_batch(&lines)?;
    let mut ifindexes = Vec::new();
    for l in &kernel.links {
        let idx = std::fs::read_to_string(format!("/sys/class/net/{l}/ifindex"))?;
        ifindexes.push(idx.trim().parse()?);
    }
    Ok((kernel, ifindexes))
}

/// Nearest-rank percentile `p` (0..=1) of sorted samples (NaN when empty).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}
