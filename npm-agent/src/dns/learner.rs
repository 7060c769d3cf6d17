//! The answers of one DNS response ([`parse_response`]) and the names
//! learned from them ([`Learner`]): each address kept for its TTL and a
//! grace, bounded per name and in total, saved across agent restarts.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use std::{fs, io};

use npm_policy::tiers::domains::normalize_name;
use npm_policy::tiers::LearnedNames;
use serde::{Deserialize, Serialize};
use simple_dns::rdata::RData;
use simple_dns::{Packet, PacketFlag, CLASS, RCODE};

/// The longest CNAME chain (in CNAME records) followed back from an
/// address record to an alias.
const MAX_CHAIN: usize = 16;

/// The version of the saved file format.
const FILE_VERSION: u32 = 1;

/// What parsing a DNS response or saving/loading the learned names failed on.
#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    /// The payload is not a DNS message.
    #[error("DNS payload of {len} bytes does not parse: {source}")]
    Parse {
        /// The payload's length.
        len: usize,
        /// simple-dns's error.
        #[source]
        source: simple_dns::SimpleDnsError,
    },
    /// The message is a query (QR clear), not a response.
    #[error("DNS message {id} is a query, not a response")]
    NotResponse {
        /// The message ID.
        id: u16,
    },
    /// Reading, encoding, writing or renaming the saved names failed.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// The saved names are not the expected JSON.
    #[error("learned names file {path} is corrupt: {source}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// serde_json's error.
        #[source]
        source: serde_json::Error,
    },
    /// The saved names have an unknown format version.
    #[error("learned names file {path} has version {version}, expected {FILE_VERSION}")]
    Version {
        /// The file.
        path: PathBuf,
        /// The version found.
        version: u32,
    },
}

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

/// Bounds of the [`Learner`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// Addresses kept per name (the NPEP requires at least 100); beyond it
    /// the name's soonest-expiring addresses are evicted. Default 256.
    pub max_addrs_per_name: usize,
    /// Names kept; beyond it the names whose latest expiry is soonest are
    /// evicted. Default 10 000.
    pub max_names: usize,
    /// Addresses kept in all (each is a CIDR prefix of the compiled state:
    /// an `NPM_CIDRS` entry on eBPF, default 65,536 entries); beyond it the
    /// soonest-expiring (name, address) pairs are evicted. Default 16,384.
    pub max_addrs: usize,
    /// How long an address is kept beyond its TTL (the NPEP's optional
    /// "grace period beyond the TTL"). Default 30 s.
    pub grace: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_addrs_per_name: 256,
            max_names: 10_000,
            max_addrs: 16_384,
            grace: Duration::from_secs(30),
        }
    }
}

/// A [`DnsError::Io`] maker for `op` on `path`.
fn io_err<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(io::Error) -> DnsError + 'a {
    move |source| DnsError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// The saved form of a [`Learner`]: name -> address -> expiry (Unix ms).
#[derive(Serialize, Deserialize)]
struct Saved {
    version: u32,
    names: BTreeMap<String, BTreeMap<String, u64>>,
}

/// The learned names: name -> address -> when it expires.
#[derive(Clone, Debug)]
pub struct Learner {
    limits: Limits,
    names: BTreeMap<String, BTreeMap<IpAddr, Instant>>,
    evicted: u64,
}

impl Learner {
    /// An empty learner bounded by `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            names: BTreeMap::new(),
            evicted: 0,
        }
    }

    /// Keeps each of `answers` whose name `wanted` accepts until `now` +
    /// TTL + grace (a known pair keeps the later expiry), then evicts beyond
    /// the [`Limits`]. True when the set of (name, address) pairs changed;
    /// a refresh that only extends expiries is no change.
    pub fn learn(&mut self, now: Instant, answers: &[Answer], wanted: impl Fn(&str) -> bool) -> bool {
        let mut added: BTreeSet<(String, IpAddr)> = BTreeSet::new();
        for answer in answers {
            let name = normalize_name(&answer.name);
            if name.is_empty() || !wanted(&name) {
                continue;
            }
            let Some(expiry) = Duration::from_secs(u64::from(answer.ttl))
                .checked_add(self.limits.grace)
                .and_then(|d| now.checked_add(d))
            else {
                continue;
            };
            let addr = answer.addr.to_canonical();
            if self.insert(&name, addr, expiry) {
                added.insert((name, addr));
            }
        }
        let touched: BTreeSet<String> = added.iter().map(|(n, _)| n.clone()).collect();
        let mut changed = false;
        for pair in self.enforce(touched.iter()) {
            changed |= !added.remove(&pair);
        }
        changed || !added.is_empty()
    }

    /// Records `addr` for `name` until `expiry` (or later if already
    /// known); true if the pair is new.
    fn insert(&mut self, name: &str, addr: IpAddr, expiry: Instant) -> bool {
        let addrs = self.names.entry(name.to_owned()).or_default();
        match addrs.entry(addr) {
            Entry::Vacant(v) => {
                v.insert(expiry);
                true
            }
            Entry::Occupied(mut o) => {
                if *o.get() < expiry {
                    o.insert(expiry);
                }
                false
            }
        }
    }

    /// Evicts beyond the limits (per name for `touched`, then in total);
    /// the evicted pairs.
    fn enforce<'a>(&mut self, touched: impl Iterator<Item = &'a String>) -> Vec<(String, IpAddr)> {
        let mut evicted = Vec::new();
        for name in touched {
            let Some(addrs) = self.names.get_mut(name) else {
                continue;
            };
            let excess = addrs.len().saturating_sub(self.limits.max_addrs_per_name);
            if excess > 0 {
                let mut by_expiry: Vec<(Instant, IpAddr)> = addrs.iter().map(|(a, e)| (*e, *a)).collect();
                by_expiry.sort_unstable();
                for (_, addr) in by_expiry.into_iter().take(excess) {
                    addrs.remove(&addr);
                    evicted.push((name.clone(), addr));
                }
            }
            if addrs.is_empty() {
                self.names.remove(name);
            }
        }
        let excess = self.names.len().saturating_sub(self.limits.max_names);
        if excess > 0 {
            let mut by_latest: Vec<(Option<Instant>, String)> = (self.names.iter())
                .map(|(n, addrs)| (addrs.values().max().copied(), n.clone()))
                .collect();
            by_latest.sort_unstable();
            for (_, name) in by_latest.into_iter().take(excess) {
                let addrs = self.names.remove(&name).unwrap_or_default();
                evicted.extend(addrs.into_keys().map(|a| (name.clone(), a)));
            }
        }
        let total: usize = self.names.values().map(BTreeMap::len).sum();
        let excess = total.saturating_sub(self.limits.max_addrs);
        if excess > 0 {
            let mut by_expiry: Vec<(Instant, String, IpAddr)> = (self.names.iter())
                .flat_map(|(n, addrs)| addrs.iter().map(move |(a, e)| (*e, n.clone(), *a)))
                .collect();
            by_expiry.sort_unstable();
            for (_, name, addr) in by_expiry.into_iter().take(excess) {
                if let Some(addrs) = self.names.get_mut(&name) {
                    addrs.remove(&addr);
                    if addrs.is_empty() {
                        self.names.remove(&name);
                    }
                }
                evicted.push((name, addr));
            }
        }
        self.evicted += evicted.len() as u64;
        evicted
    }

    /// How many (name, address) pairs the limits have evicted so far.
    pub fn evicted(&self) -> u64 {
        self.evicted
    }

    /// Drops the addresses expiring at or before `now` (and the names left
    /// without any); true if anything was dropped.
    pub fn expire(&mut self, now: Instant) -> bool {
        let before = self.len();
        self.names.retain(|_, addrs| {
            addrs.retain(|_, expiry| *expiry > now);
            !addrs.is_empty()
        });
        self.len() != before
    }

    /// Drops the names `wanted` no longer accepts; true if any was dropped.
    pub fn retain(&mut self, wanted: impl Fn(&str) -> bool) -> bool {
        let before = self.names.len();
        self.names.retain(|name, _| wanted(name));
        self.names.len() != before
    }

    /// When the next address expires (`None` when empty).
    pub fn next_expiry(&self) -> Option<Instant> {
        self.names.values().flat_map(|addrs| addrs.values()).min().copied()
    }

    /// The learned names as the compiler takes them.
    pub fn names(&self) -> LearnedNames {
        (self.names.iter())
            .map(|(name, addrs)| (name.clone(), addrs.keys().copied().collect()))
            .collect()
    }

    /// (names, addresses) kept.
    pub fn len(&self) -> (usize, usize) {
        (self.names.len(), self.names.values().map(BTreeMap::len).sum())
    }

    /// Whether nothing is learned.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Writes the unexpired names to `path` (atomically: `path` + ".tmp",
    /// then a rename) as JSON `{"version":1,"names":{name:{addr:
    /// expiry_unix_ms}}}`, `wall` being the wall-clock time of `now`.
    pub fn save(&self, path: &Path, now: Instant, wall: SystemTime) -> Result<(), DnsError> {
        let unix_ms = |expiry: &Instant| {
            let at = wall.checked_add(expiry.checked_duration_since(now)?)?;
            u64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()
        };
        let names = (self.names.iter())
            .map(|(name, addrs)| {
                let addrs = (addrs.iter().filter(|(_, e)| **e > now))
                    .filter_map(|(a, e)| Some((a.to_string(), unix_ms(e)?)))
                    .collect::<BTreeMap<_, _>>();
                (name.clone(), addrs)
            })
            .filter(|(_, addrs)| !addrs.is_empty())
            .collect();
        let json = serde_json::to_vec(&Saved {
            version: FILE_VERSION,
            names,
        })
        .map_err(|e| io_err("encoding", path)(e.into()))?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        fs::write(&tmp, json).map_err(io_err("writing", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("renaming to", path))
    }

    /// Reads what [`Learner::save`] wrote, `wall` being the wall-clock time
    /// of `now`, dropping expired entries and those whose name is empty or
    /// address does not parse, then evicting beyond `limits`. A missing
    /// file is an empty learner; an unreadable or corrupt one an error.
    pub fn load(path: &Path, now: Instant, wall: SystemTime, limits: Limits) -> Result<Self, DnsError> {
        let mut learner = Self::new(limits);
        let bytes = match fs::read(path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(learner),
            Err(source) => return Err(io_err("reading", path)(source)),
        };
        let saved: Saved = serde_json::from_slice(&bytes).map_err(|source| DnsError::Corrupt {
            path: path.to_owned(),
            source,
        })?;
        if saved.version != FILE_VERSION {
            return Err(DnsError::Version {
                path: path.to_owned(),
                version: saved.version,
            });
        }
        for (name, addrs) in saved.names {
            let name = normalize_name(&name);
            if name.is_empty() {
                continue;
            }
            for (addr, ms) in addrs {
                let Ok(addr) = addr.parse::<IpAddr>() else {
                    continue;
                };
                let left = UNIX_EPOCH
                    .checked_add(Duration::from_millis(ms))
                    .and_then(|at| at.duration_since(wall).ok())
                    .filter(|left| !left.is_zero());
                if let Some(expiry) = left.and_then(|left| now.checked_add(left)) {
                    learner.insert(&name, addr.to_canonical(), expiry);
                }
            }
        }
        let names: Vec<String> = learner.names.keys().cloned().collect();
        learner.enforce(names.iter());
        Ok(learner)
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

    fn answer(name: &str, addr: &str, ttl: u32) -> Answer {
        let addr = addr.parse().expect("test address");
        Answer {
            name: name.to_owned(),
            addr,
            ttl,
        }
    }

    fn limits(per_name: usize, names: usize) -> Limits {
        Limits {
            max_addrs_per_name: per_name,
            max_names: names,
            max_addrs: 16_384,
            grace: Duration::from_secs(30),
        }
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

    #[test]
    fn learn_refresh_and_expire() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut l = Learner::new(Limits::default());
        let wanted = |n: &str| n.ends_with(".example.com");
        assert!(l.learn(t0, &[answer("x.example.com", "192.0.2.1", 60)], wanted));
        assert!(!l.learn(t0, &[answer("x.other.org", "192.0.2.2", 60)], wanted));
        assert_eq!(l.next_expiry(), Some(t0 + s(90)));
        assert!(!l.learn(t0 + s(10), &[answer("x.example.com", "192.0.2.1", 60)], wanted));
        assert_eq!(l.next_expiry(), Some(t0 + s(100)));
        assert!(!l.learn(t0 + s(10), &[answer("x.example.com", "192.0.2.1", 1)], wanted));
        assert_eq!(l.next_expiry(), Some(t0 + s(100)));
        assert!(l.learn(t0, &[answer("x.example.com", "::ffff:192.0.2.3", 10)], wanted));
        assert_eq!(l.len(), (1, 2));
        assert!(l.expire(t0 + s(40)));
        assert!(!l.expire(t0 + s(99)));
        let want: LearnedNames = [("x.example.com".into(), ["192.0.2.1".parse().expect("ip")].into())].into();
        assert_eq!(l.names(), want);
        assert!(l.expire(t0 + s(100)));
        assert!(l.is_empty());
        assert_eq!(l.next_expiry(), None);
    }

    #[test]
    fn limits_evict_the_soonest_expiring() {
        let t0 = Instant::now();
        let mut l = Learner::new(limits(2, 2));
        let all = |_: &str| true;
        let n = [answer("n.io", "192.0.2.1", 20), answer("n.io", "192.0.2.2", 30)];
        assert!(l.learn(t0, &n, all));
        // A new address expiring before the others evicts itself: no change.
        assert!(!l.learn(t0, &[answer("n.io", "192.0.2.3", 5)], all));
        assert!(l.learn(t0, &[answer("n.io", "192.0.2.4", 40)], all));
        assert_eq!(l.evicted(), 2);
        let addrs: BTreeSet<IpAddr> = ["192.0.2.2".parse().expect("ip"), "192.0.2.4".parse().expect("ip")].into();
        assert_eq!(l.names().get("n.io"), Some(&addrs));
        assert!(l.learn(t0, &[answer("m.io", "192.0.2.9", 100)], all));
        assert!(l.learn(t0, &[answer("k.io", "192.0.2.8", 50)], all));
        assert_eq!(l.names().keys().collect::<Vec<_>>(), ["k.io", "m.io"]);
        assert_eq!(l.evicted(), 4);
        assert_eq!(l.len(), (2, 2));
    }

    #[test]
    fn the_total_address_cap_evicts_the_soonest_expiring() {
        let t0 = Instant::now();
        let mut l = Learner::new(Limits {
            max_addrs: 3,
            ..Limits::default()
        });
        let all = |_: &str| true;
        let answers = [
            answer("a.io", "192.0.2.1", 50),
            answer("a.io", "192.0.2.2", 10),
            answer("b.io", "192.0.2.3", 30),
            answer("c.io", "192.0.2.4", 5),
        ];
        assert!(l.learn(t0, &answers, all));
        assert_eq!(l.len(), (2, 3), "c.io (soonest) evicted");
        assert!(l.learn(t0, &[answer("d.io", "192.0.2.5", 100)], all));
        let left: Vec<(String, usize)> = l.names().into_iter().map(|(n, a)| (n, a.len())).collect();
        assert_eq!(
            left,
            [
                ("a.io".to_string(), 1),
                ("b.io".to_string(), 1),
                ("d.io".to_string(), 1)
            ]
        );
        assert_eq!(l.evicted(), 2);
    }

    #[test]
    fn retain_drops_unwanted_names() {
        let t0 = Instant::now();
        let mut l = Learner::new(Limits::default());
        let answers = [answer("a.io", "192.0.2.1", 60), answer("b.io", "192.0.2.2", 60)];
        assert!(l.learn(t0, &answers, |_| true));
        assert!(!l.retain(|_| true));
        assert!(l.retain(|n| n == "a.io"));
        assert_eq!(l.names().keys().collect::<Vec<_>>(), ["a.io"]);
    }

    fn temp_dir(test: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("npm-dns-learner-{}-{test}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        dir
    }

    #[test]
    fn save_load_round_trip_drops_expired() {
        let dir = temp_dir("roundtrip");
        let path = dir.join("names.json");
        let (t0, s) = (Instant::now(), Duration::from_secs);
        let wall = UNIX_EPOCH + s(1_700_000_000);
        let mut l = Learner::new(limits(256, 100));
        let answers = [answer("a.io", "192.0.2.1", 60), answer("b.io", "2001:db8::2", 300)];
        assert!(l.learn(t0, &answers, |_| true));
        l.save(&path, t0, wall).expect("saves");
        assert!(!dir.join("names.json.tmp").exists());
        let same = Learner::load(&path, t0, wall, Limits::default()).expect("loads");
        assert_eq!(same.names(), l.names());
        assert_eq!(same.next_expiry(), Some(t0 + s(90)));
        // Restarted 100 s later: a.io (expiring at 90 s) is gone.
        let t1 = t0 + s(5);
        let later = Learner::load(&path, t1, wall + s(100), Limits::default()).expect("loads");
        assert_eq!(later.names().keys().collect::<Vec<_>>(), ["b.io"]);
        assert_eq!(later.next_expiry(), Some(t1 + s(230)));
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn load_skips_bad_entries_and_rejects_corrupt_files() {
        let dir = temp_dir("corrupt");
        let path = dir.join("names.json");
        let (t0, wall) = (Instant::now(), UNIX_EPOCH + Duration::from_secs(1_000));
        let missing = Learner::load(&path, t0, wall, Limits::default()).expect("missing is empty");
        assert!(missing.is_empty());
        let json =
            r#"{"version":1,"names":{"Example.COM.":{"192.0.2.1":1010000,"bogus":1010000},".":{"192.0.2.2":1010000}}}"#;
        fs::write(&path, json).expect("write");
        let l = Learner::load(&path, t0, wall, Limits::default()).expect("loads");
        assert_eq!(l.len(), (1, 1));
        assert_eq!(l.next_expiry(), Some(t0 + Duration::from_secs(10)));
        fs::write(&path, "{not json").expect("write");
        let err = Learner::load(&path, t0, wall, Limits::default());
        assert!(matches!(err, Err(DnsError::Corrupt { .. })));
        fs::write(&path, r#"{"version":2,"names":{}}"#).expect("write");
        let err = Learner::load(&path, t0, wall, Limits::default());
        assert!(matches!(err, Err(DnsError::Version { version: 2, .. })));
        fs::remove_dir_all(&dir).expect("cleanup");
    }
}
