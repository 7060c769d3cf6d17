//! Pure translation of the compiled policy into the kernel map layout of
//! `npm-common`: addresses to [`IpKey`]s (IPv4-mapped), prefixes to LPM keys
//! (IPv4 prefix `n` stored as `96 + n`), policy entries to LPM
//! [`PolicyKey`]s keyed by their subject (port ranges split into aligned
//! power-of-two blocks), tier entries to `NPM_TIERS` keys and values, and endpoints to
//! [`EndpointInfo`]s. No kernel access here.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use npm_common::{
    ep_no_peer_flag, EndpointInfo, IpInfo, IpKey, PolicyKey, PolicyValue, EP_HAS_V4, EP_HAS_V6, EP_ISOLATED_EGRESS,
    EP_ISOLATED_INGRESS, EP_NO_ANY_PEER_EGRESS, EP_NO_ANY_PEER_INGRESS, EP_NO_CIDR_PEER_EGRESS,
    EP_NO_CIDR_PEER_INGRESS, EP_NO_POD_PEER_EGRESS, EP_NO_POD_PEER_INGRESS, EP_PRESENT, EP_REPORT_NEW,
    POLICY_PREFIX_ANY_PORT, POLICY_PREFIX_ANY_PROTO,
};
use npm_common::{
    tier_flags, tier_key, TierValue as KernelTierValue, EP_ADMIN_INGRESS, EP_BASELINE_INGRESS, TIER_ACCEPT, TIER_ADMIN,
    TIER_BASELINE, TIER_DENY, TIER_PASS,
};
use npm_policy::compiled::{
    Direction, Endpoint, IpEntry, PolicyEntry, Tier, TierAction, TierEntry, TierPresence, TierValue,
};

/// Errors of the translation.
#[derive(Clone, Debug, thiserror::Error, PartialEq, Eq)]
pub enum TranslateError {
    /// A policy entry whose port range is empty (`lo > hi`).
    #[error("policy entry {entry:?}: empty port range {lo}..={hi}")]
    EmptyPortRange {
        /// The offending entry.
        entry: PolicyEntry,
        /// First port.
        lo: u16,
        /// Last port.
        hi: u16,
    },
    /// A tier entry whose port range is empty (`lo > hi`).
    #[error("tier entry {entry:?}: empty port range {lo}..={hi}")]
    EmptyTierPortRange {
        /// The offending entry.
        entry: TierEntry,
        /// First port.
        lo: u16,
        /// Last port.
        hi: u16,
    },
    /// An LPM key of `NPM_CIDRS` whose prefix length is out of range.
    #[error("CIDR key with invalid prefix length {prefix_len}")]
    BadPrefix {
        /// The prefix length found.
        prefix_len: u32,
    },
}

/// The map key of an address: IPv4 addresses are IPv4-mapped.
pub fn ip_key(addr: IpAddr) -> IpKey {
    match addr {
        IpAddr::V4(a) => IpKey::v4(a.octets()),
        IpAddr::V6(a) => IpKey::v6(a.octets()),
    }
}

/// The address of a map key: IPv4-mapped keys give IPv4 addresses.
pub fn ip_from_key(key: &IpKey) -> IpAddr {
    let a = Ipv6Addr::from(key.addr);
    match a.to_ipv4_mapped() {
        Some(v4) => IpAddr::V4(v4),
        None => IpAddr::V6(a),
    }
}

/// The ipcache value of a compiled ipcache entry.
pub fn ip_info(entry: &IpEntry) -> IpInfo {
    IpInfo {
        identity: entry.identity,
        cidr_identity: entry.cidr_identity,
    }
}

/// The `NPM_CIDRS` LPM key of a prefix: (prefix length, address bytes with
/// the host bits zeroed). IPv4 prefixes of length `n` become `96 + n` over
/// the IPv4-mapped address.
pub fn cidr_key(net: &IpNet) -> (u32, [u8; 16]) {
    match net.trunc() {
        IpNet::V4(n) => (96 + u32::from(n.prefix_len()), IpKey::v4(n.network().octets()).addr),
        IpNet::V6(n) => (u32::from(n.prefix_len()), n.network().octets()),
    }
}

/// The prefix of an `NPM_CIDRS` key (inverse of [`cidr_key`]).
pub fn cidr_from_key(prefix_len: u32, addr: [u8; 16]) -> Result<IpNet, TranslateError> {
    let bad = TranslateError::BadPrefix { prefix_len };
    let v6 = Ipv6Addr::from(addr);
    match v6.to_ipv4_mapped() {
        Some(v4) if prefix_len >= 96 => {
            let len = u8::try_from(prefix_len - 96).map_err(|_| bad.clone())?;
            Ipv4Net::new(v4, len).map(IpNet::V4).map_err(|_| bad)
        }
        _ => {
            let len = u8::try_from(prefix_len).map_err(|_| bad.clone())?;
            Ipv6Net::new(v6, len).map(IpNet::V6).map_err(|_| bad)
        }
    }
}

/// Splits the inclusive range `lo..=hi` into aligned power-of-two blocks:
/// each block is (first port, number of significant port bits), covering
/// `2^(16 - bits)` ports. The blocks are disjoint, ascending and cover the
/// range exactly; an empty range (`lo > hi`) gives no block.
pub fn split_port_range(lo: u16, hi: u16) -> Vec<(u16, u32)> {
    let mut out = Vec::new();
    let mut start = u32::from(lo);
    let end = u32::from(hi);
    while start <= end {
        // Largest block aligned at `start` that stays inside the range.
        let mut size_log = if start == 0 { 16 } else { start.trailing_zeros().min(16) };
        while start + (1u32 << size_log) - 1 > end {
            size_log -= 1;
        }
        out.push((start as u16, 16 - size_log));
        start += 1u32 << size_log;
    }
    out
}

/// The `NPM_POLICY` keys of one policy entry, under its subject
/// ([`PolicyEntry::subject`], the pod identity of the endpoints it
/// governs): one key of prefix
/// [`POLICY_PREFIX_ANY_PROTO`] for a rule without ports, one of
/// [`POLICY_PREFIX_ANY_PORT`] for a whole protocol, else one key per aligned
/// block of the port range (prefix `80 + bits`).
pub fn policy_keys(entry: &PolicyEntry) -> Result<Vec<PolicyKey>, TranslateError> {
    let subject = entry.subject;
    let dir = entry.direction.as_u8();
    let peer = entry.peer;
    let Some(protocol) = entry.protocol else {
        return Ok(vec![PolicyKey::with_prefix(
            POLICY_PREFIX_ANY_PROTO,
            subject,
            dir,
            peer,
            0,
            0,
        )]);
    };
    let (lo, hi) = entry.ports;
    if lo > hi {
        return Err(TranslateError::EmptyPortRange { entry: *entry, lo, hi });
    }
    let proto = protocol.number();
    Ok(split_port_range(lo, hi)
        .into_iter()
        .map(|(start, bits)| PolicyKey::with_prefix(POLICY_PREFIX_ANY_PORT + bits, subject, dir, peer, proto, start))
        .collect())
}

/// Every `EP_NO_*_PEER_*` flag.
pub const EP_NO_PEER_ALL: u32 = EP_NO_ANY_PEER_INGRESS
    | EP_NO_ANY_PEER_EGRESS
    | EP_NO_CIDR_PEER_INGRESS
    | EP_NO_CIDR_PEER_EGRESS
    | EP_NO_POD_PEER_INGRESS
    | EP_NO_POD_PEER_EGRESS;

/// The `EP_NO_*_PEER_*` flags of every subject that has policy entries
/// (subject -> flags, given to every endpoint of that subject): a flag is
/// set when no entry of that subject, direction and peer class exists. A
/// subject missing from the result has no entry at all: its endpoints'
/// flags are [`EP_NO_PEER_ALL`].
pub fn subject_peer_flags<'a>(policy: impl IntoIterator<Item = &'a PolicyEntry>) -> BTreeMap<u32, u32> {
    let mut present: BTreeMap<u32, u32> = BTreeMap::new();
    for e in policy {
        *present.entry(e.subject).or_default() |= ep_no_peer_flag(e.peer) << e.direction.as_u8();
    }
    present
        .into_iter()
        .map(|(subject, p)| (subject, EP_NO_PEER_ALL & !p))
        .collect()
}

/// The value written for a policy entry produced by rule `rule`.
pub fn policy_value(rule: u32) -> PolicyValue {
    PolicyValue { rule, flags: 0 }
}

/// The inclusive port range a policy key covers, with its protocol; `None`
/// for a key of every protocol.
pub fn policy_key_ports(key: &PolicyKey) -> Option<(u8, u16, u16)> {
    if key.prefix_len < POLICY_PREFIX_ANY_PORT {
        return None;
    }
    let bits = (key.prefix_len - POLICY_PREFIX_ANY_PORT).min(16);
    let size = 1u32 << (16 - bits);
    let lo = key.port();
    Some((key.protocol(), lo, (u32::from(lo) + size - 1) as u16))
}

/// The `NPM_TIERS` keys of one tier entry ([`npm_common::tier_key`]): the
/// prefixes of [`policy_keys`] (one key for every protocol, one for every
/// port of a protocol, else one per aligned block of the port range), with
/// the tier bit in the direction byte.
pub fn tier_keys(entry: &TierEntry) -> Result<Vec<PolicyKey>, TranslateError> {
    let ep = entry.subject;
    let dir = entry.direction.as_u8();
    let tier = tier_bit(entry.tier);
    let peer = entry.peer;
    let Some(protocol) = entry.protocol else {
        return Ok(vec![tier_key(POLICY_PREFIX_ANY_PROTO, ep, dir, tier, peer, 0, 0)]);
    };
    let (lo, hi) = entry.ports;
    if lo > hi {
        return Err(TranslateError::EmptyTierPortRange { entry: *entry, lo, hi });
    }
    let proto = protocol.number();
    Ok(split_port_range(lo, hi)
        .into_iter()
        .map(|(start, bits)| tier_key(POLICY_PREFIX_ANY_PORT + bits, ep, dir, tier, peer, proto, start))
        .collect())
}

/// The direction-byte bit of a tier ([`TIER_ADMIN`], [`TIER_BASELINE`]).
pub const fn tier_bit(tier: Tier) -> u8 {
    match tier {
        Tier::Admin => TIER_ADMIN,
        Tier::Baseline => TIER_BASELINE,
    }
}

/// The `NPM_TIERS` value of a compiled tier value: its rule id, and its
/// action and rank in the flags ([`tier_flags`]).
pub fn tier_value(value: &TierValue) -> KernelTierValue {
    let action = match value.action {
        TierAction::Accept => TIER_ACCEPT,
        TierAction::Deny => TIER_DENY,
        TierAction::Pass => TIER_PASS,
    };
    KernelTierValue {
        rule: value.rule,
        flags: tier_flags(action, value.rank),
    }
}

/// The endpoint flag of a tier in a direction ([`EP_ADMIN_INGRESS`] ...
/// [`EP_BASELINE_EGRESS`](npm_common::EP_BASELINE_EGRESS)).
pub const fn tier_flag(tier: Tier, direction: Direction) -> u32 {
    let ingress = match tier {
        Tier::Admin => EP_ADMIN_INGRESS,
        Tier::Baseline => EP_BASELINE_INGRESS,
    };
    ingress << direction.as_u8()
}

/// The tier flags of every subject that has tier entries (subject ->
/// `EP_ADMIN_*` / `EP_BASELINE_*`, given to every endpoint of that
/// subject), derived from the entries themselves (an entry is never
/// ignored because its endpoints' presence flags say otherwise).
pub fn subject_tier_flags<'a>(tiers: impl IntoIterator<Item = &'a TierEntry>) -> BTreeMap<u32, u32> {
    let mut out: BTreeMap<u32, u32> = BTreeMap::new();
    for e in tiers {
        *out.entry(e.subject).or_default() |= tier_flag(e.tier, e.direction);
    }
    out
}

/// The tier flags of an endpoint's [`TierPresence`].
pub fn presence_flags(p: &TierPresence) -> u32 {
    let mut f = 0;
    for tier in [Tier::Admin, Tier::Baseline] {
        for dir in [Direction::Ingress, Direction::Egress] {
            if p.has(tier, dir) {
                f |= tier_flag(tier, dir);
            }
        }
    }
    f
}

/// The `NPM_ENDPOINTS` value of endpoint `id` (its subject is its pod
/// identity, [`Endpoint::identity`]; its tier flags from
/// [`Endpoint::tiers`]; the writer adds those of its entries and its
/// subject's policy flags; [`EP_REPORT_NEW`] from [`Endpoint::report_new`]).
pub fn endpoint_info(id: u32, ep: &Endpoint) -> EndpointInfo {
    let mut info = EndpointInfo {
        id,
        flags: EP_PRESENT,
        subject: ep.identity,
        ..EndpointInfo::default()
    };
    if ep.isolated_ingress {
        info.flags |= EP_ISOLATED_INGRESS;
    }
    if ep.isolated_egress {
        info.flags |= EP_ISOLATED_EGRESS;
    }
    info.flags |= presence_flags(&ep.tiers);
    if ep.report_new {
        info.flags |= EP_REPORT_NEW;
    }
    if let Some(v4) = ep.ipv4 {
        info.flags |= EP_HAS_V4;
        info.ipv4 = IpKey::v4(v4.octets()).addr;
    }
    if let Some(v6) = ep.ipv6 {
        info.flags |= EP_HAS_V6;
        info.ipv6 = v6.octets();
    }
    info
}

/// The IPv4 address of an endpoint value, if set.
pub fn endpoint_ipv4(info: &EndpointInfo) -> Option<Ipv4Addr> {
    if info.flags & EP_HAS_V4 == 0 {
        return None;
    }
    Ipv6Addr::from(info.ipv4).to_ipv4_mapped()
}

/// The IPv6 address of an endpoint value, if set.
pub fn endpoint_ipv6(info: &EndpointInfo) -> Option<Ipv6Addr> {
    (info.flags & EP_HAS_V6 != 0).then(|| Ipv6Addr::from(info.ipv6))
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_policy::compiled::PodRef;
    use npm_policy::model::Protocol;
    use rand::Rng;

    fn entry(protocol: Option<Protocol>, lo: u16, hi: u16) -> PolicyEntry {
        PolicyEntry {
            subject: 7,
            direction: Direction::Egress,
            peer: 300,
            protocol,
            ports: (lo, hi),
        }
    }

    /// Every port covered by the blocks, checking alignment and disjointness.
    fn covered(blocks: &[(u16, u32)]) -> Vec<u32> {
        let mut ports = Vec::new();
        for &(start, bits) in blocks {
            let size = 1u32 << (16 - bits);
            assert_eq!(u32::from(start) % size, 0, "block {start}/{bits} not aligned");
            ports.extend(u32::from(start)..u32::from(start) + size);
        }
        ports
    }

    #[test]
    fn split_edges() {
        assert_eq!(split_port_range(80, 80), vec![(80, 16)]);
        assert_eq!(split_port_range(0, 65535), vec![(0, 0)]);
        assert_eq!(split_port_range(65535, 65535), vec![(65535, 16)]);
        assert_eq!(split_port_range(1024, 2047), vec![(1024, 6)]);
        assert_eq!(split_port_range(80, 90), vec![(80, 13), (88, 15), (90, 16)]);
        assert!(split_port_range(10, 9).is_empty());
        assert_eq!(covered(&split_port_range(1, 65535)), (1..=65535).collect::<Vec<_>>());
    }

    #[test]
    fn split_random_ranges_cover_exactly() {
        let mut rng = rand::rng();
        for _ in 0..2000 {
            let a: u16 = rng.random();
            let b: u16 = rng.random();
            let (lo, hi) = (a.min(b), a.max(b));
            let blocks = split_port_range(lo, hi);
            let ports = covered(&blocks);
            let want: Vec<u32> = (u32::from(lo)..=u32::from(hi)).collect();
            assert_eq!(ports, want, "range {lo}..={hi} blocks {blocks:?}");
            // At most 2 blocks per bit level.
            assert!(blocks.len() <= 32, "{lo}..={hi}: {} blocks", blocks.len());
        }
    }

    #[test]
    fn policy_keys_prefixes() {
        let any = policy_keys(&entry(None, 0, 0)).unwrap();
        assert_eq!(any.len(), 1);
        assert_eq!(any[0].prefix_len, POLICY_PREFIX_ANY_PROTO);
        assert_eq!(any[0].subject(), 7);
        assert_eq!(any[0].direction(), npm_common::DIR_EGRESS);
        assert_eq!(any[0].identity(), 300);
        assert_eq!(any[0].protocol(), 0);

        let all = policy_keys(&entry(Some(Protocol::Udp), 0, 65535)).unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].prefix_len, POLICY_PREFIX_ANY_PORT);
        assert_eq!(all[0].protocol(), npm_common::proto::UDP);

        let one = policy_keys(&entry(Some(Protocol::Tcp), 443, 443)).unwrap();
        assert_eq!(one, vec![PolicyKey::new(7, npm_common::DIR_EGRESS, 300, 6, 443)]);

        let range = policy_keys(&entry(Some(Protocol::Sctp), 1000, 1100)).unwrap();
        let mut ports = Vec::new();
        for k in &range {
            let (p, lo, hi) = policy_key_ports(k).unwrap();
            assert_eq!(p, npm_common::proto::SCTP);
            ports.extend(u32::from(lo)..=u32::from(hi));
        }
        assert_eq!(ports, (1000..=1100).collect::<Vec<_>>());

        assert_eq!(
            policy_keys(&entry(Some(Protocol::Tcp), 9, 8)),
            Err(TranslateError::EmptyPortRange {
                entry: entry(Some(Protocol::Tcp), 9, 8),
                lo: 9,
                hi: 8
            })
        );
    }

    #[test]
    fn addresses_and_prefixes() {
        let v4: IpAddr = "10.1.2.3".parse().unwrap();
        let k = ip_key(v4);
        assert_eq!(&k.addr[10..], &[0xff, 0xff, 10, 1, 2, 3]);
        assert_eq!(ip_from_key(&k), v4);
        let v6: IpAddr = "fd00::1".parse().unwrap();
        assert_eq!(ip_from_key(&ip_key(v6)), v6);

        let net: IpNet = "10.1.2.3/16".parse().unwrap();
        let (len, addr) = cidr_key(&net);
        assert_eq!(len, 112);
        assert_eq!(&addr[10..], &[0xff, 0xff, 10, 1, 0, 0]);
        assert_eq!(
            cidr_from_key(len, addr).unwrap(),
            "10.1.0.0/16".parse::<IpNet>().unwrap()
        );
        let net6: IpNet = "fd00:1::/32".parse().unwrap();
        let (len, addr) = cidr_key(&net6);
        assert_eq!(len, 32);
        assert_eq!(cidr_from_key(len, addr).unwrap(), net6);
        assert_eq!(
            cidr_from_key(200, addr),
            Err(TranslateError::BadPrefix { prefix_len: 200 })
        );
    }

    #[test]
    fn peer_flags() {
        let mk = |subject, direction, peer| PolicyEntry {
            subject,
            direction,
            peer,
            protocol: None,
            ports: (0, 0),
        };
        let entries = [
            mk(1, Direction::Ingress, npm_common::IDENTITY_ANY),
            mk(1, Direction::Egress, npm_common::IDENTITY_FIRST_CIDR + 7),
            mk(2, Direction::Ingress, 300),
            mk(2, Direction::Egress, npm_common::IDENTITY_WORLD),
        ];
        let f = subject_peer_flags(&entries);
        assert_eq!(f.len(), 2);
        assert_eq!(
            f[&1],
            EP_NO_PEER_ALL & !(EP_NO_ANY_PEER_INGRESS | EP_NO_CIDR_PEER_EGRESS)
        );
        assert_eq!(
            f[&2],
            EP_NO_PEER_ALL & !(EP_NO_POD_PEER_INGRESS | EP_NO_POD_PEER_EGRESS)
        );
        assert!(subject_peer_flags(&[]).is_empty());
    }

    #[test]
    fn tier_entries_translate() {
        use npm_common::{DIR_EGRESS, DIR_INGRESS, EP_ADMIN_EGRESS, EP_BASELINE_EGRESS};
        let e = TierEntry {
            subject: 7,
            direction: Direction::Egress,
            tier: Tier::Baseline,
            peer: 300,
            protocol: Some(Protocol::Tcp),
            ports: (80, 83),
        };
        let keys = tier_keys(&e).unwrap();
        assert_eq!(keys.len(), 1);
        assert_eq!(keys[0].prefix_len, POLICY_PREFIX_ANY_PORT + 14);
        assert_eq!(keys[0].direction(), DIR_EGRESS | TIER_BASELINE);
        assert_eq!((keys[0].subject(), keys[0].identity(), keys[0].port()), (7, 300, 80));
        let any = TierEntry {
            tier: Tier::Admin,
            direction: Direction::Ingress,
            protocol: None,
            ports: (0, 0),
            ..e
        };
        let k = tier_keys(&any).unwrap();
        assert_eq!(k.len(), 1);
        assert_eq!(k[0].prefix_len, POLICY_PREFIX_ANY_PROTO);
        assert_eq!(k[0].direction(), DIR_INGRESS | TIER_ADMIN);
        let empty = TierEntry { ports: (9, 8), ..e };
        assert_eq!(
            tier_keys(&empty),
            Err(TranslateError::EmptyTierPortRange {
                entry: empty,
                lo: 9,
                hi: 8
            })
        );
        let v = tier_value(&TierValue {
            action: TierAction::Pass,
            rank: 12,
            rule: 4,
        });
        assert_eq!((v.rule, v.action(), v.rank()), (4, TIER_PASS, 12));
        let flags = subject_tier_flags([&e, &any]);
        assert_eq!(flags[&7], EP_BASELINE_EGRESS | EP_ADMIN_INGRESS);
        let mut p = TierPresence::default();
        p.set(Tier::Admin, Direction::Egress);
        assert_eq!(presence_flags(&p), EP_ADMIN_EGRESS);
    }

    #[test]
    fn endpoint_flags() {
        let ep = Endpoint {
            pod: PodRef {
                namespace: "ns".into(),
                name: "p".into(),
                uid: "u".into(),
            },
            identity: 256,
            ipv4: Some("10.0.0.5".parse().unwrap()),
            ipv6: None,
            isolated_ingress: true,
            isolated_egress: false,
            tiers: Default::default(),
            report_new: false,
        };
        let info = endpoint_info(9, &ep);
        assert_eq!(info.id, 9);
        assert_eq!(info.subject, 256);
        assert_eq!(info.flags, EP_PRESENT | EP_ISOLATED_INGRESS | EP_HAS_V4);
        assert_eq!(endpoint_ipv4(&info), Some("10.0.0.5".parse().unwrap()));
        assert_eq!(endpoint_ipv6(&info), None);
        let reported = endpoint_info(9, &Endpoint { report_new: true, ..ep });
        assert_eq!(reported.flags, info.flags | EP_REPORT_NEW);
    }
}
