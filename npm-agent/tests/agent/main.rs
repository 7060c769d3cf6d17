//! The agent's integration tests, one test binary (each module was a test
//! binary of its own: one link of the agent instead of forty). The tests
//! of all modules run in parallel in this one process: a kernel test names
//! its netns, veths, pins, nft tables and temp dirs `<module prefix><pid>...`
//! with a prefix no other module uses, takes root-namespace subnets no other
//! module takes, and sweeps only leftovers of its own prefix whose process is
//! gone; process-wide state (IPv4 forwarding, the tracing subscriber) is
//! shared through `common`.

#[allow(dead_code)]
#[path = "common/cni_chain.rs"]
mod cni_chain;
#[allow(dead_code)]
#[path = "common/cni_plugins.rs"]
mod cni_plugins;
mod cnp_support;
mod common;

/// npm tc filters anywhere on the node make an `auto` agent attach with tc
/// (it keeps the mode in place on the node). The test whose agent makes
/// such filters takes this for writing; the tests whose agents run in
/// `auto` mode and expect tcx take it for reading.
pub static TC_FILTERS: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

mod bad_input;
mod bridge_netfilter;
mod chart;
mod chart_metrics;
mod chart_node_restriction;
mod cli;
mod cni_chained;
mod cni_facts;
mod cni_pod_start;
mod cnp_guard;
mod cnp_invalid;
mod cnp_no_crd;
mod cnp_relist;
mod cnp_tiers_ebpf;
mod cnp_tiers_nft;
mod cnp_versions;
mod cross_node_reuse;
mod debug_portforward;
mod dns_capture;
mod guard_held_removals;
mod guard_policies;
mod guard_tiers_restart;
mod health_readyz;
mod http;
mod incident1;
mod invalid_policy;
mod kernel_ebpf;
mod kernel_nft;
mod lifecycle_bpffs;
mod lifecycle_cleanup;
mod lifecycle_lock;
mod lifecycle_uninstall;
mod map_full;
mod metrics_map_fill;
mod node_addresses;
mod node_bridge_ebpf;
mod node_bridge_nft;
mod node_interfaces;
mod node_taint;
mod nodes_identity;
mod outage;
mod partial_cache;
mod pod_conditions;
mod prometheus_scrape;
mod restart_ids;
mod restart_kill9;
mod restart_numbers;
mod restart_numbers_nft;
mod services_ebpf;
mod sigterm;
mod surface_from_pod;
mod sync_thread;
