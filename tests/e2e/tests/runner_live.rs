//! The live runner's plumbing against the in-process API server and the
//! netns cluster, with a stand-in agent process that enforces nothing:
//! actions reach the API server and the cluster, `reset` brings both back
//! to the pristine model, and probing an unenforced cluster reports the
//! matrix that is really there (every pod reachable), so an expectation of
//! isolation fails with the expected and observed tables.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use npm_e2e::api::{namespace_path, pod_path};
use npm_e2e::runner::{parse_text, Engine, LiveRunner, Options};
use npm_sim::cases::Topology;

fn stand_in_agent() -> std::path::PathBuf {
    let p = std::env::temp_dir().join(format!("npm-e2e-fake-agent-{}.sh", std::process::id()));
    std::fs::write(&p, "#!/bin/sh\nexec sleep 600\n").expect("write the stand-in agent");
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    p
}

const CASE: &str = r#"
id: plumbing
title: runner plumbing
steps:
  - actions:
      - create_namespace: {namespace: w, labels: {team: new}}
      - create_pod: {pod: w/a, labels: {pod: a}}
      - create_pod: {pod: x/d, labels: {pod: d}}
      - delete_pod: {pod: y/b}
      - add_pod_labels: {pod: x/a, labels: {extra: "1"}}
      - set_namespace_labels: {namespace: z, labels: {}}
      - create_policy:
          apiVersion: networking.k8s.io/v1
          kind: NetworkPolicy
          metadata: {namespace: x, name: deny-from-zc}
          spec:
            podSelector: {}
            ingress: [{from: [{ipBlock: {cidr: "${CIDR32:z/c}"}}]}]
            policyTypes: [Ingress]
    probes:
      - port: 80
        protocol: TCP
        pods: [x/a, x/d, w/a, z/c]
        matrix:
          x/a: "1100"
          x/d: "1100"
          w/a: "0011"
          z/c: "1111"
"#;

/// The live runner on nftables with the stand-in agent (and its path).
fn start() -> (LiveRunner, std::path::PathBuf) {
    let agent = stand_in_agent();
    let opts = Options {
        engine: Engine::Nftables,
        agent_bin: agent.clone(),
        deadline: Duration::from_secs(2),
        settle: Duration::from_millis(50),
        startup_deadline: Duration::from_secs(2),
        ..Options::default()
    };
    (LiveRunner::start(opts).expect("start the live runner"), agent)
}

/// Shuts the runner down, removes the stand-in agent, and checks that no
/// netns of this process is left.
fn stop(r: LiveRunner, agent: std::path::PathBuf) {
    r.shutdown().expect("shutdown");
    let _ = std::fs::remove_file(agent);
    assert!(npm_e2e::cluster::own_netns().is_empty());
}

/// One live cluster at a time (shared pod addresses and names).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn actions_reset_and_probes_on_an_unenforced_cluster() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut r, agent) = start();
    let case = parse_text(CASE).expect("parse").remove(0);

    let (passed, report) = r.run_case(&case);
    // Nothing enforces: w/a -> x/a etc. connect, so the case fails and the
    // report shows both tables.
    assert!(!passed, "an unenforced cluster cannot pass: {report}");
    assert!(report.contains("expected:") && report.contains("observed:"), "{report}");
    assert!(
        report.contains("w/a -> x/a: expected blocked, got reachable"),
        "{report}"
    );

    // The actions reached the API server and the cluster.
    let api = r.api();
    assert!(api.get_opt(&namespace_path("w")).unwrap().is_some());
    assert!(api.get_opt(&pod_path("y", "b")).unwrap().is_none());
    assert!(r.cluster().pod("y", "b").is_none());
    let xd = api.get(&pod_path("x", "d")).unwrap();
    assert_eq!(xd["spec"]["nodeName"], "npm-node");
    assert_eq!(xd["status"]["phase"], "Running");
    assert_eq!(
        xd["status"]["podIP"],
        r.cluster().pod("x", "d").unwrap().ipv4.to_string()
    );
    let ports: Vec<String> = xd["spec"]["containers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["ports"][0]["name"].as_str().unwrap().to_string())
        .collect();
    assert!(ports.contains(&"serve-81-sctp".to_string()), "{ports:?}");
    let pol = api
        .get("/apis/networking.k8s.io/v1/namespaces/x/networkpolicies/deny-from-zc")
        .unwrap();
    let zc = r.cluster().pod("z", "c").unwrap().ipv4;
    assert_eq!(
        pol["spec"]["ingress"][0]["from"][0]["ipBlock"]["cidr"],
        format!("{zc}/32")
    );

    // Reset: back to the pristine model.
    r.reset().expect("reset");
    let api = r.api();
    assert!(api.get_opt(&namespace_path("w")).unwrap().is_none());
    assert!(api.get_opt(&pod_path("x", "d")).unwrap().is_none());
    assert!(r.cluster().pod("x", "d").is_none() && r.cluster().pod("w", "a").is_none());
    let yb = api.get(&pod_path("y", "b")).unwrap();
    assert_eq!(yb["status"]["podIP"], "198.18.2.2");
    assert!(r.cluster().pod("y", "b").is_some());
    let xa = api.get(&pod_path("x", "a")).unwrap();
    let want: BTreeMap<String, String> = [("pod".to_string(), "a".to_string())].into();
    let got: BTreeMap<String, String> = serde_json::from_value(xa["metadata"]["labels"].clone()).unwrap();
    assert_eq!(got, want);
    let z = api.get(&namespace_path("z")).unwrap();
    assert_eq!(z["metadata"]["labels"]["ns"], "z");
    let pols = api.get("/apis/networking.k8s.io/v1/networkpolicies").unwrap();
    assert_eq!(pols["items"].as_array().map(|a| a.len()), Some(0));
    assert_eq!(r.cluster().pods().count(), 9);

    // A case that expects full connectivity passes on the pristine cluster.
    let open = parse_text(
        "id: open\nsteps:\n  - actions: []\n    probes:\n      - port: 81\n        protocol: UDP\n        matrix: {x/a: '111111111', y/b: '111111111', z/c: '111111111'}\n",
    )
    .unwrap()
    .remove(0);
    let (passed, report) = r.run_case(&open);
    assert!(passed, "{report}");

    stop(r, agent);
}

/// A reset that fails half-way (the API server refuses the pods of one
/// house after the namespaces and the first houses' pods were created)
/// leaves the runner able to reset again: the next reset starts from a
/// clean slate instead of from a model the live cluster no longer matches
/// (which failed with "already exists" and then failed every case after
/// it), and the cluster it builds answers probes.
#[test]
fn a_reset_that_failed_half_way_does_not_fail_the_next() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (mut r, agent) = start();
    let slytherin = "network-policy-conformance-slytherin";
    r.api_server().expect("in-process API server").fail_next(
        1,
        500,
        Some(&format!("/api/v1/namespaces/{slytherin}/pods")),
    );
    let failed = r.reset_to(Topology::NetworkPolicyApi);
    assert!(failed.is_err(), "the injected failure fails the reset: {failed:?}");
    // Half-way: the first houses' pods are live, slytherin's are not.
    assert!(r
        .cluster()
        .pod("network-policy-conformance-gryffindor", "harry-potter-0")
        .is_some());
    assert!(r
        .api()
        .get_opt(&pod_path(slytherin, "draco-malfoy-0"))
        .unwrap()
        .is_none());

    r.reset_to(Topology::NetworkPolicyApi)
        .expect("the next reset succeeds after a failed one");
    let api = r.api();
    for (ns, pod) in r.model().snapshot.pods.keys() {
        let obj = api.get(&pod_path(ns, pod)).expect("every model pod is published");
        let live = r.cluster().pod(ns, pod).expect("every model pod is live");
        assert_eq!(obj["status"]["podIP"], live.ipv4.to_string(), "{ns}/{pod}");
    }
    assert_eq!(r.cluster().pods().count(), r.model().snapshot.pods.len());
    assert!(api.get_opt(&namespace_path("x")).unwrap().is_none());
    let open = parse_text(&format!(
        "topology: network-policy-api\ncases:\n- id: houses-open\n  steps:\n  - actions: []\n    probes:\n    - port: 80\n      protocol: TCP\n      pods: [{slytherin}/draco-malfoy-1]\n      matrix: {{network-policy-conformance-gryffindor/harry-potter-0: '1', {slytherin}/draco-malfoy-0: '1'}}\n"
    ))
    .unwrap()
    .remove(0);
    let (passed, report) = r.run_case(&open);
    assert!(passed, "{report}");

    stop(r, agent);
}
