//! Audit mode: a NetworkPolicy annotated
//! `npm.io/audit: "true"` is never enforced, and what it would deny is
//! exactly what the reference evaluator denies once it is enforced.
//!
//! - the full and the incremental compile of a state with an audited
//!   policy equal the compile of the same state without it (switching a
//!   policy between audited and enforced, both ways, incrementally);
//! - a bad annotation value is reported and the policy enforced;
//! - `AuditView::would_deny`, over every pod pair, direction and port of
//!   a table of policy sets, equals (compiled lookup on the enforced state
//!   allows) and (compiled lookup on the state with the audited policies
//!   enforced, annotation removed, denies), and the reference evaluator on
//!   both; it names exactly the audited policies selecting the pod.

use std::collections::BTreeMap;
use std::net::IpAddr;

use k8s_openapi::api::networking::v1::NetworkPolicy;
use npm_policy::audit::{audited_policies, is_enforced_form, AuditView, AUDIT_ANNOTATION};
use npm_policy::compiled::{CompileOptions, Compiled, Direction};
use npm_policy::evaluate::evaluate_direction;
use npm_policy::incremental::Compiler;
use npm_policy::lookup::lookup;
use npm_policy::model::*;
use serde_json::{json, Value};

/// (namespace, name, app label, address); every pod is on this node.
const PODS: &[(&str, &str, &str, &str)] = &[
    ("ns1", "web", "web", "10.0.0.1"),
    ("ns1", "db", "db", "10.0.0.2"),
    ("ns1", "client", "client", "10.0.0.3"),
    ("ns2", "far", "client", "10.0.1.1"),
];
const NODE_IP: &str = "10.9.9.9";
const EXT: &str = "192.168.5.5";
const PORTS: &[u16] = &[80, 5432];

fn opts() -> CompileOptions {
    CompileOptions {
        node_name: "node".into(),
        node_ips: vec![NODE_IP.parse().unwrap()],
        allow_host_egress: false,
        report_new: false,
    }
}

fn base() -> Snapshot {
    let mut s = Snapshot::default();
    for ns in ["ns1", "ns2"] {
        s.upsert_namespace(Namespace {
            name: ns.into(),
            labels: [("kubernetes.io/metadata.name".to_string(), ns.to_string())].into(),
        });
    }
    for (ns, name, app, ip) in PODS {
        s.upsert_pod(npm_testkit::policy::pod(ns, name, ip, app, "node"));
    }
    s
}

/// A NetworkPolicy in `ns1` with `spec` and, when given, the audit
/// annotation value.
fn np(name: &str, audit: Option<&str>, spec: Value) -> NetworkPolicy {
    let mut meta = json!({"name": name, "namespace": "ns1"});
    if let Some(v) = audit {
        meta["annotations"] = json!({ AUDIT_ANNOTATION: v, "other": "x" });
    }
    serde_json::from_value(json!({"metadata": meta, "spec": spec})).unwrap()
}

fn without_annotation(p: &NetworkPolicy) -> NetworkPolicy {
    let mut p = p.clone();
    p.metadata.annotations = None;
    p
}

fn deny_all_ingress(app: &str) -> Value {
    json!({"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"]})
}

fn allow_from(app: &str, from: &str, port: u16) -> Value {
    json!({"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Ingress"],
           "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": from}}}],
                        "ports": [{"port": port}]}]})
}

fn deny_all_egress(app: &str) -> Value {
    json!({"podSelector": {"matchLabels": {"app": app}}, "policyTypes": ["Egress"]})
}

fn snapshot_of(policies: &[NetworkPolicy]) -> Snapshot {
    let mut s = base();
    for p in policies {
        let _ = s.upsert_policy(p);
    }
    s
}

/// The policy sets of the table: (name, policies). Audited ones carry
/// the annotation.
fn cases() -> Vec<(&'static str, Vec<NetworkPolicy>)> {
    vec![
        (
            "audited deny-all on web",
            vec![np("a-deny", Some("true"), deny_all_ingress("web"))],
        ),
        (
            "audited allow client:80 on web",
            vec![np("a-allow", Some("true"), allow_from("web", "client", 80))],
        ),
        (
            "enforced allow client:80 + audited deny-all on web",
            vec![
                np("e-allow", None, allow_from("web", "client", 80)),
                np("a-deny", Some("true"), deny_all_ingress("web")),
            ],
        ),
        (
            "two audited on web, one enforced on db",
            vec![
                np("a-deny", Some("true"), deny_all_ingress("web")),
                np("a-allow", Some("true"), allow_from("web", "db", 5432)),
                np("e-db", None, allow_from("db", "web", 5432)),
            ],
        ),
        (
            "audited egress deny-all on client, audited false on db",
            vec![
                np("a-egress", Some("true"), deny_all_egress("client")),
                np("f-db", Some("false"), deny_all_ingress("db")),
            ],
        ),
    ]
}

fn endpoint_of(c: &Compiled, pod: &str) -> u32 {
    *c.endpoints.iter().find(|(_, e)| e.pod.name == pod).unwrap().0
}

#[test]
fn an_audited_policy_is_never_compiled() {
    for (case, policies) in cases() {
        let with = snapshot_of(&policies);
        let enforced_only: Vec<NetworkPolicy> = policies
            .iter()
            .filter(|p| audit_value(p) != Some("true"))
            .cloned()
            .collect();
        let without = snapshot_of(&enforced_only);
        let full = npm_policy::compile(&with, &opts(), None);
        let reference = npm_policy::compile(&without, &opts(), None);
        assert!(reference.diff(&full).is_empty(), "{case}: full compile");
        for (k, p) in &with.policies {
            let audited = policies
                .iter()
                .any(|n| n.metadata.name.as_deref() == Some(&k.1) && audit_value(n) == Some("true"));
            assert_eq!(is_enforced_form(p), audited, "{case}: {k:?}");
        }
        // Incrementally: start without policies, add each; then switch
        // every policy to the other mode and back.
        let mut c = Compiler::new(base(), opts(), None);
        for p in &policies {
            let _ = c.apply_policy(p);
        }
        assert!(c.compiled().diff(&full).is_empty(), "{case}: incremental");
        for p in &policies {
            let flipped = flip(p);
            let _ = c.apply_policy(&flipped);
        }
        let flipped: Vec<NetworkPolicy> = policies.iter().map(flip).collect();
        let full_flipped = npm_policy::compile(&snapshot_of(&flipped), &opts(), Some(c.compiled()));
        assert!(c.compiled().diff(&full_flipped).is_empty(), "{case}: flipped");
        for p in &policies {
            let _ = c.apply_policy(p);
        }
        assert!(
            c.compiled()
                .diff(&npm_policy::compile(&with, &opts(), Some(c.compiled())))
                .is_empty(),
            "{case}: flipped back"
        );
    }
}

fn audit_value(p: &NetworkPolicy) -> Option<&str> {
    p.metadata
        .annotations
        .as_ref()?
        .get(AUDIT_ANNOTATION)
        .map(String::as_str)
}

/// The same policy in the other mode.
fn flip(p: &NetworkPolicy) -> NetworkPolicy {
    let mut p = p.clone();
    let audited = audit_value(&p) == Some("true");
    p.metadata
        .annotations
        .get_or_insert_with(BTreeMap::new)
        .insert(AUDIT_ANNOTATION.into(), if audited { "false" } else { "true" }.into());
    p
}

#[test]
fn a_bad_annotation_is_reported_and_enforced() {
    for bad in ["True", "yes", "", "1"] {
        let p = np("typo", Some(bad), deny_all_ingress("web"));
        let mut s = base();
        let err = s.upsert_policy(&p).expect_err("reported");
        assert_eq!(err.errors.len(), 1, "{err:?}");
        let e = &err.errors[0];
        assert!(e.contains("metadata.annotations[\"npm.io/audit\"]"), "{e}");
        assert!(e.contains(&format!("{bad:?}")), "{e}");
        assert!(e.contains("enforced"), "{e}");
        assert!(audited_policies([&p]).is_empty());
        let c = npm_policy::compile(&s, &opts(), None);
        let web = endpoint_of(&c, "web");
        assert!(c.endpoints[&web].isolated_ingress, "{bad:?}: enforced");
        let client: IpAddr = "10.0.0.3".parse().unwrap();
        assert!(!lookup(&c, web, Direction::Ingress, client, 6, 80).allowed);
        // The incremental compiler reports and enforces it too.
        let mut inc = Compiler::new(base(), opts(), None);
        assert!(inc.apply_policy(&p).is_err());
        assert!(inc.compiled().diff(&c).is_empty());
    }
}

fn ip(name: &str) -> IpAddr {
    match name {
        "node" => NODE_IP.parse().unwrap(),
        "ext" => EXT.parse().unwrap(),
        _ => PODS.iter().find(|p| p.1 == name).unwrap().3.parse().unwrap(),
    }
}

#[test]
fn would_deny_matches_the_reference_evaluator_and_the_compiled_lookup() {
    let o = opts();
    let mut would_denies = 0;
    let mut checked = 0;
    for (case, policies) in cases() {
        let enforced = snapshot_of(&policies);
        let audited = audited_policies(&policies);
        let view = AuditView::new(&enforced, &o, audited.clone());
        // The audited policies enforced: the annotation removed.
        let enforcing: Vec<NetworkPolicy> = policies.iter().map(without_annotation).collect();
        let merged = snapshot_of(&enforcing);
        let c_enforced = npm_policy::compile(&enforced, &o, None);
        let c_merged = npm_policy::compile(&merged, &o, None);
        for (ns, pod, _, _) in PODS {
            let key = (ns.to_string(), pod.to_string());
            let p = &enforced.pods[&key];
            let (ep_e, ep_m) = (endpoint_of(&c_enforced, pod), endpoint_of(&c_merged, pod));
            for peer in PODS.iter().map(|p| p.1).chain(["node", "ext"]) {
                if peer == *pod {
                    continue;
                }
                for dir in [Direction::Ingress, Direction::Egress] {
                    for &port in PORTS {
                        checked += 1;
                        let got = view.would_deny(&enforced, &o, &key, dir, ip(peer), 6, port);
                        let before = lookup(&c_enforced, ep_e, dir, ip(peer), 6, port).allowed;
                        let after = lookup(&c_merged, ep_m, dir, ip(peer), 6, port).allowed;
                        let ref_before = evaluate_direction(&enforced, &o, p, dir, ip(peer), 6, port).allowed;
                        let ref_after = evaluate_direction(&merged, &o, p, dir, ip(peer), 6, port).allowed;
                        let what = format!("{case}: {pod} {} {peer}:{port}", dir.name());
                        assert_eq!(
                            (before, after),
                            (ref_before, ref_after),
                            "{what}: compiled vs reference"
                        );
                        assert_eq!(got.is_some(), before && !after, "{what}: {got:?}");
                        if let Some(w) = got {
                            would_denies += 1;
                            let want: Vec<(String, String)> = audited
                                .iter()
                                .filter(|(_, a)| match dir {
                                    Direction::Ingress => a.ingress_isolation,
                                    Direction::Egress => a.egress_isolation,
                                })
                                .filter(|(_, a)| npm_policy::compile::policy_selects(a, p))
                                .map(|(k, _)| k.clone())
                                .collect();
                            assert_eq!(w.policies, want, "{what}");
                            assert!(!w.policies.is_empty(), "{what}");
                            assert_eq!(w.direction, dir);
                        }
                    }
                }
            }
        }
    }
    // The table exercises both outcomes.
    assert!(would_denies >= 10, "{would_denies} of {checked}");
    assert!(checked > 200);
}

#[test]
fn the_table_says_what_each_audited_policy_would_deny() {
    let o = opts();
    let policies = &cases()[2].1; // enforced allow client:80 + audited deny-all on web
    let enforced = snapshot_of(policies);
    let view = AuditView::new(&enforced, &o, audited_policies(policies));
    let web = ("ns1".to_string(), "web".to_string());
    let wd = |peer: &str, port| view.would_deny(&enforced, &o, &web, Direction::Ingress, ip(peer), 6, port);
    // web is isolated by the enforced policy: the audited one changes
    // nothing (union), and what the enforced one denies is no event.
    assert_eq!(wd("client", 80), None);
    assert_eq!(wd("db", 80), None);
    let policies = &cases()[0].1; // audited deny-all on web
    let enforced = snapshot_of(policies);
    let view = AuditView::new(&enforced, &o, audited_policies(policies));
    let wd = |peer: &str, port| view.would_deny(&enforced, &o, &web, Direction::Ingress, ip(peer), 6, port);
    let w = wd("client", 80).expect("would deny");
    assert_eq!(w.policies, vec![("ns1".to_string(), "a-deny".to_string())]);
    assert!(w.enforced.allowed && !w.audited.allowed);
    assert!(wd("far", 5432).is_some());
    assert!(wd("ext", 80).is_some());
    // Ingress from the node is always allowed; egress is not audited.
    assert_eq!(wd("node", 80), None);
    assert_eq!(
        view.would_deny(&enforced, &o, &web, Direction::Egress, ip("db"), 6, 80),
        None
    );
}
