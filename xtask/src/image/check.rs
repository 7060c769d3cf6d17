//! `cargo xtask image --check`: the built image run as the cluster would
//! run it (its version, its tools and libraries, the chart's arguments, a
//! conformance smoke test), and the arm64 image under qemu-user.

use super::*;
/// podman's options on this machine: crun rejects the hybrid cgroup layout,
/// and rlimits cannot be raised above the session's.
const PODMAN_RUN: &[&str] = &[
    "run",
    "--rm",
    "--runtime",
    "runc",
    "--ulimit",
    "nofile=4096:4096",
    "--ulimit",
    "nproc=4096:4096",
];

/// Prefix of the containers the image checks start (removed afterwards,
/// and before, when a crashed run left them).
const CONTAINER_PREFIX: &str = "npm-agent-xtask-";

/// The image checks of `cargo xtask test`: the image prints its version,
/// accepts the arguments the chart renders, and runs as the agent of the
/// netns cluster with exactly the chart's capabilities and the DNS
/// learning on (the conformance smoke cases, `default-deny*`, pass with
/// it). Prints `image: N passed, M failed`.
pub fn check(tag: &str, arm64: bool) -> Result<()> {
    remove_leftover_containers();
    let version = version()?;
    let mut passed = 0;
    let mut failed = Vec::new();
    let mut record = |name: &str, res: Result<()>| match res {
        Ok(()) => {
            eprintln!("xtask: image check {name}: ok");
            passed += 1;
        }
        Err(e) => {
            eprintln!("xtask: image check {name}: FAILED: {e:#}");
            failed.push(name.to_string());
        }
    };
    record("version", check_version(tag, &version));
    if arm64 {
        record("arm64", check_arm64(&version));
    }
    record("tools", check_tools(tag));
    record("chart-arguments", check_chart_arguments(tag));
    record("conformance-smoke", check_conformance_smoke(tag));
    remove_leftover_containers();
    println!("image: {passed} passed, {} failed", failed.len());
    if !failed.is_empty() {
        bail!("image checks failed: {}", failed.join(", "));
    }
    Ok(())
}

fn podman(args: &[&str]) -> Result<String> {
    let out = Command::new("podman")
        .args(args)
        .output()
        .context("cannot start podman")?;
    if !out.status.success() {
        bail!(
            "podman {} failed ({}): {}{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim(),
            String::from_utf8_lossy(&out.stdout).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

fn check_version(tag: &str, version: &str) -> Result<()> {
    let mut args = PODMAN_RUN.to_vec();
    args.extend([tag, "--version"]);
    let out = podman(&args)?;
    let want = format!("npm-agent {version}");
    if out.trim() != want {
        bail!("`--version` printed {:?}, expected {want:?}", out.trim());
    }
    // The kubectl plugin runs in the image too (its libraries resolve).
    let mut args = PODMAN_RUN.to_vec();
    args.extend(["--entrypoint", "/usr/bin/kubectl-npm", tag, "--version"]);
    let out = podman(&args)?;
    let want = format!("kubectl-npm {version}");
    if out.trim() != want {
        bail!("`kubectl-npm --version` printed {:?}, expected {want:?}", out.trim());
    }
    Ok(())
}

/// The arm64 image, mounted (`buildah mount`), its executables run under
/// qemu-user with the image as their root (`qemu-aarch64-static -L`, so
/// the loader and every library come from the image: this machine has no
/// arm64 libraries outside the Debian arm64 root): the agent's and the
/// plugin's `--version`, and the image's loader resolving every library
/// of each tool of [`TOOLS`] and each xtables extension. Also checks the
/// agent is an AArch64 executable and the index lists both architectures.
fn check_arm64(version: &str) -> Result<()> {
    let tag = format!("{REPOSITORY}:{version}-arm64");
    let ctr = buildah_out(&["from", "--pull=never", "--arch", "arm64", &tag])?;
    let res = (|| -> Result<()> {
        let mnt = PathBuf::from(buildah_out(&["mount", &ctr])?);
        let header = crate::setup::output(Command::new("readelf").arg("-h").arg(mnt.join("usr/bin/npm-agent")))
            .context("readelf -h on the arm64 agent")?;
        if !header.lines().any(|l| l.contains("Machine:") && l.contains("AArch64")) {
            bail!("the arm64 image's agent is not an AArch64 executable");
        }
        let qemu = |exe: &str, args: &[&str]| -> Result<String> {
            let out = Command::new("qemu-aarch64-static")
                .arg("-L")
                .arg(&mnt)
                .arg(mnt.join(exe.trim_start_matches('/')))
                .args(args)
                .output()
                .context("cannot start qemu-aarch64-static (package qemu-user-static)")?;
            if !out.status.success() {
                bail!(
                    "{exe} {args:?} under qemu-aarch64 failed ({}): {}",
                    out.status,
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
        };
        for (exe, name) in [
            ("/usr/bin/npm-agent", "npm-agent"),
            ("/usr/bin/kubectl-npm", "kubectl-npm"),
        ] {
            let out = qemu(exe, &["--version"])?;
            let want = format!("{name} {version}");
            if out != want {
                bail!("arm64 `{name} --version` printed {out:?}, expected {want:?}");
            }
        }
        // nft and iptables open a netfilter netlink socket before anything
        // else, which qemu-user does not emulate ("Protocol not
        // supported"): the image's own loader lists what each needs
        // instead, failing (127) on a library the image lacks.
        let loader = "/lib/ld-linux-aarch64.so.1";
        let mut listed: Vec<String> = TOOLS.iter().map(|(_, path, _)| path.to_string()).collect();
        listed.extend(
            XTABLES_DIRS
                .iter()
                .filter(|d| d.contains("aarch64"))
                .flat_map(|d| XTABLES_EXTENSIONS.iter().map(move |e| format!("{d}/{e}"))),
        );
        for path in &listed {
            let out = qemu(loader, &["--list", path]).with_context(|| format!("arm64 {path} in the image"))?;
            if out.contains("not found") || !out.contains("libc.so.6") {
                bail!("arm64 {path}: the image's loader listed {out:?}");
            }
        }
        Ok(())
    })();
    let _ = Command::new("buildah").args(["umount", &ctr]).output();
    let _ = Command::new("buildah").args(["rm", &ctr]).output();
    res?;
    let index = buildah_out(&["manifest", "inspect", &format!("{INDEX_REPOSITORY}:{version}")])?;
    let index: serde_json::Value = serde_json::from_str(&index).context("the index's JSON")?;
    let mut arches: Vec<&str> = index["manifests"]
        .as_array()
        .map(|m| {
            m.iter()
                .filter_map(|m| m["platform"]["architecture"].as_str())
                .collect()
        })
        .unwrap_or_default();
    arches.sort_unstable();
    if arches != ["amd64", "arm64"] {
        bail!("the index lists {arches:?}, expected amd64 and arm64");
    }
    Ok(())
}

/// Each tool of [`TOOLS`] runs in the image (its libraries resolve); each
/// path of [`NOT_SHIPPED`] is absent (starting it fails for the missing file).
fn check_tools(tag: &str) -> Result<()> {
    for (name, default, args) in TOOLS {
        let path = which(name).unwrap_or_else(|| PathBuf::from(default));
        let path = path.to_string_lossy();
        let mut run = PODMAN_RUN.to_vec();
        run.extend(["--entrypoint", &path, tag]);
        run.extend(args.iter());
        podman(&run).with_context(|| format!("{name} in the image"))?;
    }
    for path in NOT_SHIPPED {
        let mut run = PODMAN_RUN.to_vec();
        run.extend(["--entrypoint", path, tag]);
        match podman(&run) {
            Ok(out) => bail!("{path} exists in the image and ran: {}", out.trim()),
            Err(e) if missing_executable(&format!("{e:#}"), path) => {}
            Err(e) => bail!("{path}: starting it failed, but not for a missing file: {e:#}"),
        }
    }
    Ok(())
}

/// Whether a container runtime's error says that the entrypoint `path`
/// does not exist (runc: `stat <path>: no such file or directory`; crun:
/// `executable file <path> not found ...: No such file or directory`).
pub(super) fn missing_executable(err: &str, path: &str) -> bool {
    err.contains(path) && err.to_ascii_lowercase().contains("no such file or directory")
}

/// `helm template` with `--set` values, as YAML documents.
fn helm_template(set: &[&str]) -> Result<Vec<serde_yaml::Value>> {
    let mut cmd = Command::new(helm());
    cmd.args(["template", "npm"])
        .arg(root().join("charts/npm-agent"))
        .args(["--namespace", "kube-system"]);
    for s in set {
        cmd.args(["--set", s]);
    }
    let out = cmd.output().context("cannot start helm")?;
    if !out.status.success() {
        bail!("helm template failed: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(serde_yaml::Deserializer::from_str(&text)
        .filter_map(|d| serde::Deserialize::deserialize(d).ok())
        .filter(|v: &serde_yaml::Value| !v.is_null())
        .collect())
}

fn helm() -> PathBuf {
    let local = Path::new("/usr/local/bin/helm");
    if local.exists() {
        local.to_path_buf()
    } else {
        PathBuf::from("helm")
    }
}

/// The agent container of the rendered DaemonSet.
fn agent_container(docs: &[serde_yaml::Value]) -> Result<serde_yaml::Value> {
    docs.iter()
        .filter(|d| d["kind"].as_str() == Some("DaemonSet"))
        .flat_map(|d| {
            d["spec"]["template"]["spec"]["containers"]
                .as_sequence()
                .cloned()
                .unwrap_or_default()
        })
        .find(|c| c["name"].as_str() == Some("agent"))
        .context("the rendered chart has no DaemonSet container named agent")
}

fn strings(v: &serde_yaml::Value) -> Vec<String> {
    v.as_sequence()
        .map(|s| s.iter().filter_map(|x| x.as_str().map(str::to_string)).collect())
        .unwrap_or_default()
}

/// The rendered DaemonSet's command and arguments are accepted by the
/// image's own binary (`run ... --dry-run` validates and exits).
fn check_chart_arguments(tag: &str) -> Result<()> {
    for set in [
        &[][..],
        &["privileged=false"][..],
        &["dataplane=nftables", "cniPreset=calico"][..],
        &["dns.servers={10.96.0.10,fd00:96::a}"][..],
    ] {
        let agent = agent_container(&helm_template(set)?)?;
        let command = strings(&agent["command"]);
        let entry = command.first().context("the agent container has no command")?.clone();
        let mut args: Vec<String> = PODMAN_RUN.iter().map(|s| s.to_string()).collect();
        // NODE_NAME comes from the downward API in the DaemonSet.
        args.extend(["-e".to_string(), "NODE_NAME=node-a".to_string()]);
        args.extend(["--entrypoint".to_string(), entry, tag.to_string()]);
        args.extend(command.iter().skip(1).cloned());
        args.extend(strings(&agent["args"]));
        args.push("--dry-run".into());
        let refs: Vec<&str> = args.iter().map(String::as_str).collect();
        podman(&refs).with_context(|| format!("chart values {set:?}"))?;
    }
    Ok(())
}

/// The capabilities the chart gives an unprivileged agent.
fn chart_capabilities() -> Result<Vec<String>> {
    let agent = agent_container(&helm_template(&["privileged=false"])?)?;
    let caps = strings(&agent["securityContext"]["capabilities"]["add"]);
    if caps.is_empty() {
        bail!("the chart's unprivileged agent has no capabilities listed");
    }
    Ok(caps)
}

/// The conformance smoke cases with the image as the agent, run the way
/// the chart runs it with `privileged=false`: host network, bpffs mounted
/// from the host, exactly the chart's capabilities.
fn check_conformance_smoke(tag: &str) -> Result<()> {
    let caps = chart_capabilities()?;
    let wrapper = root().join("target/image/npm-agent-podman");
    let script = format!(
        "#!/bin/sh\n\
         # The agent image as the chart runs it (written by `cargo xtask image`).\n\
         exec podman {run} --name {prefix}$$ --network host --cap-drop all --cap-add {caps} \\\n  \
         --security-opt seccomp=unconfined --security-opt apparmor=unconfined \\\n  \
         --mount type=bind,src=/sys/fs/bpf,dst=/sys/fs/bpf,bind-propagation=rslave \\\n  \
         -v /tmp:/tmp -e NODE_NAME -e RUST_LOG {tag} \"$@\"\n",
        run = PODMAN_RUN.join(" "),
        prefix = CONTAINER_PREFIX,
        caps = caps.join(","),
    );
    std::fs::write(&wrapper, script)?;
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    // With the DNS learning on: the image's iptables must install its
    // NFQUEUE rules from inside the container (the agent refuses to start
    // otherwise). 198.18.3.3 is the model's z/c; the queue is this check's.
    let queue = format!("--dns-queue={}", 40000 + std::process::id() % 20000);
    let state = format!("/tmp/npm-image-check-dns-{}.json", std::process::id());
    let result = crate::conformance_with(&[
        "--dataplane".into(),
        "ebpf".into(),
        "--filter".into(),
        "default-deny".into(),
        "--agent-bin".into(),
        wrapper.display().to_string(),
        "--agent-arg=--dns-server=198.18.3.3".into(),
        format!("--agent-arg={queue}"),
        format!("--agent-arg=--dns-state-file={state}"),
    ]);
    let _ = std::fs::remove_file(&state);
    result
}

fn remove_leftover_containers() {
    let Ok(out) = podman(&["ps", "-a", "--format", "{{.Names}}"]) else {
        return;
    };
    for name in out.lines().filter(|n| n.starts_with(CONTAINER_PREFIX)) {
        let _ = podman(&["rm", "-f", name]);
    }
}
