//! npm's TC classifier: per-packet NetworkPolicy enforcement with conntrack.
//!
//! Build (this is the exact command `cargo xtask build-ebpf` runs, from the
//! workspace root; the RUSTFLAGS add BTF, the object also loads without):
//!
//! ```text
//! cd /work/main && CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS="-C debuginfo=2 -C link-arg=--btf" \
//!     cargo +nightly build -p npm-ebpf --release --target bpfel-unknown-none -Z build-std=core
//! ```
//!
//! (needs `bpf-linker` on PATH and `aya-build` pinned to 0.2.0 in Cargo.lock:
//! 0.2.1 requires rustc 1.98).
//! The object lands at `target/bpfel-unknown-none/release/npm-ebpf`.
//!
//! # Programs
//!
//! - `npm_egress`: attached with tcx on the *ingress* hook of a pod's
//!   host-side veth: packets leaving the pod, the pod's EGRESS direction.
//! - `npm_ingress`: attached with tcx on the *egress* hook of the host-side
//!   veth: packets entering the pod, the pod's INGRESS direction.
//! - `npm_empty`: returns `TC_ACT_UNSPEC` and does nothing; the baseline of
//!   the benchmark.
//!
//! Both real entry points share [`decide`], which implements exactly the
//! precedence documented in `npm-common` (steps 1 to 9). An allowed packet
//! returns `TC_ACT_UNSPEC` (-1, which tcx reads as `TCX_NEXT`: the next
//! program, or the default action, decides); a dropped packet returns
//! `TC_ACT_SHOT` (2): it is dropped silently, never answered with a reset or
//! an ICMP error.
//!
//! # Fragments
//!
//! A first fragment (IPv4 MF set and offset 0; IPv6 fragment header with
//! offset 0) carries the L4 header and is evaluated like any packet. If it is
//! allowed, its ports and verdict reason are recorded in `NPM_FRAGS` under
//! (endpoint, direction, fragment id, source, destination, protocol). A
//! non-first fragment carries no L4 header: it is allowed only if that record
//! exists, and then with the reason its first fragment had; without a record
//! it is dropped with reason `Fragment`. Fragments that arrive before their
//! first fragment are therefore dropped (the sender retransmits).
//!
//! # Conntrack
//!
//! Timestamps (`CtValue`, `DenyEvent::ts_ns`) are `CLOCK_MONOTONIC` read
//! with `bpf_ktime_get_coarse_ns` (tick resolution, no TSC read): the
//! timeouts are seconds long, and the coarse clock is much cheaper.
//!
//! Keys are canonical (the lower (address, port) pair first) and per
//! endpoint, so both hooks of an endpoint find the same entry. A hit that
//! has not idled out allows the packet (`Tracked`). A packet in the reply
//! direction sets `CT_SEEN_REPLY`; a TCP FIN or RST sets `CT_CLOSING`.
//! Established flows are not re-evaluated when policy changes: they keep
//! flowing until they end or idle out; policy changes only affect new
//! connections (the loader purges the entries of removed endpoints).
//!
//! ICMP/ICMPv6 echo requests and replies use the echo identifier as both
//! ports in the conntrack key. Other ICMP messages use ports 0 and are
//! decided by policy (only "any protocol" entries match them, with port 0).
//!
//! A TCP SYN without ACK opens a new connection: it skips the conntrack
//! lookup and is decided by policy; if allowed, its fresh entry replaces any
//! older entry of the same 5-tuple.
//!
//! # Fast paths
//!
//! The costly part of a packet is each hash or trie lookup (a call into the
//! kernel, with hashing and return-thunk overhead); array lookups are
//! inlined by the verifier. The common IPv4 TCP/UDP packet is decided by
//! [`fast_v4`] with its fields in registers (anything else by [`classify`],
//! same steps, same shared helpers), and these fast paths avoid calls:
//!
//! - endpoints live in an array indexed by ifindex (`NPM_EP_SLOTS`), the
//!   hash `NPM_ENDPOINTS` only serves ifindexes beyond it;
//! - an IPv4 peer is first looked up in [`NPM_IPCACHE4`], a direct-mapped
//!   array of whole 64-bit words, and only if its slot holds another
//!   address in the hash `NPM_IPCACHE`;
//! - the flow cache ([`NPM_FLOWCACHE`], per CPU, direct-mapped): established
//!   IPv4 flows confirmed by a conntrack hit in the last 250 ms skip the
//!   conntrack lookup (see [`flow_cache_hit`] for what that may change);
//! - the policy front ([`NPM_POLICY_FRONT`], a hash table of exact words in
//!   4-word buckets written by user space): for an endpoint direction whose
//!   policy is complete there (`EP_FRONT_<dir>`), step 9 probes it (see
//!   [`front_allows`]) instead of walking the `NPM_POLICY` trie;
//! - the decision cache ([`NPM_DECISIONS`], per CPU, direct-mapped): the
//!   outcome of steps 8-9 per (endpoint, direction, protocol, port, peer
//!   address), valid only under the `NPM_GENERATION` it was decided in. The
//!   loader bumps the generation after every batch of map writes, so it is
//!   exact at batch boundaries (see [`NPM_DECISIONS`]).
//!
//! # Deny events
//!
//! Every drop is counted in `NPM_COUNTERS`; at most 32 deny events per CPU
//! and tick are written to the ring buffer, so a flood of denied packets
//! costs no ring-buffer call per packet.
#![no_std]
#![no_main]
// Map keys are passed by reference on purpose: by value they would be
// copied onto the 512-byte BPF stack (and through memcpy).
#![allow(clippy::needless_borrows_for_generic_args)]

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns, bpf_skb_load_bytes},
    macros::{classifier, map},
    maps::{lpm_trie::Key, Array, HashMap, LpmTrie, LruHashMap, PerCpuArray, RingBuf},
    programs::TcContext,
};
use core::ffi::c_void;

use npm_common::{
    counter_index, ep_no_peer_flag, ipcache4_slot, ipcache4_unpack, policy_front_bucket, policy_front_proto,
    policy_front_word, proto, sizes, Counter, CtKey, CtKey4, CtValue, DenyEvent, EndpointInfo, FragKey, FragValue,
    IpInfo, IpKey, PolicyValue, Reason, COUNTER_SLOTS, CT_CLOSING, CT_ORIG_LO_TO_HI, CT_SEEN_REPLY,
    CT_TIMEOUT_OTHER_NS, CT_TIMEOUT_TCP_CLOSING_NS, CT_TIMEOUT_TCP_NS, CT_TIMEOUT_TCP_SYN_NS, DIR_EGRESS, DIR_INGRESS,
    EP_FRONT_EXACT_INGRESS, EP_FRONT_INGRESS, EP_HAS_V4, EP_HAS_V6, EP_ISOLATED_EGRESS, EP_ISOLATED_INGRESS,
    EP_PRESENT, FIRST_DENY_REASON, IDENTITY_ANY, IDENTITY_HOST, IDENTITY_WORLD, POLICY_FRONT_MAX_ENDPOINT,
    POLICY_FRONT_MAX_IDENTITY, POLICY_KEY_LEN, POLICY_PREFIX_FULL,
};

#[map]
static NPM_EP_SLOTS: Array<EndpointInfo> = Array::with_max_entries(sizes::ENDPOINT_SLOTS, 0);
#[map]
static NPM_ENDPOINTS: HashMap<u32, EndpointInfo> = HashMap::with_max_entries(sizes::ENDPOINTS, 0);
#[map]
static NPM_IPCACHE: HashMap<IpKey, IpInfo> = HashMap::with_max_entries(sizes::IPCACHE, 0);
/// `BPF_F_MMAPABLE`: user space maps the array and stores whole words.
const BPF_F_MMAPABLE: u32 = 1 << 10;
#[map]
static NPM_IPCACHE4: Array<u64> = Array::with_max_entries(sizes::IPCACHE4_SLOTS, BPF_F_MMAPABLE);
#[map]
static NPM_CIDRS: LpmTrie<[u8; 16], u32> = LpmTrie::with_max_entries(sizes::CIDRS, 0);
#[map]
static NPM_POLICY: LpmTrie<[u8; POLICY_KEY_LEN], PolicyValue> = LpmTrie::with_max_entries(sizes::POLICY, 0);
/// `NPM_POLICY_FRONT`: buckets of four policy words (see
/// `npm_common::policy_front_word`), written by user space through a
/// shared mapping with single 64-bit stores.
#[map]
static NPM_POLICY_FRONT: Array<[u64; 4]> = Array::with_max_entries(sizes::POLICY_FRONT_BUCKETS, BPF_F_MMAPABLE);
#[map]
static NPM_CT: LruHashMap<CtKey, CtValue> = LruHashMap::with_max_entries(sizes::CT, 0);
#[map]
static NPM_CT4: LruHashMap<CtKey4, CtValue> = LruHashMap::with_max_entries(sizes::CT, 0);
#[map]
static NPM_FRAGS: LruHashMap<FragKey, FragValue> = LruHashMap::with_max_entries(sizes::FRAGS, 0);
#[map]
static NPM_COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);
#[map]
static NPM_EVENTS: RingBuf = RingBuf::with_byte_size(sizes::EVENTS_BYTES, 0);

/// Per-CPU scratch space: the parsed packet and the map keys live here, not
/// on the 512-byte BPF stack. Not pinned: between packets it only holds the
/// clock cache of [`coarse_now`] and the deny-event budget.
#[map]
static NPM_SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// The per-CPU flow cache in front of `NPM_CT4`: a direct-mapped table of
/// recently confirmed established IPv4 flows, looked up by an inlined array
/// access instead of a hash-map call. Not pinned: a cache, rebuilt from the
/// conntrack map after every load. See [`flow_cache_hit`].
#[map]
static NPM_FLOWCACHE: PerCpuArray<FlowSlot> = PerCpuArray::with_max_entries(FLOW_SLOTS, 0);

/// Slots of [`NPM_FLOWCACHE`] per CPU (a power of two).
const FLOW_SLOTS: u32 = 4096;
/// How long a flow-cache slot vouches for its flow: after this, the next
/// packet of the flow takes the conntrack lookup again (which refreshes the
/// entry's idle timer and checks its timeout) and refills the slot.
const FLOW_TTL_NS: u64 = 250_000_000;

/// One [`NPM_FLOWCACHE`] slot: the `CtKey4` of an established flow (words,
/// see [`fill_ct_key4`]) and when the conntrack lookup last confirmed it.
#[repr(C)]
struct FlowSlot {
    key: [u32; 5],
    pad: u32,
    /// Coarse clock at the confirmation; 0: empty slot.
    confirmed_ns: u64,
}

/// The per-CPU decision cache of steps 8 and 9: a direct-mapped table of
/// (endpoint, direction, protocol, port, peer address) -> reason, each
/// slot tagged with the `NPM_GENERATION` it was decided under. The loader
/// bumps the generation after every batch of writes to the maps a decision
/// reads (endpoints, ipcache, CIDRs, policy), so a slot only answers while
/// the maps are as when it was decided: exact at batch boundaries (during a
/// batch it answers with the state before the batch). The generation is a
/// plain load, ordered before the map reads on x86; see ARCHITECTURE.md for
/// weakly ordered CPUs. Not pinned.
#[map]
static NPM_DECISIONS: PerCpuArray<DecisionSlot> = PerCpuArray::with_max_entries(DECISION_SLOTS, 0);

/// Slots of [`NPM_DECISIONS`] per CPU (a power of two).
const DECISION_SLOTS: u32 = 4096;

/// One [`NPM_DECISIONS`] slot.
#[repr(C)]
struct DecisionSlot {
    key: [u32; 6],
    reason: u32,
    pad: u32,
    /// `NPM_GENERATION` at the decision; 0 never matches (no loader write yet).
    generation: u64,
}

/// The policy generation (one `u64`), bumped by the loader after every map
/// write; see [`NPM_DECISIONS`].
#[map]
static NPM_GENERATION: Array<u64> = Array::with_max_entries(1, 0);

/// Benchmark-only switch, a read-only global the loader may override at load
/// time: when 1, allowed new flows do NOT create a conntrack entry, so a
/// repeated test run measures the policy path every time. The production
/// loader never sets it; the verifier sees the frozen value 0 and prunes the
/// branch.
#[no_mangle]
static NPM_BENCH_NO_CT_CREATE: u8 = 0;

/// Benchmark-only switch like [`NPM_BENCH_NO_CT_CREATE`]: when 1, the flow
/// cache is neither read nor filled, so tracked packets measure the
/// conntrack lookup.
#[no_mangle]
static NPM_BENCH_NO_FLOW_CACHE: u8 = 0;

/// Benchmark-only switch: when 1, the decision cache is not used, so
/// policy-decided packets measure the ipcache and policy lookups.
#[no_mangle]
static NPM_BENCH_NO_DECISION_CACHE: u8 = 0;

/// Test and benchmark switch: when 1, every packet takes the general path
/// ([`classify`]), never [`fast_v4`]; the packet tables run both ways.
#[no_mangle]
static NPM_BENCH_NO_FAST_V4: u8 = 0;

/// Test and benchmark switch: when 1, step 9 always walks the LPM
/// (`NPM_POLICY`), never the policy front.
#[no_mangle]
static NPM_BENCH_NO_POLICY_FRONT: u8 = 0;

const ETH_HLEN: usize = 14;
const ETH_P_IP: u16 = 0x0800;
const ETH_P_IPV6: u16 = 0x86dd;
const TCP_FIN: u8 = 0x01;
const TCP_RST: u8 = 0x04;
const TCP_SYN: u8 = 0x02;
const TCP_ACK: u8 = 0x10;
/// Most IPv6 extension headers walked before the packet counts as malformed.
const MAX_EXT_HEADERS: usize = 8;
const FRAG_NONE: u8 = 0;
const FRAG_FIRST: u8 = 1;
const FRAG_LATER: u8 = 2;
/// Bytes 8..12 of an IPv4-mapped address (`0, 0, 0xff, 0xff`) as a
/// little-endian word.
const V4_MAPPED_WORD: u32 = 0xffff_0000;

/// What the parser learned of one packet. Every multi-byte field sits at a
/// 4-byte aligned offset, so the code moves addresses as 32-bit words:
/// byte-wise copies and `memset`/`memcpy` calls (which the BPF backend
/// emits as slow byte loops) are avoided on the hot path.
#[repr(C)]
struct Pkt {
    /// Source address (IPv4-mapped for IPv4); valid once `family != 0`.
    src: [u8; 16],
    /// Destination address.
    dst: [u8; 16],
    /// 4 or 6; 0 until parsed.
    family: u8,
    /// Upper-layer protocol (for a non-first fragment: the fragment's).
    proto: u8,
    tcp_flags: u8,
    frag: u8,
    /// Protocol stored in the fragment record (IPv4 protocol, or the next
    /// header of the IPv6 fragment header).
    frag_proto: u8,
    icmp_type: u8,
    pad: [u8; 2],
    frag_id: u32,
    sport: u16,
    dport: u16,
    /// Conntrack ports (ICMP echo: the echo id on both sides).
    ct_sport: u16,
    ct_dport: u16,
}

/// Per-CPU working state of one packet.
#[repr(C)]
struct Scratch {
    pkt: Pkt,
    hdr: [u8; 40],
    ct: CtKey,
    ct4: CtKey4,
    ctv: CtValue,
    frag: FragKey,
    fragv: FragValue,
    ev: DenyEvent,
    /// An LPM key: prefix length and up to 16 bytes of data.
    lpm: [u32; 5],
    pad: u32,
    clk: Clock,
}

/// Clock cache of [`coarse_now`] and the deny-event budget of this CPU.
#[repr(C)]
struct Clock {
    /// The jiffies value at the last clock read.
    jiffies: u64,
    /// The coarse clock read then (0: none yet).
    ns: u64,
    /// The tick whose deny events `ev_count` counts.
    ev_jiffies: u64,
    /// Deny events sent in that tick.
    ev_count: u64,
}

/// Deny events per CPU and tick (1 to 10 ms) sent to the ring buffer.
const EVENTS_PER_TICK: u64 = 32;

#[classifier]
pub fn npm_ingress(ctx: TcContext) -> i32 {
    decide(&ctx, DIR_INGRESS)
}

#[classifier]
pub fn npm_egress(ctx: TcContext) -> i32 {
    decide(&ctx, DIR_EGRESS)
}

#[classifier]
pub fn npm_empty(_ctx: TcContext) -> i32 {
    TC_ACT_UNSPEC
}

// Word access to 4-byte aligned scratch and map memory. Volatile stores keep
// LLVM from merging them into memset/memcpy calls (loads need not be).
#[inline(always)]
unsafe fn rd32(p: *const u8) -> u32 {
    core::ptr::read(p as *const u32)
}

#[inline(always)]
unsafe fn wr32(p: *mut u8, v: u32) {
    core::ptr::write_volatile(p as *mut u32, v)
}

#[inline(always)]
unsafe fn wr64(p: *mut u8, v: u64) {
    core::ptr::write_volatile(p as *mut u64, v)
}

#[inline(always)]
unsafe fn copy16(d: *mut u8, s: *const u8) {
    wr32(d, rd32(s));
    wr32(d.add(4), rd32(s.add(4)));
    wr32(d.add(8), rd32(s.add(8)));
    wr32(d.add(12), rd32(s.add(12)));
}

#[inline(always)]
unsafe fn zero16(d: *mut u8) {
    wr32(d, 0);
    wr32(d.add(4), 0);
    wr32(d.add(8), 0);
    wr32(d.add(12), 0);
}

#[inline(always)]
unsafe fn eq16(a: *const u8, b: *const u8) -> bool {
    ((rd32(a) ^ rd32(b))
        | (rd32(a.add(4)) ^ rd32(b.add(4)))
        | (rd32(a.add(8)) ^ rd32(b.add(8)))
        | (rd32(a.add(12)) ^ rd32(b.add(12))))
        == 0
}

/// (a, pa) <= (b, pb), addresses compared as big-endian numbers.
#[inline(always)]
unsafe fn le_addr_port(a: *const u8, pa: u16, b: *const u8, pb: u16) -> bool {
    let mut i = 0;
    while i < 16 {
        let x = rd32(a.add(i)).swap_bytes();
        let y = rd32(b.add(i)).swap_bytes();
        if x != y {
            return x < y;
        }
        i += 4;
    }
    pa <= pb
}

#[inline(always)]
fn be16(b0: u8, b1: u8) -> u16 {
    ((b0 as u16) << 8) | b1 as u16
}

/// Copies `N` bytes of the packet at `off` into `buf` (works on non-linear
/// skbs too); fails when the packet is shorter.
#[inline(always)]
fn load<const N: usize>(ctx: &TcContext, off: usize, buf: &mut [u8; 40]) -> Result<(), ()> {
    // SAFETY: buf has room for N <= 40 bytes.
    let r = unsafe {
        bpf_skb_load_bytes(
            ctx.skb.skb as *const c_void,
            off as u32,
            buf.as_mut_ptr() as *mut c_void,
            N as u32,
        )
    };
    if r < 0 {
        Err(())
    } else {
        Ok(())
    }
}

#[inline(always)]
fn decide(ctx: &TcContext, dir: u8) -> i32 {
    // Index 0 of a per-CPU array always exists; fail closed regardless.
    let s = match NPM_SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU memory used only by this CPU, for this packet.
        Some(s) => unsafe { &mut *s },
        None => return TC_ACT_SHOT,
    };
    // SAFETY: the context pointer is valid for the program's lifetime.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    let len = ctx.len();
    let mut ep_id = 0u32;
    let mut now = 0u64;
    let mut reason = fast_v4(ctx, dir, ifindex, s, &mut ep_id, &mut now);
    if reason == TAKE_GENERAL {
        // SAFETY: words 32..52 of Pkt (everything but the addresses).
        unsafe {
            let p = core::ptr::addr_of_mut!(s.pkt) as *mut u8;
            wr32(p.add(32), 0);
            wr32(p.add(36), 0);
            wr32(p.add(40), 0);
            wr32(p.add(44), 0);
            wr32(p.add(48), 0);
        }
        ep_id = 0;
        now = 0;
        reason = classify(ctx, dir, ifindex, s, &mut ep_id, &mut now);
    }

    if let Some(c) = NPM_COUNTERS.get_ptr_mut(counter_index(dir, reason)) {
        // SAFETY: per-CPU slot, only this CPU writes it.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len as u64;
        }
    }
    if reason < FIRST_DENY_REASON {
        return TC_ACT_UNSPEC;
    }
    // At most EVENTS_PER_TICK deny events per CPU and tick reach the ring
    // buffer (the counters above count every drop): a flood of denied
    // packets costs no ring-buffer call per packet.
    // SAFETY: plain helper call (inlined by the verifier).
    let j = unsafe { bpf_jiffies64() };
    if s.clk.ev_jiffies != j {
        s.clk.ev_jiffies = j;
        s.clk.ev_count = 0;
    }
    if s.clk.ev_count >= EVENTS_PER_TICK {
        return TC_ACT_SHOT;
    }
    s.clk.ev_count += 1;
    // The conntrack step's clock reading, when it got that far.
    let ts = if now != 0 { now } else { coarse_now(&mut s.clk) };
    // SAFETY: DenyEvent layout: ts 0, endpoint 8, ifindex 12, direction,
    // reason, protocol, family 16..20, sport 20, dport 22, src 24, dst 40.
    unsafe {
        let e = core::ptr::addr_of_mut!(s.ev) as *mut u8;
        let p = &s.pkt;
        wr64(e, ts);
        wr32(e.add(8), ep_id);
        wr32(e.add(12), ifindex);
        wr32(
            e.add(16),
            dir as u32 | (reason as u32) << 8 | (p.proto as u32) << 16 | (p.family as u32) << 24,
        );
        wr32(e.add(20), p.sport as u32 | (p.dport as u32) << 16);
        if p.family != 0 {
            copy16(e.add(24), p.src.as_ptr());
            copy16(e.add(40), p.dst.as_ptr());
        } else {
            zero16(e.add(24));
            zero16(e.add(40));
        }
    }
    // A full ring buffer loses the event, never the verdict.
    let _ = NPM_EVENTS.output::<DenyEvent>(&s.ev, 0);
    TC_ACT_SHOT
}

/// Steps 1 to 9 of the precedence; returns the reason (a `Reason` number).
#[inline(always)]
fn classify(ctx: &TcContext, dir: u8, ifindex: u32, s: &mut Scratch, ep_id: &mut u32, now_out: &mut u64) -> u8 {
    // 1. non-IP. A frame too short for an Ethernet header, or a VLAN tag that
    // could hide an IP packet, is malformed rather than non-IP.
    let data = ctx.data();
    let eth_proto = if data + ETH_HLEN <= ctx.data_end() {
        let pk = data as *const u8;
        // SAFETY: bounds checked against data_end just above.
        unsafe { be16(*pk.add(12), *pk.add(13)) }
    } else {
        match load::<2>(ctx, 12, &mut s.hdr) {
            Ok(()) => be16(s.hdr[0], s.hdr[1]),
            Err(()) => 0,
        }
    };
    let known = eth_proto == ETH_P_IP || eth_proto == ETH_P_IPV6;
    let vlan = eth_proto == 0x8100 || eth_proto == 0x88a8;
    if eth_proto != 0 && !known && !vlan {
        return Reason::NonIp as u8;
    }
    // 2. endpoint: an inlined array lookup for the usual small ifindex.
    let ep = if ifindex < sizes::ENDPOINT_SLOTS {
        match NPM_EP_SLOTS.get(ifindex) {
            Some(ep) if ep.flags & EP_PRESENT != 0 => ep,
            _ => return Reason::NoEndpoint as u8,
        }
    } else {
        // SAFETY: the value is only read.
        match unsafe { NPM_ENDPOINTS.get(&ifindex) } {
            Some(ep) => ep,
            None => return Reason::NoEndpoint as u8,
        }
    };
    *ep_id = ep.id;
    // 3. headers.
    if !known || parse(ctx, s).is_err() {
        return Reason::Malformed as u8;
    }
    let p = &s.pkt;
    let src = p.src.as_ptr();
    let dst = p.dst.as_ptr();
    // 4. ICMPv6 control (both directions), then source validation.
    if p.family == 6 && p.proto == proto::ICMPV6 && p.frag != FRAG_LATER && is_icmpv6_control(p.icmp_type) {
        return Reason::Icmpv6Control as u8;
    }
    if dir == DIR_EGRESS {
        // SAFETY: 16-byte, 4-aligned fields of scratch and map memory.
        let ok = unsafe {
            if p.family == 4 {
                ep.flags & EP_HAS_V4 != 0 && eq16(src, ep.ipv4.as_ptr())
            } else {
                ep.flags & EP_HAS_V6 != 0 && eq16(src, ep.ipv6.as_ptr())
            }
        };
        if !ok {
            return Reason::Spoofed as u8;
        }
    }
    // 5. non-first fragments.
    if p.frag == FRAG_LATER {
        fill_frag_key(&mut s.frag, ep.id, dir, p);
        // SAFETY: the value is only read.
        return match unsafe { NPM_FRAGS.get(&s.frag) } {
            Some(v) => {
                s.pkt.sport = v.sport;
                s.pkt.dport = v.dport;
                v.reason
            }
            None => Reason::Fragment as u8,
        };
    }
    // 6. conntrack.
    let now = coarse_now(&mut s.clk);
    *now_out = now;
    // Flows whose two addresses are IPv4-mapped live in NPM_CT4 (20-byte
    // key), all others in NPM_CT (44 bytes).
    // SAFETY: 16-byte, 4-aligned scratch fields.
    let v4 = p.family == 4 || unsafe { is_v4_mapped(src) && is_v4_mapped(dst) };
    // A packet the flow cache may decide: an IPv4 flow, no fragment (a
    // first fragment must be recorded), no TCP FIN or RST (they change the
    // conntrack entry's state, and clear the flow's slot).
    let closing = p.proto == proto::TCP && p.tcp_flags & (TCP_FIN | TCP_RST) != 0;
    // SAFETY: reading a read-only global.
    let use_cache = v4 && p.frag == FRAG_NONE && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FLOW_CACHE) } == 0;
    let mut slot: *mut FlowSlot = core::ptr::null_mut();
    // A TCP SYN without ACK opens a new connection: policy decides it, never
    // an older entry of the same 5-tuple, so no lookup (an allowed SYN then
    // writes a fresh entry over any old one).
    let opening = p.proto == proto::TCP && p.tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    let (src_is_lo, hit) = if opening {
        let lo = if v4 {
            fill_ct_key4(&mut s.ct4, ep.id, p)
        } else {
            fill_ct_key(&mut s.ct, ep.id, p)
        };
        (lo, None)
    } else if v4 {
        let lo = fill_ct_key4(&mut s.ct4, ep.id, p);
        if use_cache {
            let k = ct4_words(&s.ct4);
            if let Some(sl) = NPM_FLOWCACHE.get_ptr_mut(flow_slot(k)) {
                // SAFETY: this CPU's slot; 4-aligned words.
                unsafe {
                    if closing {
                        flow_cache_forget(sl, k);
                    } else if flow_cache_hit(sl, k, now) {
                        return Reason::Tracked as u8;
                    } else {
                        slot = sl;
                    }
                }
            }
        }
        (lo, NPM_CT4.get_ptr_mut(&s.ct4))
    } else {
        let lo = fill_ct_key(&mut s.ct, ep.id, p);
        (lo, NPM_CT.get_ptr_mut(&s.ct))
    };
    if let Some(v) = hit {
        if ct_continue(v, p.proto, p.tcp_flags, src_is_lo, now, slot, ct4_words(&s.ct4)) {
            let r = Reason::Tracked as u8;
            record_first_fragment(s, ep.id, dir, r);
            return r;
        }
    }
    let peer = if dir == DIR_INGRESS { src } else { dst };
    let port = match p.proto {
        proto::TCP | proto::UDP | proto::SCTP => p.dport,
        _ => 0,
    };
    let peer = Peer {
        at: peer,
        lazy_v4: false,
        v4addr: 0,
    };
    let reason = policy_step(s.lpm.as_mut_ptr() as *mut u8, ep, dir, p.proto, port, peer);
    if reason >= FIRST_DENY_REASON {
        return reason;
    }
    // Allowed by steps 7-9: track the connection.
    let (pr, tcp_flags) = (s.pkt.proto, s.pkt.tcp_flags);
    ct_create(s, v4, src_is_lo, pr, tcp_flags, dir, reason, now);
    record_first_fragment(s, ep.id, dir, reason);
    reason
}

/// The five words of a `NPM_CT4` key (the flow cache's key).
#[inline(always)]
fn ct4_words(k: &CtKey4) -> &[u32; 5] {
    // SAFETY: CtKey4 is five 4-aligned words.
    unsafe { &*(k as *const CtKey4 as *const [u32; 5]) }
}

/// Step 6 on a conntrack hit: unless the entry idled out, records what
/// this packet says of the flow (a reply, a FIN or RST), refreshes the idle
/// timer at most every 100 ms, puts an established flow into its flow-cache
/// slot (when `slot` is not null) and returns true: the packet is
/// `Tracked`. Returns false for an idled-out entry (policy decides).
#[inline(always)]
fn ct_continue(
    v: *mut CtValue,
    pr: u8,
    tcp_flags: u8,
    src_is_lo: bool,
    now: u64,
    slot: *mut FlowSlot,
    key: &[u32; 5],
) -> bool {
    // SAFETY: a map value; concurrent writers only set flag bits or the
    // timestamp, both benign races.
    let v = unsafe { &mut *v };
    let timeout = if pr == proto::TCP {
        if v.flags & CT_CLOSING != 0 {
            CT_TIMEOUT_TCP_CLOSING_NS
        } else if v.flags & CT_SEEN_REPLY == 0 {
            CT_TIMEOUT_TCP_SYN_NS
        } else {
            CT_TIMEOUT_TCP_NS
        }
    } else {
        CT_TIMEOUT_OTHER_NS
    };
    let idle = now.wrapping_sub(v.last_seen_ns);
    if idle > timeout {
        return false;
    }
    let orig_lo = v.flags & CT_ORIG_LO_TO_HI != 0;
    let mut flags = v.flags;
    if orig_lo != src_is_lo {
        flags |= CT_SEEN_REPLY;
    }
    if pr == proto::TCP && tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= CT_CLOSING;
    }
    if flags != v.flags {
        v.flags = flags;
    }
    // Refresh at most every 100 ms: keeps the cache line mostly read-only
    // (timeouts are 10 s and more).
    if idle > 100_000_000 {
        v.last_seen_ns = now;
    }
    // An established flow (replies seen, not closing) goes into the flow
    // cache: its next packets on this CPU skip the conntrack lookup.
    if !slot.is_null() && flags & (CT_SEEN_REPLY | CT_CLOSING) == CT_SEEN_REPLY {
        // SAFETY: this CPU's slot, found by the caller.
        unsafe { flow_cache_fill(slot, key, now) };
    }
    true
}

/// The peer address of steps 8 and 9: 16 bytes (4-aligned, IPv4-mapped
/// for IPv4) at `at`, or, when `lazy_v4`, the IPv4 address `v4addr`,
/// written IPv4-mapped to `lpm + 4` only when a map lookup needs its bytes
/// (then `at` is `lpm + 4`).
#[derive(Clone, Copy)]
struct Peer {
    at: *const u8,
    lazy_v4: bool,
    v4addr: u32,
}

/// Steps 7 to 9 for a packet conntrack did not allow: `NotIsolated`, or
/// the decision of the peer's identities and the policy lookups (through
/// the decision cache). `port` is the destination port (0 for protocols
/// without ports).
#[inline(always)]
fn policy_step(lpm: *mut u8, ep: &EndpointInfo, dir: u8, pr: u8, port: u16, peer: Peer) -> u8 {
    let Peer { at, lazy_v4, v4addr } = peer;
    // 7. not isolated.
    let isolated = if dir == DIR_INGRESS {
        ep.flags & EP_ISOLATED_INGRESS != 0
    } else {
        ep.flags & EP_ISOLATED_EGRESS != 0
    };
    if !isolated {
        return Reason::NotIsolated as u8;
    }
    // Steps 8 and 9 depend on the endpoint, the direction, the peer
    // address, the protocol and the port only: the decision cache answers
    // for a tuple decided before under the same generation.
    // SAFETY: reading a read-only global.
    let use_cache = unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_DECISION_CACHE) } == 0;
    let generation = match NPM_GENERATION.get(0) {
        Some(g) if use_cache => *g,
        _ => 0,
    };
    let key = if lazy_v4 {
        [
            ep.id,
            dir as u32 | (pr as u32) << 8 | (port as u32) << 16,
            0,
            0,
            V4_MAPPED_WORD,
            v4addr,
        ]
    } else {
        // SAFETY: 16-byte, 4-aligned peer address.
        unsafe { decision_key(ep.id, dir, pr, port, at) }
    };
    let key = &key;
    // A null slot: no cache (raw pointers and a sentinel rather than
    // Options: LLVM may otherwise read an undefined payload register, which
    // the verifier rejects).
    let slot: *mut DecisionSlot = if generation != 0 {
        NPM_DECISIONS
            .get_ptr_mut(decision_slot(key))
            .unwrap_or(core::ptr::null_mut())
    } else {
        core::ptr::null_mut()
    };
    // SAFETY: this CPU's slot, when not null.
    let cached = if slot.is_null() {
        NO_DECISION
    } else {
        unsafe { decision_cache_get(slot, key, generation) }
    };
    if cached != NO_DECISION {
        return cached;
    }
    let r = evaluate_policy(lpm, ep, dir, pr, port, peer);
    if !slot.is_null() {
        // SAFETY: this CPU's slot.
        unsafe { decision_cache_put(slot, key, generation, r) };
    }
    r
}

/// Creates the conntrack entry of a new connection allowed by steps 7 to 9
/// (in `NPM_CT4` from `s.ct4` when `v4`, else in `NPM_CT` from `s.ct`);
/// a fresh entry replaces an older one of the same key.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn ct_create(s: &mut Scratch, v4: bool, src_is_lo: bool, pr: u8, tcp_flags: u8, dir: u8, reason: u8, now: u64) {
    // SAFETY: reading a read-only global.
    if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_CT_CREATE) } != 0 {
        return;
    }
    let mut flags = if src_is_lo { CT_ORIG_LO_TO_HI } else { 0 };
    if pr == proto::TCP && tcp_flags & (TCP_FIN | TCP_RST) != 0 {
        flags |= CT_CLOSING;
    }
    // SAFETY: CtValue layout: last_seen 0, created 8, origin_direction,
    // flags, reason, pad 16..24.
    unsafe {
        let v = core::ptr::addr_of_mut!(s.ctv) as *mut u8;
        wr64(v, now);
        wr64(v.add(8), now);
        wr32(v.add(16), dir as u32 | (flags as u32) << 8 | (reason as u32) << 16);
        wr32(v.add(20), 0);
    }
    let _ = if v4 {
        NPM_CT4.insert(&s.ct4, &s.ctv, 0)
    } else {
        NPM_CT.insert(&s.ct, &s.ctv, 0)
    };
}

/// [`fast_v4`]'s answer for a packet it leaves to [`classify`].
const TAKE_GENERAL: u8 = 0xfe;

/// The IPv4 fast path: the same steps as [`classify`] for the common packet
/// (Ethernet, IPv4 without options or fragmentation, TCP or UDP, the
/// first 54 bytes linear, an endpoint in `NPM_EP_SLOTS`, a valid source on
/// egress, no TCP FIN or RST), with the packet's fields in registers
/// rather than in scratch memory: an established flow costs the parse, the
/// endpoint slot and the flow-cache slot. Returns the reason, or
/// [`TAKE_GENERAL`] (having changed nothing) for any other packet.
/// `s.pkt` is filled only for a denied packet (its deny event).
///
/// `ebpf_packets.rs` runs its tables with this path switched off too
/// (`NPM_BENCH_NO_FAST_V4`): both paths give every row the same verdict.
#[inline(always)]
fn fast_v4(ctx: &TcContext, dir: u8, ifindex: u32, s: &mut Scratch, ep_id: &mut u32, now_out: &mut u64) -> u8 {
    // SAFETY: reading a read-only global.
    if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FAST_V4) } != 0 {
        return TAKE_GENERAL;
    }
    let data = ctx.data();
    if data + 54 > ctx.data_end() || ifindex >= sizes::ENDPOINT_SLOTS {
        return TAKE_GENERAL;
    }
    let pk = data as *const u8;
    // SAFETY: 54 bytes are in bounds (checked just above); unaligned 32-bit
    // packet reads as in `parse_fast`.
    // Whole 32-bit words of the headers, read little-endian (the byte at
    // the lowest offset is the lowest byte of the word).
    let (saddr, daddr, pr, sport, dport, tcp_flags) = unsafe {
        // Bytes 12..15: ethertype 0x0800, version 4 with a 20-byte header.
        if rd32(pk.add(12)) & 0x00ff_ffff != 0x0045_0008 {
            return TAKE_GENERAL;
        }
        let w16 = rd32(pk.add(16));
        let tot = (((w16 & 0xff) << 8) | ((w16 >> 8) & 0xff)) as usize;
        // Bytes 20..23: no fragment (MF clear, offset 0), then the protocol.
        let w20 = rd32(pk.add(20));
        if w20 & 0xff3f != 0 || tot < 20 || (ctx.len() as usize) < ETH_HLEN + tot {
            return TAKE_GENERAL;
        }
        let pr = (w20 >> 24) as u8;
        let mut fl = 0u8;
        if pr == proto::TCP {
            // Bytes 44..47: the data offset at 46, the flags at 47.
            let w44 = rd32(pk.add(44));
            fl = (w44 >> 24) as u8;
            if (w44 >> 20) & 0xf < 5 || fl & (TCP_FIN | TCP_RST) != 0 {
                return TAKE_GENERAL;
            }
        } else if pr != proto::UDP {
            return TAKE_GENERAL;
        }
        // Bytes 34..37: the ports, each big-endian.
        let w34 = rd32(pk.add(34));
        (
            rd32(pk.add(26)),
            rd32(pk.add(30)),
            pr,
            (((w34 & 0xff) << 8) | ((w34 >> 8) & 0xff)) as u16,
            (((w34 >> 16) & 0xff) << 8 | (w34 >> 24)) as u16,
            fl,
        )
    };
    let ep = match NPM_EP_SLOTS.get(ifindex) {
        Some(ep) if ep.flags & EP_PRESENT != 0 => ep,
        _ => return TAKE_GENERAL,
    };
    if dir == DIR_EGRESS {
        let a = ep.ipv4.as_ptr();
        // SAFETY: 16-byte, 4-aligned map field.
        let own = ep.flags & EP_HAS_V4 != 0
            && unsafe {
                (rd32(a) | rd32(a.add(4)) | (rd32(a.add(8)) ^ V4_MAPPED_WORD) | (rd32(a.add(12)) ^ saddr)) == 0
            };
        if !own {
            return TAKE_GENERAL;
        }
    }
    *ep_id = ep.id;
    // 6. conntrack, with the key of `fill_ct_key4` in registers.
    let now = coarse_now(&mut s.clk);
    *now_out = now;
    let (x, y) = (saddr.swap_bytes(), daddr.swap_bytes());
    let src_is_lo = if x != y { x < y } else { sport <= dport };
    let key: [u32; 5] = if src_is_lo {
        [ep.id, pr as u32, saddr, daddr, sport as u32 | (dport as u32) << 16]
    } else {
        [ep.id, pr as u32, daddr, saddr, dport as u32 | (sport as u32) << 16]
    };
    let opening = pr == proto::TCP && tcp_flags & (TCP_SYN | TCP_ACK) == TCP_SYN;
    if !opening {
        let mut slot: *mut FlowSlot = core::ptr::null_mut();
        // SAFETY: reading a read-only global.
        if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_FLOW_CACHE) } == 0 {
            if let Some(sl) = NPM_FLOWCACHE.get_ptr_mut(flow_slot(&key)) {
                // SAFETY: this CPU's slot.
                if unsafe { flow_cache_hit(sl, &key, now) } {
                    return Reason::Tracked as u8;
                }
                slot = sl;
            }
        }
        store_ct4(&mut s.ct4, &key);
        if let Some(v) = NPM_CT4.get_ptr_mut(&s.ct4) {
            if ct_continue(v, pr, tcp_flags, src_is_lo, now, slot, &key) {
                return Reason::Tracked as u8;
            }
        }
    }
    // Steps 7 to 9 with the peer in a register.
    let lpm = s.lpm.as_mut_ptr() as *mut u8;
    let peer = Peer {
        // SAFETY: lpm is 20 bytes.
        at: unsafe { lpm.add(4) },
        lazy_v4: true,
        v4addr: if dir == DIR_INGRESS { saddr } else { daddr },
    };
    let reason = policy_step(lpm, ep, dir, pr, dport, peer);
    if reason >= FIRST_DENY_REASON {
        // The deny event reads the packet from scratch.
        fill_pkt_v4(&mut s.pkt, saddr, daddr, pr, tcp_flags, sport, dport);
        return reason;
    }
    store_ct4(&mut s.ct4, &key);
    ct_create(s, true, src_is_lo, pr, tcp_flags, dir, reason, now);
    reason
}

/// Writes a `NPM_CT4` key's words.
#[inline(always)]
fn store_ct4(k: &mut CtKey4, key: &[u32; 5]) {
    // SAFETY: CtKey4 is five 4-aligned words.
    unsafe {
        let k = k as *mut CtKey4 as *mut u8;
        wr32(k, key[0]);
        wr32(k.add(4), key[1]);
        wr32(k.add(8), key[2]);
        wr32(k.add(12), key[3]);
        wr32(k.add(16), key[4]);
    }
}

/// Fills the parsed packet of an IPv4 packet [`fast_v4`] decided (for its
/// deny event).
#[inline(always)]
fn fill_pkt_v4(p: &mut Pkt, saddr: u32, daddr: u32, pr: u8, tcp_flags: u8, sport: u16, dport: u16) {
    // SAFETY: 4-aligned fields of the repr(C) Pkt (words 32..52 are the
    // family, protocol, flags, fragment id and ports).
    unsafe {
        let p = p as *mut Pkt as *mut u8;
        wr32(p, 0);
        wr32(p.add(4), 0);
        wr32(p.add(8), V4_MAPPED_WORD);
        wr32(p.add(12), saddr);
        wr32(p.add(16), 0);
        wr32(p.add(20), 0);
        wr32(p.add(24), V4_MAPPED_WORD);
        wr32(p.add(28), daddr);
        wr32(p.add(32), 4 | (pr as u32) << 8 | (tcp_flags as u32) << 16);
        wr32(p.add(36), 0);
        wr32(p.add(40), 0);
        wr32(p.add(44), sport as u32 | (dport as u32) << 16);
        wr32(p.add(48), sport as u32 | (dport as u32) << 16);
    }
}

/// The flow-cache slot of a `NPM_CT4` key: a multiplicative hash of its
/// words (the key is canonical, so both directions share the slot).
#[inline(always)]
fn flow_slot(w: &[u32; 5]) -> u32 {
    let a = (w[2] ^ w[4].rotate_left(16)).wrapping_mul(0x9e37_79b1);
    let b = (w[3] ^ w[0] ^ (w[1] << 24)).wrapping_mul(0x85eb_ca77);
    ((a ^ b) >> 16) & (FLOW_SLOTS - 1)
}

/// Step 6's fast path: the slot holds exactly this flow's key and was
/// confirmed by a conntrack hit less than [`FLOW_TTL_NS`] ago.
///
/// What the cache may change: a flow whose conntrack entry disappears (LRU
/// eviction, or the loader's purge of a removed endpoint) keeps passing on
/// this CPU until the slot's confirmation is [`FLOW_TTL_NS`] old. Endpoint
/// ids are never reused, so a purged endpoint's slots match no live
/// endpoint. Everything else is as the conntrack entry says: only flows
/// with replies seen and not closing are cached, FIN/RST packets and
/// fragments always take the conntrack path (a FIN or RST also empties the
/// flow's slot), and the conntrack entry is refreshed by the packet that
/// refills the slot.
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
unsafe fn flow_cache_hit(slot: *const FlowSlot, k: &[u32; 5], now: u64) -> bool {
    let confirmed = (*slot).confirmed_ns;
    flow_slot_holds(slot, k) && confirmed != 0 && now.wrapping_sub(confirmed) < FLOW_TTL_NS
}

/// Whether the slot holds exactly this key.
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
unsafe fn flow_slot_holds(slot: *const FlowSlot, w: &[u32; 5]) -> bool {
    let sl = &*slot;
    ((sl.key[0] ^ w[0]) | (sl.key[1] ^ w[1]) | (sl.key[2] ^ w[2]) | (sl.key[3] ^ w[3]) | (sl.key[4] ^ w[4])) == 0
}

/// Empties the slot if it holds this key (a FIN or RST of the flow: its
/// next packets take the conntrack path, which knows it is closing).
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
unsafe fn flow_cache_forget(slot: *mut FlowSlot, k: &[u32; 5]) {
    if flow_slot_holds(slot, k) {
        wr64((slot as *mut u8).add(24), 0);
    }
}

/// Stores an established flow's key in its flow-cache slot.
///
/// # Safety
/// `slot` points to this CPU's `NPM_FLOWCACHE` slot.
#[inline(always)]
unsafe fn flow_cache_fill(slot: *mut FlowSlot, w: &[u32; 5], now: u64) {
    let d = slot as *mut u8;
    wr32(d, w[0]);
    wr32(d.add(4), w[1]);
    wr32(d.add(8), w[2]);
    wr32(d.add(12), w[3]);
    wr32(d.add(16), w[4]);
    wr64(d.add(24), now);
}

/// Steps 8 and 9 for an isolated endpoint: the peer's identities (ipcache,
/// else the CIDR trie) and the policy lookups. Returns `Host`, `Policy` or
/// `PolicyDenied`.
#[inline(always)]
fn evaluate_policy(lpm: *mut u8, ep: &EndpointInfo, dir: u8, pr: u8, port: u16, peer: Peer) -> u8 {
    let Peer {
        at: peer,
        lazy_v4,
        v4addr,
    } = peer;
    // SAFETY: 16-byte, 4-aligned address (not read when lazy).
    let (v4, addr) = if lazy_v4 {
        (true, v4addr)
    } else {
        unsafe { (is_v4_mapped(peer), rd32(peer.add(12))) }
    };
    // The IPv4 front first: one inlined array read of a whole word.
    let slot_word = if v4 {
        match NPM_IPCACHE4.get(ipcache4_slot(addr)) {
            Some(w) => {
                // SAFETY: an 8-aligned array value, stored whole by user space.
                let w = unsafe { core::ptr::read_volatile(w) };
                if w as u32 == addr && w >> 32 != 0 {
                    w
                } else {
                    0
                }
            }
            None => 0,
        }
    } else {
        0
    };
    if slot_word == 0 && lazy_v4 {
        // SAFETY: lpm is 20 bytes; the mapped address goes to 4..20.
        unsafe {
            let d = lpm.add(4);
            wr32(d, 0);
            wr32(d.add(4), 0);
            wr32(d.add(8), V4_MAPPED_WORD);
            wr32(d.add(12), v4addr);
        }
    }
    let info = if slot_word != 0 {
        None
    } else {
        // SAFETY: IpKey is repr(C) around exactly 16 address bytes.
        unsafe { NPM_IPCACHE.get(&*(peer as *const IpKey)) }
    };
    let (identity, cidr_identity) = match info {
        _ if slot_word != 0 => {
            let (_, i) = ipcache4_unpack(slot_word);
            (i.identity, i.cidr_identity)
        }
        Some(i) => (i.identity, i.cidr_identity),
        None => {
            // SAFETY: lpm is 20 bytes: prefix length and 16 bytes (when
            // lazy, `peer` is already those 16 bytes).
            let cidr = unsafe {
                wr32(lpm, 128);
                if !lazy_v4 {
                    copy16(lpm.add(4), peer);
                }
                NPM_CIDRS.get(&*(lpm as *const Key<[u8; 16]>)).copied()
            };
            (IDENTITY_WORLD, cidr.unwrap_or(IDENTITY_ANY))
        }
    };
    if dir == DIR_INGRESS && identity == IDENTITY_HOST {
        // 8. host.
        return Reason::Host as u8;
    }
    // 9. policy.
    let id = ep.id;
    let f = ep.flags;
    // The front when the direction's policy is complete there, else the LPM.
    // SAFETY: reading a read-only global.
    let front =
        f & (EP_FRONT_INGRESS << dir) != 0 && unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_POLICY_FRONT) } == 0;
    let exact_only = f & (EP_FRONT_EXACT_INGRESS << dir) != 0;
    // (A plain function, not a closure: LLVM compiles a closure into a
    // BPF-to-BPF call.)
    let (l, x) = (front, exact_only);
    // A lookup the endpoint's EP_NO_*_PEER_* flags rule out is skipped: it
    // could not hit.
    if (may_match(f, dir, identity) && lookup(lpm, l, x, id, dir, identity, pr, port))
        || (cidr_identity != IDENTITY_ANY
            && may_match(f, dir, cidr_identity)
            && lookup(lpm, l, x, id, dir, cidr_identity, pr, port))
        || (may_match(f, dir, IDENTITY_ANY) && lookup(lpm, l, x, id, dir, IDENTITY_ANY, pr, port))
    {
        Reason::Policy as u8
    } else {
        Reason::PolicyDenied as u8
    }
}

/// The decision-cache key: endpoint, direction|protocol|port, peer
/// address (4 words).
///
/// # Safety
/// `peer` is a 16-byte, 4-aligned address.
#[inline(always)]
unsafe fn decision_key(ep: u32, dir: u8, pr: u8, port: u16, peer: *const u8) -> [u32; 6] {
    [
        ep,
        dir as u32 | (pr as u32) << 8 | (port as u32) << 16,
        rd32(peer),
        rd32(peer.add(4)),
        rd32(peer.add(8)),
        rd32(peer.add(12)),
    ]
}

/// The decision-cache slot of a key.
#[inline(always)]
fn decision_slot(w: &[u32; 6]) -> u32 {
    let a = (w[5] ^ w[1].rotate_left(16)).wrapping_mul(0x9e37_79b1);
    let b = (w[0] ^ w[2] ^ w[3] ^ w[4]).wrapping_mul(0x85eb_ca77);
    ((a ^ b) >> 16) & (DECISION_SLOTS - 1)
}

/// [`decision_cache_get`]'s miss.
const NO_DECISION: u8 = 0xff;

/// The cached decision for `key` if the slot holds it under `generation`,
/// else [`NO_DECISION`].
///
/// # Safety
/// `slot` points to this CPU's `NPM_DECISIONS` slot.
#[inline(always)]
unsafe fn decision_cache_get(slot: *const DecisionSlot, w: &[u32; 6], generation: u64) -> u8 {
    let sl = &*slot;
    let diff = (sl.key[0] ^ w[0])
        | (sl.key[1] ^ w[1])
        | (sl.key[2] ^ w[2])
        | (sl.key[3] ^ w[3])
        | (sl.key[4] ^ w[4])
        | (sl.key[5] ^ w[5]);
    if diff == 0 && sl.generation == generation {
        sl.reason as u8
    } else {
        NO_DECISION
    }
}

/// Stores a decision made under `generation`.
///
/// # Safety
/// `slot` points to this CPU's `NPM_DECISIONS` slot.
#[inline(always)]
unsafe fn decision_cache_put(slot: *mut DecisionSlot, w: &[u32; 6], generation: u64, reason: u8) {
    let d = slot as *mut u8;
    wr32(d, w[0]);
    wr32(d.add(4), w[1]);
    wr32(d.add(8), w[2]);
    wr32(d.add(12), w[3]);
    wr32(d.add(16), w[4]);
    wr32(d.add(20), w[5]);
    wr32(d.add(24), reason as u32);
    wr64(d.add(32), generation);
}

/// Whether some policy entry of the endpoint (flags `ep_flags`) in
/// direction `dir` may have `identity` as its peer.
#[inline(always)]
fn may_match(ep_flags: u32, dir: u8, identity: u32) -> bool {
    ep_flags & (ep_no_peer_flag(identity) << dir) == 0
}

/// `bpf_ktime_get_coarse_ns`, read at most once per jiffy and CPU: the
/// coarse clock only moves when the tick updates the timekeeper (and
/// jiffies), and `bpf_jiffies64` is inlined by the verifier while the clock
/// helper is a real call. The cached value is at most one tick old, the
/// resolution of the coarse clock anyway.
#[inline(always)]
fn coarse_now(c: &mut Clock) -> u64 {
    // SAFETY: plain helper call.
    let j = unsafe { bpf_jiffies64() };
    if j == c.jiffies && c.ns != 0 {
        return c.ns;
    }
    // SAFETY: plain helper call.
    let now = unsafe { bpf_ktime_get_coarse_ns() };
    // SAFETY: 8-aligned fields of per-CPU scratch. The value goes first: a
    // nested run between the stores sees a stale jiffies value and reads
    // the clock itself.
    unsafe {
        wr64(core::ptr::addr_of_mut!(c.ns) as *mut u8, now);
        wr64(core::ptr::addr_of_mut!(c.jiffies) as *mut u8, j);
    }
    now
}

#[inline(always)]
fn is_icmpv6_control(t: u8) -> bool {
    (130..=137).contains(&t) || t == 143
}

/// Looks up the fully specified policy key (see `PolicyKey`): endpoint,
/// direction, identity, protocol and port in network order, prefix 96.
#[inline(always)]
fn policy_allows(lpm: *mut u8, ep: u32, dir: u8, identity: u32, protocol: u8, port: u16) -> bool {
    let i = identity;
    // SAFETY: lpm is 20 bytes; the key is 16 (`bpf_lpm_trie_key` + 12).
    unsafe {
        wr32(lpm, POLICY_PREFIX_FULL);
        wr32(lpm.add(4), ep.to_be());
        wr32(
            lpm.add(8),
            dir as u32 | ((i >> 24) & 0xff) << 8 | ((i >> 16) & 0xff) << 16 | ((i >> 8) & 0xff) << 24,
        );
        wr32(
            lpm.add(12),
            (i & 0xff) | (protocol as u32) << 8 | ((port >> 8) as u32) << 16 | ((port & 0xff) as u32) << 24,
        );
        NPM_POLICY.get(&*(lpm as *const Key<[u8; POLICY_KEY_LEN]>)).is_some()
    }
}

/// One identity's lookup of step 9: in the policy front when `front`, else
/// in the LPM.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn lookup(lpm: *mut u8, front: bool, exact_only: bool, ep: u32, dir: u8, identity: u32, pr: u8, port: u16) -> bool {
    if front {
        front_allows(ep, dir, identity, pr, port, exact_only)
    } else {
        policy_allows(lpm, ep, dir, identity, pr, port)
    }
}

/// Whether `NPM_POLICY_FRONT` holds the word (one bucket of four words).
#[inline(always)]
fn front_has(word: u64) -> bool {
    match NPM_POLICY_FRONT.get(policy_front_bucket(word)) {
        Some(b) => {
            let b = b.as_ptr();
            // SAFETY: four 8-aligned words of the bucket; volatile: user
            // space stores them concurrently (whole words).
            unsafe {
                (core::ptr::read_volatile(b) == word)
                    | (core::ptr::read_volatile(b.add(1)) == word)
                    | (core::ptr::read_volatile(b.add(2)) == word)
                    | (core::ptr::read_volatile(b.add(3)) == word)
            }
        }
        None => false,
    }
}

/// Step 9's lookup of one peer identity in the policy front, for an
/// endpoint direction whose policy is complete there: the exact port, then
/// (unless `exact_only`) any port of the protocol and any protocol. The
/// same answer as [`policy_allows`] on the LPM: an LPM entry is an aligned
/// port block, which the front holds port by port.
#[inline(always)]
fn front_allows(ep: u32, dir: u8, identity: u32, protocol: u8, port: u16, exact_only: bool) -> bool {
    // Out of the word's ranges no front word can be meant (the loader never
    // marks such an endpoint, or a direction with such a peer, complete):
    // no allow, rather than a word whose bits spill into other fields.
    // Endpoint 0 is never used (its any-protocol word for peer ANY would be
    // 0, an empty slot).
    if identity >= POLICY_FRONT_MAX_IDENTITY || ep == 0 || ep >= POLICY_FRONT_MAX_ENDPOINT {
        return false;
    }
    let code = policy_front_proto(protocol);
    if code != 0 && front_has(policy_front_word(ep, dir, identity, code, true, port)) {
        return true;
    }
    if exact_only {
        return false;
    }
    (code != 0 && front_has(policy_front_word(ep, dir, identity, code, false, 0)))
        || front_has(policy_front_word(ep, dir, identity, 0, false, 0))
}

/// FragKey layout: endpoint 0, id 4, protocol and direction 8, src 12, dst 28.
#[inline(always)]
fn fill_frag_key(k: &mut FragKey, ep: u32, dir: u8, p: &Pkt) {
    // SAFETY: offsets of the repr(C) FragKey.
    unsafe {
        let k = k as *mut FragKey as *mut u8;
        wr32(k, ep);
        wr32(k.add(4), p.frag_id);
        wr32(k.add(8), p.frag_proto as u32 | (dir as u32) << 8);
        copy16(k.add(12), p.src.as_ptr());
        copy16(k.add(28), p.dst.as_ptr());
    }
}

#[inline(always)]
fn record_first_fragment(s: &mut Scratch, ep: u32, dir: u8, reason: u8) {
    if s.pkt.frag == FRAG_FIRST {
        fill_frag_key(&mut s.frag, ep, dir, &s.pkt);
        // SAFETY: FragValue layout: sport 0, dport 2, reason 4, pad 5..8.
        unsafe {
            let v = core::ptr::addr_of_mut!(s.fragv) as *mut u8;
            wr32(v, s.pkt.sport as u32 | (s.pkt.dport as u32) << 16);
            wr32(v.add(4), reason as u32);
        }
        let _ = NPM_FRAGS.insert(&s.frag, &s.fragv, 0);
    }
}

/// Fills the canonical conntrack key (CtKey layout: endpoint 0, protocol
/// and pad 4, addr_lo 8, addr_hi 24, port_lo 40, port_hi 42); returns
/// whether the packet's source is the key's `lo` side.
#[inline(always)]
fn fill_ct_key(k: &mut CtKey, ep: u32, p: &Pkt) -> bool {
    let src = p.src.as_ptr();
    let dst = p.dst.as_ptr();
    // SAFETY: offsets of the repr(C) CtKey; 4-aligned addresses.
    unsafe {
        let src_is_lo = le_addr_port(src, p.ct_sport, dst, p.ct_dport);
        let k = k as *mut CtKey as *mut u8;
        wr32(k, ep);
        wr32(k.add(4), p.proto as u32);
        if src_is_lo {
            copy16(k.add(8), src);
            copy16(k.add(24), dst);
            wr32(k.add(40), p.ct_sport as u32 | (p.ct_dport as u32) << 16);
        } else {
            copy16(k.add(8), dst);
            copy16(k.add(24), src);
            wr32(k.add(40), p.ct_dport as u32 | (p.ct_sport as u32) << 16);
        }
        src_is_lo
    }
}

/// Whether the 16-byte, 4-aligned address at `a` is IPv4-mapped.
#[inline(always)]
unsafe fn is_v4_mapped(a: *const u8) -> bool {
    (rd32(a) | rd32(a.add(4)) | (rd32(a.add(8)) ^ V4_MAPPED_WORD)) == 0
}

/// Fills the canonical `NPM_CT4` key (CtKey4 layout: endpoint 0, protocol
/// and pad 4, addr_lo 8, addr_hi 12, port_lo 16, port_hi 18) of a packet
/// whose addresses are both IPv4-mapped; returns whether the packet's source
/// is the key's `lo` side. Same order as [`fill_ct_key`]: the mapped
/// prefixes are equal, so the last 4 bytes decide.
#[inline(always)]
fn fill_ct_key4(k: &mut CtKey4, ep: u32, p: &Pkt) -> bool {
    // SAFETY: offsets of the repr(C) CtKey4; 4-aligned addresses.
    unsafe {
        let s = rd32(p.src.as_ptr().add(12));
        let d = rd32(p.dst.as_ptr().add(12));
        let (x, y) = (s.swap_bytes(), d.swap_bytes());
        let src_is_lo = if x != y { x < y } else { p.ct_sport <= p.ct_dport };
        let k = k as *mut CtKey4 as *mut u8;
        wr32(k, ep);
        wr32(k.add(4), p.proto as u32);
        if src_is_lo {
            wr32(k.add(8), s);
            wr32(k.add(12), d);
            wr32(k.add(16), p.ct_sport as u32 | (p.ct_dport as u32) << 16);
        } else {
            wr32(k.add(8), d);
            wr32(k.add(12), s);
            wr32(k.add(16), p.ct_dport as u32 | (p.ct_sport as u32) << 16);
        }
        src_is_lo
    }
}

/// Fast path of [`parse`]: reads the headers in place (direct packet
/// access) when the frame is IPv4 without options or fragmentation, or IPv6
/// without extension headers, carries TCP, UDP, SCTP or ICMP/ICMPv6, and
/// the first 54 (IPv4) or 74 (IPv6) bytes are in the linear area. Returns
/// false, having changed nothing the slow path relies on, for anything else.
#[inline(always)]
fn parse_fast(ctx: &TcContext, p: &mut Pkt) -> bool {
    let len = ctx.len() as usize;
    let data = ctx.data();
    let end = ctx.data_end();
    if data + 54 > end {
        return false;
    }
    let pk = data as *const u8;
    // SAFETY: every read below is within the bounds checked against
    // data_end (54 bytes, or 74 after the second check). Unaligned 32-bit
    // packet reads are fine: the kernel only enforces packet alignment on
    // architectures without efficient unaligned access.
    unsafe {
        let ethertype = be16(*pk.add(12), *pk.add(13));
        let l4: *const u8;
        if ethertype == ETH_P_IP && *pk.add(14) == 0x45 {
            let tot = be16(*pk.add(16), *pk.add(17)) as usize;
            let fo = be16(*pk.add(20), *pk.add(21));
            let pr = *pk.add(23);
            if fo & 0x3fff != 0 || tot < 20 || len < ETH_HLEN + tot {
                return false;
            }
            if !(pr == proto::TCP || pr == proto::UDP || pr == proto::SCTP || pr == proto::ICMP) {
                return false;
            }
            p.family = 4;
            p.proto = pr;
            let sp = p.src.as_mut_ptr();
            let dp = p.dst.as_mut_ptr();
            wr32(sp, 0);
            wr32(sp.add(4), 0);
            wr32(sp.add(8), V4_MAPPED_WORD);
            wr32(sp.add(12), rd32(pk.add(26)));
            wr32(dp, 0);
            wr32(dp.add(4), 0);
            wr32(dp.add(8), V4_MAPPED_WORD);
            wr32(dp.add(12), rd32(pk.add(30)));
            l4 = pk.add(34);
        } else if ethertype == ETH_P_IPV6 {
            if data + 74 > end || *pk.add(14) >> 4 != 6 {
                return false;
            }
            let payload = be16(*pk.add(18), *pk.add(19)) as usize;
            let pr = *pk.add(20);
            if len < ETH_HLEN + 40 + payload {
                return false;
            }
            if !(pr == proto::TCP || pr == proto::UDP || pr == proto::SCTP || pr == proto::ICMPV6) {
                return false;
            }
            p.family = 6;
            p.proto = pr;
            let sp = p.src.as_mut_ptr();
            let dp = p.dst.as_mut_ptr();
            wr32(sp, rd32(pk.add(22)));
            wr32(sp.add(4), rd32(pk.add(26)));
            wr32(sp.add(8), rd32(pk.add(30)));
            wr32(sp.add(12), rd32(pk.add(34)));
            wr32(dp, rd32(pk.add(38)));
            wr32(dp.add(4), rd32(pk.add(42)));
            wr32(dp.add(8), rd32(pk.add(46)));
            wr32(dp.add(12), rd32(pk.add(50)));
            l4 = pk.add(54);
        } else {
            return false;
        }
        // 20 bytes of L4 header are in bounds on both paths.
        let pr = p.proto;
        if pr == proto::ICMP || pr == proto::ICMPV6 {
            let t = *l4;
            p.icmp_type = t;
            let echo = if pr == proto::ICMP {
                t == 8 || t == 0
            } else {
                t == 128 || t == 129
            };
            if echo {
                let id = be16(*l4.add(4), *l4.add(5));
                p.ct_sport = id;
                p.ct_dport = id;
            }
            return true;
        }
        if pr == proto::TCP {
            if *l4.add(12) >> 4 < 5 {
                // Malformed: let the slow path decide it.
                p.family = 0;
                return false;
            }
            p.tcp_flags = *l4.add(13);
        }
        let sport = be16(*l4, *l4.add(1));
        let dport = be16(*l4.add(2), *l4.add(3));
        p.sport = sport;
        p.dport = dport;
        p.ct_sport = sport;
        p.ct_dport = dport;
    }
    true
}

/// Parses IPv4/IPv6 and the L4 header into `s.pkt`.
#[inline(always)]
fn parse(ctx: &TcContext, s: &mut Scratch) -> Result<(), ()> {
    if parse_fast(ctx, &mut s.pkt) {
        return Ok(());
    }
    let len = ctx.len() as usize;
    let h = &mut s.hdr;
    let p = &mut s.pkt;
    load::<1>(ctx, ETH_HLEN, h)?;
    let version = h[0] >> 4;
    let l4off: usize;
    if version == 4 {
        load::<20>(ctx, ETH_HLEN, h)?;
        let ihl = ((h[0] & 0x0f) as usize) * 4;
        let tot = be16(h[2], h[3]) as usize;
        if ihl < 20 || tot < ihl || len < ETH_HLEN + tot {
            return Err(());
        }
        p.family = 4;
        p.proto = h[9];
        p.frag_proto = h[9];
        // SAFETY: 4-aligned 16-byte fields and header offsets 12 and 16.
        unsafe {
            let sp = p.src.as_mut_ptr();
            let dp = p.dst.as_mut_ptr();
            wr32(sp, 0);
            wr32(sp.add(4), 0);
            wr32(sp.add(8), V4_MAPPED_WORD);
            wr32(sp.add(12), rd32(h.as_ptr().add(12)));
            wr32(dp, 0);
            wr32(dp.add(4), 0);
            wr32(dp.add(8), V4_MAPPED_WORD);
            wr32(dp.add(12), rd32(h.as_ptr().add(16)));
        }
        let fo = be16(h[6], h[7]);
        if fo & 0x1fff != 0 {
            p.frag = FRAG_LATER;
        } else if fo & 0x2000 != 0 {
            p.frag = FRAG_FIRST;
        }
        p.frag_id = be16(h[4], h[5]) as u32;
        l4off = ETH_HLEN + ihl;
    } else if version == 6 {
        load::<40>(ctx, ETH_HLEN, h)?;
        let payload = be16(h[4], h[5]) as usize;
        if len < ETH_HLEN + 40 + payload {
            return Err(());
        }
        p.family = 6;
        // SAFETY: 4-aligned 16-byte fields and header offsets 8 and 24.
        unsafe {
            copy16(p.src.as_mut_ptr(), h.as_ptr().add(8));
            copy16(p.dst.as_mut_ptr(), h.as_ptr().add(24));
        }
        let mut nh = h[6];
        let mut off = ETH_HLEN + 40;
        let mut done = false;
        // One more round than headers allowed: it finds the upper layer.
        for _ in 0..=MAX_EXT_HEADERS {
            match nh {
                0 | 43 | 60 => {
                    load::<2>(ctx, off, h)?;
                    nh = h[0];
                    off += (h[1] as usize + 1) * 8;
                }
                51 => {
                    load::<2>(ctx, off, h)?;
                    nh = h[0];
                    off += (h[1] as usize + 2) * 4;
                }
                44 => {
                    if p.frag != FRAG_NONE {
                        return Err(());
                    }
                    load::<8>(ctx, off, h)?;
                    nh = h[0];
                    let fo = be16(h[2], h[3]);
                    p.frag_proto = h[0];
                    p.frag_id = u32::from_be_bytes([h[4], h[5], h[6], h[7]]);
                    off += 8;
                    if fo >> 3 != 0 {
                        // Later fragment: what follows is not a header.
                        p.frag = FRAG_LATER;
                        done = true;
                        break;
                    } else if fo & 1 != 0 {
                        p.frag = FRAG_FIRST;
                    }
                }
                _ => {
                    done = true;
                    break;
                }
            }
        }
        if !done {
            return Err(());
        }
        p.proto = nh;
        l4off = off;
    } else {
        return Err(());
    }
    if p.frag == FRAG_LATER {
        return Ok(());
    }
    match p.proto {
        proto::TCP => {
            load::<20>(ctx, l4off, h)?;
            if h[12] >> 4 < 5 {
                return Err(());
            }
            p.tcp_flags = h[13];
        }
        proto::UDP => load::<8>(ctx, l4off, h)?,
        proto::SCTP => load::<12>(ctx, l4off, h)?,
        proto::ICMP | proto::ICMPV6 => {
            load::<8>(ctx, l4off, h)?;
            p.icmp_type = h[0];
            let echo = if p.proto == proto::ICMP {
                h[0] == 8 || h[0] == 0
            } else {
                h[0] == 128 || h[0] == 129
            };
            if echo {
                let id = be16(h[4], h[5]);
                p.ct_sport = id;
                p.ct_dport = id;
            }
            return Ok(());
        }
        _ => return Ok(()),
    }
    p.sport = be16(h[0], h[1]);
    p.dport = be16(h[2], h[3]);
    p.ct_sport = p.sport;
    p.ct_dport = p.dport;
    Ok(())
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 4] = *b"GPL\0";
