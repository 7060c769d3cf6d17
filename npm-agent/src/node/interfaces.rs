//! Local endpoints and their host-side interfaces.
//!
//! A local endpoint is a pod with `spec.nodeName == NODE_NAME`, not
//! hostNetwork, with an IP (the compiler decides which pods are endpoints;
//! this module only finds their interfaces). The host-side interface of a
//! pod is the one the node's route to the pod IP points at: the agent asks
//! the kernel (`ip -j route get <ip>`, i.e. an `RTM_GETROUTE` request), and
//! accepts the answer only when the route is direct (no gateway) and, with
//! `--interface-pattern`, the interface name matches the pattern. An
//! endpoint whose interface is not found yet is left out of what is
//! programmed and retried on the next sync.

use std::collections::HashMap;
use std::net::IpAddr;
use std::process::Command;

use npm_dataplane::Interfaces;
use npm_policy::compiled::Compiled;

/// Errors of interface resolution.
#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    /// `ip route get` could not be run.
    #[error("route lookup of {ip}: cannot run `ip`: {source}")]
    Spawn {
        /// Address looked up.
        ip: IpAddr,
        /// The spawn error.
        #[source]
        source: std::io::Error,
    },
    /// `ip route get` printed something unexpected.
    #[error("route lookup of {ip}: unexpected output {output:?}: {detail}")]
    Parse {
        /// Address looked up.
        ip: IpAddr,
        /// What `ip` printed.
        output: String,
        /// What was wrong.
        detail: String,
    },
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

/// The result of one route lookup.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteTarget {
    /// Output interface name.
    pub dev: String,
    /// The route has a gateway (so it is not a pod's own veth route).
    pub via_gateway: bool,
}

fn ip_command(netns: Option<&str>) -> Command {
    let mut c = Command::new("ip");
    if let Some(ns) = netns {
        c.args(["-n", ns]);
    }
    c
}

/// Ask the kernel (of network namespace `netns`, or the agent's own) which
/// interface the route to `ip` leaves by.
pub fn route_get(ip: IpAddr, netns: Option<&str>) -> Result<Option<RouteTarget>, EndpointError> {
    let out = ip_command(netns)
        .args(["-j", "route", "get", &ip.to_string()])
        .output()
        .map_err(|source| EndpointError::Spawn { ip, source })?;
    if !out.status.success() {
        // "RTNETLINK answers: Network is unreachable": no route yet.
        return Ok(None);
    }
    parse_route_get(ip, &String::from_utf8_lossy(&out.stdout))
}

/// Parse the JSON output of `ip -j route get`.
pub fn parse_route_get(ip: IpAddr, output: &str) -> Result<Option<RouteTarget>, EndpointError> {
    let err = |detail: String| EndpointError::Parse {
        ip,
        output: output.chars().take(500).collect(),
        detail,
    };
    let v: serde_json::Value = serde_json::from_str(output).map_err(|e| err(e.to_string()))?;
    let Some(first) = v.as_array().and_then(|a| a.first()) else {
        return Ok(None);
    };
    if first
        .get("type")
        .and_then(|t| t.as_str())
        .is_some_and(|t| t != "unicast")
    {
        return Ok(None); // local, unreachable, blackhole, ...
    }
    let Some(dev) = first.get("dev").and_then(|d| d.as_str()) else {
        return Err(err("no \"dev\" in the route".into()));
    };
    Ok(Some(RouteTarget {
        dev: dev.to_string(),
        via_gateway: first.get("gateway").is_some(),
    }))
}

/// ifindex of an interface by name (from sysfs, or `ip -n` for another
/// network namespace), `None` if it does not exist.
pub fn ifindex_of(name: &str, netns: Option<&str>) -> Option<u32> {
    if name.is_empty() || name.contains('/') || name.starts_with('.') {
        return None;
    }
    if netns.is_some() {
        let out = ip_command(netns)
            .args(["-j", "link", "show", "dev", name])
            .output()
            .ok()?;
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
        return v.as_array()?.first()?.get("ifindex")?.as_u64().map(|i| i as u32);
    }
    std::fs::read_to_string(format!("/sys/class/net/{name}/ifindex"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Finds the interfaces of the endpoints of a compiled state.
pub trait Resolve: Send {
    /// Endpoint id -> ifindex for every endpoint whose interface exists.
    fn resolve(&mut self, compiled: &Compiled) -> Resolved;
}

impl Resolve for InterfaceResolver {
    fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        InterfaceResolver::resolve(self, compiled)
    }
}

/// Finds and caches the host-side interface of each local endpoint.
#[derive(Debug, Default)]
pub struct InterfaceResolver {
    pattern: Option<InterfacePattern>,
    netns: Option<String>,
    cache: HashMap<IpAddr, (String, u32)>,
}

/// Interfaces found for a compiled state, and the endpoints still missing one.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resolved {
    /// Endpoint id -> ifindex.
    pub interfaces: Interfaces,
    /// Endpoint ids whose interface is not found yet.
    pub missing: Vec<u32>,
}

impl InterfaceResolver {
    /// A resolver accepting only interfaces matching `pattern` (any direct route without one).
    pub fn new(pattern: Option<InterfacePattern>) -> Self {
        InterfaceResolver {
            pattern,
            netns: None,
            cache: HashMap::new(),
        }
    }

    /// Look routes and interfaces up in the named network namespace
    /// (`/run/netns/<name>`) instead of the agent's own (tests).
    pub fn in_netns(mut self, netns: &str) -> Self {
        self.netns = Some(netns.to_string());
        self
    }

    /// The interface of a pod address, checking the cache against sysfs.
    pub fn lookup(&mut self, ip: IpAddr) -> Result<Option<u32>, EndpointError> {
        if let Some((name, idx)) = self.cache.get(&ip) {
            if ifindex_of(name, self.netns.as_deref()) == Some(*idx) {
                return Ok(Some(*idx));
            }
            self.cache.remove(&ip);
        }
        let Some(route) = route_get(ip, self.netns.as_deref())? else {
            return Ok(None);
        };
        if route.via_gateway || route.dev == "lo" {
            return Ok(None);
        }
        if let Some(p) = &self.pattern {
            if !p.matches(&route.dev) {
                return Ok(None);
            }
        }
        let Some(idx) = ifindex_of(&route.dev, self.netns.as_deref()) else {
            return Ok(None);
        };
        self.cache.insert(ip, (route.dev, idx));
        Ok(Some(idx))
    }

    /// Resolve every endpoint of `compiled` (IPv4 address first, else IPv6).
    pub fn resolve(&mut self, compiled: &Compiled) -> Resolved {
        let mut r = Resolved::default();
        self.cache.retain(|ip, _| {
            compiled
                .endpoints
                .values()
                .any(|e| e.ipv4.map(IpAddr::V4) == Some(*ip) || e.ipv6.map(IpAddr::V6) == Some(*ip))
        });
        for (&id, ep) in &compiled.endpoints {
            let mut found = None;
            for ip in [ep.ipv4.map(IpAddr::V4), ep.ipv6.map(IpAddr::V6)].into_iter().flatten() {
                match self.lookup(ip) {
                    Ok(Some(idx)) => {
                        found = Some(idx);
                        break;
                    }
                    Ok(None) => {}
                    Err(e) => {
                        tracing::warn!(endpoint = id, pod = %format!("{}/{}", ep.pod.namespace, ep.pod.name), error = %e, "interface lookup failed")
                    }
                }
            }
            match found {
                Some(idx) => {
                    r.interfaces.insert(id, idx);
                }
                None => r.missing.push(id),
            }
        }
        r
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

    #[test]
    fn parses_ip_route_get() {
        let ip: IpAddr = "10.1.2.3".parse().unwrap();
        let direct = r#"[{"dst":"10.1.2.3","dev":"veth9","prefsrc":"10.0.0.1","flags":[],"uid":0,"cache":[]}]"#;
        assert_eq!(
            parse_route_get(ip, direct).unwrap(),
            Some(RouteTarget {
                dev: "veth9".into(),
                via_gateway: false
            })
        );
        let gw = r#"[{"dst":"10.1.2.3","gateway":"10.0.0.254","dev":"eth0","flags":[]}]"#;
        assert!(parse_route_get(ip, gw).unwrap().unwrap().via_gateway);
        let local = r#"[{"type":"local","dst":"10.1.2.3","dev":"lo"}]"#;
        assert_eq!(parse_route_get(ip, local).unwrap(), None);
        assert!(parse_route_get(ip, "not json").is_err());
        assert!(parse_route_get(ip, r#"[{"dst":"10.1.2.3"}]"#).is_err());
    }

    #[test]
    fn route_lookup_finds_loopback_route_as_not_an_endpoint() {
        // 127.0.0.1 routes to `lo` (type local): never an endpoint interface.
        let mut r = InterfaceResolver::new(None);
        assert_eq!(r.lookup("127.0.0.1".parse().unwrap()).unwrap(), None);
        assert_eq!(ifindex_of("lo", None), Some(1));
        assert_eq!(ifindex_of("../x", None), None);
    }
}
