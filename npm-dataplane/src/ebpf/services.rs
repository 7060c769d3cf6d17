//! `NPM_SERVICES`, the Service keys of the datapath (see
//! `npm_common::service`): [`ServicePort`], the user-space form of a key,
//! and [`ServicesMap`], the pinned map written level-triggered
//! ([`ServicesMap::sync`]: the map is made equal to the wanted set).
//!
//! The map is pinned beside the other maps by the loader
//! ([`super::EbpfDataplane::open`]); [`ServicesMap::open`] opens that pin
//! by itself, so the agent's Service watcher writes it without the
//! dataplane object.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv6Addr};
use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, MapData};
use npm_common::{maps, ServiceKey, ServiceValue};

use super::errors::{map_err, removed, EbpfError};
use super::pins::open_pinned;

/// One Service key: an address (a ClusterIP, or a node address for a
/// NodePort), a port and a protocol number, with its `SVC_*` flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ServicePort {
    /// The address (IPv4 or IPv6; IPv4-mapped IPv6 is IPv4).
    pub addr: IpAddr,
    /// The port (the service port of a ClusterIP, or the NodePort).
    pub port: u16,
    /// Protocol number (`npm_common::proto`: TCP, UDP or SCTP).
    pub protocol: u8,
}

impl ServicePort {
    /// The map key of this port.
    pub fn key(&self) -> ServiceKey {
        let v6 = match self.addr {
            IpAddr::V4(a) => a.to_ipv6_mapped(),
            IpAddr::V6(a) => a,
        };
        ServiceKey {
            addr: v6.octets(),
            port: self.port,
            protocol: self.protocol,
            pad: 0,
        }
    }

    /// The port of a map key (an IPv4-mapped address is IPv4).
    pub fn from_key(k: &ServiceKey) -> ServicePort {
        let a = Ipv6Addr::from(k.addr);
        ServicePort {
            addr: a.to_ipv4_mapped().map_or(IpAddr::V6(a), IpAddr::V4),
            port: k.port,
            protocol: k.protocol,
        }
    }
}

/// What one [`ServicesMap::sync`] changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServicesSync {
    /// Keys written (new, or with other flags).
    pub written: usize,
    /// Keys removed.
    pub removed: usize,
    /// Keys in the map afterwards.
    pub total: usize,
}

/// The pinned `NPM_SERVICES` map.
pub struct ServicesMap {
    map: BpfHashMap<MapData, ServiceKey, ServiceValue>,
}

impl std::fmt::Debug for ServicesMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServicesMap").finish_non_exhaustive()
    }
}

impl ServicesMap {
    /// Opens `<pin_dir>/NPM_SERVICES` (pinned by the loader).
    pub fn open(pin_dir: &Path) -> Result<Self, EbpfError> {
        Ok(ServicesMap {
            map: open_pinned(pin_dir, maps::SERVICES)?,
        })
    }

    /// Every key in the map with its flags.
    pub fn entries(&self) -> Result<BTreeMap<ServicePort, u32>, EbpfError> {
        let mut out = BTreeMap::new();
        for kv in self.map.iter() {
            let (k, v) = kv.map_err(map_err(maps::SERVICES, "iterate"))?;
            out.insert(ServicePort::from_key(&k), v.flags);
        }
        Ok(out)
    }

    /// Makes the map hold exactly `wanted` (port -> `SVC_*` flags): writes
    /// what is missing or differs first, then removes what is not wanted.
    /// A set larger than the map (`sizes::SERVICES`) is refused before
    /// anything is written.
    pub fn sync(&mut self, wanted: &BTreeMap<ServicePort, u32>) -> Result<ServicesSync, EbpfError> {
        let cap = npm_common::sizes::SERVICES as usize;
        if wanted.len() > cap {
            return Err(EbpfError::Map {
                map: maps::SERVICES,
                op: format!("sync {} keys (the map holds {cap})", wanted.len()),
                source: Box::new(aya::maps::MapError::OutOfBounds {
                    index: wanted.len() as u32,
                    max_entries: cap as u32,
                }),
            });
        }
        let have = self.entries()?;
        let mut out = ServicesSync::default();
        for (p, flags) in wanted {
            if have.get(p) != Some(flags) {
                self.map
                    .insert(p.key(), ServiceValue { flags: *flags }, 0)
                    .map_err(map_err(maps::SERVICES, format!("insert {p:?}")))?;
                out.written += 1;
            }
        }
        let stale: BTreeSet<&ServicePort> = have.keys().filter(|p| !wanted.contains_key(p)).collect();
        for p in stale {
            removed(self.map.remove(&p.key()), maps::SERVICES, format!("{p:?}"))?;
            out.removed += 1;
        }
        out.total = wanted.len();
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use npm_common::proto;

    #[test]
    fn keys_round_trip_with_ipv4_mapped() {
        for addr in ["10.96.0.10".parse().unwrap(), "fd00::10".parse().unwrap()] {
            let p = ServicePort {
                addr,
                port: 53,
                protocol: proto::UDP,
            };
            let k = p.key();
            assert_eq!(k.port, 53);
            assert_eq!(ServicePort::from_key(&k), p);
        }
        let k = ServicePort {
            addr: "10.96.0.10".parse().unwrap(),
            port: 80,
            protocol: proto::TCP,
        }
        .key();
        assert_eq!(&k.addr[10..], &[0xff, 0xff, 10, 96, 0, 10]);
    }
}
