//! Probing for the live runner: a case probe's matrix observed on the
//! cluster until it matches the expectation (or the deadline passes), and
//! a whole case run with its report.

use std::net::SocketAddr;

use npm_policy::model::Protocol;
use npm_sim::cases::{self, Case, Matrix};

use super::LiveRunner;
use crate::probe::{probe_until, Probe, ProbeConfig, Proto};
use crate::runner::{Destination, RunnerError};

fn proto_of(p: Protocol) -> Proto {
    match p {
        Protocol::Tcp => Proto::Tcp,
        Protocol::Udp => Proto::Udp,
        Protocol::Sctp => Proto::Sctp,
    }
}

/// The probe jobs of one case probe: the jobs, the expected verdict of
/// each, and the matrix cell each fills.
struct ProbeJobs {
    expected: Matrix,
    jobs: Vec<Probe>,
    want: Vec<bool>,
    cells: Vec<(usize, usize)>,
}

impl LiveRunner {
    /// The jobs of one case probe (one per off-diagonal cell; two for a
    /// host-network destination with Services).
    fn probe_jobs(&self, probe: &cases::Probe) -> Result<ProbeJobs, RunnerError> {
        let proto = probe.protocol().map_err(|e| RunnerError::Probe(e.to_string()))?;
        let expected = probe.expected().map_err(|e| RunnerError::Probe(e.to_string()))?;
        let mut out = ProbeJobs {
            expected,
            jobs: Vec::new(),
            want: Vec::new(),
            cells: Vec::new(),
        };
        for (ri, r) in out.expected.rows.iter().enumerate() {
            let (rns, rname) = r.split_once('/').unwrap_or(("", ""));
            let src = self
                .cluster
                .pod(rns, rname)
                .ok_or_else(|| RunnerError::Probe(format!("source pod {r} does not exist")))?;
            if src.host_network {
                return Err(RunnerError::Probe(format!(
                    "host-network pod {r} cannot be a probe source"
                )));
            }
            for (ci, c) in out.expected.columns.iter().enumerate() {
                if r == c {
                    continue;
                }
                let (cns, cname) = c.split_once('/').unwrap_or(("", ""));
                let dst = self
                    .cluster
                    .pod(cns, cname)
                    .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} does not exist")))?;
                // A host-network pod is probed at its address (its node's,
                // as upstream probes `status.podIP`) and, with Services,
                // through its Service too (a backend on a node's host
                // network): both must give the cell's verdict.
                let dst_ips = match self.opts.destination {
                    Destination::Pod => vec![dst.ip(self.opts.ipv6)],
                    Destination::Service => {
                        let svc = self
                            .service_ip(cns, cname, self.opts.ipv6)
                            .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} has no Service")))?;
                        if dst.host_network {
                            vec![dst.ip(self.opts.ipv6), svc]
                        } else {
                            vec![svc]
                        }
                    }
                };
                for dst_ip in dst_ips {
                    out.jobs.push(Probe {
                        src_netns: src.netns.clone(),
                        dst_pod: dst.receiver(),
                        dst: SocketAddr::new(dst_ip, probe.port),
                        proto: proto_of(proto),
                    });
                    out.want.push(out.expected.cells[ri][ci]);
                    out.cells.push((ri, ci));
                }
            }
        }
        Ok(out)
    }

    /// Probes every probe of one step as one parallel batch until all of
    /// them match or the deadline passes; returns (expected, observed) per
    /// probe. (One batch, so a step's denied cells wait out one probe
    /// timeout together, not one per probe.)
    pub fn probe_step(&mut self, probes: &[cases::Probe]) -> Result<Vec<(Matrix, Matrix)>, RunnerError> {
        let mut parts = Vec::with_capacity(probes.len());
        let mut jobs = Vec::new();
        let mut want = Vec::new();
        for p in probes {
            let pj = self.probe_jobs(p)?;
            jobs.extend(pj.jobs.iter().cloned());
            want.extend(pj.want.iter().copied());
            parts.push(pj);
        }
        let cfg = ProbeConfig {
            timeout: self.opts.probe_timeout,
            threads: self.opts.threads,
            sctp_log: self.cluster.sctp_log(),
        };
        // The very first probe also waits for the agent to come up.
        let deadline = if self.first_probe {
            self.opts.deadline.max(self.opts.startup_deadline)
        } else {
            self.opts.deadline
        };
        self.first_probe = false;
        let (got, _rounds) = probe_until(&jobs, &want, &cfg, deadline, self.opts.settle, true);
        let mut at = 0;
        let mut out = Vec::with_capacity(parts.len());
        for pj in parts {
            let mut observed = pj.expected.clone();
            // A cell probed twice (a host-network pod directly and through
            // its Service) shows a mismatch if either probe had one.
            for &(ri, ci) in &pj.cells {
                if got[at] != pj.expected.cells[ri][ci] {
                    observed.cells[ri][ci] = got[at];
                }
                at += 1;
            }
            out.push((pj.expected, observed));
        }
        Ok(out)
    }

    /// Runs one case from the pristine model.
    pub fn run_case(&mut self, case: &Case) -> (bool, String) {
        let mut report = String::new();
        let mut ok = true;
        if let Some(msg) = self.agent_exited() {
            return (false, format!("  the agent is not running: {msg}\n"));
        }
        if let Err(e) = self.reset_to(case.topology()) {
            return (false, format!("  reset to the pristine model: {e}\n"));
        }
        for (si, step) in case.steps.iter().enumerate() {
            for a in &step.actions {
                if let Err(e) = self.apply(a) {
                    return (false, format!("{report}  step {si}: {e}\n"));
                }
            }
            std::thread::sleep(self.opts.settle);
            let results = match self.probe_step(&step.probes) {
                Ok(r) => r,
                Err(e) => return (false, format!("{report}  step {si}: {e}\n")),
            };
            for (pi, (p, (expected, observed))) in step.probes.iter().zip(results).enumerate() {
                let mism = expected.compare(&observed);
                if !mism.is_empty() {
                    ok = false;
                    report.push_str(&format!(
                        "  step {si} probe {pi} ({} {}{}): {} cells differ\n  expected:\n{}  observed:\n{}",
                        p.protocol,
                        p.port,
                        if self.opts.ipv6 { " IPv6" } else { "" },
                        mism.len(),
                        indent(&expected.render()),
                        indent(&observed.render())
                    ));
                    for m in mism.iter().take(20) {
                        report.push_str(&format!("    {m}\n"));
                    }
                }
            }
        }
        if let Some(msg) = self.agent_exited() {
            ok = false;
            report.push_str(&format!("  the agent died: {msg}\n"));
        }
        (ok, report)
    }
}

fn indent(s: &str) -> String {
    s.lines().map(|l| format!("    {l}\n")).collect()
}
