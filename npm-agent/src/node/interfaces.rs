//! Local endpoints and their host-side interfaces.
//!
//! A local endpoint is a pod with `spec.nodeName == NODE_NAME`, not
//! hostNetwork, with an IP (the compiler decides which pods are endpoints;
//! this module only finds their interfaces). The [`InterfaceResolver`]
//! reads the kernel through one netlink socket, reused for every
//! resolution: the links and the default routes (one dump each), the route
//! lookup of every endpoint address (sent in batches), and, when a route
//! points at a bridge, the neighbour entries and the bridges' forwarding
//! database; [`discovery`](super::discovery) states the rules that pick a
//! veth host peer, or nothing. With `--interface-pattern`, the interface
//! name must also match the pattern.
//!
//! - An endpoint whose interface is not found is left out of what is
//!   programmed and retried on the next sync.
//! - When the answer is not known (a netlink error, or a bridged pod whose
//!   MAC is not learned yet), the endpoint keeps its previous interface if
//!   that interface is still there as it was (a cache of last good
//!   answers, by endpoint id): an error never drops an endpoint.
//! - An endpoint that was attached before keeps its previous interface
//!   while that veth is still there as it was, whatever a later lookup says
//!   (no route, a refused interface): it stays enforced (fail closed). An
//!   endpoint never attached stays attached nowhere until found.
//! - An ifindex claimed by several endpoints goes to the CNI-attached
//!   endpoint if there is one, else to the incumbent (the endpoint whose
//!   last good answer was that ifindex); the newcomers are refused there
//!   (they fall back on their own previous interface if still valid). With
//!   no incumbent, it is refused for all. Conflicts are logged and counted
//!   (`npm_interface_conflicts_total`, once per new conflict). A refused
//!   answer is never stored as a last good one.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::net::IpAddr;

use npm_dataplane::Interfaces;
use npm_policy::compiled::Compiled;

use super::discovery::{bridge_step, route_step, still_valid, Found, KernelView, Outcome, RouteStep};
use super::netlink::{Netlink, NetlinkError};

/// Errors of interface resolution.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// The interface pattern is not a valid glob.
    #[error("--interface-pattern {pattern:?}: {detail}")]
    Pattern {
        /// The pattern.
        pattern: String,
        /// What is wrong.
        detail: String,
    },
}

/// An interface name pattern: `*` matches any run of characters, `?` one character.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InterfacePattern(String);

impl InterfacePattern {
    /// Parse a pattern (non-empty, at most 15 characters of an interface name plus wildcards).
    pub fn new(pattern: &str) -> Result<Self, EndpointError> {
        if pattern.is_empty() || pattern.contains('/') || pattern.contains(char::is_whitespace) {
            return Err(EndpointError::Pattern {
                pattern: pattern.into(),
                detail: "must be a non-empty interface name glob without '/' or spaces".into(),
            });
        }
        Ok(InterfacePattern(pattern.into()))
    }

    /// Whether `name` matches.
    pub fn matches(&self, name: &str) -> bool {
        fn m(p: &[u8], s: &[u8]) -> bool {
            match (p.first(), s.first()) {
                (None, None) => true,
                (Some(b'*'), _) => m(&p[1..], s) || (!s.is_empty() && m(p, &s[1..])),
                (Some(b'?'), Some(_)) => m(&p[1..], &s[1..]),
                (Some(a), Some(b)) if a == b => m(&p[1..], &s[1..]),
                _ => false,
            }
        }
        m(self.0.as_bytes(), name.as_bytes())
    }
}

/// Finds the interfaces of the endpoints of a compiled state.
pub trait Resolve: Send {
    /// Endpoint id -> ifindex for every endpoint whose interface exists.
    fn resolve(&mut self, compiled: &Compiled) -> Resolved;

    /// Like [`resolve`](Resolve::resolve), with `attached` (endpoint id ->
    /// ifindex, the CNI-reported veths) taking precedence: an attached
    /// endpoint is on its veth, and no other endpoint is attached there.
    fn resolve_attached(&mut self, compiled: &Compiled, attached: &Interfaces) -> Resolved {
        let mut resolved = self.resolve(compiled);
        apply_attached(&mut resolved, attached);
        resolved
    }

    /// Interface conflicts (an ifindex claimed by several endpoints) first
    /// seen since the last call, for `npm_interface_conflicts_total`.
    fn take_new_conflicts(&mut self) -> u64 {
        0
    }
}

impl Resolve for InterfaceResolver {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        InterfaceResolver::resolve(self, compiled)
    }

    fn resolve_attached(&mut self, compiled: &Compiled, attached: &Interfaces) -> Resolved {
        InterfaceResolver::resolve_attached(self, compiled, attached)
    }

    fn take_new_conflicts(&mut self) -> u64 {
        std::mem::take(&mut self.new_conflicts)
    }
}

/// Interfaces found for a compiled state, and the endpoints still missing one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Endpoint id -> ifindex.
    pub interfaces: Interfaces,
    /// Endpoint ids whose interface is not found yet.
    pub missing: Vec<u32>,
}

/// Put the `attached` endpoints (id -> ifindex) on their interfaces in
/// `resolved`, and drop every other endpoint found on one of those
/// interfaces (it becomes missing).
pub fn apply_attached(resolved: &mut Resolved, attached: &Interfaces) {
    if attached.is_empty() {
        return;
    }
    let taken: BTreeSet<u32> = attached.values().copied().collect();
    let dropped: Vec<u32> = resolved
        .interfaces
        .iter()
        .filter(|(id, ifindex)| !attached.contains_key(id) && taken.contains(ifindex))
        .map(|(id, _)| *id)
        .collect();
    for id in dropped {
        resolved.interfaces.remove(&id);
        resolved.missing.push(id);
    }
    resolved.interfaces.extend(attached);
    resolved.missing.retain(|m| !attached.contains_key(m));
    resolved.missing.sort_unstable();
    resolved.missing.dedup();
}

/// A last good answer: the endpoint's address and its interface.
#[derive(Clone, Debug)]
struct Known {
    ip: IpAddr,
    found: Found,
}

/// Finds the host-side interface of each local endpoint through netlink.
#[derive(Debug, Default)]
pub struct InterfaceResolver {
    pattern: Option<InterfacePattern>,
    netns: Option<String>,
    /// The socket, opened on first use and again after an error.
    netlink: Option<Netlink>,
    /// Last good answers by endpoint id (ids are never reused).
    known: HashMap<u32, Known>,
    /// Conflicts seen in the last resolution: (ifindex, endpoint ids).
    conflicts: BTreeSet<(u32, Vec<u32>)>,
    new_conflicts: u64,
}

fn addresses_of(ep: &npm_policy::compiled::Endpoint) -> impl Iterator<Item = IpAddr> {
    [ep.ipv4.map(IpAddr::V4), ep.ipv6.map(IpAddr::V6)].into_iter().flatten()
}

impl InterfaceResolver {
    /// A resolver accepting only interfaces matching `pattern` (any veth host peer without one).
    pub fn new(pattern: Option<InterfacePattern>) -> Self {
        InterfaceResolver {
            pattern,
            ..InterfaceResolver::default()
        }
    }

    /// Look interfaces up in network namespace `netns` (a name under
    /// `/run/netns`, or a path) instead of the agent's own (tests).
    pub fn in_netns(mut self, netns: &str) -> Self {
        self.netns = Some(netns.to_string());
        self
    }

    fn netlink(&mut self) -> Result<&mut Netlink, NetlinkError> {
        if self.netlink.is_none() {
            self.netlink = Some(Netlink::open(self.netns.as_deref())?);
        }
        Ok(self.netlink.as_mut().expect("opened above"))
    }

    /// The links and default routes.
    fn read_view(&mut self) -> Result<KernelView, NetlinkError> {
        let nl = self.netlink()?;
        let links = nl.links()?;
        let routes = nl.routes()?;
        Ok(KernelView {
            links,
            default_oifs: KernelView::default_oifs_of(&routes),
            ..KernelView::default()
        })
    }

    /// Read the neighbour entries of the bridged addresses and the bridges'
    /// forwarding database into `view`.
    fn read_bridges(&mut self, view: &mut KernelView, bridged: &[(u32, IpAddr)]) -> Result<(), NetlinkError> {
        let nl = self.netlink()?;
        for v6 in [false, true] {
            if bridged.iter().any(|(_, ip)| ip.is_ipv6() == v6) {
                for n in nl.neighbours(v6)? {
                    view.neighbours.insert((n.index, n.ip), n);
                }
            }
        }
        view.fdb = nl.fdb()?;
        Ok(())
    }

    /// Every endpoint address's outcome, with one route lookup each.
    fn outcomes(&mut self, view: &mut KernelView, ips: &[IpAddr]) -> Vec<Outcome> {
        let lookups = match self.netlink() {
            Ok(nl) => nl.route_lookups(ips),
            Err(e) => return ips.iter().map(|_| Outcome::Error(e.to_string())).collect(),
        };
        let steps: Vec<RouteStep> = lookups.iter().map(|l| route_step(view, l)).collect();
        let bridged: Vec<(u32, IpAddr)> = steps
            .iter()
            .zip(ips)
            .filter_map(|(s, ip)| match s {
                RouteStep::Bridge(b) => Some((*b, *ip)),
                _ => None,
            })
            .collect();
        let bridge_error = if bridged.is_empty() {
            None
        } else {
            self.read_bridges(view, &bridged).err().map(|e| e.to_string())
        };
        let mut out = Vec::with_capacity(ips.len());
        for (step, &ip) in steps.into_iter().zip(ips) {
            out.push(match step {
                RouteStep::Veth(f) => Outcome::Found(f),
                RouteStep::Refused(why) => Outcome::Refused(why),
                RouteStep::Error(e) => Outcome::Error(e),
                RouteStep::Bridge(b) => match &bridge_error {
                    Some(e) => Outcome::Error(e.clone()),
                    None => {
                        let o = bridge_step(view, b, ip);
                        if matches!(o, Outcome::Pending(_)) {
                            // Resolve the MAC as a packet to the pod would;
                            // the pod's answer also teaches the bridge its port.
                            if let Err(e) = self.netlink().and_then(|nl| nl.trigger_neighbour(b, ip)) {
                                tracing::debug!(%ip, error = %e, "neighbour resolution request failed");
                            }
                        }
                        o
                    }
                },
            });
        }
        out
    }

    fn pattern_allows(&self, name: &str) -> bool {
        self.pattern.as_ref().is_none_or(|p| p.matches(name))
    }

    /// Resolve every endpoint of `compiled` (IPv4 address first, else IPv6).
    pub fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        self.resolve_attached(compiled, &Interfaces::new())
    }

    /// Resolve every endpoint of `compiled`, the `attached` ones (endpoint
    /// id -> ifindex, reported by the CNI) being on their veth first.
    pub fn resolve_attached(&mut self, compiled: &Compiled, attached: &Interfaces) -> Resolved {
        self.known.retain(|id, _| compiled.endpoints.contains_key(id));
        if compiled.endpoints.is_empty() {
            self.conflicts.clear();
            return Resolved::default();
        }
        // Endpoint id -> the answer of this resolution (or the kept previous one).
        let mut claims: BTreeMap<u32, Known> = BTreeMap::new();
        // Endpoint id -> its previous interface, still valid, to fall back on if refused.
        let mut fallbacks: HashMap<u32, Known> = HashMap::new();
        let mut missing = Vec::new();
        match self.read_view() {
            Err(e) => {
                // Nothing can be checked: every endpoint keeps its last good
                // interface, the others wait.
                self.netlink = None;
                tracing::warn!(error = %e, "interface discovery failed; endpoints keep their previous interfaces");
                for &id in compiled.endpoints.keys() {
                    match self.known.get(&id) {
                        Some(k) => {
                            claims.insert(id, k.clone());
                        }
                        None => missing.push(id),
                    }
                }
            }
            Ok(mut view) => {
                let ips: Vec<IpAddr> = compiled.endpoints.values().flat_map(addresses_of).collect();
                let mut outcomes = self.outcomes(&mut view, &ips).into_iter();
                for (&id, ep) in &compiled.endpoints {
                    let mut answer = None;
                    for ip in addresses_of(ep) {
                        let outcome = outcomes.next().expect("one outcome per address");
                        if answer.is_some() {
                            continue;
                        }
                        match outcome {
                            Outcome::Found(f) if self.pattern_allows(&f.name) => answer = Some(Known { ip, found: f }),
                            Outcome::Found(f) => {
                                tracing::debug!(endpoint = id, %ip, interface = %f.name, "interface does not match --interface-pattern")
                            }
                            Outcome::Refused(why) => {
                                tracing::debug!(endpoint = id, %ip, reason = why, "no endpoint interface")
                            }
                            Outcome::Pending(why) => {
                                tracing::debug!(endpoint = id, %ip, reason = why, "endpoint interface not known yet");
                            }
                            Outcome::Error(e) => {
                                tracing::warn!(endpoint = id, pod = %format!("{}/{}", ep.pod.namespace, ep.pod.name), %ip, error = %e, "interface lookup failed");
                            }
                        }
                    }
                    // The previous interface, kept while it is there as it
                    // was: an endpoint once enforced stays enforced.
                    let previous = self
                        .known
                        .get(&id)
                        .filter(|k| {
                            addresses_of(ep).any(|ip| ip == k.ip)
                                && still_valid(&view, &k.found)
                                && self.pattern_allows(&k.found.name)
                        })
                        .cloned();
                    match (answer, previous) {
                        (Some(a), previous) => {
                            claims.insert(id, a);
                            if let Some(p) = previous {
                                fallbacks.insert(id, p);
                            }
                        }
                        (None, Some(p)) => {
                            claims.insert(id, p);
                        }
                        (None, None) => {
                            self.known.remove(&id);
                            missing.push(id);
                        }
                    }
                }
            }
        }
        let interfaces = self.settle(compiled, claims, fallbacks, attached, &mut missing);
        missing.sort_unstable();
        missing.dedup();
        Resolved { interfaces, missing }
    }

    /// Give each ifindex to one endpoint: an attached endpoint first, else
    /// the only claimant, else the incumbent (whose last good answer was
    /// that ifindex); with several claimants and no incumbent, nobody.
    /// Refused endpoints fall back on their previous interface if it is
    /// still valid and free. Record the winners' answers as last good; log
    /// and count conflicts not seen in the previous resolution.
    fn settle(
        &mut self,
        compiled: &Compiled,
        claims: BTreeMap<u32, Known>,
        mut fallbacks: HashMap<u32, Known>,
        attached: &Interfaces,
        missing: &mut Vec<u32>,
    ) -> Interfaces {
        let mut interfaces = Interfaces::new();
        let mut by_ifindex: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (&id, &ifindex) in attached.iter().filter(|(id, _)| compiled.endpoints.contains_key(id)) {
            by_ifindex.entry(ifindex).or_default().push(id);
        }
        let attached_on: BTreeSet<u32> = by_ifindex.keys().copied().collect();
        for (&id, k) in claims.iter().filter(|(id, _)| !attached.contains_key(id)) {
            by_ifindex.entry(k.found.ifindex).or_default().push(id);
        }
        let mut conflicts = BTreeSet::new();
        let mut refused = Vec::new();
        for (ifindex, mut ids) in by_ifindex {
            ids.sort_unstable();
            let winner = if let [id] = ids[..] {
                Some(id)
            } else if attached_on.contains(&ifindex) {
                let cni: Vec<u32> = ids.iter().copied().filter(|id| attached.contains_key(id)).collect();
                (cni.len() == 1).then(|| cni[0])
            } else {
                let incumbents: Vec<u32> = ids
                    .iter()
                    .copied()
                    .filter(|id| self.known.get(id).is_some_and(|k| k.found.ifindex == ifindex))
                    .collect();
                (incumbents.len() == 1).then(|| incumbents[0])
            };
            if let Some(w) = winner {
                interfaces.insert(w, ifindex);
            }
            if ids.len() > 1 {
                refused.extend(ids.iter().copied().filter(|id| Some(*id) != winner));
                conflicts.insert((ifindex, ids));
            }
        }
        // Refused endpoints fall back on their previous interface if free.
        for id in refused {
            let taken: BTreeSet<u32> = interfaces.values().copied().collect();
            match fallbacks.remove(&id) {
                Some(p) if !attached.contains_key(&id) && !taken.contains(&p.found.ifindex) => {
                    interfaces.insert(id, p.found.ifindex);
                }
                _ => missing.push(id),
            }
        }
        // Only answers that won are last good ones.
        for (id, k) in claims {
            if interfaces.get(&id) == Some(&k.found.ifindex) && !attached.contains_key(&id) {
                self.known.insert(id, k);
            }
        }
        missing.retain(|m| !interfaces.contains_key(m));
        for (ifindex, ids) in conflicts.difference(&self.conflicts) {
            self.new_conflicts += 1;
            let pods: Vec<String> = ids
                .iter()
                .filter_map(|id| compiled.endpoints.get(id))
                .map(|e| format!("{}/{}", e.pod.namespace, e.pod.name))
                .collect();
            let kept = ids.iter().find(|id| interfaces.get(id) == Some(ifindex));
            tracing::warn!(ifindex, endpoints = ?ids, pods = ?pods, kept = ?kept, "interface claimed by several endpoints; only the attached or incumbent one is attached there");
        }
        self.conflicts = conflicts;
        interfaces
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_globs() {
        let p = InterfacePattern::new("veth*").unwrap();
        assert!(p.matches("veth12ab"));
        assert!(!p.matches("eth0"));
        let q = InterfacePattern::new("cali?x*").unwrap();
        assert!(q.matches("cali1x"));
        assert!(!q.matches("calix"));
        assert!(InterfacePattern::new("").is_err());
        assert!(InterfacePattern::new("a/b").is_err());
    }

    fn compiled(ids: &[u32]) -> Compiled {
        let mut c = Compiled::default();
        for &id in ids {
            c.endpoints.insert(
                id,
                npm_policy::compiled::Endpoint {
                    pod: npm_policy::compiled::PodRef {
                        namespace: "k".into(),
                        name: format!("ep{id}"),
                        uid: format!("uid{id}"),
                    },
                    identity: 300,
                    ipv4: Some(std::net::Ipv4Addr::new(10, 0, 0, id as u8)),
                    ipv6: None,
                    isolated_ingress: false,
                    isolated_egress: false,
                    tiers: Default::default(),
                    report_new: false,
                },
            );
        }
        c
    }

    fn claim(id: u32, ifindex: u32) -> (u32, Known) {
        (
            id,
            Known {
                ip: IpAddr::from([10, 0, 0, id as u8]),
                found: Found {
                    ifindex,
                    name: format!("veth{ifindex}"),
                    bridge: None,
                },
            },
        )
    }

    /// A CNI-attached endpoint wins its veth over a route-resolved one
    /// (whatever their ids), and the route-resolved one is not attached
    /// there; the conflict is counted.
    #[test]
    fn an_attached_veth_goes_to_its_pod_not_to_a_route_resolved_endpoint() {
        let c = compiled(&[1, 2, 3]);
        for (cni, routed) in [(1, 2), (2, 1)] {
            let mut r = InterfaceResolver::default();
            let claims = BTreeMap::from([claim(routed, 7), claim(3, 8)]);
            let attached = Interfaces::from([(cni, 7)]);
            let mut missing = Vec::new();
            let got = r.settle(&c, claims, HashMap::new(), &attached, &mut missing);
            assert_eq!(got, Interfaces::from([(cni, 7), (3, 8)]), "cni {cni}, routed {routed}");
            assert_eq!(missing, vec![routed]);
            assert_eq!(r.take_new_conflicts(), 1);
            assert!(!r.known.contains_key(&routed), "a refused answer is no last good one");
        }
        // The trait's default (a resolver that cannot take them first) drops them too.
        let mut resolved = Resolved {
            interfaces: Interfaces::from([(2, 7), (3, 8)]),
            missing: vec![1],
        };
        apply_attached(&mut resolved, &Interfaces::from([(1, 7)]));
        assert_eq!(resolved.interfaces, Interfaces::from([(1, 7), (3, 8)]));
        assert_eq!(resolved.missing, vec![2]);
    }

    /// The incumbent keeps an ifindex a newcomer claims; the newcomer falls
    /// back on its own previous interface if it is still valid.
    #[test]
    fn the_incumbent_keeps_its_interface_and_the_newcomer_falls_back() {
        let c = compiled(&[1, 2]);
        let mut r = InterfaceResolver::default();
        let mut missing = Vec::new();
        let first = r.settle(
            &c,
            BTreeMap::from([claim(1, 7), claim(2, 8)]),
            HashMap::new(),
            &Interfaces::new(),
            &mut missing,
        );
        assert_eq!(first, Interfaces::from([(1, 7), (2, 8)]));
        // 2's address now resolves to 1's veth (a spoofed ARP answer).
        let fallback = HashMap::from([claim(2, 8)]);
        let got = r.settle(
            &c,
            BTreeMap::from([claim(1, 7), claim(2, 7)]),
            fallback,
            &Interfaces::new(),
            &mut missing,
        );
        assert_eq!(got, Interfaces::from([(1, 7), (2, 8)]));
        assert!(missing.is_empty());
        assert_eq!(r.take_new_conflicts(), 1);
        assert_eq!(r.known[&2].found.ifindex, 8, "the refused answer is not stored");
        // Without a valid previous interface, the newcomer is refused.
        let got = r.settle(
            &c,
            BTreeMap::from([claim(1, 7), claim(2, 7)]),
            HashMap::new(),
            &Interfaces::new(),
            &mut missing,
        );
        assert_eq!(got, Interfaces::from([(1, 7)]));
        assert_eq!(missing, vec![2]);
    }
}
