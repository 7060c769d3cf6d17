//! The Helm chart `charts/npm-agent`, checked with a real `helm` binary:
//! `helm lint`, and `helm template` whose rendered RBAC and DaemonSet are
//! asserted field by field.
//!
//! helm is found through `$HELM`, else `/usr/local/bin/helm`, else `helm` on
//! `$PATH`; a missing helm fails the test (it is installed by the project's
//! setup).

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_yaml::Value;

fn helm() -> PathBuf {
    if let Some(h) = std::env::var_os("HELM") {
        return PathBuf::from(h);
    }
    let local = Path::new("/usr/local/bin/helm");
    if local.exists() {
        return local.to_path_buf();
    }
    PathBuf::from("helm")
}

pub(crate) fn chart_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../charts/npm-agent")
}

pub(crate) fn run_helm(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(helm()).args(args).output().unwrap_or_else(|e| {
        panic!(
            "cannot run helm ({}): {e}; install it (see the project setup)",
            helm().display()
        )
    });
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub(crate) fn template(set: &[&str]) -> Vec<Value> {
    let chart = chart_dir();
    let mut args = vec!["template", "rel", chart.to_str().unwrap(), "--namespace", "npm-system"];
    for s in set {
        args.push("--set");
        args.push(s);
    }
    let (ok, out, err) = run_helm(&args);
    assert!(ok, "helm template failed: {err}");
    out.split("\n---")
        .filter_map(|d| serde_yaml::from_str::<Value>(d).ok())
        .filter(|v| !v.is_null())
        .collect()
}

/// Whether a rendered object is a Helm hook (not part of the release).
fn is_hook(doc: &Value) -> bool {
    !doc["metadata"]["annotations"]["helm.sh/hook"].is_null()
}

/// The release's objects of `kind` (hooks left out).
pub(crate) fn find<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind) && !is_hook(d))
        .collect()
}

/// The hook objects of `kind`.
fn find_hooks<'a>(docs: &'a [Value], kind: &str) -> Vec<&'a Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some(kind) && is_hook(d))
        .collect()
}

/// The agent DaemonSet's pod spec.
pub(crate) fn agent_pod_spec(docs: &[Value]) -> &Value {
    let ds = find(docs, "DaemonSet");
    assert_eq!(ds.len(), 1, "one agent DaemonSet");
    &ds[0]["spec"]["template"]["spec"]
}

/// The container `name` of a pod spec's `containers` or `initContainers`.
pub(crate) fn container<'a>(spec: &'a Value, list: &str, name: &str) -> Option<&'a Value> {
    spec[list]
        .as_sequence()?
        .iter()
        .find(|c| c["name"].as_str() == Some(name))
}

/// `command` followed by `args` of a rendered container.
fn argv(c: &Value) -> Vec<String> {
    let mut v = strings(&c["command"]);
    v.extend(strings(&c["args"]));
    v
}

/// The command line (`command` + `args`) of the agent container that
/// `helm template` renders with `set`: what the image's own binary must
/// accept.
pub(crate) fn agent_command_line(set: &[&str]) -> Vec<String> {
    let docs = template(set);
    argv(container(agent_pod_spec(&docs), "containers", "agent").expect("agent container"))
}

/// Every command line that `helm template` renders with `set`, hooks
/// included: `(object/container, command + args)` of every container and
/// init container of every DaemonSet and Job.
fn command_lines(set: &[&str]) -> Vec<(String, Vec<String>)> {
    let docs = template(set);
    let mut out = Vec::new();
    for d in &docs {
        if !matches!(d["kind"].as_str(), Some("DaemonSet" | "Job")) {
            continue;
        }
        let spec = &d["spec"]["template"]["spec"];
        for list in ["initContainers", "containers"] {
            for c in spec[list].as_sequence().into_iter().flatten() {
                let name = format!(
                    "{}/{}",
                    d["metadata"]["name"].as_str().unwrap_or_default(),
                    c["name"].as_str().unwrap_or_default()
                );
                out.push((name, argv(c)));
            }
        }
    }
    out
}

/// The volume mount of `c` at `path`, and the host path of its volume.
fn host_mount<'a>(spec: &'a Value, c: &'a Value, path: &str) -> (&'a Value, String) {
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some(path))
        .unwrap_or_else(|| panic!("{path} mounted in {:?}", c["name"]));
    let vol = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap_or_else(|| panic!("volume {:?}", mount["name"]));
    let host = vol["hostPath"]["path"].as_str().expect("a hostPath volume");
    (mount, host.to_string())
}

/// `helm lint` of the chart with `set`.
fn lint(set: &[&str]) {
    let chart = chart_dir();
    let mut args = vec!["lint", chart.to_str().unwrap()];
    for s in set {
        args.push("--set");
        args.push(s);
    }
    let (ok, out, err) = run_helm(&args);
    assert!(ok, "helm lint {set:?} failed:\n{out}\n{err}");
    assert!(out.contains("0 chart(s) failed"), "{set:?}: {out}");
}

/// `helm template` with `set` fails with a message containing `want`.
fn rejected(set: &[&str], want: &str) {
    let chart = chart_dir();
    let mut args = vec!["template", "rel", chart.to_str().unwrap()];
    for s in set {
        args.push("--set");
        args.push(s);
    }
    let (ok, _, err) = run_helm(&args);
    assert!(!ok, "{set:?} must be rejected");
    assert!(err.contains(want), "{set:?}: {err}");
}

/// The CNI presets: (cniPreset, interface pattern, CNI config dir, CNI bin dir).
const PRESETS: &[(&str, Option<&str>, &str, &str)] = &[
    ("", None, "/etc/cni/net.d", "/opt/cni/bin"),
    ("calico", Some("cali*"), "/etc/cni/net.d", "/opt/cni/bin"),
    ("flannel", Some("veth*"), "/etc/cni/net.d", "/opt/cni/bin"),
    ("kindnet", Some("veth*"), "/etc/cni/net.d", "/opt/cni/bin"),
    ("aws-vpc-cni", Some("eni*"), "/etc/cni/net.d", "/opt/cni/bin"),
    ("bridge", Some("veth*"), "/etc/cni/net.d", "/opt/cni/bin"),
    ("ptp", Some("veth*"), "/etc/cni/net.d", "/opt/cni/bin"),
    (
        "k3s",
        Some("veth*"),
        "/var/lib/rancher/k3s/agent/etc/cni/net.d",
        "/var/lib/rancher/k3s/data/cni",
    ),
    ("gke", Some("gke*"), "/etc/cni/net.d", "/home/kubernetes/bin"),
];

/// The agent's capabilities of values.yaml, in order.
const CAPABILITIES: [&str; 5] = ["BPF", "NET_ADMIN", "SYS_ADMIN", "PERFMON", "SYS_RESOURCE"];

fn strings(v: &Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(|x| x.as_str().map(String::from)).collect())
        .unwrap_or_default()
}

#[test]
fn helm_lint_passes() {
    lint(&[]);
    lint(&["privileged=false"]);
    lint(&["privileged=false", "cni.install=false", "cleanupOnUninstall=false"]);
    lint(&[
        "cni.failOpen=true",
        "dataplane=nftables",
        "pinDir=/sys/fs/bpf/npm/custom",
    ]);
    for (preset, ..) in PRESETS {
        let set = format!("cniPreset={preset}");
        lint(&[&set]);
        lint(&[&set, "privileged=false"]);
    }
}

#[test]
fn rbac_is_least_privilege() {
    let docs = template(&[]);
    let (roles, readers): (Vec<&Value>, Vec<&Value>) = find(&docs, "ClusterRole")
        .into_iter()
        .partition(|r| r["metadata"]["name"] == "rel-npm-agent");
    assert_eq!(roles.len(), 1);
    // The metrics reader grants `get` on /metrics and nothing else; it is
    // bound only to the subjects of metrics.readers (none by default).
    assert_eq!(readers.len(), 1);
    assert_eq!(readers[0]["metadata"]["name"], "rel-npm-agent-metrics-reader");
    let reader_rules = readers[0]["rules"].as_sequence().unwrap();
    assert_eq!(reader_rules.len(), 1);
    assert_eq!(strings(&reader_rules[0]["nonResourceURLs"]), ["/metrics"]);
    assert_eq!(strings(&reader_rules[0]["verbs"]), ["get"]);
    assert_eq!(find(&docs, "ClusterRoleBinding").len(), 1);
    let mut granted = Vec::new();
    for rule in roles[0]["rules"].as_sequence().unwrap() {
        assert!(rule["resourceNames"].is_null(), "{rule:?}");
        let mut verbs = strings(&rule["verbs"]);
        verbs.sort();
        for g in strings(&rule["apiGroups"]) {
            for r in strings(&rule["resources"]) {
                granted.push(format!("{g}/{r}: {}", verbs.join(",")));
            }
        }
    }
    granted.sort();
    assert_eq!(
        granted,
        [
            "/events: create,patch",
            "/namespaces: get,list,watch",
            "/nodes: get,list,patch,watch",
            "/pods/status: patch",
            "/pods: get,list,watch",
            "/services: get,list,watch",
            "apiextensions.k8s.io/customresourcedefinitions: get",
            "authentication.k8s.io/tokenreviews: create",
            "authorization.k8s.io/subjectaccessreviews: create",
            "events.k8s.io/events: create,patch",
            "networking.k8s.io/networkpolicies: get,list,watch",
            "policy.networking.k8s.io/clusternetworkpolicies: get,list,watch",
        ],
        "services read (eBPF Service egress), ClusterNetworkPolicies read, CRDs get (what a 404 on CNPs means); \
         no endpointslices, secrets or write access beyond node patch, events and pods/status patch"
    );
    assert!(find(&docs, "Role").is_empty());
    let binding = find(&docs, "ClusterRoleBinding")[0];
    assert_eq!(binding["roleRef"]["name"], roles[0]["metadata"]["name"]);
    let sa = find(&docs, "ServiceAccount")[0];
    assert_eq!(binding["subjects"][0]["name"], sa["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["namespace"].as_str(), Some("npm-system"));
}

#[test]
fn daemonset_essentials() {
    let docs = template(&["dataplane=nftables", "logLevel=debug"]);
    let ds = find(&docs, "DaemonSet");
    assert_eq!(ds.len(), 1);
    let spec = &ds[0]["spec"]["template"]["spec"];
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    let sa = find(&docs, "ServiceAccount")[0];
    assert_eq!(spec["serviceAccountName"], sa["metadata"]["name"]);
    let tolerations = spec["tolerations"].as_sequence().unwrap();
    assert!(
        tolerations
            .iter()
            .any(|t| t["operator"].as_str() == Some("Exists") && t["key"].is_null()),
        "tolerates every taint: {tolerations:?}"
    );
    let c = &spec["containers"][0];
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(true));
    let args = strings(&c["args"]);
    assert_eq!(args[0], "run");
    for want in [
        "--dataplane=nftables",
        "--log-level=debug",
        "--metrics-addr=0.0.0.0:9090",
        "--mass-delete-threshold=0.5",
        "--mass-delete-window-secs=600",
        "--cluster-network-policies=auto",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
    }
    let env = c["env"].as_sequence().unwrap();
    let node = env
        .iter()
        .find(|e| e["name"].as_str() == Some("NODE_NAME"))
        .expect("NODE_NAME env");
    assert_eq!(
        node["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("spec.nodeName")
    );
    assert_eq!(c["readinessProbe"]["httpGet"]["path"].as_str(), Some("/readyz"));
    assert_eq!(c["livenessProbe"]["httpGet"]["path"].as_str(), Some("/healthz"));
    assert_eq!(c["ports"][0]["containerPort"].as_u64(), Some(9090));
    let mount = c["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| m["mountPath"].as_str() == Some("/sys/fs/bpf"))
        .expect("bpffs mounted");
    let vol = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .expect("bpffs volume");
    assert_eq!(vol["hostPath"]["path"].as_str(), Some("/sys/fs/bpf"));
    assert_eq!(mount["mountPropagation"].as_str(), Some("Bidirectional"));
    assert!(args.iter().any(|a| a == "--cni-socket=/run/npm/cni.sock"), "{args:?}");
    let (_, host) = host_mount(spec, c, "/run/npm");
    assert_eq!(host, "/run/npm", "the socket's directory comes from the host");
    assert!(
        !args.iter().any(|a| a.starts_with("--interface-pattern")),
        "no preset, no pattern: {args:?}"
    );
    assert!(find(&docs, "ServiceMonitor").is_empty(), "off by default");
}

#[test]
fn agent_command_line_is_run_with_every_flag() {
    let argv = agent_command_line(&["cniPreset=calico", "allowHostEgress=true"]);
    assert_eq!(argv[..2], ["/usr/bin/npm-agent", "run"]);
    for want in [
        "--dataplane=ebpf",
        "--bpf-object=/usr/lib/npm/npm-ebpf.o",
        "--metrics-addr=0.0.0.0:9090",
        "--page-size=500",
        "--debounce-ms=20",
        "--mass-delete-threshold=0.5",
        "--mass-delete-window-secs=600",
        "--flow-logs-per-sec=10",
        "--rule-metrics-max=1000",
        "--pod-condition-qps=5",
        "--pod-condition-burst=20",
        "--cluster-network-policies=auto",
        "--established=keep",
        "--log-level=info",
        "--log-format=json",
        "--allow-host-egress",
        "--interface-pattern=cali*",
        "--cni-socket=/run/npm/cni.sock",
        "--cni-conf-dir=/host/etc/cni/net.d",
        "--cni-bin-dir=/host/opt/cni/bin",
        "--cni-timeout-seconds=10",
    ] {
        assert!(argv.iter().any(|a| a == want), "{want} in {argv:?}");
    }
    assert_eq!(argv.len(), 2 + 21, "no other flag: {argv:?}");
    assert!(
        !argv.iter().any(|a| a == "--flow-logs-allow"),
        "off by default: {argv:?}"
    );
    let argv = agent_command_line(&["flowLogsAllow=true", "ruleMetricsMax=20", "established=enforce"]);
    for want in ["--flow-logs-allow", "--rule-metrics-max=20", "--established=enforce"] {
        assert!(argv.iter().any(|a| a == want), "{want} in {argv:?}");
    }
}

/// The agent keeps npm-cni chained with the init container's entry (the
/// same socket, timeout and failOpen: the two never rewrite each other's
/// values) in the same host directories; without `cni.install` it does not
/// touch the conflist.
#[test]
fn the_agent_keeps_npm_cni_chained_with_the_init_containers_entry() {
    for set in [
        &[][..],
        &[
            "cni.failOpen=true",
            "cni.timeoutSeconds=7",
            "cni.socket=/var/run/npm/c.sock",
        ][..],
        &["cniPreset=k3s"][..],
    ] {
        let docs = template(set);
        let spec = agent_pod_spec(&docs);
        let init = container(spec, "initContainers", "install-cni").expect("install-cni");
        let agent = container(spec, "containers", "agent").expect("agent");
        let (init_args, agent_args) = (argv(init), argv(agent));
        let value = |args: &[String], flag: &str| {
            args.iter()
                .find_map(|a| a.strip_prefix(&format!("{flag}=")).map(String::from))
                .unwrap_or_else(|| panic!("{flag} in {args:?}"))
        };
        assert_eq!(
            value(&agent_args, "--cni-socket"),
            value(&init_args, "--socket"),
            "{set:?}"
        );
        assert_eq!(
            value(&agent_args, "--cni-timeout-seconds"),
            value(&init_args, "--timeout-seconds"),
            "{set:?}"
        );
        assert_eq!(
            agent_args.iter().any(|a| a == "--cni-fail-open"),
            init_args.iter().any(|a| a == "--fail-open"),
            "{set:?}"
        );
        for (agent_flag, init_flag, path) in [
            ("--cni-conf-dir", "--conf-dir", "/host/etc/cni/net.d"),
            ("--cni-bin-dir", "--bin-dir", "/host/opt/cni/bin"),
        ] {
            assert_eq!(value(&agent_args, agent_flag), path, "{set:?}");
            assert_eq!(value(&init_args, init_flag), path, "{set:?}");
            let (_, agent_host) = host_mount(spec, agent, path);
            let (_, init_host) = host_mount(spec, init, path);
            assert_eq!(agent_host, init_host, "{set:?} {path}");
        }
    }
    let argv = agent_command_line(&["cni.install=false"]);
    assert!(!argv.iter().any(|a| a.starts_with("--cni-conf-dir")), "{argv:?}");
    let (ok, out, err) = dry_run(&["cni.failOpen=true", "cni.timeoutSeconds=7"]);
    assert!(ok, "{err}");
    let config: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["cni_chain"]["conf_dir"], "/host/etc/cni/net.d");
    assert_eq!(config["cni_chain"]["bin_dir"], "/host/opt/cni/bin");
    assert_eq!(config["cni_chain"]["source"], "/usr/bin/npm-cni");
    assert_eq!(config["cni_chain"]["agent_socket"], "/run/npm/cni.sock");
    assert_eq!(config["cni_chain"]["timeout_seconds"], 7);
    assert_eq!(config["cni_chain"]["fail_open"], true);
    let (ok, out, _) = dry_run(&["cni.install=false"]);
    assert!(ok);
    let config: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert!(config["cni_chain"].is_null(), "{config}");
}

/// Runs the image's binary (`target/debug/npm-agent`) with the command
/// line the chart renders for `set`, plus `--dry-run`, as the DaemonSet's
/// environment gives it (`NODE_NAME`): (success, stdout, stderr).
fn dry_run(set: &[&str]) -> (bool, String, String) {
    let argv = agent_command_line(set);
    assert_eq!(argv[0], "/usr/bin/npm-agent");
    let out = Command::new(env!("CARGO_BIN_EXE_npm-agent"))
        .args(&argv[1..])
        .arg("--dry-run")
        .env("NODE_NAME", "node-a")
        .env_remove("KUBECONFIG")
        .output()
        .expect("run npm-agent");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn the_binary_accepts_the_rendered_agent_arguments() {
    for set in [
        &["cniPreset=calico", "allowHostEgress=true"][..],
        &["dataplane=nftables", "pinDir=/sys/fs/bpf/npm/custom", "logFormat=text"][..],
        &[][..],
    ] {
        let (ok, out, err) = dry_run(set);
        assert!(ok, "{set:?}: {err}");
        let config: serde_json::Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
        assert_eq!(config["node_name"], "node-a");
        assert_eq!(config["metrics_addr"], "0.0.0.0:9090");
        assert_eq!(config["cni_socket"], "/run/npm/cni.sock");
        assert_eq!(config["bpf_object"], "/usr/lib/npm/npm-ebpf.o");
    }
    let (_, out, _) = dry_run(&["cniPreset=calico", "allowHostEgress=true"]);
    let config: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["interface_pattern"], "cali*");
    assert_eq!(config["allow_host_egress"], true);
    assert_eq!(config["log_format"], "json");
    assert_eq!(config["cluster_network_policies"], "auto");
    // The default pin directory is the map layout's own.
    let layout = npm_common::maps::LAYOUT_VERSION;
    assert_eq!(config["pin_dir"], format!("/sys/fs/bpf/npm/v{layout}"));
    assert_eq!(
        config["lock_file"],
        format!("/run/npm/agent-sys_fs_bpf_npm_v{layout}.lock")
    );
    let (_, out, _) = dry_run(&["dataplane=nftables", "pinDir=/sys/fs/bpf/npm/custom"]);
    let config: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(config["dataplane"], "nftables");
    assert_eq!(config["pin_dir"], "/sys/fs/bpf/npm/custom");
}

#[test]
fn the_binary_rejects_a_bad_rendered_value() {
    let (ok, _, err) = dry_run(&["massDeleteThreshold=2"]);
    assert!(!ok);
    assert!(err.contains("--mass-delete-threshold must be within 0..1"), "{err}");
    let (ok, _, err) = dry_run(&["interfacePattern=a/b"]);
    assert!(!ok);
    assert!(err.contains("--interface-pattern"), "{err}");
    let (ok, _, err) = dry_run(&["pageSize=0"]);
    assert!(!ok);
    assert!(err.contains("--page-size must be positive"), "{err}");
    let (ok, _, err) = dry_run(&["clusterNetworkPolicies=maybe"]);
    assert!(!ok);
    assert!(err.contains("--cluster-network-policies"), "{err}");
    let (ok, _, err) = dry_run(&["established=sometimes"]);
    assert!(!ok);
    assert!(err.contains("--established"), "{err}");
}

#[test]
fn every_container_runs_the_image_binaries() {
    let lines = command_lines(&["privileged=false"]);
    let names: Vec<&str> = lines.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(
        names,
        [
            "rel-npm-agent/mount-bpffs",
            "rel-npm-agent/install-cni",
            "rel-npm-agent/agent",
            "rel-npm-agent-cleanup/cleanup",
            "rel-npm-agent-cleanup/done",
            "rel-npm-agent-uninstall-stop-agents/stop-agents",
            "rel-npm-agent-uninstall-wait-cleanup/wait-cleanup",
        ]
    );
    for (name, argv) in &lines {
        assert!(
            matches!(argv[0].as_str(), "/usr/bin/npm-agent" | "/usr/bin/npm-cni"),
            "{name}: {argv:?}"
        );
        assert!(argv.len() > 1, "{name} runs a subcommand: {argv:?}");
    }
    let docs = template(&["image.repository=reg.example/npm-agent", "image.tag=1.2.3"]);
    for d in docs
        .iter()
        .filter(|d| matches!(d["kind"].as_str(), Some("DaemonSet" | "Job")))
    {
        let spec = &d["spec"]["template"]["spec"];
        for list in ["initContainers", "containers"] {
            for c in spec[list].as_sequence().into_iter().flatten() {
                assert_eq!(c["image"].as_str(), Some("reg.example/npm-agent:1.2.3"), "{c:?}");
            }
        }
    }
}

#[test]
fn presets_set_interface_pattern_and_cni_paths() {
    for (preset, pattern, conf, bin) in PRESETS {
        let set = format!("cniPreset={preset}");
        let docs = template(&[&set]);
        let spec = agent_pod_spec(&docs);
        let agent = container(spec, "containers", "agent").unwrap();
        let patterns: Vec<String> = strings(&agent["args"])
            .into_iter()
            .filter(|a| a.starts_with("--interface-pattern"))
            .collect();
        let want: Vec<String> = pattern.iter().map(|p| format!("--interface-pattern={p}")).collect();
        assert_eq!(patterns, want, "{preset}");
        let install = container(spec, "initContainers", "install-cni").expect("installer");
        assert_eq!(host_mount(spec, install, "/host/etc/cni/net.d").1, *conf, "{preset}");
        assert_eq!(host_mount(spec, install, "/host/opt/cni/bin").1, *bin, "{preset}");
        let cleanup = find_hooks(&docs, "DaemonSet")[0];
        let cspec = &cleanup["spec"]["template"]["spec"];
        let c = container(cspec, "initContainers", "cleanup").unwrap();
        assert_eq!(host_mount(cspec, c, "/host/etc/cni/net.d").1, *conf, "{preset}");
        assert_eq!(host_mount(cspec, c, "/host/opt/cni/bin").1, *bin, "{preset}");
    }
    // Explicit values win over the preset, each on its own.
    let docs = template(&["cniPreset=k3s", "interfacePattern=lxc*", "cni.binDir=/opt/k3s/bin"]);
    let spec = agent_pod_spec(&docs);
    let agent = container(spec, "containers", "agent").unwrap();
    assert!(strings(&agent["args"]).iter().any(|a| a == "--interface-pattern=lxc*"));
    let install = container(spec, "initContainers", "install-cni").unwrap();
    assert_eq!(host_mount(spec, install, "/host/opt/cni/bin").1, "/opt/k3s/bin");
    assert_eq!(
        host_mount(spec, install, "/host/etc/cni/net.d").1,
        "/var/lib/rancher/k3s/agent/etc/cni/net.d"
    );
    rejected(
        &["cniPreset=cilium"],
        "values.cniPreset must be one of aws-vpc-cni, bridge, calico",
    );
}

#[test]
fn unprivileged_agent_gets_bpffs_from_a_privileged_init_container() {
    let docs = template(&["privileged=false"]);
    let spec = agent_pod_spec(&docs);
    let inits: Vec<&str> = spec["initContainers"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|c| c["name"].as_str().unwrap())
        .collect();
    assert_eq!(inits, ["mount-bpffs", "install-cni"], "bpffs first");
    let mounter = container(spec, "initContainers", "mount-bpffs").unwrap();
    assert_eq!(
        argv(mounter),
        ["/usr/bin/npm-agent", "mount-bpffs", "--path=/sys/fs/bpf"]
    );
    assert_eq!(mounter["securityContext"]["privileged"].as_bool(), Some(true));
    let (m, host) = host_mount(spec, mounter, "/sys/fs/bpf");
    assert_eq!(host, "/sys/fs/bpf");
    assert_eq!(m["mountPropagation"].as_str(), Some("Bidirectional"));

    let agent = container(spec, "containers", "agent").unwrap();
    let sc = &agent["securityContext"];
    assert_eq!(sc["privileged"].as_bool(), Some(false));
    assert_eq!(sc["runAsUser"].as_u64(), Some(0), "capabilities reach root only");
    assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
    assert_eq!(strings(&sc["capabilities"]["add"]), CAPABILITIES, "exactly these");
    assert_eq!(sc["seLinuxOptions"]["type"].as_str(), Some("spc_t"));
    let (m, host) = host_mount(spec, agent, "/sys/fs/bpf");
    assert_eq!(host, "/sys/fs/bpf");
    assert_eq!(m["mountPropagation"].as_str(), Some("HostToContainer"));
    for m in agent["volumeMounts"].as_sequence().unwrap() {
        assert_ne!(m["mountPropagation"].as_str(), Some("Bidirectional"), "{m:?}");
    }
    // Every container but the bpffs mounter is unprivileged.
    for c in spec["initContainers"]
        .as_sequence()
        .unwrap()
        .iter()
        .chain(spec["containers"].as_sequence().unwrap())
    {
        let privileged = c["securityContext"]["privileged"].as_bool();
        let want = c["name"].as_str() == Some("mount-bpffs");
        assert_eq!(privileged, Some(want), "{:?}", c["name"]);
    }
    // A narrower list is taken as it is.
    let docs = template(&["privileged=false", "capabilities={BPF,NET_ADMIN}"]);
    let agent = container(agent_pod_spec(&docs), "containers", "agent").unwrap();
    assert_eq!(
        strings(&agent["securityContext"]["capabilities"]["add"]),
        ["BPF", "NET_ADMIN"]
    );

    // privileged=true: one privileged agent, Bidirectional, no capability list;
    // the mounter still runs first.
    let docs = template(&[]);
    let spec = agent_pod_spec(&docs);
    assert!(container(spec, "initContainers", "mount-bpffs").is_some());
    let agent = container(spec, "containers", "agent").unwrap();
    assert_eq!(agent["securityContext"]["privileged"].as_bool(), Some(true));
    assert!(agent["securityContext"]["capabilities"].is_null());
    let (m, _) = host_mount(spec, agent, "/sys/fs/bpf");
    assert_eq!(m["mountPropagation"].as_str(), Some("Bidirectional"));
}

#[test]
fn npm_cni_installer() {
    let docs = template(&[]);
    let spec = agent_pod_spec(&docs);
    let install = container(spec, "initContainers", "install-cni").expect("installed by default");
    assert_eq!(
        argv(install),
        [
            "/usr/bin/npm-cni",
            "install",
            "--bin-dir=/host/opt/cni/bin",
            "--conf-dir=/host/etc/cni/net.d",
            "--socket=/run/npm/cni.sock",
            "--timeout-seconds=10",
            "--wait-seconds=300",
        ]
    );
    let sc = &install["securityContext"];
    assert_eq!(sc["privileged"].as_bool(), Some(false));
    assert_eq!(strings(&sc["capabilities"]["drop"]), ["ALL"]);
    assert!(sc["capabilities"]["add"].is_null());
    let mounts: Vec<&str> = install["volumeMounts"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|m| m["mountPath"].as_str().unwrap())
        .collect();
    assert_eq!(mounts, ["/host/opt/cni/bin", "/host/etc/cni/net.d"], "nothing else");
    for path in mounts {
        let vol_name = &install["volumeMounts"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|m| m["mountPath"].as_str() == Some(path))
            .unwrap()["name"];
        let vol = spec["volumes"]
            .as_sequence()
            .unwrap()
            .iter()
            .find(|v| &v["name"] == vol_name)
            .unwrap();
        assert_eq!(vol["hostPath"]["type"].as_str(), Some("DirectoryOrCreate"));
    }

    let docs = template(&[
        "cni.failOpen=true",
        "cni.timeoutSeconds=3",
        "cni.socket=/var/run/npmx/agent.sock",
    ]);
    let spec = agent_pod_spec(&docs);
    let install = container(spec, "initContainers", "install-cni").unwrap();
    let args = strings(&install["args"]);
    for want in [
        "--socket=/var/run/npmx/agent.sock",
        "--timeout-seconds=3",
        "--fail-open",
    ] {
        assert!(args.iter().any(|a| a == want), "{want} in {args:?}");
    }
    let agent = container(spec, "containers", "agent").unwrap();
    assert!(strings(&agent["args"])
        .iter()
        .any(|a| a == "--cni-socket=/var/run/npmx/agent.sock"));
    let (_, host) = host_mount(spec, agent, "/var/run/npmx");
    assert_eq!(host, "/var/run/npmx");

    // Without the installer the agent still serves the socket.
    let docs = template(&["cni.install=false"]);
    let spec = agent_pod_spec(&docs);
    assert!(container(spec, "initContainers", "install-cni").is_none());
    let volumes: Vec<&str> = spec["volumes"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|v| v["name"].as_str().unwrap())
        .collect();
    assert!(
        !volumes.contains(&"cni-conf") && !volumes.contains(&"cni-bin"),
        "{volumes:?}"
    );
    let agent = container(spec, "containers", "agent").unwrap();
    assert!(strings(&agent["args"])
        .iter()
        .any(|a| a == "--cni-socket=/run/npm/cni.sock"));
}

#[test]
fn uninstall_runs_cleanup_on_every_node() {
    let docs = template(&["privileged=false", "pinDir=/sys/fs/bpf/npm/custom"]);
    let hooks: Vec<&Value> = docs.iter().filter(|d| is_hook(d)).collect();
    let mut order: Vec<(i64, String)> = hooks
        .iter()
        .map(|h| {
            let a = &h["metadata"]["annotations"];
            assert_eq!(a["helm.sh/hook"].as_str(), Some("pre-delete"), "{h:?}");
            let mut policy: Vec<&str> = a["helm.sh/hook-delete-policy"].as_str().unwrap().split(',').collect();
            policy.sort();
            assert_eq!(policy, ["before-hook-creation", "hook-succeeded"]);
            let w: i64 = a["helm.sh/hook-weight"].as_str().unwrap().parse().unwrap();
            (
                w,
                format!(
                    "{}/{}",
                    h["kind"].as_str().unwrap(),
                    h["metadata"]["name"].as_str().unwrap()
                ),
            )
        })
        .collect();
    order.sort();
    assert_eq!(
        order,
        [
            (-20, "Role/rel-npm-agent-uninstall".to_string()),
            (-20, "RoleBinding/rel-npm-agent-uninstall".to_string()),
            (-20, "ServiceAccount/rel-npm-agent-uninstall".to_string()),
            (-10, "Job/rel-npm-agent-uninstall-stop-agents".to_string()),
            (0, "DaemonSet/rel-npm-agent-cleanup".to_string()),
            (10, "Job/rel-npm-agent-uninstall-wait-cleanup".to_string()),
        ]
    );

    // The hooks' Role: namespaced, the two DaemonSets by name, delete only the agent's.
    let role = find_hooks(&docs, "Role")[0];
    assert_eq!(role["metadata"]["namespace"].as_str(), Some("npm-system"));
    let rules: Vec<String> = role["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| {
            format!(
                "{:?} {:?} {:?} {:?}",
                strings(&r["apiGroups"]),
                strings(&r["resources"]),
                strings(&r["resourceNames"]),
                strings(&r["verbs"])
            )
        })
        .collect();
    assert_eq!(
        rules,
        [
            r#"["apps"] ["daemonsets"] ["rel-npm-agent", "rel-npm-agent-cleanup"] ["get", "list", "watch"]"#,
            r#"["apps"] ["daemonsets"] ["rel-npm-agent"] ["delete"]"#,
            r#"[""] ["pods"] [] ["list"]"#,
        ]
    );
    let binding = find_hooks(&docs, "RoleBinding")[0];
    assert_eq!(binding["roleRef"]["name"], role["metadata"]["name"]);
    assert_eq!(binding["subjects"][0]["name"].as_str(), Some("rel-npm-agent-uninstall"));

    // The Jobs: host network (npm-cni may be chained with no agent to answer it), no privilege.
    let agent_selector = &find(&docs, "DaemonSet")[0]["spec"]["selector"]["matchLabels"];
    let selected_by_agent = |labels: &Value| {
        agent_selector
            .as_mapping()
            .unwrap()
            .iter()
            .all(|(k, v)| &labels[k.as_str().unwrap()] == v)
    };
    for (job, step, ds) in [
        ("rel-npm-agent-uninstall-stop-agents", "stop-agents", "rel-npm-agent"),
        (
            "rel-npm-agent-uninstall-wait-cleanup",
            "wait-cleanup",
            "rel-npm-agent-cleanup",
        ),
    ] {
        let j = find_hooks(&docs, "Job")
            .into_iter()
            .find(|j| j["metadata"]["name"].as_str() == Some(job))
            .unwrap();
        let spec = &j["spec"]["template"]["spec"];
        assert_eq!(spec["serviceAccountName"].as_str(), Some("rel-npm-agent-uninstall"));
        assert_eq!(spec["hostNetwork"].as_bool(), Some(true), "{job}");
        assert_eq!(spec["restartPolicy"].as_str(), Some("Never"));
        assert_eq!(j["spec"]["activeDeadlineSeconds"].as_u64(), Some(180));
        assert!(
            !selected_by_agent(&j["spec"]["template"]["metadata"]["labels"]),
            "{job}"
        );
        let c = &spec["containers"][0];
        assert_eq!(
            argv(c),
            [
                "/usr/bin/npm-agent",
                "uninstall",
                step,
                "--namespace=npm-system",
                &format!("--daemonset={ds}"),
                "--timeout-seconds=120",
            ]
        );
        assert_eq!(c["securityContext"]["runAsNonRoot"].as_bool(), Some(true));
        assert_eq!(strings(&c["securityContext"]["capabilities"]["drop"]), ["ALL"]);
    }

    // The cleanup DaemonSet: the agent's nodes, the agent's privileges, no API access.
    let agent_spec = agent_pod_spec(&docs);
    let ds = find_hooks(&docs, "DaemonSet")[0];
    let spec = &ds["spec"]["template"]["spec"];
    assert!(!selected_by_agent(&ds["spec"]["template"]["metadata"]["labels"]));
    for key in ["tolerations", "nodeSelector", "affinity", "priorityClassName"] {
        assert_eq!(spec[key], agent_spec[key], "{key}");
    }
    assert_eq!(spec["hostNetwork"].as_bool(), Some(true));
    assert_eq!(spec["automountServiceAccountToken"].as_bool(), Some(false));
    let cleanup = container(spec, "initContainers", "cleanup").unwrap();
    assert_eq!(
        argv(cleanup),
        [
            "/usr/bin/npm-agent",
            "cleanup",
            "--pin-dir=/sys/fs/bpf/npm/custom",
            "--cni-conf-dir=/host/etc/cni/net.d",
            "--cni-bin-dir=/host/opt/cni/bin",
        ]
    );
    let agent = container(agent_spec, "containers", "agent").unwrap();
    assert_eq!(cleanup["securityContext"], agent["securityContext"]);
    let (m, host) = host_mount(spec, cleanup, "/sys/fs/bpf");
    assert_eq!(host, "/sys/fs/bpf");
    assert_eq!(m["mountPropagation"].as_str(), Some("HostToContainer"));
    assert_eq!(host_mount(spec, cleanup, "/host/etc/cni/net.d").1, "/etc/cni/net.d");
    assert_eq!(host_mount(spec, cleanup, "/host/opt/cni/bin").1, "/opt/cni/bin");
    let done = container(spec, "containers", "done").unwrap();
    assert_eq!(argv(done), ["/usr/bin/npm-agent", "pause"]);
    assert_eq!(done["securityContext"]["runAsNonRoot"].as_bool(), Some(true));

    // Default pin directory: no --pin-dir; opt-out: no hook at all.
    let docs = template(&["cleanupTimeoutSeconds=30"]);
    let ds = find_hooks(&docs, "DaemonSet")[0];
    let cleanup = container(&ds["spec"]["template"]["spec"], "initContainers", "cleanup").unwrap();
    assert!(!strings(&cleanup["args"]).iter().any(|a| a.starts_with("--pin-dir")));
    let job = find_hooks(&docs, "Job")[0];
    assert!(strings(&job["spec"]["template"]["spec"]["containers"][0]["args"])
        .iter()
        .any(|a| a == "--timeout-seconds=30"));
    let docs = template(&["cleanupOnUninstall=false"]);
    assert!(docs.iter().all(|d| !is_hook(d)), "no hooks when opted out");
}

#[test]
fn capabilities_mode_and_service_monitor() {
    let docs = template(&[
        "privileged=false",
        "serviceMonitor.enabled=true",
        "interfacePattern=veth*",
    ]);
    let ds = find(&docs, "DaemonSet")[0];
    let c = &ds["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["securityContext"]["privileged"].as_bool(), Some(false));
    let caps = strings(&c["securityContext"]["capabilities"]["add"]);
    for cap in ["NET_ADMIN", "BPF", "SYS_ADMIN"] {
        assert!(caps.iter().any(|c| c == cap), "{cap} in {caps:?}");
    }
    assert!(strings(&c["args"]).iter().any(|a| a == "--interface-pattern=veth*"));
    let sm = find(&docs, "ServiceMonitor");
    assert_eq!(sm.len(), 1);
    assert_eq!(sm[0]["spec"]["endpoints"][0]["path"].as_str(), Some("/metrics"));
}

#[test]
fn bad_dataplane_value_is_rejected() {
    let chart = chart_dir();
    let (ok, _, err) = run_helm(&[
        "template",
        "rel",
        chart.to_str().unwrap(),
        "--set",
        "dataplane=iptables",
    ]);
    assert!(!ok);
    assert!(err.contains("values.dataplane must be ebpf or nftables"), "{err}");
}

/// `doc` read as the Kubernetes type `T` and written back is `doc` itself:
/// no field is unknown to the API (a misspelt or misplaced field would be
/// dropped) and every value has the API's type.
fn round_trips<T: serde::de::DeserializeOwned + serde::Serialize>(doc: &Value) {
    let json = serde_json::to_value(doc).unwrap();
    let typed: T = serde_json::from_value(json.clone())
        .unwrap_or_else(|e| panic!("{}: {e}", doc["metadata"]["name"].as_str().unwrap_or_default()));
    assert_eq!(
        serde_json::to_value(&typed).unwrap(),
        json,
        "fields the API does not know"
    );
}

#[test]
fn rendered_objects_match_the_kubernetes_schema() {
    use k8s_openapi::api::{apps::v1::DaemonSet, batch::v1::Job, core::v1, rbac::v1 as rbac};
    for set in [
        &[][..],
        &["privileged=false", "cni.failOpen=true", "cniPreset=k3s"][..],
        &[
            "cni.install=false",
            "pinDir=/sys/fs/bpf/npm/x",
            "serviceMonitor.enabled=true",
            "serviceMonitor.bearerTokenFile=/var/run/secrets/kubernetes.io/serviceaccount/token",
            "nodeRestriction.enabled=true",
            "metrics.readers[0].kind=ServiceAccount",
            "metrics.readers[0].name=prometheus",
            "metrics.readers[0].namespace=monitoring",
        ][..],
    ] {
        let mut kinds = Vec::new();
        for doc in template(set) {
            let kind = doc["kind"].as_str().unwrap().to_string();
            match kind.as_str() {
                "DaemonSet" => round_trips::<DaemonSet>(&doc),
                "Job" => round_trips::<Job>(&doc),
                "Service" => round_trips::<v1::Service>(&doc),
                "ServiceAccount" => round_trips::<v1::ServiceAccount>(&doc),
                "ClusterRole" => round_trips::<rbac::ClusterRole>(&doc),
                "ClusterRoleBinding" => round_trips::<rbac::ClusterRoleBinding>(&doc),
                "Role" => round_trips::<rbac::Role>(&doc),
                "RoleBinding" => round_trips::<rbac::RoleBinding>(&doc),
                "ValidatingAdmissionPolicy" => {
                    round_trips::<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicy>(&doc)
                }
                "ValidatingAdmissionPolicyBinding" => {
                    round_trips::<k8s_openapi::api::admissionregistration::v1::ValidatingAdmissionPolicyBinding>(&doc)
                }
                "ServiceMonitor" => {}
                other => panic!("unexpected kind {other}"),
            }
            kinds.push(kind);
        }
        assert!(kinds.len() >= 10, "{set:?}: {kinds:?}");
    }
}

#[test]
fn bad_cni_and_cleanup_values_are_rejected() {
    rejected(
        &["cni.timeoutSeconds=0"],
        "values.cni.timeoutSeconds must be a positive number",
    );
    rejected(&["cni.socket=/cni.sock"], "values.cni.socket must be an absolute path");
    rejected(
        &["cni.socket=run/cni.sock"],
        "values.cni.socket must be an absolute path",
    );
    rejected(
        &["cleanupTimeoutSeconds=0"],
        "values.cleanupTimeoutSeconds must be a positive number",
    );
}

/// Every `npm_*` metric name in a PromQL expression, with a histogram's
/// `_bucket`/`_sum`/`_count` suffix taken off when the rest is a histogram.
fn metric_names(expr: &str) -> Vec<String> {
    use npm_agent::telemetry::metrics::{Kind, SERIES};
    let bytes = expr.as_bytes();
    let mut names = Vec::new();
    let mut i = 0;
    while let Some(at) = expr[i..].find("npm_").map(|p| p + i) {
        let starts_word = at == 0 || !(bytes[at - 1].is_ascii_alphanumeric() || bytes[at - 1] == b'_');
        let end = expr[at..]
            .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .map_or(expr.len(), |e| at + e);
        if starts_word {
            let name = &expr[at..end];
            let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| {
                let b = name.strip_suffix(s)?;
                SERIES
                    .iter()
                    .any(|x| x.name == b && x.kind == Kind::Histogram)
                    .then_some(b)
            });
            names.push(base.unwrap_or(name).to_string());
        }
        i = end;
    }
    names
}

/// The dashboard is JSON with panels, and every metric it queries (panel
/// targets and template variables) is one the agent exports: the registry's
/// list `SERIES`, which the metrics unit test proves equal to what
/// `/metrics` renders. The ConfigMap ships exactly that file, labelled for
/// Grafana's sidecar, only when `grafanaDashboard.enabled`.
#[test]
fn grafana_dashboard_queries_only_exported_metrics() {
    use npm_agent::telemetry::metrics::SERIES;
    let path = chart_dir().join("dashboards/npm-agent.json");
    let text = std::fs::read_to_string(&path).expect("read the dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let panels = dash["panels"].as_array().expect("panels");
    assert!(panels.len() >= 6, "{} panels", panels.len());
    let mut exprs: Vec<String> = panels
        .iter()
        .flat_map(|p| p["targets"].as_array().cloned().unwrap_or_default())
        .map(|t| t["expr"].as_str().expect("every target has an expr").to_string())
        .collect();
    for v in dash["templating"]["list"].as_array().unwrap() {
        if let Some(q) = v["query"]["query"].as_str() {
            exprs.push(q.to_string());
        }
    }
    let mut queried = std::collections::BTreeSet::new();
    for e in &exprs {
        let names = metric_names(e);
        assert!(!names.is_empty(), "{e:?} queries no npm metric");
        for n in names {
            assert!(
                SERIES.iter().any(|s| s.name == n),
                "{e:?} queries {n}, which the agent does not export"
            );
            queried.insert(n);
        }
    }
    // The series the issue asks the dashboard to show.
    for want in [
        "npm_programming_latency_seconds",
        "npm_packets_total",
        "npm_map_entries",
        "npm_map_capacity",
        "npm_held_removals",
        "npm_ready",
        "npm_ringbuf_events_lost_total",
    ] {
        assert!(queried.contains(want), "the dashboard does not show {want}");
    }
    assert_eq!(
        metric_names("rate(npm_programming_latency_seconds_bucket[1m])"),
        ["npm_programming_latency_seconds"]
    );
    assert_eq!(metric_names("x_npm_ready"), Vec::<String>::new());

    assert!(
        find(&template(&[]), "ConfigMap").is_empty(),
        "no dashboard unless enabled"
    );
    let docs = template(&["grafanaDashboard.enabled=true"]);
    let cms = find(&docs, "ConfigMap");
    assert_eq!(cms.len(), 1);
    assert_eq!(cms[0]["metadata"]["labels"]["grafana_dashboard"].as_str(), Some("1"));
    assert_eq!(cms[0]["metadata"]["namespace"].as_str(), Some("npm-system"));
    let shipped: serde_json::Value =
        serde_json::from_str(cms[0]["data"]["npm-agent.json"].as_str().expect("data")).expect("shipped JSON");
    assert_eq!(shipped, dash, "the ConfigMap carries the dashboard file");
    lint(&["grafanaDashboard.enabled=true"]);
}

/// With `dns.servers`, the agent gets the DNS flags and the host's
/// `/run/xtables.lock` (so that its `iptables -w` and kube-proxy's
/// `iptables-restore` take turns); without, neither.
#[test]
fn dns_learning_mounts_the_host_xtables_lock() {
    let set = ["dns.servers={10.96.0.10}", "dns.minTtlSecs=600", "dns.maxHolds=64"];
    let argv = agent_command_line(&set);
    for want in [
        "--dns-server=10.96.0.10",
        "--dns-queue=20049",
        "--dns-hold-ms=1000",
        "--dns-grace-secs=30",
        "--dns-min-ttl-secs=600",
        "--dns-max-holds=64",
    ] {
        assert!(argv.iter().any(|a| a == want), "{want} in {argv:?}");
    }
    let docs = template(&set);
    let spec = agent_pod_spec(&docs);
    let agent = container(spec, "containers", "agent").expect("the agent container");
    let (_, host) = host_mount(spec, agent, "/run/xtables.lock");
    assert_eq!(host, "/run/xtables.lock");
    let vol = (spec["volumes"].as_sequence().unwrap().iter())
        .find(|v| v["hostPath"]["path"].as_str() == Some("/run/xtables.lock"))
        .unwrap();
    assert_eq!(
        vol["hostPath"]["type"], "FileOrCreate",
        "a missing lock file is created, not a directory"
    );
    let (ok, _, err) = dry_run(&set);
    assert!(ok, "{err}");
    let docs = template(&[]);
    let spec = agent_pod_spec(&docs);
    let agent = container(spec, "containers", "agent").expect("the agent container");
    let mounts = agent["volumeMounts"].as_sequence().unwrap();
    assert!(!mounts.iter().any(|m| m["mountPath"] == "/run/xtables.lock"));
}
