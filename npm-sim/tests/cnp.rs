//! ClusterNetworkPolicies in the case format and the simulator: the CNP
//! actions, the network-policy-api topology, the catalogue's CNP cases
//! (evaluator and compiled lookup agree with the upstream expectations, and
//! the cases fail without their policies), and `npmctl` on CNP YAML.

use std::path::PathBuf;
use std::process::Command;

use npm_sim::cases::{parse_case_file, run_case_simulated, Action, Case, Model, Topology};

fn catalogue() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/conformance")
}

fn cnp_cases() -> Vec<(String, Case)> {
    let mut out = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(catalogue())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_str().unwrap().starts_with("cnp-"))
        .collect();
    files.sort();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        for c in parse_case_file(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display())) {
            out.push((f.display().to_string(), c));
        }
    }
    out
}

const HP0: &str = "network-policy-conformance-gryffindor/harry-potter-0";
const DM0: &str = "network-policy-conformance-slytherin/draco-malfoy-0";

fn deny_slytherin(tier: &str, name: &str, action: &str) -> String {
    format!(
        r#"
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {{name: {name}}}
spec:
  tier: {tier}
  priority: 5
  subject: {{namespaces: {{matchLabels: {{conformance-house: gryffindor}}}}}}
  ingress:
    - name: from-slytherin
      action: {action}
      from: [{{namespaces: {{matchLabels: {{conformance-house: slytherin}}}}}}]
"#
    )
}

#[test]
fn the_network_policy_api_topology() {
    let m = Model::new(Topology::NetworkPolicyApi);
    // Four houses of two pods, and the two host-network centaurs, each with
    // its node's addresses (npm-node, npm-node-2).
    assert_eq!(m.pod_names().len(), 10);
    let c1 = &m.snapshot.pods[&(
        "network-policy-conformance-forbidden-forrest".into(),
        "centaur-1".into(),
    )];
    assert!(c1.host_network);
    assert_eq!(c1.ips, m.snapshot.nodes["npm-node-2"].addresses);
    assert_eq!(m.compile_options().node_ips, m.snapshot.nodes["npm-node"].addresses);
    let s = &m.snapshot;
    let ns = &s.namespaces["network-policy-conformance-ravenclaw"];
    assert_eq!(ns.labels.len(), 2, "{:?}", ns.labels);
    assert_eq!(ns.labels["conformance-house"], "ravenclaw");
    let p = &s.pods[&("network-policy-conformance-gryffindor".into(), "harry-potter-1".into())];
    assert_eq!(p.labels["conformance-house"], "gryffindor");
    let ports: Vec<(Option<&str>, u16)> = p.ports.iter().map(|c| (c.name.as_deref(), c.port)).collect();
    assert_eq!(ports, [(Some("web"), 80), (Some("dns"), 53)]);
    assert_eq!(m.ip(HP0).unwrap().to_string(), "198.18.11.1");
    assert_eq!(
        m.ip("network-policy-conformance-ravenclaw/luna-lovegood-1")
            .unwrap()
            .to_string(),
        "198.18.14.2"
    );
    // A namespace created by a case gets the next index, no `ns` label.
    let mut m = m;
    let c = &parse_case_file("topology: houses\ncases:\n- id: t\n  steps:\n  - actions:\n    - create_namespace: {namespace: q}\n    - create_pod: {pod: q/p}\n")
        .unwrap()[0];
    assert_eq!(c.topology(), Topology::NetworkPolicyApi);
    for a in &c.steps[0].actions {
        m.apply(a).unwrap();
    }
    // (index 15 is forbidden-forrest, whose host-network pods have node addresses)
    assert_eq!(m.ip("q/p").unwrap().to_string(), "198.18.16.1");
    assert!(!m.snapshot.namespaces["q"].labels.contains_key("ns"));
    assert_eq!(m.snapshot.pods[&("q".into(), "p".into())].ports.len(), 2);
}

#[test]
fn file_topology_and_default_pods() {
    let text = r#"
topology: network-policy-api
cases:
  - id: a
    steps: [{probes: [{port: 80, matrix: {}}]}]
  - id: b
    topology: xyz
    steps: [{probes: [{port: 80, matrix: {}}]}]
"#;
    let cases = parse_case_file(text).unwrap();
    assert_eq!(cases[0].topology(), Topology::NetworkPolicyApi);
    assert_eq!(cases[0].steps[0].probes[0].pods.len(), 8);
    assert_eq!(cases[0].steps[0].probes[0].pods[0], HP0);
    assert_eq!(cases[1].topology(), Topology::Xyz);
    assert_eq!(cases[1].steps[0].probes[0].pods, npm_sim::cases::default_pods());
    // A single case without a topology runs on x, y, z.
    let c = parse_case_file("id: c\nsteps: []\n").unwrap();
    assert_eq!(c[0].topology(), Topology::Xyz);
    assert!(parse_case_file("topology: moon\ncases: []\n").is_err());
}

#[test]
fn a_probe_of_a_pod_of_another_topology_is_an_error_not_a_pass() {
    // On x, y, z the houses do not exist: the case must not pass vacuously.
    let text = format!("id: wrong-topology\nsteps:\n  - probes:\n      - port: 80\n        pods: [{HP0}]\n        matrix: {{{DM0}: \"0\"}}\n");
    let r = run_case_simulated(&parse_case_file(&text).unwrap()[0]);
    assert!(!r.passed());
    assert!(
        r.error.as_deref().unwrap().contains("does not exist (topology xyz)"),
        "{}",
        r.report()
    );
}

#[test]
fn cluster_network_policy_actions() {
    let create = deny_slytherin("Admin", "deny-slytherin", "Deny");
    let text = format!(
        "topology: network-policy-api\ncases:\n- id: t\n  steps:\n  - actions:\n    - create_cluster_network_policy:\n{}\n    - update_cluster_network_policy:\n{}\n    - delete_cluster_network_policy: {{name: deny-slytherin}}\n",
        indent(&create, 8),
        indent(&deny_slytherin("Admin", "deny-slytherin", "Accept"), 8)
    );
    let cases = parse_case_file(&text).unwrap();
    let acts = &cases[0].steps[0].actions;
    assert_eq!(
        acts.iter().map(|a| a.name()).collect::<Vec<_>>(),
        [
            "create_cluster_network_policy",
            "update_cluster_network_policy",
            "delete_cluster_network_policy"
        ]
    );
    let mut m = Model::new(Topology::NetworkPolicyApi);
    m.apply(&acts[0]).unwrap();
    assert_eq!(m.snapshot.cluster_policies["deny-slytherin"].priority, 5);
    // Creating it again, updating or deleting a missing one: clear errors.
    let e = m.apply(&acts[0]).unwrap_err().to_string();
    assert!(
        e.contains("create_cluster_network_policy") && e.contains("already exists"),
        "{e}"
    );
    m.apply(&acts[1]).unwrap();
    m.apply(&acts[2]).unwrap();
    assert!(m.snapshot.cluster_policies.is_empty());
    let e = m.apply(&acts[1]).unwrap_err().to_string();
    assert!(
        e.contains("update_cluster_network_policy") && e.contains("does not exist"),
        "{e}"
    );
    let e = m.apply(&acts[2]).unwrap_err().to_string();
    assert!(
        e.contains("delete_cluster_network_policy") && e.contains("does not exist"),
        "{e}"
    );
    // Malformed arguments fail at parse time.
    for bad in [
        "- create_cluster_network_policy: 3",
        "- create_cluster_network_policy: {kind: ClusterNetworkPolicy}",
        "- delete_cluster_network_policy: {}",
    ] {
        let t = format!("id: bad\nsteps:\n  - actions:\n    {bad}\n");
        assert!(parse_case_file(&t).is_err(), "{bad}");
    }
    // An invalid policy (priority out of range) is an action error naming it.
    let invalid = deny_slytherin("Admin", "bad-priority", "Deny").replace("priority: 5", "priority: 5000");
    let t = format!(
        "topology: houses\nid: inv\nsteps:\n  - actions:\n    - create_cluster_network_policy:\n{}\n",
        indent(&invalid, 8)
    );
    let c = &parse_case_file(&t).unwrap()[0];
    let e = Model::new(Topology::NetworkPolicyApi)
        .apply(&c.steps[0].actions[0])
        .unwrap_err()
        .to_string();
    assert!(e.contains("invalid policy") && e.contains("bad-priority"), "{e}");
    // Placeholders in a CNP are resolved against the model.
    let cidr = format!(
        "apiVersion: policy.networking.k8s.io/v1alpha2\nkind: ClusterNetworkPolicy\nmetadata: {{name: c}}\nspec:\n  tier: Admin\n  priority: 1\n  subject: {{namespaces: {{}}}}\n  egress:\n  - action: Deny\n    to: [{{networks: [\"${{CIDR32:{DM0}}}\"]}}]\n"
    );
    let t = format!(
        "id: ph\nsteps:\n  - actions:\n    - create_cluster_network_policy:\n{}\n",
        indent(&cidr, 8)
    );
    let c = &parse_case_file(&t).unwrap()[0];
    let mut m = Model::new(Topology::NetworkPolicyApi);
    m.apply(&c.steps[0].actions[0]).unwrap();
    let p = format!("{:?}", m.snapshot.cluster_policies["c"].egress[0].peers);
    assert!(p.contains("198.18.12.1/32"), "{p}");
}

fn indent(s: &str, n: usize) -> String {
    s.trim()
        .lines()
        .map(|l| format!("{}{l}", " ".repeat(n)))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_catalogue_cnp_cases_pass_on_the_evaluator_and_the_compiled_lookup() {
    let cases = cnp_cases();
    // 24 upstream tests on their topology, one case on x, y, z.
    assert_eq!(cases.len(), 25);
    let houses = cases
        .iter()
        .filter(|(_, c)| c.topology() == Topology::NetworkPolicyApi)
        .count();
    assert_eq!(houses, 24);
    let mut failures = String::new();
    for (file, c) in &cases {
        let r = run_case_simulated(c);
        if !r.passed() {
            failures.push_str(&format!("{file}: {}", r.report()));
        }
    }
    assert!(failures.is_empty(), "{failures}");
}

#[test]
fn the_catalogue_cnp_cases_fail_without_their_policies() {
    // Every case expects at least one verdict that only its policies give:
    // dropping the CNP actions (and the integration case's NetworkPolicy)
    // must make each of them fail.
    for (file, c) in cnp_cases() {
        let mut stripped = c.clone();
        for s in &mut stripped.steps {
            s.actions.retain(|a| {
                !matches!(
                    a,
                    Action::CreateClusterNetworkPolicy(_)
                        | Action::UpdateClusterNetworkPolicy(_)
                        | Action::DeleteClusterNetworkPolicy(_)
                        | Action::CreatePolicy(_)
                        | Action::DeletePolicy(_)
                )
            });
        }
        let r = run_case_simulated(&stripped);
        assert!(r.error.is_none(), "{file} {}: {}", c.id, r.report());
        assert!(!r.passed(), "{file} {}: passes without its policies", c.id);
    }
}

fn npmctl(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_npmctl")).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

const OBJECTS: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: app, labels: {tenant: a}}
---
apiVersion: v1
kind: Namespace
metadata: {name: mon, labels: {tenant: ops}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: app, labels: {app: web}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: prom, namespace: mon, labels: {app: prom}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: mon, labels: {app: other}}
spec: {containers: [{name: c, image: i}]}
---
kind: List
items:
  - apiVersion: policy.networking.k8s.io/v1alpha2
    kind: ClusterNetworkPolicy
    metadata: {name: only-prometheus-reaches-app}
    spec:
      tier: Admin
      priority: 10
      subject: {namespaces: {matchLabels: {tenant: a}}}
      ingress:
        - name: accept-prometheus
          action: Accept
          from: [{pods: {namespaceSelector: {matchLabels: {tenant: ops}}, podSelector: {matchLabels: {app: prom}}}}]
        - name: deny-the-rest
          action: Deny
          from: [{namespaces: {}}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: broken}
spec:
  tier: Baseline
  priority: 2000
  subject: {namespaces: {matchLabels: {tenant: nobody}}}
"#;

#[test]
fn npmctl_with_cluster_network_policies() {
    let dir = std::env::temp_dir().join(format!("npmctl-cnp-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("objects.yaml");
    std::fs::write(&f, OBJECTS).unwrap();
    let f = f.to_str().unwrap();

    let (ok, out, err) = npmctl(&["matrix", "-f", f, "--port", "80"]);
    assert!(ok, "{err}");
    assert!(err.contains("invalid clusternetworkpolicy broken"), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    // rows/columns sorted: app/web, mon/other, mon/prom
    let row = |i: usize| lines[i].split_whitespace().skip(1).collect::<Vec<_>>();
    assert_eq!(lines.len(), 4, "{out}");
    assert!(
        lines[2].starts_with("mon/other") && lines[3].starts_with("mon/prom"),
        "{out}"
    );
    assert_eq!(row(2), ["X", ".", "."], "mon/other -> app/web: Admin Deny\n{out}");
    assert_eq!(row(3)[0], ".", "mon/prom -> app/web: Admin Accept\n{out}");

    let (ok, out, _) = npmctl(&[
        "explain",
        "-f",
        f,
        "--from",
        "mon/other",
        "--to",
        "app/web",
        "--port",
        "80",
    ]);
    assert!(ok, "{out}");
    assert!(
        out.contains("DENIED")
            && out.contains("Admin")
            && out.contains("only-prometheus-reaches-app")
            && out.contains("deny-the-rest"),
        "explain names the tier, the CNP and the rule:\n{out}"
    );
    let (ok, out, _) = npmctl(&[
        "explain", "-f", f, "--from", "mon/prom", "--to", "app/web", "--port", "80",
    ]);
    assert!(
        ok && out.contains("ALLOWED") && out.contains("accept-prometheus"),
        "{out}"
    );

    let (ok, out, _) = npmctl(&["validate", "-f", f]);
    assert!(!ok, "an invalid CNP fails validate\n{out}");
    assert!(
        out.contains("valid: clusternetworkpolicy only-prometheus-reaches-app (tier Admin, priority 10)"),
        "{out}"
    );
    assert!(out.contains("INVALID: clusternetworkpolicy broken"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}
