//! `npm-agent inspect`: what the eBPF dataplane of this node has pinned
//! (endpoints, ipcache, CIDR prefixes, policy entries, conntrack size and
//! counters), read through the loader's read-only dump
//! ([`npm_dataplane::ebpf::dump_pinned`]): no program is loaded, no link
//! is touched, so an inspection never changes enforcement.

use std::fmt::Write as _;
use std::path::PathBuf;

use npm_dataplane::ebpf::{default_pin_dir, dump_pinned, EbpfDump};

/// Errors of `inspect`.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// Nothing is pinned at the pin directory (no agent ran on this node).
    #[error("no pinned npm maps under {dir}: is an agent running with this --pin-dir?")]
    NothingPinned {
        /// The directory looked at.
        dir: PathBuf,
    },
    /// The pinned maps could not be read.
    #[error("reading the pinned maps under {dir}: {detail}")]
    Read {
        /// Pin directory.
        dir: PathBuf,
        /// What went wrong.
        detail: String,
    },
    /// JSON encoding failed.
    #[error("encoding the dump as JSON: {0}")]
    Json(#[from] serde_json::Error),
}

/// Read the dump of the maps pinned under `pin_dir` (default: the
/// loader's), read-only.
pub fn dump(pin_dir: Option<PathBuf>) -> Result<EbpfDump, InspectError> {
    let dir = pin_dir.unwrap_or_else(default_pin_dir);
    if !dir.join(npm_common::maps::ENDPOINTS).exists() {
        return Err(InspectError::NothingPinned { dir });
    }
    dump_pinned(&dir).map_err(|e| InspectError::Read {
        dir,
        detail: e.to_string(),
    })
}

/// Human-readable rendering of a dump.
pub fn render_text(d: &EbpfDump) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "pin dir: {}", d.pin_dir.display());
    let _ = writeln!(s, "endpoints ({}):", d.endpoints.len());
    for e in &d.endpoints {
        let _ = writeln!(
            s,
            "  ifindex {:>5}  id {:>6}  subject {:>8}  flags {:#06x}  ipv4 {}  ipv6 {}  attached [{}]",
            e.ifindex,
            e.id,
            e.subject,
            e.flags,
            e.ipv4.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
            e.ipv6.map(|a| a.to_string()).unwrap_or_else(|| "-".into()),
            e.attached.join(",")
        );
    }
    let _ = writeln!(s, "ipcache ({}):", d.ipcache.len());
    for e in &d.ipcache {
        let _ = writeln!(
            s,
            "  {:<40} identity {:>8}  cidr {}",
            e.addr, e.identity, e.cidr_identity
        );
    }
    let _ = writeln!(s, "cidrs ({}):", d.cidrs.len());
    for c in &d.cidrs {
        let _ = writeln!(s, "  {:<43} identity {}", c.prefix, c.identity);
    }
    let _ = writeln!(s, "policy ({}):", d.policy.len());
    for p in &d.policy {
        let proto = p.protocol.map(|p| p.to_string()).unwrap_or_else(|| "any".into());
        let _ = writeln!(
            s,
            "  subject {:>8} {:<7} peer {:>8} proto {:<3} ports {}-{}  rule {}",
            p.subject, p.direction, p.peer, proto, p.ports.0, p.ports.1, p.rule
        );
    }
    let _ = writeln!(s, "conntrack entries: {}", d.ct_entries);
    let _ = writeln!(s, "fragment records: {}", d.frag_entries);
    let _ = writeln!(s, "counters:");
    for c in &d.counters {
        let _ = writeln!(
            s,
            "  {:<7} {:<16} packets {:>12} bytes {:>14}",
            c.direction, c.reason, c.packets, c.bytes
        );
    }
    s
}

/// `npm-agent inspect`: print the dump (text, or JSON with `json`).
pub fn run(pin_dir: Option<PathBuf>, json: bool) -> Result<(), InspectError> {
    let d = dump(pin_dir)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&d)?);
    } else {
        print!("{}", render_text(&d));
    }
    Ok(())
}
