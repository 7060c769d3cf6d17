//! The endpoint table: host-side ifindex -> [`EndpointInfo`], split over
//! two maps so the datapath's per-packet lookup is an inlined array access.
//!
//! - `NPM_EP_SLOTS`, an array indexed by the ifindex, holds every endpoint
//!   whose ifindex is below [`sizes::ENDPOINT_SLOTS`] (the usual case: the
//!   kernel hands out ifindexes in increasing order, so only a host that has
//!   created that many interfaces since boot goes beyond). A slot holds an
//!   endpoint when its flags carry [`EP_PRESENT`]; removing writes zeroes.
//! - `NPM_ENDPOINTS`, a hash, holds the endpoints of larger ifindexes.
//!
//! Array slots are updated in place, not replaced atomically like hash
//! entries: a packet racing with an update may read a mix of the old and
//! the new bytes. For the same endpoint (new flags, addresses or subject)
//! a mix only combines that endpoint's own old and new settings: a new
//! subject (a relabelled pod) read with the old subject's policy flags, or
//! the reverse, only skips lookups that cannot hit for the read subject,
//! so it allows at most what that subject allows (both subjects' entries exist while the record is rewritten:
//! upserts before, removals after). When a slot changes
//! owner (endpoint X's interface index now belongs to endpoint Y), the
//! loader goes through two drop-all records first ([`EndpointTable::replace`]):
//! X's, then Y's, then Y's full record; any mix of two consecutive records
//! is then either one endpoint's own view or a drop-all, never Y's traffic
//! under X's id (X's policy entries are removed only after the upserts).

use std::os::fd::{AsFd, AsRawFd};

use aya::maps::{Array, HashMap as BpfHashMap, IterableMap, MapData, MapError};
use aya::Ebpf;
use npm_common::{
    maps, sizes, EndpointInfo, EP_ADMIN_EGRESS, EP_ADMIN_INGRESS, EP_BASELINE_EGRESS, EP_BASELINE_INGRESS,
    EP_ISOLATED_EGRESS, EP_ISOLATED_INGRESS, EP_PRESENT,
};

use super::errors::{is_not_found, map_err, removed, EbpfError};
use super::loader::take_map;
use super::translate;
use crate::AdoptedEndpoint;

/// The two endpoint maps, written together.
pub(crate) struct EndpointTable {
    slots: Array<MapData, EndpointInfo>,
    overflow: BpfHashMap<MapData, u32, EndpointInfo>,
}

impl EndpointTable {
    /// Wraps the two opened maps.
    pub(crate) fn new(slots: Array<MapData, EndpointInfo>, overflow: BpfHashMap<MapData, u32, EndpointInfo>) -> Self {
        EndpointTable { slots, overflow }
    }

    /// Takes both maps out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        let slots = take_map(bpf, maps::EP_SLOTS)?;
        let overflow = take_map(bpf, maps::ENDPOINTS)?;
        Ok(EndpointTable::new(slots, overflow))
    }

    /// Writes the endpoint of `ifindex` (`info.flags` must carry
    /// [`EP_PRESENT`]).
    pub(crate) fn insert(&mut self, ifindex: u32, info: EndpointInfo) -> Result<(), EbpfError> {
        debug_assert!(info.flags & EP_PRESENT != 0);
        if ifindex < sizes::ENDPOINT_SLOTS {
            self.slots.set(ifindex, info, 0).map_err(map_err(
                maps::EP_SLOTS,
                format!("write endpoint {} at ifindex {ifindex}", info.id),
            ))
        } else {
            self.overflow.insert(ifindex, info, 0).map_err(map_err(
                maps::ENDPOINTS,
                format!("insert endpoint {} at ifindex {ifindex}", info.id),
            ))
        }
    }

    /// The endpoint record of `ifindex`, if any.
    pub(crate) fn get(&self, ifindex: u32) -> Result<Option<EndpointInfo>, EbpfError> {
        if ifindex < sizes::ENDPOINT_SLOTS {
            let info = self
                .slots
                .get(&ifindex, 0)
                .map_err(map_err(maps::EP_SLOTS, format!("read ifindex {ifindex}")))?;
            Ok((info.flags & EP_PRESENT != 0).then_some(info))
        } else {
            match self.overflow.get(&ifindex, 0) {
                Ok(info) => Ok(Some(info)),
                Err(e) if is_not_found(&e) => Ok(None),
                Err(e) => Err(map_err(maps::ENDPOINTS, format!("read ifindex {ifindex}"))(e)),
            }
        }
    }

    /// Writes `info` at `ifindex`; when the record there belongs to another
    /// endpoint, first a drop-all record of that endpoint, then one of the
    /// new endpoint (see the module doc).
    pub(crate) fn replace(&mut self, ifindex: u32, info: EndpointInfo) -> Result<(), EbpfError> {
        if let Some(cur) = self.get(ifindex)? {
            if cur.id != info.id {
                self.insert(ifindex, drop_all(cur.id))?;
                self.insert(ifindex, drop_all(info.id))?;
            }
        }
        self.insert(ifindex, info)
    }

    /// Removes the endpoint of `ifindex`; removing an absent one is no error.
    pub(crate) fn remove(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        if ifindex < sizes::ENDPOINT_SLOTS {
            self.slots
                .set(ifindex, EndpointInfo::default(), 0)
                .map_err(map_err(maps::EP_SLOTS, format!("clear ifindex {ifindex}")))
        } else {
            removed(
                self.overflow.remove(&ifindex),
                maps::ENDPOINTS,
                format_args!("ifindex {ifindex}"),
            )
        }
    }

    /// Every endpoint, by ifindex.
    pub(crate) fn entries(&self) -> Result<Vec<(u32, EndpointInfo)>, EbpfError> {
        read_entries(&self.slots, &self.overflow)
    }

    /// Every endpoint record: interface, id, addresses and isolation.
    pub(crate) fn records(&self) -> Result<Vec<AdoptedEndpoint>, EbpfError> {
        Ok(adopted_records(self.entries()?))
    }

    /// The borrowed maps, for a dump.
    pub(crate) fn maps(&self) -> (&Array<MapData, EndpointInfo>, &BpfHashMap<MapData, u32, EndpointInfo>) {
        (&self.slots, &self.overflow)
    }
}

/// A record of endpoint `id` that lets nothing through but its tracked
/// flows: isolated both ways, no policy lookup, no address (every packet
/// leaving it is spoofed).
fn drop_all(id: u32) -> EndpointInfo {
    EndpointInfo {
        id,
        flags: EP_PRESENT | EP_ISOLATED_INGRESS | EP_ISOLATED_EGRESS | translate::EP_NO_PEER_ALL,
        ..EndpointInfo::default()
    }
}

/// The [`AdoptedEndpoint`]s of endpoint records (by ifindex).
pub(crate) fn adopted_records(entries: Vec<(u32, EndpointInfo)>) -> Vec<AdoptedEndpoint> {
    entries
        .into_iter()
        .map(|(ifindex, info)| AdoptedEndpoint {
            ifindex,
            id: info.id,
            ipv4: translate::endpoint_ipv4(&info),
            ipv6: translate::endpoint_ipv6(&info),
            isolated_ingress: info.flags & EP_ISOLATED_INGRESS != 0,
            isolated_egress: info.flags & EP_ISOLATED_EGRESS != 0,
            tiered_directions: [
                EP_ADMIN_INGRESS,
                EP_ADMIN_EGRESS,
                EP_BASELINE_INGRESS,
                EP_BASELINE_EGRESS,
            ]
            .iter()
            .filter(|&&f| info.flags & f != 0)
            .count() as u8,
        })
        .collect()
}

/// An endpoint record as some map layout stores it, read back as this
/// layout's [`EndpointInfo`].
pub(crate) trait Record: aya::Pod + Default {
    /// The record's `EP_*` flags.
    fn flags(&self) -> u32;
    /// The record in this layout's form.
    fn info(self) -> EndpointInfo;
}

impl Record for EndpointInfo {
    fn flags(&self) -> u32 {
        self.flags
    }
    fn info(self) -> EndpointInfo {
        self
    }
}

/// The endpoint record of map layouts 3 to 5 (40 bytes): this layout's
/// without the subject (policy keys were keyed by endpoint id then).
/// Read only from an older layout's pins, for the ids, addresses and
/// isolation of the endpoints whose flows were copied.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RecordV5 {
    id: u32,
    flags: u32,
    ipv4: [u8; 16],
    ipv6: [u8; 16],
}
const _: () = assert!(std::mem::size_of::<RecordV5>() == 40);

// SAFETY: repr(C), only integers and byte arrays, no padding (40 bytes,
// asserted), any bit pattern is valid.
unsafe impl aya::Pod for RecordV5 {}

impl Record for RecordV5 {
    fn flags(&self) -> u32 {
        self.flags
    }
    fn info(self) -> EndpointInfo {
        EndpointInfo {
            id: self.id,
            flags: self.flags,
            ipv4: self.ipv4,
            ipv6: self.ipv6,
            subject: 0,
        }
    }
}

/// The `EP_*` flags of a record written by map layouts 3 to 6, in this
/// layout's bits: bits 0 to 10 (isolation, addresses, the
/// `EP_NO_*_PEER_*` flags, presence) are unchanged; the tier flags moved
/// from bits 15 to 18 to [`EP_ADMIN_INGRESS`] ..= [`EP_BASELINE_EGRESS`]
/// when layout 7 dropped the front flags; the others (fronts, class
/// filter, fold, report) are dropped: nothing adopted reads them.
pub(crate) fn flags_before_layout_7(flags: u32) -> u32 {
    const KEPT: u32 = (1 << 11) - 1;
    const OLD_TIERS_SHIFT: u32 = 15;
    let tiers = (flags >> OLD_TIERS_SHIFT) & 0xf;
    (flags & KEPT) | (tiers * EP_ADMIN_INGRESS)
}
const _: () = assert!(
    EP_ADMIN_EGRESS == EP_ADMIN_INGRESS << 1
        && EP_BASELINE_INGRESS == EP_ADMIN_INGRESS << 2
        && EP_BASELINE_EGRESS == EP_ADMIN_INGRESS << 3
        && EP_PRESENT == 1 << 10
);

/// Every endpoint of the two maps, by ifindex: the present slots of the
/// array, then the hash entries (records of type `R`, read as
/// [`EndpointInfo`]s).
pub(crate) fn read_entries<R: Record>(
    slots: &Array<MapData, R>,
    overflow: &BpfHashMap<MapData, u32, R>,
) -> Result<Vec<(u32, EndpointInfo)>, EbpfError> {
    let mut out: Vec<(u32, EndpointInfo)> = read_all_slots(slots)?
        .into_iter()
        .filter(|(_, r)| r.flags() & EP_PRESENT != 0)
        .map(|(ifindex, r)| (ifindex, r.info()))
        .collect();
    for e in overflow.iter() {
        let (ifindex, r) = e.map_err(|e: MapError| map_err(maps::ENDPOINTS, "iterate")(e))?;
        out.push((ifindex, r.info()));
    }
    Ok(out)
}

/// Reads every slot of the array with `BPF_MAP_LOOKUP_BATCH`: a few
/// syscalls for all 65,536 slots instead of one per slot (which made a full
/// sync's sweep cost seconds).
fn read_all_slots<R: Record>(slots: &Array<MapData, R>) -> Result<Vec<(u32, R)>, EbpfError> {
    let mut out = Vec::with_capacity(sizes::ENDPOINT_SLOTS as usize);
    let fd = slots.map().fd().as_fd().as_raw_fd();
    // The array was opened as an array of R (aya checked its value size);
    // its keys are u32 indexes.
    super::batch::for_each::<u32, R>(fd, |keys, values| {
        out.extend(keys.iter().copied().zip(values.iter().copied()))
    })
    .map_err(|io_error| {
        map_err(maps::EP_SLOTS, "batch lookup")(MapError::SyscallError(aya::sys::SyscallError {
            call: "bpf_map_lookup_batch",
            io_error,
        }))
    })?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::{EP_FOLD_INGRESS, EP_HAS_V4, EP_NO_ANY_PEER_EGRESS, EP_REPORT_NEW};

    /// A layout-6 record's flags read at layout 7's bits: the unchanged
    /// low bits stay, the tier flags move down from bits 15..=18, and the
    /// front, class filter, report and fold bits are dropped (its front
    /// flag, bit 11, is layout 7's Admin ingress flag: it must not become
    /// one).
    #[test]
    fn layout_6_flags_are_read_at_their_own_bits() {
        let low = EP_PRESENT | EP_HAS_V4 | EP_ISOLATED_INGRESS | EP_NO_ANY_PEER_EGRESS;
        let (front, admin_in, baseline_out, report, summary, fold_in) =
            (1 << 11, 1 << 15, 1 << 18, 1 << 23, 1 << 24, 1 << 25);
        assert_eq!(flags_before_layout_7(low | front), low);
        assert_eq!(
            flags_before_layout_7(low | admin_in | baseline_out | report | summary | fold_in),
            low | EP_ADMIN_INGRESS | EP_BASELINE_EGRESS
        );
        assert_eq!(
            flags_before_layout_7(1 << 16 | 1 << 17),
            EP_ADMIN_EGRESS | EP_BASELINE_INGRESS
        );
        assert_eq!(flags_before_layout_7(u32::MAX) & (EP_REPORT_NEW | EP_FOLD_INGRESS), 0);
    }
}
