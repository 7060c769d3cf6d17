//! `npmctl ports`: every protocol and port of a pod-to-pod flow in runs,
//! each run's ends checked against the reference evaluator (`explain`), and
//! the command's output naming the deciding rules.

use std::process::Command;

use npm_policy::model::Protocol;
use npm_sim::{ports, sim};

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
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: web-ports, namespace: app}
spec:
  podSelector: {matchLabels: {app: web}}
  ingress:
    - from: [{namespaceSelector: {matchLabels: {tenant: ops}}}]
      ports: [{protocol: TCP, port: 80}, {protocol: TCP, port: 8000, endPort: 8100}, {protocol: UDP, port: 53}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: prom-out, namespace: mon}
spec:
  podSelector: {matchLabels: {app: prom}}
  policyTypes: [Egress]
  egress:
    - ports: [{protocol: TCP, port: 8000, endPort: 9000}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: no-8080-from-other}
spec:
  tier: Admin
  priority: 5
  subject: {namespaces: {matchLabels: {tenant: a}}}
  ingress:
    - name: deny-8080
      action: Deny
      from: [{pods: {namespaceSelector: {}, podSelector: {matchLabels: {app: other}}}}]
      protocols: [{tcp: {destinationPort: {number: 8080}}}]
    - name: pass-udp
      action: Pass
      from: [{namespaces: {}}]
      protocols: [{udp: {destinationPort: {range: {start: 50, end: 60}}}}]
---
apiVersion: policy.networking.k8s.io/v1alpha2
kind: ClusterNetworkPolicy
metadata: {name: baseline-sctp}
spec:
  tier: Baseline
  priority: 5
  subject: {namespaces: {matchLabels: {tenant: ops}}}
  ingress:
    - name: accept-sctp
      action: Accept
      from: [{namespaces: {}}]
      protocols: [{sctp: {destinationPort: {number: 9003}}}]
"#;

const PODS: [&str; 3] = ["app/web", "mon/prom", "mon/other"];

#[test]
fn every_run_agrees_with_the_evaluator_at_both_ends() {
    let s = sim::load_snapshot(&[("objects.yaml".to_string(), OBJECTS.to_string())]).expect("objects");
    let opts = sim::sim_options();
    let mut runs = 0;
    for from in PODS {
        for to in PODS.iter().filter(|t| **t != from) {
            let r = ports::ports(&s, &opts, from, to).expect("ports");
            for row in &r.rows {
                let Some(protocol) = row.protocol else {
                    continue;
                };
                runs += 1;
                for port in [row.ports.0, row.ports.1] {
                    let v = sim::explain(&s, &opts, from, to, protocol, port).expect("explain");
                    assert_eq!(
                        v.allowed,
                        row.allowed(),
                        "{from} -> {to} {protocol:?} {port}: evaluator {v}, ports {row:?}"
                    );
                }
            }
            // The runs of each protocol cover every port, in order.
            for p in [Protocol::Tcp, Protocol::Udp, Protocol::Sctp] {
                let rows: Vec<_> = r.rows.iter().filter(|x| x.protocol == Some(p)).collect();
                assert_eq!(rows.first().map(|x| x.ports.0), Some(0));
                assert_eq!(rows.last().map(|x| x.ports.1), Some(u16::MAX));
                assert!(rows.windows(2).all(|w| w[0].ports.1 + 1 == w[1].ports.0));
            }
        }
    }
    // Runs split where the rules do (not one run per protocol).
    assert!(runs > 20, "{runs} runs");
}

#[test]
fn npmctl_ports_names_the_deciding_rules() {
    let dir = std::env::temp_dir().join(format!("npmctl-ports-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let f = dir.join("objects.yaml");
    std::fs::write(&f, OBJECTS).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_npmctl"))
        .args([
            "ports",
            "-f",
            f.to_str().unwrap(),
            "--from",
            "mon/other",
            "--to",
            "app/web",
        ])
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8_lossy(&out.stdout);
    let after = |head: &str| -> String {
        let i = text.find(head).unwrap_or_else(|| panic!("no {head:?} in\n{text}"));
        text[i..].lines().take(3).collect::<Vec<_>>().join("\n")
    };
    assert!(
        after("  TCP 80: allowed").contains("networkpolicy app/web-ports ingress rule 0"),
        "{text}"
    );
    assert!(after("  TCP 8000-8079: allowed").contains("web-ports"), "{text}");
    assert!(
        after("  TCP 8080: DENIED").contains("clusternetworkpolicy no-8080-from-other ingress rule 0 (deny-8080)"),
        "{text}"
    );
    assert!(after("  TCP 8081-8100: allowed").contains("web-ports"), "{text}");
    assert!(
        after("  TCP 8101-65535: DENIED").contains("no rule allows it"),
        "{text}"
    );
    assert!(after("  UDP 53: allowed").contains("web-ports"), "{text}");
    assert!(text.contains("  other protocols: DENIED"), "{text}");
    let ok = Command::new(env!("CARGO_BIN_EXE_npmctl"))
        .args(["ports", "-f", "/nonexistent.yaml", "--from", "a/b", "--to", "c/d"])
        .status()
        .unwrap()
        .success();
    assert!(!ok, "a missing file is an error");
}
