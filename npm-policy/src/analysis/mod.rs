//! Policy analysis on a snapshot, behind `npmctl lint`, `exposure` and
//! `preview`: plain functions over the model and the reference evaluator
//! ([`crate::evaluate`]), no I/O.
//!
//! - [`universe`]: the finite probes (pods, node addresses, one address per
//!   region the policies' CIDRs cut, one port per run the policies and
//!   container ports cut) that decide every flow;
//! - [`lint`]: shadowed, unmatched and overlapping ClusterNetworkPolicy
//!   rules, Pass rules without effect, policies and peers that select
//!   nothing, undefined named ports;
//! - [`exposure`]: per namespace and direction, the unprotected pods and
//!   the rules opening pods to addresses outside the cluster;
//! - [`preview`]: recorded flows decided before and after a change.

pub mod exposure;
pub mod lint;
pub mod preview;
pub mod universe;
