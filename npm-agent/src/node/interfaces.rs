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
//! - An ifindex claimed by two endpoints is refused for both: neither is
//!   attached there; it is logged and counted
//!   (`npm_interface_conflicts_total`, once per new conflict).

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
        self.known.retain(|id, _| compiled.endpoints.contains_key(id));
        if compiled.endpoints.is_empty() {
            self.conflicts.clear();
            return Resolved::default();
        }
        let mut found: BTreeMap<u32, Found> = BTreeMap::new();
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
                            found.insert(id, k.found.clone());
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
                    let mut unknown = None;
                    for ip in addresses_of(ep) {
                        let outcome = outcomes.next().expect("one outcome per address");
                        if answer.is_some() {
                            continue;
                        }
                        match outcome {
                            Outcome::Found(f) if self.pattern_allows(&f.name) => answer = Some((ip, f)),
                            Outcome::Found(f) => {
                                tracing::debug!(endpoint = id, %ip, interface = %f.name, "interface does not match --interface-pattern")
                            }
                            Outcome::Refused(why) => {
                                tracing::debug!(endpoint = id, %ip, reason = why, "no endpoint interface")
                            }
                            Outcome::Pending(why) => {
                                tracing::debug!(endpoint = id, %ip, reason = why, "endpoint interface not known yet");
                                unknown.get_or_insert_with(|| why.to_string());
                            }
                            Outcome::Error(e) => {
                                tracing::warn!(endpoint = id, pod = %format!("{}/{}", ep.pod.namespace, ep.pod.name), %ip, error = %e, "interface lookup failed");
                                unknown.get_or_insert(e);
                            }
                        }
                    }
                    match answer {
                        Some((ip, f)) => {
                            self.known.insert(id, Known { ip, found: f.clone() });
                            found.insert(id, f);
                        }
                        None => {
                            let previous = self.known.get(&id).filter(|k| {
                                unknown.is_some()
                                    && addresses_of(ep).any(|ip| ip == k.ip)
                                    && still_valid(&view, &k.found)
                                    && self.pattern_allows(&k.found.name)
                            });
                            match previous {
                                Some(k) => {
                                    found.insert(id, k.found.clone());
                                }
                                None => {
                                    self.known.remove(&id);
                                    missing.push(id);
                                }
                            }
                        }
                    }
                }
            }
        }
        let interfaces = self.refuse_conflicts(compiled, found, &mut missing);
        missing.sort_unstable();
        Resolved { interfaces, missing }
    }

    /// Refuse every ifindex claimed by more than one endpoint (for all of
    /// them); log and count conflicts not seen in the previous resolution.
    fn refuse_conflicts(
        &mut self,
        compiled: &Compiled,
        found: BTreeMap<u32, Found>,
        missing: &mut Vec<u32>,
    ) -> Interfaces {
        let mut by_ifindex: BTreeMap<u32, Vec<u32>> = BTreeMap::new();
        for (&id, f) in &found {
            by_ifindex.entry(f.ifindex).or_default().push(id);
        }
        let mut conflicts = BTreeSet::new();
        let mut interfaces = Interfaces::new();
        for (ifindex, ids) in by_ifindex {
            if let [id] = ids[..] {
                interfaces.insert(id, ifindex);
                continue;
            }
            missing.extend(&ids);
            conflicts.insert((ifindex, ids));
        }
        for (ifindex, ids) in conflicts.difference(&self.conflicts) {
            self.new_conflicts += 1;
            let pods: Vec<String> = ids
                .iter()
                .filter_map(|id| compiled.endpoints.get(id))
                .map(|e| format!("{}/{}", e.pod.namespace, e.pod.name))
                .collect();
            let name = found.get(&ids[0]).map(|f| f.name.as_str()).unwrap_or("");
            tracing::warn!(ifindex, interface = name, endpoints = ?ids, pods = ?pods, "interface claimed by several endpoints; none is attached there");
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
}
