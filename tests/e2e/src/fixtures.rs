//! Small helpers the live-agent tests (`tests/*.rs`) share: the agent
//! binary they start, a TCP probe between two pods of a live cluster, and
//! the one-policy setup several of them start from.

use std::net::SocketAddr;
use std::path::PathBuf;

use crate::probe::{Probe, Proto};
use crate::runner::LiveRunner;

/// The `npm-agent` binary a live test starts: `NPM_AGENT_BIN`, else the
/// workspace's debug build (a clear panic when it was not built).
pub fn agent_bin() -> PathBuf {
    let p = std::env::var_os("NPM_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target/debug/npm-agent"));
    assert!(p.exists(), "{} missing: cargo build --bin npm-agent", p.display());
    p
}

/// A TCP probe from pod `from` (`NS/POD`) to pod `to`'s IPv4 address on
/// `port` (panics on a pod the cluster does not have).
pub fn tcp_probe(r: &LiveRunner, from: &str, to: &str, port: u16) -> Probe {
    let (ns, name) = from.split_once('/').expect("NS/POD");
    let (tns, tname) = to.split_once('/').expect("NS/POD");
    Probe {
        src_netns: r.cluster().pod(ns, name).expect("source pod").netns.clone(),
        dst_pod: to.to_string(),
        dst: SocketAddr::new(r.cluster().pod(tns, tname).expect("destination pod").ipv4.into(), port),
        proto: Proto::Tcp,
    }
}

/// A one-step case on the x/y/z model: `y/allow-xa-80` isolates `y/b`'s
/// ingress and allows TCP 80 from `x/a` (no probes).
pub const ALLOW_XA_80: &str = r#"
id: allow-xa-80-setup
steps:
  - actions:
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: y, name: allow-xa-80}
          spec:
            podSelector: {matchLabels: {pod: b}}
            policyTypes: [Ingress]
            ingress:
              - from:
                  - namespaceSelector: {matchLabels: {ns: x}}
                    podSelector: {matchLabels: {pod: a}}
                ports: [{protocol: TCP, port: 80}]
    probes: []
"#;
