//! The names learned from DNS answers ([`Learner`]; the answers of one
//! response: [`super::answers`]): each address kept for its TTL (at least
//! the minimum TTL) and a grace, bounded per name, per namespace and in
//! total, saved across agent restarts.

use std::collections::btree_map::Entry;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use std::{fs, io};

use imbl::OrdMap;
use npm_policy::tiers::domains::normalize_name;
use npm_policy::tiers::LearnedNames;
use serde::{Deserialize, Serialize};

pub use super::answers::{parse_response, Answer};

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
    /// Pairs one namespace's pods may have learned (a pair several
    /// namespaces learned counts for each); beyond it that namespace's
    /// soonest-expiring pairs are evicted, so that one namespace resolving
    /// many names cannot push out everyone else's. Default 4,096: a quarter
    /// of `max_addrs`.
    pub max_addrs_per_namespace: usize,
    /// The shortest TTL an answer is kept for (a shorter one is raised to
    /// it; the grace comes on top). Default 0 here; the agent's default
    /// (`--dns-min-ttl-secs`) is 3,600 s.
    pub min_ttl: Duration,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_addrs_per_name: 256,
            max_names: 10_000,
            max_addrs: 16_384,
            max_addrs_per_namespace: 4_096,
            grace: Duration::from_secs(30),
            min_ttl: Duration::ZERO,
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

/// The saved form of a [`Learner`]: name -> address -> expiry (Unix ms),
/// and the same per namespace that learned it (`owners`; absent in files
/// of earlier agents: their pairs are then owned by no namespace).
#[derive(Serialize, Deserialize)]
struct Saved {
    version: u32,
    names: BTreeMap<String, BTreeMap<String, u64>>,
    #[serde(default)]
    owners: BTreeMap<String, BTreeMap<String, BTreeMap<String, u64>>>,
}

/// The namespaces that learned one (name, address) pair, each with its own
/// expiry; the pair expires with the last of them.
type Owners = BTreeMap<String, Instant>;

/// The namespace of pairs loaded from a file that named none (and of
/// replies to addresses that are no pod of this node).
pub const NO_NAMESPACE: &str = "";

/// The learned names: name -> address -> the namespaces that learned it,
/// each until when.
#[derive(Clone, Debug)]
pub struct Learner {
    limits: Limits,
    /// A persistent map: [`Learner::snapshot`] is a constant-time copy.
    names: OrdMap<String, BTreeMap<IpAddr, Owners>>,
    /// Pairs owned per namespace.
    per_namespace: BTreeMap<String, usize>,
    evicted: u64,
}

/// A constant-time copy of the learned names ([`Learner::snapshot`]).
#[derive(Clone, Debug)]
pub struct Snapshot(OrdMap<String, BTreeMap<IpAddr, Owners>>);

impl Snapshot {
    /// The learned names as the compiler takes them.
    pub fn names(&self) -> LearnedNames {
        (self.0.iter())
            .map(|(name, addrs)| (name.clone(), addrs.keys().copied().collect()))
            .collect()
    }
}

/// When a pair expires: with its last owner.
fn expiry(owners: &Owners) -> Option<Instant> {
    owners.values().max().copied()
}

impl Learner {
    /// An empty learner bounded by `limits`.
    pub fn new(limits: Limits) -> Self {
        Self {
            limits,
            names: OrdMap::new(),
            per_namespace: BTreeMap::new(),
            evicted: 0,
        }
    }

    /// Keeps each of `answers` whose name `wanted` accepts, for namespace
    /// `namespace` (the namespace of the pod the response went to), until
    /// `now` + max(TTL, minimum TTL) + grace (a known pair keeps the later
    /// expiry), then evicts beyond the [`Limits`]: first the namespace's
    /// own soonest-expiring pairs beyond its bound (a pair another
    /// namespace learned too stays for that one), then per name and in
    /// total. True when the set of (name, address) pairs changed; a
    /// refresh that only extends expiries is no change.
    pub fn learn(&mut self, now: Instant, namespace: &str, answers: &[Answer], wanted: impl Fn(&str) -> bool) -> bool {
        let mut added: BTreeSet<(String, IpAddr)> = BTreeSet::new();
        for answer in answers {
            let name = normalize_name(&answer.name);
            if name.is_empty() || !wanted(&name) {
                continue;
            }
            let Some(expiry) = (Duration::from_secs(u64::from(answer.ttl)).max(self.limits.min_ttl))
                .checked_add(self.limits.grace)
                .and_then(|d| now.checked_add(d))
            else {
                continue;
            };
            let addr = answer.addr.to_canonical();
            if self.insert(&name, addr, namespace, expiry) {
                added.insert((name, addr));
            }
        }
        let mut evicted = self.enforce_namespace(namespace);
        let touched: BTreeSet<String> = added.iter().map(|(n, _)| n.clone()).collect();
        evicted.extend(self.enforce(touched.iter()));
        let mut changed = false;
        for pair in evicted {
            changed |= !added.remove(&pair);
        }
        changed || !added.is_empty()
    }

    /// Records `addr` for `name`, learned by `namespace`, until `expiry`
    /// (or later if that namespace learned it already); true if the pair is
    /// new.
    fn insert(&mut self, name: &str, addr: IpAddr, namespace: &str, expiry: Instant) -> bool {
        let addrs = self.names.entry(name.to_owned()).or_default();
        let (new_pair, owners) = match addrs.entry(addr) {
            Entry::Vacant(v) => (true, v.insert(Owners::new())),
            Entry::Occupied(o) => (false, o.into_mut()),
        };
        match owners.get_mut(namespace) {
            Some(e) => *e = (*e).max(expiry),
            None => {
                owners.insert(namespace.to_owned(), expiry);
                *self.per_namespace.entry(namespace.to_owned()).or_default() += 1;
            }
        }
        new_pair
    }

    /// Forgets that `namespaces` own a pair (`owners`, being dropped).
    fn disown<'a>(per_namespace: &mut BTreeMap<String, usize>, namespaces: impl Iterator<Item = &'a String>) {
        for ns in namespaces {
            if let Some(n) = per_namespace.get_mut(ns) {
                *n = n.saturating_sub(1);
                if *n == 0 {
                    per_namespace.remove(ns);
                }
            }
        }
    }

    /// Drops the pair (`name`, `addr`) whoever owns it; true if it was there.
    fn remove_pair(&mut self, name: &str, addr: IpAddr) -> bool {
        let Some(addrs) = self.names.get_mut(name) else {
            return false;
        };
        let Some(owners) = addrs.remove(&addr) else {
            return false;
        };
        Self::disown(&mut self.per_namespace, owners.keys());
        if addrs.is_empty() {
            self.names.remove(name);
        }
        true
    }

    /// Evicts `namespace`'s soonest-expiring pairs beyond
    /// [`Limits::max_addrs_per_namespace`]: each loses that owner, and is
    /// dropped when it has no other; the dropped pairs.
    fn enforce_namespace(&mut self, namespace: &str) -> Vec<(String, IpAddr)> {
        let owned = self.per_namespace.get(namespace).copied().unwrap_or(0);
        let excess = owned.saturating_sub(self.limits.max_addrs_per_namespace);
        if excess == 0 {
            return Vec::new();
        }
        let mut own: Vec<(Instant, String, IpAddr)> = (self.names.iter())
            .flat_map(|(n, addrs)| {
                addrs
                    .iter()
                    .filter_map(move |(a, o)| Some((*o.get(namespace)?, n.clone(), *a)))
            })
            .collect();
        own.sort_unstable();
        let mut dropped = Vec::new();
        for (_, name, addr) in own.into_iter().take(excess) {
            let Some(addrs) = self.names.get_mut(&name) else {
                continue;
            };
            let Some(owners) = addrs.get_mut(&addr) else {
                continue;
            };
            owners.remove(namespace);
            Self::disown(&mut self.per_namespace, std::iter::once(&namespace.to_owned()));
            if owners.is_empty() {
                addrs.remove(&addr);
                if addrs.is_empty() {
                    self.names.remove(&name);
                }
                dropped.push((name, addr));
            }
        }
        self.evicted += dropped.len() as u64;
        dropped
    }

    /// Evicts beyond the limits (per name for `touched`, then in total);
    /// the evicted pairs.
    fn enforce<'a>(&mut self, touched: impl Iterator<Item = &'a String>) -> Vec<(String, IpAddr)> {
        let mut evicted = Vec::new();
        for name in touched {
            let Some(addrs) = self.names.get(name) else {
                continue;
            };
            let excess = addrs.len().saturating_sub(self.limits.max_addrs_per_name);
            if excess > 0 {
                let mut by_expiry: Vec<(Option<Instant>, IpAddr)> =
                    addrs.iter().map(|(a, o)| (expiry(o), *a)).collect();
                by_expiry.sort_unstable();
                for (_, addr) in by_expiry.into_iter().take(excess) {
                    self.remove_pair(name, addr);
                    evicted.push((name.clone(), addr));
                }
            }
        }
        let excess = self.names.len().saturating_sub(self.limits.max_names);
        if excess > 0 {
            let mut by_latest: Vec<(Option<Instant>, String)> = (self.names.iter())
                .map(|(n, addrs)| (addrs.values().filter_map(expiry).max(), n.clone()))
                .collect();
            by_latest.sort_unstable();
            for (_, name) in by_latest.into_iter().take(excess) {
                let addrs: Vec<IpAddr> = self
                    .names
                    .get(&name)
                    .map(|a| a.keys().copied().collect())
                    .unwrap_or_default();
                for addr in addrs {
                    self.remove_pair(&name, addr);
                    evicted.push((name.clone(), addr));
                }
            }
        }
        let total: usize = self.names.values().map(BTreeMap::len).sum();
        let excess = total.saturating_sub(self.limits.max_addrs);
        if excess > 0 {
            let mut by_expiry: Vec<(Option<Instant>, String, IpAddr)> = (self.names.iter())
                .flat_map(|(n, addrs)| addrs.iter().map(move |(a, o)| (expiry(o), n.clone(), *a)))
                .collect();
            by_expiry.sort_unstable();
            for (_, name, addr) in by_expiry.into_iter().take(excess) {
                self.remove_pair(&name, addr);
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

    /// Drops what expires at or before `now`: each namespace's claim on a
    /// pair, the pairs left without any, the names left without any; true
    /// if a pair was dropped.
    pub fn expire(&mut self, now: Instant) -> bool {
        let before = self.len();
        let due: Vec<String> = (self.names.iter())
            .filter(|(_, addrs)| addrs.values().any(|o| o.values().any(|e| *e <= now)))
            .map(|(n, _)| n.clone())
            .collect();
        let per_namespace = &mut self.per_namespace;
        for name in due {
            let Some(addrs) = self.names.get_mut(&name) else {
                continue;
            };
            addrs.retain(|_, owners| {
                let gone: Vec<String> = (owners.iter().filter(|(_, e)| **e <= now))
                    .map(|(ns, _)| ns.clone())
                    .collect();
                Self::disown(per_namespace, gone.iter());
                owners.retain(|_, e| *e > now);
                !owners.is_empty()
            });
            if addrs.is_empty() {
                self.names.remove(&name);
            }
        }
        self.len() != before
    }

    /// Drops the names `wanted` no longer accepts; true if any was dropped.
    pub fn retain(&mut self, wanted: impl Fn(&str) -> bool) -> bool {
        let unwanted: Vec<String> = self.names.keys().filter(|n| !wanted(n)).cloned().collect();
        for name in &unwanted {
            let addrs: Vec<IpAddr> = self
                .names
                .get(name)
                .map(|a| a.keys().copied().collect())
                .unwrap_or_default();
            for addr in addrs {
                self.remove_pair(name, addr);
            }
        }
        !unwanted.is_empty()
    }

    /// When the next address expires (`None` when empty).
    pub fn next_expiry(&self) -> Option<Instant> {
        self.names
            .values()
            .flat_map(|addrs| addrs.values())
            .filter_map(expiry)
            .min()
    }

    /// The learned names as the compiler takes them.
    pub fn names(&self) -> LearnedNames {
        self.snapshot().names()
    }

    /// A copy of the learned names in constant time (taken under the
    /// learner's lock; [`Snapshot::names`] then builds them without it).
    pub fn snapshot(&self) -> Snapshot {
        Snapshot(self.names.clone())
    }

    /// (names, addresses) kept.
    pub fn len(&self) -> (usize, usize) {
        (self.names.len(), self.names.values().map(BTreeMap::len).sum())
    }

    /// The pairs namespace `namespace` learned (and still holds).
    pub fn owned_by(&self, namespace: &str) -> usize {
        self.per_namespace.get(namespace).copied().unwrap_or(0)
    }

    /// Whether nothing is learned.
    pub fn is_empty(&self) -> bool {
        self.names.is_empty()
    }

    /// Writes the unexpired names to `path` (atomically: `path` + ".tmp",
    /// then a rename) as JSON `{"version":1,"names":{name:{addr:
    /// expiry_unix_ms}},"owners":{namespace:{name:{addr:expiry_unix_ms}}}}`,
    /// `wall` being the wall-clock time of `now`.
    pub fn save(&self, path: &Path, now: Instant, wall: SystemTime) -> Result<(), DnsError> {
        let unix_ms = |expiry: &Instant| {
            if *expiry <= now {
                return None;
            }
            let at = wall.checked_add(expiry.checked_duration_since(now)?)?;
            u64::try_from(at.duration_since(UNIX_EPOCH).ok()?.as_millis()).ok()
        };
        let mut saved = Saved {
            version: FILE_VERSION,
            names: BTreeMap::new(),
            owners: BTreeMap::new(),
        };
        for (name, addrs) in self.names.iter() {
            for (addr, owners) in addrs {
                let Some(ms) = expiry(owners).as_ref().and_then(unix_ms) else {
                    continue;
                };
                let a = addr.to_string();
                saved.names.entry(name.clone()).or_default().insert(a.clone(), ms);
                for (ns, e) in owners {
                    if let Some(ms) = unix_ms(e) {
                        let by_name = saved.owners.entry(ns.clone()).or_default();
                        by_name.entry(name.clone()).or_default().insert(a.clone(), ms);
                    }
                }
            }
        }
        let json = serde_json::to_vec(&saved).map_err(|e| io_err("encoding", path)(e.into()))?;
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(".tmp");
        let tmp = PathBuf::from(tmp);
        fs::write(&tmp, json).map_err(io_err("writing", &tmp))?;
        fs::rename(&tmp, path).map_err(io_err("renaming to", path))
    }

    /// Reads what [`Learner::save`] wrote, `wall` being the wall-clock time
    /// of `now`, dropping expired entries and those whose name is empty or
    /// address does not parse, then evicting beyond `limits`. A file
    /// without owners (an earlier agent's) gives pairs of no namespace. A
    /// missing file is an empty learner; an unreadable or corrupt one an
    /// error.
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
        let owners = if saved.owners.is_empty() {
            BTreeMap::from([(NO_NAMESPACE.to_owned(), saved.names)])
        } else {
            saved.owners
        };
        for (ns, names) in owners {
            for (name, addrs) in names {
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
                        learner.insert(&name, addr.to_canonical(), &ns, expiry);
                    }
                }
            }
        }
        let namespaces: Vec<String> = learner.per_namespace.keys().cloned().collect();
        for ns in namespaces {
            learner.enforce_namespace(&ns);
        }
        let names: Vec<String> = learner.names.keys().cloned().collect();
        learner.enforce(names.iter());
        Ok(learner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dns::answers::answer;

    fn limits(per_name: usize, names: usize) -> Limits {
        Limits {
            max_addrs_per_name: per_name,
            max_names: names,
            max_addrs: 16_384,
            ..Limits::default()
        }
    }

    #[test]
    fn learn_refresh_and_expire() {
        let t0 = Instant::now();
        let s = Duration::from_secs;
        let mut l = Learner::new(Limits::default());
        let wanted = |n: &str| n.ends_with(".example.com");
        assert!(l.learn(t0, NO_NAMESPACE, &[answer("x.example.com", "192.0.2.1", 60)], wanted));
        assert!(!l.learn(t0, NO_NAMESPACE, &[answer("x.other.org", "192.0.2.2", 60)], wanted));
        assert_eq!(l.next_expiry(), Some(t0 + s(90)));
        assert!(!l.learn(
            t0 + s(10),
            NO_NAMESPACE,
            &[answer("x.example.com", "192.0.2.1", 60)],
            wanted
        ));
        assert_eq!(l.next_expiry(), Some(t0 + s(100)));
        assert!(!l.learn(
            t0 + s(10),
            NO_NAMESPACE,
            &[answer("x.example.com", "192.0.2.1", 1)],
            wanted
        ));
        assert_eq!(l.next_expiry(), Some(t0 + s(100)));
        assert!(l.learn(
            t0,
            NO_NAMESPACE,
            &[answer("x.example.com", "::ffff:192.0.2.3", 10)],
            wanted
        ));
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
    fn the_minimum_ttl_raises_short_ttls() {
        let (t0, s) = (Instant::now(), Duration::from_secs);
        let mut l = Learner::new(Limits {
            min_ttl: s(3600),
            grace: s(30),
            ..Limits::default()
        });
        let answers = [answer("a.io", "192.0.2.1", 5), answer("b.io", "192.0.2.2", 7200)];
        assert!(l.learn(t0, NO_NAMESPACE, &answers, |_| true));
        assert!(
            !l.expire(t0 + s(3629)),
            "a 5 s answer is kept for the minimum TTL and the grace"
        );
        assert!(l.expire(t0 + s(3630)));
        assert_eq!(
            l.names().keys().collect::<Vec<_>>(),
            ["b.io"],
            "a longer TTL is kept as it is"
        );
        assert_eq!(l.next_expiry(), Some(t0 + s(7230)));
    }

    #[test]
    fn limits_evict_the_soonest_expiring() {
        let t0 = Instant::now();
        let mut l = Learner::new(limits(2, 2));
        let all = |_: &str| true;
        let n = [answer("n.io", "192.0.2.1", 20), answer("n.io", "192.0.2.2", 30)];
        assert!(l.learn(t0, NO_NAMESPACE, &n, all));
        // A new address expiring before the others evicts itself: no change.
        assert!(!l.learn(t0, NO_NAMESPACE, &[answer("n.io", "192.0.2.3", 5)], all));
        assert!(l.learn(t0, NO_NAMESPACE, &[answer("n.io", "192.0.2.4", 40)], all));
        assert_eq!(l.evicted(), 2);
        let addrs: BTreeSet<IpAddr> = ["192.0.2.2".parse().expect("ip"), "192.0.2.4".parse().expect("ip")].into();
        assert_eq!(l.names().get("n.io"), Some(&addrs));
        assert!(l.learn(t0, NO_NAMESPACE, &[answer("m.io", "192.0.2.9", 100)], all));
        assert!(l.learn(t0, NO_NAMESPACE, &[answer("k.io", "192.0.2.8", 50)], all));
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
        assert!(l.learn(t0, NO_NAMESPACE, &answers, all));
        assert_eq!(l.len(), (2, 3), "c.io (soonest) evicted");
        assert!(l.learn(t0, NO_NAMESPACE, &[answer("d.io", "192.0.2.5", 100)], all));
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
    fn one_namespace_cannot_evict_the_others_names() {
        let (t0, s) = (Instant::now(), Duration::from_secs);
        let mut l = Learner::new(Limits {
            max_addrs: 10,
            max_addrs_per_namespace: 4,
            ..Limits::default()
        });
        let all = |_: &str| true;
        // Two namespaces learn short-lived names; one floods with 50
        // longer-lived ones (the soonest-expiring would be the others').
        assert!(l.learn(
            t0,
            "a",
            &[answer("a.io", "192.0.2.1", 10), answer("shared.io", "192.0.2.9", 10)],
            all
        ));
        assert!(l.learn(t0, "b", &[answer("b.io", "192.0.2.2", 10)], all));
        for i in 0..50u8 {
            let name = format!("f{i}.io");
            let addr = format!("198.51.100.{i}");
            l.learn(t0 + s(u64::from(i)), "flood", &[answer(&name, &addr, 600)], all);
        }
        // The flood also resolved the shared name: its claim is evicted
        // first among its own (soonest), the pair stays for "a".
        l.learn(t0 + s(60), "flood", &[answer("shared.io", "192.0.2.9", 1)], all);
        let names = l.names();
        for kept in ["a.io", "b.io", "shared.io"] {
            assert!(
                names.contains_key(kept),
                "{kept} evicted by another namespace: {names:?}"
            );
        }
        assert_eq!(l.owned_by("flood"), 4, "the flood keeps its bound");
        assert_eq!((l.owned_by("a"), l.owned_by("b")), (2, 1));
        assert!(
            names.contains_key("f49.io") && !names.contains_key("f0.io"),
            "its own soonest go"
        );
        assert_eq!(l.len(), (7, 7));
        // Saved and loaded: the owners (and so the bounds) are kept.
        let dir = temp_dir("owners");
        let path = dir.join("names.json");
        let wall = UNIX_EPOCH + s(1_700_000_000);
        l.save(&path, t0, wall).expect("saves");
        let back = Learner::load(&path, t0, wall, l.limits).expect("loads");
        assert_eq!(back.names(), l.names());
        assert_eq!((back.owned_by("flood"), back.owned_by("a")), (4, 2));
        // Expiry drops each namespace's claim: "a" and "b" (10 s) go,
        // the flood's (600 s) stay.
        let mut back = back;
        assert!(back.expire(t0 + s(41)));
        assert_eq!(
            (back.owned_by("a"), back.owned_by("b"), back.owned_by("flood")),
            (0, 0, 4)
        );
        fs::remove_dir_all(&dir).expect("cleanup");
    }

    #[test]
    fn retain_drops_unwanted_names() {
        let t0 = Instant::now();
        let mut l = Learner::new(Limits::default());
        let answers = [answer("a.io", "192.0.2.1", 60), answer("b.io", "192.0.2.2", 60)];
        assert!(l.learn(t0, NO_NAMESPACE, &answers, |_| true));
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
        assert!(l.learn(t0, NO_NAMESPACE, &answers, |_| true));
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
