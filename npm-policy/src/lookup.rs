//! What the datapath does for the first packet of a new connection, on the
//! compiled form (npm-common lookup precedence, steps 7 to 9). Used to test
//! the compiler against the reference evaluator and by `explain` tools.

use std::net::IpAddr;

use npm_common::{Reason, IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD};

use crate::compiled::{Compiled, Direction, PolicyEntry};
use crate::identity::PrefixTable;
use crate::model::Protocol;

/// Outcome of [`lookup`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupResult {
    /// The packet passes.
    pub allowed: bool,
    /// Why (the datapath's reason).
    pub reason: Reason,
    /// Rule id of the entry that allowed it (with [`Reason::Policy`]).
    pub rule: Option<u32>,
    /// The peer's pod identity (`IDENTITY_WORLD` when unknown).
    pub peer_identity: u32,
    /// The peer's CIDR identity (0 when none).
    pub cidr_identity: u32,
}

/// The entry of `compiled` allowing (`endpoint`, `direction`, `peer`
/// identity, `protocol`, `port`), if any; entries match on protocol `None`
/// or an equal protocol with `port` in range.
pub fn find_entry(
    compiled: &Compiled,
    endpoint: u32,
    direction: Direction,
    peer: u32,
    protocol: u8,
    port: u16,
) -> Option<(&PolicyEntry, u32)> {
    let lo = PolicyEntry {
        endpoint,
        direction,
        peer,
        protocol: None,
        ports: (0, 0),
    };
    let hi = PolicyEntry {
        endpoint,
        direction,
        peer,
        protocol: Some(Protocol::Sctp),
        ports: (u16::MAX, u16::MAX),
    };
    compiled
        .policy
        .range(lo..=hi)
        .find(|(e, _)| match e.protocol {
            None => true,
            Some(p) => p.number() == protocol && e.ports.0 <= port && port <= e.ports.1,
        })
        .map(|(e, r)| (e, *r))
}

/// Decides a new connection of local endpoint `endpoint` with `peer` in
/// `direction` (`port` is the destination port) exactly as the datapath
/// does: not isolated -> allow; ingress from `IDENTITY_HOST` -> allow; the
/// peer's identity from the ipcache (exact), else `IDENTITY_WORLD`; its CIDR
/// identity from the ipcache entry, else the longest prefix of `cidrs`;
/// then the policy entries of the pod identity, the CIDR identity and
/// `IDENTITY_ANY`. An endpoint that is not compiled is allowed
/// ([`Reason::NoEndpoint`]), as the datapath does.
pub fn lookup(
    compiled: &Compiled,
    endpoint: u32,
    direction: Direction,
    peer: IpAddr,
    protocol: u8,
    port: u16,
) -> LookupResult {
    lookup_with(compiled, None, endpoint, direction, peer, protocol, port)
}

/// [`lookup`] with a prebuilt prefix table of `compiled.cidrs` (saves
/// rebuilding it per packet).
pub fn lookup_with(
    compiled: &Compiled,
    table: Option<&PrefixTable>,
    endpoint: u32,
    direction: Direction,
    peer: IpAddr,
    protocol: u8,
    port: u16,
) -> LookupResult {
    let mut res = LookupResult {
        allowed: true,
        reason: Reason::NoEndpoint,
        rule: None,
        peer_identity: IDENTITY_WORLD,
        cidr_identity: IDENTITY_ANY,
    };
    let Some(ep) = compiled.endpoints.get(&endpoint) else {
        return res;
    };
    let isolated = match direction {
        Direction::Ingress => ep.isolated_ingress,
        Direction::Egress => ep.isolated_egress,
    };
    let cached = compiled.ipcache.get(&peer);
    res.peer_identity = cached.map_or(IDENTITY_WORLD, |e| e.identity);
    res.cidr_identity = match cached {
        Some(e) => e.cidr_identity,
        None => match table {
            Some(t) => t.longest(peer).map_or(IDENTITY_ANY, |(_, id)| id),
            None => PrefixTable::new(&compiled.cidrs)
                .longest(peer)
                .map_or(IDENTITY_ANY, |(_, id)| id),
        },
    };
    if !isolated {
        res.reason = Reason::NotIsolated;
        return res;
    }
    if direction == Direction::Ingress && res.peer_identity == IDENTITY_HOST {
        res.reason = Reason::Host;
        return res;
    }
    for id in [res.peer_identity, res.cidr_identity, IDENTITY_ANY] {
        if let Some((_, rule)) = find_entry(compiled, endpoint, direction, id, protocol, port) {
            res.reason = Reason::Policy;
            res.rule = Some(rule);
            return res;
        }
    }
    res.allowed = false;
    res.reason = Reason::PolicyDenied;
    res
}
