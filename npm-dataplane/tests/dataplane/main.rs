//! The dataplane's integration tests, one test binary (each module was a
//! test binary of its own). The tests of all modules run in parallel in this
//! one process: each module names its interfaces, netns, pins and tables
//! with tags or prefixes no other module uses (`npt<pid><tag>`,
//! `npmt-<pid>-<tag>`, `/sys/fs/bpf/npm-test-<pid>-<tag>`, `<module
//! prefix><pid>...`) and sweeps only leftovers whose process is gone.

mod ebpf_common;
mod fuzz_cases;
mod fuzz_judge;
mod fuzz_packets;
mod netns_common;
mod nft_common;
mod random_compiled;

use std::sync::{Mutex, MutexGuard};

/// The binary's one serial lock: `auto` (ebpf_attach_modes) looks at every
/// npm tc filter on the node, so its tests and the tests that make tc
/// filters (the tc variants of ebpf_veth and ebpf_restart) run one at a
/// time.
static SERIAL: Mutex<()> = Mutex::new(());

/// Take [`SERIAL`] (a panicked holder does not poison it for the others).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

mod ebpf_allow_events;
mod ebpf_attach_modes;
mod ebpf_ct_quota;
mod ebpf_differential;
mod ebpf_established;
mod ebpf_fastpath;
mod ebpf_fill;
mod ebpf_fold;
mod ebpf_fuzz;
mod ebpf_half_close;
mod ebpf_icmp_errors;
mod ebpf_inspect;
mod ebpf_owner_change;
mod ebpf_packets;
mod ebpf_restart;
mod ebpf_rule_counters;
mod ebpf_services;
mod ebpf_subjects;
mod ebpf_tiers;
mod ebpf_tunnels;
mod ebpf_verifier;
mod ebpf_veth;
mod map_size;
mod nft_conntrack;
mod nft_differential;
mod nft_established;
mod nft_flow_events;
mod nft_golden;
mod nft_rule_counters;
mod nft_scale;
mod nft_services;
mod nft_tiers;
mod nft_traffic;
mod vxlan_pmtu;
