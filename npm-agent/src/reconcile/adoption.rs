//! What a restarted agent takes over from the state its dataplane adopted
//! (a previous agent's pinned maps): the endpoint ids of the pods those
//! records still describe, the identity numbers that keep their meaning
//! (every other number above them), and the mass-deletion guard's first
//! reference
//! (see the [`reconcile`](crate::reconcile) module doc).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Instant;

use npm_dataplane::AdoptedEndpoint;
use npm_policy::adopt;
use npm_policy::numbers::NumberKind;

use super::compiler;
use super::dataplane::AgentDataplane;
use super::syncer::Syncer;
use crate::k8s::CompleteState;

impl<D: AgentDataplane> Syncer<D> {
    /// A compile before anything is programmed, when the dataplane adopted
    /// a previous agent's state, redone so that no number changes meaning:
    ///
    /// - endpoint ids: each pod whose interface holds a record with the
    ///   pod's own addresses keeps that record's id (and so its tracked
    ///   flows), every other endpoint is numbered above all adopted ids
    ///   (and above the ids of a failed attempt). So no packet of one pod is
    ///   ever decided under an id another pod's record had (the kernel keeps
    ///   the old records until the first sync rewrites them). Matching
    ///   relies on each pod having its own host-side interface (an ifindex
    ///   is not handed out again while its interface exists).
    /// - pod identities, CIDR identities and rule ids
    ///   ([`AgentDataplane::adopted_numbers`], `npm_policy::adopt::seed`):
    ///   an identity stays with an identity key only when the addresses that
    ///   carried it are exactly that key's addresses now, a CIDR identity
    ///   stays with its prefix, and every other number is handed out above
    ///   all adopted ones. The first sync writes the new ipcache before it
    ///   sweeps the old policy keys; so every address carries either its old
    ///   number (with the old allowances) or its new one, never a number
    ///   that stood for other addresses.
    pub(super) fn seed_endpoint_ids(&mut self, state: &CompleteState) {
        let dataplane = &self.dataplane;
        let adopted = self
            .adopted
            .get_or_insert_with(|| dataplane.adopted_endpoints())
            .clone();
        let numbers = self
            .adopted_numbers
            .get_or_insert_with(|| dataplane.adopted_numbers())
            .clone();
        let max = adopted.iter().map(|a| a.id).max();
        if max.is_none() && numbers.is_empty() {
            return;
        }
        let by_ifindex: HashMap<u32, &AdoptedEndpoint> = adopted.iter().map(|a| (a.ifindex, a)).collect();
        let compiled = self.incremental.compiled();
        let mut keep: BTreeMap<String, u32> = BTreeMap::new();
        if max.is_some() {
            let resolved = self
                .resolver
                .resolve_attached(compiled, &self.facts.attached_interfaces(compiled));
            let mut used = BTreeSet::new();
            for (id, ep) in &compiled.endpoints {
                let Some(a) = resolved.interfaces.get(id).and_then(|i| by_ifindex.get(i)) else {
                    continue;
                };
                if a.ipv4 == ep.ipv4 && a.ipv6 == ep.ipv6 && used.insert(a.id) {
                    keep.insert(ep.pod.uid.clone(), a.id);
                }
            }
        }
        let mut floor = adopt::seed(compiled, &numbers);
        tracing::info!(
            kept = keep.len(),
            adopted = adopted.len(),
            next = max.map_or(1, |m| m + 1),
            "endpoint ids of the adopted state kept for the pods they still describe"
        );
        tracing::info!(
            identities_kept = floor.ids.identities.len(),
            identities_adopted = numbers.identities.len(),
            cidrs_kept = floor.cidrs.len(),
            next_identity = floor.ids.next_identity,
            next_cidr = floor.ids.next_cidr,
            next_rule = floor.ids.next_rule,
            "identity numbers of the adopted state kept for exactly the addresses that carried them"
        );
        // The counters of a failed attempt stay floors (never reused).
        let ids = &mut floor.ids;
        ids.endpoints = keep;
        ids.limits = self.cfg.numbers;
        ids.raise_floor(NumberKind::Endpoint, max.map_or(1, |m| m + 1));
        if let Some(attempted) = &self.attempted_ids {
            ids.raise_to(attempted);
        }
        self.incremental = compiler::Incremental::new(state, &self.facts, &self.cfg.compile, Some(&floor));
    }

    /// Before the first sync of the agent's life: the guard's reference
    /// starts from what the dataplane adopted (a previous agent's pinned
    /// state: identities, endpoints, isolated directions, tiered
    /// directions), so a restarted agent's first sync is held like any
    /// other when it would remove most of it.
    pub(super) fn seed_guard(&mut self) {
        if self.guard_seeded {
            return;
        }
        self.guard_seeded = true;
        if self.programmed.is_some() {
            return;
        }
        if let Some((identities, endpoints)) = self.dataplane.adopted_counts() {
            if identities + endpoints > 0 {
                tracing::info!(
                    identities,
                    endpoints,
                    "mass-deletion guard: starting from the state adopted from a previous agent"
                );
                self.guard.observe(Instant::now(), identities, endpoints);
            }
        }
        // The isolated directions of the adopted records: without them a
        // first sync with no policy would open every isolated endpoint
        // unheld (the guard has no programmed policies to compare with).
        let dataplane = &self.dataplane;
        let adopted = self.adopted.get_or_insert_with(|| dataplane.adopted_endpoints());
        let isolated: usize = adopted
            .iter()
            .map(|a| a.isolated_ingress as usize + a.isolated_egress as usize)
            .sum();
        if isolated > 0 {
            tracing::info!(
                isolated,
                "mass-deletion guard: starting from the isolated endpoint directions adopted from a previous agent"
            );
            self.guard.observe_adopted_isolation(Instant::now(), isolated);
        }
        // The tiered endpoint directions the dataplane holds (an Admin or
        // Baseline tier with entries for an endpoint and direction): without
        // them a first sync with no ClusterNetworkPolicy would remove every
        // adopted Deny unheld (the guard has no programmed CNPs to compare
        // with).
        if let Some(tiered) = self.dataplane.adopted_tier_directions().filter(|t| *t > 0) {
            tracing::info!(
                tiered,
                "mass-deletion guard: starting from the tiered endpoint directions adopted from a previous agent"
            );
            self.guard.observe_adopted_tiers(Instant::now(), tiered);
        }
    }
}
