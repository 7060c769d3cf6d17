//! `kubectl npm observe` (the built binary) against the test API server
//! and three stand-in agents (a debug listener each, on this machine's
//! loopback, reached through `pods/portforward` of an agent pod per node):
//! the records of several nodes are printed in the order of their `time`,
//! not of their arrival, and a node whose stream goes silent (not even
//! the keepalive) is given up after `--idle-timeout`, named on stderr,
//! while the other nodes' records keep coming. No agent and no root
//! needed: the stand-ins answer `/observe` as the agent does (an NDJSON
//! stream, an empty keepalive line on subscribing).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use npm_testapi::{auth::UserInfo, Kind, Options, TestApiServer};
use serde_json::{json, Value};

/// An agent pod of the chart on `node` whose debug listener is `port`.
fn agent_pod(srv: &TestApiServer, node: &str, port: u16) {
    srv.create_object(
        Kind::Pod,
        Some("kube-system"),
        json!({"metadata": {"name": format!("npm-agent-{node}"), "namespace": "kube-system",
                            "labels": {"app.kubernetes.io/name": "npm-agent"}},
               "spec": {"nodeName": node, "hostNetwork": true,
                        "containers": [{"name": "agent", "image": "localhost/npm-agent:latest",
                                        "args": ["run", format!("--debug-addr=127.0.0.1:{port}")]}]},
               "status": {"podIP": "127.0.0.1", "phase": "Running",
                          "conditions": [{"type": "Ready", "status": "True"}]}}),
    )
    .expect("create the agent pod");
}

/// A flow record of second `s` (past 15:00:00).
fn record(s: u32) -> String {
    format!(
        r#"{{"time":"2026-12-07T15:00:{s:02}.5Z","verdict":"deny","reason":"policy-denied","direction":"ingress","pod":{{"namespace":"y","name":"b"}},"peer":{{"kind":"world"}},"src":"1.1.1.1:{s}","dst":"10.0.0.2:80","protocol":"TCP"}}"#
    )
}

/// Accepts one `/observe` request on `l`, answers its head and the
/// subscription keepalive; returns the connection.
fn subscribed(l: &TcpListener) -> TcpStream {
    let (mut c, _) = l.accept().expect("accept");
    let mut head = Vec::new();
    let mut byte = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        c.read_exact(&mut byte).expect("read the request");
        head.push(byte[0]);
    }
    assert!(head.starts_with(b"GET /observe"), "{}", String::from_utf8_lossy(&head));
    c.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: application/x-ndjson\r\nConnection: close\r\n\r\n\n")
        .expect("answer");
    c
}

fn send(c: &mut TcpStream, seconds: &[u32]) {
    for s in seconds {
        writeln!(c, "{}", record(*s)).expect("send a record");
    }
    c.flush().expect("flush");
}

#[test]
fn observe_merges_nodes_in_time_order_and_gives_up_a_silent_one() {
    let srv = TestApiServer::start_background(Options::default()).expect("the test API server");
    // kube-system may be there already.
    let _ = srv.create_object(Kind::Namespace, None, json!({"metadata": {"name": "kube-system"}}));
    srv.add_rbac(&[
        json!({"kind": "Role", "metadata": {"name": "npm-debug", "namespace": "kube-system"},
               "rules": [{"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]},
                         {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}]}),
        json!({"kind": "RoleBinding", "metadata": {"name": "npm-debug", "namespace": "kube-system"},
               "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "npm-debug"},
               "subjects": [{"kind": "User", "name": "alice"}]}),
    ]);
    srv.add_token(
        "alice-token",
        UserInfo {
            username: "alice".into(),
            ..Default::default()
        },
    );
    let dir = std::env::temp_dir().join(format!("kubectl-npm-observe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let kubeconfig = dir.join("alice.kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: t\n  cluster:\n    server: {}\ncontexts:\n- name: t\n  context:\n    cluster: t\n    user: alice\ncurrent-context: t\nusers:\n- name: alice\n  user:\n    token: alice-token\n",
            srv.url()
        ),
    )
    .unwrap();
    let listeners: Vec<TcpListener> = (0..3).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    for (i, l) in listeners.iter().enumerate() {
        agent_pod(&srv, &format!("n{}", i + 1), l.local_addr().unwrap().port());
    }
    let [l1, l2, l3] = <[TcpListener; 3]>::try_from(listeners).unwrap();
    let (n2_sent, n2_done) = mpsc::channel::<()>();
    let (n3_given_up, n3_gone) = mpsc::channel::<()>();
    // n2 sends its records first, all later than n1's first.
    let t2 = std::thread::spawn(move || {
        let mut c = subscribed(&l2);
        send(&mut c, &[2, 4]);
        n2_sent.send(()).unwrap();
    });
    // n1 sends after n2 (so they arrive out of time order), then once n3
    // was given up, one more: the others are still followed.
    let t1 = std::thread::spawn(move || {
        let mut c = subscribed(&l1);
        n2_done.recv().unwrap();
        send(&mut c, &[1, 3]);
        // Keepalives meanwhile, as an idle agent sends them.
        while let Err(mpsc::RecvTimeoutError::Timeout) = n3_gone.recv_timeout(Duration::from_millis(300)) {
            if c.write_all(b"\n").and_then(|()| c.flush()).is_err() {
                return;
            }
        }
        let _ = writeln!(c, "{}", record(5));
    });
    // n3 subscribes and then says nothing, not even a keepalive.
    let t3 = std::thread::spawn(move || {
        let c = subscribed(&l3);
        std::thread::sleep(Duration::from_secs(120));
        drop(c);
    });
    // A window far longer than the test: the order comes from the merge
    // (each node's latest time, the ends of streams), not from waiting.
    let mut child = Command::new(env!("CARGO_BIN_EXE_kubectl-npm"))
        .arg("--kubeconfig")
        .arg(&kubeconfig)
        .args(["observe", "-o", "json", "--sort-window", "300", "--idle-timeout", "2"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run kubectl-npm observe");
    // A safety net only: without the idle timeout the command would
    // follow n3 forever; it is killed then and the assertions say so.
    let pid = child.id().to_string();
    let (finished, watchdog) = mpsc::channel::<()>();
    std::thread::spawn(move || {
        if let Err(mpsc::RecvTimeoutError::Timeout) = watchdog.recv_timeout(Duration::from_secs(90)) {
            let _ = Command::new("kill").arg(&pid).status();
        }
    });
    let stderr = BufReader::new(child.stderr.take().unwrap());
    let errors = std::thread::spawn(move || {
        let mut text = String::new();
        let mut n3_given_up = Some(n3_given_up);
        for line in stderr.lines().map_while(Result::ok) {
            if line.contains("node n3") && line.contains("nothing from it for 2 s") {
                if let Some(tx) = n3_given_up.take() {
                    tx.send(()).unwrap();
                }
            }
            text.push_str(&line);
            text.push('\n');
        }
        text
    });
    let mut stdout = String::new();
    child.stdout.take().unwrap().read_to_string(&mut stdout).unwrap();
    let status = child.wait().unwrap();
    let _ = finished.send(());
    let stderr = errors.join().unwrap();
    t1.join().unwrap();
    t2.join().unwrap();
    drop(t3);
    let got: Vec<(String, String)> = stdout
        .lines()
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}"));
            (
                v["node"].as_str().unwrap().into(),
                v["time"].as_str().unwrap()[17..19].into(),
            )
        })
        .collect();
    let want: Vec<(String, String)> = [("n1", "01"), ("n2", "02"), ("n1", "03"), ("n2", "04"), ("n1", "05")]
        .iter()
        .map(|(n, s)| (n.to_string(), s.to_string()))
        .collect();
    assert_eq!(got, want, "stdout:\n{stdout}\nstderr:\n{stderr}");
    // n3 named, with its pod and what to do; the command ended on its own
    // once every stream had ended, as an error.
    assert!(
        stderr.contains("the agent on node n3 (pod kube-system/npm-agent-n3)")
            && stderr.contains("hung or unreachable (--idle-timeout); no longer following it (still following "),
        "{stderr}"
    );
    assert!(!status.success(), "{stderr}");
    assert!(stderr.contains("the flow streams of 3 of 3 nodes failed"), "{stderr}");
    std::fs::remove_dir_all(&dir).unwrap();
}
