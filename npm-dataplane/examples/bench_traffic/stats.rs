//! `--bpf-stats`: the kernel's own run-time accounting of the attached
//! programs (`BPF_ENABLE_STATS`, held while the process runs): per eBPF
//! row, the invocations and nanoseconds per invocation of the programs its
//! pinned links run, on the real traffic of the benchmark. The accounting
//! itself adds two clock reads per invocation, so it is off by default.

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::path::Path;

use aya::programs::links::{FdLink, PinnedLink};

/// Turns the accounting on for as long as the returned descriptor lives.
pub fn enable() -> OwnedFd {
    aya::sys::enable_stats(aya::sys::Stats::RunTime).unwrap_or_else(|e| panic!("BPF_ENABLE_STATS: {e}"))
}

/// Program id → program name of the links pinned under `dir` (any depth
/// below a `links` directory).
pub fn linked_programs(dir: &Path) -> BTreeMap<u32, String> {
    let mut ids = BTreeMap::new();
    let mut stack = vec![(dir.to_path_buf(), false)];
    while let Some((d, in_links)) = stack.pop() {
        let Ok(rd) = std::fs::read_dir(&d) else { continue };
        for e in rd.flatten() {
            let path = e.path();
            let links = in_links || e.file_name() == "links";
            if path.is_dir() {
                stack.push((path, links));
            } else if in_links {
                if let Ok(link) = PinnedLink::from_pin(&path) {
                    if let Ok(info) = FdLink::from(link).info() {
                        ids.insert(info.program_id(), String::new());
                    }
                }
            }
        }
    }
    for info in aya::programs::loaded_programs().flatten() {
        if let Some(name) = ids.get_mut(&info.id()) {
            *name = info.name_as_str().unwrap_or("?").to_string();
        }
    }
    ids
}

/// (invocations, total run time in ns) of each program, by name.
pub fn snapshot(programs: &BTreeMap<u32, String>) -> BTreeMap<String, (u64, u64)> {
    let mut out: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for info in aya::programs::loaded_programs().flatten() {
        if let Some(name) = programs.get(&info.id()) {
            let e = out.entry(name.clone()).or_default();
            e.0 += info.run_count();
            e.1 += info.run_time().as_nanos() as u64;
        }
    }
    out
}
