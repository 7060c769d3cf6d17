//! Invalid input fails closed: for every invalid form the
//! test API server's validator knows (`tests/apiserver/src/validate.rs`),
//! a policy with one good rule and one bad part keeps isolating the pods
//! it selects in its policyTypes; only the part that cannot be understood
//! is dropped (see the module doc of `npm_policy::validate`):
//!
//! - the converted policy equals the conversion of the same policy with
//!   the bad part removed by hand (a dropped peer never widens its rule: a
//!   rule left without peers, or with a bad port, goes as a whole);
//! - the problem names the field path, the value and what was dropped;
//! - on a set of flows the compiled lookup (full and incremental compile)
//!   and the reference evaluator agree with each other and with the
//!   expected verdicts.
//!
//! Before the fix such a policy was skipped: the pods it selects were not
//! isolated at all, so every "denied" flow below was allowed.

use std::net::IpAddr;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::compiled::{CompileOptions, Compiled, Direction};
use npm_policy::evaluate::evaluate_direction;
use npm_policy::lookup::lookup;
use npm_policy::model::*;
use npm_policy::validate::{convert_policy, validate_policy};
use serde_json::{json, Value};

/// The pods: `ns1/web` (the selected pod, on this node) and peers.
const PODS: &[(&str, &str, &str, &str)] = &[
    // (namespace, name, app label, address)
    ("ns1", "web", "web", "10.0.0.1"),
    ("ns1", "good", "good", "10.0.0.2"),
    ("ns1", "ok2", "ok2", "10.0.0.3"),
    ("ns1", "other", "other", "10.0.0.4"),
    ("ns2", "far", "good", "10.0.1.1"),
];
/// An address outside the cluster (inside 192.168.0.0/16).
const EXT: &str = "192.168.5.5";
/// The peers every flow is probed with, by name (`ext` for [`EXT`]).
const PEERS: &[&str] = &["good", "ok2", "other", "far", "ext"];
/// TCP destination ports probed.
const PORTS: &[u16] = &[80, 81, 95];

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec!["10.9.9.9".parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    }
}

fn ip_of(peer: &str) -> IpAddr {
    if peer == "ext" {
        return EXT.parse().unwrap();
    }
    let (_, _, _, ip) = PODS.iter().find(|p| p.1 == peer).unwrap();
    ip.parse().unwrap()
}

fn snapshot() -> Snapshot {
    let mut s = Snapshot::default();
    for (ns, team) in [("ns1", "a"), ("ns2", "x")] {
        s.upsert_namespace(Namespace {
            name: ns.into(),
            labels: [
                ("kubernetes.io/metadata.name".to_string(), ns.to_string()),
                ("team".to_string(), team.to_string()),
            ]
            .into(),
        });
    }
    for (ns, name, app, ip) in PODS {
        s.upsert_pod(Pod {
            uid: format!("uid-{name}"),
            namespace: ns.to_string(),
            name: name.to_string(),
            labels: [("app".to_string(), app.to_string())].into(),
            ips: vec![ip.parse().unwrap()],
            node_name: Some(if *name == "web" { "node" } else { "other" }.into()),
            phase: PodPhase::Running,
            deleting: false,
            host_network: false,
            ports: vec![ContainerPort {
                name: Some("http".into()),
                port: 80,
                protocol: Protocol::Tcp,
            }],
            created: 0,
        });
    }
    s
}

fn policy(name: &str, spec: Value) -> NetworkPolicy {
    serde_json::from_value(json!({
        "apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "ns1", "uid": "u1", "resourceVersion": "7"},
        "spec": spec,
    }))
    .unwrap()
}

/// The good rule every case starts with: `app=good` on port 80.
fn good_rule() -> Value {
    json!({"from": [{"podSelector": {"matchLabels": {"app": "good"}}}], "ports": [{"port": 80}]})
}

/// An ingress policy on `app=web`: the good rule, then `bad`.
fn ingress(bad: Value) -> Value {
    json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [good_rule(), bad]})
}

/// A rule `from: [app=ok2, peer]` (any port).
fn with_ok2(peer: Value) -> Value {
    ingress(json!({"from": [{"podSelector": {"matchLabels": {"app": "ok2"}}}, peer]}))
}

/// The same rule with the bad peer removed by hand.
fn ok2_only() -> Value {
    ingress(json!({"from": [{"podSelector": {"matchLabels": {"app": "ok2"}}}]}))
}

/// A rule `from: [app=other]` on ports `[port, 81]`.
fn with_port(port: Value) -> Value {
    ingress(json!({"from": [{"podSelector": {"matchLabels": {"app": "other"}}}], "ports": [port, {"port": 81}]}))
}

/// Only the good rule: what is left when the second rule is dropped.
fn good_only() -> Value {
    json!({"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [good_rule()]})
}

/// What a direction allows of the probed (peer, port) pairs.
#[derive(Clone, Copy, Debug)]
enum Expect {
    /// Not isolated: everything.
    Open,
    /// Isolated: only these peers, each on these ports.
    Only(&'static [(&'static str, &'static [u16])]),
}

impl Expect {
    fn allows(self, peer: &str, port: u16) -> bool {
        match self {
            Expect::Open => true,
            Expect::Only(list) => list.iter().any(|(p, ports)| *p == peer && ports.contains(&port)),
        }
    }
}

/// The good rule's allowance alone.
const GOOD: Expect = Expect::Only(&[("good", &[80])]);
/// The good rule and a kept `app=ok2` peer.
const GOOD_OK2: Expect = Expect::Only(&[("good", &[80]), ("ok2", &[80, 81, 95])]);

struct Case {
    name: &'static str,
    spec: Value,
    /// A valid spec that converts to the same policy (`None`: checked
    /// otherwise, see `selects nothing`).
    same_as: Option<Value>,
    /// (field path, what the problem says was dropped); `None`: the form is
    /// understood as written (no problem reported).
    problem: Option<(&'static str, &'static str)>,
    ingress: Expect,
    egress: Expect,
}

fn case(
    name: &'static str,
    spec: Value,
    same_as: Option<Value>,
    problem: Option<(&'static str, &'static str)>,
    ingress: Expect,
) -> Case {
    Case {
        name,
        spec,
        same_as,
        problem,
        ingress,
        egress: Expect::Open,
    }
}

const PEER1: &str = "peer spec.ingress[1].from[1] dropped";
const RULE1: &str = "rule spec.ingress[1] dropped";

fn cases() -> Vec<Case> {
    let ip_block = |b: Value| json!({"ipBlock": b});
    let pods_expr = |key: &str, op: &str, values: Value| json!({"podSelector": {"matchExpressions": [{"key": key, "operator": op, "values": values}]}});
    let ns_expr = |key: &str, op: &str, values: Value| json!({"namespaceSelector": {"matchExpressions": [{"key": key, "operator": op, "values": values}]}});
    let alone = |peer: Value| ingress(json!({"from": [peer]}));
    let both_types = |types: Value| {
        json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": types, "ingress": [good_rule()],
               "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "good"}}}]}]})
    };
    vec![
        // ipBlock
        case(
            "bad cidr",
            with_ok2(ip_block(json!({"cidr": "192.168.0.0/33"}))),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].ipBlock.cidr", PEER1)),
            GOOD_OK2,
        ),
        case(
            "bad cidr, the only peer",
            alone(ip_block(json!({"cidr": "192.168.0.0/33"}))),
            Some(good_only()),
            Some(("spec.ingress[1].from[0].ipBlock.cidr", RULE1)),
            GOOD,
        ),
        case(
            "empty cidr",
            alone(ip_block(json!({"cidr": ""}))),
            Some(good_only()),
            Some(("spec.ingress[1].from[0].ipBlock.cidr", RULE1)),
            GOOD,
        ),
        case(
            "bad except",
            with_ok2(ip_block(json!({"cidr": "192.168.0.0/16", "except": ["nope"]}))),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].ipBlock.except[0]", PEER1)),
            GOOD_OK2,
        ),
        case(
            "except outside cidr",
            with_ok2(ip_block(json!({"cidr": "192.168.0.0/16", "except": ["10.0.0.0/24"]}))),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].ipBlock.except[0]", PEER1)),
            GOOD_OK2,
        ),
        case(
            "except equal to cidr",
            with_ok2(ip_block(
                json!({"cidr": "192.168.0.0/16", "except": ["192.168.0.0/16"]}),
            )),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].ipBlock.except[0]", PEER1)),
            GOOD_OK2,
        ),
        case(
            "except of the other family",
            with_ok2(ip_block(json!({"cidr": "192.168.0.0/16", "except": ["fd00::/64"]}))),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].ipBlock.except[0]", PEER1)),
            GOOD_OK2,
        ),
        // Peers
        case(
            "empty peer",
            with_ok2(json!({})),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1]", PEER1)),
            GOOD_OK2,
        ),
        case(
            "empty peer, the only peer",
            alone(json!({})),
            Some(good_only()),
            Some(("spec.ingress[1].from[0]", RULE1)),
            GOOD,
        ),
        case(
            "ipBlock with a selector",
            with_ok2(json!({"ipBlock": {"cidr": "192.168.0.0/16"}, "podSelector": {}})),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1]", PEER1)),
            GOOD_OK2,
        ),
        // Label selectors of peers
        case(
            "bad operator",
            with_ok2(pods_expr("app", "Foo", json!(["other"]))),
            Some(ok2_only()),
            Some((
                "spec.ingress[1].from[1].podSelector.matchExpressions[0].operator",
                PEER1,
            )),
            GOOD_OK2,
        ),
        case(
            "bad operator, the only peer",
            alone(pods_expr("app", "Foo", json!(["other"]))),
            Some(good_only()),
            Some((
                "spec.ingress[1].from[0].podSelector.matchExpressions[0].operator",
                RULE1,
            )),
            GOOD,
        ),
        case(
            "In without values",
            with_ok2(ns_expr("team", "In", json!([]))),
            Some(ok2_only()),
            Some((
                "spec.ingress[1].from[1].namespaceSelector.matchExpressions[0].values",
                PEER1,
            )),
            GOOD_OK2,
        ),
        case(
            "NotIn without values",
            with_ok2(pods_expr("app", "NotIn", Value::Null)),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchExpressions[0].values", PEER1)),
            GOOD_OK2,
        ),
        case(
            "Exists with values",
            with_ok2(ns_expr("team", "Exists", json!(["x"]))),
            Some(ok2_only()),
            Some((
                "spec.ingress[1].from[1].namespaceSelector.matchExpressions[0].values",
                PEER1,
            )),
            GOOD_OK2,
        ),
        case(
            "DoesNotExist with values",
            with_ok2(pods_expr("app", "DoesNotExist", json!(["x"]))),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchExpressions[0].values", PEER1)),
            GOOD_OK2,
        ),
        case(
            "empty key",
            with_ok2(pods_expr("", "Exists", Value::Null)),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchExpressions[0].key", PEER1)),
            GOOD_OK2,
        ),
        case(
            "good podSelector, bad namespaceSelector in one peer",
            with_ok2(json!({"podSelector": {"matchLabels": {"app": "good"}},
                            "namespaceSelector": {"matchExpressions": [{"key": "team", "operator": "Near"}]}})),
            Some(ok2_only()),
            Some((
                "spec.ingress[1].from[1].namespaceSelector.matchExpressions[0].operator",
                PEER1,
            )),
            GOOD_OK2,
        ),
        // Label keys and values the API rejects make the selector invalid:
        // with NotIn/DoesNotExist a key no pod can have would match every pod.
        case(
            "DoesNotExist on an invalid label key",
            with_ok2(pods_expr("Bad Key!", "DoesNotExist", Value::Null)),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchExpressions[0].key", PEER1)),
            GOOD_OK2,
        ),
        case(
            "NotIn on an invalid label key",
            with_ok2(pods_expr("app!", "NotIn", json!(["x"]))),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchExpressions[0].key", PEER1)),
            GOOD_OK2,
        ),
        case(
            "DoesNotExist on an invalid label key in a namespaceSelector",
            with_ok2(ns_expr("Bad Key!", "DoesNotExist", Value::Null)),
            Some(ok2_only()),
            Some((
                "spec.ingress[1].from[1].namespaceSelector.matchExpressions[0].key",
                PEER1,
            )),
            GOOD_OK2,
        ),
        case(
            "DoesNotExist on a key with an invalid prefix",
            with_ok2(pods_expr("Bad_Prefix/app", "DoesNotExist", Value::Null)),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchExpressions[0].key", PEER1)),
            GOOD_OK2,
        ),
        case(
            "NotIn with an invalid label value",
            with_ok2(pods_expr("app", "NotIn", json!(["not a value!"]))),
            Some(ok2_only()),
            Some((
                "spec.ingress[1].from[1].podSelector.matchExpressions[0].values[0]",
                PEER1,
            )),
            GOOD_OK2,
        ),
        case(
            "invalid label key in matchLabels",
            with_ok2(json!({"podSelector": {"matchLabels": {"bad key!": "v"}}})),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].podSelector.matchLabels", PEER1)),
            GOOD_OK2,
        ),
        case(
            "invalid label value in matchLabels",
            with_ok2(json!({"namespaceSelector": {"matchLabels": {"team": "a".repeat(64)}}})),
            Some(ok2_only()),
            Some(("spec.ingress[1].from[1].namespaceSelector.matchLabels[team]", PEER1)),
            GOOD_OK2,
        ),
        // Ports
        case(
            "unknown protocol",
            with_port(json!({"protocol": "ICMP", "port": 1})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].protocol", RULE1)),
            GOOD,
        ),
        case(
            "port 0",
            with_port(json!({"port": 0})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].port", RULE1)),
            GOOD,
        ),
        case(
            "port 65536",
            with_port(json!({"port": 65536})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].port", RULE1)),
            GOOD,
        ),
        case(
            "bad port name",
            with_port(json!({"port": "Not_A_Name"})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].port", RULE1)),
            GOOD,
        ),
        case(
            "endPort < port",
            with_port(json!({"port": 95, "endPort": 90})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].endPort", RULE1)),
            GOOD,
        ),
        case(
            "endPort out of range",
            with_port(json!({"port": 90, "endPort": 70000})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].endPort", RULE1)),
            GOOD,
        ),
        case(
            "endPort without port",
            with_port(json!({"endPort": 95})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].endPort", RULE1)),
            GOOD,
        ),
        case(
            "endPort with a named port",
            with_port(json!({"port": "http", "endPort": 95})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].endPort", RULE1)),
            GOOD,
        ),
        case(
            "the only port is bad (an empty port list would allow every port)",
            ingress(json!({"from": [{"podSelector": {"matchLabels": {"app": "other"}}}], "ports": [{"port": 0}]})),
            Some(good_only()),
            Some(("spec.ingress[1].ports[0].port", RULE1)),
            GOOD,
        ),
        case(
            "bad port and bad peer in one rule",
            ingress(json!({"from": [{"podSelector": {"matchLabels": {"app": "other"}}}, {}], "ports": [{"port": 0}]})),
            Some(good_only()),
            Some(("spec.ingress[1].from[1]", RULE1)),
            GOOD,
        ),
        // Egress
        Case {
            egress: Expect::Only(&[("good", &[80, 81, 95])]),
            ..case(
                "egress: bad cidr peer next to a good one",
                json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"],
                       "ingress": [good_rule()],
                       "egress": [{"to": [{"ipBlock": {"cidr": "x"}}, {"podSelector": {"matchLabels": {"app": "good"}}}]}]}),
                Some(
                    json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"],
                       "ingress": [good_rule()],
                       "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "good"}}}]}]}),
                ),
                Some(("spec.egress[0].to[0].ipBlock.cidr", "peer spec.egress[0].to[0] dropped")),
                GOOD,
            )
        },
        Case {
            egress: Expect::Only(&[]),
            ..case(
                "egress: the only rule dropped, egress stays isolated",
                json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"],
                       "ingress": [good_rule()], "egress": [{"ports": [{"port": 70000}]}]}),
                Some(
                    json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Egress"],
                       "ingress": [good_rule()]}),
                ),
                Some(("spec.egress[0].ports[0].port", "rule spec.egress[0] dropped")),
                GOOD,
            )
        },
        // policyTypes
        Case {
            egress: Expect::Only(&[("good", &[80, 81, 95])]),
            ..case(
                "unknown policyTypes entry",
                both_types(json!(["Ingress", "Sideways"])),
                Some(both_types(json!(["Ingress", "Egress"]))),
                Some(("spec.policyTypes[1]", "isolated both ways")),
                GOOD,
            )
        },
        Case {
            egress: Expect::Only(&[("good", &[80, 81, 95])]),
            ..case(
                "only an unknown policyTypes entry",
                both_types(json!(["ingress"])),
                Some(both_types(json!(["Ingress", "Egress"]))),
                Some(("spec.policyTypes[0]", "isolated both ways")),
                GOOD,
            )
        },
        case(
            "three policyTypes",
            json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress", "Ingress", "Ingress"],
                   "ingress": [good_rule()]}),
            Some(
                json!({"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Ingress"],
                   "ingress": [good_rule()]}),
            ),
            Some(("spec.policyTypes", "enforced as written")),
            GOOD,
        ),
        // The policy's own podSelector: it selects nothing.
        case(
            "bad operator in the policy's podSelector",
            json!({"podSelector": {"matchExpressions": [{"key": "app", "operator": "Is", "values": ["web"]}]},
                   "ingress": [good_rule()]}),
            None,
            Some(("spec.podSelector.matchExpressions[0].operator", "selects no pod")),
            Expect::Open,
        ),
        case(
            "DoesNotExist on an invalid label key in the policy's podSelector",
            json!({"podSelector": {"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "Bad Key!", "operator": "DoesNotExist"}]},
                   "ingress": [good_rule()]}),
            None,
            Some(("spec.podSelector.matchExpressions[0].key", "selects no pod")),
            Expect::Open,
        ),
        case(
            "In without values in the policy's podSelector",
            json!({"podSelector": {"matchLabels": {"app": "web"}, "matchExpressions": [{"key": "tier", "operator": "In"}]},
                   "ingress": [good_rule()]}),
            None,
            Some(("spec.podSelector.matchExpressions[0].values", "selects no pod")),
            Expect::Open,
        ),
    ]
}

/// The endpoint id of `ns1/web`.
fn web(c: &Compiled) -> u32 {
    *c.ids.endpoints.get("uid-web").expect("web is an endpoint")
}

/// Every probed flow: compiled lookup == evaluator == expected.
fn check_flows(name: &str, what: &str, s: &Snapshot, c: &Compiled, want: (Expect, Expect)) {
    let pod = &s.pods[&("ns1".to_string(), "web".to_string())];
    let ep = web(c);
    for (dir, expect) in [(Direction::Ingress, want.0), (Direction::Egress, want.1)] {
        for peer in PEERS {
            for &port in PORTS {
                let ip = ip_of(peer);
                let got = lookup(c, ep, dir, ip, 6, port).allowed;
                let reference = evaluate_direction(s, &opts(), pod, dir, ip, 6, port);
                let expected = expect.allows(peer, port);
                assert_eq!(
                    (got, reference.allowed),
                    (expected, expected),
                    "{name} ({what}): {dir:?} {peer}:{port}: compiled {got}, evaluator {reference}, expected {expected}"
                );
            }
        }
    }
}

#[test]
fn every_invalid_form_keeps_the_isolation_and_drops_only_the_bad_part() {
    let table = cases();
    assert!(table.len() >= 30);
    for case in table {
        let name = case.name;
        let np = policy("np", case.spec.clone());
        let conversion = convert_policy(&np);
        // The problem names the field path and what was dropped.
        match case.problem {
            Some((field, consequence)) => {
                let prefix = format!("ns1/np: {field}: ");
                let err = validate_policy(&np).expect_err(name);
                let line = err
                    .errors
                    .iter()
                    .find(|e| e.starts_with(&prefix))
                    .unwrap_or_else(|| panic!("{name}: want {prefix:?} in {:?}", err.errors));
                assert!(line.contains(consequence), "{name}: {line:?} says {consequence:?}");
                assert!(conversion.problems.iter().any(|p| p.field == field), "{name}");
            }
            None => assert!(conversion.problems.is_empty(), "{name}: {:?}", conversion.problems),
        }
        // Exactly the bad part is dropped.
        match &case.same_as {
            Some(spec) => {
                let fixed = validate_policy(&policy("np", spec.clone()))
                    .unwrap_or_else(|e| panic!("{name}: the hand-fixed spec is valid: {e:?}"));
                assert_eq!(conversion.policy, fixed, "{name}");
            }
            None if case.problem.is_some() => {
                assert_eq!(conversion.policy.pod_selector, Selector::nothing(), "{name}")
            }
            None => {}
        }
        // The snapshot holds the policy and its report.
        let mut s = snapshot();
        assert_eq!(s.upsert_policy(&np).is_err(), case.problem.is_some(), "{name}");
        assert!(s.policies.contains_key(&("ns1".into(), "np".into())), "{name}: kept");
        assert_eq!(s.invalid_policies.len(), case.problem.is_some() as usize, "{name}");
        // Full compile, the reference evaluator, and the expected verdicts.
        let full = npm_policy::compile(&s, &opts(), None);
        assert_eq!(
            full.endpoints[&web(&full)].isolated_ingress,
            !matches!(case.ingress, Expect::Open),
            "{name}"
        );
        check_flows(name, "full compile", &s, &full, (case.ingress, case.egress));
        // The incremental compiler: the policy applied to a running
        // compile, and replacing a valid version of itself.
        let mut c = npm_policy::incremental::Compiler::new(snapshot(), opts(), None);
        let valid = policy("np", good_only());
        c.apply_policy(&valid).unwrap();
        assert_eq!(c.apply_policy(&np).is_err(), case.problem.is_some(), "{name}");
        assert_eq!(
            c.snapshot().invalid_policies.len(),
            case.problem.is_some() as usize,
            "{name}"
        );
        check_flows(name, "incremental", &s, c.compiled(), (case.ingress, case.egress));
        // A fixed version clears the report.
        c.apply_policy(&valid).unwrap();
        assert!(c.snapshot().invalid_policies.is_empty(), "{name}");
    }
}

/// The rules chosen, one by one, on the model: dropping never widens.
#[test]
fn a_dropped_peer_never_turns_its_rule_into_from_everyone() {
    // Both peers bad: the rule goes (it is not kept with `from: []`).
    let np = policy(
        "np",
        json!({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "300.0.0.0/8"}}, {}]}]}),
    );
    let c = convert_policy(&np);
    assert!(c.policy.ingress.is_empty(), "{:?}", c.policy.ingress);
    assert!(c.policy.ingress_isolation);
    assert_eq!(c.problems.len(), 2);
    assert!(c
        .problems
        .iter()
        .all(|p| p.consequence == npm_policy::validate::Consequence::RuleDropped("spec.ingress[0]".into())));
    // A rule whose `from` was empty to begin with stays "from everyone".
    let np = policy(
        "np",
        json!({"podSelector": {}, "ingress": [{"from": [], "ports": [{"port": 80}]}]}),
    );
    let c = convert_policy(&np);
    assert!(c.problems.is_empty());
    assert_eq!(c.policy.ingress.len(), 1);
    assert!(c.policy.ingress[0].peers.is_empty());
}

/// The value is quoted in the report (the agent's Event message).
#[test]
fn problems_quote_the_value() {
    for (spec, value) in [
        (
            with_ok2(json!({"ipBlock": {"cidr": "192.168.0.0/33"}})),
            "\"192.168.0.0/33\"",
        ),
        (with_port(json!({"port": 70000})), "70000"),
        (with_port(json!({"port": 95, "endPort": 90})), "90"),
        (with_port(json!({"protocol": "ICMP"})), "\"ICMP\""),
        (with_port(json!({"port": "http", "endPort": 95})), "\"http\""),
        (
            with_ok2(json!({"podSelector": {"matchExpressions": [{"key": "a", "operator": "Foo"}]}})),
            "\"Foo\"",
        ),
        (with_ok2(json!({})), "{}"),
    ] {
        let c = convert_policy(&policy("np", spec));
        assert!(
            c.problems.iter().any(|p| p.message.contains(value)),
            "{value}: {:?}",
            c.problems
        );
    }
}
