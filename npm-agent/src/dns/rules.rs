//! The iptables rules of the DNS capture: in table `mangle`, chain
//! `POSTROUTING` jumps to a chain of ours ([`chain_name`]) that sends every
//! UDP reply of a connection a pod opened to a trusted server's port 53
//! (conntrack's original destination: the address the pod asked, a
//! Service ClusterIP included) to the queue. Installed at start,
//! checked every few seconds and re-installed when a firewall reload
//! (firewalld, `iptables-restore` without `--noflush`, a node script)
//! removed them ([`rules_present`]), removed on stop ([`remove_rules`]).
//!
//! Every command waits for the xtables lock (`-w 5`): the chart mounts the
//! host's `/run/xtables.lock`, so that this agent and kube-proxy's
//! `iptables-restore` never write the legacy tables at once.
//!
//! Why iptables: the nftables `queue` statement needs `nft_queue`, which
//! kernels do not all have (this project's CI kernel has none), while the
//! `NFQUEUE` target of iptables (`xt_NFQUEUE`, also through iptables-nft)
//! is on every Kubernetes node kube-proxy runs on.

use std::net::IpAddr;
use std::process::Command;

/// Errors of the rules.
#[derive(Debug, thiserror::Error)]
pub enum RulesError {
    /// An iptables command failed.
    #[error("{cmd}: {message}")]
    Rule {
        /// The command line.
        cmd: String,
        /// Its error output, or why it could not run.
        message: String,
    },
}

/// The prefix of the chains of the DNS learning (`NPM-DNS-<queue>`).
pub const CHAIN_PREFIX: &str = "NPM-DNS-";

/// The chain of queue `queue` (in `mangle` of iptables and ip6tables).
pub fn chain_name(queue: u16) -> String {
    format!("{CHAIN_PREFIX}{queue}")
}

/// Runs `bin` (iptables or ip6tables) with the xtables lock waited for.
fn run(bin: &str, args: &[&str]) -> Result<(), RulesError> {
    let mut all = vec!["-w", "5", "-t", "mangle"];
    all.extend_from_slice(args);
    let cmd = format!("{bin} {}", all.join(" "));
    let out = Command::new(bin).args(&all).output().map_err(|e| RulesError::Rule {
        cmd: cmd.clone(),
        message: e.to_string(),
    })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(RulesError::Rule {
            cmd,
            message: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

/// Removes the rules of queue `queue` (the jump, then the chain), in both
/// families; what is not there is no error.
pub fn remove_rules(queue: u16) {
    let chain = chain_name(queue);
    for bin in ["iptables", "ip6tables"] {
        while run(bin, &["-D", "POSTROUTING", "-j", &chain]).is_ok() {}
        let _ = run(bin, &["-F", &chain]);
        let _ = run(bin, &["-X", &chain]);
    }
}

/// The rules of `servers` on queue `queue`: per family binary, the
/// arguments of each rule of our chain after `-A <chain>` / `-C <chain>`.
fn chain_rules(servers: &[IpAddr], queue: u16) -> Vec<(&'static str, Vec<Vec<String>>)> {
    let mut out = Vec::new();
    for (bin, v6) in [("iptables", false), ("ip6tables", true)] {
        let rules: Vec<Vec<String>> = (servers.iter().filter(|s| s.is_ipv6() == v6))
            .map(|s| {
                [
                    "-p",
                    "udp",
                    "-m",
                    "conntrack",
                    "--ctdir",
                    "REPLY",
                    "--ctorigdst",
                    &s.to_string(),
                    "--ctorigdstport",
                    "53",
                    "-j",
                    "NFQUEUE",
                    "--queue-num",
                    &queue.to_string(),
                    "--queue-bypass",
                ]
                .map(String::from)
                .to_vec()
            })
            .collect();
        if !rules.is_empty() {
            out.push((bin, rules));
        }
    }
    out
}

/// Installs the rules of `servers` on queue `queue` (after removing any left
/// by an earlier run).
pub fn install_rules(servers: &[IpAddr], queue: u16) -> Result<(), RulesError> {
    remove_rules(queue);
    let chain = chain_name(queue);
    for (bin, rules) in chain_rules(servers, queue) {
        run(bin, &["-N", &chain])?;
        for rule in &rules {
            let mut args = vec!["-A", chain.as_str()];
            args.extend(rule.iter().map(String::as_str));
            run(bin, &args)?;
        }
        run(bin, &["-I", "POSTROUTING", "-j", &chain])?;
    }
    Ok(())
}

/// Whether every rule of `servers` on queue `queue` is in place (the jump
/// from `POSTROUTING` and each rule of the chain), checked with `-C`.
pub fn rules_present(servers: &[IpAddr], queue: u16) -> bool {
    let chain = chain_name(queue);
    chain_rules(servers, queue).into_iter().all(|(bin, rules)| {
        run(bin, &["-C", "POSTROUTING", "-j", &chain]).is_ok()
            && rules.iter().all(|rule| {
                let mut args = vec!["-C", chain.as_str()];
                args.extend(rule.iter().map(String::as_str));
                run(bin, &args).is_ok()
            })
    })
}
