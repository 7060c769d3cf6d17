//! The attach modes against the kernel: tc filters live beside other
//! people's filters and `clsact` qdisc and leave them alone; the sweep after
//! the first full sync removes filters of interfaces that are no longer
//! endpoints; `auto` keeps the mode in place; a forced mode change never
//! leaves a hook without a program; a restarted loader replaces the program
//! of its filters in place, where a plain re-attach would add a second
//! filter or fail (so the alternative would be delete-then-add: a gap); the
//! kernel feature check passes here. Needs root.
//!
//! The tests of this file hold the binary's one lock ([`crate::serial`]):
//! `auto` looks at every npm filter on the node, and another test's
//! filters must not change its choice.

use crate::ebpf_common::*;
use aya::programs::tc::{NlOptions, TcAttachOptions, TcHandle};
use aya::programs::{SchedClassifier, TcAttachType};
use npm_dataplane::ebpf::tc_filters::{TC_HANDLE, TC_PRIORITY};
use npm_dataplane::ebpf::{check_kernel, dump_pinned, pinned_link_programs, AttachMode, PROG_EMPTY};
use npm_dataplane::Dataplane;
use npm_policy::compiled::Compiled;
use npm_policy::model::Protocol;

/// Endpoints 1.. on the given interfaces (one address each), isolated, one
/// TCP allow each.
fn endpoints_on(ifs: &[u32]) -> (Compiled, std::collections::BTreeMap<u32, u32>) {
    let mut c = Compiled::default();
    ip(&mut c, "10.77.0.200", 300, 0);
    let mut pairs = Vec::new();
    for (i, ifindex) in ifs.iter().enumerate() {
        let id = i as u32 + 1;
        let addr = format!("10.77.0.{id}");
        c.endpoints
            .insert(id, endpoint(&format!("p{id}"), 256, Some(&addr), None, true, true));
        ip(&mut c, &addr, 256, 0);
        allow(
            &mut c,
            id,
            npm_policy::compiled::Direction::Ingress,
            300,
            Some(Protocol::Tcp),
            (80, 80),
            id,
        );
        pairs.push((id, *ifindex));
    }
    (c, ifaces(&pairs))
}

/// npm's filters (npm priority and handle) on `ifname`: (ingress, egress).
fn npm_filter_counts(ifname: &str) -> (usize, usize) {
    let (i, e) = tc_filters(ifname);
    let npm = |f: &Vec<npm_dataplane::ebpf::tc_filters::TcFilter>| {
        f.iter()
            .filter(|f| f.priority == TC_PRIORITY && f.handle == TC_HANDLE)
            .count()
    };
    (npm(&i), npm(&e))
}

#[test]
fn tc_detach_leaves_foreign_filters_and_the_qdisc() {
    let _g = crate::serial();
    sweep_leftovers();
    let pins = PinDir::new("amf");
    let veth = Dummy::new("amf");
    // Someone else's clsact qdisc and filters, before npm.
    sh(&["tc", "qdisc", "add", "dev", &veth.name, "clsact"]);
    sh(&[
        "tc", "filter", "add", "dev", &veth.name, "ingress", "prio", "20", "protocol", "all", "u32", "match", "u32",
        "0", "0", "classid", "1:1",
    ]);
    sh(&[
        "tc",
        "filter",
        "add",
        "dev",
        &veth.name,
        "egress",
        "prio",
        "30",
        "handle",
        "7",
        "protocol",
        "all",
        "bpf",
        "bytecode",
        "1,6 0 0 4294967295,",
        "classid",
        "1:1",
    ]);
    let foreign_in = tc_show(&veth.name, "ingress");
    let foreign_eg = tc_show(&veth.name, "egress");

    let mut dp = pins.open_in(AttachMode::Tc);
    let (c, ifs) = endpoints_on(&[veth.ifindex]);
    dp.sync_full(&c, &ifs).unwrap();
    assert_eq!(npm_filter_counts(&veth.name), (1, 1));
    // The foreign classic-BPF filter (a `bpf` filter too, without a name)
    // is not npm's.
    let (_, eg) = tc_filters(&veth.name);
    assert_eq!(eg.len(), 2, "{eg:?}");
    assert!(eg
        .iter()
        .any(|f| f.handle == 7 && f.priority == 30 && f.name.is_empty()));
    // The inspect path sees npm's filters only.
    let progs = pinned_link_programs(&pins.path).unwrap();
    assert_eq!(progs.len(), 2, "{progs:?}");
    let dump = dump_pinned(&pins.path).unwrap();
    assert_eq!(dump.endpoints[0].attached, vec!["ingress", "egress"]);

    // The endpoint goes: exactly npm's filters go.
    let empty = Compiled::default();
    dp.apply(&c.diff(&empty), &empty, &ifaces(&[])).unwrap();
    assert_eq!(npm_filter_counts(&veth.name), (0, 0));
    assert_eq!(
        tc_show(&veth.name, "ingress"),
        foreign_in,
        "foreign ingress filter changed"
    );
    assert_eq!(
        tc_show(&veth.name, "egress"),
        foreign_eg,
        "foreign egress filter changed"
    );
    assert!(tc_qdiscs(&veth.name).contains("clsact"), "the clsact qdisc stays");
    assert!(pinned_link_programs(&pins.path).unwrap().is_empty());

    // On an interface npm added the qdisc to, detaching leaves it too
    // (another agent may have filters there by then).
    let fresh = Dummy::new("amg");
    let (c, ifs) = endpoints_on(&[fresh.ifindex]);
    dp.sync_full(&c, &ifs).unwrap();
    assert_eq!(npm_filter_counts(&fresh.name), (1, 1));
    dp.sync_full(&Compiled::default(), &ifaces(&[])).unwrap();
    assert_eq!(npm_filter_counts(&fresh.name), (0, 0));
    assert!(tc_qdiscs(&fresh.name).contains("clsact"));
}

fn sweep_removes_stale_hooks(mode: AttachMode, tag: &str) {
    let pins = PinDir::new(tag);
    let a = Dummy::new(&format!("{tag}a"));
    let b = Dummy::new(&format!("{tag}b"));
    {
        let mut dp = pins.open_in(mode);
        let (c, ifs) = endpoints_on(&[a.ifindex, b.ifindex]);
        dp.sync_full(&c, &ifs).unwrap();
    }
    let (a_before, _) = prog_ids(&a.name, mode);
    assert_eq!(prog_ids(&b.name, mode).0.len(), 1, "b attached by the first loader");
    // A restarted loader adopts both and, at its first full sync, only a
    // is an endpoint: b's hooks go, a's program is replaced in place.
    let mut dp = pins.open_in(mode);
    assert_eq!(dp.attached().len(), 2, "both hooks adopted");
    let (c, ifs) = endpoints_on(&[a.ifindex]);
    dp.sync_full(&c, &ifs).unwrap();
    let (a_after, a_eg) = prog_ids_settled(&a.name, mode, (1, 1));
    assert_eq!((a_after.len(), a_eg.len()), (1, 1));
    assert_ne!(a_after, a_before, "a's program replaced");
    assert_eq!(prog_ids_settled(&b.name, mode, (0, 0)), (vec![], vec![]), "b swept");
    assert_eq!(dp.attached().into_iter().collect::<Vec<_>>(), vec![a.ifindex]);
}

#[test]
fn the_sweep_after_the_first_full_sync_removes_stale_hooks() {
    let _g = crate::serial();
    sweep_leftovers();
    sweep_removes_stale_hooks(AttachMode::Tc, "aws");
    sweep_removes_stale_hooks(AttachMode::Tcx, "awx");
}

#[test]
fn auto_keeps_the_mode_in_place() {
    let _g = crate::serial();
    sweep_leftovers();
    // Nothing in place: this kernel has tcx.
    let fresh = PinDir::new("amn");
    assert_eq!(fresh.open_in(AttachMode::Auto).attach_mode(), AttachMode::Tcx);
    drop(fresh);

    for (mode, tag) in [(AttachMode::Tc, "ama"), (AttachMode::Tcx, "amb")] {
        let pins = PinDir::new(tag);
        let veth = Dummy::new(tag);
        {
            let mut dp = pins.open_in(mode);
            let (c, ifs) = endpoints_on(&[veth.ifindex]);
            dp.sync_full(&c, &ifs).unwrap();
        }
        let mut dp = pins.open_in(AttachMode::Auto);
        assert_eq!(dp.attach_mode(), mode, "auto keeps {mode}");
        let (c, ifs) = endpoints_on(&[veth.ifindex]);
        dp.sync_full(&c, &ifs).unwrap();
        let other = if mode == AttachMode::Tc {
            AttachMode::Tcx
        } else {
            AttachMode::Tc
        };
        assert_eq!(prog_ids(&veth.name, mode).0.len(), 1);
        assert_eq!(prog_ids(&veth.name, other), (vec![], vec![]), "no second mode");
        if mode == AttachMode::Tc {
            // Another pin directory (a new map layout) on a node with npm
            // tc filters does not start tcx beside them.
            let other_dir = PinDir::new("amc");
            assert_eq!(other_dir.open_in(AttachMode::Auto).attach_mode(), AttachMode::Tc);
        }
        // Cleanup of the tc filters: the interface goes with the guard.
        dp.sync_full(&Compiled::default(), &ifaces(&[])).unwrap();
    }
}

#[test]
fn a_forced_mode_change_never_leaves_a_hook_without_a_program() {
    let _g = crate::serial();
    sweep_leftovers();
    for (from, to, tag) in [
        (AttachMode::Tcx, AttachMode::Tc, "amx"),
        (AttachMode::Tc, AttachMode::Tcx, "amy"),
    ] {
        let pins = PinDir::new(tag);
        let veth = Dummy::new(tag);
        let (c, ifs) = endpoints_on(&[veth.ifindex]);
        {
            let mut dp = pins.open_in(from);
            dp.sync_full(&c, &ifs).unwrap();
        }
        let (before, _) = prog_ids(&veth.name, from);
        let mut dp = pins.open_in(to);
        // Adopted in the old mode, with the new program, before any attach.
        let (adopted, _) = prog_ids(&veth.name, from);
        assert_eq!(adopted.len(), 1);
        assert_ne!(adopted, before, "the old mode's hook runs the new program");
        dp.sync_full(&c, &ifs).unwrap();
        assert_eq!(prog_ids(&veth.name, to).0.len(), 1, "attached in {to}");
        assert_eq!(
            prog_ids_settled(&veth.name, from, (0, 0)),
            (vec![], vec![]),
            "{from} removed"
        );
        dp.sync_full(&Compiled::default(), &ifaces(&[])).unwrap();
    }
}

#[test]
fn a_plain_reattach_would_duplicate_or_fail_where_the_replace_swaps() {
    let _g = crate::serial();
    sweep_leftovers();
    let pins = PinDir::new("amr");
    let veth = Dummy::new("amr");
    let (c, ifs) = endpoints_on(&[veth.ifindex]);
    {
        let mut dp = pins.open_in(AttachMode::Tc);
        dp.sync_full(&c, &ifs).unwrap();
    }
    assert_eq!(npm_filter_counts(&veth.name), (1, 1));
    let (_, before) = prog_ids(&veth.name, AttachMode::Tc);

    // Without the replace: a second loader's program (own maps, no pins).
    // The object's empty classifier: what is attached is what this test is
    // about, and it verifies on every kernel (the full `from_pod` is too
    // large for some verifiers, which the loader answers with the reduced
    // datapath; a direct load has no such fallback).
    let object = npm_dataplane::ebpf::resolve_object(None).unwrap();
    let mut bpf = aya::Ebpf::load_file(&object).expect("load object");
    let prog: &mut SchedClassifier = bpf.program_mut(PROG_EMPTY).unwrap().try_into().unwrap();
    prog.load().unwrap();
    // 1. Attaching again as a fresh attach at npm's priority and handle
    //    fails (NLM_F_EXCL): the only way on without a replace would be
    //    delete-then-add, a moment with no program on the hook.
    let exclusive = prog.attach_with_options(
        &veth.name,
        TcAttachType::Egress,
        TcAttachOptions::Netlink(NlOptions {
            priority: TC_PRIORITY,
            handle: TcHandle::from(TC_HANDLE),
            classid: None,
        }),
    );
    let err = exclusive.expect_err("a second exclusive attach must fail");
    assert!(
        format!("{err:?}").contains("17") || err.to_string().contains("exists"),
        "{err:?}"
    );
    // 2. Attaching with a kernel-chosen priority and handle adds a second
    //    filter: two programs would decide each packet.
    let id = prog
        .attach_with_options(
            &veth.name,
            TcAttachType::Egress,
            TcAttachOptions::Netlink(NlOptions::default()),
        )
        .unwrap();
    let (_, eg) = tc_filters(&veth.name);
    assert_eq!(eg.len(), 2, "a plain attach leaves two filters: {eg:?}");
    prog.detach(id).unwrap();
    drop(bpf);
    assert_eq!(tc_filters(&veth.name).1.len(), 1);

    // With the replace: a new loader swaps the program in the same filter.
    let mut dp = pins.open_in(AttachMode::Tc);
    let (_, after) = prog_ids(&veth.name, AttachMode::Tc);
    assert_eq!(npm_filter_counts(&veth.name), (1, 1), "still one npm filter per hook");
    assert_eq!(after.len(), 1);
    assert_ne!(after, before, "program replaced at open");
    dp.sync_full(&c, &ifs).unwrap();
    assert_eq!(npm_filter_counts(&veth.name), (1, 1));
    dp.sync_full(&Compiled::default(), &ifaces(&[])).unwrap();
}

#[test]
fn the_kernel_has_what_each_mode_needs() {
    let _g = crate::serial();
    for mode in [AttachMode::Auto, AttachMode::Tcx, AttachMode::Tc] {
        let f = check_kernel(mode).unwrap_or_else(|e| panic!("{mode}: {e}"));
        assert!(f.tcx, "this kernel (6.18) has tcx");
        if mode == AttachMode::Tc {
            assert_eq!(f.clsact, Some(true));
        }
    }
    assert!(npm_dataplane::ebpf::tcx_supported());
}
