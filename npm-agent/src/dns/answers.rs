//! The answers of one DNS response ([`parse_response`]): each A/AAAA
//! address with the names reaching it and the TTL it may be kept for.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use npm_policy::tiers::domains::normalize_name;
use simple_dns::rdata::RData;
use simple_dns::{Packet, PacketFlag, CLASS, RCODE};

use super::learner::DnsError;

/// The longest CNAME chain (in CNAME records) followed back from an
/// address record to an alias.
const MAX_CHAIN: usize = 16;
/// One address a response gave a name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Answer {
    /// The name (lowercase, without a trailing dot): the address record's
    /// owner or an alias reaching it through the response's CNAME records.
    pub name: String,
    /// The address (IPv4-mapped IPv6 as IPv4).
    pub addr: IpAddr,
    /// Seconds the answer may be kept: the minimum TTL along the chain.
    pub ttl: u32,
}

/// The answers of the DNS response `payload`: every A/AAAA record (class
/// IN) of the answer section for its owner and for every name reaching the
/// owner through a chain of at most 16 CNAME records of the same answer
/// section (the NPEP: "if the upstream resolver used CNAME chasing and
/// returns the resulting chain in a single response, the implementor can
/// use it"), with the minimum TTL along the chain. Sorted, one per (name,
/// address) with the largest TTL. A response whose RCODE is not NoError has
/// no answers; a query or unparsable data is an error.
pub fn parse_response(payload: &[u8]) -> Result<Vec<Answer>, DnsError> {
    let packet = Packet::parse(payload).map_err(|source| DnsError::Parse {
        len: payload.len(),
        source,
    })?;
    if !packet.has_flags(PacketFlag::RESPONSE) {
        return Err(DnsError::NotResponse { id: packet.id() });
    }
    if packet.rcode() != RCODE::NoError {
        return Ok(Vec::new());
    }
    let mut addrs: Vec<(String, IpAddr, u32)> = Vec::new();
    let mut cnames: Vec<(String, String, u32)> = Vec::new();
    for rr in packet.answers.iter().filter(|rr| rr.class == CLASS::IN) {
        let owner = normalize_name(&rr.name.to_string());
        match &rr.rdata {
            RData::A(a) => addrs.push((owner, IpAddr::V4(Ipv4Addr::from(a.address)), rr.ttl)),
            RData::AAAA(a) => addrs.push((owner, IpAddr::V6(Ipv6Addr::from(a.address)).to_canonical(), rr.ttl)),
            RData::CNAME(c) => cnames.push((owner, normalize_name(&c.0.to_string()), rr.ttl)),
            _ => {}
        }
    }
    let mut aliases_of: BTreeMap<&str, BTreeMap<&str, u32>> = BTreeMap::new();
    let mut best: BTreeMap<(String, IpAddr), u32> = BTreeMap::new();
    for (owner, addr, ttl) in &addrs {
        if owner.is_empty() {
            continue;
        }
        let aliases = aliases_of
            .entry(owner.as_str())
            .or_insert_with(|| chain_aliases(owner, &cnames));
        let own = std::iter::once((owner.as_str(), *ttl));
        for (name, ttl) in own.chain(aliases.iter().map(|(n, t)| (*n, (*t).min(*ttl)))) {
            let slot = best.entry((name.to_owned(), *addr)).or_insert(ttl);
            *slot = (*slot).max(ttl);
        }
    }
    Ok(best
        .into_iter()
        .map(|((name, addr), ttl)| Answer { name, addr, ttl })
        .collect())
}

/// The names reaching `owner` through at most [`MAX_CHAIN`] of `cnames`
/// (alias, target, TTL), each with the largest minimum CNAME TTL over its
/// chains (a hop-bounded widest path: loops only ever lower the minimum).
fn chain_aliases<'a>(owner: &str, cnames: &'a [(String, String, u32)]) -> BTreeMap<&'a str, u32> {
    let mut best: BTreeMap<&'a str, u32> = BTreeMap::new();
    let mut frontier: BTreeMap<&str, u32> = BTreeMap::from([(owner, u32::MAX)]);
    for _ in 0..MAX_CHAIN {
        let mut next: BTreeMap<&'a str, u32> = BTreeMap::new();
        for (alias, target, ttl) in cnames {
            let Some(reach) = frontier.get(target.as_str()) else {
                continue;
            };
            let ttl = (*reach).min(*ttl);
            if alias.is_empty() || alias == owner || best.get(alias.as_str()).is_some_and(|b| *b >= ttl) {
                continue;
            }
            best.insert(alias, ttl);
            let slot = next.entry(alias).or_insert(ttl);
            *slot = (*slot).max(ttl);
        }
        if next.is_empty() {
            break;
        }
        frontier = next;
    }
    best
}

/// An answer for a test: `name` at `addr` (parsed) for `ttl` seconds.
#[cfg(test)]
pub(crate) fn answer(name: &str, addr: &str, ttl: u32) -> Answer {
    Answer {
        name: name.to_owned(),
        addr: addr.parse().expect("test address"),
        ttl,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use simple_dns::rdata::CNAME;
    use simple_dns::{Name, ResourceRecord};

    fn rr<'a>(name: &'a str, ttl: u32, rdata: RData<'a>) -> ResourceRecord<'a> {
        ResourceRecord::new(Name::new_unchecked(name), CLASS::IN, ttl, rdata)
    }

    fn a(name: &str, ttl: u32, ip: [u8; 4]) -> ResourceRecord<'_> {
        rr(name, ttl, RData::A(Ipv4Addr::from(ip).into()))
    }

    fn cname<'a>(name: &'a str, ttl: u32, target: &'a str) -> ResourceRecord<'a> {
        rr(name, ttl, RData::CNAME(CNAME(Name::new_unchecked(target))))
    }

    fn reply(answers: Vec<ResourceRecord<'_>>) -> Vec<u8> {
        let mut packet = Packet::new_reply(7);
        packet.answers = answers;
        packet.build_bytes_vec().expect("reply builds")
    }

    #[test]
    fn responses_give_their_answers() {
        let v6: Ipv6Addr = "2001:db8::1".parse().expect("v6");
        let mapped: Ipv6Addr = "::ffff:192.0.2.9".parse().expect("mapped");
        // (what, the answer section, the answers as (name, address, TTL)).
        type Row = (
            &'static str,
            Vec<ResourceRecord<'static>>,
            &'static [(&'static str, &'static str, u32)],
        );
        let table: Vec<Row> = vec![
            (
                "A and AAAA answers, names lowercased, IPv4-mapped read as IPv4",
                vec![
                    a("WWW.Example.COM", 60, [192, 0, 2, 1]),
                    rr("www.example.com", 120, RData::AAAA(v6.into())),
                    rr("Other.Example.com", 30, RData::AAAA(mapped.into())),
                ],
                &[
                    ("other.example.com", "192.0.2.9", 30),
                    ("www.example.com", "192.0.2.1", 60),
                    ("www.example.com", "2001:db8::1", 120),
                ],
            ),
            (
                "a CNAME chain gives every name, with the chain's smallest TTL",
                vec![
                    cname("www.example.com", 300, "cdn.example.net"),
                    cname("cdn.example.net", 50, "edge.example.net"),
                    a("edge.example.net", 120, [192, 0, 2, 7]),
                ],
                &[
                    ("cdn.example.net", "192.0.2.7", 50),
                    ("edge.example.net", "192.0.2.7", 120),
                    ("www.example.com", "192.0.2.7", 50),
                ],
            ),
            (
                "a CNAME loop terminates",
                vec![
                    cname("a.example.com", 60, "b.example.com"),
                    cname("b.example.com", 60, "a.example.com"),
                    a("b.example.com", 10, [192, 0, 2, 1]),
                ],
                &[("a.example.com", "192.0.2.1", 10), ("b.example.com", "192.0.2.1", 10)],
            ),
        ];
        for (what, records, want) in table {
            let answers = parse_response(&reply(records)).expect("parses");
            let want: Vec<Answer> = want.iter().map(|(n, a, t)| answer(n, a, *t)).collect();
            assert_eq!(answers, want, "{what}");
        }
    }

    #[test]
    fn query_is_an_error_and_nxdomain_has_no_answers() {
        let query = Packet::new_query(1).build_bytes_vec().expect("query builds");
        assert!(matches!(parse_response(&query), Err(DnsError::NotResponse { id: 1 })));
        assert!(matches!(
            parse_response(&[1, 2, 3]),
            Err(DnsError::Parse { len: 3, .. })
        ));
        let mut nx = Packet::new_reply(2);
        *nx.rcode_mut() = RCODE::NameError;
        nx.answers.push(a("x.example.com", 60, [192, 0, 2, 1]));
        let nx = nx.build_bytes_vec().expect("nxdomain builds");
        assert_eq!(parse_response(&nx).expect("parses"), vec![]);
    }
}
