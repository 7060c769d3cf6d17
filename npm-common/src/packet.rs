//! What every map key says of a packet: its direction (seen from the pod),
//! the protocol numbers the datapath parses, and the reserved peer
//! identities.

/// Direction as seen from the pod: traffic entering the pod.
pub const DIR_INGRESS: u8 = 0;
/// Direction as seen from the pod: traffic leaving the pod.
pub const DIR_EGRESS: u8 = 1;
const _: () = assert!(DIR_INGRESS == 0);

/// Wildcard peer in a policy key: the rule allows any peer.
pub const IDENTITY_ANY: u32 = 0;
/// An address unknown to the ipcache and outside every ipBlock prefix.
pub const IDENTITY_WORLD: u32 = 1;
/// An address of this node (kubelet probes, hostNetwork pods).
pub const IDENTITY_HOST: u32 = 2;
/// First identity handed out to pod label sets.
pub const IDENTITY_FIRST_POD: u32 = 256;
/// First identity handed out to ipBlock prefixes; pod identities stay below.
pub const IDENTITY_FIRST_CIDR: u32 = 1 << 24;

/// The 8-bit code of a CIDR identity in the compact words (`NPM_IPCACHE4`,
/// `NPM_FOLD`): 0 for none ([`IDENTITY_ANY`]), `1 + (cidr -
/// IDENTITY_FIRST_CIDR)` for the first 255 CIDR identities, `None` beyond
/// (and for a number that is no CIDR identity).
#[inline(always)]
pub const fn cidr_code(cidr_identity: u32) -> Option<u64> {
    if cidr_identity == IDENTITY_ANY {
        Some(0)
    } else if cidr_identity >= IDENTITY_FIRST_CIDR && cidr_identity - IDENTITY_FIRST_CIDR < 255 {
        Some((cidr_identity - IDENTITY_FIRST_CIDR + 1) as u64)
    } else {
        None
    }
}

/// The CIDR identity of a [`cidr_code`] (`code` below 256).
#[inline(always)]
pub const fn cidr_of_code(code: u64) -> u32 {
    if code == 0 {
        IDENTITY_ANY
    } else {
        IDENTITY_FIRST_CIDR + (code as u32 & 0xff) - 1
    }
}

const _: () = assert!(matches!(cidr_code(cidr_of_code(255)), Some(255)) && cidr_of_code(1) == IDENTITY_FIRST_CIDR);

/// Protocol numbers the datapath parses.
pub mod proto {
    /// Wildcard in a policy key (rule without ports).
    pub const ANY: u8 = 0;
    /// ICMP.
    pub const ICMP: u8 = 1;
    /// TCP.
    pub const TCP: u8 = 6;
    /// UDP.
    pub const UDP: u8 = 17;
    /// ICMPv6.
    pub const ICMPV6: u8 = 58;
    /// SCTP.
    pub const SCTP: u8 = 132;
}

/// The IP header of a packet the kernel hands to user space (NFLOG,
/// NFQUEUE): IPv4 with its options, or IPv6 without extension headers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpHeader {
    /// 4 or 6.
    pub family: u8,
    /// The transport protocol (IPv4 protocol, IPv6 next header).
    pub protocol: u8,
    /// Where the transport header starts.
    pub l4_offset: usize,
    /// Not a later fragment (an IPv4 fragment offset of 0; always for
    /// IPv6): the transport header is at `l4_offset`.
    pub first_fragment: bool,
}

impl IpHeader {
    /// The header of packet `p`, `None` when it is neither a whole IPv4
    /// header (at least 20 bytes, a header length of at least 20) nor a
    /// whole IPv6 header.
    pub fn parse(p: &[u8]) -> Option<IpHeader> {
        match p.first()? >> 4 {
            4 => {
                let ihl = usize::from(p[0] & 0xf) * 4;
                if ihl < 20 || p.len() < 20 {
                    return None;
                }
                Some(IpHeader {
                    family: 4,
                    protocol: p[9],
                    l4_offset: ihl,
                    first_fragment: u16::from_be_bytes([p[6], p[7]]) & 0x1fff == 0,
                })
            }
            6 if p.len() >= 40 => Some(IpHeader {
                family: 6,
                protocol: p[6],
                l4_offset: 40,
                first_fragment: true,
            }),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ip_headers() {
        let mut v4 = [0u8; 28];
        v4[0] = 0x46; // IHL 6: 4 option bytes
        v4[9] = proto::UDP;
        let h = IpHeader::parse(&v4).expect("v4");
        assert_eq!(
            (h.family, h.protocol, h.l4_offset, h.first_fragment),
            (4, proto::UDP, 24, true)
        );
        v4[7] = 1; // fragment offset 8
        assert!(!IpHeader::parse(&v4).expect("v4").first_fragment);
        v4[0] = 0x44; // IHL below 20
        assert_eq!(IpHeader::parse(&v4), None);
        let mut v6 = [0u8; 40];
        v6[0] = 0x60;
        v6[6] = proto::TCP;
        let h = IpHeader::parse(&v6).expect("v6");
        assert_eq!(
            (h.family, h.protocol, h.l4_offset, h.first_fragment),
            (6, proto::TCP, 40, true)
        );
        assert_eq!(IpHeader::parse(&v6[..39]), None);
        assert_eq!(IpHeader::parse(&v4[..19]), None);
        assert_eq!(IpHeader::parse(&[]), None);
        assert_eq!(IpHeader::parse(&[0x50; 40]), None);
    }
}
