//! `npm-cni install` and `npm-cni uninstall` on real files in private temp directories, run as the
//! chart's init container runs them (the binary, with arguments), and one end-to-end check: the
//! conflist as installed run the way libcni runs a chain (ptp ADD, then the INSTALLED npm-cni copy
//! found through `CNI_PATH` with `prevResult`), then uninstalled back to the original bytes.
//! The end-to-end test is privileged (netns, veth).

mod common;

use std::fs;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::thread;
use std::time::{Duration, Instant};

use common::{exec, fake_agent, npm_cni, temp_dir, Pod, Run, CNI_BIN, NETWORK};
use npm_cni::proto::{self, Request, Response};
use serde_json::{json, Value};

/// A node's CNI directories: `bin/` and `conf/` in a private temp directory.
struct Node {
    root: PathBuf,
}

impl Node {
    fn new(case: &str) -> Self {
        let root = temp_dir(case);
        fs::create_dir(root.join("bin")).unwrap();
        fs::create_dir(root.join("conf")).unwrap();
        Node { root }
    }

    fn bin(&self) -> PathBuf {
        self.root.join("bin")
    }

    fn conf(&self) -> PathBuf {
        self.root.join("conf")
    }

    fn write_conf(&self, name: &str, text: &str) -> PathBuf {
        let path = self.conf().join(name);
        fs::write(&path, text).unwrap();
        path
    }

    fn dirs(&self) -> Vec<String> {
        vec![
            format!("--bin-dir={}", self.bin().display()),
            format!("--conf-dir={}", self.conf().display()),
        ]
    }

    fn install(&self, extra: &[&str]) -> Run {
        let mut args = vec!["install".to_owned()];
        args.extend(self.dirs());
        args.extend(extra.iter().map(|a| a.to_string()));
        cli(&args)
    }

    fn uninstall(&self) -> Run {
        let mut args = vec!["uninstall".to_owned()];
        args.extend(self.dirs());
        cli(&args)
    }

    /// Every file under `conf/` and `bin/` with its bytes.
    fn snapshot(&self) -> Vec<(PathBuf, Vec<u8>)> {
        let mut files = Vec::new();
        for dir in [self.bin(), self.conf()] {
            for entry in fs::read_dir(dir).unwrap() {
                let path = entry.unwrap().path();
                files.push((path.clone(), fs::read(&path).unwrap()));
            }
        }
        files.sort();
        files
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// Runs the binary with `args` and no CNI variables, as an operator does.
fn cli<S: AsRef<str>>(args: &[S]) -> Run {
    let started = Instant::now();
    let output = Command::new(npm_cni())
        .env_clear()
        .args(args.iter().map(|a| a.as_ref()))
        .output()
        .unwrap();
    let run = Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).trim().to_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
        elapsed: started.elapsed(),
    };
    assert!(!run.stderr.contains("panicked"), "npm-cni panicked: {}", run.stderr);
    run
}

fn ok(run: &Run) {
    assert_eq!(run.code, 0, "stdout {:?} stderr {:?}", run.stdout, run.stderr);
}

fn failed(run: &Run) -> &str {
    assert_eq!(
        run.code, 1,
        "expected failure; stdout {:?} stderr {:?}",
        run.stdout, run.stderr
    );
    &run.stderr
}

/// A conflist as a primary CNI may write it: tabs, keys in no sorted order, a number spelled its
/// own way, an escape; and a later single-plugin file the runtime does not use.
const PRIMARY: &str = "{\n\t\"name\": \"k8s-pod-network\",\n\t\"cniVersion\": \"1.0.0\",\n\t\"plugins\": [\n\t\t{\n\t\t\t\"type\": \"ptp\",\n\t\t\t\"mtu\": 1.5e3,\n\t\t\t\"ipMasq\": false,\n\t\t\t\"ipam\": {\"type\": \"host-local\", \"subnet\": \"10.244.1.0/24\", \"dataDir\": \"/var/lib/cni/n\\u00e9t\"}\n\t\t},\n\t\t{\"type\": \"portmap\", \"capabilities\": {\"portMappings\": true}}\n\t],\n\t\"disableCheck\": false\n}\n";

fn plugins(path: &Path) -> Vec<Value> {
    let value: Value = serde_json::from_slice(&fs::read(path).unwrap()).unwrap();
    value["plugins"].as_array().unwrap().clone()
}

#[test]
fn install_twice_then_uninstall_gives_back_the_original_bytes() {
    let node = Node::new("install-twice");
    let conflist = node.write_conf("10-ptp.conflist", PRIMARY);
    node.write_conf(
        "99-loopback.conf",
        r#"{"cniVersion":"1.0.0","name":"lo","type":"loopback"}"#,
    );

    let run = node.install(&[]);
    ok(&run);
    assert!(
        run.stdout.contains("created") && run.stdout.contains("10-ptp.conflist updated"),
        "{}",
        run.stdout
    );
    let binary = node.bin().join("npm-cni");
    assert_eq!(
        fs::read(&binary).unwrap(),
        fs::read(npm_cni()).unwrap(),
        "a copy of itself"
    );
    assert_eq!(fs::metadata(&binary).unwrap().permissions().mode() & 0o777, 0o755);
    let installed = fs::read_to_string(&conflist).unwrap();
    let plugins = plugins(&conflist);
    assert_eq!(plugins.len(), 3);
    assert_eq!(
        plugins[2],
        json!({"type": "npm-cni", "agentSocket": "/run/npm/cni.sock", "timeoutSeconds": 10, "failOpen": false})
    );
    // The primary plugins' text, key order and all, is untouched: only the entry is new.
    let last_primary_end = PRIMARY.find("true}}").unwrap() + "true}}".len();
    assert!(installed.starts_with(&PRIMARY[..last_primary_end]), "{installed}");
    assert!(installed.ends_with(&PRIMARY[last_primary_end..]), "{installed}");
    assert_eq!(
        &installed[last_primary_end..installed.len() - (PRIMARY.len() - last_primary_end)],
        ",\n\t\t{\"type\":\"npm-cni\",\"agentSocket\":\"/run/npm/cni.sock\",\"timeoutSeconds\":10,\"failOpen\":false}"
    );
    assert_eq!(
        fs::read_to_string(node.conf().join("99-loopback.conf")).unwrap(),
        r#"{"cniVersion":"1.0.0","name":"lo","type":"loopback"}"#
    );

    // Again: nothing is rewritten.
    let inodes = (
        fs::metadata(&binary).unwrap().ino(),
        fs::metadata(&conflist).unwrap().ino(),
    );
    let before = node.snapshot();
    let run = node.install(&[]);
    ok(&run);
    assert!(
        run.stdout.contains("unchanged; conflist") && run.stdout.ends_with(")"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("10-ptp.conflist unchanged"), "{}", run.stdout);
    assert_eq!(node.snapshot(), before);
    assert_eq!(
        inodes,
        (
            fs::metadata(&binary).unwrap().ino(),
            fs::metadata(&conflist).unwrap().ino()
        )
    );

    let run = node.uninstall();
    ok(&run);
    assert!(run.stdout.contains("removed from 1 conflist"), "{}", run.stdout);
    assert_eq!(
        fs::read_to_string(&conflist).unwrap(),
        PRIMARY,
        "uninstall restores the bytes"
    );
    assert!(!binary.exists());
    let run = node.uninstall();
    ok(&run);
    assert!(
        run.stdout
            .contains("removed from 0 conflist(s); binary was not installed"),
        "{}",
        run.stdout
    );
    assert_eq!(fs::read_to_string(&conflist).unwrap(), PRIMARY);
    // No temporary file is left behind.
    assert_eq!(fs::read_dir(node.conf()).unwrap().count(), 2);
    assert_eq!(fs::read_dir(node.bin()).unwrap().count(), 0);
}

#[test]
fn install_updates_changed_values_in_place_and_keeps_the_entry_last() {
    let node = Node::new("install-update");
    let conflist = node.write_conf("05-primary.conflist", PRIMARY);
    fs::set_permissions(&conflist, fs::Permissions::from_mode(0o600)).unwrap();
    ok(&node.install(&[]));
    let run = node.install(&["--socket", "/run/other/cni.sock", "--timeout-seconds=3", "--fail-open"]);
    ok(&run);
    assert!(
        run.stdout.contains("conflist") && run.stdout.contains("updated"),
        "{}",
        run.stdout
    );
    let plugins_now = plugins(&conflist);
    assert_eq!(plugins_now.len(), 3);
    assert_eq!(
        plugins_now[2],
        json!({"type": "npm-cni", "agentSocket": "/run/other/cni.sock", "timeoutSeconds": 3, "failOpen": true})
    );
    assert_eq!(
        fs::metadata(&conflist).unwrap().permissions().mode() & 0o777,
        0o600,
        "the primary CNI's permissions are kept"
    );

    // The primary CNI (or an operator) put a plugin after npm-cni, and a key of its own in the
    // entry: the entry is moved last, with that key, and holds the new values.
    let text = fs::read_to_string(&conflist).unwrap().replace(
        "\"failOpen\":true}",
        "\"failOpen\":true,\"note\":\"kept\"},\n\t\t{\"type\": \"bandwidth\"}",
    );
    fs::write(&conflist, &text).unwrap();
    ok(&node.install(&["--timeout-seconds", "4"]));
    let types: Vec<Value> = plugins(&conflist).iter().map(|p| p["type"].clone()).collect();
    assert_eq!(types, ["ptp", "portmap", "bandwidth", "npm-cni"]);
    assert_eq!(
        plugins(&conflist)[3],
        json!({"type": "npm-cni", "agentSocket": "/run/npm/cni.sock", "timeoutSeconds": 4, "failOpen": false, "note": "kept"})
    );
    ok(&node.uninstall());
    let types: Vec<Value> = plugins(&conflist).iter().map(|p| p["type"].clone()).collect();
    assert_eq!(types, ["ptp", "portmap", "bandwidth"]);

    // --source: another binary is copied; then this one replaces it.
    let other = Path::new(CNI_BIN).join("loopback");
    let binary = node.bin().join("npm-cni");
    ok(&node.install(&["--source", other.to_str().unwrap()]));
    assert_eq!(fs::read(&binary).unwrap(), fs::read(&other).unwrap());
    let run = node.install(&[]);
    ok(&run);
    assert!(run.stdout.contains("npm-cni updated"), "{}", run.stdout);
    assert_eq!(fs::read(&binary).unwrap(), fs::read(npm_cni()).unwrap());
    assert!(fs::read_to_string(&conflist)
        .unwrap()
        .starts_with(&PRIMARY[..PRIMARY.find("\n\t],").unwrap()]));
}

#[test]
fn a_symlinked_conflist_stays_a_link() {
    let node = Node::new("install-link");
    let real = node.root.join("managed.conflist");
    fs::write(&real, PRIMARY).unwrap();
    let link = node.conf().join("10-linked.conflist");
    std::os::unix::fs::symlink(&real, &link).unwrap();
    ok(&node.install(&[]));
    assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(plugins(&real)[2]["type"], "npm-cni");
    ok(&node.uninstall());
    assert!(fs::symlink_metadata(&link).unwrap().file_type().is_symlink());
    assert_eq!(fs::read_to_string(&real).unwrap(), PRIMARY);
}

#[test]
fn a_single_plugin_conf_is_refused_naming_the_file() {
    let node = Node::new("install-conf");
    let conf = node.write_conf(
        "10-bridge.conf",
        r#"{"cniVersion":"1.0.0","name":"br","type":"bridge","ipam":{"type":"host-local","subnet":"10.9.0.0/16"}}"#,
    );
    let before = node.snapshot();
    let run = node.install(&[]);
    let stderr = failed(&run);
    assert!(stderr.contains(&conf.display().to_string()), "{stderr}");
    assert!(
        stderr.contains("single-plugin") && stderr.contains("conflist"),
        "{stderr}"
    );
    assert_eq!(node.snapshot(), before, "nothing changed, no binary copied");

    // A .conf first by name shadows a conflist (the Multus layout): the runtime uses the .conf.
    node.write_conf("20-calico.conflist", PRIMARY);
    let before = node.snapshot();
    let stderr = failed(&node.install(&[])).to_owned();
    assert!(
        stderr.contains("10-bridge.conf") && stderr.contains("shadows") && stderr.contains("20-calico.conflist"),
        "{stderr}"
    );
    assert_eq!(node.snapshot(), before);
    // A .json file is read as a single plugin by the runtimes as well.
    fs::remove_file(&conf).unwrap();
    node.write_conf("00-x.json", PRIMARY);
    let stderr = failed(&node.install(&[])).to_owned();
    assert!(stderr.contains("00-x.json"), "{stderr}");
}

#[test]
fn missing_dir_malformed_or_unsupported_conflists_are_clear_errors_and_change_nothing() {
    let node = Node::new("install-bad");
    let missing = node.root.join("nowhere");
    let run = cli(&[
        "install".to_owned(),
        format!("--bin-dir={}", node.bin().display()),
        format!("--conf-dir={}", missing.display()),
    ]);
    let stderr = failed(&run);
    assert!(
        stderr.contains("does not exist") && stderr.contains(&missing.display().to_string()),
        "{stderr}"
    );
    assert_eq!(fs::read_dir(node.bin()).unwrap().count(), 0);

    let stderr = failed(&node.install(&[])).to_owned();
    assert!(
        stderr.contains("no CNI configuration") && stderr.contains("--wait-seconds"),
        "{stderr}"
    );

    for (text, expected) in [
        (
            "{\n  \"cniVersion\": \"1.0.0\",\n  \"plugins\": [\n    {\"type\": \"ptp\",}\n  ]\n}\n",
            "not valid JSON: trailing comma at line 4",
        ),
        (
            r#"{"cniVersion":"1.0.0","name":"n","plugins":{"type":"ptp"}}"#,
            "\"plugins\" is not a list",
        ),
        (
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"ipam":{}}]}"#,
            "has no \"type\"",
        ),
        (
            r#"{"cniVersion":"1.0.0","name":"n","plugins":[{"type":"npm-cni"}]}"#,
            "no plugin besides npm-cni",
        ),
        (
            r#"{"cniVersion":"0.2.0","name":"n","plugins":[{"type":"ptp"}]}"#,
            "cniVersion \"0.2.0\" is not supported",
        ),
    ] {
        let path = node.write_conf("10-bad.conflist", text);
        let before = node.snapshot();
        let stderr = failed(&node.install(&[])).to_owned();
        assert!(stderr.contains(&path.display().to_string()), "{stderr}");
        assert!(stderr.contains(expected), "expected {expected:?} in {stderr}");
        assert_eq!(node.snapshot(), before, "{text}");
    }

    // Usage errors exit 2 and change nothing either.
    let run = node.install(&["--timeout-seconds", "0"]);
    assert_eq!(run.code, 2, "{}", run.stderr);
    assert!(run.stderr.contains("--timeout-seconds must be"), "{}", run.stderr);
}

#[test]
fn install_waits_for_the_primary_cni_to_write_its_conflist() {
    let node = Node::new("install-wait");
    let run = node.install(&["--wait-seconds", "1"]);
    let stderr = failed(&run);
    assert!(stderr.contains("waited 1s"), "{stderr}");
    assert!(
        run.elapsed >= Duration::from_millis(950) && run.elapsed < Duration::from_secs(3),
        "{:?}",
        run.elapsed
    );

    // The conf dir itself may appear late too (a fresh node).
    fs::remove_dir(node.conf()).unwrap();
    let conf = node.conf();
    let writer = thread::spawn(move || {
        thread::sleep(Duration::from_millis(1200));
        fs::create_dir(&conf).unwrap();
        // A primary CNI that writes in place: first a part, then the rest.
        let path = conf.join("10-late.conflist");
        fs::write(&path, &PRIMARY[..40]).unwrap();
        thread::sleep(Duration::from_millis(600));
        fs::write(&path, PRIMARY).unwrap();
    });
    let run = node.install(&["--wait-seconds=20"]);
    writer.join().unwrap();
    ok(&run);
    assert!(run.elapsed >= Duration::from_millis(1700), "{:?}", run.elapsed);
    eprintln!("install found the late conflist after {:?}", run.elapsed);
    assert_eq!(plugins(&node.conf().join("10-late.conflist"))[2]["type"], "npm-cni");
}

/// `install::chained` (what the agent checks every few seconds): true only for the conflist the
/// runtime uses holding the entry with the same values; false once the primary rewrote it or when
/// the values differ; the installer's error without a usable conflist; it writes nothing.
#[test]
fn chained_tells_whether_the_runtimes_conflist_holds_the_entry() {
    let node = Node::new("chained");
    let entry = |fail_open| npm_cni::install::Entry {
        agent_socket: proto::DEFAULT_SOCKET.into(),
        timeout_seconds: 10,
        fail_open,
    };
    let err = npm_cni::install::chained(&node.conf(), &entry(false)).unwrap_err();
    assert!(err.to_string().contains("no CNI configuration"), "{err}");
    let path = node.write_conf("10-primary.conflist", PRIMARY);
    assert_eq!(
        npm_cni::install::chained(&node.conf(), &entry(false)).unwrap(),
        (path.clone(), false)
    );
    ok(&node.install(&[]));
    let before = node.snapshot();
    assert_eq!(
        npm_cni::install::chained(&node.conf(), &entry(false)).unwrap(),
        (path.clone(), true)
    );
    assert_eq!(
        npm_cni::install::chained(&node.conf(), &entry(true)).unwrap(),
        (path.clone(), false)
    );
    assert_eq!(node.snapshot(), before, "chained writes nothing");
    // A conflist sorting first is the one the runtime uses.
    let first = node.write_conf("05-other.conflist", PRIMARY);
    assert_eq!(
        npm_cni::install::chained(&node.conf(), &entry(false)).unwrap(),
        (first, false)
    );
}

#[test]
fn uninstall_cleans_every_conflist_and_succeeds_with_nothing_installed() {
    let node = Node::new("uninstall");
    // Nothing there at all, not even the directories.
    let run = cli(&[
        "uninstall".to_owned(),
        format!("--bin-dir={}", node.root.join("no-bin").display()),
        format!("--conf-dir={}", node.root.join("no-conf").display()),
    ]);
    ok(&run);

    let first = node.write_conf("10-a.conflist", PRIMARY);
    ok(&node.install(&[]));
    let second = node.write_conf(
        "20-b.conflist",
        r#"{"cniVersion":"1.0.0","name":"b","plugins":[{"type":"npm-cni"},{"type":"bridge"},{"type":"npm-cni","failOpen":true}]}"#,
    );
    let broken = node.write_conf("30-c.conflist", "{\"plugins\": [");
    let run = node.uninstall();
    ok(&run);
    assert!(run.stdout.contains("removed from 2 conflist(s)"), "{}", run.stdout);
    assert!(
        run.stderr.contains("30-c.conflist") && run.stderr.contains("left"),
        "{}",
        run.stderr
    );
    assert_eq!(fs::read_to_string(&first).unwrap(), PRIMARY);
    assert_eq!(
        fs::read_to_string(&second).unwrap(),
        r#"{"cniVersion":"1.0.0","name":"b","plugins":[{"type":"bridge"}]}"#
    );
    assert_eq!(fs::read_to_string(&broken).unwrap(), "{\"plugins\": [");
    assert!(!node.bin().join("npm-cni").exists());
}

#[test]
fn help_version_and_usage_errors() {
    let run = cli(&["--help"]);
    ok(&run);
    assert!(
        run.stdout.contains("npm-cni install --bin-dir DIR --conf-dir DIR"),
        "{}",
        run.stdout
    );
    let run = cli(&["--version"]);
    ok(&run);
    assert_eq!(
        run.stdout,
        format!(
            "npm-cni {} (CNI spec versions 0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0)",
            env!("CARGO_PKG_VERSION")
        )
    );
    for args in [&["install"][..], &["frobnicate"], &["uninstall", "--bin-dir", "/b"]] {
        let run = cli(args);
        assert_eq!(run.code, 2, "{args:?}: {}", run.stderr);
        assert!(run.stderr.contains("Usage:"), "{}", run.stderr);
    }
    // Without arguments and without CNI_COMMAND it is still the plugin: a CNI error result.
    let run = exec(npm_cni(), &[], "");
    assert_eq!(run.code, 1);
    assert_eq!(run.json()["code"], 4);
}

/// The plugin binary of `plugin_type` that libcni would run: the first match in `cni_path`.
fn find_plugin(cni_path: &str, plugin_type: &str) -> PathBuf {
    cni_path
        .split(':')
        .map(|dir| Path::new(dir).join(plugin_type))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("{plugin_type} not in CNI_PATH {cni_path}"))
}

#[test]
fn installed_conflist_runs_like_libcni_with_ptp_and_uninstalls_to_the_original() {
    let node = Node::new("install-e2e");
    let mut pod = Pod::unwired("e2e", "1.0.0");
    let original = serde_json::to_string_pretty(&json!({
        "cniVersion": pod.cni_version,
        "name": NETWORK,
        "plugins": [pod.ptp_conf],
    }))
    .unwrap();
    let conflist = node.write_conf("10-ptp.conflist", &original);
    let socket = pod.socket().display().to_string();
    ok(&node.install(&["--socket", &socket, "--timeout-seconds", "2"]));

    let agent = fake_agent(&pod.socket(), 2, |_| {
        Some(proto::encode_response(&Response::ok(Some(7))))
    });
    let cni_path = format!("{}:{CNI_BIN}", node.bin().display());
    let env = |command: &str| {
        let mut env = pod.env(command);
        env.retain(|(k, _)| k != "CNI_PATH");
        env.push(("CNI_PATH".into(), cni_path.clone()));
        env
    };
    let (add_env, del_env) = (env("ADD"), env("DEL"));
    let list: Value = serde_json::from_str(&fs::read_to_string(&conflist).unwrap()).unwrap();
    let plugins = list["plugins"].as_array().unwrap();
    assert_eq!(
        find_plugin(&cni_path, "npm-cni"),
        node.bin().join("npm-cni"),
        "the installed copy runs"
    );
    // ADD: each plugin in order, `prevResult` = the previous plugin's result.
    let mut result: Option<Value> = None;
    for plugin in plugins {
        let binary = find_plugin(&cni_path, plugin["type"].as_str().unwrap());
        let run = exec(&binary, &add_env, &pod.plugin_conf(plugin, result.as_ref()));
        assert_eq!(run.code, 0, "{} ADD: {} {}", binary.display(), run.stdout, run.stderr);
        if result.is_none() {
            // ptp's result, for Pod's own clean-up if an assertion fails below.
            pod.result = run.json();
        }
        result = Some(run.json());
    }
    let result = result.unwrap();
    assert_eq!(result, pod.result, "npm-cni passes ptp's result through unchanged");
    // DEL: in reverse order, each with the cached result as `prevResult`.
    for plugin in plugins.iter().rev() {
        let binary = find_plugin(&cni_path, plugin["type"].as_str().unwrap());
        let run = exec(&binary, &del_env, &pod.plugin_conf(plugin, Some(&result)));
        assert_eq!(
            (run.code, run.stdout.as_str()),
            (0, ""),
            "{} DEL: {}",
            binary.display(),
            run.stderr
        );
    }

    let requests: Vec<Request> = agent
        .join()
        .unwrap()
        .iter()
        .map(|l| proto::decode_request(l).unwrap())
        .collect();
    let Request::Add(add) = &requests[0] else {
        panic!("first request {:?}", requests[0])
    };
    assert_eq!(
        (add.pod.name.as_str(), add.network.as_str()),
        (pod.name.as_str(), NETWORK)
    );
    assert_eq!(add.ips[0].address.to_string(), pod.ip());
    assert_eq!(add.host_interfaces[0].name, pod.host_veth());
    assert!(matches!(&requests[1], Request::Del(d) if d.container_id == pod.container_id));

    ok(&node.uninstall());
    assert_eq!(
        fs::read_to_string(&conflist).unwrap(),
        original,
        "byte-identical after uninstall"
    );
    assert!(!node.bin().join("npm-cni").exists());
}
