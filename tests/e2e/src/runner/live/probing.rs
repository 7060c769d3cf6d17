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

impl LiveRunner {
    /// Probes one case probe until it matches or the deadline passes;
    /// returns (expected, observed, rounds).
    pub fn probe(&mut self, probe: &cases::Probe) -> Result<(Matrix, Matrix, usize), RunnerError> {
        let proto = probe.protocol().map_err(|e| RunnerError::Probe(e.to_string()))?;
        let expected = probe.expected().map_err(|e| RunnerError::Probe(e.to_string()))?;
        let mut jobs = Vec::new();
        let mut want = Vec::new();
        let mut cells = Vec::new();
        for (ri, r) in expected.rows.iter().enumerate() {
            let (rns, rname) = r.split_once('/').unwrap_or(("", ""));
            let src = self
                .cluster
                .pod(rns, rname)
                .ok_or_else(|| RunnerError::Probe(format!("source pod {r} does not exist")))?;
            for (ci, c) in expected.columns.iter().enumerate() {
                if r == c {
                    continue;
                }
                let (cns, cname) = c.split_once('/').unwrap_or(("", ""));
                let dst = self
                    .cluster
                    .pod(cns, cname)
                    .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} does not exist")))?;
                let dst_ip = match self.opts.destination {
                    Destination::Pod => dst.ip(self.opts.ipv6),
                    Destination::Service => self
                        .service_ip(cns, cname, self.opts.ipv6)
                        .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} has no Service")))?,
                };
                jobs.push(Probe {
                    src_netns: src.netns.clone(),
                    dst_pod: dst.key(),
                    dst: SocketAddr::new(dst_ip, probe.port),
                    proto: proto_of(proto),
                });
                want.push(expected.cells[ri][ci]);
                cells.push((ri, ci));
            }
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
        let (got, rounds) = probe_until(&jobs, &want, &cfg, deadline, self.opts.settle, true);
        let mut observed = expected.clone();
        for (k, &(ri, ci)) in cells.iter().enumerate() {
            observed.cells[ri][ci] = got[k];
        }
        Ok((expected, observed, rounds))
    }

    /// Runs one case from the pristine model.
    pub fn run_case(&mut self, case: &Case) -> (bool, String) {
        let mut report = String::new();
        let mut ok = true;
        if let Some(msg) = self.agent_exited() {
            return (false, format!("  the agent is not running: {msg}\n"));
        }
        if let Err(e) = self.reset() {
            return (false, format!("  reset to the pristine model: {e}\n"));
        }
        for (si, step) in case.steps.iter().enumerate() {
            for a in &step.actions {
                if let Err(e) = self.apply(a) {
                    return (false, format!("{report}  step {si}: {e}\n"));
                }
            }
            std::thread::sleep(self.opts.settle);
            for (pi, p) in step.probes.iter().enumerate() {
                match self.probe(p) {
                    Ok((expected, observed, _rounds)) => {
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
                    Err(e) => return (false, format!("{report}  step {si} probe {pi}: {e}\n")),
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
