//! The CEL rules (`x-kubernetes-validations`) npm-testapi evaluates: exactly the rules of the
//! vendored ClusterNetworkPolicy CRDs, recognised by their expression text (whitespace
//! insensitive) and evaluated natively with CEL's semantics. A CRD carrying any other rule is
//! refused at install (see [`super::Schema::prepare`]), so no rule is ever skipped silently.

use serde_json::Value;
use std::net::IpAddr;

/// A recognised CEL rule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CelRule {
    /// `self.start < self.end` (a port range).
    StartLessThanEnd,
    /// `isCIDR(self)` (the Kubernetes CEL library's CIDR check).
    IsCidr,
    /// The experimental channel's egress rule: no `destinationNamedPort` in `protocols`
    /// when a peer is `networks`, `nodes` or `domainNames`.
    NoNamedPortForNonPodPeers,
}

/// The expression text with all whitespace removed.
fn squash(s: &str) -> String {
    s.chars().filter(|c| !c.is_whitespace()).collect()
}

impl CelRule {
    /// The rule whose expression is `rule`, if npm-testapi evaluates it.
    pub fn recognise(rule: &str) -> Option<Self> {
        const KNOWN: [(&str, CelRule); 3] = [
            ("self.start < self.end", CelRule::StartLessThanEnd),
            ("isCIDR(self)", CelRule::IsCidr),
            (
                "!(self.to.exists(peer, has(peer.networks) || has(peer.nodes) || has(peer.domainNames)) && has(self.protocols) && self.protocols.exists(protocol, has(protocol.destinationNamedPort)))",
                CelRule::NoNamedPortForNonPodPeers,
            ),
        ];
        let r = squash(rule);
        KNOWN.iter().find(|(text, _)| squash(text) == r).map(|(_, k)| *k)
    }

    /// Evaluate the rule on `v` (the value at the rule's node). `None` when the expression
    /// cannot be evaluated (a field it reads is missing or of another type): the schema's own
    /// checks (required, type) report that case, as the real server's do.
    pub fn eval(self, v: &Value) -> Option<bool> {
        match self {
            CelRule::StartLessThanEnd => {
                let start = v.get("start")?.as_f64()?;
                let end = v.get("end")?.as_f64()?;
                Some(start < end)
            }
            CelRule::IsCidr => Some(is_cidr(v.as_str()?)),
            CelRule::NoNamedPortForNonPodPeers => {
                let to = v.get("to")?.as_array()?;
                let non_pod = to.iter().any(|p| {
                    ["networks", "nodes", "domainNames"]
                        .iter()
                        .any(|k| p.get(k).is_some_and(|x| !x.is_null()))
                });
                let named = match v.get("protocols") {
                    None | Some(Value::Null) => false,
                    Some(p) => p
                        .as_array()?
                        .iter()
                        .any(|p| p.get("destinationNamedPort").is_some_and(|x| !x.is_null())),
                };
                Some(!(non_pod && named))
            }
        }
    }
}

/// `isCIDR` of the Kubernetes CEL library: `ADDR/BITS` as Go's `netip.ParsePrefix` accepts it
/// (no zone, decimal prefix length within the family's width, no leading zeros), and not an
/// IPv4-mapped IPv6 address. Host bits may be set (`10.0.0.1/8` is a CIDR).
pub fn is_cidr(s: &str) -> bool {
    let Some((addr, bits)) = s.split_once('/') else {
        return false;
    };
    let Ok(addr) = addr.parse::<IpAddr>() else {
        return false;
    };
    if bits.is_empty() || !bits.bytes().all(|b| b.is_ascii_digit()) || (bits.len() > 1 && bits.starts_with('0')) {
        return false;
    }
    let Ok(bits) = bits.parse::<u32>() else {
        return false;
    };
    match addr {
        IpAddr::V4(_) => bits <= 32,
        IpAddr::V6(a) => bits <= 128 && a.to_ipv4_mapped().is_none(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn recognises_the_crd_rules_whatever_the_spacing() {
        assert_eq!(
            CelRule::recognise("self.start<self.end"),
            Some(CelRule::StartLessThanEnd)
        );
        assert_eq!(CelRule::recognise(" isCIDR( self ) "), Some(CelRule::IsCidr));
        assert_eq!(CelRule::recognise("self.start <= self.end"), None);
    }

    #[test]
    fn evaluates_ranges_cidrs_and_the_named_port_rule() {
        let r = CelRule::StartLessThanEnd;
        assert_eq!(r.eval(&json!({"start": 80, "end": 81})), Some(true));
        assert_eq!(r.eval(&json!({"start": 81, "end": 81})), Some(false));
        assert_eq!(r.eval(&json!({"start": 81})), None);
        for ok in [
            "10.0.0.0/8",
            "10.0.0.1/8",
            "0.0.0.0/0",
            "fd00::/64",
            "::/0",
            "1.2.3.4/32",
        ] {
            assert!(is_cidr(ok), "{ok}");
        }
        for bad in [
            "10.0.0.0",
            "10.0.0.0/33",
            "10.0.0.0/08",
            "010.0.0.0/8",
            "fd00::/129",
            "::ffff:1.2.3.4/128",
            "10.0.0.0/",
            "10.0.0.0/+8",
            "host/8",
            "fe80::1%eth0/64",
        ] {
            assert!(!is_cidr(bad), "{bad}");
        }
        let n = CelRule::NoNamedPortForNonPodPeers;
        let named = json!([{"destinationNamedPort": "web"}]);
        assert_eq!(
            n.eval(&json!({"to": [{"networks": ["10.0.0.0/8"]}], "protocols": named})),
            Some(false)
        );
        assert_eq!(n.eval(&json!({"to": [{"pods": {}}], "protocols": named})), Some(true));
        assert_eq!(n.eval(&json!({"to": [{"nodes": {}}]})), Some(true));
    }
}
