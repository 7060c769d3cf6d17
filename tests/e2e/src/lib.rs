//! npm's end-to-end conformance suite on real network-namespace pods.
//!
//! - [`cluster`]: the netns cluster (pods are netns with veths to the root
//!   netns, serving TCP/UDP 80 and 81, SCTP on crafted packets).
//! - [`probe`]: parallel TCP/UDP/SCTP probes with retries.
//! - [`runner`]: runs the case catalogue (`tests/conformance/*.yaml`)
//!   against the simulator or a real agent.
//! - [`nodes`]: several nodes (netns, private mount namespaces, a routed
//!   fabric); [`cni`]: pods wired by the reference CNI plugins and npm-cni
//!   as a container runtime wires them.
//! - [`chaos`]: the chaos soak (a seeded schedule of changes and faults,
//!   continuous probes, an oracle over the states passed through).
//! - [`enforcement`]: the enforcement bench (policy and pod latency as
//!   probes see it, npm-cni's hold of CNI ADD).
//! - [`kube_proxy`]: a node's Service DNAT as kube-proxy programs it (iptables
//!   and nftables modes); [`endpointslices`]: the EndpointSlice controller.
//! - [`nodeport_fixture`]: helpers of the NodePort suite (source echo).
#![deny(missing_docs)]

pub mod api;
pub mod chaos;
pub mod cluster;
pub mod cni;
pub mod demo;
pub mod endpointslices;
pub mod enforcement;
pub mod fixtures;
pub mod kube_proxy;
pub mod netns;
pub mod nodeport_fixture;
pub mod nodes;
pub mod plugin;
pub mod poller;
pub mod probe;
pub mod runner;
pub mod server;
