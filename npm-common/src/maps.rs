//! The maps by name: the pinned map names (the files under the bpffs pin
//! directory), their sizes ([`sizes`]) and the version of their layout
//! ([`LAYOUT_VERSION`]).

/// ifindex -> [`crate::EndpointInfo`], an array indexed by the ifindex
/// (the verifier inlines an array lookup: no helper call per packet).
/// A slot holds an endpoint when its flags have [`crate::EP_PRESENT`].
pub const EP_SLOTS: &str = "NPM_EP_SLOTS";
/// ifindex -> [`crate::EndpointInfo`] for the interfaces whose ifindex
/// does not fit `NPM_EP_SLOTS` (`>=` [`sizes::ENDPOINT_SLOTS`]:
/// hosts that created that many interfaces since boot).
pub const ENDPOINTS: &str = "NPM_ENDPOINTS";
/// exact address -> [`crate::IpInfo`].
pub const IPCACHE: &str = "NPM_IPCACHE";
/// Direct-mapped front of `NPM_IPCACHE` for IPv4 addresses: slot
/// [`crate::ipcache4_slot`] holds one [`crate::ipcache4_word`], read by
/// the datapath with one inlined array access. User space writes the
/// words with single 64-bit stores through a shared mapping, so the
/// datapath never sees half of an update. `NPM_IPCACHE` holds every
/// address; an address whose slot holds another one (or that does not
/// fit a word) is only found there.
pub const IPCACHE4: &str = "NPM_IPCACHE4";
/// prefix -> CIDR identity.
pub const CIDRS: &str = "NPM_CIDRS";
/// [`crate::PolicyKey`] -> [`crate::PolicyValue`].
pub const POLICY: &str = "NPM_POLICY";
/// [`crate::CtKey`] -> [`crate::CtValue`].
pub const CT: &str = "NPM_CT";
/// [`crate::CtKey4`] -> [`crate::CtValue`]: the conntrack entries whose
/// two addresses are IPv4-mapped (a shorter key hashes faster).
pub const CT4: &str = "NPM_CT4";
/// [`crate::FragKey`] -> [`crate::FragValue`].
pub const FRAGS: &str = "NPM_FRAGS";
/// per-CPU [`crate::Counter`]s.
pub const COUNTERS: &str = "NPM_COUNTERS";
/// ring buffer of [`crate::DenyEvent`]s.
pub const EVENTS: &str = "NPM_EVENTS";
/// [`crate::ServiceKey`] -> [`crate::ServiceValue`]: the ClusterIP and
/// NodePort addresses and ports kube-proxy may DNAT; an isolated
/// endpoint's egress to one is decided after the DNAT (see
/// `npm_common::service`).
pub const SERVICES: &str = "NPM_SERVICES";
/// [`crate::PolicyKey`] (with the tier in the direction byte:
/// [`crate::tier_key`]) -> [`crate::TierValue`]: the ClusterNetworkPolicy
/// Admin and Baseline tiers.
pub const TIERS: &str = "NPM_TIERS";
/// The folded decisions ([`crate::fold_key`] ...): buckets of four
/// (key, value) entries, per (subject, direction, peer class, port class)
/// the decision of both tiers and NetworkPolicy together, for subjects
/// with tier entries: the one precomputed form of `NPM_POLICY` and
/// `NPM_TIERS`. User space writes whole words through a shared
/// mapping.
pub const FOLD: &str = "NPM_FOLD";
/// per-CPU [`crate::Counter`]s of the packets allowed at a policy
/// decision by each NetworkPolicy rule, at [`crate::rule_slot`] (the
/// first packet of each connection: tracked packets are not re-decided).
pub const RULE_COUNT: &str = "NPM_RULE_COUNT";
/// per-CPU [`crate::Counter`]s of the packets NetworkPolicy denied, by
/// endpoint and direction at [`crate::endpoint_deny_slot`].
pub const EP_DENIES: &str = "NPM_EP_DENIES";
/// The decision epoch of each local endpoint (`u32`), an array indexed by
/// [`crate::ep_epoch_slot`] of the endpoint's host-side ifindex: a tracked
/// packet whose conntrack entry's [`crate::CtValue::epoch`] differs is
/// decided again once (connection semantics `enforce`). The
/// loader moves an endpoint's epoch after a sync that changed what its
/// policy decides; under `keep` it never moves. Added with layout 7 (same
/// rule: an older program ignores it and keeps its flows).
pub const EP_EPOCH: &str = "NPM_EP_EPOCH";
/// Each endpoint's conntrack quota: [`crate::CT_QUOTA_WORDS`] `u64`
/// words per slot of [`crate::ep_epoch_slot`] (the host-side ifindex
/// modulo the size; endpoints whose ifindexes share a slot share a
/// quota), an array the loader maps (`BPF_F_MMAPABLE`). Added in layout 8.
pub const CT_QUOTA: &str = "NPM_CT_QUOTA";
/// The conntrack maps' fill and pressure thresholds:
/// [`crate::CT_FILL_LEN`] `u64` words ([`crate::CT_FILL_WORDS`] per map),
/// an array the loader maps (`BPF_F_MMAPABLE`). Added in layout 8 after
/// `NPM_CT_QUOTA` (same rule: a program without it caps at all fills).
pub const CT_FILL: &str = "NPM_CT_FILL";
/// LRU [`crate::DeferSourceKey`] -> `u32`: the sender's host-side
/// ifindex of each deferred Service flow by its source (address, port,
/// protocol), written by `from_pod` with the deferral; read after the DNAT
/// when the packet's `ingress_ifindex` is no endpoint's (a bridged pod's
/// packet routed by the node: see `npm_common::service`). Added with
/// layout 8.
pub const DEFER_SRC: &str = "NPM_DEFER_SRC";
/// Every map, for pinning and adoption.
pub const ALL: [&str; 20] = [
    EP_SLOTS, ENDPOINTS, IPCACHE, IPCACHE4, CIDRS, POLICY, CT, CT4, FRAGS, COUNTERS, EVENTS, SERVICES, TIERS, FOLD,
    RULE_COUNT, EP_DENIES, EP_EPOCH, CT_QUOTA, DEFER_SRC, CT_FILL,
];

/// Map sizes (max entries).
pub mod sizes {
    /// Local endpoints per node whose ifindex is `>=` [`ENDPOINT_SLOTS`].
    pub const ENDPOINTS: u32 = 4096;
    /// Slots of `NPM_EP_SLOTS`: interfaces with a smaller ifindex are found
    /// by an inlined array lookup (44 bytes a slot: 2.9 MB).
    pub const ENDPOINT_SLOTS: u32 = 65_536;
    /// Exact addresses known cluster-wide (pods and node addresses).
    pub const IPCACHE: u32 = 262_144;
    /// log2 of the slots of `NPM_IPCACHE4`.
    pub const IPCACHE4_BITS: u32 = 18;
    /// Slots of `NPM_IPCACHE4` (8 bytes each: 2 MB).
    pub const IPCACHE4_SLOTS: u32 = 1 << IPCACHE4_BITS;
    /// Distinct ipBlock prefixes.
    pub const CIDRS: u32 = 65_536;
    /// Policy LPM entries (port ranges expand to prefixes).
    pub const POLICY: u32 = 1_048_576;
    /// Tracked connections (each of `NPM_CT` and `NPM_CT4`).
    pub const CT: u32 = 262_144;
    /// Fragment records.
    pub const FRAGS: u32 = 8192;
    /// ClusterNetworkPolicy tier LPM entries (both tiers; port ranges
    /// expand to prefixes).
    pub const TIERS: u32 = 262_144;
    /// log2 of the buckets of `NPM_FOLD`.
    pub const FOLD_BITS: u32 = 16;
    /// Buckets of `NPM_FOLD` (four entries of 16 bytes each: 4 MB, room
    /// for 262,144 entries). Fixed: the datapath's shift is compiled in
    /// ([`crate::FOLD_SHIFT`]).
    pub const FOLD_BUCKETS: u32 = 1 << FOLD_BITS;
    /// Service keys (ClusterIP ports and node address x NodePort pairs).
    pub const SERVICES: u32 = 65_536;
    /// Deferred flows' sources (`NPM_DEFER_SRC`, LRU: an entry is read
    /// within the packet's own trip through the node, so only the newest
    /// matter).
    pub const DEFER_SOURCES: u32 = 65_536;
    /// Ring buffer bytes for flow events (denies, and allows of new connections).
    pub const EVENTS_BYTES: u32 = 256 * 1024;
}

/// Version of the map layout; part of the pin path so that an agent with an
/// incompatible layout never adopts maps it cannot read. Its history, and
/// when a change needs a new version, are in CHANGELOG.md (Layout versions).
pub const LAYOUT_VERSION: u32 = 8;
