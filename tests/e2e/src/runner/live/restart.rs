//! Agents of a multi-node run killed and started again one node at a time
//! (the chaos soak's `kill -9` and restart), without waiting for
//! readiness: the caller watches `/readyz` itself.

use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;

use super::agent::AgentSpec;
use super::nodes::NODE_METRICS_PORT;
use super::LiveRunner;
use crate::runner::RunnerError;

impl LiveRunner {
    /// Creates `pod`, which the model does not know, at `v4`/`v6` on node
    /// `node` (1-based; `None`: the node owning the address's subnet),
    /// wired as the cluster wires model pods (the CNI chain: the Pod object
    /// first, ADD, then its status); on another node than the subnet's
    /// owner the other nodes route the address to it. Delete it with
    /// [`LiveRunner::delete_unmodelled_pod`].
    pub fn create_unmodelled_pod_wired(
        &mut self,
        pod: &npm_policy::model::Pod,
        v4: std::net::Ipv4Addr,
        v6: std::net::Ipv6Addr,
        node: Option<u8>,
    ) -> Result<(), RunnerError> {
        let served = self.model.topology().served_ports();
        self.create_pod_on(pod, v4, v6, &served, node)
    }

    /// The agents' metrics/health addresses by node index (1-based) of a
    /// multi-node run.
    pub fn node_metrics_addr(&self, k: u8) -> Option<SocketAddr> {
        let node = self.cluster.nodes()?.node(k)?;
        Some(SocketAddr::new(IpAddr::V4(node.ipv4), NODE_METRICS_PORT))
    }

    /// The agent logs of this run (one per node and start).
    pub fn agent_logs(&self) -> Vec<PathBuf> {
        let mut v: Vec<PathBuf> = std::fs::read_dir(&self.workdir)
            .map(|rd| {
                rd.flatten()
                    .map(|e| e.path())
                    .filter(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("agent")))
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    }

    /// Multi-node runs: kills node `k`'s agent with SIGKILL (as a crash:
    /// its pins or nftables table stay and keep enforcing).
    pub fn kill_node_agent(&mut self, k: u8) -> Result<(), RunnerError> {
        let addr = self
            .node_metrics_addr(k)
            .ok_or_else(|| RunnerError::Options(format!("no node {k}")))?;
        for a in self.agents.iter_mut().filter(|a| a.metrics == addr) {
            a.kill();
        }
        Ok(())
    }

    /// Multi-node runs: stops (`true`, SIGSTOP) or continues (`false`,
    /// SIGCONT) node `k`'s agent. Its kernel state keeps enforcing; npm-cni's
    /// requests wait unanswered until their timeout.
    pub fn pause_node_agent(&mut self, k: u8, stop: bool) -> Result<(), RunnerError> {
        let addr = self
            .node_metrics_addr(k)
            .ok_or_else(|| RunnerError::Options(format!("no node {k}")))?;
        for a in self.agents.iter_mut().filter(|a| a.metrics == addr) {
            a.pause(stop);
        }
        Ok(())
    }

    /// npm-cni's `timeoutSeconds` for the pods created from now on (`None`:
    /// the chain's own).
    pub fn set_npm_cni_timeout(&mut self, secs: Option<u64>) {
        self.cluster.set_npm_cni_timeout(secs);
    }

    /// Multi-node runs: node `k`'s agent's resident set in KiB (`None`:
    /// no agent runs there).
    pub fn node_agent_rss_kib(&self, k: u8) -> Option<u64> {
        let addr = self.node_metrics_addr(k)?;
        self.agents
            .iter()
            .filter(|a| a.metrics == addr)
            .find_map(|a| a.rss_kib())
    }

    /// The pin directory of node `k`'s agent: `/sys/fs/bpf/npm-conformance-
    /// <pid>-n<k>`, or with [`crate::runner::Options::pin_layout_change`]
    /// its `v<LAYOUT_VERSION + 1>` (first start) or `v<LAYOUT_VERSION>`
    /// (`restarted`) directory.
    pub fn node_pin_dir(&self, k: u8, restarted: bool) -> PathBuf {
        let base = PathBuf::from(format!("/sys/fs/bpf/npm-conformance-{}-n{k}", std::process::id()));
        if !self.opts.pin_layout_change {
            return base;
        }
        let layout = npm_common::LAYOUT_VERSION + u32::from(!restarted);
        base.join(format!("v{layout}"))
    }

    /// Multi-node runs: starts node `k`'s agent again with the flags of the
    /// first start (its log `agent-node-<k>.<start>.log`), replacing the
    /// killed one; returns at once (not waiting for readiness). With
    /// [`crate::runner::Options::pin_layout_change`] it pins under the
    /// current layout's directory (the first restart of a node changes
    /// its layout).
    pub fn respawn_node_agent(&mut self, k: u8, start: u32) -> Result<(), RunnerError> {
        let pid = std::process::id();
        let kubeconfig = self.kubeconfig_path();
        let metrics = self
            .node_metrics_addr(k)
            .ok_or_else(|| RunnerError::Options(format!("no node {k}")))?;
        let nodes = self
            .cluster
            .nodes()
            .ok_or_else(|| RunnerError::Options("not a multi-node run".into()))?;
        let node = nodes
            .node(k)
            .ok_or_else(|| RunnerError::Options(format!("no node {k}")))?;
        let pin_dir = self.node_pin_dir(k, true);
        let table = format!("npmconf{pid}n{k}");
        let agent = self.spawn_agent(
            &kubeconfig,
            AgentSpec {
                node_name: &node.name,
                node: Some(node),
                pin_dir: &pin_dir,
                nft_table: &table,
                metrics,
                log: self.workdir.join(format!("agent-{}.{start}.log", node.name)),
            },
        )?;
        self.agents.retain(|a| a.metrics != metrics);
        self.agents.push(agent);
        Ok(())
    }
}
