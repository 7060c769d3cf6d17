//! The simulator: example case files through `run_case_simulated`, case
//! parsing and placeholders, and `npmctl` smoke tests on the built binary.

use std::path::PathBuf;
use std::process::Command;

use npm_sim::cases::{parse_case_file, run_case_simulated, substitute, Action, Model};

fn case_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/cases")
}

#[test]
fn example_cases_pass() {
    let mut n = 0;
    for entry in std::fs::read_dir(case_dir()).unwrap() {
        let path = entry.unwrap().path();
        let cases = parse_case_file(&std::fs::read_to_string(&path).unwrap())
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for c in cases {
            let r = run_case_simulated(&c);
            assert!(r.passed(), "{}: {}", path.display(), r.report());
            assert!(!r.probes.is_empty());
            n += 1;
        }
    }
    assert_eq!(n, 3);
}

#[test]
fn wrong_expectation_fails_with_mismatch() {
    let text = r#"
id: wrong
steps:
  - actions:
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {name: deny, namespace: y}
          spec: {podSelector: {matchLabels: {pod: b}}, policyTypes: [Ingress]}
    probes:
      - port: 80
        matrix:
          x/a: "111111111"
"#;
    let cases = parse_case_file(text).unwrap();
    let r = run_case_simulated(&cases[0]);
    assert!(!r.passed());
    let m = &r.probes[0].mismatches;
    assert_eq!(m.len(), 1, "{}", r.report());
    assert_eq!(
        (m[0].from.as_str(), m[0].to.as_str(), m[0].expected, m[0].actual),
        ("x/a", "y/b", true, false)
    );
    assert!(
        r.report().contains("x/a -> y/b: expected reachable, got blocked"),
        "{}",
        r.report()
    );
    assert!(r.probes[0].actual.render().contains("X"));
}

#[test]
fn actions_parse_and_errors_are_clear() {
    let text = r#"
cases:
  - id: all-actions
    unknown_field: ignored
    steps:
      - actions:
          - create_namespace: {namespace: q, labels: {a: b}}
          - create_pod: {pod: q/p, labels: {pod: p}}
          - add_pod_labels: {pod: q/p, labels: {x: "1"}}
          - set_pod_labels: {pod: x/a, labels: {pod: z}}
          - add_namespace_labels: {namespace: q, labels: {c: d}}
          - set_namespace_labels: {namespace: x, labels: {only: this}}
          - delete_pod: {pod: x/b}
          - delete_all_policies: {}
          - delete_namespace: {namespace: z}
"#;
    let cases = parse_case_file(text).unwrap();
    assert_eq!(cases[0].steps[0].actions.len(), 9);
    let mut m = Model::upstream();
    for a in &cases[0].steps[0].actions {
        m.apply(a).unwrap();
    }
    let s = &m.snapshot;
    assert_eq!(s.pods[&("q".into(), "p".into())].labels.len(), 2);
    assert_eq!(m.ip("q/p").unwrap().to_string(), "198.18.4.1");
    assert_eq!(s.namespaces["x"].labels.len(), 2, "{:?}", s.namespaces["x"].labels);
    assert_eq!(s.namespaces["x"].labels["kubernetes.io/metadata.name"], "x");
    assert!(!s.pods.contains_key(&("x".into(), "b".into())));
    assert!(!s.namespaces.contains_key("z") && !s.pods.keys().any(|k| k.0 == "z"));
    // Errors name the action and the object.
    let e = m
        .apply(&Action::DeletePod(npm_sim::cases::PodName { pod: "x/nope".into() }))
        .unwrap_err();
    assert_eq!(e.to_string(), "action delete_pod: pod \"x/nope\" does not exist");
    assert!(parse_case_file("cases:\n  - id: bad\n    steps:\n      - actions:\n          - explode: {}\n").is_err());
}

#[test]
fn placeholders() {
    let m = Model::upstream();
    let out = substitute("a ${IP:y/c} b ${CIDR16:z/a} c ${CIDR24:x/b}", &|p| m.ip(p)).unwrap();
    assert_eq!(out, "a 198.18.2.3 b 198.18.0.0/16 c 198.18.1.0/24");
    assert!(substitute("${IP:q/q}", &|p| m.ip(p))
        .unwrap_err()
        .to_string()
        .contains("unknown pod"));
    assert!(substitute("${FOO:x/a}", &|p| m.ip(p)).is_err());
    assert_eq!(m.ip("x/a").unwrap().to_string(), "198.18.1.1");
    let v6 = m.snapshot.pods[&("z".into(), "b".into())].ips[1].to_string();
    assert_eq!(v6, "fd00:198:18::3:2");
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
metadata: {name: shop, labels: {team: shop}}
---
apiVersion: v1
kind: Pod
metadata: {name: web, namespace: shop, labels: {app: web}}
spec: {containers: [{name: c, image: i, ports: [{name: http, containerPort: 8080}]}]}
---
apiVersion: v1
kind: Pod
metadata: {name: db, namespace: shop, labels: {app: db}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: other, labels: {app: client}}
spec: {containers: [{name: c, image: i}]}
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: db-from-web, namespace: shop}
spec:
  podSelector: {matchLabels: {app: db}}
  ingress:
    - from: [{podSelector: {matchLabels: {app: web}}}]
      ports: [{port: 5432}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: broken, namespace: shop}
spec:
  podSelector: {}
  ingress:
    - from: [{ipBlock: {cidr: 10.0.0.0/8, except: [192.168.0.0/16]}}]
      ports: [{port: http, endPort: 90}]
"#;

#[test]
fn npmctl_smoke() {
    let dir = std::env::temp_dir().join(format!("npmctl-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("objects.yaml");
    std::fs::write(&f, OBJECTS).unwrap();
    let f = f.to_str().unwrap();

    let (ok, out, _) = npmctl(&["matrix", "-f", f, "--port", "5432", "--protocol", "TCP"]);
    assert!(ok);
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    // rows/columns sorted: other/client, shop/db, shop/web
    assert!(
        lines[1].starts_with("other/client") && lines[1].split_whitespace().collect::<Vec<_>>()[1..] == [".", "X", "X"],
        "{out}"
    );
    // `broken` selects every pod of shop: its invalid rule is dropped, its
    // isolation stays (fail closed), so shop/web admits nobody.
    assert!(
        lines[3].starts_with("shop/web") && lines[3].split_whitespace().collect::<Vec<_>>()[1..] == [".", ".", "X"],
        "{out}"
    );

    let (ok, out, _) = npmctl(&[
        "explain",
        "-f",
        f,
        "--from",
        "other/client",
        "--to",
        "shop/db",
        "--port",
        "5432",
    ]);
    assert!(ok);
    assert!(
        out.contains("DENIED")
            && out.contains("selected by shop/broken, shop/db-from-web")
            && out.contains("isolated and no rule allows"),
        "{out}"
    );
    let (ok, out, _) = npmctl(&[
        "explain", "-f", f, "--from", "shop/web", "--to", "shop/db", "--port", "5432",
    ]);
    assert!(
        ok && out.contains("ALLOWED") && out.contains("by shop/db-from-web ingress[0]"),
        "{out}"
    );

    let (ok, out, _) = npmctl(&["validate", "-f", f]);
    assert!(!ok, "invalid policy must fail validate");
    assert!(out.contains("INVALID: shop/broken"), "{out}");
    assert!(
        out.contains("shop/broken: spec.ingress[0].from[0].ipBlock.except[0]"),
        "{out}"
    );
    assert!(out.contains("shop/broken: spec.ingress[0].ports[0].endPort"), "{out}");

    let (ok, out, _) = npmctl(&["compile", "-f", f]);
    assert!(ok && out.contains("policy:") && out.contains("shop/db"), "{out}");

    let (ok, out, _) = npmctl(&[
        "cases",
        case_dir().join("basic.yaml").to_str().unwrap(),
        case_dir().join("lifecycle.yaml").to_str().unwrap(),
    ]);
    assert!(ok, "{out}");
    assert!(out.trim_end().ends_with("3 passed, 0 failed"), "{out}");

    let bad = dir.join("bad-case.yaml");
    std::fs::write(
        &bad,
        "id: bad\nsteps:\n  - probes:\n      - port: 80\n        matrix: {x/a: \"000000000\"}\n",
    )
    .unwrap();
    let (ok, out, _) = npmctl(&["cases", bad.to_str().unwrap()]);
    assert!(!ok);
    assert!(out.contains("0 passed, 1 failed") && out.contains("bad: FAIL"), "{out}");

    let (ok, _, err) = npmctl(&["matrix", "-f", "/nonexistent/x.yaml"]);
    assert!(!ok && err.contains("/nonexistent/x.yaml"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}
