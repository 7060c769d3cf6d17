//! The packet fuzzer: random and malformed frames ([`crate::fuzz_cases`])
//! through the real `to_pod` and `from_pod` programs with
//! `BPF_PROG_TEST_RUN`, against seeded random compiled states
//! (NetworkPolicy and both ClusterNetworkPolicy tiers, ipcache and CIDR
//! tables of [`crate::random_compiled`]; a new state every other round,
//! a small change of the last in between, written by the real loader),
//! each verdict judged by `docs/packet-spec.md` ([`crate::fuzz_judge`]:
//! the reference evaluator for first packets, a model of conntrack and
//! fragment state for replies, related errors and later fragments, fail
//! closed for unreadable frames).
//!
//! CI runs a bounded number of cases on tcx and on tc attach (the two
//! tests below, fixed seeds). `cargo xtask fuzz --seed N (--cases N |
//! --duration SECS)` runs [`fuzz_on_demand`] for long runs; it ends with
//! one JSON line (`"bench":"fuzz"`). Every finding is printed with its
//! seed, round, case and frame, and becomes a row of `ebpf_packets` (or
//! the test file of its step) with a fix. Needs root.

use std::time::{Duration, Instant};

use npm_common::Reason;
use npm_dataplane::ebpf::{AttachMode, BenchSwitches, EbpfDataplane, VERDICT_ALLOW};
use npm_dataplane::{Dataplane, Interfaces};
use npm_policy::compiled::Compiled;

use crate::ebpf_common::{sweep_leftovers, Dummy, PinDir};
use crate::fuzz_cases::{case, Scope};
use crate::fuzz_judge::{Model, Shape, Want};
use crate::fuzz_packets::mapped;
use crate::random_compiled::{random_state, Rng, NODE_IP, NODE_IP6, OUTSIDE_V4, OUTSIDE_V6, PODS};

/// Cases per random state.
const CASES_PER_ROUND: u64 = 150;

/// A run's settings.
pub struct Config {
    /// The seed.
    pub seed: u64,
    /// Stop after this many cases.
    pub cases: Option<u64>,
    /// Stop after this long.
    pub duration: Option<Duration>,
    /// The attach mode of the endpoints' programs.
    pub mode: AttachMode,
    /// Layer switches.
    pub switches: BenchSwitches,
    /// Interface and pin tag.
    pub tag: &'static str,
    /// Stop at the first finding.
    pub stop_at_first: bool,
}

/// A run's outcome.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Cases run.
    pub cases: u64,
    /// Frames run.
    pub packets: u64,
    /// Frames the kernel refused to run (shorter than it allows).
    pub refused: u64,
    /// Random states.
    pub rounds: u64,
    /// Verdicts outside the specification.
    pub findings: Vec<String>,
    /// Frames whose verdict the specification permits but whose counters
    /// did not say one reason (no slot moved, several did, or one moved by
    /// more than one): a counting fault (`npm_packets_total`), not a
    /// verdict fault; each with the slots that moved.
    pub counting: Vec<String>,
    /// The known finding of `ebpf_differential` (an Admin deny reported
    /// where NetworkPolicy denies; both drop).
    pub known: u64,
    /// Frames per verdict reason.
    pub reasons: std::collections::BTreeMap<String, u64>,
    /// Later fragments allowed (on their first fragment's record).
    pub later_allowed: u64,
    /// Frames per generator kind.
    pub kinds: std::collections::BTreeMap<&'static str, u64>,
    /// Wall time.
    pub elapsed: Duration,
}

impl Outcome {
    /// The one JSON line of `cargo xtask fuzz`.
    pub fn json(&self, c: &Config) -> String {
        let mode = match c.mode {
            AttachMode::Tc => "tc",
            _ => "tcx",
        };
        format!(
            "{{\"bench\":\"fuzz\",\"seed\":\"{:#x}\",\"attach\":\"{mode}\",\"rounds\":{},\"cases\":{},\"packets\":{},\
             \"refused\":{},\"findings\":{},\"counting\":{},\"known\":{},\"seconds\":{:.1},\"cases_per_second\":{:.0}}}",
            c.seed,
            self.rounds,
            self.cases,
            self.packets,
            self.refused,
            self.findings.len(),
            self.counting.len(),
            self.known,
            self.elapsed.as_secs_f64(),
            self.cases as f64 / self.elapsed.as_secs_f64().max(1e-3),
        )
    }
}

/// Destination ports: the edges of the tier ranges and NetworkPolicy
/// ports, and the edges of the round's ranges.
fn round_ports(c: &Compiled) -> Vec<u16> {
    let mut ports: std::collections::BTreeSet<u16> = [
        1, 949, 950, 960, 998, 999, 1000, 1001, 1004, 1007, 1010, 1011, 1100, 1101, 19_999, 20_000, 40_001,
    ]
    .into_iter()
    .collect();
    for e in c.policy.keys().filter(|e| e.protocol.is_some()) {
        let (lo, hi) = e.ports;
        ports.extend([lo.saturating_sub(1), lo, hi, hi.saturating_add(1)]);
    }
    ports.into_iter().collect()
}

fn addresses() -> Vec<&'static str> {
    let mut a = vec![NODE_IP, NODE_IP6];
    a.extend(PODS.iter().flat_map(|p| [p.v4, p.v6]));
    a.extend(OUTSIDE_V4);
    a.extend(OUTSIDE_V6);
    a
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Runs the fuzzer.
pub fn run(cfg: &Config) -> Outcome {
    sweep_leftovers();
    let started = Instant::now();
    let pins = PinDir::new(cfg.tag);
    let links: Vec<Dummy> = PODS
        .iter()
        .map(|p| Dummy::new(&format!("{}{}", cfg.tag, p.ep)))
        .collect();
    let mut dp =
        EbpfDataplane::open_with(pins.options_in(cfg.mode), cfg.switches).unwrap_or_else(|e| panic!("open: {e}"));
    let ifs: Interfaces = PODS.iter().zip(&links).map(|(p, l)| (p.ep, l.ifindex)).collect();
    let addrs = addresses();
    let mut model = Model::default();
    let mut out = Outcome::default();
    let mut prev = Compiled::default();
    let done = |o: &Outcome| {
        cfg.cases.is_some_and(|n| o.cases >= n)
            || cfg.duration.is_some_and(|d| started.elapsed() >= d)
            || (cfg.stop_at_first && !o.findings.is_empty())
    };
    let mut round = 0u64;
    // NPM_FUZZ_TRACE=1: every frame, its shape and verdict (to trace a
    // finding back to the frames that made its state).
    let trace = std::env::var_os("NPM_FUZZ_TRACE").is_some();
    while !done(&out) {
        let c = random_state(cfg.seed, round, &prev);
        if round == 0 || round % 16 == 8 {
            dp.sync_full(&c, &ifs).expect("sync_full");
        } else {
            dp.apply(&prev.diff(&c), &c, &ifs).expect("apply");
        }
        out.rounds += 1;
        let ports = round_ports(&c);
        let mut rng = Rng((cfg.seed.rotate_left(17) ^ (round + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9)) | 1);
        for n in 0..CASES_PER_ROUND {
            if done(&out) {
                break;
            }
            let k = rng.below(PODS.len() as u64) as usize;
            let pod = PODS[k];
            let own = (mapped(pod.v4.parse().expect("v4")), mapped(pod.v6.parse().expect("v6")));
            let scope = Scope {
                pod,
                addrs: &addrs,
                ports: &ports,
            };
            let packets = case(&mut rng, &scope);
            out.cases += 1;
            for (i, p) in packets.iter().enumerate() {
                // The kernel stamps its entries during the run: the model
                // records the instant before it and judges after it, so
                // that a descheduled fuzzer (a loaded host) only ever makes
                // the model's entries look older than the kernel's, never
                // younger (which would make it sure of an entry the
                // kernel has idled out).
                let before = Instant::now();
                let run = match dp.test_run_traced(p.dir, links[k].ifindex, &p.bytes) {
                    Ok(r) => r,
                    Err(_) => {
                        out.refused += 1;
                        continue;
                    }
                };
                let (verdict, mut reason) = (run.verdict, run.reason);
                let want = model.judge(&c, pod.ep, own, p.dir, &p.shape);
                out.packets += 1;
                *out.kinds.entry(p.what).or_default() += 1;
                *out.reasons
                    .entry(reason.map(|r| format!("{r:?}")).unwrap_or_else(|| "none".into()))
                    .or_default() += 1;
                let allowed = verdict == VERDICT_ALLOW;
                if trace {
                    eprintln!(
                        "trace round {round} case {n} packet {i} ep {} {:?} {}: {:?} -> {allowed} {reason:?}",
                        pod.ep, p.dir, p.what, p.shape
                    );
                }
                if allowed && matches!(p.shape, Shape::Later { .. }) {
                    out.later_allowed += 1;
                }
                // One finding's line: the frame, the specification and
                // what the datapath did (reason, slots moved, shape).
                let finding = |reason: Option<Reason>| {
                    format!(
                        "seed {:#x} round {round} case {n} packet {i} ({}), endpoint {} {:?}: \
                         spec {want:?}, datapath {} {reason:?} (slots moved {:?}); shape {:?}; frame {}",
                        cfg.seed,
                        p.what,
                        pod.ep,
                        p.dir,
                        if allowed { "allow" } else { "drop" },
                        run.moved,
                        p.shape,
                        hex(&p.bytes),
                    )
                };
                if reason.is_none() {
                    // The counters did not name one reason: the verdict is
                    // judged by the reasons whose slots moved, and the run
                    // is a counting finding whatever the verdict.
                    let moved = run.reasons_in(p.dir);
                    if let Some(r) = moved.iter().find(|r| want.permits(allowed, Some(**r))) {
                        reason = Some(*r);
                    }
                    out.counting.push(finding(None));
                }
                if !want.permits(allowed, reason) {
                    if want == Want::Exact(false, Reason::PolicyDenied) && !allowed && reason == Some(Reason::AdminDeny)
                    {
                        out.known += 1;
                    } else {
                        out.findings.push(finding(reason));
                    }
                }
                // The model follows the kernel (after a finding too).
                model.record(before, pod.ep, p.dir, &p.shape, allowed, reason);
            }
        }
        prev = c;
        round += 1;
    }
    out.elapsed = started.elapsed();
    out
}

/// Runs `cfg` and fails with every finding.
fn run_and_assert(cfg: Config) {
    let o = run(&cfg);
    eprintln!(
        "ebpf_fuzz {}: reasons {:?}; kinds {:?}; later fragments allowed {}",
        cfg.tag, o.reasons, o.kinds, o.later_allowed
    );
    println!("{}", o.json(&cfg));
    assert!(o.packets > 0, "no frame ran");
    // Not trivial: every rule of the specification decided frames.
    let seen = |r: &str| o.reasons.get(r).copied().unwrap_or(0);
    for r in [
        "Malformed",
        "Fragment",
        "Tracked",
        "Related",
        "Spoofed",
        "Icmpv6Control",
        "Host",
        "Policy",
        "PolicyDenied",
        "NotIsolated",
    ] {
        assert!(seen(r) > 0, "seed {:#x}: no frame decided as {r}", cfg.seed);
    }
    let tiers = ["AdminAccept", "AdminDeny", "BaselineAccept", "BaselineDeny"];
    assert!(
        tiers.iter().map(|r| seen(r)).sum::<u64>() > 0,
        "no frame decided by a tier"
    );
    assert!(o.later_allowed > 0, "no later fragment passed on its record");
    assert!(
        o.findings.is_empty(),
        "{} verdicts outside docs/packet-spec.md (rerun: cargo xtask fuzz --seed {:#x}):\n{}",
        o.findings.len(),
        cfg.seed,
        o.findings.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
    assert!(
        o.counting.is_empty(),
        "{} frames with a permitted verdict not counted under one reason (rerun: cargo xtask fuzz --seed {:#x}):\n{}",
        o.counting.len(),
        cfg.seed,
        o.counting.iter().take(30).cloned().collect::<Vec<_>>().join("\n")
    );
}

/// CI: a bounded run on tcx attach, the full datapath.
#[test]
fn ebpf_fuzz_tcx() {
    run_and_assert(Config {
        seed: 0xf022,
        cases: Some(4_000),
        duration: None,
        mode: crate::ebpf_common::default_mode(),
        switches: BenchSwitches::default(),
        tag: "fza",
        stop_at_first: false,
    });
}

/// CI: a bounded run on tc attach, the LPMs without the fold and the
/// general parser.
#[test]
fn ebpf_fuzz_tc() {
    let _serial = crate::serial();
    run_and_assert(Config {
        seed: 0xf023,
        cases: Some(2_000),
        duration: None,
        mode: AttachMode::Tc,
        switches: BenchSwitches {
            no_fold: true,
            no_fast_v4: true,
            ..BenchSwitches::default()
        },
        tag: "fzb",
        stop_at_first: false,
    });
}

/// `cargo xtask fuzz`: `NPM_FUZZ_SEED`, `NPM_FUZZ_CASES`,
/// `NPM_FUZZ_DURATION` (seconds), `NPM_FUZZ_ATTACH` (tcx or tc).
#[test]
#[ignore = "long runs: cargo xtask fuzz"]
fn fuzz_on_demand() {
    let env = |k: &str| std::env::var(k).ok().filter(|s| !s.trim().is_empty());
    let num = |s: String| -> u64 { npm_testkit::rng::parse_seed(&s).unwrap_or_else(|e| panic!("{s:?}: {e}")) };
    let seed = npm_testkit::rng::seed("NPM_FUZZ_SEED", None);
    let cases = env("NPM_FUZZ_CASES").map(num);
    let duration = env("NPM_FUZZ_DURATION").map(|s| Duration::from_secs(num(s)));
    let mode = match env("NPM_FUZZ_ATTACH").as_deref() {
        Some("tc") => AttachMode::Tc,
        _ => crate::ebpf_common::default_mode(),
    };
    let _serial = (mode == AttachMode::Tc).then(crate::serial);
    eprintln!("ebpf_fuzz: seed {seed:#x}");
    run_and_assert(Config {
        seed,
        cases: cases.or(if duration.is_none() { Some(10_000) } else { None }),
        duration,
        mode,
        switches: BenchSwitches::default(),
        tag: "fzc",
        stop_at_first: false,
    });
}
