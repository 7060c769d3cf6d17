//! Helpers shared by the nftables dataplane tests: network namespaces with
//! Drop-guard cleanup and builders of hand-made compiled policies.
#![allow(dead_code)]

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::Command;

use npm_policy::compiled::{Compiled, Direction, Endpoint, IpEntry, PodRef, PolicyEntry};
use npm_policy::model::Protocol;

/// Runs a command, panicking with its output if it fails.
pub fn sh(args: &[&str]) -> String {
    let out = Command::new(args[0])
        .args(&args[1..])
        .output()
        .unwrap_or_else(|e| panic!("{args:?}: {e}"));
    assert!(
        out.status.success(),
        "{args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs a command in a namespace, panicking if it fails.
pub fn ns_sh(ns: &str, args: &[&str]) -> String {
    let mut full = vec!["ip", "netns", "exec", ns];
    full.extend_from_slice(args);
    sh(&full)
}

/// Deletes namespaces named `<prefix>*` whose owning test process is gone
/// (left over by a crashed run). Names look like `<prefix><pid>...`.
pub fn clear_leftovers(prefix: &str) {
    let list = sh(&["ip", "netns", "list"]);
    for line in list.lines() {
        let name = line.split_whitespace().next().unwrap_or("");
        let Some(rest) = name.strip_prefix(prefix) else {
            continue;
        };
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let alive = digits
            .parse::<u32>()
            .map(|pid| std::path::Path::new(&format!("/proc/{pid}")).exists())
            .unwrap_or(false);
        if !alive {
            let _ = Command::new("ip").args(["netns", "del", name]).status();
        }
    }
}

/// A network namespace deleted on drop (also on panic).
pub struct Netns {
    /// Its name under /run/netns.
    pub name: String,
}

impl Netns {
    /// Creates `name` (deleting a stale one of the same name first).
    pub fn new(name: &str) -> Netns {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        sh(&["ip", "netns", "add", name]);
        ns_sh(name, &["ip", "link", "set", "lo", "up"]);
        Netns { name: name.to_string() }
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.name]).output();
    }
}

/// An endpoint for a hand-built compiled form.
pub fn endpoint(name: &str, identity: u32, v4: Option<&str>, v6: Option<&str>, ing: bool, eg: bool) -> Endpoint {
    Endpoint {
        pod: PodRef {
            namespace: "default".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        },
        identity,
        ipv4: v4.map(|a| a.parse::<Ipv4Addr>().unwrap()),
        ipv6: v6.map(|a| a.parse::<Ipv6Addr>().unwrap()),
        isolated_ingress: ing,
        isolated_egress: eg,
    }
}

/// Adds an ipcache entry.
pub fn ip(c: &mut Compiled, addr: &str, identity: u32, cidr_identity: u32) {
    c.ipcache.insert(
        addr.parse::<IpAddr>().unwrap(),
        IpEntry {
            identity,
            cidr_identity,
        },
    );
}

/// Adds a policy entry with the next rule id.
pub fn allow(
    c: &mut Compiled,
    endpoint: u32,
    direction: Direction,
    peer: u32,
    proto: Option<Protocol>,
    ports: (u16, u16),
) {
    let rule = c.policy.len() as u32 + 1;
    c.policy.insert(
        PolicyEntry {
            endpoint,
            direction,
            peer,
            protocol: proto,
            ports,
        },
        rule,
    );
}
