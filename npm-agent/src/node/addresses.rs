//! This node's own addresses: identity HOST in the compiled policy.

use std::net::IpAddr;

/// This node's own addresses (global scope, every interface): identity
/// HOST in the compiled policy.
pub fn local_addresses() -> Vec<IpAddr> {
    let Ok(out) = std::process::Command::new("ip").args(["-j", "addr", "show"]).output() else {
        return Vec::new();
    };
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(&out.stdout) else {
        return Vec::new();
    };
    let mut ips = Vec::new();
    for link in v.as_array().into_iter().flatten() {
        for a in link.get("addr_info").and_then(|a| a.as_array()).into_iter().flatten() {
            if a.get("scope").and_then(|s| s.as_str()) != Some("global") {
                continue;
            }
            if let Some(ip) = a.get("local").and_then(|l| l.as_str()).and_then(|l| l.parse().ok()) {
                ips.push(ip);
            }
        }
    }
    ips.sort();
    ips.dedup();
    ips
}
