//! A stable text form of [`Compiled`] (golden files, `npmctl compile`).

use std::fmt::Write;

use crate::compiled::{Compiled, Direction, RuleRef, Tier};
use crate::model::Protocol;

/// A protocol and port range as `any`, `Tcp/*`, `Tcp/80` or `Tcp/80-90`.
fn ports(protocol: Option<Protocol>, ports: (u16, u16)) -> String {
    match protocol {
        None => "any".to_string(),
        Some(p) if ports == (0, u16::MAX) => format!("{p:?}/*"),
        Some(p) if ports.0 == ports.1 => format!("{p:?}/{}", ports.0),
        Some(p) => format!("{p:?}/{}-{}", ports.0, ports.1),
    }
}

fn labels(l: &crate::model::Labels) -> String {
    let v: Vec<String> = l.iter().map(|(k, v)| format!("{k}={v}")).collect();
    format!("{{{}}}", v.join(","))
}

fn peer_name(c: &Compiled, id: u32) -> String {
    identity_name(c, id)
}

/// A name of identity `id` for logs and tables: `any`, `world`, `host`,
/// `cidr:<prefix>`, `node/<name>` for a node identity (`node/<first>+<n>`
/// when `n` more nodes share its labels), else `id:<n>` (a pod identity;
/// its key is in `ids.identities`).
pub fn identity_name(c: &Compiled, id: u32) -> String {
    if let Some(n) = c.ids.node_identities.get(&id) {
        return match n.nodes.as_slice() {
            [] => format!("node#{id}"),
            [one] => format!("node/{one}"),
            [first, rest @ ..] => format!("node/{first}+{}", rest.len()),
        };
    }
    match id {
        npm_common::IDENTITY_ANY => "any".to_string(),
        npm_common::IDENTITY_WORLD => "world".to_string(),
        npm_common::IDENTITY_HOST => "host".to_string(),
        id if id >= npm_common::IDENTITY_FIRST_CIDR => match c.cidrs.iter().find(|(_, v)| **v == id) {
            Some((n, _)) => format!("cidr:{n}"),
            None => format!("cidr#{id}"),
        },
        id => format!("id:{id}"),
    }
}

impl Compiled {
    /// Renders every table in a stable, line-oriented text form.
    pub fn render_table(&self) -> String {
        let mut s = String::new();
        s.push_str("identities:\n");
        for (id, k) in &self.ids.identities {
            let ports: Vec<String> = k
                .named_ports
                .iter()
                .map(|(n, p, num)| format!("{n}={num}/{p:?}"))
                .collect();
            let _ = writeln!(
                s,
                "  {id} ns={} pod{} nsl{} ports=[{}]",
                k.namespace,
                labels(&k.pod_labels),
                labels(&k.namespace_labels),
                ports.join(",")
            );
        }
        if !self.ids.node_identities.is_empty() {
            s.push_str("node identities:\n");
            for (id, n) in &self.ids.node_identities {
                let _ = writeln!(s, "  {id} nodes=[{}] labels{}", n.nodes.join(","), labels(&n.labels));
            }
        }
        s.push_str("cidrs:\n");
        for (n, id) in &self.cidrs {
            let _ = writeln!(s, "  {n} -> {id}");
        }
        s.push_str("ipcache:\n");
        for (ip, e) in &self.ipcache {
            let _ = writeln!(s, "  {ip} -> {} cidr={}", peer_name(self, e.identity), e.cidr_identity);
        }
        s.push_str("endpoints:\n");
        for (id, e) in &self.endpoints {
            let v4 = e.ipv4.map(|a| a.to_string()).unwrap_or_else(|| "-".into());
            let v6 = e.ipv6.map(|a| a.to_string()).unwrap_or_else(|| "-".into());
            let iso = |b: bool| if b { "isolated" } else { "open" };
            let mut tiers = String::new();
            for (tier, dir) in [
                (Tier::Admin, Direction::Ingress),
                (Tier::Admin, Direction::Egress),
                (Tier::Baseline, Direction::Ingress),
                (Tier::Baseline, Direction::Egress),
            ] {
                if e.tiers.has(tier, dir) {
                    let _ = write!(tiers, " {}-{}", tier.name().to_lowercase(), dir.name());
                }
            }
            let _ = writeln!(
                s,
                "  ep{id} {}/{} identity={} v4={v4} v6={v6} ingress={} egress={}{}",
                e.pod.namespace,
                e.pod.name,
                e.identity,
                iso(e.isolated_ingress),
                iso(e.isolated_egress),
                if tiers.is_empty() {
                    String::new()
                } else {
                    format!(" tiers:{tiers}")
                }
            );
        }
        s.push_str("rules:\n");
        for (id, r) in &self.ids.rules {
            match r {
                RuleRef::Policy {
                    namespace,
                    name,
                    direction,
                    index,
                } => {
                    let _ = writeln!(s, "  r{id} {namespace}/{name} {}[{index}]", direction.name());
                }
                RuleRef::HostEgress => {
                    let _ = writeln!(s, "  r{id} host-egress");
                }
                RuleRef::Cluster {
                    tier,
                    name,
                    direction,
                    index,
                } => {
                    let _ = writeln!(s, "  r{id} cnp/{name} {} {}[{index}]", tier.name(), direction.name());
                }
            }
        }
        s.push_str("policy:\n");
        for (e, r) in &self.policy {
            let _ = writeln!(
                s,
                "  s{} {} {} {} r{r}",
                e.subject,
                e.direction.name(),
                peer_name(self, e.peer),
                ports(e.protocol, e.ports)
            );
        }
        // Only with ClusterNetworkPolicies (the form without them is
        // unchanged).
        if !self.tiers.is_empty() {
            s.push_str("tiers:\n");
            for (e, v) in &self.tiers {
                let _ = writeln!(
                    s,
                    "  ep{} {} {} {} {} {:?} rank={} r{}",
                    e.endpoint,
                    e.direction.name(),
                    e.tier.name(),
                    peer_name(self, e.peer),
                    ports(e.protocol, e.ports),
                    v.action,
                    v.rank,
                    v.rule
                );
            }
        }
        s
    }
}
