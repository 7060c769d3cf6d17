//! Observing the live cluster: one probe round over every pair of the
//! model's pods, rounds until an expectation holds, and the policies the
//! API server holds.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use npm_policy::model::Protocol;
use npm_sim::cases::Matrix;
use serde_json::Value;

use crate::probe::{probe_all, Probe, ProbeConfig, Proto};
use crate::runner::{LiveRunner, RunnerError};

use super::expect::all_reachable;
use super::{model_pods, stop_requested, DemoError};

/// Probes every ordered pair of the model's pods once (no retries, no
/// expectation); the diagonal is reported reachable.
pub fn observe(runner: &LiveRunner, protocol: Protocol, port: u16) -> Result<Matrix, DemoError> {
    let pods = model_pods();
    let proto = match protocol {
        Protocol::Tcp => Proto::Tcp,
        Protocol::Udp => Proto::Udp,
        Protocol::Sctp => Proto::Sctp,
    };
    let cluster = runner.cluster();
    let mut jobs = Vec::new();
    let mut cells = Vec::new();
    for (ri, r) in pods.iter().enumerate() {
        let (rns, rname) = r.split_once('/').unwrap_or(("", ""));
        let src = cluster
            .pod(rns, rname)
            .ok_or_else(|| RunnerError::Probe(format!("source pod {r} does not exist")))?;
        for (ci, c) in pods.iter().enumerate() {
            if r == c {
                continue;
            }
            let (cns, cname) = c.split_once('/').unwrap_or(("", ""));
            let dst = cluster
                .pod(cns, cname)
                .ok_or_else(|| RunnerError::Probe(format!("destination pod {c} does not exist")))?;
            jobs.push(Probe {
                src_netns: src.netns.clone(),
                dst_pod: dst.key(),
                dst: SocketAddr::new(dst.ip(false), port),
                proto,
            });
            cells.push((ri, ci));
        }
    }
    let cfg = ProbeConfig {
        timeout: Duration::from_secs(1),
        threads: 32,
        sctp_log: cluster.sctp_log(),
    };
    let got = probe_all(&jobs, &cfg);
    let mut m = all_reachable(&pods, &pods);
    for (k, &(ri, ci)) in cells.iter().enumerate() {
        m.cells[ri][ci] = got[k];
    }
    Ok(m)
}

/// Probes until the observed matrix equals `expected` (confirmed by one
/// more round) or `deadline` passes; returns the last observation.
pub fn observe_until(
    runner: &LiveRunner,
    protocol: Protocol,
    port: u16,
    expected: &Matrix,
    deadline: Duration,
) -> Result<Matrix, DemoError> {
    let end = Instant::now() + deadline;
    let mut confirmed = false;
    loop {
        let m = observe(runner, protocol, port)?;
        if expected.compare(&m).is_empty() {
            if confirmed {
                return Ok(m);
            }
            confirmed = true;
        } else {
            confirmed = false;
        }
        if Instant::now() >= end || stop_requested() {
            return Ok(m);
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// The NetworkPolicies in the API server, sorted by `ns/name`.
pub fn list_policies(runner: &LiveRunner) -> Result<Vec<Value>, DemoError> {
    let list = runner
        .api()
        .get("/apis/networking.k8s.io/v1/networkpolicies")
        .map_err(|source| DemoError::Api {
            context: "listing NetworkPolicies".into(),
            source,
        })?;
    let mut items = list["items"].as_array().cloned().unwrap_or_default();
    items.sort_by_key(policy_name);
    Ok(items)
}

pub(super) fn policy_name(p: &Value) -> String {
    format!(
        "{}/{}",
        p["metadata"]["namespace"].as_str().unwrap_or(""),
        p["metadata"]["name"].as_str().unwrap_or("")
    )
}
