//! The Service side of the multi-node live runner: the EndpointSlice
//! controller and one kube-proxy emulation per node (both
//! [`crate::kube_proxy`] and [`crate::endpointslices`], owned by their own
//! module), started before the pods, and the wait, after a pod's Service
//! is created, until every node's kube-proxy has programmed its endpoint
//! (so a probe of a fresh Service is never "blocked" only because its DNAT
//! is not there yet).

use std::time::{Duration, Instant};

use super::{api_err, LiveRunner};
use crate::endpointslices::EndpointSliceController;
use crate::kube_proxy::{KubeProxy, Mode};
use crate::runner::{KubeProxyMode, RunnerError};

/// The Service plumbing of a run.
#[derive(Default)]
pub(super) struct ServicePlumbing {
    pub(super) proxies: Vec<KubeProxy>,
    pub(super) endpoints: Option<EndpointSliceController>,
}

impl std::fmt::Debug for ServicePlumbing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServicePlumbing")
            .field("proxies", &self.proxies.len())
            .finish()
    }
}

impl ServicePlumbing {
    /// Stops the kube-proxies (their rules removed) and the controller.
    pub(super) fn stop(&mut self) {
        for p in std::mem::take(&mut self.proxies) {
            p.stop();
        }
        if let Some(c) = self.endpoints.take() {
            c.stop();
        }
    }

    /// Each kube-proxy's applied generation.
    pub(super) fn generations(&self) -> Vec<u64> {
        self.proxies.iter().map(|p| p.applied_generation()).collect()
    }
}

impl LiveRunner {
    /// Starts the EndpointSlice controller and a kube-proxy in every node.
    pub(super) fn start_services(&mut self) -> Result<(), RunnerError> {
        let mode = match self.opts.kube_proxy {
            KubeProxyMode::None => return Ok(()),
            KubeProxyMode::Iptables => Mode::Iptables,
            KubeProxyMode::Nftables => Mode::Nftables,
        };
        let err = |what: &str, e: String| RunnerError::Action {
            action: "kube-proxy",
            message: format!("{what}: {e}"),
        };
        let controller =
            EndpointSliceController::start(self.api.clone()).map_err(|e| err("endpointslices", e.to_string()))?;
        self.plumbing.endpoints = Some(controller);
        if let Some(nodes) = self.cluster.nodes() {
            for node in nodes.nodes() {
                let kp = KubeProxy::start(&node.netns, mode, self.api.clone(), &node.name)
                    .map_err(|e| err(&node.name, e.to_string()))?;
                self.plumbing.proxies.push(kp);
            }
        }
        // The first pass of a node loads the nf_tables modules its rules
        // need (conntrack, NAT, masquerade, reject, fib, numgen: one module
        // autoload, and one replay of the transaction, each) unless an
        // earlier run loaded them; under emulation (the arm64 VM row's TCG)
        // that alone takes longer than 20 s. So the wait is the startup
        // deadline, as for the agents (`--deadline-secs`), never under 20 s.
        let wait = self.opts.startup_deadline.max(Duration::from_secs(20));
        for kp in &self.plumbing.proxies {
            if !kp.wait_synced(wait) {
                return Err(err(
                    "first sync",
                    kp.last_error()
                        .unwrap_or_else(|| format!("not synced after {} s", wait.as_secs())),
                ));
            }
        }
        Ok(())
    }

    /// Waits (up to 10 s, or the probe deadline if longer) until the EndpointSlice of `ns/pod`'s Service
    /// lists the pod's address and every kube-proxy applied a rule set
    /// after `before` (their generations before the Service was created),
    /// then one more poll interval.
    pub(super) fn wait_service_programmed(&self, ns: &str, pod: &str, before: &[u64]) -> Result<(), RunnerError> {
        let Some(p) = self.cluster.pod(ns, pod) else {
            return Ok(());
        };
        let want = p.ipv4.to_string();
        let svc = super::nodes::service_name(ns, pod);
        let path = format!(
            "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices?labelSelector=kubernetes.io/service-name%3D{svc}"
        );
        let wait = self.opts.deadline.max(Duration::from_secs(10));
        let end = Instant::now() + wait;
        loop {
            let list = self.api.get(&path).map_err(api_err)?;
            let listed = list["items"].as_array().is_some_and(|items| {
                items.iter().any(|s| {
                    s["endpoints"].as_array().is_some_and(|eps| {
                        eps.iter().any(|e| {
                            e["addresses"]
                                .as_array()
                                .is_some_and(|a| a.iter().any(|x| x == want.as_str()))
                        })
                    })
                })
            });
            let applied = self
                .plumbing
                .generations()
                .iter()
                .zip(before)
                .all(|(now, was)| now > was);
            if listed && applied {
                std::thread::sleep(Duration::from_millis(250));
                return Ok(());
            }
            if Instant::now() >= end {
                return Err(RunnerError::Action {
                    action: "create_service",
                    message: format!(
                        "service {svc}: endpoint listed {listed}, every kube-proxy applied {applied}, after {} s{}",
                        wait.as_secs(),
                        self.plumbing
                            .proxies
                            .iter()
                            .find_map(|p| p.last_error())
                            .map(|e| format!(" (last error: {e})"))
                            .unwrap_or_default()
                    ),
                });
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
