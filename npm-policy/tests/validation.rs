//! Validation table: each invalid form gives an error naming the object and
//! the field path; the other policies still compile. Also defaulting. What
//! is enforced of an invalid policy: tests/invalid_fail_closed.rs.

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::model::{PortSpec, Protocol, Snapshot};
use npm_policy::validate::validate_policy;

fn base() -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "np", "namespace": "ns1"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [{
                "from": [{"podSelector": {}}, {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}}],
                "ports": [{"port": 80}]
            }]
        }
    })
}

fn np(v: serde_json::Value) -> NetworkPolicy {
    serde_json::from_value(v).unwrap()
}

#[test]
fn invalid_forms() {
    type Tweak = fn(&mut serde_json::Value);
    let table: Vec<(&str, Tweak, &str)> = vec![
        (
            "bad cidr",
            |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["cidr"] = "10.0.0.0/33".into(),
            "spec.ingress[0].from[1].ipBlock.cidr",
        ),
        (
            "bad except",
            |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"][0] = "nope".into(),
            "spec.ingress[0].from[1].ipBlock.except[0]",
        ),
        (
            "except outside cidr",
            |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"][0] = "192.168.0.0/16".into(),
            "spec.ingress[0].from[1].ipBlock.except[0]",
        ),
        (
            "except equal to cidr",
            |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"][0] = "10.0.0.0/8".into(),
            "spec.ingress[0].from[1].ipBlock.except[0]",
        ),
        (
            "except other family",
            |v| v["spec"]["ingress"][0]["from"][1]["ipBlock"]["except"][0] = "fd00::/64".into(),
            "spec.ingress[0].from[1].ipBlock.except[0]",
        ),
        (
            "endPort < port",
            |v| v["spec"]["ingress"][0]["ports"][0]["endPort"] = 79.into(),
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            "endPort with named port",
            |v| v["spec"]["ingress"][0]["ports"][0] = serde_json::json!({"port": "http", "endPort": 90}),
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            "endPort without port",
            |v| v["spec"]["ingress"][0]["ports"][0] = serde_json::json!({"endPort": 90}),
            "spec.ingress[0].ports[0].endPort",
        ),
        (
            "unknown protocol",
            |v| v["spec"]["ingress"][0]["ports"][0]["protocol"] = "ICMP".into(),
            "spec.ingress[0].ports[0].protocol",
        ),
        (
            "port 0",
            |v| v["spec"]["ingress"][0]["ports"][0]["port"] = 0.into(),
            "spec.ingress[0].ports[0].port",
        ),
        (
            "port 65536",
            |v| v["spec"]["ingress"][0]["ports"][0]["port"] = 65536.into(),
            "spec.ingress[0].ports[0].port",
        ),
        (
            "bad port name",
            |v| v["spec"]["ingress"][0]["ports"][0]["port"] = "Not_A_Name".into(),
            "spec.ingress[0].ports[0].port",
        ),
        (
            "port name too long",
            |v| v["spec"]["ingress"][0]["ports"][0]["port"] = "abcdefghijklmnop".into(),
            "spec.ingress[0].ports[0].port",
        ),
        (
            "bad operator",
            |v| {
                v["spec"]["podSelector"] =
                    serde_json::json!({"matchExpressions": [{"key": "a", "operator": "Like", "values": ["b"]}]})
            },
            "spec.podSelector.matchExpressions[0].operator",
        ),
        (
            "In without values",
            |v| {
                v["spec"]["ingress"][0]["from"][0]["podSelector"] =
                    serde_json::json!({"matchExpressions": [{"key": "a", "operator": "In", "values": []}]})
            },
            "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
        ),
        (
            "NotIn without values",
            |v| {
                v["spec"]["ingress"][0]["from"][0]["podSelector"] =
                    serde_json::json!({"matchExpressions": [{"key": "a", "operator": "NotIn"}]})
            },
            "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
        ),
        (
            "Exists with values",
            |v| {
                v["spec"]["ingress"][0]["from"][0]["namespaceSelector"] =
                    serde_json::json!({"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]})
            },
            "spec.ingress[0].from[0].namespaceSelector.matchExpressions[0].values",
        ),
        (
            "empty peer",
            |v| v["spec"]["ingress"][0]["from"][0] = serde_json::json!({}),
            "spec.ingress[0].from[0]",
        ),
        (
            "ipBlock with selector",
            |v| v["spec"]["ingress"][0]["from"][1]["namespaceSelector"] = serde_json::json!({}),
            "spec.ingress[0].from[1]",
        ),
        (
            "bad policyType",
            |v| v["spec"]["policyTypes"] = serde_json::json!(["Ingress", "Sideways"]),
            "spec.policyTypes[1]",
        ),
        (
            "three policyTypes",
            |v| v["spec"]["policyTypes"] = serde_json::json!(["Ingress", "Egress", "Ingress"]),
            "spec.policyTypes",
        ),
        (
            "egress peer path",
            |v| {
                v["spec"]["egress"] =
                    serde_json::json!([{"to": [{"ipBlock": {"cidr": "10.0.0.0/8"}}, {"ipBlock": {"cidr": "x"}}]}])
            },
            "spec.egress[0].to[1].ipBlock.cidr",
        ),
    ];
    let good = np(base());
    let mut good2 = base();
    good2["metadata"]["name"] = "other".into();
    for (name, tweak, field) in table {
        let mut v = base();
        tweak(&mut v);
        let err = validate_policy(&np(v.clone())).expect_err(name);
        assert_eq!((err.namespace.as_str(), err.name.as_str()), ("ns1", "np"), "{name}");
        let prefix = format!("ns1/np: {field}: ");
        assert!(
            err.errors.iter().any(|e| e.starts_with(&prefix)),
            "{name}: want {prefix:?} in {:?}",
            err.errors
        );
        // The invalid policy is reported and kept as far as it is
        // understood (tests/invalid_fail_closed.rs); the others compile.
        let s = Snapshot::from_objects(&[], &[], &[np(v), np(good2.clone())]).unwrap();
        assert_eq!(s.invalid_policies.len(), 1, "{name}");
        assert!(s.policies.contains_key(&("ns1".into(), "np".into())), "{name}");
        assert!(s.policies.contains_key(&("ns1".into(), "other".into())), "{name}");
    }
    assert!(validate_policy(&good).is_ok());
}

#[test]
fn defaulting() {
    // No policyTypes, no egress: [Ingress].
    let p = validate_policy(&np(base())).unwrap();
    assert!(p.ingress_isolation && !p.egress_isolation);
    assert_eq!(p.ingress[0].ports[0].protocol, Protocol::Tcp);
    assert_eq!(p.ingress[0].ports[0].port, PortSpec::Range(80, 80));
    // egress: [] without policyTypes: not an egress policy.
    let mut v = base();
    v["spec"]["egress"] = serde_json::json!([]);
    let p = validate_policy(&np(v)).unwrap();
    assert!(p.ingress_isolation && !p.egress_isolation);
    // egress rules without policyTypes: [Ingress, Egress].
    let mut v = base();
    v["spec"]["egress"] = serde_json::json!([{}]);
    let p = validate_policy(&np(v)).unwrap();
    assert!(p.ingress_isolation && p.egress_isolation);
    // policyTypes as given.
    let mut v = base();
    v["spec"]["policyTypes"] = serde_json::json!(["Egress"]);
    let p = validate_policy(&np(v)).unwrap();
    assert!(!p.ingress_isolation && p.egress_isolation);
    // Host bits are cleared; IPv4-mapped IPv6 becomes IPv4; endPort range.
    let mut v = base();
    v["spec"]["ingress"][0]["from"][1]["ipBlock"] =
        serde_json::json!({"cidr": "::ffff:10.1.2.3/104", "except": ["10.9.9.9/16"]});
    v["spec"]["ingress"][0]["ports"][0] = serde_json::json!({"port": 80, "endPort": 90, "protocol": "SCTP"});
    let p = validate_policy(&np(v)).unwrap();
    match &p.ingress[0].peers[1] {
        npm_policy::model::Peer::IpBlock(b) => {
            assert_eq!(b.cidr.to_string(), "10.0.0.0/8");
            assert_eq!(b.except[0].to_string(), "10.9.0.0/16");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(p.ingress[0].ports[0].port, PortSpec::Range(80, 90));
    assert_eq!(p.ingress[0].ports[0].protocol, Protocol::Sctp);
}
