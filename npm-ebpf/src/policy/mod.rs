//! Steps 7 to 9 for a packet conntrack did not allow: isolation and the
//! tier flags, then the peer's identities ([`ipcache`]), the decision
//! folded ahead of time for the peer's class ([`fold`], when the subject's
//! direction is folded and the class is there), else the truth: the Admin
//! tier ([`tiers`]), the allows of the endpoint's policy ([`lpm`], keyed
//! by the endpoint's subject, its pod identity, which every local
//! endpoint of that identity shares) and the Baseline tier. A `Policy`
//! allow also says which rule allowed it (for [`crate::rule_counters`]).

pub(crate) mod fold;
pub(crate) mod ipcache;
pub(crate) mod lpm;
pub(crate) mod tiers;

use npm_common::{
    ep_no_peer_flag, rule_slot, EndpointInfo, Reason, DIR_INGRESS, EP_ADMIN_INGRESS, EP_BASELINE_INGRESS,
    EP_ISOLATED_EGRESS, EP_ISOLATED_INGRESS, EP_TIERS_INGRESS, IDENTITY_ANY, IDENTITY_HOST, TIER_ACCEPT, TIER_ADMIN,
    TIER_BASELINE, TIER_DENY,
};

use crate::mem::wr32;
use crate::rule_counters::RULE_TAG;
use fold::{fold_decision, fold_enabled, NO_FOLD};
use ipcache::peer_identities;
use lpm::{policy_rule, NO_RULE};
use tiers::tier_action;

/// `BPF_F_MMAPABLE`: user space maps the array and stores whole words.
pub(crate) const BPF_F_MMAPABLE: u32 = 1 << 10;

/// The peer address of steps 8 and 9: 16 bytes (4-aligned, IPv4-mapped
/// for IPv4) at `at`, or, when `lazy_v4`, the IPv4 address `v4addr`,
/// written IPv4-mapped to `lpm + 4` only when a map lookup needs its bytes
/// (then `at` is `lpm + 4`).
#[derive(Clone, Copy)]
pub(crate) struct Peer {
    /// The 16 address bytes.
    pub(crate) at: *const u8,
    /// The address is `v4addr`, not yet written at `at`.
    pub(crate) lazy_v4: bool,
    /// The IPv4 address as loaded (network order in a little-endian word).
    pub(crate) v4addr: u32,
}

/// Steps 7 to 9 for a packet conntrack did not allow: `NotIsolated`, or
/// the decision of the peer's identities, the tiers and the policy
/// lookups. `port` is the destination port (0 for protocols without
/// ports). An endpoint direction with no tier flag and
/// not isolated returns at step 7, as without ClusterNetworkPolicies.
/// On `Policy`, the first word at `lpm` is `RULE_TAG` | the allowing
/// rule's slot (`npm_common::rule_slot`), for [`crate::rule_counters`].
#[inline(always)]
pub(crate) fn policy_step(lpm: *mut u8, ep: &EndpointInfo, dir: u8, pr: u8, port: u16, peer: Peer) -> u8 {
    // 7. not isolated and no tier.
    let isolated = if dir == DIR_INGRESS {
        ep.flags & EP_ISOLATED_INGRESS != 0
    } else {
        ep.flags & EP_ISOLATED_EGRESS != 0
    };
    if !isolated && ep.flags & (EP_TIERS_INGRESS << dir) == 0 {
        return Reason::NotIsolated as u8;
    }
    let w = evaluate_policy(lpm, ep, dir, pr, port, peer, isolated);
    let r = w as u8;
    if r == Reason::Policy as u8 {
        // SAFETY: lpm is 20 writable, 4-aligned bytes (the key is dead now).
        unsafe { wr32(lpm, RULE_TAG | w >> 8) };
    }
    r
}

/// The decision of a tier's action `a`: `accept` or `deny` (final), or
/// `None` (Pass, or no rule matched: the next step decides).
#[inline(always)]
fn tier_final(a: u32, accept: Reason, deny: Reason) -> Option<u32> {
    if a == TIER_ACCEPT {
        Some(accept as u32)
    } else if a == TIER_DENY {
        Some(deny as u32)
    } else {
        None
    }
}

/// Steps 8 and 9 for an endpoint direction that is isolated (`isolated`)
/// or has a tier flag: the peer's identities (ipcache, else the CIDR trie),
/// then 9a the Admin tier, 9b the policy lookups when isolated, 9c the
/// Baseline tier, 9d allow. Returns the decision word: the reason (`Host`,
/// `AdminAccept`, `AdminDeny`, `Policy`, `PolicyDenied`, `BaselineAccept`,
/// `BaselineDeny` or `NotIsolated`) in bits 0..8 and, for `Policy`, the
/// allowing rule's slot above.
#[inline(always)]
fn evaluate_policy(lpm: *mut u8, ep: &EndpointInfo, dir: u8, pr: u8, port: u16, peer: Peer, isolated: bool) -> u32 {
    let (identity, cidr_identity) = peer_identities(lpm, peer);
    if dir == DIR_INGRESS && identity == IDENTITY_HOST {
        // 8. host.
        return Reason::Host as u32;
    }
    // NetworkPolicy and the tiers are keyed by the subject (the pod
    // identity), not the endpoint id.
    let subject = ep.subject;
    let f = ep.flags;
    let ids = (identity, cidr_identity);
    // 9a to 9d folded ahead of time, when the subject's direction is.
    // (An endpoint direction that is not folded pays only this test.)
    if fold_enabled(f, dir) {
        // SAFETY: lpm is the 20-byte, 4-aligned scratch key.
        let w = unsafe { folded(lpm, subject, dir, ids, pr, port) };
        if w != NO_FOLD {
            return w;
        }
    }
    // 9a. Admin tier: accept and deny are final, pass goes on.
    if f & (EP_ADMIN_INGRESS << dir) != 0 {
        let a = tier_action(lpm, subject, dir | TIER_ADMIN, ids, pr, port);
        if let Some(r) = tier_final(a, Reason::AdminAccept, Reason::AdminDeny) {
            return r;
        }
    }
    if !isolated {
        // 9c. Baseline tier, then 9d.
        if f & (EP_BASELINE_INGRESS << dir) != 0 {
            let a = tier_action(lpm, subject, dir | TIER_BASELINE, ids, pr, port);
            if let Some(r) = tier_final(a, Reason::BaselineAccept, Reason::BaselineDeny) {
                return r;
            }
        }
        return Reason::NotIsolated as u32;
    }
    // 9b. policy (final when isolated). A lookup the endpoint's
    // EP_NO_*_PEER_* flags rule out is skipped: it could not hit.
    let mut rule = NO_RULE;
    if may_match(f, dir, identity) {
        rule = policy_rule(lpm, subject, dir, identity, pr, port);
    }
    if rule == NO_RULE && cidr_identity != IDENTITY_ANY && may_match(f, dir, cidr_identity) {
        rule = policy_rule(lpm, subject, dir, cidr_identity, pr, port);
    }
    if rule == NO_RULE && may_match(f, dir, IDENTITY_ANY) {
        rule = policy_rule(lpm, subject, dir, IDENTITY_ANY, pr, port);
    }
    if rule == NO_RULE {
        Reason::PolicyDenied as u32
    } else {
        Reason::Policy as u32 | rule_slot(rule) << 8
    }
}

/// [`fold_decision`] with its inputs and its answer passed through the
/// scratch words at `lpm` (a per-CPU map value): the verifier then refines
/// only those copies on the fold's branches and knows nothing of how the
/// answer was found, so the fold's paths join at the return instead of
/// each walking the lookups after it (which exceeds the verifier's
/// instruction budget).
///
/// # Safety
/// `lpm` is the 20-byte, 4-aligned scratch key.
#[inline(always)]
unsafe fn folded(lpm: *mut u8, subject: u32, dir: u8, ids: (u32, u32), pr: u8, port: u16) -> u32 {
    // SAFETY: the caller upholds this function's contract (its doc),
    // which every operation below relies on.
    unsafe {
        let s = lpm as *const u32;
        wr32(lpm, subject);
        wr32(lpm.add(4), ids.0);
        wr32(lpm.add(8), ids.1);
        wr32(lpm.add(12), dir as u32 | (pr as u32) << 8 | (port as u32) << 16);
        let x = core::ptr::read_volatile(s.add(3));
        let w = fold_decision(
            core::ptr::read_volatile(s),
            (x & 1) as u8,
            (core::ptr::read_volatile(s.add(1)), core::ptr::read_volatile(s.add(2))),
            (x >> 8) as u8,
            (x >> 16) as u16,
        );
        wr32(lpm, w);
        core::ptr::read_volatile(s)
    }
}

/// Whether some policy entry of the endpoint's subject (flags `ep_flags`)
/// in direction `dir` may have `identity` as its peer.
#[inline(always)]
fn may_match(ep_flags: u32, dir: u8, identity: u32) -> bool {
    ep_flags & (ep_no_peer_flag(identity) << dir) == 0
}
