//! What the datapath reports back: `NPM_COUNTERS`, the per-CPU packet and
//! byte counts by (direction, reason) at [`counter_index`], summed over
//! CPUs here, the deny events lost to a full ring buffer at
//! [`EVENTS_LOST_SLOT`] ([`EbpfDataplane::events_lost`]), and `NPM_EVENTS`,
//! the ring buffer of [`DenyEvent`]s; `NPM_RULE_COUNT` and `NPM_EP_DENIES`,
//! the per-rule allows and per-endpoint denies ([`RuleCounts`], read with
//! the counters).
//!
//! Every [`Reason`] has its slot per direction, `Reason::Deferred`
//! included: an egress-isolated pod's new flow to a Service that
//! `from_pod` passed undecided (its decision after the DNAT is counted
//! again, as `policy` or `policy-denied`, where it is taken). Metrics and
//! `npm-agent inspect` name the slots with [`Reason::name`].

use aya::maps::{MapData, PerCpuArray, RingBuf};
use aya::Ebpf;
use npm_common::{
    counter_index, maps, Counter, DenyEvent, Reason, DENY_ENDPOINT_SLOTS, DIR_EGRESS, DIR_INGRESS, EP_DENY_ENTRIES,
    EVENTS_LOST_SLOT, RULE_COUNT_ENTRIES, RULE_SLOTS,
};

use super::errors::{map_err, EbpfError};
use super::loader::take_map;
use super::EbpfDataplane;
use crate::{Counters, KernelCount, RuleCounts};

/// `NPM_COUNTERS`, `NPM_EVENTS`, `NPM_RULE_COUNT` and `NPM_EP_DENIES`.
pub(crate) struct Reports {
    counters: PerCpuArray<MapData, Counter>,
    events: RingBuf<MapData>,
    rule_count: PerCpuArray<MapData, Counter>,
    ep_denies: PerCpuArray<MapData, Counter>,
}

impl Reports {
    /// Takes both maps out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(Reports {
            counters: take_map(bpf, maps::COUNTERS)?,
            events: take_map(bpf, maps::EVENTS)?,
            rule_count: take_map(bpf, maps::RULE_COUNT)?,
            ep_denies: take_map(bpf, maps::EP_DENIES)?,
        })
    }

    /// Counters summed over CPUs, with the per-rule and per-endpoint ones.
    pub(crate) fn counters(&self) -> Result<Counters, EbpfError> {
        let mut c = sum_counters(&self.counters)?;
        c.rules = self.rule_counts()?;
        Ok(c)
    }

    /// The non-zero slots of `NPM_RULE_COUNT` and `NPM_EP_DENIES`, summed
    /// over CPUs (one lookup per slot: 12,289 per read, about 10 ms; the
    /// agent reads them on its stats tick).
    pub(crate) fn rule_counts(&self) -> Result<RuleCounts, EbpfError> {
        let mut out = RuleCounts {
            rule_modulus: Some(RULE_SLOTS),
            endpoint_modulus: Some(DENY_ENDPOINT_SLOTS),
            ..RuleCounts::default()
        };
        for slot in 0..RULE_COUNT_ENTRIES {
            if let Some((packets, bytes)) = slot_sum(&self.rule_count, maps::RULE_COUNT, slot)? {
                // The direction is the rule's own (user space knows it).
                out.allowed.push(KernelCount {
                    source: slot as u64,
                    key: slot,
                    direction: 0,
                    packets,
                    bytes,
                });
            }
        }
        for slot in 0..EP_DENY_ENTRIES {
            if let Some((packets, bytes)) = slot_sum(&self.ep_denies, maps::EP_DENIES, slot)? {
                out.denied.push(KernelCount {
                    source: slot as u64,
                    key: slot >> 1,
                    direction: (slot & 1) as u8,
                    packets,
                    bytes,
                });
            }
        }
        Ok(out)
    }

    /// Deny events lost because the ring buffer was full, summed over CPUs.
    pub(crate) fn events_lost(&self) -> Result<u64, EbpfError> {
        let values = self
            .counters
            .get(&EVENTS_LOST_SLOT, 0)
            .map_err(map_err(maps::COUNTERS, format!("read slot {EVENTS_LOST_SLOT}")))?;
        Ok(values.iter().map(|c| c.packets).sum())
    }

    /// `NPM_COUNTERS`, for reads.
    pub(crate) fn counter_map(&self) -> &PerCpuArray<MapData, Counter> {
        &self.counters
    }

    /// Drains the ring buffer of deny events.
    pub(crate) fn drain_events(&mut self) -> Vec<DenyEvent> {
        let mut out = Vec::new();
        while let Some(item) = self.events.next() {
            if item.len() >= std::mem::size_of::<DenyEvent>() {
                // SAFETY: DenyEvent is plain old data; the read is unaligned-safe.
                let ev = unsafe { std::ptr::read_unaligned(item.as_ptr() as *const DenyEvent) };
                out.push(ev);
            }
        }
        out
    }

    /// The packet count of every reason slot of direction `dir`, summed
    /// over CPUs (the slots `BPF_PROG_TEST_RUN` helpers compare).
    #[cfg(feature = "testing")]
    pub(crate) fn packets_by_slot(&self, dir: u8) -> Result<Vec<u64>, EbpfError> {
        (0..npm_common::REASON_SLOTS as u8)
            .map(|r| self.packets_in_slot(dir, r))
            .collect()
    }

    /// The packet count of reason slot `reason` of direction `dir`, summed
    /// over CPUs (0 for the slot of lost events, not a verdict).
    #[cfg(feature = "testing")]
    pub(crate) fn packets_in_slot(&self, dir: u8, reason: u8) -> Result<u64, EbpfError> {
        use npm_common::{COUNTER_SLOTS, REASON_SLOTS};
        let idx = dir as u32 * REASON_SLOTS + reason as u32;
        debug_assert!(idx < COUNTER_SLOTS);
        if idx == EVENTS_LOST_SLOT {
            // Not a verdict: lost deny events.
            return Ok(0);
        }
        self.counters
            .get(&idx, 0)
            .map(|v| v.iter().map(|c| c.packets).sum())
            .map_err(map_err(maps::COUNTERS, format!("read slot {idx}")))
    }
}

/// Slot `slot` of the per-CPU counter map `counters` (named `name`) summed
/// over CPUs, `None` when zero.
fn slot_sum(
    counters: &PerCpuArray<MapData, Counter>,
    name: &'static str,
    slot: u32,
) -> Result<Option<(u64, u64)>, EbpfError> {
    let values = counters
        .get(&slot, 0)
        .map_err(map_err(name, format!("read slot {slot}")))?;
    let (p, b) = values.iter().fold((0u64, 0u64), |(p, b), c| {
        (p.wrapping_add(c.packets), b.wrapping_add(c.bytes))
    });
    Ok((p != 0 || b != 0).then_some((p, b)))
}

/// Every non-zero (direction, reason) of `counters`, summed over CPUs.
pub(crate) fn sum_counters(counters: &PerCpuArray<MapData, Counter>) -> Result<Counters, EbpfError> {
    let mut out = Counters::default();
    for dir in [DIR_INGRESS, DIR_EGRESS] {
        for r in Reason::ALL {
            let idx = counter_index(dir, r as u8);
            let values = counters
                .get(&idx, 0)
                .map_err(map_err(maps::COUNTERS, format!("read slot {idx}")))?;
            let (p, b) = values
                .iter()
                .fold((0u64, 0u64), |(p, b), c| (p + c.packets, b + c.bytes));
            if p != 0 || b != 0 {
                out.by_reason.insert((dir, r as u8), (p, b));
            }
        }
    }
    Ok(out)
}

impl EbpfDataplane {
    /// Deny events the datapath could not write because `NPM_EVENTS` was
    /// full (nobody drained it fast enough), since the maps were created
    /// (`npm_ringbuf_events_lost_total`).
    pub fn events_lost(&self) -> Result<u64, EbpfError> {
        self.reports.events_lost()
    }
}
