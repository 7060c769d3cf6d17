//! Address-range arithmetic for the CIDR identity sets.
//!
//! A CIDR identity `P` stands for the addresses whose *longest* matching
//! prefix among all ipBlock prefixes of the compiled form is `P`: that is `P`
//! minus every more specific prefix inside it. nftables interval sets hold
//! disjoint ranges, so the difference is computed here, exactly, on integer
//! ranges (`u128` for both families; IPv4 uses the low 32 bits).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// Address family of a range.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Family {
    /// IPv4 (32-bit addresses).
    V4,
    /// IPv6 (128-bit addresses).
    V6,
}

impl Family {
    fn bits(self) -> u32 {
        match self {
            Family::V4 => 32,
            Family::V6 => 128,
        }
    }
}

/// The family of a prefix.
pub(crate) fn family_of(net: &IpNet) -> Family {
    match net {
        IpNet::V4(_) => Family::V4,
        IpNet::V6(_) => Family::V6,
    }
}

/// The inclusive integer range `[first, last]` a prefix covers.
pub(crate) fn prefix_range(net: &IpNet) -> (u128, u128) {
    let net = net.trunc();
    match net {
        IpNet::V4(n) => (u128::from(u32::from(n.network())), u128::from(u32::from(n.broadcast()))),
        IpNet::V6(n) => (u128::from(n.network()), u128::from(n.broadcast())),
    }
}

/// `outer` minus the union of `holes`: sorted, disjoint, non-adjacent
/// inclusive ranges. Holes may overlap each other and may stick out of
/// `outer`.
pub(crate) fn subtract(outer: (u128, u128), holes: &[(u128, u128)]) -> Vec<(u128, u128)> {
    let mut holes: Vec<(u128, u128)> = holes
        .iter()
        .filter(|(s, e)| *e >= outer.0 && *s <= outer.1 && s <= e)
        .copied()
        .collect();
    holes.sort_unstable();
    let mut out = Vec::new();
    // `cursor` is the first address not yet emitted or cut; None once past the end.
    let mut cursor = Some(outer.0);
    for (s, e) in holes {
        let Some(c) = cursor else { break };
        if s > c {
            out.push((c, (s - 1).min(outer.1)));
        }
        if e >= c {
            cursor = if e >= outer.1 { None } else { Some(e + 1) };
        }
    }
    if let Some(c) = cursor {
        if c <= outer.1 {
            out.push((c, outer.1));
        }
    }
    out
}

/// Formats one address of `family` given as an integer.
pub(crate) fn addr_string(family: Family, v: u128) -> String {
    match family {
        // The value of an IPv4 range always fits 32 bits (it comes from `prefix_range`).
        Family::V4 => Ipv4Addr::from(v as u32).to_string(),
        Family::V6 => Ipv6Addr::from(v).to_string(),
    }
}

/// Formats an inclusive range as an nftables interval-set element: a single
/// address, a prefix when the range is exactly one, else `first-last`.
pub(crate) fn range_element(family: Family, (s, e): (u128, u128)) -> String {
    if s == e {
        return addr_string(family, s);
    }
    let size = e.wrapping_sub(s).wrapping_add(1);
    let bits = family.bits();
    // A prefix: the size is a power of two (or the whole space) and `s` is aligned to it.
    let whole = bits == 128 && s == 0 && e == u128::MAX || bits == 32 && s == 0 && e == u128::from(u32::MAX);
    if whole {
        return format!("{}/0", addr_string(family, 0));
    }
    if size.is_power_of_two() && s % size == 0 {
        let len = bits - size.trailing_zeros();
        return format!("{}/{}", addr_string(family, s), len);
    }
    format!("{}-{}", addr_string(family, s), addr_string(family, e))
}

/// The family of an address.
pub(crate) fn family_of_addr(addr: &IpAddr) -> Family {
    match addr {
        IpAddr::V4(_) => Family::V4,
        IpAddr::V6(_) => Family::V6,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn net(s: &str) -> IpNet {
        s.parse().unwrap()
    }

    #[test]
    fn subtract_cuts_holes_and_merges_nothing_extra() {
        let outer = prefix_range(&net("10.0.0.0/24"));
        let holes = [prefix_range(&net("10.0.0.128/25")), prefix_range(&net("10.0.0.16/28"))];
        let got = subtract(outer, &holes);
        let s: Vec<String> = got.iter().map(|r| range_element(Family::V4, *r)).collect();
        assert_eq!(s, vec!["10.0.0.0/28", "10.0.0.32-10.0.0.127"]);
    }

    #[test]
    fn subtract_whole_and_edges() {
        let outer = prefix_range(&net("10.0.0.0/30"));
        assert!(subtract(outer, &[prefix_range(&net("10.0.0.0/30"))]).is_empty());
        assert!(subtract(outer, &[prefix_range(&net("10.0.0.0/8"))]).is_empty());
        let got = subtract(
            outer,
            &[prefix_range(&net("10.0.0.0/32")), prefix_range(&net("10.0.0.3/32"))],
        );
        assert_eq!(got, vec![(0x0a00_0001, 0x0a00_0002)]);
        // Overlapping holes.
        let got = subtract(
            prefix_range(&net("10.0.0.0/24")),
            &[prefix_range(&net("10.0.0.0/25")), prefix_range(&net("10.0.0.0/26"))],
        );
        assert_eq!(range_element(Family::V4, got[0]), "10.0.0.128/25");
    }

    #[test]
    fn full_spaces_format_as_slash_zero() {
        let v6 = prefix_range(&net("::/0"));
        assert_eq!(range_element(Family::V6, v6), "::/0");
        let v4 = prefix_range(&net("0.0.0.0/0"));
        assert_eq!(range_element(Family::V4, v4), "0.0.0.0/0");
        let got = subtract(v6, &[prefix_range(&net("fd00::/8"))]);
        let s: Vec<String> = got.iter().map(|r| range_element(Family::V6, *r)).collect();
        assert_eq!(s, vec!["::-fcff:ffff:ffff:ffff:ffff:ffff:ffff:ffff", "fe00::/7"]);
    }
}
