//! Step 6, conntrack: the canonical keys of `NPM_CT` and `NPM_CT4`, the
//! lookup's continuation ([`ct_continue`]) and the entry of a new
//! connection ([`ct_create`]).
//!
//! Timestamps (`CtValue`, `DenyEvent::ts_ns`) are `CLOCK_MONOTONIC` read
//! with `bpf_ktime_get_coarse_ns` (tick resolution, no TSC read): the
//! timeouts are seconds long, and the coarse clock is much cheaper.
//!
//! Keys are canonical (the lower (address, port) pair first) and per
//! endpoint, so both hooks of an endpoint find the same entry. A hit that
//! has not idled out allows the packet (`Tracked`). A packet in the reply
//! direction sets `CT_SEEN_REPLY`; a TCP FIN or RST sets `CT_CLOSING`, and
//! the side that sent a FIN (`CT_FIN_LO`, `CT_FIN_HI`) or the RST
//! (`CT_RST`): a half-closed flow (one FIN) keeps the established timeout,
//! the short closing one starts with the second FIN or a RST
//! (`npm_common::ct_timeout_ns`).
//! An established flow is decided again only when its endpoint's
//! decision epoch (`NPM_EP_EPOCH`, [`crate::endpoint::endpoint_epoch`])
//! differs from the one its entry recorded ([`CtValue::epoch`]): the
//! loader moves it after a sync that changed what an `enforce` endpoint's
//! policy decides (connection semantics). [`ct_continue`] then
//! answers [`CT_STALE`], the caller decides the connection's original
//! packet again by the normal policy step ([`ct_original`]), and
//! [`ct_redecided`] keeps the entry under the current epoch or marks it
//! cut (`CT_CUT`: the packet is dropped, `Reason::ConnectionCut`, and so
//! is every later packet of the tuple, `Reason::CutFlow`, in either
//! direction, until the entry idles out or a TCP SYN opens a new
//! connection). Under `keep` the epoch
//! never moves: flows keep flowing until they end or idle out, and policy
//! changes only affect new connections (the loader purges the entries of
//! removed endpoints, and of addresses that changed owner, in both modes).
//!
//! ICMP/ICMPv6 echo requests and replies use the echo identifier as both
//! ports in the conntrack key. An ICMP error whose quoted header belongs to
//! an entry passes as related ([`crate::icmp_error`], with [`ct_alive`]),
//! unless the entry is cut (dropped, `Reason::CutFlow`) or stale (the
//! quoted connection is decided again first, [`ct_original`],
//! [`ct_redecided`]);
//! other ICMP messages use ports 0 and are decided by policy (only "any
//! protocol" entries match them, with port 0).
//!
//! A TCP SYN without ACK opens a new connection: it skips the conntrack
//! lookup and is decided by policy; if allowed, its fresh entry replaces any
//! older entry of the same 5-tuple.
//!
//! A *pending* entry (`CT_PENDING`, written by [`crate::service::defer`]
//! for a flow to a Service whose egress decision was deferred) lets only
//! replies in until the first reply confirms it: a packet of its original
//! direction is not `Tracked` (it is deferred again).

use aya_ebpf::{
    macros::map,
    maps::{Array, LruHashMap},
};
use npm_common::{
    ct_timeout_ns, ep_epoch_slot, proto, sizes, CtKey, CtKey4, CtValue, CT_CLOSING, CT_CUT, CT_FILL_CT, CT_FILL_CT4,
    CT_FILL_ENTRIES, CT_FILL_LEN, CT_FILL_PRESSURE, CT_FIN_HI, CT_FIN_LO, CT_ORIG_LO_TO_HI, CT_PENDING, CT_QUOTA_HELD,
    CT_QUOTA_REFUSED, CT_QUOTA_SHARE_DEFAULT, CT_QUOTA_WORDS, CT_RST, CT_SEEN_REPLY, FIRST_DENY_REASON,
};

use crate::flow_cache::{flow_cache_fill, FlowSlot};
use crate::mem::{copy16, rd32, wr32, wr64};
use crate::parse::{Pkt, TCP_FIN, TCP_RST};
use crate::scratch::Scratch;

/// `NPM_CT`: the conntrack entries of flows with an IPv6 address, keyed by
/// [`fill_ct_key`].
#[map]
pub(crate) static NPM_CT: LruHashMap<CtKey, CtValue> = LruHashMap::with_max_entries(sizes::CT, 0);
/// `NPM_CT4`: the conntrack entries of flows whose two addresses are
/// IPv4-mapped, keyed by [`ct4_key`] (a shorter key hashes faster).
#[map]
pub(crate) static NPM_CT4: LruHashMap<CtKey4, CtValue> = LruHashMap::with_max_entries(sizes::CT, 0);

/// `NPM_CT_QUOTA`: per slot of the endpoint's host-side ifindex
/// (`npm_common::ep_epoch_slot`), the words `CT_QUOTA_HELD` (an upper
/// bound of the endpoint's live entries: one added per entry created here,
/// what is no longer alive taken away by the loader's conntrack worker)
/// and `CT_QUOTA_REFUSED` (new connections refused at the cap). Inlined
/// array lookups; the loader maps it (`BPF_F_MMAPABLE`).
#[map]
static NPM_CT_QUOTA: Array<u64> =
    Array::with_max_entries(sizes::ENDPOINT_SLOTS * CT_QUOTA_WORDS, crate::policy::BPF_F_MMAPABLE);

/// `NPM_CT_FILL`: per conntrack map (`CT_FILL_CT`, `CT_FILL_CT4`), the
/// words `CT_FILL_ENTRIES` (an approximation from above of the map's
/// entries: one added per entry written here, moved to the truth by the
/// loader's conntrack worker at each pass) and `CT_FILL_PRESSURE` (the
/// loader's threshold: at or above it the map is under pressure and the
/// per-endpoint cap applies). Why a count kept here rather than a flag the
/// worker sets: a flood fills a map in well under a second, the worker's
/// passes are seconds apart; the datapath's own count follows every
/// insert, and the worker only has to take away what LRU evictions and
/// idled-out entries left uncounted (an eviction happens only when the
/// map is full, where the count is above the threshold anyway).
#[map]
static NPM_CT_FILL: Array<u64> = Array::with_max_entries(CT_FILL_LEN, crate::policy::BPF_F_MMAPABLE);

/// The most live conntrack entries one endpoint may hold (both maps
/// together) while the map of its new entry is under pressure
/// (`NPM_CT_FILL`), a read-only global the loader sets at load time to the
/// conntrack maps' size over the configured share (`u32::MAX`: no
/// quota); `node_exit` and `host_in`, loaded beside the pins, keep this
/// default.
#[no_mangle]
static NPM_CT_CAP: u32 = sizes::CT / CT_QUOTA_SHARE_DEFAULT;

/// Benchmark-only switch, a read-only global the loader may override at load
/// time: when 1, allowed new flows do NOT create a conntrack entry, so a
/// repeated test run measures the policy path every time. The production
/// loader never sets it; the verifier sees the frozen value 0 and prunes the
/// branch.
#[no_mangle]
pub(crate) static NPM_BENCH_NO_CT_CREATE: u8 = 0;

/// Test-only fault injection, a read-only global the loader may override
/// at load time: when 1, every conntrack insert is treated as refused by
/// the kernel (no entry written), so a test sees what a failed LRU insert
/// does to the packet. The production loader never sets it; the verifier
/// sees the frozen value 0 and prunes the branch.
#[no_mangle]
static NPM_BENCH_CT_INSERT_FAILS: u8 = 0;

/// (a, pa) <= (b, pb), addresses compared as big-endian numbers.
#[inline(always)]
unsafe fn le_addr_port(a: *const u8, pa: u16, b: *const u8, pb: u16) -> bool {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
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
}

/// Fills the canonical conntrack key (CtKey layout: endpoint 0, protocol
/// and pad 4, addr_lo 8, addr_hi 24, port_lo 40, port_hi 42); returns
/// whether the packet's source is the key's `lo` side.
#[inline(always)]
pub(crate) fn fill_ct_key(k: &mut CtKey, ep: u32, p: &Pkt) -> bool {
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

/// The canonical `NPM_CT4` key of endpoint `ep`'s flow of protocol `pr`
/// from `saddr`:`sport` to `daddr`:`dport` (addresses as loaded: network
/// order in a little-endian word), as the words of `CtKey4` (endpoint,
/// protocol and pad, `addr_lo`, `addr_hi`, the ports), and whether the
/// source is the key's `lo` side. Same order as [`fill_ct_key`] on the
/// IPv4-mapped addresses: their prefixes are equal, so the last 4 bytes
/// decide.
#[inline(always)]
pub(crate) fn ct4_key(ep: u32, pr: u8, saddr: u32, daddr: u32, sport: u16, dport: u16) -> (bool, [u32; 5]) {
    let (x, y) = (saddr.swap_bytes(), daddr.swap_bytes());
    let src_is_lo = if x != y { x < y } else { sport <= dport };
    let key = if src_is_lo {
        [ep, pr as u32, saddr, daddr, sport as u32 | (dport as u32) << 16]
    } else {
        [ep, pr as u32, daddr, saddr, dport as u32 | (sport as u32) << 16]
    };
    (src_is_lo, key)
}

/// Fills the canonical `NPM_CT4` key ([`ct4_key`]) of a packet whose
/// addresses are both IPv4-mapped; returns whether the packet's source is
/// the key's `lo` side.
#[inline(always)]
pub(crate) fn fill_ct_key4(k: &mut CtKey4, ep: u32, p: &Pkt) -> bool {
    // SAFETY: 4-aligned 16-byte addresses.
    let (s, d) = unsafe { (rd32(p.src.as_ptr().add(12)), rd32(p.dst.as_ptr().add(12))) };
    let (src_is_lo, key) = ct4_key(ep, p.proto, s, d, p.ct_sport, p.ct_dport);
    store_ct4(k, &key);
    src_is_lo
}

/// Writes a `NPM_CT4` key's words.
#[inline(always)]
pub(crate) fn store_ct4(k: &mut CtKey4, key: &[u32; 5]) {
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

/// The five words of a `NPM_CT4` key (the flow cache's key).
#[inline(always)]
pub(crate) fn ct4_words(k: &CtKey4) -> &[u32; 5] {
    // SAFETY: CtKey4 is five 4-aligned words.
    unsafe { &*(k as *const CtKey4 as *const [u32; 5]) }
}

/// What step 6 knows of the packet: its protocol and TCP flags, whether
/// its source is the `lo` side of the canonical key, and the clock.
#[derive(Clone, Copy)]
pub(crate) struct CtPacket {
    /// Protocol number.
    pub(crate) pr: u8,
    /// TCP flags (0 for other protocols).
    pub(crate) tcp_flags: u8,
    /// The packet's source is the key's `lo` side.
    pub(crate) src_is_lo: bool,
    /// The coarse clock.
    pub(crate) now: u64,
}

/// The flags a TCP packet with flags `tcp_flags` adds to its flow's entry:
/// a FIN marks the flow closing and its sender's side done (`CT_FIN_LO` or
/// `CT_FIN_HI`, by `src_is_lo`), a RST marks it closing and reset.
#[inline(always)]
fn tcp_close_flags(tcp_flags: u8, src_is_lo: bool) -> u8 {
    let mut f = 0;
    if tcp_flags & TCP_FIN != 0 {
        f |= CT_CLOSING | if src_is_lo { CT_FIN_LO } else { CT_FIN_HI };
    }
    if tcp_flags & TCP_RST != 0 {
        f |= CT_CLOSING | CT_RST;
    }
    f
}

/// Whether the entry at `v` (of a flow of protocol `pr`) has not idled out
/// at `now` (the timeout of [`ct_timeout_ns`]).
#[inline(always)]
pub(crate) fn ct_alive(v: &CtValue, pr: u8, now: u64) -> bool {
    now.wrapping_sub(v.last_seen_ns) <= ct_timeout_ns(pr, v.flags)
}

/// [`ct_continue`]: no live entry for this packet (policy decides).
pub(crate) const CT_MISS: u8 = 0;
/// [`ct_continue`]: the packet is `Tracked`.
pub(crate) const CT_TRACKED: u8 = 1;
/// [`ct_continue`]: a live entry decided under an older epoch of its
/// endpoint: the connection is decided again ([`ct_original`],
/// [`ct_redecided`]) before the packet passes.
pub(crate) const CT_STALE: u8 = 2;
/// [`ct_continue`]: a live entry of a cut connection (`CT_CUT`): the
/// packet is dropped (`Reason::CutFlow`).
pub(crate) const CT_CUT_HIT: u8 = 3;

/// Step 6 on a conntrack hit: unless the entry idled out, records what
/// this packet says of the flow (a reply, a FIN or RST), refreshes the idle
/// timer at most every 100 ms and answers [`CT_TRACKED`] (or
/// [`CT_CUT_HIT`] for a cut connection, whose timer it refreshes too), putting an
/// established flow into its flow-cache slot (when `slot` is not null)
/// under `epoch`; or [`CT_STALE`] (same writes, no flow-cache slot) when
/// the entry was decided under another epoch than the endpoint's current
/// `epoch` and is not a pending Service entry. Answers [`CT_MISS`] for an
/// idled-out entry (policy decides). A dry run
/// (`dry`: `/explain`'s crafted packet) writes nothing: no flag (a
/// crafted "reply" must not confirm a pending Service entry), no
/// timestamp, no flow-cache slot; it answers as the packet would be
/// answered.
#[inline(always)]
pub(crate) fn ct_continue(
    v: *mut CtValue,
    pkt: CtPacket,
    slot: *mut FlowSlot,
    key: &[u32; 5],
    dry: bool,
    epoch: u32,
) -> u8 {
    // SAFETY: a map value; concurrent writers only set flag bits, the
    // timestamp or the epoch, all benign races (the flags are read, OR-ed and stored
    // back: two CPUs adding bits at the same instant, such as both FINs of
    // a simultaneous close, may lose one; the BPF target has no atomic
    // OR. A lost FIN bit leaves the entry half-closed, with the
    // established timeout, until LRU eviction; a TCP SYN is decided by
    // policy regardless).
    let v = unsafe { &mut *v };
    if !ct_alive(v, pkt.pr, pkt.now) {
        return CT_MISS;
    }
    let idle = pkt.now.wrapping_sub(v.last_seen_ns);
    // A cut connection: dropped, either way; each packet keeps it cut.
    if v.flags & CT_CUT != 0 {
        if !dry && idle > 100_000_000 {
            v.last_seen_ns = pkt.now;
        }
        return CT_CUT_HIT;
    }
    let orig_lo = v.flags & CT_ORIG_LO_TO_HI != 0;
    // An unconfirmed pending entry answers only for replies.
    if v.flags & (CT_PENDING | CT_SEEN_REPLY) == CT_PENDING && orig_lo == pkt.src_is_lo {
        return CT_MISS;
    }
    // Decided under another epoch: decided again (a pending Service
    // entry never is: its tuple is the pre-DNAT one).
    let stale = v.epoch != epoch && v.flags & CT_PENDING == 0;
    let mut flags = v.flags;
    if orig_lo != pkt.src_is_lo {
        flags |= CT_SEEN_REPLY;
    }
    if pkt.pr == proto::TCP {
        flags |= tcp_close_flags(pkt.tcp_flags, pkt.src_is_lo);
    }
    if dry {
        return if stale { CT_STALE } else { CT_TRACKED };
    }
    if flags != v.flags {
        v.flags = flags;
    }
    // Refresh at most every 100 ms: keeps the cache line mostly read-only
    // (timeouts are 10 s and more).
    if idle > 100_000_000 {
        v.last_seen_ns = pkt.now;
    }
    if stale {
        return CT_STALE;
    }
    // An established flow (replies seen, not closing) goes into the flow
    // cache: its next packets on this CPU skip the conntrack lookup.
    if !slot.is_null() && flags & (CT_SEEN_REPLY | CT_CLOSING) == CT_SEEN_REPLY {
        // SAFETY: this CPU's slot, found by the caller.
        unsafe { flow_cache_fill(slot, key, pkt.now, epoch) };
    }
    CT_TRACKED
}

/// What the connection of a [`CT_STALE`] entry `v` is decided again as:
/// its original packet, in the direction that opened it (returned first)
/// to the destination port of that packet (returned second: this packet's
/// `dport` when it travels the original way, else its `sport`). The peer
/// is the same address either way: the side that is not the endpoint.
#[inline(always)]
pub(crate) fn ct_original(v: *const CtValue, src_is_lo: bool, sport: u16, dport: u16) -> (u8, u16) {
    // SAFETY: a map value, read only.
    let v = unsafe { &*v };
    let orig = (v.flags & CT_ORIG_LO_TO_HI != 0) == src_is_lo;
    (v.origin_direction, if orig { dport } else { sport })
}

/// The end of a [`CT_STALE`] packet's new decision `reason` (the entry `v`,
/// in `NPM_CT4` at `s.ct4` when `v4`, else in `NPM_CT` at `s.ct`):
/// allowed, the entry takes `epoch` and the packet is `Tracked`; denied,
/// the entry is marked `CT_CUT` and the packet dropped as
/// `Reason::ConnectionCut` (its later packets, either way, are dropped as
/// `Reason::CutFlow`: see `npm_common::CT_CUT` for why the entry stays).
/// A dry run writes nothing and answers the same.
#[inline(always)]
pub(crate) fn ct_redecided(s: &Scratch, v: *mut CtValue, reason: u8, epoch: u32) -> u8 {
    let dry = s.pad == crate::DRY_RUN_IIF;
    if reason < FIRST_DENY_REASON {
        if !dry {
            // SAFETY: a map value; a 4-aligned word.
            unsafe { wr32(core::ptr::addr_of_mut!((*v).epoch) as *mut u8, epoch) };
        }
        return npm_common::Reason::Tracked as u8;
    }
    if !dry {
        // SAFETY: a map value; a benign race as for every flag bit.
        unsafe { (*v).flags |= CT_CUT };
    }
    npm_common::Reason::ConnectionCut as u8
}

/// [`ct_create`]: no entry written (a dry run, the benchmark switch).
pub(crate) const CT_NOT_WRITTEN: u8 = 0;
/// [`ct_create`]: the entry was written.
pub(crate) const CT_WRITTEN: u8 = 1;
/// [`ct_create`]: refused, the endpoint holds its share of the table
/// (`NPM_CT_CAP`) and the table is under pressure: the caller drops the
/// packet as `Reason::ConntrackQuota`.
pub(crate) const CT_REFUSED: u8 = 2;
/// [`ct_create`]: the kernel did not write the entry (the LRU insert
/// failed): the caller drops the packet as `Reason::ConntrackFailed`.
pub(crate) const CT_FAILED: u8 = 3;

/// Charges one new conntrack entry to the endpoint on `ifindex`
/// (`NPM_CT_QUOTA`): false, and the refusal counted, when the endpoint
/// already holds `NPM_CT_CAP` entries and the map of the entry (`fill`:
/// `CT_FILL_CT` or `CT_FILL_CT4`) is under pressure ([`ct_pressure`]).
/// The test and the add are not one atomic step: CPUs racing at the cap
/// may each pass it by one.
#[inline(always)]
fn ct_charge(ifindex: u32, fill: u32) -> bool {
    let base = ep_epoch_slot(ifindex) * CT_QUOTA_WORDS;
    let Some(held) = NPM_CT_QUOTA.get_ptr_mut(base + CT_QUOTA_HELD) else {
        return true;
    };
    // SAFETY: reading a read-only global; `held` and `refused` are
    // 8-aligned array values, changed only by atomic adds (here and by
    // the loader's conntrack worker).
    unsafe {
        let cap = core::ptr::read_volatile(&NPM_CT_CAP) as u64;
        if core::ptr::read_volatile(held) >= cap && ct_pressure(fill) {
            if let Some(refused) = NPM_CT_QUOTA.get_ptr_mut(base + CT_QUOTA_REFUSED) {
                atomic_add(refused, 1);
            }
            return false;
        }
        atomic_add(held, 1);
    }
    true
}

/// Takes back the charge of an entry the kernel did not write.
#[inline(always)]
fn ct_uncharge(ifindex: u32) {
    let base = ep_epoch_slot(ifindex) * CT_QUOTA_WORDS;
    if let Some(held) = NPM_CT_QUOTA.get_ptr_mut(base + CT_QUOTA_HELD) {
        // SAFETY: an 8-aligned array value changed only by atomic adds;
        // adding 2^64 - 1 takes one away.
        unsafe { atomic_add(held, u64::MAX) };
    }
}

/// Whether the conntrack map whose `NPM_CT_FILL` words start at `fill` is
/// under pressure: its fill at or above its threshold (a threshold of 0,
/// not yet written by a loader: always).
#[inline(always)]
fn ct_pressure(fill: u32) -> bool {
    let (Some(entries), Some(threshold)) = (
        NPM_CT_FILL.get_ptr(fill + CT_FILL_ENTRIES),
        NPM_CT_FILL.get_ptr(fill + CT_FILL_PRESSURE),
    ) else {
        return true;
    };
    // SAFETY: 8-aligned array values (the fill changed by atomic adds,
    // the threshold stored whole by the loader).
    unsafe { core::ptr::read_volatile(entries) >= core::ptr::read_volatile(threshold) }
}

/// `*p += v` as one `BPF_ATOMIC` add (no fetch: the result is unused).
///
/// # Safety
/// `p` is a valid, 8-aligned map value.
#[inline(always)]
unsafe fn atomic_add(p: *mut u64, v: u64) {
    // SAFETY: the caller's contract.
    unsafe {
        core::intrinsics::atomic_xadd::<u64, u64, { core::intrinsics::AtomicOrdering::Relaxed }>(p, v);
    }
}

/// Creates the conntrack entry of a new connection allowed by steps 7 to 9
/// (in `NPM_CT4` from `s.ct4` when `v4`, else in `NPM_CT` from `s.ct`)
/// with the extra flags `extra` (`CT_PENDING` for a deferred flow, else 0)
/// and the endpoint's decision `epoch` (read before the policy lookup);
/// a fresh entry replaces an older one of the same key. The entry is
/// charged to the endpoint on `ifindex` ([`ct_charge`]): one that holds its
/// share of the table while the table is under pressure gets
/// [`CT_REFUSED`] and no entry, so its flood of new flows never evicts
/// another endpoint's entries. A written entry is added to the map's fill
/// (`NPM_CT_FILL`); an insert the kernel refused gets [`CT_FAILED`] (its
/// charge taken back). Returns [`CT_WRITTEN`], or [`CT_NOT_WRITTEN`] for
/// a dry run or the benchmark switch; the allow event of a new connection
/// (`crate::verdict::report_new`) is sent by the caller only for a
/// written entry of an `EP_REPORT_NEW` endpoint.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(crate) fn ct_create(
    s: &mut Scratch,
    v4: bool,
    pkt: CtPacket,
    dir: u8,
    reason: u8,
    extra: u8,
    epoch: u32,
    ifindex: u32,
) -> u8 {
    // SAFETY: reading a read-only global.
    if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_CT_CREATE) } != 0 {
        return CT_NOT_WRITTEN;
    }
    // A dry run (`npm-agent explain`) creates no conntrack state.
    if s.pad == crate::DRY_RUN_IIF {
        return CT_NOT_WRITTEN;
    }
    let fill = if v4 { CT_FILL_CT4 } else { CT_FILL_CT };
    if !ct_charge(ifindex, fill) {
        return CT_REFUSED;
    }
    let mut flags = extra | if pkt.src_is_lo { CT_ORIG_LO_TO_HI } else { 0 };
    if pkt.pr == proto::TCP {
        flags |= tcp_close_flags(pkt.tcp_flags, pkt.src_is_lo);
    }
    // SAFETY: CtValue layout: last_seen 0, created 8, origin_direction,
    // flags, reason, pad 16..20, epoch 20..24.
    unsafe {
        let v = core::ptr::addr_of_mut!(s.ctv) as *mut u8;
        wr64(v, pkt.now);
        wr64(v.add(8), pkt.now);
        wr32(v.add(16), dir as u32 | (flags as u32) << 8 | (reason as u32) << 16);
        wr32(v.add(20), epoch);
    }
    // SAFETY: reading a read-only global.
    let written = if unsafe { core::ptr::read_volatile(&NPM_BENCH_CT_INSERT_FAILS) } != 0 {
        Err(-12)
    } else if v4 {
        NPM_CT4.insert(&s.ct4, &s.ctv, 0)
    } else {
        NPM_CT.insert(&s.ct, &s.ctv, 0)
    };
    if written.is_err() {
        ct_uncharge(ifindex);
        return CT_FAILED;
    }
    if let Some(entries) = NPM_CT_FILL.get_ptr_mut(fill + CT_FILL_ENTRIES) {
        // SAFETY: an 8-aligned array value changed only by atomic adds.
        unsafe { atomic_add(entries, 1) };
    }
    CT_WRITTEN
}
