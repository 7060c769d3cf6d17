//! Per-rule and per-endpoint counters: `NPM_RULE_COUNT` (the packets and
//! bytes each NetworkPolicy rule allowed at a policy decision, by
//! `npm_common::rule_slot`) and `NPM_EP_DENIES` (the packets NetworkPolicy
//! denied, by `npm_common::endpoint_deny_slot`), both per-CPU.
//!
//! A tracked packet (a conntrack or flow-cache hit) is never re-decided,
//! so it adds nothing here: `NPM_RULE_COUNT` counts the packet that a
//! policy lookup (or the fold) allowed, which is the first packet
//! of each new connection (and each packet of a protocol conntrack does not
//! track). Tracked packets cost no lookup for this: [`count_rule`] compares
//! the reason and returns.
//!
//! How the rule reaches the accounting: `policy::policy_step`, when it
//! returns `Reason::Policy`, leaves [`RULE_TAG`] `|` the rule slot in the
//! first word of the scratch key `s.lpm` (dead after the decision);
//! [`count_rule`] takes it from there and clears it.

use aya_ebpf::{macros::map, maps::PerCpuArray};
use npm_common::{endpoint_deny_slot, Counter, Reason, EP_DENY_ENTRIES, RULE_COUNT_ENTRIES, RULE_SLOT_UNKNOWN};

use crate::scratch::Scratch;

/// Benchmark switch (measurement only): when 1, [`count_rule`] bumps no
/// counter (it still clears the rule tag), so the datapath benchmark can
/// measure what the counters cost per decision.
#[no_mangle]
static NPM_BENCH_NO_RULE_COUNT: u8 = 0;

/// `NPM_RULE_COUNT`: per-CPU packets and bytes allowed per rule slot.
#[map]
static NPM_RULE_COUNT: PerCpuArray<Counter> = PerCpuArray::with_max_entries(RULE_COUNT_ENTRIES, 0);
/// `NPM_EP_DENIES`: per-CPU packets and bytes denied by NetworkPolicy per
/// endpoint slot and direction.
#[map]
static NPM_EP_DENIES: PerCpuArray<Counter> = PerCpuArray::with_max_entries(EP_DENY_ENTRIES, 0);

/// Marks the first scratch-key word as holding a rule slot (an LPM key's
/// first word is a prefix length, at most 128: never this bit).
pub(crate) const RULE_TAG: u32 = 0x8000_0000;

/// Adds one packet of `len` bytes to the counter at `idx` of `map`.
#[inline(always)]
fn bump(map: &PerCpuArray<Counter>, idx: u32, len: u32) {
    // SAFETY: reading a read-only global.
    if unsafe { core::ptr::read_volatile(&NPM_BENCH_NO_RULE_COUNT) } != 0 {
        return;
    }
    if let Some(c) = map.get_ptr_mut(idx) {
        // SAFETY: per-CPU slot, only this CPU writes it.
        unsafe {
            (*c).packets += 1;
            (*c).bytes += len as u64;
        }
    }
}

/// Counts a packet of `len` bytes with verdict `reason` in direction `dir`
/// of endpoint `ep_id`: an allow of `Reason::Policy` at its rule slot (the
/// tag `policy_step` left in `s.lpm[0]`, else [`RULE_SLOT_UNKNOWN`]), a
/// `Reason::PolicyDenied` at the endpoint's deny slot. Any other reason
/// (a tracked packet among them) costs two compares.
#[inline(always)]
pub(crate) fn count_rule(s: &mut Scratch, dir: u8, len: u32, reason: u8, ep_id: u32) {
    if reason == Reason::Policy as u8 {
        let w = s.lpm[0];
        let slot = if w & RULE_TAG != 0 {
            w & !RULE_TAG
        } else {
            RULE_SLOT_UNKNOWN
        };
        s.lpm[0] = 0;
        bump(&NPM_RULE_COUNT, slot, len);
    } else if reason == Reason::PolicyDenied as u8 && ep_id != 0 {
        bump(&NPM_EP_DENIES, endpoint_deny_slot(ep_id, dir), len);
    }
}
