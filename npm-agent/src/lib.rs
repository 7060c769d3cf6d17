//! The npm node agent: watches pods, namespaces and NetworkPolicies, keeps
//! the kernel dataplane equal to the compiled policy of its node, and
//! exports metrics and health.
//!
//! One module per step of the flow:
//!
//! - [`k8s`]: API objects in: watchers, the complete-list-only stores
//!   (incident 2) and the direct read;
//! - [`reconcile`]: the level-triggered sync loop: the compiler bridge
//!   (objects -> snapshot -> compiled policy), the mass-deletion guard,
//!   adoption of a previous agent's state, the cross-check, IP conflicts;
//! - [`cni`]: the npm-cni socket: what the CNI plugin tells the agent
//!   about this node's pods (attachments, tombstones), overlaid on the
//!   pods the compiler sees, and CNI ADD held until the pod is enforced;
//! - [`node`]: this node: its addresses and the host-side interfaces of
//!   its local endpoints;
//! - [`services`]: Services and Nodes watched into the eBPF dataplane's
//!   `NPM_SERVICES`, and `node_exit` on the uplinks (egress of Service
//!   traffic decided after kube-proxy's DNAT);
//! - [`dns`]: learning the DNS answers of trusted servers (what
//!   ClusterNetworkPolicy `domainNames` peers match);
//! - [`dataplanes`]: opening the eBPF or nftables dataplane;
//! - [`telemetry`]: Prometheus metrics, deny flow logs, `/metrics`,
//!   `/healthz`, `/readyz`;
//! - [`agent`]: wiring of all of the above (used by `main` and the tests);
//! - [`lifecycle`]: the node's lifecycle outside the loop: `mount-bpffs`,
//!   the one-agent-per-pin-directory lock, `cleanup`, `uninstall`, `pause`;
//! - [`inspect`], [`simulate`]: the `npm-agent inspect` and
//!   `npm-agent simulate` subcommands;
//! - [`explain`]: `npm-agent explain` and the agent's `/explain`.
#![deny(missing_docs)]

pub mod agent;
pub mod cni;
pub mod dataplanes;
pub mod dns;
pub mod explain;
pub mod inspect;
pub mod k8s;
pub mod lifecycle;
pub mod node;
pub mod reconcile;
pub mod services;
pub mod simulate;
pub mod telemetry;

// `dataplanes.rs` names the trait by its former path, `crate::sync`.
use reconcile as sync;
