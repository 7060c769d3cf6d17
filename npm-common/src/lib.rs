//! Types shared by the eBPF datapath (`npm-ebpf`) and user space
//! (`npm-dataplane`, `npm-agent`): the map keys and values, the reserved
//! identities, the verdict reasons and the pinned map names.
//!
//! Everything here is `#[repr(C)]`, has no implicit padding and is plain old
//! data, so the kernel and user space read the same bytes. Every field the
//! datapath reads or writes at a fixed byte offset (as whole 32- or 64-bit
//! words) has a compile-time `offset_of!` assertion beside its type, and
//! every type a `size_of!` one.
//!
//! One module per map family; every item is re-exported here, at the crate
//! root, so its path is `npm_common::Item`:
//!
//! | module      | owns |
//! |-------------|------|
//! | [`maps`]    | the pinned map names, [`sizes`] and [`LAYOUT_VERSION`] |
//! | `packet`    | directions ([`DIR_INGRESS`], [`DIR_EGRESS`]), [`proto`] numbers, reserved identities (`IDENTITY_*`) |
//! | `endpoint`  | [`EndpointInfo`] (`NPM_EP_SLOTS`, `NPM_ENDPOINTS`) and its `EP_*` flags |
//! | `ipcache`   | [`IpKey`], [`IpInfo`] (`NPM_IPCACHE`) and the `NPM_IPCACHE4` words |
//! | `policy`    | [`PolicyKey`], [`PolicyValue`] (`NPM_POLICY`) and the rule counters' slots |
//! | `fold`      | [`fold_key`], [`fold_value`] (`NPM_FOLD`): the folded decisions |
//! | `tiers`     | [`tier_key`], [`TierValue`] (`NPM_TIERS`): the ClusterNetworkPolicy tiers |
//! | `conntrack` | [`CtKey`], [`CtKey4`], [`CtValue`] (`NPM_CT`, `NPM_CT4`), [`FragKey`], [`FragValue`] (`NPM_FRAGS`) |
//! | `verdict`   | [`Reason`], [`Counter`] (`NPM_COUNTERS`), [`DenyEvent`] (`NPM_EVENTS`) |
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
//! | `NPM_TIERS`    | LPM trie             | [`PolicyKey`] with the tier in the direction byte ([`tier_key`]) | [`TierValue`] |
//! | `NPM_FOLD`     | array (mmapable) of 4-entry buckets | [`fold_bucket`] of a key | ([`fold_key`], [`fold_value`]) pairs (`[u64; 8]`) |
//! | `NPM_CT`       | LRU hash             | [`CtKey`]                   | [`CtValue`]    |
//! | `NPM_CT4`      | LRU hash             | [`CtKey4`]                  | [`CtValue`]    |
//! | `NPM_FRAGS`    | LRU hash             | [`FragKey`]                 | [`FragValue`]  |
//! | `NPM_SERVICES` | hash                 | [`ServiceKey`]              | [`ServiceValue`] |
//! | `NPM_DEFER_SRC`| LRU hash             | [`DeferSourceKey`] (a deferred flow's source) | sender's ifindex (`u32`) |
//! | `NPM_COUNTERS` | per-CPU array        | [`counter_index`]           | [`Counter`]    |
//! | `NPM_EVENTS`   | ring buffer          | -                           | [`DenyEvent`]  |
//!
//! IPv4 addresses are stored IPv4-mapped (`::ffff:a.b.c.d`) everywhere, so
//! one map serves both families; an IPv4 prefix of length `n` is stored with
//! prefix length `96 + n`.
//!
//! ## Precedence
//!
//! This is the one statement of the per-packet precedence; the datapath
//! (`npm-ebpf`) implements it and refers to its steps by number. The
//! classifier decides every packet on a pod's host-side veth in this
//! order; the first step that decides wins:
//!
//! 1. not IPv4/IPv6 (ARP, ...): allow ([`Reason::NonIp`]);
//! 2. an endpoint missing (its `NPM_EP_SLOTS` slot without [`EP_PRESENT`],
//!    or, for a large ifindex, no `NPM_ENDPOINTS` entry): allow
//!    ([`Reason::NoEndpoint`]), the program is only attached to interfaces of
//!    programmed endpoints;
//! 3. a truncated or malformed header: drop ([`Reason::Malformed`]); what
//!    is readable (the version the ethertype's, every header within the
//!    datagram's length field, not the frame's padding) is stated in
//!    `docs/packet-spec.md`;
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
//!    connection is always decided by policy. An ICMP error (IPv4 types 3,
//!    11 and 12, ICMPv6 types 1 to 4; not a fragment) whose quoted header
//!    (addresses, protocol, the ports or echo id of its first 8 L4 bytes)
//!    gives the canonical key of an entry of this endpoint that has not
//!    idled out, and that is addressed to the quoted packet's source, is
//!    allowed first ([`Reason::Related`]; it changes nothing in the
//!    entry); any other ICMP error goes on as any ICMP packet (conntrack
//!    with ports 0, then policy: only rules without ports allow it). A TCP
//!    entry keeps its timeout until both sides sent a FIN or a RST was seen
//!    ([`ct_timeout_ns`]);
//! 7. the endpoint is not isolated in this direction and no
//!    ClusterNetworkPolicy tier has entries for it (its flags carry neither
//!    [`EP_ISOLATED_INGRESS`] nor [`EP_ADMIN_INGRESS`] nor
//!    [`EP_BASELINE_INGRESS`], or their egress counterparts): allow
//!    ([`Reason::NotIsolated`]), with no further lookup;
//! 8. ingress from the local node ([`IDENTITY_HOST`]): allow ([`Reason::Host`]),
//!    before every tier (kubelet probes always work);
//! 9. the tiers and NetworkPolicy, in this order (the peer's identities are
//!    its pod or node identity, its CIDR identity and [`IDENTITY_ANY`]):
//!
//!    - 9a. Admin tier (only with [`EP_ADMIN_INGRESS`] / [`EP_ADMIN_EGRESS`]):
//!      `NPM_TIERS` is looked up with [`tier_key`] ([`TIER_ADMIN`]) for
//!      each identity (the CIDR identity only when there is one); the hit
//!      of the lowest rank decides: accept allows ([`Reason::AdminAccept`]),
//!      deny drops ([`Reason::AdminDeny`]); pass, or no hit, goes on;
//!    - 9b. NetworkPolicy (only when isolated: [`EP_ISOLATED_INGRESS`] /
//!      [`EP_ISOLATED_EGRESS`]), as described next: allows
//!      ([`Reason::Policy`]) or drops ([`Reason::PolicyDenied`]); final;
//!    - 9c. Baseline tier (only with [`EP_BASELINE_INGRESS`] /
//!      [`EP_BASELINE_EGRESS`]): as 9a with [`TIER_BASELINE`]:
//!      [`Reason::BaselineAccept`], [`Reason::BaselineDeny`]; pass or no
//!      hit goes on;
//!    - 9d. allow ([`Reason::NotIsolated`]).
//!
//!    9b: `NPM_POLICY` is looked up under the endpoint's subject
//!    ([`EndpointInfo::subject`], its pod identity: every local endpoint of
//!    one identity shares its NetworkPolicy entries) with the peer's pod
//!    identity, then its CIDR identity, then [`IDENTITY_ANY`]; any hit
//!    allows ([`Reason::Policy`]), no hit drops ([`Reason::PolicyDenied`]).
//!    A lookup that cannot hit, as the endpoint's `EP_NO_*_PEER_*` flags
//!    (which describe its subject's entries) tell, is skipped.
//!
//!    9a to 9d folded: when the endpoint's flags carry [`EP_FOLD_INGRESS`]
//!    (or [`EP_FOLD_EGRESS`]), `NPM_FOLD` holds the outcome of 9a to 9d for
//!    the peer's class (its two identities from step 8), the protocol and
//!    the port, computed ahead of time by user space ([`fold_key`]); a hit
//!    there is the decision, a class without entries takes 9a to 9d as
//!    written. The order above is unchanged: the fold only precomputes it.
//!    The LPM tries (`NPM_TIERS`, `NPM_POLICY`) are the truth; the fold is
//!    the one precomputed form of it, and nothing else caches a decision.
//!
//! Steps 7 to 9 that allow a packet (a tier's accept too) also create a
//! conntrack entry, so its replies are allowed by step 6 in both hooks of
//! this endpoint. `NPM_POLICY` only holds allows: there is no deny entry and
//! no priority between entries, the longest-prefix match of a policy key
//! only finds *an* allow. `NPM_TIERS` holds, per endpoint, direction, tier
//! and peer identity, entries whose most specific match (the longest
//! prefix) carries the first rule of the tier matching it; the minimum of
//! at most three ranks is the tier's first matching rule, whatever the
//! number of ClusterNetworkPolicies.
#![no_std]
#![deny(missing_docs)]

mod conntrack;
mod endpoint;
mod fold;
mod ipcache;
pub mod maps;
mod packet;
mod policy;
mod service;
mod tiers;
mod verdict;

pub use conntrack::*;
pub use endpoint::*;
pub use fold::*;
pub use ipcache::*;
pub use maps::{sizes, LAYOUT_VERSION};
pub use packet::*;
pub use policy::*;
pub use service::*;
pub use tiers::*;
pub use verdict::*;
