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
//! entries: a packet racing with an update may read some 4-byte fields old
//! and others new. Each field on its own is consistent, and the loader only
//! rewrites a slot for the same endpoint (new flags or addresses), so such a
//! packet is decided as before or as after the update, or (old address with
//! new flags) dropped as spoofed: never allowed by a state that did not
//! exist.

use aya::maps::{Array, HashMap as BpfHashMap, MapData, MapError};
use npm_common::{maps, sizes, EndpointInfo, EP_PRESENT};

use super::{is_not_found, map_err, EbpfError};

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

    /// Removes the endpoint of `ifindex`; removing an absent one is no error.
    pub(crate) fn remove(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        if ifindex < sizes::ENDPOINT_SLOTS {
            self.slots
                .set(ifindex, EndpointInfo::default(), 0)
                .map_err(map_err(maps::EP_SLOTS, format!("clear ifindex {ifindex}")))
        } else {
            match self.overflow.remove(&ifindex) {
                Ok(()) => Ok(()),
                Err(e) if is_not_found(&e) => Ok(()),
                Err(e) => Err(map_err(maps::ENDPOINTS, format!("remove ifindex {ifindex}"))(e)),
            }
        }
    }

    /// Every endpoint, by ifindex.
    pub(crate) fn entries(&self) -> Result<Vec<(u32, EndpointInfo)>, EbpfError> {
        read_entries(&self.slots, &self.overflow)
    }

    /// The borrowed maps, for a dump.
    pub(crate) fn maps(&self) -> (&Array<MapData, EndpointInfo>, &BpfHashMap<MapData, u32, EndpointInfo>) {
        (&self.slots, &self.overflow)
    }
}

/// Every endpoint of the two maps, by ifindex: the present slots of the
/// array, then the hash entries.
pub(crate) fn read_entries(
    slots: &Array<MapData, EndpointInfo>,
    overflow: &BpfHashMap<MapData, u32, EndpointInfo>,
) -> Result<Vec<(u32, EndpointInfo)>, EbpfError> {
    let mut out = Vec::new();
    for (i, v) in slots.iter().enumerate() {
        let info = v.map_err(map_err(maps::EP_SLOTS, format!("read slot {i}")))?;
        if info.flags & EP_PRESENT != 0 {
            out.push((i as u32, info));
        }
    }
    for e in overflow.iter() {
        let (ifindex, info) = e.map_err(|e: MapError| map_err(maps::ENDPOINTS, "iterate")(e))?;
        out.push((ifindex, info));
    }
    Ok(out)
}
