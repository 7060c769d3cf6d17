//! Verdict accounting: the per-CPU counters (`NPM_COUNTERS`) and the deny
//! events of the ring buffer `NPM_EVENTS`.
//!
//! Every drop is counted in `NPM_COUNTERS`; at most 32 deny events per CPU
//! and tick are written to the ring buffer, so a flood of denied packets
//! costs no ring-buffer call per packet. An event the full ring buffer
//! refuses is counted at `EVENTS_LOST_SLOT` (`npm_ringbuf_events_lost_total`).
//!
//! Allow events ([`report_new`]): the packet that creates a new conntrack
//! entry of an endpoint flagged `EP_REPORT_NEW` (the allowed first packet
//! of a connection, never a tracked packet, never a dry run) sends the
//! same `DenyEvent` record with its allow reason (`Policy`, `NotIsolated`,
//! `Host`, `AdminAccept`, `BaselineAccept`: below `FIRST_DENY_REASON`, so
//! user space tells the verdict from the reason). They have a budget of
//! their own, [`ALLOW_EVENTS_PER_TICK`] per CPU and tick, so a burst of new
//! connections never takes the deny events' budget. They count nothing in
//! `NPM_COUNTERS` (the packet's verdict is counted as ever), except a lost
//! one at `EVENTS_LOST_SLOT`.

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    helpers::bpf_jiffies64,
    macros::map,
    maps::{PerCpuArray, RingBuf},
};
use npm_common::{counter_index, sizes, Counter, DenyEvent, COUNTER_SLOTS, EVENTS_LOST_SLOT, FIRST_DENY_REASON};

use crate::mem::{copy16, wr32, wr64, zero16};
use crate::scratch::{coarse_now, Scratch};

/// `NPM_COUNTERS`: per-CPU packets and bytes by direction and reason.
#[map]
static NPM_COUNTERS: PerCpuArray<Counter> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);
/// `NPM_EVENTS`: the ring buffer of deny events.
#[map]
static NPM_EVENTS: RingBuf = RingBuf::with_byte_size(sizes::EVENTS_BYTES, 0);

/// Deny events per CPU and tick (1 to 10 ms) sent to the ring buffer.
const EVENTS_PER_TICK: u64 = 32;
/// Allow events per CPU and tick sent to the ring buffer (a budget of their
/// own, see the module doc).
const ALLOW_EVENTS_PER_TICK: u64 = 32;

/// What the path that decided a packet learned of it besides `s.pkt`, for
/// its deny event.
pub(crate) struct Seen {
    /// The endpoint id (0 before step 2 found the endpoint).
    pub(crate) ep_id: u32,
    /// The conntrack step's clock reading (0 when it did not get that far).
    pub(crate) now: u64,
    /// The direction whose decision the event reports when it is not the
    /// hook's ([`NO_DIR`]: the hook's): a connection cut on a reply
    /// packet reports the direction that opened the connection, whose new
    /// decision denied it.
    pub(crate) dir: u8,
}

/// [`Seen::dir`]: the event reports the hook's direction.
pub(crate) const NO_DIR: u8 = 0xff;

impl Seen {
    /// Nothing seen yet.
    #[inline(always)]
    pub(crate) const fn new() -> Seen {
        Seen {
            ep_id: 0,
            now: 0,
            dir: NO_DIR,
        }
    }
}

/// Accounts for the verdict of a packet of `len` bytes: counts it in
/// `NPM_COUNTERS` and, for a drop, sends its deny event (`s.pkt` and
/// `seen`) to `NPM_EVENTS`, unless this CPU already sent
/// [`EVENTS_PER_TICK`] in this tick. Returns the TC action.
#[inline(always)]
pub(crate) fn account(s: &mut Scratch, dir: u8, ifindex: u32, len: u32, reason: u8, seen: Seen) -> i32 {
    let Seen {
        ep_id,
        now,
        dir: ev_dir,
    } = seen;
    if let Some(c) = NPM_COUNTERS.get_ptr_mut(counter_index(dir, reason)) {
        // SAFETY: per-CPU slot, only this CPU writes it.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len as u64;
        }
    }
    // Per rule (a policy allow) and per endpoint (a policy deny): two
    // compares for any other packet.
    crate::rule_counters::count_rule(s, dir, len, reason, ep_id);
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
    let ev_dir = if ev_dir == NO_DIR { dir } else { ev_dir };
    send_event(s, ev_dir, ifindex, ep_id, reason, ts);
    TC_ACT_SHOT
}

/// The allow event of a new connection of an `EP_REPORT_NEW` endpoint
/// (`ep_id`), allowed for `reason` at `now` (the conntrack step's clock):
/// called once its conntrack entry was written (so never for a tracked
/// packet nor a dry run), with `s.pkt` holding the packet. At most
/// [`ALLOW_EVENTS_PER_TICK`] per CPU and tick; the rest are not sent.
#[inline(always)]
pub(crate) fn report_new(s: &mut Scratch, dir: u8, ifindex: u32, ep_id: u32, reason: u8, now: u64) {
    // SAFETY: plain helper call (inlined by the verifier).
    let j = unsafe { bpf_jiffies64() };
    if s.clk.allow_jiffies != j {
        s.clk.allow_jiffies = j;
        s.clk.allow_count = 0;
    }
    if s.clk.allow_count >= ALLOW_EVENTS_PER_TICK {
        return;
    }
    s.clk.allow_count += 1;
    send_event(s, dir, ifindex, ep_id, reason, now);
}

/// Writes the event of `s.pkt` (endpoint `ep_id` on `ifindex`, direction
/// `dir`, `reason`, time `ts`) into `s.ev` and sends it to `NPM_EVENTS`; a
/// full ring buffer loses the event (counted at `EVENTS_LOST_SLOT`), never
/// the verdict.
#[inline(always)]
fn send_event(s: &mut Scratch, dir: u8, ifindex: u32, ep_id: u32, reason: u8, ts: u64) {
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
    // A full ring buffer loses the event, never the verdict; the loss is
    // counted.
    if NPM_EVENTS.output::<DenyEvent>(&s.ev, 0).is_err() {
        if let Some(c) = NPM_COUNTERS.get_ptr_mut(EVENTS_LOST_SLOT) {
            // SAFETY: per-CPU slot, only this CPU writes it.
            unsafe { (*c).packets += 1 };
        }
    }
}
