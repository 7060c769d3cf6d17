//! The placeholders of case texts: `${IP:<ns>/<pod>}` and
//! `${CIDR<n>:<ns>/<pod>}`, replaced by a pod's address or network.

use std::net::IpAddr;

use super::CaseError;

/// A placeholder found in a case text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Placeholder {
    /// `${IP:<ns>/<pod>}`.
    Ip {
        /// `ns/pod`.
        pod: String,
    },
    /// `${CIDR<n>:<ns>/<pod>}`.
    Cidr {
        /// Prefix length.
        len: u8,
        /// `ns/pod`.
        pod: String,
    },
}

/// Replaces every `${IP:ns/pod}` and `${CIDR<n>:ns/pod}` of `text`; `ip`
/// gives a pod's address (`None`: unknown pod, an error).
pub fn substitute(text: &str, ip: &dyn Fn(&str) -> Option<IpAddr>) -> Result<String, CaseError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(i) = rest.find("${") {
        out.push_str(&rest[..i]);
        let Some(end) = rest[i..].find('}') else {
            return Err(CaseError::Placeholder {
                placeholder: rest[i..].to_string(),
                message: "no closing }".into(),
            });
        };
        let ph = &rest[i..i + end + 1];
        let bad = |m: &str| CaseError::Placeholder {
            placeholder: ph.to_string(),
            message: m.to_string(),
        };
        let inner = &ph[2..ph.len() - 1];
        let (kind, pod) = inner
            .split_once(':')
            .ok_or_else(|| bad("want ${IP:ns/pod} or ${CIDR<n>:ns/pod}"))?;
        let addr = ip(pod).ok_or_else(|| bad("unknown pod"))?;
        if kind == "IP" {
            out.push_str(&addr.to_string());
        } else if let Some(n) = kind.strip_prefix("CIDR") {
            let len: u8 = n.parse().map_err(|_| bad("bad prefix length"))?;
            let net = ipnet::IpNet::new(addr, len).map_err(|_| bad("prefix length too long for the address"))?;
            out.push_str(&net.trunc().to_string());
        } else {
            return Err(bad("unknown placeholder kind"));
        }
        rest = &rest[i + end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}
