//! Test mode (feature `testing`, not part of the production API):
//! [`EbpfDataplane::test_run`] runs a program on a crafted packet with
//! `BPF_PROG_TEST_RUN`, passing a `__sk_buff` context whose `ifindex` is
//! the endpoint's interface (the kernel binds the test skb to that device),
//! so the program sees exactly what it sees in production; nothing in the
//! program knows about test mode. [`EbpfDataplane::bench_run`] times
//! repeated runs for the datapath benchmark, and
//! [`EbpfDataplane::open_with`] opens with [`BenchSwitches`].

use std::time::Duration;

use aya::{TestRun, TestRunOptions};
use npm_common::{Reason, REASON_SLOTS};
use npm_policy::compiled::Direction;

use super::errors::{prog_err, EbpfError};
use super::links::prog_for;
use super::loader::{self, BenchSwitches, MapSizes};
use super::{EbpfDataplane, EbpfOptions};

impl EbpfDataplane {
    /// [`EbpfDataplane::open`] with benchmark switches (the datapath
    /// benchmark measures the conntrack lookup without the flow cache).
    pub fn open_with(opts: EbpfOptions, switches: BenchSwitches) -> Result<Self, EbpfError> {
        Self::open_switched(opts, switches)
    }

    /// [`EbpfDataplane::open_with`] creating the configurable maps with
    /// `sizes` (as [`EbpfDataplane::open_sized`]).
    pub fn open_with_sized(opts: EbpfOptions, sizes: MapSizes, switches: BenchSwitches) -> Result<Self, EbpfError> {
        Self::open_switched_sized(opts, sizes, switches)
    }

    fn run(
        &self,
        program: &'static str,
        ifindex: u32,
        packet: &[u8],
        repeat: u32,
    ) -> Result<aya::TestRunResult, EbpfError> {
        self.run_marked(program, ifindex, packet, repeat, 0, 0)
    }

    fn run_marked(
        &self,
        program: &'static str,
        ifindex: u32,
        packet: &[u8],
        repeat: u32,
        mark: u32,
        ingress_ifindex: u32,
    ) -> Result<aya::TestRunResult, EbpfError> {
        // `struct __sk_buff` up to and including `ifindex` (offset 40): the
        // kernel binds the test skb to that device; `mark` at offset 8,
        // `ingress_ifindex` (the kernel's `skb_iif`) at 36; every other
        // field zero.
        let mut ctx = [0u8; 44];
        ctx[8..12].copy_from_slice(&mark.to_ne_bytes());
        ctx[36..40].copy_from_slice(&ingress_ifindex.to_ne_bytes());
        ctx[40..44].copy_from_slice(&ifindex.to_ne_bytes());
        let prog = loader::prog(&self.bpf, program)?;
        prog.test_run(TestRunOptions {
            data_in: Some(packet),
            ctx_in: Some(&ctx),
            repeat,
            ..TestRunOptions::default()
        })
        .map_err(prog_err(program, format!("test run on ifindex {ifindex}")))
    }

    /// Runs the program of `dir` once on `packet` (an Ethernet frame) as if
    /// it arrived on host-side interface `ifindex` (which must exist), with
    /// `BPF_PROG_TEST_RUN`. Returns the verdict
    /// ([`super::VERDICT_ALLOW`] or [`super::VERDICT_DROP`]) and the reason,
    /// found from the counter slot that moved (`None` if other traffic
    /// moved counters at the same time).
    pub fn test_run(&self, dir: Direction, ifindex: u32, packet: &[u8]) -> Result<(i32, Option<Reason>), EbpfError> {
        let d = dir.as_u8();
        let before = self.reports.packets_by_slot(d)?;
        let res = self.run(prog_for(d), ifindex, packet, 1)?;
        let after = self.reports.packets_by_slot(d)?;
        let moved: Vec<u8> = (0..REASON_SLOTS as u8)
            .filter(|r| after[*r as usize] != before[*r as usize])
            .collect();
        let reason = match moved.as_slice() {
            [r] => Reason::from_u8(*r),
            _ => None,
        };
        Ok((res.return_value as i32, reason))
    }

    /// [`EbpfDataplane::test_run`] that reports every counter slot the run
    /// moved, in both directions: [`TracedRun::reason`] is the reason of
    /// the single slot of `dir` that moved by one (as `test_run`), and
    /// [`TracedRun::moved`] lists each moved slot as (direction, reason
    /// slot, packets added), so that a caller can tell a run that counted
    /// nothing, or twice, from one it could attribute. 128 counter reads a
    /// run: for the fuzzer, not for bulk tests.
    pub fn test_run_traced(&self, dir: Direction, ifindex: u32, packet: &[u8]) -> Result<TracedRun, EbpfError> {
        let read = || -> Result<Vec<Vec<u64>>, EbpfError> {
            [Direction::Ingress, Direction::Egress]
                .iter()
                .map(|d| self.reports.packets_by_slot(d.as_u8()))
                .collect()
        };
        let before = read()?;
        let res = self.run(prog_for(dir.as_u8()), ifindex, packet, 1)?;
        let after = read()?;
        let mut moved = Vec::new();
        for (d, (b, a)) in [Direction::Ingress, Direction::Egress]
            .iter()
            .zip(before.iter().zip(&after))
        {
            for slot in 0..REASON_SLOTS as usize {
                if a[slot] != b[slot] {
                    moved.push((*d, slot as u8, a[slot].wrapping_sub(b[slot])));
                }
            }
        }
        let reason = match moved.as_slice() {
            [(d, slot, 1)] if *d == dir => Reason::from_u8(*slot),
            _ => None,
        };
        Ok(TracedRun {
            verdict: res.return_value as i32,
            reason,
            moved,
        })
    }

    /// [`EbpfDataplane::test_run`] when the caller knows the reason it
    /// expects: returns the verdict and whether the counter slot of
    /// `expected` moved by exactly one (two counter reads instead of the
    /// 64 of `test_run`, for tests that run many thousands of packets; on
    /// `false`, `test_run` on a new flow tells the reason it got).
    pub fn test_run_expecting(
        &self,
        dir: Direction,
        ifindex: u32,
        packet: &[u8],
        expected: Reason,
    ) -> Result<(i32, bool), EbpfError> {
        let d = dir.as_u8();
        let before = self.reports.packets_in_slot(d, expected as u8)?;
        let res = self.run(prog_for(d), ifindex, packet, 1)?;
        let after = self.reports.packets_in_slot(d, expected as u8)?;
        Ok((res.return_value as i32, after == before + 1))
    }

    /// [`EbpfDataplane::test_run`] of a packet carrying the skb mark
    /// `mark` (e.g. `npm_common::defer_mark`'s) that entered the node on
    /// `ingress_ifindex` (a deferred packet's sender is found by it);
    /// returns the verdict only (a deferred decision is counted in the
    /// sender's direction: read the counters).
    pub fn test_run_marked(
        &self,
        dir: Direction,
        ifindex: u32,
        packet: &[u8],
        mark: u32,
        ingress_ifindex: u32,
    ) -> Result<i32, EbpfError> {
        let res = self.run_marked(prog_for(dir.as_u8()), ifindex, packet, 1, mark, ingress_ifindex)?;
        Ok(res.return_value as i32)
    }

    /// Benchmark helper: runs a program `repeat` times on `packet` (as on
    /// `ifindex`) and returns the kernel's average time per run.
    pub fn bench_run(
        &self,
        program: &'static str,
        ifindex: u32,
        packet: &[u8],
        repeat: u32,
    ) -> Result<Duration, EbpfError> {
        Ok(self.run(program, ifindex, packet, repeat)?.duration)
    }
}

/// The outcome of [`EbpfDataplane::test_run_traced`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TracedRun {
    /// The program's return value.
    pub verdict: i32,
    /// The reason, when exactly one slot moved, by one, in the run's
    /// direction.
    pub reason: Option<Reason>,
    /// Every slot that moved: (direction, reason slot, packets added).
    pub moved: Vec<(Direction, u8, u64)>,
}

impl TracedRun {
    /// The reasons of the slots of `dir` that moved (whatever by).
    pub fn reasons_in(&self, dir: Direction) -> Vec<Reason> {
        self.moved
            .iter()
            .filter(|(d, _, _)| *d == dir)
            .filter_map(|(_, slot, _)| Reason::from_u8(*slot))
            .collect()
    }
}
