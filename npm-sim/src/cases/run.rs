//! A simulated run of a case: each step's actions on the pristine model of
//! the case's topology ([`Model::new`]), each probe checked against the
//! reference evaluator and the compiled lookup. A probe naming a pod that
//! does not exist is an error (as in live runs), so a case on the wrong
//! topology cannot pass by probing nothing.

use super::{Case, Matrix, Mismatch, Model};

/// The outcome of one probe.
#[derive(Clone, Debug)]
pub struct ProbeResult {
    /// Step index.
    pub step: usize,
    /// Probe index in the step.
    pub probe: usize,
    /// Expected matrix.
    pub expected: Matrix,
    /// Matrix of the reference evaluator.
    pub actual: Matrix,
    /// Cells where the evaluator differs from the expectation.
    pub mismatches: Vec<Mismatch>,
    /// Cells where the compiled lookup differs from the evaluator (a
    /// compiler bug).
    pub compiled_mismatches: Vec<Mismatch>,
}

/// The outcome of a case.
#[derive(Clone, Debug)]
pub struct CaseResult {
    /// Case id.
    pub id: String,
    /// Probes run.
    pub probes: Vec<ProbeResult>,
    /// An action or probe that could not run (the case fails).
    pub error: Option<String>,
}

impl CaseResult {
    /// No error, no mismatch.
    pub fn passed(&self) -> bool {
        self.error.is_none()
            && self
                .probes
                .iter()
                .all(|p| p.mismatches.is_empty() && p.compiled_mismatches.is_empty())
    }

    /// A human report: the failing probes with their matrices.
    pub fn report(&self) -> String {
        let mut s = format!("{}: {}\n", self.id, if self.passed() { "PASS" } else { "FAIL" });
        if let Some(e) = &self.error {
            s.push_str(&format!("  error: {e}\n"));
        }
        for p in self
            .probes
            .iter()
            .filter(|p| !p.mismatches.is_empty() || !p.compiled_mismatches.is_empty())
        {
            s.push_str(&format!(
                "  step {} probe {}:\n  expected:\n{}  actual:\n{}",
                p.step,
                p.probe,
                p.expected.render(),
                p.actual.render()
            ));
            for m in &p.mismatches {
                s.push_str(&format!("    {m}\n"));
            }
            for m in &p.compiled_mismatches {
                s.push_str(&format!("    compiled disagrees with evaluator: {m}\n"));
            }
        }
        s
    }
}

/// Runs a case on the pristine model of its topology: applies each step's
/// actions, then checks each probe against the evaluator and the compiled
/// lookup.
pub fn run_case_simulated(case: &Case) -> CaseResult {
    let mut res = CaseResult {
        id: case.id.clone(),
        probes: Vec::new(),
        error: None,
    };
    let mut model = Model::new(case.topology());
    for (si, step) in case.steps.iter().enumerate() {
        for a in &step.actions {
            if let Err(e) = model.apply(a) {
                res.error = Some(format!("step {si}: {e}"));
                return res;
            }
        }
        for (pi, probe) in step.probes.iter().enumerate() {
            let (proto, expected) = match probe.protocol().and_then(|p| Ok((p, probe.expected()?))) {
                Ok(v) => v,
                Err(e) => {
                    res.error = Some(format!("step {si} probe {pi}: {e}"));
                    return res;
                }
            };
            if let Some(missing) = expected
                .rows
                .iter()
                .chain(&expected.columns)
                .find(|p| model.ip(p).is_none())
            {
                res.error = Some(format!(
                    "step {si} probe {pi}: pod {missing} does not exist (topology {})",
                    model.topology().name()
                ));
                return res;
            }
            // A host-network pod is the node: the runners probe from pods.
            if let Some(host) = expected.rows.iter().find(|p| model.is_host_network(p)) {
                res.error = Some(format!(
                    "step {si} probe {pi}: host-network pod {host} cannot be a probe source"
                ));
                return res;
            }
            let (actual, compiled) = model.probe(&expected.rows, &probe.pods, proto, probe.port);
            let mismatches = expected.compare(&actual);
            let compiled_mismatches = actual.compare(&compiled);
            res.probes.push(ProbeResult {
                step: si,
                probe: pi,
                expected,
                actual,
                mismatches,
                compiled_mismatches,
            });
        }
    }
    res
}
