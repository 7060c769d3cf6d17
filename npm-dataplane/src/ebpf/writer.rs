//! Writing the compiled policy into the maps, in the order documented on
//! [`npm_policy::compiled::CompiledDiff`] (invariant 4 of ARCHITECTURE.md):
//! upserts (policy and tier entries, ipcache and CIDRs, endpoints), then
//! removals in the same order, then the folded decisions of the
//! directions the batch changed. [`EbpfDataplane::apply_diff`] applies a diff;
//! [`EbpfDataplane::sync`] writes everything and sweeps what is not part of
//! it (mark and sweep against adopted pins), after purging the flows of
//! endpoint ids that now name another pod.
//!
//! When a map is nearly full the order bends, never towards allowing more:
//! if a diff's `NPM_POLICY` (or `NPM_IPCACHE`) upserts would not fit beside
//! the entries it removes, those removals go first (a removal only takes
//! away an allow, or an address, that the target does not have); a full
//! sync whose inserts find the map full sweeps that map's unwanted entries
//! first and inserts again. The states that do not fit at all are trimmed
//! before they get here (`fit.rs`).

use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;

use npm_common::{maps, PolicyKey};
use npm_policy::compiled::{Compiled, CompiledDiff, Direction, Tier, TierEntry, TierValue};

use super::errors::EbpfError;
use super::{epochs, fit, tiers, translate, EbpfDataplane};
use crate::{AdoptedEndpoint, Interfaces};

/// The tier flags of subject `id` derived from its entries in `tiers`
/// (those [`translate::subject_tier_flags`] gives it), by four range
/// lookups instead of a pass over every entry of every subject.
fn entry_tier_flags(tiers: &BTreeMap<TierEntry, TierValue>, id: u32) -> u32 {
    let mut flags = 0;
    for direction in [Direction::Ingress, Direction::Egress] {
        for tier in [Tier::Admin, Tier::Baseline] {
            let lo = TierEntry {
                subject: id,
                direction,
                tier,
                peer: 0,
                protocol: None,
                ports: (0, 0),
            };
            if tiers
                .range(lo..)
                .next()
                .is_some_and(|(e, _)| e.subject == id && e.direction == direction && e.tier == tier)
            {
                flags |= translate::tier_flag(tier, direction);
            }
        }
    }
    flags
}

/// How long a full sync waits for the conntrack worker to drop the flows
/// of renumbered endpoint ids (a pass over full tables takes well under a
/// second; the sync fails, and is retried, past this).
const RENUMBERED_PURGE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(60);

impl EbpfDataplane {
    /// [`crate::Dataplane::apply`] with the loader's own error type.
    pub fn apply_diff(
        &mut self,
        diff: &CompiledDiff,
        next: &Compiled,
        interfaces: &Interfaces,
    ) -> Result<(), EbpfError> {
        // The policy flags are computed for the groups the diff touches.
        self.policy.begin_apply(&diff.policy);
        self.fold.begin_apply(diff, next);
        // The ids this batch may program keep their flows meanwhile.
        self.ct_worker.keep_also(next.endpoints.keys().copied());
        let moved = self.moved_in_diff(diff);
        let mut touched = epochs::decisions_touched(diff, next, &self.epochs.enforce);
        // An endpoint that entered `enforce` (an annotation change alone):
        // its kept flows are judged by the policy in force.
        touched.extend(self.epochs.newly_enforced());
        let result = self
            .apply_diff_maps(diff, next, interfaces)
            .and_then(|()| self.refold(next, interfaces));
        self.policy.end_batch(result.is_ok());
        if result.is_err() {
            self.fold.poison();
        }
        if result.is_ok() {
            self.fill.applied(diff, next);
        }
        self.purge_moved(moved);
        self.publish_endpoints(!diff.endpoints.remove.is_empty());
        result?;
        self.advance_epochs(&touched)?;
        self.epochs.judged_all();
        Ok(())
    }

    /// Connection semantics `enforce`: once a batch is written, the
    /// decision epoch of each endpoint of `touched` moves, so that each of
    /// its tracked flows is decided again, once, by the policy just
    /// written (`epochs.rs`). Only after a successful batch: a failed one
    /// is followed by a full sync, which moves them all.
    fn advance_epochs(&mut self, touched: &BTreeSet<u32>) -> Result<(), EbpfError> {
        if touched.is_empty() {
            return Ok(());
        }
        let ifindexes: Vec<u32> = touched
            .iter()
            .filter_map(|id| self.programmed.get(id).copied())
            .collect();
        let n = self.epochs.advance(ifindexes)?;
        tracing::debug!(
            endpoints = n,
            "decision epochs moved: their tracked flows are decided again"
        );
        Ok(())
    }

    /// The addresses of `diff` that leave a pod or pass to another owner
    /// (see `purge_moved`); `owners` follows the
    /// diff.
    fn moved_in_diff(&mut self, diff: &CompiledDiff) -> HashSet<IpAddr> {
        let mut moved = HashSet::new();
        for addr in &diff.ipcache.remove {
            if self.owners.remove(addr).is_some() {
                moved.insert(*addr);
            }
        }
        for (addr, e) in &diff.ipcache.upsert {
            let old = if e.owner == 0 {
                self.owners.remove(addr)
            } else {
                self.owners.insert(*addr, e.owner)
            };
            if old.is_some_and(|o| o != e.owner) {
                moved.insert(*addr);
            }
        }
        moved
    }

    /// `moved_in_diff` for a full sync to `compiled`.
    fn moved_in_sync(&mut self, compiled: &Compiled) -> HashSet<IpAddr> {
        let moved = self
            .owners
            .iter()
            .filter(|(a, o)| compiled.ipcache.get(*a).map(|e| e.owner) != Some(**o))
            .map(|(a, _)| *a)
            .collect();
        self.owners = compiled
            .ipcache
            .iter()
            .filter(|(_, e)| e.owner != 0)
            .map(|(a, e)| (*a, e.owner))
            .collect();
        moved
    }

    /// After a batch: the programmed endpoints go to the conntrack worker
    /// (`ct_worker.rs`): every other endpoint id's flows go at its next
    /// pass (requested when `removed`), and the quota slots follow.
    fn publish_endpoints(&mut self, removed: bool) {
        self.ct_worker.keep(&self.programmed, removed);
    }

    /// Incident 1: a new owner never carries the old owner's connections.
    /// The flows of every address in `moved` (it left the pod that held it,
    /// or passed to another pod: identities are shared by label set, so
    /// only the owner tells) are deleted, local endpoints' flows towards a
    /// remote address included: the next packet is decided anew, against
    /// the new owner. Requested from the conntrack worker once the batch's
    /// ipcache is written, never waited for: the purge is complete when
    /// the worker's completed ticket reaches the request's
    /// ([`EbpfDataplane::wait_flow_purges`]); until then the old flows
    /// pass, as they did while the purge ran on the sync thread. A flow
    /// the per-CPU flow cache vouched for passes until its slot expires
    /// (`FLOW_TTL_NS`, 250 ms).
    fn purge_moved(&mut self, moved: HashSet<IpAddr>) {
        if moved.is_empty() {
            return;
        }
        let peers: HashSet<[u8; 16]> = moved
            .iter()
            .map(|a| match a {
                IpAddr::V4(v4) => v4.to_ipv6_mapped().octets(),
                IpAddr::V6(v6) => v6.octets(),
            })
            .collect();
        let ticket = self.ct_worker.purge_peers(peers);
        tracing::debug!(
            addresses = moved.len(),
            ticket,
            "purge of the flows of addresses that changed hands requested"
        );
    }

    /// [`crate::Dataplane::sync_full`] with the loader's own error type:
    /// writes everything in `compiled`, then deletes every kernel entry (and
    /// pinned link) that is not part of it.
    pub fn sync(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), EbpfError> {
        self.policy.begin_sync();
        self.fold.begin_sync();
        self.ct_worker.keep_also(compiled.endpoints.keys().copied());
        let moved = self.moved_in_sync(compiled);
        let result = self
            .sync_maps(compiled, interfaces)
            .and_then(|()| self.refold(compiled, interfaces));
        self.policy.end_batch(result.is_ok());
        if result.is_err() {
            self.fold.poison();
        }
        self.purge_moved(moved);
        // The sweep: every id no longer programmed loses its flows.
        self.publish_endpoints(result.is_ok());
        result?;
        // Anything may have changed (a restart, a failed batch before):
        // every `enforce` endpoint's flows are decided again once.
        let all: BTreeSet<u32> = compiled
            .endpoints
            .keys()
            .filter(|id| self.epochs.enforce.contains(id))
            .copied()
            .collect();
        self.advance_epochs(&all)?;
        self.epochs.judged_all();
        // The maps are right; a pin that cannot be removed yet is only
        // logged and retried at the next full sync.
        if let Err(e) = self.retire_other_layouts() {
            tracing::warn!(error = %e, "retiring the pins of other map layouts");
        }
        Ok(())
    }

    /// The last step of a batch, once every other map holds `next`: the
    /// folded decisions follow it (`fold.rs`), and the endpoint records
    /// whose `EP_FOLD_*` flags that changes are written again.
    fn refold(&mut self, next: &Compiled, interfaces: &Interfaces) -> Result<(), EbpfError> {
        if self.fold.finish(next) {
            self.program_endpoints(next, interfaces, &BTreeSet::new())?;
        }
        Ok(())
    }

    fn apply_diff_maps(
        &mut self,
        diff: &CompiledDiff,
        next: &Compiled,
        interfaces: &Interfaces,
    ) -> Result<(), EbpfError> {
        // A nearly full map: its removals first (see the module doc).
        let (policy_first, ipcache_first) = self.removals_first(diff)?;
        if policy_first {
            for entry in &diff.policy.remove {
                self.policy.remove(entry, next)?;
            }
        }
        if ipcache_first {
            for addr in &diff.ipcache.remove {
                self.ipcache.remove(*addr)?;
            }
        }
        // 1. upserts: policy and tiers, ipcache and CIDRs, endpoints (whose
        // tier flags then point at written entries).
        for (entry, rule) in &diff.policy.upsert {
            self.policy.upsert(entry, *rule)?;
        }
        for (entry, value) in &diff.tiers.upsert {
            self.tiers.upsert(entry, value)?;
        }
        for (addr, e) in &diff.ipcache.upsert {
            self.ipcache.upsert(*addr, translate::ip_info(e))?;
        }
        for (net, id) in &diff.cidrs.upsert {
            self.cidrs.upsert(net, *id)?;
        }
        let changed: BTreeSet<u32> = diff.endpoints.upsert.iter().map(|(id, _)| *id).collect();
        self.program_endpoints(next, interfaces, &changed)?;
        // 2. removals in the same order.
        if !policy_first {
            for entry in &diff.policy.remove {
                self.policy.remove(entry, next)?;
            }
        }
        for entry in &diff.tiers.remove {
            self.tiers.remove(entry, next)?;
        }
        if !ipcache_first {
            for addr in &diff.ipcache.remove {
                self.ipcache.remove(*addr)?;
            }
        }
        self.cidrs.remove(&diff.cidrs.remove, &next.cidrs)?;
        for id in &diff.endpoints.remove {
            self.written.remove(id);
            if let Some(ifindex) = self.programmed.remove(id) {
                if !self.programmed.values().any(|v| *v == ifindex) {
                    self.unprogram_ifindex(ifindex)?;
                }
            }
        }
        // Their flows go at the conntrack worker's next pass (requested at
        // the end of the batch: `publish_endpoints`).
        Ok(())
    }

    fn sync_maps(&mut self, compiled: &Compiled, interfaces: &Interfaces) -> Result<(), EbpfError> {
        // Flows tracked under an endpoint id that now names another pod go
        // first (adopted pins: a restarted agent may number endpoints anew).
        // Until a full sync succeeded, the records are those adopted at
        // open (after a layout upgrade, the older layout's, whose flows were
        // copied); then the kernel's.
        let records: Vec<AdoptedEndpoint> = if self.full_synced {
            self.endpoints.records()?
        } else {
            self.adopted_endpoints.clone()
        };
        self.purge_renumbered_flows(compiled, interfaces, &records)?;
        // The IPv4 front first: a slot may only hold its address's current
        // entry (the writes below then fill the free slots).
        self.ipcache.sweep_front(&compiled.ipcache);
        // Mark: write everything.
        let mut want_policy: BTreeMap<PolicyKey, u32> = BTreeMap::new();
        for (entry, rule) in &compiled.policy {
            for k in translate::policy_keys(entry)? {
                want_policy.insert(k, *rule);
            }
        }
        if let Err(e) = self.policy.insert_keys(&want_policy) {
            if e.full_map() != Some(maps::POLICY) {
                return Err(e);
            }
            // Full of entries the target does not want (adopted pins, a
            // failed apply): those go first, then the inserts again.
            tracing::warn!(
                wanted = want_policy.len(),
                "NPM_POLICY full during a full sync; removing unwanted keys first"
            );
            self.policy.sweep_keys(&want_policy)?;
            self.policy.insert_keys(&want_policy)?;
        }
        let want_tiers = tiers::want_keys(compiled)?;
        self.tiers.insert_keys(&want_tiers)?;
        for (addr, e) in &compiled.ipcache {
            match self.ipcache.upsert(*addr, translate::ip_info(e)) {
                Err(e) if e.full_map() == Some(maps::IPCACHE) => {
                    tracing::warn!(
                        wanted = compiled.ipcache.len(),
                        "NPM_IPCACHE full during a full sync; removing unwanted addresses first"
                    );
                    self.ipcache.sweep(&compiled.ipcache)?;
                    for (addr, e) in &compiled.ipcache {
                        self.ipcache.upsert(*addr, translate::ip_info(e))?;
                    }
                    break;
                }
                r => r?,
            }
        }
        for (net, id) in &compiled.cidrs {
            self.cidrs.upsert(net, *id)?;
        }
        // Every endpoint is rewritten: adopted maps may hold stale values.
        let all: BTreeSet<u32> = compiled.endpoints.keys().copied().collect();
        self.programmed.retain(|id, _| all.contains(id));
        self.written.retain(|id, _| all.contains(id));
        self.program_endpoints(compiled, interfaces, &all)?;

        // Sweep.
        self.policy.sweep_keys(&want_policy)?;
        self.tiers.sweep_keys(&want_tiers)?;
        self.ipcache.sweep(&compiled.ipcache)?;
        self.cidrs.sweep(&compiled.cidrs)?;
        let want_if: BTreeSet<u32> = self.programmed.values().copied().collect();
        let stale: Vec<u32> = self
            .endpoints
            .entries()?
            .into_iter()
            .map(|(ifindex, _)| ifindex)
            .filter(|k| !want_if.contains(k))
            .collect();
        for ifindex in stale {
            self.unprogram_ifindex(ifindex)?;
        }
        let stale_links: Vec<u32> = self.attached().into_iter().filter(|i| !want_if.contains(i)).collect();
        for ifindex in stale_links {
            self.detach(ifindex)?;
        }
        self.fill.synced(compiled, want_policy.len(), want_tiers.len());
        self.full_synced = true;
        Ok(())
    }

    /// Writes the endpoints of `next` that have an interface and need it
    /// (new, changed in `changed`, moved to another interface, or whose
    /// record differs from the one last written: its subject, or its
    /// `EP_NO_*_PEER_*`, tier or fold flags changed with the policy),
    /// attaching the programs. The subject is the endpoint's pod
    /// identity and the policy flags are its subject's (`policy_flags.rs`):
    /// when a subject's entries change, every endpoint of that subject is
    /// rewritten here. The tier flags are those of
    /// [`npm_policy::compiled::Endpoint::tiers`] and of the endpoint's
    /// entries in `next.tiers`. Endpoints without an interface are held back.
    fn program_endpoints(
        &mut self,
        next: &Compiled,
        interfaces: &Interfaces,
        changed: &BTreeSet<u32>,
    ) -> Result<(), EbpfError> {
        let policy_flags = self.policy.subject_flags(next).clone();
        for (&id, ep) in &next.endpoints {
            let Some(&ifindex) = interfaces.get(&id) else {
                // No interface known (yet, or any more): nothing may stay
                // keyed by an ifindex that could be reused.
                self.written.remove(&id);
                if let Some(old) = self.programmed.remove(&id) {
                    self.unprogram_ifindex(old)?;
                }
                continue;
            };
            let old = self.programmed.get(&id).copied();
            let mut info = translate::endpoint_info(id, ep);
            // The policy flags of its subject (its entries' owner).
            info.flags |= policy_flags
                .get(&info.subject)
                .copied()
                .unwrap_or(translate::EP_NO_PEER_ALL);
            info.flags |= entry_tier_flags(&next.tiers, info.subject);
            // Its subject's folded directions whose entries are current.
            info.flags |= self.fold.flags(info.subject);
            if old == Some(ifindex)
                && !changed.contains(&id)
                && self.attached_in_mode(ifindex)
                && self.written.get(&id) == Some(&info)
            {
                continue;
            }
            self.endpoints.replace(ifindex, info)?;
            self.written.insert(id, info);
            self.attach(ifindex)?;
            self.programmed.insert(id, ifindex);
            if let Some(old) = old.filter(|o| *o != ifindex) {
                if !self.programmed.values().any(|v| *v == old) {
                    self.unprogram_ifindex(old)?;
                }
            }
        }
        Ok(())
    }

    /// Whether the `NPM_POLICY` and the `NPM_IPCACHE` removals of `diff`
    /// must go before its upserts: the map's entries (as the writer counted
    /// them) and the upserts would exceed its real size.
    fn removals_first(&self, diff: &CompiledDiff) -> Result<(bool, bool), EbpfError> {
        if !self.fill.known {
            return Ok((false, false));
        }
        let actual = &self.sizes.actual;
        let ipcache = self.fill.ipcache + diff.ipcache.upsert.len() > actual.ipcache as usize;
        let cap = actual.policy as usize;
        if self.fill.policy_keys + diff.policy.upsert.len() * fit::MAX_KEYS_PER_ENTRY <= cap {
            return Ok((false, ipcache));
        }
        let mut keys = self.fill.policy_keys;
        for (e, _) in &diff.policy.upsert {
            keys += translate::policy_keys(e)?.len();
        }
        Ok((keys > cap, ipcache))
    }

    fn unprogram_ifindex(&mut self, ifindex: u32) -> Result<(), EbpfError> {
        self.endpoints.remove(ifindex)?;
        self.detach(ifindex)
    }

    /// Deletes the conntrack and fragment entries tracked under an endpoint
    /// id of `compiled` that no record of `records` describes as the same
    /// endpoint (interface and addresses): after an agent restart an id may
    /// have been given anew, and a pod must never inherit another pod's
    /// flows (with a recycled address, the same 5-tuple); an id that no
    /// record carries can only hold orphans. Flows of an id whose endpoint
    /// is unchanged are kept; those of ids no longer used go with the sweep.
    fn purge_renumbered_flows(
        &mut self,
        compiled: &Compiled,
        interfaces: &Interfaces,
        records: &[AdoptedEndpoint],
    ) -> Result<(), EbpfError> {
        let by_id: BTreeMap<u32, &AdoptedEndpoint> = records.iter().map(|r| (r.id, r)).collect();
        let renumbered: BTreeSet<u32> = compiled
            .endpoints
            .iter()
            .filter(|(id, ep)| {
                !by_id
                    .get(id)
                    .is_some_and(|r| interfaces.get(id) == Some(&r.ifindex) && r.ipv4 == ep.ipv4 && r.ipv6 == ep.ipv6)
            })
            .map(|(id, _)| *id)
            .collect();
        if renumbered.is_empty() {
            return Ok(());
        }
        tracing::debug!(endpoints = ?renumbered, "dropping the flows of endpoint ids no record describes as the same endpoint");
        // Before any of them is programmed: waited for.
        self.ct_worker
            .purge_ids_now(renumbered.into_iter().collect(), RENUMBERED_PURGE_TIMEOUT)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `entry_tier_flags` gives every subject the flags of
    /// `translate::subject_tier_flags` (and 0 to one without entries).
    #[test]
    fn entry_tier_flags_match_a_pass_over_the_entries() {
        let mut rnd = npm_testkit::rng::xorshift(11);
        for _ in 0..200 {
            let mut tiers = BTreeMap::new();
            for _ in 0..rnd() % 30 {
                let e = TierEntry {
                    subject: (rnd() % 6) as u32,
                    direction: [Direction::Ingress, Direction::Egress][(rnd() % 2) as usize],
                    tier: [Tier::Admin, Tier::Baseline][(rnd() % 2) as usize],
                    peer: (rnd() % 4) as u32,
                    protocol: None,
                    ports: (0, 65535),
                };
                let v = TierValue {
                    action: npm_policy::compiled::TierAction::Deny,
                    rank: 1,
                    rule: 1,
                };
                tiers.insert(e, v);
            }
            let want = translate::subject_tier_flags(tiers.keys());
            for id in 0..7 {
                assert_eq!(entry_tier_flags(&tiers, id), want.get(&id).copied().unwrap_or(0));
            }
        }
    }
}
