//! The kernel map fill as the agent's metrics publish it: a real eBPF
//! dataplane (pins `/sys/fs/bpf/npmmf<pid>`) is synced with a known state,
//! its [`EbpfDataplane::map_fill`] and [`EbpfDataplane::events_lost`] go
//! through [`Metrics::map_fill`] and [`Metrics::ringbuf_events_lost`], and
//! the rendered `npm_map_entries{map}` equal the entries written and the
//! entries the pinned maps hold (counted here by iterating them);
//! `npm_map_capacity{map}` are the map sizes. Needs root (bpffs).

use std::path::PathBuf;

use crate::common::netns::clear_stale_dirs;
use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use npm_agent::telemetry::{sample, Metrics};
use npm_common::{maps, sizes, IpInfo, IpKey, IDENTITY_FIRST_CIDR};
use npm_dataplane::ebpf::{AttachMode, EbpfDataplane, EbpfOptions};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{Compiled, IpEntry};

const PREFIX: &str = "npmmf";

struct Pins(PathBuf);

impl Drop for Pins {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn map_entries_and_capacity_metrics_have_the_kernel_values() {
    clear_stale_dirs("/sys/fs/bpf", PREFIX);
    npm_dataplane::ebpf::ensure_bpffs().unwrap();
    let pins = Pins(PathBuf::from(format!("/sys/fs/bpf/{PREFIX}{}", std::process::id())));
    let _ = std::fs::remove_dir_all(&pins.0);
    let mut dp = EbpfDataplane::open(EbpfOptions {
        object: None,
        pin_dir: pins.0.clone(),
        bench_no_ct_create: false,
        attach: AttachMode::Tcx,
    })
    .unwrap_or_else(|e| panic!("open: {e}"));

    let mut c = Compiled::default();
    for i in 0..777u32 {
        let addr = format!("10.63.{}.{}", i / 200, i % 200 + 1).parse().unwrap();
        c.ipcache.insert(
            addr,
            IpEntry {
                identity: 300 + i % 7,
                cidr_identity: 0,
                owner: 0,
            },
        );
    }
    for i in 0..12u32 {
        c.cidrs
            .insert(format!("172.16.{i}.0/24").parse().unwrap(), IDENTITY_FIRST_CIDR + i);
    }
    dp.sync_full(&c, &Default::default()).unwrap();

    let m = Metrics::new().unwrap();
    m.map_fill(&dp.map_fill());
    m.ringbuf_events_lost(dp.events_lost().unwrap());
    let text = m.render();
    let series = |name: &str, map: &str| sample(&text, &format!("{name}{{map=\"{map}\"}}"));

    let data = MapData::from_pin(pins.0.join(maps::IPCACHE)).unwrap();
    let kernel: BpfHashMap<_, IpKey, IpInfo> = BpfHashMap::try_from(Map::from_map_data(data).unwrap()).unwrap();
    let in_kernel = kernel.keys().count() as f64;
    assert_eq!(in_kernel, 777.0);
    assert_eq!(series("npm_map_entries", maps::IPCACHE), Some(in_kernel), "{text}");
    assert_eq!(
        series("npm_map_capacity", maps::IPCACHE),
        Some(f64::from(sizes::IPCACHE))
    );
    assert_eq!(series("npm_map_entries", maps::IPCACHE4), Some(777.0));
    assert_eq!(series("npm_map_entries", maps::CIDRS), Some(12.0));
    assert_eq!(series("npm_map_entries", maps::POLICY), Some(0.0));
    assert_eq!(series("npm_map_capacity", maps::POLICY), Some(f64::from(sizes::POLICY)));
    assert_eq!(series("npm_map_entries", maps::CT4), Some(0.0));
    assert_eq!(sample(&text, "npm_ringbuf_events_lost_total"), Some(0.0));

    // A diff moves the gauges with the kernel.
    let mut next = c.clone();
    let gone: Vec<_> = next.ipcache.keys().take(100).copied().collect();
    for a in gone {
        next.ipcache.remove(&a);
    }
    dp.apply(&c.diff(&next), &next, &Default::default()).unwrap();
    m.map_fill(&dp.map_fill());
    let text = m.render();
    assert_eq!(
        sample(&text, &format!("npm_map_entries{{map=\"{}\"}}", maps::IPCACHE)),
        Some(kernel.keys().count() as f64)
    );
    assert_eq!(kernel.keys().count(), 677);
}
