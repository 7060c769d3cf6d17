//! Helpers of the nftables dataplane tests: the shared namespace, process
//! and compiled-form helpers of `netns_common`, plus a policy-entry builder
//! that numbers rules itself.
#![allow(dead_code)]

pub use crate::netns_common::*;

pub mod tier_topo;

use std::io::{BufRead, BufReader, Write};
use std::net::Ipv4Addr;
use std::process::{Child, ChildStdout, Command, Stdio};

use npm_policy::compiled::{Compiled, Direction, PolicyEntry};
use npm_policy::model::Protocol;

/// Deletes namespaces named `<prefix><pid>...` whose owning test process is
/// gone (left over by a crashed run).
pub fn clear_leftovers(prefix: &str) {
    clear_netns_leftovers(prefix);
}

/// Adds a policy entry with the next rule id for the subject of endpoint
/// `endpoint` (its pod identity: the entry governs every endpoint of that
/// identity). The endpoint must be in `c` already.
pub fn allow(
    c: &mut Compiled,
    endpoint: u32,
    direction: Direction,
    peer: u32,
    proto: Option<Protocol>,
    ports: (u16, u16),
) {
    let subject = c
        .endpoints
        .get(&endpoint)
        .unwrap_or_else(|| panic!("allow: endpoint {endpoint} is not in the compiled state"))
        .identity;
    let rule = c.policy.len() as u32 + 1;
    c.policy.insert(
        PolicyEntry {
            subject,
            direction,
            peer,
            protocol: proto,
            ports,
        },
        rule,
    );
}

/// Path of the golden file `tests/golden/nft_<name>.<ext>`.
pub fn golden_path(name: &str, ext: &str) -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(format!("nft_{name}.{ext}"))
}

/// Compares `got` with the golden file `nft_<name>.<ext>`;
/// `UPDATE_GOLDEN=1` writes it instead.
pub fn check_golden(name: &str, ext: &str, got: &str) {
    let path = golden_path(name, ext);
    if std::env::var_os("UPDATE_GOLDEN").is_some() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (run with UPDATE_GOLDEN=1 to create it)", path.display()));
    if want != got {
        panic!(
            "{} differs from the output (UPDATE_GOLDEN=1 regenerates it)\n--- want\n{want}\n--- got\n{got}",
            path.display()
        );
    }
}

/// `nft list table` output without handles, the table name `table`
/// replaced by `npm`, element lists joined on one line and sorted (the
/// kernel's iteration order of hash sets is not part of the contract).
pub fn normalise_listing(list: &str, table: &str) -> String {
    let text = list
        .replace(&format!("table inet {table} "), "table inet npm ")
        .replace(&format!("table bridge {table} "), "table bridge npm ");
    let mut lines: Vec<String> = Vec::new();
    let mut pending: Option<String> = None;
    for line in text.lines() {
        let line = line.find(" # handle ").map_or(line, |i| &line[..i]);
        if let Some(p) = pending.as_mut() {
            p.push(' ');
            p.push_str(line.trim());
            if line.trim_end().ends_with('}') {
                lines.push(pending.take().unwrap());
            }
            continue;
        }
        if line.trim_start().starts_with("elements = {") && !line.trim_end().ends_with('}') {
            pending = Some(line.trim_end().to_string());
            continue;
        }
        lines.push(line.to_string());
    }
    let mut out = String::new();
    for line in lines {
        if let (Some(start), true) = (line.find("elements = { "), line.ends_with(" }")) {
            let inner = &line[start + "elements = { ".len()..line.len() - 2];
            let mut items: Vec<&str> = inner.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
            items.sort_unstable();
            out.push_str(&format!("{}elements = {{ {} }}\n", &line[..start], items.join(", ")));
        } else {
            out.push_str(&line);
            out.push('\n');
        }
    }
    out
}

/// The top-level blocks of a normalised listing, sorted (an incrementally
/// updated table lists its objects in creation order), counters' values
/// blanked (they count packets).
pub fn listing_blocks(normalised: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut cur = String::new();
    for line in normalised.lines() {
        if line.starts_with("table ") || line == "}" || line.is_empty() {
            continue;
        }
        if line.trim_start().starts_with("packets ") {
            cur.push_str("\t\tpackets - bytes -\n");
            continue;
        }
        cur.push_str(line);
        cur.push('\n');
        if line == "\t}" {
            out.push(std::mem::take(&mut cur));
        }
    }
    out.sort();
    out
}

/// Adds a ClusterNetworkPolicy tier entry (rule id `1000 * (1 + 2 * tier
/// + direction) + rank`: one rule per tier, direction and rank) and
/// marks the endpoint's [`TierPresence`](npm_policy::compiled::TierPresence).
// The table tests call it with one positional row per entry.
#[allow(clippy::too_many_arguments)]
pub fn tier(
    c: &mut Compiled,
    endpoint: u32,
    direction: Direction,
    tier: npm_policy::compiled::Tier,
    peer: u32,
    proto: Option<Protocol>,
    ports: (u16, u16),
    action: npm_policy::compiled::TierAction,
    rank: u32,
) {
    // Keyed by the endpoint's subject (its pod identity).
    let subject = c.endpoints[&endpoint].identity;
    c.tiers.insert(
        npm_policy::compiled::TierEntry {
            subject,
            direction,
            tier,
            peer,
            protocol: proto,
            ports,
        },
        npm_policy::compiled::TierValue {
            action,
            rank,
            rule: 1000 * (1 + 2 * tier as u32 + direction as u32) + rank,
        },
    );
    if let Some(ep) = c.endpoints.get_mut(&endpoint) {
        ep.tiers.set(tier, direction);
    }
}

/// A client in `ns` with one socket (UDP, or a TCP connection) to
/// `dst`:`port`: each [`SocketFlow::ask`] sends on the same socket (the same
/// flow) and answers whether a reply came within 0.6 s.
pub struct SocketFlow {
    child: Child,
    out: BufReader<ChildStdout>,
}

impl SocketFlow {
    pub fn new(ns: &str, tcp: bool, dst: Ipv4Addr, port: u16) -> SocketFlow {
        let kind = if tcp { "SOCK_STREAM" } else { "SOCK_DGRAM" };
        let code = format!(
            "import socket,sys\n\
             s=socket.socket(socket.AF_INET, socket.{kind}); s.settimeout(0.6)\n\
             try:\n  s.connect(('{dst}',{port}))\nexcept Exception:\n  pass\n\
             for line in sys.stdin:\n\
             \x20 try:\n    s.send(b'q'); s.recv(64); print('ok', flush=True)\n\
             \x20 except Exception:\n    print('FAIL', flush=True)\n"
        );
        let mut child = Command::new("ip")
            .args(["netns", "exec", ns, "python3", "-c", &code])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn python3 client");
        let out = BufReader::new(child.stdout.take().unwrap());
        SocketFlow { child, out }
    }

    pub fn ask(&mut self) -> bool {
        writeln!(self.child.stdin.as_mut().unwrap()).unwrap();
        let mut line = String::new();
        self.out.read_line(&mut line).unwrap();
        line.trim() == "ok"
    }

    /// Asks until a reply came (the first packets may meet a table still
    /// settling), at most 20 times.
    pub fn establish(&mut self) -> bool {
        (0..20).any(|_| self.ask())
    }
}

impl Drop for SocketFlow {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
