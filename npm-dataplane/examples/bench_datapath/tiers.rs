//! The ClusterNetworkPolicy rows of the datapath benchmark: packets decided
//! by the Admin tier (accept, deny), by NetworkPolicy after an Admin pass,
//! and by the Baseline tier, at 1, 100 and 1,000 ClusterNetworkPolicies in
//! each tier (each CNP three rules selecting both endpoints).
//!
//! Two endpoints on their own veths: endpoint 1 (10.0.0.1) is isolated for
//! ingress by a NetworkPolicy that allows pod identity 300 (10.0.0.2) and
//! 311 (10.0.0.4) on TCP 80; endpoint 2 (10.0.0.5) is isolated by none.
//! Every peer also has a CIDR identity, so each tier is its worst case,
//! three lookups (pod identity, CIDR identity, any). The measured rules are
//! those of the Admin CNP and the Baseline CNP in the middle of their
//! tier's order:
//! - `admin_accept`: 10.0.0.3 (identity 310, not allowed by the NP) to
//!   endpoint 1 TCP 80, accepted by the Admin tier;
//! - `admin_deny`: 10.0.0.4 (311, allowed by the NP) to endpoint 1 TCP 80,
//!   denied by the Admin tier (a deny event);
//! - `pass_policy`: 10.0.0.2 (300) to endpoint 1 TCP 80: an Admin pass,
//!   then the NP allows it;
//! - `baseline_tier`: 10.0.0.6 (312) to endpoint 2 TCP 80: the Admin tier does
//!   not match, the Baseline tier accepts.
//!
//! Both endpoints' ingress is folded (`NPM_FOLD`, column `fold_entries`:
//! the entries the loader stored): each of these packets is decided by one
//! probe of the folded decisions. The `_lookups` rows are the same packets
//! with the fold switched off: the tiers' lookups on the `NPM_TIERS` LPM
//! (3 for the Admin tier, 3 more for the Baseline tier) and the
//! `NPM_POLICY` lookups, what a class the fold does not hold costs.
//!
//! The ranks are the compiler's (`npm_policy::tiers::compile::ranked_rules`:
//! `priority << 20 | position among equal priorities << 5 | rule index`),
//! CNP `i` of a tier having priority `i + 1` (1..=1000).
//!
//! Same method as the other rows: the median of [`super::RUNS`]
//! interleaved rounds of [`super::REPEAT`] repeats.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;

use npm_common::{IDENTITY_ANY, IDENTITY_FIRST_CIDR};
use npm_dataplane::ebpf::{AttachMode, BenchSwitches, EbpfDataplane, EbpfOptions, PROG_EMPTY, PROG_INGRESS};
use npm_dataplane::Dataplane;
use npm_policy::compiled::{
    Compiled, Direction, Endpoint, IpEntry, PodRef, PolicyEntry, Tier, TierAction, TierEntry, TierValue,
};
use npm_policy::model::Protocol;

use super::{frame, median, veth, REPEAT};

/// CNPs in each tier per row.
const SCALES: [usize; 3] = [1, 100, 1_000];
/// The CIDR identity every peer carries.
const BLOCK: u32 = IDENTITY_FIRST_CIDR;

/// The compiler's rank of rule `index` of the only CNP of priority
/// `priority` (`npm_policy::tiers::compile::ranked_rules`).
const fn compiler_rank(priority: u32, index: u32) -> u32 {
    priority << 20 | index
}

fn endpoint(name: &str, identity: u32, ip: Ipv4Addr, isolated_ingress: bool) -> Endpoint {
    Endpoint {
        pod: PodRef {
            namespace: "bench".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        },
        identity,
        ipv4: Some(ip),
        ipv6: None,
        isolated_ingress,
        isolated_egress: false,
        tiers: Default::default(),
        report_new: false,
    }
}

/// The compiled form of `n` CNPs in each tier (see the module doc).
pub(super) fn compiled(n: usize) -> Compiled {
    let mut c = Compiled::default();
    // Two identities: isolation, like every NetworkPolicy outcome, is a
    // function of the pod identity (the entries' subject).
    c.endpoints
        .insert(1, endpoint("np", 256, Ipv4Addr::new(10, 0, 0, 1), true));
    c.endpoints
        .insert(2, endpoint("open", 257, Ipv4Addr::new(10, 0, 0, 5), false));
    for (last, identity) in [(2, 300), (3, 310), (4, 311), (6, 312)] {
        c.ipcache.insert(
            IpAddr::V4(Ipv4Addr::new(10, 0, 0, last)),
            IpEntry {
                identity,
                cidr_identity: BLOCK,
                owner: 0,
            },
        );
    }
    c.cidrs.insert("10.0.0.0/24".parse().expect("prefix"), BLOCK);
    for peer in [300, 311] {
        c.policy.insert(
            PolicyEntry {
                subject: 256,
                direction: Direction::Ingress,
                peer,
                protocol: Some(Protocol::Tcp),
                ports: (80, 80),
            },
            peer,
        );
    }
    let mut rule = 1_000;
    let mut add = |c: &mut Compiled, ep, tier, peer, protocol, ports, action, rank| {
        rule += 1;
        // Keyed by the endpoint's subject (its pod identity).
        let subject = c.endpoints[&ep].identity;
        c.tiers.insert(
            TierEntry {
                subject,
                direction: Direction::Ingress,
                tier,
                peer,
                protocol,
                ports,
            },
            TierValue { action, rank, rule },
        );
        c.endpoints
            .get_mut(&ep)
            .expect("endpoint")
            .tiers
            .set(tier, Direction::Ingress);
    };
    let tcp = Some(Protocol::Tcp);
    for tier in [Tier::Admin, Tier::Baseline] {
        // The measured CNP sits in the middle of its tier's order.
        let measured = n / 2;
        for i in 0..n {
            let rank = compiler_rank(i as u32 + 1, 0);
            for ep in [1, 2] {
                if i == measured {
                    match tier {
                        Tier::Admin => {
                            add(&mut c, ep, tier, 310, tcp, (80, 80), TierAction::Accept, rank);
                            add(&mut c, ep, tier, 311, tcp, (80, 80), TierAction::Deny, rank + 1);
                            add(&mut c, ep, tier, 300, None, (0, 0), TierAction::Pass, rank + 2);
                        }
                        Tier::Baseline => {
                            add(&mut c, ep, tier, 312, tcp, (80, 80), TierAction::Accept, rank);
                            add(&mut c, ep, tier, 313, tcp, (0, 1023), TierAction::Deny, rank + 1);
                            add(
                                &mut c,
                                ep,
                                tier,
                                IDENTITY_ANY,
                                tcp,
                                (9000, 9000),
                                TierAction::Deny,
                                rank + 2,
                            );
                        }
                    }
                    continue;
                }
                // Three rules of other peers and ports.
                let peer = 1_000 + i as u32;
                let port = 1_024 + (i as u16 % 20_000) * 3;
                add(&mut c, ep, tier, peer, tcp, (port, port + 2), TierAction::Deny, rank);
                add(
                    &mut c,
                    ep,
                    tier,
                    peer,
                    Some(Protocol::Udp),
                    (53, 53),
                    TierAction::Accept,
                    rank + 1,
                );
                add(
                    &mut c,
                    ep,
                    tier,
                    BLOCK + 1 + i as u32,
                    None,
                    (0, 0),
                    TierAction::Pass,
                    rank + 2,
                );
            }
        }
    }
    c
}

/// A tier setup: a loaded dataplane with two endpoints on their own veths.
struct TierSetup {
    dp: EbpfDataplane,
    /// Endpoint 1's interface.
    np_if: u32,
    /// Endpoint 2's interface.
    open_if: u32,
}

/// One measured case: a program of a dataplane on a frame, as on an
/// interface.
type Case<'a> = (&'a EbpfDataplane, u32, &'static str, &'a [u8]);

/// Runs every case once ([`REPEAT`] repeats); ns per packet of each.
fn measure_once(cases: &[Case<'_>]) -> Vec<u64> {
    cases
        .iter()
        .map(|(dp, ifindex, prog, pkt)| {
            dp.bench_run(prog, *ifindex, pkt, REPEAT)
                .unwrap_or_else(|e| panic!("bench run {prog}: {e}"))
                .as_nanos() as u64
        })
        .collect()
}

/// Runs the tier rows; returns their JSON results.
pub(super) fn run(pid: u32) -> Vec<String> {
    let kinds = [
        ("k", BenchSwitches::default()),
        (
            "l",
            BenchSwitches {
                no_fold: true,
                ..BenchSwitches::default()
            },
        ),
    ];
    let mut links = Vec::new();
    let mut pins = Vec::new();
    let mut setups = Vec::new();
    for (tag, switches) in kinds {
        let (l1, l2) = (format!("npb{pid}{tag}"), format!("npb{pid}{tag}2"));
        let pin = PathBuf::from(format!("/sys/fs/bpf/npm-bench-{pid}-{tag}"));
        let (if1, if2) = (veth(&l1), veth(&l2));
        links.extend([l1, l2]);
        pins.push(pin.clone());
        let dp = EbpfDataplane::open_with(
            EbpfOptions {
                object: None,
                pin_dir: pin,
                bench_no_ct_create: true,
                attach: AttachMode::Tcx,
            },
            switches,
        )
        .unwrap_or_else(|e| panic!("open: {e}"));
        setups.push(TierSetup {
            dp,
            np_if: if1,
            open_if: if2,
        });
    }
    let _cleanup = super::Cleanup { links, pins };

    let me = Ipv4Addr::new(10, 0, 0, 1);
    let open = Ipv4Addr::new(10, 0, 0, 5);
    let accept = frame(Ipv4Addr::new(10, 0, 0, 3), me, 40000, 80);
    let deny = frame(Ipv4Addr::new(10, 0, 0, 4), me, 40000, 80);
    let pass = frame(Ipv4Addr::new(10, 0, 0, 2), me, 40000, 80);
    let baseline = frame(Ipv4Addr::new(10, 0, 0, 6), open, 40000, 80);
    let paths = [
        "admin_accept",
        "admin_deny",
        "pass_policy",
        "baseline_tier",
        "admin_accept_lookups",
        "admin_deny_lookups",
        "pass_policy_lookups",
        "baseline_tier_lookups",
    ];
    let mut samples: Vec<Vec<Vec<u64>>> = vec![vec![Vec::new(); paths.len() + 1]; SCALES.len()];
    let mut prev = Compiled::default();
    let mut fold_entries = [0; SCALES.len()];
    for _ in 0..super::runs() {
        for (row, &n) in SCALES.iter().enumerate() {
            let next = compiled(n);
            let diff = prev.diff(&next);
            for s in &mut setups {
                let ifs: BTreeMap<u32, u32> = [(1, s.np_if), (2, s.open_if)].into_iter().collect();
                s.dp.apply(&diff, &next, &ifs).expect("apply");
            }
            prev = next;
            fold_entries[row] = setups[0].dp.fold_len();
            use npm_common::Reason::{AdminAccept, AdminDeny, BaselineAccept, Policy};
            for s in &setups {
                let (dp, a, b) = (&s.dp, s.np_if, s.open_if);
                for (ifindex, pkt, want) in [
                    (a, &accept, AdminAccept),
                    (a, &deny, AdminDeny),
                    (a, &pass, Policy),
                    (b, &baseline, BaselineAccept),
                ] {
                    // A reason of None is a run whose counters another
                    // packet moved too (the fresh veths' own IPv6
                    // traffic): run it again.
                    let got = (0..3).find_map(|_| dp.test_run(Direction::Ingress, ifindex, pkt).expect("check").1);
                    assert_eq!(got, Some(want), "{n} CNPs per tier");
                }
            }
            let [k, l] = &setups[..] else {
                unreachable!("two setups")
            };
            let cases: [Case<'_>; 9] = [
                (&k.dp, k.np_if, PROG_EMPTY, &accept),
                (&k.dp, k.np_if, PROG_INGRESS, &accept),
                (&k.dp, k.np_if, PROG_INGRESS, &deny),
                (&k.dp, k.np_if, PROG_INGRESS, &pass),
                (&k.dp, k.open_if, PROG_INGRESS, &baseline),
                (&l.dp, l.np_if, PROG_INGRESS, &accept),
                (&l.dp, l.np_if, PROG_INGRESS, &deny),
                (&l.dp, l.np_if, PROG_INGRESS, &pass),
                (&l.dp, l.open_if, PROG_INGRESS, &baseline),
            ];
            for (i, ns) in measure_once(&cases).into_iter().enumerate() {
                samples[row][i].push(ns);
            }
        }
    }
    let mut results = Vec::new();
    let entries: Vec<usize> = SCALES.iter().map(|&n| compiled(n).tiers.len()).collect();
    print!(
        "{:>8} {:>8} {:>12} {:>11}",
        "cnps", "entries", "fold_entries", "baseline_ns"
    );
    for p in paths {
        print!(" {:>13}", format!("{p}_ns"));
    }
    println!();
    for (row, &n) in SCALES.iter().enumerate() {
        let m: Vec<u64> = samples[row].iter().map(|v| median(v)).collect();
        let row_baseline = m[0];
        let e = entries[row];
        let f = fold_entries[row];
        print!("{n:>8} {e:>8} {f:>12} {row_baseline:>11}");
        for (path, ns) in paths.iter().zip(&m[1..]) {
            print!(" {ns:>13}");
            results.push(format!(
                r#"{{"path":"tier_{path}","cnps_per_tier":{n},"tier_entries":{e},"fold_entries":{f},"ns":{ns},"baseline_ns":{row_baseline}}}"#
            ));
        }
        println!();
    }
    results
}
