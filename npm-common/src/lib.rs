//! Types shared by the eBPF datapath (`npm-ebpf`) and user space
//! (`npm-dataplane`, `npm-agent`): the map keys and values, the reserved
//! identities, the verdict reasons and the pinned map names.
//!
//! Everything here is `#[repr(C)]`, has no implicit padding and is plain old
//! data, so the kernel and user space read the same bytes.
//!
//! # Map layout and lookup precedence
//!
//! | map            | kind                 | key                         | value          |
//! |----------------|----------------------|-----------------------------|----------------|
//! | `NPM_EP_SLOTS` | array                | host-side ifindex `<` [`sizes::ENDPOINT_SLOTS`] | [`EndpointInfo`] |
//! | `NPM_ENDPOINTS`| hash                 | host-side ifindex `>=` [`sizes::ENDPOINT_SLOTS`] | [`EndpointInfo`] |
//! | `NPM_IPCACHE`  | hash                 | [`IpKey`] (exact address)   | [`IpInfo`]     |
//! | `NPM_IPCACHE4` | array (mmapable)     | [`ipcache4_slot`] of an IPv4 address | [`ipcache4_word`] (`u64`) |
//! | `NPM_CIDRS`    | LPM trie             | prefix of [`IpKey::addr`]   | CIDR identity (`u32`) |
//! | `NPM_POLICY`   | LPM trie             | [`PolicyKey`]               | [`PolicyValue`] |
//! | `NPM_POLICY_FRONT` | array (mmapable) of 4-word buckets | [`policy_front_bucket`] of a word | [`policy_front_word`]s (`[u64; 4]`) |
//! | `NPM_CT`       | LRU hash             | [`CtKey`]                   | [`CtValue`]    |
//! | `NPM_CT4`      | LRU hash             | [`CtKey4`]                  | [`CtValue`]    |
//! | `NPM_FRAGS`    | LRU hash             | [`FragKey`]                 | [`FragValue`]  |
//! | `NPM_COUNTERS` | per-CPU array        | [`counter_index`]           | [`Counter`]    |
//! | `NPM_EVENTS`   | ring buffer          | -                           | [`DenyEvent`]  |
//! | `NPM_GENERATION` | array (1)          | 0                           | policy generation (`u64`) |
//!
//! IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`) everywhere, so
//! one map serves both families; an IPv4 prefix of length `n` is stored with
//! prefix length `96 + n`.
//!
//! The classifier decides every packet on a pod's host-side veth in this
//! order; the first step that decides wins:
//!
//! 1. not IPv4/IPv6 (ARP, ...): allow ([`Reason::NonIp`]);
//! 2. an endpoint missing (its `NPM_EP_SLOTS` slot without [`EP_PRESENT`],
//!    or, for a large ifindex, no `NPM_ENDPOINTS` entry): allow
//!    ([`Reason::NoEndpoint`]), the program is only attached to interfaces of
//!    programmed endpoints;
//! 3. a truncated or malformed header: drop ([`Reason::Malformed`]);
//! 4. egress (leaving the pod) with a source address that is not the
//!    endpoint's own: drop ([`Reason::Spoofed`]); ICMPv6 neighbour discovery
//!    and MLD are exempt and allowed ([`Reason::Icmpv6Control`]);
//! 5. a non-first fragment: decided as its first fragment was (`NPM_FRAGS`);
//!    without a record of an allowed first fragment: drop ([`Reason::Fragment`]);
//! 6. a conntrack hit (`NPM_CT4` when both addresses are IPv4-mapped, else
//!    `NPM_CT`) for this endpoint: allow ([`Reason::Tracked`]). An IPv4
//!    packet of an established flow (replies seen, not closing; no FIN, RST
//!    or fragment) is first looked up in the datapath's per-CPU flow cache
//!    (`NPM_FLOWCACHE`, not pinned), which a conntrack hit confirms for
//!    250 ms at a time. A TCP SYN without ACK skips this step: a new
//!    connection is always decided by policy;
//! 7. the endpoint is not isolated in this direction: allow ([`Reason::NotIsolated`]);
//! 8. ingress from the local node ([`IDENTITY_HOST`]): allow ([`Reason::Host`]);
//! 9. policy: `NPM_POLICY` is looked up with the peer's pod identity, then its
//!    CIDR identity, then [`IDENTITY_ANY`]; any hit allows ([`Reason::Policy`]),
//!    no hit drops ([`Reason::PolicyDenied`]). A lookup that cannot hit, as
//!    the endpoint's `EP_NO_*_PEER_*` flags tell, is skipped. When the
//!    endpoint's flags carry [`EP_FRONT_INGRESS`] (or [`EP_FRONT_EGRESS`])
//!    the direction's policy is complete in `NPM_POLICY_FRONT`, a hash table
//!    of exact words the datapath probes with inlined array reads: each
//!    lookup is then up to three probes (the exact port, any port of the
//!    protocol, any protocol) instead of the LPM walk, with the same answer.
//!
//! Steps 8 and 9 read only the endpoint, the direction, the peer address,
//! the protocol and the destination port. The datapath keeps their outcome
//! per CPU in a decision cache (`NPM_DECISIONS`, not pinned) tagged with
//! `NPM_GENERATION`, which the loader bumps after every batch of map writes:
//! a cached decision answers only while the maps are as they were at the
//! last batch boundary before it was made (during a batch, with the state
//! before the batch).
//!
//! Steps 7 to 9 that allow a packet also create a conntrack entry, so its
//! replies are allowed by step 6 in both hooks of this endpoint. Policy maps
//! only hold allows: there is no deny entry and no priority between entries,
//! the longest-prefix match of a policy key only finds *an* allow.
#![no_std]
#![deny(missing_docs)]

/// Pinned map names (the files under the bpffs pin directory).
pub mod maps {
    /// ifindex -> [`super::EndpointInfo`], an array indexed by the ifindex
    /// (the verifier inlines an array lookup: no helper call per packet).
    /// A slot holds an endpoint when its flags have [`super::EP_PRESENT`].
    pub const EP_SLOTS: &str = "NPM_EP_SLOTS";
    /// ifindex -> [`super::EndpointInfo`] for the interfaces whose ifindex
    /// does not fit `NPM_EP_SLOTS` (`>=` [`super::sizes::ENDPOINT_SLOTS`]:
    /// hosts that created that many interfaces since boot).
    pub const ENDPOINTS: &str = "NPM_ENDPOINTS";
    /// exact address -> [`super::IpInfo`].
    pub const IPCACHE: &str = "NPM_IPCACHE";
    /// Direct-mapped front of `NPM_IPCACHE` for IPv4 addresses: slot
    /// [`super::ipcache4_slot`] holds one [`super::ipcache4_word`], read by
    /// the datapath with one inlined array access. User space writes the
    /// words with single 64-bit stores through a shared mapping, so the
    /// datapath never sees half of an update. `NPM_IPCACHE` holds every
    /// address; an address whose slot holds another one (or that does not
    /// fit a word) is only found there.
    pub const IPCACHE4: &str = "NPM_IPCACHE4";
    /// prefix -> CIDR identity.
    pub const CIDRS: &str = "NPM_CIDRS";
    /// [`super::PolicyKey`] -> [`super::PolicyValue`].
    pub const POLICY: &str = "NPM_POLICY";
    /// [`super::CtKey`] -> [`super::CtValue`].
    pub const CT: &str = "NPM_CT";
    /// [`super::CtKey4`] -> [`super::CtValue`]: the conntrack entries whose
    /// two addresses are IPv4-mapped (a shorter key hashes faster).
    pub const CT4: &str = "NPM_CT4";
    /// [`super::FragKey`] -> [`super::FragValue`].
    pub const FRAGS: &str = "NPM_FRAGS";
    /// per-CPU [`super::Counter`]s.
    pub const COUNTERS: &str = "NPM_COUNTERS";
    /// ring buffer of [`super::DenyEvent`]s.
    pub const EVENTS: &str = "NPM_EVENTS";
    /// The policy generation (array of one `u64`): the loader bumps it
    /// after every batch of map writes; the datapath's decision cache only
    /// answers for decisions made under the current generation.
    pub const GENERATION: &str = "NPM_GENERATION";
    /// The policy front: the `NPM_POLICY` entries of endpoints whose
    /// policy in a direction fits it (see [`super::EP_FRONT_INGRESS`]), as
    /// [`super::policy_front_word`]s in 4-word buckets
    /// ([`super::policy_front_bucket`]), read by the datapath with inlined
    /// array accesses. User space writes single 64-bit words through a
    /// shared mapping, so the datapath never sees half of a word.
    pub const POLICY_FRONT: &str = "NPM_POLICY_FRONT";
    /// Every map, for pinning and adoption.
    pub const ALL: [&str; 13] = [
        EP_SLOTS,
        ENDPOINTS,
        IPCACHE,
        IPCACHE4,
        CIDRS,
        POLICY,
        POLICY_FRONT,
        CT,
        CT4,
        FRAGS,
        COUNTERS,
        EVENTS,
        GENERATION,
    ];
}

/// Map sizes (max entries).
pub mod sizes {
    /// Local endpoints per node whose ifindex is `>=` [`ENDPOINT_SLOTS`].
    pub const ENDPOINTS: u32 = 4096;
    /// Slots of `NPM_EP_SLOTS`: interfaces with a smaller ifindex are found
    /// by an inlined array lookup (40 bytes a slot: 2.6 MB).
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
    /// log2 of the buckets of `NPM_POLICY_FRONT`.
    pub const POLICY_FRONT_BITS: u32 = 16;
    /// Buckets of `NPM_POLICY_FRONT` (4 words, 32 bytes each: 2 MB, room
    /// for 262,144 words).
    pub const POLICY_FRONT_BUCKETS: u32 = 1 << POLICY_FRONT_BITS;
    /// Tracked connections (each of `NPM_CT` and `NPM_CT4`).
    pub const CT: u32 = 262_144;
    /// Fragment records.
    pub const FRAGS: u32 = 8192;
    /// Ring buffer bytes for deny events.
    pub const EVENTS_BYTES: u32 = 256 * 1024;
}

/// Version of the map layout; part of the pin path so that an agent with an
/// incompatible layout never adopts maps it cannot read.
///
/// 2: IPv4 conntrack entries moved from `NPM_CT` to `NPM_CT4`.
/// 3: endpoints in the `NPM_EP_SLOTS` array (with [`EP_PRESENT`]), the hash
/// `NPM_ENDPOINTS` only for large ifindexes; `NPM_GENERATION`.
/// 4: `NPM_IPCACHE4`, the direct-mapped IPv4 front of the ipcache.
/// 5: `NPM_POLICY_FRONT` and the `EP_FRONT_*` flags.
pub const LAYOUT_VERSION: u32 = 5;

/// Direction as seen from the pod: traffic entering the pod.
pub const DIR_INGRESS: u8 = 0;
/// Direction as seen from the pod: traffic leaving the pod.
pub const DIR_EGRESS: u8 = 1;

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

/// [`EndpointInfo::flags`]: ingress is isolated (some policy selects it for ingress).
pub const EP_ISOLATED_INGRESS: u32 = 1 << 0;
/// [`EndpointInfo::flags`]: egress is isolated.
pub const EP_ISOLATED_EGRESS: u32 = 1 << 1;
/// [`EndpointInfo::flags`]: [`EndpointInfo::ipv4`] is set.
pub const EP_HAS_V4: u32 = 1 << 2;
/// [`EndpointInfo::flags`]: [`EndpointInfo::ipv6`] is set.
pub const EP_HAS_V6: u32 = 1 << 3;
/// [`EndpointInfo::flags`]: no `NPM_POLICY` entry of this endpoint for
/// ingress has the peer [`IDENTITY_ANY`], so step 9 skips that lookup (it
/// could not hit). The `EP_NO_*_PEER_*` flags only let the datapath skip
/// lookups that cannot match: when clear (e.g. an endpoint written by an
/// older loader) every lookup is made. The egress flag of each pair is the
/// ingress flag shifted left by [`DIR_EGRESS`].
pub const EP_NO_ANY_PEER_INGRESS: u32 = 1 << 4;
/// [`EndpointInfo::flags`]: like [`EP_NO_ANY_PEER_INGRESS`], for egress.
pub const EP_NO_ANY_PEER_EGRESS: u32 = 1 << 5;
/// [`EndpointInfo::flags`]: no `NPM_POLICY` entry of this endpoint for
/// ingress has a CIDR identity (`>=` [`IDENTITY_FIRST_CIDR`]) as its peer, so
/// step 9 skips the lookup of such an identity.
pub const EP_NO_CIDR_PEER_INGRESS: u32 = 1 << 6;
/// [`EndpointInfo::flags`]: like [`EP_NO_CIDR_PEER_INGRESS`], for egress.
pub const EP_NO_CIDR_PEER_EGRESS: u32 = 1 << 7;
/// [`EndpointInfo::flags`]: no `NPM_POLICY` entry of this endpoint for
/// ingress has a peer identity between [`IDENTITY_WORLD`] and
/// [`IDENTITY_FIRST_CIDR`] (exclusive), so step 9 skips the lookup of such an
/// identity.
pub const EP_NO_POD_PEER_INGRESS: u32 = 1 << 8;
/// [`EndpointInfo::flags`]: like [`EP_NO_POD_PEER_INGRESS`], for egress.
pub const EP_NO_POD_PEER_EGRESS: u32 = 1 << 9;
/// [`EndpointInfo::flags`]: the record holds an endpoint. Array slots always
/// exist; a slot without this flag (all zeroes) is no endpoint.
pub const EP_PRESENT: u32 = 1 << 10;
/// [`EndpointInfo::flags`]: every `NPM_POLICY` entry of this endpoint for
/// ingress is also in `NPM_POLICY_FRONT` (as the words of
/// [`policy_front_word`]), so step 9 probes the front instead of walking
/// the LPM trie, and a miss there is a miss. The loader sets it only once
/// all the words are written and clears it before a word it cannot place
/// would be needed; words are removed from the front before their entries
/// leave `NPM_POLICY`. The egress flag is the ingress flag shifted left by
/// [`DIR_EGRESS`].
pub const EP_FRONT_INGRESS: u32 = 1 << 11;
/// [`EndpointInfo::flags`]: like [`EP_FRONT_INGRESS`], for egress.
pub const EP_FRONT_EGRESS: u32 = 1 << 12;
/// [`EndpointInfo::flags`]: with [`EP_FRONT_INGRESS`], no ingress entry of
/// the endpoint is a wildcard (any port, or any protocol), so step 9 only
/// probes exact ports.
pub const EP_FRONT_EXACT_INGRESS: u32 = 1 << 13;
/// [`EndpointInfo::flags`]: like [`EP_FRONT_EXACT_INGRESS`], for egress.
pub const EP_FRONT_EXACT_EGRESS: u32 = 1 << 14;
const _: () = assert!(EP_FRONT_EGRESS == EP_FRONT_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_FRONT_EXACT_EGRESS == EP_FRONT_EXACT_INGRESS << DIR_EGRESS);

/// Endpoint ids below this fit a [`policy_front_word`] (19 bits).
pub const POLICY_FRONT_MAX_ENDPOINT: u32 = 1 << 19;
/// Peer identities below this fit a [`policy_front_word`] (25 bits: every
/// pod identity and the first 2^24 CIDR identities).
pub const POLICY_FRONT_MAX_IDENTITY: u32 = 1 << 25;

/// The `NPM_POLICY_FRONT` protocol code of an IP protocol number: 1 TCP,
/// 2 UDP, 3 SCTP, 0 for any other (only "any protocol" words match those).
pub const fn policy_front_proto(protocol: u8) -> u64 {
    match protocol {
        proto::TCP => 1,
        proto::UDP => 2,
        proto::SCTP => 3,
        _ => 0,
    }
}

/// One `NPM_POLICY_FRONT` word: an allow of endpoint `endpoint` in
/// direction `dir` for peer `identity` and
/// - `code` 0: any protocol, any port (`exact` false, `port` 0);
/// - `code` 1..=3 ([`policy_front_proto`]) with `exact` false: any port of
///   that protocol (`port` 0);
/// - `code` 1..=3 with `exact` true: that destination port.
///
/// Bits 0..16 the port, 16 exact, 17..19 the protocol code, 19..44 the
/// identity, 44 the direction, 45..64 the endpoint. Endpoint ids start at
/// 1, so no word is 0 (an empty slot). The caller checks the ranges
/// ([`POLICY_FRONT_MAX_ENDPOINT`], [`POLICY_FRONT_MAX_IDENTITY`]).
pub const fn policy_front_word(endpoint: u32, dir: u8, identity: u32, code: u64, exact: bool, port: u16) -> u64 {
    port as u64
        | (exact as u64) << 16
        | code << 17
        | (identity as u64) << 19
        | ((dir & 1) as u64) << 44
        | (endpoint as u64) << 45
}

/// The bucket of a [`policy_front_word`] in `NPM_POLICY_FRONT`: a
/// multiplicative hash of the whole word. A word is only ever stored in
/// its own bucket (4 slots); a word that finds its bucket full is not
/// stored, and its endpoint's direction keeps the LPM.
pub const fn policy_front_bucket(word: u64) -> u32 {
    (word.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - sizes::POLICY_FRONT_BITS)) as u32
}

/// The `EP_NO_*_PEER_INGRESS` flag whose (direction-shifted) bit tells that
/// no policy entry of an endpoint can match `identity` as its peer.
pub const fn ep_no_peer_flag(identity: u32) -> u32 {
    if identity == IDENTITY_ANY {
        EP_NO_ANY_PEER_INGRESS
    } else if identity >= IDENTITY_FIRST_CIDR {
        EP_NO_CIDR_PEER_INGRESS
    } else {
        EP_NO_POD_PEER_INGRESS
    }
}

const _: () = assert!(EP_NO_ANY_PEER_EGRESS == EP_NO_ANY_PEER_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_NO_CIDR_PEER_EGRESS == EP_NO_CIDR_PEER_INGRESS << DIR_EGRESS);
const _: () = assert!(EP_NO_POD_PEER_EGRESS == EP_NO_POD_PEER_INGRESS << DIR_EGRESS);
const _: () = assert!(DIR_INGRESS == 0);

/// One local pod, keyed by the ifindex of its host-side veth.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct EndpointInfo {
    /// Endpoint id used in [`PolicyKey`], [`CtKey`] and [`FragKey`].
    pub id: u32,
    /// `EP_*` flags.
    pub flags: u32,
    /// The pod's IPv4 address, IPv4-mapped (valid with [`EP_HAS_V4`]).
    pub ipv4: [u8; 16],
    /// The pod's IPv6 address (valid with [`EP_HAS_V6`]).
    pub ipv6: [u8; 16],
}

/// An address: IPv6, or IPv4-mapped IPv6 (`::ffff:a.b.c.d`).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct IpKey {
    /// Address bytes in network order.
    pub addr: [u8; 16],
}

impl IpKey {
    /// The IPv4-mapped form of an IPv4 address given in network byte order.
    pub const fn v4(octets: [u8; 4]) -> Self {
        let mut addr = [0u8; 16];
        addr[10] = 0xff;
        addr[11] = 0xff;
        addr[12] = octets[0];
        addr[13] = octets[1];
        addr[14] = octets[2];
        addr[15] = octets[3];
        IpKey { addr }
    }
    /// An IPv6 address.
    pub const fn v6(octets: [u8; 16]) -> Self {
        IpKey { addr: octets }
    }
}

/// The `NPM_IPCACHE4` slot of an IPv4 address (`addr`: its 4 bytes in
/// network order read as a little-endian `u32`, as the datapath loads them).
pub const fn ipcache4_slot(addr: u32) -> u32 {
    addr.wrapping_mul(0x9e37_79b1) >> (32 - sizes::IPCACHE4_BITS)
}

/// The `NPM_IPCACHE4` word of an IPv4 address and its [`IpInfo`]: bits
/// 0..32 the address (as in [`ipcache4_slot`]), 32..56 the pod identity
/// (never 0, so an all-zero word is an empty slot), 56..64 the CIDR
/// identity as `1 + (cidr_identity - IDENTITY_FIRST_CIDR)`, 0 for none.
/// `None` when the entry does not fit: identity 0 or `>= 2^24`, or a CIDR
/// identity beyond the first 255 (such addresses live in `NPM_IPCACHE`
/// only).
pub const fn ipcache4_word(addr: u32, info: IpInfo) -> Option<u64> {
    if info.identity == 0 || info.identity >= IDENTITY_FIRST_CIDR {
        return None;
    }
    let cidr = if info.cidr_identity == IDENTITY_ANY {
        0
    } else if info.cidr_identity >= IDENTITY_FIRST_CIDR && info.cidr_identity - IDENTITY_FIRST_CIDR < 255 {
        info.cidr_identity - IDENTITY_FIRST_CIDR + 1
    } else {
        return None;
    };
    Some(addr as u64 | (info.identity as u64) << 32 | (cidr as u64) << 56)
}

/// The address and [`IpInfo`] of a non-zero `NPM_IPCACHE4` word.
pub const fn ipcache4_unpack(word: u64) -> (u32, IpInfo) {
    let cidr = (word >> 56) as u32;
    (
        word as u32,
        IpInfo {
            identity: ((word >> 32) & 0xff_ffff) as u32,
            cidr_identity: if cidr == 0 {
                IDENTITY_ANY
            } else {
                IDENTITY_FIRST_CIDR + cidr - 1
            },
        },
    )
}

/// What the ipcache knows of one exact address.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct IpInfo {
    /// Pod identity, [`IDENTITY_HOST`] for node addresses.
    pub identity: u32,
    /// Identity of the longest ipBlock prefix containing the address, or
    /// [`IDENTITY_ANY`] (0) when none does; saves the LPM lookup for pods.
    pub cidr_identity: u32,
}

/// Length of [`PolicyKey::data`] in bytes.
pub const POLICY_KEY_LEN: usize = 12;
/// Prefix length matching endpoint, direction and peer: any protocol, any port.
pub const POLICY_PREFIX_ANY_PROTO: u32 = 72;
/// Prefix length matching up to the protocol: any port of that protocol.
pub const POLICY_PREFIX_ANY_PORT: u32 = 80;
/// Prefix length of a fully specified key (one port).
pub const POLICY_PREFIX_FULL: u32 = 96;

/// Key of the `NPM_POLICY` LPM trie: `bpf_lpm_trie_key` layout.
///
/// `data` is, in network order: endpoint id (4 bytes), direction (1),
/// peer identity (4), protocol (1), destination port (2). A rule without
/// ports is an entry of prefix length [`POLICY_PREFIX_ANY_PROTO`]; a rule
/// with a protocol and no port, [`POLICY_PREFIX_ANY_PORT`]; a port range is
/// split into aligned power-of-two blocks, each an entry of prefix length
/// `80 + (16 - log2(block size))`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    /// Significant bits of `data`.
    pub prefix_len: u32,
    /// See the type's documentation.
    pub data: [u8; POLICY_KEY_LEN],
}

impl PolicyKey {
    /// The fully specified key the datapath looks up for one packet.
    #[inline(always)]
    pub const fn new(endpoint: u32, direction: u8, identity: u32, protocol: u8, port: u16) -> Self {
        Self::with_prefix(POLICY_PREFIX_FULL, endpoint, direction, identity, protocol, port)
    }

    /// A key with an explicit prefix length; bits past the prefix are zeroed.
    #[inline(always)]
    pub const fn with_prefix(
        prefix_len: u32,
        endpoint: u32,
        direction: u8,
        identity: u32,
        protocol: u8,
        port: u16,
    ) -> Self {
        let e = endpoint.to_be_bytes();
        let i = identity.to_be_bytes();
        let p = port.to_be_bytes();
        let mut data = [
            e[0], e[1], e[2], e[3], direction, i[0], i[1], i[2], i[3], protocol, p[0], p[1],
        ];
        // Zero the bits beyond the prefix so equal rules give equal keys.
        let mut bit = prefix_len as usize;
        while bit < POLICY_KEY_LEN * 8 {
            data[bit / 8] &= !(0x80u8 >> (bit % 8));
            bit += 1;
        }
        PolicyKey { prefix_len, data }
    }

    /// Endpoint id of the key.
    pub const fn endpoint(&self) -> u32 {
        u32::from_be_bytes([self.data[0], self.data[1], self.data[2], self.data[3]])
    }
    /// Direction of the key.
    pub const fn direction(&self) -> u8 {
        self.data[4]
    }
    /// Peer identity of the key.
    pub const fn identity(&self) -> u32 {
        u32::from_be_bytes([self.data[5], self.data[6], self.data[7], self.data[8]])
    }
    /// Protocol of the key (meaningless below [`POLICY_PREFIX_ANY_PORT`]).
    pub const fn protocol(&self) -> u8 {
        self.data[9]
    }
    /// First port of the key's range.
    pub const fn port(&self) -> u16 {
        u16::from_be_bytes([self.data[10], self.data[11]])
    }
}

/// Value of a policy entry: which compiled rule produced it (for counters,
/// `inspect` and `explain`). Its presence alone means "allow".
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct PolicyValue {
    /// Index of the rule in the compiled rule table.
    pub rule: u32,
    /// Reserved, zero.
    pub flags: u32,
}

/// Conntrack key: one connection as seen by one endpoint, canonical so that
/// both directions of the connection give the same key (the lower
/// (address, port) pair first).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtKey {
    /// Endpoint id that tracks the connection.
    pub endpoint: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Reserved, zero.
    pub pad: [u8; 3],
    /// Lower address of the pair.
    pub addr_lo: [u8; 16],
    /// Higher address of the pair.
    pub addr_hi: [u8; 16],
    /// Port that goes with `addr_lo` (ICMP echo: the echo id).
    pub port_lo: u16,
    /// Port that goes with `addr_hi` (ICMP echo: the echo id).
    pub port_hi: u16,
}

/// Bytes 0..12 of an IPv4-mapped address (`::ffff:0:0/96`).
pub const V4_MAPPED_PREFIX: [u8; 12] = [0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff];

/// The `NPM_CT4` key: a [`CtKey`] whose two addresses are IPv4-mapped,
/// stored as their last 4 bytes. Same canonical order as [`CtKey`] (for
/// IPv4-mapped addresses, comparing the last 4 bytes is comparing all 16).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct CtKey4 {
    /// Endpoint id that tracks the connection.
    pub endpoint: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Reserved, zero.
    pub pad: [u8; 3],
    /// Lower IPv4 address of the pair.
    pub addr_lo: [u8; 4],
    /// Higher IPv4 address of the pair.
    pub addr_hi: [u8; 4],
    /// Port that goes with `addr_lo` (ICMP echo: the echo id).
    pub port_lo: u16,
    /// Port that goes with `addr_hi` (ICMP echo: the echo id).
    pub port_hi: u16,
}

impl CtKey4 {
    /// The equivalent [`CtKey`] (IPv4-mapped addresses).
    pub fn to_key(&self) -> CtKey {
        let map = |a: [u8; 4]| {
            let mut m = [0u8; 16];
            m[..12].copy_from_slice(&V4_MAPPED_PREFIX);
            m[12..].copy_from_slice(&a);
            m
        };
        CtKey {
            endpoint: self.endpoint,
            protocol: self.protocol,
            pad: self.pad,
            addr_lo: map(self.addr_lo),
            addr_hi: map(self.addr_hi),
            port_lo: self.port_lo,
            port_hi: self.port_hi,
        }
    }
}

impl CtKey {
    /// The `NPM_CT4` form of this key, when both addresses are IPv4-mapped.
    pub fn to_v4(&self) -> Option<CtKey4> {
        let v4 = |a: &[u8; 16]| (a[..12] == V4_MAPPED_PREFIX).then(|| [a[12], a[13], a[14], a[15]]);
        Some(CtKey4 {
            endpoint: self.endpoint,
            protocol: self.protocol,
            pad: self.pad,
            addr_lo: v4(&self.addr_lo)?,
            addr_hi: v4(&self.addr_hi)?,
            port_lo: self.port_lo,
            port_hi: self.port_hi,
        })
    }
}

/// [`CtValue::flags`]: the connection was opened from `addr_lo` to `addr_hi`.
pub const CT_ORIG_LO_TO_HI: u8 = 1 << 0;
/// [`CtValue::flags`]: a TCP FIN or RST was seen; the entry expires soon.
pub const CT_CLOSING: u8 = 1 << 1;
/// [`CtValue::flags`]: a packet of the reply direction was seen.
pub const CT_SEEN_REPLY: u8 = 1 << 2;

/// Conntrack value.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CtValue {
    /// Monotonic time (ns) of the last packet.
    pub last_seen_ns: u64,
    /// Monotonic time (ns) the entry was created.
    pub created_ns: u64,
    /// Direction (from the endpoint) of the packet that opened the connection.
    pub origin_direction: u8,
    /// `CT_*` flags.
    pub flags: u8,
    /// Verdict reason that opened the connection.
    pub reason: u8,
    /// Reserved, zero.
    pub pad: [u8; 5],
}

/// Idle timeout of a TCP connection that has not seen a reply (ns).
pub const CT_TIMEOUT_TCP_SYN_NS: u64 = 60 * 1_000_000_000;
/// Idle timeout of an established TCP connection (ns).
pub const CT_TIMEOUT_TCP_NS: u64 = 6 * 3600 * 1_000_000_000;
/// Idle timeout of a TCP connection after FIN or RST (ns).
pub const CT_TIMEOUT_TCP_CLOSING_NS: u64 = 10 * 1_000_000_000;
/// Idle timeout of UDP, SCTP, ICMP and other flows (ns).
pub const CT_TIMEOUT_OTHER_NS: u64 = 120 * 1_000_000_000;

/// Fragment record key: an allowed first fragment, per endpoint.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Default)]
pub struct FragKey {
    /// Endpoint id.
    pub endpoint: u32,
    /// IPv4 identification or IPv6 fragment identification.
    pub id: u32,
    /// Protocol number.
    pub protocol: u8,
    /// Direction from the endpoint.
    pub direction: u8,
    /// Reserved, zero.
    pub pad: [u8; 2],
    /// Source address.
    pub src: [u8; 16],
    /// Destination address.
    pub dst: [u8; 16],
}

/// Fragment record value: the first fragment's ports and verdict reason.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct FragValue {
    /// Source port of the first fragment.
    pub sport: u16,
    /// Destination port of the first fragment.
    pub dport: u16,
    /// Reason the first fragment was allowed.
    pub reason: u8,
    /// Reserved, zero.
    pub pad: [u8; 3],
}

/// Why a packet was allowed or dropped.
#[repr(u8)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// Allowed: allowed by a policy entry.
    Policy = 0,
    /// Allowed: the endpoint is not isolated in this direction.
    NotIsolated = 1,
    /// Allowed: part of a tracked connection (established or reply).
    Tracked = 2,
    /// Allowed: ingress from this node.
    Host = 3,
    /// Allowed: not an IP packet.
    NonIp = 4,
    /// Allowed: ICMPv6 neighbour discovery or MLD.
    Icmpv6Control = 5,
    /// Allowed: the interface has no endpoint entry.
    NoEndpoint = 6,
    /// Dropped: no policy entry allows it.
    PolicyDenied = 16,
    /// Dropped: egress with a source that is not the endpoint's address.
    Spoofed = 17,
    /// Dropped: truncated or malformed headers.
    Malformed = 18,
    /// Dropped: non-first fragment without an allowed first fragment.
    Fragment = 19,
}

/// Number of reason slots per direction in `NPM_COUNTERS`.
pub const REASON_SLOTS: u32 = 32;
/// Reasons at or above this value drop the packet.
pub const FIRST_DENY_REASON: u8 = 16;

impl Reason {
    /// Every reason, for counters and metrics.
    pub const ALL: [Reason; 11] = [
        Reason::Policy,
        Reason::NotIsolated,
        Reason::Tracked,
        Reason::Host,
        Reason::NonIp,
        Reason::Icmpv6Control,
        Reason::NoEndpoint,
        Reason::PolicyDenied,
        Reason::Spoofed,
        Reason::Malformed,
        Reason::Fragment,
    ];

    /// True when the reason drops the packet.
    pub const fn is_deny(self) -> bool {
        self as u8 >= FIRST_DENY_REASON
    }

    /// The reason with this number.
    pub const fn from_u8(v: u8) -> Option<Reason> {
        Some(match v {
            0 => Reason::Policy,
            1 => Reason::NotIsolated,
            2 => Reason::Tracked,
            3 => Reason::Host,
            4 => Reason::NonIp,
            5 => Reason::Icmpv6Control,
            6 => Reason::NoEndpoint,
            16 => Reason::PolicyDenied,
            17 => Reason::Spoofed,
            18 => Reason::Malformed,
            19 => Reason::Fragment,
            _ => return None,
        })
    }

    /// Stable lower-case name (metrics label, logs).
    pub const fn name(self) -> &'static str {
        match self {
            Reason::Policy => "policy",
            Reason::NotIsolated => "not-isolated",
            Reason::Tracked => "tracked",
            Reason::Host => "host",
            Reason::NonIp => "non-ip",
            Reason::Icmpv6Control => "icmpv6-control",
            Reason::NoEndpoint => "no-endpoint",
            Reason::PolicyDenied => "policy-denied",
            Reason::Spoofed => "spoofed",
            Reason::Malformed => "malformed",
            Reason::Fragment => "fragment",
        }
    }
}

/// Index into `NPM_COUNTERS` for a direction and a reason.
#[inline(always)]
pub const fn counter_index(direction: u8, reason: u8) -> u32 {
    (direction as u32) * REASON_SLOTS + (reason as u32 % REASON_SLOTS)
}

/// Number of entries of `NPM_COUNTERS`.
pub const COUNTER_SLOTS: u32 = 2 * REASON_SLOTS;

/// One per-CPU counter slot.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Counter {
    /// Packets.
    pub packets: u64,
    /// Bytes.
    pub bytes: u64,
}

/// A dropped packet, sent to user space through `NPM_EVENTS`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DenyEvent {
    /// Monotonic time (ns).
    pub ts_ns: u64,
    /// Endpoint id.
    pub endpoint: u32,
    /// Host-side ifindex.
    pub ifindex: u32,
    /// `DIR_*`.
    pub direction: u8,
    /// [`Reason`] as a number.
    pub reason: u8,
    /// Protocol number.
    pub protocol: u8,
    /// 4 or 6.
    pub family: u8,
    /// Source port (0 when not known).
    pub sport: u16,
    /// Destination port (0 when not known).
    pub dport: u16,
    /// Source address (IPv4-mapped for IPv4).
    pub src: [u8; 16],
    /// Destination address (IPv4-mapped for IPv4).
    pub dst: [u8; 16],
}

#[cfg(feature = "user")]
mod pod_impls {
    use super::*;
    // SAFETY: all these types are repr(C), contain only integers and byte
    // arrays, have no padding, and any bit pattern is valid.
    unsafe impl aya::Pod for EndpointInfo {}
    unsafe impl aya::Pod for IpKey {}
    unsafe impl aya::Pod for IpInfo {}
    unsafe impl aya::Pod for PolicyValue {}
    unsafe impl aya::Pod for CtKey {}
    unsafe impl aya::Pod for CtKey4 {}
    unsafe impl aya::Pod for CtValue {}
    unsafe impl aya::Pod for FragKey {}
    unsafe impl aya::Pod for FragValue {}
    unsafe impl aya::Pod for Counter {}
    unsafe impl aya::Pod for DenyEvent {}
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use core::mem::size_of;

    #[test]
    fn layouts_have_no_padding() {
        assert_eq!(size_of::<EndpointInfo>(), 40);
        assert_eq!(size_of::<IpKey>(), 16);
        assert_eq!(size_of::<IpInfo>(), 8);
        assert_eq!(size_of::<PolicyKey>(), 16);
        assert_eq!(size_of::<PolicyValue>(), 8);
        assert_eq!(size_of::<CtKey>(), 44);
        assert_eq!(size_of::<CtKey4>(), 20);
        assert_eq!(size_of::<CtValue>(), 24);
        assert_eq!(size_of::<FragKey>(), 44);
        assert_eq!(size_of::<FragValue>(), 8);
        assert_eq!(size_of::<Counter>(), 16);
        assert_eq!(size_of::<DenyEvent>(), 56);
    }

    #[test]
    fn ipcache4_words_round_trip_or_refuse() {
        let addr = u32::from_le_bytes([10, 1, 2, 3]);
        for (identity, cidr) in [
            (IDENTITY_HOST, IDENTITY_ANY),
            (256, IDENTITY_ANY),
            ((1 << 24) - 1, IDENTITY_FIRST_CIDR),
            (300, IDENTITY_FIRST_CIDR + 254),
        ] {
            let info = IpInfo {
                identity,
                cidr_identity: cidr,
            };
            let w = ipcache4_word(addr, info).expect("fits");
            assert_ne!(w, 0);
            assert_eq!(ipcache4_unpack(w), (addr, info));
        }
        for (identity, cidr) in [(0, 0), (1 << 24, 0), (300, IDENTITY_FIRST_CIDR + 255), (300, 5)] {
            let info = IpInfo {
                identity,
                cidr_identity: cidr,
            };
            assert_eq!(ipcache4_word(addr, info), None, "{info:?}");
        }
        assert!(ipcache4_slot(u32::MAX) < sizes::IPCACHE4_SLOTS);
        assert_ne!(ipcache4_slot(addr), ipcache4_slot(u32::from_le_bytes([10, 1, 2, 4])));
    }

    #[test]
    fn policy_key_prefix_zeroes_tail() {
        let k = PolicyKey::with_prefix(POLICY_PREFIX_ANY_PROTO, 7, DIR_EGRESS, 300, proto::TCP, 80);
        assert_eq!(k.endpoint(), 7);
        assert_eq!(k.direction(), DIR_EGRESS);
        assert_eq!(k.identity(), 300);
        assert_eq!(k.protocol(), 0);
        assert_eq!(k.port(), 0);
        let k = PolicyKey::with_prefix(88, 7, DIR_INGRESS, 1, proto::UDP, 0x12ff);
        assert_eq!(k.protocol(), proto::UDP);
        assert_eq!(k.port(), 0x1200);
    }

    #[test]
    fn ct_key4_round_trip() {
        let k4 = CtKey4 {
            endpoint: 9,
            protocol: proto::TCP,
            pad: [0; 3],
            addr_lo: [10, 0, 0, 1],
            addr_hi: [10, 0, 0, 2],
            port_lo: 80,
            port_hi: 40000,
        };
        let k = k4.to_key();
        assert_eq!(k.addr_lo[..12], V4_MAPPED_PREFIX);
        assert_eq!(k.addr_hi[12..], [10, 0, 0, 2]);
        assert_eq!(k.to_v4(), Some(k4));
        let mut v6 = k;
        v6.addr_hi[0] = 0xfd;
        assert_eq!(v6.to_v4(), None);
    }

    #[test]
    fn reasons_round_trip() {
        for r in Reason::ALL {
            assert_eq!(Reason::from_u8(r as u8), Some(r));
            assert!(counter_index(DIR_EGRESS, r as u8) < COUNTER_SLOTS);
        }
        assert!(Reason::Spoofed.is_deny());
        assert!(!Reason::Tracked.is_deny());
    }
}
