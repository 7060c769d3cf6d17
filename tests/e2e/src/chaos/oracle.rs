//! The oracle of the chaos soak: the sequence of states the cluster passed
//! through, the disturbances (faults, agents down, agents not settled),
//! and the verdict on each probe.
//!
//! - A **state** is the snapshot the API server held from `since` until the
//!   next state. Whether a flow is allowed in a state is decided by
//!   npm-policy's reference evaluator ([`npm_policy::evaluate::evaluate`])
//!   on that snapshot, by address (a probe names addresses, so a reused
//!   address is judged as whichever pod held it in each state).
//! - **Legal states.** A state stays legal after its successor began until
//!   the agents could have applied the successor: until the first moment
//!   `s` at or after the change with no disturbance running in `[s, s + B]`
//!   (a held removal, an unready or dead agent, an API outage or a 410, a
//!   dropped watch, a resource answering 404: the last good state may be
//!   kept), plus the propagation bound `B` ([`Bounds::propagation`]). The
//!   current state is always legal.
//! - A probe that connected (a TCP handshake, a UDP request answered) is a
//!   **violation** when no state legal in its window `[start, end]` allows
//!   it.
//! - A probe that failed is a **liveness failure** when every state legal
//!   in its window allows it, both ends are pods in each of them, and no
//!   disturbance ran in `[start - L, end]` ([`Bounds::liveness`]): the
//!   agents had been settled (ready, nothing held) for at least `L`.
//!
//! Probes open new connections only; established connections across a
//! change are not judged here.

use std::borrow::Cow;
use std::fmt::Write as _;
use std::net::IpAddr;

use npm_policy::compiled::CompileOptions;
use npm_policy::evaluate::{evaluate, pod_at, Flow};
use npm_policy::model::{Pod, Snapshot};

/// The bounds the oracle judges with (seconds).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Bounds {
    /// How long after a change (with nothing disturbing) the old state may
    /// still be enforced.
    pub propagation: f64,
    /// How long the agents must have been settled before a failed probe
    /// that every legal state allows is a liveness failure.
    pub liveness: f64,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            propagation: 5.0,
            liveness: 10.0,
        }
    }
}

/// One state of the cluster.
#[derive(Clone, Debug)]
pub struct State {
    /// Seconds since the run began.
    pub since: f64,
    /// The schedule step that made it.
    pub what: String,
    /// What the API server held.
    pub snapshot: Snapshot,
    /// Pods whose status lost their addresses, with the addresses their
    /// sandboxes keep, and their node: the agent of a pod's own node holds
    /// it at them (by npm-cni's facts), every other node sees the
    /// addresses unowned.
    pub local_only: Vec<(u8, Pod)>,
}

impl State {
    /// The state as the agent of `node` holds it: the snapshot, with the
    /// pods of [`State::local_only`] on that node at their addresses.
    fn view(&self, node: Option<u8>) -> Cow<'_, Snapshot> {
        let mine: Vec<&Pod> = self
            .local_only
            .iter()
            .filter(|(n, _)| node == Some(*n))
            .map(|(_, p)| p)
            .collect();
        if mine.is_empty() {
            return Cow::Borrowed(&self.snapshot);
        }
        let mut s = self.snapshot.clone();
        for p in mine {
            s.upsert_pod(p.clone());
        }
        Cow::Owned(s)
    }
}

/// A time the agents may legitimately lag or keep an older state.
#[derive(Clone, Debug)]
pub struct Disturbance {
    /// What (a fault, `node-1 not ready`, `held removal`, …).
    pub what: String,
    /// Seconds since the run began.
    pub start: f64,
    /// When it ended (`None`: still running).
    pub end: Option<f64>,
}

/// L4 protocol of a probe.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProbeProto {
    /// TCP handshake.
    Tcp,
    /// UDP request answered.
    Udp,
}

impl ProbeProto {
    fn number(self) -> u8 {
        match self {
            ProbeProto::Tcp => 6,
            ProbeProto::Udp => 17,
        }
    }
}

/// One probe as it ran.
#[derive(Clone, Debug)]
pub struct ProbeRecord {
    /// Sequence number.
    pub id: u64,
    /// Source pod (`ns/name`).
    pub src: String,
    /// Destination pod (`ns/name`).
    pub dst: String,
    /// Source address.
    pub src_ip: IpAddr,
    /// Destination address (the backend of a probe through a ClusterIP).
    pub dst_ip: IpAddr,
    /// The ClusterIP the probe connected to, if not the pod's address:
    /// judged as the flow to the backend `dst_ip` (npm decides Service
    /// egress after kube-proxy's DNAT, against the backend).
    pub via: Option<IpAddr>,
    /// Protocol.
    pub proto: ProbeProto,
    /// Destination port.
    pub port: u16,
    /// Seconds since the run began, when it started.
    pub start: f64,
    /// When it ended.
    pub end: f64,
    /// Whether it connected.
    pub ok: bool,
}

/// The oracle's verdict on one probe.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// As some legal state allows.
    Fine,
    /// Connected, but no legal state allows it (the legal states' indexes).
    Violation(Vec<usize>),
    /// Failed while every legal state allowed it and the agents were settled.
    LivenessFailure(Vec<usize>),
}

/// The node (1-based) of the pod at an address, as the cluster places it.
pub type Placement = Box<dyn Fn(IpAddr) -> Option<u8> + Send + Sync>;

/// States, disturbances and the judging.
pub struct Oracle {
    states: Vec<State>,
    disturbances: Vec<Disturbance>,
    bounds: Bounds,
    opts: CompileOptions,
    /// Which node holds an address's pod (for [`State::local_only`]).
    placement: Option<Placement>,
}

impl std::fmt::Debug for Oracle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Oracle")
            .field("states", &self.states.len())
            .field("disturbances", &self.disturbances)
            .field("bounds", &self.bounds)
            .finish_non_exhaustive()
    }
}

impl Oracle {
    /// An oracle with no state yet; flows are evaluated with `opts`.
    pub fn new(bounds: Bounds, opts: CompileOptions) -> Self {
        Oracle {
            states: Vec::new(),
            disturbances: Vec::new(),
            bounds,
            opts,
            placement: None,
        }
    }

    /// The oracle with `placement`: which node holds the pod at an
    /// address (needed to judge states with [`State::local_only`] pods).
    pub fn with_placement(mut self, placement: Placement) -> Self {
        self.placement = Some(placement);
        self
    }

    /// The bounds.
    pub fn bounds(&self) -> Bounds {
        self.bounds
    }

    /// Records a new state from `since` on (times must not go back).
    pub fn push_state(&mut self, since: f64, what: &str, snapshot: Snapshot) {
        self.push_state_with(since, what, snapshot, Vec::new());
    }

    /// [`Oracle::push_state`] with pods that lost their addresses
    /// ([`State::local_only`]).
    pub fn push_state_with(&mut self, since: f64, what: &str, snapshot: Snapshot, local_only: Vec<(u8, Pod)>) {
        self.states.push(State {
            since,
            what: what.to_string(),
            snapshot,
            local_only,
        });
    }

    /// The states so far.
    pub fn states(&self) -> &[State] {
        &self.states
    }

    /// A disturbance begins at `t`; returns its handle for [`Oracle::end`].
    pub fn begin(&mut self, what: &str, t: f64) -> usize {
        self.disturbances.push(Disturbance {
            what: what.to_string(),
            start: t,
            end: None,
        });
        self.disturbances.len() - 1
    }

    /// Disturbance `handle` ended at `t`.
    pub fn end(&mut self, handle: usize, t: f64) {
        if let Some(d) = self.disturbances.get_mut(handle) {
            d.end.get_or_insert(t);
        }
    }

    /// The disturbances so far.
    pub fn disturbances(&self) -> &[Disturbance] {
        &self.disturbances
    }

    /// The first time at or after `t` with no disturbance running in the
    /// following propagation bound.
    fn settled_after(&self, t: f64) -> f64 {
        let b = self.bounds.propagation;
        let mut cur = t;
        loop {
            let next = self
                .disturbances
                .iter()
                .filter(|d| d.start <= cur + b && d.end.is_none_or(|e| e > cur))
                .map(|d| d.end.unwrap_or(f64::INFINITY))
                .fold(cur, f64::max);
            if next <= cur {
                return cur;
            }
            cur = next;
            if cur.is_infinite() {
                return cur;
            }
        }
    }

    /// Until when state `i` is legal.
    pub fn legal_until(&self, i: usize) -> f64 {
        match self.states.get(i + 1) {
            None => f64::INFINITY,
            Some(next) => self.settled_after(next.since) + self.bounds.propagation,
        }
    }

    /// The indexes of the states legal at some time in `[t0, t1]`.
    pub fn legal_states(&self, t0: f64, t1: f64) -> Vec<usize> {
        (0..self.states.len())
            .filter(|&i| self.states[i].since <= t1 && self.legal_until(i) >= t0)
            .collect()
    }

    /// Whether state `i` allows the probe's flow (reference evaluator):
    /// the sender's egress as the sender's node sees the state, and the
    /// receiver's ingress as the receiver's node sees it (its view: the
    /// pods of [`State::local_only`] on that node at their addresses).
    pub fn allows(&self, i: usize, p: &ProbeRecord) -> bool {
        let flow = Flow {
            src: p.src_ip,
            dst: p.dst_ip,
            protocol: p.proto.number(),
            dst_port: p.port,
        };
        let st = &self.states[i];
        if st.local_only.is_empty() {
            return evaluate(&st.snapshot, &self.opts, &flow).allowed;
        }
        let node = |ip| self.node_of(st, ip);
        let egress = evaluate(&st.view(node(p.src_ip)), &self.opts, &flow).egress.allowed;
        egress && evaluate(&st.view(node(p.dst_ip)), &self.opts, &flow).ingress.allowed
    }

    /// The node of the pod at `ip` in state `st`: its `nodeName`
    /// (`node-<k>`; an address can move to another node than its subnet's
    /// owner), that of a pod that lost its addresses, else the placement.
    fn node_of(&self, st: &State, ip: IpAddr) -> Option<u8> {
        let index = |p: &Pod| p.node_name.as_deref()?.strip_prefix("node-")?.parse().ok();
        if let Some(k) = pod_at(&st.snapshot, &self.opts, ip).and_then(index) {
            return Some(k);
        }
        if let Some((k, _)) = st.local_only.iter().find(|(_, p)| p.ips.contains(&ip)) {
            return Some(*k);
        }
        self.placement.as_ref().and_then(|f| f(ip))
    }

    fn both_pods(&self, i: usize, p: &ProbeRecord) -> bool {
        let s = &self.states[i].snapshot;
        pod_at(s, &self.opts, p.src_ip).is_some() && pod_at(s, &self.opts, p.dst_ip).is_some()
    }

    /// Whether a disturbance ran at some time in `[t0, t1]`.
    fn disturbed(&self, t0: f64, t1: f64) -> bool {
        self.disturbances
            .iter()
            .any(|d| d.start <= t1 && d.end.is_none_or(|e| e >= t0))
    }

    /// The verdict on one probe.
    pub fn judge(&self, p: &ProbeRecord) -> Verdict {
        let legal = self.legal_states(p.start, p.end);
        if legal.is_empty() {
            return Verdict::Fine;
        }
        if p.ok {
            if legal.iter().any(|&i| self.allows(i, p)) {
                Verdict::Fine
            } else {
                Verdict::Violation(legal)
            }
        } else {
            let all = legal.iter().all(|&i| self.allows(i, p) && self.both_pods(i, p));
            let settled = !self.disturbed(p.start - self.bounds.liveness, p.end);
            if all && settled {
                Verdict::LivenessFailure(legal)
            } else {
                Verdict::Fine
            }
        }
    }

    /// A report of a judged probe: the probe, each legal state (what made
    /// it, when, its verdict on the flow) and the disturbances around it.
    pub fn explain(&self, p: &ProbeRecord, states: &[usize]) -> String {
        let mut s = format!(
            "probe #{} {} ({}) -> {} ({}{}) {:?}/{} [{:.3}s, {:.3}s] {}\n",
            p.id,
            p.src,
            p.src_ip,
            p.dst,
            p.dst_ip,
            p.via.map_or(String::new(), |v| format!(" via ClusterIP {v}")),
            p.proto,
            p.port,
            p.start,
            p.end,
            if p.ok { "connected" } else { "failed" }
        );
        for &i in states {
            let st = &self.states[i];
            let _ = writeln!(
                s,
                "  state {i} from {:.3}s (legal until {:.3}s) after {}: {}",
                st.since,
                self.legal_until(i),
                st.what,
                if self.allows(i, p) { "allows" } else { "denies" }
            );
        }
        for d in self
            .disturbances
            .iter()
            .filter(|d| d.start <= p.end + 5.0 && d.end.is_none_or(|e| e >= p.start - 30.0))
        {
            let end = d.end.map_or("running".to_string(), |e| format!("{e:.3}s"));
            let _ = writeln!(s, "  disturbance {} [{:.3}s, {end}]", d.what, d.start);
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::networking::v1::NetworkPolicy;
    use npm_sim::cases::{Action, Model};

    fn probe(m: &Model, src: &str, dst: &str, start: f64, ok: bool) -> ProbeRecord {
        ProbeRecord {
            id: 1,
            src: src.into(),
            dst: dst.into(),
            src_ip: m.ip(src).unwrap(),
            dst_ip: m.ip(dst).unwrap(),
            via: None,
            proto: ProbeProto::Tcp,
            port: 80,
            start,
            end: start + 0.1,
            ok,
        }
    }

    /// x/a open at 0; at 10 a deny-all isolates namespace x.
    fn oracle() -> (Oracle, Model) {
        let mut m = Model::upstream();
        let mut o = Oracle::new(Bounds::default(), Model::options());
        o.push_state(0.0, "start", m.snapshot.clone());
        let np: NetworkPolicy = serde_yaml::from_str(
            "metadata: {namespace: x, name: deny}\nspec: {podSelector: {}, policyTypes: [Ingress]}",
        )
        .expect("policy");
        m.apply(&Action::CreatePolicy(Box::new(np))).expect("applied");
        o.push_state(10.0, "deny x", m.snapshot.clone());
        (o, m)
    }

    #[test]
    fn a_connection_no_legal_state_allows_is_a_violation() {
        let (o, m) = oracle();
        // Within the propagation bound the old state is legal.
        assert_eq!(o.judge(&probe(&m, "y/a", "x/a", 12.0, true)), Verdict::Fine);
        // After it, only the deny is.
        assert_eq!(
            o.judge(&probe(&m, "y/a", "x/a", 16.0, true)),
            Verdict::Violation(vec![1])
        );
        assert_eq!(o.judge(&probe(&m, "y/a", "x/b", 16.0, false)), Verdict::Fine);
    }

    #[test]
    fn a_disturbance_keeps_the_last_good_state_legal() {
        let (mut o, m) = oracle();
        let h = o.begin("outage", 11.0);
        o.end(h, 40.0);
        assert_eq!(o.legal_until(0), 45.0);
        assert_eq!(o.judge(&probe(&m, "y/a", "x/a", 44.0, true)), Verdict::Fine);
        assert_eq!(
            o.judge(&probe(&m, "y/a", "x/a", 46.0, true)),
            Verdict::Violation(vec![1])
        );
    }

    /// The upstream model with namespace x admitting only namespace y.
    fn x_from_y() -> Model {
        let mut m = Model::upstream();
        let np: NetworkPolicy = serde_yaml::from_str(
            "metadata: {namespace: x, name: from-y}\nspec: {podSelector: {}, policyTypes: [Ingress], \
             ingress: [{from: [{namespaceSelector: {matchLabels: {ns: y}}}]}]}",
        )
        .expect("policy");
        m.apply(&Action::CreatePolicy(Box::new(np))).expect("applied");
        m
    }

    /// A pod whose status lost its addresses keeps them on its own node
    /// (npm-cni's facts) and nowhere else: its flows are judged per end.
    #[test]
    fn a_pod_that_lost_its_address_is_held_only_by_its_own_node() {
        let m = x_from_y();
        let mut snap = m.snapshot.clone();
        // y/a and x/a on node 2, every other pod on node 1.
        let on_2: Vec<IpAddr> = ["y/a", "x/a"].iter().map(|p| m.ip(p).unwrap()).collect();
        let place: Placement = Box::new(move |ip| Some(if on_2.contains(&ip) { 2 } else { 1 }));
        let key = ("y".to_string(), "a".to_string());
        let lost = snap.pods[&key].clone();
        snap.pods.get_mut(&key).expect("y/a").ips.clear();
        let mut o = Oracle::new(Bounds::default(), Model::options()).with_placement(place);
        o.push_state_with(0.0, "y/a lost its addresses", snap.clone(), vec![(2, lost)]);
        // The same node holds y/a at its address: from namespace y.
        assert!(o.allows(0, &probe(&m, "y/a", "x/a", 1.0, true)));
        // Another node sees the address unowned: not from namespace y.
        assert!(!o.allows(0, &probe(&m, "y/a", "x/b", 1.0, true)));
        // The API's state alone would deny both.
        o.push_state(2.0, "the API's view only", snap);
        assert!(!o.allows(1, &probe(&m, "y/a", "x/a", 3.0, true)));
    }

    /// An address moved to another node than its subnet's owner is judged
    /// by the node its pod's `nodeName` names, not by the address.
    #[test]
    fn a_moved_address_is_judged_by_its_pods_node() {
        let m = x_from_y();
        let mut snap = m.snapshot.clone();
        // By address y/a is on node 2 and every other pod on node 1, but
        // x/b's address moved to node 2.
        let y_a = m.ip("y/a").unwrap();
        let place: Placement = Box::new(move |ip| Some(if ip == y_a { 2 } else { 1 }));
        let key = ("y".to_string(), "a".to_string());
        let lost = snap.pods[&key].clone();
        snap.pods.get_mut(&key).expect("y/a").ips.clear();
        snap.pods
            .get_mut(&("x".to_string(), "b".to_string()))
            .expect("x/b")
            .node_name = Some("node-2".into());
        let mut o = Oracle::new(Bounds::default(), Model::options()).with_placement(place);
        o.push_state_with(0.0, "y/a lost its addresses", snap, vec![(2, lost)]);
        // Node 2 holds y/a at its address, and x/b's ingress is node 2's.
        assert!(o.allows(0, &probe(&m, "y/a", "x/b", 1.0, true)));
        // x/c stayed on node 1, which sees y/a's address unowned.
        assert!(!o.allows(0, &probe(&m, "y/a", "x/c", 1.0, true)));
    }

    #[test]
    fn a_failed_probe_is_a_liveness_failure_only_when_settled() {
        let (mut o, m) = oracle();
        // y/a -> y/b is allowed in both states.
        assert_eq!(
            o.judge(&probe(&m, "y/a", "y/b", 30.0, false)),
            Verdict::LivenessFailure(vec![1])
        );
        let h = o.begin("node-1 not ready", 25.0);
        o.end(h, 26.0);
        assert_eq!(o.judge(&probe(&m, "y/a", "y/b", 30.0, false)), Verdict::Fine);
        assert!(matches!(
            o.judge(&probe(&m, "y/a", "y/b", 40.0, false)),
            Verdict::LivenessFailure(_)
        ));
        // Denied in the legal state: not a liveness failure.
        assert_eq!(o.judge(&probe(&m, "y/a", "x/a", 40.0, false)), Verdict::Fine);
    }
}
