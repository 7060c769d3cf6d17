//! kube-proxy's nftables mode: the whole `table ip kube-proxy` / `table ip6 kube-proxy`
//! rendered from the service ports, replaced in one `nft -f` transaction.
//!
//! The layout follows upstream's nftables proxier: base chains `nat-prerouting` and
//! `nat-output` jump to `services`, which dispatches ClusterIP traffic through the verdict
//! map `service-ips` and local-destination traffic to `nodeports` (map `service-nodeports`);
//! a per-service chain picks an endpoint with `numgen random mod N vmap`; a per-endpoint
//! chain marks hairpin traffic (source = endpoint) for masquerade and does the `dnat to`;
//! a per-NodePort `external-*` chain marks for masquerade (`externalTrafficPolicy:
//! Cluster`) or, for `Local`, goes to the `local-*` chain of the node's own endpoints without
//! SNAT (locally-originated traffic still masqueraded and sent cluster-wide); `nat-postrouting`
//! masquerades marked packets (mark 0x4000). Filter chains reject new connections to a
//! ClusterIP without endpoints and drop NodePort traffic with no (local) endpoint.

use std::fmt::Write as _;

use super::model::{chain_hash, Endpoint, ServicePort};

/// The table's name in both families.
pub const TABLE: &str = "kube-proxy";
/// The masquerade mark.
pub const MASQ_MARK: &str = "0x4000";

/// `ip` or `ip6`.
pub fn family(v6: bool) -> &'static str {
    if v6 {
        "ip6"
    } else {
        "ip"
    }
}

fn addr(ep: &Endpoint) -> String {
    if ep.ip.is_ipv6() {
        format!("[{}]:{}", ep.ip, ep.port)
    } else {
        format!("{}:{}", ep.ip, ep.port)
    }
}

fn svc_chain(sp: &ServicePort) -> String {
    format!("service-{}-{}", &chain_hash(&sp.id())[..8], sp.id())
}

/// The endpoint chain, named as upstream: `endpoint-HASH-ns/name/proto/port__IP/PORT`
/// (an IPv6 address with its `:` written as `.`, which nft identifiers allow).
fn ep_chain(sp: &ServicePort, ep: &Endpoint) -> String {
    let id = format!("{}__{}/{}", sp.id(), ep.ip, ep.port);
    format!("endpoint-{}-{}", &chain_hash(&id)[..8], id.replace(':', "."))
}

/// A chain name as written in the script (nft identifiers take `/`, `.`, `_` and `-`
/// unquoted, as upstream writes them).
fn q(name: &str) -> String {
    name.to_string()
}

/// `numgen random mod N vmap { 0 : goto a, ... }`, or a reject when there is no endpoint.
fn pick(sp: &ServicePort, eps: &[&Endpoint]) -> String {
    let arms: Vec<String> = eps
        .iter()
        .enumerate()
        .map(|(i, e)| format!("{i} : goto {}", q(&ep_chain(sp, e))))
        .collect();
    format!("numgen random mod {} vmap {{ {} }}", eps.len(), arms.join(", "))
}

/// The full script for one family: creates the table if missing, deletes it and recreates
/// it with the whole state, in one transaction.
pub fn render(ports: &[ServicePort], v6: bool) -> String {
    let fam = family(v6);
    let (addr_ty, daddr, saddr, lo) = if v6 {
        ("ipv6_addr", "ip6 daddr", "ip6 saddr", "::1")
    } else {
        ("ipv4_addr", "ip daddr", "ip saddr", "127.0.0.0/8")
    };
    let mut s = String::new();
    let _ = writeln!(s, "table {fam} {TABLE} {{ }}");
    let _ = writeln!(s, "delete table {fam} {TABLE}");
    let _ = writeln!(s, "table {fam} {TABLE} {{");
    let base = [
        (
            "nat-prerouting",
            "type nat hook prerouting priority dstnat",
            "jump services",
        ),
        ("nat-output", "type nat hook output priority -100", "jump services"),
        (
            "nat-postrouting",
            "type nat hook postrouting priority srcnat",
            "jump masquerading",
        ),
        (
            "filter-input",
            "type filter hook input priority -110",
            "ct state new jump nodeport-endpoints-check\n\t\tct state new jump service-endpoints-check",
        ),
        (
            "filter-forward",
            "type filter hook forward priority -110",
            "ct state new jump service-endpoints-check",
        ),
        (
            "filter-output",
            "type filter hook output priority -110",
            "ct state new jump service-endpoints-check",
        ),
    ];
    for (name, hook, body) in base {
        let _ = writeln!(s, "\tchain {name} {{\n\t\t{hook}; policy accept;\n\t\t{body}\n\t}}");
    }
    let _ = writeln!(
        s,
        "\tchain mark-for-masquerade {{\n\t\tmeta mark set meta mark or {MASQ_MARK}\n\t}}"
    );
    let _ = writeln!(
        s,
        "\tchain masquerading {{\n\t\tmeta mark & {MASQ_MARK} == 0 return\n\t\tmeta mark set meta mark xor {MASQ_MARK}\n\t\tmasquerade fully-random\n\t}}"
    );
    let _ = writeln!(s, "\tchain reject-chain {{\n\t\treject\n\t}}");
    let mut svc_ips = Vec::new();
    let mut node_ports = Vec::new();
    let mut no_ep_svcs = Vec::new();
    let mut no_ep_nps = Vec::new();
    let mut chains = String::new();
    for sp in ports {
        let key = format!("{} . {} . {}", sp.cluster_ip, sp.proto, sp.port);
        if sp.endpoints.is_empty() {
            no_ep_svcs.push(format!("{key} : goto reject-chain"));
            if let Some(np) = sp.node_port {
                no_ep_nps.push(format!("{} . {np} : drop", sp.proto));
            }
            continue;
        }
        let sc = svc_chain(sp);
        let lc = format!("local-{}", &sc["service-".len()..]);
        let local = sp.local_endpoints();
        let has_local_chain = !local.is_empty() && (sp.internal_local || (sp.external_local && sp.node_port.is_some()));
        if has_local_chain {
            let _ = writeln!(chains, "\tchain {} {{\n\t\t{}\n\t}}", q(&lc), pick(sp, &local));
        }
        // internalTrafficPolicy: Local: the ClusterIP leads to this node's endpoints only,
        // dropped where there is none (upstream's no-endpoint-services `drop`).
        if !sp.internal_local {
            svc_ips.push(format!("{key} : goto {}", q(&sc)));
        } else if has_local_chain {
            svc_ips.push(format!("{key} : goto {}", q(&lc)));
        } else {
            no_ep_svcs.push(format!("{key} : drop"));
        }
        let all: Vec<&Endpoint> = sp.endpoints.iter().collect();
        let _ = writeln!(chains, "\tchain {} {{\n\t\t{}\n\t}}", q(&sc), pick(sp, &all));
        for ep in &sp.endpoints {
            let _ = writeln!(
                chains,
                "\tchain {} {{\n\t\t{saddr} {} jump mark-for-masquerade\n\t\tmeta l4proto {} dnat to {}\n\t}}",
                q(&ep_chain(sp, ep)),
                ep.ip,
                sp.proto,
                addr(ep)
            );
        }
        let Some(np) = sp.node_port else { continue };
        let ext = format!("external-{}", &sc["service-".len()..]);
        if !sp.external_local {
            let _ = writeln!(
                chains,
                "\tchain {} {{\n\t\tjump mark-for-masquerade\n\t\tgoto {}\n\t}}",
                q(&ext),
                q(&sc)
            );
            node_ports.push(format!("{} . {np} : goto {}", sp.proto, q(&ext)));
            continue;
        }
        if local.is_empty() {
            no_ep_nps.push(format!("{} . {np} : drop", sp.proto));
            continue;
        }
        let _ = writeln!(
            chains,
            "\tchain {} {{\n\t\tfib saddr type local jump mark-for-masquerade\n\t\tfib saddr type local goto {}\n\t\tgoto {}\n\t}}",
            q(&ext),
            q(&sc),
            q(&lc)
        );
        node_ports.push(format!("{} . {np} : goto {}", sp.proto, q(&ext)));
    }
    let map = |s: &mut String, name: &str, ty: &str, elems: &[String]| {
        let _ = write!(s, "\tmap {name} {{\n\t\ttype {ty} : verdict\n");
        if !elems.is_empty() {
            let _ = writeln!(s, "\t\telements = {{ {} }}", elems.join(",\n\t\t\t"));
        }
        let _ = writeln!(s, "\t}}");
    };
    map(
        &mut s,
        "service-ips",
        &format!("{addr_ty} . inet_proto . inet_service"),
        &svc_ips,
    );
    map(&mut s, "service-nodeports", "inet_proto . inet_service", &node_ports);
    map(
        &mut s,
        "no-endpoint-services",
        &format!("{addr_ty} . inet_proto . inet_service"),
        &no_ep_svcs,
    );
    map(&mut s, "no-endpoint-nodeports", "inet_proto . inet_service", &no_ep_nps);
    let _ = writeln!(
        s,
        "\tchain services {{\n\t\t{daddr} . meta l4proto . th dport vmap @service-ips\n\t\tfib daddr type local {daddr} != {lo} jump nodeports\n\t}}"
    );
    let _ = writeln!(
        s,
        "\tchain nodeports {{\n\t\tmeta l4proto . th dport vmap @service-nodeports\n\t}}"
    );
    let _ = writeln!(
        s,
        "\tchain service-endpoints-check {{\n\t\t{daddr} . meta l4proto . th dport vmap @no-endpoint-services\n\t}}"
    );
    let _ = writeln!(
        s,
        "\tchain nodeport-endpoints-check {{\n\t\tfib daddr type local meta l4proto . th dport vmap @no-endpoint-nodeports\n\t}}"
    );
    s.push_str(&chains);
    s.push_str("}\n");
    s
}

/// The script removing both tables (for stop and leftovers); `nft` fails on a missing
/// table, so each is created first.
pub fn cleanup_script() -> String {
    let mut s = String::new();
    for fam in ["ip", "ip6"] {
        let _ = writeln!(s, "table {fam} {TABLE} {{ }}\ndelete table {fam} {TABLE}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sp(eps: &[(&str, bool)], node_port: Option<u16>, local: bool) -> ServicePort {
        ServicePort {
            namespace: "x".into(),
            name: "web".into(),
            port_name: "http".into(),
            proto: "tcp",
            cluster_ip: "10.96.0.10".parse().unwrap(),
            port: 80,
            node_port,
            external_local: local,
            internal_local: false,
            endpoints: eps
                .iter()
                .map(|(ip, l)| Endpoint {
                    ip: ip.parse().unwrap(),
                    port: 8080,
                    local: *l,
                })
                .collect(),
        }
    }

    #[test]
    fn renders_the_upstream_layout() {
        let s = render(
            &[sp(&[("10.0.0.2", true), ("10.0.0.3", false)], Some(30080), false)],
            false,
        );
        assert!(s.starts_with("table ip kube-proxy { }\ndelete table ip kube-proxy\n"));
        assert!(s.contains("10.96.0.10 . tcp . 80 : goto service-"), "{s}");
        assert!(s.contains("numgen random mod 2 vmap { 0 : goto endpoint-"), "{s}");
        assert!(s.contains("-x/web/tcp/http__10.0.0.2/8080 {"), "{s}");
        assert!(s.contains("ip saddr 10.0.0.2 jump mark-for-masquerade\n\t\tmeta l4proto tcp dnat to 10.0.0.2:8080"));
        assert!(s.contains("tcp . 30080 : goto external-"));
        assert!(s.contains("jump mark-for-masquerade\n\t\tgoto service-"));
        // Local: only the local endpoint, no SNAT for external sources.
        let s = render(
            &[sp(&[("10.0.0.2", true), ("10.0.0.3", false)], Some(30080), true)],
            false,
        );
        assert!(s.contains("chain local-"));
        assert!(s.contains("numgen random mod 1 vmap"));
        assert!(s.contains("fib saddr type local jump mark-for-masquerade"));
        // internalTrafficPolicy: Local: the ClusterIP goes to the local endpoint only, and
        // is dropped without one.
        let itp = |eps: &[(&str, bool)]| ServicePort {
            internal_local: true,
            ..sp(eps, None, false)
        };
        let s = render(&[itp(&[("10.0.0.2", true), ("10.0.0.3", false)])], false);
        assert!(s.contains("10.96.0.10 . tcp . 80 : goto local-"), "{s}");
        assert!(s.contains("numgen random mod 1 vmap { 0 : goto endpoint-"), "{s}");
        let s = render(&[itp(&[("10.0.0.3", false)])], false);
        assert!(s.contains("10.96.0.10 . tcp . 80 : drop"), "{s}");
        assert!(!s.contains("10.96.0.10 . tcp . 80 : goto"), "{s}");
        // No local endpoint: the NodePort is dropped; no endpoint at all: rejected.
        let s = render(&[sp(&[("10.0.0.3", false)], Some(30080), true)], false);
        assert!(s.contains("tcp . 30080 : drop"));
        let s = render(&[sp(&[], Some(30080), false)], false);
        assert!(s.contains("10.96.0.10 . tcp . 80 : goto reject-chain"));
        let mut six = sp(&[("fd00::2", false)], None, false);
        six.cluster_ip = "fd00:96::a".parse().unwrap();
        let s = render(&[six], true);
        assert!(s.contains("table ip6 kube-proxy {"));
        assert!(s.contains("dnat to [fd00::2]:8080"));
        assert!(s.contains("ip6 daddr . meta l4proto . th dport vmap @service-ips"));
    }
}
