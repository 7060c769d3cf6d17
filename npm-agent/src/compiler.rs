//! The agent's calls into the compiler (`npm-policy`): API objects ->
//! [`Snapshot`], [`Snapshot`] -> [`Compiled`], and the [`Incremental`]
//! compiler that the sync loop keeps between syncs.
//!
//! Objects are converted one by one so that a pod or namespace the converter
//! rejects (a malformed IP, say) is logged and skipped instead of stopping
//! enforcement of everything else; invalid policies are kept by the
//! converter in `Snapshot::invalid_policies`.
//!
//! [`Incremental`] stays level-triggered: each update compares the complete
//! state it is given with the complete state of the previous update (object
//! by object, by pointer, resourceVersion and uid) and feeds only the
//! objects that were added, changed or removed to a long-lived
//! [`npm_policy::incremental::Compiler`]. Event order never matters: two
//! complete states are diffed, whatever happened between them.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Resource;
use npm_policy::compiled::{CompileOptions, Compiled};
use npm_policy::convert::{namespace_from_api, pod_from_api};
use npm_policy::incremental::Compiler;
use npm_policy::model::Snapshot;

use crate::watch::{key_of, CompleteState, ObjKey};

/// Build the snapshot of a complete state. Objects that cannot be converted
/// are logged (naming the object and the field) and left out.
pub fn snapshot(state: &CompleteState) -> Snapshot {
    let mut s = Snapshot::default();
    for ns in &state.namespaces {
        match namespace_from_api(ns) {
            Ok(n) => s.upsert_namespace(n),
            Err(e) => tracing::error!(error = %e, "namespace skipped"),
        }
    }
    for p in &state.pods {
        match pod_from_api(p) {
            Ok(p) => s.upsert_pod(p),
            Err(e) => tracing::error!(error = %e, "pod skipped"),
        }
    }
    for np in &state.policies {
        // Invalid policies are recorded in `s.invalid_policies`; the sync
        // loop logs and counts them.
        let _ = s.upsert_policy(np);
    }
    s
}

/// Compile a snapshot, reusing the previous compile's ids.
pub fn compile(snapshot: &Snapshot, opts: &CompileOptions, prev: Option<&Compiled>) -> Compiled {
    npm_policy::compile(snapshot, opts, prev)
}

/// How many objects an [`Incremental::update`] fed to the compiler.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Changes {
    /// Namespaces added, changed or removed.
    pub namespaces: usize,
    /// Pods added, changed or removed.
    pub pods: usize,
    /// NetworkPolicies added, changed or removed.
    pub policies: usize,
}

impl Changes {
    /// Total number of objects fed to the compiler.
    pub fn total(&self) -> usize {
        self.namespaces + self.pods + self.policies
    }
}

/// A difference between the incremental compile and a full compile of the
/// same snapshot (found by [`Incremental::cross_check`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mismatch {
    /// Number of map changes between the two.
    pub changes: usize,
}

/// Whether the stored object `old` and the current `new` may differ.
fn changed<K: Resource>(old: &Arc<K>, new: &Arc<K>) -> bool {
    if Arc::ptr_eq(old, new) {
        return false;
    }
    let (o, n) = (old.meta(), new.meta());
    o.resource_version.is_none() || o.resource_version != n.resource_version || o.uid != n.uid
}

/// Objects of `current` added or changed since `last`, and keys of `last`
/// gone from `current`; `last` becomes `current`.
fn diff_objects<K: Resource>(last: &mut HashMap<ObjKey, Arc<K>>, current: &[Arc<K>]) -> (Vec<Arc<K>>, Vec<ObjKey>) {
    let mut next: HashMap<ObjKey, Arc<K>> = HashMap::with_capacity(current.len());
    let mut upserts = Vec::new();
    for o in current {
        let key = key_of(o.as_ref());
        match last.remove(&key) {
            Some(old) if !changed(&old, o) => {}
            _ => upserts.push(o.clone()),
        }
        next.insert(key, o.clone());
    }
    let removed = std::mem::replace(last, next).into_keys().collect();
    (upserts, removed)
}

fn index<K: Resource>(objs: &[Arc<K>]) -> HashMap<ObjKey, Arc<K>> {
    objs.iter().map(|o| (key_of(o.as_ref()), o.clone())).collect()
}

/// The incremental compiler is (re)built (about four full compiles) only on
/// an update of at most this many changes, a sign that churn has calmed down.
const REBUILD_MAX_CHANGES: usize = 2;

/// One object change, converted, in the order it is applied.
enum Op {
    Namespace(String, Option<npm_policy::model::Namespace>),
    Pod(ObjKey, Option<npm_policy::model::Pod>),
    Policy(ObjKey, Option<Arc<NetworkPolicy>>),
}

/// The compile state the sync loop keeps between syncs: the converted
/// snapshot of the last complete state (updated object by object), its
/// compiled form, and a long-lived [`Compiler`] when incremental compiling
/// pays off.
///
/// Each update picks the cheaper way from measured costs: the incremental
/// compiler when `changes x cost per change` is below the cost of a full
/// compile, else a full [`compile`] of the (already converted) snapshot.
/// Both give the same tables (tested by npm-policy and here); the choice
/// only changes the time a sync takes.
pub struct Incremental {
    opts: CompileOptions,
    snapshot: Snapshot,
    compiler: Option<Compiler>,
    /// The compiled form when `compiler` is `None`.
    compiled: Compiled,
    per_change: Duration,
    full_cost: Duration,
    namespaces: HashMap<ObjKey, Arc<Namespace>>,
    pods: HashMap<ObjKey, Arc<Pod>>,
    policies: HashMap<ObjKey, Arc<NetworkPolicy>>,
}

fn ewma(old: Duration, new: Duration) -> Duration {
    if old.is_zero() {
        new
    } else {
        (old * 3 + new) / 4
    }
}

impl Incremental {
    /// A full conversion and compile of `state` (keeping the ids of `prev`),
    /// remembered as the base of later updates.
    pub fn new(state: &CompleteState, opts: &CompileOptions, prev: Option<&Compiled>) -> Incremental {
        let snapshot = snapshot(state);
        let t = Instant::now();
        let compiled = compile(&snapshot, opts, prev);
        Incremental {
            opts: opts.clone(),
            snapshot,
            compiler: None,
            compiled,
            per_change: Duration::ZERO,
            full_cost: t.elapsed(),
            namespaces: index(&state.namespaces),
            pods: index(&state.pods),
            policies: index(&state.policies),
        }
    }

    /// Bring the compile up to `state`: only the objects that differ from
    /// the state of the previous update are converted; they are compiled
    /// incrementally or, when that is estimated slower, the snapshot is
    /// compiled in full.
    pub fn update(&mut self, state: &CompleteState) -> Changes {
        let (ns_up, ns_gone) = diff_objects(&mut self.namespaces, &state.namespaces);
        let (pod_up, pod_gone) = diff_objects(&mut self.pods, &state.pods);
        let (np_up, np_gone) = diff_objects(&mut self.policies, &state.policies);
        let changes = Changes {
            namespaces: ns_up.len() + ns_gone.len(),
            pods: pod_up.len() + pod_gone.len(),
            policies: np_up.len() + np_gone.len(),
        };
        let mut ops = Vec::with_capacity(changes.total());
        for ns in &ns_up {
            let name = key_of(ns.as_ref()).1;
            match namespace_from_api(ns) {
                Ok(n) => ops.push(Op::Namespace(name, Some(n))),
                Err(e) => {
                    tracing::error!(error = %e, "namespace skipped");
                    ops.push(Op::Namespace(name, None));
                }
            }
        }
        ops.extend(ns_gone.into_iter().map(|(_, name)| Op::Namespace(name, None)));
        ops.extend(pod_gone.into_iter().map(|k| Op::Pod(k, None)));
        for p in &pod_up {
            let key = key_of(p.as_ref());
            match pod_from_api(p) {
                Ok(p) => ops.push(Op::Pod(key, Some(p))),
                Err(e) => {
                    tracing::error!(error = %e, "pod skipped");
                    ops.push(Op::Pod(key, None));
                }
            }
        }
        ops.extend(np_gone.into_iter().map(|k| Op::Policy(k, None)));
        ops.extend(np_up.into_iter().map(|np| Op::Policy(key_of(np.as_ref()), Some(np))));
        if ops.is_empty() {
            return changes;
        }
        for op in &ops {
            // Invalid policies are recorded in the snapshot's
            // `invalid_policies`; the sync loop logs and counts them.
            match op {
                Op::Namespace(_, Some(n)) => self.snapshot.upsert_namespace(n.clone()),
                Op::Namespace(name, None) => {
                    self.snapshot.remove_namespace(name);
                }
                Op::Pod(_, Some(p)) => self.snapshot.upsert_pod(p.clone()),
                Op::Pod((ns, name), None) => {
                    self.snapshot.remove_pod(ns, name);
                }
                Op::Policy(_, Some(np)) => {
                    let _ = self.snapshot.upsert_policy(np);
                }
                Op::Policy((ns, name), None) => self.snapshot.remove_policy(ns, name),
            }
        }
        let estimate = self.per_change * ops.len() as u32;
        let incremental = estimate < self.full_cost;
        let t = Instant::now();
        match self.compiler.as_mut() {
            Some(c) if incremental => {
                for op in ops {
                    match op {
                        Op::Namespace(_, Some(n)) => c.upsert_namespace(n),
                        Op::Namespace(name, None) => c.remove_namespace(&name),
                        Op::Pod(_, Some(p)) => c.upsert_pod(p),
                        Op::Pod((ns, name), None) => c.remove_pod(&ns, &name),
                        Op::Policy(_, Some(np)) => {
                            let _ = c.apply_policy(&np);
                        }
                        Op::Policy((ns, name), None) => c.remove_policy(&ns, &name),
                    }
                }
                self.per_change = ewma(self.per_change, t.elapsed() / changes.total().max(1) as u32);
            }
            None if incremental && ops.len() <= REBUILD_MAX_CHANGES => {
                // Cheap changes again: (re)build the incremental compiler
                // (one full compile) and use it from the next update on.
                let c = Compiler::new(self.snapshot.clone(), self.opts.clone(), Some(&self.compiled));
                self.full_cost = ewma(self.full_cost, t.elapsed());
                self.compiler = Some(c);
            }
            _ => {
                let prev = match &self.compiler {
                    Some(c) => c.compiled(),
                    None => &self.compiled,
                };
                self.compiled = compile(&self.snapshot, &self.opts, Some(prev));
                self.compiler = None;
                self.full_cost = ewma(self.full_cost, t.elapsed());
            }
        }
        changes
    }

    /// The current compiled form.
    pub fn compiled(&self) -> &Compiled {
        match &self.compiler {
            Some(c) => c.compiled(),
            None => &self.compiled,
        }
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> &Snapshot {
        &self.snapshot
    }

    /// Whether the incremental compiler is in use (else full compiles).
    pub fn is_incremental(&self) -> bool {
        self.compiler.is_some()
    }

    /// The safety net: a full conversion and [`compile`] of `state` (the
    /// complete state of the last update; ids of the current compile kept)
    /// compared with the current compile. This catches both a change the
    /// object diff missed and a compiler difference. On a difference the
    /// full compile is trusted (the state is rebuilt from it) and the
    /// difference is returned.
    pub fn cross_check(&mut self, state: &CompleteState) -> Option<Mismatch> {
        let full = compile(&snapshot(state), &self.opts, Some(self.compiled()));
        let diff = self.compiled().diff(&full);
        if diff.is_empty() {
            return None;
        }
        let changes = diff.len();
        let opts = self.opts.clone();
        *self = Incremental::new(state, &opts, Some(&full));
        Some(Mismatch { changes })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{Container, PodSpec, PodStatus};
    use kube::api::ObjectMeta;

    fn meta(ns: Option<&str>, name: &str, rv: u64, labels: &[(&str, &str)]) -> ObjectMeta {
        ObjectMeta {
            name: Some(name.into()),
            namespace: ns.map(String::from),
            uid: Some(format!("uid-{}-{name}", ns.unwrap_or(""))),
            resource_version: Some(rv.to_string()),
            labels: Some(labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()),
            ..Default::default()
        }
    }

    fn ns(name: &str, rv: u64, team: &str) -> Arc<Namespace> {
        Arc::new(Namespace {
            metadata: meta(None, name, rv, &[("team", team)]),
            ..Default::default()
        })
    }

    fn pod(ns: &str, name: &str, rv: u64, ip: &str, app: &str, node: &str) -> Arc<Pod> {
        Arc::new(Pod {
            metadata: meta(Some(ns), name, rv, &[("app", app)]),
            spec: Some(PodSpec {
                node_name: Some(node.into()),
                containers: vec![Container {
                    name: "c".into(),
                    ..Default::default()
                }],
                ..Default::default()
            }),
            status: Some(PodStatus {
                phase: Some("Running".into()),
                pod_ip: Some(ip.into()),
                ..Default::default()
            }),
        })
    }

    fn policy(ns: &str, name: &str, rv: u64, app: &str, from_team: &str) -> Arc<NetworkPolicy> {
        let mut np: NetworkPolicy = serde_json::from_value(serde_json::json!({
            "metadata": {"name": name, "namespace": ns},
            "spec": {
                "podSelector": {"matchLabels": {"app": app}},
                "policyTypes": ["Ingress"],
                "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"team": from_team}}}],
                             "ports": [{"protocol": "TCP", "port": 80}]}]
            }
        }))
        .unwrap();
        np.metadata = meta(Some(ns), name, rv, &[]);
        Arc::new(np)
    }

    type Step = dyn Fn(&mut CompleteState, u64);

    fn opts() -> CompileOptions {
        CompileOptions {
            node_name: "node-a".into(),
            node_ips: Vec::new(),
            allow_host_egress: false,
        }
    }

    /// Every incremental step equals a full compile of the same complete
    /// state, and a relist with the same resourceVersions feeds nothing.
    #[test]
    fn incremental_updates_match_full_compile() {
        let mut state = CompleteState {
            namespaces: vec![ns("a", 1, "x"), ns("b", 2, "y")],
            pods: (0..20)
                .map(|i| {
                    let node = if i % 2 == 0 { "node-a" } else { "node-b" };
                    pod(
                        if i % 3 == 0 { "a" } else { "b" },
                        &format!("p{i}"),
                        10 + i,
                        &format!("10.1.0.{}", i + 1),
                        if i % 2 == 0 { "web" } else { "db" },
                        node,
                    )
                })
                .collect(),
            policies: vec![policy("a", "np1", 100, "web", "y")],
        };
        let mut inc = Incremental::new(&state, &opts(), None);
        let mut rv = 1000;
        let mut next = || {
            rv += 1;
            rv
        };
        let steps: Vec<Box<Step>> = vec![
            Box::new(|s, rv| s.pods.push(pod("a", "new", rv, "10.1.1.1", "web", "node-a"))),
            Box::new(|s, rv| s.pods[1] = pod("b", "p1", rv, "10.1.1.2", "web", "node-b")),
            Box::new(|s, _| {
                s.pods.remove(0);
            }),
            Box::new(|s, rv| s.namespaces[1] = ns("b", rv, "x")),
            Box::new(|s, rv| s.policies.push(policy("b", "np2", rv, "db", "x"))),
            Box::new(|s, rv| s.policies[0] = policy("a", "np1", rv, "web", "x")),
            Box::new(|s, _| {
                s.policies.remove(0);
            }),
            // An address taken over by another pod (incident 1 shape).
            Box::new(|s, rv| s.pods.push(pod("b", "thief", rv, "10.1.0.3", "db", "node-a"))),
            Box::new(|s, _| {
                s.namespaces.remove(0);
            }),
        ];
        let mut incremental_steps = 0;
        for (i, step) in steps.iter().enumerate() {
            incremental_steps += usize::from(inc.is_incremental());
            let before = inc.compiled().clone();
            step(&mut state, next());
            let changes = inc.update(&state);
            assert!(changes.total() >= 1, "step {i}: a change was fed");
            let reference = compile(&snapshot(&state), &opts(), Some(inc.compiled()));
            assert!(
                inc.compiled().diff(&reference).is_empty(),
                "step {i}: incremental == full"
            );
            if [0, 1, 2, 7].contains(&i) {
                assert!(!before.diff(inc.compiled()).is_empty(), "step {i} changed the output");
            }
            assert_eq!(inc.cross_check(&state), None, "step {i}");
        }
        assert!(incremental_steps > 0, "the incremental compiler was used");
        // A relist: new objects with the same versions change nothing.
        let relisted = CompleteState {
            namespaces: state.namespaces.iter().map(|o| Arc::new((**o).clone())).collect(),
            pods: state.pods.iter().map(|o| Arc::new((**o).clone())).collect(),
            policies: state.policies.iter().map(|o| Arc::new((**o).clone())).collect(),
        };
        assert_eq!(inc.update(&relisted), Changes::default());
    }

    /// The cross-check catches a change the object diff missed and trusts
    /// the full compile.
    #[test]
    fn cross_check_repairs_a_missed_change() {
        let mut state = CompleteState {
            namespaces: vec![ns("a", 1, "x")],
            pods: vec![pod("a", "p", 2, "10.2.0.1", "web", "node-a")],
            policies: Vec::new(),
        };
        let mut inc = Incremental::new(&state, &opts(), None);
        state.pods[0] = pod("a", "p", 3, "10.2.0.9", "web", "node-a");
        // Pretend the new version was already compiled: the diff misses it.
        inc.pods.insert(("a".into(), "p".into()), state.pods[0].clone());
        assert_eq!(inc.update(&state), Changes::default());
        let old: IpAddr = "10.2.0.1".parse().unwrap();
        let new: IpAddr = "10.2.0.9".parse().unwrap();
        assert!(inc.compiled().ipcache.contains_key(&old));
        let m = inc.cross_check(&state).expect("mismatch found");
        assert!(m.changes >= 2, "{m:?}");
        assert!(inc.compiled().ipcache.contains_key(&new));
        assert!(!inc.compiled().ipcache.contains_key(&old));
        assert_eq!(inc.cross_check(&state), None);
    }

    use std::net::IpAddr;
}
