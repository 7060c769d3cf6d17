//! Random compiled states for the differential tests of the dataplanes
//! against the compiler's reference of the datapath
//! (`npm_policy::lookup::lookup`): `nft_differential` (nftables) and
//! `ebpf_differential` (the eBPF programs) draw their policies here, from a
//! seeded generator, over the same addresses: three pods, the node and an
//! outside host with addresses in and out of the ipBlocks.
#![allow(dead_code)]

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use ipnet::IpNet;
use npm_common::{IDENTITY_ANY, IDENTITY_FIRST_CIDR, IDENTITY_HOST, IDENTITY_WORLD};
use npm_policy::compiled::{Compiled, Direction, IpEntry, Tier, TierAction, TierEntry, TierValue};
use npm_policy::model::Protocol;
use npm_policy::tiers::compile::{fold, Item};

use crate::netns_common::endpoint;
use crate::nft_common::allow;

/// The node's addresses (identity `IDENTITY_HOST`).
pub const NODE_IP: &str = "10.77.255.254";
/// The node's IPv6 address.
pub const NODE_IP6: &str = "fd77::ffff";

/// A pod of the random states: endpoint id and its addresses.
#[derive(Clone, Copy, Debug)]
pub struct Pod<'a> {
    /// Endpoint id (1..=3).
    pub ep: u32,
    /// Its IPv4 address.
    pub v4: &'a str,
    /// Its IPv6 address.
    pub v6: &'a str,
}

/// The three pods both differentials use.
pub const PODS: [Pod<'static>; 3] = [
    Pod {
        ep: 1,
        v4: "10.77.0.1",
        v6: "fd77::1",
    },
    Pod {
        ep: 2,
        v4: "10.77.0.2",
        v6: "fd77::2",
    },
    Pod {
        ep: 3,
        v4: "10.77.0.3",
        v6: "fd77::3",
    },
];

/// The outside host's addresses (in and out of the ipBlocks).
pub const OUTSIDE_V4: [&str; 3] = ["192.0.2.1", "192.0.2.130", "198.51.100.7"];
/// The outside host's IPv6 addresses.
pub const OUTSIDE_V6: [&str; 2] = ["2001:db8::1", "2001:db8:0:1::1"];

/// A small deterministic generator (xorshift64*).
pub struct Rng(pub u64);

impl Rng {
    /// The next value.
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// A value below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The ipBlock prefixes the random policies pick from (nested, both families).
///
/// `::/0` covers the IPv4-mapped range `::ffff:0:0/96` in which the reference
/// lookup (like the eBPF datapath) keeps IPv4 addresses; the compiler adds
/// `0.0.0.0/0` as a guard so that an IPv6 ipBlock never matches an IPv4
/// peer, as nftables (which keeps the families apart) and the API mean it.
pub const PREFIXES: [&str; 12] = [
    "::/0",
    "10.77.0.0/16",
    "10.77.0.0/30",
    "10.77.0.2/32",
    "192.0.2.0/24",
    "192.0.2.128/25",
    "0.0.0.0/0",
    "fd77::/64",
    "fd77::2/128",
    "2001:db8::/32",
    "2001:db8:0:1::/64",
    "2000::/3",
];

/// The CIDR identity of `ip`: its longest prefix among `cidrs`.
pub fn longest(cidrs: &BTreeMap<IpNet, u32>, ip: IpAddr) -> u32 {
    cidrs
        .iter()
        .filter(|(n, _)| n.contains(&ip))
        .max_by_key(|(n, _)| n.prefix_len())
        .map(|(_, id)| *id)
        .unwrap_or(IDENTITY_ANY)
}

/// A random NetworkPolicy state over `pods` and the node: a random subset
/// of [`PREFIXES`] as CIDR identities, the pods' and node's ipcache
/// entries, random isolation (pods 1 and 3 share an identity half of the
/// time, and then its isolation: isolation is the identity's), and 0 to 4
/// allow entries per pod and direction (peers: any, host, world, the pod
/// identities, the CIDR identities; any protocol, TCP or UDP; all ports,
/// an exact port in 998..=1007 or a range from there of up to `span`
/// ports).
pub fn random_policies(rng: &mut Rng, pods: &[Pod<'_>], span: u64) -> Compiled {
    let mut c = Compiled::default();
    for (k, p) in PREFIXES.iter().enumerate() {
        if rng.below(3) != 0 {
            c.cidrs.insert(p.parse().unwrap(), IDENTITY_FIRST_CIDR + k as u32);
        }
    }
    let add_ip = |c: &mut Compiled, a: &str, identity: u32| {
        let ip: IpAddr = a.parse().unwrap();
        let cidr_identity = longest(&c.cidrs, ip);
        c.ipcache.insert(
            ip,
            IpEntry {
                identity,
                cidr_identity,
                owner: 0,
            },
        );
    };
    add_ip(&mut c, NODE_IP, IDENTITY_HOST);
    add_ip(&mut c, NODE_IP6, IDENTITY_HOST);
    for pod in pods {
        let ep = pod.ep;
        // Pods 1 and 3 share an identity half of the time.
        let identity = if ep == 3 && rng.below(2) == 0 { 256 } else { 255 + ep };
        let name = format!("p{ep}");
        let (mut iso_in, mut iso_eg) = (rng.below(4) != 0, rng.below(2) == 0);
        if let Some(same) = c.endpoints.values().find(|e| e.identity == identity) {
            (iso_in, iso_eg) = (same.isolated_ingress, same.isolated_egress);
        }
        let e = endpoint(&name, identity, Some(pod.v4), Some(pod.v6), iso_in, iso_eg);
        c.endpoints.insert(ep, e);
        add_ip(&mut c, pod.v4, identity);
        add_ip(&mut c, pod.v6, identity);
    }
    let mut peers = vec![IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD, 256, 257, 258];
    peers.extend(c.cidrs.values().copied());
    for pod in pods {
        for dir in [Direction::Ingress, Direction::Egress] {
            for _ in 0..rng.below(5) {
                let peer = peers[rng.below(peers.len() as u64) as usize];
                let proto = match rng.below(4) {
                    0 => None,
                    1 | 2 => Some(Protocol::Tcp),
                    _ => Some(Protocol::Udp),
                };
                let lo = 998 + rng.below(10) as u16;
                let ports = match rng.below(3) {
                    0 => (0, u16::MAX),
                    1 => (lo, lo),
                    _ => (lo, lo + rng.below(span) as u16),
                };
                // Peer ANY without ports on ingress would make most probes pass: keep it rarer.
                if peer == IDENTITY_ANY && proto.is_none() && rng.below(3) != 0 {
                    continue;
                }
                allow(&mut c, pod.ep, dir, peer, proto, ports);
            }
        }
    }
    c
}

/// Port ranges a random tier rule may take besides all ports and exact
/// ports: a range over the edge of a 64-port block (960 = 15 * 64), one
/// inside a block, one over two blocks with edges, and one long one (many
/// fold classes).
const TIER_RANGES: [(u16, u16); 4] = [(950, 1000), (1000, 1010), (1010, 1100), (20_000, 40_000)];

/// Adds random ClusterNetworkPolicy tier entries to `c` (a state of
/// [`random_policies`]): per pod identity, direction and tier, none
/// (half of the time) or 1 to 5 rules, each a rank unique in its tier
/// (random priority in the compiler's rank layout, `priority << 20`), an
/// action (Accept, Deny, Pass), one or two peers (any, host, world, pod
/// and CIDR identities) and one protocol and port set (any protocol, a
/// whole protocol of TCP, UDP or SCTP, an exact port, a range of
/// [`TIER_RANGES`]). The rules of one (subject, direction, tier, peer)
/// overlap freely and are folded into entries by the compiler's own
/// `tiers::compile::fold` (disjoint ranges per protocol, each holding its
/// first rule: the compiled form's guarantee); the entries' endpoints get
/// their tier presence flags. Some endpoints also report new connections
/// (`report_new`).
pub fn add_random_tiers(rng: &mut Rng, c: &mut Compiled) {
    let mut peers = vec![IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD, 256, 257, 258];
    peers.extend(c.cidrs.values().copied());
    let subjects: BTreeSet<u32> = c.endpoints.values().map(|e| e.identity).collect();
    let mut serial = 0u32;
    let mut items: BTreeMap<(u32, Direction, Tier, u32), Vec<Item>> = BTreeMap::new();
    for subject in subjects {
        for direction in [Direction::Ingress, Direction::Egress] {
            for tier in [Tier::Admin, Tier::Baseline] {
                if rng.below(2) == 0 {
                    continue;
                }
                for _ in 0..1 + rng.below(5) {
                    serial += 1;
                    let rank = (1 + rng.below(60) as u32) << 20 | serial;
                    let action = match rng.below(3) {
                        0 => TierAction::Accept,
                        1 => TierAction::Deny,
                        _ => TierAction::Pass,
                    };
                    let protocol = match rng.below(6) {
                        0 => None,
                        1 | 2 => Some(Protocol::Tcp),
                        3 | 4 => Some(Protocol::Udp),
                        _ => Some(Protocol::Sctp),
                    };
                    let ports = match (protocol, rng.below(4)) {
                        (None, _) => (0, 0),
                        (_, 0) => (0, u16::MAX),
                        (_, 1) => {
                            let p = 998 + rng.below(10) as u16;
                            (p, p)
                        }
                        _ => TIER_RANGES[rng.below(TIER_RANGES.len() as u64) as usize],
                    };
                    let value = TierValue {
                        action,
                        rank,
                        rule: 10_000 + serial,
                    };
                    for _ in 0..1 + rng.below(2) {
                        let peer = peers[rng.below(peers.len() as u64) as usize];
                        items.entry((subject, direction, tier, peer)).or_default().push(Item {
                            protocol,
                            ports,
                            value,
                        });
                    }
                }
                for e in c.endpoints.values_mut().filter(|e| e.identity == subject) {
                    e.tiers.set(tier, direction);
                }
            }
        }
    }
    for ((subject, direction, tier, peer), items) in items {
        for (protocol, ports, value) in fold(&items) {
            c.tiers.insert(
                TierEntry {
                    subject,
                    direction,
                    tier,
                    peer,
                    protocol,
                    ports,
                },
                value,
            );
        }
    }
    for e in c.endpoints.values_mut() {
        e.report_new = rng.below(4) == 0;
    }
}

/// A small change of `c` (a state of [`random_policies`] and
/// [`add_random_tiers`]), as one incremental update makes: 1 to 3 of
/// removing a tier entry, changing a tier rule's action (in all its entries), removing a
/// NetworkPolicy entry, adding one (any peer of [`random_policies`], TCP
/// or UDP, one port of 998..=1007), or removing a CIDR prefix (the
/// ipcache's CIDR identities follow). What is left stays in the compiled
/// form's guarantees (disjoint tier ranges per protocol).
pub fn mutate(rng: &mut Rng, c: &Compiled) -> Compiled {
    let mut c = c.clone();
    for _ in 0..1 + rng.below(3) {
        match rng.below(5) {
            0 | 1 if !c.tiers.is_empty() => {
                let k = *c
                    .tiers
                    .keys()
                    .nth(rng.below(c.tiers.len() as u64) as usize)
                    .expect("entry");
                if rng.below(2) == 0 {
                    c.tiers.remove(&k);
                } else if let Some(&v) = c.tiers.get(&k) {
                    // A rule changes its action in all its entries: ranks
                    // are unique per tier and direction
                    // (`tiers::compile::ranked_rules`), so two entries of
                    // one rank with different actions are a state no
                    // compiler makes (the datapath and the lookup may
                    // break that tie differently).
                    let action = match v.action {
                        TierAction::Accept => TierAction::Deny,
                        TierAction::Deny => TierAction::Pass,
                        TierAction::Pass => TierAction::Accept,
                    };
                    for (e, w) in c.tiers.iter_mut() {
                        if e.tier == k.tier && e.direction == k.direction && w.rank == v.rank {
                            w.action = action;
                        }
                    }
                }
            }
            2 if !c.policy.is_empty() => {
                let k = *c
                    .policy
                    .keys()
                    .nth(rng.below(c.policy.len() as u64) as usize)
                    .expect("entry");
                c.policy.remove(&k);
            }
            3 => {
                let mut peers = vec![IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD, 256, 257, 258];
                peers.extend(c.cidrs.values().copied());
                let ep = 1 + rng.below(3) as u32;
                if c.endpoints.contains_key(&ep) {
                    let peer = peers[rng.below(peers.len() as u64) as usize];
                    let dir = if rng.below(2) == 0 {
                        Direction::Ingress
                    } else {
                        Direction::Egress
                    };
                    let proto = if rng.below(2) == 0 {
                        Protocol::Tcp
                    } else {
                        Protocol::Udp
                    };
                    let port = 998 + rng.below(10) as u16;
                    allow(&mut c, ep, dir, peer, Some(proto), (port, port));
                }
            }
            _ if !c.cidrs.is_empty() => {
                let k = *c
                    .cidrs
                    .keys()
                    .nth(rng.below(c.cidrs.len() as u64) as usize)
                    .expect("prefix");
                c.cidrs.remove(&k);
                let cidrs = c.cidrs.clone();
                for (ip, e) in c.ipcache.iter_mut() {
                    e.cidr_identity = longest(&cidrs, *ip);
                }
            }
            _ => {}
        }
    }
    c
}

/// The random state of `round` under `seed`, after `prev`: every other
/// round a new one ([`random_policies`] and [`add_random_tiers`] over
/// [`PODS`]), the others a small change of `prev` ([`mutate`]: what one
/// incremental update of the agent writes, the case where a layer the
/// writer forgets to refresh keeps a stale decision).
pub fn random_state(seed: u64, round: u64, prev: &Compiled) -> Compiled {
    // Never 0 (xorshift would stay there).
    let mut rng = Rng((seed ^ (round + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15)) | 1);
    if round % 2 == 1 {
        return mutate(&mut rng, prev);
    }
    let mut c = random_policies(&mut rng, &PODS, 200);
    add_random_tiers(&mut rng, &mut c);
    c
}
