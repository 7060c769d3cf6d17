//! `NPM_EP_SLOTS` / `NPM_ENDPOINTS`: one local pod, keyed by the ifindex of
//! its host-side veth ([`EndpointInfo`]), and its `EP_*` flags.

use core::mem::{align_of, offset_of, size_of};

use crate::packet::{DIR_EGRESS, IDENTITY_ANY, IDENTITY_FIRST_CIDR};

/// [`EndpointInfo::flags`]: ingress is isolated (some policy selects it for ingress).
pub const EP_ISOLATED_INGRESS: u32 = 1 << 0;
/// [`EndpointInfo::flags`]: egress is isolated.
pub const EP_ISOLATED_EGRESS: u32 = 1 << 1;
/// [`EndpointInfo::flags`]: [`EndpointInfo::ipv4`] is set.
pub const EP_HAS_V4: u32 = 1 << 2;
/// [`EndpointInfo::flags`]: [`EndpointInfo::ipv6`] is set.
pub const EP_HAS_V6: u32 = 1 << 3;
/// [`EndpointInfo::flags`]: no `NPM_POLICY` entry of this endpoint's
/// subject ([`EndpointInfo::subject`]) for ingress has the peer
/// [`IDENTITY_ANY`], so step 9 skips that lookup (it could not hit). Like
/// every policy flag (`EP_NO_*_PEER_*`) it describes the subject's entries, so every endpoint of one subject carries the same
/// ones. The `EP_NO_*_PEER_*` flags only let the datapath skip
/// lookups that cannot match: when clear (e.g. an endpoint written by an
/// older loader) every lookup is made. The egress flag of each pair is the
/// ingress flag shifted left by [`DIR_EGRESS`].
pub const EP_NO_ANY_PEER_INGRESS: u32 = 1 << 4;
/// [`EndpointInfo::flags`]: like [`EP_NO_ANY_PEER_INGRESS`], for egress.
pub const EP_NO_ANY_PEER_EGRESS: u32 = 1 << 5;
/// [`EndpointInfo::flags`]: no `NPM_POLICY` entry of this endpoint's
/// subject for ingress has a CIDR identity (`>=` [`IDENTITY_FIRST_CIDR`]) as its peer, so
/// step 9 skips the lookup of such an identity.
pub const EP_NO_CIDR_PEER_INGRESS: u32 = 1 << 6;
/// [`EndpointInfo::flags`]: like [`EP_NO_CIDR_PEER_INGRESS`], for egress.
pub const EP_NO_CIDR_PEER_EGRESS: u32 = 1 << 7;
/// [`EndpointInfo::flags`]: no `NPM_POLICY` entry of this endpoint's
/// subject for ingress has a peer identity between [`crate::IDENTITY_WORLD`] and
/// [`IDENTITY_FIRST_CIDR`] (exclusive), so step 9 skips the lookup of such an
/// identity.
pub const EP_NO_POD_PEER_INGRESS: u32 = 1 << 8;
/// [`EndpointInfo::flags`]: like [`EP_NO_POD_PEER_INGRESS`], for egress.
pub const EP_NO_POD_PEER_EGRESS: u32 = 1 << 9;
/// [`EndpointInfo::flags`]: the record holds an endpoint. Array slots always
/// exist; a slot without this flag (all zeroes) is no endpoint.
pub const EP_PRESENT: u32 = 1 << 10;
/// [`EndpointInfo::flags`]: the Admin ClusterNetworkPolicy tier has
/// `NPM_TIERS` entries ([`crate::TIER_ADMIN`]) for this endpoint's ingress,
/// so step 9 looks them up before NetworkPolicy. Clear: the tier is skipped
/// (no lookup). The egress flag is the ingress flag shifted left by
/// [`DIR_EGRESS`].
pub const EP_ADMIN_INGRESS: u32 = 1 << 11;
/// [`EndpointInfo::flags`]: like [`EP_ADMIN_INGRESS`], for egress.
pub const EP_ADMIN_EGRESS: u32 = 1 << 12;
/// [`EndpointInfo::flags`]: the Baseline ClusterNetworkPolicy tier has
/// `NPM_TIERS` entries ([`crate::TIER_BASELINE`]) for this endpoint's
/// ingress, so step 9 looks them up when no NetworkPolicy isolates it.
pub const EP_BASELINE_INGRESS: u32 = 1 << 13;
/// [`EndpointInfo::flags`]: like [`EP_BASELINE_INGRESS`], for egress.
pub const EP_BASELINE_EGRESS: u32 = 1 << 14;
/// [`EndpointInfo::flags`]: report the new connections this endpoint's
/// policy allows (both directions): the packet that creates a new tracked
/// flow (the conntrack entry of steps 7 to 9) also sends an allow event to
/// `NPM_EVENTS` (a [`crate::DenyEvent`] whose reason is an allow reason,
/// below [`crate::FIRST_DENY_REASON`]), rate-limited per CPU and tick.
/// Never changes a verdict; tracked packets never send one; a dry run
/// (`npm-agent explain`) sends none.
pub const EP_REPORT_NEW: u32 = 1 << 15;
/// [`EndpointInfo::flags`]: the entries of `NPM_FOLD` (see
/// [`crate::fold_key`]) of this endpoint's subject in the ingress
/// direction are its current decisions: the datapath decides a new
/// connection by them, and takes the tiers' and NetworkPolicy's lookups
/// only for a peer class without entries. The egress flag is the ingress
/// flag shifted left by [`DIR_EGRESS`].
pub const EP_FOLD_INGRESS: u32 = 1 << 16;
/// [`EndpointInfo::flags`]: like [`EP_FOLD_INGRESS`], for egress.
pub const EP_FOLD_EGRESS: u32 = 1 << 17;
/// Every tier flag of the ingress direction (shift left by [`DIR_EGRESS`]
/// for egress): clear, the direction is decided as without
/// ClusterNetworkPolicies.
pub const EP_TIERS_INGRESS: u32 = EP_ADMIN_INGRESS | EP_BASELINE_INGRESS;
// The datapath finds a direction's flag by shifting the ingress flag.
const _: () = assert!(EP_ADMIN_EGRESS == EP_ADMIN_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_BASELINE_EGRESS == EP_BASELINE_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_FOLD_EGRESS == EP_FOLD_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_NO_ANY_PEER_EGRESS == EP_NO_ANY_PEER_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_NO_CIDR_PEER_EGRESS == EP_NO_CIDR_PEER_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_NO_POD_PEER_EGRESS == EP_NO_POD_PEER_INGRESS << DIR_EGRESS);

/// The `NPM_EP_EPOCH` slot of the endpoint on host-side interface
/// `ifindex`: the ifindex modulo [`crate::sizes::ENDPOINT_SLOTS`] (a power
/// of two). Two endpoints whose ifindexes share a slot share an epoch: a
/// move for either decides both endpoints' flows again once, never fewer.
#[inline(always)]
pub const fn ep_epoch_slot(ifindex: u32) -> u32 {
    ifindex & (crate::sizes::ENDPOINT_SLOTS - 1)
}
const _: () = assert!(crate::sizes::ENDPOINT_SLOTS.is_power_of_two());

/// The `EP_NO_*_PEER_INGRESS` flag whose (direction-shifted) bit tells that
/// no policy entry of an endpoint's subject can match `identity` as its peer.
pub const fn ep_no_peer_flag(identity: u32) -> u32 {
    if identity == IDENTITY_ANY {
        EP_NO_ANY_PEER_INGRESS
    } else if identity >= IDENTITY_FIRST_CIDR {
        EP_NO_CIDR_PEER_INGRESS
    } else {
        EP_NO_POD_PEER_INGRESS
    }
}

/// One local pod, keyed by the ifindex of its host-side veth.
///
/// Two numbers name it: [`EndpointInfo::id`], its own (conntrack,
/// fragments, deny counters, events, the ClusterNetworkPolicy tiers), and
/// [`EndpointInfo::subject`], the pod identity whose NetworkPolicy allows
/// govern it (`NPM_POLICY`): what NetworkPolicy allows
/// a pod is a function of its identity only, so every local endpoint of
/// one identity shares one set of entries.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct EndpointInfo {
    /// Endpoint id used in [`crate::CtKey`], [`crate::FragKey`], the
    /// `NPM_TIERS` keys ([`crate::tier_key`]), `NPM_EP_DENIES` and the
    /// events. Never reused by an agent.
    pub id: u32,
    /// `EP_*` flags.
    pub flags: u32,
    /// The pod's IPv4 address, IPv4-mapped (valid with [`EP_HAS_V4`]).
    pub ipv4: [u8; 16],
    /// The pod's IPv6 address (valid with [`EP_HAS_V6`]).
    pub ipv6: [u8; 16],
    /// The policy subject: the pod identity (`>=`
    /// [`crate::IDENTITY_FIRST_POD`]) whose `NPM_POLICY` keys
    /// ([`crate::PolicyKey::subject`]) hold this endpoint's NetworkPolicy
    /// allows. The policy flags (`EP_NO_*_PEER_*`) describe
    /// the subject's entries. 0 only in a record that makes no policy
    /// lookup (no endpoint, or a drop-all record). Appended after the
    /// addresses so that they stay 4-aligned (layout 6).
    pub subject: u32,
}
// The datapath compares the addresses as 4-aligned 32-bit words.
const _: () = assert!(size_of::<EndpointInfo>() == 44);
const _: () = assert!(align_of::<EndpointInfo>() == 4);
const _: () = assert!(offset_of!(EndpointInfo, id) == 0);
const _: () = assert!(offset_of!(EndpointInfo, flags) == 4);
const _: () = assert!(offset_of!(EndpointInfo, ipv4) == 8);
const _: () = assert!(offset_of!(EndpointInfo, ipv6) == 24);
const _: () = assert!(offset_of!(EndpointInfo, subject) == 40);

// SAFETY: repr(C), only integers and byte arrays, no padding (asserted
// above), any bit pattern is valid.
#[cfg(feature = "user")]
unsafe impl aya::Pod for EndpointInfo {}
