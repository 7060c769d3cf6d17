//! Rendering of a compiled policy as one `nft -f` script (see the module
//! documentation of [`super`] for the layout of the table).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS, IDENTITY_ANY, IDENTITY_FIRST_CIDR, IDENTITY_HOST, IDENTITY_WORLD};
use npm_policy::compiled::{Compiled, Direction, Endpoint, PolicyEntry};
use npm_policy::model::Protocol;

use super::ranges::{family_of, family_of_addr, prefix_range, range_element, subtract, Family};
use super::{CounterMap, NftOptions};
use crate::Interfaces;

/// ICMPv6 neighbour discovery and MLD types, exempt from source validation
/// and policy (the datapath's `Icmpv6Control`).
const ICMPV6_CONTROL: &str = "{ mld-listener-query, mld-listener-report, mld-listener-done, nd-router-solicit, \
nd-router-advert, nd-neighbor-solicit, nd-neighbor-advert, nd-redirect, mld2-listener-report }";

/// Short name of a direction in chain and counter names.
pub(crate) const fn dir_tag(direction: u8) -> &'static str {
    if direction == DIR_INGRESS {
        "in"
    } else {
        "out"
    }
}

/// Name of the named counter of a direction and a reason, e.g. `in_policy_denied`.
pub fn counter_name(direction: u8, reason: Reason) -> String {
    format!("{}_{}", dir_tag(direction), reason.name().replace('-', "_"))
}

/// The reasons the chains of `direction` count (each has a named counter).
pub(crate) const fn counted_reasons(direction: u8) -> &'static [Reason] {
    if direction == DIR_INGRESS {
        &[
            Reason::Policy,
            Reason::NotIsolated,
            Reason::Tracked,
            Reason::Host,
            Reason::Icmpv6Control,
            Reason::PolicyDenied,
            Reason::Malformed,
        ]
    } else {
        &[
            Reason::Policy,
            Reason::NotIsolated,
            Reason::Tracked,
            Reason::Icmpv6Control,
            Reason::PolicyDenied,
            Reason::Spoofed,
            Reason::Malformed,
        ]
    }
}

/// Name of the chain of an endpoint and a direction, e.g. `ep_7_in`.
pub fn chain_name(endpoint: u32, direction: Direction) -> String {
    format!("ep_{}_{}", endpoint, dir_tag(direction.as_u8()))
}

/// Name of the set of `identity`'s addresses of one family.
fn set_name(identity: u32, family: Family) -> String {
    let fam = match family {
        Family::V4 => "v4",
        Family::V6 => "v6",
    };
    if identity == IDENTITY_WORLD {
        // Holds what is *not* world: every ipcache address.
        format!("not_world_{fam}")
    } else if identity >= IDENTITY_FIRST_CIDR {
        format!("cidr_{identity}_{fam}")
    } else {
        format!("id_{identity}_{fam}")
    }
}

/// The address sets of one identity: elements per family (already formatted),
/// and whether the set is an interval set.
struct PeerSet {
    v4: Vec<String>,
    v6: Vec<String>,
    interval: bool,
}

impl PeerSet {
    fn elements(&self, family: Family) -> &[String] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }
}

/// Ranges of one identity: (IPv4, IPv6).
type RangesByFamily = (Vec<(u128, u128)>, Vec<(u128, u128)>);

/// Computes the address sets of every identity that `compiled` references
/// as a policy peer, plus [`IDENTITY_HOST`] (host ingress).
fn peer_sets(compiled: &Compiled) -> BTreeMap<u32, PeerSet> {
    let mut wanted: BTreeSet<u32> = compiled.policy.keys().map(|e| e.peer).collect();
    wanted.insert(IDENTITY_HOST);
    wanted.remove(&IDENTITY_ANY);

    // Every prefix as a range, sorted by family, first address, then widest
    // first: the prefixes inside one follow it directly (prefixes nest or
    // are disjoint), which keeps the CIDR differences near-linear.
    let mut prefixes: Vec<(Family, (u128, u128), u32)> = compiled
        .cidrs
        .iter()
        .map(|(net, id)| (family_of(net), prefix_range(net), *id))
        .collect();
    prefixes.sort_unstable_by_key(|(f, (s, e), id)| (*f, *s, std::cmp::Reverse(*e), *id));
    let mut cidr_parts: BTreeMap<u32, RangesByFamily> = BTreeMap::new();
    for (i, (fam, outer, id)) in prefixes.iter().enumerate() {
        if !wanted.contains(id) {
            continue;
        }
        // Strictly more specific prefixes inside `outer` are holes: an
        // address there has a longer match, hence another identity.
        let holes: Vec<(u128, u128)> = prefixes[i + 1..]
            .iter()
            .take_while(|(f, r, _)| f == fam && r.0 <= outer.1)
            .filter(|(_, r, _)| r != outer)
            .map(|(_, r, _)| *r)
            .collect();
        let parts = subtract(*outer, &holes);
        let entry = cidr_parts.entry(*id).or_default();
        match fam {
            Family::V4 => entry.0.extend(parts),
            Family::V6 => entry.1.extend(parts),
        }
    }
    // Pod identity (and host) addresses, grouped once.
    let mut pod_addrs: BTreeMap<u32, (Vec<String>, Vec<String>)> = BTreeMap::new();
    for (addr, entry) in &compiled.ipcache {
        if !wanted.contains(&entry.identity) {
            continue;
        }
        let e = pod_addrs.entry(entry.identity).or_default();
        match family_of_addr(addr) {
            Family::V4 => e.0.push(addr.to_string()),
            Family::V6 => e.1.push(addr.to_string()),
        }
    }

    let mut out = BTreeMap::new();
    for id in wanted {
        let set = if id == IDENTITY_WORLD {
            let mut v4: Vec<(u128, u128)> = Vec::new();
            let mut v6: Vec<(u128, u128)> = Vec::new();
            for addr in compiled.ipcache.keys() {
                match addr {
                    IpAddr::V4(a) => v4.push((u128::from(u32::from(*a)), u128::from(u32::from(*a)))),
                    IpAddr::V6(a) => v6.push((u128::from(*a), u128::from(*a))),
                }
            }
            PeerSet {
                v4: union_elements(Family::V4, v4),
                v6: union_elements(Family::V6, v6),
                interval: true,
            }
        } else if id >= IDENTITY_FIRST_CIDR {
            let (v4, v6) = cidr_parts.remove(&id).unwrap_or_default();
            PeerSet {
                v4: union_elements(Family::V4, v4),
                v6: union_elements(Family::V6, v6),
                interval: true,
            }
        } else {
            let (v4, v6) = pod_addrs.remove(&id).unwrap_or_default();
            PeerSet {
                v4,
                v6,
                interval: false,
            }
        };
        out.insert(id, set);
    }
    out
}

/// Sorts and merges overlapping or adjacent ranges, then formats them.
fn union_elements(family: Family, mut ranges: Vec<(u128, u128)>) -> Vec<String> {
    ranges.sort_unstable();
    let mut merged: Vec<(u128, u128)> = Vec::new();
    for (s, e) in ranges {
        if let Some(last) = merged.last_mut() {
            if s <= last.1.saturating_add(1) {
                last.1 = last.1.max(e);
                continue;
            }
        }
        merged.push((s, e));
    }
    merged.into_iter().map(|r| range_element(family, r)).collect()
}

/// The L4 part of a policy rule: protocol and destination ports, or `None`
/// when the entry can match nothing (an empty port range).
fn l4_match(entry: &PolicyEntry) -> Option<String> {
    let Some(proto) = entry.protocol else {
        return Some(String::new());
    };
    let name = match proto {
        Protocol::Tcp => "tcp",
        Protocol::Udp => "udp",
        Protocol::Sctp => "sctp",
    };
    let (lo, hi) = entry.ports;
    if lo > hi {
        return None;
    }
    if lo == 0 && hi == u16::MAX {
        Some(format!(" meta l4proto {name}"))
    } else if lo == hi {
        Some(format!(" meta l4proto {name} th dport {lo}"))
    } else {
        Some(format!(" meta l4proto {name} th dport {lo}-{hi}"))
    }
}

/// One named set of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SetDef {
    /// `ipv4_addr` or `ipv6_addr`.
    ty: &'static str,
    /// `flags interval`.
    interval: bool,
    /// Elements as rendered (sorted, unique).
    elements: Vec<String>,
}

/// The table as objects: what [`full_script`] writes and what
/// [`incremental_script`] compares. Counters and base chains are fixed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Model {
    /// Peer sets by name.
    sets: BTreeMap<String, SetDef>,
    /// Endpoint chains by name: their rules.
    chains: BTreeMap<String, Vec<String>>,
    /// Dispatch: ifindex -> endpoint id.
    dispatch: BTreeMap<u32, u32>,
}

/// Builds the objects of the table for `compiled`.
///
/// Endpoints get a dispatch entry only when `interfaces` has their ifindex
/// (an ifindex claimed by two endpoints goes to the lower id); policy
/// entries of endpoints missing from `compiled.endpoints` and entries with
/// an empty port range match nothing and are not rendered.
pub(crate) fn model(compiled: &Compiled, interfaces: &Interfaces) -> Model {
    let peer = peer_sets(compiled);
    let mut m = Model::default();
    for (id, set) in &peer {
        for family in [Family::V4, Family::V6] {
            let elems = set.elements(family);
            if elems.is_empty() && *id != IDENTITY_WORLD {
                continue;
            }
            let ty = match family {
                Family::V4 => "ipv4_addr",
                Family::V6 => "ipv6_addr",
            };
            let mut elements = elems.to_vec();
            elements.sort_unstable();
            elements.dedup();
            m.sets.insert(
                set_name(*id, family),
                SetDef {
                    ty,
                    interval: set.interval,
                    elements,
                },
            );
        }
    }
    let mut entries: BTreeMap<(u32, Direction), Vec<(&PolicyEntry, u32)>> = BTreeMap::new();
    for (entry, rule) in &compiled.policy {
        entries
            .entry((entry.endpoint, entry.direction))
            .or_default()
            .push((entry, *rule));
    }
    for (id, ep) in &compiled.endpoints {
        for direction in [Direction::Ingress, Direction::Egress] {
            let list = entries.get(&(*id, direction)).map(Vec::as_slice).unwrap_or(&[]);
            m.chains
                .insert(chain_name(*id, direction), endpoint_rules(ep, direction, list, &peer));
        }
        if let Some(ifindex) = interfaces.get(id) {
            m.dispatch.entry(*ifindex).or_insert(*id);
        }
    }
    m
}

/// Renders `compiled` as an `nft -f` script that replaces the table
/// `opts.table` (family `inet`) atomically: the script creates the table if
/// missing, deletes it and adds it again, all in one transaction.
///
/// Endpoints get a dispatch entry only when `interfaces` has their ifindex;
/// policy entries of endpoints missing from `compiled.endpoints` and entries
/// with an empty port range match nothing and are not rendered. The output
/// is deterministic (everything is rendered in map order).
pub fn render(compiled: &Compiled, interfaces: &Interfaces, opts: &NftOptions) -> String {
    full_script(&model(compiled, interfaces), &opts.table, &CounterMap::new())
}

fn dispatch_elements(m: &Model, direction: Direction) -> Vec<String> {
    m.dispatch
        .iter()
        .map(|(ifindex, id)| format!("{ifindex} : jump {}", chain_name(*id, direction)))
        .collect()
}

/// Name of the dispatch verdict map of a direction.
fn dispatch_map(direction: Direction) -> &'static str {
    match direction {
        Direction::Ingress => "dispatch_in",
        Direction::Egress => "dispatch_out",
    }
}

/// The script replacing the table with `m`, the named counters starting at
/// `counters` (the values of the table being replaced, so totals survive).
pub(crate) fn full_script(m: &Model, table: &str, counters: &CounterMap) -> String {
    let mut s = String::new();
    // Writing into a String cannot fail; `let _ =` keeps that explicit.
    let _ = writeln!(s, "# npm nftables dataplane: generated, do not edit");
    let _ = writeln!(s, "table inet {table} {{}}");
    let _ = writeln!(s, "delete table inet {table}");
    let _ = writeln!(s, "table inet {table} {{");

    // Named counters, one per direction and reason that the chains use.
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        for reason in counted_reasons(dir) {
            let _ = writeln!(s, "\tcounter {} {{", counter_name(dir, *reason));
            if let Some((packets, bytes)) = counters.get(&(dir, *reason as u8)) {
                let _ = writeln!(s, "\t\tpackets {packets} bytes {bytes}");
            }
            let _ = writeln!(s, "\t}}");
        }
    }
    for (name, set) in &m.sets {
        let _ = writeln!(s, "\tset {name} {{");
        let _ = writeln!(s, "\t\ttype {}", set.ty);
        if set.interval {
            let _ = writeln!(s, "\t\tflags interval");
        }
        if !set.elements.is_empty() {
            let _ = writeln!(s, "\t\telements = {{ {} }}", set.elements.join(", "));
        }
        let _ = writeln!(s, "\t}}");
    }
    for (name, rules) in &m.chains {
        let _ = writeln!(s, "\tchain {name} {{");
        for r in rules {
            let _ = writeln!(s, "\t\t{r}");
        }
        let _ = writeln!(s, "\t}}");
    }
    // Dispatch by ifindex through verdict maps: one lookup per packet and hook.
    for direction in [Direction::Egress, Direction::Ingress] {
        let _ = writeln!(s, "\tmap {} {{", dispatch_map(direction));
        let _ = writeln!(s, "\t\ttype iface_index : verdict");
        let elems = dispatch_elements(m, direction);
        if !elems.is_empty() {
            let _ = writeln!(s, "\t\telements = {{ {} }}", elems.join(", "));
        }
        let _ = writeln!(s, "\t}}");
    }
    let base = |s: &mut String, name: &str, hook: &str, egress: bool, ingress: bool| {
        let _ = writeln!(s, "\tchain {name} {{");
        let _ = writeln!(s, "\t\ttype filter hook {hook} priority filter; policy accept;");
        if egress {
            let _ = writeln!(s, "\t\tiif vmap @{}", dispatch_map(Direction::Egress));
        }
        if ingress {
            let _ = writeln!(s, "\t\toif vmap @{}", dispatch_map(Direction::Ingress));
        }
        let _ = writeln!(s, "\t}}");
    };
    // Pod <-> pod and pod <-> world: both hooks of the packet.
    base(&mut s, "base_forward", "forward", true, true);
    // Pod -> this node: the pod's egress.
    base(&mut s, "base_input", "input", true, false);
    // This node -> pod: the pod's ingress.
    base(&mut s, "base_output", "output", false, true);
    let _ = writeln!(s, "}}");
    s
}

/// The script that turns the table holding `old` into one holding `new`,
/// touching only what differs, as one transaction (`None`: nothing differs).
/// Counters are left alone, so they keep counting.
///
/// Order: new sets and added elements first (rules may reference them),
/// then new and changed chains (a changed chain is flushed and refilled),
/// then dispatch changes, then removed elements, chains and sets (nothing
/// references them any more).
pub(crate) fn incremental_script(old: &Model, new: &Model, table: &str) -> Option<String> {
    if old == new {
        return None;
    }
    let t = format!("inet {table}");
    let mut s = String::new();
    let mut late = String::new();
    for (name, set) in &new.sets {
        let old_set = old
            .sets
            .get(name)
            .filter(|o| o.ty == set.ty && o.interval == set.interval);
        let had: BTreeSet<&String> = old_set.map(|o| o.elements.iter().collect()).unwrap_or_default();
        let has: BTreeSet<&String> = set.elements.iter().collect();
        if old_set.is_none() {
            if old.sets.contains_key(name) {
                let _ = writeln!(s, "delete set {t} {name}");
            }
            let flags = if set.interval { " flags interval;" } else { "" };
            let _ = writeln!(s, "add set {t} {name} {{ type {};{flags} }}", set.ty);
        }
        // Removals before additions: an interval set rejects overlapping elements.
        let removed: Vec<&str> = had.difference(&has).map(|e| e.as_str()).collect();
        if !removed.is_empty() {
            let _ = writeln!(s, "delete element {t} {name} {{ {} }}", removed.join(", "));
        }
        let added: Vec<&str> = has.difference(&had).map(|e| e.as_str()).collect();
        if !added.is_empty() {
            let _ = writeln!(s, "add element {t} {name} {{ {} }}", added.join(", "));
        }
    }
    for (name, rules) in &new.chains {
        match old.chains.get(name) {
            Some(o) if o == rules => continue,
            Some(_) => {
                let _ = writeln!(s, "flush chain {t} {name}");
            }
            None => {
                let _ = writeln!(s, "add chain {t} {name}");
            }
        }
        for r in rules {
            let _ = writeln!(s, "add rule {t} {name} {r}");
        }
    }
    for direction in [Direction::Egress, Direction::Ingress] {
        let map = dispatch_map(direction);
        let had: BTreeSet<String> = dispatch_elements(old, direction).into_iter().collect();
        let has: BTreeSet<String> = dispatch_elements(new, direction).into_iter().collect();
        let removed: Vec<&str> = had.difference(&has).map(|e| e.as_str()).collect();
        if !removed.is_empty() {
            let _ = writeln!(s, "delete element {t} {map} {{ {} }}", removed.join(", "));
        }
        let added: Vec<&str> = has.difference(&had).map(|e| e.as_str()).collect();
        if !added.is_empty() {
            let _ = writeln!(s, "add element {t} {map} {{ {} }}", added.join(", "));
        }
    }
    for name in old.chains.keys().filter(|n| !new.chains.contains_key(*n)) {
        let _ = writeln!(late, "flush chain {t} {name}");
        let _ = writeln!(late, "delete chain {t} {name}");
    }
    for name in old.sets.keys().filter(|n| !new.sets.contains_key(*n)) {
        let _ = writeln!(late, "delete set {t} {name}");
    }
    s.push_str(&late);
    Some(s)
}

/// The rules of one endpoint's chain for one direction.
fn endpoint_rules(
    ep: &Endpoint,
    direction: Direction,
    entries: &[(&PolicyEntry, u32)],
    sets: &BTreeMap<u32, PeerSet>,
) -> Vec<String> {
    let d = direction.as_u8();
    let c = |r: Reason| counter_name(d, r);
    let mut out = vec![format!(
        "icmpv6 type {ICMPV6_CONTROL} counter name \"{}\" return",
        c(Reason::Icmpv6Control)
    )];
    if direction == Direction::Egress {
        // Source validation: only the endpoint's own addresses may leave it.
        let spoofed = c(Reason::Spoofed);
        out.push(match ep.ipv4 {
            Some(a) => format!("ip saddr != {a} counter name \"{spoofed}\" drop"),
            None => format!("meta nfproto ipv4 counter name \"{spoofed}\" drop"),
        });
        out.push(match ep.ipv6 {
            Some(a) => format!("ip6 saddr != {a} counter name \"{spoofed}\" drop"),
            None => format!("meta nfproto ipv6 counter name \"{spoofed}\" drop"),
        });
    }
    out.push(format!(
        "ct state established,related counter name \"{}\" return",
        c(Reason::Tracked)
    ));
    out.push(format!(
        "ct state invalid counter name \"{}\" drop",
        c(Reason::Malformed)
    ));
    let isolated = match direction {
        Direction::Ingress => ep.isolated_ingress,
        Direction::Egress => ep.isolated_egress,
    };
    if !isolated {
        out.push(format!("counter name \"{}\" return", c(Reason::NotIsolated)));
        return out;
    }
    let (v4_peer, v6_peer) = match direction {
        Direction::Ingress => ("ip saddr", "ip6 saddr"),
        Direction::Egress => ("ip daddr", "ip6 daddr"),
    };
    if direction == Direction::Ingress {
        if let Some(host) = sets.get(&IDENTITY_HOST) {
            for (family, sel) in [(Family::V4, v4_peer), (Family::V6, v6_peer)] {
                if !host.elements(family).is_empty() {
                    out.push(format!(
                        "{sel} @{} counter name \"{}\" return",
                        set_name(IDENTITY_HOST, family),
                        c(Reason::Host)
                    ));
                }
            }
        }
    }
    for (entry, rule) in entries {
        let Some(l4) = l4_match(entry) else { continue };
        let tail = format!(
            "{l4} counter name \"{}\" return comment \"rule {rule}\"",
            c(Reason::Policy)
        );
        if entry.peer == IDENTITY_ANY {
            out.push(tail.trim_start().to_string());
            continue;
        }
        let Some(set) = sets.get(&entry.peer) else { continue };
        for (family, sel) in [(Family::V4, v4_peer), (Family::V6, v6_peer)] {
            let name = set_name(entry.peer, family);
            if entry.peer == IDENTITY_WORLD {
                out.push(format!("{sel} != @{name}{tail}"));
            } else if !set.elements(family).is_empty() {
                out.push(format!("{sel} @{name}{tail}"));
            }
        }
    }
    out.push(format!("counter name \"{}\" drop", c(Reason::PolicyDenied)));
    out
}
