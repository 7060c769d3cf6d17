//! What the datapath reports back: `NPM_COUNTERS`, the per-CPU packet and
//! byte counts by (direction, reason) at [`counter_index`], summed over
//! CPUs here, the deny events lost to a full ring buffer at
//! [`EVENTS_LOST_SLOT`] ([`EbpfDataplane::events_lost`]), and `NPM_EVENTS`,
//! the ring buffer of [`DenyEvent`]s.
//!
//! Every [`Reason`] has its slot per direction, `Reason::Deferred`
//! included: an egress-isolated pod's new flow to a Service that
//! `from_pod` passed undecided (its decision after the DNAT is counted
//! again, as `policy` or `policy-denied`, where it is taken). Metrics and
//! `npm-agent inspect` name the slots with [`Reason::name`].

use aya::maps::{MapData, PerCpuArray, RingBuf};
use aya::Ebpf;
use npm_common::{counter_index, maps, Counter, DenyEvent, Reason, DIR_EGRESS, DIR_INGRESS, EVENTS_LOST_SLOT};

use super::errors::{map_err, EbpfError};
use super::loader::take_map;
use super::EbpfDataplane;
use crate::Counters;

/// `NPM_COUNTERS` and `NPM_EVENTS`.
pub(crate) struct Reports {
    counters: PerCpuArray<MapData, Counter>,
    events: RingBuf<MapData>,
}

impl Reports {
    /// Takes both maps out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(Reports {
            counters: take_map(bpf, maps::COUNTERS)?,
            events: take_map(bpf, maps::EVENTS)?,
        })
    }

    /// Counters summed over CPUs.
    pub(crate) fn counters(&self) -> Result<Counters, EbpfError> {
        sum_counters(&self.counters)
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
        use npm_common::{COUNTER_SLOTS, REASON_SLOTS};
        (0..REASON_SLOTS)
            .map(|r| {
                let idx = dir as u32 * REASON_SLOTS + r;
                debug_assert!(idx < COUNTER_SLOTS);
                if idx == EVENTS_LOST_SLOT {
                    // Not a verdict: lost deny events.
                    return Ok(0);
                }
                self.counters
                    .get(&idx, 0)
                    .map(|v| v.iter().map(|c| c.packets).sum())
                    .map_err(map_err(maps::COUNTERS, format!("read slot {idx}")))
            })
            .collect()
    }
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
