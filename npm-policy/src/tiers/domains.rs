//! `domainNames` egress peers (experimental, Accept rules only): the
//! validated pattern ([`DomainPattern`]) and what a peer of such patterns
//! stands for at compile time: the host prefixes of the addresses the
//! snapshot's learned names ([`LearnedNames`], `Snapshot::domain_names`)
//! map to ([`domain_prefixes`]).
//!
//! The compiler stays free of I/O: the names are learned outside it (from
//! the DNS answers the trusted servers give selected pods, each kept for
//! its TTL) and handed to it as data. What is not (or no longer) learned is
//! not allowed: a `domainNames` peer never matches more than the addresses
//! of its names' current answers, so an incomplete view only denies (the
//! API allows these peers in Accept rules only for that reason).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use ipnet::IpNet;
use serde::{Deserialize, Serialize};

/// Learned names: a domain name (lowercase, without a trailing dot) -> the
/// addresses its current answers hold (IPv4-mapped IPv6 addresses as
/// IPv4).
pub type LearnedNames = BTreeMap<String, BTreeSet<IpAddr>>;

/// One `domainNames` entry: an exact name, or `*.` and a suffix.
///
/// API text: "DomainName can be an exact match, or use the wildcard
/// specifier '*' to match one or more labels. '*', the wildcard specifier,
/// matches one or more entire labels. It does not support partial matches.
/// '*' may only be specified as a prefix."
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct DomainPattern {
    /// The name, or the suffix after `*.` (lowercase, no trailing dot).
    pub name: String,
    /// `*.` was given: one or more labels before `name`, never `name`
    /// itself.
    pub wildcard: bool,
}

impl fmt::Display for DomainPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.wildcard {
            write!(f, "*.{}", self.name)
        } else {
            f.write_str(&self.name)
        }
    }
}

/// Whether `label` is one label of the API's pattern:
/// `[a-zA-Z0-9]([-a-zA-Z0-9_]*[a-zA-Z0-9])?`.
fn valid_label(label: &str) -> bool {
    let b = label.as_bytes();
    let (Some(first), Some(last)) = (b.first(), b.last()) else {
        return false;
    };
    first.is_ascii_alphanumeric()
        && last.is_ascii_alphanumeric()
        && b.iter().all(|c| c.is_ascii_alphanumeric() || *c == b'-' || *c == b'_')
        && b.len() <= 63
}

impl DomainPattern {
    /// Parses a `domainNames` entry as the API's pattern allows it
    /// (`^(\*\.)?(label\.)+label\.?$`: at least two labels, an optional
    /// trailing dot), lowercased (DNS names compare without case).
    pub fn parse(s: &str) -> Result<Self, String> {
        let (wildcard, rest) = match s.strip_prefix("*.") {
            Some(r) => (true, r),
            None => (false, s),
        };
        let rest = rest.strip_suffix('.').unwrap_or(rest);
        let labels: Vec<&str> = rest.split('.').collect();
        if labels.len() < 2 || !labels.iter().all(|l| valid_label(l)) || rest.len() > 253 {
            return Err(format!(
                "{s:?} is not a domain name: at least two labels of letters, digits, '-' and '_' \
                 (not first or last), optionally after \"*.\""
            ));
        }
        Ok(Self {
            name: rest.to_ascii_lowercase(),
            wildcard,
        })
    }

    /// Whether the learned name `name` (lowercase, no trailing dot)
    /// matches. "`kubernetes.io` matches only `kubernetes.io`"; "`*.kubernetes.io`
    /// matches subdomains of kubernetes.io. "www.kubernetes.io",
    /// "blog.kubernetes.io", and "latest.blog.kubernetes.io" match, however
    /// "kubernetes.io", and "wikipedia.org" do not."
    pub fn matches(&self, name: &str) -> bool {
        if !self.wildcard {
            return name == self.name;
        }
        name.len() > self.name.len() + 1
            && name.ends_with(self.name.as_str())
            && name.as_bytes()[name.len() - self.name.len() - 1] == b'.'
    }
}

/// A learned name as [`LearnedNames`] keys it: lowercase, without a
/// trailing dot.
pub fn normalize_name(name: &str) -> String {
    name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase()
}

/// The host prefix (`/32`, `/128`) of an address.
fn host(ip: IpAddr) -> IpNet {
    IpNet::from(ip.to_canonical())
}

/// What a `domainNames` peer of `patterns` stands for: the host prefixes of
/// every address of every learned name one of them matches.
pub fn domain_prefixes(patterns: &[DomainPattern], learned: &LearnedNames) -> BTreeSet<IpNet> {
    let mut out = BTreeSet::new();
    for p in patterns {
        if p.wildcard {
            for (name, ips) in learned {
                if p.matches(name) {
                    out.extend(ips.iter().map(|ip| host(*ip)));
                }
            }
        } else if let Some(ips) = learned.get(&p.name) {
            out.extend(ips.iter().map(|ip| host(*ip)));
        }
    }
    out
}

/// Whether `ip` is an address of a learned name one of `patterns` matches.
pub fn domain_matches(patterns: &[DomainPattern], learned: &LearnedNames, ip: IpAddr) -> bool {
    let ip = ip.to_canonical();
    learned
        .iter()
        .any(|(name, ips)| ips.iter().any(|a| a.to_canonical() == ip) && patterns.iter().any(|p| p.matches(name)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn learned(entries: &[(&str, &[&str])]) -> LearnedNames {
        entries
            .iter()
            .map(|(n, ips)| (n.to_string(), ips.iter().map(|i| i.parse().unwrap()).collect()))
            .collect()
    }

    #[test]
    fn patterns_parse_as_the_api_allows() {
        for (s, name, wildcard) in [
            ("kubernetes.io", "kubernetes.io", false),
            ("Blog.Kubernetes.IO.", "blog.kubernetes.io", false),
            ("*.kubernetes.io", "kubernetes.io", true),
            ("my_host-1.example.com", "my_host-1.example.com", false),
        ] {
            assert_eq!(
                DomainPattern::parse(s),
                Ok(DomainPattern {
                    name: name.into(),
                    wildcard
                }),
                "{s}"
            );
        }
        for bad in [
            "",
            "localhost",
            "*.io",
            "*kubernetes.io",
            "www.*.io",
            "-a.io",
            "a-.io",
            "a..io",
            "*",
            "a.io..",
            "exa mple.com",
        ] {
            assert!(DomainPattern::parse(bad).is_err(), "{bad:?} must be refused");
        }
    }

    #[test]
    fn exact_and_wildcard_matching_follow_the_api_examples() {
        let exact = DomainPattern::parse("kubernetes.io").unwrap();
        let blog = DomainPattern::parse("blog.kubernetes.io").unwrap();
        let wild = DomainPattern::parse("*.kubernetes.io").unwrap();
        // "`kubernetes.io` matches only `kubernetes.io`. It does not match
        // "www.kubernetes.io", "blog.kubernetes.io", "my-kubernetes.io", or
        // "wikipedia.org"."
        assert!(exact.matches("kubernetes.io"));
        for n in [
            "www.kubernetes.io",
            "blog.kubernetes.io",
            "my-kubernetes.io",
            "wikipedia.org",
        ] {
            assert!(!exact.matches(n), "{n}");
        }
        // "`blog.kubernetes.io` matches only "blog.kubernetes.io"."
        assert!(blog.matches("blog.kubernetes.io"));
        assert!(!blog.matches("www.kubernetes.io") && !blog.matches("kubernetes.io"));
        // "`*.kubernetes.io` matches subdomains of kubernetes.io."
        for n in ["www.kubernetes.io", "blog.kubernetes.io", "latest.blog.kubernetes.io"] {
            assert!(wild.matches(n), "{n}");
        }
        for n in ["kubernetes.io", "wikipedia.org", "my-kubernetes.io", "xkubernetes.io"] {
            assert!(!wild.matches(n), "{n}");
        }
    }

    #[test]
    fn a_peer_stands_for_the_hosts_of_its_learned_names_only() {
        let l = learned(&[
            ("kubernetes.io", &["192.0.2.1", "2001:db8::1"]),
            ("blog.kubernetes.io", &["192.0.2.2"]),
            ("wikipedia.org", &["198.51.100.7", "::ffff:192.0.2.9"]),
        ]);
        let p = |s: &str| DomainPattern::parse(s).unwrap();
        let nets =
            |ps: &[DomainPattern]| -> Vec<String> { domain_prefixes(ps, &l).iter().map(ToString::to_string).collect() };
        assert_eq!(nets(&[p("kubernetes.io")]), ["192.0.2.1/32", "2001:db8::1/128"]);
        assert_eq!(nets(&[p("*.kubernetes.io")]), ["192.0.2.2/32"]);
        assert_eq!(nets(&[p("wikipedia.org")]), ["192.0.2.9/32", "198.51.100.7/32"]);
        assert!(nets(&[p("example.com")]).is_empty());
        assert!(domain_matches(
            &[p("*.kubernetes.io")],
            &l,
            "192.0.2.2".parse().unwrap()
        ));
        assert!(!domain_matches(
            &[p("*.kubernetes.io")],
            &l,
            "192.0.2.1".parse().unwrap()
        ));
        assert!(domain_matches(
            &[p("wikipedia.org")],
            &l,
            "::ffff:192.0.2.9".parse().unwrap()
        ));
    }
}
