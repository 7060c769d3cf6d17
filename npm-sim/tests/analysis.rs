//! `npmctl lint`, `exposure` and `preview` (`npm_policy::analysis`): one
//! table per finding kind, each with a control that must not report it
//! (so a test fails when the analysis reports too little or too much), the
//! exposure and preview reports on the demo objects, the upstream CNP
//! conformance policy whose rules are deliberately shadowed, and the
//! `npmctl` binary end to end.

use std::path::PathBuf;
use std::process::Command;

use npm_policy::analysis::exposure::exposure;
use npm_policy::analysis::lint::{lint, Finding, Severity};
use npm_policy::analysis::preview::preview;
use npm_policy::model::Snapshot;
use npm_sim::analysis::parse_flow_records;
use npm_sim::cases::{parse_case_file, Action, Model};
use npm_sim::sim::{load_snapshot, sim_options};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn cluster_yaml() -> String {
    std::fs::read_to_string(root().join("examples/cluster.yaml")).unwrap()
}

/// The demo cluster (x, y, z with pods a, b, c) plus `extra`.
fn snapshot(extra: &str) -> Snapshot {
    load_snapshot(&[("cluster".into(), cluster_yaml()), ("extra".into(), extra.to_string())]).unwrap()
}

fn cnp(name: &str, tier: &str, priority: u32, subject_ns: &str, ingress: &str) -> String {
    format!(
        r#"
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {{name: {name}}}
spec:
  tier: {tier}
  priority: {priority}
  subject:
    namespaces:
      matchLabels: {{ns: {subject_ns}}}
  ingress:
{ingress}
"#
    )
}

/// An ingress rule from namespace `ns`, optionally on TCP `port`.
fn from_ns(name: &str, action: &str, ns: &str, port: Option<u16>) -> String {
    let mut s = format!(
        "  - name: {name}\n    action: {action}\n    from:\n    - namespaces:\n        matchLabels: {{ns: {ns}}}\n"
    );
    if let Some(p) = port {
        s.push_str(&format!(
            "    protocols:\n    - tcp:\n        destinationPort: {{number: {p}}}\n"
        ));
    }
    s
}

fn findings(extra: &str, kind: &str) -> Vec<Finding> {
    lint(&snapshot(extra), &sim_options())
        .into_iter()
        .filter(|f| f.kind == kind)
        .collect()
}

/// (severity, object) of the findings of `kind`.
fn objects(extra: &str, kind: &str) -> Vec<(Severity, String)> {
    findings(extra, kind)
        .into_iter()
        .map(|f| (f.severity, f.object))
        .collect()
}

#[test]
fn the_demo_objects_lint_clean() {
    for f in ["01-default-deny-ingress-x.yaml", "02-egress-only-dns-and-z.yaml"] {
        let extra = std::fs::read_to_string(root().join("examples").join(f)).unwrap();
        assert_eq!(lint(&snapshot(&extra), &sim_options()), vec![], "{f}");
    }
}

/// A table row: what, the extra objects, the (severity, object) wanted.
type Row<'a> = (&'a str, String, Vec<(Severity, &'a str)>);

#[test]
fn shadowed_rules() {
    let deny_then_accept = cnp(
        "a",
        "Admin",
        10,
        "x",
        &(from_ns("deny-y", "Deny", "y", None) + &from_ns("web-from-y", "Accept", "y", Some(80))),
    );
    let accept_then_deny = cnp(
        "a",
        "Admin",
        10,
        "x",
        &(from_ns("web-from-y", "Accept", "y", Some(80)) + &from_ns("deny-y", "Deny", "y", None)),
    );
    let higher_priority = cnp("hi", "Admin", 1, "x", &from_ns("deny-y", "Deny", "y", None))
        + &cnp("lo", "Admin", 5, "x", &from_ns("web-from-y", "Accept", "y", Some(80)));
    let redundant = cnp("hi", "Admin", 1, "x", &from_ns("deny-y", "Deny", "y", None))
        + &cnp("lo", "Admin", 5, "x", &from_ns("deny-y-80", "Deny", "y", Some(80)));
    let baseline_under_np = cnp("base", "Baseline", 10, "x", &from_ns("deny-y", "Deny", "y", None))
        + "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: all, namespace: x}\nspec: {podSelector: {}}\n";
    let baseline_partly = cnp("base", "Baseline", 10, "x", &from_ns("deny-y", "Deny", "y", None))
        + "---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {name: a-only, namespace: x}\nspec: {podSelector: {matchLabels: {pod: a}}}\n";
    let table: Vec<Row<'_>> = vec![
        (
            "an earlier Deny covers the Accept",
            deny_then_accept,
            vec![(Severity::Warning, r#"clusternetworkpolicy/a ingress[1] "web-from-y""#)],
        ),
        ("the narrow Accept first: both decide", accept_then_deny, vec![]),
        (
            "a higher-priority CNP covers it",
            higher_priority,
            vec![(Severity::Warning, r#"clusternetworkpolicy/lo ingress[0] "web-from-y""#)],
        ),
        (
            "covered with the same action: redundant",
            redundant,
            vec![(Severity::Info, r#"clusternetworkpolicy/lo ingress[0] "deny-y-80""#)],
        ),
        (
            "a NetworkPolicy isolates every subject: Baseline never consulted",
            baseline_under_np,
            vec![(Severity::Warning, r#"clusternetworkpolicy/base ingress[0] "deny-y""#)],
        ),
        ("the NetworkPolicy isolates x/a only", baseline_partly, vec![]),
    ];
    for (what, extra, want) in table {
        let want: Vec<(Severity, String)> = want.into_iter().map(|(s, o)| (s, o.to_string())).collect();
        assert_eq!(objects(&extra, "shadowed-rule"), want, "{what}");
    }
    // The finding names what shadows it.
    let f = &findings(
        &(cnp("hi", "Admin", 1, "x", &from_ns("deny-y", "Deny", "y", None))
            + &cnp("lo", "Admin", 5, "x", &from_ns("web-from-y", "Accept", "y", Some(80)))),
        "shadowed-rule",
    )[0];
    assert_eq!(
        f.related,
        vec![r#"clusternetworkpolicy/hi ingress[0] "deny-y" (Admin tier, priority 1, Deny)"#]
    );
}

#[test]
fn equal_priority_overlaps() {
    let table: Vec<(&str, String, Vec<Severity>)> = vec![
        (
            "Accept and Deny at one priority",
            cnp("p", "Admin", 5, "x", &from_ns("allow-y", "Accept", "y", None))
                + &cnp("q", "Admin", 5, "x", &from_ns("deny-y", "Deny", "y", Some(80))),
            vec![Severity::Error],
        ),
        (
            "the same action at one priority",
            cnp("p", "Admin", 5, "x", &from_ns("deny-y", "Deny", "y", None))
                + &cnp("q", "Admin", 5, "x", &from_ns("deny-y-80", "Deny", "y", Some(80))),
            vec![Severity::Info],
        ),
        (
            "one priority, disjoint peers",
            cnp("p", "Admin", 5, "x", &from_ns("allow-y", "Accept", "y", None))
                + &cnp("q", "Admin", 5, "x", &from_ns("deny-z", "Deny", "z", None)),
            vec![],
        ),
        (
            "different priorities",
            cnp("p", "Admin", 5, "x", &from_ns("allow-y", "Accept", "y", None))
                + &cnp("q", "Admin", 6, "x", &from_ns("deny-y", "Deny", "y", Some(80))),
            vec![],
        ),
        (
            "different tiers",
            cnp("p", "Admin", 5, "x", &from_ns("allow-y", "Pass", "y", None))
                + &cnp("q", "Baseline", 5, "x", &from_ns("deny-y", "Deny", "y", Some(80))),
            vec![],
        ),
    ];
    for (what, extra, want) in table {
        let got: Vec<Severity> = findings(&extra, "equal-priority-overlap")
            .into_iter()
            .map(|f| f.severity)
            .collect();
        assert_eq!(got, want, "{what}");
        if !want.is_empty() {
            // Overlap, not shadowing: q's rule is not reported as shadowed.
            assert_eq!(objects(&extra, "shadowed-rule"), vec![], "{what}");
        }
    }
}

#[test]
fn pass_rules_without_effect() {
    let alone = cnp("p", "Admin", 5, "x", &from_ns("pass-y", "Pass", "y", None));
    let before_deny = cnp("p", "Admin", 1, "x", &from_ns("pass-y", "Pass", "y", None))
        + &cnp("d", "Admin", 2, "x", &from_ns("deny-y", "Deny", "y", None));
    let before_accept = cnp("p", "Admin", 1, "x", &from_ns("pass-y", "Pass", "y", None))
        + &cnp("d", "Admin", 2, "x", &from_ns("accept-y", "Accept", "y", None));
    let baseline_before_deny = cnp(
        "b",
        "Baseline",
        1,
        "x",
        &(from_ns("pass-y", "Pass", "y", Some(80)) + &from_ns("deny-y", "Deny", "y", None)),
    );
    let table: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "nothing after it",
            alone,
            vec![r#"clusternetworkpolicy/p ingress[0] "pass-y""#],
        ),
        ("it skips a Deny", before_deny, vec![]),
        (
            "it skips an Accept and nothing denies later",
            before_accept,
            vec![r#"clusternetworkpolicy/p ingress[0] "pass-y""#],
        ),
        ("a Baseline Pass skipping a Deny", baseline_before_deny, vec![]),
    ];
    for (what, extra, want) in table {
        let want: Vec<(Severity, String)> = want.into_iter().map(|o| (Severity::Info, o.to_string())).collect();
        assert_eq!(objects(&extra, "pass-no-effect"), want, "{what}");
    }
}

fn np(name: &str, spec: &str) -> String {
    format!("---\napiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\nmetadata: {{name: {name}, namespace: x}}\nspec: {spec}\n")
}

#[test]
fn network_policies_selecting_nothing() {
    let table: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "no pod has the label",
            np("p", "{podSelector: {matchLabels: {app: web}}, policyTypes: [Ingress]}"),
            vec!["networkpolicy/x/p"],
        ),
        (
            "x/a has it",
            np("p", "{podSelector: {matchLabels: {pod: a}}, policyTypes: [Ingress]}"),
            vec![],
        ),
        (
            "every pod",
            np("p", "{podSelector: {}, policyTypes: [Ingress]}"),
            vec![],
        ),
    ];
    for (what, extra, want) in table {
        let want: Vec<(Severity, String)> = want.into_iter().map(|o| (Severity::Warning, o.to_string())).collect();
        assert_eq!(objects(&extra, "selects-no-pod"), want, "{what}");
    }
    // A ClusterNetworkPolicy whose subject matches no namespace.
    assert_eq!(
        objects(
            &cnp("c", "Admin", 1, "nope", &from_ns("r", "Deny", "y", None)),
            "selects-no-pod"
        ),
        vec![(Severity::Warning, "clusternetworkpolicy/c".to_string())]
    );
    // ... and its rules are not reported again as matching nothing.
    assert_eq!(
        objects(
            &cnp("c", "Admin", 1, "nope", &from_ns("r", "Deny", "y", None)),
            "rule-matches-nothing"
        ),
        vec![]
    );
}

#[test]
fn peers_matching_nothing() {
    let table: Vec<(&str, String, Vec<&str>, bool)> = vec![
        (
            "the only peer matches no pod: the rule allows nothing",
            np("p", "{podSelector: {}, ingress: [{from: [{podSelector: {matchLabels: {pod: zz}}}]}]}"),
            vec!["networkpolicy/x/p ingress[0] peer[0]"],
            true,
        ),
        (
            "one of two peers",
            np(
                "p",
                "{podSelector: {}, egress: [{to: [{namespaceSelector: {matchLabels: {ns: w}}}, {namespaceSelector: {matchLabels: {ns: y}}}]}]}",
            ),
            vec!["networkpolicy/x/p egress[0] peer[0]"],
            false,
        ),
        (
            "a podSelector peer matching a pod of the policy's namespace",
            np("p", "{podSelector: {}, ingress: [{from: [{podSelector: {matchLabels: {pod: a}}}]}]}"),
            vec![],
            false,
        ),
        (
            "ipBlock peers are not judged",
            np("p", "{podSelector: {}, ingress: [{from: [{ipBlock: {cidr: 192.0.2.0/24}}]}]}"),
            vec![],
            false,
        ),
    ];
    for (what, extra, want, allows_nothing) in table {
        let got = findings(&extra, "peer-matches-nothing");
        let objs: Vec<String> = got.iter().map(|f| f.object.clone()).collect();
        assert_eq!(objs, want, "{what}");
        for f in &got {
            assert_eq!(f.message.contains("allows nothing"), allows_nothing, "{what}: {f}");
        }
    }
    // A CNP peer.
    assert_eq!(
        objects(
            &cnp("c", "Admin", 1, "x", &from_ns("r", "Deny", "w", None)),
            "peer-matches-nothing"
        ),
        vec![(
            Severity::Warning,
            r#"clusternetworkpolicy/c ingress[0] "r" peer[0]"#.to_string()
        )]
    );
}

#[test]
fn named_ports_no_pod_defines() {
    let table: Vec<(&str, String, Vec<&str>)> = vec![
        (
            "ingress: the selected pods lack it",
            np("p", "{podSelector: {}, ingress: [{ports: [{port: http}]}]}"),
            vec!["networkpolicy/x/p ingress[0] ports[0]"],
        ),
        ("ingress: defined", np("p", "{podSelector: {}, ingress: [{ports: [{port: serve-80-tcp}]}]}"), vec![]),
        (
            "ingress: defined for UDP only",
            np("p", "{podSelector: {}, ingress: [{ports: [{port: serve-80-tcp, protocol: UDP}]}]}"),
            vec!["networkpolicy/x/p ingress[0] ports[0]"],
        ),
        (
            "egress: resolved against the peers",
            np(
                "p",
                "{podSelector: {}, policyTypes: [Egress], egress: [{to: [{podSelector: {}}], ports: [{port: dns}]}]}",
            ),
            vec!["networkpolicy/x/p egress[0] ports[0]"],
        ),
        (
            "egress: defined by the peers",
            np(
                "p",
                "{podSelector: {}, policyTypes: [Egress], egress: [{to: [{podSelector: {}}], ports: [{port: serve-81-udp, protocol: UDP}]}]}",
            ),
            vec![],
        ),
    ];
    for (what, extra, want) in table {
        let want: Vec<(Severity, String)> = want.into_iter().map(|o| (Severity::Warning, o.to_string())).collect();
        assert_eq!(objects(&extra, "named-port-undefined"), want, "{what}");
    }
    let named = |port: &str| {
        cnp(
            "c",
            "Admin",
            1,
            "x",
            &format!("  - action: Accept\n    from: [{{namespaces: {{}}}}]\n    protocols: [{{destinationNamedPort: {port}}}]\n"),
        )
    };
    assert_eq!(
        objects(&named("http"), "named-port-undefined"),
        vec![(
            Severity::Warning,
            "clusternetworkpolicy/c ingress[0] protocols[0]".to_string()
        )]
    );
    // Defined: no finding at all (the rule matches TCP 80 into x, decided
    // there: the named port's number is a probe of its own).
    assert_eq!(lint(&snapshot(&named("serve-80-tcp")), &sim_options()), vec![]);
}

#[test]
fn rules_matching_no_flow() {
    // A rule about the subject itself (a pod's own traffic is no flow).
    let own = |pod: &str| {
        format!(
            r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {{name: self}}
spec:
  tier: Admin
  priority: 1
  subject:
    pods:
      namespaceSelector: {{matchLabels: {{ns: x}}}}
      podSelector: {{matchLabels: {{pod: a}}}}
  ingress:
  - action: Deny
    from:
    - pods:
        namespaceSelector: {{matchLabels: {{ns: x}}}}
        podSelector: {{matchLabels: {{pod: {pod}}}}}
"#
        )
    };
    assert_eq!(
        objects(&own("a"), "rule-matches-nothing"),
        vec![(Severity::Warning, "clusternetworkpolicy/self ingress[0]".to_string())]
    );
    assert_eq!(objects(&own("b"), "rule-matches-nothing"), vec![]);
}

/// The upstream conformance policy `ingress-tcp` (CNPAdminTierIngressTCP)
/// on the network-policy-api topology: three of its rules are written to
/// be shadowed (upstream checks that rule order is respected).
#[test]
fn the_upstream_rule_ordering_policy_on_the_conformance_topology() {
    let text = std::fs::read_to_string(root().join("tests/conformance/cnp-admin.yaml")).unwrap();
    let case = parse_case_file(&text)
        .unwrap()
        .into_iter()
        .find(|c| c.id == "cnp-admin-ingress-tcp")
        .unwrap();
    let mut model = Model::new(case.topology());
    let step = &case.steps[0];
    assert!(matches!(step.actions[0], Action::CreateClusterNetworkPolicy(_)));
    for a in &step.actions {
        model.apply(a).unwrap();
    }
    let all = lint(&model.snapshot, &model.compile_options());
    let shadowed: Vec<(String, Vec<String>)> = all
        .iter()
        .filter(|f| f.kind == "shadowed-rule")
        .map(|f| (f.object.clone(), f.related.clone()))
        .collect();
    assert_eq!(
        shadowed,
        vec![
            (
                r#"clusternetworkpolicy/ingress-tcp ingress[1] "deny-from-ravenclaw-everything""#.to_string(),
                vec![r#"clusternetworkpolicy/ingress-tcp ingress[0] "allow-from-ravenclaw-everything" (Admin tier, priority 3, Accept)"#.to_string()]
            ),
            (
                r#"clusternetworkpolicy/ingress-tcp ingress[2] "pass-from-ravenclaw-everything""#.to_string(),
                vec![r#"clusternetworkpolicy/ingress-tcp ingress[0] "allow-from-ravenclaw-everything" (Admin tier, priority 3, Accept)"#.to_string()]
            ),
            (
                r#"clusternetworkpolicy/ingress-tcp ingress[4] "pass-from-slytherin-at-port-80""#.to_string(),
                vec![r#"clusternetworkpolicy/ingress-tcp ingress[3] "deny-from-slytherin-at-port-80" (Admin tier, priority 3, Deny)"#.to_string()]
            ),
        ]
    );
    assert!(all.iter().all(|f| f.kind == "shadowed-rule"), "{all:#?}");
}

#[test]
fn exposure_names_the_opening_rule_and_the_outside_ranges() {
    let web = |from: &str| {
        np(
            "web",
            &format!("{{podSelector: {{matchLabels: {{pod: a}}}}, ingress: [{{from: [{{ipBlock: {from}}}], ports: [{{port: 443}}]}}]}}"),
        )
    };
    let get = |extra: &str| {
        let e = exposure(&snapshot(extra), &sim_options(), &[]);
        let x = e
            .namespaces
            .iter()
            .find(|n| n.namespace == "x" && n.direction == npm_policy::compiled::Direction::Ingress)
            .unwrap()
            .clone();
        (e.cluster_cidrs, x)
    };
    // Anywhere: every outside address on TCP 443, by the policy's rule.
    let (cidrs, x) = get(&web("{cidr: 0.0.0.0/0}"));
    assert_eq!(cidrs, vec!["198.18.0.0/16".parse::<ipnet::IpNet>().unwrap()]);
    assert_eq!(x.unprotected, vec!["x/b", "x/c"]);
    let a = x.exposed.iter().find(|p| p.pod == "x/a").unwrap();
    assert_eq!(a.isolated_by, vec!["networkpolicy/x/web"]);
    assert_eq!(a.outside.len(), 1);
    assert_eq!(a.outside[0].rule, "networkpolicy/x/web ingress[0]");
    assert!(a.outside[0].any_address);
    assert_eq!(a.outside[0].ports, vec!["TCP 443"]);
    // All but 10.0.0.0/8: the regions say so.
    let (_, x) = get(&web("{cidr: 0.0.0.0/0, except: [10.0.0.0/8]}"));
    let a = x.exposed.iter().find(|p| p.pod == "x/a").unwrap();
    assert!(!a.outside[0].any_address);
    assert_eq!(a.outside[0].regions, vec!["0.0.0.0/0 except 10.0.0.0/8, 198.18.0.0/16"]);
    // Only the pod network: not exposed.
    let (_, x) = get(&web("{cidr: 198.18.0.0/16}"));
    assert!(x.exposed.iter().all(|p| p.pod != "x/a"), "{x:#?}");
    // A Deny of a ClusterNetworkPolicy closes x entirely to the world.
    let deny_world = "---\napiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {name: no-world}\nspec:\n  tier: Admin\n  priority: 1\n  subject: {namespaces: {matchLabels: {ns: x}}}\n  egress: [{action: Deny, to: [{networks: [0.0.0.0/0]}]}]\n";
    let e = exposure(&snapshot(deny_world), &sim_options(), &[]);
    let xe = e
        .namespaces
        .iter()
        .find(|n| n.namespace == "x" && n.direction == npm_policy::compiled::Direction::Egress)
        .unwrap();
    assert_eq!(xe.unprotected, Vec::<String>::new());
    assert!(xe.exposed.is_empty(), "{xe:#?}");
}

const FLOWS: &str = r#"{"verdict":"allow","reason":"not-isolated","direction":"egress","pod":{"namespace":"y","name":"b"},"peer":{"kind":"pod","namespace":"x","name":"a"},"peer_ip":"10.1.1.1","policies":[],"protocol":"TCP","src":"10.1.2.2:40000","dst":"10.1.1.1:80","endpoint":5,"ifindex":9}
{"verdict":"allow","reason":"not-isolated","direction":"egress","pod":{"namespace":"z","name":"c"},"peer":{"kind":"pod","namespace":"x","name":"b"},"peer_ip":"10.1.1.2","policies":[],"protocol":"TCP","src":"10.1.3.3:40000","dst":"10.1.1.2:80","endpoint":6,"ifindex":10}
{"verdict":"allow","reason":"not-isolated","direction":"egress","pod":{"namespace":"x","name":"a"},"peer":{"kind":"pod","namespace":"y","name":"b"},"peer_ip":"10.1.2.2","policies":[],"protocol":"TCP","src":"10.1.1.1:40000","dst":"10.1.2.2:80","endpoint":2,"ifindex":4}
"#;

#[test]
fn preview_lists_the_flows_a_change_denies_by_pair() {
    let current = snapshot("");
    let new = snapshot(&std::fs::read_to_string(root().join("examples/01-default-deny-ingress-x.yaml")).unwrap());
    let flows = parse_flow_records(FLOWS).unwrap().flows;
    let p = preview(&current, &new, &sim_options(), &flows);
    assert_eq!((p.flows, p.records, p.disagree_with_record), (3, 3, 0));
    // Pods are found by name (the records' addresses are another cluster's).
    assert!(p.missing_pods.is_empty());
    assert!(p.opened.is_empty());
    // y/b -> x/a stays allowed (allow-y-to-a); z/c -> x/b is closed.
    let pairs: Vec<(String, String)> = p.closed.iter().map(|c| (c.from.clone(), c.to.clone())).collect();
    assert_eq!(pairs, vec![("z/c".to_string(), "x/b".to_string())]);
    let c = &p.closed[0].flows[0];
    assert_eq!(c.port, "TCP/80");
    assert!(c.before.allowed && !c.after.allowed);
    assert_eq!(c.after.ingress, "DENIED (isolated and no rule allows)");
    // Reverse: applying the current state's objects again changes nothing,
    // and the change read the other way opens the flow.
    assert!(preview(&new, &new, &sim_options(), &flows).closed.is_empty());
    let back = preview(&new, &current, &sim_options(), &flows);
    assert_eq!(back.opened.len(), 1);
    assert!(back.closed.is_empty());
}

fn npmctl(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npmctl"))
        .current_dir(root())
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn npmctl_runs_the_three_commands() {
    let dir = std::env::temp_dir().join(format!("npm-analysis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let overlap = dir.join("overlap.yaml");
    std::fs::write(
        &overlap,
        cnp("p", "Admin", 5, "x", &from_ns("allow-y", "Accept", "y", None))
            + &cnp("q", "Admin", 5, "x", &from_ns("deny-y", "Deny", "y", Some(80))),
    )
    .unwrap();
    let flows = dir.join("flows.jsonl");
    std::fs::write(&flows, FLOWS).unwrap();
    // lint: an error finding, exit 1; JSON parses.
    let (code, out, _) = npmctl(&["lint", "-f", "examples/cluster.yaml", "-f", overlap.to_str().unwrap()]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("error: equal-priority-overlap"), "{out}");
    let (_, out, _) = npmctl(&[
        "lint",
        "-f",
        "examples/cluster.yaml",
        "-f",
        overlap.to_str().unwrap(),
        "-o",
        "json",
    ]);
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v[0]["severity"], "error");
    assert_eq!(v[0]["kind"], "equal-priority-overlap");
    // exposure
    let (code, out, _) = npmctl(&[
        "exposure",
        "-f",
        "examples/cluster.yaml",
        "-f",
        "examples/01-default-deny-ingress-x.yaml",
    ]);
    assert_eq!(code, 0, "{out}");
    assert!(out.contains("namespace x ingress:\n  unprotected: none"), "{out}");
    // preview
    let (code, out, err) = npmctl(&[
        "preview",
        "-f",
        "examples/cluster.yaml",
        "--apply",
        "examples/01-default-deny-ingress-x.yaml",
        "--flows",
        flows.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("NEWLY DENIED z/c -> x/b"), "{out}");
    // --delete: without allow-y-to-a, y/b -> x/a (recorded allowed) closes.
    let (code, out, err) = npmctl(&[
        "preview",
        "-f",
        "examples/cluster.yaml",
        "-f",
        "examples/01-default-deny-ingress-x.yaml",
        "--delete",
        "networkpolicy/x/allow-y-to-a",
        "--flows",
        flows.to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("1 newly denied, 0 newly allowed"), "{out}");
    assert!(out.contains("NEWLY DENIED y/b -> x/a"), "{out}");
    let (code, _, err) = npmctl(&[
        "preview",
        "-f",
        "examples/cluster.yaml",
        "--delete",
        "networkpolicy/x/nope",
        "--flows",
        flows.to_str().unwrap(),
    ]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("no networkpolicy x/nope"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Every CNP case of the catalogue, step by step (its policies applied
/// cumulatively, on its topology): the reference evaluator never decides
/// a probe by a rule lint reports as shadowed or matching nothing, and
/// every rule it decides a probe by is not reported so. Ties lint's walk
/// of the tiers to `evaluate` on the conformance topology.
#[test]
fn shadowed_rules_never_decide_on_the_cnp_catalogue() {
    use npm_policy::analysis::universe::Universe;
    use npm_policy::compiled::Direction;
    use npm_policy::evaluate::{evaluate_direction_with_peer, EndReason};
    use npm_policy::tiers::evaluate::End;
    use std::collections::BTreeSet;

    let dir = root().join("tests/conformance");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("cnp-"))
        .collect();
    files.sort();
    let (mut steps, mut shadowed_total, mut decided_total) = (0, 0, 0);
    for f in files {
        for case in parse_case_file(&std::fs::read_to_string(&f).unwrap()).unwrap() {
            let mut model = Model::new(case.topology());
            for step in &case.steps {
                for a in &step.actions {
                    model.apply(a).unwrap();
                }
                steps += 1;
                let s = &model.snapshot;
                let opts = model.compile_options();
                // `clusternetworkpolicy/NAME DIR[i]` of the rules lint says
                // never decide.
                let findings = lint(s, &opts);
                // The rule of a finding's object: its first two words.
                let rule_of = |o: &str| o.split(' ').take(2).collect::<Vec<_>>().join(" ");
                let never: BTreeSet<String> = findings
                    .iter()
                    .filter(|f| f.kind == "shadowed-rule" || f.kind == "rule-matches-nothing")
                    .map(|f| rule_of(&f.object))
                    .collect();
                // Rules with a finding saying why they match nothing.
                let dead: BTreeSet<String> = findings
                    .iter()
                    .filter(|f| f.kind == "peer-matches-nothing" || f.kind == "named-port-undefined")
                    .map(|f| rule_of(&f.object))
                    .collect();
                let no_subject: BTreeSet<String> = findings
                    .iter()
                    .filter(|f| f.kind == "selects-no-pod")
                    .map(|f| f.object.clone())
                    .collect();
                shadowed_total += never.len();
                let u = Universe::new(s, &[]);
                let mut decided = BTreeSet::new();
                for pod in npm_policy::analysis::universe::live_pods(s) {
                    for end in &u.ends {
                        if end.pod().is_some_and(|p| std::ptr::eq(p, pod)) {
                            continue;
                        }
                        let tend = End {
                            ip: end.ip,
                            pod: end.pod(),
                            node: end.node_labels(),
                        };
                        for run in &u.ports {
                            for dir in [Direction::Ingress, Direction::Egress] {
                                let v = evaluate_direction_with_peer(s, &opts, pod, dir, tend, run.protocol, run.start);
                                // Every tier match consulted (Pass included).
                                let mut ms = v.tiers.clone();
                                if let EndReason::Tier(m) = &v.reason {
                                    ms.push(m.clone());
                                }
                                for m in ms {
                                    decided.insert(format!(
                                        "clusternetworkpolicy/{} {}[{}]",
                                        m.policy,
                                        dir.name(),
                                        m.index
                                    ));
                                }
                            }
                        }
                    }
                }
                decided_total += decided.len();
                let both: Vec<&String> = never.intersection(&decided).collect();
                assert!(
                    both.is_empty(),
                    "{} step {steps}: lint says never decides, evaluate decided by: {both:?}",
                    case.id
                );
                // And every rule lint does not report decides some probe.
                for c in s.cluster_policies.values() {
                    for dir in [Direction::Ingress, Direction::Egress] {
                        for i in 0..c.rules(dir).len() {
                            let name = format!("clusternetworkpolicy/{} {}[{i}]", c.name, dir.name());
                            let explained = never.contains(&name)
                                || no_subject.contains(&format!("clusternetworkpolicy/{}", c.name))
                                || dead.contains(&name);
                            assert!(
                                explained || decided.contains(&name),
                                "{} step {steps}: {name} neither reported nor deciding: {findings:#?}",
                                case.id
                            );
                        }
                    }
                }
            }
        }
    }
    assert!(
        steps > 20 && shadowed_total > 0 && decided_total > 20,
        "{steps} {shadowed_total} {decided_total}"
    );
}
