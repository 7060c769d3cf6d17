//! What the datapath does for the first packet of a new connection, on the
//! compiled form (npm-common lookup precedence, steps 7 to 9, with the
//! ClusterNetworkPolicy tiers around NetworkPolicy: Host, Admin,
//! NetworkPolicy, Baseline, allow). Used to test the compiler against the
//! reference evaluator and by `explain` tools.

use std::net::IpAddr;

use npm_common::{Reason, IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD};

use crate::compiled::{Compiled, Direction, Endpoint, PolicyEntry, Tier, TierAction, TierEntry, TierValue};
use crate::identity::PrefixTable;
use crate::model::Protocol;

/// Outcome of [`lookup`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LookupResult {
    /// The packet passes.
    pub allowed: bool,
    /// Why (the datapath's reason).
    pub reason: Reason,
    /// Rule id of the deciding entry: the NetworkPolicy rule that allowed it
    /// ([`Reason::Policy`]) or the ClusterNetworkPolicy rule that accepted
    /// or denied it (the four tier reasons).
    pub rule: Option<u32>,
    /// The Admin tier's match when it was consulted (a `Pass` or a final
    /// action); `None` when it has no entries or nothing matched.
    pub admin: Option<TierValue>,
    /// The Baseline tier's match when it was consulted.
    pub baseline: Option<TierValue>,
    /// The peer's pod identity (`IDENTITY_WORLD` when unknown).
    pub peer_identity: u32,
    /// The peer's CIDR identity (0 when none).
    pub cidr_identity: u32,
}

/// The entry of `compiled` allowing (`subject`, `direction`, `peer`
/// identity, `protocol`, `port`), if any; entries match on protocol `None`
/// or an equal protocol with `port` in range. `subject` is the local
/// endpoint's pod identity ([`crate::compiled::Endpoint::identity`]; see
/// [`PolicyEntry`]).
pub fn find_entry(
    compiled: &Compiled,
    subject: u32,
    direction: Direction,
    peer: u32,
    protocol: u8,
    port: u16,
) -> Option<(&PolicyEntry, u32)> {
    let lo = PolicyEntry {
        subject,
        direction,
        peer,
        protocol: None,
        ports: (0, 0),
    };
    let hi = PolicyEntry {
        subject,
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

/// The tier entry of `compiled` matching `peer`'s subject, direction, tier
/// and peer identity (its protocol and ports are not read; see
/// [`TierEntry::first`]), `protocol` and `port`: the most specific one (the
/// entry of the packet's protocol whose range holds `port`, else the
/// `protocol: None` entry), as the datapath's LPM lookup finds it.
pub fn find_tier_entry(
    compiled: &Compiled,
    peer: TierEntry,
    protocol: u8,
    port: u16,
) -> Option<(&TierEntry, TierValue)> {
    let lo = TierEntry::first(peer.subject, peer.direction, peer.tier, peer.peer);
    let hi = TierEntry {
        protocol: Some(Protocol::Sctp),
        ports: (u16::MAX, u16::MAX),
        ..lo
    };
    let mut none = None;
    for (e, v) in compiled.tiers.range(lo..=hi) {
        match e.protocol {
            None => none = Some((e, *v)),
            Some(p) if p.number() == protocol && e.ports.0 <= port && port <= e.ports.1 => return Some((e, *v)),
            Some(_) => {}
        }
    }
    none
}

/// A tier's decision for a packet whose peer has the identities `ids`
/// (pod or node identity, CIDR identity, `IDENTITY_ANY`): the matched entry
/// of lowest rank among them, for the endpoints of subject `subject`;
/// `None`: the tier does not decide.
pub fn tier_decision(
    compiled: &Compiled,
    subject: u32,
    direction: Direction,
    tier: Tier,
    ids: [u32; 3],
    protocol: u8,
    port: u16,
) -> Option<TierValue> {
    ids.iter()
        .filter_map(|id| {
            let peer = TierEntry::first(subject, direction, tier, *id);
            find_tier_entry(compiled, peer, protocol, port).map(|(_, v)| v)
        })
        .min_by_key(|v| v.rank)
}

/// Decides a new connection of local endpoint `endpoint` with `peer` in
/// `direction` (`port` is the destination port) exactly as the datapath
/// does. The peer's identity comes from the ipcache (exact), else
/// `IDENTITY_WORLD`; its CIDR identity from the ipcache entry, else the
/// longest prefix of `cidrs`. Then:
/// 1. not isolated by a NetworkPolicy and no tier entries for the
///    direction -> allow ([`Reason::NotIsolated`], as without tiers);
/// 2. ingress from `IDENTITY_HOST` -> allow ([`Reason::Host`]);
/// 3. Admin tier ([`tier_decision`]): Accept -> [`Reason::AdminAccept`],
///    Deny -> [`Reason::AdminDeny`], Pass or no match -> on;
/// 4. isolated by a NetworkPolicy: the policy entries of the pod identity,
///    the CIDR identity and `IDENTITY_ANY` -> [`Reason::Policy`], else
///    [`Reason::PolicyDenied`];
/// 5. Baseline tier: Accept -> [`Reason::BaselineAccept`], Deny ->
///    [`Reason::BaselineDeny`], Pass or no match -> on;
/// 6. allow ([`Reason::NotIsolated`]).
///
/// An endpoint that is not compiled is allowed ([`Reason::NoEndpoint`]),
/// as the datapath does.
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
        admin: None,
        baseline: None,
    };
    let Some(ep) = compiled.endpoints.get(&endpoint) else {
        return res;
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
    decide(compiled, ep, direction, res, protocol, port)
}

/// Steps 1 to 6 of [`lookup`] for endpoint `ep` once the peer's identities
/// are known (`res.peer_identity`, `res.cidr_identity`; the rest of `res`
/// as [`lookup_with`] starts it): what the datapath decides from the
/// endpoint's flags, the peer's two identities, the protocol and the port.
/// [`crate::fold`] folds it ahead of time per peer class.
pub(crate) fn decide(
    compiled: &Compiled,
    ep: &Endpoint,
    direction: Direction,
    mut res: LookupResult,
    protocol: u8,
    port: u16,
) -> LookupResult {
    let isolated = match direction {
        Direction::Ingress => ep.isolated_ingress,
        Direction::Egress => ep.isolated_egress,
    };
    let admin = ep.tiers.has(Tier::Admin, direction);
    let baseline = ep.tiers.has(Tier::Baseline, direction);
    if !isolated && !admin && !baseline {
        res.reason = Reason::NotIsolated;
        return res;
    }
    if direction == Direction::Ingress && res.peer_identity == IDENTITY_HOST {
        res.reason = Reason::Host;
        return res;
    }
    let ids = [res.peer_identity, res.cidr_identity, IDENTITY_ANY];
    if admin {
        res.admin = tier_decision(compiled, ep.identity, direction, Tier::Admin, ids, protocol, port);
        if tier_decides(&mut res, Tier::Admin, Reason::AdminAccept, Reason::AdminDeny) {
            return res;
        }
    }
    if isolated {
        for id in ids {
            if let Some((_, rule)) = find_entry(compiled, ep.identity, direction, id, protocol, port) {
                res.reason = Reason::Policy;
                res.rule = Some(rule);
                return res;
            }
        }
        res.allowed = false;
        res.reason = Reason::PolicyDenied;
        return res;
    }
    if baseline {
        res.baseline = tier_decision(compiled, ep.identity, direction, Tier::Baseline, ids, protocol, port);
        if tier_decides(&mut res, Tier::Baseline, Reason::BaselineAccept, Reason::BaselineDeny) {
            return res;
        }
    }
    res.reason = Reason::NotIsolated;
    res
}

/// Records the decision of `tier` (`res.admin` or `res.baseline`) in
/// `res` (Accept: allowed for `accept`; Deny: denied for `deny`; with the
/// rule); `false` when the tier does not decide (Pass, or no entry).
fn tier_decides(res: &mut LookupResult, tier: Tier, accept: Reason, deny: Reason) -> bool {
    let v = match tier {
        Tier::Admin => res.admin,
        Tier::Baseline => res.baseline,
    };
    let Some(v) = v.filter(|v| v.action != TierAction::Pass) else {
        return false;
    };
    res.allowed = v.action == TierAction::Accept;
    res.reason = if res.allowed { accept } else { deny };
    res.rule = Some(v.rule);
    true
}
