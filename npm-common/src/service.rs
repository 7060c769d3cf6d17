//! Services (`NPM_SERVICES`: [`ServiceKey`] -> [`ServiceValue`]), the
//! skb mark of an egress decision deferred past kube-proxy's DNAT
//! ([`DEFER_MARK`], [`defer_mark`], [`is_deferred`]) and the deferred
//! flows' senders by source (`NPM_DEFER_SRC`: [`DeferSourceKey`] ->
//! ifindex).
//!
//! `from_pod` runs before netfilter PREROUTING, where kube-proxy rewrites
//! a ClusterIP:port (or a node address:NodePort) into a backend's
//! address:targetPort. For a new flow of an egress-isolated endpoint to a
//! key of `NPM_SERVICES`, `from_pod` does not decide egress: it sets the
//! deferral bit in the packet's mark, records the flow's source (address,
//! port, protocol) with the endpoint's ifindex in `NPM_DEFER_SRC`, and a
//! *pending* conntrack entry of the pre-NAT tuple ([`crate::CT_PENDING`]);
//! the endpoint's egress is decided after the DNAT, against the backend,
//! by `to_pod` of a local backend, by `node_exit` on the interface the
//! packet leaves the node by, or by `host_in` at `INPUT`.
//!
//! # The mark carries no endpoint
//!
//! Other owners rewrite mark bits between `from_pod` and those programs:
//! Calico the bits of its `IptablesMarkMask` (`0xffff0000` by default),
//! Cilium the `0x0f00` nibble (and `0xffff0000` with identities),
//! kube-proxy `0x4000` and `0x8000`. The mark is only a flag,
//! [`DEFER_MARK`] (`0x1000`), which none of them uses; the consumer
//! finds the sender without it:
//!
//! 1. the packet's `ingress_ifindex` (the kernel's `skb_iif`, the device it
//!    entered the node by; NAT never changes it): the sender's host-side
//!    veth for a routed pod, and for a bridged pod whose frame the bridge
//!    forwarded;
//! 2. otherwise (the bridge's ifindex: a bridged pod's packet routed by the
//!    node) the endpoint `NPM_DEFER_SRC` holds for the packet's source
//!    (address, port, protocol): `from_pod` wrote it for this flow, before
//!    the packet got here. Exact while the source is not rewritten: a
//!    bridged pod's flow masqueraded on its way (kube-proxy's
//!    `--masquerade-all`, its masquerade of a NodePort) is not found;
//! 3. a packet whose sender neither finds is denied and counted as the
//!    egress of no endpoint (`to_pod`, `node_exit`), never decided under
//!    another endpoint's policy; `host_in` leaves it to the chain of the
//!    dataplane that holds its sender (a second pin directory's).
//!
//! The consumer clears the bit (`host_in`, a socket filter, cannot; the
//! packet is delivered). Marks of packets crossing a veth into another
//! network namespace are scrubbed by the kernel, so a pod cannot forge
//! one; a node process's packet (`ingress_ifindex` 0) carrying the bit
//! is someone else's, and passes untouched.

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
/// [`ServiceValue::flags`]: the key is an address of this node (or the
/// `hostIP`) and a `hostPort` of one of its pods (the `portmap` CNI
/// plugin's DNAT). Only this node's: another node's hostPort is DNATed
/// there, after this node's programs.
pub const SVC_HOST_PORT: u32 = 1 << 4;

/// `NPM_SERVICES` value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct ServiceValue {
    /// `SVC_*` flags (what the key is; the datapath only tests presence).
    pub flags: u32,
}
const _: () = assert!(size_of::<ServiceValue>() == 4);
const _: () = assert!(offset_of!(ServiceValue, flags) == 0);

/// The deferral bit of the skb mark: the packet's egress decision was
/// deferred past the DNAT by `from_pod`. Bit 12: outside Calico's
/// default `IptablesMarkMask` (`0xffff0000`), Cilium's magic nibble
/// (`0x0f00`) and identity bits, kube-proxy's masquerade (`0x4000`) and
/// drop (`0x8000`) marks and the low byte (Istio's `0x539`, AWS VPC CNI's
/// `0x80`).
pub const DEFER_MARK: u32 = 0x0000_1000;
const _: () = assert!(DEFER_MARK & (0xffff_0000 | 0x0f00 | 0x4000 | 0x8000 | 0xff) == 0);

/// The mark `mark` with the deferral bit set; the other bits are kept.
#[inline(always)]
pub const fn defer_mark(mark: u32) -> u32 {
    mark | DEFER_MARK
}

/// Whether `mark` has the deferral bit.
#[inline(always)]
pub const fn is_deferred(mark: u32) -> bool {
    mark & DEFER_MARK != 0
}

/// `NPM_DEFER_SRC` key: the source (address, IPv4 as IPv4-mapped; port;
/// protocol) of a deferred flow's packets, as `from_pod` saw them; the
/// value is the sender's host-side ifindex (`u32`). The same layout as
/// [`ServiceKey`] (five 32-bit words: the address, then the port with the
/// protocol in bits 16..24).
pub type DeferSourceKey = ServiceKey;

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
    fn the_defer_mark_is_one_bit_and_keeps_other_bits() {
        let m = defer_mark(0x4000 | 0x1);
        assert!(is_deferred(m));
        assert_eq!(m & !DEFER_MARK, 0x4001);
        assert!(!is_deferred(0x4000 | 0x8000 | 0xffff_0000 | 0x0f00));
        // What Calico, Cilium and kube-proxy write leaves the flag alone.
        for (and, or) in [(0x0000_ffff, 0x0001_0000), (0xffff_f0ff, 0x0200), (0xffff_ffff, 0xc000)] {
            assert!(is_deferred((defer_mark(0xabcd_0000) & and) | or));
        }
    }
}
