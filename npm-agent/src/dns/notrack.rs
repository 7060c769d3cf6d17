//! Detecting DNS traffic that conntrack does not track ([`detect`]):
//! NodeLocal DNSCache (`node-cache`, which kubespray and many managed
//! clusters enable) installs `raw`-table `NOTRACK` rules for port 53 of its
//! link-local address (169.254.20.10 by default) and of the cluster DNS
//! ClusterIP. The capture's rules match a reply by conntrack's original
//! destination, so untracked replies are never read: nothing is learned
//! and every `domainNames` peer denies. This is reported (readiness check
//! `dns-learning`, `npm_dns_notrack`, a warning), never worked around:
//! the fix is in the node's setup (README, "DNS learning").

use std::net::IpAddr;
use std::process::Command;

/// NodeLocal DNSCache's default link-local address.
pub const NODE_LOCAL_DNS: &str = "169.254.20.10";

/// Whether the `iptables-save` rule `line` exempts DNS from conntrack: a
/// `NOTRACK` (or `CT --notrack`) rule that names port 53, NodeLocal
/// DNSCache's address or one of `servers`.
fn untracks_dns(line: &str, servers: &[IpAddr]) -> bool {
    if !line.starts_with("-A ") {
        return false;
    }
    let words: Vec<&str> = line.split_whitespace().collect();
    let notrack = words.windows(2).any(|w| w == ["-j", "NOTRACK"])
        || (words.windows(2).any(|w| w == ["-j", "CT"]) && words.contains(&"--notrack"));
    if !notrack {
        return false;
    }
    let port53 = words
        .windows(2)
        .any(|w| matches!(w[0], "--dport" | "--sport" | "--dports" | "--sports") && w[1].split(',').any(|p| p == "53"));
    let addr = |w: &str| {
        let a = w.split('/').next().unwrap_or(w);
        a == NODE_LOCAL_DNS || a.parse::<IpAddr>().is_ok_and(|a| servers.contains(&a))
    };
    let named = words.windows(2).any(|w| matches!(w[0], "-d" | "-s") && addr(w[1]));
    port53 || named
}

/// The rules of `ruleset` (`iptables-save -t raw` output) that exempt DNS
/// from conntrack (see `untracks_dns`).
pub fn untracked_dns_rules<'a>(ruleset: &'a str, servers: &[IpAddr]) -> Vec<&'a str> {
    ruleset.lines().filter(|l| untracks_dns(l, servers)).collect()
}

/// Why DNS replies to pods cannot be learned on this node, `None` when
/// nothing untracks them: the first NOTRACK rules of the `raw` tables
/// (`iptables-save` and `ip6tables-save`, whichever run) that name DNS.
pub fn detect(servers: &[IpAddr]) -> Option<String> {
    let mut found: Vec<String> = Vec::new();
    for bin in ["iptables-save", "ip6tables-save"] {
        let Ok(out) = Command::new(bin).args(["-t", "raw"]).output() else {
            continue;
        };
        let text = String::from_utf8_lossy(&out.stdout);
        found.extend(untracked_dns_rules(&text, servers).into_iter().map(String::from));
    }
    (!found.is_empty()).then(|| {
        let shown: Vec<&str> = found.iter().take(3).map(String::as_str).collect();
        format!(
            "{} raw-table NOTRACK rule(s) exempt DNS from conntrack (NodeLocal DNSCache?), so no DNS answer to a \
             pod is learned and domainNames peers deny: {}",
            found.len(),
            shown.join("; ")
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_local_dns_rules_are_found_and_others_are_not() {
        let servers: Vec<IpAddr> = vec!["10.96.0.10".parse().unwrap()];
        let save = "\
*raw
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
-A PREROUTING -d 169.254.20.10/32 -p udp -m udp --dport 53 -j NOTRACK
-A OUTPUT -s 10.96.0.10/32 -p tcp -m tcp --sport 8080 -j NOTRACK
-A OUTPUT -p udp -m udp --sport 53 -j CT --notrack
-A PREROUTING -p udp -m udp --dport 53 -j ACCEPT
-A PREROUTING -p tcp -m tcp --dport 5353 -j NOTRACK
-A PREROUTING -p udp -m multiport --dports 80,53 -j CT --notrack
-A PREROUTING -p udp -j CT --zone 1
COMMIT
";
        let found = untracked_dns_rules(save, &servers);
        assert_eq!(
            found,
            [
                "-A PREROUTING -d 169.254.20.10/32 -p udp -m udp --dport 53 -j NOTRACK",
                "-A OUTPUT -s 10.96.0.10/32 -p tcp -m tcp --sport 8080 -j NOTRACK",
                "-A OUTPUT -p udp -m udp --sport 53 -j CT --notrack",
                "-A PREROUTING -p udp -m multiport --dports 80,53 -j CT --notrack",
            ]
        );
        assert!(untracked_dns_rules("*raw\nCOMMIT\n", &servers).is_empty());
    }
}
