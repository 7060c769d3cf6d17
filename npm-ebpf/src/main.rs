//! npm's TC classifier: per-packet NetworkPolicy enforcement with conntrack.
//!
//! Build (this is the exact command `cargo xtask build-ebpf` runs, from the
//! workspace root; the RUSTFLAGS add BTF, the object also loads without):
//!
//! ```text
//! cd /work/main && CARGO_TARGET_BPFEL_UNKNOWN_NONE_RUSTFLAGS="-C debuginfo=2 -C link-arg=--btf" \
//!     cargo +nightly build -p npm-ebpf --release --target bpfel-unknown-none -Z build-std=core
//! ```
//!
//! (needs `bpf-linker` on PATH and `aya-build` pinned to 0.2.0 in Cargo.lock:
//! 0.2.1 requires rustc 1.98).
//! The object lands at `target/bpfel-unknown-none/release/npm-ebpf`.
//!
//! # Programs
//!
//! - `from_pod`: attached with tcx on the *ingress* hook of a pod's
//!   host-side veth: packets leaving the pod, the pod's EGRESS direction.
//! - `to_pod`: attached with tcx on the *egress* hook of the host-side
//!   veth: packets entering the pod, the pod's INGRESS direction.
//! - `node_exit`: attached with tcx on the *egress* hook of the node's
//!   interfaces towards other nodes (never an endpoint's): its first test
//!   is the deferral bit of the mark (`npm_common::service`); an unmarked
//!   packet passes untouched, a marked one gets the deferred egress
//!   decision of its sender, found by the device it entered the node by
//!   ([`service::deferred_egress`]). `node_exit_l3` is the same
//!   on a device without an Ethernet header (IPIP, WireGuard, GRE, TUN),
//!   where the packet starts at its IP header (the inner one, before the
//!   encapsulation). On a kernel without tcx both are tc `clsact` filters.
//!   A marked packet that is not TCP, UDP or SCTP is an outer tunnel
//!   header and is denied, never decided on.
//! - `host_in`: a socket filter, run by an `xt_bpf` match in the node's
//!   `INPUT` chain (iptables and ip6tables, on the deferral bit): the
//!   deferred egress decision of a flow kube-proxy sent to a backend on
//!   the node's own host network, which crosses no tc egress hook
//!   ([`service::deferred_egress_l3`]). It answers 1 (match: the rule
//!   drops the packet) for a deny, 0 for anything else.
//! - `npm_empty`: returns `TC_ACT_UNSPEC` and does nothing; the baseline of
//!   the benchmark.
//!
//! # Services
//!
//! A new flow of an egress-isolated endpoint to a key of `NPM_SERVICES`
//! (a ClusterIP port, a node address and NodePort) is not decided by
//! `from_pod`, which runs before kube-proxy's DNAT: [`service::defer`]
//! sets the deferral bit, records the flow's source as the endpoint's and
//! writes a pending conntrack entry of the pre-NAT tuple (its replies
//! pass). The decision is taken after the DNAT against the
//! backend: by `to_pod` of a local backend (then that endpoint's ingress,
//! as for any packet), by `node_exit` where it leaves the node, or by
//! `host_in` where it is delivered to the node itself.
//!
//! Both real entry points share [`decide`], which implements exactly the
//! per-packet precedence stated once in the crate documentation of
//! `npm-common` (steps 1 to 9; the code refers to the steps by number). An
//! allowed packet returns `TC_ACT_UNSPEC` (-1, which tcx reads as
//! `TCX_NEXT`: the next program, or the default action, decides); a dropped
//! packet returns `TC_ACT_SHOT` (2): it is dropped silently, never answered
//! with a reset or an ICMP error.
//!
//! # Modules
//!
//! Each map is defined beside its key and its lookup:
//!
//! | module | owns | maps |
//! |--------|------|------|
//! | [`parse`] | Ethernet, IPv4/IPv6 and L4 parsing into [`parse::Pkt`] (ICMP echo ids, ICMPv6 control types) | |
//! | [`mod@fast_v4`] | the IPv4 fast path | |
//! | [`mod@classify`] | the general path, steps 1 to 9 | |
//! | [`endpoint`] | step 2's endpoint maps | `NPM_EP_SLOTS`, `NPM_ENDPOINTS` |
//! | [`fragments`] | step 5 | `NPM_FRAGS` |
//! | [`conntrack`] | step 6 | `NPM_CT`, `NPM_CT4` |
//! | [`icmp_error`] | step 6 for ICMP errors: the quoted header's flow | |
//! | [`flow_cache`] | step 6's per-CPU cache | `NPM_FLOWCACHE` |
//! | [`policy`] | steps 7 to 9 | |
//! | [`policy::ipcache`] | the peer's identities | `NPM_IPCACHE4`, `NPM_IPCACHE`, `NPM_CIDRS` |
//! | [`policy::fold`] | steps 9a to 9d folded ahead of time | `NPM_FOLD` |
//! | [`policy::lpm`] | step 9b on the trie | `NPM_POLICY` |
//! | [`policy::tiers`] | steps 9a and 9c: the ClusterNetworkPolicy tiers | `NPM_TIERS` |
//! | [`verdict`] | counters and deny events | `NPM_COUNTERS`, `NPM_EVENTS` |
//! | [`scratch`] | per-CPU scratch and the clock cache | `NPM_SCRATCH` |
//! | [`mem`] | 32-bit word access to scratch and map memory | |
//!
//! # Fast paths
//!
//! The costly part of a packet is each hash or trie lookup (a call into the
//! kernel, with hashing and return-thunk overhead); array lookups are
//! inlined by the verifier. The common IPv4 TCP/UDP packet is decided by
//! [`fast_v4()`] with its fields in registers (anything else by [`classify()`],
//! same steps, same shared helpers), and these fast paths avoid calls:
//!
//! - endpoints live in an array indexed by ifindex (`NPM_EP_SLOTS`), the
//!   hash `NPM_ENDPOINTS` only serves ifindexes beyond it;
//! - an IPv4 peer is first looked up in `NPM_IPCACHE4`, a direct-mapped
//!   array of whole 64-bit words, and only if its slot holds another
//!   address in the hash `NPM_IPCACHE`;
//! - the flow cache ([`flow_cache`]): established IPv4 flows confirmed by a
//!   conntrack hit in the last 250 ms skip the conntrack lookup;
//! - the fold ([`policy::fold`]): for a subject's direction whose decisions
//!   user space folded (`EP_FOLD_<dir>`), steps 9a to 9d are one probe of
//!   `NPM_FOLD` per port class instead of the tiers' and NetworkPolicy's
//!   trie walks. It is the one precomputed form of the decision; anything
//!   it does not hold is decided on the tries (`NPM_TIERS`, `NPM_POLICY`),
//!   the truth.
//!
//! Everything per packet is `#[inline(always)]` and closure-free: a closure
//! or an outlined function compiles to a BPF-to-BPF call.
#![no_std]
#![no_main]
// `atomic_xadd`: the BPF target has no atomic read-modify-write in
// `core::sync::atomic`, but the kernel has `BPF_ATOMIC` add (the
// conntrack quota's counters, `conntrack::ct_charge`).
#![feature(core_intrinsics)]
#![allow(internal_features)]
// Map keys are passed by reference on purpose: by value they would be
// copied onto the 512-byte BPF stack (and through memcpy).
#![allow(clippy::needless_borrows_for_generic_args)]

mod classify;
mod conntrack;
mod endpoint;
mod fast_v4;
mod flow_cache;
mod fragments;
mod icmp_error;
mod mem;
mod parse;
mod policy;
mod rule_counters;
mod scratch;
mod service;
mod verdict;

use aya_ebpf::{
    bindings::{TC_ACT_SHOT, TC_ACT_UNSPEC},
    macros::{classifier, socket_filter},
    programs::{SkBuffContext, TcContext},
};
use npm_common::{is_deferred, Reason, DEFER_MARK, DIR_EGRESS, DIR_INGRESS, FIRST_DENY_REASON};

use crate::classify::classify;
use crate::fast_v4::{fast_v4, TAKE_GENERAL};
use crate::parse::clear_fields;
use crate::scratch::NPM_SCRATCH;
use crate::service::{deferred_egress, deferred_egress_l3};
use crate::verdict::{account, Seen};

/// The pod's INGRESS direction (its hook: see # Programs above).
#[classifier]
pub fn to_pod(ctx: TcContext) -> i32 {
    decide(&ctx, DIR_INGRESS)
}

/// The pod's EGRESS direction (its hook: see # Programs above).
#[classifier]
pub fn from_pod(ctx: TcContext) -> i32 {
    decide(&ctx, DIR_EGRESS)
}

/// The deferred egress decision of Service traffic leaving the node (see
/// # Programs above): anything without the deferral bit passes untouched.
#[classifier]
pub fn node_exit(ctx: TcContext) -> i32 {
    exit_decision::<false>(&ctx)
}

/// [`node_exit`] on a device without an Ethernet header (IPIP, WireGuard,
/// GRE, TUN: tc hands it the packet at its IP header, before the
/// encapsulation): the deferred decision against the inner packet's
/// backend, never against an outer header.
#[classifier]
pub fn node_exit_l3(ctx: TcContext) -> i32 {
    exit_decision::<true>(&ctx)
}

/// The body of [`node_exit`] (`L3` false) and [`node_exit_l3`].
#[inline(always)]
fn exit_decision<const L3: bool>(ctx: &TcContext) -> i32 {
    // SAFETY: the context pointer is valid for the program's lifetime.
    let (mark, iif) = unsafe { ((*ctx.skb.skb).mark, (*ctx.skb.skb).ingress_ifindex) };
    // No deferral; or the bit on a node process's packet (it entered by
    // no device): someone else's mark, left as it is.
    if !is_deferred(mark) || iif == 0 {
        return TC_ACT_UNSPEC;
    }
    ctx.set_mark(mark & !DEFER_MARK);
    let s = match NPM_SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU memory used only by this CPU, for this packet.
        Some(s) => unsafe { &mut *s },
        None => return TC_ACT_SHOT,
    };
    // Never a dry run (explain runs `to_pod` and `from_pod` only): a stale
    // flag must not skip this packet's conntrack entry.
    s.pad = 0;
    let mut seen = Seen::new();
    let (reason, src) = if L3 {
        deferred_egress_l3(ctx, s, iif, &mut seen)
    } else {
        deferred_egress(ctx, s, iif, &mut seen)
    };
    // A sender not found is denied, counted on the device it came by.
    account(s, DIR_EGRESS, if src == 0 { iif } else { src }, ctx.len(), reason, seen)
}

/// The deferred egress decision of Service traffic delivered to this node
/// (see # Programs above): `xt_bpf` runs it on the packets of the `INPUT`
/// rule, after the DNAT, with the packet at its IP header. 1 drops the
/// packet (the rule's target), 0 lets it on; a packet without the
/// deferral bit, or deferred by an endpoint these maps do not hold,
/// answers 0. The mark stays (a socket filter cannot write it; the packet
/// is delivered here, no later program reads it).
#[socket_filter]
pub fn host_in(ctx: SkBuffContext) -> i64 {
    // SAFETY: the context pointer is valid for the program's lifetime.
    let (mark, iif) = unsafe { ((*ctx.skb.skb).mark, (*ctx.skb.skb).ingress_ifindex) };
    if !is_deferred(mark) {
        return 0;
    }
    let s = match NPM_SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU memory used only by this CPU, for this packet.
        Some(s) => unsafe { &mut *s },
        None => return 1,
    };
    // Never a dry run (explain runs `to_pod` and `from_pod` only).
    s.pad = 0;
    let mut seen = Seen::new();
    let (reason, src) = deferred_egress_l3(&ctx, s, iif, &mut seen);
    // A sender that is no endpoint of these maps deferred through another
    // dataplane's maps (a second agent's pin directory): that dataplane's
    // rule decides it.
    if src == 0 && reason != Reason::Malformed as u8 {
        return 0;
    }
    let len = ctx.len();
    (account(s, DIR_EGRESS, if src == 0 { iif } else { src }, len, reason, seen) == TC_ACT_SHOT) as i64
}

/// The dry-run signal and mark (one definition, in `npm-common`).
pub(crate) use npm_common::{DRY_RUN_IIF, DRY_RUN_MARK};

/// Whether this CPU's packet is a dry run (its scratch `pad` holds the
/// packet's `ingress_ifindex`, written first thing by [`decide`] and
/// cleared by [`node_exit`]). Read only on paths that write state (the
/// flow cache); [`decide`] and `ct_create` test `s.pad` directly.
#[inline(always)]
pub(crate) fn dry_run() -> bool {
    match NPM_SCRATCH.get_ptr(0) {
        // SAFETY: per-CPU memory used only by this CPU, for this packet.
        Some(s) => unsafe { (*s).pad == DRY_RUN_IIF },
        None => false,
    }
}

/// The benchmark's baseline: does nothing.
#[classifier]
pub fn npm_empty(_ctx: TcContext) -> i32 {
    TC_ACT_UNSPEC
}

/// The verdict of one packet in direction `dir`: [`fast_v4()`], or
/// [`classify()`] for a packet it leaves, then the accounting.
#[inline(always)]
fn decide(ctx: &TcContext, dir: u8) -> i32 {
    // Index 0 of a per-CPU array always exists; fail closed regardless.
    let s = match NPM_SCRATCH.get_ptr_mut(0) {
        // SAFETY: per-CPU memory used only by this CPU, for this packet.
        Some(s) => unsafe { &mut *s },
        None => return TC_ACT_SHOT,
    };
    // SAFETY: the context pointer is valid for the program's lifetime.
    let ifindex = unsafe { (*ctx.skb.skb).ifindex };
    // The dry-run signal (see DRY_RUN_IIF), for the steps that write state.
    // SAFETY: as above.
    s.pad = unsafe { (*ctx.skb.skb).ingress_ifindex };
    let len = ctx.len();
    // `to_pod` of a packet whose egress `from_pod` deferred: the sender's
    // egress against this (post-DNAT) destination first, then this
    // endpoint's ingress on the general path, as for any packet. The
    // sender is found by the device the packet entered the node by (never
    // by the mark, whose other bits other owners rewrite); a node
    // process's packet (no such device) carrying the bit is not ours.
    let mut deferred = false;
    if dir == DIR_INGRESS {
        // SAFETY: as above.
        let mark = unsafe { (*ctx.skb.skb).mark };
        let iif = s.pad;
        if is_deferred(mark) && iif != 0 && iif != DRY_RUN_IIF {
            ctx.set_mark(mark & !DEFER_MARK);
            let mut seen = Seen::new();
            let (reason, src) = deferred_egress(ctx, s, iif, &mut seen);
            if reason >= FIRST_DENY_REASON {
                return account(s, DIR_EGRESS, if src == 0 { iif } else { src }, len, reason, seen);
            }
            // The egress rule that allowed the deferred flow (the
            // accounting below is the ingress side's).
            crate::rule_counters::count_rule(s, DIR_EGRESS, len, reason, seen.ep_id);
            deferred = true;
        }
    }
    let mut seen = Seen::new();
    let mut reason = if deferred {
        TAKE_GENERAL
    } else {
        fast_v4(ctx, dir, ifindex, s, &mut seen)
    };
    if reason == TAKE_GENERAL {
        clear_fields(&mut s.pkt);
        seen = Seen::new();
        reason = classify(ctx, dir, ifindex, s, &mut seen);
    }
    // A dry run counts nothing and sends no event: its reason goes back
    // in the mark. The one dry-run branch every packet takes.
    if s.pad == DRY_RUN_IIF {
        s.pad = 0;
        ctx.set_mark(DRY_RUN_MARK | reason as u32);
        return if reason < FIRST_DENY_REASON {
            TC_ACT_UNSPEC
        } else {
            TC_ACT_SHOT
        };
    }

    account(s, dir, ifindex, len, reason, seen)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}

#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 4] = *b"GPL\0";
