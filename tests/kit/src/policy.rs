//! Builders of `npm_policy::model` values for the compiler's table tests.

use npm_policy::compiled::CompileOptions;
use npm_policy::model::{Pod, PodPhase, Snapshot};

/// The node the compiler runs for in [`opts`].
pub const NODE: &str = "node";

/// A running pod `ns/name` (uid `uid-<name>`, created at 1) with one
/// address `ip`, label `app=<app>`, on node `node`.
pub fn pod(ns: &str, name: &str, ip: &str, app: &str, node: &str) -> Pod {
    Pod {
        uid: format!("uid-{name}"),
        namespace: ns.into(),
        name: name.into(),
        labels: [("app".to_string(), app.to_string())].into(),
        ips: vec![ip.parse().unwrap_or_else(|e| panic!("pod address {ip:?}: {e}"))],
        node_name: Some(node.into()),
        phase: PodPhase::Running,
        deleting: false,
        host_network: false,
        ports: vec![],
        created: 1,
    }
}

/// A snapshot of the pods (name, address, app label) of namespace `ns`,
/// all on node `node` (see [`pod`]).
pub fn app_snapshot(ns: &str, node: &str, pods: &[(&str, &str, &str)]) -> Snapshot {
    let mut s = Snapshot::default();
    for (name, ip, app) in pods {
        s.pods
            .insert((ns.into(), name.to_string()), pod(ns, name, ip, app, node));
    }
    s
}

/// The compile options of node [`NODE`], every other option default.
pub fn opts() -> CompileOptions {
    CompileOptions {
        node_name: NODE.into(),
        ..CompileOptions::default()
    }
}
