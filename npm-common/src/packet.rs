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
