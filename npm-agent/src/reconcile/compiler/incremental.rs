//! The compile state the sync loop keeps between syncs ([`Incremental`]):
//! each update converts only the objects that changed since the previous
//! complete state and compiles them incrementally, or rebuilds the compiler
//! when that is estimated cheaper; the cross-check compares it with a full
//! compile.

use std::collections::{BTreeSet, HashSet};
use std::net::IpAddr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, Node};
use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::compiled::{CompileOptions, Compiled};
use npm_policy::convert::{namespace_from_api, node_from_api};
use npm_policy::incremental::Compiler;
use npm_policy::model::Snapshot;
use npm_policy::tiers::LearnedNames;

use super::cluster::{self, LastValid, Unparsed};
use super::objects::{diff_objects, key_ref};
use super::overlay::{convert_pod, Stripped};
use super::{compile, snapshot, snapshot_with_overlay, Changes, Mismatch};
use crate::cni::NodeFacts;
use crate::k8s::pods::Pod;
use crate::k8s::{key_of, ClusterNetworkPolicy, CompleteState, ObjKey, Objects};

/// One object change, converted, in the order it is applied.
enum Op {
    Namespace(String, Option<npm_policy::model::Namespace>),
    Pod(ObjKey, Option<npm_policy::model::Pod>),
    Policy(ObjKey, Option<Arc<NetworkPolicy>>),
    ClusterPolicy(String, Option<Arc<ClusterNetworkPolicy>>),
    Node(String, Option<npm_policy::model::Node>),
}

/// The compile state the sync loop keeps between syncs: a long-lived
/// [`Compiler`] (which holds the converted snapshot of the last complete
/// state and its compiled form), the API objects of that state and the CNI
/// facts overlaid on its pods.
///
/// The facts are part of the state: an update whose facts differ from the
/// previous ones converts again every pod they touch (the pods whose own
/// facts changed, and those claiming an address whose CNI owner changed).
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
    pub(super) per_change: Duration,
    pub(super) rebuild_cost: Duration,
    namespaces: Objects<Namespace>,
    pods: Objects<Pod>,
    policies: Objects<NetworkPolicy>,
    cluster_policies: Objects<ClusterNetworkPolicy>,
    nodes: Objects<Node>,
    facts: Arc<NodeFacts>,
    stripped: Stripped,
    /// The ClusterNetworkPolicies of the state that cannot be decoded.
    unparsed: Unparsed,
    /// The last version of each ClusterNetworkPolicy whose subject was
    /// understood (kept across rebuilds: [`Incremental::new_keeping`]).
    last_valid: LastValid,
}

fn ewma(old: Duration, new: Duration) -> Duration {
    if old.is_zero() {
        new
    } else {
        (old * 3 + new) / 4
    }
}

impl Incremental {
    /// A full conversion of `state` with `facts` overlaid and its compile
    /// (keeping the ids of `prev`) into a new [`Compiler`], remembered as
    /// the base of later updates.
    pub fn new(
        state: &CompleteState,
        facts: &Arc<NodeFacts>,
        opts: &CompileOptions,
        prev: Option<&Compiled>,
    ) -> Incremental {
        Incremental::new_keeping(state, facts, opts, prev, LastValid::default())
    }

    /// [`Incremental::new`] where each ClusterNetworkPolicy whose subject
    /// is not understood keeps its version of `last_valid` (the last
    /// valid versions of the compiler this one replaces).
    pub fn new_keeping(
        state: &CompleteState,
        facts: &Arc<NodeFacts>,
        opts: &CompileOptions,
        prev: Option<&Compiled>,
        mut last_valid: LastValid,
    ) -> Incremental {
        let (snapshot, stripped, unparsed) = snapshot_with_overlay(state, facts, &last_valid);
        for cnp in &state.cluster_policies {
            last_valid.record(&snapshot, cnp.name(), Some(cnp));
        }
        let t = Instant::now();
        let compiler = Compiler::new(snapshot, opts.clone(), prev);
        Incremental {
            opts: opts.clone(),
            compiler,
            last_incremental: false,
            per_change: Duration::ZERO,
            rebuild_cost: t.elapsed(),
            namespaces: state.namespaces.clone(),
            pods: state.pods.clone(),
            policies: state.policies.clone(),
            cluster_policies: state.cluster_policies.clone(),
            nodes: state.nodes.clone(),
            facts: facts.clone(),
            stripped,
            unparsed,
            last_valid,
        }
    }

    /// The last valid version of each ClusterNetworkPolicy (what a rebuild
    /// keeps: [`Incremental::new_keeping`]).
    pub fn last_valid(&self) -> LastValid {
        self.last_valid.clone()
    }

    /// Compiles `learned` as the names `domainNames` peers match (nothing
    /// when they are the ones compiled in: the snapshot's).
    pub fn set_domain_names(&mut self, learned: &LearnedNames) {
        if &self.snapshot().domain_names != learned {
            self.compiler.set_domain_names(learned.clone());
        }
    }

    /// The names of the ClusterNetworkPolicies of the state last compiled
    /// (decoded or not), in order.
    pub fn cluster_policy_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.cluster_policies.iter().map(|p| p.name())
    }

    /// The names of the Nodes of the state last compiled, in order.
    pub fn node_names(&self) -> impl Iterator<Item = &str> + '_ {
        self.nodes.iter().map(|n| key_ref(n.as_ref()).1)
    }

    /// The ClusterNetworkPolicies of the state last compiled that are not
    /// fully understood (or cannot be decoded), by name, with their errors.
    pub fn invalid_cluster_policies(&self) -> std::collections::BTreeMap<String, Vec<String>> {
        cluster::invalid_cluster_policies(self.compiler.snapshot(), &self.unparsed)
    }

    /// The API objects of the state last compiled (O(1): shared, not
    /// copied).
    pub fn state(&self) -> CompleteState {
        CompleteState {
            namespaces: self.namespaces.clone(),
            pods: self.pods.clone(),
            policies: self.policies.clone(),
            cluster_policies: self.cluster_policies.clone(),
            nodes: self.nodes.clone(),
        }
    }

    /// The pods of the current state that a change from the previous facts
    /// to `facts` touches and that `pod_up` does not hold already: those
    /// whose own facts changed, those claiming an address whose CNI owner
    /// changed, and those the overlay took such an address from.
    fn touched_by_facts(&self, facts: &NodeFacts, pod_up: &[Arc<Pod>]) -> Vec<Arc<Pod>> {
        let change = facts.change_since(&self.facts);
        if change.is_empty() {
            return Vec::new();
        }
        let mut keys = change.pods;
        if !change.addresses.is_empty() {
            for (key, p) in &self.compiler.snapshot().pods {
                if p.ips.iter().any(|ip| change.addresses.contains(ip)) {
                    keys.insert(key.clone());
                }
            }
            for ip in &change.addresses {
                keys.extend(self.stripped.pods_of(ip).cloned());
            }
        }
        let converted: HashSet<(&str, &str)> = pod_up.iter().map(|p| key_ref(p.as_ref())).collect();
        keys.iter()
            .filter(|(ns, name)| !converted.contains(&(ns.as_str(), name.as_str())))
            .filter_map(|key| self.pods.get(key).cloned())
            .collect()
    }

    /// Bring the compile up to `state` with `facts` overlaid: only the
    /// objects that differ from the state of the previous update, and the
    /// pods a change of the facts touches, are converted; they are compiled
    /// incrementally or, when that is estimated slower, the compiler is
    /// rebuilt from the updated snapshot.
    pub fn update(&mut self, state: &CompleteState, facts: &Arc<NodeFacts>) -> Changes {
        let t0 = Instant::now();
        let (ns_up, ns_gone) = diff_objects(&mut self.namespaces, &state.namespaces);
        let (mut pod_up, pod_gone) = diff_objects(&mut self.pods, &state.pods);
        let touched = self.touched_by_facts(facts, &pod_up);
        pod_up.extend(touched);
        self.facts = facts.clone();
        let (np_up, np_gone) = diff_objects(&mut self.policies, &state.policies);
        let (cnp_up, cnp_gone) = diff_objects(&mut self.cluster_policies, &state.cluster_policies);
        let (node_up, node_gone) = diff_objects(&mut self.nodes, &state.nodes);
        let changes = Changes {
            nodes: node_up.len() + node_gone.len(),
            namespaces: ns_up.len() + ns_gone.len(),
            pods: pod_up.len() + pod_gone.len(),
            policies: np_up.len() + np_gone.len(),
            cluster_policies: cnp_up.len() + cnp_gone.len(),
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
        for key in &pod_gone {
            self.stripped.remove(key);
        }
        ops.extend(pod_gone.into_iter().map(|k| Op::Pod(k, None)));
        for p in &pod_up {
            let key = key_of(p.as_ref());
            match convert_pod(p, facts) {
                Ok((p, stripped)) => {
                    self.stripped.set(&key, stripped);
                    ops.push(Op::Pod(key, Some(p)));
                }
                Err(e) => {
                    tracing::error!(error = %e, "pod skipped");
                    self.stripped.remove(&key);
                    ops.push(Op::Pod(key, None));
                }
            }
        }
        ops.extend(np_gone.into_iter().map(|k| Op::Policy(k, None)));
        ops.extend(np_up.into_iter().map(|np| Op::Policy(key_of(np.as_ref()), Some(np))));
        let cnp_names: Vec<String> = cnp_gone
            .iter()
            .map(|(_, name)| name.clone())
            .chain(cnp_up.iter().map(|p| p.name().to_string()))
            .collect();
        ops.extend(cnp_gone.into_iter().map(|(_, name)| Op::ClusterPolicy(name, None)));
        ops.extend(
            cnp_up
                .into_iter()
                .map(|p| Op::ClusterPolicy(p.name().to_string(), Some(p))),
        );
        ops.extend(node_gone.into_iter().map(|(_, name)| Op::Node(name, None)));
        for n in &node_up {
            let name = key_of(n.as_ref()).1;
            match node_from_api(n) {
                Ok(n) => ops.push(Op::Node(name, Some(n))),
                Err(e) => {
                    tracing::error!(error = %e, "node skipped");
                    ops.push(Op::Node(name, None));
                }
            }
        }
        if ops.is_empty() {
            return changes;
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
                    Op::ClusterPolicy(_, Some(p)) => cluster::apply(c, &mut self.unparsed, &p, &self.last_valid),
                    Op::ClusterPolicy(name, None) => cluster::remove_compiled(c, &mut self.unparsed, &name),
                    Op::Node(_, Some(n)) => c.upsert_node(n),
                    Op::Node(name, None) => c.remove_node(&name),
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
                    Op::ClusterPolicy(_, Some(p)) => {
                        cluster::upsert(&mut snapshot, &mut self.unparsed, &p, &self.last_valid)
                    }
                    Op::ClusterPolicy(name, None) => cluster::remove(&mut snapshot, &mut self.unparsed, &name),
                    Op::Node(_, Some(n)) => snapshot.upsert_node(n),
                    Op::Node(name, None) => {
                        snapshot.remove_node(&name);
                    }
                }
            }
            self.compiler = Compiler::new(snapshot, self.opts.clone(), Some(&prev));
            self.rebuild_cost = ewma(self.rebuild_cost, t.elapsed());
        }
        self.last_incremental = incremental;
        for name in cnp_names {
            let object = self
                .cluster_policies
                .get(&(String::new(), name.clone()))
                .map(|o| o.as_ref());
            self.last_valid.record(self.compiler.snapshot(), &name, object);
        }
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

    /// The endpoint ids whose tier entries may have changed since the last
    /// call (`None`: any; a rebuilt compiler), see
    /// [`Compiler::take_tier_touched`].
    pub fn take_tier_touched(&mut self) -> Option<BTreeSet<u32>> {
        self.compiler.take_tier_touched()
    }

    /// IP conflicts of the current snapshot: addresses claimed by more than
    /// one pod (`npm_policy::ownership`, the one ownership rule), kept up to
    /// date pod by pod by the compiler.
    pub fn conflicts(&self) -> BTreeSet<(IpAddr, Vec<String>)> {
        self.compiler.claims().conflicts()
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
        let facts = self.facts.clone();
        let learned = self.snapshot().domain_names.clone();
        let last_valid = self.last_valid.clone();
        *self = Incremental::new_keeping(state, &facts, &opts, Some(&current), last_valid);
        self.set_domain_names(&learned);
        Some(m)
    }

    /// The comparison of [`Incremental::cross_check`] as a job that owns
    /// what it needs (the objects of `state`, the facts of the last update,
    /// a copy of the current compile), to run off the sync path: it returns
    /// the difference, if any; the caller then rebuilds (see
    /// [`Incremental::new`]).
    pub fn cross_check_job(&self, state: &CompleteState) -> impl FnOnce() -> Option<Mismatch> + Send + 'static {
        let state = state.clone();
        let facts = self.facts.clone();
        let opts = self.opts.clone();
        let current = self.compiled().clone();
        let learned = self.snapshot().domain_names.clone();
        let last_valid = self.last_valid.clone();
        move || {
            let mut s = snapshot(&state, &facts, &last_valid);
            s.domain_names = learned;
            let full = compile(&s, &opts, Some(&current));
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
        self.namespaces = state.namespaces.clone();
        self.pods = state.pods.clone();
        self.policies = state.policies.clone();
        self.cluster_policies = state.cluster_policies.clone();
        self.nodes = state.nodes.clone();
    }
}
