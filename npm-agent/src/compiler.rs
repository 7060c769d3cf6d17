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

use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use kube::Resource;
use npm_policy::compiled::{CompileOptions, Compiled};
use npm_policy::convert::{namespace_from_api, pod_from_api};
use npm_policy::incremental::Compiler;
use npm_policy::model::{Pod as ModelPod, PodPhase, Snapshot};

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

/// `(namespace, name)` of an object, borrowed (no allocation).
fn key_ref<K: Resource>(o: &K) -> (&str, &str) {
    let m = o.meta();
    (m.namespace.as_deref().unwrap_or(""), m.name.as_deref().unwrap_or(""))
}

/// `objs` ordered by key, one object per key (the last one given wins).
/// The stores hand out their objects in key order already: then this is a
/// linear check and a copy of the pointers.
fn sorted<K: Resource>(objs: &[Arc<K>]) -> Vec<Arc<K>> {
    if objs.windows(2).all(|w| key_ref(w[0].as_ref()) < key_ref(w[1].as_ref())) {
        return objs.to_vec();
    }
    let mut v = objs.to_vec();
    v.sort_by(|a, b| key_ref(a.as_ref()).cmp(&key_ref(b.as_ref())));
    let mut out: Vec<Arc<K>> = Vec::with_capacity(v.len());
    for o in v {
        match out.last_mut() {
            Some(last) if key_ref(last.as_ref()) == key_ref(o.as_ref()) => *last = o,
            _ => out.push(o),
        }
    }
    out
}

/// Objects of `current` added or changed since `last`, and keys of `last`
/// gone from `current`; `last` becomes `current`. Both are walked once in
/// key order (pointer-equal objects are skipped without a look at them).
fn diff_objects<K: Resource>(last: &mut Vec<Arc<K>>, current: &[Arc<K>]) -> (Vec<Arc<K>>, Vec<ObjKey>) {
    let current = sorted(current);
    let mut upserts = Vec::new();
    let mut removed = Vec::new();
    let (mut i, mut j) = (0, 0);
    while i < last.len() || j < current.len() {
        let ord = match (last.get(i), current.get(j)) {
            (Some(o), Some(n)) if Arc::ptr_eq(o, n) => std::cmp::Ordering::Equal,
            (Some(o), Some(n)) => key_ref(o.as_ref()).cmp(&key_ref(n.as_ref())),
            (Some(_), None) => std::cmp::Ordering::Less,
            _ => std::cmp::Ordering::Greater,
        };
        match ord {
            std::cmp::Ordering::Less => {
                removed.push(key_of(last[i].as_ref()));
                i += 1;
            }
            std::cmp::Ordering::Greater => {
                upserts.push(current[j].clone());
                j += 1;
            }
            std::cmp::Ordering::Equal => {
                if changed(&last[i], &current[j]) {
                    upserts.push(current[j].clone());
                }
                i += 1;
                j += 1;
            }
        }
    }
    *last = current;
    (upserts, removed)
}

/// One object change, converted, in the order it is applied.
enum Op {
    Namespace(String, Option<npm_policy::model::Namespace>),
    Pod(ObjKey, Option<npm_policy::model::Pod>),
    Policy(ObjKey, Option<Arc<NetworkPolicy>>),
}

/// Addresses claimed by live pods (not terminal, not hostNetwork), kept up
/// to date pod by pod, so that the IP conflicts of a sync cost nothing when
/// there are none.
#[derive(Default)]
struct Claims {
    by_ip: HashMap<IpAddr, BTreeSet<ObjKey>>,
    conflicted: BTreeSet<IpAddr>,
}

impl Claims {
    fn live(p: &ModelPod) -> bool {
        !p.host_network && !matches!(p.phase, PodPhase::Succeeded | PodPhase::Failed)
    }

    /// Pod `key` changes from `old` to `new`.
    fn update(&mut self, key: &ObjKey, old: Option<&ModelPod>, new: Option<&ModelPod>) {
        for ip in old.filter(|p| Self::live(p)).into_iter().flat_map(|p| &p.ips) {
            if let Some(set) = self.by_ip.get_mut(ip) {
                set.remove(key);
                match set.len() {
                    0 => {
                        self.by_ip.remove(ip);
                        self.conflicted.remove(ip);
                    }
                    1 => {
                        self.conflicted.remove(ip);
                    }
                    _ => {}
                }
            }
        }
        for ip in new.filter(|p| Self::live(p)).into_iter().flat_map(|p| &p.ips) {
            let set = self.by_ip.entry(*ip).or_default();
            set.insert(key.clone());
            if set.len() > 1 {
                self.conflicted.insert(*ip);
            }
        }
    }

    fn of(snapshot: &Snapshot) -> Claims {
        let mut c = Claims::default();
        for (key, p) in &snapshot.pods {
            c.update(key, None, Some(p));
        }
        c
    }

    /// Same result as [`crate::sync::ip_conflicts`] of the snapshot.
    fn conflicts(&self) -> BTreeSet<(IpAddr, Vec<String>)> {
        self.conflicted
            .iter()
            .filter_map(|ip| {
                let pods = self.by_ip.get(ip)?;
                Some((*ip, pods.iter().map(|(ns, name)| format!("{ns}/{name}")).collect()))
            })
            .collect()
    }
}

/// The compile state the sync loop keeps between syncs: a long-lived
/// [`Compiler`] (which holds the converted snapshot of the last complete
/// state and its compiled form) and the API objects of that state.
///
/// Each update converts only the objects that changed and picks the cheaper
/// way from measured costs: the incremental compiler when `changes x cost
/// per change` is below the cost of a rebuild, else the compiler is rebuilt
/// from the updated snapshot ([`Compiler::new`], one full compile plus its
/// caches, ids kept). There is always a compiler, so a burst of changes
/// never leaves a costly rebuild for a later (quiet) sync; there is one
/// snapshot, owned by the compiler. Both ways give the same tables (tested
/// by npm-policy and here); the choice only changes the time a sync takes.
pub struct Incremental {
    opts: CompileOptions,
    compiler: Compiler,
    last_incremental: bool,
    per_change: Duration,
    rebuild_cost: Duration,
    claims: Claims,
    namespaces: Vec<Arc<Namespace>>,
    pods: Vec<Arc<Pod>>,
    policies: Vec<Arc<NetworkPolicy>>,
}

fn ewma(old: Duration, new: Duration) -> Duration {
    if old.is_zero() {
        new
    } else {
        (old * 3 + new) / 4
    }
}

impl Incremental {
    /// A full conversion and compile of `state` (keeping the ids of `prev`)
    /// into a new [`Compiler`], remembered as the base of later updates.
    pub fn new(state: &CompleteState, opts: &CompileOptions, prev: Option<&Compiled>) -> Incremental {
        let snapshot = snapshot(state);
        let claims = Claims::of(&snapshot);
        let t = Instant::now();
        let compiler = Compiler::new(snapshot, opts.clone(), prev);
        Incremental {
            opts: opts.clone(),
            compiler,
            last_incremental: false,
            per_change: Duration::ZERO,
            rebuild_cost: t.elapsed(),
            claims,
            namespaces: sorted(&state.namespaces),
            pods: sorted(&state.pods),
            policies: sorted(&state.policies),
        }
    }

    /// Bring the compile up to `state`: only the objects that differ from
    /// the state of the previous update are converted; they are compiled
    /// incrementally or, when that is estimated slower, the compiler is
    /// rebuilt from the updated snapshot.
    pub fn update(&mut self, state: &CompleteState) -> Changes {
        let t0 = Instant::now();
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
            if let Op::Pod(key, new) = op {
                self.claims
                    .update(key, self.compiler.snapshot().pods.get(key), new.as_ref());
            }
        }
        let t_convert = t0.elapsed();
        let estimate = self.per_change * ops.len() as u32;
        let incremental = estimate < self.rebuild_cost;
        let t = Instant::now();
        if incremental {
            let c = &mut self.compiler;
            for op in ops {
                // Invalid policies are recorded in the snapshot's
                // `invalid_policies`; the sync loop logs and counts them.
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
        } else {
            // An empty compiler stands in while the real one is rebuilt
            // (compiling an empty snapshot costs next to nothing).
            let empty = Compiler::new(Snapshot::default(), self.opts.clone(), None);
            let (mut snapshot, prev) = std::mem::replace(&mut self.compiler, empty).into_parts();
            for op in ops {
                match op {
                    Op::Namespace(_, Some(n)) => snapshot.upsert_namespace(n),
                    Op::Namespace(name, None) => {
                        snapshot.remove_namespace(&name);
                    }
                    Op::Pod(_, Some(p)) => snapshot.upsert_pod(p),
                    Op::Pod((ns, name), None) => {
                        snapshot.remove_pod(&ns, &name);
                    }
                    Op::Policy(_, Some(np)) => {
                        let _ = snapshot.upsert_policy(&np);
                    }
                    Op::Policy((ns, name), None) => snapshot.remove_policy(&ns, &name),
                }
            }
            self.compiler = Compiler::new(snapshot, self.opts.clone(), Some(&prev));
            self.rebuild_cost = ewma(self.rebuild_cost, t.elapsed());
        }
        self.last_incremental = incremental;
        tracing::debug!(
            diff_convert_ms = t_convert.as_secs_f64() * 1e3,
            compile_ms = t.elapsed().as_secs_f64() * 1e3,
            incremental,
            ops = changes.total(),
            "incremental update"
        );
        changes
    }

    /// The current compiled form.
    pub fn compiled(&self) -> &Compiled {
        self.compiler.compiled()
    }

    /// The current snapshot.
    pub fn snapshot(&self) -> &Snapshot {
        self.compiler.snapshot()
    }

    /// IP conflicts of the current snapshot (as [`crate::sync::ip_conflicts`]
    /// computes them), kept up to date pod by pod.
    pub fn conflicts(&self) -> BTreeSet<(IpAddr, Vec<String>)> {
        self.claims.conflicts()
    }

    /// Whether the last update was compiled incrementally (else the
    /// compiler was rebuilt; also `false` before the first update).
    pub fn is_incremental(&self) -> bool {
        self.last_incremental
    }

    /// The safety net: a full conversion and [`compile`] of `state` (the
    /// complete state of the last update; ids of the current compile kept)
    /// compared with the current compile. This catches both a change the
    /// object diff missed and a compiler difference. On a difference the
    /// full compile is trusted (the state is rebuilt from it) and the
    /// difference is returned.
    pub fn cross_check(&mut self, state: &CompleteState) -> Option<Mismatch> {
        let m = self.cross_check_job(state)()?;
        let opts = self.opts.clone();
        let current = self.compiled().clone();
        *self = Incremental::new(state, &opts, Some(&current));
        Some(m)
    }

    /// The comparison of [`Incremental::cross_check`] as a job that owns
    /// what it needs (the objects of `state`, a copy of the current
    /// compile), to run off the sync path: it returns the difference, if
    /// any; the caller then rebuilds (see [`Incremental::new`]).
    pub fn cross_check_job(&self, state: &CompleteState) -> impl FnOnce() -> Option<Mismatch> + Send + 'static {
        let state = state.clone();
        let opts = self.opts.clone();
        let current = self.compiled().clone();
        move || {
            let full = compile(&snapshot(&state), &opts, Some(&current));
            let diff = current.diff(&full);
            (!diff.is_empty()).then(|| Mismatch { changes: diff.len() })
        }
    }
}

#[cfg(test)]
impl Incremental {
    /// Tests only: record the objects of `state` as compiled without
    /// compiling them, so the next update misses their changes (what the
    /// cross-check is there to catch).
    pub(crate) fn pretend_compiled(&mut self, state: &CompleteState) {
        self.namespaces = sorted(&state.namespaces);
        self.pods = sorted(&state.pods);
        self.policies = sorted(&state.policies);
    }
}

#[cfg(test)]
pub(crate) mod tests {
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

    /// A Running pod `ns/name` with `ip`, label `app`, on `node` (shared by
    /// the sync tests).
    pub(crate) fn pod(ns: &str, name: &str, rv: u64, ip: &str, app: &str, node: &str) -> Arc<Pod> {
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
            // Every third step takes the rebuild path (estimated slower),
            // the others the incremental one: the estimates are set before
            // each step, since the measured ones vary with the machine's load.
            let force_rebuild = i % 3 == 2;
            if force_rebuild {
                inc.per_change = Duration::from_secs(3600);
                inc.rebuild_cost = Duration::ZERO;
            } else {
                inc.per_change = Duration::ZERO;
                inc.rebuild_cost = Duration::from_secs(3600);
            }
            let changes = inc.update(&state);
            assert!(changes.total() >= 1, "step {i}: a change was fed");
            assert_eq!(inc.is_incremental(), !force_rebuild, "step {i}");
            assert_eq!(
                inc.conflicts(),
                crate::sync::ip_conflicts(&snapshot(&state)),
                "step {i}: conflicts kept up to date"
            );
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
        inc.pretend_compiled(&state);
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
