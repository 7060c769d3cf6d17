//! Services (`NPM_SERVICES`: [`ServiceKey`] -> [`ServiceValue`]) and the
//! skb mark of an egress decision deferred past kube-proxy's DNAT
//! ([`DEFER_MARK_MAGIC`], [`defer_mark`], [`deferred_source`]).
//!
//! `from_pod` runs before netfilter PREROUTING, where kube-proxy rewrites
//! a ClusterIP:port (or a node address:NodePort) into a backend's
//! address:targetPort. For a new flow of an egress-isolated endpoint to a
//! key of `NPM_SERVICES`, `from_pod` does not decide egress: it marks the
//! packet (the endpoint's ifindex in the mark) and records a *pending*
//! conntrack entry of the pre-NAT tuple ([`crate::CT_PENDING`]); the
//! endpoint's egress is decided after the DNAT, against the backend, by
//! `to_pod` of a local backend or by `node_exit` on the interface the
//! packet leaves the node by.
//!
//! # The mark
//!
//! Bits 8 to 11 hold [`DEFER_MARK_MAGIC`] (`0xd`), bits 16 to 31 the
//! ifindex of the sender's host-side interface (always below
//! `sizes::ENDPOINT_SLOTS`, 65,536; an endpoint beyond the slot array is
//! decided at `from_pod` as before). The other bits are kept as they are:
//! kube-proxy's masquerade and drop marks (`0x4000`, `0x8000`) and the
//! low byte stay free. The consumer clears bits 8 to 11 and 16 to 31.
//! Marks of packets crossing a veth into another network namespace are
//! scrubbed by the kernel, so a pod cannot forge one.

use core::mem::{align_of, offset_of, size_of};

/// `NPM_SERVICES` key: an address (IPv4 as IPv4-mapped) and port that
/// kube-proxy may DNAT: a ClusterIP (every address of `clusterIPs`), an
/// `externalIPs` address or a LoadBalancer ingress IP with a service port,
/// or a node address with a NodePort.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default, PartialOrd, Ord)]
pub struct ServiceKey {
    /// The address (16 bytes; IPv4-mapped for IPv4).
    pub addr: [u8; 16],
    /// The port, host order.
    pub port: u16,
    /// Protocol number (TCP, UDP or SCTP).
    pub protocol: u8,
    /// Reserved, zero.
    pub pad: u8,
}
// The datapath builds the key as five 32-bit words: the address, then the
// port with the protocol in bits 16..24.
const _: () = assert!(size_of::<ServiceKey>() == 20);
const _: () = assert!(align_of::<ServiceKey>() == 2);
const _: () = assert!(offset_of!(ServiceKey, addr) == 0);
const _: () = assert!(offset_of!(ServiceKey, port) == 16);
const _: () = assert!(offset_of!(ServiceKey, protocol) == 18);
const _: () = assert!(offset_of!(ServiceKey, pad) == 19);

/// [`ServiceValue::flags`]: the key is a ClusterIP and a service port.
pub const SVC_CLUSTER_IP: u32 = 1 << 0;
/// [`ServiceValue::flags`]: the key is a node address and a NodePort.
pub const SVC_NODE_PORT: u32 = 1 << 1;
/// [`ServiceValue::flags`]: the key is an address of `spec.externalIPs`
/// and a service port.
pub const SVC_EXTERNAL_IP: u32 = 1 << 2;
/// [`ServiceValue::flags`]: the key is a LoadBalancer ingress IP
/// (`status.loadBalancer.ingress[].ip`, not `ipMode: Proxy`) and a
/// service port.
pub const SVC_LOAD_BALANCER: u32 = 1 << 3;

/// `NPM_SERVICES` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceValue {
    /// `SVC_*` flags (what the key is; the datapath only tests presence).
    pub flags: u32,
}
const _: () = assert!(size_of::<ServiceValue>() == 4);
const _: () = assert!(offset_of!(ServiceValue, flags) == 0);

/// Mask of the magic nibble of a deferral mark (bits 8 to 11).
pub const DEFER_MARK_MAGIC_MASK: u32 = 0x0000_0f00;
/// The magic nibble of a deferral mark.
pub const DEFER_MARK_MAGIC: u32 = 0x0000_0d00;
/// Shift of the sender's ifindex in a deferral mark.
pub const DEFER_MARK_IFINDEX_SHIFT: u32 = 16;
/// Every bit a deferral mark uses (cleared by its consumer).
pub const DEFER_MARK_BITS: u32 = 0xffff_0000 | DEFER_MARK_MAGIC_MASK;
// kube-proxy's masquerade (0x4000) and drop (0x8000) marks stay free.
const _: () = assert!(DEFER_MARK_BITS & 0x0000_c000 == 0);

/// The mark `mark` with a deferral of the endpoint on `ifindex` (below
/// 65,536) set in its deferral bits; the other bits are kept.
#[inline(always)]
pub const fn defer_mark(mark: u32, ifindex: u32) -> u32 {
    (mark & !DEFER_MARK_BITS) | DEFER_MARK_MAGIC | (ifindex << DEFER_MARK_IFINDEX_SHIFT)
}

/// The sender's ifindex of a deferral mark; 0 when `mark` is none.
#[inline(always)]
pub const fn deferred_source(mark: u32) -> u32 {
    if mark & DEFER_MARK_MAGIC_MASK == DEFER_MARK_MAGIC {
        mark >> DEFER_MARK_IFINDEX_SHIFT
    } else {
        0
    }
}

#[cfg(feature = "user")]
mod pod_impls {
    use super::*;
    // SAFETY: repr(C), only integers and byte arrays, no padding (asserted
    // above), any bit pattern is valid.
    unsafe impl aya::Pod for ServiceKey {}
    // SAFETY: as above.
    unsafe impl aya::Pod for ServiceValue {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defer_marks_round_trip_and_keep_other_bits() {
        let m = defer_mark(0x4000 | 0x1, 42);
        assert_eq!(deferred_source(m), 42);
        assert_eq!(m & 0x4001, 0x4001);
        assert_eq!(m & !DEFER_MARK_BITS, 0x4001);
        assert_eq!(deferred_source(0x4000), 0);
        assert_eq!(deferred_source(0x0c00 | (5 << 16)), 0);
        // A stale deferral is replaced, not OR-ed.
        assert_eq!(deferred_source(defer_mark(defer_mark(0, 0xffff), 7)), 7);
    }
}
