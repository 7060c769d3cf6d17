//! The agent binary as a child process: spawning `npm-agent run` with the
//! eBPF dataplane, and HTTP requests to its metrics/health server.

use std::net::{SocketAddr, TcpListener};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};

pub use npm_testkit::http::http_get;

/// A free local TCP address (port chosen by the kernel).
pub fn free_port() -> SocketAddr {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    l.local_addr().unwrap()
}

/// Spawns `npm-agent run --dataplane ebpf` (node `node-a`, pins in
/// `pin_dir`, the eBPF object `object` if given, interfaces matching
/// `interface_pattern`), logging to `log`, serving metrics on `metrics`.
/// The child gets SIGKILL when the test process dies.
pub fn spawn_agent_run(
    pin_dir: &Path,
    object: Option<&Path>,
    kubeconfig: &Path,
    interface_pattern: &str,
    metrics: SocketAddr,
    log: &Path,
) -> Child {
    spawn_agent_run_with(
        &["--dataplane", "ebpf"],
        pin_dir,
        object,
        kubeconfig,
        interface_pattern,
        metrics,
        log,
    )
}

/// [`spawn_agent_run`] with other dataplane arguments (`dataplane_args`
/// replaces `--dataplane ebpf`, e.g. `--dataplane nftables --nft-table T`).
pub fn spawn_agent_run_with(
    dataplane_args: &[&str],
    pin_dir: &Path,
    object: Option<&Path>,
    kubeconfig: &Path,
    interface_pattern: &str,
    metrics: SocketAddr,
    log: &Path,
) -> Child {
    let out = std::fs::File::create(log).expect("create agent log");
    let err = out.try_clone().unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_npm-agent"));
    cmd.arg("run").args(dataplane_args).arg("--pin-dir").arg(pin_dir);
    if let Some(object) = object {
        cmd.arg("--bpf-object").arg(object);
    }
    cmd.arg("--kubeconfig")
        .arg(kubeconfig)
        .args(["--metrics-addr", &metrics.to_string()])
        // A port of its own (the default would collide between agents).
        .args(["--debug-addr", &free_port().to_string()])
        .args(["--interface-pattern", interface_pattern])
        .args(["--log-level", "info"])
        // No npm-cni socket: the default path is the host's.
        .args(["--cni-socket", ""])
        .env("NODE_NAME", "node-a")
        .env_remove("KUBECONFIG")
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err);
    // SAFETY: prctl is async-signal-safe; it only sets this child's
    // parent-death signal.
    unsafe {
        cmd.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd.spawn().expect("spawn npm-agent run")
}

/// Runs `npm-agent inspect --json --pin-dir <pin_dir>` with `envs` set and
/// parses its output; panics with its stderr if it fails.
pub fn inspect_json(pin_dir: &Path, envs: &[(&str, &std::ffi::OsStr)]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_npm-agent"))
        .args(["inspect", "--json", "--pin-dir"])
        .arg(pin_dir)
        .envs(envs.iter().copied())
        .output()
        .expect("run npm-agent inspect");
    assert!(
        out.status.success(),
        "inspect: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("inspect JSON")
}
