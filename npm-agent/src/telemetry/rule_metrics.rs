//! Per-rule and per-endpoint counters with names: the kernel's running
//! totals ([`RuleCounts`], read on the stats tick with the other counters)
//! folded into `npm_rule_allowed_{packets,bytes}_total{namespace,policy,rule,direction}`
//! and `npm_endpoint_denied_{packets,bytes}_total{namespace,pod,direction}`,
//! rendered at scrape time after the registry's series.
//!
//! What is counted: a rule's counters are the packets its policy decision
//! allowed, that is the first packet of each new connection (and each
//! packet of a protocol that is not tracked); the later packets of an
//! allowed connection are tracked, never re-decided, and are not counted per
//! rule (they are `npm_packets_total{reason="tracked"}`). The eBPF datapath
//! adds nothing to a tracked packet for this; nftables does the same
//! (`ct state established` returns before the policy rules). An endpoint's
//! deny counters are the packets NetworkPolicy denied it (every one).
//!
//! The fold: each kernel counter's increment since the last read goes to
//! the live rule or endpoint it belongs to (an eBPF slot shared by two live
//! rules, or an allow whose rule the datapath could not tell, goes to the
//! `_other` series). A total lower than the last reading restarted at 0
//! (its counter was recreated); the first read after start is the baseline,
//! so the series count from the agent's start and are monotonic while it
//! runs. A series exists from its first counted packet while its rule or
//! endpoint exists; at most `max` series per kind (`--rule-metrics-max`):
//! once that many exist, a new rule or endpoint is counted in its
//! direction's `_other` series (namespace, policy or pod `_other`) and
//! reported by `npm_rule_metrics_folded{kind}`; a freed series makes room.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt::Write as _;
use std::sync::Mutex;

use npm_common::{DIR_EGRESS, DIR_INGRESS};
use npm_dataplane::{KernelCount, RuleCounts};
use npm_policy::compiled::{Compiled, RuleRef};

use super::metrics::SERIES;

/// Default of `--rule-metrics-max`: series per kind (rules, endpoints).
pub const DEFAULT_MAX_SERIES: usize = 1000;

/// The label value of the aggregate series.
const OTHER: &str = "_other";

/// Labels of a per-rule series: namespace, policy, rule index, direction.
type RuleLabels = (String, String, String, u8);
/// Labels of a per-endpoint series: namespace, pod, direction.
type EndpointLabels = (String, String, u8);

/// Packets and bytes.
type Totals = (u64, u64);

/// The per-rule and per-endpoint series (shared by the stats tick and the
/// scrape).
#[derive(Debug)]
pub struct RuleMetrics {
    state: Mutex<Fold>,
}

impl Default for RuleMetrics {
    fn default() -> Self {
        RuleMetrics::new(DEFAULT_MAX_SERIES)
    }
}

/// One kind's series: the admitted ones, the aggregate per direction, and
/// which live rules or endpoints are folded into it.
#[derive(Debug)]
struct Family<L: Ord> {
    series: BTreeMap<L, Totals>,
    other: [Totals; 2],
    folded: BTreeSet<L>,
}

impl<L: Ord + Clone> Family<L> {
    fn new() -> Self {
        Family {
            series: BTreeMap::new(),
            other: [(0, 0); 2],
            folded: BTreeSet::new(),
        }
    }

    /// Adds `d` to `labels` (admitted if room), or to `dir`'s aggregate.
    fn add(&mut self, labels: Option<L>, dir: u8, d: Totals, max: usize) {
        let Some(l) = labels else {
            add_to(&mut self.other[(dir & 1) as usize], d);
            return;
        };
        if let Some(t) = self.series.get_mut(&l) {
            add_to(t, d);
        } else if self.series.len() < max && !self.folded.contains(&l) {
            self.series.insert(l, d);
        } else {
            add_to(&mut self.other[(dir & 1) as usize], d);
            self.folded.insert(l);
        }
    }

    /// Drops the series and folded marks of what no longer exists.
    fn retain(&mut self, live: impl Fn(&L) -> bool) {
        self.series.retain(|l, _| live(l));
        self.folded.retain(|l| live(l));
    }
}

fn add_to(t: &mut Totals, d: Totals) {
    t.0 = t.0.wrapping_add(d.0);
    t.1 = t.1.wrapping_add(d.1);
}

#[derive(Debug)]
struct Fold {
    max: usize,
    /// The last reading of each kernel counter: (denied?, source).
    last: HashMap<(bool, u64), Totals>,
    /// The baseline was taken (the first read).
    primed: bool,
    rules: Family<RuleLabels>,
    endpoints: Family<EndpointLabels>,
}

/// The increment of a counter from `last` to `now` (`None`: first seen).
fn increment(last: Option<Totals>, now: Totals, primed: bool) -> Totals {
    match last {
        // Lower than before: the counter was recreated and restarted at 0.
        Some(l) if now.0 < l.0 || now.1 < l.1 => now,
        Some(l) => (now.0 - l.0, now.1 - l.1),
        // A counter that appeared since the last read: all of it is new,
        // except at the first read (the baseline).
        None if primed => now,
        None => (0, 0),
    }
}

impl RuleMetrics {
    /// Series bounded to `max` per kind (see the module documentation).
    pub fn new(max: usize) -> Self {
        RuleMetrics {
            state: Mutex::new(Fold {
                max,
                last: HashMap::new(),
                primed: false,
                rules: Family::new(),
                endpoints: Family::new(),
            }),
        }
    }

    /// Sets the bound (`--rule-metrics-max`).
    pub fn set_max(&self, max: usize) {
        self.lock().max = max;
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Fold> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Folds one reading of the kernel's counters, named after `compiled`
    /// (the state programmed last; `None` before the first sync: only the
    /// baseline is taken).
    pub fn fold(&self, counts: &RuleCounts, compiled: Option<&Compiled>) {
        let mut f = self.lock();
        let f = &mut *f;
        let Some(compiled) = compiled else {
            // Nothing to name yet: remember the readings as the baseline.
            for (denied, list) in [(false, &counts.allowed), (true, &counts.denied)] {
                for c in list {
                    f.last.insert((denied, c.source), (c.packets, c.bytes));
                }
            }
            f.primed = true;
            return;
        };
        let names = Names::new(compiled, counts);
        // What no longer exists frees its series first (room for new ones).
        let live_rules: BTreeSet<RuleLabels> = names.rule_labels.values().cloned().collect();
        f.rules.retain(|l| live_rules.contains(l));
        let live_eps: BTreeSet<(String, String)> = compiled
            .endpoints
            .values()
            .map(|e| (e.pod.namespace.clone(), e.pod.name.clone()))
            .collect();
        f.endpoints
            .retain(|(ns, pod, _)| live_eps.contains(&(ns.clone(), pod.clone())));
        let mut seen = HashMap::with_capacity(f.last.len());
        for (denied, list) in [(false, &counts.allowed), (true, &counts.denied)] {
            for c in list {
                let now = (c.packets, c.bytes);
                let d = increment(f.last.get(&(denied, c.source)).copied(), now, f.primed);
                seen.insert((denied, c.source), now);
                if d == (0, 0) {
                    continue;
                }
                if denied {
                    let labels = names.endpoint(c);
                    f.endpoints.add(labels, c.direction, d, f.max);
                } else {
                    let (labels, dir) = names.rule(c);
                    f.rules.add(labels, dir, d, f.max);
                }
            }
        }
        f.last = seen;
        f.primed = true;
    }

    /// The text exposition of the per-rule and per-endpoint families.
    pub fn render(&self) -> String {
        let f = self.lock();
        let mut out = String::new();
        let dirs = [(DIR_INGRESS, "ingress"), (DIR_EGRESS, "egress")];
        let dir_name = |d: u8| if d == DIR_INGRESS { "ingress" } else { "egress" };
        for (name, bytes) in [
            ("npm_rule_allowed_packets_total", false),
            ("npm_rule_allowed_bytes_total", true),
        ] {
            header(&mut out, name, "counter");
            for ((ns, policy, rule, d), t) in &f.rules.series {
                let v = if bytes { t.1 } else { t.0 };
                let _ = writeln!(
                    out,
                    "{name}{{namespace=\"{}\",policy=\"{}\",rule=\"{}\",direction=\"{}\"}} {v}",
                    esc(ns),
                    esc(policy),
                    esc(rule),
                    dir_name(*d)
                );
            }
            for (d, dn) in dirs {
                let t = f.rules.other[(d & 1) as usize];
                let v = if bytes { t.1 } else { t.0 };
                let _ = writeln!(
                    out,
                    "{name}{{namespace=\"{OTHER}\",policy=\"{OTHER}\",rule=\"{OTHER}\",direction=\"{dn}\"}} {v}"
                );
            }
        }
        for (name, bytes) in [
            ("npm_endpoint_denied_packets_total", false),
            ("npm_endpoint_denied_bytes_total", true),
        ] {
            header(&mut out, name, "counter");
            for ((ns, pod, d), t) in &f.endpoints.series {
                let v = if bytes { t.1 } else { t.0 };
                let _ = writeln!(
                    out,
                    "{name}{{namespace=\"{}\",pod=\"{}\",direction=\"{}\"}} {v}",
                    esc(ns),
                    esc(pod),
                    dir_name(*d)
                );
            }
            for (d, dn) in dirs {
                let t = f.endpoints.other[(d & 1) as usize];
                let v = if bytes { t.1 } else { t.0 };
                let _ = writeln!(
                    out,
                    "{name}{{namespace=\"{OTHER}\",pod=\"{OTHER}\",direction=\"{dn}\"}} {v}"
                );
            }
        }
        let name = "npm_rule_metrics_folded";
        header(&mut out, name, "gauge");
        let _ = writeln!(out, "{name}{{kind=\"rule\"}} {}", f.rules.folded.len());
        let _ = writeln!(out, "{name}{{kind=\"endpoint\"}} {}", f.endpoints.folded.len());
        out
    }
}

/// `# HELP` (from [`SERIES`]) and `# TYPE` of family `name`.
fn header(out: &mut String, name: &str, kind: &str) {
    let help = SERIES.iter().find(|s| s.name == name).map_or("", |s| s.help);
    let _ = writeln!(out, "# HELP {name} {help}");
    let _ = writeln!(out, "# TYPE {name} {kind}");
}

/// A label value escaped for the text exposition.
fn esc(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Rule and endpoint names of one compiled state, by kernel key.
struct Names<'a> {
    compiled: &'a Compiled,
    rule_modulus: Option<u32>,
    endpoint_modulus: Option<u32>,
    /// Rule id -> labels, for the rules with entries on this node.
    rule_labels: BTreeMap<u32, RuleLabels>,
    /// eBPF slot -> the live rule ids in it.
    rule_slots: HashMap<u32, Vec<u32>>,
    /// eBPF slot -> the live endpoint ids in it.
    endpoint_slots: HashMap<u32, Vec<u32>>,
}

impl<'a> Names<'a> {
    fn new(compiled: &'a Compiled, counts: &RuleCounts) -> Self {
        let used: BTreeSet<u32> = compiled.policy.values().copied().collect();
        let mut rule_labels = BTreeMap::new();
        for id in used {
            let labels = match compiled.ids.rules.get(&id) {
                Some(RuleRef::Policy {
                    namespace,
                    name,
                    direction,
                    index,
                }) => (namespace.clone(), name.clone(), index.to_string(), direction.as_u8()),
                Some(RuleRef::HostEgress) => (String::new(), "_host_egress".into(), "0".into(), DIR_EGRESS),
                // Tier rules have no policy entries; an unknown id is folded.
                _ => continue,
            };
            rule_labels.insert(id, labels);
        }
        let mut rule_slots: HashMap<u32, Vec<u32>> = HashMap::new();
        if let Some(n) = counts.rule_modulus {
            for &id in rule_labels.keys() {
                rule_slots.entry(id % n).or_default().push(id);
            }
        }
        let mut endpoint_slots: HashMap<u32, Vec<u32>> = HashMap::new();
        if let Some(n) = counts.endpoint_modulus {
            for &id in compiled.endpoints.keys() {
                endpoint_slots.entry(id % n).or_default().push(id);
            }
        }
        Names {
            compiled,
            rule_modulus: counts.rule_modulus,
            endpoint_modulus: counts.endpoint_modulus,
            rule_labels,
            rule_slots,
            endpoint_slots,
        }
    }

    /// The labels of an allow counter (`None`: the aggregate) and its
    /// direction.
    fn rule(&self, c: &KernelCount) -> (Option<RuleLabels>, u8) {
        let id = match self.rule_modulus {
            None => Some(c.key),
            Some(_) => match self.rule_slots.get(&c.key).map(Vec::as_slice) {
                Some([id]) => Some(*id),
                _ => None,
            },
        };
        match id.and_then(|id| self.rule_labels.get(&id)) {
            Some(l) => (Some(l.clone()), l.3),
            // eBPF slots carry no direction: an unnamed one is counted as
            // ingress's aggregate; nftables knows the chain's.
            None => (
                None,
                if self.rule_modulus.is_some() {
                    DIR_INGRESS
                } else {
                    c.direction
                },
            ),
        }
    }

    /// The labels of a deny counter (`None`: the aggregate).
    fn endpoint(&self, c: &KernelCount) -> Option<EndpointLabels> {
        let id = match self.endpoint_modulus {
            None => c.key,
            Some(_) => match self.endpoint_slots.get(&c.key).map(Vec::as_slice) {
                Some([id]) => *id,
                _ => return None,
            },
        };
        let ep = self.compiled.endpoints.get(&id)?;
        Some((ep.pod.namespace.clone(), ep.pod.name.clone(), c.direction))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::telemetry::sample;
    use npm_policy::compiled::{Direction, Endpoint, PodRef, PolicyEntry, TierPresence};

    fn compiled(rules: &[(u32, &str)], endpoints: &[(u32, &str)]) -> Compiled {
        let mut c = Compiled::default();
        for &(id, name) in rules {
            c.ids.rules.insert(
                id,
                RuleRef::Policy {
                    namespace: "ns".into(),
                    name: name.into(),
                    direction: Direction::Ingress,
                    index: 0,
                },
            );
            let e = PolicyEntry {
                subject: 100,
                direction: Direction::Ingress,
                peer: id,
                protocol: None,
                ports: (0, 65535),
            };
            c.policy.insert(e, id);
        }
        for &(id, pod) in endpoints {
            c.endpoints.insert(
                id,
                Endpoint {
                    pod: PodRef {
                        namespace: "ns".into(),
                        name: pod.into(),
                        uid: pod.into(),
                    },
                    identity: 100,
                    ipv4: None,
                    ipv6: None,
                    isolated_ingress: true,
                    isolated_egress: false,
                    tiers: TierPresence::default(),
                    report_new: false,
                },
            );
        }
        c
    }

    fn count(source: u64, key: u32, direction: u8, packets: u64) -> KernelCount {
        KernelCount {
            source,
            key,
            direction,
            packets,
            bytes: packets * 60,
        }
    }

    fn ebpf(allowed: Vec<KernelCount>, denied: Vec<KernelCount>) -> RuleCounts {
        RuleCounts {
            rule_modulus: Some(8),
            endpoint_modulus: Some(4),
            allowed,
            denied,
        }
    }

    fn rule(text: &str, policy: &str) -> Option<f64> {
        let s = format!(
            "npm_rule_allowed_packets_total{{namespace=\"ns\",policy=\"{policy}\",rule=\"0\",direction=\"ingress\"}}"
        );
        sample(text, &s)
    }

    #[test]
    fn baseline_then_increments_restarts_and_names() {
        let m = RuleMetrics::new(10);
        let c = compiled(&[(1, "a"), (2, "b")], &[(5, "web")]);
        // The first read is the baseline.
        m.fold(&ebpf(vec![count(1, 1, 0, 7)], vec![count(10, 1, 0, 3)]), Some(&c));
        assert_eq!(rule(&m.render(), "a"), None);
        m.fold(
            &ebpf(vec![count(1, 1, 0, 10), count(2, 2, 0, 4)], vec![count(10, 1, 0, 5)]),
            Some(&c),
        );
        let t = m.render();
        assert_eq!(rule(&t, "a"), Some(3.0));
        assert_eq!(
            rule(&t, "b"),
            Some(4.0),
            "a slot first seen after the baseline counts whole"
        );
        assert_eq!(
            sample(
                &t,
                "npm_endpoint_denied_packets_total{namespace=\"ns\",pod=\"web\",direction=\"ingress\"}"
            ),
            Some(2.0)
        );
        assert_eq!(
            sample(
                &t,
                "npm_endpoint_denied_bytes_total{namespace=\"ns\",pod=\"web\",direction=\"ingress\"}"
            ),
            Some(120.0)
        );
        // A counter that restarted at 0 (recreated) adds what it holds.
        m.fold(&ebpf(vec![count(1, 1, 0, 2), count(2, 2, 0, 4)], vec![]), Some(&c));
        assert_eq!(rule(&m.render(), "a"), Some(5.0));
    }

    #[test]
    fn shared_slot_and_bound_fold_into_other() {
        let m = RuleMetrics::new(1);
        // Rules 1 and 9 share slot 1 (modulus 8); rules 2 and 3 have their own.
        let c = compiled(&[(1, "a"), (9, "i"), (2, "b"), (3, "c")], &[]);
        m.fold(&ebpf(vec![], vec![]), Some(&c));
        m.fold(
            &ebpf(vec![count(1, 1, 0, 4), count(2, 2, 0, 1), count(3, 3, 0, 2)], vec![]),
            Some(&c),
        );
        let t = m.render();
        let other = "npm_rule_allowed_packets_total{namespace=\"_other\",policy=\"_other\",rule=\"_other\",direction=\"ingress\"}";
        assert_eq!(rule(&t, "b"), Some(1.0), "the first rule counted gets the one series");
        assert_eq!(rule(&t, "c"), None);
        assert_eq!(
            sample(&t, other),
            Some(6.0),
            "the shared slot and the rule beyond the bound"
        );
        assert_eq!(sample(&t, "npm_rule_metrics_folded{kind=\"rule\"}"), Some(1.0));
        // Rule 2 goes away: its series goes, a folded rule stays folded
        // (its aggregate stays monotonic), a new rule takes the room.
        let c = compiled(&[(3, "c"), (4, "d")], &[]);
        m.fold(
            &ebpf(vec![count(1, 1, 0, 4), count(3, 3, 0, 5), count(4, 4, 0, 1)], vec![]),
            Some(&c),
        );
        let t = m.render();
        assert_eq!(rule(&t, "b"), None);
        assert_eq!(rule(&t, "c"), None);
        assert_eq!(rule(&t, "d"), Some(1.0));
        assert_eq!(sample(&t, other), Some(9.0));
    }

    #[test]
    fn nftables_keys_are_rule_ids() {
        let m = RuleMetrics::new(10);
        let c = compiled(&[(9, "i")], &[(5, "web")]);
        let nft = |p| RuleCounts {
            allowed: vec![count(77, 9, 0, p)],
            denied: vec![count(78, 5, 0, p)],
            ..RuleCounts::default()
        };
        m.fold(&nft(1), None);
        m.fold(&nft(4), Some(&c));
        let t = m.render();
        assert_eq!(rule(&t, "i"), Some(3.0));
        assert_eq!(
            sample(
                &t,
                "npm_endpoint_denied_packets_total{namespace=\"ns\",pod=\"web\",direction=\"ingress\"}"
            ),
            Some(3.0)
        );
        assert!(t.contains("# HELP npm_rule_allowed_packets_total "));
    }
}
