//! `kubectl npm` (the built binary) against the test API server and a real
//! agent on a netns cluster (x/y/z pods, one node), on eBPF and on
//! nftables: `y/allow-xa-80` isolates `y/b`'s ingress and allows TCP 80
//! from `x/a`. The agent is registered as the chart runs it (a host-network
//! pod labelled `app.kubernetes.io/name=npm-agent` in `kube-system` on the
//! pods' node, `--debug-addr` in its arguments); the API server's RBAC
//! grants `create` on `pods/portforward` there to group `sre` only.
//!
//! - `why` for allowed and denied pairs gives the agent's verdicts, the
//!   deciding rule or isolating policy, and on eBPF the kernel's dry-run
//!   verdict (`null` on nftables);
//! - a user without the grant gets an error naming the verb, the resource
//!   and the namespace;
//! - `status NS/POD` shows the pod's `npm.io/PolicyEnforced` condition;
//!   `status` the agent ready with its map fill; an agent pod whose debug
//!   port answers nothing is reported by name;
//! - `observe --pod y/b` prints the denied probe's record with its node
//!   and the agent's time.
//!
//! Needs root, the agent binary (`cargo build --bin npm-agent`, or
//! `NPM_AGENT_BIN`) and, for eBPF, the BPF object (`NPM_EBPF_OBJECT`).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use npm_e2e::fixtures::{probe_config, start_with_setup, tcp_probe as probe, wait_enforced, ALLOW_XA_80};
use npm_e2e::probe::probe_all;
use npm_e2e::runner::{Engine, LiveRunner};
use npm_testapi::{auth::UserInfo, Kind};
use serde_json::{json, Value};

const NODE: &str = "npm-node";

/// Registers the agent pod of `node` whose debug listener is `port`, and
/// the RBAC and users of the test; returns the kubeconfigs of alice
/// (granted) and bob (not).
fn register(r: &LiveRunner, engine: Engine, dir: &Path, port: u16) -> (PathBuf, PathBuf) {
    let srv = r.api_server().expect("the in-process API server");
    // Already there on some runs: the error is ignored.
    let _ = srv.create_object(Kind::Namespace, None, json!({"metadata": {"name": "kube-system"}}));
    let dataplane = if engine == Engine::Nftables { "nftables" } else { "ebpf" };
    agent_pod(srv, "npm-agent-live", NODE, port, dataplane);
    srv.add_rbac(&[
        json!({"kind": "Role", "metadata": {"name": "npm-debug", "namespace": "kube-system"},
               "rules": [{"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]}]}),
        json!({"kind": "RoleBinding", "metadata": {"name": "npm-debug", "namespace": "kube-system"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "npm-debug"},
               "subjects": [{"kind": "Group", "name": "sre"}]}),
    ]);
    let user = |name: &str, groups: &[&str]| UserInfo {
        username: name.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        ..Default::default()
    };
    srv.add_token("alice-token", user("alice", &["sre"]));
    srv.add_token("bob-token", user("bob", &["dev"]));
    let kubeconfig = |who: &str| {
        let path = dir.join(format!("{who}.kubeconfig"));
        let text = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster:\n    server: {}\ncontexts:\n- name: t\n  context:\n    cluster: t\n    user: {who}\ncurrent-context: t\nusers:\n- name: {who}\n  user:\n    token: {who}-token\n",
            srv.url()
        );
        std::fs::write(&path, text).expect("write a kubeconfig");
        path
    };
    (kubeconfig("alice"), kubeconfig("bob"))
}

/// An agent pod as the chart's DaemonSet makes it, on `node`, its debug
/// listener on the node's loopback port `port`.
fn agent_pod(srv: &npm_testapi::TestApiServer, name: &str, node: &str, port: u16, dataplane: &str) {
    srv.create_object(
        Kind::Pod,
        Some("kube-system"),
        json!({"metadata": {"name": name, "namespace": "kube-system",
                            "labels": {"app.kubernetes.io/name": "npm-agent", "app.kubernetes.io/instance": "npm"}},
               "spec": {"nodeName": node, "hostNetwork": true,
                        "containers": [{"name": "agent", "image": "localhost/npm-agent:latest",
                                        "args": ["run", format!("--dataplane={dataplane}"), format!("--debug-addr=127.0.0.1:{port}")]}]},
               "status": {"podIP": "127.0.0.1", "phase": "Running",
                          "conditions": [{"type": "Ready", "status": "True"}]}}),
    )
    .expect("create the agent pod");
}

/// Runs `kubectl-npm` with `kubeconfig`: (success, stdout, stderr).
fn kubectl_npm(kubeconfig: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .arg("--kubeconfig")
        .arg(kubeconfig)
        .args(args)
        .output()
        .expect("run kubectl-npm");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

fn json_of(kubeconfig: &Path, args: &[&str]) -> Value {
    let (ok, out, err) = kubectl_npm(kubeconfig, args);
    assert!(ok, "kubectl npm {args:?} failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
}

fn ingress(v: &Value) -> &Value {
    v["directions"]
        .as_array()
        .and_then(|d| d.iter().find(|d| d["direction"] == "ingress"))
        .expect("an ingress direction")
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

fn run(engine: Engine) {
    let r = start_with_setup(engine, &[], ALLOW_XA_80);
    let cfg = probe_config(&r, 2);
    let allowed = [probe(&r, "x/a", "y/b", 80)];
    let denied = [probe(&r, "x/a", "y/b", 81), probe(&r, "z/c", "y/b", 80)];
    wait_enforced(&format!("{engine:?}"), &cfg, &allowed, &denied);
    let dir = r.workdir().to_path_buf();
    let (alice, bob) = register(&r, engine, &dir, r.debug_addr().expect("the debug address").port());

    // why: allowed and denied pairs, by name and by address.
    let why = |from: &str, to: &str, port: u16| {
        json_of(
            &alice,
            &[
                "why",
                from,
                to,
                "--port",
                &port.to_string(),
                "--protocol",
                "TCP",
                "-o",
                "json",
            ],
        )
    };
    let allow = why("x/a", "y/b", 80);
    let deny = why("x/a", "y/b", 81);
    let zc_ip = r.cluster().pod("z", "c").unwrap().ipv4.to_string();
    let by_ip = why(&zc_ip, "y/b", 80);
    let open = why("y/b", "z/c", 81);
    eprintln!("{engine:?} allow: {allow}\n{engine:?} deny: {deny}");
    assert_eq!(allow["verdict"], "allow", "{allow}");
    let rule = &ingress(&allow)["policies"][0];
    assert_eq!(
        (&rule["namespace"], &rule["name"], &rule["rule"], &rule["effect"]),
        (
            &json!("y"),
            &json!("allow-xa-80"),
            &json!("ingress[0]"),
            &json!("allow")
        ),
        "{allow}"
    );
    assert_eq!(ingress(&allow)["node"], NODE, "{allow}");
    assert_eq!(deny["verdict"], "deny", "{deny}");
    assert_eq!(ingress(&deny)["reason"], "PolicyDenied", "{deny}");
    let iso = &ingress(&deny)["policies"][0];
    assert_eq!(
        (&iso["name"], &iso["effect"]),
        (&json!("allow-xa-80"), &json!("isolates")),
        "{deny}"
    );
    assert_eq!(by_ip["verdict"], "deny", "{by_ip}");
    assert_eq!(open["verdict"], "allow", "{open}");
    assert_eq!(ingress(&open)["reason"], "NotIsolated", "{open}");
    for v in [&allow, &deny, &by_ip, &open] {
        assert_eq!(v["mismatch"], Value::Null, "{v}");
        let k = &ingress(v)["kernel"];
        match engine {
            Engine::Ebpf => assert_eq!(k["verdict"], ingress(v)["verdict"], "{v}"),
            _ => assert_eq!(*k, Value::Null, "{v}"),
        }
    }
    let (ok, text, err) = kubectl_npm(&alice, &["why", "x/a", "y/b", "--port", "81"]);
    assert!(ok, "{err}");
    assert!(text.starts_with("DENIED x/a ("), "{text}");
    assert!(text.contains("y/allow-xa-80"), "{text}");
    let (ok, yaml, err) = kubectl_npm(&alice, &["why", "x/a", "y/b", "--port", "80", "-o", "yaml"]);
    assert!(ok && yaml.contains("verdict: allow"), "{yaml}{err}");

    // Without the grant: the missing permission, named.
    let (ok, _, err) = kubectl_npm(&bob, &["why", "x/a", "y/b", "--port", "80"]);
    assert!(!ok, "bob was let through");
    assert!(
        err.contains("you need `create` on `pods/portforward` in namespace kube-system"),
        "{err}"
    );
    let (ok, _, err) = kubectl_npm(&bob, &["status"]);
    assert!(!ok && err.contains("`create` on `pods/portforward`"), "{err}");

    // status POD: the condition the agent wrote once y/b's policy was in
    // the kernel (written by its own rate-limited writer: waited for).
    let until = Instant::now() + Duration::from_secs(30);
    let pod = loop {
        let v = json_of(&alice, &["status", "y/b", "-o", "json"]);
        if v["enforced"]["status"] == "True" || Instant::now() > until {
            break v;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(pod["enforced"]["status"], "True", "{pod}");
    assert_eq!(pod["enforced"]["reason"], "Enforced", "{pod}");
    assert!(pod["enforced"]["since"].is_string(), "{pod}");
    assert_eq!(pod["node"], NODE, "{pod}");
    let (ok, text, _) = kubectl_npm(&alice, &["status", "y/b"]);
    eprintln!("{engine:?} status y/b:\n{text}");
    assert!(
        ok && text.contains("npm.io/PolicyEnforced: True (Enforced) since "),
        "{text}"
    );

    // status: the agent ready, its maps (eBPF); an agent pod whose debug
    // port answers nothing is named, the others still reported.
    agent_pod(
        r.api_server().unwrap(),
        "npm-agent-gone",
        "node-gone",
        free_port(),
        "ebpf",
    );
    let all = json_of(&alice, &["status", "-o", "json"]);
    eprintln!("{engine:?} status:\n{}", kubectl_npm(&alice, &["status"]).1);
    let of = |node: &str| {
        all.as_array()
            .and_then(|a| a.iter().find(|s| s["node"] == node))
            .unwrap_or_else(|| panic!("no status of {node}: {all}"))
            .clone()
    };
    let live = of(NODE);
    assert_eq!(live["ready"], true, "{all}");
    assert_eq!(live["held_removals"], false, "{all}");
    assert!(live["version"].is_string(), "{all}");
    if engine == Engine::Ebpf {
        assert!(live["maps"].as_array().is_some_and(|m| !m.is_empty()), "{all}");
        // What the agent attached in, as it reports it (`auto` resolved).
        assert!(live["attach_in_use"] == "tcx" || live["attach_in_use"] == "tc", "{all}");
    } else {
        assert!(live["attach_in_use"].is_null(), "{all}");
    }
    assert_eq!(live["dataplane"], format!("{engine:?}").to_lowercase(), "{all}");
    let gone = of("node-gone");
    assert!(
        gone["error"]
            .as_str()
            .is_some_and(|e| e.contains("kube-system/npm-agent-gone") && e.contains("no answer on its debug port")),
        "{all}"
    );

    // observe: the denied probe's record, with its node.
    let mut child = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .arg("--kubeconfig")
        .arg(&alice)
        .args(["observe", "--pod", "y/b", "--verdict", "deny", "-o", "json"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start kubectl npm observe");
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let until = Instant::now() + Duration::from_secs(30);
    let record = loop {
        // Probe until a record arrives (the stream may subscribe after the
        // first probes; flow logs are rate-limited per verdict).
        probe_all(&denied[..1], &cfg);
        match rx.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => break serde_json::from_str::<Value>(&line).unwrap_or_else(|e| panic!("{e}: {line}")),
            Err(_) => assert!(Instant::now() < until, "{engine:?}: no observed record"),
        }
    };
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(record["node"], NODE, "{record}");
    assert_eq!(record["verdict"], "deny", "{record}");
    assert_eq!(record["pod"]["name"], "b", "{record}");
    // The agent's time of the packet, RFC 3339 (what `observe` merges by).
    assert!(
        record["time"]
            .as_str()
            .is_some_and(|t| t.parse::<k8s_openapi::jiff::Timestamp>().is_ok()),
        "{record}"
    );
    r.shutdown().expect("shutdown");
}

/// One live cluster at a time (shared pod addresses).
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[test]
fn kubectl_npm_on_ebpf() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Engine::Ebpf);
}

#[test]
fn kubectl_npm_on_nftables() {
    let _g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    run(Engine::Nftables);
}
