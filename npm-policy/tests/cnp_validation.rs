//! ClusterNetworkPolicy validation table: each tweak of a valid base
//! object gives an error naming the policy and the field path, with the
//! documented fail-closed consequence visible in the converted model (see
//! the module doc of `npm_policy::tiers::validate`).

use npm_policy::compiled::{Tier, TierAction};
use npm_policy::model::{Protocol, Selector};
use npm_policy::tiers::validate::{
    cluster_policy_from_value, convert_cluster_policy_value, convert_cluster_policy_yaml, ClusterConsequence,
    ClusterParseError,
};
use npm_policy::tiers::{ClusterPeer, ClusterPolicy, ClusterPort, Subject};
use serde_json::{json, Value};

fn base() -> Value {
    json!({
        "apiVersion": "policy.networking.k8s.io/v1alpha2",
        "kind": "ClusterNetworkPolicy",
        "metadata": {"name": "cnp"},
        "spec": {
            "tier": "Admin",
            "priority": 10,
            "subject": {"namespaces": {"matchLabels": {"ns": "x"}}},
            "ingress": [
                {"name": "deny-y", "action": "Deny",
                 "from": [{"namespaces": {"matchLabels": {"ns": "y"}}}],
                 "protocols": [{"tcp": {"destinationPort": {"number": 80}}}]},
                {"action": "Accept",
                 "from": [{"pods": {"namespaceSelector": {}, "podSelector": {"matchLabels": {"pod": "b"}}}},
                          {"namespaces": {"matchLabels": {"ns": "z"}}}],
                 "protocols": [{"udp": {"destinationPort": {"range": {"start": 50, "end": 60}}}},
                               {"destinationNamedPort": "http"}]},
                {"action": "Pass", "from": [{"namespaces": {}}]}
            ],
            "egress": [
                {"action": "Deny", "to": [{"networks": ["10.0.0.0/8", "fd00::1/64"]}]},
                {"action": "Accept", "to": [{"pods": {"podSelector": {}}}]}
            ]
        }
    })
}

fn sel(k: &str, v: &str) -> Selector {
    Selector {
        match_labels: [(k.to_string(), v.to_string())].into(),
        match_expressions: vec![],
    }
}

#[test]
fn base_converts_exactly() {
    let c = convert_cluster_policy_value(&base()).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    let p = c.policy;
    assert_eq!((p.name.as_str(), p.tier, p.priority), ("cnp", Tier::Admin, 10));
    assert_eq!(p.subject, Subject::Namespaces(sel("ns", "x")));
    assert_eq!(p.ingress.len(), 3);
    assert_eq!(p.ingress[0].name.as_deref(), Some("deny-y"));
    assert_eq!(p.ingress[0].action, TierAction::Deny);
    assert_eq!(p.ingress[0].peers, vec![ClusterPeer::Namespaces(sel("ns", "y"))]);
    assert_eq!(
        p.ingress[0].ports,
        vec![ClusterPort::Ports {
            protocol: Protocol::Tcp,
            start: 80,
            end: 80
        }]
    );
    assert_eq!(
        p.ingress[1].peers,
        vec![
            ClusterPeer::Pods {
                namespaces: Selector::default(),
                pods: sel("pod", "b")
            },
            ClusterPeer::Namespaces(sel("ns", "z"))
        ]
    );
    assert_eq!(
        p.ingress[1].ports,
        vec![
            ClusterPort::Ports {
                protocol: Protocol::Udp,
                start: 50,
                end: 60
            },
            ClusterPort::Named("http".into())
        ]
    );
    assert_eq!((p.ingress[2].action, p.ingress[2].ports.len()), (TierAction::Pass, 0));
    // Host bits cleared.
    assert_eq!(
        p.egress[0].peers,
        vec![ClusterPeer::Networks(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00::/64".parse().unwrap()
        ])]
    );
    // Unknown fields anywhere are ignored.
    let mut v = base();
    v["spec"]["future"] = json!({"x": 1});
    v["spec"]["ingress"][0]["future"] = json!(true);
    v["spec"]["subject"]["namespaces"]["matchLabels"]["ns"] = json!("x");
    assert!(convert_cluster_policy_value(&v).unwrap().problems.is_empty());
}

type Tweak = fn(&mut Value);
type Check = fn(&ClusterPolicy) -> bool;

#[test]
fn invalid_forms_fail_closed() {
    let table: Vec<(&str, Tweak, &str, ClusterConsequence, Check)> = vec![
        (
            "priority above 1000",
            |v| v["spec"]["priority"] = json!(1001),
            "spec.priority",
            ClusterConsequence::Reported,
            |p| p.priority == 1000 && p.ingress[1].action == TierAction::Accept,
        ),
        (
            "negative priority",
            |v| v["spec"]["priority"] = json!(-3),
            "spec.priority",
            ClusterConsequence::Reported,
            |p| p.priority == 0,
        ),
        (
            "missing priority",
            |v| {
                v["spec"].as_object_mut().unwrap().remove("priority");
            },
            "spec.priority",
            ClusterConsequence::DenyOnly,
            |p| {
                p.priority == 0
                    && p.ingress[1].peers.is_empty()
                    && p.ingress[2].action == TierAction::Deny
                    && p.egress[1].peers.is_empty()
                    && p.ingress[0].action == TierAction::Deny
            },
        ),
        (
            "unknown tier",
            |v| v["spec"]["tier"] = json!("Developer"),
            "spec.tier",
            ClusterConsequence::DenyOnly,
            |p| p.tier == Tier::Admin && p.ingress[1].peers.is_empty() && p.ingress[2].action == TierAction::Deny,
        ),
        (
            "baseline is a valid tier",
            |v| {
                v["spec"]["tier"] = json!("Baseline");
                v["spec"]["priority"] = json!(1001);
            },
            "spec.priority",
            ClusterConsequence::Reported,
            |p| p.tier == Tier::Baseline,
        ),
        (
            "range start == end in an Accept rule",
            |v| {
                v["spec"]["ingress"][1]["protocols"][0]["udp"]["destinationPort"]["range"] =
                    json!({"start": 60, "end": 60})
            },
            "spec.ingress[1].protocols[0].udp.destinationPort.range",
            ClusterConsequence::ProtocolDropped("spec.ingress[1]".into()),
            |p| p.ingress[1].ports == vec![ClusterPort::Named("http".into())] && p.ingress[1].peers.len() == 2,
        ),
        (
            "range start > end in a Deny rule",
            |v| {
                v["spec"]["ingress"][0]["protocols"][0] =
                    json!({"tcp": {"destinationPort": {"range": {"start": 90, "end": 80}}}})
            },
            "spec.ingress[0].protocols[0].tcp.destinationPort.range",
            ClusterConsequence::DenyAllTraffic("spec.ingress[0]".into()),
            |p| p.ingress[0].ports.is_empty() && p.ingress[0].action == TierAction::Deny,
        ),
        (
            "range end out of range",
            |v| v["spec"]["ingress"][1]["protocols"][0]["udp"]["destinationPort"]["range"]["end"] = json!(70000),
            "spec.ingress[1].protocols[0].udp.destinationPort.range.end",
            ClusterConsequence::ProtocolDropped("spec.ingress[1]".into()),
            |p| p.ingress[1].ports.len() == 1,
        ),
        (
            "port number 0",
            |v| v["spec"]["ingress"][0]["protocols"][0]["tcp"]["destinationPort"]["number"] = json!(0),
            "spec.ingress[0].protocols[0].tcp.destinationPort.number",
            ClusterConsequence::DenyAllTraffic("spec.ingress[0]".into()),
            |p| p.ingress[0].ports.is_empty(),
        ),
        (
            "number and range",
            |v| {
                v["spec"]["ingress"][0]["protocols"][0]["tcp"]["destinationPort"]["range"] =
                    json!({"start": 1, "end": 2})
            },
            "spec.ingress[0].protocols[0].tcp.destinationPort",
            ClusterConsequence::DenyAllTraffic("spec.ingress[0]".into()),
            |p| p.ingress[0].ports.is_empty(),
        ),
        (
            "tcp without destinationPort",
            |v| v["spec"]["ingress"][0]["protocols"][0] = json!({"tcp": {}}),
            "spec.ingress[0].protocols[0].tcp.destinationPort",
            ClusterConsequence::DenyAllTraffic("spec.ingress[0]".into()),
            |p| p.ingress[0].ports.is_empty(),
        ),
        (
            "protocol with two fields",
            |v| v["spec"]["ingress"][1]["protocols"][1]["tcp"] = json!({"destinationPort": {"number": 1}}),
            "spec.ingress[1].protocols[1]",
            ClusterConsequence::ProtocolDropped("spec.ingress[1]".into()),
            |p| p.ingress[1].ports.len() == 1,
        ),
        (
            "every protocol of an Accept rule unknown",
            |v| v["spec"]["ingress"][1]["protocols"] = json!([{"icmp": {"type": 8}}]),
            "spec.ingress[1].protocols[0]",
            ClusterConsequence::RuleMatchesNothing("spec.ingress[1]".into()),
            |p| p.ingress[1].peers.is_empty(),
        ),
        (
            "bad named port",
            |v| v["spec"]["ingress"][1]["protocols"][1]["destinationNamedPort"] = json!("HTTP_"),
            "spec.ingress[1].protocols[1].destinationNamedPort",
            ClusterConsequence::ProtocolDropped("spec.ingress[1]".into()),
            |p| p.ingress[1].ports.len() == 1,
        ),
        (
            "subject with both fields",
            |v| v["spec"]["subject"]["pods"] = json!({"podSelector": {}}),
            "spec.subject",
            ClusterConsequence::SelectsNothing,
            |p| p.subject == Subject::Namespaces(Selector::nothing()),
        ),
        (
            "subject with no field",
            |v| v["spec"]["subject"] = json!({}),
            "spec.subject",
            ClusterConsequence::SelectsNothing,
            |p| p.subject == Subject::Namespaces(Selector::nothing()),
        ),
        (
            "subject with only a newer field",
            |v| v["spec"]["subject"] = json!({"serviceAccounts": {"name": "x"}}),
            "spec.subject",
            ClusterConsequence::SelectsNothing,
            |p| p.subject == Subject::Namespaces(Selector::nothing()),
        ),
        (
            "subject selector with a bad operator",
            |v| v["spec"]["subject"] = json!({"pods": {"namespaceSelector": {"matchExpressions": [{"key": "a", "operator": "Near"}]}, "podSelector": {}}}),
            "spec.subject.pods.namespaceSelector.matchExpressions[0].operator",
            ClusterConsequence::SelectsNothing,
            |p| p.subject == Subject::Namespaces(Selector::nothing()),
        ),
        (
            "peer with no field in an Accept rule",
            |v| v["spec"]["ingress"][1]["from"][1] = json!({"serviceAccounts": {}}),
            "spec.ingress[1].from[1]",
            ClusterConsequence::PeerMatchesNothing("spec.ingress[1].from[1]".into()),
            |p| p.ingress[1].peers.len() == 1 && p.ingress[1].action == TierAction::Accept,
        ),
        (
            "every peer of an Accept rule unknown",
            |v| v["spec"]["egress"][1]["to"][0] = json!({}),
            "spec.egress[1].to[0]",
            ClusterConsequence::PeerMatchesNothing("spec.egress[1].to[0]".into()),
            |p| p.egress[1].peers.is_empty(),
        ),
        (
            "peer with no field in a Deny rule",
            |v| v["spec"]["ingress"][0]["from"][0] = json!({}),
            "spec.ingress[0].from[0]",
            ClusterConsequence::DenyEveryPeer("spec.ingress[0]".into()),
            |p| p.ingress[0].peers == vec![ClusterPeer::All] && p.ingress[0].ports.len() == 1,
        ),
        (
            "peer with no field in a Pass rule",
            |v| v["spec"]["ingress"][2]["from"][0] = json!({"future": 1}),
            "spec.ingress[2].from[0]",
            ClusterConsequence::DenyEveryPeer("spec.ingress[2]".into()),
            |p| p.ingress[2].peers == vec![ClusterPeer::All] && p.ingress[2].action == TierAction::Deny,
        ),
        (
            "ingress peer with networks (an egress-only field)",
            |v| v["spec"]["ingress"][0]["from"][0] = json!({"networks": ["10.0.0.0/8"]}),
            "spec.ingress[0].from[0]",
            ClusterConsequence::DenyEveryPeer("spec.ingress[0]".into()),
            |p| p.ingress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "peer with two fields in a Deny rule",
            |v| v["spec"]["ingress"][0]["from"][0]["pods"] = json!({"podSelector": {}}),
            "spec.ingress[0].from[0]",
            ClusterConsequence::DenyEveryPeer("spec.ingress[0]".into()),
            |p| p.ingress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "peer with a bad selector in a Deny rule",
            |v| {
                v["spec"]["ingress"][0]["from"][0]["namespaces"] =
                    json!({"matchExpressions": [{"key": "a", "operator": "In"}]})
            },
            "spec.ingress[0].from[0].namespaces.matchExpressions[0].values",
            ClusterConsequence::DenyEveryPeer("spec.ingress[0]".into()),
            |p| p.ingress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "nodes peer (experimental) with a bad selector in a Deny rule",
            |v| {
                v["spec"]["egress"][0]["to"][0] =
                    json!({"nodes": {"matchExpressions": [{"key": "a", "operator": "In"}]}})
            },
            "spec.egress[0].to[0].nodes.matchExpressions[0].values",
            ClusterConsequence::DenyEveryPeer("spec.egress[0]".into()),
            |p| p.egress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "domainNames peer (experimental) with a name the API's pattern refuses, in an Accept rule",
            |v| v["spec"]["egress"][1]["to"][0] = json!({"domainNames": ["*.example.com", "www.*.example.com"]}),
            "spec.egress[1].to[0].domainNames[1]",
            ClusterConsequence::PeerMatchesNothing("spec.egress[1].to[0]".into()),
            |p| p.egress[1].peers.is_empty(),
        ),
        (
            "domainNames peer (experimental) in a Deny rule (Accept only)",
            |v| v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["*.example.com"]}),
            "spec.egress[0].to[0].domainNames",
            ClusterConsequence::DenyEveryPeer("spec.egress[0]".into()),
            |p| p.egress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "domainNames peer in an Accept rule of the Baseline tier (NPEP-133: Admin tier only)",
            |v| {
                v["spec"]["tier"] = json!("Baseline");
                v["spec"]["egress"][1]["to"][0] = json!({"domainNames": ["*.example.com"]});
            },
            "spec.egress[1].to[0].domainNames",
            ClusterConsequence::PeerMatchesNothing("spec.egress[1].to[0]".into()),
            |p| p.tier == Tier::Baseline && p.egress[1].action == TierAction::Accept && p.egress[1].peers.is_empty(),
        ),
        (
            "Baseline domainNames peer beside a pods peer: only the domainNames peer matches nothing",
            |v| {
                v["spec"]["tier"] = json!("Baseline");
                v["spec"]["egress"][1]["to"]
                    .as_array_mut()
                    .unwrap()
                    .push(json!({"domainNames": ["www.example.com"]}));
            },
            "spec.egress[1].to[1].domainNames",
            ClusterConsequence::PeerMatchesNothing("spec.egress[1].to[1]".into()),
            |p| p.egress[1].peers.len() == 1 && matches!(p.egress[1].peers[0], ClusterPeer::Pods { .. }),
        ),
        (
            "Baseline domainNames peer in a Deny rule",
            |v| {
                v["spec"]["tier"] = json!("Baseline");
                v["spec"]["egress"][0]["to"][0] = json!({"domainNames": ["*.example.com"]});
            },
            "spec.egress[0].to[0].domainNames",
            ClusterConsequence::DenyEveryPeer("spec.egress[0]".into()),
            |p| p.egress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "bad CIDR",
            |v| v["spec"]["egress"][0]["to"][0]["networks"][1] = json!("10.0.0.0/33"),
            "spec.egress[0].to[0].networks[1]",
            ClusterConsequence::DenyEveryPeer("spec.egress[0]".into()),
            |p| p.egress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "empty networks",
            |v| v["spec"]["egress"][0]["to"][0]["networks"] = json!([]),
            "spec.egress[0].to[0].networks",
            ClusterConsequence::DenyEveryPeer("spec.egress[0]".into()),
            |p| p.egress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "empty from in an Accept rule",
            |v| v["spec"]["ingress"][1]["from"] = json!([]),
            "spec.ingress[1].from",
            ClusterConsequence::RuleMatchesNothing("spec.ingress[1]".into()),
            |p| p.ingress[1].peers.is_empty(),
        ),
        (
            "missing to in a Deny rule",
            |v| {
                v["spec"]["egress"][0].as_object_mut().unwrap().remove("to");
            },
            "spec.egress[0].to",
            ClusterConsequence::DenyEveryPeer("spec.egress[0]".into()),
            |p| p.egress[0].peers == vec![ClusterPeer::All],
        ),
        (
            "unknown action",
            |v| v["spec"]["ingress"][1]["action"] = json!("Log"),
            "spec.ingress[1].action",
            ClusterConsequence::Deny("spec.ingress[1]".into()),
            |p| {
                p.ingress[1].action == TierAction::Deny
                    && p.ingress[1].peers.len() == 2
                    && p.ingress[1].ports.len() == 2
            },
        ),
        (
            "missing action",
            |v| {
                v["spec"]["ingress"][2].as_object_mut().unwrap().remove("action");
            },
            "spec.ingress[2].action",
            ClusterConsequence::Deny("spec.ingress[2]".into()),
            |p| p.ingress[2].action == TierAction::Deny,
        ),
        (
            "rule name over 100 characters",
            |v| v["spec"]["ingress"][0]["name"] = json!("n".repeat(101)),
            "spec.ingress[0].name",
            ClusterConsequence::Reported,
            |p| p.ingress[0].action == TierAction::Deny && p.ingress[0].peers.len() == 1,
        ),
        (
            "26 rules",
            |v| {
                let r = v["spec"]["egress"][0].clone();
                v["spec"]["egress"] = Value::Array(vec![r; 26]);
            },
            "spec.egress",
            ClusterConsequence::Reported,
            |p| p.egress.len() == 26,
        ),
        (
            "networks with a named port",
            |v| v["spec"]["egress"][0]["protocols"] = json!([{"destinationNamedPort": "http"}]),
            "spec.egress[0]",
            ClusterConsequence::Reported,
            |p| p.egress[0].ports == vec![ClusterPort::Named("http".into())],
        ),
        (
            "empty name",
            |v| v["metadata"]["name"] = json!(""),
            "metadata.name",
            ClusterConsequence::Reported,
            |p| p.name.is_empty(),
        ),
    ];
    for (what, tweak, field, consequence, check) in table {
        let mut v = base();
        tweak(&mut v);
        let c = convert_cluster_policy_value(&v).unwrap_or_else(|e| panic!("{what}: {e}"));
        let e = c
            .problems
            .iter()
            .find(|e| e.field == field)
            .unwrap_or_else(|| panic!("{what}: no error at {field}: {:#?}", c.problems));
        assert_eq!(e.consequence, consequence, "{what}: {e}");
        assert!(e.to_string().starts_with("clusternetworkpolicy "), "{what}: {e}");
        assert!(check(&c.policy), "{what}: {:#?}", c.policy);
        let report = c.invalid().expect("reported");
        assert_eq!(report.namespace, "");
        assert!(report.errors.iter().any(|m| m.contains(field)), "{what}: {report:?}");
    }
}

/// NPEP-133: `domainNames` stays valid in an Accept rule of the Admin
/// tier (the table above has the Baseline tier refusing it).
#[test]
fn admin_accept_domain_names_are_valid() {
    let mut v = base();
    v["spec"]["egress"][1]["to"]
        .as_array_mut()
        .unwrap()
        .push(json!({"domainNames": ["*.example.com", "www.example.org"]}));
    let c = convert_cluster_policy_value(&v).unwrap();
    assert!(c.problems.is_empty(), "{:#?}", c.problems);
    assert!(c.invalid().is_none());
    assert!(
        matches!(&c.policy.egress[1].peers[1], ClusterPeer::DomainNames(names) if names.len() == 2),
        "{:#?}",
        c.policy.egress[1]
    );
}

#[test]
fn parse_errors_and_yaml() {
    let mut v = base();
    v["kind"] = json!("NetworkPolicy");
    assert!(matches!(
        cluster_policy_from_value(&v),
        Err(ClusterParseError::WrongKind { .. })
    ));
    let mut v = base();
    v["spec"]["priority"] = json!("high");
    let e = cluster_policy_from_value(&v).unwrap_err();
    assert!(e.to_string().contains("\"cnp\""), "{e}");
    let yaml = r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata:
  name: deny-metadata
spec:
  tier: Admin
  priority: 0
  subject:
    namespaces: {}
  egress:
  - name: metadata
    action: Deny
    to:
    - networks: ["169.254.169.254/32"]
"#;
    let c = convert_cluster_policy_yaml(yaml).unwrap();
    assert!(c.problems.is_empty(), "{:?}", c.problems);
    assert_eq!(
        c.policy.egress[0].peers,
        vec![ClusterPeer::Networks(vec!["169.254.169.254/32".parse().unwrap()])]
    );
    // Serializes back with the upstream names.
    let obj = cluster_policy_from_value(&serde_yaml::from_str::<Value>(yaml).unwrap()).unwrap();
    let back = serde_json::to_value(&obj).unwrap();
    assert_eq!(
        back["spec"]["egress"][0]["to"][0]["networks"][0],
        json!("169.254.169.254/32")
    );
    assert_eq!(back["apiVersion"], json!("policy.networking.k8s.io/v1alpha2"));
    // The snapshot keeps the report with the policy and forgets it on
    // replace and remove.
    let mut s = npm_policy::model::Snapshot::default();
    let mut bad = obj.clone();
    bad.spec.tier = "Nope".into();
    assert!(s.upsert_cluster_policy(&bad).is_err());
    assert_eq!(s.invalid_cluster_policies.len(), 1);
    assert!(s.upsert_cluster_policy(&obj).is_ok());
    assert!(s.invalid_cluster_policies.is_empty() && s.cluster_policies.len() == 1);
    assert!(s.upsert_cluster_policy(&bad).is_err());
    s.remove_cluster_policy("deny-metadata");
    assert!(s.invalid_cluster_policies.is_empty() && s.cluster_policies.is_empty());
}

#[test]
fn yaml_files_load_cluster_policies() {
    let text = r#"
apiVersion: v1
kind: Namespace
metadata: {name: x}
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: a}
spec: {tier: Baseline, priority: 3, subject: {namespaces: {}}, ingress: [{action: Deny, from: [{namespaces: {}}]}]}
"#;
    let objs = npm_policy::convert::load_yaml(text).unwrap();
    assert_eq!((objs.namespaces.len(), objs.cluster_policies.len()), (1, 1));
    let mut s = npm_policy::model::Snapshot::default();
    s.upsert_cluster_policy(&objs.cluster_policies[0]).unwrap();
    assert_eq!(s.cluster_policies["a"].tier, Tier::Baseline);
}

/// A new version whose subject is not understood (an unknown selector
/// operator here) keeps the last version whose subject was understood
/// enforced, rules included, on the full and the incremental path, and
/// says so in its report; a fixed version replaces it; a policy that never
/// had an understood subject selects no pod and is reported as such.
#[test]
fn a_subject_not_understood_keeps_the_last_valid_version() {
    use npm_policy::compiled::CompileOptions;
    use npm_policy::incremental::Compiler;
    use npm_policy::model::Snapshot;
    let v1 = cluster_policy_from_value(&base()).unwrap();
    let mut broken = base();
    broken["spec"]["subject"] =
        json!({"namespaces": {"matchExpressions": [{"key": "ns", "operator": "Typo", "values": ["x"]}]}});
    // The broken version also turns the Deny into an Accept: not applied.
    broken["spec"]["ingress"][0]["action"] = json!("Accept");
    let v2 = cluster_policy_from_value(&broken).unwrap();
    let mut fixed = base();
    fixed["spec"]["subject"] = json!({"namespaces": {"matchLabels": {"ns": "w"}}});
    let v3 = cluster_policy_from_value(&fixed).unwrap();

    let mut s = Snapshot::default();
    s.upsert_cluster_policy(&v1).unwrap();
    let kept = s.cluster_policies["cnp"].clone();
    assert_eq!(kept.subject, Subject::Namespaces(sel("ns", "x")));
    for _ in 0..2 {
        let err = s.upsert_cluster_policy(&v2).unwrap_err();
        assert_eq!(s.cluster_policies["cnp"], kept, "the last valid version stays");
        assert!(
            err.errors
                .iter()
                .any(|e| e.contains("spec.subject") && e.contains("stays enforced")),
            "{err:?}"
        );
        assert_eq!(s.invalid_cluster_policies.len(), 1);
    }
    s.upsert_cluster_policy(&v3).unwrap();
    assert_eq!(s.cluster_policies["cnp"].subject, Subject::Namespaces(sel("ns", "w")));
    assert!(s.invalid_cluster_policies.is_empty());

    // Never understood: selects no pod, reported.
    let mut fresh = Snapshot::default();
    let err = fresh.upsert_cluster_policy(&v2).unwrap_err();
    assert_eq!(
        fresh.cluster_policies["cnp"].subject,
        Subject::Namespaces(Selector::nothing())
    );
    assert!(err.errors.iter().any(|e| e.contains("selects no pod")), "{err:?}");

    // The incremental compiler, over the upstream x/y/z pods, keeps the
    // same version: its tier entries are those of v1 (namespace x's pods,
    // the Deny from y), as a full compile of the snapshot holding v1.
    let pods = npm_sim::cases::Model::upstream().snapshot;
    let opts: CompileOptions = npm_sim::cases::Model::options();
    let mut c = Compiler::new(pods.clone(), opts.clone(), None);
    c.apply_cluster_policy(&v1).unwrap();
    // The decisions (entry, action, rank); rule numbers are handed out
    // anew when a version replaces another.
    let decisions = |t: &std::collections::BTreeMap<
        npm_policy::compiled::TierEntry,
        npm_policy::compiled::TierValue,
    >| { t.iter().map(|(e, v)| (*e, v.action, v.rank)).collect::<Vec<_>>() };
    let with_v1 = decisions(&c.compiled().tiers);
    assert!(!with_v1.is_empty(), "v1 selects namespace x's pods");
    assert!(c.apply_cluster_policy(&v2).is_err());
    assert_eq!(c.snapshot().cluster_policies["cnp"], kept);
    assert_eq!(decisions(&c.compiled().tiers), with_v1, "the tier entries are v1's");
    let mut only_v1 = pods;
    only_v1.upsert_cluster_policy(&v1).unwrap();
    assert_eq!(
        with_v1,
        decisions(&npm_policy::compile(&only_v1, &opts, Some(c.compiled())).tiers)
    );
}
