//! What the enforcement bench needs of the live runner: a cluster preloaded
//! with many objects before the agents start ([`Preload`]), and a pod
//! wired through the CNI chain with the moments that matter timed
//! ([`LiveRunner::create_pod_wired_timed`]).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use super::{api_err, LiveRunner};
use crate::api::{pod_object, pod_path};
use crate::cluster::{PodNet, PodWiring};
use crate::runner::RunnerError;

/// Objects written into the test API server's store before the agents
/// start, shaped as `cargo xtask bench agent` shapes them: `pods` pods in
/// the namespaces `bench0`..`bench9` on another node (`node-b`, remote to
/// every agent), labelled `app: g<i mod 100>`, addresses from 10.100.0.0
/// up; `policies` NetworkPolicies there, each admitting `g<i+1>` to
/// `g<i>` on a port of its own. None of them selects a pod of the model's
/// namespaces.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Preload {
    /// Pods.
    pub pods: usize,
    /// NetworkPolicies.
    pub policies: usize,
}

/// The namespaces of the preloaded objects.
pub const PRELOAD_NAMESPACES: usize = 10;

/// The address of preloaded (or churn) pod `i`.
pub fn preload_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(10, 100 + (i / 65536) as u8, ((i / 256) % 256) as u8, (i % 256) as u8)
}

/// Preloaded pod `i` (also the churn's pods).
pub fn preload_pod(i: usize) -> (String, Value) {
    let ns = format!("bench{}", i % PRELOAD_NAMESPACES);
    let ip = preload_ip(i).to_string();
    let obj = json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": format!("p{i}"), "namespace": ns, "labels": {"app": format!("g{}", i % 100)}},
        "spec": {"nodeName": "node-b", "containers": [{"name": "c", "image": "agnhost"}]},
        "status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]},
    });
    (ns, obj)
}

/// Preloaded policy `i` (also the churn's, with another name).
pub fn preload_policy(i: usize, name: &str) -> (String, Value) {
    let ns = format!("bench{}", i % PRELOAD_NAMESPACES);
    let obj = json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": format!("g{}", i % 100)}},
                 "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": format!("g{}", (i + 1) % 100)}}}],
                              "ports": [{"port": 1000 + (i % 100) as i64}]}]},
    });
    (ns, obj)
}

impl Preload {
    /// Writes the namespaces and objects into `server`'s store directly
    /// (no HTTP; the same defaulting, validation and watch events as a
    /// POST).
    pub fn apply(&self, server: &npm_testapi::TestApiServer) -> Result<(), RunnerError> {
        use npm_testapi::Kind;
        let err = |e: npm_testapi::ApiError| RunnerError::ApiServer(format!("preload: {e}"));
        for n in 0..PRELOAD_NAMESPACES {
            let ns = json!({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": format!("bench{n}")}});
            server.create_object(Kind::Namespace, None, ns).map_err(err)?;
        }
        for i in 0..self.pods {
            let (ns, obj) = preload_pod(i);
            server.create_object(Kind::Pod, Some(&ns), obj).map_err(err)?;
        }
        for i in 0..self.policies {
            let (ns, obj) = preload_policy(i, &format!("np{i}"));
            server.create_object(Kind::NetworkPolicy, Some(&ns), obj).map_err(err)?;
        }
        Ok(())
    }
}

/// The moments of a pod made by [`LiveRunner::create_pod_wired_timed`].
#[derive(Clone, Copy, Debug)]
pub struct WiredTimes {
    /// How long npm-cni's ADD took, as the runtime waited for it (process
    /// start to exit: npm-cni holds ADD until the agent has enforced the
    /// pod).
    pub npm_cni_add: Duration,
    /// The whole chain's ADD (the interface plugin, IPAM and npm-cni).
    pub chain_add: Duration,
    /// When the status write (the pod's IPs) was sent.
    pub status_sent: Instant,
    /// When its response came back.
    pub status_done: Instant,
}

impl LiveRunner {
    /// Creates pod `ns/name` (unknown to the model) with `labels` at
    /// `v4`/`v6` on the node owning the address's subnet, as the kubelet
    /// does with the CNI chain: the Pod object scheduled without an IP,
    /// CNI ADD, then the status write with its IPs; returns the times.
    /// `after_add` is called between ADD and the status write (the pod's
    /// netns is wired). Delete it with [`LiveRunner::delete_unmodelled_pod`].
    pub fn create_pod_wired_timed(
        &mut self,
        ns: &str,
        name: &str,
        labels: &BTreeMap<String, String>,
        v4: Ipv4Addr,
        v6: Ipv6Addr,
        after_add: &mut dyn FnMut(&PodNet),
    ) -> Result<WiredTimes, RunnerError> {
        if !matches!(self.cluster.wiring(), PodWiring::Cni(_)) {
            return Err(RunnerError::Options(
                "timed pods need the CNI chain (--cni ptp|bridge)".into(),
            ));
        }
        let node = self.cluster.node_name_for(v4).unwrap_or_default();
        let mut obj = pod_object(ns, name, labels, &node, &[]);
        obj["status"] = json!({"phase": "Pending"});
        let created = self
            .api
            .create(&format!("/api/v1/namespaces/{ns}/pods"), &obj)
            .map_err(api_err)?;
        let uid = created["metadata"]["uid"].as_str().unwrap_or_default().to_string();
        let t_add = Instant::now();
        if let Err(e) = self.cluster.create_pod_cni(ns, name, v4, v6, &uid) {
            let _ = self.api.delete(&pod_path(ns, name));
            return Err(e.into());
        }
        let chain_add = t_add.elapsed();
        let pod = self.cluster.pod(ns, name).ok_or_else(|| RunnerError::Action {
            action: "create_pod_wired_timed",
            message: format!("{ns}/{name}: not in the cluster after ADD"),
        })?;
        let npm_cni_add = pod
            .attachment
            .as_ref()
            .and_then(|a| a.add_timings.iter().find(|(t, _)| t == "npm-cni"))
            .map(|(_, d)| *d)
            .ok_or_else(|| RunnerError::Action {
                action: "create_pod_wired_timed",
                message: format!("{ns}/{name}: no npm-cni ADD in the chain"),
            })?;
        after_add(pod);
        let status = json!({"status": {
            "phase": "Running",
            "podIP": v4.to_string(),
            "podIPs": [{"ip": IpAddr::V4(v4).to_string()}, {"ip": IpAddr::V6(v6).to_string()}],
        }});
        let status_sent = Instant::now();
        self.api
            .merge_patch(&format!("{}/status", pod_path(ns, name)), &status)
            .map_err(api_err)?;
        let status_done = Instant::now();
        Ok(WiredTimes {
            npm_cni_add,
            chain_add,
            status_sent,
            status_done,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn preload_addresses_are_distinct_and_outside_the_model() {
        assert_eq!(preload_ip(0), Ipv4Addr::new(10, 100, 0, 0));
        assert_eq!(preload_ip(65_537), Ipv4Addr::new(10, 101, 0, 1));
        assert_eq!(preload_ip(99_999), Ipv4Addr::new(10, 101, 134, 159));
        let (ns, p) = preload_pod(12);
        assert_eq!(ns, "bench2");
        assert_eq!(p["metadata"]["labels"]["app"], "g12");
        let (ns, np) = preload_policy(3, "np3");
        assert_eq!(ns, "bench3");
        assert_eq!(np["spec"]["ingress"][0]["ports"][0]["port"], 1003);
    }
}
