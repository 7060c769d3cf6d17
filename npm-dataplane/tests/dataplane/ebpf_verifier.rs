//! The verifier's budget: the instructions the kernel's verifier walked to
//! load each pod program (`verified_insns`, what the 1,000,000-instruction
//! complexity limit counts), kept below 80% of the limit, so that a change
//! that nears it fails here rather than on a node. On this kernel (6.18)
//! `from_pod` takes about 494,000 and `to_pod` about 609,000 (the folded
//! decisions added 0% and 6%: 494,000 and 572,000 without them). Needs
//! root.

use crate::ebpf_common::*;
use aya::programs::loaded_programs;
use npm_dataplane::ebpf::{AttachMode, BenchSwitches, EbpfDataplane};
use npm_dataplane::Dataplane;

/// 80% of the kernel's complexity limit (`BPF_COMPLEXITY_LIMIT_INSNS`).
const BUDGET: u32 = 800_000;

#[test]
fn the_pod_programs_load_within_80_percent_of_the_verifier_limit() {
    sweep_leftovers();
    let pins = PinDir::new("vfb");
    let a = Dummy::new("vfa");
    // tcx where the kernel has it, tc clsact filters before 6.6 (the
    // Debian 6.1 row of `cargo xtask vm matrix`): the programs are the same.
    let mode = if npm_dataplane::ebpf::tcx_supported() {
        AttachMode::Tcx
    } else {
        AttachMode::Tc
    };
    let mut dp = pins.open_in(mode);
    dp.sync_full(&tier_fixture(true), &ifaces(&[(1, a.ifindex)])).unwrap();
    let (ingress, egress) = prog_ids(&a.name, mode);
    assert_eq!((ingress.len(), egress.len()), (1, 1), "one program on each hook");
    for (hook, id) in [
        (format!("from_pod ({mode} ingress)"), ingress[0]),
        (format!("to_pod ({mode} egress)"), egress[0]),
    ] {
        let info = loaded_programs()
            .filter_map(Result::ok)
            .find(|p| p.id() == id)
            .unwrap_or_else(|| panic!("program {id} is loaded"));
        let insns = info
            .verified_instruction_count()
            .expect("the kernel reports verified_insns");
        eprintln!("{hook}: {insns} instructions verified");
        assert!(insns < BUDGET, "{hook}: {insns} verified instructions, budget {BUDGET}");
    }
    // What the agent reports as `npm_datapath_reduced`: the verifiers of
    // 6.6 and later (tcx) accept the full programs; Debian 12's 6.1 refuses
    // them and gets the reduced datapath.
    eprintln!("datapath: {}", if dp.reduced_datapath() { "reduced" } else { "full" });
    if npm_dataplane::ebpf::tcx_supported() {
        assert!(!dp.reduced_datapath(), "this verifier accepts the full programs");
    }
    drop(dp);
    let reduced_pins = PinDir::new("vfr");
    let dp = EbpfDataplane::open_with(reduced_pins.options_in(mode), BenchSwitches::reduced())
        .unwrap_or_else(|e| panic!("open reduced: {e}"));
    assert!(dp.reduced_datapath(), "asked for the reduced datapath");
}
