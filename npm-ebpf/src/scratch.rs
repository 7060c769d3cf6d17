//! The per-CPU scratch space of one packet (`NPM_SCRATCH`: the parsed
//! packet and the map keys live there, not on the 512-byte BPF stack) and
//! the clock cache of [`coarse_now`].

use aya_ebpf::{
    helpers::{bpf_jiffies64, bpf_ktime_get_coarse_ns},
    macros::map,
    maps::PerCpuArray,
};
use npm_common::{CtKey, CtKey4, CtValue, DenyEvent, FragKey, FragValue};

use crate::mem::wr64;
use crate::parse::Pkt;

/// Per-CPU scratch space: the parsed packet and the map keys live here, not
/// on the 512-byte BPF stack. Not pinned: between packets it only holds the
/// clock cache of [`coarse_now`] and the deny-event budget.
#[map]
pub(crate) static NPM_SCRATCH: PerCpuArray<Scratch> = PerCpuArray::with_max_entries(1, 0);

/// Per-CPU working state of one packet.
#[repr(C)]
pub(crate) struct Scratch {
    /// The parsed packet.
    pub(crate) pkt: Pkt,
    /// The header an ICMP error quotes (addresses, protocol, conntrack
    /// ports), parsed by [`crate::icmp_error`].
    pub(crate) quoted: Pkt,
    /// Header bytes copied by `bpf_skb_load_bytes`.
    pub(crate) hdr: [u8; 40],
    /// The `NPM_CT` key.
    pub(crate) ct: CtKey,
    /// The `NPM_CT4` key.
    pub(crate) ct4: CtKey4,
    /// A new conntrack value.
    pub(crate) ctv: CtValue,
    /// The `NPM_FRAGS` key.
    pub(crate) frag: FragKey,
    /// A new fragment record.
    pub(crate) fragv: FragValue,
    /// The deny event.
    pub(crate) ev: DenyEvent,
    /// An LPM key: prefix length and up to 16 bytes of data.
    pub(crate) lpm: [u32; 5],
    /// This packet's `ingress_ifindex`, copied by `decide()`: `DRY_RUN_IIF`
    /// (`u32::MAX`, which no real packet carries) marks an explain dry run
    /// (`main.rs`: no conntrack entry, no cache fill, no counter, no event);
    /// `node_exit` clears it.
    pub(crate) pad: u32,
    /// The clock cache and the deny-event budget.
    pub(crate) clk: Clock,
}

/// Clock cache of [`coarse_now`] and the event budgets of this CPU.
#[repr(C)]
pub(crate) struct Clock {
    /// The jiffies value at the last clock read.
    pub(crate) jiffies: u64,
    /// The coarse clock read then (0: none yet).
    pub(crate) ns: u64,
    /// The tick whose deny events `ev_count` counts.
    pub(crate) ev_jiffies: u64,
    /// Deny events sent in that tick.
    pub(crate) ev_count: u64,
    /// The tick whose allow events `allow_count` counts.
    pub(crate) allow_jiffies: u64,
    /// Allow events (new connections of `EP_REPORT_NEW` endpoints) sent in
    /// that tick: their own budget, so they never take the deny events'.
    pub(crate) allow_count: u64,
}

/// `bpf_ktime_get_coarse_ns`, read at most once per jiffy and CPU: the
/// coarse clock only moves when the tick updates the timekeeper (and
/// jiffies), and `bpf_jiffies64` is inlined by the verifier while the clock
/// helper is a real call. The cached value is at most one tick old, the
/// resolution of the coarse clock anyway.
#[inline(always)]
pub(crate) fn coarse_now(c: &mut Clock) -> u64 {
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
