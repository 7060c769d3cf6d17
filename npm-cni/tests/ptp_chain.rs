//! npm-cni chained after the real reference `ptp` plugin (Debian's containernetworking-plugins, with
//! `host-local` IPAM), called exactly as a container runtime calls a conflist: a named netns under
//! `/var/run/netns`, the `CNI_*` variables and `CNI_ARGS` the kubelet's runtimes pass, the config on
//! stdin and `prevResult` inserted as libcni inserts it. The agent is played by small unix-socket
//! listeners built on `npm_cni::proto`. Privileged: needs root (netns, veth).

mod common;

use std::os::unix::net::UnixListener;
use std::process::Command;
use std::time::Duration;

use common::{exec, fake_agent, npm_cni, temp_dir, Pod, CNI_BIN, CNI_VERSION, NETWORK};
use npm_cni::proto::{self, Request, Response};
use serde_json::{json, Value};

#[test]
fn add_fails_within_timeout_when_agent_is_missing_refusing_or_silent() {
    let pod = Pod::new("missing");
    let run = pod.npm("ADD", json!({}));
    let error = run.cni_error(11);
    assert_eq!(
        error["cniVersion"], CNI_VERSION,
        "an error carries the configuration's version"
    );
    assert!(
        error["msg"]
            .as_str()
            .unwrap()
            .contains(&pod.socket().display().to_string()),
        "{error}"
    );
    eprintln!(
        "ADD with the socket missing, timeoutSeconds 1: failed after {:?}",
        run.elapsed
    );
    assert!(
        run.elapsed >= Duration::from_millis(850) && run.elapsed < Duration::from_millis(1500),
        "{:?}",
        run.elapsed
    );

    // A socket file nobody listens on: connection refused.
    drop(UnixListener::bind(pod.socket()).unwrap());
    let run = pod.npm("ADD", json!({"timeoutSeconds": 2}));
    run.cni_error(11);
    eprintln!(
        "ADD with the socket refusing, timeoutSeconds 2: failed after {:?}",
        run.elapsed
    );
    assert!(
        run.elapsed >= Duration::from_millis(1850) && run.elapsed < Duration::from_millis(2500),
        "{:?}",
        run.elapsed
    );
    std::fs::remove_file(pod.socket()).unwrap();

    // A listener that accepts and never answers.
    let agent = fake_agent(&pod.socket(), 1, |_| None);
    let run = pod.npm("ADD", json!({}));
    let error = run.cni_error(11);
    assert!(
        error["msg"].as_str().unwrap().contains("did not answer within"),
        "{error}"
    );
    eprintln!(
        "ADD with a silent agent, timeoutSeconds 1: failed after {:?}",
        run.elapsed
    );
    assert!(
        run.elapsed >= Duration::from_millis(950) && run.elapsed < Duration::from_millis(1500),
        "{:?}",
        run.elapsed
    );
    assert_eq!(agent.join().unwrap().len(), 1);
}

#[test]
fn fail_open_prints_prev_result_unchanged() {
    let pod = Pod::new("failopen");
    let run = pod.npm("ADD", json!({"failOpen": true}));
    assert_eq!(run.code, 0, "{} {}", run.stdout, run.stderr);
    assert_eq!(run.json(), pod.result);
    assert!(run.stderr.contains("failOpen"), "{}", run.stderr);
    // CHECK forgives an absent agent as well.
    let run = pod.npm("CHECK", json!({"failOpen": true}));
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{}", run.stderr);
}

#[test]
fn agent_answering_garbage_or_refusing_is_a_cni_error() {
    let pod = Pod::new("garbage");
    let agent = fake_agent(&pod.socket(), 1, |_| Some(b"garbage\n".to_vec()));
    let error = pod.npm("ADD", json!({"failOpen": true})).cni_error(101);
    assert!(error["msg"].as_str().unwrap().contains("garbage"), "{error}");
    agent.join().unwrap();
    std::fs::remove_file(pod.socket()).unwrap();

    let agent = fake_agent(&pod.socket(), 2, |line| {
        let Request::Add(a) = proto::decode_request(line).unwrap() else {
            panic!("not an ADD")
        };
        Some(proto::encode_response(&Response::error(
            format!("pod {} is not known", a.pod.name),
            false,
        )))
    });
    let error = pod.npm("ADD", json!({})).cni_error(100);
    assert!(error["msg"].as_str().unwrap().contains("is not known"), "{error}");
    // failOpen does not override an agent's explicit refusal.
    pod.npm("ADD", json!({"failOpen": true})).cni_error(100);
    agent.join().unwrap();
}

#[test]
fn add_check_del_with_an_agent_that_programs() {
    let pod = Pod::new("programmed");
    let agent = fake_agent(&pod.socket(), 3, |_| {
        Some(proto::encode_response(&Response::ok(Some(42))))
    });

    let add = pod.npm("ADD", json!({}));
    assert_eq!(add.code, 0, "{} {}", add.stdout, add.stderr);
    assert_eq!(add.json(), pod.result, "ADD must output prevResult unchanged");
    eprintln!("ADD with an agent answering at once: {:?}", add.elapsed);
    let check = pod.npm("CHECK", json!({}));
    assert_eq!((check.code, check.stdout.as_str()), (0, ""), "{}", check.stderr);
    let del = pod.npm("DEL", json!({}));
    assert_eq!((del.code, del.stdout.as_str()), (0, ""), "{}", del.stderr);

    let lines = agent.join().unwrap();
    let requests: Vec<Request> = lines.iter().map(|l| proto::decode_request(l).unwrap()).collect();
    let Request::Add(add) = &requests[0] else {
        panic!("first request {:?}", requests[0])
    };
    assert_eq!(
        (add.pod.namespace.as_str(), add.pod.name.as_str(), add.pod.uid.as_str()),
        (pod.namespace.as_str(), pod.name.as_str(), pod.uid.as_str())
    );
    assert_eq!(add.container_id, pod.container_id);
    assert_eq!(add.netns, pod.netns_path());
    assert_eq!(add.network, NETWORK);
    assert_eq!(add.ifname, "eth0");
    let veth = pod.host_veth();
    assert_eq!(
        add.host_interfaces.iter().map(|i| i.name.as_str()).collect::<Vec<_>>(),
        [veth.as_str()]
    );
    let link = Command::new("ip")
        .args(["-j", "link", "show", "dev", &veth])
        .output()
        .unwrap();
    assert!(link.status.success(), "host veth {veth} is not in the root netns");
    let link: Value = serde_json::from_slice(&link.stdout).unwrap();
    assert_eq!(link[0]["link_type"], "ether");
    assert_eq!(add.sandbox_interface.as_ref().map(|i| i.name.as_str()), Some("eth0"));
    assert_eq!(add.ips.len(), 1);
    assert_eq!(add.ips[0].address.to_string(), pod.ip());
    assert_eq!(add.ips[0].family, proto::IpFamily::Ipv4);
    assert!(matches!(&requests[1], Request::Check(c) if c == add));
    let Request::Del(del) = &requests[2] else {
        panic!("third request {:?}", requests[2])
    };
    assert_eq!(
        (del.container_id.as_str(), del.ifname.as_str()),
        (pod.container_id.as_str(), "eth0")
    );
    assert_eq!(del.ips, add.ips);
    assert_eq!(del.pod.as_ref(), Some(&add.pod));
}

#[test]
fn del_succeeds_with_the_agent_down() {
    let pod = Pod::new("deldown");
    let run = pod.npm("DEL", json!({"timeoutSeconds": 5}));
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{}", run.stderr);
    assert!(
        run.elapsed < Duration::from_secs(1),
        "DEL waited {:?} for an absent agent",
        run.elapsed
    );
    // Again (idempotent), and without prevResult, netns or CNI_ARGS, as a runtime may call it.
    let conf = pod.plugin_conf(&json!({"type": "npm-cni", "agentSocket": pod.socket()}), None);
    let env: Vec<_> = pod
        .env_with_args("DEL", "")
        .into_iter()
        .filter(|(k, _)| k != "CNI_NETNS")
        .collect();
    let run = exec(npm_cni(), &env, &conf);
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{}", run.stderr);
    // A refused socket is no different.
    drop(UnixListener::bind(pod.socket()).unwrap());
    let run = pod.npm("DEL", json!({}));
    assert_eq!((run.code, run.stdout.as_str()), (0, ""), "{}", run.stderr);
}

#[test]
fn version_reply() {
    let run = exec(
        npm_cni(),
        &[("CNI_COMMAND".into(), "VERSION".into())],
        r#"{"cniVersion":"1.0.0"}"#,
    );
    assert_eq!(run.code, 0);
    assert_eq!(
        run.json(),
        json!({"cniVersion": "1.0.0", "supportedVersions": ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]})
    );
    let run = exec(npm_cni(), &[("CNI_COMMAND".into(), "VERSION".into())], "");
    assert_eq!(run.json()["cniVersion"], "1.1.0");
}

#[test]
fn bad_input_gets_cni_errors_with_spec_codes() {
    let pod = Pod::new("badinput");

    // Not JSON: 6 (decoding failure).
    let run = exec(npm_cni(), &pod.env("ADD"), r#"{"cniVersion":"1.0.0","name":"#);
    let error = run.cni_error(6);
    assert!(error["msg"].as_str().unwrap().contains("not valid JSON"), "{error}");
    // A bad key: 7 (invalid network config).
    pod.npm("ADD", json!({"timeoutSeconds": "soon"})).cni_error(7);
    // No prevResult: 7.
    let conf = pod.plugin_conf(&json!({"type": "npm-cni", "agentSocket": pod.socket()}), None);
    let error = exec(npm_cni(), &pod.env("ADD"), &conf).cni_error(7);
    assert!(error["msg"].as_str().unwrap().contains("prevResult"), "{error}");
    // A prevResult that is not a result: 6.
    let mut broken = pod.result.clone();
    broken["ips"] = json!([{"address": "not-an-ip", "interface": 1}]);
    let conf = pod.plugin_conf(&json!({"type": "npm-cni", "agentSocket": pod.socket()}), Some(&broken));
    exec(npm_cni(), &pod.env("ADD"), &conf).cni_error(6);
    // No K8S_POD_UID in CNI_ARGS: 4 (invalid environment), naming the key.
    let args = pod.cni_args().replace(&format!(";K8S_POD_UID={}", pod.uid), "");
    let error = exec(npm_cni(), &pod.env_with_args("ADD", &args), &pod.npm_conf(json!({}))).cni_error(4);
    assert!(error["msg"].as_str().unwrap().contains("K8S_POD_UID"), "{error}");
    assert!(
        error["details"]
            .as_str()
            .unwrap()
            .contains("container runtime must pass"),
        "{error}"
    );
    // With failOpen the pod starts without the agent: its previous result back.
    let run = exec(
        npm_cni(),
        &pod.env_with_args("ADD", &args),
        &pod.npm_conf(json!({"failOpen": true})),
    );
    assert_eq!(run.code, 0, "{}", run.json());
    assert_eq!(run.json()["ips"], pod.result["ips"]);
    // No CNI_NETNS: 4.
    let env: Vec<_> = pod.env("ADD").into_iter().filter(|(k, _)| k != "CNI_NETNS").collect();
    let error = exec(npm_cni(), &env, &pod.npm_conf(json!({}))).cni_error(4);
    assert!(error["msg"].as_str().unwrap().contains("CNI_NETNS"), "{error}");
    // An unsupported version: 1.
    let conf = pod.npm_conf(json!({})).replace("\"1.0.0\"", "\"0.2.0\"");
    let run = exec(npm_cni(), &pod.env("ADD"), &conf);
    assert_ne!(run.code, 0);
    assert_eq!(run.json()["code"], 1);
}

#[test]
fn spec_0_4_0_chain() {
    let pod = Pod::with_version("v040", "0.4.0");
    assert_eq!(pod.result["cniVersion"], "0.4.0");
    assert_eq!(pod.result["ips"][0]["version"], "4", "ptp answers the 0.4.0 layout");
    let agent = fake_agent(&pod.socket(), 1, |_| Some(proto::encode_response(&Response::ok(None))));
    let add = pod.npm("ADD", json!({}));
    assert_eq!(add.code, 0, "{} {}", add.stdout, add.stderr);
    assert_eq!(add.json(), pod.result);
    let Request::Add(request) = proto::decode_request(&agent.join().unwrap()[0]).unwrap() else {
        panic!("not ADD")
    };
    assert_eq!(request.cni_version, "0.4.0");
    assert_eq!(request.ips[0].address.to_string(), pod.ip());
    assert_eq!(request.host_interfaces[0].name, pod.host_veth());
    // Without an agent, the error result carries the configuration's version.
    let run = pod.npm("ADD", json!({}));
    assert_eq!(run.cni_error(11)["cniVersion"], "0.4.0");
}

#[test]
fn spec_0_3_1_chain() {
    // The real ptp plugin configured as 0.3.1 answers the 0.3.x layout; npm-cni reads it, hands the
    // attachment to the agent and prints the result back unchanged.
    let pod = Pod::with_version("v031", "0.3.1");
    assert_eq!(pod.result["cniVersion"], "0.3.1");
    assert_eq!(pod.result["ips"][0]["version"], "4", "ptp answers the 0.3.1 layout");
    assert!(pod.result["ips"][0]["interface"].is_u64(), "{}", pod.result);
    let agent = fake_agent(&pod.socket(), 2, |_| Some(proto::encode_response(&Response::ok(None))));
    let add = pod.npm("ADD", json!({}));
    assert_eq!(add.code, 0, "{} {}", add.stdout, add.stderr);
    assert_eq!(add.json(), pod.result, "ADD must output prevResult unchanged");
    // CHECK does not exist before 0.4.0: an incompatible-version error, without asking the agent.
    let check = pod.npm("CHECK", json!({}));
    assert_eq!(check.cni_error(1)["cniVersion"], "0.3.1");
    // libcni gives 0.3.x plugins no prevResult on DEL: the agent evicts by container id.
    let conf = pod.plugin_conf(&json!({"type": "npm-cni", "agentSocket": pod.socket()}), None);
    let del = exec(npm_cni(), &pod.env("DEL"), &conf);
    assert_eq!((del.code, del.stdout.as_str()), (0, ""), "{}", del.stderr);
    let requests: Vec<Request> = agent
        .join()
        .unwrap()
        .iter()
        .map(|l| proto::decode_request(l).unwrap())
        .collect();
    let Request::Add(request) = &requests[0] else {
        panic!("not ADD: {:?}", requests[0])
    };
    assert_eq!(request.cni_version, "0.3.1");
    assert_eq!(request.ips[0].address.to_string(), pod.ip());
    assert_eq!(request.ips[0].family, proto::IpFamily::Ipv4);
    assert_eq!(request.host_interfaces[0].name, pod.host_veth());
    assert_eq!(
        request.sandbox_interface.as_ref().map(|i| i.name.as_str()),
        Some("eth0")
    );
    let Request::Del(del) = &requests[1] else {
        panic!("not DEL: {:?}", requests[1])
    };
    assert_eq!(
        (del.container_id.as_str(), del.ifname.as_str(), del.pod.as_ref()),
        (pod.container_id.as_str(), "eth0", Some(&request.pod))
    );
}

#[test]
fn status_and_gc_reach_the_agent() {
    let dir = temp_dir("status");
    let socket = dir.join("agent.sock");
    let conf = json!({
        "cniVersion": "1.1.0", "name": NETWORK, "type": "npm-cni", "agentSocket": socket,
        "cni.dev/valid-attachments": [{"containerID": "c1", "ifname": "eth0"}],
    })
    .to_string();
    let env = |command: &str| {
        vec![
            ("CNI_COMMAND".to_owned(), command.to_owned()),
            ("CNI_PATH".into(), CNI_BIN.into()),
        ]
    };

    let agent = fake_agent(&socket, 2, |_| Some(proto::encode_response(&Response::ok(None))));
    let status = exec(npm_cni(), &env("STATUS"), &conf);
    assert_eq!((status.code, status.stdout.as_str()), (0, ""), "{}", status.stderr);
    let gc = exec(npm_cni(), &env("GC"), &conf);
    assert_eq!((gc.code, gc.stdout.as_str()), (0, ""), "{}", gc.stderr);
    let requests: Vec<Request> = agent
        .join()
        .unwrap()
        .iter()
        .map(|l| proto::decode_request(l).unwrap())
        .collect();
    assert_eq!(requests[0], Request::Status);
    let Request::Gc(gc) = &requests[1] else {
        panic!("not GC: {:?}", requests[1])
    };
    assert_eq!(gc.network, NETWORK);
    assert_eq!(
        gc.valid_attachments,
        vec![proto::AttachmentId {
            container_id: "c1".into(),
            ifname: "eth0".into()
        }]
    );

    std::fs::remove_file(&socket).unwrap();
    let error = exec(npm_cni(), &env("STATUS"), &conf).cni_error(50);
    assert_eq!(error["cniVersion"], "1.1.0");
    exec(npm_cni(), &env("GC"), &conf).cni_error(11);
    std::fs::remove_dir_all(&dir).unwrap();
}
