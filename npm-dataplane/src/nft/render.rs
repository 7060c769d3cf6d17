//! Rendering of a compiled policy as one `nft -f` script (see the module
//! documentation of [`super`] for the layout of the tables): the `inet`
//! table that takes every verdict, and the `bridge` table that binds each
//! bridge port to its endpoint's addresses (source validation of bridged
//! pods, the one check that needs the port).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;

use npm_common::{Reason, DIR_EGRESS, DIR_INGRESS, IDENTITY_ANY, IDENTITY_FIRST_CIDR, IDENTITY_HOST, IDENTITY_WORLD};
use npm_policy::compiled::{Compiled, Direction, Endpoint, PolicyEntry, Tier};

use super::chain::{
    chain_name_from, decides_original_source, endpoint_rules, group_tiers, original_source_rules, tier_chain_name_from,
    tier_rules, Source, TierJumps, TIER_REASONS,
};
use super::ranges::{family_of, family_of_addr, prefix_range, range_element, subtract, Family};
use super::{CounterMap, NftOptions};
use crate::Interfaces;

/// ICMPv6 neighbour discovery and MLD types, exempt from source validation
/// and policy (the datapath's `Icmpv6Control`).
pub(super) const ICMPV6_CONTROL: &str =
    "{ mld-listener-query, mld-listener-report, mld-listener-done, nd-router-solicit, \
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
            Reason::CutFlow,
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
            Reason::CutFlow,
        ]
    }
}

/// Name of the chain of an endpoint and a direction, e.g. `ep_7_in`.
pub fn chain_name(endpoint: u32, direction: Direction) -> String {
    format!("ep_{}_{}", endpoint, dir_tag(direction.as_u8()))
}

/// Name of the set of `identity`'s addresses of one family.
pub(super) fn set_name(identity: u32, family: Family) -> String {
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
pub(super) struct PeerSet {
    v4: Vec<String>,
    v6: Vec<String>,
    interval: bool,
}

impl PeerSet {
    pub(super) fn elements(&self, family: Family) -> &[String] {
        match family {
            Family::V4 => &self.v4,
            Family::V6 => &self.v6,
        }
    }
}

/// Ranges of one identity: (IPv4, IPv6).
type RangesByFamily = (Vec<(u128, u128)>, Vec<(u128, u128)>);

/// Computes the address sets of every identity that `compiled` references
/// as a policy or tier peer, plus [`IDENTITY_HOST`] (host ingress).
fn peer_sets(compiled: &Compiled) -> BTreeMap<u32, PeerSet> {
    let mut wanted: BTreeSet<u32> = compiled.policy.keys().map(|e| e.peer).collect();
    wanted.extend(compiled.tiers.keys().map(|e| e.peer));
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

/// The tables as objects: what [`full_script`] writes and what
/// [`incremental_script`] compares. Counters and base chains are fixed.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(crate) struct Model {
    /// Peer sets by name.
    sets: BTreeMap<String, SetDef>,
    /// Endpoint chains by name: their rules.
    chains: BTreeMap<String, Vec<String>>,
    /// Dispatch: ifindex -> endpoint id.
    dispatch: BTreeMap<u32, u32>,
    /// Dispatch of traffic seen on a bridge device (bridged pods): address
    /// -> endpoint id, for the endpoints that have a dispatch entry.
    by_addr: BTreeMap<IpAddr, u32>,
    /// Port chains of the `bridge` table by name (source validation).
    port_chains: BTreeMap<String, Vec<String>>,
    /// Some endpoint has a tier chain: the tier counters are needed.
    tier_counters: bool,
}

/// Builds the objects of the table for `compiled`.
///
/// Endpoints get a dispatch entry only when `interfaces` has their ifindex
/// (an ifindex claimed by two endpoints goes to the lower id). Each
/// endpoint's chains hold the policy entries of its subject (the entries
/// with `subject` equal to its `identity`); entries of a subject no
/// endpoint has and entries with an empty port range match nothing and are
/// not rendered.
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
    // The entries of each (subject, direction): every endpoint of that
    // subject (its pod identity) gets them in its own chain, so the log
    // prefixes, `report_new` and the deny counter stay the endpoint's.
    let mut entries: BTreeMap<(u32, Direction), Vec<(&PolicyEntry, u32)>> = BTreeMap::new();
    for (entry, rule) in &compiled.policy {
        entries
            .entry((entry.subject, entry.direction))
            .or_default()
            .push((entry, *rule));
    }
    let tiers = group_tiers(&compiled.tiers);
    for (id, ep) in &compiled.endpoints {
        for direction in [Direction::Ingress, Direction::Egress] {
            let list = entries.get(&(ep.identity, direction)).map(Vec::as_slice).unwrap_or(&[]);
            // The chains deciding on the packet's source, and for ingress
            // their copies deciding on a source-NATed connection's original
            // source (`chain::Source`).
            let mut per_source = vec![(Source::Packet, TierJumps::default())];
            if direction == Direction::Ingress {
                per_source.push((Source::Original, TierJumps::default()));
            }
            for (source, jumps) in &mut per_source {
                for tier in [Tier::Admin, Tier::Baseline] {
                    // The endpoint's flag decides, as in the datapath (the
                    // compiler sets it iff the tier has entries).
                    if !ep.tiers.has(tier, direction) {
                        continue;
                    }
                    let tl = tiers
                        .get(&(ep.identity, direction, tier))
                        .map_or(&[][..], Vec::as_slice);
                    let name = tier_chain_name_from(*id, direction, tier, *source);
                    m.chains.insert(
                        name.clone(),
                        tier_rules(*id, ep.report_new, direction, tier, tl, &peer, *source),
                    );
                    match tier {
                        Tier::Admin => jumps.admin = Some(name),
                        Tier::Baseline => jumps.baseline = Some(name),
                    }
                    m.tier_counters = true;
                }
            }
            let jumps = &per_source[0].1;
            m.chains.insert(
                chain_name(*id, direction),
                endpoint_rules(*id, ep, direction, list, jumps, &peer),
            );
            // (An ingress chain with tier chains always decides: the `_nat`
            // tier chains above are never left without their caller.)
            if let (true, Some((_, nat_jumps))) = (decides_original_source(ep, direction, jumps), per_source.get(1)) {
                m.chains.insert(
                    chain_name_from(*id, direction, Source::Original),
                    original_source_rules(*id, ep, list, nat_jumps, &peer),
                );
            }
        }
        if let Some(ifindex) = interfaces.get(id) {
            if *m.dispatch.entry(*ifindex).or_insert(*id) == *id {
                let addrs = [ep.ipv4.map(IpAddr::V4), ep.ipv6.map(IpAddr::V6)];
                for a in addrs.into_iter().flatten() {
                    m.by_addr.entry(a).or_insert(*id);
                }
                m.port_chains.insert(port_chain_name(*id), port_rules(ep));
            }
        }
    }
    m
}

/// Name of the `bridge` table's chain of an endpoint's port, e.g. `port_7`.
fn port_chain_name(endpoint: u32) -> String {
    format!("port_{endpoint}")
}

/// The rules of an endpoint's port chain in the `bridge` table: frames the
/// port receives from the pod must carry the endpoint's own source address
/// (ICMPv6 neighbour discovery and MLD excepted, as in the endpoint
/// chains). `meta protocol`, not `meta nfproto`: in the bridge family the
/// latter is always `bridge`. Non-IP frames (ARP) are left alone, as the
/// eBPF datapath leaves them.
fn port_rules(ep: &Endpoint) -> Vec<String> {
    let spoofed = counter_name(DIR_EGRESS, Reason::Spoofed);
    vec![
        format!("icmpv6 type {ICMPV6_CONTROL} return"),
        match ep.ipv4 {
            Some(a) => format!("ip saddr != {a} counter name \"{spoofed}\" drop"),
            None => format!("meta protocol ip counter name \"{spoofed}\" drop"),
        },
        match ep.ipv6 {
            Some(a) => format!("ip6 saddr != {a} counter name \"{spoofed}\" drop"),
            None => format!("meta protocol ip6 counter name \"{spoofed}\" drop"),
        },
    ]
}

/// Renders `compiled` as an `nft -f` script that replaces the tables
/// `opts.table` (families `inet` and `bridge`) atomically: the script
/// creates each table if missing, deletes it and adds it again, all in one
/// transaction.
///
/// Endpoints get a dispatch entry only when `interfaces` has their ifindex;
/// each endpoint chain holds the policy entries of the endpoint's subject
/// (its pod identity); entries of a subject no endpoint of
/// `compiled.endpoints` has and entries with an empty port range match
/// nothing and are not rendered. The output
/// is deterministic (everything is rendered in map order).
pub fn render(compiled: &Compiled, interfaces: &Interfaces, opts: &NftOptions) -> String {
    full_script(
        &model(compiled, interfaces),
        &opts.table,
        &CounterMap::new(),
        &CounterMap::new(),
    )
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

/// Name of the by-address dispatch verdict map of a direction and family.
fn bridged_map(direction: Direction, family: Family) -> &'static str {
    match (direction, family) {
        (Direction::Egress, Family::V4) => "bridged_out_v4",
        (Direction::Egress, Family::V6) => "bridged_out_v6",
        (Direction::Ingress, Family::V4) => "bridged_in_v4",
        (Direction::Ingress, Family::V6) => "bridged_in_v6",
    }
}

fn bridged_elements(m: &Model, direction: Direction, family: Family) -> Vec<String> {
    m.by_addr
        .iter()
        .filter(|(a, _)| family_of_addr(a) == family)
        .map(|(a, id)| format!("{a} : jump {}", chain_name(*id, direction)))
        .collect()
}

fn port_elements(m: &Model) -> Vec<String> {
    m.dispatch
        .iter()
        .map(|(ifindex, id)| format!("{ifindex} : jump {}", port_chain_name(*id)))
        .collect()
}

/// The element-level difference of one map or set: a delete of what `had`
/// has and `has` lacks, then an add of the reverse.
fn element_diff(s: &mut String, target: &str, had: Vec<String>, has: Vec<String>) {
    let had: BTreeSet<String> = had.into_iter().collect();
    let has: BTreeSet<String> = has.into_iter().collect();
    let removed: Vec<&str> = had.difference(&has).map(|e| e.as_str()).collect();
    if !removed.is_empty() {
        let _ = writeln!(s, "delete element {target} {{ {} }}", removed.join(", "));
    }
    let added: Vec<&str> = has.difference(&had).map(|e| e.as_str()).collect();
    if !added.is_empty() {
        let _ = writeln!(s, "add element {target} {{ {} }}", added.join(", "));
    }
}

/// Writes `map <name> { type <ty> : verdict; elements }`.
fn verdict_map(s: &mut String, name: &str, ty: &str, elems: &[String]) {
    let _ = writeln!(s, "\tmap {name} {{");
    let _ = writeln!(s, "\t\ttype {ty} : verdict");
    if !elems.is_empty() {
        let _ = writeln!(s, "\t\telements = {{ {} }}", elems.join(", "));
    }
    let _ = writeln!(s, "\t}}");
}

/// The script replacing the tables with `m`, the named counters starting
/// at `counters` (the `inet` table's) and `bridge_counters` (the `bridge`
/// table's): the values of the tables being replaced, so totals survive.
pub(crate) fn full_script(m: &Model, table: &str, counters: &CounterMap, bridge_counters: &CounterMap) -> String {
    let mut s = String::new();
    // Writing into a String cannot fail; `let _ =` keeps that explicit.
    let _ = writeln!(s, "# npm nftables dataplane: generated, do not edit");
    let _ = writeln!(s, "table inet {table} {{}}");
    let _ = writeln!(s, "delete table inet {table}");
    let _ = writeln!(s, "table bridge {table} {{}}");
    let _ = writeln!(s, "delete table bridge {table}");
    let _ = writeln!(s, "table inet {table} {{");

    let counter = |s: &mut String, counters: &CounterMap, dir: u8, reason: Reason| {
        let _ = writeln!(s, "\tcounter {} {{", counter_name(dir, reason));
        if let Some((packets, bytes)) = counters.get(&(dir, reason as u8)) {
            let _ = writeln!(s, "\t\tpackets {packets} bytes {bytes}");
        }
        let _ = writeln!(s, "\t}}");
    };
    // Named counters, one per direction and reason that the chains use;
    // the tier counters when a chain uses them or the replaced table had
    // them (their totals carry on).
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        for reason in counted_reasons(dir) {
            counter(&mut s, counters, dir, *reason);
        }
    }
    let had_tiers = counters
        .keys()
        .any(|(_, r)| TIER_REASONS.iter().any(|t| *t as u8 == *r));
    if m.tier_counters || had_tiers {
        for dir in [DIR_INGRESS, DIR_EGRESS] {
            for reason in TIER_REASONS {
                counter(&mut s, counters, dir, reason);
            }
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
    chains(&mut s, &m.chains);
    // Dispatch by ifindex through verdict maps: one lookup per packet and hook.
    for direction in [Direction::Egress, Direction::Ingress] {
        verdict_map(
            &mut s,
            dispatch_map(direction),
            "iface_index",
            &dispatch_elements(m, direction),
        );
    }
    // Dispatch of bridged pods by address (see the module documentation).
    for direction in [Direction::Egress, Direction::Ingress] {
        for (family, ty) in [(Family::V4, "ipv4_addr"), (Family::V6, "ipv6_addr")] {
            let elems = bridged_elements(m, direction, family);
            verdict_map(&mut s, bridged_map(direction, family), ty, &elems);
        }
    }
    let base = |s: &mut String, name: &str, hook: &str, priority: &str, direction: Direction| {
        let _ = writeln!(s, "\tchain {name} {{");
        let _ = writeln!(s, "\t\ttype filter hook {hook} priority {priority}; policy accept;");
        // The pod is the source of its egress (the input interface), the
        // destination of its ingress (the output interface).
        let (dev, addr) = match direction {
            Direction::Egress => ("iif", "saddr"),
            Direction::Ingress => ("oif", "daddr"),
        };
        // A connection cut under `enforce` (`conntrack.rs`): dropped, both
        // ways, whatever its state (an ICMP error related to it too: the
        // kernel gives it the connection's entry, and so its mark), each
        // packet counted as `cut-flow` of the hook's direction.
        let cut = super::conntrack::CT_MARK_CUT;
        let _ = writeln!(
            s,
            "\t\tct mark & 0x{cut:08x} == 0x{cut:08x} counter name \"{}\" drop",
            counter_name(direction.as_u8(), Reason::CutFlow)
        );
        let _ = writeln!(s, "\t\t{dev} vmap @{}", dispatch_map(direction));
        for (family, ip) in [(Family::V4, "ip"), (Family::V6, "ip6")] {
            let map = bridged_map(direction, family);
            let _ = writeln!(s, "\t\tmeta {dev}kind \"bridge\" {ip} {addr} vmap @{map}");
        }
        let _ = writeln!(s, "\t}}");
    };
    // Egress, before any NAT of the way out: pod -> other pods and the
    // world (forward), pod -> this node (input).
    base(&mut s, "base_forward", "forward", "filter", Direction::Egress);
    base(&mut s, "base_input", "input", "filter", Direction::Egress);
    // Ingress, after every NAT (kube-proxy's masquerade is nat postrouting,
    // priority srcnat): on the source the pod sees, as the eBPF datapath's
    // `to_pod`. Forwarded, locally generated and (br_netfilter) bridged
    // packets all pass postrouting, each once.
    base(
        &mut s,
        "base_postrouting",
        "postrouting",
        INGRESS_PRIORITY,
        Direction::Ingress,
    );
    let _ = writeln!(s, "}}");

    // The bridge table: source validation on the bridge ports, before
    // br_netfilter and conntrack (bridge prerouting, priority filter = -200).
    let _ = writeln!(s, "table bridge {table} {{");
    counter(&mut s, bridge_counters, DIR_EGRESS, Reason::Spoofed);
    chains(&mut s, &m.port_chains);
    verdict_map(&mut s, PORTS_MAP, "iface_index", &port_elements(m));
    let _ = writeln!(s, "\tchain base_prerouting {{");
    let _ = writeln!(s, "\t\ttype filter hook prerouting priority filter; policy accept;");
    let _ = writeln!(s, "\t\tiif vmap @{PORTS_MAP}");
    let _ = writeln!(s, "\t}}");
    let _ = writeln!(s, "}}");
    s
}

/// Priority of the ingress base chain (hook postrouting): just after source
/// NAT (`srcnat`, 100), so the verdict is on the source the pod sees.
const INGRESS_PRIORITY: &str = "srcnat + 1";

/// Name of the `bridge` table's dispatch map (port ifindex -> port chain).
const PORTS_MAP: &str = "ports";

/// Writes regular chains with their rules.
fn chains(s: &mut String, chains: &BTreeMap<String, Vec<String>>) {
    for (name, rules) in chains {
        let _ = writeln!(s, "\tchain {name} {{");
        for r in rules {
            let _ = writeln!(s, "\t\t{r}");
        }
        let _ = writeln!(s, "\t}}");
    }
}

/// The script that turns the table holding `old` into one holding `new`,
/// touching only what differs, as one transaction (`None`: nothing differs).
/// Counters are left alone, so they keep counting.
///
/// Order: new sets and added elements first (rules may reference them),
/// then new and changed chains of both tables (a changed chain is flushed
/// and refilled), then the dispatch changes (by ifindex, by address, by
/// port; removals before additions, so an address or ifindex that changes
/// owner is re-pointed), then removed chains and sets (nothing references
/// them any more).
pub(crate) fn incremental_script(old: &Model, new: &Model, table: &str) -> Option<String> {
    if old == new {
        return None;
    }
    let t = format!("inet {table}");
    let mut s = String::new();
    let mut late = String::new();
    if new.tier_counters && !old.tier_counters {
        // `add` leaves a counter that exists (a table that had tiers) as it is.
        for dir in [DIR_INGRESS, DIR_EGRESS] {
            for reason in TIER_REASONS {
                let _ = writeln!(s, "add counter {t} {}", counter_name(dir, reason));
            }
        }
    }
    for (name, set) in &new.sets {
        let old_set = old
            .sets
            .get(name)
            .filter(|o| o.ty == set.ty && o.interval == set.interval);
        let had: Vec<&String> = old_set.map(|o| o.elements.iter().collect()).unwrap_or_default();
        if old_set.is_none() {
            if old.sets.contains_key(name) {
                let _ = writeln!(s, "delete set {t} {name}");
            }
            let flags = if set.interval { " flags interval;" } else { "" };
            let _ = writeln!(s, "add set {t} {name} {{ type {};{flags} }}", set.ty);
        }
        // Removals before additions: an interval set rejects overlapping elements.
        let had = had.into_iter().cloned().collect();
        element_diff(&mut s, &format!("{t} {name}"), had, set.elements.clone());
    }
    let b = format!("bridge {table}");
    chain_diff(&mut s, &mut late, &t, &old.chains, &new.chains);
    chain_diff(&mut s, &mut late, &b, &old.port_chains, &new.port_chains);
    for direction in [Direction::Egress, Direction::Ingress] {
        let target = format!("{t} {}", dispatch_map(direction));
        element_diff(
            &mut s,
            &target,
            dispatch_elements(old, direction),
            dispatch_elements(new, direction),
        );
        for family in [Family::V4, Family::V6] {
            let target = format!("{t} {}", bridged_map(direction, family));
            let had = bridged_elements(old, direction, family);
            element_diff(&mut s, &target, had, bridged_elements(new, direction, family));
        }
    }
    element_diff(
        &mut s,
        &format!("{b} {PORTS_MAP}"),
        port_elements(old),
        port_elements(new),
    );
    for name in old.sets.keys().filter(|n| !new.sets.contains_key(*n)) {
        let _ = writeln!(late, "delete set {t} {name}");
    }
    s.push_str(&late);
    // Only `tier_counters` changed (the counters stay): nothing to send.
    (!s.is_empty()).then_some(s)
}

/// The commands turning the regular chains `old` of `target` (`<family>
/// <table>`) into `new`: new and changed chains into `s` (a changed chain is
/// flushed and refilled), removed ones into `late` (after the dispatch
/// changes, once nothing jumps to them).
fn chain_diff(
    s: &mut String,
    late: &mut String,
    target: &str,
    old: &BTreeMap<String, Vec<String>>,
    new: &BTreeMap<String, Vec<String>>,
) {
    // Every new chain exists before any rule is added: a rule may jump to
    // a chain that sorts after its own (`ep_1_in` -> `ep_1_in_admin`).
    for name in new.keys().filter(|n| !old.contains_key(*n)) {
        let _ = writeln!(s, "add chain {target} {name}");
    }
    for (name, rules) in new {
        match old.get(name) {
            Some(o) if o == rules => continue,
            Some(_) => {
                let _ = writeln!(s, "flush chain {target} {name}");
            }
            None => {}
        }
        for r in rules {
            let _ = writeln!(s, "add rule {target} {name} {r}");
        }
    }
    for name in old.keys().filter(|n| !new.contains_key(*n)) {
        let _ = writeln!(late, "flush chain {target} {name}");
        let _ = writeln!(late, "delete chain {target} {name}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_policy::compiled::{IpEntry, PodRef};
    use npm_policy::model::Protocol;

    fn endpoint(name: &str, identity: u32, v4: &str, isolated_ingress: bool) -> Endpoint {
        Endpoint {
            pod: PodRef {
                namespace: "n".into(),
                name: name.into(),
                uid: name.into(),
            },
            identity,
            ipv4: Some(v4.parse().unwrap()),
            ipv6: None,
            isolated_ingress,
            isolated_egress: false,
            tiers: Default::default(),
            report_new: false,
        }
    }

    /// The entries of a subject reach the chain of every endpoint of that
    /// pod identity, and no other endpoint's; each chain keeps its own
    /// endpoint's log prefix, and an entry of a subject without an endpoint
    /// renders nothing.
    #[test]
    fn endpoint_chains_hold_their_subjects_entries() {
        let mut c = Compiled::default();
        c.endpoints.insert(1, endpoint("a", 300, "10.0.0.1", true));
        c.endpoints.insert(2, endpoint("b", 300, "10.0.0.2", true));
        c.endpoints.insert(3, endpoint("c", 301, "10.0.0.3", true));
        for (addr, identity) in [("10.0.0.1", 300), ("10.0.0.2", 300), ("10.0.0.3", 301)] {
            c.ipcache.insert(
                addr.parse().unwrap(),
                IpEntry {
                    identity,
                    cidr_identity: 0,
                    owner: 0,
                },
            );
        }
        let entry = |subject, ports| PolicyEntry {
            subject,
            direction: Direction::Ingress,
            peer: 301,
            protocol: Some(Protocol::Tcp),
            ports,
        };
        c.policy.insert(entry(300, (80, 80)), 7);
        c.policy.insert(entry(301, (443, 443)), 8);
        c.policy.insert(entry(999, (22, 22)), 9);
        let m = model(&c, &Interfaces::new());
        let rule = |chain: &str, r: u32| {
            m.chains[chain]
                .iter()
                .filter(|l| l.ends_with(&format!("comment \"rule {r}\"")))
                .count()
        };
        for chain in ["ep_1_in", "ep_2_in"] {
            assert_eq!((rule(chain, 7), rule(chain, 8), rule(chain, 9)), (1, 0, 0), "{chain}");
        }
        assert_eq!((rule("ep_3_in", 7), rule("ep_3_in", 8), rule("ep_3_in", 9)), (0, 1, 0));
        let as_ep1: Vec<String> = m.chains["ep_2_in"]
            .iter()
            .map(|l| l.replace("npm:2:", "npm:1:").replace("ep_2_in_nat", "ep_1_in_nat"))
            .collect();
        assert_eq!(
            m.chains["ep_1_in"], as_ep1,
            "the same rules, each with its own endpoint's log prefix"
        );
        assert!(m.chains["ep_2_in"].iter().any(|l| l.contains("npm:2:")));
    }

    /// An isolated endpoint's ingress chain sends a source-NATed connection
    /// to its copy deciding on conntrack's original source, where only a
    /// host (or loopback) original source is admitted as the host and the
    /// policy's peers are matched on the original source; an endpoint not
    /// isolated has no copy; egress has none.
    #[test]
    fn source_nated_connections_are_decided_on_their_original_source() {
        let mut c = Compiled::default();
        c.endpoints.insert(1, endpoint("a", 300, "10.0.0.1", true));
        c.endpoints.insert(2, endpoint("b", 301, "10.0.0.2", false));
        for (addr, identity) in [("10.0.0.1", 300), ("10.0.0.2", 301), ("10.0.255.1", IDENTITY_HOST)] {
            c.ipcache.insert(
                addr.parse().unwrap(),
                IpEntry {
                    identity,
                    cidr_identity: 0,
                    owner: 0,
                },
            );
        }
        c.policy.insert(
            PolicyEntry {
                subject: 300,
                direction: Direction::Ingress,
                peer: 301,
                protocol: Some(Protocol::Tcp),
                ports: (80, 80),
            },
            7,
        );
        let m = model(&c, &Interfaces::new());
        let main = &m.chains["ep_1_in"];
        let goto = main.iter().position(|r| r == "ct status snat goto ep_1_in_nat");
        let host = main.iter().position(|r| r.starts_with("ip saddr @id_2_v4"));
        assert!(
            goto.is_some() && goto < host,
            "the goto comes before host admission: {main:#?}"
        );
        assert_eq!(
            m.chains["ep_1_in_nat"],
            [
                "ct original ip saddr @id_2_v4 counter name \"in_host\" return",
                "ct original ip saddr 127.0.0.0/8 counter name \"in_host\" return",
                "ct original ip6 saddr ::1 counter name \"in_host\" return",
                "ct original ip saddr @id_301_v4 meta l4proto tcp th dport 80 counter name \"in_policy\" counter return comment \"rule 7\"",
                "limit rate 100/second burst 32 packets log prefix \"npm:1:0:16 \" group 20048",
                "counter name \"in_policy_denied\" counter drop",
            ]
        );
        assert!(!m.chains.contains_key("ep_2_in_nat"), "not isolated: no copy");
        assert!(!m.chains["ep_2_in"].iter().any(|r| r.contains("snat")));
        assert!(!m.chains.contains_key("ep_1_out_nat"), "egress: no copy");
    }
}
