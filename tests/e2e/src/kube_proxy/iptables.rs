//! kube-proxy's iptables mode: the `nat` and `filter` chains kube-proxy owns (KUBE-SERVICES,
//! KUBE-SVC-*, KUBE-SEP-*, KUBE-EXT-*, KUBE-SVL-*, KUBE-NODEPORTS, KUBE-MARK-MASQ,
//! KUBE-POSTROUTING, filter KUBE-SERVICES / KUBE-EXTERNAL-SERVICES) rendered as one
//! `iptables-restore --noflush` input, as kube-proxy writes it: every owned chain is declared
//! (which flushes it) and rewritten, stale service chains are deleted, other chains of the
//! tables are left alone. The jumps from PREROUTING, OUTPUT, POSTROUTING, INPUT and FORWARD
//! are ensured separately (`-C`, then `-I`), as kube-proxy's `EnsureRule` does.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use super::model::{chain_hash, Endpoint, ServicePort};

/// The hook rules: (table, built-in chain, rule spec).
pub const HOOKS: [(&str, &str, &str); 6] = [
    ("nat", "PREROUTING", "-m comment --comment kubernetes-service-portals -j KUBE-SERVICES"),
    ("nat", "OUTPUT", "-m comment --comment kubernetes-service-portals -j KUBE-SERVICES"),
    ("nat", "POSTROUTING", "-m comment --comment kubernetes-postrouting-rules -j KUBE-POSTROUTING"),
    ("filter", "INPUT", "-m conntrack --ctstate NEW -m comment --comment kubernetes-externally-visible-service-portals -j KUBE-EXTERNAL-SERVICES"),
    ("filter", "FORWARD", "-m conntrack --ctstate NEW -m comment --comment kubernetes-service-portals -j KUBE-SERVICES"),
    ("filter", "OUTPUT", "-m conntrack --ctstate NEW -m comment --comment kubernetes-service-portals -j KUBE-SERVICES"),
];

/// Fixed chains of the nat table.
const NAT_FIXED: [&str; 4] = ["KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-POSTROUTING", "KUBE-MARK-MASQ"];
/// Fixed chains of the filter table.
const FILTER_FIXED: [&str; 2] = ["KUBE-SERVICES", "KUBE-EXTERNAL-SERVICES"];

fn svc_chain(prefix: &str, sp: &ServicePort) -> String {
    format!("{prefix}-{}", chain_hash(&sp.id()))
}

fn sep_chain(sp: &ServicePort, ep: &Endpoint) -> String {
    format!(
        "KUBE-SEP-{}",
        chain_hash(&format!("{}__{}:{}", sp.id(), ep.ip, ep.port))
    )
}

fn host(ip: &std::net::IpAddr) -> String {
    if ip.is_ipv6() {
        format!("{ip}/128")
    } else {
        format!("{ip}/32")
    }
}

fn dest(ep: &Endpoint) -> String {
    if ep.ip.is_ipv6() {
        format!("[{}]:{}", ep.ip, ep.port)
    } else {
        format!("{}:{}", ep.ip, ep.port)
    }
}

/// Rules choosing an endpoint: `-m statistic --mode random --probability 1/(n-i)` for all
/// but the last, as kube-proxy writes them.
fn pick(out: &mut String, chain: &str, sp: &ServicePort, eps: &[&Endpoint]) {
    let n = eps.len();
    for (i, ep) in eps.iter().enumerate() {
        let stat = if i + 1 < n {
            format!(" -m statistic --mode random --probability {:.10}", 1.0 / (n - i) as f64)
        } else {
            String::new()
        };
        let _ = writeln!(
            out,
            "-A {chain} -m comment --comment \"{} -> {}\"{stat} -j {}",
            sp.id(),
            dest(ep),
            sep_chain(sp, ep)
        );
    }
}

/// Whether the service port has a KUBE-SVL chain (its local endpoints): for
/// `internalTrafficPolicy: Local` (the ClusterIP) or an `externalTrafficPolicy: Local`
/// NodePort, when it has local endpoints.
fn uses_svl(sp: &ServicePort) -> bool {
    (sp.internal_local || (sp.external_local && sp.node_port.is_some())) && !sp.local_endpoints().is_empty()
}

/// The chains this state uses in the nat table (fixed ones included).
fn nat_chains(ports: &[ServicePort]) -> BTreeSet<String> {
    let mut set: BTreeSet<String> = NAT_FIXED.iter().map(|s| s.to_string()).collect();
    for sp in ports.iter().filter(|sp| !sp.endpoints.is_empty()) {
        set.insert(svc_chain("KUBE-SVC", sp));
        for ep in &sp.endpoints {
            set.insert(sep_chain(sp, ep));
        }
        if sp.node_port.is_some() {
            set.insert(svc_chain("KUBE-EXT", sp));
        }
        if uses_svl(sp) {
            set.insert(svc_chain("KUBE-SVL", sp));
        }
    }
    set
}

/// The `iptables-restore --noflush` input for the state. `existing_nat` are the KUBE-*
/// chains now in the nat table (from `iptables-save`): those the state no longer uses are
/// flushed and deleted in the same transaction.
pub fn render(ports: &[ServicePort], existing_nat: &BTreeSet<String>) -> String {
    let chains = nat_chains(ports);
    let stale: Vec<&String> = existing_nat.iter().filter(|c| !chains.contains(*c)).collect();
    let mut s = String::from("*nat\n");
    for c in chains.iter().chain(stale.iter().copied()) {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    let _ = writeln!(s, "-A KUBE-POSTROUTING -m mark ! --mark 0x4000/0x4000 -j RETURN");
    let _ = writeln!(s, "-A KUBE-POSTROUTING -j MARK --xor-mark 0x4000");
    let _ = writeln!(
        s,
        "-A KUBE-POSTROUTING -m comment --comment \"kubernetes service traffic requiring SNAT\" -j MASQUERADE --random-fully"
    );
    let _ = writeln!(s, "-A KUBE-MARK-MASQ -j MARK --or-mark 0x4000");
    let mut filter = String::new();
    for sp in ports {
        let m = format!("-p {} -m {}", sp.proto, sp.proto);
        if sp.endpoints.is_empty() {
            let _ = writeln!(
                filter,
                "-A KUBE-SERVICES -m comment --comment \"{} has no endpoints\" -d {} {m} --dport {} -j REJECT",
                sp.id(),
                host(&sp.cluster_ip),
                sp.port
            );
            if let Some(np) = sp.node_port {
                let _ = writeln!(
                    filter,
                    "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"{} has no endpoints\" -m addrtype --dst-type LOCAL {m} --dport {np} -j DROP",
                    sp.id()
                );
            }
            continue;
        }
        let svc = svc_chain("KUBE-SVC", sp);
        let svl = svc_chain("KUBE-SVL", sp);
        let local = sp.local_endpoints();
        if uses_svl(sp) {
            pick(&mut s, &svl, sp, &local);
        }
        // internalTrafficPolicy: Local: the ClusterIP leads to this node's endpoints only,
        // dropped where there is none (as kube-proxy's "has no local endpoints").
        if sp.internal_local && local.is_empty() {
            let _ = writeln!(
                filter,
                "-A KUBE-SERVICES -m comment --comment \"{} has no local endpoints\" -d {} {m} --dport {} -j DROP",
                sp.id(),
                host(&sp.cluster_ip),
                sp.port
            );
        } else {
            let target = if sp.internal_local { &svl } else { &svc };
            let _ = writeln!(
                s,
                "-A KUBE-SERVICES -m comment --comment \"{} cluster IP\" -d {} {m} --dport {} -j {target}",
                sp.id(),
                host(&sp.cluster_ip),
                sp.port
            );
        }
        let all: Vec<&Endpoint> = sp.endpoints.iter().collect();
        pick(&mut s, &svc, sp, &all);
        for ep in &sp.endpoints {
            let sep = sep_chain(sp, ep);
            let _ = writeln!(
                s,
                "-A {sep} -m comment --comment {} -s {} -j KUBE-MARK-MASQ",
                sp.id(),
                host(&ep.ip)
            );
            let _ = writeln!(
                s,
                "-A {sep} -m comment --comment {} {m} -j DNAT --to-destination {}",
                sp.id(),
                dest(ep)
            );
        }
        let Some(np) = sp.node_port else { continue };
        let ext = svc_chain("KUBE-EXT", sp);
        if !sp.external_local {
            let _ = writeln!(
                s,
                "-A KUBE-NODEPORTS -m comment --comment {} {m} --dport {np} -j {ext}",
                sp.id()
            );
            let _ = writeln!(
                s,
                "-A {ext} -m comment --comment \"masquerade traffic for {} external destinations\" -j KUBE-MARK-MASQ",
                sp.id()
            );
            let _ = writeln!(s, "-A {ext} -j {svc}");
            continue;
        }
        if local.is_empty() {
            let _ = writeln!(
                filter,
                "-A KUBE-EXTERNAL-SERVICES -m comment --comment \"{} has no local endpoints\" -m addrtype --dst-type LOCAL {m} --dport {np} -j DROP",
                sp.id()
            );
            continue;
        }
        let _ = writeln!(
            s,
            "-A KUBE-NODEPORTS -m comment --comment {} {m} --dport {np} -j {ext}",
            sp.id()
        );
        let _ = writeln!(s, "-A {ext} -m comment --comment \"masquerade LOCAL traffic for {} external destinations\" -m addrtype --src-type LOCAL -j KUBE-MARK-MASQ", sp.id());
        let _ = writeln!(s, "-A {ext} -m comment --comment \"route LOCAL traffic for {} external destinations\" -m addrtype --src-type LOCAL -j {svc}", sp.id());
        let _ = writeln!(s, "-A {ext} -j {svl}");
    }
    let _ = writeln!(
        s,
        "-A KUBE-SERVICES -m comment --comment \"kubernetes service nodeports\" -m addrtype --dst-type LOCAL -j KUBE-NODEPORTS"
    );
    for c in stale {
        let _ = writeln!(s, "-X {c}");
    }
    s.push_str("COMMIT\n*filter\n");
    for c in FILTER_FIXED {
        let _ = writeln!(s, ":{c} - [0:0]");
    }
    s.push_str(&filter);
    s.push_str("COMMIT\n");
    s
}

/// The KUBE-* chains of a table, from `iptables-save -t <table>` output.
pub fn kube_chains(save: &str) -> BTreeSet<String> {
    save.lines()
        .filter_map(|l| l.strip_prefix(':'))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| c.starts_with("KUBE-"))
        .map(str::to_string)
        .collect()
}

/// The restore input deleting every KUBE-* chain given (after the hooks are gone).
pub fn cleanup(nat: &BTreeSet<String>, filter: &BTreeSet<String>) -> String {
    let mut s = String::new();
    for (table, chains) in [("nat", nat), ("filter", filter)] {
        let _ = writeln!(s, "*{table}");
        for c in chains {
            let _ = writeln!(s, ":{c} - [0:0]");
        }
        for c in chains {
            let _ = writeln!(s, "-X {c}");
        }
        s.push_str("COMMIT\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(n: usize, node_port: Option<u16>, local: bool) -> ServicePort {
        ServicePort {
            namespace: "x".into(),
            name: "web".into(),
            port_name: String::new(),
            proto: "tcp",
            cluster_ip: "10.96.0.10".parse().unwrap(),
            port: 80,
            node_port,
            external_local: local,
            internal_local: false,
            endpoints: (0..n)
                .map(|i| Endpoint {
                    ip: format!("10.0.0.{}", i + 2).parse().unwrap(),
                    port: 8080,
                    local: i == 0,
                })
                .collect(),
        }
    }

    #[test]
    fn renders_kube_proxy_chains() {
        let stale: BTreeSet<String> = ["KUBE-SVC-OLD".to_string(), "KUBE-SERVICES".to_string()].into();
        let s = render(&[sp(3, Some(30080), false)], &stale);
        assert!(
            s.contains("-d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j KUBE-SVC-"),
            "{s}"
        );
        assert!(s.contains("--probability 0.3333333333 -j KUBE-SEP-"));
        assert!(s.contains("--probability 0.5000000000 -j KUBE-SEP-"));
        assert_eq!(s.matches("-m statistic").count(), 2, "the last endpoint takes the rest");
        assert!(s.contains("-s 10.0.0.2/32 -j KUBE-MARK-MASQ"));
        assert!(s.contains("-j DNAT --to-destination 10.0.0.4:8080"));
        assert!(
            s.contains("-A KUBE-NODEPORTS -m comment --comment x/web/tcp/ -p tcp -m tcp --dport 30080 -j KUBE-EXT-")
        );
        assert!(s.contains(":KUBE-SVC-OLD - [0:0]") && s.contains("-X KUBE-SVC-OLD\nCOMMIT"));
        assert!(!s.contains("-X KUBE-SERVICES"));
        let s = render(&[sp(2, Some(30080), true)], &BTreeSet::new());
        assert!(s.contains("-j KUBE-SVL-") && s.contains("--src-type LOCAL -j KUBE-MARK-MASQ"));
        let s = render(&[sp(0, Some(30080), false)], &BTreeSet::new());
        assert!(s.contains("has no endpoints\" -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j REJECT"));
        assert!(s.contains("--dport 30080 -j DROP"));
        // internalTrafficPolicy: Local: the ClusterIP jumps to the local endpoint only
        // (10.0.0.2), or is dropped without one.
        let itp = |n| ServicePort {
            internal_local: true,
            ..sp(n, None, false)
        };
        let s = render(&[itp(3)], &BTreeSet::new());
        assert!(s.contains("--dport 80 -j KUBE-SVL-"), "{s}");
        let svl = s.lines().filter(|l| l.starts_with("-A KUBE-SVL-")).collect::<Vec<_>>();
        assert!(svl.len() == 1 && svl[0].contains("-> 10.0.0.2:8080"), "{svl:?}");
        let mut remote = itp(3);
        remote.endpoints.retain(|e| !e.local);
        let s = render(&[remote], &BTreeSet::new());
        assert!(s.contains("has no local endpoints\" -d 10.96.0.10/32 -p tcp -m tcp --dport 80 -j DROP"));
        assert!(!s.contains("--dport 80 -j KUBE-SV"), "{s}");
        assert_eq!(
            kube_chains(":KUBE-A - [0:0]\n:INPUT ACCEPT [0:0]\n-A KUBE-A -j X\n"),
            ["KUBE-A".to_string()].into()
        );
    }
}
