//! The host the demo runs on: its prerequisites, other processes running
//! a netns cluster (the demo waits for them), and what crashed earlier runs
//! left behind.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::runner::Engine;

use super::{
    stop_requested, writeln_flush, DemoError, DemoOptions, FIRST_EXAMPLE, NFT_TABLE_PREFIX, PIN_DIR_PREFIX,
    SECOND_EXAMPLE,
};

/// Pids of other live processes that own a netns cluster (netns names
/// `npmc<hex pid><letter>-...`). The model's pods have fixed addresses, so
/// two clusters at once steal each other's host routes.
pub fn other_live_clusters() -> Vec<u32> {
    let me = std::process::id();
    let Ok(list) = crate::netns::ip(&["netns", "list"]) else {
        return vec![];
    };
    let mut pids: Vec<u32> = list
        .lines()
        .filter_map(|l| {
            let rest = l.split_whitespace().next()?.strip_prefix(crate::cluster::NAME_PREFIX)?;
            let hex: String = rest.chars().take_while(|c| c.is_ascii_hexdigit()).collect();
            if hex.is_empty() || hex.len() == rest.len() {
                return None;
            }
            u32::from_str_radix(&hex, 16).ok()
        })
        .filter(|&p| p != me && pid_alive(p))
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Waits (up to `max`) until no other process runs a netns cluster.
pub(super) fn wait_exclusive(max: Duration, out: &mut dyn Write) -> Result<(), DemoError> {
    let end = Instant::now() + max;
    let mut said = false;
    loop {
        let others = other_live_clusters();
        if others.is_empty() {
            return Ok(());
        }
        if stop_requested() {
            return Err(DemoError::Interrupted("the wait for other clusters"));
        }
        if Instant::now() >= end {
            return Err(DemoError::Prerequisite(format!(
                "another netns cluster is running (pids {others:?}); its pods use the same addresses"
            )));
        }
        if !said {
            writeln_flush(
                out,
                &format!("npm-demo: waiting for the netns cluster of pids {others:?} to finish (same pod addresses)"),
            );
            said = true;
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn pid_alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Removes what a crashed earlier demo (or conformance) run left behind:
/// netns and veths of the cluster prefix (done by `Cluster::new`), pin
/// directories `/sys/fs/bpf/npm-conformance-<pid>`, scratch directories
/// `<tmp>/npm-conformance-<pid>` and nftables tables `npmconf<pid>` whose
/// process is gone. Returns what was removed.
pub fn clear_leftovers() -> Vec<String> {
    let mut removed = Vec::new();
    crate::cluster::clear_leftovers();
    for dir in [PathBuf::from("/sys/fs/bpf"), std::env::temp_dir()] {
        let Ok(rd) = std::fs::read_dir(&dir) else { continue };
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            let Some(pid) = name.strip_prefix(PIN_DIR_PREFIX).and_then(|p| p.parse::<u32>().ok()) else {
                continue;
            };
            if !pid_alive(pid) && std::fs::remove_dir_all(e.path()).is_ok() {
                removed.push(e.path().display().to_string());
            }
        }
    }
    if let Ok(out) = Command::new("nft")
        .args(["list", "tables"])
        .stderr(Stdio::null())
        .output()
    {
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            // "table inet npmconf1234"
            let parts: Vec<&str> = line.split_whitespace().collect();
            if let [_, fam, name] = parts[..] {
                if let Some(pid) = name.strip_prefix(NFT_TABLE_PREFIX).and_then(|p| p.parse::<u32>().ok()) {
                    if !pid_alive(pid)
                        && Command::new("nft")
                            .args(["delete", "table", fam, name])
                            .stderr(Stdio::null())
                            .status()
                            .is_ok_and(|s| s.success())
                    {
                        removed.push(format!("nft table {fam} {name}"));
                    }
                }
            }
        }
    }
    removed
}

pub(super) fn check_prerequisites(opts: &DemoOptions) -> Result<(), DemoError> {
    if !opts.agent_bin.is_file() {
        return Err(DemoError::Prerequisite(format!(
            "agent binary {} (build it: cargo build --bin npm-agent)",
            opts.agent_bin.display()
        )));
    }
    if opts.engine == Engine::Ebpf {
        match std::env::var_os("NPM_EBPF_OBJECT") {
            Some(o) if Path::new(&o).is_file() => {}
            Some(o) => {
                return Err(DemoError::Prerequisite(format!(
                    "BPF object {} (NPM_EBPF_OBJECT) does not exist (build it: cargo xtask build-ebpf, or use --dataplane nftables)",
                    Path::new(&o).display()
                )))
            }
            None => {
                return Err(DemoError::Prerequisite(
                    "NPM_EBPF_OBJECT is not set (run through `cargo xtask demo`, or use --dataplane nftables)".into(),
                ))
            }
        }
    }
    if opts.engine == Engine::Simulate {
        return Err(DemoError::Option {
            option: "--dataplane",
            message: "the demo needs a real dataplane: ebpf or nftables".into(),
        });
    }
    for f in [FIRST_EXAMPLE, SECOND_EXAMPLE] {
        if !opts.examples.join(f).is_file() {
            return Err(DemoError::Prerequisite(format!(
                "example {}",
                opts.examples.join(f).display()
            )));
        }
    }
    Ok(())
}
