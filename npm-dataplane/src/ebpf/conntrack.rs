//! The flow state the datapath keeps per endpoint id: `NPM_CT` (conntrack,
//! [`CtKey`]), `NPM_CT4` (its IPv4 form, [`CtKey4`]) and `NPM_FRAGS`
//! (fragment tracking, [`FragKey`]). The loader never creates entries; it
//! counts and reads them, copies them from an older map layout and drops
//! them all when that copy cannot be used; every other purge is the
//! conntrack worker's (`ct_worker.rs`), off the sync thread.

use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, MapData};
use aya::Ebpf;
use npm_common::{maps, CtKey, CtKey4, CtValue, FragKey, FragValue};

use super::errors::{map_err, removed, EbpfError};
use super::loader::take_map;
use super::pins::open_pinned;

/// The three flow maps.
pub(crate) struct Flows {
    ct: BpfHashMap<MapData, CtKey, CtValue>,
    ct4: BpfHashMap<MapData, CtKey4, CtValue>,
    frags: BpfHashMap<MapData, FragKey, FragValue>,
}

impl Flows {
    /// Takes the flow maps out of the loaded object.
    pub(crate) fn take(bpf: &mut Ebpf) -> Result<Self, EbpfError> {
        Ok(Flows {
            ct: take_map(bpf, maps::CT)?,
            ct4: take_map(bpf, maps::CT4)?,
            frags: take_map(bpf, maps::FRAGS)?,
        })
    }

    /// Opens the flow maps pinned under `pin_dir` read-only.
    pub(crate) fn open_pinned(pin_dir: &Path) -> Result<Self, EbpfError> {
        Ok(Flows {
            ct: open_pinned(pin_dir, maps::CT)?,
            ct4: open_pinned(pin_dir, maps::CT4)?,
            frags: open_pinned(pin_dir, maps::FRAGS)?,
        })
    }

    /// Duplicates of the descriptors of `NPM_CT`, `NPM_CT4` and
    /// `NPM_FRAGS`, for the conntrack worker (`ct_worker.rs`).
    pub(crate) fn dup_fds(&self) -> Result<[std::os::fd::OwnedFd; 3], EbpfError> {
        use aya::maps::IterableMap;
        use std::os::fd::AsFd;
        let dup = |m: &MapData| {
            m.fd()
                .as_fd()
                .try_clone_to_owned()
                .map_err(|source| EbpfError::Conntrack { source })
        };
        Ok([dup(self.ct.map())?, dup(self.ct4.map())?, dup(self.frags.map())?])
    }

    /// Entries of `NPM_CT` and `NPM_CT4`.
    pub(crate) fn ct_len(&self) -> usize {
        self.ct.keys().filter(Result::is_ok).count() + self.ct4.keys().filter(Result::is_ok).count()
    }

    /// Entries of `NPM_CT` and of `NPM_CT4`, each.
    pub(crate) fn ct_lens(&self) -> (usize, usize) {
        (
            self.ct.keys().filter(Result::is_ok).count(),
            self.ct4.keys().filter(Result::is_ok).count(),
        )
    }

    /// Entries of `NPM_FRAGS`.
    pub(crate) fn frag_len(&self) -> usize {
        self.frags.keys().filter(Result::is_ok).count()
    }

    /// The entries of `NPM_CT` and `NPM_CT4`, the latter in [`CtKey`] form.
    pub(crate) fn ct_entries(&self) -> Vec<(CtKey, CtValue)> {
        self.ct
            .iter()
            .filter_map(Result::ok)
            .chain(self.ct4.iter().filter_map(Result::ok).map(|(k, v)| (k.to_key(), v)))
            .collect()
    }

    /// Copies every entry of `src` (another layout's maps) into these.
    /// Returns how many were copied.
    pub(crate) fn copy_from(&mut self, src: &Flows) -> Result<usize, EbpfError> {
        let mut copied = 0;
        for (k, v) in src.ct.iter().filter_map(Result::ok) {
            self.ct
                .insert(k, v, 0)
                .map_err(map_err(maps::CT, "copy from another layout"))?;
            copied += 1;
        }
        for (k, v) in src.ct4.iter().filter_map(Result::ok) {
            self.ct4
                .insert(k, v, 0)
                .map_err(map_err(maps::CT4, "copy from another layout"))?;
            copied += 1;
        }
        for (k, v) in src.frags.iter().filter_map(Result::ok) {
            self.frags
                .insert(k, v, 0)
                .map_err(map_err(maps::FRAGS, "copy from another layout"))?;
            copied += 1;
        }
        Ok(copied)
    }

    /// Deletes the entries of every endpoint id `keep` rejects.
    pub(crate) fn purge(&mut self, keep: impl Fn(u32) -> bool) -> Result<(), EbpfError> {
        purge_map(&mut self.ct, maps::CT, |k| k.endpoint, &keep)?;
        purge_map(&mut self.ct4, maps::CT4, |k| k.endpoint, &keep)?;
        purge_map(&mut self.frags, maps::FRAGS, |k| k.endpoint, &keep)
    }
}

/// Deletes every entry of `map` whose endpoint (`endpoint_of` the key)
/// `keep` rejects.
fn purge_map<K: aya::Pod, V: aya::Pod>(
    map: &mut BpfHashMap<MapData, K, V>,
    name: &'static str,
    endpoint_of: impl Fn(&K) -> u32,
    keep: &impl Fn(u32) -> bool,
) -> Result<(), EbpfError> {
    let doomed: Vec<K> = map
        .keys()
        .filter_map(Result::ok)
        .filter(|k| !keep(endpoint_of(k)))
        .collect();
    for k in doomed {
        removed(map.remove(&k), name, format_args!("endpoint {}", endpoint_of(&k)))?;
    }
    Ok(())
}
